//! The CUDA kernels run on the CPU: `runtime/src/backend/cuda/kernels/*.cu` compiled with the host C++
//! compiler against `shim.h` (threads as CUDA threads, barriers, emulated warp shuffles), behind
//! the same [`Launcher`] trait the real backend implements. GEMMs go through
//! `backend::cuda::gemm::gemm_ex_reference` (what cublasGemmEx computes for the column-major arguments).
//!
//! One emulator process per launcher, started once: it holds every buffer (a "device memory"
//! keyed by id) and reads commands on stdin — allocate, write, read, free, launch — so a launch
//! moves no buffer contents, only its arguments (buffer ids with byte offsets, scalars).
//!
//! So the host code of the backend (argument order, geometry, bf16 conversions, multi-kernel
//! sequences) and the kernels' arithmetic are checked in CI. Not checked: NVRTC accepting the
//! source, the cudarc calls, real GPU memory semantics and speed.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

use tessera_runtime::backend::bf16;
use tessera_runtime::backend::cuda::gemm::{gemm_ex_reference, ColMajorGemm};
use tessera_runtime::backend::cuda::kernels::{self, Module, Param};
use tessera_runtime::backend::cuda::{
    DType, Geometry, GpuError, GpuKernels, HostData, HostVec, KArg, Launcher,
};

mod fp8;

/// The running emulator and its pipes.
struct Process {
    child: Child,
    stdin: BufWriter<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    next_id: u64,
    /// Bytes of the buffers alive now, and the most alive at once since the start: the device
    /// memory this emulated device holds.
    live: usize,
    peak: usize,
}

impl Process {
    fn send(&mut self, header: &str, payload: &[u8]) {
        let ok = self
            .stdin
            .write_all(header.as_bytes())
            .and_then(|_| self.stdin.write_all(payload))
            .and_then(|_| self.stdin.flush());
        if ok.is_err() {
            self.died(header);
        }
    }

    /// One reply line (`ok`, or a byte count).
    fn line(&mut self, what: &str) -> String {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(n) if n > 0 => line.trim().to_string(),
            _ => self.died(what),
        }
    }

    fn died(&mut self, what: &str) -> ! {
        let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
        let mut err = String::new();
        if let Some(e) = self.child.stderr.as_mut() {
            e.read_to_string(&mut err).ok();
        }
        // SIGALRM after 120 s means a barrier or shuffle that not every thread reaches.
        panic!(
            "emulator died during `{}` ({status}; a timeout means a barrier or shuffle not reached by every thread): {err}",
            what.trim()
        );
    }

    fn read(&mut self, id: u64) -> Vec<u8> {
        self.read_range(id, 0, u64::MAX as usize)
    }

    /// `len` bytes from byte `off` (to the end when `len` is past it).
    fn read_range(&mut self, id: u64, off: usize, len: usize) -> Vec<u8> {
        self.send(&format!("R {id} {off} {len}\n"), &[]);
        let n: usize = self
            .line("read")
            .parse()
            .unwrap_or_else(|_| self.died("read"));
        let mut bytes = vec![0; n];
        if self.stdout.read_exact(&mut bytes).is_err() {
            self.died("read");
        }
        bytes
    }

    fn write(&mut self, id: u64, bytes: &[u8]) {
        self.send(&format!("W {id} {}\n", bytes.len()), bytes);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A device buffer of the emulator: an id in its process.
pub struct EmuBuf {
    id: u64,
    dtype: DType,
    len: usize,
    process: Arc<Mutex<Process>>,
}

impl Drop for EmuBuf {
    fn drop(&mut self) {
        if let Ok(mut p) = self.process.lock() {
            p.live -= self.len * self.dtype.size();
            let header = format!("F {}\n", self.id);
            p.stdin.write_all(header.as_bytes()).ok();
        }
    }
}

#[derive(Clone)]
pub struct EmuLauncher {
    process: Arc<Mutex<Process>>,
}

impl EmuLauncher {
    fn start(exe: &Path) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the emulator {}: {e}", exe.display()))?;
        let stdin = BufWriter::new(child.stdin.take().expect("piped stdin"));
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Ok(EmuLauncher {
            process: Arc::new(Mutex::new(Process {
                child,
                stdin,
                stdout,
                next_id: 0,
                live: 0,
                peak: 0,
            })),
        })
    }

    fn process(&self) -> std::sync::MutexGuard<'_, Process> {
        self.process.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most bytes of device memory allocated at once since the emulator started.
    pub fn peak_device_bytes(&self) -> usize {
        self.process().peak
    }

    fn new_buf(&self, dtype: DType, bytes: &[u8]) -> EmuBuf {
        let mut p = self.process();
        let id = p.next_id;
        p.next_id += 1;
        p.live += bytes.len();
        p.peak = p.peak.max(p.live);
        p.send(&format!("A {id} {}\n", bytes.len()), &[]);
        if bytes.iter().any(|&b| b != 0) {
            p.write(id, bytes);
        }
        EmuBuf {
            id,
            dtype,
            len: bytes.len() / dtype.size(),
            process: self.process.clone(),
        }
    }
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
    let all: String = std::iter::once(kernels::COMMON)
        .chain(kernels::MODULES.iter().map(|m| m.source))
        .collect();
    let sync_helpers = sync_helpers(&all);
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
            let runner = if needs_sync(m.source, &sig.name, &sync_helpers) {
                "run"
            } else {
                "run_serial"
            };
            src += &format!(
                "  if (k == \"{n}\") {{ emu::{runner}(g, b, s, [&] {{ {n}({}); }}); return; }}\n",
                args.join(", "),
                n = sig.name
            );
        }
    }
    src += "  fprintf(stderr, \"unknown kernel %s\\n\", k.c_str()); exit(3);\n}\n";
    src += include_str!("main.cpp");
    src
}

/// What makes a kernel need its threads to run together: barriers, shuffles, shared memory.
const SYNC: &[&str] = &[
    "__syncthreads",
    "__shfl",
    "__shared__",
    "TESSERA_DYNAMIC_SHARED",
];

/// The body of function `name` in `source` (from its parameter list to its closing brace).
fn body<'a>(source: &'a str, name: &str) -> Option<&'a str> {
    let at = source.find(&format!(" {name}("))?;
    let open = at + source[at..].find('{')?;
    let mut depth = 0;
    for (i, ch) in source[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&source[open..open + i + 1]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The `__device__` helpers that synchronise, directly or through another helper.
fn sync_helpers(source: &str) -> Vec<String> {
    let helpers: Vec<&str> = source
        .split("__device__")
        .skip(1)
        .filter_map(|rest| {
            let head = &rest[..rest.find('(')?];
            head.split_whitespace().last()
        })
        .collect();
    let mut found: Vec<String> = Vec::new();
    loop {
        let before = found.len();
        for h in &helpers {
            let Some(b) = body(source, h) else { continue };
            let syncs = SYNC.iter().any(|t| b.contains(t))
                || found.iter().any(|f| b.contains(&format!("{f}(")));
            if syncs && !found.iter().any(|f| f == h) {
                found.push(h.to_string());
            }
        }
        if found.len() == before {
            return found;
        }
    }
}

/// Whether kernel `name` must run its threads as fibers (else one after another).
fn needs_sync(source: &str, name: &str, helpers: &[String]) -> bool {
    let Some(b) = body(source, name) else {
        return true;
    };
    SYNC.iter().any(|t| b.contains(t)) || helpers.iter().any(|h| b.contains(&format!("{h}(")))
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
            // Fibers switch stacks with _longjmp, which the fortified longjmp would refuse.
            "-U_FORTIFY_SOURCE",
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
    Ok(GpuKernels::new(launcher()?))
}

/// A launcher on a new emulator process, or `None` with the reason the test skips printed
/// (there is no C++ compiler to build the emulator).
pub fn or_skip() -> Option<EmuLauncher> {
    match launcher() {
        Ok(l) => Some(l),
        Err(why) => {
            eprintln!("SKIPPED: the CUDA kernel emulator is not available: {why}");
            None
        }
    }
}

/// A launcher on a new emulator process (compiled once per test process).
pub fn launcher() -> Result<EmuLauncher, String> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let exe = EXE
        .get_or_init(|| build(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-emu")))
        .clone()?;
    EmuLauncher::start(&exe)
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

/// With `TESSERA_EMU_PROFILE` set, one stderr line per launch: `EMUPROF name µs size`.
fn profile(name: &str, t0: std::time::Instant, size: impl std::fmt::Display) {
    if std::env::var_os("TESSERA_EMU_PROFILE").is_some() {
        eprintln!("EMUPROF {name} {} {size}", t0.elapsed().as_micros());
    }
}

fn decode(dtype: DType, b: &[u8]) -> HostVec {
    match dtype {
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
        buf.len
    }

    fn alloc_zeros(&self, dtype: DType, len: usize) -> Result<EmuBuf, GpuError> {
        Ok(self.new_buf(dtype, &vec![0; len * dtype.size()]))
    }

    fn upload(&self, data: HostData<'_>) -> Result<EmuBuf, GpuError> {
        let (dtype, bytes) = le_bytes(data);
        Ok(self.new_buf(dtype, &bytes))
    }

    fn download(&self, buf: &EmuBuf) -> Result<HostVec, GpuError> {
        let b = self.process().read(buf.id);
        Ok(decode(buf.dtype, &b))
    }

    fn launch(
        &self,
        _module: &'static Module,
        function: &'static str,
        g: &Geometry,
        args: &[KArg<'_, EmuBuf>],
    ) -> Result<(), GpuError> {
        let mut text = format!(
            "L {function} {} {} {} {} {} {} {} {}\n",
            g.grid.0,
            g.grid.1,
            g.grid.2,
            g.block.0,
            g.block.1,
            g.block.2,
            g.shared_bytes,
            args.len()
        );
        for a in args {
            text += &match a {
                KArg::Buf(b) => format!("b {} 0\n", b.id),
                KArg::At(b, at) => format!("b {} {}\n", b.id, at * b.dtype.size()),
                KArg::Null => "n\n".into(),
                KArg::I32(x) => format!("i {x}\n"),
                KArg::I64(x) => format!("i {x}\n"),
                KArg::F32(x) => format!("f {}\n", x.to_bits()),
            };
        }
        let mut p = self.process();
        let t0 = std::time::Instant::now();
        p.send(&text, &[]);
        if p.line(function) != "ok" {
            p.died(function);
        }
        profile(function, t0, g.grid.0 * g.grid.1 * g.grid.2 * g.block.0);
        Ok(())
    }

    fn gemm(
        &self,
        g: &ColMajorGemm,
        (first, fo): (&EmuBuf, usize),
        (second, so): (&EmuBuf, usize),
        (c, co): (&EmuBuf, usize),
        alpha: f32,
        beta: f32,
    ) -> Result<(), GpuError> {
        assert_eq!(
            (first.dtype, second.dtype),
            (DType::Bf16, DType::Bf16),
            "gemm inputs are bf16"
        );
        let cdt = match c.dtype {
            DType::Bf16 => 0,
            DType::F32 => 1,
            DType::U32 => panic!("gemm into a u32 buffer"),
        };
        let text = format!(
            "G {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {cdt}\n",
            u8::from(g.trans_first),
            u8::from(g.trans_second),
            g.m,
            g.n,
            g.k,
            g.ld_first,
            g.ld_second,
            g.ldc,
            alpha.to_bits(),
            beta.to_bits(),
            first.id,
            fo * 2,
            second.id,
            so * 2,
            c.id,
            co * c.dtype.size(),
        );
        let mut p = self.process();
        let t0 = std::time::Instant::now();
        p.send(&text, &[]);
        if p.line("gemm") != "ok" {
            p.died("gemm");
        }
        profile("gemm", t0, g.m * g.n * g.k);
        Ok(())
    }

    fn gemm_fp8(
        &self,
        g: &ColMajorGemm,
        first: &EmuBuf,
        first_scale: (&EmuBuf, usize),
        second: &EmuBuf,
        second_scale: (&EmuBuf, usize),
        c: &EmuBuf,
    ) -> Result<(), GpuError> {
        fp8::gemm_fp8(self, g, first, first_scale, second, second_scale, c)
    }

    fn download_range(
        &self,
        buf: &EmuBuf,
        range: std::ops::Range<usize>,
    ) -> Result<HostVec, GpuError> {
        assert!(
            range.start <= range.end && range.end <= buf.len,
            "download range"
        );
        let size = buf.dtype.size();
        let b = self
            .process()
            .read_range(buf.id, range.start * size, range.len() * size);
        Ok(decode(buf.dtype, &b))
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
        let mut p = self.process();
        let (fa, sa, bb) = (p.read(first.id), p.read(second.id), p.read(bias.id));
        let mut cb = p.read(c.id);
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
        p.write(c.id, &cb);
        Ok(())
    }
}
