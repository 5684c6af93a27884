/* libcuda.so.1 at run time (cuda_loader.h). */
#define _GNU_SOURCE
#include "load/cuda_loader.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/config.h"
#include "base/status.h"

/* The driver API version whose entry points we ask for: 12.0 has every one
 * used here (cuMem* virtual memory, cuIpcOpenMemHandle_v2, ...). */
#define CU_API_VERSION 12000
#define MAX_DEVICES 64

/* Write-once state (pthread_once): the table, why it failed, the handle. */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static struct uccl__cuda table;
static int loaded;
static char load_error[300];

/* Primary contexts, retained once per device (written under ctx_mu). */
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static cu_context primary[MAX_DEVICES];
static int init_done;

typedef cu_result (*get_proc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef cu_result (*get_proc_v1_fn)(const char *, void **, int, unsigned long long);

static void load(void)
{
    const char *path = NULL;
    uccl__cfg_str(UCCL_CFG_CUDA_LIBRARY, &path);
    if (!path)
        path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(load_error, sizeof(load_error), "cannot load the CUDA driver (%s): %s", path,
                 dlerror());
        return;
    }
    get_proc_v2_fn gp2 = (get_proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    get_proc_v1_fn gp1 = (get_proc_v1_fn)dlsym(lib, "cuGetProcAddress");
    if (!gp2 && !gp1) {
        snprintf(load_error, sizeof(load_error), "%s has no cuGetProcAddress (driver older "
                 "than CUDA 11.3?)", path);
        return;
    }
    static const struct { const char *name; size_t off; } syms[] = {
#define SYM(field, name) {name, offsetof(struct uccl__cuda, field)}
        SYM(Init, "cuInit"), SYM(DeviceGet, "cuDeviceGet"),
        SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
        SYM(CtxSetCurrent, "cuCtxSetCurrent"), SYM(CtxGetCurrent, "cuCtxGetCurrent"),
        SYM(PointerGetAttribute, "cuPointerGetAttribute"),
        SYM(PointerGetAttributes, "cuPointerGetAttributes"),
        SYM(MemcpyAsync, "cuMemcpyAsync"), SYM(StreamCreate, "cuStreamCreate"),
        SYM(StreamDestroy, "cuStreamDestroy"),
        SYM(StreamQuery, "cuStreamQuery"), SYM(StreamWaitValue32, "cuStreamWaitValue32"),
        SYM(StreamWriteValue32, "cuStreamWriteValue32"),
        SYM(EventCreate, "cuEventCreate"), SYM(EventRecord, "cuEventRecord"),
        SYM(EventQuery, "cuEventQuery"), SYM(EventDestroy, "cuEventDestroy"),
        SYM(IpcGetMemHandle, "cuIpcGetMemHandle"), SYM(IpcOpenMemHandle, "cuIpcOpenMemHandle"),
        SYM(IpcCloseMemHandle, "cuIpcCloseMemHandle"),
        SYM(MemGetAddressRange, "cuMemGetAddressRange"),
        SYM(MemRetainAllocationHandle, "cuMemRetainAllocationHandle"),
        SYM(MemExportToShareableHandle, "cuMemExportToShareableHandle"),
        SYM(MemImportFromShareableHandle, "cuMemImportFromShareableHandle"),
        SYM(MemAddressReserve, "cuMemAddressReserve"), SYM(MemAddressFree, "cuMemAddressFree"),
        SYM(MemMap, "cuMemMap"), SYM(MemUnmap, "cuMemUnmap"),
        SYM(MemSetAccess, "cuMemSetAccess"), SYM(MemRelease, "cuMemRelease"),
        SYM(MemHostAlloc, "cuMemHostAlloc"), SYM(MemFreeHost, "cuMemFreeHost"),
        SYM(MemHostRegister, "cuMemHostRegister"),
        SYM(MemHostUnregister, "cuMemHostUnregister"),
        SYM(GetErrorString, "cuGetErrorString"),
        SYM(DeviceGetPCIBusId, "cuDeviceGetPCIBusId"),
        SYM(DeviceGetByPCIBusId, "cuDeviceGetByPCIBusId"),
        SYM(DeviceGetCount, "cuDeviceGetCount"),
        SYM(DeviceGetAttribute, "cuDeviceGetAttribute"),
        SYM(ModuleLoadData, "cuModuleLoadData"), SYM(ModuleUnload, "cuModuleUnload"),
        SYM(ModuleGetFunction, "cuModuleGetFunction"), SYM(LaunchKernel, "cuLaunchKernel"),
        SYM(OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor"),
        SYM(MemHostGetDevicePointer, "cuMemHostGetDevicePointer"),
        SYM(MemAlloc, "cuMemAlloc"), SYM(MemFree, "cuMemFree"),
        SYM(StreamWaitEvent, "cuStreamWaitEvent"),
#undef SYM
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = NULL;
        int status = 0;
        cu_result rc = gp2 ? gp2(syms[i].name, &fn, CU_API_VERSION, 0, &status)
                           : gp1(syms[i].name, &fn, CU_API_VERSION, 0);
        if (rc != CU_OK || !fn) {
            snprintf(load_error, sizeof(load_error), "%s lacks %s (error %d): driver too old?",
                     path, syms[i].name, rc);
            return;
        }
        memcpy((char *)&table + syms[i].off, &fn, sizeof(fn));
    }
    /* Optional entry points: absent from older drivers, which still serve. */
    static const struct {
        const char *name;
        size_t off;
    } opt[] = {
#define OPT(field, name) {name, offsetof(struct uccl__cuda, field)}
        OPT(MemGetHandleForAddressRange, "cuMemGetHandleForAddressRange"),
        OPT(FuncGetParamInfo, "cuFuncGetParamInfo"),
        OPT(StreamBatchMemOp, "cuStreamBatchMemOp"),
        OPT(StreamIsCapturing, "cuStreamIsCapturing"),
        OPT(ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode"),
        OPT(MemsetD32Async, "cuMemsetD32Async"), OPT(StreamSynchronize, "cuStreamSynchronize"),
#undef OPT
    };
    for (size_t i = 0; i < sizeof(opt) / sizeof(opt[0]); i++) {
        void *fn = NULL;
        int status = 0;
        cu_result orc = gp2 ? gp2(opt[i].name, &fn, CU_API_VERSION, 0, &status)
                            : gp1(opt[i].name, &fn, CU_API_VERSION, 0);
        if (orc == CU_OK && fn)
            memcpy((char *)&table + opt[i].off, &fn, sizeof(fn));
    }
    loaded = 1; /* the library stays loaded for the life of the process */
}

const struct uccl__cuda *uccl__cuda(void)
{
    pthread_once(&load_once, load);
    if (!loaded) {
        uccl__err(UCCL_ERR_UNAVAIL, "%s", load_error);
        return NULL;
    }
    return &table;
}

int uccl__cuda_initialised(void)
{
    const struct uccl__cuda *cu = uccl__cuda();
    if (!cu)
        return 0;
    cu_context ctx;
    return cu->CtxGetCurrent(&ctx) != CU_ERR_NOT_INITIALIZED;
}

int uccl__cuda_err(cu_result rc, const char *what)
{
    const char *s = NULL;
    if (loaded && table.GetErrorString(rc, &s) != CU_OK)
        s = NULL;
    return uccl__err(UCCL_ERR_IO, "%s: CUDA error %d (%s)", what, rc, s ? s : "unknown");
}

int uccl__cuda_init(void)
{
    const struct uccl__cuda *cu = uccl__cuda();
    if (!cu)
        return UCCL_ERR_UNAVAIL;
    pthread_mutex_lock(&ctx_mu);
    cu_result r = init_done ? CU_OK : cu->Init(0);
    init_done = r == CU_OK;
    pthread_mutex_unlock(&ctx_mu);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "cuInit");
}

int uccl__cuda_use(int dev)
{
    const struct uccl__cuda *cu = uccl__cuda();
    if (!cu)
        return UCCL_ERR_UNAVAIL;
    if (dev < 0 || dev >= MAX_DEVICES)
        return uccl__err(UCCL_ERR_INVALID, "CUDA device %d out of range", dev);
    pthread_mutex_lock(&ctx_mu);
    cu_context ctx = primary[dev];
    int rc = UCCL_OK;
    if (!ctx) {
        cu_device d;
        cu_result r = init_done ? CU_OK : cu->Init(0);
        init_done = r == CU_OK;
        if (r == CU_OK)
            r = cu->DeviceGet(&d, dev);
        if (r == CU_OK)
            r = cu->DevicePrimaryCtxRetain(&ctx, d);
        if (r != CU_OK)
            rc = uccl__cuda_err(r, "retaining the primary context of CUDA device");
        else
            primary[dev] = ctx;
    }
    pthread_mutex_unlock(&ctx_mu);
    if (rc)
        return rc;
    cu_context cur = NULL;
    if (cu->CtxGetCurrent(&cur) == CU_OK && cur == ctx)
        return UCCL_OK;
    cu_result r = cu->CtxSetCurrent(ctx);
    return r == CU_OK ? UCCL_OK : uccl__cuda_err(r, "making a primary context current");
}
