/* NVRTC (CUDA's run-time compiler), loaded at run time as cuda_loader.c
 * loads libcuda: the kernels of GPU-initiated transfers (ring.c) and the
 * user kernels that include their device header are compiled when first
 * used, so installing the package needs no CUDA toolkit.  torch's CUDA
 * wheels ship libnvrtc (nvidia/cuda_nvrtc/lib, or nvidia/cu13/lib); the
 * Python layer finds it there and names it with uccl__nvrtc_set_path. */
#ifndef UCCL_NVRTC_LOADER_H
#define UCCL_NVRTC_LOADER_H

#include <stddef.h>

typedef int nvrtc_result;                    /* nvrtcResult: 0 is NVRTC_SUCCESS */
typedef struct nvrtc_prog_st *nvrtc_program; /* nvrtcProgram */

struct uccl__nvrtc {
    nvrtc_result (*Version)(int *, int *);
    nvrtc_result (*CreateProgram)(nvrtc_program *, const char *, const char *, int,
                                  const char *const *, const char *const *);
    nvrtc_result (*CompileProgram)(nvrtc_program, int, const char *const *);
    nvrtc_result (*GetProgramLogSize)(nvrtc_program, size_t *);
    nvrtc_result (*GetProgramLog)(nvrtc_program, char *);
    nvrtc_result (*GetCUBINSize)(nvrtc_program, size_t *);
    nvrtc_result (*GetCUBIN)(nvrtc_program, char *);
    nvrtc_result (*DestroyProgram)(nvrtc_program *);
    const char *(*GetErrorString)(nvrtc_result);
};

/* A library path to try after UCCL_NVRTC_LIB (the user's override) and
 * before the loader's own search; only before the first uccl__nvrtc(). */
void uccl__nvrtc_set_path(const char *path);

/* The table, loading the library on first call: UCCL_NVRTC_LIB, else the
 * path set above, else libnvrtc.so.13 / .12 / libnvrtc.so by the loader's
 * search.  NULL with the reason (every name tried) in uccl_last_error(). */
const struct uccl__nvrtc *uccl__nvrtc(void);

#endif
