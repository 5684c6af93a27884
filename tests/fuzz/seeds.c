/* Writes the seed corpus (corpus/<harness>/<name>): valid records made by
 * the engine's own encoders (or, for the stream-ordered groups, the slots
 * a peer's real calls publish), and edge cases around every bound the
 * decoders check.  Run from tests/_fuzz.py (seeds()); the files it wrote
 * are kept in the repository, so a change of a record's layout means
 * running it again:  python3 -c 'import sys; sys.path.insert(0, "tests");
 * import _fuzz; _fuzz.seeds()'. */
#define _GNU_SOURCE
#include <sys/stat.h>

#include "sgfake.h"
#include "sg/sg_page.h"
#include "net/wire.h"
#include "base/status.h"

static const char *root;
static int sgfake_allowed(int p, uint64_t k, uint64_t a, size_t l)
{
    (void)p, (void)k, (void)a, (void)l;
    return 1;
}

static void put(const char *h, const char *name, const void *p, size_t n)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", root, h);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%s/%s", root, h, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f)) {
        perror(path);
        exit(1);
    }
}


static void le64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> 8 * i); }

/* ---- handshake (fuzz_hello.c says the input's layout: a mode byte, then records) ---- */
static struct uccl__hello hello(int type)
{
    struct uccl__hello h = {.type = (uint16_t)type, .pid = 4242, .gpu_idx = -1, .rank = 1,
                            .transport = UCCL_TP_SHM, .num_streams = 2,
                            .conn_token = 0x1122334455667788ull, .probe_addr = 0x7fff0000,
                            .listen_port = 5000, .chunk_bytes = 1 << 20, .caps = UCCL_CAP_RDMA};
    memset(h.nonce, 0x5a, sizeof(h.nonce));
    memset(h.mac, 0xa5, sizeof(h.mac));
    snprintf(h.host_id, sizeof(h.host_id), "0123456789abcdef-boot-id");
    if (type == UCCL_HS_ACK)
        snprintf(h.shm_name, sizeof(h.shm_name), "uccl-ring-1234_x.y");
    if (type == UCCL_HS_REFUSE)
        h.status = UCCL_ERR_AUTH;
    return h;
}

/* mode byte, then records a and b (b may be NULL) */
static void hs_put(const char *name, int mode, const struct uccl__hello *a,
                   const struct uccl__hello *b)
{
    uint8_t buf[1 + 2 * UCCL_HELLO_SIZE];
    buf[0] = (uint8_t)mode;
    uccl__hello_encode(a, buf + 1);
    if (b)
        uccl__hello_encode(b, buf + 1 + UCCL_HELLO_SIZE);
    put("hello", name, buf, b ? sizeof(buf) : 1 + UCCL_HELLO_SIZE);
}

/* one record (mode 0), patched at byte `at` (-1: none) */
static void hs_rec(const char *name, struct uccl__hello h, int at, uint8_t v)
{
    uint8_t buf[1 + UCCL_HELLO_SIZE] = {0};
    uccl__hello_encode(&h, buf + 1);
    if (at >= 0)
        buf[1 + at] = v;
    put("hello", name, buf, sizeof(buf));
}

static void hellos(void)
{
    enum { SIGN = 4, SEAL = 8, SIGN2 = 16, NOKEY = 32, TCP = 64 };
    static const char *names[] = {"", "init", "stream", "challenge", "hello", "ack", "refuse"};
    struct uccl__hello h, a, b;
    char name[64];
    /* every record type, as its sender makes it */
    for (int t = UCCL_HS_CONN; t <= UCCL_HS_REFUSE; t++) {
        snprintf(name, sizeof(name), "rec-%s", names[t]);
        hs_rec(name, hello(t), -1, 0);
    }
    /* every bound the decoder checks */
    h = hello(UCCL_HS_HELLO), h.num_streams = 16, h.stream_index = 15;
    hs_rec("rec-streams-16", h, -1, 0);
    h = hello(UCCL_HS_HELLO), h.num_streams = 17, hs_rec("rec-streams-17", h, -1, 0);
    h = hello(UCCL_HS_HELLO), h.stream_index = 2, hs_rec("rec-index-past", h, -1, 0);
    h = hello(UCCL_HS_HELLO), h.chunk_bytes = 4095, hs_rec("rec-chunk-small", h, -1, 0);
    h = hello(UCCL_HS_ACK), h.chunk_bytes = (64u << 20) + 1, hs_rec("rec-chunk-big", h, -1, 0);
    h = hello(UCCL_HS_HELLO), h.transport = UCCL_TP_COUNT, hs_rec("rec-tp-unknown", h, -1, 0);
    h = hello(UCCL_HS_ACK), h.shm_mode = 2, hs_rec("rec-shm-mode-2", h, -1, 0);
    h = hello(UCCL_HS_ACK), h.shm_name[0] = '.', hs_rec("rec-shm-dot", h, -1, 0);
    h = hello(UCCL_HS_ACK), h.shm_name[3] = '/', hs_rec("rec-shm-slash", h, -1, 0);
    h = hello(UCCL_HS_REFUSE), h.status = 0, hs_rec("rec-refuse-status-0", h, -1, 0);
    h = hello(UCCL_HS_REFUSE), h.status = -100, hs_rec("rec-refuse-busy", h, -1, 0);
    hs_rec("rec-version-1", hello(UCCL_HS_HELLO), 4, 1);
    hs_rec("rec-bad-magic", hello(UCCL_HS_HELLO), 0, 'V');
    hs_rec("rec-type-0", hello(UCCL_HS_HELLO), 6, 0);
    hs_rec("rec-type-7", hello(UCCL_HS_HELLO), 6, 7);
    {
        uint8_t buf[1 + UCCL_HELLO_SIZE] = {0};
        h = hello(UCCL_HS_ACK), uccl__hello_encode(&h, buf + 1);
        memset(buf + 1 + 104, 'h', 64 + 44); /* host id and shm name with no end */
        put("hello", "rec-strings-unterminated", buf, sizeof(buf));
        put("hello", "rec-short", buf, 13);
    }
    /* the acceptor's steps (mode 1): a connector's INIT then HELLO, or a STREAM */
    a = hello(UCCL_HS_CONN), b = hello(UCCL_HS_HELLO);
    hs_put("acc-init-hello-signed", 1 | SIGN, &a, &b);
    hs_put("acc-init-hello-signed-nokey", 1 | SIGN | NOKEY, &a, &b);
    hs_put("acc-init-hello-unsigned", 1, &a, &b);
    b.conn_token = 0, hs_put("acc-hello-token-0", 1 | SIGN, &a, &b);
    b = hello(UCCL_HS_ACK), hs_put("acc-ack-for-hello", 1 | SIGN, &a, &b);
    a = hello(UCCL_HS_STREAM), hs_put("acc-stream-signed", 1 | SIGN, &a, NULL);
    hs_put("acc-stream-unsigned", 1, &a, NULL);
    a.conn_token = 0, hs_put("acc-stream-token-0", 1 | SIGN, &a, NULL);
    a = hello(UCCL_HS_HELLO), hs_put("acc-hello-first", 1 | SIGN, &a, NULL);
    /* the connector's steps (mode 2): the listener's CHALLENGE then its ACK */
    a = hello(UCCL_HS_CHALLENGE), b = hello(UCCL_HS_ACK);
    b.transport = UCCL_TP_TCP;
    hs_put("con-all-signed", 2 | SIGN | SEAL | SIGN2, &a, &b);
    hs_put("con-all-signed-tcp", 2 | SIGN | SEAL | SIGN2 | TCP, &a, &b);
    hs_put("con-all-signed-nokey", 2 | SIGN | SEAL | SIGN2 | NOKEY, &a, &b);
    hs_put("con-challenge-unsigned", 2 | SEAL | SIGN2, &a, &b);
    hs_put("con-ack-unsigned", 2 | SIGN | SEAL, &a, &b);
    hs_put("con-challenge-unsealed", 2 | SIGN | SIGN2, &a, &b);
    a.pid = 0, hs_put("con-no-pid", 2 | SIGN | SEAL | SIGN2, &a, &b);
    a = hello(UCCL_HS_CHALLENGE), b = hello(UCCL_HS_ACK), b.shm_mode = 0;
    hs_put("con-shm-cma", 2 | SIGN | SEAL | SIGN2, &a, &b);
    a = hello(UCCL_HS_REFUSE), hs_put("con-refused-auth", 2, &a, NULL);
    a.status = -100, hs_put("con-refused-busy", 2, &a, NULL);
    a = hello(UCCL_HS_CHALLENGE), b = hello(UCCL_HS_REFUSE);
    hs_put("con-refused-after-hello", 2 | SIGN | SEAL, &a, &b);
    /* an extra socket (mode 3): the listener's ACK to our STREAM */
    a = hello(UCCL_HS_ACK), a.transport = UCCL_TP_TCP;
    hs_put("str-ack-signed", 3 | SIGN, &a, NULL);
    hs_put("str-ack-unsigned", 3, &a, NULL);
    a = hello(UCCL_HS_REFUSE), hs_put("str-refused", 3, &a, NULL);
}

/* ---- control messages ---- */
static void msgs(void)
{
    uint8_t b[UCCL_MSG_SIZE];
    char name[32];
    for (int t = 1; t <= UCCL_MSG_TYPE_MAX; t++) {
        struct uccl__msg m = {.type = (uint16_t)t, .seq = 7, .len = 4096, .addr = 0x7f0000001000,
                              .window = 3, .token = 0xabcdef, .offset = 64, .aux = 1};
        uccl__msg_encode(&m, b);
        snprintf(name, sizeof(name), "type-%d", t);
        put("msg", name, b, sizeof(b));
    }
    struct uccl__msg m = {.type = UCCL_MSG_WREQ, .len = 1ull << 48, .offset = 1ull << 48};
    uccl__msg_encode(&m, b), put("msg", "len-max", b, sizeof(b));
    m.len++, uccl__msg_encode(&m, b), put("msg", "len-past", b, sizeof(b));
    m.len = 1, m.offset = UINT64_MAX, uccl__msg_encode(&m, b), put("msg", "offset-huge", b, sizeof(b));
    m = (struct uccl__msg){.type = 0}, uccl__msg_encode(&m, b), put("msg", "type-0", b, sizeof(b));
    m.type = UCCL_MSG_TYPE_MAX + 1, uccl__msg_encode(&m, b), put("msg", "type-past", b, sizeof(b));
}

/* ---- data chunk headers (then the receiver's bound) ---- */
static void chunk_one(const char *name, int kind, uint64_t len, uint64_t max_len)
{
    uint8_t b[UCCL_CHUNK_HDR_SIZE + 8];
    struct uccl__chunk_hdr c = {.kind = (uint16_t)kind, .id = 5, .offset = 1 << 20, .len = len};
    uccl__chunk_encode(&c, b);
    le64(b + UCCL_CHUNK_HDR_SIZE, max_len);
    put("chunk", name, b, sizeof(b));
}

static void chunks(void)
{
    chunk_one("send", UCCL_DATA_SEND, 1 << 20, 1 << 20);
    chunk_one("write", UCCL_DATA_WRITE, 1, 1 << 20);
    chunk_one("read", UCCL_DATA_READ, 4096, 1 << 20);
    chunk_one("len-0", UCCL_DATA_SEND, 0, 1 << 20);
    chunk_one("len-past", UCCL_DATA_SEND, (1 << 20) + 1, 1 << 20);
    chunk_one("len-huge", UCCL_DATA_WRITE, UINT64_MAX, UINT64_MAX);
    chunk_one("kind-0", 0, 16, 1 << 20);
    chunk_one("kind-4", 4, 16, 1 << 20);
}

/* ---- one-sided descriptors, then a request (fuzz_fifo.c says the layout) ---- */
static void fifo_one(const char *name, uint64_t window, uint64_t addr, uint64_t len,
                     uint64_t base, int flags, uint64_t offset, uint64_t rlen, int conn)
{
    uint8_t b[UCCL_FIFO_ITEM_SIZE + 34] = {0};
    uccl_fifo_make(window, 0x5eed, addr, len, base, b);
    uint8_t *r = b + UCCL_FIFO_ITEM_SIZE;
    r[0] = (uint8_t)flags;
    le64(r + 1, window), le64(r + 9, 0x5eed), le64(r + 17, offset), le64(r + 25, rlen);
    r[33] = (uint8_t)conn;
    put("fifo", name, b, sizeof(b));
}

static void fifos(void)
{
    fifo_one("whole", 1, 0x10000, 4096, 0, 3, 0, 4096, 1);
    fifo_one("part-of-window", 1, 0x10100, 256, 0x10000, 3, 0, 0, 1);
    fifo_one("window-2", 2, 0x20000, 500, 0, 3, 0, 500, 1);
    fifo_one("window-2-past", 2, 0x20000, 500, 0, 2, 1, 500, 1);
    fifo_one("window-3-other-conn", 3, 0x30000, 96, 0, 3, 0, 96, 1);
    fifo_one("window-3", 3, 0x30000, 96, 0, 3, 0, 96, 2);
    fifo_one("offset-huge", 1, 0, 0, 0, 2, UINT64_MAX, 2, 1);
    fifo_one("len-huge", 1, 0, 0, 0, 2, 1, UINT64_MAX, 1);
    fifo_one("wrong-token", 1, 0x10000, 4096, 0, 0, 0, 16, 1);
    fifo_one("base-past-addr", 1, 0x100, 16, 0x200, 1, 0, 0, 1);
    fifo_one("base-overflow", 1, UINT64_MAX - 1, 16, 1, 1, 0, 0, 1);
    uint8_t b[UCCL_FIFO_ITEM_SIZE + 1] = {0};
    uccl_fifo_make(1, 2, 3, 4, 0, b);
    put("fifo", "short-63", b, 63);
    put("fifo", "long-65", b, 65);
}

/* ---- endpoint metadata ---- */
static void meta_one(const char *name, const char *ip, uint32_t port, uint32_t secret_len)
{
    uint8_t b[UCCL_META_SIZE + 8] = {0}; /* room: the encoder is checked by the harness */
    struct uccl__meta m = {.port = port, .gpu_idx = 3, .secret_len = secret_len};
    snprintf(m.ip, sizeof(m.ip), "%s", ip);
    snprintf(m.host_id, sizeof(m.host_id), "0123456789abcdef-boot-id");
    memset(m.secret, 'k', secret_len <= UCCL_SECRET_MAX ? secret_len : UCCL_SECRET_MAX);
    uccl__meta_encode(&m, b);
    if (secret_len > UCCL_SECRET_MAX) /* the length field: 16 bits at 126 */
        b[126] = (uint8_t)secret_len, b[127] = (uint8_t)(secret_len >> 8);
    put("meta", name, b, UCCL_META_SIZE);
}

static void metas(void)
{
    meta_one("secret-6", "127.0.0.1", 5000, 6);
    meta_one("secret-0", "10.1.2.3", 65535, 0);
    meta_one("secret-62", "127.0.0.1", 1, 62);
    meta_one("secret-64", "127.0.0.1", 1, 64);
    meta_one("secret-65", "127.0.0.1", 1, 65);
    meta_one("port-0", "127.0.0.1", 0, 6);
    meta_one("port-65536", "127.0.0.1", 65536, 6);
    struct uccl__meta m = {.port = 5000, .gpu_idx = -1};
    snprintf(m.ip, sizeof(m.ip), "127.0.0.1");
    uint8_t up[UCCL_META_UPSTREAM_SIZE];
    uccl__meta_encode_upstream(&m, up);
    put("meta", "upstream-10", up, sizeof(up));
    up[4] = up[5] = 0;
    put("meta", "upstream-port-0", up, sizeof(up));
    uint8_t six[22] = {0};
    put("meta", "upstream-ipv6-22", six, sizeof(six));
    uint8_t b[UCCL_META_SIZE];
    memset(b, 'x', sizeof(b));
    put("meta", "garbage-192", b, sizeof(b));
    put("meta", "length-191", b, 191);
}

/* ---- stream-ordered groups: the slots a peer's own calls publish ---- */
/* Rank r's call (op as fuzz_sg_round.c numbers them) on a page of its own:
 * it publishes its slot of round 1, then fails waiting for the others. */
static size_t peer_slot(int n, int r, int op, int dtype, int red, int root, size_t count,
                        uint8_t *out)
{
    size_t bytes = uccl_sg_page_bytes(n), nb = count * uccl_dtype_size(dtype);
    uint8_t *pg = aligned_alloc(PAGE, bytes), *in = malloc((size_t)n * nb + 1),
            *o = malloc(nb + 1), *arena = aligned_alloc(16, 2 * 1024 + UCCL_SG_FUSED_TAIL);
    memset(pg, 0, bytes);
    sgfake_reset();
    sgfake_own((uintptr_t)pg, bytes);
    sgfake_own((uintptr_t)in, (size_t)n * nb + 1);
    sgfake_own((uintptr_t)o, nb + 1);
    sgfake_own((uintptr_t)arena, 2 * 1024 + UCCL_SG_FUSED_TAIL);
    uccl_sg_t *sg;
    if (uccl_sg_new(pg, bytes, r, n, 0.005, 1, &sgfake_ops, NULL, &sg))
        exit(1);
    if (op == 5)
        uccl_sg_fused_arena(sg, (uintptr_t)arena, 2 * 1024 + UCCL_SG_FUSED_TAIL, 1024);
    struct uccl_sg_opts opt = {.caller = 1};
    uint32_t k;
    switch (op) {
    case 0: uccl_sg_allreduce(sg, &opt, (uintptr_t)in, count, dtype, red, &k); break;
    case 1: uccl_sg_reduce_scatter(sg, &opt, (uintptr_t)o, (uintptr_t)in, count, dtype, red, &k); break;
    case 2: case 5: uccl_sg_allgather(sg, &opt, (uintptr_t)o, count, (uintptr_t)in, &k); break;
    case 3: uccl_sg_broadcast(sg, &opt, (uintptr_t)in, count, root, &k); break;
    default: uccl_sg_reduce(sg, &opt, (uintptr_t)in, count, dtype, red, root, &k); break;
    }
    const uint8_t *s = pg + PAGE + (size_t)r * RANK_BYTES + OFF_SLOTS + (1 % NSLOT) * SLOT_BYTES;
    const struct slot_head *h = (const struct slot_head *)s;
    size_t len = sizeof(*h) + (size_t)h->count * ENTRY_BYTES;
    memcpy(out, s, len);
    uccl_sg_close(sg);
    free(pg), free(in), free(o), free(arena);
    return len;
}

static void sg_rounds(void)
{
    static const char *ops[] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
                                "allgather_arena"};
    uint8_t b[16384];
    char name[64];
    for (int n = 2; n <= 4; n++)
        for (int op = 0; op < 6; op++) {
            int me = op % n, dtype = UCCL_DT_F32, red = 0, root = (me + 1) % n;
            size_t count = op == 5 ? 256 : 100 + (size_t)n;
            uint8_t hd[9] = {(uint8_t)(n - 2), (uint8_t)me, (uint8_t)op, (uint8_t)dtype,
                             (uint8_t)red, (uint8_t)root, (uint8_t)count, (uint8_t)(count >> 8), 0};
            size_t at = sizeof(hd);
            memcpy(b, hd, at);
            for (int r = 0; r < n; r++) {
                if (r == me)
                    continue;
                size_t l = peer_slot(n, r, op, dtype, red, root, count, b + at + 2);
                b[at] = (uint8_t)l, b[at + 1] = (uint8_t)(l >> 8);
                at += 2 + l;
            }
            snprintf(name, sizeof(name), "%s-%d-ranks", ops[op], n);
            put("sg_round", name, b, at);
            if (n == 3 && op == 0) { /* the same, the group failed by another rank */
                b[8] = 2;
                memset(b + at, 0, REASON);
                snprintf((char *)b + at, REASON, "rank 2 exited");
                put("sg_round", "allreduce-failed-page", b, at + REASON);
                memset(b + at, 'r', REASON); /* a reason with no end */
                put("sg_round", "allreduce-failed-unterminated", b, at + REASON);
            }
        }
}

/* The channel's slots once the peer posted its side of messages 1 and 2. */
static void sg_p2ps(void)
{
    char name[64];
    for (int n = 2; n <= 3; n++)
        for (int send = 0; send < 2; send++)
            for (int staged = 0; staged < 2; staged++) {
                int me = 0, peer = n - 1;
                size_t bytes = uccl_sg_page_bytes(n), len = 1000;
                uint8_t *pg = aligned_alloc(PAGE, bytes), *buf = malloc(len),
                        *arena = malloc(16 * 4096);
                memset(pg, 0, bytes);
                sgfake_reset();
                sgfake_own((uintptr_t)pg, bytes);
                sgfake_own((uintptr_t)buf, len);
                sgfake_own((uintptr_t)arena, 16 * 4096);
                uccl_sg_t *sg;
                if (uccl_sg_new(pg, bytes, peer, n, 0.005, 1, &sgfake_ops, NULL, &sg))
                    exit(1);
                if (staged && !send) /* the peer sends: its staging arena */
                    uccl_sg_p2p_arena(sg, me, (uintptr_t)arena, 16 * 4096);
                struct uccl_sg_p2p_op ops[2] = {{me, !send, (uintptr_t)buf, len, 2},
                                                {me, !send, (uintptr_t)buf, len, 2}};
                uint64_t codes[2];
                uccl_sg_p2p(sg, ops, 2, 1, NULL, NULL, codes);
                int src = send ? me : peer, dst = send ? peer : me;
                struct p2p_chan *ch = (struct p2p_chan *)(pg + PAGE + (size_t)n * RANK_BYTES) +
                                      (src * n + dst);
                uint8_t b[6 + 2 * sizeof(struct p2p_slot)];
                uint8_t hd[6] = {(uint8_t)(n - 2), (uint8_t)me,
                                 (uint8_t)((peer - me - 1 + n) % n),
                                 (uint8_t)(send | (staged && send ? 2 : 0) | 4),
                                 (uint8_t)len, (uint8_t)(len >> 8)};
                memcpy(b, hd, 6);
                memcpy(b + 6, &ch->slot[1], 2 * sizeof(struct p2p_slot));
                snprintf(name, sizeof(name), "%s-%d-ranks%s", send ? "send" : "recv", n,
                         staged ? "-staged" : "");
                put("sg_p2p", name, b, sizeof(b));
                if (n == 2 && send && !staged) {
                    b[4] ^= 1; /* the receiver's length differs */
                    put("sg_p2p", "send-length-differs", b, sizeof(b));
                    b[4] ^= 1;
                    le64(b + 6, ((uint64_t)1 << 32) | 7); /* a state no protocol makes */
                    put("sg_p2p", "send-bad-state", b, sizeof(b));
                }
                uccl_sg_close(sg);
                free(pg), free(buf), free(arena);
            }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    mkdir(root, 0755);
    hellos();
    msgs();
    chunks();
    fifos();
    metas();
    sg_rounds();
    sg_p2ps();
    return 0;
}
