/* The module's functions for stream-ordered groups (sgroup.h): the shared
 * page's size, and the emulated streams the CPU tests queue on
 * (tests/test_stream_group.py, test_stream_p2p.py). */
#include "pyengine.h"

#include "sgroup.h"

PyObject *uccl__py_sg_page_bytes(PyObject *module, PyObject *args)
{
    (void)module;
    int size;
    if (!PyArg_ParseTuple(args, "i", &size))
        return NULL;
    if (size < 1 || size > UCCL_SG_MAX_RANKS)
        return PyErr_Format(PyExc_ValueError, "sg_page_bytes: %d ranks (1..%d)", size,
                            UCCL_SG_MAX_RANKS);
    return PyLong_FromSize_t(uccl_sg_page_bytes(size));
}

PyObject *uccl__py_sg_emu_stream(PyObject *module, PyObject *unused)
{
    (void)unused;
    uintptr_t s = 0;
    int rc = uccl_sg_emu_stream_new(&s);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return PyLong_FromUnsignedLongLong((unsigned long long)s);
}

/* _sg_emu_stream_free(stream) -> how many waits ran past the stuck bound */
PyObject *uccl__py_sg_emu_stream_free(PyObject *module, PyObject *args)
{
    (void)module;
    uint64_t s;
    if (!PyArg_ParseTuple(args, "O&", uccl__py_to_u64, &s))
        return NULL;
    int stuck;
    Py_BEGIN_ALLOW_THREADS
    stuck = uccl_sg_emu_stream_free((uintptr_t)s);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(stuck);
}

/* _sg_emu_stream_idle(stream, timeout_s) -> True once all it queued has run */
PyObject *uccl__py_sg_emu_stream_idle(PyObject *module, PyObject *args)
{
    (void)module;
    uint64_t s;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "O&d", uccl__py_to_u64, &s, &timeout_s))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = uccl_sg_emu_stream_idle((uintptr_t)s, (uint64_t)(timeout_s * 1e9));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == UCCL_OK);
}
