/* The CUDA driver API, loaded at run time (NCCL's cudawrap pattern).
 *
 * libcuda.so.1 is dlopen'ed on first use and every entry point is looked up
 * once through cuGetProcAddress into one write-once table, so building
 * needs no CUDA toolkit and the module imports where there is no GPU.  The
 * few driver types and constants the engine uses are declared here with
 * the values of the driver's published ABI (cuda.h), under their own names.
 *
 * Contexts: the engine works in the primary context of a pointer's device,
 * the one torch's runtime uses, so memory and streams torch made are valid
 * in it.  uccl__cuda_use(dev) retains it once per device and makes it
 * current on the calling thread. */
#ifndef UCCL_CUDA_LOADER_H
#define UCCL_CUDA_LOADER_H

#include <stddef.h>
#include <stdint.h>

typedef int cu_result;                  /* CUresult */
typedef int cu_device;                  /* CUdevice */
typedef struct cu_ctx_st *cu_context;   /* CUcontext */
typedef struct cu_stream_st *cu_stream; /* CUstream */
typedef struct cu_event_st *cu_event;   /* CUevent */
typedef struct cu_module_st *cu_module; /* CUmodule */
typedef struct cu_func_st *cu_function; /* CUfunction */
typedef unsigned long long cu_ptr;      /* CUdeviceptr */
typedef unsigned long long cu_memhandle; /* CUmemGenericAllocationHandle */
typedef struct { char reserved[64]; } cu_ipc_handle; /* CUipcMemHandle */
typedef struct { int type; int id; } cu_mem_location; /* CUmemLocation */
typedef struct { cu_mem_location location; int flags; } cu_mem_access; /* CUmemAccessDesc */

enum {
    CU_OK = 0,
    CU_ERR_INVALID_VALUE = 1,
    CU_ERR_NOT_INITIALIZED = 3,
    CU_ERR_INVALID_CONTEXT = 201,
    CU_ERR_NOT_READY = 600,
};
enum { /* CUpointer_attribute */
    CU_PA_MEMORY_TYPE = 2, CU_PA_BUFFER_ID = 7, CU_PA_DEVICE_ORDINAL = 9,
    CU_PA_IS_LEGACY_IPC_CAPABLE = 10, CU_PA_RANGE_START_ADDR = 11, CU_PA_RANGE_SIZE = 12,
    CU_PA_MAPPING_SIZE = 18, CU_PA_MAPPING_BASE_ADDR = 19,
};
enum { /* CUdevice_attribute */
    CU_DEV_ATTR_SM_COUNT = 16, CU_DEV_ATTR_CC_MAJOR = 75, CU_DEV_ATTR_CC_MINOR = 76,
    CU_DEV_ATTR_MPS_ENABLED = 133
};
enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };
enum { CU_MEMHOSTALLOC_DEVICEMAP = 2, CU_STREAM_WAIT_VALUE_GEQ = 0 };
enum { CU_MEMHOSTREGISTER_PORTABLE = 1, CU_MEMHOSTREGISTER_DEVICEMAP = 2,
       CU_ERR_HOST_MEMORY_ALREADY_REGISTERED = 712 };
enum { CU_IPC_LAZY_PEER_ACCESS = 1, CU_STREAM_NON_BLOCKING = 1, CU_EVENT_DISABLE_TIMING = 2,
       CU_MEMHOSTALLOC_PORTABLE = 1, CU_HANDLE_POSIX_FD = 1, CU_LOCATION_DEVICE = 1,
       CU_ACCESS_READWRITE = 3 };

struct uccl__cuda {
    cu_result (*Init)(unsigned);
    cu_result (*DeviceGet)(cu_device *, int);
    cu_result (*DevicePrimaryCtxRetain)(cu_context *, cu_device);
    cu_result (*CtxSetCurrent)(cu_context);
    cu_result (*CtxGetCurrent)(cu_context *);
    cu_result (*PointerGetAttribute)(void *, int, cu_ptr);
    cu_result (*PointerGetAttributes)(unsigned, int *, void **, cu_ptr);
    cu_result (*MemcpyAsync)(cu_ptr, cu_ptr, size_t, cu_stream);
    cu_result (*StreamCreate)(cu_stream *, unsigned);
    cu_result (*StreamDestroy)(cu_stream);
    cu_result (*StreamQuery)(cu_stream);
    cu_result (*StreamWaitValue32)(cu_stream, cu_ptr, uint32_t, unsigned);
    cu_result (*StreamWriteValue32)(cu_stream, cu_ptr, uint32_t, unsigned);
    cu_result (*EventCreate)(cu_event *, unsigned);
    cu_result (*EventRecord)(cu_event, cu_stream);
    cu_result (*EventQuery)(cu_event);
    cu_result (*EventDestroy)(cu_event);
    cu_result (*IpcGetMemHandle)(cu_ipc_handle *, cu_ptr);
    cu_result (*IpcOpenMemHandle)(cu_ptr *, cu_ipc_handle, unsigned);
    cu_result (*IpcCloseMemHandle)(cu_ptr);
    cu_result (*MemGetAddressRange)(cu_ptr *, size_t *, cu_ptr);
    cu_result (*MemRetainAllocationHandle)(cu_memhandle *, void *);
    cu_result (*MemExportToShareableHandle)(void *, cu_memhandle, int, unsigned long long);
    cu_result (*MemImportFromShareableHandle)(cu_memhandle *, void *, int);
    cu_result (*MemAddressReserve)(cu_ptr *, size_t, size_t, cu_ptr, unsigned long long);
    cu_result (*MemAddressFree)(cu_ptr, size_t);
    cu_result (*MemMap)(cu_ptr, size_t, size_t, cu_memhandle, unsigned long long);
    cu_result (*MemUnmap)(cu_ptr, size_t);
    cu_result (*MemSetAccess)(cu_ptr, size_t, const cu_mem_access *, size_t);
    cu_result (*MemRelease)(cu_memhandle);
    cu_result (*MemHostAlloc)(void **, size_t, unsigned);
    cu_result (*MemFreeHost)(void *);
    cu_result (*MemHostRegister)(void *, size_t, unsigned);
    cu_result (*MemHostUnregister)(void *);
    cu_result (*GetErrorString)(cu_result, const char **);
    cu_result (*DeviceGetPCIBusId)(char *, int, cu_device);
    cu_result (*DeviceGetByPCIBusId)(cu_device *, const char *);
    cu_result (*DeviceGetCount)(int *);
    /* kernels compiled at run time and the memory they share with the
     * host (gpu_kernel.c) */
    cu_result (*DeviceGetAttribute)(int *, int, cu_device);
    cu_result (*ModuleLoadData)(cu_module *, const void *);
    cu_result (*ModuleUnload)(cu_module);
    cu_result (*ModuleGetFunction)(cu_function *, cu_module, const char *);
    cu_result (*LaunchKernel)(cu_function, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, cu_stream, void **, void **);
    /* how many blocks of a kernel fit an SM at once (spinning launches' grids) */
    cu_result (*OccupancyMaxActiveBlocksPerMultiprocessor)(int *, cu_function, int, size_t);
    cu_result (*MemHostGetDevicePointer)(cu_ptr *, void *, unsigned);
    cu_result (*MemAlloc)(cu_ptr *, size_t);
    cu_result (*MemFree)(cu_ptr);
    /* optional (NULL where the driver predates it, CUDA 11.7): a dmabuf fd
     * of device memory, for GPUDirect RDMA registration */
    cu_result (*MemGetHandleForAddressRange)(void *, cu_ptr, size_t, int, unsigned long long);
    /* optional (CUDA 12.4): a kernel's parameter offsets and sizes, to check
     * a launch's arguments against */
    cu_result (*FuncGetParamInfo)(cu_function, size_t, size_t *, size_t *);
    /* stream-ordered groups (sg_cuda.c): a stream waits for an event; and
     * optional, several stream memory operations in one call */
    cu_result (*StreamWaitEvent)(cu_stream, cu_event, unsigned);
    cu_result (*StreamBatchMemOp)(cu_stream, unsigned, void *, unsigned);
    /* optional: whether a stream captures a CUDA graph (*status: 0 none,
     * 1 active, 2 invalidated), for captured rounds (sg/sg_graph.c) */
    cu_result (*StreamIsCapturing)(cu_stream, int *);
    /* optional: this thread's capture mode swapped (0 global, 1 thread
     * local, 2 relaxed), for the host part of a captured round */
    cu_result (*ThreadExchangeStreamCaptureMode)(int *);
    /* optional: a captured round's arena zeroed (sg_cuda.c, cuda_alloc) */
    cu_result (*MemsetD32Async)(cu_ptr, unsigned, size_t, cu_stream);
    cu_result (*StreamSynchronize)(cu_stream);
};
enum { CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1 };

/* The table, loading libcuda on first call (UCCL_CUDA_LIBRARY names another
 * file, for tests).  NULL if it cannot be loaded, with the reason in
 * uccl_last_error() (UCCL_ERR_UNAVAIL). */
const struct uccl__cuda *uccl__cuda(void);

/* Has any code in this process initialised CUDA (cuInit)?  Without that no
 * device or page-locked memory can exist here, so a pointer is host memory
 * without asking the driver (and without initialising CUDA in a process
 * that may still fork). */
int uccl__cuda_initialised(void);

/* Initialise the driver (cuInit) once; the other uccl__cuda_* do it too. */
int uccl__cuda_init(void);

/* Make device dev's primary context current on this thread. */
int uccl__cuda_use(int dev);

/* A driver error as a status with a message: "what: CUDA_ERROR_... (text)". */
int uccl__cuda_err(cu_result rc, const char *what);

#endif
