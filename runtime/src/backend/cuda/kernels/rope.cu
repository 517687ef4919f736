// Rotary position embedding, "rotate-half" convention (GPT-NeoX, Hugging Face LLaMA);
// runtime/src/backend/cpu/kernels/rope.rs is the reference. In place on x (N, width): the first `heads` heads
// of size hd of every row, row n at position n % t. Element i < hd/2 pairs with i + hd/2 and the
// pair turns by dir · pos · θ^(−2i/hd): cos/sin (T, hd/2) fp32 hold those angles' values.
// dir = 1 is the forward; dir = −1 the backward (the transpose rotation of the gradient).
// One thread per pair.

extern "C" __global__ void rope_rotate(bf16* __restrict__ x, const float* __restrict__ cos_t,
                                       const float* __restrict__ sin_t, long long n_rows, int t,
                                       int width, int heads, int hd, float dir) {
    const int half = hd / 2;
    const long long pairs = n_rows * heads * half;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const long long row = p / ((long long)heads * half);
        const int rest = (int)(p % ((long long)heads * half));
        const int head = rest / half;
        const int i = rest % half;
        const long long pos = row % t;
        const float c = cos_t[pos * half + i];
        const float s = dir * sin_t[pos * half + i];
        bf16* h = x + row * width + (long long)head * hd;
        const float a = bf2f(h[i]);
        const float b = bf2f(h[i + half]);
        h[i] = f2bf(a * c - b * s);
        h[i + half] = f2bf(b * c + a * s);
    }
}
