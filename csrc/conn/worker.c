/* The copies a connection makes (conn.h, UCCL_JOB_*): a pull into a
 * posted buffer or a window, a push into the peer's GPU memory, each
 * followed by its answer to the peer.  The protocol queues them (proto.c);
 * the connection's worker thread runs them, or the caller driving the
 * connection runs them itself, on its own thread, so a blocking caller's
 * copy needs no thread handoff (progress.c marks that caller here). */
#define _GNU_SOURCE
#include <stdlib.h>

#include "conn/conn.h"
#include "base/log.h"
#include "base/status.h"

static void run_job(struct uccl__conn *c, struct uccl__job *j);

/* ------------------------------------------------------------------------- */
/* copy jobs                                                                  */

/* The connection whose copies this thread makes itself: the one it drives
 * (progress.c, uccl__conn_drive) or posts to blocking, if any. */
static _Thread_local struct uccl__conn *tls_driving;

struct uccl__conn *uccl__conn_driving(void) { return tls_driving; }

void uccl__conn_set_driving(struct uccl__conn *c) { tls_driving = c; }

/* A job that will touch r's buffer marks it busy from now on, so a waiter
 * that gives up cannot return between queueing and copying. */
static int writes_req(int kind)
{
    return kind == UCCL_JOB_PULL_RECV || kind == UCCL_JOB_PULL_READ ||
           kind == UCCL_JOB_PUSH_SEND || kind == UCCL_JOB_PUSH_WRITE;
}

static void job_done(struct uccl__conn *c, struct uccl__job *j)
{
    if (j->busy_held)
        atomic_fetch_sub(&j->req->busy, 1);
    j->busy_held = 0;
    if (j->served) /* the peer's read or write is over here */
        atomic_fetch_sub(&c->served, 1);
    j->served = 0;
    uccl__mem_release_hold(&c->link.local->mem, j->hold);
    j->hold = NULL;
}

void uccl__conn_push_job(struct uccl__conn *c, int kind, struct uccl__req *r,
                         const struct uccl__msg *m, void *dst, struct uccl__mr *hold)
{
    int busy = r && writes_req(kind);
    /* the peer's own read or write (proto.c counted it in c->served) */
    int served = kind == UCCL_JOB_PULL_WRITE || kind == UCCL_JOB_PUSH_READ;
    if (busy)
        atomic_fetch_add(&r->busy, 1);
    if (tls_driving == c) { /* the waiting caller copies itself: no handoff */
        struct uccl__job j = {.kind = kind, .req = r, .dst = dst, .hold = hold, .busy_held = busy,
                              .served = served};
        if (m)
            j.msg = *m;
        if (!atomic_load(&c->link.failed))
            run_job(c, &j);
        job_done(c, &j);
        return;
    }
    struct uccl__job *j = calloc(1, sizeof(*j));
    if (!j) {
        struct uccl__job tmp = {.kind = kind, .req = r, .hold = hold, .busy_held = busy,
                                .served = served};
        job_done(c, &tmp);
        uccl__conn_fail(c, UCCL_ERR_NOMEM, "out of memory queueing a copy");
        return;
    }
    j->kind = kind;
    j->req = r;
    j->hold = hold;
    j->busy_held = busy;
    j->served = served;
    if (r)
        uccl__req_get(r);
    if (m)
        j->msg = *m;
    j->dst = dst;
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->link.failed)) { /* the worker may be gone: nobody would run it */
        pthread_mutex_unlock(&c->mu);
        job_done(c, j);
        if (j->req)
            uccl__req_put(j->req);
        free(j);
        return;
    }
    STAILQ_INSERT_TAIL(&c->jobs, j, link);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void uccl__conn_with_inline_copies(struct uccl__conn *c, void (*fn)(struct uccl__conn *))
{
    if (tls_driving) { /* this thread drives a connection already: leave it be */
        fn(c);
        return;
    }
    tls_driving = c;
    fn(c);
    tls_driving = NULL;
}

/* ------------------------------------------------------------------------- */
/* the worker thread: direct copies                                           */

static void run_job(struct uccl__conn *c, struct uccl__job *j)
{
    int rc;
    struct uccl__req *r = j->req;
    switch (j->kind) {
    case UCCL_JOB_PULL_RECV:
    case UCCL_JOB_PULL_READ:
        if (atomic_load(&r->state) != UCCL_REQ_PENDING)
            break; /* already finished or failed: its buffer is not ours to fill */
        rc = c->link.tp->pull(&c->link, r->buf, r->local_key, r->remote_addr, r->remote_key,
                              r->len);
        if (rc) {
            uccl__conn_fail(c, rc, "copying %s %llu from the peer: %s",
                            j->kind == UCCL_JOB_PULL_RECV ? "message" : "read",
                            (unsigned long long)r->seq, uccl_last_error());
            break;
        }
        job_done(c, j); /* done writing into r: only then may it complete */
        uccl__req_answer(c, r, j->kind == UCCL_JOB_PULL_RECV ? UCCL_MSG_FIN : UCCL_MSG_RDONE,
                         r->len, UCCL_OK, NULL);
        break;
    case UCCL_JOB_PULL_WRITE:
        rc = c->link.tp->pull(&c->link, j->dst, j->hold ? j->hold->tp_key[c->link.tp->id] : 0,
                              j->msg.addr, j->msg.aux, j->msg.len);
        if (rc)
            LOG_WARN("connection %llu: one-sided copy failed: %s", (unsigned long long)c->id,
                     uccl_last_error());
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, j->msg.seq, j->msg.len, (uint64_t)(int64_t)rc);
        break;
    case UCCL_JOB_PUSH_SEND:
    case UCCL_JOB_PUSH_WRITE:
        if (atomic_load(&r->state) != UCCL_REQ_PENDING)
            break;
        rc = c->link.tp->push(&c->link, r->buf, r->local_key, r->remote_addr, r->remote_key,
                              r->len);
        if (rc) {
            uccl__conn_fail(c, rc, "copying %s %llu into the peer's GPU memory: %s",
                            j->kind == UCCL_JOB_PUSH_SEND ? "message" : "write",
                            (unsigned long long)r->seq, uccl_last_error());
            break;
        }
        job_done(c, j);
        uccl__req_answer(c, r, j->kind == UCCL_JOB_PUSH_SEND ? UCCL_MSG_PDONE : UCCL_MSG_RDONE,
                         r->len, UCCL_OK, NULL);
        break;
    case UCCL_JOB_PUSH_READ: /* our window into the reader's GPU buffer */
        rc = c->link.tp->push(&c->link, j->dst, j->hold ? j->hold->tp_key[c->link.tp->id] : 0,
                              j->msg.addr, j->msg.aux, j->msg.len);
        if (rc)
            LOG_WARN("connection %llu: one-sided copy failed: %s", (unsigned long long)c->id,
                     uccl_last_error());
        job_done(c, j); /* let the window go before the reader hears */
        uccl__conn_send_simple(c, UCCL_MSG_OPDONE, j->msg.seq, j->msg.len, (uint64_t)(int64_t)rc);
        break;
    }
}

/* The worker thread: queued copies, and the announcing of requests that
 * waited for the window (uccl__conn_launch: it may wait for room on the
 * control channel, which the connection's reader must never do). */
void *uccl__conn_worker_main(void *arg)
{
    struct uccl__conn *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (STAILQ_EMPTY(&c->jobs) && !c->launch && !atomic_load(&c->link.failed))
            pthread_cond_wait(&c->cv, &c->mu);
        int launch = c->launch;
        c->launch = 0;
        struct uccl__job *j = STAILQ_FIRST(&c->jobs);
        if (j)
            STAILQ_REMOVE_HEAD(&c->jobs, link);
        pthread_mutex_unlock(&c->mu);
        if (launch)
            uccl__conn_launch(c);
        if (!j && launch)
            continue;
        if (!j)
            break; /* failed and drained */
        if (!atomic_load(&c->link.failed))
            run_job(c, j);
        job_done(c, j);
        if (j->req)
            uccl__req_put(j->req);
        free(j);
    }
    atomic_fetch_add(&c->threads_out, 1);
    return NULL;
}
