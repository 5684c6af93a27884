/* Public C API of the engine.  Opaque handles; every function returns a
 * status (status.h) and sets its outputs (`_p`) only on success; the reason
 * of an error is in uccl_last_error() on the calling thread. */
#ifndef UCCL_H
#define UCCL_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
/* Parts of this API that the layers below implement, declared there: */
#include "gpu/gpu_api.h" /* GPUs by bus id, host memory for streams, kernels, mapped memory */
#include "net/wire.h"    /* one-sided descriptors made and read (uccl_fifo_make, _read) */

typedef struct uccl__ep uccl_ep_t;

struct uccl_ep_opts {
    int gpu_idx;             /* -1: CPU only */
    int num_cpus;            /* accepted for API compatibility (threads are per connection) */
    double timeout_s;        /* <= 0: UCCL_P2P_TIMEOUT_S or 300 s */
    const char *secret;      /* NULL: UCCL_P2P_SECRET if set, else none */
    size_t secret_len;
    int port;                /* < 0: base port + gpu index, else ephemeral; 0: ephemeral */
    int rank;                /* this endpoint's rank in its job, sent in every handshake; -1: none */
    const char *host_id;     /* NULL: UCCL_P2P_HOST_ID, else the kernel's boot id.  Ends
                                with equal ids may use same-host transports. */
};

enum { UCCL_XFER_SEND = 1, UCCL_XFER_RECV, UCCL_XFER_WRITE, UCCL_XFER_READ };
/* OR'ed into op: the caller waits at once (its thread may do the copy). */
#define UCCL_XFER_BLOCKING 0x100
/* OR'ed into a recv: its size is a capacity, as upstream's: a shorter
 * message is taken (nothing lands past it; uccl_ep_xfer_len tells how much
 * came); without it the sizes must match exactly (the collectives' rule). */
#define UCCL_XFER_CAPACITY 0x200

int uccl_ep_create(const struct uccl_ep_opts *o, uccl_ep_t **ep_p);
/* Fail everything pending, stop every thread; idempotent. */
void uccl_ep_close(uccl_ep_t *ep);
void uccl_ep_destroy(uccl_ep_t *ep);

/* The bytes a peer connects with (out_len >= 192): upstream's 10-byte form
 * when the endpoint has no secret (its scripts parse it themselves), else
 * this engine's 192-byte form, which carries the secret. */
int uccl_ep_metadata(uccl_ep_t *ep, uint8_t *out, size_t out_len, size_t *len_p);
int uccl_parse_metadata(const uint8_t *in, size_t in_len, char ip[46], int *port_p, int *gpu_p);
void uccl_ep_addr(uccl_ep_t *ep, char ip[46], int *port_p);
uint64_t uccl_ep_timeout_ns(uccl_ep_t *ep);
/* This endpoint's host identity (UCCL_P2P_HOST_ID, else the kernel's boot
 * id): peers with the same one may use same-host transports. */
const char *uccl_ep_host_id(uccl_ep_t *ep);
/* How long a waiter polls before it sleeps (UCCL_P2P_SPIN_US).  Call before
 * any transfer; 0 suits more busy threads than cores, where polling only
 * takes the core from the peer being waited for. */
void uccl_ep_set_spin_ns(uccl_ep_t *ep, uint64_t ns);

/* Connect (the new connection sends).  port < 0: base port + remote_gpu.
 * expect_rank >= 0: refuse (UCCL_ERR_MISMATCH) a peer whose rank differs. */
int uccl_ep_connect(uccl_ep_t *ep, const char *ip, int port, int remote_gpu, int expect_rank,
                    const uint8_t *secret, size_t secret_len, uint64_t *conn_p);
/* Connect from metadata; the same metadata gives the same connection. */
int uccl_ep_connect_meta(uccl_ep_t *ep, const uint8_t *meta, size_t meta_len, uint64_t *conn_p);
/* Wait up to timeout_ns for an accepted connection (UCCL_INPROGRESS: none yet). */
int uccl_ep_accept(uccl_ep_t *ep, uint64_t timeout_ns, uint64_t *conn_p, char ip[46],
                   int *gpu_p);
int uccl_ep_set_passive(uccl_ep_t *ep);
/* Name of the transport a connection uses ("tcp", "shm-cma", "shm-ring"). */
int uccl_ep_conn_transport(uccl_ep_t *ep, uint64_t conn, char *buf, size_t len);
/* The rank the peer of a connection gave in its handshake (-1: none). */
int uccl_ep_conn_peer_rank(uccl_ep_t *ep, uint64_t conn, int *rank_p);
/* Close connection conn and forget it (add_remote_endpoint connects afresh
 * to that peer afterwards); what was pending on it fails.
 * UCCL_ERR_NOTFOUND: no such live connection. */
int uccl_ep_conn_remove(uccl_ep_t *ep, uint64_t conn);
/* The IPv4 address endpoints put in their metadata (UCCL_SOCKET_IFNAME, else
 * the first interface that is up and not loopback). */
int uccl_local_ip(char *buf, size_t len);

int uccl_ep_reg(uccl_ep_t *ep, uintptr_t addr, size_t len, uint64_t *mr_p);
int uccl_ep_dereg(uccl_ep_t *ep, uint64_t mr);

/* Register [addr, +len): host memory, page-locked host memory or CUDA device
 * memory of one allocation (classified here; libcuda is loaded at run time). */
/* Post a transfer; fifo (advertised descriptor) only for WRITE/READ.
 * Device memory is stream-ordered as NCCL orders its work: the transfer
 * starts after the work queued on `stream` (a CUstream of the buffer's
 * device; 0: the legacy default stream) before this call, and it is done
 * (poll, wait) once the bytes are in place for any later work.  Host
 * memory ignores `stream`. */
int uccl_ep_post(uccl_ep_t *ep, int op, uint64_t conn, uint64_t mr, uintptr_t ptr, size_t len,
                 const uint8_t *fifo, size_t fifo_len, uintptr_t stream, uint64_t *xfer_p);
/* `stream` for callers that ordered the stream themselves (the
 * communicator, which waits for its caller's stream once per operation):
 * the transfer starts at once. */
#define UCCL_STREAM_NONE ((uintptr_t)-1)

/* Stream marks: the point a CUDA stream (of device dev; 0: the legacy
 * default stream) has reached now.  *mark_p is NULL where the stream has
 * no work left.  poll: 1 reached, 0 not yet, < 0 the stream's work failed;
 * wait: polls until reached or timeout_ns (UCCL_ERR_TIMEOUT). */
int uccl_stream_mark(int dev, uintptr_t stream, void **mark_p);
int uccl_stream_mark_poll(void *mark);
int uccl_stream_mark_wait(void *mark, uint64_t timeout_ns);
void uccl_stream_mark_free(void *mark);

/* Copy len bytes from src to dst within this process, host or device
 * memory in any pairing (classified here: no registration needed); done
 * when it returns.  Host to host may overlap (memmove). */
int uccl_ep_copy(uccl_ep_t *ep, uintptr_t dst, uintptr_t src, size_t len);
/* The same, started: where device memory is involved the copy is queued on
 * the copy engine and *mark_p is a stream mark that is reached when it is
 * done (uccl_stream_mark_poll/wait/free); otherwise it is done here and
 * *mark_p is NULL. */
int uccl_ep_copy_start(uccl_ep_t *ep, uintptr_t dst, uintptr_t src, size_t len, void **mark_p);

/* ---- Stream-ordered groups of processes of one host (sg/sgroup.h) -------
 * The pieces below them: page-aligned host memory registered for every
 * device's streams (uccl_gpu_host_register, gpu/gpu_api.h), and a
 * registered region's device memory shared with a same-host peer
 * (ipc_share.c). */
/* The key that lets the same-host peer of connection conn_id map
 * [ptr, +len) of region mr_id (device memory, still the allocation that was
 * registered): the address of the region's export record. */
int uccl_ep_ipc_key(uccl_ep_t *ep, uint64_t conn_id, uint64_t mr_id, uintptr_t ptr, size_t len,
                    uint64_t *key_p);
/* *ptr_p: [addr, +len) of the peer's memory behind key, mapped on device
 * dev (checked against the peer's export record); the mapping stays until
 * uccl_ep_ipc_unmap(*imp_p). */
int uccl_ep_ipc_map(uccl_ep_t *ep, uint64_t conn_id, uint64_t key, uint64_t addr, size_t len,
                    int dev, void **ptr_p, void **imp_p);
void uccl_ep_ipc_unmap(void *imp);

/* Order `stream` (a CUstream of the buffer's device; 0: the legacy default
 * stream) after transfer xfer of device memory without blocking the host:
 * work queued there next runs once the transfer has finished (the stream
 * waits on a flag the engine sets; a failed transfer releases it too, and
 * poll/wait report the error).  *queued_p: 1 if the stream waits (or the
 * transfer is done already), 0 if xfer moves host memory (wait on the host). */
int uccl_ep_stream_wait(uccl_ep_t *ep, uint64_t xfer, uintptr_t stream, int *queued_p);
/* Done?  A failed transfer returns its error (every time until released). */
int uccl_ep_poll(uccl_ep_t *ep, uint64_t xfer, int *done_p);
/* Wait until done or until min(deadline_ns, now + slice_ns).  UCCL_OK: done;
 * UCCL_INPROGRESS: the slice passed; past the deadline the transfer's
 * connection is failed (nothing may land later) and UCCL_ERR_TIMEOUT returned. */
int uccl_ep_wait(uccl_ep_t *ep, uint64_t xfer, uint64_t deadline_ns, uint64_t slice_ns);
/* Drive the connections of n transfers from this thread, round robin,
 * until xfers[0] is finished (every one, with UCCL_PROGRESS_ALL) or
 * budget_ns passes (never sleeps; yields the core between rounds).
 * Arrivals on all of them are handled here, so no connection thread has to
 * wake; their copies too, unless UCCL_PROGRESS_HANDOFF asks that each go to
 * its connection's worker (several copies then run at once, for machines
 * with cores to spare).  Looks at the first 64 ids at most; returns how many
 * of those it looked at are finished (an unknown id counts as finished: its
 * wait reports it). */
#define UCCL_PROGRESS_ALL 1u
#define UCCL_PROGRESS_HANDOFF 2u
int uccl_ep_progress(uccl_ep_t *ep, const uint64_t *xfers, int n, unsigned flags,
                     uint64_t budget_ns);
/* Forget a finished transfer id (its answer is kept until then).  A
 * transfer still in flight cannot be released (UCCL_ERR_INVALID). */
int uccl_ep_release(uccl_ep_t *ep, uint64_t xfer);
/* The bytes a finished transfer moved (a capacity recv's may be fewer than
 * it posted).  UCCL_INPROGRESS while it runs; UCCL_ERR_NOTFOUND for an
 * unknown, released or compacted id (UCCL_P2P_DONE_IDS). */
int uccl_ep_xfer_len(uccl_ep_t *ep, uint64_t xfer, size_t *len_p);
/* How many transfer ids the table holds now (in flight, or finished and
 * not released; finished ids beyond UCCL_P2P_DONE_IDS are compacted). */
size_t uccl_ep_ids_held(uccl_ep_t *ep);
/* Give up on a pending transfer (e.g. its caller was interrupted): its
 * connection fails, and this returns once nothing can land in its buffer. */
int uccl_ep_abort(uccl_ep_t *ep, uint64_t xfer, const char *why);

/* A descriptor (UCCL_FIFO_ITEM_SIZE bytes into out) that lets the peer of
 * accepted connection conn read and write [addr, +len) of region mr, and
 * nothing else; conn 0: the peer of any accepted connection that holds the
 * descriptor (upstream's newer advertise(mr_id, ptr, size) and transfer
 * API): the descriptor's random token is then the capability.  Revoked by
 * dereg(mr); until then the same (conn, mr, addr, len) gives the same
 * descriptor again. */
int uccl_ep_advertise(uccl_ep_t *ep, uint64_t conn, uint64_t mr, uintptr_t addr, size_t len,
                      uint8_t *out, size_t out_len);

#endif
