/* moechat's one-token (decode) steps of the recurrent layers on the CPU: the gated delta rule (Gated DeltaNet:
 * Qwen3-Next, Qwen3.5/3.6), Mamba-2's SSM update, and the short causal conv1d (+ SiLU) in front of both, each its
 * rolling window updated in place. Compiled with native.c into one library (native.py builds native.c with every
 * native_*.c beside it); called through ctypes from engine/models/gated_deltanet.py and mamba2.py (native.py's
 * `delta_rule_step` / `ssd_step` / `conv_step` wrappers).
 *
 * Why: the torch steps are ~20 small ops each (normalise, repeat the key heads, decay, three batched GEMVs), a few
 * microseconds of dispatch apiece against ~2 MiB of fp32 state a layer; here the state is read from memory once and
 * written once (the delta rule by blocks of 32 columns whose two passes, decay + S^T k then S += k u^T + S^T q, meet
 * in L1) and nothing else is allocated.
 *
 * Exactness: fp32 throughout, the same operations as the torch step in the same roles (the decay applied before
 * S^T k, u = beta (v - S^T k), the rank-1 update, then the output), so each result is the torch step's up to the
 * order of its sums: each element within 1e-6 x (its |value| + the tensor's largest |value|) of the torch step's,
 * outputs and states (tests/engine/test_recurrent_native.py). Inputs are fp32 or bf16 (a flag bit per
 * tensor: widened exactly). Threads: the heads (value heads / Mamba heads / channel blocks) split over native.c's pool
 * (moechat_parallel_for); a head is always computed by one thread with the same code, so every thread count writes
 * the same bits. Plain C with GCC/Clang vector types (v8: 8 fp32 lanes, AVX registers or scalar code) along Dv / N:
 * one source for the SIMD and the scalar build (MOECHAT_SCALAR changes nothing here). Return 0, -1 for a shape the kernels do not take. */

#include <math.h>
#include <stdint.h>
#include <string.h>

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

typedef float v8 __attribute__((vector_size(32))); /* GCC/Clang vectors: AVX registers, or scalar code */

#define REC_MAX_D 1024 /* the largest head dim / state size the stack scratch takes (the models: 64-256) */

static inline float rec_ld(const void *p, int bf16, int64_t i) {
    if (bf16) {
        uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    return ((const float *)p)[i];
}

static inline uint16_t rec_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t b;
    memcpy(&b, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline void rec_st(void *p, int bf16, int64_t i, float f) {
    if (bf16) ((uint16_t *)p)[i] = rec_bf16(f);
    else ((float *)p)[i] = f;
}

/* -- the gated delta rule, one token ----------------------------------------------------------------------------
 * Per value head h (key head h / (HV / HK)), S [Dk, Dv] fp32:
 *   q, k <- l2norm (x rsqrt(sum x^2 + 1e-6)), q scaled by Dk^-1/2;  S <- exp(g_h) S;  u = beta_h (v - S^T k);
 *   S <- S + k u^T;  o = S^T q.
 * flags: bit 0 q, 1 k, 2 v, 3 g, 4 beta are bf16. q, k [HK, Dk], v [HV, Dv], g, beta [HV] contiguous. */
typedef struct {
    const void *q, *k, *v, *g, *beta;
    int flags;
    int64_t HK, HV, Dk, Dv;
    float *state, *out;
} DeltaJob;

static void l2n(const void *x, int bf16, int64_t off, int64_t n, float scale, float *o) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        o[i] = rec_ld(x, bf16, off + i);
        s += o[i] * o[i];
    }
    float r = 1.0f / sqrtf(s + 1e-6f);
    for (int64_t i = 0; i < n; i++) o[i] = o[i] * r * scale;
}

#define DCB 32 /* the delta rule's column block */

static int delta_share(void *ctx, int64_t a, int64_t b) {
    const DeltaJob *j = ctx;
    const int64_t Dk = j->Dk, Dv = j->Dv, rep = j->HV / j->HK;
    const float qscale = 1.0f / sqrtf((float)Dk);
    float qn[REC_MAX_D], kn[REC_MAX_D], mem[REC_MAX_D], u[REC_MAX_D];
    for (int64_t h = a; h < b; h++) {
        const int64_t kh = h / rep;
        l2n(j->q, j->flags & 1, kh * Dk, Dk, qscale, qn);
        l2n(j->k, j->flags & 2, kh * Dk, Dk, 1.0f, kn);
        const float decay = expf(rec_ld(j->g, j->flags & 8, h)), beta = rec_ld(j->beta, j->flags & 16, h);
        float *S = j->state + h * Dk * Dv, *o = j->out + h * Dv;
        /* by blocks of DCB columns: a column's u needs only its own S^T k, so the block ([Dk, DCB], 16 KiB at Dk 128)
         * is read from memory once and is in L1 for the second pass */
        int64_t c0 = 0;
        for (; c0 + DCB <= Dv; c0 += DCB) { /* a whole block in 4 vectors of 8 (registers, whatever the build) */
            v8 m[4] = {{0}}, oo[4] = {{0}}, uu[4];
            for (int64_t r = 0; r < Dk; r++) {
                float *row = S + r * Dv + c0;
                for (int i = 0; i < 4; i++) {
                    v8 x;
                    memcpy(&x, row + 8 * i, 32);
                    x = x * decay;
                    memcpy(row + 8 * i, &x, 32);
                    m[i] += x * kn[r];
                }
            }
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 8; l++) uu[i][l] = (rec_ld(j->v, j->flags & 4, h * Dv + c0 + 8 * i + l) - m[i][l]) * beta;
            for (int64_t r = 0; r < Dk; r++) {
                float *row = S + r * Dv + c0;
                for (int i = 0; i < 4; i++) {
                    v8 x;
                    memcpy(&x, row + 8 * i, 32);
                    x = x + kn[r] * uu[i];
                    memcpy(row + 8 * i, &x, 32);
                    oo[i] += x * qn[r];
                }
            }
            memcpy(o + c0, oo, sizeof oo);
        }
        if (c0 < Dv) { /* the last Dv % DCB columns, one at a time (the same operations) */
            for (int64_t c = c0; c < Dv; c++) mem[c] = 0.0f;
            for (int64_t r = 0; r < Dk; r++) {
                float *row = S + r * Dv;
                const float kr = kn[r];
                for (int64_t c = c0; c < Dv; c++) {
                    row[c] *= decay;
                    mem[c] += row[c] * kr;
                }
            }
            for (int64_t c = c0; c < Dv; c++) {
                u[c] = (rec_ld(j->v, j->flags & 4, h * Dv + c) - mem[c]) * beta;
                o[c] = 0.0f;
            }
            for (int64_t r = 0; r < Dk; r++) {
                float *row = S + r * Dv;
                const float kr = kn[r], qr = qn[r];
                for (int64_t c = c0; c < Dv; c++) {
                    row[c] += kr * u[c];
                    o[c] += row[c] * qr;
                }
            }
        }
    }
    return 0;
}

int moechat_delta_rule_step(const void *q, const void *k, const void *v, const void *g, const void *beta, int flags,
                            int64_t HK, int64_t HV, int64_t Dk, int64_t Dv, float *state, float *out) {
    if (HK <= 0 || HV <= 0 || HV % HK || Dk <= 0 || Dv <= 0 || Dk > REC_MAX_D || Dv > REC_MAX_D) return -1;
    DeltaJob j = {q, k, v, g, beta, flags, HK, HV, Dk, Dv, state, out};
    return moechat_parallel_for(delta_share, &j, HV, 1, HV * Dk * Dv * 4);
}

/* -- Mamba-2, one token ------------------------------------------------------------------------------------------
 * Per head h (group h / (H / G)), S [P, N] fp32: S <- exp(dt_h A_h) S + (dt_h x_h) B^T;  y = S C + D_h x_h.
 * flags: bit 0 x, 1 dt, 2 A, 3 B, 4 C, 5 D are bf16. x [H, P], dt, A, D [H], B, C [G, N] contiguous; y [H, P]. */
typedef struct {
    const void *x, *dt, *A, *B, *C, *D;
    int flags;
    int64_t H, G, P, N;
    float *state, *y;
} SsdJob;

static int ssd_share(void *ctx, int64_t a, int64_t b) {
    const SsdJob *j = ctx;
    const int64_t P = j->P, N = j->N, rep = j->H / j->G;
    float Bv[REC_MAX_D], Cv[REC_MAX_D];
    int64_t loaded = -1;
    for (int64_t h = a; h < b; h++) {
        const int64_t g = h / rep;
        if (g != loaded) {
            for (int64_t n = 0; n < N; n++) {
                Bv[n] = rec_ld(j->B, j->flags & 8, g * N + n);
                Cv[n] = rec_ld(j->C, j->flags & 16, g * N + n);
            }
            loaded = g;
        }
        const float dt = rec_ld(j->dt, j->flags & 2, h), Dh = rec_ld(j->D, j->flags & 32, h);
        const float da = expf(dt * rec_ld(j->A, j->flags & 4, h));
        for (int64_t p = 0; p < P; p++) {
            const float xp = rec_ld(j->x, j->flags & 1, h * P + p), xdt = dt * xp;
            float *row = j->state + (h * P + p) * N;
            v8 acc = {0};  /* lanes n mod 8, summed in a fixed order: the same bits on every build */
            int64_t n = 0;
            for (; n + 8 <= N; n += 8) {
                v8 r, bv, cv;
                memcpy(&r, row + n, 32);
                memcpy(&bv, Bv + n, 32);
                memcpy(&cv, Cv + n, 32);
                r = r * da + xdt * bv;
                memcpy(row + n, &r, 32);
                acc += r * cv;
            }
            for (int l = 0; n < N; n++, l++) {
                row[n] = row[n] * da + xdt * Bv[n];
                acc[l] += row[n] * Cv[n];
            }
            const float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            j->y[h * P + p] = s + Dh * xp;
        }
    }
    return 0;
}

int moechat_ssd_step(const void *x, const void *dt, const void *A, const void *B, const void *C, const void *D,
                     int flags, int64_t H, int64_t G, int64_t P, int64_t N, float *state, float *y) {
    if (H <= 0 || G <= 0 || H % G || P <= 0 || N <= 0 || N > REC_MAX_D) return -1;
    SsdJob j = {x, dt, A, B, C, D, flags, H, G, P, N, state, y};
    return moechat_parallel_for(ssd_share, &j, H, 1, H * P * N * 4);
}

/* -- the short causal conv1d + SiLU, one token --------------------------------------------------------------------
 * Per channel c: y = silu(sum_i window[c, i] w[c, i] + x[c] w[c, W-1] + bias[c]) in fp32 (the reference's math: the
 * products of two bf16 exact, one rounding to out's dtype), then the window [C, W-1] (oldest first) shifted by x.
 * flags: bit 0 x, 1 w, 2 bias, 3 state, 4 out are bf16; bias may be NULL. */
typedef struct {
    const void *x, *w, *bias;
    void *state, *out;
    int flags;
    int64_t C, W;
} ConvJob;

static inline __attribute__((always_inline)) void conv_rows(const ConvJob *j, int64_t a, int64_t b, const int xb,
                                                            const int wb, const int bb, const int sb, const int ob,
                                                            const int64_t W) {
    for (int64_t c = a; c < b; c++) {
        const float xc = rec_ld(j->x, xb, c);
        float s = 0.0f;
        for (int64_t i = 0; i < W - 1; i++) s += rec_ld(j->state, sb, c * (W - 1) + i) * rec_ld(j->w, wb, c * W + i);
        s += xc * rec_ld(j->w, wb, c * W + W - 1);
        if (j->bias) s += rec_ld(j->bias, bb, c);
        rec_st(j->out, ob, c, s / (1.0f + expf(-s)));
        for (int64_t i = 0; i + 1 < W - 1; i++)
            rec_st(j->state, sb, c * (W - 1) + i, rec_ld(j->state, sb, c * (W - 1) + i + 1));
        if (W > 1) rec_st(j->state, sb, c * (W - 1) + W - 2, xc);
    }
}

static int conv_share(void *ctx, int64_t a, int64_t b) {
    const ConvJob *j = ctx;
    const int f = j->flags;
    if ((f == 31 || f == 27) && j->W == 4) conv_rows(j, a, b, 1, 1, 1, 1, 1, 4); /* the models' bf16 (27: no bias) */
    else if (f == 0 && j->W == 4) conv_rows(j, a, b, 0, 0, 0, 0, 0, 4);
    else conv_rows(j, a, b, f & 1, f & 2, f & 4, f & 8, f & 16, j->W);
    return 0;
}

int moechat_conv_step(const void *x, const void *w, const void *bias, void *state, void *out, int flags, int64_t C,
                      int64_t W) {
    if (C <= 0 || W <= 0) return -1;
    ConvJob j = {x, w, bias, state, out, flags, C, W};
    return moechat_parallel_for(conv_share, &j, C, 64, C * W * 8);
}
