/* The StreamGroup type (pyengine.h): a stream-ordered group (sgroup.h) for
 * uccl_collective/core/stream_group.py, which makes the shared file and the
 * group's stream.
 *
 *   StreamGroup(endpoint, conns, rank, size, dev, page, page_len, timeout_s, stream)
 *
 * over CUDA (endpoint: the Endpoint whose same-host connections conns[r]
 * reach rank r), or with endpoint None the emulated device of tests (the
 * streams are handles of _sg_emu_stream_new).  Every call that queues a
 * round takes (caller, caller_waits, end_event) first: the caller's stream,
 * whether it waits for the round's end, an event of event_new() to record
 * there (0: none); it returns the round's number.  A round runs without the
 * GIL; its host waits check for signals every ~50 ms (an interrupted round
 * fails the group). */
#include "py/pyengine.h"
#include <stdarg.h>
#include <time.h>

#include "sg/sgroup.h"

uccl__py_sgroup *uccl__py_sg_open(PyObject *op)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    if (!self->sg) {
        PyErr_SetString(PyExc_ValueError, "the stream-ordered group is closed");
        return NULL;
    }
    if (self->endpoint && uccl__py_ep_check(self->endpoint))
        return NULL;
    return self;
}

/* A failed round as an exception: the group's failure is a UcclError (a
 * UcclTimeoutError for a timeout) whatever the status, an argument error
 * (nothing failed) as its status says. */
static PyObject *round_error(uccl__py_sgroup *self, int rc)
{
    if (PyErr_Occurred())
        return NULL; /* a signal's exception */
    if (uccl_sg_error(self->sg) && rc != UCCL_ERR_TIMEOUT)
        rc = UCCL_ERR_IO;
    return uccl__py_raise(self->module, rc, uccl_last_error());
}

/* Host waits call this without the GIL: take it, check for signals, give it back. */
struct intr {
    PyThreadState *ts;
};

static int interrupted(void *arg)
{
    struct intr *in = arg;
    PyEval_RestoreThread(in->ts);
    int hit = PyErr_CheckSignals() != 0;
    in->ts = PyEval_SaveThread();
    return hit;
}

typedef int (*call_fn)(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *arg, uint32_t *k);

static int sg_close(uccl__py_sgroup *self);

/* The group this thread is running a round of (its host waits call back
 * into Python for signals: a handler there may close the group). */
static _Thread_local uccl__py_sgroup *in_round;

/* Run fn without the GIL (and with the endpoint held), return the round.
 * The group stays alive meanwhile: close() waits for rounds in flight. */
static PyObject *run_round(uccl__py_sgroup *self, struct uccl_sg_opts *o, call_fn fn, void *arg)
{
    struct intr in;
    uint32_t k = 0;
    o->intr = interrupted;
    o->intr_arg = &in;
    if (self->endpoint)
        uccl__py_ep_enter(self->endpoint);
    uccl_sg_t *sg = self->sg;
    uccl__py_sgroup *outer = in_round;
    self->inflight++;
    in_round = self;
    in.ts = PyEval_SaveThread();
    int rc = fn(sg, o, arg, &k);
    PyEval_RestoreThread(in.ts);
    in_round = outer;
    self->inflight--;
    PyObject *res = rc ? round_error(self, rc) : PyLong_FromUnsignedLong(k);
    if (self->close_pending && self->inflight == 0) {
        self->close_pending = 0;
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb); /* the round's error, kept across the close */
        sg_close(self);
        PyErr_Restore(et, ev, tb);
    }
    if (self->endpoint)
        uccl__py_ep_leave(self->endpoint);
    return res;
}

/* ---- construction -------------------------------------------------------------- */
static int SG_init(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    static char *kwlist[] = {"endpoint", "conns", "rank", "size", "dev", "page", "page_len",
                             "timeout_s", "stream", "owner", NULL};
    PyObject *epo, *conns, *owner = Py_None;
    int rank, size, dev;
    uint64_t page, stream;
    size_t page_len;
    double timeout_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOiiiO&O&dO&|O", kwlist, &epo, &conns, &rank,
                                     &size, &dev, uccl__py_to_u64, &page, uccl__py_to_size,
                                     &page_len, &timeout_s, uccl__py_to_u64, &stream, &owner))
        return -1;
    if (self->sg || self->module) {
        PyErr_SetString(PyExc_RuntimeError, "StreamGroup.__init__ called twice");
        return -1;
    }
    self->module = uccl__py_module_of(Py_TYPE(op));
    if (!self->module)
        return -1;
    if (size < 1 || size > UCCL_SG_MAX_RANKS || rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "StreamGroup: rank %d of %d (at most %d ranks)", rank,
                     size, UCCL_SG_MAX_RANKS);
        return -1;
    }
    const struct uccl__sg_dev *ops;
    void *d = NULL;
    int rc;
    if (epo == Py_None) {
        rc = uccl_sg_emu_new(&ops, &d);
        self->emu = d;
    } else {
        uccl__py_endpoint *ep = uccl__py_endpoint_arg(self->module, epo, "StreamGroup");
        if (!ep || uccl__py_ep_check(ep))
            return -1;
        uint64_t c[UCCL_SG_MAX_RANKS];
        Py_ssize_t n = PySequence_Size(conns);
        if (n != size) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "StreamGroup: %zd connections for %d ranks", n,
                             size);
            return -1;
        }
        for (int i = 0; i < size; i++) {
            PyObject *it = PySequence_GetItem(conns, i);
            int ok = it && uccl__py_to_u64(it, &c[i]);
            Py_XDECREF(it);
            if (!ok)
                return -1;
        }
        rc = uccl_sg_cuda_new(ep->ep, c, rank, size, dev, &ops, &d);
        if (rc == UCCL_OK) {
            Py_INCREF(ep);
            self->endpoint = ep;
            self->cuda = d;
        }
    }
    if (rc) {
        uccl__py_raise(self->module, rc, uccl_last_error());
        return -1;
    }
    rc = uccl_sg_new((void *)(uintptr_t)page, page_len, rank, size, timeout_s, (uintptr_t)stream,
                     ops, d, &self->sg);
    if (rc) {
        self->cuda = NULL;
        uccl__py_raise(self->module, rc, uccl_last_error());
        return -1;
    }
    self->dev = dev;
    /* the page stays mapped at least as long as this group runs (its
     * watchdog reads it until close): whatever owns the mapping is kept */
    Py_INCREF(owner);
    self->owner = owner;
    return 0;
}

/* ---- rounds ---------------------------------------------------------------------- */
static int opts_arg(PyObject *args, Py_ssize_t *at, struct uccl_sg_opts *o)
{
    /* (caller, caller_waits, end_event) at the front of args */
    if (PyTuple_Size(args) < 3) {
        PyErr_SetString(PyExc_TypeError, "expected (caller, caller_waits, end_event, ...)");
        return -1;
    }
    uint64_t caller, ev;
    if (!uccl__py_to_u64(PyTuple_GetItem(args, 0), &caller) ||
        !uccl__py_to_u64(PyTuple_GetItem(args, 2), &ev))
        return -1;
    int waits = PyObject_IsTrue(PyTuple_GetItem(args, 1));
    if (waits < 0)
        return -1;
    memset(o, 0, sizeof(*o));
    o->caller = (uintptr_t)caller;
    o->caller_waits = waits;
    o->end_event = (void *)(uintptr_t)ev;
    *at = 3;
    return 0;
}

static PyObject *rest(PyObject *args, Py_ssize_t at)
{
    return PyTuple_GetSlice(args, at, PyTuple_Size(args));
}

static int do_allreduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    return uccl_sg_allreduce(sg, o, r->a, r->count, r->dtype, r->op, k);
}
static int do_reduce_scatter(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    return uccl_sg_reduce_scatter(sg, o, r->a, r->b, r->count, r->dtype, r->op, k);
}
static int do_reduce(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    return uccl_sg_reduce(sg, o, r->a, r->count, r->dtype, r->op, r->root, k);
}
static int do_allgather(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    return uccl_sg_allgather(sg, o, r->a, r->count, r->b, k);
}
static int do_broadcast(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    return uccl_sg_broadcast(sg, o, r->a, r->count, r->root, k);
}

/* A collective: (caller, caller_waits, end_event), then its own arguments
 * parsed by fmt into the fields of *r the varargs point at, then its round. */
static PyObject *collective(PyObject *op, PyObject *args, call_fn fn, struct uccl__py_coll_args *r,
                            const char *fmt, ...)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    struct uccl_sg_opts o;
    Py_ssize_t at;
    if (!self || opts_arg(args, &at, &o))
        return NULL;
    PyObject *t = rest(args, at);
    if (!t)
        return NULL;
    va_list va;
    va_start(va, fmt);
    int ok = PyArg_VaParse(t, fmt, va);
    va_end(va);
    Py_DECREF(t);
    return ok ? run_round(self, &o, fn, r) : NULL;
}

/* allreduce(caller, caller_waits, end_event, ptr, count, dtype, op) */
static PyObject *SG_allreduce(PyObject *op, PyObject *args)
{
    struct uccl__py_coll_args r = {0};
    return collective(op, args, do_allreduce, &r, "O&O&ii", uccl__py_to_u64, &r.a,
                      uccl__py_to_size, &r.count, &r.dtype, &r.op);
}

/* reduce_scatter(caller, caller_waits, end_event, out, inp, count, dtype, op) */
static PyObject *SG_reduce_scatter(PyObject *op, PyObject *args)
{
    struct uccl__py_coll_args r = {0};
    return collective(op, args, do_reduce_scatter, &r, "O&O&O&ii", uccl__py_to_u64, &r.a,
                      uccl__py_to_u64, &r.b, uccl__py_to_size, &r.count, &r.dtype, &r.op);
}

/* reduce(caller, caller_waits, end_event, ptr, count, dtype, op, root) */
static PyObject *SG_reduce(PyObject *op, PyObject *args)
{
    struct uccl__py_coll_args r = {0};
    return collective(op, args, do_reduce, &r, "O&O&iii", uccl__py_to_u64, &r.a,
                      uccl__py_to_size, &r.count, &r.dtype, &r.op, &r.root);
}

/* allgather(caller, caller_waits, end_event, src, nbytes, dst) */
static PyObject *SG_allgather(PyObject *op, PyObject *args)
{
    struct uccl__py_coll_args r = {0};
    return collective(op, args, do_allgather, &r, "O&O&O&", uccl__py_to_u64, &r.a,
                      uccl__py_to_size, &r.count, uccl__py_to_u64, &r.b);
}

/* broadcast(caller, caller_waits, end_event, ptr, nbytes, root) */
static PyObject *SG_broadcast(PyObject *op, PyObject *args)
{
    struct uccl__py_coll_args r = {0};
    return collective(op, args, do_broadcast, &r, "O&O&i", uccl__py_to_u64, &r.a,
                      uccl__py_to_size, &r.count, &r.root);
}

PyObject *uccl__py_sg_fast_round(uccl__py_sgroup *self, uint64_t caller, int gather,
                                 const struct uccl__py_coll_args *a)
{
    struct uccl_sg_opts o = {.caller = (uintptr_t)caller, .caller_waits = 1};
    struct uccl__py_coll_args r = *a; /* run_round's argument is not const */
    if (!uccl__py_sg_open((PyObject *)self))
        return NULL;
    return run_round(self, &o, gather ? do_allgather : do_allreduce, &r);
}

/* The general round's lists, parsed with the GIL held. */
struct gen_call {
    struct uccl_sg_call c;
    struct uccl_sg_pub *pub;
    struct uccl_sg_pull *pull;
    struct uccl_sg_copy *copy;
    struct uccl_sg_red red;
};

static int do_round(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct gen_call *g = p;
    g->c.caller = o->caller;
    g->c.caller_waits = o->caller_waits;
    g->c.end_event = o->end_event;
    return uccl_sg_round(sg, &g->c, o->intr, o->intr_arg, k);
}

/* Each item of seq parsed into out[i] by fill (a tuple). */
static int parse_list(PyObject *seq, Py_ssize_t *n_p, void **out, size_t esz,
                      int (*fill)(void *out, Py_ssize_t i, PyObject *item))
{
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0)
        return -1;
    *out = PyMem_Calloc((size_t)(n ? n : 1), esz);
    if (!*out) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_GetItem(seq, i);
        int bad = !it || fill(*out, i, it);
        Py_XDECREF(it);
        if (bad)
            return -1;
    }
    *n_p = n;
    return 0;
}

static int fill_pub(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_pub *p = (struct uccl_sg_pub *)out + i;
    uint64_t ptr;
    return PyArg_ParseTuple(it, "O&O&O&", uccl__py_to_u64, &p->tag, uccl__py_to_u64, &ptr,
                            uccl__py_to_size, &p->len)
               ? (p->ptr = (uintptr_t)ptr, 0)
               : -1;
}

static int fill_pull(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_pull *p = (struct uccl_sg_pull *)out + i;
    uint64_t dst;
    return PyArg_ParseTuple(it, "iipO&O&O&O&", &p->peer, &p->phase, &p->exact, uccl__py_to_u64,
                            &p->tag, uccl__py_to_u64, &p->off, uccl__py_to_u64, &dst,
                            uccl__py_to_size, &p->len)
               ? (p->dst = (uintptr_t)dst, 0)
               : -1;
}

static int fill_copy(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_copy *p = (struct uccl_sg_copy *)out + i;
    uint64_t dst, src;
    return PyArg_ParseTuple(it, "O&O&O&", uccl__py_to_u64, &dst, uccl__py_to_u64, &src,
                            uccl__py_to_size, &p->len)
               ? (p->dst = (uintptr_t)dst, p->src = (uintptr_t)src, 0)
               : -1;
}

/* round(caller, caller_waits, end_event, what, kind, arg, phases, pub, pull, copy, red):
 * pub [(tag, ptr, len)], pull [(peer, phase, exact, tag, off, dst, len)],
 * copy [(dst, src, len)], red None or (dtype, op, tag, off, out, count). */
static PyObject *SG_round(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    struct uccl_sg_opts o;
    Py_ssize_t at, npub = 0, npull = 0, ncopy = 0;
    if (!self || opts_arg(args, &at, &o))
        return NULL;
    const char *what;
    unsigned int kind;
    uint64_t arg;
    int phases;
    PyObject *pubs, *pulls, *copies, *red, *res = NULL;
    PyObject *t = rest(args, at);
    int ok = t && PyArg_ParseTuple(t, "sIO&iOOOO", &what, &kind, uccl__py_to_u64, &arg, &phases,
                                   &pubs, &pulls, &copies, &red);
    Py_XDECREF(t);
    if (!ok)
        return NULL;
    struct gen_call g;
    memset(&g, 0, sizeof(g));
    if (parse_list(pubs, &npub, (void **)&g.pub, sizeof(*g.pub), fill_pub) ||
        parse_list(pulls, &npull, (void **)&g.pull, sizeof(*g.pull), fill_pull) ||
        parse_list(copies, &ncopy, (void **)&g.copy, sizeof(*g.copy), fill_copy))
        goto out;
    if (npub > INT32_MAX || npull > INT32_MAX || ncopy > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "round: too many entries");
        goto out;
    }
    if (red != Py_None) {
        uint64_t out_ptr;
        if (!PyArg_ParseTuple(red, "iiO&O&O&O&", &g.red.dtype, &g.red.op, uccl__py_to_u64,
                              &g.red.tag, uccl__py_to_u64, &g.red.off, uccl__py_to_u64, &out_ptr,
                              uccl__py_to_size, &g.red.count))
            goto out;
        g.red.out = (uintptr_t)out_ptr;
        g.c.red = &g.red;
    }
    g.c.what = what;
    g.c.kind = kind;
    g.c.arg = arg;
    g.c.phases = phases;
    g.c.pub = g.pub;
    g.c.npub = (int)npub;
    g.c.pull = g.pull;
    g.c.npull = (int)npull;
    g.c.copy = g.copy;
    g.c.ncopy = (int)ncopy;
    res = run_round(self, &o, do_round, &g);
out:
    PyMem_Free(g.pub);
    PyMem_Free(g.pull);
    PyMem_Free(g.copy);
    return res;
}

/* ---- point to point ------------------------------------------------------------------ */
struct p2p_call {
    struct uccl_sg_p2p_op *ops;
    int n;
    uint64_t *codes;
};

static int do_p2p(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct p2p_call *a = p;
    *k = 0;
    return uccl_sg_p2p(sg, a->ops, a->n, o->caller, o->intr, o->intr_arg, a->codes);
}

static int fill_p2p(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_p2p_op *p = (struct uccl_sg_p2p_op *)out + i;
    uint64_t ptr, stream;
    return PyArg_ParseTuple(it, "ipO&O&O&", &p->peer, &p->send, uccl__py_to_u64, &ptr,
                            uccl__py_to_size, &p->len, uccl__py_to_u64, &stream)
               ? (p->ptr = (uintptr_t)ptr, p->stream = (uintptr_t)stream, 0)
               : -1;
}

/* p2p(caller, [(peer, send, ptr, len, stream)]) -> [code]: post the messages in order */
static PyObject *SG_p2p(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t caller;
    PyObject *items, *res = NULL;
    Py_ssize_t n = 0;
    struct p2p_call a = {NULL, 0, NULL};
    if (!self || !PyArg_ParseTuple(args, "O&O", uccl__py_to_u64, &caller, &items))
        return NULL;
    if (parse_list(items, &n, (void **)&a.ops, sizeof(*a.ops), fill_p2p))
        goto out;
    if (n < 1 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "p2p: %zd messages", n);
        goto out;
    }
    a.n = (int)n;
    a.codes = PyMem_Calloc((size_t)n, sizeof(uint64_t));
    if (!a.codes) {
        PyErr_NoMemory();
        goto out;
    }
    struct uccl_sg_opts o = {(uintptr_t)caller, 0, NULL, NULL, NULL};
    PyObject *k = run_round(self, &o, do_p2p, &a);
    if (!k)
        goto out;
    Py_DECREF(k);
    res = PyList_New(n);
    for (Py_ssize_t i = 0; res && i < n; i++) {
        PyObject *c = PyLong_FromUnsignedLongLong(a.codes[i]);
        if (!c) {
            Py_CLEAR(res);
            break;
        }
        PyList_SetItem(res, i, c); /* steals c */
    }
out:
    PyMem_Free(a.ops);
    PyMem_Free(a.codes);
    return res;
}

/* p2p_wait(code, stream): the stream waits for the message (no host wait) */
static PyObject *SG_p2p_wait(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t code, stream;
    if (!self || !PyArg_ParseTuple(args, "O&O&", uccl__py_to_u64, &code, uccl__py_to_u64, &stream))
        return NULL;
    int rc = uccl_sg_p2p_wait(self->sg, code, (uintptr_t)stream);
    return rc ? round_error(self, rc) : (Py_INCREF(Py_None), Py_None);
}

/* p2p_arena(peer, ptr, len): sends to peer posted first staged there; fused_arena(ptr,
 * len, slot_bytes): one-launch rounds'.  Without the GIL: a round may hold the lock. */
static PyObject *set_arena(PyObject *op, PyObject *args, int fused)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    int peer = 0, rc;
    uint64_t ptr;
    size_t len, slot = 0;
    if (!self || !(fused ? PyArg_ParseTuple(args, "O&O&O&", uccl__py_to_u64, &ptr,
                                            uccl__py_to_size, &len, uccl__py_to_size, &slot)
                         : PyArg_ParseTuple(args, "iO&O&", &peer, uccl__py_to_u64, &ptr,
                                            uccl__py_to_size, &len)))
        return NULL;
    uccl_sg_t *sg = self->sg;
    self->inflight++;
    Py_BEGIN_ALLOW_THREADS
    rc = fused ? uccl_sg_fused_arena(sg, (uintptr_t)ptr, len, slot)
               : uccl_sg_p2p_arena(sg, peer, (uintptr_t)ptr, len);
    Py_END_ALLOW_THREADS
    self->inflight--;
    return rc ? round_error(self, rc) : (Py_INCREF(Py_None), Py_None);
}

static PyObject *SG_p2p_arena(PyObject *op, PyObject *args) { return set_arena(op, args, 0); }
static PyObject *SG_fused_arena(PyObject *op, PyObject *args) { return set_arena(op, args, 1); }

static PyObject *SG_p2p_passed(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    uint64_t code;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &code))
        return NULL;
    if (!self->sg)
        Py_RETURN_TRUE; /* closed: its messages were waited for */
    int rc = uccl_sg_p2p_passed(self->sg, code);
    if (rc < 0)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    return PyBool_FromLong(rc);
}

/* ---- state, events, close ----------------------------------------------------------- */
static PyObject *SG_passed(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    unsigned long k;
    if (!PyArg_ParseTuple(args, "k", &k))
        return NULL;
    if (!self->sg)
        Py_RETURN_TRUE; /* closed: its stream was waited for */
    return PyBool_FromLong(uccl_sg_passed(self->sg, (uint32_t)k));
}

static PyObject *SG_error(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    const char *e = self->sg ? uccl_sg_error(self->sg) : NULL;
    if (!e)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(e, (Py_ssize_t)strlen(e), "replace");
}

static PyObject *SG_fail(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    const char *why;
    if (!PyArg_ParseTuple(args, "s", &why))
        return NULL;
    if (self->sg)
        uccl_sg_fail(self->sg, why);
    Py_RETURN_NONE;
}

static PyObject *SG_event_new(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    void *ev = NULL;
    if (!self)
        return NULL;
    int rc = uccl_sg_event_new(self->sg, &ev);
    if (rc)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ev);
}

static PyObject *SG_event_free(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    uint64_t ev;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &ev))
        return NULL;
    if (self->sg)
        uccl_sg_event_free(self->sg, (void *)(uintptr_t)ev);
    Py_RETURN_NONE;
}

/* event_wait(stream, ev): the stream waits for the event (no host wait) */
static PyObject *SG_event_wait(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t stream, ev;
    if (!self || !PyArg_ParseTuple(args, "O&O&", uccl__py_to_u64, &stream, uccl__py_to_u64, &ev))
        return NULL;
    int rc = uccl_sg_event_wait(self->sg, (uintptr_t)stream, (void *)(uintptr_t)ev);
    if (rc)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    Py_RETURN_NONE;
}

/* wait_last(stream): the stream waits for the last round queued so far */
static PyObject *SG_wait_last(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t stream;
    if (!self || !PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &stream))
        return NULL;
    int rc;
    uccl_sg_t *sg = self->sg;
    self->inflight++; /* a round may hold the group's call lock: wait without the GIL */
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_sg_wait_last(sg, (uintptr_t)stream);
    Py_END_ALLOW_THREADS
    self->inflight--;
    if (rc)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    Py_RETURN_NONE;
}

static PyObject *SG_event_query(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t ev;
    if (!self || !PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &ev))
        return NULL;
    int rc = uccl_sg_event_query(self->sg, (void *)(uintptr_t)ev);
    if (rc < 0)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    return PyBool_FromLong(rc);
}

/* kernel_ready(dtype): compile the reduction kernel for dtype now (CUDA) */
static PyObject *SG_kernel_ready(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    int dtype;
    if (!self || !PyArg_ParseTuple(args, "i", &dtype))
        return NULL;
    if (!self->cuda)
        Py_RETURN_NONE; /* emulated: the CPU reduces */
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_sg_kernel_ready(self->dev, dtype);
    Py_END_ALLOW_THREADS
    if (rc)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    Py_RETURN_NONE;
}

/* Close: a round in flight on another thread is failed (its host waits
 * end at once) and waited for first; one in flight on this thread (close
 * from a signal handler inside it) closes the group once it returns. */
static int sg_close(uccl__py_sgroup *self)
{
    if (!self->sg)
        return 1;
    if (self->inflight) {
        uccl_sg_fail(self->sg, "the group was closed with an operation in flight");
        if (in_round == self) {
            self->close_pending = 1;
            return 0;
        }
        while (self->inflight) {
            Py_BEGIN_ALLOW_THREADS
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
        }
        if (!self->sg)
            return 1; /* closed by a round's thread meanwhile */
    }
    uccl_sg_t *sg = self->sg;
    self->sg = NULL;
    int ep_open = self->endpoint && !self->endpoint->closed;
    if (self->cuda && !ep_open)
        uccl_sg_cuda_forget_ep(self->cuda); /* its registrations went with it */
    self->cuda = NULL;
    if (ep_open)
        uccl__py_ep_enter(self->endpoint);
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = uccl_sg_close(sg);
    Py_END_ALLOW_THREADS
    if (ep_open)
        uccl__py_ep_leave(self->endpoint);
    return ok;
}

/* close() -> True when the page may be unmapped (see uccl_sg_close) */
static PyObject *SG_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(sg_close((uccl__py_sgroup *)op));
}

static void SG_dealloc(PyObject *op)
{
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    PyTypeObject *tp = Py_TYPE(op);
    int ok = sg_close(self);
    uccl_sg_emu_free(self->emu);
    Py_CLEAR(self->endpoint);
    if (ok)
        Py_CLEAR(self->owner);
    /* else the group failed with rounds queued: this rank's stream may
     * still write into the page, which stays mapped for the process */
    Py_CLEAR(self->module);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static PyMethodDef SG_methods[] = {
    {"round", SG_round, METH_VARARGS,
     "round(caller, caller_waits, end_event, what, kind, arg, phases, pub, pull, copy, red) -> k"},
    {"allreduce", SG_allreduce, METH_VARARGS,
     "allreduce(caller, caller_waits, end_event, ptr, count, dtype, op) -> k"},
    {"reduce_scatter", SG_reduce_scatter, METH_VARARGS,
     "reduce_scatter(caller, caller_waits, end_event, out, inp, count, dtype, op) -> k"},
    {"reduce", SG_reduce, METH_VARARGS,
     "reduce(caller, caller_waits, end_event, ptr, count, dtype, op, root) -> k"},
    {"allgather", SG_allgather, METH_VARARGS,
     "allgather(caller, caller_waits, end_event, src, nbytes, dst) -> k"},
    {"broadcast", SG_broadcast, METH_VARARGS,
     "broadcast(caller, caller_waits, end_event, ptr, nbytes, root) -> k"},
    {"p2p", SG_p2p, METH_VARARGS,
     "p2p(caller, [(peer, send, ptr, len, stream)]) -> [code]: messages posted in order"},
    {"p2p_wait", SG_p2p_wait, METH_VARARGS, "p2p_wait(code, stream): the stream waits for it"},
    {"p2p_passed", SG_p2p_passed, METH_VARARGS, "p2p_passed(code): the message is in place"},
    {"p2p_arena", SG_p2p_arena, METH_VARARGS, "p2p_arena(peer, ptr, len): sends staged there"},
    {"fused_arena", SG_fused_arena, METH_VARARGS, "fused_arena(ptr, len, slot): one-launch arena"},
    {"passed", SG_passed, METH_VARARGS, "passed(k): this rank's stream is past round k"},
    {"error", SG_error, METH_NOARGS, "error() -> why the group failed, or None"},
    {"fail", SG_fail, METH_VARARGS, "fail(why): fail the group for every rank"},
    {"event_new", SG_event_new, METH_NOARGS, "event_new() -> an event for end_event"},
    {"event_free", SG_event_free, METH_VARARGS, "event_free(ev)"},
    {"event_wait", SG_event_wait, METH_VARARGS, "event_wait(stream, ev): the stream waits"},
    {"event_query", SG_event_query, METH_VARARGS, "event_query(ev) -> done?"},
    {"wait_last", SG_wait_last, METH_VARARGS, "wait_last(stream): it waits for the last round"},
    {"emu_counts", uccl__py_sg_emu_counts, METH_NOARGS, "emu_counts() -> (regs, deregs, live mappings)"},
    {"emu_renumber", uccl__py_sg_emu_renumber, METH_VARARGS, "emu_renumber(rounds, messages[, lag]): tests"},
    {"kernel_ready", SG_kernel_ready, METH_VARARGS, "kernel_ready(dtype): compile it, or raise"},
    {"close", SG_close, METH_NOARGS, "close() -> whether the page may be unmapped"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot SG_slots[] = {
    {Py_tp_init, SG_init},
    {Py_tp_dealloc, SG_dealloc},
    {Py_tp_methods, SG_methods},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "A stream-ordered group of processes of one host on one GPU (sgroup.h)."},
    {0, NULL},
};

PyType_Spec uccl__py_sgroup_spec = {
    .name = "uccl_collective._engine.StreamGroup",
    .basicsize = sizeof(uccl__py_sgroup),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = SG_slots,
};
