//! `--plot FILE.svg`: the loss curve of a run as an SVG document (train loss per step and
//! validation loss at the steps that evaluated, against training tokens seen). No font or
//! system library is needed.

use plotters::prelude::*;
use tessera_planner::plan::Plan;

use crate::exec::StepMetrics;

/// The loss curve of a run of `plan` as an SVG document, titled with the model's name.
pub fn loss_curve(plan: &Plan, steps: &[StepMetrics]) -> Result<String, String> {
    let title = format!("{}: loss against training tokens", plan.job.model.name);
    loss_svg(&title, steps)
}

/// The loss curve as an SVG document: train loss per step and validation loss at the steps
/// that evaluated, against training tokens seen.
pub fn loss_svg(title: &str, steps: &[StepMetrics]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 540)).into_drawing_area();
        draw(&root, title, steps).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    steps: &[StepMetrics],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let train: Vec<(f64, f64)> = steps
        .iter()
        .map(|m| (m.tokens_seen as f64, m.loss))
        .collect();
    let val: Vec<(f64, f64)> = steps
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.tokens_seen as f64, v)))
        .collect();
    let all = || train.iter().chain(&val);
    let x_max = all().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (lo, hi) = if lo.is_finite() {
        let pad = ((hi - lo) * 0.05).max(1e-3);
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("training tokens")
        .y_desc("cross-entropy loss")
        .draw()?;
    chart
        .draw_series(LineSeries::new(train, &BLUE))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.clone(), &RED))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart.draw_series(val.into_iter().map(|p| Circle::new(p, 3, RED.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
