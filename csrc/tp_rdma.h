/* The RDMA transport's two halves: the devices of this process and the
 * memory registered with them (tp_rdma_dev.c), and connections of RC queue
 * pairs with their movers (tp_rdma.c). */
#ifndef UCCL_TP_RDMA_H
#define UCCL_TP_RDMA_H

#include <stdint.h>

#include "ibv_loader.h"

/* A connection stripes over at most this many NICs: a region's key for the
 * peer carries one 32-bit rkey per NIC in 64 bits. */
#define UCCL_RDMA_MAX_DEVS 2

struct uccl__rdma_dev {
    char name[64];
    struct ibv_context_s *ctx;
    struct ibv_pd_s *pd;
    uint8_t port;
    uint8_t link_layer;    /* IBV_LINK_LAYER_* */
    int active_mtu;        /* IBV_MTU_* code */
    uint16_t lid;
    int gid_index;         /* -1: none (InfiniBand, addressed by LID) */
    union ibv_gid_u gid;
};

/* The devices this process uses (discovered once: UCCL_P2P_RDMA_DEV, else
 * every device with an active port), or NULL with the reason as the
 * thread's error (UCCL_ERR_UNAVAIL): no library, no device, no active port,
 * a bad setting. */
const struct uccl__rdma_dev *uccl__rdma_devs(unsigned *n_p);

/* What mem_reg made for a region: one MR per device, or why there is none
 * (then any transfer over RDMA that needs it fails naming the reason; GPU
 * memory is staged instead, which serves its own side's moves only: a
 * peer cannot address it, its key is 0). */
#define UCCL_RDMA_MR_MAGIC 0x524d5231u
struct uccl__rdma_mr {
    uint32_t magic;
    unsigned n;
    int staged_dev;           /* GPU memory no NIC could register (no GPUDirect): its
                                 device, moved through page-locked host memory; else -1 */
    struct ibv_mr_s *mr[UCCL_RDMA_MAX_DEVS];
    char err[240];
};

struct uccl__mem;
struct uccl__mr;
struct uccl__conn;
int uccl__rdma_mem_reg(struct uccl__mem *mem, struct uccl__mr *mr);
void uccl__rdma_mem_dereg(struct uccl__mem *mem, struct uccl__mr *mr);
int uccl__rdma_mem_key(struct uccl__conn *c, const struct uccl__mr *mr, uintptr_t addr,
                       uint64_t *key_p);

#endif
