/* GGUF (ggml) blocks for quant/gguf.py's GGUFFormat.linear: decoded to fp32 rows (moechat_gguf_dequant: the tile
 * path, and the many-token kernel's scratch), one token's integer dots (moechat_gguf_vecdot) and the many-token
 * kernel (moechat_gguf_prefill). The decoders are plain C with SSE/AVX2 forms of the inner loops where the compiler
 * would not vectorise them; every value is computed with the operations, in the order, of the torch reference
 * (quant/gguf.py dequantize_blocks) and the gguf package: products rounded one at a time, never fused (fp-contract
 * off), so the rows are bit for bit the reference's in every build (AVX-512, AVX2, scalar: tested). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if (defined(__F16C__) || defined(__AVX2__)) && !defined(MOECHAT_SCALAR)
#include <immintrin.h>
#endif
static const int8_t gguf_fp4x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t gguf_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#if defined(__AVX2__) && !defined(MOECHAT_SCALAR)
#define GD_SIMD 1
/* 16 signed byte codes q -> y[l] = dl * q[l] (- ml): the reference's two roundings, 8 lanes at a time */
static inline void gd_put16(float *y, __m128i q, float dl, float ml, int min) {
    __m256 s = _mm256_set1_ps(dl), m = _mm256_set1_ps(ml);
    __m256 a = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    __m256 b = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
    _mm256_storeu_ps(y, min ? _mm256_sub_ps(a, m) : a);
    _mm256_storeu_ps(y + 8, min ? _mm256_sub_ps(b, m) : b);
}
/* 16 bytes at p, each shifted right by n, masked */
static inline __m128i gd_bits(const uint8_t *p, int n, int mask) {
    return _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128(n)),
                         _mm_set1_epi8((char)mask));
}
/* 16 bytes of nibbles at p -> y[0..15] from the low nibbles, y[16..31] from the high ones: codes through an int8
 * table (lut) or less `off`, times dl */
static inline void gd_nibbles(float *y, const uint8_t *p, const int8_t *lut, int off, float dl) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    if (lut) {
        __m128i t = _mm_loadu_si128((const __m128i *)lut);
        lo = _mm_shuffle_epi8(t, lo), hi = _mm_shuffle_epi8(t, hi);
    } else {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8((char)off)), hi = _mm_sub_epi8(hi, _mm_set1_epi8((char)off));
    }
    gd_put16(y, lo, dl, 0.0f, 0);
    gd_put16(y + 16, hi, dl, 0.0f, 0);
}
#else
#define GD_SIMD 0
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

static inline float gguf_h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__) && !defined(MOECHAT_SCALAR)
    return _cvtsh_ss(h); /* exact, as the bit arithmetic (a third faster per block scale) */
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float v = (float)man * (1.0f / 16777216.0f); /* a subnormal (or zero): man x 2^-24, exact */
        return sign ? -v : v;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
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


/* type: the ggml type id; src: nblocks blocks back to back; dst: nblocks x the type's values. 0, or -1 for a type
 * decoded only by the torch path. */
int moechat_gguf_dequant(int type, const uint8_t *restrict src, int64_t nblocks, float *restrict dst) {
    if (type == 0) { /* F32: one value a block */
        memcpy(dst, src, (size_t)nblocks * 4);
        return 0;
    }
    if (type == 1 || type == 30) { /* F16 / BF16 (the top half of an fp32) */
        int64_t i = 0;
#if defined(__F16C__) && !defined(MOECHAT_SCALAR)
        for (; type == 1 && i + 8 <= nblocks; i += 8) /* F16C's conversion: exact, as gguf_h2f */
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
        for (; i < nblocks; i++) {
            uint32_t bits = (uint32_t)(src[2 * i] | (src[2 * i + 1] << 8)) << 16;
            if (type == 1) dst[i] = gguf_h2f(src + 2 * i);
            else memcpy(dst + i, &bits, 4);
        }
        return 0;
    }
    for (int64_t b = 0; b < nblocks; b++) {
        if (type == 8) { /* Q8_0: d, int8 qs[32] */
            const uint8_t *x = src + b * 34;
            float d = gguf_h2f(x), *y = dst + b * 32;
            for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)x[2 + i];
        } else if (type == 2) { /* Q4_0: d, qs[16]: low nibbles values 0..15, high 16..31, minus 8 */
            const uint8_t *x = src + b * 18;
            float d = gguf_h2f(x), *y = dst + b * 32;
#if GD_SIMD
            gd_nibbles(y, x + 2, NULL, 8, d);
            continue;
#endif
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
#if GD_SIMD
            gd_nibbles(y, x + 2, gguf_iq4, 0, d);
            continue;
#endif
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)gguf_iq4[x[2 + i] & 0x0f];
                y[i + 16] = d * (float)gguf_iq4[x[2 + i] >> 4];
            }
        } else if (type == 39) { /* MXFP4: e (E8M0), qs[16]: 2^(e - 128) x the doubled E2M1 value, exact */
            const uint8_t *x = src + b * 17;
            /* 2^(e - 128) from its bits (ldexpf's value, without the call): a normal from e = 2, subnormals below */
            uint32_t bits = x[0] >= 2 ? (uint32_t)(x[0] - 1) << 23 : (uint32_t)1 << (21 + x[0]);
            float s, *y = dst + b * 32; /* a power of two: each product below is exact */
            memcpy(&s, &bits, 4);
#if GD_SIMD
            gd_nibbles(y, x + 1, gguf_fp4x2, 0, s);
            continue;
#endif
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
            /* value 128n + 32k + 16h + l: the low 4 bits of ql[64n + 32(k & 1) + 16h + l] (the high nibble for k >= 2),
             * the top 2 bits 2k of qh[32n + 16h + l]; its scale sc[8n + 2k + h] (16 values a scale) */
            for (int n = 0; n < 2; n++)
                for (int k = 0; k < 4; k++)
                    for (int h = 0; h < 2; h++) {
                        float dl = d * (float)sc[8 * n + 2 * k + h];
                        const uint8_t *lo = ql + 64 * n + 32 * (k & 1) + 16 * h, *hi = qh + 32 * n + 16 * h;
                        float *yy = y + 128 * n + 32 * k + 16 * h;
                        int s4 = 4 * (k >> 1), s2 = 2 * k;
#if GD_SIMD
                        __m128i q = _mm_or_si128(gd_bits(lo, s4, 0x0f), _mm_slli_epi16(gd_bits(hi, s2, 3), 4));
                        gd_put16(yy, _mm_sub_epi8(q, _mm_set1_epi8(32)), dl, 0.0f, 0);
                        continue;
#endif
                        for (int l = 0; l < 16; l++)
                            yy[l] = dl * (float)((((lo[l] >> s4) & 0x0f) | (((hi[l] >> s2) & 3) << 4)) - 32);
                    }
        } else if (type == 10) { /* Q2_K: scales[16] (low nibble scale, high min), qs[64], d, dmin */
            const uint8_t *x = src + b * 84, *qs = x + 16;
            float d = gguf_h2f(x + 80), dmin = gguf_h2f(x + 82), *y = dst + b * 256;
            /* value 128n + 32j + 16h + l: bits 2j of byte 32n + 16h + l; its group g = 8n + 2j + h */
            for (int n = 0; n < 2; n++)
                for (int jj = 0; jj < 4; jj++)
                    for (int h = 0; h < 2; h++) {
                        int g = 8 * n + 2 * jj + h;
                        float dl = d * (float)(x[g] & 0x0f), ml = dmin * (float)(x[g] >> 4);
                        const uint8_t *q = qs + 32 * n + 16 * h;
                        float *yy = y + 16 * g;
#if GD_SIMD
                        gd_put16(yy, gd_bits(q, 2 * jj, 3), dl, ml, 1);
                        continue;
#endif
                        for (int l = 0; l < 16; l++) yy[l] = dl * (float)((q[l] >> (2 * jj)) & 3) - ml;
                    }
        } else if (type == 11) { /* Q3_K: hmask[32], qs[64], scales[12] (16 of 6 bits, less 32), d */
            const uint8_t *x = src + b * 110, *hm = x, *qs = x + 32, *s = x + 96;
            float d = gguf_h2f(x + 108), *y = dst + b * 256;
            for (int n = 0; n < 2; n++) /* as Q2_K's, the third bit (clear: less 4) bit 4n + j of hmask[16h + l] */
                for (int jj = 0; jj < 4; jj++)
                    for (int h = 0; h < 2; h++) {
                        int g = 8 * n + 2 * jj + h, sh = 4 * n + jj;
                        int lo = g < 8 ? s[g] & 0x0f : s[g - 8] >> 4, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                        float dl = d * (float)((lo | (hi << 4)) - 32);
                        const uint8_t *q = qs + 32 * n + 16 * h, *m = hm + 16 * h;
                        float *yy = y + 16 * g;
#if GD_SIMD
                        __m128i c = _mm_or_si128(gd_bits(q, 2 * jj, 3), _mm_slli_epi16(gd_bits(m, sh, 1), 2));
                        gd_put16(yy, _mm_sub_epi8(c, _mm_set1_epi8(4)), dl, 0.0f, 0);
                        continue;
#endif
                        for (int l = 0; l < 16; l++)
                            yy[l] = dl * (float)((int)((q[l] >> (2 * jj)) & 3) - (int)((~m[l] >> sh) & 1) * 4);
                    }
        } else if (type == 23) { /* IQ4_XS: d, scales_h u16, scales_l[4], qs[128] */
            const uint8_t *x = src + b * 136;
            float d = gguf_h2f(x), *y = dst + b * 256;
            int sh = x[2] | (x[3] << 8);
            for (int ib = 0; ib < 8; ib++) {
                int ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((sh >> (2 * ib)) & 3) << 4);
                float dl = d * (float)(ls - 32);
                const uint8_t *qs = x + 8 + 16 * ib;
#if GD_SIMD
                gd_nibbles(y + 32 * ib, qs, gguf_iq4, 0, dl);
                continue;
#endif
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

/* ---- One token, integer dot products (llama.cpp's vec_dot): x quantized once per call to Q8 blocks (int8 + an
 * fp32 scale per 32 values for the 32-value types; per 256 with per-16 sums for the k-quants and IQ4_XS, as ggml's
 * Q8_K), then per row integer sums per (sub-)block: the k-quants and IQ4_XS scaled by their integer sub-block scales,
 * one fp32 multiply-add per 256 values (the mins' / offsets' terms from x's sums per 16); the 32-value types as 8
 * lanes of 4 products scaled per block in fp32, the lanes added in order at the end (Q4_1 / Q5_1's min from x's
 * block sum). The integer sums are exact and the float steps are the same in every build (AVX-512 VNNI, AVX2,
 * scalar C: no fused multiply-add, fp-contract off), so every build and every thread count writes the same bits
 * (the tests build the AVX2 and scalar variants and compare). One Qwen3-30B-A3B w13 (1536 x 2048), one thread of a
 * loaded 2-core machine: 2.5-6.9x the tile path for every type (bench/gguf_vecdot.py; quant/gguf.py has figures).
 * Error against the fp32 reference (dequantize, then the dot with x):
 * x_i = dx_b * q_i + e_i with |e_i| <= dx_b / 2, dx_b = amax_b / 127, so |y - y_ref| <= sum_b dx_b / 2 *
 * sum_{i in b} |w_i| (plus fp32 rounding of the sums).
 * The AVX-512 build's loops (the k-quants and IQ4_XS a row at a time, 4 super-blocks per reduction; the 32-value
 * types 4 rows a pass) read x in their own byte order, permuted once per call (gv_prep_z), and prefetch into L2 what
 * they read next; their integer sums are the same exact numbers, their float steps the same operations in the same
 * order. An LM head out of cache (151936 x 2048), one Zen 4 thread, against a read probe in the same rounds: Q8_0
 * 0.92-0.98, Q6_K 0.74-0.79, Q4_K 0.60-0.68, Q4_0 0.54-0.61 (1.2-1.6x the AVX2-form loops before; Q2_K / Q3_K 3x);
 * the 32-value types are held by their 8 fp32 lanes a block (cvt, multiply, add: the bits' contract). */
#include <stdlib.h>

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

#if defined(__AVX2__) && !defined(MOECHAT_SCALAR)
#define GV_SIMD 1
#include <immintrin.h>
/* software prefetch into L2 (T1; into L1, T0, measured slower) of what the loops read next, out of cache the
 * hardware's alone left them at 0.5-0.6 of the memory's read bandwidth on Zen 4 (bench/gguf_vecdot.py): GV_AHEAD
 * bytes ahead of a row read alone, the rows GV_AHEAD_ROWS below for the loops on 4 rows at once */
#define GV_AHEAD 8192
#define GV_AHEAD_ROWS 4
/* 32 unsigned x 32 signed bytes -> 8 int32 partial sums (lanes 0-3: values 0-15, 4-7: values 16-31). No int16
 * saturation on the AVX2 path: a pair is at most 2 x 128 x 127 = 32512 for every type here. */
static inline __m256i gv_dot32v(__m256i a, const int8_t *s) {
    __m256i b = _mm256_loadu_si256((const __m256i *)s);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
static inline int32_t gv_hsum(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
    return _mm_cvtsi128_si32(a);
}
/* the 8 partial sums scaled per 16 values: summed over a super-block in registers, one horizontal sum at its end */
static inline __m256i gv_dot32vm(__m256i u, const int8_t *s, int32_t sc0, int32_t sc1) {
    return _mm256_mullo_epi32(gv_dot32v(u, s), _mm256_setr_epi32(sc0, sc0, sc0, sc0, sc1, sc1, sc1, sc1));
}
static inline int32_t gv_dot32vs(__m256i u, const int8_t *s, int32_t sc0, int32_t sc1) {
    __m256i v = gv_dot32v(u, s);
    if (sc0 == sc1) return sc0 * gv_hsum(v); /* exact either way: one multiply instead of eight */
    return gv_hsum(_mm256_mullo_epi32(v, _mm256_setr_epi32(sc0, sc0, sc0, sc0, sc1, sc1, sc1, sc1)));
}
#else
#define GV_SIMD 0
#endif

/* sum of u[i] * s[i] over 32 values, scaled per 16: sc0 * (values 0-15) + sc1 * (values 16-31) */
static inline int32_t gv_dot32s(const uint8_t *u, const int8_t *s, int32_t sc0, int32_t sc1) {
#if GV_SIMD
    return gv_dot32vs(_mm256_loadu_si256((const __m256i *)u), s, sc0, sc1);
#else
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; i++) a += (int32_t)u[i] * s[i];
    for (int i = 16; i < 32; i++) b += (int32_t)u[i] * s[i];
    return sc0 * a + sc1 * b;
#endif
}

/* The 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4): each block's 32 codes as signed bytes in value
 * order (Q4_1 / Q5_1: the unsigned codes before the min, Q4_0 / Q5_0 less 8 / 16, IQ4_NL / MXFP4 through their int8
 * tables), |w| times x with w's sign (ggml's trick), exact; the 8 lane sums of 4 consecutive products each, scaled
 * per block in fp32 and summed lane by lane over the row (8 fp32 sums, added in lane order at the end: the scalar
 * build keeps the same 8 sums, so the bits agree). Q4_1 / Q5_1's min m adds m * dx * (x's block sum) per block. */
#if GV_SIMD
static inline __m256i gv_sdot32v(__m256i a, __m256i b) { /* signed a x signed b -> 8 int32 sums of 4 */
    __m256i ua = _mm256_sign_epi8(a, a), sb = _mm256_sign_epi8(b, a);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sb);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));
#endif
}
static inline __m256 gv_lanes_ss(__m256i a, const int8_t *s, float dd, __m256 acc) {
    __m256i v = gv_sdot32v(a, _mm256_loadu_si256((const __m256i *)s));
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(v)));
}
/* 16 bytes of nibbles -> 32 values: the low nibbles first, then the high ones (through an int8 table if lut) */
static inline __m256i gv_nibbles(const uint8_t *p16, const int8_t *lut) {
    /* the 16 bytes in both halves, the high half's 64-bit words shifted right by 4: each byte's high nibble lands in
     * its low bits (the next byte's low nibble above them, masked off); 3 ops where two 128-bit halves took 5 */
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p16));
    __m256i u = _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
    if (lut) u = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut)), u);
    return u;
}
/* Q5_0 / Q5_1's fifth bits: byte i of the result 0x10 where bit i of qh is set */
static inline __m256i gv_bit5(uint32_t qh) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, /* each 128-bit half: */
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3); /* qh's bytes 0-3 */
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}
#endif
static inline void gv_lanes_ss_scalar(const int8_t *w, const int8_t *s, float dd, float *acc) {
    for (int k = 0; k < 8; k++) {
        int32_t a = 0;
        for (int i = 4 * k; i < 4 * k + 4; i++) a += (int32_t)w[i] * s[i];
        acc[k] += dd * (float)a;
    }
}

/* MXFP4's E8M0 scale 2^(e - 128) (E2M1 held doubled) from its bits: a normal from e = 2, subnormals below */
static inline float gv_e8m0(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : (uint32_t)1 << (21 + e);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* where a 32-value block's codes start: after its scale(s) and, for Q5_0 / Q5_1, the 4 bytes of fifth bits */
static inline int gv_codes_at(int type) { return type == 39 ? 1 : type == 3 ? 4 : type == 6 ? 6 : type == 7 ? 8 : 2; }

static inline uint32_t gv_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

typedef struct {
    int type;
    int64_t cols, row_bytes;
    const uint8_t *w;
    const int8_t *q;   /* x as int8 [cols] */
    const float *d;    /* its scales, one per QB values */
    const int32_t *bs; /* its sums per 16 values [cols / 16] */
    const int8_t *qz;  /* AVX-512: x in the byte order of the 512-bit loops (gv_prep_z) */
    const int32_t *nz; /* the 32-value types: less x's sums of 4 in that order, 16 per block */
    const int16_t *bz; /* Q6_K: -16 x its sums per 16, 32 a super-block; Q4_K: its sums per 32 */
    float *y;
} GVJob;

/* a 32-value block's codes as signed bytes (the scalar build's form of the SIMD unpacking) */
static inline void gv_codes32(const int type, const uint8_t *x, int8_t *w) {
    if (type == 8) {
        memcpy(w, x + 2, 32);
        return;
    }
    int o = gv_codes_at(type);
    uint32_t qh = type == 6 || type == 7 ? gv_u32(x + o - 4) : 0;
    for (int i = 0; i < 16; i++) {
        int lo = x[o + i] & 0x0f, hi = x[o + i] >> 4;
        if (type == 20) lo = gguf_iq4[lo], hi = gguf_iq4[hi];
        else if (type == 39) lo = gguf_fp4x2[lo], hi = gguf_fp4x2[hi];
        lo |= (int)((qh >> i) & 1) << 4;
        hi |= (int)((qh >> (i + 16)) & 1) << 4;
        int off = type == 2 ? 8 : type == 6 ? 16 : 0;
        w[i] = (int8_t)(lo - off);
        w[i + 16] = (int8_t)(hi - off);
    }
}

#if GV_SIMD
/* one block x of a 32-value type's row times x's block qb, scaled by dd, into the 8 fp32 lanes acc */
static inline __attribute__((always_inline)) __m256 gv_block32(const uint8_t *x, const int8_t *qb, float dd,
                                                               const int type, __m256 acc) {
    __m256i wv;
    if (type == 8) {
        wv = _mm256_loadu_si256((const __m256i *)(x + 2));
    } else {
        int o = gv_codes_at(type);
        wv = gv_nibbles(x + o, type == 20 ? gguf_iq4 : type == 39 ? gguf_fp4x2 : NULL);
        if (type == 6 || type == 7) wv = _mm256_or_si256(wv, gv_bit5(gv_u32(x + o - 4)));
        if (type == 2 || type == 6) wv = _mm256_sub_epi8(wv, _mm256_set1_epi8(type == 2 ? 8 : 16));
    }
    return gv_lanes_ss(wv, qb, dd, acc);
}

/* The AVX2 build's unsigned form of gv_block32 for the types whose codes are small unsigned bytes: u = code + o (Q4_0
 * o = 8, Q5_0 16, MXFP4 12 through its table plus 12, Q4_1 / Q5_1 0), vpmaddubsw straight on u and x (pairs <= 2 x 31
 * x 127: no saturation) from `init` = -o x x's sums of 4 (gv_prep_nz, once per call): the 8 lane sums of 4 are the
 * signed form's exactly (integers), so the bits too, with no vpsignb pair and no subtraction a block (Zen 2, one
 * thread, an LM head out of cache, bench/gguf_vecdot.py --base: Q4_0 0.52 -> 0.57 of the read probe, Q5_0 0.50 ->
 * 0.54, MXFP4 0.47 -> 0.49; Q4_1 even).
 * Q8_0 and IQ4_NL (signed, wider) keep gv_block32. */
#if !defined(__AVX512BW__) /* not GV_Z's builds (defined below), whose 512-bit loops take u their own way */
#define GV_UNSIGNED(type) ((type) == 2 || (type) == 6 || (type) == 39 || (type) == 3 || (type) == 7)
static const int8_t gguf_fp4x2_u12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static inline int gv_uoffset(int type) { return type == 2 ? 8 : type == 6 ? 16 : type == 39 ? 12 : 0; }

static inline __attribute__((always_inline)) __m256 gv_block32u(const uint8_t *x, const int8_t *qb, __m256i init,
                                                                float dd, const int type, __m256 acc) {
    const int o = gv_codes_at(type);
    __m256i u = gv_nibbles(x + o, type == 39 ? gguf_fp4x2_u12 : NULL);
    if (type == 6 || type == 7) u = _mm256_or_si256(u, gv_bit5(gv_u32(x + o - 4)));
    __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)qb)),
                                  _mm256_set1_epi16(1));
    v = _mm256_add_epi32(init, v);
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(v)));
}

/* init per block for gv_block32u: nz[8b + k] = -o x (x's elements 4k..4k+3 of block b) */
static void gv_prep_nz(int type, int64_t cols, const int8_t *q, int32_t *nz) {
    const int o = gv_uoffset(type);
    for (int64_t k = 0; k < cols / 4; k++) nz[k] = -o * (q[4 * k] + q[4 * k + 1] + q[4 * k + 2] + q[4 * k + 3]);
}
#else
#define GV_UNSIGNED(type) 0
#endif
#endif

static inline __attribute__((always_inline)) float gv_row32(const GVJob *j, const uint8_t *row, const int type,
                                                             const int64_t nb) {
    const int8_t *q = j->q;
    float lanes[8] = {0}, summ = 0.0f, sumf = 0.0f;
#if GV_SIMD
    __m256 acc = _mm256_setzero_ps();
#endif
    for (int64_t b = 0; b < j->cols / 32; b++) {
        const uint8_t *x = row + b * nb;
        float dx = j->d[b], dd = (type == 39 ? gv_e8m0(x[0]) : gguf_h2f(x)) * dx;
#if GV_SIMD
#if !defined(__AVX512BW__)
        if (GV_UNSIGNED(type))
            acc = gv_block32u(x, q + 32 * b, _mm256_loadu_si256((const __m256i *)(j->nz + 8 * b)), dd, type, acc);
        else
#endif
            acc = gv_block32(x, q + 32 * b, dd, type, acc);
#else
        int8_t w[32];
        gv_codes32(type, x, w);
        gv_lanes_ss_scalar(w, q + 32 * b, dd, lanes);
#endif
        if (type == 3 || type == 7) summ += gguf_h2f(x + 2) * dx * (float)(j->bs[2 * b] + j->bs[2 * b + 1]);
    }
#if GV_SIMD
    _mm256_storeu_ps(lanes, acc);
#endif
    for (int k = 0; k < 8; k++) sumf += lanes[k];
    return type == 3 || type == 7 ? sumf + summ : sumf;
}


/* Q4_K / Q5_K's 8 scales and 8 mins (6 bits each, packed in 12 bytes) as bytes, once per super-block: for j < 4
 * scale j is s[j] & 63 and min j s[j + 4] & 63; for j >= 4 the low 4 bits come from s[j + 4] (scale: low nibble,
 * min: high) and the top 2 from s[j - 4] (scale) or s[j] (min) >> 6. Word arithmetic on the 12 bytes, the same in
 * every build (gguf_scale_min_k4 per j, byte by byte). */
static inline void gv_scales_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c, w[4];
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    w[0] = a & 0x3f3f3f3fu;                                           /* scales 0-3 */
    w[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);       /* scales 4-7 */
    w[2] = b & 0x3f3f3f3fu;                                           /* mins 0-3 */
    w[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4); /* mins 4-7 */
    memcpy(sc, w, 8);
    memcpy(mn, w + 2, 8);
}

#if GV_SIMD
/* 32 unsigned codes x 32 signed bytes of x, the 16 pair sums (int16, no saturation: at most 2 x 63 x 127) times
 * int16 scales k16 and summed in pairs into 8 int32, added to acc: exact */
static inline __m256i gv_madd_sc(__m256i acc, __m256i u, const int8_t *s, __m256i k16) {
    __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)s));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, k16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, k16));
#endif
}
#endif

#if GV_SIMD && defined(__AVX512BW__)
#define GV_Z 1 /* the k-quants' inner loops on 64 values a step */
/* 64 unsigned codes x 64 signed bytes of x, pair sums (int16) times int16 scales k16, in pairs into 16 int32 */
static inline __m512i gv_madd_sc_z(__m512i acc, __m512i u, const int8_t *s, __m512i k16) {
    __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512((const void *)s));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p, k16);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, k16));
#endif
}
static inline __m512i gv_z2(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline int32_t gv_hsum_z(__m512i v) {
    return gv_hsum(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}
/* the sums of 4 vectors' 16 lanes each, in order */
static inline __m128i gv_hsum4_z(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m256i a8 = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m256i b8 = _mm256_add_epi32(_mm512_castsi512_si256(b), _mm512_extracti64x4_epi64(b, 1));
    __m256i c8 = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    __m256i d8 = _mm256_add_epi32(_mm512_castsi512_si256(d), _mm512_extracti64x4_epi64(d, 1));
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a8, b8), _mm256_hadd_epi32(c8, d8)); /* per half: a b c d */
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}
#else
#define GV_Z 0
#endif

#if GV_Z && defined(__AVX512VNNI__)
#define GV_ZV 1
/* R = 4 (or 2) rows of a 32-value type in one pass (AVX-512 VNNI), by pairs: a block's codes of two rows in one
 * vector (x's bytes, x's sums and the 4 rows' scales loaded once for all), as unsigned
 * bytes u = code + o (o = 8 / 16: Q4_0 / Q5_0's nibbles; 128: Q8_0 xor 0x80, IQ4_NL / MXFP4 through their tables
 * plus 128; 0: Q4_1 / Q5_1), vpdpbusd against x in the vector's order (qz) from o x (less x's sums of 4: nz): each
 * row's 8 lane sums of 4 exact, gv_row32's. Q8_0's vector is [row 0, row 1]; the nibbles' [row 0 low, row 1 low,
 * row 0 high, row 1 high] (values 0-15, 16-31). The fp32 steps lane by lane, gv_row32's: the same bits. */
static inline __attribute__((always_inline)) void gv_rows_32z(const GVJob *j, const uint8_t *r0, const int type,
                                                              const int nb, const int R, float *y) {
    const int o = gv_codes_at(type);
    const int sh = type == 8 || type == 20 || type == 39 ? 7 : type == 6 ? 4 : 3;    /* log2 o (not Q4_1 / Q5_1) */
    const int64_t rb = j->row_bytes;
    const __m512i m4 = _mm512_set1_epi8(0x0f), b16 = _mm512_set1_epi8(0x10);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_loadu_si128((const __m128i *)(type == 39 ? gguf_fp4x2 : gguf_iq4)), _mm_set1_epi8((char)0x80)));
    /* rows 2p, 2p + 1's block scales (dd: rows 0-3) into their lanes */
    const __m512i idx0 = type == 8 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(2));
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 summ = _mm_setzero_ps();
    for (int64_t b = 0; b < j->cols / 32; b++) {
        const uint8_t *x = r0 + b * nb;
        const float dx = j->d[b];
        const __m512i qz = _mm512_loadu_si512((const void *)(j->qz + 64 * b));
        const __m512i init = type == 3 || type == 7
                                 ? _mm512_setzero_si512()
                                 : _mm512_slli_epi32(_mm512_loadu_si512((const void *)(j->nz + 16 * b)), sh);
        uint64_t hs = 0;
        for (int r = 0; r < R; r++) {
            uint16_t h;
            memcpy(&h, x + r * rb, 2);
            hs |= (uint64_t)h << (16 * r);
        }
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(x + (r + GV_AHEAD_ROWS) * rb), _MM_HINT_T1);
        __m128 dd;
        if (type == 39) { /* gv_e8m0 of the rows' bytes in 32-bit lanes: (e - 1) << 23 from e = 2, else 1 << (21 + e) */
            uint32_t eb = x[0] | (uint32_t)x[rb] << 8;
            if (R > 2) eb |= (uint32_t)x[2 * rb] << 16 | (uint32_t)x[3 * rb] << 24;
            __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)eb));
            __m128i nrm = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
            __m128i sub = _mm_sllv_epi32(_mm_set1_epi32(1), _mm_add_epi32(e, _mm_set1_epi32(21)));
            dd = _mm_castsi128_ps(_mm_blendv_epi8(sub, nrm, _mm_cmpgt_epi32(e, _mm_set1_epi32(1))));
        } else {
            dd = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)hs));
        }
        dd = _mm_mul_ps(dd, _mm_set1_ps(dx));
        for (int p = 0; p < R / 2; p++) {
            const uint8_t *x0 = x + 2 * p * rb, *x1 = x0 + rb;
            __m512i u;
            if (type == 8) {
                u = _mm512_xor_si512(gv_z2(_mm256_loadu_si256((const __m256i *)(x0 + 2)),
                                           _mm256_loadu_si256((const __m256i *)(x1 + 2))),
                                     _mm512_set1_epi8((char)0x80));
            } else {
                __m256i t = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x0 + o))),
                    _mm_loadu_si128((const __m128i *)(x1 + o)), 1);
                u = _mm512_and_si512(gv_z2(t, _mm256_srli_epi16(t, 4)), m4);
                if (type == 20 || type == 39) u = _mm512_shuffle_epi8(lut, u);
                if (type == 6 || type == 7) { /* the fifth bits: byte i of each quarter from bit i (or 16 + i) of qh */
                    uint64_t h0 = gv_u32(x0 + o - 4), h1 = gv_u32(x1 + o - 4);
                    __mmask64 m = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
                    u = _mm512_mask_add_epi8(u, m, u, b16);
                }
            }
            __m512 ddv = _mm512_permutexvar_ps(p ? idx1 : idx0, _mm512_castps128_ps512(dd));
            acc[p] = _mm512_add_ps(acc[p], _mm512_mul_ps(ddv, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, qz))));
        }
        if (type == 3 || type == 7) { /* the 4 rows' mins in lanes: summ_r += m_r * dx * (x's block sum), in order */
            uint64_t ms = 0;
            for (int r = 0; r < R; r++) {
                uint16_t h;
                memcpy(&h, x + r * rb + 2, 2);
                ms |= (uint64_t)h << (16 * r);
            }
            __m128 m = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)ms)), _mm_set1_ps(dx));
            summ = _mm_add_ps(summ, _mm_mul_ps(m, _mm_set1_ps((float)(j->bs[2 * b] + j->bs[2 * b + 1]))));
        }
    }
    float sm[4];
    _mm_storeu_ps(sm, summ);
    for (int p = 0; p < R / 2; p++) {
        float l[16], s0 = 0.0f, s1 = 0.0f;
        _mm512_storeu_ps(l, acc[p]);
        for (int k = 0; k < 8; k++) {
            int k0 = type == 8 ? k : k < 4 ? k : k + 4, k1 = type == 8 ? 8 + k : k < 4 ? 4 + k : 8 + k;
            s0 += l[k0];
            s1 += l[k1];
        }
        y[2 * p] = type == 3 || type == 7 ? s0 + sm[2 * p] : s0;
        y[2 * p + 1] = type == 3 || type == 7 ? s1 + sm[2 * p + 1] : s1;
    }
}
/* a type's rows [a, b) by 4, then 2: the rest left to gv_row */
static inline __attribute__((always_inline)) int64_t gv_share_32z(const GVJob *j, int64_t a, int64_t b,
                                                                  const int type, const int nb) {
    for (; a + 3 < b; a += 4) {
        gv_rows_32z(j, j->w + a * j->row_bytes, type, nb, 4, j->y + a);
    }
    for (; a + 1 < b; a += 2) {
        gv_rows_32z(j, j->w + a * j->row_bytes, type, nb, 2, j->y + a);
    }
    return a;
}
#else
#define GV_ZV 0
#endif

#if GV_SIMD && !GV_ZV
/* The AVX2 build's 32-value types 4 rows a pass: each row's steps exactly gv_row32's (the same bits), the rows'
 * chains side by side, x's block read once for the 4, and the 4 rows below prefetched into L2 at the same block
 * (Zen 2, one thread, an LM head out of cache, bench/gguf_vecdot.py --base: Q8_0 0.74 -> 0.85 of the read probe;
 * the 4-bit types within 3%, their decode compute-bound there) */
static inline __attribute__((always_inline)) void gv_rows32_4(const GVJob *j, const uint8_t *r0, const int type,
                                                              const int64_t nb, float *y) {
    const int8_t *q = j->q;
    const int64_t rb = j->row_bytes;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float summ[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < j->cols / 32; b++) {
        const float dx = j->d[b];
#if !defined(__AVX512BW__)
        const __m256i init = GV_UNSIGNED(type) ? _mm256_loadu_si256((const __m256i *)(j->nz + 8 * b))
                                               : _mm256_setzero_si256();
#endif
        for (int r = 0; r < 4; r++) {
            const uint8_t *x = r0 + r * rb + b * nb;
            if ((b * nb & 63) < nb) _mm_prefetch((const char *)(x + 4 * rb), _MM_HINT_T1); /* a new line below */
            const float dd = (type == 39 ? gv_e8m0(x[0]) : gguf_h2f(x)) * dx;
#if !defined(__AVX512BW__)
            if (GV_UNSIGNED(type))
                acc[r] = gv_block32u(x, q + 32 * b, init, dd, type, acc[r]);
            else
#endif
                acc[r] = gv_block32(x, q + 32 * b, dd, type, acc[r]);
            if (type == 3 || type == 7) summ[r] += gguf_h2f(x + 2) * dx * (float)(j->bs[2 * b] + j->bs[2 * b + 1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        float lanes[8], sumf = 0.0f;
        _mm256_storeu_ps(lanes, acc[r]);
        for (int k = 0; k < 8; k++) sumf += lanes[k];
        y[r] = type == 3 || type == 7 ? sumf + summ[r] : sumf;
    }
}

/* the row groups' loop under the name the AVX-512 build's has (gv_share's one switch); MXFP4 a row at a time here:
 * measured faster (0.43 vs 0.40 of the probe) */
static inline __attribute__((always_inline)) int64_t gv_share_32z(const GVJob *j, int64_t a, int64_t b,
                                                                  const int type, const int nb) {
    if (type != 39)
        for (; a + 3 < b; a += 4) gv_rows32_4(j, j->w + a * j->row_bytes, type, nb, j->y + a);
    return a;
}
#endif

#if GV_SIMD
/* a Q4_K / Q5_K super-block's codes times x's 256 values times its scales: 8 int32 partial sums (exact) */
static inline __attribute__((always_inline)) __m256i gv_acc_q45k(const uint8_t *x, const int8_t *qb,
                                                                 const uint8_t *scs, const int type) {
    const uint8_t *qh = x + 16, *qs = x + (type == 12 ? 16 : 48);
#if GV_Z
    __m512i acc = _mm512_setzero_si512(), m4 = _mm512_set1_epi8(0x0f), b16 = _mm512_set1_epi8(0x10);
    __m256i h = type == 13 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    const __m512i sv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)scs)));
    for (int c = 0; c < 4; c++) { /* values 64c .. 64c + 63: the low nibbles of qs[32c ..], then the high */
        __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m512i u = _mm512_and_si512(gv_z2(p, _mm256_srli_epi16(p, 4)), m4);
        if (type == 13) { /* the fifth bits: bit 2c of qh[l] for the low half, 2c + 1 the high */
            __m256i t = _mm256_srli_epi16(h, 2 * c);
            u = _mm512_or_si512(u, _mm512_and_si512(gv_z2(_mm256_slli_epi16(t, 4), _mm256_slli_epi16(t, 3)), b16));
        }
        __m512i idx = gv_z2(_mm256_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)));
        acc = gv_madd_sc_z(acc, u, qb + 64 * c, _mm512_permutexvar_epi16(idx, sv));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
#else
    __m256i acc = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0f);
    __m256i h = type == 13 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
        if (type == 13) { /* the fifth bits: bit 2c of qh[l] for the low half, 2c + 1 the high */
            __m256i t = _mm256_srli_epi16(h, 2 * c), b16 = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(t, 4), b16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(t, 3), b16));
        }
        acc = gv_madd_sc(acc, lo, qb + 64 * c, _mm256_set1_epi16(scs[2 * c]));
        acc = gv_madd_sc(acc, hi, qb + 64 * c + 32, _mm256_set1_epi16(scs[2 * c + 1]));
    }
    return acc;
#endif
}
/* x's sums per 32 (pairs of its sums per 16) times a super-block's 8 mins: 8 int32 partial sums of the mins' term */
static inline __m256i gv_mins_q45k(__m256i pr, const uint8_t *mns) {
    return _mm256_mullo_epi32(pr, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mns)));
}
static inline __m256i gv_pairs16(const int32_t *bs) {
    __m256i b0 = _mm256_loadu_si256((const __m256i *)bs), b1 = _mm256_loadu_si256((const __m256i *)(bs + 8));
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(b0, b1), 0xd8);
}
#endif

/* Q4_K / Q5_K: unsigned codes times 6-bit scales per 32, the mins' term from x's sums per 16. The integer sums of a
 * super-block are exact (at most 256 x 31 x 127 x 63 < 2^31) in any order, the float steps are one pair per
 * super-block in the same order in every build. */
static inline __attribute__((always_inline)) float gv_row_q45k_t(const GVJob *j, const uint8_t *row, const int type) {
    const int8_t *q = j->q;
    const int nb = type == 12 ? 144 : 176;
    float sumf = 0.0f;
    for (int64_t b = 0; b < j->cols / 256; b++) {
        const uint8_t *x = row + b * nb;
#if !GV_SIMD
        const uint8_t *qh = x + 16, *qs = x + (type == 12 ? 16 : 48);
#endif
        const int8_t *qb = q + 256 * b;
        const int32_t *bs = j->bs + 16 * b;
        uint8_t scs[8], mns[8];
        int32_t sumi = 0, summ = 0;
        gv_scales_k4(x + 4, scs, mns);
#if GV_SIMD
        summ = gv_hsum(gv_mins_q45k(gv_pairs16(bs), mns));
        sumi = gv_hsum(gv_acc_q45k(x, qb, scs, type));
#else
        uint8_t u[64];
        for (int jj = 0; jj < 8; jj++) summ += mns[jj] * (bs[2 * jj] + bs[2 * jj + 1]);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                u[l] = qs[32 * c + l] & 0x0f;
                u[32 + l] = qs[32 * c + l] >> 4;
            }
            if (type == 13)
                for (int l = 0; l < 32; l++) {
                    u[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
                    u[32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
            for (int hh = 0; hh < 2; hh++)
                sumi += gv_dot32s(u + 32 * hh, qb + 64 * c + 32 * hh, scs[2 * c + hh], scs[2 * c + hh]);
        }
#endif
        float dx = j->d[b];
        sumf += gguf_h2f(x) * dx * (float)sumi;
        sumf -= gguf_h2f(x + 2) * dx * (float)summ;
    }
    return sumf;
}
#if GV_SIMD
/* two rows in one pass over x: x's sums per 32 formed once, the four sums of a super-block (sumi, summ of each row)
 * in one reduction; each row's integer sums and float steps exactly those of gv_row_q45k_t */
static inline __attribute__((always_inline)) void gv_rows2_q45k_t(const GVJob *j, const uint8_t *r0,
                                                                  const uint8_t *r1, const int type, float *y) {
    const int nb = type == 12 ? 144 : 176;
    float s0 = 0.0f, s1 = 0.0f;
    for (int64_t b = 0; b < j->cols / 256; b++) {
        const uint8_t *x0 = r0 + b * nb, *x1 = r1 + b * nb;
        const int8_t *qb = j->q + 256 * b;
        uint8_t sc0[8], mn0[8], sc1[8], mn1[8];
        gv_scales_k4(x0 + 4, sc0, mn0);
        gv_scales_k4(x1 + 4, sc1, mn1);
        __m256i pr = gv_pairs16(j->bs + 16 * b);
        __m256i t0 = _mm256_hadd_epi32(gv_acc_q45k(x0, qb, sc0, type), gv_mins_q45k(pr, mn0));
        __m256i t1 = _mm256_hadd_epi32(gv_acc_q45k(x1, qb, sc1, type), gv_mins_q45k(pr, mn1));
        __m256i t = _mm256_hadd_epi32(t0, t1); /* per 128-bit half: sumi0, summ0, sumi1, summ1 */
        int32_t v[4];
        _mm_storeu_si128((__m128i *)v, _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
        float dx = j->d[b];
        s0 += gguf_h2f(x0) * dx * (float)v[0];
        s0 -= gguf_h2f(x0 + 2) * dx * (float)v[1];
        s1 += gguf_h2f(x1) * dx * (float)v[2];
        s1 -= gguf_h2f(x1 + 2) * dx * (float)v[3];
    }
    y[0] = s0;
    y[1] = s1;
}
#endif
#if GV_SIMD
/* four rows in one pass over x, as gv_rows2_q45k_t (AVX-512: registers for the four accumulators) */
static inline __attribute__((always_inline)) void gv_rows4_q45k_t(const GVJob *j, const uint8_t *r0, const int type,
                                                                  float *y) {
    const int nb = type == 12 ? 144 : 176;
    const int64_t rb = j->row_bytes;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < j->cols / 256; b++) {
        const int8_t *qb = j->q + 256 * b;
        __m256i pr = gv_pairs16(j->bs + 16 * b), t[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *x = r0 + r * rb + b * nb, *ahead = x + 4 * rb;
            /* the next 4 rows' same super-block: without it the 4 interleaved streams run at half the memory
             * bandwidth of one row after another (measured, a matrix out of cache) */
            _mm_prefetch((const char *)ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)(ahead + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(ahead + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(ahead + nb - 1), _MM_HINT_T0);
            uint8_t sc[8], mn[8];
            gv_scales_k4(x + 4, sc, mn);
            t[r] = _mm256_hadd_epi32(gv_acc_q45k(x, qb, sc, type), gv_mins_q45k(pr, mn));
        }
        __m256i u0 = _mm256_hadd_epi32(t[0], t[1]), u1 = _mm256_hadd_epi32(t[2], t[3]);
        int32_t v[8]; /* sumi, summ of rows 0, 1, then 2, 3 */
        _mm_storeu_si128((__m128i *)v, _mm_add_epi32(_mm256_castsi256_si128(u0), _mm256_extracti128_si256(u0, 1)));
        _mm_storeu_si128((__m128i *)(v + 4),
                         _mm_add_epi32(_mm256_castsi256_si128(u1), _mm256_extracti128_si256(u1, 1)));
        float dx = j->d[b];
        for (int r = 0; r < 4; r++) {
            const uint8_t *x = r0 + r * rb + b * nb;
            s[r] += gguf_h2f(x) * dx * (float)v[2 * r];
            s[r] -= gguf_h2f(x + 2) * dx * (float)v[2 * r + 1];
        }
    }
    for (int r = 0; r < 4; r++) y[r] = s[r];
}
#endif
#if GV_Z
/* A Q4_K / Q5_K super-block in 4 vectors of 64 codes: 64 bytes of qs hold values 128c + 0-31 and 128c + 64-95 in
 * their low nibbles, 128c + 32-63 and 128c + 96-127 in their high ones (sub-blocks 4c, 4c + 2; 4c + 1, 4c + 3), so
 * one load and a shift make two vectors; x is permuted to match (qz); Q5_K's fifth bits by immediate shifts of
 * [qh, qh >> 2]. The 8 scales and mins unpacked in SIMD words (gv_scales_k4's arithmetic: [a, c, b, c >> 4] masked,
 * the top bits of a, b), the mins' term as int16 dots with x's sums per 32 (bz). Returns the 16 int32 partial sums
 * of sumi; *mins: the 4 of summ. Exact. */
static inline __attribute__((always_inline)) __m512i gv_q45k_z(const uint8_t *x, const int8_t *qz, const int16_t *pz,
                                                               __m128i *mins, const int type) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m128i v = _mm_loadu_si128((const __m128i *)(x + 4)); /* a, b, c (and 4 bytes of qs) */
    __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4)),
                               _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2),
                               _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    __m128i sm = _mm_or_si128(lo, hi); /* bytes: scales 0-7, mins 0-7 */
    *mins = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)), _mm_loadu_si128((const __m128i *)pz));
    const __m512i sv = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
    __m512i acc = _mm512_setzero_si512(), h = _mm512_setzero_si512();
    if (type == 13) { /* [qh, qh >> 2]: bit 4c (4c + 1) of qh and 4c + 2 (4c + 3) at the same place of each half */
        __m256i q = _mm256_loadu_si256((const __m256i *)(x + 16));
        h = gv_z2(q, _mm256_srli_epi16(q, 2));
    }
    for (int c = 0; c < 2; c++) {
        __m512i p = _mm512_loadu_si512((const void *)(x + (type == 12 ? 16 : 48) + 64 * c));
        __m512i ul = _mm512_and_si512(p, m4), uh = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
        if (type == 13) { /* the fifth bits: bits 4c, 4c + 2 of qh[l] (ul's halves), 4c + 1, 4c + 3 (uh's) to bit 4 */
            const __m512i b16 = _mm512_set1_epi8(0x10);
            ul = _mm512_or_si512(ul, _mm512_and_si512(c ? h : _mm512_slli_epi16(h, 4), b16));
            uh = _mm512_or_si512(uh, _mm512_and_si512(c ? _mm512_srli_epi16(h, 1) : _mm512_slli_epi16(h, 3), b16));
        }
        /* int16 scale w in every word: its bytes 2w, 2w + 1 (w = 4c, 4c + 2 for ul's halves, 4c + 1, 4c + 3 uh's) */
        __m512i il = gv_z2(_mm256_set1_epi16((short)(0x0100 * (8 * c + 1) + 8 * c)),
                           _mm256_set1_epi16((short)(0x0100 * (8 * c + 5) + 8 * c + 4)));
        __m512i ih = _mm512_add_epi8(il, _mm512_set1_epi8(2));
        acc = gv_madd_sc_z(acc, ul, qz + 128 * c, _mm512_shuffle_epi8(sv, il));
        acc = gv_madd_sc_z(acc, uh, qz + 128 * c + 64, _mm512_shuffle_epi8(sv, ih));
    }
    return acc;
}
/* one Q4_K / Q5_K row: 4 super-blocks' sums in one reduction, then their float steps (gv_row_q45k_t's, in its order) */
static inline __attribute__((always_inline)) float gv_row_q45k_z(const GVJob *j, const uint8_t *row, const int type) {
    const int nb = type == 12 ? 144 : 176;
    float sumf = 0.0f;
    int64_t b = 0;
    for (; b < j->cols / 256; b += 4) {
        const uint8_t *x = row + b * nb;
        const int n = j->cols / 256 - b < 4 ? (int)(j->cols / 256 - b) : 4;
        for (int l = 0; l < n * nb; l += 64) _mm_prefetch((const char *)(x + GV_AHEAD + l), _MM_HINT_T1);
        __m512i a[4];
        __m128i m[4];
        for (int i = 0; i < 4; i++) {
            if (i < n) a[i] = gv_q45k_z(x + nb * i, j->qz + 256 * (b + i), j->bz + 8 * (b + i), &m[i], type);
            else a[i] = _mm512_setzero_si512(), m[i] = _mm_setzero_si128();
        }
        int32_t si[4], sm[4];
        _mm_storeu_si128((__m128i *)si, gv_hsum4_z(a[0], a[1], a[2], a[3]));
        _mm_storeu_si128((__m128i *)sm, _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3])));
        for (int i = 0; i < n; i++) {
            float dx = j->d[b + i];
            sumf += gguf_h2f(x + nb * i) * dx * (float)si[i];
            sumf -= gguf_h2f(x + nb * i + 2) * dx * (float)sm[i];
        }
    }
    return sumf;
}
static float gv_row_q4k(const GVJob *j, const uint8_t *row) { return gv_row_q45k_z(j, row, 12); }
static float gv_row_q5k(const GVJob *j, const uint8_t *row) { return gv_row_q45k_z(j, row, 13); }
#else
static float gv_row_q4k(const GVJob *j, const uint8_t *row) { return gv_row_q45k_t(j, row, 12); }
static float gv_row_q5k(const GVJob *j, const uint8_t *row) { return gv_row_q45k_t(j, row, 13); }
#endif

#if GV_Z
/* Q6_K's super-block in 4 vectors of 64 codes: V_k byte 32n + l is value 128n + 32k + l, where its ql byte (of
 * [ql[32(k & 1)..], ql[64 + 32(k & 1)..]], nibble k >> 1) and its qh byte (qh[32n + l], bits 2k) both sit, so no
 * byte moves; x is permuted once per call to match (qz). Lane i of V_k is group 8(i >> 1) + 2k + (i & 1): its int16
 * scale picked by a shuffle within the lane from [sc 0-7, sc 0-7, sc 8-15, sc 8-15]; the codes' -32 as that vector
 * against [-16 bs 0-7, -16 bs 0-7, -16 bs 8-15, -16 bs 8-15] (bz: each group twice). Exact: sumi - 32 sumb. */
static inline __attribute__((always_inline)) __m512i gv_q6k_z(const uint8_t *x, const int8_t *qz, const int16_t *bz) {
    const uint8_t *ql = x, *qh = x + 128;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 192)));
    __m512i s = _mm512_shuffle_i64x2(_mm512_castsi256_si512(s16), _mm512_castsi256_si512(s16), 0x50);
    __m512i acc = _mm512_madd_epi16(s, _mm512_loadu_si512((const void *)bz));
    __m512i qe = gv_z2(_mm256_loadu_si256((const __m256i *)ql), _mm256_loadu_si256((const __m256i *)(ql + 64)));
    __m512i qo = gv_z2(_mm256_loadu_si256((const __m256i *)(ql + 32)), _mm256_loadu_si256((const __m256i *)(ql + 96)));
    __m512i h = _mm512_loadu_si512((const void *)qh);
    __m512i v[4] = {
        _mm512_or_si512(_mm512_and_si512(qe, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30)),
        _mm512_or_si512(_mm512_and_si512(qo, m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qe, 4), m4), _mm512_and_si512(h, m30)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qo, 4), m4),
                        _mm512_and_si512(_mm512_srli_epi16(h, 2), m30))};
    for (int k = 0; k < 4; k++) { /* lane i's int16 word 2k + (i & 1) of its 8 scales, in every word */
        const __m512i pick = _mm512_broadcast_i32x4(_mm_setr_epi8(
            (char)(4 * k), (char)(4 * k + 1), (char)(4 * k), (char)(4 * k + 1), (char)(4 * k), (char)(4 * k + 1),
            (char)(4 * k), (char)(4 * k + 1), (char)(4 * k), (char)(4 * k + 1), (char)(4 * k), (char)(4 * k + 1),
            (char)(4 * k), (char)(4 * k + 1), (char)(4 * k), (char)(4 * k + 1)));
        const __m512i odd = _mm512_setr_epi64(0, 0, 0x0202020202020202LL, 0x0202020202020202LL, 0, 0,
                                              0x0202020202020202LL, 0x0202020202020202LL);
        __m512i k16 = _mm512_shuffle_epi8(s, _mm512_add_epi8(pick, odd));
        acc = gv_madd_sc_z(acc, v[k], qz + 64 * k, k16);
    }
    return acc;
}
#endif

/* Q6_K: value 128n + 32k + l, its scale sc[8n + 2k + l / 16]; codes less 32 through x's sums per 16 */
static float gv_row_q6k(const GVJob *j, const uint8_t *row) {
    const int8_t *q = j->q;
    float sumf = 0.0f;
    int64_t b = 0;
#if GV_Z
    for (; b + 3 < j->cols / 256; b += 4) { /* 4 super-blocks' sums in one reduction, then their float steps */
        const uint8_t *x = row + b * 210;
        for (int l = 0; l < 840; l += 64) _mm_prefetch((const char *)(x + GV_AHEAD + l), _MM_HINT_T1);
        int32_t v[4];
        _mm_storeu_si128((__m128i *)v, gv_hsum4_z(gv_q6k_z(x, j->qz + 256 * b, j->bz + 32 * b),
                                                  gv_q6k_z(x + 210, j->qz + 256 * b + 256, j->bz + 32 * b + 32),
                                                  gv_q6k_z(x + 420, j->qz + 256 * b + 512, j->bz + 32 * b + 64),
                                                  gv_q6k_z(x + 630, j->qz + 256 * b + 768, j->bz + 32 * b + 96)));
        for (int i = 0; i < 4; i++) sumf += gguf_h2f(x + 210 * i + 208) * j->d[b + i] * (float)v[i];
    }
#endif
    for (; b < j->cols / 256; b++) {
        const uint8_t *x = row + b * 210, *ql = x, *qh = x + 128;
        const int8_t *sc = (const int8_t *)(x + 192), *qb = q + 256 * b;
        const int32_t *bs = j->bs + 16 * b;
        int32_t sumi = 0, sumb = 0;
#if GV_Z
        (void)ql, (void)qh, (void)sc, (void)qb, (void)bs, (void)sumb;
        sumi = gv_hsum_z(gv_q6k_z(x, j->qz + 256 * b, j->bz + 32 * b));
#elif GV_SIMD
        __m256i acc = _mm256_setzero_si256();
        const __m128i s8 = _mm_loadu_si128((const __m128i *)sc);
        {
            /* the codes' -32 through x's sums per 16: sumb = sum_g sc_g bs_g, exact */
            __m256i v = _mm256_add_epi32(
                _mm256_mullo_epi32(_mm256_cvtepi8_epi32(s8), _mm256_loadu_si256((const __m256i *)bs)),
                _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)),
                                   _mm256_loadu_si256((const __m256i *)(bs + 8))));
            sumb = gv_hsum(v);
        }
        const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
        for (int n = 0; n < 2; n++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
            __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(h, 2), m30))};
            for (int k = 0; k < 4; k++) {
                int g = 8 * n + 2 * k; /* scales g (values 0-15 of the 32) and g + 1 (16-31) as int16 */
                __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ULL * (uint64_t)(g + 1)),
                                              (long long)(0x0101010101010101ULL * (uint64_t)g));
                __m256i k16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, pick));
                acc = gv_madd_sc(acc, v[k], qb + 128 * n + 32 * k, k16);
            }
        }
        sumi = gv_hsum(acc);
#else
        uint8_t u[128];
        for (int n = 0; n < 2; n++) {
            for (int l = 0; l < 32; l++) {
                uint8_t h = qh[32 * n + l];
                u[l] = (ql[64 * n + l] & 0x0f) | ((h & 3) << 4);
                u[32 + l] = (ql[64 * n + l + 32] & 0x0f) | (((h >> 2) & 3) << 4);
                u[64 + l] = (ql[64 * n + l] >> 4) | (((h >> 4) & 3) << 4);
                u[96 + l] = (ql[64 * n + l + 32] >> 4) | (((h >> 6) & 3) << 4);
            }
            for (int k = 0; k < 4; k++) {
                int g = 8 * n + 2 * k; /* the 16-groups of values 128n + 32k .. +31 */
                sumi += gv_dot32s(u + 32 * k, qb + 128 * n + 32 * k, sc[g], sc[g + 1]);
                sumb += sc[g] * bs[g] + sc[g + 1] * bs[g + 1];
            }
        }
#endif
        sumf += gguf_h2f(x + 208) * j->d[b] * (float)(sumi - 32 * sumb); /* GV_Z: sumb 0, in sumi */
    }
    return sumf;
}

#if GV_Z
/* Q2_K's super-block in 4 vectors of 64 codes, as Q6_K's: V_j byte 32n + i is value 128n + 32j + i (bits 2j of the
 * 64 bytes of qs at their place), lane L of V_j group 8(L >> 1) + 2j + (L & 1), x permuted as Q6_K's (qz). Returns
 * the 16 int32 partial sums of sumi; *mins: the 8 of summ (the mins as int16 dots with x's sums per 16, bz). */
static inline __attribute__((always_inline)) __m512i gv_q2k_z(const uint8_t *x, const int8_t *qz, const int16_t *bz,
                                                              __m256i *mins) {
    const __m128i sm = _mm_loadu_si128((const __m128i *)x), m4 = _mm_set1_epi8(0x0f);
    __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sm, m4));
    *mins = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), m4)),
                              _mm256_loadu_si256((const __m256i *)bz));
    __m512i s = _mm512_shuffle_i64x2(_mm512_castsi256_si512(s16), _mm512_castsi256_si512(s16), 0x50);
    __m512i q = _mm512_loadu_si512((const void *)(x + 16)), acc = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) { /* lane L's int16 word 2k + (L & 1) of its 8 scales, in every word */
        const __m512i pick = _mm512_add_epi8(_mm512_set1_epi16((short)(0x0100 * (4 * k + 1) + 4 * k)),
                                             _mm512_setr_epi64(0, 0, 0x0202020202020202LL, 0x0202020202020202LL, 0,
                                                               0, 0x0202020202020202LL, 0x0202020202020202LL));
        __m512i u = _mm512_and_si512(_mm512_srli_epi16(q, 2 * k), _mm512_set1_epi8(3));
        acc = gv_madd_sc_z(acc, u, qz + 64 * k, _mm512_shuffle_epi8(s, pick));
    }
    return acc;
}
static inline __m128i gv_hsum4_y(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d)); /* per half: a b c d */
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}
#endif

/* Q2_K: value 128n + 32j + i is bits 2j of qs[32n + i], in group g = 8n + 2j + i / 16 of scale (x[g] & 15) and min
 * (x[g] >> 4): w = d * sc * q - dmin * m, so the sum is d * dx * sum_g sc_g (q . xq)_g - dmin * dx * sum_g m_g bs_g */
static float gv_row_q2k(const GVJob *j, const uint8_t *row) {
    float sumf = 0.0f;
    int64_t b = 0;
#if GV_Z
    for (; b < j->cols / 256; b += 4) { /* 4 super-blocks' sums (the last 1-3) in one reduction, their float steps */
        const uint8_t *x = row + b * 84;
        const int n = j->cols / 256 - b < 4 ? (int)(j->cols / 256 - b) : 4;
        for (int l = 0; l < 84 * n; l += 64) _mm_prefetch((const char *)(x + GV_AHEAD + l), _MM_HINT_T1);
        __m512i a[4];
        __m256i m[4];
        for (int i = 0; i < 4; i++) {
            if (i < n) a[i] = gv_q2k_z(x + 84 * i, j->qz + 256 * (b + i), j->bz + 16 * (b + i), &m[i]);
            else a[i] = _mm512_setzero_si512(), m[i] = _mm256_setzero_si256();
        }
        int32_t si[4], sm[4];
        _mm_storeu_si128((__m128i *)si, gv_hsum4_z(a[0], a[1], a[2], a[3]));
        _mm_storeu_si128((__m128i *)sm, gv_hsum4_y(m[0], m[1], m[2], m[3]));
        for (int i = 0; i < n; i++) {
            float dx = j->d[b + i];
            sumf += gguf_h2f(x + 84 * i + 80) * dx * (float)si[i];
            sumf -= gguf_h2f(x + 84 * i + 82) * dx * (float)sm[i];
        }
    }
#endif
    for (; b < j->cols / 256; b++) {
        const uint8_t *x = row + b * 84, *qs = x + 16;
        const int8_t *qb = j->q + 256 * b;
        const int32_t *bs = j->bs + 16 * b;
        int32_t sumi = 0, summ = 0;
        for (int g = 0; g < 16; g++) summ += (x[g] >> 4) * bs[g];
#if GV_SIMD
        __m256i acc = _mm256_setzero_si256();
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int n = 0; n < 2; n++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int jj = 0; jj < 4; jj++) {
                int g = 8 * n + 2 * jj;
                __m256i u = _mm256_and_si256(_mm256_srli_epi16(p, 2 * jj), m3);
                acc = _mm256_add_epi32(acc, gv_dot32vm(u, qb + 128 * n + 32 * jj, x[g] & 0x0f, x[g + 1] & 0x0f));
            }
        }
        sumi = gv_hsum(acc);
#else
        uint8_t u[32];
        for (int n = 0; n < 2; n++)
            for (int jj = 0; jj < 4; jj++) {
                int g = 8 * n + 2 * jj;
                for (int i = 0; i < 32; i++) u[i] = (qs[32 * n + i] >> (2 * jj)) & 3;
                sumi += gv_dot32s(u, qb + 128 * n + 32 * jj, x[g] & 0x0f, x[g + 1] & 0x0f);
            }
#endif
        float dx = j->d[b];
        sumf += gguf_h2f(x + 80) * dx * (float)sumi;
        sumf -= gguf_h2f(x + 82) * dx * (float)summ;
    }
    return sumf;
}

#if GV_Z
/* Q3_K's super-block as Q2_K's 4 vectors, the third bits from [hmask, hmask >> 4] (bit j of half n: bit 4n + j) by
 * immediate shifts; the 16 signed scales unpacked in SIMD words (lo: s[0-7] & 15, s[0-7] >> 4; hi: s[8-11] >> 2k,
 * dword k), the codes' -4 as Q6_K's -32 (bz: -2 x x's sums per 16, each group twice). Exact: sumi - 4 sumb. */
static inline __attribute__((always_inline)) __m512i gv_q3k_z(const uint8_t *x, const int8_t *qz, const int16_t *bz) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i a = _mm_loadl_epi64((const __m128i *)(x + 96));
    __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4));
    __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)gv_u32(x + 104)), _mm_setr_epi32(0, 2, 4, 6)),
                               _mm_set1_epi8(3));
    __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
    __m256i s16 = _mm256_cvtepi8_epi16(sc);
    __m512i s = _mm512_shuffle_i64x2(_mm512_castsi256_si512(s16), _mm512_castsi256_si512(s16), 0x50);
    __m512i acc = _mm512_madd_epi16(s, _mm512_loadu_si512((const void *)bz));
    __m256i hm = _mm256_loadu_si256((const __m256i *)x);
    __m512i h = gv_z2(hm, _mm256_srli_epi16(hm, 4)), q = _mm512_loadu_si512((const void *)(x + 32));
    const __m512i b4 = _mm512_set1_epi8(4);
    for (int k = 0; k < 4; k++) { /* lane L's int16 word 2k + (L & 1) of its 8 scales, in every word */
        const __m512i pick = _mm512_add_epi8(_mm512_set1_epi16((short)(0x0100 * (4 * k + 1) + 4 * k)),
                                             _mm512_setr_epi64(0, 0, 0x0202020202020202LL, 0x0202020202020202LL, 0,
                                                               0, 0x0202020202020202LL, 0x0202020202020202LL));
        __m512i t = k == 0 ? _mm512_slli_epi16(h, 2) : k == 1 ? _mm512_slli_epi16(h, 1) : k == 2 ? h
                                                                                            : _mm512_srli_epi16(h, 1);
        __m512i u = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 2 * k), _mm512_set1_epi8(3)),
                                    _mm512_and_si512(t, b4));
        acc = gv_madd_sc_z(acc, u, qz + 64 * k, _mm512_shuffle_epi8(s, pick));
    }
    return acc;
}
#endif

/* Q3_K: value 128n + 32j + i has 2 bits (2j of qs[32n + i]) and a third (bit 4n + j of hmask[i]; clear: less 4),
 * in group g = 8n + 2j + i / 16 of 6-bit signed scale sc_g: the codes 0..7 summed, less 4 x sum_g sc_g bs_g */
static float gv_row_q3k(const GVJob *j, const uint8_t *row) {
    float sumf = 0.0f;
    int64_t b = 0;
#if GV_Z
    for (; b < j->cols / 256; b += 4) { /* as Q2_K's */
        const uint8_t *x = row + b * 110;
        const int n = j->cols / 256 - b < 4 ? (int)(j->cols / 256 - b) : 4;
        for (int l = 0; l < 110 * n; l += 64) _mm_prefetch((const char *)(x + GV_AHEAD + l), _MM_HINT_T1);
        __m512i a[4];
        for (int i = 0; i < 4; i++)
            a[i] = i < n ? gv_q3k_z(x + 110 * i, j->qz + 256 * (b + i), j->bz + 32 * (b + i)) : _mm512_setzero_si512();
        int32_t v[4];
        _mm_storeu_si128((__m128i *)v, gv_hsum4_z(a[0], a[1], a[2], a[3]));
        for (int i = 0; i < n; i++) sumf += gguf_h2f(x + 110 * i + 108) * j->d[b + i] * (float)v[i];
    }
#endif
    for (; b < j->cols / 256; b++) {
        const uint8_t *x = row + b * 110, *hm = x, *qs = x + 32, *s = x + 96;
        const int8_t *qb = j->q + 256 * b;
        const int32_t *bs = j->bs + 16 * b;
        int32_t sumi = 0, sumb = 0, sc[16];
        for (int g = 0; g < 16; g++) {
            int lo = g < 8 ? s[g] & 0x0f : s[g - 8] >> 4, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            sc[g] = (lo | (hi << 4)) - 32;
            sumb += sc[g] * bs[g];
        }
#if GV_SIMD
        __m256i acc = _mm256_setzero_si256();
        const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
        const __m256i h = _mm256_loadu_si256((const __m256i *)hm);
        for (int n = 0; n < 2; n++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int jj = 0; jj < 4; jj++) {
                int g = 8 * n + 2 * jj;
                __m256i bit = _mm256_set1_epi8((char)(1 << (4 * n + jj)));
                __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 2 * jj), m3),
                                            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), four));
                acc = _mm256_add_epi32(acc, gv_dot32vm(u, qb + 128 * n + 32 * jj, sc[g], sc[g + 1]));
            }
        }
        sumi = gv_hsum(acc);
#else
        uint8_t u[32];
        for (int n = 0; n < 2; n++)
            for (int jj = 0; jj < 4; jj++) {
                int g = 8 * n + 2 * jj;
                for (int i = 0; i < 32; i++)
                    u[i] = (uint8_t)(((qs[32 * n + i] >> (2 * jj)) & 3) | (((hm[i] >> (4 * n + jj)) & 1) << 2));
                sumi += gv_dot32s(u, qb + 128 * n + 32 * jj, sc[g], sc[g + 1]);
            }
#endif
        sumf += gguf_h2f(x + 108) * j->d[b] * (float)(sumi - 4 * sumb);
    }
    return sumf;
}

#if GV_Z && defined(__AVX512VNNI__)
/* IQ4_XS's super-block in 4 vectors: 64 bytes of qs are sub-blocks 4c .. 4c + 3, lane i of their low nibbles values
 * 0-15 of sub-block 4c + i, of their high ones 16-31 (x permuted to match: qz); the codebook plus 128 (unsigned) by
 * vpshufb, vpdpbusd, times the lane's scale as int32; the 128's term once per super-block from x's sums per 32 (bz).
 * Exact: sumi. */
static inline __attribute__((always_inline)) __m512i gv_iq4xs_z(const uint8_t *x, const int8_t *qz, const int16_t *bz,
                                                                __m128i *off) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)gguf_iq4),
                                                             _mm_set1_epi8((char)0x80)));
    __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)gv_u32(x + 4)),
                                                    _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                  _mm256_set1_epi32(15));
    __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(x[2] | x[3] << 8),
                                                    _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                  _mm256_set1_epi32(3));
    __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    /* -128 x sum_ib ls_ib x (x's sum over sub-block ib), as int16 dots: 4 int32 */
    __m128i l16 = _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
    *off = _mm_madd_epi16(l16, _mm_loadu_si128((const __m128i *)bz));
    __m512i acc = _mm512_setzero_si512();
    for (int c = 0; c < 2; c++) {
        __m512i p = _mm512_loadu_si512((const void *)(x + 8 + 64 * c));
        __m512i sc = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 2,
                              4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3),
            _mm512_castsi256_si512(ls));
        __m512i ul = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, m4));
        __m512i uh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), m4));
        __m512i v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ul, _mm512_loadu_si512((const void *)(qz + 128 * c)));
        v = _mm512_dpbusd_epi32(v, uh, _mm512_loadu_si512((const void *)(qz + 128 * c + 64)));
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(v, sc));
    }
    return acc;
}
#endif

/* IQ4_XS: 8 sub-blocks of 32 (IQ4_NL's codebook, nibbles as IQ4_NL's), each with a 6-bit scale less 32; signed
 * codebook values times x (the sign trick), exact integer sums scaled per sub-block, one fp32 step per 256 */
static float gv_row_iq4xs(const GVJob *j, const uint8_t *row) {
    float sumf = 0.0f;
    int64_t b = 0;
#if GV_Z && defined(__AVX512VNNI__)
    for (; b < j->cols / 256; b += 4) { /* as Q2_K's */
        const uint8_t *x = row + b * 136;
        const int n = j->cols / 256 - b < 4 ? (int)(j->cols / 256 - b) : 4;
        for (int l = 0; l < 136 * n; l += 64) _mm_prefetch((const char *)(x + GV_AHEAD + l), _MM_HINT_T1);
        __m512i a[4];
        __m128i m[4];
        for (int i = 0; i < 4; i++) {
            if (i < n) a[i] = gv_iq4xs_z(x + 136 * i, j->qz + 256 * (b + i), j->bz + 8 * (b + i), &m[i]);
            else a[i] = _mm512_setzero_si512(), m[i] = _mm_setzero_si128();
        }
        int32_t si[4], so[4];
        _mm_storeu_si128((__m128i *)si, gv_hsum4_z(a[0], a[1], a[2], a[3]));
        _mm_storeu_si128((__m128i *)so, _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3])));
        for (int i = 0; i < n; i++) sumf += gguf_h2f(x + 136 * i) * j->d[b + i] * (float)(si[i] - 128 * so[i]);
    }
#endif
    for (; b < j->cols / 256; b++) {
        const uint8_t *x = row + b * 136;
        const int8_t *qb = j->q + 256 * b;
        int sh = x[2] | (x[3] << 8);
        int32_t sumi = 0;
#if GV_SIMD
        __m256i acc = _mm256_setzero_si256();
#endif
        for (int ib = 0; ib < 8; ib++) {
            int32_t ls = (((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
            const uint8_t *qs = x + 8 + 16 * ib;
#if GV_SIMD
            __m256i v = gv_sdot32v(gv_nibbles(qs, gguf_iq4), _mm256_loadu_si256((const __m256i *)(qb + 32 * ib)));
            acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(v, _mm256_set1_epi32(ls)));
#else
            int32_t s = 0;
            for (int i = 0; i < 16; i++)
                s += gguf_iq4[qs[i] & 0x0f] * qb[32 * ib + i] + gguf_iq4[qs[i] >> 4] * qb[32 * ib + 16 + i];
            sumi += ls * s;
#endif
        }
#if GV_SIMD
        sumi = gv_hsum(acc);
#endif
        sumf += gguf_h2f(x) * j->d[b] * (float)sumi;
    }
    return sumf;
}

static float gv_row(const GVJob *j, const uint8_t *row) {
    switch (j->type) { /* the 32-value rows inlined per type: its constants folded */
        case 8: return gv_row32(j, row, 8, 34);
        case 2: return gv_row32(j, row, 2, 18);
        case 3: return gv_row32(j, row, 3, 20);
        case 6: return gv_row32(j, row, 6, 22);
        case 7: return gv_row32(j, row, 7, 24);
        case 20: return gv_row32(j, row, 20, 18);
        case 39: return gv_row32(j, row, 39, 17);
        case 10: return gv_row_q2k(j, row);
        case 11: return gv_row_q3k(j, row);
        case 12: return gv_row_q4k(j, row);
        case 13: return gv_row_q5k(j, row);
        case 23: return gv_row_iq4xs(j, row);
        default: return gv_row_q6k(j, row);
    }
}

static int gv_share(void *ctx, int64_t a, int64_t b) {
    const GVJob *j = (const GVJob *)ctx;
#if GV_SIMD
    switch (j->type) { /* the 32-value types: rows by 4 (AVX-512: then 2), the same bits as one at a time */
        case 8: a = gv_share_32z(j, a, b, 8, 34); break;
        case 2: a = gv_share_32z(j, a, b, 2, 18); break;
        case 3: a = gv_share_32z(j, a, b, 3, 20); break;
        case 6: a = gv_share_32z(j, a, b, 6, 22); break;
        case 7: a = gv_share_32z(j, a, b, 7, 24); break;
        case 20: a = gv_share_32z(j, a, b, 20, 18); break;
        case 39: a = gv_share_32z(j, a, b, 39, 17); break;
        default: break;
    }
#endif
#if GV_SIMD
    /* Q4_K / Q5_K: rows by 4, then pairs (the same bits); with AVX-512 only for rows of 1-2 super-blocks (a row at a
     * time measured slower there, faster from 3) */
    if ((j->type == 12 || j->type == 13) && (!GV_Z || j->cols < 768)) {
        for (; a + 3 < b; a += 4) {
            if (j->type == 12) gv_rows4_q45k_t(j, j->w + a * j->row_bytes, 12, j->y + a);
            else gv_rows4_q45k_t(j, j->w + a * j->row_bytes, 13, j->y + a);
        }
        for (; a + 1 < b; a += 2) {
            const uint8_t *r0 = j->w + a * j->row_bytes, *r1 = r0 + j->row_bytes;
            if (j->type == 12) gv_rows2_q45k_t(j, r0, r1, 12, j->y + a);
            else gv_rows2_q45k_t(j, r0, r1, 13, j->y + a);
        }
    }
#endif
    for (int64_t r = a; r < b; r++) {
        j->y[r] = gv_row(j, j->w + r * j->row_bytes);
    }
    return 0;
}

/* Q8 blocks of x: qb values per scale d = amax / 127, q = round(x / d) (to even); sums per 16 values */
void moechat_gguf_quantize_x(const float *x, int64_t cols, int64_t qb, int8_t *q, float *d, int32_t *bs) {
    for (int64_t b = 0; b < cols / qb; b++) {
        const float *xb = x + b * qb;
        float amax = 0.0f;
        for (int64_t i = 0; i < qb; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int64_t i = 0; i < qb; i++) {
            float v = nearbyintf(xb[i] * id);
            q[b * qb + i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
    }
    for (int64_t g = 0; g < cols / 16; g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * g + i];
        bs[g] = s;
    }
}

#if GV_Z
/* x for the 512-bit loops, as gv_rows_32z, gv_q45k_z and gv_q6k_z read it: the 32-value types' blocks doubled (qz)
 * with less their sums of 4 (nz); Q4_K's and Q6_K's super-blocks permuted (qz), their sums per 32 / -16 x their sums
 * per 16 (bz) */
static void gv_prep_z(int type, int64_t cols, const int8_t *q, const int32_t *bs, int8_t *qz, int32_t *nz,
                      int16_t *bz) {
    int q32 = type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 20 || type == 39;
    if (GV_ZV && q32)
        for (int64_t b = 0; b < cols / 32; b++) {
            for (int h = 0; h < 4; h++) /* [x, x] (Q8_0), [x 0-15, x 0-15, x 16-31, x 16-31] (the nibbles) */
                memcpy(qz + 64 * b + 16 * h, q + 32 * b + (type == 8 ? 16 * (h & 1) : 16 * (h >> 1)), 16);
            for (int i = 0; i < 16; i++)
                nz[16 * b + i] = -(qz[64 * b + 4 * i] + qz[64 * b + 4 * i + 1] + qz[64 * b + 4 * i + 2] +
                                   qz[64 * b + 4 * i + 3]);
        }
    /* IQ4_XS: qz[256b + 128c + 64h + 16i + l] = q[256b + 128c + 32i + 16h + l]; bz: x's sums per 32 */
    if (type == 23)
        for (int64_t b = 0; b < cols / 256; b++) {
            for (int c = 0; c < 2; c++)
                for (int h = 0; h < 2; h++)
                    for (int i = 0; i < 4; i++)
                        memcpy(qz + 256 * b + 128 * c + 64 * h + 16 * i, q + 256 * b + 128 * c + 32 * i + 16 * h, 16);
            for (int i = 0; i < 8; i++) bz[8 * b + i] = (int16_t)(bs[16 * b + 2 * i] + bs[16 * b + 2 * i + 1]);
        }
    /* Q4_K / Q5_K: qz[256b + 128c + 64h + 32t + l] = q[256b + 128c + 64t + 32h + l]; bz: x's sums per 32 */
    if (type == 12 || type == 13)
        for (int64_t b = 0; b < cols / 256; b++) {
            for (int c = 0; c < 2; c++)
                for (int h = 0; h < 2; h++)
                    for (int t = 0; t < 2; t++)
                        memcpy(qz + 256 * b + 128 * c + 64 * h + 32 * t, q + 256 * b + 128 * c + 64 * t + 32 * h, 32);
            for (int i = 0; i < 8; i++) bz[8 * b + i] = (int16_t)(bs[16 * b + 2 * i] + bs[16 * b + 2 * i + 1]);
        }
    if (type == 10) /* Q2_K: bz its sums per 16 */
        for (int64_t g = 0; g < cols / 16; g++) bz[g] = (int16_t)bs[g];
    /* Q6_K, Q2_K, Q3_K: qz[256b + 64k + 32n + l] = q[256b + 128n + 32k + l] */
    if (type == 14 || type == 10 || type == 11)
        for (int64_t b = 0; b < cols / 256; b++) {
            for (int k = 0; k < 4; k++)
                for (int n = 0; n < 2; n++) memcpy(qz + 256 * b + 64 * k + 32 * n, q + 256 * b + 128 * n + 32 * k, 32);
            for (int i = 0; i < 32 && type != 10; i++) /* -16 (Q6_K) or -2 (Q3_K) x its sums per 16, each twice */
                bz[32 * b + i] = (int16_t)((type == 14 ? -16 : -2) * bs[16 * b + (i >> 4) * 8 + (i & 7)]);
        }
}
#endif

/* a type's values and bytes per block; 0, or -1 for a type this file does not know */
static int gguf_block(int type, int64_t *blk, int64_t *nb) {
    static const int16_t table[][3] = {{0, 1, 4},      {1, 1, 2},      {2, 32, 18},    {3, 32, 20},   {6, 32, 22},
                                       {7, 32, 24},    {8, 32, 34},    {10, 256, 84},  {11, 256, 110}, {12, 256, 144},
                                       {13, 256, 176}, {14, 256, 210}, {20, 32, 18},   {23, 256, 136}, {30, 1, 2},
                                       {39, 32, 17}};
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (table[i][0] == type) {
            *blk = table[i][1];
            *nb = table[i][2];
            return 0;
        }
    return -1;
}

/* y[r] = row r of w (rows x cols of `type`) . x, through x's Q8 blocks (of 32 for the 32-value types, of 256 for the
 * k-quants and IQ4_XS). 0; -1 for a type without the kernel (the float ones) or cols not a multiple of its block;
 * -2 out of memory. */
int moechat_gguf_vecdot(int type, const float *x, const uint8_t *w, int64_t rows, int64_t cols, float *y) {
    int64_t blk, nb;
    if (gguf_block(type, &blk, &nb) || blk == 1) return -1;
    if (cols <= 0 || cols % blk || rows < 0) return -1;
    size_t bytes = (size_t)cols + sizeof(float) * (size_t)(cols / blk) + sizeof(int32_t) * (size_t)(cols / 16);
#if GV_Z
    /* qz (64 bytes a block of 32), nz (16 int32 a block), bz (32 int16 a super-block) */
    bytes += 2 * (size_t)cols + sizeof(int32_t) * (size_t)cols / 2 + sizeof(int16_t) * (size_t)cols / 8;
#elif GV_SIMD
    bytes += sizeof(int32_t) * (size_t)cols / 4; /* nz (8 int32 a block): gv_block32u's */
#endif
    /* x's Q8 blocks in a per-thread buffer that only grows: no allocation per call on the decode path */
    static __thread int8_t *held = NULL;
    static __thread size_t held_bytes = 0;
    if (bytes > held_bytes) {
        int8_t *grown = (int8_t *)realloc(held, bytes);
        if (!grown) return -2;
        held = grown;
        held_bytes = bytes;
    }
    int8_t *q = held;
    float *d = (float *)(void *)(q + cols); /* cols a multiple of 32: aligned */
    int32_t *bs = (int32_t *)(void *)(d + cols / blk);
    moechat_gguf_quantize_x(x, cols, blk, q, d, bs);
    GVJob j = {.type = type, .cols = cols, .row_bytes = cols / blk * nb, .w = w, .q = q, .d = d, .bs = bs, .y = y};
#if GV_Z
    int8_t *qz = (int8_t *)(void *)(bs + cols / 16);
    int32_t *nz = (int32_t *)(void *)(qz + 2 * cols);
    int16_t *bz = (int16_t *)(void *)(nz + cols / 2);
    gv_prep_z(type, cols, q, bs, qz, nz, bz);
    j.qz = qz, j.nz = nz, j.bz = bz;
#elif GV_SIMD
    if (GV_UNSIGNED(type)) {
        int32_t *nz = (int32_t *)(void *)(bs + cols / 16);
        gv_prep_nz(type, cols, q, nz);
        j.nz = nz;
    }
#endif
    return moechat_parallel_for(gv_share, &j, rows, 1, rows * j.row_bytes);
}

/* ---- Many tokens (prefill): y [T, rows] = x [T, cols] @ W^T, each weight decoded once for all T tokens (the pattern
 * of native_prefill.c, whose micro-kernel is file-local there): the rows cut into blocks of GP_RB = 4, a share's rows
 * decoded `big` at a time (a ~256 KB scratch, in L2) by moechat_gguf_dequant above (bit for bit dequantize), then
 * every block of GP_TB tokens (6 with AVX-512, 3 with AVX2) over each 4 rows: GP_RB x GP_TB vector accumulators of
 * fp32 FMAs along the input, one horizontal sum each at the end. The path it replaces decoded 256 rows into an fp32
 * tile and ran torch's GEMM on it.
 * Exactness: exact decoded weights times the fp32 x, summed in fp32: F.linear(x, dequantize(w)) up to the order of
 * the sum (|y - ref| <= cols * 2^-24 * sum |x w|, the worst case of a sequential sum; tested). The order is a
 * function of (t, r) alone (lanes k mod VL, a fixed horizontal sum, then the tail), so every thread count, every T
 * and every batch a token is in give the same bits. Unlike the one-token integer dots, the AVX2, AVX-512 and scalar
 * builds differ in the last bits (their lane counts differ). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(MOECHAT_SCALAR)
#include <immintrin.h>
#define GP_RB 4
#if defined(__AVX512F__)
#define GP_VL 16
#define GP_TB 6 /* 24 accumulators + 4 weights + x of 32 zmm registers */
typedef __m512 gp_vf;
#define GP_LOAD(p) _mm512_loadu_ps(p)
#define GP_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GP_ZERO() _mm512_setzero_ps()
static inline float gp_hsum(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); /* AVX-512F alone */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#else
#define GP_VL 8
#define GP_TB 3 /* 12 accumulators, the weights as FMA memory operands */
typedef __m256 gp_vf;
#define GP_LOAD(p) _mm256_loadu_ps(p)
#define GP_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GP_ZERO() _mm256_setzero_ps()
static inline float gp_hsum(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif
#else
#define GP_RB 4
#define GP_VL 1
#define GP_TB 4
typedef float gp_vf;
#define GP_LOAD(p) (*(p))
#define GP_FMA(a, b, c) ((a) * (b) + (c)) /* fp-contract off: a product, then a sum */
#define GP_ZERO() 0.0f
#define gp_hsum(v) (v)
#endif

/* y[t * ldy + r] = S[r, :] . x[t, :] for NR rows of the scratch and NT tokens */
static inline __attribute__((always_inline)) void gp_tile(const float *S, const int NR, const float *x, const int NT,
                                                          int64_t cols, float *y, int64_t ldy) {
    gp_vf acc[GP_TB][GP_RB];
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = GP_ZERO();
    int64_t kv = cols / GP_VL * GP_VL;
    for (int64_t k = 0; k < kv; k += GP_VL) {
        gp_vf w[GP_RB];
        for (int r = 0; r < NR; r++) w[r] = GP_LOAD(S + r * cols + k);
        for (int t = 0; t < NT; t++) {
            gp_vf xv = GP_LOAD(x + t * cols + k);
            for (int r = 0; r < NR; r++) acc[t][r] = GP_FMA(w[r], xv, acc[t][r]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) {
            float s = gp_hsum(acc[t][r]);
            for (int64_t k = kv; k < cols; k++) s += S[r * cols + k] * x[t * cols + k];
            y[t * ldy + r] = s;
        }
}

/* NR (1 or GP_RB) rows by nt <= GP_TB tokens, each count its own unrolled kernel */
#define GP_NT(NR)                                                                  \
    switch (nt) {                                                                  \
        case 1: gp_tile(S, NR, x, 1, cols, y, ldy); break;                         \
        case 2: gp_tile(S, NR, x, 2, cols, y, ldy); break;                         \
        case 3: gp_tile(S, NR, x, 3, cols, y, ldy); break;                         \
        case 4: gp_tile(S, NR, x, GP_TB >= 4 ? 4 : 1, cols, y, ldy); break;        \
        case 5: gp_tile(S, NR, x, GP_TB >= 5 ? 5 : 1, cols, y, ldy); break;        \
        default: gp_tile(S, NR, x, GP_TB >= 6 ? 6 : 1, cols, y, ldy); break;       \
    }

static void gp_tiles(const float *S, int nr, const float *x, int nt, int64_t cols, float *y, int64_t ldy) {
    if (nr == GP_RB) {
        GP_NT(GP_RB)
    } else {
        for (int r = 0; r < nr; r++, S += cols, y++) { GP_NT(1) }
    }
}

typedef struct {
    int type;
    int64_t blk, row_bytes, cols, T, ldy;
    const uint8_t *w;
    const float *x;
    float *y;
} GPJob;

#define GP_SCRATCH (256 << 10)
static int gp_share(void *ctx, int64_t a, int64_t b) {
    const GPJob *j = (const GPJob *)ctx;
    int64_t cols = j->cols, big = GP_SCRATCH / (4 * cols) / GP_RB * GP_RB;
    if (big < GP_RB) big = GP_RB;
    if (big > b - a) big = (b - a + GP_RB - 1) / GP_RB * GP_RB;
    size_t bytes = ((size_t)(big * cols) * sizeof(float) + 63) / 64 * 64;
    float *S = (float *)aligned_alloc(64, bytes);
    if (!S) return -2;
    int rc = 0;
    for (int64_t r0 = a; r0 < b && rc == 0; r0 += big) {
        int64_t n = b - r0 < big ? b - r0 : big;
        rc = moechat_gguf_dequant(j->type, j->w + r0 * j->row_bytes, n * (cols / j->blk), S); /* rows back to back */
        for (int64_t t0 = 0; t0 < j->T && rc == 0; t0 += GP_TB) {
            int nt = (int)(j->T - t0 < GP_TB ? j->T - t0 : GP_TB);
            for (int64_t i = 0; i < n; i += GP_RB)
                gp_tiles(S + i * cols, (int)(n - i < GP_RB ? n - i : GP_RB), j->x + t0 * cols, nt, cols,
                         j->y + t0 * j->ldy + r0 + i, j->ldy);
        }
    }
    free(S);
    return rc;
}

/* x [T, cols] fp32 contiguous, w [rows, row_bytes] of `type` -> y [T, ldy] fp32 (row r of token t at y[t * ldy + r]).
 * 0; -1 for a type this file does not decode or a shape it does not take; -2 where memory cannot be had. */
int moechat_gguf_prefill(int type, const float *x, int64_t T, const uint8_t *w, int64_t rows, int64_t cols, float *y,
                         int64_t ldy) {
    int64_t blk, nb;
    if (gguf_block(type, &blk, &nb) || cols <= 0 || cols % blk || rows < 0 || T < 0 || ldy < rows) return -1;
    if (rows == 0 || T == 0) return 0;
    GPJob j = {.type = type, .blk = blk, .row_bytes = cols / blk * nb, .cols = cols, .T = T, .ldy = ldy, .w = w,
               .x = x, .y = y};
    /* the pool's "bytes": multiply-adds / 4, as native_prefill.c's (a share of >= 256 KB is ~1M MACs) */
    return moechat_parallel_for(gp_share, &j, rows, GP_RB, rows * cols / 4 * T);
}
