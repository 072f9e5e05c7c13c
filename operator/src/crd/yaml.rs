//! Rendering of the CRD YAML committed under `crds/` (the `crdgen` binary writes it; a test
//! fails when the committed files drift from the Rust types).

use crate::crd::install;
use crate::{Error, Result};

/// `(file name, YAML)` of every CRD ([`install::crds`]), in a fixed order, object keys sorted.
pub fn render() -> Result<Vec<(&'static str, String)>> {
    let files = [
        "serving.dspark.dev_dsparkdeployments.yaml",
        "serving.dspark.dev_dsparkcosttables.yaml",
    ];
    files
        .into_iter()
        .zip(install::crds())
        .map(|(file, crd)| {
            let value = serde_json::to_value(&crd).map_err(|e| Error::Serialize {
                what: "CRD",
                source: e,
            })?;
            let yaml =
                serde_yaml::to_string(&install::sorted(value)).map_err(|e| Error::Serialize {
                    what: "CRD",
                    source: serde_json::Error::io(std::io::Error::other(e)),
                })?;
            Ok((file, yaml))
        })
        .collect()
}

/// The message an invalid sample's `# expect: ...` line names.
pub fn expected_message(sample: &str) -> Option<String> {
    sample
        .lines()
        .find_map(|l| l.strip_prefix("# expect:"))
        .map(|m| m.trim().to_string())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::expected_message;
    use crate::crd::schema_check::refusals;
    use crate::crd::DSparkDeployment;

    #[test]
    fn committed_crds_match_the_rust_types() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
        for (file, yaml) in super::render().unwrap() {
            let path = dir.join(file);
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == yaml,
                "{} is out of date with the Rust types; regenerate it with \
                 `cargo run -p dspark-operator --bin crdgen -- crds/`",
                path.display()
            );
        }
    }

    /// Every sample under config/samples/ parses and passes the CRD's CEL rules and its
    /// OpenAPI validations.
    #[test]
    fn samples_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
        let mut n = 0;
        for (path, text) in yaml_files(&dir) {
            let _: DSparkDeployment =
                serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let raw: serde_json::Value = serde_yaml::from_str(&text).unwrap();
            let refused = refusals(&raw);
            assert!(
                refused.is_empty(),
                "{} is refused: {refused:?}",
                path.display()
            );
            n += 1;
        }
        assert!(n >= 3, "expected the samples under {}", dir.display());
    }

    /// Every sample under config/samples/invalid/ is refused (by a CEL rule or an OpenAPI
    /// validation) with a message containing its `# expect:` line: the rule's message, or
    /// the field's path where the apiserver names it.
    #[test]
    fn invalid_samples_are_refused_with_their_message() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples/invalid");
        let mut n = 0;
        for (path, text) in yaml_files(&dir) {
            let expect = expected_message(&text)
                .unwrap_or_else(|| panic!("{} has no `# expect:` line", path.display()));
            let raw: serde_json::Value =
                serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let messages = refusals(&raw);
            assert!(
                messages.iter().any(|m| m.contains(&expect)),
                "{}: expected '{expect}', got {messages:?}",
                path.display()
            );
            n += 1;
        }
        assert!(n >= 22);
    }

    fn yaml_files(dir: &Path) -> Vec<(std::path::PathBuf, String)> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|p| {
                let text = std::fs::read_to_string(&p).unwrap();
                (p, text)
            })
            .collect()
    }
}
