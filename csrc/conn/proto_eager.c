/* Eager payloads on a socket control channel (conn.h): a message of at
 * most UCCL_EAGER_MAX bytes travels right behind its RTS, and the
 * connection's reader (progress.c) reads it straight into the posted recv
 * it will match, or into a held buffer within the budget a well-behaved
 * sender never exceeds; once all of it is in, the protocol (proto.c)
 * queues and matches it like any announced message. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "conn/conn.h"
#include "base/status.h"

/* An eager RTS: decide where its bytes go before reading them.  Straight
 * into the posted recv that it will match, if sizes agree; else into a
 * held buffer, within the budget a well-behaved sender never exceeds. */
int uccl__proto_eager_begin(struct uccl__conn *c, const struct uccl__msg *m)
{
    if (c->link.is_connector || c->link.ctrl_shm || c->link.direct)
        return uccl__err(UCCL_ERR_PROTO, "eager message on a connection that does not take them");
    if (m->len > UCCL_EAGER_MAX)
        return uccl__err(UCCL_ERR_PROTO, "eager message of %llu bytes (at most %u)",
                         (unsigned long long)m->len, UCCL_EAGER_MAX);
    struct uccl__rts *rts = calloc(1, sizeof(*rts));
    if (!rts)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *rts = (struct uccl__rts){.seq = m->seq, .len = m->len, .addr = m->addr, .eager = 1,
                              .slot = -1};
    c->erx = (__typeof__(c->erx)){.rts = rts};
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = TAILQ_FIRST(&c->posted);
    if (STAILQ_EMPTY(&c->rtsq) && r && r->seq == m->seq && r->len == m->len &&
        !UCCL_MK_ON_GPU(r->mkind)) { /* a socket cannot write GPU memory */
        uccl__req_get(r);
        atomic_fetch_add(&r->busy, 1);
        c->erx.direct = r;
        c->erx.dst = r->buf;
    } else if (m->len > 0) {
        if (c->eager_held + m->len > (size_t)UCCL_EAGER_MAX * UCCL_EAGER_INFLIGHT) {
            pthread_mutex_unlock(&c->mu);
            c->erx.rts = NULL;
            free(rts);
            return uccl__err(UCCL_ERR_PROTO, "peer sent more eager bytes than it may have in "
                             "flight (%zu held)", c->eager_held);
        }
        rts->data = malloc(m->len);
        if (!rts->data) {
            pthread_mutex_unlock(&c->mu);
            c->erx.rts = NULL;
            free(rts);
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        }
        c->eager_held += m->len;
        c->erx.dst = rts->data;
    }
    pthread_mutex_unlock(&c->mu);
    return m->len == 0 ? uccl__proto_eager_arrived(c) : UCCL_OK;
}

/* End the reader's eager payload: stop writing into the posted recv, if
 * that is where it went, and hand back its RTS.  Reader only. */
static struct uccl__rts *erx_take(struct uccl__conn *c)
{
    struct uccl__rts *rts = c->erx.rts;
    struct uccl__req *direct = c->erx.direct;
    c->erx = (__typeof__(c->erx)){0};
    if (direct) {
        atomic_fetch_sub(&direct->busy, 1);
        uccl__req_put(direct);
    }
    return rts;
}

int uccl__proto_eager_arrived(struct uccl__conn *c)
{
    return uccl__proto_queue_rts(c, erx_take(c));
}

/* Let go of a half-read eager payload (the connection failed).  Only the
 * reader of the moment calls this, as only it writes there. */
void uccl__proto_eager_drop(struct uccl__conn *c)
{
    struct uccl__rts *rts = erx_take(c);
    if (rts) {
        pthread_mutex_lock(&c->mu);
        c->eager_held -= rts->data ? rts->len : 0;
        pthread_mutex_unlock(&c->mu);
        free(rts->data);
        free(rts);
    }
}

