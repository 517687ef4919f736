// Small helpers of the linear layers and of the executor: partial-sum reduction, bias add and
// reduce, the squared norm, fill, copy and the in-place add.

// dst[i] += sum_k partial[k*stride + offset + i], chunks k in order (deterministic).
extern "C" __global__ void sum_partials(float* __restrict__ dst,
                                        const float* __restrict__ partial, int chunks,
                                        long long len, long long stride, long long offset) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < chunks; k++) {
            acc += partial[k * stride + offset + i];
        }
        dst[i] += acc;
    }
}

// partial (chunks, C): column sums of x (N, C) over each chunk of rows. Bias backward.
extern "C" __global__ void column_sums(float* __restrict__ partial, const bf16* __restrict__ x,
                                       long long n_rows, int c, long long rows_per_chunk) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) {
        return;
    }
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float acc = 0.0f;
    for (long long r = r0; r < r1; r++) {
        acc += bf2f(x[r * c + ch]);
    }
    partial[chunk * c + ch] = acc;
}

// out (N, C) += bias (C).
extern "C" __global__ void add_bias(bf16* __restrict__ out, const bf16* __restrict__ bias,
                                    long long n_rows, int c) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f2bf(bf2f(out[i]) + bf2f(bias[i % c]));
    }
}

// partial[k] = sum of x[i]^2 over chunk k of `per_chunk` elements, summed in order by one
// thread per chunk (grid-stride over chunks; deterministic); the host adds the partials in order, in f64. The squared
// norm of the gradients, for global-norm clipping.
extern "C" __global__ void sum_squares(float* __restrict__ partial, const float* __restrict__ x,
                                       long long n, long long per_chunk, long long chunks) {
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < chunks;
         k += (long long)gridDim.x * blockDim.x) {
        const long long i0 = k * per_chunk;
        const long long i1 = i0 + per_chunk < n ? i0 + per_chunk : n;
        float acc = 0.0f;
        for (long long i = i0; i < i1; i++) {
            acc += x[i] * x[i];
        }
        partial[k] = acc;
    }
}

// Buffer primitives of the device executor: fill, copy (same dtype, or f32 into bf16) and the
// in-place add.
extern "C" __global__ void fill_f32(float* __restrict__ x, long long n, float value) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = value;
    }
}

extern "C" __global__ void fill_bf16(bf16* __restrict__ x, long long n, float value) {
    const bf16 v = f2bf(value);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = v;
    }
}

extern "C" __global__ void copy_f32(float* __restrict__ dst, const float* __restrict__ src,
                                    long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void copy_bf16(bf16* __restrict__ dst, const bf16* __restrict__ src,
                                     long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

// dst (bf16) = src (f32), rounded to nearest even: an f32 accumulator into activation storage
// (ring attention's running output into y).
extern "C" __global__ void copy_f32_to_bf16(bf16* __restrict__ dst,
                                            const float* __restrict__ src, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = f2bf(src[i]);
    }
}

// x (N) *= s, bf16 storage, fp32 arithmetic (a LoRA adapter's scaling of its intermediate).
extern "C" __global__ void scale_bf16(bf16* __restrict__ x, long long n, float s) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = f2bf(bf2f(x[i]) * s);
    }
}

// a (N) += b, bf16 storage, fp32 arithmetic (the residual connection in place).
extern "C" __global__ void add_inplace_bf16(bf16* __restrict__ a, const bf16* __restrict__ b,
                                            long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        a[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
    }
}
