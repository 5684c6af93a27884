#define _GNU_SOURCE
#include "net/wire.h"

#include <arpa/inet.h>

#include <string.h>

#include "base/status.h"

/* Byte-order-explicit accessors: the wire is little-endian on every host. */
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void put_head_v(uint8_t *p, uint32_t magic, uint16_t version, uint16_t type)
{
    put32(p, magic);
    put16(p + 4, version);
    put16(p + 6, type);
}

static void put_head(uint8_t *p, uint32_t magic, uint16_t type)
{
    put_head_v(p, magic, UCCL_WIRE_VERSION, type);
}

static int check_head_v(const uint8_t *p, uint32_t magic, uint16_t version, const char *what,
                        uint16_t *type_p)
{
    if (get32(p) != magic)
        return uccl__err(UCCL_ERR_PROTO, "%s: bad magic 0x%08x (expected 0x%08x)", what,
                         get32(p), magic);
    if (get16(p + 4) != version)
        return uccl__err(UCCL_ERR_PROTO, "%s: wire version %u, this build speaks %u", what,
                         get16(p + 4), version);
    *type_p = get16(p + 6);
    return UCCL_OK;
}

static int check_head(const uint8_t *p, uint32_t magic, const char *what, uint16_t *type_p)
{
    return check_head_v(p, magic, UCCL_WIRE_VERSION, what, type_p);
}

/* Copy a string into a fixed-size, zero-filled field, always terminated. */
static void put_str(uint8_t *dst, const char *src, size_t n)
{
    size_t l = strnlen(src, n - 1);
    memcpy(dst, src, l);
}

/* Copy a fixed-size text field and make sure it is terminated. */
static void get_str(char *dst, const uint8_t *src, size_t n)
{
    memcpy(dst, src, n);
    dst[n - 1] = '\0';
}

/* ---- hello ----------------------------------------------------------------- */
enum {
    H_NONCE = 8, H_TOKEN = 40, H_STATUS = 48, H_PID = 52, H_GPU = 56, H_RANK = 60, H_TP = 64,
    H_SHMMODE = 68, H_NSTREAMS = 72, H_SIDX = 76, H_LPORT = 80, H_CAPS = 84, H_CHUNK = 88,
    H_PADDR = 96, H_HOST = 104, H_SHMNAME = 168, H_SHMNAME_END = 212, /* 212..224 zero */
    H_MAC = UCCL_HELLO_MAC_OFF, /* .. 256 */
};
_Static_assert(H_HOST + UCCL_HOSTID_MAX == H_SHMNAME, "hello layout");
_Static_assert(H_SHMNAME_END <= UCCL_HELLO_SEAL_END && H_NONCE + UCCL_NONCE_BYTES ==
               UCCL_HELLO_SEAL_OFF, "hello layout");

void uccl__hello_encode(const struct uccl__hello *h, uint8_t out[UCCL_HELLO_SIZE])
{
    memset(out, 0, UCCL_HELLO_SIZE);
    put_head_v(out, UCCL_WIRE_MAGIC, UCCL_HELLO_VERSION, h->type);
    memcpy(out + H_NONCE, h->nonce, UCCL_NONCE_BYTES);
    put64(out + H_TOKEN, h->conn_token);
    put32(out + H_STATUS, (uint32_t)h->status);
    put32(out + H_PID, h->pid);
    put32(out + H_GPU, (uint32_t)h->gpu_idx);
    put32(out + H_RANK, (uint32_t)h->rank);
    put32(out + H_TP, h->transport);
    put32(out + H_SHMMODE, h->shm_mode);
    put32(out + H_NSTREAMS, h->num_streams);
    put32(out + H_SIDX, h->stream_index);
    put32(out + H_LPORT, h->listen_port);
    put32(out + H_CAPS, h->caps);
    put64(out + H_CHUNK, h->chunk_bytes);
    put64(out + H_PADDR, h->probe_addr);
    put_str(out + H_HOST, h->host_id, UCCL_HOSTID_MAX);
    put_str(out + H_SHMNAME, h->shm_name, H_SHMNAME_END - H_SHMNAME);
    memcpy(out + H_MAC, h->mac, UCCL_MAC_BYTES);
}

/* The terms of a HELLO or an ACK. */
static int check_terms(const struct uccl__hello *v)
{
    if (v->transport >= UCCL_TP_COUNT)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown transport %u", v->transport);
    if (v->shm_mode > 1)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown shm mode %u", v->shm_mode);
    if (v->num_streams < 1 || v->num_streams > UCCL_MAX_STREAMS)
        return uccl__err(UCCL_ERR_PROTO, "handshake: %u streams (allowed 1..%d)",
                         v->num_streams, UCCL_MAX_STREAMS);
    if (v->stream_index >= v->num_streams)
        return uccl__err(UCCL_ERR_PROTO, "handshake: stream index %u >= %u streams",
                         v->stream_index, v->num_streams);
    if (v->chunk_bytes < 4096 || v->chunk_bytes > (64u << 20))
        return uccl__err(UCCL_ERR_PROTO, "handshake: chunk size %llu outside 4 KiB..64 MiB",
                         (unsigned long long)v->chunk_bytes);
    for (const char *c = v->shm_name; *c; c++) {
        int ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                 (*c >= '0' && *c <= '9') || *c == '-' || *c == '_' || *c == '.';
        if (!ok || (c == v->shm_name && *c == '.'))
            return uccl__err(UCCL_ERR_PROTO, "handshake: bad shared-memory name");
    }
    return UCCL_OK;
}

int uccl__hello_decode(const uint8_t in[UCCL_HELLO_SIZE], struct uccl__hello *h)
{
    struct uccl__hello v;
    memset(&v, 0, sizeof(v));
    int rc = check_head_v(in, UCCL_WIRE_MAGIC, UCCL_HELLO_VERSION, "handshake", &v.type);
    if (rc)
        return rc;
    if (v.type < UCCL_HS_CONN || v.type > UCCL_HS_REFUSE)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown record type %u", v.type);
    memcpy(v.nonce, in + H_NONCE, UCCL_NONCE_BYTES);
    v.conn_token = get64(in + H_TOKEN);
    v.status = (int32_t)get32(in + H_STATUS);
    v.pid = get32(in + H_PID);
    v.gpu_idx = (int32_t)get32(in + H_GPU);
    v.rank = (int32_t)get32(in + H_RANK);
    v.transport = get32(in + H_TP);
    v.shm_mode = get32(in + H_SHMMODE);
    v.num_streams = get32(in + H_NSTREAMS);
    v.stream_index = get32(in + H_SIDX);
    v.listen_port = get32(in + H_LPORT);
    v.caps = get32(in + H_CAPS); /* unknown bits: a newer peer's, ignored */
    v.chunk_bytes = get64(in + H_CHUNK);
    v.probe_addr = get64(in + H_PADDR);
    get_str(v.host_id, in + H_HOST, UCCL_HOSTID_MAX);
    get_str(v.shm_name, in + H_SHMNAME, H_SHMNAME_END - H_SHMNAME);
    memcpy(v.mac, in + H_MAC, UCCL_MAC_BYTES);
    if ((v.type == UCCL_HS_HELLO || v.type == UCCL_HS_ACK || v.type == UCCL_HS_STREAM) &&
        (rc = check_terms(&v)))
        return rc;
    if (v.type == UCCL_HS_REFUSE && v.status >= 0)
        return uccl__err(UCCL_ERR_PROTO, "handshake: a refusal with status %d", v.status);
    *h = v;
    return UCCL_OK;
}

/* ---- control messages ---------------------------------------------------- */
void uccl__msg_encode(const struct uccl__msg *m, uint8_t out[UCCL_MSG_SIZE])
{
    put_head(out, UCCL_WIRE_MAGIC, m->type);
    put64(out + 8, m->seq);
    put64(out + 16, m->len);
    put64(out + 24, m->addr);
    put64(out + 32, m->window);
    put64(out + 40, m->token);
    put64(out + 48, m->offset);
    put64(out + 56, m->aux);
}

int uccl__msg_decode(const uint8_t in[UCCL_MSG_SIZE], struct uccl__msg *m)
{
    struct uccl__msg v;
    int rc = check_head(in, UCCL_WIRE_MAGIC, "control message", &v.type);
    if (rc)
        return rc;
    if (v.type < 1 || v.type > UCCL_MSG_TYPE_MAX)
        return uccl__err(UCCL_ERR_PROTO, "control message: unknown type %u", v.type);
    v.seq = get64(in + 8);
    v.len = get64(in + 16);
    v.addr = get64(in + 24);
    v.window = get64(in + 32);
    v.token = get64(in + 40);
    v.offset = get64(in + 48);
    v.aux = get64(in + 56);
    /* Lengths are checked against the local buffer by the handler, which alone
     * knows it; here only what is absurd on its face. */
    if (v.len > (1ull << 48) || v.offset > (1ull << 48))
        return uccl__err(UCCL_ERR_PROTO, "control message: length %llu / offset %llu "
                         "out of range", (unsigned long long)v.len,
                         (unsigned long long)v.offset);
    *m = v;
    return UCCL_OK;
}

/* ---- data chunk header ------------------------------------------------------ */
#define UCCL_CHUNK_MAGIC 0x4B434355u /* "UCCK" */
void uccl__chunk_encode(const struct uccl__chunk_hdr *c, uint8_t out[UCCL_CHUNK_HDR_SIZE])
{
    put_head(out, UCCL_CHUNK_MAGIC, c->kind);
    put64(out + 8, c->id);
    put64(out + 16, c->offset);
    put64(out + 24, c->len);
}

int uccl__chunk_decode(const uint8_t in[UCCL_CHUNK_HDR_SIZE], uint64_t max_len,
                       struct uccl__chunk_hdr *c)
{
    struct uccl__chunk_hdr v;
    int rc = check_head(in, UCCL_CHUNK_MAGIC, "data chunk", &v.kind);
    if (rc)
        return rc;
    if (v.kind < UCCL_DATA_SEND || v.kind > UCCL_DATA_READ)
        return uccl__err(UCCL_ERR_PROTO, "data chunk: unknown kind %u", v.kind);
    v.id = get64(in + 8);
    v.offset = get64(in + 16);
    v.len = get64(in + 24);
    if (v.len == 0 || v.len > max_len)
        return uccl__err(UCCL_ERR_PROTO, "data chunk: length %llu outside 1..%llu",
                         (unsigned long long)v.len, (unsigned long long)max_len);
    *c = v;
    return UCCL_OK;
}

/* ---- fifo item --------------------------------------------------------------- */
#define UCCL_FIFO_MAGIC 0x49464355u /* "UCFI" */
void uccl__fifo_encode(const struct uccl__fifo_item *f, uint8_t out[UCCL_FIFO_ITEM_SIZE])
{
    memset(out, 0, UCCL_FIFO_ITEM_SIZE);
    put_head(out, UCCL_FIFO_MAGIC, 0);
    put64(out + 8, f->window);
    put64(out + 16, f->token);
    put64(out + 24, f->addr);
    put64(out + 32, f->len);
    put64(out + 40, f->base);
}

void uccl_fifo_make(uint64_t window, uint64_t token, uint64_t addr, uint64_t len, uint64_t base,
                    uint8_t out[UCCL_FIFO_ITEM_SIZE])
{
    struct uccl__fifo_item f = {.window = window, .token = token, .addr = addr, .len = len,
                                .base = base};
    uccl__fifo_encode(&f, out);
}

int uccl_fifo_read(const uint8_t *in, size_t in_len, uint64_t fields[5])
{
    struct uccl__fifo_item f;
    int rc = uccl__fifo_decode(in, in_len, &f);
    if (rc == UCCL_OK) {
        fields[0] = f.window, fields[1] = f.token, fields[2] = f.addr, fields[3] = f.len;
        fields[4] = f.base;
    }
    return rc;
}

int uccl__fifo_decode(const uint8_t *in, size_t in_len, struct uccl__fifo_item *f)
{
    uint16_t type;
    if (in_len != UCCL_FIFO_ITEM_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "fifo_item must be %d bytes, got %zu",
                         UCCL_FIFO_ITEM_SIZE, in_len);
    int rc = check_head(in, UCCL_FIFO_MAGIC, "fifo_item", &type);
    if (rc)
        return uccl__err(UCCL_ERR_INVALID, "%s", uccl_last_error());
    f->window = get64(in + 8);
    f->token = get64(in + 16);
    f->addr = get64(in + 24);
    f->len = get64(in + 32);
    f->base = get64(in + 40);
    if (f->base && (f->addr < f->base || f->addr - f->base > UINT64_MAX - f->len))
        return uccl__err(UCCL_ERR_INVALID, "fifo_item: [%#llx, +%llu) does not lie past its "
                         "window's start %#llx", (unsigned long long)f->addr,
                         (unsigned long long)f->len, (unsigned long long)f->base);
    return UCCL_OK;
}

/* ---- metadata ------------------------------------------------------------------ */
#define UCCL_META_MAGIC 0x444D4355u /* "UCMD" */
/* The secret's length (16 bits) and the secret, which ends the record: a
 * longest secret (64 bytes) fills it to its last byte. */
enum { M_SECLEN = 126, M_SECRET = 128 };
_Static_assert(M_SECRET + UCCL_SECRET_MAX == UCCL_META_SIZE, "the secret fits the metadata");
void uccl__meta_encode(const struct uccl__meta *m, uint8_t out[UCCL_META_SIZE])
{
    memset(out, 0, UCCL_META_SIZE);
    put_head(out, UCCL_META_MAGIC, 0);
    put_str(out + 8, m->ip, 46);
    put32(out + 54, m->port);
    put32(out + 58, (uint32_t)m->gpu_idx);
    put_str(out + 62, m->host_id, UCCL_HOSTID_MAX);
    put16(out + M_SECLEN, (uint16_t)m->secret_len);
    memcpy(out + M_SECRET, m->secret, m->secret_len <= UCCL_SECRET_MAX ? m->secret_len : 0);
}

int uccl__meta_encode_upstream(const struct uccl__meta *m, uint8_t out[UCCL_META_UPSTREAM_SIZE])
{
    if (inet_pton(AF_INET, m->ip, out) != 1)
        return uccl__err(UCCL_ERR_INVALID, "address '%s' is not IPv4", m->ip);
    out[4] = (uint8_t)(m->port >> 8);
    out[5] = (uint8_t)m->port;
    memcpy(out + 6, &m->gpu_idx, 4); /* native order, as upstream's struct "i" */
    return UCCL_OK;
}

int uccl__meta_decode(const uint8_t *in, size_t in_len, struct uccl__meta *m)
{
    uint16_t type;
    if (in_len == UCCL_META_UPSTREAM_SIZE) {
        memset(m, 0, sizeof(*m));
        inet_ntop(AF_INET, in, m->ip, sizeof(m->ip));
        m->port = (uint32_t)in[4] << 8 | in[5];
        memcpy(&m->gpu_idx, in + 6, 4);
        if (m->port == 0)
            return uccl__err(UCCL_ERR_INVALID, "endpoint metadata (10 bytes): port 0");
        return UCCL_OK;
    }
    if (in_len == 22)
        return uccl__err(UCCL_ERR_INVALID, "endpoint metadata of 22 bytes is upstream's IPv6 "
                         "form; this engine connects over IPv4 only");
    if (in_len != UCCL_META_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "endpoint metadata must be %d bytes (or upstream's "
                         "%d), got %zu", UCCL_META_SIZE, UCCL_META_UPSTREAM_SIZE, in_len);
    if (check_head(in, UCCL_META_MAGIC, "endpoint metadata", &type))
        return uccl__err(UCCL_ERR_INVALID, "%s", uccl_last_error());
    memset(m, 0, sizeof(*m));
    get_str(m->ip, in + 8, 46);
    m->port = get32(in + 54);
    m->gpu_idx = (int32_t)get32(in + 58);
    get_str(m->host_id, in + 62, UCCL_HOSTID_MAX);
    m->secret_len = get16(in + M_SECLEN);
    if (m->port == 0 || m->port > 65535 || m->secret_len > UCCL_SECRET_MAX)
        return uccl__err(UCCL_ERR_INVALID, "endpoint metadata: bad port %u or secret "
                         "length %u", m->port, m->secret_len);
    memcpy(m->secret, in + M_SECRET, m->secret_len);
    return UCCL_OK;
}
