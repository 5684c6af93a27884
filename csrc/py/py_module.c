/* The module uccl_collective._engine (pyengine.h), the top of its files:
 * its functions, and multi-phase init, which makes the exception classes,
 * adds the types (Endpoint, Communicator, StreamGroup, GpuRing, Token,
 * FastPath) and the constants; its state's traverse and clear. */
#include "py/pyengine.h"
#include "sg/sgroup.h"

#include <string.h>

#include "net/wire.h"
#include "base/ptracer.h"
#include "base/sha256.h"

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
        return uccl__py_raise(module, rc, uccl_last_error());
    return Py_BuildValue("(sii)", ip, port, gpu);
}

static PyObject *mod_get_oob_ip(PyObject *module, PyObject *unused)
{
    (void)unused;
    char ip[64];
    int rc = uccl_local_ip(ip, sizeof(ip));
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return PyUnicode_FromString(ip);
}

static PyObject *mod_gpu_bus_id(PyObject *module, PyObject *args)
{
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    char bdf[32];
    int rc = uccl_gpu_bus_id(dev, bdf);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return PyUnicode_FromString(bdf);
}

static PyObject *mod_gpu_of_bus_id(PyObject *module, PyObject *args)
{
    const char *bdf;
    if (!PyArg_ParseTuple(args, "s", &bdf))
        return NULL;
    int dev;
    int rc = uccl_gpu_of_bus_id(bdf, &dev);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return PyLong_FromLong(dev);
}

static PyObject *mod_fifo_item(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned long long window, token, addr, len, base;
    if (!PyArg_ParseTuple(args, "KKKKK", &window, &token, &addr, &len, &base))
        return NULL;
    uint8_t out[64];
    uccl_fifo_make(window, token, addr, len, base, out);
    return PyBytes_FromStringAndSize((const char *)out, sizeof(out));
}

static PyObject *mod_fifo_fields(PyObject *module, PyObject *args)
{
    const char *in;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &in, &n))
        return NULL;
    uint64_t f[5];
    int rc = uccl_fifo_read((const uint8_t *)in, (size_t)n, f);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    return Py_BuildValue("(KKKKK)", (unsigned long long)f[0], (unsigned long long)f[1],
                         (unsigned long long)f[2], (unsigned long long)f[3],
                         (unsigned long long)f[4]);
}

/* The handshake's primitives, for their known-answer tests. */
static PyObject *mod_sha256(PyObject *module, PyObject *args)
{
    (void)module;
    const char *in;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &in, &n))
        return NULL;
    uint8_t out[UCCL_SHA256_BYTES];
    uccl__sha256(in, (size_t)n, out);
    return PyBytes_FromStringAndSize((const char *)out, sizeof(out));
}

static PyObject *mod_hmac_sha256(PyObject *module, PyObject *args)
{
    (void)module;
    const char *key, *in;
    Py_ssize_t klen, n;
    if (!PyArg_ParseTuple(args, "y#y#", &key, &klen, &in, &n))
        return NULL;
    uint8_t out[UCCL_SHA256_BYTES];
    uccl__hmac_sha256(key, (size_t)klen, in, (size_t)n, out);
    return PyBytes_FromStringAndSize((const char *)out, sizeof(out));
}

static PyObject *mod_ptracer(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    int scope;
    long want;
    unsigned peers;
    uccl__ptracer_state(&scope, &want, &peers);
    return Py_BuildValue("(ilI)", scope, want, peers);
}

static PyMethodDef module_methods[] = {
    {"_sha256", mod_sha256, METH_VARARGS, "_sha256(data) -> the engine's SHA-256 digest"},
    {"_hmac_sha256", mod_hmac_sha256, METH_VARARGS,
     "_hmac_sha256(key, data) -> the engine's HMAC-SHA256"},
    {"_ptracer", mod_ptracer, METH_NOARGS,
     "_ptracer() -> (Yama scope or -1, what this process asks of Yama: 0 nothing, -1 any, "
     "else a pid; peer processes granted)"},
    {"fifo_item", mod_fifo_item, METH_VARARGS,
     "fifo_item(window, token, addr, len, base) -> the 64-byte one-sided descriptor"},
    {"fifo_fields", mod_fifo_fields, METH_VARARGS,
     "fifo_fields(item) -> (window, token, addr, len, base), checked"},
    {"gpu_bus_id", mod_gpu_bus_id, METH_VARARGS,
     "gpu_bus_id(dev) -> the PCI bus id of CUDA device dev ('0000:3b:00.0')"},
    {"gpu_of_bus_id", mod_gpu_of_bus_id, METH_VARARGS,
     "gpu_of_bus_id(bdf) -> the index of this host's CUDA device with that PCI bus id"},
    {"parse_metadata", mod_parse_metadata, METH_VARARGS,
     "parse_metadata(bytes) -> (ip, port, gpu_idx)"},
    {"gpu_compile", uccl__py_gpu_compile, METH_VARARGS,
     "gpu_compile(dev, src, name, headers, options) -> kernel: NVRTC, loaded on device dev"},
    {"gpu_launch", uccl__py_gpu_launch, METH_VARARGS,
     "gpu_launch(kernel, grid, block, shmem, stream, params, offsets)"},
    {"nvrtc_set_path", uccl__py_nvrtc_set_path, METH_VARARGS,
     "nvrtc_set_path(path): the libnvrtc to try before the loader's search"},
    {"_gpu_host_register", uccl__py_gpu_host_register, METH_VARARGS,
     "_gpu_host_register(dev, addr, len): page-locked and mapped for every device"},
    {"_gpu_host_unregister", uccl__py_gpu_host_unregister, METH_VARARGS,
     "_gpu_host_unregister(dev, addr)"},
    {"sg_page_bytes", uccl__py_sg_page_bytes, METH_VARARGS,
     "sg_page_bytes(size) -> bytes of a stream-ordered group's shared file"},
    {"_sg_emu_stream", uccl__py_sg_emu_stream, METH_NOARGS,
     "_sg_emu_stream() -> an emulated stream (tests of StreamGroup without a GPU)"},
    {"_sg_emu_stream_free", uccl__py_sg_emu_stream_free, METH_VARARGS,
     "_sg_emu_stream_free(stream) -> how many of its waits were stuck"},
    {"_sg_emu_stale_passes", uccl__py_sg_emu_stale_passes, METH_NOARGS,
     "_sg_emu_stale_passes() -> waits of emulated streams that a stale word let pass"},
    {"_sg_emu_stream_idle", uccl__py_sg_emu_stream_idle, METH_VARARGS,
     "_sg_emu_stream_idle(stream, timeout_s) -> True once what it queued has run"},
    {"_sg_emu_graph", uccl__py_sg_emu_graph, METH_VARARGS,
     "_sg_emu_graph(what, a[, b]): begin/end (-> graph) a capture, launch/free a graph, "
     "launches (-> its one-launch rounds)"},
    {"fast_setup", uccl__py_fast_setup, METH_VARARGS,
     "fast_setup(tensor, strided, profiler_enabled, capturing, raw_stream, work): torch's "
     "pieces, for FastPath's calls"},
    {"config", uccl__py_config, METH_VARARGS,
     "config(name[, text]): an environment variable of the configuration table, parsed"},
    {"config_table", uccl__py_config_table, METH_NOARGS,
     "config_table(): (name, kind, default, meaning) of every variable"},
    {"get_oob_ip", mod_get_oob_ip, METH_NOARGS,
     "get_oob_ip() -> the IPv4 address endpoints advertise (UCCL_SOCKET_IFNAME)"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    uccl__py_state *st = uccl__py_state_of(m);
    st->error = PyErr_NewExceptionWithDoc("uccl_collective.UcclError",
                                          "A transfer or connection failed.", PyExc_RuntimeError,
                                          NULL);
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
    /* An id this side does not know: the caller's mistake (ValueError), and
     * a RuntimeError, which upstream's scripts catch there. */
    bases = PyTuple_Pack(2, PyExc_ValueError, PyExc_RuntimeError);
    if (!bases)
        return -1;
    st->unknown_id_error = PyErr_NewExceptionWithDoc(
        "uccl_collective.UcclUnknownIdError",
        "A conn_id, mr_id or transfer_id this endpoint does not know.", bases, NULL);
    Py_DECREF(bases);
    if (!st->unknown_id_error)
        return -1;
    /* The ranks' calls disagree (a size, an operation, a root): the
     * callers' mistake, as every argument error is (a ValueError). */
    st->mismatch_error = PyErr_NewExceptionWithDoc(
        "uccl_collective.UcclMismatchError",
        "The ranks' calls disagree (sizes, operations, roots): nothing of the mismatched "
        "data was written.", PyExc_ValueError, NULL);
    if (!st->mismatch_error)
        return -1;
    if (PyModule_AddObjectRef(m, "UcclMismatchError", st->mismatch_error) < 0 ||
        PyModule_AddObjectRef(m, "UcclError", st->error) < 0 ||
        PyModule_AddObjectRef(m, "UcclTimeoutError", st->timeout_error) < 0 ||
        PyModule_AddObjectRef(m, "UcclUnknownIdError", st->unknown_id_error) < 0)
        return -1;
    PyObject *ep_type = PyType_FromModuleAndSpec(m, &uccl__py_endpoint_spec, NULL);
    if (!ep_type)
        return -1;
    int rc = PyModule_AddObjectRef(m, "Endpoint", ep_type);
    Py_DECREF(ep_type);
    if (rc < 0)
        return -1;
    PyObject *comm_type = PyType_FromModuleAndSpec(m, &uccl__py_comm_spec, NULL);
    if (!comm_type)
        return -1;
    rc = PyModule_AddObjectRef(m, "Communicator", comm_type);
    Py_DECREF(comm_type);
    if (rc < 0)
        return -1;
    PyObject *sg_type = PyType_FromModuleAndSpec(m, &uccl__py_sgroup_spec, NULL);
    if (!sg_type)
        return -1;
    rc = PyModule_AddObjectRef(m, "StreamGroup", sg_type);
    st->sg_type = sg_type; /* the reference made here */
    if (rc < 0)
        return -1;
    PyObject *ring_type = PyType_FromModuleAndSpec(m, &uccl__py_ring_spec, NULL);
    if (!ring_type)
        return -1;
    rc = PyModule_AddObjectRef(m, "GpuRing", ring_type);
    Py_DECREF(ring_type);
    if (rc < 0)
        return -1;
    PyObject *token_type = PyType_FromModuleAndSpec(m, &uccl__py_token_spec, NULL);
    if (!token_type)
        return -1;
    rc = PyModule_AddObjectRef(m, "Token", token_type);
    st->token_type = token_type; /* the reference made here */
    if (rc < 0)
        return -1;
    PyObject *fp_type = PyType_FromModuleAndSpec(m, &uccl__py_fastpath_spec, NULL);
    if (!fp_type)
        return -1;
    rc = PyModule_AddObjectRef(m, "FastPath", fp_type);
    Py_DECREF(fp_type);
    if (rc < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "OP_SEND", UCCL_XFER_SEND) < 0 ||
        PyModule_AddIntConstant(m, "OP_RECV", UCCL_XFER_RECV) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", UCCL_XFER_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "OP_READ", UCCL_XFER_READ) < 0 ||
        PyModule_AddIntConstant(m, "XFER_CAPACITY", UCCL_XFER_CAPACITY) < 0 ||
        PyModule_AddIntConstant(m, "METADATA_SIZE", UCCL_META_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "FIFO_ITEM_SIZE", UCCL_FIFO_ITEM_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "AG_AUTO", UCCL_AG_AUTO) < 0 ||
        PyModule_AddIntConstant(m, "AG_DIRECT", UCCL_AG_DIRECT) < 0 ||
        PyModule_AddIntConstant(m, "AG_RING", UCCL_AG_RING) < 0 ||
        PyModule_AddIntConstant(m, "AG_NO_DIAGNOSIS", UCCL_AG_NO_DIAGNOSIS) < 0)
        return -1;
    static const struct { const char *name; int value; } sg_consts[] = {
        {"DT_F32", UCCL_DT_F32}, {"DT_F64", UCCL_DT_F64}, {"DT_F16", UCCL_DT_F16},
        {"DT_BF16", UCCL_DT_BF16}, {"DT_I8", UCCL_DT_I8}, {"DT_U8", UCCL_DT_U8},
        {"DT_I16", UCCL_DT_I16}, {"DT_I32", UCCL_DT_I32}, {"DT_I64", UCCL_DT_I64},
        {"DT_BOOL", UCCL_DT_BOOL}, {"RED_SUM", UCCL_RED_SUM}, {"RED_PROD", UCCL_RED_PROD},
        {"RED_MIN", UCCL_RED_MIN}, {"RED_MAX", UCCL_RED_MAX}, {"RED_BAND", UCCL_RED_BAND},
        {"RED_BOR", UCCL_RED_BOR}, {"RED_BXOR", UCCL_RED_BXOR}, {"RED_AVG", UCCL_RED_AVG},
        {"SG_MAX_RANKS", UCCL_SG_MAX_RANKS}, {"SG_P2P_SLOTS", UCCL_SG_P2P_SLOTS}, {"SG_FUSED_RANKS", UCCL_SG_FUSED_RANKS},
        {"SG_FUSED_TAIL", UCCL_SG_FUSED_TAIL},
    };
    for (size_t i = 0; i < sizeof(sg_consts) / sizeof(sg_consts[0]); i++)
        if (PyModule_AddIntConstant(m, sg_consts[i].name, sg_consts[i].value) < 0)
            return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    uccl__py_state *st = uccl__py_state_of(m);
    Py_VISIT(st->error);
    Py_VISIT(st->timeout_error);
    Py_VISIT(st->unknown_id_error);
    Py_VISIT(st->mismatch_error);
    Py_VISIT(st->sg_type);
    Py_VISIT(st->token_type);
    return uccl__py_fast_traverse(&st->fast, visit, arg);
}

static int module_clear(PyObject *m)
{
    uccl__py_state *st = uccl__py_state_of(m);
    Py_CLEAR(st->error);
    Py_CLEAR(st->timeout_error);
    uccl__py_fast_clear(&st->fast); /* first: FastPath reads the hooks while set up */
    Py_CLEAR(st->unknown_id_error);
    Py_CLEAR(st->mismatch_error);
    Py_CLEAR(st->sg_type);
    Py_CLEAR(st->token_type);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

struct PyModuleDef uccl__py_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "uccl_collective._engine",
    .m_doc = "The uccl-collective C engine.",
    .m_size = sizeof(uccl__py_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    return PyModuleDef_Init(&uccl__py_module_def);
}
