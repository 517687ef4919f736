//! The CUDA C kernel modules (the `*.cu` files of this folder, compiled into the binary with
//! `include_str!`), their signatures read back from the source, and the compile cache key.
//!
//! NVRTC compiles a module the first time a device uses it. The PTX is cached in memory per
//! (module, architecture, source hash) by the backend, and on disk here ([`DiskCache`]) so the
//! next process skips the compile. The key hashes the exact program text and the compile
//! options, so an edited kernel or a new option never loads a stale PTX.
//!
//! Signatures are parsed from the source so that every launch is checked against the kernel's
//! real parameter list before it reaches the driver (a wrong argument count is undefined
//! behaviour on the GPU, and an error here).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bf16 stored as its 16-bit pattern.
    Bf16,
    F32,
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::U32 => 4,
        }
    }
}

/// Helpers prepended to every module.
pub const COMMON: &str = include_str!("common.cuh");

/// One .cu file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
}

/// Every kernel module of the backend.
pub const MODULES: &[Module] = &[
    Module {
        name: "embedding",
        source: include_str!("embedding.cu"),
    },
    Module {
        name: "norm",
        source: include_str!("norm.cu"),
    },
    Module {
        name: "reduce",
        source: include_str!("reduce.cu"),
    },
    Module {
        name: "act",
        source: include_str!("act.cu"),
    },
    Module {
        name: "crossentropy",
        source: include_str!("crossentropy.cu"),
    },
    Module {
        name: "attention",
        source: include_str!("attention.cu"),
    },
    Module {
        name: "adamw",
        source: include_str!("adamw.cu"),
    },
    Module {
        name: "rope",
        source: include_str!("rope.cu"),
    },
    Module {
        name: "ring_attention",
        source: include_str!("ring_attention.cu"),
    },
    Module {
        name: "fp8",
        source: include_str!("fp8.cu"),
    },
];

/// The module called `name`.
pub fn module(name: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.name == name)
}

impl Module {
    /// The text NVRTC compiles: the common helpers, then the module.
    pub fn program(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu ----\n{}", self.name, self.source)
    }
}

/// One kernel parameter's kind, as the launch must pass it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A device pointer to elements of `elem` (null allowed where the kernel checks for it).
    Ptr {
        elem: DType,
        constant: bool,
    },
    I32,
    I64,
    F32,
}

/// A kernel's name and parameters, in order, with their names from the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    pub name: String,
    pub params: Vec<(Param, String)>,
}

fn parse_param(text: &str) -> Result<(Param, String), String> {
    let text = text.replace("__restrict__", " ");
    let split = text
        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
        .ok_or_else(|| format!("parameter `{}` has no type", text.trim()))?;
    let (ty, name) = text.split_at(split + 1);
    let name = name.trim().to_string();
    let constant = ty.split_whitespace().any(|w| w == "const");
    let pointer = ty.contains('*');
    let base: Vec<&str> = ty
        .split(|c: char| c.is_whitespace() || c == '*')
        .filter(|w| !w.is_empty() && *w != "const")
        .collect();
    let base = base.join(" ");
    let param = match (pointer, base.as_str()) {
        (true, "bf16") => Param::Ptr {
            elem: DType::Bf16,
            constant,
        },
        (true, "float") => Param::Ptr {
            elem: DType::F32,
            constant,
        },
        (true, "unsigned int") => Param::Ptr {
            elem: DType::U32,
            constant,
        },
        (false, "int") => Param::I32,
        (false, "long long") => Param::I64,
        (false, "float") => Param::F32,
        _ => {
            return Err(format!(
                "parameter `{}`: unsupported type `{}`",
                name,
                ty.trim()
            ))
        }
    };
    Ok((param, name))
}

/// Every `extern "C" __global__` kernel of `source`, in order.
pub fn signatures(source: &str) -> Result<Vec<Signature>, String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(MARK) {
        rest = &rest[at + MARK.len()..];
        let open = rest.find('(').ok_or("kernel without a parameter list")?;
        let close = rest.find(')').ok_or("unclosed parameter list")?;
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(parse_param)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("kernel {name}: {e}"))?;
        out.push(Signature { name, params });
        rest = &rest[close..];
    }
    Ok(out)
}

/// The signature of `module::function` (parsed once per process).
pub fn signature(module_name: &str, function: &str) -> Option<&'static Signature> {
    static ALL: OnceLock<HashMap<(String, String), Signature>> = OnceLock::new();
    ALL.get_or_init(|| {
        let mut map = HashMap::new();
        for m in MODULES {
            // The sources are part of the binary and checked by the tests: a parse failure is a bug.
            for s in signatures(m.source).expect("kernel sources parse") {
                map.insert((m.name.to_string(), s.name.clone()), s);
            }
        }
        map
    })
    .get(&(module_name.to_string(), function.to_string()))
}

/// The cache key's hash (it lives in `crate::rng`: the rendezvous uses it too).
pub use crate::rng::fnv1a64;

/// `sm_XY` for compute capability X.Y.
pub fn arch_of(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// NVRTC options for `arch`.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=true".into(),
    ]
}

/// What identifies one compiled module.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub module: String,
    pub arch: String,
    /// FNV-1a of the program text and the options.
    pub hash: u64,
}

impl CacheKey {
    /// `compiler` names the compiler and its version (`nvrtc 13.0`): PTX from a newer NVRTC
    /// may not load on an older driver, so a cache entry is only reused by the same compiler.
    pub fn new(module: &Module, arch: &str, options: &[String], compiler: &str) -> Self {
        let mut text = module.program().into_bytes();
        text.push(0);
        text.extend_from_slice(compiler.as_bytes());
        for o in options {
            text.push(0);
            text.extend_from_slice(o.as_bytes());
        }
        CacheKey {
            module: module.name.to_string(),
            arch: arch.to_string(),
            hash: fnv1a64(&text),
        }
    }

    /// `{module}-{arch}-{hash}.ptx`.
    pub fn file_name(&self) -> String {
        format!("{}-{}-{:016x}.ptx", self.module, self.arch, self.hash)
    }

    fn header(&self) -> String {
        format!(
            "// tessera kernel cache: {} {} {:016x}\n",
            self.module, self.arch, self.hash
        )
    }
}

/// PTX kept on disk between processes. A missing, unreadable or foreign file is a miss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCache {
    dir: Option<PathBuf>,
}

impl DiskCache {
    /// A cache in `dir` (created on first store).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        DiskCache {
            dir: Some(dir.into()),
        }
    }

    /// No disk cache: every process compiles once.
    pub fn disabled() -> Self {
        DiskCache { dir: None }
    }

    /// From the environment: `TESSERA_KERNEL_CACHE` (a folder, or `off`), else
    /// `$XDG_CACHE_HOME/tessera/kernels`, else `$HOME/.cache/tessera/kernels`.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`DiskCache::from_env`] with the variables read through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        if let Some(v) = set("TESSERA_KERNEL_CACHE") {
            return match v.as_str() {
                "off" | "0" | "none" => Self::disabled(),
                _ => Self::at(v),
            };
        }
        if let Some(x) = set("XDG_CACHE_HOME") {
            return Self::at(Path::new(&x).join("tessera/kernels"));
        }
        match set("HOME") {
            Some(h) => Self::at(Path::new(&h).join(".cache/tessera/kernels")),
            None => Self::disabled(),
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The cached PTX for `key`, if a file with this key's header is there.
    pub fn load(&self, key: &CacheKey) -> Option<String> {
        let path = self.dir.as_ref()?.join(key.file_name());
        let text = std::fs::read_to_string(path).ok()?;
        text.strip_prefix(&key.header()).map(str::to_string)
    }

    /// Stores `ptx` under `key`, atomically (a temporary file renamed into place), so a
    /// concurrent reader sees the whole file or none.
    pub fn store(&self, key: &CacheKey, ptx: &str) -> std::io::Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        std::fs::create_dir_all(dir)?;
        let path = dir.join(key.file_name());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dir.join(format!(
            ".{}.{}.{nanos}.tmp",
            key.file_name(),
            std::process::id()
        ));
        std::fs::write(&tmp, format!("{}{ptx}", key.header()))?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            std::fs::remove_file(&tmp).ok();
        })
    }
}

#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(test)]
mod tests;
