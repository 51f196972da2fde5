// Fused elementwise ops of the decoder layer on CPU, for bf16 / fp16 models: one pass over the rows where torch
// takes several (each a pass over memory, with a conversion to fp32 and back). Each keeps the rounding steps of
// the torch path it replaces (core/layers/activation.py, core/layers/norm.py): every value torch writes in the
// model dtype is rounded to it here too, so the results differ from torch's only where an fp32 exp or a sum
// order moves a value across a rounding boundary.
#include <math.h>

#include "common.h"

// out[t, i] = silu(x[t, i]) * x[t, inter + i]: x the fused gate_up projection [rows, 2 * inter] (row stride
// x_stride), out [rows, inter]. As torch: silu in fp32 rounded to the dtype, the product rounded again.
void kvf_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t inter, int32_t dtype,
                      int32_t threads) {
    const size_t es = dtype_size(dtype);
#pragma omp parallel num_threads(threads) if (rows * inter >= 32768)
    {
        float *gate = scratch_floats(inter), *up = scratch_floats(inter);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            const char *row = (const char *)x + (size_t)t * x_stride * es;
            load_row(row, dtype, inter, gate);
            load_row(row + (size_t)inter * es, dtype, inter, up);
            if (dtype == BF16) {
#pragma omp simd
                for (int i = 0; i < inter; i++) gate[i] = round_bf16(gate[i] / (1.0f + exp_clamped(-gate[i]))) * up[i];
            } else {
#pragma omp simd
                for (int i = 0; i < inter; i++) gate[i] = round_f16(gate[i] / (1.0f + exp_clamped(-gate[i]))) * up[i];
            }
            store_row(gate, dtype, inter, (char *)out + (size_t)t * inter * es);
        }
        free(gate);
        free(up);
    }
}

// RMSNorm with the residual add fused (residual may be NULL): sum = x + residual rounded to the dtype (written to
// sum_out unless NULL), out = weight * round(sum * rsqrt(mean(sum^2) + eps)), rounded. Rows contiguous, `hidden`
// values each.
void kvf_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *weight,
                      int64_t rows, int32_t hidden, float eps, int32_t dtype, int32_t threads) {
    const size_t es = dtype_size(dtype), row_bytes = (size_t)hidden * es;
#pragma omp parallel num_threads(threads) if (rows * hidden >= 32768)
    {
        float *s = scratch_floats(hidden), *r = scratch_floats(hidden), *w = scratch_floats(hidden);
        load_row(weight, dtype, hidden, w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            load_row((const char *)x + t * row_bytes, dtype, hidden, s);
            if (residual != NULL) {
                load_row((const char *)residual + t * row_bytes, dtype, hidden, r);
                if (dtype == BF16) {
#pragma omp simd
                    for (int i = 0; i < hidden; i++) s[i] = round_bf16(s[i] + r[i]);
                } else {
#pragma omp simd
                    for (int i = 0; i < hidden; i++) s[i] = round_f16(s[i] + r[i]);
                }
                if (sum_out != NULL) store_row(s, dtype, hidden, (char *)sum_out + t * row_bytes);
            }
            float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
            for (int i = 0; i < hidden; i++) squares += s[i] * s[i];
            const float rstd = 1.0f / sqrtf(squares / (float)hidden + eps);
            if (dtype == BF16) {
#pragma omp simd
                for (int i = 0; i < hidden; i++) r[i] = w[i] * round_bf16(s[i] * rstd);
            } else {
#pragma omp simd
                for (int i = 0; i < hidden; i++) r[i] = w[i] * round_f16(s[i] * rstd);
            }
            store_row(r, dtype, hidden, (char *)out + t * row_bytes);
        }
        free(s);
        free(r);
        free(w);
    }
}

// Rotary embedding in place, bf16: x [rows, heads, D] with row stride x_stride and head stride D (elements);
// cos, sin [rows, D] contiguous. As torch's apply_rotary: x * cos + rotate_half(x) * sin, each product and the
// sum rounded to bf16 (rotate_half(x) = (-x[D/2:], x[:D/2])).
void kvf_rotary_bf16(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows, int32_t heads,
                     int32_t head_dim, int32_t threads) {
    const int half = head_dim / 2;
#pragma omp parallel num_threads(threads) if (rows * heads * head_dim >= 32768)
    {
        float *c = scratch_floats(head_dim), *s = scratch_floats(head_dim), *v = scratch_floats(head_dim),
              *o = scratch_floats(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            load_row((const uint16_t *)cos + t * head_dim, BF16, head_dim, c);
            load_row((const uint16_t *)sin + t * head_dim, BF16, head_dim, s);
            for (int h = 0; h < heads; h++) {
                uint16_t *row = (uint16_t *)x + t * x_stride + (size_t)h * head_dim;
                load_row(row, BF16, head_dim, v);
#pragma omp simd
                for (int i = 0; i < half; i++)
                    o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]));
#pragma omp simd
                for (int i = half; i < head_dim; i++)
                    o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(v[i - half] * s[i]));
                store_row(o, BF16, head_dim, row);
            }
        }
        free(c);
        free(s);
        free(v);
        free(o);
    }
}
