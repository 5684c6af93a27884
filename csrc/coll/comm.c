/* The communicator (coll.h, comm.h): a queue of operations started
 * strictly in submission order, one at a time, so that posts reach every
 * connection in the order all ranks issued them.  An operation is advanced
 * by the thread that waits for it (no handoff), or by a worker thread while
 * nobody waits (async calls); whoever advances it holds the execution
 * token.  The first operation that fails poisons the communicator. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "coll/comm.h"
#include "net/sock.h"
#include "base/config.h"
#include "base/status.h"

#define WORKER_SLICE_NS 20000000ull /* the worker looks at abort requests this often */

/* ------------------------------------------------------------------------- */
/* creation                                                                   */

int uccl_comm_create(uccl_ep_t *ep, int rank, int size, const uint64_t *send_conns,
                     const uint64_t *recv_conns, uccl_comm_t **comm_p)
{
    if (size < 1 || rank < 0 || rank >= size)
        return uccl__err(UCCL_ERR_INVALID, "rank %d of world size %d", rank, size);
    long piece, poll_us;
    int rc;
    if ((rc = uccl__cfg_long(UCCL_CFG_COLL_PIECE_KB, &piece)) ||
        (rc = uccl__cfg_long(UCCL_CFG_COLL_POLL_US, &poll_us)))
        return rc;
    struct uccl__comm *cm = calloc(1, sizeof(*cm));
    if (cm) {
        cm->send_conn = calloc((size_t)size, sizeof(uint64_t));
        cm->recv_conn = calloc((size_t)size, sizeof(uint64_t));
    }
    if (!cm || !cm->send_conn || !cm->recv_conn) {
        if (cm) {
            free(cm->send_conn);
            free(cm->recv_conn);
        }
        free(cm);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(cm->send_conn, send_conns, (size_t)size * sizeof(uint64_t));
    memcpy(cm->recv_conn, recv_conns, (size_t)size * sizeof(uint64_t));
    cm->send_conn[rank] = cm->recv_conn[rank] = 0;
    cm->ep = ep;
    cm->rank = rank;
    cm->size = size;
    cm->piece = (size_t)piece;
    cm->poll_ns = (uint64_t)poll_us * 1000;
    /* On a small machine the waiting thread copies every arrival itself
     * (no wake-ups; the cores are busy anyway).  With cores to spare, the
     * copies of different peers run at once on their connections' workers
     * (16 cores, 4 ranks, 1 MiB: one thread copying three chunks one after
     * the other was the slowest part). */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    cm->handoff = ncpu > 4 && size >= 3 && (long)size * 2 <= ncpu; /* 2 ranks: one copy */
    for (int r = 0; r < size && !cm->multinode; r++) {
        char tp[32];
        cm->multinode = cm->send_conn[r] &&
                        uccl_ep_conn_transport(ep, cm->send_conn[r], tp, sizeof(tp)) == UCCL_OK &&
                        strcmp(tp, "tcp") == 0;
    }
    TAILQ_INIT(&cm->queue);
    pthread_mutex_init(&cm->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&cm->cv, &ca);
    pthread_cond_init(&cm->work_cv, &ca);
    pthread_condattr_destroy(&ca);
    *comm_p = cm;
    return UCCL_OK;
}

void uccl_comm_size(const uccl_comm_t *cm, int *size_p) { *size_p = cm->size; }

/* ------------------------------------------------------------------------- */
/* the queue and the execution token                                          */

static void fail_comm(struct uccl__comm *cm, int status, const char *msg)
{
    if (cm->failed)
        return;
    cm->failed = 1;
    cm->fail_status = status;
    snprintf(cm->fail_msg, sizeof(cm->fail_msg), "%s", msg);
}

/* Under cm->mu: an operation that will never run. */
static void fail_queued(struct uccl__op *o, int status, const char *why, const char *detail)
{
    o->state = UCCL_OPST_FAILED;
    o->status = status;
    snprintf(o->msg, sizeof(o->msg), "%s%.300s%s", why, detail, *detail ? ")" : "");
}

/* Under cm->mu: take o out of the queue (if it is there). */
static void unlink_queued(struct uccl__comm *cm, struct uccl__op *o)
{
    if (o->queued)
        TAILQ_REMOVE(&cm->queue, o, link);
    o->queued = 0;
}

/* Under cm->mu: may the calling thread advance o now?  Operations start
 * strictly in order and one at a time, so posts reach every connection in
 * the order all ranks issued them. */
static int runnable(const struct uccl__comm *cm, const struct uccl__op *o)
{
    return !cm->executing && (cm->cur == o || (!cm->cur && TAILQ_FIRST(&cm->queue) == o));
}

/* Under cm->mu, o runnable: take the execution token for it (starting it if
 * queued).  0: it must not run (an earlier operation failed), and is failed. */
static int take(struct uccl__comm *cm, struct uccl__op *o)
{
    if (!cm->cur) {
        unlink_queued(cm, o);
        if (cm->failed || cm->stop) {
            fail_queued(o, cm->stop ? UCCL_ERR_CLOSED : cm->fail_status,
                        cm->stop ? "not run: the communicator was shut down"
                                 : "not run: an earlier operation on this communicator failed (",
                        cm->stop ? "" : cm->fail_msg);
            pthread_cond_broadcast(&cm->cv);
            pthread_cond_signal(&cm->work_cv);
            return 0;
        }
        cm->cur = o;
        o->state = UCCL_OPST_RUNNING;
        o->deadline = uccl__now_ns() + uccl_ep_timeout_ns(cm->ep);
    }
    cm->executing = 1;
    return 1;
}

/* Under cm->mu: o came to rest with rc (not UCCL_INPROGRESS). */
static void settle(struct uccl__comm *cm, struct uccl__op *o, int rc, int ok_state)
{
    if (rc == UCCL_OK) {
        o->state = ok_state;
        return;
    }
    o->status = rc;
    o->state = UCCL_OPST_FAILED;
    if (!o->clean) /* (a clean failure left every connection in step) */
        fail_comm(cm, rc, o->msg);
}

/* Under cm->mu with the token for o: advance it until `until` without the
 * lock, then give the token back.  An abandoned operation is stopped here. */
static int run_slice(struct uccl__comm *cm, struct uccl__op *o, uint64_t until)
{
    int stop = cm->stop;
    pthread_mutex_unlock(&cm->mu);
    int rc = atomic_load(&o->abort) || stop ? UCCL_INPROGRESS : uccl__coll_advance(cm, o, until);
    if (rc == UCCL_INPROGRESS && (atomic_load(&o->abort) || stop))
        rc = uccl__op_err(o, stop ? UCCL_ERR_CLOSED : UCCL_ERR_TIMEOUT, "%s abandoned: %s",
                          o->algo->name, stop ? "the communicator was shut down"
                                              : "its caller gave up (timeout or interrupt)");
    if (rc != UCCL_OK && rc != UCCL_INPROGRESS)
        uccl__coll_cleanup(cm, o, 1);
    pthread_mutex_lock(&cm->mu);
    cm->executing = 0;
    if (rc != UCCL_INPROGRESS) {
        cm->cur = NULL;
        settle(cm, o, rc, o->algo->posted_is_done ? UCCL_OPST_POSTED : UCCL_OPST_DONE);
    }
    pthread_cond_broadcast(&cm->cv);
    pthread_cond_signal(&cm->work_cv);
    return rc;
}

/* The worker advances only operations nobody waits on (async ones); a
 * blocking call's caller advances its own, with no thread handoff. */
static void *worker_main(void *arg)
{
    struct uccl__comm *cm = arg;
    pthread_mutex_lock(&cm->mu);
    while (!cm->stop) {
        struct uccl__op *o = cm->cur ? cm->cur : TAILQ_FIRST(&cm->queue);
        if (!o || cm->executing || !o->async) {
            pthread_cond_wait(&cm->work_cv, &cm->mu);
            continue;
        }
        if (take(cm, o))
            run_slice(cm, o, uccl__now_ns() + WORKER_SLICE_NS);
    }
    pthread_mutex_unlock(&cm->mu);
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* submission                                                                 */

static int submit(struct uccl__comm *cm, struct uccl__op *o, int async, uint64_t *op_p)
{
    pthread_mutex_lock(&cm->mu);
    int rc = UCCL_OK;
    if (cm->stop)
        rc = uccl__err(UCCL_ERR_CLOSED, "the communicator is shut down");
    else if (cm->failed)
        rc = uccl__err(cm->fail_status, "an earlier operation on this communicator failed, so "
                       "its ranks no longer agree on what comes next: %s", cm->fail_msg);
    if (rc == UCCL_OK && async && !cm->worker_started) {
        if (pthread_create(&cm->worker, NULL, worker_main, cm))
            rc = uccl__err(UCCL_ERR_IO, "pthread_create: %s", strerror(errno));
        else
            cm->worker_started = 1;
    }
    if (rc == UCCL_OK) {
        o->id = ++cm->next_id;
        rc = uccl__idmap_put(&cm->ops, o->id, o);
    }
    if (rc) {
        pthread_mutex_unlock(&cm->mu);
        uccl__op_free(o);
        return rc;
    }
    o->async = async;
    TAILQ_INSERT_TAIL(&cm->queue, o, link);
    o->queued = 1;
    *op_p = o->id;
    /* Nothing ahead of it: post what can be posted now, on this thread. */
    if (async && runnable(cm, o) && take(cm, o))
        run_slice(cm, o, 0);
    pthread_cond_signal(&cm->work_cv);
    pthread_mutex_unlock(&cm->mu);
    return UCCL_OK;
}

static int check_buf(const struct uccl_coll_buf *b, const char *what, int r)
{
    if (!b->ptr && b->len)
        return uccl__err(UCCL_ERR_INVALID, "%s %d: %zu bytes at address 0", what, r, b->len);
    if (b->ptr + b->len < b->ptr)
        return uccl__err(UCCL_ERR_INVALID, "%s %d: 0x%zx + %zu wraps around", what, r,
                         (size_t)b->ptr, b->len);
    return UCCL_OK;
}

static int check_peer(const struct uccl__comm *cm, int peer, int kind)
{
    if (peer < 0 || peer >= cm->size || peer == cm->rank)
        return uccl__err(UCCL_ERR_INVALID, "peer rank %d: expected another rank in 0..%d (this "
                         "is rank %d)", peer, cm->size - 1, cm->rank);
    uint64_t conn = kind == UCCL_XFER_SEND ? cm->send_conn[peer] : cm->recv_conn[peer];
    if (!conn)
        return uccl__err(UCCL_ERR_INVALID, "rank %d is not reached through this engine (same "
                         "host with use_copy_engine_for_intra=False?)", peer);
    return UCCL_OK;
}

/* A p2p operation, checked and made (not submitted). */
static int p2p_make(struct uccl__comm *cm, const struct uccl_coll_p2p *ops, int n,
                    struct uccl__op **o_p)
{
    if (n < 1)
        return uccl__err(UCCL_ERR_INVALID, "an empty batch of %d operations", n);
    for (int i = 0; i < n; i++) {
        if (ops[i].op != UCCL_XFER_SEND && ops[i].op != UCCL_XFER_RECV)
            return uccl__err(UCCL_ERR_INVALID, "operation %d: kind %d is neither send nor recv",
                             i, ops[i].op);
        int rc = check_peer(cm, ops[i].peer, ops[i].op);
        if (rc == UCCL_OK)
            rc = check_buf(&ops[i].buf, "operation", i);
        if (rc)
            return rc;
    }
    struct uccl__op *o = calloc(1, sizeof(*o));
    if (o) {
        o->p2p = malloc((size_t)n * sizeof(*ops));
        o->tmp_mr = calloc((size_t)n, sizeof(uint64_t));
    }
    if (!o || !o->p2p || !o->tmp_mr) {
        uccl__op_free(o);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(o->p2p, ops, (size_t)n * sizeof(*ops));
    o->algo = &uccl__coll_p2p;
    o->n = n;
    o->tolerant = 1; /* every transfer is matched with one of the peer's */
    *o_p = o;
    return UCCL_OK;
}

int uccl_comm_p2p(uccl_comm_t *cm, const struct uccl_coll_p2p *ops, int n, void *mark,
                  uint64_t *op_p)
{
    struct uccl__op *o = NULL;
    int rc = p2p_make(cm, ops, n, &o);
    if (rc) {
        uccl_stream_mark_free(mark);
        return rc;
    }
    o->mark = mark;
    return submit(cm, o, 1, op_p);
}

/* An allgather, checked and made (not submitted). */
static int allgather_make(struct uccl__comm *cm, const struct uccl_coll_buf *send,
                          const struct uccl_coll_buf *recv, int algo, struct uccl__op **o_p)
{
    int n = cm->size, me = cm->rank, rc, nodiag = (algo & UCCL_AG_NO_DIAGNOSIS) != 0;
    algo &= ~UCCL_AG_NO_DIAGNOSIS;
    if (algo != UCCL_AG_AUTO && algo != UCCL_AG_DIRECT && algo != UCCL_AG_RING)
        return uccl__err(UCCL_ERR_INVALID, "allgather algorithm %d (expected auto, direct or "
                         "ring)", algo);
    if ((rc = check_buf(send, "send buffer of rank", me)))
        return rc;
    for (int r = 0; r < n; r++)
        if ((rc = check_buf(&recv[r], "receive buffer for rank", r)))
            return rc;
    if (recv[me].len != send->len)
        return uccl__err(UCCL_ERR_INVALID, "the receive buffer for this rank (%d) has %zu "
                         "bytes but the send buffer has %zu", me, recv[me].len, send->len);
    /* Every rank must pick the same: decide from what all of them know
     * alike (the largest chunk), not from this rank's own chunk. */
    size_t largest = 0;
    for (int r = 0; r < n; r++)
        largest = recv[r].len > largest ? recv[r].len : largest;
    algo = uccl_comm_pick_algo(cm, algo, largest);
    for (int r = 0; r < n; r++) {
        if (r == me)
            continue;
        int needed = algo == UCCL_AG_DIRECT || r == (me + 1) % n || r == (me - 1 + n) % n;
        if (needed && (cm->send_conn[r] == 0 || cm->recv_conn[r] == 0))
            return uccl__err(UCCL_ERR_INVALID, "allgather needs rank %d, which this engine does "
                             "not reach (same host with use_copy_engine_for_intra=False?)", r);
    }
    struct uccl__op *o = calloc(1, sizeof(*o));
    if (o) {
        o->recv = malloc((size_t)n * sizeof(*recv));
        o->tmp_mr = calloc((size_t)n + 1, sizeof(uint64_t));
    }
    if (!o || !o->recv || !o->tmp_mr) {
        uccl__op_free(o);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(o->recv, recv, (size_t)n * sizeof(*recv));
    o->send = *send;
    o->algo = algo == UCCL_AG_RING ? &uccl__coll_ring : &uccl__coll_direct;
    /* Direct: one message each way per pair, so a size mismatch fails both
     * sides of that pair and nothing else; the ring's forwarding is not. */
    o->tolerant = algo == UCCL_AG_DIRECT;
    o->nodiag = nodiag;
    *o_p = o;
    return UCCL_OK;
}

int uccl_comm_allgather(uccl_comm_t *cm, const struct uccl_coll_buf *send,
                        const struct uccl_coll_buf *recv, int algo, int async, void *mark,
                        uint64_t *op_p)
{
    struct uccl__op *o = NULL;
    int rc = allgather_make(cm, send, recv, algo, &o);
    if (rc) {
        uccl_stream_mark_free(mark);
        return rc;
    }
    o->mark = mark;
    return submit(cm, o, async, op_p);
}

/* ------------------------------------------------------------------------- */
/* waiting                                                                    */


static struct timespec abs_mono(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                          .tv_nsec = (long)(ns % 1000000000ull)};
    return ts;
}

int uccl_comm_wait(uccl_comm_t *cm, uint64_t id, uint64_t deadline, uint64_t slice)
{
    pthread_mutex_lock(&cm->mu);
    struct uccl__op *o = uccl__idmap_get(&cm->ops, id);
    if (!o) {
        pthread_mutex_unlock(&cm->mu);
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown operation %llu (never issued, or released)",
                         (unsigned long long)id);
    }
    uint64_t now = uccl__now_ns();
    uint64_t until = now + slice < deadline ? now + slice : deadline;
    int rc;
    o->waiters++; /* keeps o allocated while this thread sleeps (see release) */
    for (;;) {
        if (o->state == UCCL_OPST_DONE) {
            rc = UCCL_OK;
            break;
        }
        if (o->state == UCCL_OPST_FAILED) {
            rc = uccl__err(o->status, "%s", o->msg);
            break;
        }
        if (o->state == UCCL_OPST_POSTED && !o->collecting) {
            o->collecting = 1; /* p2p: one thread collects the posted transfers */
            pthread_mutex_unlock(&cm->mu);
            rc = uccl__coll_finish_transfers(cm, o, deadline, until);
            if (rc != UCCL_OK && rc != UCCL_INPROGRESS)
                uccl__coll_cleanup(cm, o, 1);
            pthread_mutex_lock(&cm->mu);
            o->collecting = 0;
            if (rc != UCCL_INPROGRESS)
                settle(cm, o, rc, UCCL_OPST_DONE);
            pthread_cond_broadcast(&cm->cv);
            if (rc == UCCL_INPROGRESS && uccl__now_ns() >= until)
                break;
            continue;
        }
        now = uccl__now_ns();
        if (now >= deadline && o->state != UCCL_OPST_POSTED) {
            /* Give up: a queued operation never runs; a started one is
             * stopped by whoever advances it next (us, if nobody does). */
            atomic_store(&o->abort, 1);
            if (o->state == UCCL_OPST_QUEUED && !runnable(cm, o)) { /* behind another one */
                unlink_queued(cm, o);
                fail_queued(o, UCCL_ERR_TIMEOUT, "timed out while queued behind earlier "
                            "operations", "");
                fail_comm(cm, UCCL_ERR_TIMEOUT, o->msg);
                pthread_cond_broadcast(&cm->cv);
                continue;
            }
        }
        if (now >= deadline && o->state == UCCL_OPST_POSTED) { /* another thread collects it */
            rc = uccl__err(UCCL_ERR_TIMEOUT, "operation %llu: timed out while another thread "
                           "waits for it", (unsigned long long)id);
            break;
        }
        if ((o->state == UCCL_OPST_QUEUED || o->state == UCCL_OPST_RUNNING) && runnable(cm, o)) {
            if (take(cm, o))
                run_slice(cm, o, until);
            if (uccl__now_ns() >= until && o->state != UCCL_OPST_DONE &&
                o->state != UCCL_OPST_FAILED && o->state != UCCL_OPST_POSTED) {
                rc = UCCL_INPROGRESS;
                break;
            }
            continue;
        }
        if (now >= until && now < deadline) {
            rc = UCCL_INPROGRESS;
            break;
        }
        struct timespec ts = abs_mono(now >= until ? now + 2000000ull : until);
        pthread_cond_timedwait(&cm->cv, &cm->mu, &ts);
    }
    int free_it = --o->waiters == 0 && o->released;
    pthread_mutex_unlock(&cm->mu);
    if (free_it)
        uccl__op_free(o);
    return rc;
}

int uccl_comm_test(uccl_comm_t *cm, uint64_t id, int *done_p)
{
    int rc = uccl_comm_wait(cm, id, UINT64_MAX, 0);
    if (rc == UCCL_INPROGRESS) {
        *done_p = 0;
        return UCCL_OK;
    }
    if (rc == UCCL_OK)
        *done_p = 1;
    return rc;
}

int uccl_comm_release(uccl_comm_t *cm, uint64_t id)
{
    pthread_mutex_lock(&cm->mu);
    struct uccl__op *o = uccl__idmap_get(&cm->ops, id);
    int rc = UCCL_OK;
    if (!o)
        rc = uccl__err(UCCL_ERR_NOTFOUND, "unknown operation %llu", (unsigned long long)id);
    else if (o->state != UCCL_OPST_DONE && o->state != UCCL_OPST_FAILED)
        rc = uccl__err(UCCL_ERR_INVALID, "operation %llu is still in flight: wait for it first",
                       (unsigned long long)id);
    int free_now = 0;
    if (rc == UCCL_OK) {
        uccl__idmap_del(&cm->ops, id);
        /* A thread still inside uccl_comm_wait on it frees it on leaving. */
        o->released = 1;
        free_now = o->waiters == 0;
    }
    pthread_mutex_unlock(&cm->mu);
    if (free_now)
        uccl__op_free(o);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* shutdown                                                                   */

void uccl_comm_shutdown(uccl_comm_t *cm)
{
    if (!cm)
        return;
    pthread_mutex_lock(&cm->mu);
    int join = cm->worker_started && !cm->stop;
    cm->stop = 1;
    pthread_cond_broadcast(&cm->work_cv);
    pthread_cond_broadcast(&cm->cv);
    pthread_mutex_unlock(&cm->mu);
    if (join)
        pthread_join(cm->worker, NULL);
    pthread_mutex_lock(&cm->mu);
    /* A waiter still advancing cur sees stop at its next slice. */
    while (cm->executing)
        pthread_cond_wait(&cm->cv, &cm->mu);
    if (cm->cur && take(cm, cm->cur))
        run_slice(cm, cm->cur, 0); /* stops it: nothing lands in its buffers afterwards */
    for (struct uccl__op *o; (o = TAILQ_FIRST(&cm->queue));) {
        unlink_queued(cm, o);
        fail_queued(o, UCCL_ERR_CLOSED, "the communicator was shut down", "");
    }
    pthread_cond_broadcast(&cm->cv);
    pthread_mutex_unlock(&cm->mu);
}

static void free_op_cb(uint64_t id, void *val, void *arg)
{
    (void)id;
    (void)arg;
    uccl__op_free(val);
}

void uccl_comm_destroy(uccl_comm_t *cm)
{
    if (!cm)
        return;
    uccl_comm_shutdown(cm);
    uccl__idmap_each(&cm->ops, free_op_cb, NULL);
    uccl__idmap_free(&cm->ops);
    pthread_mutex_destroy(&cm->mu);
    pthread_cond_destroy(&cm->cv);
    pthread_cond_destroy(&cm->work_cv);
    free(cm->send_conn);
    free(cm->recv_conn);
    free(cm);
}
