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

static void put_head(uint8_t *p, uint32_t magic, uint16_t type)
{
    put32(p, magic);
    put16(p + 4, UCCL_WIRE_VERSION);
    put16(p + 6, type);
}

static int check_head(const uint8_t *p, uint32_t magic, const char *what, uint16_t *type_p)
{
    if (get32(p) != magic)
        return uccl__err(UCCL_ERR_PROTO, "%s: bad magic 0x%08x (expected 0x%08x)", what,
                         get32(p), magic);
    if (get16(p + 4) != UCCL_WIRE_VERSION)
        return uccl__err(UCCL_ERR_PROTO, "%s: wire version %u, this build speaks %u", what,
                         get16(p + 4), UCCL_WIRE_VERSION);
    *type_p = get16(p + 6);
    return UCCL_OK;
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

/* ---- hello --------------------------------------------------------------- */
enum {
    H_SECLEN = 8, H_SECRET = 12, H_HOST = 76, H_PID = 140, H_GPU = 144, H_RANK = 148,
    H_TP = 152, H_SHMMODE = 156, H_NSTREAMS = 160, H_SIDX = 164, H_TOKEN = 168,
    H_PADDR = 176, H_PCOOKIE = 184, H_STATUS = 192, H_LPORT = 196, H_CHUNK = 200,
    H_SHMNAME = 208, H_CAPS = 252, /* .. 256 */
};

void uccl__hello_encode(const struct uccl__hello *h, uint8_t out[UCCL_HELLO_SIZE])
{
    memset(out, 0, UCCL_HELLO_SIZE);
    put_head(out, UCCL_WIRE_MAGIC, h->type);
    put32(out + H_SECLEN, h->secret_len);
    memcpy(out + H_SECRET, h->secret, h->secret_len <= UCCL_SECRET_MAX ? h->secret_len : 0);
    put_str(out + H_HOST, h->host_id, UCCL_HOSTID_MAX);
    put32(out + H_PID, h->pid);
    put32(out + H_GPU, (uint32_t)h->gpu_idx);
    put32(out + H_RANK, (uint32_t)h->rank);
    put32(out + H_TP, h->transport);
    put32(out + H_SHMMODE, h->shm_mode);
    put32(out + H_NSTREAMS, h->num_streams);
    put32(out + H_SIDX, h->stream_index);
    put64(out + H_TOKEN, h->conn_token);
    put64(out + H_PADDR, h->probe_addr);
    put64(out + H_PCOOKIE, h->probe_cookie);
    put32(out + H_STATUS, (uint32_t)h->status);
    put32(out + H_LPORT, h->listen_port);
    put64(out + H_CHUNK, h->chunk_bytes);
    put_str(out + H_SHMNAME, h->shm_name, H_CAPS - H_SHMNAME);
    put32(out + H_CAPS, h->caps);
}

int uccl__hello_decode(const uint8_t in[UCCL_HELLO_SIZE], struct uccl__hello *h)
{
    struct uccl__hello v;
    memset(&v, 0, sizeof(v));
    int rc = check_head(in, UCCL_WIRE_MAGIC, "handshake", &v.type);
    if (rc)
        return rc;
    if (v.type < UCCL_HELLO_CONN || v.type > UCCL_HELLO_ACK)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown type %u", v.type);
    v.secret_len = get32(in + H_SECLEN);
    if (v.secret_len > UCCL_SECRET_MAX)
        return uccl__err(UCCL_ERR_PROTO, "handshake: secret length %u > %d", v.secret_len,
                         UCCL_SECRET_MAX);
    memcpy(v.secret, in + H_SECRET, v.secret_len);
    get_str(v.host_id, in + H_HOST, UCCL_HOSTID_MAX);
    v.pid = get32(in + H_PID);
    v.gpu_idx = (int32_t)get32(in + H_GPU);
    v.rank = (int32_t)get32(in + H_RANK);
    v.transport = get32(in + H_TP);
    v.shm_mode = get32(in + H_SHMMODE);
    v.num_streams = get32(in + H_NSTREAMS);
    v.stream_index = get32(in + H_SIDX);
    v.conn_token = get64(in + H_TOKEN);
    v.probe_addr = get64(in + H_PADDR);
    v.probe_cookie = get64(in + H_PCOOKIE);
    v.status = (int32_t)get32(in + H_STATUS);
    v.listen_port = get32(in + H_LPORT);
    v.chunk_bytes = get64(in + H_CHUNK);
    get_str(v.shm_name, in + H_SHMNAME, H_CAPS - H_SHMNAME);
    v.caps = get32(in + H_CAPS); /* unknown bits: a newer peer's, ignored */
    if (v.transport >= UCCL_TP_COUNT)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown transport %u", v.transport);
    if (v.shm_mode > 1)
        return uccl__err(UCCL_ERR_PROTO, "handshake: unknown shm mode %u", v.shm_mode);
    if (v.num_streams < 1 || v.num_streams > UCCL_MAX_STREAMS)
        return uccl__err(UCCL_ERR_PROTO, "handshake: %u streams (allowed 1..%d)",
                         v.num_streams, UCCL_MAX_STREAMS);
    if (v.stream_index >= v.num_streams)
        return uccl__err(UCCL_ERR_PROTO, "handshake: stream index %u >= %u streams",
                         v.stream_index, v.num_streams);
    if (v.chunk_bytes < 4096 || v.chunk_bytes > (64u << 20))
        return uccl__err(UCCL_ERR_PROTO, "handshake: chunk size %llu outside 4 KiB..64 MiB",
                         (unsigned long long)v.chunk_bytes);
    for (const char *c = v.shm_name; *c; c++) {
        int ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                 (*c >= '0' && *c <= '9') || *c == '-' || *c == '_' || *c == '.';
        if (!ok || (c == v.shm_name && *c == '.'))
            return uccl__err(UCCL_ERR_PROTO, "handshake: bad shared-memory name");
    }
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
