/* libibverbs at run time (NCCL's ibvwrap pattern).
 *
 * libibverbs.so.1 (UCCL_IBVERBS_LIB overrides the path) is dlopen'ed on
 * first use and every exported entry point is looked up once with dlvsym at
 * the symbol version rdma-core gives it, into one write-once table.  The
 * data path (post_send, post_recv, poll_cq) is not exported: verbs.h makes
 * those static inline calls through context->ops, and so does this engine
 * (uccl__ibv_post_send, ... below).
 *
 * The build needs no rdma-core headers: the slice of the verbs ABI used is
 * declared here under its own names, with the layouts of rdma-core's
 * verbs.h on LP64 Linux (stable since IBVERBS_1.1; the compat members of
 * the context ops table keep their slots).  Only the fields the engine
 * reads or writes matter, but every struct is declared whole so that sizes
 * match too. */
#ifndef UCCL_IBV_LOADER_H
#define UCCL_IBV_LOADER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

union ibv_gid_u {
    uint8_t raw[16];
    struct { uint64_t subnet_prefix, interface_id; } global;
};

struct ibv_device_s; /* opaque: read only through ibv_get_device_name */
struct ibv_qp_s;
struct ibv_cq_s;
struct ibv_wc_s;
struct ibv_send_wr_s;
struct ibv_recv_wr_s;

struct ibv_context_ops_s {
    void *compat0[11];     /* _compat_query_device .. _compat_create_cq, alloc/bind/dealloc_mw */
    int (*poll_cq)(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc);
    int (*req_notify_cq)(struct ibv_cq_s *cq, int solicited_only);
    void *compat1[8];      /* _compat_cq_event .. _compat_destroy_srq, post_srq_recv */
    void *compat2[4];      /* _compat_create_qp .. _compat_destroy_qp */
    int (*post_send)(struct ibv_qp_s *qp, struct ibv_send_wr_s *wr, struct ibv_send_wr_s **bad);
    int (*post_recv)(struct ibv_qp_s *qp, struct ibv_recv_wr_s *wr, struct ibv_recv_wr_s **bad);
    void *compat3[5];      /* _compat_create_ah .. _compat_async_event */
};

struct ibv_context_s {
    struct ibv_device_s *device;
    struct ibv_context_ops_s ops;
    int cmd_fd, async_fd, num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct ibv_pd_s { struct ibv_context_s *context; uint32_t handle; };

struct ibv_mr_s {
    struct ibv_context_s *context;
    struct ibv_pd_s *pd;
    void *addr;
    size_t length;
    uint32_t handle, lkey, rkey;
};

struct ibv_cq_s {
    struct ibv_context_s *context;
    void *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed, async_events_completed;
};

struct ibv_qp_s {
    struct ibv_context_s *context;
    void *qp_context;
    struct ibv_pd_s *pd;
    struct ibv_cq_s *send_cq, *recv_cq;
    void *srq;
    uint32_t handle, qp_num;
    int state, qp_type;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_qp_cap_s {
    uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_qp_init_attr_s {
    void *qp_context;
    struct ibv_cq_s *send_cq, *recv_cq;
    void *srq;
    struct ibv_qp_cap_s cap;
    int qp_type;
    int sq_sig_all;
};

struct ibv_global_route_s {
    union ibv_gid_u dgid;
    uint32_t flow_label;
    uint8_t sgid_index, hop_limit, traffic_class;
};

struct ibv_ah_attr_s {
    struct ibv_global_route_s grh;
    uint16_t dlid;
    uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct ibv_qp_attr_s {
    int qp_state, cur_qp_state, path_mtu, path_mig_state;
    uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
    unsigned qp_access_flags;
    struct ibv_qp_cap_s cap;
    struct ibv_ah_attr_s ah_attr, alt_ah_attr;
    uint16_t pkey_index, alt_pkey_index;
    uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
        port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
    uint32_t rate_limit;
};

struct ibv_port_attr_s {
    int state, max_mtu, active_mtu, gid_tbl_len;
    uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
    uint16_t pkey_tbl_len, lid, sm_lid;
    uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width,
        active_speed, phys_state, link_layer, flags;
    uint16_t port_cap_flags2;
    uint32_t active_speed_ex;
};

struct ibv_gid_entry_s {
    union ibv_gid_u gid;
    uint32_t gid_index, port_num, gid_type, ndev_ifindex;
};

struct ibv_sge_s { uint64_t addr; uint32_t length, lkey; };

struct ibv_send_wr_s {
    uint64_t wr_id;
    struct ibv_send_wr_s *next;
    struct ibv_sge_s *sg_list;
    int num_sge;
    int opcode;
    unsigned send_flags;
    uint32_t imm_data; /* network order */
    union {
        struct { uint64_t remote_addr; uint32_t rkey; } rdma;
        struct { uint64_t remote_addr, compare_add, swap; uint32_t rkey; } atomic;
        struct { void *ah; uint32_t remote_qpn, remote_qkey; } ud;
    } wr;
    union { struct { uint32_t remote_srqn; } xrc; } qp_type;
    union {
        struct { void *mw; uint32_t rkey; struct { void *mr; uint64_t addr, length;
                                                   unsigned mw_access_flags; } bind_info; } bind_mw;
        struct { void *hdr; uint16_t hdr_sz, mss; } tso;
    } ext;
};

struct ibv_recv_wr_s {
    uint64_t wr_id;
    struct ibv_recv_wr_s *next;
    struct ibv_sge_s *sg_list;
    int num_sge;
};

struct ibv_wc_s {
    uint64_t wr_id;
    int status, opcode;
    uint32_t vendor_err, byte_len;
    uint32_t imm_data; /* network order */
    uint32_t qp_num, src_qp;
    unsigned wc_flags;
    uint16_t pkey_index, slid;
    uint8_t sl, dlid_path_bits;
};

/* The constants used (verbs.h values). */
enum { IBV_QPS_RESET_ = 0, IBV_QPS_INIT_ = 1, IBV_QPS_RTR_ = 2, IBV_QPS_RTS_ = 3,
       IBV_QPS_ERR_ = 6 };
enum { IBV_QPT_RC_ = 2 };
enum { IBV_QP_STATE_ = 1 << 0, IBV_QP_ACCESS_FLAGS_ = 1 << 3, IBV_QP_PKEY_INDEX_ = 1 << 4,
       IBV_QP_PORT_ = 1 << 5, IBV_QP_AV_ = 1 << 7, IBV_QP_PATH_MTU_ = 1 << 8,
       IBV_QP_TIMEOUT_ = 1 << 9, IBV_QP_RETRY_CNT_ = 1 << 10, IBV_QP_RNR_RETRY_ = 1 << 11,
       IBV_QP_RQ_PSN_ = 1 << 12, IBV_QP_MAX_QP_RD_ATOMIC_ = 1 << 13,
       IBV_QP_MIN_RNR_TIMER_ = 1 << 15, IBV_QP_SQ_PSN_ = 1 << 16,
       IBV_QP_MAX_DEST_RD_ATOMIC_ = 1 << 17, IBV_QP_DEST_QPN_ = 1 << 20 };
enum { IBV_ACCESS_LOCAL_WRITE_ = 1, IBV_ACCESS_REMOTE_WRITE_ = 2, IBV_ACCESS_REMOTE_READ_ = 4 };
enum { IBV_WR_RDMA_WRITE_ = 0, IBV_WR_RDMA_WRITE_WITH_IMM_ = 1, IBV_WR_SEND_ = 2,
       IBV_WR_RDMA_READ_ = 4 };
enum { IBV_SEND_SIGNALED_ = 2 };
enum { IBV_WC_SUCCESS_ = 0, IBV_WC_WR_FLUSH_ERR_ = 5, IBV_WC_REM_ACCESS_ERR_ = 10,
       IBV_WC_RETRY_EXC_ERR_ = 12, IBV_WC_RNR_RETRY_EXC_ERR_ = 13 };
enum { IBV_WC_RDMA_WRITE_ = 1, IBV_WC_RDMA_READ_ = 2, IBV_WC_RECV_ = 128,
       IBV_WC_RECV_RDMA_WITH_IMM_ = 129 };
enum { IBV_WC_WITH_IMM_ = 2 };
enum { IBV_PORT_ACTIVE_ = 4 };
enum { IBV_LINK_LAYER_INFINIBAND_ = 1, IBV_LINK_LAYER_ETHERNET_ = 2 };
enum { IBV_GID_TYPE_IB_ = 0, IBV_GID_TYPE_ROCE_V1_ = 1, IBV_GID_TYPE_ROCE_V2_ = 2 };

/* The exported entry points, with the versions rdma-core gives them. */
struct uccl__ibv {
    struct ibv_device_s **(*get_device_list)(int *num);
    void (*free_device_list)(struct ibv_device_s **list);
    const char *(*get_device_name)(struct ibv_device_s *dev);
    struct ibv_context_s *(*open_device)(struct ibv_device_s *dev);
    int (*close_device)(struct ibv_context_s *ctx);
    /* exported ibv_query_port: fills the compat prefix of the struct, which
     * the caller zeroes first (as verbs.h's inline wrapper does) */
    int (*query_port)(struct ibv_context_s *ctx, uint8_t port, struct ibv_port_attr_s *attr);
    int (*query_gid)(struct ibv_context_s *ctx, uint8_t port, int index, union ibv_gid_u *gid);
    struct ibv_pd_s *(*alloc_pd)(struct ibv_context_s *ctx);
    int (*dealloc_pd)(struct ibv_pd_s *pd);
    struct ibv_mr_s *(*reg_mr)(struct ibv_pd_s *pd, void *addr, size_t len, int access);
    int (*dereg_mr)(struct ibv_mr_s *mr);
    struct ibv_cq_s *(*create_cq)(struct ibv_context_s *ctx, int cqe, void *cq_ctx, void *channel,
                                  int comp_vector);
    int (*destroy_cq)(struct ibv_cq_s *cq);
    struct ibv_qp_s *(*create_qp)(struct ibv_pd_s *pd, struct ibv_qp_init_attr_s *attr);
    int (*modify_qp)(struct ibv_qp_s *qp, struct ibv_qp_attr_s *attr, int mask);
    int (*destroy_qp)(struct ibv_qp_s *qp);
    /* optional (NULL where the library is older) */
    int (*query_gid_ex)(struct ibv_context_s *ctx, uint32_t port, uint32_t index,
                        struct ibv_gid_entry_s *entry, uint32_t flags, size_t entry_size);
    struct ibv_mr_s *(*reg_dmabuf_mr)(struct ibv_pd_s *pd, uint64_t offset, size_t len,
                                      uint64_t iova, int fd, int access);
};

/* The table, loaded once; NULL with the reason as the thread's error
 * (UCCL_ERR_UNAVAIL) when the library or one of its entry points is missing. */
const struct uccl__ibv *uccl__ibv(void);

/* The data path, as verbs.h's inline functions: through the context's ops. */
static inline int uccl__ibv_post_send(struct ibv_qp_s *qp, struct ibv_send_wr_s *wr,
                                      struct ibv_send_wr_s **bad)
{
    return qp->context->ops.post_send(qp, wr, bad);
}
static inline int uccl__ibv_post_recv(struct ibv_qp_s *qp, struct ibv_recv_wr_s *wr,
                                      struct ibv_recv_wr_s **bad)
{
    return qp->context->ops.post_recv(qp, wr, bad);
}
static inline int uccl__ibv_poll_cq(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc)
{
    return cq->context->ops.poll_cq(cq, num, wc);
}

#endif
