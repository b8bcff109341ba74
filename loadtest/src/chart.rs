//! The run's chart, as SVG: policies converged over time, and each replica's queue depth.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use plotters::prelude::*;

use crate::sample::Sample;

pub fn write(
    path: &Path,
    samples: &[Sample],
    converged: &HashMap<String, (i64, Instant)>,
    started: Instant,
    objects: usize,
) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut times: Vec<f64> = converged.values().map(|(_, t)| t.duration_since(started).as_secs_f64()).collect();
    times.sort_by(f64::total_cmp);
    let end = times.last().copied().unwrap_or(1.0).max(samples.last().map_or(1.0, |s| s.t)).max(1.0);

    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(320);

    let mut chart = ChartBuilder::on(&top)
        .caption("policies converged (Ready for their latest generation)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..(objects as f64 * 1.05))?;
    chart.configure_mesh().x_desc("seconds").y_desc("converged").draw()?;
    chart.draw_series(LineSeries::new(times.iter().enumerate().map(|(i, t)| (*t, (i + 1) as f64)), &BLUE))?;

    let mut by_replica: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples {
        by_replica.entry(&s.replica).or_default().push((s.t, s.queue_depth));
    }
    let max_depth = samples.iter().map(|s| s.queue_depth).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&bottom)
        .caption("work-queue depth per replica", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..(max_depth * 1.05))?;
    chart.configure_mesh().x_desc("seconds").y_desc("queued").draw()?;
    for (i, (replica, points)) in by_replica.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color))?
            .label(replica.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
