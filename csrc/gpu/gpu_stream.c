/* Page-locked host memory for stream-ordered groups (sgroup.h): the
 * shared page whose 32-bit words the streams write and wait for (sg_cuda.c
 * queues those operations).
 *
 * These are what lets processes of one host order their streams after each
 * other with no host thread in the way: rank A's stream writes a counter
 * into a page both processes map (cuStreamWriteValue32 runs once the work
 * queued ahead of it has finished), rank B's stream waits for it
 * (cuStreamWaitValue32, GEQ, a cyclic comparison), then copies from A's
 * memory through CUDA IPC.  Unlike a wait for a flag that an engine thread
 * sets (gpu_copy.c's flags), nothing this process queues later has to run
 * for such a wait to end: only the peer's stream, which reached its write
 * without waiting for anything queued after.  So the few hardware queues
 * streams share cannot hold a wait's own release behind it. */
#define _GNU_SOURCE
#include <stdint.h>

#include "load/cuda_loader.h"
#include "base/status.h"
#include "gpu/gpu_api.h"

static int use(int dev, const struct uccl__cuda **cu_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    *cu_p = uccl__cuda();
    return UCCL_OK;
}

int uccl_gpu_host_register(int dev, void *ptr, size_t len)
{
    const struct uccl__cuda *cu;
    int rc = use(dev, &cu);
    if (rc)
        return rc;
    if (!ptr || len == 0 || ((uintptr_t)ptr & 4095u))
        return uccl__err(UCCL_ERR_INVALID, "host memory to register for the GPU at %p (%zu bytes) "
                         "must be page-aligned and not empty", ptr, len);
    cu_result r = cu->MemHostRegister(ptr, len, CU_MEMHOSTREGISTER_PORTABLE |
                                                    CU_MEMHOSTREGISTER_DEVICEMAP);
    if (r != CU_OK)
        return uccl__cuda_err(r, "cuMemHostRegister of the stream-order page");
    return UCCL_OK;
}

int uccl_gpu_host_unregister(int dev, void *ptr)
{
    const struct uccl__cuda *cu;
    int rc = use(dev, &cu);
    if (rc)
        return rc;
    cu_result r = cu->MemHostUnregister(ptr);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuMemHostUnregister");
}
