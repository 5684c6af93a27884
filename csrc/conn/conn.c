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

/* What the protocol still holds with the last reference: announced
 * messages never matched, an eager payload half read. */
static void free_held(struct uccl__conn *c)
{
    for (struct uccl__rts *rts; (rts = STAILQ_FIRST(&c->rtsq));) {
        STAILQ_REMOVE_HEAD(&c->rtsq, link);
        free(rts->data);
        free(rts);
    }
    if (c->erx.rts) {
        free(c->erx.rts->data);
        free(c->erx.rts);
    }
    if (c->erx.direct) {
        atomic_fetch_sub(&c->erx.direct->busy, 1);
        uccl__req_put(c->erx.direct);
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
    free_held(c);
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

struct uccl__conn *uccl__conn_new(struct uccl__local *loc, int is_connector, int ctrl_fd)
{
    struct uccl__conn *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    atomic_init(&c->link.failed, 0);
    c->link.conn = c;
    c->link.local = loc;
    c->link.is_connector = is_connector;
    c->ctrl_fd = ctrl_fd;
    c->link.peer_rank = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->ctrl_tx_mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->svc_cv, NULL);
    pthread_cond_init(&c->drv_cv, NULL);
    TAILQ_INIT(&c->posted);
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
    return r;
}

void uccl__req_get(struct uccl__req *r) { atomic_fetch_add(&r->refs, 1); }

void uccl__req_put(struct uccl__req *r)
{
    if (r && atomic_fetch_sub(&r->refs, 1) == 1) {
        uccl__mem_release_hold(&r->conn->link.local->mem, r->hold);
        uccl__conn_put(r->conn);
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

void uccl__req_complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *fmt, ...)
{
    char msg[512] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
    }
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
    pthread_mutex_unlock(&c->mu);
    if (!held)
        return;
    req_finish(r, status, "%s", msg);
    uccl__req_put(r);
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
    atomic_fetch_add(&c->answering, 1);
    uccl__req_complete(c, r, status, why ? "%s" : NULL, why);
    uccl__conn_send_simple(c, type, seq, len, type == UCCL_MSG_OPDONE || type == UCCL_MSG_PDONE
                                                  ? (uint64_t)(int64_t)status : 0);
    atomic_fetch_sub(&c->answering, 1);
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
}

/* ------------------------------------------------------------------------- */
/* the control channel: sending                                               */

int uccl__conn_ctrl_write(struct uccl__conn *c, const uint8_t *buf, uint64_t deadline)
{
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
