// Paged attention on CPU, one query row at a time over its paged KV cache, read in place: every row of a step
// (decode tokens, and each token of a prefill chunk, whose K/V are written before) in one call.
// Built and loaded by core/cpu_kernels/__init__.py (plain C with OpenMP, called through ctypes: no torch
// headers, so it compiles in about a second at first use).
//
// Layout (one layer), as core/kernels/paged_decode.py: cache [2, KVH, NB, BS, D], K then V, head-major and
// paged; row r belongs to sequence s = row_seqs[r] (r itself when row_seqs is NULL), whose token t lives in
// block tables[s * width + t / BS] at slot t % BS. lens[r] = L: the row is the token at position L - 1 and
// sees keys [max(0, L - window), L) (window 0: all; L 0: a padding row, output 0).
// Query head i uses KV head i / G, G = H / KVH; one work item is one (row, KV head) with its G queries, so each
// K/V row is read once for the group. A row's result depends on its q and its keys only, not on the rest of
// the batch: a token prefilled and the same token decoded get the same attention, bit for bit.
// A quantized pool (kv: core/kv/quant.py's format code) has rows of codes and bf16 scales instead of D values; each
// K / V row is dequantized in registers as it is read, the same fp32 values as the reference's dequantize.
// Math in fp32 whatever the storage dtype: scores (q * scale in fp32, or bf16 products, exact in fp32, scaled
// after), soft-capping where asked (cap * tanh(s / cap), Gemma 2), softmax (max, exp, sum, normalise), weighted sum
// of values, rounded once to the output dtype.
#include "common.h"

// cap * tanh(s / cap) for each of the count scores (cap 0: none), the reference's order of operations
static void soft_cap(float *scores, size_t count, float cap) {
    if (cap <= 0.0f) return;
    for (size_t i = 0; i < count; i++) scores[i] = tanhf(scores[i] / cap) * cap;
}


// each of the G rows of n scores -> its softmax (max, exp, sum, normalise)
static void softmax_rows(float *scores, int G, int n) {
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * n, m = s[0], sum = 0.0f;
        for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; i++) {
            s[i] = exp_clamped(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int i = 0; i < n; i++) s[i] *= inv;
    }
}

// Byte offset, within its (K or V, KV head) plane, of the row of each visible key [first, L): walks the block
// table block by block (no division per token); both paths below read keys and values through it.
static void visible_rows(const int32_t *table, int first, int L, int block_size, size_t row_bytes, size_t *rows) {
    for (int t = first, i = 0; t < L;) {
        const int offset = t % block_size;
        size_t row = ((size_t)table[t / block_size] * block_size + offset) * row_bytes;
        for (int o = offset; o < block_size && t < L; o++, t++, i++, row += row_bytes) rows[i] = row;
    }
}

// Software prefetch of the K and V rows of keys [from, to) of the n visible: the first PREFETCH_KEYS together at the
// start, then those PREFETCH_KEYS ahead, four at a time, in the scores pass (so the weighted sum finds V in cache):
// a sequence's blocks lie anywhere in the pool and every block is a short stream the hardware prefetchers lose at
// its end. 64 sequences of 150 keys over a 1 GiB pool, blocks scattered (bf16, AMD EPYC Zen 5, 2 threads): 33 ms
// per step of 30 layers without, 15 with; 16 ahead beat 8, 32 and 64.
#define PREFETCH_KEYS 16
static inline void prefetch_kv(const char *k_plane, const char *v_plane, const size_t *rows, int from, int to, int n,
                               size_t row_bytes) {
    for (int j = from; j < to && j < n; j++)
        for (size_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k_plane + rows[j] + b, 0, 3);
            __builtin_prefetch(v_plane + rows[j] + b, 0, 3);
        }
}

// One (row, KV head) item with its G queries over its n visible keys, in plain C; D is a compile-time constant in
// the specialised copies below (the d loops unroll and stay in registers).
static inline __attribute__((always_inline)) void attend(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        float scale, float softcap, int dtype, size_t es, int kv, size_t rb, float *qf, float *acc, float *row,
        float *scores) {
    for (int g = 0; g < G; g++) {
        load_row(q_row + (size_t)g * D * es, dtype, D, qf + g * D);
        for (int d = 0; d < D; d++) qf[g * D + d] *= scale;
    }
    prefetch_kv(k_plane, v_plane, rows, 0, PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i++) {  // scores[g][i] = q_g . k_i
        if ((i & 3) == 0) prefetch_kv(k_plane, v_plane, rows, i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4, n, rb);
        load_kv_row(k_plane + rows[i], v_plane + rows[i], kv, D, row);
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qg[d] * row[d];
            scores[(size_t)g * n + i] = s;
        }
    }
    soft_cap(scores, (size_t)G * n, softcap);
    softmax_rows(scores, G, n);
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int i = 0; i < n; i++) {  // acc[g] = sum_i p[g][i] v_i
        load_kv_row(v_plane + rows[i], NULL, kv, D, row);
        for (int g = 0; g < G; g++) {
            const float p = scores[(size_t)g * n + i];
            float *a = acc + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] += p * row[d];
        }
    }
}

// one copy per storage format: no branch in the loops
#define KV_COPIES(call, ...)                                                                                     \
    switch (kv) {                                                                                                \
        case F32: call(__VA_ARGS__, F32); break;                                                                  \
        case BF16: call(__VA_ARGS__, BF16); break;                                                                \
        case F16: call(__VA_ARGS__, F16); break;                                                                  \
        case KV_I8: call(__VA_ARGS__, KV_I8); break;                                                              \
        case KV_E4M3: call(__VA_ARGS__, KV_E4M3); break;                                                          \
        case KV_E5M2: call(__VA_ARGS__, KV_E5M2); break;                                                          \
        default: call(__VA_ARGS__, KV_Q4); break;                                                                 \
    }

// ---- AVX-512 path (compiled where -march=native has AVX-512: D a multiple of 64) ----
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16(const char *p, int dtype) {  // 16 stored values -> fp32
    if (dtype == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (dtype == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps((const float *)p);
}

// (sum(v0), sum(v1), sum(v2), sum(v3)): one reduction tree for four dot products
static inline __m128 sum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
    __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// 16 values of a stored K / V row from value c -> fp32: q4's with their group's scale, an 8-bit format's codes as
// numbers (their row's scale, kv_row_scale, is applied to the dot products and the weights instead: once per key, not
// per 16 values); kv constant in each copy
static inline __attribute__((always_inline)) __m512 load16_kv(const char *row, int c, const int kv, int D) {
    if (kv == F32) return _mm512_loadu_ps((const float *)row + c);
    if (kv == BF16 || kv == F16) return load16(row + (size_t)c * 2, kv);
    if (kv == KV_Q4) {  // 8 bytes, value 2i in the low nibble of byte i
        const __m128i b = _mm_loadl_epi64((const __m128i *)(row + c / 2)), low = _mm_set1_epi8(15);
        const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(8)));
        return _mm512_mul_ps(v, _mm512_set1_ps(bf16_at(row + D / 2 + 2 * (c / KV_Q4_GROUP))));
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)(row + c));
    if (kv == KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    __m256i w = _mm256_cvtepu8_epi16(b);
    if (kv == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    w = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),  // e4m3 as fp16 * 2^-8
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(w);
}

// 16 values of a stored K row from value c -> fp32, as load16_kv; v: the V row of its token and head (q4's K has
// 5-bit codes, the fifth bits after the nibbles, and its scales in the V row)
static inline __attribute__((always_inline)) __m512 load16_k(const char *k, const char *v, int c, const int kv, int D) {
    if (kv != KV_Q4) return load16_kv(k, c, kv, D);
    const __m128i b = _mm_loadl_epi64((const __m128i *)(k + c / 2)), low = _mm_set1_epi8(15);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    uint16_t fifth;
    memcpy(&fifth, k + D / 2 + c / 8, 2);
    __m512i wide = _mm512_cvtepu8_epi32(codes);
    wide = _mm512_mask_add_epi32(wide, (__mmask16)fifth, wide, _mm512_set1_epi32(16));
    const __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(wide, _mm512_set1_epi32(16)));
    return _mm512_mul_ps(x, _mm512_set1_ps(bf16_at(q4_key_scales(v, D) + 2 * (c / KV_Q4_GROUP))));
}

// scores[g * n + i] = scale * q_g . k_(first + i) for the n visible keys; rows[i]: byte offset of key i's K row
static inline __attribute__((always_inline)) void qk_avx512_impl(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, int D, int dtype,
        size_t es, const int kv, size_t rb, float scale, float *qf, float *kf, float *scores) {
    prefetch_kv(k_plane, v_plane, rows, 0, PREFETCH_KEYS, n, rb);  // requested together, not one miss at a time
#if defined(__AVX512BF16__)
    if (kv == BF16) {  // bf16 pairs multiplied exactly into fp32 sums: no conversion of K
        for (int i = 0; i < n; i += 4) {
            const char *k[4];
            for (int j = 0; j < 4; j++) k[j] = k_plane + rows[i + j < n ? i + j : n - 1];
            prefetch_kv(k_plane, v_plane, rows, i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4, n, rb);
            for (int g = 0; g < G; g++) {
                const char *qg = q_row + (size_t)g * D * 2;
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int c = 0; c < D; c += 32) {
                    __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qg + c * 2));
                    for (int j = 0; j < 4; j++)
                        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512((const void *)(k[j] + c * 2)));
                }
                __m128 s = _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale));
                float tmp[4];
                _mm_storeu_ps(tmp, s);
                for (int j = 0; j < 4 && i + j < n; j++) scores[(size_t)g * n + i + j] = tmp[j];
            }
        }
        return;
    }
    if (dtype == BF16 && (kv == KV_I8 || kv == KV_E4M3 || kv == KV_E5M2)) {
        // an 8-bit format's codes are exact in bf16 (small integers, 8-bit floats): converted once per key, then
        // multiplied by q's bf16 pairs exactly as the bf16 cache is; the row's scale after. The fp32 path below
        // spent its time converting, storing and reloading K (64 sequences of 2k tokens: 3.4 ms a layer, 0.05 GB)
        uint16_t *kb = (uint16_t *)kf;  // 4 rows of D bf16: half of kf
        for (int i = 0; i < n; i += 4) {
            prefetch_kv(k_plane, v_plane, rows, i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4, n, rb);
            float ks[4];
            for (int j = 0; j < 4; j++) {
                const char *k = k_plane + rows[i + j < n ? i + j : n - 1];
                ks[j] = kv_row_scale(k, kv, D) * scale;
                for (int c = 0; c < D; c += 32)
                    _mm512_storeu_si512((void *)(kb + j * D + c),
                                        (__m512i)_mm512_cvtne2ps_pbh(load16_kv(k, c + 16, kv, D), load16_kv(k, c, kv, D)));
            }
            const __m128 key_scales = _mm_loadu_ps(ks);
            for (int g = 0; g < G; g++) {
                const char *qg = q_row + (size_t)g * D * 2;
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int c = 0; c < D; c += 32) {
                    __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qg + c * 2));
                    for (int j = 0; j < 4; j++)
                        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512((const void *)(kb + j * D + c)));
                }
                float tmp[4];
                _mm_storeu_ps(tmp, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), key_scales));
                for (int j = 0; j < 4 && i + j < n; j++) scores[(size_t)g * n + i + j] = tmp[j];
            }
        }
        return;
    }

#endif
    for (int g = 0; g < G; g++) {  // q * scale in fp32, as the torch bmm variant
        for (int c = 0; c < D; c += 16)
            _mm512_storeu_ps(qf + g * D + c, _mm512_mul_ps(load16(q_row + ((size_t)g * D + c) * es, dtype),
                                                          _mm512_set1_ps(scale)));
    }
    for (int i = 0; i < n; i += 4) {
        prefetch_kv(k_plane, v_plane, rows, i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4, n, rb);
        float ks[4];
        for (int j = 0; j < 4; j++) {  // four K rows -> fp32, once for all G queries
            const size_t r = rows[i + j < n ? i + j : n - 1];
            const char *k = k_plane + r;
            ks[j] = kv_row_scale(k, kv, D);
            for (int c = 0; c < D; c += 16) _mm512_storeu_ps(kf + j * D + c, load16_k(k, v_plane + r, c, kv, D));
        }
        const __m128 key_scales = _mm_loadu_ps(ks);
        for (int g = 0; g < G; g++) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int c = 0; c < D; c += 16) {
                __m512 qv = _mm512_loadu_ps(qf + g * D + c);
                for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + j * D + c), acc[j]);
            }
            float tmp[4];
            _mm_storeu_ps(tmp, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), key_scales));
            for (int j = 0; j < 4 && i + j < n; j++) scores[(size_t)g * n + i + j] = tmp[j];
        }
    }
}

// acc[g * D + d] = sum_i p[g][i] v_i[d]: four queries' accumulators of 64 dims held in registers over all keys
static inline __attribute__((always_inline)) void pv_avx512_impl(
        const char *v_plane, const size_t *rows, int n, int G, int D, const int kv, const float *scores, float *acc) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        for (int d0 = 0; d0 < D; d0 += 64) {
            __m512 a[4][4];
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                const char *v = v_plane + rows[i];
                const float vs = kv_row_scale(v, kv, D);
                __m512 x[4];
                for (int c = 0; c < 4; c++) x[c] = load16_kv(v, d0 + c * 16, kv, D);
                for (int g = 0; g < 4; g++) {
                    if (g < gn) {
                        __m512 p = _mm512_set1_ps(scores[(size_t)(g0 + g) * n + i] * vs);
                        for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(p, x[c], a[g][c]);
                    }
                }
            }
            for (int g = 0; g < gn; g++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)(g0 + g) * D + d0 + c * 16, a[g][c]);
        }
    }
}

#endif

// ---- AVX2 path (where there is no AVX-512: D a multiple of 32): the AVX-512 path's method at 8 lanes. The plain C
// loop reduced every key's dot product on its own and copied each K / V row first: at 2.7k keys, 32 heads of 64
// (Zen 2) it took 2.4 ms a row per layer ----
#if !defined(__AVX512F__) && defined(__AVX2__)
#include <immintrin.h>

static inline __m256 load8(const char *p, int dtype) {  // 8 stored values -> fp32
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

// (sum(v0), sum(v1), sum(v2), sum(v3)): one reduction tree for four dot products
static inline __m128 sum4_avx2(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

// 8 values of a stored K / V row from value c -> fp32, as load16_kv (an 8-bit format's codes unscaled)
static inline __attribute__((always_inline)) __m256 load8_kv(const char *row, int c, const int kv, int D) {
    if (kv == F32) return _mm256_loadu_ps((const float *)row + c);
    if (kv == BF16 || kv == F16) return load8(row + (size_t)c * 2, kv);
    if (kv == KV_Q4) {  // 4 bytes, value 2i in the low nibble of byte i
        int32_t word;
        memcpy(&word, row + c / 2, 4);
        const __m128i b = _mm_cvtsi32_si128(word), low = _mm_set1_epi8(15);
        const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(codes), _mm256_set1_epi32(8)));
        return _mm256_mul_ps(v, _mm256_set1_ps(bf16_at(row + D / 2 + 2 * (c / KV_Q4_GROUP))));
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)(row + c));
    if (kv == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m128i w = _mm_cvtepu8_epi16(b);
    if (kv == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
    w = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),  // e4m3 as fp16 * 2^-8
                     _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(w);
}

// 8 values of a stored K row from value c -> fp32, as load16_k
static inline __attribute__((always_inline)) __m256 load8_k(const char *k, const char *v, int c, const int kv, int D) {
    if (kv != KV_Q4) return load8_kv(k, c, kv, D);
    int32_t word;
    memcpy(&word, k + c / 2, 4);
    const __m128i b = _mm_cvtsi32_si128(word), low = _mm_set1_epi8(15);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i fifth = _mm256_and_si256(_mm256_set1_epi32((uint8_t)k[D / 2 + c / 8]), bits);  // value c + i: bit i
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi32(fifth, bits), _mm256_set1_epi32(16));
    const __m256i wide = _mm256_add_epi32(_mm256_cvtepu8_epi32(codes), high);
    const __m256 x = _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, _mm256_set1_epi32(16)));
    return _mm256_mul_ps(x, _mm256_set1_ps(bf16_at(q4_key_scales(v, D) + 2 * (c / KV_Q4_GROUP))));
}

// scores[g * n + i] = (q_g * scale) . k_(first + i) for the n visible keys; rows[i]: byte offset of key i's K row
static inline __attribute__((always_inline)) void qk_avx2_impl(const char *q_row, const char *k_plane,
                                                               const char *v_plane, const size_t *rows, int n, int G,
                                                               int D, int dtype, size_t es, const int kv, size_t rb,
                                                               float scale, float *qf, float *kf, float *scores) {
    prefetch_kv(k_plane, v_plane, rows, 0, PREFETCH_KEYS, n, rb);  // requested together, not one miss at a time
    for (int g = 0; g < G; g++)  // q * scale in fp32, as attend()
        for (int c = 0; c < D; c += 8)
            _mm256_storeu_ps(qf + g * D + c, _mm256_mul_ps(load8(q_row + ((size_t)g * D + c) * es, dtype),
                                                          _mm256_set1_ps(scale)));
    for (int i = 0; i < n; i += 4) {
        prefetch_kv(k_plane, v_plane, rows, i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4, n, rb);
        const char *k[4], *v[4];
        float ks[4];
        for (int j = 0; j < 4; j++) {
            k[j] = k_plane + rows[i + j < n ? i + j : n - 1];
            v[j] = v_plane + rows[i + j < n ? i + j : n - 1];
            ks[j] = kv_row_scale(k[j], kv, D);
        }
        const __m128 key_scales = _mm_loadu_ps(ks);
        if (kv != F32)  // four K rows -> fp32, once for all G queries
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < D; c += 8) _mm256_storeu_ps(kf + j * D + c, load8_k(k[j], v[j], c, kv, D));
        for (int g = 0; g < G; g++) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int c = 0; c < D; c += 8) {
                const __m256 qv = _mm256_loadu_ps(qf + g * D + c);
                for (int j = 0; j < 4; j++)
                    acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kv == F32 ? (const float *)k[j] + c : kf + j * D + c),
                                             acc[j]);
            }
            float tmp[4];
            _mm_storeu_ps(tmp, _mm_mul_ps(sum4_avx2(acc[0], acc[1], acc[2], acc[3]), key_scales));
            for (int j = 0; j < 4 && i + j < n; j++) scores[(size_t)g * n + i + j] = tmp[j];
        }
    }
}

// acc[g * D + d] = sum_i p[g][i] v_i[d]: two queries' accumulators of 32 dims held in registers over all keys
static inline __attribute__((always_inline)) void pv_avx2_impl(const char *v_plane, const size_t *rows, int n, int G,
                                                               int D, const int kv, const float *scores, float *acc) {
    for (int g0 = 0; g0 < G; g0 += 2) {
        const int gn = G - g0 < 2 ? G - g0 : 2;
        for (int d0 = 0; d0 < D; d0 += 32) {
            __m256 a[2][4];
            for (int g = 0; g < 2; g++)
                for (int c = 0; c < 4; c++) a[g][c] = _mm256_setzero_ps();
            for (int i = 0; i < n; i++) {
                const char *v = v_plane + rows[i];
                const float vs = kv_row_scale(v, kv, D);
                __m256 x[4];
                for (int c = 0; c < 4; c++) x[c] = load8_kv(v, d0 + c * 8, kv, D);
                for (int g = 0; g < 2; g++) {
                    if (g < gn) {
                        const __m256 p = _mm256_set1_ps(scores[(size_t)(g0 + g) * n + i] * vs);
                        for (int c = 0; c < 4; c++) a[g][c] = _mm256_fmadd_ps(p, x[c], a[g][c]);
                    }
                }
            }
            for (int g = 0; g < gn; g++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (size_t)(g0 + g) * D + d0 + c * 8, a[g][c]);
        }
    }
}

#endif

// the SIMD path of this build, where there is one: qk / pv and the head sizes it takes (a multiple of SIMD_HEAD_DIM)
#if defined(__AVX512F__)
#define SIMD_HEAD_DIM 64
#define qk_simd_impl qk_avx512_impl
#define pv_simd_impl pv_avx512_impl
#elif defined(__AVX2__)
#define SIMD_HEAD_DIM 32
#define qk_simd_impl qk_avx2_impl
#define pv_simd_impl pv_avx2_impl
#endif

#if defined(SIMD_HEAD_DIM)  // this build's qk / pv, each dispatched to its copy for the storage format
#define QK_SIMD(q_row, k_plane, v_plane, rows, n, G, D, dtype, es, rb, scale, qf, kf, scores, KV) \
    qk_simd_impl(q_row, k_plane, v_plane, rows, n, G, D, dtype, es, KV, rb, scale, qf, kf, scores)
#define PV_SIMD(v_plane, rows, n, G, D, scores, acc, KV) pv_simd_impl(v_plane, rows, n, G, D, KV, scores, acc)

static void qk_simd(const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G,
                    int D, int dtype, size_t es, int kv, size_t rb, float scale, float *qf, float *kf, float *scores) {
    KV_COPIES(QK_SIMD, q_row, k_plane, v_plane, rows, n, G, D, dtype, es, rb, scale, qf, kf, scores)
}

static void pv_simd(const char *v_plane, const size_t *rows, int n, int G, int D, int kv, const float *scores,
                    float *acc) {
    KV_COPIES(PV_SIMD, v_plane, rows, n, G, D, scores, acc)
}
#endif

#define ATTEND_WITH_HEAD_DIM(name, HEAD_DIM)                                                                     \
    static void name(const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, \
                     int D, float scale, float softcap, int dtype, size_t es, int kv, size_t rb, float *qf,        \
                     float *acc, float *row, float *scores) {                                                     \
        attend(q_row, k_plane, v_plane, rows, n, G, HEAD_DIM, scale, softcap, dtype, es, kv, rb, qf, acc, row,     \
               scores);                                                                                           \
    }
ATTEND_WITH_HEAD_DIM(attend_64, 64)
ATTEND_WITH_HEAD_DIM(attend_128, 128)
ATTEND_WITH_HEAD_DIM(attend_256, 256)
ATTEND_WITH_HEAD_DIM(attend_any, D)

// q: [B] rows of H * D values, row stride q_stride (elements); out: [B, H * D] contiguous; kv: the cache's storage
// (dtype itself, or a quantized format: rows of kv_row_bytes).
void kvf_paged_attention(const void *q, int64_t q_stride, void *out, const void *cache, const int32_t *tables,
                         const int32_t *row_seqs, const int32_t *lens, int32_t batch, int32_t heads, int32_t kv_heads,
                         int32_t head_dim, int32_t num_blocks, int32_t block_size, int32_t width, float scale,
                         int32_t window, float softcap, int32_t dtype, int32_t kv, int32_t threads, int32_t portable) {
    const int G = heads / kv_heads, D = head_dim;
    const size_t es = dtype_size(dtype);
    const size_t rb = kv_row_bytes(kv, D), plane = (size_t)num_blocks * block_size * rb;  // bytes of a (K/V, head)
    int max_len = 0;
    for (int b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    void (*run)(const char *, const char *, const char *, const size_t *, int, int, int, float, float, int, size_t,
                int, size_t, float *, float *, float *, float *) =
        D == 64 ? attend_64 : D == 128 ? attend_128 : D == 256 ? attend_256 : attend_any;

#pragma omp parallel num_threads(threads)
    {
        float *qf = scratch_floats((size_t)G * D);
        float *acc = scratch_floats((size_t)G * D);
        float *row = scratch_floats((size_t)D);
        float *scores = scratch_floats((size_t)G * (max_len > 0 ? max_len : 1));
        float *kf = scratch_floats(4 * (size_t)D);
        size_t *rows = malloc(sizeof(size_t) * (max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < batch * kv_heads; item++) {
            const int b = item / kv_heads, h = item % kv_heads, L = lens[b];
            if (L <= 0) {  // a padding row: zeros
                memset(acc, 0, sizeof(float) * (size_t)G * D);
            } else {
                const int first = (window > 0 && L > window) ? L - window : 0, n = L - first;
                const int32_t *table = tables + (size_t)(row_seqs ? row_seqs[b] : b) * width;
                const char *q_row = (const char *)q + ((size_t)b * q_stride + (size_t)h * G * D) * es;
                const char *k_plane = (const char *)cache + (size_t)h * plane;
                const char *v_plane = (const char *)cache + (size_t)(kv_heads + h) * plane;
                visible_rows(table, first, L, block_size, rb, rows);
#if defined(SIMD_HEAD_DIM)
                if (D % SIMD_HEAD_DIM == 0 && !portable) {  // four keys per reduction tree (the same math as attend())
                    qk_simd(q_row, k_plane, v_plane, rows, n, G, D, dtype, es, kv, rb, scale, qf, kf, scores);
                    soft_cap(scores, (size_t)G * n, softcap);
                    softmax_rows(scores, G, n);
                    pv_simd(v_plane, rows, n, G, D, kv, scores, acc);
                } else
#endif
                    run(q_row, k_plane, v_plane, rows, n, G, D, scale, softcap, dtype, es, kv, rb, qf, acc, row, scores);
            }
            store_row(acc, dtype, G * D, (char *)out + ((size_t)b * heads + (size_t)h * G) * D * es);
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
        free(kf);
        free(rows);
    }
}
