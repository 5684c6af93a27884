/* The algorithms of the collective layer (comm.h): what each operation
 * posts.  A p2p batch posts its sends and receives as given.  The direct
 * allgather posts every chunk at once (n-1 copies in flight per rank).  The
 * ring (two of them, in opposite directions) receives each piece of a chunk
 * from one neighbour and passes it on to the other as soon as it has
 * arrived, so a rank's receives and sends overlap.
 *
 * A new algorithm is a start function here and a uccl__coll_algo naming it
 * (plus, for an allgather, its place in uccl_comm_pick_algo). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "coll/comm.h"
#include "base/status.h"

#define PIECE_MIN (512u << 10)
#define PIECE_MAX (8u << 20)

/* The ring runs two rings at once: the first part of every chunk travels
 * clockwise, the rest counter-clockwise, so each rank copies from both
 * neighbours at once (twice the copies in flight of one ring) and every link
 * carries traffic both ways.  Small chunks (and 2 ranks) go one way only. */
#define BIDIR_MIN (1u << 20)

int uccl_comm_pick_algo(const uccl_comm_t *cm, int algo, size_t chunk)
{
    if (algo != UCCL_AG_AUTO)
        return algo;
    /* Both move (n-1) chunks per rank.  Within a host, direct wins: every
     * copy can run at once, while the ring waits on its neighbour at every
     * step (measured on 2 cores: 8 ranks, 1 MiB: 6.1 ms direct, 22.5 ms
     * ring).  Across nodes with many ranks, the ring crosses each node
     * boundary once per step instead of opening n-1 streams per rank. */
    return cm->multinode && cm->size > 4 && chunk >= (1u << 20) ? UCCL_AG_RING
                                                                 : UCCL_AG_DIRECT;
}

/* ------------------------------------------------------------------------- */
/* p2p batches                                                                */

static int start_p2p(struct uccl__comm *cm, struct uccl__op *o)
{
    int rc = UCCL_OK;
    for (int i = 0; i < o->n && rc == UCCL_OK; i++) {
        struct uccl_coll_p2p *e = &o->p2p[i];
        if ((rc = uccl__coll_reg(cm, o, &e->buf)))
            return uccl__op_err(o, rc, "p2p: %s", uccl_last_error());
        rc = uccl__coll_post(cm, o, e->op, e->peer, &e->buf, 0, e->buf.len);
    }
    return rc;
}

const struct uccl__coll_algo uccl__coll_p2p = {
    .name = "p2p", .posted_is_done = 1, .start = start_p2p,
};

/* ------------------------------------------------------------------------- */
/* allgather                                                                  */

static size_t piece_for(const struct uccl__comm *cm, size_t len)
{
    if (cm->piece)
        return cm->piece;
    /* Two pieces per part of a chunk: the second is on its way while the
     * first is forwarded, and a piece is still large enough for the copy to
     * be split over threads (16 cores, 4 ranks, 16 MiB per rank: 8.1 ms
     * with 4 MiB pieces, 13.0 ms with 2 MiB). */
    size_t p = len / 2;
    p = p < PIECE_MIN ? PIECE_MIN : p > PIECE_MAX ? PIECE_MAX : p;
    return (p + 4095) & ~(size_t)4095;
}

/* Post bytes [off, off + len) of chunk c (this rank's own when c < 0) as
 * pieces: at least one, so an empty region is still matched and a length
 * mismatch shows.  With to >= 0, also record each piece as a forward to that
 * rank, made once the piece has arrived. */
static int post_pieces(struct uccl__comm *cm, struct uccl__op *o, int kind, int peer, int c,
                       size_t off, size_t len, int to)
{
    const struct uccl_coll_buf *b = c < 0 ? &o->send : &o->recv[c];
    size_t p = piece_for(cm, len), end = off + len;
    do {
        size_t n = end - off < p ? end - off : p;
        int rc = uccl__coll_post(cm, o, kind, peer, b, off, n);
        if (rc)
            return rc;
        if (to >= 0) {
            struct uccl__fwd *f = realloc(o->fwd, (size_t)(o->nfwd + 1) * sizeof(*f));
            if (!f)
                return uccl__op_err(o, UCCL_ERR_NOMEM, "out of memory");
            o->fwd = f;
            f[o->nfwd++] = (struct uccl__fwd){.c = c, .rx = o->x.n - 1, .to = to, .off = off,
                                              .len = n};
        }
        off += n;
    } while (off < end);
    return UCCL_OK;
}

static size_t clockwise_part(const struct uccl__comm *cm, size_t len)
{
    if (cm->size < 3 || len < BIDIR_MIN)
        return len;
    return ((len / 2) + 4095) & ~(size_t)4095;
}

/* This rank's own chunk into its place (host or GPU memory: the engine's
 * copy, which tells them apart).  Within GPU memory it is only started
 * (o->own_copy), so the receives are posted at once and the copy engine
 * runs it alongside them; finishing the operation waits for it. */
static int copy_own(struct uccl__comm *cm, struct uccl__op *o)
{
    struct uccl_coll_buf *own = &o->recv[cm->rank];
    int rc = uccl_ep_copy_start(cm->ep, own->ptr, o->send.ptr, o->send.len, &o->own_copy);
    return rc ? uccl__op_err(o, rc, "%s: this rank's own chunk: %s", o->algo->name,
                             uccl_last_error())
              : UCCL_OK;
}

/* Both allgathers: register the buffers; the flag receives are posted with.
 * A caller that waits at once posts them "blocking": a peer's announcement
 * already in is pulled right here, on this thread, instead of being handed
 * to the connection's worker. */
static int allgather_setup(struct uccl__comm *cm, struct uccl__op *o, int *rflag_p)
{
    int rc = uccl__coll_reg(cm, o, &o->send);
    for (int r = 0; r < cm->size && rc == UCCL_OK; r++)
        if (r != cm->rank)
            rc = uccl__coll_reg(cm, o, &o->recv[r]);
    if (rc)
        return uccl__op_err(o, rc, "allgather: %s", uccl_last_error());
    *rflag_p = o->async || cm->handoff ? 0 : UCCL_XFER_BLOCKING;
    return UCCL_OK;
}

/* Sends first, so that peers can start pulling; then this rank's own
 * chunk; then the receives. */
static int start_direct(struct uccl__comm *cm, struct uccl__op *o)
{
    int n = cm->size, me = cm->rank, rflag, rc = allgather_setup(cm, o, &rflag);
    /* Staggered, so that the ranks do not all start with rank 0. */
    for (int i = 1; i < n && rc == UCCL_OK; i++)
        rc = uccl__coll_post(cm, o, UCCL_XFER_SEND, (me + i) % n, &o->send, 0, o->send.len);
    if (rc == UCCL_OK)
        rc = copy_own(cm, o);
    for (int i = 1; i < n && rc == UCCL_OK; i++) {
        int r = (me - i + n) % n;
        rc = uccl__coll_post(cm, o, UCCL_XFER_RECV | rflag, r, &o->recv[r], 0, o->recv[r].len);
    }
    return rc;
}

const struct uccl__coll_algo uccl__coll_direct = {
    .name = "direct allgather", .start = start_direct,
};

/* At step s the clockwise ring receives chunk me-1-s from the left and the
 * counter-clockwise one chunk me+1+s from the right; the chunks of steps
 * 0..n-3 are passed on piece by piece as they arrive. */
static int start_ring(struct uccl__comm *cm, struct uccl__op *o)
{
    int n = cm->size, me = cm->rank, rflag, rc = allgather_setup(cm, o, &rflag);
    if (rc)
        return rc;
    if (n == 1)
        return copy_own(cm, o);
    int left = (me - 1 + n) % n, right = (me + 1) % n;
    size_t h = clockwise_part(cm, o->send.len);
    rc = post_pieces(cm, o, UCCL_XFER_SEND, right, -1, 0, h, -1);
    if (rc == UCCL_OK && n > 2)
        rc = post_pieces(cm, o, UCCL_XFER_SEND, left, -1, h, o->send.len - h, -1);
    if (rc == UCCL_OK)
        rc = copy_own(cm, o);
    for (int s = 0; s < n - 1 && rc == UCCL_OK; s++) {
        int cw = (me - 1 - s + 2 * n) % n, ccw = (me + 1 + s) % n;
        size_t hc = clockwise_part(cm, o->recv[cw].len);
        rc = post_pieces(cm, o, UCCL_XFER_RECV | rflag, left, cw, 0, hc,
                         s < n - 2 ? right : -1);
        if (rc == UCCL_OK && n > 2) {
            size_t hcc = clockwise_part(cm, o->recv[ccw].len);
            rc = post_pieces(cm, o, UCCL_XFER_RECV | rflag, right, ccw, hcc,
                             o->recv[ccw].len - hcc, s < n - 2 ? left : -1);
        }
    }
    return rc;
}

const struct uccl__coll_algo uccl__coll_ring = {
    .name = "ring allgather", .start = start_ring,
};
