/* StreamGroup's methods whose arguments are lists, parsed here with the
 * GIL held before the round runs without it (py_sgroup.c's run_round): the
 * general round (round: publications, pulls, copies, a reduction),
 * all_to_all (a chunk to and from each rank) and point-to-point messages
 * (p2p). */
#include <string.h>

#include "py/pyengine.h"

#include "sg/sgroup.h"

/* all_to_all's chunks, parsed with the GIL held */
struct a2a_call {
    struct uccl_sg_span send[UCCL_SG_MAX_RANKS], recv[UCCL_SG_MAX_RANKS];
};

static int do_all_to_all(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct a2a_call *g = p;
    return uccl_sg_all_to_all(sg, o, g->send, g->recv, k);
}

/* seq's got (ptr, nbytes) pairs into out; 0, or -1 with an exception set */
static int spans_arg(PyObject *seq, Py_ssize_t got, struct uccl_sg_span *out)
{
    for (Py_ssize_t i = 0; i < got; i++) {
        PyObject *it = PySequence_GetItem(seq, i);
        uint64_t ptr = 0;
        int ok = it && PyArg_ParseTuple(it, "O&O&", uccl__py_to_u64, &ptr, uccl__py_to_size,
                                        &out[i].len);
        Py_XDECREF(it);
        if (!ok)
            return -1;
        out[i].ptr = (uintptr_t)ptr;
    }
    return 0;
}

/* all_to_all(caller, caller_waits, end_event, sends, recvs): sends[r] and
 * recvs[r], (ptr, nbytes), the chunks to and from rank r */
PyObject *uccl__py_sg_all_to_all(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    struct uccl_sg_opts o;
    Py_ssize_t at;
    if (!self || uccl__py_sg_opts_arg(args, &at, &o))
        return NULL;
    PyObject *t = uccl__py_sg_rest(args, at), *sends, *recvs, *res = NULL;
    if (!t)
        return NULL;
    struct a2a_call *g = PyMem_Calloc(1, sizeof(*g));
    int n = uccl_sg_size(self->sg);
    Py_ssize_t ns = -1, nr = -1;
    if (!g)
        PyErr_NoMemory();
    else if (PyArg_ParseTuple(t, "OO:all_to_all", &sends, &recvs) &&
             (ns = PySequence_Size(sends)) >= 0 && (nr = PySequence_Size(recvs)) >= 0) {
        if (ns != n || nr != n)
            PyErr_Format(PyExc_ValueError, "all_to_all: %zd sends and %zd receives for a group "
                         "of %d", ns, nr, n);
        else if (!spans_arg(sends, ns, g->send) && !spans_arg(recvs, nr, g->recv))
            res = uccl__py_sg_run_round(self, &o, do_all_to_all, g);
    }
    PyMem_Free(g);
    Py_DECREF(t);
    return res;
}

/* The general round's lists, parsed with the GIL held. */
struct gen_call {
    struct uccl_sg_call c;
    struct uccl_sg_pub *pub;
    struct uccl_sg_pull *pull;
    struct uccl_sg_copy *copy;
    struct uccl_sg_red red;
};

static int do_round(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct gen_call *g = p;
    g->c.caller = o->caller;
    g->c.caller_waits = o->caller_waits;
    g->c.end_event = o->end_event;
    return uccl_sg_round(sg, &g->c, o->intr, o->intr_arg, k);
}

/* Each item of seq parsed into out[i] by fill (a tuple). */
static int parse_list(PyObject *seq, Py_ssize_t *n_p, void **out, size_t esz,
                      int (*fill)(void *out, Py_ssize_t i, PyObject *item))
{
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0)
        return -1;
    *out = PyMem_Calloc((size_t)(n ? n : 1), esz);
    if (!*out) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_GetItem(seq, i);
        int bad = !it || fill(*out, i, it);
        Py_XDECREF(it);
        if (bad)
            return -1;
    }
    *n_p = n;
    return 0;
}

static int fill_pub(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_pub *p = (struct uccl_sg_pub *)out + i;
    uint64_t ptr;
    return PyArg_ParseTuple(it, "O&O&O&", uccl__py_to_u64, &p->tag, uccl__py_to_u64, &ptr,
                            uccl__py_to_size, &p->len)
               ? (p->ptr = (uintptr_t)ptr, 0)
               : -1;
}

static int fill_pull(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_pull *p = (struct uccl_sg_pull *)out + i;
    uint64_t dst;
    return PyArg_ParseTuple(it, "iipO&O&O&O&", &p->peer, &p->phase, &p->exact, uccl__py_to_u64,
                            &p->tag, uccl__py_to_u64, &p->off, uccl__py_to_u64, &dst,
                            uccl__py_to_size, &p->len)
               ? (p->dst = (uintptr_t)dst, 0)
               : -1;
}

static int fill_copy(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_copy *p = (struct uccl_sg_copy *)out + i;
    uint64_t dst, src;
    return PyArg_ParseTuple(it, "O&O&O&", uccl__py_to_u64, &dst, uccl__py_to_u64, &src,
                            uccl__py_to_size, &p->len)
               ? (p->dst = (uintptr_t)dst, p->src = (uintptr_t)src, 0)
               : -1;
}

/* round(caller, caller_waits, end_event, what, kind, arg, phases, pub, pull, copy, red):
 * pub [(tag, ptr, len)], pull [(peer, phase, exact, tag, off, dst, len)],
 * copy [(dst, src, len)], red None or (dtype, op, tag, off, out, count). */
PyObject *uccl__py_sg_round(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    struct uccl_sg_opts o;
    Py_ssize_t at, npub = 0, npull = 0, ncopy = 0;
    if (!self || uccl__py_sg_opts_arg(args, &at, &o))
        return NULL;
    const char *what;
    unsigned int kind;
    uint64_t arg;
    int phases;
    PyObject *pubs, *pulls, *copies, *red, *res = NULL;
    PyObject *t = uccl__py_sg_rest(args, at);
    int ok = t && PyArg_ParseTuple(t, "sIO&iOOOO", &what, &kind, uccl__py_to_u64, &arg, &phases,
                                   &pubs, &pulls, &copies, &red);
    Py_XDECREF(t);
    if (!ok)
        return NULL;
    struct gen_call g;
    memset(&g, 0, sizeof(g));
    if (parse_list(pubs, &npub, (void **)&g.pub, sizeof(*g.pub), fill_pub) ||
        parse_list(pulls, &npull, (void **)&g.pull, sizeof(*g.pull), fill_pull) ||
        parse_list(copies, &ncopy, (void **)&g.copy, sizeof(*g.copy), fill_copy))
        goto out;
    if (npub > INT32_MAX || npull > INT32_MAX || ncopy > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "round: too many entries");
        goto out;
    }
    if (red != Py_None) {
        uint64_t out_ptr;
        if (!PyArg_ParseTuple(red, "iiO&O&O&O&", &g.red.dtype, &g.red.op, uccl__py_to_u64,
                              &g.red.tag, uccl__py_to_u64, &g.red.off, uccl__py_to_u64, &out_ptr,
                              uccl__py_to_size, &g.red.count))
            goto out;
        g.red.out = (uintptr_t)out_ptr;
        g.c.red = &g.red;
    }
    g.c.what = what;
    g.c.kind = kind;
    g.c.arg = arg;
    g.c.phases = phases;
    g.c.pub = g.pub;
    g.c.npub = (int)npub;
    g.c.pull = g.pull;
    g.c.npull = (int)npull;
    g.c.copy = g.copy;
    g.c.ncopy = (int)ncopy;
    res = uccl__py_sg_run_round(self, &o, do_round, &g);
out:
    PyMem_Free(g.pub);
    PyMem_Free(g.pull);
    PyMem_Free(g.copy);
    return res;
}

/* ---- point to point ------------------------------------------------------------------ */
struct p2p_call {
    struct uccl_sg_p2p_op *ops;
    int n;
    uint64_t *codes;
};

static int do_p2p(uccl_sg_t *sg, const struct uccl_sg_opts *o, void *p, uint32_t *k)
{
    struct p2p_call *a = p;
    *k = 0;
    return uccl_sg_p2p(sg, a->ops, a->n, o->caller, o->intr, o->intr_arg, a->codes);
}

static int fill_p2p(void *out, Py_ssize_t i, PyObject *it)
{
    struct uccl_sg_p2p_op *p = (struct uccl_sg_p2p_op *)out + i;
    uint64_t ptr, stream;
    return PyArg_ParseTuple(it, "ipO&O&O&", &p->peer, &p->send, uccl__py_to_u64, &ptr,
                            uccl__py_to_size, &p->len, uccl__py_to_u64, &stream)
               ? (p->ptr = (uintptr_t)ptr, p->stream = (uintptr_t)stream, 0)
               : -1;
}

/* p2p(caller, [(peer, send, ptr, len, stream)]) -> [code]: post the messages in order */
PyObject *uccl__py_sg_p2p(PyObject *op, PyObject *args)
{
    uccl__py_sgroup *self = uccl__py_sg_open(op);
    uint64_t caller;
    PyObject *items, *res = NULL;
    Py_ssize_t n = 0;
    struct p2p_call a = {NULL, 0, NULL};
    if (!self || !PyArg_ParseTuple(args, "O&O", uccl__py_to_u64, &caller, &items))
        return NULL;
    if (parse_list(items, &n, (void **)&a.ops, sizeof(*a.ops), fill_p2p))
        goto out;
    if (n < 1 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "p2p: %zd messages", n);
        goto out;
    }
    a.n = (int)n;
    a.codes = PyMem_Calloc((size_t)n, sizeof(uint64_t));
    if (!a.codes) {
        PyErr_NoMemory();
        goto out;
    }
    struct uccl_sg_opts o = {(uintptr_t)caller, 0, NULL, NULL, NULL};
    PyObject *k = uccl__py_sg_run_round(self, &o, do_p2p, &a);
    if (!k)
        goto out;
    Py_DECREF(k);
    res = PyList_New(n);
    for (Py_ssize_t i = 0; res && i < n; i++) {
        PyObject *c = PyLong_FromUnsignedLongLong(a.codes[i]);
        if (!c) {
            Py_CLEAR(res);
            break;
        }
        PyList_SetItem(res, i, c); /* steals c */
    }
out:
    PyMem_Free(a.ops);
    PyMem_Free(a.codes);
    return res;
}
