// Helpers shared by the C kernels of this folder (core/cpu_kernels/__init__.py builds them into one library).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };
// a quantized KV pool's formats (core/kv/quant.py: the codes of a row, then its bf16 scales)
enum { KV_I8 = 3, KV_E4M3 = 4, KV_E5M2 = 5, KV_Q4 = 6 };
#define KV_Q4_GROUP 32

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

// x rounded to bf16 and read back (what a torch op writing bf16 keeps), NaN kept; vectorisable
static inline float round_bf16(float x) {
    uint32_t u = f32_to_bits(x);
    return (x != x) ? x : bits_to_f32((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u);
}

// x (n values, a power of two) <- x H / divisor, H the Sylvester Hadamard matrix (entries +-1, core/kv/quant.py's
// hadamard): the fast transform, log2(n) stages of sums and differences in fp32 (n log n additions where the matmul
// takes n^2; a power-of-two divisor is exact)
static inline void hadamard_row(float *x, int n, float divisor) {
    for (int h = 1; h < n; h <<= 1)
        for (int i = 0; i < n; i += 2 * h)
#pragma omp simd
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    if (divisor != 1.0f) {
        const float inv = 1.0f / divisor;
#pragma omp simd
        for (int i = 0; i < n; i++) x[i] *= inv;
    }
}

// exp(x), vectorisable: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 Taylor polynomial for exp(r) (truncation
// < 1e-8 relative), times 2^n built from its bits; x clamped to +-87 (exp(-87) ~ 1.6e-38 is still a normal number:
// softmax's and silu's tails come out 0 and x). Written out because glibc's vector expf needs -ffast-math, which
// GCC 12 links as process-wide flush-to-zero into shared libraries.
static inline float exp_clamped(float x) {
    x = x > 87.0f ? 87.0f : x;
    x = x < -87.0f ? -87.0f : x;
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

static inline size_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

static inline float half_at(const void *p) { _Float16 h; memcpy(&h, p, 2); return (float)h; }  // an fp16 at any address
static inline float bf16_at(const void *p) { uint16_t h; memcpy(&h, p, 2); return bits_to_f32((uint32_t)h << 16); }

// bytes of one stored KV row of D values: a full-precision dtype's, or a format's codes and fp16 scales
static inline size_t kv_row_bytes(int kv, int D) {
    if (kv <= F16) return (size_t)D * dtype_size(kv);
    return kv == KV_Q4 ? (size_t)D * 5 / 8 : (size_t)D + 2;  // q4: K's 5-bit codes; V's 4-bit codes, V's and K's scales
}

// an fp8 code -> fp32 (e4m3 is placed in fp16's bits at 2^-8 of its value, and the factor given back after)
static inline float fp8_value(uint8_t b, int kv) {
    const uint16_t bits = kv == KV_E5M2 ? (uint16_t)(b << 8) : (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7));
    _Float16 h;
    memcpy(&h, &bits, 2);
    return kv == KV_E5M2 ? (float)h : (float)h * 256.0f;
}

// the factor an 8-bit format's codes (as the SIMD loads return them) are multiplied by: the row's scale, for e4m3 times
// 2^8 (its codes are read as fp16 at 2^-8 of their value); 1 for the others (q4 applies its group scales itself)
static inline float kv_row_scale(const char *row, int kv, int D) {
    if (kv == KV_I8 || kv == KV_E5M2) return bf16_at(row + D);
    return kv == KV_E4M3 ? bf16_at(row + D) * 256.0f : 1.0f;
}

// q4's K scales: in the V row of the same token and head, after V's codes and V's scales (core/kv/quant.py)
static inline const char *q4_key_scales(const char *v_row, int D) { return v_row + D / 2 + 2 * (D / KV_Q4_GROUP); }

// one stored KV row (full precision or quantized) -> D fp32 values, exactly core/kv/quant.py's dequantize; key_v_row:
// for a q4 K row, the V row of its token and head (which holds K's scales), else NULL
static inline void load_kv_row(const char *row, const char *key_v_row, int kv, int D, float *dst) {
    if (kv <= F16) {
        load_row(row, kv, D, dst);
    } else if (kv == KV_Q4) {
        const uint8_t *b = (const uint8_t *)row, *fifth = key_v_row ? b + D / 2 : NULL;
        const char *scales = key_v_row ? q4_key_scales(key_v_row, D) : row + D / 2;
        const int low = key_v_row ? 16 : 8;  // K's codes have 5 bits, V's 4
        for (int i = 0; i < D; i++) {
            int code = (b[i / 2] >> (4 * (i & 1))) & 15;
            if (fifth) code |= ((fifth[i / 8] >> (i & 7)) & 1) << 4;
            dst[i] = (float)(code - low) * bf16_at(scales + 2 * (i / KV_Q4_GROUP));
        }
    } else {
        const float s = bf16_at(row + D);
        const uint8_t *b = (const uint8_t *)row;
        if (kv == KV_I8) {
#pragma omp simd
            for (int i = 0; i < D; i++) dst[i] = (float)(int8_t)b[i] * s;
        } else {
            for (int i = 0; i < D; i++) dst[i] = fp8_value(b[i], kv) * s;
        }
    }
}

// Scratch buffers aligned to 64 bytes: the compiler's vector loops then split them into the same head, body and
// tail on every thread, so a row's result does not depend on which thread computes it (nor on the batch around it).
static inline float *scratch_floats(size_t count) {
    return aligned_alloc(64, (count * sizeof(float) + 63) & ~(size_t)63);
}
