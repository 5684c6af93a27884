/* The FastPath type (pyengine.h): the "uccl" backend's blocking all_reduce,
 * all_gather_into_tensor and all_to_all_single with no split sizes on CUDA
 * tensors in one C call, the first row of uccl_collective/core/dispatch.py's
 * table (the backend calls FastPath.allreduce / allgather / all_to_all
 * before anything else).
 *
 *   FastPath(token, size)
 *
 * One per process group, over its runner's Token (py_token.c) and its size.
 * The dispatch keeps it up to date through its methods: set_group(group, c,
 * dev) once the group's stream group is made (the Python StreamGroup, for
 * the Work; its engine object; its device), `closed` when the group shuts
 * down, and `codes`, the dict it fills with the kernel's codes per
 * (hash(reduceOp), dtype).  The calls read only these fields.
 *
 * Why C: for a small tensor the host's time is the call.  On one H100
 * shared by 2 processes under MPS a 1 MiB all_reduce's launches run at
 * 10.6 us a call, and the Python fast path (its checks, the runner's token,
 * the Work) took the host to 15-16 us (docs/benchmark-log.md, session 11).
 *
 * What it does is exactly the dispatch's second row's common case, nothing
 * more: the same checks (Dispatch.fast and kernel_codes: a blocking call, no
 * profiler, the group open, dense contiguous CUDA tensors on the group's
 * device, no graph capture, an operator and dtype whose kernel codes are
 * cached), the token taken and given back under the runner's lock, the
 * engine's round on the caller's stream, and the StreamWork.  Wherever
 * anything differs (the first call, which makes the stream group and
 * caches the codes; a task queued; a capture, which must raise; an
 * attribute missing) it returns None and the caller takes the dispatch's
 * next row, which decides and raises as before.  Raised here: the round's
 * own error, as the Python path would raise it, and an exception that is
 * not an Exception (KeyboardInterrupt, SystemExit) raised by anything it
 * calls, which is never swallowed.
 *
 * torch is reached only through its Python objects, given once by
 * fast_setup() (this module never links against libtorch): the tensors'
 * and the options' public attributes, read by name; a test that patches
 * torch.cuda or the backend's module globals does not reach this path,
 * only fast_setup() does. */
#include "py/pyengine.h"

#include "sg/sgroup.h"

/* the tensors' and options' attributes and methods, interned once */
enum {
    N_ASYNC, N_REDUCE_OP, N_IS_CUDA, N_LAYOUT, N_IS_CONTIGUOUS, N_GET_DEVICE, N_DTYPE,
    N_DATA_PTR, N_NUMEL, N_ELEMENT_SIZE, N_SHAPE, N_COUNT
};
_Static_assert(N_COUNT == UCCL__PY_FAST_NAMES, "struct uccl__py_fast's names");
static const char *const names[N_COUNT] = {
    "asyncOp", "reduceOp", "is_cuda", "layout", "is_contiguous", "get_device", "dtype",
    "data_ptr", "numel", "element_size", "shape",
};

/* fast_setup(tensor_type, strided, profiler_enabled, capturing, raw_stream, work_type).
 * The hooks it replaces are kept (in `retired`) for good: a call on
 * another thread may be using them, and this runs a few times at most. */
PyObject *uccl__py_fast_setup(PyObject *module, PyObject *args)
{
    struct uccl__py_fast *f = &uccl__py_state_of(module)->fast;
    PyObject *h[UCCL__PY_FAST_HOOKS];
    if (!PyArg_ParseTuple(args, "OOOOOO:fast_setup", &h[0], &h[1], &h[2], &h[3], &h[4], &h[5]))
        return NULL;
    for (int i = 0; i < N_COUNT; i++)
        if (!f->name[i] && !(f->name[i] = PyUnicode_InternFromString(names[i])))
            return NULL;
    if (!f->retired && !(f->retired = PyList_New(0)))
        return NULL;
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++)
        if (f->hook[i] && PyList_Append(f->retired, f->hook[i]) < 0)
            return NULL;
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++) {
        PyObject *old = f->hook[i];
        f->hook[i] = Py_NewRef(h[i]);
        Py_XDECREF(old); /* (still held by `retired`) */
    }
    Py_RETURN_NONE;
}

int uccl__py_fast_traverse(struct uccl__py_fast *f, visitproc visit, void *arg)
{
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++)
        Py_VISIT(f->hook[i]);
    Py_VISIT(f->retired);
    return 0;
}

void uccl__py_fast_clear(struct uccl__py_fast *f)
{
    Py_CLEAR(f->hook[UCCL__PY_FAST_WORK]); /* first: fast_of() says "not set up" from here */
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++)
        Py_CLEAR(f->hook[i]);
    Py_CLEAR(f->retired);
    for (int i = 0; i < N_COUNT; i++)
        Py_CLEAR(f->name[i]);
}

/* The hooks where fast_setup() ran (and this object's __init__), else NULL. */
static struct uccl__py_fast *fast_of(uccl__py_fastpath *self)
{
    if (!self->module) /* made by __new__ alone: declines, as the Python path then raises */
        return NULL;
    struct uccl__py_fast *f = &uccl__py_state_of(self->module)->fast;
    return f->hook[UCCL__PY_FAST_WORK] ? f : NULL;
}

/* After a check that failed with an error: an Exception is cleared (the
 * call declines, and the Python path meets it again); anything else
 * (KeyboardInterrupt, SystemExit) stays set, and the call raises it. */
static void soft(void)
{
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();
}

/* Declined: None for the Python path, or the error that must not be lost. */
static PyObject *decline(void)
{
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* o.name (a new reference), or NULL (soft()). */
static PyObject *get(struct uccl__py_fast *f, PyObject *o, int name)
{
    PyObject *v = PyObject_GetAttr(o, f->name[name]);
    if (!v)
        soft();
    return v;
}

/* o.name() (a new reference), or NULL (soft()). */
static PyObject *call0(struct uccl__py_fast *f, PyObject *o, int name)
{
    PyObject *v = PyObject_CallMethodObjArgs(o, f->name[name], NULL);
    if (!v)
        soft();
    return v;
}

/* Whether o.name is v (identity; NULL o.name: no). */
static int attr_is(struct uccl__py_fast *f, PyObject *o, int name, PyObject *v)
{
    PyObject *a = get(f, o, name);
    Py_XDECREF(a);
    return a != NULL && a == v;
}

/* A non-negative integer, or -1 (soft()); steals o. */
static long long as_ll(PyObject *o)
{
    if (!o)
        return -1;
    long long v = PyLong_Check(o) ? PyLong_AsLongLong(o) : -1;
    Py_DECREF(o);
    if (v < 0 && PyErr_Occurred())
        soft();
    return v < 0 ? -1 : v;
}

/* hook() is False (NULL hook result: no). */
static int hook_false(struct uccl__py_fast *f, int hook)
{
    PyObject *v = PyObject_CallNoArgs(f->hook[hook]);
    if (!v)
        soft();
    Py_XDECREF(v);
    return v == Py_False;
}

/* t's CUDA device if t is a dense contiguous CUDA tensor, else -1. */
static long long dense_cuda(struct uccl__py_fast *f, PyObject *t)
{
    int ok = PyObject_IsInstance(t, f->hook[UCCL__PY_FAST_TENSOR]);
    if (ok <= 0) {
        if (ok < 0)
            soft();
        return -1;
    }
    if (!attr_is(f, t, N_IS_CUDA, Py_True) || !attr_is(f, t, N_LAYOUT, f->hook[UCCL__PY_FAST_STRIDED]))
        return -1;
    PyObject *c = call0(f, t, N_IS_CONTIGUOUS);
    Py_XDECREF(c);
    if (c != Py_True)
        return -1;
    return as_ll(call0(f, t, N_GET_DEVICE));
}

/* The checks of Dispatch.fast that read no tensor (a blocking call, the
 * group open, no profiler): made first, as an asynchronous call, the most
 * common one declined, needs no more.  1 passed, 0 declined. */
static int call_checks(struct uccl__py_fast *f, uccl__py_fastpath *self, PyObject *opts)
{
    return opts != Py_None && attr_is(f, opts, N_ASYNC, Py_False) && !self->closed &&
           hook_false(f, UCCL__PY_FAST_PROFILING);
}

/* The rest of Dispatch.fast's checks, for tensors (dense CUDA, on device
 * dev) that were checked: the group there, no capture; 0 and the caller's
 * stream (new reference: as StreamWork takes it) in *stream and *caller
 * (as the round takes it), or -1 (decline). */
static int group_checks(struct uccl__py_fast *f, uccl__py_fastpath *self, long long dev,
                        PyObject **stream, uint64_t *caller)
{
    if (dev < 0 || !self->group || dev != self->dev ||
        !hook_false(f, UCCL__PY_FAST_CAPTURING)) /* capturing: the Python path refuses it */
        return -1;
    PyObject *d = PyLong_FromLong(self->dev); /* handed to raw_stream as Dispatch.round does */
    *stream = d ? PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_RAW_STREAM], d, NULL)
                : NULL;
    Py_XDECREF(d);
    if (!*stream || !uccl__py_to_u64(*stream, caller)) {
        soft();
        return -1;
    }
    return 0;
}

/* The round under the token, then its Work (StreamWork(group, k, [result],
 * stream)); the round's error raised; None where the token is taken. */
static PyObject *run(struct uccl__py_fast *f, uccl__py_fastpath *self, PyObject *stream,
                     uint64_t caller, PyObject *result, int which,
                     const struct uccl__py_coll_args *a)
{
    if (uccl__py_token_try(self->token))
        return decline();
    /* held across the round, which lets the GIL go (set_group may run meanwhile) */
    uccl__py_sgroup *c = (uccl__py_sgroup *)Py_NewRef((PyObject *)self->c);
    PyObject *group = Py_NewRef(self->group);
    PyObject *r = uccl__py_sg_fast_round(c, caller, which, a);
    Py_DECREF(c);
    uccl__py_token_give(self->token);
    if (r && PyErr_Occurred()) /* the round ran, but giving the token back was interrupted */
        Py_CLEAR(r);
    PyObject *w = NULL, *lst = r ? PyList_New(1) : NULL;
    if (lst) {
        PyList_SetItem(lst, 0, Py_NewRef(result));
        w = PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_WORK], group, r, lst, stream, NULL);
    }
    Py_DECREF(group);
    Py_XDECREF(lst);
    Py_XDECREF(r);
    return w;
}

/* The integer t.name(), or -1 (soft()). */
static long long ll_of(struct uccl__py_fast *f, PyObject *t, int name)
{
    return PyErr_Occurred() ? -1 : as_ll(call0(f, t, name));
}

/* The engine's (dtype, operator) codes cached by Dispatch.kernel_codes for
 * (hash(opts.reduceOp), t.dtype): 0, or -1 where none are (decline). */
static int red_codes(struct uccl__py_fast *f, uccl__py_fastpath *self, PyObject *opts,
                     PyObject *t, int *dtype, int *op)
{
    int rc = -1;
    PyObject *ro = NULL, *dt = NULL, *hv = NULL, *key = NULL;
    Py_hash_t h;
    if (!(ro = get(f, opts, N_REDUCE_OP)) || (h = PyObject_Hash(ro)) == -1 ||
        !(dt = get(f, t, N_DTYPE)) || !(hv = PyLong_FromSsize_t(h)) ||
        !(key = PyTuple_Pack(2, hv, dt)))
        goto out;
    PyObject *codes = PyDict_GetItemWithError(self->codes, key); /* borrowed */
    if (codes && PyTuple_Check(codes) && PyTuple_Size(codes) == 2) {
        long long a = as_ll(Py_NewRef(PyTuple_GetItem(codes, 0)));
        long long b = as_ll(Py_NewRef(PyTuple_GetItem(codes, 1)));
        if (a >= 0 && a <= INT32_MAX && b >= 0 && b <= INT32_MAX && !PyErr_Occurred()) {
            *dtype = (int)a;
            *op = (int)b;
            rc = 0;
        }
    }
out:
    soft();
    Py_XDECREF(key);
    Py_XDECREF(hv);
    Py_XDECREF(dt);
    Py_XDECREF(ro);
    return rc;
}

/* allreduce(tensors, opts) -> StreamWork, or None: take the dispatch's next row */
static PyObject *FP_allreduce(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "allreduce(tensors, opts): %zd arguments", nargs);
    PyObject *ts = args[0], *opts = args[1];
    struct uccl__py_fast *f = fast_of(self);
    if (!f || !PyList_Check(ts) || PyList_Size(ts) != 1)
        Py_RETURN_NONE;
    if (!call_checks(f, self, opts))
        return decline();
    PyObject *t = Py_NewRef(PyList_GetItem(ts, 0)), *w = NULL; /* ours: the list may change */
    PyObject *stream = NULL;
    uint64_t caller = 0;
    struct uccl__py_coll_args a = {0};
    long long ptr = -1, n = -1;
    if (!group_checks(f, self, dense_cuda(f, t), &stream, &caller) &&
        !red_codes(f, self, opts, t, &a.dtype, &a.op) &&
        (ptr = ll_of(f, t, N_DATA_PTR)) >= 0 && (n = ll_of(f, t, N_NUMEL)) >= 0) {
        a.a = (uintptr_t)ptr;
        a.count = (size_t)n;
        w = run(f, self, stream, caller, t, UCCL__PY_FAST_ALLREDUCE, &a);
    } else {
        w = decline();
    }
    Py_XDECREF(stream);
    Py_DECREF(t);
    return w;
}

/* t.shape[0], or -1 (no dimension, or soft()) */
static long long dim0(struct uccl__py_fast *f, PyObject *t)
{
    PyObject *sh = PyErr_Occurred() ? NULL : get(f, t, N_SHAPE);
    long long v = -1;
    if (sh && PyTuple_Check(sh) && PyTuple_Size(sh) >= 1)
        v = as_ll(Py_NewRef(PyTuple_GetItem(sh, 0)));
    Py_XDECREF(sh);
    return v;
}

/* What allgather and all_to_all read of (output, input, opts), checked:
 * both dense CUDA tensors on the group's device, of one dtype; their
 * element counts, the input's element size and both data pointers. */
struct out_in {
    struct uccl__py_fast *f;
    PyObject *out, *stream;
    uint64_t caller;
    long long no, ni, es, src, dst;
};

/* 1: *c filled (the caller releases c->stream), else the answer to return
 * (NULL with an error set, or None: not this path) in *res. */
static int out_in_of(uccl__py_fastpath *self, PyObject *const *args, Py_ssize_t nargs,
                     const char *name, struct out_in *c, PyObject **res)
{
    if (nargs != 3) {
        *res = PyErr_Format(PyExc_TypeError, "%s(output, input, opts): %zd arguments", name,
                            nargs);
        return 0;
    }
    PyObject *out = args[0], *inp = args[1], *opts = args[2];
    struct uccl__py_fast *f = fast_of(self);
    if (!f) {
        *res = Py_NewRef(Py_None);
        return 0;
    }
    *c = (struct out_in){.f = f, .out = out};
    long long dev;
    if (!call_checks(f, self, opts) || (dev = dense_cuda(f, out)) < 0 || PyErr_Occurred() ||
        dense_cuda(f, inp) != dev || group_checks(f, self, dev, &c->stream, &c->caller)) {
        Py_CLEAR(c->stream);
        *res = decline();
        return 0;
    }
    PyObject *dto = get(f, out, N_DTYPE), *dti = dto ? get(f, inp, N_DTYPE) : NULL;
    int same = dto && dto == dti;
    Py_XDECREF(dto);
    Py_XDECREF(dti);
    c->no = ll_of(f, out, N_NUMEL);
    c->ni = ll_of(f, inp, N_NUMEL);
    c->es = ll_of(f, inp, N_ELEMENT_SIZE);
    c->src = ll_of(f, inp, N_DATA_PTR);
    c->dst = ll_of(f, out, N_DATA_PTR);
    if (!same || c->no < 0 || c->ni < 0 || c->es <= 0 || c->src < 0 || c->dst < 0 ||
        self->size < 1 || (unsigned long long)c->ni > UINT64_MAX / (unsigned long long)c->es) {
        Py_CLEAR(c->stream);
        *res = decline();
        return 0;
    }
    return 1;
}

/* allgather(output, input, opts) -> StreamWork, or None */
static PyObject *FP_allgather(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    struct out_in c;
    PyObject *w = NULL;
    if (!out_in_of(self, args, nargs, "allgather", &c, &w))
        return w;
    long long world = self->size;
    if (c.no % world == 0 && c.no / world == c.ni) {
        struct uccl__py_coll_args a = {.a = (uintptr_t)c.src, .b = (uintptr_t)c.dst,
                                       .count = (size_t)c.ni * (size_t)c.es};
        w = run(c.f, self, c.stream, c.caller, c.out, UCCL__PY_FAST_ALLGATHER, &a);
    } else {
        w = decline();
    }
    Py_XDECREF(c.stream);
    return w;
}

/* all_to_all(output, input, opts) -> StreamWork, or None: all_to_all_single
 * with no split sizes (the backend calls it only then): dim 0 of both
 * divisible by the group's size, the same dtype and element count, so
 * chunk r of each is numel / size elements at r x that */
static PyObject *FP_all_to_all(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    struct out_in c;
    PyObject *w = NULL;
    if (!out_in_of(self, args, nargs, "all_to_all", &c, &w))
        return w;
    long long world = self->size, d0 = dim0(c.f, c.out), d1 = dim0(c.f, args[1]);
    if (c.no == c.ni && d0 > 0 && d1 > 0 && d0 % world == 0 && d1 % world == 0) {
        struct uccl__py_coll_args a = {.a = (uintptr_t)c.src, .b = (uintptr_t)c.dst,
                                       .count = (size_t)(c.ni / world) * (size_t)c.es};
        w = run(c.f, self, c.stream, c.caller, c.out, UCCL__PY_FAST_ALL_TO_ALL, &a);
    } else {
        w = decline();
    }
    Py_XDECREF(c.stream);
    return w;
}

/* ---- the state the dispatch keeps --------------------------------------------------- */

/* set_group(group, c, dev): the group's stream group (the Python StreamGroup,
 * its engine object, its device); set_group(None, None, -1): none */
static PyObject *FP_set_group(PyObject *op, PyObject *args)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    if (!self->module)
        return PyErr_Format(PyExc_RuntimeError, "FastPath.__init__ was not called");
    PyObject *group, *c;
    int dev;
    if (!PyArg_ParseTuple(args, "OOi:set_group", &group, &c, &dev))
        return NULL;
    if (group == Py_None) {
        Py_CLEAR(self->group);
        Py_CLEAR(self->c);
        self->dev = -1;
        Py_RETURN_NONE;
    }
    PyObject *sg_type = uccl__py_state_of(self->module)->sg_type;
    if (!PyObject_TypeCheck(c, (PyTypeObject *)sg_type))
        return PyErr_Format(PyExc_TypeError, "set_group: %R is not a StreamGroup of the engine",
                            c);
    if (dev < 0)
        return PyErr_Format(PyExc_ValueError, "set_group: device %d", dev);
    PyObject *old_g = self->group, *old_c = (PyObject *)self->c;
    self->group = Py_NewRef(group);
    self->c = (uccl__py_sgroup *)Py_NewRef(c);
    self->dev = dev;
    Py_XDECREF(old_g);
    Py_XDECREF(old_c);
    Py_RETURN_NONE;
}

static int FP_init(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    static char *kwlist[] = {"token", "size", NULL};
    PyObject *tok;
    long long size;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OL:FastPath", kwlist, &tok, &size))
        return -1;
    if (self->module) {
        PyErr_SetString(PyExc_RuntimeError, "FastPath.__init__ called twice");
        return -1;
    }
    if (!(self->module = uccl__py_module_of(Py_TYPE(op))))
        return -1;
    if (!PyObject_TypeCheck(tok, (PyTypeObject *)uccl__py_state_of(self->module)->token_type)) {
        PyErr_Format(PyExc_TypeError, "FastPath: %R is not a Token", tok);
        return -1;
    }
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "FastPath: a group of %lld", size);
        return -1;
    }
    if (!(self->codes = PyDict_New()))
        return -1;
    self->token = (uccl__py_token *)Py_NewRef(tok);
    self->size = size;
    self->dev = -1;
    return 0;
}

static int FP_traverse(PyObject *op, visitproc visit, void *arg)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->module);
    Py_VISIT(self->token);
    Py_VISIT(self->group);
    Py_VISIT(self->c);
    Py_VISIT(self->codes);
    return 0;
}

static int FP_clear(PyObject *op)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    Py_CLEAR(self->token);
    Py_CLEAR(self->group);
    Py_CLEAR(self->c);
    Py_CLEAR(self->codes);
    Py_CLEAR(self->module);
    return 0;
}

static void FP_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    FP_clear(op);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static PyObject *get_closed(PyObject *op, void *unused)
{
    (void)unused;
    return PyBool_FromLong(((uccl__py_fastpath *)op)->closed);
}

static int set_closed(PyObject *op, PyObject *v, void *unused)
{
    (void)unused;
    int b = v ? PyObject_IsTrue(v) : -1;
    if (b < 0) {
        if (!v)
            PyErr_SetString(PyExc_AttributeError, "closed cannot be deleted");
        return -1;
    }
    ((uccl__py_fastpath *)op)->closed = b;
    return 0;
}

/* codes, token, group: the fields (read-only; codes is the dict itself) */
static PyObject *get_field(PyObject *op, void *which)
{
    uccl__py_fastpath *self = (uccl__py_fastpath *)op;
    PyObject *v = which == (void *)0 ? self->codes
                  : which == (void *)1 ? (PyObject *)self->token : self->group;
    return Py_NewRef(v ? v : Py_None);
}

static PyGetSetDef FP_getset[] = {
    {"closed", get_closed, set_closed, "the group is shut down: every call declines", NULL},
    {"codes", get_field, NULL, "(hash(reduceOp), dtype) -> the kernel's (dtype, op) codes, or ()",
     (void *)0},
    {"token", get_field, NULL, "the runner's Token", (void *)1},
    {"group", get_field, NULL, "the stream group set by set_group, or None", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef FP_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))FP_allreduce, METH_FASTCALL,
     "allreduce(tensors, opts) -> the blocking CUDA all_reduce's Work, or None"},
    {"allgather", (PyCFunction)(void (*)(void))FP_allgather, METH_FASTCALL,
     "allgather(out, inp, opts) -> the blocking CUDA all_gather_into_tensor's Work, or None"},
    {"all_to_all", (PyCFunction)(void (*)(void))FP_all_to_all, METH_FASTCALL,
     "all_to_all(output, input, opts) -> StreamWork, or None (all_to_all_single, no splits)"},
    {"set_group", FP_set_group, METH_VARARGS,
     "set_group(group, c, dev): the stream group (set_group(None, None, -1): none)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot FP_slots[] = {
    {Py_tp_init, FP_init},
    {Py_tp_dealloc, FP_dealloc},
    {Py_tp_traverse, FP_traverse},
    {Py_tp_clear, FP_clear},
    {Py_tp_methods, FP_methods},
    {Py_tp_getset, FP_getset},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "FastPath(token, size): a process group's blocking CUDA all_reduce and "
                "all_gather_into_tensor in one call."},
    {0, NULL},
};

PyType_Spec uccl__py_fastpath_spec = {
    .name = "uccl_collective._engine.FastPath",
    .basicsize = sizeof(uccl__py_fastpath),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = FP_slots,
};
