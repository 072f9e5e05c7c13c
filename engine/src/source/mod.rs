//! Where weights come from: a local path, `hf://ORG/REPO[@REVISION][/FILE[,FILE...]]` (a GGUF
//! file, a whole Hugging Face folder, or the files named: paths and globs such as
//! `*.safetensors`), `s3://BUCKET/KEY` (any S3-compatible endpoint) or `https://...`.
//!
//! Remote sources are fetched once into a cache folder shared by every process that names
//! it (replicas on one cache volume): an exclusive lock per source makes the second process
//! wait and then find the files in place. Every file is downloaded into a part file (resumed
//! where an interrupted download stopped), checked against the checksum the server
//! publishes (the Hub's sha256 / git blob id, an S3 MD5 ETag), and only then moved to its
//! final name, so nothing half-written is ever served. The resolved revision (Hub commit,
//! ETag) comes back in [`Fetched::revision`] and becomes part of the model id that cost
//! tables are keyed by.
//!
//! The protocols are the libraries' (`hf-hub` for the Hub, `object_store` for S3, `reqwest`
//! for plain HTTPS); this module only adds the cache, the lock, the checks and the messages.

mod hf;
mod http;
mod progress;
mod s3;

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

pub use progress::Reporter;

/// A parsed `--model` / `--drafter` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Local(PathBuf),
    HuggingFace {
        repo: String,
        revision: Option<String>,
        /// One path in the repo, or several paths and globs separated by `,`.
        file: Option<String>,
    },
    S3 {
        bucket: String,
        key: String,
    },
    Https(String),
}

use dspark_types::contract::source::SourceUri;
/// The schemes a source may use, for error messages (the contract's).
pub use dspark_types::contract::source::SCHEMES;

/// The grammar is the contract's ([`SourceUri`]: parse and display written once, shared with
/// the operator); this type only holds a local path as a [`PathBuf`].
impl std::str::FromStr for Source {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.parse::<SourceUri>().map_err(anyhow::Error::msg)? {
            SourceUri::Local(p) => Source::Local(PathBuf::from(p)),
            SourceUri::HuggingFace {
                repo,
                revision,
                file,
            } => Source::HuggingFace {
                repo,
                revision,
                file,
            },
            SourceUri::S3 { bucket, key } => Source::S3 { bucket, key },
            SourceUri::Https(u) => Source::Https(u),
        })
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let uri = match self {
            Source::Local(p) => return write!(f, "{}", p.display()),
            Source::HuggingFace {
                repo,
                revision,
                file,
            } => SourceUri::HuggingFace {
                repo: repo.clone(),
                revision: revision.clone(),
                file: file.clone(),
            },
            Source::S3 { bucket, key } => SourceUri::S3 {
                bucket: bucket.clone(),
                key: key.clone(),
            },
            Source::Https(u) => SourceUri::Https(u.clone()),
        };
        write!(f, "{uri}")
    }
}

/// A source made local.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// A GGUF file or a Hugging Face folder, complete and checked.
    pub path: PathBuf,
    /// The resolved revision: the Hub commit sha, the S3 / HTTP ETag (None for local paths).
    pub revision: Option<String>,
    /// A short name: the file's stem, or the repo / folder name.
    pub name: String,
}

impl Fetched {
    /// The model id cost tables are keyed by: the file or folder name, plus `@` and the first
    /// 12 characters of the resolved revision for a remote source (a new commit is a new
    /// model as far as measured speeds go).
    pub fn model_id(&self) -> String {
        match &self.revision {
            Some(r) => format!("{}@{}", self.name, short_rev(r)),
            None => self.name.clone(),
        }
    }
}

/// The short name of a path: its last component without `.gguf`.
pub(crate) fn stem(p: &str) -> String {
    let last = p.trim_end_matches('/').rsplit('/').next().unwrap_or(p);
    let s = last.trim_end_matches(".gguf");
    if s.is_empty() {
        "model".into()
    } else {
        s.to_string()
    }
}

fn short_rev(r: &str) -> String {
    r.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(12)
        .collect()
}

/// Where fetched sources go and how progress is shown.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// The cache folder (Hugging Face sources use the Hub's own layout under it, so the
    /// `huggingface_hub` Python client can share it).
    pub cache: PathBuf,
    /// Hub token (else HF_TOKEN / the cache's token file).
    pub hf_token: Option<String>,
}

impl FetchOptions {
    /// `--cache DIR`, else DSPARK_MODEL_CACHE, else HF_HUB_CACHE, else $HF_HOME/hub, else
    /// ~/.cache/huggingface/hub; the token from HF_TOKEN (or HUGGING_FACE_HUB_TOKEN).
    pub fn from_env(cache: Option<PathBuf>) -> Self {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let cache = cache
            .or_else(|| env("DSPARK_MODEL_CACHE").map(PathBuf::from))
            .or_else(|| env("HF_HUB_CACHE").map(PathBuf::from))
            .or_else(|| env("HF_HOME").map(|h| Path::new(&h).join("hub")))
            .unwrap_or_else(|| {
                Path::new(&env("HOME").unwrap_or_else(|| "/root".into()))
                    .join(".cache/huggingface/hub")
            });
        let hf_token = env("HF_TOKEN")
            .or_else(|| env("HUGGING_FACE_HUB_TOKEN"))
            .map(|t| t.trim().to_string());
        Self { cache, hf_token }
    }
}

/// Makes `source` local (downloading it into the cache unless it is there already).
pub fn resolve(source: &Source, opts: &FetchOptions) -> Result<Fetched> {
    if let Source::Local(p) = source {
        anyhow::ensure!(
            p.exists(),
            "model path {} does not exist (remote sources: {SCHEMES})",
            p.display()
        );
        return Ok(Fetched {
            path: p.clone(),
            revision: None,
            name: stem(&p.to_string_lossy()),
        });
    }
    std::fs::create_dir_all(&opts.cache)
        .with_context(|| format!("cannot create the cache folder {}", opts.cache.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let res = rt.block_on(async {
        match source {
            Source::HuggingFace {
                repo,
                revision,
                file,
            } => hf::fetch(repo, revision.as_deref(), file.as_deref(), opts).await,
            Source::S3 { bucket, key } => s3::fetch(bucket, key, opts).await,
            Source::Https(url) => http::fetch(url, opts).await,
            Source::Local(_) => unreachable!(),
        }
    });
    res.with_context(|| format!("cannot fetch {source}"))
}

/// `source` (parsed from `arg`) at the revision the pins file holds for `arg`: a Hub source
/// is fetched at the pinned commit; S3 and HTTP objects have no old revisions to ask for and
/// are fetched as they are. A missing pins file (nothing pinned yet) pins nothing.
pub fn pinned(arg: &str, source: Source, pins: Option<&Path>) -> Result<Source> {
    let Some(path) = pins else {
        return Ok(source);
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(source),
        Err(e) => anyhow::bail!("cannot read the revision pins {}: {e}", path.display()),
    };
    let Some(rev) = dspark_types::contract::pins::lookup(&text, arg) else {
        return Ok(source);
    };
    Ok(match source {
        Source::HuggingFace { repo, file, .. } => {
            tracing::info!(source = arg, revision = rev, "revision pinned");
            Source::HuggingFace {
                repo,
                revision: Some(rev.to_string()),
                file,
            }
        }
        other => other,
    })
}

/// Parses and resolves a `--model` / `--drafter` argument (at its pinned revision, see
/// [`pinned`]), logging where it came from.
pub fn resolve_arg(arg: &str, cache: Option<PathBuf>, pins: Option<&Path>) -> Result<Fetched> {
    let source = pinned(arg, arg.parse()?, pins)?;
    let remote = !matches!(source, Source::Local(_));
    let f = resolve(&source, &FetchOptions::from_env(cache))?;
    if remote {
        tracing::info!(
            source = %source,
            path = %f.path.display(),
            revision = f.revision.as_deref().unwrap_or("-"),
            "model source ready"
        );
    }
    Ok(f)
}

/// An exclusive lock on `<cache>/.locks/dspark/<name>.lock`, held while one source is
/// fetched: a second process (a replica on the same cache volume) waits here and then finds
/// the files complete.
pub(crate) struct Lock {
    _file: std::fs::File,
}

impl Lock {
    pub(crate) fn acquire(cache: &Path, name: &str) -> Result<Self> {
        let dir = cache.join(".locks").join("dspark");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("{}.lock", sanitize(name)));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open the lock {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                tracing::info!(
                    lock = %path.display(),
                    "another process is fetching {name}; waiting for it"
                );
                file.lock()
                    .with_context(|| format!("cannot lock {}", path.display()))?;
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()))
            }
        }
        Ok(Self { _file: file })
    }
}

/// A file-name-safe form of a source name.
pub(crate) fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// Fails early, with the numbers, when the cache volume cannot hold `need` more bytes.
pub(crate) fn check_space(dir: &Path, need: u64, what: &str) -> Result<()> {
    if let Ok(free) = fs2::available_space(dir) {
        anyhow::ensure!(
            free >= need,
            "no space left for {what}: it needs {} MB, {} MB are free in {} (give the cache volume more room)",
            need.div_ceil(1 << 20),
            free / (1 << 20),
            dir.display()
        );
    }
    Ok(())
}

/// Hex digest of a file with any `digest` hasher.
pub(crate) fn file_digest<D: sha2::Digest>(path: &Path, prefix: &[u8]) -> Result<String> {
    use std::io::Read;
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = D::new();
    h.update(prefix);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        let hf = |r: &str, v: Option<&str>, f: Option<&str>| Source::HuggingFace {
            repo: r.into(),
            revision: v.map(Into::into),
            file: f.map(Into::into),
        };
        let p = |s: &str| s.parse::<Source>().unwrap();
        assert_eq!(p("hf://Qwen/Qwen3-0.6B"), hf("Qwen/Qwen3-0.6B", None, None));
        assert_eq!(
            p("hf://org/repo@v1.0/sub/model.Q4_1.gguf"),
            hf("org/repo", Some("v1.0"), Some("sub/model.Q4_1.gguf"))
        );
        assert_eq!(
            p("hf://org/repo/model.gguf"),
            hf("org/repo", None, Some("model.gguf"))
        );
        assert_eq!(
            p("s3://bucket/models/a.gguf"),
            Source::S3 {
                bucket: "bucket".into(),
                key: "models/a.gguf".into()
            }
        );
        assert_eq!(
            p("https://example.org/a.gguf"),
            Source::Https("https://example.org/a.gguf".into())
        );
        assert_eq!(p("/models/a.gguf"), Source::Local("/models/a.gguf".into()));
        assert_eq!(
            p("hf://org/repo@v1/config.json,*.safetensors"),
            hf("org/repo", Some("v1"), Some("config.json,*.safetensors"))
        );
        for s in [
            "hf://org/repo@v1/x.gguf",
            "hf://o/r/a.json,b/*.gguf",
            "s3://b/k",
            "hf://o/r",
            "https://h/p",
        ] {
            assert_eq!(p(s).to_string(), s);
        }
    }

    #[test]
    fn refuses_unknown_schemes_and_bad_repos() {
        let e = |s: &str| format!("{:#}", s.parse::<Source>().unwrap_err());
        assert!(e("gs://x/y").contains("unknown model source scheme 'gs://'"));
        assert!(e("gs://x/y").contains("hf://"));
        assert!(e("hf://justone").contains("ORG/REPO"));
        assert!(e("hf://o/r@/f").contains("revision"));
        assert!(e("hf://o/r/../x").contains("bad file path"));
        assert!(e("hf://o/r/a.json,,b").contains("bad file path ''"));
        assert!(e("hf://o/r/a.json,../b").contains("bad file path '../b'"));
        assert!(e("s3://bucket").contains("s3://BUCKET/KEY"));
    }

    #[test]
    fn a_pin_sets_the_revision_of_that_hub_source_only() {
        let dir = std::env::temp_dir().join(format!("dspark-pins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pins = dir.join("pins");
        std::fs::write(
            &pins,
            dspark_types::contract::pins::render([
                ("hf://o/r@main/m.gguf", "c0ffee"),
                ("s3://b/k", "etag"),
            ]),
        )
        .unwrap();
        let pin = |arg: &str, file: Option<&Path>| pinned(arg, arg.parse().unwrap(), file).unwrap();
        assert_eq!(
            pin("hf://o/r@main/m.gguf", Some(&pins)).to_string(),
            "hf://o/r@c0ffee/m.gguf"
        );
        // Another source string (even the same repo) is not pinned, nor an S3 object.
        assert_eq!(
            pin("hf://o/r/m.gguf", Some(&pins)).to_string(),
            "hf://o/r/m.gguf"
        );
        assert_eq!(pin("s3://b/k", Some(&pins)).to_string(), "s3://b/k");
        // No pins file yet: nothing pinned.
        assert_eq!(
            pin("hf://o/r@main/m.gguf", Some(&dir.join("none"))).to_string(),
            "hf://o/r@main/m.gguf"
        );
        assert_eq!(
            pin("hf://o/r@main/m.gguf", None).to_string(),
            "hf://o/r@main/m.gguf"
        );
    }

    #[test]
    fn model_id_carries_the_revision() {
        let f = Fetched {
            path: "/c/models--o--r/snapshots/abc/SmolLM2.Q4_1.gguf".into(),
            revision: Some("0123456789abcdef0123".into()),
            name: stem("sub/SmolLM2.Q4_1.gguf"),
        };
        assert_eq!(f.model_id(), "SmolLM2.Q4_1@0123456789ab");
        let local = resolve(
            &Source::Local("/".into()),
            &FetchOptions::from_env(Some("/nonexistent".into())),
        )
        .unwrap();
        assert_eq!(local.model_id(), "model");
        assert_eq!(stem("/m/SmolLM2.Q4_1.gguf"), "SmolLM2.Q4_1");
        assert_eq!(stem("models/qwen3/"), "qwen3");
    }
}
