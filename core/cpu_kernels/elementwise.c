// Fused elementwise ops of the decoder layer on CPU: one pass over the rows where torch takes several (each a
// pass over memory, in bf16 with a conversion to fp32 and back, and each op's dispatch: ~20-30 us a call on a
// decode step's one row, where the kernel takes a few). In bf16 each keeps the rounding steps of the torch path it
// replaces (core/layers/activation.py, core/layers/norm.py, core/layers/rotary.py): every value torch writes in
// bf16 is rounded to bf16 here too, so the results equal torch's except where an fp32 exp or a sum order moves a
// value across a rounding boundary. In fp32 rotary equals torch's bit for bit (products and sum rounded as torch
// rounds them: no fused multiply-add, see below); SiLU's exp and RMSNorm's sum order differ from torch's in the
// last bits, so the layers take those two in fp32 only where the model's linears are not exact anyway
// (core/layers/backend.py). fp16 is not offered: GCC 12 does not vectorise such loops over _Float16.
#include <math.h>
#include <string.h>

#include "common.h"

// what torch keeps of a value it writes in the tensor's dtype: bf16's rounding, or the fp32 value itself
#define KEPT(dtype, v) ((dtype) == BF16 ? round_bf16(v) : (v))

// out[t, i] = silu(x[t, i]) * x[t, inter + i]: x the fused gate_up projection [rows, 2 * inter] (row stride
// x_stride, elements), out [rows, inter]. As torch: silu in fp32 (kept in the dtype), times up, kept again.
void kvf_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t inter, int32_t dtype,
                      int32_t threads) {
    const size_t size = dtype_size(dtype);
#pragma omp parallel num_threads(threads) if (rows * inter >= 32768)
    {
        float *gate = scratch_floats(inter), *up = scratch_floats(inter);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            const char *row = (const char *)x + t * x_stride * size;
            load_row(row, dtype, inter, gate);
            load_row(row + inter * size, dtype, inter, up);
            // one loop per dtype, not KEPT: with the choice inside, GCC leaves this loop (and the residual add's
            // below) scalar (SiLU of 8192 values 20 -> 42 us)
            if (dtype == BF16) {
#pragma omp simd
                for (int i = 0; i < inter; i++) gate[i] = round_bf16(gate[i] / (1.0f + exp_clamped(-gate[i]))) * up[i];
            } else {
#pragma omp simd
                for (int i = 0; i < inter; i++) gate[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
            }
            store_row(gate, dtype, inter, (char *)out + t * inter * size);
        }
        free(gate);
        free(up);
    }
}

// RMSNorm with the residual add fused (residual may be NULL): sum = x + residual kept in the dtype (written to
// sum_out unless NULL), out = weight * kept(sum * rsqrt(mean(sum^2) + eps)), kept. Rows contiguous, `hidden`
// values each; the weight in the same dtype.
void kvf_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *weight,
                      int64_t rows, int32_t hidden, float eps, int32_t dtype, int32_t threads) {
    const size_t size = dtype_size(dtype);
#pragma omp parallel num_threads(threads) if (rows * hidden >= 32768)
    {
        float *s = scratch_floats(hidden), *r = scratch_floats(hidden), *w = scratch_floats(hidden);
        load_row(weight, dtype, hidden, w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            load_row((const char *)x + t * hidden * size, dtype, hidden, s);
            if (residual != NULL) {
                load_row((const char *)residual + t * hidden * size, dtype, hidden, r);
                if (dtype == BF16) {
#pragma omp simd
                    for (int i = 0; i < hidden; i++) s[i] = round_bf16(s[i] + r[i]);
                } else {
#pragma omp simd
                    for (int i = 0; i < hidden; i++) s[i] += r[i];
                }
                if (sum_out != NULL) store_row(s, dtype, hidden, (char *)sum_out + t * hidden * size);
            }
            float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
            for (int i = 0; i < hidden; i++) squares += s[i] * s[i];
            const float rstd = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
            for (int i = 0; i < hidden; i++) r[i] = w[i] * KEPT(dtype, s[i] * rstd);
            store_row(r, dtype, hidden, (char *)out + t * hidden * size);
        }
        free(s);
        free(r);
        free(w);
    }
}

// Rotary embedding in place: x [rows, heads, D] with row stride x_stride and head stride D (elements); cos, sin
// [rows, D] contiguous. As torch's apply_rotary: x * cos + rotate_half(x) * sin, each product and the sum kept in
// the dtype (rotate_half(x) = (-x[D/2:], x[:D/2])). The products go through memory (p, q) and are summed in a loop
// of their own: written as one expression GCC would fuse a product into the sum (an FMA rounds once where torch
// rounds twice), and fp32 would no longer equal torch's bits.
void kvf_rotary(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows, int32_t heads,
                int32_t head_dim, int32_t dtype, int32_t threads) {
    const int half = head_dim / 2;
    const size_t size = dtype_size(dtype);
#pragma omp parallel num_threads(threads) if (rows * heads * head_dim >= 32768)
    {
        float *c = scratch_floats(head_dim), *s = scratch_floats(head_dim), *v = scratch_floats(head_dim),
              *p = scratch_floats(head_dim), *q = scratch_floats(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            load_row((const char *)cos + t * head_dim * size, dtype, head_dim, c);
            load_row((const char *)sin + t * head_dim * size, dtype, head_dim, s);
            for (int h = 0; h < heads; h++) {
                char *row = (char *)x + (t * x_stride + (int64_t)h * head_dim) * size;
                load_row(row, dtype, head_dim, v);
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    p[i] = KEPT(dtype, v[i] * c[i]);
                    q[i] = KEPT(dtype, -v[i + half] * s[i]);
                }
#pragma omp simd
                for (int i = half; i < head_dim; i++) {
                    p[i] = KEPT(dtype, v[i] * c[i]);
                    q[i] = KEPT(dtype, v[i - half] * s[i]);
                }
#pragma omp simd
                for (int i = 0; i < head_dim; i++) p[i] = KEPT(dtype, p[i] + q[i]);
                store_row(p, dtype, head_dim, row);
            }
        }
        free(c);
        free(s);
        free(v);
        free(p);
        free(q);
    }
}

// fp32 -> fp8 e4m3fn / e5m2 code, rounding to nearest even: c10's conversions (torch's .to(float8_*)), for values
// already within the format's range
static inline uint8_t fp8_code(float f, int kv) {
    const int e4m3 = kv == KV_E4M3;
    uint32_t bits = f32_to_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t code;
    if (bits >= (e4m3 ? (1087u << 20) : (143u << 23))) {  // beyond the largest finite value (not reached: clamped)
        code = e4m3 ? 0x7F : 0x7C;
    } else if (bits < (e4m3 ? (121u << 23) : (113u << 23))) {  // a subnormal code: fp32 addition rounds it
        const uint32_t denorm = e4m3 ? (141u << 23) : (134u << 23);
        code = (uint8_t)(f32_to_bits(bits_to_f32(bits) + bits_to_f32(denorm)) - denorm);
    } else {
        const int shift = e4m3 ? 20 : 21;
        const uint32_t odd = (bits >> shift) & 1;
        bits += (e4m3 ? ((uint32_t)(7 - 127) << 23) + 0x7FFFF : ((uint32_t)(15 - 127) << 23) + 0xFFFFF) + odd;
        code = (uint8_t)(bits >> shift);
    }
    return code | (uint8_t)(sign >> 24);
}

// x rounded to bf16 (to nearest even, as torch) and written at dst; returns the rounded value
static inline float store_bf16(float x, uint8_t *dst) {
    store_row(&x, BF16, 1, dst);
    return bf16_at(dst);
}

// one row of D fp32 values -> its codes and scales in quantized format kv, exactly core/kv/quant.py's quantize: q4's
// codes are `bits` wide (K 5, V 4: the low nibbles, then for 5 bits one byte of fifth bits per 8 values); scales go to
// `scales` (an 8-bit format's right after its codes)
static void quantize_row(const float *x, int D, int kv, int bits, uint8_t *out, uint8_t *scales) {
    const int size = kv == KV_Q4 ? KV_Q4_GROUP : D;
    const float limit = kv == KV_I8 ? 127.0f : kv == KV_E4M3 ? 448.0f : 57344.0f, low = (float)(1 << (bits - 1));
    if (kv == KV_Q4) memset(out, 0, (size_t)D * bits / 8);
    for (int g = 0; g < D / size; g++) {
        const float *xg = x + g * size;
        float wide;
        if (kv == KV_Q4) {  // the value of largest magnitude (the first of equals) maps to the lowest code
            float biggest = xg[0];
            for (int i = 1; i < size; i++) biggest = fabsf(xg[i]) > fabsf(biggest) ? xg[i] : biggest;
            wide = store_bf16(biggest / -low, scales + 2 * g);
        } else {
            float amax = 0.0f;
            for (int i = 0; i < size; i++) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
            wide = store_bf16(amax / limit, scales + 2 * g);
        }
        const float divisor = wide == 0.0f ? 1.0f : wide;
        for (int i = 0; i < size; i++) {
            const float y = xg[i] / divisor;
            const int at = g * size + i;
            if (kv == KV_I8) {
                const float r = rintf(y);
                out[at] = (uint8_t)(int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            } else if (kv == KV_Q4) {
                const float r = rintf(y);
                const uint8_t c = (uint8_t)((r > low - 1.0f ? low - 1.0f : r < -low ? -low : r) + low);
                out[at / 2] |= (uint8_t)((c & 15) << (4 * (at & 1)));
                if (bits == 5) out[D / 2 + at / 8] |= (uint8_t)((c >> 4) << (at & 7));
            } else {
                out[at] = fp8_code(y > limit ? limit : y < -limit ? -limit : y, kv);
            }
        }
    }
}

// A new K or V row -> fp32 in `row`; `rotate`: times the Hadamard matrix (hadamard_row) and rounded once to the model's
// dtype through `rounded`, as the attention layer's torch rotation (layers/attention.py _rotated) rounds its output
static inline void load_source_row(const char *src, int dtype, int D, int rotate, char *rounded, float *row) {
    load_row(src, dtype, D, row);
    if (rotate) {
        hadamard_row(row, D, 1.0f);
        store_row(row, dtype, D, rounded);
        load_row(rounded, dtype, D, row);
    }
}

// an fp32 row into a pool row of storage `kv`: a full-precision pool's dtype, or an 8-bit format's codes + scale
static inline void store_kv_row(const float *row, int D, int kv, int dtype, char *dst) {
    if (kv <= F16)
        store_row(row, dtype, D, dst);
    else
        quantize_row(row, D, kv, 8, (uint8_t *)dst, (uint8_t *)dst + D);
}

// The step's new K and V written into one layer's paged cache: k, v [tokens, kv_heads, D] (row strides in elements;
// heads contiguous within a row, e.g. the columns of a fused qkv output), rows[(plane * tokens + t) * kv_heads + h]
// the cache row ([2 * kv_heads * slots, row bytes] view) of token t's head h, plane 0 K, 1 V; kv: the cache's storage
// (dtype: copied; a quantized format: each row quantized on its own). torch's stack + index_copy_ took ~18 us a layer
// for one token; this is a few hundred bytes copied. rotate: each row times the Hadamard matrix first (q4's pools
// hold rotated rows; the attention layer's rotation in torch took 7 us a call).
void kvf_store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *cache, const int64_t *rows,
                  int64_t tokens, int32_t kv_heads, int32_t head_dim, int32_t dtype, int32_t kv, int32_t rotate) {
    const size_t size = dtype_size(dtype), bytes = kv_row_bytes(kv, head_dim);
    float *row = kv > F16 || rotate ? scratch_floats((size_t)head_dim) : NULL;
    char *rounded = rotate ? malloc((size_t)head_dim * size) : NULL;
    for (int64_t t = 0; t < tokens; t++)
        for (int h = 0; h < kv_heads; h++) {  // K then V of one token's head: q4's V row also holds K's scales
            char *k_dst = (char *)cache + rows[t * kv_heads + h] * bytes;
            char *v_dst = (char *)cache + rows[(tokens + t) * kv_heads + h] * bytes;
            const char *k_src = (const char *)k + (t * k_stride + (int64_t)h * head_dim) * size;
            const char *v_src = (const char *)v + (t * v_stride + (int64_t)h * head_dim) * size;
            if (row == NULL) {
                memcpy(k_dst, k_src, bytes);
                memcpy(v_dst, v_src, bytes);
            } else if (kv == KV_Q4) {
                const size_t scales = (size_t)head_dim / 2;  // V's scales, then K's, after V's codes
                load_source_row(v_src, dtype, head_dim, rotate, rounded, row);
                quantize_row(row, head_dim, kv, 4, (uint8_t *)v_dst, (uint8_t *)v_dst + scales);
                load_source_row(k_src, dtype, head_dim, rotate, rounded, row);
                quantize_row(row, head_dim, kv, 5, (uint8_t *)k_dst,
                             (uint8_t *)v_dst + scales + 2 * (size_t)(head_dim / KV_Q4_GROUP));
            } else {
                load_source_row(k_src, dtype, head_dim, rotate, rounded, row);
                store_kv_row(row, head_dim, kv, dtype, k_dst);
                load_source_row(v_src, dtype, head_dim, rotate, rounded, row);
                store_kv_row(row, head_dim, kv, dtype, v_dst);
            }
        }
    free(row);
    free(rounded);
}

// ---- a mixture-of-experts step's bookkeeping (core/layers/moe.py): one pass each where torch takes ~10 ops ----

// The step's (token, slot) pairs grouped by expert, in pair order within an expert (torch's argsort(stable) and
// bincount): `experts` [pairs] (pair p = token p / k, slot p % k) -> tokens [pairs] (each grouped pair's token),
// sorted_weights [pairs] (its router weight, `weights` [pairs] in `dtype`, copied), starts [num_experts + 1]. Returns
// the most pairs one expert has, or -1 (nothing written) where an id is outside [0, num_experts).
int32_t kvf_moe_group(const int64_t *experts, const void *weights, int64_t pairs, int32_t k, int32_t num_experts,
                      int32_t dtype, int64_t *tokens, void *sorted_weights, int64_t *starts) {
    const size_t size = dtype_size(dtype);
    for (int64_t p = 0; p < pairs; p++)
        if (experts[p] < 0 || experts[p] >= num_experts)
            return -1;
    memset(starts, 0, sizeof(int64_t) * (num_experts + 1));
    for (int64_t p = 0; p < pairs; p++) starts[experts[p] + 1]++;
    int64_t widest = 0;
    for (int e = 0; e < num_experts; e++) {
        widest = starts[e + 1] > widest ? starts[e + 1] : widest;
        starts[e + 1] += starts[e];
    }
    int64_t *next = malloc(sizeof(int64_t) * (num_experts > 0 ? num_experts : 1));
    memcpy(next, starts, sizeof(int64_t) * num_experts);
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = next[experts[p]]++;
        tokens[at] = p / k;
        memcpy((char *)sorted_weights + at * size, (const char *)weights + p * size, size);
    }
    free(next);
    return (int32_t)widest;
}

// out[tokens[p]] += y[p] * w[p] for p in order (out [.., hidden] zeroed by the caller, y [pairs, hidden], w [pairs],
// all `dtype`), pairs grouped by expert: as transformers' loop, `index_add_` of `y * w` once per expert in expert
// order, so each product and each token's running sum is kept in the dtype (a token meets each expert once). The
// products go through memory, not into an FMA with the sum (torch rounds them apart). Returns 0, or -1 (nothing written) where a token is outside [0, num_tokens).
int32_t kvf_moe_combine(const void *y, const void *w, const int64_t *tokens, int64_t pairs, int32_t hidden,
                        int32_t dtype, int64_t num_tokens, void *out) {
    const size_t size = dtype_size(dtype);
    for (int64_t p = 0; p < pairs; p++)
        if (tokens[p] < 0 || tokens[p] >= num_tokens)
            return -1;
    float *product = scratch_floats(hidden), *sum = scratch_floats(hidden), *weight = scratch_floats(1);
    for (int64_t p = 0; p < pairs; p++) {
        load_row((const char *)w + p * size, dtype, 1, weight);
        load_row((const char *)y + p * hidden * size, dtype, hidden, product);
        const float scale = weight[0];
        if (dtype == BF16) {
#pragma omp simd
            for (int i = 0; i < hidden; i++) product[i] = round_bf16(product[i] * scale);
        } else if (dtype == F16) {
            for (int i = 0; i < hidden; i++) product[i] = (float)(_Float16)(product[i] * scale);
        } else {
#pragma omp simd
            for (int i = 0; i < hidden; i++) product[i] *= scale;
        }
        char *row = (char *)out + tokens[p] * hidden * size;
        load_row(row, dtype, hidden, sum);
#pragma omp simd
        for (int i = 0; i < hidden; i++) sum[i] += product[i];
        store_row(sum, dtype, hidden, row);
    }
    free(product);
    free(sum);
    free(weight);
    return 0;
}
