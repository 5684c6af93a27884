/* One round of a stream-ordered group (sgroup.h): the call checked, this
 * rank's buffers published, the peers' read and compared, their ranges
 * mapped, and the phases queued on the group's stream. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_page.h"
#include "sock.h"
#include "status.h"

/* ---- checks -------------------------------------------------------------------------- */
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
    if (c->red) {
        int dt = c->red->dtype, op = c->red->op;
        int flt = dt == UCCL_DT_F32 || dt == UCCL_DT_F64 || dt == UCCL_DT_F16 || dt == UCCL_DT_BF16;
        if ((flt && (op == UCCL_RED_BAND || op == UCCL_RED_BOR || op == UCCL_RED_BXOR)) ||
            (dt == UCCL_DT_BOOL && op == UCCL_RED_AVG))
            return uccl__err(UCCL_ERR_INVALID, "%s: operator %d is not defined for element type "
                             "%d (bitwise operators need integers or bool; AVG a number)",
                             what, op, dt);
        size_t esz = uccl_dtype_size(c->red->dtype);
        if (!esz || c->red->op < 0 || c->red->op >= UCCL_RED_COUNT ||
            c->red->count > SIZE_MAX / esz || c->red->off + c->red->count * esz < c->red->off)
            return uccl__err(UCCL_ERR_INVALID, "%s: reduction of type %d, operator %d, %zu "
                             "elements", what, c->red->dtype, c->red->op, c->red->count);
    }
    return UCCL_OK;
}

/* The entry rank r published under tag in this round (r may be this rank:
 * then from the call's own list), or NULL. */
static const struct entry *peer_entry(uccl_sg_t *sg, int r, uint64_t tag)
{
    const struct entry *e = sg->peer_ent + (size_t)r * MAX_ENTRIES;
    for (uint32_t i = 0; i < sg->peer_cnt[r]; i++)
        if (e[i].tag == tag)
            return &e[i];
    return NULL;
}

static const struct uccl_sg_pub *own_entry(const struct uccl_sg_call *c, uint64_t tag)
{
    for (int i = 0; i < c->npub; i++)
        if (c->pub[i].tag == tag && c->pub[i].len)
            return &c->pub[i];
    return NULL;
}

/* Map [off, +len) of what rank r published under tag into *ptr_p. */
static int map_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                     size_t len, int exact, struct pending *p, uintptr_t *ptr_p)
{
    const struct entry *e = peer_entry(sg, r, tag);
    if (!e)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published nothing for rank %d to read "
                         "%zu bytes from (tag %#llx): the ranks' calls disagree", what, r,
                         sg->rank, len, (unsigned long long)tag);
    if (exact && e->len != len)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d sends %llu bytes where rank %d "
                         "receives %zu", what, r, (unsigned long long)e->len, sg->rank, len);
    if (off > e->len || len > e->len - off)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published %llu bytes; rank %d reads "
                         "[%llu, +%zu): the ranks' calls disagree", what, r,
                         (unsigned long long)e->len, sg->rank, (unsigned long long)off, len);
    void *imp = NULL;
    int rc = sg->ops->map(sg->d, r, e->key, e->addr + off, len, ptr_p, &imp);
    if (rc == UCCL_OK && imp)
        p->imp[p->nimp++] = imp;
    return rc;
}

/* Read every peer's slot of round k (waiting for them to arrive) and
 * compare their calls with this one. */
static int read_peers(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                      uint64_t deadline, uccl_sg_interrupt_fn intr, void *intr_arg)
{
    for (int r = 0; r < sg->size; r++) {
        if (r == sg->rank)
            continue;
        char waiting[64];
        snprintf(waiting, sizeof(waiting), "rank %d arriving at round %u", r, k);
        int rc = uccl__sg_host_wait(sg, uccl__sg_arrived, k, r, what, waiting, deadline, intr, intr_arg);
        if (rc)
            return rc;
        const struct slot_head *h = (const struct slot_head *)slot(sg, r, k);
        char theirs[17];
        memcpy(theirs, h->what, 16);
        theirs[16] = '\0';
        if (h->kind != c->kind || h->arg != c->arg || (int)h->phases != c->phases)
            return uccl__err(UCCL_ERR_MISMATCH, "%s: the ranks' calls disagree: rank %d is in "
                             "%s (kind %#x, argument %llu), rank %d in %s (kind %#x, argument "
                             "%llu)", what, r, theirs, h->kind, (unsigned long long)h->arg,
                             sg->rank, what, c->kind, (unsigned long long)c->arg);
        if (h->count > (uint32_t)MAX_ENTRIES)
            return uccl__err(UCCL_ERR_PROTO, "%s: rank %d published %u buffers (at most %d)",
                             what, r, h->count, MAX_ENTRIES);
        sg->peer_cnt[r] = h->count;
        memcpy(sg->peer_ent + (size_t)r * MAX_ENTRIES, (const uint8_t *)h + sizeof(*h),
               (size_t)h->count * ENTRY_BYTES);
    }
    return UCCL_OK;
}

static void memop(struct uccl__sg_memop *ops, int *n, uint32_t *addr, uint32_t v, int wait)
{
    ops[(*n)++] = (struct uccl__sg_memop){addr, v, wait};
}

/* Copies of one phase in one call: cs (n of them) on `stream`. */
static int copies(uccl_sg_t *sg, uintptr_t stream, struct uccl_sg_copy *cs, int n)
{
    return n ? sg->ops->copies(sg->d, stream, cs, n) : UCCL_OK;
}

/* Everything after the slots were read, on stream X: map, then queue the
 * phases (ready written with the waits for the peers read, in one call). */
static int queue_round(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                       uintptr_t X, struct pending *p, struct uccl__sg_memop *ops)
{
    const struct uccl__sg_dev *dv = sg->ops;
    int n = sg->size, me = sg->rank, nops = 0, rc = UCCL_OK, n1 = 0, n2 = 0;
    struct uccl_sg_copy *cp = calloc((size_t)c->npull + (size_t)c->ncopy + 1, sizeof(*cp));
    struct uccl__sg_red_args ra;
    memset(&ra, 0, sizeof(ra));
    unsigned char reads[UCCL_SG_MAX_RANKS] = {0};
    if (!cp)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    /* phase 1's copies first in cp, phase 2's from the end */
    struct uccl_sg_copy *cp2 = cp + c->npull + c->ncopy;
    for (int i = 0; i < c->npull && !rc; i++) {
        const struct uccl_sg_pull *q = &c->pull[i];
        if (q->len == 0)
            continue;
        struct uccl_sg_copy *to = q->phase == 1 ? &cp[n1++] : &cp2[-++n2];
        *to = (struct uccl_sg_copy){q->dst, 0, q->len};
        rc = map_range(sg, what, q->peer, q->tag, q->off, q->len, q->exact, p, &to->src);
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
                rc = map_range(sg, what, r, red->tag, red->off, nb, 0, p, &ra.src[r]);
                reads[r] = 1;
            }
        }
    }
    if (rc) {
        free(cp);
        return rc;
    }
    /* every peer's buffers this round are read and mapped: their slots may
     * be reused, and their registrations dropped (not before: a peer's
     * eviction follows this word) */
    st64(w64(sg, me, OFF_CONSUMED), k);
    memop(ops, &nops, w32(sg, me, OFF_READY), k, 0);
    for (int r = 0; r < n; r++)
        if (reads[r])
            memop(ops, &nops, w32(sg, r, OFF_READY), k, 1);
    rc = dv->memops(sg->d, X, ops, nops);
    if (!rc)
        rc = copies(sg, X, cp, n1);
    if (!rc && red && red->count)
        rc = dv->reduce(sg->d, X, &ra);
    nops = 0;
    memop(ops, &nops, w32(sg, me, OFF_DONE), k, 0);
    for (int r = 0; r < n; r++)
        if (r != me)
            memop(ops, &nops, w32(sg, r, OFF_DONE), k, 1);
    if (c->phases == 2) {
        if (!rc)
            rc = dv->memops(sg->d, X, ops, nops);
        if (!rc)
            rc = copies(sg, X, cp2 - n2, n2);
        nops = 0;
        memop(ops, &nops, w32(sg, me, OFF_DONE2), k, 0);
        for (int r = 0; r < n; r++)
            if (r != me)
                memop(ops, &nops, w32(sg, r, OFF_DONE2), k, 1);
    }
    memop(ops, &nops, w32(sg, me, OFF_FIN), k, 0);
    if (!rc)
        rc = dv->memops(sg->d, X, ops, nops);
    free(cp);
    if (!rc && c->end_event)
        rc = dv->record(sg->d, c->end_event, X);
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
    int rc = check_call(sg, c);
    if (rc)
        return rc;
    uint32_t k = sg->round + 1;
    if (k == 0)
        k = 1;
    uccl__sg_reclaim(sg);
    uint64_t deadline = uccl__now_ns() + sg->timeout_ns;
    char waiting[64];
    snprintf(waiting, sizeof(waiting), "peers reading round %u", k - NSLOT);
    /* the slot of round k was last used by round k - NSLOT: every peer has read it */
    if ((rc = uccl__sg_host_wait(sg, uccl__sg_consumed_ready, k, -1, what, waiting, deadline, intr, intr_arg)))
        return rc;
    struct entry ent[MAX_ENTRIES];
    int nent = 0;
    for (int i = 0; i < c->npub && !rc; i++) {
        if (c->pub[i].len == 0)
            continue;
        ent[nent] = (struct entry){c->pub[i].tag, 0, c->pub[i].ptr, c->pub[i].len};
        rc = uccl__sg_reg_key(sg, c->pub[i].ptr, c->pub[i].len, k, &ent[nent].key, NULL);
        nent++;
    }
    if (rc)
        return uccl__sg_fail_rc(sg, rc);
    __atomic_store_n(&sg->round, k, __ATOMIC_RELAXED); /* posts read it (sg_p2p.c) */
    struct pending p = {k, uccl__now_ns(), 0, calloc((size_t)c->npull + (size_t)sg->size + 1,
                                                     sizeof(void *))};
    struct uccl__sg_memop *ops = calloc(2 * (size_t)sg->size + 2, sizeof(*ops));
    if (!p.imp || !ops) {
        free(p.imp);
        free(ops);
        uccl__err(UCCL_ERR_NOMEM, "out of memory");
        return uccl__sg_fail_rc(sg, UCCL_ERR_NOMEM);
    }
    uintptr_t X = 0;
    rc = order_round(sg, c, &X);
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
        rc = read_peers(sg, c, what, k, deadline, intr, intr_arg);
    }
    if (!rc)
        rc = queue_round(sg, c, what, k, X, &p, ops);
    free(ops);
    p.t0 = uccl__now_ns(); /* the watchdog times the stream, not the peers' arrival */
    int arc = uccl__sg_pending_add(sg, p); /* even when failed: queued copies may read through them */
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
