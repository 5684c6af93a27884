/* libnvrtc at run time (nvrtc_loader.h). */
#define _GNU_SOURCE
#include "load/nvrtc_loader.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/config.h"
#include "base/status.h"

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t path_mu = PTHREAD_MUTEX_INITIALIZER;
static char given_path[512];
static struct uccl__nvrtc table;
static int loaded;
static char load_error[1200];

void uccl__nvrtc_set_path(const char *path)
{
    pthread_mutex_lock(&path_mu);
    snprintf(given_path, sizeof(given_path), "%s", path ? path : "");
    pthread_mutex_unlock(&path_mu);
}

static void load(void)
{
    const char *env = NULL;
    uccl__cfg_str(UCCL_CFG_NVRTC_LIB, &env);
    pthread_mutex_lock(&path_mu);
    char given[512];
    snprintf(given, sizeof(given), "%s", given_path);
    pthread_mutex_unlock(&path_mu);
    const char *names[] = {env && *env ? env : NULL, given[0] ? given : NULL, "libnvrtc.so.13",
                           "libnvrtc.so.12", "libnvrtc.so"};
    void *lib = NULL;
    size_t at = (size_t)snprintf(load_error, sizeof(load_error), "cannot load NVRTC (the CUDA "
                                 "run-time compiler; torch's CUDA wheels ship it): tried");
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !lib; i++) {
        if (!names[i])
            continue;
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib && at < sizeof(load_error))
            at += (size_t)snprintf(load_error + at, sizeof(load_error) - at, " %s (%s);",
                                   names[i], dlerror());
        if (env && *env && !lib)
            return; /* an explicit choice that fails is not replaced by a guess */
    }
    if (!lib)
        return;
    static const struct { const char *name; size_t off; } syms[] = {
#define SYM(field, name) {name, offsetof(struct uccl__nvrtc, field)}
        SYM(Version, "nvrtcVersion"), SYM(CreateProgram, "nvrtcCreateProgram"),
        SYM(CompileProgram, "nvrtcCompileProgram"),
        SYM(GetProgramLogSize, "nvrtcGetProgramLogSize"),
        SYM(GetProgramLog, "nvrtcGetProgramLog"), SYM(GetCUBINSize, "nvrtcGetCUBINSize"),
        SYM(GetCUBIN, "nvrtcGetCUBIN"), SYM(DestroyProgram, "nvrtcDestroyProgram"),
        SYM(GetErrorString, "nvrtcGetErrorString"),
#undef SYM
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = dlsym(lib, syms[i].name);
        if (!fn) {
            snprintf(load_error, sizeof(load_error), "NVRTC lacks %s (older than CUDA 11.1?)",
                     syms[i].name);
            dlclose(lib);
            return;
        }
        memcpy((char *)&table + syms[i].off, &fn, sizeof(fn));
    }
    loaded = 1; /* stays loaded for the life of the process */
}

const struct uccl__nvrtc *uccl__nvrtc(void)
{
    pthread_once(&load_once, load);
    if (!loaded) {
        uccl__err(UCCL_ERR_UNAVAIL, "%s", load_error);
        return NULL;
    }
    return &table;
}
