//! `tessera diff`: the same plan is no difference (exit 0); two layouts of one job differ in
//! the layout, the stage split, the memory terms and the step-time terms (exit 1); an unreadable
//! plan is exit 2.

mod common;

use common::*;

const TINY: &str = "specs/models/tiny.toml";
const CPU8: &str = "specs/clusters/cpu-8.toml";

#[test]
fn diff_of_two_layouts_names_what_changed() {
    let dir = Scratch::new();
    let pipelined = tiny_plan(&dir); // dp2·tp2·pp2
    let flat = dir.path("flat.json");
    let r = run(&[
        "plan",
        TINY,
        CPU8,
        "--dp",
        "8",
        "--micro-batch",
        "2",
        "-o",
        &s(&flat),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);

    let same = run(&["diff", &s(&flat), &s(&flat)]);
    assert_eq!(same.code, Some(0), "{}", same.stderr);
    assert!(same.stdout.contains("no differences"), "{}", same.stdout);

    let r = run(&["diff", &s(&flat), &s(&pipelined)]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    let out = &r.stdout;
    let row = |name: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no `{name}` row in:\n{out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(row("dp")[1..], ["8", "2"]);
    assert_eq!(row("pp")[1..], ["1", "2"]);
    assert_eq!(row("tp")[1..], ["1", "2"]);
    assert!(
        out.contains("stage 1") && out.contains("layers 2..4"),
        "{out}"
    );
    // The pipelined plan has a bubble and TP communication the flat one has not.
    assert_eq!(row("pipeline_bubble").last(), Some(&"new"));
    assert_eq!(row("tp_comm").last(), Some(&"new"));
    assert!(out.contains("stage 0 weights_fp32"), "{out}");
    assert!(out.contains("step_time_s"), "{out}");
}

#[test]
fn diff_of_an_unreadable_plan_is_exit_2() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let broken = dir.path("broken.json");
    std::fs::write(&broken, "{\"format\": ").unwrap();
    refused(&run(&["diff", &s(&plan), &s(&broken)]), &[&s(&broken)]);
}

/// The words of the row whose first word is `name`.
fn row<'a>(out: &'a str, name: &str) -> Vec<&'a str> {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no `{name}` row in:\n{out}"))
        .split_whitespace()
        .collect()
}

fn plan_tiny(dir: &Scratch, model: &str, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let out = dir.path(name);
    let o = s(&out);
    let mut args = vec!["plan", model];
    args.extend_from_slice(&README_TINY_LAYOUT[1..]);
    args.extend_from_slice(extra);
    args.extend(["-o", o.as_str()]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    out
}

/// Full recompute of every layer against every second layer: the layout row says so.
#[test]
fn diff_shows_recompute_every() {
    let dir = Scratch::new();
    let every = plan_tiny(&dir, TINY, "every.json", &["--recompute", "full"]);
    let second = plan_tiny(
        &dir,
        TINY,
        "second.json",
        &["--recompute", "full", "--recompute-every", "2"],
    );
    let r = run(&["diff", &s(&every), &s(&second)]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(row(&r.stdout, "recompute_every")[1..], ["1", "2"]);
}

/// Two plans of one model whose vocabulary padding differs export different Megatron
/// arguments, so diff shows it, with the model key behind it: when the padded size is the
/// same (nothing else changes: GPT-2's 50257 is 50304 as a multiple of 64 and of 128) and when
/// it is not (TP 2: a multiple of 128 or of 256).
#[test]
fn diff_shows_vocabulary_padding() {
    const GPT2: &str = "specs/models/gpt2-124m.toml";
    const A100: &str = "specs/clusters/dgx-a100-80g.toml";
    let dir = Scratch::new();
    let model = dir.copy_edit(
        GPT2,
        &[(
            "vocab = 50257",
            "vocab = 50257\nmake_vocab_size_divisible_by = 64",
        )],
    );
    for (tp, dp, multiples, padded) in [
        ("1", "8", ["128", "64"], ["50304", "50304"]),
        ("2", "4", ["256", "128"], ["50432", "50304"]),
    ] {
        let plans: Vec<_> = [GPT2, &s(&model)]
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let out = dir.path(&format!("tp{tp}-{i}.json"));
                let r = run(&[
                    "plan",
                    m,
                    A100,
                    "--tp",
                    tp,
                    "--dp",
                    dp,
                    "--pp",
                    "1",
                    "--micro-batch",
                    "4",
                    "-o",
                    &s(&out),
                ]);
                assert_eq!(r.code, Some(0), "{}", r.stderr);
                out
            })
            .collect();
        let exports: Vec<String> = plans
            .iter()
            .map(|p| {
                let r = run(&["export", &s(p), "--to", "megatron"]);
                assert_eq!(r.code, Some(0), "{}", r.stderr);
                r.stdout
            })
            .collect();
        assert_ne!(exports[0], exports[1], "the Megatron exports differ");
        let r = run(&["diff", &s(&plans[0]), &s(&plans[1])]);
        assert_eq!(r.code, Some(1), "TP {tp}:\n{}", r.stdout);
        assert_eq!(row(&r.stdout, "vocab.multiple")[1..], multiples);
        if padded[0] != padded[1] {
            assert_eq!(row(&r.stdout, "vocab.padded")[1..], padded);
        }
        assert_eq!(
            row(&r.stdout, "model.architecture.vocab_divisible_by")[1..],
            ["128", "64"]
        );
    }
}

/// A plan written before `parallel.vocab` existed against the same plan with it: the key that
/// is absent on one side is shown as `-`.
#[test]
fn diff_shows_a_key_absent_on_one_side() {
    let dir = Scratch::new();
    let new = tiny_plan(&dir);
    let old = dir.path("old.json");
    std::fs::copy(&new, &old).unwrap();
    edit_json(&old, |v| {
        v["parallel"].as_object_mut().unwrap().remove("vocab");
    });
    let r = run(&["diff", &s(&old), &s(&new)]);
    assert_eq!(r.code, Some(1), "{}\n{}", r.stdout, r.stderr);
    assert_eq!(row(&r.stdout, "vocab.padded")[1..], ["-", "256"]);
}
