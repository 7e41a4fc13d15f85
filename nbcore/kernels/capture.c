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
 * Numerics: sums over D run in 8 float lanes (two 4-lane halves) combined in a fixed order (GCC /
 * Clang vector extensions; built with -ffp-contract=off), each kernel chunk's c rows are summed in
 * float and the chunk sum s in double. Results are deterministic, the same bits from the baseline,
 * AVX2 and AVX-512 code paths, and agree with the torch path to ~1e-6.
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

typedef float v8f __attribute__((vector_size(32)));

/* 8-lane values stay inside one function (no v8f arguments or returns: the ABI of those differs
   between the baseline and AVX builds, and GCC warns about it) */
#define LOAD8(v, p) memcpy(&(v), (p), sizeof(v8f))

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);   /* nearest, ties to even */
    return ((u & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)0x7fc0 : rounded;   /* NaN, as c10::BFloat16 */
}

/* Eq. 9 with AVX-512 (x86-64 GCC / Clang, picked at run time when the CPU has AVX-512F): 16
   coordinates per instruction, a two-register permute when D = 32 (the tiny models' head size),
   else a gather; the rounding is f32_to_bf16's integer recipe on 16 lanes, so the bits are the
   scalar loop's (tests/test_capture_native.py compares both). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(NB_NO_AVX512)
#define NB_AVX512 1
#include <immintrin.h>

__attribute__((target("avx512f")))
static void qc_rows_avx512(const float *blk, int64_t jn, int64_t D, const int32_t *co, int64_t dr,
                           uint16_t *dst0, int64_t qc_tok) {
    const __m512i c7fff = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i qnan = _mm512_set1_epi32(0x7fc0);
    for (int64_t e0 = 0; e0 < dr; e0 += 16) {
        __m512i idx = _mm512_loadu_si512((const void *)(co + e0));
        for (int64_t j = 0; j < jn; j++) {
            const float *row = blk + j * D;
            __m512 g = D == 32 ? _mm512_permutex2var_ps(_mm512_loadu_ps(row), idx, _mm512_loadu_ps(row + 16))
                               : _mm512_i32gather_ps(idx, row, 4);
            __m512i u = _mm512_castps_si512(g);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            __m512i rnd = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, c7fff), lsb), 16);
            __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
            rnd = _mm512_mask_mov_epi32(rnd, nan, qnan);
            _mm256_storeu_si256((__m256i *)(dst0 + j * qc_tok + e0), _mm512_cvtepi32_epi16(rnd));
        }
    }
}

static int qc_avx512_ok(int64_t dr) {
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return cpu && dr % 16 == 0;                /* any D: a gather when D != 32 */
}
#else
#define NB_AVX512 0
#endif

/* 1 / max(sqrt(sq), 1e-12) over m values (inv_norm, vectorised: IEEE sqrt and division, same bits) */
static inline void inv_norms(float *x, int64_t m) {
    const float floor_ = 1e-12f;
    uint32_t fb;
    memcpy(&fb, &floor_, 4);
    for (int64_t j = 0; j < m; j++) x[j] = sqrtf(x[j]);
    for (int64_t j = 0; j < m; j++) {
        /* nrm < 1e-12 ? 1e-12 : nrm as a bit select (a branch would stop the vectoriser; NaN kept) */
        float nrm = x[j];
        uint32_t nb, mask = -(uint32_t)(nrm < floor_);
        memcpy(&nb, &nrm, 4);
        nb = (nb & ~mask) | (fb & mask);
        memcpy(&nrm, &nb, 4);
        x[j] = 1.0f / nrm;
    }
}

/* sum of squares and <x, mu> of one row; D8 = D rounded down to a multiple of 8. One 8-lane
   accumulator: lanes 0-3 and 4-7 are the two 4-lane partial sums this kernel has always kept (per
   lane the same additions in the same order), so 256-bit and 2 x 128-bit builds give the same bits. */
#define HSUM8(a) ((((a)[0] + (a)[1]) + ((a)[2] + (a)[3])) + (((a)[4] + (a)[5]) + ((a)[6] + (a)[7])))

static inline float row_sq(const float *x, int64_t D, int64_t D8) {
    v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t e = 0;
    for (; e < D8; e += 8) {
        v8f x0;
        LOAD8(x0, x + e);
        a += x0 * x0;
    }
    float s = HSUM8(a);
    for (; e < D; e++) s += x[e] * x[e];
    return s;
}

static inline float row_dot(const float *x, const float *mu, int64_t D, int64_t D8) {
    v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t e = 0;
    for (; e < D8; e += 8) {
        v8f x0, m0;
        LOAD8(x0, x + e);
        LOAD8(m0, mu + e);
        a += x0 * m0;
    }
    float s = HSUM8(a);
    for (; e < D; e++) s += x[e] * mu[e];
    return s;
}

/* Eq. 9 for kernel chunk i, key head h (kernel head h * r): rows 0 .. jn-1 */
static inline __attribute__((always_inline)) void qc_chunk(const float *q, int64_t i, int64_t h, int64_t BH, int64_t c, int64_t D, int64_t r,
                            int64_t jn, const int32_t *co, int64_t dr, uint16_t *qc, int64_t qc_tok,
                            int64_t qc_head, int wide) {
    const float *blk = q + (i * BH + h * r) * c * D;
    uint16_t *dst0 = qc + i * c * qc_tok + h * qc_head;
#if NB_AVX512
    if (wide) {
        qc_rows_avx512(blk, jn, D, co, dr, dst0, qc_tok);
        return;
    }
#else
    (void)wide;
#endif
    for (int64_t j = 0; j < jn; j++) {
        const float *row = blk + j * D;
        uint16_t *dst = dst0 + j * qc_tok;
        for (int64_t e = 0; e < dr; e++) dst[e] = f32_to_bf16(row[co[e]]);
    }
}

/* Eqs. 3, 8 for NoteBank chunk jj (kernel chunks jj*g .. jj*g+g-1), key head h */
static inline __attribute__((always_inline)) void dist_chunk(const float *k, int64_t jj, int64_t h, int64_t g, int64_t BH, int64_t c,
                              int64_t D, int64_t r, float *d, int64_t d_tok, int64_t d_head, float *inv) {
    int64_t D8 = D - D % 8, D4 = D - D % 4;
    double s[MAX_D];
    v8f part8[MAX_D / 8];
    v4f part4;
    float mu[MAX_D], part_tail[4];
    for (int64_t e = 0; e < D; e++) s[e] = 0.0;
    for (int64_t i = jj * g; i < (jj + 1) * g; i++) {
        /* one kernel chunk: its c rows summed in float (as a [1, c] x [c, D] product), then
           added to the chunk's sum in double */
        const float *blk = k + (i * BH + h * r) * c * D;
        float *inv_i = inv + (i - jj * g) * c;
        for (int64_t e = 0; e < D8 / 8; e++) part8[e] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
        part4 = (v4f){0, 0, 0, 0};
        for (int64_t e = 0; e < D - D4; e++) part_tail[e] = 0.0f;
        for (int64_t j = 0; j < c; j++) inv_i[j] = row_sq(blk + j * D, D, D8);
        inv_norms(inv_i, c);
        for (int64_t j = 0; j < c; j++) {
            const float *x = blk + j * D;
            float w = inv_i[j];
            for (int64_t e = 0; e < D8 / 8; e++) {
                v8f x0;
                LOAD8(x0, x + 8 * e);
                part8[e] += w * x0;
            }
            if (D4 > D8) part4 += w * load4(x + D8);
            for (int64_t e = D4; e < D; e++) part_tail[e - D4] += w * x[e];
        }
        for (int64_t e = 0; e < D8 / 8; e++)
            for (int l = 0; l < 8; l++) s[8 * e + l] += (double)part8[e][l];
        for (int64_t e = D8; e < D4; e++) s[e] += (double)part4[e - D8];
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

/* The sum of squares of a row as torch computes `x.square().sum(-1)` for a contiguous float row of
 * D < MAX_TORCH_SUM values on x86-64 (ATen's vectorized inner sum, 8-float vectors): four vector
 * accumulators taking vectors 4i .. 4i+3 in turn, the remainder vectors added to the first, the
 * four folded into the first in order; then a scalar sum: the D % 8 tail elements, then the 8
 * lanes in order. Every product and sum is rounded as there (no contraction), so the bits are
 * torch's; nbcore.kernels.native checks that on first use per D and otherwise keeps torch's ops. */
#define MAX_TORCH_SUM 512
static inline __attribute__((always_inline)) float torch_row_sumsq(const float *x, int64_t D) {
    int64_t nv = D / 8, ilp = nv / 4;
    v8f p0 = {0, 0, 0, 0, 0, 0, 0, 0}, p1 = p0, p2 = p0, p3 = p0;
    for (int64_t i = 0; i < ilp; i++) {
        v8f a, b, c_, d_;
        LOAD8(a, x + 32 * i);
        LOAD8(b, x + 32 * i + 8);
        LOAD8(c_, x + 32 * i + 16);
        LOAD8(d_, x + 32 * i + 24);
        p0 += a * a;
        p1 += b * b;
        p2 += c_ * c_;
        p3 += d_ * d_;
    }
    for (int64_t i = 4 * ilp; i < nv; i++) {
        v8f a;
        LOAD8(a, x + 8 * i);
        p0 += a * a;
    }
    p0 += p1;
    p0 += p2;
    p0 += p3;
    float f = 0.0f;
    for (int64_t e = 8 * nv; e < D; e++) f += x[e] * x[e];
    for (int l = 0; l < 8; l++) f += p0[l];
    return f;
}

/* transformers' `l2norm` in place, then an optional scale, over m contiguous rows of D:
 * x <- x * (1 / sqrt(sum(x^2) + eps)), then x <- x * scale (two roundings, as torch's two ops) */
static inline __attribute__((always_inline)) void l2norm_rows(float *x, int64_t m, int64_t D, float eps, float scale, int scaled) {
    for (int64_t j = 0; j < m; j++) {
        float *row = x + j * D;
        float w = 1.0f / sqrtf(torch_row_sumsq(row, D) + eps);
        for (int64_t e = 0; e < D; e++) row[e] = row[e] * w;
        if (scaled)
            for (int64_t e = 0; e < D; e++) row[e] = row[e] * scale;
    }
}

/* In place over rows x [rows, D] (contiguous): transformers' l2norm with eps, then times scale if
 * scaled. Returns 0, or -1 if D >= MAX_TORCH_SUM (nothing written). */
NB_CLONES
int nb_l2norm_rows(float *x, int64_t rows, int64_t D, float eps, float scale, int64_t scaled) {
    if (D <= 0 || D >= MAX_TORCH_SUM) return -1;
    l2norm_rows(x, rows, D, eps, scale, (int)scaled);
    return 0;
}

/* Returns 0, or -1 if D or d_rho > MAX_D or C is not a multiple of c (nothing written then).
 * inv: scratch of at least C floats (or NULL when d is NULL). */
NB_CLONES
int nb_capture_segment(const float *q, const float *k, int64_t n, int64_t BH, int64_t c, int64_t D,
                       int64_t r, int64_t H, int64_t t, const int64_t *coords, int64_t dr,
                       uint16_t *qc, int64_t qc_tok, int64_t qc_head,
                       float *d, int64_t d_tok, int64_t d_head, int64_t C, float *inv) {
    if (D > MAX_D || dr > MAX_D || (d && (C <= 0 || C % c || !inv))) return -1;
    int wide = 0;
#if NB_AVX512
    wide = qc_avx512_ok(dr);
#endif
    /* Eq. 9: token-major compacted queries */
    int32_t co[MAX_D];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t e = 0; e < dr; e++) co[e] = (int32_t)coords[h * dr + e];
        for (int64_t i = 0; i < n; i++)
            qc_chunk(q, i, h, BH, c, D, r, t - i * c < c ? t - i * c : c, co, dr, qc, qc_tok, qc_head, wide);
    }
    if (!d) return 0;
    /* Eqs. 3, 8 over each whole C-token chunk and head */
    int64_t g = C / c, nb = t / C;
    for (int64_t jj = 0; jj < nb; jj++)
        for (int64_t h = 0; h < H; h++) dist_chunk(k, jj, h, g, BH, c, D, r, d, d_tok, d_head, inv);
    return 0;
}
