/* Endpoints: listener and handshake, the tables of connections, memory
 * regions, advertised windows and transfers, and the public C API. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine.h"
#include "pool.h"
#include "log.h"
#include "sock.h"
#include "status.h"

/* Transports by wire id; NULL where this build has none yet. */
static const struct uccl__tp_ops *const tp_registry[UCCL_TP_COUNT] = {
    [UCCL_TP_TCP] = &uccl__tp_tcp,
    [UCCL_TP_SHM] = &uccl__tp_shm,
};
static const char *const tp_names[UCCL_TP_COUNT] = {"auto", "tcp", "shm", "ipc", "rdma"};

/* A finished transfer keeps answering until release(); once its success
 * has been reported, the table keeps only this marker, not the request. */
static const char done_marker;
#define DONE_MARK ((void *)&done_marker)

#define HANDSHAKE_NS (10ull * 1000000000ull) /* a peer gets this long to say hello */
#define MAX_PENDING 64
#define DEFAULT_BASE_PORT 28500

struct uccl__remote {
    char ip[46];
    int port;
    uint64_t conn_id;
    struct uccl__remote *next;
};

uint64_t uccl__random64(void)
{
    uint64_t v = 0;
    while (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v))
        ;
    return v ? v : 1;
}

static void read_host_id(const char *given, char *buf, size_t len)
{
    const char *env = given ? given : getenv("UCCL_P2P_HOST_ID");
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
/* tables                                                                     */

static struct uccl__conn *conn_lookup(struct uccl__ep *ep, uint64_t id)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__conn *c = uccl__idmap_get(&ep->conns, id);
    if (c)
        uccl__conn_get(c);
    pthread_mutex_unlock(&ep->mu);
    return c;
}

static int add_conn(struct uccl__ep *ep, struct uccl__conn *c, int queue)
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

struct uccl__window *uccl__ep_window_check(struct uccl__ep *ep, uint64_t conn_id,
                                           uint64_t window, uint64_t token, uint64_t offset,
                                           uint64_t len, int *status_p)
{
    struct uccl__window *copy = NULL;
    pthread_mutex_lock(&ep->mu);
    struct uccl__window *w = uccl__idmap_get(&ep->windows, window);
    if (!w || w->conn_id != conn_id || w->token != token) {
        *status_p = uccl__err(UCCL_ERR_NOTFOUND, "window %llu was not advertised on "
                              "connection %llu (or its token is wrong)",
                              (unsigned long long)window, (unsigned long long)conn_id);
    } else if (offset > w->len || len > w->len - offset) {
        *status_p = uccl__err(UCCL_ERR_ACCESS, "[%llu, +%llu) is outside the %zu advertised "
                              "bytes of window %llu", (unsigned long long)offset,
                              (unsigned long long)len, w->len, (unsigned long long)window);
    } else if ((copy = malloc(sizeof(*copy))) != NULL) {
        *copy = *w;
        copy->mr = uccl__idmap_get(&ep->mrs, w->mr_id); /* present: dereg drops windows first */
        if (copy->mr)
            copy->mr->inflight++;
    } else {
        *status_p = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_unlock(&ep->mu);
    return copy;
}

/* A region no peer can reach any more: undo each transport's registration. */
static void mr_free(struct uccl__ep *ep, struct uccl__mr *mr)
{
    for (int i = 0; i < UCCL_TP_COUNT; i++)
        if (tp_registry[i] && tp_registry[i]->mem_dereg && mr->tp_priv[i])
            tp_registry[i]->mem_dereg(ep, mr);
    free(mr);
}

void uccl__ep_release_hold(struct uccl__ep *ep, struct uccl__mr *mr)
{
    if (!mr)
        return;
    pthread_mutex_lock(&ep->mu);
    int last = --mr->inflight == 0;
    if (last)
        pthread_cond_broadcast(&ep->cv);
    int gone = last && mr->dead && !mr->waiting;
    pthread_mutex_unlock(&ep->mu);
    if (gone)
        mr_free(ep, mr);
}

/* ------------------------------------------------------------------------- */
/* accepting: the listener thread                                             */

struct pending {
    int fd;
    size_t got;
    uint64_t deadline;
    uint8_t buf[UCCL_HELLO_SIZE];
    char name[64];
};

struct incomplete {               /* an accepted connection still missing streams */
    struct uccl__conn *conn;
    unsigned have, need;
    uint64_t deadline;
};

static void send_ack(int fd, const struct uccl__ep *ep, int status, struct uccl__hello *ack)
{
    struct uccl__hello a;
    if (!ack) {
        memset(&a, 0, sizeof(a));
        a.num_streams = 1;
        a.chunk_bytes = 4096;
        ack = &a;
    }
    ack->type = UCCL_HELLO_ACK;
    ack->status = status;
    ack->pid = (uint32_t)getpid();
    ack->gpu_idx = ep->gpu_idx;
    ack->rank = ep->rank;
    ack->listen_port = (uint32_t)ep->port;
    ack->probe_addr = (uint64_t)(uintptr_t)&ep->probe_word;
    ack->probe_cookie = ep->probe_word;
    snprintf(ack->host_id, sizeof(ack->host_id), "%s", ep->host_id);
    uint8_t buf[UCCL_HELLO_SIZE];
    uccl__hello_encode(ack, buf);
    uccl__sock_send_all(fd, buf, sizeof(buf), uccl__now_ns() + HANDSHAKE_NS);
}

static int secret_ok(const struct uccl__ep *ep, const struct uccl__hello *h)
{
    if (ep->secret_len == 0)
        return 1;
    /* Constant time over the whole field: no early exit on the first difference. */
    unsigned diff = h->secret_len ^ ep->secret_len;
    for (unsigned i = 0; i < UCCL_SECRET_MAX; i++)
        diff |= (unsigned)(h->secret[i] ^ ep->secret[i]);
    return diff == 0;
}

static int choose_transport(struct uccl__ep *ep, const struct uccl__hello *h, int *tp_p)
{
    int want = h->transport != UCCL_TP_AUTO ? (int)h->transport : ep->forced_tp;
    int same_host = strcmp(h->host_id, ep->host_id) == 0;
    if (want == UCCL_TP_AUTO)
        want = same_host && tp_registry[UCCL_TP_SHM]->available() == UCCL_OK ? UCCL_TP_SHM
                                                                              : UCCL_TP_TCP;
    if (!tp_registry[want])
        return uccl__err(UCCL_ERR_UNAVAIL, "transport '%s' is not part of this build (only "
                         "tcp and shm are)", tp_names[want]);
    if (want == UCCL_TP_SHM && !same_host)
        return uccl__err(UCCL_ERR_UNAVAIL, "transport 'shm' needs both ends on one host, but "
                         "the host ids differ ('%s' here, '%s' there)", ep->host_id, h->host_id);
    int rc = tp_registry[want]->available();
    if (rc)
        return rc;
    *tp_p = want;
    return UCCL_OK;
}

static void start_accepted(struct uccl__ep *ep, struct uccl__conn *c)
{
    int rc = add_conn(ep, c, 1);
    if (rc == UCCL_OK)
        rc = uccl__conn_start(c);
    if (rc) {
        LOG_WARN("accepted connection from %s could not start: %s", c->peer_ip, uccl_last_error());
        pthread_mutex_lock(&ep->mu);
        if (c->id)
            uccl__idmap_del(&ep->conns, c->id);
        pthread_mutex_unlock(&ep->mu);
        uccl__conn_close(c);
        uccl__conn_put(c);
        return;
    }
    LOG_INFO("accepted connection %llu from %s:%d over %s", (unsigned long long)c->id,
             c->peer_ip, c->peer_port, c->tp->name);
}

/* Returns 1 if the fd now belongs to a connection, 0 if the caller closes it. */
static int on_hello(struct uccl__ep *ep, struct pending *p)
{
    struct uccl__hello h, ack;
    int rc = uccl__hello_decode(p->buf, &h);
    if (rc == UCCL_OK && h.type == UCCL_HELLO_ACK)
        rc = uccl__err(UCCL_ERR_PROTO, "handshake: unexpected ACK");
    if (rc) {
        LOG_WARN("dropped connection from %s: %s", p->name, uccl_last_error());
        return 0;
    }
    if (!secret_ok(ep, &h)) {
        LOG_WARN("dropped connection from %s: wrong or missing secret (UCCL_P2P_SECRET)", p->name);
        send_ack(p->fd, ep, UCCL_ERR_AUTH, NULL);
        return 0;
    }
    if (h.type == UCCL_HELLO_STREAM) {
        pthread_mutex_lock(&ep->mu);
        struct incomplete *inc = uccl__idmap_get(&ep->incomplete, h.conn_token);
        pthread_mutex_unlock(&ep->mu);
        if (!inc || h.num_streams != inc->need) {
            LOG_WARN("dropped stream from %s: no connection waits for it", p->name);
            send_ack(p->fd, ep, UCCL_ERR_PROTO, NULL);
            return 0;
        }
        if (inc->conn->tp->add_stream(inc->conn, p->fd, h.stream_index)) {
            LOG_WARN("dropped stream from %s: %s", p->name, uccl_last_error());
            send_ack(p->fd, ep, UCCL_ERR_PROTO, NULL);
            return 0;
        }
        send_ack(p->fd, ep, UCCL_OK, NULL);
        if (++inc->have == inc->need) {
            pthread_mutex_lock(&ep->mu);
            uccl__idmap_del(&ep->incomplete, h.conn_token);
            pthread_mutex_unlock(&ep->mu);
            start_accepted(ep, inc->conn);
            free(inc);
        }
        return 1;
    }

    /* HELLO_CONN */
    int tp_id = UCCL_TP_TCP;
    memset(&ack, 0, sizeof(ack));
    if (choose_transport(ep, &h, &tp_id)) {
        LOG_WARN("refused connection from %s: %s", p->name, uccl_last_error());
        send_ack(p->fd, ep, UCCL_ERR_UNAVAIL, NULL);
        return 0;
    }
    pthread_mutex_lock(&ep->mu);
    int dup = uccl__idmap_get(&ep->incomplete, h.conn_token) != NULL;
    pthread_mutex_unlock(&ep->mu);
    if (dup || h.conn_token == 0) {
        LOG_WARN("refused connection from %s: its token is in use", p->name);
        send_ack(p->fd, ep, UCCL_ERR_PROTO, NULL);
        return 0;
    }
    struct uccl__conn *c = uccl__conn_new(ep, 0, p->fd);
    if (!c) {
        send_ack(p->fd, ep, UCCL_ERR_NOMEM, NULL);
        return 0;
    }
    c->tp = tp_registry[tp_id];
    c->token = h.conn_token;
    c->num_streams = h.num_streams;
    c->chunk_bytes = h.chunk_bytes;
    c->peer_gpu = h.gpu_idx;
    c->peer_rank = h.rank;
    c->peer_pid = h.pid;
    c->peer_port = (int)h.listen_port;
    snprintf(c->peer_host, sizeof(c->peer_host), "%s", h.host_id);
    snprintf(c->peer_ip, sizeof(c->peer_ip), "%s", p->name);
    c->peer_ip[strcspn(c->peer_ip, ":")] = '\0';
    ack.transport = (uint32_t)tp_id;
    ack.num_streams = h.num_streams;
    ack.chunk_bytes = h.chunk_bytes;
    if (c->tp->conn_accept(c, &h, &ack)) {
        LOG_WARN("refused connection from %s: %s", p->name, uccl_last_error());
        send_ack(p->fd, ep, UCCL_ERR_UNAVAIL, NULL);
        c->ctrl_fd = -1; /* the caller closes it */
        uccl__conn_put(c);
        return 0;
    }
    send_ack(p->fd, ep, UCCL_OK, &ack);
    unsigned need = c->tp->streams_needed ? c->tp->streams_needed(c) : 0;
    if (need == 0) {
        start_accepted(ep, c);
        return 1;
    }
    struct incomplete *inc = calloc(1, sizeof(*inc));
    if (!inc) {
        uccl__conn_put(c);
        return 1;
    }
    *inc = (struct incomplete){.conn = c, .need = need, .deadline = uccl__now_ns() + HANDSHAKE_NS};
    pthread_mutex_lock(&ep->mu);
    uccl__idmap_put(&ep->incomplete, c->token, inc);
    pthread_mutex_unlock(&ep->mu);
    return 1;
}

struct expire_ctx { uint64_t now; uint64_t keys[MAX_PENDING]; unsigned n; };
static void find_expired(uint64_t k, void *v, void *arg)
{
    struct expire_ctx *e = arg;
    if (((struct incomplete *)v)->deadline < e->now && e->n < MAX_PENDING)
        e->keys[e->n++] = k;
}

static void expire_incomplete(struct uccl__ep *ep, int all)
{
    struct expire_ctx e = {.now = all ? UINT64_MAX : uccl__now_ns()};
    pthread_mutex_lock(&ep->mu);
    uccl__idmap_each(&ep->incomplete, find_expired, &e);
    struct incomplete *v[MAX_PENDING];
    for (unsigned i = 0; i < e.n; i++)
        v[i] = uccl__idmap_del(&ep->incomplete, e.keys[i]);
    pthread_mutex_unlock(&ep->mu);
    for (unsigned i = 0; i < e.n; i++) {
        if (!all)
            LOG_WARN("dropped connection from %s: its data streams did not arrive",
                     v[i]->conn->peer_ip);
        uccl__conn_close(v[i]->conn);
        uccl__conn_put(v[i]->conn);
        free(v[i]);
    }
}

static void *listener_main(void *arg)
{
    struct uccl__ep *ep = arg;
    struct pending pend[MAX_PENDING];
    unsigned npend = 0;
    for (;;) {
        struct pollfd pfd[MAX_PENDING + 2];
        pfd[0] = (struct pollfd){.fd = ep->wake_pipe[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = ep->listen_fd, .events = npend < MAX_PENDING ? POLLIN : 0};
        for (unsigned i = 0; i < npend; i++)
            pfd[i + 2] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
        int n = poll(pfd, npend + 2, 500);
        if (n < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break; /* close() */
        uint64_t now = uccl__now_ns();
        if (pfd[1].revents & POLLIN) {
            int fd = accept4(ep->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0) {
                uccl__sock_tune(fd);
                pend[npend] = (struct pending){.fd = fd, .deadline = now + HANDSHAKE_NS};
                uccl__sock_peer_name(fd, pend[npend].name, sizeof(pend[npend].name));
                npend++;
            }
        }
        for (unsigned i = 0; i < npend;) {
            struct pending *p = &pend[i];
            int done = 0, keep = 0;
            if (now > p->deadline) { /* trickling counts as silence */
                LOG_WARN("dropped connection from %s: no complete handshake within %llu s",
                         p->name, (unsigned long long)(HANDSHAKE_NS / 1000000000ull));
                done = 1;
            } else if (pfd[i + 2].revents && pfd[i + 2].fd == p->fd) {
                ssize_t r = recv(p->fd, p->buf + p->got, sizeof(p->buf) - p->got, 0);
                if (r > 0) {
                    p->got += (size_t)r;
                    if (p->got == sizeof(p->buf)) {
                        done = 1;
                        keep = on_hello(ep, p);
                    }
                } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                    LOG_WARN("dropped connection from %s: closed during the handshake "
                             "after %zu bytes", p->name, p->got);
                    done = 1;
                }
            }
            if (done) {
                if (!keep)
                    close(p->fd);
                pend[i] = pend[--npend];
                pfd[i + 2] = pfd[npend + 2];
            } else {
                i++;
            }
        }
        expire_incomplete(ep, 0);
    }
    for (unsigned i = 0; i < npend; i++)
        close(pend[i].fd);
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* create / close                                                             */

int uccl_ep_create(const struct uccl_ep_opts *o, uccl_ep_t **ep_p)
{
    int bad = 0, status = UCCL_ERR_INVALID;
    struct uccl__ep *ep = calloc(1, sizeof(*ep));
    if (!ep)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    ep->listen_fd = ep->wake_pipe[0] = ep->wake_pipe[1] = -1;
    pthread_mutex_init(&ep->mu, NULL);
    pthread_cond_init(&ep->cv, NULL);
    ep->gpu_idx = o->gpu_idx;
    ep->probe_word = uccl__random64();
    ep->rank = o->rank;
    if (o->host_id && (!o->host_id[0] || strlen(o->host_id) >= sizeof(ep->host_id))) {
        uccl__err(UCCL_ERR_INVALID, "host id '%s': expected 1..%zu characters", o->host_id,
                  sizeof(ep->host_id) - 1);
        goto err_free;
    }
    read_host_id(o->host_id, ep->host_id, sizeof(ep->host_id));

    double t = o->timeout_s > 0 ? o->timeout_s
                                : (double)uccl__env_long("UCCL_P2P_TIMEOUT_S", 300, 1, 86400 * 7, &bad);
    if (t > 365.0 * 86400) /* beyond a year means "forever"; keep the ns count finite */
        t = 365.0 * 86400;
    ep->timeout_ns = (uint64_t)(t * 1e9);
    ep->spin_ns = (uint64_t)uccl__env_long("UCCL_P2P_SPIN_US", 200, 0, 1000000, &bad) * 1000ull;
    ep->num_streams = (unsigned)uccl__env_long("UCCL_P2P_TCP_STREAMS", 2, 1, UCCL_MAX_STREAMS, &bad);
    ep->chunk_bytes = (size_t)uccl__env_long("UCCL_P2P_TCP_CHUNK_KB", 1024, 4, 65536, &bad) * 1024;
    long base = uccl__env_long("UCCL_P2P_BASE_PORT", DEFAULT_BASE_PORT, 1, 65535, &bad);
    if (bad)
        goto err_free;

    const char *tp = getenv("UCCL_P2P_TRANSPORT");
    ep->forced_tp = UCCL_TP_AUTO;
    if (tp && *tp) {
        int found = 0;
        for (int i = 0; i < UCCL_TP_COUNT; i++)
            if (strcasecmp(tp, tp_names[i]) == 0) {
                ep->forced_tp = i;
                found = 1;
            }
        if (!found) {
            uccl__err(UCCL_ERR_INVALID, "UCCL_P2P_TRANSPORT=%s: use auto, tcp, shm, ipc or rdma", tp);
            goto err_free;
        }
        if (ep->forced_tp != UCCL_TP_AUTO && !tp_registry[ep->forced_tp]) {
            status = uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_TRANSPORT=%s: that transport is not part of "
                      "this build (tcp and shm are)", tp);
            goto err_free;
        }
        if (ep->forced_tp != UCCL_TP_AUTO && tp_registry[ep->forced_tp]->available()) {
            status = uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_TRANSPORT=%s is unavailable: %s", tp,
                      uccl_last_error());
            goto err_free;
        }
    }

    const char *mode = getenv("UCCL_P2P_SHM_MODE");
    ep->shm_mode = -1;
    if (mode && *mode && strcasecmp(mode, "auto") != 0) {
        if (strcasecmp(mode, "cma") == 0)
            ep->shm_mode = 0;
        else if (strcasecmp(mode, "ring") == 0)
            ep->shm_mode = 1;
        else {
            status = uccl__err(UCCL_ERR_INVALID, "UCCL_P2P_SHM_MODE=%s: use auto, cma or ring", mode);
            goto err_free;
        }
    }

    const char *sec = o->secret;
    size_t slen = o->secret_len;
    if (!sec) {
        sec = getenv("UCCL_P2P_SECRET");
        slen = sec ? strlen(sec) : 0;
    }
    if (slen > UCCL_SECRET_MAX) {
        uccl__err(UCCL_ERR_INVALID, "the secret is %zu bytes; at most %d are allowed", slen,
                  UCCL_SECRET_MAX);
        goto err_free;
    }
    memcpy(ep->secret, sec, slen);
    ep->secret_len = (uint32_t)slen;

    if ((status = uccl__sock_local_ip(ep->ip, sizeof(ep->ip))) != UCCL_OK)
        goto err_free;
    int rc = UCCL_ERR_UNAVAIL;
    if (o->port < 0) /* the well-known port first, so connect(ip, gpu) finds it */
        rc = uccl__sock_listen(NULL, (int)base + (o->gpu_idx > 0 ? o->gpu_idx : 0),
                               &ep->listen_fd, &ep->port);
    if (rc == UCCL_ERR_UNAVAIL)
        rc = uccl__sock_listen(NULL, o->port > 0 ? o->port : 0, &ep->listen_fd, &ep->port);
    if ((status = rc) != UCCL_OK)
        goto err_free;
    if (pipe2(ep->wake_pipe, O_CLOEXEC) < 0) {
        status = uccl__err(UCCL_ERR_IO, "pipe2: %s", strerror(errno));
        goto err_close;
    }
    if (pthread_create(&ep->listener, NULL, listener_main, ep)) {
        status = uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
        goto err_close;
    }
    ep->listener_started = 1;
    if (ep->secret_len == 0)
        LOG_INFO("endpoint on port %d has no secret: its connections are unauthenticated "
                 "(set UCCL_P2P_SECRET)", ep->port);
    *ep_p = ep;
    return UCCL_OK;

err_close:
    close(ep->listen_fd);
    if (ep->wake_pipe[0] >= 0) {
        close(ep->wake_pipe[0]);
        close(ep->wake_pipe[1]);
    }
err_free:
    pthread_mutex_destroy(&ep->mu);
    pthread_cond_destroy(&ep->cv);
    free(ep);
    return status;
}

static void close_conn_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    struct uccl__conn ***pp = arg;
    *(*pp)++ = v;
}

static void put_req_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    (void)arg;
    if (v != (void *)arg)
        uccl__req_put(v);
}

static void free_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    (void)arg;
    free(v);
}

static void free_mr_entry(uint64_t k, void *v, void *arg)
{
    (void)k;
    mr_free(arg, v);
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
    if (ep->listener_started) {
        ssize_t w = write(ep->wake_pipe[1], "x", 1);
        (void)w;
        pthread_join(ep->listener, NULL);
        ep->listener_started = 0;
    }
    expire_incomplete(ep, 1);
    /* No new connection can appear now: close each one (joins its threads). */
    pthread_mutex_lock(&ep->mu);
    size_t n = ep->conns.live;
    struct uccl__conn **v = calloc(n + 1, sizeof(*v)), **p = v;
    if (v)
        uccl__idmap_each(&ep->conns, close_conn_entry, &p);
    pthread_mutex_unlock(&ep->mu);
    for (size_t i = 0; v && i < n; i++)
        uccl__conn_close(v[i]);
    free(v);
}

void uccl_ep_destroy(uccl_ep_t *ep)
{
    if (!ep)
        return;
    uccl_ep_close(ep);
    uccl__idmap_each(&ep->reqs, put_req_entry, DONE_MARK);
    struct uccl__conn **v = calloc(ep->conns.live + 1, sizeof(*v)), **p = v;
    size_t n = ep->conns.live;
    if (v)
        uccl__idmap_each(&ep->conns, close_conn_entry, &p);
    for (size_t i = 0; v && i < n; i++)
        uccl__conn_put(v[i]);
    free(v);
    uccl__idmap_each(&ep->mrs, free_mr_entry, ep);
    uccl__idmap_each(&ep->windows, free_entry, NULL);
    uccl__idmap_free(&ep->conns);
    uccl__idmap_free(&ep->reqs);
    uccl__idmap_free(&ep->mrs);
    uccl__idmap_free(&ep->windows);
    uccl__idmap_free(&ep->incomplete);
    uccl__pool_free(ep->copy_pool); /* every connection is gone: no copy runs */
    while (ep->remotes) {
        struct uccl__remote *r = ep->remotes->next;
        free(ep->remotes);
        ep->remotes = r;
    }
    if (ep->listen_fd >= 0)
        close(ep->listen_fd);
    if (ep->wake_pipe[0] >= 0) {
        close(ep->wake_pipe[0]);
        close(ep->wake_pipe[1]);
    }
    pthread_mutex_destroy(&ep->mu);
    pthread_cond_destroy(&ep->cv);
    free(ep);
}

static int check_open(struct uccl__ep *ep)
{
    if (ep->closed)
        return uccl__err(UCCL_ERR_CLOSED, "the endpoint is closed");
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* metadata, connect, accept                                                  */

void uccl_ep_addr(uccl_ep_t *ep, char ip[46], int *port_p)
{
    snprintf(ip, 46, "%s", ep->ip);
    *port_p = ep->port;
}

uint64_t uccl_ep_timeout_ns(uccl_ep_t *ep) { return ep->timeout_ns; }

int uccl_ep_metadata(uccl_ep_t *ep, uint8_t *out, size_t out_len)
{
    if (out_len < UCCL_META_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "metadata buffer too small");
    struct uccl__meta m = {.port = (uint32_t)ep->port, .gpu_idx = ep->gpu_idx,
                           .secret_len = ep->secret_len};
    snprintf(m.ip, sizeof(m.ip), "%s", ep->ip);
    snprintf(m.host_id, sizeof(m.host_id), "%s", ep->host_id);
    memcpy(m.secret, ep->secret, ep->secret_len);
    uccl__meta_encode(&m, out);
    return UCCL_OK;
}

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

static void fill_hello(struct uccl__conn *c, int type, struct uccl__hello *h)
{
    struct uccl__ep *ep = c->ep;
    memset(h, 0, sizeof(*h));
    h->type = (uint16_t)type;
    h->secret_len = c->secret_len;
    memcpy(h->secret, c->secret, c->secret_len);
    snprintf(h->host_id, sizeof(h->host_id), "%s", ep->host_id);
    h->pid = (uint32_t)getpid();
    h->gpu_idx = ep->gpu_idx;
    h->rank = ep->rank;
    h->transport = (uint32_t)ep->forced_tp;
    h->num_streams = c->num_streams;
    h->conn_token = c->token;
    h->probe_addr = (uint64_t)(uintptr_t)&ep->probe_word;
    h->probe_cookie = ep->probe_word;
    h->listen_port = (uint32_t)ep->port;
    h->chunk_bytes = c->chunk_bytes;
}

/* One handshake round trip on a fresh socket; returns the peer's ACK. */
static int handshake(struct uccl__conn *c, int fd, int type, unsigned index, uint64_t deadline,
                     struct uccl__hello *ack)
{
    struct uccl__hello h;
    uint8_t buf[UCCL_HELLO_SIZE];
    fill_hello(c, type, &h);
    h.stream_index = index;
    uccl__hello_encode(&h, buf);
    int rc = uccl__sock_send_all(fd, buf, sizeof(buf), deadline);
    if (rc == UCCL_OK)
        rc = uccl__sock_recv_all(fd, buf, sizeof(buf), deadline);
    if (rc)
        return uccl__err(rc, "handshake with %s:%d: %s", c->peer_ip, c->peer_port,
                         uccl_last_error());
    rc = uccl__hello_decode(buf, ack);
    if (rc)
        return rc;
    if (ack->type != UCCL_HELLO_ACK)
        return uccl__err(UCCL_ERR_PROTO, "handshake with %s:%d: expected an ACK", c->peer_ip,
                         c->peer_port);
    if (ack->status == UCCL_ERR_AUTH)
        return uccl__err(UCCL_ERR_AUTH, "%s:%d refused the connection: wrong or missing secret "
                         "(UCCL_P2P_SECRET)", c->peer_ip, c->peer_port);
    if (ack->status != UCCL_OK)
        return uccl__err(ack->status == UCCL_ERR_UNAVAIL ? UCCL_ERR_UNAVAIL : UCCL_ERR_IO,
                         "%s:%d refused the connection: %s (see its log)", c->peer_ip,
                         c->peer_port, uccl_status_str(ack->status));
    return UCCL_OK;
}

int uccl__ep_open_stream(struct uccl__conn *c, unsigned index, uint64_t deadline_ns, int *fd_p)
{
    int fd;
    struct uccl__hello ack;
    int rc = uccl__sock_connect(c->peer_ip, c->peer_port, deadline_ns, &fd);
    if (rc)
        return rc;
    rc = handshake(c, fd, UCCL_HELLO_STREAM, index, deadline_ns, &ack);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_p = fd;
    return UCCL_OK;
}

int uccl_ep_connect(uccl_ep_t *ep, const char *ip, int port, int remote_gpu, int expect_rank,
                    const uint8_t *secret, size_t secret_len, uint64_t *conn_p)
{
    int rc = check_open(ep), fd = -1;
    if (rc)
        return rc;
    if (port < 0) {
        int bad = 0;
        port = (int)uccl__env_long("UCCL_P2P_BASE_PORT", DEFAULT_BASE_PORT, 1, 65535, &bad) +
               (remote_gpu > 0 ? remote_gpu : 0);
    }
    if (!secret) {
        secret = ep->secret;
        secret_len = ep->secret_len;
    }
    if (secret_len > UCCL_SECRET_MAX)
        return uccl__err(UCCL_ERR_INVALID, "secret of %zu bytes (at most %d)", secret_len,
                         UCCL_SECRET_MAX);
    uint64_t deadline = uccl__now_ns() + ep->timeout_ns;
    rc = uccl__sock_connect(ip, port, deadline, &fd);
    if (rc)
        return rc;
    struct uccl__conn *c = uccl__conn_new(ep, 1, fd);
    if (!c) {
        close(fd);
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    }
    c->token = uccl__random64();
    c->num_streams = ep->num_streams;
    c->chunk_bytes = ep->chunk_bytes;
    c->peer_rank = -1;
    c->peer_port = port;
    c->peer_gpu = remote_gpu;
    c->secret_len = (uint32_t)secret_len;
    memcpy(c->secret, secret, secret_len);
    snprintf(c->peer_ip, sizeof(c->peer_ip), "%s", ip);

    struct uccl__hello ack;
    rc = handshake(c, fd, UCCL_HELLO_CONN, 0, deadline, &ack);
    if (rc)
        goto err_conn;
    if (expect_rank >= 0 && ack.rank != expect_rank) {
        rc = uccl__err(UCCL_ERR_MISMATCH, "%s:%d is rank %d, but rank %d was expected there "
                       "(a stale or foreign endpoint on that port?)", ip, port, (int)ack.rank,
                       expect_rank);
        goto err_conn;
    }
    c->peer_rank = ack.rank;
    c->peer_pid = ack.pid;
    c->peer_gpu = ack.gpu_idx;
    snprintf(c->peer_host, sizeof(c->peer_host), "%s", ack.host_id);
    if (ack.transport >= UCCL_TP_COUNT || !tp_registry[ack.transport]) {
        rc = uccl__err(UCCL_ERR_PROTO, "peer chose transport %u, unknown here", ack.transport);
        goto err_conn;
    }
    c->tp = tp_registry[ack.transport];
    rc = c->tp->conn_connected(c, &ack, deadline);
    if (rc)
        goto err_conn;
    rc = add_conn(ep, c, 0);
    if (rc)
        goto err_conn;
    rc = uccl__conn_start(c);
    if (rc) {
        pthread_mutex_lock(&ep->mu);
        uccl__idmap_del(&ep->conns, c->id);
        pthread_mutex_unlock(&ep->mu);
        goto err_conn;
    }
    LOG_INFO("connection %llu to %s:%d over %s", (unsigned long long)c->id, ip, port, c->tp->name);
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
    for (struct uccl__remote *r = ep->remotes; r; r = r->next) {
        struct uccl__conn *c = uccl__idmap_get(&ep->conns, r->conn_id);
        if (strcmp(r->ip, m.ip) == 0 && r->port == (int)m.port && c && !atomic_load(&c->failed)) {
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
    struct uccl__remote *r = calloc(1, sizeof(*r));
    if (r) {
        snprintf(r->ip, sizeof(r->ip), "%s", m.ip);
        r->port = (int)m.port;
        r->conn_id = id;
        pthread_mutex_lock(&ep->mu);
        r->next = ep->remotes;
        ep->remotes = r;
        pthread_mutex_unlock(&ep->mu);
    }
    *conn_p = id;
    return UCCL_OK;
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
        snprintf(ip, 46, "%s", c->peer_ip);
        *gpu_p = c->peer_gpu;
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
    return check_open(ep);
}

int uccl_ep_conn_transport(uccl_ep_t *ep, uint64_t conn, char *buf, size_t len)
{
    struct uccl__conn *c = conn_lookup(ep, conn);
    if (!c)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown conn_id %llu", (unsigned long long)conn);
    if (c->tp == &uccl__tp_shm)
        snprintf(buf, len, "shm-%s", c->direct ? "cma" : "ring");
    else
        snprintf(buf, len, "%s", c->tp->name);
    uccl__conn_put(c);
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* memory                                                                     */

void uccl_ep_set_spin_ns(uccl_ep_t *ep, uint64_t ns) { ep->spin_ns = ns; }

struct uccl__pool *uccl__ep_copy_pool(struct uccl__ep *ep)
{
    pthread_mutex_lock(&ep->mu);
    if (!ep->copy_pool && !ep->closed) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        int helpers = ncpu <= 4 ? 1 : (int)(ncpu / 2 < 8 ? ncpu / 2 : 8) - 1;
        ep->copy_pool = uccl__pool_new(helpers);
    }
    struct uccl__pool *p = ep->copy_pool;
    pthread_mutex_unlock(&ep->mu);
    return p;
}

int uccl_ep_conn_peer_rank(uccl_ep_t *ep, uint64_t conn, int *rank_p)
{
    struct uccl__conn *c = conn_lookup(ep, conn);
    if (!c)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown conn_id %llu", (unsigned long long)conn);
    *rank_p = c->peer_rank;
    uccl__conn_put(c);
    return UCCL_OK;
}

int uccl_ep_reg(uccl_ep_t *ep, uintptr_t addr, size_t len, uint64_t *mr_p)
{
    int rc = check_open(ep);
    if (rc)
        return rc;
    if (addr == 0 && len > 0)
        return uccl__err(UCCL_ERR_INVALID, "cannot register %zu bytes at address 0", len);
    if (addr + len < addr)
        return uccl__err(UCCL_ERR_INVALID, "region 0x%zx + %zu wraps around", (size_t)addr, len);
    struct uccl__mr *mr = calloc(1, sizeof(*mr));
    if (!mr)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    rc = UCCL_OK;
    mr->addr = addr;
    mr->len = len;
    for (int i = 0; i < UCCL_TP_COUNT && rc == UCCL_OK; i++)
        if (tp_registry[i] && tp_registry[i]->mem_reg && tp_registry[i]->available() == UCCL_OK)
            rc = tp_registry[i]->mem_reg(ep, mr);
    if (rc) {
        mr_free(ep, mr);
        return rc;
    }
    pthread_mutex_lock(&ep->mu);
    mr->id = ++ep->next_mr_id;
    rc = uccl__idmap_put(&ep->mrs, mr->id, mr);
    pthread_mutex_unlock(&ep->mu);
    if (rc) {
        mr_free(ep, mr);
        return rc;
    }
    *mr_p = mr->id;
    return UCCL_OK;
}

struct win_sweep { uint64_t mr; uint64_t ids[256]; unsigned n; };
static void match_window(uint64_t k, void *v, void *arg)
{
    struct win_sweep *s = arg;
    if (((struct uccl__window *)v)->mr_id == s->mr && s->n < 256)
        s->ids[s->n++] = k;
}

static void fail_conn_ids(struct uccl__ep *ep, const uint64_t *ids, unsigned n, uint64_t mr_id)
{
    for (unsigned i = 0; i < n; i++) {
        struct uccl__conn *c = conn_lookup(ep, ids[i]);
        if (c) {
            uccl__conn_fail(c, UCCL_ERR_TIMEOUT, "region %llu was deregistered while the peer "
                            "was still reading or writing it", (unsigned long long)mr_id);
            uccl__conn_put(c);
        }
    }
}

int uccl_ep_dereg(uccl_ep_t *ep, uint64_t mr_id)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__mr *mr = uccl__idmap_del(&ep->mrs, mr_id);
    if (!mr) {
        pthread_mutex_unlock(&ep->mu);
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown mr_id %llu (never registered, or "
                         "already deregistered)", (unsigned long long)mr_id);
    }
    /* Its advertised windows die with it: no new peer access can start. */
    struct win_sweep s = {.mr = mr_id};
    uint64_t *conns = NULL; /* distinct connections that were offered it */
    unsigned nconns = 0;
    do {
        s.n = 0;
        uccl__idmap_each(&ep->windows, match_window, &s);
        for (unsigned i = 0; i < s.n; i++) {
            struct uccl__window *w = uccl__idmap_del(&ep->windows, s.ids[i]);
            unsigned k = 0;
            while (w && k < nconns && conns[k] != w->conn_id)
                k++;
            if (w && k == nconns) {
                uint64_t *grown = realloc(conns, (nconns + 1) * sizeof(*conns));
                if (grown) {
                    conns = grown;
                    conns[nconns++] = w->conn_id;
                }
            }
            free(w);
        }
    } while (s.n == 256);
    /* Accesses already under way finish first: after dereg() returns, no
     * peer touches this memory.  If they do not finish within the timeout,
     * their connections are failed, which stops them. */
    mr->dead = 1;
    mr->waiting = 1;
    int rc = UCCL_OK;
    for (int round = 0; mr->inflight > 0 && round < 2; round++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t wait_ns = round == 0 ? ep->timeout_ns : 5000000000ull;
        uint64_t t = (uint64_t)ts.tv_nsec + wait_ns;
        ts.tv_sec += (time_t)(t / 1000000000ull);
        ts.tv_nsec = (long)(t % 1000000000ull);
        while (mr->inflight > 0)
            if (pthread_cond_timedwait(&ep->cv, &ep->mu, &ts) == ETIMEDOUT)
                break;
        if (mr->inflight > 0 && round == 0) {
            pthread_mutex_unlock(&ep->mu);
            fail_conn_ids(ep, conns, nconns, mr_id);
            pthread_mutex_lock(&ep->mu);
        }
    }
    mr->waiting = 0;
    free(conns);
    int stopped = mr->inflight == 0;
    if (!stopped) /* the last release frees it */
        rc = uccl__err(UCCL_ERR_TIMEOUT, "dereg(%llu): %d peer accesses did not stop",
                       (unsigned long long)mr_id, mr->inflight);
    pthread_mutex_unlock(&ep->mu);
    if (stopped)
        mr_free(ep, mr);
    return rc;
}

/* Under ep->mu: is [ptr, ptr + len) inside registered region mr_id? */
static int check_mr(struct uccl__ep *ep, uint64_t mr_id, uintptr_t ptr, size_t len)
{
    struct uccl__mr *mr = uccl__idmap_get(&ep->mrs, mr_id);
    if (!mr)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown mr_id %llu (never registered, or "
                         "deregistered)", (unsigned long long)mr_id);
    if (ptr < mr->addr || ptr - mr->addr > mr->len || len > mr->len - (ptr - mr->addr))
        return uccl__err(UCCL_ERR_INVALID, "buffer [0x%zx, +%zu) is not inside registered "
                         "region %llu [0x%zx, +%zu)", (size_t)ptr, len,
                         (unsigned long long)mr_id, (size_t)mr->addr, mr->len);
    return UCCL_OK;
}

int uccl_ep_advertise(uccl_ep_t *ep, uint64_t conn, uint64_t mr, uintptr_t addr, size_t len,
                      uint8_t *out, size_t out_len)
{
    int rc = check_open(ep);
    if (rc)
        return rc;
    if (out_len < UCCL_FIFO_ITEM_SIZE)
        return uccl__err(UCCL_ERR_INVALID, "fifo item buffer too small");
    struct uccl__conn *c = conn_lookup(ep, conn);
    if (!c)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown conn_id %llu", (unsigned long long)conn);
    int acceptor = !c->is_connector;
    uccl__conn_put(c);
    if (!acceptor)
        return uccl__err(UCCL_ERR_INVALID, "conn_id %llu was made by connect(): advertise on "
                         "the accepting side, whose peer then reads or writes",
                         (unsigned long long)conn);
    struct uccl__window *w = malloc(sizeof(*w));
    if (!w)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    pthread_mutex_lock(&ep->mu);
    rc = check_mr(ep, mr, addr, len);
    if (rc == UCCL_OK) {
        *w = (struct uccl__window){.id = ++ep->next_window_id, .token = uccl__random64(),
                                   .conn_id = conn, .mr_id = mr, .addr = addr, .len = len};
        rc = uccl__idmap_put(&ep->windows, w->id, w);
    }
    pthread_mutex_unlock(&ep->mu);
    if (rc) {
        free(w);
        return rc;
    }
    struct uccl__fifo_item f = {.window = w->id, .token = w->token, .addr = addr, .len = len};
    uccl__fifo_encode(&f, out);
    return UCCL_OK;
}

/* ------------------------------------------------------------------------- */
/* transfers                                                                  */

static const char *op_name(int op)
{
    switch (op) {
    case UCCL_XFER_SEND: return "send";
    case UCCL_XFER_RECV: return "recv";
    case UCCL_XFER_WRITE: return "write";
    case UCCL_XFER_READ: return "read";
    }
    return "?";
}

int uccl_ep_post(uccl_ep_t *ep, int op, uint64_t conn, uint64_t mr, uintptr_t ptr, size_t len,
                 const uint8_t *fifo, size_t fifo_len, uint64_t *xfer_p)
{
    int rc = check_open(ep);
    if (rc)
        return rc;
    int blocking = (op & UCCL_XFER_BLOCKING) != 0;
    op &= ~UCCL_XFER_BLOCKING;
    if (op < UCCL_XFER_SEND || op > UCCL_XFER_READ)
        return uccl__err(UCCL_ERR_INVALID, "unknown transfer kind %d", op);
    struct uccl__fifo_item f = {0};
    if (op == UCCL_XFER_WRITE || op == UCCL_XFER_READ) {
        if ((rc = uccl__fifo_decode(fifo, fifo_len, &f)) != UCCL_OK)
            return rc;
        if (len > f.len)
            return uccl__err(UCCL_ERR_INVALID, "%s of %zu bytes exceeds the %llu bytes the "
                             "peer advertised", op_name(op), len, (unsigned long long)f.len);
    }
    struct uccl__conn *c = conn_lookup(ep, conn);
    if (!c)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown conn_id %llu", (unsigned long long)conn);
    if ((op == UCCL_XFER_RECV) == c->is_connector) {
        rc = uccl__err(UCCL_ERR_INVALID, "%s on conn_id %llu: connections are one-way; the side "
                       "that called connect() sends, reads and writes, the side that called "
                       "accept() receives", op_name(op), (unsigned long long)conn);
        goto out;
    }
    static const int to_req[] = {0, UCCL_OP_SEND, UCCL_OP_RECV, UCCL_OP_WRITE, UCCL_OP_READ};
    struct uccl__req *r = uccl__req_new(to_req[op], c, (void *)ptr, len);
    if (!r) {
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
        goto out;
    }
    pthread_mutex_lock(&ep->mu);
    rc = check_mr(ep, mr, ptr, len);
    if (rc == UCCL_OK) { /* the keys a direct transport will need (0 for CMA) */
        struct uccl__mr *m = uccl__idmap_get(&ep->mrs, mr);
        r->local_key = m->tp_key[c->tp->id];
        r->key_for_peer = c->tp->mem_key ? c->tp->mem_key(c, m, ptr) : 0;
    }
    pthread_mutex_unlock(&ep->mu);
    if (rc) {
        uccl__req_put(r);
        goto out;
    }
    r->fifo = f;
    pthread_mutex_lock(&ep->mu);
    r->id = ++ep->next_req_id;
    rc = uccl__idmap_put(&ep->reqs, r->id, r); /* the table owns the creation reference */
    pthread_mutex_unlock(&ep->mu);
    if (rc) {
        uccl__req_put(r);
        goto out;
    }
    rc = uccl__conn_post(c, r, blocking);
    if (rc) {
        pthread_mutex_lock(&ep->mu);
        uccl__idmap_del(&ep->reqs, r->id);
        pthread_mutex_unlock(&ep->mu);
        uccl__req_put(r);
        goto out;
    }
    *xfer_p = r->id;
out:
    uccl__conn_put(c);
    return rc;
}

/* The request behind xfer (with a reference), DONE_MARK, or NULL. */
static struct uccl__req *req_lookup(struct uccl__ep *ep, uint64_t xfer)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__req *r = uccl__idmap_get(&ep->reqs, xfer);
    if (r && r != DONE_MARK)
        atomic_fetch_add(&r->refs, 1);
    pthread_mutex_unlock(&ep->mu);
    if (!r)
        uccl__err(UCCL_ERR_NOTFOUND, "unknown transfer_id %llu (never issued, or released)",
                  (unsigned long long)xfer);
    return r;
}


static void mark_done(struct uccl__ep *ep, struct uccl__req *r)
{
    pthread_mutex_lock(&ep->mu);
    int swap = uccl__idmap_get(&ep->reqs, r->id) == r;
    if (swap)
        uccl__idmap_put(&ep->reqs, r->id, DONE_MARK);
    pthread_mutex_unlock(&ep->mu);
    if (swap)
        uccl__req_put(r); /* the table's reference */
}

/* The outcome of a finished request; waits for engine threads to leave its
 * buffer first, so that after an error nothing lands in it any more. */
static int outcome(struct uccl__ep *ep, struct uccl__req *r)
{
    /* Done or failed, an engine thread may still be in the buffer (a peer
     * may answer early, or a copy be ending): wait for it to leave; if it
     * does not soon, fail the connection, which stops it. */
    for (int i = 0; atomic_load(&r->busy) > 0 && i < 20000; i++)
        usleep(50);
    if (atomic_load(&r->busy) > 0) {
        uccl__conn_fail(r->conn, UCCL_ERR_PROTO, "transfer %llu was answered while its bytes "
                        "were still moving", (unsigned long long)r->id);
        for (int i = 0; atomic_load(&r->busy) > 0 && i < 100000; i++)
            usleep(50);
    }
    if (atomic_load(&r->state) == UCCL_REQ_DONE) {
        mark_done(ep, r);
        return UCCL_OK;
    }
    return uccl__err(r->status, "%s", r->msg);
}

int uccl_ep_poll(uccl_ep_t *ep, uint64_t xfer, int *done_p)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r)
        return UCCL_ERR_NOTFOUND;
    if (r == DONE_MARK) {
        *done_p = 1;
        return UCCL_OK;
    }
    unsigned s = atomic_load(&r->state);
    int rc = UCCL_OK;
    /* A finished transfer whose buffer an engine thread is still leaving
     * reads as not done yet: poll never waits. */
    if (s != UCCL_REQ_PENDING && atomic_load(&r->busy) > 0)
        s = UCCL_REQ_PENDING;
    if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
        rc = outcome(ep, r);
    if (rc == UCCL_OK)
        *done_p = s == UCCL_REQ_DONE;
    uccl__req_put(r);
    return rc;
}

int uccl_ep_wait(uccl_ep_t *ep, uint64_t xfer, uint64_t deadline_ns, uint64_t slice_ns)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r)
        return UCCL_ERR_NOTFOUND;
    if (r == DONE_MARK)
        return UCCL_OK;
    uint64_t now = uccl__now_ns();
    uint64_t wait = deadline_ns > now ? deadline_ns - now : 0;
    if (wait > slice_ns)
        wait = slice_ns;
    int rc = uccl__req_wait(r, wait);
    if (rc == UCCL_INPROGRESS && uccl__now_ns() >= deadline_ns) {
        /* Nothing may land in this buffer after we give up on it: fail the
         * whole connection (as NCCL aborts a communicator on timeout). */
        uccl__conn_fail(r->conn, UCCL_ERR_TIMEOUT, "%s %llu of %zu bytes timed out: its wait's "
                        "deadline passed (the endpoint's timeout is %.1f s; wait() may have "
                        "been given a shorter one)",
                        r->op == UCCL_OP_SEND ? "send" : r->op == UCCL_OP_RECV ? "recv"
                        : r->op == UCCL_OP_WRITE ? "write" : "read",
                        (unsigned long long)xfer, r->len, (double)ep->timeout_ns / 1e9);
        uccl__req_wait(r, 1000000000ull);
    }
    unsigned s = atomic_load(&r->state);
    if (s == UCCL_REQ_DONE || s == UCCL_REQ_FAILED)
        rc = outcome(ep, r);
    uccl__req_put(r);
    return rc;
}

#define PROGRESS_MAX 64 /* connections driven at once by uccl_ep_progress */

static int req_finished(struct uccl__req *r)
{
    return r == DONE_MARK || (atomic_load(&r->state) != UCCL_REQ_PENDING &&
                              atomic_load(&r->busy) == 0);
}

int uccl_ep_progress(uccl_ep_t *ep, const uint64_t *xfers, int n, unsigned flags,
                     uint64_t budget_ns)
{
    int all = (flags & UCCL_PROGRESS_ALL) != 0, inline_copies = !(flags & UCCL_PROGRESS_HANDOFF);
    struct uccl__req *reqs[PROGRESS_MAX];
    struct uccl__conn *conns[PROGRESS_MAX];
    int nr = 0, nc = 0, done = 0, first_pending = 0;
    for (int i = 0; i < n && nr < PROGRESS_MAX; i++) {
        struct uccl__req *r = req_lookup(ep, xfers[i]);
        if (!r || r == DONE_MARK || req_finished(r)) {
            if (r && r != DONE_MARK)
                uccl__req_put(r);
            done++;
            if (i == 0 && !all)
                return done; /* the one that matters is finished already */
            continue;
        }
        first_pending |= i == 0;
        reqs[nr++] = r;
        int seen = 0;
        for (int k = 0; k < nc && !seen; k++)
            seen = conns[k] == r->conn;
        if (!seen && uccl__conn_drive_begin(r->conn))
            conns[nc++] = r->conn;
    }
    uint64_t start = uccl__now_ns();
    int left = nr;
    while (left > 0 && nc > 0) {
        for (int k = 0; k < nc; k++)
            uccl__conn_drive_pump(conns[k], inline_copies);
        left = 0;
        for (int i = 0; i < nr; i++)
            left += !req_finished(reqs[i]);
        if (left == 0 || (!all && first_pending && req_finished(reqs[0])) ||
            uccl__now_ns() - start >= budget_ns)
            break;
        sched_yield();
    }
    for (int k = 0; k < nc; k++)
        uccl__conn_drive_end(conns[k]);
    for (int i = 0; i < nr; i++) {
        done += req_finished(reqs[i]);
        uccl__req_put(reqs[i]);
    }
    return done;
}

int uccl_ep_release(uccl_ep_t *ep, uint64_t xfer)
{
    pthread_mutex_lock(&ep->mu);
    struct uccl__req *r = uccl__idmap_get(&ep->reqs, xfer);
    if (r && r != DONE_MARK &&
        (atomic_load(&r->state) == UCCL_REQ_PENDING || atomic_load(&r->busy) > 0)) {
        pthread_mutex_unlock(&ep->mu);
        /* Releasing would let the bytes land in a buffer its owner believes free. */
        return uccl__err(UCCL_ERR_INVALID, "transfer_id %llu is still in flight: wait for it "
                         "(or close the endpoint) before releasing it", (unsigned long long)xfer);
    }
    if (r)
        uccl__idmap_del(&ep->reqs, xfer);
    pthread_mutex_unlock(&ep->mu);
    if (!r)
        return uccl__err(UCCL_ERR_NOTFOUND, "unknown transfer_id %llu (never issued, or "
                         "released)", (unsigned long long)xfer);
    if (r != DONE_MARK)
        uccl__req_put(r);
    return UCCL_OK;
}

int uccl_ep_abort(uccl_ep_t *ep, uint64_t xfer, const char *why)
{
    struct uccl__req *r = req_lookup(ep, xfer);
    if (!r || r == DONE_MARK)
        return r ? UCCL_OK : UCCL_ERR_NOTFOUND;
    if (atomic_load(&r->state) == UCCL_REQ_PENDING)
        uccl__conn_fail(r->conn, UCCL_ERR_IO, "transfer %llu abandoned: %s",
                        (unsigned long long)xfer, why);
    uccl__req_wait(r, 1000000000ull);
    for (int i = 0; atomic_load(&r->busy) > 0 && i < 100000; i++)
        usleep(50);
    uccl__req_put(r);
    return UCCL_OK;
}
