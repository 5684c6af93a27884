/* Stream-ordered groups: the protocol (sgroup.h).
 *
 * The page's words are each written by one side: ready/done/done2/fin by
 * the owner's stream, consumed, pid and the slots by the owner's host, the
 * header by whoever fails the group first.  Hosts read and write them with
 * acquire loads and release stores; a slot's round is stored last, so a
 * peer that sees the round sees the entries and the header. */
#define _GNU_SOURCE
#include "sgroup.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sock.h"
#include "status.h"

#define PAGE 4096
#define REASON 440                  /* header: failed flag (u32) at 0, reason at 8 */
#define RANK_BYTES (5 * 4096)
#define OFF_READY 0                 /* u32 words the streams write, a cache line each */
#define OFF_DONE 64
#define OFF_DONE2 128
#define OFF_FIN 192
#define OFF_CONSUMED 256            /* u64 words the host writes */
#define OFF_PID 264
#define OFF_SLOTS 320
#define NSLOT 4
#define SLOT_BYTES ((RANK_BYTES - OFF_SLOTS) / NSLOT)
#define ENTRY_BYTES 32
#define MAX_ENTRIES ((SLOT_BYTES - (int)sizeof(struct slot_head)) / ENTRY_BYTES)
#define RELEASE_AHEAD (1u << 30)    /* words set this far past the last round let every wait pass */
#define REG_CACHE 64
#define WATCH_NS 20000000ull        /* the watchdog's period */
#define SLOW_CHECK_NS 50000000ull   /* host waits: dead peers and interrupts this often */

enum { FLAG_OK = 0, FLAG_FAILED = 1, FLAG_WRITING = 2 };

struct slot_head {
    uint32_t count, kind;
    uint64_t round;                 /* stored last */
    uint64_t arg;
    uint32_t phases, pad;
    char what[16];
};
struct entry {
    uint64_t tag, key, addr, len;
};

struct reg {
    uintptr_t ptr;
    size_t len;
    uint64_t reg, key, used;
    uint32_t last;                  /* the last round that published it */
};
struct pending {
    uint32_t k;
    uint64_t t0;
    int nimp;
    void **imp;
};

struct uccl_sg {
    uint8_t *page;
    size_t page_len;
    int rank, size;
    uint64_t timeout_ns;
    uintptr_t stream;
    const struct uccl__sg_dev *ops;
    void *d;
    void *ev_start, *ev_end;        /* reused every round: a wait captures the event's state */
    uint32_t round;
    uint64_t clock;
    struct reg *regs;
    int nregs, cap_regs;
    struct entry *peer_ent;         /* size * MAX_ENTRIES: the peers' slots of this round */
    uint32_t *peer_cnt;
    pthread_mutex_t mu;             /* pend, failed, error, closed */
    pthread_cond_t cv;
    struct pending *pend;
    int npend, cap_pend;
    pthread_t watch;
    int watching, closed, failed;
    char error[REASON];
};

/* ---- the page ---------------------------------------------------------------- */
size_t uccl_sg_page_bytes(int size)
{
    return size > 0 ? PAGE + (size_t)size * RANK_BYTES : 0;
}

static uint8_t *part(uccl_sg_t *sg, int r) { return sg->page + PAGE + (size_t)r * RANK_BYTES; }
static uint32_t *w32(uccl_sg_t *sg, int r, int off) { return (uint32_t *)(part(sg, r) + off); }
static uint64_t *w64(uccl_sg_t *sg, int r, int off) { return (uint64_t *)(part(sg, r) + off); }
static uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static uint64_t ld64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void st32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static void st64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
/* a >= b for round numbers, as the streams compare them (cyclic, 32-bit) */
static int ahead(uint32_t a, uint32_t b) { return (uint32_t)(a - b) < 0x80000000u; }

static uint8_t *slot(uccl_sg_t *sg, int r, uint32_t k)
{
    return part(sg, r) + OFF_SLOTS + (size_t)(k % NSLOT) * SLOT_BYTES;
}

static int alive(uint64_t pid)
{
    if (pid == 0 || pid > 0x7fffffff)
        return 1; /* not written yet */
    return kill((pid_t)pid, 0) == 0 || errno != ESRCH;
}

/* ---- failure ------------------------------------------------------------------- */
/* Every rank's words far past any round (under mu).  Done again while the
 * group stays failed: a live rank's stream may still write the rounds it
 * had queued, lowering a word another stream waits on. */
static void release_words(uccl_sg_t *sg)
{
    uint32_t far = sg->round + RELEASE_AHEAD;
    for (int r = 0; r < sg->size; r++) {
        st32(w32(sg, r, OFF_READY), far);
        st32(w32(sg, r, OFF_DONE), far);
        st32(w32(sg, r, OFF_DONE2), far);
        st32(w32(sg, r, OFF_FIN), far);
    }
}

/* Under mu: has the group failed (here, or at a rank that wrote the page)? */
static int failed_locked(uccl_sg_t *sg)
{
    if (sg->failed)
        return 1;
    uint32_t *flag = (uint32_t *)sg->page;
    uint32_t f = ld32(flag);
    if (f == FLAG_OK)
        return 0;
    sg->failed = 1;
    if (f == FLAG_FAILED) {
        memcpy(sg->error, sg->page + 8, REASON - 1);
        sg->error[REASON - 1] = '\0';
    }
    if (!sg->error[0])
        snprintf(sg->error, sizeof(sg->error), "another rank failed the group");
    release_words(sg);
    pthread_cond_broadcast(&sg->cv);
    return 1;
}

static void fail_locked(uccl_sg_t *sg, const char *why)
{
    if (!failed_locked(sg)) {
        sg->failed = 1;
        snprintf(sg->error, sizeof(sg->error), "%s", why);
        uint32_t *flag = (uint32_t *)sg->page, zero = FLAG_OK;
        if (__atomic_compare_exchange_n(flag, &zero, FLAG_WRITING, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            memcpy(sg->page + 8, sg->error, REASON);
            st32(flag, FLAG_FAILED);
        }
    }
    release_words(sg);
    pthread_cond_broadcast(&sg->cv);
}

void uccl_sg_fail(uccl_sg_t *sg, const char *why)
{
    pthread_mutex_lock(&sg->mu);
    fail_locked(sg, why && *why ? why : "failed by the caller");
    pthread_mutex_unlock(&sg->mu);
}

const char *uccl_sg_error(uccl_sg_t *sg)
{
    if (sg->failed)
        return sg->error;
    if (ld32((uint32_t *)sg->page) == FLAG_OK)
        return NULL;
    pthread_mutex_lock(&sg->mu);
    failed_locked(sg);
    pthread_mutex_unlock(&sg->mu);
    return sg->error;
}

/* Fail the group with the message recorded on this thread; the status as it was. */
static int fail_rc(uccl_sg_t *sg, int rc)
{
    char why[REASON];
    snprintf(why, sizeof(why), "%s", uccl_last_error());
    uccl_sg_fail(sg, why);
    return uccl__err(rc, "%s", why);
}

static int failed_err(uccl_sg_t *sg, const char *what)
{
    return uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: the group failed: %s",
                     sg->rank, what, uccl_sg_error(sg));
}

/* ---- waiting for peers on the host ------------------------------------------------ */
typedef int (*ready_fn)(uccl_sg_t *sg, uint32_t k, int r);

static int consumed_ready(uccl_sg_t *sg, uint32_t k, int r)
{
    for (int p = 0; p < sg->size; p++)
        if (p != sg->rank && !ahead((uint32_t)ld64(w64(sg, p, OFF_CONSUMED)), k - NSLOT))
            return 0;
    (void)r;
    return 1;
}

static int arrived(uccl_sg_t *sg, uint32_t k, int r)
{
    const struct slot_head *h = (const struct slot_head *)slot(sg, r, k);
    return ld64(&h->round) == k;
}

/* Spin, then yield, then sleep, until ready(); past the deadline, with a
 * peer process gone, or on an interrupt: fail the group. */
static int host_wait(uccl_sg_t *sg, ready_fn ready, uint32_t k, int r, const char *what,
                     const char *waiting, uint64_t deadline, uccl_sg_interrupt_fn intr,
                     void *intr_arg)
{
    uint64_t slow = 0;
    for (unsigned long spins = 0;; spins++) {
        if (ready(sg, k, r))
            return UCCL_OK;
        if (spins < 64) {
            __asm__ __volatile__("" ::: "memory");
            continue;
        }
        if (uccl_sg_error(sg))
            return failed_err(sg, what);
        uint64_t now = uccl__now_ns();
        if (now >= slow) {
            slow = now + SLOW_CHECK_NS;
            for (int p = 0; p < sg->size; p++)
                if (p != sg->rank && !alive(ld64(w64(sg, p, OFF_PID)))) {
                    uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: %s: rank %d "
                              "exited", sg->rank, what, waiting, p);
                    return fail_rc(sg, UCCL_ERR_IO);
                }
            if (intr && intr(intr_arg)) {
                uccl__err(UCCL_ERR_IO, "stream-ordered group (rank %d), %s: interrupted while "
                          "%s", sg->rank, what, waiting);
                return fail_rc(sg, UCCL_ERR_IO);
            }
        }
        if (now > deadline) {
            uccl__err(UCCL_ERR_TIMEOUT, "stream-ordered group (rank %d), %s: %s: not within the "
                      "group's timeout (%.3g s)", sg->rank, what, waiting,
                      (double)sg->timeout_ns / 1e9);
            return fail_rc(sg, UCCL_ERR_TIMEOUT);
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

/* Past REG_CACHE: drop the least recently used registrations every peer has
 * read the keys of (none is still to map one). */
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
            if (ahead(read, sg->regs[i].last) &&
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
static int reg_key(uccl_sg_t *sg, uintptr_t ptr, size_t len, uint32_t k, uint64_t *key_p)
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
            e->last = k;
            e->used = ++sg->clock;
            *key_p = e->key;
            return UCCL_OK;
        }
        reg_drop(sg, i);
        break;
    }
    if (sg->nregs == sg->cap_regs) {
        int cap = sg->cap_regs ? 2 * sg->cap_regs : REG_CACHE + 8;
        struct reg *n = realloc(sg->regs, (size_t)cap * sizeof(*n));
        if (!n)
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        sg->regs = n;
        sg->cap_regs = cap;
    }
    uint64_t reg = 0, key = 0;
    int rc = sg->ops->reg(sg->d, ptr, len, &reg);
    if (rc)
        return rc;
    if ((rc = sg->ops->key(sg->d, reg, ptr, len, &key))) {
        sg->ops->dereg(sg->d, reg);
        return rc;
    }
    sg->regs[sg->nregs++] = (struct reg){ptr, len, reg, key, ++sg->clock, k};
    *key_p = key;
    reg_evict(sg);
    return UCCL_OK;
}

/* ---- rounds behind the stream ------------------------------------------------------- */
static void pending_free(uccl_sg_t *sg, struct pending *p)
{
    for (int i = 0; i < p->nimp; i++)
        sg->ops->unmap(sg->d, p->imp[i]);
    free(p->imp);
}

/* Under mu: release the peers' memory that rounds behind this rank's stream
 * mapped (its fin word passed them).  Not once the group failed: fin may
 * then be the release's value, with copies still queued. */
static void reclaim_locked(uccl_sg_t *sg)
{
    uint32_t fin = ld32(w32(sg, sg->rank, OFF_FIN));
    if (failed_locked(sg))
        return;
    int done = 0;
    while (done < sg->npend && ahead(fin, sg->pend[done].k))
        pending_free(sg, &sg->pend[done++]);
    if (done) {
        memmove(sg->pend, sg->pend + done, (size_t)(sg->npend - done) * sizeof(*sg->pend));
        sg->npend -= done;
    }
}

static int pending_add(uccl_sg_t *sg, struct pending p)
{
    pthread_mutex_lock(&sg->mu);
    if (sg->npend == sg->cap_pend) {
        int cap = sg->cap_pend ? 2 * sg->cap_pend : 16;
        struct pending *n = realloc(sg->pend, (size_t)cap * sizeof(*n));
        if (!n) {
            pthread_mutex_unlock(&sg->mu);
            return uccl__err(UCCL_ERR_NOMEM, "out of memory");
        }
        sg->pend = n;
        sg->cap_pend = cap;
    }
    sg->pend[sg->npend++] = p;
    if (sg->npend == 1)
        pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
    return UCCL_OK;
}

/* While rounds are pending: release what rounds behind the stream held;
 * fail the group if the oldest has not passed this rank's stream within
 * the timeout, or a peer process is gone; once the group failed (here or
 * at another rank), keep every stream released. */
static void *watch_main(void *arg)
{
    uccl_sg_t *sg = arg;
    pthread_mutex_lock(&sg->mu);
    while (!sg->closed) {
        if (sg->npend == 0 && !failed_locked(sg)) {
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
        if (failed_locked(sg)) {
            release_words(sg);
            if (sg->npend == 0)
                pthread_cond_wait(&sg->cv, &sg->mu); /* until a round or close */
            continue;
        }
        reclaim_locked(sg);
        if (sg->npend == 0)
            continue;
        const struct pending *old = &sg->pend[0];
        int gone = -1;
        for (int p = 0; p < sg->size && gone < 0; p++)
            if (p != sg->rank && !alive(ld64(w64(sg, p, OFF_PID))))
                gone = p;
        if (gone < 0 && uccl__now_ns() - old->t0 <= sg->timeout_ns)
            continue;
        char why[REASON], words[256] = "";
        size_t at_w = 0;
        for (int p = 0; p < sg->size && at_w < sizeof(words) - 32; p++)
            at_w += (size_t)snprintf(words + at_w, sizeof(words) - at_w, "%s%d: %u/%u",
                                     p ? ", " : "", p, ld32(w32(sg, p, OFF_READY)),
                                     ld32(w32(sg, p, OFF_DONE)));
        if (gone >= 0)
            snprintf(why, sizeof(why), "rank %d exited with round %u queued (ready/done words "
                     "by rank: %s)", gone, old->k, words);
        else
            snprintf(why, sizeof(why), "round %u not through rank %d's stream within %.3g s "
                     "(ready/done words by rank: %s)", old->k, sg->rank,
                     (double)sg->timeout_ns / 1e9, words);
        fail_locked(sg, why);
    }
    pthread_mutex_unlock(&sg->mu);
    return NULL;
}

/* ---- the group ------------------------------------------------------------------------ */
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
    sg->stream = stream;
    sg->ops = ops;
    sg->d = d;
    pthread_mutex_init(&sg->mu, NULL);
    pthread_cond_init(&sg->cv, NULL);
    sg->peer_ent = calloc((size_t)size * MAX_ENTRIES, sizeof(struct entry));
    sg->peer_cnt = calloc((size_t)size, sizeof(uint32_t));
    if (!sg->peer_ent || !sg->peer_cnt)
        rc = uccl__err(UCCL_ERR_NOMEM, "out of memory");
    if (!rc)
        rc = ops->event_new(d, &sg->ev_start);
    if (!rc)
        rc = ops->event_new(d, &sg->ev_end);
    if (!rc && pthread_create(&sg->watch, NULL, watch_main, sg) != 0)
        rc = uccl__err(UCCL_ERR_NOMEM, "stream-ordered group: no watchdog thread: %s",
                       strerror(errno));
    if (rc) {
        if (sg->ev_start)
            ops->event_free(d, sg->ev_start);
        if (sg->ev_end)
            ops->event_free(d, sg->ev_end);
        ops->destroy(d);
        free(sg->peer_ent);
        free(sg->peer_cnt);
        pthread_mutex_destroy(&sg->mu);
        pthread_cond_destroy(&sg->cv);
        free(sg);
        return rc;
    }
    sg->watching = 1;
    st64(w64(sg, rank, OFF_PID), (uint64_t)getpid());
    *sg_p = sg;
    return UCCL_OK;
}

int uccl_sg_rank(uccl_sg_t *sg) { return sg->rank; }
int uccl_sg_size(uccl_sg_t *sg) { return sg->size; }

int uccl_sg_passed(uccl_sg_t *sg, uint32_t k)
{
    return ahead(ld32(w32(sg, sg->rank, OFF_FIN)), k);
}

int uccl_sg_wait_last(uccl_sg_t *sg, uintptr_t stream)
{
    if (stream == sg->stream)
        return UCCL_OK;
    return sg->ops->wait_event(sg->d, stream, sg->ev_end);
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

/* ---- one round -------------------------------------------------------------------------- */
static int check_call(uccl_sg_t *sg, const struct uccl_sg_call *c)
{
    const char *what = c->what ? c->what : "exchange";
    if (c->phases < 1 || c->phases > 2 || c->npub < 0 || c->npull < 0 || c->ncopy < 0)
        return uccl__err(UCCL_ERR_INVALID, "%s: %d phases, %d publications, %d pulls, %d copies",
                         what, c->phases, c->npub, c->npull, c->ncopy);
    if (c->npub > MAX_ENTRIES)
        return uccl__err(UCCL_ERR_INVALID, "%s: %d buffers in one round (at most %d)", what,
                         c->npub, MAX_ENTRIES);
    for (int i = 0; i < c->npull; i++) {
        const struct uccl_sg_pull *p = &c->pull[i];
        if (p->peer < 0 || p->peer >= sg->size || p->peer == sg->rank || p->phase < 1 ||
            p->phase > c->phases || p->off + p->len < p->off)
            return uccl__err(UCCL_ERR_INVALID, "%s: pull %d from rank %d (phase %d, offset "
                             "%llu, %zu bytes) in a group of %d (this rank %d, %d phases)", what,
                             i, p->peer, p->phase, (unsigned long long)p->off, p->len, sg->size,
                             sg->rank, c->phases);
    }
    if (c->red) {
        size_t esz = uccl_dtype_size(c->red->dtype);
        if (!esz || c->red->op < 0 || c->red->op >= UCCL_RED_COUNT ||
            c->red->count > SIZE_MAX / esz || c->red->off + c->red->count * esz < c->red->off)
            return uccl__err(UCCL_ERR_INVALID, "%s: reduction of type %d, operator %d, %zu "
                             "elements", what, c->red->dtype, c->red->op, c->red->count);
    }
    return UCCL_OK;
}

/* The entry rank r published under tag in this round (r may be this rank:
 * then from the call's own list), or NULL. */
static const struct entry *peer_entry(uccl_sg_t *sg, int r, uint64_t tag)
{
    const struct entry *e = sg->peer_ent + (size_t)r * MAX_ENTRIES;
    for (uint32_t i = 0; i < sg->peer_cnt[r]; i++)
        if (e[i].tag == tag)
            return &e[i];
    return NULL;
}

static const struct uccl_sg_pub *own_entry(const struct uccl_sg_call *c, uint64_t tag)
{
    for (int i = 0; i < c->npub; i++)
        if (c->pub[i].tag == tag && c->pub[i].len)
            return &c->pub[i];
    return NULL;
}

/* Map [off, +len) of what rank r published under tag into *ptr_p. */
static int map_range(uccl_sg_t *sg, const char *what, int r, uint64_t tag, uint64_t off,
                     size_t len, int exact, struct pending *p, uintptr_t *ptr_p)
{
    const struct entry *e = peer_entry(sg, r, tag);
    if (!e)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published nothing for rank %d to read "
                         "%zu bytes from (tag %#llx): the ranks' calls disagree", what, r,
                         sg->rank, len, (unsigned long long)tag);
    if (exact && e->len != len)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d sends %llu bytes where rank %d "
                         "receives %zu", what, r, (unsigned long long)e->len, sg->rank, len);
    if (off > e->len || len > e->len - off)
        return uccl__err(UCCL_ERR_MISMATCH, "%s: rank %d published %llu bytes; rank %d reads "
                         "[%llu, +%zu): the ranks' calls disagree", what, r,
                         (unsigned long long)e->len, sg->rank, (unsigned long long)off, len);
    void *imp = NULL;
    int rc = sg->ops->map(sg->d, r, e->key, e->addr + off, len, ptr_p, &imp);
    if (rc == UCCL_OK && imp)
        p->imp[p->nimp++] = imp;
    return rc;
}

/* Read every peer's slot of round k (waiting for them to arrive) and
 * compare their calls with this one. */
static int read_peers(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                      uint64_t deadline, uccl_sg_interrupt_fn intr, void *intr_arg)
{
    for (int r = 0; r < sg->size; r++) {
        if (r == sg->rank)
            continue;
        char waiting[64];
        snprintf(waiting, sizeof(waiting), "rank %d arriving at round %u", r, k);
        int rc = host_wait(sg, arrived, k, r, what, waiting, deadline, intr, intr_arg);
        if (rc)
            return rc;
        const struct slot_head *h = (const struct slot_head *)slot(sg, r, k);
        char theirs[17];
        memcpy(theirs, h->what, 16);
        theirs[16] = '\0';
        if (h->kind != c->kind || h->arg != c->arg || (int)h->phases != c->phases)
            return uccl__err(UCCL_ERR_MISMATCH, "%s: the ranks' calls disagree: rank %d is in "
                             "%s (kind %#x, argument %llu), rank %d in %s (kind %#x, argument "
                             "%llu)", what, r, theirs, h->kind, (unsigned long long)h->arg,
                             sg->rank, what, c->kind, (unsigned long long)c->arg);
        if (h->count > (uint32_t)MAX_ENTRIES)
            return uccl__err(UCCL_ERR_PROTO, "%s: rank %d published %u buffers (at most %d)",
                             what, r, h->count, MAX_ENTRIES);
        sg->peer_cnt[r] = h->count;
        memcpy(sg->peer_ent + (size_t)r * MAX_ENTRIES, (const uint8_t *)h + sizeof(*h),
               (size_t)h->count * ENTRY_BYTES);
    }
    /* every peer's buffers this round are read: their slots may be reused */
    st64(w64(sg, sg->rank, OFF_CONSUMED), k);
    return UCCL_OK;
}

static void memop(struct uccl__sg_memop *ops, int *n, uint32_t *addr, uint32_t v, int wait)
{
    ops[(*n)++] = (struct uccl__sg_memop){addr, v, wait};
}

/* Everything after the slots were read: map, then queue the phases. */
static int queue_round(uccl_sg_t *sg, const struct uccl_sg_call *c, const char *what, uint32_t k,
                       struct pending *p, struct uccl__sg_memop *ops)
{
    const struct uccl__sg_dev *dv = sg->ops;
    int n = sg->size, me = sg->rank, nops = 0, rc = UCCL_OK;
    uintptr_t *src = calloc((size_t)c->npull + 1, sizeof(*src));
    struct uccl__sg_red_args ra;
    memset(&ra, 0, sizeof(ra));
    unsigned char reads[UCCL_SG_MAX_RANKS] = {0};
    if (!src)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    for (int i = 0; i < c->npull && !rc; i++) {
        const struct uccl_sg_pull *q = &c->pull[i];
        if (q->len == 0)
            continue;
        rc = map_range(sg, what, q->peer, q->tag, q->off, q->len, q->exact, p, &src[i]);
        if (q->phase == 1)
            reads[q->peer] = 1;
    }
    const struct uccl_sg_red *red = c->red;
    if (!rc && red && red->count) {
        size_t nb = red->count * uccl_dtype_size(red->dtype);
        ra = (struct uccl__sg_red_args){red->dtype, red->op, n, red->out, {0}, red->count};
        for (int r = 0; r < n && !rc; r++) {
            if (r == me) {
                const struct uccl_sg_pub *o = own_entry(c, red->tag);
                if (!o || red->off > o->len || nb > o->len - red->off)
                    rc = uccl__err(UCCL_ERR_INVALID, "%s: the reduction reads [%llu, +%zu) of "
                                   "this rank's buffer (tag %#llx), which is %zu bytes", what,
                                   (unsigned long long)red->off, nb,
                                   (unsigned long long)red->tag, o ? o->len : 0);
                else
                    ra.src[r] = o->ptr + red->off;
            } else {
                rc = map_range(sg, what, r, red->tag, red->off, nb, 0, p, &ra.src[r]);
                reads[r] = 1;
            }
        }
    }
    if (rc) {
        free(src);
        return rc;
    }
    for (int r = 0; r < n; r++)
        if (reads[r])
            memop(ops, &nops, w32(sg, r, OFF_READY), k, 1);
    if (nops)
        rc = dv->memops(sg->d, sg->stream, ops, nops);
    for (int i = 0; i < c->npull && !rc; i++)
        if (c->pull[i].len && c->pull[i].phase == 1)
            rc = dv->copy(sg->d, sg->stream, c->pull[i].dst, src[i], c->pull[i].len);
    for (int i = 0; i < c->ncopy && !rc; i++)
        if (c->copy[i].len && c->copy[i].dst != c->copy[i].src)
            rc = dv->copy(sg->d, sg->stream, c->copy[i].dst, c->copy[i].src, c->copy[i].len);
    if (!rc && red && red->count)
        rc = dv->reduce(sg->d, sg->stream, &ra);
    nops = 0;
    memop(ops, &nops, w32(sg, me, OFF_DONE), k, 0);
    for (int r = 0; r < n; r++)
        if (r != me)
            memop(ops, &nops, w32(sg, r, OFF_DONE), k, 1);
    if (c->phases == 2) {
        if (!rc)
            rc = dv->memops(sg->d, sg->stream, ops, nops);
        for (int i = 0; i < c->npull && !rc; i++)
            if (c->pull[i].len && c->pull[i].phase == 2)
                rc = dv->copy(sg->d, sg->stream, c->pull[i].dst, src[i], c->pull[i].len);
        nops = 0;
        memop(ops, &nops, w32(sg, me, OFF_DONE2), k, 0);
        for (int r = 0; r < n; r++)
            if (r != me)
                memop(ops, &nops, w32(sg, r, OFF_DONE2), k, 1);
    }
    memop(ops, &nops, w32(sg, me, OFF_FIN), k, 0);
    if (!rc)
        rc = dv->memops(sg->d, sg->stream, ops, nops);
    free(src);
    /* the group's end event, recorded every round: a stream that waits for
     * it later waits for the last round queued so far (uccl_sg_wait_last) */
    if (!rc)
        rc = dv->record(sg->d, sg->ev_end, sg->stream);
    if (!rc && c->caller_waits && c->caller != sg->stream)
        rc = dv->wait_event(sg->d, c->caller, sg->ev_end);
    if (!rc && c->end_event)
        rc = dv->record(sg->d, c->end_event, sg->stream);
    return rc;
}

int uccl_sg_round(uccl_sg_t *sg, const struct uccl_sg_call *c, uccl_sg_interrupt_fn intr,
                  void *intr_arg, uint32_t *round_p)
{
    const char *what = c->what ? c->what : "exchange";
    if (uccl_sg_error(sg))
        return failed_err(sg, what);
    int rc = check_call(sg, c);
    if (rc)
        return rc;
    uint32_t k = sg->round + 1;
    if (k == 0)
        k = 1;
    pthread_mutex_lock(&sg->mu);
    reclaim_locked(sg);
    pthread_mutex_unlock(&sg->mu);
    uint64_t deadline = uccl__now_ns() + sg->timeout_ns;
    char waiting[64];
    snprintf(waiting, sizeof(waiting), "peers reading round %u", k - NSLOT);
    /* the slot of round k was last used by round k - NSLOT: every peer has read it */
    if ((rc = host_wait(sg, consumed_ready, k, -1, what, waiting, deadline, intr, intr_arg)))
        return rc;
    struct entry ent[MAX_ENTRIES];
    int nent = 0;
    for (int i = 0; i < c->npub && !rc; i++) {
        if (c->pub[i].len == 0)
            continue;
        ent[nent] = (struct entry){c->pub[i].tag, 0, c->pub[i].ptr, c->pub[i].len};
        rc = reg_key(sg, c->pub[i].ptr, c->pub[i].len, k, &ent[nent].key);
        nent++;
    }
    if (rc)
        return fail_rc(sg, rc);
    sg->round = k;
    struct pending p = {k, uccl__now_ns(), 0, calloc((size_t)c->npull + (size_t)sg->size + 1,
                                                     sizeof(void *))};
    struct uccl__sg_memop *ops = calloc(2 * (size_t)sg->size + 2, sizeof(*ops));
    if (!p.imp || !ops) {
        free(p.imp);
        free(ops);
        uccl__err(UCCL_ERR_NOMEM, "out of memory");
        return fail_rc(sg, UCCL_ERR_NOMEM);
    }
    /* on the group's stream: after the caller's work, then ready = k */
    if (c->caller != sg->stream) {
        rc = sg->ops->record(sg->d, sg->ev_start, c->caller);
        if (!rc)
            rc = sg->ops->wait_event(sg->d, sg->stream, sg->ev_start);
    }
    ops[0] = (struct uccl__sg_memop){w32(sg, sg->rank, OFF_READY), k, 0};
    if (!rc)
        rc = sg->ops->memops(sg->d, sg->stream, ops, 1);
    if (!rc) { /* publish: entries and header, the round alone and last */
        uint8_t *s = slot(sg, sg->rank, k);
        struct slot_head *h = (struct slot_head *)s;
        memcpy(s + sizeof(*h), ent, (size_t)nent * ENTRY_BYTES);
        h->count = (uint32_t)nent;
        h->kind = c->kind;
        h->arg = c->arg;
        h->phases = (uint32_t)c->phases;
        memset(h->what, 0, sizeof(h->what));
        strncpy(h->what, what, sizeof(h->what));
        st64(&h->round, k);
        rc = read_peers(sg, c, what, k, deadline, intr, intr_arg);
    }
    if (!rc)
        rc = queue_round(sg, c, what, k, &p, ops);
    free(ops);
    int arc = pending_add(sg, p); /* even when failed: queued copies may read through them */
    if (arc) {
        pending_free(sg, &p);
        rc = rc ? rc : arc;
    }
    if (rc) {
        if (!uccl_sg_error(sg))
            return fail_rc(sg, rc);
        return rc;
    }
    *round_p = k;
    return UCCL_OK;
}

int uccl_sg_close(uccl_sg_t *sg)
{
    if (!sg)
        return 1;
    pthread_mutex_lock(&sg->mu);
    sg->closed = 1;
    pthread_cond_broadcast(&sg->cv);
    pthread_mutex_unlock(&sg->mu);
    if (sg->watching)
        pthread_join(sg->watch, NULL);
    /* the copies of rounds still queued read through their mappings: wait
     * (on the host, bounded) until this rank's stream is past them */
    uint64_t until = uccl__now_ns() + sg->timeout_ns;
    pthread_mutex_lock(&sg->mu);
    while (sg->npend && !failed_locked(sg)) {
        reclaim_locked(sg);
        if (!sg->npend)
            break;
        if (uccl__now_ns() > until) {
            fail_locked(sg, "closed with rounds still queued that did not finish");
            break;
        }
        pthread_mutex_unlock(&sg->mu);
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&sg->mu);
    }
    int ok = !failed_locked(sg) || sg->npend == 0;
    pthread_mutex_unlock(&sg->mu);
    while (sg->nregs)
        reg_drop(sg, sg->nregs - 1);
    if (ok) {
        for (int i = 0; i < sg->npend; i++)
            pending_free(sg, &sg->pend[i]);
    } /* else the mappings stay: the stream may still copy through them */
    free(sg->pend);
    free(sg->regs);
    free(sg->peer_ent);
    free(sg->peer_cnt);
    sg->ops->event_free(sg->d, sg->ev_start);
    sg->ops->event_free(sg->d, sg->ev_end);
    sg->ops->destroy(sg->d);
    pthread_mutex_destroy(&sg->mu);
    pthread_cond_destroy(&sg->cv);
    free(sg);
    return ok;
}
