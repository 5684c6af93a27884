// uccl_ring.cuh: GPU-initiated transfers on a uccl_collective GPU ring.
//
// A kernel gets the ring as `const uccl_ring_dev *` (GpuRing.device_ptr,
// passed as a 64-bit argument) and calls:
//
//   long long seq = uccl_ring_put(r, dst, src_off, dst_off, len);
//       copy len bytes from the ring's source region at src_off into
//       destination dst's window at dst_off.  Waits while the ring is full.
//       Returns the command's sequence number (>= 0), or a negative
//       UCCL_RING_E* code.  The thread's earlier writes (the source bytes)
//       are made visible to the host and the copy engine first.
//   long long seq = uccl_ring_try_put(r, dst, src_off, dst_off, len);
//       the same, but UCCL_RING_EFULL instead of waiting for a free slot.
//   int rc = uccl_ring_wait(r, seq);
//       wait until command seq (and every one before it) is complete: its
//       bytes are at the destination.  0, or a negative UCCL_RING_E* code.
//   unsigned long long n = uccl_ring_done(r);   commands completed so far.
//
// Any number of threads, warps and blocks may enqueue at once; commands run
// in the order of their sequence numbers, each exactly once.  Needs sm_70+.
// The layout below is csrc/ring/ring.h's, byte for byte.
//
// A put that times out (UCCL_RING_ETIMEOUT; e.g. a ring paused longer than
// the endpoint's timeout) leaves its ticket unused: the ring stops there,
// and the proxy fails it with that reason (GpuRing.wait raises it).
#pragma once

struct uccl_ring_cmd {
    unsigned long long seq;      // ticket + 1 once the command is whole; written last
    unsigned long long src_off;
    unsigned long long dst_off;
    unsigned long long len;
    unsigned int dst;
    unsigned int flags;          // 0
    unsigned long long pad[3];
};

struct uccl_ring_dev {
    unsigned long long magic;
    unsigned long long slots;    // device address of nslots commands (host-mapped memory)
    unsigned long long ticket;   // device memory: the next ticket
    unsigned long long head;     // host-written: commands the proxy has taken
    unsigned long long done;     // host-written: commands completed, in sequence
    unsigned long long error;    // host-written: 0, or 1 + the seq of the command that failed
    unsigned int nslots;         // a power of two
    unsigned int ndst;
    unsigned long long src_len;
    unsigned long long timeout_ns;
    unsigned long long cache;    // device memory: a uccl_ring_cache
    unsigned long long stuck;    // host-mapped: 1 + a ticket whose thread gave up (below)
    unsigned long long pad[5];
};
static_assert(sizeof(uccl_ring_cmd) == 64, "csrc/ring/ring.h's layout");
static_assert(sizeof(uccl_ring_dev) == 128, "csrc/ring/ring.h's layout");

// Device-memory copies of the host-written counters.  Many waiting threads
// read these (L2), and one thread at a time, at most every
// UCCL_RING_REFRESH_NS, reads the host's over PCIe and raises them: a
// thousand threads polling host memory each would flood PCIe and slow the
// very transfers they wait for (measured: 1.8 ms per command instead of
// microseconds).
struct uccl_ring_cache {
    unsigned long long head, done;
    unsigned long long error_inv;  // ~error: the proxy may lower error (an earlier command
                                   // failing later), and atomicMax of ~error keeps the lowest
    unsigned long long stamp;
};
#ifndef UCCL_RING_REFRESH_NS
#define UCCL_RING_REFRESH_NS 500ULL
#endif

#define UCCL_RING_EFAILED (-1LL)   // the ring failed (a command or transfer failed)
#define UCCL_RING_ETIMEOUT (-2LL)  // waited longer than the endpoint's timeout
#define UCCL_RING_EFULL (-3LL)     // try_put: no free slot
#define UCCL_RING_EINVAL (-4LL)    // a bad destination or range, seen before enqueueing

// Loads of what the host writes: acquire at system scope, so that reads
// after them see what the host wrote before (PTX ISA memory model, sm_70+).
__device__ __forceinline__ unsigned long long uccl_ring_load(unsigned long long addr)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long uccl_ring_load_gpu(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long uccl_ring_now()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Refresh the cache from the host's counters if nobody did for
// UCCL_RING_REFRESH_NS (or `force`).  The host's are read with acquire at
// system scope, and published with a fence before the atomicMax, so a thread
// that reads the cache with acquire sees what the proxy did before them.
__device__ __forceinline__ void uccl_ring_refresh_(const uccl_ring_dev *r, bool force)
{
    uccl_ring_cache *c = (uccl_ring_cache *)r->cache;
    unsigned long long now = uccl_ring_now();
    unsigned long long last = *(volatile unsigned long long *)&c->stamp;
    if (!force && (now - last < UCCL_RING_REFRESH_NS || atomicCAS(&c->stamp, last, now) != last))
        return;
    unsigned long long head = uccl_ring_load(r->head), done = uccl_ring_load(r->done);
    unsigned long long err = uccl_ring_load(r->error);
    __threadfence();
    atomicMax(&c->head, head);
    atomicMax(&c->done, done);
    if (err)
        atomicMax(&c->error_inv, ~err);
}

// 0, or 1 + the first command that failed (as the kernels last saw it).
__device__ __forceinline__ unsigned long long uccl_ring_error_(uccl_ring_cache *c)
{
    unsigned long long inv = uccl_ring_load_gpu(&c->error_inv);
    return inv ? ~inv : 0;
}

// Commands completed so far (read from the host now).
__device__ __forceinline__ unsigned long long uccl_ring_done(const uccl_ring_dev *r)
{
    uccl_ring_refresh_(r, true);
    return uccl_ring_load_gpu(&((uccl_ring_cache *)r->cache)->done);
}

// One round of a wait: refresh the counters if due, then sleep, longer the
// longer the thread has waited (to 2 us).  false once the wait has lasted
// longer than the ring's timeout.
__device__ __forceinline__ bool uccl_ring_pause_(const uccl_ring_dev *r,
                                                 unsigned long long *start, unsigned *ns)
{
    uccl_ring_refresh_(r, false);
    unsigned long long now = uccl_ring_now();
    if (!*start)
        *start = now;
    else if (now - *start > r->timeout_ns)
        return false;
    __nanosleep(*ns);
    if (*ns < 2048)
        *ns *= 2;
    return true;
}

// Fill slot t and publish it: the fields, then a system-scope fence, then
// seq.  The fence also orders this thread's earlier writes to the source
// region before the proxy can see the command.
__device__ __forceinline__ void uccl_ring_fill_(const uccl_ring_dev *r, unsigned long long t,
                                                unsigned dst, unsigned long long src_off,
                                                unsigned long long dst_off,
                                                unsigned long long len)
{
    volatile uccl_ring_cmd *s = (volatile uccl_ring_cmd *)r->slots + (t & (r->nslots - 1));
    s->src_off = src_off;
    s->dst_off = dst_off;
    s->len = len;
    s->dst = dst;
    s->flags = 0;
    __threadfence_system();
    s->seq = t + 1;
}

__device__ __forceinline__ bool uccl_ring_bad_(const uccl_ring_dev *r, unsigned dst,
                                               unsigned long long src_off,
                                               unsigned long long len)
{
    return dst >= r->ndst || len > r->src_len || src_off > r->src_len - len;
}

__device__ __forceinline__ long long uccl_ring_put(const uccl_ring_dev *r, unsigned dst,
                                                   unsigned long long src_off,
                                                   unsigned long long dst_off,
                                                   unsigned long long len)
{
    if (uccl_ring_bad_(r, dst, src_off, len))
        return UCCL_RING_EINVAL;
    unsigned long long t = atomicAdd((unsigned long long *)r->ticket, 1ULL);
    uccl_ring_cache *c = (uccl_ring_cache *)r->cache;
    unsigned long long start = 0;
    unsigned ns = 64;
    while (t >= uccl_ring_load_gpu(&c->head) + r->nslots) { // full: wait for the proxy
        if (uccl_ring_error_(c))
            return UCCL_RING_EFAILED;
        if (!uccl_ring_pause_(r, &start, &ns)) {
            // ticket t's slot will never be filled: tell the proxy, which
            // stops the ring there (and the host hears why)
            *(volatile unsigned long long *)r->stuck = t + 1;
            __threadfence_system();
            return UCCL_RING_ETIMEOUT;
        }
    }
    uccl_ring_fill_(r, t, dst, src_off, dst_off, len);
    return (long long)t;
}

__device__ __forceinline__ long long uccl_ring_try_put(const uccl_ring_dev *r, unsigned dst,
                                                       unsigned long long src_off,
                                                       unsigned long long dst_off,
                                                       unsigned long long len)
{
    if (uccl_ring_bad_(r, dst, src_off, len))
        return UCCL_RING_EINVAL;
    unsigned long long *ticket = (unsigned long long *)r->ticket;
    uccl_ring_cache *c = (uccl_ring_cache *)r->cache;
    unsigned long long t = *(volatile unsigned long long *)ticket;
    for (;;) { // take ticket t only if its slot is free now: no ticket is left unused
        if (t >= uccl_ring_load_gpu(&c->head) + r->nslots)
            uccl_ring_refresh_(r, true); // "full" is told from the host's own count
        if (uccl_ring_error_(c))
            return UCCL_RING_EFAILED;
        if (t >= uccl_ring_load_gpu(&c->head) + r->nslots)
            return UCCL_RING_EFULL;
        unsigned long long seen = atomicCAS(ticket, t, t + 1);
        if (seen == t)
            break;
        t = seen;
    }
    uccl_ring_fill_(r, t, dst, src_off, dst_off, len);
    return (long long)t;
}

__device__ __forceinline__ int uccl_ring_wait(const uccl_ring_dev *r, long long seq)
{
    if (seq < 0)
        return (int)seq;
    uccl_ring_cache *c = (uccl_ring_cache *)r->cache;
    unsigned long long start = 0;
    unsigned ns = 64;
    while (uccl_ring_load_gpu(&c->done) <= (unsigned long long)seq) {
        unsigned long long err = uccl_ring_error_(c); // 1 + the first failed seq
        if (err && err - 1 <= (unsigned long long)seq)
            return (int)UCCL_RING_EFAILED;
        if (!uccl_ring_pause_(r, &start, &ns))
            return (int)UCCL_RING_ETIMEOUT;
    }
    return 0;
}
