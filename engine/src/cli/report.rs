//! `dspark-engine experiment-report`: an online policy experiment summarised per arm, with
//! load-matched throughput ratios over the baseline.

use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ReportArgs {
    /// A serving engine's base URL (reads GET /experiment)...
    #[arg(long, conflicts_with = "file")]
    pub url: Option<String>,
    /// ...or a saved copy of that JSON.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// The arm the others are compared with.
    #[arg(long, default_value = "none")]
    pub baseline: String,
    /// Most relative difference of mean load (running requests) between paired windows.
    #[arg(long, default_value_t = 0.25)]
    pub load_tolerance: f64,
    /// Windows dropped at the start (warm-up).
    #[arg(long, default_value_t = 1)]
    pub skip: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn experiment_report(a: ReportArgs) -> Result<()> {
    use dspark_engine::experiment::{report, Window};
    let text = match (&a.url, &a.file) {
        (Some(u), _) => {
            let url = format!("{}/experiment", u.trim_end_matches('/'));
            let r = reqwest::blocking::get(&url).with_context(|| format!("cannot reach {url}"))?;
            let code = r.status();
            let body = r.text()?;
            anyhow::ensure!(code.is_success(), "{url}: HTTP {code}: {body}");
            body
        }
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        (None, None) => anyhow::bail!("give --url URL (a serving engine) or --file FILE"),
    };
    #[derive(serde::Deserialize)]
    struct Doc {
        windows: Vec<Window>,
    }
    let doc: Doc = serde_json::from_str(&text).context("not an /experiment document")?;
    let r = report(&doc.windows, &a.baseline, a.load_tolerance, a.skip);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let unsettled: f64 = doc.windows.iter().map(|w| w.unsettled_s).sum();
    println!(
        "{} windows ({} skipped as warm-up; {:.0} s not counted while windows that turn speculation on settled)\n",
        doc.windows.len(),
        a.skip.min(doc.windows.len()),
        unsettled
    );
    println!("| arm | windows | committed tok/s | per-user tok/s | mean running |");
    println!("|---|---:|---:|---:|---:|");
    for s in &r.arms {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} |",
            s.arm, s.windows, s.throughput, s.per_user, s.load
        );
    }
    println!(
        "\n| arm / {} | load-matched pairs | throughput ratio | 95 % CI | per-user ratio |",
        a.baseline
    );
    println!("|---|---:|---:|---|---:|");
    for c in &r.comparisons {
        let ci = c
            .ci95
            .map_or("-".to_string(), |(lo, hi)| format!("{lo:.3} - {hi:.3}"));
        println!(
            "| {} | {} | {:.3} | {} | {:.3} |",
            c.arm, c.pairs, c.ratio, ci, c.per_user_ratio
        );
    }
    if r.comparisons.is_empty() {
        println!("(no load-matched window pairs with '{}' yet)", a.baseline);
    }
    Ok(())
}
