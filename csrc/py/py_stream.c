/* Host memory registered for the GPU: the page of a stream-ordered group
 * (uccl_collective/core/stream_group.py), which every process of the group maps
 * and whose words the streams write and wait for (sgroup.h).  Private to
 * the package: the names start with an underscore. */
#include "py/pyengine.h"

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
