/* GPU memory over the shared-memory transport: CUDA IPC and the copy engine.
 *
 * On a CMA connection the key of a region in device memory is the address
 * of its export record (gpu.h) in the owner's memory; 0 is host memory.  The
 * side that copies reads the peer's record, maps what it names (the
 * allocation's IPC handle, or its cuMem chunks by file descriptor), once
 * per peer and allocation (the process's import cache), and copies on its copy
 * engine from or to that mapping: a pull from a peer's GPU memory into any
 * local memory, or a push from local host memory into a peer's GPU memory
 * (the destination cannot map our host memory).  Host to host stays CMA.
 * Every range was checked by the protocol against what the peer posted or
 * advertised, and is checked here against what the peer's record exports,
 * so no copy leaves the peer's allocation. */
#define _GNU_SOURCE
#include "tp/tp_shm_ipc.h"

#include "tp/transport.h"
#include "gpu/gpu.h"
#include "base/log.h"
#include "base/status.h"

int uccl__shm_ipc_mem_key(struct uccl__link *lk, const struct uccl__mr *mr, uintptr_t addr,
                          uint64_t *key_p)
{
    if (!lk->direct || !UCCL_MK_ON_GPU(mr->gpu.mkind)) { /* host memory, or the ring stages */
        *key_p = 0;
        return UCCL_OK;
    }
    if (!mr->gexp)
        return uccl__err(UCCL_ERR_UNAVAIL, "device memory at 0x%zx (region %llu) cannot be "
                         "shared with another process: %s", (size_t)addr,
                         (unsigned long long)mr->id, mr->gexp_err);
    *key_p = (uint64_t)(uintptr_t)mr->gexp;
    return UCCL_OK;
}

int uccl__shm_ipc_key_on_gpu(uint64_t peer_key) { return peer_key != 0; }

/* The device whose context maps the peer's memory and runs the copy: the
 * local memory's, else the endpoint's GPU, else the first. */
static int copy_dev(struct uccl__link *lk, uint64_t local_key)
{
    if (UCCL_MK_KIND(local_key) != UCCL_MK_HOST)
        return UCCL_MK_DEV(local_key);
    return lk->local->gpu_idx >= 0 ? lk->local->gpu_idx : 0;
}

static int ipc_copy(struct uccl__link *lk, char *local, uint64_t local_key, uint64_t remote,
                    uint64_t remote_key, size_t len, int to_peer)
{
    if (remote_key == 0) /* proto.c pushes only into, and pulls through IPC only from, GPUs */
        return uccl__err(UCCL_ERR_PROTO, "a GPU copy with the peer's host memory at 0x%llx",
                         (unsigned long long)remote);
    int dev = copy_dev(lk, local_key);
    void *mapped;
    struct uccl__gpu_import *imp;
    int rc = uccl__gpu_import_get(lk->peer_pid, remote_key, remote, len, dev, &mapped, &imp);
    if (rc)
        return rc;
    int split = UCCL_MK_KIND(local_key) != UCCL_MK_HOST; /* not from/to pageable memory */
    uint64_t t0 = uccl__now_ns();
    rc = to_peer ? uccl__gpu_copy(dev, mapped, local, len, split, lk->local->timeout_ns)
                 : uccl__gpu_copy(dev, local, mapped, len, split, lk->local->timeout_ns);
    uccl__gpu_import_put(imp);
    uint64_t ns = uccl__now_ns() - t0;
    if (ns >= 100000000ull + len) /* 0.1 s more than 1 GB/s: it waited for something */
        LOG_WARN("a %zu-byte copy %s pid %u's GPU memory on device %d took %.1f ms", len,
                 to_peer ? "into" : "from", lk->peer_pid, dev, (double)ns / 1e6);
    return rc;
}

int uccl__shm_ipc_pull(struct uccl__link *lk, void *dst, uint64_t local_key, uint64_t remote,
                       uint64_t remote_key, size_t len)
{
    return ipc_copy(lk, dst, local_key, remote, remote_key, len, 0);
}

int uccl__shm_ipc_push(struct uccl__link *lk, const void *src, uint64_t local_key,
                       uint64_t remote, uint64_t remote_key, size_t len)
{
    return ipc_copy(lk, (char *)src, local_key, remote, remote_key, len, 1);
}
