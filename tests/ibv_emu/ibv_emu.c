/* A userspace emulation of libibverbs.so.1, for tests only.
 *
 * No machine here has an RDMA device, so the engine's RDMA transport is
 * exercised against this library, loaded through UCCL_IBVERBS_LIB.  It is
 * binary-compatible with libibverbs for every call it implements: the same
 * struct layouts (declared by the engine's csrc/load/ibv_loader.h, whose offsets
 * are checked there against rdma-core's), the context ops table through
 * which verbs.h's inline data path calls, and the symbol versions
 * (ibv_emu.map).
 *
 * Semantics are those of RC queue pairs between processes:
 *  - each QP has a 24-bit number unique in its network namespace: it names
 *    an abstract Unix socket (bind() is the uniqueness check), or, with
 *    UCCL_IBV_EMU_IPV4, carries the TCP port it listens on at that address
 *    (which joins QPs across namespaces and hosts); at RTR the QP with the
 *    lower number (and address) connects to its peer's socket, the other
 *    accepts;
 *  - per QP one sender thread (requests in post order, then responses) and
 *    one receiver thread (requests: checked and placed; responses: matched
 *    to the oldest outstanding request), so delivery is ordered per QP;
 *  - the responder checks every rkey: known, same PD, access rights of MR
 *    and QP, [addr, addr + len) inside the region; a bad one is NAKed and
 *    the requester completes with IBV_WC_REM_ACCESS_ERR and enters ERR, the
 *    responder executes nothing after it and enters ERR once its NAK is out;
 *  - WRITE_WITH_IMM and SEND consume a posted receive; with none posted
 *    the responder waits (receiver not ready) the responder's min_rnr_timer
 *    (the IB spec's timer codes) per retry, as many retries as the
 *    requester's rnr_retry (7: forever), then NAKs: IBV_WC_RNR_RETRY_EXC_ERR;
 *  - posting in a state that does not allow it fails with EINVAL; posting
 *    to a QP in ERR completes with IBV_WC_WR_FLUSH_ERR; a QP entering ERR
 *    flushes every outstanding send and posted receive the same way;
 *  - a dead peer (EOF on the socket) is noticed, as on a fabric, only by a
 *    request of ours: the oldest outstanding (or next posted) completes
 *    with IBV_WC_RETRY_EXC_ERR and the QP enters ERR, flushing the rest and
 *    every posted receive with IBV_WC_WR_FLUSH_ERR; a QP with nothing to
 *    send keeps its state and its posted receives.
 * Devices: UCCL_IBV_EMU_DEVICES (comma-separated names, default "emu0";
 * empty: none); UCCL_IBV_EMU_PORT_DOWN=<name>|all makes ports DOWN.  Each
 * has one Ethernet port with GID 0 fe80::1 (RoCE v1) and GID 1
 * ::ffff:<UCCL_IBV_EMU_IPV4, else 127.0.0.1> (RoCE v2).
 *
 * rdma-core's own programs (ibv_devices, ibv_devinfo, ibv_rc_pingpong) run
 * on it unchanged: it also exports what they import (device queries, the
 * node GUID, completion channels and CQ events, ibv_query_qp,
 * ibv_wc_status_str, ...), each at rdma-core's symbol version.
 *
 * This file: protection domains and memory regions; ibv_emu_device.c:
 * devices, contexts and their queries; ibv_emu_cq.c: completion queues and
 * channels; ibv_emu_qp.c: queue pairs, ibv_emu_wire.c: the wire between
 * them, ibv_emu_sock.c: its socket I/O (ibv_emu.h: what they share). */
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

/* ---- protection domains and memory regions ------------------------------- */
struct emu_pd { struct ibv_pd_s pd; };

pthread_rwlock_t emu_mr_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct emu_mr *mrs;

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

