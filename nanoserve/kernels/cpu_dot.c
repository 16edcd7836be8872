/* Chapter 10 — the integer dot products llama.cpp decodes with, for this CPU (cpu_dot.py builds and calls it).

   A decode step multiplies a few activation rows by every weight once, so at best its time is how fast the
   weights stream from memory. torch's int4 and int8 kernels turn each weight into a float (or bf16) before they
   multiply; on a CPU without native bf16 that conversion, not memory, bounds them (chapter 10 has the arithmetic:
   ~4 GB/s of q4 weights against float32's ~10). This file keeps the weights
   as integers: the activations are rounded to int8 too, one scale per block of 32 (llama.cpp's Q8_1), and each
   block's dot product is integer multiply-adds (AVX2's vpmaddubsw: 32 byte products, summed in pairs, in one
   instruction; AVX-512 VNNI's vpdpbusd sums them in fours where the CPU has it); floats appear once per block, to
   apply the scales.

   Q4_1 weights, one block of 32:  w_i = d · q_i + m        (q_i in 0..15, d and m float16, as the GGUF stores them)
   Q8_1 activations, block of 32:  x_i ≈ dx · p_i           (p_i in -127..127, dx = max|x| / 127, sx = dx · Σ p_i)
   so  Σ w_i x_i ≈ d · dx · Σ q_i p_i  +  m · sx            (one integer dot product per block)

   int8 weights, one scale per row (the LM head):  Σ_row = s_row · Σ_blocks dx · Σ q_i p_i

   Shapes: x (tokens, in) float32, y (tokens, out) float32, in a multiple of 32. Each thread takes a range of
   output rows and multiplies it with every token's activations (the weights are read once per call, not once
   per token). Without AVX2 and FMA the same arithmetic runs in plain C: the same result up to the order of float32
   additions, and slower than torch's kernels (so the layers do not take it by default).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define SIMD 1 /* the AVX2 branch (it multiplies-adds with FMA too) */
#include <immintrin.h>
#else
#define SIMD 0
#endif

#define QK 32 /* weights per block */

typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1; /* the GGUF's 20 bytes */
typedef struct { float dx, sx; int8_t p[QK]; } block_q8_1;        /* one block of activations */

static float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);          /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);     /* normal */
    else if (!man) bits = sign;                                         /* zero */
    else {                                                              /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* 1 where this build took the AVX2 branch, 0 where the plain C loops (slower than torch's kernels) */
int cpu_dot_simd(void) { return SIMD; }

/* x (n,) float32 -> n/32 blocks of int8 with their scale dx and sx = dx · Σ p (rounding to nearest). */
void quantize_q8_1(const float *x, block_q8_1 *out, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float dx = amax / 127.f, inv = dx ? 1.f / dx : 0.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int p = (int)lrintf(xb[i] * inv);
            out[b].p[i] = (int8_t)p;
            sum += p;
        }
        out[b].dx = dx;
        out[b].sx = dx * (float)sum;
    }
}

#if SIMD
static inline float hsum(__m256 v) {  /* the 8 lanes added */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 32 unsigned bytes (0..15 here) times 32 signed bytes, as 8 int32 partial sums, then floats */
static inline __m256 dot32(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* VNNI (Intel since Cascade Lake, AMD since Zen 4): the four products and their sum in one instruction */
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#else
    __m256i pairs = _mm256_maddubs_epi16(u, s);                        /* 16 × (u0 s0 + u1 s1), no overflow: ≤ 2·15·127 */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));  /* 8 × int32 */
#endif
}
#endif

#define TILE 8 /* tokens multiplied with one unpacked weight block before the next block is unpacked: the nibble
                  unpacking and the two half-float scales of a block are paid once per 8 tokens */

/* The two dot products below are inlined into their callers (q4_1_row, i8_row), which call them with nt a
   constant for the two common tiles, a full one and a single token (batch-1 decode): then the accumulators
   live in registers, not in memory, and the loops over t unroll. The arithmetic per token is the same either way. */
#define INLINE static inline __attribute__((always_inline))

/* One row of Q4_1 weights times nt <= TILE tokens' activations (token t's blocks at x + t * nb): y[t]. */
INLINE void dot_q4_1(const block_q4_1 *w, const block_q8_1 *x, int64_t nb, const int nt, float *y) {
    float summ[TILE] = {0};  /* Σ m · sx: the part of each block that does not depend on q */
#if SIMD
    __m256 acc[TILE];
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        __m128i qs = _mm_loadu_si128((const __m128i *)w[b].qs);
        /* bytes 0..15: the low nibbles (weights 0..15); bytes 16..31: the high ones (weights 16..31) */
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
        float d = half_to_float(w[b].d), m = half_to_float(w[b].m);
        for (int t = 0; t < nt; t++) {
            const block_q8_1 *xb = x + t * nb + b;
            __m256i p = _mm256_loadu_si256((const __m256i *)xb->p);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->dx), dot32(q, p), acc[t]);
            summ[t] += m * xb->sx;
        }
    }
    for (int t = 0; t < nt; t++) y[t] = hsum(acc[t]) + summ[t];
#else
    float sum[TILE] = {0};
    for (int64_t b = 0; b < nb; b++) {
        float d = half_to_float(w[b].d), m = half_to_float(w[b].m);
        for (int t = 0; t < nt; t++) {
            const block_q8_1 *xb = x + t * nb + b;
            int isum = 0;
            for (int j = 0; j < QK / 2; j++)
                isum += (w[b].qs[j] & 0x0f) * xb->p[j] + (w[b].qs[j] >> 4) * xb->p[j + QK / 2];
            sum[t] += d * xb->dx * (float)isum;
            summ[t] += m * xb->sx;
        }
    }
    for (int t = 0; t < nt; t++) y[t] = sum[t] + summ[t];
#endif
}

/* One row of int8 weights times nt <= TILE tokens' activations: y[t], before the row's scale. */
INLINE void dot_i8(const int8_t *w, const block_q8_1 *x, int64_t nb, const int nt, float *y) {
#if SIMD
    __m256 acc[TILE];
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        __m256i aq = _mm256_sign_epi8(q, q);  /* vpmaddubsw wants one operand unsigned: |q|, and p with q's sign */
        for (int t = 0; t < nt; t++) {
            const block_q8_1 *xb = x + t * nb + b;
            __m256i p = _mm256_loadu_si256((const __m256i *)xb->p);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(xb->dx), dot32(aq, _mm256_sign_epi8(p, q)), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t] = hsum(acc[t]);
#else
    float sum[TILE] = {0};
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++) {
            const block_q8_1 *xb = x + t * nb + b;
            int isum = 0;
            for (int i = 0; i < QK; i++) isum += w[b * QK + i] * xb->p[i];
            sum[t] += xb->dx * (float)isum;
        }
    for (int t = 0; t < nt; t++) y[t] = sum[t];
#endif
}

/* One row of weights (its bytes) times nt <= TILE tokens' activations: dot_q4_1 or dot_i8. */
typedef void (*row_dot)(const void *row, const block_q8_1 *x, int64_t nb, int nt, float *y);

/* dot(w, x, nb, nt, y) with nt a compile-time constant where it is TILE or 1 (see INLINE above) */
#define TILE_DOT(dot, w, x, nb, nt, y) \
    (nt == TILE ? dot(w, x, nb, TILE, y) : nt == 1 ? dot(w, x, nb, 1, y) : dot(w, x, nb, nt, y))

static void q4_1_row(const void *row, const block_q8_1 *x, int64_t nb, int nt, float *y) {
    TILE_DOT(dot_q4_1, (const block_q4_1 *)row, x, nb, nt, y);
}

static void i8_row(const void *row, const block_q8_1 *x, int64_t nb, int nt, float *y) {
    TILE_DOT(dot_i8, (const int8_t *)row, x, nb, nt, y);
}

/* y[t, r] = scale[r] (1 where scale is NULL) · row r · xq[t] for already quantized tokens (token t's blocks at
   xq + t · nb), y (tokens, out): the calling team's threads share the rows (an orphaned omp for, its barrier at the
   end), each row met by the tokens in tiles of TILE. gemv below and cpu_decode.c's products run this loop. */
static void gemv_rows(const uint8_t *w, int64_t row_bytes, row_dot dot, const float *scale, const block_q8_1 *xq,
                      float *y, int64_t tokens, int64_t nb, int64_t out) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < out; r++)
        for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
            float yt[TILE];
            int nt = tokens - t0 < TILE ? (int)(tokens - t0) : TILE;
            dot(w + r * row_bytes, xq + t0 * nb, nb, nt, yt);
            for (int t = 0; t < nt; t++) y[(t0 + t) * out + r] = scale ? scale[r] * yt[t] : yt[t];
        }
}

/* y[t, r] = scale[r] (1 where scale is NULL) · row r · x[t]: the tokens quantized to Q8_1 (tokens · in/32 blocks,
   a few KB per token), then each thread a range of rows (gemv_rows).
   Returns 0, or -1 where the activations' blocks could not be allocated (y untouched). */
static int gemv(const uint8_t *w, int64_t row_bytes, row_dot dot, const float *scale, const float *x, float *y,
                 int64_t tokens, int64_t in, int64_t out, int threads) {
    int64_t nb = in / QK;
    block_q8_1 *xq = malloc((size_t)(tokens * nb) * sizeof(block_q8_1));
    if (!xq) return -1;
    for (int64_t t = 0; t < tokens; t++) quantize_q8_1(x + t * in, xq + t * nb, in);
    #pragma omp parallel num_threads(threads)
    gemv_rows(w, row_bytes, dot, scale, xq, y, tokens, nb, out);
    free(xq);
    return 0;
}

/* y[t, r] = Σ_i w[r, i] · x[t, i] for Q4_1 weights (out, in/32 blocks of 20 bytes). */
int gemv_q4_1(const block_q4_1 *w, const float *x, float *y, int64_t tokens, int64_t in, int64_t out, int threads) {
    return gemv((const uint8_t *)w, (in / QK) * (int64_t)sizeof(block_q4_1), q4_1_row, NULL, x, y, tokens, in, out, threads);
}

/* y[t, r] = scale[r] · Σ_i q[r, i] · x[t, i] for int8 weights (out, in) with one scale per row. */
int gemv_i8(const int8_t *q, const float *scale, const float *x, float *y, int64_t tokens, int64_t in, int64_t out,
            int threads) {
    return gemv((const uint8_t *)q, in, i8_row, scale, x, y, tokens, in, out, threads);
}
