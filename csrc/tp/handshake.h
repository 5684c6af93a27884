/* The handshake on a fresh socket: the connector sends a HELLO (a new
 * connection, or one more data stream of one), the acceptor answers with an
 * ACK.  Both carry this side's identity (link.h: the local side); the HELLO
 * carries the connection's terms from its link (token, secret, streams),
 * and the secret, which the acceptor checks in constant time.  Used by the
 * endpoint (connect, and the listener's side) and by transports that open
 * extra sockets (tp_tcp.c's data streams, tp_rdma.c's setup socket). */
#ifndef UCCL_HANDSHAKE_H
#define UCCL_HANDSHAKE_H

#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

struct uccl__link;
struct uccl__local;

#define UCCL_HANDSHAKE_NS (10ull * 1000000000ull) /* a peer gets this long to say hello */

/* Connector: one HELLO of `type` for lk's connection on fd, and the peer's
 * ACK into *ack; a refusal is an error naming the peer and its reason. */
int uccl__handshake(struct uccl__link *lk, int fd, int type, unsigned index,
                    uint64_t deadline_ns, struct uccl__hello *ack);

/* Connector: open extra socket `index` of lk's connection (HELLO_STREAM). */
int uccl__open_stream(struct uccl__link *lk, unsigned index, uint64_t deadline_ns, int *fd_p);

/* Connector: open extra socket 0 of lk's connection to set up a transport:
 * out_len bytes go right behind the HELLO (the acceptor's add_stream reads
 * them), and the acceptor's in_len-byte reply comes back before its ACK (so
 * the connection is whole before the acceptor's accept() can return).  The
 * reply must not start with UCCL_WIRE_MAGIC; in_len >= 4. */
int uccl__open_setup_stream(struct uccl__link *lk, uint64_t deadline_ns, const void *out,
                            size_t out_len, void *in, size_t in_len, int *fd_p);

/* Acceptor: answer with status; ack (NULL: an empty one) gets this side's
 * identity.  Best effort: a peer that does not read it finds out anyway. */
void uccl__send_ack(int fd, const struct uccl__local *loc, int status, struct uccl__hello *ack);

/* Acceptor: does the HELLO carry this side's secret (or is none needed)? */
int uccl__secret_ok(const struct uccl__local *loc, const struct uccl__hello *h);

#endif
