/* moechat's many-token kernel for bf16 experts: y [T, rows] = x [T, cols] @ W^T with x and W bf16, fp32 sums.
 * Compiled with native.c into one library; called through ctypes from quant/prefill.py (`bf16`).
 *
 * Why: in prefill each expert sees a few tokens (128 prompt tokens x top-8 / 128 experts = 8 on Qwen3-30B-A3B), and
 * torch's bf16 GEMM (MKL) runs such [8, 2048] x [2048, 1536] products at ~20 GMAC/s on one Zen 4 core, a fifth of
 * what streaming the weights once allows. Here a tile of BR = 4 rows meets BT = 6 tokens at a time: 24 zmm
 * accumulators, one weight load per row and one x load per token shared by 24 `vdpbf16ps` (AVX-512 BF16: 32
 * multiply-adds each, products of two bf16 exact in fp32), the rows re-read from L1 for the next 6 tokens; each
 * accumulator reduced once at the end. Rows split over native.c's pool (moechat_parallel_for), in multiples of 4.
 *
 * Exactness: every product exact, the sums in fp32: F.linear(x.float(), W.float()) up to the order of the sum (lane
 * i of an accumulator adds elements 32j + 2i and 32j + 2i + 1 for j = 0, 1, .., two roundings a step, then a fixed
 * reduction over the 16 lanes), within cols x 2^-24 x sum |x w| (quant/prefill.py `bound`, tested); `vdpbf16ps` treats bf16 subnormals
 * (below 2^-126) as zero and flushes subnormal results, which the bound's smallest-normal term covers. The order is
 * a function of (t, r) alone, so the same bits at any thread count, any token batching and any row split.
 *
 * Where the compiler targets AVX-512 BF16 (Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and later: native.py
 * builds with -march=native) that kernel; else, where it targets AVX2 + FMA, the same products in fp32 FMAs
 * (`ftile`): x widened to fp32 once per call (exact), each weight widened in registers by a shift (exact), FR = 3
 * rows x FT = 4 tokens = 12 ymm accumulators, each x load serving the 3 rows; lane i adds elements 8j + i in
 * order, one rounding a step, then a fixed tree over the 8 lanes: within the same `bound`, the same bits at any thread
 * count and row split. It is there for CPUs whose torch has no fast bf16 GEMM: torch 2.13 on an AVX2-only CPU multiplies
 * bf16 through `bf16_dot_with_fp32_arith`, 63% of a 128-token Qwen3-30B-A3B-shaped prefill on a Zen 2 core
 * (bench/bf16_cpu.py; figures in docs/benchmarks.md). moechat_prefill_bf16_isa(): 1 AVX-512 BF16, 2 the fp32
 * tiles, 0 none (quant/prefill.py then keeps torch's GEMM). */

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(MOECHAT_SCALAR)
#define BF_ISA 1
#include <immintrin.h>
#else
#define BF_ISA 0
#endif

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

typedef struct {
    const uint16_t *x, *w;
    int64_t T, rows, cols, ldy;
    float *y;
} BJob;

#if BF_ISA
#define BR 4 /* rows a tile */
/* prefetch: the next tile's rows into L2 while this one computes (4 KB rows each start a page, where the hardware
 * prefetcher stops), measured 1.3-1.9x over a fixed distance into L1 at 4-8 tokens (BF_NEXT=0 BF_AHEAD=bytes for
 * the A/B; prefetches past the matrix's end are harmless) */
#ifndef BF_AHEAD
#define BF_AHEAD 4096
#endif
#ifndef BF_NEXT
#define BF_NEXT 1
#endif
#ifndef BF_PF_HINT
#define BF_PF_HINT _MM_HINT_T1
#endif
#define BT 6 /* tokens a tile: 24 accumulators + 4 weights + x of 32 zmm registers */

static inline __attribute__((always_inline)) void btile(const BJob *J, int64_t r0, int nr, int64_t t0, const int NT) {
    const int64_t cols = J->cols;
    const uint16_t *wr[BR];
    for (int i = 0; i < BR; i++) wr[i] = J->w + (r0 + (i < nr ? i : 0)) * cols;  /* a short tile repeats a row */
    __m512 acc[BR][BT];
    for (int i = 0; i < BR; i++)
        for (int t = 0; t < NT; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k += 32) {
        if (t0 == 0)  /* the first token tile streams the rows in */
            for (int i = 0; i < BR; i++)
                _mm_prefetch((const char *)(wr[i] + k) + (BF_NEXT ? 2 * BR * cols : BF_AHEAD), BF_PF_HINT);
        __m512bh wv[BR];
        for (int i = 0; i < BR; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(wr[i] + k));
        for (int t = 0; t < NT; t++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(J->x + (t0 + t) * cols + k));
            for (int i = 0; i < BR; i++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xv);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < nr; i++) J->y[(t0 + t) * J->ldy + r0 + i] = _mm512_reduce_add_ps(acc[i][t]);
}

static int bshare(void *ctx, int64_t a, int64_t b) { /* rows [a, b) */
    const BJob *J = ctx;
    for (int64_t r0 = a; r0 < b; r0 += BR) {
        int nr = (int)(b - r0 < BR ? b - r0 : BR);
        for (int64_t t0 = 0; t0 < J->T; t0 += BT) {
            int nt = (int)(J->T - t0 < BT ? J->T - t0 : BT);
            switch (nt) { /* a constant token count per instance: the accumulators stay in registers */
                case 1: btile(J, r0, nr, t0, 1); break;
                case 2: btile(J, r0, nr, t0, 2); break;
                case 3: btile(J, r0, nr, t0, 3); break;
                case 4: btile(J, r0, nr, t0, 4); break;
                case 5: btile(J, r0, nr, t0, 5); break;
                default: btile(J, r0, nr, t0, BT); break;
            }
        }
    }
    return 0;
}
#endif

#if !BF_ISA && defined(__AVX2__) && defined(__FMA__) && !defined(MOECHAT_SCALAR)
#define BF_F32 1
#include <immintrin.h>
#include <stdlib.h>
#define FR 3 /* rows a tile */
#define FT 4 /* tokens a tile: 12 accumulators + 3 widened weights + one x of 16 ymm registers; 3 x 4 ran 1.1-1.25x
              * 4 x 3's GMAC/s at 8 tokens (an expert's share of a prompt) on a Zen 2 core, the same at 128 */
#ifndef FF_AHEAD
#define FF_AHEAD 1 /* prefetch the next tile's rows while the first token tile streams these in */
#endif

typedef struct {
    const float *x; /* [T, cols] fp32: x widened once */
    const uint16_t *w;
    int64_t T, rows, cols, ldy;
    float *y;
} FJob;

static inline __attribute__((always_inline)) __m256 fw8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __attribute__((always_inline)) float fsum8(__m256 v) { /* a fixed tree over the 8 lanes */
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline __attribute__((always_inline)) void ftile(const FJob *J, int64_t r0, int nr, int64_t t0, const int NT) {
    const int64_t cols = J->cols;
    const uint16_t *wr[FR];
    for (int i = 0; i < FR; i++) wr[i] = J->w + (r0 + (i < nr ? i : 0)) * cols;  /* a short tile repeats a row */
    const float *xr[FT];
    for (int t = 0; t < NT; t++) xr[t] = J->x + (t0 + t) * cols;
    __m256 acc[FR][FT];
    for (int i = 0; i < FR; i++)
        for (int t = 0; t < NT; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < cols; k += 8) {
        if (FF_AHEAD && t0 == 0 && (k & 31) == 0)  /* one line in 64 bytes of each row */
            for (int i = 0; i < FR; i++) _mm_prefetch((const char *)(wr[i] + k) + 2 * FR * cols, _MM_HINT_T1);
        __m256 wv[FR];
        for (int i = 0; i < FR; i++) wv[i] = fw8(wr[i] + k);
        for (int t = 0; t < NT; t++) {
            __m256 xv = _mm256_loadu_ps(xr[t] + k);
            for (int i = 0; i < FR; i++) acc[i][t] = _mm256_fmadd_ps(wv[i], xv, acc[i][t]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < nr; i++) J->y[(t0 + t) * J->ldy + r0 + i] = fsum8(acc[i][t]);
}

static int fshare(void *ctx, int64_t a, int64_t b) { /* rows [a, b) */
    const FJob *J = ctx;
    for (int64_t r0 = a; r0 < b; r0 += FR) {
        int nr = (int)(b - r0 < FR ? b - r0 : FR);
        for (int64_t t0 = 0; t0 < J->T; t0 += FT) {
            int nt = (int)(J->T - t0 < FT ? J->T - t0 : FT);
            switch (nt) { /* a constant token count per instance: the accumulators stay in registers */
                case 1: ftile(J, r0, nr, t0, 1); break;
                case 2: ftile(J, r0, nr, t0, 2); break;
                case 3: ftile(J, r0, nr, t0, 3); break;
                default: ftile(J, r0, nr, t0, FT); break;
            }
        }
    }
    return 0;
}
#else
#define BF_F32 0
#endif

/* x [T, cols] bf16, w [rows, cols] bf16 (both contiguous, cols a multiple of 32) -> y [T, ldy] fp32. 0; -1 for a
 * shape it does not take or a build with neither kernel. */
int moechat_prefill_bf16(const uint16_t *x, int64_t T, const uint16_t *w, int64_t rows, int64_t cols, float *y,
                         int64_t ldy) {
#if BF_ISA
    if (T < 0 || rows < 0 || cols <= 0 || cols % 32 || ldy < rows) return -1;
    if (T == 0 || rows == 0) return 0;
    BJob J = {.x = x, .w = w, .T = T, .rows = rows, .cols = cols, .ldy = ldy, .y = y};
    /* the pool's "bytes": the weights once per 6 tokens, at the fp32 tile kernel's rate per multiply-add x 2 */
    return moechat_parallel_for(bshare, &J, rows, BR, rows * cols / 8 * T);
#elif BF_F32
    if (T < 0 || rows < 0 || cols <= 0 || cols % 32 || ldy < rows) return -1;
    if (T == 0 || rows == 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)(T * cols));
    if (!xf) return -2;
    for (int64_t i = 0; i < T * cols; i += 8)  /* bf16 -> fp32: the bits moved up, exact */
        _mm256_storeu_ps(xf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                     _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i))), 16)));
    FJob J = {.x = xf, .w = w, .T = T, .rows = rows, .cols = cols, .ldy = ldy, .y = y};
    int rc = moechat_parallel_for(fshare, &J, rows, FR, rows * cols / 8 * T);
    free(xf);
    return rc;
#else
    (void)x, (void)T, (void)w, (void)rows, (void)cols, (void)y, (void)ldy;
    return -1;
#endif
}

/* 1 where this build has the AVX-512 BF16 kernel, 2 the fp32 tiles (AVX2 + FMA), else 0 */
int moechat_prefill_bf16_isa(void) { return BF_ISA ? 1 : BF_F32 ? 2 : 0; }
