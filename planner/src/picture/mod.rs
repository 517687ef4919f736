//! The plan as one SVG picture (`tessera plan --svg`, `tessera explain --svg`): the whole-run
//! summary as text at the top; per pipeline stage, the device memory of one rank as a stacked
//! bar of every named term against the device's capacity; and one step's predicted time per
//! stage (compute, exposed communication, the bubble, the optimizer) as a row of segments.
//!
//! Drawn through plotters' SVG backend: no font or system library. Every number drawn is the
//! plan's own (`predicted.memory`) or the planner's regrouping of its prediction
//! ([`Plan::stage_times`]); this module only draws. The legends are drawn by hand, a swatch
//! beside each name, so that a reader (and the test that parses the SVG) can tell which colour
//! is which term.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::cost::stages::StageTime;
use crate::plan::Plan;
use crate::units;

/// Why a picture could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PictureError {
    #[error("the plan's stages do not split the model's layers, so its step cannot be simulated per stage\n  fix: re-create the plan with `tessera plan … -o plan.json`")]
    Stages,
    #[error("drawing the SVG failed: {0}")]
    Draw(String),
}

/// The picture's width in pixels.
const WIDTH: u32 = 1100;
/// Where the legends start: the charts take the width to their left.
const CHART_WIDTH: u32 = 820;
const LINE: u32 = 20;
const MEMORY_HEIGHT: u32 = 520;
/// Pixels per stage row of the timeline, and what the timeline adds for its axes and caption.
const ROW: u32 = 40;
const TIMELINE_FRAME: u32 = 130;

/// Distinct colours for the memory terms (Tableau's 20), none of them the capacity's red.
const TERM_COLOURS: [RGBColor; 20] = [
    RGBColor(0x4E, 0x79, 0xA7),
    RGBColor(0xA0, 0xCB, 0xE8),
    RGBColor(0xF2, 0x8E, 0x2B),
    RGBColor(0xFF, 0xBE, 0x7D),
    RGBColor(0x59, 0xA1, 0x4F),
    RGBColor(0x8C, 0xD1, 0x7D),
    RGBColor(0xB6, 0x99, 0x2D),
    RGBColor(0xF1, 0xCE, 0x63),
    RGBColor(0x49, 0x98, 0x94),
    RGBColor(0x86, 0xBC, 0xB6),
    RGBColor(0xE1, 0x57, 0x59),
    RGBColor(0xFF, 0x9D, 0x9A),
    RGBColor(0x79, 0x70, 0x6E),
    RGBColor(0xBA, 0xB0, 0xAC),
    RGBColor(0xD3, 0x72, 0xA6),
    RGBColor(0xFA, 0xBF, 0xD2),
    RGBColor(0xB0, 0x7A, 0xA1),
    RGBColor(0xD4, 0xA6, 0xC8),
    RGBColor(0x9D, 0x76, 0x60),
    RGBColor(0xD7, 0xB5, 0xA6),
];
const CAPACITY: RGBColor = RGBColor(0xFF, 0x00, 0x00);

/// The timeline's four parts, in the order a row draws them, with their colours (none of them
/// a memory term's).
const PARTS: [(&str, RGBColor); 4] = [
    ("compute", RGBColor(0x1F, 0x4E, 0x9A)),
    ("exposed communication", RGBColor(0xE0, 0x6C, 0x00)),
    ("bubble", RGBColor(0xCC, 0xCC, 0xCC)),
    ("optimizer", RGBColor(0x2C, 0x8A, 0x2C)),
];

fn parts(t: &StageTime) -> [f64; 4] {
    [t.compute, t.comm, t.bubble, t.optimizer]
}

/// The plan's headline, as `tessera plan` prints it: model, cluster, layout, predicted step
/// time, throughput, MFU and peak memory. The caller may add lines (the whole run's summary).
pub fn headline(plan: &Plan) -> Vec<String> {
    let p = &plan.predicted;
    let m = &p.memory;
    let mut lines = vec![
        format!(
            "{} on {} devices of {}: {}",
            plan.job.model.name,
            plan.parallel.world,
            plan.job.cluster.name,
            plan.parallel.layout().label()
        ),
        format!(
            "predicted step {:.3} s, {:.0} tokens/s ({:.0} per device), MFU {:.1}%, bottleneck stage {}",
            p.step_time_s,
            p.tokens_per_s,
            p.tokens_per_s_per_device,
            100.0 * p.mfu,
            p.bottleneck_stage
        ),
        format!(
            "peak memory {} on stage {} of {} per device",
            units::bytes(m.peak_bytes as f64),
            m.peak_stage,
            units::bytes(m.capacity_bytes as f64)
        ),
    ];
    if !plan.feasible {
        lines.push("INFEASIBLE: this layout does not fit (written with --force)".into());
    }
    // The whole run, where the job or the cluster states any of it (`whole_run::report`).
    lines.extend(
        crate::whole_run::report::lines(&plan.job.model, &plan.job.cluster, p)
            .into_iter()
            .map(|l| l.trim_start().to_string()),
    );
    lines
}

/// The picture of `plan` as an SVG document, `summary` (lines of text) drawn above the charts.
pub fn plan_svg(plan: &Plan, summary: &[String]) -> Result<String, PictureError> {
    let rows = plan.stage_times().ok_or(PictureError::Stages)?;
    let head = LINE * (summary.len() as u32 + 1);
    let timeline = TIMELINE_FRAME + ROW * rows.len() as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, head + MEMORY_HEIGHT + timeline))
            .into_drawing_area();
        draw(&root, plan, summary, &rows, head).map_err(|e| PictureError::Draw(e.to_string()))?;
        root.present()
            .map_err(|e| PictureError::Draw(e.to_string()))?;
    }
    Ok(svg)
}

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plan: &Plan,
    summary: &[String],
    rows: &[StageTime],
    head: u32,
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    for (i, line) in summary.iter().enumerate() {
        let size = if i == 0 { 18 } else { 15 };
        root.draw(&Text::new(
            line.as_str(),
            (16, (12 + LINE * i as u32) as i32),
            ("sans-serif", size).into_font(),
        ))?;
    }
    let (_, rest) = root.split_vertically(head);
    let (memory, timeline) = rest.split_vertically(MEMORY_HEIGHT);
    let (chart, legend) = memory.split_horizontally(CHART_WIDTH);
    memory_chart(&chart, &legend, plan)?;
    let (chart, legend) = timeline.split_horizontally(CHART_WIDTH);
    timeline_chart(&chart, &legend, plan, rows)
}

/// Every term name that holds bytes on some stage, in the order the stages list them.
fn term_names(plan: &Plan) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for t in plan
        .predicted
        .memory
        .per_stage
        .iter()
        .flat_map(|s| &s.terms)
    {
        if t.bytes > 0 && !names.contains(&t.name.as_str()) {
            names.push(&t.name);
        }
    }
    names
}

fn term_colour(i: usize) -> RGBColor {
    TERM_COLOURS.get(i).copied().unwrap_or_else(|| {
        let c = Palette99::pick(i).to_rgba();
        RGBColor(c.0, c.1, c.2)
    })
}

/// A legend: a swatch, then the name to its right, one entry a line.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    entries: &[(String, RGBColor)],
) -> Drawn<DB> {
    area.draw(&Text::new(title, (8, 40), ("sans-serif", 14).into_font()))?;
    for (i, (name, colour)) in entries.iter().enumerate() {
        let y = 64 + 18 * i as i32;
        area.draw(&Rectangle::new([(8, y - 6), (20, y + 6)], colour.filled()))?;
        area.draw(&Text::new(
            name.as_str(),
            (26, y),
            ("sans-serif", 13)
                .into_font()
                .into_text_style(area)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// The stage axis: stage `s` spans `s − 0.5..s + 0.5`. (Plotters' segmented ranges hold
/// their end value as a segment too, and map a one-value range to nothing.)
fn stages(pp: u32) -> std::ops::Range<f64> {
    -0.5..pp.max(1) as f64 - 0.5
}

/// The label of a tick on the stage axis: `stage N` at a stage's centre, else none. `index`
/// turns the position into the stage.
fn stage_label(v: f64, pp: u32, index: impl Fn(u32) -> u32) -> String {
    let r = v.round();
    if (v - r).abs() < 1e-9 && r >= 0.0 && r < pp as f64 {
        format!("stage {}", index(r as u32))
    } else {
        String::new()
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A tick value without float noise (`0.30000000000000004`), for labels a reader can parse.
fn tick(v: f64) -> f64 {
    (v * 1e9).round() / 1e9
}

fn memory_chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    legend_area: &DrawingArea<DB, Shift>,
    plan: &Plan,
) -> Drawn<DB> {
    let m = &plan.predicted.memory;
    let pp = m.per_stage.len() as u32;
    let highest = m.per_stage.iter().map(|s| s.total_bytes).max().unwrap_or(0);
    let top = gib(highest.max(m.capacity_bytes)).max(1e-9) * 1.08;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "device memory of one rank per pipeline stage, every named term",
            ("sans-serif", 16),
        )
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(stages(pp), 0.0..top)?;
    let stage_label = |v: &f64| stage_label(*v, pp, |s| s);
    let gib_label = |v: &f64| format!("{} GiB", tick(*v));
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(pp as usize)
        .x_label_formatter(&stage_label)
        .y_label_formatter(&gib_label)
        .y_desc("GiB per device")
        .draw()?;
    let names = term_names(plan);
    // Bars span the middle of their stage's segment, whatever its width.
    let gap = (CHART_WIDTH / pp.max(1) / 5).min(60);
    for (s, stage) in m.per_stage.iter().enumerate() {
        let s = s as u32;
        let mut below = 0u64;
        for t in stage.terms.iter().filter(|t| t.bytes > 0) {
            let i = names.iter().position(|n| *n == t.name).unwrap_or(0);
            let above = below.saturating_add(t.bytes);
            let mut bar = Rectangle::new(
                [(s as f64 - 0.5, gib(below)), (s as f64 + 0.5, gib(above))],
                term_colour(i).filled(),
            );
            bar.set_margin(0, 0, gap, gap);
            chart.draw_series(std::iter::once(bar))?;
            below = above;
        }
    }
    let cap = gib(m.capacity_bytes);
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(-0.5, cap), (pp as f64 - 0.5, cap)],
        CAPACITY.stroke_width(2),
    )))?;
    let mut entries: Vec<(String, RGBColor)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), term_colour(i)))
        .rev()
        .collect();
    entries.push((
        format!("device capacity {}", units::bytes(m.capacity_bytes as f64)),
        CAPACITY,
    ));
    let title = if m.host.is_some() {
        "terms (top first; host memory and NVMe not drawn)"
    } else {
        "terms (top first)"
    };
    legend(legend_area, title, &entries)
}

fn timeline_chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    legend_area: &DrawingArea<DB, Shift>,
    plan: &Plan,
    rows: &[StageTime],
) -> Drawn<DB> {
    let pp = rows.len() as u32;
    let step = plan.predicted.step_time_s;
    let longest = rows.iter().map(StageTime::total).fold(step, f64::max);
    let right = longest.max(1e-12) * 1.02;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("one step, predicted per pipeline stage: {step:.3} s"),
            ("sans-serif", 16),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..right, stages(pp))?;
    // Stage 0 on top: position i from the bottom is stage pp − 1 − i.
    let stage_label = |v: &f64| stage_label(*v, pp, |i| pp - 1 - i);
    let seconds_label = |v: &f64| format!("{} s", tick(*v));
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(TRANSPARENT)
        .y_labels(pp as usize)
        .y_label_formatter(&stage_label)
        .x_label_formatter(&seconds_label)
        .x_desc("seconds")
        .draw()?;
    for (s, row) in rows.iter().enumerate() {
        let i = pp - 1 - s as u32;
        let mut start = 0.0;
        for (seconds, (_, colour)) in parts(row).into_iter().zip(PARTS) {
            if seconds <= 0.0 {
                continue;
            }
            let mut seg = Rectangle::new(
                [(start, i as f64 - 0.5), (start + seconds, i as f64 + 0.5)],
                colour.filled(),
            );
            seg.set_margin(ROW / 5, ROW / 5, 0, 0);
            chart.draw_series(std::iter::once(seg))?;
            start += seconds;
        }
    }
    let entries: Vec<(String, RGBColor)> = PARTS.iter().map(|(n, c)| (n.to_string(), *c)).collect();
    legend(legend_area, "parts of the step", &entries)
}
