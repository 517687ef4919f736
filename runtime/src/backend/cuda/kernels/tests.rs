//! The kernel sources against what the host code assumes of them, the cache key and the disk
//! cache.

use super::*;
use crate::backend::cuda::launch;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    d
}

#[test]
fn every_module_parses_and_kernel_names_are_unique() {
    let mut seen = std::collections::HashSet::new();
    for m in MODULES {
        let sigs = signatures(m.source).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert!(!sigs.is_empty(), "{} has no kernel", m.name);
        for s in sigs {
            assert!(
                seen.insert(s.name.clone()),
                "kernel {} defined twice",
                s.name
            );
            assert!(signature(m.name, &s.name).is_some());
        }
        assert!(
            !m.source.contains("#include"),
            "{}: NVRTC gets no include path",
            m.name
        );
    }
    assert!(signatures(COMMON).unwrap().is_empty());
}

#[test]
fn the_kernels_the_issue_asks_for_are_there() {
    let want: &[(&str, &[&str])] = &[
        (
            "embedding",
            &[
                "embedding_forward",
                "embedding_backward",
                "pos_embedding_forward",
                "pos_embedding_backward",
            ],
        ),
        (
            "norm",
            &[
                "layernorm_forward",
                "layernorm_backward",
                "layernorm_param_grads",
                "rmsnorm_forward",
                "rmsnorm_backward",
                "rmsnorm_param_grads",
            ],
        ),
        (
            "attention",
            &[
                "attention_forward",
                "attention_delta",
                "attention_backward_dq",
                "attention_backward_dkv",
            ],
        ),
        (
            "act",
            &[
                "gelu_forward",
                "gelu_backward",
                "swiglu_forward",
                "swiglu_backward",
            ],
        ),
        (
            "crossentropy",
            &[
                "crossentropy_row_max",
                "crossentropy_partials",
                "crossentropy_losses",
                "crossentropy_forward",
                "crossentropy_backward",
                "crossentropy_fused",
            ],
        ),
        ("adamw", &["adamw_step"]),
        (
            "reduce",
            &[
                "sum_partials",
                "column_sums",
                "add_bias",
                "sum_squares",
                "fill_f32",
                "fill_bf16",
                "copy_f32",
                "copy_bf16",
                "add_inplace_bf16",
            ],
        ),
    ];
    for (m, names) in want {
        for n in *names {
            assert!(signature(m, n).is_some(), "{m}::{n} missing");
        }
    }
}

#[test]
fn parameters_parse_to_the_launch_kinds() {
    let s = signatures(
        "extern \"C\" __global__ void k(const bf16* __restrict__ a, float* b, unsigned int* c,\n long long n, int c2, float eps) {}",
    )
    .unwrap();
    assert_eq!(s.len(), 1);
    let kinds: Vec<Param> = s[0].params.iter().map(|p| p.0).collect();
    assert_eq!(
        kinds,
        vec![
            Param::Ptr {
                elem: DType::Bf16,
                constant: true
            },
            Param::Ptr {
                elem: DType::F32,
                constant: false
            },
            Param::Ptr {
                elem: DType::U32,
                constant: false
            },
            Param::I64,
            Param::I32,
            Param::F32,
        ]
    );
    assert_eq!(s[0].params[3].1, "n");
    assert!(signatures("extern \"C\" __global__ void k(double x) {}").is_err());
}

#[test]
fn attention_constants_match_the_source() {
    let src = module("attention").unwrap().source;
    let define = |name: &str| -> u32 {
        let line = src
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("no #define {name}"));
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    assert_eq!(define("ATT_WARPS"), launch::ATT_WARPS);
    assert_eq!(define("ATT_ROWS"), launch::ATT_ROWS);
    assert_eq!(define("ATT_BC"), launch::ATT_BC);
    assert_eq!(define("ATT_MAXD") as usize, launch::ATT_MAXD);
    let ring = module("ring_attention").unwrap().source;
    let maxd = ring
        .lines()
        .find_map(|l| l.strip_prefix("#define RING_MAXD "))
        .expect("#define RING_MAXD");
    assert_eq!(maxd.trim().parse::<usize>().unwrap(), launch::RING_MAXD);
}

#[test]
fn fnv1a_matches_published_values() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
}

#[test]
fn cache_key_changes_with_arch_options_and_source() {
    let m = module("norm").unwrap();
    let k90 = CacheKey::new(m, "sm_90", &compile_options("sm_90"), "nvrtc 13.0");
    let again = CacheKey::new(m, "sm_90", &compile_options("sm_90"), "nvrtc 13.0");
    assert_eq!(k90, again);
    let k80 = CacheKey::new(m, "sm_80", &compile_options("sm_80"), "nvrtc 13.0");
    assert_ne!(k90.hash, k80.hash);
    assert_ne!(k90.file_name(), k80.file_name());
    let mut opts = compile_options("sm_90");
    opts.push("--use_fast_math".into());
    assert_ne!(
        CacheKey::new(m, "sm_90", &opts, "nvrtc 13.0").hash,
        k90.hash
    );
    let edited = Module {
        source: "// edited\n",
        ..*m
    };
    assert_ne!(
        CacheKey::new(&edited, "sm_90", &compile_options("sm_90"), "nvrtc 13.0").hash,
        k90.hash
    );
    // Another compiler version is another entry.
    assert_ne!(
        CacheKey::new(m, "sm_90", &compile_options("sm_90"), "nvrtc 13.1").hash,
        k90.hash
    );
    assert!(k90.file_name().starts_with("norm-sm_90-"));
    assert_eq!(arch_of(9, 0), "sm_90");
    assert_eq!(arch_of(12, 0), "sm_120");
}

#[test]
fn disk_cache_round_trip_and_misses() {
    let dir = temp_dir("kcache");
    let cache = DiskCache::at(&dir);
    let m = module("act").unwrap();
    let key = CacheKey::new(m, "sm_90", &compile_options("sm_90"), "nvrtc 13.0");
    assert_eq!(cache.load(&key), None);
    cache.store(&key, ".version 8.0\n// ptx").unwrap();
    assert_eq!(cache.load(&key).as_deref(), Some(".version 8.0\n// ptx"));
    // A file whose header names another key (e.g. renamed by hand) is a miss.
    let other = CacheKey {
        hash: key.hash ^ 1,
        ..key.clone()
    };
    std::fs::copy(dir.join(key.file_name()), dir.join(other.file_name())).unwrap();
    assert_eq!(cache.load(&other), None);
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    let off = DiskCache::disabled();
    off.store(&key, "x").unwrap();
    assert_eq!(off.load(&key), None);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn disk_cache_location_from_the_environment() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
    };
    let d = DiskCache::from_vars(vars(&[("TESSERA_KERNEL_CACHE", "/c"), ("HOME", "/h")]));
    assert_eq!(d.dir(), Some(Path::new("/c")));
    let d = DiskCache::from_vars(vars(&[("TESSERA_KERNEL_CACHE", "off"), ("HOME", "/h")]));
    assert_eq!(d.dir(), None);
    let d = DiskCache::from_vars(vars(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]));
    assert_eq!(d.dir(), Some(Path::new("/x/tessera/kernels")));
    let d = DiskCache::from_vars(vars(&[("HOME", "/h")]));
    assert_eq!(d.dir(), Some(Path::new("/h/.cache/tessera/kernels")));
    assert_eq!(DiskCache::from_vars(vars(&[])).dir(), None);
}
