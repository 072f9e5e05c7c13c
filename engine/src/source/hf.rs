//! `hf://ORG/REPO[@REVISION][/FILE]` through the `hf-hub` client (HF_ENDPOINT, chunked
//! downloads that resume from the last committed chunk, the Hub's cache layout). This file
//! adds what the client leaves out: resolving the revision to one commit first (so every
//! file of a folder comes from the same commit), checking each file against the sha256 /
//! git blob id the Hub publishes, retries, a blocking lock for replicas sharing the cache,
//! an offline path for complete snapshots, and errors that say what to do.

use super::{check_space, file_digest, FetchOptions, Fetched, Lock, Reporter};
use anyhow::{Context, Result};
use hf_hub::api::tokio::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The Hub's answer to `GET /api/models/{repo}/revision/{rev}?blobs=true`.
#[derive(Debug, Deserialize)]
struct Info {
    sha: String,
    siblings: Vec<Sibling>,
}

#[derive(Debug, Clone, Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

impl Sibling {
    fn size(&self) -> Option<u64> {
        self.lfs.as_ref().map(|l| l.size).or(self.size)
    }
}

/// Files of a Hugging Face model folder the engine reads (config, weights, tokenizer, chat
/// template); other formats' weights (`*.bin`, `*.gguf`, ONNX, ...) are left on the Hub.
fn folder_file(name: &str) -> bool {
    let ext = name.rsplit('.').next().unwrap_or("");
    !name.contains('/')
        && matches!(
            ext,
            "json" | "safetensors" | "txt" | "model" | "jinja" | "tiktoken"
        )
}

const DOWNLOAD_ATTEMPTS: usize = 4;

pub(super) async fn fetch(
    repo: &str,
    revision: Option<&str>,
    file: Option<&str>,
    opts: &FetchOptions,
) -> Result<Fetched> {
    let rev = revision.unwrap_or("main");
    let _lock = Lock::acquire(&opts.cache, &format!("hf-{repo}"))?;
    let token = opts
        .hf_token
        .clone()
        .or_else(|| Cache::new(opts.cache.clone()).token());
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v == "true");
    if offline || is_commit(rev) {
        if let Some(f) = complete(&opts.cache, repo, rev, file) {
            return Ok(f);
        }
        anyhow::ensure!(
            !offline,
            "HF_HUB_OFFLINE is set but hf://{repo}@{rev} is not complete in the cache {}",
            opts.cache.display()
        );
    }
    let api = ApiBuilder::from_env()
        .with_cache_dir(opts.cache.clone())
        .with_token(token.clone())
        .with_progress(false)
        .build()?;
    let info = match info(&api, repo, rev, token.is_some()).await {
        Ok(i) => i,
        Err(e) => {
            let unreachable = e
                .chain()
                .filter_map(|c| c.downcast_ref::<reqwest::Error>())
                .any(|r| r.is_connect() || r.is_timeout());
            if unreachable {
                if let Some(f) = complete(&opts.cache, repo, rev, file) {
                    tracing::warn!(
                        "the Hub is unreachable ({e:#}); using the complete cached hf://{repo}@{rev} ({})",
                        f.revision.as_deref().unwrap_or("")
                    );
                    return Ok(f);
                }
            }
            return Err(e);
        }
    };
    let files = select(&info, repo, rev, file)?;
    let hub_repo = Repo::with_revision(repo.to_string(), RepoType::Model, info.sha.clone());
    let repo_dir = opts.cache.join(hub_repo.folder_name());
    let snapshot = repo_dir.join("snapshots").join(&info.sha);
    let missing: Vec<&Sibling> = files
        .iter()
        .filter(|s| !present(&opts.cache, &snapshot, s))
        .collect();
    let need: u64 = missing.iter().filter_map(|s| s.size()).sum();
    check_space(&opts.cache, need, &format!("hf://{repo}@{rev}"))?;
    for s in missing {
        let mut attempt = 0;
        let path = loop {
            attempt += 1;
            match download_once(opts, &token, &hub_repo, &s.rfilename) {
                Ok(p) => break p,
                Err(e) if attempt < DOWNLOAD_ATTEMPTS && retryable(&e) => {
                    tracing::warn!(
                        file = s.rfilename.as_str(),
                        attempt,
                        "download interrupted ({e}); resuming"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(500 * attempt as u64))
                        .await;
                }
                Err(e) => return Err(explain(e, repo, &s.rfilename, token.is_some())),
            }
        };
        verify(&opts.cache, &path, s)?;
    }
    // The requested name (branch, tag) now points at the commit, as the Hub's cache does.
    Cache::new(opts.cache.clone())
        .repo(Repo::with_revision(
            repo.to_string(),
            RepoType::Model,
            rev.to_string(),
        ))
        .create_ref(&info.sha)?;
    let path = match model_path(file.is_some(), &files) {
        "" => snapshot.clone(),
        f => snapshot.join(f),
    };
    let marker = marker(&opts.cache, repo, &info.sha, file);
    std::fs::create_dir_all(marker.parent().expect("marker has a parent"))?;
    std::fs::write(&marker, path.to_string_lossy().as_bytes())?;
    Ok(fetched(repo, path, info.sha))
}

/// What the engine opens inside the snapshot: the one GGUF of the selection (a named file,
/// or the repo's only GGUF; files named beside it, a tokenizer say, lie next to it), else
/// the folder itself (`""`).
fn model_path(named: bool, files: &[Sibling]) -> &str {
    let ggufs: Vec<&str> = files
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    match (named, files, ggufs.as_slice()) {
        (true, [one], _) => &one.rfilename,
        (_, _, [gguf]) if !files.iter().any(|s| s.rfilename == "config.json") => gguf,
        _ => "",
    }
}

/// One download attempt on a runtime of its own: when a chunk fails, `hf-hub` returns while
/// the chunk tasks it already spawned keep running; dropping the runtime stops them, so the
/// next attempt (which resumes from the part file's last committed chunk) runs alone.
fn download_once(
    opts: &FetchOptions,
    token: &Option<String>,
    repo: &Repo,
    file: &str,
) -> Result<PathBuf, ApiError> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async {
                    ApiBuilder::from_env()
                        .with_cache_dir(opts.cache.clone())
                        .with_token(token.clone())
                        .with_progress(false)
                        .build()?
                        .repo(repo.clone())
                        .download_with_progress(file, Reporter::new())
                        .await
                })
            })
            .join()
            .unwrap_or_else(|_| {
                Err(ApiError::IoError(std::io::Error::other(
                    "download thread panicked",
                )))
            })
    })
}

fn fetched(repo: &str, path: PathBuf, sha: String) -> Fetched {
    let name = if path.extension().is_some_and(|e| e == "gguf") {
        super::stem(&path.to_string_lossy())
    } else {
        repo.rsplit('/').next().unwrap_or(repo).to_string()
    };
    Fetched {
        path,
        revision: Some(sha),
        name,
    }
}

fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
}

/// Where a finished (downloaded and checked) selection of a commit is recorded.
fn marker(cache: &Path, repo: &str, sha: &str, file: Option<&str>) -> PathBuf {
    cache.join(".dspark").join("complete").join(format!(
        "{}--{sha}--{}",
        super::sanitize(repo),
        selection_key(file)
    ))
}

/// A file-name-safe key of a selection: the name itself for one plain path (as before
/// selections existed), plus a digest when `,` or glob characters would collide once
/// sanitized (`a*` and `a?`).
fn selection_key(file: Option<&str>) -> String {
    use sha2::Digest;
    let Some(f) = file else {
        return "_all".into();
    };
    let key = super::sanitize(f);
    if f.contains([',', '*', '?', '[', ']']) {
        let d = sha2::Sha256::digest(f.as_bytes());
        format!("{key}-{:x}", &d)[..key.len() + 13].to_string()
    } else {
        key
    }
}

/// A complete cached copy of `repo@rev` (a commit, or a branch through the cache's refs).
fn complete(cache: &Path, repo: &str, rev: &str, file: Option<&str>) -> Option<Fetched> {
    let sha = if is_commit(rev) {
        rev.to_string()
    } else {
        let folder = Repo::model(repo.to_string()).folder_name();
        std::fs::read_to_string(cache.join(folder).join("refs").join(rev))
            .ok()?
            .trim()
            .to_string()
    };
    let path = PathBuf::from(std::fs::read_to_string(marker(cache, repo, &sha, file)).ok()?);
    path.exists().then(|| fetched(repo, path, sha))
}

async fn info(api: &Api, repo: &str, rev: &str, has_token: bool) -> Result<Info> {
    let api_repo = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    let resp = api_repo
        .info_request()
        .query(&[("blobs", "true")])
        .send()
        .await
        .with_context(|| format!("cannot reach the Hub for hf://{repo} (HF_ENDPOINT)"))?;
    let code = resp.status();
    if !code.is_success() {
        anyhow::bail!(status_message(code.as_u16(), repo, rev, None, has_token));
    }
    resp.json::<Info>()
        .await
        .with_context(|| format!("the Hub's description of hf://{repo}@{rev} is unreadable"))
}

fn status_message(code: u16, repo: &str, rev: &str, file: Option<&str>, has_token: bool) -> String {
    let what = match file {
        Some(f) => format!("{f} of hf://{repo}@{rev}"),
        None => format!("hf://{repo}@{rev}"),
    };
    match (code, has_token) {
        (401, false) | (403, false) => format!(
            "{repo} is gated or private (the Hub answered {code} for {what}): set HF_TOKEN to a token with access to {repo} (and accept its terms on the Hub if it is gated)"
        ),
        (401, true) | (403, true) => format!(
            "the Hub refused the token for {repo} ({code} for {what}): check that HF_TOKEN is valid and has been granted access to {repo}"
        ),
        (404, _) => format!(
            "{what} not found (404): check the repo name and revision (a private repo also answers 404 without HF_TOKEN)"
        ),
        (c, _) => format!("the Hub answered {c} for {what}"),
    }
}

/// Is `name` one of the files `want` names (an exact path or a glob: `*`, `?`, `[...]`, which
/// do not cross `/`, as huggingface_hub's `allow_patterns`)?
fn matches(want: &str, name: &str) -> Result<bool> {
    if !want.contains(['*', '?', '[']) {
        return Ok(want == name);
    }
    let p = glob::Pattern::new(want).with_context(|| format!("bad file pattern '{want}'"))?;
    Ok(p.matches_with(
        name,
        glob::MatchOptions {
            require_literal_separator: true,
            ..Default::default()
        },
    ))
}

/// The files of `info` to fetch: those `file` names (one path, or several paths and globs
/// separated by `,`; each must match something), else the model folder, else the one GGUF.
fn select(info: &Info, repo: &str, rev: &str, file: Option<&str>) -> Result<Vec<Sibling>> {
    let names = || {
        info.siblings
            .iter()
            .map(|s| s.rfilename.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(f) = file {
        let mut out: Vec<Sibling> = Vec::new();
        for want in f.split(',') {
            let mut hit = false;
            for s in &info.siblings {
                if matches(want, &s.rfilename)? {
                    hit = true;
                    if !out.iter().any(|o| o.rfilename == s.rfilename) {
                        out.push(s.clone());
                    }
                }
            }
            anyhow::ensure!(
                hit,
                "hf://{repo}@{rev} has no file '{want}'; it has: {}",
                names()
            );
        }
        return Ok(out);
    }
    if info.siblings.iter().any(|s| s.rfilename == "config.json") {
        return Ok(info
            .siblings
            .iter()
            .filter(|s| folder_file(&s.rfilename))
            .cloned()
            .collect());
    }
    let ggufs: Vec<&Sibling> = info
        .siblings
        .iter()
        .filter(|s| s.rfilename.ends_with(".gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(vec![(*one).clone()]),
        [] => anyhow::bail!(
            "hf://{repo}@{rev} is neither a model folder (no config.json) nor holds a GGUF file; it has: {}",
            names()
        ),
        many => anyhow::bail!(
            "hf://{repo}@{rev} holds several GGUF files; name one: {}",
            many.iter()
                .map(|s| format!("hf://{repo}@{rev}/{}", s.rfilename))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The checksum the Hub publishes for a file: (sha256 of the content) for LFS files, else
/// the git blob id (sha1 of `blob {len}\0` + content). The blob's name in the cache is the
/// ETag the download saw, the same value.
fn expected(s: &Sibling, blob: &str) -> (Option<String>, Option<String>) {
    let hex = |x: &str, n: usize| x.len() == n && x.chars().all(|c| c.is_ascii_hexdigit());
    match (&s.lfs, &s.blob_id) {
        (Some(l), _) => (Some(l.sha256.to_lowercase()), None),
        (None, Some(b)) => (None, Some(b.to_lowercase())),
        (None, None) if hex(blob, 64) => (Some(blob.to_lowercase()), None),
        (None, None) if hex(blob, 40) => (None, Some(blob.to_lowercase())),
        _ => (None, None),
    }
}

fn verified_marker(cache: &Path, blob: &Path) -> PathBuf {
    let name = blob
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    cache.join(".dspark").join("verified").join(name)
}

fn blob_of(pointer: &Path) -> Option<PathBuf> {
    let target = std::fs::read_link(pointer).ok()?;
    Some(pointer.parent()?.join(target))
}

/// Already in the snapshot and checked (checking now if it never was).
fn present(cache: &Path, snapshot: &Path, s: &Sibling) -> bool {
    let pointer = snapshot.join(&s.rfilename);
    if !pointer.exists() {
        return false;
    }
    let Some(blob) = blob_of(&pointer) else {
        return false;
    };
    verified_marker(cache, &blob).exists() || verify(cache, &pointer, s).is_ok()
}

/// Checks a downloaded file against the Hub's checksum and size; a file that fails is
/// removed (blob and snapshot entry), so no later start can pick it up.
fn verify(cache: &Path, pointer: &Path, s: &Sibling) -> Result<()> {
    let blob = blob_of(pointer).unwrap_or_else(|| pointer.to_path_buf());
    let blob_name = blob
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let len = std::fs::metadata(&blob)
        .with_context(|| format!("cannot stat {}", blob.display()))?
        .len();
    let (sha256, git) = expected(s, &blob_name);
    let bad = if s.size().is_some_and(|n| n != len) {
        Some(format!(
            "size {len} bytes, the Hub says {}",
            s.size().unwrap_or(0)
        ))
    } else if let Some(want) = sha256 {
        let got = file_digest::<sha2::Sha256>(&blob, b"")?;
        (got != want).then(|| format!("sha256 {got}, the Hub says {want}"))
    } else if let Some(want) = git {
        let got = file_digest::<sha1::Sha1>(&blob, format!("blob {len}\0").as_bytes())?;
        (got != want).then(|| format!("git blob id {got}, the Hub says {want}"))
    } else {
        tracing::warn!(
            file = s.rfilename.as_str(),
            "the Hub published no checksum; only the size was checked"
        );
        None
    };
    if let Some(why) = bad {
        let _ = std::fs::remove_file(pointer);
        let _ = std::fs::remove_file(&blob);
        anyhow::bail!(
            "checksum mismatch for {}: {why}; the corrupt download was deleted, fetch again",
            s.rfilename
        );
    }
    let m = verified_marker(cache, &blob);
    std::fs::create_dir_all(m.parent().expect("marker has a parent"))?;
    std::fs::write(&m, b"")?;
    Ok(())
}

fn retryable(e: &ApiError) -> bool {
    match e {
        ApiError::RequestError(r) => r.status().is_none_or(|c| c.is_server_error()),
        ApiError::TooManyRetries(_) | ApiError::Join(_) => true,
        _ => false,
    }
}

fn explain(e: ApiError, repo: &str, file: &str, has_token: bool) -> anyhow::Error {
    if let ApiError::RequestError(r) = &e {
        if let Some(code) = r.status() {
            return anyhow::anyhow!(status_message(
                code.as_u16(),
                repo,
                "resolved commit",
                Some(file),
                has_token
            ));
        }
    }
    if let ApiError::IoError(io) = &e {
        if io.raw_os_error() == Some(28) {
            return anyhow::anyhow!(
                "no space left on the cache volume while downloading {file} of hf://{repo}: give it more room"
            );
        }
    }
    anyhow::Error::new(e).context(format!("download of {file} from hf://{repo} failed"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sib(name: &str) -> Sibling {
        Sibling {
            rfilename: name.into(),
            size: None,
            blob_id: None,
            lfs: None,
        }
    }

    #[test]
    fn selects_a_folder_or_the_one_gguf() {
        let info = |names: &[&str]| Info {
            sha: "s".into(),
            siblings: names.iter().map(|n| sib(n)).collect(),
        };
        let pick = |names: &[&str], f: Option<&str>| {
            select(&info(names), "o/r", "main", f)
                .map(|v| v.into_iter().map(|s| s.rfilename).collect::<Vec<_>>())
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            pick(
                &[
                    ".gitattributes",
                    "README.md",
                    "config.json",
                    "model.safetensors",
                    "pytorch_model.bin",
                    "tokenizer.json"
                ],
                None
            )
            .unwrap(),
            ["config.json", "model.safetensors", "tokenizer.json"]
        );
        assert_eq!(
            pick(&["README.md", "m.Q4.gguf"], None).unwrap(),
            ["m.Q4.gguf"]
        );
        assert!(pick(&["a.gguf", "b.gguf"], None)
            .unwrap_err()
            .contains("hf://o/r@main/a.gguf"));
        assert!(pick(&["a.gguf"], Some("c.gguf"))
            .unwrap_err()
            .contains("has no file 'c.gguf'; it has: a.gguf"));
        // Several files: paths and globs, in order, each once; globs do not cross `/`.
        let repo = [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "original/consolidated.safetensors",
            "tokenizer.json",
            "m.Q4.gguf",
            "m.Q8.gguf",
        ];
        assert_eq!(
            pick(
                &repo,
                Some("config.json,*.safetensors,tokenizer.json,config.json")
            )
            .unwrap(),
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "tokenizer.json"
            ]
        );
        assert_eq!(
            pick(&repo, Some("original/*")).unwrap(),
            ["original/consolidated.safetensors"]
        );
        assert!(pick(&repo, Some("config.json,*.bin"))
            .unwrap_err()
            .contains("has no file '*.bin'"));
        assert!(pick(&repo, Some("["))
            .unwrap_err()
            .contains("bad file pattern '['"));
        let files = |f: &str| select(&info(&repo), "o/r", "main", Some(f)).unwrap();
        assert_eq!(model_path(true, &files("*Q8.gguf")), "m.Q8.gguf");
        assert_eq!(
            model_path(true, &files("m.Q4.gguf,tokenizer.json")),
            "m.Q4.gguf"
        );
        assert_eq!(model_path(true, &files("*.gguf")), "");
        assert_eq!(model_path(true, &files("config.json,*.safetensors")), "");
        assert_eq!(model_path(false, &files("config.json,m.Q4.gguf")), "");
        // Selections that sanitize alike keep apart in the completion markers.
        assert_ne!(selection_key(Some("a*")), selection_key(Some("a?")));
        assert_eq!(selection_key(Some("m.Q4.gguf")), "m.Q4.gguf");
    }

    #[test]
    fn gated_messages_name_the_repo_and_the_token() {
        let m = status_message(401, "org/gated", "main", None, false);
        assert!(m.contains("org/gated") && m.contains("HF_TOKEN"), "{m}");
        let m = status_message(403, "org/gated", "main", None, true);
        assert!(m.contains("refused the token"), "{m}");
    }

    #[test]
    fn verify_catches_a_changed_byte_and_deletes_it() {
        let dir = std::env::temp_dir().join(format!("dspark-verify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let body = b"hello weights";
        let sha = file_digest::<sha2::Sha256>(
            &{
                let p = dir.join("good");
                std::fs::write(&p, body).unwrap();
                p
            },
            b"",
        )
        .unwrap();
        let mut s = sib("w.gguf");
        s.lfs = Some(Lfs {
            sha256: sha.clone(),
            size: body.len() as u64,
        });
        verify(&dir, &dir.join("good"), &s).unwrap();
        assert!(dir.join(".dspark/verified/good").exists());
        std::fs::write(dir.join("bad"), b"hello weighta").unwrap();
        let e = verify(&dir, &dir.join("bad"), &s).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch") && e.contains(&sha), "{e}");
        assert!(!dir.join("bad").exists());
        // A git blob id (non-LFS file): sha1 of "blob 13\0hello weights".
        let mut g = sib("config.json");
        g.blob_id = Some(file_digest::<sha1::Sha1>(&dir.join("good"), b"blob 13\0").unwrap());
        verify(&dir, &dir.join("good"), &g).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
