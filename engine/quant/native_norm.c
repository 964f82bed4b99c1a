/* RMSNorm of a decode step's few rows in one call: y [rows, n] = x / rms(x) (* w), in transformers' order.
 * Compiled with native.c into one library; called through ctypes from quant/native.py (`rms_norm`).
 *
 * Why: a decode token runs 4 norms a layer (input, post-attention, q and k per head) and the final one; in torch
 * each is 7-8 elementwise ops at ~5-10 us of dispatch apiece on a [1, 2048] row, ~1-2 ms a token on a 48-layer model,
 * where the arithmetic is a few microseconds.
 *
 * The order of transformers' (and the engine's torch path, models/base.py rms_norm): in fp32, var = mean(x^2), r =
 * 1 / sqrt(var + eps), y = x r rounded to x's dtype, then y w rounded to that dtype (KIND_AFTER: bf16 x and
 * weight, or fp32 both); GPT-OSS's (KIND_FP32_W): fp32 w times the fp32 x r, one rounding at the end; KIND_NONE: no
 * weight. The squares are summed in double, in 16 lanes added in a fixed order (torch sums in fp32 lanes: the two
 * can differ by an ulp of var, which moves a bf16 output by one step with a probability of ~2^-16 an element); each
 * row is independent, so the bits do not depend on how many rows a call holds. */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KIND_NONE = 0, KIND_AFTER = 1, KIND_FP32_W = 2 };

static inline float nb_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t nb_to_bf16(float f) { /* round to nearest even, NaN kept a (quiet) NaN: torch's */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

/* x [rows, n] (bf16 when x_bf16, else fp32), w [n] (bf16 for KIND_AFTER with a bf16 x, else fp32; unused for
 * KIND_NONE) -> y [rows, n] in x's dtype. 0; -1 for a bad argument. */
int moechat_rms_norm(const void *x, int x_bf16, int64_t rows, int64_t n, const void *w, int kind, float eps,
                     void *y) {
    if (rows < 0 || n <= 0 || kind < KIND_NONE || kind > KIND_FP32_W) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xb = (const uint16_t *)x + r * n;
        const float *xf = (const float *)x + r * n;
        /* 16 lanes of double partial sums (each square exact in double), added in a fixed order at the end */
        double lane[16] = {0};
        int64_t i = 0;
        if (x_bf16)
            for (; i + 16 <= n; i += 16)
                for (int l = 0; l < 16; l++) {
                    double v = nb_bf16(xb[i + l]);
                    lane[l] += v * v;
                }
        else
            for (; i + 16 <= n; i += 16)
                for (int l = 0; l < 16; l++) {
                    double v = xf[i + l];
                    lane[l] += v * v;
                }
        double acc = 0.0;
        for (; i < n; i++) {
            double v = x_bf16 ? nb_bf16(xb[i]) : xf[i];
            acc += v * v;
        }
        for (int l = 0; l < 16; l++) acc += lane[l];
        float var = (float)(acc / (double)n);
        float inv = 1.0f / sqrtf(var + eps);
        if (x_bf16) {
            uint16_t *yb = (uint16_t *)y + r * n;
            const uint16_t *wb = (const uint16_t *)w;
            const float *wf = (const float *)w;
            for (int64_t j = 0; j < n; j++) {
                float t = nb_bf16(xb[j]) * inv;
                float out = kind == KIND_FP32_W ? wf[j] * t
                          : kind == KIND_AFTER ? nb_bf16(nb_to_bf16(t)) * nb_bf16(wb[j]) : t;
                yb[j] = nb_to_bf16(out);
            }
        } else {
            float *yf = (float *)y + r * n;
            const float *wf = (const float *)w;
            for (int64_t j = 0; j < n; j++) {
                float t = xf[j] * inv;
                yf[j] = kind == KIND_NONE ? t : wf[j] * t;
            }
        }
    }
    return 0;
}
