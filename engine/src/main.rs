//! `dspark-engine` command line: `serve`, `profile`, `convert`, `experiment-report`, `fetch`.
//! Drafter training, calibration and evaluation are `dspark-train` (crate `train/`).

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cli::{convert, fetch, profile, report, serve};
use dspark_engine::VERSION;

#[derive(Parser)]
#[command(name = "dspark-engine", version = VERSION, about = "DSpark serving engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Measure SPS(B) (target forwards per second at B batch tokens) and write a cost table.
    Profile(profile::ProfileArgs),
    /// Rewrite a drafter checkpoint: between layouts (native, DeepSpec DSpark, z-lab DFlash)
    /// and/or with --compact-w1.
    Convert(convert::ConvertArgs),
    /// Summarise an online policy experiment (serve --policy-experiment): per-arm
    /// throughput, per-user rate and load, and each arm's throughput ratio over the baseline
    /// from load-matched neighbouring windows with a 95 % confidence interval.
    ExperimentReport(report::ReportArgs),
    /// Download a model source (hf://ORG/REPO[@REV][/FILE], s3://BUCKET/KEY, https://...)
    /// into the cache ahead of time, check it, and print where it is (JSON on stdout).
    Fetch(fetch::FetchArgs),
}

fn main() -> Result<()> {
    dspark_engine::kernels::pool::pin_candle_threads();
    dspark_engine::kernels::pool::keep_freed_memory();
    // Logs (DSPARK_LOG_FORMAT=json for JSON), and OTLP traces + metrics when OTEL_* asks.
    let telemetry = dspark_telemetry::init("dspark-engine")?;
    let cli = Cli::parse();
    let res = run(cli);
    telemetry.flush();
    res
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Profile(a) => profile::profile(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::ExperimentReport(a) => report::experiment_report(a),
        Cmd::Fetch(a) => fetch::fetch(a),
    }
}
