/* swarmtrain's CPU kernels: one pass over memory where torch would take several.
 *
 * Built on first use by swarmtrain/compression/kernels.py with the machine's C compiler
 * (-O3 -march=native -ffp-contract=off) and loaded with ctypes, which lets go of the GIL
 * during a call: kernels.py runs one call per thread on slices of a tensor. Every kernel
 * computes, bit for bit, what the torch code it replaces computes: -ffp-contract=off keeps
 * a*b+c two roundings (as torch's separate ops are), and nothing is reassociated (no
 * -ffast-math). Sums of squares are accumulated in double, so they neither overflow nor
 * lose small terms. The one exception: the Adam step flushes subnormal floats to zero (see
 * st_adam_apply), where torch's step would keep them and take far longer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FP16_MAX 65504.0f
#define LANES 16
#define BLOCK 1024

/* The published copy moves by the fp16 rounding of (master - published):
 *   d = m[i] - pub[i]; h = fp16(clamp(d, +-65504)); pub[i] += float(h); out[i] = h
 * sums[0] += (d - float(h))^2 (what the downlink left out), sums[1] += m[i]^2. */
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
static inline double hsum(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    double a = 0.0;
    for (int j = 0; j < 8; j++) a += t[j];
    return a;
}

/* the sum of four float accumulators' lanes, added in double as a tree: one dependency on
 * the running total per call instead of eight (a block's sums of squares, below) */
static inline double hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    const __m256d d = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)),
                                    _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)));
    const __m128d e = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(e, _mm_unpackhi_pd(e, e)));
}
#endif

/* where a publication goes (the fused Adam step's, below) */
enum { PUB_NONE = 0, PUB_FP16 = 1, PUB_UNIFORM = 2, PUB_SNAPSHOT = 3, PUB_HALF = 4 };

/* Where a new weight goes once it is known: the fp16 publication above (pub, out; the sums
 * added to resid and norm), a copy into the snapshot (snap), or (PUB_HALF) the weight itself
 * rounded to fp16 into out, saturating at +-65504, the sums of what the rounding left out and
 * of the weights added as the fp16 publication adds them. Pointers are for the piece's
 * first element. st_publish_fp16 runs it over weights it reads; the fused Adam step over the
 * weights it has just computed, still in registers, so the publication's arithmetic overlaps
 * the step's divisions and no second pass reads the weights. */
typedef struct {
    int mode; /* PUB_FP16, PUB_SNAPSHOT or PUB_HALF */
    float *pub;
    _Float16 *out;
    float *snap;
    double resid, norm;
} sink_t;

static inline void sink1(sink_t *s, int64_t i, float pv) {
    if (s->mode == PUB_SNAPSHOT) {
        s->snap[i] = pv;
        return;
    }
    float d = s->mode == PUB_HALF ? pv : pv - s->pub[i];
    float c = d > FP16_MAX ? FP16_MAX : (d < -FP16_MAX ? -FP16_MAX : d);
    _Float16 h = (_Float16)c;
    float e = (float)h;
    if (s->mode != PUB_HALF) s->pub[i] = s->pub[i] + e;
    s->out[i] = h;
    double r = (double)(d - e);
    s->resid += r * r;
    s->norm += (double)pv * (double)pv;
}

#ifdef HAVE_AVX2
/* sink1 for the 8 new weights at i; the fp16 sums go into the float accumulators r and q,
 * which the caller adds into resid and norm every SINK_FLUSH elements */
#define SINK_FLUSH 1024
static inline void sink8(sink_t *s, int64_t i, __m256 pv, __m256 *r, __m256 *q) {
    if (s->mode == PUB_SNAPSHOT) {
        /* the snapshot is not read here again: streamed past the cache where aligned */
        if (((uintptr_t)(s->snap + i) & 31) == 0)
            _mm256_stream_ps(s->snap + i, pv);
        else
            _mm256_storeu_ps(s->snap + i, pv);
        return;
    }
    const __m256 hi = _mm256_set1_ps(FP16_MAX), lo = _mm256_set1_ps(-FP16_MAX);
    const int half = s->mode == PUB_HALF;
    __m256 pa = half ? _mm256_setzero_ps() : _mm256_loadu_ps(s->pub + i);
    __m256 da = half ? pv : _mm256_sub_ps(pv, pa);
    __m256 ca = _mm256_max_ps(_mm256_min_ps(da, hi), lo);
    ca = _mm256_blendv_ps(ca, da, _mm256_cmp_ps(da, da, _CMP_UNORD_Q));
    __m128i ha = _mm256_cvtps_ph(ca, _MM_FROUND_TO_NEAREST_INT);
    __m256 ea = _mm256_cvtph_ps(ha);
    if (!half) _mm256_storeu_ps(s->pub + i, _mm256_add_ps(pa, ea));
    if (((uintptr_t)(s->out + i) & 15) == 0)
        _mm_stream_si128((__m128i *)(s->out + i), ha);
    else
        _mm_storeu_si128((__m128i *)(s->out + i), ha);
    __m256 ra = _mm256_sub_ps(da, ea);
    *r = _mm256_add_ps(*r, _mm256_mul_ps(ra, ra));
    *q = _mm256_add_ps(*q, _mm256_mul_ps(pv, pv));
}

/* after each vector step: the sink's part, and its float sums into the doubles every
 * SINK_FLUSH elements (and once more after the loop: sink_flush) */
static inline void sink_step(sink_t *s, int64_t i, __m256 pv, __m256 *r, __m256 *q, int *count) {
    sink8(s, i, pv, r, q);
    if (s->mode != PUB_SNAPSHOT && (*count += 8) >= SINK_FLUSH) {
        s->resid += hsum(*r);
        s->norm += hsum(*q);
        *r = *q = _mm256_setzero_ps();
        *count = 0;
    }
}

static inline void sink_flush(sink_t *s, __m256 r, __m256 q) {
    if (s->mode != PUB_SNAPSHOT) {
        s->resid += hsum(r);
        s->norm += hsum(q);
    }
}
#endif

/* the sink over n weights it reads from m (its sums added to s's) */
static void sink_run(sink_t *s, const float *m, int64_t n) {
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 r = _mm256_setzero_ps(), q = r;
    int count = 0;
    for (; i + 8 <= n; i += 8) sink_step(s, i, _mm256_loadu_ps(m + i), &r, &q, &count);
    sink_flush(s, r, q);
    _mm_sfence();
#endif
    for (; i < n; i++) sink1(s, i, m[i]);
}

void st_publish_fp16(const float *m, float *pub, _Float16 *out, int64_t n, double *sums) {
    sink_t s = {PUB_FP16, pub, out, NULL, 0.0, 0.0};
    sink_run(&s, m, n);
    sums[0] = s.resid;
    sums[1] = s.norm;
}

/* out = fp16(m) (saturating); sums as PUB_HALF adds them (the rounded snapshot of weights the
 * fused step did not write: a small model's, or a parameter that was not stepped) */
void st_round_half(const float *m, _Float16 *out, int64_t n, double *sums) {
    sink_t s = {PUB_HALF, NULL, out, NULL, 0.0, 0.0};
    sink_run(&s, m, n);
    sums[0] = s.resid;
    sums[1] = s.norm;
}

/* The uniform codec (swarmtrain/compression/uniform.py) on d = m - pub, bucket by bucket:
 *   M = max|d| over the bucket; f = (1 / M) * s (0 when M is 0); level = clamp(rint(d * f), -s, s);
 *   code = level + s, packed 8/bits per byte, least significant bits first;
 *   pub[i] += level * (M / s).
 * sums as for fp16; returns 0, or 1 when a bucket holds NaN or inf (nothing is then sure
 * to be consistent: the caller restarts from the master). */
#define CHUNK 2048
int st_publish_uniform(const float *m, float *pub, uint8_t *codes, float *scales, int64_t n,
                       int64_t bucket, int bits, double *sums) {
    const int s = (1 << (bits - 1)) - 1;
    const int per_byte = 8 / bits;
    const int64_t nb = (n + bucket - 1) / bucket;
    int bad = 0;
    double resid = 0.0, norm = 0.0;
    uint8_t buf[CHUNK];
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * bucket, hi = lo + bucket < n ? lo + bucket : n;
        /* pass 1: the bucket's largest magnitude, and whether it is finite */
        float mx = 0.0f;
        int finite = 1;
        int64_t i = lo;
#ifdef HAVE_AVX2
        {
            const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028234663852886e38f);
            __m256 vmx = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (; i + 8 <= hi; i += 8) {
                __m256 a = _mm256_andnot_ps(sign, _mm256_sub_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(pub + i)));
                ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));
                vmx = _mm256_max_ps(vmx, a);
            }
            float t[8];
            _mm256_storeu_ps(t, vmx);
            for (int j = 0; j < 8; j++) mx = t[j] > mx ? t[j] : mx;
            if (_mm256_movemask_ps(ok) != 0xff) finite = 0;
        }
#endif
        for (; i < hi; i++) {
            float a = fabsf(m[i] - pub[i]);
            if (!(a <= 3.4028234663852886e38f)) finite = 0;
            mx = a > mx ? a : mx;
        }
        if (!finite) {
            bad = 1;
            scales[b] = NAN;
            continue;
        }
        scales[b] = mx;
        /* torch computes the codec's int / tensor as reciprocal(tensor) * int */
        const float f = mx > 0.0f ? (1.0f / mx) * (float)s : 0.0f;
        const float unit = mx / (float)s;
        /* pass 2, a chunk at a time: levels, codes, the published copy, the sums */
        for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
            const int64_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
            int64_t k = c0;
#ifdef HAVE_AVX2
            {
                const __m256 vf = _mm256_set1_ps(f), vu = _mm256_set1_ps(unit);
                const __m256 smax = _mm256_set1_ps((float)s), smin = _mm256_set1_ps((float)-s);
                __m256 r0 = _mm256_setzero_ps(), n0 = r0;
                for (; k + 8 <= c1; k += 8) {
                    __m256 mv = _mm256_loadu_ps(m + k), pv = _mm256_loadu_ps(pub + k);
                    __m256 d = _mm256_sub_ps(mv, pv);
                    __m256 level = _mm256_round_ps(_mm256_mul_ps(d, vf),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    level = _mm256_min_ps(_mm256_max_ps(level, smin), smax);
                    __m256i code = _mm256_cvtps_epi32(_mm256_add_ps(level, smax));
                    __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
                    __m128i c8 = _mm_packus_epi16(c16, c16);
                    _mm_storel_epi64((__m128i *)(buf + (k - c0)), c8);
                    __m256 e = _mm256_mul_ps(level, vu);
                    _mm256_storeu_ps(pub + k, _mm256_add_ps(pv, e));
                    __m256 r = _mm256_sub_ps(d, e);
                    r0 = _mm256_add_ps(r0, _mm256_mul_ps(r, r));
                    n0 = _mm256_add_ps(n0, _mm256_mul_ps(mv, mv));
                }
                resid += hsum(r0);
                norm += hsum(n0);
            }
#endif
            for (; k < c1; k++) {
                float d = m[k] - pub[k];
                float level = rintf(d * f);
                level = level < (float)-s ? (float)-s : (level > (float)s ? (float)s : level);
                buf[k - c0] = (uint8_t)((int)level + s);
                float e = level * unit;
                pub[k] = pub[k] + e;
                double r = (double)(d - e);
                resid += r * r;
                norm += (double)m[k] * (double)m[k];
            }
            /* pack: code i of the slice goes to byte i / per_byte, bit (i % per_byte) * bits;
             * c0 - lo and the bucket start are multiples of per_byte (the caller checks) */
            const int64_t len = c1 - c0;
            uint8_t *dst = codes + c0 / per_byte;
            if (bits == 8) {
                memcpy(dst, buf, (size_t)len);
            } else if (bits == 4) {
                int64_t j = 0;
                for (; 2 * j + 1 < len; j++) dst[j] = (uint8_t)(buf[2 * j] | (buf[2 * j + 1] << 4));
                if (2 * j < len) dst[j] = buf[2 * j];
            } else {
                for (int64_t j = 0; j * 4 < len; j++) {
                    uint8_t v = 0;
                    for (int q = 0; q < 4 && 4 * j + q < len; q++) v |= (uint8_t)(buf[4 * j + q] << (2 * q));
                    dst[j] = v;
                }
            }
        }
    }
    sums[0] = resid;
    sums[1] = norm;
    return bad;
}

/* sum of squares of float32 / float16 values (NaN and inf make it NaN / inf), added to acc
 * block by block: a range summed in pieces cut at multiples of BLOCK, each piece continuing
 * from the last one's acc, gives the bits of one call over the whole range */
#define SUMSQ(name, type)                                                    \
    static double name##_acc(double acc, const type *x, int64_t n) {         \
        int64_t i = 0;                                                       \
        for (; i + BLOCK <= n; i += BLOCK) {                                 \
            float l[LANES] = {0};                                            \
            for (int64_t k = i; k < i + BLOCK; k += LANES)                   \
                for (int j = 0; j < LANES; j++) {                            \
                    float v = (float)x[k + j];                               \
                    l[j] += v * v;                                           \
                }                                                            \
            for (int j = 0; j < LANES; j++) acc += l[j];                     \
        }                                                                    \
        for (; i < n; i++) acc += (double)(float)x[i] * (double)(float)x[i]; \
        return acc;                                                          \
    }
SUMSQ(sumsq_f32_acc_c, float)
SUMSQ(sumsq_f16_scalar, _Float16)

/* With AVX2: four vector accumulators per block, so that its adds overlap (the loop above
 * keeps one dependency chain per 8 lanes and runs at about a third of the rate; the compiler
 * does not vectorize float16's widening at all). LOAD8(p) gives the 8 floats at p. */
#ifdef HAVE_AVX2
#define SUMSQ_AVX2(name, type, LOAD8, tail)                                  \
    static double name(double acc, const type *x, int64_t n) {               \
        int64_t i = 0;                                                       \
        for (; i + BLOCK <= n; i += BLOCK) {                                 \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;      \
            for (int64_t k = i; k < i + BLOCK; k += 32) {                    \
                __m256 v0 = LOAD8(x + k), v1 = LOAD8(x + k + 8);             \
                __m256 v2 = LOAD8(x + k + 16), v3 = LOAD8(x + k + 24);       \
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));               \
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));               \
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(v2, v2));               \
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(v3, v3));               \
            }                                                                \
            acc += hsum4(a0, a1, a2, a3);                                    \
        }                                                                    \
        return tail(acc, x + i, n - i);                                      \
    }
#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
SUMSQ_AVX2(sumsq_f32_acc, float, LOAD8_F32, sumsq_f32_acc_c_acc)
SUMSQ_AVX2(sumsq_f16_acc, _Float16, LOAD8_F16, sumsq_f16_scalar_acc)
#else
#define sumsq_f32_acc sumsq_f32_acc_c_acc
#define sumsq_f16_acc sumsq_f16_scalar_acc
#endif

double st_sumsq_f32(const float *x, int64_t n) { return sumsq_f32_acc(0.0, x, n); }
double st_sumsq_f16(const _Float16 *x, int64_t n) { return sumsq_f16_acc(0.0, x, n); }

/* The top-k decoder (swarmtrain/compression/topk.py) after its checks: out = 0 but for the
 * k kept entries, block b's j-th at b * 65536 + index_low, value widened from float16.
 * Returns 0, or 1 (out is then not to be used) when an index is >= n. */
int st_topk_decode(const _Float16 *values, const uint16_t *index_low, const int32_t *counts,
                   int64_t blocks, float *out, int64_t n) {
    memset(out, 0, (size_t)n * sizeof(float));
    int64_t pos = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t base = b << 16, end = pos + counts[b];
        if (base + 65536 <= n) {
            for (; pos < end; pos++) out[base + index_low[pos]] = (float)values[pos];
        } else {
            for (; pos < end; pos++) {
                int64_t idx = base + index_low[pos];
                if (idx >= n) return 1;
                out[idx] = (float)values[pos];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * The coordinator's Adam step over one flat float32 vector of master weights, fused with the
 * gradient's decoding and the downlink publication.
 *
 * The vector is cut into segments (one per parameter tensor): seg[SEG_FIELDS * s + ...] =
 * {flat offset, numel, kind, gradient pointer, top-k index_low, top-k block counts, snapshot
 * pointer}, kinds: no gradient (not stepped, as torch skips grad None), float32, float16 (the
 * fp16 codec's wire values, widened in registers) and top-k (decoded 65536 at a time into a
 * cache-sized scratch buffer rather than into a full-size tensor). segf[3 * s ...] are the
 * segment's scalars: step size lr / (1 - beta1^step) and sqrt(1 - beta2^step) for Adam (the
 * third unused), see held_piece for the held variance.
 *
 * The arithmetic is torch's fused CPU Adam with decoupled weight decay, operation for
 * operation in float32 (tests/test_kernels.py compares the two):
 *   p *= 1 - lr * wd;  m = fma(w, g - m, m) (lerp, w = 1 - beta1 < 0.5);
 *   v = fma((1 - beta2) * g, g, v * beta2);  p += (-step_size * m) / (sqrt(v) / bc2 + eps)
 * (torch's build contracts its v * beta2 + c * g * g into that fma).
 *
 * The publication is made as the weights are written: the fp16 coding of p - pub (as
 * st_publish_fp16 does) and the lossless downlink's copy into the snapshot tensors in the
 * step's own loop, from the new weights in registers (sink_t: their arithmetic overlaps the
 * step's divisions, and no second pass reads the weights); the uniform coding, which needs a
 * bucket's largest change first, in one pass over the thread's slice after its step (coding
 * each block while it was still in cache measured 1.6 ms slower for 10M parameters than the
 * two passes apart, and 2.3-2.8 ms slower than this). Parameters without a gradient are not
 * stepped but published all the same.
 * ------------------------------------------------------------------------------------- */
#define SEG_FIELDS 7
enum { G_NONE = 0, G_F32 = 1, G_F16 = 2, G_TOPK = 3 };
enum { RULE_ADAM = 0, RULE_HELD = 1 };
#define TOPK_BLOCK 65536
#define APPLY_BLOCK 16384

typedef struct {
    float wd_scale, w, beta2, one_minus_beta2, eps, neg_lr, clamp;
    int decay;
} hyper_t;

static inline float load_g1(const void *g, int kind, int64_t i) {
    return kind == G_F16 ? (float)((const _Float16 *)g)[i] : ((const float *)g)[i];
}

/* What both Adam kernels do first at element i: the gradient as float32, the weight with its
 * decoupled decay, and the new first moment m + w * (g - m) (torch's lerp). */
static inline void adam_start1(const float *p, const float *m, const void *g, int kind, int64_t i,
                               const hyper_t *h, float *gv, float *pv, float *mv) {
    *gv = load_g1(g, kind, i);
    *pv = h->decay ? p[i] * h->wd_scale : p[i];
    *mv = fmaf(h->w, *gv - m[i], m[i]);
}

#ifdef HAVE_AVX2
/* adam_start1 for the 8 elements at i; wd and w are h->wd_scale and h->w broadcast */
static inline void adam_start8(const float *p, const float *m, const void *g, int kind, int64_t i,
                               const hyper_t *h, __m256 wd, __m256 w, __m256 *gv, __m256 *pv,
                               __m256 *mv) {
    *gv = kind == G_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const _Float16 *)g + i)))
                        : _mm256_loadu_ps((const float *)g + i);
    *pv = _mm256_loadu_ps(p + i);
    if (h->decay) *pv = _mm256_mul_ps(*pv, wd);
    __m256 m0 = _mm256_loadu_ps(m + i);
    *mv = _mm256_fmadd_ps(w, _mm256_sub_ps(*gv, m0), m0);
}
#endif

/* plain Adam over n elements; g is float32 or float16 (kind) */
static void adam_piece(float *p, float *m, float *v, const void *g, int kind, int64_t n,
                       const hyper_t *h, float step_size, float bc2, sink_t *sk) {
    const float nss = -step_size;
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 wd = _mm256_set1_ps(h->wd_scale), w = _mm256_set1_ps(h->w);
    const __m256 b2 = _mm256_set1_ps(h->beta2), c2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 vbc2 = _mm256_set1_ps(bc2), veps = _mm256_set1_ps(h->eps);
    const __m256 vnss = _mm256_set1_ps(nss);
    __m256 sr = _mm256_setzero_ps(), sq = sr;
    int sc = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv, pv, mv;
        adam_start8(p, m, g, kind, i, h, wd, w, &gv, &pv, &mv);
        __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(c2, gv), gv, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
        __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), vbc2), veps);
        pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(vnss, mv), den));
        _mm256_storeu_ps(p + i, pv);
        _mm256_storeu_ps(m + i, mv);
        _mm256_storeu_ps(v + i, vv);
        if (sk) sink_step(sk, i, pv, &sr, &sq, &sc);
    }
    if (sk) sink_flush(sk, sr, sq);
#endif
    for (; i < n; i++) {
        float gv, pv, mv;
        adam_start1(p, m, g, kind, i, h, &gv, &pv, &mv);
        float vv = fmaf(h->one_minus_beta2 * gv, gv, v[i] * h->beta2);
        float den = sqrtf(vv) / bc2 + h->eps;
        p[i] = pv + (nss * mv) / den;
        m[i] = mv;
        v[i] = vv;
        if (sk) sink1(sk, i, p[i]);
    }
}

/* Adam with the second moment held (roles/ps/adam.py, held_variance_step): v only takes
 * (g * g) * vb where it is still 0; r = clamp((m / (sqrt(v) * rsvb + eps)) * rbc1, +-clamp);
 * p = fma(r, -lr, p) (torch's add with alpha). a = rbc1 = 1 / (1 - beta1^step), b = vb =
 * 1 - beta2^variance_steps, c = rsvb = 1 / sqrt(vb), each rounded from double as torch does. */
static void held_piece(float *p, float *m, float *v, const void *g, int kind, int64_t n,
                       const hyper_t *h, float rbc1, float vb, float rsvb, sink_t *sk) {
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 wd = _mm256_set1_ps(h->wd_scale), w = _mm256_set1_ps(h->w);
    const __m256 vvb = _mm256_set1_ps(vb), vrs = _mm256_set1_ps(rsvb), veps = _mm256_set1_ps(h->eps);
    const __m256 vr = _mm256_set1_ps(rbc1), hi = _mm256_set1_ps(h->clamp), lo = _mm256_set1_ps(-h->clamp);
    const __m256 nlr = _mm256_set1_ps(h->neg_lr), zero = _mm256_setzero_ps();
    __m256 sr = zero, sq = zero;
    int sc = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv, pv, mv;
        adam_start8(p, m, g, kind, i, h, wd, w, &gv, &pv, &mv);
        __m256 vv = _mm256_loadu_ps(v + i);
        vv = _mm256_blendv_ps(vv, _mm256_mul_ps(_mm256_mul_ps(gv, gv), vvb), _mm256_cmp_ps(vv, zero, _CMP_EQ_OQ));
        __m256 den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vv), vrs), veps);
        __m256 r = _mm256_mul_ps(_mm256_div_ps(mv, den), vr);
        /* r second: max/min return it when it is NaN, which torch's clamp keeps too */
        r = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
        pv = _mm256_fmadd_ps(r, nlr, pv);
        _mm256_storeu_ps(p + i, pv);
        _mm256_storeu_ps(m + i, mv);
        _mm256_storeu_ps(v + i, vv);
        if (sk) sink_step(sk, i, pv, &sr, &sq, &sc);
    }
    if (sk) sink_flush(sk, sr, sq);
#endif
    for (; i < n; i++) {
        float gv, pv, mv;
        adam_start1(p, m, g, kind, i, h, &gv, &pv, &mv);
        float vv = v[i] == 0.0f ? (gv * gv) * vb : v[i];
        float den = sqrtf(vv) * rsvb + h->eps;
        float r = (mv / den) * rbc1;
        r = r < -h->clamp ? -h->clamp : (r > h->clamp ? h->clamp : r);
        p[i] = fmaf(r, h->neg_lr, pv);
        m[i] = mv;
        v[i] = vv;
        if (sk) sink1(sk, i, p[i]);
    }
}

static void step_piece(int rule, float *p, float *m, float *v, const void *g, int kind, int64_t n,
                       const hyper_t *h, float a, float b, float c, sink_t *sk) {
    if (rule == RULE_HELD)
        held_piece(p, m, v, g, kind, n, h, a, b, c, sk);
    else
        adam_piece(p, m, v, g, kind, n, h, a, b, sk);
}

/* the sink for the piece of the flat vector at x (segment sg at offset off), or NULL */
static sink_t *piece_sink(sink_t *s, int pubmode, float *pub, void *out, const int64_t *sg,
                          int64_t off, int64_t x) {
    if (pubmode == PUB_FP16) {
        s->pub = pub + x;
        s->out = (_Float16 *)out + x;
        return s;
    }
    if (pubmode == PUB_SNAPSHOT && sg[6]) {
        s->snap = (float *)sg[6] + (x - off);
        return s;
    }
    if (pubmode == PUB_HALF && sg[6]) {
        s->out = (_Float16 *)sg[6] + (x - off);
        return s;
    }
    return NULL;
}

/* Decode top-k block `blk` of a segment into scratch (TOPK_BLOCK floats); 1 if an index
 * falls past the segment's end. */
static int topk_block(const int64_t *sg, int64_t blk, float *scratch) {
    const _Float16 *values = (const _Float16 *)sg[3];
    const uint16_t *low = (const uint16_t *)sg[4];
    const int32_t *counts = (const int32_t *)sg[5];
    int64_t pos = 0;
    for (int64_t b = 0; b < blk; b++) pos += counts[b];
    const int64_t base = blk * TOPK_BLOCK, len = sg[1] - base < TOPK_BLOCK ? sg[1] - base : TOPK_BLOCK;
    memset(scratch, 0, (size_t)len * sizeof(float));
    for (int64_t e = pos + counts[blk]; pos < e; pos++) {
        if (low[pos] >= len) return 1;
        scratch[low[pos]] = (float)values[pos];
    }
    return 0;
}

/* One thread's part [lo, hi) of the flat vector (for PUB_UNIFORM lo is a multiple of the
 * bucket). Returns 0, 1 when a top-k index is out of range (nothing after it is stepped:
 * the caller refuses such a gradient before, this is a guard), 2 when the publication met
 * NaN/inf. sums as the publication kernels give them. */
static int adam_apply(const int64_t *seg, const double *segf, int64_t nseg, float *p, float *m,
                      float *v, int64_t lo, int64_t hi, const double *hyper, int rule, int pubmode,
                      float *pub, void *out, float *scales, int64_t bucket, int bits, double *sums) {
    hyper_t h;
    h.decay = hyper[0] != 0.0;
    h.wd_scale = (float)hyper[1];
    h.w = (float)hyper[2];
    h.beta2 = (float)hyper[3];
    h.one_minus_beta2 = (float)hyper[4];
    h.eps = (float)hyper[5];
    h.neg_lr = (float)hyper[6];
    h.clamp = (float)hyper[7];
    float *scratch = NULL;
    int64_t scratch_seg = -1, scratch_blk = -1;
    int bad = 0;
    sink_t sink = {pubmode, NULL, NULL, NULL, 0.0, 0.0};  /* (its sums: every publication's) */
    int64_t s = 0;
    while (s < nseg && seg[SEG_FIELDS * s] + seg[SEG_FIELDS * s + 1] <= lo) s++;
    for (int64_t b0 = lo; b0 < hi && !bad; b0 += APPLY_BLOCK) {
        const int64_t b1 = b0 + APPLY_BLOCK < hi ? b0 + APPLY_BLOCK : hi;
        for (int64_t t = s; t < nseg; t++) {
            const int64_t *sg = seg + SEG_FIELDS * t;
            const int64_t off = sg[0], end = off + sg[1];
            if (off >= b1) break;
            if (end <= b0) { s = t + 1; continue; }
            const int64_t a = off > b0 ? off : b0, z = end < b1 ? end : b1;
            const int kind = (int)sg[2];
            const float sa = (float)segf[3 * t], sb = (float)segf[3 * t + 1], sc = (float)segf[3 * t + 2];
            if (kind == G_F32 || kind == G_F16) {
                const char *g = (const char *)sg[3] + (a - off) * (kind == G_F16 ? 2 : 4);
                step_piece(rule, p + a, m + a, v + a, g, kind, z - a, &h, sa, sb, sc,
                           piece_sink(&sink, pubmode, pub, out, sg, off, a));
            } else if (kind == G_TOPK) {
                if (!scratch && !(scratch = (float *)malloc(TOPK_BLOCK * sizeof(float)))) return 1;
                for (int64_t x = a; x < z;) {
                    const int64_t blk = (x - off) / TOPK_BLOCK, base = off + blk * TOPK_BLOCK;
                    if (scratch_seg != t || scratch_blk != blk) {
                        if (topk_block(sg, blk, scratch)) { bad = 1; break; }
                        scratch_seg = t;
                        scratch_blk = blk;
                    }
                    const int64_t y = base + TOPK_BLOCK < z ? base + TOPK_BLOCK : z;
                    step_piece(rule, p + x, m + x, v + x, scratch + (x - base), G_F32, y - x, &h, sa, sb, sc,
                               piece_sink(&sink, pubmode, pub, out, sg, off, x));
                    x = y;
                }
                if (bad) break;
            } else {  /* not stepped: published all the same, from the weights as they are */
                sink_t *sk = piece_sink(&sink, pubmode, pub, out, sg, off, a);
                if (sk) sink_run(sk, p + a, z - a);
            }
        }
        if (bad) break;
    }
    free(scratch);
    if (!bad && pubmode == PUB_UNIFORM) {
        double part[2] = {0.0, 0.0};
        if (st_publish_uniform(p + lo, pub + lo, (uint8_t *)out + lo * bits / 8, scales + lo / bucket,
                               hi - lo, bucket, bits, part))
            bad = 2;
        sink.resid += part[0];
        sink.norm += part[1];
    }
#ifdef HAVE_AVX2
    _mm_sfence(); /* the streamed snapshot is complete before another thread reads it */
#endif
    sums[0] = sink.resid;
    sums[1] = sink.norm;
    return bad;
}

/* Subnormal floats (below 2^-126, about 1.2e-38) are flushed to zero while Adam steps: a
 * moment of a parameter whose gradient stopped (a dead unit, an input that is always zero)
 * decays by beta each step through the subnormal range, and x86 processors take on the order
 * of a hundred cycles for each operation on one. Measured on the digits model after a few
 * thousand updates: a fifth of one layer's moments subnormal, the step 4x slower (115 us
 * against 30). Flushing changes only values that small (to 0); the caller's floating-point
 * mode is restored on return. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fpmode_t;
static inline fpmode_t flush_subnormals(void) {
    const fpmode_t old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15): results to zero; DAZ (bit 6): inputs as zero */
    return old;
}
static inline void restore_fpmode(fpmode_t old) { _mm_setcsr(old); }
#elif defined(__aarch64__)
typedef uint64_t fpmode_t;
static inline fpmode_t flush_subnormals(void) {
    fpmode_t old;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(old | (1ull << 24))); /* FZ */
    return old;
}
static inline void restore_fpmode(fpmode_t old) { __asm__ __volatile__("msr fpcr, %0" : : "r"(old)); }
#else
typedef int fpmode_t;
static inline fpmode_t flush_subnormals(void) { return 0; }
static inline void restore_fpmode(fpmode_t old) { (void)old; }
#endif

/* One thread's part [lo, hi) of the Adam step (adam_apply above), subnormals flushed. */
int st_adam_apply(const int64_t *seg, const double *segf, int64_t nseg, float *p, float *m,
                  float *v, int64_t lo, int64_t hi, const double *hyper, int rule, int pubmode,
                  float *pub, void *out, float *scales, int64_t bucket, int bits, double *sums) {
    const fpmode_t mode = flush_subnormals();
    const int bad = adam_apply(seg, segf, nseg, p, m, v, lo, hi, hyper, rule, pubmode, pub, out,
                               scales, bucket, bits, sums);
    restore_fpmode(mode);
    return bad;
}

/* The step's slices [bounds[t], bounds[t + 1]) for t < nslices at once, on the OpenMP
 * runtime's threads when this library is built with it (st_openmp), one after the other
 * otherwise. torch's CPU build runs its own parallel work on OpenMP and ships its libgomp, which
 * this library then shares (a process loads one libgomp.so.1): the same threads step the
 * weights as run torch's ops, instead of a second set of threads that each of them keeps
 * from a core while it spins waiting for work (measured with 2 threads: our step took 7.5 ms
 * beside torch's spinning threads on a Python thread pool, 5.4 ms when they slept). status[t]
 * and sums[2t..2t+1] are slice t's (st_adam_apply). */
void st_adam_apply_slices(const int64_t *seg, const double *segf, int64_t nseg, float *p, float *m,
                          float *v, const int64_t *bounds, int nslices, const double *hyper, int rule,
                          int pubmode, float *pub, void *out, float *scales, int64_t bucket, int bits,
                          double *sums, int *status) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(nslices) schedule(static, 1)
#endif
    for (int t = 0; t < nslices; t++)
        status[t] = st_adam_apply(seg, segf, nseg, p, m, v, bounds[t], bounds[t + 1], hyper, rule, pubmode,
                                  pub, out, scales, bucket, bits, sums + 2 * t);
}

/* 1 when built with OpenMP (st_adam_apply_slices runs its slices at once), else 0 */
int st_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The top-k decoder's checks without the decoding: 0 when the block counts are >= 0 and add
 * up to k and the last block's indices fall inside the tensor; 1 (counts) or 2 (an index). */
int st_topk_check(const uint16_t *index_low, const int32_t *counts, int64_t blocks, int64_t k,
                  int64_t n) {
    int64_t total = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (counts[b] < 0) return 1;
        total += counts[b];
    }
    if (total != k) return 1;
    if (blocks == 0) return 0;
    const int64_t last_len = n - (blocks - 1) * 65536;
    for (int64_t pos = k - counts[blocks - 1]; pos < k; pos++)
        if (index_low[pos] >= last_len) return 2;
    return 0;
}

/* st_topk_check over `count` entries in one call (a gradient's top-k tensors): entry i's
 * index_low at lows[i] and block counts at counts[i], blocks[i] blocks, ks[i] indices, over
 * ns[i] elements. Returns -1 when every entry passes, else the first failing entry's index. */
int64_t st_topk_check_many(const int64_t *lows, const int64_t *counts, const int64_t *blocks,
                           const int64_t *ks, const int64_t *ns, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (st_topk_check((const uint16_t *)lows[i], (const int32_t *)counts[i], blocks[i], ks[i], ns[i]))
            return i;
    return -1;
}

/* Sum of squares of many float32 / float16 ranges in one call (the screen's norm over every
 * tensor of a gradient): ptrs[i], lens[i] elements, half[i] nonzero for float16. */
double st_sumsq_many(const int64_t *ptrs, const int64_t *lens, const int32_t *half, int64_t count) {
    double acc = 0.0;
    for (int64_t i = 0; i < count; i++)
        acc += half[i] ? st_sumsq_f16((const _Float16 *)ptrs[i], lens[i])
                       : st_sumsq_f32((const float *)ptrs[i], lens[i]);
    return acc;
}

/* The receiver's sums of squares while a payload arrives (swarmtrain/wire/measure.py): for
 * every float range i of the payload at `base` (ranges[4i..4i+3] = start byte, end byte,
 * element size 4 for float32 or 2 for float16, bytes summed so far), out[i] takes the sum of
 * squares of the range's elements below byte hi: up to the last whole BLOCK of elements
 * below hi, or to its end once hi reaches it. Pieces are cut at whole blocks, so out[i] has
 * the bits of st_sumsq_f32 / _f16 over the whole range however the payload arrived. */
void st_sumsq_ranges(const char *base, int64_t *ranges, int64_t count, int64_t hi, double *out) {
    for (int64_t i = 0; i < count; i++) {
        int64_t *r = ranges + 4 * i;
        const int64_t start = r[0], end = r[1], size = r[2], done = r[3];
        int64_t z = end;
        if (hi < end) z = start + (hi - start) / (BLOCK * size) * (BLOCK * size);
        if (z <= done) continue;
        out[i] = size == 2 ? sumsq_f16_acc(out[i], (const _Float16 *)(base + done), (z - done) / 2)
                           : sumsq_f32_acc(out[i], (const float *)(base + done), (z - done) / 4);
        r[3] = z;
    }
}
