// LayerNorm and RMSNorm over the last dimension C (runtime/src/backend/cpu/kernels/norm.rs is the reference).
// inp, out, dinp, dout: (N, C) bf16; mean, rstd: (N) fp32; weight, bias: (C) bf16.
// One block per row for the row kernels (grid.x = N). Backward ACCUMULATES into dinp (the
// residual gradient may be pre-loaded there). Parameter gradients are reduced without atomics:
// `*_param_grads` writes one fp32 partial per chunk of rows (grid.y = chunks), then
// `sum_partials` (reduce.cu) adds the chunks in order, so results are deterministic.

// One row of LayerNorm (one block), shared by layernorm_forward and
// residual_layernorm_forward.
__device__ void layernorm_row(bf16* __restrict__ out, float* __restrict__ mean,
                              float* __restrict__ rstd, const bf16* __restrict__ inp,
                              const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                              long long row, int c, float eps, float* scratch) {
    const bf16* x = inp + row * c;
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        s += bf2f(x[i]);
    }
    const float mu = block_sum(s, scratch) / c;
    float v = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float d = bf2f(x[i]) - mu;
        v += d * d;
    }
    const float rs = rsqrtf(block_sum(v, scratch) / c + eps);
    bf16* o = out + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float y = (bf2f(x[i]) - mu) * rs * bf2f(weight[i]);
        if (bias != 0) {
            y += bf2f(bias[i]);
        }
        o[i] = f2bf(y);
    }
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

extern "C" __global__ void layernorm_forward(bf16* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd,
                                             const bf16* __restrict__ inp,
                                             const bf16* __restrict__ weight,
                                             const bf16* __restrict__ bias, long long n_rows,
                                             int c, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    layernorm_row(out, mean, rstd, inp, weight, bias, row, c, eps, scratch);
}

// The residual connection before a norm, in place: x (row) = x + proj_bias (when non-null)
// + res, each add rounded to bf16 as add_bias and add_inplace_bf16 round it. Each thread
// writes the elements it later reads back (the norm's loops stride alike), and block_sum's
// barrier orders the rest.
__device__ void residual_row(bf16* __restrict__ x, const bf16* __restrict__ res,
                             const bf16* __restrict__ proj_bias, long long row, int c) {
    bf16* xr = x + row * c;
    const bf16* rr = res + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float v = bf2f(xr[i]);
        if (proj_bias != 0) {
            v = bf2f(f2bf(v + bf2f(proj_bias[i])));
        }
        xr[i] = f2bf(v + bf2f(rr[i]));
    }
}

// A projection's bias, the residual add and the next LayerNorm in one launch (instead of
// add_bias + add_inplace_bf16 + layernorm_forward): x (N, C) = x + proj_bias + res in place
// (the block's residual stream), then out, mean, rstd = LayerNorm(x). Bit for bit the three
// kernels' results.
extern "C" __global__ void residual_layernorm_forward(
    bf16* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
    bf16* __restrict__ x, const bf16* __restrict__ res, const bf16* __restrict__ proj_bias,
    const bf16* __restrict__ weight, const bf16* __restrict__ bias, long long n_rows, int c,
    float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    residual_row(x, res, proj_bias, row, c);
    layernorm_row(out, mean, rstd, x, weight, bias, row, c, eps, scratch);
}

// dinp += rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)).
extern "C" __global__ void layernorm_backward(bf16* __restrict__ dinp,
                                              const bf16* __restrict__ dout,
                                              const bf16* __restrict__ inp,
                                              const bf16* __restrict__ weight,
                                              const float* __restrict__ mean,
                                              const float* __restrict__ rstd, long long n_rows,
                                              int c) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const float mu = mean[row];
    const float rs = rstd[row];
    const bf16* x = inp + row * c;
    const bf16* dy = dout + row * c;
    float g = 0.0f;
    float gx = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float wdy = bf2f(weight[i]) * bf2f(dy[i]);
        g += wdy;
        gx += wdy * (bf2f(x[i]) - mu) * rs;
    }
    const float g_mean = block_sum(g, scratch) / c;
    const float gx_mean = block_sum(gx, scratch) / c;
    bf16* dx = dinp + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float xh = (bf2f(x[i]) - mu) * rs;
        const float d = rs * (bf2f(weight[i]) * bf2f(dy[i]) - g_mean - xh * gx_mean);
        dx[i] = f2bf(bf2f(dx[i]) + d);
    }
}

// partial (chunks, 2, C): [sum dy*xhat | sum dy] over rows [chunk*rpc, (chunk+1)*rpc).
// grid: (ceil(C / blockDim.x), chunks).
extern "C" __global__ void layernorm_param_grads(float* __restrict__ partial,
                                                 const bf16* __restrict__ dout,
                                                 const bf16* __restrict__ inp,
                                                 const float* __restrict__ mean,
                                                 const float* __restrict__ rstd,
                                                 long long n_rows, int c,
                                                 long long rows_per_chunk) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) {
        return;
    }
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float dw = 0.0f;
    float db = 0.0f;
    for (long long r = r0; r < r1; r++) {
        const float dy = bf2f(dout[r * c + ch]);
        dw += dy * (bf2f(inp[r * c + ch]) - mean[r]) * rstd[r];
        db += dy;
    }
    partial[(chunk * 2) * c + ch] = dw;
    partial[(chunk * 2 + 1) * c + ch] = db;
}

// One row of RMSNorm (one block), shared by rmsnorm_forward and residual_rmsnorm_forward.
__device__ void rmsnorm_row(bf16* __restrict__ out, float* __restrict__ rstd,
                            const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                            long long row, int c, float eps, float* scratch) {
    const bf16* x = inp + row * c;
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float v = bf2f(x[i]);
        s += v * v;
    }
    const float rs = rsqrtf(block_sum(s, scratch) / c + eps);
    bf16* o = out + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        o[i] = f2bf(bf2f(x[i]) * rs * bf2f(weight[i]));
    }
    if (threadIdx.x == 0) {
        rstd[row] = rs;
    }
}

extern "C" __global__ void rmsnorm_forward(bf16* __restrict__ out, float* __restrict__ rstd,
                                           const bf16* __restrict__ inp,
                                           const bf16* __restrict__ weight, long long n_rows,
                                           int c, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    rmsnorm_row(out, rstd, inp, weight, row, c, eps, scratch);
}

// residual_layernorm_forward's RMSNorm twin: x = x + proj_bias (when non-null) + res in place,
// then out, rstd = RMSNorm(x).
extern "C" __global__ void residual_rmsnorm_forward(bf16* __restrict__ out,
                                                    float* __restrict__ rstd,
                                                    bf16* __restrict__ x,
                                                    const bf16* __restrict__ res,
                                                    const bf16* __restrict__ proj_bias,
                                                    const bf16* __restrict__ weight,
                                                    long long n_rows, int c, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    residual_row(x, res, proj_bias, row, c);
    rmsnorm_row(out, rstd, x, weight, row, c, eps, scratch);
}

// dinp += rstd*w*dy - rstd^3 * x * mean(w*dy*x).
extern "C" __global__ void rmsnorm_backward(bf16* __restrict__ dinp,
                                            const bf16* __restrict__ dout,
                                            const bf16* __restrict__ inp,
                                            const bf16* __restrict__ weight,
                                            const float* __restrict__ rstd, long long n_rows,
                                            int c) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const float rs = rstd[row];
    const bf16* x = inp + row * c;
    const bf16* dy = dout + row * c;
    float gx = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        gx += bf2f(weight[i]) * bf2f(dy[i]) * bf2f(x[i]);
    }
    const float k = rs * rs * rs * (block_sum(gx, scratch) / c);
    bf16* dx = dinp + row * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float d = rs * bf2f(weight[i]) * bf2f(dy[i]) - k * bf2f(x[i]);
        dx[i] = f2bf(bf2f(dx[i]) + d);
    }
}

// partial (chunks, C): sum dy*x*rstd over the chunk's rows.
extern "C" __global__ void rmsnorm_param_grads(float* __restrict__ partial,
                                               const bf16* __restrict__ dout,
                                               const bf16* __restrict__ inp,
                                               const float* __restrict__ rstd,
                                               long long n_rows, int c,
                                               long long rows_per_chunk) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) {
        return;
    }
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float dw = 0.0f;
    for (long long r = r0; r < r1; r++) {
        dw += bf2f(dout[r * c + ch]) * bf2f(inp[r * c + ch]) * rstd[r];
    }
    partial[chunk * c + ch] = dw;
}
