/* Collectives over an endpoint's connections (one communicator per job or
 * group): point-to-point batches, allgather (direct or pipelined ring,
 * equal or uneven chunks) and the ring step.
 *
 * Every rank must issue the same operations in the same order, as with
 * NCCL: messages on a connection are matched in the order they are posted.
 * So each communicator starts its operations strictly in submission order,
 * one at a time.  An operation is advanced by the thread that waits for it
 * (no handoff), or by a worker thread while nobody waits (async calls).  The
 * first operation that fails poisons the communicator (NCCL's rule): later
 * ones fail at once with its reason, since their peers can no longer agree
 * on what comes next. */
#ifndef UCCL_COLL_H
#define UCCL_COLL_H

#include <stddef.h>
#include <stdint.h>

#include "ep/uccl.h"

typedef struct uccl__comm uccl_comm_t;

enum { UCCL_AG_AUTO = 0, UCCL_AG_DIRECT = 1, UCCL_AG_RING = 2 };
/* or'ed into an allgather's algorithm: after a size mismatch, no exchange
 * of the ranks' sizes (the caller has its own: the process group's call
 * headers, whose first exchanges are not all of equal chunks). */
#define UCCL_AG_NO_DIAGNOSIS 0x100

/* A buffer of an operation; mr 0: registered for the operation's duration. */
struct uccl_coll_buf {
    uintptr_t ptr;
    size_t len;
    uint64_t mr;
};

struct uccl_coll_p2p {
    int op;                  /* UCCL_XFER_SEND or UCCL_XFER_RECV */
    int peer;                /* rank */
    struct uccl_coll_buf buf;
};

/* send_conns[r]: a connection made by connect() to rank r; recv_conns[r]:
 * the one rank r made to us.  0 for this rank, and for ranks this engine
 * does not reach (their traffic goes elsewhere; operations naming them are
 * refused). */
int uccl_comm_create(uccl_ep_t *ep, int rank, int size, const uint64_t *send_conns,
                     const uint64_t *recv_conns, uccl_comm_t **comm_p);
/* Fail what is queued and stop the worker; call after uccl_ep_close() so
 * that the running operation's transfers fail too.  Idempotent. */
void uccl_comm_shutdown(uccl_comm_t *cm);
void uccl_comm_destroy(uccl_comm_t *cm);

/* Stream order: `mark` (uccl_stream_mark of the caller's CUDA stream at
 * the call, or NULL) is the point the operation waits for before it posts
 * anything, so peers never touch a buffer before the work queued ahead of
 * the call is done.  The operation takes the mark (frees it), also when
 * submission fails.  Its transfers then go out with UCCL_STREAM_NONE. */

/* Post a batch of sends and receives (in order, after every operation
 * submitted before it). */
int uccl_comm_p2p(uccl_comm_t *cm, const struct uccl_coll_p2p *ops, int n, void *mark,
                  uint64_t *op_p);
/* Allgather: send (this rank's chunk) to every rank; recv[r] receives rank
 * r's chunk (recv[r].len must be what rank r sends: a mismatch fails the
 * receiver).  recv[rank] may be send itself (in place) or a copy target.
 * async 0: the caller waits at once and advances it itself (no thread
 * handoff); 1: the worker thread advances it while nobody waits. */
int uccl_comm_allgather(uccl_comm_t *cm, const struct uccl_coll_buf *send,
                        const struct uccl_coll_buf *recv, int algo, int async, void *mark,
                        uint64_t *op_p);

/* UCCL_OK: done; UCCL_INPROGRESS: the slice passed; past the deadline the
 * operation is aborted (nothing lands in its buffers after this returns)
 * and UCCL_ERR_TIMEOUT returned.  A failed operation returns its error,
 * every time until released. */
int uccl_comm_wait(uccl_comm_t *cm, uint64_t op, uint64_t deadline_ns, uint64_t slice_ns);
int uccl_comm_test(uccl_comm_t *cm, uint64_t op, int *done_p);
/* Forget a finished operation (one still running cannot be released). */
int uccl_comm_release(uccl_comm_t *cm, uint64_t op);
void uccl_comm_size(const uccl_comm_t *cm, int *size_p);
/* The algorithm an allgather of chunk bytes per rank would use (auto resolved). */
int uccl_comm_pick_algo(const uccl_comm_t *cm, int algo, size_t chunk);

#endif
