/* Compiled against rdma-core's own <infiniband/verbs.h> (when installed):
 * every struct member, size and constant the engine declares itself in
 * csrc/load/ibv_loader.h, and the emulator in ibv_emu.h (what rdma-core's
 * programs read: devices, device attributes, completion channels, the CQ's
 * event counters), must match.  A mismatch is a compile error naming it. */
#include <stddef.h>
#include <infiniband/verbs.h>

#include "load/ibv_loader.h"
#include "ibv_emu.h"

#define SAME_SIZE(a, b) _Static_assert(sizeof(struct a) == sizeof(struct b), #a " size")
#define SAME_OFF(a, b, f, g) \
    _Static_assert(offsetof(struct a, f) == offsetof(struct b, g), #a "." #f " offset")
#define SAME(x, y) _Static_assert((int)(x) == (int)(y), #x " value")

_Static_assert(sizeof(union ibv_gid) == sizeof(union ibv_gid_u), "ibv_gid size");
SAME_SIZE(ibv_context_ops, ibv_context_ops_s);
SAME_OFF(ibv_context_ops, ibv_context_ops_s, poll_cq, poll_cq);
SAME_OFF(ibv_context_ops, ibv_context_ops_s, req_notify_cq, req_notify_cq);
SAME_OFF(ibv_context_ops, ibv_context_ops_s, post_send, post_send);
SAME_OFF(ibv_context_ops, ibv_context_ops_s, post_recv, post_recv);
SAME_SIZE(ibv_context, ibv_context_s);
SAME_OFF(ibv_context, ibv_context_s, ops, ops);
SAME_OFF(ibv_context, ibv_context_s, abi_compat, abi_compat);
SAME_SIZE(ibv_pd, ibv_pd_s);
SAME_SIZE(ibv_mr, ibv_mr_s);
SAME_OFF(ibv_mr, ibv_mr_s, addr, addr);
SAME_OFF(ibv_mr, ibv_mr_s, length, length);
SAME_OFF(ibv_mr, ibv_mr_s, lkey, lkey);
SAME_OFF(ibv_mr, ibv_mr_s, rkey, rkey);
SAME_SIZE(ibv_cq, ibv_cq_s);
SAME_OFF(ibv_cq, ibv_cq_s, cqe, cqe);
SAME_SIZE(ibv_qp, ibv_qp_s);
SAME_OFF(ibv_qp, ibv_qp_s, send_cq, send_cq);
SAME_OFF(ibv_qp, ibv_qp_s, qp_num, qp_num);
SAME_OFF(ibv_qp, ibv_qp_s, state, state);
SAME_OFF(ibv_qp, ibv_qp_s, events_completed, events_completed);
SAME_SIZE(ibv_qp_cap, ibv_qp_cap_s);
SAME_SIZE(ibv_qp_init_attr, ibv_qp_init_attr_s);
SAME_OFF(ibv_qp_init_attr, ibv_qp_init_attr_s, cap, cap);
SAME_OFF(ibv_qp_init_attr, ibv_qp_init_attr_s, qp_type, qp_type);
SAME_OFF(ibv_qp_init_attr, ibv_qp_init_attr_s, sq_sig_all, sq_sig_all);
SAME_SIZE(ibv_global_route, ibv_global_route_s);
SAME_SIZE(ibv_ah_attr, ibv_ah_attr_s);
SAME_OFF(ibv_ah_attr, ibv_ah_attr_s, dlid, dlid);
SAME_OFF(ibv_ah_attr, ibv_ah_attr_s, is_global, is_global);
SAME_OFF(ibv_ah_attr, ibv_ah_attr_s, port_num, port_num);
SAME_SIZE(ibv_qp_attr, ibv_qp_attr_s);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, path_mtu, path_mtu);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, dest_qp_num, dest_qp_num);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, qp_access_flags, qp_access_flags);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, ah_attr, ah_attr);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, pkey_index, pkey_index);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, max_dest_rd_atomic, max_dest_rd_atomic);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, min_rnr_timer, min_rnr_timer);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, port_num, port_num);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, timeout, timeout);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, rnr_retry, rnr_retry);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, rate_limit, rate_limit);
/* newer rdma-core appends members (active_speed_ex): ours may be longer */
_Static_assert(sizeof(struct ibv_port_attr_s) >= sizeof(struct ibv_port_attr), "port_attr size");
SAME_OFF(ibv_port_attr, ibv_port_attr_s, port_cap_flags2, port_cap_flags2);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, active_mtu, active_mtu);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, gid_tbl_len, gid_tbl_len);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, lid, lid);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, link_layer, link_layer);
SAME_SIZE(ibv_gid_entry, ibv_gid_entry_s);
SAME_OFF(ibv_gid_entry, ibv_gid_entry_s, gid_type, gid_type);
SAME_SIZE(ibv_sge, ibv_sge_s);
SAME_SIZE(ibv_send_wr, ibv_send_wr_s);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, next, next);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, opcode, opcode);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, send_flags, send_flags);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, imm_data, imm_data);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, wr.rdma.remote_addr, wr.rdma.remote_addr);
SAME_OFF(ibv_send_wr, ibv_send_wr_s, wr.rdma.rkey, wr.rdma.rkey);
SAME_SIZE(ibv_recv_wr, ibv_recv_wr_s);
SAME_SIZE(ibv_wc, ibv_wc_s);
SAME_OFF(ibv_wc, ibv_wc_s, status, status);
SAME_OFF(ibv_wc, ibv_wc_s, opcode, opcode);
SAME_OFF(ibv_wc, ibv_wc_s, byte_len, byte_len);
SAME_OFF(ibv_wc, ibv_wc_s, imm_data, imm_data);
SAME_OFF(ibv_wc, ibv_wc_s, qp_num, qp_num);
SAME_OFF(ibv_wc, ibv_wc_s, wc_flags, wc_flags);

SAME(IBV_QPS_RESET, IBV_QPS_RESET_); SAME(IBV_QPS_INIT, IBV_QPS_INIT_);
SAME(IBV_QPS_RTR, IBV_QPS_RTR_); SAME(IBV_QPS_RTS, IBV_QPS_RTS_); SAME(IBV_QPS_ERR, IBV_QPS_ERR_);
SAME(IBV_QPT_RC, IBV_QPT_RC_);
SAME(IBV_QP_STATE, IBV_QP_STATE_); SAME(IBV_QP_ACCESS_FLAGS, IBV_QP_ACCESS_FLAGS_);
SAME(IBV_QP_PKEY_INDEX, IBV_QP_PKEY_INDEX_); SAME(IBV_QP_PORT, IBV_QP_PORT_);
SAME(IBV_QP_AV, IBV_QP_AV_); SAME(IBV_QP_PATH_MTU, IBV_QP_PATH_MTU_);
SAME(IBV_QP_TIMEOUT, IBV_QP_TIMEOUT_); SAME(IBV_QP_RETRY_CNT, IBV_QP_RETRY_CNT_);
SAME(IBV_QP_RNR_RETRY, IBV_QP_RNR_RETRY_); SAME(IBV_QP_RQ_PSN, IBV_QP_RQ_PSN_);
SAME(IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC_);
SAME(IBV_QP_MIN_RNR_TIMER, IBV_QP_MIN_RNR_TIMER_); SAME(IBV_QP_SQ_PSN, IBV_QP_SQ_PSN_);
SAME(IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_DEST_RD_ATOMIC_); SAME(IBV_QP_DEST_QPN, IBV_QP_DEST_QPN_);
SAME(IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_LOCAL_WRITE_);
SAME(IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_WRITE_);
SAME(IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_READ_);
SAME(IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_); SAME(IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM_);
SAME(IBV_WR_SEND, IBV_WR_SEND_); SAME(IBV_WR_RDMA_READ, IBV_WR_RDMA_READ_);
SAME(IBV_SEND_SIGNALED, IBV_SEND_SIGNALED_);
SAME(IBV_WC_SUCCESS, IBV_WC_SUCCESS_); SAME(IBV_WC_WR_FLUSH_ERR, IBV_WC_WR_FLUSH_ERR_);
SAME(IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_ACCESS_ERR_); SAME(IBV_WC_RETRY_EXC_ERR, IBV_WC_RETRY_EXC_ERR_);
SAME(IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR_); SAME(IBV_WC_LOC_PROT_ERR, 4);
SAME(IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE_); SAME(IBV_WC_RDMA_READ, IBV_WC_RDMA_READ_);
SAME(IBV_WC_RECV, IBV_WC_RECV_); SAME(IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_RECV_RDMA_WITH_IMM_);
SAME(IBV_WC_WITH_IMM, IBV_WC_WITH_IMM_); SAME(IBV_PORT_ACTIVE, IBV_PORT_ACTIVE_);
SAME(IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_INFINIBAND_);
SAME(IBV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_ETHERNET_);
SAME(IBV_GID_TYPE_ROCE_V2, IBV_GID_TYPE_ROCE_V2_); SAME(IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V1_);

/* The emulator's own declarations (ibv_emu.h) */
SAME_SIZE(ibv_device, ibv_device_s);
SAME_OFF(ibv_device, ibv_device_s, transport_type, transport_type);
SAME_OFF(ibv_device, ibv_device_s, name, name);
SAME_OFF(ibv_device, ibv_device_s, ibdev_path, ibdev_path);
SAME_SIZE(ibv_comp_channel, ibv_comp_channel_s);
SAME_OFF(ibv_comp_channel, ibv_comp_channel_s, fd, fd);
SAME_OFF(ibv_comp_channel, ibv_comp_channel_s, refcnt, refcnt);
SAME_SIZE(ibv_device_attr, ibv_device_attr_s);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, node_guid, node_guid);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, max_qp_wr, max_qp_wr);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, atomic_cap, atomic_cap);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, max_srq_sge, max_srq_sge);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, max_pkeys, max_pkeys);
SAME_OFF(ibv_device_attr, ibv_device_attr_s, phys_port_cnt, phys_port_cnt);
_Static_assert(sizeof(((struct ibv_device_attr *)0)->atomic_cap) == sizeof(int), "atomic_cap");
/* ibv_get_cq_event/ibv_ack_cq_events/ibv_destroy_cq use the CQ's own lock */
SAME_OFF(ibv_cq, ibv_cq_s, channel, channel);
SAME_OFF(ibv_cq, ibv_cq_s, cq_context, cq_context);
SAME_OFF(ibv_cq, ibv_cq_s, mutex, mutex);
SAME_OFF(ibv_cq, ibv_cq_s, cond, cond);
SAME_OFF(ibv_cq, ibv_cq_s, comp_events_completed, comp_events_completed);
SAME_OFF(ibv_qp, ibv_qp_s, qp_context, qp_context);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, cap, cap);
SAME_OFF(ibv_qp_attr, ibv_qp_attr_s, sq_psn, sq_psn);
SAME_OFF(ibv_qp_cap, ibv_qp_cap_s, max_inline_data, max_inline_data);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, active_speed, active_speed);
SAME_OFF(ibv_port_attr, ibv_port_attr_s, phys_state, phys_state);
SAME(IBV_SEND_SOLICITED, IBV_SEND_SOLICITED_); SAME(IBV_SEND_INLINE, IBV_SEND_INLINE_);
/* The emulator's context is a legacy one: a struct verbs_context ends with
 * the struct ibv_context that programs see, and verbs.h reaches the
 * extended members before it only where abi_compat holds the marker
 * below, which the emulator never sets (so ibv_query_device_ex & co. take
 * their legacy path). */
_Static_assert(offsetof(struct verbs_context, context) + sizeof(struct ibv_context) ==
               sizeof(struct verbs_context), "verbs_context ends with ibv_context");
_Static_assert(__VERBS_ABI_IS_EXTENDED == (void *)-1, "the extended-context marker");

int main(void) { return 0; }
