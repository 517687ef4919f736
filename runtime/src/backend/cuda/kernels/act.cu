// GELU (tanh approximation, as GPT-2) and SwiGLU (as LLaMA); runtime/src/backend/cpu/kernels/act.rs
// is the reference. SwiGLU rows are [gate (F) | up (F)]. Backward OVERWRITES dinp. Also the
// element-wise work fused around them: a bias before GELU (and its gradient after GELU's
// backward), a projection's bias with the residual add.

#define GELU_S 0.7978845608f
#define GELU_C 0.044715f

__device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_S * (x + GELU_C * x * x * x)));
}

// d gelu(x) / dx.
__device__ __forceinline__ float gelu_grad(float x) {
    const float t = tanhf(GELU_S * (x + GELU_C * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * GELU_C * x * x);
}

extern "C" __global__ void gelu_forward(bf16* __restrict__ out, const bf16* __restrict__ inp,
                                        long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(gelu_f(bf2f(inp[i])));
    }
}

extern "C" __global__ void gelu_backward(bf16* __restrict__ dinp, const bf16* __restrict__ inp,
                                         const bf16* __restrict__ dout, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dinp[i] = f2bf(gelu_grad(bf2f(inp[i])) * bf2f(dout[i]));
    }
}

// The fc layer's bias and GELU in one pass (one launch instead of add_bias + gelu_forward):
// h (N, C) += bias, rounded to bf16 and kept for the backward, then out = gelu(h). The same
// roundings as the two kernels, so the result is bit for bit theirs.
extern "C" __global__ void bias_gelu_forward(bf16* __restrict__ out, bf16* __restrict__ h,
                                             const bf16* __restrict__ bias, long long n_rows,
                                             int c) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const bf16 hb = f2bf(bf2f(h[i]) + bf2f(bias[i % c]));
        h[i] = hb;
        out[i] = f2bf(gelu_f(bf2f(hb)));
    }
}

// A projection's bias and the residual add in one pass (instead of add_bias +
// add_inplace_bf16): y (N, C) = y + bias, rounded to bf16, + res, rounded again, as the two.
extern "C" __global__ void add_bias_residual(bf16* __restrict__ y, const bf16* __restrict__ res,
                                             const bf16* __restrict__ bias, long long n_rows,
                                             int c) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = bf2f(f2bf(bf2f(y[i]) + bf2f(bias[i % c])));
        y[i] = f2bf(v + bf2f(res[i]));
    }
}

// GELU's backward and the fc bias's column sums in one pass (instead of gelu_backward +
// column_sums): dinp (N, C) = gelu'(inp) * dout (overwritten), and partial (chunks, C) = the
// column sums of dinp (as rounded to bf16) over each chunk of rows, rows in order, as
// column_sums adds them; sum_partials (reduce.cu) then adds the chunks in order.
// grid: (ceil(C / blockDim.x), chunks).
extern "C" __global__ void gelu_backward_bias(bf16* __restrict__ dinp,
                                              float* __restrict__ partial,
                                              const bf16* __restrict__ inp,
                                              const bf16* __restrict__ dout, long long n_rows,
                                              int c, long long rows_per_chunk) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) {
        return;
    }
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float acc = 0.0f;
    for (long long r = r0; r < r1; r++) {
        const long long i = r * c + ch;
        const bf16 d = f2bf(gelu_grad(bf2f(inp[i])) * bf2f(dout[i]));
        dinp[i] = d;
        acc += bf2f(d);
    }
    partial[chunk * c + ch] = acc;
}

// out (N, F) = silu(gate) * up, inp (N, 2F).
extern "C" __global__ void swiglu_forward(bf16* __restrict__ out, const bf16* __restrict__ inp,
                                          long long n_rows, int f) {
    const long long total = n_rows * f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / f;
        const long long j = i % f;
        const float g = bf2f(inp[row * 2 * f + j]);
        const float u = bf2f(inp[row * 2 * f + f + j]);
        const float s = 1.0f / (1.0f + expf(-g));
        out[i] = f2bf(g * s * u);
    }
}

// dinp (N, 2F) = [d gate | d up] from dout (N, F).
extern "C" __global__ void swiglu_backward(bf16* __restrict__ dinp,
                                           const bf16* __restrict__ inp,
                                           const bf16* __restrict__ dout, long long n_rows,
                                           int f) {
    const long long total = n_rows * f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / f;
        const long long j = i % f;
        const float g = bf2f(inp[row * 2 * f + j]);
        const float u = bf2f(inp[row * 2 * f + f + j]);
        const float dy = bf2f(dout[i]);
        const float s = 1.0f / (1.0f + expf(-g));
        dinp[row * 2 * f + j] = f2bf(dy * u * s * (1.0f + g * (1.0f - s)));
        dinp[row * 2 * f + f + j] = f2bf(dy * g * s);
    }
}
