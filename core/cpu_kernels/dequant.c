// Quantized weights of the gguf plugin (plugins/quant/gguf.py). 4-bit ones dequantized to bf16 for a large-batch
// matmul: torch's int4 matmul is fastest for a few rows, but at a batch or a prefill chunk it recomputes each weight
// for every few rows, so there the weight is expanded once per call and multiplied by oneDNN's bf16 GEMM. The other
// types (5-8 bits) as int8 codes: a matmul reading the codes for a few rows, expanded to bf16 for many.
#include "common.h"

// out[n, k] = bf16((q - 8) * scale + zero), q the 4-bit code of (n, k): codes [rows, cols / 2], per group of 32
// columns 16 bytes, byte j holding column j (low nibble) and column j + 16 (high nibble); scales_zeros bf16
// [cols / 32, rows, 2] (torch's int4 layout: scale, zero). `out` bf16 [rows, cols].
void kvf_dequant_int4(const uint8_t *codes, const uint16_t *scales_zeros, uint16_t *out, int64_t rows, int32_t cols,
                      int32_t threads) {
    const int groups = cols / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *c = codes + r * (cols / 2);
        uint16_t *o = out + r * cols;
        for (int g = 0; g < groups; g++) {
            const uint16_t *sz = scales_zeros + ((int64_t)g * rows + r) * 2;
            const float scale = bits_to_f32((uint32_t)sz[0] << 16), zero = bits_to_f32((uint32_t)sz[1] << 16);
            const uint8_t *b = c + g * 16;
            uint16_t *dst = o + g * 32;
#pragma omp simd
            for (int j = 0; j < 16; j++) {
                const float lo = ((float)(b[j] & 15) - 8.0f) * scale + zero;
                const float hi = ((float)(b[j] >> 4) - 8.0f) * scale + zero;
                const uint32_t ul = f32_to_bits(lo), uh = f32_to_bits(hi);
                dst[j] = (uint16_t)((ul + 0x7FFF + ((ul >> 16) & 1)) >> 16);
                dst[j + 16] = (uint16_t)((uh + 0x7FFF + ((uh >> 16) & 1)) >> 16);
            }
        }
    }
}

// ---- int8 codes with a scale and an offset per group of input features (the gguf plugin's other types) ----
// W[o, k] = codes[o, k] * scales[o, k / group] + offsets[o, k / group] (offsets NULL: none); codes [outs, cols],
// scales / offsets fp32 [outs, cols / group], all contiguous.

// one weight row in fp32 (w: cols floats)
static inline void int8_row(const int8_t *c, const float *s, const float *z, int cols, int group, float *w) {
    for (int g = 0; g < cols / group; g++) {
        const float scale = s[g], offset = z ? z[g] : 0.0f;
#pragma omp simd
        for (int j = 0; j < group; j++) w[g * group + j] = (float)c[g * group + j] * scale + offset;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define INT8_ROWS 4  // rows of x per pass over the weight rows
#define INT8_OUTS 4  // weight rows at once: 16 independent fma chains (one alone waits on its own latency)

// sums[n * INT8_OUTS + j] = W[o + j] . x[n] for rows [0, rows), j < INT8_OUTS; group a multiple of 16: each 16 codes
// widened to fp32, scaled and offset in one fma, then one fma per row of x
static void int8_dot_avx512(const int8_t *c, const float *s, const float *z, int cols, int group, const float *xf,
                            int rows, float *sums) {
    const int groups = cols / group;
    for (int n0 = 0; n0 < rows; n0 += INT8_ROWS) {
        const int nn = rows - n0 < INT8_ROWS ? rows - n0 : INT8_ROWS;
        __m512 acc[INT8_OUTS][INT8_ROWS];
        for (int j = 0; j < INT8_OUTS; j++)
            for (int n = 0; n < INT8_ROWS; n++) acc[j][n] = _mm512_setzero_ps();
        for (int k = 0; k < cols; k += 16) {
            const int g = k / group;
            __m512 xv[INT8_ROWS];
            for (int n = 0; n < INT8_ROWS; n++)
                xv[n] = n < nn ? _mm512_loadu_ps(xf + (size_t)(n0 + n) * cols + k) : _mm512_setzero_ps();
            if (k % 64 == 0)  // the next block's rows, a cache line each step (measured: 9.5 -> ms at a 262144 x 640 head)
                for (int j = 0; j < INT8_OUTS; j++)
                    _mm_prefetch((const char *)(c + (size_t)(INT8_OUTS + j) * cols + k), _MM_HINT_T0);
            for (int j = 0; j < INT8_OUTS; j++) {
                const size_t sg = (size_t)j * groups + g;
                const __m512 w = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + (size_t)j * cols + k)))),
                    _mm512_set1_ps(s[sg]), _mm512_set1_ps(z ? z[sg] : 0.0f));
                for (int n = 0; n < INT8_ROWS; n++)
                    if (n < nn) acc[j][n] = _mm512_fmadd_ps(w, xv[n], acc[j][n]);
            }
        }
        for (int n = 0; n < nn; n++)
            for (int j = 0; j < INT8_OUTS; j++) sums[(size_t)(n0 + n) * INT8_OUTS + j] = _mm512_reduce_add_ps(acc[j][n]);
    }
}
#endif

// out[n, o] = sum_k x[n, k] W[o, k] for the `rows` rows of x (row stride x_stride elements; x and out of `dtype`,
// out contiguous [rows, outs]), fp32 math: memory traffic is the codes (1 byte per weight) and scales, not a bf16
// copy (2 bytes), and a decode step's matmuls are bound by it. A row's result depends on that row alone (not on
// the batch around it).
void kvf_int8_linear(const void *x, int64_t x_stride, void *out, const int8_t *codes, const float *scales,
                     const float *offsets, int32_t rows, int64_t outs, int32_t cols, int32_t group, int32_t dtype,
                     int32_t threads) {
    const size_t es = dtype_size(dtype);
    const int groups = cols / group;
    float *xf = scratch_floats((size_t)rows * cols);
    for (int n = 0; n < rows; n++) load_row((const char *)x + (size_t)n * x_stride * es, dtype, cols, xf + (size_t)n * cols);
#pragma omp parallel num_threads(threads)
    {
        float *w = scratch_floats((size_t)cols);
        float *sums = scratch_floats((size_t)rows * 4);
#if defined(__AVX512F__)
        const int64_t blocked = group % 16 == 0 ? outs / INT8_OUTS * INT8_OUTS : 0;
#pragma omp for schedule(static)
        for (int64_t o = 0; o < blocked; o += INT8_OUTS) {
            int8_dot_avx512(codes + o * cols, scales + o * groups, offsets ? offsets + o * groups : NULL, cols, group,
                            xf, rows, sums);
            for (int n = 0; n < rows; n++)
                store_row(sums + (size_t)n * INT8_OUTS, dtype, INT8_OUTS, (char *)out + ((size_t)n * outs + o) * es);
        }
#else
        const int64_t blocked = 0;
#endif
#pragma omp for schedule(static)
        for (int64_t o = blocked; o < outs; o++) {  // the portable loop (and what the blocks leave)
            int8_row(codes + o * cols, scales + o * groups, offsets ? offsets + o * groups : NULL, cols, group, w);
            for (int n = 0; n < rows; n++) {
                const float *xr = xf + (size_t)n * cols;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int k = 0; k < cols; k++) acc += w[k] * xr[k];
                sums[n] = acc;
            }
            for (int n = 0; n < rows; n++) store_row(sums + n, dtype, 1, (char *)out + ((size_t)n * outs + o) * es);
        }
        free(w);
        free(sums);
    }
    free(xf);
}

// the bf16 weight [outs, cols] (for a large batch: expanded once per call, then oneDNN's bf16 GEMM)
void kvf_dequant_int8(const int8_t *codes, const float *scales, const float *offsets, uint16_t *out, int64_t outs,
                      int32_t cols, int32_t group, int32_t threads) {
    const int groups = cols / group;
#pragma omp parallel num_threads(threads)
    {
        float *w = scratch_floats((size_t)cols);
#pragma omp for schedule(static)
        for (int64_t o = 0; o < outs; o++) {
            int8_row(codes + o * cols, scales + o * groups, offsets ? offsets + o * groups : NULL, cols, group, w);
            store_row(w, BF16, cols, out + o * cols);
        }
        free(w);
    }
}
