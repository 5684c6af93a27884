/* Stream-ordered groups: the group's core (sgroup.h), under its rounds
 * (sg_round.c), its messages (sg_p2p.c) and its life (sg_watch.c): the
 * page's words, failure, the host's waits for peers, this rank's
 * registrations, and the rounds and messages pending behind the stream.
 *
 * The page's words are each written by one side: ready/done/done2/fin by
 * the owner's stream, consumed, pid and the slots by the owner's host, the
 * header by whoever fails the group first.  Hosts read and write them with
 * acquire loads and release stores; a slot's round is stored last, so a
 * peer that sees the round sees the entries and the header. */
#define _GNU_SOURCE
#include "sg/sg_page.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "net/sock.h"
#include "base/status.h"

size_t uccl_sg_page_bytes(int size)
{
    if (size < 1)
        return 0;
    size_t n = graph_off(size) + (size_t)GRAPH_SLOTS * size * GW_WORDS * sizeof(uint32_t);
    return (n + PAGE - 1) / PAGE * PAGE;
}

int uccl__sg_alive(uint64_t pid)
{
    if (pid == 0 || pid > 0x7fffffff)
        return 1; /* not written yet */
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return 0;
    /* A process that died but that its parent has not reaped (a zombie)
     * still answers kill(); its state in /proc says it is gone.  A rank
     * SIGKILLed under torchrun or multiprocessing stays one until its
     * parent's next poll, or for good while the parent blocks elsewhere. */
    char path[48], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1; /* no /proc to ask: kill() said alive */
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = '\0';
    const char *end = strrchr(buf, ')'); /* the name may hold anything, ')' too */
    return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

/* Room for one more of *arr's n elements of esz bytes (capacity *cap,
 * doubled from `first`). */
static int grow(void **arr, int *cap, int n, size_t esz, int first)
{
    if (n < *cap)
        return UCCL_OK;
    int c = *cap ? 2 * *cap : first;
    void *a = realloc(*arr, (size_t)c * esz);
    if (!a)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *arr = a;
    *cap = c;
    return UCCL_OK;
}

/* ---- failure ------------------------------------------------------------------- */
/* Every channel's words (sg_p2p.c) far past its highest message. */
static void release_chans(uccl_sg_t *sg)
{
    uint32_t n = (uint32_t)sg->size;
    for (uint32_t c = 0; c < n * n; c++) {
        if (c / n == c % n)
            continue;
        struct p2p_chan *ch = chan_at(sg, c);
        uint32_t far = (uint32_t)ld64(&ch->high) + RELEASE_AHEAD;
        for (int side = 0; side < 2; side++) {
            st32(&ch->ready[side][0], far);
            st32(&ch->done[side][0], far);
        }
        /* captured messages: a wait counts from the waiter's epoch */
        for (int j = 0; j < P2P_GRAPH; j++) {
            uint32_t a = ld32(&ch->gw[j][PG_EP]), b = ld32(&ch->gw[j][PG_EP + 1]);
            uint32_t e = (ahead(a, b) ? a : b) + RELEASE_AHEAD;
            for (int w = PG_RDY; w < PG_WORDS; w++)
                st32(&ch->gw[j][w], e);
        }
    }
}

/* Every captured round's words (sg_graph.c): a wait counts from the
 * waiter's epoch, within a replay of the writer's. */
static void release_graph_words(uccl_sg_t *sg)
{
    for (uint32_t g = 0; g < GRAPH_SLOTS; g++)
        for (int r = 0; r < sg->size; r++) {
            uint32_t e = ld32(gword(sg, g, r, GW_EPOCH)) + RELEASE_AHEAD;
            for (int w = GW_READY; w < GW_WORDS; w++)
                st32(gword(sg, g, r, w), e);
        }
}

void uccl__sg_release_words(uccl_sg_t *sg)
{
    uint32_t far = sg->round + RELEASE_AHEAD;
    for (int r = 0; r < sg->size; r++) {
        st32(w32(sg, r, OFF_READY), far);
        st32(w32(sg, r, OFF_DONE), far);
        st32(w32(sg, r, OFF_DONE2), far);
        st32(w32(sg, r, OFF_FIN), far);
    }
    release_graph_words(sg);
    release_chans(sg);
}

int uccl__sg_failed_locked(uccl_sg_t *sg)
{
    if (__atomic_load_n(&sg->failed, __ATOMIC_ACQUIRE))
        return 1;
    uint32_t *flag = (uint32_t *)sg->page;
    uint32_t f = ld32(flag);
    if (f == FLAG_OK)
        return 0;
    /* another rank is writing its reason: a few stores, wait for them */
    for (int i = 0; f == FLAG_WRITING && i < 100000; i++) {
        sched_yield();
        f = ld32(flag);
    }
    if (f == FLAG_FAILED) {
        memcpy(sg->error, sg->page + 8, REASON - 1);
        sg->error[REASON - 1] = '\0';
    }
    if (!sg->error[0])
        snprintf(sg->error, sizeof(sg->error), "another rank failed the group");
    __atomic_store_n(&sg->failed, 1, __ATOMIC_RELEASE); /* after the reason: readers see it whole */
    uccl__sg_release_words(sg);
    pthread_cond_broadcast(&sg->cv);
    return 1;
}

void uccl__sg_fail_locked(uccl_sg_t *sg, const char *why)
{
    if (!uccl__sg_failed_locked(sg)) {
        snprintf(sg->error, sizeof(sg->error), "%s", why);
        __atomic_store_n(&sg->failed, 1, __ATOMIC_RELEASE);
        uint32_t *flag = (uint32_t *)sg->page, zero = FLAG_OK;
        if (__atomic_compare_exchange_n(flag, &zero, FLAG_WRITING, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            memcpy(sg->page + 8, sg->error, REASON);
            st32(flag, FLAG_FAILED);
        }
    }
    uccl__sg_release_words(sg);
    pthread_cond_broadcast(&sg->cv);
}

void uccl_sg_fail(uccl_sg_t *sg, const char *why)
{
    pthread_mutex_lock(&sg->mu);
    uccl__sg_fail_locked(sg, why && *why ? why : "failed by the caller");
    pthread_mutex_unlock(&sg->mu);
}

const char *uccl_sg_error(uccl_sg_t *sg)
{
    if (__atomic_load_n(&sg->failed, __ATOMIC_ACQUIRE))
        return sg->error;
    if (ld32((uint32_t *)sg->page) == FLAG_OK)
        return NULL;
    pthread_mutex_lock(&sg->mu);
    uccl__sg_failed_locked(sg);
    pthread_mutex_unlock(&sg->mu);
    return sg->error;
}

/* Fail the group with the message recorded on this thread; the status as it was. */
int uccl__sg_fail_rc(uccl_sg_t *sg, int rc)
{
    char why[REASON];
    snprintf(why, sizeof(why), "%s", uccl_last_error());
    uccl_sg_fail(sg, why);
    return uccl__err(rc, "%s", why);
}

int uccl__sg_failed_err(uccl_sg_t *sg, const char *what)
{
    return uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: the group failed: %s",
                     sg->rank, what, uccl_sg_error(sg));
}

/* ---- waiting for peers on the host ------------------------------------------------ */

int uccl__sg_consumed_ready(uccl_sg_t *sg, uint32_t k, int r)
{
    for (int p = 0; p < sg->size; p++)
        if (p != sg->rank && !ahead((uint32_t)ld64(w64(sg, p, OFF_CONSUMED)), k - NSLOT))
            return 0;
    (void)r;
    return 1;
}

int uccl__sg_arrived(uccl_sg_t *sg, uint32_t k, int r)
{
    const struct slot_head *h = (const struct slot_head *)slot(sg, r, k);
    return ld64(&h->round) == k;
}

/* Spin, then yield, then sleep, until ready(); past the deadline, with a
 * peer process gone, or on an interrupt: fail the group.  What is awaited
 * (wfmt, for the messages) is formatted only once the first look finds it
 * not ready: the waits run on every round and message, and most end there. */
int uccl__sg_host_wait(uccl_sg_t *sg, uccl__sg_ready_fn ready, uint32_t k, int r, const char *what,
                       uint64_t deadline, uccl_sg_interrupt_fn intr, void *intr_arg,
                       const char *wfmt, ...)
{
    if (ready(sg, k, r))
        return UCCL_OK;
    uint64_t slow = 0;
    char waiting[128];
    va_list ap;
    va_start(ap, wfmt);
    vsnprintf(waiting, sizeof(waiting), wfmt, ap);
    va_end(ap);
    for (unsigned long spins = 0;; spins++) {
        if (ready(sg, k, r))
            return UCCL_OK;
        if (spins < 64) {
            __asm__ __volatile__("" ::: "memory");
            continue;
        }
        if (uccl_sg_error(sg))
            return uccl__sg_failed_err(sg, what);
        uint64_t now = uccl__now_ns();
        if (now >= slow) {
            slow = now + SLOW_CHECK_NS;
            for (int p = 0; p < sg->size; p++)
                if (p != sg->rank && !uccl__sg_alive(ld64(w64(sg, p, OFF_PID)))) {
                    uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: %s: rank %d "
                              "exited", sg->rank, what, waiting, p);
                    return uccl__sg_fail_rc(sg, UCCL_ERR_IO);
                }
            if (intr && intr(intr_arg)) {
                uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: interrupted while "
                          "%s", sg->rank, what, waiting);
                return uccl__sg_fail_rc(sg, UCCL_ERR_IO);
            }
        }
        if (now > deadline) {
            uccl__err(UCCL_ERR_TIMEOUT, "stream-ordered group (rank %d), %s: %s: not within the "
                      "group's timeout (%.3g s)", sg->rank, what, waiting,
                      (double)sg->timeout_ns / 1e9);
            return uccl__sg_fail_rc(sg, UCCL_ERR_TIMEOUT);
        }
        if (spins < 2048) {
            sched_yield();
        } else {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

/* ---- registrations of this rank's buffers ------------------------------------------- */
static void reg_drop(uccl_sg_t *sg, int i)
{
    sg->ops->dereg(sg->d, sg->regs[i].reg);
    sg->regs[i] = sg->regs[--sg->nregs];
}

void uccl__sg_reg_drop_all(uccl_sg_t *sg)
{
    while (sg->nregs)
        reg_drop(sg, sg->nregs - 1);
}

/* Past REG_CACHE: drop the least recently used registrations every peer has
 * read the keys of (none is still to map one) and no message pins. */
static void reg_evict(uccl_sg_t *sg)
{
    uint32_t read = sg->round;
    for (int p = 0; p < sg->size; p++) {
        uint32_t c = (uint32_t)ld64(w64(sg, p, OFF_CONSUMED));
        if (p != sg->rank && !ahead(c, read))
            read = c;
    }
    while (sg->nregs > REG_CACHE) {
        int victim = -1;
        for (int i = 0; i < sg->nregs; i++)
            if (ahead(read, sg->regs[i].last) && sg->regs[i].pins == 0 &&
                (victim < 0 || sg->regs[i].used < sg->regs[victim].used))
                victim = i;
        if (victim < 0)
            return; /* all in use: kept until later rounds */
        reg_drop(sg, victim);
    }
}

/* The key peers map [ptr, +len) by, from a registration made once and
 * reused while the memory is the allocation it registered (the device
 * checks that at every use: a freed and reused address fails the check
 * and is registered anew). */
static int reg_key_locked(uccl_sg_t *sg, uintptr_t ptr, size_t len, uint32_t k,
                          uint64_t *key_p, uint64_t *pin_p)
{
    if (sg->size == 1) { /* nobody to share it with */
        *key_p = 0;
        return UCCL_OK;
    }
    for (int i = 0; i < sg->nregs; i++) {
        struct reg *e = &sg->regs[i];
        if (e->ptr != ptr || e->len != len)
            continue;
        if (sg->ops->key(sg->d, e->reg, ptr, len, &e->key) == UCCL_OK) {
            if (ahead(k, e->last)) /* a post may pass an older round than a round's own */
                e->last = k;
            e->used = ++sg->clock;
            *key_p = e->key;
            if (pin_p) {
                e->pins++;
                *pin_p = e->reg;
            }
            return UCCL_OK;
        }
        reg_drop(sg, i);
        break;
    }
    int rc = grow((void **)&sg->regs, &sg->cap_regs, sg->nregs, sizeof(struct reg),
                  REG_CACHE + 8);
    if (rc)
        return rc;
    uint64_t reg = 0, key = 0;
    rc = sg->ops->reg(sg->d, ptr, len, &reg);
    if (rc)
        return rc;
    if ((rc = sg->ops->key(sg->d, reg, ptr, len, &key))) {
        sg->ops->dereg(sg->d, reg);
        return rc;
    }
    sg->regs[sg->nregs++] = (struct reg){ptr, len, reg, key, ++sg->clock, k, pin_p ? 1 : 0};
    *key_p = key;
    if (pin_p)
        *pin_p = reg;
    reg_evict(sg);
    return UCCL_OK;
}

int uccl__sg_reg_key(uccl_sg_t *sg, uintptr_t ptr, size_t len, uint32_t k, uint64_t *key_p,
                     uint64_t *pin_p)
{
    pthread_mutex_lock(&sg->reg_mu);
    int rc = reg_key_locked(sg, ptr, len, k, key_p, pin_p);
    pthread_mutex_unlock(&sg->reg_mu);
    return rc;
}

void uccl__sg_reg_age(uccl_sg_t *sg, uint32_t k)
{
    pthread_mutex_lock(&sg->reg_mu);
    for (int i = 0; i < sg->nregs; i++)
        if ((uint32_t)(k - sg->regs[i].last) > (1u << 30))
            sg->regs[i].last = k - (1u << 30); /* as young: later to evict, never earlier */
    pthread_mutex_unlock(&sg->reg_mu);
}

void uccl__sg_reg_unpin(uccl_sg_t *sg, uint64_t reg)
{
    pthread_mutex_lock(&sg->reg_mu);
    for (int i = 0; i < sg->nregs; i++)
        if (sg->regs[i].reg == reg && sg->regs[i].pins) {
            sg->regs[i].pins--;
            break;
        } /* not found: dropped meanwhile (its memory was freed and reused) */
    pthread_mutex_unlock(&sg->reg_mu);
}

/* ---- rounds behind the stream ------------------------------------------------------- */
void uccl__sg_pending_free(uccl_sg_t *sg, struct pending *p)
{
    for (int i = 0; i < p->nimp; i++)
        sg->ops->unmap(sg->d, p->imp[i]);
    free(p->imp);
}

void uccl__sg_p2p_free(uccl_sg_t *sg, struct p2p_pending *p)
{
    if (p->imp)
        sg->ops->unmap(sg->d, p->imp);
    if (p->reg)
        uccl__sg_reg_unpin(sg, p->reg);
}

/* Has the copier's done word passed message p? */
static int p2p_passed(uccl_sg_t *sg, const struct p2p_pending *p)
{
    return ahead(ld32(&chan_at(sg, p->chan)->done[p->copier][0]), p->k);
}

/* Under mu: release the peers' memory that rounds behind this rank's stream
 * mapped (its fin word passed them).  Not once the group failed: fin may
 * then be the release's value, with copies still queued. */
void uccl__sg_reclaim_locked(uccl_sg_t *sg)
{
    /* the words first, then the failure flag: a failing rank sets its flag
     * before it releases the words, so a released value read here is seen
     * as the failure below, and nothing is freed on it */
    uint32_t fin = ld32(w32(sg, sg->rank, OFF_FIN));
    for (int i = 0; i < sg->np2p; i++)
        sg->p2p[i].passed = p2p_passed(sg, &sg->p2p[i]);
    if (uccl__sg_failed_locked(sg))
        return;
    int kept = 0;
    for (int i = 0; i < sg->np2p; i++) {
        if (sg->p2p[i].passed)
            uccl__sg_p2p_free(sg, &sg->p2p[i]);
        else
            sg->p2p[kept++] = sg->p2p[i];
    }
    sg->np2p = kept;
    int done = 0;
    while (done < sg->npend && ahead(fin, sg->pend[done].k))
        uccl__sg_pending_free(sg, &sg->pend[done++]);
    if (done) {
        memmove(sg->pend, sg->pend + done, (size_t)(sg->npend - done) * sizeof(*sg->pend));
        sg->npend -= done;
    }
}

int uccl__sg_p2p_add(uccl_sg_t *sg, struct p2p_pending p)
{
    pthread_mutex_lock(&sg->mu);
    int rc = grow((void **)&sg->p2p, &sg->cap_p2p, sg->np2p, sizeof(p), 16);
    if (rc) {
        pthread_mutex_unlock(&sg->mu);
        return rc;
    }
    sg->p2p[sg->np2p++] = p;
    pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
    return UCCL_OK;
}

int uccl__sg_pending_add(uccl_sg_t *sg, struct pending p)
{
    pthread_mutex_lock(&sg->mu);
    int rc = grow((void **)&sg->pend, &sg->cap_pend, sg->npend, sizeof(p), 16);
    if (rc) {
        pthread_mutex_unlock(&sg->mu);
        return rc;
    }
    sg->pend[sg->npend++] = p;
    if (sg->npend == 1)
        pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
    return UCCL_OK;
}

/* ---- the group's queries and events ------------------------------------------------ */
int uccl_sg_rank(uccl_sg_t *sg) { return sg->rank; }
int uccl_sg_size(uccl_sg_t *sg) { return sg->size; }

int uccl_sg_passed(uccl_sg_t *sg, uint32_t k)
{
    return ahead(ld32(w32(sg, sg->rank, OFF_FIN)), k);
}

int uccl_sg_wait_last(uccl_sg_t *sg, uintptr_t stream)
{
    pthread_mutex_lock(&sg->call_mu);
    int rc = UCCL_OK;
    if (stream != sg->last) {
        /* everything queued on the last round's stream so far: the round too */
        rc = sg->ops->record(sg->d, sg->ev_mark, sg->last);
        if (!rc)
            rc = sg->ops->wait_event(sg->d, stream, sg->ev_mark);
    }
    pthread_mutex_unlock(&sg->call_mu);
    return rc;
}

int uccl_sg_event_new(uccl_sg_t *sg, void **ev_p) { return sg->ops->event_new(sg->d, ev_p); }
void uccl_sg_event_free(uccl_sg_t *sg, void *ev)
{
    if (ev)
        sg->ops->event_free(sg->d, ev);
}
int uccl_sg_event_wait(uccl_sg_t *sg, uintptr_t stream, void *ev)
{
    return sg->ops->wait_event(sg->d, stream, ev);
}
int uccl_sg_event_query(uccl_sg_t *sg, void *ev) { return sg->ops->query(sg->d, ev); }

void uccl__sg_reclaim(uccl_sg_t *sg)
{
    pthread_mutex_lock(&sg->mu);
    uccl__sg_reclaim_locked(sg);
    pthread_mutex_unlock(&sg->mu);
}

/* ---- what the peers published in this round (read_peers, sg_round.c) ---- */

/* The entry rank r (a peer) published under tag in this round, or NULL. */
const struct entry *uccl__sg_peer_entry(uccl_sg_t *sg, int r, uint64_t tag)
{
    const struct entry *e = sg->peer_ent + (size_t)r * MAX_ENTRIES;
    for (uint32_t i = 0; i < sg->peer_cnt[r]; i++)
        if (e[i].tag == tag)
            return &e[i];
    return NULL;
}

/* What rank r published under tag, checked for a read of [off, +len) (of
 * exactly len bytes where exact), in *e_p. */
int uccl__sg_find_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                        size_t len, int exact, const struct entry **e_p)
{
    const struct entry *e = uccl__sg_peer_entry(sg, r, tag);
    if (!e)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published nothing for rank %d to read "
                         "%zu bytes from (tag %#llx): the ranks' calls disagree", what, r,
                         sg->rank, len, (unsigned long long)tag);
    if (e->addr + e->len < e->addr)
        return uccl__err(UCCL_ERR_PROTO, "%s: rank %d published [%#llx, +%llu), which wraps "
                         "round the address space", what, r, (unsigned long long)e->addr,
                         (unsigned long long)e->len);
    if (exact && e->len != len)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d sends %llu bytes where rank %d "
                         "receives %zu", what, r, (unsigned long long)e->len, sg->rank, len);
    if (off > e->len || len > e->len - off)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published %llu bytes; rank %d reads "
                         "[%llu, +%zu): the ranks' calls disagree", what, r,
                         (unsigned long long)e->len, sg->rank, (unsigned long long)off, len);
    *e_p = e;
    return UCCL_OK;
}

/* Map [off, +len) of what rank r published under tag into *ptr_p. */
int uccl__sg_map_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                       size_t len, int exact, struct pending *p, uintptr_t *ptr_p)
{
    const struct entry *e = NULL;
    int rc = uccl__sg_find_range(sg, what, r, tag, off, len, exact, &e);
    if (rc)
        return rc;
    void *imp = NULL;
    rc = sg->ops->map(sg->d, r, e->key, e->addr + off, len, ptr_p, &imp);
    if (rc == UCCL_OK && imp)
        p->imp[p->nimp++] = imp;
    return rc;
}
