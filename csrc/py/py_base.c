/* The bottom of the module's files (pyengine.h): what every other file of
 * the module uses and nothing of theirs: the module's state, engine
 * statuses raised as exceptions, this module found from a type, the
 * clock, and the argument converters.  It calls no other file of py/. */
#include "py/pyengine.h"

#include <time.h>

uccl__py_state *uccl__py_state_of(PyObject *module)
{
    return (uccl__py_state *)PyModule_GetState(module);
}

uint64_t uccl__py_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Raise the exception that fits status, with the engine's message. */
PyObject *uccl__py_raise(PyObject *module, int status, const char *msg)
{
    uccl__py_state *st = uccl__py_state_of(module);
    PyObject *type;
    switch (status) {
    case UCCL_ERR_NOTFOUND:
        type = st->unknown_id_error;
        break;
    case UCCL_ERR_MISMATCH:
        type = st->mismatch_error;
        break;
    case UCCL_ERR_INVALID:
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

PyObject *uccl__py_module_of(PyTypeObject *tp)
{
    PyObject *mro = PyObject_GetAttrString((PyObject *)tp, "__mro__");
    if (!mro)
        return NULL;
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_Size(mro) && !found; i++) {
        PyObject *m = PyType_GetModule((PyTypeObject *)PyTuple_GetItem(mro, i));
        if (m && PyModule_GetDef(m) == &uccl__py_module_def) {
            Py_INCREF(m);
            found = m;
        }
        PyErr_Clear();
    }
    Py_DECREF(mro);
    if (!found)
        PyErr_Format(PyExc_TypeError, "%R: cannot find the _engine module", (PyObject *)tp);
    return found;
}

int uccl__py_to_u64(PyObject *o, void *out)
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

int uccl__py_to_size(PyObject *o, void *out)
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
