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
#include <stdarg.h>
#include <stdio.h>
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

/* After a size mismatch of an allgather of equal chunks every rank has
 * failed (each receives from every rank as many bytes as it sends, so a
 * rank whose chunk differs fails every rank's receive from it): each sends
 * every other a record of its call (magic, chunk bytes), so that each can
 * name the ranks and their sizes. */
#define DIAG_MAGIC 0x75636c6167647231ull /* "uclagdr1" */

static int diagnose_direct(struct uccl__comm *cm, struct uccl__op *o)
{
    int n = cm->size, me = cm->rank, rc = UCCL_OK;
    for (int r = 0; r < n; r++)
        if (o->recv[r].len != o->send.len)
            return UCCL_ERR_UNAVAIL; /* uneven chunks: only the ranks that disagree fail */
    o->diag = calloc(2 * ((size_t)n + 1), sizeof(uint64_t));
    if (!o->diag)
        return uccl__op_err(o, UCCL_ERR_NOMEM, "out of memory");
    o->diag[0] = DIAG_MAGIC;
    o->diag[1] = o->send.len;
    memcpy(&o->diag[2 + 2 * me], o->diag, 2 * sizeof(uint64_t));
    struct uccl_coll_buf mine = {.ptr = (uintptr_t)o->diag, .len = 2 * sizeof(uint64_t)};
    struct uccl_coll_buf all = {.ptr = (uintptr_t)(o->diag + 2),
                                .len = 2 * sizeof(uint64_t) * (size_t)n};
    if ((rc = uccl__coll_reg(cm, o, &mine)) || (rc = uccl__coll_reg(cm, o, &all)))
        return uccl__op_err(o, rc, "allgather: %s", uccl_last_error());
    for (int i = 1; i < n && rc == UCCL_OK; i++)
        rc = uccl__coll_post(cm, o, UCCL_XFER_SEND, (me + i) % n, &mine, 0, mine.len);
    for (int i = 1; i < n && rc == UCCL_OK; i++) {
        int r = (me - i + n) % n;
        rc = uccl__coll_post(cm, o, UCCL_XFER_RECV, r, &all, (size_t)r * mine.len, mine.len);
    }
    return rc;
}

/* A message built piece by piece (truncated where it does not fit). */
struct text {
    char *p;
    size_t left;
};

static void put(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int w = t->left ? vsnprintf(t->p, t->left, fmt, ap) : 0;
    va_end(ap);
    size_t n = w < 0 ? 0 : (size_t)w < t->left ? (size_t)w : t->left - 1;
    t->p += n;
    t->left -= n;
}

static int says(const uint64_t *rec, int r, uint64_t len)
{
    return rec[2 * r] == DIAG_MAGIC && rec[2 * r + 1] == len;
}

static void explain_direct(struct uccl__comm *cm, struct uccl__op *o)
{
    int n = cm->size;
    const uint64_t *rec = o->diag + 2;
    struct text t = {o->msg, sizeof(o->msg)};
    put(&t, "allgather: the ranks' chunk sizes disagree (each rank receives from every rank as "
        "many bytes as it sends):");
    int groups = 0;
    for (int r = 0; r < n; r++) {
        int first = rec[2 * r] == DIAG_MAGIC; /* the first rank of its size: name them all */
        for (int q = 0; q < r && first; q++)
            first = !says(rec, q, rec[2 * r + 1]);
        if (!first)
            continue;
        int count = 0, shown = 0;
        for (int q = r; q < n; q++)
            count += says(rec, q, rec[2 * r + 1]);
        put(&t, "%s %s", groups++ ? "," : "", count > 1 ? "ranks" : "rank");
        for (int q = r; q < n && shown < 8; q++)
            if (says(rec, q, rec[2 * r + 1]))
                put(&t, "%s %d", shown++ ? "," : "", q);
        if (count > shown)
            put(&t, " and %d more", count - shown);
        put(&t, " %s %llu bytes", count > 1 ? "send" : "sends",
            (unsigned long long)rec[2 * r + 1]);
    }
    put(&t, "; rank %d received nothing from the ranks whose size differs from its own",
        cm->rank);
}

const struct uccl__coll_algo uccl__coll_direct = {
    .name = "direct allgather", .start = start_direct, .diagnose = diagnose_direct,
    .explain = explain_direct,
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
