/* A prefill chunk's expert outputs into their pairs' rows: contrib[idx[i], :] = y[i, :] * w[i] in fp32.
 * Compiled with native.c into one library; called through ctypes from quant/native.py (`scatter_weighted`).
 *
 * Why: layers/experts.py writes each (token, k) pair's weighted output into its own fp32 row so that the k-sum
 * (`combine`) does not depend on how the pairs were grouped; in torch that is y.float(), a multiply and an
 * index_copy_ over [T*K, H] (128 tokens x top-8 x 2048: three passes over 8 MB on torch's one thread, ~6 ms a layer).
 * Here one pass, rows split over native.c's pool. Each element is the fp32 product of y's value and w, exactly
 * torch's (y.float() is exact, one rounding in the multiply), whatever the split. */

#include <stdint.h>
#include <string.h>

int moechat_parallel_for(int (*fn)(void *ctx, int64_t a, int64_t b), void *ctx, int64_t units, int64_t align,
                         int64_t bytes);

typedef struct {
    const void *y;
    int y_bf16;
    const int64_t *idx;
    const float *w;
    int64_t H, rows_out;
    float *out;
} SJob;

static int sshare(void *ctx, int64_t a, int64_t b) {
    const SJob *J = ctx;
    for (int64_t i = a; i < b; i++) {
        int64_t r = J->idx[i];
        if (r < 0 || r >= J->rows_out) return -1;
        float *o = J->out + r * J->H;
        const float wi = J->w[i];
        if (J->y_bf16) {
            const uint16_t *yb = (const uint16_t *)J->y + i * J->H;
            for (int64_t c = 0; c < J->H; c++) {
                uint32_t u = (uint32_t)yb[c] << 16;
                float v;
                memcpy(&v, &u, 4);
                o[c] = v * wi;
            }
        } else {
            const float *yf = (const float *)J->y + i * J->H;
            for (int64_t c = 0; c < J->H; c++) o[c] = yf[c] * wi;
        }
    }
    return 0;
}

/* y [P, H] (bf16 when y_bf16, else fp32), idx [P] int64 rows of out [rows_out, H] fp32, w [P] fp32. 0; -1 for an
 * index out of range (those rows before it are written) or a bad shape. */
int moechat_scatter_weighted(const void *y, int y_bf16, const int64_t *idx, const float *w, int64_t P, int64_t H,
                             float *out, int64_t rows_out) {
    if (P < 0 || H <= 0 || rows_out < 0) return -1;
    if (P == 0) return 0;
    SJob J = {.y = y, .y_bf16 = y_bf16, .idx = idx, .w = w, .H = H, .rows_out = rows_out, .out = out};
    return moechat_parallel_for(sshare, &J, P, 1, P * H * (y_bf16 ? 6 : 8));
}
