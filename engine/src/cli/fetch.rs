//! `dspark-engine fetch`: a model source downloaded into the cache ahead of time, checked,
//! and reported (JSON on stdout; an init container's termination message).

use anyhow::{Context, Result};
use dspark_engine::source;
use dspark_types::contract::{env as cenv, flags};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct FetchArgs {
    /// hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY (or PREFIX/), https://URL.
    pub source: String,
    /// The cache folder (shared by replicas; default DSPARK_MODEL_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub).
    #[arg(long = flags::CACHE, env = cenv::MODEL_CACHE)]
    pub cache: Option<PathBuf>,
    /// A file of `SOURCE REVISION` lines: a Hub source listed there is fetched at that commit
    /// (the operator pins a branch once the first fetch resolved it). Missing: nothing pinned.
    #[arg(long = flags::REVISION_PINS, env = cenv::REVISION_PINS)]
    pub revision_pins: Option<PathBuf>,
    /// On failure, the error (at most 4096 bytes), on success the JSON printed on stdout: a
    /// Kubernetes init container's termination message, which the operator reads
    /// (ModelAvailable=False with the error; the resolved revision it pins and keys cost
    /// tables by).
    #[arg(long = flags::TERMINATION_LOG)]
    pub termination_log: Option<PathBuf>,
}

pub fn fetch(a: FetchArgs) -> Result<()> {
    let f = match source::resolve_arg(&a.source, a.cache, a.revision_pins.as_deref()) {
        Ok(f) => f,
        Err(e) => {
            if let Some(p) = &a.termination_log {
                let mut msg = format!("{e:#}");
                if msg.len() > 4096 {
                    let mut cut = 4096;
                    while !msg.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    msg.truncate(cut);
                }
                if let Err(w) = std::fs::write(p, msg) {
                    eprintln!("cannot write the termination log {}: {w}", p.display());
                }
            }
            return Err(e);
        }
    };
    let report = serde_json::json!({
        "source": a.source,
        "path": f.path,
        "revision": f.revision,
        "model_id": f.model_id(),
    })
    .to_string();
    println!("{report}");
    if let Some(p) = &a.termination_log {
        std::fs::write(p, &report)
            .with_context(|| format!("cannot write the termination log {}", p.display()))?;
    }
    Ok(())
}
