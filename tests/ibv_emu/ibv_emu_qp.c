/* The verbs emulator's queue pairs (ibv_emu.c says what the library is):
 * RC QPs between processes on one host, each pair joined by a Unix socket
 * named after the accepting QP's number; per QP a sender thread (requests
 * in post order, then responses) and a receiver thread (requests checked
 * against the regions and placed, responses matched to the oldest request
 * outstanding). */
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

#include "ibv_emu.h"

struct swr {                      /* a send work request, copied at post */
    uint64_t wr_id;
    int opcode, signaled, local_err;
    uint32_t imm, rkey, len;
    uint64_t raddr;
    int nsge;
    struct ibv_sge_s sge[MAX_SGE];
    struct swr *next;
};
struct rwr { uint64_t wr_id; int nsge; struct ibv_sge_s sge[MAX_SGE]; struct rwr *next; };
struct rsp { uint32_t type, status, len, fatal; char *data; struct rsp *next; };

struct emu_qp {
    struct ibv_qp_s qp;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int listen_fd, fd;
    uint32_t dest_qpn;
    unsigned access;
    int rnr_retry, min_rnr_timer, sq_sig_all, stop, threads, linked;
    int refused;                  /* NAKed a request for access: later ones are dropped */
    int tx_busy;                  /* the sender thread is writing a packet */
    uint64_t req_bytes, reqs;     /* what this QP asked of its peer (UCCL_IBV_EMU_STATS) */
    struct swr *sq, **sq_tail;    /* posted, not yet sent */
    struct swr *out, **out_tail;  /* sent, awaiting the response */
    struct rwr *rq, **rq_tail;    /* posted receives */
    struct rsp *rs, **rs_tail;    /* responses to send */
    pthread_t tx, rx;
};

enum { P_WRITE = 1, P_WRITE_IMM, P_SEND, P_READ, P_ACK, P_NAK, P_READ_RSP };
struct pkt { uint32_t type, imm; uint64_t raddr; uint32_t rkey, len, status, pad; };

/* ---- queue pairs: completions and failure --------------------------------- */
static void complete_send(struct emu_qp *e, struct swr *w, int status)
{
    if (status == IBV_WC_SUCCESS_ && !w->signaled)
        return;
    static const int op[] = {[IBV_WR_RDMA_WRITE_] = IBV_WC_RDMA_WRITE_,
                             [IBV_WR_RDMA_WRITE_WITH_IMM_] = IBV_WC_RDMA_WRITE_,
                             [IBV_WR_SEND_] = 0, [IBV_WR_RDMA_READ_] = IBV_WC_RDMA_READ_};
    struct ibv_wc_s wc = {.wr_id = w->wr_id, .status = status, .opcode = op[w->opcode],
                          .byte_len = w->opcode == IBV_WR_RDMA_READ_ ? w->len : 0,
                          .qp_num = e->qp.qp_num};
    emu_cq_push(e->qp.send_cq, &wc);
}

static void complete_recv(struct emu_qp *e, struct rwr *r, int status, int opcode, uint32_t len,
                          uint32_t imm, int with_imm)
{
    struct ibv_wc_s wc = {.wr_id = r->wr_id, .status = status, .opcode = opcode,
                          .byte_len = len, .imm_data = imm, .qp_num = e->qp.qp_num,
                          .src_qp = e->dest_qpn, .wc_flags = with_imm ? IBV_WC_WITH_IMM_ : 0};
    emu_cq_push(e->qp.recv_cq, &wc);
}

/* Under e->mu: enter ERR.  `first` is the status of the oldest outstanding
 * request (the one the failure hit); everything else is flushed. */
static void qp_error_locked(struct emu_qp *e, int first)
{
    e->qp.state = IBV_QPS_ERR_;
    for (struct swr *w; (w = e->out);) {
        e->out = w->next;
        complete_send(e, w, first);
        first = IBV_WC_WR_FLUSH_ERR_;
        free(w);
    }
    e->out_tail = &e->out;
    for (struct swr *w; (w = e->sq);) {
        e->sq = w->next;
        complete_send(e, w, IBV_WC_WR_FLUSH_ERR_);
        free(w);
    }
    e->sq_tail = &e->sq;
    for (struct rwr *r; (r = e->rq);) {
        e->rq = r->next;
        complete_recv(e, r, IBV_WC_WR_FLUSH_ERR_, IBV_WC_RECV_, 0, 0, 0);
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
        qp_error_locked(e, first);
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
                qp_error_locked(e, 4 /* IBV_WC_LOC_PROT_ERR */);
                continue;
            }
            *e->out_tail = w; /* before it leaves: the response may come at once */
            e->out_tail = &w->next;
            static const uint32_t type[] = {[IBV_WR_RDMA_WRITE_] = P_WRITE,
                [IBV_WR_RDMA_WRITE_WITH_IMM_] = P_WRITE_IMM, [IBV_WR_SEND_] = P_SEND,
                [IBV_WR_RDMA_READ_] = P_READ};
            p = (struct pkt){.type = type[w->opcode], .imm = w->imm, .raddr = w->raddr,
                             .rkey = w->rkey, .len = w->len};
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
        int fatal = r && r->fatal;
        if (r) {
            free(r->data);
            free(r);
        }
        pthread_mutex_lock(&e->mu);
        e->tx_busy = 0;
        pthread_cond_broadcast(&e->cv);
        if (fatal && e->qp.state != IBV_QPS_ERR_)
            qp_error_locked(e, IBV_WC_WR_FLUSH_ERR_);
        /* A failed send: the peer is gone or refused us.  The receiver
         * thread reads what it said before (a NAK names the real error),
         * then the end of the stream, and moves the QP to ERR itself. */
        while (rc && !e->stop && e->qp.state != IBV_QPS_ERR_)
            pthread_cond_wait(&e->cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* A WRITE_WITH_IMM or SEND needs a posted receive: wait for one as an RNR
 * NAK and its retries would, or give up (NULL). */
static struct rwr *take_recv(struct emu_qp *e)
{
    pthread_mutex_lock(&e->mu);
    int tries = 0;
    while (!e->rq && !e->stop && e->qp.state != IBV_QPS_ERR_) {
        if (e->rnr_retry != 7 && tries++ > e->rnr_retry)
            break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ms = e->min_rnr_timer + 1;
        ts.tv_nsec += ms * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    struct rwr *r = e->rq;
    if (r && e->qp.state != IBV_QPS_ERR_) {
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
    int dropped = e->refused || e->qp.state == IBV_QPS_ERR_;
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
    if (p->type != P_WRITE && !(r = take_recv(e))) {
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
        uint64_t room = 0;
        for (int i = 0; i < r->nsge; i++)
            room += emu_mr_check(e->qp.pd, r->sge[i].lkey, r->sge[i].addr, r->sge[i].length,
                             IBV_ACCESS_LOCAL_WRITE_) ? r->sge[i].length : 0;
        if (room < p->len)
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
            complete_recv(e, r, status, IBV_WC_RECV_, 0, 0, 0);
        free(r);
        queue_rsp(e, P_NAK, status == 1 ? 9 /* IBV_WC_REM_INV_REQ_ERR */ : (uint32_t)status,
                  NULL, 0);
        return 0;
    }
    queue_rsp(e, P_ACK, 0, NULL, 0); /* acknowledged before the receiver hears of it */
    if (r) {
        complete_recv(e, r, IBV_WC_SUCCESS_, write ? IBV_WC_RECV_RDMA_WITH_IMM_ : IBV_WC_RECV_,
                      p->len, p->imm, p->type != P_SEND);
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
            qp_error_locked(e, status);
        pthread_mutex_unlock(&e->mu);
        return rc;
    }
    complete_send(e, w, IBV_WC_SUCCESS_);
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
    /* EOF or error: the peer died or broke the connection. */
    qp_error(e, IBV_WC_RETRY_EXC_ERR_);
    return NULL;
}

/* ---- queue pairs: verbs ------------------------------------------------------- */
EXPORT struct ibv_qp_s *ibv_create_qp(struct ibv_pd_s *pd, struct ibv_qp_init_attr_s *a)
{
    if (a->qp_type != IBV_QPT_RC_ || !a->send_cq || !a->recv_cq || a->srq ||
        a->cap.max_send_sge > MAX_SGE || a->cap.max_recv_sge > MAX_SGE) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_qp *e = calloc(1, sizeof(*e));
    if (!e) {
        errno = ENOMEM;
        return NULL;
    }
    e->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    e->fd = -1;
    for (int i = 0; e->listen_fd >= 0 && i < 1000; i++) {
        uint32_t qpn = emu_random_key() & 0xffffff;
        struct sockaddr_un sa;
        socklen_t sl;
        emu_abstract_name(qpn, &sa, &sl);
        if (qpn > 1 && bind(e->listen_fd, (struct sockaddr *)&sa, sl) == 0 &&
            listen(e->listen_fd, 4) == 0) {
            e->qp.qp_num = qpn;
            break;
        }
    }
    if (!e->qp.qp_num) {
        if (e->listen_fd >= 0)
            close(e->listen_fd);
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
    e->sq_tail = &e->sq;
    e->out_tail = &e->out;
    e->rq_tail = &e->rq;
    e->rs_tail = &e->rs;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    return &e->qp;
}

static int link_up(struct emu_qp *e)
{
    if (e->qp.qp_num < e->dest_qpn) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa;
        socklen_t sl;
        emu_abstract_name(e->dest_qpn, &sa, &sl);
        uint32_t hello[2] = {e->qp.qp_num, e->dest_qpn};
        struct iovec iov = {hello, sizeof(hello)};
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sl) || emu_send_full(fd, &iov, 1)) {
            /* no such QP: requests will go unanswered (retry exceeded) */
            if (fd >= 0)
                close(fd);
            fd = -1;
        }
        e->fd = fd;
        if (fd < 0) {
            e->linked = 1;
            qp_error_locked(e, IBV_WC_RETRY_EXC_ERR_);
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
            qp_error_locked(e, IBV_WC_WR_FLUSH_ERR_);
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
            a->dest_qp_num == 0 || a->dest_qp_num > 0xffffff || a->dest_qp_num == qp->qp_num)
            rc = EINVAL;
        else {
            e->dest_qpn = a->dest_qp_num;
            e->min_rnr_timer = a->min_rnr_timer;
            rc = link_up(e);
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
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

EXPORT int ibv_query_qp(struct ibv_qp_s *qp, struct ibv_qp_attr_s *a, int mask,
                        struct ibv_qp_init_attr_s *init)
{
    struct emu_qp *e = (struct emu_qp *)qp;
    (void)mask;
    memset(a, 0, sizeof(*a));
    pthread_mutex_lock(&e->mu);
    a->qp_state = a->cur_qp_state = qp->state;
    a->dest_qp_num = e->dest_qpn;
    a->qp_access_flags = e->access;
    a->rnr_retry = (uint8_t)e->rnr_retry;
    pthread_mutex_unlock(&e->mu);
    if (init) {
        memset(init, 0, sizeof(*init));
        init->send_cq = qp->send_cq;
        init->recv_cq = qp->recv_cq;
        init->qp_type = qp->qp_type;
    }
    return 0;
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
        clock_gettime(CLOCK_REALTIME, &ts);
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
        struct swr *w = calloc(1, sizeof(*w));
        if (!w) {
            rc = ENOMEM;
            break;
        }
        w->wr_id = wr->wr_id;
        w->opcode = wr->opcode;
        w->signaled = e->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED_);
        w->imm = wr->imm_data;
        w->raddr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        w->nsge = wr->num_sge;
        uint64_t len = 0;
        for (int i = 0; i < wr->num_sge; i++) {
            w->sge[i] = wr->sg_list[i];
            len += wr->sg_list[i].length;
        }
        w->len = (uint32_t)len;
        if (len > (1ull << 31)) {
            free(w);
            rc = EINVAL;
            break;
        }
        pthread_rwlock_rdlock(&emu_mr_lock);
        w->local_err = !sges_ok(e, w->sge, w->nsge, w->opcode == IBV_WR_RDMA_READ_
                                                    ? IBV_ACCESS_LOCAL_WRITE_ : 0);
        pthread_rwlock_unlock(&emu_mr_lock);
        if (st == IBV_QPS_ERR_) {
            complete_send(e, w, IBV_WC_WR_FLUSH_ERR_);
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
            complete_recv(e, r, IBV_WC_WR_FLUSH_ERR_, IBV_WC_RECV_, 0, 0, 0);
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
