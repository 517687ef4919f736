// Token and position embeddings (runtime/src/cpu/embedding.rs is the reference).
// out: (N, C) bf16; tokens: (N) u32; wte: (V_local, C) bf16 rows vocab_start.. of the vocab.
// Backward accumulates into fp32 gradient tables.

// out[n] = wte[tokens[n] - vocab_start], or zeros when the token is in another shard.
extern "C" __global__ void embedding_forward(bf16* __restrict__ out,
                                             const unsigned int* __restrict__ tokens,
                                             const bf16* __restrict__ wte, long long n_rows,
                                             int c, long long vocab_start, long long v_local) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / c;
        const long long r = (long long)tokens[n] - vocab_start;
        out[i] = (r >= 0 && r < v_local) ? wte[r * c + (i % c)] : (bf16)0;
    }
}

// out[row] += wpe[(first + row) % t]; out: (rows, C), the rows `first..` of the B*T tokens
// (first = 0, or a sequence-parallel rank's first row).
extern "C" __global__ void pos_embedding_forward(bf16* __restrict__ out,
                                                 const bf16* __restrict__ wpe, long long n_rows,
                                                 int t, int c, long long first) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long pos = (first + i / c) % t;
        out[i] = f2bf(bf2f(out[i]) + bf2f(wpe[pos * c + (i % c)]));
    }
}

// dwte[tokens[n] - vocab_start] += dout[n] for tokens in this shard. One thread per channel,
// rows in order: deterministic (no atomics), the same order as the CPU kernel.
extern "C" __global__ void embedding_backward(float* __restrict__ dwte,
                                              const unsigned int* __restrict__ tokens,
                                              const bf16* __restrict__ dout, long long n_rows,
                                              int c, long long vocab_start, long long v_local) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) {
        return;
    }
    for (long long n = 0; n < n_rows; n++) {
        const long long r = (long long)tokens[n] - vocab_start;
        if (r >= 0 && r < v_local) {
            dwte[r * c + ch] += bf2f(dout[n * c + ch]);
        }
    }
}

// dwpe[t] += sum_b dout[b, t], batches in order. One thread per (t, channel).
extern "C" __global__ void pos_embedding_backward(float* __restrict__ dwpe,
                                                  const bf16* __restrict__ dout,
                                                  long long n_rows, int t, int c) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * c) {
        return;
    }
    const long long pos = i / c;
    const long long ch = i % c;
    float acc = 0.0f;
    for (long long row = pos; row < n_rows; row += t) {
        acc += bf2f(dout[row * c + ch]);
    }
    dwpe[i] += acc;
}
