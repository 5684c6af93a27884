/* Work on a caller's CUDA stream: copies, and 32-bit words in page-locked
 * host memory that streams write and wait for (uccl.h, "Stream-ordered
 * exchanges").
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

#include "cuda_loader.h"
#include "status.h"
#include "uccl.h"

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

/* The device address of a word in registered host memory: its host address
 * (unified addressing, as gpu_copy.c's flags rely on too). */
static cu_ptr word_addr(uintptr_t addr) { return (cu_ptr)addr; }

static int check_word(uintptr_t addr, const char *what)
{
    if (!addr || (addr & 3u))
        return uccl__err(UCCL_ERR_INVALID, "%s: word address 0x%zx is not 4-byte aligned",
                         what, (size_t)addr);
    return UCCL_OK;
}

int uccl_gpu_stream_write32(int dev, uintptr_t stream, uintptr_t addr, uint32_t value)
{
    const struct uccl__cuda *cu;
    int rc = check_word(addr, "stream write");
    if (rc || (rc = use(dev, &cu)))
        return rc;
    /* flags 0: a fence before the write, so what the stream wrote before
     * (kernels, copies) is visible to whoever sees the value */
    cu_result r = cu->StreamWriteValue32((cu_stream)stream, word_addr(addr), value, 0);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuStreamWriteValue32");
}

int uccl_gpu_stream_wait32(int dev, uintptr_t stream, uintptr_t addr, uint32_t value)
{
    const struct uccl__cuda *cu;
    int rc = check_word(addr, "stream wait");
    if (rc || (rc = use(dev, &cu)))
        return rc;
    cu_result r = cu->StreamWaitValue32((cu_stream)stream, word_addr(addr), value,
                                        CU_STREAM_WAIT_VALUE_GEQ);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuStreamWaitValue32");
}

int uccl_gpu_copy_async(int dev, uintptr_t stream, uintptr_t dst, uintptr_t src, size_t len)
{
    const struct uccl__cuda *cu;
    if (len == 0)
        return UCCL_OK;
    int rc = use(dev, &cu);
    if (rc)
        return rc;
    cu_result r = cu->MemcpyAsync((cu_ptr)dst, (cu_ptr)src, len, (cu_stream)stream);
    if (r != CU_OK)
        return uccl__cuda_err(r, "cuMemcpyAsync on the caller's stream");
    return UCCL_OK;
}
