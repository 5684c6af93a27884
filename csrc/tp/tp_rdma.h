/* The RDMA transport's parts, bottom to top (each calls only those before
 * it in this list):
 *
 *   tp_rdma_dev.c    the devices of this process, the memory registered
 *                    with them, and staging areas (registered buffers)
 *   tp_rdma_move.c   the movers on a connection's QPs (READ, WRITE; staged
 *                    memory through the connection's own chunk) and their
 *                    completions, and the progress thread
 *   tp_rdma_stage.c  the staging ring: transfers the peer must reach
 *                    memory no NIC could register by, streamed through
 *                    slots the receiving side lends
 *   tp_rdma.c        a connection's life: its QPs set up with the peer's,
 *                    started, shut down, freed; the ops table */
#ifndef UCCL_TP_RDMA_H
#define UCCL_TP_RDMA_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "load/ibv_loader.h"

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
 * memory is staged instead: its own side's moves go through a page-locked
 * chunk, and what the peer sends or writes into it, or reads from it,
 * streams through the receiving side's staging ring; its key is 0).
 * The region's local key is the address of this record. */
#define UCCL_RDMA_MR_MAGIC 0x524d5231u
struct uccl__rdma_mr {
    uint32_t magic;
    unsigned n;
    int staged;               /* GPU memory no NIC could register (no GPUDirect), or any
                                 memory under UCCL_P2P_RDMA_STAGE_ALL=1: no MR, staged */
    uint32_t mkind;           /* what the memory is (gpu.h) */
    struct ibv_mr_s *mr[UCCL_RDMA_MAX_DEVS];
    char err[240];
};

struct uccl__mem;
struct uccl__mr;
struct uccl__link;
struct uccl__msg;
int uccl__rdma_mem_reg(struct uccl__mem *mem, struct uccl__mr *mr);
void uccl__rdma_mem_dereg(struct uccl__mem *mem, struct uccl__mr *mr);
int uccl__rdma_mem_key(struct uccl__link *lk, const struct uccl__mr *mr, uintptr_t addr,
                       uint64_t *key_p);
/* The region behind a local key is staged (transport.h, `staged`). */
int uccl__rdma_staged(uint64_t local_key);
/* The record behind a local key, or NULL (with the reason) if it is none. */
const struct uccl__rdma_mr *uccl__rdma_mr_of(uint64_t local_key);

/* tp_rdma_dev.c.  A staging area: page-locked host memory (plain page-
 * aligned memory for staged host memory) registered with every NIC. */
struct uccl__rdma_area {
    char *p;
    size_t len;
    uint32_t mk;              /* what p is (gpu.h): page-locked, or host */
    uint32_t for_mk;          /* the memory kind it stages (device, or host) */
    struct ibv_mr_s *mr[UCCL_RDMA_MAX_DEVS];
};
/* len bytes to stage memory of kind for_mk through, registered with every
 * NIC for access; area_free undoes it (and is harmless on a zeroed one). */
int uccl__rdma_area_make(struct uccl__rdma_area *a, uint32_t for_mk, size_t len, int access);
void uccl__rdma_area_free(struct uccl__rdma_area *a);
/* The kind of area memory of kind mk stages through (GPU memory of one
 * device through memory of that device; host memory through host memory). */
uint32_t uccl__rdma_stage_kind(uint32_t mk);

/* ---- a connection (tp_rdma.c sets it up; the movers and the ring use it) ---- */

#define UCCL_RDMA_MAX_QPS 16
#define UCCL_RDMA_SQ_DEPTH 128   /* send WRs in flight per QP */
#define UCCL_RDMA_RQ_DEPTH 64    /* receives kept posted per QP (WRITE_WITH_IMM consumes one) */

struct uccl__rdma_qp {
    struct ibv_qp_s *qp;
    struct ibv_cq_s *cq;
    unsigned dev;             /* index into the devices */
    uint32_t psn;
    atomic_int inflight;      /* send WRs posted, not completed */
    pthread_mutex_t poll_mu;  /* one poller per CQ at a time */
};

struct uccl__rdma_conn {      /* a connection's tp_priv */
    unsigned nqp, peer_ndev;
    struct uccl__rdma_qp q[UCCL_RDMA_MAX_QPS];
    size_t chunk;
    int sl, tc;
    atomic_int stop;
    atomic_int ready;         /* QPs at RTS */
    atomic_int recv_broken;   /* a receive failed, seen by a mover: the progress thread tells */
    atomic_uint imm_seen;     /* WRITE_WITH_IMMs that landed here */
    atomic_uint next_imm;
    int thread;
    pthread_t progress;
    pthread_mutex_t own_mu;   /* one move of staged memory at a time ... */
    struct uccl__rdma_area own; /* ... through this chunk (tp_rdma_move.c) */
    struct uccl__rdma_stage *stage; /* the staging ring (tp_rdma_stage.c) */
};

/* tp_rdma_move.c: move len bytes between local (its local key) and the
 * peer's raddr (its rkeys): READ them in, or WRITE them out, the last WR a
 * WRITE_WITH_IMM if imm; staged memory through the connection's own chunk.
 * Blocking; a failure fails the connection. */
int uccl__rdma_move(struct uccl__link *lk, int read, char *local, uint64_t local_key,
                    uint64_t raddr, uint64_t rkey, size_t len, int imm);
/* Post n (at most UCCL_RDMA_RQ_DEPTH) of the receives kept on every QP. */
int uccl__rdma_post_recvs(struct uccl__rdma_qp *q, int n);
/* The progress thread (started by conn_start): polls the CQs slowly,
 * reposts consumed receives, reports a failed one.  arg: the connection. */
void *uccl__rdma_progress_main(void *arg);

/* tp_rdma_stage.c.  The staging ring of a connection. */
struct uccl__rdma_stage;
int uccl__rdma_stage_new(size_t chunk, struct uccl__rdma_stage **s_p);
/* Stop the stream thread (never blocks); join it; free everything, with
 * the QPs gone. */
void uccl__rdma_stage_shutdown(struct uccl__rdma_stage *s);
void uccl__rdma_stage_join(struct uccl__rdma_stage *s);
void uccl__rdma_stage_free(struct uccl__rdma_stage *s);
/* The ops: stream (a transfer into, or a read out of, memory the peer
 * cannot reach) and the staging ring's messages (RING, CREDIT, DATA). */
int uccl__rdma_stream(struct uccl__link *lk, int kind, uint64_t id, const void *src,
                      uint64_t src_key, size_t len, void *cookie);
int uccl__rdma_on_msg(struct uccl__link *lk, const struct uccl__msg *m);

#endif
