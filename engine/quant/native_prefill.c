/* moechat's many-token (prefill) CPU kernels: y [T, rows] = x [T, cols] @ W^T for a packed expert projection W
 * (int4, MXFP4, FP8 block, int8), each weight decoded once for all T tokens. Compiled with native.c into one library
 * (native.py builds native.c with every native_*.c beside it); called through ctypes from quant/prefill.py.
 *
 * Design (issue 27, option b: a decoded tile and a register-blocked FMA micro-kernel, fp32 sums): the rows are cut
 * into blocks of RB = 4; a block's rows are decoded into a per-thread fp32 scratch [RB, cols] (32 KB at cols 2048: in
 * L1/L2, never RAM), bit for bit the format's weight(); then every token block of TB tokens (6 with AVX-512, 3 with
 * AVX2) runs over it: RB x TB vector accumulators, each a lane-wise fp32 sum along the input, one weight load per row
 * and one x load per token shared by RB x TB FMAs, reduced once at the end. The old path decoded the whole matrix
 * into a [rows, cols] fp32 buffer (4 bytes written and read back per weight) and ran one MKL GEMM on it.
 *
 * Exactness: every product is an exact decoded weight times an fp32 x, summed in fp32: F.linear(x, weight()) up to
 * the order of the sum (each output |y - ref| <= cols * 2^-24 * sum |w x| in the worst case, far less in practice:
 * tested). The order is a function of (t, r) alone: lanes k mod VL, then a fixed horizontal sum, then the tail; the
 * same for any T, any token or row blocking and any thread split, so the same bits at any thread count and for a
 * token whatever else is in its batch.
 *
 * Threads: the row blocks split over native.c's pool (moechat_parallel_for); each share decodes its own rows.
 *
 * AVX-512F where the compiler targets it, else AVX2 + FMA + F16C, else scalar C (MOECHAT_SCALAR forces it).
 *
 * A bf16/fp16 x through int4 (groups of 32) or MXFP4 takes native_prefill_int.c instead: integer dot products over x
 * quantized to int8 blocks (not fp32-exact; quant/prefill.py states its bound). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MOECHAT_SCALAR)
#define PF_SIMD 1
#include <immintrin.h>
#else
#define PF_SIMD 0
#endif

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

#define RB 4 /* rows decoded and multiplied together */

#if PF_SIMD && defined(__AVX512F__)
#define VL 16
#define TB 6 /* 24 accumulators + 4 weights + x of 32 zmm registers */
typedef __m512 vf;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
static inline float vhsum(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#elif PF_SIMD
#define VL 8
#define TB 3 /* 12 accumulators, the weights read as FMA memory operands */
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
static inline float vhsum(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#else
#define VL 1
#define TB 4
typedef float vf;
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VZERO() 0.0f
#define vhsum(v) (v)
#endif

/* an fp16 bit pattern -> its fp32 value exactly (int4's scales; FP8's byte trick) */
static inline float pf_f16(uint16_t h) {
#if PF_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, b;
    if (e == 31) b = sign | 0x7F800000u | m << 13;
    else if (e) b = sign | (e + 112) << 23 | m << 13;
    else if (m) {
        int k = 0;
        while (!(m & 1024)) m <<= 1, k++;
        b = sign | (uint32_t)(113 - k) << 23 | (m & 1023) << 13;
    } else b = sign;
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

/* -- the micro-kernel: y[t, r] = S[r, :] . x[t, :] for NR rows of the scratch and NT tokens ------------------------ */
static inline __attribute__((always_inline)) void tile(const float *S, const int NR, const float *x, int64_t ldx,
                                                       const int NT, int64_t cols, float *y, int64_t ldy) {
    vf acc[TB][RB];
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = VZERO();
    int64_t kv = cols / VL * VL;
    for (int64_t k = 0; k < kv; k += VL) {
        vf w[RB];
        for (int r = 0; r < NR; r++) w[r] = VLOAD(S + r * cols + k);
        for (int t = 0; t < NT; t++) {
            vf xv = VLOAD(x + t * ldx + k);
            for (int r = 0; r < NR; r++) acc[t][r] = VFMA(w[r], xv, acc[t][r]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) {
            float s = vhsum(acc[t][r]);
            for (int64_t k = kv; k < cols; k++) s += S[r * cols + k] * x[t * ldx + k];
            y[t * ldy + r] = s;
        }
}

#define TILE_NT(NR)                                                                                               \
    switch (nt) {                                                                                                 \
        case 1: tile(S, NR, x, ldx, 1, cols, y, ldy); break;                                                      \
        case 2: tile(S, NR, x, ldx, 2, cols, y, ldy); break;                                                      \
        case 3: tile(S, NR, x, ldx, 3, cols, y, ldy); break;                                                      \
        case 4: if (TB >= 4) tile(S, NR, x, ldx, TB >= 4 ? 4 : 1, cols, y, ldy); break;                           \
        case 5: if (TB >= 5) tile(S, NR, x, ldx, TB >= 5 ? 5 : 1, cols, y, ldy); break;                           \
        default: if (TB >= 6) tile(S, NR, x, ldx, TB >= 6 ? 6 : 1, cols, y, ldy); break;                          \
    }

static void tiles(const float *S, int nr, const float *x, int64_t ldx, int nt, int64_t cols, float *y, int64_t ldy) {
    if (nr == RB) {
        TILE_NT(RB)
    } else {
        for (int r = 0; r < nr; r++, S += cols, y++) { TILE_NT(1) }
    }
}

/* -- decoders: row r of W into dst [cols] fp32, bit for bit weight() --------------------------------------------- */
enum { F_INT4, F_MXFP4, F_FP8, F_INT8 };

typedef struct {
    int fmt;
    const uint8_t *w;
    const void *s;
    int64_t rows, cols, group, b0, b1;
    const float *x;
    int64_t T;
    float *y;
    int64_t ldy;
    float e8m0[256]; /* MXFP4: 2^(s - 128), the scale with E2M1's factor 1/2 folded in (magnitudes held x 2) */
} PJob;

static void int4_row(const uint8_t *qr, const uint16_t *sr, int64_t cols, int64_t group, float *o) {
    int64_t c = 0;
#if PF_SIMD
    const __m128i m0f = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const int gs = group == 32 ? 5 : group == 16 ? 4 : 3;  /* a shift, not a division per 8 elements (8, 16, 32) */
    for (; (group == 8 || group == 16 || group == 32) && c + 32 <= cols; c += 32) {
        __m128i b = _mm_loadu_si128((const __m128i *)(qr + c / 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m0f), eight);  /* even elements' q */
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m0f), eight);  /* odd ones' */
        __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);  /* elements 0-15, 16-31 */
        __m128i part[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[k]));
            _mm256_storeu_ps(o + c + 8 * k, _mm256_mul_ps(v, _mm256_set1_ps(pf_f16(sr[(c + 8 * k) >> gs]))));
        }
    }
#endif
    for (; c < cols; c++) {
        int code = (c & 1) ? (qr[c / 2] >> 4) : (qr[c / 2] & 15);
        o[c] = (float)(code - 8) * pf_f16(sr[c / group]);
    }
}

static const float E2M1_X2[8] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f};

static void mxfp4_row(const uint8_t *br, const uint8_t *sr, int64_t G, const float *e8m0, float *o) {
#if PF_SIMD
    const __m128i m0f = _mm_set1_epi8(0x0F);
    const __m256 mag = _mm256_loadu_ps(E2M1_X2);
    const __m256i eight = _mm256_set1_epi32(8);
#endif
    for (int64_t g = 0; g < G; g++, br += 16, o += 32) {
        float f = e8m0[sr[g]];
#if PF_SIMD
        __m128i c = _mm_loadu_si128((const __m128i *)br);
        __m128i lo = _mm_and_si128(c, m0f), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m0f);
        __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  /* codes of elements 0-15, 16-31 */
        __m256 fv = _mm256_set1_ps(f);
        for (int k = 0; k < 4; k++) {
            __m256i idx = _mm256_cvtepu8_epi32(k & 1 ? _mm_srli_si128(e[k / 2], 8) : e[k / 2]);
            __m256 m = _mm256_permutevar8x32_ps(mag, idx);  /* the low 3 bits: the magnitude */
            __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(idx, eight), 28));  /* bit 3: sign */
            _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(_mm256_xor_ps(m, s), fv));
        }
#else
        for (int k = 0; k < 16; k++) {
            o[2 * k] = (br[k] & 8 ? -E2M1_X2[br[k] & 7] : E2M1_X2[br[k] & 7]) * f;
            o[2 * k + 1] = (br[k] & 128 ? -E2M1_X2[(br[k] >> 4) & 7] : E2M1_X2[(br[k] >> 4) & 7]) * f;
        }
#endif
    }
}

/* e4m3 byte -> fp16 bits of its value x 2^-8 (sign-extended << 7, bit 14 cleared): exact, subnormals included; the
 * NaN bytes decode as 480, as native.c's decoder and GEMV do */
static inline uint16_t e4m3_f16(uint8_t b) { return (uint16_t)(((int16_t)(int8_t)b * 128) & 0xBFFF); }

static void fp8_row(const uint8_t *wr, const float *srow, int64_t cols, int64_t b1, float *o) {
    int64_t j = 0;
#if PF_SIMD
    const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
    const __m256 x256 = _mm256_set1_ps(256.0f);
    int64_t blk = 0, edge = b1;  /* the column block of j and where it ends */
    for (; j + 16 <= cols; j += 16) {
        while (j >= edge) blk++, edge += b1;
        if (j + 16 > edge) break;  /* a block edge inside these 16: the scalar loop from here (b1 not 16 k) */
        __m256 f = _mm256_set1_ps(srow[blk]);
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + j)));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), keep);
        __m256 v0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), x256);
        __m256 v1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), x256);
        _mm256_storeu_ps(o + j, _mm256_mul_ps(v0, f));
        _mm256_storeu_ps(o + j + 8, _mm256_mul_ps(v1, f));
    }
#endif
    for (; j < cols; j++) o[j] = pf_f16(e4m3_f16(wr[j])) * 256.0f * srow[j / b1];
}

static void int8_row(const int8_t *qr, float s, int64_t cols, float *o) {
    int64_t j = 0;
#if PF_SIMD
    __m256 sv = _mm256_set1_ps(s);
    for (; j + 8 <= cols; j += 8)
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                                  (const __m128i *)(qr + j)))), sv));
#endif
    for (; j < cols; j++) o[j] = (float)qr[j] * s;
}

static void decode_row(const PJob *j, int64_t r, float *o) {
    int64_t cols = j->cols;
    switch (j->fmt) {
        case F_INT4:
            int4_row(j->w + r * (cols / 2), (const uint16_t *)j->s + r * (cols / j->group), cols, j->group, o);
            break;
        case F_MXFP4:
            mxfp4_row(j->w + r * (cols / 2), (const uint8_t *)j->s + r * (cols / 32), cols / 32, j->e8m0, o);
            break;
        case F_FP8: {
            int64_t nb1 = (cols + j->b1 - 1) / j->b1;
            fp8_row(j->w + r * cols, (const float *)j->s + r / j->b0 * nb1, cols, j->b1, o);
            break;
        }
        default:
            int8_row((const int8_t *)j->w + r * cols, ((const float *)j->s)[r], cols, o);
    }
}

/* one share of the pool: rows [a, b) for every token. Rows are decoded `big` at a time (a ~256 KB scratch, in L2),
 * then each token block's x (TB rows of x: 48 KB at cols 2048) is used for all of them 4 rows at a time, so x is
 * read from beyond L2 once per `big` rows rather than once per 4 (at T = 128, x is 1 MB). */
#define SCRATCH_BYTES (256 << 10)
static int share(void *ctx, int64_t a, int64_t b) {
    const PJob *j = ctx;
    int64_t cols = j->cols, big = SCRATCH_BYTES / (4 * cols) / RB * RB;
    if (big < RB) big = RB;
    if (big > b - a) big = (b - a + RB - 1) / RB * RB;
    size_t bytes = ((size_t)(big * cols) * sizeof(float) + 63) / 64 * 64;
    float *S = aligned_alloc(64, bytes > 0 ? bytes : 64);
    if (!S) return -2;
    for (int64_t r0 = a; r0 < b; r0 += big) {
        int64_t n = b - r0 < big ? b - r0 : big;
        for (int64_t i = 0; i < n; i++) decode_row(j, r0 + i, S + i * cols);
        for (int64_t t0 = 0; t0 < j->T; t0 += TB) {
            int nt = (int)(j->T - t0 < TB ? j->T - t0 : TB);
            for (int64_t i = 0; i < n; i += RB)
                tiles(S + i * cols, (int)(n - i < RB ? n - i : RB), j->x + t0 * cols, cols, nt, cols,
                      j->y + t0 * j->ldy + r0 + i, j->ldy);
        }
    }
    free(S);
    return 0;
}

static int run_prefill(PJob *j) {
    if (j->rows < 0 || j->cols <= 0 || j->T < 0 || j->ldy < j->rows) return -1;
    if (j->rows == 0 || j->T == 0) return 0;
    /* work in multiply-adds / 4 as the pool's "bytes": a share of >= 256 KB is ~1M MACs (~0.1 ms), worth a thread */
    return moechat_parallel_for(share, j, j->rows, RB, j->rows * j->cols / 4 * j->T);
}

/* -- the exported kernels: x [T, cols] fp32 contiguous, y [T, ldy] fp32 (rows written at y[t * ldy + r], so w13's
 * halves go into one [T, 2I] with two calls). Return 0, -1 for a shape they do not take, -2 where memory cannot be
 * had. */
int moechat_prefill_int4(const float *x, int64_t T, const uint8_t *q, const uint16_t *scale, int64_t rows,
                         int64_t cols, int64_t group, float *y, int64_t ldy) {
    if (group <= 0 || cols % group || cols % 2) return -1;
    PJob j = {.fmt = F_INT4, .w = q, .s = scale, .rows = rows, .cols = cols, .group = group, .x = x, .T = T, .y = y,
              .ldy = ldy};
    return run_prefill(&j);
}

int moechat_prefill_mxfp4(const float *x, int64_t T, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                          int64_t cols, float *y, int64_t ldy) {
    if (cols % 32) return -1;
    PJob j = {.fmt = F_MXFP4, .w = blocks, .s = scales, .rows = rows, .cols = cols, .x = x, .T = T, .y = y,
              .ldy = ldy};
    for (int s = 0; s < 256; s++) {  /* 2^(s - 128) from its bits: a normal from s = 2, subnormals 2^-127, 2^-128 */
        uint32_t bits = s >= 2 ? (uint32_t)(s - 1) << 23 : (uint32_t)1 << (21 + s);
        memcpy(&j.e8m0[s], &bits, 4);
    }
    return run_prefill(&j);
}

int moechat_prefill_fp8(const float *x, int64_t T, const uint8_t *w, const float *scale, int64_t rows, int64_t cols,
                        int64_t b0, int64_t b1, float *y, int64_t ldy) {
    if (b0 <= 0 || b1 <= 0) return -1;
    PJob j = {.fmt = F_FP8, .w = w, .s = scale, .rows = rows, .cols = cols, .b0 = b0, .b1 = b1, .x = x, .T = T,
              .y = y, .ldy = ldy};
    return run_prefill(&j);
}

int moechat_prefill_int8(const float *x, int64_t T, const int8_t *q, const float *scale, int64_t rows, int64_t cols,
                         float *y, int64_t ldy) {
    PJob j = {.fmt = F_INT8, .w = (const uint8_t *)q, .s = scale, .rows = rows, .cols = cols, .x = x, .T = T, .y = y,
              .ldy = ldy};
    return run_prefill(&j);
}
