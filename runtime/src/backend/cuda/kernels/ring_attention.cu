// Ring attention (context parallelism): the block math of one ring step on one rank's share.
// runtime/src/backend/cpu/kernels/ring_attention.rs is the reference, and has the layouts: a
// rank holds rows = 2*chunk tokens of each sequence, qkv (B, rows, (hq + 2*hkv)*hd) bf16; the
// K/V message kv = [K (B, rows, hkv*hd) | V (same)] bf16; the running output o and dq
// (B, rows, hq*hd), lse and delta (B, hq, rows), and the dK/dV message dkv (kv's layout), f32.
// The rank's query chunks have global indices q0, q1 and the message's key chunks k0, k1: query
// chunk qc sees key chunk kc fully when kc < qc, causally (key j <= query i) when kc == qc, and
// not at all when kc > qc.
//
// Simple, not tuned: one warp per row (a query row of one head for the forward and dq, a key
// row of one kv head for dk/dv, which loops over that kv head's query heads and the query rows
// that see it, so nothing is written by two warps and there are no atomics). Each lane owns the
// dims lane + 32*i (i < RING_MAXD); a score is a warp sum over the head. hd <= 32*RING_MAXD.

#define RING_MAXD 4

// 0: the block is skipped; 1: every key is seen; 2: causal.
__device__ __forceinline__ int ring_mask(int qc, int kc) {
    return kc < qc ? 1 : (kc == qc ? 2 : 0);
}

// One head's row into the lanes' registers (zeros past hd).
__device__ __forceinline__ void ring_load(float* x, const bf16* src, int hd, int lane) {
#pragma unroll
    for (int i = 0; i < RING_MAXD; i++) {
        const int d = lane + 32 * i;
        x[i] = d < hd ? bf2f(src[d]) : 0.0f;
    }
}

// Dot product of two rows held as ring_load leaves them; every lane gets it.
__device__ __forceinline__ float ring_dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < RING_MAXD; i++) {
        s += a[i] * b[i];
    }
    return warp_sum(s);
}

// Where the query row of warp `warp` lives, for the warp-per-(b, h, query row r) kernels (the
// forward step and dq), whose warps run (b, h, r) in row-major order.
struct RingQRow {
    long long q;    // its head in qkv
    long long y;    // its head in o, y, dy, dq
    long long lse;  // its entry in lse, delta
    long long kv0;  // sequence b's kv head g (q head h's) at message row 0
    long long kw;   // message row width, hkv * hd
    long long half; // offset of the V half of the message
    int i;          // row within its chunk
    int qc;         // its chunk's global index
};

__device__ __forceinline__ RingQRow ring_q_row(long long warp, int B, int chunk, int hq, int hkv,
                                               int hd, int q0, int q1) {
    const int rows = 2 * chunk;
    const int r = (int)(warp % rows);
    const int h = (int)((warp / rows) % hq);
    const long long b = warp / ((long long)rows * hq);
    RingQRow x;
    x.kw = (long long)hkv * hd;
    x.half = (long long)B * rows * x.kw;
    x.q = (b * rows + r) * (long long)(hq + 2 * hkv) * hd + (long long)h * hd;
    x.y = (b * rows + r) * hq * hd + (long long)h * hd;
    x.lse = (b * hq + h) * rows + r;
    x.kv0 = b * rows * x.kw + (long long)(h / (hq / hkv)) * hd;
    x.i = r % chunk;
    x.qc = r < chunk ? q0 : q1;
    return x;
}

// kv = [K | V] of the rank's own rows, copied out of qkv (n_rows = B * rows).
extern "C" __global__ void ring_pack_kv(bf16* __restrict__ kv, const bf16* __restrict__ qkv,
                                        long long n_rows, int hq, int hkv, int hd) {
    const long long kw = (long long)hkv * hd;
    const long long half = n_rows * kw;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < 2 * half;
         e += (long long)gridDim.x * blockDim.x) {
        const long long part = e / half; // 0: K, 1: V
        const long long j = e % half;
        kv[e] = qkv[(j / kw) * W + (long long)hq * hd + part * kw + j % kw];
    }
}

// dqkv overwritten: each row [dq | dK | dV] from dq and the rank's own dK/dV message.
extern "C" __global__ void ring_unpack(bf16* __restrict__ dqkv, const float* __restrict__ dq,
                                       const float* __restrict__ dkv, long long n_rows, int hq,
                                       int hkv, int hd) {
    const long long qw = (long long)hq * hd;
    const long long kw = (long long)hkv * hd;
    const long long W = qw + 2 * kw;
    const long long half = n_rows * kw;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n_rows * W;
         e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / W;
        const long long col = e % W;
        float v;
        if (col < qw) {
            v = dq[row * qw + col];
        } else if (col < qw + kw) {
            v = dkv[row * kw + col - qw];
        } else {
            v = dkv[half + row * kw + col - qw - kw];
        }
        dqkv[e] = f2bf(v);
    }
}

// One forward step: warp per (b, h, query row r). Each block of the step (key chunk k0, then
// k1, as the CPU) is softmax-normalised over its live keys and merged into the running (o, lse)
// by their log-sum-exps (lse = -inf: the row is empty and takes the block).
extern "C" __global__ void ring_forward_step(float* __restrict__ o, float* __restrict__ lse,
                                             const bf16* __restrict__ qkv,
                                             const bf16* __restrict__ kv, int B, int chunk,
                                             int hq, int hkv, int hd, int q0, int q1, int k0,
                                             int k1, float scale) {
    const long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)B * hq * 2 * chunk) {
        return;
    }
    const RingQRow x = ring_q_row(warp, B, chunk, hq, hkv, hd, q0, q1);
    float q[RING_MAXD];
    ring_load(q, qkv + x.q, hd, lane);
    float* orow = o + x.y;
    float run = lse[x.lse];
    for (int kb = 0; kb < 2; kb++) {
        const int mask = ring_mask(x.qc, kb == 0 ? k0 : k1);
        if (mask == 0) {
            continue;
        }
        const int live = mask == 1 ? chunk : x.i + 1;
        float m = TS_NEG_INF;
        float l = 0.0f;
        float acc[RING_MAXD];
#pragma unroll
        for (int e = 0; e < RING_MAXD; e++) {
            acc[e] = 0.0f;
        }
        for (int j = 0; j < live; j++) {
            const long long at = x.kv0 + (long long)(kb * chunk + j) * x.kw;
            float k[RING_MAXD];
            float v[RING_MAXD];
            ring_load(k, kv + at, hd, lane);
            ring_load(v, kv + x.half + at, hd, lane);
            const float s = ring_dot(q, k) * scale;
            const float m_new = fmaxf(m, s);
            const float corr = m == TS_NEG_INF ? 0.0f : expf(m - m_new);
            const float p = expf(s - m_new);
            l = l * corr + p;
#pragma unroll
            for (int e = 0; e < RING_MAXD; e++) {
                acc[e] = acc[e] * corr + p * v[e];
            }
            m = m_new;
        }
        const float part_lse = m + logf(l);
        const float inv = 1.0f / l;
        if (run == TS_NEG_INF) {
#pragma unroll
            for (int e = 0; e < RING_MAXD; e++) {
                const int d = lane + 32 * e;
                if (d < hd) {
                    orow[d] = acc[e] * inv;
                }
            }
            run = part_lse;
        } else {
            const float mm = fmaxf(run, part_lse);
            const float ea = expf(run - mm);
            const float eb = expf(part_lse - mm);
            const float z = ea + eb;
            const float wa = ea / z;
            const float wb = eb / z;
#pragma unroll
            for (int e = 0; e < RING_MAXD; e++) {
                const int d = lane + 32 * e;
                if (d < hd) {
                    orow[d] = wa * orow[d] + wb * (acc[e] * inv);
                }
            }
            run = mm + logf(z);
        }
    }
    if (lane == 0) {
        lse[x.lse] = run;
    }
}

// dq += scale * sum_j dS[r, j] * k_j for one step: warp per (b, h, query row r), with
// P = exp(scale * q.k - lse) (the final lse) and dS = P * (dy.v - delta).
extern "C" __global__ void ring_backward_dq(float* __restrict__ dq, const bf16* __restrict__ qkv,
                                            const bf16* __restrict__ kv,
                                            const bf16* __restrict__ dy,
                                            const float* __restrict__ lse,
                                            const float* __restrict__ delta, int B, int chunk,
                                            int hq, int hkv, int hd, int q0, int q1, int k0,
                                            int k1, float scale) {
    const long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)B * hq * 2 * chunk) {
        return;
    }
    const RingQRow x = ring_q_row(warp, B, chunk, hq, hkv, hd, q0, q1);
    float q[RING_MAXD];
    float o[RING_MAXD];
    ring_load(q, qkv + x.q, hd, lane);
    ring_load(o, dy + x.y, hd, lane);
    const float L = lse[x.lse];
    const float D = delta[x.lse];
    float acc[RING_MAXD];
#pragma unroll
    for (int e = 0; e < RING_MAXD; e++) {
        acc[e] = 0.0f;
    }
    for (int kb = 0; kb < 2; kb++) {
        const int mask = ring_mask(x.qc, kb == 0 ? k0 : k1);
        if (mask == 0) {
            continue;
        }
        const int live = mask == 1 ? chunk : x.i + 1;
        for (int j = 0; j < live; j++) {
            const long long at = x.kv0 + (long long)(kb * chunk + j) * x.kw;
            float k[RING_MAXD];
            float v[RING_MAXD];
            ring_load(k, kv + at, hd, lane);
            ring_load(v, kv + x.half + at, hd, lane);
            const float p = expf(ring_dot(q, k) * scale - L);
            const float ds = p * (ring_dot(o, v) - D);
#pragma unroll
            for (int e = 0; e < RING_MAXD; e++) {
                acc[e] += ds * k[e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < RING_MAXD; e++) {
        const int d = lane + 32 * e;
        if (d < hd) {
            dq[x.y + d] += scale * acc[e];
        }
    }
}

// dK += scale * sum dS^T q and dV += sum P^T dy for one step: warp per (b, kv head g, key row
// jr of the message), over g's query heads and the query rows that see key jr.
extern "C" __global__ void ring_backward_dkv(float* __restrict__ dkv,
                                             const bf16* __restrict__ qkv,
                                             const bf16* __restrict__ kv,
                                             const bf16* __restrict__ dy,
                                             const float* __restrict__ lse,
                                             const float* __restrict__ delta, int B, int chunk,
                                             int hq, int hkv, int hd, int q0, int q1, int k0,
                                             int k1, float scale) {
    const int rows = 2 * chunk;
    const long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)B * hkv * rows) {
        return;
    }
    const int jr = (int)(warp % rows);
    const int g = (int)((warp / rows) % hkv);
    const long long b = warp / ((long long)rows * hkv);
    const int rep = hq / hkv;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const long long kw = (long long)hkv * hd;
    const long long half = (long long)B * rows * kw;
    const int j = jr % chunk;
    const int kc = jr < chunk ? k0 : k1;
    const long long at = (b * rows + jr) * kw + (long long)g * hd;
    float k[RING_MAXD];
    float v[RING_MAXD];
    ring_load(k, kv + at, hd, lane);
    ring_load(v, kv + half + at, hd, lane);
    float dk[RING_MAXD];
    float dv[RING_MAXD];
#pragma unroll
    for (int e = 0; e < RING_MAXD; e++) {
        dk[e] = 0.0f;
        dv[e] = 0.0f;
    }
    for (int a = 0; a < 2; a++) {
        const int mask = ring_mask(a == 0 ? q0 : q1, kc);
        if (mask == 0) {
            continue;
        }
        const int first = mask == 1 ? 0 : j;
        for (int h = g * rep; h < (g + 1) * rep; h++) {
            for (int i = first; i < chunk; i++) {
                const int r = a * chunk + i;
                float q[RING_MAXD];
                float o[RING_MAXD];
                ring_load(q, qkv + (b * rows + r) * W + (long long)h * hd, hd, lane);
                ring_load(o, dy + (b * rows + r) * hq * hd + (long long)h * hd, hd, lane);
                const long long lat = (b * hq + h) * rows + r;
                const float p = expf(ring_dot(q, k) * scale - lse[lat]);
                const float ds = p * (ring_dot(o, v) - delta[lat]);
#pragma unroll
                for (int e = 0; e < RING_MAXD; e++) {
                    dv[e] += p * o[e];
                    dk[e] += ds * q[e];
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < RING_MAXD; e++) {
        const int d = lane + 32 * e;
        if (d < hd) {
            dkv[at + d] += scale * dk[e];
            dkv[half + at + d] += dv[e];
        }
    }
}
