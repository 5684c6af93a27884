/* Command rings for GPU-initiated transfers, and the proxy that drains
 * them (ring.h).
 *
 * Memory: one block of page-locked host memory mapped for the GPU holds
 * the proxy's counters (struct uccl_ring_ctr, one cache line each) and the
 * slots; device memory holds the kernel's descriptor (struct
 * uccl_ring_dev: read by every enqueue, so cached, not a PCIe read) and
 * the ticket counter, which only GPU threads touch (atomics on mapped host
 * memory are not guaranteed across PCIe).
 *
 * The protocol, and the memory order each step relies on:
 *  - a GPU thread takes ticket t = atomicAdd(ticket, 1), waits until
 *    t < head + nslots (the slot is free: the proxy has read what was there
 *    before), writes the command's fields, __threadfence_system() (the
 *    fields, and the data the thread wrote into the source region, become
 *    visible to the host and the copy engine before what follows), then
 *    writes slot.seq = t + 1 with a volatile store;
 *  - the proxy reads slot[taken % nslots].seq with acquire; when it equals
 *    taken + 1 the fields after it are whole (the GPU's fence ordered them
 *    before the seq, and acquire keeps the proxy's reads after it); it
 *    copies them, then publishes head = taken + 1 with release, so a GPU
 *    thread that reads the new head may reuse the slot;
 *  - the proxy issues commands in sequence and retires them in sequence:
 *    done counts completed commands, written with release once the
 *    transfer is complete (bytes in place at the destination); a host
 *    waiter reads it with acquire; on the GPU one thread at a time reads it
 *    with ld.acquire.sys and raises a device-memory copy after a fence, and
 *    waiting threads read that copy with ld.acquire.gpu (uccl_ring.cuh);
 *  - a GPU thread that gives up waiting for its slot writes 1 + its ticket
 *    into `stuck`: the proxy, idle at that ticket, fails the ring there.
 * Back-pressure is the ring itself: the proxy keeps at most `inflight`
 * commands in flight and takes no more until one retires, so the slots
 * fill and enqueuers wait (uccl_ring_put) or are told (try_put).  Two
 * commands in flight to overlapping ranges of one destination are ordered:
 * the later one waits for the earlier to finish, so in-sequence holds for
 * the bytes too.  A failure (a bad command, a failed transfer) stops the
 * ring: error = 1 + the failed command's seq, which device waits and host
 * waits report; nothing after it is taken. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "ring/ring.h"
#include "base/config.h"
#include "base/status.h"

_Static_assert(sizeof(struct uccl_ring_cmd) == 64, "ring command layout");
_Static_assert(sizeof(struct uccl_ring_dev) == 128, "ring descriptor layout");
_Static_assert(sizeof(struct uccl_ring_ctr) == 256, "ring counters layout");

/* FL_QUEUED: a copy between device memory of the ring's GPU, queued on the
 * proxy's copy stream with no event of its own: one mark per burst of
 * commands covers every copy queued before it (they run in order). */
enum { FL_NOOP = 0, FL_REMOTE = 1, FL_LOCAL = 2, FL_QUEUED = 3 };

struct qmark {
    uint64_t last;            /* the last command the mark covers */
    void *mark;
};

struct inflight {
    uint64_t seq, n, dst_off, len, xfer; /* n: commands seq.. it covers (a batch: REMOTE) */
    uint64_t posted_ns;       /* FL_REMOTE: when it was posted (its deadline's start) */
    uint32_t dst;
    int kind;
    void *mark;               /* FL_LOCAL: the copy's stream mark (NULL: done at once) */
};

struct dst_state {
    int kind;
    uint64_t conn;
    uint64_t window, token, waddr, wlen, wbase; /* REMOTE: the peer's window */
    uintptr_t addr;           /* LOCAL */
    size_t len;
    int queued;               /* LOCAL device memory of the ring's GPU, as the source */
};

struct uccl__ring {
    uccl_ep_t *ep;
    int dev;
    void *host;               /* the mapped block: counters, then the slots */
    uint64_t host_dev;        /* its device address */
    uint64_t dev_block;       /* device memory: the descriptor, then the ticket */
    volatile struct uccl_ring_ctr *ctr;
    volatile struct uccl_ring_cmd *slots;
    uint64_t ticket_dev;
    unsigned nslots, inflight_max, ndst;
    uint64_t src_mr;
    uintptr_t src_addr;
    size_t src_len;
    struct dst_state *dsts;
    struct inflight *fl;      /* circular, inflight_max entries */
    unsigned fl_first, fl_n;
    struct qmark *qm;         /* circular, inflight_max: marks over FL_QUEUED copies */
    unsigned qm_first, qm_n;
    uint64_t queued_last;     /* the last FL_QUEUED command */
    int queued_unmarked;      /* FL_QUEUED commands since the last mark */
    uint64_t taken, done;     /* the proxy's own copies of head and done */
    uint64_t batch_bytes;     /* UCCL_RING_BATCH_BYTES: the largest write a batch makes */
    atomic_ullong posts;      /* transfers and copies started (uccl_ring_stats) */
    uint64_t timeout_ns, spin_ns;
    pthread_t proxy;
    int proxy_started;
    atomic_int stop, paused, failed;
    pthread_mutex_t err_mu;   /* err: written by the proxy, read by host waiters */
    char err[512];            /* why the ring stopped, at fail_seq */
    uint64_t fail_seq;        /* the lowest command that failed (proxy thread only) */
    uint64_t *trace;
    size_t trace_len;
    atomic_size_t trace_n;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void nap(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    nanosleep(&ts, NULL);
}

static uint64_t load_acq(volatile uint64_t *p)
{
    return atomic_load_explicit((volatile _Atomic uint64_t *)p, memory_order_acquire);
}

static void store_rel(volatile uint64_t *p, uint64_t v)
{
    atomic_store_explicit((volatile _Atomic uint64_t *)p, v, memory_order_release);
}

/* The ring stops at command seq: the message for host waiters, the error
 * word for device waiters. */
static void ring_fail(struct uccl__ring *r, uint64_t seq, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void ring_fail(struct uccl__ring *r, uint64_t seq, const char *fmt, ...)
{
    /* the first failure, or an earlier command failing later: that one is
     * where the ring stopped, and its reason is the one told */
    if (atomic_load(&r->failed) && seq >= r->fail_seq)
        return;
    char msg[sizeof(r->err)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    LOG_WARN("GPU ring: %s", msg);
    pthread_mutex_lock(&r->err_mu);
    memcpy(r->err, msg, sizeof(msg));
    pthread_mutex_unlock(&r->err_mu);
    r->fail_seq = seq;
    atomic_store(&r->failed, 1);
    store_rel(&r->ctr->error, seq + 1);
}

/* ---- in flight ------------------------------------------------------------ */

static struct inflight *fl_at(struct uccl__ring *r, unsigned i)
{
    return &r->fl[(r->fl_first + i) % r->inflight_max];
}

/* A mark over the FL_QUEUED copies queued since the last one. */
static int mark_queued(struct uccl__ring *r)
{
    void *m = NULL;
    int rc = uccl_gpu_copy_queue_mark(r->dev, &m);
    if (rc)
        return rc;
    r->qm[(r->qm_first + r->qm_n) % r->inflight_max] = (struct qmark){r->queued_last, m};
    r->qm_n++;
    r->queued_unmarked = 0;
    return UCCL_OK;
}

/* Retire the oldest command if it is done (wait: until it is, or fails).
 * 1 retired, 0 not yet; a failure fails the ring and retires it too (its
 * transfer can no longer write); done counts on only for commands before
 * the one that failed. */
static int retire_oldest(struct uccl__ring *r, int wait)
{
    struct inflight *f = fl_at(r, 0);
    int rc = UCCL_OK, finished = 1;
    if (f->kind == FL_REMOTE) {
        int d = 0;
        if (wait) {
            rc = uccl_ep_wait(r->ep, f->xfer, now_ns() + r->timeout_ns, r->timeout_ns);
            d = rc == UCCL_OK;
        } else {
            rc = uccl_ep_poll(r->ep, f->xfer, &d);
            /* a peer that stalls (stopped, or its engine wedged) never
             * finishes the write: past the timeout, a wait whose deadline
             * has passed fails its connection, so the ring fails here and
             * later puts fail at once, not each after its own timeout */
            if (rc == UCCL_OK && !d && now_ns() - f->posted_ns > r->timeout_ns)
                rc = uccl_ep_wait(r->ep, f->xfer, f->posted_ns + r->timeout_ns, 0);
        }
        finished = rc != UCCL_OK || d;
        if (finished)
            uccl_ep_release(r->ep, f->xfer);
    } else if (f->kind == FL_QUEUED) {
        /* its mark: the first one left (marks are popped with the last
         * command they cover), made now if none covers it yet */
        if (r->queued_unmarked && (!r->qm_n || r->qm[(r->qm_first + r->qm_n - 1) %
                                                     r->inflight_max].last < f->seq))
            rc = mark_queued(r);
        if (rc == UCCL_OK && !r->qm_n)
            rc = uccl__err(UCCL_ERR_IO, "no event covers this queued copy");
        if (rc == UCCL_OK) {
            struct qmark *q = &r->qm[r->qm_first];
            int p = wait ? (uccl_stream_mark_wait(q->mark, r->timeout_ns) == UCCL_OK ? 1 : -1)
                         : uccl_stream_mark_poll(q->mark);
            finished = p != 0;
            rc = p < 0 ? UCCL_ERR_IO : UCCL_OK; /* the later commands it covers see it too */
            if (finished && q->last == f->seq) {
                uccl_stream_mark_free(q->mark);
                r->qm_first = (r->qm_first + 1) % r->inflight_max;
                r->qm_n--;
            }
        }
    } else if (f->kind == FL_LOCAL && f->mark) {
        int p = wait ? (uccl_stream_mark_wait(f->mark, r->timeout_ns) == UCCL_OK ? 1 : -1)
                     : uccl_stream_mark_poll(f->mark);
        finished = p != 0;
        rc = p < 0 ? UCCL_ERR_IO : UCCL_OK;
        if (finished)
            uccl_stream_mark_free(f->mark);
    }
    if (!finished)
        return 0;
    if (rc != UCCL_OK && f->n > 1)
        ring_fail(r, f->seq, "commands %llu to %llu, written as one (destination %u, %llu bytes "
                  "at offset %llu), failed: %s", (unsigned long long)f->seq,
                  (unsigned long long)(f->seq + f->n - 1), f->dst, (unsigned long long)f->len,
                  (unsigned long long)f->dst_off, uccl_last_error());
    else if (rc != UCCL_OK)
        ring_fail(r, f->seq, "command %llu (destination %u, %llu bytes at offset %llu) "
                  "failed: %s", (unsigned long long)f->seq, f->dst,
                  (unsigned long long)f->len, (unsigned long long)f->dst_off,
                  uccl_last_error());
    else if (!atomic_load(&r->failed) || f->seq < r->fail_seq) {
        uint64_t n = atomic_load(&r->failed) && r->fail_seq - f->seq < f->n
                         ? r->fail_seq - f->seq : f->n; /* those before the failed one */
        store_rel(&r->ctr->done, r->done += n);
    }
    r->fl_first = (r->fl_first + 1) % r->inflight_max;
    r->fl_n--;
    return 1;
}

/* ---- taking and issuing -------------------------------------------------- */

/* UCCL_OK if c is a good command; else, where fail, the ring fails at seq. */
static int check_cmd(struct uccl__ring *r, const struct uccl_ring_cmd *c, uint64_t seq, int fail)
{
    const struct dst_state *d = c->dst < r->ndst ? &r->dsts[c->dst] : NULL;
    uint64_t room = !d ? 0 : d->kind == UCCL_RING_DST_LOCAL ? d->len : d->wlen;
    const char *bad = !d ? "no such destination"
                    : c->flags ? "flags must be 0"
                    : c->len > r->src_len || c->src_off > r->src_len - c->len
                        ? "the source range is outside the source region"
                    : c->len > room || c->dst_off > room - c->len
                        ? "the destination range is outside the destination's window" : NULL;
    if (!bad)
        return UCCL_OK;
    if (!fail)
        return UCCL_ERR_INVALID;
    ring_fail(r, seq, "command %llu: %s (destination %u of %u, source offset %llu, destination "
              "offset %llu, %llu bytes; source region %zu bytes, destination window %llu bytes)",
              (unsigned long long)seq, bad, c->dst, r->ndst, (unsigned long long)c->src_off,
              (unsigned long long)c->dst_off, (unsigned long long)c->len, r->src_len,
              (unsigned long long)room);
    return UCCL_ERR_INVALID;
}

static int overlaps_inflight(struct uccl__ring *r, const struct uccl_ring_cmd *c)
{
    for (unsigned i = 0; i < r->fl_n; i++) {
        const struct inflight *f = fl_at(r, i);
        if (f->kind != FL_NOOP && f->dst == c->dst && c->dst_off < f->dst_off + f->len &&
            f->dst_off < c->dst_off + c->len)
            return 1;
    }
    return 0;
}

/* Issue c, which stands for n commands from seq (a batch: one write). */
static void issue(struct uccl__ring *r, const struct uccl_ring_cmd *c, uint64_t seq, uint64_t n)
{
    while (c->len && overlaps_inflight(r, c)) /* the earlier write to these bytes first */
        retire_oldest(r, 1);
    if (atomic_load(&r->failed))
        return;
    struct inflight *f = fl_at(r, r->fl_n);
    *f = (struct inflight){.seq = seq, .n = n, .dst_off = c->dst_off, .len = c->len,
                           .dst = c->dst, .kind = FL_NOOP};
    const struct dst_state *d = &r->dsts[c->dst];
    uintptr_t src = r->src_addr + c->src_off;
    int rc = UCCL_OK;
    if (c->len && d->kind == UCCL_RING_DST_LOCAL && d->queued) {
        f->kind = FL_QUEUED;
        rc = uccl_gpu_copy_queue(r->dev, d->addr + c->dst_off, src, c->len);
        r->queued_last = seq;
        r->queued_unmarked = 1;
    } else if (c->len && d->kind == UCCL_RING_DST_LOCAL) {
        f->kind = FL_LOCAL;
        rc = uccl_ep_copy_start(r->ep, d->addr + c->dst_off, src, c->len, &f->mark);
    } else if (c->len) {
        uint8_t fifo[64];
        uccl_fifo_make(d->window, d->token, d->waddr + c->dst_off, c->len, d->wbase, fifo);
        f->kind = FL_REMOTE;
        f->posted_ns = now_ns();
        rc = uccl_ep_post(r->ep, UCCL_XFER_WRITE, d->conn, r->src_mr, src, c->len, fifo,
                          sizeof(fifo), UCCL_STREAM_NONE, &f->xfer);
    }
    if (rc != UCCL_OK) {
        if (n > 1)
            ring_fail(r, seq, "commands %llu to %llu, written as one (destination %u, %llu "
                      "bytes): %s", (unsigned long long)seq, (unsigned long long)(seq + n - 1),
                      c->dst, (unsigned long long)c->len, uccl_last_error());
        else
            ring_fail(r, seq, "command %llu (destination %u, %llu bytes): %s",
                      (unsigned long long)seq, c->dst, (unsigned long long)c->len,
                      uccl_last_error());
        return;
    }
    if (f->kind != FL_NOOP)
        atomic_fetch_add(&r->posts, 1);
    r->fl_n++;
    size_t tn = atomic_load(&r->trace_n);
    for (uint64_t i = 0; i < n && tn < r->trace_len; i++)
        r->trace[tn++] = seq + i;
    atomic_store(&r->trace_n, tn);
}

/* The command in the slot of r->taken into *c if it is whole (1), else 0. */
static int peek(struct uccl__ring *r, struct uccl_ring_cmd *c)
{
    volatile struct uccl_ring_cmd *s = &r->slots[r->taken & (r->nslots - 1)];
    if (load_acq(&s->seq) != r->taken + 1)
        return 0;
    *c = (struct uccl_ring_cmd){.seq = s->seq, .src_off = s->src_off, .dst_off = s->dst_off,
                                .len = s->len, .dst = s->dst, .flags = s->flags};
    return 1;
}

/* Whether n, taken right after c, extends it into one write: to the same
 * remote destination, both ranges following on, a good command, within
 * the batch's bytes. */
static int extends(struct uccl__ring *r, const struct uccl_ring_cmd *c,
                   const struct uccl_ring_cmd *n)
{
    return n->dst == c->dst && n->len && n->flags == 0 && n->src_off == c->src_off + c->len &&
           n->dst_off == c->dst_off + c->len && n->len <= r->batch_bytes - c->len &&
           check_cmd(r, n, r->taken, 0) == UCCL_OK;
}

/* Take the next command if it is whole (1 if one was taken), and with a
 * remote destination every whole command after it that extends it: the
 * proxy's cost is per write, not per byte (UCCL_RING_BATCH_BYTES). */
static int take(struct uccl__ring *r)
{
    struct uccl_ring_cmd c, n;
    if (!peek(r, &c))
        return 0;
    uint64_t seq = r->taken++, count = 1;
    if (check_cmd(r, &c, seq, 1) == UCCL_OK) {
        if (c.len && r->dsts[c.dst].kind == UCCL_RING_DST_REMOTE && c.len <= r->batch_bytes)
            while (!atomic_load(&r->paused) && peek(r, &n) && extends(r, &c, &n)) {
                c.len += n.len;
                r->taken++, count++;
            }
        store_rel(&r->ctr->head, r->taken); /* the slots are the GPU's again */
        issue(r, &c, seq, count);
    } else {
        store_rel(&r->ctr->head, r->taken);
    }
    return 1;
}

static void *proxy_main(void *arg)
{
    struct uccl__ring *r = arg;
    uint64_t idle_since = 0, step = 1000;
    while (!atomic_load(&r->stop)) {
        int busy = 0;
        while (r->fl_n && retire_oldest(r, 0))
            busy = 1;
        /* a burst: every whole command there is room for, then one mark
         * over the copies it queued */
        while (!atomic_load(&r->failed) && !atomic_load(&r->paused) &&
               r->fl_n < r->inflight_max && take(r))
            busy = 1;
        if (r->queued_unmarked && mark_queued(r) != UCCL_OK)
            ring_fail(r, r->queued_last, "command %llu: %s",
                      (unsigned long long)r->queued_last, uccl_last_error());
        if (busy) {
            idle_since = 0, step = 1000;
            continue;
        }
        uint64_t stuck = load_acq(&r->ctr->stuck);
        if (stuck && !atomic_load(&r->failed) && stuck - 1 >= r->taken)
            ring_fail(r, stuck - 1, "a GPU thread gave up waiting for a free slot (ticket %llu, "
                      "after the %.0f s timeout): that slot will never be filled, so the ring "
                      "stops there", (unsigned long long)(stuck - 1),
                      (double)r->timeout_ns / 1e9);
        if (r->fl_n && fl_at(r, 0)->kind == FL_REMOTE) {
            /* drive the connections from here, as a host waiter would:
             * their threads need not wake for each completion */
            uint64_t ids[64];
            int n = 0;
            for (unsigned i = 0; i < r->fl_n && n < 64; i++)
                if (fl_at(r, i)->kind == FL_REMOTE)
                    ids[n++] = fl_at(r, i)->xfer;
            uccl_ep_progress(r->ep, ids, n, 0, 50000);
            continue;
        }
        uint64_t t = now_ns();
        if (!idle_since)
            idle_since = t;
        if (t - idle_since < r->spin_ns) {
            sched_yield();
            continue;
        }
        nap(step); /* idle: sleep in growing steps, up to 50 us */
        if (step < 50000)
            step *= 2;
    }
    while (r->fl_n) /* stopping: nothing may still write once the ring is freed */
        retire_oldest(r, 1);
    return NULL;
}

/* ---- placement ------------------------------------------------------------ */

/* Run the calling thread on the CPUs of the GPU's NUMA node, where sysfs
 * tells it (no node, or one CPU list we cannot read: left as it is). */
static void place_near_gpu(int dev)
{
    char bdf[32], path[160], buf[1024];
    if (uccl_gpu_bus_id(dev, bdf) != UCCL_OK)
        return;
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", bdf);
    FILE *f = fopen(path, "r");
    int node = -1;
    if (f) {
        if (fscanf(f, "%d", &node) != 1)
            node = -1;
        fclose(f);
    }
    if (node < 0) {
        LOG_INFO("GPU ring proxy: GPU %d (%s) has no NUMA node in sysfs; not pinned", dev, bdf);
        return;
    }
    snprintf(path, sizeof(path), "/sys/devices/system/node/node%d/cpulist", node);
    f = fopen(path, "r");
    if (!f || !fgets(buf, sizeof(buf), f)) {
        if (f)
            fclose(f);
        return;
    }
    fclose(f);
    cpu_set_t set;
    CPU_ZERO(&set);
    for (char *p = buf; *p && *p != '\n';) { /* "0-15,32-47" */
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (end == p)
            return;
        if (*end == '-')
            hi = strtol(end + 1, &end, 10);
        for (long c = lo; c <= hi && c < CPU_SETSIZE; c++)
            CPU_SET((int)c, &set);
        p = *end == ',' ? end + 1 : end;
    }
    if (CPU_COUNT(&set) && pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0)
        LOG_INFO("GPU ring proxy: on NUMA node %d of GPU %d (cpus %.*s)", node, dev,
                 (int)strcspn(buf, "\n"), buf);
}

static void *proxy_start(void *arg)
{
    if (((struct uccl__ring *)arg)->dev >= 0)
        place_near_gpu(((struct uccl__ring *)arg)->dev);
    return proxy_main(arg);
}

/* ---- the API ---------------------------------------------------------------- */

static int dst_init(struct uccl__ring *r, unsigned i, const struct uccl_ring_dst *in)
{
    struct dst_state *d = &r->dsts[i];
    d->kind = in->kind;
    if (in->kind == UCCL_RING_DST_LOCAL) {
        if (!in->addr && in->len)
            return uccl__err(UCCL_ERR_INVALID, "ring destination %u: %zu bytes at address 0", i,
                             in->len);
        d->addr = in->addr, d->len = in->len;
        int kind, dev, skind, sdev; /* both device memory of the ring's GPU: queued copies */
        d->queued = in->len && r->src_len &&
                    uccl_mem_kind(in->addr, in->len, &kind, &dev) == UCCL_OK &&
                    uccl_mem_kind(r->src_addr, r->src_len, &skind, &sdev) == UCCL_OK &&
                    kind == 2 && skind == 2 && dev == r->dev && sdev == r->dev;
        return UCCL_OK;
    }
    if (in->kind != UCCL_RING_DST_REMOTE)
        return uccl__err(UCCL_ERR_INVALID, "ring destination %u: kind %d is neither local (%d) "
                         "nor remote (%d)", i, in->kind, UCCL_RING_DST_LOCAL,
                         UCCL_RING_DST_REMOTE);
    uint64_t f[5];
    if (uccl_fifo_read(in->fifo, sizeof(in->fifo), f) != UCCL_OK)
        return uccl__err(UCCL_ERR_INVALID, "ring destination %u: not a window descriptor: %s", i,
                         uccl_last_error());
    char tp[32];
    if (uccl_ep_conn_transport(r->ep, in->conn, tp, sizeof(tp)) != UCCL_OK)
        return uccl__err(UCCL_ERR_INVALID, "ring destination %u: %s", i, uccl_last_error());
    d->conn = in->conn;
    d->window = f[0], d->token = f[1], d->waddr = f[2], d->wlen = f[3];
    d->wbase = f[4] ? f[4] : f[2]; /* a range inside the window names where it starts */
    return UCCL_OK;
}

static int check_opts(const struct uccl_ring_opts *o)
{
    if (o->nslots < 2 || o->nslots > (1u << 20) || (o->nslots & (o->nslots - 1)))
        return uccl__err(UCCL_ERR_INVALID, "ring slots: %u is not a power of two in 2..%u",
                         o->nslots, 1u << 20);
    if (o->inflight < 1 || o->inflight > 1024)
        return uccl__err(UCCL_ERR_INVALID, "ring inflight: %u is not in 1..1024", o->inflight);
    if (o->ndst < 1 || o->ndst > 65536 || !o->dsts)
        return uccl__err(UCCL_ERR_INVALID, "ring destinations: %u given, 1..65536 needed",
                         o->ndst);
    if (o->src_len && !o->src_addr)
        return uccl__err(UCCL_ERR_INVALID, "ring source: %zu bytes at address 0", o->src_len);
    if (o->dev < UCCL_RING_HOST)
        return uccl__err(UCCL_ERR_INVALID, "ring: GPU %d (or %d: a host ring)", o->dev,
                         UCCL_RING_HOST);
    return UCCL_OK;
}

int uccl_ring_create(uccl_ep_t *ep, const struct uccl_ring_opts *o, uccl_ring_t **r_p)
{
    int rc = check_opts(o);
    if (rc)
        return rc;
    struct uccl__ring *r = calloc(1, sizeof(*r));
    if (!r)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    r->ep = ep, r->dev = o->dev, r->nslots = o->nslots, r->inflight_max = o->inflight;
    r->ndst = o->ndst, r->src_mr = o->src_mr, r->src_addr = o->src_addr, r->src_len = o->src_len;
    r->timeout_ns = uccl_ep_timeout_ns(ep);
    long spin_us = 0, batch = 0;
    int bad = uccl__cfg_long(UCCL_CFG_RING_SPIN_US, &spin_us);
    if (!bad)
        bad = uccl__cfg_long(UCCL_CFG_RING_BATCH_BYTES, &batch);
    r->spin_ns = (uint64_t)spin_us * 1000;
    r->batch_bytes = (uint64_t)batch;
    r->trace_len = o->trace_len;
    atomic_init(&r->paused, o->paused != 0);
    pthread_mutex_init(&r->err_mu, NULL);
    r->dsts = calloc(o->ndst, sizeof(*r->dsts));
    r->fl = calloc(o->inflight, sizeof(*r->fl));
    r->qm = calloc(o->inflight, sizeof(*r->qm));
    r->trace = o->trace_len ? calloc(o->trace_len, sizeof(*r->trace)) : NULL;
    if (bad)
        rc = bad;
    else if (!r->dsts || !r->fl || !r->qm || (o->trace_len && !r->trace))
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    for (unsigned i = 0; rc == UCCL_OK && i < o->ndst; i++)
        rc = dst_init(r, i, &o->dsts[i]);
    size_t map_len = sizeof(struct uccl_ring_ctr) + (size_t)o->nslots * sizeof(struct uccl_ring_cmd);
    /* device memory: the descriptor, which every enqueue reads (cached
     * there, not a PCIe read each time), the ticket, then the kernels'
     * cache of the counters (4 words, zeroed); a host ring's are plain
     * memory of this process */
    size_t dev_len = sizeof(struct uccl_ring_dev) + 5 * sizeof(uint64_t);
    if (rc == UCCL_OK && o->dev == UCCL_RING_HOST) {
        r->host = aligned_alloc(4096, (map_len + 4095) / 4096 * 4096);
        void *db = aligned_alloc(64, (dev_len + 63) / 64 * 64);
        r->dev_block = (uint64_t)(uintptr_t)db;
        if (!r->host || !db)
            rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
        else
            memset(r->host, 0, map_len), memset(db, 0, dev_len);
        r->host_dev = (uint64_t)(uintptr_t)r->host;
    } else if (rc == UCCL_OK) {
        rc = uccl_gpu_mapped_alloc(o->dev, map_len, &r->host, &r->host_dev);
        if (rc == UCCL_OK)
            rc = uccl_gpu_dev_alloc(o->dev, dev_len, &r->dev_block);
    }
    if (rc == UCCL_OK) {
        char *h = r->host;
        uint64_t ctr_d = r->host_dev;
        r->ctr = (volatile struct uccl_ring_ctr *)h;
        r->slots = (volatile struct uccl_ring_cmd *)(h + sizeof(struct uccl_ring_ctr));
        r->ticket_dev = r->dev_block + sizeof(struct uccl_ring_dev);
        struct uccl_ring_dev desc = {
            .magic = UCCL_RING_MAGIC, .slots = ctr_d + sizeof(struct uccl_ring_ctr),
            .ticket = r->ticket_dev, .head = ctr_d + offsetof(struct uccl_ring_ctr, head),
            .done = ctr_d + offsetof(struct uccl_ring_ctr, done),
            .error = ctr_d + offsetof(struct uccl_ring_ctr, error), .nslots = o->nslots,
            .ndst = o->ndst, .src_len = o->src_len, .timeout_ns = r->timeout_ns,
            .cache = r->ticket_dev + sizeof(uint64_t),
            .stuck = ctr_d + offsetof(struct uccl_ring_ctr, stuck)};
        rc = uccl_ep_copy(ep, (uintptr_t)r->dev_block, (uintptr_t)&desc, sizeof(desc));
    }
    if (rc == UCCL_OK) {
        if (pthread_create(&r->proxy, NULL, proxy_start, r) != 0)
            rc = uccl__err(UCCL_ERR_IO, "starting the ring's proxy thread: %s", strerror(errno));
        else
            r->proxy_started = 1;
    }
    if (rc) {
        uccl_ring_destroy(r);
        return rc;
    }
    *r_p = r;
    return UCCL_OK;
}

void uccl_ring_destroy(uccl_ring_t *r)
{
    if (!r)
        return;
    atomic_store(&r->stop, 1);
    if (r->proxy_started)
        pthread_join(r->proxy, NULL);
    for (unsigned i = 0; r->qm && i < r->qm_n; i++) /* left by a failure */
        uccl_stream_mark_free(r->qm[(r->qm_first + i) % r->inflight_max].mark);
    if (r->dev == UCCL_RING_HOST) {
        free((void *)(uintptr_t)r->dev_block);
        free(r->host);
    } else {
        uccl_gpu_dev_free(r->dev, r->dev_block);
        uccl_gpu_mapped_free(r->dev, r->host);
    }
    pthread_mutex_destroy(&r->err_mu);
    free(r->dsts);
    free(r->fl);
    free(r->qm);
    free(r->trace);
    free(r);
}

uint64_t uccl_ring_dev_ptr(uccl_ring_t *r)
{
    return r->dev_block;
}

int uccl_ring_counters(uccl_ring_t *r, uint64_t out[4])
{
    out[0] = 0;
    void *mark = NULL;
    /* the ticket is device memory: read it with a copy, as a snapshot */
    int rc = r->dev == UCCL_RING_HOST
                 ? (out[0] = __atomic_load_n((uint64_t *)(uintptr_t)r->ticket_dev,
                                             __ATOMIC_ACQUIRE), UCCL_OK)
                 : uccl_ep_copy_start(r->ep, (uintptr_t)&out[0], (uintptr_t)r->ticket_dev,
                                      sizeof(uint64_t), &mark);
    if (rc == UCCL_OK && mark) {
        rc = uccl_stream_mark_wait(mark, r->timeout_ns);
        uccl_stream_mark_free(mark);
    }
    out[1] = load_acq(&r->ctr->head);
    out[2] = load_acq(&r->ctr->done);
    out[3] = load_acq(&r->ctr->error);
    return rc;
}

int uccl_ring_wait(uccl_ring_t *r, uint64_t count, uint64_t deadline_ns, uint64_t slice_ns)
{
    uint64_t start = now_ns(), until = start + slice_ns < deadline_ns ? start + slice_ns
                                                                       : deadline_ns;
    for (uint64_t step = 1000;; step = step < 16000 ? step * 2 : step) {
        if (load_acq(&r->ctr->done) >= count)
            return UCCL_OK;
        uint64_t err = load_acq(&r->ctr->error); /* 1 + the first failed command */
        if (err && err - 1 < count) { /* those before it still finish */
            char why[sizeof(r->err)];
            uccl_ring_error(r, why, sizeof(why));
            return uccl__err(UCCL_ERR_IO, "the GPU ring failed: %s", why);
        }
        uint64_t t = now_ns();
        if (t >= deadline_ns)
            return uccl__err(UCCL_ERR_TIMEOUT, "the GPU ring completed %llu of %llu commands "
                             "within the timeout (taken: %llu)",
                             (unsigned long long)load_acq(&r->ctr->done),
                             (unsigned long long)count,
                             (unsigned long long)load_acq(&r->ctr->head));
        if (t >= until)
            return UCCL_INPROGRESS;
        if (t - start < 50000)
            sched_yield();
        else
            nap(step);
    }
}

void uccl_ring_error(uccl_ring_t *r, char *buf, size_t len)
{
    if (!len)
        return;
    buf[0] = '\0';
    if (!atomic_load(&r->failed))
        return;
    pthread_mutex_lock(&r->err_mu);
    snprintf(buf, len, "%s", r->err);
    pthread_mutex_unlock(&r->err_mu);
}

void uccl_ring_pause(uccl_ring_t *r)
{
    atomic_store(&r->paused, 1);
}

void uccl_ring_resume(uccl_ring_t *r)
{
    atomic_store(&r->paused, 0);
}

size_t uccl_ring_trace(uccl_ring_t *r, uint64_t *out, size_t n)
{
    size_t have = atomic_load(&r->trace_n);
    if (n > have)
        n = have;
    memcpy(out, r->trace, n * sizeof(*out));
    return n;
}

void uccl_ring_stats(uccl_ring_t *r, uint64_t out[2])
{
    out[0] = load_acq(&r->ctr->head);
    out[1] = atomic_load(&r->posts);
}

int uccl_ring_host_put(uccl_ring_t *r, uint32_t dst, uint64_t src_off, uint64_t dst_off,
                       uint64_t len, uint64_t *seq_p)
{
    if (r->dev != UCCL_RING_HOST)
        return uccl__err(UCCL_ERR_INVALID, "a GPU's ring (cuda:%d) is filled by its kernels, "
                         "not by the host", r->dev);
    /* as uccl_ring.cuh's put: the arguments the ring's words can tell
     * checked, a ticket, its slot once free (or the ring failed), the
     * fields, seq last */
    if (dst >= r->ndst || len > r->src_len || src_off > r->src_len - len)
        return uccl__err(UCCL_ERR_INVALID, "host put: destination %u of %u, %llu bytes at "
                         "source offset %llu of a %zu-byte source region", dst, r->ndst,
                         (unsigned long long)len, (unsigned long long)src_off, r->src_len);
    uint64_t t = __atomic_fetch_add((uint64_t *)(uintptr_t)r->ticket_dev, 1, __ATOMIC_ACQ_REL);
    volatile struct uccl_ring_cmd *s = &r->slots[t & (r->nslots - 1)];
    uint64_t deadline = now_ns() + r->timeout_ns;
    for (uint64_t step = 1000; t >= load_acq(&r->ctr->head) + r->nslots;) {
        if (load_acq(&r->ctr->error)) {
            char why[sizeof(r->err)];
            uccl_ring_error(r, why, sizeof(why));
            return uccl__err(UCCL_ERR_IO, "host put: the ring failed: %s", why);
        }
        if (now_ns() > deadline) {
            store_rel(&r->ctr->stuck, t + 1); /* the slot stays empty: the ring stops there */
            return uccl__err(UCCL_ERR_TIMEOUT, "host put: slot of ticket %llu still taken "
                             "after the %.0f s timeout (the proxy took %llu)",
                             (unsigned long long)t, (double)r->timeout_ns / 1e9,
                             (unsigned long long)load_acq(&r->ctr->head));
        }
        nap(step);
        if (step < 50000)
            step *= 2;
    }
    s->src_off = src_off, s->dst_off = dst_off, s->len = len, s->dst = dst, s->flags = 0;
    store_rel(&s->seq, t + 1);
    *seq_p = t;
    return UCCL_OK;
}
