/* The two decoding calls of ops/cpu/decode.py as Python built-in functions.

   A KV-cached decoding step calls every connection once per token, and between two calls
   the branch's weights push everything else out of the caches. Through ctypes each call
   then also pays for ctypes' own cold path (its argument conversions, the call interface it
   prepares at every call). Inside a decoding step at batch 1 (d = 512, n = 4, one thread,
   Xeon with AVX-512, 2026-12-02) the merge call took 2.2 us from here against 4.9 us
   through ctypes, the maps call 21.7-22.4 against 22.0-22.9 us (two runs each of
   `python benchmarks/bench_decode_in_situ.py --batch 1 --kinds mhc --calls library` and
   `--calls ctypes`). These functions go straight to native.c's entry points:

       maps(call, x, a)          call->maps(call, x, a)
       merge(call, x, f, out)    call->merge(call, x, f, out)

   Each argument is an address (an int: ctypes.addressof of the prepared block, the tensors'
   data_ptr()). The block is native.c's decode_call, of which only its first two fields, the
   entry points, are read here. Like ctypes, the calls release the GIL while they run.

   build.py compiles this file against the running Python's headers, beside the library;
   where it cannot (no Python.h), decode.py calls the same entry points through ctypes. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct decode_call decode_call;
struct decode_call { /* the first fields of native.c's decode_call, in its order */
    void (*maps)(const decode_call* d, const void* x, void* a);
    void (*merge)(const decode_call* d, const void* x, const void* f, void* out);
};

/* args as `want` addresses in out; 0 with a TypeError or ValueError set otherwise. */
static int addresses(const char* name, PyObject* const* args, Py_ssize_t nargs,
                     Py_ssize_t want, void** out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s expects %zd addresses, got %zd arguments", name,
                     want, nargs);
        return 0;
    }
    for (Py_ssize_t i = 0; i < want; ++i) {
        if (!PyLong_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "%s expects int addresses, got %s for argument %zd",
                         name, Py_TYPE(args[i])->tp_name, i + 1);
            return 0;
        }
        out[i] = PyLong_AsVoidPtr(args[i]);
        if (out[i] == NULL && PyErr_Occurred()) return 0;
    }
    if (out[0] == NULL) {  /* a tensor's may be 0 (an empty one: no token is read) */
        PyErr_Format(PyExc_ValueError, "%s expects the call block's address, got 0", name);
        return 0;
    }
    return 1;
}

static PyObject* maps(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    void* p[3];
    if (!addresses("maps", args, nargs, 3, p)) return NULL;
    const decode_call* d = p[0];
    Py_BEGIN_ALLOW_THREADS
    d->maps(d, p[1], p[2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* merge(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    void* p[4];
    if (!addresses("merge", args, nargs, 4, p)) return NULL;
    const decode_call* d = p[0];
    Py_BEGIN_ALLOW_THREADS
    d->merge(d, p[1], p[2], p[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"maps", (PyCFunction)(void (*)(void))maps, METH_FASTCALL,
     "maps(call, x, a): a decoding call's maps and branch input (addresses)."},
    {"merge", (PyCFunction)(void (*)(void))merge, METH_FASTCALL,
     "merge(call, x, f, out): a decoding call's merge (addresses)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_decode_calls",
    "torch_mhc's decoding calls into its native library (ops/cpu/decode_calls.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__decode_calls(void) {
    PyObject* m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    /* a free-threaded Python would turn its GIL back on for a module that does not say this;
       the functions keep no state of their own (each thread decodes with its own block) */
    if (m != NULL && PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
