/* The verbs emulator's completion queues and completion channels
 * (ibv_emu.c says what the library is), with rdma-core's semantics:
 *  - ibv_req_notify_cq arms a CQ for one event: the next completion added
 *    (with solicited_only, the next one of a message sent with
 *    IBV_SEND_SOLICITED, or any error) signals the CQ's channel, and the
 *    CQ is disarmed until armed again;
 *  - a channel's fd becomes readable when an event is pending, so it can
 *    be poll()ed or made non-blocking; ibv_get_cq_event blocks on it
 *    (non-blocking fd: -1 with EAGAIN) and returns the CQ and its context;
 *  - every event returned must be acknowledged (ibv_ack_cq_events) before
 *    ibv_destroy_cq returns, which waits for that as rdma-core does;
 *    events not yet read are dropped with their CQ;
 *  - a CQ still used by a QP, or a channel still used by a CQ, cannot be
 *    destroyed (EBUSY).
 * The queue itself grows rather than overruns (a hardware CQ that
 * overflows raises an asynchronous error, which is not emulated). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ibv_emu.h"

struct emu_cq;
struct emu_event { struct emu_cq *cq; struct emu_event *next; };

struct emu_channel {
    struct ibv_comp_channel_s ch; /* ch.fd: the read end of the pipe */
    int wfd;                      /* write end: one byte per event queued */
    pthread_mutex_t mu;
    struct emu_event *head, **tail;
};

struct emu_cq {
    struct ibv_cq_s cq; /* cq.mutex/cond/comp_events_completed: as rdma-core's */
    pthread_mutex_t mu;
    struct ibv_wc_s *v;
    size_t cap, head, n;
    int armed;          /* 0, ARM_ANY or ARM_SOLICITED */
    int users;          /* QPs using it */
    uint32_t reported;  /* events returned by ibv_get_cq_event (under cq.mutex) */
};
enum { ARM_ANY = 1, ARM_SOLICITED = 2 };

/* ---- completion channels ------------------------------------------------ */
EXPORT struct ibv_comp_channel_s *ibv_create_comp_channel(struct ibv_context_s *c)
{
    struct emu_channel *e = calloc(1, sizeof(*e));
    int p[2];
    if (!e) {
        errno = ENOMEM;
        return NULL;
    }
    if (pipe2(p, O_CLOEXEC)) {
        free(e);
        return NULL;
    }
    /* the writer never blocks: an event is one byte, at most one per arm */
    fcntl(p[1], F_SETFL, O_NONBLOCK);
    e->ch.context = c;
    e->ch.fd = p[0];
    e->wfd = p[1];
    e->tail = &e->head;
    pthread_mutex_init(&e->mu, NULL);
    return &e->ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel_s *ch)
{
    struct emu_channel *e = (struct emu_channel *)ch;
    pthread_mutex_lock(&ch->context->mutex);
    int busy = ch->refcnt > 0;
    pthread_mutex_unlock(&ch->context->mutex);
    if (busy)
        return EBUSY;
    close(ch->fd);
    close(e->wfd);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return 0;
}

/* Under the CQ's lock: queue one event for it on its channel. */
static void signal_channel(struct emu_cq *q)
{
    struct emu_channel *e = (struct emu_channel *)q->cq.channel;
    struct emu_event *ev = malloc(sizeof(*ev));
    if (!ev)
        return; /* lost, as an event queue overflow would lose it */
    *ev = (struct emu_event){.cq = q};
    pthread_mutex_lock(&e->mu);
    *e->tail = ev;
    e->tail = &ev->next;
    char b = 1;
    if (write(e->wfd, &b, 1) != 1) { /* pipe full: nobody reads; drop it */
        struct emu_event **p = &e->head;
        while (*p != ev)
            p = &(*p)->next;
        *p = NULL;
        e->tail = p;
        free(ev);
    }
    pthread_mutex_unlock(&e->mu);
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel_s *ch, struct ibv_cq_s **cq, void **cq_ctx)
{
    struct emu_channel *e = (struct emu_channel *)ch;
    for (;;) {
        char b;
        if (read(ch->fd, &b, 1) != 1)
            return -1; /* errno from read: EAGAIN on a non-blocking fd, EINTR */
        pthread_mutex_lock(&e->mu);
        struct emu_event *ev = e->head;
        if (ev && !(e->head = ev->next))
            e->tail = &e->head;
        pthread_mutex_unlock(&e->mu);
        if (!ev)
            continue; /* its CQ was destroyed before the event was read */
        struct emu_cq *q = ev->cq;
        free(ev);
        pthread_mutex_lock(&q->cq.mutex);
        q->reported++;
        pthread_mutex_unlock(&q->cq.mutex);
        *cq = &q->cq;
        *cq_ctx = q->cq.cq_context;
        return 0;
    }
}

EXPORT void ibv_ack_cq_events(struct ibv_cq_s *cq, unsigned nevents)
{
    pthread_mutex_lock(&cq->mutex);
    cq->comp_events_completed += nevents;
    pthread_cond_broadcast(&cq->cond);
    pthread_mutex_unlock(&cq->mutex);
}

/* ---- completion queues ------------------------------------------------------ */
EXPORT struct ibv_cq_s *ibv_create_cq(struct ibv_context_s *c, int cqe, void *cq_ctx,
                                      struct ibv_comp_channel_s *ch, int vec)
{
    if (cqe < 1 || cqe > EMU_MAX_CQE || vec < 0 || vec >= c->num_comp_vectors ||
        (ch && ch->context != c)) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_cq *q = calloc(1, sizeof(*q));
    if (!q) {
        errno = ENOMEM;
        return NULL;
    }
    q->cq.context = c;
    q->cq.channel = ch;
    q->cq.cq_context = cq_ctx;
    q->cq.cqe = cqe;
    pthread_mutex_init(&q->cq.mutex, NULL);
    pthread_cond_init(&q->cq.cond, NULL);
    pthread_mutex_init(&q->mu, NULL);
    if (ch) {
        pthread_mutex_lock(&c->mutex);
        ch->refcnt++;
        pthread_mutex_unlock(&c->mutex);
    }
    return &q->cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq_s *cq)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_lock(&q->mu);
    int busy = q->users > 0;
    pthread_mutex_unlock(&q->mu);
    if (busy)
        return EBUSY;
    struct ibv_comp_channel_s *ch = cq->channel;
    if (ch) {
        struct emu_channel *e = (struct emu_channel *)ch;
        pthread_mutex_lock(&e->mu); /* its events not yet read go with it */
        for (struct emu_event **p = &e->head; *p;) {
            struct emu_event *ev = *p;
            if (ev->cq == q) {
                *p = ev->next;
                free(ev);
            } else {
                p = &ev->next;
            }
        }
        e->tail = &e->head;
        while (*e->tail)
            e->tail = &(*e->tail)->next;
        pthread_mutex_unlock(&e->mu);
        /* rdma-core's rule: wait until every event returned is acknowledged */
        pthread_mutex_lock(&cq->mutex);
        while (cq->comp_events_completed != q->reported)
            pthread_cond_wait(&cq->cond, &cq->mutex);
        pthread_mutex_unlock(&cq->mutex);
        pthread_mutex_lock(&cq->context->mutex);
        ch->refcnt--;
        pthread_mutex_unlock(&cq->context->mutex);
    }
    pthread_mutex_destroy(&q->mu);
    pthread_mutex_destroy(&cq->mutex);
    pthread_cond_destroy(&cq->cond);
    free(q->v);
    free(q);
    return 0;
}

void emu_cq_use(struct ibv_cq_s *cq, int delta)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_lock(&q->mu);
    q->users += delta;
    pthread_mutex_unlock(&q->mu);
}

void emu_cq_push(struct ibv_cq_s *cq, const struct ibv_wc_s *wc, int solicited)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_lock(&q->mu);
    if (q->n == q->cap) { /* grow rather than overrun: tests read every entry */
        size_t cap = q->cap ? q->cap * 2 : 64;
        struct ibv_wc_s *v = malloc(cap * sizeof(*v));
        if (!v) {
            pthread_mutex_unlock(&q->mu);
            return;
        }
        for (size_t i = 0; i < q->n; i++)
            v[i] = q->v[(q->head + i) % q->cap];
        free(q->v);
        q->v = v;
        q->cap = cap;
        q->head = 0;
    }
    q->v[(q->head + q->n) % q->cap] = *wc;
    q->n++;
    if (q->armed && (q->armed == ARM_ANY || solicited || wc->status != IBV_WC_SUCCESS_)) {
        q->armed = 0;
        if (cq->channel)
            signal_channel(q);
    }
    pthread_mutex_unlock(&q->mu);
}

int emu_poll_cq(struct ibv_cq_s *cq, int num, struct ibv_wc_s *wc)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    int got = 0;
    pthread_mutex_lock(&q->mu);
    while (got < num && q->n > 0) {
        wc[got++] = q->v[q->head];
        q->head = (q->head + 1) % q->cap;
        q->n--;
    }
    pthread_mutex_unlock(&q->mu);
    return got;
}

/* Arms for the next completion only: completions already queued raise no
 * event (poll them after arming, as rdma-core's examples do). */
int emu_req_notify_cq(struct ibv_cq_s *cq, int solicited_only)
{
    struct emu_cq *q = (struct emu_cq *)cq;
    pthread_mutex_lock(&q->mu);
    if (q->armed != ARM_ANY) /* "any" already asked for is not narrowed */
        q->armed = solicited_only ? ARM_SOLICITED : ARM_ANY;
    pthread_mutex_unlock(&q->mu);
    return 0;
}

EXPORT const char *ibv_wc_status_str(int status)
{
    static const char *const str[] = {
        "success", "local length error", "local QP operation error",
        "local EE context operation error", "local protection error",
        "Work Request Flushed Error", "memory management operation error", "bad response error",
        "local access error", "remote invalid request error", "remote access error",
        "remote operation error", "transport retry counter exceeded",
        "RNR retry counter exceeded", "local RDD violation error",
        "remote invalid RD request", "aborted error", "invalid EE context number",
        "invalid EE context state", "fatal error", "response timeout error", "general error",
        "TM error", "TM software rendezvous"};
    if (status < 0 || status >= (int)(sizeof(str) / sizeof(str[0])))
        return "unknown";
    return str[status];
}
