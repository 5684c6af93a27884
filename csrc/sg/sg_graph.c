/* Captured rounds (sgroup.h): rounds queued while the caller's stream
 * captures a CUDA graph.  Everything the host does for a round (publish,
 * read the peers' slots, compare, map) it does once, at the capture; what
 * the stream does is replayed with the graph, any number of times, with no
 * host there to number it.  So a captured round has words of its own (its
 * graph slot in the page: an epoch and ready, done, done2 per rank), and
 * its handshakes count from the epoch, which its own stream bumps at each
 * replay: a peer's word has reached this rank's epoch once the peer's
 * stream has reached the same replay of the same round.  Its mappings are
 * kept until the group closes; its words are released with the rest when
 * the group fails (uccl__sg_release_words), which ends every replay's wait.
 *
 * A captured all_reduce or allgather that fits the one-launch rounds (and
 * GRAPH_FUSED_BYTES) is one launch at every replay, as outside graphs, but
 * with an arena of its own (the group's arena is numbered by the host),
 * made zeroed at the capture, published in the round and mapped by the
 * peers then; the launch numbers itself from its arena's epoch word and
 * pushes its input into every rank's arena, so that each rank polls and
 * reads its own memory only (sg_dev.h, uccl__sg_fused_args.epoch).  Its
 * spins end at the group's failed flag, as every launch's. */
#include <stdlib.h>

#include "sg/sg_page.h"
#include "base/config.h"
#include "base/status.h"

#define GF_TAG (4ull << 40) /* a captured one-launch round's arena, published in the round */
/* The largest captured one-launch round: its arena holds 2 x size slots
 * (64 KiB at 8 ranks: 1 MiB a round captured); larger ones are two-sided. */
#define GRAPH_FUSED_BYTES (256u << 10)
#define GRAPH_CHUNK ((size_t)4 << 20) /* the arenas' memory is made this much at a time */

/* A captured round's handshake on stream X (graph slot g): at ready its
 * epoch bumped first (a replay begins), then this rank's word of the slot
 * set to the epoch and a wait for the word of every peer in reads to reach
 * this rank's epoch, all counted on the device from the epoch word. */
int uccl__sg_graph_handshake(uccl_sg_t *sg, uintptr_t X, uint32_t g, int off,
                             const unsigned char *reads, struct uccl__sg_memop *ops)
{
    int n = sg->size, me = sg->rank, nops = 0;
    int w = off == OFF_READY ? GW_READY : off == OFF_DONE ? GW_DONE : GW_DONE2;
    uint32_t *ep = gword(sg, g, me, GW_EPOCH);
    if (off == OFF_READY)
        ops[nops++] = (struct uccl__sg_memop){ep, 0, UCCL__SG_BUMP, NULL};
    ops[nops++] = (struct uccl__sg_memop){gword(sg, g, me, w), 0, UCCL__SG_WRITE, ep};
    for (int r = 0; r < n; r++)
        if (reads[r] && r != me)
            ops[nops++] = (struct uccl__sg_memop){gword(sg, g, r, w), 0, UCCL__SG_WAIT, ep};
    return sg->ops->memops(sg->d, X, ops, nops);
}

/* What a captured round or message holds (mappings, a pinned
 * registration), kept until the group closes: its graph may be replayed
 * until then, and the watchdog does not time it. */
static int keep(uccl_sg_t *sg, struct pending p)
{
    pthread_mutex_lock(&sg->mu); /* a round's thread and a post's may keep at once */
    struct pending *n = realloc(sg->graph_keep, (size_t)(sg->ngraph_keep + 1) * sizeof(*n));
    if (n) {
        sg->graph_keep = n;
        n[sg->ngraph_keep++] = p;
    }
    pthread_mutex_unlock(&sg->mu);
    return n ? UCCL_OK : uccl__err(UCCL_ERR_NOMEM, "out of memory");
}

/* From the first captured round or message on, the watchdog watches the
 * peers' processes. */
static void watch_peers(uccl_sg_t *sg)
{
    pthread_mutex_lock(&sg->mu);
    pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
}

int uccl__sg_graph_keep(uccl_sg_t *sg, struct pending p)
{
    int rc = keep(sg, p);
    if (rc)
        return rc;
    /* the slot taken (the next captured round's is the next one) */
    __atomic_store_n(&sg->graph_next, sg->graph_next + 1, __ATOMIC_RELAXED);
    watch_peers(sg);
    return UCCL_OK;
}

/* Row j of channel c: side s's word w (PG_EP, PG_RDY, PG_DN). */
static uint32_t *mword(uccl_sg_t *sg, uint32_t c, uint32_t j, int w, int side)
{
    return &chan_at(sg, c)->gw[j][w + side];
}

/* At every replay this side's stream bumps its epoch; the first side then
 * writes its ready word, the copier waits for the first side's to reach
 * its own epoch (the same replay), copies, and writes its done word. */
int uccl__sg_graph_msg(uccl_sg_t *sg, uintptr_t X, uint32_t c, uint32_t j, int side, int second,
                       const struct uccl_sg_copy *cp, void *imp, uint64_t reg, uint32_t *id_p)
{
    uint32_t *ep = mword(sg, c, j, PG_EP, side);
    struct uccl__sg_memop ops[2] = {{ep, 0, UCCL__SG_BUMP, NULL},
                                    {mword(sg, c, j, PG_RDY, side), 0, UCCL__SG_WRITE, ep}};
    if (second) { /* instead: wait for the first side's ready word of this replay */
        ops[1].addr = mword(sg, c, j, PG_RDY, 1 - side);
        ops[1].wait = UCCL__SG_WAIT;
    }
    struct uccl__sg_memop done = {mword(sg, c, j, PG_DN, side), 0, UCCL__SG_WRITE, ep};
    void **imps = imp ? malloc(sizeof(void *)) : NULL;
    struct graph_msg *m = realloc(sg->gmsg, (size_t)(sg->ngmsg + 1) * sizeof(*m));
    if (m)
        sg->gmsg = m;
    if (!m || (imp && !imps)) {
        free(imps);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    if (imps)
        imps[0] = imp;
    int rc = keep(sg, (struct pending){.nimp = imps ? 1 : 0, .imp = imps, .reg = reg});
    if (rc) {
        free(imps);
        return rc;
    }
    m += sg->ngmsg;
    *m = (struct graph_msg){c, j, side, second ? side : 1 - side, X, NULL};
    if ((rc = sg->ops->event_new(sg->d, &m->ev)))
        return rc;
    __atomic_store_n(&sg->ngmsg, sg->ngmsg + 1, __ATOMIC_RELAXED);
    watch_peers(sg);
    *id_p = (uint32_t)(sg->ngmsg - 1);
    rc = sg->ops->memops(sg->d, X, ops, 2);
    if (!rc && second && cp->len)
        rc = sg->ops->copies(sg->d, X, cp, 1);
    return rc ? rc : second ? sg->ops->memops(sg->d, X, &done, 1) : UCCL_OK;
}

int uccl__sg_graph_msg_wait(uccl_sg_t *sg, uint32_t id, uintptr_t stream)
{
    pthread_mutex_lock(&sg->p2p_mu);
    int n = sg->ngmsg;
    struct graph_msg m = id < (uint32_t)n ? sg->gmsg[id] : (struct graph_msg){0};
    pthread_mutex_unlock(&sg->p2p_mu);
    if (!m.ev)
        return uccl__err(UCCL_ERR_INVALID, "captured message %u: this group captured %d", id, n);
    /* after its stream's bump (so the epoch read is this replay's), until
     * the copier's done word reaches it */
    struct uccl__sg_memop w = {mword(sg, m.chan, m.j, PG_DN, m.copier), 0, UCCL__SG_WAIT,
                               mword(sg, m.chan, m.j, PG_EP, m.side)};
    int rc = UCCL_OK;
    if (m.stream != stream && !(rc = sg->ops->record(sg->d, m.ev, m.stream)))
        rc = sg->ops->wait_event(sg->d, stream, m.ev);
    return rc ? rc : sg->ops->memops(sg->d, stream, &w, 1);
}

int uccl_sg_capturing(uccl_sg_t *sg, uintptr_t stream)
{
    return sg->ops->capturing ? sg->ops->capturing(sg->d, stream) : 0;
}

/* Is the caller's stream capturing a CUDA graph?  Then the round is
 * captured (sgroup.h): two-sided, on that stream, its graph slot the
 * group's next; *g_p that slot, else -1. */
int uccl__sg_graph_check(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what,
                         long *g_p)
{
    *g_p = -1;
    int on = c->capture ? c->capture - 1 : uccl_sg_capturing(sg, c->caller);
    if (on < 0)
        return on;
    if (!on)
        return UCCL_OK;
    if ((c->fused && !uccl_sg_graph_fuses(sg, c->fused->nbytes)) || !c->caller_waits ||
        c->end_event)
        return uccl__err(UCCL_ERR_INVALID, "%s: a round captured in a CUDA graph runs on the "
                         "capturing stream with no event of its own (a blocking call)", what);
    if (sg->graph_next >= GRAPH_SLOTS)
        return uccl__err(UCCL_ERR_INVALID, "%s: this group has captured %d rounds, as many as "
                         "it has words for (GRAPH_SLOTS)", what, GRAPH_SLOTS);
    *g_p = sg->graph_next;
    return UCCL_OK;
}

int uccl_sg_graph_fuses(uccl_sg_t *sg, size_t nbytes)
{
    return sg->ops->fused && sg->ops->alloc && nbytes <= GRAPH_FUSED_BYTES;
}

/* len bytes (zeroed, never used before) for a captured round's arena, cut
 * from chunks of at least GRAPH_CHUNK: an allocation much smaller may
 * share the driver's own chunk with others, and a peer that opens it by
 * CUDA IPC would map that chunk, not the allocation, where the offsets
 * the export record gives are the allocation's. */
static int graph_mem(uccl_sg_t *sg, size_t len, uintptr_t *ptr_p)
{
    len = (len + 255) / 256 * 256;
    if (!sg->ngchunk || len > sg->gchunk_len - sg->gchunk_used) {
        size_t sz = len > GRAPH_CHUNK ? (len + GRAPH_CHUNK - 1) / GRAPH_CHUNK * GRAPH_CHUNK
                                      : GRAPH_CHUNK;
        uintptr_t *n = realloc(sg->gchunk, (size_t)(sg->ngchunk + 1) * sizeof(*n));
        if (!n)
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        sg->gchunk = n;
        int rc = sg->ops->alloc(sg->d, sz, &n[sg->ngchunk]);
        if (rc)
            return rc;
        sg->ngchunk++;
        sg->gchunk_len = sz;
        sg->gchunk_used = 0;
    }
    *ptr_p = sg->gchunk[sg->ngchunk - 1] + sg->gchunk_used;
    sg->gchunk_used += len;
    return UCCL_OK;
}

/* A captured one-launch round's slot: its input rounded up to 16 bytes, or
 * up to UCCL_SG_GRAPH_LL_BYTES twice that, for NCCL's LL lines (8 bytes of
 * data in each 16), which is how the launch tells (uccl__sg_graph_fused). */
static int graph_slot(size_t nbytes, size_t *slot_p)
{
    long ll = 0;
    int rc = uccl__cfg_long(UCCL_CFG_SG_GRAPH_LL_BYTES, &ll); /* a bad value: its error */
    size_t slot = (nbytes + 15) / 16 * 16;
    *slot_p = nbytes <= (size_t)ll ? 2 * slot : slot;
    return rc;
}

/* Its arena: a slot per source rank and parity, then the tail (sg_dev.h). */
int uccl__sg_graph_arena(uccl_sg_t *sg, size_t nbytes, uint32_t k, struct pending *p,
                         struct entry *e)
{
    size_t slot = 0;
    int rc = graph_slot(nbytes, &slot);
    if (rc)
        return rc;
    size_t len = 2 * (size_t)sg->size * slot + UCCL_SG_FUSED_TAIL;
    if ((rc = graph_mem(sg, len, &p->area)))
        return rc;
    p->area_len = len;
    uint64_t key = 0;
    if ((rc = uccl__sg_reg_key(sg, p->area, len, k, &key, &p->reg)))
        return rc;
    *e = (struct entry){GF_TAG, key, p->area, len};
    return UCCL_OK;
}

int uccl__sg_graph_fused(uccl_sg_t *sg, const struct uccl_sg_fused *fz, const char *what,
                         uintptr_t X, struct pending *p)
{
    size_t tail = p->area_len - UCCL_SG_FUSED_TAIL, flip = tail / 2 / (size_t)sg->size;
    struct uccl__sg_fused_args a = {.gather = fz->gather, .dtype = fz->dtype, .op = fz->op,
                                    .nsrc = sg->size, .me = sg->rank, .in = fz->in,
                                    .out = fz->out, .ctr = p->area + tail,
                                    .nbytes = fz->nbytes, .count = fz->count,
                                    .failed = (uint32_t *)sg->page,
                                    .epoch = (uint32_t *)(p->area + tail + UCCL_SG_FUSED_EPOCH),
                                    .flip = flip,
                                    .ll = flip > (fz->nbytes + 15) / 16 * 16};
    int rc = UCCL_OK;
    for (int r = 0; r < sg->size && !rc; r++) {
        const struct entry *pe = uccl__sg_peer_entry(sg, r, GF_TAG);
        a.slot[r] = p->area;
        /* the calls compared equal: a length apart is a setting apart */
        if (r == sg->rank)
            ;
        else if (pe && pe->len != p->area_len)
            rc = uccl__err(UCCL_ERR_MISMATCH, "%s captured: rank %d's arena for %zu bytes a "
                           "rank is %llu bytes, rank %d's %zu (UCCL_SG_GRAPH_LL_BYTES must be "
                           "the same on every rank)", what, r, fz->nbytes,
                           (unsigned long long)pe->len, sg->rank, p->area_len);
        else
            rc = uccl__sg_map_range(sg, what, r, GF_TAG, 0, p->area_len, 1, p, &a.slot[r]);
        a.dready[r] = a.slot[r] + tail + UCCL_SG_FUSED_READY;
    }
    return rc ? rc : sg->ops->fused(sg->d, X, &a);
}

void uccl__sg_graph_free(uccl_sg_t *sg)
{
    for (int i = 0; i < sg->ngchunk; i++)
        sg->ops->free_mem(sg->d, sg->gchunk[i]);
}
