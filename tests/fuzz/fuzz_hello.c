/* The handshake (net/wire.h's records, tp/handshake.c's steps): the first
 * bytes an unauthenticated peer sends, and what a listener we dial answers.
 *
 * Input: byte 0 picks what is fuzzed (low 2 bits) and how (flags above);
 * then up to two 256-byte records (zeros past the input's end):
 *   0  one record of any type through uccl__hello_decode: an accepted record
 *      keeps its promises (a known type; the terms of a HELLO, ACK or
 *      STREAM in range; a REFUSE's status negative; strings terminated) and
 *      encodes back to a record that decodes to the same bytes;
 *   1  the acceptor's steps: record A is the connector's first record (INIT
 *      or STREAM), record B its HELLO; with FLAG_SIGN the harness signs
 *      them as a peer holding the key would (the fuzzer cannot compute an
 *      HMAC), without it they must be refused;
 *   2  the connector's steps on a new connection: a peer thread answers our
 *      INIT with record A as its CHALLENGE (sealed with FLAG_SEAL, signed
 *      with FLAG_SIGN) and our HELLO with record B as its ACK (signed with
 *      FLAG_SIGN2); a CHALLENGE or ACK not signed must fail the handshake;
 *   3  the connector's steps on an extra socket (STREAM, then the peer's
 *      ACK, record A, signed with the connection's key with FLAG_SIGN).
 * FLAG_NOKEY: the endpoint has no secret (the proofs are keyed with nothing;
 * a peer still cannot make them without computing them). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "fuzz.h"
#include "base/ptracer.h"
#include "base/sha256.h"
#include "base/status.h"
#include "net/wire.h"
#include "tp/handshake.h"
#include "tp/link.h"

#define REC UCCL_HELLO_SIZE
enum { FLAG_SIGN = 4, FLAG_SEAL = 8, FLAG_SIGN2 = 16, FLAG_NOKEY = 32, FLAG_TCP = 64 };

static const uint8_t SECRET[] = "fuzz-secret-0123456789";
static const uint8_t CONN_KEY[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
static const char HOST[] = "0123456789abcdef-boot-id";

/* The proofs and the seal as tp/handshake.h defines them, written again
 * here (the harness plays the peer that holds the key). */
static void proof(const uint8_t *key, size_t key_len, const char *label,
                  const uint8_t *const recs[], int n, uint8_t out[UCCL_MAC_BYTES])
{
    static const uint8_t zeros[UCCL_MAC_BYTES];
    struct uccl__hmac m;
    uccl__hmac_init(&m, key, key_len);
    uccl__hmac_update(&m, label, strlen(label));
    for (int i = 0; i < n - 1; i++)
        uccl__hmac_update(&m, recs[i], REC);
    uccl__hmac_update(&m, recs[n - 1], UCCL_HELLO_MAC_OFF);
    uccl__hmac_update(&m, zeros, sizeof(zeros));
    uccl__hmac_final(&m, out);
}

static void sign(const uint8_t *key, size_t key_len, const char *label,
                 const uint8_t *const recs[], int n)
{
    proof(key, key_len, label, recs, n, (uint8_t *)recs[n - 1] + UCCL_HELLO_MAC_OFF);
}

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

/* What a decoded HELLO, ACK or STREAM promises. */
static void check_terms(const struct uccl__hello *h)
{
    CHECK(h->transport < UCCL_TP_COUNT);
    CHECK(h->shm_mode <= 1);
    CHECK(h->num_streams >= 1 && h->num_streams <= UCCL_MAX_STREAMS);
    CHECK(h->stream_index < h->num_streams);
    CHECK(h->chunk_bytes >= 4096 && h->chunk_bytes <= (64u << 20));
    CHECK(h->shm_name[0] != '.' && !strchr(h->shm_name, '/'));
}

static void record(const uint8_t *in)
{
    struct uccl__hello h, h2;
    if (uccl__hello_decode(in, &h) != 0)
        return;
    CHECK(h.type >= UCCL_HS_CONN && h.type <= UCCL_HS_REFUSE);
    CHECK(fuzz_terminated(h.host_id, sizeof(h.host_id)));
    CHECK(fuzz_terminated(h.shm_name, sizeof(h.shm_name)));
    if (h.type == UCCL_HS_HELLO || h.type == UCCL_HS_ACK || h.type == UCCL_HS_STREAM)
        check_terms(&h);
    if (h.type == UCCL_HS_REFUSE)
        CHECK(h.status < 0);
    uint8_t *again = malloc(REC), *third = malloc(REC);
    uccl__hello_encode(&h, again);
    CHECK(uccl__hello_decode(again, &h2) == 0);
    uccl__hello_encode(&h2, third);
    CHECK(memcmp(again, third, REC) == 0);
    free(again);
    free(third);
}

static void acceptor(uint8_t *a, uint8_t *b, int flags)
{
    struct uccl__local loc;
    memset(&loc, 0, sizeof(loc));
    snprintf(loc.host_id, sizeof(loc.host_id), "%s", HOST);
    size_t key_len = flags & FLAG_NOKEY ? 0 : sizeof(SECRET) - 1;
    struct uccl__hs *hs = calloc(1, sizeof(*hs));
    struct uccl__hello h;
    memcpy(hs->rec[0], a, REC);
    if (flags & FLAG_SIGN) { /* a stream's one record, proving its connection's key */
        const uint8_t *const one[1] = {hs->rec[0]};
        sign(CONN_KEY, sizeof(CONN_KEY), "uccl-v2 stream", one, 1);
    }
    int rc = uccl__hs_read_first(hs, &h);
    FUZZ_SAY(rc);
    if (rc == 0 && h.type == UCCL_HS_STREAM) {
        check_terms(&h);
        CHECK(h.conn_token != 0);
        rc = uccl__hs_check_stream(hs, CONN_KEY);
        FUZZ_SAY(rc);
        CHECK(rc != 0 || (flags & FLAG_SIGN));
    } else if (rc == 0) {
        CHECK(h.type == UCCL_HS_CONN);
        uccl__hs_challenge(hs, &loc, SECRET, key_len);
        /* what a connector with the key reads from it: our identity, no more */
        uint8_t open[REC];
        struct uccl__hello c;
        memcpy(open, hs->rec[1], REC);
        seal(open, SECRET, key_len, hs->rec[0]);
        CHECK(uccl__hello_decode(open, &c) == 0 && c.type == UCCL_HS_CHALLENGE);
        CHECK(c.pid == (uint32_t)getpid() && strcmp(c.host_id, HOST) == 0);
        memcpy(hs->rec[2], b, REC);
        if (flags & FLAG_SIGN) {
            const uint8_t *const all[3] = {hs->rec[0], hs->rec[1], hs->rec[2]};
            sign(SECRET, key_len, "uccl-v2 hello", all, 3);
        }
        uint8_t key[32];
        rc = uccl__hs_check_hello(hs, &h, key);
        FUZZ_SAY(rc);
        CHECK(rc != 0 || (flags & FLAG_SIGN));
        if (rc == 0) {
            CHECK(h.type == UCCL_HS_HELLO && h.conn_token != 0);
            check_terms(&h);
            CHECK(fuzz_terminated(h.host_id, sizeof(h.host_id)));
        }
    }
    free(hs);
}

/* ---- the connector's side: a peer thread plays the listener ---- */
struct peer {
    int fd, mode, flags;
    size_t key_len;
    const uint8_t *a, *b;
};

static int recv_rec(int fd, uint8_t *p)
{
    for (size_t got = 0; got < REC;) {
        ssize_t n = recv(fd, p + got, REC - got, 0);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return 0;
}

static void *peer_main(void *arg)
{
    struct peer *pr = arg;
    uint8_t rec[4][REC];
    if (recv_rec(pr->fd, rec[0]))
        return NULL;
    if (pr->mode == 3) { /* a STREAM record: our ACK proves the connection's key */
        const uint8_t *const all[2] = {rec[0], rec[1]};
        memcpy(rec[1], pr->a, REC);
        if (pr->flags & FLAG_SIGN)
            sign(CONN_KEY, sizeof(CONN_KEY), "uccl-v2 ack", all, 2);
        send(pr->fd, rec[1], REC, MSG_NOSIGNAL);
        return NULL;
    }
    const uint8_t *const all[4] = {rec[0], rec[1], rec[2], rec[3]};
    memcpy(rec[1], pr->a, REC);
    if (pr->flags & FLAG_SEAL)
        seal(rec[1], SECRET, pr->key_len, rec[0]);
    if (pr->flags & FLAG_SIGN)
        sign(SECRET, pr->key_len, "uccl-v2 challenge", all, 2);
    if (send(pr->fd, rec[1], REC, MSG_NOSIGNAL) != REC || recv_rec(pr->fd, rec[2]))
        return NULL;
    memcpy(rec[3], pr->b, REC);
    if (pr->flags & FLAG_SIGN2)
        sign(SECRET, pr->key_len, "uccl-v2 ack", all, 4);
    send(pr->fd, rec[3], REC, MSG_NOSIGNAL);
    return NULL;
}

static void connector(const uint8_t *a, const uint8_t *b, int mode, int flags)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv))
        abort();
    struct timeval tv = {2, 0}; /* the peer thread never waits long */
    setsockopt(sv[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct uccl__local *loc = calloc(1, sizeof(*loc));
    struct uccl__link *lk = calloc(1, sizeof(*lk));
    snprintf(loc->host_id, sizeof(loc->host_id), "%s", HOST);
    loc->rank = 1, loc->gpu_idx = -1, loc->port = 5000;
    loc->forced_tp = flags & FLAG_TCP ? UCCL_TP_TCP : UCCL_TP_AUTO;
    lk->local = loc;
    lk->is_connector = 1;
    /* a busy refusal would dial again: here, a port nobody listens on */
    snprintf(lk->peer_ip, sizeof(lk->peer_ip), "127.0.0.1");
    lk->peer_port = 1;
    lk->token = 0x1122334455667788ull;
    lk->num_streams = 2;
    lk->chunk_bytes = 1 << 20;
    lk->secret_len = flags & FLAG_NOKEY ? 0 : sizeof(SECRET) - 1;
    memcpy(lk->secret, SECRET, lk->secret_len);
    memcpy(lk->conn_key, CONN_KEY, sizeof(CONN_KEY));
    struct peer pr = {sv[1], mode, flags, lk->secret_len, a, b};
    pthread_t t;
    if (pthread_create(&t, NULL, peer_main, &pr))
        abort();
    /* A busy refusal makes the connector wait and dial again until its
     * deadline: given one, a deadline too close for another try (the
     * redial is the socket layer's, not a decoder's; seconds per input). */
    struct uccl__hello ack;
    int type = mode == 3 ? UCCL_HS_STREAM : UCCL_HS_CONN;
    int busy = uccl__hello_decode(a, &ack) == 0 && ack.type == UCCL_HS_REFUSE &&
               ack.status == UCCL_REFUSE_BUSY;
    uint64_t wait = busy ? 3000000ull : 1000000000ull;
    int rc = uccl__handshake(lk, sv[0], type, 1, uccl__now_ns() + wait, &ack);
    FUZZ_SAY(rc);
    shutdown(sv[0], SHUT_RDWR);
    pthread_join(t, NULL);
    close(sv[0]);
    close(sv[1]);
    if (mode == 3)
        CHECK(rc != 0 || (flags & FLAG_SIGN));
    else
        CHECK(rc != 0 || ((flags & FLAG_SIGN) && (flags & FLAG_SIGN2)));
    if (rc == 0) {
        CHECK(ack.type == UCCL_HS_ACK);
        check_terms(&ack);
        CHECK(fuzz_terminated(ack.host_id, sizeof(ack.host_id)));
    }
    if (rc != 0)
        CHECK(lk->ptracer_pid == 0); /* a failed handshake keeps no ptrace grant */
    if (lk->ptracer_pid)
        uccl__ptracer_release(lk->ptracer_pid);
    free(lk);
    free(loc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int mode = data[0] & 3, flags = data[0] & ~3;
    uint8_t *a = fuzz_record(data + 1, size - 1, REC);
    size_t rest = size > 1 + REC ? size - 1 - REC : 0;
    uint8_t *b = fuzz_record(rest ? data + 1 + REC : data, rest, REC);
    if (mode == 0)
        record(a);
    else if (mode == 1)
        acceptor(a, b, flags);
    else
        connector(a, b, mode, flags);
    free(a);
    free(b);
    return 0;
}
