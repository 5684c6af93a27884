/* Stream-ordered groups: the group's life (sgroup.h): made with its
 * watchdog thread, watched while rounds or messages are pending, closed.
 * These are what judge the group's work as a whole, rounds (sg_round.c)
 * and messages (sg_p2p.c, whose pending messages' failure reasons come
 * from there) alike, so this file stands above both; the page's words,
 * failure, registrations and what is pending behind the stream are the
 * group's core (sgroup.c), below them. */
#define _GNU_SOURCE
#include "sg/sg_page.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/status.h"

/* While rounds or messages are pending: release what those behind the
 * streams held; fail the group if the oldest round has not passed this
 * rank's stream within the timeout, or a message has not been copied
 * within it, or a peer process is gone; once the group failed (here or at
 * another rank), keep every stream released.  Once the group has captured
 * rounds, a graph may be replaying them with nothing pending on the host:
 * a peer process gone (and not closing its group) fails it then too, which
 * releases the survivors' replays. */
static void *watch_main(void *arg)
{
    uccl_sg_t *sg = arg;
    pthread_mutex_lock(&sg->mu);
    while (!sg->closed) {
        int graphs = __atomic_load_n(&sg->graph_next, __ATOMIC_RELAXED) > 0 ||
                     __atomic_load_n(&sg->ngmsg, __ATOMIC_RELAXED) > 0;
        if (sg->npend == 0 && sg->np2p == 0 && !graphs && !uccl__sg_failed_locked(sg)) {
            pthread_cond_wait(&sg->cv, &sg->mu);
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t at = (uint64_t)ts.tv_nsec + WATCH_NS;
        ts.tv_sec += (time_t)(at / 1000000000ull);
        ts.tv_nsec = (long)(at % 1000000000ull);
        pthread_cond_timedwait(&sg->cv, &sg->mu, &ts);
        if (sg->closed)
            break;
        if (uccl__sg_failed_locked(sg)) {
            uccl__sg_release_words(sg);
            if (sg->npend == 0 && sg->np2p == 0)
                pthread_cond_wait(&sg->cv, &sg->mu); /* until a round or close */
            continue;
        }
        uccl__sg_reclaim_locked(sg);
        int queued = sg->npend || sg->np2p;
        if (!queued && !graphs)
            continue;
        int gone = -1;
        for (int p = 0; p < sg->size && gone < 0; p++)
            if (p != sg->rank && !uccl__sg_alive(ld64(w64(sg, p, OFF_PID))) &&
                (queued || !ld64(w64(sg, p, OFF_CLOSING))))
                gone = p;
        uint64_t now = uccl__now_ns();
        const struct pending *old = sg->npend && now - sg->pend[0].t0 > sg->timeout_ns
                                        ? &sg->pend[0] : NULL;
        const struct p2p_pending *late = NULL;
        for (int i = 0; i < sg->np2p && !late; i++)
            if (now - sg->p2p[i].t0 > sg->timeout_ns)
                late = &sg->p2p[i];
        if (gone < 0 && !old && !late)
            continue;
        char why[REASON], words[256] = "";
        size_t at_w = 0;
        for (int p = 0; p < sg->size && at_w < sizeof(words) - 32; p++)
            at_w += (size_t)snprintf(words + at_w, sizeof(words) - at_w, "%s%d: %u/%u",
                                     p ? ", " : "", p, ld32(w32(sg, p, OFF_READY)),
                                     ld32(w32(sg, p, OFF_DONE)));
        if (gone >= 0 && !queued)
            snprintf(why, sizeof(why), "rank %d exited while a CUDA graph of the group's "
                     "captured rounds may be replaying", gone);
        else if (gone >= 0)
            snprintf(why, sizeof(why), "rank %d exited with %d round(s) and %d message(s) "
                     "queued (ready/done words by rank: %s)", gone, sg->npend, sg->np2p, words);
        else if (old)
            snprintf(why, sizeof(why), "round %u not through rank %d's stream within %.3g s "
                     "(ready/done words by rank: %s)", old->k, sg->rank,
                     (double)sg->timeout_ns / 1e9, words);
        else
            uccl__sg_p2p_why(sg, late, 0, why, sizeof(why));
        uccl__sg_fail_locked(sg, why);
    }
    pthread_mutex_unlock(&sg->mu);
    return NULL;
}

static void sg_free(uccl_sg_t *sg)
{
    free(sg->peer_ent);
    free(sg->peer_cnt);
    free(sg->p2p_sent);
    free(sg->p2p_recvd);
    free(sg->p2p_gsent);
    free(sg->p2p_grecvd);
    free(sg->gmsg);
    free(sg->arena);
    free(sg->p2p);
    free(sg->pend);
    free(sg->graph_keep);
    free(sg->gchunk);
    free(sg->regs);
    pthread_mutex_destroy(&sg->mu);
    pthread_mutex_destroy(&sg->call_mu);
    pthread_mutex_destroy(&sg->p2p_mu);
    pthread_mutex_destroy(&sg->reg_mu);
    pthread_cond_destroy(&sg->cv);
    free(sg);
}

int uccl_sg_new(void *page, size_t page_len, int rank, int size, double timeout_s,
                uintptr_t stream, const struct uccl__sg_dev *ops, void *d, uccl_sg_t **sg_p)
{
    int rc = UCCL_OK;
    if (!page || ((uintptr_t)page & (PAGE - 1)) || size < 1 || size > UCCL_SG_MAX_RANKS ||
        rank < 0 || rank >= size || page_len < uccl_sg_page_bytes(size) ||
        !(timeout_s > 0 && timeout_s < 1e7))
        rc = uccl__err(UCCL_ERR_INVALID, "stream-ordered group: page %p (%zu bytes, %zu needed), "
                       "rank %d of %d (at most %d), timeout %g s", page, page_len,
                       uccl_sg_page_bytes(size), rank, size, UCCL_SG_MAX_RANKS, timeout_s);
    uccl_sg_t *sg = rc ? NULL : calloc(1, sizeof(*sg));
    if (!rc && !sg)
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    if (rc) {
        ops->destroy(d);
        return rc;
    }
    sg->page = page;
    sg->page_len = page_len;
    sg->rank = rank;
    sg->size = size;
    sg->timeout_ns = (uint64_t)(timeout_s * 1e9);
    sg->own = sg->last = stream;
    sg->ops = ops;
    sg->d = d;
    pthread_mutex_init(&sg->mu, NULL);
    pthread_mutex_init(&sg->call_mu, NULL);
    pthread_mutex_init(&sg->p2p_mu, NULL);
    pthread_mutex_init(&sg->reg_mu, NULL);
    pthread_cond_init(&sg->cv, NULL);
    sg->peer_ent = calloc((size_t)size * MAX_ENTRIES, sizeof(struct entry));
    sg->peer_cnt = calloc((size_t)size, sizeof(uint32_t));
    sg->p2p_sent = calloc((size_t)size, sizeof(uint32_t));
    sg->p2p_recvd = calloc((size_t)size, sizeof(uint32_t));
    sg->p2p_gsent = calloc((size_t)size, sizeof(uint32_t));
    sg->p2p_grecvd = calloc((size_t)size, sizeof(uint32_t));
    sg->arena = calloc((size_t)size, sizeof(struct p2p_arena));
    if (!sg->peer_ent || !sg->peer_cnt || !sg->p2p_sent || !sg->p2p_recvd || !sg->p2p_gsent ||
        !sg->p2p_grecvd || !sg->arena)
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    if (!rc)
        rc = ops->event_new(d, &sg->ev_start);
    if (!rc)
        rc = ops->event_new(d, &sg->ev_mark);
    if (!rc)
        rc = ops->event_new(d, &sg->ev_p2p);
    if (!rc && pthread_create(&sg->watch, NULL, watch_main, sg) != 0)
        rc = uccl__err(UCCL_ERR_NOMEM, "stream-ordered group: no watchdog thread: %s",
                       strerror(errno));
    if (rc) {
        if (sg->ev_start)
            ops->event_free(d, sg->ev_start);
        if (sg->ev_mark)
            ops->event_free(d, sg->ev_mark);
        if (sg->ev_p2p)
            ops->event_free(d, sg->ev_p2p);
        ops->destroy(d);
        sg_free(sg);
        return rc;
    }
    sg->watching = 1;
    st64(w64(sg, rank, OFF_PID), (uint64_t)getpid());
    *sg_p = sg;
    return UCCL_OK;
}


/* Under mu: whether every peer's fin word reached round k, or its process
 * is gone, before `until` (the lock is let go while it waits). */
static int peers_past(uccl_sg_t *sg, uint32_t k, uint64_t until)
{
    for (;;) {
        int all = 1;
        for (int p = 0; p < sg->size && all; p++)
            all = p == sg->rank || ahead(ld32(w32(sg, p, OFF_FIN)), k) ||
                  !uccl__sg_alive(ld64(w64(sg, p, OFF_PID)));
        if (all)
            return 1;
        if (uccl__sg_failed_locked(sg) || uccl__now_ns() > until)
            return 0;
        pthread_mutex_unlock(&sg->mu);
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&sg->mu);
    }
}

/* A message the peer has not posted yet and never will: it closed its
 * group (or its process is gone) first.  A peer that is merely slower
 * (a buffered send it has yet to receive) gets the timeout. */
static int unposted_for_good(uccl_sg_t *sg, const struct p2p_pending *p)
{
    if (!uccl__sg_p2p_unmatched(sg, p))
        return 0;
    uint32_t n = (uint32_t)sg->size;
    int src = (int)(p->chan / n), dst = (int)(p->chan % n);
    int peer = src == sg->rank ? dst : src;
    int gone = __atomic_load_n(w64(sg, peer, OFF_CLOSING), __ATOMIC_ACQUIRE) ||
               !uccl__sg_alive(ld64(w64(sg, peer, OFF_PID)));
    /* it posts before it closes: read its arrival again after its flag */
    return gone && uccl__sg_p2p_unmatched(sg, p);
}

int uccl_sg_close(uccl_sg_t *sg)
{
    if (!sg)
        return 1;
    pthread_mutex_lock(&sg->mu);
    sg->closed = 1;
    pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
    /* peers waiting for this rank to post a message learn it never will */
    __atomic_store_n(w64(sg, sg->rank, OFF_CLOSING), 1, __ATOMIC_RELEASE);
    if (sg->watching)
        pthread_join(sg->watch, NULL);
    /* the copies of rounds still queued read through their mappings: wait
     * (on the host, bounded) until this rank's stream is past them */
    uint64_t until = uccl__now_ns() + sg->timeout_ns;
    pthread_mutex_lock(&sg->mu);
    while ((sg->npend || sg->np2p) && !uccl__sg_failed_locked(sg)) {
        uccl__sg_reclaim_locked(sg);
        if (!sg->npend && !sg->np2p)
            break;
        for (int i = 0; i < sg->np2p; i++)
            if (unposted_for_good(sg, &sg->p2p[i])) {
                char why[REASON];
                uccl__sg_p2p_why(sg, &sg->p2p[i], 1, why, sizeof(why));
                uccl__sg_fail_locked(sg, why);
                break;
            }
        if (uccl__sg_failed_locked(sg))
            break;
        if (uccl__now_ns() > until) {
            char why[REASON];
            snprintf(why, sizeof(why), "closed with rounds or messages still queued that did "
                     "not finish within the timeout");
            for (int i = 0; i < sg->np2p; i++)
                if (uccl__sg_p2p_unmatched(sg, &sg->p2p[i])) {
                    uccl__sg_p2p_why(sg, &sg->p2p[i], 1, why, sizeof(why));
                    break;
                }
            uccl__sg_fail_locked(sg, why);
            break;
        }
        pthread_mutex_unlock(&sg->mu);
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&sg->mu);
    }
    int ok = !uccl__sg_failed_locked(sg) || (sg->npend == 0 && sg->np2p == 0);
    /* a peer's launches (one-launch rounds, handshakes) read this rank's
     * arena until it is past the round; the arena goes only once every peer
     * is (or is gone) */
    if (ok && sg->fz_last && (uccl__sg_failed_locked(sg) || !peers_past(sg, sg->fz_last, until)))
        ok = 0;
    pthread_mutex_unlock(&sg->mu);
    if (ok) {
        for (int i = 0; i < sg->npend; i++)
            uccl__sg_pending_free(sg, &sg->pend[i]);
        for (int i = 0; i < sg->np2p; i++)
            uccl__sg_p2p_free(sg, &sg->p2p[i]);
        for (int i = 0; i < sg->fz_nimp; i++)
            sg->ops->unmap(sg->d, sg->fz_imp[i]);
        for (int i = 0; i < sg->ngraph_keep; i++) /* graphs are not to be replayed past here */
            uccl__sg_pending_free(sg, &sg->graph_keep[i]);
    } else { /* the mappings stay: the stream may still copy through them; their lists go */
        for (int i = 0; i < sg->npend; i++)
            free(sg->pend[i].imp);
        for (int i = 0; i < sg->ngraph_keep; i++)
            free(sg->graph_keep[i].imp);
    }
    uccl__sg_reg_drop_all(sg);
    if (ok) /* after their registrations: the captured rounds' arenas */
        uccl__sg_graph_free(sg);
    sg->ops->event_free(sg->d, sg->ev_start);
    sg->ops->event_free(sg->d, sg->ev_mark);
    sg->ops->event_free(sg->d, sg->ev_p2p);
    for (int i = 0; i < sg->ngmsg; i++)
        sg->ops->event_free(sg->d, sg->gmsg[i].ev);
    sg->ops->destroy(sg->d);
    sg_free(sg);
    return ok;
}
