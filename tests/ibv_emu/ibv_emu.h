/* What the parts of the verbs emulator share: ibv_emu_device.c (devices,
 * contexts, device and port queries), ibv_emu.c (protection domains, memory
 * regions), ibv_emu_cq.c (completion queues and completion channels),
 * ibv_emu_qp.c (queue pair verbs), ibv_emu_wire.c (the wire between two
 * QPs: RC semantics) and ibv_emu_sock.c (its socket I/O).  Structs the engine does not use are
 * declared here, with rdma-core's layouts (abi_check.c compares them). */
#ifndef IBV_EMU_H
#define IBV_EMU_H

#include <pthread.h>
#include <stddef.h>
#include <sys/socket.h>
#include <stdint.h>

#include "load/ibv_loader.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_SGE 8

/* rdma-core's struct ibv_device layout */
struct ibv_device_s {
    void *ops[2];
    int node_type, transport_type;
    char name[64], dev_name[64], dev_path[256], ibdev_path[256];
};

/* rdma-core's struct ibv_comp_channel */
struct ibv_comp_channel_s { struct ibv_context_s *context; int fd, refcnt; };

/* rdma-core's struct ibv_device_attr */
struct ibv_device_attr_s {
    char fw_ver[64];
    uint64_t node_guid, sys_image_guid; /* network order */
    uint64_t max_mr_size, page_size_cap;
    uint32_t vendor_id, vendor_part_id, hw_ver;
    int max_qp, max_qp_wr;
    unsigned device_cap_flags;
    int max_sge, max_sge_rd, max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom, max_ee_rd_atom,
        max_res_rd_atom, max_qp_init_rd_atom, max_ee_init_rd_atom;
    int atomic_cap; /* enum ibv_atomic_cap */
    int max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp,
        max_mcast_qp_attach, max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr,
        max_srq, max_srq_wr, max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay, phys_port_cnt;
};

/* verbs.h constants the engine does not use (its own are in ibv_loader.h) */
enum { IBV_SEND_SOLICITED_ = 1 << 2, IBV_SEND_INLINE_ = 1 << 3 };

/* What the emulated device offers (ibv_query_device); create_cq and
 * create_qp refuse more, as a provider does. */
enum { EMU_MAX_QP_WR = 16384, EMU_MAX_CQE = 1 << 22, EMU_MAX_INLINE = 1024 };

struct emu_mr { struct ibv_mr_s mr; int access; struct emu_mr *next; };

/* Every MR of the process, by rkey: the responder looks keys up here and
 * holds the lock (read) while bytes land in a region, so dereg waits. */
extern pthread_rwlock_t emu_mr_lock;
/* Under emu_mr_lock: the region key names in pd, if [addr, +len) lies inside
 * it and it grants `need` (IBV_ACCESS_*). */
struct emu_mr *emu_mr_check(struct ibv_pd_s *pd, uint32_t key, uint64_t addr, uint64_t len,
                            int need);
uint32_t emu_random_key(void);
/* ibv_emu_cq.c: append one completion (the queue grows rather than
 * overrun); an armed CQ then signals its channel.  `solicited`: the
 * message asked for an event (IBV_SEND_SOLICITED). */
void emu_cq_push(struct ibv_cq_s *cq, const struct ibv_wc_s *wc, int solicited);
/* A QP starts (+1) or stops (-1) using the CQ: destroy_cq refuses a CQ in use. */
void emu_cq_use(struct ibv_cq_s *cq, int delta);
int emu_poll_cq(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc);
int emu_req_notify_cq(struct ibv_cq_s *cq, int solicited_only);
/* The data path, reached through the context's ops as verbs.h does. */
int emu_post_send(struct ibv_qp_s *qp, struct ibv_send_wr_s *wr, struct ibv_send_wr_s **bad);
int emu_post_recv(struct ibv_qp_s *qp, struct ibv_recv_wr_s *wr, struct ibv_recv_wr_s **bad);

/* ibv_emu_sock.c: 0, or -1 once the peer is gone (or the socket shut down). */
int emu_send_full(int fd, struct iovec *iov, int n);
int emu_recv_full(int fd, void *buf, size_t len);
int emu_drain(int fd, size_t len);     /* read and discard len bytes */
/* The wire's sockets (Unix, or TCP with UCCL_IBV_EMU_IPV4): */
uint32_t emu_ipv4(void);               /* that address (network order), or 0 */
int emu_listen(uint32_t *qpn_p);       /* a QP's listening socket and its number; -1 */
int emu_dial(uint32_t dest_qpn, const union ibv_gid_u *dgid); /* connected, or -1 */
/* Which of two QPs connects (the other accepts), and whether a destination
 * is the QP itself. */
int emu_dials(uint32_t qpn, uint32_t dest_qpn, const union ibv_gid_u *dgid);
int emu_same_qp(uint32_t qpn, uint32_t dest_qpn, const union ibv_gid_u *dgid);

#endif
