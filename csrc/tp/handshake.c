/* The connection handshake (handshake.h): the connector's four steps on
 * a blocking socket, the acceptor's steps as the listener calls them, and
 * the proofs, the seal and the probe values both share. */
#define _GNU_SOURCE
#include "tp/handshake.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/ptracer.h"
#include "base/sha256.h"
#include "base/status.h"
#include "net/sock.h"
#include "net/sock_owner.h"
#include "tp/link.h"
#include "tp/transport.h"

#define REC UCCL_HELLO_SIZE
#define ACK_SEND_NS 2000000000ull /* an ACK or REFUSE fits the socket buffer: no real wait */

/* ---- what both sides compute -------------------------------------------- */

/* HMAC(key, label | recs[0] | .. | recs[n-1]), the last record's proof
 * field counted as zeros (it is where the result goes). */
static void proof(const uint8_t *key, size_t key_len, const char *label,
                  const uint8_t *const recs[], int n, uint8_t out[UCCL_MAC_BYTES])
{
    struct uccl__hmac m;
    static const uint8_t zeros[UCCL_MAC_BYTES];
    uccl__hmac_init(&m, key, key_len);
    uccl__hmac_update(&m, label, strlen(label));
    for (int i = 0; i < n - 1; i++)
        uccl__hmac_update(&m, recs[i], REC);
    uccl__hmac_update(&m, recs[n - 1], UCCL_HELLO_MAC_OFF);
    uccl__hmac_update(&m, zeros, sizeof(zeros));
    uccl__hmac_final(&m, out);
}

static void sign(const uint8_t *key, size_t key_len, const char *label,
                 const uint8_t *const recs[], int n, uint8_t *last)
{
    uint8_t mac[UCCL_MAC_BYTES];
    proof(key, key_len, label, recs, n, mac);
    memcpy(last + UCCL_HELLO_MAC_OFF, mac, sizeof(mac));
}

static int proof_ok(const uint8_t *key, size_t key_len, const char *label,
                    const uint8_t *const recs[], int n)
{
    uint8_t mac[UCCL_MAC_BYTES];
    proof(key, key_len, label, recs, n, mac);
    return uccl__ct_equal(mac, recs[n - 1] + UCCL_HELLO_MAC_OFF, sizeof(mac));
}

/* XOR the CHALLENGE's identity bytes with HMAC(key, "seal" | nonces | i):
 * sealing and unsealing are the same. */
static void seal(uint8_t chal[REC], const uint8_t *key, size_t key_len, const uint8_t init[REC])
{
    uint8_t ks[UCCL_SHA256_BYTES];
    size_t off = UCCL_HELLO_SEAL_OFF;
    for (uint8_t i = 0; off < UCCL_HELLO_SEAL_END; i++) {
        struct uccl__hmac m;
        uccl__hmac_init(&m, key, key_len);
        uccl__hmac_update(&m, "uccl-v2 seal", 12);
        uccl__hmac_update(&m, init + 8, UCCL_NONCE_BYTES);
        uccl__hmac_update(&m, chal + 8, UCCL_NONCE_BYTES);
        uccl__hmac_update(&m, &i, 1);
        uccl__hmac_final(&m, ks);
        for (size_t j = 0; j < sizeof(ks) && off < UCCL_HELLO_SEAL_END; j++)
            chal[off++] ^= ks[j];
    }
}

/* The connection's key: HMAC(secret, "conn key" | INIT | CHALLENGE). */
static void conn_key(const uint8_t *secret, size_t len, const uint8_t init[REC],
                     const uint8_t chal[REC], uint8_t out[32])
{
    struct uccl__hmac m;
    uccl__hmac_init(&m, secret, len);
    uccl__hmac_update(&m, "uccl-v2 conn key", 16);
    uccl__hmac_update(&m, init, REC);
    uccl__hmac_update(&m, chal, REC);
    uccl__hmac_final(&m, out);
}

uint64_t uccl__hs_probe_value(const uint8_t key[32], int connector)
{
    uint8_t mac[UCCL_SHA256_BYTES];
    const char *label = connector ? "uccl-v2 probe c" : "uccl-v2 probe a";
    uccl__hmac_sha256(key, 32, label, strlen(label), mac);
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | mac[i];
    return v;
}

/* ---- connector ------------------------------------------------------------ */

static void fill_hello(struct uccl__link *lk, int type, unsigned index, struct uccl__hello *h)
{
    const struct uccl__local *loc = lk->local;
    memset(h, 0, sizeof(*h));
    h->type = UCCL_HS_HELLO; /* a stream's record: its caller makes it UCCL_HS_STREAM */
    snprintf(h->host_id, sizeof(h->host_id), "%s", loc->host_id);
    h->pid = (uint32_t)getpid();
    h->gpu_idx = loc->gpu_idx;
    h->rank = loc->rank;
    h->transport = (uint32_t)loc->forced_tp;
    h->num_streams = lk->num_streams;
    h->stream_index = index;
    h->conn_token = lk->token;
    h->probe_addr = (uint64_t)(uintptr_t)&lk->probe_word;
    h->listen_port = (uint32_t)loc->port;
    h->chunk_bytes = lk->chunk_bytes;
    /* Left to choose, the acceptor picks RDMA for another host only if we
     * can take it too. */
    const struct uccl__tp_ops *rdma = uccl__tp_registry[UCCL_TP_RDMA];
    if (type == UCCL_HS_CONN && loc->forced_tp == UCCL_TP_AUTO && rdma &&
        rdma->available() == UCCL_OK)
        h->caps |= UCCL_CAP_RDMA;
    if (type == UCCL_HS_CONN && lk->peer_pid_ok)
        h->caps |= UCCL_CAP_CMA;
}

/* One record from the acceptor into buf (its first `have` bytes already
 * read), decoded; `want` is the type expected, a REFUSE becomes the error it
 * names (UCCL_INPROGRESS: busy, dial again). */
static int read_rec(struct uccl__link *lk, int fd, uint8_t buf[REC], size_t have, int want,
                    uint64_t deadline, struct uccl__hello *h)
{
    int rc = uccl__sock_recv_all(fd, buf + have, REC - have, deadline, 0);
    if (rc == UCCL_ERR_IO && want == UCCL_HS_CHALLENGE)
        return uccl__err(rc, "%s:%d closed the connection before answering its handshake: an "
                         "endpoint of an older uccl_collective (handshake version 1; this one "
                         "speaks %d) does that, or one that dropped it (see its log)",
                         lk->peer_ip, lk->peer_port, UCCL_HELLO_VERSION);
    if (rc)
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    if ((rc = uccl__hello_decode(buf, h)))
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    if (h->type == UCCL_HS_REFUSE) {
        if (h->status == UCCL_REFUSE_BUSY)
            return uccl__err(UCCL_INPROGRESS, "%s:%d is busy", lk->peer_ip, lk->peer_port);
        if (h->status == UCCL_ERR_AUTH)
            return uccl__err(UCCL_ERR_AUTH, "%s:%d refused the connection: wrong or missing "
                             "secret (UCCL_P2P_SECRET)", lk->peer_ip, lk->peer_port);
        return uccl__err(h->status == UCCL_ERR_UNAVAIL ? UCCL_ERR_UNAVAIL : UCCL_ERR_IO,
                         "%s:%d refused the connection: %s (see its log)", lk->peer_ip,
                         lk->peer_port, uccl_status_str(h->status));
    }
    if (h->type != want)
        return uccl__err(UCCL_ERR_PROTO, "handshake with %s:%d: record type %u where %d was "
                         "expected", lk->peer_ip, lk->peer_port, h->type, want);
    return UCCL_OK;
}

static int not_proved(struct uccl__link *lk)
{
    return uccl__err(UCCL_ERR_AUTH, "%s:%d did not prove it holds the secret: wrong or missing "
                     "secret (UCCL_P2P_SECRET) on one of the two ends, or not a uccl_collective "
                     "endpoint", lk->peer_ip, lk->peer_port);
}

/* After the acceptor proved itself on a new connection: who it is, the
 * connection's key, and (same host, CMA possible) its pid let ptrace us
 * before it probes our memory. */
static void connector_learn(struct uccl__link *lk, int fd, uint8_t rec[2][REC],
                            struct uccl__hello *chal)
{
    uint8_t open[REC];
    memcpy(open, rec[1], REC);
    seal(open, lk->secret, lk->secret_len, rec[0]);
    if (uccl__hello_decode(open, chal) != UCCL_OK)
        memset(chal, 0, sizeof(*chal)); /* proved, so ours: cannot happen */
    conn_key(lk->secret, lk->secret_len, rec[0], rec[1], lk->conn_key);
    const struct uccl__local *loc = lk->local;
    lk->peer_pid_ok = 0;
    if (chal->pid == 0 || strcmp(chal->host_id, loc->host_id) != 0 ||
        (loc->forced_tp != UCCL_TP_AUTO && loc->forced_tp != UCCL_TP_SHM))
        return; /* no same-host transport: nothing to check */
    uccl__sock_peer_held_by(fd, chal->pid, &lk->peer_pid_ok);
    if (!lk->peer_pid_ok) {
        LOG_INFO("%s:%d: no CMA with pid %u: %s", lk->peer_ip, lk->peer_port, chal->pid,
                 uccl_last_error());
        return;
    }
    if (chal->pid != (uint32_t)getpid()) { /* our own process needs no grant */
        uccl__ptracer_grant(chal->pid);
        lk->ptracer_pid = chal->pid;
    }
}

static void drop_grant(struct uccl__link *lk)
{
    if (lk->ptracer_pid) {
        uccl__ptracer_release(lk->ptracer_pid);
        lk->ptracer_pid = 0;
    }
}

/* After our last record went out: the setup stream's reply (if in), then
 * the ACK into rec_ack, checked against the records before it. */
static int read_ack(struct uccl__link *lk, int fd, const uint8_t *key, size_t key_len,
                    const uint8_t *const all[], int n, uint64_t deadline, void *in,
                    size_t in_len, struct uccl__hello *ack)
{
    uint8_t *rec_ack = (uint8_t *)all[n - 1];
    size_t have = 0;
    int rc = UCCL_OK;
    if (in) { /* the reply, or a refusal (which starts with the magic) */
        rc = uccl__sock_recv_all(fd, in, 4, deadline, 0);
        uint32_t magic = 0;
        memcpy(&magic, in, 4);
        if (rc == UCCL_OK && magic == UCCL_WIRE_MAGIC) {
            memcpy(rec_ack, in, 4);
            have = 4;
        } else if (rc == UCCL_OK) {
            rc = uccl__sock_recv_all(fd, (char *)in + 4, in_len - 4, deadline, 0);
        }
        if (rc)
            return uccl__err(rc, "setup stream to %s:%d: %s", lk->peer_ip, lk->peer_port,
                             uccl_last_error());
    }
    if (rc == UCCL_OK)
        rc = read_rec(lk, fd, rec_ack, have, UCCL_HS_ACK, deadline, ack);
    if (rc == UCCL_OK && have)
        rc = uccl__err(UCCL_ERR_PROTO, "%s:%d accepted a setup stream without a reply",
                       lk->peer_ip, lk->peer_port);
    if (rc == UCCL_OK && !proof_ok(key, key_len, "uccl-v2 ack", all, n))
        rc = not_proved(lk);
    return rc; /* read_rec's errors name the peer */
}

/* One socket more of an established connection: one round trip.  Its
 * record proves the connection's key, which is fresh (both nonces of the
 * first handshake), and names its index, which the acceptor takes once. */
static int stream_once(struct uccl__link *lk, int fd, unsigned index, uint64_t deadline,
                       const void *out, size_t out_len, void *in, size_t in_len,
                       struct uccl__hello *ack)
{
    uint8_t rec[2][REC];
    const uint8_t *const all[2] = {rec[0], rec[1]};
    struct uccl__hello h;
    fill_hello(lk, UCCL_HS_STREAM, index, &h);
    h.type = UCCL_HS_STREAM;
    uccl__random_bytes(h.nonce, sizeof(h.nonce));
    uccl__hello_encode(&h, rec[0]);
    sign(lk->conn_key, sizeof(lk->conn_key), "uccl-v2 stream", all, 1, rec[0]);
    int rc = uccl__sock_send2(fd, rec[0], REC, out, out ? out_len : 0, deadline);
    if (rc)
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    return read_ack(lk, fd, lk->conn_key, sizeof(lk->conn_key), all, 2, deadline, in, in_len,
                    ack);
}

/* One attempt of a new connection's handshake, on its control socket. */
static int conn_once(struct uccl__link *lk, int fd, uint64_t deadline, struct uccl__hello *ack)
{
    uint8_t rec[4][REC];
    const uint8_t *const all[4] = {rec[0], rec[1], rec[2], rec[3]};
    struct uccl__hello h, chal;
    const uint8_t *key = lk->secret;
    size_t key_len = lk->secret_len;

    memset(&h, 0, sizeof(h));
    h.type = UCCL_HS_CONN;
    uccl__random_bytes(h.nonce, sizeof(h.nonce));
    uccl__hello_encode(&h, rec[0]);
    int rc = uccl__sock_send_all(fd, rec[0], REC, deadline);
    if (rc == UCCL_OK)
        rc = read_rec(lk, fd, rec[1], 0, UCCL_HS_CHALLENGE, deadline, &chal);
    if (rc)
        return rc;
    if (!proof_ok(key, key_len, "uccl-v2 challenge", all, 2))
        return not_proved(lk);
    connector_learn(lk, fd, rec, &chal);
    lk->probe_word = uccl__hs_probe_value(lk->conn_key, 1);

    fill_hello(lk, UCCL_HS_CONN, 0, &h);
    uccl__hello_encode(&h, rec[2]);
    sign(key, key_len, "uccl-v2 hello", all, 3, rec[2]);
    if ((rc = uccl__sock_send_all(fd, rec[2], REC, deadline)))
        return uccl__err(rc, "handshake with %s:%d: %s", lk->peer_ip, lk->peer_port,
                         uccl_last_error());
    if ((rc = read_ack(lk, fd, key, key_len, all, 4, deadline, NULL, 0, ack)))
        return rc;
    ack->pid = chal.pid; /* who it is: from its CHALLENGE, checked against the socket */
    snprintf(ack->host_id, sizeof(ack->host_id), "%s", chal.host_id);
    return UCCL_OK;
}

static int connect_once(struct uccl__link *lk, int fd, int type, unsigned index,
                        uint64_t deadline, const void *out, size_t out_len, void *in,
                        size_t in_len, struct uccl__hello *ack)
{
    return type == UCCL_HS_CONN ? conn_once(lk, fd, deadline, ack)
                                : stream_once(lk, fd, index, deadline, out, out_len, in, in_len,
                                              ack);
}

/* Attempts until one is not refused as busy: each busy refusal dials
 * again, onto the same descriptor number (the caller holds it). */
static int connect_hs(struct uccl__link *lk, int fd, int type, unsigned index,
                      uint64_t deadline, const void *out, size_t out_len, void *in,
                      size_t in_len, struct uccl__hello *ack)
{
    long wait_ms = 5;
    for (;;) {
        int rc = connect_once(lk, fd, type, index, deadline, out, out_len, in, in_len, ack);
        if (rc == UCCL_OK && type == UCCL_HS_CONN &&
            !(ack->transport == UCCL_TP_SHM && ack->shm_mode == 0))
            drop_grant(lk); /* no CMA on this connection */
        if (rc != UCCL_OK && type == UCCL_HS_CONN)
            drop_grant(lk);
        if (rc != UCCL_INPROGRESS)
            return rc;
        if (uccl__now_ns() + (uint64_t)wait_ms * 1000000ull >= deadline)
            return uccl__err(UCCL_ERR_TIMEOUT, "%s:%d stayed too busy to take the connection "
                             "until the timeout", lk->peer_ip, lk->peer_port);
        struct timespec ts = {wait_ms / 1000, (wait_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        wait_ms = wait_ms < 200 ? 2 * wait_ms : 200;
        int nfd;
        if ((rc = uccl__sock_connect(lk->peer_ip, lk->peer_port, deadline, &nfd)))
            return rc;
        if (dup3(nfd, fd, O_CLOEXEC) < 0) {
            rc = uccl__err(UCCL_ERR_IO, "dup3: %s", strerror(errno));
            close(nfd);
            return rc;
        }
        close(nfd);
    }
}

int uccl__handshake(struct uccl__link *lk, int fd, int type, unsigned index, uint64_t deadline,
                    struct uccl__hello *ack)
{
    return connect_hs(lk, fd, type, index, deadline, NULL, 0, NULL, 0, ack);
}

int uccl__open_setup_stream(struct uccl__link *lk, uint64_t deadline, const void *out,
                            size_t out_len, void *in, size_t in_len, int *fd_p)
{
    int fd;
    struct uccl__hello ack;
    if (in_len < 4)
        return uccl__err(UCCL_ERR_INVALID, "setup stream: a reply of %zu bytes", in_len);
    int rc = uccl__sock_connect(lk->peer_ip, lk->peer_port, deadline, &fd);
    if (rc)
        return rc;
    rc = connect_hs(lk, fd, UCCL_HS_STREAM, 0, deadline, out, out_len, in, in_len, &ack);
    if (rc) {
        close(fd);
        return rc; /* its message names the peer */
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
    rc = uccl__handshake(lk, fd, UCCL_HS_STREAM, index, deadline_ns, &ack);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_p = fd;
    return UCCL_OK;
}

/* ---- acceptor --------------------------------------------------------------- */

int uccl__hs_read_first(struct uccl__hs *hs, struct uccl__hello *h)
{
    int rc = uccl__hello_decode(hs->rec[0], h);
    if (rc)
        return rc;
    if (h->type != UCCL_HS_CONN && h->type != UCCL_HS_STREAM)
        return uccl__err(UCCL_ERR_PROTO, "handshake: record type %u where an INIT was "
                         "expected", h->type);
    if (h->type == UCCL_HS_STREAM && h->conn_token == 0)
        return uccl__err(UCCL_ERR_PROTO, "handshake: a stream for connection token 0");
    hs->type = h->type;
    hs->token = h->conn_token;
    return UCCL_OK;
}

int uccl__hs_check_stream(struct uccl__hs *hs, const uint8_t key[32])
{
    const uint8_t *const all[1] = {hs->rec[0]};
    hs->key_len = 32;
    memcpy(hs->key, key, 32);
    if (!proof_ok(hs->key, hs->key_len, "uccl-v2 stream", all, 1))
        return uccl__err(UCCL_ERR_AUTH, "a stream without its connection's key");
    return UCCL_OK;
}

void uccl__hs_challenge(struct uccl__hs *hs, const struct uccl__local *loc, const uint8_t *key,
                        size_t key_len)
{
    const uint8_t *const all[2] = {hs->rec[0], hs->rec[1]};
    struct uccl__hello c;
    memset(&c, 0, sizeof(c));
    c.type = UCCL_HS_CHALLENGE;
    uccl__random_bytes(c.nonce, sizeof(c.nonce));
    c.pid = (uint32_t)getpid(); /* for the connector's ptrace grant (handshake.h) */
    snprintf(c.host_id, sizeof(c.host_id), "%s", loc->host_id);
    hs->key_len = key_len <= sizeof(hs->key) ? (uint32_t)key_len : 0;
    memcpy(hs->key, key, hs->key_len);
    uccl__hello_encode(&c, hs->rec[1]);
    seal(hs->rec[1], hs->key, hs->key_len, hs->rec[0]);
    sign(hs->key, hs->key_len, "uccl-v2 challenge", all, 2, hs->rec[1]);
}

int uccl__hs_check_hello(struct uccl__hs *hs, struct uccl__hello *h, uint8_t key_out[32])
{
    const uint8_t *const all[3] = {hs->rec[0], hs->rec[1], hs->rec[2]};
    int rc = uccl__hello_decode(hs->rec[2], h);
    if (rc)
        return rc;
    if (h->type != UCCL_HS_HELLO)
        return uccl__err(UCCL_ERR_PROTO, "handshake: record type %u where a HELLO was "
                         "expected", h->type);
    if (!proof_ok(hs->key, hs->key_len, "uccl-v2 hello", all, 3))
        return uccl__err(UCCL_ERR_AUTH, "wrong or missing secret (UCCL_P2P_SECRET)");
    if (h->conn_token == 0)
        return uccl__err(UCCL_ERR_PROTO, "handshake: connection token 0");
    conn_key(hs->key, hs->key_len, hs->rec[0], hs->rec[1], key_out);
    return UCCL_OK;
}

int uccl__hs_peer_pid_ok(int fd, const struct uccl__local *loc, const struct uccl__hello *h)
{
    int ok = 0;
    if (h->pid == 0 || strcmp(h->host_id, loc->host_id) != 0)
        return 0;
    uccl__sock_peer_held_by(fd, h->pid, &ok);
    if (!ok)
        LOG_INFO("no CMA with pid %u: %s", h->pid, uccl_last_error());
    return ok;
}

int uccl__hs_ack(struct uccl__hs *hs, int fd, const struct uccl__local *loc,
                 struct uccl__link *lk, struct uccl__hello *ack)
{
    uint8_t buf[REC];
    int conn = hs->type == UCCL_HS_CONN; /* a stream's ACK follows its one record */
    const uint8_t *const all[4] = {hs->rec[0], conn ? hs->rec[1] : buf, hs->rec[2], buf};
    ack->type = UCCL_HS_ACK;
    ack->status = UCCL_OK;
    ack->pid = (uint32_t)getpid();
    ack->gpu_idx = loc->gpu_idx;
    ack->rank = loc->rank;
    ack->listen_port = (uint32_t)loc->port;
    snprintf(ack->host_id, sizeof(ack->host_id), "%s", loc->host_id);
    if (lk) {
        lk->probe_word = uccl__hs_probe_value(lk->conn_key, 0);
        ack->probe_addr = (uint64_t)(uintptr_t)&lk->probe_word;
    }
    uccl__hello_encode(ack, buf);
    sign(hs->key, hs->key_len, "uccl-v2 ack", all, conn ? 4 : 2, buf);
    return uccl__sock_send_all(fd, buf, sizeof(buf), uccl__now_ns() + ACK_SEND_NS);
}

void uccl__hs_refuse(int fd, int status)
{
    struct uccl__hello r;
    uint8_t buf[REC];
    memset(&r, 0, sizeof(r));
    r.type = UCCL_HS_REFUSE;
    r.status = status < 0 ? status : UCCL_ERR_PROTO;
    uccl__hello_encode(&r, buf);
    uccl__sock_send_all(fd, buf, sizeof(buf), uccl__now_ns() + ACK_SEND_NS / 20);
}
