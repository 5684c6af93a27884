/* The emulated device of stream-ordered groups, for tests on machines
 * without a GPU (sg_dev.h): each "stream" is a thread that runs what is
 * queued on it in order (writes and waits of the page's words, copies,
 * reductions, events), and every rank is a thread of one process, so a
 * key is the address itself.  The protocol (sgroup.c, sg_call.c) is the
 * one that runs on the GPU; only the driver calls are replaced.  No access
 * checks here: those are CUDA IPC's (ipc_share.c), tested on the GPU.
 *
 * The reduction follows the kernel's arithmetic (sg_cuda.c): 16-bit floats
 * accumulate in float, integers in 64 bits (wrapping), one rounding at the
 * end, AVG as the sum rounded to the type and then divided. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sgdev/sg_dev.h"
#include "base/status.h"

#define STUCK_NS 30000000000ull /* a wait longer than this is reported and passed */

enum { E_WRITE, E_WAIT, E_COPY, E_REDUCE, E_RECORD, E_WAITEV, E_BUMP, E_FUSED };

struct emu_event {
    uint64_t recorded; /* generations: of the last record queued, of the last one run */
    uint64_t done;
    /* its last record was queued while this stream captured into this
     * graph (compared, never followed: a stream that waits for it then
     * joins that capture, as a CUDA stream does); NULL: not in a capture */
    struct emu_stream *cap_stream;
    struct emu_graph *cap_graph;
};

struct emu_op {
    int kind;
    uint32_t *addr;
    uint32_t value;
    uint32_t *epoch; /* a write's or wait's value counts from *epoch (sg_dev.h) */
    uintptr_t dst, src;
    size_t len;
    struct emu_event *ev;
    uint64_t gen;
    struct uccl__sg_red_args red;
    struct uccl__sg_fused_args fz;
    struct emu_stream *from; /* in a graph: the stream that queued it */
    struct emu_op *next;
};

/* An emulated CUDA graph: the ops queued while a stream captured (the
 * origin) and the streams that joined its capture (by waiting for an event
 * it recorded), in order.  A launch queues the origin's ops on the launch
 * stream and a joined stream's on that stream, the events between them
 * recorded and waited for anew. */
#define EMU_JOINED 16
struct emu_graph {
    struct emu_op *head, *tail;
    struct emu_stream *origin, *joined[EMU_JOINED];
    int njoined;
};

struct emu_stream {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct emu_op *head, *tail;
    int busy, stop, stuck;
    struct emu_graph *capture; /* recording instead of running, or NULL */
};

/* ---- 16-bit floats ------------------------------------------------------------ */
static float h2f(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    if (e == 0 && m == 0) {
        f = s;
    } else if (e == 0) { /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        f = s | (e << 23) | ((m & 0x3ffu) << 13);
    } else if (e == 31) {
        f = s | 0x7f800000u | (m << 13);
    } else {
        f = s | ((e + 112) << 23) | (m << 13);
    }
    float x;
    memcpy(&x, &f, 4);
    return x;
}

static uint16_t f2h(float x) /* round to nearest even */
{
    uint32_t f;
    memcpy(&f, &x, 4);
    uint32_t sign = f & 0x80000000u;
    f ^= sign;
    uint16_t o;
    if (f >= 0x47800000u) {
        o = f > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (f < 0x38800000u) { /* a subnormal half: the FPU rounds at the right bit */
        uint32_t magic = 126u << 23;
        float fx, mx;
        memcpy(&fx, &f, 4);
        memcpy(&mx, &magic, 4);
        fx += mx;
        uint32_t r;
        memcpy(&r, &fx, 4);
        o = (uint16_t)(r - magic);
    } else {
        uint32_t odd = (f >> 13) & 1u;
        f += 0xc8000000u + 0xfffu + odd;
        o = (uint16_t)(f >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static float b2f(uint16_t b)
{
    uint32_t f = (uint32_t)b << 16;
    float x;
    memcpy(&x, &f, 4);
    return x;
}

static uint16_t f2b(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- the reduction ---------------------------------------------------------------- */
static double fop(int op, double a, double x)
{
    switch (op) {
    case UCCL_RED_PROD: return a * x;
    case UCCL_RED_MIN: return isnan(a) ? a : isnan(x) ? x : x < a ? x : a;
    case UCCL_RED_MAX: return isnan(a) ? a : isnan(x) ? x : x > a ? x : a;
    default: return a + x; /* SUM, AVG */
    }
}

static int64_t iop(int op, int64_t a, int64_t x)
{
    switch (op) {
    case UCCL_RED_PROD: return (int64_t)((uint64_t)a * (uint64_t)x);
    case UCCL_RED_MIN: return x < a ? x : a;
    case UCCL_RED_MAX: return x > a ? x : a;
    case UCCL_RED_BAND: return a & x;
    case UCCL_RED_BOR: return a | x;
    case UCCL_RED_BXOR: return a ^ x;
    default: return (int64_t)((uint64_t)a + (uint64_t)x);
    }
}

static int bop(int op, int a, int x)
{
    switch (op) {
    case UCCL_RED_PROD: case UCCL_RED_MIN: case UCCL_RED_BAND: return a & x;
    case UCCL_RED_BXOR: return a ^ x;
    default: return a | x;
    }
}

/* float and double in their own precision (the kernel's float arithmetic) */
#define FLOAT_LOOP(T, A, LD, ST)                                                   \
    for (size_t i = 0; i < a->count; i++) {                                        \
        A acc = LD(((const T *)a->src[0])[i]);                                     \
        for (int r = 1; r < a->nsrc; r++)                                          \
            acc = (A)fop(a->op, acc, LD(((const T *)a->src[r])[i]));               \
        if (a->op == UCCL_RED_AVG)                                                 \
            acc = LD(ST(acc)) / (A)a->nsrc;                                        \
        ((T *)a->out)[i] = ST(acc);                                                \
    }
#define INT_LOOP(T)                                                                \
    for (size_t i = 0; i < a->count; i++) {                                        \
        int64_t acc = ((const T *)a->src[0])[i];                                   \
        for (int r = 1; r < a->nsrc; r++)                                          \
            acc = iop(a->op, acc, ((const T *)a->src[r])[i]);                      \
        if (a->op == UCCL_RED_AVG)                                                 \
            acc = (int64_t)(T)acc / a->nsrc;                                       \
        ((T *)a->out)[i] = (T)acc;                                                 \
    }
#define SAME(x) (x)

static void reduce_cpu(const struct uccl__sg_red_args *a)
{
    switch (a->dtype) {
    case UCCL_DT_F32: FLOAT_LOOP(float, float, SAME, SAME) break;
    case UCCL_DT_F64: FLOAT_LOOP(double, double, SAME, SAME) break;
    case UCCL_DT_F16: FLOAT_LOOP(uint16_t, float, h2f, f2h) break;
    case UCCL_DT_BF16: FLOAT_LOOP(uint16_t, float, b2f, f2b) break;
    case UCCL_DT_I8: INT_LOOP(int8_t) break;
    case UCCL_DT_U8: INT_LOOP(uint8_t) break;
    case UCCL_DT_I16: INT_LOOP(int16_t) break;
    case UCCL_DT_I32: INT_LOOP(int32_t) break;
    case UCCL_DT_I64: INT_LOOP(int64_t) break;
    case UCCL_DT_BOOL:
        for (size_t i = 0; i < a->count; i++) {
            int acc = ((const uint8_t *)a->src[0])[i] != 0;
            for (int r = 1; r < a->nsrc; r++)
                acc = bop(a->op, acc, ((const uint8_t *)a->src[r])[i] != 0);
            ((uint8_t *)a->out)[i] = (uint8_t)acc;
        }
        break;
    }
}

/* ---- streams ----------------------------------------------------------------------- */
static int ahead(uint32_t a, uint32_t b) { return (uint32_t)(a - b) < 0x80000000u; }

/* A wait that a word this far ahead let pass read a stale word (one left
 * over 2^31 behind reads as ahead); a failed group's released words are
 * RELEASE_AHEAD (2^30) ahead, nearer.  Counted for the tests. */
#define STALE_AHEAD (3u << 29)
static int stale_passes;

int uccl_sg_emu_stale_passes(void) { return __atomic_load_n(&stale_passes, __ATOMIC_ACQUIRE); }

/* Until *addr reaches value (addr NULL: until ev's record gen has run),
 * the stream is stopped, the word `failed` (if not NULL) is up, or past
 * STUCK_NS (counted). */
static void wait_op(struct emu_stream *s, const uint32_t *addr, uint32_t value,
                    struct emu_event *ev, uint64_t gen, const uint32_t *failed)
{
    uint64_t until = uccl__now_ns() + STUCK_NS;
    for (;;) {
        uint32_t w = addr ? __atomic_load_n(addr, __ATOMIC_ACQUIRE) : 0;
        int ok = addr ? ahead(w, value) : __atomic_load_n(&ev->done, __ATOMIC_ACQUIRE) >= gen;
        if (ok && addr && (uint32_t)(w - value) >= STALE_AHEAD)
            __atomic_add_fetch(&stale_passes, 1, __ATOMIC_ACQ_REL);
        if (ok || __atomic_load_n(&s->stop, __ATOMIC_ACQUIRE) ||
            (failed && __atomic_load_n(failed, __ATOMIC_ACQUIRE)))
            return;
        if (uccl__now_ns() > until) {
            __atomic_add_fetch(&s->stuck, 1, __ATOMIC_ACQ_REL);
            return;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* A captured one-launch round (sg_dev.h, fused_args.epoch) as the kernel
 * runs it, on the stream's thread: numbered from the epoch, this rank's
 * input pushed into its slot of the number's parity in every rank's
 * arena, its ready word written in each, every ready word of its own
 * arena awaited, out computed from its own arena's slots, the epoch
 * written last. */
static void run_fused_ll(struct emu_stream *s, const struct uccl__sg_fused_args *a);

static void run_fused(struct emu_stream *s, const struct uccl__sg_fused_args *a)
{
    if (a->ll) {
        run_fused_ll(s, a);
        return;
    }
    uint32_t k = __atomic_load_n(a->epoch, __ATOMIC_ACQUIRE) + 1;
    size_t par = (size_t)(k & 1) * (size_t)a->nsrc * a->flip;
    for (int r = 0; r < a->nsrc; r++)
        memmove((void *)(a->slot[r] + par + (size_t)a->me * a->flip), (const void *)a->in,
                a->nbytes);
    for (int r = 0; r < a->nsrc; r++)
        __atomic_store_n((uint32_t *)a->dready[r] + a->me, k, __ATOMIC_RELEASE);
    for (int r = 0; r < a->nsrc; r++)
        wait_op(s, (const uint32_t *)a->dready[a->me] + r, k, NULL, 0, a->failed);
    uintptr_t base = a->slot[a->me] + par;
    if (a->gather) {
        for (int r = 0; r < a->nsrc; r++)
            memmove((void *)(a->out + (size_t)r * a->nbytes),
                    (const void *)(base + (size_t)r * a->flip), a->nbytes);
    } else if (a->count) {
        struct uccl__sg_red_args red = {a->dtype, a->op, a->nsrc, a->out, {0}, a->count};
        for (int r = 0; r < a->nsrc; r++)
            red.src[r] = base + (size_t)r * a->flip;
        reduce_cpu(&red);
    }
    __atomic_store_n(a->epoch, k, __ATOMIC_RELEASE);
}

/* The LL form (sg_kernels.c, uccl_sg_cll): 8 bytes of data a 16-byte
 * line {d0, k, d1, k}, the data stored before the flags (release), read
 * once both flags carry k (acquire); the input zero-padded to 16 bytes. */
static void run_fused_ll(struct emu_stream *s, const struct uccl__sg_fused_args *a)
{
    uint32_t k = __atomic_load_n(a->epoch, __ATOMIC_ACQUIRE) + 1;
    size_t par = (size_t)(k & 1) * (size_t)a->nsrc * a->flip, nw = (a->nbytes + 15) / 16 * 4;
    uint32_t *in = calloc(nw ? nw : 1, 4), *got = calloc(nw ? nw * (size_t)a->nsrc : 1, 4);
    if (!in || !got) { /* out of memory: reported as a stuck wait (the tests fail on it) */
        free(in);
        free(got);
        __atomic_add_fetch(&s->stuck, 1, __ATOMIC_ACQ_REL);
        return;
    }
    memcpy(in, (const void *)a->in, a->nbytes);
    for (int r = 0; r < a->nsrc; r++) {
        uint32_t *l = (uint32_t *)(a->slot[r] + par + (size_t)a->me * a->flip);
        for (size_t w = 0; w < nw; w += 2) {
            l[2 * w] = in[w];
            l[2 * w + 2] = in[w + 1];
            __atomic_store_n(&l[2 * w + 1], k, __ATOMIC_RELEASE);
            __atomic_store_n(&l[2 * w + 3], k, __ATOMIC_RELEASE);
        }
    }
    for (int r = 0; r < a->nsrc; r++) {
        uint32_t *l = (uint32_t *)(a->slot[a->me] + par + (size_t)r * a->flip);
        for (size_t w = 0; w < nw; w += 2) {
            wait_op(s, &l[2 * w + 1], k, NULL, 0, a->failed);
            wait_op(s, &l[2 * w + 3], k, NULL, 0, a->failed);
            /* the kernel waits for k exactly: a later number (a peer ahead
             * by a replay, which the protocol rules out) would hang there */
            uint32_t f0 = __atomic_load_n(&l[2 * w + 1], __ATOMIC_ACQUIRE),
                     f1 = __atomic_load_n(&l[2 * w + 3], __ATOMIC_ACQUIRE);
            if ((f0 != k && ahead(f0, k)) || (f1 != k && ahead(f1, k)))
                __atomic_add_fetch(&stale_passes, 1, __ATOMIC_ACQ_REL);
            got[(size_t)r * nw + w] = l[2 * w];
            got[(size_t)r * nw + w + 1] = l[2 * w + 2];
        }
    }
    if (a->gather) {
        for (int r = 0; r < a->nsrc; r++)
            memcpy((void *)(a->out + (size_t)r * a->nbytes), got + (size_t)r * nw, a->nbytes);
    } else if (a->count) {
        struct uccl__sg_red_args red = {a->dtype, a->op, a->nsrc, a->out, {0}, a->count};
        for (int r = 0; r < a->nsrc; r++)
            red.src[r] = (uintptr_t)(got + (size_t)r * nw);
        reduce_cpu(&red);
    }
    free(in);
    free(got);
    __atomic_store_n(a->epoch, k, __ATOMIC_RELEASE);
}

static void run_op(struct emu_stream *s, struct emu_op *op)
{
    uint32_t value = op->value + (op->epoch ? __atomic_load_n(op->epoch, __ATOMIC_ACQUIRE) : 0);
    switch (op->kind) {
    case E_WRITE:
        __atomic_store_n(op->addr, value, __ATOMIC_RELEASE);
        break;
    case E_BUMP: /* only this stream writes its epoch words */
        __atomic_store_n(op->addr, __atomic_load_n(op->addr, __ATOMIC_ACQUIRE) + 1,
                         __ATOMIC_RELEASE);
        break;
    case E_WAIT:
    case E_WAITEV:
        wait_op(s, op->kind == E_WAIT ? op->addr : NULL, value, op->ev, op->gen, NULL);
        break;
    case E_COPY:
        memmove((void *)op->dst, (const void *)op->src, op->len);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        break;
    case E_REDUCE:
        reduce_cpu(&op->red);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        break;
    case E_FUSED:
        run_fused(s, &op->fz);
        break;
    case E_RECORD: {
        uint64_t cur = __atomic_load_n(&op->ev->done, __ATOMIC_ACQUIRE);
        while (cur < op->gen && !__atomic_compare_exchange_n(&op->ev->done, &cur, op->gen, 0,
                                                              __ATOMIC_ACQ_REL,
                                                              __ATOMIC_ACQUIRE))
            ;
        break;
    }
    }
}

static void *stream_main(void *arg)
{
    struct emu_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop)
            break;
        struct emu_op *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        run_op(s, op);
        free(op);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void append(struct emu_op **head, struct emu_op **tail, struct emu_op *o)
{
    o->next = NULL;
    if (*tail)
        (*tail)->next = o;
    else
        *head = o;
    *tail = o;
}

/* Queue op on the stream (or, while it captures, into its graph).  An
 * event recorded in a capture counts from its graph's launch. */
static int push(uintptr_t stream, struct emu_op op)
{
    struct emu_stream *s = (struct emu_stream *)stream;
    if (!s)
        return uccl__err(UCCL_ERR_INVALID, "emulated stream 0");
    struct emu_op *o = malloc(sizeof(*o));
    if (!o)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *o = op;
    pthread_mutex_lock(&s->mu);
    if (s->capture) {
        o->from = s;
        append(&s->capture->head, &s->capture->tail, o);
    } else {
        append(&s->head, &s->tail, o);
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return UCCL_OK;
}

int uccl_sg_emu_capture_begin(uintptr_t stream)
{
    struct emu_stream *s = (struct emu_stream *)stream;
    struct emu_graph *g = calloc(1, sizeof(*g));
    if (!s || !g) {
        free(g);
        return uccl__err(s ? UCCL_ERR_NOMEM : UCCL_ERR_INVALID, "emulated capture: %s",
                         s ? "out of memory" : "stream 0");
    }
    g->origin = s;
    pthread_mutex_lock(&s->mu);
    int busy = s->capture != NULL;
    if (!busy)
        s->capture = g;
    pthread_mutex_unlock(&s->mu);
    if (busy) {
        free(g);
        return uccl__err(UCCL_ERR_INVALID, "emulated capture: the stream captures already");
    }
    return UCCL_OK;
}

int uccl_sg_emu_capture_end(uintptr_t stream, uintptr_t *graph_p)
{
    struct emu_stream *s = (struct emu_stream *)stream;
    if (!s)
        return uccl__err(UCCL_ERR_INVALID, "emulated capture: stream 0");
    pthread_mutex_lock(&s->mu);
    struct emu_graph *g = s->capture;
    s->capture = NULL;
    pthread_mutex_unlock(&s->mu);
    if (!g)
        return uccl__err(UCCL_ERR_INVALID, "emulated capture: the stream was not capturing");
    for (int i = 0; i < g->njoined; i++) {
        struct emu_stream *j = g->joined[i];
        pthread_mutex_lock(&j->mu);
        j->capture = NULL;
        pthread_mutex_unlock(&j->mu);
    }
    *graph_p = (uintptr_t)g;
    return UCCL_OK;
}

int uccl_sg_emu_graph_launch(uintptr_t graph, uintptr_t stream)
{
    const struct emu_graph *g = (const struct emu_graph *)graph;
    int rc = g ? UCCL_OK : uccl__err(UCCL_ERR_INVALID, "emulated graph 0");
    for (const struct emu_op *o = g ? g->head : NULL; o && !rc; o = o->next) {
        struct emu_op op = *o;
        op.from = NULL;
        if (op.kind == E_RECORD) /* a new record of the event at each launch */
            op.gen = __atomic_add_fetch(&op.ev->recorded, 1, __ATOMIC_ACQ_REL);
        else if (op.kind == E_WAITEV) /* ... and a wait for this launch's record */
            op.gen = __atomic_load_n(&op.ev->recorded, __ATOMIC_ACQUIRE);
        rc = push(o->from == g->origin ? stream : (uintptr_t)o->from, op);
    }
    return rc;
}

void uccl_sg_emu_graph_free(uintptr_t graph)
{
    struct emu_graph *g = (struct emu_graph *)graph;
    for (struct emu_op *o = g ? g->head : NULL; o;) {
        struct emu_op *n = o->next;
        free(o);
        o = n;
    }
    free(g);
}

int uccl_sg_emu_graph_launches(uintptr_t graph)
{
    const struct emu_graph *g = (const struct emu_graph *)graph;
    int n = 0;
    for (const struct emu_op *o = g ? g->head : NULL; o; o = o->next)
        n += o->kind == E_FUSED;
    return n;
}

int uccl_sg_emu_stream_new(uintptr_t *stream_p)
{
    struct emu_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->th, NULL, stream_main, s) != 0) {
        free(s);
        return uccl__err(UCCL_ERR_NOMEM, "no thread for an emulated stream");
    }
    *stream_p = (uintptr_t)s;
    return UCCL_OK;
}

int uccl_sg_emu_stream_idle(uintptr_t stream, uint64_t timeout_ns)
{
    struct emu_stream *s = (struct emu_stream *)stream;
    uint64_t until = uccl__now_ns() + timeout_ns;
    pthread_mutex_lock(&s->mu);
    while ((s->head || s->busy) && uccl__now_ns() < until) {
        pthread_mutex_unlock(&s->mu);
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
    }
    int idle = !s->head && !s->busy;
    pthread_mutex_unlock(&s->mu);
    return idle ? UCCL_OK : uccl__err(UCCL_ERR_TIMEOUT, "emulated stream not idle in time");
}

int uccl_sg_emu_stream_free(uintptr_t stream)
{
    struct emu_stream *s = (struct emu_stream *)stream;
    if (!s)
        return 0;
    pthread_mutex_lock(&s->mu);
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    for (struct emu_op *o = s->head; o;) {
        struct emu_op *n = o->next;
        free(o);
        o = n;
    }
    int stuck = s->stuck;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    return stuck;
}

/* ---- the device ------------------------------------------------------------------------ */
static int emu_memops(void *d, uintptr_t stream, const struct uccl__sg_memop *ops, int n)
{
    (void)d;
    int rc = UCCL_OK;
    for (int i = 0; i < n && !rc; i++) {
        int kind = ops[i].wait == UCCL__SG_BUMP ? E_BUMP : ops[i].wait ? E_WAIT : E_WRITE;
        rc = push(stream, (struct emu_op){.kind = kind, .addr = ops[i].addr,
                                          .value = ops[i].value, .epoch = ops[i].epoch});
    }
    return rc;
}

static int emu_capturing(void *d, uintptr_t stream)
{
    (void)d;
    struct emu_stream *s = (struct emu_stream *)stream;
    pthread_mutex_lock(&s->mu);
    int on = s->capture != NULL;
    pthread_mutex_unlock(&s->mu);
    return on;
}

static int emu_copies(void *d, uintptr_t stream, const struct uccl_sg_copy *cs, int n)
{
    (void)d;
    int rc = UCCL_OK;
    for (int i = 0; i < n && !rc; i++)
        rc = push(stream, (struct emu_op){.kind = E_COPY, .dst = cs[i].dst, .src = cs[i].src,
                                          .len = cs[i].len});
    return rc;
}

static int emu_reduce(void *d, uintptr_t stream, const struct uccl__sg_red_args *a)
{
    (void)d;
    return push(stream, (struct emu_op){.kind = E_REDUCE, .red = *a});
}

/* Only a captured round's: the others' steps (sg_round.c) are what the
 * emulated device tests. */
static int emu_fused(void *d, uintptr_t stream, const struct uccl__sg_fused_args *a)
{
    (void)d;
    if (!a->epoch)
        return UCCL_ERR_UNAVAIL;
    return push(stream, (struct emu_op){.kind = E_FUSED, .fz = *a});
}

static int emu_alloc(void *d, size_t len, uintptr_t *ptr_p)
{
    (void)d;
    void *p = aligned_alloc(256, (len + 255) / 256 * 256);
    if (!p)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory (%zu bytes)", len);
    memset(p, 0, len);
    *ptr_p = (uintptr_t)p;
    return UCCL_OK;
}

static void emu_free_mem(void *d, uintptr_t ptr)
{
    (void)d;
    free((void *)ptr);
}

static int emu_event_new(void *d, void **ev_p)
{
    (void)d;
    struct emu_event *ev = calloc(1, sizeof(*ev));
    if (!ev)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *ev_p = ev;
    return UCCL_OK;
}

static void emu_event_free(void *d, void *ev)
{
    (void)d;
    (void)ev; /* not freed: an emulated stream may still hold it (a few bytes, tests only) */
}

static int emu_record(void *d, void *evp, uintptr_t stream)
{
    (void)d;
    struct emu_event *ev = evp;
    struct emu_stream *s = (struct emu_stream *)stream;
    uint64_t gen = __atomic_add_fetch(&ev->recorded, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_lock(&s->mu);
    ev->cap_graph = s->capture;
    ev->cap_stream = s->capture ? s : NULL;
    pthread_mutex_unlock(&s->mu);
    return push(stream, (struct emu_op){.kind = E_RECORD, .ev = ev, .gen = gen});
}

/* A stream that waits for an event recorded in a capture joins it. */
static int join_capture(struct emu_stream *s, const struct emu_event *ev)
{
    struct emu_stream *rec = ev->cap_stream;
    if (!rec || rec == s)
        return UCCL_OK;
    pthread_mutex_lock(&rec->mu);
    struct emu_graph *g = rec->capture == ev->cap_graph ? ev->cap_graph : NULL;
    pthread_mutex_unlock(&rec->mu);
    if (!g)
        return UCCL_OK;
    pthread_mutex_lock(&s->mu);
    int rc = UCCL_OK;
    if (!s->capture && g->njoined == EMU_JOINED) {
        rc = uccl__err(UCCL_ERR_INVALID, "emulated capture: %d streams joined it already",
                       EMU_JOINED);
    } else if (!s->capture) {
        s->capture = g;
        g->joined[g->njoined++] = s;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int emu_wait_event(void *d, uintptr_t stream, void *evp)
{
    (void)d;
    struct emu_event *ev = evp;
    int rc = join_capture((struct emu_stream *)stream, ev);
    return rc ? rc : push(stream, (struct emu_op){.kind = E_WAITEV, .ev = ev,
                                                  .gen = __atomic_load_n(&ev->recorded,
                                                                         __ATOMIC_ACQUIRE)});
}

static int emu_query(void *d, void *evp)
{
    (void)d;
    struct emu_event *ev = evp;
    return __atomic_load_n(&ev->done, __ATOMIC_ACQUIRE) >=
           __atomic_load_n(&ev->recorded, __ATOMIC_ACQUIRE);
}

struct emu_dev {
    long regs, deregs, maps; /* updated by the rank's host thread and its watchdog */
};

static int emu_reg(void *d, uintptr_t ptr, size_t len, uint64_t *reg_p)
{
    (void)len;
    __atomic_add_fetch(&((struct emu_dev *)d)->regs, 1, __ATOMIC_RELAXED);
    *reg_p = ptr;
    return UCCL_OK;
}

static int emu_key(void *d, uint64_t reg, uintptr_t ptr, size_t len, uint64_t *key_p)
{
    (void)d;
    (void)reg;
    (void)len;
    *key_p = ptr;
    return UCCL_OK;
}

static void emu_dereg(void *d, uint64_t reg)
{
    (void)reg;
    __atomic_add_fetch(&((struct emu_dev *)d)->deregs, 1, __ATOMIC_RELAXED);
}

static int emu_map(void *d, int peer, uint64_t key, uint64_t addr, size_t len, uintptr_t *ptr_p,
                   void **imp_p)
{
    (void)peer;
    (void)key;
    (void)len;
    __atomic_add_fetch(&((struct emu_dev *)d)->maps, 1, __ATOMIC_RELAXED);
    *ptr_p = (uintptr_t)addr;
    *imp_p = d; /* anything not NULL: unmap counts it back */
    return UCCL_OK;
}

static void emu_unmap(void *d, void *imp)
{
    (void)imp;
    __atomic_sub_fetch(&((struct emu_dev *)d)->maps, 1, __ATOMIC_RELAXED);
}

static void emu_destroy(void *d) { (void)d; /* uccl_sg_emu_free, after the counts are read */ }

void uccl_sg_emu_counts(void *d, long out[3])
{
    struct emu_dev *e = d;
    out[0] = __atomic_load_n(&e->regs, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&e->deregs, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&e->maps, __ATOMIC_RELAXED);
}

void uccl_sg_emu_free(void *d) { free(d); }

static const struct uccl__sg_dev emu_ops = {
    .memops = emu_memops, .copies = emu_copies, .reduce = emu_reduce, .event_new = emu_event_new,
    .event_free = emu_event_free, .record = emu_record, .wait_event = emu_wait_event,
    .query = emu_query, .reg = emu_reg, .key = emu_key, .dereg = emu_dereg, .map = emu_map,
    .unmap = emu_unmap, .destroy = emu_destroy, .capturing = emu_capturing,
    .fused = emu_fused, .alloc = emu_alloc, .free_mem = emu_free_mem,
};

int uccl_sg_emu_new(const struct uccl__sg_dev **ops_p, void **d_p)
{
    struct emu_dev *d = calloc(1, sizeof(*d));
    if (!d)
        return uccl__err(UCCL_ERR_NOMEM, "out of memory");
    *ops_p = &emu_ops;
    *d_p = d;
    return UCCL_OK;
}
