// Causal attention with grouped-query heads, flash-style: K/V tiles in shared memory, an online
// softmax, and no T x T matrix in memory. runtime/src/backend/cpu/kernels/attention.rs is the reference.
//
// Layout (what the fused qkv projection writes): qkv (B, T, W) bf16, W = (hq + 2*hkv)*hd, each
// row [q heads | k heads | v heads]; q head h reads kv head h / (hq / hkv). y (B, T, hq*hd) bf16.
// lse, delta: (B, hq, T) fp32 (log-sum-exp of each score row; rowsum(dy * y)).
//
// Work split (host side: runtime/src/gpu/launch.rs computes grids and shared memory):
// - forward and dq: a block of ATT_WARPS warps owns ATT_BR = ATT_WARPS*ATT_ROWS query rows of
//   one (batch, head); each warp owns ATT_ROWS rows; a key tile has ATT_BC = 32 keys, one per
//   lane for the scores; for the outputs each lane owns dims lane + 32*i (i < ATT_MAXD).
// - dk/dv: a block owns ATT_BR keys of one kv head and loops over that head's q heads and the
//   query tiles at or after its keys, so it writes dk, dv without atomics.
// Shared rows are padded to hd+1 floats (odd stride: lanes reading k_s[lane][d] hit distinct
// banks). hd <= 32*ATT_MAXD = 128.

#define ATT_WARPS 4
#define ATT_ROWS 4
#define ATT_BR (ATT_WARPS * ATT_ROWS)
#define ATT_BC 32
#define ATT_MAXD 4

// Loads `rows` rows of one head (column offset col) starting at token t0 into s (row stride
// ld), zero-filling rows at or past T. All threads of the block take part.
__device__ void load_rows(float* s, const bf16* src, long long row_stride, int col, int t0,
                          int rows, int T, int hd, int ld) {
    for (int idx = threadIdx.x; idx < rows * hd; idx += blockDim.x) {
        const int r = idx / hd;
        const int d = idx % hd;
        const int t = t0 + r;
        s[r * ld + d] = t < T ? bf2f(src[(long long)t * row_stride + col + d]) : 0.0f;
    }
}

extern "C" __global__ void attention_forward(bf16* __restrict__ y, float* __restrict__ lse,
                                             const bf16* __restrict__ qkv, int B, int T, int hq,
                                             int hkv, int hd, float scale) {
    TESSERA_DYNAMIC_SHARED(float, smem);
    const int ld = hd + 1;
    float* q_s = smem;
    float* k_s = q_s + ATT_BR * ld;
    float* v_s = k_s + ATT_BC * ld;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int g = h / (hq / hkv);
    const int q0 = blockIdx.x * ATT_BR;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const bf16* base = qkv + (long long)b * T * W;

    load_rows(q_s, base, W, h * hd, q0, ATT_BR, T, hd, ld);
    float m[ATT_ROWS];
    float l[ATT_ROWS];
    float o[ATT_ROWS][ATT_MAXD];
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        m[rr] = TS_NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++) {
            o[rr][i] = 0.0f;
        }
    }
    const int last_q = (q0 + ATT_BR < T ? q0 + ATT_BR : T) - 1;
    for (int k0 = 0; k0 <= last_q; k0 += ATT_BC) {
        __syncthreads();
        load_rows(k_s, base, W, (hq + g) * hd, k0, ATT_BC, T, hd, ld);
        load_rows(v_s, base, W, (hq + hkv + g) * hd, k0, ATT_BC, T, hd, ld);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ATT_ROWS; rr++) {
            const int r = warp * ATT_ROWS + rr;
            const int qi = q0 + r;
            const int kj = k0 + lane;
            const bool live = qi < T && kj <= qi;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) {
                s += q_s[r * ld + d] * k_s[lane * ld + d];
            }
            s = live ? s * scale : TS_NEG_INF;
            const float m_new = fmaxf(m[rr], warp_max(s));
            const float p = live ? expf(s - m_new) : 0.0f;
            const float corr = m[rr] == TS_NEG_INF ? 0.0f : expf(m[rr] - m_new);
            l[rr] = l[rr] * corr + warp_sum(p);
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++) {
                o[rr][i] *= corr;
            }
            for (int j = 0; j < ATT_BC; j++) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < ATT_MAXD; i++) {
                    const int d = lane + 32 * i;
                    if (d < hd) {
                        o[rr][i] += pj * v_s[j * ld + d];
                    }
                }
            }
            m[rr] = m_new;
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        const int qi = q0 + warp * ATT_ROWS + rr;
        if (qi < T) {
            const float inv = 1.0f / l[rr];
            bf16* yr = y + ((long long)b * T + qi) * hq * hd + (long long)h * hd;
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    yr[d] = f2bf(o[rr][i] * inv);
                }
            }
            if (lane == 0) {
                lse[((long long)b * hq + h) * T + qi] = m[rr] + logf(l[rr]);
            }
        }
    }
}

// delta[b, h, t] = sum_d dy[b, t, h, d] * y[b, t, h, d]; one warp per (b, h, t) row.
extern "C" __global__ void attention_delta(float* __restrict__ delta,
                                           const bf16* __restrict__ dy,
                                           const bf16* __restrict__ y, int B, int T, int hq,
                                           int hd) {
    const long long rows = (long long)B * hq * T;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const long long t = row % T;
    const long long h = (row / T) % hq;
    const long long b = row / ((long long)T * hq);
    const long long off = (b * T + t) * hq * hd + h * hd;
    float acc = 0.0f;
    for (int d = lane; d < hd; d += 32) {
        acc += bf2f(dy[off + d]) * bf2f(y[off + d]);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        delta[row] = acc;
    }
}

// dq for ATT_BR query rows of one (batch, q head); overwrites the q slots of dqkv.
extern "C" __global__ void attention_backward_dq(bf16* __restrict__ dqkv,
                                                 const bf16* __restrict__ dy,
                                                 const bf16* __restrict__ qkv,
                                                 const float* __restrict__ lse,
                                                 const float* __restrict__ delta, int B, int T,
                                                 int hq, int hkv, int hd, float scale) {
    TESSERA_DYNAMIC_SHARED(float, smem);
    const int ld = hd + 1;
    float* q_s = smem;
    float* do_s = q_s + ATT_BR * ld;
    float* k_s = do_s + ATT_BR * ld;
    float* v_s = k_s + ATT_BC * ld;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int g = h / (hq / hkv);
    const int q0 = blockIdx.x * ATT_BR;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const long long Y = (long long)hq * hd;
    const bf16* base = qkv + (long long)b * T * W;

    load_rows(q_s, base, W, h * hd, q0, ATT_BR, T, hd, ld);
    load_rows(do_s, dy + (long long)b * T * Y, Y, h * hd, q0, ATT_BR, T, hd, ld);
    float L[ATT_ROWS];
    float D[ATT_ROWS];
    float dq[ATT_ROWS][ATT_MAXD];
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        const int qi = q0 + warp * ATT_ROWS + rr;
        const long long at = ((long long)b * hq + h) * T + qi;
        L[rr] = qi < T ? lse[at] : 0.0f;
        D[rr] = qi < T ? delta[at] : 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++) {
            dq[rr][i] = 0.0f;
        }
    }
    const int last_q = (q0 + ATT_BR < T ? q0 + ATT_BR : T) - 1;
    for (int k0 = 0; k0 <= last_q; k0 += ATT_BC) {
        __syncthreads();
        load_rows(k_s, base, W, (hq + g) * hd, k0, ATT_BC, T, hd, ld);
        load_rows(v_s, base, W, (hq + hkv + g) * hd, k0, ATT_BC, T, hd, ld);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ATT_ROWS; rr++) {
            const int r = warp * ATT_ROWS + rr;
            const int qi = q0 + r;
            const int kj = k0 + lane;
            const bool live = qi < T && kj <= qi;
            float s = 0.0f;
            float dp = 0.0f;
            for (int d = 0; d < hd; d++) {
                s += q_s[r * ld + d] * k_s[lane * ld + d];
                dp += do_s[r * ld + d] * v_s[lane * ld + d];
            }
            const float p = live ? expf(s * scale - L[rr]) : 0.0f;
            const float ds = p * (dp - D[rr]);
            for (int j = 0; j < ATT_BC; j++) {
                const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                for (int i = 0; i < ATT_MAXD; i++) {
                    const int d = lane + 32 * i;
                    if (d < hd) {
                        dq[rr][i] += dsj * k_s[j * ld + d];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        const int qi = q0 + warp * ATT_ROWS + rr;
        if (qi < T) {
            bf16* out = dqkv + ((long long)b * T + qi) * W + (long long)h * hd;
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    out[d] = f2bf(dq[rr][i] * scale);
                }
            }
        }
    }
}

// dk, dv for ATT_BR keys of one (batch, kv head), summed over the head's q heads; overwrites
// the k and v slots of dqkv.
extern "C" __global__ void attention_backward_dkv(bf16* __restrict__ dqkv,
                                                  const bf16* __restrict__ dy,
                                                  const bf16* __restrict__ qkv,
                                                  const float* __restrict__ lse,
                                                  const float* __restrict__ delta, int B, int T,
                                                  int hq, int hkv, int hd, float scale) {
    TESSERA_DYNAMIC_SHARED(float, smem);
    const int ld = hd + 1;
    float* k_s = smem;
    float* v_s = k_s + ATT_BR * ld;
    float* q_s = v_s + ATT_BR * ld;
    float* do_s = q_s + ATT_BC * ld;
    float* lse_s = do_s + ATT_BC * ld;
    float* dl_s = lse_s + ATT_BC;
    const int b = blockIdx.z;
    const int g = blockIdx.y;
    const int rep = hq / hkv;
    const int k0 = blockIdx.x * ATT_BR;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const long long Y = (long long)hq * hd;
    const bf16* base = qkv + (long long)b * T * W;

    load_rows(k_s, base, W, (hq + g) * hd, k0, ATT_BR, T, hd, ld);
    load_rows(v_s, base, W, (hq + hkv + g) * hd, k0, ATT_BR, T, hd, ld);
    float dk[ATT_ROWS][ATT_MAXD];
    float dv[ATT_ROWS][ATT_MAXD];
#pragma unroll
    for (int kk = 0; kk < ATT_ROWS; kk++) {
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++) {
            dk[kk][i] = 0.0f;
            dv[kk][i] = 0.0f;
        }
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const long long stat = ((long long)b * hq + h) * T;
        for (int t0 = (k0 / ATT_BC) * ATT_BC; t0 < T; t0 += ATT_BC) {
            __syncthreads();
            load_rows(q_s, base, W, h * hd, t0, ATT_BC, T, hd, ld);
            load_rows(do_s, dy + (long long)b * T * Y, Y, h * hd, t0, ATT_BC, T, hd, ld);
            if (threadIdx.x < ATT_BC) {
                const int t = t0 + threadIdx.x;
                lse_s[threadIdx.x] = t < T ? lse[stat + t] : 0.0f;
                dl_s[threadIdx.x] = t < T ? delta[stat + t] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < ATT_ROWS; kk++) {
                const int kr = warp * ATT_ROWS + kk;
                const int kj = k0 + kr;
                const int qi = t0 + lane;
                const bool live = qi < T && kj <= qi;
                float s = 0.0f;
                float dp = 0.0f;
                for (int d = 0; d < hd; d++) {
                    s += q_s[lane * ld + d] * k_s[kr * ld + d];
                    dp += do_s[lane * ld + d] * v_s[kr * ld + d];
                }
                const float p = live ? expf(s * scale - lse_s[lane]) : 0.0f;
                const float ds = p * (dp - dl_s[lane]);
                for (int j = 0; j < ATT_BC; j++) {
                    const float pj = __shfl_sync(0xffffffffu, p, j);
                    const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                    for (int i = 0; i < ATT_MAXD; i++) {
                        const int d = lane + 32 * i;
                        if (d < hd) {
                            dv[kk][i] += pj * do_s[j * ld + d];
                            dk[kk][i] += dsj * q_s[j * ld + d];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < ATT_ROWS; kk++) {
        const int kj = k0 + warp * ATT_ROWS + kk;
        if (kj < T) {
            bf16* row = dqkv + ((long long)b * T + kj) * W;
#pragma unroll
            for (int i = 0; i < ATT_MAXD; i++) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    row[(long long)(hq + g) * hd + d] = f2bf(dk[kk][i] * scale);
                    row[(long long)(hq + hkv + g) * hd + d] = f2bf(dv[kk][i]);
                }
            }
        }
    }
}

// ---- Tensor-core forward (FlashAttention-2 style) ---------------------------------------------
// bf16 `mma.sync.m16n8k16` with fp32 accumulation, through inline PTX (NVRTC needs no header for
// it; the tests' emulator provides the same warp-wide product as `emu::mma_m16n8k16`). Same
// inputs, outputs and log-sum-exp as `attention_forward`; used when hd is a multiple of 16.
// A block of TC_WARPS warps owns TC_BR = 64 query rows of one (batch, head), 16 per warp; key
// tiles of TC_BC = 64 keys, K and V tiles in shared memory as bf16 (row stride hd + 8).
// Fragment layout (PTX ISA, m16n8k16): lane = 4*gid + tig; A (16x16, row-major) a0 = (gid,
// 2tig..+1), a1 = (gid+8, ..), a2 = (gid, 8+2tig..), a3 = (gid+8, 8+..); B (16x8) b0 = (k 2tig..+1,
// n gid), b1 = (k 8+2tig..); C (16x8) c0,c1 = (gid, 2tig..+1), c2,c3 = (gid+8, ..).
#define TC_WARPS 4
#define TC_BR 64
#define TC_BC 64
#define TC_MAXD 128

__device__ __forceinline__ unsigned pack_bf16(bf16 lo, bf16 hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// d (16x8, fp32) += a (16x16, bf16) * b (16x8, bf16), one warp.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
#ifdef TESSERA_EMU
    emu::mma_m16n8k16(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two adjacent bf16 of row `t` (0 past T).
__device__ __forceinline__ unsigned load_pair(const bf16* base, long long W, int col, int t,
                                              int T) {
    if (t >= T) {
        return 0u;
    }
    const bf16* p = base + (long long)t * W + col;
    return pack_bf16(p[0], p[1]);
}

// The A fragments of rows r0 and r0 + 8 of the columns [col, col + 16*ksteps) of a row-major
// (T, W) bf16 matrix, one set per 16-wide k step (0 past T or past ksteps).
__device__ __forceinline__ void load_a_frags(unsigned a[TC_MAXD / 16][4], const bf16* base,
                                             long long W, int col, int r0, int T, int ksteps,
                                             int tig) {
#pragma unroll
    for (int kt = 0; kt < TC_MAXD / 16; kt++) {
        const int c = col + kt * 16 + tig * 2;
        const bool in = kt < ksteps;
        a[kt][0] = in ? load_pair(base, W, c, r0, T) : 0u;
        a[kt][1] = in ? load_pair(base, W, c, r0 + 8, T) : 0u;
        a[kt][2] = in ? load_pair(base, W, c + 8, r0, T) : 0u;
        a[kt][3] = in ? load_pair(base, W, c + 8, r0 + 8, T) : 0u;
    }
}

// Two adjacent 16x8 accumulator tiles (8 columns each) as one 16x16 A operand, in bf16.
__device__ __forceinline__ void c_to_a(unsigned a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_bf16(f2bf(lo[0]), f2bf(lo[1]));
    a[1] = pack_bf16(f2bf(lo[2]), f2bf(lo[3]));
    a[2] = pack_bf16(f2bf(hi[0]), f2bf(hi[1]));
    a[3] = pack_bf16(f2bf(hi[2]), f2bf(hi[3]));
}

// The 64-key K and V tiles from key k0 (columns kcol, vcol of qkv) into shared memory, row
// stride ld, zeros past T. All threads of the block take part.
__device__ void load_kv_tile(bf16* k_s, bf16* v_s, const bf16* base, long long W, int kcol,
                             int vcol, int k0, int T, int hd, int ld) {
    for (int idx = threadIdx.x; idx < TC_BC * hd; idx += blockDim.x) {
        const int r = idx / hd;
        const int d = idx % hd;
        const int t = k0 + r;
        const bf16* row = base + (long long)t * W;
        k_s[r * ld + d] = t < T ? row[kcol + d] : (bf16)0;
        v_s[r * ld + d] = t < T ? row[vcol + d] : (bf16)0;
    }
}

extern "C" __global__ void attention_forward_tc(bf16* __restrict__ y, float* __restrict__ lse,
                                                const bf16* __restrict__ qkv, int B, int T,
                                                int hq, int hkv, int hd, float scale) {
    TESSERA_DYNAMIC_SHARED(bf16, smem_tc);  // (a second extern name: its type differs)
    const int ld = hd + 8;
    bf16* k_s = smem_tc;
    bf16* v_s = k_s + TC_BC * ld;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int g = h / (hq / hkv);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const bf16* base = qkv + (long long)b * T * W;
    const int q0 = blockIdx.x * TC_BR;
    const int r0 = q0 + warp * 16 + gid;
    const int r1 = r0 + 8;
    const int ksteps = hd / 16;
    const int dtiles = hd / 8;

    unsigned qa[TC_MAXD / 16][4];
    load_a_frags(qa, base, W, h * hd, r0, T, ksteps, tig);
    float m0 = TS_NEG_INF, m1 = TS_NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float o[TC_MAXD / 8][4];
#pragma unroll
    for (int dn = 0; dn < TC_MAXD / 8; dn++) {
        o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    }
    const int last_q = (q0 + TC_BR < T ? q0 + TC_BR : T) - 1;
    for (int k0 = 0; k0 <= last_q; k0 += TC_BC) {
        __syncthreads();
        load_kv_tile(k_s, v_s, base, W, (hq + g) * hd, (hq + hkv + g) * hd, k0, T, hd, ld);
        __syncthreads();
        // Scores S (16 rows x 64 keys per warp) = Q K^T, scaled and causally masked.
        float s[TC_BC / 8][4];
        float mx0 = TS_NEG_INF, mx1 = TS_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < TC_BC / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const bf16* kr = k_s + (nt * 8 + gid) * ld + tig * 2;
#pragma unroll
            for (int kt = 0; kt < TC_MAXD / 16; kt++) {
                if (kt < ksteps) {
                    const unsigned kb[2] = {pack_bf16(kr[kt * 16], kr[kt * 16 + 1]),
                                            pack_bf16(kr[kt * 16 + 8], kr[kt * 16 + 9])};
                    mma_bf16_16816(s[nt], qa[kt], kb);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = e < 2 ? r0 : r1;
                const int col = k0 + nt * 8 + tig * 2 + (e & 1);
                const bool live = row < T && col <= row;
                s[nt][e] = live ? s[nt][e] * scale : TS_NEG_INF;
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        // The 4 lanes of a group hold one row pair: reduce across them.
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0);
        const float n1 = fmaxf(m1, mx1);
        const float c0 = m0 == TS_NEG_INF ? 0.0f : expf(m0 - n0);
        const float c1 = m1 == TS_NEG_INF ? 0.0f : expf(m1 - n1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < TC_BC / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float mr = e < 2 ? n0 : n1;
                const float p = s[nt][e] == TS_NEG_INF ? 0.0f : expf(s[nt][e] - mr);
                s[nt][e] = p;
                if (e < 2) {
                    sum0 += p;
                } else {
                    sum1 += p;
                }
            }
        }
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = n0;
        m1 = n1;
#pragma unroll
        for (int dn = 0; dn < TC_MAXD / 8; dn++) {
            o[dn][0] *= c0;
            o[dn][1] *= c0;
            o[dn][2] *= c1;
            o[dn][3] *= c1;
        }
        // O += P V: two score tiles (16 keys) form one A operand.
#pragma unroll
        for (int kk = 0; kk < TC_BC / 16; kk++) {
            unsigned pa[4];
            c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
            const bf16* vr = v_s + (kk * 16 + tig * 2) * ld + gid;
#pragma unroll
            for (int dn = 0; dn < TC_MAXD / 8; dn++) {
                if (dn < dtiles) {
                    const bf16* v = vr + dn * 8;
                    const unsigned vb[2] = {pack_bf16(v[0], v[ld]),
                                            pack_bf16(v[8 * ld], v[9 * ld])};
                    mma_bf16_16816(o[dn], pa, vb);
                }
            }
        }
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int dn = 0; dn < TC_MAXD / 8; dn++) {
        if (dn < dtiles) {
            const int d = h * hd + dn * 8 + tig * 2;
            if (r0 < T) {
                bf16* yr = y + ((long long)b * T + r0) * hq * hd + d;
                yr[0] = f2bf(o[dn][0] * inv0);
                yr[1] = f2bf(o[dn][1] * inv0);
            }
            if (r1 < T) {
                bf16* yr = y + ((long long)b * T + r1) * hq * hd + d;
                yr[0] = f2bf(o[dn][2] * inv1);
                yr[1] = f2bf(o[dn][3] * inv1);
            }
        }
    }
    if (tig == 0) {
        if (r0 < T) {
            lse[((long long)b * hq + h) * T + r0] = m0 + logf(l0);
        }
        if (r1 < T) {
            lse[((long long)b * hq + h) * T + r1] = m1 + logf(l1);
        }
    }
}

// dq on tensor cores: the same tiles as `attention_forward_tc` (64 query rows per block, 16 per
// warp, 64-key bf16 K/V tiles). Per key tile: S = Q K^T (scaled), P = exp(S - lse), dP = dO V^T,
// dS = P (dP - delta), dq += dS K; dq is written scaled, as `attention_backward_dq` writes it.
extern "C" __global__ void attention_backward_dq_tc(bf16* __restrict__ dqkv,
                                                    const bf16* __restrict__ dy,
                                                    const bf16* __restrict__ qkv,
                                                    const float* __restrict__ lse,
                                                    const float* __restrict__ delta, int B,
                                                    int T, int hq, int hkv, int hd,
                                                    float scale) {
    TESSERA_DYNAMIC_SHARED(bf16, smem_dq);
    const int ld = hd + 8;
    bf16* k_s = smem_dq;
    bf16* v_s = k_s + TC_BC * ld;
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int g = h / (hq / hkv);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const long long Wy = (long long)hq * hd;
    const bf16* base = qkv + (long long)b * T * W;
    const bf16* dyb = dy + (long long)b * T * Wy;
    const int q0 = blockIdx.x * TC_BR;
    const int r0 = q0 + warp * 16 + gid;
    const int r1 = r0 + 8;
    const int ksteps = hd / 16;
    const int dtiles = hd / 8;
    const float* lrow = lse + ((long long)b * hq + h) * T;
    const float* drow = delta + ((long long)b * hq + h) * T;
    const float L0 = r0 < T ? lrow[r0] : 0.0f, L1 = r1 < T ? lrow[r1] : 0.0f;
    const float D0 = r0 < T ? drow[r0] : 0.0f, D1 = r1 < T ? drow[r1] : 0.0f;

    unsigned qa[TC_MAXD / 16][4];
    unsigned da[TC_MAXD / 16][4];
    load_a_frags(qa, base, W, h * hd, r0, T, ksteps, tig);
    load_a_frags(da, dyb, Wy, h * hd, r0, T, ksteps, tig);
    float dq[TC_MAXD / 8][4];
#pragma unroll
    for (int dn = 0; dn < TC_MAXD / 8; dn++) {
        dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.0f;
    }
    const int last_q = (q0 + TC_BR < T ? q0 + TC_BR : T) - 1;
    for (int k0 = 0; k0 <= last_q; k0 += TC_BC) {
        __syncthreads();
        load_kv_tile(k_s, v_s, base, W, (hq + g) * hd, (hq + hkv + g) * hd, k0, T, hd, ld);
        __syncthreads();
        float ds[TC_BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < TC_BC / 8; nt++) {
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float dp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const bf16* kr = k_s + (nt * 8 + gid) * ld + tig * 2;
            const bf16* vr = v_s + (nt * 8 + gid) * ld + tig * 2;
#pragma unroll
            for (int kt = 0; kt < TC_MAXD / 16; kt++) {
                if (kt < ksteps) {
                    const unsigned kb[2] = {pack_bf16(kr[kt * 16], kr[kt * 16 + 1]),
                                            pack_bf16(kr[kt * 16 + 8], kr[kt * 16 + 9])};
                    mma_bf16_16816(s, qa[kt], kb);
                    const unsigned vb[2] = {pack_bf16(vr[kt * 16], vr[kt * 16 + 1]),
                                            pack_bf16(vr[kt * 16 + 8], vr[kt * 16 + 9])};
                    mma_bf16_16816(dp, da[kt], vb);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = e < 2 ? r0 : r1;
                const int col = k0 + nt * 8 + tig * 2 + (e & 1);
                const bool live = row < T && col <= row;
                const float p = live ? expf(s[e] * scale - (e < 2 ? L0 : L1)) : 0.0f;
                ds[nt][e] = p * (dp[e] - (e < 2 ? D0 : D1));
            }
        }
        // dq += dS K: two score tiles (16 keys) form one A operand; B[key][d] = K[key][d].
#pragma unroll
        for (int kk = 0; kk < TC_BC / 16; kk++) {
            unsigned pa[4];
            c_to_a(pa, ds[2 * kk], ds[2 * kk + 1]);
            const bf16* kr = k_s + (kk * 16 + tig * 2) * ld + gid;
#pragma unroll
            for (int dn = 0; dn < TC_MAXD / 8; dn++) {
                if (dn < dtiles) {
                    const bf16* k = kr + dn * 8;
                    const unsigned kb[2] = {pack_bf16(k[0], k[ld]),
                                            pack_bf16(k[8 * ld], k[9 * ld])};
                    mma_bf16_16816(dq[dn], pa, kb);
                }
            }
        }
    }
#pragma unroll
    for (int dn = 0; dn < TC_MAXD / 8; dn++) {
        if (dn < dtiles) {
            const int d = h * hd + dn * 8 + tig * 2;
            if (r0 < T) {
                bf16* out = dqkv + ((long long)b * T + r0) * W + d;
                out[0] = f2bf(dq[dn][0] * scale);
                out[1] = f2bf(dq[dn][1] * scale);
            }
            if (r1 < T) {
                bf16* out = dqkv + ((long long)b * T + r1) * W + d;
                out[0] = f2bf(dq[dn][2] * scale);
                out[1] = f2bf(dq[dn][3] * scale);
            }
        }
    }
}

// dk, dv on tensor cores (head size a multiple of 16, at most 128): a block owns 64 keys of one
// (batch, kv head), 16 per warp, with K and V as A operands in registers, and loops over the
// head's q heads and the 64-query tiles at or after its keys (Q, dO tiles in shared memory as
// bf16). Per tile: S^T = K Q^T, P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta);
// dv += P^T dO, dk += dS^T Q. The accumulators cover TC_DKV_MAXD = 64 dims: above that,
// blockIdx.y also picks a 64-dim half (S and dP are computed by both halves' blocks).
// Written as attention_backward_dkv writes it.
#define TC_DKV_MAXD 64

extern "C" __global__ void attention_backward_dkv_tc(bf16* __restrict__ dqkv,
                                                     const bf16* __restrict__ dy,
                                                     const bf16* __restrict__ qkv,
                                                     const float* __restrict__ lse,
                                                     const float* __restrict__ delta, int B,
                                                     int T, int hq, int hkv, int hd,
                                                     float scale) {
    TESSERA_DYNAMIC_SHARED(bf16, smem_dkv);
    const int ld = hd + 8;
    bf16* q_s = smem_dkv;
    bf16* do_s = q_s + TC_BR * ld;
    float* lse_s = (float*)(do_s + TC_BR * ld);
    float* dl_s = lse_s + TC_BR;
    const int b = blockIdx.z;
    const int halves = (hd + TC_DKV_MAXD - 1) / TC_DKV_MAXD;
    const int g = blockIdx.y / halves;
    const int d0 = (blockIdx.y % halves) * TC_DKV_MAXD;
    const int rep = hq / hkv;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const long long W = (long long)(hq + 2 * hkv) * hd;
    const long long Wy = (long long)hq * hd;
    const bf16* base = qkv + (long long)b * T * W;
    const bf16* dyb = dy + (long long)b * T * Wy;
    const int k0 = blockIdx.x * TC_BC;
    const int kr0 = k0 + warp * 16 + gid;
    const int kr1 = kr0 + 8;
    const int ksteps = hd / 16;
    const int dtiles = (hd - d0 < TC_DKV_MAXD ? hd - d0 : TC_DKV_MAXD) / 8;

    unsigned ka[TC_MAXD / 16][4];
    unsigned va[TC_MAXD / 16][4];
    load_a_frags(ka, base, W, (hq + g) * hd, kr0, T, ksteps, tig);
    load_a_frags(va, base, W, (hq + hkv + g) * hd, kr0, T, ksteps, tig);
    float dk[TC_DKV_MAXD / 8][4];
    float dv[TC_DKV_MAXD / 8][4];
#pragma unroll
    for (int dn = 0; dn < TC_DKV_MAXD / 8; dn++) {
        dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = 0.0f;
        dv[dn][0] = dv[dn][1] = dv[dn][2] = dv[dn][3] = 0.0f;
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const long long stat = ((long long)b * hq + h) * T;
        for (int q0 = k0; q0 < T; q0 += TC_BR) {
            __syncthreads();
            for (int idx = threadIdx.x; idx < TC_BR * hd; idx += blockDim.x) {
                const int r = idx / hd;
                const int d = idx % hd;
                const int t = q0 + r;
                q_s[r * ld + d] = t < T ? base[(long long)t * W + h * hd + d] : (bf16)0;
                do_s[r * ld + d] = t < T ? dyb[(long long)t * Wy + h * hd + d] : (bf16)0;
            }
            if (threadIdx.x < TC_BR) {
                const int t = q0 + threadIdx.x;
                lse_s[threadIdx.x] = t < T ? lse[stat + t] : 0.0f;
                dl_s[threadIdx.x] = t < T ? delta[stat + t] : 0.0f;
            }
            __syncthreads();
            float pt[TC_BR / 8][4];
            float dst[TC_BR / 8][4];
#pragma unroll
            for (int nt = 0; nt < TC_BR / 8; nt++) {
                float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                float dp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const bf16* qr = q_s + (nt * 8 + gid) * ld + tig * 2;
                const bf16* dr = do_s + (nt * 8 + gid) * ld + tig * 2;
#pragma unroll
                for (int kt = 0; kt < TC_MAXD / 16; kt++) {
                    if (kt < ksteps) {
                        const unsigned qb[2] = {pack_bf16(qr[kt * 16], qr[kt * 16 + 1]),
                                                pack_bf16(qr[kt * 16 + 8], qr[kt * 16 + 9])};
                        mma_bf16_16816(s, ka[kt], qb);
                        const unsigned db[2] = {pack_bf16(dr[kt * 16], dr[kt * 16 + 1]),
                                                pack_bf16(dr[kt * 16 + 8], dr[kt * 16 + 9])};
                        mma_bf16_16816(dp, va[kt], db);
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = e < 2 ? kr0 : kr1;
                    const int qc = nt * 8 + tig * 2 + (e & 1);
                    const int qi = q0 + qc;
                    const bool live = qi < T && key <= qi;
                    const float p = live ? expf(s[e] * scale - lse_s[qc]) : 0.0f;
                    pt[nt][e] = p;
                    dst[nt][e] = p * (dp[e] - dl_s[qc]);
                }
            }
            // dv += P^T dO and dk += dS^T Q: two tiles (16 queries) form one A operand;
            // B[query][d] = dO[query][d] or Q[query][d].
#pragma unroll
            for (int kk = 0; kk < TC_BR / 16; kk++) {
                unsigned pa[4];
                unsigned sa[4];
                c_to_a(pa, pt[2 * kk], pt[2 * kk + 1]);
                c_to_a(sa, dst[2 * kk], dst[2 * kk + 1]);
                const int qrow = (kk * 16 + tig * 2) * ld + d0 + gid;
#pragma unroll
                for (int dn = 0; dn < TC_DKV_MAXD / 8; dn++) {
                    if (dn < dtiles) {
                        const bf16* o = do_s + qrow + dn * 8;
                        const unsigned ob[2] = {pack_bf16(o[0], o[ld]),
                                                pack_bf16(o[8 * ld], o[9 * ld])};
                        mma_bf16_16816(dv[dn], pa, ob);
                        const bf16* q = q_s + qrow + dn * 8;
                        const unsigned qb[2] = {pack_bf16(q[0], q[ld]),
                                                pack_bf16(q[8 * ld], q[9 * ld])};
                        mma_bf16_16816(dk[dn], sa, qb);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int dn = 0; dn < TC_DKV_MAXD / 8; dn++) {
        if (dn < dtiles) {
            const int d = d0 + dn * 8 + tig * 2;
            if (kr0 < T) {
                bf16* row = dqkv + ((long long)b * T + kr0) * W;
                row[(long long)(hq + g) * hd + d] = f2bf(dk[dn][0] * scale);
                row[(long long)(hq + g) * hd + d + 1] = f2bf(dk[dn][1] * scale);
                row[(long long)(hq + hkv + g) * hd + d] = f2bf(dv[dn][0]);
                row[(long long)(hq + hkv + g) * hd + d + 1] = f2bf(dv[dn][1]);
            }
            if (kr1 < T) {
                bf16* row = dqkv + ((long long)b * T + kr1) * W;
                row[(long long)(hq + g) * hd + d] = f2bf(dk[dn][2] * scale);
                row[(long long)(hq + g) * hd + d + 1] = f2bf(dk[dn][3] * scale);
                row[(long long)(hq + hkv + g) * hd + d] = f2bf(dv[dn][2]);
                row[(long long)(hq + hkv + g) * hd + d + 1] = f2bf(dv[dn][3]);
            }
        }
    }
}
