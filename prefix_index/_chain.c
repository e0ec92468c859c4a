/* The chained block hashes of a canonical prompt, in C: `prefix_index.hashing.block_hashes`.
 *
 * The same function as the pure-Python loop in prefix_index/hashing.py, which stays the
 * definition (and the fallback where this extension is not built): hash i is
 * XXH3_64bits_withSeed(data[start_i:end_i], hash i-1), seeded with the chain seed for block 0;
 * end_i is (i+1)·block_size moved back over at most 3 UTF-8 continuation bytes to a character
 * start. XXH3's output is stable since xxHash 0.8.0, so it equals the `xxhash` package's
 * `xxh3_64_intdigest` (tests/unit/prefix_index/test_chain_extension.py checks it on every
 * boundary case). xxHash is the header-only build of the system's libxxhash-dev (BSD-2-Clause):
 * nothing is linked at run time.
 *
 * Python: block_hashes(data: bytes-like, block_size_bytes: int >= 4, seed: int in [0, 2**64))
 *         -> list[int]; the argument checks are the Python wrapper's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define CONTINUATION_MASK 0xC0
#define CONTINUATION_BITS 0x80
#define MAX_BOUNDARY_BACKOFF_BYTES 3

static Py_ssize_t char_start(const unsigned char *data, Py_ssize_t end) {
    for (Py_ssize_t back = 1; back <= MAX_BOUNDARY_BACKOFF_BYTES; back++) {
        if ((data[end - back] & CONTINUATION_MASK) != CONTINUATION_BITS) {
            return end - back;
        }
    }
    return end; /* not UTF-8 here: keep the grid point */
}

static PyObject *block_hashes(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t block;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*nK", &buf, &block, &seed)) {
        return NULL;
    }
    if (block < 4) {
        PyBuffer_Release(&buf);
        return PyErr_Format(PyExc_ValueError, "block_size_bytes must be >= 4, got %zd", block);
    }
    const unsigned char *data = (const unsigned char *)buf.buf;
    Py_ssize_t n = buf.len;
    PyObject *out = PyList_New(n / block);
    if (out == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    XXH64_hash_t h = (XXH64_hash_t)seed;
    Py_ssize_t start = 0, i = 0;
    for (Py_ssize_t grid = block; grid <= n; grid += block, i++) {
        Py_ssize_t end = grid;
        if (end < n && (data[end] & CONTINUATION_MASK) == CONTINUATION_BITS) {
            end = char_start(data, end);
        }
        h = XXH3_64bits_withSeed(data + start, (size_t)(end - start), h);
        PyObject *value = PyLong_FromUnsignedLongLong((unsigned long long)h);
        if (value == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&buf);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
        start = end;
    }
    PyBuffer_Release(&buf);
    return out;
}


static PyMethodDef methods[] = {
    {"block_hashes", block_hashes, METH_VARARGS,
     "block_hashes(data, block_size_bytes, seed) -> list[int]: the chained XXH3 hashes of every full "
     "block (prefix_index.hashing.block_hashes, which checks the arguments)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "prefix_index._chain",
    "Chained block hashes in C (prefix_index.hashing.block_hashes is the definition and the fallback).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
