/* One round of a stream-ordered group (sgroup.h): the call checked, this
 * rank's buffers published, the peers' read and compared, their ranges
 * mapped, and the phases queued on the group's stream.
 *
 * A one-launch round (struct uccl_sg_fused) publishes only its call: its
 * input goes through this rank's arena, which every peer mapped at the
 * group's first round (of either kind), so the host waits for no peer.
 * Its call is compared with the peers' at the next round (or at once where
 * it is the round that exchanges the arenas).  Arena slots alternate
 * between rounds: a round starts on the GPU only once every peer's stream
 * is past the round before the last one (each round waits for a ready word
 * every peer writes when it reaches a round, of either kind), so the slot
 * it fills was read by all.  A two-sided round's handshakes write their
 * words to the page and the arena; where the launches may spin they poll
 * the arenas (one launch), elsewhere the page (stream memory operations). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg/sg_page.h"
#include "net/sock.h"
#include "base/status.h"

#define FZ_TAG (2ull << 40)  /* the arena's entry, published in the first round that can carry it */
#define FZ_INFO (3ull << 40) /* ... and the rank's GPU identity (addr: uccl__sg_dev.fused_id) */

/* ---- checks -------------------------------------------------------------------------- */
static int check_op(const char *what, int dt, int op)
{
    int flt = dt == UCCL_DT_F32 || dt == UCCL_DT_F64 || dt == UCCL_DT_F16 || dt == UCCL_DT_BF16;
    if ((flt && (op == UCCL_RED_BAND || op == UCCL_RED_BOR || op == UCCL_RED_BXOR)) ||
        (dt == UCCL_DT_BOOL && op == UCCL_RED_AVG))
        return uccl__err(UCCL_ERR_INVALID, "%s: operator %d is not defined for element type "
                         "%d (bitwise operators need integers or bool; AVG a number)", what, op, dt);
    if (!uccl_dtype_size(dt) || op < 0 || op >= UCCL_RED_COUNT)
        return uccl__err(UCCL_ERR_INVALID, "%s: reduction of type %d, operator %d", what, dt, op);
    return UCCL_OK;
}

static int check_call(uccl_sg_t *sg, const struct uccl_sg_call *c)
{
    const char *what = c->what ? c->what : "exchange";
    if (c->phases < 1 || c->phases > 2 || c->npub < 0 || c->npull < 0 || c->ncopy < 0)
        return uccl__err(UCCL_ERR_INVALID, "%s: %d phases, %d publications, %d pulls, %d copies",
                         what, c->phases, c->npub, c->npull, c->ncopy);
    if (c->npub > MAX_ENTRIES)
        return uccl__err(UCCL_ERR_INVALID, "%s: %d buffers in one round (at most %d)", what,
                         c->npub, MAX_ENTRIES);
    for (int i = 0; i < c->npull; i++) {
        const struct uccl_sg_pull *p = &c->pull[i];
        if (p->peer < 0 || p->peer >= sg->size || p->peer == sg->rank || p->phase < 1 ||
            p->phase > c->phases || p->off + p->len < p->off)
            return uccl__err(UCCL_ERR_INVALID, "%s: pull %d from rank %d (phase %d, offset "
                             "%llu, %zu bytes) in a group of %d (this rank %d, %d phases)", what,
                             i, p->peer, p->phase, (unsigned long long)p->off, p->len, sg->size,
                             sg->rank, c->phases);
    }
    const struct uccl_sg_fused *f = c->fused;
    if (f && (!sg->fz_arena || f->nbytes > sg->fz_slot))
        return uccl__err(UCCL_ERR_INVALID, "%s: a one-launch round of %zu bytes in a group of "
                         "%d, arena slots of %zu bytes", what, f->nbytes, sg->size, sg->fz_slot);
    int rc = f && !f->gather ? check_op(what, f->dtype, f->op) : UCCL_OK;
    if (rc)
        return rc;
    if (c->red) {
        if ((rc = check_op(what, c->red->dtype, c->red->op)))
            return rc;
        size_t esz = uccl_dtype_size(c->red->dtype);
        if (c->red->count > SIZE_MAX / esz || c->red->off + c->red->count * esz < c->red->off)
            return uccl__err(UCCL_ERR_INVALID, "%s: reduction of %zu elements of type %d at "
                             "offset %llu", what, c->red->count, c->red->dtype,
                             (unsigned long long)c->red->off);
    }
    return UCCL_OK;
}

/* This rank's own non-empty publication under tag in call c, or NULL. */
static const struct uccl_sg_pub *own_entry(const struct uccl_sg_call *c, uint64_t tag)
{
    for (int i = 0; i < c->npub; i++)
        if (c->pub[i].tag == tag && c->pub[i].len)
            return &c->pub[i];
    return NULL;
}

static size_t arena_len(const uccl_sg_t *sg) { return 2 * sg->fz_slot + UCCL_SG_FUSED_TAIL; }

/* Rank r's arena tail (counters, then words) as mapped here; this rank's
 * own too (fz_peer[rank] is the arena). */
static uintptr_t arena_tail(const uccl_sg_t *sg, int r) { return sg->fz_peer[r] + 2 * sg->fz_slot; }

/* This rank is done with the peers' slots of round k (and what they published there). */
static void consumed(uccl_sg_t *sg, uint32_t k) { st64(w64(sg, sg->rank, OFF_CONSUMED), k); }

/* A slot header's operation name (16 bytes, not always terminated). */
static void head_name(const struct slot_head *h, char out[17])
{
    memcpy(out, h->what, 16);
    out[16] = '\0';
}

/* A call in words, for a mismatch's message: "broadcast(root 1, 20 bytes)",
 * "all_reduce(SUM, 12 elements of int64, one launch)"; a general round's
 * kind and argument as numbers. */
static void call_words(const char *what, uint32_t kind, uint64_t arg, char *out, size_t len)
{
    int k = UCCL_SG_KIND_OP(kind), red = k == UCCL_SG_K_ALLREDUCE ||
                                         k == UCCL_SG_K_REDUCE_SCATTER || k == UCCL_SG_K_REDUCE;
    const char *launch = kind & UCCL_SG_FUSED_KIND ? ", one launch" : "";
    char root[32] = "";
    if (k == UCCL_SG_K_BROADCAST || k == UCCL_SG_K_REDUCE)
        snprintf(root, sizeof(root), "root %d, ", UCCL_SG_KIND_ROOT(kind));
    if (red)
        snprintf(out, len, "%s(%s%s, %llu elements of %s%s)", what, root,
                 uccl_red_name(UCCL_SG_KIND_RED(kind)), (unsigned long long)arg,
                 uccl_dtype_name(UCCL_SG_KIND_DTYPE(kind)), launch);
    else if (k == UCCL_SG_K_ALLGATHER || k == UCCL_SG_K_BROADCAST)
        snprintf(out, len, "%s(%s%llu bytes%s)", what, root, (unsigned long long)arg, launch);
    else
        snprintf(out, len, "%s(kind %#x, argument %llu)", what, kind, (unsigned long long)arg);
}

/* Rank r's call in round k (its slot's header h) against this rank's: the
 * operation's kind (with its type, operator, root) and argument, its
 * phases.  (General rounds of different operations are told apart by what
 * they publish and pull, buffer by buffer: map_range.) */
static int compare(uccl_sg_t *sg, int r, uint32_t k, const struct slot_head *h, uint32_t kind,
                   uint64_t arg, int phases, const char *what)
{
    if (h->kind == kind && h->arg == arg && (int)h->phases == phases)
        return UCCL_OK;
    char theirs[17], a[160], b[160];
    head_name(h, theirs);
    call_words(theirs, h->kind, h->arg, a, sizeof(a));
    call_words(what, kind, arg, b, sizeof(b));
    return uccl__err(UCCL_ERR_MISMATCH, "%s: the ranks' calls disagree in round %u: rank %d "
                     "calls %s, rank %d calls %s%s", what, k, r, a, sg->rank, b,
                     (h->kind ^ kind) == UCCL_SG_FUSED_KIND ? "; one of them a one-launch round: "
                     "UCCL_SG_FUSED_BYTES must be the same on every rank" : "");
}

/* Rank r's slot of round k once it arrived there (waited for, in the
 * course of `what`), its call compared with this rank's (named call: kind,
 * arg, phases); NULL with *rc_p set on a failure. */
static const struct slot_head *arrived_same(uccl_sg_t *sg, int r, uint32_t k, uint32_t kind,
                                            uint64_t arg, int phases, const char *call,
                                            const char *what, uint64_t deadline,
                                            uccl_sg_interrupt_fn intr, void *intr_arg,
                                            int *rc_p)
{
    int rc = uccl__sg_host_wait(sg, uccl__sg_arrived, k, r, what, deadline, intr, intr_arg,
                                "rank %d arriving at round %u", r, k);
    const struct slot_head *h = (const struct slot_head *)slot(sg, r, k);
    if (!rc)
        rc = compare(sg, r, k, h, kind, arg, phases, call);
    *rc_p = rc;
    return rc ? NULL : h;
}

/* The last round's call, if it was a one-launch round, against the peers'
 * (their slots of it: they published it before they ran it), then that
 * round's slots are this rank's no longer. */
static int check_unchecked(uccl_sg_t *sg, const char *what, uint64_t deadline,
                           uccl_sg_interrupt_fn intr, void *intr_arg)
{
    uint32_t u = sg->fz_unchecked;
    if (!u)
        return UCCL_OK;
    const struct slot_head *mine = (const struct slot_head *)slot(sg, sg->rank, u);
    char mine_what[17];
    head_name(mine, mine_what);
    int rc = UCCL_OK;
    for (int r = 0; r < sg->size && !rc; r++)
        if (r != sg->rank)
            arrived_same(sg, r, u, mine->kind, mine->arg, (int)mine->phases, mine_what, what,
                         deadline, intr, intr_arg, &rc);
    if (rc)
        return rc;
    consumed(sg, u);
    sg->fz_unchecked = 0;
    return UCCL_OK;
}

/* Read every peer's slot of round k (waiting for them to arrive) and
 * compare their calls with this one. */
static int read_peers(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                      uint64_t deadline, uccl_sg_interrupt_fn intr, void *intr_arg)
{
    for (int r = 0; r < sg->size; r++) {
        if (r == sg->rank)
            continue;
        int rc;
        const struct slot_head *h = arrived_same(sg, r, k, c->kind, c->arg, c->phases, what,
                                                 what, deadline, intr, intr_arg, &rc);
        if (rc)
            return rc;
        /* read once: the peer's process writes the page, the bound checked is the one used */
        uint32_t count = __atomic_load_n(&h->count, __ATOMIC_RELAXED);
        if (count > (uint32_t)MAX_ENTRIES)
            return uccl__err(UCCL_ERR_PROTO, "%s: rank %d published %u buffers (at most %d)",
                             what, r, count, MAX_ENTRIES);
        sg->peer_cnt[r] = count;
        memcpy(sg->peer_ent + (size_t)r * MAX_ENTRIES, (const uint8_t *)h + sizeof(*h),
               (size_t)count * ENTRY_BYTES);
    }
    return UCCL_OK;
}

static void memop(struct uccl__sg_memop *ops, int *n, uint32_t *addr, uint32_t v, int wait)
{
    ops[(*n)++] = (struct uccl__sg_memop){addr, v, wait, NULL};
}

/* Rank r's word (a page offset: OFF_READY, OFF_DONE, OFF_DONE2) in its
 * arena as mapped here (the arenas are mapped: fz_mapped). */
static uintptr_t arena_word(const uccl_sg_t *sg, int r, int off)
{
    int a = off == OFF_READY ? UCCL_SG_FUSED_READY
            : off == OFF_DONE ? UCCL_SG_FUSED_DONE : UCCL_SG_FUSED_DONE2;
    return arena_tail(sg, r) + (size_t)a;
}

/* A rank's round words that are in its arena too (fin is in the page only);
 * what a refresh and a renumbering set. */
static const int ROUND_WORDS[] = {OFF_READY, OFF_DONE, OFF_DONE2};
#define NROUND_WORDS (int)(sizeof(ROUND_WORDS) / sizeof(ROUND_WORDS[0]))

/* A refresh (REFRESH_EVERY), on stream X before round k: every word of
 * this rank's that a round may leave unwritten (two-sided rounds' done
 * words in a run of one-launch rounds, the launches' seen word in a run of
 * rounds without them) set to k - 1, in the page and the arena. */
static int refresh_words(uccl_sg_t *sg, uintptr_t X, uint32_t k)
{
    struct uccl__sg_memop ops[2 * NROUND_WORDS + 2];
    int n = 0;
    for (int i = 0; i < NROUND_WORDS; i++) {
        memop(ops, &n, w32(sg, sg->rank, ROUND_WORDS[i]), k - 1, 0);
        if (sg->fz_arena)
            memop(ops, &n, (uint32_t *)arena_word(sg, sg->rank, ROUND_WORDS[i]), k - 1, 0);
    }
    memop(ops, &n, w32(sg, sg->rank, OFF_FIN), k - 1, 0);
    if (sg->fz_arena)
        memop(ops, &n, (uint32_t *)(arena_tail(sg, sg->rank) + UCCL_SG_FUSED_SEEN), k - 1, 0);
    uccl__sg_reg_age(sg, k);
    return sg->ops->memops(sg->d, X, ops, n);
}

/* A handshake's launch argument (struct uccl__sg_sync_args: this rank's
 * word at off set to k, a wait for the word of every peer in reads (a flag
 * a rank), then this rank's fin word if fin), where the group's launches
 * may spin (the arenas mapped, uccl_sg_fused_bytes); else 0. */
static int sync_args(uccl_sg_t *sg, uint32_t k, int off, const unsigned char *reads,
                     int fin, struct uccl__sg_sync_args *a)
{
    int n = sg->size, me = sg->rank;
    if (!sg->fz_mapped || n > UCCL_SG_FUSED_RANKS || __atomic_load_n(&sg->fz_off, __ATOMIC_RELAXED))
        return 0;
    *a = (struct uccl__sg_sync_args){.k = k, .me = me, .n = n, .mine = arena_word(sg, me, off),
                                     .page = w32(sg, me, off),
                                     .fin = fin ? w32(sg, me, OFF_FIN) : NULL,
                                     .failed = (uint32_t *)sg->page};
    for (int r = 0; r < n; r++) {
        a->peer[r] = arena_word(sg, r, off);
        a->mask |= reads[r] && r != me ? 1u << r : 0;
    }
    return 1;
}

/* On stream X: the handshake of sync_args.  One launch that polls the
 * arenas where it may spin, else stream memory operations on the page's
 * words (ops: room for size + 3).  The word goes to the page and, once the
 * arenas are mapped, to the arena either way: ranks that take different
 * ways still see each other's.  At 4 ranks on one H200 under MPS, a
 * handshake of memory operations took 13-19 us on the GPU
 * (benchmarks/stream_sync_floor.py). */
static int handshake(uccl_sg_t *sg, uintptr_t X, uint32_t k, int off,
                     const unsigned char *reads, int fin, struct uccl__sg_memop *ops)
{
    const struct uccl__sg_dev *dv = sg->ops;
    int n = sg->size, me = sg->rank, nops = 0, rc = UCCL_ERR_UNAVAIL;
    struct uccl__sg_sync_args a;
    if (dv->sync && sync_args(sg, k, off, reads, fin, &a))
        rc = dv->sync(sg->d, X, &a);
    if (rc != UCCL_ERR_UNAVAIL)
        return rc;
    memop(ops, &nops, w32(sg, me, off), k, 0);
    if (sg->fz_mapped)
        memop(ops, &nops, (uint32_t *)arena_word(sg, me, off), k, 0);
    for (int r = 0; r < n; r++)
        if (reads[r] && r != me)
            memop(ops, &nops, w32(sg, r, off), k, 1);
    if (fin)
        memop(ops, &nops, w32(sg, me, OFF_FIN), k, 0);
    return dv->memops(sg->d, X, ops, nops);
}

/* A one-phase round with no reduction as one launch where the device makes
 * one (the handshakes of queue_round around the copies cs: ready waiting
 * for the peers in reads, done for all), else UCCL_ERR_UNAVAIL. */
static int gather_launch(uccl_sg_t *sg, uintptr_t X, uint32_t k, const unsigned char *reads,
                         const unsigned char *all, const struct uccl_sg_copy *cs, int n)
{
    struct uccl__sg_sync_args ready, done;
    if (!sg->ops->gather || !sync_args(sg, k, OFF_READY, reads, 0, &ready) ||
        !sync_args(sg, k, OFF_DONE, all, 1, &done))
        return UCCL_ERR_UNAVAIL;
    return sg->ops->gather(sg->d, X, &ready, cs, n, &done, arena_tail(sg, sg->rank));
}

/* Copies of one phase in one call: cs (n of them) on `stream`. */
static int copies(uccl_sg_t *sg, uintptr_t stream, struct uccl_sg_copy *cs, int n)
{
    return n ? sg->ops->copies(sg->d, stream, cs, n) : UCCL_OK;
}

/* The order of the pulls: from rank me+1 first, then me+2, ... (stable
 * within a peer).  Copies from several GPUs on one stream run one after
 * another; in this order each step is a permutation, every GPU read by one
 * peer and reading one, where in rank order every rank would read rank 0
 * first, n-1 readers sharing its links (4 x H200, 256 MiB a peer: one
 * reader a GPU moved 383 GB/s into each, benchmarks/gpu_copy_ceiling.py
 * ring-pull, against 228 for n-1 readers at once).  Every peer is another
 * rank of the group (check_call). */
static void pull_order(const struct uccl_sg_call *c, int n, int me, int *order)
{
    int m = 0;
    for (int d = 1; d < n; d++)
        for (int i = 0; i < c->npull; i++)
            if ((c->pull[i].peer - me + n) % n == d)
                order[m++] = i;
}

/* Everything after the slots were read, on stream X: map, then queue the
 * phases (ready written with the waits for the peers read, in one call). */
static int queue_round(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                       uintptr_t X, struct pending *p, struct uccl__sg_memop *ops, long g)
{
    const struct uccl__sg_dev *dv = sg->ops;
    int n = sg->size, me = sg->rank, rc = UCCL_OK, n1 = 0, n2 = 0;
    struct uccl_sg_copy *cp = calloc((size_t)c->npull + (size_t)c->ncopy + 1, sizeof(*cp));
    int *order = calloc((size_t)c->npull + 1, sizeof(*order));
    struct uccl__sg_red_args ra;
    memset(&ra, 0, sizeof(ra));
    unsigned char reads[UCCL_SG_MAX_RANKS] = {0};
    if (!cp || !order) {
        free(cp);
        free(order);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    pull_order(c, n, me, order);
    /* phase 1's copies first in cp, phase 2's from the end */
    struct uccl_sg_copy *cp2 = cp + c->npull + c->ncopy;
    for (int i = 0; i < c->npull && !rc; i++) {
        const struct uccl_sg_pull *q = &c->pull[order[i]];
        if (q->len == 0) { /* nothing to map or copy; an exact one still pairs with the peer's */
            const struct entry *e;
            if (q->exact)
                rc = uccl__sg_find_range(sg, what, q->peer, q->tag, q->off, 0, 1, &e);
            continue;
        }
        struct uccl_sg_copy *to = q->phase == 1 ? &cp[n1++] : &cp2[-++n2];
        *to = (struct uccl_sg_copy){q->dst, 0, q->len};
        rc = uccl__sg_map_range(sg, what, q->peer, q->tag, q->off, q->len, q->exact, p, &to->src);
        if (q->phase == 1)
            reads[q->peer] = 1;
    }
    for (int i = 0; i < c->ncopy; i++)
        if (c->copy[i].len && c->copy[i].dst != c->copy[i].src)
            cp[n1++] = c->copy[i];
    const struct uccl_sg_red *red = c->red;
    if (!rc && red && red->count) {
        size_t nb = red->count * uccl_dtype_size(red->dtype);
        ra = (struct uccl__sg_red_args){red->dtype, red->op, n, red->out, {0}, red->count};
        for (int r = 0; r < n && !rc; r++) {
            if (r == me) {
                const struct uccl_sg_pub *o = own_entry(c, red->tag);
                if (!o || red->off > o->len || nb > o->len - red->off)
                    rc = uccl__err(UCCL_ERR_INVALID, "%s: the reduction reads [%llu, +%zu) of "
                                   "this rank's buffer (tag %#llx), which is %zu bytes", what,
                                   (unsigned long long)red->off, nb,
                                   (unsigned long long)red->tag, o ? o->len : 0);
                else
                    ra.src[r] = o->ptr + red->off;
            } else {
                rc = uccl__sg_map_range(sg, what, r, red->tag, red->off, nb, 0, p, &ra.src[r]);
                reads[r] = 1;
            }
        }
    }
    free(order);
    if (rc) {
        free(cp);
        return rc;
    }
    /* every peer's buffers this round are read and mapped: their slots may
     * be reused, and their registrations dropped (not before: a peer's
     * eviction follows this word) */
    consumed(sg, k);
    unsigned char all[UCCL_SG_MAX_RANKS];
    memset(all, 1, sizeof(all));
    int two = c->phases == 2;
    if (!two && !(red && red->count) && g < 0) {
        rc = gather_launch(sg, X, k, reads, all, cp, n1);
        if (rc != UCCL_ERR_UNAVAIL) {
            free(cp);
            return rc;
        }
    }
    /* a captured round (g, its graph slot): its own words, no fin */
#define HS(off, rd, fin) (g < 0 ? handshake(sg, X, k, off, rd, fin, ops) \
                                : uccl__sg_graph_handshake(sg, X, (uint32_t)g, off, rd, ops))
    rc = HS(OFF_READY, reads, 0);
    if (!rc)
        rc = copies(sg, X, cp, n1);
    if (!rc && red && red->count)
        rc = dv->reduce(sg->d, X, &ra);
    if (!rc)
        rc = HS(OFF_DONE, all, !two);
    if (!rc && two)
        rc = copies(sg, X, cp2 - n2, n2);
    if (!rc && two)
        rc = HS(OFF_DONE2, all, 1);
#undef HS
    free(cp);
    return rc;
}

/* A one-launch round's steps one by one, for a device without the launch
 * (the emulated one) or a round the launch does not take: the same words,
 * copies and reduction.  Its ready word goes to the arena too, where a
 * peer's launch for the same round polls it (a peer's in-place all_reduce
 * may be aligned where this rank's is not). */
static int fused_steps(uccl_sg_t *sg, uintptr_t X, const struct uccl__sg_fused_args *a)
{
    const struct uccl__sg_dev *dv = sg->ops;
    struct uccl__sg_memop ops[UCCL_SG_FUSED_RANKS + 2];
    struct uccl_sg_copy cs[UCCL_SG_FUSED_RANKS];
    int nops = 0, ncs = 0, me = a->me;
    cs[0] = (struct uccl_sg_copy){a->slot[me], a->in, a->nbytes};
    int rc = copies(sg, X, cs, a->nbytes ? 1 : 0);
    memop(ops, &nops, (uint32_t *)a->dready[me], a->k, 0);
    memop(ops, &nops, a->ready[me], a->k, 0);
    for (int r = 0; r < a->nsrc; r++)
        if (r != me)
            memop(ops, &nops, a->ready[r], a->k, 1);
    if (!rc)
        rc = dv->memops(sg->d, X, ops, nops);
    if (!rc && a->gather) {
        for (int r = 0; r < a->nsrc; r++) {
            uintptr_t dst = a->out + (size_t)r * a->nbytes, src = r == me ? a->in : a->slot[r];
            if (a->nbytes && dst != src)
                cs[ncs++] = (struct uccl_sg_copy){dst, src, a->nbytes};
        }
        rc = copies(sg, X, cs, ncs);
    } else if (!rc && a->count) {
        struct uccl__sg_red_args ra = {a->dtype, a->op, a->nsrc, a->out, {0}, a->count};
        for (int r = 0; r < a->nsrc; r++)
            ra.src[r] = r == me ? a->in : a->slot[r];
        rc = dv->reduce(sg->d, X, &ra);
    }
    nops = 0;
    memop(ops, &nops, a->fin, a->k, 0);
    return rc ? rc : dv->memops(sg->d, X, ops, nops);
}

/* The slots alternate per one-launch round (a bit of its own: round numbers
 * skip 0 when they wrap, which would give two rounds in a row one slot).
 * The launch where the device makes one for this round, else the steps. */
static int queue_fused(uccl_sg_t *sg, const struct uccl_sg_fused *fz, uint32_t k, uintptr_t X)
{
    struct uccl__sg_fused_args a = {.gather = fz->gather, .dtype = fz->dtype, .op = fz->op,
                                    .nsrc = sg->size, .me = sg->rank, .k = k, .in = fz->in,
                                    .out = fz->out, .ctr = arena_tail(sg, sg->rank),
                                    .nbytes = fz->nbytes, .count = fz->count,
                                    .fin = w32(sg, sg->rank, OFF_FIN),
                                    .failed = (uint32_t *)sg->page};
    for (int r = 0; r < sg->size; r++) {
        a.slot[r] = sg->fz_peer[r] + sg->fz_flip * sg->fz_slot;
        a.ready[r] = w32(sg, r, OFF_READY);
        a.dready[r] = arena_word(sg, r, OFF_READY);
    }
    sg->fz_flip ^= 1;
    int rc = sg->ops->fused ? sg->ops->fused(sg->d, X, &a) : UCCL_ERR_UNAVAIL;
    return rc == UCCL_ERR_UNAVAIL ? fused_steps(sg, X, &a) : rc;
}

/* The first round that carried the arenas: map every peer's, for the
 * group's life; and whether to go on with one-launch rounds and handshake
 * launches (every rank decides the same from the same entries: not where
 * two ranks' GPU identities are the same, uccl__sg_dev.fused_id says why). */
static int map_arenas(uccl_sg_t *sg, const char *what, uint64_t my_id)
{
    struct pending p = {.imp = sg->fz_imp};
    uint64_t ids[UCCL_SG_FUSED_RANKS];
    int rc = UCCL_OK;
    for (int r = 0; r < sg->size; r++) {
        const struct entry *e = r == sg->rank ? NULL : uccl__sg_peer_entry(sg, r, FZ_INFO);
        ids[r] = r == sg->rank ? my_id : e ? e->addr : 0;
    }
    for (int r = 0; r < sg->size && !rc; r++)
        if (r != sg->rank)
            rc = uccl__sg_map_range(sg, what, r, FZ_TAG, 0, arena_len(sg), 1, &p, &sg->fz_peer[r]);
    sg->fz_nimp = p.nimp;
    sg->fz_mapped = !rc;
    int off = 0;
    for (int r = 0; r < sg->size; r++)
        for (int q = r + 1; q < sg->size; q++)
            off |= ids[r] && ids[r] == ids[q];
    __atomic_store_n(&sg->fz_off, off, __ATOMIC_RELAXED);
    return rc;
}

/* A two-sided round that carried this rank's arena: map the peers' where
 * every one offered its own, as long as this rank's (else stop offering:
 * a rank with UCCL_SG_FUSED_BYTES=0, or another size, runs no one-launch
 * round, and its handshakes stay on the page). */
static int take_arenas(uccl_sg_t *sg, const char *what, uint64_t my_id)
{
    for (int r = 0; r < sg->size; r++) {
        const struct entry *e = r == sg->rank ? NULL : uccl__sg_peer_entry(sg, r, FZ_TAG);
        if (r != sg->rank && (!e || e->len != arena_len(sg))) {
            sg->fz_tried = 1;
            return UCCL_OK;
        }
    }
    return map_arenas(sg, what, my_id);
}

/* Read on every all_reduce and allgather, without the call lock: fz_slot is
 * set once before any round (0 until then; no arena is taken for more than
 * UCCL_SG_FUSED_RANKS ranks), fz_off at most once, where the arenas are
 * mapped. */
size_t uccl_sg_fused_bytes(uccl_sg_t *sg)
{
    return __atomic_load_n(&sg->fz_off, __ATOMIC_RELAXED)
               ? 0 : __atomic_load_n(&sg->fz_slot, __ATOMIC_RELAXED);
}

int uccl_sg_fused_arena(uccl_sg_t *sg, uintptr_t ptr, size_t len, size_t slot_bytes)
{
    size_t need = 2 * slot_bytes + UCCL_SG_FUSED_TAIL;
    if (!ptr || (ptr & 15) || !slot_bytes || slot_bytes % 16 ||
        slot_bytes > (SIZE_MAX - UCCL_SG_FUSED_TAIL) / 2 || len < need ||
        sg->size > UCCL_SG_FUSED_RANKS)
        return uccl__err(UCCL_ERR_INVALID, "one-launch rounds: arena %#lx of %zu bytes, slots "
                         "of %zu bytes (multiples of 16; two slots and %d bytes needed), %d "
                         "ranks (at most %d)", (unsigned long)ptr, len, slot_bytes,
                         UCCL_SG_FUSED_TAIL, sg->size, UCCL_SG_FUSED_RANKS);
    pthread_mutex_lock(&sg->call_mu);
    int rc = UCCL_OK;
    uint64_t key = 0, reg = 0;
    if (sg->fz_arena)
        rc = uccl__err(UCCL_ERR_INVALID, "one-launch rounds: the arena is set already");
    else if (sg->round) /* its words start at 0: a round number to come */
        rc = uccl__err(UCCL_ERR_INVALID, "one-launch rounds: the arena comes before the group's "
                       "first round (this rank is at round %u)", sg->round);
    else if (!(rc = uccl__sg_reg_key(sg, ptr, need, sg->round, &key, &reg))) {
        sg->fz_arena = sg->fz_peer[sg->rank] = ptr; /* pinned: every peer maps it until close */
        sg->fz_key = key;
        __atomic_store_n(&sg->fz_slot, slot_bytes, __ATOMIC_RELAXED); /* last: fused_bytes */
    }
    pthread_mutex_unlock(&sg->call_mu);
    return rc;
}

int uccl_sg_round_renumber(uccl_sg_t *sg, uint32_t k, uint32_t lag)
{
    pthread_mutex_lock(&sg->call_mu);
    int rc = UCCL_OK;
    if (sg->round) {
        rc = uccl__err(UCCL_ERR_INVALID, "stream-ordered group (rank %d): round %u was run "
                       "already: too late to renumber the rounds", sg->rank, sg->round);
    } else if (k) {
        __atomic_store_n(&sg->round, k, __ATOMIC_RELAXED);
        for (int i = 0; i < NROUND_WORDS; i++) {
            int off = ROUND_WORDS[i];
            uint32_t v = off == OFF_READY ? k : k - lag; /* done words: as if left */
            st32(w32(sg, sg->rank, off), v);
            if (sg->fz_arena) /* the emulated device's memory: the host's */
                st32((uint32_t *)arena_word(sg, sg->rank, off), v);
        }
        st32(w32(sg, sg->rank, OFF_FIN), k);
        if (sg->fz_arena) /* the launches' seen word too: a later round waits for block 0 */
            st32((uint32_t *)(arena_tail(sg, sg->rank) + UCCL_SG_FUSED_SEEN), k);
        consumed(sg, k);
    }
    pthread_mutex_unlock(&sg->call_mu);
    return rc;
}

/* The stream round k runs on: the caller's own where the call blocks (its
 * stream then orders what follows after the round with no event), else the
 * group's (after an event of the caller's: work queued after the call may
 * overlap the round).  A round on another stream than the last one starts
 * after everything the group queued there: the words only grow. */
static int order_round(uccl_sg_t *sg, const struct uccl_sg_call *c, uintptr_t *X_p)
{
    uintptr_t X = c->caller_waits ? c->caller : sg->own;
    int rc = UCCL_OK;
    if (X != sg->last) {
        rc = sg->ops->record(sg->d, sg->ev_mark, sg->last);
        if (!rc)
            rc = sg->ops->wait_event(sg->d, X, sg->ev_mark);
    }
    if (!rc && X != c->caller) {
        rc = sg->ops->record(sg->d, sg->ev_start, c->caller);
        if (!rc)
            rc = sg->ops->wait_event(sg->d, X, sg->ev_start);
    }
    if (!rc) {
        sg->last = X;
        *X_p = X;
    }
    return rc;
}

static int round_locked(uccl_sg_t *sg, const struct uccl_sg_call *c, uccl_sg_interrupt_fn intr,
                        void *intr_arg, uint32_t *round_p)
{
    const char *what = c->what ? c->what : "exchange";
    if (uccl_sg_error(sg))
        return uccl__sg_failed_err(sg, what);
    long g;
    int rc = check_call(sg, c);
    if (!rc)
        rc = uccl__sg_graph_check(sg, c, what, &g);
    if (rc)
        return rc;
    uint32_t k = sg->round + 1;
    if (k == 0)
        k = 1;
    uccl__sg_reclaim(sg);
    uint64_t deadline = uccl__now_ns() + sg->timeout_ns;
    if ((rc = check_unchecked(sg, what, deadline, intr, intr_arg)))
        return uccl__sg_fail_rc(sg, rc);
    /* the slot of round k was last used by round k - NSLOT: every peer has read it */
    if ((rc = uccl__sg_host_wait(sg, uccl__sg_consumed_ready, k, -1, what, deadline, intr,
                                 intr_arg, "peers reading round %u", k - NSLOT)))
        return rc;
    struct entry ent[MAX_ENTRIES];
    int nent = 0;
    for (int i = 0; i < c->npub && !rc; i++) {
        ent[nent] = (struct entry){c->pub[i].tag, 0, c->pub[i].ptr, c->pub[i].len};
        if (c->pub[i].len) /* an empty one: no memory to share, but the peer's exact pull checks it */
            rc = uccl__sg_reg_key(sg, c->pub[i].ptr, c->pub[i].len, k, &ent[nent].key, NULL);
        nent++;
    }
    /* a captured one-launch round exchanges: the peers map its own arena */
    int fused = c->fused != NULL, exchange = !fused || !sg->fz_mapped || g >= 0;
    /* the arenas go with the first round that reads the peers' slots,
     * whatever its kind: a two-sided round's handshakes poll them too */
    int arenas = exchange && sg->fz_arena && !sg->fz_mapped &&
                 (fused || (!sg->fz_tried && nent + 2 <= MAX_ENTRIES));
    uint64_t id = 0; /* this rank's GPU identity, where the arenas go */
    if (arenas) {
        id = sg->ops->fused_id ? sg->ops->fused_id(sg->d) : 0;
        ent[nent++] = (struct entry){FZ_TAG, sg->fz_key, sg->fz_arena, arena_len(sg)};
        ent[nent++] = (struct entry){FZ_INFO, 0, id, 0};
    }
    if (rc)
        return uccl__sg_fail_rc(sg, rc);
    __atomic_store_n(&sg->round, k, __ATOMIC_RELAXED); /* posts read it (sg_p2p.c) */
    /* what a two-sided round maps, and its word operations (a one-launch
     * round has neither) */
    struct pending p = {.k = k, .t0 = uccl__now_ns()};
    struct uccl__sg_memop *ops = NULL;
    if (!fused || g >= 0)
        p.imp = calloc((size_t)c->npull + (size_t)sg->size + 1, sizeof(void *));
    if (!fused)
        ops = calloc(2 * (size_t)sg->size + 2, sizeof(*ops));
    if ((!fused || g >= 0) && (!p.imp || (!fused && !ops))) {
        free(p.imp);
        free(ops);
        uccl__err(UCCL_ERR_NOMEM, "out of memory");
        return uccl__sg_fail_rc(sg, UCCL_ERR_NOMEM);
    }
    if (fused && g >= 0) /* kept with the round's mappings until close, even if this fails */
        rc = uccl__sg_graph_arena(sg, c->fused->nbytes, k, &p, &ent[nent++]);
    uintptr_t X = c->caller; /* captured: on the capturing stream, nothing else joins it */
    if (!rc && g < 0)
        rc = order_round(sg, c, &X);
    if (!rc && g < 0 && refresh_due(k))
        rc = refresh_words(sg, X, k);
    if (!rc) { /* publish: entries and header, the round alone and last */
        uint8_t *s = slot(sg, sg->rank, k);
        struct slot_head *h = (struct slot_head *)s;
        memcpy(s + sizeof(*h), ent, (size_t)nent * ENTRY_BYTES);
        h->count = (uint32_t)nent;
        h->kind = c->kind;
        h->arg = c->arg;
        h->phases = (uint32_t)c->phases;
        memset(h->what, 0, sizeof(h->what));
        strncpy(h->what, what, sizeof(h->what));
        st64(&h->round, k);
        if (exchange)
            rc = read_peers(sg, c, what, k, deadline, intr, intr_arg);
    }
    if (!rc && fused && g >= 0) {
        rc = arenas ? map_arenas(sg, what, id) : UCCL_OK;
        if (!rc)
            rc = uccl__sg_graph_fused(sg, c->fused, what, X, &p);
        consumed(sg, k);
    } else if (!rc && fused) {
        if (exchange) {
            rc = map_arenas(sg, what, id);
            consumed(sg, k);
        } else {
            sg->fz_unchecked = k;
        }
        if (!rc)
            rc = queue_fused(sg, c->fused, k, X);
        sg->fz_last = k;
    } else if (!rc) {
        if (arenas)
            rc = take_arenas(sg, what, id);
        if (!rc)
            rc = queue_round(sg, c, what, k, X, &p, ops, g);
        if (sg->fz_mapped && g < 0) /* its handshakes may be launches polling this rank's arena */
            sg->fz_last = k;
    }
    if (!rc && c->end_event)
        rc = sg->ops->record(sg->d, c->end_event, X);
    free(ops);
    p.t0 = uccl__now_ns(); /* the watchdog times the stream, not the peers' arrival */
    int arc = g < 0 ? uccl__sg_pending_add(sg, p) /* even when failed: queued copies may read */
                    : uccl__sg_graph_keep(sg, p); /* ... a graph's replays too: until close */
    if (arc) {
        uccl__sg_pending_free(sg, &p);
        rc = rc ? rc : arc;
    }
    if (rc) {
        if (!uccl_sg_error(sg))
            return uccl__sg_fail_rc(sg, rc);
        return rc;
    }
    *round_p = k;
    return UCCL_OK;
}

/* One round at a time per group: two threads must not number, publish or
 * order rounds at once (their order is the group's, on every rank). */
int uccl_sg_round(uccl_sg_t *sg, const struct uccl_sg_call *c, uccl_sg_interrupt_fn intr,
                  void *intr_arg, uint32_t *round_p)
{
    pthread_mutex_lock(&sg->call_mu);
    int rc = round_locked(sg, c, intr, intr_arg, round_p);
    pthread_mutex_unlock(&sg->call_mu);
    return rc;
}
