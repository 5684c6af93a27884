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

typedef uccl__py_sg_call_fn call_fn;

static int sg_close(uccl__py_sgroup *self);

/* The group this thread is running a round of (its host waits call back
 * into Python for signals: a handler there may close the group). */
static _Thread_local uccl__py_sgroup *in_round;

/* Run fn without the GIL (and with the endpoint held), return the round.
 * The group stays alive meanwhile: close() waits for rounds in flight. */
PyObject *uccl__py_sg_run_round(uccl__py_sgroup *self, struct uccl_sg_opts *o, call_fn fn,
                                 void *arg)
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
int uccl__py_sg_opts_arg(PyObject *args, Py_ssize_t *at, struct uccl_sg_opts *o)
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

PyObject *uccl__py_sg_rest(PyObject *args, Py_ssize_t at)
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
    if (!self || uccl__py_sg_opts_arg(args, &at, &o))
        return NULL;
    PyObject *t = uccl__py_sg_rest(args, at);
    if (!t)
        return NULL;
    va_list va;
    va_start(va, fmt);
    int ok = PyArg_VaParse(t, fmt, va);
    va_end(va);
    Py_DECREF(t);
    return ok ? uccl__py_sg_run_round(self, &o, fn, r) : NULL;
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

/* all_to_all of equal chunks (uccl__py_sg_fast_round's third kind) */
static int do_all_to_all_equal(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct uccl__py_coll_args *r = p;
    struct uccl_sg_span send[UCCL_SG_MAX_RANKS], recv[UCCL_SG_MAX_RANKS];
    int n = uccl_sg_size(sg);
    for (int i = 0; i < n; i++) {
        send[i] = (struct uccl_sg_span){r->a + (size_t)i * r->count, r->count};
        recv[i] = (struct uccl_sg_span){r->b + (size_t)i * r->count, r->count};
    }
    return uccl_sg_all_to_all(sg, o, send, recv, k);
}

PyObject *uccl__py_sg_fast_round(uccl__py_sgroup *self, uint64_t caller, int which,
                                 const struct uccl__py_coll_args *a)
{
    struct uccl_sg_opts o = {.caller = (uintptr_t)caller, .caller_waits = 1};
    struct uccl__py_coll_args r = *a; /* run_round's argument is not const */
    if (!uccl__py_sg_open((PyObject *)self))
        return NULL;
    call_fn fn = which == UCCL__PY_FAST_ALLGATHER ? do_allgather
                 : which == UCCL__PY_FAST_ALL_TO_ALL ? do_all_to_all_equal : do_allreduce;
    return uccl__py_sg_run_round(self, &o, fn, &r);
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
    {"round", uccl__py_sg_round, METH_VARARGS,
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
    {"all_to_all", uccl__py_sg_all_to_all, METH_VARARGS,
     "all_to_all(caller, caller_waits, end_event, sends, recvs) -> k"},
    {"p2p", uccl__py_sg_p2p, METH_VARARGS,
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
