/* moechat's many-token integer kernels for the 4-bit expert formats and int8: y [T, rows] = x [T, cols] @ W^T for an
 * int4 (groups of 32), MXFP4 or int8 (a scale per row) projection W, with x quantized once per call to int8 per 32-element block (Q8_0's layout:
 * q = round(x / d), d = max |x| / 127, an fp32 d per block) and every block's dot product summed in integers.
 * Compiled with native.c into one library; called through ctypes from quant/prefill.py.
 *
 * Design (issue 27, option c, as llama.cpp's Q4_0 x Q8_0): weights are unsigned bytes u with an offset o (int4: the
 * code 0..15, o = 8; MXFP4: a 16-entry byte table of the E2M1 value x 2 plus 12, 0..24, o = 12; int8: q + 128,
 * o = 128, its row scale standing as every block's), so
 * sum_k (u_k - o) q_k = sum_k u_k q_k - o sum_k q_k: the second term is a per-(token, block) integer computed with x's
 * quantization, and the first is what `vpdpbusd` (u8 x s8, 4 products a 32-bit lane) computes. A group of RG rows
 * (16 with AVX-512, 8 otherwise) is decoded once per call into a per-thread byte scratch laid out
 * [block][chunk of 4 inputs][row][4]: one vector of it holds 4 inputs of RG rows, and one broadcast 32-bit word of a
 * token's q meets all of them, so a lane is one output and no horizontal sum is needed. Within a block the inputs
 * are taken in the packed order (the low nibbles, even elements, then the high ones); x's blocks are permuted to
 * match once, at quantization. Per block, each lane's exact int32 sum is converted to fp32 and accumulated with one
 * FMA: acc = fma(float(isum), ws x xs, acc), ws the weight's scale (int4: its fp16 scale; MXFP4: 2^(s - 128), the
 * x 2 folded in), xs the token's; the blocks in order. That is 64 multiply-adds a `vpdpbusd` against the decoded
 * tile's 16 an fp32 FMA.
 *
 * Exactness: not fp32-exact, x is rounded to 8 bits. Per output, against F.linear(x, weight()) in exact arithmetic:
 * |y - ref| <= sum_b xs_b (1/2 + 2^-15) sum_{k in b} |w_k| + (G + 1) 2^-24 sum_k |w_k| (|x_k| + xs_b(k)) (+ a few
 * smallest normals where scales underflow): the rounding of x, then the products' scale (ws x xs rounded once) and
 * the fp32 sum over the G blocks (quant/prefill.py `bound_q8`, tested). The integer sums are exact, and every step
 * after them is the same IEEE operation on every build (the fma, ws x xs, the block order), so the AVX-512 VNNI,
 * AVX-VNNI, AVX2 and scalar builds write the same bits, and the order is a function of (t, r) alone: the same bits
 * at any thread count and any token batching.
 *
 * Dispatch at compile time, as native.py's -march=native targets the CPU: AVX-512 F+BW+VNNI (zmm vpdpbusd, 16 rows x
 * 8 tokens), else AVX2 with AVX-VNNI (ymm vpdpbusd, 8 rows x 4 tokens), else AVX2 (vpmaddubsw + vpmaddwd: u8 x s8
 * pairs into int16, summed in int16 as far as they cannot saturate (codes <= 15: a block's 8 chunks, 8 x 2 x 15 x 127
 * = 30480; MXFP4's <= 24: 4; Q6_K's <= 63: 2) before one vpmaddwd widens them: on Zen 2 both multiplies issue on one
 * port, so 9 of them a token and block instead of 10 is 9% of the int4 tile; int8 there keeps q signed and multiplies
 * |q| by x carrying q's sign (vpsignb), a pair at most 2 x 128 x 127, widened at once), else scalar C (MOECHAT_SCALAR
 * forces it). Each tile's inner loop is one instance per format kind (no branch inside it) with a register barrier on
 * its int16 chains: otherwise GCC hoists the loads shared by the kinds above the branch and re-associates the chains
 * into trees, and the tile spilled its sums to the stack (1.23x on the int4 tile at 128 tokens once fixed). Threads:
 * row groups over native.c's pool (moechat_parallel_for). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(MOECHAT_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IQ_ISA 3
#elif !defined(MOECHAT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define IQ_ISA 2
#elif !defined(MOECHAT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define IQ_ISA 1
#else
#define IQ_ISA 0
#endif
#if IQ_ISA
#include <immintrin.h>
/* v held in a register at this point: keeps the compiler from reassociating a chain of integer adds into a tree of
 * independent products (the AVX2 tiles below spilled their partial sums to the stack that way) */
#define KEEP(v) __asm__ volatile("" : "+x"(v))
#endif

#if IQ_ISA == 3
#define RG 16 /* rows a vector holds (one int32 lane each) */
#define TBQ 8 /* tokens a kernel call holds: 8 int32 + 8 fp32 accumulators */
#else
#define RG 8
#define TBQ 4 /* 16 ymm registers: 4 int32 + 4 fp32 accumulators (+ 4 int16 partials for maddubs) */
#endif

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);
int moechat_parallel_for_chunks(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                                int64_t bytes, int64_t per_thread);
void moechat_moe_act_row(float *g, const void *b13, int bias_kind, int64_t I, int act, int bf16, int64_t vec,
                         float limit, float alpha, void *a);

/* the code -> unsigned byte maps (the weight is (u - offset) x the block's scale) */
static const uint8_t U_INT4[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const uint8_t U_MXFP4[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}; /* 2 x E2M1 + 12 */
/* the GGUF block types: rows of blocks of 32 as the file stores them (Q8_0: fp16 d + 32 int8; Q4_0: fp16 d + 16
 * bytes, element i in the low nibble of byte i, element 16 + i in its high one, code - 8; MXFP4: an E8M0 byte + 16
 * such bytes of E2M1 codes), each element in order (x unpermuted) */
enum { Q_INT4, Q_MXFP4, Q_INT8, Q_G8_0, Q_G4_0, Q_GMXFP4, Q_G4K, Q_G6K, Q_G5K };
/* Q4_K: super-blocks of 256 in 144 bytes (fp16 d, dmin, 12 bytes of 6-bit scales and mins, then 128 bytes: values
 * 64c.. in the low nibbles of bytes 32c.., 64c + 32.. in their high ones), w = d sc_j q - dmin m_j per 32 (sub-block
 * j): each 32 a block here, its codes u = q (offset 0), WS = d sc_j, and a second term per block, - (dmin m_j) x
 * (xs x sum q) from x's block sum (quantize_block with offset -1 leaves +sum q in xc). Q5_K: the same in 176 bytes
 * (qh[32] between the scales and the 128 bytes of low nibbles), bit j of qh[l] each code's fifth: u = 0..31.
 * Q6_K: super-blocks of 256 in 210 bytes (ql[128]: low 4 bits, qh[64]: high 2, int8 scales[16] one per 16 values,
 * fp16 d), w = d sc (q - 32), q 0..63: each 32 a block here, u = q, its two halves' scales WS = d sc_2j (inputs
 * 0..15) and WM = d sc_2j+1 (16..31), each half's int sum started at -32 x its x sum (quantize_block with offset -2
 * packs the two 16-element sums of q into xc, low then high int16) and scaled apart: two FMAs a block */
#define SIGNED_Q(f) ((f) == Q_INT8 || (f) == Q_G8_0) /* int8 codes: the AVX2 build multiplies them signed */
#define GGUF_Q(f) ((f) >= Q_G8_0)
#define KQ(f) ((f) == Q_G4K || (f) == Q_G5K || (f) == Q_G6K) /* super-blocks of 256 */
#define CODES_15(f) ((f) == Q_INT4 || (f) == Q_G4_0 || (f) == Q_G4K) /* unsigned codes 0..15 */
/* int8 weights: VNNI and scalar builds take u = q + 128 (offset 128); the AVX2 build keeps q signed (offset 0) and
 * multiplies |q| by x with q's sign (vpsignb), since u8 pairs of 255 x 127 would saturate vpmaddubsw's int16 */
#if IQ_ISA == 1
#define INT8_OFFSET 0
#else
#define INT8_OFFSET 128
#endif

typedef struct {
    int fmt;
    const uint8_t *w;  /* codes [rows, cols / 2]; int8: [rows, cols] */
    const void *s;     /* int4: fp16 [rows, G]; MXFP4: E8M0 bytes [rows, G]; int8: fp32 [rows] */
    int64_t rows, cols, G, T, ldy;
    int64_t rb;        /* GGUF: bytes a row */
    const uint8_t *w_hi; /* GGUF: rows from `split` on come from here (up's rows after gate's), else NULL */
    int64_t split;
    const int8_t *xq;  /* [T, cols], each block permuted to the packed order */
    const float *xs;   /* [T, G] */
    const int32_t *xc; /* [T, G]: -offset x sum of the block's q */
    float *y;
    const float *e8m0; /* MXFP4: [256] 2^(s - 128) */
} QJob;

static inline float q_f16(uint16_t h) { /* an fp16 bit pattern -> its fp32 value, exactly (the scalar build's) */
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
}

static inline float h2f(uint16_t h) { /* q_f16 by the F16C instruction where the build has it (the same value) */
#if IQ_ISA
    return _cvtsh_ss(h);
#else
    return q_f16(h);
#endif
}

/* x [T, cols] fp32 -> q int8 (the block's elements in the packed order: even ones, then odd ones; in order for int8
 * weights, `perm` 0), xs, xc. Per
 * block, m = max |x|: q = round(x x fl(127 / m)) to nearest even in fp32 (|q| <= 127), xs = fl(m / 127); the same
 * fp32 operations on every build (quant/prefill.py `round_x8` is the reference). m under 2^-100 (127 / m would pass
 * fp32's range) rounds in double instead; a block with a non-finite element gets xs = NaN (its outputs NaN, as the
 * reference's), an all-zero one q = 0. */
#define Q_TINY 0x1p-100f
static void quantize_block(const float *v, int offset, int perm, int8_t *o, float *xs, int32_t *xc) {
    float amax = 0.0f;
    int bad = 0;
    int32_t q[32], sum = 0;
#if IQ_ISA == 3
    __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));  /* NaN-free when finite */
    __m512 z0 = _mm512_mul_ps(v0, _mm512_setzero_ps()), z1 = _mm512_mul_ps(v1, _mm512_setzero_ps());
    bad = (_mm512_cmp_ps_mask(z0, z0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(z1, z1, _CMP_UNORD_Q)) != 0;
#elif IQ_ISA
    __m256 v4[4], m = _mm256_setzero_ps(), z = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int k = 0; k < 4; k++) {
        v4[k] = _mm256_loadu_ps(v + 8 * k);
        m = _mm256_max_ps(m, _mm256_and_ps(v4[k], abs));
        __m256 zk = _mm256_mul_ps(v4[k], _mm256_setzero_ps());
        z = _mm256_or_ps(z, _mm256_cmp_ps(zk, zk, _CMP_UNORD_Q));
    }
    bad = _mm256_movemask_ps(z) != 0;
    float mm[8];
    _mm256_storeu_ps(mm, m);
    for (int k = 0; k < 8; k++) amax = mm[k] > amax ? mm[k] : amax;
#else
    for (int k = 0; k < 32; k++) {
        amax = fmaxf(amax, fabsf(v[k]));
        bad |= !isfinite(v[k]);
    }
#endif
    if (bad || amax == 0.0f) {
        memset(o, 0, 32);
        *xs = bad ? NAN : 0.0f;
        *xc = 0;
        return;
    }
    if (amax < Q_TINY) {
        double inv = 127.0 / (double)amax;
        for (int k = 0; k < 32; k++) q[k] = (int32_t)nearbyint((double)v[k] * inv);
    } else {
        float inv = 127.0f / amax;
#if IQ_ISA == 3
        __m512 iv = _mm512_set1_ps(inv);
        _mm512_storeu_si512(q, _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)));  /* nearest even (MXCSR's default) */
        _mm512_storeu_si512(q + 16, _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv)));
#elif IQ_ISA
        __m256 iv = _mm256_set1_ps(inv);
        for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(q + 8 * k), _mm256_cvtps_epi32(_mm256_mul_ps(v4[k], iv)));
#else
        for (int k = 0; k < 32; k++) q[k] = (int32_t)nearbyintf(v[k] * inv);
#endif
    }
    int32_t lo = 0; /* elements 0..15 (Q6_K's first half) */
    for (int p = 0; p < 16; p++) {
        o[perm ? p : 2 * p] = (int8_t)q[2 * p];
        o[perm ? 16 + p : 2 * p + 1] = (int8_t)q[2 * p + 1];
        sum += q[2 * p] + q[2 * p + 1];
        if (p == 7) lo = sum;
    }
    *xs = amax / 127.0f;
    *xc = offset == -2 ? (int32_t)((uint32_t)(uint16_t)(int16_t)lo | (uint32_t)(uint16_t)(int16_t)(sum - lo) << 16)
                       : -offset * sum;
}

typedef struct {
    const float *x;
    int64_t cols, G;
    int offset, perm;
    int8_t *xq;
    float *xs;
    int32_t *xc;
} XJob;

static int xshare(void *ctx, int64_t a, int64_t b) { /* tokens [a, b) */
    const XJob *X = ctx;
    for (int64_t t = a; t < b; t++)
        for (int64_t g = 0; g < X->G; g++)
            quantize_block(X->x + t * X->cols + g * 32, X->offset, X->perm, X->xq + t * X->cols + g * 32,
                           X->xs + t * X->G + g, X->xc + t * X->G + g);
    return 0;
}

#if IQ_ISA == 3
typedef __m512i RV; /* RG rows' dwords, one a 32-bit lane */
#elif IQ_ISA
typedef __m256i RV;
#endif
#if IQ_ISA
/* the 16 bytes at `off` of each of the RG rows (a NULL row reads zeros) -> D[m]: dword m of every row, row i in
 * lane i (a 4 x 4 dword transpose in each 128-bit lane) */
static inline __attribute__((always_inline)) void rows_dwords(const uint8_t *const *rp, int64_t off, RV D[4]) {
    static const uint8_t zeros[16] = {0};
    __m128i R[RG];
    for (int i = 0; i < RG; i++) R[i] = _mm_loadu_si128((const __m128i *)(rp[i] ? rp[i] + off : zeros));
#if IQ_ISA == 3
    __m512i Z[4]; /* Z[c] = rows c, c + 4, c + 8, c + 12 in its four 128-bit lanes */
    for (int c = 0; c < 4; c++)
        Z[c] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(R[c]), R[c + 4], 1),
                                                     R[c + 8], 2), R[c + 12], 3);
    __m512i t0 = _mm512_unpacklo_epi32(Z[0], Z[1]), t1 = _mm512_unpackhi_epi32(Z[0], Z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(Z[2], Z[3]), t3 = _mm512_unpackhi_epi32(Z[2], Z[3]);
    D[0] = _mm512_unpacklo_epi64(t0, t2), D[1] = _mm512_unpackhi_epi64(t0, t2);
    D[2] = _mm512_unpacklo_epi64(t1, t3), D[3] = _mm512_unpackhi_epi64(t1, t3);
#else
    __m256i Z[4]; /* Z[c] = rows c, c + 4 */
    for (int c = 0; c < 4; c++) Z[c] = _mm256_inserti128_si256(_mm256_castsi128_si256(R[c]), R[c + 4], 1);
    __m256i t0 = _mm256_unpacklo_epi32(Z[0], Z[1]), t1 = _mm256_unpackhi_epi32(Z[0], Z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(Z[2], Z[3]), t3 = _mm256_unpackhi_epi32(Z[2], Z[3]);
    D[0] = _mm256_unpacklo_epi64(t0, t2), D[1] = _mm256_unpackhi_epi64(t0, t2);
    D[2] = _mm256_unpacklo_epi64(t1, t3), D[3] = _mm256_unpackhi_epi64(t1, t3);
#endif
}
#endif

/* int8 rows [r0, r0 + nr) -> W [G][8][RG][4] bytes (chunk j of a block: its inputs 4j..4j + 3, in order; u = q + 128,
 * or q itself in the AVX2 build), WS [G][RG] the row scales */
static void decode_group_int8(const QJob *J, int64_t r0, int nr, uint8_t *W, float *WS) {
    const int64_t G = J->G, cols = J->cols;
    const float *sc = (const float *)J->s + r0;
    for (int64_t b = 0; b < G; b++)
        for (int i = 0; i < RG; i++) WS[b * RG + i] = i < nr ? sc[i] : 0.0f;
    const uint8_t *rp[RG];
    for (int i = 0; i < RG; i++) rp[i] = i < nr ? J->w + (r0 + i) * cols : NULL;
#if IQ_ISA
#if IQ_ISA == 3
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#elif IQ_ISA == 2
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#else
    const __m256i flip = _mm256_setzero_si256();  /* q stays signed */
#endif
    for (int64_t b = 0; b < G; b++, W += 8 * RG * 4)
        for (int h = 0; h < 2; h++) { /* the block's 16-byte halves: chunks 4h .. 4h + 3 */
            RV D[4];
            rows_dwords(rp, b * 32 + 16 * h, D);
            for (int m = 0; m < 4; m++) {
#if IQ_ISA == 3
                _mm512_store_si512((__m512i *)(W + (4 * h + m) * 64), _mm512_xor_si512(D[m], flip));
#else
                _mm256_store_si256((__m256i *)(W + (4 * h + m) * 32), _mm256_xor_si256(D[m], flip));
#endif
            }
        }
#else
    for (int64_t b = 0; b < G; b++)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < RG; i++)
                for (int k = 0; k < 4; k++)
                    W[((b * 8 + j) * RG + i) * 4 + k] = rp[i] ? (uint8_t)(rp[i][b * 32 + 4 * j + k] ^ 0x80) : 0;
#endif
}

/* the fp16 at p[i] (0 where p[i] is NULL) for RG rows -> their fp32 values in ws (exact). Built in a register
 * (a 16-bit store per row then a vector load of them stalls on store forwarding, ~1/5 of a group's decode) */
static inline uint16_t ld16(const uint8_t *p) {
    uint16_t h = 0;
    if (p) memcpy(&h, p, 2);
    return h;
}

static inline void halves_to_ws(const uint8_t *const *p, float *ws) {
#if IQ_ISA
    for (int i = 0; i < RG; i += 8) {
        __m128i h = _mm_setr_epi16((short)ld16(p[i]), (short)ld16(p[i + 1]), (short)ld16(p[i + 2]),
                                   (short)ld16(p[i + 3]), (short)ld16(p[i + 4]), (short)ld16(p[i + 5]),
                                   (short)ld16(p[i + 6]), (short)ld16(p[i + 7]));
        _mm256_store_ps(ws + i, _mm256_cvtph_ps(h));
    }
#else
    for (int i = 0; i < RG; i++) ws[i] = q_f16(ld16(p[i]));
#endif
}

/* int4's fp16 scales of rows [0, nr) of sc [rows, G] -> WS [G][RG] fp32 (rows past nr 0): 8 blocks of 8 rows at a
 * time transposed in registers, the rest (G % 8) row by row */
static void int4_scales(const uint16_t *sc, int64_t G, int nr, float *WS) {
    int64_t b = 0;
#if IQ_ISA
    for (; b + 8 <= G; b += 8)
        for (int i0 = 0; i0 < RG; i0 += 8) {
            __m128i r[8], t[8], u[8];
            for (int i = 0; i < 8; i++)
                r[i] = i0 + i < nr ? _mm_loadu_si128((const __m128i *)(sc + (i0 + i) * G + b)) : _mm_setzero_si128();
            for (int i = 0; i < 8; i += 2)
                t[i] = _mm_unpacklo_epi16(r[i], r[i + 1]), t[i + 1] = _mm_unpackhi_epi16(r[i], r[i + 1]);
            /* t[2q]: rows 2q, 2q + 1 of blocks 0..3; t[2q + 1]: of blocks 4..7 */
            for (int q = 0; q < 2; q++)
                for (int hb = 0; hb < 2; hb++) {
                    const __m128i a = t[4 * q + hb], c = t[4 * q + 2 + hb];
                    u[4 * q + 2 * hb] = _mm_unpacklo_epi32(a, c), u[4 * q + 2 * hb + 1] = _mm_unpackhi_epi32(a, c);
                }
            /* u[4q + m]: rows 4q..4q + 3 of blocks 2m, 2m + 1 */
            for (int m = 0; m < 4; m++) {
                __m128i lo = _mm_unpacklo_epi64(u[m], u[4 + m]), hi = _mm_unpackhi_epi64(u[m], u[4 + m]);
                _mm256_store_ps(WS + (b + 2 * m) * RG + i0, _mm256_cvtph_ps(lo));
                _mm256_store_ps(WS + (b + 2 * m + 1) * RG + i0, _mm256_cvtph_ps(hi));
            }
        }
#endif
    for (; b < G; b++) {
        const uint8_t *p[RG];
        for (int i = 0; i < RG; i++) p[i] = i < nr ? (const uint8_t *)(sc + i * G + b) : NULL;
        halves_to_ws(p, WS + b * RG);
    }
}

/* Q4_K / Q5_K rows (base[i], NULL past the group) -> W as the others, WS = d sc_j and WM = dmin m_j per block of 32;
 * Q5_K (`five`: 176 bytes, qh[32] before qs) adds bit j of qh[l] as each code's fifth (u = 0..31) */
static void decode_group_q45k(const QJob *J, const uint8_t *const *base, uint8_t *W, float *WS, const int five) {
    const int64_t G = J->G, sbytes = five ? 176 : 144, qs_at = five ? 48 : 16;
    float *WM = WS + G * RG;
    const uint8_t *rp[RG], *rh[RG];
#if IQ_ISA == 3
    const __m512i m0f = _mm512_set1_epi8(0x0F), b01 = _mm512_set1_epi8(0x01);
#elif IQ_ISA
    const __m256i m0f = _mm256_set1_epi8(0x0F), b01 = _mm256_set1_epi8(0x01);
#endif
    float d[RG], dmin[RG]; /* the super-block's, per row */
    for (int64_t b = 0; b < G; b++, W += 8 * RG * 4) {
        const int64_t sb = b / 8;
        const int j = (int)(b % 8);
        for (int i = 0; i < RG; i++) {
            if (!base[i]) {
                rp[i] = rh[i] = NULL, WS[b * RG + i] = 0.0f, WM[b * RG + i] = 0.0f;
                continue;
            }
            const uint8_t *blk = base[i] + sb * sbytes, *sc = blk + 4;
            if (j == 0) d[i] = h2f((uint16_t)(blk[0] | blk[1] << 8)), dmin[i] = h2f((uint16_t)(blk[2] | blk[3] << 8));
            int s6, m6;
            if (j < 4) s6 = sc[j] & 63, m6 = sc[j + 4] & 63;
            else s6 = (sc[j + 4] & 0xF) | (sc[j - 4] >> 6) << 4, m6 = (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
            WS[b * RG + i] = d[i] * (float)s6;
            WM[b * RG + i] = dmin[i] * (float)m6;
            rp[i] = blk + qs_at + 32 * (j / 2);
            rh[i] = blk + 16;
        }
        const int hi = j & 1;
#if IQ_ISA
        const __m128i jsh = _mm_cvtsi32_si128(j);
        for (int h = 0; h < 2; h++) {
            RV D[4], Q[4];
            rows_dwords(rp, 16 * h, D);
            if (five) rows_dwords(rh, 16 * h, Q);
            for (int m = 0; m < 4; m++) {
#if IQ_ISA == 3
                __m512i u = hi ? _mm512_and_si512(_mm512_srli_epi32(D[m], 4), m0f) : _mm512_and_si512(D[m], m0f);
                if (five) /* bit j of each qh byte -> bit 4 (a 32-bit shift moves it within its byte) */
                    u = _mm512_or_si512(u, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(Q[m], jsh), b01), 4));
                _mm512_store_si512((__m512i *)(W + (4 * h + m) * 64), u);
#else
                __m256i u = hi ? _mm256_and_si256(_mm256_srli_epi32(D[m], 4), m0f) : _mm256_and_si256(D[m], m0f);
                if (five)
                    u = _mm256_or_si256(u, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(Q[m], jsh), b01), 4));
                _mm256_store_si256((__m256i *)(W + (4 * h + m) * 32), u);
#endif
            }
        }
#else
        for (int c = 0; c < 8; c++)
            for (int i = 0; i < RG; i++)
                for (int k = 0; k < 4; k++)
                    W[(c * RG + i) * 4 + k] = rp[i] ? (uint8_t)((hi ? rp[i][4 * c + k] >> 4 : rp[i][4 * c + k] & 15)
                                                                | (five ? (rh[i][4 * c + k] >> j & 1) << 4 : 0)) : 0;
#endif
    }
}

/* Q6_K rows (base[i], NULL past the group) -> W as the others (u = q, 0..63), WS and WM the halves' d x sc */
static void decode_group_q6k(const QJob *J, const uint8_t *const *base, uint8_t *W, float *WS) {
    const int64_t G = J->G;
    float *WM = WS + G * RG;
    _Alignas(64) uint8_t u[RG][32]; /* each row's 32 codes of the block, in element order */
    const uint8_t *up[RG];
    for (int i = 0; i < RG; i++) up[i] = base[i] ? u[i] : NULL;
    float dr[RG]; /* the super-block's d, per row */
    for (int64_t b = 0; b < G; b++, W += 8 * RG * 4) {
        const int64_t sb = b / 8;
        const int j = (int)(b % 8), n = j / 4, m = j % 4; /* values 128n + 32m + l: ql[64n + 32(m & 1) + l], its
                                                             * high nibble from m = 2; qh[32n + l] >> 2m */
        for (int i = 0; i < RG; i++) {
            if (!base[i]) {
                WS[b * RG + i] = 0.0f, WM[b * RG + i] = 0.0f;
                continue;
            }
            const uint8_t *blk = base[i] + sb * 210, *ql = blk + 64 * n + 32 * (m & 1), *qh = blk + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * n + 2 * m;
            if (j == 0) dr[i] = h2f((uint16_t)(blk[208] | blk[209] << 8));
            WS[b * RG + i] = dr[i] * (float)sc[0], WM[b * RG + i] = dr[i] * (float)sc[1]; /* exact: 11 x 8 bits */
#if IQ_ISA
            const __m256i l = _mm256_loadu_si256((const __m256i *)ql), h = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i lo = _mm256_and_si256(m >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(m == 3 ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 4 - 2 * m),
                                                _mm256_set1_epi8(0x30));
            _mm256_store_si256((__m256i *)u[i], _mm256_or_si256(lo, hi));
#else
            for (int k = 0; k < 32; k++)
                u[i][k] = (uint8_t)(((m >= 2 ? ql[k] >> 4 : ql[k]) & 15) | ((qh[k] >> (2 * m)) & 3) << 4);
#endif
        }
#if IQ_ISA
        for (int hh = 0; hh < 2; hh++) {
            RV D[4];
            rows_dwords(up, 16 * hh, D);
            for (int q = 0; q < 4; q++)
#if IQ_ISA == 3
                _mm512_store_si512((__m512i *)(W + (4 * hh + q) * 64), D[q]);
#else
                _mm256_store_si256((__m256i *)(W + (4 * hh + q) * 32), D[q]);
#endif
        }
#else
        for (int c = 0; c < 8; c++)
            for (int i = 0; i < RG; i++)
                for (int k = 0; k < 4; k++) W[(c * RG + i) * 4 + k] = up[i] ? u[i][4 * c + k] : 0;
#endif
    }
}

/* GGUF rows [r0, r0 + nr) -> W, WS as the other decoders lay them out: per block, each row's 32 codes as unsigned
 * bytes in element order (Q8_0: q + 128, or q itself in the AVX2 build; Q4_0: the code; MXFP4: 2 x E2M1 + 12),
 * loaded from the blocks where they lie and transposed in registers (Q4_0 / MXFP4: dword m of the 16 code bytes
 * holds elements 4m..4m+3 in its low nibbles and 16 + 4m.. in its high ones: chunks m and 4 + m) */
static void decode_group_gguf(const QJob *J, int64_t r0, int nr, uint8_t *W, float *WS) {
    const int64_t G = J->G, bs = J->fmt == Q_G8_0 ? 34 : J->fmt == Q_G4_0 ? 18 : 17;
    const int qoff = J->fmt == Q_GMXFP4 ? 1 : 2;
    const uint8_t *base[RG], *rp[RG];
    for (int i = 0; i < RG; i++) {
        const int64_t r = r0 + i;
        base[i] = i >= nr ? NULL : J->w_hi && r >= J->split ? J->w_hi + (r - J->split) * J->rb : J->w + r * J->rb;
    }
    if (J->fmt == Q_G4K || J->fmt == Q_G5K) {
        decode_group_q45k(J, base, W, WS, J->fmt == Q_G5K);
        return;
    }
    if (J->fmt == Q_G6K) {
        decode_group_q6k(J, base, W, WS);
        return;
    }
    const uint8_t *map = J->fmt == Q_G4_0 ? U_INT4 : U_MXFP4;
    const int ident = map == U_INT4; /* the code is the byte: no table */
    (void)ident;
#if IQ_ISA
    const __m128i tab128 = _mm_loadu_si128((const __m128i *)map);
#if IQ_ISA == 3
    const __m512i tab = _mm512_broadcast_i32x4(tab128), m0f = _mm512_set1_epi8(0x0F);
    const __m512i flip = _mm512_set1_epi8((char)(INT8_OFFSET ? 0x80 : 0));
#else
    const __m256i tab = _mm256_broadcastsi128_si256(tab128), m0f = _mm256_set1_epi8(0x0F);
    const __m256i flip = _mm256_set1_epi8((char)(INT8_OFFSET ? 0x80 : 0));
#endif
#endif
    for (int64_t b = 0; b < G; b++, W += 8 * RG * 4) {
        const uint8_t *hp[RG];
        for (int i = 0; i < RG; i++) {
            rp[i] = base[i] ? base[i] + b * bs + qoff : NULL;
            hp[i] = base[i] ? base[i] + b * bs : NULL;
        }
        if (J->fmt == Q_GMXFP4) {
            for (int i = 0; i < RG; i++) WS[b * RG + i] = base[i] ? J->e8m0[base[i][b * bs]] : 0.0f;
        } else {
            halves_to_ws(hp, WS + b * RG);
        }
#if IQ_ISA
        RV D[4];
        if (J->fmt == Q_G8_0) {
            for (int hh = 0; hh < 2; hh++) {
                rows_dwords(rp, 16 * hh, D);
                for (int m = 0; m < 4; m++)
#if IQ_ISA == 3
                    _mm512_store_si512((__m512i *)(W + (4 * hh + m) * 64), _mm512_xor_si512(D[m], flip));
#else
                    _mm256_store_si256((__m256i *)(W + (4 * hh + m) * 32), _mm256_xor_si256(D[m], flip));
#endif
            }
        } else {
            rows_dwords(rp, 0, D);
            for (int m = 0; m < 4; m++) {
#if IQ_ISA == 3
                __m512i lo = _mm512_and_si512(D[m], m0f), hi = _mm512_and_si512(_mm512_srli_epi32(D[m], 4), m0f);
                _mm512_store_si512((__m512i *)(W + m * 64), ident ? lo : _mm512_shuffle_epi8(tab, lo));
                _mm512_store_si512((__m512i *)(W + (4 + m) * 64), ident ? hi : _mm512_shuffle_epi8(tab, hi));
#else
                __m256i lo = _mm256_and_si256(D[m], m0f), hi = _mm256_and_si256(_mm256_srli_epi32(D[m], 4), m0f);
                _mm256_store_si256((__m256i *)(W + m * 32), ident ? lo : _mm256_shuffle_epi8(tab, lo));
                _mm256_store_si256((__m256i *)(W + (4 + m) * 32), ident ? hi : _mm256_shuffle_epi8(tab, hi));
#endif
            }
        }
#else
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < RG; i++)
                for (int k = 0; k < 4; k++) {
                    uint8_t u = 0;
                    if (rp[i] && J->fmt == Q_G8_0) u = (uint8_t)(rp[i][4 * j + k] ^ 0x80);
                    else if (rp[i]) u = map[j < 4 ? rp[i][4 * j + k] & 15 : rp[i][4 * (j - 4) + k] >> 4];
                    W[(j * RG + i) * 4 + k] = u;
                }
#endif
    }
}

/* rows [r0, r0 + nr) (nr <= RG; the rest zero) -> W [G][8][RG][4] bytes, WS [G][RG] fp32 */
static void decode_group(const QJob *J, int64_t r0, int nr, uint8_t *W, float *WS) {
    if (J->fmt == Q_INT8) {
        decode_group_int8(J, r0, nr, W, WS);
        return;
    }
    if (GGUF_Q(J->fmt)) {
        decode_group_gguf(J, r0, nr, W, WS);
        return;
    }
    const int64_t G = J->G, half = J->cols / 2;
    const uint8_t *rp[RG];
    for (int i = 0; i < RG; i++) rp[i] = i < nr ? J->w + (r0 + i) * half : NULL;
    if (J->fmt == Q_INT4) {
        int4_scales((const uint16_t *)J->s + r0 * G, G, nr, WS);
    } else {
        const uint8_t *sc = (const uint8_t *)J->s + r0 * G;
        for (int64_t b = 0; b < G; b++)
            for (int i = 0; i < RG; i++) WS[b * RG + i] = i < nr ? J->e8m0[sc[i * G + b]] : 0.0f;
    }
    const uint8_t *map = J->fmt == Q_INT4 ? U_INT4 : U_MXFP4;
    const int ident = map == U_INT4; /* the code is the byte: no table */
    (void)ident;
#if IQ_ISA
    const __m128i tab128 = _mm_loadu_si128((const __m128i *)map), m0f128 = _mm_set1_epi8(0x0F);
#if IQ_ISA == 3
    const __m512i tab = _mm512_broadcast_i32x4(tab128), m0f = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < G; b++, W += 8 * 64) {
        __m512i D[4];  /* D[m]: dword m (packed bytes 4m..4m+3) of rows 0..15 */
        rows_dwords(rp, b * 16, D);
        for (int m = 0; m < 4; m++) {
            __m512i lo = _mm512_and_si512(D[m], m0f), hi = _mm512_and_si512(_mm512_srli_epi32(D[m], 4), m0f);
            _mm512_store_si512((__m512i *)(W + m * 64), ident ? lo : _mm512_shuffle_epi8(tab, lo));
            _mm512_store_si512((__m512i *)(W + (4 + m) * 64), ident ? hi : _mm512_shuffle_epi8(tab, hi));
        }
    }
#else
    const __m256i tab = _mm256_broadcastsi128_si256(tab128), m0f = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < G; b++, W += 8 * 32) {
        __m256i D[4];
        rows_dwords(rp, b * 16, D);
        for (int m = 0; m < 4; m++) {
            __m256i lo = _mm256_and_si256(D[m], m0f), hi = _mm256_and_si256(_mm256_srli_epi32(D[m], 4), m0f);
            _mm256_store_si256((__m256i *)(W + m * 32), ident ? lo : _mm256_shuffle_epi8(tab, lo));
            _mm256_store_si256((__m256i *)(W + (4 + m) * 32), ident ? hi : _mm256_shuffle_epi8(tab, hi));
        }
    }
#endif
    (void)m0f128;
#else
    for (int64_t b = 0; b < G; b++)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < RG; i++)
                for (int k = 0; k < 4; k++) {
                    uint8_t byte = rp[i] ? rp[i][b * 16 + 4 * (j & 3) + k] : 0;
                    W[((b * 8 + j) * RG + i) * 4 + k] = rp[i] ? map[j < 4 ? byte & 15 : byte >> 4] : 0;
                }
#endif
}

/* rows [r0, r0 + nr) of J's weights (codes and scales) prefetched into L2: called for the next group while this one's
 * tokens run, so its decode reads from cache rather than waiting on RAM (an expert's rows are read once a prompt) */
static void prefetch_group(const QJob *J, int64_t r0, int nr) {
#if IQ_ISA
    for (int i = 0; i < nr; i++) {
        const int64_t r = r0 + i;
        const uint8_t *p;
        int64_t n;
        if (GGUF_Q(J->fmt)) {
            p = J->w_hi && r >= J->split ? J->w_hi + (r - J->split) * J->rb : J->w + r * J->rb, n = J->rb;
        } else {
            n = J->fmt == Q_INT8 ? J->cols : J->cols / 2, p = J->w + r * n;
            const int64_t sb = J->fmt == Q_INT8 ? 0 : J->G * (J->fmt == Q_INT4 ? 2 : 1); /* the row's scales */
            for (int64_t o = 0; o < sb; o += 64) _mm_prefetch((const char *)J->s + r * sb + o, _MM_HINT_T1);
        }
        for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
    }
#else
    (void)J, (void)r0, (void)nr;
#endif
}

static inline int32_t word(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* a tile's inner loop, a constant in each instance (no branch on the format inside it, where the compiler would
 * hoist the shared loads above the branch and spill them): unsigned codes (MXFP4: 4 chunks summed in int16 on AVX2),
 * unsigned codes <= 15 (int4, Q4_0: all 8), those with Q4_K's mins, signed int8 codes, Q6_K's two half blocks */
enum { M_U, M_C15, M_K, M_S, M_6, M_K5 };

/* y[t0 + t, r0 + i] for t < NT, i < nr from the decoded group */
static inline int32_t half_sum(int32_t xc, int hf) { /* Q6_K: x's sum of q over the block's half hf */
    return hf ? (int32_t)(int16_t)(uint16_t)((uint32_t)xc >> 16) : (int32_t)(int16_t)(uint16_t)((uint32_t)xc & 0xFFFF);
}

/* a block's (half's) integer sum starts at x's offset term: -offset x sum q (xc), none for Q4_K (its mins after the
 * sum), -32 x the half's sum for Q6_K */
static inline int32_t isum0(const int mode, int32_t xc, int hf) {
    return mode == M_6 ? -32 * half_sum(xc, hf) : mode == M_K || mode == M_K5 ? 0 : xc;
}

static inline __attribute__((always_inline)) void qtile(const QJob *J, const uint8_t *W, const float *WS, int64_t t0,
                                                        const int NT, const int mode, int64_t r0, int nr) {
    const int64_t G = J->G, cols = J->cols;
    const int8_t *xq = J->xq + t0 * cols;
    const float *xs = J->xs + t0 * G;
    const int32_t *xc = J->xc + t0 * G;
    const int mins = mode == M_K || mode == M_K5, halves = mode == M_6 ? 2 : 1, per = 8 / halves; /* chunks a half */
    const float *WM = WS + G * RG;
#if IQ_ISA == 3
    __m512 af[TBQ];
    for (int t = 0; t < NT; t++) af[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; b++, W += 8 * 64) {
        const int8_t *xb = xq + b * 32;
        for (int hf = 0; hf < halves; hf++) {
            __m512i ai[TBQ];
            for (int t = 0; t < NT; t++) ai[t] = _mm512_set1_epi32(isum0(mode, xc[t * G + b], hf));
            for (int j = hf * per; j < hf * per + per; j++) {
                __m512i w = _mm512_load_si512((const __m512i *)(W + j * 64));
                for (int t = 0; t < NT; t++)
                    ai[t] = _mm512_dpbusd_epi32(ai[t], w, _mm512_set1_epi32(word(xb + t * cols + 4 * j)));
            }
            __m512 ws = _mm512_load_ps((hf ? WM : WS) + b * RG);
            for (int t = 0; t < NT; t++)
                af[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[t]), _mm512_mul_ps(ws, _mm512_set1_ps(xs[t * G + b])), af[t]);
        }
        if (mins) {
            __m512 wm = _mm512_load_ps(WM + b * RG);
            for (int t = 0; t < NT; t++)
                af[t] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xs[t * G + b] * (float)xc[t * G + b]), af[t]);
        }
    }
    __mmask16 keep = (__mmask16)(nr >= 16 ? 0xFFFF : (1u << nr) - 1);
    for (int t = 0; t < NT; t++) _mm512_mask_storeu_ps(J->y + (t0 + t) * J->ldy + r0, keep, af[t]);
#elif IQ_ISA
    __m256 af[TBQ];
    for (int t = 0; t < NT; t++) af[t] = _mm256_setzero_ps();
#if IQ_ISA == 1
    const __m256i ones = _mm256_set1_epi16(1);
    /* unsigned codes: chunks summed in int16, then widened: codes <= 15, a block's 8 (<= 8 x 2 x 15 x 127 = 30480:
     * 9 ops a token on Zen 2's one multiply port, not 10); Q6_K's <= 63, 2 (<= 32004); MXFP4's <= 24, 4 */
    const int span = mode == M_C15 || mode == M_K ? 8 : mode == M_6 ? 2 : 4;
#endif
    for (int64_t b = 0; b < G; b++, W += 8 * 32) {
        const int8_t *xb = xq + b * 32;
        for (int hf = 0; hf < halves; hf++) {
            __m256i ai[TBQ];
            for (int t = 0; t < NT; t++) ai[t] = _mm256_set1_epi32(isum0(mode, xc[t * G + b], hf));
#if IQ_ISA == 2
            for (int j = hf * per; j < hf * per + per; j++) {
                __m256i w = _mm256_load_si256((const __m256i *)(W + j * 32));
                for (int t = 0; t < NT; t++)
                    ai[t] = _mm256_dpbusd_avx_epi32(ai[t], w, _mm256_set1_epi32(word(xb + t * cols + 4 * j)));
            }
#else
            if (mode == M_S) { /* signed q: |q| x (x with q's sign), a pair <= 2 x 128 x 127 = 32512, widened at once */
                for (int j = 0; j < 8; j++) {
                    __m256i w = _mm256_load_si256((const __m256i *)(W + j * 32)), aw = _mm256_abs_epi8(w);
                    for (int t = 0; t < NT; t++) {
                        __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(word(xb + t * cols + 4 * j)), w);
                        ai[t] = _mm256_add_epi32(ai[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
                        KEEP(ai[t]);
                    }
                }
            } else {
                for (int h = hf * per; h < hf * per + per; h += span) {
                    __m256i p[TBQ];
                    for (int t = 0; t < NT; t++) p[t] = _mm256_setzero_si256();
                    for (int j = h; j < h + span; j++) {
                        __m256i w = _mm256_load_si256((const __m256i *)(W + j * 32));
                        for (int t = 0; t < NT; t++) {
                            p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(w, _mm256_set1_epi32(word(xb + t * cols + 4 * j))));
                            KEEP(p[t]);
                        }
                    }
                    for (int t = 0; t < NT; t++) ai[t] = _mm256_add_epi32(ai[t], _mm256_madd_epi16(p[t], ones));
                }
            }
#endif
            __m256 ws = _mm256_load_ps((hf ? WM : WS) + b * RG);
            for (int t = 0; t < NT; t++)
                af[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[t]), _mm256_mul_ps(ws, _mm256_set1_ps(xs[t * G + b])), af[t]);
        }
        if (mins) {
            __m256 wm = _mm256_load_ps(WM + b * RG);
            for (int t = 0; t < NT; t++)
                af[t] = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xs[t * G + b] * (float)xc[t * G + b]), af[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        float *yr = J->y + (t0 + t) * J->ldy + r0;
        if (nr >= 8) _mm256_storeu_ps(yr, af[t]);
        else {
            float tmp[8];
            _mm256_storeu_ps(tmp, af[t]);
            memcpy(yr, tmp, sizeof(float) * (size_t)nr);
        }
    }
#else
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < nr; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < G; b++) {
                const uint8_t *wb = W + b * 8 * RG * 4 + i * 4;
                const int8_t *xb = xq + t * cols + b * 32;
                for (int hf = 0; hf < halves; hf++) {
                    int32_t isum = isum0(mode, xc[t * G + b], hf);
                    for (int j = hf * per; j < hf * per + per; j++)
                        for (int k = 0; k < 4; k++) isum += (int32_t)wb[j * RG * 4 + k] * xb[4 * j + k];
                    acc = fmaf((float)isum, (hf ? WM : WS)[b * RG + i] * xs[t * G + b], acc);
                }
                if (mins) acc = fmaf(-WM[b * RG + i], xs[t * G + b] * (float)xc[t * G + b], acc);
            }
            J->y[(t0 + t) * J->ldy + r0 + i] = acc;
        }
#endif
}

/* tokens [t0, t1) of the decoded group of rows [r0, r0 + nr) */
static void qtokens(const QJob *J, const uint8_t *W, const float *WS, int64_t t0, int64_t t1, int64_t r0, int nr) {
    const int mode = SIGNED_Q(J->fmt) ? M_S : J->fmt == Q_G4K ? M_K : J->fmt == Q_G5K ? M_K5 : J->fmt == Q_G6K ? M_6
                   : CODES_15(J->fmt) ? M_C15 : M_U;
    for (; t0 < t1; t0 += TBQ) {
        int nt = (int)(t1 - t0 < TBQ ? t1 - t0 : TBQ);
#define QT(n)                                                                                                          \
    (mode == M_S     ? qtile(J, W, WS, t0, n, M_S, r0, nr)                                                             \
     : mode == M_6   ? qtile(J, W, WS, t0, n, M_6, r0, nr)                                                             \
     : mode == M_K   ? qtile(J, W, WS, t0, n, M_K, r0, nr)                                                             \
     : mode == M_K5  ? qtile(J, W, WS, t0, n, M_K5, r0, nr)                                                            \
     : mode == M_C15 ? qtile(J, W, WS, t0, n, M_C15, r0, nr)                                                           \
                     : qtile(J, W, WS, t0, n, M_U, r0, nr))
        switch (nt) { /* a constant token count per instance: the accumulators stay in registers */
            case 1: QT(1); break;
            case 2: QT(2); break;
            case 3: QT(3); break;
#if TBQ == 8
            case 4: QT(4); break;
            case 5: QT(5); break;
            case 6: QT(6); break;
            case 7: QT(7); break;
#endif
            default: QT(TBQ); break;
        }
#undef QT
    }
}

/* a thread's decoded-group scratch for inputs of `cols`: W [G][8][RG][4] bytes then WS [G][RG] fp32 */
static uint8_t *group_scratch(int64_t cols) { /* ... and WM [G][RG] after WS: Q4_K's mins, Q6_K's second halves */
    size_t wbytes = (size_t)(RG * cols), sbytes = 2 * sizeof(float) * (size_t)(cols / 32 * RG);
    return aligned_alloc(64, (wbytes + sbytes + 63) / 64 * 64);  /* RG x cols is a multiple of 64: WS aligned */
}

static int qshare(void *ctx, int64_t a, int64_t b) {
    const QJob *J = ctx;
    uint8_t *W = group_scratch(J->cols);
    if (!W) return -2;
    float *WS = (float *)(W + RG * J->cols);
    for (int64_t r0 = a; r0 < b; r0 += RG) {
        int nr = (int)(b - r0 < RG ? b - r0 : RG);
        decode_group(J, r0, nr, W, WS);
        if (r0 + RG < b) prefetch_group(J, r0 + RG, (int)(b - r0 - RG < RG ? b - r0 - RG : RG));
        qtokens(J, W, WS, 0, J->T, r0, nr);
    }
    free(W);
    return 0;
}

static int run_q8(QJob *J, const float *x, int offset) {
    if (J->rows < 0 || J->cols <= 0 || J->cols % 32 || J->T < 0 || J->ldy < J->rows) return -1;
    if (J->rows == 0 || J->T == 0) return 0;
    J->G = J->cols / 32;
    int8_t *xq = malloc((size_t)(J->T * J->cols));
    float *xs = malloc(sizeof(float) * (size_t)(J->T * J->G));
    int32_t *xc = malloc(sizeof(int32_t) * (size_t)(J->T * J->G));
    int rc = -2;
    if (xq && xs && xc) {
        XJob X = {.x = x, .cols = J->cols, .G = J->G, .offset = offset, .perm = J->fmt < Q_INT8, .xq = xq, .xs = xs,
                  .xc = xc};
        rc = moechat_parallel_for(xshare, &X, J->T, 1, J->T * J->cols * 4);  /* x's fp32 bytes: over the pool too */
        J->xq = xq, J->xs = xs, J->xc = xc;
        /* the pool's "bytes": multiply-adds / 16 (the integer dot's rate is ~4x the fp32 tile's) */
        if (rc == 0) rc = moechat_parallel_for(qshare, J, J->rows, RG, J->rows * J->cols / 16 * J->T);
    }
    free(xq), free(xs), free(xc);
    return rc;
}

static void e8m0_table(float *t) {
    for (int s = 0; s < 256; s++) { /* 2^(s - 128) from its bits: a normal from s = 2, subnormals 2^-127, 2^-128 */
        uint32_t bits = s >= 2 ? (uint32_t)(s - 1) << 23 : (uint32_t)1 << (21 + s);
        memcpy(&t[s], &bits, 4);
    }
}

/* -- exported: x [T, cols] fp32 contiguous (cols a multiple of 32), y [T, ldy] fp32. 0, -1 for a shape they do not
 * take, -2 where memory cannot be had. */
int moechat_prefill_q8_int4(const float *x, int64_t T, const uint8_t *q, const uint16_t *scale, int64_t rows,
                            int64_t cols, float *y, int64_t ldy) {
    QJob J = {.fmt = Q_INT4, .w = q, .s = scale, .rows = rows, .cols = cols, .T = T, .y = y, .ldy = ldy};
    return run_q8(&J, x, 8);
}

int moechat_prefill_q8_mxfp4(const float *x, int64_t T, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                             int64_t cols, float *y, int64_t ldy) {
    float e8m0[256];
    e8m0_table(e8m0);
    QJob J = {.fmt = Q_MXFP4, .w = blocks, .s = scales, .rows = rows, .cols = cols, .T = T, .y = y, .ldy = ldy,
              .e8m0 = e8m0};
    return run_q8(&J, x, 12);
}

/* int8 [rows, cols] codes (|q| <= 127, -128 also computed exactly) with an fp32 scale per row */
int moechat_prefill_q8_int8(const float *x, int64_t T, const int8_t *q, const float *scale, int64_t rows,
                            int64_t cols, float *y, int64_t ldy) {
    QJob J = {.fmt = Q_INT8, .w = (const uint8_t *)q, .s = scale, .rows = rows, .cols = cols, .T = T, .y = y,
              .ldy = ldy};
    return run_q8(&J, x, INT8_OFFSET);
}

/* -- a layer's routed experts over a prefill chunk in one call: moechat_moe_prefill_q8 --------------------------------
 * n experts; expert k takes the pairs [start[k], start[k + 1]); pair p is token tok[p] of x (bf16 [T, H]) with the
 * routing weight wt[p], written to row dst[p] of out (fp32 [rows_out, H]): out[dst[p]] = wt[p] x down(act(gate_up(x)))
 * in fp32. Each projection goes through the integer kernel above (x quantized to Q8 blocks once per pair, the
 * activations once per pair), its fp32 sums + bias rounded to bf16 once (as prefill.finish does), the activation as
 * native.c's one-token layer call computes it (torch's bits: moechat_moe_act_row), the product by the weight in fp32
 * (as native_scatter.c). So bit for bit the per-expert path (layers/experts.py `_general_compute`: per expert, the
 * format's `linear` of w13, the activation, `linear` of w2, the scatter), in four passes over native.c's pool instead
 * of ~10 Python-driven kernel calls and torch ops an expert (each call a pool wake and a wait, the torch ops on one
 * core: ~13% of a 2-thread int8 prefill). A projection pass is cut into units of (expert, group of RG rows, block of
 * TBQ tokens), equal work each, that the threads claim in chunks, so an expert with 40 tokens weighs what it costs
 * beside one with 2; a group is decoded once per chunk that reaches it. */
typedef struct {
    int fmt13, fmt2, offset13, offset2, perm13, perm2, phase, act, bias_kind;
    int64_t n, H, I, vec, rows_out, rb13, rb2; /* rb: GGUF's bytes a row (gate's and up's, down's) */
    float limit, alpha;
    const uint16_t *x;    /* bf16 [T, H] */
    const int64_t *ptrs;  /* [n, 6]: w13, w13 scale, w2, w2 scale, w13 bias or 0, w2 bias or 0 (GGUF: gate, up,
                           * down, 0, 0, 0) */
    const int64_t *start; /* [n + 1] */
    const int64_t *ustart; /* [n + 1]: the pass's units before expert k */
    const int64_t *tok, *dst;
    const float *wt;
    int8_t *xq;           /* the pass's input per pair: [P, cols] (each block in the packed order) */
    float *xs;            /* [P, cols / 32] */
    int32_t *xc;          /* [P, cols / 32] */
    float *gu;            /* [P, 2I] */
    float *y2;            /* [P, H] */
    float *out;
    const float *e8m0;
} LJob;

static inline float bf16_bits(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float v) { /* to nearest even, NaN -> 0x7FC0 (native.c's f32_to_bf16), as fp32 */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = v != v ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

static inline float lbias(const void *b, int kind, int64_t r) { /* native.c's bias_at */
    return kind == 1 ? bf16_bits(((const uint16_t *)b)[r]) : kind == 2 ? q_f16(((const uint16_t *)b)[r])
                                                                       : ((const float *)b)[r];
}

/* a bf16 row of `cols` quantized as row p of [P, cols] int8 (its blocks' scales and sums in xs, xc [P, cols / 32]) */
static void quantize_bf16_row(const uint16_t *row, int64_t cols, int offset, int perm, int8_t *xq, float *xs,
                              int32_t *xc, int64_t p) {
    const int64_t G = cols / 32;
    float v[32];
    for (int64_t g = 0; g < G; g++) {
        for (int i = 0; i < 32; i++) v[i] = bf16_bits(row[g * 32 + i]);
        quantize_block(v, offset, perm, xq + p * cols + g * 32, xs + p * G + g, xc + p * G + g);
    }
}

/* pairs [a, b): the pair's row of x, quantized */
static int lx(void *ctx, int64_t a, int64_t b) {
    const LJob *L = ctx;
    for (int64_t p = a; p < b; p++)
        quantize_bf16_row(L->x + L->tok[p] * L->H, L->H, L->offset13, L->perm13, L->xq, L->xs, L->xc, p);
    return 0;
}

/* pairs [a, b): gate/up rounded (+ bias), the activation in bf16, quantized for the down projection */
static int lact(void *ctx, int64_t a, int64_t b) {
    const LJob *L = ctx;
    const int64_t I = L->I;
    uint16_t *act = malloc(sizeof(uint16_t) * (size_t)I);
    if (!act) return -2;
    int64_t k = 0;
    for (int64_t p = a; p < b; p++) {
        while (p >= L->start[k + 1]) k++;
        const int64_t *pt = L->ptrs + 6 * k;
        moechat_moe_act_row(L->gu + p * 2 * I, (const void *)(intptr_t)pt[4], L->bias_kind, I, L->act, 1, L->vec,
                            L->limit, L->alpha, act);
        quantize_bf16_row(act, I, L->offset2, L->perm2, L->xq, L->xs, L->xc, p);
    }
    free(act);
    return 0;
}

/* units [a, b) of a projection pass (phase 1: gate/up into gu; 2: down, each finished into its output rows) */
static int lrows(void *ctx, int64_t a, int64_t b) {
    const LJob *L = ctx;
    const int down = L->phase == 2;
    const int64_t R = down ? L->H : 2 * L->I, cols = down ? L->I : L->H, G = cols / 32;
    uint8_t *W = group_scratch(cols);
    if (!W) return -2;
    float *WS = (float *)(W + RG * cols);
    int64_t k = 0, nb = 1, decoded = -1;
    QJob J = {0};
    const void *bias = NULL;
    for (int64_t u = a; u < b; u++) {
        if (decoded == -1 || u >= L->ustart[k + 1]) {
            while (u >= L->ustart[k + 1]) k++;
            const int64_t p0 = L->start[k], m = L->start[k + 1] - p0, *pt = L->ptrs + 6 * k;
            nb = (m + TBQ - 1) / TBQ;
            const int fmt = down ? L->fmt2 : L->fmt13;
            J = (QJob){.fmt = fmt, .w = (const uint8_t *)(intptr_t)pt[down ? 2 : 0],
                       .s = (const void *)(intptr_t)pt[down ? 3 : 1], .rows = R, .cols = cols, .G = G, .T = m,
                       .ldy = R, .rb = down ? L->rb2 : L->rb13, .split = R, .xq = L->xq + p0 * cols,
                       .xs = L->xs + p0 * G, .xc = L->xc + p0 * G, .y = (down ? L->y2 : L->gu) + p0 * R,
                       .e8m0 = L->e8m0};
            if (GGUF_Q(fmt) && !down) /* gate's rows, then up's from their own tensor */
                J.w_hi = (const uint8_t *)(intptr_t)pt[1], J.s = NULL, J.split = L->I;
            bias = (const void *)(intptr_t)pt[5];
            decoded = -2;
        }
        const int64_t v = u - L->ustart[k], g = v / nb, t0 = v % nb * TBQ, t1 = t0 + TBQ < J.T ? t0 + TBQ : J.T;
        const int64_t r0 = g * RG;
        const int nr = (int)(R - r0 < RG ? R - r0 : RG);
        if (g != decoded) {
            decode_group(&J, r0, nr, W, WS);
            decoded = g;
            if (r0 + RG < R) prefetch_group(&J, r0 + RG, (int)(R - r0 - RG < RG ? R - r0 - RG : RG));
        }
        qtokens(&J, W, WS, t0, t1, r0, nr);
        if (down)
            for (int64_t t = t0; t < t1; t++) {
                const int64_t p = L->start[k] + t;
                const float *y = J.y + t * R, w = L->wt[p];
                float *o = L->out + L->dst[p] * L->H;
                for (int64_t r = r0; r < r0 + nr; r++) {
                    float s = y[r];
                    if (bias) s = s + lbias(bias, L->bias_kind, r);
                    o[r] = round_bf16(s) * w;
                }
            }
    }
    free(W);
    return 0;
}

/* the units of a projection pass with R rows an expert; ustart [n + 1] */
static int64_t pass_units(const LJob *L, int64_t R, int64_t *ustart) {
    ustart[0] = 0;
    for (int64_t k = 0; k < L->n; k++)
        ustart[k + 1] = ustart[k] + (R + RG - 1) / RG * ((L->start[k + 1] - L->start[k] + TBQ - 1) / TBQ);
    return ustart[L->n];
}

#define LAYER_CHUNKS 8 /* pieces a thread of a projection pass */

static int layer_run(LJob *L, int64_t T, int64_t n, const int64_t *start) {
    const int64_t H = L->H, I = L->I;
    if (n <= 0) return n == 0 ? 0 : -1;
    if (H <= 0 || I <= 0 || H % 32 || I % 32 || T <= 0 || (L->act != 0 && L->act != 1) || L->bias_kind < 0
        || L->bias_kind > 2 || start[0] != 0)
        return -1;
    for (int64_t k = 0; k < n; k++)
        if (start[k + 1] < start[k]) return -1;
    const int64_t P = start[n];
    for (int64_t p = 0; p < P; p++)
        if (L->tok[p] < 0 || L->tok[p] >= T || L->dst[p] < 0 || L->dst[p] >= L->rows_out) return -1;
    if (P == 0) return 0;
    float e8m0[256];
    e8m0_table(e8m0);
    L->e8m0 = e8m0;
    L->n = n, L->start = start;
    const int64_t wide = H > I ? H : I;
    int64_t *ustart = malloc(sizeof(int64_t) * (size_t)(n + 1));
    L->xq = malloc((size_t)(P * wide));
    L->xs = malloc(sizeof(float) * (size_t)(P * wide / 32));
    L->xc = malloc(sizeof(int32_t) * (size_t)(P * wide / 32));
    L->gu = malloc(sizeof(float) * (size_t)(P * 2 * I));
    L->y2 = malloc(sizeof(float) * (size_t)(P * H));
    L->ustart = ustart;
    int rc = -2;
    if (ustart && L->xq && L->xs && L->xc && L->gu && L->y2) {
        rc = moechat_parallel_for(lx, L, P, 1, P * H * 4);
        L->phase = 1;
        int64_t units = pass_units(L, 2 * I, ustart);
        if (rc == 0) rc = moechat_parallel_for_chunks(lrows, L, units, 1, P * 2 * I * H / 16, LAYER_CHUNKS);
        if (rc == 0) rc = moechat_parallel_for(lact, L, P, 1, P * 2 * I * 16);
        L->phase = 2;
        units = pass_units(L, H, ustart);
        if (rc == 0) rc = moechat_parallel_for_chunks(lrows, L, units, 1, P * H * I / 16, LAYER_CHUNKS);
    }
    free(ustart), free(L->xq), free(L->xs), free(L->xc), free(L->gu), free(L->y2);
    return rc;
}

/* kind: native.c's Job kinds (0 int4 in groups of 32, 1 MXFP4, 3 int8); ptrs [n, 6] as LJob's; bias_kind 0 fp32,
 * 1 bf16, 2 fp16; act 0 SwiGLU, 1 GPT-OSS's clamped one (with limit, alpha); vec: torch's vector step for the
 * activation's exp (native.py vector_step). 0; -1 for a shape or an index it does not take (nothing written); -2
 * where memory cannot be had. */
int moechat_moe_prefill_q8(int kind, const uint16_t *x, int64_t T, const int64_t *ptrs, const int64_t *start,
                           int64_t n, const int64_t *tok, const int64_t *dst, const float *wt, int64_t H, int64_t I,
                           int bias_kind, int act, float limit, float alpha, int64_t vec, float *out,
                           int64_t rows_out) {
    if (kind != 0 && kind != 1 && kind != 3) return -1;
    const int fmt = kind == 0 ? Q_INT4 : kind == 1 ? Q_MXFP4 : Q_INT8, offset = kind == 0 ? 8 : kind == 1 ? 12
                                                                                                   : INT8_OFFSET;
    LJob L = {.fmt13 = fmt, .fmt2 = fmt, .offset13 = offset, .offset2 = offset, .perm13 = kind != 3,
              .perm2 = kind != 3, .act = act, .bias_kind = bias_kind, .H = H, .I = I, .vec = vec,
              .rows_out = rows_out, .limit = limit, .alpha = alpha, .x = x, .ptrs = ptrs, .tok = tok, .dst = dst,
              .wt = wt, .out = out};
    return layer_run(&L, T, n, start);
}

/* ggml's type id -> the format, the offset x's quantization takes (Q4_K / Q5_K: -1, its block sums; Q6_K: -2, its
 * halves'), and the bytes of 32 values (the k-quants: of 256) */
static int gguf_fmt(int type, int *offset, int64_t *block_bytes) {
    *offset = type == 8 ? INT8_OFFSET : type == 2 ? 8 : type == 12 || type == 13 ? -1 : type == 14 ? -2 : 12;
    *block_bytes = type == 8 ? 34 : type == 2 ? 18 : type == 12 ? 144 : type == 13 ? 176 : type == 14 ? 210 : 17;
    return type == 8 ? Q_G8_0 : type == 2 ? Q_G4_0 : type == 39 ? Q_GMXFP4 : type == 12 ? Q_G4K : type == 13 ? Q_G5K
         : type == 14 ? Q_G6K : -1;
}

/* The same for GGUF experts as the file stores them: gate's and up's rows of ggml type `type13`, down's of `type2`
 * (8 Q8_0, 2 Q4_0, 39 MXFP4, 12 Q4_K, 13 Q5_K, 14 Q6_K); ptrs [n, 6] each expert's gate, up and down rows then three zeros (no biases); SwiGLU
 * (gate's rows, then up's: not interleaved). */
int moechat_moe_prefill_q8_gguf(int type13, int type2, const uint16_t *x, int64_t T, const int64_t *ptrs,
                                const int64_t *start, int64_t n, const int64_t *tok, const int64_t *dst,
                                const float *wt, int64_t H, int64_t I, int64_t vec, float *out, int64_t rows_out) {
    int o13, o2;
    int64_t b13, b2;
    const int f13 = gguf_fmt(type13, &o13, &b13), f2 = gguf_fmt(type2, &o2, &b2);
    if (f13 < 0 || f2 < 0) return -1;
    const int64_t per13 = KQ(f13) ? 256 : 32, per2 = KQ(f2) ? 256 : 32;
    if (H % per13 || I % per2) return -1;
    LJob L = {.fmt13 = f13, .fmt2 = f2, .offset13 = o13, .offset2 = o2, .act = 0, .H = H, .I = I, .vec = vec,
              .rows_out = rows_out, .rb13 = H / per13 * b13, .rb2 = I / per2 * b2, .x = x, .ptrs = ptrs, .tok = tok,
              .dst = dst, .wt = wt, .out = out};
    for (int64_t k = 0; k < n; k++)
        if (ptrs[6 * k + 3] || ptrs[6 * k + 4] || ptrs[6 * k + 5]) return -1; /* no biases here */
    return layer_run(&L, T, n, start);
}

/* GGUF rows as the file stores them: raw [rows, row_bytes] of `type` (ggml's ids: 8 Q8_0, 2 Q4_0, 39 MXFP4, 12 Q4_K,
 * 13 Q5_K, 14 Q6_K) */
int moechat_prefill_q8_gguf(int type, const float *x, int64_t T, const uint8_t *raw, int64_t rows, int64_t cols,
                            int64_t row_bytes, float *y, int64_t ldy) {
    int offset;
    int64_t bs;
    const int fmt = gguf_fmt(type, &offset, &bs);
    const int64_t per = KQ(fmt) ? 256 : 32;
    if (fmt < 0 || cols % per || row_bytes != cols / per * bs) return -1;
    float e8m0[256];
    e8m0_table(e8m0);
    QJob J = {.fmt = fmt, .w = raw, .rows = rows, .cols = cols, .rb = row_bytes, .split = rows, .T = T, .y = y,
              .ldy = ldy, .e8m0 = e8m0};
    return run_q8(&J, x, offset);
}

/* which build this is: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2 (maddubs), 0 scalar */
int moechat_prefill_q8_isa(void) { return IQ_ISA; }
