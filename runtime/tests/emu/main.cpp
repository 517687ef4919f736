// The emulator's command loop (appended to shim.h, the kernels and `dispatch` by emu/mod.rs):
// one process holds every buffer ("device memory" keyed by id) and reads commands on stdin:
// A id bytes (allocate, zeroed) | W id bytes <data> | R id off len (reply: len, data) | F id |
// L kernel grid block shared nargs <args> (reply: ok) | G ... (a cublasGemmEx, reply: ok).
#include <csignal>
#include <map>
#include <unistd.h>
int main() {
    std::map<unsigned long long, std::vector<unsigned char>> mem;
    char op[2];
    while (scanf("%1s", op) == 1) {
        unsigned long long id;
        size_t n;
        if (op[0] == 'A') {
            if (scanf("%llu %zu", &id, &n) != 2) return 4;
            mem[id].assign(n, 0);
        } else if (op[0] == 'W') {
            if (scanf("%llu %zu", &id, &n) != 2 || getchar() != '\n') return 5;
            auto& b = mem.at(id);
            if (n != b.size() || fread(b.data(), 1, n, stdin) != n) return 6;
        } else if (op[0] == 'R') {
            size_t off, len;
            if (scanf("%llu %zu %zu", &id, &off, &len) != 3) return 7;
            auto& b = mem.at(id);
            if (off > b.size()) return 14;
            if (len > b.size() - off) len = b.size() - off;
            printf("%zu\n", len);
            fwrite(b.data() + off, 1, len, stdout);
            fflush(stdout);
        } else if (op[0] == 'G') {
            // cublasGemmEx, column-major: C = alpha op(A) op(B) + beta C, f32 accumulation in
            // order over k; A, B bf16; C bf16 (cdt 0) or f32 (cdt 1). Offsets in bytes.
            int ta, tb, m, n, k, lda, ldb, ldc, cdt;
            unsigned ab, bb;
            unsigned long long fid, sid, cid;
            size_t fo, so, co;
            if (scanf("%d %d %d %d %d %d %d %d %u %u %llu %zu %llu %zu %llu %zu %d", &ta, &tb, &m, &n,
                      &k, &lda, &ldb, &ldc, &ab, &bb, &fid, &fo, &sid, &so, &cid, &co, &cdt) != 17)
                return 15;
            float alpha, beta;
            std::memcpy(&alpha, &ab, 4);
            std::memcpy(&beta, &bb, 4);
            const bf16* A = (const bf16*)(mem.at(fid).data() + fo);
            const bf16* B = (const bf16*)(mem.at(sid).data() + so);
            unsigned char* C = mem.at(cid).data() + co;
            for (int j = 0; j < n; j++) {
                for (int i = 0; i < m; i++) {
                    float acc = 0.0f;
                    for (int l = 0; l < k; l++) {
                        const float a = bf2f(ta ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda]);
                        const float b = bf2f(tb ? B[j + (size_t)l * ldb] : B[l + (size_t)j * ldb]);
                        acc += a * b;
                    }
                    const size_t at = i + (size_t)j * ldc;
                    if (cdt == 1) {
                        float* c = (float*)C;
                        const float old = beta != 0.0f ? c[at] : 0.0f;
                        c[at] = alpha * acc + beta * old;
                    } else {
                        bf16* c = (bf16*)C;
                        const float old = beta != 0.0f ? bf2f(c[at]) : 0.0f;
                        c[at] = f2bf(alpha * acc + beta * old);
                    }
                }
            }
            printf("ok\n");
            fflush(stdout);
        } else if (op[0] == 'F') {
            if (scanf("%llu", &id) != 1) return 8;
            mem.erase(id);
        } else if (op[0] == 'L') {
            char name[128];
            emu_uint3 g, b;
            unsigned s;
            size_t na;
            if (scanf("%127s %u %u %u %u %u %u %u %zu", name, &g.x, &g.y, &g.z, &b.x, &b.y, &b.z, &s, &na) != 9) return 9;
            std::vector<Arg> args(na);
            for (auto& a : args) {
                char kind[2];
                long long v = 0;
                a = Arg{nullptr, 0, 0.0f};
                if (scanf("%1s", kind) != 1) return 10;
                if (kind[0] == 'n') continue;
                if (scanf("%lld", &v) != 1) return 11;
                if (kind[0] == 'b') {
                    size_t off;
                    if (scanf("%zu", &off) != 1) return 12;
                    auto& buf = mem.at((unsigned long long)v);
                    if (off > buf.size()) return 13;
                    a.p = buf.data() + off;
                }
                if (kind[0] == 'i') a.i = v;
                if (kind[0] == 'f') { unsigned u = (unsigned)v; std::memcpy(&a.f, &u, 4); }
            }
            alarm(120);
            dispatch(name, g, b, s, args);
            alarm(0);
            printf("ok\n");
            fflush(stdout);
        } else {
            return 3;
        }
    }
    return 0;
}
