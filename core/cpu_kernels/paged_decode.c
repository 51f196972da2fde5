// Paged decode attention on CPU: one query token per sequence over its paged KV cache, read in place.
// Built and loaded by core/cpu_kernels/__init__.py (plain C with OpenMP, called through ctypes: no torch
// headers, so it compiles in about a second at first use).
//
// Layout (one layer), as core/kernels/paged_decode.py: cache [2, KVH, NB, BS, D], K then V, head-major and
// paged; sequence b's token t lives in block tables[b * width + t / BS] at slot t % BS. lens[b] = L counts
// the context including the new token; the query sees keys [max(0, L - window), L) (window 0: all).
// Query head i uses KV head i / G, G = H / KVH; one work item is one (sequence, KV head) with its G queries,
// so each K/V row is read once for the group.
// Math in fp32 whatever the storage dtype, in the order of the torch "bmm" variant: q * scale, dot
// products, softmax (max, exp, sum, normalise), weighted sum of values, rounded once to the output dtype.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// one row of `n` values stored as `dtype` -> fp32
static inline void load_row(const void *src, int dtype, int n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bits_to_f32((uint32_t)s[i] << 16);
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

// fp32 -> storage dtype, rounding to nearest even as torch's .to() does
static inline void store_row(const float *src, int dtype, int n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) {
            uint32_t u = f32_to_bits(src[i]);
            d[i] = (src[i] != src[i]) ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

// exp(x) for x <= 0 (a score minus the row's maximum), vectorisable: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-7 Taylor polynomial for exp(r) (truncation < 1e-8 relative), times 2^n built from its bits.
// Written out because glibc's vector expf needs -ffast-math, which GCC 12 links as process-wide
// flush-to-zero into shared libraries.
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: still a normal number
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693145751953125f;  // ln2 in two parts (Cody-Waite): r exact to fp32
    r = r - n * 1.42860682030941723e-06f;
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * bits_to_f32((uint32_t)((int32_t)n + 127) << 23);
}

static size_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

// One (sequence, KV head) item with its G queries; D is a compile-time constant in the specialised copies below
// (the d loops unroll and stay in registers). Walks the context block by block (no division per token).
static inline __attribute__((always_inline)) void attend(
        const char *q_row, const char *k_plane, const char *v_plane, const int32_t *table, int L, int first, int G,
        const int D, int block_size, float scale, int dtype, size_t es, float *qf, float *acc, float *row,
        float *scores) {
    const int n = L - first;
    for (int g = 0; g < G; g++) {
        load_row(q_row + (size_t)g * D * es, dtype, D, qf + g * D);
        for (int d = 0; d < D; d++) qf[g * D + d] *= scale;
    }
    for (int t = first; t < L;) {  // scores[g][t - first] = q_g . k_t
        const int offset = t % block_size, end = t - offset + block_size < L ? t - offset + block_size : L;
        const char *k = k_plane + ((size_t)table[t / block_size] * block_size + offset) * D * es;
        for (; t < end; t++, k += D * es) {
            load_row(k, dtype, D, row);
            for (int g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qg[d] * row[d];
                scores[g * n + (t - first)] = s;
            }
        }
    }
    for (int g = 0; g < G; g++) {  // softmax over the visible keys
        float *s = scores + (size_t)g * n, m = s[0], sum = 0.0f;
        for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; i++) {
            s[i] = exp_nonpositive(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int i = 0; i < n; i++) s[i] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int t = first; t < L;) {  // acc[g] = sum_t p[g][t] v_t
        const int offset = t % block_size, end = t - offset + block_size < L ? t - offset + block_size : L;
        const char *v = v_plane + ((size_t)table[t / block_size] * block_size + offset) * D * es;
        for (; t < end; t++, v += D * es) {
            load_row(v, dtype, D, row);
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * n + (t - first)];
                float *a = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += p * row[d];
            }
        }
    }
}

#define ATTEND_WITH_HEAD_DIM(name, HEAD_DIM)                                                                      \
    static void name(const char *q_row, const char *k_plane, const char *v_plane, const int32_t *table, int L,   \
                     int first, int G, int D, int block_size, float scale, int dtype, size_t es, float *qf,       \
                     float *acc, float *row, float *scores) {                                                     \
        attend(q_row, k_plane, v_plane, table, L, first, G, HEAD_DIM, block_size, scale, dtype, es, qf, acc, row, \
               scores);                                                                                           \
    }
ATTEND_WITH_HEAD_DIM(attend_64, 64)
ATTEND_WITH_HEAD_DIM(attend_128, 128)
ATTEND_WITH_HEAD_DIM(attend_256, 256)
ATTEND_WITH_HEAD_DIM(attend_any, D)

// q: [B] rows of H * D values, row stride q_stride (elements); out: [B, H * D] contiguous.
void kvf_paged_decode(const void *q, int64_t q_stride, void *out, const void *cache, const int32_t *tables,
                      const int32_t *lens, int32_t batch, int32_t heads, int32_t kv_heads, int32_t head_dim,
                      int32_t num_blocks, int32_t block_size, int32_t width, float scale, int32_t window,
                      int32_t dtype, int32_t threads) {
    const int G = heads / kv_heads, D = head_dim;
    const size_t es = dtype_size(dtype);
    const size_t plane = (size_t)num_blocks * block_size * D;  // elements of one (K/V, KV head) plane
    int max_len = 0;
    for (int b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    void (*run)(const char *, const char *, const char *, const int32_t *, int, int, int, int, int, float, int,
                size_t, float *, float *, float *, float *) =
        D == 64 ? attend_64 : D == 128 ? attend_128 : D == 256 ? attend_256 : attend_any;

#pragma omp parallel num_threads(threads)
    {
        float *qf = malloc(sizeof(float) * (size_t)G * D);
        float *acc = malloc(sizeof(float) * (size_t)G * D);
        float *row = malloc(sizeof(float) * (size_t)D);
        float *scores = malloc(sizeof(float) * (size_t)G * (max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < batch * kv_heads; item++) {
            const int b = item / kv_heads, h = item % kv_heads, L = lens[b];
            if (L <= 0) {  // a padding row: zeros
                memset(acc, 0, sizeof(float) * (size_t)G * D);
            } else {
                const int first = (window > 0 && L > window) ? L - window : 0;
                run((const char *)q + ((size_t)b * q_stride + (size_t)h * G * D) * es,
                    (const char *)cache + (size_t)h * plane * es, (const char *)cache + (size_t)(kv_heads + h) * plane * es,
                    tables + (size_t)b * width, L, first, G, D, block_size, scale, dtype, es, qf, acc, row, scores);
            }
            store_row(acc, dtype, G * D, (char *)out + ((size_t)b * heads + (size_t)h * G) * D * es);
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
    }
}
