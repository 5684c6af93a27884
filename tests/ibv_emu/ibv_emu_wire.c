/* The verbs emulator's wire (ibv_emu.c says what the library is): RC QPs
 * between processes, each pair joined by one socket (ibv_emu_sock.c: Unix,
 * or TCP); per QP a sender thread (requests in post order, then responses)
 * and a receiver thread (requests checked against the regions and placed,
 * responses matched to the oldest request outstanding). */
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

/* ---- queue pairs: completions and failure --------------------------------- */
void emu_complete_send(struct emu_qp *e, struct swr *w, int status)
{
    if (status == IBV_WC_SUCCESS_ && !w->signaled)
        return;
    static const int op[] = {[IBV_WR_RDMA_WRITE_] = IBV_WC_RDMA_WRITE_,
                             [IBV_WR_RDMA_WRITE_WITH_IMM_] = IBV_WC_RDMA_WRITE_,
                             [IBV_WR_SEND_] = 0, [IBV_WR_RDMA_READ_] = IBV_WC_RDMA_READ_};
    struct ibv_wc_s wc = {.wr_id = w->wr_id, .status = status, .opcode = op[w->opcode],
                          .byte_len = w->opcode == IBV_WR_RDMA_READ_ ? w->len : 0,
                          .qp_num = e->qp.qp_num};
    emu_cq_push(e->qp.send_cq, &wc, 0);
}

void emu_complete_recv(struct emu_qp *e, struct rwr *r, int status, int opcode, uint32_t len,
                          uint32_t imm, int with_imm, int solicited)
{
    struct ibv_wc_s wc = {.wr_id = r->wr_id, .status = status, .opcode = opcode,
                          .byte_len = len, .imm_data = imm, .qp_num = e->qp.qp_num,
                          .src_qp = e->dest_qpn, .wc_flags = with_imm ? IBV_WC_WITH_IMM_ : 0};
    emu_cq_push(e->qp.recv_cq, &wc, solicited);
}

/* Under e->mu: enter ERR.  `first` is the status of the oldest outstanding
 * request (the one the failure hit); everything else is flushed. */
void emu_qp_error_locked(struct emu_qp *e, int first)
{
    e->qp.state = IBV_QPS_ERR_;
    for (struct swr *w; (w = e->out);) {
        e->out = w->next;
        emu_complete_send(e, w, first);
        first = IBV_WC_WR_FLUSH_ERR_;
        free(w);
    }
    e->out_tail = &e->out;
    for (struct swr *w; (w = e->sq);) {
        e->sq = w->next;
        emu_complete_send(e, w, IBV_WC_WR_FLUSH_ERR_);
        free(w);
    }
    e->sq_tail = &e->sq;
    for (struct rwr *r; (r = e->rq);) {
        e->rq = r->next;
        emu_complete_recv(e, r, IBV_WC_WR_FLUSH_ERR_, IBV_WC_RECV_, 0, 0, 0, 0);
        free(r);
    }
    e->rq_tail = &e->rq;
    if (e->fd >= 0) /* the peer's requests now go unanswered: it fails too */
        shutdown(e->fd, SHUT_RDWR);
    pthread_cond_broadcast(&e->cv);
}

static void qp_error(struct emu_qp *e, int first)
{
    pthread_mutex_lock(&e->mu);
    if (e->qp.state != IBV_QPS_ERR_)
        emu_qp_error_locked(e, first);
    pthread_mutex_unlock(&e->mu);
}

static void queue_rsp(struct emu_qp *e, uint32_t type, uint32_t status, char *data, uint32_t len)
{
    struct rsp *r = calloc(1, sizeof(*r));
    if (!r) {
        free(data);
        qp_error(e, IBV_WC_RETRY_EXC_ERR_);
        return;
    }
    /* A responder that refused an access (class C error) enters ERR once
     * its NAK is out, and executes nothing after it. */
    int fatal = type == P_NAK && status != IBV_WC_RNR_RETRY_EXC_ERR_;
    *r = (struct rsp){.type = type, .status = status, .data = data, .len = len, .fatal = fatal};
    pthread_mutex_lock(&e->mu);
    e->refused |= fatal;
    *e->rs_tail = r;
    e->rs_tail = &r->next;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* The sender thread: responses first, then requests in post order. */
static void *tx_main(void *arg)
{
    struct emu_qp *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->stop && (e->fd < 0 || (!e->rs && (!e->sq || e->qp.state == IBV_QPS_ERR_))))
            pthread_cond_wait(&e->cv, &e->mu);
        if (e->stop)
            break;
        struct iovec iov[MAX_SGE + 1];
        struct pkt p = {0};
        int n = 1, fd = e->fd;
        iov[0] = (struct iovec){&p, sizeof(p)};
        struct rsp *r = e->rs;
        if (r) {
            e->rs = r->next;
            if (!e->rs)
                e->rs_tail = &e->rs;
            p = (struct pkt){.type = r->type, .status = r->status, .len = r->len};
            if (r->len)
                iov[n++] = (struct iovec){r->data, r->len};
        } else {
            struct swr *w = e->sq;
            e->sq = w->next;
            if (!e->sq)
                e->sq_tail = &e->sq;
            w->next = NULL;
            if (w->local_err) { /* a bad lkey: local protection error, QP to ERR */
                *e->out_tail = w;
                e->out_tail = &w->next;
                emu_qp_error_locked(e, 4 /* IBV_WC_LOC_PROT_ERR */);
                continue;
            }
            *e->out_tail = w; /* before it leaves: the response may come at once */
            e->out_tail = &w->next;
            static const uint32_t type[] = {[IBV_WR_RDMA_WRITE_] = P_WRITE,
                [IBV_WR_RDMA_WRITE_WITH_IMM_] = P_WRITE_IMM, [IBV_WR_SEND_] = P_SEND,
                [IBV_WR_RDMA_READ_] = P_READ};
            p = (struct pkt){.type = type[w->opcode], .imm = w->imm, .raddr = w->raddr,
                             .rkey = w->rkey, .len = w->len,
                             .flags = (uint32_t)e->rnr_retry | (w->solicited ? F_SOLICITED : 0)};
            e->req_bytes += w->len;
            e->reqs++;
            if (w->opcode != IBV_WR_RDMA_READ_)
                for (int i = 0; i < w->nsge; i++)
                    iov[n++] = (struct iovec){(void *)(uintptr_t)w->sge[i].addr,
                                              w->sge[i].length};
        }
        e->tx_busy = 1;
        pthread_mutex_unlock(&e->mu);
        int rc = emu_send_full(fd, iov, n);
        int fatal = r && r->fatal, request = !r;
        if (r) {
            free(r->data);
            free(r);
        }
        pthread_mutex_lock(&e->mu);
        e->tx_busy = 0;
        pthread_cond_broadcast(&e->cv);
        if (fatal && e->qp.state != IBV_QPS_ERR_)
            emu_qp_error_locked(e, IBV_WC_WR_FLUSH_ERR_);
        /* A failed send: the peer is gone or refused us.  The receiver
         * thread reads what it said before (a NAK names the real error),
         * then the end of the stream; if that named no error, the request
         * goes unanswered: retry exceeded. */
        while (rc && !e->stop && e->qp.state != IBV_QPS_ERR_ && !e->peer_gone)
            pthread_cond_wait(&e->cv, &e->mu);
        /* (a response that could not go out breaks nothing: a responder
         * does not wait for its requester) */
        if (((rc && request) || e->out) && e->peer_gone && e->qp.state != IBV_QPS_ERR_)
            emu_qp_error_locked(e, IBV_WC_RETRY_EXC_ERR_);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* The IB spec's RNR NAK timer codes (table 45), in microseconds: the
 * responder's min_rnr_timer is how long a requester waits after an RNR
 * NAK before it retries. */
static const long rnr_timer_us[32] = {
    655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
    2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
    163840, 245760, 327680, 491520};

/* A WRITE_WITH_IMM or SEND needs a posted receive: wait for one as an RNR
 * NAK and the requester's retries would (`retries`, the requester's
 * rnr_retry: 7 means without limit), each after min_rnr_timer, or give up
 * (NULL).  A receive posted meanwhile is taken at once, as the next retry
 * would find it.  A requester that went away (its QP in ERR or destroyed:
 * it shut the socket down) retries no more: give up too, so a receive
 * posted later is not consumed by a request its sender has flushed. */
static int peer_shut(struct emu_qp *e)
{
    struct pollfd pf = {.fd = e->fd, .events = POLLRDHUP};
    return poll(&pf, 1, 0) == 1 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static struct rwr *take_recv(struct emu_qp *e, int retries)
{
    pthread_mutex_lock(&e->mu);
    int gone = 0, rnr = !e->rq; /* a receive there at once: taken, whatever follows */
    for (int tries = 0; !e->rq && !e->stop && !gone && e->qp.state != IBV_QPS_ERR_;
         tries++) {
        if (retries != 7 && tries >= retries)
            break;
        struct timespec end;
        clock_gettime(CLOCK_MONOTONIC, &end);
        long left_us = rnr_timer_us[e->min_rnr_timer & 31];
        /* the whole timer, whatever else wakes the thread meanwhile, in
         * slices of at most 50 ms to look for the requester's shutdown */
        while (!e->rq && !e->stop && !gone && e->qp.state != IBV_QPS_ERR_ && left_us > 0) {
            long us = left_us < 50000 ? left_us : 50000;
            left_us -= us;
            end.tv_nsec += us * 1000L;
            end.tv_sec += end.tv_nsec / 1000000000L;
            end.tv_nsec %= 1000000000L;
            while (!e->rq && !e->stop && e->qp.state != IBV_QPS_ERR_ &&
                   pthread_cond_timedwait(&e->cv, &e->mu, &end) != ETIMEDOUT)
                ;
            gone = peer_shut(e);
        }
    }
    /* after an RNR wait, checked once more before a receive is taken: the
     * requester may have shut down before it was posted (unnoticed here) */
    gone = gone || (rnr && peer_shut(e));
    e->peer_gone |= gone; /* what it sent after this is not executed either */
    struct rwr *r = e->rq;
    if (r && !gone && e->qp.state != IBV_QPS_ERR_) {
        e->rq = r->next;
        if (!e->rq)
            e->rq_tail = &e->rq;
    } else {
        r = NULL;
    }
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* A request from the peer: check it, place its bytes, answer.  Returns -1
 * when the socket failed. */
static int on_request(struct emu_qp *e, const struct pkt *p)
{
    int fd = e->fd;
    pthread_mutex_lock(&e->mu);
    int dropped = e->refused || e->peer_gone || e->qp.state == IBV_QPS_ERR_;
    pthread_mutex_unlock(&e->mu);
    if (dropped) /* after a refusal, or in ERR: nothing executes, nothing answers */
        return p->type == P_READ ? 0 : emu_drain(fd, p->len);
    if (p->type == P_READ) {
        char *data = NULL;
        uint32_t status = IBV_WC_SUCCESS_;
        pthread_rwlock_rdlock(&emu_mr_lock);
        if (!(e->access & IBV_ACCESS_REMOTE_READ_) ||
            !emu_mr_check(e->qp.pd, p->rkey, p->raddr, p->len, IBV_ACCESS_REMOTE_READ_))
            status = IBV_WC_REM_ACCESS_ERR_;
        else if (p->len && !(data = malloc(p->len)))
            status = 11; /* IBV_WC_REM_OP_ERR */
        else if (p->len)
            memcpy(data, (void *)(uintptr_t)p->raddr, p->len);
        pthread_rwlock_unlock(&emu_mr_lock);
        if (status)
            queue_rsp(e, P_NAK, status, NULL, 0);
        else
            queue_rsp(e, P_READ_RSP, 0, data, p->len);
        return 0;
    }
    int write = p->type != P_SEND;
    pthread_rwlock_rdlock(&emu_mr_lock);
    int ok = !write || ((e->access & IBV_ACCESS_REMOTE_WRITE_) &&
                        emu_mr_check(e->qp.pd, p->rkey, p->raddr, p->len, IBV_ACCESS_REMOTE_WRITE_));
    pthread_rwlock_unlock(&emu_mr_lock);
    if (!ok) {
        queue_rsp(e, P_NAK, IBV_WC_REM_ACCESS_ERR_, NULL, 0);
        return emu_drain(fd, p->len);
    }
    struct rwr *r = NULL;
    if (p->type != P_WRITE && !(r = take_recv(e, (int)(p->flags & F_RNR_RETRY)))) {
        queue_rsp(e, P_NAK, IBV_WC_RNR_RETRY_EXC_ERR_, NULL, 0);
        return emu_drain(fd, p->len);
    }
    int rc = 0, status = IBV_WC_SUCCESS_;
    pthread_rwlock_rdlock(&emu_mr_lock); /* dereg waits until the bytes are in */
    if (write) {
        /* checked again under this hold: it may have gone meanwhile */
        if (emu_mr_check(e->qp.pd, p->rkey, p->raddr, p->len, IBV_ACCESS_REMOTE_WRITE_))
            rc = emu_recv_full(fd, (void *)(uintptr_t)p->raddr, p->len);
        else
            status = IBV_WC_REM_ACCESS_ERR_;
    } else { /* SEND: scatter into the receive's buffers */
        /* every buffer the message reaches must be local and writable
         * (local protection error), and they must hold it all (length) */
        uint64_t room = 0;
        for (int i = 0; !status && i < r->nsge && room < p->len; i++) {
            if (emu_mr_check(e->qp.pd, r->sge[i].lkey, r->sge[i].addr, r->sge[i].length,
                             IBV_ACCESS_LOCAL_WRITE_))
                room += r->sge[i].length;
            else
                status = 4; /* IBV_WC_LOC_PROT_ERR */
        }
        if (!status && room < p->len)
            status = 1; /* IBV_WC_LOC_LEN_ERR */
        for (int i = 0, left = (int)p->len; !status && !rc && left > 0 && i < r->nsge; i++) {
            uint32_t n = r->sge[i].length < (uint32_t)left ? r->sge[i].length : (uint32_t)left;
            rc = emu_recv_full(fd, (void *)(uintptr_t)r->sge[i].addr, n);
            left -= (int)n;
        }
    }
    pthread_rwlock_unlock(&emu_mr_lock);
    if (rc)
        return -1;
    if (status) {
        if (emu_drain(fd, p->len))
            return -1;
        if (r)
            emu_complete_recv(e, r, status, IBV_WC_RECV_, 0, 0, 0, 0);
        free(r);
        /* the requester hears: too long, an invalid request; a receive
         * the responder could not use, a remote operational error */
        queue_rsp(e, P_NAK, status == 1   ? 9  /* IBV_WC_REM_INV_REQ_ERR */
                            : status == 4 ? 11 /* IBV_WC_REM_OP_ERR */
                                          : (uint32_t)status,
                  NULL, 0);
        return 0;
    }
    queue_rsp(e, P_ACK, 0, NULL, 0); /* acknowledged before the receiver hears of it */
    if (r) {
        emu_complete_recv(e, r, IBV_WC_SUCCESS_, write ? IBV_WC_RECV_RDMA_WITH_IMM_ : IBV_WC_RECV_,
                      p->len, p->imm, p->type != P_SEND, !!(p->flags & F_SOLICITED));
        free(r);
    }
    return 0;
}

/* A response: it answers the oldest outstanding request. */
static int on_response(struct emu_qp *e, const struct pkt *p)
{
    pthread_mutex_lock(&e->mu);
    struct swr *w = e->out;
    if (w) {
        e->out = w->next;
        if (!e->out)
            e->out_tail = &e->out;
    }
    pthread_mutex_unlock(&e->mu);
    if (!w) /* flushed meanwhile (ERR): discard */
        return p->type == P_READ_RSP ? emu_drain(e->fd, p->len) : 0;
    int rc = 0, status = IBV_WC_SUCCESS_;
    if (p->type == P_NAK) {
        status = (int)p->status;
    } else if (p->type == P_READ_RSP) {
        if (w->opcode != IBV_WR_RDMA_READ_ || p->len != w->len) {
            status = 7; /* IBV_WC_BAD_RESP_ERR */
            rc = emu_drain(e->fd, p->len);
        } else {
            pthread_rwlock_rdlock(&emu_mr_lock);
            uint32_t left = p->len;
            for (int i = 0; !rc && left > 0 && i < w->nsge; i++) {
                uint32_t n = w->sge[i].length < left ? w->sge[i].length : left;
                if (emu_mr_check(e->qp.pd, w->sge[i].lkey, w->sge[i].addr, n, IBV_ACCESS_LOCAL_WRITE_))
                    rc = emu_recv_full(e->fd, (void *)(uintptr_t)w->sge[i].addr, n);
                else { /* deregistered since the post */
                    status = 4;
                    rc = emu_drain(e->fd, n);
                }
                left -= n;
            }
            pthread_rwlock_unlock(&emu_mr_lock);
        }
    }
    if (status) { /* the QP breaks: this one carries the error, the rest flush */
        pthread_mutex_lock(&e->mu);
        w->next = e->out;
        e->out = w;
        if (!w->next)
            e->out_tail = &w->next;
        if (e->qp.state != IBV_QPS_ERR_)
            emu_qp_error_locked(e, status);
        pthread_mutex_unlock(&e->mu);
        return rc;
    }
    emu_complete_send(e, w, IBV_WC_SUCCESS_);
    free(w);
    return rc;
}

/* The higher-numbered side: accept the peer's connection (checked: it is
 * the QP ours was told of). */
static int accept_peer(struct emu_qp *e)
{
    while (!e->stop) {
        struct pollfd pf = {.fd = e->listen_fd, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0)
            continue;
        int fd = accept4(e->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        uint32_t hello[2];
        struct timeval tv = {5, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        if (emu_recv_full(fd, hello, sizeof(hello)) == 0 && hello[0] == e->dest_qpn &&
            hello[1] == e->qp.qp_num) {
            struct timeval none = {0, 0};
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
            return fd;
        }
        close(fd);
    }
    return -1;
}

static void *rx_main(void *arg)
{
    struct emu_qp *e = arg;
    int fd = e->fd;
    if (fd < 0) {
        fd = accept_peer(e);
        pthread_mutex_lock(&e->mu);
        e->fd = fd;
        if (fd >= 0 && e->qp.state == IBV_QPS_ERR_)
            shutdown(fd, SHUT_RDWR);
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->mu);
        if (fd < 0)
            return NULL;
    }
    for (;;) {
        struct pkt p;
        if (emu_recv_full(fd, &p, sizeof(p)))
            break;
        int rc = p.type <= P_READ ? on_request(e, &p) : on_response(e, &p);
        if (rc)
            break;
    }
    /* EOF or error: the peer died, destroyed its QP or broke the
     * connection.  As on a real fabric, only a request of ours notices:
     * one outstanding (or queued, or posted later) is never answered and
     * fails with retry exceeded, taking the QP to ERR; with none, the QP
     * stays as it is and its posted receives stay posted. */
    pthread_mutex_lock(&e->mu);
    e->peer_gone = 1;
    if ((e->out || e->sq) && e->qp.state != IBV_QPS_ERR_)
        emu_qp_error_locked(e, IBV_WC_RETRY_EXC_ERR_);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int emu_link_up(struct emu_qp *e)
{
    if (emu_dials(e->qp.qp_num, e->dest_qpn, &e->dgid)) {
        int fd = emu_dial(e->dest_qpn, &e->dgid);
        uint32_t hello[2] = {e->qp.qp_num, e->dest_qpn};
        struct iovec iov = {hello, sizeof(hello)};
        if (fd < 0 || emu_send_full(fd, &iov, 1)) {
            /* no such QP: requests will go unanswered (retry exceeded) */
            if (fd >= 0)
                close(fd);
            fd = -1;
        }
        e->fd = fd;
        if (fd < 0) {
            e->linked = 1;
            emu_qp_error_locked(e, IBV_WC_RETRY_EXC_ERR_);
            return 0;
        }
    }
    if (pthread_create(&e->tx, NULL, tx_main, e))
        return ENOMEM;
    if (pthread_create(&e->rx, NULL, rx_main, e)) {
        e->stop = 1;
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->tx, NULL);
        pthread_mutex_lock(&e->mu);
        e->stop = 0;
        return ENOMEM;
    }
    e->threads = e->linked = 1;
    return 0;
}

/* Under e->mu: what a successful modify set, for ibv_query_qp. */
