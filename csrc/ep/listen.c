/* The listener thread of an endpoint: it accepts sockets and runs each
 * one's handshake (tp/handshake.h) without blocking: for a new connection
 * it reads the connector's INIT, answers with a CHALLENGE, reads its HELLO,
 * checks the proof, picks the transport and answers with an ACK.  A
 * connection whose transport needs more sockets (TCP data streams, the
 * RDMA setup socket) waits in the incomplete table until they have all
 * arrived, each with one record proving the connection's key.
 *
 * What a peer can hold here is bounded, and idle peers cannot keep a
 * legitimate one out: at most MAX_PENDING sockets in their handshake, each
 * dropped (with a "busy" refusal, which makes a real connector dial again)
 * when one of its (at most two) records takes longer than STEP_NS; when every slot is taken, a new
 * socket is still accepted and takes the slot of one that has waited
 * IDLE_NS in its step, of the source address holding the most slots, the
 * oldest first.  A real connector sends each record at once, so it is not
 * evicted unless it stalls; idle or trickling sockets are. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
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

#define MAX_PENDING 64                  /* sockets in their handshake at once */
#define MAX_INCOMPLETE 256              /* connections waiting for their extra sockets */
#define STEP_NS (2000000000ull)         /* for each of the connector's two records */
#define IDLE_NS (150000000ull)          /* a full listener may evict a step this old */

struct pending {
    int fd;
    int step;                /* 0: waiting for the INIT, 1: for the HELLO */
    size_t got;              /* bytes of that record so far */
    uint64_t step_start;
    uint32_t src;            /* the peer's IPv4 address (for eviction) */
    char name[64];
    struct uccl__hs hs;
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
    /* Once in the table and the accept queue, accept() may return it and
     * remove_remote_endpoint() drop the table's reference while this
     * thread still starts it: hold one of our own till the end. */
    uccl__conn_get(c);
    int rc = uccl__ep_add_conn(ep, c, 1);
    int tabled = rc == UCCL_OK;
    if (rc == UCCL_OK)
        rc = uccl__conn_start(c);
    if (rc) {
        LOG_WARN("accepted connection from %s could not start: %s", c->link.peer_ip,
                 uccl_last_error());
        /* the creator's reference, held by the table if it got there and
         * nobody took it out meanwhile */
        int ours = !tabled || uccl__ep_del_conn(ep, c->id);
        uccl__conn_close(c);
        if (ours)
            uccl__conn_put(c);
    } else {
        LOG_INFO("accepted connection %llu from %s:%d over %s", (unsigned long long)c->id,
                 c->link.peer_ip, c->link.peer_port, c->link.tp->name);
    }
    uccl__conn_put(c);
}

/* A new connection's HELLO is in p->hs.rec[2].  Returns 1 if the fd now
 * belongs to the connection, 0 if the caller closes it. */
static int on_hello(struct uccl__ep *ep, struct pending *p)
{
    struct uccl__hello h, ack;
    uint8_t key[32];
    int rc = uccl__hs_check_hello(&p->hs, &h, key);
    if (rc) {
        LOG_WARN("dropped connection from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, rc == UCCL_ERR_AUTH ? UCCL_ERR_AUTH : UCCL_ERR_PROTO);
        return 0;
    }
    memset(&ack, 0, sizeof(ack));
    /* a new connection */
    int tp_id = UCCL_TP_TCP;
    if (choose_transport(ep, &h, &tp_id)) {
        LOG_WARN("refused connection from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, UCCL_ERR_UNAVAIL);
        return 0;
    }
    pthread_mutex_lock(&ep->mu);
    int dup = uccl__idmap_get(&ep->incomplete, h.conn_token) != NULL;
    size_t waiting = ep->incomplete.live;
    pthread_mutex_unlock(&ep->mu);
    if (dup) {
        LOG_WARN("refused connection from %s: its token is in use", p->name);
        uccl__hs_refuse(p->fd, UCCL_ERR_PROTO);
        return 0;
    }
    if (waiting >= MAX_INCOMPLETE) { /* a bound on what peers make us hold */
        LOG_WARN("refused connection from %s for now: %zu connections wait for their streams",
                 p->name, waiting);
        uccl__hs_refuse(p->fd, UCCL_REFUSE_BUSY);
        return 0;
    }
    if (uccl__ep_accept_room(ep, p->name) != UCCL_OK) { /* logged there, with the numbers */
        uccl__hs_refuse(p->fd, UCCL_ERR_BUSY); /* not "busy, dial again": it may last */
        return 0;
    }
    struct uccl__conn *c = uccl__conn_new(&ep->local, 0, p->fd);
    if (!c) {
        uccl__hs_refuse(p->fd, UCCL_ERR_NOMEM);
        return 0;
    }
    c->link.tp = uccl__tp_registry[tp_id];
    c->link.token = h.conn_token;
    c->link.num_streams = h.num_streams;
    c->link.chunk_bytes = h.chunk_bytes;
    c->link.peer_gpu = h.gpu_idx;
    c->link.peer_rank = h.rank;
    c->link.peer_pid = h.pid;
    c->link.peer_pid_ok = tp_id == UCCL_TP_SHM && uccl__hs_peer_pid_ok(p->fd, &ep->local, &h);
    memcpy(c->link.conn_key, key, sizeof(key));
    c->link.peer_port = (int)h.listen_port;
    snprintf(c->link.peer_host, sizeof(c->link.peer_host), "%s", h.host_id);
    snprintf(c->link.peer_ip, sizeof(c->link.peer_ip), "%s", p->name);
    c->link.peer_ip[strcspn(c->link.peer_ip, ":")] = '\0';
    ack.transport = (uint32_t)tp_id;
    ack.num_streams = h.num_streams;
    ack.chunk_bytes = h.chunk_bytes;
    if (c->link.tp->conn_accept(&c->link, &h, &ack)) {
        LOG_WARN("refused connection from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, UCCL_ERR_UNAVAIL);
        c->ctrl_fd = -1; /* the caller closes it */
        uccl__conn_put(c);
        return 0;
    }
    if (uccl__hs_ack(&p->hs, p->fd, &ep->local, &c->link, &ack)) {
        LOG_WARN("dropped connection from %s: sending the ACK: %s", p->name, uccl_last_error());
        c->ctrl_fd = -1;
        uccl__conn_close(c);
        uccl__conn_put(c);
        return 0;
    }
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

/* A connection's extra socket: its one record (h, in p->hs.rec[0]) must
 * prove the key of a connection waiting for it.  Returns 1 if the fd now
 * belongs to that connection, 0 if the caller closes it. */
static int on_stream(struct uccl__ep *ep, struct pending *p, const struct uccl__hello *h)
{
    struct uccl__hello ack;
    uint8_t key[32];
    pthread_mutex_lock(&ep->mu);
    struct incomplete *inc = uccl__idmap_get(&ep->incomplete, h->conn_token);
    if (inc)
        memcpy(key, inc->conn->link.conn_key, sizeof(key));
    pthread_mutex_unlock(&ep->mu);
    if (!inc) {
        LOG_WARN("dropped stream from %s: no connection waits for it", p->name);
        uccl__hs_refuse(p->fd, UCCL_ERR_PROTO);
        return 0;
    }
    if (uccl__hs_check_stream(&p->hs, key)) {
        LOG_WARN("dropped stream from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, UCCL_ERR_AUTH);
        return 0;
    }
    if (h->num_streams != inc->need) {
        LOG_WARN("dropped stream from %s: %u streams, its connection has %u", p->name,
                 h->num_streams, inc->need);
        uccl__hs_refuse(p->fd, UCCL_ERR_PROTO);
        return 0;
    }
    if (inc->conn->link.tp->add_stream(&inc->conn->link, p->fd, h->stream_index)) {
        LOG_WARN("dropped stream from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, UCCL_ERR_PROTO);
        return 0;
    }
    memset(&ack, 0, sizeof(ack));
    ack.transport = (uint32_t)inc->conn->link.tp->id;
    ack.num_streams = h->num_streams;
    ack.stream_index = h->stream_index;
    ack.chunk_bytes = h->chunk_bytes;
    uccl__hs_ack(&p->hs, p->fd, &ep->local, NULL, &ack);
    if (++inc->have == inc->need) {
        pthread_mutex_lock(&ep->mu);
        uccl__idmap_del(&ep->incomplete, h->conn_token);
        pthread_mutex_unlock(&ep->mu);
        start_accepted(ep, inc->conn);
        free(inc);
    }
    return 1;
}

/* The connector's first record is in p->hs.rec[0]: an INIT is answered
 * with the CHALLENGE (*next: wait for its HELLO), a stream's record is
 * taken at once.  Returns 0 if the caller closes the socket. */
static int on_first(struct uccl__ep *ep, struct pending *p, int *next)
{
    struct uccl__hello h;
    *next = 0;
    int rc = uccl__hs_read_first(&p->hs, &h);
    if (rc) {
        LOG_WARN("dropped connection from %s: %s", p->name, uccl_last_error());
        uccl__hs_refuse(p->fd, UCCL_ERR_PROTO); /* an older peer reads our version in it */
        return 0;
    }
    if (h.type == UCCL_HS_STREAM)
        return on_stream(ep, p, &h);
    uccl__hs_challenge(&p->hs, &ep->local, ep->local.secret, ep->local.secret_len);
    /* A fresh socket's buffer takes 256 bytes at once. */
    ssize_t n = send(p->fd, p->hs.rec[1], UCCL_HELLO_SIZE, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n != UCCL_HELLO_SIZE) {
        LOG_WARN("dropped connection from %s: could not send the challenge", p->name);
        return 0;
    }
    *next = 1;
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

/* The slot a new socket may take when all are in use: -1 if none has
 * waited IDLE_NS in its step. */
static int victim(const struct pending *pend, unsigned n, uint64_t now)
{
    int best = -1;
    unsigned best_count = 0;
    for (unsigned i = 0; i < n; i++) {
        if (now - pend[i].step_start < IDLE_NS)
            continue;
        unsigned count = 0;
        for (unsigned j = 0; j < n; j++)
            count += pend[j].src == pend[i].src;
        if (best < 0 || count > best_count ||
            (count == best_count && pend[i].step_start < pend[best].step_start))
            best = (int)i, best_count = count;
    }
    return best;
}

static void drop(struct pending *pend, unsigned *n, unsigned i, int status)
{
    if (status)
        uccl__hs_refuse(pend[i].fd, status);
    close(pend[i].fd);
    pend[i] = pend[--*n];
}

/* Read what p's socket has of its current record; 1: the record is whole. */
static int read_some(struct pending *p, int *closed)
{
    uint8_t *buf = p->hs.rec[p->step == 0 ? 0 : 2];
    ssize_t r = recv(p->fd, buf + p->got, UCCL_HELLO_SIZE - p->got, MSG_DONTWAIT);
    if (r > 0) {
        p->got += (size_t)r;
        return p->got == UCCL_HELLO_SIZE;
    }
    if (r == 0 || (errno != EAGAIN && errno != EINTR))
        *closed = 1;
    return 0;
}

/* Accept what waits on lfd while there is room (or a slot to evict). */
static void accept_new(struct uccl__ep *ep, int lfd, struct pending *pend, unsigned *n,
                       uint64_t now)
{
    for (int k = 0; k < MAX_PENDING; k++) {
        int v = *n < MAX_PENDING ? -1 : victim(pend, *n, now);
        if (*n == MAX_PENDING && v < 0)
            return;
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        int fd = accept4(lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            return;
        if (v >= 0) {
            LOG_WARN("dropped connection from %s: idle in its handshake while others wait",
                     pend[v].name);
            drop(pend, n, (unsigned)v, UCCL_REFUSE_BUSY);
        }
        uccl__sock_tune(fd);
        struct pending *p = &pend[(*n)++];
        p->fd = fd;
        p->step = 0;
        p->got = 0;
        p->step_start = now;
        p->src = sa.sin_family == AF_INET ? sa.sin_addr.s_addr : 0;
        uccl__sock_peer_name(fd, p->name, sizeof(p->name));
    }
    (void)ep;
}

static void *listener_main(void *arg)
{
    struct uccl__ep *ep = arg;
    struct pending *pend = calloc(MAX_PENDING, sizeof(*pend));
    unsigned npend = 0;
    int nlisten = ep->listen_lo_fd >= 0 ? 2 : 1;
    if (!pend) {
        LOG_ERROR("listener of port %d: out of memory; it accepts nothing", ep->local.port);
        nlisten = 0;
    }
    for (;;) {
        struct pollfd pfd[MAX_PENDING + 3];
        uint64_t now = uccl__now_ns();
        int room = npend < MAX_PENDING || victim(pend, npend, now) >= 0;
        int timeout_ms = 500;
        for (unsigned i = 0; i < npend; i++) { /* wake for the next deadline or eviction */
            uint64_t at = pend[i].step_start + (room ? STEP_NS : IDLE_NS);
            int ms = at > now ? (int)((at - now) / 1000000ull) + 1 : 0;
            timeout_ms = ms < timeout_ms ? ms : timeout_ms;
        }
        pfd[0] = (struct pollfd){.fd = ep->wake_pipe[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = nlisten > 0 ? ep->listen_fd : -1,
                                 .events = room ? POLLIN : 0};
        pfd[2] = (struct pollfd){.fd = nlisten > 1 ? ep->listen_lo_fd : -1,
                                 .events = room ? POLLIN : 0};
        for (unsigned i = 0; i < npend; i++)
            pfd[i + 3] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
        unsigned polled = npend;
        int n = poll(pfd, polled + 3, timeout_ms);
        if (n < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break; /* close() */
        now = uccl__now_ns();
        /* Walk back so that a slot filled from the end is one already seen. */
        for (unsigned i = polled; i-- > 0;) {
            struct pending *p = &pend[i];
            int closed = 0, whole = 0;
            if (pfd[i + 3].revents)
                whole = read_some(p, &closed);
            if (closed) {
                LOG_WARN("dropped connection from %s: closed during the handshake after %zu "
                         "bytes", p->name, p->got);
                drop(pend, &npend, i, 0);
            } else if (whole && p->step == 0) {
                int next = 0;
                if (!on_first(ep, p, &next)) {
                    drop(pend, &npend, i, 0);
                } else if (next) {
                    p->step = 1;
                    p->got = 0;
                    p->step_start = now;
                } else {
                    pend[i] = pend[--npend]; /* a stream: its connection has the fd */
                }
            } else if (whole) {
                int keep = on_hello(ep, p);
                if (keep)
                    pend[i] = pend[--npend];
                else
                    drop(pend, &npend, i, 0);
            } else if (now - p->step_start > STEP_NS) { /* trickling counts as silence */
                LOG_WARN("dropped connection from %s: no %s within %llu s", p->name,
                         p->step ? "HELLO after the challenge" : "handshake",
                         (unsigned long long)(STEP_NS / 1000000000ull));
                drop(pend, &npend, i, UCCL_REFUSE_BUSY);
            }
        }
        if (pfd[1].revents & POLLIN)
            accept_new(ep, ep->listen_fd, pend, &npend, now);
        if (pfd[2].revents & POLLIN)
            accept_new(ep, ep->listen_lo_fd, pend, &npend, now);
        expire_incomplete(ep, 0);
        uccl__ep_reap(ep); /* what failed connections hold (conns.c) */
    }
    for (unsigned i = 0; i < npend; i++)
        close(pend[i].fd);
    free(pend);
    return NULL;
}

int uccl__listener_start(struct uccl__ep *ep)
{
    /* Non-blocking: accept() after poll() must not wait for a socket the
     * peer reset meanwhile. */
    if (uccl__sock_set_nonblock(ep->listen_fd, 1) ||
        (ep->listen_lo_fd >= 0 && uccl__sock_set_nonblock(ep->listen_lo_fd, 1)))
        return UCCL_ERR_IO;
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
