/* The verbs emulator's queue pairs (ibv_emu.c says what the library is):
 * the verbs that create, move through states, query, destroy and post to
 * them; ibv_emu_wire.c moves their bytes. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ibv_emu_qp.h"

/* ---- queue pairs: verbs ------------------------------------------------------- */
EXPORT struct ibv_qp_s *ibv_create_qp(struct ibv_pd_s *pd, struct ibv_qp_init_attr_s *a)
{
    if (a->qp_type != IBV_QPT_RC_ || !a->send_cq || !a->recv_cq || a->srq ||
        a->cap.max_send_sge > MAX_SGE || a->cap.max_recv_sge > MAX_SGE ||
        a->cap.max_send_wr > EMU_MAX_QP_WR || a->cap.max_recv_wr > EMU_MAX_QP_WR ||
        a->cap.max_inline_data > EMU_MAX_INLINE) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_qp *e = calloc(1, sizeof(*e));
    if (!e) {
        errno = ENOMEM;
        return NULL;
    }
    e->fd = -1;
    e->listen_fd = emu_listen(&e->qp.qp_num);
    if (e->listen_fd < 0) {
        free(e);
        errno = ENOMEM;
        return NULL;
    }
    e->qp.context = pd->context;
    e->qp.qp_context = a->qp_context;
    e->qp.pd = pd;
    e->qp.send_cq = a->send_cq;
    e->qp.recv_cq = a->recv_cq;
    e->qp.qp_type = IBV_QPT_RC_;
    e->qp.state = IBV_QPS_RESET_;
    e->sq_sig_all = a->sq_sig_all;
    /* what a provider grants is written back; here exactly what was asked */
    e->cap = a->cap;
    e->attr.qp_state = e->attr.cur_qp_state = IBV_QPS_RESET_;
    e->attr.path_mtu = 1; /* IBV_MTU_256 until set */
    e->attr.port_num = 1;
    emu_cq_use(a->send_cq, 1);
    emu_cq_use(a->recv_cq, 1);
    e->sq_tail = &e->sq;
    e->out_tail = &e->out;
    e->rq_tail = &e->rq;
    e->rs_tail = &e->rs;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca; /* timed waits on the monotonic clock */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    return &e->qp;
}

static void keep_attr(struct emu_qp *e, const struct ibv_qp_attr_s *a, int mask)
{
    struct ibv_qp_attr_s *k = &e->attr;
    if (mask & IBV_QP_ACCESS_FLAGS_)
        k->qp_access_flags = a->qp_access_flags;
    if (mask & IBV_QP_PKEY_INDEX_)
        k->pkey_index = a->pkey_index;
    if (mask & IBV_QP_PORT_)
        k->port_num = a->port_num;
    if (mask & IBV_QP_AV_)
        k->ah_attr = a->ah_attr;
    if (mask & IBV_QP_PATH_MTU_)
        k->path_mtu = a->path_mtu;
    if (mask & IBV_QP_TIMEOUT_)
        k->timeout = a->timeout;
    if (mask & IBV_QP_RETRY_CNT_)
        k->retry_cnt = a->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY_)
        k->rnr_retry = a->rnr_retry;
    if (mask & IBV_QP_RQ_PSN_)
        k->rq_psn = a->rq_psn & 0xffffff;
    if (mask & IBV_QP_MAX_QP_RD_ATOMIC_)
        k->max_rd_atomic = a->max_rd_atomic;
    if (mask & IBV_QP_MIN_RNR_TIMER_)
        k->min_rnr_timer = a->min_rnr_timer;
    if (mask & IBV_QP_SQ_PSN_)
        k->sq_psn = a->sq_psn & 0xffffff;
    if (mask & IBV_QP_MAX_DEST_RD_ATOMIC_)
        k->max_dest_rd_atomic = a->max_dest_rd_atomic;
    if (mask & IBV_QP_DEST_QPN_)
        k->dest_qp_num = a->dest_qp_num;
}

EXPORT int ibv_modify_qp(struct ibv_qp_s *qp, struct ibv_qp_attr_s *a, int mask)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    if (!(mask & IBV_QP_STATE_))
        return EINVAL; /* only state changes are emulated */
    int cur = qp->state, to = a->qp_state, rc = 0;
    int need = 0;
    pthread_mutex_lock(&e->mu);
    if (to == IBV_QPS_ERR_) {
        if (cur != IBV_QPS_ERR_)
            emu_qp_error_locked(e, IBV_WC_WR_FLUSH_ERR_);
    } else if (to == IBV_QPS_RESET_) {
        rc = cur == IBV_QPS_RESET_ || !e->linked ? 0 : EINVAL; /* not emulated once linked */
    } else if (cur == IBV_QPS_RESET_ && to == IBV_QPS_INIT_) {
        need = IBV_QP_PKEY_INDEX_ | IBV_QP_PORT_ | IBV_QP_ACCESS_FLAGS_;
        if ((mask & need) != need || a->port_num != 1)
            rc = EINVAL;
        else
            e->access = a->qp_access_flags;
    } else if (cur == IBV_QPS_INIT_ && to == IBV_QPS_RTR_) {
        need = IBV_QP_AV_ | IBV_QP_PATH_MTU_ | IBV_QP_DEST_QPN_ | IBV_QP_RQ_PSN_ |
               IBV_QP_MAX_DEST_RD_ATOMIC_ | IBV_QP_MIN_RNR_TIMER_;
        /* RoCE: the address vector must carry a GRH with a valid source GID */
        if ((mask & need) != need || !a->ah_attr.is_global || a->ah_attr.grh.sgid_index > 1 ||
            a->dest_qp_num == 0 || a->dest_qp_num > 0xffffff ||
            emu_same_qp(qp->qp_num, a->dest_qp_num, &a->ah_attr.grh.dgid))
            rc = EINVAL;
        else {
            e->dest_qpn = a->dest_qp_num;
            e->dgid = a->ah_attr.grh.dgid;
            e->min_rnr_timer = a->min_rnr_timer;
            rc = emu_link_up(e);
        }
    } else if ((cur == IBV_QPS_RTR_ || cur == IBV_QPS_RTS_) && to == IBV_QPS_RTS_) {
        need = cur == IBV_QPS_RTR_ ? IBV_QP_SQ_PSN_ | IBV_QP_TIMEOUT_ | IBV_QP_RETRY_CNT_ |
                                         IBV_QP_RNR_RETRY_ | IBV_QP_MAX_QP_RD_ATOMIC_ : 0;
        if ((mask & need) != need)
            rc = EINVAL;
        else if (mask & IBV_QP_RNR_RETRY_)
            e->rnr_retry = a->rnr_retry > 7 ? 7 : a->rnr_retry;
    } else if (!(cur == IBV_QPS_INIT_ && to == IBV_QPS_INIT_)) {
        rc = EINVAL;
    }
    if (rc == 0 && qp->state != IBV_QPS_ERR_)
        qp->state = to;
    if (rc == 0)
        keep_attr(e, a, mask);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* rdma-core fills what the mask names; every attribute is filled here
 * (callers may not rely on the others being left alone). */
EXPORT int ibv_query_qp(struct ibv_qp_s *qp, struct ibv_qp_attr_s *a, int mask,
                        struct ibv_qp_init_attr_s *init)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    (void)mask;
    pthread_mutex_lock(&e->mu);
    *a = e->attr;
    a->qp_state = a->cur_qp_state = qp->state;
    a->cap = e->cap;
    pthread_mutex_unlock(&e->mu);
    if (init) {
        memset(init, 0, sizeof(*init));
        init->qp_context = qp->qp_context;
        init->send_cq = qp->send_cq;
        init->recv_cq = qp->recv_cq;
        init->cap = e->cap;
        init->qp_type = qp->qp_type;
        init->sq_sig_all = e->sq_sig_all;
    }
    return 0;
}

/* Only a QP created with extended send operations (ibv_create_qp_ex, which
 * this legacy context does not offer) has an ibv_qp_ex: NULL, as rdma-core
 * answers for any other QP. */
EXPORT void *ibv_qp_to_qp_ex(struct ibv_qp_s *qp)
{
    (void)qp;
    return NULL;
}

/* UCCL_IBV_EMU_STATS=<file>: one line per destroyed QP, "device qpn
 * requests bytes", so tests can see how transfers were striped. */
static void write_stats(struct emu_qp *e)
{
    const char *path = getenv("UCCL_IBV_EMU_STATS");
    if (!path || !*path || !e->reqs)
        return;
    char line[160];
    int n = snprintf(line, sizeof(line), "%s %06x %llu %llu\n", e->qp.context->device->name,
                     e->qp.qp_num, (unsigned long long)e->reqs, (unsigned long long)e->req_bytes);
    FILE *f = fopen(path, "ae");
    if (f) {
        fwrite(line, 1, (size_t)n, f); /* one short append: lines never interleave */
        fclose(f);
    }
}

EXPORT int ibv_destroy_qp(struct ibv_qp_s *qp)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    write_stats(e);
    pthread_mutex_lock(&e->mu);
    /* Responses already decided go out first (a NIC has sent its ACKs by
     * the time the receiver sees the completion); bounded: 1 s. */
    for (int i = 0; i < 100 && (e->rs || e->tx_busy) && e->fd >= 0 &&
                    e->qp.state != IBV_QPS_ERR_; i++) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 10000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    e->stop = 1;
    if (e->fd >= 0)
        shutdown(e->fd, SHUT_RDWR);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->threads) {
        pthread_join(e->tx, NULL);
        pthread_join(e->rx, NULL);
    }
    emu_cq_use(qp->send_cq, -1);
    emu_cq_use(qp->recv_cq, -1);
    if (e->fd >= 0)
        close(e->fd);
    close(e->listen_fd);
    for (struct swr *w; (w = e->sq) || (w = e->out);) {
        if (w == e->sq)
            e->sq = w->next;
        else
            e->out = w->next;
        free(w);
    }
    for (struct rwr *r; (r = e->rq);) {
        e->rq = r->next;
        free(r);
    }
    for (struct rsp *r; (r = e->rs);) {
        e->rs = r->next;
        free(r->data);
        free(r);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
    return 0;
}

/* Under emu_mr_lock: every sge names a local region of the QP's PD. */
static int sges_ok(struct emu_qp *e, const struct ibv_sge_s *s, int n, int need)
{
    for (int i = 0; i < n; i++)
        if (!emu_mr_check(e->qp.pd, s[i].lkey, s[i].addr, s[i].length, need))
            return 0;
    return 1;
}

int emu_post_send(struct ibv_qp_s *qp, struct ibv_send_wr_s *wr, struct ibv_send_wr_s **bad)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    for (; wr; wr = wr->next) {
        int st = qp->state;
        if ((st != IBV_QPS_RTS_ && st != IBV_QPS_ERR_) || wr->num_sge < 0 ||
            wr->num_sge > MAX_SGE ||
            (wr->opcode != IBV_WR_RDMA_WRITE_ && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM_ &&
             wr->opcode != IBV_WR_SEND_ && wr->opcode != IBV_WR_RDMA_READ_)) {
            rc = EINVAL;
            break;
        }
        uint64_t len = 0;
        for (int i = 0; i < wr->num_sge; i++)
            len += wr->sg_list[i].length;
        /* inline data is copied now: the buffers are the caller's again on
         * return, and need no key (a READ has nothing to send inline) */
        int inl = (wr->send_flags & IBV_SEND_INLINE_) && wr->opcode != IBV_WR_RDMA_READ_;
        if (len > (1ull << 31) || (inl && len > e->cap.max_inline_data)) {
            rc = EINVAL;
            break;
        }
        struct swr *w = calloc(1, sizeof(*w) + (inl ? len : 0));
        if (!w) {
            rc = ENOMEM;
            break;
        }
        w->wr_id = wr->wr_id;
        w->opcode = wr->opcode;
        w->signaled = e->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED_);
        w->solicited = !!(wr->send_flags & IBV_SEND_SOLICITED_);
        w->imm = wr->imm_data;
        w->raddr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        w->len = (uint32_t)len;
        if (inl) {
            for (int i = 0, at = 0; i < wr->num_sge; at += (int)wr->sg_list[i++].length)
                memcpy(w->inl + at, (void *)(uintptr_t)wr->sg_list[i].addr,
                       wr->sg_list[i].length);
            w->nsge = len > 0;
            w->sge[0] = (struct ibv_sge_s){(uint64_t)(uintptr_t)w->inl, (uint32_t)len, 0};
        } else {
            w->nsge = wr->num_sge;
            for (int i = 0; i < wr->num_sge; i++)
                w->sge[i] = wr->sg_list[i];
            pthread_rwlock_rdlock(&emu_mr_lock);
            w->local_err = !sges_ok(e, w->sge, w->nsge, w->opcode == IBV_WR_RDMA_READ_
                                                        ? IBV_ACCESS_LOCAL_WRITE_ : 0);
            pthread_rwlock_unlock(&emu_mr_lock);
        }
        if (st == IBV_QPS_ERR_) {
            emu_complete_send(e, w, IBV_WC_WR_FLUSH_ERR_);
            free(w);
            continue;
        }
        *e->sq_tail = w;
        e->sq_tail = &w->next;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (rc && bad)
        *bad = wr;
    return rc;
}

int emu_post_recv(struct ibv_qp_s *qp, struct ibv_recv_wr_s *wr, struct ibv_recv_wr_s **bad)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    for (; wr; wr = wr->next) {
        if (qp->state == IBV_QPS_RESET_ || wr->num_sge < 0 || wr->num_sge > MAX_SGE) {
            rc = EINVAL;
            break;
        }
        struct rwr *r = calloc(1, sizeof(*r));
        if (!r) {
            rc = ENOMEM;
            break;
        }
        r->wr_id = wr->wr_id;
        r->nsge = wr->num_sge;
        for (int i = 0; i < wr->num_sge; i++)
            r->sge[i] = wr->sg_list[i];
        if (qp->state == IBV_QPS_ERR_) {
            emu_complete_recv(e, r, IBV_WC_WR_FLUSH_ERR_, IBV_WC_RECV_, 0, 0, 0, 0);
            free(r);
            continue;
        }
        *e->rq_tail = r;
        e->rq_tail = &r->next;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (rc && bad)
        *bad = wr;
    return rc;
}

