//! The runtime's NF4 (`tessera_runtime::quant`) against bitsandbytes' own code: the same
//! weights quantized by `bitsandbytes.functional.quantize_4bit(..., blocksize=64,
//! quant_type="nf4", compress_statistics=False/True)` on the CPU and dequantized by its
//! `dequantize_4bit` (scripts/check_nf4.py), with the Python of TESSERA_TORCH_PYTHON (skipped,
//! saying why, where it is unset or lacks torch and bitsandbytes).
//!
//! Everything must be identical: the packed codes, the absmax values (or their 8-bit codes, the
//! second-level absmax values and the offset), the dynamic map, and the dequantized values bit
//! for bit. No tolerance is needed: both sides compute a value as one f32 product (level ×
//! absmax), the double-quantized absmax as one f32 product and one f32 sum (code × absmax2,
//! plus the offset), each rounded to nearest, from the same inputs. Two probes go through the
//! 8-bit scheme of double quantization alone (`quantize_blockwise(x, blocksize=256)`).
//!
//! Shapes avoid a last dimension that is a multiple of 16 but not of 64: there bitsandbytes'
//! AVX-512 dequantization kernel (csrc/cpu_ops.cpp, `dequantizeBlockwise4bitCpu`) indexes the
//! absmax by row and would pick another block's scale (read in its source; not run here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_runtime::quant::blockwise8::{self, DYNAMIC_MAP};
use tessera_runtime::quant::{Absmax, Nf4Tensor, NF4_LEVELS};
use tessera_runtime::rng;

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-nf4-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, seed, 0x4e46, 0, std);
    v
}

fn write_f32(path: &Path, x: &[f32]) {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The f32 midpoints between adjacent NF4 levels (where a value changes code).
fn midpoints() -> Vec<f32> {
    NF4_LEVELS.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

/// Blocks of 64 built to land on, just above and just below the midpoints: absmax values that
/// are powers of two (x · (1/absmax) is exact) and others (it rounds, so x / absmax and
/// x · (1/absmax) can fall on different sides), a zero block and a block of tiny values.
fn ties() -> Vec<f32> {
    let mid = midpoints();
    let mut x = Vec::new();
    for (b, absmax) in [1.0f32, 0.5, 4.0, 0.3, 1.7e-3, 0.77]
        .into_iter()
        .enumerate()
    {
        let mut block = vec![0.0f32; 64];
        block[63] = if b % 2 == 0 { absmax } else { -absmax };
        for (i, &m) in mid.iter().enumerate() {
            let sign = if (i + b) % 2 == 0 { 1.0 } else { -1.0 };
            let v = sign * m * absmax;
            block[4 * i] = v;
            block[4 * i + 1] = v.next_up();
            block[4 * i + 2] = v.next_down();
            block[4 * i + 3] = (sign * m).next_up() * absmax;
        }
        x.extend(block);
    }
    x.extend([0.0; 64]);
    x.extend(randn(64, 9, 1e-20));
    x
}

/// `ties()`'s block of absmax 0.3 again as a partial last block (scaled by division): its 60
/// values on and around the midpoints and its absmax, after a full block.
fn partial_ties() -> Vec<f32> {
    let block = &ties()[3 * 64..4 * 64];
    let mut x = randn(64, 4, 1.0);
    x.extend(&block[..60]);
    x.push(block[63]);
    x
}

/// Values near zero in blocks of absmax ±1: there the dynamic map's codes are finer than the
/// step of bitsandbytes' CPU table from a value to a code (2/65535), so the table's code is
/// often not the nearest one.
fn near_zero_probe() -> Vec<f32> {
    (0..16 * 256)
        .map(|i: i32| match i % 256 {
            255 if i % 512 == 255 => 1.0,
            255 => -1.0,
            j => (j - 127 + 7 * (i / 256)) as f32 * 3.1e-7,
        })
        .collect()
}

fn cases() -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    let mut rows = randn(300 * 130, 2, 0.02);
    for (i, v) in rows.iter_mut().enumerate() {
        *v *= 1.0 + (i / 130) as f32 / 30.0; // rows of growing scale: absmax varies
    }
    vec![
        ("normal_64x64", vec![64, 64], randn(64 * 64, 1, 0.02)),
        ("odd_3x7x5", vec![3, 7, 5], randn(105, 3, 1.0)),
        ("vector_1000", vec![1000], randn(1000, 5, 0.5)),
        ("ties_8x64", vec![8, 64], ties()),
        ("partial_ties_125", vec![125], partial_ties()),
        ("rows_300x130", vec![300, 130], rows),
        ("zeros_70", vec![70], vec![0.0; 70]),
        ("constant_5x64", vec![5, 64], vec![-0.25; 320]),
        // 32784 blocks: past the 32768 elements above which torch sums in threads.
        (
            "large_2049x1024",
            vec![2049, 1024],
            randn(2049 * 1024, 8, 0.02),
        ),
    ]
}

/// Where `ours` and `theirs` differ, recorded in `problems` (a count and the first five).
fn compare<T: Copy + std::fmt::Debug>(
    problems: &mut Vec<String>,
    what: &str,
    ours: &[T],
    theirs: &[T],
    same: fn(T, T) -> bool,
) {
    if ours.len() != theirs.len() {
        problems.push(format!("{what}: {} vs {} values", ours.len(), theirs.len()));
        return;
    }
    let diff: Vec<usize> = (0..ours.len())
        .filter(|&i| !same(ours[i], theirs[i]))
        .collect();
    if !diff.is_empty() {
        let first: Vec<_> = diff
            .iter()
            .take(5)
            .map(|&i| (i, ours[i], theirs[i]))
            .collect();
        problems.push(format!(
            "{what}: {} of {} differ (index, ours, bitsandbytes'), first {first:?}",
            diff.len(),
            ours.len()
        ));
    }
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
}

fn same_u8(a: u8, b: u8) -> bool {
    a == b
}

fn map_bits(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
        .collect()
}

#[test]
fn bitsandbytes_quantizes_and_dequantizes_as_the_runtime_does() {
    let Some(python) = std::env::var_os("TESSERA_TORCH_PYTHON") else {
        println!("skipped: TESSERA_TORCH_PYTHON is not set (bash scripts/check-exports-env.sh engines prints one)");
        return;
    };
    let probe = Command::new(&python)
        .args(["-c", "import torch, bitsandbytes"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = probe.map_or_else(
            |e| e.to_string(),
            |o| String::from_utf8_lossy(&o.stderr).into_owned(),
        );
        println!(
            "skipped: {} cannot import torch and bitsandbytes: {why}",
            python.to_string_lossy()
        );
        return;
    }
    let dir = scratch();
    let cases = cases();
    let mut cmd = Command::new(&python);
    cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_nf4.py"))
        .arg("--out")
        .arg(&dir);
    for (name, shape, x) in &cases {
        let path = dir.join(format!("{name}.f32"));
        write_f32(&path, x);
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        cmd.arg("--nf4")
            .arg(format!("{}:{}", path.display(), dims.join("x")));
    }
    let mut blockwise = BTreeMap::new();
    blockwise.insert("near_zero_probe", near_zero_probe());
    let mut uniform = randn(256 * 40 + 100, 6, 1.0);
    for (i, v) in uniform.iter_mut().enumerate() {
        *v *= 1e-3 + (i / 256) as f32 * 0.37; // blocks of unrelated absmax values
    }
    blockwise.insert("blockwise_random", uniform);
    for (name, x) in &blockwise {
        let path = dir.join(format!("{name}.f32"));
        write_f32(&path, x);
        cmd.arg("--blockwise").arg(path);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check_nf4.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    println!(
        "bitsandbytes {} on torch {} (CPU dispatch {}, {} thread)",
        report["bitsandbytes"], report["torch"], report["cpu_capability"], report["threads"]
    );

    let mut problems = Vec::new();
    for (name, shape, x) in &cases {
        let before = problems.len();
        for (mode, double) in [("single", false), ("double", true)] {
            let key = format!("{name}.{mode}");
            let file = |ext: &str| dir.join(format!("{key}.{ext}"));
            let read = |ext: &str| std::fs::read(file(ext)).unwrap();
            let entry = &report["nf4"][&key];
            let p = &mut problems;
            let quant_map = map_bits(&entry["quant_map"]);
            compare(
                p,
                &format!("{key}: quant_map"),
                &NF4_LEVELS,
                &quant_map,
                same_f32,
            );
            let q = Nf4Tensor::quantize(x, shape, double).unwrap();
            compare(
                p,
                &format!("{key}: packed"),
                q.packed(),
                &read("packed"),
                same_u8,
            );
            match q.absmax() {
                Absmax::F32(a) => {
                    let theirs = read_f32(&file("absmax"));
                    compare(p, &format!("{key}: absmax"), a, &theirs, same_f32);
                }
                Absmax::Double {
                    codes,
                    absmax2,
                    offset,
                } => {
                    let map = map_bits(&entry["dynamic_map"]);
                    compare(
                        p,
                        &format!("{key}: dynamic map"),
                        &DYNAMIC_MAP,
                        &map,
                        same_f32,
                    );
                    assert_eq!(entry["nested_blocksize"], 256, "{key}");
                    let theirs = f32::from_bits(entry["offset"].as_u64().unwrap() as u32);
                    compare(
                        p,
                        &format!("{key}: offset"),
                        &[*offset],
                        &[theirs],
                        same_f32,
                    );
                    let theirs = read("absmax");
                    compare(p, &format!("{key}: absmax codes"), codes, &theirs, same_u8);
                    let theirs = read_f32(&file("absmax2"));
                    compare(p, &format!("{key}: absmax2"), absmax2, &theirs, same_f32);
                }
            }
            let what = format!("{key}: dequantized ({})", entry["dequant_path"]);
            compare(
                p,
                &what,
                &q.dequantize(),
                &read_f32(&file("dequant")),
                same_f32,
            );
        }
        let verdict = if problems.len() == before {
            "identical"
        } else {
            "DIFFERENT"
        };
        println!("{name} {shape:?}: {verdict}, single and double quantization");
    }
    for (name, x) in &blockwise {
        let before = problems.len();
        let (codes, absmax) = blockwise8::quantize_blockwise(x, 256);
        let file = |ext: &str| dir.join(format!("{name}.{ext}"));
        let theirs = std::fs::read(file("codes")).unwrap();
        compare(
            &mut problems,
            &format!("{name}: codes"),
            &codes,
            &theirs,
            same_u8,
        );
        let theirs = read_f32(&file("absmax"));
        compare(
            &mut problems,
            &format!("{name}: absmax"),
            &absmax,
            &theirs,
            same_f32,
        );
        let verdict = if problems.len() == before {
            "identical"
        } else {
            "DIFFERENT"
        };
        println!("{name} ({} values): {verdict} 8-bit codes", x.len());
    }
    assert!(
        problems.is_empty(),
        "the runtime and bitsandbytes differ:\n{}",
        problems.join("\n")
    );
    std::fs::remove_dir_all(&dir).ok();
}
