/* The stream data path (conn.h): which transfers stream, handing a
 * transfer's bytes to the transport, and where the chunks a transport
 * receives land (the upcalls of transport.h), each checked against what
 * this side posted or advertised.  The protocol (proto.c) calls it; it
 * stands on the connection and its requests (conn.c) alone.
 *
 * A connection streams everything when its transport is not direct (TCP,
 * the shared-memory ring); a direct one streams only the transfers whose
 * bytes land in, or are read out of, memory the peer cannot reach (RDMA: GPU
 * memory that no NIC could register, tp->staged), which the side holding it
 * asks for with UCCL_MSG_FLAG_STREAM in its CTS or GO. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "conn/conn.h"
#include "base/status.h"

int uccl__proto_streams(const struct uccl__conn *c, uint64_t local_key)
{
    return !c->link.direct || (c->link.tp->staged && c->link.tp->staged(local_key));
}

int uccl__proto_stream_out(struct uccl__conn *c, int kind, uint64_t id, const void *src,
                           uint64_t src_key, size_t len, struct uccl__req *r)
{
    if (r) {
        uccl__req_get(r); /* the transport's job holds it until tx_done... */
        atomic_fetch_add(&r->busy, 1); /* ...and reads its buffer till then */
    }
    int rc = c->link.tp->stream(&c->link, kind, id, src, src_key, len, r);
    if (rc) {
        if (r) {
            atomic_fetch_sub(&r->busy, 1);
            uccl__req_put(r);
        }
        uccl__conn_fail(c, rc, "queueing data: %s", uccl_last_error());
    }
    return rc;
}

int uccl__conn_rx_begin(struct uccl__conn *c, int kind, uint64_t id, uint64_t offset,
                        uint64_t len, char **dst_p, uint64_t *dst_key_p,
                        struct uccl__req **req_p)
{
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = uccl__idmap_get(&c->rx, uccl__proto_key(kind, id));
    if (!r) {
        pthread_mutex_unlock(&c->mu);
        return uccl__err(UCCL_ERR_PROTO, "data chunk (kind %d) for transfer %llu that this "
                         "side never accepted", kind, (unsigned long long)id);
    }
    if (offset > r->len || len > r->len - offset) {
        pthread_mutex_unlock(&c->mu);
        return uccl__err(UCCL_ERR_PROTO, "data chunk [%llu, +%llu) outside the %zu-byte "
                         "buffer of transfer %llu", (unsigned long long)offset,
                         (unsigned long long)len, r->len, (unsigned long long)id);
    }
    uccl__req_get(r);
    atomic_fetch_add(&r->busy, 1);
    pthread_mutex_unlock(&c->mu);
    *dst_p = r->buf + offset;
    *dst_key_p = r->local_key;
    *req_p = r;
    return UCCL_OK;
}

void uccl__conn_rx_end(struct uccl__conn *c, struct uccl__req *r, uint64_t len)
{
    size_t got = atomic_fetch_add(&r->got, len) + len;
    atomic_fetch_sub(&r->busy, 1);
    if (got == r->len) {
        /* A streamed send completes on our FIN, not when its bytes left the
         * sender: the FIN is ordered before any BYE we may send next. */
        if (r->op == UCCL_OP_WRITE_TARGET)
            uccl__req_answer(c, r, UCCL_MSG_OPDONE, r->len, UCCL_OK, NULL);
        else if (r->op == UCCL_OP_RECV)
            uccl__req_answer(c, r, UCCL_MSG_FIN, r->len, UCCL_OK, NULL);
        else
            uccl__req_complete(c, r, UCCL_OK, NULL);
    } else if (got > r->len) {
        uccl__conn_fail(c, UCCL_ERR_PROTO, "peer sent %zu bytes for a %zu-byte transfer", got,
                        r->len);
    }
    uccl__req_put(r);
}

void uccl__conn_rx_abort(struct uccl__conn *c, struct uccl__req *r)
{
    (void)c;
    atomic_fetch_sub(&r->busy, 1);
    uccl__req_put(r);
}

void uccl__conn_tx_done(struct uccl__conn *c, void *cookie, int status)
{
    struct uccl__req *r = cookie; /* a send completes on the receiver's FIN */
    if (status != UCCL_OK)
        uccl__conn_fail(c, status, "streaming data: %s", uccl_last_error());
    if (r) {
        atomic_fetch_sub(&r->busy, 1);
        uccl__req_put(r);
    }
}
