/* The Token type (pyengine.h): the execution token of one process group,
 * which whoever runs the group's next call holds (the backend's runner,
 * uccl_collective/backend/_work.py, for a task or an inline call; the C
 * fast path, py_fastpath.c, for its round), so that the group's calls keep
 * their issue order on every rank.
 *
 *   Token(cv, q)
 *
 * cv is the runner's Condition (over its lock), q the runner's queue of
 * tasks waiting for the token; the runner (backend/_work.py's Runner) is a
 * subclass, which passes its own.  The token keeps its own state: taken or
 * not (busy), and why the group refuses new tasks (closed, poisoned: a
 * reason, or None).  Python reads and sets those as attributes while
 * holding the lock; C takes the lock, and wakes the Condition's waiters,
 * through the bound methods taken here once (cv.acquire, cv.release,
 * cv.notify_all: the lock's own acquire and release), so no attribute is
 * looked up by name on a call.
 *
 * Taking it: the lock, then the token only when it is free, nothing is
 * queued, and the group is neither closed nor poisoned.  Giving it back:
 * the lock, busy cleared, and the runner's waiters woken when something is
 * queued (a queued task waits for the token).  run() is Runner.inline,
 * whose lock is taken as `with cv:` takes it (blocking); the fast path only
 * tries the lock (a holder is queueing or running a task: it declines). */
#include "py/pyengine.h"

/* ---- taking and giving back --------------------------------------------------- */

/* Whether o is true: 1 or 0; where that cannot be told, -1 with the error
 * set (strict: Runner.inline's reads, which raise), else an Exception is
 * cleared and counts as true (not free: the fast path declines) and
 * anything else (an interrupt) is kept: -1. */
static int truth(PyObject *o, int strict)
{
    int t = PyObject_IsTrue(o);
    if (t < 0 && !strict && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 1;
    }
    return t;
}

/* Under the lock: the token free to take (0 no, 1 yes, -1 an error set). */
static int is_free(uccl__py_token *t, int strict)
{
    if (t->busy)
        return 0;
    PyObject *busy_if[3] = {t->q, t->closed, t->poisoned};
    for (int i = 0; i < 3; i++) {
        int v = truth(busy_if[i], strict);
        if (v)
            return v < 0 ? -1 : 0;
    }
    return 1;
}

/* The lock: blocking (1 taken, or -1 with an exception set) or tried (1
 * taken, 0 not, -1 an exception). */
static int lock(uccl__py_token *t, int blocking)
{
    PyObject *got = blocking ? PyObject_CallNoArgs(t->acquire)
                             : PyObject_CallFunctionObjArgs(t->acquire, Py_False, NULL);
    if (!got)
        return -1;
    int ok = blocking || got == Py_True;
    Py_DECREF(got);
    return ok;
}

static int unlock(uccl__py_token *t)
{
    PyObject *r = PyObject_CallNoArgs(t->release);
    Py_XDECREF(r);
    return r ? 0 : -1;
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

int uccl__py_token_try(uccl__py_token *t)
{
    if (!t->acquire) /* made by __new__ alone: never free */
        return -1;
    int got = lock(t, 0);
    if (got <= 0) {
        if (got < 0 && PyErr_ExceptionMatches(PyExc_Exception))
            PyErr_Clear(); /* the call declines; the Python path meets it again */
        return -1;
    }
    int free = is_free(t, 0) > 0;
    if (free)
        t->busy = 1;
    struct err e = {0};
    keep(&e); /* (an interrupt while reading: released first, then raised) */
    unlock(t);
    keep(&e);
    if (e.t) {
        if (free) /* not keeping it: nothing ran */
            t->busy = 0;
        PyErr_Restore(e.t, e.v, e.tb);
        return -1;
    }
    return free ? 0 : -1;
}

/* Wake the runner's waiters when a task is queued (under the lock). */
static int wake(uccl__py_token *t)
{
    int q = PyObject_IsTrue(t->q);
    if (q <= 0)
        return q;
    PyObject *r = PyObject_CallNoArgs(t->notify_all);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

void uccl__py_token_give(uccl__py_token *t)
{
    struct err round = {0}, e = {0};
    PyErr_Fetch(&round.t, &round.v, &round.tb);
    int got = -1;
    for (int tries = 0; got < 0 && tries < 100; tries++)
        if ((got = lock(t, 1)) < 0)
            keep(&e);
    t->busy = 0; /* (no lock: still freed) */
    if (got > 0) {
        if (wake(t) < 0)
            keep(&e);
        if (unlock(t) < 0)
            keep(&e);
    }
    if (e.t) {
        Py_XDECREF(round.t);
        Py_XDECREF(round.v);
        Py_XDECREF(round.tb);
        PyErr_Restore(e.t, e.v, e.tb);
    } else {
        PyErr_Restore(round.t, round.v, round.tb);
    }
}

/* run(fn, *args) -> (True, fn(*args)) holding the token, or (False, None)
 * without running fn where it is not free.  Runner.inline's body:
 *     with cv: (declined unless free) busy = True
 *     try: return True, fn(*args)
 *     finally:
 *         with cv: busy = False; if q: cv.notify_all()
 * An error in that `finally` replaces fn's, and leaves busy set where the
 * lock itself could not be taken, as in Python. */
static PyObject *Token_run(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uccl__py_token *t = (uccl__py_token *)op;
    if (nargs < 1)
        return PyErr_Format(PyExc_TypeError, "run(fn, *args): no function");
    if (!t->acquire)
        return PyErr_Format(PyExc_RuntimeError, "the Token's __init__(cv, q), which makes its "
                            "lock, was not called");
    if (lock(t, 1) < 0)
        return NULL;
    int free = is_free(t, 1);
    if (free > 0)
        t->busy = 1;
    struct err e = {0};
    keep(&e);
    unlock(t);
    keep(&e);
    if (e.t) { /* (unlocking a lock this thread holds does not fail; a read did) */
        if (free > 0)
            t->busy = 0;
        PyErr_Restore(e.t, e.v, e.tb);
        return NULL;
    }
    if (!free)
        return Py_BuildValue("(OO)", Py_False, Py_None);
    PyObject *r = NULL, *rest = PyTuple_New(nargs - 1);
    for (Py_ssize_t i = 1; rest && i < nargs; i++)
        PyTuple_SetItem(rest, i - 1, Py_NewRef(args[i])); /* steals the new reference */
    if (rest) {
        r = PyObject_Call(args[0], rest, NULL);
        Py_DECREF(rest);
    }
    struct err fn_err = {0};
    PyErr_Fetch(&fn_err.t, &fn_err.v, &fn_err.tb);
    int ok = lock(t, 1) > 0; /* (an error here keeps busy set, as in Python) */
    if (ok) {
        /* As `with cv:` does: the lock released whatever the wake raised,
         * and that error (not a SystemError from calling release with it
         * set) the one raised. */
        struct err e = {0};
        t->busy = 0;
        if (wake(t) < 0)
            keep(&e);
        if (unlock(t) < 0)
            keep(&e);
        if (e.t) {
            PyErr_Restore(e.t, e.v, e.tb);
            ok = 0;
        }
    }
    if (!ok) { /* the `finally` failed: its error replaces fn's */
        Py_XDECREF(r);
        Py_XDECREF(fn_err.t);
        Py_XDECREF(fn_err.v);
        Py_XDECREF(fn_err.tb);
        return NULL;
    }
    if (!r) {
        PyErr_Restore(fn_err.t, fn_err.v, fn_err.tb);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, Py_True, r);
    Py_DECREF(r);
    return res;
}

/* ---- the type ------------------------------------------------------------------------ */
static int Token_init(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_token *t = (uccl__py_token *)op;
    static char *kwlist[] = {"cv", "q", NULL};
    PyObject *cv, *q;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:Token", kwlist, &cv, &q))
        return -1;
    if (t->acquire) {
        PyErr_SetString(PyExc_RuntimeError, "Token.__init__ called twice");
        return -1;
    }
    t->acquire = PyObject_GetAttrString(cv, "acquire");
    t->release = t->acquire ? PyObject_GetAttrString(cv, "release") : NULL;
    t->notify_all = t->release ? PyObject_GetAttrString(cv, "notify_all") : NULL;
    if (!t->notify_all)
        return -1;
    t->q = Py_NewRef(q);
    t->closed = Py_NewRef(Py_None);
    t->poisoned = Py_NewRef(Py_None);
    return 0;
}

static int Token_traverse(PyObject *op, visitproc visit, void *arg)
{
    uccl__py_token *t = (uccl__py_token *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(t->acquire);
    Py_VISIT(t->release);
    Py_VISIT(t->notify_all);
    Py_VISIT(t->q);
    Py_VISIT(t->closed);
    Py_VISIT(t->poisoned);
    return 0;
}

static int Token_clear(PyObject *op)
{
    uccl__py_token *t = (uccl__py_token *)op;
    Py_CLEAR(t->acquire);
    Py_CLEAR(t->release);
    Py_CLEAR(t->notify_all);
    Py_CLEAR(t->q);
    Py_CLEAR(t->closed);
    Py_CLEAR(t->poisoned);
    return 0;
}

static void Token_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Token_clear(op);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static PyObject *get_busy(PyObject *op, void *unused)
{
    (void)unused;
    return PyBool_FromLong(((uccl__py_token *)op)->busy);
}

static int set_busy(PyObject *op, PyObject *v, void *unused)
{
    (void)unused;
    int b = v ? PyObject_IsTrue(v) : -1;
    if (b < 0) {
        if (!v)
            PyErr_SetString(PyExc_AttributeError, "busy cannot be deleted");
        return -1;
    }
    ((uccl__py_token *)op)->busy = b;
    return 0;
}

/* closed, poisoned: the field at this offset (a reason, or None) */
static PyObject **field(PyObject *op, void *which)
{
    uccl__py_token *t = (uccl__py_token *)op;
    return which ? &t->poisoned : &t->closed;
}

static PyObject *get_reason(PyObject *op, void *which)
{
    PyObject *v = *field(op, which);
    return Py_NewRef(v ? v : Py_None);
}

static int set_reason(PyObject *op, PyObject *v, void *which)
{
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "a reason cannot be deleted (set None)");
        return -1;
    }
    PyObject **f = field(op, which), *old = *f;
    *f = Py_NewRef(v);
    Py_XDECREF(old);
    return 0;
}

/* refused: why new tasks are refused, closed first (None: they are not) */
static PyObject *get_refused(PyObject *op, void *unused)
{
    (void)unused;
    uccl__py_token *t = (uccl__py_token *)op;
    for (int i = 0; i < 2; i++) {
        PyObject *v = i ? t->poisoned : t->closed;
        int set = v ? PyObject_IsTrue(v) : 0;
        if (set < 0)
            return NULL;
        if (set)
            return Py_NewRef(v);
    }
    Py_RETURN_NONE;
}

static PyGetSetDef Token_getset[] = {
    {"busy", get_busy, set_busy, "whether the token is taken", NULL},
    {"closed", get_reason, set_reason, "why the group is closed, or None", NULL},
    {"poisoned", get_reason, set_reason, "why the group refuses new tasks, or None",
     (void *)1},
    {"refused", get_refused, NULL, "closed, else poisoned, else None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Token_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Token_run, METH_FASTCALL,
     "run(fn, *args) -> (True, fn(*args)) holding the token, or (False, None) where it is not "
     "free"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Token_slots[] = {
    {Py_tp_init, Token_init},
    {Py_tp_dealloc, Token_dealloc},
    {Py_tp_traverse, Token_traverse},
    {Py_tp_clear, Token_clear},
    {Py_tp_methods, Token_methods},
    {Py_tp_getset, Token_getset},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "Token(cv, q): the execution token of a process group's calls (the base of "
                "the backend's Runner)."},
    {0, NULL},
};

PyType_Spec uccl__py_token_spec = {
    .name = "uccl_collective._engine.Token",
    .basicsize = sizeof(uccl__py_token),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = Token_slots,
};
