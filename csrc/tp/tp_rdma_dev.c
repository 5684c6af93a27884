/* RDMA devices and memory (tp_rdma.h): which NICs this process uses, their
 * port, GID and protection domain, found once; regions registered with
 * every one of them; and the staging areas (page-locked, or plain,
 * memory registered with every NIC) through which memory no NIC could
 * register moves (tp_rdma_move.c's own chunk, tp_rdma_stage.c's ring).
 *
 * Discovery: UCCL_P2P_RDMA_DEV (comma-separated device names, each
 * optionally ":port") or else every device with an active port, at most
 * UCCL_RDMA_MAX_DEVS of them.  On RoCE the GID is found as NCCL finds it:
 * UCCL_P2P_RDMA_GID_INDEX if set, else the RoCE v2 GID of an IPv4 address
 * (the type from _ibv_query_gid_ex where the library has it, else from
 * sysfs, else the last IPv4-mapped GID, which on mlx5 is the v2 one of a
 * v1/v2 pair). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "load/cuda_loader.h"

#include "base/log.h"
#include "mem/mem.h"
#include "base/config.h"
#include "base/status.h"
#include "tp/tp_rdma.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct uccl__rdma_dev devs[UCCL_RDMA_MAX_DEVS];
static unsigned ndevs;
static char why[400];

static int is_v4_mapped(const union ibv_gid_u *g)
{
    static const uint8_t pfx[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g->raw, pfx, 12) == 0;
}

static int is_zero(const union ibv_gid_u *g)
{
    static const uint8_t z[16];
    return memcmp(g->raw, z, 16) == 0;
}

/* The GID's type: IBV_GID_TYPE_*, or -1 if nobody says. */
static int gid_type(const struct uccl__ibv *ib, struct uccl__rdma_dev *d, int idx)
{
    if (ib->query_gid_ex) {
        struct ibv_gid_entry_s e;
        if (ib->query_gid_ex(d->ctx, d->port, (uint32_t)idx, &e, 0, sizeof(e)) == 0)
            return (int)e.gid_type;
    }
    char path[256], buf[32] = "";
    snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d",
             d->name, d->port, idx);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    int got = fgets(buf, sizeof(buf), f) != NULL;
    fclose(f);
    if (!got)
        return -1;
    return strstr(buf, "v2") ? IBV_GID_TYPE_ROCE_V2_ : strstr(buf, "RoCE") ? IBV_GID_TYPE_ROCE_V1_
                                                                           : IBV_GID_TYPE_IB_;
}

static int pick_gid(const struct uccl__ibv *ib, struct uccl__rdma_dev *d, int tbl_len)
{
    long forced;
    if (uccl__cfg_long(UCCL_CFG_P2P_RDMA_GID_INDEX, &forced)) {
        snprintf(why, sizeof(why), "%s", uccl_last_error());
        return -1;
    }
    if (forced >= 0) {
        if (forced >= tbl_len || ib->query_gid(d->ctx, d->port, (int)forced, &d->gid) ||
            is_zero(&d->gid)) {
            snprintf(why, sizeof(why), "UCCL_P2P_RDMA_GID_INDEX=%ld: %s port %u has no such GID "
                     "(its table holds %d; see show_gids or ibv_devinfo -v)", forced, d->name,
                     d->port, tbl_len);
            return -1;
        }
        d->gid_index = (int)forced;
        return 0;
    }
    int best = -1, best_score = 0;
    for (int i = 0; i < tbl_len && i < 256; i++) {
        union ibv_gid_u g;
        if (ib->query_gid(d->ctx, d->port, i, &g) || is_zero(&g))
            continue;
        int t = gid_type(ib, d, i);
        int v4 = is_v4_mapped(&g), link_local = g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80;
        /* v2 over IPv4 > v2 > unknown type over IPv4 (the later the likelier v2) > v1 */
        int score = t == IBV_GID_TYPE_ROCE_V2_ ? (v4 ? 5 : link_local ? 3 : 4)
                  : t < 0 ? (v4 ? 2 : 1) : 1;
        if (score >= best_score && (score > best_score || t < 0)) {
            best = i;
            best_score = score;
            d->gid = g;
        }
    }
    if (best < 0) {
        snprintf(why, sizeof(why), "%s port %u (Ethernet) has no GID: is an IP address "
                 "configured on its netdev?", d->name, d->port);
        return -1;
    }
    d->gid_index = best;
    return 0;
}

/* Open dev and take its first active port (or `want`), filling *d. */
static int open_dev(const struct uccl__ibv *ib, struct ibv_device_s *dev, int want,
                    struct uccl__rdma_dev *d, char *state, size_t state_len)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->name, sizeof(d->name), "%s", ib->get_device_name(dev));
    d->ctx = ib->open_device(dev);
    if (!d->ctx) {
        snprintf(state, state_len, "%s: cannot open (%s)", d->name, strerror(errno));
        return -1;
    }
    struct ibv_port_attr_s a;
    int tbl = 0;
    size_t used = 0;
    state[0] = '\0';
    for (int p = want > 0 ? want : 1; p <= (want > 0 ? want : 8); p++) {
        memset(&a, 0, sizeof(a)); /* the exported symbol fills the compat prefix */
        if (ib->query_port(d->ctx, (uint8_t)p, &a))
            break;
        used += (size_t)snprintf(state + used, used < state_len ? state_len - used : 0,
                                 "%s%s port %d %s", used ? ", " : "", d->name, p,
                                 a.state == IBV_PORT_ACTIVE_ ? "ACTIVE" : a.state == 1 ? "DOWN"
                                 : "not active");
        if (a.state == IBV_PORT_ACTIVE_) {
            d->port = (uint8_t)p;
            tbl = a.gid_tbl_len;
            break;
        }
    }
    if (!d->port) {
        if (!state[0])
            snprintf(state, state_len, "%s: no port %d", d->name, want > 0 ? want : 1);
        ib->close_device(d->ctx);
        d->ctx = NULL;
        return -1;
    }
    d->link_layer = a.link_layer ? a.link_layer : IBV_LINK_LAYER_INFINIBAND_;
    d->active_mtu = a.active_mtu;
    d->lid = a.lid;
    d->gid_index = -1;
    if (d->link_layer == IBV_LINK_LAYER_ETHERNET_ && pick_gid(ib, d, tbl)) {
        snprintf(state, state_len, "%.190s", why);
        ib->close_device(d->ctx);
        d->ctx = NULL;
        return -2;
    }
    d->pd = ib->alloc_pd(d->ctx);
    if (!d->pd) {
        snprintf(state, state_len, "%s: ibv_alloc_pd failed (%s)", d->name, strerror(errno));
        ib->close_device(d->ctx);
        d->ctx = NULL;
        return -1;
    }
    return 0;
}

static void discover(void)
{
    const struct uccl__ibv *ib = uccl__ibv();
    if (!ib) {
        snprintf(why, sizeof(why), "no RDMA library: %s", uccl_last_error());
        return;
    }
    int n = 0;
    struct ibv_device_s **list = ib->get_device_list(&n);
    if (!list || n <= 0) {
        snprintf(why, sizeof(why), "no RDMA device: libibverbs lists none%s%s",
                 list ? "" : " (", list ? "" : strerror(errno));
        if (!list)
            strncat(why, ")", sizeof(why) - strlen(why) - 1);
        if (list)
            ib->free_device_list(list);
        return;
    }
    const char *sel = NULL;
    uccl__cfg_str(UCCL_CFG_P2P_RDMA_DEV, &sel);
    char states[300] = "", names[200] = "";
    for (int i = 0; i < n; i++)
        snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", i ? ", " : "",
                 ib->get_device_name(list[i]));
    if (sel && *sel) { /* exactly these, in this order */
        char buf[256];
        snprintf(buf, sizeof(buf), "%s", sel);
        char *save = NULL;
        for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            char *colon = strchr(t, ':');
            int port = colon ? atoi(colon + 1) : 0;
            if (colon)
                *colon = '\0';
            int k = 0;
            while (k < n && strcmp(ib->get_device_name(list[k]), t) != 0)
                k++;
            if (k == n || (colon && (port < 1 || port > 255))) {
                snprintf(why, sizeof(why), "UCCL_P2P_RDMA_DEV=%s: %s%s is not a device here "
                         "(devices: %s)", sel, t, colon ? " (or its port)" : "", names);
                goto fail;
            }
            if (ndevs == UCCL_RDMA_MAX_DEVS) {
                snprintf(why, sizeof(why), "UCCL_P2P_RDMA_DEV=%s: at most %d devices",
                         sel, UCCL_RDMA_MAX_DEVS);
                goto fail;
            }
            char st[200];
            if (open_dev(ib, list[k], port, &devs[ndevs], st, sizeof(st))) {
                snprintf(why, sizeof(why), "UCCL_P2P_RDMA_DEV=%s: no active port (%s)", sel, st);
                goto fail;
            }
            ndevs++;
        }
    } else {
        for (int i = 0; i < n && ndevs < UCCL_RDMA_MAX_DEVS; i++) {
            char st[200];
            int rc = open_dev(ib, list[i], 0, &devs[ndevs], st, sizeof(st));
            snprintf(states + strlen(states), sizeof(states) - strlen(states), "%s%s",
                     states[0] ? "; " : "", st);
            if (rc == 0)
                ndevs++;
        }
        if (ndevs == 0) {
            snprintf(why, sizeof(why), "no active port on the RDMA devices (%s)", states);
            goto fail;
        }
    }
    for (unsigned i = 0; i < ndevs; i++) {
        const uint8_t *g = devs[i].gid.raw;
        LOG_INFO("RDMA: using %s port %u, %s, GID index %d (%u.%u.%u.%u if IPv4-mapped), "
                 "LID %u", devs[i].name, devs[i].port,
                 devs[i].link_layer == IBV_LINK_LAYER_ETHERNET_ ? "RoCE" : "InfiniBand",
                 devs[i].gid_index, g[12], g[13], g[14], g[15], devs[i].lid);
    }
    ib->free_device_list(list);
    return;
fail:
    for (unsigned i = 0; i < ndevs; i++) { /* all or nothing */
        ib->dealloc_pd(devs[i].pd);
        ib->close_device(devs[i].ctx);
    }
    ndevs = 0;
    ib->free_device_list(list);
}

/* Once per process: say why there is no RDMA (auto then uses TCP between
 * hosts), at INFO, since most machines simply have no NIC for it. */
static void discover_and_tell(void)
{
    discover();
    if (ndevs == 0)
        LOG_INFO("RDMA unavailable (%s): peers on other hosts use TCP", why);
}

const struct uccl__rdma_dev *uccl__rdma_devs(unsigned *n_p)
{
    pthread_once(&once, discover_and_tell);
    if (ndevs == 0) {
        uccl__err(UCCL_ERR_UNAVAIL, "%s", why);
        return NULL;
    }
    *n_p = ndevs;
    return devs;
}

/* ---- memory ------------------------------------------------------------------ */

enum { ACCESS = IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_WRITE_ | IBV_ACCESS_REMOTE_READ_ };

/* Device memory for GPUDirect RDMA: by dmabuf where the driver and the
 * library have it (cuMemGetHandleForAddressRange, ibv_reg_dmabuf_mr: no
 * kernel module needed), else as plain memory, which works only with
 * nvidia-peermem loaded.  The range handed to the driver is page-aligned;
 * the MR covers exactly the region (offset into the dmabuf, iova = addr). */
static struct ibv_mr_s *reg_gpu(const struct uccl__ibv *ib, const struct uccl__rdma_dev *d,
                                const struct uccl__mr *mr)
{
    const struct uccl__cuda *cu = uccl__cuda();
    if (cu && cu->MemGetHandleForAddressRange && ib->reg_dmabuf_mr &&
        uccl__cuda_use((int)UCCL_MK_DEV(mr->gpu.mkind)) == UCCL_OK) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t base = mr->addr & ~(page - 1);
        size_t span = (size_t)((mr->addr + mr->len - base + page - 1) & ~(page - 1));
        int fd = -1;
        if (cu->MemGetHandleForAddressRange(&fd, (cu_ptr)base, span,
                                            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) == CU_OK &&
            fd >= 0) {
            struct ibv_mr_s *m = ib->reg_dmabuf_mr(d->pd, mr->addr - base, mr->len, mr->addr, fd,
                                                   ACCESS);
            int saved = errno;
            close(fd); /* the MR holds its own reference */
            errno = saved;
            if (m)
                return m;
        }
    }
    return ib->reg_mr(d->pd, (void *)mr->addr, mr->len, ACCESS);
}

int uccl__rdma_mem_reg(struct uccl__mem *mem, struct uccl__mr *mr)
{
    (void)mem;
    unsigned n;
    const struct uccl__rdma_dev *d = uccl__rdma_devs(&n);
    const struct uccl__ibv *ib = uccl__ibv();
    if (!d || !ib)
        return UCCL_OK; /* no RDMA here: nothing to register */
    /* For tests without a GPU, and to rule GPUDirect out: stage everything. */
    long stage_all;
    int rc = uccl__cfg_long(UCCL_CFG_P2P_RDMA_STAGE_ALL, &stage_all);
    if (rc)
        return rc;
    struct uccl__rdma_mr *m = calloc(1, sizeof(*m));
    if (!m)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    m->magic = UCCL_RDMA_MR_MAGIC;
    m->mkind = mr->gpu.mkind;
    m->staged = stage_all;
    /* A failure fails no registration (TCP and shared memory need none):
     * it is kept and told to an RDMA transfer that needs the region. */
    for (unsigned i = 0; i < n && mr->len > 0 && !m->err[0] && !m->staged; i++) {
        m->mr[i] = UCCL_MK_ON_GPU(mr->gpu.mkind) ? reg_gpu(ib, &d[i], mr)
                                                 : ib->reg_mr(d[i].pd, (void *)mr->addr, mr->len,
                                                              ACCESS);
        if (!m->mr[i])
            snprintf(m->err, sizeof(m->err), "registering %zu bytes at 0x%zx with %.60s failed "
                     "(%.40s)%s", mr->len, (size_t)mr->addr, d[i].name, strerror(errno),
                     UCCL_MK_ON_GPU(mr->gpu.mkind)
                         ? ": GPU memory needs GPUDirect RDMA (dmabuf support, or nvidia-peermem)"
                         : ": check ulimit -l (locked memory)");
        else
            m->n = i + 1;
    }
    if (m->err[0] && UCCL_MK_ON_GPU(mr->gpu.mkind)) { /* staged: no MR at all */
        for (unsigned i = 0; i < m->n; i++)
            ib->dereg_mr(m->mr[i]);
        m->n = 0;
        LOG_INFO("%s: staged through page-locked host memory", m->err);
        m->err[0] = '\0';
        m->staged = 1;
    }
    mr->tp_priv[UCCL_TP_RDMA] = m;
    mr->tp_key[UCCL_TP_RDMA] = (uint64_t)(uintptr_t)m;
    return UCCL_OK;
}

void uccl__rdma_mem_dereg(struct uccl__mem *mem, struct uccl__mr *mr)
{
    (void)mem;
    struct uccl__rdma_mr *m = mr->tp_priv[UCCL_TP_RDMA];
    const struct uccl__ibv *ib = uccl__ibv();
    if (!m)
        return;
    for (unsigned i = 0; ib && i < m->n; i++)
        ib->dereg_mr(m->mr[i]);
    m->magic = 0;
    free(m);
    mr->tp_priv[UCCL_TP_RDMA] = NULL;
}

int uccl__rdma_mem_key(struct uccl__link *lk, const struct uccl__mr *mr, uintptr_t addr,
                       uint64_t *key_p)
{
    (void)lk;
    (void)addr;
    const struct uccl__rdma_mr *m = mr->tp_priv[UCCL_TP_RDMA];
    unsigned n = 0;
    if (mr->len == 0) {
        *key_p = 0;
        return UCCL_OK;
    }
    if (m && m->staged) { /* the peer cannot reach it: what reaches it streams */
        *key_p = 0;
        return UCCL_OK;
    }
    if (!m || m->err[0] || !uccl__rdma_devs(&n) || m->n != n)
        return uccl__err(UCCL_ERR_UNAVAIL, "memory at 0x%zx cannot move over RDMA: %s",
                         (size_t)mr->addr, m && m->err[0] ? m->err : "it was registered "
                         "before RDMA was usable in this process");
    uint64_t key = 0;
    for (unsigned i = 0; i < n; i++)
        key |= (uint64_t)m->mr[i]->rkey << (32 * i);
    *key_p = key;
    return UCCL_OK;
}

int uccl__rdma_staged(uint64_t local_key)
{
    const struct uccl__rdma_mr *m = (const struct uccl__rdma_mr *)(uintptr_t)local_key;
    return m && m->magic == UCCL_RDMA_MR_MAGIC && m->staged;
}

const struct uccl__rdma_mr *uccl__rdma_mr_of(uint64_t local_key)
{
    const struct uccl__rdma_mr *m = (const struct uccl__rdma_mr *)(uintptr_t)local_key;
    if (!m || m->magic != UCCL_RDMA_MR_MAGIC) {
        uccl__err(UCCL_ERR_UNAVAIL, "the buffer's region was not registered for RDMA (key "
                  "0x%llx)", (unsigned long long)local_key);
        return NULL;
    }
    return m;
}

/* ---- staging areas ------------------------------------------------------------ */

void uccl__rdma_area_free(struct uccl__rdma_area *a)
{
    const struct uccl__ibv *ib = uccl__ibv();
    for (unsigned i = 0; ib && i < UCCL_RDMA_MAX_DEVS; i++)
        if (a->mr[i])
            ib->dereg_mr(a->mr[i]);
    if (a->p && UCCL_MK_KIND(a->mk) == UCCL_MK_PINNED)
        uccl__gpu_host_free(UCCL_MK_DEV(a->mk), a->p);
    else
        free(a->p);
    memset(a, 0, sizeof(*a));
}

/* len bytes to stage memory of kind for_mk through: page-locked (portable)
 * for GPU memory, page-aligned host memory otherwise; registered with every
 * NIC. */
int uccl__rdma_area_make(struct uccl__rdma_area *a, uint32_t for_mk, size_t len, int access)
{
    unsigned n;
    const struct uccl__rdma_dev *d = uccl__rdma_devs(&n);
    const struct uccl__ibv *ib = uccl__ibv();
    if (!d || !ib)
        return UCCL_ERR_UNAVAIL;
    int gpu = UCCL_MK_ON_GPU(for_mk), dev = UCCL_MK_DEV(for_mk), rc = UCCL_OK;
    void *p = NULL;
    if (gpu)
        rc = uccl__gpu_host_alloc(dev, len, &p);
    else if (posix_memalign(&p, (size_t)sysconf(_SC_PAGESIZE), len))
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory for a %zu-byte staging buffer", len);
    if (rc)
        return rc;
    *a = (struct uccl__rdma_area){.p = p, .len = len, .for_mk = for_mk,
                                  .mk = gpu ? UCCL_MK(UCCL_MK_PINNED, dev) : UCCL_MK(UCCL_MK_HOST, 0)};
    for (unsigned i = 0; i < n; i++) {
        a->mr[i] = ib->reg_mr(d[i].pd, p, len, access);
        if (!a->mr[i]) {
            int e = errno;
            uccl__rdma_area_free(a);
            return uccl__err(UCCL_ERR_IO, "registering a %zu-byte staging buffer with %s: %s "
                             "(ulimit -l?)", len, d[i].name, strerror(e));
        }
    }
    return UCCL_OK;
}

/* GPU memory of one device stages through memory of that device; host
 * memory through host memory. */
uint32_t uccl__rdma_stage_kind(uint32_t mk)
{
    return UCCL_MK_ON_GPU(mk) ? UCCL_MK(UCCL_MK_DEVICE, UCCL_MK_DEV(mk)) : UCCL_MK(UCCL_MK_HOST, 0);
}
