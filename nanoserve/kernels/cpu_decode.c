/* Chapters 09 and 10 — one decode step in C: every layer of a q4 Llama for the one new token of each of up to
   NATIVE_DECODE_MAX_ROWS sequences (16; cpu_decode.py names the cap and max_rows, which may allow fewer, builds
   and calls this).

   Why: at batch 1 the products are about a third of nanoserve's step (32 % of a 15.9 ms step, about 5 ms,
   chapter 09's profile) and llama.cpp's whole step (7-9 ms, chapter 09 section 5) is a little longer than
   them; the rest of ours is Python and dispatch around a
   few KB of arithmetic (RMSNorm, RoPE, SiLU, the attention's gather: dozens of torch ops per layer, or 62
   compiled-graph calls with their guards). Here one
   call runs all of it, with the products of cpu_dot.c itself (this file includes it: one translation unit, so
   the same dot_q4_1 and quantize_q8_1 compute each row, bit for bit what a q4 layer with integer_dot computes
   for the same input).

   B rows (B one-token rows: decodes, or a prompt's one-token last chunk) share each product, as a batched
   forward's rows do: every row's input is quantized to Q8_1, then each weight row is unpacked once per tile of
   TILE = 8 rows (cpu_dot.c's gemv_rows, the loop its gemv runs); everything else is per row: its own RoPE angles,
   its own pool slot, its own block table and length in the attention.

   Invariant: row r of a B-row step is bit for bit row r's batch-1 step (its hidden state, the K and V it stores).
   dot_q4_1 computes each token of a tile on its own (its own accumulators, the blocks in the same order), and every
   other per-row computation (norms, RoPE, SiLU, the attention's sums) runs the same code in the same order on that
   row's data alone; nothing sums across rows. So a request's tokens do not depend on which other requests share its
   step (tests/test_ch09_native_decode.py checks it with torch.equal).

   Per layer, for each row's x (hidden,) float32, the residual stream:
       xn = rmsnorm(x) · w1                           qkv = Q4_1(qkv) · q8_1(xn)      (H·D + 2·Hkv·D,)
       q, k rotated (rotate-half RoPE: pair i with i + D/2, rope.py)   k, v -> the pool at `slot`
       att[h] = softmax(q_h · K_jᵀ / √D) · V_j   j = h / (H / Hkv), K and V read through the block table
       x += Q4_1(o) · q8_1(att)
       xn = rmsnorm(x) · w2     gu = Q4_1(gate_up) · q8_1(xn)     x += Q4_1(down) · q8_1(silu(gate) · up)
   and after the last layer x = rmsnorm(x) · w_final (the LM head stays cpu_dot.py's int8 product).

   A bf16 pool follows the eager step's casts: k and v rounded to bf16 when stored, q rounded to bf16 before the
   scores (PagedAttention's q.to(bf16)), the output rounded to bf16 (torch's bf16 attention returns bf16); the
   scores, the softmax and the sums stay float32 here, where torch's bf16 attention rounds inside too. That
   inner rounding is what sets the bf16 case's tolerance in tests/test_ch09_native_decode.py, and these casts do
   not move the step past it: the test checks the bf16 pool's layout and reads, not these roundings.

   Threads: one OpenMP region for the whole step. The products split their output rows over the threads
   (`omp for`), the attention its (row, query head) pairs; the element-wise work between them is a few KB a row,
   and every thread does all of it on its own copy (below, "Scratch"), so the threads meet only at the 5 barriers a
   layer, whatever B: four after products whose rows they shared, one after the attention's pairs. No allocation:
   the caller's scratch.
*/
#include "cpu_dot.c"
#include <omp.h>

typedef struct {
    const float *norm1, *norm2;                      /* (hidden,) the two RMSNorm weights */
    const block_q4_1 *qkv, *o, *gate_up, *down;      /* rows of Q4_1 blocks, as the GGUF stores them */
    void *k, *v;                                     /* this layer's pool: (Hkv, num_blocks, block_size, D) */
} layer_t;

typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, layers, num_blocks, block_size;
    int64_t kv_bf16;                                 /* the pool's dtype: 0 float32, 1 bfloat16 */
    float eps;                                       /* RMSNorm's */
    const float *inv_freq;                           /* (D/2,) RoPE's theta_i, computed by rope.py's formula */
    const float *final_norm;                         /* (hidden,) */
    const layer_t *layer;                            /* (layers,) */
} model_t;

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);  /* nan stays nan */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* Scratch, in floats: shared, what the products write for the B rows (qkv, att, tmp, gate_up) and each row's RoPE
   angles (cos, sin); then per thread its own residual streams x (B, hidden), normed / activated inputs, rotated q
   and k, q8_1 blocks, and the scores of the one (row, head) pair it attends at a time (max_seq,).
   Each thread keeps its own copy of everything between two products, computed identically, so a thread waits for
   the others only where it needs rows they computed: after each product and after the attention, 5 barriers a
   layer. (With one thread per core and a neighbour's process on a core, every barrier can wait for a time slice:
   fewer of them is most of what keeps a busy machine's step short.) */
static int64_t widest(const model_t *m) {  /* the longest input a product quantizes */
    int64_t w = m->hidden > m->inter ? m->hidden : m->inter;
    return w > m->heads * m->head_dim ? w : m->heads * m->head_dim;
}

static int64_t shared_floats(const model_t *m, int64_t B) {
    return B * ((m->heads + 2 * m->kv_heads) * m->head_dim + m->heads * m->head_dim + m->hidden + 2 * m->inter
                + m->head_dim);
}

static int64_t private_bytes(const model_t *m, int64_t B, int64_t max_seq) {  /* one thread's, a multiple of 64 bytes */
    int64_t floats = B * (m->hidden + widest(m) + (m->heads + m->kv_heads) * m->head_dim) + max_seq;
    int64_t bytes = floats * (int64_t)sizeof(float) + B * (widest(m) / QK) * (int64_t)sizeof(block_q8_1);
    return (bytes + 63) / 64 * 64;
}

/* Bytes of scratch decode_step needs for B rows of sequences of up to max_seq tokens on `threads` threads. */
int64_t decode_scratch_bytes(const model_t *m, int64_t B, int64_t max_seq, int threads) {
    return (shared_floats(m, B) * (int64_t)sizeof(float) + 63) / 64 * 64 + threads * private_bytes(m, B, max_seq) + 64;
}

static void rmsnorm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* y (B, out) = rows of w · each row's quantized input (row t's blocks at xq + t · in/32): cpu_dot.c's gemv_rows,
   the caller's threads sharing the weight rows, each unpacked once per tile of TILE input rows. */
static void rows_q4_1(const block_q4_1 *w, const block_q8_1 *xq, int64_t B, int64_t in, int64_t out, float *y) {
    gemv_rows((const uint8_t *)w, (in / QK) * (int64_t)sizeof(block_q4_1), q4_1_row, NULL, xq, y, B, in / QK, out);
}

/* x (B, n) with rows `stride` floats apart -> B rows of n/32 Q8_1 blocks, row t's at out + t · n/32 */
static void quantize_rows(const float *x, int64_t stride, block_q8_1 *out, int64_t B, int64_t n) {
    for (int64_t t = 0; t < B; t++) quantize_q8_1(x + t * stride, out + t * (n / QK), n);
}

/* Rotate-half RoPE of one head vector x (D,) at angles pos · inv_freq: pair (x[i], x[i + D/2]). */
static void rope(float *x, const float *cos_, const float *sin_, int64_t D) {
    for (int64_t i = 0; i < D / 2; i++) {
        float a = x[i], b = x[i + D / 2];
        x[i] = a * cos_[i] - b * sin_[i];
        x[i + D / 2] = b * cos_[i] + a * sin_[i];
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
#if SIMD
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
#if SIMD
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {  /* 8 bf16 -> 8 floats: the 16 bits moved up */
            __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i))), 16);
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_castsi256_ps(w), acc);
        }
        return hsum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * bf16_to_float(b[i]);
    return s;
}

/* One query head against its kv head's keys and values, positions 0..seq_len-1: the earlier ones read through
   the block table (the pool's row of position t: table[t / bs] · bs + t % bs), this token's own (the last) from
   k, v (D,), already what the pool holds (rounded to bf16 for a bf16 pool): another thread may be storing them.
   q (D,), scores (seq_len,) scratch, out (D,). */
static void attend_head(const model_t *m, const layer_t *L, int64_t j, const float *q, const float *k,
                        const float *v, const int64_t *table, int64_t seq_len, float *scores, float *out) {
    int64_t D = m->head_dim, bs = m->block_size, base = j * m->num_blocks * bs;  /* kv head j's first row */
    float scale = 1.f / sqrtf((float)D), top = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < seq_len - 1; t++) {
        int64_t row = base + table[t / bs] * bs + t % bs;
        scores[t] = scale * (m->kv_bf16 ? dot_bf16(q, (const uint16_t *)L->k + row * D, D)
                                        : dot_f32(q, (const float *)L->k + row * D, D));
        top = fmaxf(top, scores[t]);
    }
    scores[seq_len - 1] = scale * dot_f32(q, k, D);
    top = fmaxf(top, scores[seq_len - 1]);
    for (int64_t t = 0; t < seq_len; t++) sum += (scores[t] = expf(scores[t] - top));
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t t = 0; t < seq_len; t++) {
        int64_t row = base + table[t / bs] * bs + t % bs;
        float p = scores[t] / sum;
        if (t == seq_len - 1) {
            for (int64_t d = 0; d < D; d++) out[d] += p * v[d];
        } else if (m->kv_bf16) {
            const uint16_t *v = (const uint16_t *)L->v + row * D;
            for (int64_t d = 0; d < D; d++) out[d] += p * bf16_to_float(v[d]);
        } else {
            const float *v = (const float *)L->v + row * D;
            for (int64_t d = 0; d < D; d++) out[d] += p * v[d];
        }
    }
    if (m->kv_bf16)
        for (int64_t d = 0; d < D; d++) out[d] = round_bf16(out[d]);
}

/* k, v (Hkv, D) of this token into the pool's row `slot` of every kv head (the pool seen as (Hkv, slots, D)). */
static void store_kv(const model_t *m, const layer_t *L, const float *k, const float *v, int64_t slot) {
    int64_t D = m->head_dim, slots = m->num_blocks * m->block_size;
    for (int64_t j = 0; j < m->kv_heads; j++)
        for (int64_t d = 0; d < D; d++) {
            int64_t at = (j * slots + slot) * D + d;
            if (m->kv_bf16) {
                ((uint16_t *)L->k)[at] = float_to_bf16(k[j * D + d]);
                ((uint16_t *)L->v)[at] = float_to_bf16(v[j * D + d]);
            } else {
                ((float *)L->k)[at] = k[j * D + d];
                ((float *)L->v)[at] = v[j * D + d];
            }
        }
}

/* The step, for B rows (one token of each of B sequences). x (B, hidden): the tokens' embeddings in, the
   final-normed hidden states out. Per row r: pos[r], its position, the sequence's last (seq_lens[r] - 1);
   its block table, tables + r · table_stride (>= ceil(seq_lens[r] / block_size) entries); slots[r], its token's
   pool row (table[pos / bs] · bs + pos % bs, the runner's slot_mapping). The rows' slots must differ and no row
   may read another's slot (different sequences: what the runner passes). scratch: at least
   decode_scratch_bytes(m, B, max(seq_lens), threads) bytes, 64-byte aligned. */
void decode_step(const model_t *m, float *x, int64_t B, const int64_t *pos, const int64_t *tables,
                 int64_t table_stride, const int64_t *seq_lens, const int64_t *slots, void *scratch, int threads) {
    int64_t H = m->heads, Hkv = m->kv_heads, D = m->head_dim, G = H / Hkv, W = widest(m);
    int64_t hidden = m->hidden, inter = m->inter, nqkv = (H + 2 * Hkv) * D, nqk = (H + Hkv) * D, max_seq = 0;
    for (int64_t r = 0; r < B; r++) max_seq = seq_lens[r] > max_seq ? seq_lens[r] : max_seq;
    float *qkv = scratch, *att = qkv + B * nqkv, *tmp = att + B * H * D, *gu = tmp + B * hidden;  /* (B, ...) */
    float *cos_ = gu + B * 2 * inter, *sin_ = cos_ + B * D / 2;                      /* (B, D/2) each */
    char *privates = (char *)scratch + (shared_floats(m, B) * (int64_t)sizeof(float) + 63) / 64 * 64;
    for (int64_t r = 0; r < B; r++)  /* each row's angles, float32 as rope_cos_sin's */
        for (int64_t i = 0; i < D / 2; i++) {
            float angle = (float)pos[r] * m->inv_freq[i];
            cos_[r * D / 2 + i] = cosf(angle);
            sin_[r * D / 2 + i] = sinf(angle);
        }
    #pragma omp parallel num_threads(threads)
    {
        float *xr = (float *)(privates + omp_get_thread_num() * private_bytes(m, B, max_seq));  /* (B, hidden) */
        float *xn = xr + B * hidden, *q = xn + B * W, *scores = q + B * nqk;  /* (B, W), (B, (H + Hkv) · D) */
        block_q8_1 *xq = (block_q8_1 *)(scores + max_seq);                    /* B rows of up to W / 32 blocks */
        memcpy(xr, x, (size_t)(B * hidden) * sizeof(float));
        for (int64_t l = 0; l < m->layers; l++) {
            const layer_t *L = m->layer + l;
            for (int64_t r = 0; r < B; r++) rmsnorm(xr + r * hidden, L->norm1, xn + r * W, hidden, m->eps);
            quantize_rows(xn, W, xq, B, hidden);
            rows_q4_1(L->qkv, xq, B, hidden, nqkv, qkv);                         /* barrier 1 */
            for (int64_t r = 0; r < B; r++) {  /* row r's q heads, then its k heads, rotated at its own angles */
                float *qr = q + r * nqk;
                memcpy(qr, qkv + r * nqkv, (size_t)nqk * sizeof(float));
                for (int64_t h = 0; h < H + Hkv; h++) rope(qr + h * D, cos_ + r * D / 2, sin_ + r * D / 2, D);
            }
            if (m->kv_bf16)  /* what the eager step attends with: q in the pool's dtype, k and v as stored */
                for (int64_t i = 0; i < B * nqk; i++) q[i] = round_bf16(q[i]);
            /* no barrier between this store and the attention below: safe only because no row reads another's
               slot (decode_step's precondition; a row that did would race with this store, not just read stale) */
            #pragma omp master
            for (int64_t r = 0; r < B; r++)  /* read back by later steps only: this one uses k and v directly */
                store_kv(m, L, q + r * nqk + H * D, qkv + r * nqkv + nqk, slots[r]);
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < B * H; p++) {                                /* barrier 2 */
                int64_t r = p / H, h = p % H, j = h / G;
                const float *v = qkv + r * nqkv + nqk;
                float vj[D];
                for (int64_t d = 0; d < D; d++) vj[d] = m->kv_bf16 ? round_bf16(v[j * D + d]) : v[j * D + d];
                attend_head(m, L, j, q + r * nqk + h * D, q + r * nqk + H * D + j * D, vj,
                            tables + r * table_stride, seq_lens[r], scores, att + (r * H + h) * D);
            }
            quantize_rows(att, H * D, xq, B, H * D);
            rows_q4_1(L->o, xq, B, H * D, hidden, tmp);                          /* barrier 3 */
            for (int64_t i = 0; i < B * hidden; i++) xr[i] += tmp[i];
            for (int64_t r = 0; r < B; r++) rmsnorm(xr + r * hidden, L->norm2, xn + r * W, hidden, m->eps);
            quantize_rows(xn, W, xq, B, hidden);
            rows_q4_1(L->gate_up, xq, B, hidden, 2 * inter, gu);                 /* barrier 4 */
            for (int64_t r = 0; r < B; r++)  /* silu(gate) · up */
                for (int64_t i = 0; i < inter; i++) {
                    float g = gu[r * 2 * inter + i];
                    xn[r * W + i] = g / (1.f + expf(-g)) * gu[r * 2 * inter + inter + i];
                }
            quantize_rows(xn, W, xq, B, inter);
            rows_q4_1(L->down, xq, B, inter, hidden, tmp);                       /* barrier 5 */
            for (int64_t i = 0; i < B * hidden; i++) xr[i] += tmp[i];
        }
        #pragma omp master
        for (int64_t r = 0; r < B; r++) rmsnorm(xr + r * hidden, m->final_norm, x + r * hidden, hidden, m->eps);
    }
}
