/* NaN/Inf checks of weights as they are read (engine/cache/store.py, engine/load/loader.py; wrapped in native.py).
 *
 * A float is Inf or NaN exactly when its exponent bits are all ones: bf16 0x7F80, fp16 0x7C00, fp32 0x7F800000,
 * fp64 0x7FF0...; FP8 E5M2 0x7C (Inf and NaN), E4M3 has no Inf and one NaN per sign, S.1111.111 (0x7F). The scan
 * ORs `(x & mask) == mask` over blocks of elements (a loop the compiler vectorizes: AVX2 or AVX-512, whatever
 * -march=native gives) and looks for the element only in a block that has one, so a clean tensor costs one pass
 * at memory speed: ~0.1 of the read it follows, against aminmax's ~0.5-1 (bench/load_time.py).
 *
 * moechat_read_checked fuses the check with the read: pread in chunks of CHUNK bytes into the destination, each
 * chunk scanned while it is still in the cache, so the check adds no pass over memory. Both run on the calling
 * thread with the GIL released (ctypes): reading several experts at once is threads calling this. */

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

enum { CK_BF16, CK_F16, CK_F32, CK_F64, CK_E4M3, CK_E5M2, CK_KINDS };

#define BLOCK 4096            /* elements between tests for a hit */
#define CHUNK (512 << 10)     /* bytes per pread: half a typical L2, so the scan reads them from the cache */

static const int64_t SIZES[CK_KINDS] = {2, 2, 4, 8, 1, 1};

#define SCAN(NAME, T)                                                              \
    static int64_t NAME(const T *p, int64_t n, T mask) {                           \
        for (int64_t i = 0; i < n; i += BLOCK) {                                   \
            int64_t m = n - i < BLOCK ? n - i : BLOCK;                             \
            const T *q = p + i;                                                    \
            T hit = 0;                                                             \
            for (int64_t j = 0; j < m; j++) hit |= (T)((q[j] & mask) == mask);     \
            if (hit)                                                               \
                for (int64_t j = 0; j < m; j++)                                    \
                    if ((q[j] & mask) == mask) return i + j;                       \
        }                                                                          \
        return -1;                                                                 \
    }

SCAN(scan8, uint8_t)
SCAN(scan16, uint16_t)
SCAN(scan32, uint32_t)
SCAN(scan64, uint64_t)

/* The index of the first non-finite element among the n elements at p (aligned to its element size, as every torch
 * tensor is), -1 when all are finite, -2 for an unknown kind. */
static int64_t first_bad(const void *p, int64_t n, int kind) {
    switch (kind) {
    case CK_BF16: return scan16(p, n, 0x7F80);
    case CK_F16: return scan16(p, n, 0x7C00);
    case CK_F32: return scan32(p, n, 0x7F800000u);
    case CK_F64: return scan64(p, n, 0x7FF0000000000000ull);
    case CK_E4M3: return scan8(p, n, 0x7F);
    case CK_E5M2: return scan8(p, n, 0x7C);
    default: return -2;
    }
}

int64_t moechat_first_nonfinite(const void *p, int64_t nbytes, int kind) {
    if (kind < 0 || kind >= CK_KINDS) return -2;
    return first_bad(p, nbytes / SIZES[kind], kind);
}

/* Read nbytes at `offset` of fd into dst, checking each element (kind >= 0; -1: bytes with no check, the packed
 * codes) as it arrives. Returns the bytes read (less than nbytes: the file ended), or -errno; *bad is the first
 * non-finite element's index, or -1. The read goes on past a bad element (the caller counts them for its error). */
int64_t moechat_read_checked(int fd, void *dst, int64_t nbytes, int64_t offset, int kind, int64_t *bad) {
    *bad = -1;
    if (kind >= CK_KINDS) return -EINVAL;
    const int64_t size = kind >= 0 ? SIZES[kind] : 1;
    uint8_t *out = dst;
    int64_t done = 0, checked = 0; /* bytes read; bytes scanned (whole elements) */
    while (done < nbytes) {
        int64_t want = nbytes - done < CHUNK ? nbytes - done : CHUNK;
        ssize_t n = pread(fd, out + done, (size_t)want, (off_t)(offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) break;
        done += n;
        if (kind >= 0 && *bad < 0) {
            int64_t upto = done / size * size;
            int64_t hit = first_bad(out + checked, (upto - checked) / size, kind);
            if (hit >= 0) *bad = checked / size + hit;
            checked = upto;
        }
    }
    return done;
}
