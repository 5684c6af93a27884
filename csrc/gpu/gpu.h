/* GPU memory for the engine, over the driver API (cuda_loader.h).
 *
 *   gpu_mem.c   what a pointer is (classification at registration), and
 *               sharing device memory with other processes of the host:
 *               export records here, imports of a peer's records (CUDA IPC
 *               of the allocation base, or for cuMem* memory a POSIX file
 *               descriptor per physical chunk), cached per process
 *   gpu_copy.c  copies on the copy engine (this thread's streams, split
 *               when large, completion by polled events), events recorded
 *               on a caller's stream, page-locked staging buffers
 *
 * A memory kind ("mkind") travels as the local key of the TCP and
 * shared-memory transports: kind in the low byte, device ordinal above. */
#ifndef UCCL_GPU_H
#define UCCL_GPU_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu_api.h"

enum { UCCL_MK_HOST = 0, UCCL_MK_PINNED = 1, UCCL_MK_DEVICE = 2 };
#define UCCL_MK(kind, dev) ((uint32_t)(kind) | ((uint32_t)(dev) << 8))
#define UCCL_MK_KIND(mk) ((unsigned)((mk) & 0xffu))
#define UCCL_MK_DEV(mk) ((int)(((mk) >> 8) & 0xffffu))
#define UCCL_MK_ON_GPU(mk) (UCCL_MK_KIND(mk) == UCCL_MK_DEVICE)

struct uccl__gpu_info {
    uint32_t mkind;
    uint64_t buffer_id;        /* device memory: the driver's id of the allocation */
    uintptr_t alloc_base;      /* device memory: its allocation (cudaMalloc block, or the */
    size_t alloc_size;         /* reserved range of cuMem* memory) */
    int legacy_ipc;            /* cuIpcGetMemHandle works on it (else: cuMem*, by fd) */
};

/* What [addr, addr + len) is: device memory of one allocation, page-locked
 * host memory, or readable host memory; anything else (a device pointer of
 * another process, memory of two allocations, a CUDA pointer where libcuda
 * cannot be loaded) is UCCL_ERR_INVALID naming the pointer. */
int uccl__gpu_classify(uintptr_t addr, size_t len, struct uccl__gpu_info *info_p);

struct uccl__gpu_export;
/* Device memory registered as `info` (exported as `e`, or NULL): is
 * [addr, +len) still that memory (not freed, nor freed and its address
 * reused)?  cuMem memory is checked chunk by chunk against the export. */
int uccl__gpu_check_live(const struct uccl__gpu_info *info, const struct uccl__gpu_export *e,
                         uintptr_t addr, size_t len);

/* ---- export (the owner's side) -------------------------------------------
 * An export record lives in the owner's memory for as long as the region is
 * registered; peers on the host read it with process_vm_readv (its address
 * is the region's key on shared-memory connections) and open what it names. */
int uccl__gpu_export_new(uintptr_t addr, size_t len, const struct uccl__gpu_info *info,
                         struct uccl__gpu_export **exp_p);
void uccl__gpu_export_free(struct uccl__gpu_export *e);

/* ---- import (the peer's side) --------------------------------------------
 * One table per process, not per endpoint: the driver opens a CUDA IPC
 * handle once per context, and the contexts (the devices' primary ones) are
 * the process's.  A cudaMalloc allocation is opened once per peer process
 * and allocation, keyed by its buffer id (a freed and reused address has a
 * new one); cuMem memory is mapped once per export.  Dropped imports are
 * closed on a thread of their own, never the caller's (gpu_mem.c says why). */
struct uccl__gpu_import;
/* A pointer, valid in this process on device dev, to [addr, addr + len) of
 * the memory process pid exported in the record at rec_addr (of pid); the
 * range must lie inside what the record exports.  The mapping stays until
 * uccl__gpu_import_put(*imp_p).  Where a close of an earlier mapping of the
 * same memory is still under way, it waits for that first (10 s at most,
 * then UCCL_ERR_TIMEOUT). */
int uccl__gpu_import_get(uint32_t pid, uint64_t rec_addr, uint64_t addr, size_t len, int dev,
                         void **ptr_p, struct uccl__gpu_import **imp_p);
void uccl__gpu_import_put(struct uccl__gpu_import *imp);

/* ---- copies --------------------------------------------------------------- */
/* Copy len bytes (any of host, page-locked, device memory, mapped peer
 * memory) in device dev's context on this thread's streams; returns once
 * the copy is complete (events polled), or fails after timeout_ns.  split:
 * a large copy may go over several streams (not with pageable memory,
 * which the driver stages through its own buffers: pieces in parallel
 * measured slower than one copy). */
int uccl__gpu_copy(int dev, void *dst, const void *src, size_t len, int split,
                   uint64_t timeout_ns);

/* Queue a copy of len bytes on this thread's copy-start stream of device
 * dev and return at once: *ev_p is an event that completes with it
 * (uccl__gpu_event_poll/wait/free), NULL when len is 0; ev_p NULL: no
 * event (uccl__gpu_copy_start_mark makes one for several copies). */
int uccl__gpu_copy_start(int dev, void *dst, const void *src, size_t len, void **ev_p);
/* An event that completes once every copy this thread started on device
 * dev so far has (they run in order on one stream). */
int uccl__gpu_copy_start_mark(int dev, void **ev_p);

/* A copy between local memory of kinds dst_mk and src_mk: memcpy between
 * host memory, else uccl__gpu_copy on the device copy_dev picks. */
int uccl__gpu_copy_kinds(void *dst, uint32_t dst_mk, const void *src, uint32_t src_mk, size_t len,
                         uint64_t timeout_ns);

/* An event recorded on `stream` (0: the legacy default stream) of device
 * dev's primary context, now: it completes when the work queued there
 * before this call has; NULL (and UCCL_OK) where the stream has no work
 * left, which one query tells cheaper than an event would.  poll: 1 done,
 * 0 not yet, < 0 error. */
int uccl__gpu_event_record(int dev, uintptr_t stream, void **ev_p);
int uccl__gpu_event_poll(void *ev);
/* Poll ev from the calling thread until it completes (spinning first, then
 * yielding, then sleeping briefly), or fail after timeout_ns. */
int uccl__gpu_event_wait(void *ev, uint64_t timeout_ns);
void uccl__gpu_event_free(void *ev);

/* ---- stream waits on host-written flags ------------------------------------
 * A caller's stream can wait for a transfer without blocking the host: the
 * stream waits (cuStreamWaitValue32) until a flag in page-locked memory
 * reaches a value, and the engine writes that value when the transfer
 * finishes.  Each waiting transfer holds a slot of the pool until then;
 * slots count up (generation) so a reused slot never releases an old wait
 * late or a new one early. */
struct uccl__gpu_flags;
int uccl__gpu_flags_new(int dev, struct uccl__gpu_flags **f_p);
void uccl__gpu_flags_free(struct uccl__gpu_flags *f);
/* Make `stream` of device dev wait until *slot reaches gen.
 * UCCL_ERR_NOMEM: every slot is taken (wait on the host). */
int uccl__gpu_flag_wait(struct uccl__gpu_flags *f, int dev, uintptr_t stream, uint32_t **slot_p,
                        uint32_t *gen_p);
/* The transfer finished: release the waiting stream and the slot. */
void uccl__gpu_flag_set(struct uccl__gpu_flags *f, uint32_t *slot, uint32_t gen);

/* ---- the engine's own kernels (gpu_kernel.c; uccl_kernel_t: gpu_api.h) ---- */
/* The engine's own kernels, whose arguments it builds itself: launched
 * without the parameter check (one driver call). */
int uccl__gpu_launch_unchecked(uccl_kernel_t *k, unsigned grid_x, unsigned grid_y,
                               unsigned block, uintptr_t stream, void **params);
/* How many blocks of `block` threads of kernel k fit one SM of its device
 * at once (its registers, threads and shared memory, as the driver says). */
int uccl__gpu_blocks_per_sm(uccl_kernel_t *k, unsigned block, int *n_p);

/* Page-locked host memory (portable to every context) for staging. */
int uccl__gpu_host_alloc(int dev, size_t len, void **p);
void uccl__gpu_host_free(int dev, void *p);

#endif
