/* RDMA: the movers and their completions, on a connection's QPs
 * (tp_rdma.h; set up by tp_rdma.c).
 *
 * uccl__rdma_move moves bytes between local memory and the peer's: RDMA
 * READs, or WRITEs ending in a WRITE_WITH_IMM when asked, cut into chunks
 * striped round-robin over the QPs, so several NICs and several QPs carry
 * one message.  Memory no NIC could register (staged, tp_rdma_dev.c) goes
 * through the connection's own page-locked chunk, chunk by chunk, copied in
 * before a WRITE or out after a READ.  The pull and push ops (tp_rdma.c)
 * and the staging ring's sender (tp_rdma_stage.c) move this way.
 *
 * Completions: each QP has its own CQ.  A mover posts its chunks signaled,
 * with a shared counter as wr_id, and polls the CQs (spinning briefly, then
 * sleeping in growing steps) until its counter drains; any thread that polls
 * hands each completion to its owner.  A progress thread per connection
 * polls too, slowly, to repost consumed receives.  A failed completion or a
 * timeout fails the connection, which moves every QP to ERR: the NIC
 * flushes what is left, so a mover never returns while its WRs may still
 * write into its buffer. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tp/transport.h"
#include "gpu/gpu.h"
#include "base/status.h"
#include "tp/tp_rdma.h"

#define RECV_WR_ID 0          /* wr_id of the standing receives (a mover's is its struct rop) */

struct rop {                  /* one mover's WRs, shared with whoever polls */
    atomic_int refs;          /* the mover, plus one per WR posted */
    atomic_int left;          /* WRs not completed */
    atomic_int status;        /* first failed wc status + 1, 0 if none */
    atomic_uint bad_qp;
};

static void rop_put(struct rop *op)
{
    if (atomic_fetch_sub(&op->refs, 1) == 1)
        free(op);
}

static const char *wc_status_str(int s)
{
    switch (s) {
    case IBV_WC_SUCCESS_: return "success";
    case 4: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR_: return "flushed (the QP is in the error state)";
    case IBV_WC_REM_ACCESS_ERR_: return "remote access error (bad rkey, range or rights)";
    case IBV_WC_RETRY_EXC_ERR_: return "transport retry count exceeded (peer gone?)";
    case IBV_WC_RNR_RETRY_EXC_ERR_: return "receiver not ready, retries exceeded";
    default: return "error";
    }
}

/* ---- completions ------------------------------------------------------------- */

int uccl__rdma_post_recvs(struct uccl__rdma_qp *q, int n)
{
    struct ibv_recv_wr_s wr[UCCL_RDMA_RQ_DEPTH];
    if (n > UCCL_RDMA_RQ_DEPTH)
        n = UCCL_RDMA_RQ_DEPTH;
    for (int i = 0; i < n; i++)
        wr[i] = (struct ibv_recv_wr_s){.wr_id = RECV_WR_ID, .next = i + 1 < n ? &wr[i + 1] : NULL};
    struct ibv_recv_wr_s *bad;
    return n > 0 ? uccl__ibv_post_recv(q->qp, wr, &bad) : 0;
}

/* Poll every CQ of the connection once; completions go to their owners.
 * A failed receive (the peer's QP went away) is reported by the progress
 * thread only (report): a mover learns of failure from its own WRs.
 * Returns how many were handled. */
static int progress_ex(struct uccl__link *lk, int report)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    int handled = 0;
    if (!atomic_load(&t->ready))
        return 0;
    for (unsigned i = 0; i < t->nqp; i++) {
        struct uccl__rdma_qp *q = &t->q[i];
        if (pthread_mutex_trylock(&q->poll_mu))
            continue;
        struct ibv_wc_s wc[32];
        int n = uccl__ibv_poll_cq(q->cq, 32, wc);
        int reposts = 0, recv_failed = 0;
        for (int k = 0; k < n; k++) {
            /* By wr_id, not opcode: a NIC leaves the opcode of an error
             * completion undefined. */
            if (wc[k].wr_id == RECV_WR_ID) { /* one of our standing receives */
                if (wc[k].status == IBV_WC_SUCCESS_) {
                    atomic_fetch_add(&t->imm_seen, 1);
                    reposts++;
                } else {
                    recv_failed = wc[k].status;
                }
                continue;
            }
            struct rop *op = (struct rop *)(uintptr_t)wc[k].wr_id;
            atomic_fetch_sub(&q->inflight, 1);
            if (wc[k].status != IBV_WC_SUCCESS_) {
                int none = 0;
                atomic_compare_exchange_strong(&op->status, &none, wc[k].status + 1);
                atomic_store(&op->bad_qp, i);
            }
            atomic_fetch_sub(&op->left, 1);
            rop_put(op);
        }
        if (reposts && !atomic_load(&t->stop) && uccl__rdma_post_recvs(q, reposts))
            recv_failed = -1;
        pthread_mutex_unlock(&q->poll_mu);
        handled += n;
        if (recv_failed && !report)
            atomic_store(&t->recv_broken, recv_failed);
        if (report && !recv_failed)
            recv_failed = atomic_exchange(&t->recv_broken, 0);
        if (recv_failed && report && !atomic_load(&t->stop)) {
            /* A closing peer says BYE on the control socket, which may be
             * read a moment after its QPs went: give it that moment, so a
             * clean close is not reported as a failure (as tp_tcp.c does). */
            for (int k = 0; k < 50 && !atomic_load(&lk->failed); k++)
                usleep(2000);
            uccl__conn_fail(lk->conn, UCCL_ERR_IO, "RDMA QP %u: %s", q->qp->qp_num,
                            recv_failed < 0 ? "reposting a receive failed"
                                            : wc_status_str(recv_failed));
        }
    }
    return handled;
}

static int progress(struct uccl__link *lk) { return progress_ex(lk, 0); }

/* Sleep in growing steps: a 2-core machine must not lose a core to a poller. */
static void backoff(unsigned *spins)
{
    if (*spins < 64) {
        (*spins)++;
        sched_yield();
        return;
    }
    unsigned us = *spins < 1000 ? 20 + (*spins - 64) : 1000;
    (*spins)++;
    usleep(us);
}

void *uccl__rdma_progress_main(void *arg)
{
    struct uccl__link *lk = arg;
    struct uccl__rdma_conn *t = lk->tp_priv;
    while (!atomic_load(&t->stop)) {
        if (progress_ex(lk, 1) == 0)
            usleep(2000); /* only receives to repost: they are deep, and RNR retries forever */
    }
    return NULL;
}

/* ---- movers -------------------------------------------------------------------- */

static uint32_t peer_rkey(const struct uccl__rdma_conn *t, unsigned qi, uint64_t key)
{
    return (uint32_t)(key >> (32 * (qi % t->peer_ndev)));
}

static int post_one(struct uccl__link *lk, struct rop *op, unsigned qi, int opcode, char *local,
                    uint32_t lkey, uint64_t raddr, uint64_t rkey, size_t len, uint32_t imm)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    struct uccl__rdma_qp *q = &t->q[qi];
    struct ibv_sge_s sge = {.addr = (uint64_t)(uintptr_t)local, .length = (uint32_t)len,
                            .lkey = lkey};
    struct ibv_send_wr_s wr = {.wr_id = (uint64_t)(uintptr_t)op, .sg_list = &sge, .num_sge = 1,
                               .opcode = opcode, .send_flags = IBV_SEND_SIGNALED_,
                               .imm_data = htonl(imm)};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = peer_rkey(t, qi, rkey);
    struct ibv_send_wr_s *bad;
    atomic_fetch_add(&op->refs, 1);
    atomic_fetch_add(&op->left, 1);
    atomic_fetch_add(&q->inflight, 1);
    int rc = uccl__ibv_post_send(q->qp, &wr, &bad);
    if (rc) {
        atomic_fetch_sub(&q->inflight, 1);
        atomic_fetch_sub(&op->left, 1);
        atomic_fetch_sub(&op->refs, 1);
        return uccl__err(UCCL_ERR_IO, "ibv_post_send on QP %u failed: %s", q->qp->qp_num,
                         strerror(rc));
    }
    return UCCL_OK;
}

/* Poll until all of op's WRs completed, one failed (unless draining: then
 * until all completed, flushed or not), or the deadline passes. */
static int wait_op(struct uccl__link *lk, struct rop *op, uint64_t deadline, int drain)
{
    unsigned spins = 0;
    while (atomic_load(&op->left) > 0) {
        if (!drain && atomic_load(&op->status))
            return UCCL_ERR_IO;
        if (progress(lk) > 0) {
            spins = 0;
            continue;
        }
        if (uccl__now_ns() > deadline)
            return UCCL_ERR_TIMEOUT;
        backoff(&spins);
    }
    return atomic_load(&op->status) ? UCCL_ERR_IO : UCCL_OK;
}

/* Wait until a slot frees on QP qi. */
static int wait_slot(struct uccl__link *lk, struct rop *op, unsigned qi, uint64_t deadline)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    unsigned spins = 0;
    while (atomic_load(&t->q[qi].inflight) >= UCCL_RDMA_SQ_DEPTH) {
        if (atomic_load(&op->status) || atomic_load(&lk->failed))
            return UCCL_ERR_IO;
        if (progress(lk) > 0)
            continue;
        if (uccl__now_ns() > deadline)
            return UCCL_ERR_TIMEOUT;
        backoff(&spins);
    }
    return UCCL_OK;
}

/* The connection's own staging chunk, for memory of kind mk, locked for one
 * move (none on an error); own_give lets it go. */
static int own_take(struct uccl__rdma_conn *t, uint32_t mk, const struct uccl__rdma_area **a_p)
{
    pthread_mutex_lock(&t->own_mu);
    int rc = UCCL_OK;
    if (!t->own.p || t->own.for_mk != uccl__rdma_stage_kind(mk)) { /* another device's */
        uccl__rdma_area_free(&t->own);
        rc = uccl__rdma_area_make(&t->own, uccl__rdma_stage_kind(mk), t->chunk,
                                  IBV_ACCESS_LOCAL_WRITE_);
    }
    if (rc) {
        pthread_mutex_unlock(&t->own_mu);
        return rc;
    }
    *a_p = &t->own;
    return UCCL_OK;
}

static void own_give(struct uccl__rdma_conn *t) { pthread_mutex_unlock(&t->own_mu); }

/* Move len bytes between local (its region's key from mem_reg) and the
 * peer's raddr (its rkeys): READ them in, or WRITE them out, with imm
 * ending in a WRITE_WITH_IMM once every other chunk has landed.  Memory no
 * NIC could register (staged) goes through the connection's own staging
 * chunk (own_take), one chunk at a time. */
int uccl__rdma_move(struct uccl__link *lk, int read, char *local, uint64_t local_key,
                    uint64_t raddr, uint64_t rkey, size_t len, int imm)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    const struct uccl__rdma_mr *m = (const struct uccl__rdma_mr *)(uintptr_t)local_key;
    const char *what = read ? "RDMA READ" : "RDMA WRITE";
    if (len == 0)
        return UCCL_OK;
    unsigned ndev = 0;
    uccl__rdma_devs(&ndev);
    int staged = uccl__rdma_staged(local_key);
    if (!staged && (!m || m->magic != UCCL_RDMA_MR_MAGIC || m->err[0] || m->n != ndev))
        return uccl__err(UCCL_ERR_UNAVAIL, "%s of %zu bytes: the local buffer cannot move over "
                         "RDMA: %s", what, len, m && m->magic == UCCL_RDMA_MR_MAGIC && m->err[0]
                         ? m->err : "it is not registered with every NIC");
    if (rkey == 0) /* staged memory there streams (proto_stream.c): never addressed */
        return uccl__err(UCCL_ERR_PROTO, "%s of %zu bytes: the peer gave no rkey for its "
                         "buffer", what, len);
    struct rop *op = calloc(1, sizeof(*op));
    if (!op)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    const struct uccl__rdma_area *sa = NULL;
    int rc = staged ? own_take(t, m->mkind, &sa) : UCCL_OK;
    int post_failed = rc != UCCL_OK;
    atomic_init(&op->refs, 1);
    uint64_t deadline = uccl__now_ns() + lk->local->timeout_ns;
    size_t nchunks = (len + t->chunk - 1) / t->chunk;
    uint32_t seq = atomic_fetch_add(&t->next_imm, 1);
    for (size_t k = 0; k < nchunks && rc == UCCL_OK; k++) {
        unsigned qi = (unsigned)((k + seq) % t->nqp), dev = t->q[qi].dev;
        size_t off = k * t->chunk, n = len - off < t->chunk ? len - off : t->chunk;
        int last_write = !read && imm && k + 1 == nchunks;
        char *at = staged ? sa->p : local + off;
        /* QPs are not ordered among themselves: the immediate, which tells
         * the receiver the message is whole, goes after every other chunk. */
        if (last_write)
            rc = wait_op(lk, op, deadline, 0);
        if (rc == UCCL_OK)
            rc = wait_slot(lk, op, qi, deadline);
        if (rc == UCCL_OK && staged && !read) { /* into the staging chunk first */
            rc = uccl__gpu_copy_kinds(at, sa->mk, local + off, m->mkind, n, lk->local->timeout_ns);
            post_failed = rc != UCCL_OK;
        }
        if (rc == UCCL_OK) {
            rc = post_one(lk, op, qi, read ? IBV_WR_RDMA_READ_ : last_write
                          ? IBV_WR_RDMA_WRITE_WITH_IMM_ : IBV_WR_RDMA_WRITE_, at,
                          staged ? sa->mr[dev]->lkey : m->mr[dev]->lkey, raddr + off, rkey,
                          n, seq);
            post_failed = rc != UCCL_OK;
        }
        if (rc == UCCL_OK && staged) /* the chunk is reused: this one must be done */
            rc = wait_op(lk, op, deadline, 0);
        if (rc == UCCL_OK && staged && read) { /* then out of it */
            rc = uccl__gpu_copy_kinds(local + off, m->mkind, at, sa->mk, n, lk->local->timeout_ns);
            post_failed = rc != UCCL_OK;
        }
    }
    if (rc == UCCL_OK)
        rc = wait_op(lk, op, deadline, 0);
    if (rc == UCCL_OK) {
        if (sa)
            own_give(t);
        rop_put(op);
        return UCCL_OK;
    }
    int st = atomic_load(&op->status);
    char msg[300];
    if (post_failed)
        snprintf(msg, sizeof(msg), "%s of %zu bytes: %s", what, len, uccl_last_error());
    else if (st)
        snprintf(msg, sizeof(msg), "%s of %zu bytes failed on QP %u: %s (wc status %d)", what,
                 len, t->q[atomic_load(&op->bad_qp) % t->nqp].qp->qp_num,
                 wc_status_str(st - 1), st - 1);
    else if (rc == UCCL_ERR_TIMEOUT)
        snprintf(msg, sizeof(msg), "%s of %zu bytes did not complete within %.0f s", what, len,
                 (double)lk->local->timeout_ns / 1e9);
    else
        snprintf(msg, sizeof(msg), "%s of %zu bytes stopped: the connection failed", what, len);
    /* Every QP to ERR (conn_shutdown): the NIC flushes what is left, and
     * only then may the caller reuse the buffer. */
    rc = rc == UCCL_ERR_TIMEOUT ? UCCL_ERR_TIMEOUT : UCCL_ERR_IO;
    uccl__conn_fail(lk->conn, rc, "%s", msg);
    wait_op(lk, op, uccl__now_ns() + 5000000000ull, 1);
    if (sa)
        own_give(t);
    rop_put(op);
    return uccl__err(rc, "%s", msg);
}
