//! The subcommands of the `dspark-engine` binary, one file each: their flags (clap) and how
//! they call the library. Nothing in the library depends on these.

pub mod convert;
pub mod fetch;
pub mod profile;
pub mod report;
pub mod serve;
