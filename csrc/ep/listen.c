/* The listener thread of an endpoint: it accepts sockets, reads each
 * one's HELLO without blocking (a silent or trickling peer is dropped at
 * its deadline), checks the secret, picks the transport and answers; a
 * connection whose transport needs more sockets (TCP data streams) waits
 * in the incomplete table until they have all arrived. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ep/engine.h"
#include "tp/handshake.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/status.h"

#define MAX_PENDING 64 /* sockets in their handshake at once */

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

static int choose_transport(struct uccl__ep *ep, const struct uccl__hello *h, int *tp_p)
{
    int want = h->transport != UCCL_TP_AUTO ? (int)h->transport : ep->local.forced_tp;
    int same_host = strcmp(h->host_id, ep->local.host_id) == 0;
    /* Same host: shared memory.  Another host: RDMA where both ends have a
     * usable device (else TCP; tp_rdma_dev.c says once why not). */
    if (want == UCCL_TP_AUTO && same_host)
        want = uccl__tp_registry[UCCL_TP_SHM]->available() == UCCL_OK ? UCCL_TP_SHM : UCCL_TP_TCP;
    else if (want == UCCL_TP_AUTO)
        want = (h->caps & UCCL_CAP_RDMA) && uccl__tp_registry[UCCL_TP_RDMA]->available() == UCCL_OK
                   ? UCCL_TP_RDMA : UCCL_TP_TCP;
    if (!uccl__tp_registry[want])
        return uccl__err(UCCL_ERR_UNAVAIL, "transport '%s' is not part of this build",
                         uccl__tp_names[want]);
    if (want == UCCL_TP_SHM && !same_host)
        return uccl__err(UCCL_ERR_UNAVAIL, "transport 'shm' needs both ends on one host, but "
                         "the host ids differ ('%s' here, '%s' there)", ep->local.host_id,
                         h->host_id);
    int rc = uccl__tp_registry[want]->available();
    if (rc)
        return rc;
    *tp_p = want;
    return UCCL_OK;
}

static void start_accepted(struct uccl__ep *ep, struct uccl__conn *c)
{
    int rc = uccl__ep_add_conn(ep, c, 1);
    if (rc == UCCL_OK)
        rc = uccl__conn_start(c);
    if (rc) {
        LOG_WARN("accepted connection from %s could not start: %s", c->link.peer_ip,
                 uccl_last_error());
        if (c->id)
            uccl__ep_del_conn(ep, c->id);
        uccl__conn_close(c);
        uccl__conn_put(c);
        return;
    }
    LOG_INFO("accepted connection %llu from %s:%d over %s", (unsigned long long)c->id,
             c->link.peer_ip, c->link.peer_port, c->link.tp->name);
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
    if (!uccl__secret_ok(&ep->local, &h)) {
        LOG_WARN("dropped connection from %s: wrong or missing secret (UCCL_P2P_SECRET)", p->name);
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_AUTH, NULL);
        return 0;
    }
    if (h.type == UCCL_HELLO_STREAM) {
        pthread_mutex_lock(&ep->mu);
        struct incomplete *inc = uccl__idmap_get(&ep->incomplete, h.conn_token);
        pthread_mutex_unlock(&ep->mu);
        if (!inc || h.num_streams != inc->need) {
            LOG_WARN("dropped stream from %s: no connection waits for it", p->name);
            uccl__send_ack(p->fd, &ep->local, UCCL_ERR_PROTO, NULL);
            return 0;
        }
        if (inc->conn->link.tp->add_stream(&inc->conn->link, p->fd, h.stream_index)) {
            LOG_WARN("dropped stream from %s: %s", p->name, uccl_last_error());
            uccl__send_ack(p->fd, &ep->local, UCCL_ERR_PROTO, NULL);
            return 0;
        }
        uccl__send_ack(p->fd, &ep->local, UCCL_OK, NULL);
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
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_UNAVAIL, NULL);
        return 0;
    }
    pthread_mutex_lock(&ep->mu);
    int dup = uccl__idmap_get(&ep->incomplete, h.conn_token) != NULL;
    pthread_mutex_unlock(&ep->mu);
    if (dup || h.conn_token == 0) {
        LOG_WARN("refused connection from %s: its token is in use", p->name);
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_PROTO, NULL);
        return 0;
    }
    if (uccl__ep_accept_room(ep, p->name) != UCCL_OK) { /* logged there, with the numbers */
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_BUSY, NULL);
        return 0;
    }
    struct uccl__conn *c = uccl__conn_new(&ep->local, 0, p->fd);
    if (!c) {
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_NOMEM, NULL);
        return 0;
    }
    c->link.tp = uccl__tp_registry[tp_id];
    c->link.token = h.conn_token;
    c->link.num_streams = h.num_streams;
    c->link.chunk_bytes = h.chunk_bytes;
    c->link.peer_gpu = h.gpu_idx;
    c->link.peer_rank = h.rank;
    c->link.peer_pid = h.pid;
    c->link.peer_port = (int)h.listen_port;
    snprintf(c->link.peer_host, sizeof(c->link.peer_host), "%s", h.host_id);
    snprintf(c->link.peer_ip, sizeof(c->link.peer_ip), "%s", p->name);
    c->link.peer_ip[strcspn(c->link.peer_ip, ":")] = '\0';
    ack.transport = (uint32_t)tp_id;
    ack.num_streams = h.num_streams;
    ack.chunk_bytes = h.chunk_bytes;
    if (c->link.tp->conn_accept(&c->link, &h, &ack)) {
        LOG_WARN("refused connection from %s: %s", p->name, uccl_last_error());
        uccl__send_ack(p->fd, &ep->local, UCCL_ERR_UNAVAIL, NULL);
        c->ctrl_fd = -1; /* the caller closes it */
        uccl__conn_put(c);
        return 0;
    }
    uccl__send_ack(p->fd, &ep->local, UCCL_OK, &ack);
    unsigned need = c->link.tp->streams_needed ? c->link.tp->streams_needed(&c->link) : 0;
    if (need == 0) {
        start_accepted(ep, c);
        return 1;
    }
    struct incomplete *inc = calloc(1, sizeof(*inc));
    if (!inc) {
        uccl__conn_put(c);
        return 1;
    }
    *inc = (struct incomplete){.conn = c, .need = need,
                                .deadline = uccl__now_ns() + UCCL_HANDSHAKE_NS};
    pthread_mutex_lock(&ep->mu);
    uccl__idmap_put(&ep->incomplete, c->link.token, inc);
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
                     v[i]->conn->link.peer_ip);
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
                pend[npend] = (struct pending){.fd = fd, .deadline = now + UCCL_HANDSHAKE_NS};
                uccl__sock_peer_name(fd, pend[npend].name, sizeof(pend[npend].name));
                npend++;
            }
        }
        for (unsigned i = 0; i < npend;) {
            struct pending *p = &pend[i];
            int done = 0, keep = 0;
            if (now > p->deadline) { /* trickling counts as silence */
                LOG_WARN("dropped connection from %s: no complete handshake within %llu s",
                         p->name, (unsigned long long)(UCCL_HANDSHAKE_NS / 1000000000ull));
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
        uccl__ep_reap(ep); /* what failed connections hold (conns.c) */
    }
    for (unsigned i = 0; i < npend; i++)
        close(pend[i].fd);
    return NULL;
}

int uccl__listener_start(struct uccl__ep *ep)
{
    if (pipe2(ep->wake_pipe, O_CLOEXEC) < 0)
        return uccl__err(UCCL_ERR_IO, "pipe2: %s", strerror(errno));
    if (pthread_create(&ep->listener, NULL, listener_main, ep))
        return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    ep->listener_started = 1;
    return UCCL_OK;
}

void uccl__listener_stop(struct uccl__ep *ep)
{
    if (ep->listener_started) {
        ssize_t w = write(ep->wake_pipe[1], "x", 1);
        (void)w;
        pthread_join(ep->listener, NULL);
        ep->listener_started = 0;
    }
    expire_incomplete(ep, 1);
}
