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
 * Python path, which decides and raises as before.  Only the round's own
 * error is raised here, as the Python path would raise it.
 *
 * torch is reached only through its Python objects, given once by
 * fast_setup() (this module never links against libtorch). */
#include "pyengine.h"

#include "sgroup.h"

/* attribute and method names, interned once */
enum {
    N_ASYNC, N_REDUCE_OP, N_CLOSED, N_SG, N_RUNNER, N_RED_CODES, N_C, N_DEV, N_IS_CUDA,
    N_LAYOUT, N_IS_CONTIGUOUS, N_GET_DEVICE, N_DTYPE, N_DATA_PTR, N_NUMEL, N_ELEMENT_SIZE,
    N_CV, N_LOCK, N_BUSY, N_Q, N_POISONED, N_ACQUIRE, N_RELEASE, N_NOTIFY_ALL, N_COUNT
};
_Static_assert(N_COUNT <= UCCL__PY_FAST_NAMES, "struct uccl__py_fast's names");
static const char *const names[N_COUNT] = {
    "asyncOp", "reduceOp", "_closed", "_sg", "_runner", "_red_codes", "c", "dev", "is_cuda",
    "layout", "is_contiguous", "get_device", "dtype", "data_ptr", "numel", "element_size",
    "_cv", "_lock", "_busy", "_q", "_poisoned", "acquire", "release", "notify_all",
};

static struct uccl__py_fast *fast_of(PyObject *module)
{
    struct uccl__py_fast *f = &((uccl__py_state *)PyModule_GetState(module))->fast;
    return f->hook[UCCL__PY_FAST_WORK] ? f : NULL;
}

/* fast_setup(tensor_type, strided, profiler_enabled, capturing, raw_stream, work_type) */
PyObject *uccl__py_fast_setup(PyObject *module, PyObject *args)
{
    struct uccl__py_fast *f = &((uccl__py_state *)PyModule_GetState(module))->fast;
    PyObject *h[UCCL__PY_FAST_HOOKS];
    if (!PyArg_ParseTuple(args, "OOOOOO:fast_setup", &h[0], &h[1], &h[2], &h[3], &h[4], &h[5]))
        return NULL;
    for (int i = 0; i < N_COUNT; i++)
        if (!f->name[i] && !(f->name[i] = PyUnicode_InternFromString(names[i])))
            return NULL;
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++) {
        PyObject *old = f->hook[i];
        Py_INCREF(h[i]);
        f->hook[i] = h[i];
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}

int uccl__py_fast_traverse(struct uccl__py_fast *f, visitproc visit, void *arg)
{
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++)
        Py_VISIT(f->hook[i]);
    return 0;
}

void uccl__py_fast_clear(struct uccl__py_fast *f)
{
    for (int i = 0; i < UCCL__PY_FAST_HOOKS; i++)
        Py_CLEAR(f->hook[i]);
    for (int i = 0; i < N_COUNT; i++)
        Py_CLEAR(f->name[i]);
}

/* o.name (a new reference), or NULL with the error cleared. */
static PyObject *get(struct uccl__py_fast *f, PyObject *o, int name)
{
    PyObject *v = PyObject_GetAttr(o, f->name[name]);
    if (!v)
        PyErr_Clear();
    return v;
}

/* o.name() (a new reference), or NULL with the error cleared. */
static PyObject *call0(struct uccl__py_fast *f, PyObject *o, int name)
{
    PyObject *v = PyObject_CallMethodObjArgs(o, f->name[name], NULL);
    if (!v)
        PyErr_Clear();
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
        PyErr_Clear();
    return t == 0;
}

/* A non-negative integer, or -1 (error cleared); steals o. */
static long long as_ll(PyObject *o)
{
    if (!o)
        return -1;
    long long v = PyLong_Check(o) ? PyLong_AsLongLong(o) : -1;
    Py_DECREF(o);
    if (v < 0 && PyErr_Occurred())
        PyErr_Clear();
    return v < 0 ? -1 : v;
}

/* t's CUDA device if t is a dense contiguous CUDA tensor, else -1. */
static long long dense_cuda(struct uccl__py_fast *f, PyObject *t)
{
    int ok = PyObject_IsInstance(t, f->hook[UCCL__PY_FAST_TENSOR]);
    if (ok <= 0) {
        if (ok < 0)
            PyErr_Clear();
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

/* What one call needs, gathered by the checks (borrowed from pg, or owned
 * where noted). */
struct call {
    PyObject *sg, *c, *runner; /* owned */
    long long dev;
    uint64_t caller;
};

static void call_free(struct call *k)
{
    Py_XDECREF(k->sg);
    Py_XDECREF(k->c);
    Py_XDECREF(k->runner);
}

/* The checks of backend._fast for a blocking call whose tensors (dense
 * CUDA, on device dev) were checked: 0 and *k filled, or -1 (decline). */
static int group_checks(PyObject *module, struct uccl__py_fast *f, PyObject *pg, PyObject *opts,
                        long long dev, struct call *k)
{
    memset(k, 0, sizeof(*k));
    if (dev < 0 || opts == Py_None || !attr_is(f, opts, N_ASYNC, Py_False) ||
        !attr_false(f, pg, N_CLOSED))
        return -1;
    PyObject *prof = PyObject_CallNoArgs(f->hook[UCCL__PY_FAST_PROFILING]);
    Py_XDECREF(prof);
    if (prof != Py_False) {
        PyErr_Clear();
        return -1;
    }
    k->sg = get(f, pg, N_SG);
    if (!k->sg || k->sg == Py_None || as_ll(get(f, k->sg, N_DEV)) != dev)
        return -1;
    k->c = get(f, k->sg, N_C);
    uccl__py_state *st = PyModule_GetState(module);
    if (!k->c || !PyObject_TypeCheck(k->c, (PyTypeObject *)st->sg_type))
        return -1;
    PyObject *cap = PyObject_CallNoArgs(f->hook[UCCL__PY_FAST_CAPTURING]);
    Py_XDECREF(cap);
    if (cap != Py_False) { /* capturing: the Python path refuses it */
        PyErr_Clear();
        return -1;
    }
    PyObject *d = PyLong_FromLongLong(dev);
    PyObject *s = d ? PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_RAW_STREAM], d, NULL)
                    : NULL;
    Py_XDECREF(d);
    if (!s || !uccl__py_to_u64(s, &k->caller)) {
        Py_XDECREF(s);
        PyErr_Clear();
        return -1;
    }
    Py_DECREF(s);
    k->runner = get(f, pg, N_RUNNER);
    return k->runner ? 0 : -1;
}

/* The runner's lock (Runner._cv's), a new reference, or NULL. */
static PyObject *runner_lock(struct uccl__py_fast *f, PyObject *runner)
{
    PyObject *cv = get(f, runner, N_CV);
    PyObject *lock = cv ? get(f, cv, N_LOCK) : NULL;
    Py_XDECREF(cv);
    return lock;
}

/* Runner.inline's first half: the token, when nothing of the group is
 * queued or running and it is open; 0 taken, -1 declined.  The lock is
 * only tried: a holder is running or queueing a task, so decline. */
static int take_token(struct uccl__py_fast *f, PyObject *runner)
{
    PyObject *lock = runner_lock(f, runner);
    if (!lock)
        return -1;
    PyObject *got = PyObject_CallMethodObjArgs(lock, f->name[N_ACQUIRE], Py_False, NULL);
    Py_XDECREF(got);
    if (got != Py_True) {
        PyErr_Clear();
        Py_DECREF(lock);
        return -1;
    }
    int free = attr_false(f, runner, N_BUSY) && attr_false(f, runner, N_Q) &&
               attr_false(f, runner, N_CLOSED) && attr_false(f, runner, N_POISONED);
    if (free && PyObject_SetAttr(runner, f->name[N_BUSY], Py_True) < 0) {
        PyErr_Clear();
        free = 0;
    }
    PyObject *r = PyObject_CallMethodObjArgs(lock, f->name[N_RELEASE], NULL);
    Py_XDECREF(r);
    Py_DECREF(lock);
    if (!r)
        PyErr_Clear();
    return free ? 0 : -1;
}

/* Its second half: give the token back and wake whoever waits for it
 * (only a queued task does).  Keeps the exception set by the round. */
static void give_token(struct uccl__py_fast *f, PyObject *runner)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *lock = runner_lock(f, runner);
    PyObject *got = lock ? PyObject_CallMethodObjArgs(lock, f->name[N_ACQUIRE], NULL) : NULL;
    if (got) {
        if (PyObject_SetAttr(runner, f->name[N_BUSY], Py_False) < 0)
            PyErr_Clear();
        if (!attr_false(f, runner, N_Q)) {
            PyObject *cv = get(f, runner, N_CV);
            PyObject *n = cv ? PyObject_CallMethodObjArgs(cv, f->name[N_NOTIFY_ALL], NULL) : NULL;
            Py_XDECREF(n);
            Py_XDECREF(cv);
        }
        PyObject *r = PyObject_CallMethodObjArgs(lock, f->name[N_RELEASE], NULL);
        Py_XDECREF(r);
    } else if (PyObject_SetAttr(runner, f->name[N_BUSY], Py_False) < 0) {
        PyErr_Clear(); /* no lock to take (cannot happen): free it anyway */
    }
    Py_XDECREF(got);
    Py_XDECREF(lock);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* The round under the token, then its Work (StreamWork(sg, k, [result],
 * caller)); the round's error raised; None where the token is taken. */
static PyObject *run(struct uccl__py_fast *f, struct call *k, PyObject *result,
                     PyObject *(*round)(uccl__py_sgroup *, uint64_t, const uint64_t *),
                     const uint64_t *args)
{
    if (take_token(f, k->runner)) {
        call_free(k);
        Py_RETURN_NONE;
    }
    PyObject *r = round((uccl__py_sgroup *)k->c, k->caller, args);
    give_token(f, k->runner);
    PyObject *w = NULL, *lst = r ? PyList_New(1) : NULL, *caller = NULL;
    if (lst) {
        Py_INCREF(result);
        PyList_SetItem(lst, 0, result);
        caller = PyLong_FromUnsignedLongLong(k->caller);
    }
    if (caller)
        w = PyObject_CallFunctionObjArgs(f->hook[UCCL__PY_FAST_WORK], k->sg, r, lst, caller, NULL);
    Py_XDECREF(caller);
    Py_XDECREF(lst);
    Py_XDECREF(r);
    call_free(k);
    return w;
}

static PyObject *round_allreduce(uccl__py_sgroup *c, uint64_t caller, const uint64_t *a)
{
    return uccl__py_sg_allreduce(c, caller, a[0], a[1], (int)a[2], (int)a[3]);
}

static PyObject *round_allgather(uccl__py_sgroup *c, uint64_t caller, const uint64_t *a)
{
    return uccl__py_sg_allgather(c, caller, a[0], a[1], a[2]);
}

/* The engine's (dtype, operator) codes cached by backend._fast_red for
 * (hash(opts.reduceOp), t.dtype): 0, or -1 where none are (decline). */
static int red_codes(struct uccl__py_fast *f, PyObject *pg, PyObject *opts, PyObject *t,
                     uint64_t *dtype, uint64_t *op)
{
    PyObject *ro = get(f, opts, N_REDUCE_OP), *dt = get(f, t, N_DTYPE);
    PyObject *cache = get(f, pg, N_RED_CODES), *key = NULL, *codes = NULL;
    Py_hash_t h = ro ? PyObject_Hash(ro) : -1;
    if (h != -1 && dt && cache && PyDict_Check(cache)) {
        PyObject *hv = PyLong_FromSsize_t(h);
        key = hv ? PyTuple_Pack(2, hv, dt) : NULL;
        Py_XDECREF(hv);
    }
    if (key)
        codes = PyDict_GetItemWithError(cache, key); /* borrowed */
    int rc = -1;
    if (codes && PyTuple_Check(codes) && PyTuple_Size(codes) == 2) {
        long long a = as_ll(Py_NewRef(PyTuple_GetItem(codes, 0)));
        long long b = as_ll(Py_NewRef(PyTuple_GetItem(codes, 1)));
        if (a >= 0 && b >= 0) {
            *dtype = (uint64_t)a;
            *op = (uint64_t)b;
            rc = 0;
        }
    }
    PyErr_Clear();
    Py_XDECREF(key);
    Py_XDECREF(cache);
    Py_XDECREF(dt);
    Py_XDECREF(ro);
    return rc;
}

/* fast_allreduce(pg, tensors, opts) -> StreamWork, or None: take the Python path */
PyObject *uccl__py_fast_allreduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    struct uccl__py_fast *f = fast_of(module);
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "fast_allreduce(pg, tensors, opts): %zd arguments",
                            nargs);
    PyObject *pg = args[0], *ts = args[1], *opts = args[2];
    if (!f || !PyList_Check(ts) || PyList_Size(ts) != 1)
        Py_RETURN_NONE;
    PyObject *t = PyList_GetItem(ts, 0);
    struct call k;
    uint64_t a[4];
    if (group_checks(module, f, pg, opts, dense_cuda(f, t), &k) ||
        red_codes(f, pg, opts, t, &a[2], &a[3])) {
        call_free(&k);
        Py_RETURN_NONE;
    }
    long long ptr = as_ll(call0(f, t, N_DATA_PTR)), n = as_ll(call0(f, t, N_NUMEL));
    if (ptr < 0 || n < 0) {
        call_free(&k);
        Py_RETURN_NONE;
    }
    a[0] = (uint64_t)ptr;
    a[1] = (uint64_t)n;
    return run(f, &k, t, round_allreduce, a);
}

/* fast_allgather(pg, output, input, opts) -> StreamWork, or None */
PyObject *uccl__py_fast_allgather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    struct uccl__py_fast *f = fast_of(module);
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError,
                            "fast_allgather(pg, output, input, opts): %zd arguments", nargs);
    PyObject *pg = args[0], *out = args[1], *inp = args[2], *opts = args[3];
    if (!f)
        Py_RETURN_NONE;
    long long dev = dense_cuda(f, out);
    if (dev < 0 || dense_cuda(f, inp) != dev)
        Py_RETURN_NONE;
    struct call k;
    if (group_checks(module, f, pg, opts, dev, &k)) {
        call_free(&k);
        Py_RETURN_NONE;
    }
    PyObject *dto = get(f, out, N_DTYPE), *dti = get(f, inp, N_DTYPE);
    int same = dto && dto == dti;
    Py_XDECREF(dto);
    Py_XDECREF(dti);
    long long no = as_ll(call0(f, out, N_NUMEL)), ni = as_ll(call0(f, inp, N_NUMEL));
    long long es = as_ll(call0(f, inp, N_ELEMENT_SIZE));
    long long src = as_ll(call0(f, inp, N_DATA_PTR)), dst = as_ll(call0(f, out, N_DATA_PTR));
    long long world = as_ll(PyObject_CallMethod(pg, "size", NULL));
    if (!same || no < 0 || ni < 0 || es < 0 || src < 0 || dst < 0 || world < 1 ||
        no / world != ni || no % world != 0) {
        call_free(&k);
        Py_RETURN_NONE;
    }
    uint64_t a[3] = {(uint64_t)src, (uint64_t)ni * (uint64_t)es, (uint64_t)dst};
    return run(f, &k, out, round_allgather, a);
}
