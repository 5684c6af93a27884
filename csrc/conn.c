/* The per-connection protocol, identical for every transport.
 *
 * Two-sided (connector sends, acceptor receives; k-th send matches k-th recv):
 *   sender -> RTS{seq, len, addr}  (eager, len <= 64 KiB: the bytes come with
 *                                   it, behind it on a socket or in a slot)
 *   receiver, once a recv is posted and the RTS is in:
 *     sizes differ      -> NACK{seq, len = posted size}; both sides fail with
 *                          the two sizes, nothing is written
 *     eager             -> copy, FIN
 *     direct transport  -> pull len bytes from addr into the recv buffer, FIN
 *     stream transport  -> CTS{seq}; the sender streams the bytes; every chunk
 *                          is checked against the posted buffer on arrival; FIN
 *   The sender completes on FIN (or fails on NACK).
 * One-sided (connector initiates against a window the acceptor advertised):
 *   WREQ/RREQ{op, window, token, offset, len, addr}; the target checks the
 *   window (its connection, token, range) and holds its region from dereg():
 *     direct write  -> the target pulls into its window, OPDONE{status}
 *     direct read   -> GO{addr}: the initiator pulls into its buffer, RDONE
 *     streamed write-> GO; the initiator streams; the target OPDONEs at the end
 *     streamed read -> the target streams; the initiator completes on the bytes
 *   A refusal is OPDONE{error}.
 * A process only ever writes into its own memory, and only from its own
 * threads, which count themselves in the request's `busy`: after a transfer
 * failed or timed out and its waiter returned, nothing lands in its buffer.
 * Every party finishes its own request before it answers the peer, since
 * the peer may close at once and its BYE must not find that request pending.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "log.h"
#include "sock.h"
#include "status.h"

enum { KEY_SEND = 1, KEY_OP = 2, KEY_LENT = 3 }; /* inflight keys (LENT: a direct read's window) */
enum { JOB_PULL_RECV = 1, JOB_PULL_WRITE, JOB_PULL_READ };

static uint64_t key_of(int kind, uint64_t id) { return ((uint64_t)kind << 56) | (id & ((1ull << 56) - 1)); }
static uint64_t ptr_key(const void *p) { return (uint64_t)(uintptr_t)p; }

/* ------------------------------------------------------------------------- */
/* requests                                                                   */

struct uccl__req *uccl__req_new(int op, struct uccl__conn *c, void *buf, size_t len)
{
    struct uccl__req *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    atomic_init(&r->refs, 1);
    atomic_init(&r->state, UCCL_REQ_PENDING);
    r->op = op;
    r->conn = c;
    r->buf = buf;
    r->len = len;
    uccl__conn_get(c);
    return r;
}

static void req_get(struct uccl__req *r) { atomic_fetch_add(&r->refs, 1); }

void uccl__req_put(struct uccl__req *r)
{
    if (r && atomic_fetch_sub(&r->refs, 1) == 1) {
        uccl__ep_release_hold(r->conn->ep, r->hold);
        uccl__conn_put(r->conn);
        free(r);
    }
}

static void futex_wake_all(atomic_uint *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

/* First caller wins; later calls (a failure racing a success) are ignored. */
void uccl__req_finish(struct uccl__req *r, int status, const char *fmt, ...)
{
    static const unsigned pending = UCCL_REQ_PENDING;
    /* Claim with a private value so the message is written before waiters
     * can see the final state. */
    unsigned expect = pending;
    if (!atomic_compare_exchange_strong(&r->state, &expect, 3u))
        return;
    r->status = status;
    r->msg[0] = '\0';
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->msg, sizeof(r->msg), fmt, ap);
        va_end(ap);
    }
    atomic_store(&r->state, status == UCCL_OK ? UCCL_REQ_DONE : UCCL_REQ_FAILED);
    if (atomic_load(&r->sleepers) > 0) /* a wake is a syscall: only when someone sleeps */
        futex_wake_all(&r->state);
}

/* Spin briefly (the answer often comes within microseconds), then sleep on
 * the state word: a 2-core machine must not lose a core to a waiter. */
int uccl__req_wait(struct uccl__req *r, uint64_t timeout_ns)
{
    uint64_t start = uccl__now_ns();
    uint64_t spin = r->conn->ep->spin_ns < timeout_ns ? r->conn->ep->spin_ns : timeout_ns;
    uccl__conn_drive(r->conn, r, spin);
    for (int i = 0; i < 2000; i++) {
        unsigned s = atomic_load(&r->state);
        if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
            return UCCL_OK;
        if ((i & 63) == 63 && uccl__now_ns() - start > 20000)
            break;
        __asm__ __volatile__("" ::: "memory");
    }
    for (;;) {
        unsigned s = atomic_load(&r->state);
        if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
            return UCCL_OK;
        uint64_t now = uccl__now_ns();
        if (now - start >= timeout_ns)
            return UCCL_INPROGRESS;
        uint64_t left = timeout_ns - (now - start);
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        atomic_fetch_add(&r->sleepers, 1);
        /* finish() stores the state before reading sleepers (both seq_cst):
         * either it sees us or futex_wait sees the new state and returns. */
        syscall(SYS_futex, (uint32_t *)&r->state, FUTEX_WAIT_PRIVATE, s, &ts, NULL, 0);
        atomic_fetch_sub(&r->sleepers, 1);
    }
}

/* ------------------------------------------------------------------------- */
/* connection bookkeeping                                                     */

void uccl__conn_get(struct uccl__conn *c) { atomic_fetch_add(&c->refs, 1); }

void uccl__conn_put(struct uccl__conn *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    if (c->tp && c->tp->conn_free)
        c->tp->conn_free(c);
    if (c->ctrl_fd >= 0)
        close(c->ctrl_fd);
    while (c->rts_head) {
        struct uccl__rts *n = c->rts_head->next;
        free(c->rts_head->data);
        free(c->rts_head);
        c->rts_head = n;
    }
    if (c->erx.rts) {
        free(c->erx.rts->data);
        free(c->erx.rts);
    }
    if (c->erx.direct) {
        atomic_fetch_sub(&c->erx.direct->busy, 1);
        uccl__req_put(c->erx.direct);
    }
    uccl__idmap_free(&c->inflight);
    uccl__idmap_free(&c->rx);
    uccl__idmap_free(&c->pending);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->ctrl_tx_mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->svc_cv);
    pthread_cond_destroy(&c->drv_cv);
    free(c);
}

struct uccl__conn *uccl__conn_new(struct uccl__ep *ep, int is_connector, int ctrl_fd)
{
    struct uccl__conn *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    atomic_init(&c->failed, 0);
    c->ep = ep;
    c->is_connector = is_connector;
    c->ctrl_fd = ctrl_fd;
    c->peer_rank = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->ctrl_tx_mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->svc_cv, NULL);
    pthread_cond_init(&c->drv_cv, NULL);
    return c;
}

/* Remove r from every protocol table and complete it (drops the reference
 * the connection held).  Must be called without c->mu held. */
static void complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *fmt, ...)
{
    char msg[512] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_lock(&c->mu);
    int held = uccl__idmap_del(&c->pending, ptr_key(r)) != NULL;
    uint64_t k1 = r->op == UCCL_OP_SEND ? key_of(KEY_SEND, r->seq)
                : r->op == UCCL_OP_READ_TARGET ? key_of(KEY_LENT, r->seq) : key_of(KEY_OP, r->seq);
    if (uccl__idmap_get(&c->inflight, k1) == r)
        uccl__idmap_del(&c->inflight, k1);
    int dk = r->op == UCCL_OP_RECV ? UCCL_DATA_SEND : r->op == UCCL_OP_READ ? UCCL_DATA_READ
           : r->op == UCCL_OP_WRITE_TARGET ? UCCL_DATA_WRITE : 0;
    if (dk && uccl__idmap_get(&c->rx, key_of(dk, r->seq)) == r)
        uccl__idmap_del(&c->rx, key_of(dk, r->seq));
    if (r->op == UCCL_OP_RECV) { /* unlink from the posted queue */
        struct uccl__req **pp = &c->recv_head, *prev = NULL;
        while (*pp && *pp != r) {
            prev = *pp;
            pp = &(*pp)->next;
        }
        if (*pp) {
            *pp = r->next;
            if (c->recv_tail == r)
                c->recv_tail = prev;
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (!held)
        return;
    uccl__req_finish(r, status, "%s", msg);
    uccl__req_put(r);
}

static void send_simple(struct uccl__conn *c, int type, uint64_t seq, uint64_t len, uint64_t aux);

/* Finish r here, then tell the peer (FIN, NACK, OPDONE).  In that order: once
 * told, the peer may close at once, and its BYE must not find r pending.
 * But finishing r may let our own caller close at once too: `answering`
 * makes that close send its BYE only after this answer (uccl__conn_close),
 * or the peer would find its half of the exchange pending. */
static void answer_after(struct uccl__conn *c, struct uccl__req *r, int type, uint64_t len,
                         int status, const char *why)
{
    uint64_t seq = r->seq;
    atomic_fetch_add(&c->answering, 1);
    complete(c, r, status, why ? "%s" : NULL, why);
    send_simple(c, type, seq, len, type == UCCL_MSG_OPDONE ? (uint64_t)(int64_t)status : 0);
    atomic_fetch_sub(&c->answering, 1);
}

static void describe_peer(struct uccl__conn *c, char *buf, size_t len)
{
    if (c->peer_rank >= 0)
        snprintf(buf, len, "connection %llu to %s:%d (rank %d)", (unsigned long long)c->id,
                 c->peer_ip, c->peer_port, c->peer_rank);
    else
        snprintf(buf, len, "connection %llu to %s:%d", (unsigned long long)c->id, c->peer_ip,
                 c->peer_port);
}

struct fail_ctx { struct uccl__req **v; size_t n; };
static void collect(uint64_t k, void *v, void *arg)
{
    (void)k;
    struct fail_ctx *f = arg;
    req_get(v);
    f->v[f->n++] = v;
}

void uccl__conn_fail(struct uccl__conn *c, int status, const char *fmt, ...)
{
    char why[200], who[120];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    int expect = 0;
    if (atomic_load(&c->closing)) { /* e.g. the peer's EOF answering our BYE */
        status = UCCL_ERR_CLOSED;
        snprintf(why, sizeof(why), "the endpoint was closed");
    }
    pthread_mutex_lock(&c->mu);
    if (!atomic_compare_exchange_strong(&c->failed, &expect, 1)) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    describe_peer(c, who, sizeof(who));
    c->fail_status = status;
    snprintf(c->fail_msg, sizeof(c->fail_msg), "%s failed: %s", who, why);
    struct fail_ctx f = {calloc(c->pending.live + 1, sizeof(void *)), 0};
    if (f.v)
        uccl__idmap_each(&c->pending, collect, &f);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);

    if (c->peer_bye)
        LOG_INFO("%s", c->fail_msg);
    else if (status != UCCL_ERR_CLOSED)
        LOG_WARN("%s", c->fail_msg);
    /* Unblock everything: the service thread's recv, the transport's data
     * threads.  fds stay open until the last reference goes, so no thread
     * ever touches a reused descriptor. */
    /* A close half-closes (our BYE is followed by a FIN; conn_close drains
     * the rest): closing with unread bytes would send an RST, which makes
     * the peer's kernel drop our BYE before its engine reads it. */
    shutdown(c->ctrl_fd, status == UCCL_ERR_CLOSED ? SHUT_WR : SHUT_RDWR);
    if (c->tp && c->tp->conn_shutdown)
        c->tp->conn_shutdown(c);
    for (size_t i = 0; i < f.n; i++) {
        complete(c, f.v[i], status, "%s", c->fail_msg);
        uccl__req_put(f.v[i]);
    }
    free(f.v);
}

/* Write one encoded message on the control channel; caller holds ctrl_tx_mu. */
static int ctrl_write(struct uccl__conn *c, const uint8_t *buf, uint64_t deadline)
{
    if (c->ctrl_shm)
        return c->tp->ctrl_send(c, buf, deadline);
    return uccl__sock_send_all(c->ctrl_fd, buf, UCCL_MSG_SIZE, deadline);
}

int uccl__conn_send_msg(struct uccl__conn *c, const struct uccl__msg *m)
{
    uint8_t buf[UCCL_MSG_SIZE];
    uccl__msg_encode(m, buf);
    pthread_mutex_lock(&c->ctrl_tx_mu);
    int rc = ctrl_write(c, buf, uccl__now_ns() + c->ep->timeout_ns);
    pthread_mutex_unlock(&c->ctrl_tx_mu);
    if (rc)
        uccl__conn_fail(c, rc == UCCL_ERR_TIMEOUT ? rc : UCCL_ERR_IO,
                        "sending a control message: %s", uccl_last_error());
    return rc;
}

static void send_simple(struct uccl__conn *c, int type, uint64_t seq, uint64_t len, uint64_t aux)
{
    struct uccl__msg m = {.type = (uint16_t)type, .seq = seq, .len = len, .aux = aux};
    uccl__conn_send_msg(c, &m);
}

static void run_job(struct uccl__conn *c, struct uccl__job *j);

/* The connection this thread is driving, if any (see uccl__conn_drive). */
static _Thread_local struct uccl__conn *tls_driving;

/* A job that will write into r's buffer marks it busy from now on, so a
 * waiter that gives up cannot return between queueing and copying. */
static int writes_req(int kind) { return kind == JOB_PULL_RECV || kind == JOB_PULL_READ; }

static void job_done(struct uccl__conn *c, struct uccl__job *j)
{
    if (j->busy_held)
        atomic_fetch_sub(&j->req->busy, 1);
    j->busy_held = 0;
    uccl__ep_release_hold(c->ep, j->hold);
    j->hold = NULL;
}

static void push_job(struct uccl__conn *c, int kind, struct uccl__req *r, const struct uccl__msg *m,
                     void *dst, struct uccl__mr *hold)
{
    int busy = r && writes_req(kind);
    if (busy)
        atomic_fetch_add(&r->busy, 1);
    if (tls_driving == c) { /* the waiting caller copies itself: no handoff */
        struct uccl__job j = {.kind = kind, .req = r, .dst = dst, .hold = hold, .busy_held = busy};
        if (m)
            j.msg = *m;
        if (!atomic_load(&c->failed))
            run_job(c, &j);
        job_done(c, &j);
        return;
    }
    struct uccl__job *j = calloc(1, sizeof(*j));
    if (!j) {
        struct uccl__job tmp = {.kind = kind, .req = r, .hold = hold, .busy_held = busy};
        job_done(c, &tmp);
        uccl__conn_fail(c, UCCL_ERR_NOMEM, "out of memory queueing a copy");
        return;
    }
    j->kind = kind;
    j->req = r;
    j->hold = hold;
    j->busy_held = busy;
    if (r)
        req_get(r);
    if (m)
        j->msg = *m;
    j->dst = dst;
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->failed)) { /* the worker may be gone: nobody would run it */
        pthread_mutex_unlock(&c->mu);
        job_done(c, j);
        if (j->req)
            uccl__req_put(j->req);
        free(j);
        return;
    }
    if (c->job_tail)
        c->job_tail->next = j;
    else
        c->job_head = j;
    c->job_tail = j;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------------- */
/* matching on the receiver                                                   */

static void try_match(struct uccl__conn *c)
{
    for (;;) {
        pthread_mutex_lock(&c->mu);
        if (!c->recv_head || !c->rts_head || atomic_load(&c->failed)) {
            pthread_mutex_unlock(&c->mu);
            return;
        }
        struct uccl__req *r = c->recv_head;
        struct uccl__rts *rts = c->rts_head;
        c->recv_head = r->next;
        if (!c->recv_head)
            c->recv_tail = NULL;
        r->next = NULL;
        c->rts_head = rts->next;
        if (!c->rts_head)
            c->rts_tail = NULL;
        int stream = 0;
        if (rts->seq != r->seq) {
            pthread_mutex_unlock(&c->mu);
            uccl__conn_fail(c, UCCL_ERR_PROTO, "message %llu arrived where %llu was expected",
                            (unsigned long long)rts->seq, (unsigned long long)r->seq);
            free(rts);
            return;
        }
        if (rts->len == r->len && r->len > 0 && !c->direct && !rts->eager) {
            uccl__idmap_put(&c->rx, key_of(UCCL_DATA_SEND, r->seq), r);
            stream = 1;
        }
        r->remote_addr = rts->addr;
        r->remote_key = rts->key;
        uint64_t slen = rts->len;
        int eager = rts->eager;
        char *held = rts->data;
        int slot = rts->slot;
        c->eager_held -= held ? rts->len : 0;
        if ((held || slot >= 0) && slen == r->len)
            atomic_fetch_add(&r->busy, 1);
        free(rts);
        pthread_mutex_unlock(&c->mu);

        if (eager && slen == r->len) { /* the bytes are here (in held, or already in r->buf) */
            if (held || slot >= 0) {
                memcpy(r->buf, held ? held : c->tp->eager_slot(c, (unsigned)slot), r->len);
                atomic_fetch_sub(&r->busy, 1);
            }
            free(held);
            answer_after(c, r, UCCL_MSG_FIN, r->len, UCCL_OK, NULL);
            continue;
        }
        free(held);
        if (slen != r->len) {
            char why[300];
            snprintf(why, sizeof(why),
                     "size mismatch on connection %llu, message %llu: the sender sent %llu "
                     "bytes but this recv posted %zu bytes; nothing was written",
                     (unsigned long long)c->id, (unsigned long long)r->seq,
                     (unsigned long long)slen, r->len);
            answer_after(c, r, UCCL_MSG_NACK, r->len, UCCL_ERR_MISMATCH, why);
        } else if (r->len == 0) {
            answer_after(c, r, UCCL_MSG_FIN, 0, UCCL_OK, NULL);
        } else if (stream) {
            send_simple(c, UCCL_MSG_CTS, r->seq, r->len, 0);
        } else {
            push_job(c, JOB_PULL_RECV, r, NULL, NULL, NULL);
        }
    }
}

/* An announced message joins the queue; match it if its recv is posted. */
static void queue_rts(struct uccl__conn *c, struct uccl__rts *rts)
{
    pthread_mutex_lock(&c->mu);
    if (c->rts_tail)
        c->rts_tail->next = rts;
    else
        c->rts_head = rts;
    c->rts_tail = rts;
    pthread_mutex_unlock(&c->mu);
    try_match(c);
}

/* ------------------------------------------------------------------------- */
/* posting (user threads)                                                     */

int uccl__conn_post(struct uccl__conn *c, struct uccl__req *r, int blocking)
{
    if (atomic_load(&c->failed))
        return uccl__err(c->fail_status == UCCL_ERR_CLOSED ? UCCL_ERR_CLOSED : UCCL_ERR_IO,
                         "%s", c->fail_msg);
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->failed)) { /* again under mu: conn_fail collects pending under it */
        pthread_mutex_unlock(&c->mu);
        return uccl__err(c->fail_status == UCCL_ERR_CLOSED ? UCCL_ERR_CLOSED : UCCL_ERR_IO,
                         "%s", c->fail_msg);
    }
    int rc = uccl__idmap_put(&c->pending, ptr_key(r), r);
    if (rc) {
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    req_get(r); /* the pending table's reference */
    pthread_cond_signal(&c->svc_cv); /* answers are coming: the service thread must listen */
    struct uccl__msg m = {0};
    switch (r->op) {
    case UCCL_OP_RECV:
        r->seq = ++c->next_recv_seq;
        if (c->recv_tail)
            c->recv_tail->next = r;
        else
            c->recv_head = r;
        c->recv_tail = r;
        pthread_mutex_unlock(&c->mu);
        if (blocking && !tls_driving) { /* a matching RTS may be in: pull on this thread */
            tls_driving = c;
            try_match(c);
            tls_driving = NULL;
        } else {
            try_match(c);
        }
        return UCCL_OK;
    case UCCL_OP_SEND:
        pthread_mutex_unlock(&c->mu);
        /* seq order must equal wire order: assign under the writer lock. */
        pthread_mutex_lock(&c->ctrl_tx_mu);
        pthread_mutex_lock(&c->mu);
        r->seq = ++c->next_send_seq;
        uccl__idmap_put(&c->inflight, key_of(KEY_SEND, r->seq), r);
        r->eager_slot = -1;
        if (r->len > 0 && r->len <= UCCL_EAGER_MAX && c->eager_inflight < UCCL_EAGER_INFLIGHT) {
            if (!c->ctrl_shm && !c->direct) {
                r->eager = 1; /* bytes follow on the socket */
            } else if (c->ctrl_shm && c->tp->eager_slot) {
                /* a free slot: freed by its own FIN/NACK, which may come out of order */
                for (int i = 0; i < UCCL_EAGER_INFLIGHT && r->eager_slot < 0; i++)
                    if (!(c->eager_slots_busy & (1u << i)))
                        r->eager_slot = i;
                c->eager_slots_busy |= 1u << r->eager_slot;
                r->eager = 1;
            }
        }
        c->eager_inflight += (unsigned)r->eager;
        pthread_mutex_unlock(&c->mu);
        if (r->eager_slot >= 0) /* one copy here beats pinning pages on the other side */
            memcpy(c->tp->eager_slot(c, (unsigned)r->eager_slot), r->buf, r->len);
        m = (struct uccl__msg){.type = UCCL_MSG_RTS, .seq = r->seq, .len = r->len,
                               .addr = (uint64_t)(uintptr_t)r->buf, .window = r->key_for_peer,
                               .offset = r->eager_slot >= 0 ? (uint64_t)r->eager_slot : 0,
                               .aux = !r->eager ? 0 : r->eager_slot >= 0
                                      ? UCCL_MSG_FLAG_EAGER | UCCL_MSG_FLAG_SLOT : UCCL_MSG_FLAG_EAGER};
        uint8_t buf[UCCL_MSG_SIZE];
        uccl__msg_encode(&m, buf);
        uint64_t deadline = uccl__now_ns() + c->ep->timeout_ns;
        rc = r->eager && r->eager_slot < 0
                 ? uccl__sock_send2(c->ctrl_fd, buf, sizeof(buf), r->buf, r->len, deadline)
                 : ctrl_write(c, buf, deadline);
        pthread_mutex_unlock(&c->ctrl_tx_mu);
        if (rc)
            uccl__conn_fail(c, UCCL_ERR_IO, "sending a control message: %s", uccl_last_error());
        return UCCL_OK; /* a failure reaches the request through conn_fail */
    case UCCL_OP_WRITE:
    case UCCL_OP_READ:
        r->seq = ++c->next_op;
        uccl__idmap_put(&c->inflight, key_of(KEY_OP, r->seq), r);
        if (r->op == UCCL_OP_READ && !c->direct && r->len > 0)
            uccl__idmap_put(&c->rx, key_of(UCCL_DATA_READ, r->seq), r);
        pthread_mutex_unlock(&c->mu);
        m = (struct uccl__msg){.type = r->op == UCCL_OP_WRITE ? UCCL_MSG_WREQ : UCCL_MSG_RREQ,
                               .seq = r->seq, .len = r->len,
                               .addr = (uint64_t)(uintptr_t)r->buf, .window = r->fifo.window,
                               .token = r->fifo.token, .offset = 0,
                               .aux = r->op == UCCL_OP_WRITE ? r->key_for_peer : 0};
        uccl__conn_send_msg(c, &m);
        return UCCL_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return uccl__err(UCCL_ERR_INVALID, "unknown operation %d", r->op);
}

/* ------------------------------------------------------------------------- */
/* stream data path (called by transports)                                    */

int uccl__conn_rx_begin(struct uccl__conn *c, int kind, uint64_t id, uint64_t offset,
                        uint64_t len, char **dst_p, struct uccl__req **req_p)
{
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = uccl__idmap_get(&c->rx, key_of(kind, id));
    if (!r) {
        pthread_mutex_unlock(&c->mu);
        return uccl__err(UCCL_ERR_PROTO, "data chunk (kind %d) for transfer %llu that this "
                         "side never accepted", kind, (unsigned long long)id);
    }
    if (offset > r->len || len > r->len - offset) {
        pthread_mutex_unlock(&c->mu);
        return uccl__err(UCCL_ERR_PROTO, "data chunk [%llu, +%llu) outside the %zu-byte "
                         "buffer of transfer %llu", (unsigned long long)offset,
                         (unsigned long long)len, r->len, (unsigned long long)id);
    }
    req_get(r);
    atomic_fetch_add(&r->busy, 1);
    pthread_mutex_unlock(&c->mu);
    *dst_p = r->buf + offset;
    *req_p = r;
    return UCCL_OK;
}

void uccl__conn_rx_end(struct uccl__conn *c, struct uccl__req *r, uint64_t len)
{
    size_t got = atomic_fetch_add(&r->got, len) + len;
    atomic_fetch_sub(&r->busy, 1);
    if (got == r->len) {
        /* A streamed send completes on our FIN, not when its bytes left the
         * sender: the FIN is ordered before any BYE we may send next. */
        if (r->op == UCCL_OP_WRITE_TARGET)
            answer_after(c, r, UCCL_MSG_OPDONE, r->len, UCCL_OK, NULL);
        else if (r->op == UCCL_OP_RECV)
            answer_after(c, r, UCCL_MSG_FIN, r->len, UCCL_OK, NULL);
        else
            complete(c, r, UCCL_OK, NULL);
    } else if (got > r->len) {
        uccl__conn_fail(c, UCCL_ERR_PROTO, "peer sent %zu bytes for a %zu-byte transfer", got,
                        r->len);
    }
    uccl__req_put(r);
}

void uccl__conn_rx_abort(struct uccl__conn *c, struct uccl__req *r)
{
    (void)c;
    atomic_fetch_sub(&r->busy, 1);
    uccl__req_put(r);
}

void uccl__conn_tx_done(struct uccl__conn *c, void *cookie, int status)
{
    struct uccl__req *r = cookie; /* a send completes on the receiver's FIN */
    if (status != UCCL_OK)
        uccl__conn_fail(c, status, "streaming data: %s", uccl_last_error());
    if (r) {
        atomic_fetch_sub(&r->busy, 1);
        uccl__req_put(r);
    }
}

static int stream_out(struct uccl__conn *c, int kind, uint64_t id, const void *src, size_t len,
                      struct uccl__req *r)
{
    if (r) {
        req_get(r); /* the transport's job holds it until tx_done... */
        atomic_fetch_add(&r->busy, 1); /* ...and reads its buffer till then */
    }
    int rc = c->tp->stream(c, kind, id, src, len, r);
    if (rc) {
        if (r) {
            atomic_fetch_sub(&r->busy, 1);
            uccl__req_put(r);
        }
        uccl__conn_fail(c, rc, "queueing data: %s", uccl_last_error());
    }
    return rc;
}

/* ------------------------------------------------------------------------- */
/* the service thread: reads the control socket                               */

static struct uccl__req *inflight_get(struct uccl__conn *c, int k, uint64_t id, int del)
{
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = del ? uccl__idmap_del(&c->inflight, key_of(k, id))
                              : uccl__idmap_get(&c->inflight, key_of(k, id));
    if (r)
        req_get(r);
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* A target-side request: holds the region from dereg() while it runs. */
static struct uccl__req *target_req(struct uccl__conn *c, int op, char *local,
                                    const struct uccl__msg *m, struct uccl__mr *hold)
{
    struct uccl__req *t = uccl__req_new(op, c, local, m->len);
    if (t) {
        t->seq = m->seq;
        t->hold = hold;
    }
    return t;
}

static void on_window_request(struct uccl__conn *c, const struct uccl__msg *m)
{
    int st = UCCL_OK;
    struct uccl__window *w = uccl__ep_window_check(c->ep, c->id, m->window, m->token, m->offset,
                                                   m->len, &st);
    if (!w) {
        LOG_WARN("connection %llu: refused %s of %llu bytes at offset %llu of window %llu: %s",
                 (unsigned long long)c->id, m->type == UCCL_MSG_WREQ ? "write" : "read",
                 (unsigned long long)m->len, (unsigned long long)m->offset,
                 (unsigned long long)m->window, uccl_last_error());
        send_simple(c, UCCL_MSG_OPDONE, m->seq, 0, (uint64_t)(int64_t)st);
        return;
    }
    char *local = (char *)w->addr + m->offset;
    struct uccl__mr *hold = w->mr;
    free(w);
    if (m->len == 0) {
        uccl__ep_release_hold(c->ep, hold);
        send_simple(c, UCCL_MSG_OPDONE, m->seq, 0, UCCL_OK);
        return;
    }
    if (c->direct && m->type == UCCL_MSG_WREQ) { /* we pull the bytes into our window */
        push_job(c, JOB_PULL_WRITE, NULL, m, local, hold);
        return;
    }
    uint64_t key_for_peer = c->direct && c->tp->mem_key && hold
                                ? c->tp->mem_key(c, hold, (uintptr_t)local) : 0;
    struct uccl__req *t = target_req(c, m->type == UCCL_MSG_WREQ ? UCCL_OP_WRITE_TARGET
                                                                 : UCCL_OP_READ_TARGET,
                                     local, m, hold);
    if (!t) {
        uccl__ep_release_hold(c->ep, hold);
        send_simple(c, UCCL_MSG_OPDONE, m->seq, 0, (uint64_t)(int64_t)UCCL_ERR_NOMEM);
        return;
    }
    if (m->type == UCCL_MSG_RREQ && !c->direct) { /* stream it; the job keeps t (and the hold) */
        stream_out(c, UCCL_DATA_READ, m->seq, local, m->len, t);
        uccl__req_put(t);
        return;
    }
    /* Streamed write (bytes land in t), or direct read (the initiator pulls from
     * our window and says RDONE): t waits in pending, failed with the connection. */
    pthread_mutex_lock(&c->mu);
    /* Not after conn_fail collected `pending`: t would never be failed. */
    int ok = !atomic_load(&c->failed) &&
             uccl__idmap_put(&c->pending, ptr_key(t), t) == UCCL_OK; /* takes the creation ref */
    if (ok && m->type == UCCL_MSG_WREQ)
        ok = uccl__idmap_put(&c->rx, key_of(UCCL_DATA_WRITE, t->seq), t) == UCCL_OK;
    else if (ok)
        ok = uccl__idmap_put(&c->inflight, key_of(KEY_LENT, t->seq), t) == UCCL_OK;
    if (!ok)
        uccl__idmap_del(&c->pending, ptr_key(t));
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        uccl__req_put(t); /* releases the hold */
        return;
    }
    struct uccl__msg go = {.type = UCCL_MSG_GO, .seq = m->seq, .len = m->len,
                           .addr = m->type == UCCL_MSG_RREQ ? (uint64_t)(uintptr_t)local : 0,
                           .token = key_for_peer};
    uccl__conn_send_msg(c, &go);
}

static int handle_msg(struct uccl__conn *c, const struct uccl__msg *m)
{
    struct uccl__req *r;
    /* Each type is legal in one direction only: the connector sends RTS,
     * WREQ, RREQ; the acceptor answers. */
    int from_connector = m->type == UCCL_MSG_RTS || m->type == UCCL_MSG_WREQ ||
                         m->type == UCCL_MSG_RREQ || m->type == UCCL_MSG_RDONE;
    if ((m->type <= UCCL_MSG_OPDONE || m->type == UCCL_MSG_RDONE) &&
        from_connector == c->is_connector)
        return uccl__err(UCCL_ERR_PROTO, "control message type %u sent the wrong way", m->type);

    switch (m->type) {
    case UCCL_MSG_RTS: {
        int slot = -1;
        if (m->aux & UCCL_MSG_FLAG_SLOT) {
            if (!c->tp->eager_slot || m->offset >= UCCL_EAGER_INFLIGHT || m->len > UCCL_EAGER_MAX)
                return uccl__err(UCCL_ERR_PROTO, "eager slot %llu / %llu bytes out of range",
                                 (unsigned long long)m->offset, (unsigned long long)m->len);
            slot = (int)m->offset;
        }
        struct uccl__rts *rts = calloc(1, sizeof(*rts));
        if (!rts)
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        *rts = (struct uccl__rts){.seq = m->seq, .len = m->len, .addr = m->addr,
                                  .key = m->window, .eager = slot >= 0, .slot = slot};
        queue_rts(c, rts);
        return UCCL_OK;
    }
    case UCCL_MSG_CTS:
        r = inflight_get(c, KEY_SEND, m->seq, 0); /* stays until FIN */
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "CTS for unknown message %llu",
                             (unsigned long long)m->seq);
        if (m->len != r->len) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "CTS for %llu bytes, message %llu has %zu",
                             (unsigned long long)m->len, (unsigned long long)m->seq, r->len);
        }
        stream_out(c, UCCL_DATA_SEND, r->seq, r->buf, r->len, r);
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_NACK:
    case UCCL_MSG_FIN:
        r = inflight_get(c, KEY_SEND, m->seq, 1);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "%s for unknown message %llu",
                             m->type == UCCL_MSG_FIN ? "FIN" : "NACK", (unsigned long long)m->seq);
        if (r->eager) {
            pthread_mutex_lock(&c->mu);
            c->eager_inflight--;
            if (r->eager_slot >= 0)
                c->eager_slots_busy &= ~(1u << r->eager_slot);
            pthread_mutex_unlock(&c->mu);
        }
        if (m->type == UCCL_MSG_FIN)
            complete(c, r, UCCL_OK, NULL);
        else
            complete(c, r, UCCL_ERR_MISMATCH,
                     "size mismatch on connection %llu, message %llu: this send has %zu bytes "
                     "but the receiver posted %llu bytes; nothing was sent",
                     (unsigned long long)c->id, (unsigned long long)m->seq, r->len,
                     (unsigned long long)m->len);
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_WREQ:
    case UCCL_MSG_RREQ:
        on_window_request(c, m);
        return UCCL_OK;
    case UCCL_MSG_BYE:
        c->peer_bye = 1;
        uccl__conn_fail(c, UCCL_ERR_IO, "the peer closed its endpoint");
        return UCCL_OK;
    case UCCL_MSG_GO:
        r = inflight_get(c, KEY_OP, m->seq, 0);
        if (!r || m->len != r->len || (r->op == UCCL_OP_READ) != (c->direct != 0) ||
            (r->op != UCCL_OP_WRITE && r->op != UCCL_OP_READ)) {
            if (r)
                uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "GO for unknown operation %llu",
                             (unsigned long long)m->seq);
        }
        pthread_mutex_lock(&c->mu);
        int again = r->go_seen;
        r->go_seen = 1;
        pthread_mutex_unlock(&c->mu);
        if (again) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "second GO for operation %llu",
                             (unsigned long long)m->seq);
        }
        if (r->op == UCCL_OP_WRITE) {
            stream_out(c, UCCL_DATA_WRITE, r->seq, r->buf, r->len, r);
        } else { /* direct read: we pull into our own buffer (tracked as busy) */
            r->remote_addr = m->addr;
            r->remote_key = m->token;
            push_job(c, JOB_PULL_READ, r, NULL, NULL, NULL);
        }
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_RDONE:
        r = inflight_get(c, KEY_LENT, m->seq, 1);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "RDONE for unknown read %llu",
                             (unsigned long long)m->seq);
        complete(c, r, UCCL_OK, NULL);
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_OPDONE: {
        r = inflight_get(c, KEY_OP, m->seq, 0);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for unknown operation %llu",
                             (unsigned long long)m->seq);
        int st = (int)(int64_t)m->aux;
        if (st == UCCL_OK && r->op == UCCL_OP_READ && r->len > 0) {
            /* A read of bytes ends when they are here (streamed) or pulled
             * (direct), never on the target's word. */
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for read %llu, which needs no OPDONE",
                             (unsigned long long)m->seq);
        }
        if (st == UCCL_OK && r->op == UCCL_OP_WRITE && r->len > 0 && !c->direct && !r->go_seen) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for write %llu before its GO",
                             (unsigned long long)m->seq);
        }
        if (st == UCCL_OK)
            complete(c, r, UCCL_OK, NULL);
        else
            /* Refused by the target (unknown window, wrong token, out of
             * range): a transfer failure here, whatever the target's reason. */
            complete(c, r, st == UCCL_ERR_ACCESS || st == UCCL_ERR_NOTFOUND ? UCCL_ERR_ACCESS
                                                                            : UCCL_ERR_IO,
                     "the peer refused the %s of %zu bytes on connection %llu: %s",
                     r->op == UCCL_OP_WRITE ? "write" : "read", r->len,
                     (unsigned long long)c->id, uccl_status_str(st));
        uccl__req_put(r);
        return UCCL_OK;
    }
    default:
        if (c->tp->on_msg)
            return c->tp->on_msg(c, m);
        return uccl__err(UCCL_ERR_PROTO, "control message type %u not used by transport %s",
                         m->type, c->tp->name);
    }
}

/* An eager RTS: decide where its bytes go before reading them.  Straight
 * into the posted recv that it will match, if sizes agree; else into a
 * held buffer, within the budget a well-behaved sender never exceeds. */
static void eager_arrived(struct uccl__conn *c);

static int eager_begin(struct uccl__conn *c, const struct uccl__msg *m)
{
    if (c->is_connector || c->ctrl_shm || c->direct)
        return uccl__err(UCCL_ERR_PROTO, "eager message on a connection that does not take them");
    if (m->len > UCCL_EAGER_MAX)
        return uccl__err(UCCL_ERR_PROTO, "eager message of %llu bytes (at most %u)",
                         (unsigned long long)m->len, UCCL_EAGER_MAX);
    struct uccl__rts *rts = calloc(1, sizeof(*rts));
    if (!rts)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *rts = (struct uccl__rts){.seq = m->seq, .len = m->len, .addr = m->addr, .eager = 1,
                              .slot = -1};
    c->erx = (__typeof__(c->erx)){.rts = rts};
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = c->recv_head;
    if (!c->rts_head && r && r->seq == m->seq && r->len == m->len) {
        req_get(r);
        atomic_fetch_add(&r->busy, 1);
        c->erx.direct = r;
        c->erx.dst = r->buf;
    } else if (m->len > 0) {
        if (c->eager_held + m->len > (size_t)UCCL_EAGER_MAX * UCCL_EAGER_INFLIGHT) {
            pthread_mutex_unlock(&c->mu);
            c->erx.rts = NULL;
            free(rts);
            return uccl__err(UCCL_ERR_PROTO, "peer sent more eager bytes than it may have in "
                             "flight (%zu held)", c->eager_held);
        }
        rts->data = malloc(m->len);
        if (!rts->data) {
            pthread_mutex_unlock(&c->mu);
            c->erx.rts = NULL;
            free(rts);
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        }
        c->eager_held += m->len;
        c->erx.dst = rts->data;
    }
    pthread_mutex_unlock(&c->mu);
    if (m->len == 0)
        eager_arrived(c);
    return UCCL_OK;
}

/* End the reader's eager payload: stop writing into the posted recv, if
 * that is where it went, and hand back its RTS.  Reader only. */
static struct uccl__rts *erx_take(struct uccl__conn *c)
{
    struct uccl__rts *rts = c->erx.rts;
    struct uccl__req *direct = c->erx.direct;
    c->erx = (__typeof__(c->erx)){0};
    if (direct) {
        atomic_fetch_sub(&direct->busy, 1);
        uccl__req_put(direct);
    }
    return rts;
}

static void eager_arrived(struct uccl__conn *c)
{
    queue_rts(c, erx_take(c));
}

/* Let go of a half-read eager payload (the connection failed).  Only the
 * reader of the moment calls this, as only it writes there. */
static void erx_drop(struct uccl__conn *c)
{
    struct uccl__rts *rts = erx_take(c);
    if (rts) {
        pthread_mutex_lock(&c->mu);
        c->eager_held -= rts->data ? rts->len : 0;
        pthread_mutex_unlock(&c->mu);
        free(rts->data);
        free(rts);
    }
}

/* Read and handle every whole message available now, without blocking.
 * Only the reader of the moment (driver or service thread) calls this.
 * Returns the number handled, or a negative status. */
static int pump(struct uccl__conn *c)
{
    int handled = 0;
    while (c->ctrl_shm && !atomic_load(&c->failed)) {
        uint8_t buf[UCCL_MSG_SIZE];
        if (!c->tp->ctrl_recv(c, buf))
            return handled;
        struct uccl__msg m;
        int rc = uccl__msg_decode(buf, &m);
        if (rc == UCCL_OK)
            rc = handle_msg(c, &m);
        if (rc)
            return rc;
        handled++;
    }
    while (!atomic_load(&c->failed)) {
        int in_payload = c->erx.rts != NULL;
        char *into = in_payload ? c->erx.dst + c->erx.got : (char *)c->rxbuf + c->rxgot;
        size_t want = in_payload ? c->erx.rts->len - c->erx.got : sizeof(c->rxbuf) - c->rxgot;
        ssize_t n = recv(c->ctrl_fd, into, want, MSG_DONTWAIT);
        if (n == 0)
            return uccl__err(UCCL_ERR_IO, "peer closed the connection");
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return handled;
            return uccl__err(UCCL_ERR_IO, "recv on control socket: %s", strerror(errno));
        }
        if (in_payload) {
            c->erx.got += (size_t)n;
            if (c->erx.got == c->erx.rts->len) {
                eager_arrived(c);
                handled++;
            }
            continue;
        }
        c->rxgot += (size_t)n;
        if (c->rxgot < sizeof(c->rxbuf))
            continue;
        c->rxgot = 0;
        struct uccl__msg m;
        int rc = uccl__msg_decode(c->rxbuf, &m);
        if (rc == UCCL_OK)
            rc = m.type == UCCL_MSG_RTS && (m.aux & UCCL_MSG_FLAG_EAGER) ? eager_begin(c, &m)
                                                                           : handle_msg(c, &m);
        if (rc)
            return rc;
        handled++;
    }
    return handled;
}

static void pump_failed(struct uccl__conn *c, int rc)
{
    uccl__conn_fail(c, rc == UCCL_ERR_NOMEM || rc == UCCL_ERR_IO ? rc : UCCL_ERR_PROTO, "%s",
                    uccl_last_error());
}

/* The service thread reads only while no caller drives the connection. */
static int svc_take_token(struct uccl__conn *c)
{
    pthread_mutex_lock(&c->mu);
    int mine = !c->driver;
    if (mine)
        atomic_store(&c->svc_reading, 1);
    pthread_mutex_unlock(&c->mu);
    return mine;
}

static void svc_give_token(struct uccl__conn *c)
{
    pthread_mutex_lock(&c->mu);
    atomic_store(&c->svc_reading, 0);
    pthread_cond_broadcast(&c->drv_cv);
    pthread_mutex_unlock(&c->mu);
}

static void *service_main(void *arg)
{
    struct uccl__conn *c = arg;
    while (!atomic_load(&c->failed)) {
        pthread_mutex_lock(&c->mu);
        if (c->driver && !c->ctrl_shm) { /* a caller is reading: stay out of its way */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&c->svc_cv, &c->mu, &ts);
            pthread_mutex_unlock(&c->mu);
            continue;
        }
        pthread_mutex_unlock(&c->mu);
        struct pollfd p = {.fd = c->ctrl_fd, .events = POLLIN};
        if (c->ctrl_shm) {
            /* Messages come through shared memory; the socket only carries
             * the peer's death (EOF), which pump() then reports. */
            c->tp->ctrl_wait(c, 100);
            if (poll(&p, 1, 0) > 0) {
                char b;
                ssize_t n = recv(c->ctrl_fd, &b, 1, MSG_DONTWAIT);
                /* Drain what the peer said before it went (its last FIN, its
                 * BYE): the queue and the socket are two channels, so its EOF
                 * can overtake them.  A waiter driving the connection reads
                 * them itself and lets go within its spin budget; wait for
                 * it (bounded) rather than fail a transfer the peer finished. */
                int token = svc_take_token(c);
                for (int i = 0; !token && i < 2000 && !atomic_load(&c->failed); i++) {
                    usleep(50);
                    token = svc_take_token(c);
                }
                if (token) {
                    pump(c);
                    svc_give_token(c);
                }
                uccl__conn_fail(c, UCCL_ERR_IO, "%s", n == 0 ? "peer closed the connection"
                                : "unexpected bytes on the control socket");
                break;
            }
        } else if (poll(&p, 1, 100) <= 0) {
            continue;
        }
        if (!svc_take_token(c))
            continue;
        int rc = pump(c);
        if (rc < 0)
            pump_failed(c, rc);
        if (atomic_load(&c->failed))
            erx_drop(c); /* still the reader */
        svc_give_token(c);
        if (rc < 0)
            break;
    }
    /* Leaving: drop a half-read payload unless a driver reads (it drops it). */
    if (svc_take_token(c)) {
        erx_drop(c);
        svc_give_token(c);
    }
    return NULL;
}

/* Drive c from the calling thread until r finishes or budget_ns passes.
 * Returns at once if another thread already drives c. */
int uccl__conn_drive_begin(struct uccl__conn *c)
{
    if (!c->started || tls_driving)
        return 0;
    pthread_mutex_lock(&c->mu);
    if (c->driver || atomic_load(&c->failed)) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    c->driver = 1; /* from now on the service thread starts no new pump() */
    pthread_mutex_unlock(&c->mu);
    /* It may be finishing one: a pump of what is queued is short, so spin
     * rather than sleep (a wake-up costs tens of microseconds on a busy
     * 2-core machine); sleep only if it takes unusually long. */
    for (unsigned i = 0; atomic_load(&c->svc_reading); i++) {
        if (i > 20000) {
            pthread_mutex_lock(&c->mu);
            while (atomic_load(&c->svc_reading))
                pthread_cond_wait(&c->drv_cv, &c->mu);
            pthread_mutex_unlock(&c->mu);
            break;
        }
        __asm__ __volatile__("" ::: "memory");
    }
    if (c->ctrl_shm)
        c->tp->ctrl_driving(c, 1);
    return 1;
}

int uccl__conn_drive_pump(struct uccl__conn *c, int inline_copies)
{
    if (atomic_load(&c->failed))
        return -1;
    tls_driving = inline_copies ? c : NULL; /* NULL: copies go to the worker */
    int rc = pump(c);
    tls_driving = NULL;
    if (rc < 0)
        pump_failed(c, rc);
    return rc;
}

void uccl__conn_drive_end(struct uccl__conn *c)
{
    if (atomic_load(&c->failed))
        erx_drop(c); /* still the reader */
    pthread_mutex_lock(&c->mu);
    c->driver = 0;
    if (c->ctrl_shm)
        c->tp->ctrl_driving(c, 0);
    if (c->pending.live > 0) /* still waiting for answers: the service thread takes over */
        pthread_cond_signal(&c->svc_cv);
    pthread_mutex_unlock(&c->mu);
}

void uccl__conn_drive(struct uccl__conn *c, struct uccl__req *r, uint64_t budget_ns)
{
    if (!uccl__conn_drive_begin(c))
        return;
    uint64_t start = uccl__now_ns();
    for (unsigned i = 0;; i++) {
        unsigned s = atomic_load(&r->state);
        if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED || uccl__conn_drive_pump(c, 1) < 0)
            break;
        if ((i & 15) == 15 && uccl__now_ns() - start > budget_ns)
            break;
    }
    uccl__conn_drive_end(c);
}

/* ------------------------------------------------------------------------- */
/* the worker thread: direct copies on the acceptor side                      */

static void run_job(struct uccl__conn *c, struct uccl__job *j)
{
    int rc;
    struct uccl__req *r = j->req;
    switch (j->kind) {
    case JOB_PULL_RECV:
    case JOB_PULL_READ:
        if (atomic_load(&r->state) != UCCL_REQ_PENDING)
            break; /* already finished or failed: its buffer is not ours to fill */
        rc = c->tp->pull(c, r->buf, r->local_key, r->remote_addr, r->remote_key, r->len);
        if (rc) {
            uccl__conn_fail(c, rc, "copying %s %llu from the peer: %s",
                            j->kind == JOB_PULL_RECV ? "message" : "read",
                            (unsigned long long)r->seq, uccl_last_error());
            break;
        }
        job_done(c, j); /* done writing into r: only then may it complete */
        answer_after(c, r, j->kind == JOB_PULL_RECV ? UCCL_MSG_FIN : UCCL_MSG_RDONE, r->len,
                     UCCL_OK, NULL);
        break;
    case JOB_PULL_WRITE:
        rc = c->tp->pull(c, j->dst, j->hold ? j->hold->tp_key[c->tp->id] : 0, j->msg.addr,
                         j->msg.aux, j->msg.len);
        if (rc)
            LOG_WARN("connection %llu: one-sided copy failed: %s", (unsigned long long)c->id,
                     uccl_last_error());
        send_simple(c, UCCL_MSG_OPDONE, j->msg.seq, j->msg.len, (uint64_t)(int64_t)rc);
        break;
    }
}

static void *worker_main(void *arg)
{
    struct uccl__conn *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (!c->job_head && !atomic_load(&c->failed))
            pthread_cond_wait(&c->cv, &c->mu);
        struct uccl__job *j = c->job_head;
        if (j) {
            c->job_head = j->next;
            if (!c->job_head)
                c->job_tail = NULL;
        }
        pthread_mutex_unlock(&c->mu);
        if (!j)
            break; /* failed and drained */
        if (!atomic_load(&c->failed))
            run_job(c, j);
        job_done(c, j);
        if (j->req)
            uccl__req_put(j->req);
        free(j);
    }
    return NULL;
}

int uccl__conn_start(struct uccl__conn *c)
{
    /* Under mu against a close racing the start: either the close sees
     * started and joins, or the start sees failed and starts nothing. */
    pthread_mutex_lock(&c->mu);
    int rc = atomic_load(&c->failed) ? uccl__err(UCCL_ERR_CLOSED, "the endpoint was closed")
           : c->tp->conn_start ? c->tp->conn_start(c) : UCCL_OK;
    if (rc == UCCL_OK && pthread_create(&c->svc_thread, NULL, service_main, c))
        rc = uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    if (rc == UCCL_OK && pthread_create(&c->worker_thread, NULL, worker_main, c)) {
        atomic_store(&c->failed, 1);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->svc_thread, NULL);
        return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    }
    c->started = rc == UCCL_OK;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Endpoint close: fail what is pending, stop the threads.  The memory goes
 * with the last reference. */
void uccl__conn_close(struct uccl__conn *c)
{
    atomic_store(&c->closing, 1);
    /* Answers already owed go first (answer_after); bounded: 100 ms. */
    for (int i = 0; i < 2000 && atomic_load(&c->answering) > 0; i++)
        usleep(50);
    if (!atomic_load(&c->failed) && c->started) {
        /* Tell the peer this is a close, not a crash; never wait long for it. */
        struct uccl__msg m = {.type = UCCL_MSG_BYE};
        uint8_t buf[UCCL_MSG_SIZE];
        uccl__msg_encode(&m, buf);
        pthread_mutex_lock(&c->ctrl_tx_mu);
        ctrl_write(c, buf, uccl__now_ns() + 100000000ull);
        pthread_mutex_unlock(&c->ctrl_tx_mu);
    }
    uccl__conn_fail(c, UCCL_ERR_CLOSED, "the endpoint was closed");
    pthread_mutex_lock(&c->mu); /* pairs with conn_start */
    pthread_mutex_unlock(&c->mu);
    if (c->started) {
        pthread_join(c->svc_thread, NULL);
        pthread_join(c->worker_thread, NULL);
        c->started = 0;
    }
    /* Read what the peer still sends until its FIN (it answers our BYE by
     * closing), bounded, so that our close() sends no RST. */
    uint64_t deadline = uccl__now_ns() + 100000000ull;
    for (;;) {
        uint64_t now = uccl__now_ns();
        struct pollfd p = {.fd = c->ctrl_fd, .events = POLLIN};
        if (now >= deadline || poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1) <= 0)
            break;
        char sink[512];
        ssize_t n = recv(c->ctrl_fd, sink, sizeof(sink), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
            break;
    }
    if (c->tp && c->tp->conn_destroy)
        c->tp->conn_destroy(c);
}
