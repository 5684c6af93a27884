/* Collectives over the engine (coll.h): a per-communicator queue started
 * in order and advanced by the waiting caller (or, for async calls, one
 * worker thread), over the engine's public transfer calls
 * (which sit on transport.h).  Direct allgather posts every chunk at once;
 * the ring (two of them, in opposite directions) forwards each piece of a
 * chunk as soon as it has arrived, so a rank's receives and sends overlap. */
#define _GNU_SOURCE
#include "coll.h"

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <time.h>
#include <unistd.h>

#include "idmap.h"
#include "log.h"
#include "sock.h"

#define WORKER_SLICE_NS 20000000ull /* the worker looks at abort requests this often */
#define PIECE_MIN (512u << 10)
#define PIECE_MAX (8u << 20)

enum { OP_P2P = 1, OP_ALLGATHER };
enum { ST_QUEUED = 0, ST_RUNNING, ST_POSTED, ST_DONE, ST_FAILED };

struct xlist {                   /* transfers an operation posted, in order */
    uint64_t *id;
    char *recv;                  /* recv[i]: transfer i is a receive */
    int n, cap, waited;          /* waited: ids [0, waited) are finished and released */
};

struct op {
    uint64_t id;
    int kind, state, algo;
    int status;
    char msg[512];
    atomic_int abort;            /* a waiter gave up: whoever runs it stops it */
    int async;                   /* nobody waits at once: the worker runs it */
    int collecting;              /* p2p: one waiter is collecting the transfers */
    int waiters;                 /* threads inside uccl_comm_wait on it (under cm->mu) */
    int released;                /* forgotten while waited on: the last waiter frees it */
    int phase, cursor;           /* progress: 0 post, 1 ring forwarding, 2 waiting */
    struct fwd { int c, rx, to; size_t off, len; } *fwd; /* ring: forward after receive rx */
    int nfwd;
    int n;                       /* p2p: number of entries */
    struct uccl_coll_p2p *p2p;
    struct uccl_coll_buf send;
    struct uccl_coll_buf *recv;  /* allgather: size entries */
    uint64_t *tmp_mr;            /* registrations made for this operation */
    int ntmp;
    uint64_t deadline;
    struct xlist x;
    TAILQ_ENTRY(op) link;        /* in the communicator's queue while queued */
    int queued;
};

struct uccl__comm {
    uccl_ep_t *ep;
    int rank, size;
    uint64_t *send_conn, *recv_conn;
    size_t piece;                /* UCCL_COLL_PIECE_KB, or 0: chosen per chunk */
    uint64_t poll_ns;            /* UCCL_COLL_POLL_US: a waiter polls this long first */
    int multinode;               /* some peer is reached over TCP (another node) */
    int handoff;                 /* cores to spare: copies run on connection workers, at once */
    pthread_mutex_t mu;          /* everything below */
    pthread_cond_t cv;           /* queue and operation state changes */
    pthread_cond_t work_cv;      /* the worker: async work may be runnable */
    TAILQ_HEAD(, op) queue;      /* submitted, not started */
    struct op *cur;              /* the operation started and not finished (at most one) */
    int executing;               /* a thread is advancing cur (the execution token) */
    struct uccl__idmap ops;
    uint64_t next_id;
    int failed, fail_status;
    char fail_msg[512];
    int stop, worker_started;
    pthread_t worker;
};

static int set_err(int status, char *msg, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int set_err(int status, char *msg, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
    return status;
}

static void op_free(struct op *o)
{
    if (!o)
        return;
    free(o->p2p);
    free(o->recv);
    free(o->tmp_mr);
    free(o->x.id);
    free(o->x.recv);
    free(o->fwd);
    free(o);
}

/* ------------------------------------------------------------------------- */
/* creation                                                                   */

int uccl_comm_create(uccl_ep_t *ep, int rank, int size, const uint64_t *send_conns,
                     const uint64_t *recv_conns, uccl_comm_t **comm_p)
{
    if (size < 1 || rank < 0 || rank >= size)
        return uccl__err(UCCL_ERR_INVALID, "rank %d of world size %d", rank, size);
    int bad = 0;
    long piece_kb = uccl__env_long("UCCL_COLL_PIECE_KB", 0, 4, 1L << 22, &bad);
    long poll_us = uccl__env_long("UCCL_COLL_POLL_US", 200, 0, 1000000, &bad);
    if (bad)
        return UCCL_ERR_INVALID;
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
    cm->piece = (size_t)piece_kb << 10;
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

int uccl_comm_pick_algo(const uccl_comm_t *cm, int algo, size_t chunk)
{
    if (algo != UCCL_AG_AUTO)
        return algo;
    /* Both move (n-1) chunks per rank.  Within a host, direct wins: every
     * copy can run at once, while the ring waits on its neighbour at every
     * step (measured on 2 cores: 8 ranks, 1 MiB: 6.1 ms direct, 22.5 ms
     * ring).  Across nodes with many ranks, the ring crosses each node
     * boundary once per step instead of opening n-1 streams per rank. */
    return cm->multinode && cm->size > 4 && chunk >= (1u << 20) ? UCCL_AG_RING
                                                                 : UCCL_AG_DIRECT;
}

/* ------------------------------------------------------------------------- */
/* running an operation (worker thread)                                        */

static int xlist_push(struct xlist *x, uint64_t id, int recv)
{
    if (x->n == x->cap) {
        int cap = x->cap ? x->cap * 2 : 16;
        uint64_t *p = realloc(x->id, (size_t)cap * sizeof(*p));
        if (p)
            x->id = p;
        char *q = p ? realloc(x->recv, (size_t)cap) : NULL;
        if (!q)
            return UCCL_ERR_NOMEM;
        x->recv = q;
        x->cap = cap;
    }
    x->recv[x->n] = (char)recv;
    x->id[x->n++] = id;
    return UCCL_OK;
}

static int reg_tmp(struct uccl__comm *cm, struct op *o, struct uccl_coll_buf *b)
{
    if (b->mr)
        return UCCL_OK;
    int rc = uccl_ep_reg(cm->ep, b->ptr, b->len, &b->mr);
    if (rc == UCCL_OK)
        o->tmp_mr[o->ntmp++] = b->mr;
    return rc;
}

static const char *what(const struct op *o)
{
    return o->kind == OP_P2P ? "p2p" : o->algo == UCCL_AG_RING ? "ring allgather"
                                                              : "direct allgather";
}

static int post(struct uccl__comm *cm, struct op *o, int kind, int peer,
                const struct uccl_coll_buf *b, size_t off, size_t len)
{
    int recv = (kind & ~UCCL_XFER_BLOCKING) == UCCL_XFER_RECV;
    uint64_t conn = recv ? cm->recv_conn[peer] : cm->send_conn[peer];
    uint64_t id;
    int rc = uccl_ep_post(cm->ep, kind, conn, b->mr, b->ptr + off, len, NULL, 0, &id);
    if (rc)
        return set_err(rc, o->msg, sizeof(o->msg), "%s: %s rank %d: %s", what(o),
                       recv ? "recv from" : "send to", peer, uccl_last_error());
    if (xlist_push(&o->x, id, recv)) {
        uccl_ep_abort(cm->ep, id, "out of memory");
        uccl_ep_release(cm->ep, id);
        return set_err(UCCL_ERR_NOMEM, o->msg, sizeof(o->msg), "out of memory");
    }
    return UCCL_OK;
}


/* After a failure: make sure nothing lands in the operation's buffers any
 * more, then forget its transfers and registrations. */
static void cleanup(struct uccl__comm *cm, struct op *o, int failed)
{
    for (int i = o->x.waited; i < o->x.n; i++) {
        if (failed)
            uccl_ep_abort(cm->ep, o->x.id[i], o->msg);
        uccl_ep_release(cm->ep, o->x.id[i]);
    }
    o->x.waited = o->x.n;
    for (int i = 0; i < o->ntmp; i++)
        uccl_ep_dereg(cm->ep, o->tmp_mr[i]);
    o->ntmp = 0;
}

static size_t piece_for(const struct uccl__comm *cm, size_t len)
{
    if (cm->piece)
        return cm->piece;
    /* Two pieces per part of a chunk: the second is on its way while the
     * first is forwarded, and a piece is still large enough for the copy to
     * be split over threads (16 cores, 4 ranks, 16 MiB per rank: 8.1 ms
     * with 4 MiB pieces, 13.0 ms with 2 MiB). */
    size_t p = len / 2;
    p = p < PIECE_MIN ? PIECE_MIN : p > PIECE_MAX ? PIECE_MAX : p;
    return (p + 4095) & ~(size_t)4095;
}

/* Post bytes [off, off + len) of chunk c (this rank's own when c < 0) as
 * pieces: at least one, so an empty region is still matched and a length
 * mismatch shows.  With to >= 0, also record each piece as a forward to that
 * rank, made once the piece has arrived. */
static int post_pieces(struct uccl__comm *cm, struct op *o, int kind, int peer, int c,
                       size_t off, size_t len, int to)
{
    const struct uccl_coll_buf *b = c < 0 ? &o->send : &o->recv[c];
    size_t p = piece_for(cm, len), end = off + len;
    do {
        size_t n = end - off < p ? end - off : p;
        int rc = post(cm, o, kind, peer, b, off, n);
        if (rc)
            return rc;
        if (to >= 0) {
            struct fwd *f = realloc(o->fwd, (size_t)(o->nfwd + 1) * sizeof(*f));
            if (!f)
                return set_err(UCCL_ERR_NOMEM, o->msg, sizeof(o->msg), "out of memory");
            o->fwd = f;
            f[o->nfwd++] = (struct fwd){.c = c, .rx = o->x.n - 1, .to = to, .off = off, .len = n};
        }
        off += n;
    } while (off < end);
    return UCCL_OK;
}

/* The ring runs two rings at once: the first part of every chunk travels
 * clockwise, the rest counter-clockwise, so each rank copies from both
 * neighbours at once (twice the copies in flight of one ring) and every link
 * carries traffic both ways.  Small chunks (and 2 ranks) go one way only. */
#define BIDIR_MIN (1u << 20)

static size_t clockwise_part(const struct uccl__comm *cm, size_t len)
{
    if (cm->size < 3 || len < BIDIR_MIN)
        return len;
    return ((len / 2) + 4095) & ~(size_t)4095;
}

static void copy_own(struct uccl__comm *cm, struct op *o)
{
    struct uccl_coll_buf *own = &o->recv[cm->rank];
    if (own->ptr != o->send.ptr && o->send.len)
        memmove((void *)own->ptr, (const void *)o->send.ptr, o->send.len);
}

/* Phase 0: registrations and every transfer that can be posted now. */
static int start_op(struct uccl__comm *cm, struct op *o)
{
    int n = cm->size, me = cm->rank, rc = UCCL_OK;
    if (o->kind == OP_P2P) {
        for (int i = 0; i < o->n && rc == UCCL_OK; i++) {
            struct uccl_coll_p2p *e = &o->p2p[i];
            if ((rc = reg_tmp(cm, o, &e->buf)))
                return set_err(rc, o->msg, sizeof(o->msg), "p2p: %s", uccl_last_error());
            rc = post(cm, o, e->op, e->peer, &e->buf, 0, e->buf.len);
        }
        return rc;
    }
    rc = reg_tmp(cm, o, &o->send);
    for (int r = 0; r < n && rc == UCCL_OK; r++)
        if (r != me)
            rc = reg_tmp(cm, o, &o->recv[r]);
    if (rc)
        return set_err(rc, o->msg, sizeof(o->msg), "allgather: %s", uccl_last_error());
    /* Sends first, so that peers can start pulling; then this rank's own
     * chunk; then the receives.  A caller that waits at once posts them
     * "blocking": a peer's announcement already in is pulled right here,
     * on this thread, instead of being handed to the connection's worker. */
    int rflag = o->async || cm->handoff ? 0 : UCCL_XFER_BLOCKING;
    if (o->algo == UCCL_AG_DIRECT) {
        /* Staggered, so that the ranks do not all start with rank 0. */
        for (int i = 1; i < n && rc == UCCL_OK; i++)
            rc = post(cm, o, UCCL_XFER_SEND, (me + i) % n, &o->send, 0, o->send.len);
        if (rc == UCCL_OK)
            copy_own(cm, o);
        for (int i = 1; i < n && rc == UCCL_OK; i++) {
            int r = (me - i + n) % n;
            rc = post(cm, o, UCCL_XFER_RECV | rflag, r, &o->recv[r], 0, o->recv[r].len);
        }
        return rc;
    }
    if (n == 1) {
        copy_own(cm, o);
        return UCCL_OK;
    }
    /* Ring: at step s the clockwise ring receives chunk me-1-s from the left
     * and the counter-clockwise one chunk me+1+s from the right; the chunks
     * of steps 0..n-3 are passed on piece by piece as they arrive. */
    int left = (me - 1 + n) % n, right = (me + 1) % n;
    size_t h = clockwise_part(cm, o->send.len);
    rc = post_pieces(cm, o, UCCL_XFER_SEND, right, -1, 0, h, -1);
    if (rc == UCCL_OK && n > 2)
        rc = post_pieces(cm, o, UCCL_XFER_SEND, left, -1, h, o->send.len - h, -1);
    if (rc == UCCL_OK)
        copy_own(cm, o);
    for (int s = 0; s < n - 1 && rc == UCCL_OK; s++) {
        int cw = (me - 1 - s + 2 * n) % n, ccw = (me + 1 + s) % n;
        size_t hc = clockwise_part(cm, o->recv[cw].len);
        rc = post_pieces(cm, o, UCCL_XFER_RECV | rflag, left, cw, 0, hc,
                         s < n - 2 ? right : -1);
        if (rc == UCCL_OK && n > 2) {
            size_t hcc = clockwise_part(cm, o->recv[ccw].len);
            rc = post_pieces(cm, o, UCCL_XFER_RECV | rflag, right, ccw, hcc,
                             o->recv[ccw].len - hcc, s < n - 2 ? left : -1);
        }
    }
    return rc;
}

/* Wait for transfer i of o until `until`.  First this thread polls every
 * connection the operation still waits on (arrivals handled and copied
 * right here, with no connection thread to wake); then it sleeps on i. */
static int wait_one(struct uccl__comm *cm, struct op *o, int i, uint64_t deadline,
                    uint64_t until)
{
    uint64_t now = uccl__now_ns();
    if (until > now && o->x.n > o->x.waited) {
        /* transfer i first: the polling ends once it is finished */
        uint64_t ids[64];
        int k = 0;
        ids[k++] = o->x.id[i];
        for (int j = o->x.waited; j < o->x.n && k < 64; j++)
            if (j != i)
                ids[k++] = o->x.id[j];
        uccl_ep_progress(cm->ep, ids, k, cm->handoff ? UCCL_PROGRESS_HANDOFF : 0,
                         until - now < cm->poll_ns ? until - now : cm->poll_ns);
    }
    now = uccl__now_ns();
    int rc = uccl_ep_wait(cm->ep, o->x.id[i], deadline, until > now ? until - now : 0);
    if (rc == UCCL_INPROGRESS || rc == UCCL_OK)
        return rc;
    set_err(rc, o->msg, sizeof(o->msg), "%s: %s", what(o), uccl_last_error());
    /* The precise cause first: a size mismatch detected by another of our
     * transfers makes the peer give up, which fails this one less clearly
     * ("peer closed"); report the mismatch. */
    for (int k = o->x.waited; k < o->x.n && rc != UCCL_ERR_MISMATCH; k++) {
        int done = 0;
        if (k != i && uccl_ep_poll(cm->ep, o->x.id[k], &done) == UCCL_ERR_MISMATCH)
            rc = set_err(UCCL_ERR_MISMATCH, o->msg, sizeof(o->msg), "%s: %s", what(o),
                         uccl_last_error());
    }
    return rc;
}

/* Wait for every transfer o posted, releasing them, until `until`
 * (resumable: cursor and x.waited say how far it got).  Receives first:
 * they need this rank (or its threads) to copy, while a send only waits for
 * the peer's answer; waiting on a send first would leave arrivals on the
 * other connections to their service threads. */
static int finish_transfers(struct uccl__comm *cm, struct op *o, uint64_t deadline,
                            uint64_t until)
{
    int rc;
    for (; o->cursor < o->x.n; o->cursor++)
        if (o->x.recv[o->cursor] && (rc = wait_one(cm, o, o->cursor, deadline, until)))
            return rc;
    for (; o->x.waited < o->x.n; o->x.waited++) {
        if ((rc = wait_one(cm, o, o->x.waited, deadline, until)))
            return rc;
        uccl_ep_release(cm->ep, o->x.id[o->x.waited]);
    }
    cleanup(cm, o, 0);
    return UCCL_OK;
}

/* Advance o (the caller holds the execution token) until it is finished
 * (p2p: posted) or `until` passes: UCCL_OK, UCCL_INPROGRESS or an error. */
static int advance(struct uccl__comm *cm, struct op *o, uint64_t until)
{
    int rc;
    if (o->phase == 0) {
        if ((rc = start_op(cm, o)))
            return rc;
        o->phase = 1;
        if (o->kind == OP_P2P)
            return UCCL_OK; /* its waiters collect the transfers */
    }
    if (o->phase == 1) {
        for (; o->cursor < o->nfwd; o->cursor++) {
            const struct fwd *f = &o->fwd[o->cursor];
            if ((rc = wait_one(cm, o, f->rx, o->deadline, until)))
                return rc;
            if ((rc = post(cm, o, UCCL_XFER_SEND, f->to, &o->recv[f->c], f->off, f->len)))
                return rc;
        }
        o->phase = 2;
        o->cursor = o->x.waited;
    }
    return finish_transfers(cm, o, o->deadline, until);
}

static void fail_comm(struct uccl__comm *cm, int status, const char *msg)
{
    if (cm->failed)
        return;
    cm->failed = 1;
    cm->fail_status = status;
    snprintf(cm->fail_msg, sizeof(cm->fail_msg), "%s", msg);
}

/* Under cm->mu: an operation that will never run. */
static void fail_queued(struct op *o, int status, const char *why, const char *detail)
{
    o->state = ST_FAILED;
    o->status = status;
    snprintf(o->msg, sizeof(o->msg), "%s%.300s%s", why, detail, *detail ? ")" : "");
}

/* Under cm->mu: take o out of the queue (if it is there). */
static void unlink_queued(struct uccl__comm *cm, struct op *o)
{
    if (o->queued)
        TAILQ_REMOVE(&cm->queue, o, link);
    o->queued = 0;
}

/* Under cm->mu: may the calling thread advance o now?  Operations start
 * strictly in order and one at a time, so posts reach every connection in
 * the order all ranks issued them. */
static int runnable(const struct uccl__comm *cm, const struct op *o)
{
    return !cm->executing && (cm->cur == o || (!cm->cur && TAILQ_FIRST(&cm->queue) == o));
}

/* Under cm->mu, o runnable: take the execution token for it (starting it if
 * queued).  0: it must not run (an earlier operation failed), and is failed. */
static int take(struct uccl__comm *cm, struct op *o)
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
        o->state = ST_RUNNING;
        o->deadline = uccl__now_ns() + uccl_ep_timeout_ns(cm->ep);
    }
    cm->executing = 1;
    return 1;
}

/* Under cm->mu: o came to rest with rc (not UCCL_INPROGRESS). */
static void settle(struct uccl__comm *cm, struct op *o, int rc, int ok_state)
{
    if (rc == UCCL_OK) {
        o->state = ok_state;
        return;
    }
    o->status = rc;
    o->state = ST_FAILED;
    fail_comm(cm, rc, o->msg);
}

/* Under cm->mu with the token for o: advance it until `until` without the
 * lock, then give the token back.  An abandoned operation is stopped here. */
static int run_slice(struct uccl__comm *cm, struct op *o, uint64_t until)
{
    int stop = cm->stop;
    pthread_mutex_unlock(&cm->mu);
    int rc = atomic_load(&o->abort) || stop ? UCCL_INPROGRESS : advance(cm, o, until);
    if (rc == UCCL_INPROGRESS && (atomic_load(&o->abort) || stop))
        rc = set_err(stop ? UCCL_ERR_CLOSED : UCCL_ERR_TIMEOUT, o->msg, sizeof(o->msg),
                     "%s abandoned: %s", what(o), stop ? "the communicator was shut down"
                     : "its caller gave up (timeout or interrupt)");
    if (rc != UCCL_OK && rc != UCCL_INPROGRESS)
        cleanup(cm, o, 1);
    pthread_mutex_lock(&cm->mu);
    cm->executing = 0;
    if (rc != UCCL_INPROGRESS) {
        cm->cur = NULL;
        settle(cm, o, rc, o->kind == OP_P2P ? ST_POSTED : ST_DONE);
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
        struct op *o = cm->cur ? cm->cur : TAILQ_FIRST(&cm->queue);
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

static int submit(struct uccl__comm *cm, struct op *o, int async, uint64_t *op_p)
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
        op_free(o);
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

int uccl_comm_p2p(uccl_comm_t *cm, const struct uccl_coll_p2p *ops, int n, uint64_t *op_p)
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
    struct op *o = calloc(1, sizeof(*o));
    if (o) {
        o->p2p = malloc((size_t)n * sizeof(*ops));
        o->tmp_mr = calloc((size_t)n, sizeof(uint64_t));
    }
    if (!o || !o->p2p || !o->tmp_mr) {
        op_free(o);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(o->p2p, ops, (size_t)n * sizeof(*ops));
    o->kind = OP_P2P;
    o->n = n;
    return submit(cm, o, 1, op_p);
}

int uccl_comm_allgather(uccl_comm_t *cm, const struct uccl_coll_buf *send,
                        const struct uccl_coll_buf *recv, int algo, int async, uint64_t *op_p)
{
    int n = cm->size, me = cm->rank, rc;
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
    struct op *o = calloc(1, sizeof(*o));
    if (o) {
        o->recv = malloc((size_t)n * sizeof(*recv));
        o->tmp_mr = calloc((size_t)n + 1, sizeof(uint64_t));
    }
    if (!o || !o->recv || !o->tmp_mr) {
        op_free(o);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    memcpy(o->recv, recv, (size_t)n * sizeof(*recv));
    o->send = *send;
    o->kind = OP_ALLGATHER;
    o->algo = algo;
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
    struct op *o = uccl__idmap_get(&cm->ops, id);
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
        if (o->state == ST_DONE) {
            rc = UCCL_OK;
            break;
        }
        if (o->state == ST_FAILED) {
            rc = uccl__err(o->status, "%s", o->msg);
            break;
        }
        if (o->state == ST_POSTED && !o->collecting) {
            o->collecting = 1; /* p2p: one thread collects the posted transfers */
            pthread_mutex_unlock(&cm->mu);
            rc = finish_transfers(cm, o, deadline, until);
            if (rc != UCCL_OK && rc != UCCL_INPROGRESS)
                cleanup(cm, o, 1);
            pthread_mutex_lock(&cm->mu);
            o->collecting = 0;
            if (rc != UCCL_INPROGRESS)
                settle(cm, o, rc, ST_DONE);
            pthread_cond_broadcast(&cm->cv);
            if (rc == UCCL_INPROGRESS && uccl__now_ns() >= until)
                break;
            continue;
        }
        now = uccl__now_ns();
        if (now >= deadline && o->state != ST_POSTED) {
            /* Give up: a queued operation never runs; a started one is
             * stopped by whoever advances it next (us, if nobody does). */
            atomic_store(&o->abort, 1);
            if (o->state == ST_QUEUED && !runnable(cm, o)) { /* behind another one */
                unlink_queued(cm, o);
                fail_queued(o, UCCL_ERR_TIMEOUT, "timed out while queued behind earlier "
                            "operations", "");
                fail_comm(cm, UCCL_ERR_TIMEOUT, o->msg);
                pthread_cond_broadcast(&cm->cv);
                continue;
            }
        }
        if (now >= deadline && o->state == ST_POSTED) { /* another thread collects it */
            rc = uccl__err(UCCL_ERR_TIMEOUT, "operation %llu: timed out while another thread "
                           "waits for it", (unsigned long long)id);
            break;
        }
        if ((o->state == ST_QUEUED || o->state == ST_RUNNING) && runnable(cm, o)) {
            if (take(cm, o))
                run_slice(cm, o, until);
            if (uccl__now_ns() >= until && o->state != ST_DONE && o->state != ST_FAILED &&
                o->state != ST_POSTED) {
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
        op_free(o);
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
    struct op *o = uccl__idmap_get(&cm->ops, id);
    int rc = UCCL_OK;
    if (!o)
        rc = uccl__err(UCCL_ERR_NOTFOUND, "unknown operation %llu", (unsigned long long)id);
    else if (o->state != ST_DONE && o->state != ST_FAILED)
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
        op_free(o);
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
    for (struct op *o; (o = TAILQ_FIRST(&cm->queue));) {
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
    op_free(val);
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
