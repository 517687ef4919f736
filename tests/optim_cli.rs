//! Optimisation settings as data: a model spec's `[optimizer]` and `[schedule]` tables reach
//! plan.json's `job.model`, `tessera run` trains with them (its flags override them), every
//! JSON line has the step's `lr` and `grad_norm`, out-of-range values are refused (spec, plan,
//! flag), and `tessera export` passes them on or refuses what an engine cannot state.

mod common;

use std::path::{Path, PathBuf};

use common::{edit_json, export_text, plan_file, refused, run, s, Scratch};

/// tiny on one CPU rank (fast), from `spec`.
fn one_rank_plan(dir: &Scratch, spec: &Path, name: &str) -> PathBuf {
    plan_file(
        dir,
        name,
        &[
            &s(spec),
            "specs/clusters/cpu-8.toml",
            "--devices",
            "1",
            "--micro-batch",
            "2",
            "--zero",
            "0",
        ],
    )
}

/// (lr, grad_norm) of every line of a metrics file.
fn lr_and_norm(path: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["lr"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap())
        })
        .collect()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-6 * want.abs().max(1e-12)
}

#[test]
fn spec_tables_reach_the_plan_and_the_run_trains_with_them() {
    let dir = Scratch::new();
    let spec = dir.copy_edit(
        "specs/models/tiny.toml",
        &[(
            "[training]",
            "[optimizer]\nlr = 2e-3\nmin_lr = 4e-4\nweight_decay = 0.05\nclip_grad = 0.5\n\n[schedule]\nwarmup_steps = 2\ndecay = \"linear\"\ndecay_steps = 6\n\n[training]",
        )],
    );
    let plan = one_rank_plan(&dir, &spec, "plan.json");
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let (o, sc) = (
        &p["job"]["model"]["optimizer"],
        &p["job"]["model"]["schedule"],
    );
    assert_eq!(o["lr"], 2e-3);
    assert_eq!(o["min_lr"], 4e-4);
    assert_eq!(o["beta2"], 0.95, "defaults fill the rest");
    assert_eq!(o["decay_on"], "matrices");
    assert_eq!(sc["decay"], "linear");
    assert_eq!(sc["decay_steps"], 6);
    let m = dir.path("m.jsonl");
    let r = run(&["run", &s(&plan), "--steps", "8", "--metrics", &s(&m)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let got = lr_and_norm(&m);
    // By hand: warm-up 1e-3, 2e-3; then linear from 2e-3 at step 2 to 4e-4 at step 6 (4e-4
    // per step), and 4e-4 after.
    let want = [1e-3, 2e-3, 2e-3, 1.6e-3, 1.2e-3, 8e-4, 4e-4, 4e-4];
    assert_eq!(got.len(), want.len());
    for (i, ((lr, norm), w)) in got.iter().zip(want).enumerate() {
        assert!(close(*lr, w), "step {i}: lr {lr}, by hand {w}");
        assert!(
            norm.is_finite() && *norm > 0.0,
            "step {i}: grad_norm {norm}"
        );
    }
}

#[test]
fn run_flags_override_the_plan_and_each_json_line_has_lr_and_grad_norm() {
    let dir = Scratch::new();
    let plan = one_rank_plan(&dir, Path::new("specs/models/tiny.toml"), "plan.json");
    // WSD over 10 steps with the last 0.4 (4 steps) decaying: warm-up 1, stable to step 6,
    // then 1e-3 → 1e-4 by 2.25e-4 a step.
    let m = dir.path("wsd.jsonl");
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "10",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "1",
        "--decay",
        "wsd",
        "--wsd-decay-fraction",
        "0.4",
        "--metrics",
        &s(&m),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let want = [
        1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4,
    ];
    let got = lr_and_norm(&m);
    for (i, ((lr, norm), w)) in got.iter().zip(want).enumerate() {
        assert!(close(*lr, w), "step {i}: lr {lr}, by hand {w}");
        assert!(*norm > 0.0);
    }
    // The default plan's schedule (warm-up 5, cosine to lr / 10 over --steps): at step 7 of
    // 9, progress (7 − 5) / 4 = 1/2, so (3e-3 + 3e-4) / 2.
    let m = dir.path("cos.jsonl");
    let r = run(&["run", &s(&plan), "--steps", "9", "--metrics", &s(&m)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let got = lr_and_norm(&m);
    assert!(close(got[0].0, 3e-3 / 5.0), "{}", got[0].0);
    assert!(close(got[4].0, 3e-3));
    assert!(close(got[7].0, (3e-3 + 3e-4) / 2.0), "{}", got[7].0);
    // Clipping does not change the norm reported: it is the norm before clipping.
    let m2 = dir.path("noclip.jsonl");
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "1",
        "--clip-grad",
        "0",
        "--metrics",
        &s(&m2),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(close(lr_and_norm(&m2)[0].1, got[0].1));
}

#[test]
fn out_of_range_settings_are_refused_where_they_are_written() {
    let dir = Scratch::new();
    for (edit, key) in [
        ("[optimizer]\nbeta1 = 1.0\n", "optimizer.beta1"),
        (
            "[optimizer]\nlr = 1e-3\nmin_lr = 1e-2\n",
            "optimizer.min_lr",
        ),
        ("[optimizer]\nlr = 0\n", "optimizer.lr"),
        ("[schedule]\nwarmup_steps = -1\n", "schedule.warmup_steps"),
        ("[schedule]\ndecay = \"cosin\"\n", "did you mean \"cosine\""),
        (
            "[schedule]\nwarmup_steps = 10\ndecay_steps = 10\n",
            "schedule.decay_steps",
        ),
        ("[optimizer]\nweight_decy = 0.1\n", "weight_decay"),
    ] {
        let spec = dir.copy_edit(
            "specs/models/tiny.toml",
            &[("[training]", &format!("{edit}\n[training]"))],
        );
        let r = run(&["validate", &s(&spec)]);
        refused(&r, &[key]);
    }
    let plan = one_rank_plan(&dir, Path::new("specs/models/tiny.toml"), "plan.json");
    for (flags, want) in [
        (&["--beta2", "1.5"][..], "--beta2"),
        (&["--min-lr", "1"], "--min-lr"),
        (&["--lr=-1"], "--lr"),
        (&["--eps", "0"], "--eps"),
        (&["--decay", "step"], "--decay"),
        (
            &["--warmup-steps", "8", "--decay-steps", "4"],
            "--decay-steps",
        ),
        (&["--wsd-decay-fraction", "0.5"], "--decay wsd"),
    ] {
        let mut args = vec!["run", plan.to_str().unwrap(), "--steps", "2"];
        args.extend_from_slice(flags);
        refused(&run(&args), &[want]);
    }
    // A hand-edited plan is refused on load, the field named.
    let bad = dir.path("bad.json");
    std::fs::copy(&plan, &bad).unwrap();
    edit_json(&bad, |v| {
        v["job"]["model"]["optimizer"]["beta1"] = 1.0.into()
    });
    refused(
        &run(&["run", &s(&bad), "--steps", "1"]),
        &["job.model.optimizer.beta1", "[0, 1)"],
    );
}

#[test]
fn plans_written_before_the_keys_load_with_the_defaults() {
    let dir = Scratch::new();
    let plan = one_rank_plan(&dir, Path::new("specs/models/tiny.toml"), "plan.json");
    let old = dir.path("old.json");
    std::fs::copy(&plan, &old).unwrap();
    edit_json(&old, |v| {
        let m = v["job"]["model"].as_object_mut().unwrap();
        m.remove("optimizer");
        m.remove("schedule");
    });
    let (a, b) = (dir.path("a.jsonl"), dir.path("b.jsonl"));
    for (p, m) in [(&plan, &a), (&old, &b)] {
        let r = run(&["run", &s(p), "--steps", "2", "--metrics", &s(m)]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
    }
    assert_eq!(lr_and_norm(&a), lr_and_norm(&b));
}

#[test]
fn exports_pass_the_settings_or_refuse_what_the_engine_cannot_state() {
    let dir = Scratch::new();
    let layout = [
        "specs/clusters/dgx-h100-80g.toml",
        "--nodes",
        "1",
        "--dp",
        "2",
        "--tp",
        "4",
        "--pp",
        "1",
        "--micro-batch",
        "1",
        "--sp",
        "--zero",
        "0",
        "--recompute",
        "full",
    ];
    let plan_of = |name: &str, table: &str| {
        let spec = dir.copy_edit(
            "specs/models/llama3-8b.toml",
            &[("[training]", &format!("{table}\n[training]"))],
        );
        let mut args = vec![s(&spec)];
        args.extend(layout.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        plan_file(&dir, name, &args)
    };
    let wsd = plan_of(
        "wsd.json",
        "[optimizer]\nlr = 3e-4\nmin_lr = 3e-5\nbeta2 = 0.98\neps = 1e-6\nclip_grad = 0.8\n[schedule]\nwarmup_steps = 100\ndecay = \"wsd\"\ndecay_steps = 1000\nwsd_decay_fraction = 0.1\n",
    );
    let megatron = export_text(&wsd, "megatron");
    for line in [
        "--lr 0.0003",
        "--min-lr 0.00003",
        "--lr-warmup-iters 100",
        "--lr-decay-style WSD",
        "--lr-decay-iters 1000",
        "--lr-wsd-decay-style linear",
        "--lr-wsd-decay-iters 100",
        "--weight-decay 0.1",
        "--adam-beta1 0.9",
        "--adam-beta2 0.98",
        "--adam-eps 0.000001",
        "--clip-grad 0.8",
    ] {
        assert!(
            megatron.contains(&format!("  {line}\n")),
            "{line}:\n{megatron}"
        );
    }
    refused(&run(&["export", &s(&wsd), "--to", "deepspeed"]), &["WSD"]);
    // torchtitan decays every parameter: a plan that decays matrices only says so in the file.
    assert!(export_text(&wsd, "torchtitan").contains("torchtitan's AdamW decays every parameter"));
    let all = plan_of(
        "all.json",
        "[optimizer]\ndecay_on = \"all\"\nlr = 3e-4\nmin_lr = 3e-5\n[schedule]\nwarmup_steps = 100\ndecay = \"wsd\"\ndecay_steps = 1000\nwsd_decay_fraction = 0.1\n",
    );
    let titan: toml::Table = toml::from_str(&export_text(&all, "torchtitan")).unwrap();
    let (o, l) = (&titan["optimizer"], &titan["lr_scheduler"]);
    assert_eq!(o["name"].as_str(), Some("AdamW"));
    assert_eq!(o["lr"].as_float(), Some(3e-4));
    assert_eq!(o["weight_decay"].as_float(), Some(0.1));
    assert_eq!(l["warmup_steps"].as_integer(), Some(100));
    assert_eq!(l["total_steps"].as_integer(), Some(1000));
    assert_eq!(l["decay_type"].as_str(), Some("linear"));
    assert_eq!(l["decay_ratio"].as_float(), Some(0.1));
    assert!((l["min_lr_factor"].as_float().unwrap() - 0.1).abs() < 1e-12);
    assert_eq!(titan["training"]["max_norm"].as_float(), Some(1.0));
    refused(&run(&["export", &s(&all), "--to", "megatron"]), &["biases"]);
    // The default plan: cosine over the run's steps, in DeepSpeed's optimizer section and
    // Megatron-DeepSpeed's schedule flags.
    let default = plan_of("default.json", "");
    let ds: serde_json::Value = serde_json::from_str(&export_text(&default, "deepspeed")).unwrap();
    assert_eq!(ds["optimizer"]["type"], "AdamW");
    assert_eq!(ds["optimizer"]["params"]["lr"], 3e-3);
    assert_eq!(
        ds["optimizer"]["params"]["betas"],
        serde_json::json!([0.9, 0.95])
    );
    assert_eq!(ds["optimizer"]["params"]["weight_decay"], 0.1);
    assert_eq!(ds["gradient_clipping"], 1.0);
    let r = run(&["export", &s(&default), "--to", "deepspeed"]);
    assert!(
        r.stderr
            .contains("--lr 0.003 --min-lr 0.0003 --lr-warmup-iters 5 --lr-decay-style cosine"),
        "{}",
        r.stderr
    );
}
