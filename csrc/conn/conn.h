/* The connection layer: one connection between two endpoints, its requests
 * and the protocol they follow, identical for every transport.  Its files,
 * bottom to top; each calls only files listed before it, so calls go one
 * way:
 *
 *   conn.c          a connection and its requests, which hold each other:
 *                   references, failure (which finishes every pending
 *                   request), the control channel's writes, requests made,
 *                   finished, and answered (finished, then the peer told)
 *   worker.c        copies: the jobs the protocol queues (a pull into a
 *                   posted buffer, a push into the peer's GPU memory) and
 *                   the worker thread that runs them, unless the caller
 *                   driving the connection runs them itself
 *   proto_stream.c  the stream data path: which transfers stream, the bytes
 *                   handed to the transport, where received chunks land
 *   proto.c         the protocol: posting, matching sends to receives, each
 *                   control message and what it does
 *   proto_eager.c   eager payloads read off a socket control channel, then
 *                   matched like any announced message
 *   progress.c      who reads the control channel and hands each message to
 *                   the protocol: the service thread, or a caller driving
 *                   the connection while it waits (uccl__req_wait); the
 *                   threads' start, and close
 *
 * The endpoint layer (engine.c, listen.c, xfer.c) calls down into this one;
 * this one calls the transports through their ops (transport.h), the memory
 * regions (mem.h) and the layers below.  A transport calls back only
 * through the upcalls at the end of transport.h (conn.c: send_msg, fail;
 * proto_stream.c: rx_begin, rx_end, rx_abort, tx_done). */
#ifndef UCCL_CONN_H
#define UCCL_CONN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>

#include "base/idmap.h"
#include "tp/link.h"
#include "tp/transport.h"
#include "net/wire.h"

enum { UCCL_OP_SEND = 1, UCCL_OP_RECV, UCCL_OP_WRITE, UCCL_OP_READ,
       UCCL_OP_WRITE_TARGET, /* internal: the target side of a streamed write */
       UCCL_OP_READ_TARGET   /* internal: the target side of a read */ };
enum { UCCL_REQ_PENDING = 0, UCCL_REQ_DONE = 1, UCCL_REQ_FAILED = 2 };

struct uccl__req {
    uint64_t id;                 /* user-visible transfer id; 0 for internal ones */
    atomic_int refs;
    int op;
    struct uccl__conn *conn;
    char *buf;
    size_t len;
    uint64_t seq;                /* message seq (send/recv) or one-sided op id */
    uint64_t remote_addr;        /* peer's address for direct movers */
    uint64_t remote_key;         /* ... and its key (tp->mem_key on the peer) */
    uint64_t local_key;          /* buf's region: mr->tp_key of this transport */
    uint64_t key_for_peer;       /* tp->mem_key of buf, sent with its address */
    uint32_t mkind;              /* what buf is: host, page-locked or device memory (gpu.h) */
    _Atomic(uint32_t *) flag;    /* a stream waits for this slot to reach flag_gen (gpu.h) */
    uint32_t flag_gen;
    struct uccl__gpu_flags *flags; /* ... the slot's pool */
    struct uccl__fifo_item fifo; /* one-sided target */
    struct uccl__mr *hold;       /* target side: the region kept from dereg() while this runs */
    atomic_uint state;           /* UCCL_REQ_*, also the futex word waiters sleep on */
    atomic_int sleepers;         /* waiters in futex_wait: finish wakes only if > 0 */
    int status;
    char msg[512];
    atomic_size_t got;           /* streamed bytes landed in buf */
    atomic_int busy;             /* engine threads writing into buf right now */
    int go_seen;                 /* one-sided: the target's GO came (a second is an error) */
    int eager;                   /* send: its bytes follow the RTS, or sit in eager_slot */
    int eager_slot;              /* send over shared memory: the slot it occupies, or -1 */
    int posted;                  /* recv: in the connection's posted queue (under conn->mu) */
    int capacity;                /* recv: len is the most it takes (UCCL_XFER_CAPACITY) */
    int windowed;                /* send, read, write: announced, holds a slot of the
                                    connection's window (under conn->mu) */
    int deferred;                /* ... or waits for one in its deferred queue (under conn->mu) */
    int served;                  /* a read or write of the peer's that this side serves:
                                    counts in conn->served while it lives */
    TAILQ_ENTRY(uccl__req) link; /* its place in the posted (recv) or deferred queue */
};

struct uccl__rts {               /* an RTS that arrived before its recv was posted */
    uint64_t seq, len, addr, key;
    int eager;                   /* the bytes came with it (socket) or sit in a slot (shm) */
    int slot;                    /* shared-memory eager slot, or -1 */
    char *data;                  /* eager bytes held until the recv is posted, or NULL
                                    when they were read straight into the posted buffer */
    STAILQ_ENTRY(uccl__rts) link;
};

/* Eager sends (UCCL_EAGER_MAX, UCCL_EAGER_INFLIGHT: transport.h, whose
 * eager slots are sized by them): on a socket control channel a message of
 * at most UCCL_EAGER_MAX bytes travels right after its RTS, saving the CTS
 * round trip and the data-stream threads; over shared memory it sits in a
 * slot.  A sender keeps at most UCCL_EAGER_INFLIGHT of them unanswered, so
 * a receiver never holds more than their product in bytes for recvs not
 * yet posted. */
/* What a peer may make this side hold (the requests it announces): a side
 * keeps at most UCCL_REQ_WINDOW of its own sends, reads and writes
 * announced (an RTS, WREQ or RREQ sent) and unfinished on one connection;
 * more wait on its side, in order, and are announced as earlier ones
 * finish.  So a receiver never holds more than that many announced
 * messages that no recv has matched yet, plus reads and writes of the
 * peer's that it still serves; UCCL_PEER_REQS_MAX of those together fail
 * the connection.  Twice the window: a request the peer has seen finish
 * may still be finishing here (its last bytes leaving, its answer on the
 * way), so an honest peer stays below it. */
#define UCCL_REQ_WINDOW 1024
#define UCCL_PEER_REQS_MAX (2 * UCCL_REQ_WINDOW)

#define UCCL_MSG_FLAG_EAGER 1u
#define UCCL_MSG_FLAG_SLOT 2u   /* eager bytes are in shared-memory slot `offset` */
#define UCCL_MSG_FLAG_STREAM 4u /* CTS, GO (aux): stream the bytes (proto_stream.c) */

/* Copies the worker thread (or a caller driving the connection) makes. */
enum { UCCL_JOB_PULL_RECV = 1, /* a message into a posted recv, then FIN */
       UCCL_JOB_PULL_WRITE,    /* a peer's write into our window, then OPDONE */
       UCCL_JOB_PULL_READ,     /* our read out of the peer's window, then RDONE */
       /* the source side copies into the peer's GPU memory (it cannot pull
        * from our host memory): */
       UCCL_JOB_PUSH_SEND,     /* a message into the peer's recv, then PDONE */
       UCCL_JOB_PUSH_WRITE,    /* our write into the peer's window, then RDONE */
       UCCL_JOB_PUSH_READ };   /* our window into the peer's read, then OPDONE */

struct uccl__job {
    int kind;
    struct uccl__req *req;       /* holds a reference */
    struct uccl__msg msg;
    void *dst;                   /* validated local target (one-sided direct) */
    struct uccl__mr *hold;       /* region kept from dereg() until the job is done */
    int busy_held;               /* the job counts in req->busy (it will write there) */
    int served;                  /* a read or write of the peer's: counts in conn->served */
    STAILQ_ENTRY(uccl__job) link;
};

struct uccl__conn {
    struct uccl__link link;      /* what the transport sees (link.h): the local side, the
                                    peer, the handshake's terms, the transport, failed */
    uint64_t id;
    atomic_int refs;
    atomic_int nreqs;            /* requests alive, each holding one of refs */
    int ctrl_fd;                 /* -1 once released */
    pthread_mutex_t ctrl_tx_mu;  /* one writer at a time on the control socket */
    pthread_mutex_t close_mu;    /* one closer at a time: uccl__conn_close, _release */
    int released;                /* failed, and its resources given back (uccl__conn_release;
                                    set under ctrl_tx_mu and mu) */
    atomic_int threads_out;      /* the service and worker threads that have returned */

    pthread_mutex_t mu;          /* everything below */
    pthread_cond_t cv;
    int peer_bye;                /* the peer closed on purpose: log quietly */
    atomic_int closing;          /* we are closing: whatever fails next is that close */
    atomic_int answering;        /* threads between finishing a request and telling the peer */
    int fail_status;
    int fail_done;               /* conn_fail has finished what was pending (under mu) */
    char fail_msg[512];
    uint64_t next_send_seq, next_recv_seq, next_op;
    TAILQ_HEAD(, uccl__req) posted;    /* posted recvs without an RTS */
    STAILQ_HEAD(, uccl__rts) rtsq;     /* RTSs without a posted recv */
    unsigned rtsq_len;
    TAILQ_HEAD(, uccl__req) deferred;  /* sends, reads, writes waiting for the window */
    unsigned announced;          /* this side's requests announced and unfinished */
    int launch;                  /* the worker announces what waits (a slot came free) */
    atomic_uint served;          /* the peer's reads and writes this side serves */
    struct uccl__idmap pending;  /* every unfinished req of this connection (holds a ref) */
    struct uccl__idmap inflight; /* key(kind, seq/op) -> req awaiting the peer */
    struct uccl__idmap rx;       /* key(data kind, id) -> req that streamed bytes land in */
    STAILQ_HEAD(, uccl__job) jobs;     /* for the worker thread */
    atomic_int started;          /* set under mu; read without it by drivers and close */
    pthread_t svc_thread, worker_thread;
    /* Reading the control socket: one reader at a time.  A thread blocked in
     * a transfer on this connection "drives" it (reads and handles messages
     * itself, as UCX's caller-progress does) so an answer needs no thread
     * handoff; the service thread reads only while nobody drives. */
    int driver;
    atomic_int svc_reading;      /* the service thread is in pump() (set under mu) */
    pthread_cond_t svc_cv, drv_cv;
    uint8_t rxbuf[UCCL_MSG_SIZE];
    size_t rxgot;
    struct {                     /* the eager payload being read (reader only) */
        struct uccl__rts *rts;
        char *dst;
        struct uccl__req *direct; /* posted recv read into, busy + ref held */
        size_t got;
    } erx;
    unsigned eager_inflight;     /* sender: eager sends without FIN/NACK (under mu) */
    unsigned eager_slots_busy;   /* sender, shared memory: bitmap of occupied slots (under mu) */
    size_t eager_held;           /* receiver: bytes held for recvs not yet posted (under mu) */
};

/* The keys of a connection's tables: pending by the request's address;
 * inflight and rx by (kind, id), kind above (rx: UCCL_DATA_*; inflight:
 * UCCL_KEY_*, where LENT is a window the initiator copies from or into and
 * RECV a recv the sender pushes into), id below. */
enum { UCCL_KEY_SEND = 1, UCCL_KEY_OP = 2, UCCL_KEY_LENT = 3, UCCL_KEY_RECV = 4 };

static inline uint64_t uccl__proto_key(int kind, uint64_t id)
{
    return ((uint64_t)kind << 56) | (id & ((1ull << 56) - 1));
}

static inline uint64_t uccl__pending_key(const struct uccl__req *r)
{
    return (uint64_t)(uintptr_t)r;
}

/* ---- for the endpoint layer ---------------------------------------------- */

/* Requests (conn.c; uccl__req_wait: progress.c).  A request holds its
 * connection. */
struct uccl__req *uccl__req_new(int op, struct uccl__conn *c, void *buf, size_t len);
void uccl__req_get(struct uccl__req *r);
/* A stream waits (flag slot, gen of pool f) until r finishes; released at
 * once if r finished already. */
void uccl__req_flag(struct uccl__req *r, struct uccl__gpu_flags *f, uint32_t *slot, uint32_t gen);
/* Fail r, never posted (its stream's event failed, or the endpoint closed). */
void uccl__req_fail_unposted(struct uccl__req *r, int status, const char *why);
void uccl__req_put(struct uccl__req *r);
/* Spin briefly, driving the connection, then sleep until r finishes or
 * timeout_ns passes (UCCL_INPROGRESS). */
int uccl__req_wait(struct uccl__req *r, uint64_t timeout_ns);

/* Connections (conn.c; start and close: progress.c).  new: one reference,
 * not started; the endpoint fills in the peer, the transport and the
 * handshake's outcome, then starts it. */
struct uccl__conn *uccl__conn_new(struct uccl__local *loc, int is_connector, int ctrl_fd);
int uccl__conn_start(struct uccl__conn *c);
void uccl__conn_get(struct uccl__conn *c);
void uccl__conn_put(struct uccl__conn *c);
/* Endpoint close: fail what is pending, say BYE, stop the threads.  The
 * memory goes with the last reference. */
void uccl__conn_close(struct uccl__conn *c);
/* A failed connection gives back what it holds (its threads, descriptors,
 * the transport's state, what the peer announced) although references
 * remain: its requests and its id keep answering with its failure.  Only
 * where nothing else is inside it: nobody drives it and it has exactly
 * `refs` references besides its requests' (those its caller knows of).
 * 1 if released (now or before), 0 if not yet: try again later. */
int uccl__conn_release(struct uccl__conn *c, int refs);
/* Start request r (proto.c).  blocking: the caller will wait for r at once,
 * so work that r's arrival triggers may run on the calling thread. */
int uccl__conn_post(struct uccl__conn *c, struct uccl__req *r, int blocking);
/* Drive c from the calling thread until r finishes or budget_ns passes;
 * returns at once if another thread already drives c (progress.c, as the
 * pieces below). */
void uccl__conn_drive(struct uccl__conn *c, struct uccl__req *r, uint64_t budget_ns);
/* The pieces of uccl__conn_drive, for a thread that drives several
 * connections at once: begin (1: this thread is now c's reader), pump
 * (handle what has arrived, copying on this thread when inline_copies, else
 * handing copies to c's worker; < 0: c failed), end. */
int uccl__conn_drive_begin(struct uccl__conn *c);
int uccl__conn_drive_pump(struct uccl__conn *c, int inline_copies);
void uccl__conn_drive_end(struct uccl__conn *c);

/* (uccl__conn_fail and uccl__conn_send_msg, also used by the endpoint, are
 * declared in transport.h.) */

/* ---- inside the layer, by file, bottom to top ----------------------------- */

/* conn.c */
/* Take r out of the protocol's tables and finish it (drops the connection's
 * reference); nothing if it was finished already.  Without c->mu held. */
void uccl__req_complete(struct uccl__conn *c, struct uccl__req *r, int status, const char *fmt,
                        ...) __attribute__((format(printf, 4, 5)));
/* Finish r here, then tell the peer (FIN, NACK, OPDONE, RDONE, PDONE). */
void uccl__req_answer(struct uccl__conn *c, struct uccl__req *r, int type, uint64_t len,
                      int status, const char *why);
/* Write one encoded message on the control channel; caller holds ctrl_tx_mu. */
int uccl__conn_ctrl_write(struct uccl__conn *c, const uint8_t *buf, uint64_t deadline);
void uccl__conn_send_simple(struct uccl__conn *c, int type, uint64_t seq, uint64_t len,
                            uint64_t aux);
/* A send, read or write (in pending): its sequence number and table
 * entries, then its RTS, WREQ or RREQ, now if the window has room, else
 * once earlier ones finish (UCCL_REQ_WINDOW).  A failure fails c. */
void uccl__conn_announce(struct uccl__conn *c, struct uccl__req *r);
/* Announce what waits, while the window has room (the worker thread, told
 * by c->launch). */
void uccl__conn_launch(struct uccl__conn *c);
/* Free what the protocol holds for the peer (announced messages never
 * matched, an eager payload half read) and the tables' arrays left empty:
 * with the last reference, or once released (no reader any more). */
void uccl__conn_free_held(struct uccl__conn *c);

/* worker.c */
/* Queue a copy (UCCL_JOB_*) for the worker, or run it here if this thread
 * drives c with inline copies.  Takes over `hold`; r may be NULL. */
void uccl__conn_push_job(struct uccl__conn *c, int kind, struct uccl__req *r,
                         const struct uccl__msg *m, void *dst, struct uccl__mr *hold);
/* Run fn(c) with c's copies made on this thread (unless it already drives a
 * connection): a blocking caller pulls what is ready at once. */
void uccl__conn_with_inline_copies(struct uccl__conn *c, void (*fn)(struct uccl__conn *));
/* The connection whose copies this thread makes itself (NULL: none), and
 * setting it, for the thread that drives c (progress.c). */
struct uccl__conn *uccl__conn_driving(void);
void uccl__conn_set_driving(struct uccl__conn *c);
/* The worker thread (started by uccl__conn_start): runs queued copies
 * until c fails. */
void *uccl__conn_worker_main(void *arg);

/* proto_stream.c */
/* Do bytes bound for (or read out of) local memory with this local key
 * stream on c?  Always where c is not direct; else where the peer cannot
 * reach that memory (tp->staged). */
int uccl__proto_streams(const struct uccl__conn *c, uint64_t local_key);
/* Hand len bytes of src to the transport's stream (r held, and busy, until
 * its tx_done); a failure fails the connection. */
int uccl__proto_stream_out(struct uccl__conn *c, int kind, uint64_t id, const void *src,
                           uint64_t src_key, size_t len, struct uccl__req *r);

/* proto.c */
/* An announced message joins the receiver's queue and is matched if its
 * recv is posted; refused (freed, an error returned) where the peer has
 * UCCL_PEER_REQS_MAX requests open already. */
int uccl__proto_queue_rts(struct uccl__conn *c, struct uccl__rts *rts);
/* A whole control message read by the connection's reader. */
int uccl__proto_handle(struct uccl__conn *c, const struct uccl__msg *m);

/* proto_eager.c */
/* An eager RTS on the socket: decide where its payload goes (c->erx), which
 * the reader then reads; eager_arrived once all of it is in. */
int uccl__proto_eager_begin(struct uccl__conn *c, const struct uccl__msg *m);
int uccl__proto_eager_arrived(struct uccl__conn *c);
/* The reader lets go of a half-read eager payload (the connection failed). */
void uccl__proto_eager_drop(struct uccl__conn *c);

#endif
