//! `--svg`: the picture of a plan, read back. The SVG is parsed and its shapes converted back to
//! numbers with the scale its own axes print (least squares over the tick labels), then held to
//! the plan.json written beside it: each stage's bar is its memory terms stacked, each term one
//! segment of its legend colour, the capacity line at the device's capacity, and each stage's
//! timeline row the step time long, the bottleneck's row the breakdown's terms regrouped.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use serde_json::Value;

const GPT2: &str = "specs/models/gpt2-124m.toml";
const A100: &str = "specs/clusters/dgx-a100-80g.toml";

/// Positions are whole pixels: a shape's two edges are each rounded (one pixel), and the scale
/// read from rounded tick positions adds at most one more over the axis's span.
const PIXELS: f64 = 2.0;

struct Rect {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    fill: String,
}

struct Label {
    x: f64,
    y: f64,
    anchor: String,
    text: String,
}

struct Svg {
    rects: Vec<Rect>,
    labels: Vec<Label>,
    /// Stroke colour and points of every polyline.
    lines: Vec<(String, Vec<(f64, f64)>)>,
}

fn num(n: roxmltree::Node, attr: &str) -> f64 {
    n.attribute(attr)
        .unwrap_or_else(|| panic!("<{}> without {attr}", n.tag_name().name()))
        .parse()
        .unwrap()
}

fn parse(path: &Path) -> Svg {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let mut svg = Svg {
        rects: vec![],
        labels: vec![],
        lines: vec![],
    };
    for n in doc.descendants().filter(|n| n.is_element()) {
        match n.tag_name().name() {
            "rect" => svg.rects.push(Rect {
                x: num(n, "x"),
                y: num(n, "y"),
                w: num(n, "width"),
                h: num(n, "height"),
                fill: n.attribute("fill").unwrap().to_string(),
            }),
            "text" => svg.labels.push(Label {
                x: num(n, "x"),
                y: num(n, "y"),
                anchor: n.attribute("text-anchor").unwrap_or("").to_string(),
                text: n.text().unwrap_or("").trim().to_string(),
            }),
            "polyline" => svg.lines.push((
                n.attribute("stroke").unwrap().to_string(),
                n.attribute("points")
                    .unwrap()
                    .split_whitespace()
                    .map(|p| {
                        let (x, y) = p.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect(),
            )),
            _ => {}
        }
    }
    svg
}

impl Svg {
    /// The colour of a legend entry: the swatch just left of the name, on its line.
    fn legend(&self, name: &str) -> Option<(usize, String)> {
        let label = self
            .labels
            .iter()
            .find(|l| l.anchor == "start" && l.text == name)?;
        let i = self.rects.iter().position(|r| {
            (r.y + r.h / 2.0 - label.y).abs() <= 2.0
                && r.x + r.w <= label.x
                && r.x + r.w >= label.x - 10.0
        })?;
        Some((i, self.rects[i].fill.clone()))
    }

    /// The pixel of value 0 and pixels per unit of an axis whose tick labels end in `unit`,
    /// fitted to the labels' positions (`y` for a vertical axis).
    fn axis(&self, unit: &str, anchor: &str, vertical: bool) -> (f64, f64) {
        let ticks: Vec<(f64, f64)> = self
            .labels
            .iter()
            .filter(|l| l.anchor == anchor)
            .filter_map(|l| {
                let v: f64 = l.text.strip_suffix(unit)?.parse().ok()?;
                Some((v, if vertical { l.y } else { l.x }))
            })
            .collect();
        assert!(ticks.len() >= 3, "too few `{unit}` ticks: {}", ticks.len());
        let n = ticks.len() as f64;
        let mv = ticks.iter().map(|t| t.0).sum::<f64>() / n;
        let mp = ticks.iter().map(|t| t.1).sum::<f64>() / n;
        let cov: f64 = ticks.iter().map(|t| (t.0 - mv) * (t.1 - mp)).sum();
        let var: f64 = ticks.iter().map(|t| (t.0 - mv).powi(2)).sum();
        let per = cov / var;
        (mp - per * mv, per)
    }
}

fn plan_and_picture(dir: &Scratch, name: &str, args: &[&str]) -> (Value, Svg) {
    let json = dir.path(&format!("{name}.json"));
    let svg = dir.path(&format!("{name}.svg"));
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(["-o".into(), s(&json), "--svg".into(), s(&svg)]);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let r = run(&all);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (plan, parse(&svg))
}

const GIB: f64 = (1u64 << 30) as f64;

/// Every stage's bar is its terms stacked in the plan's order, each of its legend colour and
/// its bytes tall; the capacity line sits at the capacity. Returns the number of bars checked.
fn check_memory(plan: &Value, svg: &Svg) {
    let memory = &plan["predicted"]["memory"];
    let stages = memory["per_stage"].as_array().unwrap();
    let (zero, per_gib) = svg.axis(" GiB", "end", true);
    assert!(per_gib < 0.0, "the memory axis grows upwards");
    let px = |bytes: f64| zero + per_gib * bytes / GIB;
    let mut colours: HashMap<String, String> = HashMap::new();
    let mut swatches = vec![];
    for t in stages.iter().flat_map(|s| s["terms"].as_array().unwrap()) {
        let name = t["name"].as_str().unwrap();
        if t["bytes"].as_u64().unwrap() == 0 || colours.contains_key(name) {
            continue;
        }
        let (i, fill) = svg
            .legend(name)
            .unwrap_or_else(|| panic!("no legend entry for the term {name}"));
        assert!(
            !colours.values().any(|c| *c == fill),
            "{name} shares its colour"
        );
        swatches.push(i);
        colours.insert(name.to_string(), fill);
    }
    // The bars: rects of a term's colour that are not legend swatches, by stage from the left.
    let mut bars: Vec<Vec<&Rect>> = vec![];
    let mut xs: Vec<f64> = vec![];
    for (i, r) in svg.rects.iter().enumerate() {
        if swatches.contains(&i) || !colours.values().any(|c| *c == r.fill) {
            continue;
        }
        match xs.iter().position(|x| (x - r.x).abs() < 0.5) {
            Some(k) => bars[k].push(r),
            None => {
                xs.push(r.x);
                bars.push(vec![r]);
            }
        }
    }
    for r in bars.iter().flatten() {
        assert!(r.w > 0.0 && r.h >= 0.0, "a bar {} wide, {} tall", r.w, r.h);
    }
    let left = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let right = bars
        .iter()
        .flatten()
        .map(|r| r.x + r.w)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut order: Vec<usize> = (0..xs.len()).collect();
    order.sort_by(|a, b| xs[*a].total_cmp(&xs[*b]));
    assert_eq!(order.len(), stages.len(), "one bar per stage");
    for (stage, k) in stages.iter().zip(order) {
        let s = stage["stage"].as_u64().unwrap();
        let bar = &bars[k];
        let mut below = 0.0f64;
        let mut drawn = 0;
        for t in stage["terms"].as_array().unwrap() {
            let (name, bytes) = (t["name"].as_str().unwrap(), t["bytes"].as_f64().unwrap());
            if bytes == 0.0 {
                continue;
            }
            let above = below + bytes;
            let want = (px(above), px(below));
            match bar.iter().find(|r| r.fill == colours[name]) {
                Some(r) => {
                    drawn += 1;
                    assert!(
                        (r.y - want.0).abs() <= PIXELS && (r.y + r.h - want.1).abs() <= PIXELS,
                        "stage {s} {name}: drawn from y {} to {}, its {bytes} B stacked on {below} B are y {} to {}",
                        r.y + r.h,
                        r.y,
                        want.1,
                        want.0
                    );
                }
                // Plotters draws nothing for a term under a pixel.
                None => assert!(
                    (want.1 - want.0).abs() < 1.0,
                    "stage {s}: {name} ({bytes} B) not drawn"
                ),
            }
            below = above;
        }
        assert_eq!(drawn, bar.len(), "stage {s}: a segment that is no term");
        let total = stage["total_bytes"].as_f64().unwrap();
        assert_eq!(below, total, "stage {s}: the terms sum to the total");
        let top = bar.iter().map(|r| r.y).fold(f64::INFINITY, f64::min);
        assert!(
            (top - px(total)).abs() <= PIXELS,
            "stage {s}: the bar tops at y {top}, its {total} B at y {}",
            px(total)
        );
    }
    let capacity = memory["capacity_bytes"].as_f64().unwrap();
    let (_, red) = svg
        .labels
        .iter()
        .find(|l| l.text.starts_with("device capacity"))
        .and_then(|l| svg.legend(&l.text))
        .expect("a legend entry for the capacity");
    let lines: Vec<&Vec<(f64, f64)>> = svg
        .lines
        .iter()
        .filter(|(c, _)| *c == red)
        .map(|(_, p)| p)
        .collect();
    assert_eq!(lines.len(), 1, "one capacity line");
    let xs: Vec<f64> = lines[0].iter().map(|p| p.0).collect();
    assert!(
        xs.iter().any(|x| *x <= left) && xs.iter().any(|x| *x >= right),
        "the capacity line spans x {xs:?}, the bars {left} to {right}"
    );
    for (_, y) in lines[0] {
        assert!(
            (y - px(capacity)).abs() <= PIXELS,
            "the capacity line at y {y}, {capacity} B at y {}",
            px(capacity)
        );
    }
}

/// The breakdown's terms in the picture's four parts.
fn part(term: &str) -> usize {
    match term {
        "compute" | "recompute" | "host_floor" | "nccl_interference" => 0,
        "tp_comm" | "cp_comm" | "ep_comm" | "pp_p2p_blocking" | "offload_copies" | "dp_exposed" => {
            1
        }
        "pipeline_bubble" => 2,
        "optimizer" | "host_optimizer" => 3,
        other => panic!("a breakdown term the picture does not place: {other}"),
    }
}

const PARTS: [&str; 4] = ["compute", "exposed communication", "bubble", "optimizer"];

/// Every stage's row runs from 0 to the step time, its parts back to back; the bottleneck's
/// row is the breakdown's terms, regrouped.
fn check_timeline(plan: &Value, svg: &Svg) {
    let p = &plan["predicted"];
    let step = p["step_time_s"].as_f64().unwrap();
    let pp = plan["parallel"]["pp"].as_u64().unwrap() as usize;
    let (zero, per_s) = svg.axis(" s", "middle", false);
    let mut colours = vec![];
    let mut swatches = vec![];
    for name in PARTS {
        let (i, fill) = svg.legend(name).expect("a legend entry per part");
        swatches.push(i);
        colours.push(fill);
    }
    let mut rows: Vec<(f64, Vec<&Rect>)> = vec![];
    for (i, r) in svg.rects.iter().enumerate() {
        if swatches.contains(&i) || !colours.contains(&r.fill) {
            continue;
        }
        match rows.iter().position(|(y, _)| (y - r.y).abs() < 0.5) {
            Some(k) => rows[k].1.push(r),
            None => rows.push((r.y, vec![r])),
        }
    }
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!(rows.len(), pp, "one row per stage, stage 0 on top");
    let mut bottom = f64::NEG_INFINITY;
    for (y, row) in &rows {
        let h = row[0].h;
        assert!(h > 0.0, "a row {h} tall");
        for r in row {
            assert!(
                r.w >= 0.0 && r.h == h,
                "a segment {} wide, {} tall",
                r.w,
                r.h
            );
        }
        assert!(*y >= bottom, "rows overlap at y {y}");
        bottom = y + h;
    }
    let mut bottleneck = [0.0; 4];
    for t in p["breakdown"].as_array().unwrap() {
        bottleneck[part(t["name"].as_str().unwrap())] += t["seconds"].as_f64().unwrap();
    }
    let b = p["bottleneck_stage"].as_u64().unwrap() as usize;
    for (s, (_, row)) in rows.iter_mut().enumerate() {
        row.sort_by(|a, c| a.x.total_cmp(&c.x));
        let mut end = zero;
        for r in row.iter() {
            assert!(
                (r.x - end).abs() <= 1.0,
                "stage {s}: a gap before x {}",
                r.x
            );
            end = r.x + r.w;
        }
        assert!(
            (end - (zero + per_s * step)).abs() <= PIXELS,
            "stage {s}: the row ends at x {end}, the step's {step} s at x {}",
            zero + per_s * step
        );
        if s == b {
            for (k, want) in bottleneck.iter().enumerate() {
                let got: f64 = row
                    .iter()
                    .filter(|r| r.fill == colours[k])
                    .map(|r| r.w)
                    .sum();
                assert!(
                    (got - per_s * want).abs() <= PIXELS,
                    "bottleneck stage {s}, {}: {got} px wide, the breakdown's {want} s are {} px",
                    PARTS[k],
                    per_s * want
                );
            }
        }
    }
}

/// The plan and picture of `args`, the picture checked against the plan.
fn drawn(dir: &Scratch, name: &str, args: &[&str]) -> (Value, Svg) {
    let (plan, svg) = plan_and_picture(dir, name, args);
    check_memory(&plan, &svg);
    check_timeline(&plan, &svg);
    (plan, svg)
}

#[test]
fn plan_svg_draws_the_plans_numbers() {
    let dir = Scratch::new();
    let (plan, svg) = drawn(
        &dir,
        "gpt2",
        &["plan", GPT2, A100, "--devices", "8", "--pp", "2"],
    );
    assert_eq!(plan["parallel"]["pp"], 2);
    let headline = &svg.labels[0].text;
    assert!(headline.starts_with("gpt2-124m on 8 devices"), "{headline}");

    // explain draws the same picture from the file.
    let again = dir.path("again.svg");
    let r = run(&["explain", &s(&dir.path("gpt2.json")), "--svg", &s(&again)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(
        std::fs::read(&again).unwrap(),
        std::fs::read(dir.path("gpt2.svg")).unwrap()
    );
}

/// One stage (no pipeline): one bar, one row, the capacity line across.
#[test]
fn plan_svg_draws_a_single_stage() {
    let dir = Scratch::new();
    let (plan, _) = drawn(
        &dir,
        "flat",
        &[
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--dp",
            "8",
            "--micro-batch",
            "2",
        ],
    );
    assert_eq!(plan["parallel"]["pp"], 1);
}

/// A layout that does not fit, written with --force, still draws: bars past the capacity line,
/// the summary saying so. Its terms are tall, so the scale is checked over the whole axis.
#[test]
fn plan_svg_draws_a_forced_plan() {
    let dir = Scratch::new();
    let (plan, svg) = drawn(
        &dir,
        "forced",
        &[
            "plan",
            "specs/models/llama3-70b.toml",
            A100,
            "--devices",
            "8",
            "--dp",
            "1",
            "--tp",
            "4",
            "--pp",
            "2",
            "--micro-batch",
            "1",
            "--zero",
            "0",
            "--recompute",
            "none",
            "--sp",
            "--schedule",
            "1f1b",
            "--force",
        ],
    );
    assert_eq!(plan["feasible"], false);
    assert!(
        svg.labels.iter().any(|l| l.text.starts_with("INFEASIBLE")),
        "the summary says it does not fit"
    );
}

/// `--svg` may not name an input, nor another output: refused before anything is written.
#[test]
fn svg_refuses_to_overwrite_an_input_or_output() {
    let dir = Scratch::new();
    let (_, _) = plan_and_picture(
        &dir,
        "gpt2",
        &["plan", GPT2, A100, "--devices", "8", "--pp", "2"],
    );
    let json = dir.path("gpt2.json");
    let model = dir.copy_edit(GPT2, &[]);
    let before = Inputs::of(&[&json, &model]);
    let (j, m) = (s(&json), s(&model));
    refused(&run(&["explain", &j, "--svg", &j]), &["--svg", "PLAN"]);
    refused(&run(&["plan", &m, A100, "--svg", &m]), &["--svg", "MODEL"]);
    let out = s(&dir.path("out"));
    refused(
        &run(&["plan", &m, A100, "-o", &out, "--svg", &out]),
        &["-o", "--svg"],
    );
    before.unchanged();
    assert!(!dir.path("out").exists());
}
