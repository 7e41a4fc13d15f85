/* NoteBank's feature capture for one segment of the CPU delta-rule kernel, in one pass per tensor.
 *
 * The same reduction as `ChunkReducer.on_segment`'s torch path (nbcore/notebank/features.py), which
 * is its reference and is tested against it (tests/test_capture_native.py):
 *   - Eq. 9, compacted queries: qc[t, h, e] = bf16(q[t, h, coords[h, e]]), rounded to nearest even
 *     exactly as torch's float -> bfloat16 conversion;
 *   - Eqs. 3, 8, distinctiveness over NoteBank's C-token chunks:
 *     d_t = 1 - <k_t / |k_t|, mu>, mu = s / |s|, s = sum over the chunk of k_t / |k_t|,
 *     with torch's clamps (|k| and |s| at least 1e-12).
 * Only whole C-token chunks are reduced here; the caller handles a trailing partial chunk.
 *
 * Layout (as gdn_cpu makes it): q, k are [n, BH, c, D] float32, contiguous, chunk-major; key head h
 * is kernel head h * r (batch 0). Outputs are strided views: qc element (t, h, e) at
 * qc[t * qc_tok + h * qc_head + e]; d element (t, h) at d[t * d_tok + h * d_head].
 *
 * Numerics: sums over D run in 2 x 4 float lanes combined in a fixed order (GCC / Clang vector
 * extensions; built with -ffp-contract=off), each kernel chunk's c rows are summed in float and
 * the chunk sum s in double. Results are
 * deterministic for a given build and agree with the torch path to ~1e-6.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 1024

/* x86-64 Linux with GCC: an AVX2 clone beside the baseline one, picked at load time (ifunc). The
 * per-lane arithmetic is the same in both (explicit 4-lane vectors, no contraction), so results
 * are bit-identical whichever runs; AVX2 only encodes it better (~1.5x here). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && !defined(NB_NO_CLONES)
#define NB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define NB_CLONES
#endif

/* GCC / Clang vector extensions: 4 float lanes (SSE on x86-64, NEON on aarch64), portable C */
typedef float v4f __attribute__((vector_size(16)));

static inline v4f load4(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof v);     /* unaligned load */
    return v;
}

static inline float hsum(v4f v) { return (v[0] + v[1]) + (v[2] + v[3]); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);   /* nearest, ties to even */
    return ((u & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)0x7fc0 : rounded;   /* NaN, as c10::BFloat16 */
}

/* sum of squares and <x, mu> of one row; D4 = D rounded down to a multiple of 8 */
static inline float row_sq(const float *x, int64_t D, int64_t D8) {
    v4f a0 = {0, 0, 0, 0}, a1 = {0, 0, 0, 0};
    int64_t e = 0;
    for (; e < D8; e += 8) {
        v4f x0 = load4(x + e), x1 = load4(x + e + 4);
        a0 += x0 * x0;
        a1 += x1 * x1;
    }
    float s = hsum(a0) + hsum(a1);
    for (; e < D; e++) s += x[e] * x[e];
    return s;
}

static inline float row_dot(const float *x, const float *mu, int64_t D, int64_t D8) {
    v4f a0 = {0, 0, 0, 0}, a1 = {0, 0, 0, 0};
    int64_t e = 0;
    for (; e < D8; e += 8) {
        a0 += load4(x + e) * load4(mu + e);
        a1 += load4(x + e + 4) * load4(mu + e + 4);
    }
    float s = hsum(a0) + hsum(a1);
    for (; e < D; e++) s += x[e] * mu[e];
    return s;
}

static inline float inv_norm(float sq_sum) {
    float nrm = sqrtf(sq_sum);
    return 1.0f / (nrm < 1e-12f ? 1e-12f : nrm);
}

/* Returns 0, or -1 if D or d_rho > MAX_D or C is not a multiple of c (nothing written then).
 * inv: scratch of at least C floats (or NULL when d is NULL). */
NB_CLONES
int nb_capture_segment(const float *q, const float *k, int64_t n, int64_t BH, int64_t c, int64_t D,
                       int64_t r, int64_t H, int64_t t, const int64_t *coords, int64_t dr,
                       uint16_t *qc, int64_t qc_tok, int64_t qc_head,
                       float *d, int64_t d_tok, int64_t d_head, int64_t C, float *inv) {
    if (D > MAX_D || dr > MAX_D || (d && (C <= 0 || C % c || !inv))) return -1;
    /* Eq. 9: token-major compacted queries */
    int32_t co[MAX_D];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t e = 0; e < dr; e++) co[e] = (int32_t)coords[h * dr + e];
        for (int64_t i = 0; i < n; i++) {
            const float *blk = q + (i * BH + h * r) * c * D;
            int64_t jn = t - i * c < c ? t - i * c : c;
            for (int64_t j = 0; j < jn; j++) {
                const float *row = blk + j * D;
                uint16_t *dst = qc + (i * c + j) * qc_tok + h * qc_head;
                for (int64_t e = 0; e < dr; e++) dst[e] = f32_to_bf16(row[co[e]]);
            }
        }
    }
    if (!d) return 0;
    /* Eqs. 3, 8 over each whole C-token chunk and head */
    int64_t g = C / c, nb = t / C, D8 = D - D % 8, D4 = D - D % 4;
    double s[MAX_D];
    v4f part[MAX_D / 4];
    float mu[MAX_D], part_tail[4];
    for (int64_t jj = 0; jj < nb; jj++) {
        for (int64_t h = 0; h < H; h++) {
            for (int64_t e = 0; e < D; e++) s[e] = 0.0;
            for (int64_t i = jj * g; i < (jj + 1) * g; i++) {
                /* one kernel chunk: its c rows summed in float (as a [1, c] x [c, D] product), then
                   added to the chunk's sum in double */
                const float *blk = k + (i * BH + h * r) * c * D;
                float *inv_i = inv + (i - jj * g) * c;
                for (int64_t e = 0; e < D4 / 4; e++) part[e] = (v4f){0, 0, 0, 0};
                for (int64_t e = 0; e < D - D4; e++) part_tail[e] = 0.0f;
                for (int64_t j = 0; j < c; j++) {
                    const float *x = blk + j * D;
                    float w = inv_i[j] = inv_norm(row_sq(x, D, D8));
                    for (int64_t e = 0; e < D4 / 4; e++) part[e] += w * load4(x + 4 * e);
                    for (int64_t e = D4; e < D; e++) part_tail[e - D4] += w * x[e];
                }
                for (int64_t e = 0; e < D4 / 4; e++)
                    for (int l = 0; l < 4; l++) s[4 * e + l] += (double)part[e][l];
                for (int64_t e = D4; e < D; e++) s[e] += (double)part_tail[e - D4];
            }
            double ss = 0.0;
            for (int64_t e = 0; e < D; e++) ss += s[e] * s[e];
            double ns = sqrt(ss);
            if (ns < 1e-12) ns = 1e-12;
            for (int64_t e = 0; e < D; e++) mu[e] = (float)(s[e] / ns);
            for (int64_t i = jj * g; i < (jj + 1) * g; i++) {
                const float *blk = k + (i * BH + h * r) * c * D;
                const float *inv_i = inv + (i - jj * g) * c;
                for (int64_t j = 0; j < c; j++)
                    d[(i * c + j) * d_tok + h * d_head] = 1.0f - row_dot(blk + j * D, mu, D, D8) * inv_i[j];
            }
        }
    }
    return 0;
}
