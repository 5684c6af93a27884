/* Same host: CPU memory here, GPU memory through tp_shm_ipc.c.
 *
 * CMA mode (preferred): one copy, by the kernel, straight between the two
 * processes' buffers with process_vm_readv/writev.  The acceptor does every
 * copy (see proto.c) but the initiator's reads.  CMA is used only with a
 * peer whose pid was found to hold the other end of the control socket
 * (link.h: peer_pid_ok), and only once each side read the other's probe
 * word and found there the value both derive from the connection's key
 * (handshake.h): never an address and value a peer chose alone.  Where
 * Yama restricts ptrace, each side lets the other's pid attach for as long
 * as the connection lives (base/ptracer.h).
 *
 * Control messages travel through queues in a shared segment (no system
 * call per message); the control socket only tells that the peer is gone.
 *
 * Ring mode (fallback when CMA is refused, or UCCL_P2P_SHM_MODE=ring): a
 * shared-memory segment with a ring of slots per direction.  The pushing
 * side's thread copies a chunk into a free slot and sends DATA{slot} on the
 * control socket; the other side's service thread checks the chunk against
 * what it posted, copies it out and returns CREDIT{slot}. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/queue.h>
#include <sys/stat.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <stdatomic.h>
#include <unistd.h>

#include "tp/transport.h"
#include "base/pool.h"
#include "base/log.h"
#include "net/sock.h"
#include "base/status.h"
#include "tp/handshake.h"
#include "tp/tp_shm_ipc.h"
#include "base/ptracer.h"

#define RING_SLOTS 8
#define RING_SLOT_BYTES (512u << 10)
#define RING_DIR_BYTES ((size_t)RING_SLOTS * RING_SLOT_BYTES)

/* Control messages: one single-producer/single-consumer queue per direction
 * in the shared segment.  Indices only grow; a slot is index % CTRL_SLOTS, so
 * whatever a peer writes here, we never read outside the mapping. */
#define CTRL_SLOTS 4096 /* unanswered messages one way before a sender waits */
struct ctrl_q {
    _Alignas(64) atomic_uint tail;  /* written by the producer */
    atomic_uint sleeping;           /* the consumer's service thread sleeps on tail (futex) */
    atomic_uint driving;            /* a consumer thread is polling: no wake needed */
    _Alignas(64) atomic_uint head;  /* written by the consumer */
    _Alignas(64) uint8_t slot[CTRL_SLOTS][UCCL_MSG_SIZE];
};
/* Segment: [queue c->a][queue a->c][eager slots c->a][ring c->a][ring a->c],
 * rings in ring mode only. */
#define CTRL_BYTES (2 * sizeof(struct ctrl_q))
#define EAGER_BYTES ((size_t)UCCL_EAGER_INFLIGHT * UCCL_EAGER_MAX)
static size_t seg_bytes(int ring) { return CTRL_BYTES + EAGER_BYTES + (ring ? 2 * RING_DIR_BYTES : 0); }

struct ring_job {
    int kind;
    uint64_t id;
    const char *src;
    uint64_t src_key;        /* its memory kind: GPU memory is copied by the copy engine */
    size_t len;
    void *cookie;
    STAILQ_ENTRY(ring_job) link;
};
STAILQ_HEAD(ring_jobs, ring_job);

struct shm_conn {
    char name[UCCL_SHMNAME_MAX + 1]; /* "/" + the name on the wire */
    char *seg;
    size_t seg_len;
    struct ctrl_q *q_out, *q_in;
    char *out, *in;          /* my outgoing / incoming ring areas (ring mode) */
    int owner;               /* created the segment: unlinks it */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned char busy[RING_SLOTS];
    struct ring_jobs jobs;   /* waiting for (or in) the ring's sender thread */
    int stop, thread;
    pthread_t tx;
};

static int shm_available(void)
{
    return UCCL_OK;
}

/* Can this side copy from and into the peer's memory?  NULL if so, else
 * why not.  The word at addr in the peer (whose pid holds the connection)
 * must hold the value its side derives from the connection's key. */
static const char *probe_peer(struct uccl__link *lk, uint64_t addr, int peer_is_connector,
                              char *why, size_t why_len)
{
    if (!lk->peer_pid_ok)
        return "its pid was not found to hold the other end of the connection "
               "(another network or pid namespace?)";
    uint64_t word = 0;
    struct iovec l = {&word, sizeof(word)};
    struct iovec r = {(void *)(uintptr_t)addr, sizeof(word)};
    ssize_t n = process_vm_readv((pid_t)lk->peer_pid, &l, 1, &r, 1, 0);
    if (n != (ssize_t)sizeof(word)) {
        snprintf(why, why_len, "process_vm_readv: %s", n < 0 ? strerror(errno) : "short read");
        return why;
    }
    if (word != uccl__hs_probe_value(lk->conn_key, peer_is_connector))
        return "its probe word does not hold the value of this connection";
    return NULL;
}

/* Copied in pieces so that a connection failed meanwhile (timeout, close)
 * stops the copy within one piece: its waiter is waiting for us to leave. */
#define CMA_PIECE (64u << 20)

static int cma_copy(struct uccl__link *lk, void *local, uint64_t remote, size_t len)
{
    size_t done = 0;
    while (done < len) {
        if (atomic_load(&lk->failed))
            return uccl__err(UCCL_ERR_IO, "connection failed during the copy");
        size_t n0 = len - done < CMA_PIECE ? len - done : CMA_PIECE;
        struct iovec l = {(char *)local + done, n0};
        struct iovec r = {(void *)(uintptr_t)(remote + done), n0};
        ssize_t n = process_vm_readv((pid_t)lk->peer_pid, &l, 1, &r, 1, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return uccl__err(UCCL_ERR_IO, "process_vm_readv of %zu bytes at 0x%llx in pid %u: %s",
                             n0,
                             (unsigned long long)(remote + done), lk->peer_pid, strerror(errno));
        }
        if (n == 0)
            return uccl__err(UCCL_ERR_IO, "CMA copy made no progress at 0x%llx in pid %u",
                             (unsigned long long)(remote + done), lk->peer_pid);
        done += (size_t)n;
    }
    return UCCL_OK;
}

/* One copy runs at memory speed on one core; while it runs, the peer only
 * waits.  So a large copy is split into parts run by the endpoint's copy
 * helpers (pool.h) and the calling thread: on a small machine (one helper,
 * up to 5 cores) into halves past 16 MiB, so both cores work; on a larger one into
 * parts of at least 1 MiB, as many as there are helpers, because one
 * core copies at 5-9 GB/s, far below what the memory can do, and a thread
 * that waits for several transfers copies them one after the other. */
#define SPLIT_BYTES_SMALL (16u << 20)
#define PART_BYTES_LARGE (1u << 20)
#define MAX_PARTS 16

struct split {
    struct uccl__link *lk;
    char *local;
    uint64_t remote;
    size_t len, step;
    int parts;
    int rc[MAX_PARTS];
    char err[256];               /* the first failure's message */
    atomic_int failed;
};

static void copy_part(void *arg, int i)
{
    struct split *s = arg;
    size_t off = s->step * (size_t)i, end = i == s->parts - 1 ? s->len : off + s->step;
    s->rc[i] = cma_copy(s->lk, s->local + off, s->remote + off, end - off);
    if (s->rc[i] && atomic_fetch_add(&s->failed, 1) == 0)
        snprintf(s->err, sizeof(s->err), "%s", uccl_last_error());
}

static int copy_parts(struct uccl__pool *pool, size_t len)
{
    int width = uccl__pool_width(pool); /* 2 on a small machine (one helper) */
    if (width <= 2)
        return len >= SPLIT_BYTES_SMALL && width > 1 ? 2 : 1;
    size_t parts = len / PART_BYTES_LARGE;
    return parts < 1 ? 1 : parts > (size_t)width ? width : (int)parts;
}

static int cma_copy_split(struct uccl__link *lk, void *local, uint64_t remote, size_t len)
{
    struct uccl__pool *pool = uccl__pool_lazy_get(&lk->local->copy_pool);
    int parts = copy_parts(pool, len);
    if (parts <= 1)
        return cma_copy(lk, local, remote, len);
    if (parts > MAX_PARTS)
        parts = MAX_PARTS;
    struct split s = {.lk = lk, .local = local, .remote = remote, .len = len, .parts = parts,
                      .step = (len / (size_t)parts) & ~(size_t)4095}; /* page-aligned */
    uccl__pool_run(pool, parts, copy_part, &s);
    for (int i = 0; i < parts; i++)
        if (s.rc[i])
            return uccl__err(s.rc[i], "%s", s.err);
    return UCCL_OK;
}

static int shm_pull(struct uccl__link *lk, void *dst, uint64_t local_key, uint64_t remote,
                    uint64_t remote_key, size_t len)
{
    /* Host memory both sides: CMA, which needs no keys (the kernel checks
     * ptrace rights).  A GPU on either side: the copy engine. */
    if (remote_key || UCCL_MK_KIND(local_key) == UCCL_MK_DEVICE)
        return uccl__shm_ipc_pull(lk, dst, local_key, remote, remote_key, len);
    return cma_copy_split(lk, dst, remote, len);
}

static struct shm_conn *shm_new(struct uccl__link *lk)
{
    struct shm_conn *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    STAILQ_INIT(&s->jobs);
    lk->tp_priv = s;
    return s;
}

static int map_segment(struct uccl__link *lk, struct shm_conn *s, int fd, int ring)
{
    s->seg_len = seg_bytes(ring);
    s->seg = mmap(NULL, s->seg_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s->seg == MAP_FAILED) {
        s->seg = NULL;
        return uccl__err(UCCL_ERR_IO, "mmap of shared segment %s: %s", s->name, strerror(errno));
    }
    struct ctrl_q *q = (struct ctrl_q *)s->seg;
    s->q_out = &q[lk->is_connector ? 0 : 1];
    s->q_in = &q[lk->is_connector ? 1 : 0];
    if (ring) {
        char *rings = s->seg + CTRL_BYTES + EAGER_BYTES;
        s->out = rings + (lk->is_connector ? 0 : RING_DIR_BYTES);
        s->in = rings + (lk->is_connector ? RING_DIR_BYTES : 0);
    }
    lk->ctrl_shm = 1;
    return UCCL_OK;
}

static int shm_conn_accept(struct uccl__link *lk, const struct uccl__hello *peer,
                           struct uccl__hello *ack)
{
    struct shm_conn *s = shm_new(lk);
    if (!s)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    int mode = lk->local->shm_mode;
    char buf[160];
    const char *why = mode == 1 ? NULL
                      : !(peer->caps & UCCL_CAP_CMA)
                          ? "it could not check that this process holds the other end of the "
                            "connection"
                          : probe_peer(lk, peer->probe_addr, 1, buf, sizeof(buf));
    int cma_ok = mode != 1 && why == NULL;
    if (!cma_ok && mode == 0)
        return uccl__err(UCCL_ERR_UNAVAIL, "UCCL_P2P_SHM_MODE=cma, but CMA with pid %u is not "
                         "possible: %s", lk->peer_pid, why);
    if (!cma_ok && mode < 0)
        LOG_INFO("no CMA with pid %u (%s): using the shared-memory ring", lk->peer_pid, why);
    if (cma_ok && lk->peer_pid != (uint32_t)getpid()) { /* its reads of us, for as long as we live */
        uccl__ptracer_grant(lk->peer_pid);
        lk->ptracer_pid = lk->peer_pid;
    }
    int ring = !(cma_ok && mode != 1);
    lk->direct = !ring;
    ack->shm_mode = (uint32_t)ring;
    snprintf(s->name, sizeof(s->name), "/uccl-%d-%016llx", (int)getpid(),
             (unsigned long long)uccl__random64());
    int fd = shm_open(s->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
        return uccl__err(UCCL_ERR_UNAVAIL, "shm_open(%s): %s", s->name, strerror(errno));
    s->owner = 1;
    int rc = UCCL_OK;
    if (ftruncate(fd, (off_t)seg_bytes(ring)) < 0)
        rc = uccl__err(UCCL_ERR_UNAVAIL, "ftruncate(%s, %zu): %s", s->name, seg_bytes(ring),
                       strerror(errno));
    if (rc == UCCL_OK)
        rc = map_segment(lk, s, fd, ring);
    close(fd);
    snprintf(ack->shm_name, sizeof(ack->shm_name), "%s", s->name + 1);
    return rc;
}

static int shm_conn_connected(struct uccl__link *lk, const struct uccl__hello *ack,
                              uint64_t deadline)
{
    (void)deadline;
    struct shm_conn *s = shm_new(lk);
    if (!s)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    int ring = ack->shm_mode == 1;
    lk->direct = !ring;
    if (lk->direct) {
        /* Reads are pulled by this side (the initiator copies into its own
         * buffer), so CMA must work this way round too. */
        char buf[160];
        const char *why = probe_peer(lk, ack->probe_addr, 0, buf, sizeof(buf));
        if (why)
            return uccl__err(UCCL_ERR_UNAVAIL, "the peer chose CMA, but CMA with pid %u is not "
                             "possible from here (%s); set UCCL_P2P_SHM_MODE=ring", lk->peer_pid,
                             why);
    }
    /* Only a name of our own scheme: a peer must not make us open (and
     * unlink) some other shared-memory object of this user. */
    if (strncmp(ack->shm_name, "uccl-", 5) != 0)
        return uccl__err(UCCL_ERR_PROTO, "peer named shared segment '%s'", ack->shm_name);
    snprintf(s->name, sizeof(s->name), "/%s", ack->shm_name);
    int fd = shm_open(s->name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0)
        return uccl__err(UCCL_ERR_UNAVAIL, "shm_open(%s): %s", s->name, strerror(errno));
    struct stat st;
    int rc = UCCL_OK;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size != seg_bytes(ring) || st.st_uid != geteuid())
        rc = uccl__err(UCCL_ERR_PROTO, "shared segment %s has the wrong size or owner", s->name);
    if (rc == UCCL_OK)
        rc = map_segment(lk, s, fd, ring);
    close(fd);
    if (rc == UCCL_OK)
        shm_unlink(s->name); /* both sides have it mapped: nothing is left behind */
    return rc;
}

/* Jobs that will never be sent: their requests learn it now. */
static void fail_jobs(struct uccl__link *lk, struct ring_jobs *q)
{
    for (struct ring_job *j; (j = STAILQ_FIRST(q));) {
        STAILQ_REMOVE_HEAD(q, link);
        uccl__conn_tx_done(lk->conn, j->cookie, UCCL_ERR_CLOSED);
        free(j);
    }
}

static void *ring_tx_main(void *arg)
{
    struct uccl__link *lk = arg;
    struct shm_conn *s = lk->tp_priv;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (STAILQ_EMPTY(&s->jobs) && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop)
            break;
        struct ring_job *j = STAILQ_FIRST(&s->jobs);
        int rc = UCCL_OK;
        for (size_t off = 0; off < j->len && rc == UCCL_OK;) {
            unsigned slot = RING_SLOTS;
            while (!s->stop) {
                for (unsigned i = 0; i < RING_SLOTS && slot == RING_SLOTS; i++)
                    if (!s->busy[i])
                        slot = i;
                if (slot < RING_SLOTS)
                    break;
                pthread_cond_wait(&s->cv, &s->mu);
            }
            if (s->stop) {
                rc = UCCL_ERR_CLOSED;
                break;
            }
            s->busy[slot] = 1;
            pthread_mutex_unlock(&s->mu);
            size_t n = j->len - off < RING_SLOT_BYTES ? j->len - off : RING_SLOT_BYTES;
            rc = uccl__gpu_copy_kinds(s->out + (size_t)slot * RING_SLOT_BYTES,
                                      UCCL_MK(UCCL_MK_HOST, 0), j->src + off, (uint32_t)j->src_key,
                                      n, lk->local->timeout_ns);
            if (rc) {
                pthread_mutex_lock(&s->mu);
                s->busy[slot] = 0;
                break;
            }
            struct uccl__msg m = {.type = UCCL_MSG_DATA, .seq = j->id, .len = n, .offset = off,
                                  .token = (uint64_t)j->kind, .aux = slot};
            rc = uccl__conn_send_msg(lk->conn, &m);
            off += n;
            pthread_mutex_lock(&s->mu);
        }
        STAILQ_REMOVE_HEAD(&s->jobs, link);
        pthread_mutex_unlock(&s->mu);
        uccl__conn_tx_done(lk->conn, j->cookie, rc);
        free(j);
        pthread_mutex_lock(&s->mu);
    }
    /* Stopped: fail what is still queued now, not at endpoint close. */
    struct ring_jobs left = STAILQ_HEAD_INITIALIZER(left);
    STAILQ_CONCAT(&left, &s->jobs);
    pthread_mutex_unlock(&s->mu);
    fail_jobs(lk, &left);
    return NULL;
}

static int shm_conn_start(struct uccl__link *lk)
{
    struct shm_conn *s = lk->tp_priv;
    if (lk->direct)
        return UCCL_OK;
    if (pthread_create(&s->tx, NULL, ring_tx_main, lk))
        return uccl__err(UCCL_ERR_NOMEM, "pthread_create failed");
    s->thread = 1;
    return UCCL_OK;
}

static int shm_stream(struct uccl__link *lk, int kind, uint64_t id, const void *src,
                      uint64_t src_key, size_t len, void *cookie)
{
    struct shm_conn *s = lk->tp_priv;
    struct ring_job *j = calloc(1, sizeof(*j));
    if (!j)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *j = (struct ring_job){.kind = kind, .id = id, .src = src, .src_key = src_key, .len = len,
                           .cookie = cookie};
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        free(j);
        return uccl__err(UCCL_ERR_CLOSED, "connection is shutting down");
    }
    STAILQ_INSERT_TAIL(&s->jobs, j, link);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return UCCL_OK;
}

static int shm_on_msg(struct uccl__link *lk, const struct uccl__msg *m)
{
    struct shm_conn *s = lk->tp_priv;
    if (lk->direct || !s->in)
        return uccl__err(UCCL_ERR_PROTO, "ring message on a CMA connection");
    if (m->aux >= RING_SLOTS)
        return uccl__err(UCCL_ERR_PROTO, "ring slot %llu out of range (%d slots)",
                         (unsigned long long)m->aux, RING_SLOTS);
    if (m->type == UCCL_MSG_CREDIT) {
        pthread_mutex_lock(&s->mu);
        int was = s->busy[m->aux];
        s->busy[m->aux] = 0;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        return was ? UCCL_OK : uccl__err(UCCL_ERR_PROTO, "credit for free slot %llu",
                                         (unsigned long long)m->aux);
    }
    if (m->type != UCCL_MSG_DATA)
        return uccl__err(UCCL_ERR_PROTO, "unexpected message type %u", m->type);
    if (m->len == 0 || m->len > RING_SLOT_BYTES || m->token < UCCL_DATA_SEND ||
        m->token > UCCL_DATA_READ)
        return uccl__err(UCCL_ERR_PROTO, "ring chunk of %llu bytes (kind %llu) is malformed",
                         (unsigned long long)m->len, (unsigned long long)m->token);
    char *dst;
    uint64_t dst_key;
    struct uccl__req *r;
    int rc = uccl__conn_rx_begin(lk->conn, (int)m->token, m->seq, m->offset, m->len, &dst,
                                 &dst_key, &r);
    if (rc)
        return rc;
    rc = uccl__gpu_copy_kinds(dst, (uint32_t)dst_key, s->in + (size_t)m->aux * RING_SLOT_BYTES,
                              UCCL_MK(UCCL_MK_HOST, 0), m->len, lk->local->timeout_ns);
    if (rc) {
        uccl__conn_rx_abort(lk->conn, r);
        return rc;
    }
    uccl__conn_rx_end(lk->conn, r, m->len);
    struct uccl__msg cr = {.type = UCCL_MSG_CREDIT, .aux = m->aux};
    return uccl__conn_send_msg(lk->conn, &cr);
}

static char *shm_eager_slot(struct uccl__link *lk, unsigned idx)
{
    struct shm_conn *s = lk->tp_priv;
    return s->seg + CTRL_BYTES + (size_t)idx * UCCL_EAGER_MAX;
}

static void futex_shared(atomic_uint *w, int op, unsigned val, int timeout_ms)
{
    struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
    syscall(SYS_futex, (uint32_t *)w, op, val, op == FUTEX_WAIT ? &ts : NULL, NULL, 0);
}

static int shm_ctrl_send(struct uccl__link *lk, const uint8_t *msg, uint64_t deadline)
{
    struct shm_conn *s = lk->tp_priv;
    struct ctrl_q *q = s->q_out;
    unsigned t = atomic_load_explicit(&q->tail, memory_order_relaxed);
    while (t - atomic_load_explicit(&q->head, memory_order_acquire) >= CTRL_SLOTS) {
        if (atomic_load(&lk->failed))
            return uccl__err(UCCL_ERR_IO, "connection failed");
        if (uccl__now_ns() > deadline)
            return uccl__err(UCCL_ERR_TIMEOUT, "the peer stopped reading control messages");
        sched_yield();
    }
    memcpy(q->slot[t % CTRL_SLOTS], msg, UCCL_MSG_SIZE);
    atomic_store(&q->tail, t + 1); /* seq_cst: ordered before reading `sleeping` */
    if (atomic_load(&q->sleeping) && !atomic_load(&q->driving))
        futex_shared(&q->tail, FUTEX_WAKE, 1, 0);
    return UCCL_OK;
}

static int shm_ctrl_recv(struct uccl__link *lk, uint8_t *msg)
{
    struct shm_conn *s = lk->tp_priv;
    struct ctrl_q *q = s->q_in;
    unsigned h = atomic_load_explicit(&q->head, memory_order_relaxed);
    if (h == atomic_load_explicit(&q->tail, memory_order_acquire))
        return 0;
    memcpy(msg, q->slot[h % CTRL_SLOTS], UCCL_MSG_SIZE);
    atomic_store_explicit(&q->head, h + 1, memory_order_release);
    return 1;
}

/* Sleep until there is a message nobody else is reading, or timeout_ms. */
static void shm_ctrl_wait(struct uccl__link *lk, int timeout_ms)
{
    struct shm_conn *s = lk->tp_priv;
    struct ctrl_q *q = s->q_in;
    unsigned h = atomic_load_explicit(&q->head, memory_order_relaxed);
    atomic_store(&q->sleeping, 1);
    unsigned t = atomic_load(&q->tail); /* seq_cst: pairs with the producer's store */
    if ((t == h || atomic_load(&q->driving)) && !atomic_load(&lk->failed))
        futex_shared(&q->tail, FUTEX_WAIT, t, timeout_ms);
    atomic_store(&q->sleeping, 0);
}

static void shm_ctrl_driving(struct uccl__link *lk, int on)
{
    struct shm_conn *s = lk->tp_priv;
    struct ctrl_q *q = s->q_in;
    atomic_store(&q->driving, (unsigned)on);
    /* Messages the driver left behind: the service thread takes them. */
    if (!on && atomic_load(&q->sleeping) &&
        atomic_load(&q->tail) != atomic_load_explicit(&q->head, memory_order_relaxed))
        futex_shared(&q->tail, FUTEX_WAKE, 1, 0);
}

static void shm_conn_shutdown(struct uccl__link *lk)
{
    struct shm_conn *s = lk->tp_priv;
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->q_in) /* wake our service thread if it sleeps on the queue */
        futex_shared(&s->q_in->tail, FUTEX_WAKE, 1, 0);
}

static void shm_conn_destroy(struct uccl__link *lk)
{
    struct shm_conn *s = lk->tp_priv;
    if (!s)
        return;
    shm_conn_shutdown(lk);
    if (s->thread) {
        pthread_join(s->tx, NULL);
        s->thread = 0;
    }
    fail_jobs(lk, &s->jobs);
    if (s->owner) {
        shm_unlink(s->name); /* in case the peer never opened it */
        s->owner = 0;
    }
}

static void shm_free(struct uccl__link *lk)
{
    struct shm_conn *s = lk->tp_priv;
    if (!s)
        return;
    shm_conn_destroy(lk);
    /* Unmapped only with the last reference: a caller still driving the
     * connection (it holds a request, hence the connection) may touch the
     * queues until it notices the failure. */
    if (s->seg)
        munmap(s->seg, s->seg_len);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    lk->tp_priv = NULL;
}

const struct uccl__tp_ops uccl__tp_shm = {
    .name = "shm",
    .id = UCCL_TP_SHM,
    .available = shm_available,
    .conn_accept = shm_conn_accept,
    .conn_connected = shm_conn_connected,
    .conn_start = shm_conn_start,
    .mem_key = uccl__shm_ipc_mem_key,
    .key_on_gpu = uccl__shm_ipc_key_on_gpu,
    .pull = shm_pull,
    .push = uccl__shm_ipc_push,
    .stream = shm_stream,
    .ctrl_send = shm_ctrl_send,
    .ctrl_recv = shm_ctrl_recv,
    .ctrl_wait = shm_ctrl_wait,
    .ctrl_driving = shm_ctrl_driving,
    .eager_slot = shm_eager_slot,
    .on_msg = shm_on_msg,
    .conn_shutdown = shm_conn_shutdown,
    .conn_destroy = shm_conn_destroy,
    .conn_free = shm_free,
};
