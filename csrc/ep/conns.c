/* The endpoint's connection table (engine.h): whether the endpoint is
 * open, the connections by id, the accept queue, the public calls that
 * only read them, remove_remote_endpoint, and the reaper that gives back
 * what failed connections hold.  The listener (listen.c) and connect
 * (engine.c) enter connections here, transfers (xfer.c) look them up; this
 * file calls none of them: the endpoint's life (engine.c) stands on top.
 *
 * What a peer can make the table hold is bounded: connections accept()
 * has not returned (UCCL_P2P_ACCEPT_QUEUE; past it a connection is refused
 * in its handshake), and failed ones, which keep only their ids and the
 * reason (the last UCCL_DEAD_CONNS_KEPT). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ep/engine.h"
#include "base/config.h"
#include "base/log.h"
#include "base/status.h"

#define REAP_EVERY_NS 100000000ull /* the reaper's passes, at most this often */
#define REAP_BATCH 64              /* connections looked at per round of a pass */
#define REAP_BUDGET_NS 20000000ull /* a pass's rounds stop after this long (the listener waits) */

int uccl__ep_conns_init(struct uccl__ep *ep)
{
    long cap;
    int rc = uccl__cfg_long(UCCL_CFG_P2P_ACCEPT_QUEUE, &cap);
    if (rc)
        return rc;
    ep->acceptq = calloc((size_t)cap, sizeof(*ep->acceptq));
    if (!ep->acceptq)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory (an accept queue of %ld)", cap);
    ep->acceptq_cap = (unsigned)cap;
    return UCCL_OK;
}

void uccl__ep_conns_fini(struct uccl__ep *ep)
{
    for (; ep->acceptq_len > 0; ep->acceptq_len--) {
        uccl__conn_put(ep->acceptq[ep->acceptq_head]);
        ep->acceptq_head = (ep->acceptq_head + 1) % ep->acceptq_cap;
    }
    free(ep->acceptq);
    ep->acceptq = NULL;
}

int uccl__ep_check_open(struct uccl__ep *ep)
{
    if (ep->closed)
        return uccl__err(UCCL_ERR_CLOSED, "the endpoint is closed");
    return UCCL_OK;
}

int uccl__ep_no_conn(uint64_t id)
{
    return uccl__err(UCCL_ERR_NOTFOUND, "Invalid conn_id %llu: no such connection (never made, "
                     "removed, or failed long ago: an endpoint remembers its last %d failed "
                     "connections)", (unsigned long long)id, UCCL_DEAD_CONNS_KEPT);
}

struct uccl__conn *uccl__ep_conn_get(struct uccl__ep *ep, uint64_t id)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__conn *c = uccl__idmap_get(&ep->conns, id);
    if (c)
        uccl__conn_get(c);
    pthread_mutex_unlock(&ep->mu);
    return c;
}

/* Under ep->mu: keep in the accept queue only the connections that keep
 * (a failed one is dropped where `drop_failed`, or if it is c); returns how
 * many went.  Their references are put after the lock (*gone, at most
 * acceptq_cap). */
static unsigned acceptq_filter(struct uccl__ep *ep, int drop_failed, const struct uccl__conn *c,
                               struct uccl__conn **gone)
{
    unsigned kept = 0, n = 0;
    for (unsigned i = 0; i < ep->acceptq_len; i++) {
        struct uccl__conn *q = ep->acceptq[(ep->acceptq_head + i) % ep->acceptq_cap];
        if (q == c || (drop_failed && atomic_load(&q->link.failed)))
            gone[n++] = q;
        else
            ep->acceptq[(ep->acceptq_head + kept++) % ep->acceptq_cap] = q;
    }
    ep->acceptq_len = kept;
    return n;
}

static void put_all(struct uccl__conn **v, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        uccl__conn_put(v[i]);
    free(v);
}

/* Under ep->mu: connections bound for the accept queue: in it, and those
 * of the listener still waiting for their data streams (admitted already). */
static size_t acceptq_taken(const struct uccl__ep *ep)
{
    return ep->acceptq_len + ep->incomplete.live;
}

/* Under ep->mu: is there room in the accept queue?  Connections whose
 * peers went away before accept() returned them make room (their ids keep
 * answering in the table); *gone as in acceptq_filter. */
static int acceptq_room(struct uccl__ep *ep, struct uccl__conn ***gone_p, unsigned *ngone_p)
{
    *gone_p = NULL;
    *ngone_p = 0;
    if (ep->passive || acceptq_taken(ep) < ep->acceptq_cap)
        return 1;
    struct uccl__conn **gone = ep->acceptq_len ? malloc(ep->acceptq_len * sizeof(*gone)) : NULL;
    if (!gone)
        return 0;
    *ngone_p = acceptq_filter(ep, 1, NULL, gone);
    *gone_p = gone;
    return acceptq_taken(ep) < ep->acceptq_cap;
}

static void log_made_room(unsigned n)
{
    if (n)
        LOG_WARN("dropped %u connections from the accept queue: their peers went away before "
                 "accept() returned them", n);
}

int uccl__ep_accept_room(struct uccl__ep *ep, const char *peer)
{
    struct uccl__conn **gone;
    unsigned ngone;
    pthread_mutex_lock(&ep->mu);
    int room = acceptq_room(ep, &gone, &ngone);
    unsigned len = (unsigned)acceptq_taken(ep), cap = ep->acceptq_cap;
    pthread_mutex_unlock(&ep->mu);
    put_all(gone, ngone);
    log_made_room(ngone);
    if (room)
        return UCCL_OK;
    LOG_WARN("refused connection from %s: %u connections wait for accept() already, the most "
             "allowed (UCCL_P2P_ACCEPT_QUEUE=%u)", peer, len, cap);
    return uccl__err(UCCL_ERR_BUSY, "%u connections wait for accept() already, the most allowed "
                     "(UCCL_P2P_ACCEPT_QUEUE=%u)", len, cap);
}

int uccl__ep_add_conn(struct uccl__ep *ep, struct uccl__conn *c, int queue)
{
    struct uccl__conn **gone = NULL;
    unsigned ngone = 0;
    int rc = UCCL_OK;
    pthread_mutex_lock(&ep->mu);
    queue = queue && !ep->passive;
    if (ep->closed)
        rc = uccl__err(UCCL_ERR_CLOSED, "endpoint is closed");
    else if (queue && !acceptq_room(ep, &gone, &ngone)) /* filled since its handshake began */
        rc = uccl__err(UCCL_ERR_BUSY, "%zu connections wait for accept() already, the most "
                       "allowed (UCCL_P2P_ACCEPT_QUEUE=%u)", acceptq_taken(ep), ep->acceptq_cap);
    if (rc == UCCL_OK) {
        c->id = ++ep->next_conn_id;
        rc = uccl__idmap_put(&ep->conns, c->id, c);
    }
    if (rc == UCCL_OK && queue) {
        uccl__conn_get(c); /* the queue's reference */
        ep->acceptq[(ep->acceptq_head + ep->acceptq_len++) % ep->acceptq_cap] = c;
        pthread_cond_broadcast(&ep->cv);
    }
    pthread_mutex_unlock(&ep->mu);
    put_all(gone, ngone);
    log_made_room(ngone);
    return rc;
}

int uccl__ep_del_conn(struct uccl__ep *ep, uint64_t id)
{
    struct uccl__conn *gone[1];
    pthread_mutex_lock(&ep->mu);
    struct uccl__conn *c = uccl__idmap_del(&ep->conns, id);
    unsigned queued = c ? acceptq_filter(ep, 0, c, gone) : 0; /* not for accept() either */
    pthread_mutex_unlock(&ep->mu);
    if (queued)
        uccl__conn_put(c);
    return c != NULL;
}

/* Under ep->mu: add_remote_endpoint's entries for connection id go (it
 * connects afresh next time). */
static void drop_remotes(struct uccl__ep *ep, uint64_t id)
{
    struct uccl__remote *r = SLIST_FIRST(&ep->remotes), *next;
    for (; r; r = next) {
        next = SLIST_NEXT(r, link);
        if (r->conn_id == id) {
            SLIST_REMOVE(&ep->remotes, r, uccl__remote, link);
            free(r);
        }
    }
}

int uccl_ep_conn_remove(uccl_ep_t *ep, uint64_t conn)
{
    struct uccl__conn *gone[1];
    pthread_mutex_lock(&ep->mu);
    struct uccl__conn *c = ep->closed ? NULL : uccl__idmap_del(&ep->conns, conn);
    unsigned queued = 0;
    if (c) {
        drop_remotes(ep, conn);
        queued = acceptq_filter(ep, 0, c, gone); /* accept() must not return it any more */
    }
    pthread_mutex_unlock(&ep->mu);
    if (!c)
        return uccl__ep_no_conn(conn);
    if (queued)
        uccl__conn_put(c);
    uccl__conn_close(c); /* fails what is pending on it, tells the peer, joins its threads */
    uccl__conn_release(c, 1); /* its resources now, unless a caller is still inside */
    uccl__mem_drop_conn(&ep->local.mem, conn);
    uccl__conn_put(c);   /* the table's reference */
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* the reaper                                                                 */

/* The failed connections not released yet, the oldest (lowest ids) first,
 * at most REAP_BATCH: the ones remembered longest are the newest. */
struct reap_ctx { struct uccl__conn *v[REAP_BATCH]; unsigned n; uint64_t after; };
static void find_failed(uint64_t k, void *v, void *arg)
{
    struct reap_ctx *r = arg;
    struct uccl__conn *c = v;
    if (k <= r->after || !atomic_load(&c->link.failed) || c->released)
        return;
    if (r->n == REAP_BATCH && k > r->v[REAP_BATCH - 1]->id)
        return;
    unsigned i = r->n < REAP_BATCH ? r->n++ : REAP_BATCH - 1; /* the newest drops out */
    for (; i > 0 && r->v[i - 1]->id > k; i--)
        r->v[i] = r->v[i - 1];
    r->v[i] = c;
}

/* Under ep->mu: is c in the accept queue (which holds a reference)? */
static int queued(const struct uccl__ep *ep, const struct uccl__conn *c)
{
    for (unsigned i = 0; i < ep->acceptq_len; i++)
        if (ep->acceptq[(ep->acceptq_head + i) % ep->acceptq_cap] == c)
            return 1;
    return 0;
}

/* Under ep->mu: released connection id joins the ones remembered; the
 * oldest past UCCL_DEAD_CONNS_KEPT is forgotten (returned, to be put). */
static struct uccl__conn *remember_dead(struct uccl__ep *ep, uint64_t id)
{
    struct uccl__conn *old = NULL;
    if (ep->dead_len == UCCL_DEAD_CONNS_KEPT) {
        uint64_t oid = ep->dead[ep->dead_head];
        ep->dead_head = (ep->dead_head + 1) % UCCL_DEAD_CONNS_KEPT;
        ep->dead_len--;
        old = uccl__idmap_del(&ep->conns, oid); /* NULL if removed meanwhile */
        if (old)
            drop_remotes(ep, oid);
    }
    ep->dead[(ep->dead_head + ep->dead_len++) % UCCL_DEAD_CONNS_KEPT] = id;
    return old;
}

/* One round: the failed connections with ids above `after` (up to
 * REAP_BATCH); returns how many it looked at, *after_p: where the next
 * round starts. */
static unsigned reap_round(struct uccl__ep *ep, uint64_t *after_p)
{
    struct reap_ctx r = {.n = 0, .after = *after_p};
    int expect[REAP_BATCH];
    pthread_mutex_lock(&ep->mu);
    if (!ep->closed)
        uccl__idmap_each(&ep->conns, find_failed, &r);
    for (unsigned i = 0; i < r.n; i++) {
        uccl__conn_get(r.v[i]);
        expect[i] = 2 + queued(ep, r.v[i]); /* the table's, ours, the queue's */
    }
    uint64_t last = r.n ? r.v[r.n - 1]->id : 0;
    pthread_mutex_unlock(&ep->mu);
    for (unsigned i = 0; i < r.n; i++) {
        struct uccl__conn *c = r.v[i], *old = NULL;
        if (uccl__conn_release(c, expect[i])) {
            LOG_INFO("connection %llu: released (%s); its id answers with that",
                     (unsigned long long)c->id, c->fail_msg);
            uccl__mem_drop_conn(&ep->local.mem, c->id);
            pthread_mutex_lock(&ep->mu);
            if (uccl__idmap_get(&ep->conns, c->id) == c)
                old = remember_dead(ep, c->id);
            pthread_mutex_unlock(&ep->mu);
        }
        uccl__conn_put(c);
        uccl__conn_put(old); /* the table's reference to the one forgotten */
    }
    if (r.n)
        *after_p = last; /* one that cannot go yet holds up no other */
    return r.n;
}

void uccl__ep_reap(struct uccl__ep *ep)
{
    uint64_t start = uccl__now_ns(), after = 0;
    if (start - ep->reaped_at < REAP_EVERY_NS)
        return;
    ep->reaped_at = start; /* the listener's own field */
    while (reap_round(ep, &after) == REAP_BATCH && uccl__now_ns() - start < REAP_BUDGET_NS)
        ;
}

static void collect_conn(uint64_t k, void *v, void *arg)
{
    (void)k;
    struct uccl__conn ***pp = arg;
    *(*pp)++ = v;
}

/* The table's connections (the table keeps its references); NULL if none
 * or out of memory.  Under ep->mu, or once no thread adds any. */
struct uccl__conn **uccl__ep_conn_list(struct uccl__ep *ep, size_t *n_p)
{
    size_t n = ep->conns.live;
    struct uccl__conn **v = calloc(n + 1, sizeof(*v)), **p = v;
    if (v)
        uccl__idmap_each(&ep->conns, collect_conn, &p);
    *n_p = v ? n : 0;
    return v;
}

int uccl_ep_accept(uccl_ep_t *ep, uint64_t timeout_ns, uint64_t *conn_p, char ip[46], int *gpu_p)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t t = (uint64_t)ts.tv_nsec + timeout_ns;
    ts.tv_sec += (time_t)(t / 1000000000ull);
    ts.tv_nsec = (long)(t % 1000000000ull);
    pthread_mutex_lock(&ep->mu);
    if (ep->passive) {
        pthread_mutex_unlock(&ep->mu);
        return uccl__err(UCCL_ERR_INVALID, "passive accept is on: connections are accepted in "
                         "the background and accept() returns none");
    }
    while (!ep->closed && ep->acceptq_len == 0)
        if (pthread_cond_timedwait(&ep->cv, &ep->mu, &ts) == ETIMEDOUT)
            break;
    if (ep->closed || ep->acceptq_len == 0) {
        int closed = ep->closed;
        pthread_mutex_unlock(&ep->mu);
        return closed ? uccl__err(UCCL_ERR_CLOSED, "the endpoint is closed") : UCCL_INPROGRESS;
    }
    struct uccl__conn *c = ep->acceptq[ep->acceptq_head];
    ep->acceptq_head = (ep->acceptq_head + 1) % ep->acceptq_cap;
    ep->acceptq_len--;
    pthread_mutex_unlock(&ep->mu);
    snprintf(ip, 46, "%s", c->link.peer_ip);
    *gpu_p = c->link.peer_gpu;
    *conn_p = c->id;
    uccl__conn_put(c); /* the queue's reference */
    return UCCL_OK;
}

int uccl_ep_set_passive(uccl_ep_t *ep)
{
    pthread_mutex_lock(&ep->mu);
    ep->passive = 1;
    pthread_mutex_unlock(&ep->mu);
    return uccl__ep_check_open(ep);
}

int uccl_ep_conn_transport(uccl_ep_t *ep, uint64_t conn, char *buf, size_t len)
{
    struct uccl__conn *c = uccl__ep_conn_get(ep, conn);
    if (!c)
        return uccl__ep_no_conn(conn);
    if (c->link.tp == &uccl__tp_shm)
        snprintf(buf, len, "shm-%s", c->link.direct ? "cma" : "ring");
    else
        snprintf(buf, len, "%s", c->link.tp->name);
    uccl__conn_put(c);
    return UCCL_OK;
}

int uccl_ep_conn_peer_rank(uccl_ep_t *ep, uint64_t conn, int *rank_p)
{
    struct uccl__conn *c = uccl__ep_conn_get(ep, conn);
    if (!c)
        return uccl__ep_no_conn(conn);
    *rank_p = c->link.peer_rank;
    uccl__conn_put(c);
    return UCCL_OK;
}
