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
    assert!(out.contains("stage 0 weights_bf16"), "{out}");
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
