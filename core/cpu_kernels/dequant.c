// 4-bit weights dequantized to bf16 for a large-batch matmul (plugins/quant/gguf.py): torch's int4 matmul is
// fastest for a few rows, but at a batch or a prefill chunk it recomputes each weight for every few rows, so
// there the weight is expanded once per call and multiplied by oneDNN's bf16 GEMM.
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
