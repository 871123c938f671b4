/* Reference FWHT in C: in place, iterative, float32, cache-blocked.
 *
 * Unnormalized Sylvester-ordered Walsh-Hadamard transform of x[0..n), n a
 * power of two (the transform of fedlite_jax.transforms.fwht.fwht). Single thread.
 * Built by benchmarks/bench_fwht.py at run time:
 *   gcc -O3 -march=native -shared -fPIC fwht.c -o libfwht.so
 *
 * Layout (three phases, each a pass over the data that stays in one cache
 * level):
 *   1. levels 0..3 (h = 1, 2, 4, 8) in registers: one 16-float vector (GCC
 *      vector extension, AVX-512 with -march=native) is transformed by four
 *      shuffle + multiply-add steps;
 *   2. levels 4..log2(BLOCK)-1 inside each BLOCK-float block (32 KiB, L1):
 *      radix-4 passes (two levels per pass), vectorized over the block;
 *   3. levels log2(BLOCK).. (strides >= BLOCK): the array viewed as
 *      R = n / BLOCK rows of BLOCK floats is transformed along the row axis,
 *      one column panel of W floats at a time: the R x W panel is copied into
 *      a contiguous buffer (<= 1 MiB, L2; avoids power-of-two-stride set
 *      conflicts), transformed with radix-4 passes over rows, copied back.
 * Memory traffic: about two passes over x (one for phases 1-2, one for 3).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

#define VL 16
#define BLOCK_LOG2 13
#define BLOCK (1u << BLOCK_LOG2)

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Levels 0..3 on each 16-float vector of x[0..n), n a multiple of 16. */
static void levels_in_register(float *x, size_t n) {
  const i16 p1 = {1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14};
  const i16 p2 = {2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13};
  const i16 p4 = {4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11};
  const i16 p8 = {8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7};
  const v16 s1 = {1,-1,1,-1,1,-1,1,-1,1,-1,1,-1,1,-1,1,-1};
  const v16 s2 = {1,1,-1,-1,1,1,-1,-1,1,1,-1,-1,1,1,-1,-1};
  const v16 s4 = {1,1,1,1,-1,-1,-1,-1,1,1,1,1,-1,-1,-1,-1};
  const v16 s8 = {1,1,1,1,1,1,1,1,-1,-1,-1,-1,-1,-1,-1,-1};
  for (size_t i = 0; i < n; i += VL) {
    v16 v = ld(x + i);
    v = v * s1 + __builtin_shuffle(v, p1);
    v = v * s2 + __builtin_shuffle(v, p2);
    v = v * s4 + __builtin_shuffle(v, p4);
    v = v * s8 + __builtin_shuffle(v, p8);
    st(x + i, v);
  }
}

/* One radix-4 pass (levels h and 2h) over x[0..n): groups of 4h rows of
 * `width` floats; h, width multiples of VL/width as used below. Element
 * (row r, col c) is x[r * width + c]; here width = 1 row = 1 float for the
 * in-block case with h >= VL, so rows are contiguous runs of h floats. */
static void radix4_pass(float *x, size_t n, size_t h) {
  for (size_t g = 0; g < n; g += 4 * h) {
    float *a = x + g, *b = a + h, *c = b + h, *d = c + h;
    for (size_t j = 0; j < h; j += VL) {
      v16 va = ld(a + j), vb = ld(b + j), vc = ld(c + j), vd = ld(d + j);
      v16 s0 = va + vb, s1 = va - vb, s2 = vc + vd, s3 = vc - vd;
      st(a + j, s0 + s2); st(b + j, s1 + s3);
      st(c + j, s0 - s2); st(d + j, s1 - s3);
    }
  }
}

static void radix2_pass(float *x, size_t n, size_t h) {
  for (size_t g = 0; g < n; g += 2 * h) {
    float *a = x + g, *b = a + h;
    for (size_t j = 0; j < h; j += VL) {
      v16 va = ld(a + j), vb = ld(b + j);
      st(a + j, va + vb); st(b + j, va - vb);
    }
  }
}

/* Levels with strides VL..n/2 (in floats) over x[0..n), radix-4 then one
 * radix-2 pass if the count is odd. h is the stride in floats. */
static void strided_levels(float *x, size_t n, size_t h0) {
  size_t h = h0;
  while (4 * h <= n) { radix4_pass(x, n, h); h *= 4; }
  if (2 * h <= n) radix2_pass(x, n, h);
}

/* All levels of a block of n <= BLOCK floats (n >= VL). */
static void block_transform(float *x, size_t n) {
  levels_in_register(x, n);
  strided_levels(x, n, VL);
}

static void small_transform(float *x, size_t n) {  /* n < VL */
  for (size_t h = 1; h < n; h *= 2)
    for (size_t i = 0; i < n; i += 2 * h)
      for (size_t j = i; j < i + h; ++j) {
        float a = x[j], b = x[j + h];
        x[j] = a + b; x[j + h] = a - b;
      }
}

/* Returns 0 on success, -1 if n is not a power of two, -2 on OOM. */
int fwht_f32(float *x, size_t n) {
  if (n == 0 || (n & (n - 1))) return -1;
  if (n < VL) { small_transform(x, n); return 0; }
  if (n <= BLOCK) { block_transform(x, n); return 0; }
  /* Phases 1-2: every BLOCK-float block. */
  for (size_t b = 0; b < n; b += BLOCK) block_transform(x + b, BLOCK);
  /* Phase 3: transform along rows (R rows of BLOCK floats), W columns at a
   * time through a contiguous R x W buffer. */
  size_t R = n / BLOCK;
  size_t W = (1u << 18) / R;  /* buffer <= 1 MiB */
  if (W < VL) W = VL;
  if (W > BLOCK) W = BLOCK;
  float *buf = aligned_alloc(64, R * W * sizeof(float));
  if (!buf) return -2;
  for (size_t c0 = 0; c0 < BLOCK; c0 += W) {
    for (size_t r = 0; r < R; ++r)
      memcpy(buf + r * W, x + r * BLOCK + c0, W * sizeof(float));
    /* Row stride h rows = h * W floats: the same passes on the buffer. */
    strided_levels(buf, R * W, W);
    for (size_t r = 0; r < R; ++r)
      memcpy(x + r * BLOCK + c0, buf + r * W, W * sizeof(float));
  }
  free(buf);
  return 0;
}
