/* Everything that crosses a socket: fixed-size little-endian records with a
 * magic and a version.  Encoders write into a byte array; every decoder
 * validates what a peer sent (magic, version, type, every length) and fails
 * with UCCL_ERR_PROTO and a message naming the bad field. */
#ifndef UCCL_WIRE_H
#define UCCL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define UCCL_WIRE_MAGIC    0x4C434355u /* "UCCL" */
#define UCCL_WIRE_VERSION  1
#define UCCL_SECRET_MAX    64
#define UCCL_HOSTID_MAX    64
#define UCCL_SHMNAME_MAX   48
#define UCCL_MAX_STREAMS   16

/* ---- handshake ----------------------------------------------------------
 * Every socket a connection uses starts with four records of 256 bytes
 * (tp/handshake.h tells why in this order):
 *   connector: INIT (its nonce; for an extra socket, the connection's token)
 *   acceptor:  CHALLENGE (its nonce, its identity sealed, its proof)
 *   connector: HELLO (its terms and identity, its proof)
 *   acceptor:  ACK (its terms, its proof), or at any step REFUSE (a status,
 *              nothing else).
 * The handshake's records have their own version: every other record
 * (control messages, chunks, descriptors, metadata) travels only between
 * ends that agreed on this one. */
#define UCCL_HELLO_VERSION 2 /* 1: the secret in clear, one round trip */
enum {
    UCCL_HS_CONN = 1,      /* INIT of a new connection (its control socket) */
    UCCL_HS_STREAM = 2,    /* INIT of one more socket of a connection (data stream, setup) */
    UCCL_HS_CHALLENGE = 3,
    UCCL_HS_HELLO = 4,
    UCCL_HS_ACK = 5,
    UCCL_HS_REFUSE = 6,
};

enum { UCCL_TP_AUTO = 0, UCCL_TP_TCP = 1, UCCL_TP_SHM = 2, UCCL_TP_IPC = 3, UCCL_TP_RDMA = 4,
       UCCL_TP_COUNT = 5 };

#define UCCL_HELLO_SIZE 256
#define UCCL_NONCE_BYTES 32
#define UCCL_MAC_BYTES 32
/* The bytes of a CHALLENGE that are sealed (the acceptor's identity): all
 * between the nonce and the proof. */
#define UCCL_HELLO_SEAL_OFF 40
#define UCCL_HELLO_SEAL_END 224
#define UCCL_HELLO_MAC_OFF 224
struct uccl__hello {
    uint16_t type;
    uint8_t nonce[UCCL_NONCE_BYTES];   /* INIT: the connector's; CHALLENGE: the acceptor's */
    uint64_t conn_token;                /* INIT of a stream, HELLO: names the connection */
    int32_t status;                     /* ACK: UCCL_OK; REFUSE: the reason */
    uint32_t pid;                       /* CHALLENGE (sealed), HELLO: the sender's process */
    int32_t gpu_idx;
    int32_t rank;
    uint32_t transport;                 /* requested (HELLO) or chosen (ACK) */
    uint32_t shm_mode;                  /* tp_shm: 0 = CMA, 1 = shared-memory ring */
    uint32_t num_streams;               /* tp_tcp data streams, 1..UCCL_MAX_STREAMS */
    uint32_t stream_index;
    uint32_t listen_port;
    uint32_t caps;                      /* HELLO of a connection: UCCL_CAP_* of the connector */
    uint64_t chunk_bytes;               /* tp_tcp chunk size, 4 KiB .. 64 MiB */
    uint64_t probe_addr;                /* CMA probe: where the sender's probe word is */
    char host_id[UCCL_HOSTID_MAX];      /* CHALLENGE (sealed), HELLO, ACK; NUL-terminated */
    char shm_name[UCCL_SHMNAME_MAX];    /* ACK: tp_shm ring segment (44 bytes on the wire) */
    uint8_t mac[UCCL_MAC_BYTES];        /* CHALLENGE, HELLO, ACK: the sender's proof */
};
#define UCCL_CAP_RDMA 1u                /* an RDMA device is usable here */
#define UCCL_CAP_CMA 2u                 /* the connector found the acceptor's pid holding the
                                           socket's other end: CMA may go both ways */
void uccl__hello_encode(const struct uccl__hello *h, uint8_t out[UCCL_HELLO_SIZE]);
/* Checks the head (magic, version: an older peer's record is refused with
 * both versions named), the type, and every field the type uses. */
int uccl__hello_decode(const uint8_t in[UCCL_HELLO_SIZE], struct uccl__hello *h);

/* ---- control messages (one connection, both directions) ------------------ */
enum {
    UCCL_MSG_RTS = 1,     /* sender: message seq of len bytes at addr is ready */
    UCCL_MSG_CTS = 2,     /* receiver: sizes match, push the bytes (direct: into addr,
                             with the key in token) */
    UCCL_MSG_NACK = 3,    /* receiver: sizes differ (len = receiver's size) */
    UCCL_MSG_FIN = 4,     /* receiver: pulled the message, sender may complete */
    UCCL_MSG_WREQ = 5,    /* initiator: write len bytes into window at offset */
    UCCL_MSG_RREQ = 6,    /* initiator: read len bytes of window at offset */
    UCCL_MSG_GO = 7,      /* target: write accepted, push the bytes; or (direct
                             read) pull len bytes from addr, then RDONE */
    UCCL_MSG_OPDONE = 8,  /* target: one-sided op finished (aux = status) */
    UCCL_MSG_DATA = 9,    /* shm ring, RDMA staging ring: a chunk sits in slot aux */
    UCCL_MSG_CREDIT = 10, /* shm ring: slot aux is free again (RDMA: slot aux of the
                             staging ring, at addr, len bytes, rkeys in window) */
    UCCL_MSG_BYE = 11,    /* either side: closing on purpose (not a crash) */
    UCCL_MSG_RDONE = 12,  /* initiator: finished with the target's window (pulled a
                             read, or pushed a write): the target may let go */
    UCCL_MSG_PDONE = 13,  /* sender: pushed message seq into the receiver's buffer
                             (after a CTS with its address; aux = status) */
    UCCL_MSG_RING = 14,   /* RDMA: lend me your staging ring, for transfer seq of
                             kind token (answered by a CREDIT per slot) */
    UCCL_MSG_TYPE_MAX = 14,
};

#define UCCL_MSG_SIZE 64
/* Field use by type, where not obvious: the peer's key for a direct copy
 * (tp->mem_key) rides in `window` for RTS, in `aux` for WREQ and RREQ, in
 * `token` for GO and CTS; those fields are otherwise unused by those types. */
struct uccl__msg {
    uint16_t type;
    uint64_t seq;     /* message sequence number or one-sided op id */
    uint64_t len;
    uint64_t addr;    /* a local address of the sender of this message (CMA) */
    uint64_t window;  /* advertised window id */
    uint64_t token;   /* advertised window token */
    uint64_t offset;  /* byte offset (window or chunk) */
    uint64_t aux;     /* status, slot, data kind */
};
void uccl__msg_encode(const struct uccl__msg *m, uint8_t out[UCCL_MSG_SIZE]);
int uccl__msg_decode(const uint8_t in[UCCL_MSG_SIZE], struct uccl__msg *m);

/* ---- data chunk header (tp_tcp data streams) ----------------------------- */
enum { UCCL_DATA_SEND = 1, UCCL_DATA_WRITE = 2, UCCL_DATA_READ = 3 };
#define UCCL_CHUNK_HDR_SIZE 32
struct uccl__chunk_hdr {
    uint16_t kind;
    uint64_t id, offset, len;
};
void uccl__chunk_encode(const struct uccl__chunk_hdr *c, uint8_t out[UCCL_CHUNK_HDR_SIZE]);
int uccl__chunk_decode(const uint8_t in[UCCL_CHUNK_HDR_SIZE], uint64_t max_len,
                       struct uccl__chunk_hdr *c);

/* ---- one-sided descriptor ("fifo item") handed out by advertise() -------- */
#define UCCL_FIFO_ITEM_SIZE 64
struct uccl__fifo_item {
    uint64_t window, token, addr, len;
    /* Where the window starts when [addr, +len) is a part of it (a range
     * inside a registration that register_memory() shares); 0: at addr.
     * The owner checks offset addr - base against the window it made. */
    uint64_t base;
};
void uccl__fifo_encode(const struct uccl__fifo_item *f, uint8_t out[UCCL_FIFO_ITEM_SIZE]);
int uccl__fifo_decode(const uint8_t *in, size_t in_len, struct uccl__fifo_item *f);
/* Where [addr, +len) starts inside the window (decode checked it). */
static inline uint64_t uccl__fifo_offset(const struct uccl__fifo_item *f)
{
    return f->base ? f->addr - f->base : 0;
}
/* Public (ep/uccl.h includes this header): one-sided descriptors (the 64
 * bytes advertise() returns) made from and read into their fields, so a
 * caller can describe a range inside a window (base: where the window
 * starts; 0 when addr is its start). */
void uccl_fifo_make(uint64_t window, uint64_t token, uint64_t addr, uint64_t len, uint64_t base,
                    uint8_t out[UCCL_FIFO_ITEM_SIZE]);
int uccl_fifo_read(const uint8_t *in, size_t in_len, uint64_t fields[5]);

/* ---- endpoint metadata (get_metadata / parse_metadata) ------------------- */
#define UCCL_META_SIZE 192
struct uccl__meta {
    char ip[46];
    uint32_t port;
    int32_t gpu_idx;
    char host_id[UCCL_HOSTID_MAX];
    uint32_t secret_len;
    uint8_t secret[UCCL_SECRET_MAX];
};
void uccl__meta_encode(const struct uccl__meta *m, uint8_t out[UCCL_META_SIZE]);
/* Upstream UCCL's form, which its scripts parse themselves: IPv4 address (4
 * bytes), port (2, network order), GPU index (int32, native order); no host
 * id (the handshake carries it) and no secret.  Fails unless ip is IPv4. */
#define UCCL_META_UPSTREAM_SIZE 10
int uccl__meta_encode_upstream(const struct uccl__meta *m, uint8_t out[UCCL_META_UPSTREAM_SIZE]);
/* Either form (upstream's IPv6 form, 22 bytes, is refused with the reason). */
int uccl__meta_decode(const uint8_t *in, size_t in_len, struct uccl__meta *m);

#endif
