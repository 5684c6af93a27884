/* GPU-initiated transfers in Python (pyengine.h, ring.h): the GpuRing type
 * over an Endpoint, and the module functions that compile and launch
 * kernels (gpu_compile, gpu_launch, nvrtc_set_path), used by
 * uccl_collective.gpu_ring.
 *
 * A ring holds its endpoint's engine (uccl__py_ep_enter) from creation to
 * close(), so closing the endpoint first only fails what the proxy has in
 * flight; the engine goes when the ring does. */
#include "py/pyengine.h"
#include "ring/ring.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    uccl__py_endpoint *endpoint; /* strong ref, entered while ring is set */
    uccl_ring_t *ring;
    int users;                   /* calls using ring without the GIL */
    int closing;                 /* close() ran: the last user frees the ring */
} uccl__py_ring;

static int parse_dst(PyObject *item, unsigned i, struct uccl_ring_dst *d)
{
    const char *kind;
    PyObject *a, *b;
    if (!PyArg_ParseTuple(item, "sOO", &kind, &a, &b)) {
        PyErr_Format(PyExc_TypeError, "ring destination %u: expected ('local', ptr, size) or "
                     "('remote', conn_id, fifo_item)", i);
        return -1;
    }
    memset(d, 0, sizeof(*d));
    if (strcmp(kind, "local") == 0) {
        uint64_t p;
        d->kind = UCCL_RING_DST_LOCAL;
        if (!uccl__py_to_u64(a, &p) || !uccl__py_to_size(b, &d->len))
            return -1;
        d->addr = (uintptr_t)p;
        return 0;
    }
    if (strcmp(kind, "remote") != 0) {
        PyErr_Format(PyExc_ValueError, "ring destination %u: kind '%s' is neither 'local' nor "
                     "'remote'", i, kind);
        return -1;
    }
    d->kind = UCCL_RING_DST_REMOTE;
    char *bytes;
    Py_ssize_t n;
    if (!uccl__py_to_u64(a, &d->conn) || PyBytes_AsStringAndSize(b, &bytes, &n) < 0)
        return -1;
    if (n != (Py_ssize_t)sizeof(d->fifo)) {
        PyErr_Format(PyExc_ValueError, "ring destination %u: a fifo_item is %zu bytes, got %zd",
                     i, sizeof(d->fifo), n);
        return -1;
    }
    memcpy(d->fifo, bytes, sizeof(d->fifo));
    return 0;
}

/* GpuRing(endpoint, dev, slots, inflight, src_mr, src_ptr, src_len, dsts, trace=0, paused=False) */
static int Ring_init(PyObject *op, PyObject *args, PyObject *kw)
{
    uccl__py_ring *self = (uccl__py_ring *)op;
    static char *kwlist[] = {"endpoint", "dev", "slots", "inflight", "src_mr", "src_ptr",
                             "src_len", "dsts", "trace", "paused", NULL};
    PyObject *epo, *dsts;
    struct uccl_ring_opts o = {0};
    uint64_t src_ptr;
    Py_ssize_t trace = 0;
    int paused = 0;
    if (self->ring) {
        PyErr_SetString(PyExc_ValueError, "GpuRing.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiIIO&O&O&O|np", kwlist, &epo, &o.dev,
                                     &o.nslots, &o.inflight, uccl__py_to_u64, &o.src_mr,
                                     uccl__py_to_u64, &src_ptr, uccl__py_to_size, &o.src_len,
                                     &dsts, &trace, &paused))
        return -1;
    PyObject *mod = uccl__py_module_of(Py_TYPE(op));
    if (!mod)
        return -1;
    PyObject *ep_type = PyObject_GetAttrString(mod, "Endpoint");
    Py_DECREF(mod);
    int ok = ep_type && PyObject_IsInstance(epo, ep_type) == 1;
    Py_XDECREF(ep_type);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, "GpuRing: endpoint must be an Endpoint");
        return -1;
    }
    uccl__py_endpoint *ep = (uccl__py_endpoint *)epo;
    if (uccl__py_ep_check(ep))
        return -1;
    if (trace < 0) {
        PyErr_Format(PyExc_ValueError, "GpuRing: trace must be >= 0, got %zd", trace);
        return -1;
    }
    Py_ssize_t n = PySequence_Size(dsts);
    if (n < 0)
        return -1;
    if (n == 0 || n > 65536) {
        PyErr_Format(PyExc_ValueError, "GpuRing: %zd destinations (1..65536)", n);
        return -1;
    }
    struct uccl_ring_dst *d = PyMem_Calloc((size_t)n, sizeof(*d));
    if (!d)
        return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(dsts, i);
        int bad = !item || parse_dst(item, (unsigned)i, &d[i]);
        Py_XDECREF(item);
        if (bad) {
            PyMem_Free(d);
            return -1;
        }
    }
    o.src_addr = (uintptr_t)src_ptr, o.ndst = (unsigned)n, o.dsts = d;
    o.trace_len = (size_t)trace, o.paused = paused;
    uccl_ring_t *r = NULL;
    int rc;
    if (uccl__py_ep_check(ep)) { /* the destinations' items ran Python code meanwhile */
        PyMem_Free(d);
        return -1;
    }
    uccl__py_ep_enter(ep);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ring_create(ep->ep, &o, &r);
    Py_END_ALLOW_THREADS
    PyMem_Free(d);
    if (rc) {
        uccl__py_ep_fail(ep, rc);
        uccl__py_ep_leave(ep);
        return -1;
    }
    Py_INCREF(epo);
    self->endpoint = ep;
    self->ring = r;
    return 0;
}

/* Free the ring (with the GIL held; released around the proxy's stop). */
static void ring_free(uccl__py_ring *self)
{
    uccl_ring_t *r = self->ring;
    self->ring = NULL;
    Py_BEGIN_ALLOW_THREADS
    uccl_ring_destroy(r);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(self->endpoint);
    Py_CLEAR(self->endpoint);
}

/* A call that uses the ring without the GIL holds it: close() from another
 * thread meanwhile only marks it, and the last user out frees it. */
static void ring_enter(uccl__py_ring *self) { self->users++; }

static void ring_leave(uccl__py_ring *self)
{
    if (--self->users == 0 && self->closing && self->ring)
        ring_free(self);
}

static PyObject *Ring_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_ring *self = (uccl__py_ring *)op;
    if (!self->ring || self->closing)
        Py_RETURN_NONE;
    self->closing = 1;
    if (self->users == 0)
        ring_free(self);
    Py_RETURN_NONE;
}

static uccl_ring_t *ring_of(uccl__py_ring *self)
{
    if (!self->ring || self->closing) {
        PyErr_SetString(PyExc_ValueError, "the GPU ring is closed");
        return NULL;
    }
    return self->ring;
}

static PyObject *Ring_device_ptr(PyObject *op, void *closure)
{
    (void)closure;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    return r ? PyLong_FromUnsignedLongLong(uccl_ring_dev_ptr(r)) : NULL;
}

/* counters() -> (tickets, taken, done, error) */
static PyObject *Ring_counters(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_ring *self = (uccl__py_ring *)op;
    uccl_ring_t *r = ring_of(self);
    if (!r)
        return NULL;
    uint64_t c[4];
    int rc;
    ring_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ring_counters(r, c);
    Py_END_ALLOW_THREADS
    ring_leave(self);
    if (rc)
        return uccl__py_ep_fail(self->endpoint, rc);
    return Py_BuildValue("(KKKK)", (unsigned long long)c[0], (unsigned long long)c[1],
                         (unsigned long long)c[2], (unsigned long long)c[3]);
}

/* wait(count, timeout=None) -> True once count commands are done */
static PyObject *Ring_wait(PyObject *op, PyObject *args)
{
    uccl__py_ring *self = (uccl__py_ring *)op;
    unsigned long long count;
    PyObject *timeout = Py_None;
    uccl_ring_t *r = ring_of(self);
    if (!r || !PyArg_ParseTuple(args, "K|O", &count, &timeout))
        return NULL;
    double t = (double)uccl_ep_timeout_ns(self->endpoint->ep) / 1e9;
    if (timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (PyErr_Occurred())
            return NULL;
        if (!(t >= 0))
            return PyErr_Format(PyExc_ValueError, "timeout must be >= 0 seconds, got %R",
                                timeout);
    }
    if (t > 365.0 * 86400) /* "forever", kept finite in ns */
        t = 365.0 * 86400;
    uint64_t deadline = uccl__py_mono_ns() + (uint64_t)(t * 1e9);
    int rc = UCCL_INPROGRESS;
    ring_enter(self);
    while (rc == UCCL_INPROGRESS) { /* slices, with Ctrl-C and close() seen between them */
        if (self->closing) {
            PyErr_SetString(PyExc_ValueError, "the GPU ring was closed while waiting on it");
            break;
        }
        Py_BEGIN_ALLOW_THREADS
        rc = uccl_ring_wait(r, count, deadline, UCCL_PY_SLICE_NS);
        Py_END_ALLOW_THREADS
        if (rc == UCCL_INPROGRESS && PyErr_CheckSignals())
            break;
    }
    ring_leave(self);
    if (PyErr_Occurred())
        return NULL;
    if (rc)
        return uccl__py_ep_fail(self->endpoint, rc);
    Py_RETURN_TRUE;
}

static PyObject *Ring_error(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    char buf[512];
    if (!r)
        return NULL;
    uccl_ring_error(r, buf, sizeof(buf));
    return PyUnicode_FromString(buf);
}

static PyObject *Ring_pause(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    if (!r)
        return NULL;
    uccl_ring_pause(r);
    Py_RETURN_NONE;
}

static PyObject *Ring_resume(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    if (!r)
        return NULL;
    uccl_ring_resume(r);
    Py_RETURN_NONE;
}

/* trace() -> list of the sequence numbers issued, in order */
static PyObject *Ring_trace(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    if (!r)
        return NULL;
    size_t n, cap = 1 << 16;
    uint64_t *buf = NULL;
    for (;;) { /* grow until it holds them all */
        PyMem_Free(buf);
        buf = PyMem_Malloc(cap * sizeof(*buf));
        if (!buf)
            return PyErr_NoMemory();
        n = uccl_ring_trace(r, buf, cap);
        if (n < cap)
            break;
        cap *= 2;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(buf[i]);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SetItem(list, (Py_ssize_t)i, v);
    }
    PyMem_Free(buf);
    return list;
}

/* stats() -> (commands taken, transfers and copies started) */
static PyObject *Ring_stats(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl_ring_t *r = ring_of((uccl__py_ring *)op);
    if (!r)
        return NULL;
    uint64_t c[2];
    uccl_ring_stats(r, c);
    return Py_BuildValue("(KK)", (unsigned long long)c[0], (unsigned long long)c[1]);
}

/* put(dst, src_off, dst_off, length) -> seq: a host ring's put (GIL let go
 * while it waits for its slot) */
static PyObject *Ring_put(PyObject *op, PyObject *args)
{
    uccl__py_ring *self = (uccl__py_ring *)op;
    unsigned int dst;
    unsigned long long src_off, dst_off, len;
    uccl_ring_t *r = ring_of(self);
    if (!r || !PyArg_ParseTuple(args, "IKKK", &dst, &src_off, &dst_off, &len))
        return NULL;
    uint64_t seq = 0;
    int rc;
    ring_enter(self);
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_ring_host_put(r, dst, src_off, dst_off, len, &seq);
    Py_END_ALLOW_THREADS
    ring_leave(self);
    if (rc)
        return uccl__py_ep_fail(self->endpoint, rc);
    return PyLong_FromUnsignedLongLong(seq);
}

/* puts(dst, table) -> first sequence number: a host ring's put per row of
 * table (a buffer of n x 3 uint64: src_off, dst_off, length), in one call
 * (GIL let go), as a kernel's threads would put them */
static PyObject *Ring_puts(PyObject *op, PyObject *args)
{
    uccl__py_ring *self = (uccl__py_ring *)op;
    unsigned int dst;
    PyObject *tab;
    char *buf;
    Py_ssize_t len;
    uccl_ring_t *r = ring_of(self);
    if (!r || !PyArg_ParseTuple(args, "IO!", &dst, &PyBytes_Type, &tab) ||
        PyBytes_AsStringAndSize(tab, &buf, &len) < 0)
        return NULL;
    if (len % (3 * (Py_ssize_t)sizeof(uint64_t)))
        return PyErr_Format(PyExc_ValueError, "puts: the table is %zd bytes, not rows of "
                            "three uint64 (src_off, dst_off, length)", len);
    size_t n = (size_t)len / (3 * sizeof(uint64_t));
    uint64_t *t = PyMem_Malloc(n ? n * 3 * sizeof(uint64_t) : 1); /* (bytes may not be aligned) */
    if (!t)
        return PyErr_NoMemory();
    memcpy(t, buf, (size_t)len);
    uint64_t seq = 0, first = 0;
    int rc = UCCL_OK;
    ring_enter(self);
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n && rc == UCCL_OK; i++) {
        rc = uccl_ring_host_put(r, dst, t[3 * i], t[3 * i + 1], t[3 * i + 2], &seq);
        if (i == 0)
            first = seq;
    }
    Py_END_ALLOW_THREADS
    ring_leave(self);
    PyMem_Free(t);
    if (rc)
        return uccl__py_ep_fail(self->endpoint, rc);
    return PyLong_FromUnsignedLongLong(first);
}

static void Ring_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    PyObject *r = Ring_close(op, NULL);
    Py_XDECREF(r);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static int Ring_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((uccl__py_ring *)op)->endpoint);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

static PyMethodDef ring_methods[] = {
    {"close", Ring_close, METH_NOARGS,
     "close(): stop the proxy once what it took has finished, free the ring"},
    {"counters", Ring_counters, METH_NOARGS,
     "counters() -> (tickets handed out, commands taken, done, error: 0 or 1 + failed seq)"},
    {"wait", Ring_wait, METH_VARARGS,
     "wait(count, timeout=None) -> True once count commands are done; raises if the ring "
     "failed or the timeout passed"},
    {"error", Ring_error, METH_NOARGS, "error() -> why the ring failed ('' if it did not)"},
    {"pause", Ring_pause, METH_NOARGS, "pause(): the proxy takes no further command"},
    {"resume", Ring_resume, METH_NOARGS, "resume(): the proxy takes commands again"},
    {"trace", Ring_trace, METH_NOARGS,
     "trace() -> the sequence numbers issued, in order (as many as trace= allowed)"},
    {"stats", Ring_stats, METH_NOARGS,
     "stats() -> (commands taken, transfers and copies the proxy started for them)"},
    {"puts", Ring_puts, METH_VARARGS,
     "puts(dst, table) -> the first one's sequence number: a host ring's put per row of table "
     "(n x 3 uint64: src_off, dst_off, length), in one call"},
    {"put", Ring_put, METH_VARARGS,
     "put(dst, src_off, dst_off, length) -> sequence number: a host ring's put (dev -1)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ring_getset[] = {
    {"device_ptr", Ring_device_ptr, NULL,
     "device address of the ring's struct uccl_ring_dev (pass it to a kernel)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ring_slots[] = {
    {Py_tp_doc, "GpuRing(endpoint, dev, slots, inflight, src_mr, src_ptr, src_len, dsts, "
                "trace=0, paused=False): a command ring GPU kernels enqueue puts on, drained "
                "by a proxy thread of the endpoint (uccl_collective.gpu_ring wraps it)"},
    {Py_tp_init, Ring_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_traverse, Ring_traverse},
    {Py_tp_methods, ring_methods},
    {Py_tp_getset, ring_getset},
    {0, NULL},
};

PyType_Spec uccl__py_ring_spec = {
    .name = "uccl_collective._engine.GpuRing",
    .basicsize = sizeof(uccl__py_ring),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = ring_slots,
};

/* ---- kernels ------------------------------------------------------------- */

#define KERNEL_CAPSULE "uccl_collective.kernel"

static void kernel_capsule_free(PyObject *cap)
{
    uccl_gpu_kernel_free(PyCapsule_GetPointer(cap, KERNEL_CAPSULE));
}

/* The strings of a sequence (UTF-8, owned by the items in *keep: a new
 * list), field `field` of each tuple item when field >= 0. */
static const char **str_list(PyObject *seq, int field, Py_ssize_t *n_p, PyObject **keep)
{
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0 || !(*keep = PyList_New(0)))
        return NULL;
    const char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (!out)
        return (const char **)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i), *s = item;
        if (item && field >= 0)
            s = PySequence_Check(item) && PySequence_Size(item) == 2
                    ? PySequence_GetItem(item, field) : NULL;
        else
            Py_XINCREF(s);
        Py_XDECREF(item);
        if (!s && !PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "item %zd: expected a (name, text) pair", i);
        if (s && !PyUnicode_Check(s))
            PyErr_Format(PyExc_TypeError, "item %zd: expected str, got %R", i, s);
        if (!s || !PyUnicode_Check(s) || PyList_Append(*keep, s) < 0 ||
            !(out[i] = PyUnicode_AsUTF8AndSize(s, NULL))) {
            Py_XDECREF(s);
            PyMem_Free(out);
            return NULL;
        }
        Py_DECREF(s);
    }
    *n_p = n;
    return out;
}

/* gpu_compile(dev, src, name, headers: [(name, text)], options: [str]) -> kernel */
PyObject *uccl__py_gpu_compile(PyObject *module, PyObject *args)
{
    int dev;
    const char *src, *name;
    PyObject *hdrs, *opts, *k1 = NULL, *k2 = NULL, *k3 = NULL, *res = NULL;
    if (!PyArg_ParseTuple(args, "issOO", &dev, &src, &name, &hdrs, &opts))
        return NULL;
    Py_ssize_t nh = 0, nh2 = 0, no = 0;
    const char **hn = str_list(hdrs, 0, &nh, &k1);
    const char **hs = hn ? str_list(hdrs, 1, &nh2, &k2) : NULL;
    const char **ov = hs ? str_list(opts, -1, &no, &k3) : NULL;
    if (ov) {
        uccl_kernel_t *k = NULL;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = uccl_gpu_compile(dev, src, name, (int)nh, hn, hs, (int)no, ov, NULL, 0, &k);
        Py_END_ALLOW_THREADS
        if (rc)
            uccl__py_raise(module, rc, uccl_last_error());
        else if (!(res = PyCapsule_New(k, KERNEL_CAPSULE, kernel_capsule_free)))
            uccl_gpu_kernel_free(k);
    }
    PyMem_Free(hn);
    PyMem_Free(hs);
    PyMem_Free(ov);
    Py_XDECREF(k1);
    Py_XDECREF(k2);
    Py_XDECREF(k3);
    return res;
}

/* gpu_launch(kernel, (gx, gy, gz), (bx, by, bz), shmem, stream, params: bytes,
 * args: [(offset, size)]): each kernel parameter at its offset into params */
PyObject *uccl__py_gpu_launch(PyObject *module, PyObject *args)
{
    PyObject *cap, *pbytes, *offs;
    unsigned g[3], b[3], shmem;
    uint64_t stream;
    if (!PyArg_ParseTuple(args, "O(III)(III)IO&SO", &cap, &g[0], &g[1], &g[2], &b[0], &b[1],
                          &b[2], &shmem, uccl__py_to_u64, &stream, &pbytes, &offs))
        return NULL;
    uccl_kernel_t *k = PyCapsule_GetPointer(cap, KERNEL_CAPSULE);
    char *buf;
    Py_ssize_t len, n;
    if (!k || PyBytes_AsStringAndSize(pbytes, &buf, &len) < 0 || (n = PySequence_Size(offs)) < 0)
        return NULL;
    void **params = PyMem_Calloc((size_t)n + 1, sizeof(void *));
    size_t *sizes = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    if (!params || !sizes) {
        PyMem_Free(params);
        PyMem_Free(sizes);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(offs, i);
        Py_ssize_t off = -1, size = -1;
        int ok = item && PyArg_ParseTuple(item, "nn", &off, &size);
        Py_XDECREF(item);
        if (ok && (off < 0 || size <= 0 || off > len || size > len - off)) {
            PyErr_Format(PyExc_ValueError, "kernel argument %zd: %zd bytes at offset %zd of "
                         "%zd", i, size, off, len);
            ok = 0;
        }
        if (!ok) {
            PyMem_Free(params);
            PyMem_Free(sizes);
            return NULL;
        }
        params[i] = buf + off;
        sizes[i] = (size_t)size;
    }
    int rc = uccl_gpu_launch(k, g, b, shmem, (uintptr_t)stream, params, sizes, (int)n);
    PyMem_Free(params);
    PyMem_Free(sizes);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    Py_RETURN_NONE;
}

/* nvrtc_set_path(path) */
PyObject *uccl__py_nvrtc_set_path(PyObject *module, PyObject *args)
{
    (void)module;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    uccl_nvrtc_set_path(path);
    Py_RETURN_NONE;
}
