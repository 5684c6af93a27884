/* Memory regions, advertised windows and holds (mem.h). */
#define _GNU_SOURCE
#include "mem/mem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "base/status.h"

#define WINDOW_SWEEP 256 /* windows looked at per pass of dereg's sweep */

void uccl__mem_init(struct uccl__mem *m, const struct uccl__mem_hooks *hooks)
{
    m->hooks = hooks;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
}

/* A region no peer can reach any more: undo its registration. */
static void mr_free(struct uccl__mem *m, struct uccl__mr *mr)
{
    m->hooks->dereg(m, mr);
    uccl__gpu_export_free(mr->gexp);
    free(mr);
}

static void free_mr_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    mr_free(arg, v);
}

static void free_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    (void)arg;
    free(v);
}

void uccl__mem_fini(struct uccl__mem *m)
{
    uccl__idmap_each(&m->mrs, free_mr_entry, m);
    uccl__idmap_each(&m->windows, free_entry, NULL);
    uccl__idmap_free(&m->window_of);
    uccl__idmap_free(&m->mrs);
    uccl__idmap_free(&m->windows);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
}

int uccl__mem_reg(struct uccl__mem *m, uintptr_t addr, size_t len, uint64_t *mr_p)
{
    if (addr == 0 && len > 0)
        return uccl__err(UCCL_ERR_INVALID, "cannot register %zu bytes at address 0", len);
    if (addr + len < addr)
        return uccl__err(UCCL_ERR_INVALID, "region 0x%zx + %zu wraps around", (size_t)addr, len);
    struct uccl__gpu_info info;
    int rc = uccl__gpu_classify(addr, len, &info);
    if (rc)
        return rc;
    struct uccl__mr *mr = calloc(1, sizeof(*mr));
    if (!mr)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    mr->addr = addr;
    mr->len = len;
    mr->gpu = info;
    /* Exported once, here; a failure (memory of a pool that cannot be
     * shared) matters only to a connection that needs the export. */
    if (UCCL_MK_ON_GPU(info.mkind) && uccl__gpu_export_new(addr, len, &info, &mr->gexp))
        snprintf(mr->gexp_err, sizeof(mr->gexp_err), "%s", uccl_last_error());
    for (int i = 0; i < UCCL_TP_COUNT; i++)
        mr->tp_key[i] = info.mkind;
    rc = m->hooks->reg(m, mr);
    if (rc) {
        mr_free(m, mr);
        return rc;
    }
    pthread_mutex_lock(&m->mu);
    mr->id = ++m->next_mr_id;
    rc = uccl__idmap_put(&m->mrs, mr->id, mr);
    pthread_mutex_unlock(&m->mu);
    if (rc) {
        mr_free(m, mr);
        return rc;
    }
    *mr_p = mr->id;
    return UCCL_OK;
}

struct win_sweep { uint64_t mr, conn; uint64_t ids[WINDOW_SWEEP]; unsigned n; };
/* window_of's key for a window's range (never 0 nor UINT64_MAX, the map's
 * marks): a collision only costs a window that is not found again. */
static uint64_t range_key(uint64_t conn_id, uint64_t mr_id, uintptr_t addr, size_t len)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    const uint64_t v[4] = {conn_id, mr_id, (uint64_t)addr, (uint64_t)len};
    for (int i = 0; i < 4; i++) {
        h ^= v[i] + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
    }
    return h == 0 || h == UINT64_MAX ? 1 : h;
}

static void match_window(uint64_t k, void *v, void *arg)
{
    struct win_sweep *s = arg;
    const struct uccl__window *w = v;
    if ((s->conn ? w->conn_id == s->conn : w->mr_id == s->mr) && s->n < WINDOW_SWEEP)
        s->ids[s->n++] = k;
}

/* Under m->mu: drop every window of region mr_id (conn_id 0), or offered
 * on connection conn_id; *conns_p: the distinct connections they were
 * offered on (the caller frees it). */
static unsigned drop_windows(struct uccl__mem *m, uint64_t mr_id, uint64_t conn_id,
                             uint64_t **conns_p)
{
    struct win_sweep s = {.mr = mr_id, .conn = conn_id};
    uint64_t *conns = NULL;
    unsigned nconns = 0;
    do {
        s.n = 0;
        uccl__idmap_each(&m->windows, match_window, &s);
        for (unsigned i = 0; i < s.n; i++) {
            struct uccl__window *w = uccl__idmap_del(&m->windows, s.ids[i]);
            uint64_t rk = w ? range_key(w->conn_id, w->mr_id, w->addr, w->len) : 0;
            if (w && uccl__idmap_get(&m->window_of, rk) == w)
                uccl__idmap_del(&m->window_of, rk);
            unsigned k = 0;
            while (w && k < nconns && conns[k] != w->conn_id)
                k++;
            if (w && k == nconns) {
                uint64_t *grown = realloc(conns, (nconns + 1) * sizeof(*conns));
                if (grown) {
                    conns = grown;
                    conns[nconns++] = w->conn_id;
                }
            }
            free(w);
        }
    } while (s.n == WINDOW_SWEEP);
    *conns_p = conns;
    return nconns;
}

void uccl__mem_drop_conn(struct uccl__mem *m, uint64_t conn_id)
{
    uint64_t *conns = NULL;
    if (conn_id == 0)
        return;
    pthread_mutex_lock(&m->mu);
    drop_windows(m, 0, conn_id, &conns);
    pthread_mutex_unlock(&m->mu);
    free(conns);
}

int uccl__mem_dereg(struct uccl__mem *m, uint64_t mr_id, uint64_t timeout_ns,
                    uccl__mem_stop_fn stop, void *arg)
{
    pthread_mutex_lock(&m->mu);
    struct uccl__mr *mr = uccl__idmap_del(&m->mrs, mr_id);
    if (!mr) {
        pthread_mutex_unlock(&m->mu);
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown mr_id %llu (never registered, or "
                         "already deregistered)", (unsigned long long)mr_id);
    }
    /* Its advertised windows die with it: no new peer access can start. */
    uint64_t *conns;
    unsigned nconns = drop_windows(m, mr_id, 0, &conns);
    /* Accesses already under way finish first: after dereg() returns, no
     * peer touches this memory.  If they do not finish within the timeout,
     * their connections are stopped, which ends them. */
    mr->dead = 1;
    mr->waiting = 1;
    int rc = UCCL_OK;
    for (int round = 0; mr->inflight > 0 && round < 2; round++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t wait_ns = round == 0 ? timeout_ns : 5000000000ull;
        uint64_t t = (uint64_t)ts.tv_nsec + wait_ns;
        ts.tv_sec += (time_t)(t / 1000000000ull);
        ts.tv_nsec = (long)(t % 1000000000ull);
        while (mr->inflight > 0)
            if (pthread_cond_timedwait(&m->cv, &m->mu, &ts) == ETIMEDOUT)
                break;
        if (mr->inflight > 0 && round == 0) {
            pthread_mutex_unlock(&m->mu);
            for (unsigned i = 0; i < nconns; i++)
                stop(arg, conns[i], mr_id);
            pthread_mutex_lock(&m->mu);
        }
    }
    mr->waiting = 0;
    free(conns);
    int stopped = mr->inflight == 0;
    if (!stopped) /* the last release frees it */
        rc = uccl__err(UCCL_ERR_TIMEOUT, "dereg(%llu): %d peer accesses did not stop",
                       (unsigned long long)mr_id, mr->inflight);
    pthread_mutex_unlock(&m->mu);
    if (stopped)
        mr_free(m, mr);
    return rc;
}

/* Under m->mu: region mr_id if [ptr, ptr + len) lies inside it, else NULL
 * with the reason recorded. */
static struct uccl__mr *mr_covering(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr,
                                    size_t len, int *status_p)
{
    struct uccl__mr *mr = uccl__idmap_get(&m->mrs, mr_id);
    if (!mr) {
        *status_p = uccl__err(UCCL_ERR_NOTFOUND, "unknown mr_id %llu (never registered, or "
                              "deregistered)", (unsigned long long)mr_id);
        return NULL;
    }
    /* Zero bytes touch nothing: any address will do (torch's empty tensors
     * have data_ptr() 0). */
    if (len > 0 && (ptr < mr->addr || ptr - mr->addr > mr->len || len > mr->len - (ptr - mr->addr))) {
        *status_p = uccl__err(UCCL_ERR_INVALID, "buffer [0x%zx, +%zu) is not inside registered "
                              "region %llu [0x%zx, +%zu)", (size_t)ptr, len,
                              (unsigned long long)mr_id, (size_t)mr->addr, mr->len);
        return NULL;
    }
    return mr;
}

size_t uccl__mem_room(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len)
{
    pthread_mutex_lock(&m->mu);
    struct uccl__mr *mr = uccl__idmap_get(&m->mrs, mr_id);
    if (mr && ptr >= mr->addr && ptr - mr->addr <= mr->len && len > mr->len - (ptr - mr->addr))
        len = mr->len - (ptr - mr->addr);
    pthread_mutex_unlock(&m->mu);
    return len;
}

int uccl__mem_keys(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len, int tp_id,
                   uccl__mem_key_fn peer_key_fn, void *arg, uint64_t *local_key_p,
                   uint64_t *peer_key_p, uint32_t *mkind_p)
{
    int rc = UCCL_OK;
    uint64_t peer_key = 0;
    pthread_mutex_lock(&m->mu);
    struct uccl__mr *mr = mr_covering(m, mr_id, ptr, len, &rc);
    struct uccl__gpu_info info = mr ? mr->gpu : (struct uccl__gpu_info){0};
    const struct uccl__gpu_export *gexp = mr ? mr->gexp : NULL;
    if (mr) { /* the keys a direct transport will need (0 for CMA) */
        *local_key_p = mr->tp_key[tp_id];
        rc = peer_key_fn ? peer_key_fn(arg, mr, ptr, &peer_key) : UCCL_OK;
    }
    /* Device memory still the registered allocation?  Under the lock: a
     * racing dereg frees the export record this reads. */
    if (rc == UCCL_OK && UCCL_MK_ON_GPU(info.mkind))
        rc = uccl__gpu_check_live(&info, gexp, ptr, len);
    pthread_mutex_unlock(&m->mu);
    if (rc == UCCL_OK) {
        *peer_key_p = peer_key;
        *mkind_p = info.mkind;
    }
    return rc;
}

/* A window lives until its region is deregistered, so a loop that
 * advertises the same range at every step (upstream's style) is given the
 * window it has already, not a new one each time. */
int uccl__mem_advertise(struct uccl__mem *m, uint64_t conn_id, uint64_t mr_id, uintptr_t addr,
                        size_t len, struct uccl__fifo_item *f_p)
{
    struct uccl__window *w = malloc(sizeof(*w));
    if (!w)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    int rc = UCCL_OK;
    uint64_t rk = range_key(conn_id, mr_id, addr, len);
    pthread_mutex_lock(&m->mu);
    struct uccl__window *had = uccl__idmap_get(&m->window_of, rk), *give = NULL;
    int same = had && had->conn_id == conn_id && had->mr_id == mr_id && had->addr == addr &&
               had->len == len;
    if (!mr_covering(m, mr_id, addr, len, &rc)) {
        /* rc says why */
    } else if (same) {
        give = had;
    } else {
        *w = (struct uccl__window){.id = ++m->next_window_id, .token = uccl__random64(),
                                   .conn_id = conn_id, .mr_id = mr_id, .addr = addr, .len = len};
        if ((rc = uccl__idmap_put(&m->windows, w->id, w)) == UCCL_OK) {
            give = w;
            if (!had) /* else a collision: not indexed, still valid (so when out of memory) */
                (void)uccl__idmap_put(&m->window_of, rk, w);
        }
    }
    /* Under the lock: once in the table, a dereg() may free it at any time. */
    if (give)
        *f_p = (struct uccl__fifo_item){.window = give->id, .token = give->token, .addr = addr,
                                        .len = len};
    pthread_mutex_unlock(&m->mu);
    if (give != w)
        free(w);
    return rc;
}

struct uccl__window *uccl__mem_window_check(struct uccl__mem *m, uint64_t conn_id,
                                            uint64_t window, uint64_t token, uint64_t offset,
                                            uint64_t len, int *status_p)
{
    struct uccl__window *copy = NULL;
    pthread_mutex_lock(&m->mu);
    struct uccl__window *w = uccl__idmap_get(&m->windows, window);
    if (!w || (w->conn_id && w->conn_id != conn_id) || w->token != token) {
        *status_p = uccl__err(UCCL_ERR_NOTFOUND, "window %llu was not advertised on "
                              "connection %llu (or its token is wrong)",
                              (unsigned long long)window, (unsigned long long)conn_id);
    } else if (offset > w->len || len > w->len - offset) {
        *status_p = uccl__err(UCCL_ERR_ACCESS, "[%llu, +%llu) is outside the %zu advertised "
                              "bytes of window %llu", (unsigned long long)offset,
                              (unsigned long long)len, w->len, (unsigned long long)window);
    } else if ((copy = malloc(sizeof(*copy))) != NULL) {
        *copy = *w;
        copy->mr = uccl__idmap_get(&m->mrs, w->mr_id); /* present: dereg drops windows first */
        if (copy->mr)
            copy->mr->inflight++;
    } else {
        *status_p = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_unlock(&m->mu);
    return copy;
}

void uccl__mem_release_hold(struct uccl__mem *m, struct uccl__mr *mr)
{
    if (!mr)
        return;
    pthread_mutex_lock(&m->mu);
    int last = --mr->inflight == 0;
    if (last)
        pthread_cond_broadcast(&m->cv);
    int gone = last && mr->dead && !mr->waiting;
    pthread_mutex_unlock(&m->mu);
    if (gone)
        mr_free(m, mr);
}
