/* Endpoints (uccl.h): creation from the environment, close and destroy,
 * connect, metadata, and the registration calls.  The endpoint's life is
 * here, on top of its parts: it starts and stops the listener (listen.c)
 * and frees the transfers (xfer.c); both, and this file, enter and find
 * connections in the table (conns.c); the connections themselves are the
 * layer below (conn.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "load/cuda_loader.h"
#include "ep/engine.h"
#include "tp/handshake.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/config.h"
#include "base/status.h"

#define DEFAULT_BASE_PORT 28500

static void read_host_id(const char *given, char *buf, size_t len)
{
    const char *env = given;
    if (!env)
        uccl__cfg_str(UCCL_CFG_P2P_HOST_ID, &env);
    if (env && *env) {
        snprintf(buf, len, "%s", env);
        return;
    }
    /* Same kernel = same host for our purposes: CMA and shared memory work. */
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    buf[0] = '\0';
    if (f) {
        if (fgets(buf, (int)len, f))
            buf[strcspn(buf, "\n")] = '\0';
        fclose(f);
    }
    if (!buf[0])
        gethostname(buf, len - 1);
}

/* ------------------------------------------------------------------------- */
/* create / close                                                             */

/* The settings of UCCL_P2P_* (timeouts, TCP streams, transport, shm mode)
 * into loc; on a bad value the reason is recorded and UCCL_ERR_INVALID or
 * UCCL_ERR_UNAVAIL returned. */
static int read_settings(struct uccl__local *loc, double timeout_s, int *base_port_p,
                         size_t *done_cap_p)
{
    _Static_assert(UCCL_MAX_STREAMS == 16, "base/config.h: UCCL_P2P_TCP_STREAMS is 1..16");
    long t_s, spin_us, streams, chunk, port, done_ids, cuda_streams;
    int rc;
    /* UCCL_P2P_CUDA_STREAMS is read where copies are split (gpu_copy.c),
     * which has no caller to raise to: checked here so a bad value raises. */
    if ((rc = uccl__cfg_long(UCCL_CFG_P2P_TIMEOUT_S, &t_s)) || /* checked even where unused */
        (rc = uccl__cfg_long(UCCL_CFG_P2P_CUDA_STREAMS, &cuda_streams)) ||
        (rc = uccl__cfg_long(UCCL_CFG_P2P_SPIN_US, &spin_us)) ||
        (rc = uccl__cfg_long(UCCL_CFG_P2P_TCP_STREAMS, &streams)) ||
        (rc = uccl__cfg_long(UCCL_CFG_P2P_TCP_CHUNK_KB, &chunk)) ||
        (rc = uccl__cfg_long(UCCL_CFG_P2P_BASE_PORT, &port)) ||
        (rc = uccl__cfg_long(UCCL_CFG_P2P_DONE_IDS, &done_ids)))
        return rc;
    double t = timeout_s > 0 ? timeout_s : (double)t_s;
    if (t > 365.0 * 86400) /* beyond a year means "forever"; keep the ns count finite */
        t = 365.0 * 86400;
    loc->timeout_ns = (uint64_t)(t * 1e9);
    loc->spin_ns = (uint64_t)spin_us * 1000ull;
    loc->num_streams = (unsigned)streams;
    loc->chunk_bytes = (size_t)chunk;
    *base_port_p = (int)port;
    *done_cap_p = (size_t)done_ids;

    /* UCCL_P2P_TRANSPORT's words are uccl__tp_names, in their order. */
    int tp;
    if ((rc = uccl__cfg_choice(UCCL_CFG_P2P_TRANSPORT, &tp)))
        return rc;
    loc->forced_tp = tp;
    if (tp != UCCL_TP_AUTO) {
        const char *name = uccl__tp_names[tp];
        /* ipc: the same-host transport, whose GPU memory moves by CUDA IPC
         * on the copy engine; it needs the CUDA driver. */
        if (loc->forced_tp == UCCL_TP_IPC) {
            if (!uccl__cuda())
                return uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_TRANSPORT=%s is unavailable: %s",
                                 name, uccl_last_error());
            loc->forced_tp = UCCL_TP_SHM;
        }
        const struct uccl__tp_ops *forced = uccl__tp_registry[loc->forced_tp];
        if (!forced)
            return uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_TRANSPORT=%s: that transport is not part "
                             "of this build (tcp and shm are)", name);
        if (forced->available())
            return uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_TRANSPORT=%s is unavailable: %s", name,
                             uccl_last_error());
    }

    int mode; /* auto|cma|ring -> -1, 0, 1 */
    if ((rc = uccl__cfg_choice(UCCL_CFG_P2P_SHM_MODE, &mode)))
        return rc;
    loc->shm_mode = mode - 1;
    /* checked here so that a bad level raises; the log itself reads it once */
    int level;
    return uccl__cfg_choice(UCCL_CFG_P2P_LOG_LEVEL, &level);
}

/* One listening socket on `ip` (NULL: every address) at port (0: any
 * free one), and, where ip is another address than loopback, the same port
 * on 127.0.0.1 too (connect_local() dials it; loopback reaches no one
 * else).  An ephemeral port taken on loopback is tried again. */
static int listen_pair(struct uccl__ep *ep, const char *ip, int port)
{
    int with_lo = ip && strcmp(ip, "127.0.0.1") != 0;
    for (int tries = 0;; tries++) {
        int rc = uccl__sock_listen(ip, port, &ep->listen_fd, &ep->local.port);
        if (rc || !with_lo)
            return rc;
        int lo_port;
        rc = uccl__sock_listen("127.0.0.1", ep->local.port, &ep->listen_lo_fd, &lo_port);
        if (rc == UCCL_OK)
            return UCCL_OK;
        close(ep->listen_fd);
        ep->listen_fd = -1;
        if (port != 0 || tries == 8)
            return rc;
    }
}

/* The listening sockets (uccl.h: port -1 tries the well-known port first).
 * With UCCL_SOCKET_IFNAME, only the address advertised (ep->ip) is bound:
 * a job kept on loopback is not reachable from the network; without it,
 * every address (the advertised one is a guess: the first interface up). */
static int open_listeners(struct uccl__ep *ep, int port)
{
    const char *ifname = NULL;
    uccl__cfg_str(UCCL_CFG_SOCKET_IFNAME, &ifname);
    const char *bind_ip = ifname && *ifname ? ep->ip : NULL;
    int rc = UCCL_ERR_UNAVAIL;
    if (port == -1) /* the well-known port first, so connect(ip, gpu) finds it */
        rc = listen_pair(ep, bind_ip,
                         ep->base_port + (ep->local.gpu_idx > 0 ? ep->local.gpu_idx : 0));
    if (rc == UCCL_ERR_UNAVAIL)
        rc = listen_pair(ep, bind_ip, port > 0 ? port : 0);
    return rc;
}

int uccl_ep_create(const struct uccl_ep_opts *o, uccl_ep_t **ep_p)
{
    if (o->port < -1 || o->port > 65535)
        return uccl__err(UCCL_ERR_INVALID, "port must be -1 (the well-known port, else any), "
                         "0 (any free port) or 1..65535, got %d", o->port);
    int status = UCCL_ERR_INVALID;
    struct uccl__ep *ep = calloc(1, sizeof(*ep));
    if (!ep)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    struct uccl__local *loc = &ep->local;
    ep->listen_fd = ep->listen_lo_fd = ep->wake_pipe[0] = ep->wake_pipe[1] = -1;
    pthread_mutex_init(&ep->mu, NULL);
    pthread_cond_init(&ep->cv, NULL);
    SLIST_INIT(&ep->remotes);
    ep->done_floor = 1; /* ids start at 1 */
    uccl__mem_init(&loc->mem, &uccl__tp_mem_hooks);
    uccl__pool_lazy_init(&loc->copy_pool);
    uccl__gate_init(&ep->gate);
    loc->gpu_idx = o->gpu_idx;
    loc->rank = o->rank;
    if (o->host_id && (!o->host_id[0] || strlen(o->host_id) >= sizeof(loc->host_id))) {
        uccl__err(UCCL_ERR_INVALID, "host id '%s': expected 1..%zu characters", o->host_id,
                  sizeof(loc->host_id) - 1);
        goto err_free;
    }
    read_host_id(o->host_id, loc->host_id, sizeof(loc->host_id));
    if ((status = read_settings(loc, o->timeout_s, &ep->base_port, &ep->done_cap)) != UCCL_OK ||
        (status = uccl__ep_conns_init(ep)) != UCCL_OK)
        goto err_free;

    const char *sec = o->secret;
    size_t slen = o->secret_len;
    if (!sec) {
        uccl__cfg_str(UCCL_CFG_P2P_SECRET, &sec);
        slen = sec ? strlen(sec) : 0;
    }
    if (slen > UCCL_SECRET_MAX) {
        status = uccl__err(UCCL_ERR_INVALID, "the secret is %zu bytes; at most %d are allowed",
                           slen, UCCL_SECRET_MAX);
        goto err_free;
    }
    if (slen) /* sec may be NULL (no secret): memcpy's pointers must not be */
        memcpy(loc->secret, sec, slen);
    loc->secret_len = (uint32_t)slen;

    if ((status = uccl__sock_local_ip(ep->ip, sizeof(ep->ip))) != UCCL_OK)
        goto err_free;
    if ((status = open_listeners(ep, o->port)) != UCCL_OK)
        goto err_free;
    if ((status = uccl__listener_start(ep)) != UCCL_OK)
        goto err_close;
    if (loc->secret_len == 0)
        LOG_INFO("endpoint on port %d has no secret: its connections are unauthenticated "
                 "(set UCCL_P2P_SECRET)", loc->port);
    *ep_p = ep;
    return UCCL_OK;

err_close:
    close(ep->listen_fd);
    if (ep->listen_lo_fd >= 0)
        close(ep->listen_lo_fd);
    if (ep->wake_pipe[0] >= 0) {
        close(ep->wake_pipe[0]);
        close(ep->wake_pipe[1]);
    }
err_free:
    uccl__ep_conns_fini(ep);
    uccl__pool_lazy_free(&loc->copy_pool);
    uccl__mem_fini(&loc->mem);
    pthread_mutex_destroy(&ep->mu);
    pthread_cond_destroy(&ep->cv);
    free(ep);
    return status;
}

void uccl_ep_close(uccl_ep_t *ep)
{
    pthread_mutex_lock(&ep->mu);
    if (ep->closed) {
        pthread_mutex_unlock(&ep->mu);
        return;
    }
    ep->closed = 1;
    pthread_cond_broadcast(&ep->cv);
    pthread_mutex_unlock(&ep->mu);
    uccl__gate_fini(&ep->gate); /* its transfers fail before their connections close */
    uccl__pool_lazy_close(&ep->local.copy_pool);
    uccl__listener_stop(ep);
    /* No new connection can appear now: close each one (joins its threads). */
    pthread_mutex_lock(&ep->mu);
    size_t n;
    struct uccl__conn **v = uccl__ep_conn_list(ep, &n);
    pthread_mutex_unlock(&ep->mu);
    for (size_t i = 0; i < n; i++)
        uccl__conn_close(v[i]);
    free(v);
}

void uccl_ep_destroy(uccl_ep_t *ep)
{
    if (!ep)
        return;
    uccl_ep_close(ep);
    uccl__xfers_free(ep);
    uccl__ep_conns_fini(ep);
    size_t n;
    struct uccl__conn **v = uccl__ep_conn_list(ep, &n);
    for (size_t i = 0; i < n; i++)
        uccl__conn_put(v[i]);
    free(v);
    uccl__idmap_free(&ep->conns);
    uccl__idmap_free(&ep->incomplete);
    uccl__gpu_flags_free(ep->flags); /* every request finished: no slot is taken */
    uccl__mem_fini(&ep->local.mem);
    uccl__pool_lazy_free(&ep->local.copy_pool); /* every connection is gone: no copy runs */
    for (struct uccl__remote *r; (r = SLIST_FIRST(&ep->remotes));) {
        SLIST_REMOVE_HEAD(&ep->remotes, link);
        free(r);
    }
    if (ep->listen_fd >= 0)
        close(ep->listen_fd);
    if (ep->listen_lo_fd >= 0)
        close(ep->listen_lo_fd);
    if (ep->wake_pipe[0] >= 0) {
        close(ep->wake_pipe[0]);
        close(ep->wake_pipe[1]);
    }
    pthread_mutex_destroy(&ep->mu);
    pthread_cond_destroy(&ep->cv);
    free(ep);
}

/* ------------------------------------------------------------------------- */
/* metadata, connect, accept                                                  */

void uccl_ep_addr(uccl_ep_t *ep, char ip[46], int *port_p)
{
    snprintf(ip, 46, "%s", ep->ip);
    *port_p = ep->local.port;
}

uint64_t uccl_ep_timeout_ns(uccl_ep_t *ep) { return ep->local.timeout_ns; }

const char *uccl_ep_host_id(uccl_ep_t *ep) { return ep->local.host_id; }

int uccl_ep_metadata(uccl_ep_t *ep, uint8_t *out, size_t out_len, size_t *len_p)
{
    if (out_len < UCCL_META_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "metadata buffer too small");
    const struct uccl__local *loc = &ep->local;
    struct uccl__meta m = {.port = (uint32_t)loc->port, .gpu_idx = loc->gpu_idx,
                           .secret_len = loc->secret_len};
    snprintf(m.ip, sizeof(m.ip), "%s", ep->ip);
    snprintf(m.host_id, sizeof(m.host_id), "%s", loc->host_id);
    memcpy(m.secret, loc->secret, loc->secret_len);
    /* Without a secret, upstream's own form: its scripts parse it themselves. */
    if (loc->secret_len == 0 && uccl__meta_encode_upstream(&m, out) == UCCL_OK) {
        *len_p = UCCL_META_UPSTREAM_SIZE;
        return UCCL_OK;
    }
    uccl__meta_encode(&m, out);
    *len_p = UCCL_META_SIZE;
    return UCCL_OK;
}

int uccl_local_ip(char *buf, size_t len) { return uccl__sock_local_ip(buf, len); }

int uccl_parse_metadata(const uint8_t *in, size_t in_len, char ip[46], int *port_p, int *gpu_p)
{
    struct uccl__meta m;
    int rc = uccl__meta_decode(in, in_len, &m);
    if (rc)
        return rc;
    snprintf(ip, 46, "%s", m.ip);
    *port_p = (int)m.port;
    *gpu_p = m.gpu_idx;
    return UCCL_OK;
}

int uccl_ep_connect(uccl_ep_t *ep, const char *ip, int port, int remote_gpu, int expect_rank,
                    const uint8_t *secret, size_t secret_len, uint64_t *conn_p)
{
    int rc = uccl__ep_check_open(ep), fd = -1;
    if (rc)
        return rc;
    if (port < 0)
        port = ep->base_port + (remote_gpu > 0 ? remote_gpu : 0);
    if (!secret) {
        secret = ep->local.secret;
        secret_len = ep->local.secret_len;
    }
    if (secret_len > UCCL_SECRET_MAX)
        return uccl__err(UCCL_ERR_INVALID, "secret of %zu bytes (at most %d)", secret_len,
                         UCCL_SECRET_MAX);
    uint64_t deadline = uccl__now_ns() + ep->local.timeout_ns;
    rc = uccl__sock_connect(ip, port, deadline, &fd);
    if (rc)
        return rc;
    struct uccl__conn *c = uccl__conn_new(&ep->local, 1, fd);
    if (!c) {
        close(fd);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    c->link.token = uccl__random64();
    c->link.num_streams = ep->local.num_streams;
    c->link.chunk_bytes = ep->local.chunk_bytes;
    c->link.peer_rank = -1;
    c->link.peer_port = port;
    c->link.peer_gpu = remote_gpu;
    c->link.secret_len = (uint32_t)secret_len;
    memcpy(c->link.secret, secret, secret_len);
    snprintf(c->link.peer_ip, sizeof(c->link.peer_ip), "%s", ip);

    struct uccl__hello ack;
    rc = uccl__handshake(&c->link, fd, UCCL_HS_CONN, 0, deadline, &ack);
    if (rc)
        goto err_conn;
    if (expect_rank >= 0 && ack.rank != expect_rank) {
        rc = uccl__err(UCCL_ERR_MISMATCH, "%s:%d is rank %d, but rank %d was expected there "
                       "(a stale or foreign endpoint on that port?)", ip, port, (int)ack.rank,
                       expect_rank);
        goto err_conn;
    }
    c->link.peer_rank = ack.rank;
    c->link.peer_pid = ack.pid;
    c->link.peer_gpu = ack.gpu_idx;
    snprintf(c->link.peer_host, sizeof(c->link.peer_host), "%s", ack.host_id);
    if (ack.transport >= UCCL_TP_COUNT || !uccl__tp_registry[ack.transport]) {
        rc = uccl__err(UCCL_ERR_PROTO, "peer chose transport %u, unknown here", ack.transport);
        goto err_conn;
    }
    c->link.tp = uccl__tp_registry[ack.transport];
    rc = c->link.tp->conn_connected(&c->link, &ack, deadline);
    if (rc)
        goto err_conn;
    rc = uccl__ep_add_conn(ep, c, 0);
    if (rc)
        goto err_conn;
    rc = uccl__conn_start(c);
    if (rc) {
        uccl__ep_del_conn(ep, c->id);
        goto err_conn;
    }
    LOG_INFO("connection %llu to %s:%d over %s", (unsigned long long)c->id, ip, port,
             c->link.tp->name);
    *conn_p = c->id;
    return UCCL_OK;

err_conn:
    uccl__conn_close(c);
    uccl__conn_put(c);
    return rc;
}

int uccl_ep_connect_meta(uccl_ep_t *ep, const uint8_t *meta, size_t meta_len, uint64_t *conn_p)
{
    struct uccl__meta m;
    int rc = uccl__meta_decode(meta, meta_len, &m);
    if (rc)
        return rc;
    pthread_mutex_lock(&ep->mu);
    struct uccl__remote *r;
    SLIST_FOREACH(r, &ep->remotes, link) {
        struct uccl__conn *c = uccl__idmap_get(&ep->conns, r->conn_id);
        if (strcmp(r->ip, m.ip) == 0 && r->port == (int)m.port && c &&
            !atomic_load(&c->link.failed)) {
            *conn_p = r->conn_id;
            pthread_mutex_unlock(&ep->mu);
            return UCCL_OK;
        }
    }
    pthread_mutex_unlock(&ep->mu);
    uint64_t id;
    rc = uccl_ep_connect(ep, m.ip, (int)m.port, m.gpu_idx, -1,
                         m.secret_len ? m.secret : NULL, m.secret_len, &id);
    if (rc)
        return rc;
    r = calloc(1, sizeof(*r));
    if (r) {
        snprintf(r->ip, sizeof(r->ip), "%s", m.ip);
        r->port = (int)m.port;
        r->conn_id = id;
        pthread_mutex_lock(&ep->mu);
        SLIST_INSERT_HEAD(&ep->remotes, r, link);
        pthread_mutex_unlock(&ep->mu);
    }
    *conn_p = id;
    return UCCL_OK;
}

void uccl_ep_set_spin_ns(uccl_ep_t *ep, uint64_t ns) { ep->local.spin_ns = ns; }

/* ------------------------------------------------------------------------- */
/* memory                                                                     */

int uccl_ep_reg(uccl_ep_t *ep, uintptr_t addr, size_t len, uint64_t *mr_p)
{
    int rc = uccl__ep_check_open(ep);
    return rc ? rc : uccl__mem_reg(&ep->local.mem, addr, len, mr_p);
}

/* dereg's last resort: a peer access that would not end.  conn_id 0 (a
 * window offered to any connection): each accepted connection may be it. */
static void stop_conn(void *arg, uint64_t conn_id, uint64_t mr_id)
{
    struct uccl__ep *ep = arg;
    size_t n = 0;
    struct uccl__conn **v = NULL, *one = NULL;
    if (conn_id == 0) {
        pthread_mutex_lock(&ep->mu);
        v = uccl__ep_conn_list(ep, &n);
        for (size_t i = 0; i < n; i++)
            uccl__conn_get(v[i]);
        pthread_mutex_unlock(&ep->mu);
    } else if ((one = uccl__ep_conn_get(ep, conn_id)) != NULL) {
        v = &one;
        n = 1;
    }
    for (size_t i = 0; i < n; i++) {
        if (!v[i]->link.is_connector)
            uccl__conn_fail(v[i], UCCL_ERR_TIMEOUT, "region %llu was deregistered while the "
                            "peer was still reading or writing it", (unsigned long long)mr_id);
        uccl__conn_put(v[i]);
    }
    if (v != &one)
        free(v);
}

int uccl_ep_dereg(uccl_ep_t *ep, uint64_t mr_id)
{
    return uccl__mem_dereg(&ep->local.mem, mr_id, ep->local.timeout_ns, stop_conn, ep);
}

int uccl_ep_advertise(uccl_ep_t *ep, uint64_t conn, uint64_t mr, uintptr_t addr, size_t len,
                      uint8_t *out, size_t out_len)
{
    int rc = uccl__ep_check_open(ep);
    if (rc)
        return rc;
    if (out_len < UCCL_FIFO_ITEM_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "fifo item buffer too small");
    struct uccl__conn *c = conn ? uccl__ep_conn_get(ep, conn) : NULL;
    if (conn && !c)
        return uccl__ep_no_conn(conn);
    int acceptor = !c || !c->link.is_connector;
    if (c)
        uccl__conn_put(c);
    if (!acceptor)
        return uccl__err(UCCL_ERR_INVALID, "conn_id %llu was made by connect(): advertise on "
                         "the accepting side, whose peer then reads or writes",
                         (unsigned long long)conn);
    struct uccl__fifo_item f;
    rc = uccl__mem_advertise(&ep->local.mem, conn, mr, addr, len, &f);
    if (rc == UCCL_OK)
        uccl__fifo_encode(&f, out);
    return rc;
}
