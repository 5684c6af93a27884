/* libibverbs.so.1 at run time (ibv_loader.h). */
#define _GNU_SOURCE
#include "load/ibv_loader.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/config.h"
#include "base/status.h"

/* The layout this file declares is rdma-core's on LP64: check the members
 * whose offsets the library and this engine must agree on. */
_Static_assert(offsetof(struct ibv_context_s, ops) == 8, "ibv_context.ops");
_Static_assert(offsetof(struct ibv_context_ops_s, poll_cq) == 11 * 8, "ops.poll_cq");
_Static_assert(offsetof(struct ibv_context_ops_s, post_send) == 25 * 8, "ops.post_send");
_Static_assert(sizeof(struct ibv_context_ops_s) == 32 * 8, "ibv_context_ops size");
_Static_assert(offsetof(struct ibv_mr_s, lkey) == 36, "ibv_mr.lkey");
_Static_assert(offsetof(struct ibv_qp_s, qp_num) == 52, "ibv_qp.qp_num");
_Static_assert(sizeof(struct ibv_wc_s) == 48, "ibv_wc size");
_Static_assert(offsetof(struct ibv_send_wr_s, wr) == 40, "ibv_send_wr.wr");
_Static_assert(sizeof(struct ibv_send_wr_s) == 128, "ibv_send_wr size");
_Static_assert(offsetof(struct ibv_qp_attr_s, ah_attr) == 56, "ibv_qp_attr.ah_attr");
_Static_assert(offsetof(struct ibv_qp_attr_s, min_rnr_timer) == 128, "ibv_qp_attr.min_rnr_timer");
_Static_assert(sizeof(struct ibv_qp_attr_s) == 144, "ibv_qp_attr size");
_Static_assert(offsetof(struct ibv_port_attr_s, link_layer) == 46, "ibv_port_attr.link_layer");

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static struct uccl__ibv table;
static int loaded;
static char load_error[400];

static void load(void)
{
    const char *path = NULL;
    uccl__cfg_str(UCCL_CFG_IBVERBS_LIB, &path);
    if (!path)
        path = "libibverbs.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(load_error, sizeof(load_error), "cannot load libibverbs (%s): %s", path,
                 dlerror());
        return;
    }
    static const struct { const char *name, *version; size_t off; int optional; } syms[] = {
#define SYM(field, name, ver, opt) {name, ver, offsetof(struct uccl__ibv, field), opt}
        SYM(get_device_list, "ibv_get_device_list", "IBVERBS_1.1", 0),
        SYM(free_device_list, "ibv_free_device_list", "IBVERBS_1.1", 0),
        SYM(get_device_name, "ibv_get_device_name", "IBVERBS_1.1", 0),
        SYM(open_device, "ibv_open_device", "IBVERBS_1.1", 0),
        SYM(close_device, "ibv_close_device", "IBVERBS_1.1", 0),
        SYM(query_port, "ibv_query_port", "IBVERBS_1.1", 0),
        SYM(query_gid, "ibv_query_gid", "IBVERBS_1.1", 0),
        SYM(alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1", 0),
        SYM(dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1", 0),
        SYM(reg_mr, "ibv_reg_mr", "IBVERBS_1.1", 0),
        SYM(dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1", 0),
        SYM(create_cq, "ibv_create_cq", "IBVERBS_1.1", 0),
        SYM(destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1", 0),
        SYM(create_qp, "ibv_create_qp", "IBVERBS_1.1", 0),
        SYM(modify_qp, "ibv_modify_qp", "IBVERBS_1.1", 0),
        SYM(destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1", 0),
        SYM(query_gid_ex, "_ibv_query_gid_ex", "IBVERBS_1.11", 1),
        SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", 1),
#undef SYM
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = dlvsym(lib, syms[i].name, syms[i].version);
        if (!fn && !syms[i].optional) {
            snprintf(load_error, sizeof(load_error), "%s lacks %s@%s (not libibverbs, or "
                     "older than rdma-core 13?)", path, syms[i].name, syms[i].version);
            dlclose(lib);
            memset(&table, 0, sizeof(table));
            return;
        }
        memcpy((char *)&table + syms[i].off, &fn, sizeof(fn));
    }
    loaded = 1; /* the library stays loaded for the life of the process */
}

const struct uccl__ibv *uccl__ibv(void)
{
    pthread_once(&load_once, load);
    if (!loaded) {
        uccl__err(UCCL_ERR_UNAVAIL, "%s", load_error);
        return NULL;
    }
    return &table;
}
