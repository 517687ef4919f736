// GELU (tanh approximation, as GPT-2) and SwiGLU (as LLaMA); runtime/src/backend/cpu/kernels/act.rs is the
// reference. SwiGLU rows are [gate (F) | up (F)]. Backward OVERWRITES dinp.

#define GELU_S 0.7978845608f
#define GELU_C 0.044715f

extern "C" __global__ void gelu_forward(bf16* __restrict__ out, const bf16* __restrict__ inp,
                                        long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float x = bf2f(inp[i]);
        out[i] = f2bf(0.5f * x * (1.0f + tanhf(GELU_S * (x + GELU_C * x * x * x))));
    }
}

extern "C" __global__ void gelu_backward(bf16* __restrict__ dinp, const bf16* __restrict__ inp,
                                         const bf16* __restrict__ dout, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float x = bf2f(inp[i]);
        const float t = tanhf(GELU_S * (x + GELU_C * x * x * x));
        const float local = 0.5f * (1.0f + t) +
                            0.5f * x * (1.0f - t * t) * GELU_S * (1.0f + 3.0f * GELU_C * x * x);
        dinp[i] = f2bf(local * bf2f(dout[i]));
    }
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
