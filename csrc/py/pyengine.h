/* The extension module uccl_collective._engine, internal to its files
 * (the only ones that include Python.h, through this header), bottom to
 * top: a file calls only files listed before it here, never one after:
 *
 *   py_base.c      the module's state, engine statuses raised as
 *                  exceptions, the module found from a type, the clock,
 *                  the argument converters
 *   py_endpoint.c  the Endpoint type, over an engine endpoint (uccl.h)
 *   py_comm.c      the Communicator type, over an Endpoint (coll.h)
 *   py_ring.c      the GpuRing type and the kernel functions (ring.h)
 *   py_stream.c    host memory registered for the GPU (private functions)
 *   py_sgroup.c    the StreamGroup type, over a stream-ordered group (sgroup.h)
 *   py_sgroup_mod.c  the module's functions for stream-ordered groups, and
 *                  StreamGroup's methods for the emulated device's tests
 *   py_sgroup_lists.c  StreamGroup's methods that take lists (round,
 *                  all_to_all, p2p)
 *   py_token.c     the Token type: a process group's execution token
 *   py_fastpath.c  the FastPath type: the backend's blocking all_reduce,
 *                  all_gather_into_tensor and all_to_all_single (no split
 *                  sizes) on CUDA tensors in one call
 *   py_module.c    the module: its functions, init (the exceptions, the
 *                  types, the constants), traverse and clear
 *
 * so no two files call each other, directly or round a circle.
 *
 * Conventions (DESIGN.md §2.6): multi-phase init, heap types, the GIL
 * released around everything that can block, waits cut into slices with
 * PyErr_CheckSignals() between them so that Ctrl-C works, close()
 * idempotent and reused by dealloc.  Built against the stable ABI
 * (Py_LIMITED_API, CPython >= 3.10). */
#ifndef UCCL_PYENGINE_H
#define UCCL_PYENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "coll/coll.h"
#include "ep/uccl.h"

#define UCCL_PY_SLICE_NS 100000000ull /* 100 ms between signal checks */

/* What py_fastpath.c calls of torch's (given by fast_setup) and the names
 * of torch's attributes it reads, interned. */
enum {
    UCCL__PY_FAST_TENSOR,     /* torch.Tensor */
    UCCL__PY_FAST_STRIDED,    /* torch.strided */
    UCCL__PY_FAST_PROFILING,  /* torch.autograd._profiler_enabled */
    UCCL__PY_FAST_CAPTURING,  /* torch.cuda.is_current_stream_capturing */
    UCCL__PY_FAST_RAW_STREAM, /* dev -> the current stream's handle */
    UCCL__PY_FAST_WORK,       /* _work.StreamWork */
    UCCL__PY_FAST_HOOKS
};
#define UCCL__PY_FAST_NAMES 11 /* py_fastpath.c: its names, asserted equal */
struct uccl__py_fast {
    PyObject *hook[UCCL__PY_FAST_HOOKS];
    PyObject *retired; /* a list: the hooks fast_setup() replaced, kept */
    PyObject *name[UCCL__PY_FAST_NAMES];
};

typedef struct {
    PyObject *error;         /* UcclError(RuntimeError) */
    PyObject *timeout_error; /* UcclTimeoutError(UcclError, TimeoutError) */
    PyObject *unknown_id_error; /* UcclUnknownIdError(ValueError, RuntimeError) */
    PyObject *mismatch_error; /* UcclMismatchError(ValueError) */
    PyObject *sg_type;       /* StreamGroup */
    PyObject *token_type;    /* Token */
    struct uccl__py_fast fast; /* py_fastpath.c; empty until fast_setup() */
} uccl__py_state;

typedef struct {
    PyObject_HEAD
    uccl_ep_t *ep;
    uccl_comm_t *comm;       /* the communicator over this endpoint (py_comm.c); destroyed
                                with the engine, before it */
    PyObject *module;        /* strong ref: where the exceptions live */
    int inflight;            /* calls running without the GIL (uccl__py_ep_enter/leave) */
    int closed;
} uccl__py_endpoint;

/* ---- py_base.c ---- */
extern struct PyModuleDef uccl__py_module_def; /* (py_module.c's; module_of compares it) */
uccl__py_state *uccl__py_state_of(PyObject *module);
uint64_t uccl__py_mono_ns(void);
/* Raise the exception that fits status (ValueError, UcclMismatchError,
 * UcclError, UcclTimeoutError, MemoryError) with msg; returns NULL. */
PyObject *uccl__py_raise(PyObject *module, int status, const char *msg);
/* This extension's module, found through tp's MRO (tp may be a Python
 * subclass of one of our types); a new reference, or NULL with TypeError. */
PyObject *uccl__py_module_of(PyTypeObject *tp);
/* PyArg "O&" converters: a non-negative integer (pointer or id), a size. */
int uccl__py_to_u64(PyObject *o, void *out);
int uccl__py_to_size(PyObject *o, void *out);

/* ---- py_endpoint.c ---- */
extern PyType_Spec uccl__py_endpoint_spec;
/* -1 with ValueError if the endpoint is closed. */
int uccl__py_ep_check(uccl__py_endpoint *self);
/* o as an Endpoint of this module (a subclass too), or NULL with TypeError
 * naming `what` (the caller) and o. */
uccl__py_endpoint *uccl__py_endpoint_arg(PyObject *module, PyObject *o, const char *what);
/* Raise status with the engine's message for this thread. */
PyObject *uccl__py_ep_fail(uccl__py_endpoint *self, int status);
/* A call that releases the GIL holds the engine alive: close() from another
 * thread then only fails what is pending (waking this call), and the last
 * call to leave frees the engine.  Both run with the GIL held. */
void uccl__py_ep_enter(uccl__py_endpoint *self);
void uccl__py_ep_leave(uccl__py_endpoint *self);
/* A timeout argument in seconds (None: the endpoint's); *err on a bad one. */
double uccl__py_timeout_arg(uccl__py_endpoint *self, PyObject *timeout, int *err);
/* Wait without the GIL, in slices with Ctrl-C checked between them:
 * wait_slice(self, arg) (one slice of at most UCCL_PY_SLICE_NS) until it
 * returns other than UCCL_INPROGRESS (0, that status in *rc_p); -1 with an
 * exception set when a signal came or check(self), made before every
 * slice, failed (the endpoint was closed). */
int uccl__py_wait_sliced(uccl__py_endpoint *self, int (*check)(uccl__py_endpoint *),
                         int (*wait_slice)(uccl__py_endpoint *, void *), void *arg, int *rc_p);
/* The arg of the waits for one id (a transfer, an operation) until a deadline. */
struct uccl__py_wait_id {
    uint64_t id, deadline;
};

/* ---- py_comm.c ---- */
extern PyType_Spec uccl__py_comm_spec;

/* ---- py_ring.c ---- */
extern PyType_Spec uccl__py_ring_spec;
PyObject *uccl__py_gpu_compile(PyObject *module, PyObject *args);
PyObject *uccl__py_gpu_launch(PyObject *module, PyObject *args);
PyObject *uccl__py_nvrtc_set_path(PyObject *module, PyObject *args);

/* ---- py_stream.c ---- */
PyObject *uccl__py_gpu_host_register(PyObject *module, PyObject *args);
PyObject *uccl__py_gpu_host_unregister(PyObject *module, PyObject *args);

/* ---- py_sgroup.c ---- */
typedef struct {
    PyObject_HEAD
    struct uccl_sg *sg;
    void *cuda;                  /* the CUDA device (owned by sg), or NULL: emulated */
    void *emu;                   /* the emulated device: kept after close (its counts) */
    PyObject *module;            /* strong ref: the exceptions */
    uccl__py_endpoint *endpoint; /* strong ref, or NULL (emulated) */
    PyObject *owner;             /* strong ref: what keeps the page mapped (its mmap) */
    int inflight;                /* rounds running without the GIL (under the GIL) */
    int close_pending;           /* close() came from inside a round (a signal handler) */
    int dev;
} uccl__py_sgroup;

extern PyType_Spec uccl__py_sgroup_spec;
/* The group, open and over an open endpoint; else NULL with an exception. */
uccl__py_sgroup *uccl__py_sg_open(PyObject *op);
/* py_sgroup.c: a round's call, run without the GIL by run_round, which
 * returns its number (or NULL with its error); the (caller, caller_waits,
 * end_event) at the front of a method's args (0, and *at past them; -1
 * with an exception), and the args after them (a new tuple). */
struct uccl_sg_opts; /* sg/sgroup.h */
typedef int (*uccl__py_sg_call_fn)(struct uccl_sg *sg, const struct uccl_sg_opts *o, void *arg,
                                   uint32_t *k);
PyObject *uccl__py_sg_run_round(uccl__py_sgroup *self, struct uccl_sg_opts *o,
                                uccl__py_sg_call_fn fn, void *arg);
int uccl__py_sg_opts_arg(PyObject *args, Py_ssize_t *at, struct uccl_sg_opts *o);
PyObject *uccl__py_sg_rest(PyObject *args, Py_ssize_t at);
/* py_sgroup_lists.c: StreamGroup.round, all_to_all, p2p */
PyObject *uccl__py_sg_round(PyObject *op, PyObject *args);
PyObject *uccl__py_sg_all_to_all(PyObject *op, PyObject *args);
PyObject *uccl__py_sg_p2p(PyObject *op, PyObject *args);
PyObject *uccl__py_sg_page_bytes(PyObject *module, PyObject *args);
PyObject *uccl__py_sg_emu_stream(PyObject *module, PyObject *unused);
PyObject *uccl__py_sg_emu_stream_free(PyObject *module, PyObject *args);
PyObject *uccl__py_sg_emu_stream_idle(PyObject *module, PyObject *args);
PyObject *uccl__py_sg_emu_graph(PyObject *module, PyObject *args);
PyObject *uccl__py_sg_emu_stale_passes(PyObject *module, PyObject *unused);
/* A collective's buffers and type, as StreamGroup's methods parse them
 * (a, b: the operation's two pointers; root where it has one). */
struct uccl__py_coll_args {
    uintptr_t a, b;
    size_t count;
    int dtype, op, root;
};
/* The backend's fast path (py_fastpath.c), as a round on the caller's
 * stream, which waits for it: an all_reduce (in place at a: count elements
 * of dtype, op), an allgather (count bytes from a into b), or an all_to_all
 * of equal chunks (count bytes a chunk, from a + r x count to rank r, into
 * b + r x count from rank r); its number, or NULL with the round's error. */
enum { UCCL__PY_FAST_ALLREDUCE, UCCL__PY_FAST_ALLGATHER, UCCL__PY_FAST_ALL_TO_ALL };
PyObject *uccl__py_sg_fast_round(uccl__py_sgroup *self, uint64_t caller, int which,
                                 const struct uccl__py_coll_args *a);
/* py_sgroup_mod.c: StreamGroup's methods for the emulated device's tests */
PyObject *uccl__py_sg_emu_counts(PyObject *op, PyObject *unused);
PyObject *uccl__py_sg_emu_renumber(PyObject *op, PyObject *args);

/* ---- py_token.c ---- */
typedef struct {
    PyObject_HEAD
    PyObject *acquire, *release; /* the runner's Condition's (its lock's), bound */
    PyObject *notify_all;        /* the Condition's, bound */
    PyObject *q;                 /* the runner's queue: tasks waiting for the token */
    PyObject *closed, *poisoned; /* why the group refuses new tasks (None: it does not) */
    int busy;                    /* taken */
} uccl__py_token;

extern PyType_Spec uccl__py_token_spec;
/* Take the token if it is free, only trying its lock: 0 taken, -1 not
 * (an exception set only for one that is not an Exception). */
int uccl__py_token_try(uccl__py_token *t);
/* Give it back, waking the runner's waiters when a task is queued; the
 * error set before stays unless giving back fails (then that one). */
void uccl__py_token_give(uccl__py_token *t);

/* ---- py_fastpath.c ---- */
typedef struct {
    PyObject_HEAD
    PyObject *module;       /* strong ref: the hooks (the state's fast) */
    uccl__py_token *token;  /* the runner's */
    PyObject *group;        /* the Python StreamGroup (for the Work), or NULL */
    uccl__py_sgroup *c;     /* its engine object, or NULL */
    PyObject *codes;        /* (hash(reduceOp), dtype) -> (dtype code, op code), or () */
    long long size;
    int dev;                /* the group's device, or -1 */
    int closed;
} uccl__py_fastpath;

extern PyType_Spec uccl__py_fastpath_spec;
PyObject *uccl__py_fast_setup(PyObject *module, PyObject *args);
int uccl__py_fast_traverse(struct uccl__py_fast *f, visitproc visit, void *arg);
void uccl__py_fast_clear(struct uccl__py_fast *f);

/* ---- py_config.c ---- */
PyObject *uccl__py_config(PyObject *module, PyObject *args);
PyObject *uccl__py_config_table(PyObject *module, PyObject *unused);

#endif
