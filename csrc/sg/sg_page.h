/* The inside of a stream-ordered group (sgroup.h), shared by the files
 * that work on it, which call down this list (sg_call.c, above sg_round.c,
 * uses only the public sgroup.h):
 *   sg_watch.c  the group's life: new, the watchdog, close
 *   sg_round.c  one round
 *   sg_p2p.c    point-to-point messages
 *   sgroup.c    the core: the page's words, failure, host waits,
 *               registrations, what is pending behind the stream
 * Private to those four files. */
#ifndef UCCL_SG_PAGE_H
#define UCCL_SG_PAGE_H

#include <pthread.h>
#include <stdint.h>

#include "sg/sgroup.h"

#define PAGE 4096
#define REASON 440                  /* header: failed flag (u32) at 0, reason at 8 */
#define RANK_BYTES (5 * 4096)
#define OFF_READY 0                 /* u32 words the streams write, a cache line each */
#define OFF_DONE 64
#define OFF_DONE2 128
#define OFF_FIN 192
#define OFF_CONSUMED 256            /* u64 words the host writes */
#define OFF_PID 264
#define OFF_CLOSING 272             /* u64 the host writes: nonzero once its close began */
#define OFF_SLOTS 320
#define NSLOT 4
#define SLOT_BYTES ((RANK_BYTES - OFF_SLOTS) / NSLOT)
#define ENTRY_BYTES 32
#define MAX_ENTRIES ((SLOT_BYTES - (int)sizeof(struct slot_head)) / ENTRY_BYTES)
#define RELEASE_AHEAD (1u << 30)    /* words set this far past the last round let every wait pass */
/* Every comparison of numbers is cyclic, so a word that only some rounds
 * (or one role of a message) write would read as ahead once a long enough
 * run of the others left it 2^31 behind.  At every round and every
 * channel's message numbered a multiple of this, the stream writes all of
 * this rank's words again, with the number before (true: the stream did
 * all that came before). */
#define REFRESH_EVERY (1u << 29)
static inline int refresh_due(uint32_t k) { return (k & (REFRESH_EVERY - 1)) == 0; }
/* Captured rounds (rounds queued while the caller's stream captures a
 * CUDA graph, replayed any number of times without the host): each has a
 * graph slot of its own, the g-th captured round of the group (every rank
 * captures the same calls in the same order, as it runs them), with four
 * words a rank after the channels: its epoch (the replays so far, bumped
 * by its own stream at the round's start) and its ready, done and done2
 * words, written with the epoch, which the peers' streams wait for. */
#define GRAPH_SLOTS 1024
enum { GW_EPOCH, GW_READY, GW_DONE, GW_DONE2, GW_WORDS };
#define REG_CACHE 64
#define WATCH_NS 20000000ull        /* the watchdog's period */
#define SLOW_CHECK_NS 50000000ull   /* host waits: dead peers and interrupts this often */

enum { FLAG_OK = 0, FLAG_FAILED = 1, FLAG_WRITING = 2 };

struct slot_head {
    uint32_t count, kind;
    uint64_t round;                 /* stored last */
    uint64_t arg;
    uint32_t phases, pad;
    char what[16];
};
struct entry {
    uint64_t tag, key, addr, len;
};

struct reg {
    uintptr_t ptr;
    size_t len;
    uint64_t reg, key, used;
    uint32_t last;                  /* the last round that published it */
    uint32_t pins;                  /* point-to-point messages a peer may still map it for */
};
struct pending {
    uint32_t k;
    uint64_t t0;
    int nimp;
    void **imp;
    uintptr_t area;   /* a captured one-launch round's arena (sg_graph.c), or 0 */
    size_t area_len;
    uint64_t reg;     /* ... and its registration, pinned */
};

/* ---- point-to-point channels (sg_p2p.c): one per ordered pair (src, dst),
 * after the ranks' parts.  Each side's stream writes its own ready and
 * done words; the hosts write the slots (a message's two descriptors and
 * its state: the message number above, arrival bits below). */
#define P2P_SLOTS UCCL_SG_P2P_SLOTS
enum { P2P_SRC = 0, P2P_DST = 1 };
struct p2p_desc {
    uint64_t key, addr, len;
};
struct p2p_slot {
    uint64_t state;                 /* (k << 32) | 1: src arrived, 2: dst arrived, 4: read */
    struct p2p_desc d[2];
    uint64_t pad;
};
/* A channel's captured messages (sg_graph.c): each side's epoch, bumped by
 * its stream at every replay, and its ready and done words, written
 * relative to it; the j-th message each side captured on the channel has
 * row j (both sides capture a pair's messages in the same order). */
#define P2P_GRAPH 64
enum { PG_EP = 0, PG_RDY = 2, PG_DN = 4, PG_WORDS = 6 }; /* + side */
struct p2p_chan {
    uint32_t ready[2][16];          /* [side][0], a cache line each */
    uint32_t done[2][16];
    uint64_t high, pad[7];          /* the highest message number posted (release's base) */
    struct p2p_slot slot[P2P_SLOTS];
    uint32_t gw[P2P_GRAPH][PG_WORDS];
};
/* Where this rank stages the sends to one peer that it posts first
 * (uccl_sg_p2p_arena): P2P_SLOTS slots of len / P2P_SLOTS bytes, and the
 * message each slot last staged (its receiver must have copied it out
 * before the slot is written again). */
struct p2p_arena {
    uintptr_t ptr;
    size_t len;
    uint64_t key;
    uint32_t staged[P2P_SLOTS];
};
/* A message captured in a CUDA graph: its channel and row (gw), this
 * rank's side and the copier's, the stream it was queued on and an event
 * of the group's that a wait records there. */
struct graph_msg {
    uint32_t chan, j;
    int side, copier;
    uintptr_t stream;
    void *ev;
};
/* A message posted here, until the copier's done word passes it. */
struct p2p_pending {
    uint32_t chan, k;
    int copier;                     /* the side whose stream copies (P2P_SRC/P2P_DST) */
    uint64_t t0, reg;               /* reg: this rank's registration pinned for it, or 0 */
    void *imp;                      /* the peer's memory mapped for the copy, or NULL */
    int passed;                     /* reclaim's reading of the copier's word */
};

struct uccl_sg {
    uint8_t *page;
    size_t page_len;
    int rank, size;
    uint64_t timeout_ns;
    const struct uccl__sg_dev *ops;
    void *d;
    uintptr_t own;                  /* the group's stream (rounds of calls that do not block) */
    uintptr_t last;                 /* the stream the last round ran on */
    void *ev_start, *ev_mark;       /* reused: a wait captures the event's state when queued */
    uint32_t round;
    uint64_t clock;
    struct reg *regs;
    int nregs, cap_regs;
    struct entry *peer_ent;         /* size * MAX_ENTRIES: the peers' slots of this round */
    uint32_t *peer_cnt;
    pthread_mutex_t call_mu;        /* one round (or wait_last) at a time: last, round, regs */
    pthread_mutex_t mu;             /* pend, failed, error, closed */
    pthread_cond_t cv;
    struct pending *pend;
    int npend, cap_pend;
    pthread_t watch;
    int watching, closed, failed;
    /* point to point (sg_p2p.c) */
    pthread_mutex_t p2p_mu;         /* one post at a time: the counters, ev_p2p */
    pthread_mutex_t reg_mu;         /* regs (rounds and posts register) */
    void *ev_p2p;
    uint32_t *p2p_sent, *p2p_recvd; /* messages posted to / from each rank */
    uint32_t *p2p_gsent, *p2p_grecvd; /* ... of them captured in CUDA graphs */
    struct graph_msg *gmsg;         /* the captured messages (sg_graph.c), by code */
    int ngmsg;
    struct p2p_arena *arena;        /* per peer (under p2p_mu) */
    struct p2p_pending *p2p;        /* under mu */
    int np2p, cap_p2p;
    /* one-launch rounds (sg_round.c; under call_mu) */
    uintptr_t fz_arena;             /* this rank's arena (uccl_sg_fused_arena), or 0 */
    size_t fz_slot;                 /* the arena: 2 x fz_slot + UCCL_SG_FUSED_TAIL bytes */
    uint64_t fz_key;
    uintptr_t fz_peer[UCCL_SG_FUSED_RANKS]; /* every rank's arena as mapped here */
    void *fz_imp[UCCL_SG_FUSED_RANKS];
    int fz_nimp, fz_mapped, fz_off;    /* fz_off: ranks share a GPU without MPS */
    int fz_tried;                   /* a two-sided round met a peer without an arena like ours */
    int fz_flip;                    /* the slot of the next one-launch round */
    uint32_t fz_last;               /* the last round whose launches may read this rank's
                                     * arena (close waits for the peers to be past it) */
    uint32_t fz_unchecked;          /* a one-launch round whose peers' calls are not yet
                                       compared with this rank's, or 0 */
    /* captured rounds (sg_round.c; under call_mu) */
    uint32_t graph_next;            /* the graph slot of the next captured round */
    struct pending *graph_keep;     /* their mappings, kept until close (a graph may be
                                     * replayed as long as the process lives) */
    int ngraph_keep;
    uintptr_t *gchunk;              /* device memory the captured one-launch rounds' arenas */
    int ngchunk;                    /* ... are carved from (sg_graph.c), freed at close */
    size_t gchunk_len, gchunk_used; /* the last chunk's */
    char error[REASON];
};

/* ---- the page ---------------------------------------------------------------- */

/* ---- the page's words ---- */
static inline uint8_t *part(uccl_sg_t *sg, int r) { return sg->page + PAGE + (size_t)r * RANK_BYTES; }
static inline uint32_t *w32(uccl_sg_t *sg, int r, int off) { return (uint32_t *)(part(sg, r) + off); }
static inline uint64_t *w64(uccl_sg_t *sg, int r, int off) { return (uint64_t *)(part(sg, r) + off); }
static inline uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t ld64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void st64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
/* a >= b for round numbers, as the streams compare them (cyclic, 32-bit) */
static inline int ahead(uint32_t a, uint32_t b) { return (uint32_t)(a - b) < 0x80000000u; }

static inline struct p2p_chan *chan_at(uccl_sg_t *sg, uint32_t c)
{
    return (struct p2p_chan *)(sg->page + PAGE + (size_t)sg->size * RANK_BYTES) + c;
}

/* The captured rounds' words (GRAPH_SLOTS x size x GW_WORDS), after the
 * channels, on a cache line of their own. */
static inline size_t graph_off(int size)
{
    size_t n = PAGE + (size_t)size * RANK_BYTES + (size_t)size * size * sizeof(struct p2p_chan);
    return (n + 63) / 64 * 64;
}
static inline uint32_t *gword(uccl_sg_t *sg, uint32_t g, int r, int which)
{
    return (uint32_t *)(sg->page + graph_off(sg->size)) +
           ((size_t)g * sg->size + (size_t)r) * GW_WORDS + which;
}

static inline uint8_t *slot(uccl_sg_t *sg, int r, uint32_t k)
{
    return part(sg, r) + OFF_SLOTS + (size_t)(k % NSLOT) * SLOT_BYTES;
}

/* ---- sgroup.c ---- */
/* Is process pid alive (or not written yet)? */
int uccl__sg_alive(uint64_t pid);
/* Under mu: has the group failed (here, or at a rank that wrote the page)? */
int uccl__sg_failed_locked(uccl_sg_t *sg);
/* Under mu: fail the group with reason why (the first reason stays). */
void uccl__sg_fail_locked(uccl_sg_t *sg, const char *why);
/* Every rank's words and every channel's far past any round or message
 * (under mu).  Done again while the group stays failed: a live rank's
 * stream may still write what it had queued, lowering a word another
 * stream waits on. */
void uccl__sg_release_words(uccl_sg_t *sg);
typedef int (*uccl__sg_ready_fn)(uccl_sg_t *sg, uint32_t k, int r);
int uccl__sg_consumed_ready(uccl_sg_t *sg, uint32_t k, int r);
int uccl__sg_arrived(uccl_sg_t *sg, uint32_t k, int r);
/* Spin, then yield, then sleep, until ready(); past the deadline, with a
 * peer process gone, or on an interrupt: fail the group. */
int uccl__sg_host_wait(uccl_sg_t *sg, uccl__sg_ready_fn ready, uint32_t k, int r,
                       const char *what, uint64_t deadline, uccl_sg_interrupt_fn intr,
                       void *intr_arg, const char *wfmt, ...)
    __attribute__((format(printf, 9, 10)));
/* Fail the group with the message recorded on this thread; the status as it was. */
int uccl__sg_fail_rc(uccl_sg_t *sg, int rc);
/* The error of a call made once the group had failed. */
int uccl__sg_failed_err(uccl_sg_t *sg, const char *what);
/* The key peers map this rank's [ptr, +len) by (a cached registration);
 * with pin_p, the registration is kept (and *pin_p names it) until
 * uccl__sg_reg_unpin: a peer may map it after this call returns. */
int uccl__sg_reg_key(uccl_sg_t *sg, uintptr_t ptr, size_t len, uint32_t k, uint64_t *key_p,
                     uint64_t *pin_p);
void uccl__sg_reg_unpin(uccl_sg_t *sg, uint64_t reg);
/* At a refresh (REFRESH_EVERY): the registrations' rounds kept within 2^30
 * of round k, so that their cyclic ages stay right. */
void uccl__sg_reg_age(uccl_sg_t *sg, uint32_t k);
/* Release every registration (close). */
void uccl__sg_reg_drop_all(uccl_sg_t *sg);
/* A round queued (its mappings, released once the stream is past it). */
int uccl__sg_pending_add(uccl_sg_t *sg, struct pending p);
void uccl__sg_pending_free(uccl_sg_t *sg, struct pending *p);
/* Release what rounds and messages behind this rank's stream mapped
 * (_locked: under mu). */
void uccl__sg_reclaim(uccl_sg_t *sg);
void uccl__sg_reclaim_locked(uccl_sg_t *sg);
/* A message posted (sg_p2p.c), watched and reclaimed with the rounds;
 * what it holds (a mapping, a pinned registration), released. */
int uccl__sg_p2p_add(uccl_sg_t *sg, struct p2p_pending p);
void uccl__sg_p2p_free(uccl_sg_t *sg, struct p2p_pending *p);
/* What the peers published in the round whose slots were read last
 * (peer_ent): rank r's entry under tag, or NULL; that entry checked for a
 * read of [off, +len) (exactly len bytes where exact); that range mapped
 * for this rank's streams into *ptr_p, the mapping kept in p. */
const struct entry *uccl__sg_peer_entry(uccl_sg_t *sg, int r, uint64_t tag);
int uccl__sg_find_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                        size_t len, int exact, const struct entry **e_p);
int uccl__sg_map_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                       size_t len, int exact, struct pending *p, uintptr_t *ptr_p);
/* ---- sg_p2p.c (under mu): a pending message's failure reasons, for sg_watch.c ---- */
void uccl__sg_p2p_why(uccl_sg_t *sg, const struct p2p_pending *p, int closing, char *why,
                      size_t len);
int uccl__sg_p2p_unmatched(uccl_sg_t *sg, const struct p2p_pending *p); /* the peer never posted it */

/* ---- sg_graph.c: captured rounds ---- */
/* Whether the caller's stream captures: then *g_p the round's graph slot
 * (else -1), or an error where the round cannot be captured. */
int uccl__sg_graph_check(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what,
                         long *g_p);
/* A captured round's handshake at off (OFF_READY, OFF_DONE, OFF_DONE2) on
 * stream X, the peers in reads awaited (ops: room for size + 2). */
int uccl__sg_graph_handshake(uccl_sg_t *sg, uintptr_t X, uint32_t g, int off,
                             const unsigned char *reads, struct uccl__sg_memop *ops);
/* Its mappings, kept until close; its graph slot taken. */
int uccl__sg_graph_keep(uccl_sg_t *sg, struct pending p);
/* A message captured on stream X (sg_p2p.c; under p2p_mu): row j of
 * channel ch, this rank's side; second: this side copies cp (the peer's
 * buffer mapped) after the other side's ready word, else it writes its
 * ready word.  Its mapping and pinned registration (imp, reg) are kept
 * until close; *code_p names it for uccl__sg_graph_msg_wait. */
int uccl__sg_graph_msg(uccl_sg_t *sg, uintptr_t X, uint32_t c, uint32_t j, int side, int second,
                       const struct uccl_sg_copy *cp, void *imp, uint64_t reg, uint32_t *id_p);
/* Stream waits until captured message id is in place (after what its
 * own stream queued for it). */
int uccl__sg_graph_msg_wait(uccl_sg_t *sg, uint32_t id, uintptr_t stream);
/* A captured one-launch round of nbytes per rank, round k: its own arena
 * made and registered (in p, kept until close), *e the entry that
 * publishes it; then, once the peers' slots of the round are read, their
 * arenas mapped (into p) and the launch queued on stream X. */
int uccl__sg_graph_arena(uccl_sg_t *sg, size_t nbytes, uint32_t k, struct pending *p,
                         struct entry *e);
int uccl__sg_graph_fused(uccl_sg_t *sg, const struct uccl_sg_fused *fz, const char *what,
                         uintptr_t X, struct pending *p);
/* At close, once no stream can replay them: the captured rounds' arenas'
 * memory. */
void uccl__sg_graph_free(uccl_sg_t *sg);

#endif
