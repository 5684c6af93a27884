/* A userspace emulation of libibverbs.so.1, for tests only.
 *
 * No machine here has an RDMA device, so the engine's RDMA transport is
 * exercised against this library, loaded through UCCL_IBVERBS_LIB.  It is
 * binary-compatible with libibverbs for every call it implements: the same
 * struct layouts (declared by the engine's csrc/load/ibv_loader.h, whose offsets
 * are checked there against rdma-core's), the context ops table through
 * which verbs.h's inline data path calls, and the symbol versions
 * (IBVERBS_1.1, _ibv_query_gid_ex at IBVERBS_1.11: ibv_emu.map).
 *
 * Semantics are those of RC queue pairs between processes on one host:
 *  - each QP has a 24-bit number unique on the host (it names an abstract
 *    Unix socket, so bind() is the uniqueness check); at RTR the QP with the
 *    lower number connects to its peer's socket, the other accepts;
 *  - per QP one sender thread (requests in post order, then responses) and
 *    one receiver thread (requests: checked and placed; responses: matched
 *    to the oldest outstanding request), so delivery is ordered per QP;
 *  - the responder checks every rkey: known, same PD, access rights of MR
 *    and QP, [addr, addr + len) inside the region; a bad one is NAKed and
 *    the requester completes with IBV_WC_REM_ACCESS_ERR and enters ERR, the
 *    responder executes nothing after it and enters ERR once its NAK is out;
 *  - WRITE_WITH_IMM and SEND consume a posted receive; with none posted
 *    the responder waits (receiver not ready) min_rnr_timer ms per retry,
 *    rnr_retry times (7: forever), then NAKs: IBV_WC_RNR_RETRY_EXC_ERR;
 *  - posting in a state that does not allow it fails with EINVAL; posting
 *    to a QP in ERR completes with IBV_WC_WR_FLUSH_ERR;
 *  - a dead peer (EOF on the socket) puts the QP in ERR: the oldest
 *    outstanding request completes with IBV_WC_RETRY_EXC_ERR, the rest and
 *    every posted receive with IBV_WC_WR_FLUSH_ERR.
 * Devices: UCCL_IBV_EMU_DEVICES (comma-separated names, default "emu0";
 * empty: none); UCCL_IBV_EMU_PORT_DOWN=<name>|all makes ports DOWN.  Each
 * has one Ethernet port with GID 0 fe80::1 (RoCE v1) and GID 1
 * ::ffff:127.0.0.1 (RoCE v2).
 *
 * This file: devices, contexts, protection domains, memory regions and
 * completion queues; ibv_emu_qp.c: queue pairs; ibv_emu_sock.c: their
 * socket I/O (ibv_emu.h: what they share). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ibv_emu.h"

#define MAX_DEVS 8

/* ---- devices ------------------------------------------------------------------ */

static struct ibv_device_s devs[MAX_DEVS];

EXPORT struct ibv_device_s **ibv_get_device_list(int *num)
{
    const char *env = getenv("UCCL_IBV_EMU_DEVICES");
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", env ? env : "emu0");
    struct ibv_device_s **list = calloc(MAX_DEVS + 1, sizeof(*list));
    if (!list) {
        errno = ENOMEM;
        return NULL;
    }
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < MAX_DEVS; t = strtok_r(NULL, ",", &save)) {
        if (!*t)
            continue;
        memset(&devs[n], 0, sizeof(devs[n]));
        devs[n].node_type = 1;  /* CA */
        devs[n].transport_type = 0; /* IB (RoCE reports IB transport) */
        snprintf(devs[n].name, sizeof(devs[n].name), "%s", t);
        snprintf(devs[n].dev_name, sizeof(devs[n].dev_name), "uverbs%d", n);
        list[n] = &devs[n];
        n++;
    }
    if (num)
        *num = n;
    return list;
}

EXPORT void ibv_free_device_list(struct ibv_device_s **list) { free(list); }
EXPORT const char *ibv_get_device_name(struct ibv_device_s *d) { return d ? d->name : NULL; }

/* ---- objects --------------------------------------------------------------- */
struct emu_ctx { struct ibv_context_s c; };
struct emu_pd { struct ibv_pd_s pd; };
struct emu_cq {
    struct ibv_cq_s cq;
    pthread_mutex_t mu;
    struct ibv_wc_s *v;
    size_t cap, head, n;
};

pthread_rwlock_t emu_mr_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct emu_mr *mrs;

static int poll_cq(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc);
static int req_notify(struct ibv_cq_s *cq, int solicited) { (void)cq; (void)solicited; return 0; }

EXPORT struct ibv_context_s *ibv_open_device(struct ibv_device_s *dev)
{
    struct emu_ctx *e = calloc(1, sizeof(*e));
    if (!e) {
        errno = ENOMEM;
        return NULL;
    }
    e->c.device = dev;
    e->c.ops.poll_cq = poll_cq;
    e->c.ops.req_notify_cq = req_notify;
    e->c.ops.post_send = emu_post_send;
    e->c.ops.post_recv = emu_post_recv;
    e->c.cmd_fd = e->c.async_fd = -1;
    e->c.num_comp_vectors = 1;
    pthread_mutex_init(&e->c.mutex, NULL);
    return &e->c;
}

EXPORT int ibv_close_device(struct ibv_context_s *c)
{
    pthread_mutex_destroy(&c->mutex);
    free(c);
    return 0;
}

static int port_down(const struct ibv_context_s *c)
{
    const char *d = getenv("UCCL_IBV_EMU_PORT_DOWN");
    return d && (strcmp(d, "all") == 0 || strcmp(d, c->device->name) == 0);
}

EXPORT int ibv_query_port(struct ibv_context_s *c, uint8_t port, struct ibv_port_attr_s *a)
{
    if (port != 1)
        return EINVAL;
    /* The compat prefix only (up to link_layer and flags), as the real
     * exported symbol writes; the caller zeroed the rest. */
    memset(a, 0, offsetof(struct ibv_port_attr_s, port_cap_flags2));
    a->state = port_down(c) ? 1 : IBV_PORT_ACTIVE_;
    a->max_mtu = 5;
    a->active_mtu = 3;
    a->gid_tbl_len = 2;
    a->max_msg_sz = 1u << 31;
    a->pkey_tbl_len = 1;
    a->link_layer = IBV_LINK_LAYER_ETHERNET_;
    a->phys_state = a->state == IBV_PORT_ACTIVE_ ? 5 : 3;
    return 0;
}

static void gid_of(int index, union ibv_gid_u *g)
{
    memset(g, 0, sizeof(*g));
    if (index == 0) {
        g->raw[0] = 0xfe;
        g->raw[1] = 0x80;
        g->raw[15] = 1;
    } else {
        g->raw[10] = g->raw[11] = 0xff;
        g->raw[12] = 127;
        g->raw[15] = 1;
    }
}

EXPORT int ibv_query_gid(struct ibv_context_s *c, uint8_t port, int index, union ibv_gid_u *g)
{
    (void)c;
    if (port != 1 || index < 0 || index > 1)
        return -1;
    gid_of(index, g);
    return 0;
}

EXPORT int _ibv_query_gid_ex(struct ibv_context_s *c, uint32_t port, uint32_t index,
                             struct ibv_gid_entry_s *e, uint32_t flags, size_t size)
{
    (void)c;
    if (flags || size < sizeof(*e))
        return EINVAL;
    if (port != 1 || index > 1)
        return ENODATA;
    memset(e, 0, sizeof(*e));
    gid_of((int)index, &e->gid);
    e->gid_index = index;
    e->port_num = port;
    e->gid_type = index == 0 ? IBV_GID_TYPE_ROCE_V1_ : IBV_GID_TYPE_ROCE_V2_;
    return 0;
}

EXPORT struct ibv_pd_s *ibv_alloc_pd(struct ibv_context_s *c)
{
    struct emu_pd *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->pd.context = c;
    return &p->pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd_s *pd)
{
    free(pd);
    return 0;
}

uint32_t emu_random_key(void)
{
    uint32_t k = 0;
    while (k == 0 && getrandom(&k, sizeof(k), 0) != sizeof(k))
        ;
    return k ? k : 1;
}

/* Can this process's CPU read [addr, +len)?  A NIC without GPUDirect
 * (nvidia-peermem) cannot register device memory either: ibv_reg_mr fails
 * with EFAULT, and the engine stages through host memory.  The first and
 * last byte stand for the range (device memory is never CPU-mapped). */
static int cpu_readable(const void *addr, size_t len)
{
    if (!len)
        return 1;
    char b;
    const char *ends[2] = {addr, (const char *)addr + len - 1};
    for (int i = 0; i < 2; i++) {
        struct iovec to = {&b, 1}, from = {(void *)ends[i], 1};
        /* only EFAULT says "not mapped"; where the call itself is refused
         * (seccomp, ENOSYS/EPERM) nothing is known: take the range */
        if (process_vm_readv(getpid(), &to, 1, &from, 1, 0) != 1 && errno == EFAULT)
            return 0;
    }
    return 1;
}

EXPORT struct ibv_mr_s *ibv_reg_mr(struct ibv_pd_s *pd, void *addr, size_t len, int access)
{
    if ((!addr && len) || !cpu_readable(addr, len)) {
        errno = EFAULT;
        return NULL;
    }
    /* Remote write needs local write, as verbs require. */
    if ((access & IBV_ACCESS_REMOTE_WRITE_) && !(access & IBV_ACCESS_LOCAL_WRITE_)) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_mr *m = calloc(1, sizeof(*m));
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = addr;
    m->mr.length = len;
    m->access = access;
    pthread_rwlock_wrlock(&emu_mr_lock);
    for (;;) { /* unique keys: a stale or foreign key never names a live region */
        uint32_t k = emu_random_key();
        struct emu_mr *o = mrs;
        while (o && o->mr.rkey != k)
            o = o->next;
        if (!o) {
            m->mr.lkey = m->mr.rkey = k;
            break;
        }
    }
    m->next = mrs;
    mrs = m;
    pthread_rwlock_unlock(&emu_mr_lock);
    return &m->mr;
}

EXPORT int ibv_dereg_mr(struct ibv_mr_s *mr)
{
    pthread_rwlock_wrlock(&emu_mr_lock); /* waits for copies into it under way */
    for (struct emu_mr **p = &mrs; *p; p = &(*p)->next)
        if (&(*p)->mr == mr) {
            *p = (*p)->next;
            break;
        }
    pthread_rwlock_unlock(&emu_mr_lock);
    free(mr);
    return 0;
}

struct emu_mr *emu_mr_check(struct ibv_pd_s *pd, uint32_t key, uint64_t addr, uint64_t len,
                               int need)
{
    for (struct emu_mr *m = mrs; m; m = m->next) {
        if (m->mr.rkey != key)
            continue;
        uint64_t lo = (uint64_t)(uintptr_t)m->mr.addr;
        if (m->mr.pd != pd || (m->access & need) != need || addr < lo ||
            len > m->mr.length || addr - lo > m->mr.length - len)
            return NULL;
        return m;
    }
    return NULL;
}

/* ---- completion queues ------------------------------------------------------ */
EXPORT struct ibv_cq_s *ibv_create_cq(struct ibv_context_s *c, int cqe, void *cq_ctx,
                                      void *channel, int vec)
{
    (void)vec;
    if (cqe < 1 || channel) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_cq *q = calloc(1, sizeof(*q));
    if (!q) {
        errno = ENOMEM;
        return NULL;
    }
    q->cq.context = c;
    q->cq.cq_context = cq_ctx;
    q->cq.cqe = cqe;
    pthread_mutex_init(&q->mu, NULL);
    return &q->cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq_s *cq)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_destroy(&q->mu);
    free(q->v);
    free(q);
    return 0;
}

void emu_cq_push(struct ibv_cq_s *cq, const struct ibv_wc_s *wc)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_lock(&q->mu);
    if (q->n == q->cap) { /* grow rather than overrun: tests read every entry */
        size_t cap = q->cap ? q->cap * 2 : 64;
        struct ibv_wc_s *v = malloc(cap * sizeof(*v));
        if (!v) {
            pthread_mutex_unlock(&q->mu);
            return;
        }
        for (size_t i = 0; i < q->n; i++)
            v[i] = q->v[(q->head + i) % q->cap];
        free(q->v);
        q->v = v;
        q->cap = cap;
        q->head = 0;
    }
    q->v[(q->head + q->n) % q->cap] = *wc;
    q->n++;
    pthread_mutex_unlock(&q->mu);
}

static int poll_cq(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    int got = 0;
    pthread_mutex_lock(&q->mu);
    while (got < num && q->n > 0) {
        wc[got++] = q->v[q->head];
        q->head = (q->head + 1) % q->cap;
        q->n--;
    }
    pthread_mutex_unlock(&q->mu);
    return got;
}

