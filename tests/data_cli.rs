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
        &["holds no text"],
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

/// A small Hugging Face tokenizer.json (word level, `</s>` as the separator).
fn word_tokenizer(dir: &Scratch) -> PathBuf {
    let p = dir.path("tokenizer.json");
    std::fs::write(
        &p,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
        "decoder":null,"model":{"type":"WordLevel","vocab":{"hello":0,"world":1,"</s>":2,"[UNK]":3},
        "unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    p
}

/// `tessera data prepare INPUTS -o OUT` with `extra` flags.
fn prepare(inputs: &[&Path], out: &Path, extra: &[&str]) -> Ran {
    let mut args = vec!["data".to_string(), "prepare".into()];
    args.extend(inputs.iter().map(|p| s(p)));
    args.extend(["-o".into(), s(out)]);
    args.extend(extra.iter().map(|a| a.to_string()));
    run(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn utf16le(text: &str) -> Vec<u8> {
    text.encode_utf16().flat_map(u16::to_le_bytes).collect()
}

#[test]
fn utf16_and_other_encodings_are_refused_naming_the_file() {
    let dir = Scratch::new();
    let text = std::fs::read_to_string(root().join("examples/data/parallelism.txt")).unwrap();
    let p = plan(&dir);
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("no-bom.txt", utf16le(&text), "UTF-16LE"),
        (
            "bom.txt",
            [&[0xff, 0xfe][..], &utf16le(&text)].concat(),
            "UTF-16LE",
        ),
        ("latin1.txt", b"caf\xe9 au lait, ".repeat(100), "not UTF-8"),
    ];
    for (name, bytes, what) in &cases {
        let f = dir.path(name);
        std::fs::write(&f, bytes).unwrap();
        let r = run(&["run", &s(&p), "--steps", "1", "--data", &s(&f)]);
        refused(&r, &[&s(&f), what, "  fix: "]);
        let r = run(&[
            "run",
            &s(&p),
            "--steps",
            "1",
            "--eval-every",
            "1",
            "--val-data",
            &s(&f),
        ]);
        refused(&r, &[&s(&f), what]);
        let r = prepare(&[&f], &dir.path("out"), &["--val-fraction", "0"]);
        refused(&r, &[&s(&f), what, "  fix: "]);
        assert!(!dir.path("out").exists());
    }
    // A UTF-8 byte-order mark is dropped: the shards are those of the text without it.
    let plain = dir.path("plain.txt");
    std::fs::write(&plain, &text).unwrap();
    let bom = dir.path("utf8-bom.txt");
    std::fs::write(&bom, [b"\xef\xbb\xbf", text.as_bytes()].concat()).unwrap();
    ok(&prepare(
        &[&plain],
        &dir.path("a"),
        &["--val-fraction", "0"],
    ));
    ok(&prepare(&[&bom], &dir.path("b"), &["--val-fraction", "0"]));
    let shard = |d: &str| std::fs::read(dir.path(d).join("data_train_000000.bin")).unwrap();
    assert_eq!(shard("a"), shard("b"));
}

#[test]
fn inputs_with_no_text_are_refused_alike_under_every_tokenizer() {
    let dir = Scratch::new();
    let tok = word_tokenizer(&dir);
    let good = dir.path("good.txt");
    std::fs::write(&good, "hello world ".repeat(50)).unwrap();
    let p = plan(&dir);
    for (name, bytes) in [
        ("empty.txt", &b""[..]),
        ("blank.txt", &b"\n  \n\t\n"[..]),
        ("empty.jsonl", &b"{\"text\": \"\"}\n"[..]),
    ] {
        let f = dir.path(name);
        std::fs::write(&f, bytes).unwrap();
        let mut messages = Vec::new();
        for t in ["gpt2", "bytes", &s(&tok)] {
            // Alone or beside a good input, it is refused, naming it, before any shard.
            for inputs in [vec![f.as_path()], vec![good.as_path(), f.as_path()]] {
                let out = dir.path("out");
                let r = prepare(&inputs, &out, &["--tokenizer", t, "--val-fraction", "0"]);
                refused(&r, &[&s(&f), "holds no text", "  fix: "]);
                assert!(!out.exists(), "no shard of separators is left");
                messages.push(r.stderr);
            }
            let r = run(&[
                "run",
                &s(&p),
                "--steps",
                "1",
                "--data",
                &s(&f),
                "--tokenizer",
                t,
            ]);
            refused(&r, &[&s(&f), "holds no text", "  fix: "]);
        }
        assert!(
            messages.windows(2).all(|w| w[0] == w[1]),
            "{name}: one message under every tokenizer: {messages:#?}"
        );
    }
}

/// Rewrites a prepared folder's tessera-data.json through `edit`.
fn edit_meta(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("tessera-data.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(&path, m.to_string()).unwrap();
}

#[test]
fn tessera_data_json_is_checked_against_the_shards_beside_it() {
    let dir = Scratch::new();
    let inputs = corpus(&dir);
    let out = dir.path("prepared");
    ok(&prepare(
        &[&inputs[0], &inputs[1]],
        &out,
        &["--shard-tokens", "3000", "--val-fraction", "0.1"],
    ));
    let meta = std::fs::read(out.join("tessera-data.json")).unwrap();
    let p = plan(&dir);
    let train = |extra: &[&str]| {
        let mut args = vec!["run", p.to_str().unwrap(), "--steps", "1"];
        args.extend(extra);
        run(&args)
    };
    ok(&train(&["--data", &s(&out)]));
    // shards: [val 0, train 0, train 1, ...]
    type Edit = fn(&mut serde_json::Value);
    let edits: [(Edit, &str); 7] = [
        (
            |m| m["shards"][1]["tokens"] = 2999.into(),
            "shards[1].tokens",
        ),
        (
            |m| m["shards"][0]["split"] = "train".into(),
            "shards[0].split",
        ),
        (
            |m| m["shards"][2]["file"] = "data_train_000009.bin".into(),
            "data_train_000009.bin",
        ),
        (
            |m| {
                m["shards"].as_array_mut().unwrap().pop();
            },
            "not listed",
        ),
        (|m| m["token_bytes"] = 4.into(), "token_bytes"),
        (|m| m["vocab"] = 256.into(), "vocab"),
        (|m| m["tokenizer"]["name"] = "bytes".into(), "tokenizer"),
    ];
    for (edit, field) in edits {
        edit_meta(&out, edit);
        let r = train(&["--data", &s(&out)]);
        refused(&r, &["tessera-data.json", field, "  fix: "]);
        let r = train(&["--val-data", &s(&out), "--eval-every", "1"]);
        refused(&r, &["tessera-data.json", field]);
        std::fs::write(out.join("tessera-data.json"), &meta).unwrap();
    }
    // A listed shard removed from the folder.
    let gone = out.join("data_train_000001.bin");
    let kept = std::fs::read(&gone).unwrap();
    std::fs::remove_file(&gone).unwrap();
    refused(
        &train(&["--data", &s(&out)]),
        &["tessera-data.json", "data_train_000001.bin", "  fix: "],
    );
    std::fs::write(&gone, kept).unwrap();
    ok(&train(&["--data", &s(&out)]));
}

#[test]
fn data_of_different_tokenizers_is_not_mixed() {
    let dir = Scratch::new();
    let inputs = corpus(&dir);
    let gpt2 = dir.path("g");
    let bytes = dir.path("b");
    for (out, t) in [(&gpt2, "gpt2"), (&bytes, "bytes")] {
        ok(&prepare(
            &[&inputs[0], &inputs[1]],
            out,
            &[
                "--tokenizer",
                t,
                "--val-fraction",
                "0.1",
                "--shard-tokens",
                "4000",
            ],
        ));
    }
    let p = plan(&dir);
    let train = |extra: &[&str]| {
        let mut args = vec![
            "run",
            p.to_str().unwrap(),
            "--steps",
            "1",
            "--eval-every",
            "1",
        ];
        args.extend(extra);
        run(&args)
    };
    // A folder of GPT-2 tokens validated on byte tokens, and the other way round.
    let r = train(&["--data", &s(&gpt2), "--val-data", &s(&bytes)]);
    refused(&r, &[&s(&bytes), "bytes", "gpt2", "  fix: "]);
    let r = train(&["--data", &s(&bytes), "--val-data", &s(&gpt2)]);
    refused(&r, &[&s(&gpt2), "bytes", "gpt2"]);
    // Text validated against a GPT-2 folder, read with another tokenizer than the folder's.
    let r = train(&[
        "--data",
        &s(&gpt2),
        "--val-data",
        &s(&inputs[0]),
        "--tokenizer",
        "bytes",
    ]);
    refused(&r, &["bytes", "gpt2"]);
    // Text beside a GPT-2 folder without --tokenizer is read with the folder's tokenizer.
    ok(&train(&["--data", &s(&gpt2), "--val-data", &s(&inputs[0])]));
    // A glob across both folders.
    let pattern = dir.path("*/data_train_*.bin");
    let r = train(&["--data", &s(&pattern)]);
    refused(&r, &["tokenizer", "bytes", "gpt2", "  fix: "]);
    // A glob within one folder is fine (its val shards are the validation split).
    ok(&train(&["--data", &s(&gpt2.join("data_*.bin"))]));
}

#[test]
fn run_reads_jsonl_as_data_prepare_does() {
    let dir = Scratch::new();
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let jsonl: String = readme
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .map(|p| serde_json::json!({ "text": p, "id": 7 }).to_string() + "\n")
        .collect();
    let docs = dir.path("docs.jsonl");
    std::fs::write(&docs, jsonl).unwrap();
    let out = dir.path("prepared");
    let r = prepare(&[&docs], &out, &["--val-fraction", "0"]);
    ok(&r);
    let prepared: u64 = r.stdout.split_whitespace().nth(1).unwrap().parse().unwrap();
    let p = plan(&dir);
    let train = |data: &Path| {
        run(&[
            "run",
            p.to_str().unwrap(),
            "--steps",
            "2",
            "--data",
            &s(data),
            "--tokenizer",
            "gpt2",
        ])
    };
    let from_text = train(&docs);
    ok(&from_text);
    assert!(
        from_text
            .stdout
            .contains(&format!("text, {prepared} tokens")),
        "the run reads the {prepared} tokens prepare writes:\n{}",
        from_text.stdout
    );
    // The same tokens in the same order: the same losses as on the prepared shard.
    let from_shards = run(&[
        "run",
        p.to_str().unwrap(),
        "--steps",
        "2",
        "--data",
        &s(&out),
    ]);
    ok(&from_shards);
    let losses = |t: &str| {
        t.lines()
            .filter(|l| l.starts_with("loss "))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&from_text.stdout), losses(&from_shards.stdout));
    assert!(
        !losses(&from_text.stdout).is_empty(),
        "{}",
        from_text.stdout
    );
}
