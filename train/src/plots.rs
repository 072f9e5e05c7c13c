//! PNG plots of an evaluation (`eval --plots DIR`), drawn with plotters: acceptance length
//! per domain and drafter (`tau.png`), conditional acceptance by block position
//! (`acceptance.png`, where the parallel drafter's suffix decay and the sequential heads'
//! recovery show), and the reliability diagram of the confidence head (`reliability.png`).
//!
//! Text is rendered with a system sans-serif font through fontconfig (plotters' `ttf`
//! backend); the `plots` cargo feature (on by default) builds it.

use crate::eval::DomainStats;
use anyhow::{Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Series colours, one per drafter in order of first appearance (colour-blind safe).
pub const COLORS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];

/// Positions reached fewer times than this are left out of `acceptance.png` (a rate over a
/// handful of blocks is noise).
pub const MIN_REACHED: usize = 10;

/// Reliability bins with fewer confidences than this are left out.
pub const MIN_BIN: usize = 5;

/// Values in first-appearance order.
fn uniq<'a>(it: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for s in it {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

fn color(drafters: &[&str], name: &str) -> RGBColor {
    let i = drafters.iter().position(|d| *d == name).unwrap_or(0);
    COLORS[i % COLORS.len()]
}

/// Writes `tau.png`, `acceptance.png` and `reliability.png` for `stats` under `dir`; returns
/// their paths.
pub fn write_all(stats: &[DomainStats], gamma: usize, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let domains = uniq(stats.iter().map(|s| s.domain.as_str()));
    let drafters = uniq(stats.iter().map(|s| s.drafter.as_str()));
    let paths = [
        dir.join("tau.png"),
        dir.join("acceptance.png"),
        dir.join("reliability.png"),
    ];
    let draw = |path: &Path, f: &dyn Fn(&DrawingArea<BitMapBackend, Shift>) -> Result<()>| {
        let w = 420 * domains.len().max(1) as u32;
        let root = BitMapBackend::new(path, (w.max(640), 420)).into_drawing_area();
        root.fill(&WHITE)?;
        f(&root).with_context(|| {
            format!(
                "cannot draw {} (plots need a sans-serif font found through fontconfig, e.g. the fonts-dejavu-core package)",
                path.display()
            )
        })?;
        root.present()
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok::<_, anyhow::Error>(())
    };
    draw(&paths[0], &|root| {
        tau_bars(root, stats, &domains, &drafters)
    })?;
    draw(&paths[1], &|root| {
        per_domain(root, &domains, |area, domain| {
            acceptance(area, stats, domain, &drafters, gamma)
        })
    })?;
    draw(&paths[2], &|root| {
        per_domain(root, &domains, |area, domain| {
            reliability(area, stats, domain, &drafters)
        })
    })?;
    Ok(paths.to_vec())
}

fn per_domain(
    root: &Area<'_>,
    domains: &[&str],
    mut f: impl FnMut(&Area<'_>, &str) -> Result<()>,
) -> Result<()> {
    let areas = root.split_evenly((1, domains.len().max(1)));
    for (area, domain) in areas.iter().zip(domains) {
        f(area, domain)?;
    }
    Ok(())
}

/// Grouped bars: tau per domain, one bar per drafter.
fn tau_bars(
    root: &DrawingArea<BitMapBackend, Shift>,
    stats: &[DomainStats],
    domains: &[&str],
    drafters: &[&str],
) -> Result<()> {
    let top = stats.iter().map(|s| s.tau).fold(1.0f64, f64::max) * 1.15;
    let n = domains.len() as f64;
    let mut chart = ChartBuilder::on(root)
        .caption(
            "acceptance length tau (tokens per target forward)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..n, 0f64..top)?;
    let names: Vec<String> = domains.iter().map(|d| d.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(domains.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 && i < names.len() {
                names[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc("tau")
        .draw()?;
    let width = 0.8 / drafters.len().max(1) as f64;
    for (j, name) in drafters.iter().enumerate() {
        let c = color(drafters, name);
        let bars: Vec<_> = stats
            .iter()
            .filter(|s| s.drafter == *name)
            .filter_map(|s| {
                let i = domains.iter().position(|d| *d == s.domain)? as f64;
                let x0 = i + 0.1 + j as f64 * width;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + width * 0.9, s.tau)],
                    c.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One domain's panel with the common frame.
fn panel<'a, 'b>(
    area: &'a Area<'b>,
    title: String,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
) -> Result<Chart<'a, 'b>> {
    Ok(ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(40)
        .build_cartesian_2d(x, y)?)
}

/// A drafter's line with markers and its legend entry.
fn line(chart: &mut Chart<'_, '_>, pts: Vec<(f64, f64)>, c: RGBColor, label: String) -> Result<()> {
    chart
        .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))?;
    Ok(())
}

fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, at: SeriesLabelPosition) -> Result<()> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Conditional acceptance at each block position, one line per drafter.
fn acceptance(
    area: &DrawingArea<BitMapBackend, Shift>,
    stats: &[DomainStats],
    domain: &str,
    drafters: &[&str],
    gamma: usize,
) -> Result<()> {
    let mut chart = panel(
        area,
        format!("{domain}: acceptance given earlier positions"),
        0.5..gamma as f64 + 0.5,
        0.0..1.05,
    )?;
    chart
        .configure_mesh()
        .x_labels(gamma)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc(format!("block position (reached >= {MIN_REACHED} times)"))
        .y_desc("conditional acceptance")
        .draw()?;
    for s in stats.iter().filter(|s| s.domain == domain && s.cycles > 0) {
        let c = color(drafters, &s.drafter);
        let pts: Vec<(f64, f64)> = s
            .acceptance
            .iter()
            .zip(&s.reached)
            .enumerate()
            .filter(|(_, (_, &r))| r >= MIN_REACHED)
            .map(|(k, (&a, _))| ((k + 1) as f64, a))
            .collect();
        line(&mut chart, pts, c, s.drafter.clone())?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

/// Reliability diagram: mean confidence against observed acceptance per bin (model drafters).
fn reliability(
    area: &DrawingArea<BitMapBackend, Shift>,
    stats: &[DomainStats],
    domain: &str,
    drafters: &[&str],
) -> Result<()> {
    let mut chart = panel(
        area,
        format!("{domain}: confidence reliability"),
        0.0..1.0,
        0.0..1.0,
    )?;
    chart
        .configure_mesh()
        .x_desc("confidence c_k (bin mean)")
        .y_desc("observed acceptance")
        .draw()?;
    chart.draw_series(LineSeries::new(
        [(0.0, 0.0), (1.0, 1.0)],
        RGBColor(150, 150, 150).stroke_width(1),
    ))?;
    for s in stats
        .iter()
        .filter(|s| s.domain == domain && !s.reliability.is_empty())
    {
        let c = color(drafters, &s.drafter);
        let pts: Vec<(f64, f64)> = s
            .reliability
            .iter()
            .filter(|b| b.2 >= MIN_BIN)
            .map(|b| (b.0, b.1))
            .collect();
        let ece = s.ece_conditional.unwrap_or(f64::NAN) * 100.0;
        let label = format!("{} (ECE {ece:.1} %, bins >= {MIN_BIN})", s.drafter);
        line(&mut chart, pts, c, label)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(drafter: &str, domain: &str, tau: f64, acc: &[f64]) -> DomainStats {
        DomainStats {
            drafter: drafter.into(),
            domain: domain.into(),
            tau,
            cycles: 100,
            acceptance: acc.to_vec(),
            reached: acc.iter().map(|_| 50).collect(),
            reliability: vec![(0.2, 0.25, 40), (0.5, 0.45, 30), (0.8, 0.7, 20)],
            ece_conditional: Some(0.04),
            ..Default::default()
        }
    }

    fn count(img: &image::RgbImage, c: RGBColor) -> usize {
        img.pixels().filter(|p| p.0 == [c.0, c.1, c.2]).count()
    }

    #[test]
    fn plots_draw_every_drafter_on_every_domain() {
        let s = vec![
            stats("parallel", "code", 1.5, &[0.4, 0.3, 0.3]),
            stats("dspark-markov", "code", 1.8, &[0.4, 0.5, 0.6]),
            stats("parallel", "math", 1.4, &[0.35, 0.3, 0.2]),
            stats("dspark-markov", "math", 1.7, &[0.35, 0.5, 0.5]),
        ];
        let dir = dspark_engine::testutil::scratch_dir("plots");
        let paths = write_all(&s, 3, &dir).unwrap();
        assert_eq!(paths.len(), 3);
        for p in &paths {
            let img = image::open(p).unwrap().to_rgb8();
            assert_eq!(img.dimensions(), (840, 420), "{}", p.display());
            // Each drafter's colour is on the canvas (bars, lines, markers and legend).
            for c in &COLORS[..2] {
                assert!(
                    count(&img, *c) > 40,
                    "{}: colour {c:?} missing",
                    p.display()
                );
            }
            // ... and nothing is drawn in a colour no drafter has.
            assert_eq!(count(&img, COLORS[2]), 0, "{}", p.display());
        }
        // A taller bar covers more pixels: markov's tau bars beat parallel's.
        let tau = image::open(&paths[0]).unwrap().to_rgb8();
        assert!(count(&tau, COLORS[1]) > count(&tau, COLORS[0]));
        std::fs::remove_dir_all(dir).ok();
    }
}
