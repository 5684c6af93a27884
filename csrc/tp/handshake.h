/* The handshake on a fresh socket (net/wire.h has its records): a
 * challenge-response in two round trips, which proves the job's secret
 * both ways without sending it, and tells neither side anything about the
 * other before that side proved it.
 *
 *   connector -> INIT       nonce_c (fresh)
 *   acceptor  -> CHALLENGE  nonce_a (fresh), the acceptor's pid and host id
 *                           sealed, and its proof: HMAC(key, INIT|CHALLENGE)
 *   connector -> HELLO      (once the proof checks) its identity and terms,
 *                           its proof: HMAC(key, INIT|CHALLENGE|HELLO)
 *   acceptor  -> ACK        (once that proof checks) its terms, its proof
 *                           over all four; or REFUSE: a status, nothing else
 *
 * key: the secret (empty where the endpoint has none: then anyone can make
 * the proofs, and there is nothing to prove; docs/security.md says what
 * such a peer can do).  Both nonces are fresh, so a recorded handshake
 * replayed gets a new CHALLENGE its proofs do not match.
 *
 * An extra socket of a connection (TCP data stream, the RDMA setup socket)
 * takes one round trip: a STREAM record (the connection's token, the
 * socket's index, a fresh nonce) with HMAC(conn key, record), then the ACK
 * with HMAC(conn key, STREAM|ACK).  The connection's key is
 * HMAC(secret, INIT|CHALLENGE) of its first handshake: fresh, as both
 * nonces are, and never on the wire; the acceptor takes each index of a
 * connection once, and only while the connection waits for its sockets, so
 * a STREAM record replayed is refused.  The
 * seal is an XOR with HMAC(key, nonces, counter): the connector learns the
 * acceptor's pid (to let it ptrace us for CMA, base/ptracer.h, before the
 * acceptor probes) only if it holds the key.
 *
 * Same host (equal host ids): a pid is believed only if that process holds
 * the other end of the socket (net/sock_owner.h); the CMA probe then reads
 * a word the peer set to a value derived from the connection's key (both
 * nonces), never a value or a pid the peer picked.
 *
 * Used by the endpoint (connect; the listener, ep/listen.c, for the
 * acceptor's steps, without blocking) and by transports that open extra
 * sockets (tp_tcp.c's data streams, tp_rdma.c's setup socket). */
#ifndef UCCL_HANDSHAKE_H
#define UCCL_HANDSHAKE_H

#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

struct uccl__link;
struct uccl__local;

#define UCCL_HANDSHAKE_NS (10ull * 1000000000ull) /* a connection's extra sockets arrive in this */
/* A refusal meaning "no room now, try again" (the listener let an idle
 * handshake go for a newer one): the connector dials again. */
#define UCCL_REFUSE_BUSY (-100)

/* Connector: the handshake of lk's connection on fd (type UCCL_HS_CONN, or
 * UCCL_HS_STREAM for extra socket `index`), the peer's ACK into *ack.  A
 * refusal is an error naming the peer and its reason; "busy" dials again
 * (the same fd number) until the deadline. */
int uccl__handshake(struct uccl__link *lk, int fd, int type, unsigned index,
                    uint64_t deadline_ns, struct uccl__hello *ack);

/* Connector: open extra socket `index` of lk's connection (UCCL_HS_STREAM). */
int uccl__open_stream(struct uccl__link *lk, unsigned index, uint64_t deadline_ns, int *fd_p);

/* Connector: open extra socket 0 of lk's connection to set up a transport:
 * out_len bytes go right behind the HELLO (the acceptor's add_stream reads
 * them), and the acceptor's in_len-byte reply comes back before its ACK (so
 * the connection is whole before the acceptor's accept() can return).  The
 * reply must not start with UCCL_WIRE_MAGIC; in_len >= 4. */
int uccl__open_setup_stream(struct uccl__link *lk, uint64_t deadline_ns, const void *out,
                            size_t out_len, void *in, size_t in_len, int *fd_p);

/* ---- the acceptor's steps (the listener runs them without blocking) ---- */
struct uccl__hs {
    uint8_t rec[3][UCCL_HELLO_SIZE]; /* INIT, CHALLENGE, HELLO, as they crossed the wire */
    uint8_t key[UCCL_SECRET_MAX];    /* what the proofs are keyed with */
    uint32_t key_len;
    int type;                        /* UCCL_HS_CONN or UCCL_HS_STREAM */
    uint64_t token;                  /* a stream's connection */
};

/* rec[0] holds the connector's first record: an INIT, or a stream's one
 * record; decode it into *h (type, token into hs). */
int uccl__hs_read_first(struct uccl__hs *hs, struct uccl__hello *h);
/* A stream's record proves its connection's key (UCCL_ERR_AUTH if not). */
int uccl__hs_check_stream(struct uccl__hs *hs, const uint8_t key[32]);
/* rec[1] := the CHALLENGE to an INIT, keyed with the secret, with this
 * side's identity sealed in it. */
void uccl__hs_challenge(struct uccl__hs *hs, const struct uccl__local *loc, const uint8_t *key,
                        size_t key_len);
/* rec[2] holds the connector's reply: check it is a HELLO with a good proof
 * (UCCL_ERR_AUTH if not); decode it into *h; conn_key := the connection's
 * key. */
int uccl__hs_check_hello(struct uccl__hs *hs, struct uccl__hello *h, uint8_t conn_key[32]);
/* Is h->pid, on this host, the process holding the other end of fd (so
 * that CMA may reach it)?  Asked only for a same-host transport. */
int uccl__hs_peer_pid_ok(int fd, const struct uccl__local *loc, const struct uccl__hello *h);
/* Send the ACK: ack's terms, this side's identity, lk's probe word (lk:
 * the new connection, NULL for an extra socket), the proof. */
int uccl__hs_ack(struct uccl__hs *hs, int fd, const struct uccl__local *loc,
                 struct uccl__link *lk, struct uccl__hello *ack);
/* A refusal: the status, nothing else (best effort, never blocks long). */
void uccl__hs_refuse(int fd, int status);

/* The value a side's CMA probe word holds (connector: 1), derived from the
 * connection's key: the reader checks it, and neither side can choose it. */
uint64_t uccl__hs_probe_value(const uint8_t conn_key[32], int connector);

#endif
