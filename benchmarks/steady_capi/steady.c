#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The steady host half's per-request work through the CPython API: an experiment for
   benchmarks/steady_capi/bench.py, not a part of the package.

   steady(states, need, at, words, bs) -> bool
   need, at: int64 buffers [bs]; words: int64 buffer [8*bs+...]
   For each request: offset = state.position_offset; require offset == need[i] + 1;
   token = state.generated_tokens[at[i]]; words[7bs+i] = token; words[bs+i] = need[i] (prefix);
   words[4bs+i] = offset; words[6bs+i] = need[i]; then need[i] = offset, at[i] += 1. */
static PyObject *s_offset, *s_generated;

static PyObject *steady(PyObject *self, PyObject *args) {
    PyObject *states, *need_o, *at_o, *words_o;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OOOOn", &states, &need_o, &at_o, &words_o, &bs)) return NULL;
    Py_buffer nb, ab, wb;
    if (PyObject_GetBuffer(need_o, &nb, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(at_o, &ab, PyBUF_WRITABLE) < 0) { PyBuffer_Release(&nb); return NULL; }
    if (PyObject_GetBuffer(words_o, &wb, PyBUF_WRITABLE) < 0) { PyBuffer_Release(&nb); PyBuffer_Release(&ab); return NULL; }
    int64_t *need = nb.buf, *at = ab.buf, *w = wb.buf;
    PyObject *res = Py_False;
    if (!PyList_Check(states) || PyList_GET_SIZE(states) != bs) {
        PyErr_SetString(PyExc_TypeError, "steady: states must be a list of bs request states");
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(states);
    /* first pass: check, no writes */
    for (Py_ssize_t i = 0; i < bs; i++) {
        PyObject *o = PyObject_GetAttr(items[i], s_offset);
        if (!o) goto fail;
        long long off = PyLong_AsLongLong(o); Py_DECREF(o);
        if (off != need[i] + 1) goto done;
        PyObject *g = PyObject_GetAttr(items[i], s_generated);
        if (!g) goto fail;
        int ok = PyList_Check(g) && at[i] >= 0 && at[i] < PyList_GET_SIZE(g);
        if (ok) w[7 * bs + i] = PyLong_AsLongLong(PyList_GET_ITEM(g, at[i]));
        Py_DECREF(g);
        if (!ok) goto done;
        w[4 * bs + i] = off;
    }
    for (Py_ssize_t i = 0; i < bs; i++) {
        w[bs + i] = need[i]; w[6 * bs + i] = need[i];
        need[i] = w[4 * bs + i]; at[i] += 1;
    }
    res = Py_True;
done:
    PyBuffer_Release(&nb); PyBuffer_Release(&ab); PyBuffer_Release(&wb);
    Py_INCREF(res);
    return res;
fail:
    PyBuffer_Release(&nb); PyBuffer_Release(&ab); PyBuffer_Release(&wb);
    return NULL;
}

static PyMethodDef M[] = {{"steady", steady, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "steady_c", NULL, -1, M};
PyMODINIT_FUNC PyInit_steady_c(void) {
    s_offset = PyUnicode_InternFromString("position_offset");
    s_generated = PyUnicode_InternFromString("generated_tokens");
    return PyModule_Create(&mod);
}
