/* The GPU layer's part of the public C API (included by ep/uccl.h and
 * ring/ring.h, whose users see it there): GPUs by PCI bus id (gpu_mem.c),
 * host memory registered for the streams of stream-ordered groups
 * (gpu_stream.c), and for GPU-initiated transfers kernels compiled at run
 * time, memory mapped for them and raw queued copies (gpu_kernel.c).
 * Every function returns a status (base/status.h). */
#ifndef UCCL_GPU_API_H
#define UCCL_GPU_API_H

#include <stddef.h>
#include <stdint.h>

/* GPUs by PCI bus id, as upstream's newer API names them: the bus id of
 * CUDA device dev ("dddd:bb:dd.f", lower case), and the device of this host
 * that a bus id names.  UCCL_ERR_UNAVAIL without a CUDA driver,
 * UCCL_ERR_NOTFOUND for no such device. */
int uccl_gpu_bus_id(int dev, char out[32]);
int uccl_gpu_of_bus_id(const char *bdf, int *dev_p);

/* Page-aligned host memory registered (and unregistered) for every
 * device's streams to read and write: the page of a stream-ordered group
 * (sg/sgroup.h), whose words the streams write and wait for. */
int uccl_gpu_host_register(int dev, void *ptr, size_t len);
int uccl_gpu_host_unregister(int dev, void *ptr);

/* ---- kernels compiled at run time --------------------------------------- */
typedef struct uccl__kernel uccl_kernel_t;

/* Where libnvrtc is (the Python layer finds torch's); before the first compile. */
void uccl_nvrtc_set_path(const char *path);
/* Compile CUDA C++ source with NVRTC for device dev's architecture, load
 * it into dev's primary context and find kernel `name` (declare it
 * extern "C").  Headers are given by name and text (#include "name").  A
 * compile error is UCCL_ERR_INVALID with the start of the compiler's log in
 * the message, and the whole log in log (if given). */
int uccl_gpu_compile(int dev, const char *src, const char *name, int nhdr,
                     const char *const *hdr_names, const char *const *hdr_srcs, int nopt,
                     const char *const *opts, char *log, size_t log_len, uccl_kernel_t **k_p);
/* Launch on `stream` (a CUstream of the kernel's device; 0: the legacy
 * default stream); params as cuLaunchKernel takes them, nparams of them
 * with these sizes in bytes: checked against the kernel's own parameters
 * where the driver tells them (CUDA 12.4), so a wrong count or size is
 * UCCL_ERR_INVALID naming it rather than the driver reading past them. */
int uccl_gpu_launch(uccl_kernel_t *k, const unsigned grid[3], const unsigned block[3],
                    unsigned shmem, uintptr_t stream, void **params, const size_t *sizes,
                    int nparams);
void uccl_gpu_kernel_free(uccl_kernel_t *k);

/* Page-locked host memory mapped for device dev (zeroed): host and device
 * address.  And device memory (zeroed), for counters that GPU threads
 * update with atomics. */
int uccl_gpu_mapped_alloc(int dev, size_t len, void **host_p, uint64_t *dev_p);
void uccl_gpu_mapped_free(int dev, void *host);
int uccl_gpu_dev_alloc(int dev, size_t len, uint64_t *dev_p);
void uccl_gpu_dev_free(int dev, uint64_t p);

/* What [addr, +len) is: 0 host, 1 page-locked host, 2 device memory (then
 * *dev_p its device); anything else is UCCL_ERR_INVALID naming it. */
int uccl_mem_kind(uintptr_t addr, size_t len, int *kind_p, int *dev_p);
/* Copies between device memory of dev, queued in order on the calling
 * thread's copy stream without an event each; a mark (uccl_stream_mark_*)
 * completes once every copy queued before it has. */
int uccl_gpu_copy_queue(int dev, uintptr_t dst, uintptr_t src, size_t len);
int uccl_gpu_copy_queue_mark(int dev, void **mark_p);

#endif
