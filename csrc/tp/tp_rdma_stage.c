/* RDMA: memory no NIC could register (GPU memory without GPUDirect; any
 * memory under UCCL_P2P_RDMA_STAGE_ALL=1), staged through registered host
 * memory on its own side: the staging ring (tp_rdma.h).
 *
 * Its own moves (sending or writing from it, reading into it) go through
 * one chunk of page-locked memory per connection, the mover's business
 * (tp_rdma_move.c).  This file carries the rest:
 *
 * What the peer must reach in it (a receive buffer, a window written to or
 * read from) cannot be addressed by the peer, so those transfers stream
 * (proto_stream.c, tp->staged) through the receiving side's staging ring:
 * RING_SLOTS slots of page-locked memory (for a GPU destination; plain
 * memory for a host one), registered with every NIC for remote writes and
 * lent to the peer slot by slot:
 *
 *   sender                               receiver
 *   RING{seq, kind}  (once, when it first needs the ring)
 *                                        makes the ring; CREDIT{slot, addr, len, rkeys}
 *                                        for every slot
 *   RDMA WRITE of a chunk into a lent slot (its own memory, or through its
 *   own area if staged too), completed; DATA{seq, kind, offset, len, slot}
 *                                        checks the slot is lent and the
 *                                        chunk against the transfer
 *                                        (uccl__conn_rx_begin), copies it out
 *                                        (to the GPU by the copy engine),
 *                                        CREDIT{slot} again
 *
 * One thread per connection sends the streams (made at the first), one
 * transfer after the other, a chunk into each slot lent; with several slots
 * the receiver's copy of one chunk overlaps the WRITE of the next.  Every
 * DATA and CREDIT is checked (slot index and state, lengths, kind); the
 * peer can only ever reach the ring.  Lending is flow control, not access
 * control: the ring is one registration, writable by the peer throughout,
 * so a peer that writes a slot it was not lent (or rewrites one it already
 * announced) can only garble its own transfers on this connection; what
 * lands in a receive buffer is still bounded by the transfer
 * (uccl__conn_rx_begin).  A credit that does
 * not come within the timeout fails the connection, as does anything a
 * peer sends out of turn; a failed connection stops the thread, and the
 * requests of what it had not sent fail with it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <time.h>
#include <unistd.h>

#include "tp/transport.h"
#include "gpu/gpu.h"
#include "net/sock.h"
#include "base/status.h"
#include "tp/tp_rdma.h"

#define RING_SLOTS 4            /* slots this side lends */
#define PEER_SLOTS 16           /* slots a peer may lend */
#define SLOT_MAX (4u << 20)     /* this side's slot size: the chunk, at most this */
#define PEER_SLOT_MAX (1ull << 30)
#define RING_ACCESS (IBV_ACCESS_LOCAL_WRITE_ | IBV_ACCESS_REMOTE_WRITE_)

enum { PEER_WAIT = 0,   /* with the peer (or never lent): its CREDIT may come */
       PEER_FREE,       /* credited: ours to write once */
       PEER_BUSY };     /* being written, its DATA not yet sent */

struct sjob {
    int kind;
    uint64_t id;
    const char *src;
    uint64_t src_key;
    size_t len;
    void *cookie;
    STAILQ_ENTRY(sjob) link;
};

struct uccl__rdma_stage {
    pthread_mutex_t mu;             /* everything below */
    pthread_cond_t cv;              /* the sender: a job, a credit, stop */
    int stop;
    /* sending */
    STAILQ_HEAD(, sjob) jobs;
    int thread;
    pthread_t tx;
    int asked;                      /* RING sent */
    struct { uint64_t addr, len, keys; int state; } peer[PEER_SLOTS]; /* PEER_* */
    /* receiving */
    struct uccl__rdma_area ring;    /* made when the peer asks */
    size_t slot_bytes;
    int lent[RING_SLOTS];           /* the peer may write the slot */
};

static struct uccl__rdma_stage *stage_of(struct uccl__link *lk)
{
    return ((struct uccl__rdma_conn *)lk->tp_priv)->stage;
}

/* ---- life cycle ------------------------------------------------------------------- */

int uccl__rdma_stage_new(size_t chunk, struct uccl__rdma_stage **s_p)
{
    struct uccl__rdma_stage *s = calloc(1, sizeof(*s));
    if (!s)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    s->slot_bytes = chunk < SLOT_MAX ? chunk : SLOT_MAX;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    STAILQ_INIT(&s->jobs);
    *s_p = s;
    return UCCL_OK;
}

void uccl__rdma_stage_shutdown(struct uccl__rdma_stage *s)
{
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void uccl__rdma_stage_join(struct uccl__rdma_stage *s)
{
    if (s && s->thread) {
        pthread_join(s->tx, NULL);
        s->thread = 0;
    }
}

void uccl__rdma_stage_free(struct uccl__rdma_stage *s)
{
    if (!s)
        return;
    for (struct sjob *j; (j = STAILQ_FIRST(&s->jobs));) { /* none: the thread failed them */
        STAILQ_REMOVE_HEAD(&s->jobs, link);
        free(j);
    }
    uccl__rdma_area_free(&s->ring);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* ---- sending ----------------------------------------------------------------------- */

/* Under mu: a slot the peer lent, asking for its ring first (once).  Waits
 * for a credit until the connection's timeout. */
static int take_slot(struct uccl__link *lk, struct uccl__rdma_stage *s, const struct sjob *j,
                     unsigned *slot_p)
{
    uint64_t deadline = uccl__now_ns() + lk->local->timeout_ns;
    for (;;) {
        for (unsigned i = 0; i < PEER_SLOTS; i++)
            if (s->peer[i].state == PEER_FREE) {
                s->peer[i].state = PEER_BUSY;
                *slot_p = i;
                return UCCL_OK;
            }
        if (s->stop)
            return uccl__err(UCCL_ERR_CLOSED, "the connection failed");
        if (!s->asked) {
            s->asked = 1;
            struct uccl__msg m = {.type = UCCL_MSG_RING, .seq = j->id, .token = (uint64_t)j->kind};
            pthread_mutex_unlock(&s->mu);
            int rc = uccl__conn_send_msg(lk->conn, &m);
            pthread_mutex_lock(&s->mu);
            if (rc)
                return rc;
            continue;
        }
        uint64_t now = uccl__now_ns();
        if (now >= deadline)
            return uccl__err(UCCL_ERR_TIMEOUT, "the peer lent no slot of its staging ring "
                             "within %.0f s", (double)lk->local->timeout_ns / 1e9);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (deadline - now);
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
}

static void *tx_main(void *arg)
{
    struct uccl__link *lk = arg;
    struct uccl__rdma_stage *s = stage_of(lk);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (STAILQ_EMPTY(&s->jobs) && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop)
            break;
        struct sjob *j = STAILQ_FIRST(&s->jobs);
        int rc = UCCL_OK;
        for (size_t off = 0; off < j->len && rc == UCCL_OK;) {
            unsigned slot = 0;
            rc = take_slot(lk, s, j, &slot);
            if (rc)
                break;
            uint64_t addr = s->peer[slot].addr, keys = s->peer[slot].keys;
            size_t n = j->len - off < s->peer[slot].len ? j->len - off : s->peer[slot].len;
            pthread_mutex_unlock(&s->mu);
            rc = uccl__rdma_move(lk, 0, (char *)j->src + off, j->src_key, addr, keys, n, 0);
            if (rc == UCCL_OK) { /* landed (the WRITEs completed): the receiver may copy */
                pthread_mutex_lock(&s->mu);
                s->peer[slot].state = PEER_WAIT; /* before the DATA: its CREDIT may come at once */
                pthread_mutex_unlock(&s->mu);
                struct uccl__msg m = {.type = UCCL_MSG_DATA, .seq = j->id, .len = n,
                                      .offset = off, .token = (uint64_t)j->kind, .aux = slot};
                rc = uccl__conn_send_msg(lk->conn, &m);
            }
            off += n;
            pthread_mutex_lock(&s->mu);
        }
        STAILQ_REMOVE_HEAD(&s->jobs, link);
        pthread_mutex_unlock(&s->mu);
        uccl__conn_tx_done(lk->conn, j->cookie, rc);
        free(j);
        pthread_mutex_lock(&s->mu);
    }
    /* Stopped: what is still queued fails now. */
    STAILQ_HEAD(, sjob) left = STAILQ_HEAD_INITIALIZER(left);
    STAILQ_CONCAT(&left, &s->jobs);
    pthread_mutex_unlock(&s->mu);
    for (struct sjob *j; (j = STAILQ_FIRST(&left));) {
        STAILQ_REMOVE_HEAD(&left, link);
        uccl__err(UCCL_ERR_CLOSED, "the connection failed before the data was sent");
        uccl__conn_tx_done(lk->conn, j->cookie, UCCL_ERR_CLOSED);
        free(j);
    }
    return NULL;
}

int uccl__rdma_stream(struct uccl__link *lk, int kind, uint64_t id, const void *src,
                      uint64_t src_key, size_t len, void *cookie)
{
    struct uccl__rdma_stage *s = stage_of(lk);
    struct sjob *j = calloc(1, sizeof(*j));
    if (!j)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *j = (struct sjob){.kind = kind, .id = id, .src = src, .src_key = src_key, .len = len,
                       .cookie = cookie};
    pthread_mutex_lock(&s->mu);
    int rc = s->stop ? uccl__err(UCCL_ERR_CLOSED, "the connection is shutting down") : UCCL_OK;
    if (rc == UCCL_OK && !s->thread) {
        if (pthread_create(&s->tx, NULL, tx_main, lk))
            rc = uccl__err(UCCL_ERR_NOMEM, "pthread_create failed (the RDMA stream thread)");
        else
            s->thread = 1;
    }
    if (rc == UCCL_OK) {
        STAILQ_INSERT_TAIL(&s->jobs, j, link);
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc)
        free(j);
    return rc;
}

/* ---- receiving ------------------------------------------------------------------------ */

static int send_credit(struct uccl__link *lk, struct uccl__rdma_stage *s, unsigned slot)
{
    unsigned n;
    uccl__rdma_devs(&n);
    uint64_t keys = 0;
    for (unsigned i = 0; i < n && i < UCCL_RDMA_MAX_DEVS; i++)
        keys |= (uint64_t)s->ring.mr[i]->rkey << (32 * i);
    struct uccl__msg m = {.type = UCCL_MSG_CREDIT, .aux = slot, .len = s->slot_bytes,
                          .addr = (uint64_t)(uintptr_t)(s->ring.p + slot * s->slot_bytes),
                          .window = keys};
    return uccl__conn_send_msg(lk->conn, &m);
}

static int data_kind_ok(uint64_t kind)
{
    return kind == UCCL_DATA_SEND || kind == UCCL_DATA_WRITE || kind == UCCL_DATA_READ;
}

/* RING: the peer streams transfer (kind, seq) into this side, which makes
 * its ring for the memory that transfer lands in and lends every slot. */
static int on_ring(struct uccl__link *lk, struct uccl__rdma_stage *s, const struct uccl__msg *m)
{
    char *dst;
    uint64_t key;
    struct uccl__req *r;
    if (s->ring.p)
        return uccl__err(UCCL_ERR_PROTO, "the peer asked for the RDMA staging ring twice");
    if (!data_kind_ok(m->token))
        return uccl__err(UCCL_ERR_PROTO, "RDMA staging ring asked for a transfer of kind %llu",
                         (unsigned long long)m->token);
    int rc = uccl__conn_rx_begin(lk->conn, (int)m->token, m->seq, 0, 0, &dst, &key, &r);
    if (rc)
        return rc;
    const struct uccl__rdma_mr *mr = uccl__rdma_mr_of(key);
    uint32_t mk = mr ? mr->mkind : 0;
    uccl__conn_rx_abort(lk->conn, r);
    if (!mr)
        return UCCL_ERR_PROTO;
    pthread_mutex_lock(&s->mu);
    rc = uccl__rdma_area_make(&s->ring, uccl__rdma_stage_kind(mk), RING_SLOTS * s->slot_bytes,
                              RING_ACCESS);
    for (unsigned i = 0; rc == UCCL_OK && i < RING_SLOTS; i++)
        s->lent[i] = 1;
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return uccl__err(rc, "making the RDMA staging ring the peer asked for: %s",
                         uccl_last_error());
    for (unsigned i = 0; rc == UCCL_OK && i < RING_SLOTS; i++)
        rc = send_credit(lk, s, i);
    return rc;
}

/* DATA: a chunk sits in a slot; checked, copied out, the slot lent again. */
static int on_data(struct uccl__link *lk, struct uccl__rdma_stage *s, const struct uccl__msg *m)
{
    pthread_mutex_lock(&s->mu);
    const char *bad = !s->ring.p ? "no ring was lent"
                    : m->aux >= RING_SLOTS || !s->lent[m->aux] ? "a slot not lent"
                    : m->len == 0 || m->len > s->slot_bytes || !data_kind_ok(m->token)
                    ? "malformed" : NULL;
    if (!bad)
        s->lent[m->aux] = 0;
    pthread_mutex_unlock(&s->mu);
    if (bad)
        return uccl__err(UCCL_ERR_PROTO, "RDMA staged chunk of %llu bytes (kind %llu) in slot "
                         "%llu: %s", (unsigned long long)m->len, (unsigned long long)m->token,
                         (unsigned long long)m->aux, bad);
    unsigned slot = (unsigned)m->aux;
    char *dst;
    uint64_t key;
    struct uccl__req *r;
    int rc = uccl__conn_rx_begin(lk->conn, (int)m->token, m->seq, m->offset, m->len, &dst, &key,
                                 &r);
    if (rc)
        return rc;
    const struct uccl__rdma_mr *mr = uccl__rdma_mr_of(key);
    rc = mr ? uccl__gpu_copy_kinds(dst, mr->mkind, s->ring.p + slot * s->slot_bytes, s->ring.mk,
                                   m->len, lk->local->timeout_ns)
            : UCCL_ERR_PROTO;
    if (rc) {
        uccl__conn_rx_abort(lk->conn, r);
        return uccl__err(rc, "copying a staged chunk of transfer %llu out of the RDMA staging "
                         "ring: %s", (unsigned long long)m->seq, uccl_last_error());
    }
    uccl__conn_rx_end(lk->conn, r, m->len);
    pthread_mutex_lock(&s->mu);
    s->lent[slot] = 1;
    pthread_mutex_unlock(&s->mu);
    return send_credit(lk, s, slot);
}

/* CREDIT: a slot of the peer's ring is ours to write once. */
static int on_credit(struct uccl__rdma_stage *s, const struct uccl__msg *m)
{
    pthread_mutex_lock(&s->mu);
    int ok = s->asked && m->aux < PEER_SLOTS && s->peer[m->aux].state == PEER_WAIT &&
             m->len > 0 && m->len <= PEER_SLOT_MAX;
    if (ok) {
        s->peer[m->aux].addr = m->addr;
        s->peer[m->aux].len = m->len;
        s->peer[m->aux].keys = m->window;
        s->peer[m->aux].state = PEER_FREE;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return ok ? UCCL_OK : uccl__err(UCCL_ERR_PROTO, "RDMA staging ring credit for slot %llu "
                                    "(%llu bytes) out of turn or malformed",
                                    (unsigned long long)m->aux, (unsigned long long)m->len);
}

int uccl__rdma_on_msg(struct uccl__link *lk, const struct uccl__msg *m)
{
    struct uccl__rdma_stage *s = stage_of(lk);
    switch (m->type) {
    case UCCL_MSG_RING: return on_ring(lk, s, m);
    case UCCL_MSG_DATA: return on_data(lk, s, m);
    case UCCL_MSG_CREDIT: return on_credit(s, m);
    default:
        return uccl__err(UCCL_ERR_PROTO, "control message type %u not used over RDMA", m->type);
    }
}
