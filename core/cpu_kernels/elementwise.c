// Fused elementwise ops of the decoder layer on CPU, for bf16 models: one pass over the rows where torch takes
// several (each a pass over memory, with a conversion to fp32 and back). Each keeps the rounding steps of the
// torch path it replaces (core/layers/activation.py, core/layers/norm.py, core/layers/rotary.py): every value
// torch writes in bf16 is rounded to bf16 here too, so the results equal torch's except where an fp32 exp or a
// sum order moves a value across a rounding boundary. bf16 only: fp32 keeps torch's ops (bit-identical to the
// reference), and GCC 12 does not vectorise such loops over _Float16.
#include <math.h>

#include "common.h"

// out[t, i] = silu(x[t, i]) * x[t, inter + i]: x the fused gate_up projection [rows, 2 * inter] (row stride
// x_stride), out [rows, inter]. As torch: silu in fp32 rounded to bf16, the product rounded again.
void kvf_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t inter, int32_t threads) {
#pragma omp parallel num_threads(threads) if (rows * inter >= 32768)
    {
        float *gate = scratch_floats(inter), *up = scratch_floats(inter);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            const uint16_t *row = (const uint16_t *)x + t * x_stride;
            load_row(row, BF16, inter, gate);
            load_row(row + inter, BF16, inter, up);
#pragma omp simd
            for (int i = 0; i < inter; i++) gate[i] = round_bf16(gate[i] / (1.0f + exp_clamped(-gate[i]))) * up[i];
            store_row(gate, BF16, inter, (uint16_t *)out + t * inter);
        }
        free(gate);
        free(up);
    }
}

// RMSNorm with the residual add fused (residual may be NULL): sum = x + residual rounded to bf16 (written to
// sum_out unless NULL), out = weight * round(sum * rsqrt(mean(sum^2) + eps)), rounded. Rows contiguous, `hidden`
// values each.
void kvf_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *weight,
                      int64_t rows, int32_t hidden, float eps, int32_t threads) {
#pragma omp parallel num_threads(threads) if (rows * hidden >= 32768)
    {
        float *s = scratch_floats(hidden), *r = scratch_floats(hidden), *w = scratch_floats(hidden);
        load_row(weight, BF16, hidden, w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            load_row((const uint16_t *)x + t * hidden, BF16, hidden, s);
            if (residual != NULL) {
                load_row((const uint16_t *)residual + t * hidden, BF16, hidden, r);
#pragma omp simd
                for (int i = 0; i < hidden; i++) s[i] = round_bf16(s[i] + r[i]);
                if (sum_out != NULL) store_row(s, BF16, hidden, (uint16_t *)sum_out + t * hidden);
            }
            float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
            for (int i = 0; i < hidden; i++) squares += s[i] * s[i];
            const float rstd = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
            for (int i = 0; i < hidden; i++) r[i] = w[i] * round_bf16(s[i] * rstd);
            store_row(r, BF16, hidden, (uint16_t *)out + t * hidden);
        }
        free(s);
        free(r);
        free(w);
    }
}

// Rotary embedding in place: x [rows, heads, D] with row stride x_stride and head stride D (elements); cos, sin
// [rows, D] contiguous. As torch's apply_rotary: x * cos + rotate_half(x) * sin, each product and the sum rounded
// to bf16 (rotate_half(x) = (-x[D/2:], x[:D/2])).
void kvf_rotary(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows, int32_t heads,
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
