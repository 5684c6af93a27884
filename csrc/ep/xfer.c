/* Transfers (uccl.h): the endpoint's table of transfer ids, and posting,
 * polling, waiting for, driving, releasing and abandoning them.  A request
 * lives in the connection layer (conn.h); this table holds one reference
 * per id until release(), so a second poll of a finished id is always
 * answered, never a use after free. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "load/cuda_loader.h"
#include "ep/engine.h"
#include "gpu/gpu.h"
#include "base/status.h"
#include "net/sock.h"

/* A finished transfer keeps answering until release(); once its success
 * has been reported, the table keeps only this marker, not the request.
 * Upstream-style code never releases ids, so the marks are bounded: past
 * ep->done_cap of them, the oldest are dropped from the table (done_floor
 * passes them), and an id below done_floor that the table lacks answers
 * "done" from then on: a released one too, even one that failed (its
 * error was answered until release).  The floor passes the requests it
 * meets (in flight, failed and not released, finished and never polled):
 * they stay, each answering for itself, and one that is reported done
 * below the floor leaves the table then (a capacity receive's length with
 * it).  So one forgotten id does not stop the compaction. */
/* A done mark is the transfer's length, tagged in the low bit (requests are
 * aligned pointers); a compacted id's length is no longer known. */
#define DONE_MARK_OF(len) ((void *)(((uintptr_t)(len) << 1) | 1u))
#define IS_DONE(e) (((uintptr_t)(e) & 1u) != 0)
#define DONE_LEN(e) ((size_t)((uintptr_t)(e) >> 1))
#define DONE_COMPACTED DONE_MARK_OF(UINTPTR_MAX >> 1)

/* Under ep->mu: xfer's entry (a request or a done mark), or NULL. */
static void *req_entry(struct uccl__ep *ep, uint64_t xfer)
{
    void *e = uccl__idmap_get(&ep->reqs, xfer);
    return !e && xfer >= 1 && xfer < ep->done_floor ? DONE_COMPACTED : e;
}

/* Under ep->mu: drop the oldest done marks once there are too many. */
static void compact_done(struct uccl__ep *ep)
{
    while (ep->done_marks > ep->done_cap / 2 && ep->done_floor <= ep->next_req_id) {
        void *e = uccl__idmap_get(&ep->reqs, ep->done_floor);
        if (e && IS_DONE(e)) { /* a request stays: it keeps its answer */
            uccl__idmap_del(&ep->reqs, ep->done_floor);
            ep->done_marks--;
        }
        ep->done_floor++;
    }
}

static const char *op_name(int op)
{
    switch (op) {
    case UCCL_XFER_SEND: return "send";
    case UCCL_XFER_RECV: return "recv";
    case UCCL_XFER_WRITE: return "write";
    case UCCL_XFER_READ: return "read";
    }
    return "?";
}

int uccl_ep_post(uccl_ep_t *ep, int op, uint64_t conn, uint64_t mr, uintptr_t ptr, size_t len,
                 const uint8_t *fifo, size_t fifo_len, uintptr_t stream, uint64_t *xfer_p)
{
    int rc = uccl__ep_check_open(ep);
    if (rc)
        return rc;
    int blocking = (op & UCCL_XFER_BLOCKING) != 0;
    int capacity = (op & UCCL_XFER_CAPACITY) != 0;
    op &= ~(UCCL_XFER_BLOCKING | UCCL_XFER_CAPACITY);
    if (op < UCCL_XFER_SEND || op > UCCL_XFER_READ)
        return uccl__err(UCCL_ERR_INVALID, "unknown transfer kind %d", op);
    struct uccl__fifo_item f = {0};
    if (op == UCCL_XFER_WRITE || op == UCCL_XFER_READ) {
        if ((rc = uccl__fifo_decode(fifo, fifo_len, &f)) != UCCL_OK)
            return rc;
        if (len > f.len)
            return uccl__err(UCCL_ERR_INVALID, "%s of %zu bytes exceeds the %llu bytes the "
                             "peer advertised", op_name(op), len, (unsigned long long)f.len);
    }
    if (capacity && op == UCCL_XFER_RECV)
        len = uccl__mem_room(&ep->local.mem, mr, ptr, len);
    struct uccl__conn *c = uccl__ep_conn_get(ep, conn);
    if (!c)
        return uccl__ep_no_conn(conn);
    if (atomic_load(&c->link.failed)) { /* its failure says what happened (it may be released) */
        rc = uccl__err(c->fail_status == UCCL_ERR_CLOSED ? UCCL_ERR_CLOSED : UCCL_ERR_IO, "%s",
                       c->fail_msg);
        goto out;
    }
    if ((op == UCCL_XFER_RECV) == c->link.is_connector) {
        rc = uccl__err(UCCL_ERR_INVALID, "%s on conn_id %llu: connections are one-way; the side "
                       "that called connect() sends, reads and writes, the side that called "
                       "accept() receives", op_name(op), (unsigned long long)conn);
        goto out;
    }
    static const int to_req[] = {0, UCCL_OP_SEND, UCCL_OP_RECV, UCCL_OP_WRITE, UCCL_OP_READ};
    struct uccl__req *r = uccl__req_new(to_req[op], c, (void *)ptr, len);
    if (!r) {
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
        goto out;
    }
    r->capacity = capacity && op == UCCL_XFER_RECV;
    rc = uccl__tp_mem_keys(&ep->local.mem, mr, ptr, len, &c->link, &r->local_key,
                           &r->key_for_peer, &r->mkind);
    void *ev = NULL; /* device memory: the caller's stream reaches this call */
    if (rc == UCCL_OK && UCCL_MK_ON_GPU(r->mkind) && len > 0 && stream != UCCL_STREAM_NONE)
        rc = uccl__gpu_event_record(UCCL_MK_DEV(r->mkind), stream, &ev);
    if (rc == UCCL_OK && ev && blocking) { /* we wait anyway: wait for the stream here */
        rc = uccl__gpu_event_wait(ev, ep->local.timeout_ns);
        uccl__gpu_event_free(ev);
        ev = NULL;
    }
    if (rc) {
        uccl__gpu_event_free(ev);
        uccl__req_put(r);
        goto out;
    }
    r->fifo = f;
    pthread_mutex_lock(&ep->mu);
    r->id = ++ep->next_req_id;
    rc = uccl__idmap_put(&ep->reqs, r->id, r); /* the table owns the creation reference */
    pthread_mutex_unlock(&ep->mu);
    if (rc) {
        uccl__req_put(r);
        goto out;
    }
    rc = ev ? uccl__gate_add(&ep->gate, c, r, ev, ep->local.timeout_ns)
            : uccl__conn_post(c, r, blocking);
    if (rc) {
        if (ev)
            uccl__gpu_event_free(ev);
        pthread_mutex_lock(&ep->mu);
        uccl__idmap_del(&ep->reqs, r->id);
        pthread_mutex_unlock(&ep->mu);
        uccl__req_put(r);
        goto out;
    }
    *xfer_p = r->id;
out:
    uccl__conn_put(c);
    return rc;
}

/* The request behind xfer (with a reference), a done mark, or NULL. */
static struct uccl__req *req_lookup(struct uccl__ep *ep, uint64_t xfer)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__req *r = req_entry(ep, xfer);
    if (r && !IS_DONE(r))
        uccl__req_get(r);
    pthread_mutex_unlock(&ep->mu);
    if (!r)
        uccl__err(UCCL_ERR_NOTFOUND, "unknown transfer_id %llu (never issued, or released)",
                  (unsigned long long)xfer);
    return r;
}


static void mark_done(struct uccl__ep *ep, struct uccl__req *r)
{
    pthread_mutex_lock(&ep->mu);
    int swap = uccl__idmap_get(&ep->reqs, r->id) == r;
    if (swap && r->id < ep->done_floor) { /* passed by the floor: absent reads as done */
        uccl__idmap_del(&ep->reqs, r->id);
    } else if (swap && uccl__idmap_put(&ep->reqs, r->id, DONE_MARK_OF(r->len)) == UCCL_OK) {
        if (++ep->done_marks > ep->done_cap)
            compact_done(ep);
    } else {
        swap = 0; /* out of memory growing the table: the request stays in it */
    }
    pthread_mutex_unlock(&ep->mu);
    if (swap)
        uccl__req_put(r); /* the table's reference */
}

/* The outcome of a finished request; waits for engine threads to leave its
 * buffer first, so that after an error nothing lands in it any more. */
static int outcome(struct uccl__ep *ep, struct uccl__req *r)
{
    /* Done or failed, an engine thread may still be in the buffer (a peer
     * may answer early, or a copy be ending): wait for it to leave; if it
     * does not soon, fail the connection, which stops it. */
    for (int i = 0; atomic_load(&r->busy) > 0 && i < 20000; i++)
        usleep(50);
    if (atomic_load(&r->busy) > 0) {
        uccl__conn_fail(r->conn, UCCL_ERR_PROTO, "transfer %llu was answered while its bytes "
                        "were still moving", (unsigned long long)r->id);
        for (int i = 0; atomic_load(&r->busy) > 0 && i < 100000; i++)
            usleep(50);
    }
    if (atomic_load(&r->state) == UCCL_REQ_DONE) {
        mark_done(ep, r);
        return UCCL_OK;
    }
    return uccl__err(r->status, "%s", r->msg);
}

int uccl_ep_poll(uccl_ep_t *ep, uint64_t xfer, int *done_p)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r)
        return UCCL_ERR_NOTFOUND;
    if (IS_DONE(r)) {
        *done_p = 1;
        return UCCL_OK;
    }
    unsigned s = atomic_load(&r->state);
    int rc = UCCL_OK;
    /* A finished transfer whose buffer an engine thread is still leaving
     * reads as not done yet: poll never waits. */
    if (s != UCCL_REQ_PENDING && atomic_load(&r->busy) > 0)
        s = UCCL_REQ_PENDING;
    if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
        rc = outcome(ep, r);
    if (rc == UCCL_OK)
        *done_p = s == UCCL_REQ_DONE;
    uccl__req_put(r);
    return rc;
}

int uccl_ep_wait(uccl_ep_t *ep, uint64_t xfer, uint64_t deadline_ns, uint64_t slice_ns)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r)
        return UCCL_ERR_NOTFOUND;
    if (IS_DONE(r))
        return UCCL_OK;
    uint64_t now = uccl__now_ns();
    uint64_t wait = deadline_ns > now ? deadline_ns - now : 0;
    if (wait > slice_ns)
        wait = slice_ns;
    int rc = uccl__req_wait(r, wait);
    if (rc == UCCL_INPROGRESS && uccl__now_ns() >= deadline_ns) {
        /* Nothing may land in this buffer after we give up on it: fail the
         * whole connection (as NCCL aborts a communicator on timeout). */
        uccl__conn_fail(r->conn, UCCL_ERR_TIMEOUT, "%s %llu of %zu bytes timed out: its wait's "
                        "deadline passed (the endpoint's timeout is %.1f s; wait() may have "
                        "been given a shorter one)",
                        r->op == UCCL_OP_SEND ? "send" : r->op == UCCL_OP_RECV ? "recv"
                        : r->op == UCCL_OP_WRITE ? "write" : "read",
                        (unsigned long long)xfer, r->len, (double)ep->local.timeout_ns / 1e9);
        uccl__req_wait(r, 1000000000ull);
    }
    unsigned s = atomic_load(&r->state);
    if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
        rc = outcome(ep, r);
    uccl__req_put(r);
    return rc;
}

/* uccl_ep_copy and uccl_ep_copy_start: mark_p NULL copies to the end. */
static int local_copy(uccl_ep_t *ep, uintptr_t dst, uintptr_t src, size_t len, void **mark_p)
{
    if (mark_p)
        *mark_p = NULL;
    if (len == 0 || dst == src)
        return UCCL_OK;
    if (!uccl__cuda_initialised()) { /* no CUDA memory can exist in this process */
        memmove((void *)dst, (const void *)src, len);
        return UCCL_OK;
    }
    struct uccl__gpu_info d, s;
    int rc = uccl__gpu_classify(dst, len, &d);
    if (rc == UCCL_OK)
        rc = uccl__gpu_classify(src, len, &s);
    if (rc)
        return rc;
    if (!UCCL_MK_ON_GPU(d.mkind) && !UCCL_MK_ON_GPU(s.mkind)) {
        memmove((void *)dst, (const void *)src, len);
        return UCCL_OK;
    }
    if (mark_p && UCCL_MK_ON_GPU(d.mkind) && UCCL_MK_ON_GPU(s.mkind) &&
        UCCL_MK_DEV(d.mkind) == UCCL_MK_DEV(s.mkind))
        return uccl__gpu_copy_start(UCCL_MK_DEV(d.mkind), (void *)dst, (const void *)src, len,
                                    mark_p);
    return uccl__gpu_copy_kinds((void *)dst, d.mkind, (const void *)src, s.mkind, len,
                                ep->local.timeout_ns);
}

int uccl_ep_copy(uccl_ep_t *ep, uintptr_t dst, uintptr_t src, size_t len)
{
    return local_copy(ep, dst, src, len, NULL);
}

int uccl_ep_copy_start(uccl_ep_t *ep, uintptr_t dst, uintptr_t src, size_t len, void **mark_p)
{
    return local_copy(ep, dst, src, len, mark_p);
}

/* The endpoint's pool of stream-wait flags, made on first use. */
static int ep_flags(struct uccl__ep *ep, int dev, struct uccl__gpu_flags **flags_p)
{
    int rc = UCCL_OK;
    pthread_mutex_lock(&ep->mu);
    if (!ep->flags)
        rc = uccl__gpu_flags_new(dev, &ep->flags);
    *flags_p = ep->flags;
    pthread_mutex_unlock(&ep->mu);
    return rc;
}

int uccl_ep_stream_wait(uccl_ep_t *ep, uint64_t xfer, uintptr_t stream, int *queued_p)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r)
        return UCCL_ERR_NOTFOUND;
    if (IS_DONE(r)) {
        *queued_p = 1;
        return UCCL_OK;
    }
    int rc = UCCL_OK;
    if (!UCCL_MK_ON_GPU(r->mkind) || r->len == 0) {
        *queued_p = 0;
    } else if (atomic_load(&r->state) == UCCL_REQ_PENDING) {
        uint32_t *slot, gen;
        int dev = UCCL_MK_DEV(r->mkind);
        struct uccl__gpu_flags *flags;
        rc = ep_flags(ep, dev, &flags);
        if (rc == UCCL_OK)
            rc = uccl__gpu_flag_wait(flags, dev, stream, &slot, &gen);
        if (rc == UCCL_OK)
            uccl__req_flag(r, flags, slot, gen);
        *queued_p = rc == UCCL_OK;
        if (rc == UCCL_ERR_NOMEM) /* no slot free: the caller waits on the host */
            rc = UCCL_OK;
    } else {
        *queued_p = 1; /* finished: the bytes are in place for every stream */
    }
    uccl__req_put(r);
    return rc;
}

#define PROGRESS_MAX 64 /* connections driven at once by uccl_ep_progress */

static int req_finished(struct uccl__req *r)
{
    return IS_DONE(r) || (atomic_load(&r->state) != UCCL_REQ_PENDING &&
                              atomic_load(&r->busy) == 0);
}

int uccl_ep_progress(uccl_ep_t *ep, const uint64_t *xfers, int n, unsigned flags,
                     uint64_t budget_ns)
{
    int all = (flags & UCCL_PROGRESS_ALL) != 0, inline_copies = !(flags & UCCL_PROGRESS_HANDOFF);
    struct uccl__req *reqs[PROGRESS_MAX];
    struct uccl__conn *conns[PROGRESS_MAX];
    int nr = 0, nc = 0, done = 0, first_pending = 0;
    for (int i = 0; i < n && nr < PROGRESS_MAX; i++) {
        struct uccl__req *r = req_lookup(ep, xfers[i]);
        if (!r || IS_DONE(r) || req_finished(r)) {
            if (r && !IS_DONE(r))
                uccl__req_put(r);
            done++;
            if (i == 0 && !all)
                return done; /* the one that matters is finished already */
            continue;
        }
        first_pending |= i == 0;
        reqs[nr++] = r;
        int seen = 0;
        for (int k = 0; k < nc && !seen; k++)
            seen = conns[k] == r->conn;
        if (!seen && uccl__conn_drive_begin(r->conn))
            conns[nc++] = r->conn;
    }
    uint64_t start = uccl__now_ns();
    int left = nr;
    while (left > 0 && nc > 0) {
        for (int k = 0; k < nc; k++)
            uccl__conn_drive_pump(conns[k], inline_copies);
        left = 0;
        for (int i = 0; i < nr; i++)
            left += !req_finished(reqs[i]);
        if (left == 0 || (!all && first_pending && req_finished(reqs[0])) ||
            uccl__now_ns() - start >= budget_ns)
            break;
        sched_yield();
    }
    for (int k = 0; k < nc; k++)
        uccl__conn_drive_end(conns[k]);
    for (int i = 0; i < nr; i++) {
        done += req_finished(reqs[i]);
        uccl__req_put(reqs[i]);
    }
    return done;
}

int uccl_ep_xfer_len(uccl_ep_t *ep, uint64_t xfer, size_t *len_p)
{
    pthread_mutex_lock(&ep->mu);
    void *e = req_entry(ep, xfer);
    int rc = UCCL_OK;
    if (!e || e == DONE_COMPACTED) {
        rc = uccl__err(UCCL_ERR_NOTFOUND, "transfer_id %llu: %s", (unsigned long long)xfer,
                       e ? "its length is no longer kept (compacted past UCCL_P2P_DONE_IDS "
                           "finished ids)" : "unknown (never issued, or released)");
    } else if (IS_DONE(e)) {
        *len_p = DONE_LEN(e);
    } else {
        struct uccl__req *r = e;
        if (atomic_load(&r->state) != UCCL_REQ_DONE)
            rc = atomic_load(&r->state) == UCCL_REQ_PENDING
                     ? UCCL_INPROGRESS
                     : uccl__err(r->status, "%s", r->msg);
        else
            *len_p = r->len;
    }
    pthread_mutex_unlock(&ep->mu);
    return rc;
}

size_t uccl_ep_ids_held(uccl_ep_t *ep)
{
    pthread_mutex_lock(&ep->mu);
    size_t n = ep->reqs.live;
    pthread_mutex_unlock(&ep->mu);
    return n;
}

int uccl_ep_release(uccl_ep_t *ep, uint64_t xfer)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__req *r = req_entry(ep, xfer);
    if (r && !IS_DONE(r) &&
        (atomic_load(&r->state) == UCCL_REQ_PENDING || atomic_load(&r->busy) > 0)) {
        pthread_mutex_unlock(&ep->mu);
        /* Releasing would let the bytes land in a buffer its owner believes free. */
        return uccl__err(UCCL_ERR_INVALID, "transfer_id %llu is still in flight: wait for it "
                         "(or close the endpoint) before releasing it", (unsigned long long)xfer);
    }
    if (r && IS_DONE(uccl__idmap_del(&ep->reqs, xfer)))
        ep->done_marks--;
    pthread_mutex_unlock(&ep->mu);
    if (!r)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown transfer_id %llu (never issued, or "
                         "released)", (unsigned long long)xfer);
    if (!IS_DONE(r))
        uccl__req_put(r);
    return UCCL_OK;
}

int uccl_ep_abort(uccl_ep_t *ep, uint64_t xfer, const char *why)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r || IS_DONE(r))
        return r ? UCCL_OK : UCCL_ERR_NOTFOUND;
    if (atomic_load(&r->state) == UCCL_REQ_PENDING)
        uccl__conn_fail(r->conn, UCCL_ERR_IO, "transfer %llu abandoned: %s",
                        (unsigned long long)xfer, why);
    uccl__req_wait(r, 1000000000ull);
    for (int i = 0; atomic_load(&r->busy) > 0 && i < 100000; i++)
        usleep(50);
    uccl__req_put(r);
    return UCCL_OK;
}

static void put_req_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    (void)arg;
    if (!IS_DONE(v))
        uccl__req_put(v);
}

void uccl__xfers_free(struct uccl__ep *ep)
{
    uccl__idmap_each(&ep->reqs, put_req_entry, NULL);
    uccl__idmap_free(&ep->reqs);
}
