/* Stream-ordered point-to-point messages of a group (sgroup.h).
 *
 * Channel (src, dst) of the page carries the messages from src to dst,
 * numbered 1, 2, ... on each side as they are posted.  Message k lives in
 * slot k % P2P_SLOTS: each side writes its descriptor there (registration
 * key, address, length), then sets its arrival bit with a compare-and-swap
 * on the slot's state (k in the high half).  The side that finds the other
 * bit already set is second: it reads the other's descriptor, maps that
 * buffer, sets the read bit (the slot may be reused from then on), and
 * queues on its stream: wait for the other side's ready word to reach k,
 * one copy, done = k.  The first side queues ready = k only.  A sender
 * that posts first and has a staging arena for the peer (small messages)
 * copies its bytes into the arena's slot for k before writing ready, and
 * publishes that slot: its send is complete once staged, whatever the
 * receiver does (a buffered send, as NCCL's and Gloo's small ones are).
 * The slot is written again only after the receiver's done word passed
 * the message it last staged.
 *
 * Each side queues a pair's messages (both ways) on one stream of its own
 * for that peer, in its host's posting order, as NCCL's per-pair streams.
 * Within a pair no wait is behind the write it waits for: a second side's
 * stream waits for the first side's ready write, queued when that host
 * arrived, before this host did, and a cycle of such waits would need each
 * arrival to come before the previous one.  What the ranks' programs add
 * across pairs (a Work's wait on the caller's stream, which a later post
 * then starts after) can still make a cycle, as with NCCL; a message not
 * in place within the timeout then fails the group. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg/sg_page.h"
#include "net/sock.h"
#include "base/status.h"

#define BIT_READ 4u
#define MAX_OPS 4096 /* messages in one post */
#define CODE_STAGED (1ull << 62) /* a staged send: complete once staged (the sender's ready) */
#define CODE_GRAPH (1ull << 63)  /* a captured message: the rest its number (sg_graph.c) */

static inline uint32_t state_k(uint64_t s) { return (uint32_t)(s >> 32); }

static uint32_t chan_of(uccl_sg_t *sg, int src, int dst)
{
    return (uint32_t)src * (uint32_t)sg->size + (uint32_t)dst;
}

/* The message before k in k's slot: P2P_SLOTS before it, but for the
 * numbers' wrap, where 0 is skipped (slot 0 then waits a turn). */
static uint32_t before_in_slot(uint32_t k)
{
    uint32_t b = k - P2P_SLOTS;
    return b ? b : b - P2P_SLOTS;
}

/* May message k take its slot of channel c?  The message before it there
 * is over (both arrived, the second read), or the peer already took the
 * slot for k. */
static int slot_free(uccl_sg_t *sg, uint32_t k, int c)
{
    uint64_t s = ld64(&chan_at(sg, (uint32_t)c)->slot[k % P2P_SLOTS].state);
    return s == 0 || state_k(s) == k ||
           (state_k(s) == before_in_slot(k) && (s & 7u) == 7u);
}

/* The copier's done word of a message and its number, from a code. */
static int decode(uccl_sg_t *sg, uint64_t code, uint32_t **done_p, uint32_t *k_p)
{
    uint64_t c = (code & ~CODE_STAGED) >> 33;
    int copier = (int)((code >> 32) & 1);
    uint32_t n = (uint32_t)sg->size;
    if (c >= (uint64_t)n * n || c / n == c % n || (uint32_t)code == 0)
        return uccl__err(UCCL_ERR_INVALID, "%#llx is not a message code of this group "
                         "(%u ranks)", (unsigned long long)code, n);
    struct p2p_chan *ch = chan_at(sg, (uint32_t)c);
    *done_p = code & CODE_STAGED ? &ch->ready[P2P_SRC][0] : &ch->done[copier][0];
    *k_p = (uint32_t)code;
    return UCCL_OK;
}

void uccl__sg_p2p_why(uccl_sg_t *sg, const struct p2p_pending *p, int closing, char *why,
                      size_t len)
{
    uint32_t n = (uint32_t)sg->size;
    int src = (int)(p->chan / n), dst = (int)(p->chan % n);
    int peer = src == sg->rank ? dst : src;
    const struct p2p_chan *ch = chan_at(sg, p->chan);
    uint64_t s = ld64(&ch->slot[p->k % P2P_SLOTS].state);
    /* a slot reused since (a later message in it) was posted both sides */
    int both = (state_k(s) == p->k && (s & 3u) == 3u) ||
               (state_k(s) != p->k && ahead(state_k(s), p->k));
    char when[48];
    if (closing)
        snprintf(when, sizeof(when), "when rank %d closed the group", sg->rank);
    else
        snprintf(when, sizeof(when), "within %.3g s", (double)sg->timeout_ns / 1e9);
    snprintf(why, len, "message %u from rank %d to rank %d not in place %s: %s "
             "(ready words %u/%u, done %u/%u)", p->k, src, dst, when,
             both ? "both sides posted it, and the copier's stream did not get to it"
                  : (peer == dst ? "the receiver never posted its recv"
                                 : "the sender never posted its send"),
             ld32(&ch->ready[P2P_SRC][0]), ld32(&ch->ready[P2P_DST][0]),
             ld32(&ch->done[P2P_SRC][0]), ld32(&ch->done[P2P_DST][0]));
}

int uccl__sg_p2p_unmatched(uccl_sg_t *sg, const struct p2p_pending *p)
{
    uint64_t s = ld64(&chan_at(sg, p->chan)->slot[p->k % P2P_SLOTS].state);
    return state_k(s) == p->k && (s & 3u) != 3u;
}

static void raise_high(struct p2p_chan *ch, uint32_t k)
{
    uint64_t h = ld64(&ch->high);
    while (!ahead((uint32_t)h, k) &&
           !__atomic_compare_exchange_n(&ch->high, &h, k, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
}

/* Set this side's arrival bit for message k: *second_p whether the other
 * side had arrived.  A state the protocol cannot produce is a peer's bug. */
static int arrive(uccl_sg_t *sg, struct p2p_slot *sl, uint32_t k, int side, int *second_p)
{
    uint64_t old = ld64(&sl->state);
    for (;;) {
        uint64_t nw;
        if (state_k(old) == k) {
            if ((old & 7u) != (1u << (1 - side)))
                return uccl__err(UCCL_ERR_PROTO, "stream-ordered group (rank %d): message %u's "
                                 "slot holds state %#llx", sg->rank, k, (unsigned long long)old);
            nw = old | (1u << side);
        } else {
            nw = ((uint64_t)k << 32) | (1u << side);
        }
        if (__atomic_compare_exchange_n(&sl->state, &old, nw, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *second_p = state_k(old) == k;
            return UCCL_OK;
        }
    }
}

/* On stream X: wait for *wait >= wv (none when wv is 0), the copy (none
 * when empty), then *write = k. */
static int wait_copy_write(uccl_sg_t *sg, uintptr_t X, uint32_t *wait, uint32_t wv,
                           const struct uccl_sg_copy *cp, uint32_t *write, uint32_t k)
{
    struct uccl__sg_memop w = {wait, wv, 1, NULL}, wr = {write, k, 0, NULL};
    int rc = wv ? sg->ops->memops(sg->d, X, &w, 1) : UCCL_OK;
    if (!rc && cp->len)
        rc = sg->ops->copies(sg->d, X, cp, 1);
    return rc ? rc : sg->ops->memops(sg->d, X, &wr, 1);
}

/* The second side: check the other's descriptor and map its buffer (*cp
 * the copy), then, unless captured, queue the copy between the other
 * side's ready word and this side's done word. */
static int copy_second(uccl_sg_t *sg, const struct uccl_sg_p2p_op *o, struct p2p_chan *ch,
                       struct p2p_slot *sl, uint32_t k, int side, uintptr_t X,
                       struct p2p_pending *p, int captured, struct uccl_sg_copy *cp_p)
{
    struct p2p_desc od = sl->d[1 - side];
    int src = o->send ? sg->rank : o->peer, dst = o->send ? o->peer : sg->rank;
    if (od.len != o->len)
        return uccl__err(UCCL_ERR_MISMATCH, "stream-ordered group: message %u from rank %d to "
                         "rank %d: rank %d sends %llu bytes, rank %d receives %llu", k, src, dst,
                         src, (unsigned long long)(o->send ? o->len : od.len), dst,
                         (unsigned long long)(o->send ? od.len : o->len));
    if (od.addr + od.len < od.addr)
        return uccl__err(UCCL_ERR_PROTO, "stream-ordered group: message %u from rank %d to "
                         "rank %d: rank %d's buffer [%#llx, +%llu) wraps round the address "
                         "space", k, src, dst, o->peer, (unsigned long long)od.addr,
                         (unsigned long long)od.len);
    struct uccl_sg_copy cp = {0, 0, o->len};
    int rc = UCCL_OK;
    if (o->len) {
        uintptr_t theirs = 0;
        rc = sg->ops->map(sg->d, o->peer, od.key, od.addr, (size_t)od.len, &theirs, &p->imp);
        cp.dst = o->send ? theirs : o->ptr;
        cp.src = o->send ? o->ptr : theirs;
    }
    __atomic_fetch_or(&sl->state, BIT_READ, __ATOMIC_ACQ_REL);
    *cp_p = cp;
    if (rc || captured)
        return rc;
    return wait_copy_write(sg, X, &ch->ready[1 - side][0], k, &cp, &ch->done[side][0], k);
}

/* A refresh (REFRESH_EVERY), on the pair's stream X before message k:
 * this side's words of the channel (a side that is always first leaves
 * its done word, one always second its ready word) set to k - 1, and the
 * staging slots whose last message the receiver has copied out forgotten
 * (a slot unused for 2^31 messages would otherwise wait for it forever). */
static int refresh_chan(uccl_sg_t *sg, const struct uccl_sg_p2p_op *o, struct p2p_chan *ch,
                        int side, uintptr_t X, uint32_t k)
{
    struct p2p_arena *ar = o->send ? &sg->arena[o->peer] : NULL;
    if (ar && ar->ptr)
        for (int s = 0; s < P2P_SLOTS; s++)
            if (ar->staged[s] && ahead(ld32(&ch->done[P2P_DST][0]), ar->staged[s]))
                ar->staged[s] = 0;
    struct uccl__sg_memop ops[2] = {{&ch->ready[side][0], k - 1, 0, NULL},
                                    {&ch->done[side][0], k - 1, 0, NULL}};
    return sg->ops->memops(sg->d, X, ops, 2);
}

/* Post one message (under p2p_mu, after the stream's ordering). */
static int post_one(uccl_sg_t *sg, const struct uccl_sg_p2p_op *o, uintptr_t X,
                    uccl_sg_interrupt_fn intr, void *intr_arg, uint64_t *code_p)
{
    int side = o->send ? P2P_SRC : P2P_DST;
    uint32_t *count = o->send ? &sg->p2p_sent[o->peer] : &sg->p2p_recvd[o->peer];
    uint32_t c = o->send ? chan_of(sg, sg->rank, o->peer) : chan_of(sg, o->peer, sg->rank);
    uint32_t k = *count + 1;
    if (k == 0)
        k = 1;
    struct p2p_chan *ch = chan_at(sg, c);
    struct p2p_slot *sl = &ch->slot[k % P2P_SLOTS];
    const char *what = o->send ? "send" : "recv";
    /* captured in a CUDA graph (X joined the caller's capture): exchanged
     * now, copied at every replay with words of its own (sg_graph.c) */
    uint32_t *gcount = o->send ? &sg->p2p_gsent[o->peer] : &sg->p2p_grecvd[o->peer];
    int captured = uccl_sg_capturing(sg, X);
    if (captured < 0)
        return captured;
    if (captured && *gcount >= P2P_GRAPH)
        return uccl__err(UCCL_ERR_INVALID, "%s: rank %d captured %u messages %s rank %d in CUDA "
                         "graphs, as many as the channel has words for (P2P_GRAPH)", what,
                         sg->rank, *gcount, o->send ? "to" : "from", o->peer);
    int rc = uccl__sg_host_wait(sg, slot_free, k, (int)c, what, uccl__now_ns() + sg->timeout_ns,
                                intr, intr_arg, "rank %d taking message %u of the %d -> %d "
                                "channel (%d messages ahead)", o->peer, before_in_slot(k),
                                o->send ? sg->rank : o->peer, o->send ? o->peer : sg->rank,
                                P2P_SLOTS);
    if (rc)
        return rc;
    /* not in a capture: the graph would set the words back at every replay */
    if (!captured && refresh_due(k) && (rc = refresh_chan(sg, o, ch, side, X, k)))
        return rc;
    struct p2p_pending p = {c, k, 1 - side, uccl__now_ns(), 0, NULL, 0};
    /* the peer's bit already there: this side is second, and no peer reads its descriptor */
    uint64_t s = ld64(&sl->state);
    int known_second = state_k(s) == k, second = 0;
    struct p2p_arena *ar = o->send ? &sg->arena[o->peer] : NULL;
    size_t stage_bytes = ar && ar->ptr ? ar->len / P2P_SLOTS : 0;
    uintptr_t stage = stage_bytes ? ar->ptr + (k % P2P_SLOTS) * stage_bytes : 0;
    int staged = !captured && !known_second && o->len && o->len <= stage_bytes;
    struct p2p_desc mine = {staged ? ar->key : 0, staged ? stage : o->ptr, o->len};
    uint32_t round = __atomic_load_n(&sg->round, __ATOMIC_RELAXED);
    if (!known_second && !staged && o->len &&
        (rc = uccl__sg_reg_key(sg, o->ptr, o->len, round, &mine.key, &p.reg)))
        return rc;
    sl->d[side] = mine;
    if ((rc = arrive(sg, sl, k, side, &second))) {
        if (p.reg)
            uccl__sg_reg_unpin(sg, p.reg);
        return rc;
    }
    *count = k;
    raise_high(ch, k);
    struct uccl_sg_copy cp = {0, 0, 0};
    if (second) {
        p.copier = side;
        if (p.reg) {
            uccl__sg_reg_unpin(sg, p.reg);
            p.reg = 0;
        }
        rc = copy_second(sg, o, ch, sl, k, side, X, &p, captured, &cp);
    }
    if (captured && rc) { /* nothing queued reads through them */
        if (p.imp)
            sg->ops->unmap(sg->d, p.imp);
        if (p.reg)
            uccl__sg_reg_unpin(sg, p.reg);
        return rc;
    }
    if (captured) { /* its mapping and registration kept until close */
        uint32_t id = 0;
        rc = uccl__sg_graph_msg(sg, X, c, (*gcount)++, side, second, &cp, p.imp, p.reg, &id);
        *code_p = CODE_GRAPH | id;
        return rc;
    }
    if (second) {
        /* queued by copy_second */
    } else if (staged) {
        /* the slot's last message copied out by the receiver, then this one in */
        cp = (struct uccl_sg_copy){stage, o->ptr, o->len};
        rc = wait_copy_write(sg, X, &ch->done[P2P_DST][0], ar->staged[k % P2P_SLOTS], &cp,
                             &ch->ready[side][0], k);
        ar->staged[k % P2P_SLOTS] = k;
    } else {
        struct uccl__sg_memop ready = {&ch->ready[side][0], k, 0, NULL};
        rc = sg->ops->memops(sg->d, X, &ready, 1);
    }
    int arc = uccl__sg_p2p_add(sg, p); /* even when failed: a queued copy may read through it */
    if (arc) {
        if (p.imp)
            sg->ops->unmap(sg->d, p.imp);
        if (p.reg)
            uccl__sg_reg_unpin(sg, p.reg);
        rc = rc ? rc : arc;
    }
    *code_p = ((uint64_t)c << 33) | ((uint64_t)p.copier << 32) | k |
              (staged && !second ? CODE_STAGED : 0);
    return rc;
}

int uccl_sg_p2p_arena(uccl_sg_t *sg, int peer, uintptr_t ptr, size_t len)
{
    if (peer < 0 || peer >= sg->size || peer == sg->rank || !ptr || len < P2P_SLOTS)
        return uccl__err(UCCL_ERR_INVALID, "stream-ordered send staging: peer %d in a group of "
                         "%d (this rank %d), arena %#lx of %zu bytes (at least %d)", peer,
                         sg->size, sg->rank, (unsigned long)ptr, len, P2P_SLOTS);
    pthread_mutex_lock(&sg->p2p_mu);
    struct p2p_arena *ar = &sg->arena[peer];
    int rc = UCCL_OK;
    uint64_t key = 0, reg = 0;
    if (ar->ptr)
        rc = uccl__err(UCCL_ERR_INVALID, "stream-ordered send staging for rank %d is set "
                       "already", peer);
    else if (!(rc = uccl__sg_reg_key(sg, ptr, len, __atomic_load_n(&sg->round, __ATOMIC_RELAXED),
                                     &key, &reg)))
        *ar = (struct p2p_arena){ptr, len, key, {0}}; /* pinned: the peer maps it until close */
    pthread_mutex_unlock(&sg->p2p_mu);
    return rc;
}

int uccl_sg_p2p(uccl_sg_t *sg, const struct uccl_sg_p2p_op *ops, int n, uintptr_t caller,
                uccl_sg_interrupt_fn intr, void *intr_arg, uint64_t *codes)
{
    if (n < 1 || n > MAX_OPS || !ops || !codes)
        return uccl__err(UCCL_ERR_INVALID, "stream-ordered send/recv: %d messages in one post "
                         "(1..%d)", n, MAX_OPS);
    for (int i = 0; i < n; i++) {
        const struct uccl_sg_p2p_op *o = &ops[i];
        if (o->peer < 0 || o->peer >= sg->size || o->peer == sg->rank || (o->len && !o->ptr) ||
            !o->stream)
            return uccl__err(UCCL_ERR_INVALID, "stream-ordered %s %d: peer %d in a group of %d "
                             "(this rank %d), buffer %#lx of %zu bytes, stream %#lx",
                             o->send ? "send" : "recv", i, o->peer, sg->size, sg->rank,
                             (unsigned long)o->ptr, o->len, (unsigned long)o->stream);
    }
    pthread_mutex_lock(&sg->p2p_mu);
    int rc = UCCL_OK;
    if (uccl_sg_error(sg)) {
        rc = uccl__sg_failed_err(sg, ops[0].send ? "send" : "recv");
        goto out;
    }
    uccl__sg_reclaim(sg);
    /* the messages start after the caller's work so far: an event of the
     * caller's, waited for by each pair's stream before its first message */
    rc = sg->ops->record(sg->d, sg->ev_p2p, caller);
    if (rc) /* nothing posted yet: the group stays up */
        goto out;
    for (int i = 0; i < n && !rc; i++) {
        int first = 1;
        for (int j = 0; j < i && first; j++)
            first = ops[j].stream != ops[i].stream;
        if (first && ops[i].stream != caller)
            rc = sg->ops->wait_event(sg->d, ops[i].stream, sg->ev_p2p);
        if (!rc)
            rc = post_one(sg, &ops[i], ops[i].stream, intr, intr_arg, &codes[i]);
    }
    if (rc && !uccl_sg_error(sg))
        rc = uccl__sg_fail_rc(sg, rc); /* peers may wait on what was posted */
out:
    pthread_mutex_unlock(&sg->p2p_mu);
    return rc;
}

int uccl_sg_p2p_renumber(uccl_sg_t *sg, uint32_t k, uint32_t lag)
{
    pthread_mutex_lock(&sg->p2p_mu);
    int rc = UCCL_OK;
    for (int p = 0; p < sg->size && !rc; p++)
        if (sg->p2p_sent[p] || sg->p2p_recvd[p])
            rc = uccl__err(UCCL_ERR_INVALID, "stream-ordered group (rank %d): messages to or "
                           "from rank %d were posted already: too late to renumber them",
                           sg->rank, p);
    for (int p = 0; p < sg->size && !rc && k; p++) {
        if (p == sg->rank)
            continue;
        sg->p2p_sent[p] = sg->p2p_recvd[p] = k;
        for (int way = 0; way < 2; way++) { /* this rank's words and the peer's, alike */
            struct p2p_chan *ch = chan_at(sg, way ? chan_of(sg, p, sg->rank)
                                                  : chan_of(sg, sg->rank, p));
            for (int side = 0; side < 2; side++) {
                st32(&ch->ready[side][0], side == P2P_SRC ? k - lag : k);
                st32(&ch->done[side][0], side == P2P_DST ? k - lag : k);
            }
            st64(&ch->high, k);
        }
    }
    pthread_mutex_unlock(&sg->p2p_mu);
    return rc;
}

int uccl_sg_p2p_wait(uccl_sg_t *sg, uint64_t code, uintptr_t stream)
{
    if (code & CODE_GRAPH)
        return uccl_sg_error(sg) ? uccl__sg_failed_err(sg, "wait")
                                 : uccl__sg_graph_msg_wait(sg, (uint32_t)code, stream);
    uint32_t *done, k;
    int rc = decode(sg, code, &done, &k);
    if (rc)
        return rc;
    if (uccl_sg_error(sg))
        return uccl__sg_failed_err(sg, "wait");
    struct uccl__sg_memop w = {done, k, 1, NULL};
    return sg->ops->memops(sg->d, stream, &w, 1);
}

int uccl_sg_p2p_passed(uccl_sg_t *sg, uint64_t code)
{
    if (code & CODE_GRAPH) /* a graph's: in place at every replay the graph's stream waits for */
        return 1;
    uint32_t *done, k;
    int rc = decode(sg, code, &done, &k);
    return rc ? rc : ahead(ld32(done), k);
}
