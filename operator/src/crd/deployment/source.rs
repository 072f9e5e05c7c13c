//! Where weights come from (`spec.model`, `spec.drafter`): the typed sources, the model
//! cache, and the identity that keys cost tables.

use dspark_types::contract::source::{self as grammar, SourceUri};
use k8s_openapi::api::core::v1::LocalObjectReference;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::admission::{self, matches};

/// Where weights come from: exactly one of `huggingFace`, `s3`, `image`, `pvc`, `hostPath`
/// or `uri`. Remote sources (`huggingFace`, `s3`, `uri`) are fetched by an init container
/// (`dspark-engine fetch`) into the model cache volume (`spec.modelCache`) before the engine
/// starts; a failed fetch shows as `ModelAvailable=False` with the reason.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("[has(self.uri), has(self.huggingFace), has(self.s3), has(self.image), has(self.pvc), has(self.hostPath)].filter(x, x).size() == 1").message("a model source needs exactly one of huggingFace, s3, image, pvc, hostPath or uri"),
    validation = Rule::new("!has(self.hostPath) || (has(self.allowHostPath) && self.allowHostPath)").message("hostPath reads weights from the node's filesystem (every node must hold them, and the pod gets a host mount): set allowHostPath: true to opt in, or use huggingFace, s3, image or pvc"),
)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Identity of the weights, used to key cost tables (defaults to the source's path or URI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), regex(pattern = admission::IMAGE_REFERENCE))]
    pub id: Option<String>,
    /// A source URI the engine fetches: `hf://ORG/REPO[@REVISION][/FILE]`, `s3://BUCKET/KEY`
    /// or `https://...` (the typed `huggingFace` / `s3` forms carry tokens and endpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(matches(&grammar::remote_uri_pattern())).message("uri: unknown model URI scheme or malformed URI: use hf://ORG/REPO[@REVISION][/FILE[,FILE...]], s3://BUCKET/KEY or https://HOST/PATH (printable ASCII, no spaces), or a typed source (huggingFace, s3, image, pvc, hostPath)"))]
    pub uri: Option<String>,
    /// A Hugging Face Hub repo (a GGUF file or a model folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// An object (or a folder: a key ending in `/`) in an S3-compatible store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Source>,
    /// Weights inside an OCI image, mounted read-only as a Kubernetes image volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSource>,
    /// A file or folder inside a PersistentVolumeClaim (mounted read-only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PvcSource>,
    /// A file or folder on the node (mounted read-only); needs `allowHostPath: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<HostPathSource>,
    /// The explicit opt-in `hostPath` needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_host_path: Option<bool>,
}

/// A Hugging Face Hub repo. The revision is resolved to a commit by the init container; the
/// engine then serves exactly that commit from the cache.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HuggingFaceSource {
    /// `ORG/REPO`.
    #[schemars(
        length(min = 3, max = 96),
        regex(pattern = "^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+$")
    )]
    pub repo: String,
    /// Branch, tag or commit (default `main`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    #[x_kube(validation = Rule::new(matches(grammar::HF_REVISION_PATTERN)).message("huggingFace.revision must be printable ASCII without '/' or spaces"))]
    pub revision: Option<String>,
    /// The files to fetch: paths in the repo or globs (`*.safetensors`, `original/*`; they do
    /// not cross `/`, as huggingface_hub's `allow_patterns`), each of which must match. The
    /// engine opens the one GGUF among them, else the folder. Unset: the repo's model folder
    /// (config, safetensors, tokenizer) or its only GGUF file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 512)))]
    #[x_kube(validation = Rule::new(format!("self.all(f, f.matches('{}'))", grammar::hf_file_pattern())).message("huggingFace.files: each file is a path or glob in the repo (printable ASCII, no ',' or spaces, no empty or '..' component)"))]
    pub files: Vec<String>,
    /// A Secret key holding the Hub token (gated or private repos), passed as HF_TOKEN.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
}

/// One key of a Secret in the deployment's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// The key (default `token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = "^[-._a-zA-Z0-9]+$"))]
    pub key: Option<String>,
}

/// An object or folder in an S3-compatible store.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// `s3://BUCKET/KEY` (a file) or `s3://BUCKET/PREFIX/` (a folder).
    #[schemars(length(min = 6, max = 1024))]
    #[x_kube(validation = Rule::new(matches(grammar::S3_URI_PATTERN)).message("s3.uri must be s3://BUCKET/KEY (printable ASCII, no spaces)"))]
    pub uri: String,
    /// The store's URL for non-AWS stores (MinIO, Ceph, R2...), passed as AWS_ENDPOINT_URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    #[x_kube(validation = Rule::new(matches(admission::HTTP_URL)).message("s3.endpoint must be an http:// or https:// URL"))]
    pub endpoint: Option<String>,
    /// Region (AWS_REGION; default us-east-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), regex(pattern = "^[a-z0-9][-a-z0-9]*$"))]
    pub region: Option<String>,
    /// A Secret with `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and optionally
    /// `AWS_SESSION_TOKEN`), passed to the fetch as environment variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = admission::name_ref)]
    pub secret_ref: Option<LocalObjectReference>,
}

/// Weights inside an OCI image (a Kubernetes image volume; the image's files, no command).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ImageSource {
    /// Image reference, e.g. `registry.example.com/models/smollm2:q4_1`.
    #[schemars(length(min = 1, max = 512), regex(pattern = admission::IMAGE_REFERENCE))]
    pub reference: String,
    /// The GGUF file or model folder inside the image (default: the image's root folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = admission::VOLUME_PATH))]
    pub path: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = admission::pull_policy)]
    pub pull_policy: Option<String>,
}

/// Where remote sources are fetched to: a PVC shared by the replicas (each source is
/// downloaded once, under a lock) or, by default, an emptyDir per pod.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheSpec {
    /// A ReadWriteMany (or single-node) PersistentVolumeClaim to fetch into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub claim_name: Option<String>,
    /// Size limit of the default emptyDir cache (e.g. `50Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_limit: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

/// Weights inside a PersistentVolumeClaim.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub claim_name: String,
    /// Path of the GGUF file or Hugging Face folder inside the volume (no `..`).
    #[schemars(length(min = 1, max = 1024), regex(pattern = admission::VOLUME_PATH))]
    pub path: String,
}

/// Weights on the node's filesystem.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HostPathSource {
    /// Absolute path of the GGUF file or Hugging Face folder on the node.
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(matches(admission::ABSOLUTE_PATH)).message("hostPath.path must be an absolute path on the node (starting with '/', printable ASCII, no spaces, no '..' component)"))]
    pub path: String,
}

impl ModelSource {
    /// The identity that keys cost tables: `id`, else the URI, else the volume path.
    pub fn identity(&self) -> String {
        if let Some(id) = &self.id {
            return id.clone();
        }
        if let Some(uri) = self.fetch_uri() {
            return uri;
        }
        if let Some(img) = &self.image {
            return match &img.path {
                Some(p) => format!("image:{}/{}", img.reference, p.trim_start_matches('/')),
                None => format!("image:{}", img.reference),
            };
        }
        if let Some(pvc) = &self.pvc {
            return format!(
                "pvc:{}/{}",
                pvc.claim_name,
                pvc.path.trim_start_matches('/')
            );
        }
        if let Some(hp) = &self.host_path {
            return format!("host:{}", hp.path);
        }
        String::new()
    }
}

impl ModelSource {
    /// The URI `dspark-engine fetch` downloads, for a remote source (`uri`, `huggingFace`,
    /// `s3`); `None` for volumes.
    pub fn fetch_uri(&self) -> Option<String> {
        if let Some(uri) = &self.uri {
            return Some(uri.clone());
        }
        if let Some(hf) = &self.hugging_face {
            let files: Vec<&str> = hf.files.iter().map(|f| f.trim_start_matches('/')).collect();
            let uri = SourceUri::HuggingFace {
                repo: hf.repo.clone(),
                revision: hf.revision.clone(),
                file: (!files.is_empty()).then(|| files.join(",")),
            };
            return Some(uri.to_string());
        }
        self.s3.as_ref().map(|s| s.uri.clone())
    }
}
