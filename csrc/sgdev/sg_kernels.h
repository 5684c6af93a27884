/* The CUDA C++ parts of stream-ordered groups' kernels (sg_kernels.c) and
 * their arguments as C lays them out.  sg_cuda.c joins the parts into a
 * module per kernel (a copy of the parts a kernel needs, nothing shared
 * between modules):
 *   uccl_sg_reduce   prelude, reduce                 (per element type)
 *   uccl_sg_fused    prelude, reduce, copy_fn, fused (per element type)
 *   uccl_sg_cfused   prelude, reduce, copy_fn, fused, cfused (per element type)
 *   uccl_sg_cll      prelude, reduce, copy_fn, fused, cll (per element type)
 *   uccl_sg_copy     prelude, copy_fn, copy
 *   uccl_sg_sync     prelude, sync
 *   uccl_sg_gather   prelude, copy_fn, sync, gather
 *   uccl_sg_eops     prelude, eops
 * The reduction's parts start with "#define UCCL_DT <type>" (dt_names). */
#ifndef UCCL_SG_KERNELS_H
#define UCCL_SG_KERNELS_H

#include <stdint.h>

#include "sgdev/sg_dev.h"

extern const char uccl__sg_prelude_src[], uccl__sg_reduce_src[], uccl__sg_copy_fn_src[],
    uccl__sg_fused_src[], uccl__sg_copy_src[], uccl__sg_sync_src[], uccl__sg_gather_src[],
    uccl__sg_eops_src[], uccl__sg_cfused_src[], uccl__sg_cll_src[];

/* struct EArgs (memory operations counted from an epoch), one thread */
#define UCCL__K_EOPS 72 /* EArgs' arrays; a captured round's handshake: UCCL_SG_MAX_RANKS + 2 at most */
struct uccl__k_eops {
    uint64_t addr[UCCL__K_EOPS], epoch[UCCL__K_EOPS];
    uint32_t value[UCCL__K_EOPS];
    int32_t kind[UCCL__K_EOPS];
    int32_t n;
};

/* struct Args (the reduction) */
struct uccl__k_reduce {
    uint64_t out, src[UCCL_SG_MAX_RANKS], count;
    int32_t nsrc, op;
};

/* struct FArgs (the one-launch round), whose arrays hold UCCL_SG_FUSED_RANKS */
_Static_assert(UCCL_SG_FUSED_RANKS == 8, "struct FArgs and SArgs hold 8 ranks' words");
struct uccl__k_fused {
    uint64_t in, out, ctr, nbytes, count, slot[8], ready[8], dready[8], fin, failed, epoch, flip;
    uint32_t k;
    int32_t gather, op, n, me, sys;
};

/* struct CopyArgs */
#define UCCL__K_COPY_SEGS 32
struct uccl__k_copy {
    uint64_t dst[UCCL__K_COPY_SEGS], src[UCCL__K_COPY_SEGS], len[UCCL__K_COPY_SEGS];
    int32_t n;
};

/* struct SArgs (a handshake) */
struct uccl__k_sync {
    uint64_t mine, page, fin, failed, peer[8];
    uint32_t k, mask;
    int32_t me, n, sys;
};

/* struct GArgs (a one-phase round as one launch) */
#define UCCL__K_GATHER_SEGS 16
struct uccl__k_gather {
    struct uccl__k_sync ready, done;
    uint64_t ctr, seen;
    uint64_t dst[UCCL__K_GATHER_SEGS], src[UCCL__K_GATHER_SEGS], len[UCCL__K_GATHER_SEGS];
    int32_t nseg;
};
/* the sizes NVRTC gives the kernels' structs (sm_90) */
_Static_assert(sizeof(struct uccl__k_reduce) == 536 && sizeof(struct uccl__k_fused) == 288 &&
               sizeof(struct uccl__k_copy) == 776 && sizeof(struct uccl__k_sync) == 120 &&
               sizeof(struct uccl__k_gather) == 648 && sizeof(struct uccl__k_eops) == 1736,
               "struct Args 536 bytes, FArgs 288, CopyArgs 776, SArgs 120, GArgs 648, "
               "EArgs 1736");

#endif
