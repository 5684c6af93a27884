/* The Endpoint type (pyengine.h) over an engine endpoint (uccl.h):
 * connections, registration, two-sided and one-sided transfers.
 * uccl_collective.p2p.Endpoint subclasses it with the tensor helpers and
 * upstream's names. */
#include "py/pyengine.h"

#include <string.h>

#include "net/wire.h"


PyObject *uccl__py_ep_fail(uccl__py_endpoint *self, int status)
{
    return uccl__py_raise(self->module, status, uccl_last_error());
}

int uccl__py_ep_check(uccl__py_endpoint *self)
{
    if (!self->ep || self->closed) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is closed");
        return -1;
    }
    return 0;
}

uccl__py_endpoint *uccl__py_endpoint_arg(PyObject *module, PyObject *o, const char *what)
{
    PyObject *ep_type = PyObject_GetAttrString(module, "Endpoint");
    int is_ep = ep_type ? PyObject_IsInstance(o, ep_type) : -1;
    Py_XDECREF(ep_type);
    if (is_ep == 0)
        PyErr_Format(PyExc_TypeError, "%s: expected an Endpoint, got %R", what, o);
    return is_ep == 1 ? (uccl__py_endpoint *)o : NULL;
}


void uccl__py_ep_enter(uccl__py_endpoint *self) { self->inflight++; }

void uccl__py_ep_leave(uccl__py_endpoint *self)
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
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
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
    if (port < -1 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port must be -1 (the well-known port, else any free "
                     "one), 0 (any free port) or 1..65535, got %d", port);
        return -1;
    }
    if (self->ep) {
        PyErr_SetString(PyExc_RuntimeError, "Endpoint.__init__ called twice");
        return -1;
    }
    /* Our module, for the exceptions: self may be a Python subclass. */
    if (!self->module && !(self->module = uccl__py_module_of(Py_TYPE(op))))
        return -1;
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
        uccl__py_ep_fail(self, rc);
        return -1;
    }
    self->ep = ep;
    return 0;
}

static PyObject *Endpoint_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (self->closed || !self->ep)
        Py_RETURN_NONE;
    self->closed = 1;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    uccl_comm_t *comm = self->comm;
    Py_BEGIN_ALLOW_THREADS
    uccl_ep_close(ep); /* wakes every waiter; memory stays until the last leaves */
    uccl_comm_shutdown(comm);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    Py_RETURN_NONE;
}

static void Endpoint_dealloc(PyObject *op)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
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
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    Py_VISIT(self->module);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

static PyObject *Endpoint_get_metadata(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    uint8_t buf[UCCL_META_SIZE];
    size_t len = 0;
    int rc = uccl_ep_metadata(self->ep, buf, sizeof(buf), &len);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
}

static PyObject *Endpoint_address(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    char ip[46];
    int port;
    uccl_ep_addr(self->ep, ip, &port);
    return Py_BuildValue("(si)", ip, port);
}

static PyObject *Endpoint_connect(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    static char *kwlist[] = {"remote_ip_addr", "remote_gpu_idx", "remote_port", "rank", "secret", NULL};
    const char *ip;
    int gpu = 0, port = -1, rank = -1;
    const char *secret = NULL;
    Py_ssize_t secret_len = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|iiiz#", kwlist, &ip, &gpu, &port, &rank,
                                     &secret, &secret_len))
        return NULL;
    if (uccl__py_ep_check(self))
        return NULL;
    if (port == 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "remote_port must be -1 (default) or 1..65535, got %d", port);
        return NULL;
    }
    uint64_t id = 0;
    int rc;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_connect(ep, ip, port, gpu, rank, (const uint8_t *)secret, (size_t)secret_len, &id);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)id);
}

static PyObject *Endpoint_add_remote_endpoint(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    const char *meta;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "y#", &meta, &len))
        return NULL;
    if (uccl__py_ep_check(self))
        return NULL;
    uint64_t id = 0;
    int rc;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_connect_meta(ep, (const uint8_t *)meta, (size_t)len, &id);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)id);
}

double uccl__py_timeout_arg(uccl__py_endpoint *self, PyObject *timeout, int *err)
{
    *err = 0;
    if (timeout == NULL || timeout == Py_None) {
        if (uccl__py_ep_check(self)) { /* closed by another thread meanwhile */
            *err = 1;
            return 0;
        }
        return (double)uccl_ep_timeout_ns(self->ep) / 1e9;
    }
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

struct accept_slice {
    uint64_t deadline, id;
    char ip[46];
    int gpu;
};

static int accept_slice(uccl__py_endpoint *self, void *arg)
{
    struct accept_slice *a = arg;
    uint64_t now = uccl__py_mono_ns();
    if (now >= a->deadline)
        return uccl__err(UCCL_ERR_TIMEOUT, "accept() timed out: no peer connected");
    uint64_t slice = a->deadline - now < UCCL_PY_SLICE_NS ? a->deadline - now : UCCL_PY_SLICE_NS;
    return uccl_ep_accept(self->ep, slice, &a->id, a->ip, &a->gpu);
}

static PyObject *Endpoint_accept(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout))
        return NULL;
    if (uccl__py_ep_check(self))
        return NULL;
    int err;
    double t = uccl__py_timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    struct accept_slice a = {.deadline = uccl__py_mono_ns() + (uint64_t)(t * 1e9), .gpu = -1};
    int rc;
    if (uccl__py_wait_sliced(self, uccl__py_ep_check, accept_slice, &a, &rc))
        return NULL;
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return Py_BuildValue("(OsiK)", Py_True, a.ip, a.gpu, (unsigned long long)a.id);
}

static PyObject *Endpoint_start_passive_accept(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    int rc = uccl_ep_set_passive(self->ep);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    Py_RETURN_TRUE;
}

static PyObject *Endpoint_conn_transport(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t conn;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &conn) || uccl__py_ep_check(self))
        return NULL;
    char buf[32];
    int rc = uccl_ep_conn_transport(self->ep, conn, buf, sizeof(buf));
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyUnicode_FromString(buf);
}

/* _set_spin_us(us): how long waiters poll before sleeping (before any transfer) */
static PyObject *Endpoint_set_spin_us(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    double us;
    if (!PyArg_ParseTuple(args, "d", &us) || uccl__py_ep_check(self))
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
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t conn;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &conn) || uccl__py_ep_check(self))
        return NULL;
    int rank;
    int rc = uccl_ep_conn_peer_rank(self->ep, conn, &rank);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyLong_FromLong(rank);
}

/* received_bytes(transfer_id) -> the bytes a finished transfer moved */
static PyObject *Endpoint_received_bytes(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &id) || uccl__py_ep_check(self))
        return NULL;
    size_t len = 0;
    int rc = uccl_ep_xfer_len(self->ep, id, &len);
    if (rc == UCCL_INPROGRESS) {
        PyErr_Format(PyExc_ValueError, "transfer_id %llu is still in flight: wait for it first",
                     (unsigned long long)id);
        return NULL;
    }
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyLong_FromSize_t(len);
}

/* _ids_held() -> how many transfer ids the engine's table holds (tests) */
static PyObject *Endpoint_ids_held(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    return PyLong_FromSize_t(uccl_ep_ids_held(self->ep));
}

/* remove_remote_endpoint(conn_id) -> True, or False when conn_id is no live
 * connection (upstream's answer: nothing was there to remove). */
static PyObject *Endpoint_remove_remote_endpoint(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t conn;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &conn) || uccl__py_ep_check(self))
        return NULL;
    int rc;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_conn_remove(ep, conn);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc == UCCL_ERR_NOTFOUND)
        Py_RETURN_FALSE;
    if (rc)
        return uccl__py_ep_fail(self, rc);
    Py_RETURN_TRUE;
}

static PyObject *Endpoint_reg(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t ptr;
    size_t size;
    if (!PyArg_ParseTuple(args, "O&O&", uccl__py_to_u64, &ptr, uccl__py_to_size, &size) ||
        uccl__py_ep_check(self))
        return NULL;
    uint64_t mr;
    int rc = uccl_ep_reg(self->ep, (uintptr_t)ptr, size, &mr);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return Py_BuildValue("(OK)", Py_True, (unsigned long long)mr);
}

static PyObject *Endpoint_dereg(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t mr;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &mr) || uccl__py_ep_check(self))
        return NULL;
    int rc;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self); /* waits for peers' accesses in flight to stop */
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ep_dereg(ep, mr);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    Py_RETURN_TRUE;
}

struct post_args {
    int op;
    uint64_t conn, mr, ptr;
    size_t size;
    const char *fifo;        /* the advertised descriptor (write, read), or NULL */
    Py_ssize_t fifo_len;
    uint64_t stream;         /* CUDA stream ordering device memory (0: legacy default) */
};

/* (op, conn_id, mr_id, ptr, size, fifo_item=None, stream=0) */
static int parse_post(uccl__py_endpoint *self, PyObject *args, struct post_args *a)
{
    a->fifo = NULL;
    a->fifo_len = 0;
    a->stream = 0;
    if (!PyArg_ParseTuple(args, "iO&O&O&O&|z#O&", &a->op, uccl__py_to_u64, &a->conn,
                          uccl__py_to_u64, &a->mr, uccl__py_to_u64, &a->ptr, uccl__py_to_size,
                          &a->size, &a->fifo, &a->fifo_len, uccl__py_to_u64, &a->stream))
        return -1;
    return uccl__py_ep_check(self);
}

static int post(uccl_ep_t *ep, const struct post_args *a, int flags, uint64_t *id_p)
{
    return uccl_ep_post(ep, a->op | flags, a->conn, a->mr, (uintptr_t)a->ptr, a->size,
                        (const uint8_t *)a->fifo, (size_t)a->fifo_len, (uintptr_t)a->stream, id_p);
}

/* _post(op, conn_id, mr_id, ptr, size, fifo_item=None) -> transfer_id */
static PyObject *Endpoint_post(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    struct post_args a;
    uint64_t id;
    if (parse_post(self, args, &a))
        return NULL;
    int rc;
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = post(ep, &a, 0, &id);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyLong_FromUnsignedLongLong(id);
}

int uccl__py_wait_sliced(uccl__py_endpoint *self, int (*check)(uccl__py_endpoint *),
                         int (*wait_slice)(uccl__py_endpoint *, void *), void *arg, int *rc_p)
{
    for (;;) {
        /* Checked before every slice, the first too: another thread may have
         * closed the endpoint (and the last call to leave freed the engine)
         * since the caller last looked. */
        if (check(self))
            return -1;
        int rc;
        uccl__py_ep_enter(self); /* self->ep and self->comm stay while we are inside */
        Py_BEGIN_ALLOW_THREADS
        rc = wait_slice(self, arg);
        Py_END_ALLOW_THREADS
        uccl__py_ep_leave(self);
        if (rc != UCCL_INPROGRESS) {
            *rc_p = rc;
            return 0;
        }
        if (PyErr_CheckSignals())
            return -1;
    }
}

static int xfer_wait_slice(uccl__py_endpoint *self, void *arg)
{
    const struct uccl__py_wait_id *w = arg;
    return uccl_ep_wait(self->ep, w->id, w->deadline, UCCL_PY_SLICE_NS);
}

static PyObject *wait_xfer(uccl__py_endpoint *self, uint64_t id, double timeout_s)
{
    struct uccl__py_wait_id w = {id, uccl__py_mono_ns() + (uint64_t)(timeout_s * 1e9)};
    int rc;
    if (uccl__py_wait_sliced(self, uccl__py_ep_check, xfer_wait_slice, &w, &rc))
        return NULL;
    if (rc == UCCL_OK)
        Py_RETURN_TRUE;
    return uccl__py_ep_fail(self, rc);
}

/* wait(transfer_id, timeout=None) -> True */
static PyObject *Endpoint_wait(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    static char *kwlist[] = {"transfer_id", "timeout", NULL};
    uint64_t id;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|O", kwlist, uccl__py_to_u64, &id, &timeout) ||
        uccl__py_ep_check(self))
        return NULL;
    int err;
    double t = uccl__py_timeout_arg(self, timeout, &err);
    if (err)
        return NULL;
    return wait_xfer(self, id, t);
}

/* _transfer(op, conn_id, mr_id, ptr, size, fifo_item=None): post, wait,
 * release, in one call (the blocking send/recv/read/write path). */
static PyObject *Endpoint_transfer(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    struct post_args a;
    uint64_t id;
    if (parse_post(self, args, &a))
        return NULL;
    int rc;
    uint64_t deadline = uccl__py_mono_ns() + uccl_ep_timeout_ns(self->ep);
    uccl_ep_t *ep = self->ep;
    uccl__py_ep_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = post(ep, &a, UCCL_XFER_BLOCKING, &id);
    if (rc == UCCL_OK) {
        rc = uccl_ep_wait(ep, id, deadline, UCCL_PY_SLICE_NS);
        if (rc != UCCL_INPROGRESS && rc != UCCL_OK)
            uccl_ep_release(ep, id); /* keep the error message: release sets none on success */
    }
    Py_END_ALLOW_THREADS
    if (rc != UCCL_OK && rc != UCCL_INPROGRESS) {
        PyObject *r = uccl__py_ep_fail(self, rc);
        uccl__py_ep_leave(self);
        return r;
    }
    uccl__py_ep_leave(self);
    PyObject *res = Py_True;
    Py_INCREF(res);
    if (rc == UCCL_INPROGRESS) {
        uint64_t now = uccl__py_mono_ns();
        Py_DECREF(res);
        res = wait_xfer(self, id, now < deadline ? (double)(deadline - now) / 1e9 : 0.0);
    }
    if (self->ep) {
        if (!res) { /* interrupted (Ctrl-C) or failed: nothing may land after we return */
            ep = self->ep;
            uccl__py_ep_enter(self);
            Py_BEGIN_ALLOW_THREADS
            uccl_ep_abort(ep, id, "the blocking call was interrupted");
            Py_END_ALLOW_THREADS
            uccl__py_ep_leave(self);
        }
        if (self->ep)
            uccl_ep_release(self->ep, id);
    }
    return res;
}

/* _stream_wait(transfer_id, stream) -> bool: the stream waits for the
 * transfer (True), or it moves host memory (False: wait on the host). */
static PyObject *Endpoint_stream_wait(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t id, stream;
    if (!PyArg_ParseTuple(args, "O&O&", uccl__py_to_u64, &id, uccl__py_to_u64, &stream) ||
        uccl__py_ep_check(self))
        return NULL;
    int queued = 0;
    int rc = uccl_ep_stream_wait(self->ep, id, (uintptr_t)stream, &queued);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return PyBool_FromLong(queued);
}

static PyObject *Endpoint_poll_async(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &id) || uccl__py_ep_check(self))
        return NULL;
    int done = 0;
    int rc = uccl_ep_poll(self->ep, id, &done);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    return Py_BuildValue("(OO)", Py_True, done ? Py_True : Py_False);
}

static PyObject *Endpoint_release(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t id;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &id) || uccl__py_ep_check(self))
        return NULL;
    int rc = uccl_ep_release(self->ep, id);
    if (rc)
        return uccl__py_ep_fail(self, rc);
    Py_RETURN_TRUE;
}

static PyObject *Endpoint_advertise(PyObject *op, PyObject *args)
{
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    uint64_t conn, mr, addr;
    size_t len;
    if (!PyArg_ParseTuple(args, "O&O&O&O&", uccl__py_to_u64, &conn, uccl__py_to_u64, &mr,
                          uccl__py_to_u64, &addr, uccl__py_to_size, &len) ||
        uccl__py_ep_check(self))
        return NULL;
    uint8_t buf[UCCL_FIFO_ITEM_SIZE];
    int rc = uccl_ep_advertise(self->ep, conn, mr, (uintptr_t)addr, len, buf, sizeof(buf));
    if (rc)
        return uccl__py_ep_fail(self, rc);
    PyObject *b = PyBytes_FromStringAndSize((const char *)buf, sizeof(buf));
    if (!b)
        return NULL;
    PyObject *res = Py_BuildValue("(OO)", Py_True, b);
    Py_DECREF(b);
    return res;
}

static PyObject *Endpoint_get_timeout(PyObject *op, void *closure)
{
    (void)closure;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    return PyFloat_FromDouble((double)uccl_ep_timeout_ns(self->ep) / 1e9);
}

static PyObject *Endpoint_get_host_id(PyObject *op, void *closure)
{
    (void)closure;
    uccl__py_endpoint *self = (uccl__py_endpoint *)op;
    if (uccl__py_ep_check(self))
        return NULL;
    return PyUnicode_FromString(uccl_ep_host_id(self->ep));
}

static PyObject *Endpoint_get_closed(PyObject *op, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((uccl__py_endpoint *)op)->ep == NULL);
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
    {"received_bytes", Endpoint_received_bytes, METH_VARARGS,
     "received_bytes(transfer_id) -> bytes the finished transfer moved (a recv's may be fewer "
     "than it posted: the size is a capacity)"},
    {"_ids_held", Endpoint_ids_held, METH_NOARGS,
     "_ids_held() -> transfer ids the engine's table holds"},
    {"remove_remote_endpoint", Endpoint_remove_remote_endpoint, METH_VARARGS,
     "remove_remote_endpoint(conn_id) -> True (closed and forgotten), False (no such "
     "connection)"},
    {"conn_peer_rank", Endpoint_conn_peer_rank, METH_VARARGS,
     "conn_peer_rank(conn_id) -> the rank the peer gave in its handshake (-1: none)"},
    {"reg", Endpoint_reg, METH_VARARGS, "reg(ptr, size) -> (True, mr_id)"},
    {"dereg", Endpoint_dereg, METH_VARARGS, "dereg(mr_id) -> True"},
    {"_post", Endpoint_post, METH_VARARGS, "_post(op, conn_id, mr_id, ptr, size, fifo=None, stream=0) -> id"},
    {"_transfer", Endpoint_transfer, METH_VARARGS,
     "_transfer(op, conn_id, mr_id, ptr, size, fifo=None, stream=0)"},
    {"wait", (PyCFunction)(void (*)(void))Endpoint_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(transfer_id, timeout=None) -> True; raises if the transfer failed"},
    {"poll_async", Endpoint_poll_async, METH_VARARGS, "poll_async(transfer_id) -> (True, is_done)"},
    {"_stream_wait", Endpoint_stream_wait, METH_VARARGS,
     "_stream_wait(transfer_id, stream) -> bool (the stream waits; False: host memory)"},
    {"release", Endpoint_release, METH_VARARGS, "release(transfer_id): forget a finished id"},
    {"advertise", Endpoint_advertise, METH_VARARGS,
     "advertise(conn_id, mr_id, addr, len) -> (True, fifo_item)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Endpoint_getset[] = {
    {"timeout_s", Endpoint_get_timeout, NULL, "default timeout of blocking calls, seconds", NULL},
    {"closed", Endpoint_get_closed, NULL, "True once close() ran", NULL},
    {"host_id", Endpoint_get_host_id, NULL,
     "this endpoint's host identity (peers with the same one may use shared memory)", NULL},
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

PyType_Spec uccl__py_endpoint_spec = {
    .name = "uccl_collective._engine.Endpoint",
    .basicsize = sizeof(uccl__py_endpoint),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Endpoint_slots,
};
