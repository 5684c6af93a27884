/* The per-connection protocol, identical for every transport: posting a
 * request, matching sends to receives, and each control message and what
 * it does (conn.h).  It stands on the connection and its requests
 * (conn.c), the copies (worker.c) and the stream data path
 * (proto_stream.c); the connection's reader (progress.c) hands it each
 * message, and proto_eager.c each eager message once its bytes are in.
 *
 * Two-sided (connector sends, acceptor receives; k-th send matches k-th recv):
 *   sender -> RTS{seq, len, addr}  (eager, len <= 64 KiB: the bytes come with
 *                                   it, behind it on a socket or in a slot)
 *   receiver, once a recv is posted and the RTS is in (a capacity recv takes
 *   a shorter message: its len becomes the message's):
 *     sizes differ      -> NACK{seq, len = posted size}; both sides fail
 *     eager             -> copy, FIN
 *     direct transport  -> pull len bytes from addr into the recv buffer, FIN
 *     stream transport  -> CTS{seq, STREAM}; the sender streams the bytes; every
 *                          chunk is checked against the posted buffer on arrival;
 *                          FIN (so too on a direct transport where the recv
 *                          buffer is out of the peer's reach: tp->staged)
 *     direct, source in host memory, destination on a GPU (CUDA IPC maps
 *     device memory only) -> CTS{seq, addr, key}: the sender pushes into the
 *                          recv buffer, completes, PDONE; the receiver
 *                          completes on PDONE
 *   The sender completes on FIN (or fails on NACK).
 * One-sided (connector initiates against a window the acceptor advertised):
 *   WREQ/RREQ{op, window, token, offset, len, addr}; the target checks the
 *   window (its connection, token, range) and holds its region from dereg():
 *     direct write  -> the target pulls into its window, OPDONE{status}
 *     direct read   -> GO{addr}: the initiator pulls into its buffer, RDONE
 *     streamed write-> GO; the initiator streams; the target OPDONEs at the end
 *     streamed read -> the target streams; the initiator completes on the bytes
 *     (direct, a window out of the peer's reach: streamed, GO{STREAM} for a write)
 *     direct, host memory to GPU memory: the side with the host memory copies
 *       write -> GO{addr, key}: the initiator pushes into the window, RDONE
 *       read  -> the target pushes into the initiator's buffer, OPDONE
 *   A refusal is OPDONE{error}.
 * A process only ever writes into its own host memory, and only from its
 * own threads, which count themselves in the request's `busy`: after a
 * transfer failed or timed out and its waiter returned, nothing lands in
 * its buffer.  (GPU memory that a peer pushes into is the exception: its
 * copy may still land after the connection failed.)
 * Every party finishes its own request before it answers the peer, since
 * the peer may close at once and its BYE must not find that request pending.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn/conn.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/status.h"

static uint64_t key_of(int kind, uint64_t id) { return uccl__proto_key(kind, id); }

/* Direct transports: does the destination side make the copy?  Not where
 * the source is host memory and the destination GPU memory. */
static int peer_on_gpu(const struct uccl__conn *c, uint64_t peer_key)
{
    return c->link.tp->key_on_gpu && c->link.tp->key_on_gpu(peer_key);
}
static int dst_copies(const struct uccl__conn *c, int dst_on_gpu, uint64_t src_peer_key)
{
    return (!dst_on_gpu && !c->link.tp->source_writes) || peer_on_gpu(c, src_peer_key);
}

/* ------------------------------------------------------------------------- */
/* matching on the receiver                                                   */

static void try_match(struct uccl__conn *c)
{
    for (;;) {
        pthread_mutex_lock(&c->mu);
        struct uccl__req *r = TAILQ_FIRST(&c->posted);
        struct uccl__rts *rts = STAILQ_FIRST(&c->rtsq);
        if (!r || !rts || atomic_load(&c->link.failed)) {
            pthread_mutex_unlock(&c->mu);
            return;
        }
        TAILQ_REMOVE(&c->posted, r, link);
        r->posted = 0;
        STAILQ_REMOVE_HEAD(&c->rtsq, link);
        c->rtsq_len--;
        int stream = 0, push = 0;
        if (r->capacity && rts->len < r->len)
            r->len = rts->len;
        if (rts->seq != r->seq) {
            pthread_mutex_unlock(&c->mu);
            uccl__conn_fail(c, UCCL_ERR_PROTO, "message %llu arrived where %llu was expected",
                            (unsigned long long)rts->seq, (unsigned long long)r->seq);
            free(rts);
            return;
        }
        if (rts->len == r->len && r->len > 0 && !rts->eager &&
            uccl__proto_streams(c, r->local_key)) { /* CTS{STREAM} */
            uccl__idmap_put(&c->rx, key_of(UCCL_DATA_SEND, r->seq), r);
            stream = 1;
        } else if (rts->len == r->len && r->len > 0 && !rts->eager &&
                   !dst_copies(c, UCCL_MK_ON_GPU(r->mkind), rts->key)) {
            uccl__idmap_put(&c->inflight, key_of(UCCL_KEY_RECV, r->seq), r); /* until PDONE */
            push = 1;
        }
        r->remote_addr = rts->addr;
        r->remote_key = rts->key;
        uint64_t slen = rts->len;
        int eager = rts->eager;
        char *held = rts->data;
        int slot = rts->slot;
        c->eager_held -= held ? rts->len : 0;
        if ((held || slot >= 0) && slen == r->len)
            atomic_fetch_add(&r->busy, 1);
        free(rts);
        pthread_mutex_unlock(&c->mu);

        if (eager && slen == r->len) { /* the bytes are here (in held, or already in r->buf) */
            int rc = UCCL_OK;
            if (held || slot >= 0) {
                char *from = held ? held : c->link.tp->eager_slot(&c->link, (unsigned)slot);
                rc = uccl__gpu_copy_kinds(r->buf, r->mkind, from, UCCL_MK(UCCL_MK_HOST, 0),
                                          r->len, c->link.local->timeout_ns);
                atomic_fetch_sub(&r->busy, 1);
            }
            free(held);
            if (rc)
                uccl__conn_fail(c, rc, "copying message %llu into its buffer: %s",
                                (unsigned long long)r->seq, uccl_last_error());
            else
                uccl__req_answer(c, r, UCCL_MSG_FIN, r->len, UCCL_OK, NULL);
            continue;
        }
        free(held);
        if (slen != r->len) {
            char why[300];
            snprintf(why, sizeof(why),
                     "size mismatch on connection %llu, message %llu: the sender sent %llu "
                     "bytes but this recv posted %zu bytes; nothing was written",
                     (unsigned long long)c->id, (unsigned long long)r->seq,
                     (unsigned long long)slen, r->len);
            uccl__req_answer(c, r, UCCL_MSG_NACK, r->len, UCCL_ERR_MISMATCH, why);
        } else if (r->len == 0) {
            uccl__req_answer(c, r, UCCL_MSG_FIN, 0, UCCL_OK, NULL);
        } else if (stream) {
            uccl__conn_send_simple(c, UCCL_MSG_CTS, r->seq, r->len, UCCL_MSG_FLAG_STREAM);
        } else if (push) {
            struct uccl__msg cts = {.type = UCCL_MSG_CTS, .seq = r->seq, .len = r->len,
                                    .addr = (uint64_t)(uintptr_t)r->buf, .token = r->key_for_peer};
            uccl__conn_send_msg(c, &cts);
        } else {
            uccl__conn_push_job(c, UCCL_JOB_PULL_RECV, r, NULL, NULL, NULL);
        }
    }
}

/* Under c->mu: may the peer open one more request (an announced message,
 * a read or write for this side to serve)?  Else the error that fails the
 * connection, with the numbers. */
static int peer_room(struct uccl__conn *c)
{
    unsigned served = atomic_load(&c->served);
    if (c->rtsq_len + served < UCCL_PEER_REQS_MAX)
        return UCCL_OK;
    return uccl__err(UCCL_ERR_PROTO, "the peer has %u requests open (%u announced messages no "
                     "recv has matched, %u reads and writes being served), the most allowed "
                     "(UCCL_PEER_REQS_MAX = %d; an honest peer keeps at most %d announced)",
                     c->rtsq_len + served, c->rtsq_len, served, UCCL_PEER_REQS_MAX,
                     UCCL_REQ_WINDOW);
}

/* An announced message joins the queue; match it if its recv is posted. */
int uccl__proto_queue_rts(struct uccl__conn *c, struct uccl__rts *rts)
{
    pthread_mutex_lock(&c->mu);
    int rc = peer_room(c);
    if (rc == UCCL_OK) {
        STAILQ_INSERT_TAIL(&c->rtsq, rts, link);
        c->rtsq_len++;
    } else if (rts->data) {
        c->eager_held -= rts->len;
    }
    pthread_mutex_unlock(&c->mu);
    if (rc) {
        free(rts->data);
        free(rts);
        return rc;
    }
    try_match(c);
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* posting (user threads)                                                     */

int uccl__conn_post(struct uccl__conn *c, struct uccl__req *r, int blocking)
{
    if (atomic_load(&c->link.failed))
        return uccl__err(c->fail_status == UCCL_ERR_CLOSED ? UCCL_ERR_CLOSED : UCCL_ERR_IO,
                         "%s", c->fail_msg);
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->link.failed)) { /* again under mu: conn_fail collects pending under it */
        pthread_mutex_unlock(&c->mu);
        return uccl__err(c->fail_status == UCCL_ERR_CLOSED ? UCCL_ERR_CLOSED : UCCL_ERR_IO,
                         "%s", c->fail_msg);
    }
    int rc = uccl__idmap_put(&c->pending, uccl__pending_key(r), r);
    if (rc) {
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    uccl__req_get(r); /* the pending table's reference */
    pthread_cond_signal(&c->svc_cv); /* answers are coming: the service thread must listen */
    switch (r->op) {
    case UCCL_OP_RECV:
        r->seq = ++c->next_recv_seq;
        TAILQ_INSERT_TAIL(&c->posted, r, link);
        r->posted = 1;
        pthread_mutex_unlock(&c->mu);
        if (blocking) /* a matching RTS may be in: pull on this thread */
            uccl__conn_with_inline_copies(c, try_match);
        else
            try_match(c);
        return UCCL_OK;
    case UCCL_OP_SEND:
    case UCCL_OP_WRITE:
    case UCCL_OP_READ:
        pthread_mutex_unlock(&c->mu);
        uccl__conn_announce(c, r); /* a failure reaches the request through conn_fail */
        return UCCL_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return uccl__err(UCCL_ERR_INVALID, "unknown operation %d", r->op);
}

/* ------------------------------------------------------------------------- */
/* control messages (handled by the connection's reader)                    */

static struct uccl__req *inflight_get(struct uccl__conn *c, int k, uint64_t id, int del)
{
    pthread_mutex_lock(&c->mu);
    struct uccl__req *r = del ? uccl__idmap_del(&c->inflight, key_of(k, id))
                              : uccl__idmap_get(&c->inflight, key_of(k, id));
    if (r)
        uccl__req_get(r);
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* A target-side request: holds the region from dereg() while it runs. */
static struct uccl__req *target_req(struct uccl__conn *c, int op, char *local,
                                    const struct uccl__msg *m, struct uccl__mr *hold)
{
    struct uccl__req *t = uccl__req_new(op, c, local, m->len);
    if (t) {
        t->seq = m->seq;
        t->hold = hold;
        t->local_key = hold ? hold->tp_key[c->link.tp->id] : 0;
        t->mkind = hold ? hold->gpu.mkind : 0;
    }
    return t;
}

/* Serve the peer's read or write: returns 1 where a job or a request of
 * ours now stands for it (and carries its count in c->served), 0 where it
 * is over already (refused, or nothing to move). */
static int serve_window_request(struct uccl__conn *c, const struct uccl__msg *m)
{
    int st = UCCL_OK;
    struct uccl__window *w = uccl__mem_window_check(&c->link.local->mem, c->id, m->window,
                                                    m->token, m->offset, m->len, &st);
    if (!w) {
        LOG_WARN("connection %llu: refused %s of %llu bytes at offset %llu of window %llu: %s",
                 (unsigned long long)c->id, m->type == UCCL_MSG_WREQ ? "write" : "read",
                 (unsigned long long)m->len, (unsigned long long)m->offset,
                 (unsigned long long)m->window, uccl_last_error());
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, m->seq, 0, (uint64_t)(int64_t)st);
        return 0;
    }
    char *local = (char *)w->addr + m->offset;
    struct uccl__mr *hold = w->mr;
    free(w);
    if (m->len == 0) {
        uccl__mem_release_hold(&c->link.local->mem, hold);
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, m->seq, 0, UCCL_OK);
        return 0;
    }
    int local_gpu = hold && UCCL_MK_ON_GPU(hold->gpu.mkind);
    int write = m->type == UCCL_MSG_WREQ;
    /* memory the peer cannot reach (or no direct transport): the bytes stream */
    int streamed = uccl__proto_streams(c, hold ? hold->tp_key[c->link.tp->id] : 0);
    if (c->link.direct && !streamed && write && dst_copies(c, local_gpu, m->aux)) { /* we pull */
        uccl__conn_push_job(c, UCCL_JOB_PULL_WRITE, NULL, m, local, hold);
        return 1;
    }
    if (c->link.direct && !streamed && !write && !local_gpu && peer_on_gpu(c, m->aux)) {
        /* host window, GPU reader: we push into its buffer, then OPDONE */
        uccl__conn_push_job(c, UCCL_JOB_PUSH_READ, NULL, m, local, hold);
        return 1;
    }
    uint64_t key_for_peer = 0;
    if (c->link.direct && !streamed && c->link.tp->mem_key && hold) /* the hold keeps the region */
        st = c->link.tp->mem_key(&c->link, hold, (uintptr_t)local, &key_for_peer);
    struct uccl__req *t = st ? NULL : target_req(c, write ? UCCL_OP_WRITE_TARGET
                                                          : UCCL_OP_READ_TARGET, local, m, hold);
    if (!t) {
        if (st)
            LOG_WARN("connection %llu: refused a %s of window %llu: %s", (unsigned long long)c->id,
                     write ? "write" : "read", (unsigned long long)m->window, uccl_last_error());
        uccl__mem_release_hold(&c->link.local->mem, hold);
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, m->seq, 0,
                               (uint64_t)(int64_t)(st ? st : UCCL_ERR_NOMEM));
        return 0;
    }
    t->served = 1;
    if (!write && streamed) { /* stream it; the job keeps t (and the hold) */
        uccl__proto_stream_out(c, UCCL_DATA_READ, m->seq, local, t->local_key, m->len, t);
        uccl__req_put(t);
        return 1;
    }
    /* Streamed write (bytes land in t), or the initiator copies from or into
     * our window (direct read, or a push into our GPU window) and says
     * RDONE: t waits in pending, failed with the connection. */
    struct uccl__idmap *by_seq = write && streamed ? &c->rx : &c->inflight;
    uint64_t seq_key = key_of(write && streamed ? UCCL_DATA_WRITE : UCCL_KEY_LENT, t->seq);
    pthread_mutex_lock(&c->mu);
    /* A seq still in use (the peer chose it) would orphan its request,
     * holding the region until the connection ends: refused, loudly. */
    int dup = uccl__idmap_get(by_seq, seq_key) != NULL;
    /* Not after conn_fail collected `pending`: t would never be failed. */
    int ok = !dup && !atomic_load(&c->link.failed) &&
             uccl__idmap_put(&c->pending, uccl__pending_key(t), t) == UCCL_OK; /* takes the creation ref */
    if (ok && uccl__idmap_put(by_seq, seq_key, t) != UCCL_OK) {
        uccl__idmap_del(&c->pending, uccl__pending_key(t));
        ok = 0;
    }
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        uccl__req_put(t); /* releases the hold */
        if (dup)
            uccl__conn_fail(c, UCCL_ERR_PROTO, "the peer asked for a %s with sequence number "
                            "%llu, which a request of its still in flight has",
                            write ? "write" : "read", (unsigned long long)m->seq);
        return 1;
    }
    struct uccl__msg go = {.type = UCCL_MSG_GO, .seq = m->seq, .len = m->len,
                           .addr = c->link.direct && !streamed ? (uint64_t)(uintptr_t)local : 0,
                           .token = key_for_peer, .aux = streamed ? UCCL_MSG_FLAG_STREAM : 0};
    uccl__conn_send_msg(c, &go);
    return 1;
}

/* The peer's read or write counts in c->served until it is over here. */
static int on_window_request(struct uccl__conn *c, const struct uccl__msg *m)
{
    pthread_mutex_lock(&c->mu);
    int rc = peer_room(c);
    if (rc == UCCL_OK)
        atomic_fetch_add(&c->served, 1);
    pthread_mutex_unlock(&c->mu);
    if (rc == UCCL_OK && !serve_window_request(c, m))
        atomic_fetch_sub(&c->served, 1);
    return rc;
}

int uccl__proto_handle(struct uccl__conn *c, const struct uccl__msg *m)
{
    struct uccl__req *r;
    /* Each type is legal in one direction only: the connector sends RTS,
     * WREQ, RREQ; the acceptor answers. */
    int from_connector = m->type == UCCL_MSG_RTS || m->type == UCCL_MSG_WREQ ||
                         m->type == UCCL_MSG_RREQ || m->type == UCCL_MSG_RDONE ||
                         m->type == UCCL_MSG_PDONE;
    if ((m->type <= UCCL_MSG_OPDONE || m->type == UCCL_MSG_RDONE || m->type == UCCL_MSG_PDONE) &&
        from_connector == c->link.is_connector)
        return uccl__err(UCCL_ERR_PROTO, "control message type %u sent the wrong way", m->type);

    switch (m->type) {
    case UCCL_MSG_RTS: {
        int slot = -1;
        if (m->aux & UCCL_MSG_FLAG_SLOT) {
            if (!c->link.tp->eager_slot || m->offset >= UCCL_EAGER_INFLIGHT ||
                m->len > UCCL_EAGER_MAX)
                return uccl__err(UCCL_ERR_PROTO, "eager slot %llu / %llu bytes out of range",
                                 (unsigned long long)m->offset, (unsigned long long)m->len);
            slot = (int)m->offset;
        }
        struct uccl__rts *rts = calloc(1, sizeof(*rts));
        if (!rts)
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        *rts = (struct uccl__rts){.seq = m->seq, .len = m->len, .addr = m->addr,
                                  .key = m->window, .eager = slot >= 0, .slot = slot};
        return uccl__proto_queue_rts(c, rts);
    }
    case UCCL_MSG_CTS:
        r = inflight_get(c, UCCL_KEY_SEND, m->seq, 0); /* stays until FIN */
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "CTS for unknown message %llu",
                             (unsigned long long)m->seq);
        if (m->len != r->len || r->eager || (c->link.direct && !c->link.tp->staged &&
                                             (m->aux & UCCL_MSG_FLAG_STREAM))) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "CTS for %llu bytes, message %llu has %zu%s",
                             (unsigned long long)m->len, (unsigned long long)m->seq, r->len,
                             r->eager ? " and went eagerly" : m->len == r->len
                             ? " (a stream this transport cannot carry)" : "");
        }
        if (c->link.direct && !(m->aux & UCCL_MSG_FLAG_STREAM)) { /* we push into its buffer */
            r->remote_addr = m->addr;
            r->remote_key = m->token;
            uccl__conn_push_job(c, UCCL_JOB_PUSH_SEND, r, NULL, NULL, NULL);
        } else {
            uccl__proto_stream_out(c, UCCL_DATA_SEND, r->seq, r->buf, r->local_key, r->len, r);
        }
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_NACK:
    case UCCL_MSG_FIN:
        r = inflight_get(c, UCCL_KEY_SEND, m->seq, 1);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "%s for unknown message %llu",
                             m->type == UCCL_MSG_FIN ? "FIN" : "NACK", (unsigned long long)m->seq);
        if (r->eager) {
            pthread_mutex_lock(&c->mu);
            c->eager_inflight--;
            if (r->eager_slot >= 0)
                c->eager_slots_busy &= ~(1u << r->eager_slot);
            pthread_mutex_unlock(&c->mu);
        }
        if (m->type == UCCL_MSG_FIN)
            uccl__req_complete(c, r, UCCL_OK, NULL);
        else
            uccl__req_complete(c, r, UCCL_ERR_MISMATCH,
                     "size mismatch on connection %llu, message %llu: this send has %zu bytes "
                     "but the receiver posted %llu bytes; nothing was sent",
                     (unsigned long long)c->id, (unsigned long long)m->seq, r->len,
                     (unsigned long long)m->len);
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_WREQ:
    case UCCL_MSG_RREQ:
        return on_window_request(c, m);
    case UCCL_MSG_BYE:
        __atomic_store_n(&c->peer_bye, 1, __ATOMIC_RELAXED); /* read by a closing thread */
        uccl__conn_fail(c, UCCL_ERR_IO, "the peer closed its endpoint");
        return UCCL_OK;
    case UCCL_MSG_GO:
        r = inflight_get(c, UCCL_KEY_OP, m->seq, 0);
        int streamed = !c->link.direct || (m->aux & UCCL_MSG_FLAG_STREAM); /* a write only */
        if (!r || m->len != r->len || (r->op == UCCL_OP_READ && streamed) ||
            (r->op != UCCL_OP_WRITE && r->op != UCCL_OP_READ) ||
            (streamed && !c->link.tp->stream) || (c->link.direct && streamed && !c->link.tp->staged)) {
            if (r)
                uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "GO for unknown operation %llu",
                             (unsigned long long)m->seq);
        }
        pthread_mutex_lock(&c->mu);
        int again = r->go_seen;
        r->go_seen = 1;
        /* a direct read: the target chose the NIC, so no streamed chunk may
         * come for it now (and none may have come before) */
        int mixed = r->op == UCCL_OP_READ &&
                    (atomic_load(&r->got) > 0 || atomic_load(&r->busy) > 0);
        if (r->op == UCCL_OP_READ && !again && !mixed)
            uccl__idmap_del(&c->rx, key_of(UCCL_DATA_READ, r->seq));
        pthread_mutex_unlock(&c->mu);
        if (again || mixed) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, again ? "second GO for operation %llu"
                             : "GO for read %llu after its bytes began to stream",
                             (unsigned long long)m->seq);
        }
        if (r->op == UCCL_OP_WRITE && streamed) {
            uccl__proto_stream_out(c, UCCL_DATA_WRITE, r->seq, r->buf, r->local_key, r->len, r);
        } else { /* direct: we pull into our own buffer (tracked as busy), or push */
            r->remote_addr = m->addr;
            r->remote_key = m->token;
            uccl__conn_push_job(c, r->op == UCCL_OP_READ ? UCCL_JOB_PULL_READ
                                                         : UCCL_JOB_PUSH_WRITE, r, NULL, NULL, NULL);
        }
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_RDONE:
        r = inflight_get(c, UCCL_KEY_LENT, m->seq, 1);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "RDONE for unknown operation %llu",
                             (unsigned long long)m->seq);
        uccl__req_complete(c, r, UCCL_OK, NULL);
        uccl__req_put(r);
        return UCCL_OK;
    case UCCL_MSG_PDONE: {
        r = inflight_get(c, UCCL_KEY_RECV, m->seq, 1);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "PDONE for message %llu, which was not pushed",
                             (unsigned long long)m->seq);
        int st = (int)(int64_t)m->aux;
        if (st == UCCL_OK)
            uccl__req_complete(c, r, UCCL_OK, NULL);
        else
            uccl__req_complete(c, r, UCCL_ERR_IO, "the sender could not copy message %llu into "
                               "this GPU buffer on connection %llu: %s",
                               (unsigned long long)m->seq, (unsigned long long)c->id,
                               uccl_status_str(st));
        uccl__req_put(r);
        return UCCL_OK;
    }
    case UCCL_MSG_OPDONE: {
        r = inflight_get(c, UCCL_KEY_OP, m->seq, 0);
        if (!r)
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for unknown operation %llu",
                             (unsigned long long)m->seq);
        int st = (int)(int64_t)m->aux;
        if (st == UCCL_OK && r->op == UCCL_OP_READ && r->len > 0 &&
            !(c->link.direct && UCCL_MK_ON_GPU(r->mkind) && !r->go_seen)) {
            /* A read of bytes ends when they are here (streamed) or pulled
             * (direct), never on the target's word, except where the target
             * pushed them into our GPU memory (it had host memory). */
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for read %llu, which needs no OPDONE",
                             (unsigned long long)m->seq);
        }
        if (st == UCCL_OK && r->op == UCCL_OP_WRITE && r->len > 0 && !c->link.direct &&
            !r->go_seen) {
            uccl__req_put(r);
            return uccl__err(UCCL_ERR_PROTO, "OPDONE for write %llu before its GO",
                             (unsigned long long)m->seq);
        }
        if (st == UCCL_OK)
            uccl__req_complete(c, r, UCCL_OK, NULL);
        else
            /* Refused by the target (unknown window, wrong token, out of
             * range): a transfer failure here, whatever the target's reason. */
            uccl__req_complete(c, r, st == UCCL_ERR_ACCESS || st == UCCL_ERR_NOTFOUND ? UCCL_ERR_ACCESS
                                                                            : UCCL_ERR_IO,
                     "the peer refused the %s of %zu bytes on connection %llu: %s",
                     r->op == UCCL_OP_WRITE ? "write" : "read", r->len,
                     (unsigned long long)c->id, uccl_status_str(st));
        uccl__req_put(r);
        return UCCL_OK;
    }
    default:
        if (c->link.tp->on_msg)
            return c->link.tp->on_msg(&c->link, m);
        return uccl__err(UCCL_ERR_PROTO, "control message type %u not used by transport %s",
                         m->type, c->link.tp->name);
    }
}
