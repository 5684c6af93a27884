/* The endpoint layer, internal to its files (calls go down this list):
 *
 *   engine.c   endpoints (create, close, destroy, settings), connect,
 *              metadata, registration: it starts and stops the listener
 *              and frees the transfers' table
 *   listen.c   the listener thread: incoming handshakes, the transport
 *              choice, connections still waiting for their data streams
 *   xfer.c     transfers: the id table, post, poll, wait, progress,
 *              release, abort
 *   gate.c     transfers of GPU memory waiting for their caller's stream
 *   conns.c    the connection table: open or closed, connections by id,
 *              the accept queue (listen.c and connect enter connections,
 *              xfer.c looks them up), removal, and the reaper that gives
 *              back what failed connections hold
 *
 * It implements the public C API (uccl.h) over the connection layer
 * (conn.h) and the memory regions (mem.h), which never call back up. */
#ifndef UCCL_ENGINE_H
#define UCCL_ENGINE_H

#include <pthread.h>
#include <stdint.h>
#include <sys/queue.h>

#include "conn/conn.h"
#include "base/idmap.h"
#include "tp/link.h"
#include "ep/uccl.h"

/* Failed connections released by the reaper (conns.c) whose ids keep
 * answering with their failure; older ones are forgotten (their ids then
 * answer "no such connection"). */
#define UCCL_DEAD_CONNS_KEPT 1024

struct uccl__gate_item;
struct uccl__gate {              /* gate.c */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct uccl__gate_item *head;
    pthread_t thread;
    int started, stop;
};

struct uccl__remote {            /* add_remote_endpoint's cache: a peer's connection */
    char ip[46];
    int port;
    uint64_t conn_id;
    SLIST_ENTRY(uccl__remote) link;
};

struct uccl__ep {
    struct uccl__local local;    /* lent to every connection: settings, identity, regions */
    pthread_mutex_t mu;          /* everything below */
    pthread_cond_t cv;           /* the accept queue changed, or the endpoint closed */
    int closed;
    int listen_fd;               /* on ip where UCCL_SOCKET_IFNAME names an interface, else
                                    on every address */
    int listen_lo_fd;            /* the same port on 127.0.0.1 where ip is another address
                                    (connect_local), else -1 */
    char ip[46];
    int passive;                 /* accepted connections are not queued for accept() */
    int base_port;               /* UCCL_P2P_BASE_PORT: connect(ip, gpu) dials base + gpu */
    uint64_t next_conn_id, next_req_id;
    struct uccl__idmap conns;    /* id -> connection (one reference) */
    struct uccl__idmap reqs;     /* transfer id -> request (one reference) or the done mark */
    size_t done_marks, done_cap; /* done marks in reqs; UCCL_P2P_DONE_IDS (xfer.c) */
    uint64_t done_floor;         /* ids below it that reqs lacks finished (or were released) */
    struct uccl__idmap incomplete; /* token -> accepted connection waiting for its streams */
    struct uccl__conn **acceptq; /* accepted, not yet returned by accept() (a reference each) */
    unsigned acceptq_cap;        /* UCCL_P2P_ACCEPT_QUEUE */
    unsigned acceptq_head, acceptq_len;
    uint64_t dead[UCCL_DEAD_CONNS_KEPT]; /* released failed connections, oldest first */
    unsigned dead_head, dead_len;
    uint64_t reaped_at;          /* the reaper's last pass (uccl__now_ns) */
    SLIST_HEAD(, uccl__remote) remotes;
    int wake_pipe[2];            /* close() wakes the listener */
    pthread_t listener;
    int listener_started;
    struct uccl__gate gate;      /* async GPU transfers waiting for their stream */
    struct uccl__gpu_flags *flags; /* streams waiting for transfers (made on first use, under mu) */
};

/* conns.c */
/* The accept queue's bound (UCCL_P2P_ACCEPT_QUEUE), at creation; and its
 * memory, at destroy. */
int uccl__ep_conns_init(struct uccl__ep *ep);
void uccl__ep_conns_fini(struct uccl__ep *ep);
/* UCCL_ERR_CLOSED once the endpoint is closed. */
int uccl__ep_check_open(struct uccl__ep *ep);
/* The connection with id, with a reference, or NULL. */
struct uccl__conn *uccl__ep_conn_get(struct uccl__ep *ep, uint64_t id);
/* Give c an id and enter it in the table; queue: for accept(), refused
 * (UCCL_ERR_BUSY) where the accept queue is full. */
int uccl__ep_add_conn(struct uccl__ep *ep, struct uccl__conn *c, int queue);
/* Is there room in the accept queue for one more (connections whose peers
 * went away make room)?  If not, logs the refusal of the connection from
 * `peer` with the numbers and returns UCCL_ERR_BUSY. */
int uccl__ep_accept_room(struct uccl__ep *ep, const char *peer);
/* The listener, now and then: give back what failed connections hold
 * (uccl__conn_release); their ids keep answering with the failure, the
 * last UCCL_DEAD_CONNS_KEPT of them. */
void uccl__ep_reap(struct uccl__ep *ep);
/* UCCL_ERR_NOTFOUND for a conn_id the table lacks, saying what it may be. */
int uccl__ep_no_conn(uint64_t id);
/* Take connection id out of the table (a connection that could not start). */
/* Take connection id out of the table (and the accept queue): 1 if it was
 * there (the caller now holds the table's reference), 0 if another thread
 * (remove_remote_endpoint) took it first. */
int uccl__ep_del_conn(struct uccl__ep *ep, uint64_t id);
/* The table's connections (the table keeps its references); NULL if none
 * or out of memory.  Under ep->mu, or once no thread adds any. */
struct uccl__conn **uccl__ep_conn_list(struct uccl__ep *ep, size_t *n_p);

/* listen.c */
int uccl__listener_start(struct uccl__ep *ep);
/* Stop the thread and drop connections still waiting for their streams. */
void uccl__listener_stop(struct uccl__ep *ep);

/* gate.c */
void uccl__gate_init(struct uccl__gate *g);
/* Post r on c once event ev (recorded on the caller's stream) completes;
 * fail it after timeout_ns.  Takes ev. */
int uccl__gate_add(struct uccl__gate *g, struct uccl__conn *c, struct uccl__req *r, void *ev,
                   uint64_t timeout_ns);
/* Stop the thread; transfers still waiting fail (UCCL_ERR_CLOSED). */
void uccl__gate_fini(struct uccl__gate *g);

/* xfer.c */
/* Drop the table's reference to every request (endpoint destroy). */
void uccl__xfers_free(struct uccl__ep *ep);

#endif
