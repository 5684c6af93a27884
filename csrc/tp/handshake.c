/* The connection handshake (handshake.h), on a connection's link: the
 * HELLO filled from its link and this side, the peer's ACK checked. */
#define _GNU_SOURCE
#include "tp/handshake.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "net/sock.h"
#include "base/status.h"
#include "tp/link.h"
#include "tp/transport.h"

static void fill_hello(struct uccl__link *lk, int type, struct uccl__hello *h)
{
    const struct uccl__local *loc = lk->local;
    memset(h, 0, sizeof(*h));
    h->type = (uint16_t)type;
    h->secret_len = lk->secret_len;
    memcpy(h->secret, lk->secret, lk->secret_len);
    snprintf(h->host_id, sizeof(h->host_id), "%s", loc->host_id);
    h->pid = (uint32_t)getpid();
    h->gpu_idx = loc->gpu_idx;
    h->rank = loc->rank;
    h->transport = (uint32_t)loc->forced_tp;
    h->num_streams = lk->num_streams;
    h->conn_token = lk->token;
    h->probe_addr = (uint64_t)(uintptr_t)&loc->probe_word;
    h->probe_cookie = loc->probe_word;
    h->listen_port = (uint32_t)loc->port;
    h->chunk_bytes = lk->chunk_bytes;
    /* Left to choose, the acceptor picks RDMA for another host only if we
     * can take it too. */
    const struct uccl__tp_ops *rdma = uccl__tp_registry[UCCL_TP_RDMA];
    if (type == UCCL_HELLO_CONN && loc->forced_tp == UCCL_TP_AUTO && rdma &&
        rdma->available() == UCCL_OK)
        h->caps |= UCCL_CAP_RDMA;
}

/* The peer's ACK in buf (its first `have` bytes already read). */
static int read_ack(struct uccl__link *lk, int fd, uint8_t buf[UCCL_HELLO_SIZE], size_t have,
                    uint64_t deadline, struct uccl__hello *ack)
{
    int rc = uccl__sock_recv_all(fd, buf + have, UCCL_HELLO_SIZE - have, deadline, 0);
    if (rc)
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    rc = uccl__hello_decode(buf, ack);
    if (rc)
        return rc;
    if (ack->type != UCCL_HELLO_ACK)
        return uccl__err(UCCL_ERR_PROTO, "handshake with %s:%d: expected an ACK", lk->peer_ip,
                         lk->peer_port);
    if (ack->status == UCCL_ERR_AUTH)
        return uccl__err(UCCL_ERR_AUTH, "%s:%d refused the connection: wrong or missing secret "
                         "(UCCL_P2P_SECRET)", lk->peer_ip, lk->peer_port);
    if (ack->status != UCCL_OK)
        return uccl__err(ack->status == UCCL_ERR_UNAVAIL ? UCCL_ERR_UNAVAIL : UCCL_ERR_IO,
                         "%s:%d refused the connection: %s (see its log)", lk->peer_ip,
                         lk->peer_port, uccl_status_str(ack->status));
    return UCCL_OK;
}

int uccl__handshake(struct uccl__link *lk, int fd, int type, unsigned index, uint64_t deadline,
                    struct uccl__hello *ack)
{
    struct uccl__hello h;
    uint8_t buf[UCCL_HELLO_SIZE];
    fill_hello(lk, type, &h);
    h.stream_index = index;
    uccl__hello_encode(&h, buf);
    int rc = uccl__sock_send_all(fd, buf, sizeof(buf), deadline);
    if (rc)
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    return read_ack(lk, fd, buf, 0, deadline, ack);
}

int uccl__open_setup_stream(struct uccl__link *lk, uint64_t deadline, const void *out,
                            size_t out_len, void *in, size_t in_len, int *fd_p)
{
    int fd;
    struct uccl__hello h, ack;
    uint8_t buf[UCCL_HELLO_SIZE];
    int rc = uccl__sock_connect(lk->peer_ip, lk->peer_port, deadline, &fd);
    if (rc)
        return rc;
    fill_hello(lk, UCCL_HELLO_STREAM, &h);
    uccl__hello_encode(&h, buf);
    rc = uccl__sock_send_all(fd, buf, sizeof(buf), deadline);
    if (rc == UCCL_OK)
        rc = uccl__sock_send_all(fd, out, out_len, deadline);
    /* A refusal is a bare ACK; the reply starts with anything but its magic. */
    if (rc == UCCL_OK)
        rc = uccl__sock_recv_all(fd, in, 4 <= in_len ? 4 : in_len, deadline, 0);
    uint32_t magic = 0;
    memcpy(&magic, in, 4);
    if (rc == UCCL_OK && in_len >= 4 && magic == UCCL_WIRE_MAGIC) {
        memcpy(buf, in, 4);
        rc = read_ack(lk, fd, buf, 4, deadline, &ack);
        if (rc == UCCL_OK)
            rc = uccl__err(UCCL_ERR_PROTO, "%s:%d accepted a setup stream without a reply",
                           lk->peer_ip, lk->peer_port);
    } else if (rc == UCCL_OK) {
        rc = uccl__sock_recv_all(fd, (char *)in + 4, in_len - 4, deadline, 0);
        if (rc == UCCL_OK)
            rc = read_ack(lk, fd, buf, 0, deadline, &ack);
    }
    if (rc) {
        close(fd);
        return rc == UCCL_ERR_PROTO || rc == UCCL_ERR_AUTH || rc == UCCL_ERR_UNAVAIL
                   ? rc : uccl__err(rc, "setup stream to %s:%d: %s", lk->peer_ip, lk->peer_port,
                                    uccl_last_error());
    }
    *fd_p = fd;
    return UCCL_OK;
}

int uccl__open_stream(struct uccl__link *lk, unsigned index, uint64_t deadline_ns, int *fd_p)
{
    int fd;
    struct uccl__hello ack;
    int rc = uccl__sock_connect(lk->peer_ip, lk->peer_port, deadline_ns, &fd);
    if (rc)
        return rc;
    rc = uccl__handshake(lk, fd, UCCL_HELLO_STREAM, index, deadline_ns, &ack);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_p = fd;
    return UCCL_OK;
}

void uccl__send_ack(int fd, const struct uccl__local *loc, int status, struct uccl__hello *ack)
{
    struct uccl__hello a;
    if (!ack) {
        memset(&a, 0, sizeof(a));
        a.num_streams = 1;
        a.chunk_bytes = 4096;
        ack = &a;
    }
    ack->type = UCCL_HELLO_ACK;
    ack->status = status;
    ack->pid = (uint32_t)getpid();
    ack->gpu_idx = loc->gpu_idx;
    ack->rank = loc->rank;
    ack->listen_port = (uint32_t)loc->port;
    ack->probe_addr = (uint64_t)(uintptr_t)&loc->probe_word;
    ack->probe_cookie = loc->probe_word;
    snprintf(ack->host_id, sizeof(ack->host_id), "%s", loc->host_id);
    uint8_t buf[UCCL_HELLO_SIZE];
    uccl__hello_encode(ack, buf);
    uccl__sock_send_all(fd, buf, sizeof(buf), uccl__now_ns() + UCCL_HANDSHAKE_NS);
}

int uccl__secret_ok(const struct uccl__local *loc, const struct uccl__hello *h)
{
    if (loc->secret_len == 0)
        return 1;
    /* Constant time over the whole field: no early exit on the first difference. */
    unsigned diff = h->secret_len ^ loc->secret_len;
    for (unsigned i = 0; i < UCCL_SECRET_MAX; i++)
        diff |= (unsigned)(h->secret[i] ^ loc->secret[i]);
    return diff == 0;
}
