//! `dspark-train` command line: `train`, `calibrate`, `eval` (the flags they had as
//! `dspark-engine` subcommands).

use anyhow::Result;
use clap::{Parser, Subcommand};
use dspark_train::cli;

#[derive(Parser)]
#[command(name = "dspark-train", version = dspark_engine::VERSION, about = "DSpark drafter training, calibration and evaluation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a drafter on self-distilled data (generated first if missing).
    Train(cli::TrainArgs),
    /// Fit the STS temperatures of a drafter on held-out data.
    Calibrate(cli::CalibrateArgs),
    /// Measure acceptance (tau, per position), calibration and speed of drafters.
    Eval(cli::EvalArgs),
}

fn main() -> Result<()> {
    dspark_engine::kernels::pool::pin_candle_threads();
    let telemetry = dspark_telemetry::init("dspark-train")?;
    let res = match Cli::parse().cmd {
        Cmd::Train(a) => cli::run_train(a),
        Cmd::Calibrate(a) => cli::run_calibrate(a),
        Cmd::Eval(a) => cli::run_eval(a),
    };
    telemetry.flush();
    res
}
