/*
 * mmcv_custom._cpu_codec: one-pass scale-and-cast between fp32 gradient
 * buckets and their fp16/bf16 wire copies, for the CPU (gloo) path of
 * mmcv_custom.ddp_hooks.
 *
 * Why this exists: on CPU, torch cannot scale and change dtype in one pass.
 * A dtype-converting multiply allocates a temporary and copies it, and an
 * in-place multiply followed by a cast reads the bucket twice. Both sides of
 * the hook are memory-bound (12 bytes per element against 8 for a plain fp32
 * copy), so every extra pass shows. Here each direction is a single loop,
 * compiled for several instruction-set levels (generic, AVX2 with F16C,
 * AVX-512, AVX512-BF16); the best one the CPU runs is chosen at import, so
 * a build on a login node still runs on older compute nodes.
 *
 * Rounding matches torch's: round to nearest even; bf16 NaN becomes the
 * quiet NaN 0x7FC0; values beyond the range become inf. The module imports
 * nothing and takes raw addresses: the Python caller (ddp_hooks) checks
 * dtypes, devices, contiguity and sizes and keeps the tensors alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define CODEC_X86 1
#include <immintrin.h>
#else
#define CODEC_X86 0
#endif

/* The AVX512-BF16 conversion needs GCC >= 11 or clang >= 9 to compile. */
#if CODEC_X86 && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 11)
#define CODEC_AVX512BF16 1
#else
#define CODEC_AVX512BF16 0
#endif

#if defined(__GNUC__)
#define CODEC_INLINE static inline __attribute__((always_inline))
#else
#define CODEC_INLINE static inline
#endif

/* ---- bf16: integer rounding, vectorised by the compiler ---------------- */

CODEC_INLINE uint16_t bf16_from_bits(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* NaN */
  /* Round to nearest, ties to even, on the 16 bits that are dropped. */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

CODEC_INLINE void bf16_encode_body(const float *src, uint16_t *dst,
                                   Py_ssize_t n, float scale) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    float v = src[i] * scale;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    dst[i] = bf16_from_bits(bits);
  }
}

CODEC_INLINE void bf16_decode_body(const uint16_t *src, float *dst,
                                   Py_ssize_t n, float scale) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint32_t bits = (uint32_t)src[i] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    dst[i] = v * scale;
  }
}

typedef void (*encode_fn)(const float *, uint16_t *, Py_ssize_t, float);
typedef void (*decode_fn)(const uint16_t *, float *, Py_ssize_t, float);

static void bf16_encode_base(const float *s, uint16_t *d, Py_ssize_t n,
                             float k) {
  bf16_encode_body(s, d, n, k);
}
static void bf16_decode_base(const uint16_t *s, float *d, Py_ssize_t n,
                             float k) {
  bf16_decode_body(s, d, n, k);
}

#if CODEC_X86
/* The same loops, compiled for wider vectors; picked at import. */
__attribute__((target("avx2"))) static void bf16_encode_avx2(
    const float *s, uint16_t *d, Py_ssize_t n, float k) {
  bf16_encode_body(s, d, n, k);
}
__attribute__((target("avx2"))) static void bf16_decode_avx2(
    const uint16_t *s, float *d, Py_ssize_t n, float k) {
  bf16_decode_body(s, d, n, k);
}
__attribute__((target("avx512f,avx512bw")))
static void bf16_encode_avx512(const float *s, uint16_t *d, Py_ssize_t n,
                               float k) {
  bf16_encode_body(s, d, n, k);
}
__attribute__((target("avx512f,avx512bw")))
static void bf16_decode_avx512(const uint16_t *s, float *d, Py_ssize_t n,
                               float k) {
  bf16_decode_body(s, d, n, k);
}

#if CODEC_AVX512BF16
/* With AVX512-BF16 the conversion is one instruction (round to nearest
 * even), but it reads fp32 subnormals as zero: vectors holding one take the
 * integer path above, so the result does not depend on the CPU. */
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
static void bf16_encode_avx512bf16(const float *s, uint16_t *d, Py_ssize_t n,
                                   float k) {
  const __m512 scale = _mm512_set1_ps(k);
  Py_ssize_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + i), scale);
    /* fpclass 0x20: denormal; 0x81: NaN (kept canonical, 0x7FC0). */
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xa1) != 0, 0)) {
      bf16_encode_body(s + i, d + i, 16, k);
      continue;
    }
    _mm256_storeu_si256((__m256i *)(d + i),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
  bf16_encode_body(s + i, d + i, n - i, k);
}
#endif /* CODEC_AVX512BF16 */

/* ---- fp16: the F16C / AVX-512 conversion instructions ------------------ */
/* Compilers turn a scalar _Float16 cast into a library call unless the CPU
 * has AVX512-FP16, so these loops use the conversion instructions directly.
 * Rounding is to nearest even (the instructions' immediate), as torch's. */

#define F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

__attribute__((target("avx,f16c"))) static void fp16_encode_f16c(
    const float *s, uint16_t *d, Py_ssize_t n, float k) {
  const __m256 scale = _mm256_set1_ps(k);
  Py_ssize_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + i), scale);
    _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, F16_ROUND));
  }
  for (; i < n; ++i) d[i] = _cvtss_sh(s[i] * k, F16_ROUND);
}
__attribute__((target("avx,f16c"))) static void fp16_decode_f16c(
    const uint16_t *s, float *d, Py_ssize_t n, float k) {
  const __m256 scale = _mm256_set1_ps(k);
  Py_ssize_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
    _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(h), scale));
  }
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]) * k;
}
__attribute__((target("avx512f,f16c"))) static void fp16_encode_avx512(
    const float *s, uint16_t *d, Py_ssize_t n, float k) {
  const __m512 scale = _mm512_set1_ps(k);
  Py_ssize_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + i), scale);
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(v, F16_ROUND));
  }
  fp16_encode_f16c(s + i, d + i, n - i, k);
}
__attribute__((target("avx512f,f16c"))) static void fp16_decode_avx512(
    const uint16_t *s, float *d, Py_ssize_t n, float k) {
  const __m512 scale = _mm512_set1_ps(k);
  Py_ssize_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
    _mm512_storeu_ps(d + i, _mm512_mul_ps(_mm512_cvtph_ps(h), scale));
  }
  fp16_decode_f16c(s + i, d + i, n - i, k);
}
#endif /* CODEC_X86 */

/* ---- kernel sets, one per instruction-set level ------------------------ */

typedef struct {
  const char *name;
  encode_fn bf16_encode;
  decode_fn bf16_decode;
  encode_fn fp16_encode; /* NULL: no fp16 here, the caller uses torch */
  decode_fn fp16_decode;
} kernel_set;

static const kernel_set kernel_sets[] = {
    {"generic", bf16_encode_base, bf16_decode_base, NULL, NULL},
#if CODEC_X86
    {"avx2", bf16_encode_avx2, bf16_decode_avx2, fp16_encode_f16c,
     fp16_decode_f16c},
    {"avx512", bf16_encode_avx512, bf16_decode_avx512, fp16_encode_avx512,
     fp16_decode_avx512},
#if CODEC_AVX512BF16
    {"avx512_bf16", bf16_encode_avx512bf16, bf16_decode_avx512,
     fp16_encode_avx512, fp16_decode_avx512},
#endif
#endif
};

/* How many of kernel_sets this CPU can run (they are in rising order). */
static int n_supported = 1;
static const kernel_set *active = &kernel_sets[0];

static void detect_cpu(void) {
#if CODEC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    n_supported = 2;
  if (n_supported == 2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw"))
    n_supported = 3;
#if CODEC_AVX512BF16
  if (n_supported == 3 && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16"))
    n_supported = 4;
#endif
#endif
  active = &kernel_sets[n_supported - 1];
}

/* ---- Python entry points ------------------------------------------------ */

/* kind: 0 = fp16, 1 = bf16. Addresses come from Tensor.data_ptr(). */
static int parse(PyObject *args, uintptr_t *src, uintptr_t *dst,
                 Py_ssize_t *n, float *scale, int *kind) {
  unsigned long long s, d;
  if (!PyArg_ParseTuple(args, "KKnfi", &s, &d, n, scale, kind)) return 0;
  if (*n < 0) {
    PyErr_Format(PyExc_ValueError, "numel must be >= 0, got %zd", *n);
    return 0;
  }
  if (*kind != 0 && *kind != 1) {
    PyErr_Format(PyExc_ValueError, "kind must be 0 (fp16) or 1 (bf16), "
                 "got %d", *kind);
    return 0;
  }
  if (*kind == 0 && active->fp16_encode == NULL) {
    PyErr_Format(PyExc_RuntimeError,
                 "kernel set '%s' has no fp16 conversion (it needs F16C); "
                 "use torch's ops for fp16", active->name);
    return 0;
  }
  if (*n > 0 && (s == 0 || d == 0)) {
    PyErr_SetString(PyExc_ValueError, "null address");
    return 0;
  }
  *src = (uintptr_t)s;
  *dst = (uintptr_t)d;
  return 1;
}

static PyObject *codec_encode(PyObject *self, PyObject *args) {
  uintptr_t src, dst;
  Py_ssize_t n;
  float scale;
  int kind;
  (void)self;
  if (!parse(args, &src, &dst, &n, &scale, &kind)) return NULL;
  Py_BEGIN_ALLOW_THREADS
  (kind ? active->bf16_encode : active->fp16_encode)((const float *)src,
                                                     (uint16_t *)dst, n, scale);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* decode walks the buffer from its end, block by block (each block
 * forwards, for the prefetchers): encode and then the all-reduce leave the
 * end of the buffers in cache, so the first blocks hit it. */
#define DECODE_BLOCK 4096

static PyObject *codec_decode(PyObject *self, PyObject *args) {
  uintptr_t src, dst;
  Py_ssize_t n, start, len;
  float scale;
  int kind;
  decode_fn fn;
  (void)self;
  if (!parse(args, &src, &dst, &n, &scale, &kind)) return NULL;
  fn = kind ? active->bf16_decode : active->fp16_decode;
  Py_BEGIN_ALLOW_THREADS
  for (start = n; start > 0; start -= len) {
    len = start < DECODE_BLOCK ? start : DECODE_BLOCK;
    fn((const uint16_t *)src + (start - len), (float *)dst + (start - len),
       len, scale);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *codec_supported(PyObject *self, PyObject *unused) {
  PyObject *names = PyTuple_New(n_supported);
  int i;
  (void)self;
  (void)unused;
  if (names == NULL) return NULL;
  for (i = 0; i < n_supported; ++i) {
    PyObject *name = PyUnicode_FromString(kernel_sets[i].name);
    if (name == NULL) {
      Py_DECREF(names);
      return NULL;
    }
    PyTuple_SET_ITEM(names, i, name);
  }
  return names;
}

static PyObject *codec_isa(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(active->name);
}

static PyObject *codec_has_fp16(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(active->fp16_encode != NULL);
}

static PyObject *codec_use(PyObject *self, PyObject *args) {
  const char *name;
  int i;
  (void)self;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  for (i = 0; i < n_supported; ++i) {
    if (strcmp(kernel_sets[i].name, name) == 0) {
      active = &kernel_sets[i];
      Py_RETURN_NONE;
    }
  }
  PyErr_Format(PyExc_ValueError,
               "kernel set '%s' is not one this CPU runs; choose from the "
               "names supported() returns", name);
  return NULL;
}

static PyMethodDef codec_methods[] = {
    {"encode", codec_encode, METH_VARARGS,
     "encode(src, dst, numel, scale, kind): dst[i] = half(src[i] * scale)\n"
     "for fp32 src and fp16 (kind 0) or bf16 (kind 1) dst, given as "
     "addresses."},
    {"decode", codec_decode, METH_VARARGS,
     "decode(src, dst, numel, scale, kind): dst[i] = float(src[i]) * scale\n"
     "for fp16 (kind 0) or bf16 (kind 1) src and fp32 dst; dst may not\n"
     "overlap src."},
    {"supported", codec_supported, METH_NOARGS,
     "supported(): names of the kernel sets this CPU runs, the best last."},
    {"isa", codec_isa, METH_NOARGS, "isa(): the kernel set in use."},
    {"has_fp16", codec_has_fp16, METH_NOARGS,
     "has_fp16(): whether the kernel set in use converts fp16."},
    {"use", codec_use, METH_VARARGS,
     "use(name): switch to another supported kernel set (for tests and\n"
     "benchmarks; the best one is chosen at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef codec_module = {
    PyModuleDef_HEAD_INIT, "_cpu_codec",
    "One-pass fp32 <-> fp16/bf16 scale-and-cast for the CPU comm hooks.", -1,
    codec_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu_codec(void) {
  detect_cpu();
  return PyModule_Create(&codec_module);
}
