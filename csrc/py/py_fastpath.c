/* The "uccl" backend's blocking all_reduce and all_gather_into_tensor on
 * CUDA tensors in one C call (uccl_collective/backend.py: allreduce and
 * _allgather_base call fast_allreduce / fast_allgather first).
 *
 * Why C: for a small tensor the host's time is the call.  On one H100
 * shared by 2 processes under MPS a 1 MiB all_reduce's launches run at
 * 10.6 us a call, and the Python fast path (its checks, the runner's token,
 * the Work) took the host to 15-16 us (BENCHMARKS.md, session 11).
 *
 * What it does is exactly that Python path's common case, nothing more:
 * the same checks (_fast, _fast_red: a blocking call, no profiler, the
 * group open, dense contiguous CUDA tensors on the group's device, no
 * graph capture, an operator and dtype whose kernel codes the group has
 * cached), the runner's token taken and given back under its lock as
 * Runner.inline does, the engine's round on the caller's stream, and the
 * StreamWork.  Wherever anything differs (the first call, which makes the
 * stream group and caches the codes; a task queued; a capture, which must
 * raise; an attribute missing) it returns None and the caller takes the
 * Python path, which decides and raises as before.  Raised here: the
 * round's own error, as the Python path would raise it, and an exception
 * that is not an Exception (KeyboardInterrupt, SystemExit) raised by
 * anything it calls, which is never swallowed.
 *
 * torch is reached only through its Python objects, given once by
 * fast_setup() (this module never links against libtorch); a test that
 * patches torch.cuda or backend.py's module globals does not reach this
 * path, only fast_setup() does. */
#include "py/pyengine.h"

#include "sg/sgroup.h"

/* attribute and method names, interned once */
enum {
    N_ASYNC, N_REDUCE_OP, N_CLOSED, N_SG, N_RUNNER, N_RED_CODES, N_C, N_DEV, N_IS_CUDA,
    N_LAYOUT, N_IS_CONTIGUOUS, N_GET_DEVICE, N_DTYPE, N_DATA_PTR, N_NUMEL, N_ELEMENT_SIZE,
    N_CV, N_BUSY, N_Q, N_POISONED, N_ACQUIRE, N_RELEASE, N_NOTIFY_ALL, N_SIZE, N_COUNT
};
_Static_assert(N_COUNT == UCCL__PY_FAST_NAMES, "struct uccl__py_fast's names");
static const char *const names[N_COUNT] = {
    "asyncOp", "reduceOp", "_closed", "_sg", "_runner", "_red_codes", "c", "dev", "is_cuda",
    "layout", "is_contiguous", "get_device", "dtype", "data_ptr", "numel", "element_size",
    "_cv", "_busy", "_q", "_poisoned", "acquire", "release", "notify_all", "size",
};

/* The module's state where fast_setup() ran, else NULL. */
static uccl__py_state *fast_of(PyObject *module)
{
    uccl__py_state *st = PyModule_GetState(module);
    return st->fast.hook[UCCL__PY_FAST_WORK] ? st : NULL;
}

/* fast_setup(tensor_type, strided, profiler_enabled, capturing, raw_stream, work_type).
 * The hooks it replaces are kept (in `retired`) for good: a call on
 * another thread may be using them, and this runs a few times at most. */
PyObject *uccl__py_fast_setup(PyObject *module, PyObject *args)
{
    struct uccl__py_fast *f = &((uccl__py_state *)PyModule_GetState(module))->fast;
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

/* Whether o.name is false (0 also when it cannot be read). */
static int attr_false(struct uccl__py_fast *f, PyObject *o, int name)
{
    PyObject *a = get(f, o, name);
    if (!a)
        return 0;
    int t = PyObject_IsTrue(a);
    Py_DECREF(a);
    if (t < 0)
        soft();
    return t == 0;
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

/* What one call needs, gathered by the checks (new references; zeroed
 * before them). */
struct call {
    PyObject *sg, *c, *runner, *cv; /* cv: Runner._cv, whose acquire and release are its lock's */
    PyObject *stream;               /* the caller's raw stream, as StreamWork takes it */
    uint64_t caller;                /* ... as the round takes it */
};

static void call_free(struct call *k)
{
    Py_XDECREF(k->sg);
    Py_XDECREF(k->c);
    Py_XDECREF(k->runner);
    Py_XDECREF(k->cv);
    Py_XDECREF(k->stream);
}

/* The checks of backend._fast that read no tensor (a blocking call, the
 * group open, no profiler): made first, as an asynchronous call, the most
 * common one declined, needs no more.  1 passed, 0 declined. */
static int call_checks(struct uccl__py_fast *f, PyObject *pg, PyObject *opts)
{
    return opts != Py_None && attr_is(f, opts, N_ASYNC, Py_False) &&
           attr_false(f, pg, N_CLOSED) && hook_false(f, UCCL__PY_FAST_PROFILING);
}

/* The rest of backend._fast's checks, for tensors (dense CUDA, on device
 * dev) that were checked: 0 and *k filled, or -1 (decline). */
static int group_checks(uccl__py_state *st, PyObject *pg, long long dev, struct call *k)
{
    struct uccl__py_fast *f = &st->fast;
    if (dev < 0 || !(k->sg = get(f, pg, N_SG)) || k->sg == Py_None)
        return -1;
    PyObject *d = get(f, k->sg, N_DEV); /* sg.dev, handed to raw_stream as _streamed does */
    long long sg_dev = d && PyLong_Check(d) ? PyLong_AsLongLong(d) : -1;
    if (sg_dev != dev || !(k->c = get(f, k->sg, N_C)) ||
        !PyObject_TypeCheck(k->c, (PyTypeObject *)st->sg_type) ||
        !hook_false(f, UCCL__PY_FAST_CAPTURING)) { /* capturing: the Python path refuses it */
        Py_XDECREF(d);
        soft();
        return -1;
    }
    k->stream = PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_RAW_STREAM], d, NULL);
    Py_DECREF(d);
    if (!k->stream || !uccl__py_to_u64(k->stream, &k->caller)) {
        soft();
        return -1;
    }
    if (!(k->runner = get(f, pg, N_RUNNER)))
        return -1;
    return (k->cv = get(f, k->runner, N_CV)) ? 0 : -1;
}

/* The error set now, if any, kept in *e (the first one wins; later ones
 * are dropped). */
struct err {
    PyObject *t, *v, *tb;
};

static void keep(struct err *e)
{
    if (!PyErr_Occurred())
        return;
    if (e->t) {
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&e->t, &e->v, &e->tb);
}

/* Runner.inline's first half: the token, when nothing of the group is
 * queued or running and it is open; 0 taken, -1 declined.  The lock is
 * only tried: a holder is running or queueing a task, so decline. */
static int take_token(struct uccl__py_fast *f, PyObject *runner, PyObject *cv)
{
    PyObject *got = PyObject_CallMethodObjArgs(cv, f->name[N_ACQUIRE], Py_False, NULL);
    Py_XDECREF(got);
    if (got != Py_True) {
        if (!got)
            soft();
        return -1;
    }
    int free = attr_false(f, runner, N_BUSY) && attr_false(f, runner, N_Q) &&
               attr_false(f, runner, N_CLOSED) && attr_false(f, runner, N_POISONED);
    if (free && PyObject_SetAttr(runner, f->name[N_BUSY], Py_True) < 0) {
        soft();
        free = 0;
    }
    struct err e = {0};
    keep(&e); /* (an interrupt while reading: released first, then raised) */
    PyObject *r = PyObject_CallMethodObjArgs(cv, f->name[N_RELEASE], NULL);
    Py_XDECREF(r);
    keep(&e);
    if (e.t) {
        if (free) /* not keeping it: nothing ran */
            (void)PyObject_SetAttr(runner, f->name[N_BUSY], Py_False);
        PyErr_Restore(e.t, e.v, e.tb);
        return -1;
    }
    return free ? 0 : -1;
}

/* Its second half, as inline's `finally`: the token given back and
 * whoever waits for it woken (only a queued task does).  An error in
 * this part replaces the round's, as in Python; else the round's stays.
 * The lock's acquire is retried: a signal handler may interrupt it. */
static void give_token(struct uccl__py_fast *f, PyObject *runner, PyObject *cv)
{
    struct err round = {0}, e = {0};
    PyErr_Fetch(&round.t, &round.v, &round.tb);
    PyObject *got = NULL;
    for (int tries = 0; !got && tries < 100; tries++)
        if (!(got = PyObject_CallMethodObjArgs(cv, f->name[N_ACQUIRE], NULL)))
            keep(&e);
    if (PyObject_SetAttr(runner, f->name[N_BUSY], Py_False) < 0) /* (no lock: still freed) */
        keep(&e);
    if (got) {
        if (!attr_false(f, runner, N_Q)) {
            keep(&e);
            PyObject *n = PyObject_CallMethodObjArgs(cv, f->name[N_NOTIFY_ALL], NULL);
            Py_XDECREF(n);
        }
        keep(&e);
        PyObject *r = PyObject_CallMethodObjArgs(cv, f->name[N_RELEASE], NULL);
        Py_XDECREF(r);
        keep(&e);
    }
    Py_XDECREF(got);
    if (e.t) {
        Py_XDECREF(round.t);
        Py_XDECREF(round.v);
        Py_XDECREF(round.tb);
        PyErr_Restore(e.t, e.v, e.tb);
    } else {
        PyErr_Restore(round.t, round.v, round.tb);
    }
}

/* The round under the token, then its Work (StreamWork(sg, k, [result],
 * caller)); the round's error raised; None where the token is taken. */
static PyObject *run(struct uccl__py_fast *f, struct call *k, PyObject *result, int gather,
                     const struct uccl__py_coll_args *a)
{
    if (take_token(f, k->runner, k->cv))
        return decline();
    PyObject *r = uccl__py_sg_fast_round((uccl__py_sgroup *)k->c, k->caller, gather, a);
    give_token(f, k->runner, k->cv);
    if (r && PyErr_Occurred()) /* the round ran, but giving the token back was interrupted */
        Py_CLEAR(r);
    PyObject *w = NULL, *lst = r ? PyList_New(1) : NULL;
    if (lst) {
        PyList_SetItem(lst, 0, Py_NewRef(result));
        w = PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_WORK], k->sg, r, lst, k->stream,
                                         NULL);
    }
    Py_XDECREF(lst);
    Py_XDECREF(r);
    return w;
}

/* The integer t.name(), or -1 (soft()). */
static long long ll_of(struct uccl__py_fast *f, PyObject *t, int name)
{
    return PyErr_Occurred() ? -1 : as_ll(call0(f, t, name));
}

/* The engine's (dtype, operator) codes cached by backend._fast_red for
 * (hash(opts.reduceOp), t.dtype): 0, or -1 where none are (decline). */
static int red_codes(struct uccl__py_fast *f, PyObject *pg, PyObject *opts, PyObject *t,
                     int *dtype, int *op)
{
    int rc = -1;
    PyObject *ro = NULL, *dt = NULL, *cache = NULL, *hv = NULL, *key = NULL;
    Py_hash_t h;
    if (!(ro = get(f, opts, N_REDUCE_OP)) || (h = PyObject_Hash(ro)) == -1 ||
        !(dt = get(f, t, N_DTYPE)) || !(cache = get(f, pg, N_RED_CODES)) ||
        !PyDict_Check(cache) || !(hv = PyLong_FromSsize_t(h)) ||
        !(key = PyTuple_Pack(2, hv, dt)))
        goto out;
    PyObject *codes = PyDict_GetItemWithError(cache, key); /* borrowed */
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
    Py_XDECREF(cache);
    Py_XDECREF(dt);
    Py_XDECREF(ro);
    return rc;
}

/* fast_allreduce(pg, tensors, opts) -> StreamWork, or None: take the Python path */
PyObject *uccl__py_fast_allreduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_state *st = fast_of(module);
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "fast_allreduce(pg, tensors, opts): %zd arguments",
                            nargs);
    PyObject *pg = args[0], *ts = args[1], *opts = args[2];
    if (!st || !PyList_Check(ts) || PyList_Size(ts) != 1)
        Py_RETURN_NONE;
    struct uccl__py_fast *f = &st->fast;
    if (!call_checks(f, pg, opts))
        return decline();
    PyObject *t = Py_NewRef(PyList_GetItem(ts, 0)), *w = NULL; /* ours: the list may change */
    struct call k = {0};
    struct uccl__py_coll_args a = {0};
    long long ptr = -1, n = -1;
    if (!group_checks(st, pg, dense_cuda(f, t), &k) &&
        !red_codes(f, pg, opts, t, &a.dtype, &a.op) &&
        (ptr = ll_of(f, t, N_DATA_PTR)) >= 0 && (n = ll_of(f, t, N_NUMEL)) >= 0) {
        a.a = (uintptr_t)ptr;
        a.count = (size_t)n;
        w = run(f, &k, t, 0, &a);
    } else {
        w = decline();
    }
    call_free(&k);
    Py_DECREF(t);
    return w;
}

/* fast_allgather(pg, output, input, opts) -> StreamWork, or None */
PyObject *uccl__py_fast_allgather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_state *st = fast_of(module);
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError,
                            "fast_allgather(pg, output, input, opts): %zd arguments", nargs);
    PyObject *pg = args[0], *out = args[1], *inp = args[2], *opts = args[3];
    if (!st)
        Py_RETURN_NONE;
    struct uccl__py_fast *f = &st->fast;
    if (!call_checks(f, pg, opts))
        return decline();
    struct call k = {0};
    long long dev = dense_cuda(f, out);
    if (dev < 0 || PyErr_Occurred() || dense_cuda(f, inp) != dev ||
        group_checks(st, pg, dev, &k)) {
        call_free(&k);
        return decline();
    }
    PyObject *dto = get(f, out, N_DTYPE), *dti = dto ? get(f, inp, N_DTYPE) : NULL;
    int same = dto && dto == dti;
    Py_XDECREF(dto);
    Py_XDECREF(dti);
    long long no = ll_of(f, out, N_NUMEL), ni = ll_of(f, inp, N_NUMEL);
    long long es = ll_of(f, inp, N_ELEMENT_SIZE), src = ll_of(f, inp, N_DATA_PTR);
    long long dst = ll_of(f, out, N_DATA_PTR);
    long long world = ll_of(f, pg, N_SIZE);
    PyObject *w;
    if (same && no >= 0 && ni >= 0 && es > 0 && src >= 0 && dst >= 0 && world >= 1 &&
        no % world == 0 && no / world == ni && (unsigned long long)ni <= UINT64_MAX / (unsigned long long)es) {
        struct uccl__py_coll_args a = {.a = (uintptr_t)src, .b = (uintptr_t)dst,
                                       .count = (size_t)ni * (size_t)es};
        w = run(f, &k, out, 1, &a);
    } else {
        w = decline();
    }
    call_free(&k);
    return w;
}
