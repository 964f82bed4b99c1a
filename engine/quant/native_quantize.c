/* Dense weights quantized at load (`--dense-format int8|int4`, quant/dense_quant.py `quantize_rows`): the int8 and
 * int4 formats' `quantize` (quant/intq.py) in one pass a row over the pool, bit for bit torch's ops there.
 * Compiled with native.c into one library; called through ctypes from quant/dense_quant.py.
 *
 * Why: torch's ops widen each block of rows to fp32 and pass over it five times (abs, amax, divide, round, clamp and
 * the cast); the Qwen3-30B-A3B head (151,936 x 2,048) took ~0.5 s of a 0.9 s load on a Zen 2 core, llama.cpp's load
 * of the same model 0.24 s (issue 27: load within 1.5x of llama.cpp's).
 *
 * int8, per row: s = max(amax / 127, FLT_MIN) in fp32, q = round_half_even(w / s) clamped to [-127, 127].
 * int4, per group of `group` along the row: want = max(amax / 7.5, 2^-24); the scale is the largest fp16 <= want
 * (want rounded to nearest even, one step down where that went above; never below 2^-24), codes round_half_even(w /
 * scale) clamped to [-8, 7] plus 8, element 2k in the low nibble of byte k and 2k + 1 in its high one. The same
 * IEEE divisions and roundings as torch's (no reciprocal, no fused operation), so the same bits (tested against
 * intq.py). A row with a non-finite weight, or an int4 group whose scale passes fp16's range, returns -3 and the
 * caller takes torch's path (which raises the typed error where there is one). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

static inline float qz_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a positive fp32 in [2^-24, 65504] -> fp16 bits, rounded to nearest even (as torch's .to(float16)) */
static uint16_t qz_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (x < 0x38800000u) /* under 2^-14: a subnormal fp16, f / 2^-24 rounded (the scaling is exact) */
        return (uint16_t)nearbyintf(f * 16777216.0f);
    x += 0xfffu + ((x >> 13) & 1u); /* round to nearest even at bit 13 (a carry moves into the exponent) */
    return (uint16_t)((x - 0x38000000u) >> 13); /* exponent 127 -> 15 */
}

static float qz_f16_to_f32(uint16_t h) { /* a positive fp16 -> fp32, exactly */
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    if (!e) return (float)m * 0x1p-24f;
    uint32_t b = (e + 112) << 23 | m << 13;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

typedef struct {
    const void *w;
    int bf16;
    int64_t cols, group;
    int8_t *q8;    /* int8: [rows, cols] */
    uint8_t *q4;   /* int4: [rows, cols / 2] */
    void *scale;   /* int8: fp32 [rows]; int4: fp16 bits [rows, cols / group] */
} QZJob;

static inline void qz_row(const QZJob *J, int64_t r, float *v) {
    if (J->bf16) {
        const uint16_t *w = (const uint16_t *)J->w + r * J->cols;
        int64_t i = 0;
#if QZ_SIMD
        for (; i + 8 <= J->cols; i += 8)
            _mm256_storeu_ps(v + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i))), 16)));
#endif
        for (; i < J->cols; i++) v[i] = qz_bf16(w[i]);
    } else {
        memcpy(v, (const float *)J->w + r * J->cols, sizeof(float) * (size_t)J->cols);
    }
}

#define QZ_MAX_COLS 65536 /* a row widened on the stack of the share (256 KB) */

#if defined(__AVX2__) && !defined(MOECHAT_SCALAR)
#include <immintrin.h>
#define QZ_SIMD 1
/* max |v| over n (a multiple of 8) and whether all are finite: the same value as the scalar loop (max is exact) */
static inline float qz_amax8(const float *v, int64_t n, int *finite) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        m = _mm256_max_ps(m, _mm256_and_ps(x, abs));
        __m256 z = _mm256_sub_ps(x, x); /* NaN for Inf and NaN */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
    }
    *finite = _mm256_movemask_ps(bad) == 0;
    float t[8], r = 0.0f;
    _mm256_storeu_ps(t, m);
    for (int k = 0; k < 8; k++) r = t[k] > r ? t[k] : r;
    return r;
}
/* 8 values / s rounded to nearest even and clamped to [lo, hi], as int32 lanes */
static inline __m256i qz_codes8(const float *v, __m256 s, __m256 lo, __m256 hi) {
    __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(c, lo), hi));
}
#else
#define QZ_SIMD 0
#endif

static int qz_int8(void *ctx, int64_t a, int64_t b) {
    const QZJob *J = ctx;
    float v[QZ_MAX_COLS];
    for (int64_t r = a; r < b; r++) {
        qz_row(J, r, v);
        float amax = 0.0f;
        int64_t i = 0;
#if QZ_SIMD
        int finite;
        const int64_t n8 = J->cols / 8 * 8;
        amax = qz_amax8(v, n8, &finite);
        if (!finite) return -3;
        i = n8;
#endif
        for (; i < J->cols; i++) {
            if (!isfinite(v[i])) return -3;
            float m = fabsf(v[i]);
            amax = m > amax ? m : amax;
        }
        float s = amax / 127.0f;
        if (s < FLT_MIN) s = FLT_MIN;
        ((float *)J->scale)[r] = s;
        int8_t *q = J->q8 + r * J->cols;
        i = 0;
#if QZ_SIMD
        const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        for (; i + 16 <= J->cols; i += 16) {
            __m256i a = qz_codes8(v + i, sv, lo, hi), b = qz_codes8(v + i + 8, sv, lo, hi);
            __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            __m128i x16 = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_storeu_si128((__m128i *)(q + i), _mm_packs_epi16(w16, x16));
        }
#endif
        for (; i < J->cols; i++) {
            float c = nearbyintf(v[i] / s);
            q[i] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
        }
    }
    return 0;
}

static int qz_int4(void *ctx, int64_t a, int64_t b) {
    const QZJob *J = ctx;
    float v[QZ_MAX_COLS];
    const int64_t gs = J->group, G = J->cols / gs;
    for (int64_t r = a; r < b; r++) {
        qz_row(J, r, v);
        uint16_t *sc = (uint16_t *)J->scale + r * G;
        uint8_t *q = J->q4 + r * (J->cols / 2);
        for (int64_t g = 0; g < G; g++) {
            const float *x = v + g * gs;
            float amax = 0.0f;
            int64_t i = 0;
#if QZ_SIMD
            int finite;
            amax = qz_amax8(x, gs / 8 * 8, &finite);
            if (!finite) return -3;
            i = gs / 8 * 8;
#endif
            for (; i < gs; i++) {
                if (!isfinite(x[i])) return -3;
                float m = fabsf(x[i]);
                amax = m > amax ? m : amax;
            }
            float want = amax / 7.5f;
            if (want < 0x1p-24f) want = 0x1p-24f;
            if (want > 65504.0f) return -3;
            uint16_t h = qz_f32_to_f16(want);
            float s = qz_f16_to_f32(h);
            if (s > want && s > 0x1p-24f) s = qz_f16_to_f32(--h);
            sc[g] = h;
            i = 0;
#if QZ_SIMD
            const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
            const __m256i eight = _mm256_set1_epi32(8);
            for (; i + 16 <= gs; i += 16) { /* 16 codes + 8 -> 8 bytes: even elements low nibbles, odd high */
                __m256i a = _mm256_add_epi32(qz_codes8(x + i, sv, lo, hi), eight);
                __m256i b = _mm256_add_epi32(qz_codes8(x + i + 8, sv, lo, hi), eight);
                /* lanes (e0, o0, e1, o1, ...): each 64-bit pair -> e | o << 4 */
                __m256i pa = _mm256_or_si256(a, _mm256_srli_epi64(_mm256_slli_epi64(a, 4), 32));
                __m256i pb = _mm256_or_si256(b, _mm256_srli_epi64(_mm256_slli_epi64(b, 4), 32));
                uint8_t t[32], *o = q + (g * gs + i) / 2;
                _mm256_storeu_si256((__m256i *)t, pa);
                for (int k = 0; k < 4; k++) o[k] = t[8 * k];
                _mm256_storeu_si256((__m256i *)t, pb);
                for (int k = 0; k < 4; k++) o[4 + k] = t[8 * k];
            }
#endif
            for (; i < gs; i += 2) {
                float c0 = nearbyintf(x[i] / s), c1 = nearbyintf(x[i + 1] / s);
                c0 = c0 > 7.0f ? 7.0f : c0 < -8.0f ? -8.0f : c0;
                c1 = c1 > 7.0f ? 7.0f : c1 < -8.0f ? -8.0f : c1;
                q[(g * gs + i) / 2] = (uint8_t)((int)c0 + 8) | (uint8_t)(((int)c1 + 8) << 4);
            }
        }
    }
    return 0;
}

/* w [rows, cols] (bf16 when w_bf16, else fp32), contiguous. int8: q [rows, cols], scale fp32 [rows]. 0; -1 a shape
 * it does not take; -3 a non-finite weight (nothing promised about what was written). */
int moechat_quantize_int8(const void *w, int w_bf16, int64_t rows, int64_t cols, int8_t *q, float *scale) {
    if (rows < 0 || cols <= 0 || cols > QZ_MAX_COLS) return -1;
    QZJob J = {.w = w, .bf16 = w_bf16, .cols = cols, .q8 = q, .scale = scale};
    return moechat_parallel_for(qz_int8, &J, rows, 1, rows * cols * (w_bf16 ? 2 : 4));
}

/* int4 in groups of `group` (cols a multiple of it, group even): q [rows, cols / 2], scale fp16 bits
 * [rows, cols / group]. -3 also for a group whose scale passes fp16's range. */
int moechat_quantize_int4(const void *w, int w_bf16, int64_t rows, int64_t cols, int64_t group, uint8_t *q,
                          uint16_t *scale) {
    if (rows < 0 || cols <= 0 || cols > QZ_MAX_COLS || group <= 0 || group % 2 || cols % group) return -1;
    QZJob J = {.w = w, .bf16 = w_bf16, .cols = cols, .group = group, .q4 = q, .scale = scale};
    return moechat_parallel_for(qz_int4, &J, rows, 1, rows * cols * (w_bf16 ? 2 : 4));
}
