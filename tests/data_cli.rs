//! `tessera data prepare` and `tessera run --data` on prepared shards: the shard format
//! checked byte by byte against llm.c's (`dev/data/data_common.py`: 256 int32s of header,
//! magic 20240520, version 1, token count, then uint16 tokens), a run on a GPT-2-vocabulary
//! model, and the bad inputs refused with exit 2 naming the file.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const MODEL: &str = "tests/fixtures/tiny-gpt2-vocab.toml";
const CPU8: &str = "specs/clusters/cpu-8.toml";

/// The header llm.c writes for `count` GPT-2 tokens, built by hand.
fn llmc_header(count: i32) -> Vec<u8> {
    let mut h = vec![0u8; 1024];
    h[0..4].copy_from_slice(&20240520i32.to_le_bytes());
    h[4..8].copy_from_slice(&1i32.to_le_bytes());
    h[8..12].copy_from_slice(&count.to_le_bytes());
    h
}

/// A shard as llm.c writes it, of `tokens` (uint16).
fn llmc_shard(tokens: &[u16]) -> Vec<u8> {
    let mut v = llmc_header(tokens.len() as i32);
    for t in tokens {
        v.extend_from_slice(&t.to_le_bytes());
    }
    v
}

fn ok(r: &Ran) {
    assert_eq!(
        r.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        r.stdout,
        r.stderr
    );
}

/// The tiny GPT-2-vocabulary model planned for one CPU rank.
fn plan(dir: &Scratch) -> PathBuf {
    let p = dir.path("plan.json");
    ok(&run(&[
        "plan",
        MODEL,
        CPU8,
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "-o",
        &s(&p),
    ]));
    p
}

/// A small text corpus: the repository's own prose.
fn corpus(dir: &Scratch) -> Vec<PathBuf> {
    let a = dir.path("a.txt");
    std::fs::copy(root().join("examples/data/parallelism.txt"), &a).unwrap();
    let b = dir.path("b.txt");
    std::fs::copy(root().join("README.md"), &b).unwrap();
    vec![a, b]
}

#[test]
fn prepare_writes_llmc_shards_and_run_trains_on_them() {
    let dir = Scratch::new();
    let inputs = corpus(&dir);
    let out = dir.path("prepared");
    let r = run(&[
        "data",
        "prepare",
        &s(&inputs[0]),
        &s(&inputs[1]),
        "-o",
        &s(&out),
        "--tokenizer",
        "gpt2",
        "--shard-tokens",
        "2000",
        "--val-fraction",
        "0.1",
        "--name",
        "demo",
    ]);
    ok(&r);
    assert!(
        r.stdout.contains("training tokens") && r.stdout.contains("gpt2"),
        "{}",
        r.stdout
    );
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.contains(&"demo_val_000000.bin".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"demo_train_000001.bin".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"tessera-data.json".to_string()),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with('.')),
        "no temporary left: {names:?}"
    );

    // The first training shard is full: the header by hand, then 2000 uint16 tokens.
    let bytes = std::fs::read(out.join("demo_train_000000.bin")).unwrap();
    assert_eq!(bytes.len(), 1024 + 2 * 2000);
    assert_eq!(&bytes[..1024], &llmc_header(2000)[..]);
    // The validation shard starts with the first input's first document: <|endoftext|>
    // (50256) before it, as llm.c does, then GPT-2's tokens of its text.
    let val = std::fs::read(out.join("demo_val_000000.bin")).unwrap();
    let count = i32::from_le_bytes(val[8..12].try_into().unwrap());
    assert_eq!(val.len(), 1024 + 2 * count as usize);
    let first = u16::from_le_bytes([val[1024], val[1025]]);
    assert_eq!(first, 50256);

    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tessera-data.json")).unwrap())
            .unwrap();
    assert_eq!(meta["tokenizer"]["name"], "gpt2");
    assert_eq!(meta["vocab"], 50257);
    assert_eq!(meta["token_bytes"], 2);
    let listed: u64 = meta["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tokens"].as_u64().unwrap())
        .sum();
    assert!(listed > 2000, "{meta}");

    // Training on the folder: its train shards, and its val shard as the validation data.
    let p = plan(&dir);
    let r = run(&["run", &s(&p), "--data", &s(&out), "--steps", "2"]);
    ok(&r);
    assert!(
        r.stdout.contains("llm.c shards") && r.stdout.contains("validation data"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("over 2 steps"), "{}", r.stdout);
    // A glob of the train shards trains the same.
    let pattern = out.join("demo_train_*.bin");
    let r2 = run(&["run", &s(&p), "--data", &s(&pattern), "--steps", "2"]);
    ok(&r2);
    let loss = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("loss "))
            .map(str::to_string)
    };
    assert_eq!(loss(&r.stdout), loss(&r2.stdout));
    // A byte-vocabulary model cannot train on it: the folder's tessera-data.json says why.
    let tiny = dir.path("tiny-plan.json");
    ok(&run(&[
        "plan",
        "specs/models/tiny.toml",
        CPU8,
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "-o",
        &s(&tiny),
    ]));
    let r = run(&["run", &s(&tiny), "--data", &s(&out), "--steps", "1"]);
    refused(&r, &[&s(&out), "50257"]);
}

#[test]
fn gpt2_text_is_tokenized_at_load_and_known_ids_come_out() {
    let dir = Scratch::new();
    let text = dir.path("hello.txt");
    std::fs::write(&text, "Hello world").unwrap();
    let out = dir.path("p");
    ok(&run(&[
        "data",
        "prepare",
        &s(&text),
        "-o",
        &s(&out),
        "--val-fraction",
        "0",
    ]));
    // "Hello world" is [15496, 995] in r50k_base; the document starts with <|endoftext|>.
    let bytes = std::fs::read(out.join("data_train_000000.bin")).unwrap();
    let mut want = llmc_header(3);
    for t in [50256u16, 15496, 995] {
        want.extend_from_slice(&t.to_le_bytes());
    }
    assert_eq!(bytes, want);
    assert!(!out.join("data_val_000000.bin").exists());
    // A second prepare into the same folder is refused: the shards would mix.
    let r = run(&["data", "prepare", &s(&text), "-o", &s(&out)]);
    refused(&r, &[&s(&out), "already holds"]);
}

/// `tessera run --data` on a bad file of the tiny GPT-2-vocabulary plan: exit 2 naming it.
fn refused_naming(dir: &Scratch, data: &Path, extra: &[&str], parts: &[&str]) {
    let p = plan(dir);
    let mut args = vec!["run".to_string(), s(&p), "--steps".into(), "1".into()];
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = run(&args);
    let mut want = vec![s(data)];
    want.extend(parts.iter().map(|p| p.to_string()));
    refused(&r, &want.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn bad_shards_are_refused_naming_the_file() {
    let dir = Scratch::new();
    let tokens: Vec<u16> = (0..500).map(|i| (i * 97 % 50000) as u16).collect();

    // Truncated: the header says 500 tokens, the file holds 499.
    let trunc = dir.path("trunc.bin");
    let mut b = llmc_shard(&tokens);
    b.truncate(b.len() - 2);
    std::fs::write(&trunc, &b).unwrap();
    refused_naming(
        &dir,
        &trunc,
        &["--data", &s(&trunc)],
        &["header says 500 tokens, the file holds 499"],
    );

    // Header count against the size: more bytes than the header says.
    let long = dir.path("long.bin");
    let mut b = llmc_shard(&tokens);
    b.extend_from_slice(&[1, 0, 2, 0]);
    std::fs::write(&long, &b).unwrap();
    refused_naming(
        &dir,
        &long,
        &["--data", &s(&long)],
        &["header says 500 tokens, the file holds 502"],
    );

    // A wrong magic, when llm.c's format is asked for.
    let magic = dir.path("magic.bin");
    let mut b = llmc_shard(&tokens);
    b[0..4].copy_from_slice(&20240521i32.to_le_bytes());
    std::fs::write(&magic, &b).unwrap();
    refused_naming(
        &dir,
        &magic,
        &["--data", &s(&magic), "--data-format", "llmc"],
        &["wrong magic 20240521"],
    );

    // A token id past the model's vocabulary (50257).
    let ids = dir.path("ids.bin");
    let mut high = tokens.clone();
    high[321] = 60000;
    std::fs::write(&ids, llmc_shard(&high)).unwrap();
    refused_naming(
        &dir,
        &ids,
        &["--data", &s(&ids)],
        &["token id 60000", "50257", "first at token 321"],
    );

    // An empty validation split: a folder whose val shard holds no token.
    let folder = dir.path("set");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("x_train_000000.bin"), llmc_shard(&tokens)).unwrap();
    let empty = folder.join("x_val_000000.bin");
    std::fs::write(&empty, llmc_shard(&[])).unwrap();
    refused_naming(
        &dir,
        &empty,
        &["--data", &s(&folder)],
        &["validation split is empty"],
    );
    // ... and an empty --val-data file.
    let good = dir.path("good.bin");
    std::fs::write(&good, llmc_shard(&tokens)).unwrap();
    let none = dir.path("none.txt");
    std::fs::write(&none, "").unwrap();
    refused_naming(
        &dir,
        &none,
        &[
            "--data",
            &s(&good),
            "--val-data",
            &s(&none),
            "--eval-every",
            "1",
        ],
        &["validation split is empty"],
    );
    // Shorter than one sequence (32 + 1).
    let short = dir.path("short.bin");
    std::fs::write(&short, llmc_shard(&tokens[..20])).unwrap();
    refused_naming(
        &dir,
        &short,
        &["--data", &s(&short)],
        &["shorter than one sequence"],
    );
}

#[test]
fn prepare_refuses_bad_arguments_before_writing() {
    let dir = Scratch::new();
    let text = dir.path("t.txt");
    std::fs::write(&text, "Hello world").unwrap();
    let out = dir.path("o");
    let r = run(&[
        "data",
        "prepare",
        &s(&text),
        "-o",
        &s(&out),
        "--val-fraction",
        "1",
    ]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    let r = run(&[
        "data",
        "prepare",
        &s(&text),
        "-o",
        &s(&out),
        "--name",
        "x_val",
    ]);
    refused(&r, &["--name"]);
    let r = run(&[
        "data",
        "prepare",
        &s(&dir.path("missing.txt")),
        "-o",
        &s(&out),
    ]);
    refused(&r, &["missing.txt"]);
    // Too little text for a 5% validation split: nothing is left behind.
    let r = run(&[
        "data",
        "prepare",
        &s(&text),
        "-o",
        &s(&out),
        "--val-fraction",
        "0.05",
    ]);
    refused(&r, &["validation split would be empty"]);
    assert!(
        !out.exists(),
        "nothing is left behind, not even the folder it made"
    );
    // A folder that was there stays, empty.
    std::fs::create_dir_all(&out).unwrap();
    let r = run(&["data", "prepare", &s(&text), "-o", &s(&out)]);
    refused(&r, &["validation split would be empty"]);
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}
