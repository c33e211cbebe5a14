/* The small operations between the products of one float32 decode step on the CPU
 * (cpu_fused.py builds this file and says why it exists; lean.py calls it).
 *
 * Each function does in one call what the step otherwise does in a dozen PyTorch calls:
 * an RMS norm with the residual add before it, the rotary embedding with the new key and
 * value written to the cache and attention over the cached positions, and SiLU(gate) * up.
 * Every array is float32 and contiguous; rows are independent of each other.
 *
 * Built with -ffp-contract=off so that an expression rounds as PyTorch's elementwise
 * kernels round it (a product, then a sum: no fused multiply-add); reductions (the norm's
 * mean, the attention's dot products and its softmax sum) run in their own order, so
 * results differ from PyTorch's in the last bits only.  The attention's dot products and
 * weighted sums say fused multiply-add explicitly (fmaf), as a matrix product does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for float32, vectorizable (the loops calling it run `omp simd`): x = n ln2 + r
 * with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial, 2^n put in the exponent
 * bits.  Within 3 ulp of expf over the range used; below -87.3 it returns 0 (the
 * softmax of a masked or far smaller score, SiLU of a large negative gate), above 88.7
 * +inf. */
static inline float exp_simd(float x) {
    const float hi = 88.7f, lo = -87.3f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    /* n = x / ln2 rounded to nearest (even) by adding and taking away 1.5 * 2^23: roundf
     * (ties away from zero) has no vector form, and left every loop calling this scalar */
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693145751953125f;   /* ln2, high part (exact in n * ln2_hi) */
    r = r - n * 1.42860682030941723212e-6f;  /* ln2, low part */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x < lo ? 0.0f : y;
    return x > hi ? INFINITY : y;
}

/* x = h + delta (delta NULL: x = h, and sum is not written; otherwise x is written to
 * sum); out = weight * (x * rsqrt(mean(x^2) + eps)), LlamaRMSNorm's arithmetic in
 * float32.  h is never written: a hook may hold it. */
void millm_add_rms(const float *h, const float *delta, const float *weight, float eps,
                   int64_t rows, int64_t d, float *sum, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = h + r * d;
        float *y = out + r * d;
        if (delta) {
            const float *e = delta + r * d;
            float *z = sum + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) z[i] = x[i] + e[i];
            x = z;
        }
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < d; i++) acc += x[i] * x[i];
        float inv = 1.0f / sqrtf(acc / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) y[i] = weight[i] * (x[i] * inv);
    }
}

/* One row of silu(g) * u.  A function of its own, with restrict pointers: written inline
 * in the OpenMP loop below, GCC left it scalar ("no vectype"), a tenth of the speed. */
static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict y,
                         int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = (g[i] / (1.0f + exp_simd(-g[i]))) * u[i];
}

/* out = silu(gate) * up, with gate and up the two halves of each row of gu. */
void millm_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter;
        silu_mul_row(g, g + inter, out + r * inter, inter);
    }
}

/* o += p * v over hd floats. */
static inline void add_weighted(float *restrict o, float p, const float *restrict v, int64_t hd) {
#pragma omp simd
    for (int64_t i = 0; i < hd; i++) o[i] = __builtin_fmaf(p, v[i], o[i]);
}

/* One head of one row: softmax(q . k_t * scaling) over the positions t < end that mask
 * (NULL: none) leaves, then the weighted sum of the values into o.  Four positions at a
 * time, so that one load of q serves four independent dot products and one pass over o
 * adds four values; a masked position is skipped, never multiplied by its zero weight
 * (its slot may hold anything). */
static void attend(const float *restrict q, const float *restrict keys, const float *restrict values,
                   const uint8_t *mask, int64_t end, int64_t hd, float scaling, float *restrict sc,
                   float *restrict o) {
    float top = -INFINITY;
    int64_t t = 0;
    for (; t + 4 <= end; t += 4) {
        const float *k0 = keys + t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t i = 0; i < hd; i++) {
            a0 = __builtin_fmaf(q[i], k0[i], a0);
            a1 = __builtin_fmaf(q[i], k1[i], a1);
            a2 = __builtin_fmaf(q[i], k2[i], a2);
            a3 = __builtin_fmaf(q[i], k3[i], a3);
        }
        sc[t] = a0 * scaling;
        sc[t + 1] = a1 * scaling;
        sc[t + 2] = a2 * scaling;
        sc[t + 3] = a3 * scaling;
    }
    for (; t < end; t++) {
        const float *k = keys + t * hd;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < hd; i++) a = __builtin_fmaf(q[i], k[i], a);
        sc[t] = a * scaling;
    }
    for (t = 0; t < end; t++) {
        if (mask && mask[t]) sc[t] = -INFINITY;
        else if (sc[t] > top) top = sc[t];
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (t = 0; t < end; t++) {
        float e = exp_simd(sc[t] - top);  /* a masked score (-inf) gives 0 */
        sc[t] = e;
        total += e;
    }
    for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
    for (t = 0; t + 4 <= end; t += 4) {
        if (mask && (mask[t] | mask[t + 1] | mask[t + 2] | mask[t + 3])) {
            for (int64_t u = t; u < t + 4; u++)
                if (!mask[u]) add_weighted(o, sc[u], values + u * hd, hd);
            continue;
        }
        const float p0 = sc[t], p1 = sc[t + 1], p2 = sc[t + 2], p3 = sc[t + 3];
        const float *v0 = values + t * hd, *v1 = v0 + hd, *v2 = v1 + hd, *v3 = v2 + hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) o[i] = __builtin_fmaf(p3, v3[i], __builtin_fmaf(p2, v2[i], __builtin_fmaf(p1, v1[i], __builtin_fmaf(p0, v0[i], o[i]))));
    }
    for (; t < end; t++)
        if (!(mask && mask[t])) add_weighted(o, sc[t], values + t * hd, hd);
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < hd; i++) o[i] = o[i] * inv;
}

/* One layer's attention for one new token per row.
 *
 * qkv: rows x (heads + 2 kv) x hd, the fused q/k/v product (q heads, then k, then v);
 * cos, sin: rotary tables, row p for position p (hd wide; sin with rotate_half's sign
 * folded into its first half, as lean.py builds them); pos: each row's position;
 * k_buf, v_buf: the cache, rows x kv x slots x hd; the new key (rotated) and value go to
 * slot `slot`, and each row attends to slots 0 .. slot except where pad (rows x (slot+1),
 * nonzero = masked; NULL = none) says; scores: scratch of rows x heads x (slot+1);
 * out: rows x heads x hd.  With several rows, the (row, head) pairs are shared out over
 * the calling thread's OpenMP team (PyTorch's own: see cpu_fused.py). */
void millm_attention(const float *qkv, const float *cos_t, const float *sin_t, const int64_t *pos,
                     float *k_buf, float *v_buf, int64_t slots, int64_t slot,
                     const uint8_t *pad, int64_t rows, int64_t heads, int64_t kv, int64_t hd,
                     float scaling, float *scores, float *out) {
    const int64_t half = hd / 2, end = slot + 1, group = heads / kv;
    const int64_t width = (heads + 2 * kv) * hd;
    /* the new keys (rotated) and values into the cache, before any row reads it */
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width;
        const float *c = cos_t + pos[r] * hd;
        const float *s = sin_t + pos[r] * hd;
        for (int64_t g = 0; g < kv; g++) {
            const float *k = row + (heads + g) * hd;
            const float *v = row + (heads + kv + g) * hd;
            float *kd = k_buf + ((r * kv + g) * slots + slot) * hd;
            float *vd = v_buf + ((r * kv + g) * slots + slot) * hd;
            for (int64_t i = 0; i < half; i++) kd[i] = k[i] * c[i] + k[i + half] * s[i];
            for (int64_t i = half; i < hd; i++) kd[i] = k[i] * c[i] + k[i - half] * s[i];
            for (int64_t i = 0; i < hd; i++) vd[i] = v[i];
        }
    }
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t job = 0; job < rows * heads; job++) {
        const int64_t r = job / heads, h = job % heads, g = h / group;
        const float *x = qkv + r * width + h * hd;
        const float *c = cos_t + pos[r] * hd;
        const float *s = sin_t + pos[r] * hd;
        const uint8_t *mask = pad ? pad + r * end : 0;
        float *sc = scores + job * end;
        float q[hd];
        for (int64_t i = 0; i < half; i++) q[i] = x[i] * c[i] + x[i + half] * s[i];
        for (int64_t i = half; i < hd; i++) q[i] = x[i] * c[i] + x[i - half] * s[i];
        const float *keys = k_buf + (r * kv + g) * slots * hd;
        const float *values = v_buf + (r * kv + g) * slots * hd;
        attend(q, keys, values, mask, end, hd, scaling, sc, out + (r * heads + h) * hd);
    }
}
