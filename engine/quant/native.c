/* moechat's native CPU kernels: one token (decode) times a packed expert projection, y = W x, reading the packed
 * bytes once; for several tokens (prefill) the decoders below write the projection's fp32 values for one GEMM. Built and loaded by native.py (cc -O3 -march=native -shared, cached per source + flags + CPU);
 * plain C, no torch headers, called through ctypes on the raw pointers of contiguous tensors.
 *
 * Every kernel: x [cols] fp32 or bf16 (x_bf16 = 1), the packed matrix [rows, cols] in its format, y [rows] fp32.
 * Each output is a sum of products in fp32 as F.linear over the dequantized matrix computes it, in another order
 * (per-lane partial sums, a group's scale applied to its partial sum, FP8's block scale on x): equal within fp32
 * rounding, tested; except that a bf16 x through int4 (groups of 32) or MXFP4 is summed in integers over x rounded
 * to 16 bits per block (the integer path below, within 1/128 of a bf16 rounding). The codes become fp32 values in registers and nothing else touches memory: int4 and MXFP4
 * through bf16 bit patterns from an in-register table (pshufb), FP8 as bf16 bit patterns made with shifts,
 * int8 by conversion. Where the values come out of the registers in another order than the elements (the 4-bit
 * formats, FP8), a copy of x made once per call is in that order instead, so no shuffle puts them back.
 * Four rows at a time share each x load and keep four FMA chains in flight; each row group prefetches the
 * next one's bytes (1.4x measured: the hardware prefetcher alone left the loads waiting on RAM).
 *
 * AVX2 + FMA + F16C where the compiler targets them; otherwise the same sums in scalar C (MOECHAT_SCALAR forces
 * it, for the tests; native.py uses the torch paths rather than this). moechat_simd() says which was built. */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MOECHAT_ABI 7

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MOECHAT_SCALAR)
#define SIMD 1
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define SIMD 0
#define PAUSE() ((void)0)
#endif

int moechat_abi(void) { return MOECHAT_ABI; }
int moechat_simd(void) { return SIMD; }

static float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* an fp16 bit pattern -> its fp32 value, exactly (subnormals, infinities and NaN too): int4's group scales. F16C's
 * conversion (it does not consult MXCSR.DAZ) on the SIMD build, the same bits in integer ops on the scalar one. */
static float f16_to_f32(uint16_t h) {
#if SIMD
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, b;
    if (e == 31) b = sign | 0x7F800000u | m << 13;
    else if (e) b = sign | (e + 112) << 23 | m << 13;
    else if (m) { /* subnormal: m 2^-24, a normal fp32 */
        int k = 0;
        while (!(m & 1024)) m <<= 1, k++;
        b = sign | (uint32_t)(113 - k) << 23 | (m & 1023) << 13;
    } else b = sign;
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

/* Per-thread scratch, grown on demand and kept (freed when the thread exits): the kernels' copies of x, the bf16
 * calls' fp32 y, the layer call's intermediates. A decode step then allocates nothing (issue 27: ~6% of a step was
 * malloc/free). Slots: TLS_X the kernels' x, TLS_Y a bf16 call's fp32 y, TLS_MOE the layer call's buffers, TLS_ATT decode attention's. */
enum { TLS_X, TLS_Y, TLS_MOE, TLS_ATT, TLS_SLOTS };
typedef struct { void *p[TLS_SLOTS]; size_t n[TLS_SLOTS]; } Tls;
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void tls_free(void *v) {
    Tls *t = v;
    for (int i = 0; i < TLS_SLOTS; i++) free(t->p[i]);
    free(t);
}

static void tls_init(void) { pthread_key_create(&tls_key, tls_free); }

/* this thread's buffer `slot`, at least `bytes` (64-byte aligned), or NULL where memory cannot be had */
static void *scratch(int slot, size_t bytes) {
    pthread_once(&tls_once, tls_init);
    Tls *t = pthread_getspecific(tls_key);
    if (!t) {
        if (!(t = calloc(1, sizeof(Tls)))) return NULL;
        if (pthread_setspecific(tls_key, t)) {
            free(t);
            return NULL;
        }
    }
    if (t->n[slot] < bytes) {
        free(t->p[slot]);
        size_t n = (bytes + 63) / 64 * 64;
        t->p[slot] = aligned_alloc(64, n < 4096 ? 4096 : n);
        t->n[slot] = t->p[slot] ? (n < 4096 ? 4096 : n) : 0;
    }
    return t->p[slot];
}

static float load_x(const void *x, int x_bf16, int64_t j) {
    return x_bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
}

/* 2^(s - 128) for an E8M0 scale byte s (the E2M1 table below holds twice the values). */
static float e8m0_half(uint8_t s) {
    uint32_t b = s >= 2 ? (uint32_t)(s - 1) << 23 : 0x00400000u >> (1 - s);
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#if !SIMD
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#endif

/* e4m3 byte -> its value (0x7F/0xFF, the NaNs, decode as 480 like the SIMD path's bit trick) */
static float e4m3(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return (b & 0x80) ? -v : v;
}

#if SIMD
static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 i8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
#endif

/* -- 4-bit codes (int4, MXFP4) ---------------------------------------------------------------------------------
 * A 32-element block is 16 bytes (low nibble the even element). In registers: the 16 bytes in both 128-bit lanes,
 * lane 0 shifted to the low nibbles and lane 1 to the high ones (the codes of elements 0, 2, .., 30 | 1, 3, .., 31);
 * two in-lane table lookups (pshufb) give each code's value as a bf16's low and high byte, interleaving them gives
 * bf16 words, and a bf16 is the top half of its fp32: << 16 (the even words) and & 0xFFFF0000 (the odd ones) are
 * four vectors of fp32 values, exactly. Every step is a one-cycle in-lane op; x is reordered to match (FOUR_BIT
 * below), once per call. The four vectors hold elements {0-7}, {8-15}, {16-23}, {24-31} of the block (as sets). */
static float e8m0_table[256];  /* 2^(s - 128): filled by moechat_init */

static void forget_workers(void);

static void read_spin(void);

void moechat_init(void) {
    for (int s = 0; s < 256; s++) e8m0_table[s] = e8m0_half((uint8_t)s);
    read_spin();
    static int atfork = 0;
    if (!atfork) atfork = !pthread_atfork(NULL, NULL, forget_workers);
}

#if SIMD
static const int FOUR_BIT[32] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                 16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31};

/* x [cols] -> fp32 in 4-bit-code order: each full 32-element block reordered by FOUR_BIT; the tail as it is */
static void x_four_bit(const void *x, int x_bf16, int64_t cols, float *xp) {
    int64_t full = cols / 32 * 32;
    for (int64_t c = 0; c < full; c += 32)
        for (int k = 0; k < 32; k++) xp[c + k] = load_x(x, x_bf16, c + FOUR_BIT[k]);
    for (int64_t j = full; j < cols; j++) xp[j] = load_x(x, x_bf16, j);
}

/* the value of each code as bf16 (table[code] = its high byte << 8 | low byte) */
static const uint16_t INT4_BF16[16] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};  // q = c - 8
static const uint16_t E2M1_X2_BF16[16] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
                                          0x8000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};  // 2 x E2M1

#ifndef NROWS
#define NROWS 4 /* rows a step (a -D flag for experiments: 2 measured a little slower) */
#endif
#ifndef PREFETCH
#define PREFETCH 1
#endif
/* the same bytes of the next group of rows (`ahead` bytes on), once per 64-byte line */
#define PF(p, off, ahead)                                                                                         \
    do {                                                                                                          \
        if (PREFETCH && ((off) & 63) == 0) _mm_prefetch((const char *)(p) + (ahead), _MM_HINT_T0);               \
    } while (0)

typedef struct { __m256i lo, hi; } Lut;

static Lut make_lut(const uint16_t *t) {
    uint8_t lo[16], hi[16];
    for (int k = 0; k < 16; k++) {
        lo[k] = (uint8_t)(t[k] & 0xFF);
        hi[k] = (uint8_t)(t[k] >> 8);
    }
    Lut l = {_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
             _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi))};
    return l;
}

static inline __attribute__((always_inline)) void decode32(const uint8_t *p, Lut lut, __m256 f[4]) {
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), m0f = _mm256_set1_epi8(0x0F);
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    c = _mm256_and_si256(_mm256_srlv_epi32(c, shift), m0f);
    __m256i lo = _mm256_shuffle_epi8(lut.lo, c), hi = _mm256_shuffle_epi8(lut.hi, c);
    __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, top));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, top));
}
#endif

/* -- 4-bit codes times a 16-bit x: the integer path (bf16 x; int4 in groups of 32, MXFP4) -----------------------
 * Where x is bf16 and a scale covers 32 elements, one token's dot products run in integers: x is rounded once per
 * call to 16-bit integers per 32-element block, q = round(x 2^(15-e)) with 2^e > max |x| >= 2^(e-1) (a power-of-two
 * step: x = q 2^(e-15) within half a step, 2^-16 of the block's largest |x|, 1/128 of that element's own bf16
 * rounding; every element within 2^7 of the largest is exact, and |q| <= 32640 as a bf16 has 8 significant bits).
 * Each code stays a small unsigned integer u (int4: the code, value u - 8; MXFP4: 2 x its E2M1 value + 12, by
 * pshufb), and madd (16 x 16 -> 32-bit pair sums) gives each block's sum of u q exactly, in four int32 lanes (each
 * < 2^24 in magnitude, so the fp32 conversion is exact too); the offset comes off as off * sum(q) per block
 * (`corr`), and the block's weight scale times x's power of two is one exact fp32 multiply. Against the fp32 path:
 * about half the instructions per byte (no per-element fp32 values, one FMA per two blocks). fp32 x keeps the fp32
 * path (an fp32 model is the exactness reference). Non-finite x makes the block's step NaN, so every output NaN.
 *
 * Registers: 32 bytes = two blocks, block g in the low 128-bit lane and g + 1 in the high one; low nibbles (elements
 * 0, 2, .., 30) and high nibbles (1, 3, .., 31) unpacked against zero into four vectors of 16-bit codes, each lane
 * holding eight: even elements 0-14, even 16-30, odd 1-15, odd 17-31. x16 holds x in that order, 64 words a pair of
 * blocks (a zero block after an odd last one), with the pair's eight x steps and eight correction lanes: int32 lane
 * i of a block sums elements 4i..4i+3 and 16+4i..19+4i.
 *
 * AVX-512 (BW; VNNI where the CPU has it): 64 bytes = four blocks, one a 128-bit lane, and no unpacking: q is split
 * into its bytes, q = 256 h + l (h = q >> 8 signed, l = q & 255 unsigned), and byte products summed four to an
 * int32 lane (vpdpbusd; else vpmaddubsw, which cannot saturate here, + vpmaddwd) give 256 sum(u h) + sum(u l).
 * One in-lane byte shuffle of the codes (bytes 0, 1, 8, 9, 2, 3, 10, 11, ..) puts each lane's elements in its four
 * bytes, so every lane holds the AVX2 loop's integer, and the fp32 steps run as two i16_pair calls would (the low
 * eight lanes' FMA, then the high eight's): every output has the AVX2 build's bits. x16 there holds l and h of the
 * even and the odd elements in the shuffled order, 256 bytes a quad of blocks (l even, l odd, h even, h odd at
 * 64 v + 16 b). 1.2x the AVX2 loop's rate from L2 on Zen 4 (int4 22 GB/s against 18-19 on one thread, MXFP4 17
 * against 14-15); from RAM MXFP4 1.1-1.2x, int4 as fast as the AVX2 loop (both at what one core of that VM reads,
 * 13-17 GB/s). */
#if SIMD
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define I16_512 1
#else
#define I16_512 0
#endif
typedef struct {
    void *q;       /* AVX2: [pairs, 64] int16; AVX-512: [quads, 256] bytes */
    float *step;   /* [pairs, 8]: 2^(e-15) of each block, four lanes each */
    int32_t *corr; /* [pairs, 8]: -off * sum(q) of each block, spread over its four lanes */
    void *mem;
} X16;


/* one block's 16-bit integers and its step; scalar (the rare blocks: non-finite, zero or
 * below 2^-113, where 2^(15-e) is no normal float) */
static float x16_block_scalar(const float *v, int32_t *t) {
    float mx = 0.0f;
    int bad = 0;
    for (int k = 0; k < 32; k++) {
        float a = fabsf(v[k]);
        bad |= !(a <= 3.402823466e38f); /* inf or NaN: the block's step is NaN, so is every output */
        mx = a > mx ? a : mx;
    }
    int e;
    frexpf(mx, &e); /* mx = m 2^e, m in [0.5, 1); e = 0 for a zero block */
    double f = ldexp(1.0, 15 - e);
    for (int k = 0; k < 32; k++) t[k] = bad ? 0 : (int32_t)lrint((double)v[k] * f);
    return bad ? NAN : (float)ldexp(1.0, e - 15);
}

/* one block of a bf16 x (32 elements at xb) -> its 16-bit integers t and its step 2^(e-15) (NaN if non-finite) */
static inline __attribute__((always_inline)) float x16_block(const uint16_t *xb, int32_t t[32]) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 v[4]; /* the block as fp32 (a bf16 << 16) */
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + k * 8))), 16));
    __m256 a0 = _mm256_andnot_ps(sign, v[0]), a1 = _mm256_andnot_ps(sign, v[1]);
    __m256 a2 = _mm256_andnot_ps(sign, v[2]), a3 = _mm256_andnot_ps(sign, v[3]);
    __m256 nf = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a0, inf, _CMP_NLT_UQ), _mm256_cmp_ps(a1, inf, _CMP_NLT_UQ)),
                             _mm256_or_ps(_mm256_cmp_ps(a2, inf, _CMP_NLT_UQ), _mm256_cmp_ps(a3, inf, _CMP_NLT_UQ)));
    __m256 m = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    uint32_t bits;
    float mx = _mm_cvtss_f32(m4), step;
    memcpy(&bits, &mx, 4);
    int E = (int)(bits >> 23); /* mx = 1.f 2^(E-127) = 0.5 (1.f) 2^(E-126): frexp's e = E - 126 */
    if (_mm256_movemask_ps(nf) || E < 15) {
        float w[32];
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(w + 8 * k, v[k]);
        step = x16_block_scalar(w, t);
    } else {
        uint32_t fb = (uint32_t)(268 - E) << 23, sb = (uint32_t)(E + 1 - 15) << 23; /* 2^(15-e), 2^(e-15) */
        float f;
        memcpy(&f, &fb, 4);
        memcpy(&step, &sb, 4);
        for (int k = 0; k < 4; k++) /* x 2^(15-e) is exact; the conversion rounds to nearest even */
            _mm256_storeu_si256((__m256i *)(t + 8 * k), _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(f))));
    }
    return step;
}

static int x16_make(const uint16_t *x, int64_t cols, int off, X16 *o) {
    int64_t G = cols / 32, P = I16_512 ? (G + 3) / 4 * 2 : (G + 1) / 2; /* AVX-512: whole quads */
    size_t bytes = (size_t)P * (64 * sizeof(int16_t) + 8 * sizeof(float) + 8 * sizeof(int32_t));
    o->mem = scratch(TLS_X, bytes);
    if (!o->mem) return -2;
    memset(o->mem, 0, bytes); /* the blocks past the last zero (an odd last block's pair) */
    o->q = o->mem;
    o->step = (float *)((int16_t *)o->q + P * 64);
    o->corr = (int32_t *)(o->step + P * 8);
#if I16_512
    const __m256i bytes_lh = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
    for (int64_t g = 0; g < G; g++) {
        int32_t t[32];
        float step = x16_block(x + g * 32, t);
        int64_t sum = 0;
        /* elements 0-7 .. 24-31 -> (even 0-14 | odd 1-15), (even 16-30 | odd 17-31) as 16-bit words */
        const __m256i eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        __m256i t0 = _mm256_loadu_si256((const __m256i *)t), t1 = _mm256_loadu_si256((const __m256i *)(t + 8));
        __m256i t2 = _mm256_loadu_si256((const __m256i *)(t + 16)), t3 = _mm256_loadu_si256((const __m256i *)(t + 24));
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(t0, t1), _mm256_add_epi32(t2, t3));
        __m256i w01 = _mm256_packs_epi32(_mm256_permutevar8x32_epi32(t0, eo), _mm256_permutevar8x32_epi32(t1, eo));
        __m256i w23 = _mm256_packs_epi32(_mm256_permutevar8x32_epi32(t2, eo), _mm256_permutevar8x32_epi32(t3, eo));
        int64_t p = g / 2, lane = g % 2;
#if I16_512
        /* each lane's elements (0, 2, 16, 18 | 4, 6, 20, 22 | ..: a lane's even ones) as words, then their low bytes
         * before their high ones: (l | h) of the even elements in the low 128 bits, of the odd ones in the high */
        __m256i e01 = _mm256_shuffle_epi8(_mm256_unpacklo_epi32(w01, w23), bytes_lh);
        __m256i e23 = _mm256_shuffle_epi8(_mm256_unpackhi_epi32(w01, w23), bytes_lh);
        __m256i l = _mm256_unpacklo_epi64(e01, e23), h = _mm256_unpackhi_epi64(e01, e23);
        uint8_t *dst = (uint8_t *)o->q + g / 4 * 256 + g % 4 * 16;
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(l));
        _mm_storeu_si128((__m128i *)(dst + 64), _mm256_extracti128_si256(l, 1));
        _mm_storeu_si128((__m128i *)(dst + 128), _mm256_castsi256_si128(h));
        _mm_storeu_si128((__m128i *)(dst + 192), _mm256_extracti128_si256(h, 1));
#else
        int16_t *dst = (int16_t *)o->q + p * 64 + lane * 8;
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(w01));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm256_castsi256_si128(w23));
        _mm_storeu_si128((__m128i *)(dst + 32), _mm256_extracti128_si256(w01, 1));
        _mm_storeu_si128((__m128i *)(dst + 48), _mm256_extracti128_si256(w23, 1));
#endif
        int32_t s[8];
        _mm256_storeu_si256((__m256i *)s, s8);
        for (int k = 0; k < 8; k++) sum += s[k];
        int32_t c = (int32_t)(off * sum), c4 = c / 4;
        for (int k = 0; k < 4; k++) {
            o->step[p * 8 + lane * 4 + k] = step;
            o->corr[p * 8 + lane * 4 + k] = -(k ? c4 : c - 3 * c4); /* negated: the sums start from it */
        }
    }
    return 0;
}

#ifndef I16_AHEAD
#define I16_AHEAD 4096 /* bytes (1-8 KB measured alike; the AVX-512 loop: 2-8 KB, T0 or T1 within noise, none 0.8x) */
#endif
#ifndef I16_HINT
#define I16_HINT _MM_HINT_T0
#endif
enum { K_INT4, K_MXFP4 };
/* 2 x E2M1 + 12 for each code (0..24) */
static const int8_t E2M1_X2_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

#if I16_512
/* d + the sums of four products u8 x s8 to an int32 lane: VNNI's vpdpbusd, else two products to a word (no
 * saturation: |u s| <= 255 x 24) and two words to an int32 */
#ifdef __AVX512VNNI__
#define DOT_U8(d, u, s) _mm512_dpbusd_epi32(d, u, s)
#else
#define DOT_U8(d, u, s) _mm512_add_epi32(d, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8_256(d, u, s) _mm256_dpbusd_epi32(d, u, s)
#else
#define DOT_U8_256(d, u, s) _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
/* the codes of each 128-bit lane (a block) in lane order: bytes 2i, 2i+1, 8+2i, 9+2i to int32 lane i */
static const int8_t I16_LANES[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

/* one quad of blocks of one row: its 64 code bytes (c) against x16's quad Q -> the sixteen exact int32 lanes (the
 * AVX2 loop's two pairs') */
static inline __attribute__((always_inline)) __m512i i16_quad(const X16 *xq, int64_t Q, __m512i c, const int kind) {
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    const uint8_t *xp = (const uint8_t *)xq->q + Q * 256;
    c = _mm512_shuffle_epi8(c, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)I16_LANES)));
    __m512i lo = _mm512_and_si512(c, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), m0f);
    if (kind == K_MXFP4) {
        const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_X2_U));
        lo = _mm512_shuffle_epi8(lut, lo);
        hi = _mm512_shuffle_epi8(lut, hi);
    }
    __m512i d = DOT_U8(_mm512_loadu_si512(xq->corr + Q * 16), _mm512_loadu_si512(xp), lo);
    d = DOT_U8(d, _mm512_loadu_si512(xp + 64), hi);
    __m512i h = DOT_U8(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp + 128));
    h = DOT_U8(h, hi, _mm512_loadu_si512(xp + 192));
    return _mm512_add_epi32(d, _mm512_slli_epi32(h, 8));
}

/* the pair p's 32 code bytes as i16_quad (the tail of a row) */
static inline __attribute__((always_inline)) __m256i i16_pair_ints(const X16 *xq, int64_t p, __m256i c,
                                                                   const int kind) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const uint8_t *xp = (const uint8_t *)xq->q + p / 2 * 256 + p % 2 * 32;
    c = _mm256_shuffle_epi8(c, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)I16_LANES)));
    __m256i lo = _mm256_and_si256(c, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m0f);
    if (kind == K_MXFP4) {
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2_U));
        lo = _mm256_shuffle_epi8(lut, lo);
        hi = _mm256_shuffle_epi8(lut, hi);
    }
    __m256i d = DOT_U8_256(_mm256_loadu_si256((const __m256i *)(xq->corr + p * 8)),
                           _mm256_loadu_si256((const __m256i *)xp), lo);
    d = DOT_U8_256(d, _mm256_loadu_si256((const __m256i *)(xp + 64)), hi);
    __m256i h = DOT_U8_256(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(xp + 128)));
    h = DOT_U8_256(h, hi, _mm256_loadu_si256((const __m256i *)(xp + 192)));
    return _mm256_add_epi32(d, _mm256_slli_epi32(h, 8));
}
#else
/* one pair of blocks of one row: its 32 code bytes (c) against x16's pair p -> its eight exact int32 lanes */
static inline __attribute__((always_inline)) __m256i i16_pair_ints(const X16 *xq, int64_t p, __m256i c,
                                                                   const int kind) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i *xp = (const __m256i *)((const int16_t *)xq->q + p * 64);
    __m256i lo = _mm256_and_si256(c, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m0f);
    if (kind == K_MXFP4) {
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2_U));
        lo = _mm256_shuffle_epi8(lut, lo);
        hi = _mm256_shuffle_epi8(lut, hi);
    }
    __m256i d = _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), _mm256_loadu_si256(xp));
    d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), _mm256_loadu_si256(xp + 1)));
    d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), _mm256_loadu_si256(xp + 2)));
    d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), _mm256_loadu_si256(xp + 3)));
    return _mm256_add_epi32(d, _mm256_loadu_si256((const __m256i *)(xq->corr + p * 8)));
}
#endif

/* one pair of blocks of one row: its 32 code bytes (c) against x16's pair p; the pair's partial sums in fp32 times
 * its two weight scales (s: lanes 0-3 and 4-7) added to acc */
static inline __attribute__((always_inline)) __m256 i16_pair(const X16 *xq, int64_t p, __m256i c, __m256 s,
                                                             __m256 acc, const int kind) {
    __m256i d = i16_pair_ints(xq, p, c, kind);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_loadu_ps(xq->step + p * 8)), acc);
}

/* the weight scales of blocks g..g+n-1 of a row as fp32 (n = 8, 2 or 1; the rest of the lanes 0): int4's from
 * fp16, MXFP4's from E8M0 */
static inline __attribute__((always_inline)) __m256 i16_scales(const void *scale, int64_t at, const int n,
                                                               const int kind) {
    if (kind == K_INT4) {  /* fp16 scales, widened by F16C (exact) */
        const uint16_t *sr = (const uint16_t *)scale + at;
        if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sr));
        return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(n == 2 ? sr[0] | sr[1] << 16 : sr[0])));
    }
    const uint8_t *sr = (const uint8_t *)scale + at;
    __m128i b = n == 8 ? _mm_loadl_epi64((const __m128i *)sr)
                : n == 2 ? _mm_cvtsi32_si128(sr[0] | sr[1] << 8) : _mm_cvtsi32_si128(sr[0]);
    /* E8M0 s -> 2^(s - 128) (e8m0_half) in integer ops: (s - 1) << 23, or for s = 0, 1 the subnormal 2^21 << s */
    __m256i e = _mm256_cvtepu8_epi32(b);
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i v = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
    if (n < 8) v = _mm256_blend_epi32(_mm256_setzero_si256(), v, n == 2 ? 0x03 : 0x01);
    return _mm256_castsi256_ps(v);
}

#if I16_512
/* a quad's sixteen lanes in fp32 times their scales (s0: the low eight lanes', s1: the high eight's) into acc: the
 * low eight lanes' FMA, then the high eight's (the AVX2 loop's order) */
static inline __attribute__((always_inline)) __m256 i16_quad_acc(const X16 *xq, int64_t Q, __m512i c, __m256 s0,
                                                                 __m256 s1, __m256 acc, const int kind) {
    __m512 f = _mm512_cvtepi32_ps(i16_quad(xq, Q, c, kind));
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_mul_ps(s0, _mm256_loadu_ps(xq->step + Q * 16)), acc);
    return _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)),
                           _mm256_mul_ps(s1, _mm256_loadu_ps(xq->step + Q * 16 + 8)), acc);
}
#endif

/* One row of 4-bit codes (G blocks of 16 bytes) against x16 -> its output. Four pairs a step (AVX-512: as two
 * quads): their eight weight scales in one load (int4) or made from the eight E8M0 bytes (MXFP4), then each pair's
 * two by one in-register permute. Row by row (one stream: the rows are contiguous), prefetching I16_AHEAD bytes
 * on: measured at least as fast as 2, 4 or 8 rows sharing each x load, as x16 comes from L1 either way (the AVX-512
 * loop with two rows a step: as fast from L2, 0.6x from RAM). */
static inline __attribute__((always_inline)) float i16_row(const X16 *xq, const uint8_t *codes, const void *scale,
                                                           int64_t r, int64_t G, const int kind) {
    const __m256i pairs[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                              _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    const uint8_t *row = codes + r * G * 16;
    int64_t full = G / 2, p = 0;
    __m256 acc = _mm256_setzero_ps();
#if I16_512
    for (; p + 4 <= full; p += 4) {  // two quads a step
        __m256 s8 = i16_scales(scale, r * G + 2 * p, 8, kind);
        for (int k = 0; k < 2; k++) {
            const uint8_t *b = row + (p + 2 * k) * 32;
            _mm_prefetch((const char *)b + I16_AHEAD, I16_HINT);
            acc = i16_quad_acc(xq, p / 2 + k, _mm512_loadu_si512(b), _mm256_permutevar8x32_ps(s8, pairs[2 * k]),
                               _mm256_permutevar8x32_ps(s8, pairs[2 * k + 1]), acc, kind);
        }
    }
#endif
    for (; p + 4 <= full; p += 4) {
        __m256 s8 = i16_scales(scale, r * G + 2 * p, 8, kind);
        for (int k = 0; k < 4; k++) {
            const uint8_t *b = row + (p + k) * 32;
            if (((p + k) & 1) == 0) _mm_prefetch((const char *)b + I16_AHEAD, I16_HINT);
            acc = i16_pair(xq, p + k, _mm256_loadu_si256((const __m256i *)b), _mm256_permutevar8x32_ps(s8, pairs[k]),
                           acc, kind);
        }
    }
    for (; p < (G + 1) / 2; p++) {  // the last pairs, and an odd last block (its pair's second block zero)
        const uint8_t *b = row + p * 32;
        int two = p < full;
        __m256i c = two ? _mm256_loadu_si256((const __m256i *)b)
                        : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)b));
        __m256 s2 = two ? i16_scales(scale, r * G + 2 * p, 2, kind) : i16_scales(scale, r * G + 2 * p, 1, kind);
        acc = i16_pair(xq, p, c, _mm256_permutevar8x32_ps(s2, pairs[0]), acc, kind);
    }
    return hsum(acc);
}

/* the integer path of a whole matrix: x made into x16 once (int4's codes are offset by 8, MXFP4's by 12), then
 * row by row */
static inline __attribute__((always_inline)) int i16_gemv(const void *x, const uint8_t *codes, const void *scale,
                                                          int64_t rows, int64_t cols, float *y, const int kind) {
    X16 xq;
    if (x16_make(x, cols, kind == K_INT4 ? 8 : 12, &xq)) return -2;
    for (int64_t r = 0; r < rows; r++) y[r] = i16_row(&xq, codes, scale, r, cols / 32, kind);
    return 0;
}
#endif

/* what the integer path was built for: 0 none (the scalar build), 1 AVX2, 2 AVX-512BW, 3 AVX-512 VNNI (the tests,
 * the bench) */
int moechat_i16_isa(void) {
#if !SIMD
    return 0;
#elif !I16_512
    return 1;
#elif defined(__AVX512VNNI__)
    return 3;
#else
    return 2;
#endif
}

/* -- int4: q [rows, cols/2] u8 (low nibble the even element, code = q + 8), scale [rows, cols/group] fp16 ------ */
#if SIMD
/* NR rows at once: each x load serves NR rows, and NR accumulator chains keep the FMA units busy */
static inline __attribute__((always_inline)) void int4_rows(const float *xp, const uint8_t *q, const uint16_t *scale,
                                                            int64_t r, int64_t cols, int64_t group, float *y,
                                                            const int NR, Lut lut) {
    const __m256i idx0 = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1), idx1 = _mm256_setr_epi32(2, 2, 3, 3, 2, 2, 3, 3);
    int64_t full = cols / 32 * 32, G = cols / group, half = cols / 2;
    const uint8_t *qr = q + r * half;
    const uint16_t *sr = scale + r * G;
    __m256 acc[NROWS];
    for (int u = 0; u < NR; u++) acc[u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < full; c += 32) {
        const float *xc = xp + c;
        for (int u = 0; u < NR; u++) {
            __m256 f[4];
            PF(qr + u * half + c / 2, c / 2, NR * half);
            decode32(qr + u * half + c / 2, lut, f);
            __m256 ta = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xc + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xc)));
            if (group == 32) {  // one FMA chain over the block, then its scale
                ta = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xc + 16), ta);
                ta = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xc + 24), ta);
                acc[u] = _mm256_fmadd_ps(ta, _mm256_set1_ps(f16_to_f32(sr[u * G + c / 32])), acc[u]);
                continue;
            }
            // ta: elements 0-15 of the block, tb: 16-31
            __m256 tb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xc + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xc + 16)));
            if (group == 16) {
                acc[u] = _mm256_fmadd_ps(ta, _mm256_set1_ps(f16_to_f32(sr[u * G + c / 16])), acc[u]);
                acc[u] = _mm256_fmadd_ps(tb, _mm256_set1_ps(f16_to_f32(sr[u * G + c / 16 + 1])), acc[u]);
            } else {  // groups of 8: ta's lanes hold elements 0,4,8,12,1,5,9,13 (+2): groups 0,0,1,1,0,0,1,1
                __m256 s4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sr + u * G + c / 8))));
                acc[u] = _mm256_fmadd_ps(ta, _mm256_permutevar8x32_ps(s4, idx0), acc[u]);
                acc[u] = _mm256_fmadd_ps(tb, _mm256_permutevar8x32_ps(s4, idx1), acc[u]);
            }
        }
    }
    for (int u = 0; u < NR; u++) {
        float a = hsum(acc[u]);
        for (int64_t j = full; j < cols; j++) {  // a last 16 or 8 elements (groups of 16 or 8)
            int code = (j & 1) ? (qr[u * half + j / 2] >> 4) : (qr[u * half + j / 2] & 15);
            a += (float)(code - 8) * f16_to_f32(sr[u * G + j / group]) * xp[j];
        }
        y[r + u] = a;
    }
}
#endif

static int int4_gemv_f32(const void *x, int x_bf16, const uint8_t *q, const uint16_t *scale, int64_t rows, int64_t cols,
                      int64_t group, float *y) {
    if (group != 32 && group != 16 && group != 8) return -1;
    if (cols % group) return -1;
    int64_t r = 0;
#if SIMD
    if (group == 32 && x_bf16) return i16_gemv(x, q, scale, rows, cols, y, K_INT4);  // the integer path
#endif
    float *xp = scratch(TLS_X, sizeof(float) * (size_t)(cols + 1));
    if (!xp) return -2;
#if SIMD
    x_four_bit(x, x_bf16, cols, xp);
    Lut lut = make_lut(INT4_BF16);
    // fp32 x, or groups of 16 or 8 (inputs not a multiple of 32): fp32 values; the group and the row count as
    // constants: one specialised loop each
#define INT4_CASE(GROUP)                                                                                          \
    if (group == GROUP) {                                                                                         \
        for (; r + NROWS <= rows; r += NROWS) int4_rows(xp, q, scale, r, cols, GROUP, y, NROWS, lut);             \
        for (; r < rows; r++) int4_rows(xp, q, scale, r, cols, GROUP, y, 1, lut);                                \
    }
    INT4_CASE(32) else INT4_CASE(16) else INT4_CASE(8)
#undef INT4_CASE
#else
    for (int64_t j = 0; j < cols; j++) xp[j] = load_x(x, x_bf16, j);
    int64_t G = cols / group;
    for (; r < rows; r++) {  // per group: the sum of q x, times the group's scale
        const uint8_t *qr = q + r * (cols / 2);
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++) {
            float part = 0.0f;
            for (int64_t j = g * group; j < (g + 1) * group; j += 2) {
                uint8_t b = qr[j / 2];
                part += (float)((b & 15) - 8) * xp[j] + (float)((b >> 4) - 8) * xp[j + 1];
            }
            acc += part * f16_to_f32(scale[r * G + g]);
        }
        y[r] = acc;
    }
#endif
    return 0;
}

/* -- MXFP4: blocks [rows, cols/32, 16] u8 (E2M1 codes, low nibble the even element), scales [rows, cols/32] u8 -- */
#if SIMD
static inline __attribute__((always_inline)) void mxfp4_rows(const float *xp, const uint8_t *blocks,
                                                             const uint8_t *scales, int64_t r, int64_t G, float *y,
                                                             const int NR, Lut lut) {
    const uint8_t *br = blocks + r * G * 16, *sr = scales + r * G;
    __m256 acc[NROWS];
    for (int u = 0; u < NR; u++) acc[u] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const float *xc = xp + g * 32;
        for (int u = 0; u < NR; u++) {
            __m256 f[4];
            PF(br + (u * G + g) * 16, g * 16, NR * G * 16);
            decode32(br + (u * G + g) * 16, lut, f);  // 2 x the E2M1 values
            __m256 t = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xc + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xc)));
            t = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xc + 16), t);
            t = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xc + 24), t);
            acc[u] = _mm256_fmadd_ps(t, _mm256_broadcast_ss(e8m0_table + sr[u * G + g]), acc[u]);
        }
    }
    for (int u = 0; u < NR; u++) y[r + u] = hsum(acc[u]);
}
#endif

static int mxfp4_gemv_f32(const void *x, int x_bf16, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                       int64_t cols, float *y) {
    if (cols % 32) return -1;
    int64_t G = cols / 32, r = 0;
#if SIMD
    if (x_bf16) return i16_gemv(x, blocks, scales, rows, cols, y, K_MXFP4);  // the integer path
#endif
    float *xp = scratch(TLS_X, sizeof(float) * (size_t)(cols + 1));
    if (!xp) return -2;
#if SIMD
    x_four_bit(x, x_bf16, cols, xp);
    Lut lut = make_lut(E2M1_X2_BF16);
    for (; r + NROWS <= rows; r += NROWS) mxfp4_rows(xp, blocks, scales, r, G, y, NROWS, lut);
    for (; r < rows; r++) mxfp4_rows(xp, blocks, scales, r, G, y, 1, lut);
#else
    for (int64_t j = 0; j < cols; j++) xp[j] = load_x(x, x_bf16, j);
    for (; r < rows; r++) {
        const uint8_t *br = blocks + r * G * 16;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++) {
            float part = 0.0f;
            for (int k = 0; k < 16; k++) {
                uint8_t b = br[g * 16 + k];
                part += (float)E2M1_X2[b & 15] * xp[g * 32 + 2 * k] + (float)E2M1_X2[b >> 4] * xp[g * 32 + 2 * k + 1];
            }
            acc += part * e8m0_table[scales[r * G + g]];
        }
        y[r] = acc;
    }
#endif
    return 0;
}

/* -- FP8 e4m3: w [rows, cols], scale [ceil(rows/b0), ceil(cols/b1)] fp32 (partial blocks at the edges) ---------
 * In registers, 32 bytes at a time as 8 dwords: each byte moved to the top of a 16-bit word, arithmetic-shifted
 * right by 4 and masked (0x87FF) is a bf16 bit pattern equal to the e4m3 value x 2^-120 (subnormals land on
 * bf16's subnormals), and a bf16 is the top half of its fp32: bytes 0, 1, 2, 3 of each dword give four vectors of
 * fp32 values in shifts and ands only. x carries the block scale and 2^64 (x s 2^64 cannot overflow, x s 2^120
 * could) and the sum is taken back by 2^56: powers of two, exact. x is reordered to match (byte i of dword k is
 * element 4k + i of the 32). */
#define FP8_X_SHIFT 18446744073709551616.0f /* 2^64 */
#define FP8_Y_SHIFT 72057594037927936.0f    /* 2^56 */

#if SIMD
static inline __attribute__((always_inline)) void fp8_rows(const float *xs, const uint8_t *w, int64_t r,
                                                           int64_t cols, float *y, const int NR) {
    const __m256i m_lo = _mm256_set1_epi32(0x000087F0), m_hi = _mm256_set1_epi32((int)0x87F00000u);
    int64_t full = cols / 32 * 32;
    __m256 a[NROWS];
    for (int u = 0; u < NR; u++) a[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 32) {
        const float *xc = xs + j;
        for (int u = 0; u < NR; u++) {
            const uint8_t *p = w + (r + u) * cols + j;
            PF(p, j, NR * cols);
            __m256i v = _mm256_loadu_si256((const __m256i *)p);
            __m256i odd = _mm256_srai_epi16(v, 4);  // bytes 1, 3: sign-extended << 4 (bits 0-3 from byte 0, 2)
            __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4);  // bytes 0, 2
            __m256 f0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(even, m_lo), 16));
            __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(odd, m_lo), 16));
            __m256 f2 = _mm256_castsi256_ps(_mm256_and_si256(even, m_hi));
            __m256 f3 = _mm256_castsi256_ps(_mm256_and_si256(odd, m_hi));
            __m256 t = _mm256_fmadd_ps(f1, _mm256_loadu_ps(xc + 8), _mm256_mul_ps(f0, _mm256_loadu_ps(xc)));
            t = _mm256_fmadd_ps(f2, _mm256_loadu_ps(xc + 16), t);
            a[u] = _mm256_add_ps(a[u], _mm256_fmadd_ps(f3, _mm256_loadu_ps(xc + 24), t));
        }
    }
    for (int u = 0; u < NR; u++) {
        float tail = 0.0f;
        for (int64_t k = full; k < cols; k++) tail += e4m3(w[(r + u) * cols + k]) * (xs[k] / FP8_X_SHIFT);
        y[r + u] = hsum(a[u]) * FP8_Y_SHIFT + tail;
    }
}
#endif

static int fp8_gemv_f32(const void *x, int x_bf16, const uint8_t *w, const float *scale, int64_t rows, int64_t cols,
                     int64_t b0, int64_t b1, float *y) {
    if (b0 <= 0 || b1 <= 0) return -1;
    float *xs = scratch(TLS_X, sizeof(float) * (size_t)(2 * cols + 1));
    if (!xs) return -2;
#if SIMD
    float *xr = xs + cols;
#endif
    int64_t nb1 = (cols + b1 - 1) / b1, full = cols / 32 * 32;
#if SIMD
    // x as fp32 in the kernel's order, once
    for (int64_t c = 0; c < full; c += 32)
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < 8; k++) xr[c + 8 * i + k] = load_x(x, x_bf16, c + 4 * k + i);
    for (int64_t j = full; j < cols; j++) xr[j] = load_x(x, x_bf16, j);
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += b0) {
        const float *srow = scale + (r0 / b0) * nb1;
        int64_t r1 = r0 + b0 < rows ? r0 + b0 : rows, r = r0;
#if SIMD
        // x times the row block's scale per column (x 2^64): one scale per 32 columns where b1 is a multiple of 32
        for (int64_t c = 0; c < full; c += 32) {
            if (b1 % 32 == 0) {
                __m256 f = _mm256_set1_ps(srow[c / b1] * FP8_X_SHIFT);
                for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(xs + c + i, _mm256_mul_ps(_mm256_loadu_ps(xr + c + i), f));
                continue;
            }
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < 8; k++) xs[c + 8 * i + k] = xr[c + 8 * i + k] * (srow[(c + 4 * k + i) / b1] * FP8_X_SHIFT);
        }
        for (int64_t j = full; j < cols; j++) xs[j] = xr[j] * (srow[j / b1] * FP8_X_SHIFT);
        for (; r + NROWS <= r1; r += NROWS) fp8_rows(xs, w, r, cols, y, NROWS);
        for (; r < r1; r++) fp8_rows(xs, w, r, cols, y, 1);
#else
        for (int64_t j = 0; j < cols; j++) xs[j] = load_x(x, x_bf16, j) * srow[j / b1];
        for (; r < r1; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < cols; j++) acc += e4m3(w[r * cols + j]) * xs[j];
            y[r] = acc;
        }
#endif
    }
    (void)full;
    return 0;
}

/* -- int8: q [rows, cols] int8, scale [rows] fp32 (w = q * scale) ----------------------------------------------
 * A bf16 x with cols a multiple of 32 (the SIMD build): x rounded to 16 bits per 32-element block once per call
 * (x16_block: round(x 2^(15-e)) with a power-of-two step, native.round_x16 the reference), then each block's 32
 * products summed exactly in int32 (codes widened to int16, vpmaddwd against x16), converted once and scaled by
 * the block's step into fp32 lanes, the row's scale applied last: ~9 instructions per 32 bytes where the fp32
 * path takes ~18, so the row stream runs at the read bandwidth. Within 2^-16 of each block's largest |x| per
 * element (x's bf16 rounding is 2^-9 of it); fp32 x keeps the fp32 path below (the exactness reference). */
static int int8_i16 = 1;
void moechat_set_int8_i16(int on) { int8_i16 = on != 0; }

#if SIMD
static inline __attribute__((always_inline)) float int8_row16(const int16_t *xq, const float *step, const int8_t *q,
                                                              int64_t r, int64_t G) {
    const int8_t *p = q + r * G * 32;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {  /* two blocks a step, one accumulator each (a fixed order) */
        const int8_t *b = p + g * 32;
        _mm_prefetch((const char *)(b + 8192), _MM_HINT_T1);
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16)));
        __m256i w2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 32)));
        __m256i w3 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 48)));
        const __m256i *x = (const __m256i *)(xq + g * 32);
        __m256i d0 = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                                      _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1)));
        __m256i d1 = _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(x + 2)),
                                      _mm256_madd_epi16(w3, _mm256_loadu_si256(x + 3)));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(step + g), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(step + g + 1), a1);
    }
    if (g < G) {
        const int8_t *b = p + g * 32;
        const __m256i *x = (const __m256i *)(xq + g * 32);
        __m256i d0 = _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b)), _mm256_loadu_si256(x)),
            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16))), _mm256_loadu_si256(x + 1)));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(step + g), a0);
    }
    return hsum(_mm256_add_ps(a0, a1));
}

static int int8_gemv_i16(const uint16_t *x, const int8_t *q, const float *scale, int64_t rows, int64_t cols,
                         float *y) {
    int64_t G = cols / 32;
    int16_t *xq = scratch(TLS_X, (size_t)cols * sizeof(int16_t) + (size_t)G * sizeof(float));
    if (!xq) return -2;
    float *step = (float *)(xq + cols);  /* cols is even: 4-byte aligned */
    for (int64_t g = 0; g < G; g++) {
        int32_t t[32];
        step[g] = x16_block(x + g * 32, t);
        __m256i w01 = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)t), _mm256_loadu_si256((const __m256i *)(t + 8)));
        __m256i w23 = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)(t + 16)),
                                         _mm256_loadu_si256((const __m256i *)(t + 24)));
        /* packs interleaves the 128-bit lanes: (0-3, 8-11, 4-7, 12-15) -> element order by a qword permute */
        _mm256_storeu_si256((__m256i *)(xq + g * 32), _mm256_permute4x64_epi64(w01, 0xD8));
        _mm256_storeu_si256((__m256i *)(xq + g * 32 + 16), _mm256_permute4x64_epi64(w23, 0xD8));
    }
    for (int64_t r = 0; r < rows; r++) y[r] = int8_row16(xq, step, q, r, G) * scale[r];
    return 0;
}
#endif

/* The fp32 path (an fp32 x, the scalar build, MOECHAT_INT8_I16=0 for the A/B: native.py sets it): one row at a time over four accumulators, 4 KB prefetched ahead: 18.3 GB/s over a [151936, 2048] matrix on one
 * core where four rows a step read 10.7 (C harness; the row-at-a-time loop keeps one stream of loads in order). */
#if SIMD
static inline __attribute__((always_inline)) void int8_row(const float *xf, const int8_t *q, const float *scale,
                                                           int64_t r, int64_t cols, float *y) {
    const int8_t *p = q + r * cols;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32) {
        _mm_prefetch((const char *)(p + j + 4096), _MM_HINT_T0);
        __m128i b0 = _mm_loadu_si128((const __m128i *)(p + j)), b1 = _mm_loadu_si128((const __m128i *)(p + j + 16));
        a0 = _mm256_fmadd_ps(i8_to_f32(b0), _mm256_loadu_ps(xf + j), a0);
        a1 = _mm256_fmadd_ps(i8_to_f32(_mm_unpackhi_epi64(b0, b0)), _mm256_loadu_ps(xf + j + 8), a1);
        a2 = _mm256_fmadd_ps(i8_to_f32(b1), _mm256_loadu_ps(xf + j + 16), a2);
        a3 = _mm256_fmadd_ps(i8_to_f32(_mm_unpackhi_epi64(b1, b1)), _mm256_loadu_ps(xf + j + 24), a3);
    }
    float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; j < cols; j++) acc += (float)p[j] * xf[j];
    y[r] = acc * scale[r];
}
#endif

static int int8_gemv_f32(const void *x, int x_bf16, const int8_t *q, const float *scale, int64_t rows, int64_t cols,
                      float *y) {
#if SIMD
    if (x_bf16 && cols % 32 == 0 && int8_i16) return int8_gemv_i16(x, q, scale, rows, cols, y);
#endif
    float *xf = scratch(TLS_X, sizeof(float) * (size_t)(cols + 1));
    if (!xf) return -2;
    for (int64_t j = 0; j < cols; j++) xf[j] = load_x(x, x_bf16, j);
    int64_t r = 0;
#if SIMD
    for (; r < rows; r++) int8_row(xf, q, scale, r, cols, y);
#else
    for (; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < cols; j++) acc += (float)q[r * cols + j] * xf[j];
        y[r] = acc * scale[r];
    }
#endif
    return 0;
}

/* -- bf16: w [rows, cols] bf16 (a bf16 model's dense projections and LM head, one token): fp32 sums, one row at a
 * time over four accumulators (a fixed order: the same bits at any thread count), 8 KB prefetched ahead into L2. torch
 * 2.13's one-row bf16 GEMM read such a matrix at ~12 GB/s on a 26 GB/s core; this loop at ~22 (C harness,
 * [151936, 2048], one thread). */
#ifndef BF16_AHEAD
#define BF16_AHEAD 8192 /* bytes, into L2: 20.1-21.2 GB/s against 17.1-20.1 at 4 KB into L1 (two A/B runs of
                         * [151936, 2048], one thread, quiet machine) */
#endif
#ifndef BF16_HINT
#define BF16_HINT _MM_HINT_T1
#endif
#if SIMD
static inline __m256 bf16_w8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* Two rows a step where measured faster (BF16_PAIRS: AVX2 builds without AVX-512; a Zen 2 core, [201088, 2880]:
 * 15.4 vs 13.6 GB/s on one thread, 28.6 vs 25.0 on two; bench/bf16_cpu.py; not measured on an AVX-512 core, which
 * keeps one row a step): each x load serves both
 * rows and both rows' next bytes are prefetched, and each row keeps the one-row loop's four accumulators over the same
 * elements in the same order, so every row's bits are the one-row loop's (any split of rows, any thread count). */
#ifndef BF16_PAIRS
#if SIMD && !defined(__AVX512F__)
#define BF16_PAIRS 1
#else
#define BF16_PAIRS 0
#endif
#endif

#if SIMD
static inline __attribute__((always_inline)) void bf16_row_pair(const float *xf, const uint16_t *p, int64_t cols,
                                                                float *y) {
    const uint16_t *q = p + cols;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32) {
        _mm_prefetch((const char *)(p + j) + BF16_AHEAD, BF16_HINT);
        _mm_prefetch((const char *)(q + j) + BF16_AHEAD, BF16_HINT);
        __m256 xv = _mm256_loadu_ps(xf + j);
        a0 = _mm256_fmadd_ps(bf16_w8(p + j), xv, a0);
        b0 = _mm256_fmadd_ps(bf16_w8(q + j), xv, b0);
        xv = _mm256_loadu_ps(xf + j + 8);
        a1 = _mm256_fmadd_ps(bf16_w8(p + j + 8), xv, a1);
        b1 = _mm256_fmadd_ps(bf16_w8(q + j + 8), xv, b1);
        xv = _mm256_loadu_ps(xf + j + 16);
        a2 = _mm256_fmadd_ps(bf16_w8(p + j + 16), xv, a2);
        b2 = _mm256_fmadd_ps(bf16_w8(q + j + 16), xv, b2);
        xv = _mm256_loadu_ps(xf + j + 24);
        a3 = _mm256_fmadd_ps(bf16_w8(p + j + 24), xv, a3);
        b3 = _mm256_fmadd_ps(bf16_w8(q + j + 24), xv, b3);
    }
    float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float acc2 = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    for (int64_t k = j; k < cols; k++) acc += bf16_to_f32(p[k]) * xf[k];
    for (int64_t k = j; k < cols; k++) acc2 += bf16_to_f32(q[k]) * xf[k];
    y[0] = acc;
    y[1] = acc2;
}
#endif

static int bf16_gemv_f32(const void *x, int x_bf16, const uint16_t *w, int64_t rows, int64_t cols, float *y) {
    float *xf = scratch(TLS_X, sizeof(float) * (size_t)(cols + 1));
    if (!xf) return -2;
    for (int64_t j = 0; j < cols; j++) xf[j] = load_x(x, x_bf16, j);
    int64_t r = 0;
#if SIMD && BF16_PAIRS
    for (; r + 2 <= rows; r += 2) bf16_row_pair(xf, w + r * cols, cols, y + r);
#endif
    for (; r < rows; r++) {
        const uint16_t *p = w + r * cols;
        int64_t j = 0;
        float acc = 0.0f;
#if SIMD
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; j + 32 <= cols; j += 32) {
            _mm_prefetch((const char *)(p + j) + BF16_AHEAD, BF16_HINT);
            a0 = _mm256_fmadd_ps(bf16_w8(p + j), _mm256_loadu_ps(xf + j), a0);
            a1 = _mm256_fmadd_ps(bf16_w8(p + j + 8), _mm256_loadu_ps(xf + j + 8), a1);
            a2 = _mm256_fmadd_ps(bf16_w8(p + j + 16), _mm256_loadu_ps(xf + j + 16), a2);
            a3 = _mm256_fmadd_ps(bf16_w8(p + j + 24), _mm256_loadu_ps(xf + j + 24), a3);
        }
        acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
        for (; j < cols; j++) acc += bf16_to_f32(p[j]) * xf[j];
        y[r] = acc;
    }
    return 0;
}

/* -- many tokens (prefill): a packed matrix decoded to fp32 values [rows, cols], bit for bit the format's weight()
 * Each weight tile is decoded once for all the tokens routed to an expert, then one GEMM (torch's) multiplies it:
 * quant/cpu.py. Every value is one fp32 multiply of exact operands, as weight() computes it: int4 (code - 8) x its
 * group's fp16 scale (widened exactly); MXFP4 2 x its E2M1 value (the magnitude from an in-register table, the sign bit apart, so -0 stays
 * -0) x 2^(s - 128) (e8m0_half: exact for every s, 0 and 255 included); FP8 the e4m3 byte as an fp16 bit pattern
 * (F16C, exact: value x 2^-8), x 2^8 and x its block's scale (NaN bytes decode as 480, as the GEMV's bit trick
 * does). Output stores dominate (4 bytes per 0.5-1 packed byte): each row is written once, in element order.
 * Rows r0..r1-1 of the whole matrix (the thread pool hands out any split: every element stands alone). */
static inline __attribute__((always_inline)) void int4_decode_rows(const uint8_t *q, const uint16_t *scale, int64_t r0,
                                                                    int64_t r1, int64_t cols, const int64_t group,
                                                                    float *out) {
    int64_t half = cols / 2, G = cols / group, full = cols / 32 * 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *qr = q + r * half;
        const uint16_t *sr = scale + r * G;
        float *o = out + r * cols;
        int64_t c = 0;
#if SIMD
        const __m128i m0f = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        for (; c < full; c += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(qr + c / 2));
            __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m0f), eight);  // even elements' q
            __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m0f), eight);  // odd ones'
            __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);  // elements 0-15, 16-31
            __m256 v[4] = {i8_to_f32(e0), i8_to_f32(_mm_srli_si128(e0, 8)), i8_to_f32(e1),
                           i8_to_f32(_mm_srli_si128(e1, 8))};
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(o + c + 8 * k, _mm256_mul_ps(v[k], _mm256_set1_ps(f16_to_f32(sr[(c + 8 * k) / group]))));
        }
#endif
        (void)full;
        for (; c < cols; c++) {
            int code = (c & 1) ? (qr[c / 2] >> 4) : (qr[c / 2] & 15);
            o[c] = (float)(code - 8) * f16_to_f32(sr[c / group]);
        }
    }
}

static const float E2M1_X2_MAG[8] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f};

static void mxfp4_decode_rows(const uint8_t *blocks, const uint8_t *scales, int64_t r0, int64_t r1, int64_t G,
                              float *out) {
#if SIMD
    const __m128i m0f = _mm_set1_epi8(0x0F);
    const __m256 mag = _mm256_loadu_ps(E2M1_X2_MAG);
    const __m256i eight = _mm256_set1_epi32(8);
#endif
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = blocks + (r * G + g) * 16;
            float f = e8m0_table[scales[r * G + g]], *o = out + (r * G + g) * 32;
#if SIMD
            __m128i c = _mm_loadu_si128((const __m128i *)b);
            __m128i lo = _mm_and_si128(c, m0f), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m0f);
            __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // codes of elements 0-15, 16-31
            __m256 fv = _mm256_set1_ps(f);
            for (int k = 0; k < 4; k++) {
                __m256i idx = _mm256_cvtepu8_epi32(k & 1 ? _mm_srli_si128(e[k / 2], 8) : e[k / 2]);
                __m256 m = _mm256_permutevar8x32_ps(mag, idx);  // the low 3 bits: the magnitude
                __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(idx, eight), 28));  // bit 3: sign
                _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(_mm256_xor_ps(m, s), fv));
            }
#else
            for (int k = 0; k < 16; k++) {
                o[2 * k] = (b[k] & 8 ? -E2M1_X2_MAG[b[k] & 7] : E2M1_X2_MAG[b[k] & 7]) * f;
                o[2 * k + 1] = (b[k] & 128 ? -E2M1_X2_MAG[(b[k] >> 4) & 7] : E2M1_X2_MAG[(b[k] >> 4) & 7]) * f;
            }
#endif
        }
    }
}

static int fp8_decode_rows(const uint8_t *w, const float *scale, int64_t r0, int64_t r1, int64_t cols, int64_t b0,
                           int64_t b1, float *out) {
    float *fac = scratch(TLS_X, sizeof(float) * (size_t)(cols + 1));  // the row block's scale per column
    if (!fac) return -2;
    int64_t nb1 = (cols + b1 - 1) / b1, cur = -1;
    for (int64_t r = r0; r < r1; r++) {
        if (r / b0 != cur) {
            cur = r / b0;
            for (int64_t j = 0; j < cols; j++) fac[j] = scale[cur * nb1 + j / b1];
        }
        const uint8_t *wr = w + r * cols;
        float *o = out + r * cols;
        int64_t j = 0;
#if SIMD
        const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
        const __m256 x256 = _mm256_set1_ps(256.0f);
        for (; j + 16 <= cols; j += 16) {
            __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + j)));  // sign-extended
            h = _mm256_and_si256(_mm256_slli_epi16(h, 7), keep);  // fp16 of the value x 2^-8 (bit 14 cleared)
            __m256 v0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), x256);
            __m256 v1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), x256);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(v0, _mm256_loadu_ps(fac + j)));
            _mm256_storeu_ps(o + j + 8, _mm256_mul_ps(v1, _mm256_loadu_ps(fac + j + 8)));
        }
#endif
        for (; j < cols; j++) o[j] = e4m3(wr[j]) * fac[j];
    }
    return 0;
}

/* -- the exported GEMVs: flags bit 0 = x is bf16, bit 1 = y is bf16 (each output rounded to nearest even once, NaN
 * a NaN: torch's .to(torch.bfloat16)); else y fp32. Return 0, -1 for a shape the kernel does not take, -2 where
 * memory cannot be had. */
static uint16_t f32_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* -- threads: a GEMV's rows split over a pool of worker threads --------------------------------------------------
 * moechat_set_threads(n) (native.py: torch's intra-op thread count) lets one call use up to n threads: the caller
 * and n - 1 workers, started on first use and kept. Each takes a contiguous share of the rows (a multiple of 4, or
 * of FP8's row block, so every share is a whole sub-matrix with its own scales) and runs the one-thread kernel on
 * it, x's preparation included; at least MIN_SHARE packed bytes a share, so a small matrix stays on one thread.
 * Between calls a worker spins SPIN_US, then sleeps on a condition variable; the caller spins until every worker
 * has taken the call. One call at a time uses the pool (a second concurrent one runs on its own thread alone);
 * a fork's child starts with no workers. */
#define MAX_THREADS 64
#define MIN_SHARE (256 << 10)
#define SPIN_US 50 /* the default; MOECHAT_SPIN_US overrides it (benches) */
static double spin_us = SPIN_US;

typedef struct {
    int kind; /* GEMVs: 0 int4, 1 mxfp4, 2 fp8, 3 int8, 7 bf16; decoders (y = the [rows, cols] output): 4 int4,
               * 5 mxfp4, 6 fp8 */
    const void *x, *w, *s;
    int x_bf16;
    int64_t rows, cols, group, b0, b1, align;
    float *y;
    int (*fn)(void *ctx, int64_t a, int64_t b); /* kind 8: a companion's work (moechat_parallel_for) */
    void *ctx;
} Job;

static int run_share(const Job *j, int64_t a, int64_t b) {
    if (a >= b) return 0;
    const uint8_t *w = j->w;
    switch (j->kind) {
        case 4:  // the group a constant in each (no division per 8 elements)
            if (j->group == 32) int4_decode_rows(w, j->s, a, b, j->cols, 32, j->y);
            else if (j->group == 16) int4_decode_rows(w, j->s, a, b, j->cols, 16, j->y);
            else int4_decode_rows(w, j->s, a, b, j->cols, 8, j->y);
            return 0;
        case 5:
            mxfp4_decode_rows(w, j->s, a, b, j->cols / 32, j->y);
            return 0;
        case 6:
            return fp8_decode_rows(w, j->s, a, b, j->cols, j->b0, j->b1, j->y);
        case 8:
            return j->fn(j->ctx, a, b);
        case 7:
            return bf16_gemv_f32(j->x, j->x_bf16, (const uint16_t *)w + a * j->cols, b - a, j->cols, j->y + a);
        case 0:
            return int4_gemv_f32(j->x, j->x_bf16, w + a * (j->cols / 2), (const uint16_t *)j->s + a * (j->cols / j->group),
                                 b - a, j->cols, j->group, j->y + a);
        case 1:
            return mxfp4_gemv_f32(j->x, j->x_bf16, w + a * (j->cols / 2), (const uint8_t *)j->s + a * (j->cols / 32),
                                  b - a, j->cols, j->y + a);
        case 2:
            return fp8_gemv_f32(j->x, j->x_bf16, w + a * j->cols,
                                (const float *)j->s + a / j->b0 * ((j->cols + j->b1 - 1) / j->b1), b - a, j->cols,
                                j->b0, j->b1, j->y + a);
        default:
            return int8_gemv_f32(j->x, j->x_bf16, (const int8_t *)w + a * j->cols, (const float *)j->s + a, b - a,
                                 j->cols, j->y + a);
    }
}

/* The pool. A call publishes its job as a ticket (generation : chunk count : next chunk) and every thread taking part,
 * the caller first, claims chunks by compare-and-swap until none is left: a worker that wakes late (descheduled, or
 * asleep) only helps less, the caller never waits for it to start, only for the chunks already taken. Each chunk is
 * a run of whole row blocks; every row is computed by one thread with the one-thread code, so any split writes the
 * same bits. Between calls a worker polls: PAUSE for a few us, then sched_yield (so a thread that wants its core, one
 * of torch's OpenMP workers or another process, gets it at once) up to spin_us since its last chunk, then sleeps on
 * the condition variable until the next call. */
#define TICKET(gen, n, i) ((uint64_t)(gen) << 32 | (uint64_t)(n) << 16 | (uint64_t)(i))
#define T_GEN(t) ((uint32_t)((t) >> 32))
#define T_N(t) ((uint32_t)((t) >> 16) & 0xFFFF)
#define T_I(t) ((uint32_t)(t) & 0xFFFF)
#define MAX_CHUNKS 0xFFFF
#define CHUNKS_PER_THREAD 4
#define MIN_CHUNK (128 << 10) /* packed bytes */
#define PAUSE_US 5

static struct {
    pthread_mutex_t busy, mu;
    pthread_cond_t cv;
    _Atomic uint64_t ticket;
    _Atomic int active, rc, sleepers;
    int workers, want, T;
    const Job *job;
    int64_t units, per; /* the job's units and units a chunk (the last one shorter) */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* claim and run chunks of generation g until none is left; the first error is the call's */
static void take_chunks(uint32_t g) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (T_GEN(t) != g || T_I(t) >= T_N(t)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* a chunk of g is ours: its caller waits for us (active > 0), so the job is still g's */
        const Job *j = pool.job;
        int64_t u0 = (int64_t)T_I(t) * pool.per, u1 = u0 + pool.per < pool.units ? u0 + pool.per : pool.units;
        int64_t a = u0 * j->align, b = u1 * j->align < j->rows ? u1 * j->align : j->rows;
        int rc = run_share(j, a, b);
        if (rc) {
            int zero = 0;
            atomic_compare_exchange_strong(&pool.rc, &zero, rc);
        }
    }
}

static void *worker(void *arg) {
    int i = (int)(intptr_t)arg;
    uint32_t seen = T_GEN(atomic_load(&pool.ticket));
    double last = now_us();
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (T_GEN(t) == seen) {
            double idle = now_us() - last;
            if (idle < PAUSE_US) {
                PAUSE();
            } else if (idle < spin_us) {
                sched_yield();
            } else {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleepers, 1);
                while (T_GEN(atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mu);
            }
            continue;
        }
        seen = T_GEN(t);
        atomic_fetch_add(&pool.active, 1);
        /* worker i helps calls of at least i + 1 threads; a finished call's generation has no chunk left */
        if (i < pool.T && T_GEN(atomic_load(&pool.ticket)) == seen) take_chunks(seen);
        atomic_fetch_sub(&pool.active, 1);
        last = now_us();
    }
    return NULL;
}

/* a fork's child: the workers stayed in the parent, and a lock one of them held would stay held */
static void forget_workers(void) {
    pool.workers = 0;
    atomic_store(&pool.active, 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
}

static void read_spin(void) {
    const char *v = getenv("MOECHAT_SPIN_US");
    if (v && *v) spin_us = atof(v);
}

void moechat_set_threads(int n) { pool.want = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n; }

/* `chunks`: how many pieces to cut the job into (0: by its bytes, CHUNKS_PER_THREAD a thread, >= MIN_CHUNK each) */
static int run_job_chunks(const Job *j, int64_t bytes, int64_t chunks) {
    int64_t shares = bytes / MIN_SHARE, units = (j->rows + j->align - 1) / j->align;
    int T = pool.want;
    if (T > shares) T = (int)shares;
    if (T > units) T = (int)units;
    if (T <= 1 || pthread_mutex_trylock(&pool.busy) != 0) return run_share(j, 0, j->rows);
    while (pool.workers < T - 1) {  /* start the workers this call needs */
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int ok = !pthread_create(&t, &at, worker, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&at);
        if (!ok) break;
        pool.workers++;
    }
    if (T > pool.workers + 1) T = pool.workers + 1;
    if (chunks <= 0) {
        chunks = (int64_t)T * CHUNKS_PER_THREAD;
        if (chunks > bytes / MIN_CHUNK) chunks = bytes / MIN_CHUNK;
        if (chunks < T) chunks = T;
    }
    if (chunks > units) chunks = units;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    pool.job = j;
    pool.units = units;
    pool.per = (units + chunks - 1) / chunks;
    chunks = (units + pool.per - 1) / pool.per;
    pool.T = T - 1;  /* workers 0 .. T-2 take part */
    atomic_store(&pool.rc, 0);
    uint32_t g = T_GEN(atomic_load(&pool.ticket)) + 1;
    atomic_store(&pool.ticket, TICKET(g, chunks, 0));  /* seq_cst: ordered before the load of sleepers (a worker
                                                          * going to sleep counts itself, then reads the ticket) */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    take_chunks(g);
    while (atomic_load_explicit(&pool.active, memory_order_acquire) > 0) PAUSE();
    int rc = atomic_load(&pool.rc);
    pthread_mutex_unlock(&pool.busy);
    return rc;
}

static int run_job(const Job *j, int64_t bytes) { return run_job_chunks(j, bytes, 0); }

static int run(Job j, int flags, void *y, int64_t bytes) {
    int y_bf16 = flags & 2;  /* the kernels sum into fp32: a scratch y, rounded into the caller's at the end */
    float *yf = y_bf16 ? scratch(TLS_Y, sizeof(float) * (size_t)(j.rows > 0 ? j.rows : 1)) : (float *)y;
    if (!yf) return -2;
    j.y = yf;
    j.x_bf16 = flags & 1;
    int rc = run_job(&j, bytes);
    if (y_bf16) {
        if (rc == 0)
            for (int64_t r = 0; r < j.rows; r++) ((uint16_t *)y)[r] = f32_to_bf16(yf[r]);
    }
    return rc;
}

/* The pool for the companions (native_*.c): fn(ctx, a, b) over [a, b) of [0, units), shares cut at multiples of
 * `align`, as many threads as `bytes` of work warrant (MIN_SHARE each) up to the set count; the first non-zero
 * return is the call's. */
int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes) {
    if (!fn || units < 0 || align < 1) return -1;
    Job j = {.kind = 8, .rows = units, .align = align, .fn = fn, .ctx = ctx};
    return run_job_chunks(&j, bytes, pool.want);
}

/* the same, cut into `per_thread` pieces a thread that the threads claim as they finish (units of unequal work) */
int moechat_parallel_for_chunks(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                                int64_t bytes, int64_t per_thread) {
    if (!fn || units < 0 || align < 1 || per_thread < 1) return -1;
    Job j = {.kind = 8, .rows = units, .align = align, .fn = fn, .ctx = ctx};
    return run_job_chunks(&j, bytes, pool.want * per_thread);
}

int moechat_int4_gemv(const void *x, int flags, const uint8_t *q, const uint16_t *scale, int64_t rows, int64_t cols,
                      int64_t group, void *y) {
    if (group <= 0) return -1;
    Job j = {.kind = 0, .x = x, .w = q, .s = scale, .rows = rows, .cols = cols, .group = group, .align = 4};
    return run(j, flags, y, rows * cols / 2);
}

int moechat_mxfp4_gemv(const void *x, int flags, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                       int64_t cols, void *y) {
    Job j = {.kind = 1, .x = x, .w = blocks, .s = scales, .rows = rows, .cols = cols, .align = 4};
    return run(j, flags, y, rows * cols / 2);
}

int moechat_fp8_gemv(const void *x, int flags, const uint8_t *w, const float *scale, int64_t rows, int64_t cols,
                     int64_t b0, int64_t b1, void *y) {
    if (b0 <= 0 || b1 <= 0) return -1;
    Job j = {.kind = 2, .x = x, .w = w, .s = scale, .rows = rows, .cols = cols, .b0 = b0, .b1 = b1, .align = b0};
    return run(j, flags, y, rows * cols);
}

int moechat_int8_gemv(const void *x, int flags, const int8_t *q, const float *scale, int64_t rows, int64_t cols,
                      void *y) {
    Job j = {.kind = 3, .x = x, .w = q, .s = scale, .rows = rows, .cols = cols, .align = 4};
    return run(j, flags, y, rows * cols);
}

int moechat_bf16_gemv(const void *x, int flags, const uint16_t *w, int64_t rows, int64_t cols, void *y) {
    Job j = {.kind = 7, .x = x, .w = w, .rows = rows, .cols = cols, .align = 4};
    return run(j, flags, y, 2 * rows * cols);
}

/* -- the exported decoders: out [rows, cols] fp32 (rows split over the pool as the GEMVs' are, any split: each
 * element is decoded alone, so any thread count writes the same bits). Return 0, -1 for a shape they do not take,
 * -2 where memory cannot be had. */
int moechat_int4_decode(const uint8_t *q, const uint16_t *scale, int64_t rows, int64_t cols, int64_t group,
                        float *out) {
    if (group != 32 && group != 16 && group != 8) return -1;
    if (cols % group || rows < 0) return -1;
    Job j = {.kind = 4, .w = q, .s = scale, .rows = rows, .cols = cols, .group = group, .align = 1, .y = out};
    return run_job(&j, rows * cols * 4);
}

int moechat_mxfp4_decode(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t cols, float *out) {
    if (cols % 32 || rows < 0) return -1;
    Job j = {.kind = 5, .w = blocks, .s = scales, .rows = rows, .cols = cols, .align = 1, .y = out};
    return run_job(&j, rows * cols * 4);
}

int moechat_fp8_decode(const uint8_t *w, const float *scale, int64_t rows, int64_t cols, int64_t b0, int64_t b1,
                       float *out) {
    if (b0 <= 0 || b1 <= 0 || rows < 0) return -1;
    Job j = {.kind = 6, .w = w, .s = scale, .rows = rows, .cols = cols, .b0 = b0, .b1 = b1, .align = 1, .y = out};
    return run_job(&j, rows * cols * 4);
}

/* -- decode attention: one query token over a bf16 K/V cache ---------------------------------------------------
 * q [nkv, G, D] bf16 (contiguous), k / v [nkv, S_max, D] bf16 (rows contiguous, heads head_stride_k / _v elements
 * apart), keys first..end-1; out [nkv, G, D] fp32 = softmax(scale * q K^T) V per query head, in fp32. Two passes
 * per KV head, each reading its K (then V) rows once for all G query heads: 32-row blocks widened to fp32 in an L1
 * buffer (bf16 << 16, exact), G dot products per row (eight rows reduced together by a hadd tree), the scores kept
 * ([G, S] fp32, L2); the softmax with a polynomial exp (Cephes' expf: ~1 ulp); then the V rows weighted by the
 * probabilities into G accumulators, divided by the sum at the end. Returns -2 where a buffer cannot be had. */
#define ATT_BR 32

#if SIMD
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* e^x, Cephes expf's reduction and polynomial (x <= 0 here; clamped below so 2^n stays a normal float) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* the eight sums of a[0..7]'s lanes, in order */
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}
#endif

/* bf16 rows [n, D] -> fp32 buf [n, D] */
static void widen_rows(const uint16_t *src, int64_t n, int64_t D, float *buf) {
    int64_t m = n * D, j = 0;
#if SIMD
    for (; j + 8 <= m; j += 8) _mm256_storeu_ps(buf + j, bf16x8(src + j));
#endif
    for (; j < m; j++) buf[j] = bf16_to_f32(src[j]);
}

static float dot_f32(const float *a, const float *b, int64_t D) {
    int64_t j = 0;
    float acc = 0.0f;
#if SIMD
    __m256 s = _mm256_setzero_ps();
    for (; j + 8 <= D; j += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s);
    acc = hsum(s);
#endif
    for (; j < D; j++) acc += a[j] * b[j];
    return acc;
}

int moechat_attn_decode(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t head_stride_k,
                        int64_t head_stride_v, int64_t nkv, int64_t G, int64_t D, int64_t first, int64_t end,
                        float scale, float *out) {
    int64_t S = end - first;
    if (S <= 0) return -1;
    float *sc = scratch(TLS_ATT, sizeof(float) * (size_t)(G * S + G * D + ATT_BR * D));
    if (!sc) return -2;
    float *qf = sc + G * S, *buf = qf + G * D;
    for (int64_t h = 0; h < nkv; h++) {
        const uint16_t *kh = k + h * head_stride_k + first * D, *vh = v + h * head_stride_v + first * D;
        widen_rows(q + h * G * D, G, D, qf);
        /* pass 1: scores [G, S] */
        for (int64_t t0 = 0; t0 < S; t0 += ATT_BR) {
            int64_t n = S - t0 < ATT_BR ? S - t0 : ATT_BR;
            widen_rows(kh + t0 * D, n, D, buf);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float *sg = sc + g * S + t0;
                int64_t r = 0;
#if SIMD
                if ((D & 7) == 0) {
                    for (; r + 8 <= n; r += 8) {
                        __m256 a[8];
                        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                        for (int64_t j = 0; j < D; j += 8) {
                            __m256 qv = _mm256_loadu_ps(qg + j);
                            for (int u = 0; u < 8; u++)
                                a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + (r + u) * D + j), qv, a[u]);
                        }
                        _mm256_storeu_ps(sg + r, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
                    }
                }
#endif
                for (; r < n; r++) sg[r] = dot_f32(buf + r * D, qg, D) * scale;
            }
        }
        /* softmax per query head: probabilities in place, 1 / sum kept */
        float inv[G];
        for (int64_t g = 0; g < G; g++) {
            float *sg = sc + g * S, m = -INFINITY, sum = 0.0f;
            int64_t t = 0;
#if SIMD
            __m256 mv = _mm256_set1_ps(-INFINITY), sv = _mm256_setzero_ps();
            for (; t + 8 <= S; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
            float mm[8];
            _mm256_storeu_ps(mm, mv);
            for (int u = 0; u < 8; u++) m = mm[u] > m ? mm[u] : m;
#endif
            for (; t < S; t++) m = sg[t] > m ? sg[t] : m;
            t = 0;
#if SIMD
            __m256 mb = _mm256_set1_ps(m);
            for (; t + 8 <= S; t += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mb));
                _mm256_storeu_ps(sg + t, e);
                sv = _mm256_add_ps(sv, e);
            }
            sum = hsum(sv);
#endif
            for (; t < S; t++) {
                sg[t] = expf(sg[t] - m);
                sum += sg[t];
            }
            inv[g] = 1.0f / sum;
        }
        /* pass 2: out[g] = sum_t p[g][t] v_t / sum */
        float *oh = out + h * G * D;
        memset(oh, 0, sizeof(float) * (size_t)(G * D));
        for (int64_t t0 = 0; t0 < S; t0 += ATT_BR) {
            int64_t n = S - t0 < ATT_BR ? S - t0 : ATT_BR;
            widen_rows(vh + t0 * D, n, D, buf);
            for (int64_t g = 0; g < G; g++) {
                const float *pg = sc + g * S + t0;
                float *og = oh + g * D;
                int64_t j = 0;
#if SIMD
                for (; j + 32 <= D; j += 32) {
                    __m256 a0 = _mm256_loadu_ps(og + j), a1 = _mm256_loadu_ps(og + j + 8);
                    __m256 a2 = _mm256_loadu_ps(og + j + 16), a3 = _mm256_loadu_ps(og + j + 24);
                    for (int64_t r = 0; r < n; r++) {
                        __m256 p = _mm256_broadcast_ss(pg + r);
                        const float *vr = buf + r * D + j;
                        a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr), a0);
                        a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8), a1);
                        a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 16), a2);
                        a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 24), a3);
                    }
                    _mm256_storeu_ps(og + j, a0);
                    _mm256_storeu_ps(og + j + 8, a1);
                    _mm256_storeu_ps(og + j + 16, a2);
                    _mm256_storeu_ps(og + j + 24, a3);
                }
                for (; j + 8 <= D; j += 8) {
                    __m256 a0 = _mm256_loadu_ps(og + j);
                    for (int64_t r = 0; r < n; r++)
                        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + r), _mm256_loadu_ps(buf + r * D + j), a0);
                    _mm256_storeu_ps(og + j, a0);
                }
#endif
                for (; j < D; j++) {
                    float a = og[j];
                    for (int64_t r = 0; r < n; r++) a += pg[r] * buf[r * D + j];
                    og[j] = a;
                }
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < D; j++) oh[g * D + j] *= inv[g];
    }
    return 0;
}

/* -- one token through a layer's routed experts: moechat_moe_decode ------------------------------------------------
 * For n experts (the layer's top-k for one token, or the pairs of one batch), each out_k = w_k * down(act(gate_up(x)))
 * with gate_up and down the packed projections (int4, MXFP4, FP8, int8), in one call: the intermediates stay in this
 * thread's scratch, and the pool runs two jobs, all n experts' gate/up rows, then all their down rows, instead of 2n
 * calls from Python (~10 us of ctypes and a pool wake each; issue 27). Bit for bit the per-projection path
 * (engine/experts.py's `_expert` through each format's `linear`, then contrib[k].add_(y, alpha=w_k) into a zero row):
 * each GEMV row is the same kernel over the same x (rows split, never a sum); a bias is added in fp32 and the sum
 * rounded once to x's dtype (bf16 or fp32), as `linear` does; the activation is computed as torch computes it on this
 * CPU, rounding where torch rounds: SwiGLU silu(gate) * up, or GPT-OSS's (up + 1) * (gate * sigmoid(alpha gate))
 * after the clamps, torch's exp being Sleef's expf_u10 over the vectorised part of each op (`vec` elements a step:
 * 2 x the vector width, from torch's CPU capability; 0 where torch has no vectorised exp) and libm's expf over the
 * tail, both reproduced here (tested against torch). Each output row out_k[h] = w_k * y[h] (+ 0: add_ into zeros). */
static float pow2i(int q) {
    uint32_t b = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Sleef's expf_u10 (torch's Vectorized<float>::exp on AVX2 and AVX-512), one lane: the same FMAs in the same order */
static float sleef_expf(float d) {
    if (d != d) return d;
    if (d < -104.0f) return 0.0f;
    if (d > 100.0f) return INFINITY;
    int q = (int)rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1);
    return u * pow2i(q - (q >> 1));
}

static inline float round_to(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* exp(-v) as the torch op over element i of n computes it */
static inline float torch_exp_neg(float v, int64_t i, int64_t nvec) { return i < nvec ? sleef_expf(-v) : expf(-v); }

enum { ACT_SWIGLU, ACT_CLAMPED };

#if SIMD
/* sleef_expf on eight lanes: the same operations (torch's own vector code is Sleef's) */
static inline __m256 pow2i8(__m256i q) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(0x7f)), 23));
}

static inline __m256 sleef_exp8(__m256 d) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    __m256i q1 = _mm256_srai_epi32(q, 1);
    u = _mm256_mul_ps(_mm256_mul_ps(u, pow2i8(q1)), pow2i8(_mm256_sub_epi32(q, q1)));
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

/* each lane rounded to bf16 as f32_to_bf16 does (NaN -> 0x7FC0), kept as fp32 */
static inline __m256 round_bf16_8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                 _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

static inline __m256 round8(__m256 v, int bf16) { return bf16 ? round_bf16_8(v) : v; }

/* the vectorised part of moe_activation: elements [0, nvec), eight at a time (nvec a multiple of 8) */
static void moe_activation8(const float *gu, int64_t I, int64_t nvec, int act, int bf16, float limit, float alpha,
                            void *a) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), al = _mm256_set1_ps(alpha);
    const __m256i odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t i = 0; i < nvec; i += 8) {
        __m256 v;
        if (act == ACT_SWIGLU) {
            __m256 g = _mm256_loadu_ps(gu + i), up = _mm256_loadu_ps(gu + I + i);
            __m256 s = round8(_mm256_div_ps(g, _mm256_add_ps(one, sleef_exp8(_mm256_xor_ps(g, sign)))), bf16);
            v = _mm256_mul_ps(s, up);
        } else {  /* even lanes gate, odd lanes up: de-interleaved by a permute per half */
            __m256 p0 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(gu + 2 * i), odd);
            __m256 p1 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(gu + 2 * i + 8), odd);
            __m256 g = _mm256_permute2f128_ps(p0, p1, 0x20), u = _mm256_permute2f128_ps(p0, p1, 0x31);
            /* the clamps as the scalar code: NaN stays NaN (a comparison with NaN is false) */
            g = round8(_mm256_blendv_ps(g, lim, _mm256_cmp_ps(g, lim, _CMP_GT_OQ)), bf16);
            u = _mm256_blendv_ps(u, nlim, _mm256_cmp_ps(u, nlim, _CMP_LT_OQ));
            u = round8(_mm256_blendv_ps(u, lim, _mm256_cmp_ps(u, lim, _CMP_GT_OQ)), bf16);
            __m256 ga = round8(_mm256_mul_ps(g, al), bf16);
            __m256 sg = round8(_mm256_div_ps(one, _mm256_add_ps(one, sleef_exp8(_mm256_xor_ps(ga, sign)))), bf16);
            __m256 t = round8(_mm256_mul_ps(g, sg), bf16);
            v = _mm256_mul_ps(round8(_mm256_add_ps(u, one), bf16), t);
        }
        if (bf16) {
            __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v)), 16);
            __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i *)((uint16_t *)a + i), w);
        } else {
            _mm256_storeu_ps((float *)a + i, v);
        }
    }
}
#endif

/* gu [2I] (x's dtype values, as fp32) -> a [I] in x's dtype (bf16 bit patterns, or fp32) */
static void moe_activation(const float *gu, int64_t I, int act, int bf16, int64_t vec, float limit, float alpha,
                           void *a) {
    int64_t nvec = vec > 0 ? I / vec * vec : 0, i = 0;
#if SIMD
    if (nvec % 8 == 0) {
        moe_activation8(gu, I, nvec, act, bf16, limit, alpha, a);
        i = nvec;
    }
#endif
    for (; i < I; i++) {
        float v;
        if (act == ACT_SWIGLU) {  /* F.silu(gate) * up */
            float g = gu[i], up = gu[I + i];
            float s = round_to(g / (1.0f + torch_exp_neg(g, i, nvec)), bf16);
            v = s * up;
        } else {  /* gate = g.clamp(max=limit), up = u.clamp(-limit, limit): NaN stays NaN */
            float g = gu[2 * i], u = gu[2 * i + 1];
            g = round_to(g > limit ? limit : g, bf16);  /* a clamp's output is x's dtype: the limit rounded */
            u = round_to(u < -limit ? -limit : u > limit ? limit : u, bf16);
            float ga = round_to(g * alpha, bf16);
            float sg = round_to(1.0f / (1.0f + torch_exp_neg(ga, i, nvec)), bf16);
            float t = round_to(g * sg, bf16);
            v = round_to(u + 1.0f, bf16) * t;
        }
        if (bf16) ((uint16_t *)a)[i] = f32_to_bf16(v);
        else ((float *)a)[i] = v;
    }
}

/* For native_prefill_int.c's many-token layer call: one pair's gate/up row g [2I] (fp32 sums) + the expert's w13 bias
 * (or none), rounded to x's dtype, then the activation into a [I] (bf16 bit patterns or fp32): the one-token layer
 * call's steps below, so the same bits as the torch ops on that row. */
void moechat_moe_act_row(float *g, const void *b13, int bias_kind, int64_t I, int act, int bf16, int64_t vec,
                         float limit, float alpha, void *a);

/* a row range of one matrix of the layer call: rows [0, rows) of w (scale s) times x into y, in units of `align`
 * rows (FP8: its row block, so every share starts on a scale row) */
typedef struct {
    const void *x, *w, *s;
    int64_t rows, cols, group, u0;
    float *y;
    int expert;
} MoeSeg;

typedef struct {
    int kind, x_bf16, bias_kind, phase;
    int64_t b0, b1, align;
    const MoeSeg *seg;
    int nseg;
    const int64_t *ptrs; /* [n, 7]: w13, s13, w2, s2, b13, b2, out */
    const float *weights;
} MoeCtx;

static float bias_at(const void *b, int kind, int64_t r) {
    return kind == 1 ? bf16_to_f32(((const uint16_t *)b)[r]) : kind == 2 ? f16_to_f32(((const uint16_t *)b)[r])
                                                                          : ((const float *)b)[r];
}

void moechat_moe_act_row(float *g, const void *b13, int bias_kind, int64_t I, int act, int bf16, int64_t vec,
                         float limit, float alpha, void *a) {
    int64_t r = 0;
#if SIMD
    if (!b13 || bias_kind == 0)  /* fp32 bias or none: eight at a time */
        for (; r + 8 <= 2 * I; r += 8) {
            __m256 v = _mm256_loadu_ps(g + r);
            if (b13) v = _mm256_add_ps(v, _mm256_loadu_ps((const float *)b13 + r));
            _mm256_storeu_ps(g + r, round8(v, bf16));
        }
#endif
    for (; r < 2 * I; r++) {
        float v = g[r];
        if (b13) v = v + bias_at(b13, bias_kind, r);
        g[r] = round_to(v, bf16);
    }
    moe_activation(g, I, act, bf16, vec, limit, alpha, a);
}

static int moe_share(void *vctx, int64_t ua, int64_t ub) {
    const MoeCtx *c = vctx;
    for (int i = 0; i < c->nseg; i++) {
        const MoeSeg *g = &c->seg[i];
        int64_t units = (g->rows + c->align - 1) / c->align;
        int64_t a = ua > g->u0 ? ua - g->u0 : 0, b = ub - g->u0 < units ? ub - g->u0 : units;
        if (a >= b) continue;
        int64_t r0 = a * c->align, r1 = b * c->align < g->rows ? b * c->align : g->rows;
        Job j = {.kind = c->kind, .x = g->x, .x_bf16 = c->x_bf16, .w = g->w, .s = g->s, .rows = g->rows,
                 .cols = g->cols, .group = g->group, .b0 = c->b0, .b1 = c->b1, .y = g->y};
        int rc = run_share(&j, r0, r1);
        if (rc) return rc;
        if (c->phase == 2) {  /* down rows done: + bias, x's dtype, times the routing weight, into the output row */
            const int64_t *p = c->ptrs + 7 * g->expert;
            const void *bias = (const void *)(intptr_t)p[5];
            float *out = (float *)(intptr_t)p[6], w = c->weights[g->expert];
            int64_t r = r0;
#if SIMD
            if (!bias || c->bias_kind == 0)
                for (; r + 8 <= r1; r += 8) {
                    __m256 v = _mm256_loadu_ps(g->y + r);
                    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps((const float *)bias + r));
                    v = _mm256_add_ps(_mm256_mul_ps(round8(v, c->x_bf16), _mm256_set1_ps(w)), _mm256_setzero_ps());
                    _mm256_storeu_ps(out + r, v);
                }
#endif
            for (; r < r1; r++) {
                float v = g->y[r];
                if (bias) v = v + bias_at(bias, c->bias_kind, r);
                out[r] = round_to(v, c->x_bf16) * w + 0.0f;
            }
        }
    }
    return 0;
}

/* kind: 0 int4, 1 MXFP4, 2 FP8, 3 int8 (the GEMVs' Job kinds). x [H] (x_bf16: bf16, else fp32); ptrs [n, 7] the
 * addresses of each expert's w13, w13 scale, w2, w2 scale, w13 bias or 0, w2 bias or 0, and its output row (fp32
 * [H]); weights [n]; int4's groups along H and I (group13, group2); FP8's block (b0, b1); bias_kind 0 fp32, 1 bf16,
 * 2 fp16. Returns 0, -1 for a shape no kernel takes, -2 where memory cannot be had. */
int moechat_moe_decode(int kind, const void *x, int x_bf16, const int64_t *ptrs, const float *weights, int64_t n,
                       int64_t H, int64_t I, int64_t group13, int64_t group2, int64_t b0, int64_t b1, int bias_kind,
                       int act, float limit, float alpha, int64_t vec) {
    if (n <= 0) return n == 0 ? 0 : -1;
    if (kind < 0 || kind > 3 || H <= 0 || I <= 0 || (kind == 2 && (b0 <= 0 || b1 <= 0))) return -1;
    if (kind == 0 && (group13 <= 0 || group2 <= 0)) return -1;
    int64_t nseg13 = kind == 2 ? 2 * n : n;
    size_t abytes = (size_t)I * (x_bf16 ? 2 : 4);
    size_t need = sizeof(float) * (size_t)(n * 2 * I + n * H) + (size_t)n * abytes + sizeof(MoeSeg) * (size_t)(nseg13 + n)
                  + 64;
    uint8_t *mem = scratch(TLS_MOE, need);
    if (!mem) return -2;
    float *gu = (float *)mem, *y2 = gu + n * 2 * I;
    uint8_t *acts = (uint8_t *)(y2 + n * H);
    MoeSeg *seg = (MoeSeg *)(((uintptr_t)(acts + n * abytes) + 15) & ~(uintptr_t)15);
    int64_t align = kind == 2 ? b0 : 4;
    /* phase 1: every expert's gate/up rows (FP8: each half blocked from its own start) */
    int64_t u = 0, bytes = 0;
    int ns = 0;
    for (int64_t k = 0; k < n; k++) {
        const int64_t *p = ptrs + 7 * k;
        const void *w = (const void *)(intptr_t)p[0], *s = (const void *)(intptr_t)p[1];
        if (kind == 2) {
            int64_t sh = (I + b0 - 1) / b0 * ((H + b1 - 1) / b1);  /* the gate half's scale rows */
            for (int h = 0; h < 2; h++) {
                seg[ns] = (MoeSeg){.x = x, .w = (const uint8_t *)w + h * I * H, .s = (const float *)s + h * sh,
                                   .rows = I, .cols = H, .u0 = u, .y = gu + k * 2 * I + h * I, .expert = (int)k};
                u += (I + align - 1) / align;
                ns++;
            }
        } else {
            seg[ns] = (MoeSeg){.x = x, .w = w, .s = s, .rows = 2 * I, .cols = H, .group = group13, .u0 = u,
                               .y = gu + k * 2 * I, .expert = (int)k};
            u += (2 * I + align - 1) / align;
            ns++;
        }
        bytes += kind == 0 || kind == 1 ? I * H : 2 * I * H;
    }
    MoeCtx c = {.kind = kind, .x_bf16 = x_bf16, .bias_kind = bias_kind, .phase = 1, .b0 = b0, .b1 = b1,
                .align = align, .seg = seg, .nseg = ns, .ptrs = ptrs, .weights = weights};
    Job j1 = {.kind = 8, .rows = u, .align = 1, .fn = moe_share, .ctx = &c};
    int rc = run_job(&j1, bytes);
    if (rc) return rc;
    /* the activations, on this thread (n x I elements: ~1% of the GEMVs' time) */
    for (int64_t k = 0; k < n; k++)
        moechat_moe_act_row(gu + k * 2 * I, (const void *)(intptr_t)ptrs[7 * k + 4], bias_kind, I, act, x_bf16, vec,
                            limit, alpha, acts + k * abytes);
    /* phase 2: every expert's down rows, each finished into its output row */
    MoeSeg *seg2 = seg + ns;
    u = 0;
    for (int64_t k = 0; k < n; k++) {
        const int64_t *p = ptrs + 7 * k;
        seg2[k] = (MoeSeg){.x = acts + k * abytes, .w = (const void *)(intptr_t)p[2], .s = (const void *)(intptr_t)p[3],
                           .rows = H, .cols = I, .group = group2, .u0 = u, .y = y2 + k * H, .expert = (int)k};
        u += (H + align - 1) / align;
    }
    c.phase = 2;
    c.seg = seg2;
    c.nseg = (int)n;
    Job j2 = {.kind = 8, .rows = u, .align = 1, .fn = moe_share, .ctx = &c};
    return run_job(&j2, bytes / 2);
}
