/* A connection (conn.h): its life cycle and failure, the control channel,
 * the service thread that reads it while nobody else does, callers that
 * drive it themselves while they wait, and the worker thread that makes the
 * copies the protocol (proto.c) asks for.
 *
 * Reading the control channel: one reader at a time.  The service thread
 * reads while no caller drives; a caller blocked in a transfer takes over
 * (uccl__conn_drive) and handles what arrives on its own thread, so an
 * answer needs no thread handoff.  Copies (a pull into a posted buffer) go
 * to the worker, or are made by the driving caller itself. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conn/conn.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/status.h"

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
    uccl__proto_free(c);
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
    atomic_init(&c->failed, 0);
    c->local = loc;
    c->is_connector = is_connector;
    c->ctrl_fd = ctrl_fd;
    c->peer_rank = -1;
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
        uccl__req_complete(c, f.v[i], status, "%s", c->fail_msg);
        uccl__req_put(f.v[i]);
    }
    free(f.v);
}

/* ------------------------------------------------------------------------- */
/* the control channel: sending                                               */

int uccl__conn_ctrl_write(struct uccl__conn *c, const uint8_t *buf, uint64_t deadline)
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
    int rc = uccl__conn_ctrl_write(c, buf, uccl__now_ns() + c->local->timeout_ns);
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
/* copy jobs                                                                  */

static void run_job(struct uccl__conn *c, struct uccl__job *j);

/* The connection this thread is driving, if any (see uccl__conn_drive). */
static _Thread_local struct uccl__conn *tls_driving;

/* A job that will touch r's buffer marks it busy from now on, so a waiter
 * that gives up cannot return between queueing and copying. */
static int writes_req(int kind)
{
    return kind == UCCL_JOB_PULL_RECV || kind == UCCL_JOB_PULL_READ ||
           kind == UCCL_JOB_PUSH_SEND || kind == UCCL_JOB_PUSH_WRITE;
}

static void job_done(struct uccl__conn *c, struct uccl__job *j)
{
    if (j->busy_held)
        atomic_fetch_sub(&j->req->busy, 1);
    j->busy_held = 0;
    uccl__mem_release_hold(&c->local->mem, j->hold);
    j->hold = NULL;
}

void uccl__conn_push_job(struct uccl__conn *c, int kind, struct uccl__req *r,
                         const struct uccl__msg *m, void *dst, struct uccl__mr *hold)
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
        uccl__req_get(r);
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
    STAILQ_INSERT_TAIL(&c->jobs, j, link);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void uccl__conn_with_inline_copies(struct uccl__conn *c, void (*fn)(struct uccl__conn *))
{
    if (tls_driving) { /* this thread drives a connection already: leave it be */
        fn(c);
        return;
    }
    tls_driving = c;
    fn(c);
    tls_driving = NULL;
}

/* ------------------------------------------------------------------------- */
/* the worker thread: direct copies                                           */

static void run_job(struct uccl__conn *c, struct uccl__job *j)
{
    int rc;
    struct uccl__req *r = j->req;
    switch (j->kind) {
    case UCCL_JOB_PULL_RECV:
    case UCCL_JOB_PULL_READ:
        if (atomic_load(&r->state) != UCCL_REQ_PENDING)
            break; /* already finished or failed: its buffer is not ours to fill */
        rc = c->tp->pull(c, r->buf, r->local_key, r->remote_addr, r->remote_key, r->len);
        if (rc) {
            uccl__conn_fail(c, rc, "copying %s %llu from the peer: %s",
                            j->kind == UCCL_JOB_PULL_RECV ? "message" : "read",
                            (unsigned long long)r->seq, uccl_last_error());
            break;
        }
        job_done(c, j); /* done writing into r: only then may it complete */
        uccl__proto_answer(c, r, j->kind == UCCL_JOB_PULL_RECV ? UCCL_MSG_FIN : UCCL_MSG_RDONE,
                           r->len, UCCL_OK, NULL);
        break;
    case UCCL_JOB_PULL_WRITE:
        rc = c->tp->pull(c, j->dst, j->hold ? j->hold->tp_key[c->tp->id] : 0, j->msg.addr,
                         j->msg.aux, j->msg.len);
        if (rc)
            LOG_WARN("connection %llu: one-sided copy failed: %s", (unsigned long long)c->id,
                     uccl_last_error());
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, j->msg.seq, j->msg.len, (uint64_t)(int64_t)rc);
        break;
    case UCCL_JOB_PUSH_SEND:
    case UCCL_JOB_PUSH_WRITE:
        if (atomic_load(&r->state) != UCCL_REQ_PENDING)
            break;
        rc = c->tp->push(c, r->buf, r->local_key, r->remote_addr, r->remote_key, r->len);
        if (rc) {
            uccl__conn_fail(c, rc, "copying %s %llu into the peer's GPU memory: %s",
                            j->kind == UCCL_JOB_PUSH_SEND ? "message" : "write",
                            (unsigned long long)r->seq, uccl_last_error());
            break;
        }
        job_done(c, j);
        uccl__proto_answer(c, r, j->kind == UCCL_JOB_PUSH_SEND ? UCCL_MSG_PDONE : UCCL_MSG_RDONE,
                           r->len, UCCL_OK, NULL);
        break;
    case UCCL_JOB_PUSH_READ: /* our window into the reader's GPU buffer */
        rc = c->tp->push(c, j->dst, j->hold ? j->hold->tp_key[c->tp->id] : 0, j->msg.addr,
                         j->msg.aux, j->msg.len);
        if (rc)
            LOG_WARN("connection %llu: one-sided copy failed: %s", (unsigned long long)c->id,
                     uccl_last_error());
        job_done(c, j); /* let the window go before the reader hears */
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, j->msg.seq, j->msg.len, (uint64_t)(int64_t)rc);
        break;
    }
}

static void *worker_main(void *arg)
{
    struct uccl__conn *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (STAILQ_EMPTY(&c->jobs) && !atomic_load(&c->failed))
            pthread_cond_wait(&c->cv, &c->mu);
        struct uccl__job *j = STAILQ_FIRST(&c->jobs);
        if (j)
            STAILQ_REMOVE_HEAD(&c->jobs, link);
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

/* ------------------------------------------------------------------------- */
/* the control channel: reading (the service thread, or a driving caller)     */

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
            rc = uccl__proto_handle(c, &m);
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
                uccl__proto_eager_arrived(c);
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
            rc = m.type == UCCL_MSG_RTS && (m.aux & UCCL_MSG_FLAG_EAGER)
                     ? uccl__proto_eager_begin(c, &m) : uccl__proto_handle(c, &m);
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
            uccl__proto_eager_drop(c); /* still the reader */
        svc_give_token(c);
        if (rc < 0)
            break;
    }
    /* Leaving: drop a half-read payload unless a driver reads (it drops it). */
    if (svc_take_token(c)) {
        uccl__proto_eager_drop(c);
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
        uccl__proto_eager_drop(c); /* still the reader */
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
/* start and close                                                            */

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
    /* Answers already owed go first (uccl__proto_answer); bounded: 100 ms. */
    for (int i = 0; i < 2000 && atomic_load(&c->answering) > 0; i++)
        usleep(50);
    if (!atomic_load(&c->failed) && c->started) {
        /* Tell the peer this is a close, not a crash; never wait long for it. */
        struct uccl__msg m = {.type = UCCL_MSG_BYE};
        uint8_t buf[UCCL_MSG_SIZE];
        uccl__msg_encode(&m, buf);
        pthread_mutex_lock(&c->ctrl_tx_mu);
        uccl__conn_ctrl_write(c, buf, uccl__now_ns() + 100000000ull);
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
