/* TCP transport: the control socket plus num_streams data sockets per
 * connection.  Outgoing bytes are cut into chunks (chunk_bytes) that the
 * streams' sender threads take from one queue, so a large message is striped
 * over every stream and a small one goes out on whichever stream is free.
 * Each chunk carries (kind, id, offset, len); the receiving thread asks
 * the protocol where it may land and receives straight into that buffer.
 *
 * GPU memory is staged, the role GPUDirect-TCPX plays upstream: each
 * stream's threads own a page-locked buffer of one chunk; the sender copies
 * a chunk device-to-host into it, then sends it, and the receiver receives
 * into it, then copies host-to-device.  The streams pipeline: while one
 * sends (or receives) chunk k, another copies chunk k+1. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "tp/transport.h"
#include "gpu/gpu.h"
#include "tp/handshake.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/status.h"

struct tcp_job {
    int kind;
    uint64_t id;
    const char *src;
    uint64_t src_key;         /* its memory kind (gpu.h): GPU memory is staged */
    size_t len, next_off;
    atomic_size_t accounted;  /* bytes of dispatched chunks, sent or failed */
    atomic_int err;
    void *cookie;
    STAILQ_ENTRY(tcp_job) link;
};

struct tcp_stream {
    int fd;
    unsigned idx;
    int threads;
    pthread_t tx, rx;
    struct uccl__link *link;
};

/* A stream thread's page-locked chunk, made on its first GPU chunk. */
struct stage {
    char *buf;
    int dev;
};

static int stage_get(struct uccl__link *lk, struct stage *st, int dev, char **buf_p)
{
    if (!st->buf) {
        int rc = uccl__gpu_host_alloc(dev, lk->chunk_bytes, (void **)&st->buf);
        if (rc)
            return rc;
        st->dev = dev;
    }
    *buf_p = st->buf;
    return UCCL_OK;
}

static void stage_free(struct stage *st)
{
    if (st->buf)
        uccl__gpu_host_free(st->dev, st->buf);
    st->buf = NULL;
}

struct tcp_conn {
    struct tcp_stream s[UCCL_MAX_STREAMS];
    unsigned n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    STAILQ_HEAD(, tcp_job) jobs; /* not yet fully handed out to the streams */
    int stop;
    int destroyed;
};

static int tcp_available(void) { return UCCL_OK; }

static struct tcp_conn *tcp_new(struct uccl__link *lk)
{
    struct tcp_conn *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->n = lk->num_streams;
    for (unsigned i = 0; i < UCCL_MAX_STREAMS; i++) {
        t->s[i].fd = -1;
        t->s[i].idx = i;
        t->s[i].link = lk;
    }
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    STAILQ_INIT(&t->jobs);
    lk->tp_priv = t;
    lk->direct = 0;
    return t;
}

static int tcp_conn_accept(struct uccl__link *lk, const struct uccl__hello *peer,
                           struct uccl__hello *ack)
{
    (void)peer;
    (void)ack;
    return tcp_new(lk) ? UCCL_OK : uccl__err(UCCL_ERR_NOMEM, "out of memory");
}

static unsigned tcp_streams_needed(const struct uccl__link *lk) { return lk->num_streams; }

static int tcp_add_stream(struct uccl__link *lk, int fd, unsigned index)
{
    struct tcp_conn *t = lk->tp_priv;
    if (index >= t->n || t->s[index].fd >= 0)
        return uccl__err(UCCL_ERR_PROTO, "stream index %u duplicated or out of range (%u streams)",
                         index, t->n);
    uccl__sock_set_nonblock(fd, 0); /* data threads block; shutdown() wakes them */
    t->s[index].fd = fd;
    return UCCL_OK;
}

static int tcp_conn_connected(struct uccl__link *lk, const struct uccl__hello *ack,
                              uint64_t deadline)
{
    (void)ack;
    struct tcp_conn *t = tcp_new(lk);
    if (!t)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    for (unsigned i = 0; i < t->n; i++) {
        int fd;
        int rc = uccl__open_stream(lk, i, deadline, &fd);
        if (rc)
            return rc;
        uccl__sock_set_nonblock(fd, 0);
        t->s[i].fd = fd;
    }
    return UCCL_OK;
}

/* Account a dispatched chunk; the thread that accounts the last byte ends the job.
 * The job's length is read before this thread's bytes are added: once they
 * are, another data thread may account the last byte and free the job. */
static void account(struct uccl__link *lk, struct tcp_job *j, size_t n, int failed)
{
    size_t len = j->len;
    if (failed)
        atomic_store(&j->err, 1);
    if (atomic_fetch_add(&j->accounted, n) + n == len) {
        uccl__conn_tx_done(lk->conn, j->cookie, atomic_load(&j->err) ? UCCL_ERR_IO : UCCL_OK);
        free(j);
    }
}

static int send_chunk(int fd, const uint8_t *hdr, const char *data, size_t len)
{
    struct iovec iov[2] = {{(void *)hdr, UCCL_CHUNK_HDR_SIZE}, {(void *)data, len}};
    int rc = uccl__sock_sendv(fd, iov, 2, 0, 1);
    return rc ? uccl__err(rc, "send on data stream: %s", uccl_last_error()) : UCCL_OK;
}

/* Stopped: what was never handed out fails now, so its request (and any
 * region it holds) is let go at once, not at endpoint close; chunks in
 * flight account for themselves. */
static void fail_queued(struct uccl__link *lk, struct tcp_conn *t)
{
    pthread_mutex_lock(&t->mu);
    STAILQ_HEAD(, tcp_job) left = STAILQ_HEAD_INITIALIZER(left);
    STAILQ_CONCAT(&left, &t->jobs);
    pthread_mutex_unlock(&t->mu);
    for (struct tcp_job *j; (j = STAILQ_FIRST(&left));) {
        STAILQ_REMOVE_HEAD(&left, link);
        account(lk, j, j->len - j->next_off, 1);
    }
}

static void *tx_main(void *arg)
{
    struct tcp_stream *s = arg;
    struct uccl__link *lk = s->link;
    struct tcp_conn *t = lk->tp_priv;
    struct stage st = {0};
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (STAILQ_EMPTY(&t->jobs) && !t->stop)
            pthread_cond_wait(&t->cv, &t->mu);
        if (t->stop) {
            pthread_mutex_unlock(&t->mu);
            break;
        }
        struct tcp_job *j = STAILQ_FIRST(&t->jobs);
        size_t off = j->next_off;
        size_t len = j->len - off < lk->chunk_bytes ? j->len - off : lk->chunk_bytes;
        j->next_off += len;
        if (j->next_off == j->len) /* fully handed out: leave the queue */
            STAILQ_REMOVE_HEAD(&t->jobs, link);
        pthread_mutex_unlock(&t->mu);

        struct uccl__chunk_hdr h = {.kind = (uint16_t)j->kind, .id = j->id, .offset = off, .len = len};
        uint8_t hdr[UCCL_CHUNK_HDR_SIZE];
        uccl__chunk_encode(&h, hdr);
        const char *from = j->src + off;
        int rc = UCCL_OK;
        if (UCCL_MK_ON_GPU(j->src_key)) { /* device to host first */
            char *buf;
            rc = stage_get(lk, &st, UCCL_MK_DEV(j->src_key), &buf);
            if (rc == UCCL_OK)
                rc = uccl__gpu_copy(UCCL_MK_DEV(j->src_key), buf, from, len, 0,
                                    lk->local->timeout_ns);
            from = buf;
        }
        if (rc == UCCL_OK)
            rc = send_chunk(s->fd, hdr, from, len);
        if (rc)
            uccl__conn_fail(lk->conn, UCCL_ERR_IO, "%s", uccl_last_error());
        account(lk, j, len, rc != UCCL_OK);
        if (rc)
            break;
    }
    fail_queued(lk, t);
    stage_free(&st);
    return NULL;
}

static int recv_full(int fd, void *buf, size_t len)
{
    int rc = uccl__sock_recv_all(fd, buf, len, 0, 1);
    return rc ? uccl__err(rc, "data stream: %s", uccl_last_error()) : UCCL_OK;
}

/* A data stream ended between chunks.  A closing peer says BYE on the
 * control socket, which may be read a moment after this EOF: give the
 * control path that moment so a clean close is not reported as a failure. */
static void stream_ended(struct uccl__link *lk)
{
    char why[256];
    snprintf(why, sizeof(why), "%s", uccl_last_error());
    for (int i = 0; i < 50 && !atomic_load(&lk->failed); i++)
        usleep(2000);
    uccl__conn_fail(lk->conn, UCCL_ERR_IO, "%s", why);
}

static void *rx_main(void *arg)
{
    struct tcp_stream *s = arg;
    struct uccl__link *lk = s->link;
    uint8_t hdr[UCCL_CHUNK_HDR_SIZE];
    struct stage st = {0};
    while (!atomic_load(&lk->failed)) {
        struct uccl__chunk_hdr h;
        char *dst, *into;
        uint64_t dst_key;
        struct uccl__req *r;
        int rc = recv_full(s->fd, hdr, sizeof(hdr));
        if (rc) {
            stream_ended(lk);
            break;
        }
        rc = uccl__chunk_decode(hdr, lk->chunk_bytes, &h);
        if (rc == UCCL_OK)
            rc = uccl__conn_rx_begin(lk->conn, h.kind, h.id, h.offset, h.len, &dst, &dst_key, &r);
        if (rc) {
            uccl__conn_fail(lk->conn, UCCL_ERR_PROTO, "%s", uccl_last_error());
            break;
        }
        into = dst;
        int on_gpu = UCCL_MK_ON_GPU(dst_key);
        if (on_gpu)
            rc = stage_get(lk, &st, UCCL_MK_DEV(dst_key), &into);
        if (rc == UCCL_OK)
            rc = recv_full(s->fd, into, h.len);
        if (rc == UCCL_OK && on_gpu) /* host to device */
            rc = uccl__gpu_copy(UCCL_MK_DEV(dst_key), dst, into, h.len, 0, lk->local->timeout_ns);
        if (rc) {
            uccl__conn_rx_abort(lk->conn, r);
            uccl__conn_fail(lk->conn, UCCL_ERR_IO, "%s", uccl_last_error());
            break;
        }
        uccl__conn_rx_end(lk->conn, r, h.len);
    }
    stage_free(&st);
    return NULL;
}

static int tcp_conn_start(struct uccl__link *lk)
{
    struct tcp_conn *t = lk->tp_priv;
    for (unsigned i = 0; i < t->n; i++) {
        struct tcp_stream *s = &t->s[i];
        if (s->fd < 0)
            return uccl__err(UCCL_ERR_PROTO, "data stream %u missing", i);
        if (pthread_create(&s->tx, NULL, tx_main, s))
            return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
        if (pthread_create(&s->rx, NULL, rx_main, s)) {
            pthread_mutex_lock(&t->mu);
            t->stop = 1;
            pthread_cond_broadcast(&t->cv);
            pthread_mutex_unlock(&t->mu);
            pthread_join(s->tx, NULL);
            return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
        }
        s->threads = 1;
    }
    return UCCL_OK;
}

static int tcp_stream(struct uccl__link *lk, int kind, uint64_t id, const void *src,
                      uint64_t src_key, size_t len, void *cookie)
{
    struct tcp_conn *t = lk->tp_priv;
    struct tcp_job *j = calloc(1, sizeof(*j));
    if (!j)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    j->kind = kind;
    j->id = id;
    j->src = src;
    j->src_key = src_key;
    j->len = len;
    j->cookie = cookie;
    pthread_mutex_lock(&t->mu);
    if (t->stop) {
        pthread_mutex_unlock(&t->mu);
        free(j);
        return uccl__err(UCCL_ERR_CLOSED, "connection is shutting down");
    }
    STAILQ_INSERT_TAIL(&t->jobs, j, link);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return UCCL_OK;
}

static void tcp_conn_shutdown(struct uccl__link *lk)
{
    struct tcp_conn *t = lk->tp_priv;
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    for (unsigned i = 0; i < t->n; i++)
        if (t->s[i].fd >= 0)
            shutdown(t->s[i].fd, SHUT_RDWR);
}

static void tcp_conn_destroy(struct uccl__link *lk)
{
    struct tcp_conn *t = lk->tp_priv;
    if (!t || t->destroyed)
        return;
    tcp_conn_shutdown(lk);
    for (unsigned i = 0; i < t->n; i++) {
        if (t->s[i].threads) {
            pthread_join(t->s[i].tx, NULL);
            pthread_join(t->s[i].rx, NULL);
            t->s[i].threads = 0;
        }
    }
    /* Jobs never fully handed out: no thread references them any more. */
    for (struct tcp_job *j; (j = STAILQ_FIRST(&t->jobs));) {
        STAILQ_REMOVE_HEAD(&t->jobs, link);
        uccl__conn_tx_done(lk->conn, j->cookie, UCCL_ERR_CLOSED);
        free(j);
    }
    for (unsigned i = 0; i < t->n; i++)
        if (t->s[i].fd >= 0) {
            close(t->s[i].fd);
            t->s[i].fd = -1;
        }
    t->destroyed = 1;
}

static void tcp_free(struct uccl__link *lk)
{
    struct tcp_conn *t = lk->tp_priv;
    tcp_conn_destroy(lk);
    if (t) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
        lk->tp_priv = NULL;
    }
}

const struct uccl__tp_ops uccl__tp_tcp = {
    .name = "tcp",
    .id = UCCL_TP_TCP,
    .available = tcp_available,
    .conn_accept = tcp_conn_accept,
    .conn_connected = tcp_conn_connected,
    .streams_needed = tcp_streams_needed,
    .add_stream = tcp_add_stream,
    .conn_start = tcp_conn_start,
    .stream = tcp_stream,
    .conn_shutdown = tcp_conn_shutdown,
    .conn_destroy = tcp_conn_destroy,
    .conn_free = tcp_free,
};
