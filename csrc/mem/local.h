/* This process's side of its connections: what an endpoint lends each one.
 *
 * The endpoint (engine.c) owns it and outlives its connections.  The layers
 * below the endpoint (the protocol, the transports, the handshake) read
 * their settings and this side's identity here and reach the shared
 * resources (the memory regions, the copy helpers) through it, so none of
 * them needs the endpoint itself. */
#ifndef UCCL_LOCAL_H
#define UCCL_LOCAL_H

#include <stddef.h>
#include <stdint.h>

#include "mem/mem.h"
#include "base/pool.h"
#include "net/wire.h"

struct uccl__local {
    /* identity: sent in every handshake (handshake.c) */
    char host_id[UCCL_HOSTID_MAX];   /* equal ids may use same-host transports */
    int gpu_idx;
    int rank;                        /* -1: none */
    int port;                        /* the endpoint's listening port */
    int forced_tp;                   /* UCCL_TP_AUTO unless UCCL_P2P_TRANSPORT says */
    volatile uint64_t probe_word;    /* CMA probe: peers read this to test access */
    uint8_t secret[UCCL_SECRET_MAX]; /* what a connecting peer must present */
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

#endif
