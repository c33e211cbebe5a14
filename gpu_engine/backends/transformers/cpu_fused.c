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
 * results differ from PyTorch's in the last bits only.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for float32, vectorizable (the loops calling it run `omp simd`): x = n ln2 + r
 * with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial, 2^n put in the exponent
 * bits.  Within 2 ulp of expf over the range used; below -87.3 it returns 0 (the
 * softmax of a masked or far smaller score, SiLU of a large negative gate), above 88.7
 * +inf. */
static inline float exp_simd(float x) {
    const float hi = 88.7f, lo = -87.3f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    float n = __builtin_roundf(xc * 1.44269504088896341f);
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

/* out = silu(gate) * up, with gate and up the two halves of each row of gu. */
void millm_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter;
        const float *u = g + inter;
        float *y = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) y[i] = (g[i] / (1.0f + exp_simd(-g[i]))) * u[i];
    }
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
        float top = -INFINITY;
        for (int64_t t = 0; t < end; t++) {
            if (mask && mask[t]) {
                sc[t] = -INFINITY;
                continue;
            }
            const float *k = keys + t * hd;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < hd; i++) acc += q[i] * k[i];
            acc = acc * scaling;
            sc[t] = acc;
            if (acc > top) top = acc;
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < end; t++) {
            float e = exp_simd(sc[t] - top);  /* a masked score (-inf) gives 0 */
            sc[t] = e;
            total += e;
        }
        float *o = out + (r * heads + h) * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
        for (int64_t t = 0; t < end; t++) {
            const float p = sc[t] / total;
            if (p == 0.0f) continue;
            const float *v = values + t * hd;
#pragma omp simd
            for (int64_t i = 0; i < hd; i++) o[i] = o[i] + p * v[i];
        }
    }
}
