//! The runtime's import rule, checked on its sources (docs/cuda.md, "Where the GPU code lives"):
//! no module imports from a module above it.
//!
//! Layers, bottom up: `rng`, `comm` (communicators, backend-independent) → `backend` (the
//! `Backend`/`Collective` traits, `backend/cpu`, `backend/cuda`) → `layers`, `optim`, `params`
//! → `exec`. Everything GPU lives in `backend/cuda/`; inside it the parts built without the
//! `cuda` feature (`host/`, `kernels/`) never reach for the cudarc parts (launcher, probe,
//! compile, NCCL, the `cuda-local` carrier).
//!
//! Comments are skipped (a doc line may name any path); everything else counts, `use` lines and
//! paths written inline alike.

use std::path::{Path, PathBuf};

/// The code of every .rs file under `runtime/src/<dir>`, comments removed, with its path
/// relative to `runtime/src`.
fn sources(dir: &str) -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.join(dir)];
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            entries.sort();
            stack.extend(entries);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            let rel = p
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            out.push((rel, code_of(&text)));
        }
    }
    assert!(!out.is_empty(), "no sources under runtime/src/{dir}");
    out
}

/// `text` without its line comments (`//`, `///`, `//!`) and with its string literals emptied
/// (a message may name anything; a `//` in a string is no comment). Strings may span lines.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut in_str = false;
    let mut raw = false; // in an r#"…"# literal
    for line in text.lines() {
        let chars: Vec<char> = line.chars().collect();
        let mut prev = '\0';
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if raw {
                if c == '"' && chars.get(i + 1) == Some(&'#') {
                    raw = false;
                    code.push_str("\"#");
                    i += 1;
                }
                i += 1;
                continue;
            }
            if c == 'r' && chars.get(i + 1) == Some(&'#') && chars.get(i + 2) == Some(&'"') {
                raw = true;
                code.push_str("r#\"");
                i += 3;
                continue;
            }
            if in_str {
                if c == '"' && prev != '\\' {
                    in_str = false;
                    code.push(c);
                }
                // an escaped backslash does not escape what follows it
                prev = if c == '\\' && prev == '\\' { '\0' } else { c };
                i += 1;
                continue;
            }
            if c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && !(prev == '\'' && chars.get(i + 1) == Some(&'\'')) {
                in_str = true;
            }
            code.push(c);
            prev = c;
            i += 1;
        }
        code.push('\n');
    }
    code
}

/// The (file, line, needle) of every forbidden path in `files`, leaving out the files `allow`
/// accepts.
fn violations(
    files: &[(String, String)],
    forbidden: &[&str],
    allow: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut found = Vec::new();
    for (path, code) in files {
        if allow(path) {
            continue;
        }
        for (n, line) in code.lines().enumerate() {
            for needle in forbidden {
                if line.contains(needle) {
                    found.push(format!(
                        "runtime/src/{path}:{}: `{needle}` in `{}`",
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    found
}

fn assert_none(rule: &str, found: Vec<String>) {
    assert!(
        found.is_empty(),
        "{rule}; found:\n  {}\n(see docs/cuda.md, \"Where the GPU code lives\")",
        found.join("\n  ")
    );
}

#[test]
fn gpu_code_lives_only_in_backend_cuda() {
    let all = sources("");
    assert_none(
        "only runtime/src/backend/cuda/ may name the CUDA backend or cudarc (and session/gpu.rs, the top, the backend's types)",
        violations(&all, &["backend::cuda", "cudarc", "half::"], |p| {
            p.starts_with("backend/cuda/") || p == "session/gpu.rs"
        }),
    );
}

#[test]
fn comm_does_not_import_the_backends_above_it() {
    assert_none(
        "comm/ is below the backends: it must not import crate::backend (nor exec, layers)",
        violations(
            &sources("comm"),
            &["crate::backend", "crate::exec", "crate::layers", "cudarc"],
            |_| false,
        ),
    );
}

#[test]
fn exec_sees_only_the_backend_traits() {
    assert_none(
        "exec/ sees the backends only through crate::backend's traits (and the Cpu it defaults to)",
        violations(
            &sources("exec"),
            &[
                "backend::cuda",
                "backend::ops",
                "backend::bf16",
                "cudarc",
                "Device<",
            ],
            |_| false,
        ),
    );
}

/// Issue 42: every plan the CPU runs, the device runs, so the layers and the executor call no
/// CPU kernel directly: each goes through the `Backend` (whose CPU implementation calls it).
/// Test files (`*_tests.rs`) may.
#[test]
fn layers_and_exec_call_no_cpu_kernel() {
    let mut files = sources("layers");
    files.extend(sources("exec"));
    assert_none(
        "layers/ and exec/ reach the CPU kernels only through the Backend trait",
        violations(&files, &["backend::cpu", "cpu::"], |p| {
            p.ends_with("_tests.rs") || p.ends_with("/tests.rs")
        }),
    );
}

#[test]
fn the_backends_do_not_import_the_layers_above_them() {
    assert_none(
        "backend/ is below layers, exec, checkpoint, data, hf and launch",
        violations(
            &sources("backend"),
            &[
                "crate::exec",
                "crate::layers",
                "crate::checkpoint",
                "crate::data",
                "crate::hf",
                "crate::launch",
                "crate::params",
                "crate::calibrate",
                "crate::comm_parity",
                "crate::optim",
            ],
            |_| false,
        ),
    );
}

#[test]
fn the_backend_traits_do_not_import_a_backend() {
    // backend/mod.rs declares `pub mod cuda;` (not a path: `cuda::` is) and re-exports the CPU
    // backend; the traits, their types, the error and the host-slice surface name neither
    // backend's internals.
    let files: Vec<_> = sources("backend")
        .into_iter()
        .filter(|(p, _)| !p.starts_with("backend/cuda/") && !p.starts_with("backend/cpu/"))
        .collect();
    assert_none(
        "backend/{mod,ops,error,bf16}.rs must not import backend/cuda",
        violations(&files, &["cuda::", "super::cuda"], |_| false),
    );
    assert_none(
        "backend/cpu must not import backend/cuda",
        violations(&sources("backend/cpu"), &["cuda::"], |_| false),
    );
}

#[test]
fn the_host_side_builds_without_the_cuda_parts() {
    // host/ and kernels/ (but kernels/compile.rs, NVRTC) build without the `cuda` feature:
    // they must not name the feature-gated parts of backend/cuda.
    let files: Vec<_> = sources("backend/cuda")
        .into_iter()
        .filter(|(p, _)| {
            p.starts_with("backend/cuda/host/")
                || (p.starts_with("backend/cuda/kernels/") && !p.ends_with("/compile.rs"))
        })
        .collect();
    assert_none(
        "backend/cuda/{host,kernels} must not use cudarc or the gated launcher, probe, compile, nccl, local, doctor",
        violations(
            &files,
            &[
                "cudarc",
                "half::",
                "cuda::launcher",
                "cuda::probe",
                "kernels::compile",
                "cuda::nccl",
                "cuda::local",
                "cuda::doctor",
                "cuda::standin",
                "CudaLauncher",
                "CudaBuf",
                "super::super",
            ],
            |_| false,
        ),
    );
}

#[test]
fn code_of_drops_comments_and_string_contents() {
    assert_eq!(code_of("use a; // crate::backend::cuda"), "use a; \n");
    assert_eq!(code_of("//! crate::backend::cuda"), "\n");
    assert_eq!(code_of(r#"let u = "http://x"; // y"#), "let u = \"\"; \n");
    assert_eq!(
        code_of("f(\"cudarc\n  more\", '\"');\ng()"),
        "f(\"\n\", '\"');\ng()\n"
    );
    assert_eq!(code_of(r#"e("a \" b // c"); d"#), "e(\"\"); d\n");
    assert_eq!(code_of("x(r#\"a\"b\n\"c\"#); y"), "x(r#\"\n\"#); y\n");
}
