/* The Communicator type (pyengine.h): the collectives of coll.h over an
 * Endpoint's connections, used by uccl_collective.collective (and through it
 * by the "uccl" process group).  Communicator(endpoint, rank, size,
 * send_conns, recv_conns) makes the engine communicator, which the endpoint
 * owns and destroys with its engine; this object keeps the endpoint alive. */
#include "py/pyengine.h"

typedef struct {
    PyObject_HEAD
    uccl__py_endpoint *endpoint; /* strong ref */
} uccl__py_comm;

/* -1 with ValueError unless ep is open and has its communicator. */
static int check_comm(uccl__py_endpoint *ep)
{
    if (uccl__py_ep_check(ep))
        return -1;
    if (!ep->comm) {
        PyErr_SetString(PyExc_ValueError, "the communicator is gone (its endpoint was closed)");
        return -1;
    }
    return 0;
}

/* The endpoint of an initialised communicator that can run; else NULL with ValueError. */
static uccl__py_endpoint *comm_ep(uccl__py_comm *self)
{
    if (!self->endpoint) {
        PyErr_SetString(PyExc_ValueError, "Communicator.__init__ was not called");
        return NULL;
    }
    return check_comm(self->endpoint) ? NULL : self->endpoint;
}

static int conn_list(PyObject *seq, int size, uint64_t *out, const char *what)
{
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0)
        return -1;
    if (n != size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd entries for world size %d", what, n, size);
        return -1;
    }
    for (int i = 0; i < size; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        int ok = item && uccl__py_to_u64(item, &out[i]);
        Py_XDECREF(item);
        if (!ok)
            return -1;
    }
    return 0;
}


/* Communicator(endpoint, rank, size, send_conns, recv_conns) */
static int Comm_init(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    static char *kwlist[] = {"endpoint", "rank", "size", "send_conns", "recv_conns", NULL};
    PyObject *epo, *sends, *recvs;
    int rank, size;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiiOO", kwlist, &epo, &rank, &size, &sends,
                                     &recvs))
        return -1;
    PyObject *module = uccl__py_module_of(Py_TYPE(op));
    if (!module)
        return -1;
    uccl__py_endpoint *self = uccl__py_endpoint_arg(module, epo, "Communicator");
    Py_DECREF(module);
    if (!self)
        return -1;
    if (cself->endpoint) {
        PyErr_SetString(PyExc_RuntimeError, "Communicator.__init__ called twice");
        return -1;
    }
    if (uccl__py_ep_check(self))
        return -1;
    if (self->comm) {
        PyErr_SetString(PyExc_ValueError, "this endpoint already has a communicator");
        return -1;
    }
    if (size < 1 || size > 65536) {
        PyErr_Format(PyExc_ValueError, "world size %d (expected 1..65536)", size);
        return -1;
    }
    uint64_t *sc = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    uint64_t *rc_ = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    int res = -1;
    if (!sc || !rc_) {
        PyErr_NoMemory();
        goto out;
    }
    if (conn_list(sends, size, sc, "send_conns") || conn_list(recvs, size, rc_, "recv_conns"))
        goto out;
    int rc = uccl_comm_create(self->ep, rank, size, sc, rc_, &self->comm);
    if (rc) {
        uccl__py_ep_fail(self, rc);
        goto out;
    }
    Py_INCREF(epo);
    cself->endpoint = self;
    res = 0;
out:
    PyMem_Free(sc);
    PyMem_Free(rc_);
    return res;
}

static void Comm_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Py_CLEAR(((uccl__py_comm *)op)->endpoint);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static int Comm_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((uccl__py_comm *)op)->endpoint);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

/* (ptr, len, mr) */
static int parse_buf(PyObject *t, struct uccl_coll_buf *b)
{
    unsigned long long ptr, mr;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(t, "KnK", &ptr, &len, &mr))
        return -1;
    if (len < 0) {
        PyErr_Format(PyExc_ValueError, "buffer length %zd < 0", len);
        return -1;
    }
    *b = (struct uccl_coll_buf){.ptr = (uintptr_t)ptr, .len = (size_t)len, .mr = mr};
    return 0;
}

/* Finished (done or failed): forget it, and raise if it failed. */
static PyObject *comm_finish(uccl__py_endpoint *self, uint64_t id, int rc)
{
    PyObject *res = rc == UCCL_OK ? Py_True : uccl__py_ep_fail(self, rc);
    Py_XINCREF(res);
    if (self->comm)
        uccl_comm_release(self->comm, id);
    return res;
}

static int comm_wait_slice(uccl__py_endpoint *self, void *arg)
{
    const struct uccl__py_wait_id *w = arg;
    return uccl_comm_wait(self->comm, w->id, w->deadline, UCCL_PY_SLICE_NS);
}

/* Wait for operation id in slices (Ctrl-C works), then forget it; raise if
 * it failed.  Interrupted, it is stopped first: nothing lands afterwards. */
static PyObject *comm_wait_loop(uccl__py_endpoint *self, uint64_t id, PyObject *timeout)
{
    int err;
    double t = uccl__py_timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    struct uccl__py_wait_id w = {id, uccl__py_mono_ns() + (uint64_t)(t * 1e9)};
    int rc;
    if (uccl__py_wait_sliced(self, check_comm, comm_wait_slice, &w, &rc) == 0)
        return comm_finish(self, id, rc);
    if (self->comm) { /* stop it (deadline 0): nothing may land after we raise */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        uccl_comm_t *cm = self->comm;
        uccl__py_ep_enter(self);
        Py_BEGIN_ALLOW_THREADS
        uccl_comm_wait(cm, id, 0, UCCL_PY_SLICE_NS * 50);
        Py_END_ALLOW_THREADS
        uccl__py_ep_leave(self);
        if (self->comm)
            uccl_comm_release(self->comm, id);
        PyErr_Restore(et, ev, tb);
    }
    return NULL;
}

/* Items of a sequence parsed into an array of n elements of elem bytes
 * (PyMem_Free it); NULL with an exception set. */
static void *parse_seq(PyObject *seq, size_t elem, int (*item_fn)(PyObject *, void *),
                       Py_ssize_t *n_p)
{
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0)
        return NULL;
    char *arr = PyMem_Calloc((size_t)(n ? n : 1), elem);
    if (!arr)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        int ok = item && item_fn(item, arr + (size_t)i * elem) == 0;
        Py_XDECREF(item);
        if (!ok) {
            PyMem_Free(arr);
            return NULL;
        }
    }
    *n_p = n;
    return arr;
}

static int parse_buf_item(PyObject *item, void *out) { return parse_buf(item, out); }

static int parse_p2p_item(PyObject *item, void *out)
{
    struct uccl_coll_p2p *e = out;
    PyObject *b;
    if (!PyArg_ParseTuple(item, "iiO", &e->op, &e->peer, &b))
        return -1;
    return parse_buf(b, &e->buf);
}

/* The mark of the caller's CUDA stream (dev >= 0), NULL for host-only
 * operations or an idle stream; -1 with an exception set. */
static int stream_mark(uccl__py_endpoint *self, int dev, uint64_t stream, void **mark_p)
{
    *mark_p = NULL;
    if (dev < 0)
        return 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_stream_mark(dev, (uintptr_t)stream, mark_p);
    Py_END_ALLOW_THREADS
    if (rc) {
        uccl__py_ep_fail(self, rc);
        return -1;
    }
    return 0;
}

/* After a submission: its error, or the op id, or (wait) its outcome. */
static PyObject *comm_submitted(uccl__py_endpoint *self, int rc, uint64_t id, int wait,
                                PyObject *timeout)
{
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return wait ? comm_wait_loop(self, id, timeout) : PyLong_FromUnsignedLongLong(id);
}

/* p2p([(op, peer, (ptr, len, mr)), ...], wait=False, timeout=None, dev=-1, stream=0)
 * -> op_id; with wait, posts and waits in one call -> True.  dev >= 0: the
 * operation starts after the work queued on CUDA stream `stream` of device
 * dev before this call. */
static PyObject *Comm_p2p(PyObject *op, PyObject *args)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    uccl__py_endpoint *self;
    PyObject *seq, *timeout = Py_None;
    int wait = 0, dev = -1;
    uint64_t stream = 0;
    void *mark;
    if (!PyArg_ParseTuple(args, "O|pOiO&", &seq, &wait, &timeout, &dev, uccl__py_to_u64,
                          &stream) || !(self = comm_ep(cself)))
        return NULL;
    Py_ssize_t n = 0;
    struct uccl_coll_p2p *ops = parse_seq(seq, sizeof(*ops), parse_p2p_item, &n);
    if (!ops)
        return NULL;
    if (stream_mark(self, dev, stream, &mark)) {
        PyMem_Free(ops);
        return NULL;
    }
    uint64_t id = 0;
    int rc;
    uccl_comm_t *cm = self->comm;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_p2p(cm, ops, (int)n, mark, &id);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    PyMem_Free(ops);
    return comm_submitted(self, rc, id, wait, timeout);
}

/* allgather((ptr, len, mr), [(ptr, len, mr)] * size, algo, async=False, timeout=None,
 *           dev=-1, stream=0)
 * async: -> op_id.  Blocking: submits and waits in one call (no window in
 * which an interrupt could leave the operation unwatched) -> True.  dev,
 * stream: as p2p. */
static PyObject *Comm_allgather(PyObject *op, PyObject *args)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    uccl__py_endpoint *self;
    PyObject *sendt, *recvl, *timeout = Py_None;
    int algo, async = 0, dev = -1;
    uint64_t stream = 0;
    void *mark;
    if (!PyArg_ParseTuple(args, "OOi|pOiO&", &sendt, &recvl, &algo, &async, &timeout, &dev,
                          uccl__py_to_u64, &stream) || !(self = comm_ep(cself)))
        return NULL;
    struct uccl_coll_buf send;
    if (parse_buf(sendt, &send))
        return NULL;
    Py_ssize_t n = 0;
    struct uccl_coll_buf *recv = parse_seq(recvl, sizeof(*recv), parse_buf_item, &n);
    if (!recv)
        return NULL;
    int size;
    uccl_comm_size(self->comm, &size);
    if (n != size) {
        PyMem_Free(recv);
        return PyErr_Format(PyExc_ValueError, "%zd receive buffers for world size %d", n, size);
    }
    if (stream_mark(self, dev, stream, &mark)) {
        PyMem_Free(recv);
        return NULL;
    }
    uint64_t id = 0;
    int rc;
    uccl_comm_t *cm = self->comm;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_allgather(cm, &send, recv, algo, async, mark, &id);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    PyMem_Free(recv);
    return comm_submitted(self, rc, id, !async, timeout);
}


/* wait(op_id, timeout=None) -> True; forgets the operation once finished */
static PyObject *Comm_wait(PyObject *op, PyObject *args)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    uccl__py_endpoint *self;
    uint64_t id;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "O&|O", uccl__py_to_u64, &id, &timeout) ||
        !(self = comm_ep(cself)))
        return NULL;
    return comm_wait_loop(self, id, timeout);
}

/* test(op_id) -> bool; forgets the operation once finished */
static PyObject *Comm_test(PyObject *op, PyObject *args)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    uccl__py_endpoint *self;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &id) || !(self = comm_ep(cself)))
        return NULL;
    int done = 0, rc;
    uccl_comm_t *cm = self->comm;
    uccl__py_ep_enter(self); /* it may start the operation (copies) or clean one up */
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_test(cm, id, &done);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc == UCCL_OK && !done)
        Py_RETURN_FALSE;
    return comm_finish(self, id, rc);
}

/* pick_algo(algo, chunk_bytes) -> the algorithm auto resolves to */
static PyObject *Comm_pick_algo(PyObject *op, PyObject *args)
{
    uccl__py_comm *cself = (uccl__py_comm *)op;
    uccl__py_endpoint *self;
    int algo;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "in", &algo, &chunk) || !(self = comm_ep(cself)))
        return NULL;
    return PyLong_FromLong(uccl_comm_pick_algo(self->comm, algo, (size_t)(chunk < 0 ? 0 : chunk)));
}

static PyMethodDef Comm_methods[] = {
    {"p2p", Comm_p2p, METH_VARARGS,
     "p2p([(op, peer, (ptr, len, mr))], wait=False, timeout=None, dev=-1, stream=0) -> op_id "
     "or True"},
    {"allgather", Comm_allgather, METH_VARARGS,
     "allgather(send, recvs, algo, async=False, timeout=None, dev=-1, stream=0) -> op_id "
     "(async) or True"},
    {"wait", Comm_wait, METH_VARARGS,
     "wait(op_id, timeout=None) -> True; raises if it failed; forgets it"},
    {"test", Comm_test, METH_VARARGS,
     "test(op_id) -> done; raises if it failed; forgets it once finished"},
    {"pick_algo", Comm_pick_algo, METH_VARARGS, "pick_algo(algo, chunk_bytes) -> algorithm"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Comm_slots[] = {
    {Py_tp_init, Comm_init},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_traverse, Comm_traverse},
    {Py_tp_methods, Comm_methods},
    {Py_tp_doc, "Collectives over an Endpoint's connections (used by uccl_collective.collective)."},
    {0, NULL},
};

PyType_Spec uccl__py_comm_spec = {
    .name = "uccl_collective._engine.Communicator",
    .basicsize = sizeof(uccl__py_comm),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Comm_slots,
};
