/* The endpoint's connection table (engine.h): whether the endpoint is
 * open, the connections by id, the accept queue, and the public calls that
 * only read them.  The listener (listen.c) and connect (engine.c) enter
 * connections here, transfers (xfer.c) look them up; this file calls none
 * of them: the endpoint's life (engine.c) stands on top. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ep/engine.h"
#include "base/log.h"
#include "base/status.h"

int uccl__ep_check_open(struct uccl__ep *ep)
{
    if (ep->closed)
        return uccl__err(UCCL_ERR_CLOSED, "the endpoint is closed");
    return UCCL_OK;
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

int uccl__ep_add_conn(struct uccl__ep *ep, struct uccl__conn *c, int queue)
{
    pthread_mutex_lock(&ep->mu);
    if (ep->closed) {
        pthread_mutex_unlock(&ep->mu);
        return uccl__err(UCCL_ERR_CLOSED, "endpoint is closed");
    }
    c->id = ++ep->next_conn_id;
    int rc = uccl__idmap_put(&ep->conns, c->id, c);
    if (rc == UCCL_OK && queue && !ep->passive) {
        if (ep->acceptq_len == UCCL_ACCEPTQ_MAX) {
            LOG_WARN("accept queue full (%d): connection %llu is not returned by accept()",
                     UCCL_ACCEPTQ_MAX, (unsigned long long)c->id);
        } else {
            ep->acceptq[(ep->acceptq_head + ep->acceptq_len++) % UCCL_ACCEPTQ_MAX] = c->id;
            pthread_cond_broadcast(&ep->cv);
        }
    }
    pthread_mutex_unlock(&ep->mu);
    return rc;
}

void uccl__ep_del_conn(struct uccl__ep *ep, uint64_t id)
{
    pthread_mutex_lock(&ep->mu);
    uccl__idmap_del(&ep->conns, id);
    pthread_mutex_unlock(&ep->mu);
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
    uint64_t id = ep->acceptq[ep->acceptq_head];
    ep->acceptq_head = (ep->acceptq_head + 1) % UCCL_ACCEPTQ_MAX;
    ep->acceptq_len--;
    struct uccl__conn *c = uccl__idmap_get(&ep->conns, id);
    if (c) {
        snprintf(ip, 46, "%s", c->link.peer_ip);
        *gpu_p = c->link.peer_gpu;
    }
    pthread_mutex_unlock(&ep->mu);
    *conn_p = id;
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
        return uccl__err(UCCL_ERR_NOTFOUND, "Invalid conn_id %llu: no such connection (never made, or removed)", (unsigned long long)conn);
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
        return uccl__err(UCCL_ERR_NOTFOUND, "Invalid conn_id %llu: no such connection (never made, or removed)", (unsigned long long)conn);
    *rank_p = c->link.peer_rank;
    uccl__conn_put(c);
    return UCCL_OK;
}
