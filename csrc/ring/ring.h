/* Public C API of GPU-initiated transfers, the third data plane: command
 * rings drained by a proxy thread (ring.c).  The kernels that fill them
 * are compiled and launched with gpu/gpu_api.h (gpu_kernel.c).
 *
 * A ring is an array of fixed-size commands in page-locked host memory
 * that the GPU sees (cuMemHostAlloc, DEVICEMAP).  A kernel enqueues a put
 * (destination, offsets into the ring's source region and the
 * destination's window, length) with the device functions of
 * uccl_collective/include/uccl_ring.cuh; the proxy takes commands in
 * sequence, issues each on the endpoint's transports (a one-sided write
 * to a peer's advertised window, or a copy on this GPU's copy engine for a
 * local destination) and counts completions in sequence; a kernel or the
 * host waits on that counter.  The layout shared with device code is
 * below: both sides must agree on it byte for byte.
 *
 * The contract.  Three parties use a ring, each through its own door;
 * calls go one way (the host API and the proxy call the endpoint's public
 * calls and gpu/, never the reverse), and the kernel and the proxy meet
 * only in the shared words, each written by one side:
 *
 *   The kernel (uccl_ring.cuh; any number of threads, warps and blocks at
 *   once).  put: takes a ticket (an atomic on device memory), waits on the
 *   GPU while its slot is still taken (the ring is full: the proxy has
 *   `inflight` commands in flight and takes no more until one retires),
 *   writes the command, a system fence (its earlier writes to the source
 *   region visible first), then seq.  The wait gives up after the
 *   endpoint's timeout: the ticket's slot then stays empty, the thread
 *   writes `stuck`, and the ring fails there.  try_put: never waits (EFULL
 *   instead).  wait(seq): waits on the GPU until done passes seq, the ring
 *   failed at or before seq, or the timeout.  done(): one read of the
 *   host's counter, no wait.  Kernels read the proxy's counters through a
 *   device-memory cache that one thread at a time refreshes over PCIe.
 *   The kernel writes: the slots' fields and seq, the ticket, the cache,
 *   stuck.
 *
 *   The proxy thread (ring.c, one per ring, on the GPU's NUMA node).
 *   Takes commands in sequence once whole (seq == ticket + 1), publishes
 *   head (the slot is the GPU's again), checks each (destination, ranges
 *   inside the source region and the window, flags 0) and issues it
 *   without waiting: a remote destination as a one-sided write
 *   (uccl_ep_post), a local one as a copy started on the copy engine
 *   (uccl_ep_copy_start, or uccl_gpu_copy_queue between device memory of
 *   the ring's GPU, one stream mark per burst).  It retires commands in
 *   sequence (polling their transfers and marks) and publishes done.  It
 *   waits (bounded by the endpoint's timeout) only where a command writes
 *   bytes an earlier one in flight still writes (the earlier retires
 *   first: in-sequence holds for the bytes too) and, at destroy, for what
 *   it took.  Idle with remote writes in flight it drives their
 *   connections (uccl_ep_progress); idle otherwise it spins
 *   UCCL_RING_SPIN_US, then naps up to 50 us.  A bad command or a failed
 *   transfer stops the ring: error = 1 + that command's seq, and nothing
 *   after it is taken.  The proxy writes: head, done, error.
 *
 *   The host API (below; the Python layer's GpuRing, any thread, the GIL
 *   let go around the calls that wait).  create: allocates, writes the
 *   descriptor into device memory (one small copy, waited for), starts
 *   the proxy.  destroy: stops the proxy after what it took has finished
 *   or failed (blocks for that), then frees; no kernel may use the ring
 *   any more, and no other call runs on it.  wait: polls done (yields,
 *   then naps) until count, the ring's failure, or a slice or deadline.
 *   counters: reads the ticket from device memory with a copy (waits for
 *   it, bounded by the timeout) and the proxy's counters.  dev_ptr, error,
 *   pause, resume and trace never wait (pause holds the proxy before the
 *   next command it would take: kernels' puts then wait for slots). */
#ifndef UCCL_RING_H
#define UCCL_RING_H

#include <stddef.h>
#include <stdint.h>

#include "ep/uccl.h"
#include "gpu/gpu_api.h"

/* ---- kernels compiled at run time, mapped and device memory, what a
 * pointer is, queued copies: gpu/gpu_api.h (included above) ----------------- */

/* ---- the layout shared with device code (uccl_ring.cuh) ------------------ */
#define UCCL_RING_MAGIC 0x474e495243435555ull /* "UUCCRING" */
struct uccl_ring_cmd {        /* one slot, 64 bytes */
    uint64_t seq;             /* ticket + 1 once the command is whole; written last */
    uint64_t src_off;         /* into the ring's source region */
    uint64_t dst_off;         /* into the destination's window */
    uint64_t len;
    uint32_t dst;             /* index into the ring's destinations */
    uint32_t flags;           /* 0 (reserved) */
    uint64_t pad[3];
};
struct uccl_ring_dev {        /* what a kernel is given (its device address) */
    uint64_t magic;
    uint64_t slots;           /* device address of nslots struct uccl_ring_cmd */
    uint64_t ticket;          /* device memory: the next ticket (GPU atomics only) */
    uint64_t head;            /* device address of the host-written counters below */
    uint64_t done;
    uint64_t error;
    uint32_t nslots;          /* a power of two */
    uint32_t ndst;
    uint64_t src_len;
    uint64_t timeout_ns;      /* a device wait gives up after this long */
    uint64_t cache;           /* device memory: the kernels' copies of head, done, error
                                 (struct uccl_ring_cache in uccl_ring.cuh), and a stamp */
    uint64_t stuck;           /* device address of the counters' `stuck` */
    uint64_t pad[5];
};
struct uccl_ring_ctr {        /* in mapped host memory, each on its own line */
    uint64_t head;            /* proxy: commands taken; slot s is free again once head > its ticket */
    uint64_t pad0[7];
    uint64_t done;            /* proxy: commands completed, in sequence */
    uint64_t pad1[7];
    uint64_t error;           /* proxy: 0, or 1 + the sequence number of the command that failed */
    uint64_t pad2[7];
    uint64_t stuck;           /* GPU: 0, or 1 + a ticket whose thread gave up waiting for its
                                 slot (the slot stays empty: the ring cannot go on) */
    uint64_t pad3[7];
};

/* ---- rings --------------------------------------------------------------- */
typedef struct uccl__ring uccl_ring_t;

enum { UCCL_RING_DST_LOCAL = 1, UCCL_RING_DST_REMOTE = 2 };
struct uccl_ring_dst {
    int kind;
    uint64_t conn;            /* REMOTE: the connection, and the peer's advertised window */
    uint8_t fifo[64];
    uintptr_t addr;           /* LOCAL: memory of this process (host or device) */
    size_t len;
};

/* opts.dev of a host ring: its words in this process's memory, filled by
 * host threads (uccl_ring_host_put), the proxy the same (tests, and the
 * proxy's own cost measured without a GPU). */
#define UCCL_RING_HOST (-1)

struct uccl_ring_opts {
    int dev;                  /* the GPU whose kernels enqueue (UCCL_RING_HOST: host threads) */
    unsigned nslots;          /* a power of two, 2 .. 1 << 20 */
    unsigned inflight;        /* commands the proxy keeps in flight, 1 .. 1024 */
    uint64_t src_mr;          /* the source region: registered with the endpoint */
    uintptr_t src_addr;
    size_t src_len;
    unsigned ndst;
    const struct uccl_ring_dst *dsts;
    size_t trace_len;         /* > 0: record the sequence numbers issued, in order (tests) */
    int paused;               /* start without draining (uccl_ring_resume) */
};

/* Make the ring, its device-side descriptor and its proxy thread (placed
 * on the GPU's NUMA node where sysfs tells it). */
int uccl_ring_create(uccl_ep_t *ep, const struct uccl_ring_opts *o, uccl_ring_t **r_p);
/* Stop the proxy after what it took has finished (or failed), then free
 * everything.  No kernel may use the ring any more. */
void uccl_ring_destroy(uccl_ring_t *r);
/* The device address of the ring's struct uccl_ring_dev (device memory). */
uint64_t uccl_ring_dev_ptr(uccl_ring_t *r);
/* Counters: [0] tickets handed out (read from the GPU's memory: a
 * snapshot), [1] taken, [2] done, [3] error (0 or 1 + failed seq). */
int uccl_ring_counters(uccl_ring_t *r, uint64_t out[4]);
/* Wait until `count` commands are done, the ring failed (its error), or
 * min(deadline_ns, now + slice_ns) passed (UCCL_INPROGRESS), or the
 * deadline passed (UCCL_ERR_TIMEOUT). */
int uccl_ring_wait(uccl_ring_t *r, uint64_t count, uint64_t deadline_ns, uint64_t slice_ns);
/* Why the ring failed ("" if it did not), into buf. */
void uccl_ring_error(uccl_ring_t *r, char *buf, size_t len);
/* Hold the proxy before it takes the next command, and let it go on. */
void uccl_ring_pause(uccl_ring_t *r);
void uccl_ring_resume(uccl_ring_t *r);
/* The sequence numbers issued so far, in order (opts.trace_len of them at most). */
size_t uccl_ring_trace(uccl_ring_t *r, uint64_t *out, size_t n);
/* [0] commands taken, [1] transfers and copies the proxy started for them
 * (fewer where it batched: UCCL_RING_BATCH_BYTES). */
void uccl_ring_stats(uccl_ring_t *r, uint64_t out[2]);
/* A host ring's put, as a kernel's (uccl_ring.cuh): a ticket, its slot
 * once free (waits, bounded by the endpoint's timeout, then fails the
 * ring there), the command; *seq_p its sequence number. */
int uccl_ring_host_put(uccl_ring_t *r, uint32_t dst, uint64_t src_off, uint64_t dst_off,
                       uint64_t len, uint64_t *seq_p);

#endif
