/* The one contract every transport meets.
 *
 * A connection is set up by the endpoint over its control socket
 * (handshake.c: secret, host identity); the transport then adds what it
 * needs (TCP data streams, a shared-memory segment, RDMA queue pairs).  The two-sided and one-sided protocol (rendezvous,
 * size checks, advertised windows) lives in proto.c and is the same for
 * every transport; a transport only moves bytes, in one of two ways:
 *
 *  - direct: the local process copies straight from/to the peer's memory
 *    given its address (CMA process_vm_readv/writev; a copy-engine copy from
 *    or into a CUDA IPC mapping; RDMA READ/WRITE with the key carried in
 *    `key`).
 *  - stream: the bytes travel tagged (kind, id, offset) and the peer's
 *    engine asks the protocol where each chunk may land (uccl__conn_rx_begin,
 *    below), which checks it against what that side posted or advertised.
 *
 * A transport sees a connection only as its link (link.h): this side's
 * settings and identity, the peer, the handshake's terms, its own state
 * (tp_priv) and what it decided at setup (direct, ctrl_shm); every op on
 * a connection takes the link (the process-wide ones, available, mem_reg,
 * mem_dereg, key_on_gpu and staged, take none).  Calls go one way, down: the protocol calls the ops; a
 * transport calls back into the connection layer only through the upcalls
 * declared at the end of this file (where stream bytes land, that they
 * left, that the connection failed, a control message to send), which take
 * the link's opaque handle lk->conn, and into its own layer and those below
 * (handshake.c, pool.c, sock.c, wire.c, mem.c, gpu.h).
 *
 * Adding a transport = one new tp_<name>.c exporting a const ops table, and
 * one line in the registry (transport.c).
 *
 * GPU memory rides the same two ways.  tp_shm.c, when CMA works, is direct
 * for it too: the key of device memory is the address of its export record
 * (gpu.h), which the peer reads and maps (CUDA IPC, cached), then copies on
 * its copy engine; host memory on the other side is reached by the side that
 * owns it (pull, or push into GPU memory).  Streaming transports stage GPU
 * memory through page-locked buffers.  The RDMA transport maps like this:
 *  - tp_rdma.c (libibverbs via ibv_loader.c): the acceptor asks for one
 *    extra socket, over which both sides exchange QP numbers and GIDs once;
 *    mem_reg is ibv_reg_mr on every NIC (tp_key: the MRs, mem_key: their
 *    rkeys); with source_writes the sender WRITEs into the receiver's
 *    advertised buffer (last chunk WRITE_WITH_IMM), a read posts an RDMA
 *    READ; control messages stay on the control socket.  GPU memory no NIC
 *    can register is staged by its own side: its own moves through a
 *    page-locked chunk, and what the peer must reach streamed (`staged`)
 *    through a page-locked ring the receiving side lends (tp_rdma_stage.c).
 */
#ifndef UCCL_TRANSPORT_H
#define UCCL_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "mem/mem.h"
#include "net/wire.h"
#include "tp/link.h"

struct uccl__conn;
struct uccl__req;

/* Eager messages (the protocol's, conn.h): at most UCCL_EAGER_MAX bytes
 * each, at most UCCL_EAGER_INFLIGHT unanswered per sender; a transport
 * with eager slots (below) has this many of this size. */
#define UCCL_EAGER_MAX (64u << 10)
#define UCCL_EAGER_INFLIGHT 16

struct uccl__tp_ops {
    const char *name;
    int id; /* UCCL_TP_* */
    /* Direct transports: 1 where the side holding the source always moves
     * the bytes (RDMA: the destination advertises its buffer and key, the
     * source WRITEs into it), so a receiver never pulls; reads still pull. */
    int source_writes;

    /* Usable in this process at all (libraries loaded, kernel support)?
     * Never blocks.  On UCCL_ERR_UNAVAIL the message says why. */
    int (*available)(void);

    /* Acceptor, on HELLO_CONN: check the peer's fields, set up local state
     * and fill the ACK.  Bounded by the handshake deadline. */
    int (*conn_accept)(struct uccl__link *lk, const struct uccl__hello *peer,
                       struct uccl__hello *ack);

    /* Connector, after a positive ACK: finish local state (map a segment,
     * open extra streams).  May block until deadline_ns. */
    int (*conn_connected)(struct uccl__link *lk, const struct uccl__hello *ack,
                          uint64_t deadline_ns);

    /* Acceptor: how many HELLO_STREAM sockets complete this connection, and
     * take one of them (the engine has checked token and secret). */
    unsigned (*streams_needed)(const struct uccl__link *lk);
    int (*add_stream)(struct uccl__link *lk, int fd, unsigned index);

    /* Start the transport's threads.  Never blocks. */
    int (*conn_start)(struct uccl__link *lk);

    /* Memory registration, per endpoint (its region table, mem.h) and
     * region (NULL: nothing to do): RDMA registers with the device
     * (ibv_reg_mr), CUDA IPC exports a handle.  What it makes lives in
     * mr->tp_key[id] (an lkey, say) and mr->tp_priv[id].  The regions call
     * them through uccl__tp_mem_hooks (below): mem_reg at reg() for every
     * transport available in this process, mem_dereg once no peer can
     * reach the region any more (dereg(), or its last hold). */
    int (*mem_reg)(struct uccl__mem *mem, struct uccl__mr *mr);
    void (*mem_dereg)(struct uccl__mem *mem, struct uccl__mr *mr);

    /* What a peer needs besides the address to reach addr, inside region
     * mr, over lk (an rkey; the address of a GPU export record); 0 where the
     * address is enough (CMA).  It travels with the address in RTS, CTS,
     * WREQ, RREQ or GO.  Called under the regions' lock (uccl__tp_mem_keys),
     * or with the region held from dereg() (a window's target, proto.c);
     * never blocks.  An error (memory that cannot be shared with this peer)
     * fails the transfer. */
    int (*mem_key)(struct uccl__link *lk, const struct uccl__mr *mr, uintptr_t addr,
                   uint64_t *key_p);

    /* Direct transports: is the peer's memory behind a key it sent (its
     * mem_key) on a GPU?  The destination side pulls unless the source is
     * host memory and the destination GPU memory (CUDA IPC maps device
     * memory only): then the source side pushes.  NULL: the peer's memory
     * is always reachable by pull. */
    int (*key_on_gpu)(uint64_t peer_key);

    /* Direct transports that can also stream (RDMA): is the local memory
     * behind local_key (mr->tp_key) out of the peer's reach (GPU memory no
     * NIC could register)?  Then the bytes bound for it, and a read of it,
     * stream on the direct connection (stream, with on_msg carrying the
     * chunks' messages), asked for by UCCL_MSG_FLAG_STREAM in the CTS or
     * GO.  NULL: never. */
    int (*staged)(uint64_t local_key);

    /* Direct mover (NULL, or the connection's `direct` flag clear, when the
     * transport streams): copy len bytes from the peer's remote_addr (with its
     * remote_key) into dst (whose region has local_key).  The destination
     * pulls, except where the transport has source_writes (RDMA: the
     * source WRITEs into the destination's advertised buffer) and where the
     * destination is GPU memory the source must push into (push, below);
     * an RDMA transport posts a READ and polls its completion here.  Blocking;
     * runs on the connection's worker thread or a caller driving it. */
    int (*pull)(struct uccl__link *lk, void *dst, uint64_t local_key, uint64_t remote_addr,
                uint64_t remote_key, size_t len);
    /* ... and the other way, where the destination cannot pull (key_on_gpu):
     * copy len bytes of src (with its local_key) to the peer's remote_addr. */
    int (*push)(struct uccl__link *lk, const void *src, uint64_t local_key, uint64_t remote_addr,
                uint64_t remote_key, size_t len);

    /* Stream mover (also, on a direct transport with `staged`, for the
     * transfers that stream): queue len > 0 bytes for the peer, tagged (kind, id).
     * Never blocks; calls uccl__conn_tx_done(lk->conn, cookie, status) once
     * the bytes have left the buffer.  `cookie` is a struct uccl__req *.
     * src_key is src's local key: GPU memory (gpu.h) is staged through
     * page-locked buffers, as is GPU memory that rx_begin hands out. */
    int (*stream)(struct uccl__link *lk, int kind, uint64_t id, const void *src, uint64_t src_key,
                  size_t len, void *cookie);

    /* Optional control channel replacing the control socket for messages
     * (same host: queues in shared memory, no system call per message).  The
     * socket then only tells that the peer is gone.  ctrl_send: one message,
     * waiting for room until deadline_ns; the caller holds the connection's
     * writer lock (one sender at a time).
     * ctrl_recv: 1 if a message was read, 0 if none (only the connection's
     * current reader calls it).  ctrl_wait: sleep until a message may be
     * there, or timeout_ms. */
    int (*ctrl_send)(struct uccl__link *lk, const uint8_t *msg, uint64_t deadline_ns);
    int (*ctrl_recv)(struct uccl__link *lk, uint8_t *msg);
    void (*ctrl_wait)(struct uccl__link *lk, int timeout_ms);
    /* A caller starts (on=1) or stops driving: while one drives, producers
     * need not wake the service thread, which saves a wake-up per message. */
    void (*ctrl_driving)(struct uccl__link *lk, int on);

    /* Optional eager slots (same host): UCCL_EAGER_INFLIGHT slots of
     * UCCL_EAGER_MAX bytes in shared memory, connector -> acceptor.  Returns
     * slot `idx` of this side's outgoing (connector) or incoming (acceptor)
     * area, or NULL if the transport has none. */
    char *(*eager_slot)(struct uccl__link *lk, unsigned idx);

    /* A control message of a type the protocol does not know (UCCL_MSG_DATA /
     * UCCL_MSG_CREDIT for the shared-memory ring).  Runs on the connection's
     * reader: its service thread, or a caller driving the connection; must
     * not wait for the peer. */
    int (*on_msg)(struct uccl__link *lk, const struct uccl__msg *m);

    /* Unblock every thread of the transport (failure or close).  Idempotent,
     * callable from any thread, never blocks. */
    void (*conn_shutdown)(struct uccl__link *lk);

    /* Join the transport's threads and release its resources (sockets,
     * mappings).  Idempotent; never called from the transport's threads. */
    void (*conn_destroy)(struct uccl__link *lk);

    /* Free what conn_destroy left (called with the last reference). */
    void (*conn_free)(struct uccl__link *lk);
};

extern const struct uccl__tp_ops uccl__tp_tcp;
extern const struct uccl__tp_ops uccl__tp_shm;
extern const struct uccl__tp_ops uccl__tp_rdma;

/* The registry (transport.c): transports by wire id (UCCL_TP_*), NULL where
 * this build has none; and the names UCCL_P2P_TRANSPORT takes. */
extern const struct uccl__tp_ops *const uccl__tp_registry[UCCL_TP_COUNT];
extern const char *const uccl__tp_names[UCCL_TP_COUNT];

/* What the memory regions (mem.h) ask of the transports, through the
 * registry: the hooks an endpoint gives its regions at init (registration
 * with every transport available here, undone when the region goes), and
 * a region's keys for the transport of one link (uccl__mem_keys, asking
 * that transport's mem_key under the regions' lock). */
extern const struct uccl__mem_hooks uccl__tp_mem_hooks;
int uccl__tp_mem_keys(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len,
                      struct uccl__link *lk, uint64_t *local_key_p, uint64_t *peer_key_p,
                      uint32_t *mkind_p);

/* ---- upcalls: what a transport may call in the connection layer ----------
 *
 * Each takes the opaque connection of a link (lk->conn).  conn.c has
 * send_msg and fail, proto_stream.c the rest.
 *
 * Stream receive path, for each arriving chunk: rx_begin validates (kind,
 * id, offset, len) against what this side posted or advertised and returns
 * where the bytes go, holding the request busy; rx_end accounts them;
 * rx_abort lets go of a chunk that could not be received (the connection is
 * failing). */
int uccl__conn_rx_begin(struct uccl__conn *c, int kind, uint64_t id, uint64_t offset,
                        uint64_t len, char **dst_p, uint64_t *dst_key_p,
                        struct uccl__req **req_p);
void uccl__conn_rx_end(struct uccl__conn *c, struct uccl__req *r, uint64_t len);
void uccl__conn_rx_abort(struct uccl__conn *c, struct uccl__req *r);
/* Stream send path: the bytes queued with `cookie` have left the buffer. */
void uccl__conn_tx_done(struct uccl__conn *c, void *cookie, int status);
/* A control message to the peer (the shared-memory ring's DATA/CREDIT). */
int uccl__conn_send_msg(struct uccl__conn *c, const struct uccl__msg *m);
/* The connection cannot go on: fail everything pending on it. */
void uccl__conn_fail(struct uccl__conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
