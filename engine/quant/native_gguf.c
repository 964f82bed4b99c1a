/* GGUF (ggml) blocks decoded to fp32 rows: the fast path of quant/gguf.py's GGUFFormat.linear (a tile of rows
 * decoded here, then one torch GEMM). Plain C, no intrinsics: it compiles for any x86-64 (or other) target and the
 * compiler vectorises the inner loops. Every value is computed with the operations, in the order, of the torch
 * reference (quant/gguf.py dequantize_blocks) and the gguf package: products rounded one at a time, never fused
 * (fp-contract off), so the rows are bit for bit the reference's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

static inline float gguf_h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float v = (float)man * (1.0f / 16777216.0f); /* a subnormal (or zero): man x 2^-24, exact */
        return sign ? -v : v;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline void gguf_scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static const int8_t gguf_fp4x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t gguf_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* type: the ggml type id; src: nblocks blocks back to back; dst: nblocks x the type's values. 0, or -1 for a type
 * decoded only by the torch path. */
int moechat_gguf_dequant(int type, const uint8_t *src, int64_t nblocks, float *dst) {
    for (int64_t b = 0; b < nblocks; b++) {
        if (type == 8) { /* Q8_0: d, int8 qs[32] */
            const uint8_t *x = src + b * 34;
            float d = gguf_h2f(x), *y = dst + b * 32;
            for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)x[2 + i];
        } else if (type == 2) { /* Q4_0: d, qs[16]: low nibbles values 0..15, high 16..31, minus 8 */
            const uint8_t *x = src + b * 18;
            float d = gguf_h2f(x), *y = dst + b * 32;
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)((x[2 + i] & 0x0f) - 8);
                y[i + 16] = d * (float)((x[2 + i] >> 4) - 8);
            }
        } else if (type == 3) { /* Q4_1: d, m, qs[16]: d * q + m */
            const uint8_t *x = src + b * 20;
            float d = gguf_h2f(x), m = gguf_h2f(x + 2), *y = dst + b * 32;
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)(x[4 + i] & 0x0f) + m;
                y[i + 16] = d * (float)(x[4 + i] >> 4) + m;
            }
        } else if (type == 6 || type == 7) { /* Q5_0 / Q5_1: d, (m,) qh u32, qs[16] */
            int o = type == 6 ? 2 : 4;
            const uint8_t *x = src + b * (type == 6 ? 22 : 24);
            float d = gguf_h2f(x), m = type == 7 ? gguf_h2f(x + 2) : 0.0f, *y = dst + b * 32;
            uint32_t qh = (uint32_t)x[o] | ((uint32_t)x[o + 1] << 8) | ((uint32_t)x[o + 2] << 16) |
                          ((uint32_t)x[o + 3] << 24);
            for (int i = 0; i < 16; i++) {
                int lo = (x[o + 4 + i] & 0x0f) | (((qh >> i) & 1) << 4);
                int hi = (x[o + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
                if (type == 6) {
                    y[i] = d * (float)(lo - 16);
                    y[i + 16] = d * (float)(hi - 16);
                } else {
                    y[i] = d * (float)lo + m;
                    y[i + 16] = d * (float)hi + m;
                }
            }
        } else if (type == 20) { /* IQ4_NL: d, qs[16]: d * codebook[q] */
            const uint8_t *x = src + b * 18;
            float d = gguf_h2f(x), *y = dst + b * 32;
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)gguf_iq4[x[2 + i] & 0x0f];
                y[i + 16] = d * (float)gguf_iq4[x[2 + i] >> 4];
            }
        } else if (type == 39) { /* MXFP4: e (E8M0), qs[16]: 2^(e - 128) x the doubled E2M1 value, exact */
            const uint8_t *x = src + b * 17;
            int e = (int)x[0] - 128;
            float s = ldexpf(1.0f, e), *y = dst + b * 32; /* a power of two: each product below is exact */
            for (int i = 0; i < 16; i++) {
                y[i] = (float)gguf_fp4x2[x[1 + i] & 0x0f] * s;
                y[i + 16] = (float)gguf_fp4x2[x[1 + i] >> 4] * s;
            }
        } else if (type == 12 || type == 13) { /* Q4_K / Q5_K: d, dmin, scales[12], (qh[32],) qs[128] */
            const uint8_t *x = src + b * (type == 12 ? 144 : 176);
            float d = gguf_h2f(x), dmin = gguf_h2f(x + 2), *y = dst + b * 256;
            const uint8_t *qh = x + 16, *qs = x + (type == 12 ? 16 : 48);
            for (int c = 0; c < 4; c++) {
                for (int h = 0; h < 2; h++) {
                    int sc, m, j = 2 * c + h;
                    gguf_scale_min_k4(j, x + 4, &sc, &m);
                    float dl = d * (float)sc, ml = dmin * (float)m;
                    for (int l = 0; l < 32; l++) {
                        int q = (qs[32 * c + l] >> (4 * h)) & 0x0f;
                        if (type == 13) q |= ((qh[l] >> j) & 1) << 4;
                        y[32 * j + l] = dl * (float)q - ml;
                    }
                }
            }
        } else if (type == 14) { /* Q6_K: ql[128], qh[64], int8 scales[16], d */
            const uint8_t *x = src + b * 210;
            float d = gguf_h2f(x + 208), *y = dst + b * 256;
            const uint8_t *ql = x, *qh = x + 128;
            const int8_t *sc = (const int8_t *)(x + 192);
            for (int n = 0; n < 2; n++) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[64 * n + l] & 0x0f) | (((qh[32 * n + l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[64 * n + l + 32] & 0x0f) | (((qh[32 * n + l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[64 * n + l] >> 4) | (((qh[32 * n + l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[64 * n + l + 32] >> 4) | (((qh[32 * n + l] >> 6) & 3) << 4)) - 32;
                    float *yy = y + 128 * n;
                    yy[l] = d * (float)sc[8 * n + is] * (float)q1;
                    yy[l + 32] = d * (float)sc[8 * n + is + 2] * (float)q2;
                    yy[l + 64] = d * (float)sc[8 * n + is + 4] * (float)q3;
                    yy[l + 96] = d * (float)sc[8 * n + is + 6] * (float)q4;
                }
            }
        } else if (type == 23) { /* IQ4_XS: d, scales_h u16, scales_l[4], qs[128] */
            const uint8_t *x = src + b * 136;
            float d = gguf_h2f(x), *y = dst + b * 256;
            int sh = x[2] | (x[3] << 8);
            for (int ib = 0; ib < 8; ib++) {
                int ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((sh >> (2 * ib)) & 3) << 4);
                float dl = d * (float)(ls - 32);
                const uint8_t *qs = x + 8 + 16 * ib;
                for (int i = 0; i < 16; i++) {
                    y[32 * ib + i] = dl * (float)gguf_iq4[qs[i] & 0x0f];
                    y[32 * ib + i + 16] = dl * (float)gguf_iq4[qs[i] >> 4];
                }
            }
        } else {
            return -1;
        }
    }
    return 0;
}
