//! Prints the CRD YAML of every DSpark resource (`cargo run -p dspark-operator --bin crdgen`),
//! or, with a directory argument, writes one file per CRD into it (`crdgen crds/`).

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    match std::env::args_os().nth(1).map(PathBuf::from) {
        Some(dir) => {
            for (file, yaml) in dspark_operator::crd::yaml::render()? {
                let path = dir.join(file);
                std::fs::write(&path, yaml)?;
                eprintln!("wrote {}", path.display());
            }
        }
        None => {
            for (_, yaml) in dspark_operator::crd::yaml::render()? {
                print!("---\n{yaml}");
            }
        }
    }
    Ok(())
}
