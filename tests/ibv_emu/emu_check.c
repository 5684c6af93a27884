/* The emulator's own tests: `emu_check <lib> <scenario>` loads the library
 * at <lib> as the engine does (dlopen + dlvsym at rdma-core's versions, the
 * data path through context->ops), forks a peer, connects one RC QP each way
 * over a socketpair and runs one scenario; it prints "OK <scenario>" and
 * exits 0, or prints what failed and exits 1.  Every wait is bounded. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "load/ibv_loader.h"
#include "ibv_emu.h" /* rdma-core's structs the engine does not declare */

static struct uccl__ibv ib;
/* per scenario: the RNR timer code each side sets at RTR, the access
 * rights each side's QP grants at INIT */
static int rnr_timer = 1;
static unsigned qp_access = IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_WRITE_ |
                            IBV_ACCESS_REMOTE_READ_;
static int (*query_qp)(struct ibv_qp_s *, struct ibv_qp_attr_s *, int, struct ibv_qp_init_attr_s *);
static const char *who = "?";
/* completion channels (the cq_events scenario gives each side's CQ one) */
static struct ibv_comp_channel_s *(*create_channel)(struct ibv_context_s *);
static int (*destroy_channel)(struct ibv_comp_channel_s *);
static int (*get_cq_event)(struct ibv_comp_channel_s *, struct ibv_cq_s **, void **);
static void (*ack_cq_events)(struct ibv_cq_s *, unsigned);
static struct ibv_comp_channel_s *channel;
static int want_channel;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            printf("FAIL [%s] %s:%d: ", who, __FILE__, __LINE__);                          \
            printf(__VA_ARGS__);                                                           \
            printf("\n");                                                                  \
            fflush(stdout);                                                                \
            _exit(1);                                                                      \
        }                                                                                  \
    } while (0)

static void load(const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK(h, "dlopen %s: %s", path, dlerror());
#define V(p, n, v) CHECK((*(void **)&(p) = dlvsym(h, n, v)) != NULL, "no %s@%s", n, v)
    V(ib.get_device_list, "ibv_get_device_list", "IBVERBS_1.1");
    V(ib.free_device_list, "ibv_free_device_list", "IBVERBS_1.1");
    V(ib.get_device_name, "ibv_get_device_name", "IBVERBS_1.1");
    V(ib.open_device, "ibv_open_device", "IBVERBS_1.1");
    V(ib.query_port, "ibv_query_port", "IBVERBS_1.1");
    V(ib.query_gid, "ibv_query_gid", "IBVERBS_1.1");
    V(ib.alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1");
    V(ib.reg_mr, "ibv_reg_mr", "IBVERBS_1.1");
    V(ib.dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1");
    V(ib.create_cq, "ibv_create_cq", "IBVERBS_1.1");
    V(ib.create_qp, "ibv_create_qp", "IBVERBS_1.1");
    V(ib.modify_qp, "ibv_modify_qp", "IBVERBS_1.1");
    V(ib.destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1");
    V(ib.destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1");
    V(ib.query_gid_ex, "_ibv_query_gid_ex", "IBVERBS_1.11");
    V(query_qp, "ibv_query_qp", "IBVERBS_1.1");
    V(create_channel, "ibv_create_comp_channel", "IBVERBS_1.0");
    V(destroy_channel, "ibv_destroy_comp_channel", "IBVERBS_1.0");
    V(get_cq_event, "ibv_get_cq_event", "IBVERBS_1.1");
    V(ack_cq_events, "ibv_ack_cq_events", "IBVERBS_1.1");
#undef V
}

struct side {
    struct ibv_context_s *ctx;
    struct ibv_pd_s *pd;
    struct ibv_cq_s *cq;
    struct ibv_qp_s *qp;
    int fd; /* to the peer process */
};

static void xchg(struct side *s, const void *mine, void *theirs, size_t n)
{
    CHECK(write(s->fd, mine, n) == (ssize_t)n, "write to peer");
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(s->fd, (char *)theirs + got, n - got);
        CHECK(r > 0, "peer gone (read %zd)", r);
        got += (size_t)r;
    }
}

static void sync_peer(struct side *s)
{
    char a = 1, b;
    xchg(s, &a, &b, 1);
}

static int qp_state(struct side *s)
{
    struct ibv_qp_attr_s a;
    struct ibv_qp_init_attr_s ia;
    CHECK(query_qp(s->qp, &a, IBV_QP_STATE_, &ia) == 0, "ibv_query_qp");
    return a.qp_state;
}

static int to_init(struct side *s, unsigned access)
{
    struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_INIT_, .port_num = 1, .qp_access_flags = access};
    return ib.modify_qp(s->qp, &a, IBV_QP_STATE_ | IBV_QP_PKEY_INDEX_ | IBV_QP_PORT_ |
                                        IBV_QP_ACCESS_FLAGS_);
}

static int to_rtr(struct side *s, uint32_t peer_qpn, int with_av)
{
    struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_RTR_, .path_mtu = 3, .dest_qp_num = peer_qpn,
                              .max_dest_rd_atomic = 1, .min_rnr_timer = (uint8_t)rnr_timer};
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = 1;
    a.ah_attr.grh.sgid_index = 1;
    CHECK(ib.query_gid(s->ctx, 1, 1, &a.ah_attr.grh.dgid) == 0, "query_gid");
    int mask = IBV_QP_STATE_ | IBV_QP_PATH_MTU_ | IBV_QP_DEST_QPN_ | IBV_QP_RQ_PSN_ |
               IBV_QP_MAX_DEST_RD_ATOMIC_ | IBV_QP_MIN_RNR_TIMER_ | (with_av ? IBV_QP_AV_ : 0);
    return ib.modify_qp(s->qp, &a, mask);
}

static int to_rts(struct side *s, int rnr_retry)
{
    struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_RTS_, .timeout = 14, .retry_cnt = 7,
                              .rnr_retry = (uint8_t)rnr_retry, .max_rd_atomic = 1};
    return ib.modify_qp(s->qp, &a, IBV_QP_STATE_ | IBV_QP_SQ_PSN_ | IBV_QP_TIMEOUT_ |
                                        IBV_QP_RETRY_CNT_ | IBV_QP_RNR_RETRY_ |
                                        IBV_QP_MAX_QP_RD_ATOMIC_);
}

static void open_side(struct side *s)
{
    int n = 0;
    struct ibv_device_s **l = ib.get_device_list(&n);
    CHECK(l && n >= 1, "no emulated device (n=%d)", n);
    s->ctx = ib.open_device(l[0]);
    CHECK(s->ctx && s->ctx->ops.post_send && s->ctx->ops.poll_cq, "open_device / ops table");
    s->pd = ib.alloc_pd(s->ctx);
    if (want_channel)
        CHECK((channel = create_channel(s->ctx)) != NULL, "create_comp_channel");
    s->cq = ib.create_cq(s->ctx, 256, s, channel, 0);
    struct ibv_qp_init_attr_s ia = {.send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC_,
                                    .cap = {64, 64, 1, 1, 64}};
    s->qp = ib.create_qp(s->pd, &ia);
    CHECK(s->pd && s->cq && s->qp && s->qp->qp_num > 0 && s->qp->qp_num <= 0xffffff, "pd/cq/qp");
    ib.free_device_list(l);
}

/* A connected pair: both sides at RTS with the given RNR retry count. */
static void connect_side(struct side *s, int rnr_retry)
{
    uint32_t peer;
    CHECK(to_init(s, qp_access) == 0, "INIT");
    xchg(s, &s->qp->qp_num, &peer, sizeof(peer));
    CHECK(to_rtr(s, peer, 1) == 0, "RTR");
    CHECK(to_rts(s, rnr_retry) == 0, "RTS");
    CHECK(qp_state(s) == IBV_QPS_RTS_, "state after RTS: %d", qp_state(s));
    sync_peer(s);
}

static int post(struct side *s, uint64_t id, int opcode, void *buf, uint32_t len, uint32_t lkey,
                uint64_t raddr, uint32_t rkey, uint32_t imm)
{
    struct ibv_sge_s sge = {(uint64_t)(uintptr_t)buf, len, lkey};
    struct ibv_send_wr_s wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = opcode,
                               .send_flags = IBV_SEND_SIGNALED_, .imm_data = htonl(imm)};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    struct ibv_send_wr_s *bad = NULL;
    return s->ctx->ops.post_send(s->qp, &wr, &bad);
}

static int post_recv(struct side *s, uint64_t id)
{
    struct ibv_recv_wr_s wr = {.wr_id = id};
    struct ibv_recv_wr_s *bad = NULL;
    return s->ctx->ops.post_recv(s->qp, &wr, &bad);
}

/* One completion within 10 s. */
static struct ibv_wc_s poll1(struct side *s)
{
    struct ibv_wc_s wc;
    for (int i = 0; i < 100000; i++) {
        if (s->cq->context->ops.poll_cq(s->cq, 1, &wc) == 1)
            return wc;
        usleep(100);
    }
    CHECK(0, "no completion within 10 s");
    return wc;
}

/* Wait (bounded: 2 s) for the QP to reach a state; 1 if it did. */
static int reaches(struct side *s, int state)
{
    for (int i = 0; i < 2000; i++) {
        if (qp_state(s) == state)
            return 1;
        usleep(1000);
    }
    return 0;
}

static double ms_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

static int none_within(struct side *s, int ms)
{
    struct ibv_wc_s wc;
    for (int i = 0; i < ms; i++) {
        if (s->cq->context->ops.poll_cq(s->cq, 1, &wc) == 1)
            return 0;
        usleep(1000);
    }
    return 1;
}

struct region { uint64_t addr; uint32_t rkey, len; };
enum { N = 1 << 20, GUARD = 4096 };

static unsigned char *filled(size_t n, unsigned char v)
{
    unsigned char *p = malloc(n);
    CHECK(p, "malloc");
    memset(p, v, n);
    return p;
}

static void randomize(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (unsigned char)(seed >> 16);
    }
}

static int all_is(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return 0;
    return 1;
}

/* ---- scenarios: `a` is the requester, `b` the responder ------------------ */

static int scenario(const char *name, struct side *s, int is_a)
{
    /* B offers a poisoned region of N bytes with a guard after it. */
    unsigned char *mem = filled(N + GUARD, 0xA5);
    int access = IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_WRITE_ | IBV_ACCESS_REMOTE_READ_;
    if (!strcmp(name, "no_remote_read") && !is_a)
        access = IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_WRITE_;
    struct ibv_mr_s *mr = ib.reg_mr(s->pd, mem, is_a ? N + GUARD : N, access);
    CHECK(mr && mr->lkey && mr->addr == mem && mr->length == (size_t)(is_a ? N + GUARD : N), "reg_mr");
    struct region mine = {(uint64_t)(uintptr_t)mem, mr->rkey, N}, peer;
    if (!strcmp(name, "state_machine"))
        goto state_machine;
    if (!strcmp(name, "read") && !is_a)
        randomize(mem, N, 9); /* before the requester can know the region */
    if (!strcmp(name, "qp_no_remote_write") && !is_a)
        qp_access = IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_READ_;
    if (!strcmp(name, "rnr_requester_count"))
        rnr_timer = 20; /* 10.24 ms */
    /* the RNR retry count is the requester's: 3 there, 7 (forever) here */
    connect_side(s, !strcmp(name, "rnr_exceeded") ? 1
                    : !strcmp(name, "rnr_requester_count") && is_a ? 3 : 7);
    xchg(s, &mine, &peer, sizeof(mine));
    if (!strcmp(name, "write_imm")) {
        if (is_a) {
            randomize(mem, N, 1);
            CHECK(post(s, 1, IBV_WR_RDMA_WRITE_, mem, N / 2, mr->lkey, peer.addr, peer.rkey, 0) == 0, "post");
            CHECK(post(s, 2, IBV_WR_RDMA_WRITE_WITH_IMM_, mem + N / 2, N / 2, mr->lkey,
                       peer.addr + N / 2, peer.rkey, 0xC0FFEE) == 0, "post imm");
            for (uint64_t id = 1; id <= 2; id++) {
                struct ibv_wc_s wc = poll1(s);
                CHECK(wc.status == 0 && wc.wr_id == id && wc.opcode == IBV_WC_RDMA_WRITE_ &&
                      wc.qp_num == s->qp->qp_num, "send wc %lu: status %d opcode %d",
                      (unsigned long)wc.wr_id, wc.status, wc.opcode);
            }
        } else {
            CHECK(post_recv(s, 77) == 0, "post_recv");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.status == 0 && wc.wr_id == 77 && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM_ &&
                  (wc.wc_flags & IBV_WC_WITH_IMM_) && ntohl(wc.imm_data) == 0xC0FFEE &&
                  wc.byte_len == N / 2, "recv wc: status %d opcode %d flags %u imm %x len %u",
                  wc.status, wc.opcode, wc.wc_flags, ntohl(wc.imm_data), wc.byte_len);
            unsigned char *want = filled(N, 0);
            randomize(want, N, 1);
            CHECK(memcmp(mem, want, N) == 0, "written bytes differ");
            CHECK(all_is(mem + N, GUARD, 0xA5), "guard past the region touched");
        }
        sync_peer(s);
    } else if (!strcmp(name, "read")) {
        if (is_a) {
            CHECK(post(s, 5, IBV_WR_RDMA_READ_, mem, N, mr->lkey, peer.addr, peer.rkey, 0) == 0, "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.status == 0 && wc.opcode == IBV_WC_RDMA_READ_ && wc.byte_len == N,
                  "read wc: status %d opcode %d len %u", wc.status, wc.opcode, wc.byte_len);
            unsigned char *want = filled(N, 0);
            randomize(want, N, 9);
            CHECK(memcmp(mem, want, N) == 0, "read bytes differ");
            CHECK(all_is(mem + N, GUARD, 0xA5), "read wrote past its buffer");
        }
        sync_peer(s);
    } else if (!strcmp(name, "bad_rkey") || !strcmp(name, "out_of_bounds") ||
               !strcmp(name, "no_remote_read")) {
        if (is_a) {
            int rd = !strcmp(name, "no_remote_read");
            uint32_t rkey = !strcmp(name, "bad_rkey") ? peer.rkey ^ 0x5a5a : peer.rkey;
            uint64_t at = !strcmp(name, "out_of_bounds") ? peer.addr + N - 100 : peer.addr;
            randomize(mem, N, 3);
            CHECK(post(s, 9, rd ? IBV_WR_RDMA_READ_ : IBV_WR_RDMA_WRITE_, mem, 4096, mr->lkey, at,
                       rkey, 0) == 0, "post");
            CHECK(post(s, 10, IBV_WR_RDMA_WRITE_, mem, 16, mr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "second post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 9 && wc.status == IBV_WC_REM_ACCESS_ERR_,
                  "wc %lu status %d, expected REM_ACCESS_ERR", (unsigned long)wc.wr_id, wc.status);
            wc = poll1(s);
            CHECK(wc.wr_id == 10 && wc.status == IBV_WC_WR_FLUSH_ERR_, "second wc status %d", wc.status);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP state %d after the error, expected ERR", qp_state(s));
            CHECK(post(s, 11, IBV_WR_RDMA_WRITE_, mem, 16, mr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "post in ERR");
            wc = poll1(s);
            CHECK(wc.wr_id == 11 && wc.status == IBV_WC_WR_FLUSH_ERR_, "post in ERR: status %d",
                  wc.status);
        }
        sync_peer(s);
        if (!is_a)
            CHECK(all_is(mem, N + GUARD, 0xA5), "a refused access changed the target's memory");
    } else if (!strcmp(name, "send") || !strcmp(name, "send_too_long")) {
        /* SEND lands in the receive's own buffer; one too small for it is a
         * local length error there and an invalid request for the sender. */
        int too_long = !strcmp(name, "send_too_long");
        if (is_a) {
            randomize(mem, 4097, 4);
            sync_peer(s); /* the receive is posted */
            CHECK(post(s, 6, IBV_WR_SEND_, mem, 4097, mr->lkey, 0, 0, 0) == 0, "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(too_long ? wc.status == 9 /* REM_INV_REQ_ERR */ : wc.status == 0 && wc.opcode == 0,
                  "send wc: status %d opcode %d", wc.status, wc.opcode);
        } else {
            struct ibv_sge_s sge = {(uint64_t)(uintptr_t)mem, too_long ? 4096 : 8192, mr->lkey};
            struct ibv_recv_wr_s wr = {.wr_id = 12, .sg_list = &sge, .num_sge = 1}, *bad;
            CHECK(s->ctx->ops.post_recv(s->qp, &wr, &bad) == 0, "post_recv");
            sync_peer(s);
            struct ibv_wc_s wc = poll1(s);
            if (too_long) {
                CHECK(wc.wr_id == 12 && wc.status == 1 /* LOC_LEN_ERR */, "recv wc status %d",
                      wc.status);
                CHECK(all_is(mem, N + GUARD, 0xA5), "a refused SEND landed");
            } else {
                unsigned char *want = filled(4097, 0);
                randomize(want, 4097, 4);
                CHECK(wc.status == 0 && wc.opcode == IBV_WC_RECV_ && wc.byte_len == 4097 &&
                      !(wc.wc_flags & IBV_WC_WITH_IMM_), "recv wc: status %d opcode %d len %u",
                      wc.status, wc.opcode, wc.byte_len);
                CHECK(memcmp(mem, want, 4097) == 0 && all_is(mem + 4097, 4096, 0xA5),
                      "SEND bytes differ or spilled");
            }
        }
        sync_peer(s);
    } else if (!strcmp(name, "bad_lkey")) {
        if (is_a) {
            CHECK(post(s, 4, IBV_WR_RDMA_READ_, mem, 64, mr->lkey + 1, peer.addr, peer.rkey, 0) == 0,
                  "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.status == 4 /* LOC_PROT_ERR */, "status %d, expected LOC_PROT_ERR", wc.status);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP not in ERR");
        }
        sync_peer(s);
    } else if (!strcmp(name, "ordered")) {
        /* 2000 writes of an increasing counter to one word, then an
         * immediate: the word holds the last one, completions in order. */
        enum { K = 2000 };
        if (is_a) {
            uint32_t *vals = (uint32_t *)mem;
            for (uint32_t i = 0; i < K; i++) {
                vals[i] = i + 1;
                CHECK(post(s, i, i + 1 == K ? IBV_WR_RDMA_WRITE_WITH_IMM_ : IBV_WR_RDMA_WRITE_,
                           &vals[i], 4, mr->lkey, peer.addr, peer.rkey, K) == 0, "post %u", i);
                if (i % 32 == 31)
                    for (uint32_t j = i - 31; j <= i; j++) {
                        struct ibv_wc_s wc = poll1(s);
                        CHECK(wc.status == 0 && wc.wr_id == j, "wc %lu for %u, status %d",
                              (unsigned long)wc.wr_id, j, wc.status);
                    }
            }
            for (uint32_t j = K - K % 32; j < K; j++)
                CHECK(poll1(s).wr_id == j, "last completions out of order");
        } else {
            CHECK(post_recv(s, 1) == 0, "post_recv");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.status == 0 && ntohl(wc.imm_data) == K, "imm wc status %d", wc.status);
            CHECK(*(uint32_t *)mem == K, "the word holds %u, not the last write %u",
                  *(uint32_t *)mem, K);
        }
        sync_peer(s);
    } else if (!strcmp(name, "rnr_wait") || !strcmp(name, "rnr_exceeded")) {
        int exceeded = !strcmp(name, "rnr_exceeded");
        if (is_a) {
            CHECK(post(s, 3, IBV_WR_RDMA_WRITE_WITH_IMM_, mem, 64, mr->lkey, peer.addr, peer.rkey, 5)
                  == 0, "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(exceeded ? wc.status == IBV_WC_RNR_RETRY_EXC_ERR_ : wc.status == 0,
                  "status %d (%s)", wc.status, exceeded ? "expected RNR_RETRY_EXC_ERR" : "expected success");
            sync_peer(s);
        } else {
            /* No receive posted: the write waits (RNR) and consumes nothing. */
            CHECK(none_within(s, 300), "a completion without a posted receive");
            if (!exceeded) {
                CHECK(post_recv(s, 8) == 0, "post_recv");
                struct ibv_wc_s wc = poll1(s);
                CHECK(wc.status == 0 && wc.wr_id == 8 && ntohl(wc.imm_data) == 5, "late recv wc");
            } else {
                CHECK(all_is(mem, 64, 0xA5), "an RNR-refused write landed");
            }
            sync_peer(s);
        }
    } else if (!strcmp(name, "rnr_requester_count")) {
        /* The requester's rnr_retry (3) bounds the retries, not the
         * responder's (7: forever); each waits the responder's
         * min_rnr_timer (code 20: 10.24 ms), so giving up takes >= 30 ms. */
        if (is_a) {
            struct timespec t0;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            CHECK(post(s, 3, IBV_WR_RDMA_WRITE_WITH_IMM_, mem, 64, mr->lkey, peer.addr, peer.rkey, 5)
                  == 0, "post");
            struct ibv_wc_s wc = poll1(s);
            double ms = ms_since(&t0);
            CHECK(wc.status == IBV_WC_RNR_RETRY_EXC_ERR_, "status %d, expected RNR_RETRY_EXC_ERR",
                  wc.status);
            CHECK(ms >= 3 * 10.24 * 0.99, "gave up after %.2f ms: fewer than 3 timers of 10.24 ms",
                  ms);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP state %d after RNR exceeded", qp_state(s));
        } else {
            CHECK(none_within(s, 300), "a completion without a posted receive");
            CHECK(all_is(mem, 64, 0xA5), "an RNR-refused write landed");
        }
        sync_peer(s);
    } else if (!strcmp(name, "qp_no_remote_write")) {
        /* The responder's QP grants remote read but not remote write (its
         * region grants both): a READ is served, a WRITE refused. */
        if (is_a) {
            randomize(mem, 4096, 3);
            CHECK(post(s, 8, IBV_WR_RDMA_READ_, mem, 4096, mr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "post read");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 8 && wc.status == 0 && all_is(mem, 4096, 0xA5),
                  "read: status %d, or the bytes are not the responder's", wc.status);
            randomize(mem, 4096, 3);
            CHECK(post(s, 9, IBV_WR_RDMA_WRITE_, mem, 4096, mr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "post write");
            wc = poll1(s);
            CHECK(wc.wr_id == 9 && wc.status == IBV_WC_REM_ACCESS_ERR_,
                  "write: status %d, expected REM_ACCESS_ERR", wc.status);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP state %d", qp_state(s));
        }
        sync_peer(s);
        if (!is_a)
            CHECK(all_is(mem, N + GUARD, 0xA5), "a write the QP refuses changed memory");
    } else if (!strcmp(name, "read_into_readonly")) {
        /* A READ's destination must grant local write: a region without it
         * is a local protection error, the QP in ERR, nothing written. */
        if (is_a) {
            unsigned char *ro = filled(4096, 0x11);
            struct ibv_mr_s *rmr = ib.reg_mr(s->pd, ro, 4096, 0);
            CHECK(rmr, "reg_mr without rights");
            CHECK(post(s, 4, IBV_WR_RDMA_READ_, ro, 4096, rmr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 4 && wc.status == 4 /* LOC_PROT_ERR */, "status %d", wc.status);
            CHECK(qp_state(s) == IBV_QPS_ERR_ && all_is(ro, 4096, 0x11), "ERR / untouched");
        }
        sync_peer(s);
    } else if (!strcmp(name, "recv_no_local_write")) {
        /* A SEND into a receive whose buffer the responder may not write:
         * a local protection error there (the QP to ERR), a remote
         * operational error for the sender. */
        if (is_a) {
            sync_peer(s); /* the receive is posted */
            CHECK(post(s, 6, IBV_WR_SEND_, mem, 100, mr->lkey, 0, 0, 0) == 0, "post");
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 6 && wc.status == 11 /* REM_OP_ERR */, "send: status %d", wc.status);
        } else {
            unsigned char *ro = filled(4096, 0x11);
            struct ibv_mr_s *rmr = ib.reg_mr(s->pd, ro, 4096, 0);
            CHECK(rmr, "reg_mr without rights");
            struct ibv_sge_s sge = {(uint64_t)(uintptr_t)ro, 4096, rmr->lkey};
            struct ibv_recv_wr_s wr = {.wr_id = 12, .sg_list = &sge, .num_sge = 1}, *bad;
            CHECK(s->ctx->ops.post_recv(s->qp, &wr, &bad) == 0, "post_recv");
            sync_peer(s);
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 12 && wc.status == 4 /* LOC_PROT_ERR */, "recv: status %d",
                  wc.status);
            CHECK(all_is(ro, 4096, 0x11), "a SEND landed in a buffer without local write");
            CHECK(reaches(s, IBV_QPS_ERR_), "responder QP state %d", qp_state(s));
        }
        sync_peer(s);
    } else if (!strcmp(name, "cq_order")) {
        /* Both sides at once: K WRITEs and K SENDs interleaved (write i
         * before send i) into K posted receives, one CQ for both queues.
         * Each queue completes in its own order (sends in post order,
         * receives in posting order, message i in receive i), and a
         * receive's completion means the WRITE before it is in place. */
        enum { K = 64, SZ = 256 };
        unsigned char *rx = mem, *wdst = mem + N / 2, *ssrc = mem + N / 4,
                      *wsrc = mem + N / 4 + K * SZ;
        unsigned mine = is_a ? 100 : 200, theirs = is_a ? 200 : 100;
        for (int i = 0; i < K; i++) {
            struct ibv_sge_s sge = {(uint64_t)(uintptr_t)(rx + i * SZ), SZ, mr->lkey};
            struct ibv_recv_wr_s wr = {.wr_id = 5000 + i, .sg_list = &sge, .num_sge = 1}, *bad;
            CHECK(s->ctx->ops.post_recv(s->qp, &wr, &bad) == 0, "post_recv %d", i);
            randomize(ssrc + i * SZ, SZ, mine + i);
            randomize(wsrc + i * SZ, SZ, mine + 1000 + i);
        }
        sync_peer(s);
        for (int i = 0; i < K; i++) {
            CHECK(post(s, 2 * i, IBV_WR_RDMA_WRITE_, wsrc + i * SZ, SZ, mr->lkey,
                       peer.addr + N / 2 + i * SZ, peer.rkey, 0) == 0, "post write %d", i);
            CHECK(post(s, 2 * i + 1, IBV_WR_SEND_, ssrc + i * SZ, SZ, mr->lkey, 0, 0, 0) == 0,
                  "post send %d", i);
        }
        uint64_t next_send = 0, next_recv = 5000;
        unsigned char want[SZ];
        for (int n = 0; n < 3 * K; n++) {
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.status == 0 && wc.qp_num == s->qp->qp_num, "wc %lu status %d",
                  (unsigned long)wc.wr_id, wc.status);
            if (wc.opcode & IBV_WC_RECV_) {
                int i = (int)(wc.wr_id - 5000);
                CHECK(wc.wr_id == next_recv++ && wc.byte_len == SZ,
                      "receive %lu out of order or %u bytes", (unsigned long)wc.wr_id, wc.byte_len);
                randomize(want, SZ, theirs + i);
                CHECK(memcmp(rx + i * SZ, want, SZ) == 0, "message %d not in receive %d", i, i);
                randomize(want, SZ, theirs + 1000 + i);
                CHECK(memcmp(wdst + i * SZ, want, SZ) == 0,
                      "receive %d completed before the WRITE posted ahead of its SEND landed", i);
            } else {
                CHECK(wc.wr_id == next_send++, "send-queue completion %lu, expected %lu",
                      (unsigned long)wc.wr_id, (unsigned long)next_send - 1);
                CHECK(wc.opcode == (wc.wr_id % 2 ? 0 /* IBV_WC_SEND */ : IBV_WC_RDMA_WRITE_),
                      "opcode %d for %lu", wc.opcode, (unsigned long)wc.wr_id);
            }
        }
        sync_peer(s);
    } else if (!strcmp(name, "flush_on_err")) {
        /* A QP moved to ERR flushes everything outstanding, each queue in
         * order: the SEND waiting on the receiver (RNR, forever), those
         * queued behind it, every posted receive; later posts too.  The
         * flushed SENDs never land, even in a receive posted afterwards. */
        if (is_a) {
            for (int i = 0; i < 4; i++)
                CHECK(post_recv(s, 100 + i) == 0, "post_recv");
            for (int i = 1; i <= 3; i++)
                CHECK(post(s, i, IBV_WR_SEND_, mem, 64, mr->lkey, 0, 0, 0) == 0, "post send");
            CHECK(none_within(s, 200), "a completion while the receiver has no receive");
            struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_ERR_};
            CHECK(ib.modify_qp(s->qp, &a, IBV_QP_STATE_) == 0, "-> ERR");
            uint64_t next_send = 1, next_recv = 100;
            for (int n = 0; n < 7; n++) {
                struct ibv_wc_s wc = poll1(s);
                CHECK(wc.status == IBV_WC_WR_FLUSH_ERR_ && wc.qp_num == s->qp->qp_num,
                      "wc %lu status %d", (unsigned long)wc.wr_id, wc.status);
                uint64_t *next = wc.wr_id >= 100 ? &next_recv : &next_send;
                CHECK(wc.wr_id == (*next)++, "flushed %lu out of its queue's order",
                      (unsigned long)wc.wr_id);
            }
            CHECK(next_send == 4 && next_recv == 104, "not all flushed");
            CHECK(post(s, 7, IBV_WR_SEND_, mem, 64, mr->lkey, 0, 0, 0) == 0 && post_recv(s, 8) == 0,
                  "post in ERR");
            struct ibv_wc_s w1 = poll1(s), w2 = poll1(s);
            CHECK(w1.status == IBV_WC_WR_FLUSH_ERR_ && w2.status == IBV_WC_WR_FLUSH_ERR_ &&
                  w1.wr_id + w2.wr_id == 15, "posts in ERR: %d %d", w1.status, w2.status);
            sync_peer(s);
        } else {
            sync_peer(s); /* the requester flushed its SENDs */
            CHECK(post_recv(s, 9) == 0, "post_recv");
            CHECK(none_within(s, 300), "a flushed SEND landed in a receive posted later");
        }
    } else if (!strcmp(name, "send_inline")) {
        /* An inline SEND is copied at post: its buffer needs no key and is
         * the caller's again at once; one longer than max_inline_data (64
         * here, as ibv_query_qp says) is refused. */
        struct ibv_qp_attr_s qa;
        struct ibv_qp_init_attr_s ia;
        CHECK(query_qp(s->qp, &qa, 0, &ia) == 0 && qa.cap.max_inline_data == 64 &&
              ia.cap.max_send_wr == 64 && ia.send_cq == s->cq && qa.qp_access_flags == qp_access &&
              qa.rnr_retry == 7 && qa.min_rnr_timer == rnr_timer, "ibv_query_qp");
        unsigned char src[65];
        if (is_a) {
            sync_peer(s); /* the receive is posted */
            randomize(src, sizeof(src), 21);
            struct ibv_sge_s sge = {(uint64_t)(uintptr_t)src, 65, 0xdeadbeef};
            struct ibv_send_wr_s wr = {.wr_id = 6, .sg_list = &sge, .num_sge = 1,
                                       .opcode = IBV_WR_SEND_,
                                       .send_flags = IBV_SEND_SIGNALED_ | IBV_SEND_INLINE_};
            struct ibv_send_wr_s *bad = NULL;
            CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == EINVAL && bad == &wr, "65 B inline");
            sge.length = 64;
            CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == 0, "64 B inline");
            memset(src, 0, sizeof(src));
            struct ibv_wc_s wc = poll1(s);
            CHECK(wc.wr_id == 6 && wc.status == 0, "inline send: status %d", wc.status);
        } else {
            struct ibv_sge_s sge = {(uint64_t)(uintptr_t)mem, 4096, mr->lkey};
            struct ibv_recv_wr_s wr = {.wr_id = 12, .sg_list = &sge, .num_sge = 1}, *bad;
            CHECK(s->ctx->ops.post_recv(s->qp, &wr, &bad) == 0, "post_recv");
            sync_peer(s);
            struct ibv_wc_s wc = poll1(s);
            randomize(src, sizeof(src), 21);
            CHECK(wc.status == 0 && wc.byte_len == 64 && memcmp(mem, src, 64) == 0 &&
                  all_is(mem + 64, 64, 0xA5), "inline bytes: status %d len %u", wc.status,
                  wc.byte_len);
        }
        sync_peer(s);
    } else if (!strcmp(name, "cq_events")) {
        /* The requester sends four SENDs, one at a time; the responder's CQ
         * (with a channel) is armed before the 1st (an event), not re-armed
         * for the 2nd (none), armed solicited-only for the 3rd (plain: none)
         * and the 4th (solicited: an event). */
        static const int solicited[4] = {0, 0, 0, 1}, armed[4] = {1, 0, 2, 2},
                         event[4] = {1, 0, 0, 1};
        int events = 0;
        if (!is_a) {
            fcntl(channel->fd, F_SETFL, O_NONBLOCK);
            struct ibv_cq_s *cq;
            void *ctx;
            CHECK(get_cq_event(channel, &cq, &ctx) == -1 && errno == EAGAIN, "an event unarmed");
            CHECK(ib.destroy_cq(s->cq) == EBUSY && destroy_channel(channel) == EBUSY,
                  "a CQ used by a QP, or a channel used by a CQ, destroyed");
        }
        for (int i = 0; i < 4; i++) {
            if (is_a) {
                sync_peer(s);
                struct ibv_sge_s sge = {(uint64_t)(uintptr_t)mem, 16, mr->lkey};
                struct ibv_send_wr_s wr = {.wr_id = 6, .sg_list = &sge, .num_sge = 1,
                                           .opcode = IBV_WR_SEND_,
                                           .send_flags = IBV_SEND_SIGNALED_ |
                                                         (solicited[i] ? IBV_SEND_SOLICITED_ : 0)};
                struct ibv_send_wr_s *bad;
                CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == 0, "post");
                CHECK(poll1(s).status == 0, "send %d", i);
            } else {
                struct ibv_sge_s sge = {(uint64_t)(uintptr_t)mem, 16, mr->lkey};
                struct ibv_recv_wr_s wr = {.wr_id = 10 + i, .sg_list = &sge, .num_sge = 1}, *bad;
                CHECK(s->ctx->ops.post_recv(s->qp, &wr, &bad) == 0, "post_recv");
                if (armed[i])
                    CHECK(s->cq->context->ops.req_notify_cq(s->cq, armed[i] == 2) == 0, "arm");
                sync_peer(s);
                CHECK(poll1(s).wr_id == (uint64_t)(10 + i), "receive %d", i);
                struct pollfd pf = {.fd = channel->fd, .events = POLLIN};
                int ready = poll(&pf, 1, event[i] ? 5000 : 200) == 1;
                CHECK(ready == event[i], "SEND %d: %s event", i, ready ? "an unexpected" : "no");
                struct ibv_cq_s *cq = NULL;
                void *ctx = NULL;
                if (ready) {
                    CHECK(get_cq_event(channel, &cq, &ctx) == 0 && cq == s->cq && ctx == s,
                          "get_cq_event: the CQ and its context");
                    events++;
                }
            }
        }
        if (!is_a)
            ack_cq_events(s->cq, (unsigned)events);
        sync_peer(s);
    } else if (!strcmp(name, "peer_dies")) {
        if (is_a) {
            CHECK(post_recv(s, 21) == 0, "post_recv");
            sync_peer(s); /* B exits after this */
            usleep(200000);
            CHECK(post(s, 22, IBV_WR_RDMA_WRITE_, mem, N, mr->lkey, peer.addr, peer.rkey, 0) == 0,
                  "post after the peer died");
            struct ibv_wc_s w1 = poll1(s), w2 = poll1(s);
            struct ibv_wc_s rw = w1.opcode & IBV_WC_RECV_ ? w1 : w2, sw = w1.opcode & IBV_WC_RECV_ ? w2 : w1;
            CHECK(rw.wr_id == 21 && rw.status == IBV_WC_WR_FLUSH_ERR_, "posted recv: status %d",
                  rw.status);
            CHECK(sw.wr_id == 22 && (sw.status == IBV_WC_WR_FLUSH_ERR_ ||
                                     sw.status == IBV_WC_RETRY_EXC_ERR_), "send: status %d", sw.status);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP state %d with the peer dead", qp_state(s));
        } else {
            sync_peer(s);
            _exit(0); /* dies without cleaning up */
        }
    } else if (!strcmp(name, "peer_dies_midway")) {
        if (is_a) {
            sync_peer(s);
            for (int i = 0; i < 8; i++) /* 8 MiB queued; B dies meanwhile */
                CHECK(post(s, 30 + i, IBV_WR_RDMA_WRITE_, mem, N, mr->lkey, peer.addr, peer.rkey, 0)
                      == 0, "post");
            int retry = 0, flush = 0, ok = 0;
            for (int i = 0; i < 8; i++) {
                struct ibv_wc_s wc = poll1(s);
                ok += wc.status == 0;
                retry += wc.status == IBV_WC_RETRY_EXC_ERR_;
                flush += wc.status == IBV_WC_WR_FLUSH_ERR_;
            }
            CHECK(ok + retry + flush == 8 && retry + flush > 0, "ok %d retry %d flush %d", ok,
                  retry, flush);
            CHECK(qp_state(s) == IBV_QPS_ERR_, "QP state %d", qp_state(s));
        } else {
            sync_peer(s);
            kill(getpid(), SIGKILL);
        }
    } else {
        CHECK(0, "unknown scenario %s", name);
    }
    return 0;

state_machine:
    if (is_a) {
        struct ibv_send_wr_s *bad;
        struct ibv_sge_s sge = {(uint64_t)(uintptr_t)mem, 8, mr->lkey};
        struct ibv_send_wr_s wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE_};
        CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == EINVAL && bad == &wr, "post_send in RESET");
        CHECK(post_recv(s, 1) == EINVAL, "post_recv in RESET");
        CHECK(to_rtr(s, 5, 1) == EINVAL, "RESET -> RTR allowed");
        CHECK(to_rts(s, 7) == EINVAL, "RESET -> RTS allowed");
        CHECK(to_init(s, 0) == 0 && qp_state(s) == IBV_QPS_INIT_, "RESET -> INIT");
        CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == EINVAL, "post_send in INIT");
        CHECK(post_recv(s, 2) == 0, "post_recv in INIT refused");
        CHECK(to_rtr(s, 5, 0) == EINVAL, "RTR without an address vector allowed");
        CHECK(to_rts(s, 7) == EINVAL, "INIT -> RTS allowed");
        CHECK(to_rtr(s, 5, 1) == 0 && qp_state(s) == IBV_QPS_RTR_, "INIT -> RTR");
        CHECK(s->ctx->ops.post_send(s->qp, &wr, &bad) == EINVAL, "post_send in RTR");
        CHECK(to_rts(s, 7) == 0 && qp_state(s) == IBV_QPS_RTS_, "RTR -> RTS");
        struct ibv_qp_attr_s a = {.qp_state = IBV_QPS_ERR_};
        CHECK(ib.modify_qp(s->qp, &a, IBV_QP_STATE_) == 0 && qp_state(s) == IBV_QPS_ERR_, "-> ERR");
        struct ibv_wc_s wc = poll1(s); /* the receive posted in INIT is flushed */
        CHECK(wc.wr_id == 2 && wc.status == IBV_WC_WR_FLUSH_ERR_ && (wc.opcode & IBV_WC_RECV_),
              "flushed recv: id %lu status %d", (unsigned long)wc.wr_id, wc.status);
        /* GIDs: index 1 is RoCE v2 over 127.0.0.1, index 0 v1 */
        struct ibv_gid_entry_s e;
        CHECK(ib.query_gid_ex(s->ctx, 1, 1, &e, 0, sizeof(e)) == 0 &&
              e.gid_type == IBV_GID_TYPE_ROCE_V2_ && e.gid.raw[12] == 127, "GID 1");
        CHECK(ib.query_gid_ex(s->ctx, 1, 0, &e, 0, sizeof(e)) == 0 &&
              e.gid_type == IBV_GID_TYPE_ROCE_V1_, "GID 0");
        struct ibv_port_attr_s pa;
        memset(&pa, 0, sizeof(pa));
        CHECK(ib.query_port(s->ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE_ &&
              pa.link_layer == IBV_LINK_LAYER_ETHERNET_ && pa.gid_tbl_len == 2, "port");
        CHECK(ib.query_port(s->ctx, 2, &pa) != 0, "port 2 exists");
    }
    sync_peer(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s <libibverbs> <scenario>\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    alarm(60); /* nothing here may hang a test run */
    load(argv[1]);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    struct side s = {.fd = pid == 0 ? sv[1] : sv[0]};
    close(pid == 0 ? sv[0] : sv[1]);
    who = pid == 0 ? "responder" : "requester";
    want_channel = !strcmp(argv[2], "cq_events");
    open_side(&s);
    scenario(argv[2], &s, pid != 0);
    if (pid == 0) {
        ib.destroy_qp(s.qp);
        if (channel) /* every event acked: destroy_cq does not wait */
            CHECK(ib.destroy_cq(s.cq) == 0 && destroy_channel(channel) == 0, "destroy cq, channel");
        _exit(0);
    }
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    int expect_kill = !strcmp(argv[2], "peer_dies_midway");
    CHECK(expect_kill ? WIFSIGNALED(st) : WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "the responder failed (status 0x%x)", st);
    ib.destroy_qp(s.qp);
    if (channel)
        CHECK(ib.destroy_cq(s.cq) == 0 && destroy_channel(channel) == 0, "destroy cq, channel");
    printf("OK %s\n", argv[2]);
    return 0;
}
