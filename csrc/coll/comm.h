/* The collective layer, internal to its three files:
 *
 *   comm.c       the communicator (coll.h): the queue started in order, the
 *                execution token, submission, waiting, failure, shutdown
 *   coll_run.c   running one operation: posting its transfers, forwarding
 *                pieces as they arrive, waiting for and releasing them
 *   coll_algo.c  the algorithms: what each operation posts (p2p batches,
 *                direct and ring allgather) and which one auto picks
 *
 * It sits on the engine's public C API (uccl.h) alone.  A new algorithm is
 * one start function and one uccl__coll_algo in coll_algo.c. */
#ifndef UCCL_COMM_H
#define UCCL_COMM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>

#include "coll/coll.h"
#include "base/idmap.h"

enum { UCCL_OPST_QUEUED = 0, UCCL_OPST_RUNNING, UCCL_OPST_POSTED, UCCL_OPST_DONE,
       UCCL_OPST_FAILED };

struct uccl__comm;
struct uccl__op;

/* An algorithm: what an operation posts. */
struct uccl__coll_algo {
    const char *name;            /* in error messages: "ring allgather" */
    /* 1: done once posted; the operation's waiters then collect the
     * transfers (p2p batches: their sends and receives may be waited for
     * by different calls).  0: done when every transfer has finished. */
    int posted_is_done;
    /* Register the operation's buffers and post every transfer that can be
     * posted now (uccl__coll_post); pieces to pass on once they have
     * arrived are recorded in o->fwd, and posted by coll_run.c then. */
    int (*start)(struct uccl__comm *cm, struct uccl__op *o);
    /* Optional, where every rank fails alike on a size mismatch (an
     * allgather of equal chunks): after such a failure, with every
     * transfer finished, post an exchange with every rank of what it
     * called (diagnose), then name the ranks and their sizes (explain,
     * into o->msg).  NULL: the mismatch's own message is the error. */
    int (*diagnose)(struct uccl__comm *cm, struct uccl__op *o);
    void (*explain)(struct uccl__comm *cm, struct uccl__op *o);
};

extern const struct uccl__coll_algo uccl__coll_p2p, uccl__coll_direct, uccl__coll_ring;

struct uccl__xlist {             /* transfers an operation posted, in order */
    uint64_t *id;
    char *recv;                  /* recv[i]: transfer i is a receive */
    int *peer;                   /* peer[i]: the rank of transfer i */
    int n, cap, waited;          /* waited: ids [0, waited) are finished and released */
};

struct uccl__fwd {               /* after receive rx, send [off, +len) of chunk c to rank to */
    int c, rx, to;
    size_t off, len;
};

struct uccl__op {
    uint64_t id;
    const struct uccl__coll_algo *algo;
    int state;                   /* UCCL_OPST_* */
    int status;
    char msg[512];
    atomic_int abort;            /* a waiter gave up: whoever runs it stops it */
    int async;                   /* nobody waits at once: the worker runs it */
    int collecting;              /* posted_is_done: one waiter is collecting the transfers */
    int waiters;                 /* threads inside uccl_comm_wait on it (under cm->mu) */
    int released;                /* forgotten while waited on: the last waiter frees it */
    int phase, cursor;           /* progress: 0 post, 1 forwarding, 2 waiting, 3 diagnosing */
    /* A size mismatch is the callers' mistake, not a broken connection: the
     * peer's side of a mismatched message fails too (NACK), so once every
     * transfer has finished, the ranks still agree on what comes next.
     * tolerant: on a mismatch, wait for every other transfer instead of
     * aborting them; clean: the operation failed that way, so the
     * communicator is not poisoned. */
    int tolerant, clean;
    int nodiag;                  /* UCCL_AG_NO_DIAGNOSIS: no diagnose after a mismatch */
    int mismatched;              /* transfers that failed with a size mismatch */
    char mmsg[512];              /* the first one's message */
    uint64_t *diag;              /* diagnose: this rank's record, then every rank's */
    struct uccl__fwd *fwd;
    int nfwd;
    int n;                       /* p2p: number of entries */
    struct uccl_coll_p2p *p2p;
    struct uccl_coll_buf send;
    struct uccl_coll_buf *recv;  /* allgather: size entries */
    uint64_t *tmp_mr;            /* registrations made for this operation */
    int ntmp;
    uint64_t deadline;
    void *mark;                  /* the caller's stream must reach it first (uccl_stream_mark) */
    void *own_copy;              /* allgather: this rank's chunk being copied (a mark), or NULL */
    struct uccl__xlist x;
    TAILQ_ENTRY(uccl__op) link;  /* in the communicator's queue while queued */
    int queued;
};

struct uccl__comm {
    uccl_ep_t *ep;
    int rank, size;
    uint64_t *send_conn, *recv_conn;
    size_t piece;                /* UCCL_COLL_PIECE_KB, or 0: chosen per chunk */
    uint64_t poll_ns;            /* UCCL_COLL_POLL_US: a waiter polls this long first */
    int multinode;               /* some peer is reached over TCP (another node) */
    int handoff;                 /* cores to spare: copies run on connection workers, at once */
    pthread_mutex_t mu;          /* everything below */
    pthread_cond_t cv;           /* queue and operation state changes */
    pthread_cond_t work_cv;      /* the worker: async work may be runnable */
    TAILQ_HEAD(, uccl__op) queue; /* submitted, not started */
    struct uccl__op *cur;        /* the operation started and not finished (at most one) */
    int executing;               /* a thread is advancing cur (the execution token) */
    struct uccl__idmap ops;
    uint64_t next_id;
    int failed, fail_status;
    char fail_msg[512];
    int stop, worker_started;
    pthread_t worker;
};

/* ---- coll_run.c ---- */
/* Record why o failed (printf-style, into o->msg) and return status. */
int uccl__op_err(struct uccl__op *o, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Register b for o's duration if it has no region yet (b->mr 0). */
int uccl__coll_reg(struct uccl__comm *cm, struct uccl__op *o, struct uccl_coll_buf *b);
/* Post one transfer of o (UCCL_XFER_SEND/RECV, maybe | UCCL_XFER_BLOCKING)
 * of [off, +len) of b with rank peer. */
int uccl__coll_post(struct uccl__comm *cm, struct uccl__op *o, int kind, int peer,
                    const struct uccl_coll_buf *b, size_t off, size_t len);
/* Advance o (the caller holds the execution token) until it is finished
 * (posted, for posted_is_done) or `until` passes: UCCL_OK, UCCL_INPROGRESS
 * or an error. */
int uccl__coll_advance(struct uccl__comm *cm, struct uccl__op *o, uint64_t until);
/* Wait for every transfer o posted, releasing them, until `until`. */
int uccl__coll_finish_transfers(struct uccl__comm *cm, struct uccl__op *o, uint64_t deadline,
                                uint64_t until);
/* Forget o's transfers and registrations; failed: make sure first that
 * nothing lands in its buffers any more. */
void uccl__coll_cleanup(struct uccl__comm *cm, struct uccl__op *o, int failed);
void uccl__op_free(struct uccl__op *o);

#endif
