/* Kernels compiled at run time and memory shared with them (gpu_api.h).
 *
 * NVRTC (nvrtc_loader.c) compiles to a cubin for the device's own
 * architecture (sm_XY from its compute capability), which the driver loads
 * as it is: no PTX JIT, so an NVRTC newer than the driver's PTX still
 * works as long as it knows the architecture.  Modules live in the
 * device's primary context, torch's, so a kernel runs on torch's streams. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "load/cuda_loader.h"
#include "gpu/gpu.h"
#include "load/nvrtc_loader.h"
#include "gpu/gpu_api.h"
#include "base/status.h"

struct uccl__kernel {
    int dev;
    cu_module mod;
    cu_function fn;
    char name[64];
};

void uccl_nvrtc_set_path(const char *path)
{
    uccl__nvrtc_set_path(path);
}

static int nvrtc_err(const struct uccl__nvrtc *nv, nvrtc_result r, const char *what)
{
    return uccl__err(UCCL_ERR_IO, "%s: NVRTC error %d (%s)", what, r, nv->GetErrorString(r));
}

/* Compile src into a cubin (malloc'ed into *bin_p); the log into log. */
static int compile(const struct uccl__nvrtc *nv, int cc, const char *src, int nhdr,
                   const char *const *hdr_names, const char *const *hdr_srcs, int nopt,
                   const char *const *opts, char *log, size_t log_len, char **bin_p)
{
    nvrtc_program prog;
    nvrtc_result r = nv->CreateProgram(&prog, src, "uccl_kernel.cu", nhdr, hdr_srcs, hdr_names);
    if (r != 0)
        return nvrtc_err(nv, r, "nvrtcCreateProgram");
    const char **all = calloc((size_t)nopt + 3, sizeof(*all));
    char arch[40];
    snprintf(arch, sizeof(arch), "--gpu-architecture=sm_%d", cc);
    if (!all) {
        nv->DestroyProgram(&prog);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    all[0] = arch;
    all[1] = "--std=c++17";
    for (int i = 0; i < nopt; i++)
        all[i + 2] = opts[i];
    r = nv->CompileProgram(prog, nopt + 2, all);
    free(all);
    size_t n = 0;
    char *text = NULL;
    if (nv->GetProgramLogSize(prog, &n) == 0 && n > 0 && (text = malloc(n + 1)) &&
        nv->GetProgramLog(prog, text) == 0)
        text[n] = '\0';
    else if (text)
        text[0] = '\0';
    if (log && log_len)
        snprintf(log, log_len, "%s", text ? text : "");
    int rc = UCCL_OK;
    if (r != 0) {
        rc = uccl__err(UCCL_ERR_INVALID, "compiling the kernel for sm_%d failed (NVRTC error "
                       "%d, %s): %.380s", cc, r, nv->GetErrorString(r), text ? text : "");
    } else if ((r = nv->GetCUBINSize(prog, &n)) != 0 || !(*bin_p = malloc(n)) ||
               (r = nv->GetCUBIN(prog, *bin_p)) != 0) {
        free(*bin_p);
        *bin_p = NULL;
        rc = r ? nvrtc_err(nv, r, "nvrtcGetCUBIN") : uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    free(text);
    nv->DestroyProgram(&prog);
    return rc;
}

int uccl_gpu_compile(int dev, const char *src, const char *name, int nhdr,
                     const char *const *hdr_names, const char *const *hdr_srcs, int nopt,
                     const char *const *opts, char *log, size_t log_len, uccl_kernel_t **k_p)
{
    if (!src || !name || !*name || nhdr < 0 || nopt < 0)
        return uccl__err(UCCL_ERR_INVALID, "uccl_gpu_compile: a source and a kernel name are "
                         "needed");
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    const struct uccl__nvrtc *nv = uccl__nvrtc();
    if (!nv)
        return UCCL_ERR_UNAVAIL;
    cu_device d;
    int major = 0, minor = 0;
    cu_result r = cu->DeviceGet(&d, dev);
    if (r == CU_OK)
        r = cu->DeviceGetAttribute(&major, CU_DEV_ATTR_CC_MAJOR, d);
    if (r == CU_OK)
        r = cu->DeviceGetAttribute(&minor, CU_DEV_ATTR_CC_MINOR, d);
    if (r != CU_OK)
        return uccl__cuda_err(r, "reading the device's compute capability");
    char *bin = NULL;
    rc = compile(nv, major * 10 + minor, src, nhdr, hdr_names, hdr_srcs, nopt, opts, log,
                 log_len, &bin);
    if (rc)
        return rc;
    struct uccl__kernel *k = calloc(1, sizeof(*k));
    if (!k) {
        free(bin);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    k->dev = dev;
    r = cu->ModuleLoadData(&k->mod, bin);
    free(bin);
    if (r != CU_OK) {
        free(k);
        return uccl__cuda_err(r, "loading the compiled kernel (cuModuleLoadData)");
    }
    r = cu->ModuleGetFunction(&k->fn, k->mod, name);
    if (r != CU_OK) {
        cu->ModuleUnload(k->mod);
        free(k);
        return uccl__err(UCCL_ERR_INVALID, "the compiled source has no kernel named '%.100s' "
                         "(declare it extern \"C\" __global__)", name);
    }
    snprintf(k->name, sizeof(k->name), "%s", name);
    *k_p = k;
    return UCCL_OK;
}

/* The arguments against the kernel's parameters, where the driver tells them. */
static int check_params(const struct uccl__cuda *cu, uccl_kernel_t *k, const size_t *sizes,
                        int n)
{
    if (!cu->FuncGetParamInfo)
        return UCCL_OK;
    size_t off, size;
    for (int i = 0; i < n; i++) {
        if (cu->FuncGetParamInfo(k->fn, (size_t)i, &off, &size) != CU_OK)
            return uccl__err(UCCL_ERR_INVALID, "kernel %s takes %d parameters, %d given", k->name,
                             i, n);
        if (size != sizes[i])
            return uccl__err(UCCL_ERR_INVALID, "kernel %s: parameter %d is %zu bytes, the "
                             "argument given is %zu", k->name, i, size, sizes[i]);
    }
    if (cu->FuncGetParamInfo(k->fn, (size_t)n, &off, &size) == CU_OK) {
        int want = n + 1;
        while (want < 256 && cu->FuncGetParamInfo(k->fn, (size_t)want, &off, &size) == CU_OK)
            want++;
        return uccl__err(UCCL_ERR_INVALID, "kernel %s takes %d parameters, %d given", k->name,
                         want, n);
    }
    return UCCL_OK;
}

int uccl_gpu_launch(uccl_kernel_t *k, const unsigned grid[3], const unsigned block[3],
                    unsigned shmem, uintptr_t stream, void **params, const size_t *sizes,
                    int nparams)
{
    if (!k)
        return uccl__err(UCCL_ERR_INVALID, "launch of a freed kernel");
    for (int i = 0; i < 3; i++)
        if (grid[i] == 0 || block[i] == 0)
            return uccl__err(UCCL_ERR_INVALID, "launch: grid (%u, %u, %u) and block (%u, %u, "
                             "%u) must be at least 1 in each dimension", grid[0], grid[1],
                             grid[2], block[0], block[1], block[2]);
    int rc = uccl__cuda_use(k->dev);
    if (rc == UCCL_OK)
        rc = check_params(uccl__cuda(), k, sizes, nparams);
    if (rc)
        return rc;
    cu_result r = uccl__cuda()->LaunchKernel(k->fn, grid[0], grid[1], grid[2], block[0],
                                             block[1], block[2], shmem, (cu_stream)stream,
                                             params, NULL);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuLaunchKernel");
}

int uccl__gpu_launch_unchecked(uccl_kernel_t *k, unsigned grid_x, unsigned grid_y,
                               unsigned block, uintptr_t stream, void **params)
{
    cu_result r = uccl__cuda()->LaunchKernel(k->fn, grid_x, grid_y, 1, block, 1, 1, 0,
                                             (cu_stream)stream, params, NULL);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuLaunchKernel");
}

int uccl__gpu_blocks_per_sm(uccl_kernel_t *k, unsigned block, int *n_p)
{
    cu_result r = uccl__cuda()->OccupancyMaxActiveBlocksPerMultiprocessor(n_p, k->fn, (int)block,
                                                                         0);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
}

void uccl_gpu_kernel_free(uccl_kernel_t *k)
{
    if (!k)
        return;
    if (uccl__cuda_use(k->dev) == UCCL_OK)
        uccl__cuda()->ModuleUnload(k->mod);
    free(k);
}

int uccl_gpu_mapped_alloc(int dev, size_t len, void **host_p, uint64_t *dev_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    void *h = NULL;
    cu_ptr d = 0;
    cu_result r = cu->MemHostAlloc(&h, len, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    if (r != CU_OK)
        return uccl__cuda_err(r, "allocating mapped page-locked memory");
    r = cu->MemHostGetDevicePointer(&d, h, 0);
    if (r != CU_OK) {
        cu->MemFreeHost(h);
        return uccl__cuda_err(r, "cuMemHostGetDevicePointer");
    }
    memset(h, 0, len);
    *host_p = h;
    *dev_p = d;
    return UCCL_OK;
}

void uccl_gpu_mapped_free(int dev, void *host)
{
    if (host && uccl__cuda_use(dev) == UCCL_OK)
        uccl__cuda()->MemFreeHost(host);
}

int uccl_gpu_dev_alloc(int dev, size_t len, uint64_t *dev_p)
{
    int rc = uccl__cuda_use(dev);
    if (rc)
        return rc;
    const struct uccl__cuda *cu = uccl__cuda();
    cu_ptr d = 0;
    cu_result r = cu->MemAlloc(&d, len);
    if (r != CU_OK)
        return uccl__cuda_err(r, "allocating device memory");
    /* zeroed by a copy on this thread's own stream, waited for with a
     * deadline: a memset on the legacy stream would queue behind whatever
     * runs there (a kernel waiting on another ring, say), and torch's
     * non-blocking streams would not wait for it */
    void *zeros = calloc(1, len);
    rc = zeros ? uccl__gpu_copy(dev, (void *)(uintptr_t)d, zeros, len, 0, 30000000000ull)
               : uccl__err(UCCL_ERR_NOMEM, "out of memory");
    free(zeros);
    if (rc) {
        cu->MemFree(d);
        return rc;
    }
    *dev_p = d;
    return UCCL_OK;
}

void uccl_gpu_dev_free(int dev, uint64_t p)
{
    if (p && uccl__cuda_use(dev) == UCCL_OK)
        uccl__cuda()->MemFree(p);
}

int uccl_mem_kind(uintptr_t addr, size_t len, int *kind_p, int *dev_p)
{
    struct uccl__gpu_info info;
    int rc = uccl__cuda_initialised() ? uccl__gpu_classify(addr, len, &info) : UCCL_OK;
    if (rc)
        return rc;
    if (!uccl__cuda_initialised())
        info.mkind = UCCL_MK(UCCL_MK_HOST, 0);
    *kind_p = (int)UCCL_MK_KIND(info.mkind);
    *dev_p = UCCL_MK_DEV(info.mkind);
    return UCCL_OK;
}

int uccl_gpu_copy_queue(int dev, uintptr_t dst, uintptr_t src, size_t len)
{
    return uccl__gpu_copy_start(dev, (void *)dst, (const void *)src, len, NULL);
}

int uccl_gpu_copy_queue_mark(int dev, void **mark_p)
{
    return uccl__gpu_copy_start_mark(dev, mark_p);
}
