//! The PNG chart: dump time, restore time and checkpoint size, one panel
//! each, grouped by workload with one bar per configuration (median, with a
//! min-max whisker when there are several runs). A failed pair gets a red
//! cross instead of a bar.

use crate::error::{Error, Result};
use crate::report::{Document, ResultJson};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::OnceLock;

const FONT_CANDIDATES: &[(&str, &str)] = &[
    ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf"),
    ("/usr/share/fonts/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans-Bold.ttf"),
    ("/usr/share/fonts/TTF/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans-Bold.ttf"),
    (
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Bold.ttf",
    ),
];

/// Registers a system TTF as "sans-serif" (plotters draws text with ab_glyph).
fn fonts() -> std::result::Result<(), String> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for (regular, bold) in FONT_CANDIDATES {
            let Ok(bytes) = std::fs::read(regular) else { continue };
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
                continue;
            }
            if let Ok(b) = std::fs::read(bold) {
                let b: &'static [u8] = Box::leak(b.into_boxed_slice());
                let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, b);
            }
            return Ok(());
        }
        Err("no TrueType font found for the chart (install fonts-dejavu-core)".into())
    })
    .clone()
}

/// Okabe-Ito colours: greys for plain CRIU, warm for CRIU + a compressor,
/// blues and green for criuz.
fn colour(config: &str) -> RGBColor {
    match config {
        "criu-dir" => RGBColor(110, 110, 110),
        "criu-tmpfs" => RGBColor(180, 180, 180),
        "criu-dir+sync" => RGBColor(60, 60, 60),
        "criu+lz4" => RGBColor(230, 159, 0),
        "criu+zstd" => RGBColor(213, 94, 0),
        "criuz-pack" => RGBColor(86, 180, 233),
        "criuz-lz4" => RGBColor(0, 114, 178),
        "criuz-zstd" => RGBColor(0, 158, 115),
        _ => RGBColor(204, 121, 167),
    }
}

fn err<E: std::fmt::Display>(e: E) -> Error {
    Error::Invalid(format!("drawing the chart: {e}"))
}

struct Metric {
    title: &'static str,
    unit: &'static str,
    get: fn(&ResultJson) -> Option<(f64, f64, f64)>,
}

const MIB: f64 = (1u64 << 20) as f64;

const METRICS: [Metric; 3] = [
    Metric {
        title: "Dump: from the start of the checkpoint until it is complete at its destination",
        unit: "seconds",
        get: |r| r.dump_s.map(|f| (f.median, f.min, f.max)),
    },
    Metric {
        title: "Restore: from the start until CRIU reports the process restored",
        unit: "seconds",
        get: |r| r.restore_s.map(|f| (f.median, f.min, f.max)),
    },
    Metric {
        title: "Checkpoint size at its destination (black line: raw CRIU images)",
        unit: "MiB",
        get: |r| r.bytes.map(|b| (b as f64 / MIB, b as f64 / MIB, b as f64 / MIB)),
    },
];

pub fn draw(path: &Path, doc: &Document) -> Result<()> {
    fonts().map_err(Error::Invalid)?;
    let mut workloads: Vec<&str> = Vec::new();
    let mut configs: Vec<&str> = Vec::new();
    for r in &doc.results {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
        if !configs.contains(&r.config.as_str()) {
            configs.push(&r.config);
        }
    }
    let nw = workloads.len().max(1);
    let nc = configs.len().max(1);
    let width = (180 + nw * (nc * 20 + 36)).clamp(1100, 3000) as u32;
    let height = 1500u32;
    let find = |w: &str, c: &str| doc.results.iter().find(|r| r.workload == w && r.config == c);

    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (header, body) = root.split_vertically(96);

    let s = &doc.settings;
    let m = &doc.machine;
    let mut title = format!(
        "criuz-bench: {} MiB per workload, {} run{} each, {} cores, {:.0} GiB RAM, kernel {}, CRIU {}",
        s.size_mib,
        s.runs,
        if s.runs == 1 { "" } else { "s" },
        m.cores,
        m.memory as f64 / (1u64 << 30) as f64,
        m.kernel,
        m.criu_version
    );
    if let Some(r) = s.link_bytes_per_s {
        title.push_str(&format!(", link {:.0} MB/s", r as f64 / 1e6));
    }
    if s.cold {
        title.push_str(", cold page cache");
    }
    header.draw(&Text::new(title, (20, 12), ("sans-serif", 22).into_font().style(FontStyle::Bold))).map_err(err)?;
    let legend_font = ("sans-serif", 17).into_font();
    let mut x = 20;
    for c in &configs {
        header.draw(&Rectangle::new([(x, 52), (x + 22, 70)], colour(c).filled())).map_err(err)?;
        header.draw(&Text::new(c.to_string(), (x + 28, 53), legend_font.clone())).map_err(err)?;
        x += 40 + 10 * c.len() as i32;
    }
    header.draw(&PathElement::new(vec![(x, 61), (x + 22, 61)], BLACK.stroke_width(3))).map_err(err)?;
    header.draw(&Text::new("raw CRIU images", (x + 28, 53), legend_font.clone())).map_err(err)?;
    x += 190;
    header.draw(&Text::new("x", (x, 51), ("sans-serif", 20).into_font().color(&RED))).map_err(err)?;
    header.draw(&Text::new("failed (not intact)", (x + 18, 53), legend_font)).map_err(err)?;

    let panels = body.split_evenly((3, 1));
    let group = 0.82;
    let slot = group / nc as f64;
    for (mi, (metric, area)) in METRICS.iter().zip(panels.iter()).enumerate() {
        let mut ymax: f64 = 0.0;
        for r in &doc.results {
            if let Some((med, _, max)) = (metric.get)(r) {
                ymax = ymax.max(med).max(max);
            }
            if mi == 2 {
                ymax = ymax.max(r.raw_bytes.unwrap_or(0) as f64 / MIB);
            }
        }
        let ymax = if ymax > 0.0 { ymax * 1.12 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(metric.title, ("sans-serif", 19).into_font().style(FontStyle::Bold))
            .margin_left(12)
            .margin_right(20)
            .margin_top(6)
            .x_label_area_size(34)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..nw as f64, 0f64..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_label_formatter(&|_| String::new())
            .y_labels(8)
            .y_desc(metric.unit)
            .y_label_formatter(&|v| if ymax < 10.0 { format!("{v:.2}") } else { format!("{v:.0}") })
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .light_line_style(WHITE)
            .draw()
            .map_err(err)?;

        for (wi, w) in workloads.iter().enumerate() {
            let x0 = wi as f64 + (1.0 - group) / 2.0;
            for (ci, c) in configs.iter().enumerate() {
                let Some(r) = find(w, c) else { continue };
                let left = x0 + ci as f64 * slot + slot * 0.06;
                let right = x0 + (ci + 1) as f64 * slot - slot * 0.06;
                let mid = (left + right) / 2.0;
                match (metric.get)(r) {
                    Some((med, min, max)) => {
                        chart
                            .draw_series(std::iter::once(Rectangle::new(
                                [(left, 0.0), (right, med)],
                                colour(c).filled(),
                            )))
                            .map_err(err)?;
                        if max > min {
                            let q = (right - left) / 4.0;
                            let whisker = vec![
                                PathElement::new(vec![(mid, min), (mid, max)], BLACK.stroke_width(1)),
                                PathElement::new(vec![(mid - q, min), (mid + q, min)], BLACK.stroke_width(1)),
                                PathElement::new(vec![(mid - q, max), (mid + q, max)], BLACK.stroke_width(1)),
                            ];
                            chart.draw_series(whisker).map_err(err)?;
                        }
                    }
                    None => {
                        let (px, py) = chart.backend_coord(&(mid, 0.0));
                        let style =
                            ("sans-serif", 20).into_font().color(&RED).pos(Pos::new(HPos::Center, VPos::Bottom));
                        root.draw(&Text::new("x", (px, py - 4), style)).map_err(err)?;
                    }
                }
            }
            if mi == 2 {
                let raws: Vec<f64> = configs
                    .iter()
                    .filter_map(|c| find(w, c).and_then(|r| r.raw_bytes))
                    .map(|b| b as f64 / MIB)
                    .collect();
                if let Some(raw) = super::report::median(&raws) {
                    let line = PathElement::new(vec![(x0, raw), (x0 + group, raw)], BLACK.stroke_width(2));
                    chart.draw_series(std::iter::once(line)).map_err(err)?;
                }
            }
            let (px, py) = chart.backend_coord(&(wi as f64 + 0.5, 0.0));
            let style = TextStyle::from(("sans-serif", 17).into_font().style(FontStyle::Bold))
                .pos(Pos::new(HPos::Center, VPos::Top));
            root.draw(&Text::new(w.to_string(), (px, py + 8), style)).map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}
