/* A connection as the transport layer sees it: this side (the local
 * side, what an endpoint lends each of its connections) and one link (one
 * connection's peer, the handshake's terms, its transport and what that
 * transport decided).
 *
 * The endpoint (engine.c) owns the local side and outlives its
 * connections.  The connection layer embeds a link in each connection
 * (conn.h) and fills it with the endpoint; the transports and the
 * handshake (handshake.c) read it, and write only the fields marked so.
 * That is all they see of a connection: `conn` is an opaque handle,
 * passed back only to the upcalls (transport.h).  The layers below the
 * endpoint read their settings and this side's identity in the local side
 * and reach the shared resources (the memory regions, the copy helpers)
 * through it, so none of them needs the endpoint itself. */
#ifndef UCCL_LINK_H
#define UCCL_LINK_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/pool.h"
#include "mem/mem.h"
#include "net/wire.h"

struct uccl__local {
    /* identity: sent in every handshake (handshake.c) */
    char host_id[UCCL_HOSTID_MAX];   /* equal ids may use same-host transports */
    int gpu_idx;
    int rank;                        /* -1: none */
    int port;                        /* the endpoint's listening port */
    int forced_tp;                   /* UCCL_TP_AUTO unless UCCL_P2P_TRANSPORT says */
    uint8_t secret[UCCL_SECRET_MAX]; /* what a connecting peer must prove it holds */
    uint32_t secret_len;

    /* settings (from the environment, at endpoint creation) */
    uint64_t timeout_ns;
    uint64_t spin_ns;                /* how long a waiter drives its connection before sleeping */
    unsigned num_streams;            /* TCP data streams per connection */
    size_t chunk_bytes;              /* TCP chunk size */
    int shm_mode;                    /* -1 auto, 0 CMA, 1 ring (UCCL_P2P_SHM_MODE) */

    /* shared resources */
    struct uccl__mem mem;            /* registered regions and advertised windows */
    struct uccl__pool_lazy copy_pool; /* helpers splitting large copies */
};

struct uccl__conn;                   /* opaque here */
struct uccl__tp_ops;

struct uccl__link {
    struct uccl__conn *conn;         /* what the upcalls take */
    struct uccl__local *local;       /* this side */
    int is_connector;                /* connector sends/reads/writes, acceptor receives */

    /* the peer: as the endpoint dialed it, then as its handshake said */
    char peer_ip[46];
    int peer_port, peer_gpu, peer_rank;
    uint32_t peer_pid;
    int peer_pid_ok;                 /* peer_pid holds the other end of the control socket
                                        (net/sock_owner.h): only then may CMA reach it */
    char peer_host[UCCL_HOSTID_MAX];

    /* the handshake's terms */
    uint64_t token;                  /* names the connection on its extra streams */
    uint8_t secret[UCCL_SECRET_MAX]; /* connector: the secret its first handshake proves */
    uint32_t secret_len;
    uint8_t conn_key[32];            /* from the first handshake: extra streams prove it */
    volatile uint64_t probe_word;    /* CMA probe: the peer reads this (handshake.h) */
    uint32_t ptracer_pid;            /* a Yama grant this connection holds (base/ptracer.h),
                                        released with its last reference */
    unsigned num_streams;            /* extra streams (a transport may change it at setup) */
    size_t chunk_bytes;

    /* the transport, and what it decided at setup (written by it) */
    const struct uccl__tp_ops *tp;
    void *tp_priv;                   /* the transport's own state */
    int direct;                      /* moves bytes with pull/push (else streams) */
    int ctrl_shm;                    /* control messages use tp->ctrl_send/recv */

    /* Set once, by the connection layer, when the connection fails: the
     * transport's threads and movers stop. */
    atomic_int failed;
};

#endif
