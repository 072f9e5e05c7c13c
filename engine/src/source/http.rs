//! `https://...` (and `http://` on loopback for tests): one file through `reqwest`, cached
//! under `<cache>/https/HOST/<ETag>/NAME`. reqwest has no resumable download, so this keeps
//! the part file's length as the resume point and asks for the rest with `Range` plus
//! `If-Range: <ETag>` (a changed file comes back whole, status 200, and the part restarts).
//! Integrity: a `#sha256=HEX` fragment on the URL is checked when given; else the size.

use super::{check_space, file_digest, FetchOptions, Fetched, Lock, Reporter};
use anyhow::{Context, Result};
use reqwest::header::{CONTENT_LENGTH, ETAG, IF_RANGE, LAST_MODIFIED, RANGE};
use std::io::Write;
use std::path::PathBuf;

const DOWNLOAD_ATTEMPTS: usize = 4;

pub(super) async fn fetch(url: &str, opts: &FetchOptions) -> Result<Fetched> {
    let (url, want_sha) = match url.split_once("#sha256=") {
        Some((u, h)) => (u, Some(h.to_lowercase())),
        None => (url, None),
    };
    let parsed = reqwest::Url::parse(url).with_context(|| format!("bad URL {url}"))?;
    let host = parsed.host_str().unwrap_or("host").to_string();
    let name = parsed
        .path_segments()
        .and_then(|mut s| s.next_back())
        .filter(|s| !s.is_empty())
        .unwrap_or("model.gguf")
        .to_string();
    let _lock = Lock::acquire(&opts.cache, &format!("https-{url}"))?;
    let client = reqwest::Client::new();
    let head = client
        .head(url)
        .send()
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    anyhow::ensure!(
        head.status().is_success(),
        "{url} answered {}",
        head.status()
    );
    let header = |h| {
        head.headers()
            .get(h)
            .and_then(|v: &reqwest::header::HeaderValue| v.to_str().ok())
            .map(str::to_string)
    };
    let tag = header(ETAG)
        .or_else(|| header(LAST_MODIFIED))
        .or_else(|| want_sha.clone())
        .context("the server sends neither ETag nor Last-Modified, so a cached copy could not be told from a changed file; add #sha256=HEX to the URL")?;
    let size: Option<u64> = header(CONTENT_LENGTH).and_then(|v| v.parse().ok());
    let dir = opts
        .cache
        .join("https")
        .join(super::sanitize(&host))
        .join(super::sanitize(&tag.replace('"', "")));
    let dest = dir.join(super::sanitize(&name));
    let fetched = Fetched {
        path: dest.clone(),
        revision: Some(tag.replace('"', "")),
        name: super::stem(&name),
    };
    if dest.exists() {
        return Ok(fetched);
    }
    std::fs::create_dir_all(&dir)?;
    check_space(&dir, size.unwrap_or(0), url)?;
    let part = PathBuf::from(format!("{}.part", dest.display()));
    let progress = Reporter::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match get_rest(&client, url, &tag, size, &part, &progress).await {
            Ok(()) => break,
            Err(e) if attempt < DOWNLOAD_ATTEMPTS => {
                tracing::warn!(url, attempt, "download interrupted ({e:#}); resuming");
                tokio::time::sleep(std::time::Duration::from_millis(500 * attempt as u64)).await;
            }
            Err(e) => return Err(e),
        }
    }
    progress.finish();
    let len = std::fs::metadata(&part)?.len();
    let bad = if size.is_some_and(|s| s != len) {
        Some(format!(
            "size {len} bytes, the server says {}",
            size.unwrap_or(0)
        ))
    } else if let Some(want) = &want_sha {
        let got = file_digest::<sha2::Sha256>(&part, b"")?;
        (&got != want).then(|| format!("sha256 {got}, the URL says {want}"))
    } else {
        None
    };
    if let Some(why) = bad {
        let _ = std::fs::remove_file(&part);
        anyhow::bail!("checksum mismatch for {url}: {why}; the corrupt download was deleted");
    }
    std::fs::rename(&part, &dest)?;
    Ok(fetched)
}

async fn get_rest(
    client: &reqwest::Client,
    url: &str,
    tag: &str,
    size: Option<u64>,
    part: &std::path::Path,
    progress: &Reporter,
) -> Result<()> {
    let have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
    if size.is_some_and(|s| s == have) {
        return Ok(());
    }
    let mut req = client.get(url);
    if have > 0 {
        req = req
            .header(RANGE, format!("bytes={have}-"))
            .header(IF_RANGE, tag);
    }
    let mut resp = req.send().await?;
    let code = resp.status();
    anyhow::ensure!(code.is_success(), "{url} answered {code}");
    let append = code == reqwest::StatusCode::PARTIAL_CONTENT;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(part)?;
    progress.start(url, size.unwrap_or(0), if append { have } else { 0 });
    while let Some(chunk) = resp.chunk().await? {
        f.write_all(&chunk)?;
        progress.add(chunk.len() as u64);
    }
    f.sync_all()?;
    Ok(())
}
