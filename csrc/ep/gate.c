/* The stream gate: transfers of GPU memory that wait for their caller's
 * stream (engine.h).
 *
 * An operation on GPU memory starts only after the work its caller queued
 * before the call on its stream (as NCCL orders its kernels): an event is
 * recorded on that stream at the call, and the transfer is posted once the
 * event has completed.  A blocking call polls the event itself; an
 * asynchronous one leaves it here, where one
 * thread per endpoint (started on first use) polls the events and posts
 * each transfer as its event completes.  Posting only then keeps every peer
 * out of the memory until the stream's writes (and reads) of it are done,
 * across processes too: the peer hears of the buffer only after that. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "ep/engine.h"
#include "gpu/gpu.h"
#include "net/sock.h"
#include "base/status.h"

struct uccl__gate_item {
    struct uccl__conn *c;        /* holds a reference */
    struct uccl__req *r;         /* holds a reference */
    void *ev;
    uint64_t deadline;
    int outcome;                 /* once taken out: UCCL_OK, or why it fails */
    struct uccl__gate_item *next;
};

void uccl__gate_init(struct uccl__gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->head = NULL;
    g->started = g->stop = 0;
}

static void item_end(struct uccl__gate_item *it, int status, const char *why)
{
    if (status != UCCL_OK)
        uccl__req_fail_unposted(it->r, status, why);
    else if (uccl__conn_post(it->c, it->r, 0) != UCCL_OK)
        uccl__req_fail_unposted(it->r, UCCL_ERR_IO, uccl_last_error());
    uccl__gpu_event_free(it->ev);
    uccl__req_put(it->r);
    uccl__conn_put(it->c);
    free(it);
}

static void *gate_main(void *arg)
{
    struct uccl__gate *g = arg;
    unsigned idle_polls = 0;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        if (!g->head) {
            idle_polls = 0;
            pthread_cond_wait(&g->cv, &g->mu);
            continue;
        }
        /* Take what is ready (or failed, or late) out of the list. */
        struct uccl__gate_item *ready = NULL, **l = &g->head;
        uint64_t now = uccl__now_ns();
        while (*l) {
            struct uccl__gate_item *it = *l;
            int done = uccl__gpu_event_poll(it->ev);
            if (done != 0 || now > it->deadline) {
                *l = it->next;
                it->next = ready;
                ready = it;
                it->outcome = done < 0 ? UCCL_ERR_IO : done == 0 ? UCCL_ERR_TIMEOUT : UCCL_OK;
            } else {
                l = &it->next;
            }
        }
        pthread_mutex_unlock(&g->mu);
        for (struct uccl__gate_item *it = ready, *n; it; it = n) {
            n = it->next;
            item_end(it, it->outcome,
                     it->outcome == UCCL_ERR_IO ? "work queued on the caller's CUDA stream failed"
                                                : "the caller's CUDA stream did not reach the "
                                                  "transfer within the endpoint's timeout");
        }
        /* Poll at once while events keep completing; then back off to
         * yields, then to short sleeps, so a waiting gate costs no core. */
        idle_polls = ready ? 0 : idle_polls + 1;
        if (idle_polls > 2000)
            usleep(100);
        else if (idle_polls > 50)
            sched_yield();
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

int uccl__gate_add(struct uccl__gate *g, struct uccl__conn *c, struct uccl__req *r, void *ev,
                   uint64_t timeout_ns)
{
    struct uccl__gate_item *it = calloc(1, sizeof(*it));
    if (!it)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    pthread_mutex_lock(&g->mu);
    if (g->stop) {
        pthread_mutex_unlock(&g->mu);
        free(it);
        return uccl__err(UCCL_ERR_CLOSED, "endpoint is closed");
    }
    if (!g->started) {
        if (pthread_create(&g->thread, NULL, gate_main, g)) {
            pthread_mutex_unlock(&g->mu);
            free(it);
            return uccl__err(UCCL_ERR_NOMEM, "cannot start the stream gate thread");
        }
        g->started = 1;
    }
    uccl__conn_get(c);
    uccl__req_get(r);
    *it = (struct uccl__gate_item){.c = c, .r = r, .ev = ev,
                                   .deadline = uccl__now_ns() + timeout_ns, .next = g->head};
    g->head = it;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return UCCL_OK;
}

void uccl__gate_fini(struct uccl__gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_broadcast(&g->cv);
    struct uccl__gate_item *left = g->head;
    g->head = NULL;
    int started = g->started;
    g->started = 0;
    pthread_mutex_unlock(&g->mu);
    if (started)
        pthread_join(g->thread, NULL);
    for (struct uccl__gate_item *it = left, *n; it; it = n) {
        n = it->next;
        item_end(it, UCCL_ERR_CLOSED, "the endpoint was closed while the transfer waited for "
                 "its CUDA stream");
    }
}

/* ------------------------------------------------------------------------- */
/* stream marks (uccl.h), for layers above that order their own work          */

int uccl_stream_mark(int dev, uintptr_t stream, void **mark_p)
{
    return uccl__gpu_event_record(dev, stream, mark_p);
}

int uccl_stream_mark_poll(void *mark)
{
    return mark ? uccl__gpu_event_poll(mark) : 1;
}

int uccl_stream_mark_wait(void *mark, uint64_t timeout_ns)
{
    return mark ? uccl__gpu_event_wait(mark, timeout_ns) : UCCL_OK;
}

void uccl_stream_mark_free(void *mark)
{
    uccl__gpu_event_free(mark);
}
