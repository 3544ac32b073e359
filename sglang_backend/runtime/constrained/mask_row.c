/* The grammar mask on a CPU logits row, one call per row (mask_row.py): row[j] = -inf where bit j of `bits` (one
 * bit per token, little-endian, as llguidance packs its masks) is 0, and at every column j >= n_bits; allowed
 * logits are not touched. A 64-token word that allows every token is skipped, one that allows none is stored
 * without reading the row, the others are blended 8 lanes at a time (load, blend, store: vmaskmovps stores are
 * microcoded on AMD CPUs, 3x slower here).
 * Built with MASK_ROW_PYTHON (where Python's headers are installed) it is also a Python extension module whose
 * mask_row(row_ptr, width, bits, n_bits) calls it: ~5 us less per call than ctypes on a cold cache. */
#ifdef MASK_ROW_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first, as Python asks */
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void grammar_mask_row(float *row, int64_t width, const uint8_t *bits, int64_t n_bits) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i zero = _mm256_setzero_si256();
    const int64_t n = n_bits < width ? n_bits : width;
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        uint64_t word;
        memcpy(&word, bits + (j >> 3), sizeof word);
        if (word == UINT64_MAX) continue;
        float *r = row + j;
        if (word == 0) {
            for (int i = 0; i < 64; i += 8) _mm256_storeu_ps(r + i, ninf);
            continue;
        }
        for (int b = 0; b < 8; b++) {
            const __m256i lane = _mm256_and_si256(_mm256_set1_epi32((int)(word >> (8 * b)) & 0xFF), lane_bit);
            const __m256 forbidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, zero));
            _mm256_storeu_ps(r + 8 * b, _mm256_blendv_ps(_mm256_loadu_ps(r + 8 * b), ninf, forbidden));
        }
    }
    for (; j < n; j++)
        if (!(bits[j >> 3] >> (j & 7) & 1)) row[j] = -INFINITY;
    for (; j < width; j++) row[j] = -INFINITY;
}

#ifdef MASK_ROW_PYTHON
static PyObject *mask_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "mask_row(row_ptr: int, width: int, bits: bytes, n_bits: int)");
        return NULL;
    }
    float *row = (float *)PyLong_AsVoidPtr(args[0]);
    const long long width = PyLong_AsLongLong(args[1]), n_bits = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (width < 0 || n_bits < 0 || (n_bits + 7) / 8 > PyBytes_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_ValueError, "mask_row: negative width, or fewer bits than n_bits");
        return NULL;
    }
    grammar_mask_row(row, width, (const uint8_t *)PyBytes_AS_STRING(args[2]), n_bits);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"mask_row", (PyCFunction)(void (*)(void))mask_row, METH_FASTCALL, "grammar_mask_row on a row's address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "grammar_mask_row", NULL, -1, methods};

PyMODINIT_FUNC PyInit_grammar_mask_row(void) { return PyModule_Create(&module); }
#endif
