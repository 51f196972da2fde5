// GGUF's quantized blocks read in place (plugins/quant/gguf.py serves a GGUF's projections with these): a matmul
// x @ W.T for W stored as Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks exactly as they lie in the
// file, and the rows of such a W dequantized (embedding lookups; bit for bit the `gguf` package's values).
//
// The matmul follows ggml's approach (learned from, written here): each row of x is quantized per 32 values to int8
// with one fp32 scale (round to nearest), and each 32-weight sub-block's codes meet those int8 values in integer dot
// products (AVX2: maddubs + madd, 32 multiplies per instruction pair), scaled once per sub-block in fp32. Weights
// are decoded tile by tile (TILE output rows at a time, into a per-thread buffer: codes, 8 scale lanes and one
// offset per sub-block), then every row of x is multiplied with the decoded tile, so a weight is decoded once per
// call however many rows x has. Offsets (the types' mins) meet the exact fp32 sum of x's 32 values; the centring of
// the symmetric 4/5-bit types (q - 8, q - 16) meets the sum of x's quantized values, so that the error is the one of
// their signed codes.
//
// x may instead be quantized to int16 (x_bits 16): the same method with 256 times finer steps, the codes widened to
// int16 and multiplied by madd (16 multiplies per instruction). x's values are kept in natural order, the codes of
// most types widened into it straight from memory (vpmovzxbw); for Q6_K (two scales per 32 weights) and Q5_K, whose
// codes are built byte-wide, also in the order in-lane unpacks widen bytes (0-7, 16-23, 8-15, 24-31: "slots"), so
// that each scale lane's weights sum into the same int32 lanes as in int8.
//
// On AVX-512 (BW, DQ, VL, VNNI) a decode step's int16 (or int8) dot products run two sub-blocks at a time in 512-bit
// registers (row_dot's pairs: the same integers and fp32 operations as AVX2's, the same outputs); with AVX512_BF16 many rows of a
// bf16 model's x (prefill, `invariant` 0) meet the weights rounded to bf16 in bf16 products (outer_linear_bf16).
//
// Error, per output: |y - x @ W| <= sum over x's 32-blocks b of (max|x_b| / (2 Q)) * sum_{i in b} |s_i c_i| with
// Q = 127 (int8) or 32767 (int16) (the rounding of x: at most half a step per value, times the weight's scaled signed
// code, W = s c + offset), plus fp32 rounding. tests/core/test_gguf_kernels.py checks that bound per type and width,
// SIMD and portable.
#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
// AVX-512 VNNI's integer dot products on 256-bit registers: one instruction where AVX2 takes two or three
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI256 1
#else
#define VNNI256 0
#endif
#if defined(__AVX2__)
#define AVX2_BUILT 1
#else
#define AVX2_BUILT 0
#endif
// which SIMD code a call may run (the `simd` argument of the kernels below)
enum { SIMD_WIDEST = 0, SIMD_NONE = 1, SIMD_AVX2 = 2 };
// the decode step's two-sub-blocks-at-a-time path (row_dot) on AVX-512
#if VNNI256 && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define ZMM_PAIRS 1
#else
#define ZMM_PAIRS 0
#endif
// prefill on AVX512_BF16 with a bf16 model: bf16 products of x with the weights rounded to bf16 (outer_linear_bf16)
#if ZMM_PAIRS && defined(__AVX512BF16__)
#define BF16_TILE 1
#else
#define BF16_TILE 0
#endif

// ggml's type numbers (the `gguf` package's GGMLQuantizationType)
enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14 };
enum { GG_F32 = 0, GG_F16 = 1, GG_BF16 = 30 };  // float weights, read in place by the fp32-activations path
enum { SUB = 32 };     // weights per sub-block (one x scale each)
enum { TILE = 4 };     // output rows decoded and multiplied together
enum { FEW_ROWS = 4 }; // up to this many rows of x, weights are decoded in registers as they are used (AVX2)
// the same with the AVX-512 pairs: Zen 5, 2 threads, 8192 x 2048 Q4_0 at 8 rows 2.35 -> 1.11 ms, at 16 rows 3.9 -> 2.35
// against the decoded tiles (int16 x; int8 x at 16 rows: 3.8 -> 1.48)
enum { FEW_ROWS_PAIRS = 16 };
enum { UNIT = 16 };    // output rows per scheduling unit of that path
// rows of x per pass of that path over a unit's weights (each pass decodes them again, from the cache): 2 on AVX2,
// whose 16 registers hold no more accumulators; 4 with the AVX-512 pairs (32 registers)
enum { MAX_XROWS = 4 };
// bytes ahead of the block being decoded that are asked into cache: one thread's stream of blocks reached ~half the
// machine's streaming bandwidth without it (a cold 8192 x 2048 Q4_0 GEMV, 2 threads on Zen 2: int16 12.2 -> 14.8
// GB/s, int8 11.7 -> 16.7; 512 B to 8 KiB ahead all helped, 4 KiB the most); neutral where compute bounds (16 rows)
#define PREFETCH_AHEAD 4096
// non-temporal: a decode step streams every weight once, and kept in the caches they evicted what the rest of the
// step uses (Zen 2, 1.7B Q4_0: the step's other work 17.5 -> 13.5 ms, the GEMVs a little faster too)
#define PREFETCH_HINT _MM_HINT_NTA
// multiply-adds per thread below which a call runs on one thread: a team's start and join cost more than they save
// on small matmuls (a 135M model's decode), and a busy machine delays a team until its last thread is scheduled
#define PARALLEL_MIN ((int64_t)1 << 19)

typedef struct {
    int super;       // weights per block as stored (32, or 256 for the K types)
    int bytes;       // bytes per block
    int signed_codes;// codes are int8 (-128..127); else uint8 0..63
    int centred;     // the offset is a centring (-8 d, -16 d): it meets the sum of x's quantized values
    int slots;       // int16 x in WIDE_SLOT order (Q6_K: two scales per sub-block; Q5_K: its codes are built
                     // byte-wide, and widened by in-lane unpacks faster than into natural order); else natural
} block_type;

static int block_type_of(int type, block_type *t) {
    switch (type) {
    case GG_Q4_0: *t = (block_type){32, 18, 0, 1, 0}; return 1;
    case GG_Q4_1: *t = (block_type){32, 20, 0, 0, 0}; return 1;
    case GG_Q5_0: *t = (block_type){32, 22, 0, 1, 0}; return 1;
    case GG_Q5_1: *t = (block_type){32, 24, 0, 0, 0}; return 1;
    case GG_Q8_0: *t = (block_type){32, 34, 1, 0, 0}; return 1;
    case GG_Q4_K: *t = (block_type){256, 144, 0, 0, 0}; return 1;
    case GG_Q5_K: *t = (block_type){256, 176, 0, 0, 1}; return 1;
    case GG_Q6_K: *t = (block_type){256, 210, 1, 0, 1}; return 1;
    default: return 0;
    }
}

// The weights of a call cut into groups of `per` rows that never cross a segment (a unit of work on the threads):
// how many groups, and group g's segment, first row in it, output column and row count (<= per)
static int64_t row_groups(int segments, const int64_t *outs, int per) {
    int64_t groups = 0;
    for (int s = 0; s < segments; s++) groups += (outs[s] + per - 1) / per;
    return groups;
}

static int row_group(int64_t g, int per, const int64_t *outs, int *segment, int64_t *first, int64_t *column) {
    int s = 0;
    int64_t col = 0;
    while (g >= (outs[s] + per - 1) / per) {
        g -= (outs[s] + per - 1) / per;
        col += outs[s];
        s++;
    }
    *segment = s, *first = g * per, *column = col;
    return outs[s] - *first < per ? (int)(outs[s] - *first) : per;
}

// sums of output columns [first, first + n) into one row of `out` (`dtype`): in place, or where `columns` sends each
// output column (the layer's order where the file permutes rows: Llama's Q / K; NULL: in order)
static void store_columns(const float *sums, int dtype, int64_t first, int n, const int64_t *columns, void *out) {
    const size_t es = dtype_size(dtype);
    if (!columns) {
        store_row(sums, dtype, n, (char *)out + first * es);
        return;
    }
    for (int i = 0; i < n; i++) store_row(sums + i, dtype, 1, (char *)out + columns[first + i] * es);
}


static inline void fill8(float *lanes, float lo, float hi) {  // lanes 0-3 scale weights 0-15, lanes 4-7 16-31
    for (int l = 0; l < 4; l++) { lanes[l] = lo; lanes[l + 4] = hi; }
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (12 packed bytes)
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// One block (`super` weights) -> per sub-block: 32 codes, 8 scale lanes, one offset. W = lanes * code + offset.
static inline void decode_block(int type, const uint8_t *b, uint8_t *codes, float *lanes, float *offsets) {
    switch (type) {
    case GG_Q4_0: case GG_Q4_1: {
        const int header = type == GG_Q4_0 ? 2 : 4;
        const float d = half_at(b);
        for (int j = 0; j < 16; j++) { codes[j] = b[header + j] & 15; codes[j + 16] = b[header + j] >> 4; }
        fill8(lanes, d, d);
        offsets[0] = type == GG_Q4_0 ? -8.0f * d : half_at(b + 2);
        break;
    }
    case GG_Q5_0: case GG_Q5_1: {
        const int header = type == GG_Q5_0 ? 2 : 4;
        const float d = half_at(b);
        uint32_t qh;
        memcpy(&qh, b + header, 4);
        const uint8_t *qs = b + header + 4;
        for (int j = 0; j < 16; j++) {
            codes[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            codes[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        fill8(lanes, d, d);
        offsets[0] = type == GG_Q5_0 ? -16.0f * d : half_at(b + 2);
        break;
    }
    case GG_Q8_0: {
        const float d = half_at(b);
        memcpy(codes, b + 2, 32);
        fill8(lanes, d, d);
        offsets[0] = 0.0f;
        break;
    }
    case GG_Q4_K: case GG_Q5_K: {
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == GG_Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(scales, j, &sc, &mn);
            const uint8_t *q = qs + (j / 2) * 32;
            uint8_t *c = codes + j * 32;
            const int shift = (j & 1) * 4;
            for (int i = 0; i < 32; i++) c[i] = (q[i] >> shift) & 15;
            if (type == GG_Q5_K)
                for (int i = 0; i < 32; i++) c[i] |= ((qh[i] >> j) & 1) << 4;
            fill8(lanes + j * 8, d * (float)sc, d * (float)sc);
            offsets[j] = -(dmin * (float)mn);
        }
        break;
    }
    case GG_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, g = j % 4;
            const uint8_t *low = ql + h * 64 + (g % 2) * 32, *high = qh + h * 32;
            const int low_shift = (g / 2) * 4;
            int8_t *c = (int8_t *)codes + j * 32;
            for (int i = 0; i < 32; i++)
                c[i] = (int8_t)((((low[i] >> low_shift) & 15) | (((high[i] >> (2 * g)) & 3) << 4)) - 32);
            fill8(lanes + j * 8, d * (float)sc[h * 8 + g * 2], d * (float)sc[h * 8 + g * 2 + 1]);
            offsets[j] = 0.0f;
        }
        break;
    }
    }
}

// `count` weight rows (row stride `row_bytes`) decoded: codes [count][cols], lanes [count][cols / 32 * 8],
// offsets [count][cols / 32]
static void decode_rows(int type, const block_type *t, const uint8_t *rows, int64_t row_bytes, int count, int cols,
                        uint8_t *codes, float *lanes, float *offsets, int portable);

// ---- x quantized per 32 values ----
typedef struct {
    int8_t *q;        // [rows][cols] (int8), or NULL
    int16_t *q16;     // [rows][cols] (int16, natural order), or NULL
    int16_t *q16s;    // the same values, each 32 in WIDE_SLOT order (for the types with `slots`), or NULL
    int16_t *q16p;    // q16 in the pair layout of row_dot's AVX-512 path (ZMM_PAIRS), or NULL
    int16_t *q16sp;   // q16s likewise, or NULL
    int pairs8;       // int8 x taken two sub-blocks at a time by row_dot's AVX-512 path (ZMM_PAIRS; q as it is)
    float *scale;     // [rows][cols / 32]: max|x| / 127 (int8) or / 32767 (int16)
    float *sum;       // the exact fp32 sum of the 32 values
    float *qsum;      // scale * the sum of the quantized values
} quantized_x;

// where the slot layout keeps value i of a 32-block, and the scale lane (of 8) whose int32 sum takes weight i there
// (in natural order every type has one scale per 32 weights: any lane will do)
#define WIDE_SLOT(i) (((i) & 7) | (((i) & 8) << 1) | (((i) & 16) >> 1))
#define LANE_OF(i, slots) ((slots) ? ((((i) & 16) >> 2) | (((i) & 7) >> 1)) : (i) / 4)

// one row of x quantized: into q (int8) or q16 (int16, natural order) and q16s (slot order, or NULL)
static void quantize_row(const float *x, int cols, int8_t *q, int16_t *q16, int16_t *q16s, float *scale, float *sum,
                         float *qsum) {
    const float top = q16 ? 32767.0f : 127.0f;
    for (int b = 0; b < cols / SUB; b++) {
        const float *v = x + b * SUB;
        float amax = 0.0f, s = 0.0f;
        for (int i = 0; i < SUB; i++) { const float a = fabsf(v[i]); amax = a > amax ? a : amax; s += v[i]; }
        const float d = amax / top, inverse = amax > 0.0f ? top / amax : 0.0f;
        int total = 0;
        for (int i = 0; i < SUB; i++) {
            const int code = (int)nearbyintf(v[i] * inverse);
            if (q16) {
                q16[b * SUB + i] = (int16_t)code;
                if (q16s)
                    q16s[b * SUB + WIDE_SLOT(i)] = (int16_t)code;
            } else
                q[b * SUB + i] = (int8_t)code;
            total += code;
        }
        scale[b] = d;
        sum[b] = s;
        qsum[b] = d * (float)total;
    }
}

#if ZMM_PAIRS
// x's int16 values (natural or slot order) in row_dot's AVX-512 pair layout: each two sub-blocks' 64 values as A's
// first 16, B's first 16, A's last 16, B's last 16 (a row's last sub-block without a pair, if any, as it was)
static int16_t *pair_layout(const int16_t *src, int16_t *dst, int rows, int cols) {
    for (int n = 0; n < rows; n++) {
        const int16_t *a = src + (size_t)n * cols;
        int16_t *d = dst + (size_t)n * cols;
        int s = 0;
        for (; s + 2 <= cols / SUB; s += 2) {
            const int16_t *pair = a + s * SUB;
            memcpy(d + s * SUB, pair, 32);
            memcpy(d + s * SUB + 16, pair + 32, 32);
            memcpy(d + s * SUB + 32, pair + 16, 32);
            memcpy(d + s * SUB + 48, pair + 48, 32);
        }
        memcpy(d + s * SUB, a + s * SUB, (size_t)(cols - s * SUB) * 2);
    }
    return dst;
}
#endif

// ---- the dot products of a decoded tile with rows of x ----
// out[r][o] = sum over sub-blocks s of lanes . (codes * xq) * xscale + offset * (centred ? qsum : sum)

static void dot_tile_portable(const block_type *t, int tile, int xrows, int cols, const uint8_t *codes,
                              const float *lanes, const float *offsets, const quantized_x *x, float *out) {
    const int subs = cols / SUB;
    const int wide = x->q16 != NULL;
    for (int r = 0; r < xrows; r++) {
        const int8_t *xq = wide ? NULL : x->q + (size_t)r * cols;
        const int16_t *xq16 = wide ? (t->slots ? x->q16s : x->q16) + (size_t)r * cols : NULL;
        const float *xs = x->scale + (size_t)r * subs, *xo = (t->centred ? x->qsum : x->sum) + (size_t)r * subs;
        for (int o = 0; o < tile; o++) {
            const uint8_t *c = codes + (size_t)o * cols;
            const float *l = lanes + (size_t)o * subs * 8, *off = offsets + (size_t)o * subs;
            float acc = 0.0f;
            for (int s = 0; s < subs; s++) {
                int part[8] = {0};
                for (int i = 0; i < SUB; i++) {
                    const int w = t->signed_codes ? (int)(int8_t)c[s * SUB + i] : (int)c[s * SUB + i];
                    part[LANE_OF(i, wide && t->slots)] +=
                        w * (wide ? xq16[s * SUB + (t->slots ? WIDE_SLOT(i) : i)] : xq[s * SUB + i]);
                }
                float block = 0.0f;
                for (int k = 0; k < 8; k++) block += (float)part[k] * l[s * 8 + k];
                acc += block * xs[s] + off[s] * xo[s];
            }
            out[(size_t)r * tile + o] = acc;
        }
    }
}

#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 codes (bytes) widened to int16 in the int16 layout's order (in-lane unpacks): lo holds codes 0-7 and 16-23,
// hi 8-15 and 24-31
static inline __attribute__((always_inline)) void widen_codes(const int IS_SIGNED, __m256i c, __m256i *lo,
                                                              __m256i *hi) {
    if (IS_SIGNED) {
        *lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(c, c), 8);
        *hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(c, c), 8);
    } else {
        *lo = _mm256_unpacklo_epi8(c, _mm256_setzero_si256());
        *hi = _mm256_unpackhi_epi8(c, _mm256_setzero_si256());
    }
}

// 32 codes (bytes) widened to int16 in natural order: lo codes 0-15, hi 16-31 (the layout of the types without
// `slots`: the codes of a 4-bit block widened straight from memory cost a third fewer instructions than the slot
// layout's unpacks, a Q4_0 GEMV 18.9 -> 23 GB/s on Zen 2)
static inline __attribute__((always_inline)) void widen_natural(const int IS_SIGNED, __m256i c, __m256i *lo,
                                                                __m256i *hi) {
    const __m128i low = _mm256_castsi256_si128(c), high = _mm256_extracti128_si256(c, 1);
    *lo = IS_SIGNED ? _mm256_cvtepi8_epi16(low) : _mm256_cvtepu8_epi16(low);
    *hi = IS_SIGNED ? _mm256_cvtepi8_epi16(high) : _mm256_cvtepu8_epi16(high);
}

// the 8 scale lanes' int32 sums of widened codes times x's int16 values (32 of them from xq, in lo / hi's order); no
// overflow: |x| <= 32767 and |code| <= 128, 4 products per lane. AVX-512 VNNI: the second multiply and the add in
// one instruction, the same integers
static inline __m256i wide_dot(__m256i lo, __m256i hi, const int16_t *xq) {
    const __m256i first = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
#if VNNI256
    return _mm256_dpwssd_epi32(first, hi, _mm256_loadu_si256((const __m256i *)(xq + 16)));
#else
    return _mm256_add_epi32(first, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
#endif
}

// the 8 scale lanes' int32 sums of codes times x's int8 values (u8 x s8 pairs into int16: no overflow, |w| <= 128 and
// |x| <= 127; then into int32 per 4)
static inline __m256i narrow_dot(const int IS_SIGNED, __m256i c, __m256i magnitude, const int8_t *xq) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)xq);
#if VNNI256  // u8 x s8 products summed per 4 into int32 by one instruction (the pairs' int16 sums never saturate here)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, IS_SIGNED ? _mm256_sign_epi8(v, c) : v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, IS_SIGNED ? _mm256_sign_epi8(v, c) : v),
                             _mm256_set1_epi16(1));
#endif
}

// RR rows of x against TILE decoded weight rows over the sub-blocks of one parity (s = parity, parity + 2, ..):
// acc[r][o], the 8 lanes (no offsets). Inlined with RR, IS_SIGNED and WIDE (x in int16) constant, so the TILE * RR
// accumulators stay in registers (both parities at once would not fit in AVX2's 16).
static inline __attribute__((always_inline)) void dot_pass(const int RR, const int IS_SIGNED, const int WIDE, int cols,
                                                           int parity, const uint8_t *const *c, const float *const *l,
                                                           const int8_t *const *xq, const int16_t *const *xq16,
                                                           const float *const *xs, __m256 acc[][TILE]) {
    const int subs = cols / SUB;
    for (int r = 0; r < RR; r++)
        for (int o = 0; o < TILE; o++) acc[r][o] = _mm256_setzero_ps();
    for (int s = parity; s < subs; s += 2) {
        __m256i w[TILE], magnitude[TILE];
        for (int o = 0; o < TILE; o++) {
            w[o] = _mm256_load_si256((const __m256i *)(c[o] + s * SUB));
            magnitude[o] = IS_SIGNED && !WIDE ? _mm256_abs_epi8(w[o]) : w[o];
        }
        for (int r = 0; r < RR; r++) {
            const __m256 d = _mm256_broadcast_ss(xs[r] + s);
            for (int o = 0; o < TILE; o++) {
                __m256i ints;
                if (WIDE) {  // 1: x in slot order, 2: in natural order
                    __m256i lo, hi;
                    if (WIDE == 2)
                        widen_natural(IS_SIGNED, w[o], &lo, &hi);
                    else
                        widen_codes(IS_SIGNED, w[o], &lo, &hi);
                    ints = wide_dot(lo, hi, xq16[r] + s * SUB);
                } else {
                    ints = narrow_dot(IS_SIGNED, w[o], magnitude[o], xq[r] + s * SUB);
                }
                acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_mul_ps(_mm256_load_ps(l[o] + s * 8), d),
                                            acc[r][o]);
            }
        }
    }
}

// TILE weight rows x every row of x; `tile` < TILE only for a layer's last rows (those lanes read the tile's first
// row again and are not stored). Every sum in row_dot's order (an output does not depend on the path it took):
// hsum8(even sub-blocks' lanes + odd ones') + the offsets' term (an 8-lane sum over whole groups of 8 sub-blocks,
// lane i taking sub-block i of each group, then the last sub-blocks of a row that has no whole group left).
static void dot_tile_avx2(const block_type *t, int tile, int xrows, int cols, const uint8_t *codes,
                          const float *lanes, const float *offsets, const quantized_x *x, float *out) {
    const int subs = cols / SUB;
    const uint8_t *c[TILE];
    const float *l[TILE], *off[TILE];
    for (int o = 0; o < TILE; o++) {
        c[o] = codes + (size_t)(o < tile ? o : 0) * cols;
        l[o] = lanes + (size_t)(o < tile ? o : 0) * subs * 8;
        off[o] = offsets + (size_t)(o < tile ? o : 0) * subs;
    }
    const int wide = x->q16 == NULL ? 0 : t->slots ? 1 : 2;  // dot_pass's WIDE
    const int16_t *x16 = t->slots ? x->q16s : x->q16;
    for (int r0 = 0; r0 < xrows; r0 += 2) {
        const int nr = xrows - r0 < 2 ? 1 : 2;
        const int8_t *xq[2] = {wide ? NULL : x->q + (size_t)r0 * cols,
                               wide ? NULL : x->q + (size_t)(r0 + nr - 1) * cols};
        const int16_t *xq16[2] = {wide ? x16 + (size_t)r0 * cols : NULL,
                                  wide ? x16 + (size_t)(r0 + nr - 1) * cols : NULL};
        const float *xs[2] = {x->scale + (size_t)r0 * subs, x->scale + (size_t)(r0 + nr - 1) * subs};
        __m256 even[2][TILE], odd[2][TILE];
#define DOT_PASS(SIGNED, WIDE, PARITY, ACC) \
        if (nr == 2) dot_pass(2, SIGNED, WIDE, cols, PARITY, c, l, xq, xq16, xs, ACC); \
        else dot_pass(1, SIGNED, WIDE, cols, PARITY, c, l, xq, xq16, xs, ACC);
        for (int parity = 0; parity < 2; parity++) {
            __m256 (*acc)[TILE] = parity ? odd : even;
            if (t->signed_codes) {
                if (wide == 1) { DOT_PASS(1, 1, parity, acc) }
                else if (wide == 2) { DOT_PASS(1, 2, parity, acc) }
                else { DOT_PASS(1, 0, parity, acc) }
            } else {
                if (wide == 1) { DOT_PASS(0, 1, parity, acc) }
                else if (wide == 2) { DOT_PASS(0, 2, parity, acc) }
                else { DOT_PASS(0, 0, parity, acc) }
            }
        }
#undef DOT_PASS
        // the offsets' term
        const float *xo[2] = {(t->centred ? x->qsum : x->sum) + (size_t)r0 * subs,
                              (t->centred ? x->qsum : x->sum) + (size_t)(r0 + nr - 1) * subs};
        float shift[2][TILE];
        for (int r = 0; r < 2; r++)
            for (int o = 0; o < TILE; o++) {
                __m256 v = _mm256_setzero_ps();
                int s = 0;
                for (; s + 8 <= subs; s += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(off[o] + s), _mm256_loadu_ps(xo[r] + s), v);
                shift[r][o] = hsum8(v);
                for (; s < subs; s++) shift[r][o] = fmaf(off[o][s], xo[r][s], shift[r][o]);
            }
        for (int r = 0; r < nr; r++)
            for (int o = 0; o < tile; o++)
                out[(size_t)(r0 + r) * tile + o] = hsum8(_mm256_add_ps(even[r][o], odd[r][o])) + shift[r][o];
    }
}

// 32 bytes whose bit i (of the little-endian 32-bit word at p) is set -> 0x10, else 0 (the fifth bit of Q5 codes)
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

// 16 bytes of nibbles -> 32 codes: low nibbles first, then the high ones
static inline __m256i nibbles32(const uint8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

// sub-block j of block b in registers: its 32 codes, 8 scale lanes and offset (decode_block's values; the tests
// compare the SIMD and portable paths)
static inline __attribute__((always_inline)) void sub_block(const int type, const uint8_t *b, int j, __m256i *codes,
                                                            __m256 *lanes, float *offset) {
    const __m256i low4 = _mm256_set1_epi8(15);
    switch (type) {
    case GG_Q4_0: case GG_Q4_1: {
        const float d = half_at(b);
        *codes = nibbles32(b + (type == GG_Q4_0 ? 2 : 4));
        *lanes = _mm256_set1_ps(d);
        *offset = type == GG_Q4_0 ? -8.0f * d : half_at(b + 2);
        break;
    }
    case GG_Q5_0: case GG_Q5_1: {
        const int header = type == GG_Q5_0 ? 2 : 4;
        const float d = half_at(b);
        *codes = _mm256_or_si256(nibbles32(b + header + 4), fifth_bits(b + header));
        *lanes = _mm256_set1_ps(d);
        *offset = type == GG_Q5_0 ? -16.0f * d : half_at(b + 2);
        break;
    }
    case GG_Q8_0:
        *codes = _mm256_loadu_si256((const __m256i *)(b + 2));
        *lanes = _mm256_set1_ps(half_at(b));
        *offset = 0.0f;
        break;
    case GG_Q4_K: case GG_Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == GG_Q4_K ? 16 : 48) + (j / 2) * 32));
        __m256i v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
        if (type == GG_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
        }
        *codes = v;
        *lanes = _mm256_set1_ps(half_at(b) * (float)sc);
        *offset = -(half_at(b + 2) * (float)mn);
        break;
    }
    case GG_Q6_K: {
        const int h = j / 4, g = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (g & 1) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        const __m256i low = _mm256_and_si256(g >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3)), 4);
        *codes = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        *lanes = _mm256_set_m128(_mm_set1_ps(d * (float)sc[h * 8 + g * 2 + 1]), _mm_set1_ps(d * (float)sc[h * 8 + g * 2]));
        *offset = 0.0f;
        break;
    }
    }
}

// a sub-block's codes (32 bytes, signed or not) against `xrows` rows of x from row r0: its 8 scale lanes' int32 sums
// (WIDE: 0 x in int8, 1 in int16 slot order, 2 in int16 natural order; width_of picks it for a type)
static inline __attribute__((always_inline)) void code_dots(const int IS_SIGNED, const int WIDE, const int xrows,
                                                            __m256i c, const quantized_x *x, int r0, int cols, int s,
                                                            __m256i *ints) {
    __m256i magnitude = c, lo = c, hi = c;
    if (WIDE == 1)
        widen_codes(IS_SIGNED, c, &lo, &hi);
    else if (WIDE == 2)
        widen_natural(IS_SIGNED, c, &lo, &hi);
    else if (IS_SIGNED)
        magnitude = _mm256_abs_epi8(c);
    for (int r = 0; r < xrows; r++)
        ints[r] = WIDE ? wide_dot(lo, hi, (WIDE == 1 ? x->q16s : x->q16) + (size_t)(r0 + r) * cols + s * SUB)
                       : narrow_dot(IS_SIGNED, c, magnitude, x->q + (size_t)(r0 + r) * cols + s * SUB);
}
// code_dots' WIDE for a type: x's layout is the block type's (`slots`) in int16
static inline __attribute__((always_inline)) int width_of(const int type, const int WIDE) {
    block_type t;
    block_type_of(type, &t);
    return WIDE ? (t.slots ? 1 : 2) : 0;
}

// codes already widened in natural order (lo: 0-15, hi: 16-31) against `xrows` rows of x in int16
static inline __attribute__((always_inline)) void natural_dots(const int xrows, __m256i lo, __m256i hi,
                                                               const quantized_x *x, int r0, int cols, int s,
                                                               __m256i *ints) {
    for (int r = 0; r < xrows; r++) ints[r] = wide_dot(lo, hi, x->q16 + (size_t)(r0 + r) * cols + s * SUB);
}

// 16 bits (of a Q5 block's fifth bits) as 16 int16 lanes: 16 where the lane's bit is set, else 0
static inline __m256i fifth16(uint32_t bits) {
    const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                             (short)16384, (short)32768);
    const __m256i spread = _mm256_and_si256(_mm256_set1_epi16((short)bits), select);
    return _mm256_and_si256(_mm256_cmpeq_epi16(spread, select), _mm256_set1_epi16(16));
}

// sub-block s (the one block of a 32-weight type at b) against `xrows` rows of x: into acc[r], shift[r]
static inline __attribute__((always_inline)) void small_block_dot(const int type, const int xrows, const int WIDE,
                                                                  const uint8_t *b, int s, int cols,
                                                                  const quantized_x *x, int r0, __m256 *acc,
                                                                  float *shift) {
    block_type t;
    block_type_of(type, &t);
    const int subs = cols / SUB;
    const float *sums = t.centred ? x->qsum : x->sum;
    __m256i c, ints[MAX_XROWS];
    __m256 lanes;
    float offset;
    sub_block(type, b, 0, &c, &lanes, &offset);
    code_dots(t.signed_codes, width_of(type, WIDE), xrows, c, x, r0, cols, s, ints);
    for (int r = 0; r < xrows; r++) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[r]),
                                 _mm256_mul_ps(lanes, _mm256_set1_ps(x->scale[(size_t)(r0 + r) * subs + s])), acc[r]);
        shift[r] = fmaf(offset, sums[(size_t)(r0 + r) * subs + s], shift[r]);
    }
}

// 8 consecutive blocks of a 32-weight type (sub-blocks s0 .. s0 + 7) against `xrows` rows of x: their fp16 scales
// (and Q4_1 / Q5_1 mins) gathered into one vector, each times x's scale into a table, the offsets' term one 8-lane
// FMA (per block, the scalar work took a third of a Q4_0 GEMV's time).
static inline int u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
#define GATHER_HALF(v, at, i) v = _mm_insert_epi16(v, u16_at(at + (i) * t.bytes), i)
// the group's scale table (table[r][i]: block i's scale times x's scale) and offsets' term (into minsum)
static inline __attribute__((always_inline)) void small_group_table(const int type, const int xrows, const uint8_t *b,
                                                                    int s0, int cols, const quantized_x *x, int r0,
                                                                    float table[][8], __m256 *minsum) {
    block_type t;
    block_type_of(type, &t);
    const int subs = cols / SUB, with_mins = type == GG_Q4_1 || type == GG_Q5_1;
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#if defined(__AVX512VBMI__)
    // the 8 blocks lie in 144 bytes: their scales' 16 bytes picked by one two-register permute instead of 8 inserts
    // (the experts' gate / up above: 27.0 -> 28.3 GB/s)
    if (type == GG_Q4_0) {
        static const uint8_t picks[64] __attribute__((aligned(64))) = {
            0, 1, 18, 19, 36, 37, 54, 55, 72, 73, 90, 91, 108, 109, 126, 127};
        dh = _mm512_castsi512_si128(_mm512_permutex2var_epi8(_mm512_loadu_si512(b), _mm512_load_si512(picks),
                                                             _mm512_loadu_si512(b + 64)));
    } else
#endif
    {
        GATHER_HALF(dh, b, 0); GATHER_HALF(dh, b, 1); GATHER_HALF(dh, b, 2); GATHER_HALF(dh, b, 3);
        GATHER_HALF(dh, b, 4); GATHER_HALF(dh, b, 5); GATHER_HALF(dh, b, 6); GATHER_HALF(dh, b, 7);
    }
    if (with_mins) {
        GATHER_HALF(mh, b + 2, 0); GATHER_HALF(mh, b + 2, 1); GATHER_HALF(mh, b + 2, 2); GATHER_HALF(mh, b + 2, 3);
        GATHER_HALF(mh, b + 2, 4); GATHER_HALF(mh, b + 2, 5); GATHER_HALF(mh, b + 2, 6); GATHER_HALF(mh, b + 2, 7);
    }
    const __m256 d = _mm256_cvtph_ps(dh);
    const __m256 offset = with_mins ? _mm256_cvtph_ps(mh) : _mm256_mul_ps(d, _mm256_set1_ps(type == GG_Q4_0 ? -8.0f : -16.0f));
    const float *sums = t.centred ? x->qsum : x->sum;
    for (int r = 0; r < xrows; r++) {
        const size_t at = (size_t)(r0 + r) * subs + s0;
        _mm256_store_ps(table[r], _mm256_mul_ps(d, _mm256_loadu_ps(x->scale + at)));
        if (type != GG_Q8_0)
            minsum[r] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(sums + at), minsum[r]);
    }
}

// the 32 codes of one block of a 32-weight type widened straight from memory to int16, in natural order (lo: codes
// 0-15, hi: 16-31)
static inline __attribute__((always_inline)) void small_codes16(const int type, const uint8_t *block, __m256i *lo,
                                                                __m256i *hi) {
    if (type == GG_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        return;
    }
    const int header = type == GG_Q4_0 || type == GG_Q5_0 ? 2 : 4, q5 = type == GG_Q5_0 || type == GG_Q5_1;
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + header + 4 * q5)));
    *lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
    *hi = _mm256_srli_epi16(bytes, 4);
    if (q5) {
        uint32_t bits;
        memcpy(&bits, block + header, 4);
        *lo = _mm256_or_si256(*lo, fifth16(bits & 0xffff));
        *hi = _mm256_or_si256(*hi, fifth16(bits >> 16));
    }
}

// the 32 codes of one block of a 32-weight type as bytes, in natural order (signed for Q8_0)
static inline __attribute__((always_inline)) __m256i small_codes8(const int type, const uint8_t *block) {
    const int header = type == GG_Q4_0 || type == GG_Q5_0 || type == GG_Q8_0 ? 2 : 4;
    if (type == GG_Q8_0)
        return _mm256_loadu_si256((const __m256i *)(block + 2));
    if (type == GG_Q4_0 || type == GG_Q4_1)
        return nibbles32(block + header);
    return _mm256_or_si256(nibbles32(block + header + 4), fifth_bits(block + header));
}

static inline __attribute__((always_inline)) void small_group_dot(const int type, const int xrows, const int WIDE,
                                                                  const uint8_t *b, int s0, int cols,
                                                                  const quantized_x *x, int r0, __m256 *even,
                                                                  __m256 *odd, __m256 *minsum) {
    block_type t;
    block_type_of(type, &t);
    float table[MAX_XROWS][8] __attribute__((aligned(32)));
    small_group_table(type, xrows, b, s0, cols, x, r0, table, minsum);
    for (int i = 0; i < 8; i++) {
        const uint8_t *block = b + i * t.bytes;
        __m256i ints[MAX_XROWS];
        if (WIDE) {  // the codes widened straight from memory, in natural order
            __m256i lo, hi;
            small_codes16(type, block, &lo, &hi);
            natural_dots(xrows, lo, hi, x, r0, cols, s0 + i, ints);
        } else {
            code_dots(t.signed_codes, 0, xrows, small_codes8(type, block), x, r0, cols, s0 + i, ints);
        }
        for (int r = 0; r < xrows; r++) {
            __m256 *acc = i & 1 ? odd : even;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[r]), _mm256_broadcast_ss(table[r] + i), acc[r]);
        }
    }
}
#undef GATHER_HALF

// bits j of 32 bytes (Q5_K's fifth bits of sub-block j) moved to bit 4 (j constant: one shift; 16-bit shifts carry
// no bit into the 0x10 place of a neighbouring byte)
static inline __attribute__((always_inline)) __m256i fifth_of(__m256i qh, int j) {
    const __m256i moved = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// sub-blocks 2 i and 2 i + 1 of a Q4_K / Q5_K block (the low and high nibbles of 32 bytes): their codes as bytes
// (Q5_K's with their fifth bit)
static inline __attribute__((always_inline)) void k_codes(const int type, const uint8_t *b, int i, __m256i c[2]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == GG_Q4_K ? 16 : 48) + i * 32));
    c[0] = _mm256_and_si256(q, _mm256_set1_epi8(15));
    c[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(15));
    if (type == GG_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        c[0] = _mm256_or_si256(c[0], fifth_of(qh, 2 * i));
        c[1] = _mm256_or_si256(c[1], fifth_of(qh, 2 * i + 1));
    }
}

// sub-blocks 2 i and 2 i + 1 of a Q4_K block widened straight from memory to int16, in natural order (lo[k]: codes
// 0-15 of sub-block 2 i + k, hi[k]: 16-31)
static inline __attribute__((always_inline)) void q4k_codes16(const uint8_t *b, int i, __m256i lo[2], __m256i hi[2]) {
    const uint8_t *qs = b + 16 + i * 32;
    const __m256i first = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i last = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    lo[0] = _mm256_and_si256(first, _mm256_set1_epi16(15));
    hi[0] = _mm256_and_si256(last, _mm256_set1_epi16(15));
    lo[1] = _mm256_srli_epi16(first, 4);
    hi[1] = _mm256_srli_epi16(last, 4);
}

// One super-block (256 weights: 8 sub-blocks) of a K type against `xrows` rows of x, the ggml way round: its packed
// sub-block scales and mins unpacked for all 8 sub-blocks at once with vector ops (scalar unpacking per sub-block
// took as long as the dot products), each scale times x's scale of that sub-block into a table, the mins' term as
// one 8-lane FMA (lane j: sub-block j) into minsum. Even / odd sub-blocks sum into separate accumulators.
// a K super-block's scale table (table[r][j]: sub-block j's scale times x's; Q6_K: [r][2 j + half], one per 16
// weights) and its mins' term (into minsum)
static inline __attribute__((always_inline)) void k_block_table(const int type, const int xrows, const uint8_t *b,
                                                                int s0, int cols, const quantized_x *x, int r0,
                                                                float table[][16], __m256 *minsum,
                                                                __m512 *q6_table) {
    const int subs = cols / SUB;
    if (type == GG_Q6_K) {
        const __m128i packed = _mm_loadu_si128((const __m128i *)(b + 192));  // 16 int8 scales, one per 16 weights
        const __m256 d = _mm256_set1_ps(half_at(b + 208));
        const __m256 first = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed)));
        const __m256 second = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(packed, 8))));
        for (int r = 0; r < xrows; r++) {
            const __m256 xs = _mm256_loadu_ps(x->scale + (size_t)(r0 + r) * subs + s0);
            const __m256 low = _mm256_mul_ps(first, _mm256_permutevar8x32_ps(xs, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
            const __m256 high = _mm256_mul_ps(second, _mm256_permutevar8x32_ps(xs, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
#if ZMM_PAIRS
            if (q6_table) {  // in a register: a 512-bit load of two 256-bit stores would wait for them (no forwarding)
                q6_table[r] = _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
                continue;
            }
#endif
            _mm256_store_ps(table[r], low);
            _mm256_store_ps(table[r] + 8, high);
        }
        return;
    }
    // Q4_K / Q5_K: 12 bytes hold 8 6-bit scales and 8 6-bit mins (k_scale_min's layout), regrouped as ggml does
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    const __m128i scales_mins = _mm_setr_epi32((int)(u[0] & six), (int)((u[2] & four) | (((u[0] >> 6) & two) << 4)),
                                               (int)(u[1] & six), (int)(((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4)));
    const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales_mins)));
    const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8))));
    for (int r = 0; r < xrows; r++) {
        const size_t at = (size_t)(r0 + r) * subs + s0;
        _mm256_store_ps(table[r], _mm256_mul_ps(scales, _mm256_loadu_ps(x->scale + at)));
        minsum[r] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(x->sum + at), minsum[r]);
    }
}

// sub-block g of half h of a Q6_K block: its 32 codes as signed bytes
static inline __attribute__((always_inline)) __m256i q6k_codes(const uint8_t *b, int h, int g) {
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (g & 1) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
    const __m256i low = _mm256_and_si256(g >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(g == 2 ? qh : g < 2 ? _mm256_slli_epi16(qh, 4 - 2 * g) : _mm256_srli_epi16(qh, 2),
                                          _mm256_set1_epi8(0x30));
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

// One super-block (256 weights: 8 sub-blocks) of a K type against `xrows` rows of x, the ggml way round: its packed
// sub-block scales and mins unpacked for all 8 sub-blocks at once with vector ops (scalar unpacking per sub-block
// took as long as the dot products), each scale times x's scale of that sub-block into a table, the mins' term as
// one 8-lane FMA (lane j: sub-block j) into minsum. Even / odd sub-blocks sum into separate accumulators.
static inline __attribute__((always_inline)) void k_block_dot(const int type, const int xrows, const int WIDE,
                                                              const uint8_t *b, int blk, int cols,
                                                              const quantized_x *x, int r0, __m256 *even,
                                                              __m256 *odd, __m256 *minsum) {
    const int s0 = blk * 8;
    float table[MAX_XROWS][16] __attribute__((aligned(32)));  // per row of x: each scale lane's scale times x's scale
    k_block_table(type, xrows, b, s0, cols, x, r0, table, minsum, NULL);
    if (type == GG_Q6_K) {
        for (int j = 0; j < 8; j++) {
            __m256i ints[MAX_XROWS];
            code_dots(1, width_of(GG_Q6_K, WIDE), xrows, q6k_codes(b, j / 4, j % 4), x, r0, cols, s0 + j, ints);
            for (int r = 0; r < xrows; r++) {
                const __m256 lanes = _mm256_set_m128(_mm_broadcast_ss(table[r] + 2 * j + 1),
                                                     _mm_broadcast_ss(table[r] + 2 * j));
                __m256 *acc = j & 1 ? odd : even;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[r]), lanes, acc[r]);
            }
        }
        return;
    }
    for (int i = 0; i < 4; i++) {  // sub-blocks j = 2 i + half
        __m256i c[2], lo[2], hi[2];
        if (WIDE && type == GG_Q4_K)  // the codes widened straight from memory, in natural order
            q4k_codes16(b, i, lo, hi);
        else
            k_codes(type, b, i, c);
        for (int half = 0; half < 2; half++) {
            const int j = 2 * i + half;
            __m256i ints[MAX_XROWS];
            if (WIDE && type == GG_Q4_K)
                natural_dots(xrows, lo[half], hi[half], x, r0, cols, s0 + j, ints);
            else
                code_dots(0, width_of(type, WIDE), xrows, c[half], x, r0, cols, s0 + j, ints);
            for (int r = 0; r < xrows; r++) {
                __m256 *acc = half ? odd : even;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[r]), _mm256_broadcast_ss(table[r] + j), acc[r]);
            }
        }
    }
}

#if ZMM_PAIRS
// The decode step's path on AVX-512 (BW, DQ, VL, VNNI): two sub-blocks at a time in 512-bit registers. Each one's codes
// are widened as on AVX2 (lo / hi in the layout x has for its type), the pair's put side by side (A's lo beside B's lo,
// A's hi beside B's hi), and meet x in the pair layout (each 64 values: A's first 16, B's first 16, A's last 16, B's
// last 16): lanes 0-7 of the sums are A's 8 scale lanes of the AVX2 path, lanes 8-15 B's, the same integers; the fp32
// work is the same operations in the same order, the accumulator's low half the even sub-blocks' one and its high half
// the odd ones'. Outputs are bit for bit the AVX2 path's, for half the dot-product, conversion and FMA instructions.
// Zen 5, 2 threads, a cold 8192 x 2048 GEMV against a streaming read of ~52 GB/s: Q4_0 39 -> 48 GB/s, Q4_K 39 -> 45,
// Q5_K 38 -> 43, Q6_K 36 -> 48 (AVX-512 VNNI on AVX2's 256-bit registers alone: within 3%).
static inline __m512i side_by_side(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

// sub-blocks s and s + 1 (s even), their widened codes side by side in lo / hi, against `xrows` rows of x in the pair
// layout (xp: row r0's values); their scale lanes are table[r] permuted by `lanes` (16 indices)
static inline __attribute__((always_inline)) void pair_fma(const int xrows, __m512i lo, __m512i hi, const int16_t *xp,
                                                           int cols, int s, __m512i lanes, const __m512 *table,
                                                           __m512 *acc) {
    for (int r = 0; r < xrows; r++) {
        const int16_t *v = xp + (size_t)r * cols + s * SUB;
        const __m512i ints = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(v)), hi,
                                                 _mm512_loadu_si512(v + 32));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_permutexvar_ps(lanes, table[r]), acc[r]);
    }
}

// the same with x in int8 (narrow_dot's integers): the pair's codes as bytes side by side (A's 32, B's 32) against x's
// 64 values in natural order; signed codes meet their magnitudes with x negated where the code is negative. Zen 5,
// 8192 x 2048 at 16 rows against the int16 pairs: Q4_0 1.64 -> 1.48 ms, Q4_K 1.65 -> 1.32, Q6_K level (the fp32
// conversion, scale lanes and FMA per pair and row bound both, not the integer products)
static inline __attribute__((always_inline)) void pair_fma8(const int IS_SIGNED, const int xrows, __m512i c,
                                                            const int8_t *xq, int cols, int s, __m512i lanes,
                                                            const __m512 *table, __m512 *acc) {
    const __m512i magnitude = IS_SIGNED ? _mm512_abs_epi8(c) : c;
    const __mmask64 negative = IS_SIGNED ? _mm512_movepi8_mask(c) : 0;
    for (int r = 0; r < xrows; r++) {
        __m512i v = _mm512_loadu_si512(xq + (size_t)r * cols + s * SUB);
        if (IS_SIGNED)
            v = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
        const __m512i ints = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, v);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_permutexvar_ps(lanes, table[r]), acc[r]);
    }
}

// the scale-lane indices of sub-blocks s, s + 1 in a table of one scale per sub-block (j: s within the group)
static inline __m512i pair_lanes(int j) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(j)), _mm256_set1_epi32(j + 1), 1);
}

// Q6_K's scale-lane indices of sub-blocks j, j + 1 (two scales each: lanes 0-3 of sub-block j take 2 j, lanes 4-7 2 j + 1)
static inline __m512i q6k_pair_lanes(int j) {
    return _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 2, 2 * j + 2,
                             2 * j + 2, 2 * j + 2, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3);
}

// small_codes16 of blocks a and b side by side (side_by_side's lo / hi) for the types without fifth bits, each pair's
// bytes widened by one 512-bit instruction instead of two 256-bit ones and an insert (a decode step's Q4_0 GEMV is
// bound by instructions per weight on a 2-core Zen 5 at 2.6 GHz: a cold Q4_0 8192 x 2048 GEMV, int16 x, 26.1 -> 28.4
// GB/s; OLMoE-1B-7B's 8 routed experts' gate / up 24.5 -> 27.0 GB/s)
static inline __attribute__((always_inline)) void pair_codes16(const int type, const uint8_t *a, const uint8_t *b,
                                                               __m512i *lo, __m512i *hi) {
#define TWO_HALVES(p, q) _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p))), \
                                                 _mm_loadu_si128((const __m128i *)(q)), 1)
    if (type == GG_Q8_0) {
        *lo = _mm512_cvtepi8_epi16(TWO_HALVES(a + 2, b + 2));
        *hi = _mm512_cvtepi8_epi16(TWO_HALVES(a + 18, b + 18));
        return;
    }
    const int header = type == GG_Q4_0 ? 2 : 4;
    const __m512i bytes = _mm512_cvtepu8_epi16(TWO_HALVES(a + header, b + header));
#undef TWO_HALVES
    *lo = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
    *hi = _mm512_srli_epi16(bytes, 4);
}

// small_group_dot's pair version: 8 blocks of a 32-weight type from sub-block s0
static inline __attribute__((always_inline)) void small_group_pairs(const int type, const int xrows, const int WIDE,
                                                                    const uint8_t *b, int s0, int cols,
                                                                    const quantized_x *x, int r0, __m512 *acc,
                                                                    __m256 *minsum) {
    block_type t;
    block_type_of(type, &t);
    float table[MAX_XROWS][8] __attribute__((aligned(32)));
    small_group_table(type, xrows, b, s0, cols, x, r0, table, minsum);
    __m512 tables[MAX_XROWS];
    for (int r = 0; r < xrows; r++) tables[r] = _mm512_zextps256_ps512(_mm256_load_ps(table[r]));
    if (!WIDE) {
        for (int i = 0; i < 8; i += 2)
            pair_fma8(t.signed_codes, xrows, side_by_side(small_codes8(type, b + i * t.bytes),
                                                          small_codes8(type, b + (i + 1) * t.bytes)),
                      x->q + (size_t)r0 * cols, cols, s0 + i, pair_lanes(i), tables, acc);
        return;
    }
    const int16_t *xp = x->q16p + (size_t)r0 * cols;
    for (int i = 0; i < 8; i += 2) {
        const uint8_t *a = b + i * t.bytes, *c = a + t.bytes;
        if (type == GG_Q4_0 || type == GG_Q4_1 || type == GG_Q8_0) {
            __m512i lo, hi;
            pair_codes16(type, a, c, &lo, &hi);
            pair_fma(xrows, lo, hi, xp, cols, s0 + i, pair_lanes(i), tables, acc);
            continue;
        }
        __m256i loA, hiA, loB, hiB;
        small_codes16(type, a, &loA, &hiA);
        small_codes16(type, c, &loB, &hiB);
        pair_fma(xrows, side_by_side(loA, loB), side_by_side(hiA, hiB), xp, cols, s0 + i, pair_lanes(i), tables, acc);
    }
}

// k_block_dot's pair version
static inline __attribute__((always_inline)) void k_block_pairs(const int type, const int xrows, const int WIDE,
                                                                const uint8_t *b, int blk, int cols,
                                                                const quantized_x *x, int r0, __m512 *acc,
                                                                __m256 *minsum) {
    const int s0 = blk * 8;
    float table[MAX_XROWS][16] __attribute__((aligned(32)));
    __m512 tables[MAX_XROWS];
    k_block_table(type, xrows, b, s0, cols, x, r0, table, minsum, tables);
    if (!WIDE) {  // int8 x in natural order: the codes as bytes, a pair side by side
        const int8_t *xq = x->q + (size_t)r0 * cols;
        if (type == GG_Q6_K) {
            for (int j = 0; j < 8; j += 2)
                pair_fma8(1, xrows, side_by_side(q6k_codes(b, j / 4, j % 4), q6k_codes(b, j / 4, j % 4 + 1)), xq,
                          cols, s0 + j, q6k_pair_lanes(j), tables, acc);
            return;
        }
        for (int r = 0; r < xrows; r++) tables[r] = _mm512_zextps256_ps512(_mm256_load_ps(table[r]));
        for (int i = 0; i < 4; i++) {
            __m256i c[2];
            k_codes(type, b, i, c);
            pair_fma8(0, xrows, side_by_side(c[0], c[1]), xq, cols, s0 + 2 * i, pair_lanes(2 * i), tables, acc);
        }
        return;
    }
    if (type == GG_Q6_K) {  // two scales per sub-block: lanes 0-3 of sub-block j take table[2 j], lanes 4-7 [2 j + 1]
        const int16_t *xp = x->q16sp + (size_t)r0 * cols;
        for (int h = 0; h < 2; h++) {  // sub-blocks 4 h + g: low bits from ql (g odd: its second 32 bytes; g >= 2:
            // the high nibbles), bits 4-5 from qh's bit pair g, both pairs (g = 0, 1 and 2, 3) built 64 bytes wide
            // (q6k_codes per sub-block and widen_codes, as k_block_dot: 53 -> 47 GB/s on Zen 5, 2 rows 46 -> 37)
            const __m512i ql = _mm512_loadu_si512(b + h * 64);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + h * 32)));
            for (int pair = 0; pair < 2; pair++) {
                const int j = 4 * h + 2 * pair;
                const __m512i low = _mm512_and_si512(pair ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(15));
                const __m512i moved = pair ? _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_setzero_si512(),
                                                                                      _mm256_set1_epi16(2), 1))
                                           : _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4),
                                                                                      _mm256_set1_epi16(2), 1));
                const __m512i c = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_and_si512(moved, _mm512_set1_epi8(0x30))),
                                                  _mm512_set1_epi8(32));
                // in-lane unpacks: A's slot-order lo / hi (widen_codes') beside B's
                const __m512i lo = _mm512_srai_epi16(_mm512_unpacklo_epi8(c, c), 8);
                const __m512i hi = _mm512_srai_epi16(_mm512_unpackhi_epi8(c, c), 8);
                pair_fma(xrows, lo, hi, xp, cols, s0 + j, q6k_pair_lanes(j), tables, acc);
            }
        }
        return;
    }
    for (int r = 0; r < xrows; r++) tables[r] = _mm512_zextps256_ps512(_mm256_load_ps(table[r]));
    for (int i = 0; i < 4; i++) {  // sub-blocks 2 i and 2 i + 1 side by side
        __m256i lo[2], hi[2];
        if (type == GG_Q4_K) {  // natural order, widened straight from memory
            q4k_codes16(b, i, lo, hi);
        } else {  // Q5_K: bytes with their fifth bit, in slot order
            __m256i c[2];
            k_codes(type, b, i, c);
            widen_codes(0, c[0], &lo[0], &hi[0]);
            widen_codes(0, c[1], &lo[1], &hi[1]);
        }
        pair_fma(xrows, side_by_side(lo[0], lo[1]), side_by_side(hi[0], hi[1]),
                 (type == GG_Q4_K ? x->q16p : x->q16sp) + (size_t)r0 * cols, cols, s0 + 2 * i, pair_lanes(2 * i),
                 tables, acc);
    }
}
#endif

// out[r] = W row . x row r for `xrows` (1 or 2) rows of x, the weight row decoded once (WIDE: x in int16). Even and
// odd sub-blocks sum into separate accumulators, then hsum8(even + odd) + the offsets' term (dot_tile_avx2 sums in
// the same order: a row's result does not depend on the path). (Four weight rows side by side, independent
// accumulators, measured 1.8x slower at one row of x on Zen 2.)
static inline __attribute__((always_inline)) void row_dot(const int type, const int xrows, const int WIDE,
                                                          const uint8_t *row, int cols, const quantized_x *x, int r0,
                                                          float *out) {
    block_type t;
    block_type_of(type, &t);
    const int blocks = cols / t.super;
    __m256 even[MAX_XROWS], odd[MAX_XROWS], minsum[MAX_XROWS];
    for (int r = 0; r < MAX_XROWS; r++) even[r] = odd[r] = minsum[r] = _mm256_setzero_ps();
    int blk = 0;
#if ZMM_PAIRS
    if (WIDE ? x->q16p != NULL : x->pairs8) {  // two sub-blocks at a time; the accumulators' halves: `even`, `odd`
        __m512 acc[MAX_XROWS];
        for (int r = 0; r < MAX_XROWS; r++) acc[r] = _mm512_setzero_ps();
        if (t.super == SUB) {
            for (; blk + 8 <= blocks; blk += 8) {
                const uint8_t *b = row + (size_t)blk * t.bytes;
                for (int line = 0; line < 8 * t.bytes; line += 64)
                    _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, PREFETCH_HINT);
                small_group_pairs(type, xrows, WIDE, b, blk, cols, x, r0, acc, minsum);
            }
        } else {
            for (; blk < blocks; blk++) {
                const uint8_t *b = row + (size_t)blk * t.bytes;
                for (int line = 0; line < t.bytes; line += 64)
                    _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, PREFETCH_HINT);
                k_block_pairs(type, xrows, WIDE, b, blk, cols, x, r0, acc, minsum);
            }
        }
        for (int r = 0; r < xrows; r++) {
            even[r] = _mm512_castps512_ps256(acc[r]);
            odd[r] = _mm512_extractf32x8_ps(acc[r], 1);
        }
    } else
#endif
    if (t.super == SUB) {
        for (; blk + 8 <= blocks; blk += 8) {
            const uint8_t *b = row + (size_t)blk * t.bytes;
            for (int line = 0; line < 8 * t.bytes; line += 64)
                _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, PREFETCH_HINT);
            small_group_dot(type, xrows, WIDE, b, blk, cols, x, r0, even, odd, minsum);
        }
    } else {
        for (; blk < blocks; blk++) {
            const uint8_t *b = row + (size_t)blk * t.bytes;
            for (int line = 0; line < t.bytes; line += 64)  // a K block spans 3-4 cache lines
                _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, PREFETCH_HINT);
            k_block_dot(type, xrows, WIDE, b, blk, cols, x, r0, even, odd, minsum);
        }
    }
    float shift[MAX_XROWS];
    for (int r = 0; r < xrows; r++) shift[r] = hsum8(minsum[r]);
    for (; blk < blocks; blk++)  // a row's last 32-weight blocks that make no group of 8
        small_block_dot(type, xrows, WIDE, row + (size_t)blk * t.bytes, blk, cols, x, r0, blk & 1 ? odd : even, shift);
    for (int r = 0; r < xrows; r++) out[r] = hsum8(_mm256_add_ps(even[r], odd[r])) + shift[r];
}

// rows [first, first + count) of one weight against rows r0 .. r0 + xrows - 1 of x: out[r][o] (row stride `total`)
static inline __attribute__((always_inline)) void rows_dot(const int type, const int xrows, const int WIDE,
                                                           const uint8_t *weight,
                                                           int64_t row_bytes, int64_t first, int64_t count, int cols,
                                                           const quantized_x *x, int r0, float *out, int64_t total) {
    for (int64_t o = first; o < first + count; o++) {
        float sums[MAX_XROWS];
        row_dot(type, xrows, WIDE, weight + o * row_bytes, cols, x, r0, sums);
        for (int r = 0; r < xrows; r++) out[(size_t)r * total + o] = sums[r];
    }
}

#define ROWS_DOT_CASES(XROWS, WIDE) \
    case GG_Q4_0: rows_dot(GG_Q4_0, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q4_1: rows_dot(GG_Q4_1, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q5_0: rows_dot(GG_Q5_0, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q5_1: rows_dot(GG_Q5_1, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q8_0: rows_dot(GG_Q8_0, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q4_K: rows_dot(GG_Q4_K, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q5_K: rows_dot(GG_Q5_K, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break; \
    case GG_Q6_K: rows_dot(GG_Q6_K, XROWS, WIDE, w, rb, first, count, cols, x, r0, out, total); break;

// one type's rows against one or two rows of x, specialised per type (the switch is outside the loops)
static void rows_dot_any(int type, int xrows, const uint8_t *w, int64_t rb, int64_t first, int64_t count, int cols,
                         const quantized_x *x, int r0, float *out, int64_t total) {
#if ZMM_PAIRS
    if (x->q16p && xrows == 4) { switch (type) { ROWS_DOT_CASES(4, 1) } return; }
    if (x->q16p && xrows == 3) { switch (type) { ROWS_DOT_CASES(3, 1) } return; }
    if (x->pairs8 && xrows == 4) { switch (type) { ROWS_DOT_CASES(4, 0) } return; }
    if (x->pairs8 && xrows == 3) { switch (type) { ROWS_DOT_CASES(3, 0) } return; }
#endif
    if (x->q16) {
        if (xrows == 2) { switch (type) { ROWS_DOT_CASES(2, 1) } } else { switch (type) { ROWS_DOT_CASES(1, 1) } }
    } else {
        if (xrows == 2) { switch (type) { ROWS_DOT_CASES(2, 0) } } else { switch (type) { ROWS_DOT_CASES(1, 0) } }
    }
}
#endif

// `count` weight rows (row stride `row_bytes`) decoded: codes [count][cols], lanes [count][cols / 32 * 8],
// offsets [count][cols / 32]; codes and lanes 32-byte aligned
static void decode_rows(int type, const block_type *t, const uint8_t *rows, int64_t row_bytes, int count, int cols,
                        uint8_t *codes, float *lanes, float *offsets, int portable) {
    const int subs = cols / SUB, per_block = t->super / SUB;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = rows + r * row_bytes;
        for (int blk = 0; blk < cols / t->super; blk++) {
            const uint8_t *block = row + (int64_t)blk * t->bytes;
            uint8_t *c = codes + (size_t)r * cols + blk * t->super;
            float *l = lanes + ((size_t)r * subs + blk * per_block) * 8, *o = offsets + (size_t)r * subs + blk * per_block;
#if defined(__AVX2__)
            if (!portable) {  // each sub-block as the register path decodes it, stored
                for (int line = 0; line < t->bytes; line += 64)
                    _mm_prefetch((const char *)block + PREFETCH_AHEAD + line, PREFETCH_HINT);
                for (int j = 0; j < per_block; j++) {
                    __m256i codes32;
                    __m256 lanes8;
                    sub_block(type, block, j, &codes32, &lanes8, o + j);
                    _mm256_store_si256((__m256i *)(c + j * SUB), codes32);
                    _mm256_store_ps(l + j * 8, lanes8);
                }
                continue;
            }
#endif
            decode_block(type, block, c, l, o);
        }
    }
}

// x's rows quantized per 32 values for weights of `types` (`count` of them), once for all of them: row n is x's row
// ids[n] (ids NULL: row n), in int8, or int16 (x_bits 16; also in slot order where one of the types takes it).
// Released by free_x.
static quantized_x quantize_x(const void *x, int64_t x_stride, const int64_t *ids, int rows, int cols, int dtype,
                              const int32_t *types, int count, int x_bits, int threads) {
    const size_t es = dtype_size(dtype);
    const int subs = cols / SUB, wide = x_bits == 16;
    int slots = 0;
    for (int i = 0; i < count; i++) {
        block_type t;
        block_type_of(types[i], &t);
        slots |= wide && t.slots;
    }
    const size_t x_bytes = ((size_t)rows * cols * (wide ? 2 : 1) + 63) & ~(size_t)63;
    void *codes_x = aligned_alloc(64, x_bytes * (slots ? 2 : 1));
    quantized_x xq = {.q = wide ? NULL : codes_x, .q16 = wide ? codes_x : NULL,
                      .q16s = slots ? (int16_t *)((char *)codes_x + x_bytes) : NULL,
                      .scale = scratch_floats((size_t)rows * subs), .sum = scratch_floats((size_t)rows * subs),
                      .qsum = scratch_floats((size_t)rows * subs)};
    // a team only for enough values to pay for it: a MoE decode step's down call quantizes one row per routed expert
    // (OLMoE: 8 x 1024), which one thread does in a few us where the team's start and join cost more
#pragma omp parallel for num_threads(threads) schedule(static) if ((int64_t)rows * cols >= 32768)
    for (int n = 0; n < rows; n++) {
        float *row = scratch_floats((size_t)cols);
        load_row((const char *)x + (size_t)(ids ? ids[n] : n) * x_stride * es, dtype, cols, row);
        quantize_row(row, cols, wide ? NULL : xq.q + (size_t)n * cols, wide ? xq.q16 + (size_t)n * cols : NULL,
                     slots ? xq.q16s + (size_t)n * cols : NULL, xq.scale + (size_t)n * subs,
                     xq.sum + (size_t)n * subs, xq.qsum + (size_t)n * subs);
        free(row);
    }
    return xq;
}

#if ZMM_PAIRS
// the quantized x also as row_dot's AVX-512 pairs take it: int8 as it is, int16 (and its slot order) in the pair
// layout (the decoded tiles read q16 / q16s)
static void pair_x(quantized_x *xq, int rows, int cols) {
    xq->pairs8 = xq->q != NULL;
    if (xq->q16 == NULL)
        return;
    const size_t x_bytes = ((size_t)rows * cols * 2 + 63) & ~(size_t)63;
    int16_t *paired = aligned_alloc(64, x_bytes * (xq->q16s ? 2 : 1));
    xq->q16p = pair_layout(xq->q16, paired, rows, cols);
    xq->q16sp = xq->q16s ? pair_layout(xq->q16s, (int16_t *)((char *)paired + x_bytes), rows, cols) : NULL;
}
#endif

static void free_x(quantized_x *xq) {
    free(xq->q ? (void *)xq->q : (void *)xq->q16);  // q16s lies in the same block, q16sp in q16p's
    free(xq->q16p);
    free(xq->scale);
    free(xq->sum);
    free(xq->qsum);
}

// out[n][segment's columns] = x[n] @ W.T for each of `segments` weights (a fused projection: q / k / v or gate / up,
// possibly of different types), their outputs side by side in `out` (contiguous [rows][sum of outs], `dtype`); x
// [rows][cols] of `dtype` with row stride x_stride. Weight s: `types[s]`, `weights[s]` its first row, `row_bytes[s]`
// between rows, `outs[s]` rows; `columns` (or NULL) where each output column goes in `out`. `simd`: SIMD_WIDEST, SIMD_NONE (the plain C dot products even where AVX2 runs) or
// SIMD_AVX2 (not the AVX-512 pairs where they are built): the tests check each.
// `x_bits`: 8 or 16, x's quantization.
void kvf_gguf_linear(const void *x, int64_t x_stride, int32_t rows, int32_t cols, int32_t dtype, int32_t segments,
                     const int32_t *types, const void *const *weights, const int64_t *row_bytes, const int64_t *outs,
                     const int64_t *columns, void *out, int32_t threads, int32_t simd, int32_t x_bits) {
    const int portable = simd == SIMD_NONE;
    const size_t es = dtype_size(dtype);
    const int subs = cols / SUB;
    int64_t total = 0;
    for (int s = 0; s < segments; s++) total += outs[s];
    const int64_t tiles = row_groups(segments, outs, TILE);
    if ((int64_t)rows * total * cols < PARALLEL_MIN * threads)
        threads = 1;
    quantized_x xq = quantize_x(x, x_stride, NULL, rows, cols, dtype, types, segments, x_bits, threads);
#if defined(__AVX2__)
    const int pairs = ZMM_PAIRS && simd == SIMD_WIDEST;
    if (!portable && rows <= (pairs ? FEW_ROWS_PAIRS : FEW_ROWS)) {  // decoded in registers, once per 2 or 4 rows of x
#if ZMM_PAIRS
        if (pairs)
            pair_x(&xq, rows, cols);
#endif
        float *sums = scratch_floats((size_t)rows * total);
        const int64_t units = (total + UNIT - 1) / UNIT;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int64_t first = u * UNIT, column = 0;
            int s = 0;
            while (first >= outs[s]) { first -= outs[s]; column += outs[s]; s++; }
            int64_t count = outs[s] - first < UNIT ? outs[s] - first : UNIT;
            // a unit may cross into the next segments: each part with its own weight
            while (count > 0) {
                const int per_pass = pairs ? MAX_XROWS : 2;
                for (int r0 = 0; r0 < rows; r0 += per_pass)
                    rows_dot_any(types[s], rows - r0 >= per_pass ? per_pass : rows - r0, weights[s], row_bytes[s], first,
                                 count, cols, &xq, r0, sums + (size_t)r0 * total + column, total);
                int64_t left = (u + 1) * UNIT - (column + first + count);
                if (left <= 0 || ++s >= segments) break;
                column += outs[s - 1];
                first = 0;
                count = outs[s] < left ? outs[s] : left;
            }
        }
        for (int n = 0; n < rows; n++)
            store_columns(sums + (size_t)n * total, dtype, 0, (int)total, columns, (char *)out + (size_t)n * total * es);
        free(sums);
        free_x(&xq);
        return;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        uint8_t *codes = aligned_alloc(64, (size_t)TILE * cols);
        float *lanes = scratch_floats((size_t)TILE * subs * 8), *offsets = scratch_floats((size_t)TILE * subs);
        float *sums = scratch_floats((size_t)rows * TILE);
#pragma omp for schedule(static)
        for (int64_t k = 0; k < tiles; k++) {
            int s;
            int64_t first, column;
            const int tile = row_group(k, TILE, outs, &s, &first, &column);
            block_type t;
            block_type_of(types[s], &t);
            decode_rows(types[s], &t, (const uint8_t *)weights[s] + first * row_bytes[s], row_bytes[s], tile, cols,
                        codes, lanes, offsets, portable);
#if defined(__AVX2__)
            if (!portable)
                dot_tile_avx2(&t, tile, rows, cols, codes, lanes, offsets, &xq, sums);
            else
#endif
                dot_tile_portable(&t, tile, rows, cols, codes, lanes, offsets, &xq, sums);
            for (int n = 0; n < rows; n++)
                store_columns(sums + (size_t)n * tile, dtype, column + first, tile, columns,
                              (char *)out + (size_t)n * total * es);
        }
        free(codes);
        free(lanes);
        free(offsets);
        free(sums);
    }
    free_x(&xq);
}

// ---- a mixture-of-experts layer's routed experts in one call ----

// rows [r0, r0 + xrows) of the quantized x, as a quantized_x of their own (the tile path reads from row 0)
static quantized_x rows_from(const quantized_x *x, int64_t r0, int cols) {
    const int64_t subs = cols / SUB;
    quantized_x v = *x;
    v.q = x->q ? x->q + r0 * cols : NULL;
    v.q16 = x->q16 ? x->q16 + r0 * cols : NULL;
    v.q16s = x->q16s ? x->q16s + r0 * cols : NULL;
    v.scale = x->scale + r0 * subs, v.sum = x->sum + r0 * subs, v.qsum = x->qsum + r0 * subs;
    return v;
}

// Expert e's weights (`segments` side by side, as kvf_gguf_linear's: types / weights / row_bytes [e * segments + s],
// outs [s], the same for every expert) against its own rows of x: rows [starts[e], starts[e + 1]) of the gathered x,
// whose row p is x[ids[p]] (ids NULL: x's row p). out [rows][outs' sum] (`dtype`). One call for all the experts a
// step routed to, where one call per expert quantized x and started a team of threads each time (OLMoE-1B-7B's shape
// in Q4_0 on a 2-core Zen 5: batch-1 decode 19.4 -> 24.8 tok/s with the Python it saves; one layer's 8 experts' gate
// / up, cold, 24 GB/s). Each expert's outputs are the bits kvf_gguf_linear gives for its rows alone
// (x quantized per row alike; few rows decoded in registers, many through decoded tiles, as there). `x_bits` 8 or 16.
// Returns 0, or before touching anything 1 where `starts` does not ascend from 0 to `rows`, 2 where an id is not
// one of x's `x_rows` rows (checked here: the same checks in torch cost ~35 us a call, a MoE model's ~1 ms a token).
int32_t kvf_gguf_experts_linear(const void *x, int64_t x_stride, int64_t x_rows, const int64_t *ids, int32_t rows,
                                int32_t cols, int32_t dtype, int32_t experts, const int64_t *starts, int32_t segments,
                                const int32_t *types, const void *const *weights, const int64_t *row_bytes,
                                const int64_t *outs, void *out, int32_t threads, int32_t simd, int32_t x_bits) {
    if (starts[0] != 0 || starts[experts] != rows)
        return 1;
    for (int e = 0; e < experts; e++)
        if (starts[e + 1] < starts[e])
            return 1;
    for (int n = 0; n < rows; n++)
        if (ids ? ids[n] < 0 || ids[n] >= x_rows : n >= x_rows)
            return 2;
    const int portable = simd == SIMD_NONE;
    const size_t es = dtype_size(dtype);
    const int subs = cols / SUB;
    int64_t total = 0;
    for (int s = 0; s < segments; s++) total += outs[s];
    if ((int64_t)rows * total * cols < PARALLEL_MIN * threads)
        threads = 1;
    quantized_x xq = quantize_x(x, x_stride, ids, rows, cols, dtype, types, experts * segments, x_bits, threads);
    int few = 0;  // rows of x up to which an expert's weights are decoded in registers (0: always decoded tiles)
#if defined(__AVX2__)
    const int pairs = ZMM_PAIRS && simd == SIMD_WIDEST;
    few = portable ? 0 : pairs ? FEW_ROWS_PAIRS : FEW_ROWS;
#if ZMM_PAIRS
    if (pairs)  // the tiles read q16 / q16s; the pairs only the rows decoded in registers
        pair_x(&xq, rows, cols);
#endif
#endif
    int *active = malloc(sizeof(int) * (experts > 0 ? experts : 1)), routed = 0;  // the experts with rows
    for (int e = 0; e < experts; e++)
        if (starts[e + 1] > starts[e]) active[routed++] = e;
    float *sums = scratch_floats((size_t)rows * total);
    const int64_t per_expert = (total + UNIT - 1) / UNIT, units = routed * per_expert;
#pragma omp parallel num_threads(threads)
    {
        int widest = 0;  // the most rows an expert takes through the tiles
        for (int a = 0; a < routed; a++) {
            const int count = (int)(starts[active[a] + 1] - starts[active[a]]);
            if (count > few && count > widest) widest = count;
        }
        uint8_t *codes = widest ? aligned_alloc(64, (size_t)TILE * cols) : NULL;
        float *lanes = widest ? scratch_floats((size_t)TILE * subs * 8) : NULL;
        float *offsets = widest ? scratch_floats((size_t)TILE * subs) : NULL;
        float *tile_sums = widest ? scratch_floats((size_t)widest * TILE) : NULL;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int e = active[u / per_expert];
            const int64_t r0 = starts[e], xrows = starts[e + 1] - r0;
            // the unit's output columns [u0, u0 + UNIT), over the segments they cross
            const int64_t u0 = u % per_expert * UNIT, u1 = u0 + UNIT < total ? u0 + UNIT : total;
            int64_t column = 0;
            for (int s = 0; s < segments; column += outs[s], s++) {
                const int64_t first = u0 > column ? u0 - column : 0;
                const int64_t last = u1 - column < outs[s] ? u1 - column : outs[s];
                if (last <= first) continue;
                const int i = e * segments + s;
                const uint8_t *w = weights[i];
#if defined(__AVX2__)
                if (xrows <= few) {
                    const int per_pass = pairs ? MAX_XROWS : 2;
                    for (int64_t r = r0; r < r0 + xrows; r += per_pass)
                        rows_dot_any(types[i], r0 + xrows - r >= per_pass ? per_pass : (int)(r0 + xrows - r), w,
                                     row_bytes[i], first, last - first, cols, &xq, (int)r,
                                     sums + (size_t)r * total + column, total);
                    continue;
                }
#endif
                block_type t;
                block_type_of(types[i], &t);
                const quantized_x own = rows_from(&xq, r0, cols);
                for (int64_t o = first; o < last; o += TILE) {
                    const int tile = last - o < TILE ? (int)(last - o) : TILE;
                    decode_rows(types[i], &t, w + o * row_bytes[i], row_bytes[i], tile, cols, codes, lanes, offsets,
                                portable);
#if defined(__AVX2__)
                    if (!portable)
                        dot_tile_avx2(&t, tile, (int)xrows, cols, codes, lanes, offsets, &own, tile_sums);
                    else
#endif
                        dot_tile_portable(&t, tile, (int)xrows, cols, codes, lanes, offsets, &own, tile_sums);
                    for (int64_t r = 0; r < xrows; r++)
                        memcpy(sums + (size_t)(r0 + r) * total + column + o, tile_sums + r * tile,
                               sizeof(float) * tile);
                }
            }
        }
        free(codes);
        free(lanes);
        free(offsets);
        free(tile_sums);
    }
    for (int n = 0; n < rows; n++)
        store_columns(sums + (size_t)n * total, dtype, 0, (int)total, NULL, (char *)out + (size_t)n * total * es);
    free(sums);
    free(active);
    free_x(&xq);
    return 0;
}

// what this build's kernels use on this CPU (bits: 1 AVX2, 2 the AVX-512 pairs, 4 the AVX512_BF16 tile)
int32_t kvf_gguf_simd_built(void) { return AVX2_BUILT | (ZMM_PAIRS << 1) | (BF16_TILE << 2); }

// out[n] = W[ids[n]] dequantized (fp32 / bf16 / fp16, `dtype`), W [.., cols] of `type` with row stride row_bytes;
// ids NULL: rows 0 .. count - 1. In fp32, bit for bit the `gguf` package's dequantize: every product here is exact
// (an fp16 scale times a small integer) and the one addition rounds as numpy's does.
void kvf_gguf_dequant(int32_t type, const void *weight, int64_t row_bytes, const int64_t *ids, int64_t count,
                      int32_t cols, void *out, int32_t dtype, int32_t threads) {
    block_type t;
    block_type_of(type, &t);
    const int subs = cols / SUB;
#pragma omp parallel num_threads(threads) if (count * cols >= 65536)
    {
        uint8_t *codes = aligned_alloc(64, (size_t)cols);
        float *lanes = scratch_floats((size_t)subs * 8), *offsets = scratch_floats((size_t)subs);
        float *row = scratch_floats((size_t)cols);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < count; n++) {
            const int64_t id = ids ? ids[n] : n;
            decode_rows(type, &t, (const uint8_t *)weight + id * row_bytes, row_bytes, 1, cols, codes, lanes, offsets, 0);
            for (int s = 0; s < subs; s++)
                for (int i = 0; i < SUB; i++) {
                    const float code = t.signed_codes ? (float)(int8_t)codes[s * SUB + i] : (float)codes[s * SUB + i];
                    row[s * SUB + i] = lanes[s * 8 + i / 4] * code + offsets[s];
                }
            store_row(row, dtype, cols, (char *)out + (size_t)n * cols * dtype_size(dtype));
        }
        free(codes);
        free(lanes);
        free(offsets);
        free(row);
    }
}

// ---- F32 / F16 / BF16 weights of a GGUF, read in place: the fp32-activations path below, each weight row converted
// as it is read (x as given, fp32 math; a row of any length: the last cols % 8 weights after the lanes' sum) ----
static inline int float_type(int type) { return type == GG_F32 || type == GG_F16 || type == GG_BF16; }

// one weight row in fp32
static inline void float_row(int type, const uint8_t *w, int cols, float *row) {
    load_row(w, type == GG_F32 ? F32 : type == GG_F16 ? F16 : BF16, cols, row);
}

// ---- fp32 activations (the default): y = x . W, W formed exactly as GGUF dequantizes it ----
// Each 8-weight group is lanes * code + offset in one fma (the product is exact: GGUF's value, bit for bit) and meets
// x in fp32, accumulated into 8 lanes in k order, the lanes added in a fixed order: fp32 rounding only. A few rows of
// x: PANEL weight rows at a time decoded in registers as they are used (independent accumulators). Many rows: a
// panel of PANEL weight rows decoded once per chunk of x rows into an fp32 buffer, then a 3 x 4 register tile of
// (x row, weight row) sums. Every path -- and the portable one -- forms each sum the same way: a row's result does
// not depend on the batch. Float weights (F32 / F16 / BF16) take the same paths, converted instead of decoded (a
// prefill through the panel: 128 rows x 2048 x 8192 BF16 ~8x faster than one dot product per (row, weight row)).
enum { PANEL = 8 };         // weight rows decoded together (fp32: 32 KiB per 1024 input features)
enum { MANY_ROWS = 4 };     // from this many rows of x, the panel path
enum { X_CHUNK = 64 };      // rows of x per pass over the panels (kept in cache while the panels stream)

static inline float hsum8_fixed(const float lanes[8]) {
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// one weight row in fp32, exactly (portable)
static void exact_weights_portable(int type, const block_type *t, const uint8_t *row, int cols, float *w) {
    if (float_type(type)) {
        float_row(type, row, cols, w);
        return;
    }
    uint8_t codes[256];
    float lanes[64], offsets[8];
    for (int blk = 0; blk < cols / t->super; blk++) {
        decode_block(type, row + (size_t)blk * t->bytes, codes, lanes, offsets);
        for (int i = 0; i < t->super; i++) {
            const float code = t->signed_codes ? (float)(int8_t)codes[i] : (float)codes[i];
            w[blk * t->super + i] = fmaf(code, lanes[(i / SUB) * 8 + (i % SUB) / 4], offsets[i / SUB]);
        }
    }
}

// x . w in the fixed order (8 lanes over k, then hsum8_fixed, then a float row's last cols % 8 products in k order)
static float exact_dot_portable(const float *w, const float *x, int cols) {
    float lanes[8] = {0};
    int k = 0;
    for (; k + 8 <= cols; k += 8)
        for (int l = 0; l < 8; l++) lanes[l] = fmaf(w[k + l], x[k + l], lanes[l]);
    float acc = hsum8_fixed(lanes);
    for (; k < cols; k++) acc = fmaf(w[k], x[k], acc);
    return acc;
}

#if defined(__AVX2__)
static inline float hsum8_vec(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return hsum8_fixed(lanes);
}

// 8 codes as fp32 from 8 bytes at p: (byte >> shift) & mask, unsigned, or the signed bytes themselves (mask 0)
static inline __m256 codes8(const uint8_t *p, int shift, int mask) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    if (!mask)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256i wide = _mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes), shift);
    return _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(mask)));
}

// bits [bit, bit + 8) of the 32-bit word at p, each as 0 / 16 (the fifth bit of 8 Q5 codes)
static inline __m256i fifth8(const uint8_t *p, int bit) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_srlv_epi32(_mm256_set1_epi32((int)(bits >> bit)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(1)), 4);
}

// sub-block j of block b as four vectors of 8 exact weights (decode_block's codes, scales and offset)
static inline __attribute__((always_inline)) void sub_weights(const int type, const uint8_t *b, int j, __m256 w[4]) {
    __m256 q[4];
    float low, high, offset;
    switch (type) {
    case GG_Q4_0: case GG_Q4_1: {
        const uint8_t *qs = b + (type == GG_Q4_0 ? 2 : 4);
        q[0] = codes8(qs, 0, 15); q[1] = codes8(qs + 8, 0, 15); q[2] = codes8(qs, 4, 15); q[3] = codes8(qs + 8, 4, 15);
        low = high = half_at(b);
        offset = type == GG_Q4_0 ? -8.0f * low : half_at(b + 2);
        break;
    }
    case GG_Q5_0: case GG_Q5_1: {
        const int header = type == GG_Q5_0 ? 2 : 4;
        const uint8_t *qs = b + header + 4, *qh = b + header;
        for (int g = 0; g < 4; g++) {
            const __m256i nib = _mm256_and_si256(
                _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (g % 2) * 8))), (g / 2) * 4),
                _mm256_set1_epi32(15));
            q[g] = _mm256_cvtepi32_ps(_mm256_or_si256(nib, fifth8(qh, g * 8)));
        }
        low = high = half_at(b);
        offset = type == GG_Q5_0 ? -16.0f * low : half_at(b + 2);
        break;
    }
    case GG_Q8_0:
        for (int g = 0; g < 4; g++) q[g] = codes8(b + 2 + g * 8, 0, 0);
        low = high = half_at(b);
        offset = 0.0f;
        break;
    case GG_Q4_K: case GG_Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const uint8_t *qs = b + (type == GG_Q4_K ? 16 : 48) + (j / 2) * 32;
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_and_si256(
                _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + g * 8))), (j & 1) * 4),
                _mm256_set1_epi32(15));
            if (type == GG_Q5_K) {  // bit j of qh byte i: the fifth bit of weight i
                const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + g * 8)));
                v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, j), _mm256_set1_epi32(1)), 4));
            }
            q[g] = _mm256_cvtepi32_ps(v);
        }
        low = high = half_at(b) * (float)sc;
        offset = -(half_at(b + 2) * (float)mn);
        break;
    }
    default: {  // GG_Q6_K: its 32 codes built byte-wide (as sub_block does), then widened
        const int h = j / 4, g4 = j % 4;
        __m256i c;
        __m256 unused;
        sub_block(GG_Q6_K, b, j, &c, &unused, &offset);
        const __m128i lo8 = _mm256_castsi256_si128(c), hi8 = _mm256_extracti128_si256(c, 1);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo8));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo8, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi8));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi8, 8)));
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        low = d * (float)sc[h * 8 + g4 * 2];
        high = d * (float)sc[h * 8 + g4 * 2 + 1];
        break;
    }
    }
    const __m256 off = _mm256_set1_ps(offset), lo = _mm256_set1_ps(low), hi = _mm256_set1_ps(high);
    w[0] = _mm256_fmadd_ps(q[0], lo, off);
    w[1] = _mm256_fmadd_ps(q[1], lo, off);
    w[2] = _mm256_fmadd_ps(q[2], hi, off);
    w[3] = _mm256_fmadd_ps(q[3], hi, off);
}

// out[o] = x . W[o] for `count` (1..PANEL) weight rows from `row` (stride row_bytes), one row of x
static inline __attribute__((always_inline)) void exact_rows(const int type, const uint8_t *row, int64_t row_bytes,
                                                             int count, int cols, const float *x, float *out) {
    block_type t;
    block_type_of(type, &t);
    __m256 acc[PANEL];
    for (int o = 0; o < PANEL; o++) acc[o] = _mm256_setzero_ps();
    for (int blk = 0; blk < cols / t.super; blk++)
        for (int j = 0; j < t.super / SUB; j++) {
            const int k = (blk * (t.super / SUB) + j) * SUB;
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8), x2 = _mm256_loadu_ps(x + k + 16),
                         x3 = _mm256_loadu_ps(x + k + 24);
            for (int o = 0; o < PANEL; o++) {
                if (o >= count) break;
                __m256 w[4];
                sub_weights(type, row + o * row_bytes + (size_t)blk * t.bytes, j, w);
                acc[o] = _mm256_fmadd_ps(w[0], x0, acc[o]);
                acc[o] = _mm256_fmadd_ps(w[1], x1, acc[o]);
                acc[o] = _mm256_fmadd_ps(w[2], x2, acc[o]);
                acc[o] = _mm256_fmadd_ps(w[3], x3, acc[o]);
            }
        }
    for (int o = 0; o < count; o++) out[o] = hsum8_vec(acc[o]);
}

// one weight row in fp32, exactly (the panel path's buffer)
static inline __attribute__((always_inline)) void exact_weights(const int type, const uint8_t *row, int cols, float *w) {
    block_type t;
    block_type_of(type, &t);
    for (int blk = 0; blk < cols / t.super; blk++) {
        _mm_prefetch((const char *)row + (size_t)blk * t.bytes + PREFETCH_AHEAD, PREFETCH_HINT);
        for (int j = 0; j < t.super / SUB; j++) {
            __m256 v[4];
            sub_weights(type, row + (size_t)blk * t.bytes, j, v);
            float *dst = w + (blk * (t.super / SUB) + j) * SUB;
            for (int g = 0; g < 4; g++) _mm256_storeu_ps(dst + g * 8, v[g]);
        }
    }
}

// 8 float weights from p (type F32 / F16 / BF16) in fp32
static inline __m256 float8(const int type, const uint8_t *p) {
    if (type == GG_F32)
        return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == GG_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exact_rows for float weights (cols a multiple of 8): out[o] = x . W[o], in the same order
static inline __attribute__((always_inline)) void float_rows(const int type, const uint8_t *row, int64_t row_bytes,
                                                             int count, int cols, const float *x, float *out) {
    const int size = type == GG_F32 ? 4 : 2;
    __m256 acc[PANEL];
    for (int o = 0; o < PANEL; o++) acc[o] = _mm256_setzero_ps();
    for (int k = 0; k < cols; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        const int line = ((k * size) & 63) == 0;  // one prefetch per cache line of each weight row
        for (int o = 0; o < PANEL; o++) {
            if (o >= count) break;
            const uint8_t *w = row + o * row_bytes + (size_t)k * size;
            if (line) _mm_prefetch((const char *)w + PREFETCH_AHEAD, PREFETCH_HINT);
            acc[o] = _mm256_fmadd_ps(float8(type, w), xv, acc[o]);
        }
    }
    for (int o = 0; o < count; o++) out[o] = hsum8_vec(acc[o]);
}

#define EXACT_CASES(CALL) \
    case GG_Q4_0: CALL(GG_Q4_0); break; case GG_Q4_1: CALL(GG_Q4_1); break; case GG_Q5_0: CALL(GG_Q5_0); break; \
    case GG_Q5_1: CALL(GG_Q5_1); break; case GG_Q8_0: CALL(GG_Q8_0); break; case GG_Q4_K: CALL(GG_Q4_K); break; \
    case GG_Q5_K: CALL(GG_Q5_K); break; case GG_Q6_K: CALL(GG_Q6_K); break;
#define FLOAT_CASES(CALL) \
    case GG_F32: CALL(GG_F32); break; case GG_F16: CALL(GG_F16); break; case GG_BF16: CALL(GG_BF16); break;

static void exact_rows_any(int type, const uint8_t *row, int64_t row_bytes, int count, int cols, const float *x,
                           float *out) {
#define CALL(T) exact_rows(T, row, row_bytes, count, cols, x, out)
#define FLOAT(T) float_rows(T, row, row_bytes, count, cols, x, out)
    switch (type) { EXACT_CASES(CALL) FLOAT_CASES(FLOAT) }
#undef CALL
#undef FLOAT
}

static void exact_weights_any(int type, const uint8_t *row, int cols, float *w) {
#define CALL(T) exact_weights(T, row, cols, w)
    if (float_type(type)) {
        float_row(type, row, cols, w);
        return;
    }
    switch (type) { EXACT_CASES(CALL) }
#undef CALL
}

// sums[r][o] (row stride `stride`) = x[r] . w[o] for rows of x [0, xrows) and `count` (<= PANEL) panel rows: XR
// rows of x x 4 panel rows of accumulators in registers (each (r, o) summed in exact_rows' order: lane l over
// k = l mod 8, then hsum8_fixed)
#define PANEL_XR 3
static void panel_dot(const float *w, int count, const float *x, int xrows, int cols, float *sums, int64_t stride) {
    for (int r0 = 0; r0 < xrows; r0 += PANEL_XR) {
        const int nr = xrows - r0 < PANEL_XR ? xrows - r0 : PANEL_XR;
        const float *xr[PANEL_XR];
        for (int r = 0; r < PANEL_XR; r++) xr[r] = x + (size_t)(r0 + (r < nr ? r : nr - 1)) * cols;
        for (int o0 = 0; o0 < count; o0 += 4) {
            __m256 acc[PANEL_XR][4];
            for (int r = 0; r < PANEL_XR; r++)
                for (int o = 0; o < 4; o++) acc[r][o] = _mm256_setzero_ps();
            const float *wr[4];
            for (int o = 0; o < 4; o++) wr[o] = w + (size_t)(o0 + o < count ? o0 + o : o0) * cols;
            for (int k = 0; k < cols; k += 8) {
                __m256 v[PANEL_XR];
                for (int r = 0; r < PANEL_XR; r++) v[r] = _mm256_loadu_ps(xr[r] + k);
                for (int o = 0; o < 4; o++) {
                    const __m256 wv = _mm256_loadu_ps(wr[o] + k);
                    for (int r = 0; r < PANEL_XR; r++) acc[r][o] = _mm256_fmadd_ps(wv, v[r], acc[r][o]);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int o = 0; o < 4 && o0 + o < count; o++) sums[(size_t)(r0 + r) * stride + o0 + o] = hsum8_vec(acc[r][o]);
        }
    }
}

// ---- many rows without the fixed order: an outer-product register tile (BLIS's / oneDNN's AVX2 shape) ----
// Where a row's result may depend on the batch (`invariant` 0: the `auto` activations, whose decode steps already
// quantize x; dense weights kept in a narrower dtype, as torch's matmul), many rows of x take this path instead of
// panel_dot: OUTER_NR weight rows decoded, transposed so that each k holds their 16 weights side by side, then an
// OUTER_MR x 16 tile of sums: per k two loads of weights, MR broadcasts of x, 2 MR fmas (12 accumulators, 8 loads
// for 12 fmas where panel_dot's tile needs 7 loads for 12 and GCC reloads x per fma). Each sum runs over k in order
// (one fp32 accumulator), KC at a time so that the transposed block stays in L1. Zen 2, 2 threads, 140 rows of 2048
// against 6144 rows: BF16 55 -> 66 GMAC/s, Q4_0 58 -> 71, Q4_K 56 -> 69, Q6_K 55 -> 68 (oneDNN's fp32 sgemm: 69).
enum { OUTER_NR = 16, OUTER_MR = 6, OUTER_KC = 256, OUTER_CHUNK = 96 };
// from this many rows of x (fewer: the 6-row tile's last pass is mostly repeats; measured from 24 rows faster than
// panel_dot on Zen 2 for BF16 / Q4_0 / Q4_K / Q6_K, 1.2-1.3x at 64-140 rows)
enum { OUTER_MIN_ROWS = 24 };

// 8 vectors (rows) -> their transpose in place: r[j] holds element j of each row
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]),
                 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]),
                 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]),
                 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// w: `count` (<= nr, a multiple of 8) rows [count][cols] of 32-bit values -> wt [cols][nr] (rows past count: zeros)
static void transpose_rows(const float *w, int count, int cols, int nr, float *wt) {
    for (int k0 = 0; k0 < cols; k0 += 8)
        for (int o0 = 0; o0 < nr; o0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = o0 + i < count ? _mm256_loadu_ps(w + (size_t)(o0 + i) * cols + k0) : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_store_ps(wt + (size_t)(k0 + j) * nr + o0, r[j]);
        }
}

// sums[r][o] (row stride `stride`) = x[r] . w[o] for x rows [0, xrows) (<= OUTER_CHUNK) and outputs [0, count):
// wt [cols][OUTER_NR] (transpose_rows), part a scratch [OUTER_CHUNK][OUTER_NR]
static void outer_dot(const float *wt, int count, const float *x, int xrows, int cols, float *sums, int64_t stride,
                      float *part) {
    for (int k0 = 0; k0 < cols; k0 += OUTER_KC) {
        const int k1 = cols - k0 < OUTER_KC ? cols : k0 + OUTER_KC;
        for (int r0 = 0; r0 < xrows; r0 += OUTER_MR) {
            const int nr = xrows - r0 < OUTER_MR ? xrows - r0 : OUTER_MR;
            // rows past the last one repeat it (same sums, stored to the same place): every index below is constant
            // once unrolled, so the 12 accumulators stay in registers
            const float *xr[OUTER_MR];
            float *pr[OUTER_MR];
            __m256 acc[OUTER_MR][2];
            for (int r = 0; r < OUTER_MR; r++) {
                xr[r] = x + (size_t)(r0 + (r < nr ? r : nr - 1)) * cols;
                pr[r] = part + (size_t)(r0 + (r < nr ? r : nr - 1)) * OUTER_NR;
                acc[r][0] = k0 ? _mm256_load_ps(pr[r]) : _mm256_setzero_ps();
                acc[r][1] = k0 ? _mm256_load_ps(pr[r] + 8) : _mm256_setzero_ps();
            }
            for (int k = k0; k < k1; k++) {
                const __m256 b0 = _mm256_load_ps(wt + (size_t)k * OUTER_NR), b1 = _mm256_load_ps(wt + (size_t)k * OUTER_NR + 8);
                for (int r = 0; r < OUTER_MR; r++) {
                    const __m256 a = _mm256_broadcast_ss(xr[r] + k);
                    acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
                }
            }
            for (int r = 0; r < OUTER_MR; r++) {
                _mm256_store_ps(pr[r], acc[r][0]);
                _mm256_store_ps(pr[r] + 8, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < xrows; r++)
        for (int o = 0; o < count; o++) sums[(size_t)r * stride + o] = part[(size_t)r * OUTER_NR + o];
}

// every row of x (fp32 xf [rows][cols]) against every weight (segments as kvf_gguf_linear_exact's) -> sums
// [rows][total], through outer_dot: units of OUTER_NR weight rows on the threads, OUTER_CHUNK rows of x a pass
static void outer_linear(int rows, int cols, int segments, const int32_t *types, const void *const *weights,
                         const int64_t *row_bytes, const int64_t *outs, int64_t total, const float *xf, float *sums,
                         int threads) {
    const int64_t units = row_groups(segments, outs, OUTER_NR);
    for (int r0 = 0; r0 < rows; r0 += OUTER_CHUNK) {
        const int xrows = rows - r0 < OUTER_CHUNK ? rows - r0 : OUTER_CHUNK;
#pragma omp parallel num_threads(threads)
        {
            float *w = scratch_floats((size_t)OUTER_NR * cols), *wt = scratch_floats((size_t)OUTER_NR * cols),
                  *part = scratch_floats((size_t)OUTER_CHUNK * OUTER_NR);
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                int s;
                int64_t first, column;
                const int count = row_group(u, OUTER_NR, outs, &s, &first, &column);
                const uint8_t *row = (const uint8_t *)weights[s] + first * row_bytes[s];
                for (int o = 0; o < count; o++) exact_weights_any(types[s], row + o * row_bytes[s], cols, w + (size_t)o * cols);
                transpose_rows(w, count, cols, OUTER_NR, wt);
                outer_dot(wt, count, xf + (size_t)r0 * cols, xrows, cols, sums + (size_t)r0 * total + column + first,
                          total, part);
            }
            free(w);
            free(wt);
            free(part);
        }
    }
}
#endif

#if BF16_TILE
// ---- many rows of a bf16 model on AVX512_BF16: bf16 products ----
// The weights are decoded exactly as above, rounded to bf16 (what a dense bf16 model holds) and meet x's bf16 values
// in vdpbf16ps (two products per fp32 lane, summed in fp32): an OUTER_MR16 x 32 tile of sums, 24 accumulators, per
// pair of k 2 loads of weights and OUTER_MR16 broadcasts of x's pair for 24 instructions of 32 products. The weights'
// rows are converted in pairs of values (32 bits: k, k + 1) and transposed like outer_linear's fp32 ones, so that each
// pair of k holds 32 outputs' pairs side by side. Each sum runs over k in pairs in order, OUTER_KC at a time; the
// weights are decoded once per OUTER_CHUNK16 rows of x (bf16_row). Zen 5, 2 threads, 140 rows of 2048 against 8192
// weight rows: Q4_0 95 -> 350 GMAC/s, Q4_K 103 -> 390, Q6_K 103 -> 360 (the fp32 tile -> this; oneDNN's bf16 GEMM on
// weights already expanded: ~400-450).
enum { OUTER_NR16 = 32, OUTER_MR16 = 12, OUTER_CHUNK16 = 256 };
// from this many rows of x (Zen 5: faster than the fp32 panel from 8 rows, 8192 x 2048 Q4_0 2.0 -> 1.6 ms; at 16 rows
// the AVX-512 int16 pairs are faster still, 1.65 against 2.0, and `auto` times that choice)
enum { OUTER_MIN_ROWS16 = 8 };

// one weight row of a block type -> bf16 (dst: cols values), each weight formed exactly as exact_weights forms it
// (lanes * code + offset in one fma) and rounded to nearest even: sub_block's registers widened 16 at a time
// (the fp32 row and a second pass cost 3 ms of a 140-row 8192 x 2048 Q4_0 call's 7.5)
static inline __attribute__((always_inline)) void bf16_row(const int type, const uint8_t *row, int cols,
                                                           uint16_t *dst) {
    block_type t;
    block_type_of(type, &t);
    for (int blk = 0; blk < cols / t.super; blk++) {
        const uint8_t *b = row + (size_t)blk * t.bytes;
        for (int j = 0; j < t.super / SUB; j++) {
            __m256i codes;
            __m256 lanes;
            float offset;
            sub_block(type, b, j, &codes, &lanes, &offset);
            const __m128i first = _mm256_castsi256_si128(codes), last = _mm256_extracti128_si256(codes, 1);
            const __m512i low = t.signed_codes ? _mm512_cvtepi8_epi32(first) : _mm512_cvtepu8_epi32(first);
            const __m512i high = t.signed_codes ? _mm512_cvtepi8_epi32(last) : _mm512_cvtepu8_epi32(last);
            // lanes 0-3 scale weights 0-15, lanes 4-7 16-31 (fill8's layout)
            const __m512 s0 = _mm512_broadcastss_ps(_mm256_castps256_ps128(lanes));
            const __m512 s1 = _mm512_broadcastss_ps(_mm256_extractf128_ps(lanes, 1));
            const __m512 o = _mm512_set1_ps(offset);
            const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(high), o),
                                                        _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(low), o));
            _mm512_storeu_si512(dst + (size_t)blk * t.super + j * SUB, (__m512i)packed);
        }
    }
}

// sums[r][o] (row stride `stride`) = x[r] . w[o] for x rows [0, xrows) (bf16, row stride x_stride) and outputs
// [0, count): wt [cols / 2][OUTER_NR16] pairs, part a scratch [OUTER_CHUNK16][OUTER_NR16]
static void outer_dot_bf16(const uint32_t *wt, int count, const uint16_t *x, int64_t x_stride, int xrows, int cols,
                           float *sums, int64_t stride, float *part) {
    for (int k0 = 0; k0 < cols; k0 += OUTER_KC) {
        const int k1 = cols - k0 < OUTER_KC ? cols : k0 + OUTER_KC;
        for (int r0 = 0; r0 < xrows; r0 += OUTER_MR16) {
            const int nr = xrows - r0 < OUTER_MR16 ? xrows - r0 : OUTER_MR16;
            const uint16_t *xr[OUTER_MR16];
            float *pr[OUTER_MR16];
            __m512 acc[OUTER_MR16][2];
            for (int r = 0; r < OUTER_MR16; r++) {  // rows past the last one repeat it, as in outer_dot
                xr[r] = x + (size_t)(r0 + (r < nr ? r : nr - 1)) * x_stride;
                pr[r] = part + (size_t)(r0 + (r < nr ? r : nr - 1)) * OUTER_NR16;
                acc[r][0] = k0 ? _mm512_load_ps(pr[r]) : _mm512_setzero_ps();
                acc[r][1] = k0 ? _mm512_load_ps(pr[r] + 16) : _mm512_setzero_ps();
            }
            for (int k = k0; k < k1; k += 2) {
                const uint32_t *b = wt + (size_t)(k / 2) * OUTER_NR16;
                const __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 16);
                for (int r = 0; r < OUTER_MR16; r++) {
                    uint32_t pair;
                    memcpy(&pair, xr[r] + k, 4);
                    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
                }
            }
            for (int r = 0; r < OUTER_MR16; r++) {
                _mm512_store_ps(pr[r], acc[r][0]);
                _mm512_store_ps(pr[r] + 16, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < xrows; r++)
        for (int o = 0; o < count; o++) sums[(size_t)r * stride + o] = part[(size_t)r * OUTER_NR16 + o];
}

// one weight row of any type -> bf16 (float types through fp32 in `scratch`, rounded to nearest even)
static void bf16_row_any(int type, const uint8_t *row, int cols, float *scratch, uint16_t *dst) {
#define CALL(T) bf16_row(T, row, cols, dst)
    if (float_type(type)) {
        float_row(type, row, cols, scratch);
        for (int k = 0; k < cols; k += 32)  // (cols % 32 == 0 on this path)
            _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(scratch + k + 16),
                                                                      _mm512_loadu_ps(scratch + k)));
        return;
    }
    switch (type) { EXACT_CASES(CALL) }
#undef CALL
}

// outer_linear for x in bf16 (x [rows] with row stride x_stride), through outer_dot_bf16
static void outer_linear_bf16(int rows, int cols, const uint16_t *x, int64_t x_stride, int segments,
                              const int32_t *types, const void *const *weights, const int64_t *row_bytes,
                              const int64_t *outs, int64_t total, float *sums, int threads) {
    const int64_t units = row_groups(segments, outs, OUTER_NR16);
    for (int r0 = 0; r0 < rows; r0 += OUTER_CHUNK16) {
        const int xrows = rows - r0 < OUTER_CHUNK16 ? rows - r0 : OUTER_CHUNK16;
#pragma omp parallel num_threads(threads)
        {
            float *w = scratch_floats((size_t)cols), *part = scratch_floats((size_t)OUTER_CHUNK16 * OUTER_NR16);
            uint32_t *pairs = (uint32_t *)scratch_floats((size_t)OUTER_NR16 * cols / 2),
                     *wt = (uint32_t *)scratch_floats((size_t)OUTER_NR16 * cols / 2);
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                int s;
                int64_t first, column;
                const int count = row_group(u, OUTER_NR16, outs, &s, &first, &column);
                const uint8_t *row = (const uint8_t *)weights[s] + first * row_bytes[s];
                for (int o = 0; o < count; o++)
                    bf16_row_any(types[s], row + o * row_bytes[s], cols, w, (uint16_t *)(pairs + (size_t)o * cols / 2));
                transpose_rows((const float *)pairs, count, cols / 2, OUTER_NR16, (float *)wt);
                outer_dot_bf16(wt, count, x + (size_t)r0 * x_stride, x_stride, xrows, cols,
                               sums + (size_t)r0 * total + column + first, total, part);
            }
            free(w);
            free(part);
            free(pairs);
            free(wt);
        }
    }
}

#endif

// kvf_gguf_linear's contract with fp32 activations (x as given, not quantized); see above.
// `invariant` 0: many rows of x may take outer_linear (each sum over k in order; a row's result then depends on the
// batch it runs in).
void kvf_gguf_linear_exact(const void *x, int64_t x_stride, int32_t rows, int32_t cols, int32_t dtype,
                           int32_t segments, const int32_t *types, const void *const *weights, const int64_t *row_bytes,
                           const int64_t *outs, const int64_t *columns, void *out, int32_t threads, int32_t simd,
                           int32_t invariant) {
    const int portable = simd == SIMD_NONE;
    (void)portable;  // (read by the AVX2 paths only)
    const size_t es = dtype_size(dtype);
    int64_t total = 0;
    for (int s = 0; s < segments; s++) total += outs[s];
    const int64_t panels = row_groups(segments, outs, PANEL);
    if ((int64_t)rows * total * cols < PARALLEL_MIN * threads)
        threads = 1;
    float *sums = scratch_floats((size_t)rows * total), *xf = NULL;
#if BF16_TILE
    if (!invariant && simd == SIMD_WIDEST && dtype == BF16 && rows >= OUTER_MIN_ROWS16 && cols % 32 == 0) {
        outer_linear_bf16(rows, cols, (const uint16_t *)x, x_stride, segments, types, weights, row_bytes, outs, total, sums, threads);
        goto store;
    }
#endif
    xf = scratch_floats((size_t)rows * cols);
    for (int n = 0; n < rows; n++) load_row((const char *)x + (size_t)n * x_stride * es, dtype, cols, xf + (size_t)n * cols);
    const int many = rows >= MANY_ROWS;
#if defined(__AVX2__)
    if (!invariant && !portable && rows >= OUTER_MIN_ROWS && cols % 8 == 0) {
        outer_linear(rows, cols, segments, types, weights, row_bytes, outs, total, xf, sums, threads);
        goto store;
    }
#endif
    for (int r0 = 0; r0 < rows; r0 += many ? X_CHUNK : rows) {
        const int xrows = many ? (rows - r0 < X_CHUNK ? rows - r0 : X_CHUNK) : rows;
#pragma omp parallel num_threads(threads)
        {
            float *w = scratch_floats((size_t)PANEL * cols);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                int s;
                int64_t first, column;
                const int count = row_group(p, PANEL, outs, &s, &first, &column);
                const uint8_t *row = (const uint8_t *)weights[s] + first * row_bytes[s];
                block_type t = {0};  // (none for a float type: its rows are converted, not decoded)
                block_type_of(types[s], &t);
                float *dst = sums + (size_t)r0 * total + column + first;
#if defined(__AVX2__)
                if (!portable && cols % 8 == 0 && many) {  // (a block type's rows are whole blocks of 32)
                    for (int o = 0; o < count; o++) exact_weights_any(types[s], row + o * row_bytes[s], cols, w + (size_t)o * cols);
                    panel_dot(w, count, xf + (size_t)r0 * cols, xrows, cols, dst, total);
                    continue;
                }
                if (!portable && cols % 8 == 0) {
                    for (int r = 0; r < xrows; r++) {
                        float part[PANEL];
                        exact_rows_any(types[s], row, row_bytes[s], count, cols, xf + (size_t)(r0 + r) * cols, part);
                        for (int o = 0; o < count; o++) dst[(size_t)r * total + o] = part[o];
                    }
                    continue;
                }
#endif
                for (int o = 0; o < count; o++) {
                    exact_weights_portable(types[s], &t, row + o * row_bytes[s], cols, w);
                    for (int r = 0; r < xrows; r++)
                        dst[(size_t)r * total + o] = exact_dot_portable(w, xf + (size_t)(r0 + r) * cols, cols);
                }
            }
            free(w);
        }
    }
#if defined(__AVX2__)
store:
#endif
    for (int n = 0; n < rows; n++)
        store_columns(sums + (size_t)n * total, dtype, 0, (int)total, columns, (char *)out + (size_t)n * total * es);
    free(xf);
    free(sums);
}
