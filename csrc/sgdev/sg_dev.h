/* The contract of the devices that stream-ordered groups queue on (the
 * second data plane; sg/sgroup.h says the protocol that stands on it).
 *
 * A group (sg/) never waits for a GPU on the host: everything it does to a
 * stream goes through this table, which queues it and returns.  Two
 * devices meet it:
 *   sg_cuda.c  the CUDA driver: stream memory operations, copies on the
 *              copy engine or in one launch, events, the kernels of
 *              sg_kernels.c compiled by NVRTC on first use, memory shared
 *              with the group's peers through an endpoint (CUDA IPC)
 *   sg_emu.c   the same on the CPU, for tests: a stream is a thread that
 *              runs its queue in order, every rank a thread of one
 *              process, keys are addresses (no access checks)
 *
 * Calls go one way, down: the group (sg/sgroup.c, sg_round.c, sg_p2p.c,
 * sg_watch.c) calls the members; a device calls only the layers below it
 * (the endpoint's public calls, gpu/, load/, base/), never the group.  A
 * device knows nothing of rounds, messages or the page: it is handed
 * addresses of 32-bit words, buffers and streams, and queues what it is
 * told.
 *
 * Every member takes the device's state `d` (what its constructor gave)
 * and returns UCCL_OK or a status with the reason recorded (uccl__err);
 * an error after the group published anything fails the group.  "Queues"
 * below means: returns once the work is on the stream, before it runs;
 * the host never waits for the stream, nor for a peer.  What queued work
 * waits for on the stream is said with each member.
 *
 * Threads.  A group's calls come from:
 *   - the thread of a round (uccl_sg_round and the collectives), one at a
 *     time (the group's call lock);
 *   - the thread of a message post (uccl_sg_p2p), one at a time (the
 *     group's p2p lock), and p2p_wait from any caller's thread: these may
 *     run at the same time as a round, on other streams;
 *   - the group's watchdog thread (unmap, releasing what a stream is past);
 *   - any caller's thread for the events of its Work (event_*, record,
 *     wait_event, query);
 *   - close, after the watchdog stopped and no other call runs.
 * So memops, copies, record, wait_event, query, map and unmap may run on
 * several threads at once (on different streams and objects); reduce,
 * fused, fused_id, sync and gather come from a round's thread only, one at
 * a time, and a device may keep what they cache unlocked; reg, key and
 * dereg come under the group's registration lock (dereg also from close). */
#ifndef UCCL_SG_DEV_H
#define UCCL_SG_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "ep/uccl.h"

#define UCCL_SG_MAX_RANKS 64   /* the reduction kernel reads one source per rank */
#define UCCL_SG_FUSED_RANKS 8  /* one-launch rounds: every rank's staging slot is an argument */
#define UCCL_SG_FUSED_TAIL 128 /* ... and their arena: two slots, then this many bytes: two
                                * counters and a flag (device memory, zero between launches),
                                * and at UCCL_SG_FUSED_READY this rank's ready word, which the
                                * peers' launches poll (in device memory, not over PCIe) */
#define UCCL_SG_FUSED_READY 64 /* the arena's words: ready (one-launch and two-sided rounds) */
#define UCCL_SG_FUSED_DONE 80  /* ... and a two-sided round's done and done2 (uccl__sg_sync_args) */
#define UCCL_SG_FUSED_DONE2 96
#define UCCL_SG_FUSED_SEEN 8   /* the one-launch kernel's last round whose peers block 0 saw */
#define UCCL_SG_FUSED_EPOCH 16 /* a captured round's arena: its last replay (fused_args.epoch) */

/* One copy: len bytes from src to dst, addresses this process may use on
 * the device (its own memory, or a peer's as map() gave it). */
struct uccl_sg_copy {
    uintptr_t dst, src;
    size_t len;
};

/* A stream memory operation on a 32-bit word the stream can reach (the
 * group's page, registered for the GPU; or an arena word).  With epoch
 * (a word of this rank's that only its own stream writes), value counts
 * from *epoch as the stream reads it when it gets there, not from 0: what
 * a CUDA graph replays (a captured round's words, sgroup.h) must number
 * itself on the device, the host being absent at a replay. */
enum { UCCL__SG_WRITE = 0, UCCL__SG_WAIT = 1, UCCL__SG_BUMP = 2 };
struct uccl__sg_memop {
    uint32_t *addr;
    uint32_t value;
    int wait;         /* UCCL__SG_WAIT: until *addr >= value (cyclic); UCCL__SG_WRITE:
                       * value; UCCL__SG_BUMP: *addr += 1 (addr is an epoch word) */
    uint32_t *epoch;  /* NULL, or value is relative to *epoch */
};
/* out[0..count) <- op (base/dtype.h) over the nsrc buffers src[], in their
 * order, elements of dtype; one rounding at the end (as torch reduces). */
struct uccl__sg_red_args {
    int dtype, op, nsrc;
    uintptr_t out;
    uintptr_t src[UCCL_SG_MAX_RANKS];
    size_t count;
};
/* A one-launch round as the device runs it: slot[r] is rank r's staging
 * slot of this round (mine: where in is staged), ready[r] its ready word in
 * the page and dready[r] the same word in its arena (what launches poll);
 * ctr the arena's counters; failed the page's flag (a spin ends there).
 *
 * epoch: NULL, or the round is captured in a CUDA graph (sg_graph.c) and
 * numbers itself when it runs: k is *epoch + 1 as the launch reads it, and
 * *epoch is set to k at its end.  It pushes: slot[r] is rank r's own arena
 * for this round (mapped), which holds a slot of flip bytes per source
 * rank and parity (source s, parity p at (p * nsrc + s) * flip), and
 * dready[r] its ready words (word s: source s's); this rank writes its
 * input into slot [me] of k's parity in every rank's arena, then word [me]
 * of every rank's ready words, waits for all of its own words (its own
 * too: in and out may overlap), and computes out from its own arena's
 * slots.  ready[] and fin are NULL. */
struct uccl__sg_fused_args {
    int gather, dtype, op, nsrc, me;
    uint32_t k;
    uintptr_t in, out, ctr;
    size_t nbytes, count;
    uintptr_t slot[UCCL_SG_FUSED_RANKS];
    uint32_t *ready[UCCL_SG_FUSED_RANKS];
    uintptr_t dready[UCCL_SG_FUSED_RANKS];
    uint32_t *fin, *failed;
    uint32_t *epoch;
    size_t flip;
    int ll; /* captured: NCCL's LL lines (sg_kernels.c, uccl_sg_cll): a slot of flip
             * bytes holds flip / 2 of data, each 8 with the number twice; no ready word */
};
/* A handshake of a two-sided round as one launch: this rank's word set to
 * k (mine: in its arena; page: the same word in the page, what the host and
 * peers without the launch read), then a wait until every peer r in mask
 * has set its own (peer[r], in its arena) to k or past, then fin (if not
 * NULL) set to k.  failed: the page's flag, which ends the wait. */
struct uccl__sg_sync_args {
    uint32_t k, mask;
    int me, n;
    uintptr_t mine, peer[UCCL_SG_FUSED_RANKS];
    uint32_t *page, *fin, *failed;
};

struct uccl__sg_dev {
    /* ---- work on a stream (queued, never waited for here) ---- */

    /* Queue n memory operations on `stream`, in order (one driver call
     * where the driver batches them; CUDA: one launch of a single thread
     * where any is relative to an epoch or a bump, which the driver's own
     * operations cannot compute).  On the stream a write lands once
     * the work queued before it has finished (its writes visible first);
     * a wait holds the stream until the word reaches the value, which
     * only a peer's stream (or a failing rank's release of every word)
     * brings about, never work this process queues later.  Rounds, posts
     * and p2p_wait call it. */
    int (*memops)(void *d, uintptr_t stream, const struct uccl__sg_memop *ops, int n);
    /* Queue n copies (any mix of sizes) on `stream`, in one go where the
     * device can (CUDA: one launch of the copy kernel up to
     * UCCL_SG_KERNEL_COPY_BYTES in all and as many copies as the kernel's
     * segments, UCCL__K_COPY_SEGS; else one copy-engine copy each).
     * Rounds and posts call it. */
    int (*copies)(void *d, uintptr_t stream, const struct uccl_sg_copy *cs, int n);
    /* Queue the reduction a on `stream`.  The first one of an element
     * type compiles its kernel (NVRTC, a process-wide lock held while it
     * compiles; UCCL_ERR_UNAVAIL where NVRTC cannot be loaded).  A round's
     * thread calls it. */
    int (*reduce)(void *d, uintptr_t stream, const struct uccl__sg_red_args *a);

    /* ---- events: a point of a stream, for the group and for a caller's Work ---- */

    /* Make and free an event (free: NULL is not passed; the device may
     * keep what a stream still holds).  Never block.  The group makes its
     * own at uccl_sg_new and frees them at close; callers through
     * uccl_sg_event_new/free. */
    int (*event_new)(void *d, void **ev_p);
    void (*event_free)(void *d, void *ev);
    /* Queue: ev marks what `stream` has queued so far (record); `stream`
     * waits for the last record of ev queued before this call (wait_event).
     * Never block the host.  Rounds, posts, wait_last, and callers
     * (uccl_sg_event_wait) call them. */
    int (*record)(void *d, void *ev, uintptr_t stream);
    int (*wait_event)(void *d, uintptr_t stream, void *ev);
    /* Has ev's last record passed?  1 done, 0 not yet, < 0 an error of the
     * stream's work.  Never blocks; any caller's thread. */
    int (*query)(void *d, void *ev);

    /* ---- sharing this rank's memory with the group's peers ---- */

    /* Register [ptr, +len) of this rank's memory for the peers (CUDA: with
     * the endpoint, uccl_ep_reg: classified, an export record made);
     * `key`: what a peer maps [ptr, +len) inside registration reg by,
     * checked at every use (memory freed since, or freed and its address
     * reused, fails: the group then registers it anew); dereg: the
     * registration released (CUDA: uccl_ep_dereg, which may wait, bounded
     * by the endpoint's timeout, for the endpoint's own transfers still
     * reading or writing it).  reg and key never wait for a peer or a
     * stream.  Called under the group's registration lock (rounds,
     * posts), dereg also at close. */
    int (*reg)(void *d, uintptr_t ptr, size_t len, uint64_t *reg_p);
    int (*key)(void *d, uint64_t reg, uintptr_t ptr, size_t len, uint64_t *key_p);
    void (*dereg)(void *d, uint64_t reg);
    /* Map [addr, +len) of what rank `peer` published under key, for this
     * rank's streams to read and write: *ptr_p, until unmap(*imp_p).
     * CUDA: the peer's export record read and checked, its memory opened
     * by CUDA IPC (cached per process: the first open of an allocation
     * costs milliseconds); never waits for the peer.  Rounds (a round's
     * peers, the arenas at the first one-launch round) and posts (the
     * other side's buffer) call it.  unmap: never waits for a stream (the
     * group unmaps only what its stream is past, or never once it failed
     * with work queued); the watchdog, rounds, posts and close call it. */
    int (*map)(void *d, int peer, uint64_t key, uint64_t addr, size_t len, uintptr_t *ptr_p,
               void **imp_p);
    void (*unmap)(void *d, void *imp);

    /* The group is gone (uccl_sg_close, or uccl_sg_new failing): free d.
     * The last call; never blocks.  Kernels compiled stay for the life of
     * the process (a launch a failed group queued may still run). */
    void (*destroy)(void *d);

    /* Is `stream` capturing a CUDA graph (1), or not (0)?  < 0: the
     * driver's error.  What the caller queues while it captures runs only
     * when the graph is launched, any number of times.  Rounds call it. */
    int (*capturing)(void *d, uintptr_t stream);
    /* Device memory of len bytes, zeroed, that the peers may map (reg):
     * a captured one-launch round's arena (sg_graph.c), kept until close;
     * called while the caller's stream captures.  free_mem gives it back
     * (close, once no stream can run the round again).  NULL where the
     * device has no launch that spins (fused). */
    int (*alloc)(void *d, size_t len, uintptr_t *ptr_p);
    void (*free_mem)(void *d, uintptr_t ptr);

    /* ---- launches that spin (optional: NULL where the device has none) ----
     * These launches wait on the GPU, polling peers' words in the arenas
     * (device memory the ranks map from each other), so every rank's
     * launch must be resident at once; each spin also ends at the page's
     * failed flag.  They are queued like the rest: the host never waits.
     * A round's thread calls them, one at a time; the first use compiles
     * the kernel.  UCCL_ERR_UNAVAIL: not this way for this call (no
     * kernel, a size or alignment the launch does not take): the round
     * then queues the same steps one by one, which write the same words,
     * so ranks may take different ways. */

    /* A one-launch round: in staged into this rank's slot, ready written,
     * the peers' ready words awaited, out computed from every rank's slot
     * (the reduction in rank order, or the gather), fin written.  A
     * captured one (a->epoch) has no steps to fall back on: UCCL_ERR_UNAVAIL
     * there is an error to report. */
    int (*fused)(void *d, uintptr_t stream, const struct uccl__sg_fused_args *a);
    /* 0 where this rank's launches run beside other processes' (MPS, or the
     * emulated device; or NULL), else its GPU's identity: one-launch rounds
     * spin, and ranks on one GPU without MPS would each hold it for a time
     * slice (~2 ms a round), so a group where two ranks show the same
     * identity runs two-sided rounds instead.  Driver queries only. */
    uint64_t (*fused_id)(void *d);
    /* A handshake as one launch (where one-launch rounds may run): the
     * words of struct uccl__sg_sync_args.  Else stream memory operations
     * on the words (memops). */
    int (*sync)(void *d, uintptr_t stream, const struct uccl__sg_sync_args *a);
    /* A one-phase round with no reduction as one launch: the ready
     * handshake, the n copies, the done handshake (where handshakes may be
     * launches); ctr: this rank's arena counters.  CUDA: where every peer
     * is a process on this GPU and the copies move at most
     * UCCL_SG_GATHER_LAUNCH_BYTES in all.  Else the three one by one. */
    int (*gather)(void *d, uintptr_t stream, const struct uccl__sg_sync_args *ready,
                  const struct uccl_sg_copy *cs, int n, const struct uccl__sg_sync_args *done,
                  uintptr_t ctr);
};

/* ---- the devices: made by the caller (the Python layer), handed to
 * uccl_sg_new, which owns them from then on ---------------------------------- */

/* The CUDA device (sg_cuda.c): queues on device dev through the driver,
 * shares memory through endpoint ep's connections conns[rank] (same-host,
 * CUDA IPC).  Compiles the copy kernel unless UCCL_SG_KERNEL_COPY_BYTES is
 * 0 (blocks while NVRTC compiles). */
int uccl_sg_cuda_new(uccl_ep_t *ep, const uint64_t *conns, int rank, int size, int dev,
                      const struct uccl__sg_dev **ops_p, void **d_p);
/* The endpoint was closed before the group: its registrations went with it. */
void uccl_sg_cuda_forget_ep(void *d);
/* Compile (once per process) the reduction kernel for dtype on device dev:
 * UCCL_ERR_UNAVAIL where NVRTC cannot be loaded.  Blocks while it compiles. */
int uccl_sg_kernel_ready(int dev, int dtype);
/* The emulated device (sg_emu.c, tests): a stream is a handle of
 * uccl_sg_emu_stream_new, memory is this process's, keys are addresses (no
 * access checks).  It has no launches (fused_id, sync, gather NULL), but for
 * captured one-launch rounds (fused with an epoch), which it runs as one
 * operation of its stream's thread: they have no steps to fall back on. */
int uccl_sg_emu_new(const struct uccl__sg_dev **ops_p, void **d_p);
/* Its counts: registrations made, released, mappings live.  The device
 * outlives its group (destroy leaves it) so tests can read them after
 * close; uccl_sg_emu_free frees it. */
void uccl_sg_emu_counts(void *d, long out[3]);
void uccl_sg_emu_free(void *d);
int uccl_sg_emu_stream_new(uintptr_t *stream_p);
/* Stop (after what is queued) and free (joins the stream's thread); how
 * many waits ran past the stuck bound. */
int uccl_sg_emu_stream_free(uintptr_t stream);
/* Wait (blocking, at most timeout_ns) until the stream has run what is queued. */
int uccl_sg_emu_stream_idle(uintptr_t stream, uint64_t timeout_ns);
/* Waits (of every emulated stream so far) that a stale word let pass. */
int uccl_sg_emu_stale_passes(void);
/* The emulated CUDA graphs: from capture_begin to capture_end what is
 * queued on the stream is recorded, not run (capturing() says 1), and
 * becomes a graph; graph_launch queues a copy of it on any stream, as
 * often as called; graph_free frees it. */
int uccl_sg_emu_capture_begin(uintptr_t stream);
int uccl_sg_emu_capture_end(uintptr_t stream, uintptr_t *graph_p);
int uccl_sg_emu_graph_launch(uintptr_t graph, uintptr_t stream);
void uccl_sg_emu_graph_free(uintptr_t graph);
/* How many captured one-launch rounds the graph holds (tests). */
int uccl_sg_emu_graph_launches(uintptr_t graph);

#endif
