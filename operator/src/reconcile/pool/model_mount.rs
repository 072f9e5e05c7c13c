//! A model source as a container sees it: a read-only volume (image, PVC, host path) and the
//! path inside it, or a remote URI with the credentials its fetch needs.

use k8s_openapi::api::core::v1::{
    EnvFromSource, EnvVar, EnvVarSource, HostPathVolumeSource, ImageVolumeSource,
    PersistentVolumeClaimVolumeSource, SecretEnvSource, SecretKeySelector, Volume, VolumeMount,
};

use super::var;
use crate::crd::ModelSource;
use dspark_types::contract::env as cenv;
use dspark_types::contract::source::SourceUri;

/// A model source as the container sees it: the path (or URI) to pass and the volume to
/// mount, or, for a remote source, what its fetch needs.
pub struct Mounted {
    pub path: String,
    pub volume: Option<(Volume, VolumeMount)>,
    pub remote: Option<Remote>,
}

/// A remote source: fetched by an init container into the cache volume, then served from
/// there by the engine (same URI, same cache).
pub struct Remote {
    pub env: Vec<EnvVar>,
    pub env_from: Vec<EnvFromSource>,
    pub hugging_face: bool,
}

/// Mounts `src` under `/models/{name}` (read-only) and returns the path the engine reads.
pub fn mount_model(src: &ModelSource, name: &str) -> Mounted {
    let dir = format!("/models/{name}");
    if let Some(uri) = src.fetch_uri() {
        let mut env = Vec::new();
        let mut env_from = Vec::new();
        if let Some(t) = src
            .hugging_face
            .as_ref()
            .and_then(|h| h.token_secret_ref.as_ref())
        {
            env.push(EnvVar {
                name: cenv::HF_TOKEN.into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: t.name.clone(),
                        key: t.key.clone().unwrap_or_else(|| "token".into()),
                        optional: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        if let Some(s3) = &src.s3 {
            if let Some(e) = &s3.endpoint {
                env.push(var(cenv::AWS_ENDPOINT_URL, e.clone()));
            }
            env.push(var(
                cenv::AWS_REGION,
                s3.region.clone().unwrap_or_else(|| "us-east-1".into()),
            ));
            if let Some(r) = &s3.secret_ref {
                env_from.push(EnvFromSource {
                    secret_ref: Some(SecretEnvSource {
                        name: r.name.clone(),
                        optional: None,
                    }),
                    ..Default::default()
                });
            }
        }
        return Mounted {
            path: uri.clone(),
            volume: None,
            remote: Some(Remote {
                env,
                env_from,
                hugging_face: matches!(uri.parse::<SourceUri>(), Ok(SourceUri::HuggingFace { .. })),
            }),
        };
    }
    if let Some(img) = &src.image {
        let volume = Volume {
            name: name.into(),
            image: Some(ImageVolumeSource {
                reference: Some(img.reference.clone()),
                pull_policy: img.pull_policy.clone(),
            }),
            ..Default::default()
        };
        let path = match img.path.as_deref().map(|p| p.trim_matches('/')) {
            Some(p) if !p.is_empty() => format!("{dir}/{p}"),
            _ => dir.clone(),
        };
        return read_only(volume, dir, path);
    }
    if let Some(pvc) = &src.pvc {
        let volume = Volume {
            name: name.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: pvc.claim_name.clone(),
                read_only: Some(true),
            }),
            ..Default::default()
        };
        let path = format!("{dir}/{}", pvc.path.trim_start_matches('/'));
        return read_only(volume, dir, path);
    }
    let hp = src.host_path.clone().unwrap_or(crate::crd::HostPathSource {
        path: String::new(),
    });
    let base = hp
        .path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty())
        .unwrap_or("model");
    let path = format!("{dir}/{base}");
    let volume = Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: hp.path.clone(),
            type_: None,
        }),
        ..Default::default()
    };
    read_only(volume, path.clone(), path)
}

/// `volume` mounted read-only at `mount_path`; the engine reads `path`.
fn read_only(volume: Volume, mount_path: String, path: String) -> Mounted {
    let mount = VolumeMount {
        name: volume.name.clone(),
        mount_path,
        read_only: Some(true),
        ..Default::default()
    };
    Mounted {
        path,
        volume: Some((volume, mount)),
        remote: None,
    }
}
