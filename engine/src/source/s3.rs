//! `s3://BUCKET/KEY` (one file) or `s3://BUCKET/PREFIX/` (a folder) through `object_store`,
//! from any S3-compatible endpoint: credentials and endpoint from the usual variables
//! (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL; plain
//! `http://` endpoints are allowed). Objects land under `<cache>/s3/BUCKET/<ETag>/KEY`, so
//! a changed object is a new folder and a running engine's file is never replaced.
//!
//! Resume: `object_store` has no resumable download, so the part file's length is the resume
//! point and the rest is asked for with a range request conditioned on the same ETag
//! (If-Match), which fails rather than splice two versions of an object.

use super::{check_space, file_digest, FetchOptions, Fetched, Lock, Reporter};
use anyhow::{Context, Result};
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::{path::Path as ObjPath, GetOptions, GetRange, ObjectMeta, ObjectStore};
use std::io::Write;
use std::path::{Path, PathBuf};

const DOWNLOAD_ATTEMPTS: usize = 4;

pub(super) async fn fetch(bucket: &str, key: &str, opts: &FetchOptions) -> Result<Fetched> {
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    let endpoint = std::env::var("AWS_ENDPOINT_URL")
        .or_else(|_| std::env::var("AWS_ENDPOINT"))
        .unwrap_or_default();
    if endpoint.starts_with("http://") {
        b = b.with_allow_http(true);
    }
    let store = b
        .build()
        .context("cannot configure the S3 client (AWS_* variables)")?;
    let _lock = Lock::acquire(&opts.cache, &format!("s3-{bucket}-{key}"))?;
    let objects: Vec<ObjectMeta> = if key.ends_with('/') {
        let prefix = ObjPath::from(key.trim_end_matches('/'));
        let mut v: Vec<ObjectMeta> = store
            .list(Some(&prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<object_store::Result<_>>()
            .map_err(|e| explain(e, bucket, key))?;
        v.sort_by(|a, b| a.location.cmp(&b.location));
        anyhow::ensure!(!v.is_empty(), "s3://{bucket}/{key} holds no objects");
        v
    } else {
        vec![store
            .head(&ObjPath::from(key))
            .await
            .map_err(|e| explain(e, bucket, key))?]
    };
    // One revision for the selection: the object's ETag, or a digest of the folder's.
    let revision = if objects.len() == 1 && !key.ends_with('/') {
        etag(&objects[0])
    } else {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for o in &objects {
            h.update(o.location.as_ref());
            h.update(etag(o));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    };
    let root = opts
        .cache
        .join("s3")
        .join(super::sanitize(bucket))
        .join(super::sanitize(&revision));
    let need: u64 = objects
        .iter()
        .filter(|o| !root.join(o.location.as_ref()).exists())
        .map(|o| o.size)
        .sum();
    check_space(&opts.cache, need, &format!("s3://{bucket}/{key}"))?;
    for o in &objects {
        let dest = root.join(o.location.as_ref());
        if dest.exists() {
            continue;
        }
        download(&store, o, &dest, bucket).await?;
    }
    let path = if key.ends_with('/') {
        root.join(key.trim_end_matches('/'))
    } else {
        root.join(key)
    };
    Ok(Fetched {
        path,
        revision: Some(revision),
        name: super::stem(key),
    })
}

fn etag(o: &ObjectMeta) -> String {
    o.e_tag.clone().unwrap_or_default().replace('"', "")
}

async fn download(store: &AmazonS3, o: &ObjectMeta, dest: &Path, bucket: &str) -> Result<()> {
    let dir = dest.parent().expect("object path has a parent");
    std::fs::create_dir_all(dir)?;
    let part = PathBuf::from(format!("{}.part", dest.display()));
    let progress = Reporter::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        let have = if have > o.size { 0 } else { have };
        progress.start(o.location.as_ref(), o.size, have);
        match fetch_rest(store, o, &part, have, &progress).await {
            Ok(()) => break,
            Err(e) if attempt < DOWNLOAD_ATTEMPTS && retryable(&e) => {
                tracing::warn!(
                    key = o.location.as_ref(),
                    attempt,
                    "download interrupted ({e}); resuming"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500 * attempt as u64)).await;
            }
            Err(e) => {
                return Err(match e.downcast::<object_store::Error>() {
                    Ok(os) => explain(os, bucket, o.location.as_ref()),
                    Err(e) => e,
                })
            }
        }
    }
    progress.finish();
    let len = std::fs::metadata(&part)?.len();
    let tag = etag(o);
    let bad = if len != o.size {
        Some(format!("size {len} bytes, the server says {}", o.size))
    } else if tag.len() == 32 && tag.chars().all(|c| c.is_ascii_hexdigit()) {
        // A single-part upload's ETag is the MD5 of the content; a multipart one
        // ("<md5>-<parts>") depends on the part size, so only the size is checked then.
        let got = file_digest::<md5::Md5>(&part, b"")?;
        (got != tag.to_lowercase()).then(|| format!("md5 {got}, the ETag says {tag}"))
    } else {
        None
    };
    if let Some(why) = bad {
        let _ = std::fs::remove_file(&part);
        anyhow::bail!(
            "checksum mismatch for s3://{bucket}/{}: {why}; the corrupt download was deleted, fetch again",
            o.location
        );
    }
    std::fs::rename(&part, dest)?;
    Ok(())
}

async fn fetch_rest(
    store: &AmazonS3,
    o: &ObjectMeta,
    part: &Path,
    have: u64,
    progress: &Reporter,
) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .with_context(|| format!("cannot write {}", part.display()))?;
    f.set_len(have)?;
    if have == o.size {
        return Ok(());
    }
    let opts = GetOptions {
        range: (have > 0).then_some(GetRange::Offset(have)),
        if_match: o.e_tag.clone(),
        ..Default::default()
    };
    let mut stream = store.get_opts(&o.location, opts).await?.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        f.write_all(&chunk).map_err(|e| {
            if e.raw_os_error() == Some(28) {
                anyhow::anyhow!(
                    "no space left on the cache volume while downloading {}",
                    o.location
                )
            } else {
                anyhow::Error::new(e)
            }
        })?;
        progress.add(chunk.len() as u64);
    }
    f.flush()?;
    f.sync_all()?;
    Ok(())
}

fn retryable(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<object_store::Error>(),
        Some(object_store::Error::Generic { .. })
    )
}

fn explain(e: object_store::Error, bucket: &str, key: &str) -> anyhow::Error {
    match &e {
        object_store::Error::NotFound { .. } => {
            anyhow::anyhow!("s3://{bucket}/{key} not found (404): check the bucket and key")
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            anyhow::anyhow!(
                "access to s3://{bucket}/{key} was denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ({e})"
            )
        }
        object_store::Error::Precondition { .. } => anyhow::anyhow!(
            "s3://{bucket}/{key} changed during the download (ETag differs); fetch again"
        ),
        _ => anyhow::Error::new(e).context(format!("s3://{bucket}/{key}")),
    }
}
