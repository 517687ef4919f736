//! Loading corpora: the detection rule, folders and patterns, the checks at load.

use std::path::PathBuf;

use super::shard::{write_shard, Width};
use super::*;

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("tessera-data-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn shard(&self, name: &str, tokens: &[u32], width: Width) -> PathBuf {
        let mut v = Vec::new();
        write_shard(&mut v, tokens, width).unwrap();
        self.file(name, &v)
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn err(r: Result<impl std::fmt::Debug, DataError>) -> String {
    r.unwrap_err().to_string()
}

fn llmc() -> LoadOptions {
    LoadOptions {
        format: DataFormat::Llmc,
        tokenizer: None,
    }
}

#[test]
fn token_files_are_read_little_endian_and_checked() {
    let d = Dir::new("le");
    let p = d.file("t.bin", &[1u8, 0, 0, 1, 255, 255]);
    let t = Tokens::load(&p).unwrap();
    assert_eq!(t.head(10), vec![1, 256, 65535]);
    assert_eq!(t.parts()[0].kind, PartKind::Headerless);
    let e = err(t.check(50257, 1));
    assert!(e.contains("65535") && e.contains("t.bin"), "{e}");
    d.file("t.bin", &[1u8, 0, 0]);
    assert!(
        Tokens::load(&p).is_err(),
        "odd byte count is a damaged u16 file"
    );
    let p = d.file("t.u32", &[1u8, 0, 1, 0]);
    assert_eq!(Tokens::load(&p).unwrap().head(1), vec![65537]);
}

#[test]
fn text_is_byte_tokens_as_before() {
    let d = Dir::new("text");
    let p = d.file("a.txt", "héllo".as_bytes());
    let t = Tokens::load(&p).unwrap();
    assert_eq!(
        t.head(100),
        "héllo".bytes().map(u32::from).collect::<Vec<_>>()
    );
    assert_eq!(t.vocab_used(), 0xc3 + 1);
    // The fingerprint of a text corpus is FNV-1a over its tokens as u32 LE, as it was.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for tok in "héllo".bytes().map(u32::from) {
        for b in tok.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    assert_eq!(t.fingerprint(), format!("{h:016x}"));
    let gpt2 = LoadOptions {
        format: DataFormat::Auto,
        tokenizer: Some(Tokenizer::Gpt2),
    };
    let p = d.file("b.txt", b"Hello world");
    let t = DataSet::open(&p, &gpt2).unwrap().train;
    assert_eq!(t.head(9), vec![15496, 995]);
    let bad = d.file("c.txt", &[0xff, 0xfe]);
    assert!(err(Tokens::load(&bad)).contains("not UTF-8"));
}

#[test]
fn llmc_shards_are_mapped_and_checked() {
    let d = Dir::new("llmc");
    let ids: Vec<u32> = (0..3000).map(|i| i % 50257).collect();
    let p = d.shard("s.bin", &ids, Width::U16);
    let t = Tokens::load(&p).unwrap();
    assert_eq!(t.parts()[0].kind, PartKind::Llmc);
    assert_eq!(t.len(), 3000);
    assert_eq!(t.head(3000), ids);
    t.check(50257, 64).unwrap();
    let e = err(t.check(2000, 64));
    assert!(
        e.contains("s.bin") && e.contains("token id 2999") && e.contains("first at token 2000"),
        "{e}"
    );
    // Truncated: two bytes short.
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.truncate(bytes.len() - 2);
    let q = d.file("short.bin", &bytes);
    let e = err(Tokens::load(&q));
    assert!(
        e.contains("short.bin") && e.contains("header says 3000 tokens, the file holds 2999"),
        "{e}"
    );
    // Unknown version.
    bytes[4] = 9;
    let q = d.file("v9.bin", &bytes);
    assert!(err(Tokens::load(&q)).contains("unknown llm.c shard version 9"));
    // uint32 shards.
    let big = d.shard("w.bin", &[70000, 1, 2], Width::U32);
    assert_eq!(Tokens::load(&big).unwrap().head(3), vec![70000, 1, 2]);
}

#[test]
fn the_detection_rule_and_forced_formats() {
    let d = Dir::new("detect");
    // No magic: headerless nanoGPT tokens, whatever the size.
    let plain: Vec<u8> = (0..2048u32)
        .flat_map(|i| (i as u16).to_le_bytes())
        .collect();
    let p = d.file("plain.bin", &plain);
    let t = Tokens::load(&p).unwrap();
    assert_eq!((t.parts()[0].kind, t.len()), (PartKind::Headerless, 2048));
    // Forced llm.c: the wrong magic is refused, naming the file.
    let e = err(DataSet::open(&p, &llmc()));
    assert!(e.contains("plain.bin") && e.contains("wrong magic"), "{e}");
    // A shard forced to nanoGPT is read as headerless tokens (its header too).
    let s = d.shard("s.bin", &[5, 6], Width::U16);
    let opts = LoadOptions {
        format: DataFormat::Nanogpt,
        tokenizer: None,
    };
    assert_eq!(DataSet::open(&s, &opts).unwrap().train.len(), 512 + 2);
    // Forced text reads a .bin as text.
    let opts = LoadOptions {
        format: DataFormat::Text,
        tokenizer: None,
    };
    let x = d.file("x.bin", b"abc");
    assert_eq!(
        DataSet::open(&x, &opts).unwrap().train.head(3),
        vec![97, 98, 99]
    );
}

#[test]
fn folders_split_by_name_and_patterns_match() {
    let d = Dir::new("folder");
    let a: Vec<u32> = (0..100).collect();
    let b: Vec<u32> = (100..150).collect();
    d.shard("fw_train_000001.bin", &b, Width::U16);
    d.shard("fw_train_000000.bin", &a, Width::U16);
    d.shard("fw_val_000000.bin", &[7, 8, 9, 10, 11], Width::U16);
    d.file("notes.txt", b"ignored");
    d.file(".fw_train_000002.bin.tmp", b"ignored");
    let set = DataSet::open(&d.0, &LoadOptions::default()).unwrap();
    assert_eq!(set.train.len(), 150);
    assert_eq!(set.train.head(101)[100], 100, "sorted by name");
    let val = set.val.unwrap();
    assert_eq!(val.head(5), vec![7, 8, 9, 10, 11]);
    // Eval sequences: non-overlapping windows from the start.
    assert_eq!(val.eval_windows(1), 2);
    assert_eq!(val.eval_sequences(1, 5), (vec![7, 9], vec![8, 10]));
    assert_eq!(
        set.train.eval_sequences(4, 2),
        (vec![0, 1, 2, 3, 5, 6, 7, 8], vec![1, 2, 3, 4, 6, 7, 8, 9])
    );
    // A pattern.
    let pat = d.0.join("fw_train_*.bin");
    let t = DataSet::open(&pat, &LoadOptions::default()).unwrap();
    assert_eq!((t.train.len(), t.val.is_none()), (150, true));
    let none = d.0.join("nothing_*.bin");
    assert!(err(DataSet::open(&none, &LoadOptions::default())).contains("no file matches"));
    // --val-data on the folder takes its val shards.
    assert_eq!(
        Tokens::open_val(&d.0, &LoadOptions::default())
            .unwrap()
            .len(),
        5
    );
    // An empty val split is refused, naming it.
    d.shard("fw_val_000000.bin", &[], Width::U16);
    let e = err(DataSet::open(&d.0, &LoadOptions::default()));
    assert!(
        e.contains("fw_val_000000.bin") && e.contains("validation split is empty"),
        "{e}"
    );
    // A folder without token files.
    let empty = Dir::new("nofiles");
    empty.file("a.txt", b"x");
    assert!(err(DataSet::open(&empty.0, &LoadOptions::default())).contains("no token files"));
}

#[test]
fn sampled_fingerprints_see_names_headers_and_content() {
    let d = Dir::new("fp");
    let ids: Vec<u32> = (0..5000).map(|i| (i * 7) % 50000).collect();
    let p = d.shard("a_train_000000.bin", &ids, Width::U16);
    let fp = Tokens::load(&p).unwrap().fingerprint();
    assert_eq!(fp, Tokens::load(&p).unwrap().fingerprint());
    let mut changed = ids.clone();
    changed[0] = 1;
    let q = d.shard("a_train_000000.bin", &changed, Width::U16);
    assert_ne!(fp, Tokens::load(&q).unwrap().fingerprint());
    let r = d.shard("b_train_000000.bin", &ids, Width::U16);
    assert_ne!(fp, Tokens::load(&r).unwrap().fingerprint());
}

#[test]
fn shorter_than_one_sequence_names_the_file() {
    let d = Dir::new("short");
    let p = d.shard("s.bin", &[1, 2, 3], Width::U16);
    let e = err(Tokens::load(&p).unwrap().check(256, 8));
    assert!(
        e.contains("s.bin") && e.contains("shorter than one sequence"),
        "{e}"
    );
}

fn utf16(text: &str, big_endian: bool) -> Vec<u8> {
    text.encode_utf16()
        .flat_map(|u| {
            if big_endian {
                u.to_be_bytes()
            } else {
                u.to_le_bytes()
            }
        })
        .collect()
}

fn gpt2() -> LoadOptions {
    LoadOptions {
        format: DataFormat::Auto,
        tokenizer: Some(Tokenizer::Gpt2),
    }
}

#[test]
fn text_encodings_are_detected_and_refused_naming_the_file() {
    let d = Dir::new("enc");
    let text = "Pipeline parallelism splits the layers into stages.\n";
    // A UTF-8 byte-order mark is not text: it is dropped, and the tokens are the same.
    let plain = d.file("plain.txt", text.as_bytes());
    let bom = d.file("bom.txt", &[b"\xef\xbb\xbf", text.as_bytes()].concat());
    for opts in [LoadOptions::default(), gpt2()] {
        assert_eq!(
            DataSet::open(&bom, &opts).unwrap().train.head(1000),
            DataSet::open(&plain, &opts).unwrap().train.head(1000)
        );
    }
    // UTF-16 and UTF-32, with a byte-order mark or (UTF-16) without one: refused, naming the
    // file, the encoding and the conversion.
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "le-bom.txt",
            [&[0xff, 0xfe][..], &utf16(text, false)].concat(),
            "UTF-16LE",
        ),
        (
            "be-bom.txt",
            [&[0xfe, 0xff][..], &utf16(text, true)].concat(),
            "UTF-16BE",
        ),
        ("le.txt", utf16(text, false), "UTF-16LE"),
        ("be.txt", utf16(text, true), "UTF-16BE"),
        (
            "le32.txt",
            [
                &[0xff, 0xfe, 0, 0][..],
                &text
                    .chars()
                    .flat_map(|c| (c as u32).to_le_bytes())
                    .collect::<Vec<_>>(),
            ]
            .concat(),
            "UTF-32LE",
        ),
        (
            "be32.txt",
            text.chars()
                .flat_map(|c| (c as u32).to_be_bytes())
                .collect(),
            "UTF-32BE",
        ),
    ];
    for (name, bytes, encoding) in &cases {
        let p = d.file(name, bytes);
        for opts in [LoadOptions::default(), gpt2()] {
            let e = err(DataSet::open(&p, &opts));
            assert!(
                e.contains(name) && e.contains(encoding) && e.contains("iconv"),
                "{name}: {e}"
            );
            let e = err(Tokens::open_val(&p, &opts));
            assert!(e.contains(name) && e.contains(encoding), "{name}: {e}");
        }
    }
    // NUL bytes with no UTF-16 pattern: not text.
    let nul = d.file("nul.txt", b"abc\0def");
    let e = err(Tokens::load(&nul));
    assert!(
        e.contains("nul.txt") && e.contains("NUL byte at byte 3"),
        "{e}"
    );
    // Invalid UTF-8 is refused at its first bad byte, not read lossily.
    let latin1 = d.file("latin1.txt", b"caf\xe9 au lait\nna\xefve");
    let e = err(Tokens::load(&latin1));
    assert!(
        e.contains("latin1.txt") && e.contains("not UTF-8") && e.contains("byte 3 (line 1)"),
        "{e}"
    );
}

#[test]
fn text_with_no_text_is_refused_alike_under_every_tokenizer() {
    let d = Dir::new("notext");
    let cases: [(&str, &[u8]); 4] = [
        ("empty.txt", b""),
        ("blank.txt", b" \n\t\r\n  \n"),
        ("bom-only.txt", b"\xef\xbb\xbf\n"),
        ("empty.jsonl", b"{\"text\": \"\"}\n{\"text\": \"  \\n\"}\n"),
    ];
    for (name, bytes) in cases {
        let p = d.file(name, bytes);
        let messages: Vec<String> = [LoadOptions::default(), gpt2()]
            .iter()
            .map(|o| err(DataSet::open(&p, o)))
            .collect();
        assert!(
            messages[0].contains(name) && messages[0].contains("holds no text"),
            "{name}: {}",
            messages[0]
        );
        assert_eq!(messages[0], messages[1], "the same under bytes and gpt2");
    }
}

#[test]
fn jsonl_is_read_as_data_prepare_reads_it() {
    let d = Dir::new("jsonl");
    let lines = "{\"text\": \"Hello world\", \"id\": 1}\n\n{\"text\": \"Pipeline stages\"}\n";
    let p = d.file("docs.jsonl", lines.as_bytes());
    for tok in [Tokenizer::Bytes, Tokenizer::Gpt2] {
        let opts = LoadOptions {
            format: DataFormat::Auto,
            tokenizer: Some(tok.clone()),
        };
        let got = DataSet::open(&p, &opts).unwrap().train.head(1000);
        let docs = prepare::documents("docs.jsonl", lines).unwrap();
        let want = prepare::encode_documents(&tok, &docs).unwrap();
        assert_eq!(got, want, "{tok:?}");
    }
    let bytes = Tokens::load(&p).unwrap();
    assert_eq!(bytes.len(), "Hello worldPipeline stages".len());
    // A line that is not a document names the file and line, as prepare does.
    let bad = d.file("bad.jsonl", b"{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
    let e = err(Tokens::load(&bad));
    assert!(e.contains("bad.jsonl:2") && e.contains("\"text\""), "{e}");
}

/// A prepared folder: shards of `train` and `val` and the tessera-data.json prepare writes.
fn prepared(d: &Dir, sub: &str, tokenizer: &str, train: &[u32], val: &[u32]) -> PathBuf {
    let dir = d.0.join(sub);
    std::fs::create_dir_all(&dir).unwrap();
    let t = Tokenizer::parse(tokenizer).unwrap();
    let width = shard::Width::for_vocab(t.vocab());
    let mut shards = Vec::new();
    for (name, split, ids) in [
        ("p_val_000000.bin", "val", val),
        ("p_train_000000.bin", "train", train),
    ] {
        let mut v = Vec::new();
        write_shard(&mut v, ids, width).unwrap();
        std::fs::write(dir.join(name), v).unwrap();
        shards.push(ShardEntry {
            file: name.into(),
            split: split.into(),
            tokens: ids.len() as u64,
        });
    }
    let meta = DataMeta {
        format: META_FORMAT.into(),
        version: 1,
        tokenizer: TokenizerRef::of(&t),
        vocab: t.vocab(),
        separator: t.separator(),
        token_bytes: width.bytes() as u32,
        shards,
    };
    std::fs::write(dir.join(META_FILE), serde_json::to_string(&meta).unwrap()).unwrap();
    dir
}

#[test]
fn a_prepared_folders_meta_is_checked_field_by_field() {
    let d = Dir::new("meta");
    let train: Vec<u32> = (0..300).map(|i| i % 200).collect();
    let dir = prepared(&d, "p", "bytes", &train, &[1, 2, 3, 4]);
    let set = DataSet::open(&dir, &LoadOptions::default()).unwrap();
    set.train.check(256, 8).unwrap();
    let meta_path = dir.join(META_FILE);
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    // Each edit of the record, and the field the refusal must name.
    type Edit = fn(&mut serde_json::Value);
    let edits: [(Edit, &str); 8] = [
        (
            |m| m["shards"][1]["tokens"] = 299.into(),
            "shards[1].tokens",
        ),
        (
            |m| m["shards"][0]["split"] = "train".into(),
            "shards[0].split",
        ),
        (
            |m| m["shards"][1]["file"] = "p_train_000001.bin".into(),
            "shards[1].file",
        ),
        (
            |m| m["shards"].as_array_mut().unwrap().truncate(1),
            "p_train_000000.bin",
        ),
        (|m| m["token_bytes"] = 4.into(), "token_bytes"),
        (|m| m["vocab"] = 50257.into(), "vocab"),
        (|m| m["tokenizer"]["name"] = "gpt3".into(), "tokenizer"),
        (|m| m["separator"] = 50256.into(), "separator"),
    ];
    for (edit, field) in edits {
        let mut m = good.clone();
        edit(&mut m);
        std::fs::write(&meta_path, m.to_string()).unwrap();
        let e = err(DataSet::open(&dir, &LoadOptions::default()));
        assert!(e.contains(META_FILE) && e.contains(field), "{field}: {e}");
        let e = err(Tokens::open_val(&dir, &LoadOptions::default()));
        assert!(e.contains(field), "--val-data, {field}: {e}");
    }
    std::fs::write(&meta_path, good.to_string()).unwrap();
    // A shard in the folder that the record does not list.
    let extra = d.shard("p/p_train_000001.bin", &[5, 6, 7], Width::U16);
    let e = err(DataSet::open(&dir, &LoadOptions::default()));
    assert!(
        e.contains(META_FILE) && e.contains("p_train_000001.bin") && e.contains("not listed"),
        "{e}"
    );
    std::fs::remove_file(extra).unwrap();
    // A shard rewritten with another width.
    d.shard("p/p_train_000000.bin", &train, Width::U32);
    let e = err(DataSet::open(&dir, &LoadOptions::default()));
    assert!(e.contains("token_bytes"), "{e}");
    // An id at or above the vocabulary the record declares, though the model's is larger.
    let mut high = train.clone();
    high[7] = 300;
    d.shard("p/p_train_000000.bin", &high, Width::U16);
    let set = DataSet::open(&dir, &LoadOptions::default()).unwrap();
    let e = err(set.train.check(50257, 8));
    assert!(
        e.contains("p_train_000000.bin") && e.contains("token id 300") && e.contains("vocab"),
        "{e}"
    );
}

#[test]
fn a_glob_across_folders_of_different_tokenizers_is_refused() {
    let d = Dir::new("mix");
    let ids: Vec<u32> = (0..300).map(|i| i % 200).collect();
    prepared(&d, "a", "bytes", &ids, &[1, 2, 3]);
    prepared(&d, "b", "gpt2", &ids, &[1, 2, 3]);
    prepared(&d, "c", "bytes", &ids, &[1, 2, 3]);
    let mixed = d.0.join("*/p_train_*.bin");
    let e = err(DataSet::open(&mixed, &LoadOptions::default()));
    assert!(
        e.contains("tokenizer") && e.contains("gpt2") && e.contains("bytes") && e.contains("/b"),
        "{e}"
    );
    // Folders of one tokenizer are one corpus, which knows its tokenizer.
    let same = d.0.join("[ac]/p_train_*.bin");
    let set = DataSet::open(&same, &LoadOptions::default()).unwrap();
    assert_eq!(set.train.len(), 600);
    assert_eq!(set.train.tokenizer.unwrap().name, "bytes");
    assert_eq!(set.train.declared_vocab, Some(256));
}
