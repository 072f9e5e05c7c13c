//! The subcommands of the `dspark-engine` binary, one file each: their flags (clap) and how
//! they call the library. Nothing in the library depends on these.

pub mod convert;
pub mod fetch;
pub mod profile;
pub mod report;
pub mod serve;

use anyhow::Result;
use dspark_engine::source::{self, Fetched};
use dspark_types::contract::{env as cenv, flags};
use std::path::PathBuf;

/// Where `serve` and `profile` find a remote model or drafter (`fetch` documents both).
#[derive(clap::Args)]
pub struct SourceArgs {
    /// The cache folder for remote sources (see `fetch --cache`).
    #[arg(long = flags::CACHE, env = cenv::MODEL_CACHE)]
    pub cache: Option<PathBuf>,
    /// Revisions the deployment pinned (see `fetch --revision-pins`).
    #[arg(long = flags::REVISION_PINS, env = cenv::REVISION_PINS)]
    pub revision_pins: Option<PathBuf>,
}

impl SourceArgs {
    /// `arg` (a local path or a remote source) as a local path, fetched first if remote.
    pub fn resolve(&self, arg: &str) -> Result<Fetched> {
        source::resolve_arg(arg, self.cache.clone(), self.revision_pins.as_deref())
    }
}
