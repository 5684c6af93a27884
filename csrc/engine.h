/* Internal structures shared by engine.c (endpoints, tables, handshake),
 * conn.c (the per-connection protocol) and the transports. */
#ifndef UCCL_ENGINE_H
#define UCCL_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "idmap.h"
#include "transport.h"
#include "uccl.h"
#include "wire.h"

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
    uint64_t key_for_peer;       /* send/write: tp->mem_key of buf, sent with its address */
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
    struct uccl__req *next;      /* conn queues (under conn->mu) */
};

struct uccl__rts {               /* an RTS that arrived before its recv was posted */
    uint64_t seq, len, addr, key;
    int eager;                   /* the bytes came with it (socket) or sit in a slot (shm) */
    int slot;                    /* shared-memory eager slot, or -1 */
    char *data;                  /* eager bytes held until the recv is posted, or NULL
                                    when they were read straight into the posted buffer */
    struct uccl__rts *next;
};

/* Eager sends: on a socket control channel a message of at most
 * UCCL_EAGER_MAX bytes travels right after its RTS, saving the CTS round
 * trip and the data-stream threads.  A sender keeps at most
 * UCCL_EAGER_INFLIGHT of them unanswered, so a receiver never holds more
 * than their product in bytes for recvs not yet posted. */
#define UCCL_EAGER_MAX (64u << 10)
#define UCCL_EAGER_INFLIGHT 16
#define UCCL_MSG_FLAG_EAGER 1u
#define UCCL_MSG_FLAG_SLOT 2u   /* eager bytes are in shared-memory slot `offset` */

struct uccl__job {               /* work for the connection's worker thread */
    int kind;
    struct uccl__req *req;       /* holds a reference */
    struct uccl__msg msg;
    void *dst;                   /* validated local target (one-sided direct) */
    struct uccl__mr *hold;       /* region kept from dereg() until the job is done */
    int busy_held;               /* the job counts in req->busy (it will write there) */
    struct uccl__job *next;
};

struct uccl__conn {
    uint64_t id;
    atomic_int refs;
    struct uccl__ep *ep;
    int is_connector;            /* connector sends/reads/writes, acceptor receives */
    int ctrl_fd;
    pthread_mutex_t ctrl_tx_mu;  /* one writer at a time on the control socket */
    const struct uccl__tp_ops *tp;
    void *tp_priv;
    int direct;                  /* transport moves bytes with pull/push */
    int ctrl_shm;                /* control messages use tp->ctrl_send/recv */
    size_t chunk_bytes;
    unsigned num_streams;
    uint64_t token;
    uint8_t secret[UCCL_SECRET_MAX]; /* connector: presented on every extra stream */
    uint32_t secret_len;

    char peer_ip[46];
    int peer_port, peer_gpu, peer_rank;
    uint32_t peer_pid;
    char peer_host[UCCL_HOSTID_MAX];

    pthread_mutex_t mu;          /* everything below */
    pthread_cond_t cv;
    atomic_int failed;
    int peer_bye;                /* the peer closed on purpose: log quietly */
    atomic_int closing;          /* we are closing: whatever fails next is that close */
    atomic_int answering;        /* threads between finishing a request and telling the peer */
    int fail_status;
    char fail_msg[512];
    uint64_t next_send_seq, next_recv_seq, next_op;
    struct uccl__req *recv_head, *recv_tail;   /* posted recvs without an RTS */
    struct uccl__rts *rts_head, *rts_tail;     /* RTSs without a posted recv */
    struct uccl__idmap pending;  /* every unfinished req of this connection (holds a ref) */
    struct uccl__idmap inflight; /* key(kind, seq/op) -> req awaiting the peer */
    struct uccl__idmap rx;       /* key(data kind, id) -> req that streamed bytes land in */
    struct uccl__job *job_head, *job_tail;
    int started;
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

struct uccl__mr {
    uint64_t id;
    uintptr_t addr;
    size_t len;
    uint64_t tp_key[UCCL_TP_COUNT];  /* per transport: what mem_reg made (an lkey) */
    void *tp_priv[UCCL_TP_COUNT];
    int inflight;                /* one-sided operations of peers touching it (ep->mu) */
    int dead;                    /* deregistered: freed when inflight drops to 0 ... */
    int waiting;                 /* ... by dereg() itself while it waits, else by the last release */
};

struct uccl__window {
    uint64_t id, token, conn_id, mr_id;
    uintptr_t addr;
    size_t len;
    struct uccl__mr *mr;         /* in a window_check result: the hold to release */
};

#define UCCL_ACCEPTQ_MAX 1024

struct uccl__ep {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int closed;
    int listen_fd, port, gpu_idx;
    int rank;                    /* sent in handshakes (-1: none) */
    char ip[46];
    char host_id[UCCL_HOSTID_MAX];
    uint8_t secret[UCCL_SECRET_MAX];
    uint32_t secret_len;
    uint64_t timeout_ns;
    uint64_t spin_ns;            /* how long a waiter drives its connection before sleeping */
    unsigned num_streams;
    size_t chunk_bytes;
    int forced_tp;               /* UCCL_TP_AUTO unless UCCL_P2P_TRANSPORT says */
    int shm_mode;                /* -1 auto, 0 CMA, 1 ring (UCCL_P2P_SHM_MODE) */
    int passive;
    uint64_t next_conn_id, next_mr_id, next_req_id, next_window_id;
    struct uccl__idmap conns, mrs, reqs, windows, incomplete;
    uint64_t acceptq[UCCL_ACCEPTQ_MAX];
    unsigned acceptq_head, acceptq_len;
    struct uccl__remote *remotes; /* add_remote_endpoint cache */
    volatile uint64_t probe_word; /* CMA probe: peers read this to test access */
    struct uccl__pool *copy_pool; /* helpers splitting large copies (made at first use) */
    int wake_pipe[2];
    pthread_t listener;
    int listener_started;
};

/* ---- engine.c services used by conn.c and the transports ---- */
uint64_t uccl__random64(void);
/* Connector side: open extra socket `index` of connection c (HELLO_STREAM). */
int uccl__ep_open_stream(struct uccl__conn *c, unsigned index, uint64_t deadline_ns, int *fd_p);
/* If the request is allowed: a copy of the window (caller frees), whose
 * region is held from dereg() until uccl__ep_release_hold(ep, copy->mr). */
struct uccl__window *uccl__ep_window_check(struct uccl__ep *ep, uint64_t conn_id,
                                           uint64_t window, uint64_t token, uint64_t offset,
                                           uint64_t len, int *status_p);

void uccl__ep_release_hold(struct uccl__ep *ep, struct uccl__mr *mr);
/* The endpoint's copy helpers (pool.h), started at the first call: one on a
 * machine of up to 4 cores, else min(8, cores / 2) - 1.  NULL if none. */
struct uccl__pool *uccl__ep_copy_pool(struct uccl__ep *ep);

/* ---- requests (conn.c) ---- */
struct uccl__req *uccl__req_new(int op, struct uccl__conn *c, void *buf, size_t len);
void uccl__req_put(struct uccl__req *r);
void uccl__req_finish(struct uccl__req *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int uccl__req_wait(struct uccl__req *r, uint64_t timeout_ns);

/* ---- connections (conn.c) ---- */
struct uccl__conn *uccl__conn_new(struct uccl__ep *ep, int is_connector, int ctrl_fd);
int uccl__conn_start(struct uccl__conn *c);
void uccl__conn_get(struct uccl__conn *c);
void uccl__conn_put(struct uccl__conn *c);
void uccl__conn_fail(struct uccl__conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void uccl__conn_close(struct uccl__conn *c);
int uccl__conn_send_msg(struct uccl__conn *c, const struct uccl__msg *m);
/* blocking: the caller will wait for r at once, so work that r's arrival
 * triggers may run on the calling thread. */
int uccl__conn_post(struct uccl__conn *c, struct uccl__req *r, int blocking);
void uccl__conn_drive(struct uccl__conn *c, struct uccl__req *r, uint64_t budget_ns);
/* The pieces of uccl__conn_drive, for a thread that drives several
 * connections at once: begin (1: this thread is now c's reader), pump
 * (handle what has arrived, copying on this thread when inline_copies, else
 * handing copies to c's worker; < 0: c failed), end. */
int uccl__conn_drive_begin(struct uccl__conn *c);
int uccl__conn_drive_pump(struct uccl__conn *c, int inline_copies);
void uccl__conn_drive_end(struct uccl__conn *c);

/* Stream receive path, called by transports for each arriving chunk:
 * begin validates (kind, id, offset, len) against what this side posted and
 * returns where the bytes go, holding the request busy; end accounts them. */
int uccl__conn_rx_begin(struct uccl__conn *c, int kind, uint64_t id, uint64_t offset,
                        uint64_t len, char **dst_p, struct uccl__req **req_p);
void uccl__conn_rx_end(struct uccl__conn *c, struct uccl__req *r, uint64_t len);
/* The chunk begun with rx_begin could not be received (the connection is failing). */
void uccl__conn_rx_abort(struct uccl__conn *c, struct uccl__req *r);
/* Stream send completion, called by transports. */
void uccl__conn_tx_done(struct uccl__conn *c, void *cookie, int status);

#endif
