//! The model-source grammar (`--model`, `--drafter`, `dspark-engine fetch SOURCE`), parsed and
//! displayed here only: a local path (or `file://PATH`), `hf://ORG/REPO[@REVISION][/FILE[,FILE...]]`
//! (a GGUF file, a whole Hugging Face folder, or the files named: paths and globs such as
//! `*.safetensors`), `s3://BUCKET/KEY` or `https://...` (`http://` too, for tests on loopback).
//!
//! The engine parses its flags with [`SourceUri`]; the operator formats the typed
//! `huggingFace` source with its [`std::fmt::Display`], asks [`SourceUri::is_remote`] whether a
//! path is fetched, and admits a DSparkDeployment's `uri` with [`remote_uri_pattern`], a
//! regular expression that accepts exactly what [`SourceUri::parse_admissible`] accepts (a
//! test in the operator evaluates the CRD's rule against this parser).

use std::fmt;

/// The schemes a source may use, for error messages.
pub const SCHEMES: &str = "hf://, s3://, https:// or a local path";

/// A parsed model source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceUri {
    /// A path on the local filesystem (`file://PATH` is the same path).
    Local(String),
    /// A Hugging Face Hub repo.
    HuggingFace {
        /// `ORG/REPO`.
        repo: String,
        /// Branch, tag or commit (default `main`).
        revision: Option<String>,
        /// One path in the repo, or several paths and globs separated by `,`.
        file: Option<String>,
    },
    /// An object (or a folder: a key ending in `/`) in an S3-compatible store.
    S3 { bucket: String, key: String },
    /// A file over HTTPS (or HTTP), the URI as given.
    Https(String),
}

/// Why a source does not parse (the message names the grammar).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceError(pub String);

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SourceError {}

const HF_GRAMMAR: &str = "hf://ORG/REPO[@REVISION][/FILE[,FILE...]]";

impl std::str::FromStr for SourceUri {
    type Err = SourceError;

    fn from_str(s: &str) -> Result<Self, SourceError> {
        let s = s.trim();
        let err = |m: String| Err(SourceError(m));
        if s.is_empty() {
            return err(format!("empty model source; give {SCHEMES}"));
        }
        let Some((scheme, rest)) = s.split_once("://") else {
            return Ok(SourceUri::Local(s.to_string()));
        };
        match scheme {
            "hf" => parse_hf(rest)
                .map_err(|e| SourceError(format!("bad source '{s}': use {HF_GRAMMAR}: {e}"))),
            "s3" => {
                let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() || key.is_empty() {
                    return err(format!(
                        "bad source '{s}': use s3://BUCKET/KEY (a file) or s3://BUCKET/PREFIX/ (a folder)"
                    ));
                }
                Ok(SourceUri::S3 {
                    bucket: bucket.to_string(),
                    key: key.to_string(),
                })
            }
            "https" | "http" => {
                if rest.split('/').next().is_none_or(|h| h.is_empty()) {
                    return err(format!("bad source '{s}': no host"));
                }
                Ok(SourceUri::Https(s.to_string()))
            }
            "file" => Ok(SourceUri::Local(rest.to_string())),
            other => err(format!(
                "unknown model source scheme '{other}://' in '{s}'; use {SCHEMES}"
            )),
        }
    }
}

/// Whether `x` is an ORG or REPO name of the Hub.
fn hub_name(x: &str) -> bool {
    !x.is_empty()
        && x.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

fn parse_hf(rest: &str) -> Result<SourceUri, String> {
    let mut parts = rest.splitn(3, '/');
    let org = parts.next().unwrap_or_default();
    let name_rev = parts.next().unwrap_or_default();
    let file = parts.next().filter(|f| !f.is_empty());
    let (name, revision) = match name_rev.split_once('@') {
        Some((n, r)) => (n, Some(r)),
        None => (name_rev, None),
    };
    if !(hub_name(org) && hub_name(name)) {
        return Err("the repo must be ORG/REPO".into());
    }
    if let Some(r) = revision {
        if r.is_empty() || r.contains(char::is_whitespace) {
            return Err("empty revision after '@'".into());
        }
    }
    if let Some(f) = file {
        for one in f.split(',') {
            if one.split('/').any(|c| c == ".." || c.is_empty()) {
                return Err(format!("bad file path '{one}'"));
            }
        }
    }
    Ok(SourceUri::HuggingFace {
        repo: format!("{org}/{name}"),
        revision: revision.map(str::to_string),
        file: file.map(str::to_string),
    })
}

impl fmt::Display for SourceUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceUri::Local(p) => f.write_str(p),
            SourceUri::HuggingFace {
                repo,
                revision,
                file,
            } => {
                write!(f, "hf://{repo}")?;
                if let Some(r) = revision {
                    write!(f, "@{r}")?;
                }
                if let Some(x) = file {
                    write!(f, "/{x}")?;
                }
                Ok(())
            }
            SourceUri::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
            SourceUri::Https(u) => f.write_str(u),
        }
    }
}

/// The schemes a DSparkDeployment's `uri` may use (`http://` is for tests on loopback only).
pub const ADMISSIBLE_SCHEMES: [&str; 3] = ["hf", "s3", "https"];

impl SourceUri {
    /// Fetched into a cache before it is served (not a path on a volume).
    pub fn is_remote(&self) -> bool {
        !matches!(self, SourceUri::Local(_))
    }

    /// Whether the path or URI `s` names a remote source (a `file://` URI does not).
    pub fn names_remote(s: &str) -> bool {
        s.parse::<SourceUri>().is_ok_and(|u| u.is_remote())
    }

    /// The source a DSparkDeployment's `uri` may name: a remote source of an
    /// [`ADMISSIBLE_SCHEMES`] scheme, written in printable ASCII without spaces
    /// (percent-encode anything else).
    pub fn parse_admissible(s: &str) -> Result<SourceUri, SourceError> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SourceError(format!(
                "'{s}': a source URI is printable ASCII without spaces"
            )));
        }
        let u: SourceUri = s.parse()?;
        let scheme = s.split_once("://").map(|(sc, _)| sc).unwrap_or_default();
        if !u.is_remote() || !ADMISSIBLE_SCHEMES.contains(&scheme) {
            return Err(SourceError(format!(
                "'{s}': use hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY or https://..."
            )));
        }
        Ok(u)
    }
}

// The patterns below are RE2 and Rust `regex` syntax without a backslash, so they can sit
// inside a CEL string literal. Character classes are ranges of printable ASCII (`!`..`~`):
// `[!-~]` any, `[!-.0-~]` any but `/`, `[!-+.0-~-]` any but `/` and `,`, `[!-+0-~-]` any but
// `/`, `,` and `.`.

/// One path component of a file in a Hub repo: neither empty nor `..`, no `/` or `,`.
const COMPONENT: &str = "([!-+0-~-][!-+.0-~-]*|[.][!-+0-~-][!-+.0-~-]*|[.][.][!-+.0-~-]+|[.])";

/// A Hub repo's `ORG/REPO` (either part: letters, digits, `-`, `_`, `.`).
pub const HF_REPO_PATTERN: &str = "^[-A-Za-z0-9_.]+/[-A-Za-z0-9_.]+$";
/// A revision after `@`: printable ASCII but `/`.
pub const HF_REVISION_PATTERN: &str = "^[!-.0-~]+$";
/// `s3://BUCKET/KEY`.
pub const S3_URI_PATTERN: &str = "^s3://[!-.0-~]+/[!-~]+$";

/// One file (or glob) of a Hub repo as the typed `huggingFace.files` names it: leading `/`s
/// are dropped, then components neither empty nor `..`, no `,`.
pub fn hf_file_pattern() -> String {
    format!("^/*{COMPONENT}(/{COMPONENT})*$")
}

/// The regular expression accepting exactly the strings [`SourceUri::parse_admissible`]
/// accepts (the CRD's rule on `uri`).
pub fn remote_uri_pattern() -> String {
    let piece = format!("{COMPONENT}(/{COMPONENT})*");
    let files = format!("{piece}(,{piece})*");
    format!(
        "^(hf://[-A-Za-z0-9_.]+/[-A-Za-z0-9_.]+(@[!-.0-~]+)?(/({files})?)?\
         |s3://[!-.0-~]+/[!-~]+\
         |https://[!-.0-~]+(/[!-~]*)?)$"
    )
}
