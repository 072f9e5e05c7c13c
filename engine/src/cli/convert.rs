//! `dspark-engine convert`: rewrites a drafter checkpoint between layouts (this engine's
//! compact form, DeepSpec DSpark, z-lab DFlash) and/or with a compact W1. Serving-side: it
//! needs the target and the drafter's loaders, nothing of training.

use anyhow::{ensure, Result};
use dspark_engine::loader;
use dspark_engine::speculative::dspark::{DSparkDrafter, Layout};
use std::path::PathBuf;

/// `dspark-engine convert`: the arguments.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    #[arg(long, env = "DSPARK_MODEL")]
    pub model: PathBuf,
    /// Drafter checkpoint folder to read: this engine's layout, a DeepSpec DSpark folder or a
    /// z-lab DFlash folder (detected from its config.json).
    #[arg(long)]
    pub drafter: PathBuf,
    /// Folder to write (config.json, model.safetensors); must differ from --drafter.
    #[arg(long)]
    pub out: PathBuf,
    /// Layout to write: `native` (this engine's compact form: the target's embedding and LM
    /// head are used, not stored), `deepspec` (Qwen3DSparkModel, with copies of the target's
    /// embedding and LM head) or `dflash` (z-lab DFlashDraftModel; parallel drafters whose
    /// anchor row is not a draft only).
    #[arg(long, value_enum, default_value = "native")]
    pub to: Layout,
    /// Keep W1 rows for the draft vocabulary only, plus one shared row for every other
    /// token (the mean of theirs): with a 49k-token target and an 8k draft vocabulary this
    /// shrinks W1 six-fold. Only anchors outside the draft vocabulary draft differently.
    #[arg(long)]
    pub compact_w1: bool,
}

/// Reads `--drafter`, writes `--out` in `--to`, and prints both sizes.
pub fn run(a: ConvertArgs) -> Result<()> {
    let same = match (a.drafter.canonicalize(), a.out.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    };
    ensure!(
        !same,
        "--out must differ from --drafter (the input is read, not rewritten)"
    );
    let device = candle_core::Device::Cpu;
    let (model, _) = loader::load(&a.model, &device, true)?;
    let (mut d, from) = DSparkDrafter::load_layout(&a.drafter, &model)?;
    ensure!(
        a.compact_w1 || from != a.to,
        "nothing to convert: {} is already in the {} layout (pass --to another layout, or --compact-w1)",
        a.drafter.display(),
        from.name()
    );
    let w1_rows = d.config().w1_rows();
    if a.to == Layout::Native && d.config().own_embeddings {
        let (c, diff) = d.without_own_embeddings(&model)?;
        println!(
            "the checkpoint's embedding and LM head copies differ from the target's by at most {diff:.3e}; the compact form uses the target's"
        );
        if diff > 1e-2 {
            tracing::warn!(
                max_abs_diff = diff,
                "the drafter's stored embedding / LM head are not this target's (another target, or a quantized one): the compact form drafts differently from the checkpoint"
            );
        }
        d = c;
    }
    if a.compact_w1 {
        d = d.compact_w1(&model)?;
    }
    d.save_as(&a.out, a.to, &model)?;
    let size = |dir: &PathBuf| {
        std::fs::metadata(dir.join("model.safetensors")).map_or(0, |m| m.len()) as f64 / 1e6
    };
    println!(
        "{} ({}, {:.1} MB) -> {} ({}, {:.1} MB): W1 {} -> {} rows",
        a.drafter.display(),
        from.name(),
        size(&a.drafter),
        a.out.display(),
        a.to.name(),
        size(&a.out),
        w1_rows,
        d.config().w1_rows()
    );
    Ok(())
}
