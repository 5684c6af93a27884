/* Stream-ordered groups: the collectives of processes of one host whose
 * buffers are on one GPU, queued on a CUDA stream so that no host thread
 * ever waits for the GPU (as NCCL's kernels are).
 *
 *   sg_watch.c  the group's life: new, the watchdog, close
 *   sg_call.c   the collectives as rounds (allreduce, allgather, ...)
 *   sg_round.c  one round
 *   sg_p2p.c    point-to-point messages
 *   sgroup.c    the core: the shared page's words, failure, host waits,
 *               registrations, what is pending behind the stream
 * and the device it queues work on, a layer below (sgdev/sg_dev.h, its
 * contract): the CUDA driver (sgdev/sg_cuda.c: stream memory operations,
 * copies, events, kernels compiled by NVRTC, CUDA IPC through the
 * endpoint) or the same on the CPU for tests (sgdev/sg_emu.c: streams
 * emulated by threads).
 *
 * A group's ranks share one file in /dev/shm (made and mapped by the
 * Python layer, registered with CUDA): a header page, then one part per
 * rank with the 32-bit words its stream writes (ready, done, done2, fin)
 * and the descriptor slots its host writes.  In round k every rank
 *   1. publishes its buffers (key, address, length, tag) in slot k % NSLOT
 *      and reads every peer's slot of round k (the host waits here for the
 *      peers to *arrive*, never for a GPU); the ranks' calls are compared
 *      (operation, argument, phases) and every range is checked;
 *   2. queues, on the caller's stream where the call blocks (else on the
 *      group's, after an event of the caller's): ready = k with a wait for
 *      the ready word of each peer it reads, its copies and its reduction
 *      (phase 1), done = k and a wait for every peer's done >= k; with two
 *      phases, the phase-2 copies, done2 = k and a wait for every done2 >=
 *      k; then fin = k.
 * A wait here ends on a peer's stream reaching a write, never on work this
 * process queues later.  A round on another stream than the last one
 * starts after everything the group queued there, so the words only grow
 * (a cyclic 32-bit count).  The copies of one phase go in one kernel
 * launch up to UCCL_SG_KERNEL_COPY_BYTES (8 MiB) in all, else one by one
 * on the copy engine; where every peer is a process on this GPU, a round
 * of one phase with no reduction is one launch, handshakes and copies, up
 * to UCCL_SG_GATHER_LAUNCH_BYTES (48 MiB) of copies (uccl__sg_dev.gather).
 *
 * Failures (a peer that does not arrive within the timeout, a peer process
 * gone, ranks whose calls disagree, a round not through the stream within
 * the timeout, a queueing error) fail the group for every rank: the reason
 * goes into the header page, every rank's words are set far ahead so that
 * no stream anywhere stays blocked, and every later call raises. */
#ifndef UCCL_SGROUP_H
#define UCCL_SGROUP_H

#include <stddef.h>
#include <stdint.h>

#include "ep/uccl.h"
#include "base/dtype.h"
#include "sgdev/sg_dev.h" /* the device's contract, UCCL_SG_MAX_RANKS, the arena's layout */

#define UCCL_SG_P2P_SLOTS 16   /* messages of a pair posted ahead before a post waits */
#define UCCL_SG_FUSED_KIND 0x80u /* in a one-launch round's kind (compared across ranks) */

/* The kinds of the collectives' rounds (sg_call.c): the operation, its
 * element type, operator and root in one word, compared across ranks with
 * the argument (elements for the reductions, bytes for allgather and
 * broadcast); sg_round.c names what differs.  A general round's kind is the
 * caller's (stream_group.py: 1, argument 0). */
enum { UCCL_SG_K_ALLREDUCE = 0x10, UCCL_SG_K_REDUCE_SCATTER, UCCL_SG_K_ALLGATHER,
       UCCL_SG_K_BROADCAST, UCCL_SG_K_REDUCE };
#define UCCL_SG_KIND(k, dtype, op, root)                                                   \
    ((uint32_t)(k) | (uint32_t)(dtype) << 8 | (uint32_t)(op) << 16 | (uint32_t)(root) << 24)
#define UCCL_SG_KIND_OP(kind) ((int)((kind) & 0x7fu))
#define UCCL_SG_KIND_DTYPE(kind) ((int)((kind) >> 8 & 0xffu))
#define UCCL_SG_KIND_RED(kind) ((int)((kind) >> 16 & 0xffu))
#define UCCL_SG_KIND_ROOT(kind) ((int)((kind) >> 24 & 0xffu))

/* element types and reduction operators of uccl_sg_call.red: base/dtype.h */

/* Tags name what a rank publishes: every peer's buffer, or the k-th to rank d. */
#define UCCL_SG_TAG_ALL 0ull
#define UCCL_SG_TAG_TO(d, k) ((1ull << 40) | ((uint64_t)(d) << 20) | (uint64_t)(k))

struct uccl_sg_pub {
    uint64_t tag;
    uintptr_t ptr;
    size_t len;
};
/* Copy len bytes at offset off of what rank peer published under tag to
 * dst; exact: the published buffer must be exactly len bytes (a send
 * matched with a receive).  Phase 2 pulls run after every rank's phase 1. */
struct uccl_sg_pull {
    int peer, phase, exact;
    uint64_t tag, off;
    uintptr_t dst;
    size_t len;
};
/* struct uccl_sg_copy (a copy of this rank's): sgdev/sg_dev.h */
/* out[0..count) <- op over ranks 0..n-1 (in rank order) of the elements at
 * offset off of what each rank published under tag (this rank's too). */
struct uccl_sg_red {
    int dtype, op;
    uint64_t tag, off;
    uintptr_t out;
    size_t count;
};

/* A one-launch round (sg_round.c): this rank's input is staged into its
 * slot of its arena (uccl_sg_fused_arena), and one launch waits for every
 * rank's ready word and computes out from the ranks' slots: no host wait
 * for the peers, no mapping of their buffers.  gather: out holds the ranks'
 * nbytes in rank order; else out[0..count) <- op over the ranks in rank
 * order (out may be in). */
struct uccl_sg_fused {
    int gather, dtype, op;
    uintptr_t in, out;
    size_t nbytes, count;
};

struct uccl_sg_call {
    const char *what;          /* the operation's name, for messages */
    uint32_t kind;             /* compared across ranks with arg: their calls must agree */
    uint64_t arg;
    int phases;                /* 1 or 2 */
    uintptr_t caller;          /* the caller's stream: the round starts after its work */
    int caller_waits;          /* the caller's stream waits for the round's end (the round
                                  then runs on it; else on the group's stream) */
    void *end_event;           /* an event of uccl_sg_event_new, recorded at the end, or NULL */
    const struct uccl_sg_pub *pub;
    int npub;
    const struct uccl_sg_pull *pull;
    int npull;
    const struct uccl_sg_copy *copy; /* this rank's own copies, in phase 1 */
    int ncopy;
    const struct uccl_sg_red *red;   /* a reduction in phase 1, or NULL */
    const struct uccl_sg_fused *fused; /* instead of the above: a one-launch round */
    int capture;               /* whether caller captures a CUDA graph: 0 not known (the
                                  round asks the device), 1 no, 2 yes */
};

/* ---- the device a group queues on: sgdev/sg_dev.h (struct uccl__sg_dev, the
 * CUDA and emulated devices) ---------------------------------------------- */

/* ---- the group -------------------------------------------------------------- */
typedef struct uccl_sg uccl_sg_t;

/* Bytes of the shared file for a group of size ranks. */
size_t uccl_sg_page_bytes(int size);

/* A group over the mapped file [page, +page_len) (every rank maps it; this
 * rank writes its pid there), queueing on `stream` of the device (ops, d),
 * which the group owns from here on, failed or not. */
int uccl_sg_new(void *page, size_t page_len, int rank, int size, double timeout_s,
                uintptr_t stream, const struct uccl__sg_dev *ops, void *d, uccl_sg_t **sg_p);

/* Host waits call this every ~50 ms; nonzero stops the wait (fails the
 * group: an interrupted round leaves the peers in it). */
typedef int (*uccl_sg_interrupt_fn)(void *arg);

/* Whether `stream` is capturing a CUDA graph (1, 0; < 0 the driver's
 * error).  A round queued while it captures is a captured round: the host
 * does its part once, and the graph replays the stream's part with words
 * of the round's own, counted on the device (sg_graph.c). */
int uccl_sg_capturing(uccl_sg_t *sg, uintptr_t stream);
/* Whether a one-launch round of nbytes per rank can be captured (the
 * device makes the round's own arena and runs it as one launch, and it is
 * small enough for an arena of its own); else a captured round is
 * two-sided. */
int uccl_sg_graph_fuses(uccl_sg_t *sg, size_t nbytes);

/* Queue one round; *round_p its number.  Errors in the arguments come
 * before anything is published (UCCL_ERR_INVALID, nothing failed); every
 * later error fails the group. */
int uccl_sg_round(uccl_sg_t *sg, const struct uccl_sg_call *c, uccl_sg_interrupt_fn intr,
                  void *intr_arg, uint32_t *round_p);

/* The collectives (sg_call.c), each one round: a flat buffer of count
 * elements reduced in place (two phases: every rank reduces its chunk, then
 * copies the others'); out (count elements) <- this rank's chunk of the
 * reduction of in (size * count); every rank's nbytes into dst (size *
 * nbytes, rank order); root's buffer to every rank; the reduction to root. */
struct uccl_sg_opts {
    uintptr_t caller;
    int caller_waits;
    void *end_event;
    uccl_sg_interrupt_fn intr;
    void *intr_arg;
};
int uccl_sg_allreduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t count,
                      int dtype, int op, uint32_t *round_p);
int uccl_sg_reduce_scatter(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t out,
                           uintptr_t in, size_t count, int dtype, int op, uint32_t *round_p);
int uccl_sg_allgather(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t src, size_t nbytes,
                      uintptr_t dst, uint32_t *round_p);
int uccl_sg_broadcast(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t nbytes,
                      int root, uint32_t *round_p);
int uccl_sg_reduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t count,
                   int dtype, int op, int root, uint32_t *round_p);
/* send[r], recv[r] (n of each): the chunk to and from rank r; this rank's
 * own pair must be one size.  Its kind is the general round's all_to_all
 * (UCCL_SG_KIND_ALL_TO_ALL), so ranks that build the round in Python meet it. */
struct uccl_sg_span {
    uintptr_t ptr;
    size_t len;
};
#define UCCL_SG_KIND_ALL_TO_ALL (1u | 1u << 8) /* stream_group.py's KIND_ALL_TO_ALL */
int uccl_sg_all_to_all(uccl_sg_t *sg, const struct uccl_sg_opts *o,
                       const struct uccl_sg_span *send, const struct uccl_sg_span *recv,
                       uint32_t *round_p);

/* ---- point to point (sg_p2p.c) --------------------------------------------------
 * Messages between two ranks of the group, matched in order per ordered
 * pair (the k-th send from a to b with the k-th receive at b from a), as
 * NCCL and Gloo match them, with no host ever waiting for a peer or a GPU
 * (but for P2P_SLOTS messages posted on one side ahead of the other's
 * host: then the poster waits, within the timeout).  Each side posts its
 * buffer into the pair's slot for message k; whichever host posts second
 * moves the bytes: its stream waits for the first side's ready word (that
 * side's stream reached the message: its buffer is ready), copies through
 * CUDA IPC (pull or push), and writes its done word; the first side's
 * stream only writes ready.  Either side's Work then waits for the
 * copier's done word (p2p_wait).  Posts queue on the pair's stream (one
 * per peer for the messages both ways, as NCCL's per-pair streams: each
 * runs its messages in the order its host posted them, so no wait of the
 * pair's is behind the write it waits for, whatever order the two ranks
 * post in) after the caller's work.
 * A message not copied within the timeout, sizes that differ, or a peer
 * gone fail the group, as a round's failure does. */
struct uccl_sg_p2p_op {
    int peer, send;        /* send: this rank sends to peer; else receives from it */
    uintptr_t ptr;
    size_t len;            /* a send and its receive must have the same length */
    uintptr_t stream;      /* the pair's stream: every message with this peer, both ways */
};
/* Post n messages in order, each after the caller's work so far; codes[i]
 * names message i for p2p_wait/passed. */
int uccl_sg_p2p(uccl_sg_t *sg, const struct uccl_sg_p2p_op *ops, int n, uintptr_t caller,
                uccl_sg_interrupt_fn intr, void *intr_arg, uint64_t *codes);
/* Stage the sends to `peer` that this rank posts first in [ptr, +len) of
 * its GPU memory (kept registered until close): such a send is complete
 * once its bytes are copied there, so a send then receive on every rank
 * (each blocking, as `dist.send(); dist.recv()`) does not wait for the
 * peer's receive, as NCCL's and Gloo's buffered sends do not.  Sends of up
 * to len / P2P_SLOTS bytes are staged; larger ones wait for the receiver. */
int uccl_sg_p2p_arena(uccl_sg_t *sg, int peer, uintptr_t ptr, size_t len);

/* The arena of one-launch rounds: [ptr, +len) of this rank's device memory,
 * zeroed, kept registered until close: two slots of slot_bytes (rounds
 * alternate; a round starts only once every peer is past the round before
 * the last, so a slot is free again), then 16 bytes of the launch's counters.
 * Collectives of at most slot_bytes per rank (allreduce, allgather) then
 * run as one-launch rounds in groups of at most UCCL_SG_FUSED_RANKS;
 * every rank sets the same slot_bytes before its first collective.  The
 * peers' calls are compared one round late: a disagreement raises at the
 * next call. */
int uccl_sg_fused_arena(uccl_sg_t *sg, uintptr_t ptr, size_t len, size_t slot_bytes);
/* The most bytes per rank a one-launch round takes here (0: none). */
size_t uccl_sg_fused_bytes(uccl_sg_t *sg);
/* `stream` waits for message `code` to be in place, or for a staged send
 * to be staged (no host wait). */
int uccl_sg_p2p_wait(uccl_sg_t *sg, uint64_t code, uintptr_t stream);
/* Is message `code` in place (or staged)? (1 yes, 0 not yet, < 0 not a code of this group)
 * A failed group releases its words: then 1 says nothing (uccl_sg_error first). */
int uccl_sg_p2p_passed(uccl_sg_t *sg, uint64_t code);
/* Tests: number this rank's messages on every channel as if k had gone
 * through each already (the next is k + 1, or 1 past 0xffffffff), so that
 * the numbers' wrap at 2^32 is reached in a test.  Every rank of the group
 * calls it with the same k before any message is posted (k 0: no change).
 * The words that a run of messages whose receivers all posted first would
 * have left (the senders' ready, the receivers' done) are set lag behind. */
int uccl_sg_p2p_renumber(uccl_sg_t *sg, uint32_t k, uint32_t lag);
/* Tests, on the emulated device: the same for the rounds (the next is
 * round k + 1), before the group's first round, on every rank (k 0: no
 * change).  The two-sided rounds' done words are set lag behind, as a run
 * of one-launch rounds would have left them (see REFRESH_EVERY). */
int uccl_sg_round_renumber(uccl_sg_t *sg, uint32_t k, uint32_t lag);

/* Has this rank's stream finished round k? (its fin word) */
int uccl_sg_passed(uccl_sg_t *sg, uint32_t k);
/* `stream` waits for the end of the last round queued so far (no host wait). */
int uccl_sg_wait_last(uccl_sg_t *sg, uintptr_t stream);
/* Events for a caller's Work: made, recorded by a round (end_event), waited
 * for by a stream, queried, freed. */
int uccl_sg_event_new(uccl_sg_t *sg, void **ev_p);
void uccl_sg_event_free(uccl_sg_t *sg, void *ev);
int uccl_sg_event_wait(uccl_sg_t *sg, uintptr_t stream, void *ev);
int uccl_sg_event_query(uccl_sg_t *sg, void *ev);

/* The reason the group failed (this rank or another noticed), or NULL. */
const char *uccl_sg_error(uccl_sg_t *sg);
/* Fail the group for every rank. */
void uccl_sg_fail(uccl_sg_t *sg, const char *why);
int uccl_sg_rank(uccl_sg_t *sg);
int uccl_sg_size(uccl_sg_t *sg);

/* Stop the watchdog; wait (at most the timeout) for this rank's stream to
 * pass what it queued; release mappings and registrations.  Returns 1 when
 * the page may be unmapped, 0 when the group failed with rounds queued:
 * their copies may still read through the mappings and their writes reach
 * the page, so both stay for the life of the process.  Frees sg. */
int uccl_sg_close(uccl_sg_t *sg);

#endif
