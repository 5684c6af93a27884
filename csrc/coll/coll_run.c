/* Running one operation of a communicator (comm.h): posting its
 * transfers through the engine, forwarding pieces as they arrive, waiting
 * for every transfer (this thread polling the connections itself first, so
 * that arrivals need no wake-up), and cleaning up after a failure so that
 * nothing lands in the operation's buffers once it has been reported. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "coll/comm.h"
#include "net/sock.h"
#include "base/status.h"

int uccl__op_err(struct uccl__op *o, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->msg, sizeof(o->msg), fmt, ap);
    va_end(ap);
    return status;
}

void uccl__op_free(struct uccl__op *o)
{
    if (!o)
        return;
    free(o->p2p);
    free(o->recv);
    free(o->tmp_mr);
    free(o->x.id);
    free(o->x.recv);
    free(o->x.peer);
    free(o->diag);
    free(o->fwd);
    uccl_stream_mark_free(o->mark);
    if (o->own_copy) { /* only after a failure's cleanup could not wait it out */
        uccl_stream_mark_wait(o->own_copy, 10000000000ull);
        uccl_stream_mark_free(o->own_copy);
    }
    free(o);
}

static int xlist_push(struct uccl__xlist *x, uint64_t id, int recv, int peer)
{
    if (x->n == x->cap) {
        int cap = x->cap ? x->cap * 2 : 16;
        uint64_t *p = realloc(x->id, (size_t)cap * sizeof(*p));
        if (p)
            x->id = p;
        char *q = p ? realloc(x->recv, (size_t)cap) : NULL;
        if (q)
            x->recv = q;
        int *r = q ? realloc(x->peer, (size_t)cap * sizeof(*r)) : NULL;
        if (!r)
            return UCCL_ERR_NOMEM;
        x->peer = r;
        x->cap = cap;
    }
    x->recv[x->n] = (char)recv;
    x->peer[x->n] = peer;
    x->id[x->n++] = id;
    return UCCL_OK;
}

int uccl__coll_reg(struct uccl__comm *cm, struct uccl__op *o, struct uccl_coll_buf *b)
{
    if (b->mr)
        return UCCL_OK;
    int rc = uccl_ep_reg(cm->ep, b->ptr, b->len, &b->mr);
    if (rc == UCCL_OK)
        o->tmp_mr[o->ntmp++] = b->mr;
    return rc;
}

int uccl__coll_post(struct uccl__comm *cm, struct uccl__op *o, int kind, int peer,
                    const struct uccl_coll_buf *b, size_t off, size_t len)
{
    int recv = (kind & ~UCCL_XFER_BLOCKING) == UCCL_XFER_RECV;
    uint64_t conn = recv ? cm->recv_conn[peer] : cm->send_conn[peer];
    uint64_t id;
    int rc = uccl_ep_post(cm->ep, kind, conn, b->mr, b->ptr + off, len, NULL, 0,
                          UCCL_STREAM_NONE, &id);
    if (rc)
        return uccl__op_err(o, rc, "%s: %s rank %d: %s", o->algo->name,
                            recv ? "recv from" : "send to", peer, uccl_last_error());
    if (xlist_push(&o->x, id, recv, peer)) {
        uccl_ep_abort(cm->ep, id, "out of memory");
        uccl_ep_release(cm->ep, id);
        return uccl__op_err(o, UCCL_ERR_NOMEM, "out of memory");
    }
    return UCCL_OK;
}

void uccl__coll_cleanup(struct uccl__comm *cm, struct uccl__op *o, int failed)
{
    for (int i = o->x.waited; i < o->x.n; i++) {
        if (failed)
            uccl_ep_abort(cm->ep, o->x.id[i], o->msg);
        uccl_ep_release(cm->ep, o->x.id[i]);
    }
    o->x.waited = o->x.n;
    if (o->own_copy && uccl_stream_mark_wait(o->own_copy, uccl_ep_timeout_ns(cm->ep)) == UCCL_OK) {
        uccl_stream_mark_free(o->own_copy); /* nothing of it lands after this */
        o->own_copy = NULL;
    }
    for (int i = 0; i < o->ntmp; i++)
        uccl_ep_dereg(cm->ep, o->tmp_mr[i]);
    o->ntmp = 0;
}


/* Record why transfer i of o failed (its rank named). */
static int xfer_err(struct uccl__op *o, int i, int rc, const char *why)
{
    return uccl__op_err(o, rc, "%s: %s rank %d: %s", o->algo->name,
                        o->x.recv[i] ? "recv from" : "send to", o->x.peer[i], why);
}

/* Wait for transfer i of o until `until`.  First this thread polls every
 * connection the operation still waits on (arrivals handled and copied
 * right here, with no connection thread to wake); then it sleeps on i. */
static int wait_one(struct uccl__comm *cm, struct uccl__op *o, int i, uint64_t deadline,
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
    xfer_err(o, i, rc, uccl_last_error());
    /* The precise cause first: a size mismatch detected by another of our
     * transfers makes the peer give up, which fails this one less clearly
     * ("peer closed"); report the mismatch.  (A tolerant operation waits
     * for every transfer and keeps the first mismatch itself.) */
    for (int k = o->x.waited; k < o->x.n && rc != UCCL_ERR_MISMATCH && !o->tolerant; k++) {
        int done = 0;
        if (k != i && uccl_ep_poll(cm->ep, o->x.id[k], &done) == UCCL_ERR_MISMATCH)
            rc = xfer_err(o, k, UCCL_ERR_MISMATCH, uccl_last_error());
    }
    return rc;
}

/* Transfer i failed with rc: 1 where o goes on (a tolerant operation's size
 * mismatch: the first one's message kept), 0 where o fails now. */
static int tolerated(struct uccl__op *o, int rc)
{
    if (rc == UCCL_ERR_MISMATCH && o->tolerant) {
        if (!o->mismatched++)
            snprintf(o->mmsg, sizeof(o->mmsg), "%s", o->msg);
        return 1;
    }
    if (o->mismatched) { /* the mismatch came first: it is the cause */
        char then[sizeof(o->msg)];
        snprintf(then, sizeof(then), "%s", o->msg);
        uccl__op_err(o, rc, "%.300s; then %.200s", o->mmsg, then);
    }
    return 0;
}

/* Wait until *mark is reached (then free it), or `until` passes (spinning
 * briefly, then yielding, then napping: a GPU producer may run for
 * milliseconds).  what: the mark, in the timeout's message. */
static int wait_mark(struct uccl__op *o, void **mark, uint64_t until, const char *what)
{
    for (unsigned i = 0;; i++) {
        int q = uccl_stream_mark_poll(*mark);
        if (q > 0) {
            uccl_stream_mark_free(*mark);
            *mark = NULL;
            return UCCL_OK;
        }
        if (q < 0)
            return uccl__op_err(o, q, "%s: %s", o->algo->name, uccl_last_error());
        uint64_t now = uccl__now_ns();
        if (now >= o->deadline)
            return uccl__op_err(o, UCCL_ERR_TIMEOUT, "%s: %s did not end within the timeout",
                                o->algo->name, what);
        if (now >= until)
            return UCCL_INPROGRESS;
        if (i < 64)
            continue;
        if (i < 1024)
            sched_yield();
        else
            usleep(20);
    }
}

/* Wait for every transfer o posted, releasing them, until `until`
 * (resumable: cursor and x.waited say how far it got).  Receives first:
 * they need this rank (or its threads) to copy, while a send only waits for
 * the peer's answer; waiting on a send first would leave arrivals on the
 * other connections to their service threads. */
int uccl__coll_finish_transfers(struct uccl__comm *cm, struct uccl__op *o, uint64_t deadline,
                                uint64_t until)
{
    int rc;
    for (; o->cursor < o->x.n; o->cursor++)
        if (o->x.recv[o->cursor] && (rc = wait_one(cm, o, o->cursor, deadline, until)) &&
            (rc == UCCL_INPROGRESS || !tolerated(o, rc)))
            return rc;
    for (; o->x.waited < o->x.n; o->x.waited++) {
        if ((rc = wait_one(cm, o, o->x.waited, deadline, until)) &&
            (rc == UCCL_INPROGRESS || !tolerated(o, rc)))
            return rc;
        uccl_ep_release(cm->ep, o->x.id[o->x.waited]);
    }
    if (o->own_copy && (rc = wait_mark(o, &o->own_copy, until, "the copy of this rank's chunk")))
        return rc;
    uccl__coll_cleanup(cm, o, 0);
    if (o->mismatched) { /* every transfer is over: the connections still agree */
        o->mismatched = 0;
        o->clean = 1;
        return uccl__op_err(o, UCCL_ERR_MISMATCH, "%s", o->mmsg);
    }
    return UCCL_OK;
}

int uccl__coll_advance(struct uccl__comm *cm, struct uccl__op *o, uint64_t until)
{
    int rc;
    if (o->phase == 0 && o->mark &&
        (rc = wait_mark(o, &o->mark, until, "the work queued on the caller's CUDA stream")))
        return rc;
    if (o->phase == 0) {
        if ((rc = o->algo->start(cm, o)))
            return rc;
        o->phase = 1;
        if (o->algo->posted_is_done)
            return UCCL_OK; /* its waiters collect the transfers */
    }
    if (o->phase == 1) {
        for (; o->cursor < o->nfwd; o->cursor++) {
            const struct uccl__fwd *f = &o->fwd[o->cursor];
            if ((rc = wait_one(cm, o, f->rx, o->deadline, until)))
                return rc;
            if ((rc = uccl__coll_post(cm, o, UCCL_XFER_SEND, f->to, &o->recv[f->c], f->off,
                                      f->len)))
                return rc;
        }
        o->phase = 2;
        o->cursor = o->x.waited;
    }
    if (o->phase == 2) {
        rc = uccl__coll_finish_transfers(cm, o, o->deadline, until);
        if (rc != UCCL_ERR_MISMATCH || !o->clean || !o->algo->diagnose || o->nodiag)
            return rc;
        /* Every rank failed alike: each tells every other what it called,
         * exactly (a mismatch now is a failure like any other). */
        char first[sizeof(o->msg)];
        snprintf(first, sizeof(first), "%s", o->msg);
        o->clean = o->tolerant = 0;
        rc = o->algo->diagnose(cm, o);
        if (rc == UCCL_ERR_UNAVAIL) { /* not for this call: its own message */
            o->clean = 1;
            return uccl__op_err(o, UCCL_ERR_MISMATCH, "%s", first);
        }
        if (rc)
            return rc;
        o->phase = 3;
        o->cursor = o->x.waited;
    }
    if ((rc = uccl__coll_finish_transfers(cm, o, o->deadline, until)))
        return rc;
    o->algo->explain(cm, o);
    o->clean = 1;
    return UCCL_ERR_MISMATCH;
}
