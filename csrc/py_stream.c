/* The module functions behind stream-ordered exchanges between processes of
 * one host (uccl.h, "Stream-ordered exchanges"; used by
 * uccl_collective/_stream_group.py).  Private to the package: the names
 * start with an underscore.
 *
 * A mapping of a peer's memory comes back as a capsule that unmaps it when
 * it is collected, so it is released once, whatever the caller does; the
 * caller keeps it until the copies queued from it have run. */
#include "pyengine.h"

#define IMPORT_CAPSULE "uccl_collective._engine.ipc_import"

static uccl__py_endpoint *endpoint_arg(PyObject *module, PyObject *o)
{
    uccl__py_endpoint *ep = uccl__py_endpoint_arg(module, o, "stream-ordered exchange");
    return ep && uccl__py_ep_check(ep) == 0 ? ep : NULL;
}

static PyObject *done(PyObject *module, int rc)
{
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    Py_RETURN_NONE;
}

/* _gpu_host_register(dev, addr, len) / _gpu_host_unregister(dev, addr) */
PyObject *uccl__py_gpu_host_register(PyObject *module, PyObject *args)
{
    int dev;
    uint64_t addr;
    size_t len;
    if (!PyArg_ParseTuple(args, "iO&O&", &dev, uccl__py_to_u64, &addr, uccl__py_to_size, &len))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_gpu_host_register(dev, (void *)(uintptr_t)addr, len);
    Py_END_ALLOW_THREADS
    return done(module, rc);
}

PyObject *uccl__py_gpu_host_unregister(PyObject *module, PyObject *args)
{
    int dev;
    uint64_t addr;
    if (!PyArg_ParseTuple(args, "iO&", &dev, uccl__py_to_u64, &addr))
        return NULL;
    return done(module, uccl_gpu_host_unregister(dev, (void *)(uintptr_t)addr));
}

/* _gpu_stream_ops(dev, stream, ops): queue ops on the stream in order, each
 * ("w", addr, value) a write, ("a", addr, value) a wait, or ("c", dst, src,
 * len) a copy.  One call for an operation's whole sequence: each costs a
 * microsecond or two of driver time, and a Python call apiece more. */
PyObject *uccl__py_gpu_stream_ops(PyObject *module, PyObject *args)
{
    int dev;
    uint64_t stream;
    PyObject *ops;
    if (!PyArg_ParseTuple(args, "iO&O", &dev, uccl__py_to_u64, &stream, &ops))
        return NULL;
    if (!PyList_Check(ops)) {
        PyErr_Format(PyExc_TypeError, "_gpu_stream_ops: ops must be a list, got %R", ops);
        return NULL;
    }
    Py_ssize_t n = PyList_Size(ops);
    int rc = UCCL_OK;
    for (Py_ssize_t i = 0; i < n && rc == UCCL_OK; i++) {
        PyObject *op = PyList_GetItem(ops, i); /* borrowed */
        const char *kind;
        uint64_t a = 0, b = 0;
        size_t len = 0;
        if (!PyTuple_Check(op) || PyTuple_Size(op) < 1) {
            PyErr_Format(PyExc_TypeError, "_gpu_stream_ops: op %zd is %R, not a tuple", i, op);
            return NULL;
        }
        int ok = PyTuple_Size(op) == 4
                     ? PyArg_ParseTuple(op, "sO&O&O&", &kind, uccl__py_to_u64, &a,
                                        uccl__py_to_u64, &b, uccl__py_to_size, &len)
                     : PyArg_ParseTuple(op, "sO&O&", &kind, uccl__py_to_u64, &a,
                                        uccl__py_to_u64, &b);
        if (!ok)
            return NULL;
        if (kind[0] == 'w' && !kind[1] && b <= UINT32_MAX)
            rc = uccl_gpu_stream_write32(dev, (uintptr_t)stream, (uintptr_t)a, (uint32_t)b);
        else if (kind[0] == 'a' && !kind[1] && b <= UINT32_MAX)
            rc = uccl_gpu_stream_wait32(dev, (uintptr_t)stream, (uintptr_t)a, (uint32_t)b);
        else if (kind[0] == 'c' && !kind[1] && PyTuple_Size(op) == 4)
            rc = uccl_gpu_copy_async(dev, (uintptr_t)stream, (uintptr_t)a, (uintptr_t)b, len);
        else {
            PyErr_Format(PyExc_ValueError, "_gpu_stream_ops: op %zd (%R) is none of ('w', addr, "
                         "u32), ('a', addr, u32), ('c', dst, src, len)", i, op);
            return NULL;
        }
    }
    return done(module, rc);
}

/* _ipc_key(endpoint, conn, mr, ptr, len) -> the key a peer maps it by */
PyObject *uccl__py_ipc_key(PyObject *module, PyObject *args)
{
    PyObject *epo;
    uint64_t conn, mr, ptr;
    size_t len;
    if (!PyArg_ParseTuple(args, "OO&O&O&O&", &epo, uccl__py_to_u64, &conn, uccl__py_to_u64, &mr,
                          uccl__py_to_u64, &ptr, uccl__py_to_size, &len))
        return NULL;
    uccl__py_endpoint *ep = endpoint_arg(module, epo);
    if (!ep)
        return NULL;
    uint64_t key = 0;
    int rc = uccl_ep_ipc_key(ep->ep, conn, mr, (uintptr_t)ptr, len, &key);
    if (rc)
        return uccl__py_ep_fail(ep, rc);
    return PyLong_FromUnsignedLongLong(key);
}

static void import_release(PyObject *cap)
{
    void *imp = PyCapsule_GetPointer(cap, IMPORT_CAPSULE);
    /* the last release of a mapping the owner has since freed closes it,
     * which may wait for the GPU: not with the GIL held */
    Py_BEGIN_ALLOW_THREADS
    uccl_ep_ipc_unmap(imp);
    Py_END_ALLOW_THREADS
}

/* _ipc_map(endpoint, conn, key, addr, len, dev) -> (ptr, mapping): the
 * peer's [addr, +len) on device dev, mapped while `mapping` lives. */
PyObject *uccl__py_ipc_map(PyObject *module, PyObject *args)
{
    PyObject *epo;
    uint64_t conn, key, addr;
    size_t len;
    int dev;
    if (!PyArg_ParseTuple(args, "OO&O&O&O&i", &epo, uccl__py_to_u64, &conn, uccl__py_to_u64,
                          &key, uccl__py_to_u64, &addr, uccl__py_to_size, &len, &dev))
        return NULL;
    uccl__py_endpoint *ep = endpoint_arg(module, epo);
    if (!ep)
        return NULL;
    void *ptr = NULL, *imp = NULL;
    int rc;
    uccl__py_ep_enter(ep);
    Py_BEGIN_ALLOW_THREADS /* the first mapping of an allocation opens its IPC handle */
    rc = uccl_ep_ipc_map(ep->ep, conn, key, addr, len, dev, &ptr, &imp);
    Py_END_ALLOW_THREADS
    uccl__py_ep_leave(ep);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    PyObject *cap = PyCapsule_New(imp, IMPORT_CAPSULE, import_release);
    if (!cap) {
        uccl_ep_ipc_unmap(imp);
        return NULL;
    }
    PyObject *res = Py_BuildValue("(KN)", (unsigned long long)(uintptr_t)ptr, cap);
    return res;
}
