/* The extension module uccl_collective._engine: one heap type (Endpoint)
 * over the C engine, exceptions in module state, the GIL released around
 * everything that can block, and waits cut into slices so Ctrl-C works.
 * Built against the stable ABI (Py_LIMITED_API, CPython >= 3.10). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>
#include <time.h>

#include "coll.h"
#include "uccl.h"
#include "wire.h"

#define SLICE_NS 100000000ull /* 100 ms between signal checks */

typedef struct {
    PyObject *error;         /* UcclError(RuntimeError) */
    PyObject *timeout_error; /* UcclTimeoutError(UcclError, TimeoutError) */
} modstate;

typedef struct {
    PyObject_HEAD
    uccl_ep_t *ep;
    uccl_comm_t *comm;       /* collectives (_comm_init), owned with the engine */
    PyObject *module;        /* strong ref: where the exceptions live */
    int inflight;            /* calls running without the GIL (ep_enter/ep_leave) */
    int closed;
} EndpointObject;

static struct PyModuleDef engine_module;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static modstate *state_of(PyObject *module) { return (modstate *)PyModule_GetState(module); }

/* Raise the exception that fits status, with the engine's message. */
static PyObject *raise_status(PyObject *module, int status, const char *msg)
{
    modstate *st = state_of(module);
    PyObject *type;
    switch (status) {
    case UCCL_ERR_INVALID:
    case UCCL_ERR_NOTFOUND:
    case UCCL_ERR_MISMATCH:
    case UCCL_ERR_CLOSED:
        type = PyExc_ValueError;
        break;
    case UCCL_ERR_TIMEOUT:
        type = st->timeout_error;
        break;
    case UCCL_ERR_NOMEM:
        return PyErr_NoMemory();
    default:
        type = st->error;
    }
    PyErr_Format(type, "%s", msg && *msg ? msg : uccl_status_str(status));
    return NULL;
}

static PyObject *fail(EndpointObject *self, int status)
{
    return raise_status(self->module, status, uccl_last_error());
}

static int to_u64(PyObject *o, void *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "expected a non-negative integer (pointer or id), got %R", o);
        return 0;
    }
    *(uint64_t *)out = v;
    return 1;
}

static int to_size(PyObject *o, void *out)
{
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred())
        return 0;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", v);
        return 0;
    }
    *(size_t *)out = (size_t)v;
    return 1;
}

static int check_ep(EndpointObject *self)
{
    if (!self->ep || self->closed) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is closed");
        return -1;
    }
    return 0;
}

/* A call that releases the GIL holds the engine alive: close() from another
 * thread then only fails what is pending (waking this call), and the last
 * call to leave frees the engine.  Both run with the GIL held. */
static void ep_enter(EndpointObject *self) { self->inflight++; }

static void ep_leave(EndpointObject *self)
{
    if (--self->inflight == 0 && self->closed && self->ep) {
        uccl_ep_t *ep = self->ep;
        uccl_comm_t *comm = self->comm;
        self->ep = NULL;
        self->comm = NULL;
        Py_BEGIN_ALLOW_THREADS
        uccl_comm_destroy(comm);
        uccl_ep_destroy(ep);
        Py_END_ALLOW_THREADS
    }
}

/* Endpoint(local_gpu_idx=None, num_cpus=4, *, timeout_s=None, secret=None, port=-1,
 *          rank=-1, host_id=None) */
static int Endpoint_init(PyObject *op, PyObject *args, PyObject *kw)
{
    EndpointObject *self = (EndpointObject *)op;
    static char *kwlist[] = {"local_gpu_idx", "num_cpus", "timeout_s", "secret", "port", "rank",
                             "host_id", NULL};
    PyObject *gpu = Py_None, *timeout = Py_None, *secret = Py_None;
    int num_cpus = 4, port = -1, rank = -1;
    const char *host_id = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Oi$OOiiz", kwlist, &gpu, &num_cpus, &timeout,
                                     &secret, &port, &rank, &host_id))
        return -1;
    if (rank < -1) {
        PyErr_Format(PyExc_ValueError, "rank must be -1 (none) or >= 0, got %d", rank);
        return -1;
    }
    if (self->ep) {
        PyErr_SetString(PyExc_RuntimeError, "Endpoint.__init__ called twice");
        return -1;
    }
    /* Find our module through the MRO: self may be a Python subclass. */
    PyObject *mro = PyObject_GetAttrString((PyObject *)Py_TYPE(op), "__mro__");
    if (!mro)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_Size(mro) && !self->module; i++) {
        PyObject *m = PyType_GetModule((PyTypeObject *)PyTuple_GetItem(mro, i));
        if (m && PyModule_GetDef(m) == &engine_module) {
            Py_INCREF(m);
            self->module = m;
        }
        PyErr_Clear();
    }
    Py_DECREF(mro);
    if (!self->module) {
        PyErr_SetString(PyExc_TypeError, "Endpoint: cannot find the _engine module");
        return -1;
    }
    struct uccl_ep_opts o = {.gpu_idx = -1, .num_cpus = num_cpus, .port = port, .rank = rank,
                             .host_id = host_id};
    if (gpu != Py_None) {
        long g = PyLong_AsLong(gpu);
        if (g == -1 && PyErr_Occurred())
            return -1;
        if (g < 0 || g > 1023) {
            PyErr_Format(PyExc_ValueError, "local_gpu_idx must be None or 0..1023, got %ld", g);
            return -1;
        }
        o.gpu_idx = (int)g;
    }
    if (num_cpus < 1) {
        PyErr_Format(PyExc_ValueError, "num_cpus must be >= 1, got %d", num_cpus);
        return -1;
    }
    if (timeout != Py_None) {
        o.timeout_s = PyFloat_AsDouble(timeout);
        if (PyErr_Occurred())
            return -1;
        if (!(o.timeout_s > 0)) {
            PyErr_Format(PyExc_ValueError, "timeout_s must be > 0, got %R", timeout);
            return -1;
        }
    }
    PyObject *secret_bytes = NULL;
    if (secret != Py_None) {
        secret_bytes = PyUnicode_Check(secret) ? PyUnicode_AsUTF8String(secret)
                                               : PyBytes_FromObject(secret);
        if (!secret_bytes)
            return -1;
        char *p;
        Py_ssize_t n;
        PyBytes_AsStringAndSize(secret_bytes, &p, &n);
        o.secret = p;
        o.secret_len = (size_t)n;
    }
    int rc;
    uccl_ep_t *ep = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_create(&o, &ep);
    Py_END_ALLOW_THREADS
    Py_XDECREF(secret_bytes);
    if (rc) {
        fail(self, rc);
        return -1;
    }
    self->ep = ep;
    return 0;
}

static PyObject *Endpoint_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    EndpointObject *self = (EndpointObject *)op;
    if (self->closed || !self->ep)
        Py_RETURN_NONE;
    self->closed = 1;
    uccl_ep_t *ep = self->ep;
    ep_enter(self);
    uccl_comm_t *comm = self->comm;
    Py_BEGIN_ALLOW_THREADS
    uccl_ep_close(ep); /* wakes every waiter; memory stays until the last leaves */
    uccl_comm_shutdown(comm);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    Py_RETURN_NONE;
}

static void Endpoint_dealloc(PyObject *op)
{
    EndpointObject *self = (EndpointObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    PyObject *r = Endpoint_close(op, NULL);
    Py_XDECREF(r);
    Py_CLEAR(self->module);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static int Endpoint_traverse(PyObject *op, visitproc visit, void *arg)
{
    EndpointObject *self = (EndpointObject *)op;
    Py_VISIT(self->module);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

static PyObject *Endpoint_get_metadata(PyObject *op, PyObject *unused)
{
    (void)unused;
    EndpointObject *self = (EndpointObject *)op;
    if (check_ep(self))
        return NULL;
    uint8_t buf[UCCL_META_SIZE];
    int rc = uccl_ep_metadata(self->ep, buf, sizeof(buf));
    if (rc)
        return fail(self, rc);
    return PyBytes_FromStringAndSize((const char *)buf, sizeof(buf));
}

static PyObject *Endpoint_address(PyObject *op, PyObject *unused)
{
    (void)unused;
    EndpointObject *self = (EndpointObject *)op;
    if (check_ep(self))
        return NULL;
    char ip[46];
    int port;
    uccl_ep_addr(self->ep, ip, &port);
    return Py_BuildValue("(si)", ip, port);
}

static PyObject *Endpoint_connect(PyObject *op, PyObject *args, PyObject *kw)
{
    EndpointObject *self = (EndpointObject *)op;
    static char *kwlist[] = {"remote_ip_addr", "remote_gpu_idx", "remote_port", "rank", "secret", NULL};
    const char *ip;
    int gpu = 0, port = -1, rank = -1;
    const char *secret = NULL;
    Py_ssize_t secret_len = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|iiiz#", kwlist, &ip, &gpu, &port, &rank,
                                     &secret, &secret_len))
        return NULL;
    if (check_ep(self))
        return NULL;
    if (port == 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "remote_port must be -1 (default) or 1..65535, got %d", port);
        return NULL;
    }
    uint64_t id = 0;
    int rc;
    uccl_ep_t *ep = self->ep;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_connect(ep, ip, port, gpu, rank, (const uint8_t *)secret, (size_t)secret_len, &id);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    if (rc)
        return fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)id);
}

static PyObject *Endpoint_add_remote_endpoint(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    const char *meta;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "y#", &meta, &len))
        return NULL;
    if (check_ep(self))
        return NULL;
    uint64_t id = 0;
    int rc;
    uccl_ep_t *ep = self->ep;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_connect_meta(ep, (const uint8_t *)meta, (size_t)len, &id);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    if (rc)
        return fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)id);
}

/* Wait on `what` in slices, checking for signals between them. */
static double timeout_arg(EndpointObject *self, PyObject *timeout, int *err)
{
    *err = 0;
    if (timeout == NULL || timeout == Py_None)
        return (double)uccl_ep_timeout_ns(self->ep) / 1e9;
    double t = PyFloat_AsDouble(timeout);
    if (PyErr_Occurred()) {
        *err = 1;
        return 0;
    }
    if (!(t >= 0)) {
        PyErr_Format(PyExc_ValueError, "timeout must be >= 0 seconds, got %R", timeout);
        *err = 1;
    }
    return t > 365.0 * 86400 ? 365.0 * 86400 : t; /* "forever", kept finite in ns */
}

static PyObject *Endpoint_accept(PyObject *op, PyObject *args, PyObject *kw)
{
    EndpointObject *self = (EndpointObject *)op;
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout))
        return NULL;
    if (check_ep(self))
        return NULL;
    int err;
    double t = timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    uint64_t deadline = mono_ns() + (uint64_t)(t * 1e9);
    for (;;) {
        uint64_t id = 0, now = mono_ns();
        char ip[46] = "";
        int gpu = -1, rc;
        if (now >= deadline)
            return raise_status(self->module, UCCL_ERR_TIMEOUT,
                                "accept() timed out: no peer connected");
        uint64_t slice = deadline - now < SLICE_NS ? deadline - now : SLICE_NS;
        uccl_ep_t *ep = self->ep;
        ep_enter(self);
        Py_BEGIN_ALLOW_THREADS
        rc = uccl_ep_accept(ep, slice, &id, ip, &gpu);
        Py_END_ALLOW_THREADS
        ep_leave(self);
        if (rc == UCCL_OK)
            return Py_BuildValue("(OsiK)", Py_True, ip, gpu, (unsigned long long)id);
        if (rc != UCCL_INPROGRESS)
            return fail(self, rc);
        if (PyErr_CheckSignals())
            return NULL;
        if (check_ep(self))
            return NULL;
    }
}

static PyObject *Endpoint_start_passive_accept(PyObject *op, PyObject *unused)
{
    (void)unused;
    EndpointObject *self = (EndpointObject *)op;
    if (check_ep(self))
        return NULL;
    int rc = uccl_ep_set_passive(self->ep);
    if (rc)
        return fail(self, rc);
    Py_RETURN_TRUE;
}

static PyObject *Endpoint_conn_transport(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t conn;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &conn) || check_ep(self))
        return NULL;
    char buf[32];
    int rc = uccl_ep_conn_transport(self->ep, conn, buf, sizeof(buf));
    if (rc)
        return fail(self, rc);
    return PyUnicode_FromString(buf);
}

/* _set_spin_us(us): how long waiters poll before sleeping (before any transfer) */
static PyObject *Endpoint_set_spin_us(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    double us;
    if (!PyArg_ParseTuple(args, "d", &us) || check_ep(self))
        return NULL;
    if (!(us >= 0 && us <= 1e6)) {
        PyErr_Format(PyExc_ValueError, "spin must be 0..1000000 us, got %g", us);
        return NULL;
    }
    uccl_ep_set_spin_ns(self->ep, (uint64_t)(us * 1000));
    Py_RETURN_NONE;
}

static PyObject *Endpoint_conn_peer_rank(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t conn;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &conn) || check_ep(self))
        return NULL;
    int rank;
    int rc = uccl_ep_conn_peer_rank(self->ep, conn, &rank);
    if (rc)
        return fail(self, rc);
    return PyLong_FromLong(rank);
}

static PyObject *Endpoint_reg(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t ptr;
    size_t size;
    if (!PyArg_ParseTuple(args, "O&O&", to_u64, &ptr, to_size, &size) || check_ep(self))
        return NULL;
    uint64_t mr;
    int rc = uccl_ep_reg(self->ep, (uintptr_t)ptr, size, &mr);
    if (rc)
        return fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)mr);
}

static PyObject *Endpoint_dereg(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t mr;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &mr) || check_ep(self))
        return NULL;
    int rc;
    uccl_ep_t *ep = self->ep;
    ep_enter(self); /* waits for peers' accesses in flight to stop */
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_dereg(ep, mr);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    if (rc)
        return fail(self, rc);
    Py_RETURN_TRUE;
}

static int parse_post(EndpointObject *self, PyObject *args, int *op, uint64_t *conn, uint64_t *mr,
                      uint64_t *ptr, size_t *size, const char **fifo, Py_ssize_t *fifo_len)
{
    *fifo = NULL;
    *fifo_len = 0;
    if (!PyArg_ParseTuple(args, "iO&O&O&O&|z#", op, to_u64, conn, to_u64, mr, to_u64, ptr,
                          to_size, size, fifo, fifo_len))
        return -1;
    return check_ep(self);
}

/* _post(op, conn_id, mr_id, ptr, size, fifo_item=None) -> transfer_id */
static PyObject *Endpoint_post(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    int op;
    uint64_t conn, mr, ptr, id;
    size_t size;
    const char *fifo;
    Py_ssize_t fifo_len;
    if (parse_post(self, args, &op, &conn, &mr, &ptr, &size, &fifo, &fifo_len))
        return NULL;
    int rc;
    uccl_ep_t *ep = self->ep;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_post(ep, op, conn, mr, (uintptr_t)ptr, size, (const uint8_t *)fifo,
                      (size_t)fifo_len, &id);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    if (rc)
        return fail(self, rc);
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *wait_xfer(EndpointObject *self, uint64_t id, double timeout_s)
{
    uint64_t deadline = mono_ns() + (uint64_t)(timeout_s * 1e9);
    for (;;) {
        int rc;
        uccl_ep_t *ep = self->ep;
        ep_enter(self);
        Py_BEGIN_ALLOW_THREADS
        rc = uccl_ep_wait(ep, id, deadline, SLICE_NS);
        Py_END_ALLOW_THREADS
        ep_leave(self);
        if (rc == UCCL_OK)
            Py_RETURN_TRUE;
        if (rc != UCCL_INPROGRESS)
            return fail(self, rc);
        if (PyErr_CheckSignals())
            return NULL;
        if (check_ep(self))
            return NULL;
    }
}

/* wait(transfer_id, timeout=None) -> True */
static PyObject *Endpoint_wait(PyObject *op, PyObject *args, PyObject *kw)
{
    EndpointObject *self = (EndpointObject *)op;
    static char *kwlist[] = {"transfer_id", "timeout", NULL};
    uint64_t id;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|O", kwlist, to_u64, &id, &timeout) ||
        check_ep(self))
        return NULL;
    int err;
    double t = timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    return wait_xfer(self, id, t);
}

/* _transfer(op, conn_id, mr_id, ptr, size, fifo_item=None): post, wait,
 * release, in one call (the blocking send/recv/read/write path). */
static PyObject *Endpoint_transfer(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    int op;
    uint64_t conn, mr, ptr, id;
    size_t size;
    const char *fifo;
    Py_ssize_t fifo_len;
    if (parse_post(self, args, &op, &conn, &mr, &ptr, &size, &fifo, &fifo_len))
        return NULL;
    int rc;
    uint64_t deadline = mono_ns() + uccl_ep_timeout_ns(self->ep);
    uccl_ep_t *ep = self->ep;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_post(ep, op | UCCL_XFER_BLOCKING, conn, mr, (uintptr_t)ptr, size,
                      (const uint8_t *)fifo, (size_t)fifo_len, &id);
    if (rc == UCCL_OK) {
        rc = uccl_ep_wait(ep, id, deadline, SLICE_NS);
        if (rc != UCCL_INPROGRESS && rc != UCCL_OK)
            uccl_ep_release(ep, id); /* keep the error message: release sets none on success */
    }
    Py_END_ALLOW_THREADS
    if (rc != UCCL_OK && rc != UCCL_INPROGRESS) {
        PyObject *r = fail(self, rc);
        ep_leave(self);
        return r;
    }
    ep_leave(self);
    PyObject *res = Py_True;
    Py_INCREF(res);
    if (rc == UCCL_INPROGRESS) {
        uint64_t now = mono_ns();
        Py_DECREF(res);
        res = wait_xfer(self, id, now < deadline ? (double)(deadline - now) / 1e9 : 0.0);
    }
    if (self->ep) {
        if (!res) { /* interrupted (Ctrl-C) or failed: nothing may land after we return */
            uccl_ep_t *ep = self->ep;
            ep_enter(self);
            Py_BEGIN_ALLOW_THREADS
            uccl_ep_abort(ep, id, "the blocking call was interrupted");
            Py_END_ALLOW_THREADS
            ep_leave(self);
        }
        if (self->ep)
            uccl_ep_release(self->ep, id);
    }
    return res;
}

static PyObject *Endpoint_poll_async(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &id) || check_ep(self))
        return NULL;
    int done = 0;
    int rc = uccl_ep_poll(self->ep, id, &done);
    if (rc)
        return fail(self, rc);
    return Py_BuildValue("(OO)", Py_True, done ? Py_True : Py_False);
}

static PyObject *Endpoint_release(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &id) || check_ep(self))
        return NULL;
    int rc = uccl_ep_release(self->ep, id);
    if (rc)
        return fail(self, rc);
    Py_RETURN_TRUE;
}

static PyObject *Endpoint_advertise(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    uint64_t conn, mr, addr;
    size_t len;
    if (!PyArg_ParseTuple(args, "O&O&O&O&", to_u64, &conn, to_u64, &mr, to_u64, &addr, to_size,
                          &len) || check_ep(self))
        return NULL;
    uint8_t buf[UCCL_FIFO_ITEM_SIZE];
    int rc = uccl_ep_advertise(self->ep, conn, mr, (uintptr_t)addr, len, buf, sizeof(buf));
    if (rc)
        return fail(self, rc);
    PyObject *b = PyBytes_FromStringAndSize((const char *)buf, sizeof(buf));
    if (!b)
        return NULL;
    PyObject *res = Py_BuildValue("(OO)", Py_True, b);
    Py_DECREF(b);
    return res;
}

/* ------------------------------------------------------------------------- */
/* collectives (coll.h): used by uccl_collective.collective                   */

static int check_comm(EndpointObject *self)
{
    if (check_ep(self))
        return -1;
    if (!self->comm) {
        PyErr_SetString(PyExc_ValueError, "no communicator: call _comm_init first");
        return -1;
    }
    return 0;
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
        int ok = item && to_u64(item, &out[i]);
        Py_XDECREF(item);
        if (!ok)
            return -1;
    }
    return 0;
}

/* _comm_init(rank, size, send_conns, recv_conns) */
static PyObject *Endpoint_comm_init(PyObject *op, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op;
    int rank, size;
    PyObject *sends, *recvs;
    if (!PyArg_ParseTuple(args, "iiOO", &rank, &size, &sends, &recvs) || check_ep(self))
        return NULL;
    if (self->comm) {
        PyErr_SetString(PyExc_ValueError, "this endpoint already has a communicator");
        return NULL;
    }
    if (size < 1 || size > 65536) {
        PyErr_Format(PyExc_ValueError, "world size %d (expected 1..65536)", size);
        return NULL;
    }
    uint64_t *sc = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    uint64_t *rc_ = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    PyObject *res = NULL;
    if (!sc || !rc_) {
        PyErr_NoMemory();
        goto out;
    }
    if (conn_list(sends, size, sc, "send_conns") || conn_list(recvs, size, rc_, "recv_conns"))
        goto out;
    int rc = uccl_comm_create(self->ep, rank, size, sc, rc_, &self->comm);
    if (rc) {
        fail(self, rc);
        goto out;
    }
    res = Py_True;
    Py_INCREF(res);
out:
    PyMem_Free(sc);
    PyMem_Free(rc_);
    return res;
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
static PyObject *comm_finish(EndpointObject *self, uint64_t id, int rc)
{
    PyObject *res = rc == UCCL_OK ? Py_True : fail(self, rc);
    Py_XINCREF(res);
    if (self->comm)
        uccl_comm_release(self->comm, id);
    return res;
}

/* Wait for operation id in slices (Ctrl-C works), then forget it; raise if
 * it failed.  Interrupted, it is stopped first: nothing lands afterwards. */
static PyObject *comm_wait_loop(EndpointObject *self, uint64_t id, PyObject *timeout)
{
    int err;
    double t = timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    uint64_t deadline = mono_ns() + (uint64_t)(t * 1e9);
    for (;;) {
        int rc;
        uccl_comm_t *cm = self->comm;
        ep_enter(self);
        Py_BEGIN_ALLOW_THREADS
        rc = uccl_comm_wait(cm, id, deadline, SLICE_NS);
        Py_END_ALLOW_THREADS
        ep_leave(self);
        if (rc != UCCL_INPROGRESS)
            return comm_finish(self, id, rc);
        if (PyErr_CheckSignals() || check_comm(self)) {
            if (self->comm) {
                PyObject *et, *ev, *tb;
                PyErr_Fetch(&et, &ev, &tb);
                cm = self->comm;
                ep_enter(self);
                Py_BEGIN_ALLOW_THREADS
                uccl_comm_wait(cm, id, 0, SLICE_NS * 50);
                Py_END_ALLOW_THREADS
                ep_leave(self);
                if (self->comm)
                    uccl_comm_release(self->comm, id);
                PyErr_Restore(et, ev, tb);
            }
            return NULL;
        }
    }
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

/* After a submission: its error, or the op id, or (wait) its outcome. */
static PyObject *comm_submitted(EndpointObject *self, int rc, uint64_t id, int wait,
                                PyObject *timeout)
{
    if (rc)
        return fail(self, rc);
    return wait ? comm_wait_loop(self, id, timeout) : PyLong_FromUnsignedLongLong(id);
}

/* _comm_p2p([(op, peer, (ptr, len, mr)), ...], wait=False, timeout=None)
 * -> op_id; with wait, posts and waits in one call -> True. */
static PyObject *Endpoint_comm_p2p(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    PyObject *seq, *timeout = Py_None;
    int wait = 0;
    if (!PyArg_ParseTuple(args, "O|pO", &seq, &wait, &timeout) || check_comm(self))
        return NULL;
    Py_ssize_t n = 0;
    struct uccl_coll_p2p *ops = parse_seq(seq, sizeof(*ops), parse_p2p_item, &n);
    if (!ops)
        return NULL;
    uint64_t id = 0;
    int rc;
    uccl_comm_t *cm = self->comm;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_p2p(cm, ops, (int)n, &id);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    PyMem_Free(ops);
    return comm_submitted(self, rc, id, wait, timeout);
}

/* _comm_allgather((ptr, len, mr), [(ptr, len, mr)] * size, algo, async=False, timeout=None)
 * async: -> op_id.  Blocking: submits and waits in one call (no window in
 * which an interrupt could leave the operation unwatched) -> True. */
static PyObject *Endpoint_comm_allgather(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    PyObject *sendt, *recvl, *timeout = Py_None;
    int algo, async = 0;
    if (!PyArg_ParseTuple(args, "OOi|pO", &sendt, &recvl, &algo, &async, &timeout) ||
        check_comm(self))
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
    uint64_t id = 0;
    int rc;
    uccl_comm_t *cm = self->comm;
    ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_allgather(cm, &send, recv, algo, async, &id);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    PyMem_Free(recv);
    return comm_submitted(self, rc, id, !async, timeout);
}


/* _comm_wait(op_id, timeout=None) -> True; forgets the operation once finished */
static PyObject *Endpoint_comm_wait(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    uint64_t id;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "O&|O", to_u64, &id, &timeout) || check_comm(self))
        return NULL;
    return comm_wait_loop(self, id, timeout);
}

/* _comm_test(op_id) -> bool; forgets the operation once finished */
static PyObject *Endpoint_comm_test(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", to_u64, &id) || check_comm(self))
        return NULL;
    int done = 0, rc;
    uccl_comm_t *cm = self->comm;
    ep_enter(self); /* it may start the operation (copies) or clean one up */
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_comm_test(cm, id, &done);
    Py_END_ALLOW_THREADS
    ep_leave(self);
    if (rc == UCCL_OK && !done)
        Py_RETURN_FALSE;
    return comm_finish(self, id, rc);
}

/* _comm_pick_algo(algo, chunk_bytes) -> the algorithm auto resolves to */
static PyObject *Endpoint_comm_pick_algo(PyObject *op_, PyObject *args)
{
    EndpointObject *self = (EndpointObject *)op_;
    int algo;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "in", &algo, &chunk) || check_comm(self))
        return NULL;
    return PyLong_FromLong(uccl_comm_pick_algo(self->comm, algo, (size_t)(chunk < 0 ? 0 : chunk)));
}

static PyObject *Endpoint_get_timeout(PyObject *op, void *closure)
{
    (void)closure;
    EndpointObject *self = (EndpointObject *)op;
    if (check_ep(self))
        return NULL;
    return PyFloat_FromDouble((double)uccl_ep_timeout_ns(self->ep) / 1e9);
}

static PyObject *Endpoint_get_closed(PyObject *op, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((EndpointObject *)op)->ep == NULL);
}

static PyMethodDef Endpoint_methods[] = {
    {"close", Endpoint_close, METH_NOARGS, "Fail pending transfers, close every connection."},
    {"get_metadata", Endpoint_get_metadata, METH_NOARGS, "Bytes that let a peer connect here."},
    {"address", Endpoint_address, METH_NOARGS, "(ip, port) this endpoint listens on."},
    {"connect", (PyCFunction)(void (*)(void))Endpoint_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(remote_ip_addr, remote_gpu_idx, remote_port=-1) -> (True, conn_id)"},
    {"add_remote_endpoint", Endpoint_add_remote_endpoint, METH_VARARGS,
     "add_remote_endpoint(metadata) -> (True, conn_id); cached per peer"},
    {"accept", (PyCFunction)(void (*)(void))Endpoint_accept, METH_VARARGS | METH_KEYWORDS,
     "accept(timeout=None) -> (True, remote_ip_addr, remote_gpu_idx, conn_id)"},
    {"start_passive_accept", Endpoint_start_passive_accept, METH_NOARGS,
     "Accept connections in the background; accept() is then not used."},
    {"conn_transport", Endpoint_conn_transport, METH_VARARGS,
     "conn_transport(conn_id) -> 'tcp' | 'shm-cma' | 'shm-ring'"},
    {"_set_spin_us", Endpoint_set_spin_us, METH_VARARGS,
     "_set_spin_us(us): how long waiters poll before sleeping (call before transfers)"},
    {"conn_peer_rank", Endpoint_conn_peer_rank, METH_VARARGS,
     "conn_peer_rank(conn_id) -> the rank the peer gave in its handshake (-1: none)"},
    {"reg", Endpoint_reg, METH_VARARGS, "reg(ptr, size) -> (True, mr_id)"},
    {"dereg", Endpoint_dereg, METH_VARARGS, "dereg(mr_id) -> True"},
    {"_post", Endpoint_post, METH_VARARGS, "_post(op, conn_id, mr_id, ptr, size, fifo=None) -> id"},
    {"_transfer", Endpoint_transfer, METH_VARARGS, "_transfer(op, conn_id, mr_id, ptr, size, fifo=None)"},
    {"wait", (PyCFunction)(void (*)(void))Endpoint_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(transfer_id, timeout=None) -> True; raises if the transfer failed"},
    {"poll_async", Endpoint_poll_async, METH_VARARGS, "poll_async(transfer_id) -> (True, is_done)"},
    {"release", Endpoint_release, METH_VARARGS, "release(transfer_id): forget a finished id"},
    {"advertise", Endpoint_advertise, METH_VARARGS,
     "advertise(conn_id, mr_id, addr, len) -> (True, fifo_item)"},
    {"_comm_init", Endpoint_comm_init, METH_VARARGS,
     "_comm_init(rank, size, send_conns, recv_conns): the communicator over these connections"},
    {"_comm_p2p", Endpoint_comm_p2p, METH_VARARGS,
     "_comm_p2p([(op, peer, (ptr, len, mr))], wait=False, timeout=None) -> op_id or True"},
    {"_comm_allgather", Endpoint_comm_allgather, METH_VARARGS,
     "_comm_allgather(send, recvs, algo, async=False, timeout=None) -> op_id (async) or True"},
    {"_comm_wait", Endpoint_comm_wait, METH_VARARGS,
     "_comm_wait(op_id, timeout=None) -> True; raises if it failed; forgets it"},
    {"_comm_test", Endpoint_comm_test, METH_VARARGS,
     "_comm_test(op_id) -> done; raises if it failed; forgets it once finished"},
    {"_comm_pick_algo", Endpoint_comm_pick_algo, METH_VARARGS,
     "_comm_pick_algo(algo, chunk_bytes) -> algorithm"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Endpoint_getset[] = {
    {"timeout_s", Endpoint_get_timeout, NULL, "default timeout of blocking calls, seconds", NULL},
    {"closed", Endpoint_get_closed, NULL, "True once close() ran", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Endpoint_slots[] = {
    {Py_tp_init, Endpoint_init},
    {Py_tp_dealloc, Endpoint_dealloc},
    {Py_tp_traverse, Endpoint_traverse},
    {Py_tp_methods, Endpoint_methods},
    {Py_tp_getset, Endpoint_getset},
    {Py_tp_doc, "The C engine's endpoint; uccl_collective.p2p.Endpoint adds the tensor helpers."},
    {0, NULL},
};

static PyType_Spec Endpoint_spec = {
    .name = "uccl_collective._engine.Endpoint",
    .basicsize = sizeof(EndpointObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Endpoint_slots,
};

static PyObject *mod_parse_metadata(PyObject *module, PyObject *args)
{
    const char *meta;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "y#", &meta, &len))
        return NULL;
    char ip[46];
    int port, gpu;
    int rc = uccl_parse_metadata((const uint8_t *)meta, (size_t)len, ip, &port, &gpu);
    if (rc)
        return raise_status(module, rc, uccl_last_error());
    return Py_BuildValue("(sii)", ip, port, gpu);
}

static PyMethodDef module_methods[] = {
    {"parse_metadata", mod_parse_metadata, METH_VARARGS,
     "parse_metadata(bytes) -> (ip, port, gpu_idx)"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    modstate *st = state_of(m);
    st->error = PyErr_NewExceptionWithDoc("uccl_collective.UcclError",
                                          "A transfer or connection failed.", PyExc_RuntimeError, NULL);
    if (!st->error)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->error, PyExc_TimeoutError);
    if (!bases)
        return -1;
    st->timeout_error = PyErr_NewExceptionWithDoc("uccl_collective.UcclTimeoutError",
                                                  "A deadline passed.", bases, NULL);
    Py_DECREF(bases);
    if (!st->timeout_error)
        return -1;
    if (PyModule_AddObjectRef(m, "UcclError", st->error) < 0 ||
        PyModule_AddObjectRef(m, "UcclTimeoutError", st->timeout_error) < 0)
        return -1;
    PyObject *type = PyType_FromModuleAndSpec(m, &Endpoint_spec, NULL);
    if (!type)
        return -1;
    int rc = PyModule_AddObjectRef(m, "Endpoint", type);
    Py_DECREF(type);
    if (rc < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "OP_SEND", UCCL_XFER_SEND) < 0 ||
        PyModule_AddIntConstant(m, "OP_RECV", UCCL_XFER_RECV) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", UCCL_XFER_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "OP_READ", UCCL_XFER_READ) < 0 ||
        PyModule_AddIntConstant(m, "METADATA_SIZE", UCCL_META_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "FIFO_ITEM_SIZE", UCCL_FIFO_ITEM_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "AG_AUTO", UCCL_AG_AUTO) < 0 ||
        PyModule_AddIntConstant(m, "AG_DIRECT", UCCL_AG_DIRECT) < 0 ||
        PyModule_AddIntConstant(m, "AG_RING", UCCL_AG_RING) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    modstate *st = state_of(m);
    Py_VISIT(st->error);
    Py_VISIT(st->timeout_error);
    return 0;
}

static int module_clear(PyObject *m)
{
    modstate *st = state_of(m);
    Py_CLEAR(st->error);
    Py_CLEAR(st->timeout_error);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "uccl_collective._engine",
    .m_doc = "The uccl-collective C engine.",
    .m_size = sizeof(modstate),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    return PyModuleDef_Init(&engine_module);
}
