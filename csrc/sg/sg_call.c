/* The collectives of a stream-ordered group, each one round (sgroup.h).
 *
 * allreduce is in place with no scratch: every rank publishes its buffer;
 * in phase 1 rank r reduces chunk r of every rank's buffer (read through
 * the mappings, in rank order, so every rank gets the same bits) into
 * chunk r of its own; in phase 2 it copies every other chunk from its
 * owner.  Nobody writes a chunk another rank reads in the same phase: in
 * phase 1 only r reads chunk r anywhere and only r writes it (in its own
 * buffer); phase 2 starts once every rank is done with phase 1 (the done
 * words), and the round ends once every rank is done with phase 2. */
#include <string.h>

#include "sg/sgroup.h"
#include "base/status.h"

/* Operation kinds (sgroup.h): compared across ranks (with the argument), so
 * calls that disagree fail loudly instead of moving the wrong bytes. */
enum { K_ALLREDUCE = UCCL_SG_K_ALLREDUCE, K_REDUCE_SCATTER = UCCL_SG_K_REDUCE_SCATTER,
       K_ALLGATHER = UCCL_SG_K_ALLGATHER, K_BROADCAST = UCCL_SG_K_BROADCAST,
       K_REDUCE = UCCL_SG_K_REDUCE };

static uint32_t kind(int k, int dtype, int op, int root)
{
    return UCCL_SG_KIND(k, dtype, op, root);
}

/* Chunk r of count elements split n ways (the first count % n one longer). */
static void bounds(size_t count, int n, int r, size_t *a, size_t *b)
{
    size_t q = count / (size_t)n, rem = count % (size_t)n, ur = (size_t)r;
    *a = ur * q + (ur < rem ? ur : rem);
    *b = *a + q + (ur < rem ? 1 : 0);
}

static int run(uccl_sg_t *sg, const struct uccl_sg_opts *o, struct uccl_sg_call *c,
               uint32_t *round_p)
{
    c->caller = o->caller;
    c->caller_waits = o->caller_waits;
    c->end_event = o->end_event;
    return uccl_sg_round(sg, c, o->intr, o->intr_arg, round_p);
}

/* Whether nb bytes per rank go as a one-launch round: the group has an
 * arena whose slots hold them (the same on every rank), and where the
 * caller's stream captures a CUDA graph, the device captures one-launch
 * rounds (sg_graph.c; else the captured round is two-sided).  *capture:
 * what the device said of the caller's stream (struct uccl_sg_call), so
 * that the round does not ask again. */
static int fits(uccl_sg_t *sg, const struct uccl_sg_opts *o, size_t nb, int *capture)
{
    size_t most = uccl_sg_fused_bytes(sg);
    *capture = 0;
    if (!most || nb > most)
        return 0;
    int on = uccl_sg_capturing(sg, o->caller);
    if (on >= 0)
        *capture = on + 1;
    return on == 0 || (on == 1 && o->caller_waits && !o->end_event && uccl_sg_graph_fuses(sg, nb));
}

/* A one-launch round (sg_round.c). */
static int fused_run(uccl_sg_t *sg, const struct uccl_sg_opts *o, const char *what,
                     uint32_t k, uint64_t arg, const struct uccl_sg_fused *f, int capture,
                     uint32_t *round_p)
{
    struct uccl_sg_call c = {.what = what, .kind = k | UCCL_SG_FUSED_KIND, .arg = arg,
                             .phases = 1, .fused = f, .capture = capture};
    return run(sg, o, &c, round_p);
}

static int elems(const char *what, size_t count, int dtype, size_t *nb_p)
{
    size_t esz = uccl_dtype_size(dtype);
    if (!esz || count > SIZE_MAX / esz / UCCL_SG_MAX_RANKS)
        return uccl__err(UCCL_ERR_INVALID, "%s: %zu elements of type %d", what, count, dtype);
    *nb_p = count * esz;
    return UCCL_OK;
}

static int check_root(uccl_sg_t *sg, const char *what, int root)
{
    if (root < 0 || root >= uccl_sg_size(sg))
        return uccl__err(UCCL_ERR_INVALID, "%s: root rank %d is not in 0..%d", what, root,
                         uccl_sg_size(sg) - 1);
    return UCCL_OK;
}

int uccl_sg_allreduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t count,
                      int dtype, int op, uint32_t *round_p)
{
    int n = uccl_sg_size(sg), me = uccl_sg_rank(sg), rc;
    size_t nb = 0, esz = uccl_dtype_size(dtype), a, b;
    if ((rc = elems("all_reduce", count, dtype, &nb)))
        return rc;
    int capture;
    if (fits(sg, o, nb, &capture)) {
        struct uccl_sg_fused f = {0, dtype, op, ptr, ptr, nb, count};
        return fused_run(sg, o, "all_reduce", kind(K_ALLREDUCE, dtype, op, 0), count, &f,
                         capture, round_p);
    }
    struct uccl_sg_pub pub = {UCCL_SG_TAG_ALL, ptr, nb};
    struct uccl_sg_pull pull[UCCL_SG_MAX_RANKS];
    int npull = 0;
    for (int r = 0; r < n; r++) {
        bounds(count, n, r, &a, &b);
        if (r != me && b > a)
            pull[npull++] = (struct uccl_sg_pull){r, 2, 0, UCCL_SG_TAG_ALL, a * esz,
                                                  ptr + a * esz, (b - a) * esz};
    }
    bounds(count, n, me, &a, &b);
    struct uccl_sg_red red = {dtype, op, UCCL_SG_TAG_ALL, a * esz, ptr + a * esz, b - a};
    struct uccl_sg_call c = {.what = "all_reduce", .kind = kind(K_ALLREDUCE, dtype, op, 0),
                             .arg = count, .phases = 2, .pub = &pub, .npub = 1, .pull = pull,
                             .npull = npull, .red = &red, .capture = capture};
    return run(sg, o, &c, round_p);
}

int uccl_sg_reduce_scatter(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t out,
                           uintptr_t in, size_t count, int dtype, int op, uint32_t *round_p)
{
    int n = uccl_sg_size(sg), me = uccl_sg_rank(sg), rc;
    size_t nb = 0;
    if ((rc = elems("reduce_scatter", count, dtype, &nb)))
        return rc;
    struct uccl_sg_pub pub = {UCCL_SG_TAG_ALL, in, nb * (size_t)n};
    struct uccl_sg_red red = {dtype, op, UCCL_SG_TAG_ALL, nb * (size_t)me, out, count};
    struct uccl_sg_call c = {.what = "reduce_scatter", .kind = kind(K_REDUCE_SCATTER, dtype, op, 0),
                             .arg = count, .phases = 1, .pub = &pub, .npub = 1, .red = &red};
    return run(sg, o, &c, round_p);
}

int uccl_sg_allgather(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t src, size_t nbytes,
                      uintptr_t dst, uint32_t *round_p)
{
    int n = uccl_sg_size(sg), me = uccl_sg_rank(sg);
    if (nbytes > SIZE_MAX / UCCL_SG_MAX_RANKS)
        return uccl__err(UCCL_ERR_INVALID, "allgather: %zu bytes per rank", nbytes);
    int capture;
    if (fits(sg, o, nbytes, &capture)) {
        struct uccl_sg_fused f = {1, UCCL_DT_U8, 0, src, dst, nbytes, nbytes};
        return fused_run(sg, o, "allgather", kind(K_ALLGATHER, 0, 0, 0), nbytes, &f, capture,
                         round_p);
    }
    struct uccl_sg_pub pub = {UCCL_SG_TAG_ALL, src, nbytes};
    struct uccl_sg_pull pull[UCCL_SG_MAX_RANKS];
    int npull = 0;
    for (int r = 0; r < n; r++)
        if (r != me)
            pull[npull++] = (struct uccl_sg_pull){r, 1, 1, UCCL_SG_TAG_ALL, 0,
                                                  dst + (size_t)r * nbytes, nbytes};
    struct uccl_sg_copy own = {dst + (size_t)me * nbytes, src, nbytes};
    struct uccl_sg_call c = {.what = "allgather", .kind = kind(K_ALLGATHER, 0, 0, 0),
                             .arg = nbytes, .phases = 1, .pub = &pub, .npub = 1, .pull = pull,
                             .npull = npull, .copy = &own, .ncopy = 1, .capture = capture};
    return run(sg, o, &c, round_p);
}

/* From this many bytes, a broadcast among 3 or more ranks is a scatter
 * then an allgather (below).  Every rank pulling the whole buffer from the
 * root puts (n-1) x nbytes through the root's link; split, the root serves
 * (n-1)/n of it in phase 1 and the allgather pulls the rest one peer at a
 * time: 2 (n-1)/n x nbytes over any one link, for one more handshake
 * (~15 us).  At 4 ranks that wins from about 1.5 x nbytes / 387 GB/s > 15 us,
 * i.e. ~4 MB (the root served 3 readers at 387 GB/s on 4 x H200). */
#define BCAST_SPLIT_BYTES (4u << 20)

/* Slice r of nbytes split n ways at 16-byte bounds (the last takes the rest). */
static void slice16(size_t nbytes, int n, int r, size_t *a, size_t *b)
{
    bounds(nbytes / 16, n, r, a, b);
    *a *= 16;
    *b = r == n - 1 ? nbytes : *b * 16;
}

int uccl_sg_broadcast(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t nbytes,
                      int root, uint32_t *round_p)
{
    int rc = check_root(sg, "broadcast", root);
    if (rc)
        return rc;
    int n = uccl_sg_size(sg), me = uccl_sg_rank(sg);
    struct uccl_sg_pub pub = {UCCL_SG_TAG_ALL, ptr, nbytes};
    struct uccl_sg_pull pull[UCCL_SG_MAX_RANKS];
    struct uccl_sg_call c = {.what = "broadcast", .kind = kind(K_BROADCAST, 0, 0, root),
                             .arg = nbytes, .phases = 1};
    int npull = 0;
    if (n >= 3 && nbytes >= BCAST_SPLIT_BYTES) {
        /* every rank publishes its buffer; phase 1: a non-root rank pulls
         * its slice from the root; phase 2: every slice it lacks from the
         * rank that holds it (slice r at rank r, the root's at the root).
         * Phase 2 starts once every rank is done with phase 1, so no slice
         * is read before it is there; the root pulls nothing */
        c.phases = 2;
        c.pub = &pub;
        c.npub = 1;
        for (int r = 0; r < n && me != root; r++) {
            size_t a, b;
            slice16(nbytes, n, r, &a, &b);
            if (b > a)
                pull[npull++] = (struct uccl_sg_pull){r == me ? root : r, r == me ? 1 : 2, 0,
                                                      UCCL_SG_TAG_ALL, a, ptr + a, b - a};
        }
    } else if (me == root) {
        c.pub = &pub;
        c.npub = 1;
    } else {
        pull[npull++] = (struct uccl_sg_pull){root, 1, 1, UCCL_SG_TAG_ALL, 0, ptr, nbytes};
    }
    c.pull = npull ? pull : NULL;
    c.npull = npull;
    return run(sg, o, &c, round_p);
}

int uccl_sg_reduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, uintptr_t ptr, size_t count,
                   int dtype, int op, int root, uint32_t *round_p)
{
    int rc = check_root(sg, "reduce", root);
    size_t nb = 0;
    if (rc || (rc = elems("reduce", count, dtype, &nb)))
        return rc;
    struct uccl_sg_pub pub = {UCCL_SG_TAG_ALL, ptr, nb};
    struct uccl_sg_red red = {dtype, op, UCCL_SG_TAG_ALL, 0, ptr, count};
    struct uccl_sg_call c = {.what = "reduce", .kind = kind(K_REDUCE, dtype, op, root),
                             .arg = count, .phases = 1, .pub = &pub, .npub = 1,
                             .red = uccl_sg_rank(sg) == root ? &red : NULL};
    return run(sg, o, &c, round_p);
}

/* Every rank publishes its chunk for each peer (under the tag to that
 * peer) and pulls its own from each, exactly the size it expects (a pair
 * whose sizes differ fails the group, naming both sides; an empty chunk
 * still pairs with the peer's); its own chunk is a copy.  What
 * StreamGroup.all_to_all_args builds in Python, the same round. */
int uccl_sg_all_to_all(uccl_sg_t *sg, const struct uccl_sg_opts *o,
                       const struct uccl_sg_span *send, const struct uccl_sg_span *recv,
                       uint32_t *round_p)
{
    int n = uccl_sg_size(sg), me = uccl_sg_rank(sg), np = 0;
    if (send[me].len != recv[me].len)
        return uccl__err(UCCL_ERR_INVALID, "all_to_all: this rank sends itself %zu bytes but "
                         "expects %zu", send[me].len, recv[me].len);
    struct uccl_sg_pub pub[UCCL_SG_MAX_RANKS];
    struct uccl_sg_pull pull[UCCL_SG_MAX_RANKS];
    for (int r = 0; r < n; r++)
        if (r != me) {
            pub[np] = (struct uccl_sg_pub){UCCL_SG_TAG_TO(r, 0), send[r].ptr, send[r].len};
            pull[np++] = (struct uccl_sg_pull){r, 1, 1, UCCL_SG_TAG_TO(me, 0), 0, recv[r].ptr,
                                               recv[r].len};
        }
    struct uccl_sg_copy own = {recv[me].ptr, send[me].ptr, send[me].len};
    struct uccl_sg_call c = {.what = "all_to_all", .kind = UCCL_SG_KIND_ALL_TO_ALL, .arg = 0,
                             .phases = 1, .pub = pub, .npub = np, .pull = pull, .npull = np,
                             .copy = &own, .ncopy = 1};
    return run(sg, o, &c, round_p);
}
