//! `tessera sample`: text from a checkpoint, deterministic for a seed; a trained model's
//! greedy text is made of the training text's pieces; bad flags and a damaged checkpoint are
//! refused with exit 2.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The README job trained for `steps`, saved; the save directory.
fn trained(dir: &Scratch, steps: &str) -> PathBuf {
    let plan = tiny_plan(dir);
    let ck = dir.path(&format!("ck-{steps}"));
    let r = run(&["run", &s(&plan), "--steps", steps, "--save-dir", &s(&ck)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    ck
}

fn sample(ck: &Path, extra: &[&str]) -> Ran {
    let mut args = vec![
        "sample",
        ck.to_str().unwrap(),
        "--prompt",
        "Pipeline parallelism",
    ];
    args.extend(extra);
    run(&args)
}

/// The share of the generated text's 4-byte pieces that occur in the training text.
fn seen(out: &str) -> f64 {
    let corpus = std::fs::read(root().join("examples/data/parallelism.txt")).unwrap();
    let text = out.trim_end().as_bytes()["Pipeline parallelism".len()..].to_vec();
    let grams: Vec<&[u8]> = text.windows(4).collect();
    let hits = grams
        .iter()
        .filter(|g| corpus.windows(4).any(|c| c == **g))
        .count();
    hits as f64 / grams.len().max(1) as f64
}

#[test]
fn a_trained_checkpoint_writes_text_like_its_training_data() {
    let dir = Scratch::new();
    let ck = trained(&dir, "150");
    let greedy = sample(&ck, &["--temperature", "0", "--tokens", "80"]);
    assert_eq!(greedy.code, Some(0), "{}", greedy.stderr);
    assert!(greedy.stdout.starts_with("Pipeline parallelism"));
    let a = sample(&ck, &["--tokens", "80", "--seed", "4"]);
    let b = sample(&ck, &["--tokens", "80", "--seed", "4"]);
    let c = sample(&ck, &["--tokens", "80", "--seed", "5"]);
    assert_eq!(a.stdout, b.stdout, "the same seed gives the same text");
    assert_ne!(a.stdout, c.stdout, "another seed draws other text");
    // One step in, the model is all but untrained.
    let early = trained(&dir, "1");
    let raw = sample(&early, &["--temperature", "0", "--tokens", "80"]);
    assert_eq!(raw.code, Some(0), "{}", raw.stderr);
    let (t, u) = (seen(&greedy.stdout), seen(&raw.stdout));
    assert!(
        t > 0.8 && t > u + 0.3,
        "trained {t:.2}: {:?}\nuntrained {u:.2}: {:?}",
        greedy.stdout,
        raw.stdout
    );
}

#[test]
fn bad_flags_and_a_damaged_checkpoint_are_refused() {
    let dir = Scratch::new();
    let ck = trained(&dir, "2");
    refused(&sample(&ck, &["--tokens", "0"]), &["--tokens", "found 0"]);
    refused(
        &sample(&ck, &["--temperature", "-0.5"]),
        &["--temperature", "found -0.5"],
    );
    refused(&sample(&ck, &["--temperature", "nan"]), &["--temperature"]);
    let r = run(&["sample", &s(&ck), "--prompt", ""]);
    refused(&r, &["--prompt"]);
    refused(&sample(&dir.path("missing"), &[]), &["missing"]);
    // A truncated shard file is named.
    let shard = ck.join("step-2").join("rank-00000.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    refused(
        &sample(&ck, &[]),
        &["rank-00000.safetensors", "truncated", "fix:"],
    );
}

/// A checkpoint records the tokenizer its run read text with, and `sample` encodes the prompt
/// and decodes with it: a model trained on GPT-2 tokens writes text, not one replacement
/// character per token as a byte decoder made of them.
#[test]
fn a_checkpoint_of_gpt2_tokens_is_sampled_with_gpt2() {
    let dir = Scratch::new();
    let plan = plan_file(
        &dir,
        "plan.json",
        &[
            "tests/fixtures/tiny-gpt2-vocab.toml",
            "specs/clusters/cpu-8.toml",
            "--devices",
            "1",
            "--micro-batch",
            "2",
        ],
    );
    let ck = dir.path("ck");
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "30",
        "--tokenizer",
        "gpt2",
        "--lr",
        "1e-2",
        "--data",
        "examples/data/parallelism.txt",
        "--save-dir",
        &s(&ck),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let index = std::fs::read_to_string(ck.join("step-30/index.json")).unwrap();
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert_eq!(index["data"]["tokenizer"]["name"], "gpt2", "{index}");
    let r = sample(&ck, &["--temperature", "0", "--tokens", "24"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stderr.contains("gpt2 tokenizer"), "{}", r.stderr);
    let generated = &r.stdout["Pipeline parallelism".len()..];
    let replaced = generated.matches('\u{fffd}').count();
    assert!(
        generated.trim().chars().count() >= 24 && replaced <= 1,
        "24 GPT-2 tokens decode to text ({replaced} replacement characters): {generated:?}"
    );
}

/// `sample` writes each token as it is drawn: the first text arrives long before a large
/// `--tokens` is done.
#[test]
fn sample_streams_its_text_as_the_tokens_come() {
    use std::io::Read;
    use std::process::Stdio;
    let dir = Scratch::new();
    let ck = trained(&dir, "2");
    let mut child = bin()
        .args([
            "sample",
            ck.to_str().unwrap(),
            "--prompt",
            "Pipeline parallelism",
            "--tokens",
            "1000000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.len() >= "Pipeline parallelism".len() + 20 {
                tx.send(got.clone()).ok();
                break;
            }
        }
    });
    let first = rx.recv_timeout(std::time::Duration::from_secs(60));
    let still_running = child.try_wait().unwrap().is_none();
    child.kill().ok();
    child.wait().ok();
    let first = first.expect("20 generated bytes within 60 s of a 1,000,000-token sample");
    assert!(first.starts_with(b"Pipeline parallelism"));
    assert!(still_running, "the text came before the generation ended");
}
