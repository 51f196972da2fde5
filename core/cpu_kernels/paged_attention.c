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
        // a vector max (exact in any order): the scalar loop's chain of dependent maxes was ~70% of the softmax's time
        // and the softmax a fifth of int8's (AMD EPYC Zen 5, 2k keys)
#pragma omp simd reduction(max : m)
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

// ---- AVX-512 and AVX2: the quantized formats read without converting them to fp32 (bf16 / fp16 activations) ----
// The fp32 path spent its time converting K and V to fp32 (AMD EPYC Zen 5, one layer of 64 sequences x 2k keys, 9 q /
// 3 KV heads of 64, scattered blocks, 1 thread: bf16 cache 6.8 ms, int8 6.5, e4m3 9.0, q4 7.0). These paths multiply
// the codes as stored:
// - int8 and q4: q of each head as int16 codes round(q * 32767 / max|q|) with its own fp32 scale (error <= max|q| /
//   65534 a value, ~250x below int8 K's own max|k| / 254), dot products of int16 pairs into int32 (vpdpwssd; vpmaddwd
//   + vpaddd without VNNI, and on AVX2); int8 K with VNNI 16 keys at a time in vpdpbusd (qk_int8_16). The weights (p
//   times the V row's scale) likewise as int16 codes, one fp32 scale per KEY_BLOCK keys and query, against V's codes
//   with two keys' values interleaved (one pair per 32-bit lane), summed in int32 over a block, in fp32 after. q4's
//   codes are read as stored (0..15), the + 8 taken out by starting the int32 sums at -8 * (q's codes / the weights)
//   of the lane's group; its group scales multiply each group's int32 sums.
// - fp8 (AVX-512 BF16): codes -> bf16 by bit arithmetic (sign and magnitude shifted into bf16's fields: the value *
//   2^-120 for e4m3, 2^-112 for e5m2), times q's bf16 (* 2^64, exact) and the weights as a high and a low bf16 (p to
//   16 bits, * 2^64) in vdpbf16ps, which reads bf16 subnormals as zero: an e4m3 code under 2^-6 (a value under
//   max|row| / 28672) or an e5m2 code under 2^-14 (under max|row| / 9.4e8) counts as 0, far below either format's own
//   rounding (2^-4 / 2^-3 of a value). (The 2^64 keeps the products off bf16's and fp32's subnormals; e4m3 rows whose
//   largest value passes ~4e21 would overflow it.)
// Same layer after (Zen 5): bf16 6.6 ms, int8 3.7, e4m3 4.2, q4 3.8 (2 threads: bf16 3.7, int8 1.9, e4m3 2.2, q4
// 2.0; the softmax's vector max took bf16 from 7.9 / 4.1). Tolerance (tests/core/test_kv_quant.py
// test_the_integer_and_bf16_paths_stay_within_their_tolerance): beyond half an ulp of the output, within 2^-9 of the
// largest output for int8 / q4 (measured <= 8e-4: q's int16 rounding moves a peaked softmax's scores by ~1e-3) and
// 2^-12 for fp8 (measured 1e-6), against fp64 attention over the dequantized cache.
#if defined(__AVX2__)
#include <immintrin.h>
// these paths spend fewer cycles a key than the fp32 path: prefetched 16 keys ahead they waited on memory (one layer,
// scattered blocks, 1 thread, Zen 5: int8 5.8 ms; 32 ahead 4.4, 64 ahead 3.9, 96 and 128 no better)
#define QUANT_PREFETCH_KEYS 64
// prefetch_kv for rows of at most 128 bytes (these formats' rows up to D = 64 for 8 bits, 128 for q4; longer rows
// fall back to it): each row's first and last byte, no loop over its lines
static inline void prefetch_short(const char *k_plane, const char *v_plane, const size_t *rows, int from, int to,
                                  int n, size_t row_bytes) {
    if (row_bytes > 128) {
        prefetch_kv(k_plane, v_plane, rows, from, to, n, row_bytes);
        return;
    }
    for (int j = from; j < to && j < n; j++) {
        __builtin_prefetch(k_plane + rows[j], 0, 3);
        __builtin_prefetch(k_plane + rows[j] + row_bytes - 1, 0, 3);
        __builtin_prefetch(v_plane + rows[j], 0, 3);
        __builtin_prefetch(v_plane + rows[j] + row_bytes - 1, 0, 3);
    }
}
// keys whose int16 weights share a scale: 256 * 32767 * 127 < 2^31, their int32 sums cannot overflow
#define KEY_BLOCK 256
#define FP8_SHIFT(kv) ((kv) == KV_E4M3 ? 56 : 48)  // fp8 sums: 2^(120 or 112) of the codes / 2^64 of q or weights
#define Q16 32767.0f   // int8 q.k sums: D * 127 * 32767 < 2^31 for D <= 516 (these paths take D <= 256)

// four keys' scores of query g (i: the first key; fewer than four left at the end: the tail)
static inline void put_scores(float *scores, int n, int g, int i, __m128 s) {
    if (i + 4 <= n) {
        _mm_storeu_ps(scores + (size_t)g * n + i, s);
    } else {
        float tmp[4];
        _mm_storeu_ps(tmp, s);
        for (int j = 0; i + j < n; j++) scores[(size_t)g * n + i + j] = tmp[j];
    }
}

// q's D values of head g -> fp32 in x
static inline void q_f32(const char *q_row, int g, int D, int dtype, float *x) {
    load_row(q_row + (size_t)g * D * dtype_size(dtype), dtype, D, x);
}

// q's G heads -> int16 codes qi[g * D + d] and their scales qs[g] (times `scale`); q4 (`q4` the values a vector reads:
// 64 or 32) puts each `q4` values' even ones first, then the odd: value 2w at w, 2w + 1 at q4 / 2 + w
static inline void q_int16(const char *q_row, int G, int D, int dtype, float scale, int q4, int16_t *qi, float *qs,
                           float *x) {
    for (int g = 0; g < G; g++) {
        q_f32(q_row, g, D, dtype, x);
        float m = 0.0f;
        for (int d = 0; d < D; d++) m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
        const float inv = m > 0.0f ? Q16 / m : 0.0f;
        qs[g] = m / Q16 * scale;
        for (int d = 0; d < D; d++) {
            const int at = q4 ? d - d % q4 + (d & 1) * (q4 / 2) + d % q4 / 2 : d;
            qi[(size_t)g * D + at] = (int16_t)lrintf(x[d] * inv);
        }
    }
}

// The weighted sum's scratch (wbuf, one per thread): the weights of a key block (int16 [G][groups (at least 2)]
// [KEY_BLOCK]), their scales [G], their sums [G][groups] (+ 16), the block's V scales and p ([groups + 1][KEY_BLOCK]
// floats), then every visible key's V scales as stored (vraw: [max_len][groups] bf16)
static inline size_t wbuf_fixed_bytes(int G, int D) {
    const size_t groups = D / KV_Q4_GROUP, wide = groups > 2 ? groups : 2;
    return (size_t)G * KEY_BLOCK * wide * 2 + 4 * (size_t)G + 4 * ((size_t)G * groups + 16) +
           4 * (groups + 1) * KEY_BLOCK;
}

// the V rows' scales of keys [from, to) -> vraw (q4: each row's D / 32, together), read in the scores pass, where the
// prefetch brought the rows in: gathered in the weighted sum's pass they waited on its first touch of each row (the
// loop was half of that pass's time at 2k keys in cache, Zen 5)
static inline void gather_scales(const char *v_plane, const size_t *rows, int from, int to, int n, int D, const int kv,
                                 uint16_t *vraw) {
    const int groups = kv == KV_Q4 ? D / KV_Q4_GROUP : 1;
    const int offset = kv == KV_Q4 ? D / 2 : D;
    for (int j = from; j < to && j < n; j++) memcpy(vraw + (size_t)j * groups, v_plane + rows[j] + offset, 2 * groups);
}

// The weights of one block of keys [b0, b0 + bn) for each query g: p * the V row's scale (q4: each group's), as int16
// codes w[g][group][key] with one scale per query wsc[g] (int8, q4; q4 also wsum[g][group], the sum of the group's
// codes), or as a high and a low bf16 hi[g][key], lo = hi + KEY_BLOCK (fp8, times 2^64). vs: scratch of groups *
// KEY_BLOCK floats. Keys past the block, to the next 16, get weight 0. Plain C: the compiler's vectors for either ISA
static inline __attribute__((always_inline)) void block_weights(
        int n, int b0, int bn, int G, const int D, const int kv,
        const float *scores, const uint16_t *vraw, int16_t *wq, float *wsc, int32_t *wsum, float *vs) {
    const int groups = kv == KV_Q4 ? D / KV_Q4_GROUP : 1, integer = kv == KV_I8 || kv == KV_Q4;
    const int padded = (bn + 15) & ~15;
    const float factor = integer ? 1.0f : 18446744073709551616.0f;
    for (int gr = 0; gr < groups; gr++)
#pragma omp simd
        for (int i = 0; i < bn; i++)
            vs[gr * KEY_BLOCK + i] = bits_to_f32((uint32_t)vraw[(size_t)(b0 + i) * groups + gr] << 16) * factor;
    for (int gr = 0; gr < groups; gr++)
        for (int i = bn; i < padded; i++) vs[gr * KEY_BLOCK + i] = 0.0f;
    for (int g = 0; g < G; g++) {
        float *p = vs + (size_t)groups * KEY_BLOCK;  // this query's p, zeros after the block
        memcpy(p, scores + (size_t)g * n + b0, sizeof(float) * bn);
        for (int i = bn; i < padded; i++) p[i] = 0.0f;
        int16_t *w = wq + (size_t)g * KEY_BLOCK * (groups > 2 ? groups : 2);
        if (!integer) {  // hi = bf16(p * s), lo = bf16(p * s - hi), rounded to nearest even
            uint16_t *hi = (uint16_t *)w, *lo = hi + KEY_BLOCK;
#pragma omp simd
            for (int i = 0; i < padded; i++) {
                const float f = p[i] * vs[i];
                const uint32_t u = f32_to_bits(f), h = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
                const uint32_t r = f32_to_bits(f - bits_to_f32(h << 16));
                hi[i] = (uint16_t)h;
                lo[i] = (uint16_t)((r + 0x7FFF + ((r >> 16) & 1)) >> 16);
            }
            continue;
        }
        float top = 0.0f;
        for (int gr = 0; gr < groups; gr++)
#pragma omp simd reduction(max : top)
            for (int i = 0; i < padded; i++) {
                const float f = fabsf(p[i] * vs[gr * KEY_BLOCK + i]);
                top = f > top ? f : top;
            }
        const float inv = top > 0.0f ? Q16 / top : 0.0f;
        wsc[g] = top / Q16;
        for (int gr = 0; gr < groups; gr++) {
            int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < padded; i++) {  // round to nearest even (1.5 * 2^23), |code| <= 32767
                const int32_t c = (int32_t)((p[i] * vs[gr * KEY_BLOCK + i] * inv + 12582912.0f) - 12582912.0f);
                w[gr * KEY_BLOCK + i] = (int16_t)c;
                sum += c;
            }
            if (kv == KV_Q4) wsum[g * groups + gr] = sum;
        }
    }
}

#endif

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
    // a quantized cache read here (fp32 activations; fp16 for fp8) as far ahead as the quantized paths
    const int ahead = kv > F16 ? QUANT_PREFETCH_KEYS : PREFETCH_KEYS;
    prefetch_kv(k_plane, v_plane, rows, 0, ahead, n, rb);  // requested together, not one miss at a time
#if defined(__AVX512BF16__)
    if (kv == BF16) {  // bf16 pairs multiplied exactly into fp32 sums: no conversion of K
        for (int i = 0; i < n; i += 4) {
            const char *k[4];
            for (int j = 0; j < 4; j++) k[j] = k_plane + rows[i + j < n ? i + j : n - 1];
            prefetch_kv(k_plane, v_plane, rows, i + ahead, i + ahead + 4, n, rb);
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
            prefetch_kv(k_plane, v_plane, rows, i + ahead, i + ahead + 4, n, rb);
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
        prefetch_kv(k_plane, v_plane, rows, i + ahead, i + ahead + 4, n, rb);
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

#if defined(__AVX512BW__)
static inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {  // acc + pairwise sums of int16 products
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

static inline __m128i sum4_epi32(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {  // sum4's tree in int32 (exact)
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
    __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
}

// int8 K: scores = (q's int16 codes . K's int8 codes) * q's scale * the row's scale; D a constant in each copy
static inline __attribute__((always_inline)) void qk_int8_512(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int16_t *qi = (int16_t *)qbuf;
    float *qs = (float *)(qbuf + (size_t)G * D * 2);
    q_int16(q_row, G, D, dtype, scale, 0, qi, qs, x);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 4) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 4, n, rb);
        gather_scales(v_plane, rows, i, i + 4, n, D, KV_I8, vraw);
        __m512i kk[4][8];  // D / 32 int16 vectors a key (registers: D is a constant)
        float ks[4];
        for (int j = 0; j < 4; j++) {
            const char *k = k_plane + rows[i + j < n ? i + j : n - 1];
            ks[j] = bf16_at(k + D);
            for (int c = 0; c < D / 32; c++)
                kk[j][c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(k + 32 * c)));
        }
        const __m128 key_scales = _mm_loadu_ps(ks);
        for (int g = 0; g < G; g++) {
            __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                              _mm512_setzero_si512()};
            for (int c = 0; c < D / 32; c++) {
                const __m512i qv = _mm512_loadu_si512((const void *)(qi + (size_t)g * D + 32 * c));
                for (int j = 0; j < 4; j++) acc[j] = dot16(acc[j], qv, kk[j][c]);
            }
            const __m128 s = _mm_cvtepi32_ps(sum4_epi32(acc[0], acc[1], acc[2], acc[3]));
            put_scores(scores, n, g, i, _mm_mul_ps(_mm_mul_ps(s, key_scales), _mm_set1_ps(qs[g])));
        }
    }
}

#if defined(__AVX512VNNI__)
// 16 rows of 16 dwords -> 16 columns (r[c] lane j: row j's dword c): 64 shuffles
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[4a + b] lane L: rows 4a..4a+3 of dword 4L + b
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int b = 0; b < 4; b++) {  // then a 4 x 4 transpose of 128-bit lanes
        const __m512i v0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44), v1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xEE);
        t[b] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + b] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        t[8 + b] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// q's head g as int16 codes to +-32639 split into a signed high and a low byte (q = 256 h + l; |q| <= 32639 keeps h
// in int8: vpdpbusd's signed operand) at qh / ql, its scale (times `scale`) in qs[g]; per `span` values the sums of
// the high and of the low bytes times -`offset` (what the stored codes' + offset adds to the dot products) in
// start[(g * D / span + span index) * 2] and [... + 1]. `grouped`: within each 32 values the even ones first, then
// the odd (q4_codes64's order)
static inline void q_bytes(const char *q_row, int g, int D, int dtype, float scale, int span, int offset, int grouped,
                           int8_t *qh, int8_t *ql, float *qs, int32_t *start, float *x) {
    q_f32(q_row, g, D, dtype, x);
    float m = 0.0f;
    for (int d = 0; d < D; d++) m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
    const float inv = m > 0.0f ? 32639.0f / m : 0.0f;
    qs[g] = m / 32639.0f * scale;
    for (int first = 0; first < D; first += span) {
        int32_t sh = 0, sl = 0;
        for (int d = first; d < first + span; d++) {
            const int w = d % 32, at = g * D + (grouped ? d - w + (w & 1) * 16 + w / 2 : d);
            const int c = (int)lrintf(x[d] * inv), l = ((c + 128) & 255) - 128;
            qh[at] = (int8_t)((c - l) / 256);
            ql[at] = (int8_t)l;
            sh += (c - l) / 256;
            sl += l;
        }
        start[(g * (D / span) + first / span) * 2] = -offset * sh;
        start[(g * (D / span) + first / span) * 2 + 1] = -offset * sl;
    }
}

// int8 K, 16 keys at a time with no horizontal sums: their rows transposed (lane j: key j's 4 codes of a dword), the
// codes + 128 (unsigned) times q's int16 codes split into a signed high and low byte (q = 256 h + l; |q| <= 32639
// keeps h in int8) in vpdpbusd: two instructions per dword and query for 16 keys, where the 4-key path spent two a key
// plus the 4-key sums (the layer above, int8, 1 thread: 4.35 -> 3.7 ms; 8 sequences in cache 0.38 -> 0.33 ms). The + 128 is taken out by starting the sums at -128 * (the sum of q's high / low bytes); then
// sum_h * 256 + sum_l = q . k exactly (|sum_h| <= D * 128 * 127: no int32 overflow for D <= 256).
static inline __attribute__((always_inline)) void qk_int8_16(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int8_t *qh = (int8_t *)qbuf, *ql = qh + (size_t)G * D;
    float *qs = (float *)(qbuf + 2 * (size_t)G * D);
    int32_t *start = (int32_t *)(qs + G);  // [G][high, low]
    for (int g = 0; g < G; g++) q_bytes(q_row, g, D, dtype, scale, D, 128, 0, qh, ql, qs, start, x);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 16) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 16, n, rb);
        gather_scales(v_plane, rows, i, i + 16, n, D, KV_I8, vraw);
        const char *k[16];
        uint16_t sc[16];
        for (int j = 0; j < 16; j++) {
            k[j] = k_plane + rows[i + j < n ? i + j : n - 1];
            memcpy(sc + j, k[j] + D, 2);
        }
        const __m512 key_scales = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)sc)), 16));
        __m512i kt[D / 64][16];  // per 64 codes, dword c of the 16 keys
        for (int c = 0; c < D / 64; c++) {
            for (int j = 0; j < 16; j++)
                kt[c][j] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(k[j] + 64 * c)), flip);
            transpose16(kt[c]);
        }
        const __mmask16 tail = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        for (int g = 0; g < G; g++) {
            // four sums each for the high and low bytes: one chain of 16 dependent vpdpbusd was latency-bound
            __m512i sh[4] = {_mm512_set1_epi32(start[2 * g]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                             _mm512_setzero_si512()};
            __m512i sl[4] = {_mm512_set1_epi32(start[2 * g + 1]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                             _mm512_setzero_si512()};
            const int32_t *h = (const int32_t *)(qh + (size_t)g * D), *l = (const int32_t *)(ql + (size_t)g * D);
            for (int c = 0; c < D / 64; c++)
                for (int e = 0; e < 16; e++) {
                    int32_t hw, lw;
                    memcpy(&hw, h + 16 * c + e, 4);
                    memcpy(&lw, l + 16 * c + e, 4);
                    sh[e % 4] = _mm512_dpbusd_epi32(sh[e % 4], kt[c][e], _mm512_set1_epi32(hw));
                    sl[e % 4] = _mm512_dpbusd_epi32(sl[e % 4], kt[c][e], _mm512_set1_epi32(lw));
                }
            const __m512i h4 = _mm512_add_epi32(_mm512_add_epi32(sh[0], sh[1]), _mm512_add_epi32(sh[2], sh[3]));
            const __m512i l4 = _mm512_add_epi32(_mm512_add_epi32(sl[0], sl[1]), _mm512_add_epi32(sl[2], sl[3]));
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h4, 8), l4));
            _mm512_mask_storeu_ps(scores + (size_t)g * n + i, tail,
                                  _mm512_mul_ps(_mm512_mul_ps(s, key_scales), _mm512_set1_ps(qs[g])));
        }
    }
}
#endif

// the even and the odd bits of a 64-bit word, each packed into 32 (bit w of *even: bit 2w of x)
static inline void unzip_bits(uint64_t x, uint32_t *even, uint32_t *odd) {
#if defined(__BMI2__)
    *even = (uint32_t)_pext_u64(x, 0x5555555555555555ull);
    *odd = (uint32_t)_pext_u64(x, 0xAAAAAAAAAAAAAAAAull);
#else
    uint32_t e = 0, o = 0;
    for (int w = 0; w < 32; w++) {
        e |= (uint32_t)((x >> (2 * w)) & 1) << w;
        o |= (uint32_t)((x >> (2 * w + 1)) & 1) << w;
    }
    *even = e, *odd = o;
#endif
}

// q4 K (5-bit codes): per 64 values (32 bytes of low nibbles, two groups) one vector of 32 zero-extended bytes, its low
// nibbles (values 2w) and high nibbles (2w + 1), each plus 16 where the value's fifth bit is set (a masked add), against
// q's even and odd codes; lanes 0-7 sum the first group, 8-15 the second, each times its scale (K's scales: in the V row
// of the key); the int32 sums start at -16 * (q's codes of the lane's values): the stored codes' + 16 taken out
static inline __attribute__((always_inline)) void qk_q4_512(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int16_t *qi = (int16_t *)qbuf;
    float *qs = (float *)(qbuf + (size_t)G * D * 2);
    int32_t *corr = (int32_t *)(qbuf + (size_t)G * D * 2 + 4 * (size_t)G + 64 - (4 * (size_t)G) % 64);  // [G][D/64][16]
    q_int16(q_row, G, D, dtype, scale, 64, qi, qs, x);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 64; c++)
            for (int k = 0; k < 16; k++) {
                const int16_t *e = qi + (size_t)g * D + 64 * c, *o = e + 32;
                corr[((size_t)g * (D / 64) + c) * 16 + k] = -16 * (e[2 * k] + e[2 * k + 1] + o[2 * k] + o[2 * k + 1]);
            }
    // two bf16 group scales (one 32-bit word) -> fp32: lanes 0-7 the first, 8-15 the second (odd words; even words 0)
    const __m512i spread = _mm512_set_epi16(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 4) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 4, n, rb);
        gather_scales(v_plane, rows, i, i + 4, n, D, KV_Q4, vraw);
        __m512i lo[4][4], hi[4][4];
        __m512 sv[4][4];
        for (int j = 0; j < 4; j++) {
            const size_t r = rows[i + j < n ? i + j : n - 1];
            const char *k = k_plane + r, *key_scales = q4_key_scales(v_plane + r, D);
            for (int c = 0; c < D / 64; c++) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(k + 32 * c)));
                uint64_t fifth;
                uint32_t even, odd;
                memcpy(&fifth, k + D / 2 + 8 * c, 8);
                unzip_bits(fifth, &even, &odd);
                lo[j][c] = _mm512_mask_add_epi16(_mm512_and_si512(w, low), even, _mm512_and_si512(w, low), sixteen);
                hi[j][c] = _mm512_mask_add_epi16(_mm512_srli_epi16(w, 4), odd, _mm512_srli_epi16(w, 4), sixteen);
                int32_t s2;
                memcpy(&s2, key_scales + 4 * c, 4);
                const __m512i s = _mm512_castsi128_si512(_mm_cvtsi32_si128(s2));
                sv[j][c] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread, s));
            }
        }
        for (int g = 0; g < G; g++) {
            __m512 f[4];
            for (int c = 0; c < D / 64; c++) {
                const int16_t *e = qi + (size_t)g * D + 64 * c;
                const __m512i qe = _mm512_loadu_si512((const void *)e), qo = _mm512_loadu_si512((const void *)(e + 32));
                const __m512i c0 = _mm512_loadu_si512((const void *)(corr + ((size_t)g * (D / 64) + c) * 16));
                for (int j = 0; j < 4; j++) {
                    const __m512 a = _mm512_cvtepi32_ps(dot16(dot16(c0, lo[j][c], qe), hi[j][c], qo));
                    f[j] = c == 0 ? _mm512_mul_ps(a, sv[j][c]) : _mm512_fmadd_ps(a, sv[j][c], f[j]);
                }
            }
            put_scores(scores, n, g, i, _mm_mul_ps(sum4(f[0], f[1], f[2], f[3]), _mm_set1_ps(qs[g])));
        }
    }
}

#if defined(__AVX512VNNI__)
// a q4 K row's 64 values from c * 64 (32 bytes of nibbles, 8 of fifth bits) as 64 unsigned codes 0..31, in the byte
// order [group 2c's even values, its odd values, group 2c + 1's even, its odd] (16 bytes each): the nibbles of each
// 16-byte half twice (low, then high), the fifth bits' mask in the same order (vpshufbitqmb where there is BITALG)
static inline __m512i q4_codes64(const char *k, int D, int c) {
    const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(k + 32 * c)));
    const __m512i twice = _mm512_shuffle_i64x2(x, x, 0x50);  // 128-bit lanes [0, 0, 1, 1]
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i codes = _mm512_mask_blend_epi8(0xFFFF0000FFFF0000ull, _mm512_and_si512(twice, nibble),
                                                 _mm512_and_si512(_mm512_srli_epi16(twice, 4), nibble));
    uint64_t fifth;
    memcpy(&fifth, k + D / 2 + 8 * c, 8);
#if defined(__AVX512BITALG__)
    // byte p's value in the chunk: 2p, 2(p - 16) + 1, 32 + 2(p - 32), 33 + 2(p - 48)
    const __m512i at = _mm512_set_epi8(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                       62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                       31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                       30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __mmask64 high = _mm512_bitshuffle_epi64_mask(_mm512_set1_epi64((long long)fifth), at);
#else
    uint32_t even, odd;
    unzip_bits(fifth, &even, &odd);
    const __mmask64 high = (uint64_t)(even & 0xFFFF) | (uint64_t)(odd & 0xFFFF) << 16 | (uint64_t)(even >> 16) << 32 |
                           (uint64_t)(odd >> 16) << 48;
#endif
    return _mm512_mask_add_epi8(codes, high, codes, _mm512_set1_epi8(16));
}

// q4 K, 16 keys at a time (as qk_int8_16): each key's codes as stored (value + 16, unsigned) in q4_codes64's order,
// the 16 rows transposed, times q's int16 codes (in the same order) split into a signed high and low byte in
// vpdpbusd; a group's 8 dwords summed on their own (two chains each), the + 16 taken out by starting its sums at
// -16 * (the sum of q's high / low bytes over the group), then times the group's K scales (16 keys' in a vector).
// The 4-key path (qk_q4_512) unpacked and summed each key alone: one layer, 64 x 2k keys, 2 threads, Zen 5, its
// scores pass took ~1.1 of 2.35 ms
static inline __attribute__((always_inline)) void qk_q4_16(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int8_t *qh = (int8_t *)qbuf, *ql = qh + (size_t)G * D;
    float *qs = (float *)(qbuf + 2 * (size_t)G * D);
    int32_t *start = (int32_t *)(qs + G);  // [G][D / 32][high, low]
    for (int g = 0; g < G; g++) q_bytes(q_row, g, D, dtype, scale, KV_Q4_GROUP, 16, 1, qh, ql, qs, start, x);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 16) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 16, n, rb);
        gather_scales(v_plane, rows, i, i + 16, n, D, KV_Q4, vraw);
        const char *k[16];
        uint16_t sc[D / KV_Q4_GROUP][16];
        for (int j = 0; j < 16; j++) {
            const size_t r = rows[i + j < n ? i + j : n - 1];
            const char *key_scales = q4_key_scales(v_plane + r, D);
            k[j] = k_plane + r;
            for (int grp = 0; grp < D / KV_Q4_GROUP; grp++) memcpy(&sc[grp][j], key_scales + 2 * grp, 2);
        }
        __m512 key_scales[D / KV_Q4_GROUP];
        for (int grp = 0; grp < D / KV_Q4_GROUP; grp++)
            key_scales[grp] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)sc[grp])), 16));
        __m512i kt[D / 64][16];  // per 64 values, dword e of the 16 keys (dwords 0-7 one group, 8-15 the next)
        for (int c = 0; c < D / 64; c++) {
            for (int j = 0; j < 16; j++) kt[c][j] = q4_codes64(k[j], D, c);
            transpose16(kt[c]);
        }
        const __mmask16 tail = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        for (int g = 0; g < G; g++) {
            __m512 f = _mm512_setzero_ps();
            for (int grp = 0; grp < D / KV_Q4_GROUP; grp++) {
                const int32_t *st = start + (g * (D / KV_Q4_GROUP) + grp) * 2;
                __m512i sh[2] = {_mm512_set1_epi32(st[0]), _mm512_setzero_si512()};
                __m512i sl[2] = {_mm512_set1_epi32(st[1]), _mm512_setzero_si512()};
                const int8_t *h = qh + (size_t)g * D + grp * KV_Q4_GROUP, *l = ql + (size_t)g * D + grp * KV_Q4_GROUP;
                for (int e = 0; e < 8; e++) {
                    int32_t hw, lw;
                    memcpy(&hw, h + 4 * e, 4);
                    memcpy(&lw, l + 4 * e, 4);
                    const __m512i codes = kt[grp / 2][(grp & 1) * 8 + e];
                    sh[e & 1] = _mm512_dpbusd_epi32(sh[e & 1], codes, _mm512_set1_epi32(hw));
                    sl[e & 1] = _mm512_dpbusd_epi32(sl[e & 1], codes, _mm512_set1_epi32(lw));
                }
                const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(sh[0], sh[1]), 8),
                                                     _mm512_add_epi32(sl[0], sl[1]));
                f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), key_scales[grp], f);
            }
            _mm512_mask_storeu_ps(scores + (size_t)g * n + i, tail, _mm512_mul_ps(f, _mm512_set1_ps(qs[g])));
        }
    }
}
#endif

#if defined(__AVX512BF16__)
// 64 fp8 codes (a zmm) -> two vectors of 32 bf16 (the value * 2^-120 (e4m3) / 2^-112 (e5m2)): bytes 0-7 of each 16 in
// the first, 8-15 in the second. unpack with zeros puts a code in its word's high byte; an arithmetic shift moves the
// exponent and mantissa into bf16's fields with copies of the sign above them, cleared by the mask
static inline __m512i fp8_bf16(__m512i words, const int kv) {
    return kv == KV_E4M3 ? _mm512_and_si512(_mm512_srai_epi16(words, 4), _mm512_set1_epi16((short)0x87FF))
                         : _mm512_and_si512(_mm512_srai_epi16(words, 3), _mm512_set1_epi16((short)0x8FFF));
}

// fp8 K: scores = (q * 2^64 in bf16, its values in the codes' order) . K's codes as bf16, times 2^56 / 2^48 and the
// row's scale
static inline __attribute__((always_inline)) void qk_fp8_512(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        const int kv, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    uint16_t *qb = (uint16_t *)qbuf;  // [G][D]: per 64, the values of fp8_bf16's first vector, then its second's
    for (int g = 0; g < G; g++) {
        q_f32(q_row, g, D, BF16, x);
        for (int c = 0; c < D; c += 32) {
            float t[32];
            for (int w = 0; w < 32; w++) {
                const int base = (c & ~63) + (c & 32) / 4;  // first vector: bytes 0-7 of each 16; second: 8-15
                t[w] = x[base + 16 * (w / 8) + w % 8];
            }
            const __m512 two64 = _mm512_set1_ps(18446744073709551616.0f);
            _mm512_storeu_si512((void *)(qb + (size_t)g * D + c),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(t + 16), two64),
                                                             _mm512_mul_ps(_mm512_loadu_ps(t), two64)));
        }
    }
    const float factor = scale * (float)(1ull << FP8_SHIFT(kv));
    const __m512i zero = _mm512_setzero_si512();
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 4) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 4, n, rb);
        gather_scales(v_plane, rows, i, i + 4, n, D, kv, vraw);
        __m512i kk[4][8];
        float ks[4];
        for (int j = 0; j < 4; j++) {
            const char *k = k_plane + rows[i + j < n ? i + j : n - 1];
            ks[j] = bf16_at(k + D) * factor;
            for (int c = 0; c < D / 64; c++) {
                const __m512i z = _mm512_loadu_si512((const void *)(k + 64 * c));
                kk[j][2 * c] = fp8_bf16(_mm512_unpacklo_epi8(zero, z), kv);
                kk[j][2 * c + 1] = fp8_bf16(_mm512_unpackhi_epi8(zero, z), kv);
            }
        }
        const __m128 key_scales = _mm_loadu_ps(ks);
        for (int g = 0; g < G; g++) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int c = 0; c < D / 32; c++) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qb + (size_t)g * D + 32 * c));
                for (int j = 0; j < 4; j++) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)kk[j][c]);
            }
            put_scores(scores, n, g, i, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), key_scales));
        }
    }
}
#endif

// The dimension that lane k of vector c (of the four that hold 64 dimensions of two keys) carries, per format
static inline int pair_dim(int kv, int c, int k) {
    if (kv == KV_I8) return 32 * (c / 2) + 8 * (k / 4) + 4 * (c % 2) + k % 4;  // unpack{lo,hi}_epi16 of 32 values
    if (kv == KV_Q4) {  // c: (bytes 0-7 / 8-15 of each 16) * 2 + (low / high nibble)
        const int byte = (k < 8 ? k : k + 8) + 8 * (c / 2);
        return 2 * byte + c % 2;
    }
    return 16 * (k / 4) + 4 * c + k % 4;  // fp8: unpack{lo,hi}_epi8 twice
}

// 64 dimensions [d0, d0 + 64) of keys a and b as four vectors of (a's value, b's value) pairs, in pair_dim's order:
// int16 codes (int8 as is, q4's 0..15) or bf16 (fp8)
static inline __attribute__((always_inline)) void load_pairs(const char *a, const char *b, int d0, const int kv,
                                                             __m512i x[4]) {
    if (kv == KV_I8) {
        for (int h = 0; h < 2; h++) {
            const __m512i A = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(a + d0 + 32 * h)));
            const __m512i B = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + d0 + 32 * h)));
            x[2 * h] = _mm512_unpacklo_epi16(A, B);
            x[2 * h + 1] = _mm512_unpackhi_epi16(A, B);
        }
    } else if (kv == KV_Q4) {
        const __m256i A = _mm256_loadu_si256((const __m256i *)(a + d0 / 2));
        const __m256i B = _mm256_loadu_si256((const __m256i *)(b + d0 / 2));
        const __m512i low = _mm512_set1_epi16(15);
        const __m512i X0 = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(A, B)), X1 = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(A, B));
        x[0] = _mm512_and_si512(X0, low);
        x[1] = _mm512_srli_epi16(X0, 4);
        x[2] = _mm512_and_si512(X1, low);
        x[3] = _mm512_srli_epi16(X1, 4);
    } else {
#if defined(__AVX512BF16__)
        const __m512i A = _mm512_loadu_si512((const void *)(a + d0)), B = _mm512_loadu_si512((const void *)(b + d0));
        const __m512i zero = _mm512_setzero_si512(), lo = _mm512_unpacklo_epi8(A, B), hi = _mm512_unpackhi_epi8(A, B);
        x[0] = fp8_bf16(_mm512_unpacklo_epi8(zero, lo), kv);
        x[1] = fp8_bf16(_mm512_unpackhi_epi8(zero, lo), kv);
        x[2] = fp8_bf16(_mm512_unpacklo_epi8(zero, hi), kv);
        x[3] = fp8_bf16(_mm512_unpackhi_epi8(zero, hi), kv);
#endif
    }
}

// acc[g * D + d] = sum_i p[g][i] v_i[d] over blocks of KEY_BLOCK keys: per block the weights (block_weights), then
// per 4 queries x 64 dimensions the keys two at a time (load_pairs) into int32 (int8, q4) or fp32 (fp8) sums; the
// int32 sums go into acc (in pair_dim's order) at the block's end, times its scale; acc put in order at the end
static inline __attribute__((always_inline)) void pv_quant_512(
        const char *v_plane, const size_t *rows, int n, int G, const int D, const int kv, const float *scores,
        float *acc, char *wbuf, const uint16_t *vraw) {
    const int groups = kv == KV_Q4 ? D / KV_Q4_GROUP : 1, integer = kv == KV_I8 || kv == KV_Q4;
    int16_t *wq = (int16_t *)wbuf;
    float *wsc = (float *)(wbuf + (size_t)G * KEY_BLOCK * (groups > 2 ? groups : 2) * 2);
    int32_t *wsum = (int32_t *)(wsc + G);
    float *vs = (float *)(wsum + (size_t)G * groups + 16);
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int b0 = 0; b0 < n; b0 += KEY_BLOCK) {
        const int bn = n - b0 < KEY_BLOCK ? n - b0 : KEY_BLOCK;
        block_weights(n, b0, bn, G, D, kv, scores, vraw, wq, wsc, wsum, vs);
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int gn = G - g0 < 4 ? G - g0 : 4;
            for (int d0 = 0; d0 < D; d0 += 64) {
                __m512i a[4][4];
                for (int g = 0; g < 4; g++)
                    for (int c = 0; c < 4; c++) {
                        a[g][c] = _mm512_setzero_si512();
                        if (kv == KV_Q4 && g < gn) {  // -8 * the group's weights: the stored codes' + 8 taken out
                            const int32_t *s = wsum + (g0 + g) * groups + d0 / 32;
                            a[g][c] = _mm512_mask_set1_epi32(_mm512_set1_epi32(-8 * s[0]), 0xFF00, -8 * s[1]);
                        }
                    }
                for (int i = 0; i < bn; i += 2) {
                    const char *va = v_plane + rows[b0 + i], *vb = v_plane + rows[b0 + (i + 1 < bn ? i + 1 : i)];
                    __m512i x[4];
                    load_pairs(va, vb, d0, kv, x);
                    for (int g = 0; g < 4; g++) {
                        if (g >= gn) continue;
                        const int16_t *w = wq + (size_t)(g0 + g) * KEY_BLOCK * (groups > 2 ? groups : 2);
                        if (kv == KV_I8) {
                            int32_t pair;
                            memcpy(&pair, w + i, 4);
                            const __m512i wv = _mm512_set1_epi32(pair);
                            for (int c = 0; c < 4; c++) a[g][c] = dot16(a[g][c], x[c], wv);
                        } else if (kv == KV_Q4) {
                            int32_t pair[2];  // this pair's weights in the chunk's two groups
                            memcpy(pair, w + (d0 / 32) * KEY_BLOCK + i, 4);
                            memcpy(pair + 1, w + (d0 / 32 + 1) * KEY_BLOCK + i, 4);
                            const __m512i wv = _mm512_mask_set1_epi32(_mm512_set1_epi32(pair[0]), 0xFF00, pair[1]);
                            for (int c = 0; c < 4; c++) a[g][c] = dot16(a[g][c], x[c], wv);
                        } else {
#if defined(__AVX512BF16__)
                            int32_t hi, lo;
                            memcpy(&hi, w + i, 4);
                            memcpy(&lo, w + KEY_BLOCK + i, 4);
                            const __m512bh wh = (__m512bh)_mm512_set1_epi32(hi), wl = (__m512bh)_mm512_set1_epi32(lo);
                            for (int c = 0; c < 4; c++) {
                                __m512 f = _mm512_castsi512_ps(a[g][c]);
                                f = _mm512_dpbf16_ps(_mm512_dpbf16_ps(f, (__m512bh)x[c], wh), (__m512bh)x[c], wl);
                                a[g][c] = _mm512_castps_si512(f);
                            }
#endif
                        }
                    }
                }
                for (int g = 0; g < gn; g++)
                    for (int c = 0; c < 4; c++) {
                        float *to = acc + (size_t)(g0 + g) * D + d0 + 16 * c;
                        const __m512 f = integer ? _mm512_mul_ps(_mm512_cvtepi32_ps(a[g][c]), _mm512_set1_ps(wsc[g0 + g]))
                                                 : _mm512_castsi512_ps(a[g][c]);
                        _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), f));
                    }
            }
        }
    }
    const float factor = integer ? 1.0f : (float)(1ull << FP8_SHIFT(kv));  // fp8: 2^-120 (2^-112) codes, 2^64 weights
    for (int g = 0; g < G; g++)
        for (int d0 = 0; d0 < D; d0 += 64) {
            float t[64], *to = acc + (size_t)g * D + d0;
            memcpy(t, to, sizeof t);
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 16; k++) to[pair_dim(kv, c, k)] = t[16 * c + k] * factor;
        }
}

// whether the paths above take a (format, activation dtype, head size): the integer ones bf16 / fp16 activations (an
// fp32 model keeps fp32 math: the fp32 path), the fp8 one bf16 (q as it is, exact)
static int quant_path(int kv, int dtype, int D) {
    if (D != 64 && D != 128 && D != 256) return 0;
    if (kv == KV_I8 || kv == KV_Q4) return dtype != F32;
#if defined(__AVX512BF16__)
    if (kv == KV_E4M3 || kv == KV_E5M2) return dtype == BF16;
#endif
    return 0;
}

static inline __attribute__((always_inline)) void attend_quant_impl(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, const int kv, size_t rb, float scale, float softcap, char *qbuf, float *x, float *scores,
        float *acc, char *wbuf) {
    uint16_t *vraw = (uint16_t *)(wbuf + wbuf_fixed_bytes(G, D));
#if defined(__AVX512VNNI__)
    if (kv == KV_I8) qk_int8_16(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
#else
    if (kv == KV_I8) qk_int8_512(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
#endif
#if defined(__AVX512VNNI__)
    else if (kv == KV_Q4) qk_q4_16(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
#else
    else if (kv == KV_Q4) qk_q4_512(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
#endif
#if defined(__AVX512BF16__)
    else qk_fp8_512(q_row, k_plane, v_plane, rows, n, G, D, kv, rb, scale, qbuf, x, scores, vraw);
#endif
    soft_cap(scores, (size_t)G * n, softcap);
    softmax_rows(scores, G, n);
    pv_quant_512(v_plane, rows, n, G, D, kv, scores, acc, wbuf, vraw);
}

#define QUANT_PATH 1
#endif

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
    if (kv == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
    // e4m3 as fp16 * 2^-8: sign-extended, shifted into fp16's fields, the sign's copy above the exponent cleared
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(b), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBFFF)));
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
    const int ahead = kv > F16 ? QUANT_PREFETCH_KEYS : PREFETCH_KEYS;  // as qk_avx512_impl
    prefetch_kv(k_plane, v_plane, rows, 0, ahead, n, rb);  // requested together, not one miss at a time
    for (int g = 0; g < G; g++)  // q * scale in fp32, as attend()
        for (int c = 0; c < D; c += 8)
            _mm256_storeu_ps(qf + g * D + c, _mm256_mul_ps(load8(q_row + ((size_t)g * D + c) * es, dtype),
                                                          _mm256_set1_ps(scale)));
    for (int i = 0; i < n; i += 4) {
        prefetch_kv(k_plane, v_plane, rows, i + ahead, i + ahead + 4, n, rb);
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

// The AVX-512 section's int8 and q4 paths at 8 lanes (see there): vpmaddwd + vpaddd (16 int16 products each, twice
// fp32 FMA's, and no conversion of K or V to fp32); fp8 keeps the fp32 path (AVX2 has no bf16 dot product)
static inline __m256i dot16_256(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

static inline __m128i sum4_epi32_avx2(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

// int8 K, as qk_int8_512
static inline __attribute__((always_inline)) void qk_int8_256(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int16_t *qi = (int16_t *)qbuf;
    float *qs = (float *)(qbuf + (size_t)G * D * 2);
    q_int16(q_row, G, D, dtype, scale, 0, qi, qs, x);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 4) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 4, n, rb);
        gather_scales(v_plane, rows, i, i + 4, n, D, KV_I8, vraw);
        const char *k[4];
        float ks[4];
        for (int j = 0; j < 4; j++) {
            k[j] = k_plane + rows[i + j < n ? i + j : n - 1];
            ks[j] = bf16_at(k[j] + D);
        }
        const __m128 key_scales = _mm_loadu_ps(ks);
        for (int g = 0; g < G; g++) {
            __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            for (int c = 0; c < D; c += 16) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(qi + (size_t)g * D + c));
                for (int j = 0; j < 4; j++)
                    acc[j] = dot16_256(acc[j], qv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k[j] + c))));
            }
            const __m128 s = _mm_cvtepi32_ps(sum4_epi32_avx2(acc[0], acc[1], acc[2], acc[3]));
            put_scores(scores, n, g, i, _mm_mul_ps(_mm_mul_ps(s, key_scales), _mm_set1_ps(qs[g])));
        }
    }
}

// q4 K, as qk_q4_512 with one group (16 bytes) a vector, the fifth bits added by compare masks (AVX2 has no masked add)
static inline __attribute__((always_inline)) void qk_q4_256(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, size_t rb, float scale, char *qbuf, float *x, float *scores, uint16_t *vraw) {
    int16_t *qi = (int16_t *)qbuf;
    float *qs = (float *)(qbuf + (size_t)G * D * 2);
    int32_t *corr = (int32_t *)(qbuf + (size_t)G * D * 2 + 4 * (size_t)G + 64 - (4 * (size_t)G) % 64);  // [G][D/32][8]
    q_int16(q_row, G, D, dtype, scale, 32, qi, qs, x);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 32; c++)
            for (int k = 0; k < 8; k++) {
                const int16_t *e = qi + (size_t)g * D + 32 * c, *o = e + 16;
                corr[((size_t)g * (D / 32) + c) * 8 + k] = -16 * (e[2 * k] + e[2 * k + 1] + o[2 * k] + o[2 * k + 1]);
            }
    const __m256i low = _mm256_set1_epi16(15), sixteen = _mm256_set1_epi16(16);
    // word w: the byte holding bits 2w and 2w + 1 of the group's fifth bits (byte w / 4; the same 4 bytes in both
    // 128-bit lanes), and those two bits' masks within it
    const __m256i byte_of_word = _mm256_setr_epi8(0, -128, 0, -128, 0, -128, 0, -128, 1, -128, 1, -128, 1, -128, 1, -128,
                                                  2, -128, 2, -128, 2, -128, 2, -128, 3, -128, 3, -128, 3, -128, 3, -128);
    const __m256i even_bit = _mm256_setr_epi16(1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64);
    const __m256i odd_bit = _mm256_setr_epi16(2, 8, 32, 128, 2, 8, 32, 128, 2, 8, 32, 128, 2, 8, 32, 128);
    prefetch_short(k_plane, v_plane, rows, 0, QUANT_PREFETCH_KEYS, n, rb);
    for (int i = 0; i < n; i += 4) {
        prefetch_short(k_plane, v_plane, rows, i + QUANT_PREFETCH_KEYS, i + QUANT_PREFETCH_KEYS + 4, n, rb);
        gather_scales(v_plane, rows, i, i + 4, n, D, KV_Q4, vraw);
        const char *k[4], *key_scales[4];
        for (int j = 0; j < 4; j++) {
            const size_t r = rows[i + j < n ? i + j : n - 1];
            k[j] = k_plane + r, key_scales[j] = q4_key_scales(v_plane + r, D);
        }
        for (int g = 0; g < G; g++) {
            __m256 f[4];
            for (int c = 0; c < D / 32; c++) {
                const int16_t *e = qi + (size_t)g * D + 32 * c;
                const __m256i qe = _mm256_loadu_si256((const __m256i *)e), qo = _mm256_loadu_si256((const __m256i *)(e + 16));
                const __m256i c0 = _mm256_loadu_si256((const __m256i *)(corr + ((size_t)g * (D / 32) + c) * 8));
                for (int j = 0; j < 4; j++) {
                    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(k[j] + 16 * c)));
                    int32_t fifth;  // the group's 32 fifth bits: word w of the nibbles' vectors gets bits 2w and 2w + 1
                    memcpy(&fifth, k[j] + D / 2 + 4 * c, 4);
                    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(fifth), byte_of_word);
                    const __m256i add_even = _mm256_and_si256(
                        _mm256_cmpeq_epi16(_mm256_and_si256(bytes, even_bit), even_bit), sixteen);
                    const __m256i add_odd = _mm256_and_si256(
                        _mm256_cmpeq_epi16(_mm256_and_si256(bytes, odd_bit), odd_bit), sixteen);
                    const __m256i a = dot16_256(dot16_256(c0, _mm256_add_epi16(_mm256_and_si256(w, low), add_even), qe),
                                                _mm256_add_epi16(_mm256_srli_epi16(w, 4), add_odd), qo);
                    const __m256 sv = _mm256_set1_ps(bf16_at(key_scales[j] + 2 * c));
                    f[j] = c == 0 ? _mm256_mul_ps(_mm256_cvtepi32_ps(a), sv) : _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), sv, f[j]);
                }
            }
            put_scores(scores, n, g, i, _mm_mul_ps(sum4_avx2(f[0], f[1], f[2], f[3]), _mm_set1_ps(qs[g])));
        }
    }
}

// the dimension lane k of vector c (of the four holding 32 dimensions of two keys) carries
static inline int pair_dim_256(int kv, int c, int k) {
    if (kv == KV_I8) return 16 * (c / 2) + 8 * (k / 4) + 4 * (c % 2) + k % 4;
    return 2 * (k + 8 * (c / 2)) + c % 2;  // q4: bytes 0-7 / 8-15, low / high nibble
}

// acc[g * D + d] = sum_i p[g][i] v_i[d], as pv_quant_512: two queries x 32 dimensions at a time (one q4 group)
static inline __attribute__((always_inline)) void pv_quant_256(
        const char *v_plane, const size_t *rows, int n, int G, const int D, const int kv, const float *scores,
        float *acc, char *wbuf, const uint16_t *vraw) {
    const int groups = kv == KV_Q4 ? D / KV_Q4_GROUP : 1;
    int16_t *wq = (int16_t *)wbuf;
    float *wsc = (float *)(wbuf + (size_t)G * KEY_BLOCK * (groups > 2 ? groups : 2) * 2);
    int32_t *wsum = (int32_t *)(wsc + G);
    float *vs = (float *)(wsum + (size_t)G * groups + 16);
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int b0 = 0; b0 < n; b0 += KEY_BLOCK) {
        const int bn = n - b0 < KEY_BLOCK ? n - b0 : KEY_BLOCK;
        block_weights(n, b0, bn, G, D, kv, scores, vraw, wq, wsc, wsum, vs);
        for (int g0 = 0; g0 < G; g0 += 2) {
            const int gn = G - g0 < 2 ? G - g0 : 2;
            for (int d0 = 0; d0 < D; d0 += 32) {
                __m256i a[2][4];
                for (int g = 0; g < 2; g++)
                    for (int c = 0; c < 4; c++)
                        a[g][c] = kv == KV_Q4 && g < gn ? _mm256_set1_epi32(-8 * wsum[(g0 + g) * groups + d0 / 32])
                                                        : _mm256_setzero_si256();
                for (int i = 0; i < bn; i += 2) {
                    const char *va = v_plane + rows[b0 + i], *vb = v_plane + rows[b0 + (i + 1 < bn ? i + 1 : i)];
                    __m256i x[4];
                    if (kv == KV_I8) {
                        for (int h = 0; h < 2; h++) {
                            const __m256i A = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(va + d0 + 16 * h)));
                            const __m256i B = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(vb + d0 + 16 * h)));
                            x[2 * h] = _mm256_unpacklo_epi16(A, B);
                            x[2 * h + 1] = _mm256_unpackhi_epi16(A, B);
                        }
                    } else {
                        const __m128i A = _mm_loadu_si128((const __m128i *)(va + d0 / 2));
                        const __m128i B = _mm_loadu_si128((const __m128i *)(vb + d0 / 2));
                        const __m256i low = _mm256_set1_epi16(15);
                        const __m256i X0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(A, B));
                        const __m256i X1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(A, B));
                        x[0] = _mm256_and_si256(X0, low);
                        x[1] = _mm256_srli_epi16(X0, 4);
                        x[2] = _mm256_and_si256(X1, low);
                        x[3] = _mm256_srli_epi16(X1, 4);
                    }
                    for (int g = 0; g < gn; g++) {
                        const int16_t *w = wq + (size_t)(g0 + g) * KEY_BLOCK * (groups > 2 ? groups : 2) +
                                           (kv == KV_Q4 ? (d0 / 32) * KEY_BLOCK : 0);
                        int32_t pair;
                        memcpy(&pair, w + i, 4);
                        const __m256i wv = _mm256_set1_epi32(pair);
                        for (int c = 0; c < 4; c++) a[g][c] = dot16_256(a[g][c], x[c], wv);
                    }
                }
                for (int g = 0; g < gn; g++)
                    for (int c = 0; c < 4; c++) {
                        float *to = acc + (size_t)(g0 + g) * D + d0 + 8 * c;
                        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(a[g][c]), _mm256_set1_ps(wsc[g0 + g]));
                        _mm256_storeu_ps(to, _mm256_add_ps(_mm256_loadu_ps(to), f));
                    }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d0 = 0; d0 < D; d0 += 32) {
            float t[32], *to = acc + (size_t)g * D + d0;
            memcpy(t, to, sizeof t);
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 8; k++) to[pair_dim_256(kv, c, k)] = t[8 * c + k];
        }
}

static int quant_path(int kv, int dtype, int D) {  // as the AVX-512 section's: int8 and q4 only
    return (D == 64 || D == 128 || D == 256) && (kv == KV_I8 || kv == KV_Q4) && dtype != F32;
}

static inline __attribute__((always_inline)) void attend_quant_impl(
        const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G, const int D,
        int dtype, const int kv, size_t rb, float scale, float softcap, char *qbuf, float *x, float *scores,
        float *acc, char *wbuf) {
    uint16_t *vraw = (uint16_t *)(wbuf + wbuf_fixed_bytes(G, D));
    if (kv == KV_I8) qk_int8_256(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
    else qk_q4_256(q_row, k_plane, v_plane, rows, n, G, D, dtype, rb, scale, qbuf, x, scores, vraw);
    soft_cap(scores, (size_t)G * n, softcap);
    softmax_rows(scores, G, n);
    pv_quant_256(v_plane, rows, n, G, D, kv, scores, acc, wbuf, vraw);
}

#define QUANT_PATH 1
#endif

#if defined(QUANT_PATH)
// one (row, KV head) item on this build's integer / bf16 paths (AVX-512 or AVX2 above): a copy per format and
// head size
static void attend_quant(const char *q_row, const char *k_plane, const char *v_plane, const size_t *rows, int n, int G,
                         int D, int dtype, int kv, size_t rb, float scale, float softcap, char *qbuf, float *x,
                         float *scores, float *acc, char *wbuf) {
#define QUANT_HEAD(KV)                                                                                              \
    do {                                                                                                            \
        if (D == 64)                                                                                                \
            attend_quant_impl(q_row, k_plane, v_plane, rows, n, G, 64, dtype, KV, rb, scale, softcap, qbuf, x,     \
                              scores, acc, wbuf);                                                                   \
        else if (D == 128)                                                                                          \
            attend_quant_impl(q_row, k_plane, v_plane, rows, n, G, 128, dtype, KV, rb, scale, softcap, qbuf, x,    \
                              scores, acc, wbuf);                                                                   \
        else                                                                                                        \
            attend_quant_impl(q_row, k_plane, v_plane, rows, n, G, 256, dtype, KV, rb, scale, softcap, qbuf, x,    \
                              scores, acc, wbuf);                                                                   \
    } while (0)
    switch (kv) {
        case KV_I8: QUANT_HEAD(KV_I8); break;
        case KV_Q4: QUANT_HEAD(KV_Q4); break;
#if defined(__AVX512BF16__)
        case KV_E4M3: QUANT_HEAD(KV_E4M3); break;
        case KV_E5M2: QUANT_HEAD(KV_E5M2); break;
#endif
        default: break;
    }
#undef QUANT_HEAD
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
// (dtype itself, or a quantized format: rows of kv_row_bytes); rotate: the cache holds K and V times the Hadamard
// matrix H (q4): q is multiplied by H^-1 on load and the output by H^-1 before it is stored, so q and out are the
// model's own (the attention layer's torch rotations took 7 us a call, four a layer).
void kvf_paged_attention(const void *q, int64_t q_stride, void *out, const void *cache, const int32_t *tables,
                         const int32_t *row_seqs, const int32_t *lens, int32_t batch, int32_t heads, int32_t kv_heads,
                         int32_t head_dim, int32_t num_blocks, int32_t block_size, int32_t width, float scale,
                         int32_t window, float softcap, int32_t dtype, int32_t kv, int32_t threads, int32_t portable,
                         int32_t rotate) {
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
        float *qf = scratch_floats((size_t)G * D + G + 32);  // (the quantized paths: q's codes and their scales)
        float *acc = scratch_floats((size_t)G * D);
        float *row = scratch_floats((size_t)D);
        float *scores = scratch_floats((size_t)G * (max_len > 0 ? max_len : 1));
        float *kf = scratch_floats(4 * (size_t)D);
        size_t *rows = malloc(sizeof(size_t) * (max_len > 0 ? max_len : 1));
        char *q_rotated = rotate ? malloc((size_t)G * D * es) : NULL;
#if defined(QUANT_PATH)
        char *wbuf = quant_path(kv, dtype, D) ? (char *)scratch_floats(
            (wbuf_fixed_bytes(G, D) + (size_t)(max_len + 16) * (D / KV_Q4_GROUP) * 2) / 4 + 16) : NULL;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < batch * kv_heads; item++) {
            const int b = item / kv_heads, h = item % kv_heads, L = lens[b];
            if (L <= 0) {  // a padding row: zeros
                memset(acc, 0, sizeof(float) * (size_t)G * D);
            } else {
                const int first = (window > 0 && L > window) ? L - window : 0, n = L - first;
                const int32_t *table = tables + (size_t)(row_seqs ? row_seqs[b] : b) * width;
                const char *q_row = (const char *)q + ((size_t)b * q_stride + (size_t)h * G * D) * es;
                if (rotate) {  // q H^-1 in q's dtype (as layers/attention.py's _rotated): the rows' keys are k H
                    for (int g = 0; g < G; g++) {
                        load_row(q_row + (size_t)g * D * es, dtype, D, kf);
                        hadamard_row(kf, D, (float)D);
                        store_row(kf, dtype, D, q_rotated + (size_t)g * D * es);
                    }
                    q_row = q_rotated;
                }
                const char *k_plane = (const char *)cache + (size_t)h * plane;
                const char *v_plane = (const char *)cache + (size_t)(kv_heads + h) * plane;
                visible_rows(table, first, L, block_size, rb, rows);
#if defined(SIMD_HEAD_DIM)
#if defined(QUANT_PATH)
                if (wbuf && !portable) {
                    attend_quant(q_row, k_plane, v_plane, rows, n, G, D, dtype, kv, rb, scale, softcap, (char *)qf, kf,
                                 scores, acc, wbuf);
                } else
#endif
                if (D % SIMD_HEAD_DIM == 0 && !portable) {  // four keys per reduction tree (the same math as attend())
                    qk_simd(q_row, k_plane, v_plane, rows, n, G, D, dtype, es, kv, rb, scale, qf, kf, scores);
                    soft_cap(scores, (size_t)G * n, softcap);
                    softmax_rows(scores, G, n);
                    pv_simd(v_plane, rows, n, G, D, kv, scores, acc);
                } else
#endif
                    run(q_row, k_plane, v_plane, rows, n, G, D, scale, softcap, dtype, es, kv, rb, qf, acc, row, scores);
                if (rotate)  // the output of values v H, times H^-1 in fp32 (no rounding between)
                    for (int g = 0; g < G; g++) hadamard_row(acc + (size_t)g * D, D, (float)D);
            }
            store_row(acc, dtype, G * D, (char *)out + ((size_t)b * heads + (size_t)h * G) * D * es);
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
        free(kf);
        free(rows);
        free(q_rotated);
#if defined(QUANT_PATH)
        free(wbuf);
#endif
    }
}
