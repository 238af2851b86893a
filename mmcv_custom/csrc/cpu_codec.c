/*
 * mmcv_custom._cpu_codec: one-pass scale-and-cast between fp32 gradient
 * buckets and their fp16/bf16 wire copies, for the CPU (gloo) path of
 * mmcv_custom.hooks.cast, and blockwise int8 quantisation with error
 * feedback (mmcv_custom.hooks.int8_codec).
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
 * nothing and takes raw addresses: the Python caller (hooks/cast.py) checks
 * dtypes, devices, contiguity and sizes and keeps the tensors alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The largest int8 block (values sharing one scale) the kernels take. */
#define INT8_MAX_BLOCK 4096

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

/* ---- int8: blockwise symmetric quantisation ---------------------------- */
/* One block of `len` values v = src * prescale:
 *   scale = max|v| / 127 (NaN if the block holds a NaN),
 *   q     = clamp(round_half_even(v / scale), -127, 127), 0 where v / scale
 *           is NaN (an all-zero block: 0 / 0; an infinite value: inf / inf),
 *   e     = v - q * scale, what rounding dropped, or 0 where that is not
 *           finite (a block with a NaN or inf has nothing worth keeping).
 * The residual `r`, in `mode`:
 *   INT8_NO_RESIDUAL  not read or written;
 *   INT8_FEED         v += r first (error feedback), then r = e;
 *   INT8_COLLECT      r += e (v is not changed: the owner of a shard keeps
 *                     what re-quantizing the shard's sum drops).
 * Each step is one IEEE operation in fp32 (this file is compiled with
 * -ffp-contract=off: no fused multiply-add), so the result is bit for bit
 * that of the torch reference in mmcv_custom.hooks.int8_codec, on every
 * kernel set. Decoding is dst = q * scale, or dst += q * scale to sum
 * copies.
 *
 * Blocks are addressed in two ways: consecutive blocks of one array
 * (int8_encode / int8_decode), or a table of blocks, each with its own
 * offsets (int8_encode_table / int8_decode_table), which is how the DDP hook
 * cuts a bucket into per-parameter blocks and groups them by owner rank in
 * a single pass. */

enum { INT8_NO_RESIDUAL = 0, INT8_FEED = 1, INT8_COLLECT = 2 };

/* Columns of a block table row (int64). */
enum { T_SRC, T_RES, T_LEN, T_PAYLOAD, T_SCALE, T_COLS };

CODEC_INLINE float int8_keep(float e) { return e - e == 0.0f ? e : 0.0f; }

/* The scalar steps, for values [from, len) of a block (all of it in the
 * generic kernels, the tail after the vectors in the AVX2 one). First pass:
 * v = s * prescale (+ r), the largest |v| into *amax and any NaN into *nan
 * (NaN never enters *amax). Second pass: the int8 values and residual. */
CODEC_INLINE void int8_scan(const float *s, const float *r, int mode,
                            float prescale, float *v, Py_ssize_t from,
                            Py_ssize_t len, float *amax, int *nan) {
  for (Py_ssize_t i = from; i < len; ++i) {
    float x = s[i] * prescale;
    if (mode == INT8_FEED) x = x + r[i];
    v[i] = x;
    float a = x < 0.0f ? -x : x;
    *amax = a > *amax ? a : *amax;
    *nan |= x != x;
  }
}

CODEC_INLINE void int8_round(const float *v, float scale, int8_t *d,
                             float *r, int mode, Py_ssize_t from,
                             Py_ssize_t len) {
  for (Py_ssize_t i = from; i < len; ++i) {
    float q = v[i] / scale;
    q = q != q ? 0.0f : __builtin_nearbyintf(q);
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    d[i] = (int8_t)q;
    if (mode != INT8_NO_RESIDUAL) {
      float e = int8_keep(v[i] - q * scale);
      r[i] = mode == INT8_FEED ? e : r[i] + e;
    }
  }
}

CODEC_INLINE float int8_encode_block_body(const float *s, int8_t *d,
                                          float *r, int mode, Py_ssize_t len,
                                          float prescale) {
  float v[INT8_MAX_BLOCK];
  float amax = 0.0f;
  int nan = 0;
  int8_scan(s, r, mode, prescale, v, 0, len, &amax, &nan);
  float scale = nan ? (float)NAN : amax / 127.0f;
  int8_round(v, scale, d, r, mode, 0, len);
  return scale;
}

CODEC_INLINE void int8_decode_block_body(const int8_t *s, float scale,
                                         float *d, Py_ssize_t len,
                                         int accumulate) {
  if (accumulate) {
    for (Py_ssize_t i = 0; i < len; ++i) d[i] = d[i] + (float)s[i] * scale;
  } else {
    for (Py_ssize_t i = 0; i < len; ++i) d[i] = (float)s[i] * scale;
  }
}

/* Encode one block, return its scale; decode one block. */
typedef float (*int8_encode_fn)(const float *, int8_t *, float *, int,
                                Py_ssize_t, float);
typedef void (*int8_decode_fn)(const int8_t *, float, float *, Py_ssize_t,
                               int);

#define INT8_KERNELS(suffix, target)                                        \
  target static float int8_encode_##suffix(const float *s, int8_t *d,       \
                                           float *r, int mode,              \
                                           Py_ssize_t len, float k) {       \
    return int8_encode_block_body(s, d, r, mode, len, k);                   \
  }                                                                         \
  target static void int8_decode_##suffix(const int8_t *s, float scale,     \
                                          float *d, Py_ssize_t len,         \
                                          int acc) {                        \
    int8_decode_block_body(s, scale, d, len, acc);                          \
  }

INT8_KERNELS(base, )
#if CODEC_X86

/* AVX2 by hand: the compiler does not vectorise the rounding, NaN test
 * and int8 packing of the loop above. Same operations, same order, so the
 * same bits; the block's tail (len % 32) goes through the scalar steps. */
__attribute__((target("avx2"))) static float int8_encode_avx2(
    const float *s, int8_t *d, float *r, int mode, Py_ssize_t len,
    float prescale) {
  const __m256 k = _mm256_set1_ps(prescale);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256 zero = _mm256_setzero_ps();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  float v[INT8_MAX_BLOCK];
  Py_ssize_t vec = len & ~(Py_ssize_t)31;
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  Py_ssize_t i = 0;
  for (; i < vec; i += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), k);
    if (mode == INT8_FEED) x = _mm256_add_ps(x, _mm256_loadu_ps(r + i));
    _mm256_storeu_ps(v + i, x);
    /* max_ps(a, b) returns b when a is NaN: NaN never enters amax. */
    amax = _mm256_max_ps(_mm256_and_ps(x, abs_mask), amax);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float lanes[8], m = 0.0f;
  _mm256_storeu_ps(lanes, amax);
  for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  int any_nan = _mm256_movemask_ps(nan) != 0;
  int8_scan(s, r, mode, prescale, v, vec, len, &m, &any_nan);
  float scale = any_nan ? (float)NAN : m / 127.0f;
  const __m256 sc = _mm256_set1_ps(scale);
  for (i = 0; i < vec; i += 32) {
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) {
      __m256 x = _mm256_loadu_ps(v + i + 8 * j);
      __m256 q = _mm256_div_ps(x, sc);
      q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q)); /* NaN: 0 */
      q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
      if (mode != INT8_NO_RESIDUAL) {
        __m256 e = _mm256_sub_ps(x, _mm256_mul_ps(q, sc));
        /* e - e is 0 only where e is finite. */
        e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_sub_ps(e, e), zero,
                                           _CMP_EQ_OQ));
        if (mode == INT8_COLLECT)
          e = _mm256_add_ps(_mm256_loadu_ps(r + i + 8 * j), e);
        _mm256_storeu_ps(r + i + 8 * j, e);
      }
      qi[j] = _mm256_cvtps_epi32(q);
    }
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                   _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)(d + i),
                        _mm256_permutevar8x32_epi32(w, order));
  }
  int8_round(v, scale, d, r, mode, vec, len);
  return scale;
}

__attribute__((target("avx2"))) static void int8_decode_avx2(
    const int8_t *s, float scale, float *d, Py_ssize_t len, int accumulate) {
  int8_decode_block_body(s, scale, d, len, accumulate);
}
INT8_KERNELS(avx512, __attribute__((target("avx512f,avx512bw"))))
#endif

/* ---- kernel sets, one per instruction-set level ------------------------ */

typedef struct {
  const char *name;
  encode_fn bf16_encode;
  decode_fn bf16_decode;
  encode_fn fp16_encode; /* NULL: no fp16 here, the caller uses torch */
  decode_fn fp16_decode;
  int8_encode_fn int8_encode;
  int8_decode_fn int8_decode;
} kernel_set;

static const kernel_set kernel_sets[] = {
    {"generic", bf16_encode_base, bf16_decode_base, NULL, NULL,
     int8_encode_base, int8_decode_base},
#if CODEC_X86
    {"avx2", bf16_encode_avx2, bf16_decode_avx2, fp16_encode_f16c,
     fp16_decode_f16c, int8_encode_avx2, int8_decode_avx2},
    {"avx512", bf16_encode_avx512, bf16_decode_avx512, fp16_encode_avx512,
     fp16_decode_avx512, int8_encode_avx512, int8_decode_avx512},
#if CODEC_AVX512BF16
    {"avx512_bf16", bf16_encode_avx512bf16, bf16_decode_avx512,
     fp16_encode_avx512, fp16_decode_avx512, int8_encode_avx512,
     int8_decode_avx512},
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

/* addresses_ok: every address the call needs is non-null (or n == 0). */
static int check_int8(Py_ssize_t n, Py_ssize_t block, int addresses_ok) {
  if (n < 0) {
    PyErr_Format(PyExc_ValueError, "numel must be >= 0, got %zd", n);
    return 0;
  }
  if (block < 1 || block > INT8_MAX_BLOCK) {
    PyErr_Format(PyExc_ValueError,
                 "block must be in [1, %d], got %zd", INT8_MAX_BLOCK, block);
    return 0;
  }
  if (n > 0 && !addresses_ok) {
    PyErr_SetString(PyExc_ValueError, "null address");
    return 0;
  }
  return 1;
}

static PyObject *codec_int8_encode(PyObject *self, PyObject *args) {
  unsigned long long s, d, sc, r;
  Py_ssize_t n, block, start, len;
  float prescale;
  (void)self;
  if (!PyArg_ParseTuple(args, "KKKKnnf", &s, &d, &sc, &r, &n, &block,
                        &prescale))
    return NULL;
  if (!check_int8(n, block, s != 0 && d != 0 && sc != 0)) return NULL;
  {
    const float *src = (const float *)(uintptr_t)s;
    int8_t *dst = (int8_t *)(uintptr_t)d;
    float *scales = (float *)(uintptr_t)sc, *res = (float *)(uintptr_t)r;
    int mode = res != NULL ? INT8_FEED : INT8_NO_RESIDUAL;
    Py_BEGIN_ALLOW_THREADS
    for (start = 0; start < n; start += block) {
      len = n - start < block ? n - start : block;
      scales[start / block] = active->int8_encode(
          src + start, dst + start, res != NULL ? res + start : NULL, mode,
          len, prescale);
    }
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *codec_int8_decode(PyObject *self, PyObject *args) {
  unsigned long long s, sc, d;
  Py_ssize_t n, block, start, len;
  int accumulate;
  (void)self;
  if (!PyArg_ParseTuple(args, "KKKnnp", &s, &sc, &d, &n, &block,
                        &accumulate))
    return NULL;
  if (!check_int8(n, block, s != 0 && d != 0 && sc != 0)) return NULL;
  {
    const int8_t *src = (const int8_t *)(uintptr_t)s;
    const float *scales = (const float *)(uintptr_t)sc;
    float *dst = (float *)(uintptr_t)d;
    Py_BEGIN_ALLOW_THREADS
    for (start = 0; start < n; start += block) {
      len = n - start < block ? n - start : block;
      active->int8_decode(src + start, scales[start / block], dst + start,
                          len, accumulate);
    }
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

/* A block table: `rows` rows of T_COLS int64 each. Every length must be in
 * [1, INT8_MAX_BLOCK] and every offset >= 0; the caller (int8_codec's
 * BlockTable) keeps the offsets inside its tensors. */
static int check_table(const int64_t *table, Py_ssize_t rows,
                       int addresses_ok) {
  Py_ssize_t i;
  int c;
  if (rows < 0) {
    PyErr_Format(PyExc_ValueError, "rows must be >= 0, got %zd", rows);
    return 0;
  }
  if (rows > 0 && (table == NULL || !addresses_ok)) {
    PyErr_SetString(PyExc_ValueError, "null address");
    return 0;
  }
  for (i = 0; i < rows; ++i) {
    const int64_t *t = table + i * T_COLS;
    if (t[T_LEN] < 1 || t[T_LEN] > INT8_MAX_BLOCK) {
      PyErr_Format(PyExc_ValueError,
                   "block table row %zd: length must be in [1, %d], got %lld",
                   i, INT8_MAX_BLOCK, (long long)t[T_LEN]);
      return 0;
    }
    for (c = 0; c < T_COLS; ++c) {
      if (t[c] < 0) {
        PyErr_Format(PyExc_ValueError,
                     "block table row %zd: negative offset %lld", i,
                     (long long)t[c]);
        return 0;
      }
    }
  }
  return 1;
}

static PyObject *codec_int8_encode_table(PyObject *self, PyObject *args) {
  unsigned long long s, d, r, t;
  Py_ssize_t rows, i;
  float prescale;
  int mode;
  (void)self;
  if (!PyArg_ParseTuple(args, "KKKKnfi", &s, &d, &r, &t, &rows, &prescale,
                        &mode))
    return NULL;
  if (mode < INT8_NO_RESIDUAL || mode > INT8_COLLECT) {
    PyErr_Format(PyExc_ValueError,
                 "mode must be 0 (no residual), 1 (feed) or 2 (collect), "
                 "got %d", mode);
    return NULL;
  }
  if (!check_table((const int64_t *)(uintptr_t)t, rows,
                   s != 0 && d != 0 && (mode == INT8_NO_RESIDUAL || r != 0)))
    return NULL;
  {
    const float *src = (const float *)(uintptr_t)s;
    uint8_t *dst = (uint8_t *)(uintptr_t)d;
    float *res = (float *)(uintptr_t)r;
    const int64_t *table = (const int64_t *)(uintptr_t)t;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < rows; ++i) {
      const int64_t *row = table + i * T_COLS;
      /* The scale sits at any byte offset of the packed buffer. */
      float scale = active->int8_encode(
          src + row[T_SRC], (int8_t *)(dst + row[T_PAYLOAD]),
          mode != INT8_NO_RESIDUAL ? res + row[T_RES] : NULL, mode,
          (Py_ssize_t)row[T_LEN], prescale);
      memcpy(dst + row[T_SCALE], &scale, sizeof scale);
    }
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *codec_int8_decode_table(PyObject *self, PyObject *args) {
  unsigned long long s, d, t;
  Py_ssize_t rows, i;
  int accumulate;
  (void)self;
  if (!PyArg_ParseTuple(args, "KKKnp", &s, &d, &t, &rows, &accumulate))
    return NULL;
  if (!check_table((const int64_t *)(uintptr_t)t, rows, s != 0 && d != 0))
    return NULL;
  {
    const uint8_t *src = (const uint8_t *)(uintptr_t)s;
    float *dst = (float *)(uintptr_t)d;
    const int64_t *table = (const int64_t *)(uintptr_t)t;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < rows; ++i) {
      const int64_t *row = table + i * T_COLS;
      float scale;
      memcpy(&scale, src + row[T_SCALE], sizeof scale);
      active->int8_decode((const int8_t *)(src + row[T_PAYLOAD]), scale,
                          dst + row[T_SRC], (Py_ssize_t)row[T_LEN],
                          accumulate);
    }
    Py_END_ALLOW_THREADS
  }
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
    {"int8_encode", codec_int8_encode, METH_VARARGS,
     "int8_encode(src, dst, scales, residual, numel, block, prescale):\n"
     "blockwise symmetric int8 of fp32 src * prescale (+ residual, which\n"
     "then receives what rounding dropped; 0 for none), one fp32 scale per\n"
     "block; addresses."},
    {"int8_encode_table", codec_int8_encode_table, METH_VARARGS,
     "int8_encode_table(src, dst, residual, table, rows, prescale, mode):\n"
     "int8_encode for the blocks of a table (rows of src, residual,\n"
     "length, payload and scale offsets, int64): payload and fp32 scale go\n"
     "to byte offsets of dst; mode 0 no residual, 1 feed, 2 collect."},
    {"int8_decode_table", codec_int8_decode_table, METH_VARARGS,
     "int8_decode_table(src, dst, table, rows, accumulate): dst[src\n"
     "offset + i] (+)= payload[i] * scale for each block of the table,\n"
     "payload and scale read at their byte offsets of src; addresses."},
    {"int8_decode", codec_int8_decode, METH_VARARGS,
     "int8_decode(src, scales, dst, numel, block, accumulate):\n"
     "dst[i] (+)= src[i] * scales[i // block] in fp32; addresses."},
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
    "One-pass fp32 <-> fp16/bf16/int8 codecs for the CPU comm hooks.", -1,
    codec_methods, NULL, NULL, NULL, NULL,
};

/* The constants Python needs to drive the kernels, exported so that
 * int8_codec.py reads them instead of keeping copies in sync by hand. */
static int add_constants(PyObject *m) {
  static const struct { const char *name; long value; } constants[] = {
      {"INT8_MAX_BLOCK", INT8_MAX_BLOCK},
      {"INT8_NO_RESIDUAL", INT8_NO_RESIDUAL},
      {"INT8_FEED", INT8_FEED},
      {"INT8_COLLECT", INT8_COLLECT},
      {"T_SRC", T_SRC},
      {"T_RES", T_RES},
      {"T_LEN", T_LEN},
      {"T_PAYLOAD", T_PAYLOAD},
      {"T_SCALE", T_SCALE},
      {"T_COLS", T_COLS},
  };
  for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
    if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value))
      return -1;
  }
  return 0;
}

PyMODINIT_FUNC PyInit__cpu_codec(void) {
  detect_cpu();
  PyObject *m = PyModule_Create(&codec_module);
  if (m != NULL && add_constants(m) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
