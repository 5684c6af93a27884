/* Who makes a connection progress (conn.h): reading its control channel
 * and handling what arrives, one reader at a time.  The service thread
 * reads while no caller drives; a caller blocked in a transfer takes over
 * (uccl__conn_drive, and uccl__req_wait, which drives before it sleeps) and
 * handles what arrives on its own thread, so an answer needs no thread
 * handoff, and makes the copies that answer triggers itself (worker.c).
 * And the connection's threads: started, and stopped at close.
 *
 * The top of the layer: the reader hands each message to the protocol
 * (proto.c) or an eager payload's bytes to proto_eager.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "conn/conn.h"
#include "base/ptracer.h"
#include "base/status.h"

/* ------------------------------------------------------------------------- */
/* the control channel: reading (the service thread, or a driving caller)     */

/* Read and handle every whole message available now, without blocking.
 * Only the reader of the moment (driver or service thread) calls this.
 * Returns the number handled, or a negative status. */
static int pump(struct uccl__conn *c)
{
    int handled = 0;
    while (c->link.ctrl_shm && !atomic_load(&c->link.failed)) {
        uint8_t buf[UCCL_MSG_SIZE];
        if (!c->link.tp->ctrl_recv(&c->link, buf))
            return handled;
        struct uccl__msg m;
        int rc = uccl__msg_decode(buf, &m);
        if (rc == UCCL_OK)
            rc = uccl__proto_handle(c, &m);
        if (rc)
            return rc;
        handled++;
    }
    while (!atomic_load(&c->link.failed)) {
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
                int rc = uccl__proto_eager_arrived(c);
                if (rc)
                    return rc;
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
    while (!atomic_load(&c->link.failed)) {
        pthread_mutex_lock(&c->mu);
        if (c->driver && !c->link.ctrl_shm) { /* a caller is reading: stay out of its way */
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
        if (c->link.ctrl_shm) {
            /* Messages come through shared memory; the socket only carries
             * the peer's death (EOF), which pump() then reports. */
            c->link.tp->ctrl_wait(&c->link, 100);
            if (poll(&p, 1, 0) > 0) {
                char b;
                ssize_t n = recv(c->ctrl_fd, &b, 1, MSG_DONTWAIT);
                /* Drain what the peer said before it went (its last FIN, its
                 * BYE): the queue and the socket are two channels, so its EOF
                 * can overtake them.  A waiter driving the connection reads
                 * them itself and lets go within its spin budget; wait for
                 * it (bounded) rather than fail a transfer the peer finished. */
                int token = svc_take_token(c);
                for (int i = 0; !token && i < 2000 && !atomic_load(&c->link.failed); i++) {
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
        if (atomic_load(&c->link.failed))
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
    atomic_fetch_add(&c->threads_out, 1);
    return NULL;
}

/* Drive c from the calling thread until r finishes or budget_ns passes.
 * Returns at once if another thread already drives c. */
int uccl__conn_drive_begin(struct uccl__conn *c)
{
    if (!atomic_load(&c->started) || uccl__conn_driving())
        return 0;
    pthread_mutex_lock(&c->mu);
    if (c->driver || atomic_load(&c->link.failed)) {
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
    if (c->link.ctrl_shm)
        c->link.tp->ctrl_driving(&c->link, 1);
    return 1;
}

int uccl__conn_drive_pump(struct uccl__conn *c, int inline_copies)
{
    if (atomic_load(&c->link.failed))
        return -1;
    uccl__conn_set_driving(inline_copies ? c : NULL); /* NULL: copies go to the worker */
    int rc = pump(c);
    uccl__conn_set_driving(NULL);
    if (rc < 0)
        pump_failed(c, rc);
    return rc;
}

void uccl__conn_drive_end(struct uccl__conn *c)
{
    if (atomic_load(&c->link.failed))
        uccl__proto_eager_drop(c); /* still the reader */
    pthread_mutex_lock(&c->mu);
    c->driver = 0;
    if (c->link.ctrl_shm)
        c->link.tp->ctrl_driving(&c->link, 0);
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

/* Spin briefly (the answer often comes within microseconds), then sleep on
 * the state word: a 2-core machine must not lose a core to a waiter. */
int uccl__req_wait(struct uccl__req *r, uint64_t timeout_ns)
{
    uint64_t start = uccl__now_ns();
    uint64_t spin = r->conn->link.local->spin_ns;
    /* A GPU copy of many megabytes is a wait of known length: waking from a
     * sleep costs more than polling through it (one ns per 500 bytes, the
     * copy engine's pace, up to 5 ms). */
    if (UCCL_MK_ON_GPU(r->mkind) && spin > 0 && r->len / 500 > spin)
        spin = r->len / 500 < 5000000 ? r->len / 500 : 5000000;
    if (spin > timeout_ns)
        spin = timeout_ns;
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
        /* req_finish (conn.c) stores the state before reading sleepers (both
         * seq_cst): either it sees us or futex_wait sees the new state and
         * returns. */
        syscall(SYS_futex, (uint32_t *)&r->state, FUTEX_WAIT_PRIVATE, s, &ts, NULL, 0);
        atomic_fetch_sub(&r->sleepers, 1);
    }
}

/* ------------------------------------------------------------------------- */
/* start and close                                                            */

int uccl__conn_start(struct uccl__conn *c)
{
    /* Under mu against a close racing the start: either the close sees
     * started and joins, or the start sees failed and starts nothing. */
    pthread_mutex_lock(&c->mu);
    int rc = atomic_load(&c->link.failed) ? uccl__err(UCCL_ERR_CLOSED, "the endpoint was closed")
           : c->link.tp->conn_start ? c->link.tp->conn_start(&c->link) : UCCL_OK;
    if (rc == UCCL_OK && pthread_create(&c->svc_thread, NULL, service_main, c))
        rc = uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    if (rc == UCCL_OK && pthread_create(&c->worker_thread, NULL, uccl__conn_worker_main, c)) {
        atomic_store(&c->link.failed, 1);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->svc_thread, NULL);
        return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    }
    atomic_store(&c->started, rc == UCCL_OK);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void join_threads(struct uccl__conn *c)
{
    pthread_mutex_lock(&c->mu); /* pairs with conn_start */
    int started = atomic_exchange(&c->started, 0);
    pthread_mutex_unlock(&c->mu);
    if (started) {
        pthread_join(c->svc_thread, NULL);
        pthread_join(c->worker_thread, NULL);
    }
}

/* Endpoint close: fail what is pending, stop the threads.  The memory goes
 * with the last reference. */
void uccl__conn_close(struct uccl__conn *c)
{
    pthread_mutex_lock(&c->close_mu);
    if (c->released) { /* everything went already */
        pthread_mutex_unlock(&c->close_mu);
        return;
    }
    atomic_store(&c->closing, 1);
    /* Answers already owed go first (uccl__req_answer); bounded: 100 ms. */
    for (int i = 0; i < 2000 && atomic_load(&c->answering) > 0; i++)
        usleep(50);
    if (!atomic_load(&c->link.failed) && atomic_load(&c->started)) {
        /* Tell the peer this is a close, not a crash; never wait long for it. */
        struct uccl__msg m = {.type = UCCL_MSG_BYE};
        uint8_t buf[UCCL_MSG_SIZE];
        uccl__msg_encode(&m, buf);
        pthread_mutex_lock(&c->ctrl_tx_mu);
        uccl__conn_ctrl_write(c, buf, uccl__now_ns() + 100000000ull);
        pthread_mutex_unlock(&c->ctrl_tx_mu);
    }
    uccl__conn_fail(c, UCCL_ERR_CLOSED, "the endpoint was closed");
    join_threads(c);
    /* Read what the peer still sends until its FIN (it answers our BYE by
     * closing), bounded, so that our close() sends no RST. */
    uint64_t deadline = uccl__now_ns() + 100000000ull;
    while (c->ctrl_fd >= 0) {
        uint64_t now = uccl__now_ns();
        struct pollfd p = {.fd = c->ctrl_fd, .events = POLLIN};
        if (now >= deadline || poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1) <= 0)
            break;
        char sink[512];
        ssize_t n = recv(c->ctrl_fd, sink, sizeof(sink), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
            break;
    }
    if (c->link.tp && c->link.tp->conn_destroy)
        c->link.tp->conn_destroy(&c->link);
    if (c->link.ptracer_pid) { /* closed: the peer copies our memory no more */
        uccl__ptracer_release(c->link.ptracer_pid);
        c->link.ptracer_pid = 0;
    }
    pthread_mutex_unlock(&c->close_mu);
}

int uccl__conn_release(struct uccl__conn *c, int refs)
{
    if (!atomic_load(&c->link.failed))
        return 0;
    pthread_mutex_lock(&c->close_mu);
    pthread_mutex_lock(&c->mu);
    /* Nothing else inside: the failure has run its course (conn_fail
     * touches the socket and the transport), nobody drives, the threads
     * have returned, and no caller holds it but through its requests
     * (every entry point checks `failed` before it touches anything). */
    int ready = c->released ||
                (c->fail_done && !c->driver && !atomic_load(&c->svc_reading) &&
                 (!atomic_load(&c->started) || atomic_load(&c->threads_out) == 2) &&
                 atomic_load(&c->refs) - atomic_load(&c->nreqs) == refs);
    pthread_mutex_unlock(&c->mu);
    if (!ready || c->released) {
        pthread_mutex_unlock(&c->close_mu);
        return ready;
    }
    join_threads(c);
    if (c->link.tp && c->link.tp->conn_destroy)
        c->link.tp->conn_destroy(&c->link); /* the transport's threads and sockets */
    pthread_mutex_lock(&c->ctrl_tx_mu); /* a late writer checks `released` under it */
    pthread_mutex_lock(&c->mu);
    c->released = 1;
    pthread_mutex_unlock(&c->mu);
    if (c->link.tp && c->link.tp->conn_free)
        c->link.tp->conn_free(&c->link); /* mappings, queues */
    if (c->ctrl_fd >= 0)
        close(c->ctrl_fd);
    c->ctrl_fd = -1;
    pthread_mutex_unlock(&c->ctrl_tx_mu);
    if (c->link.ptracer_pid) { /* a dead peer keeps no Yama grant (its pid may be reused) */
        uccl__ptracer_release(c->link.ptracer_pid);
        c->link.ptracer_pid = 0;
    }
    uccl__conn_free_held(c); /* what the peer announced */
    pthread_mutex_unlock(&c->close_mu);
    return 1;
}
