/* The configuration table (base/config.h) for the Python package:
 * config(name) reads a variable as the engine does (one parser for both
 * languages), config_table() lists the table for the docs and the tests. */
#include "py/pyengine.h"

#include <string.h>

#include "base/config.h"

static const char *const kind_names[] = {
    [UCCL_CFG_INT] = "int", [UCCL_CFG_SIZE] = "size", [UCCL_CFG_BOOL] = "bool",
    [UCCL_CFG_CHOICE] = "choice", [UCCL_CFG_STR] = "str",
};

/* config(name[, text]): the variable's value from the environment (or
 * `text` parsed as its kind would be): int for INT and SIZE (bytes), bool
 * for BOOL, the word as written in the table for CHOICE, str or None (unset)
 * for STR.  ValueError names the variable and the value. */
PyObject *uccl__py_config(PyObject *module, PyObject *args)
{
    const char *name, *text = NULL;
    if (!PyArg_ParseTuple(args, "s|z:config", &name, &text))
        return NULL;
    int id = uccl__cfg_find(name);
    if (id < 0)
        return PyErr_Format(PyExc_KeyError, "%s is not a variable of base/config.h's table", name);
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    long v = 0;
    int rc;
    if (e->kind == UCCL_CFG_STR) {
        const char *s = text;
        if (!text && (rc = uccl__cfg_str(id, &s)))
            return uccl__py_raise(module, rc, uccl_last_error());
        return s && *s ? PyUnicode_FromString(s) : Py_NewRef(Py_None);
    }
    if (text && *text)
        rc = uccl__cfg_parse(id, text, &v);
    else if (text) /* empty: the default, as an empty variable */
        rc = (v = e->dflt, UCCL_OK);
    else if (e->kind == UCCL_CFG_CHOICE) {
        int idx = 0;
        rc = uccl__cfg_choice(id, &idx);
        v = idx;
    } else
        rc = uccl__cfg_long(id, &v);
    if (rc)
        return uccl__py_raise(module, rc, uccl_last_error());
    if (e->kind == UCCL_CFG_BOOL)
        return PyBool_FromLong(v);
    if (e->kind != UCCL_CFG_CHOICE)
        return PyLong_FromLong(v);
    const char *w = e->choices; /* the v-th word */
    for (long i = 0; i < v; i++)
        w = strchr(w, '|') + 1;
    const char *bar = strchr(w, '|');
    return PyUnicode_FromStringAndSize(w, bar ? bar - w : (Py_ssize_t)strlen(w));
}

/* config_table(): one (name, kind, default as the docs show it, meaning)
 * per variable, in the table's order. */
PyObject *uccl__py_config_table(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    PyObject *out = PyTuple_New(UCCL_CFG_COUNT);
    for (int i = 0; out && i < UCCL_CFG_COUNT; i++) {
        const struct uccl_cfg_entry *e = uccl__cfg_entry(i);
        PyObject *row = Py_BuildValue("(ssss)", e->name, kind_names[e->kind], e->dflt_text, e->doc);
        if (!row) {
            Py_CLEAR(out);
            break;
        }
        if (PyTuple_SetItem(out, i, row) < 0) { /* steals row */
            Py_CLEAR(out);
            break;
        }
    }
    return out;
}
