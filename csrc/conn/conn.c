/* A connection and its requests (conn.h), what the rest of the layer
 * stands on: references, failure, the control channel's writes, and
 * requests made, finished and answered.
 *
 * The two hold each other: a request holds its connection, and a failing
 * connection finishes every request still pending on it.  Nothing here
 * reads the control channel or makes a copy (progress.c, worker.c): this
 * file calls only the layers below and the transport's ops. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "conn/conn.h"
#include "base/log.h"
#include "base/ptracer.h"
#include "net/sock.h"
#include "base/status.h"

static uint64_t key_of(int kind, uint64_t id) { return uccl__proto_key(kind, id); }

/* ------------------------------------------------------------------------- */
/* connection bookkeeping                                                     */

void uccl__conn_free_held(struct uccl__conn *c)
{
    pthread_mutex_lock(&c->mu);
    for (struct uccl__rts *rts; (rts = STAILQ_FIRST(&c->rtsq));) {
        STAILQ_REMOVE_HEAD(&c->rtsq, link);
        free(rts->data);
        free(rts);
    }
    c->rtsq_len = 0;
    c->eager_held = 0;
    struct uccl__rts *erx = c->erx.rts;
    struct uccl__req *direct = c->erx.direct;
    c->erx.rts = NULL;
    c->erx.direct = NULL;
    /* Tables left empty by the failure: their arrays go too (an empty map
     * stays usable, should a late request still look). */
    if (c->pending.live == 0)
        uccl__idmap_free(&c->pending);
    if (c->inflight.live == 0)
        uccl__idmap_free(&c->inflight);
    if (c->rx.live == 0)
        uccl__idmap_free(&c->rx);
    pthread_mutex_unlock(&c->mu);
    if (erx) {
        free(erx->data);
        free(erx);
    }
    if (direct) {
        atomic_fetch_sub(&direct->busy, 1);
        uccl__req_put(direct);
    }
}

void uccl__conn_get(struct uccl__conn *c) { atomic_fetch_add(&c->refs, 1); }

void uccl__conn_put(struct uccl__conn *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    if (c->link.tp && c->link.tp->conn_free)
        c->link.tp->conn_free(&c->link);
    if (c->link.ptracer_pid) /* the peer copies our memory no more */
        uccl__ptracer_release(c->link.ptracer_pid);
    if (c->ctrl_fd >= 0)
        close(c->ctrl_fd);
    uccl__conn_free_held(c);
    uccl__idmap_free(&c->inflight);
    uccl__idmap_free(&c->rx);
    uccl__idmap_free(&c->pending);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->ctrl_tx_mu);
    pthread_mutex_destroy(&c->close_mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->svc_cv);
    pthread_cond_destroy(&c->drv_cv);
    free(c);
}

struct uccl__conn *uccl__conn_new(struct uccl__local *loc, int is_connector, int ctrl_fd)
{
    struct uccl__conn *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    atomic_init(&c->nreqs, 0);
    atomic_init(&c->threads_out, 0);
    atomic_init(&c->served, 0);
    atomic_init(&c->link.failed, 0);
    c->link.conn = c;
    c->link.local = loc;
    c->link.is_connector = is_connector;
    c->ctrl_fd = ctrl_fd;
    c->link.peer_rank = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->ctrl_tx_mu, NULL);
    pthread_mutex_init(&c->close_mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->svc_cv, NULL);
    pthread_cond_init(&c->drv_cv, NULL);
    TAILQ_INIT(&c->posted);
    TAILQ_INIT(&c->deferred);
    STAILQ_INIT(&c->rtsq);
    STAILQ_INIT(&c->jobs);
    return c;
}

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
    atomic_fetch_add(&c->nreqs, 1);
    return r;
}

void uccl__req_get(struct uccl__req *r) { atomic_fetch_add(&r->refs, 1); }

void uccl__req_put(struct uccl__req *r)
{
    if (r && atomic_fetch_sub(&r->refs, 1) == 1) {
        struct uccl__conn *c = r->conn;
        uccl__mem_release_hold(&c->link.local->mem, r->hold);
        if (r->served) /* the peer's request is over here */
            atomic_fetch_sub(&c->served, 1);
        atomic_fetch_sub(&c->nreqs, 1);
        uccl__conn_put(c);
        free(r);
    }
}

static void futex_wake_all(atomic_uint *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

/* First caller wins; later calls (a failure racing a success) are ignored. */
static void req_finish(struct uccl__req *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void req_finish(struct uccl__req *r, int status, const char *fmt, ...)
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
    uint32_t *slot = atomic_exchange(&r->flag, NULL); /* a waiting stream goes on */
    if (slot)
        uccl__gpu_flag_set(r->flags, slot, r->flag_gen);
}

/* Whoever takes the slot out of r (this, or req_finish) releases it, once:
 * published after the stream's wait was queued, checked again after. */
void uccl__req_flag(struct uccl__req *r, struct uccl__gpu_flags *f, uint32_t *slot, uint32_t gen)
{
    r->flags = f;
    r->flag_gen = gen;
    atomic_store(&r->flag, slot);
    if (atomic_load(&r->state) != UCCL_REQ_PENDING && (slot = atomic_exchange(&r->flag, NULL)))
        uccl__gpu_flag_set(f, slot, gen);
}

void uccl__req_fail_unposted(struct uccl__req *r, int status, const char *why)
{
    req_finish(r, status, "%s", why);
}

/* ------------------------------------------------------------------------- */
/* finishing requests                                                         */

/* Under c->mu: r gives back its slot of the window; the worker announces
 * what waits for one. */
static void window_give_back(struct uccl__conn *c, struct uccl__req *r)
{
    if (!r->windowed)
        return;
    r->windowed = 0;
    c->announced--;
    if (!TAILQ_EMPTY(&c->deferred) && !atomic_load(&c->link.failed)) {
        c->launch = 1;
        pthread_cond_signal(&c->cv); /* the worker (conn.h: only it waits on cv) */
    }
}

/* keep_window: r's slot stays taken until its answer is on the wire
 * (uccl__req_answer), lest the peer see our next request before it. */
static void complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *msg,
                     int keep_window)
{
    pthread_mutex_lock(&c->mu);
    int held = uccl__idmap_del(&c->pending, uccl__pending_key(r)) != NULL;
    uint64_t k1 = r->op == UCCL_OP_SEND ? key_of(UCCL_KEY_SEND, r->seq)
                : r->op == UCCL_OP_RECV ? key_of(UCCL_KEY_RECV, r->seq)
                : r->op == UCCL_OP_READ_TARGET || r->op == UCCL_OP_WRITE_TARGET
                ? key_of(UCCL_KEY_LENT, r->seq) : key_of(UCCL_KEY_OP, r->seq);
    if (uccl__idmap_get(&c->inflight, k1) == r)
        uccl__idmap_del(&c->inflight, k1);
    int dk = r->op == UCCL_OP_RECV ? UCCL_DATA_SEND : r->op == UCCL_OP_READ ? UCCL_DATA_READ
           : r->op == UCCL_OP_WRITE_TARGET ? UCCL_DATA_WRITE : 0;
    if (dk && uccl__idmap_get(&c->rx, key_of(dk, r->seq)) == r)
        uccl__idmap_del(&c->rx, key_of(dk, r->seq));
    if (r->posted) { /* a recv still waiting for its RTS */
        TAILQ_REMOVE(&c->posted, r, link);
        r->posted = 0;
    }
    if (r->deferred) { /* never announced (the connection failed) */
        TAILQ_REMOVE(&c->deferred, r, link);
        r->deferred = 0;
    }
    if (held && !keep_window)
        window_give_back(c, r);
    pthread_mutex_unlock(&c->mu);
    if (!held)
        return;
    req_finish(r, status, "%s", msg);
    uccl__req_put(r);
}

void uccl__req_complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *fmt, ...)
{
    char msg[512] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
    }
    complete(c, r, status, msg, 0);
}

/* Finish r here, then tell the peer (FIN, NACK, OPDONE).  In that order: once
 * told, the peer may close at once, and its BYE must not find r pending.
 * But finishing r may let our own caller close at once too: `answering`
 * makes that close send its BYE only after this answer (uccl__conn_close),
 * or the peer would find its half of the exchange pending. */
void uccl__req_answer(struct uccl__conn *c, struct uccl__req *r, int type, uint64_t len,
                      int status, const char *why)
{
    uint64_t seq = r->seq;
    int own = r->op == UCCL_OP_SEND || r->op == UCCL_OP_WRITE || r->op == UCCL_OP_READ;
    if (own) /* r's answer ends the peer's part: keep r's slot until it is out */
        uccl__req_get(r);
    atomic_fetch_add(&c->answering, 1);
    complete(c, r, status, why ? why : "", own);
    uccl__conn_send_simple(c, type, seq, len, type == UCCL_MSG_OPDONE || type == UCCL_MSG_PDONE
                                                  ? (uint64_t)(int64_t)status : 0);
    atomic_fetch_sub(&c->answering, 1);
    if (own) {
        pthread_mutex_lock(&c->mu);
        window_give_back(c, r);
        pthread_mutex_unlock(&c->mu);
        uccl__req_put(r);
    }
}

/* ------------------------------------------------------------------------- */
/* failure                                                                    */

static void describe_peer(struct uccl__conn *c, char *buf, size_t len)
{
    if (c->link.peer_rank >= 0)
        snprintf(buf, len, "connection %llu to %s:%d (rank %d)", (unsigned long long)c->id,
                 c->link.peer_ip, c->link.peer_port, c->link.peer_rank);
    else
        snprintf(buf, len, "connection %llu to %s:%d", (unsigned long long)c->id, c->link.peer_ip,
                 c->link.peer_port);
}

struct fail_ctx { struct uccl__req **v; size_t n; };
static void collect(uint64_t k, void *v, void *arg)
{
    (void)k;
    struct fail_ctx *f = arg;
    uccl__req_get(v);
    f->v[f->n++] = v;
}

void uccl__conn_fail(struct uccl__conn *c, int status, const char *fmt, ...)
{
    char why[360], who[120];
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
    if (!atomic_compare_exchange_strong(&c->link.failed, &expect, 1)) {
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

    if (__atomic_load_n(&c->peer_bye, __ATOMIC_RELAXED)) /* the service thread sets it */
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
    if (c->link.tp && c->link.tp->conn_shutdown)
        c->link.tp->conn_shutdown(&c->link);
    for (size_t i = 0; i < f.n; i++) {
        uccl__req_complete(c, f.v[i], status, "%s", c->fail_msg);
        uccl__req_put(f.v[i]);
    }
    free(f.v);
    pthread_mutex_lock(&c->mu);
    c->fail_done = 1; /* from now on nothing of this call touches the transport */
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------------- */
/* the control channel: sending                                               */

int uccl__conn_ctrl_write(struct uccl__conn *c, const uint8_t *buf, uint64_t deadline)
{
    if (c->released) /* its socket and queues are gone */
        return uccl__err(UCCL_ERR_CLOSED, "%s", c->fail_msg);
    if (c->link.ctrl_shm)
        return c->link.tp->ctrl_send(&c->link, buf, deadline);
    return uccl__sock_send_all(c->ctrl_fd, buf, UCCL_MSG_SIZE, deadline);
}

int uccl__conn_send_msg(struct uccl__conn *c, const struct uccl__msg *m)
{
    uint8_t buf[UCCL_MSG_SIZE];
    uccl__msg_encode(m, buf);
    pthread_mutex_lock(&c->ctrl_tx_mu);
    int rc = uccl__conn_ctrl_write(c, buf, uccl__now_ns() + c->link.local->timeout_ns);
    pthread_mutex_unlock(&c->ctrl_tx_mu);
    if (rc)
        uccl__conn_fail(c, rc == UCCL_ERR_TIMEOUT ? rc : UCCL_ERR_IO,
                        "sending a control message: %s", uccl_last_error());
    return rc;
}

void uccl__conn_send_simple(struct uccl__conn *c, int type, uint64_t seq, uint64_t len,
                            uint64_t aux)
{
    struct uccl__msg m = {.type = (uint16_t)type, .seq = seq, .len = len, .aux = aux};
    uccl__conn_send_msg(c, &m);
}

/* ------------------------------------------------------------------------- */
/* announcing this side's requests, within the window                         */

/* Under c->mu: does send r go eagerly (its bytes behind its RTS on the
 * socket, or in a shared-memory slot)?  Host memory only (the CPU copies). */
static void choose_eager(struct uccl__conn *c, struct uccl__req *r)
{
    r->eager_slot = -1;
    if (r->len == 0 || r->len > UCCL_EAGER_MAX || c->eager_inflight >= UCCL_EAGER_INFLIGHT ||
        UCCL_MK_ON_GPU(r->mkind))
        return;
    if (!c->link.ctrl_shm && !c->link.direct) {
        r->eager = 1; /* bytes follow on the socket */
    } else if (c->link.ctrl_shm && c->link.tp->eager_slot) {
        /* a free slot: freed by its own FIN/NACK, which may come out of order */
        for (int i = 0; i < UCCL_EAGER_INFLIGHT && r->eager_slot < 0; i++)
            if (!(c->eager_slots_busy & (1u << i)))
                r->eager_slot = i;
        c->eager_slots_busy |= 1u << r->eager_slot;
        r->eager = 1;
    }
    c->eager_inflight += (unsigned)r->eager;
}

/* Under c->mu, r about to be announced: a slot of the window, and the
 * entries by which the peer's answers find it (never before: a peer cannot
 * answer what it was not told of). */
static void take_slot(struct uccl__conn *c, struct uccl__req *r)
{
    r->windowed = 1;
    c->announced++;
    if (r->op == UCCL_OP_SEND) {
        uccl__idmap_put(&c->inflight, key_of(UCCL_KEY_SEND, r->seq), r);
        choose_eager(c, r);
        return;
    }
    uccl__idmap_put(&c->inflight, key_of(UCCL_KEY_OP, r->seq), r);
    if (r->op == UCCL_OP_READ && (!c->link.direct || c->link.tp->staged) && r->len > 0)
        uccl__idmap_put(&c->rx, key_of(UCCL_DATA_READ, r->seq), r);
}

/* Under ctrl_tx_mu (so messages leave in the order of their sequence
 * numbers): r's RTS, WREQ or RREQ on the wire. */
static int put_on_wire(struct uccl__conn *c, struct uccl__req *r)
{
    struct uccl__msg m;
    uint8_t buf[UCCL_MSG_SIZE];
    uint64_t deadline = uccl__now_ns() + c->link.local->timeout_ns;
    if (c->released)
        return uccl__err(UCCL_ERR_CLOSED, "%s", c->fail_msg);
    if (r->op != UCCL_OP_SEND) {
        m = (struct uccl__msg){.type = r->op == UCCL_OP_WRITE ? UCCL_MSG_WREQ : UCCL_MSG_RREQ,
                               .seq = r->seq, .len = r->len, .aux = r->key_for_peer,
                               .addr = (uint64_t)(uintptr_t)r->buf, .window = r->fifo.window,
                               .token = r->fifo.token, .offset = uccl__fifo_offset(&r->fifo)};
        uccl__msg_encode(&m, buf);
        return uccl__conn_ctrl_write(c, buf, deadline);
    }
    if (r->eager_slot >= 0) /* one copy here beats pinning pages on the other side */
        memcpy(c->link.tp->eager_slot(&c->link, (unsigned)r->eager_slot), r->buf, r->len);
    m = (struct uccl__msg){.type = UCCL_MSG_RTS, .seq = r->seq, .len = r->len,
                           .addr = (uint64_t)(uintptr_t)r->buf, .window = r->key_for_peer,
                           .offset = r->eager_slot >= 0 ? (uint64_t)r->eager_slot : 0,
                           .aux = !r->eager ? 0 : r->eager_slot >= 0
                                  ? UCCL_MSG_FLAG_EAGER | UCCL_MSG_FLAG_SLOT : UCCL_MSG_FLAG_EAGER};
    uccl__msg_encode(&m, buf);
    return r->eager && r->eager_slot < 0
               ? uccl__sock_send2(c->ctrl_fd, buf, sizeof(buf), r->buf, r->len, deadline)
               : uccl__conn_ctrl_write(c, buf, deadline);
}

static void announce_failed(struct uccl__conn *c, int rc)
{
    uccl__conn_fail(c, rc == UCCL_ERR_TIMEOUT ? rc : UCCL_ERR_IO,
                    "sending a control message: %s", uccl_last_error());
}

void uccl__conn_announce(struct uccl__conn *c, struct uccl__req *r)
{
    /* Sequence numbers are given under the writer lock: the wire order is
     * theirs (the k-th send matches the k-th recv). */
    pthread_mutex_lock(&c->ctrl_tx_mu);
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->link.failed)) { /* conn_fail finishes r */
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_unlock(&c->ctrl_tx_mu);
        return;
    }
    r->seq = r->op == UCCL_OP_SEND ? ++c->next_send_seq : ++c->next_op;
    r->eager_slot = -1;
    int now = c->announced < UCCL_REQ_WINDOW && TAILQ_EMPTY(&c->deferred);
    if (now) {
        take_slot(c, r);
    } else {
        TAILQ_INSERT_TAIL(&c->deferred, r, link); /* in order, behind the others */
        r->deferred = 1;
    }
    pthread_mutex_unlock(&c->mu);
    int rc = now ? put_on_wire(c, r) : UCCL_OK;
    pthread_mutex_unlock(&c->ctrl_tx_mu);
    if (rc)
        announce_failed(c, rc);
}

void uccl__conn_launch(struct uccl__conn *c)
{
    int rc = UCCL_OK;
    pthread_mutex_lock(&c->ctrl_tx_mu);
    while (rc == UCCL_OK) {
        pthread_mutex_lock(&c->mu);
        struct uccl__req *r = TAILQ_FIRST(&c->deferred);
        if (!r || atomic_load(&c->link.failed) || c->announced >= UCCL_REQ_WINDOW) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        TAILQ_REMOVE(&c->deferred, r, link);
        r->deferred = 0;
        take_slot(c, r);
        /* A failure may finish r meanwhile, and its caller then free the
         * buffer an eager send copies from: busy makes the caller wait
         * (still pending here, under mu, so no outcome was reported). */
        uccl__req_get(r);
        int reads = r->eager;
        if (reads)
            atomic_fetch_add(&r->busy, 1);
        pthread_mutex_unlock(&c->mu);
        rc = put_on_wire(c, r);
        if (reads)
            atomic_fetch_sub(&r->busy, 1);
        uccl__req_put(r);
    }
    pthread_mutex_unlock(&c->ctrl_tx_mu);
    if (rc)
        announce_failed(c, rc);
}
