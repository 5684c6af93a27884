/* RDMA transport: reliable-connected queue pairs over libibverbs
 * (ibv_loader.c), on the devices tp_rdma_dev.c found.
 *
 * A direct mover (transport.h): the protocol (proto.c) exchanges addresses
 * and keys on the control socket; the bytes move by the NIC.  The side that
 * holds the source writes (source_writes): a receiver advertises its posted
 * buffer (CTS with address and rkeys), the sender fills it with RDMA WRITEs
 * and a final WRITE_WITH_IMM, which consumes one of the receives kept posted
 * on every QP, and says PDONE once the NIC acknowledged it; a one-sided
 * write is the same against an advertised window; a one-sided read is an
 * RDMA READ of the window, whose rkeys came with the GO.
 *
 * Setting up: the connector opens one extra socket (HELLO_STREAM) and
 * sends its QP numbers, PSNs, GIDs and LIDs right behind the HELLO; the
 * acceptor, in the listener, takes its QPs RESET -> INIT -> RTR -> RTS and
 * answers with its own before the ACK (handshake.c), so the connection is
 * whole before either side sees it; the connector then does the same and
 * the socket closes.  QP i
 * uses device i mod (devices here) and reaches the peer's device i mod
 * (devices there); a transfer is cut into chunks striped round-robin over
 * the QPs, so several NICs and several QPs carry one message.
 *
 * The movers and their completions are tp_rdma_move.c's; this file sets
 * connections up and takes them down: the QPs made and connected with the
 * peer's, the progress thread started, every QP moved to ERR on a failure
 * (the NIC flushes what is posted), the ops table.
 *
 * Memory no NIC could register (GPU memory without GPUDirect) is staged on
 * its own side: the moves of that side go through a page-locked chunk,
 * chunk by chunk, in uccl__rdma_move (tp_rdma_move.c); what the peer
 * would have to address (a receive buffer, a window written to or read
 * from) is never advertised (its key is 0, `staged`): the protocol streams
 * those transfers instead (proto_stream.c), and tp_rdma_stage.c carries the
 * stream as RDMA WRITEs into a page-locked staging ring the receiving side
 * lends slot by slot (CREDIT), each chunk announced by a DATA message,
 * checked against the transfer and copied into place by the receiver.  A
 * peer only ever reaches memory registered and lent to it: regions
 * advertised to it, and the slots of the ring. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tp/transport.h"
#include "gpu/gpu.h"
#include "tp/handshake.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/config.h"
#include "base/status.h"
#include "tp/tp_rdma.h"

#define INFO_MAGIC 0x41524355u /* "UCRA" */
#define INFO_SIZE 512
#define QP_INFO 28

static int rdma_available(void)
{
    unsigned n;
    return uccl__rdma_devs(&n) ? UCCL_OK : UCCL_ERR_UNAVAIL;
}

static int rdma_pull(struct uccl__link *lk, void *dst, uint64_t local_key, uint64_t remote_addr,
                     uint64_t remote_key, size_t len)
{
    return uccl__rdma_move(lk, 1, dst, local_key, remote_addr, remote_key, len, 1);
}

static int rdma_push(struct uccl__link *lk, const void *src, uint64_t local_key,
                     uint64_t remote_addr, uint64_t remote_key, size_t len)
{
    return uccl__rdma_move(lk, 0, (char *)src, local_key, remote_addr, remote_key, len, 1);
}

/* ---- setting up ------------------------------------------------------------------ */

struct peer_qp { uint32_t qpn, psn; uint16_t lid; uint8_t mtu, link; union ibv_gid_u gid; };

static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

/* This side's QPs, as the peer needs them: magic, QP count, device count,
 * then per QP: number, PSN, LID, MTU, link layer, GID. */
static void info_encode(const struct uccl__rdma_conn *t, const struct uccl__rdma_dev *d, unsigned ndev,
                        uint8_t out[INFO_SIZE])
{
    memset(out, 0, INFO_SIZE);
    put32(out, INFO_MAGIC);
    put32(out + 4, t->nqp | ndev << 16);
    for (unsigned i = 0; i < t->nqp; i++) {
        uint8_t *p = out + 8 + i * QP_INFO;
        const struct uccl__rdma_dev *dv = &d[t->q[i].dev];
        put32(p, t->q[i].qp->qp_num);
        put32(p + 4, t->q[i].psn);
        put32(p + 8, dv->lid | (uint32_t)dv->active_mtu << 16 | (uint32_t)dv->link_layer << 24);
        memcpy(p + 12, dv->gid.raw, 16);
    }
}

/* The peer's record, every field checked. */
static int info_decode(const uint8_t in[INFO_SIZE], unsigned *nqp_p, unsigned *ndev_p,
                       struct peer_qp *q)
{
    if (get32(in) != INFO_MAGIC)
        return uccl__err(UCCL_ERR_PROTO, "RDMA setup: bad magic 0x%08x", get32(in));
    unsigned nqp = get32(in + 4) & 0xffff, ndev = get32(in + 4) >> 16;
    if (nqp < 1 || nqp > UCCL_RDMA_MAX_QPS || ndev < 1 || ndev > UCCL_RDMA_MAX_DEVS)
        return uccl__err(UCCL_ERR_PROTO, "RDMA setup: %u QPs on %u devices (allowed 1..%d on "
                         "1..%d)", nqp, ndev, UCCL_RDMA_MAX_QPS, UCCL_RDMA_MAX_DEVS);
    for (unsigned i = 0; i < nqp; i++) {
        const uint8_t *p = in + 8 + i * QP_INFO;
        uint32_t w = get32(p + 8);
        q[i] = (struct peer_qp){.qpn = get32(p), .psn = get32(p + 4), .lid = (uint16_t)w,
                                .mtu = (uint8_t)(w >> 16), .link = (uint8_t)(w >> 24)};
        memcpy(q[i].gid.raw, p + 12, 16);
        if (q[i].qpn == 0 || q[i].qpn > 0xffffff || q[i].psn > 0xffffff || q[i].mtu < 1 ||
            q[i].mtu > 5 || (q[i].link != IBV_LINK_LAYER_INFINIBAND_ &&
                             q[i].link != IBV_LINK_LAYER_ETHERNET_))
            return uccl__err(UCCL_ERR_PROTO, "RDMA setup: QP %u: number %u, PSN %u, MTU code %u, "
                             "link layer %u out of range", i, q[i].qpn, q[i].psn, q[i].mtu,
                             q[i].link);
    }
    *nqp_p = nqp;
    *ndev_p = ndev;
    return UCCL_OK;
}

static int rconn_new(struct uccl__link *lk, struct uccl__rdma_conn **t_p)
{
    struct uccl__rdma_conn *t = calloc(1, sizeof(*t));
    if (!t)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    _Static_assert(UCCL_RDMA_MAX_QPS == 16, "base/config.h: UCCL_P2P_RDMA_QPS is 1..16");
    long nqp, chunk, sl, tc;
    int bad;
    if ((bad = uccl__cfg_long(UCCL_CFG_P2P_RDMA_QPS, &nqp)) ||
        (bad = uccl__cfg_long(UCCL_CFG_P2P_RDMA_CHUNK_KB, &chunk)) ||
        (bad = uccl__cfg_long(UCCL_CFG_P2P_RDMA_SL, &sl)) ||
        (bad = uccl__cfg_long(UCCL_CFG_P2P_RDMA_TC, &tc))) {
        free(t);
        return bad;
    }
    t->nqp = (unsigned)nqp, t->chunk = (size_t)chunk, t->sl = (int)sl, t->tc = (int)tc;
    if (uccl__rdma_stage_new(t->chunk, &t->stage)) {
        free(t);
        return UCCL_ERR_NOMEM;
    }
    for (unsigned i = 0; i < UCCL_RDMA_MAX_QPS; i++)
        pthread_mutex_init(&t->q[i].poll_mu, NULL);
    pthread_mutex_init(&t->own_mu, NULL);
    lk->tp_priv = t;
    lk->direct = 1;
    lk->num_streams = 1; /* one setup socket */
    *t_p = t;
    return UCCL_OK;
}

/* Create nqp QPs (each with its CQ), take them to INIT, post receives. */
static int qps_create(struct uccl__rdma_conn *t, unsigned nqp)
{
    unsigned ndev;
    const struct uccl__rdma_dev *d = uccl__rdma_devs(&ndev);
    const struct uccl__ibv *ib = uccl__ibv();
    if (!d || !ib)
        return UCCL_ERR_UNAVAIL;
    t->nqp = nqp;
    for (unsigned i = 0; i < nqp; i++) {
        struct uccl__rdma_qp *q = &t->q[i];
        q->dev = i % ndev;
        const struct uccl__rdma_dev *dv = &d[q->dev];
        q->cq = ib->create_cq(dv->ctx, UCCL_RDMA_SQ_DEPTH + UCCL_RDMA_RQ_DEPTH + 16, NULL, NULL, 0);
        if (!q->cq)
            return uccl__err(UCCL_ERR_IO, "ibv_create_cq on %s failed: %s", dv->name,
                             strerror(errno));
        struct ibv_qp_init_attr_s ia = {.send_cq = q->cq, .recv_cq = q->cq, .qp_type = IBV_QPT_RC_,
                                        .cap = {.max_send_wr = UCCL_RDMA_SQ_DEPTH, .max_recv_wr = UCCL_RDMA_RQ_DEPTH,
                                                .max_send_sge = 1, .max_recv_sge = 1}};
        q->qp = ib->create_qp(dv->pd, &ia);
        if (!q->qp)
            return uccl__err(UCCL_ERR_IO, "ibv_create_qp on %s failed: %s", dv->name,
                             strerror(errno));
        uint32_t psn = 0;
        if (getrandom(&psn, sizeof(psn), 0) != sizeof(psn))
            psn = (uint32_t)uccl__random64();
        q->psn = psn & 0xffffff;
        struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_INIT_, .pkey_index = 0,
                                  .port_num = dv->port,
                                  .qp_access_flags = IBV_ACCESS_LOCAL_WRITE_ |
                                      IBV_ACCESS_REMOTE_WRITE_ | IBV_ACCESS_REMOTE_READ_};
        int rc = ib->modify_qp(q->qp, &a, IBV_QP_STATE_ | IBV_QP_PKEY_INDEX_ | IBV_QP_PORT_ |
                                              IBV_QP_ACCESS_FLAGS_);
        if (rc == 0)
            rc = uccl__rdma_post_recvs(q, UCCL_RDMA_RQ_DEPTH);
        if (rc)
            return uccl__err(UCCL_ERR_IO, "QP %u to INIT on %s: %s", q->qp->qp_num, dv->name,
                             strerror(rc));
    }
    return UCCL_OK;
}

/* INIT -> RTR -> RTS against the peer's QPs. */
static int qps_connect(struct uccl__rdma_conn *t, const struct peer_qp *p)
{
    unsigned ndev;
    const struct uccl__rdma_dev *d = uccl__rdma_devs(&ndev);
    const struct uccl__ibv *ib = uccl__ibv();
    for (unsigned i = 0; i < t->nqp; i++) {
        struct uccl__rdma_qp *q = &t->q[i];
        const struct uccl__rdma_dev *dv = &d[q->dev];
        if (p[i].link != dv->link_layer)
            return uccl__err(UCCL_ERR_UNAVAIL, "RDMA: %s here is %s, the peer's NIC is %s", dv->name,
                             dv->link_layer == IBV_LINK_LAYER_ETHERNET_ ? "RoCE" : "InfiniBand",
                             p[i].link == IBV_LINK_LAYER_ETHERNET_ ? "RoCE" : "InfiniBand");
        struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_RTR_,
                                  .path_mtu = p[i].mtu < dv->active_mtu ? p[i].mtu : dv->active_mtu,
                                  .dest_qp_num = p[i].qpn, .rq_psn = p[i].psn,
                                  .max_dest_rd_atomic = 16, .min_rnr_timer = 12};
        a.ah_attr.port_num = dv->port;
        a.ah_attr.sl = (uint8_t)t->sl;
        a.ah_attr.dlid = p[i].lid;
        if (dv->gid_index >= 0) { /* RoCE: routed by GID */
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = p[i].gid;
            a.ah_attr.grh.sgid_index = (uint8_t)dv->gid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = (uint8_t)t->tc;
        }
        int rc = ib->modify_qp(q->qp, &a, IBV_QP_STATE_ | IBV_QP_AV_ | IBV_QP_PATH_MTU_ |
                               IBV_QP_DEST_QPN_ | IBV_QP_RQ_PSN_ | IBV_QP_MAX_DEST_RD_ATOMIC_ |
                               IBV_QP_MIN_RNR_TIMER_);
        if (rc)
            return uccl__err(UCCL_ERR_IO, "QP %u to RTR on %s (peer QP %u): %s", q->qp->qp_num,
                             dv->name, p[i].qpn, strerror(rc));
        a = (struct ibv_qp_attr_s){.qp_state = IBV_QPS_RTS_, .sq_psn = q->psn, .timeout = 14,
                                   .retry_cnt = 7, .rnr_retry = 7, .max_rd_atomic = 16};
        rc = ib->modify_qp(q->qp, &a, IBV_QP_STATE_ | IBV_QP_SQ_PSN_ | IBV_QP_TIMEOUT_ |
                           IBV_QP_RETRY_CNT_ | IBV_QP_RNR_RETRY_ | IBV_QP_MAX_QP_RD_ATOMIC_);
        if (rc)
            return uccl__err(UCCL_ERR_IO, "QP %u to RTS on %s: %s", q->qp->qp_num, dv->name,
                             strerror(rc));
    }
    return UCCL_OK;
}

static int rdma_conn_accept(struct uccl__link *lk, const struct uccl__hello *peer,
                            struct uccl__hello *ack)
{
    (void)peer;
    struct uccl__rdma_conn *t;
    int rc = rconn_new(lk, &t);
    if (rc)
        return rc;
    ack->num_streams = 1;
    return UCCL_OK;
}

static unsigned rdma_streams_needed(const struct uccl__link *lk) { (void)lk; return 1; }

/* Acceptor, in the listener: the connector's QPs came right behind its
 * HELLO_STREAM (so waiting for them is short); ours go back before the
 * listener's ACK, and the connection is whole before accept() sees it. */
static int rdma_add_stream(struct uccl__link *lk, int fd, unsigned index)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    uint8_t buf[INFO_SIZE];
    struct peer_qp p[UCCL_RDMA_MAX_QPS];
    unsigned nqp, ndev, n;
    uint64_t deadline = uccl__now_ns() + 2000000000ull;
    if (index != 0 || t->q[0].qp)
        return uccl__err(UCCL_ERR_PROTO, "RDMA setup socket %u duplicated or out of range", index);
    int rc = uccl__sock_recv_all(fd, buf, sizeof(buf), deadline, 0);
    if (rc == UCCL_OK)
        rc = info_decode(buf, &nqp, &ndev, p);
    if (rc == UCCL_OK) {
        t->peer_ndev = ndev;
        rc = qps_create(t, nqp);
    }
    if (rc == UCCL_OK)
        rc = qps_connect(t, p);
    if (rc == UCCL_OK) {
        const struct uccl__rdma_dev *d = uccl__rdma_devs(&n);
        info_encode(t, d, n, buf);
        rc = uccl__sock_send_all(fd, buf, sizeof(buf), deadline);
    }
    if (rc == UCCL_OK)
        atomic_store(&t->ready, 1);
    return rc;
}

static int rdma_conn_connected(struct uccl__link *lk, const struct uccl__hello *ack,
                               uint64_t deadline)
{
    if (ack->num_streams != 1)
        return uccl__err(UCCL_ERR_PROTO, "RDMA setup: the peer asked for %u sockets",
                         ack->num_streams);
    struct uccl__rdma_conn *t;
    int rc = rconn_new(lk, &t);
    if (rc)
        return rc;
    unsigned n, nqp, ndev;
    const struct uccl__rdma_dev *d = uccl__rdma_devs(&n);
    if (!d)
        return UCCL_ERR_UNAVAIL;
    int fd = -1;
    rc = qps_create(t, t->nqp);
    uint8_t buf[INFO_SIZE];
    struct peer_qp p[UCCL_RDMA_MAX_QPS];
    uint8_t mine[INFO_SIZE];
    if (rc == UCCL_OK) {
        info_encode(t, d, n, mine);
        rc = uccl__open_setup_stream(lk, deadline, mine, sizeof(mine), buf, sizeof(buf), &fd);
    }
    if (rc == UCCL_OK)
        rc = info_decode(buf, &nqp, &ndev, p);
    if (rc == UCCL_OK && nqp != t->nqp)
        rc = uccl__err(UCCL_ERR_PROTO, "RDMA setup: the peer made %u QPs for our %u", nqp, t->nqp);
    if (rc == UCCL_OK) {
        t->peer_ndev = ndev;
        rc = qps_connect(t, p);
    }
    if (fd >= 0)
        close(fd);
    if (rc == UCCL_OK)
        atomic_store(&t->ready, 1);
    return rc;
}

static int rdma_conn_start(struct uccl__link *lk)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    if (pthread_create(&t->progress, NULL, uccl__rdma_progress_main, lk))
        return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    t->thread = 1;
    return UCCL_OK;
}

/* Every QP to ERR: the NIC flushes what is posted, and movers waiting on
 * their completions see them fail. */
static void rdma_conn_shutdown(struct uccl__link *lk)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    const struct uccl__ibv *ib = uccl__ibv();
    if (!t || !ib || atomic_exchange(&t->stop, 1))
        return;
    uccl__rdma_stage_shutdown(t->stage);
    for (unsigned i = 0; i < t->nqp; i++)
        if (t->q[i].qp) {
            struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_ERR_};
            ib->modify_qp(t->q[i].qp, &a, IBV_QP_STATE_);
        }
}

static void rdma_conn_destroy(struct uccl__link *lk)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    if (!t)
        return;
    rdma_conn_shutdown(lk);
    uccl__rdma_stage_join(t->stage);
    if (t->thread) {
        pthread_join(t->progress, NULL);
        t->thread = 0;
    }
}

/* With the last reference: no mover runs any more. */
static void rdma_conn_free(struct uccl__link *lk)
{
    struct uccl__rdma_conn *t = lk->tp_priv;
    const struct uccl__ibv *ib = uccl__ibv();
    if (!t)
        return;
    rdma_conn_destroy(lk);
    for (unsigned i = 0; ib && i < UCCL_RDMA_MAX_QPS; i++) {
        if (t->q[i].qp)
            ib->destroy_qp(t->q[i].qp);
        if (t->q[i].cq)
            ib->destroy_cq(t->q[i].cq);
        pthread_mutex_destroy(&t->q[i].poll_mu);
    }
    uccl__rdma_area_free(&t->own); /* after the QPs that used them */
    pthread_mutex_destroy(&t->own_mu);
    uccl__rdma_stage_free(t->stage);
    free(t);
    lk->tp_priv = NULL;
}

const struct uccl__tp_ops uccl__tp_rdma = {
    .name = "rdma",
    .id = UCCL_TP_RDMA,
    .source_writes = 1,
    .available = rdma_available,
    .conn_accept = rdma_conn_accept,
    .conn_connected = rdma_conn_connected,
    .streams_needed = rdma_streams_needed,
    .add_stream = rdma_add_stream,
    .conn_start = rdma_conn_start,
    .mem_reg = uccl__rdma_mem_reg,
    .mem_dereg = uccl__rdma_mem_dereg,
    .mem_key = uccl__rdma_mem_key,
    .staged = uccl__rdma_staged,
    .pull = rdma_pull,
    .push = rdma_push,
    .stream = uccl__rdma_stream,
    .on_msg = uccl__rdma_on_msg,
    .conn_shutdown = rdma_conn_shutdown,
    .conn_destroy = rdma_conn_destroy,
    .conn_free = rdma_conn_free,
};
