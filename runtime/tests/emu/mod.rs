//! The CUDA kernels run on the CPU: `runtime/src/cuda/kernels/*.cu` compiled with the host C++
//! compiler against `shim.h` (threads as CUDA threads, barriers, emulated warp shuffles), behind
//! the same [`Launcher`] trait the real backend implements. GEMMs go through
//! `gpu::gemm::gemm_ex_reference` (what cublasGemmEx computes for the column-major arguments).
//!
//! So the host code of the backend (argument order, geometry, bf16 conversions, multi-kernel
//! sequences) and the kernels' arithmetic are checked in CI. Not checked: NVRTC accepting the
//! source, the cudarc calls, real GPU memory semantics and speed.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tessera_runtime::gpu::gemm::{gemm_ex_reference, ColMajorGemm};
use tessera_runtime::gpu::kernels::{self, Module, Param};
use tessera_runtime::gpu::{
    bf16, DType, Geometry, GpuError, GpuKernels, HostData, HostVec, KArg, Launcher,
};

/// A device buffer of the emulator: bytes on the host.
pub struct EmuBuf {
    dtype: DType,
    bytes: RefCell<Vec<u8>>,
}

pub struct EmuLauncher {
    exe: PathBuf,
}

fn c_type(p: &Param) -> &'static str {
    match p {
        Param::Ptr {
            elem: DType::Bf16, ..
        } => "(bf16*)",
        Param::Ptr {
            elem: DType::F32, ..
        } => "(float*)",
        Param::Ptr {
            elem: DType::U32, ..
        } => "(unsigned int*)",
        Param::I32 => "(int)",
        Param::I64 => "(long long)",
        Param::F32 => "",
    }
}

fn program() -> String {
    let mut src = String::new();
    src += include_str!("shim.h");
    src += kernels::COMMON;
    for m in kernels::MODULES {
        src += &format!("\n// ---- {}.cu ----\n{}", m.name, m.source);
    }
    src += "\n#include <cstdio>\n#include <cstdlib>\n#include <string>\nstruct Arg { void* p; long long i; float f; };\n";
    src += "static void dispatch(const std::string& k, emu_uint3 g, emu_uint3 b, unsigned s, std::vector<Arg>& a) {\n";
    for m in kernels::MODULES {
        for sig in kernels::signatures(m.source).expect("kernel sources parse") {
            let args: Vec<String> = sig
                .params
                .iter()
                .enumerate()
                .map(|(i, (p, _))| match p {
                    Param::Ptr { .. } => format!("{}a[{i}].p", c_type(p)),
                    Param::F32 => format!("a[{i}].f"),
                    _ => format!("{}a[{i}].i", c_type(p)),
                })
                .collect();
            src += &format!(
                "  if (k == \"{n}\") {{ emu::run(g, b, s, [&] {{ {n}({}); }}); return; }}\n",
                args.join(", "),
                n = sig.name
            );
        }
    }
    src += "  fprintf(stderr, \"unknown kernel %s\\n\", k.c_str()); exit(3);\n}\n";
    src += r#"
int main() {
    char name[128];
    emu_uint3 g, b;
    unsigned s;
    size_t nb, na;
    if (scanf("%127s %u %u %u %u %u %u %u %zu", name, &g.x, &g.y, &g.z, &b.x, &b.y, &b.z, &s, &nb) != 9) return 4;
    std::vector<std::vector<unsigned char>> bufs(nb);
    for (auto& buf : bufs) {
        size_t len;
        if (scanf("%zu", &len) != 1 || getchar() != '\n') return 5;
        buf.resize(len + 1);
        if (fread(buf.data(), 1, len, stdin) != len) return 6;
        buf.resize(len);
    }
    if (scanf("%zu", &na) != 1) return 7;
    std::vector<Arg> args(na);
    for (auto& a : args) {
        char kind[2];
        long long v = 0;
        a = Arg{nullptr, 0, 0.0f};
        if (scanf("%1s", kind) != 1) return 8;
        if (kind[0] == 'n') continue;
        if (scanf("%lld", &v) != 1) return 9;
        if (kind[0] == 'b') a.p = bufs[v].data();
        if (kind[0] == 'i') a.i = v;
        if (kind[0] == 'f') { unsigned u = (unsigned)v; std::memcpy(&a.f, &u, 4); }
    }
    dispatch(name, g, b, s, args);
    for (auto& buf : bufs) fwrite(buf.data(), 1, buf.size(), stdout);
    return 0;
}
"#;
    src
}

fn build(dir: &Path) -> Result<PathBuf, String> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let probe = Command::new(&compiler).arg("--version").output();
    if !matches!(&probe, Ok(o) if o.status.success()) {
        return Err(format!("no C++ compiler `{compiler}` (set CXX)"));
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let src = dir.join(format!("emu-{}.cpp", std::process::id()));
    let exe = dir.join(format!("emu-{}", std::process::id()));
    std::fs::write(&src, program()).map_err(|e| e.to_string())?;
    let out = Command::new(&compiler)
        .args([
            "-std=c++20",
            "-O1",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        // The kernels failing to compile as C++ is a real failure, not a skip.
        panic!(
            "the kernel sources do not compile in the emulator ({compiler}):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(exe)
}

/// The emulator, compiled once per test process; `Err(reason)` when there is no C++ compiler.
pub fn kernels() -> Result<GpuKernels<EmuLauncher>, String> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let exe = EXE
        .get_or_init(|| build(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-emu")))
        .clone()?;
    Ok(GpuKernels::new(EmuLauncher { exe }))
}

fn le_bytes(data: HostData<'_>) -> (DType, Vec<u8>) {
    match data {
        HostData::Bf16(v) => (
            DType::Bf16,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        HostData::F32(v) => (DType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::U32(v) => (DType::U32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

fn read_elem(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::Bf16 => bf16::to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        DType::U32 => panic!("gemm on a u32 buffer"),
    }
}

fn write_elem(dtype: DType, bytes: &mut [u8], i: usize, v: f32) {
    match dtype {
        DType::Bf16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        DType::U32 => panic!("gemm on a u32 buffer"),
    }
}

impl Launcher for EmuLauncher {
    type Buf = EmuBuf;

    fn describe(&self) -> String {
        "CUDA kernels emulated on the CPU (bf16 storage)".into()
    }

    fn max_shared_bytes(&self) -> u32 {
        227 * 1024
    }

    fn dtype(buf: &EmuBuf) -> DType {
        buf.dtype
    }

    fn len(buf: &EmuBuf) -> usize {
        buf.bytes.borrow().len() / buf.dtype.size()
    }

    fn alloc_zeros(&self, dtype: DType, len: usize) -> Result<EmuBuf, GpuError> {
        Ok(EmuBuf {
            dtype,
            bytes: RefCell::new(vec![0; len * dtype.size()]),
        })
    }

    fn upload(&self, data: HostData<'_>) -> Result<EmuBuf, GpuError> {
        let (dtype, bytes) = le_bytes(data);
        Ok(EmuBuf {
            dtype,
            bytes: RefCell::new(bytes),
        })
    }

    fn download(&self, buf: &EmuBuf) -> Result<HostVec, GpuError> {
        let b = buf.bytes.borrow();
        Ok(match buf.dtype {
            DType::Bf16 => HostVec::Bf16(
                b.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::F32 => HostVec::F32(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
            DType::U32 => HostVec::U32(
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
        })
    }

    fn launch(
        &self,
        _module: &'static Module,
        function: &'static str,
        g: &Geometry,
        args: &[KArg<'_, EmuBuf>],
    ) -> Result<(), GpuError> {
        let mut bufs: Vec<&EmuBuf> = Vec::new();
        let mut arg_text = String::new();
        for a in args {
            match a {
                KArg::Buf(b) => {
                    let i = bufs
                        .iter()
                        .position(|x| std::ptr::eq(*x, *b))
                        .unwrap_or_else(|| {
                            bufs.push(b);
                            bufs.len() - 1
                        });
                    arg_text += &format!("b {i}\n");
                }
                KArg::Null => arg_text += "n\n",
                KArg::I32(x) => arg_text += &format!("i {x}\n"),
                KArg::I64(x) => arg_text += &format!("i {x}\n"),
                KArg::F32(x) => arg_text += &format!("f {}\n", x.to_bits()),
            }
        }
        let mut input = format!(
            "{function} {} {} {} {} {} {} {} {}\n",
            g.grid.0,
            g.grid.1,
            g.grid.2,
            g.block.0,
            g.block.1,
            g.block.2,
            g.shared_bytes,
            bufs.len()
        )
        .into_bytes();
        for b in &bufs {
            let bytes = b.bytes.borrow();
            input.extend_from_slice(format!("{}\n", bytes.len()).as_bytes());
            input.extend_from_slice(&bytes);
        }
        input.extend_from_slice(format!("{}\n{arg_text}", args.len()).as_bytes());
        let mut child = Command::new(&self.exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| GpuError::Driver {
                op: "emulator".into(),
                message: e.to_string(),
            })?;
        let mut stdin = child.stdin.take().unwrap();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let mut stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            stdout.read_to_end(&mut out).map(|_| out)
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                child.kill().ok();
                child.wait().ok();
                // A deadlock here means a barrier or shuffle that not every thread reaches.
                panic!("{function}: the emulated launch did not finish in 120 s (barrier or shuffle not reached by every thread?)");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        writer.join().unwrap().ok();
        let out = reader.join().unwrap().unwrap();
        if !status.success() {
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).ok();
            panic!("{function}: emulator exited with {status}: {err}");
        }
        let mut at = 0;
        for b in bufs {
            let mut bytes = b.bytes.borrow_mut();
            let n = bytes.len();
            bytes.copy_from_slice(&out[at..at + n]);
            at += n;
        }
        assert_eq!(at, out.len(), "{function}: emulator output size");
        Ok(())
    }

    fn gemm(
        &self,
        g: &ColMajorGemm,
        first: &EmuBuf,
        second: &EmuBuf,
        c: &mut EmuBuf,
        alpha: f32,
        beta: f32,
    ) -> Result<(), GpuError> {
        assert_eq!(
            (first.dtype, second.dtype),
            (DType::Bf16, DType::Bf16),
            "gemm inputs are bf16"
        );
        let (fa, sa) = (first.bytes.borrow(), second.bytes.borrow());
        let mut cb = c.bytes.borrow_mut();
        let ct = c.dtype;
        gemm_ex_reference(
            g,
            alpha,
            &|i| read_elem(DType::Bf16, &fa, i),
            &|i| read_elem(DType::Bf16, &sa, i),
            beta,
            &mut |i, v| {
                if let Some(v) = v {
                    write_elem(ct, &mut cb, i, v);
                }
                read_elem(ct, &cb, i)
            },
        );
        Ok(())
    }

    fn gemm_bias(
        &self,
        g: &ColMajorGemm,
        first: &EmuBuf,
        second: &EmuBuf,
        c: &mut EmuBuf,
        bias: &EmuBuf,
    ) -> Result<(), GpuError> {
        // cuBLASLt's bias epilogue adds in f32 before the bf16 output is rounded.
        let (fa, sa, bb) = (
            first.bytes.borrow(),
            second.bytes.borrow(),
            bias.bytes.borrow(),
        );
        let mut cb = c.bytes.borrow_mut();
        let ldc = g.ldc as usize;
        gemm_ex_reference(
            g,
            1.0,
            &|i| read_elem(DType::Bf16, &fa, i),
            &|i| read_elem(DType::Bf16, &sa, i),
            0.0,
            &mut |i, v| {
                if let Some(v) = v {
                    write_elem(
                        DType::Bf16,
                        &mut cb,
                        i,
                        v + read_elem(DType::Bf16, &bb, i % ldc),
                    );
                }
                read_elem(DType::Bf16, &cb, i)
            },
        );
        Ok(())
    }
}
