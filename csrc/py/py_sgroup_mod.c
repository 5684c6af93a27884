/* The module's functions for stream-ordered groups (sgroup.h): the shared
 * page's size, and the emulated streams the CPU tests queue on
 * (tests/test_stream_group.py, test_stream_p2p.py); and StreamGroup's
 * methods for those tests (emu_counts, emu_renumber). */
#include <string.h>

#include "py/pyengine.h"

#include "sg/sgroup.h"

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

/* _sg_emu_stale_passes() -> waits a stale word let pass, in this process so far */
PyObject *uccl__py_sg_emu_stale_passes(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(uccl_sg_emu_stale_passes());
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

/* _sg_emu_graph(what, a[, b]): the emulated CUDA graphs (sg_dev.h):
 * "begin", stream: capture; "end", stream -> graph; "launch", graph,
 * stream: queue a replay; "free", graph. */
PyObject *uccl__py_sg_emu_graph(PyObject *module, PyObject *args)
{
    const char *what;
    uint64_t a, b = 0;
    if (!PyArg_ParseTuple(args, "sO&|O&", &what, uccl__py_to_u64, &a, uccl__py_to_u64, &b))
        return NULL;
    uintptr_t graph = 0;
    int rc;
    if (!strcmp(what, "begin"))
        rc = uccl_sg_emu_capture_begin((uintptr_t)a);
    else if (!strcmp(what, "end"))
        rc = uccl_sg_emu_capture_end((uintptr_t)a, &graph);
    else if (!strcmp(what, "launch"))
        rc = uccl_sg_emu_graph_launch((uintptr_t)a, (uintptr_t)b);
    else if (!strcmp(what, "free")) {
        uccl_sg_emu_graph_free((uintptr_t)a);
        rc = UCCL_OK;
    } else if (!strcmp(what, "launches")) {
        graph = (uintptr_t)uccl_sg_emu_graph_launches((uintptr_t)a);
        rc = UCCL_OK;
    } else
        return PyErr_Format(PyExc_ValueError, "_sg_emu_graph: %s? (begin, end, launch, free, "
                            "launches)", what);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return PyLong_FromUnsignedLongLong((unsigned long long)graph);
}

/* emu_counts() -> (registrations made, released, mappings live) */
PyObject *uccl__py_sg_emu_counts(PyObject *op, PyObject *unused)
{
    (void)unused;
    uccl__py_sgroup *self = (uccl__py_sgroup *)op;
    long c[3] = {0, 0, 0};
    if (!self->emu) {
        PyErr_SetString(PyExc_ValueError, "emu_counts: not an emulated group");
        return NULL;
    }
    uccl_sg_emu_counts(self->emu, c);
    return Py_BuildValue("(lll)", c[0], c[1], c[2]);
}

/* emu_renumber(rounds, messages[, lag]): tests of the numbers' wrap
 * (uccl_sg_round_renumber, uccl_sg_p2p_renumber) */
PyObject *uccl__py_sg_emu_renumber(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    unsigned int rounds, messages, lag = 0;
    if (!self || !PyArg_ParseTuple(args, "II|I", &rounds, &messages, &lag))
        return NULL;
    if (!self->emu)
        return PyErr_Format(PyExc_ValueError, "emu_renumber: not an emulated group");
    int rc;
    Py_BEGIN_ALLOW_THREADS /* the group's locks: a round holding one takes the GIL */
    rc = uccl_sg_round_renumber(self->sg, (uint32_t)rounds, (uint32_t)lag);
    if (!rc)
        rc = uccl_sg_p2p_renumber(self->sg, (uint32_t)messages, (uint32_t)lag);
    Py_END_ALLOW_THREADS
    if (rc)
        return uccl__py_raise(self->module, rc, uccl_last_error());
    Py_RETURN_NONE;
}
