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
