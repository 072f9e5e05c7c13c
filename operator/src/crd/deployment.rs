//! `DSparkDeployment`: a served model on one or more GPU node pools, its status, and what
//! its spec derives (scaling mode, drain deadline, model identity, cost-table keys).

use dspark_types::{PolicyKind, Speculation as EngineSpeculation};
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::cost_table::CostTableKey;

/// A model served by DSpark engine pods on one or more node pools, sized by SLO.
///
/// The `/scale` subresource reads and writes the TOTAL number of engine replicas over all
/// pools (`spec.replicas`); `status.selector` selects every engine pod of the deployment.
/// Who owns that total is `spec.scaling.mode`: `SLO` (the operator's SLO autoscaler chooses
/// it and writes it to `spec.replicas`) or `External` (an HPA, KEDA or `kubectl scale` sets it
/// and the operator spreads it over the pools, cheapest pool that meets the SLO first, within
/// each pool's min/max).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.dspark.dev",
    version = "v1alpha1",
    kind = "DSparkDeployment",
    plural = "dsparkdeployments",
    singular = "dsparkdeployment",
    shortname = "dsd",
    category = "dspark",
    namespaced,
    status = "DSparkDeploymentStatus",
    derive = "PartialEq",
    doc = "A model served by DSpark engine pods on one or more GPU node pools, sized by SLO.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas", description = "Ready engine replicas over all pools"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredReplicas", description = "Desired engine replicas over all pools"),
    printcolumn(name = "SLO", type_ = "string", json_path = ".status.sloStatus", description = "Met, Breached or Unknown"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 40").message("metadata.name must be at most 40 characters (owned objects append the pool name)"),
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, ending with a letter or digit): it names the deployment's Service"),
)]
#[x_kube(
    validation = Rule::new("self.pools.all(p, self.pools.exists_one(q, q.name == p.name))").message("spec.pools: pool names must be unique"),
    validation = Rule::new("!has(self.replicas) || (has(self.scaling) && has(self.scaling.mode) && self.scaling.mode == 'SLO') || self.replicas >= self.pools.map(p, p.minReplicas).sum()").message("spec.replicas is below the sum of the pools' minReplicas"),
    validation = Rule::new("!has(self.replicas) || (has(self.scaling) && has(self.scaling.mode) && self.scaling.mode == 'SLO') || self.replicas <= self.pools.map(p, p.maxReplicas).sum()").message("spec.replicas is above the sum of the pools' maxReplicas"),
)]
#[serde(rename_all = "camelCase")]
pub struct DSparkDeploymentSpec {
    /// The target model.
    pub model: ModelSource,
    /// The drafter for speculative decoding; without one the engine uses the drafter it ships
    /// for the model, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<ModelSource>,
    /// Where remote model sources are fetched to (default: an emptyDir per pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<ModelCacheSpec>,
    /// Start-up budgets (download and load of large models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<StartupSpec>,
    /// The engine container (all defaults: the operator's own engine image).
    #[serde(default)]
    pub engine: EngineSpec,
    /// Node pools (one engine Deployment per pool).
    #[x_kube(validation = Rule::new("self.size() > 0").message("spec.pools must name at least one node pool"))]
    #[schemars(
        length(max = 8),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub pools: Vec<NodePool>,
    /// Total replicas over all pools: the `/scale` subresource's replica count. In `External`
    /// scaling mode the input (HPA, KEDA, `kubectl scale`; unset: the operator writes the
    /// current total); in `SLO` mode written by the operator (the autoscaler's total).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Who owns the replica count (`mode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingSpec>,
    /// Pod-level platform settings merged into the engine pods and the profiling Jobs' pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodTemplateOverrides>,
    /// Latency objectives the autoscaler keeps.
    pub slo: Slo,
    /// Verify-length scheduler of the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<SchedulerSpec>,
    /// Speculation mode; unset lets the engine pick its default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<Speculation>,
    /// Cost-table profiling.
    #[serde(default)]
    pub profiling: ProfilingSpec,
    /// Autoscaling behaviour.
    #[serde(default)]
    pub autoscaling: AutoscalingSpec,
    /// Stop reconciling (maintenance, an incident, a hand-edited engine Deployment under
    /// investigation): while true the operator leaves every object it owns as it is (no
    /// apply, prune, scaling or cost-table push) and reports `Suspended=True`; setting it back
    /// reconciles at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// Keep a Gateway API Inference Extension `InferencePool` (named after this deployment)
    /// over every engine pod, for gateways that route by load through an endpoint picker;
    /// removing the field deletes the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<super::InferencePoolSpec>,
}

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
    #[schemars(length(min = 1, max = 128))]
    pub id: Option<String>,
    /// A source URI the engine fetches: `hf://ORG/REPO[@REVISION][/FILE]`, `s3://BUCKET/KEY`
    /// or `https://...` (the typed `huggingFace` / `s3` forms carry tokens and endpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new("self.matches('^(hf|s3|https)://[^/]+')").message("unknown model URI scheme: use hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY or https://..., or a typed source (huggingFace, s3, image, pvc, hostPath)"))]
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
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
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
    pub revision: Option<String>,
    /// The files to fetch: paths in the repo or globs (`*.safetensors`, `original/*`; they do
    /// not cross `/`, as huggingface_hub's `allow_patterns`), each of which must match. The
    /// engine opens the one GGUF among them, else the folder. Unset: the repo's model folder
    /// (config, safetensors, tokenizer) or its only GGUF file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 64),
        inner(length(min = 1, max = 512), regex(pattern = "^[^,]+$"))
    )]
    pub files: Vec<String>,
    /// A Secret key holding the Hub token (gated or private repos), passed as HF_TOKEN.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
}

/// One key of a Secret in the deployment's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key (default `token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

/// An object or folder in an S3-compatible store.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// `s3://BUCKET/KEY` (a file) or `s3://BUCKET/PREFIX/` (a folder).
    #[schemars(length(min = 6, max = 1024))]
    #[x_kube(validation = Rule::new("self.matches('^s3://[^/]+/.+')").message("s3.uri must be s3://BUCKET/KEY"))]
    pub uri: String,
    /// The store's URL for non-AWS stores (MinIO, Ceph, R2...), passed as AWS_ENDPOINT_URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub endpoint: Option<String>,
    /// Region (AWS_REGION; default us-east-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// A Secret with `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and optionally
    /// `AWS_SESSION_TOKEN`), passed to the fetch as environment variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<LocalObjectReference>,
}

/// Weights inside an OCI image (a Kubernetes image volume; the image's files, no command).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ImageSource {
    /// Image reference, e.g. `registry.example.com/models/smollm2:q4_1`.
    #[schemars(length(min = 1, max = 512))]
    pub reference: String,
    /// The GGUF file or model folder inside the image (default: the image's root folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_policy: Option<String>,
}

/// Where remote sources are fetched to: a PVC shared by the replicas (each source is
/// downloaded once, under a lock) or, by default, an emptyDir per pod.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheSpec {
    /// A ReadWriteMany (or single-node) PersistentVolumeClaim to fetch into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// Size limit of the default emptyDir cache (e.g. `50Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_limit: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

/// How long start-up may take: large models spend minutes downloading (the init container)
/// and loading (before the startup probe passes).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StartupSpec {
    /// Seconds the engine may take to load the model before its startup probe fails
    /// (default 1800).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 30, max = 86400))]
    pub startup_probe_seconds: Option<i32>,
    /// The engine Deployments' `progressDeadlineSeconds`: a rollout (download included) that
    /// makes no progress this long is reported as stalled (default 3600 for remote sources;
    /// unset, the Kubernetes default, for volumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 60, max = 86400))]
    pub progress_deadline_seconds: Option<i32>,
}

/// Defaults of [`StartupSpec`].
pub const DEFAULT_STARTUP_PROBE_SECONDS: i32 = 1800;
pub const DEFAULT_PROGRESS_DEADLINE_SECONDS: i32 = 3600;

/// Weights inside a PersistentVolumeClaim.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Path of the GGUF file or Hugging Face folder inside the volume.
    #[schemars(length(min = 1, max = 1024))]
    pub path: String,
}

/// Weights on the node's filesystem.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HostPathSource {
    /// Absolute path of the GGUF file or Hugging Face folder on the node.
    #[schemars(length(min = 1, max = 1024))]
    pub path: String,
}

/// The engine container.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Image holding `dspark-engine`. Default: the engine image of the operator's own
    /// version, the CUDA one (`dspark/engine-cuda:VERSION`) on pools that request GPUs and the
    /// CPU one (`dspark/engine:VERSION`) on the others; the operator's `--engine-image` and
    /// `--engine-cuda-image` (the chart's `engineImages`) say where they live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
    /// Engine version used to key cost tables; defaults to the image tag (the operator's
    /// version with the default images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Extra arguments appended to `dspark-engine serve`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// CPU and memory; the GPU request comes from the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// On SIGTERM, how long in-flight requests may finish (`serve --drain-timeout-secs`;
    /// default 30). The pods' `terminationGracePeriodSeconds` defaults to this plus
    /// [`GRACE_MARGIN_SECONDS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub drain_timeout_seconds: Option<u32>,
}

/// The engine's drain deadline when `engine.drainTimeoutSeconds` is unset (its own default).
pub const DEFAULT_DRAIN_SECONDS: u32 = 30;
/// Seconds of `terminationGracePeriodSeconds` beyond the drain deadline: the engine's exit and
/// the endpoints' removal after it.
pub const GRACE_MARGIN_SECONDS: i64 = 15;

/// Who owns the total replica count (`spec.scaling.mode`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalingMode {
    /// The SLO autoscaler (`spec.autoscaling`) chooses the total; the operator writes it to
    /// `spec.replicas`, so `/scale` reads it (a write there is overwritten).
    #[serde(rename = "SLO")]
    Slo,
    /// `spec.replicas` (through `/scale`: HPA, KEDA, `kubectl scale`) sets the total; the
    /// operator spreads it over the pools. The SLO autoscaler does not act.
    External,
}

/// `spec.scaling`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ScalingSpec {
    /// Unset: the operator sets it on its first reconcile, to `External` when `spec.replicas`
    /// is set and `SLO` otherwise (the behaviour of manifests written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ScalingMode>,
}

/// Extra labels and annotations of the engine and profiling pods (the operator's own labels
/// win on a clash).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Pod settings of the platform the engines run on.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateSpecOverrides {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The pods' ServiceAccount (its token is still not mounted: the engine needs no API
    /// access).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Added to the pool's tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Added to the node selector (the pool's terms and its node-type label win).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Default: the engine's drain deadline plus a margin (`engine.drainTimeoutSeconds` + 15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// `spec.podTemplate`: merged into every engine pod and profiling pod.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<PodTemplateMetadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodTemplateSpecOverrides>,
}

/// How a pool's engine Deployment replaces its pods (`RollingUpdate`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Pods above the desired count during a rollout (default 0: a pool that fills its nodes'
    /// accelerators has no room for an extra pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrString>,
    /// Pods below the desired count during a rollout (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
}

/// A group of identical nodes (one GPU type) and how many engine replicas may run there.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.minReplicas <= self.maxReplicas").message("pool minReplicas must not exceed maxReplicas"),
)]
#[serde(rename_all = "camelCase")]
pub struct NodePool {
    /// Pool name (a DNS-1035 label), part of the owned objects' names (`{deployment}-{pool}`
    /// names the pool's Service, at most 61 characters).
    #[schemars(
        length(min = 1, max = 20),
        regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("spec.pools[].name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, ending with a letter or digit): it is part of the pool's Service name"))]
    pub name: String,
    /// Value of the `dspark.dev/node-type` node label (a label value); keys the pool's cost
    /// table.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')").message("spec.pools[].nodeType must be a label value (letters, digits, '-', '_' and '.', starting and ending with a letter or digit): it is the value of the engine pods' dspark.dev/node-type node selector"))]
    pub node_type: String,
    /// Extra node selector terms (the node-type label is always added).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Accelerator resource per replica.
    #[serde(default)]
    pub gpu: GpuSpec,
    #[serde(default = "default_min_replicas")]
    #[x_kube(validation = Rule::new("self >= 0").message("pool minReplicas must be non-negative"))]
    pub min_replicas: i32,
    #[x_kube(validation = Rule::new("self >= 1").message("pool maxReplicas must be at least 1"))]
    pub max_replicas: i32,
    /// Relative cost of one replica (any unit, compared across pools).
    #[serde(default = "default_cost")]
    #[schemars(range(min = 0.0))]
    pub cost: f64,
    /// Rollout of the pool's engine Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
}

fn default_min_replicas() -> i32 {
    1
}
fn default_cost() -> f64 {
    1.0
}

/// The accelerator each replica requests (and limits).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    #[serde(default = "default_gpu_resource")]
    #[schemars(length(min = 1, max = 253))]
    pub resource_name: String,
    /// Devices per replica; 0 runs without an accelerator.
    #[serde(default = "default_gpu_count")]
    #[schemars(range(min = 0, max = 64))]
    pub count: u32,
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            resource_name: default_gpu_resource(),
            count: default_gpu_count(),
        }
    }
}

fn default_gpu_resource() -> String {
    "nvidia.com/gpu".into()
}
fn default_gpu_count() -> u32 {
    1
}

/// p95 latency objectives, evaluated over a sliding window.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.ttftP95Ms > 0").message("slo.ttftP95Ms must be positive"),
    validation = Rule::new("self.itlP95Ms > 0").message("slo.itlP95Ms must be positive"),
    validation = Rule::new("self.windowSeconds > 0").message("slo.windowSeconds must be positive"),
)]
#[serde(rename_all = "camelCase")]
pub struct Slo {
    /// p95 time to first token, milliseconds.
    pub ttft_p95_ms: i32,
    /// p95 inter-token latency, milliseconds.
    pub itl_p95_ms: i32,
    /// Evaluation window, seconds.
    #[serde(default = "default_window")]
    pub window_seconds: i32,
}

fn default_window() -> i32 {
    60
}

/// Verify-length scheduling policy of the engine.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SchedulerPolicy {
    /// No verify-length scheduling (the engine's plain block verification).
    None,
    /// Verify every draft position up to gamma.
    Fixed,
    /// Verify while the prefix survival stays above `threshold`.
    Threshold,
    /// Maximise tau * SPS(B) with the cost table (the DSpark scheduler).
    #[default]
    Dspark,
}

impl SchedulerPolicy {
    /// The engine's policy, if any (the contract spells its `--policy` value).
    pub fn engine_policy(self) -> Option<PolicyKind> {
        match self {
            Self::None => None,
            Self::Fixed => Some(PolicyKind::Fixed),
            Self::Threshold => Some(PolicyKind::Threshold),
            Self::Dspark => Some(PolicyKind::Dspark),
        }
    }

    /// The engine's `--policy` value, if any.
    pub fn engine_flag(self) -> Option<&'static str> {
        self.engine_policy().map(PolicyKind::flag)
    }
}

/// Scheduler settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("self.policy != 'threshold' || has(self.threshold)").message("scheduler.threshold is required when policy is threshold"),
)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerSpec {
    #[serde(default)]
    pub policy: SchedulerPolicy,
    /// Draft block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub gamma: Option<u32>,
    /// Prefix-survival threshold of the `threshold` policy, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub threshold: Option<f64>,
    /// Step of the engine's online recalibration of the drafter's confidences from verify
    /// outcomes (`serve --online-calibration`; 0 turns it off; unset: the engine default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub online_calibration: Option<f64>,
    /// An online on/off experiment on live traffic: the engines alternate these verify
    /// policies window by window (`serve --policy-experiment`), export each arm's series
    /// (`dspark_experiment_*`) and list the windows at `GET /experiment`
    /// (`dspark-engine experiment-report`). `policy` is unused while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experiment: Option<ExperimentSpec>,
}

/// `scheduler.experiment`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("self.arms.all(a, a.matches('^(dspark|none|fixed:[1-9][0-9]?|threshold:(0([.][0-9]+)?|1([.]0+)?))$'))").message("scheduler.experiment.arms: each arm is dspark, none, fixed:G (G in 1..99) or threshold:T (T in [0, 1])"),
    validation = Rule::new("self.arms.all(a, self.arms.filter(b, b == a).size() == 1)").message("scheduler.experiment.arms: an arm is listed twice"),
)]
#[serde(rename_all = "camelCase")]
pub struct ExperimentSpec {
    /// Two to four arms, e.g. `[dspark, none]`.
    #[schemars(length(min = 2, max = 4), inner(length(min = 1, max = 16)))]
    pub arms: Vec<String>,
    /// Seconds per window (default: the engine's, 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub window_seconds: Option<u32>,
}

/// Speculative decoding mode (`--speculation`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Speculation {
    None,
    Ngram,
    Parallel,
    DsparkMarkov,
    DsparkRnn,
}

impl Speculation {
    /// The engine's drafter kind (the contract spells its `--speculation` value).
    pub fn engine_kind(self) -> EngineSpeculation {
        match self {
            Self::None => EngineSpeculation::None,
            Self::Ngram => EngineSpeculation::Ngram,
            Self::Parallel => EngineSpeculation::Parallel,
            Self::DsparkMarkov => EngineSpeculation::DSparkMarkov,
            Self::DsparkRnn => EngineSpeculation::DSparkRnn,
        }
    }

    /// The engine's `--speculation` value.
    pub fn engine_flag(self) -> &'static str {
        self.engine_kind().flag()
    }
}

/// How cost tables are measured.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.timeoutSeconds > 0").message("profiling.timeoutSeconds must be positive"),
    validation = Rule::new("self.retryBaseSeconds > 0 && self.retryMaxSeconds >= self.retryBaseSeconds").message("profiling retry backoff needs 0 < retryBaseSeconds <= retryMaxSeconds"),
)]
#[serde(rename_all = "camelCase")]
pub struct ProfilingSpec {
    /// Run a profiling Job for pools without a valid table.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Extra arguments appended to `dspark-engine profile`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Deadline of one profiling Job.
    #[serde(default = "default_profile_timeout")]
    pub timeout_seconds: i64,
    /// Wait after the first failed Job; doubles per failure up to `retryMaxSeconds`.
    #[serde(default = "default_retry_base")]
    pub retry_base_seconds: i64,
    #[serde(default = "default_retry_max")]
    pub retry_max_seconds: i64,
}

impl Default for ProfilingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            args: Vec::new(),
            timeout_seconds: default_profile_timeout(),
            retry_base_seconds: default_retry_base(),
            retry_max_seconds: default_retry_max(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_profile_timeout() -> i64 {
    900
}
fn default_retry_base() -> i64 {
    60
}
fn default_retry_max() -> i64 {
    3600
}

/// Whether scaling decisions are applied.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutoscalingMode {
    /// Decisions change the pools' replicas.
    #[default]
    Active,
    /// Decisions are recorded (status, events) but not applied.
    Advisory,
}

/// Where latency metrics come from.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MetricsSource {
    /// Scrape every ready engine pod's `/metrics` by pod IP.
    #[default]
    Scrape,
    /// Query a Prometheus server (`prometheusUrl`).
    Prometheus,
}

/// Autoscaling behaviour: a predictive loop (load and the SPS(B) table) and a reactive loop
/// (+-1 toward the p95 SLOs).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.metricsSource != 'Prometheus' || has(self.prometheusUrl)").message("autoscaling.prometheusUrl is required when metricsSource is Prometheus"),
    validation = Rule::new("self.periodSeconds > 0").message("autoscaling.periodSeconds must be positive"),
    validation = Rule::new("self.maxScaleUpStep >= 1 && self.maxScaleDownStep >= 1").message("autoscaling step limits must be at least 1"),
    validation = Rule::new("self.scaleUpStabilizationSeconds >= 0 && self.scaleDownStabilizationSeconds >= 0").message("autoscaling stabilization windows must be non-negative"),
)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Period of the reactive loop.
    #[serde(default = "default_period")]
    pub period_seconds: i32,
    /// A higher recommendation must hold this long before it is applied.
    #[serde(default)]
    pub scale_up_stabilization_seconds: i32,
    /// A lower recommendation must hold this long before it is applied.
    #[serde(default = "default_down_window")]
    pub scale_down_stabilization_seconds: i32,
    #[serde(default = "default_up_step")]
    pub max_scale_up_step: i32,
    #[serde(default = "default_down_step")]
    pub max_scale_down_step: i32,
    /// Fraction of a replica's capacity at the ITL target the predictive loop plans for.
    #[serde(default = "default_utilization")]
    #[schemars(range(min = 0.05, max = 1.0))]
    pub target_utilization: f64,
    #[serde(default)]
    pub metrics_source: MetricsSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus_url: Option<String>,
}

impl Default for AutoscalingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: AutoscalingMode::Active,
            period_seconds: default_period(),
            scale_up_stabilization_seconds: 0,
            scale_down_stabilization_seconds: default_down_window(),
            max_scale_up_step: default_up_step(),
            max_scale_down_step: default_down_step(),
            target_utilization: default_utilization(),
            metrics_source: MetricsSource::Scrape,
            prometheus_url: None,
        }
    }
}

fn default_period() -> i32 {
    15
}
fn default_down_window() -> i32 {
    300
}
fn default_up_step() -> i32 {
    4
}
fn default_down_step() -> i32 {
    1
}
fn default_utilization() -> f64 {
    0.8
}

/// Observed state. Deterministic: it changes only when the world does.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DSparkDeploymentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, Available, Progressing, Profiled, Scaling, MetricsAvailable, Stalled (a map by
    /// type: other controllers may add their own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Current replicas over all pools (the `/scale` status).
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    #[serde(default)]
    pub desired_replicas: i32,
    /// Label selector of every engine pod of this deployment (the `/scale` selector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Met, Breached or Unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_status: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scaling_decision: Option<ScalingDecisionStatus>,
    /// What the first successful fetch of each remote source (as the spec names it now)
    /// resolved: a Hub branch's commit, an S3 / HTTP ETag. Later fetches of a Hub source use
    /// that commit (the pool ConfigMap's `revision-pins`), and the revision is part of the
    /// cost-table key. Read back from the fetch init containers' termination messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["role"]))]
    pub resolved_sources: Vec<ResolvedSource>,
    /// The `InferencePool` the operator keeps for `spec.inferencePool` (its name), absent when
    /// there is none (the field is unset, or the cluster has no InferencePool CRD).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<String>,
}

/// A remote source's resolved revision.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedSource {
    /// `model` or `drafter`.
    pub role: String,
    /// The source as fetched (`dspark-engine fetch SOURCE`), from the spec.
    pub source: String,
    /// The Hub commit sha, or the S3 / HTTP ETag.
    pub revision: String,
    /// The engine's model id for it (file or folder name, `@`, 12 characters of revision).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_id: String,
    /// The pod whose fetch reported it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod: String,
}

/// The two sources a deployment may fetch.
pub const SOURCE_ROLES: [&str; 2] = ["model", "drafter"];

/// One pool's observed state.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    pub name: String,
    pub desired_replicas: i32,
    pub ready_replicas: i32,
    /// Name of the DSparkCostTable this pool uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_table: Option<String>,
    /// Revision of that table held in the pool's ConfigMap (absent: engine default table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_table_revision: Option<i64>,
    /// p95 time to first token over the SLO window, milliseconds (3 significant digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p95_ms: Option<f64>,
    /// p95 inter-token latency over the SLO window, milliseconds (3 significant digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p95_ms: Option<f64>,
    /// Mean tokens committed per verification (tau), 3 significant digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance_length: Option<f64>,
}

/// The autoscaler's latest decision that changed (or, in advisory mode, would change) a pool.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ScalingDecisionStatus {
    pub pool: String,
    pub from_replicas: i32,
    pub to_replicas: i32,
    pub reason: String,
    pub applied: bool,
    /// RFC 3339 time the decision was made (set once per decision).
    pub time: String,
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
            let mut u = format!("hf://{}", hf.repo);
            if let Some(r) = &hf.revision {
                u.push('@');
                u.push_str(r);
            }
            if !hf.files.is_empty() {
                u.push('/');
                let files: Vec<&str> = hf.files.iter().map(|f| f.trim_start_matches('/')).collect();
                u.push_str(&files.join(","));
            }
            return Some(u);
        }
        self.s3.as_ref().map(|s| s.uri.clone())
    }
}

/// The engine images a deployment without `spec.engine.image` runs: full references (a tag
/// or a digest), set once at start from the operator's flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineImages {
    /// For pools without GPUs.
    pub cpu: String,
    /// For pools that request GPUs (`--features cuda`, CUDA user-space libraries inside).
    pub cuda: String,
}

impl Default for EngineImages {
    fn default() -> Self {
        let v = env!("CARGO_PKG_VERSION");
        Self {
            cpu: format!("dspark/engine:{v}"),
            cuda: format!("dspark/engine-cuda:{v}"),
        }
    }
}

static ENGINE_IMAGES: std::sync::OnceLock<EngineImages> = std::sync::OnceLock::new();

impl EngineImages {
    /// Sets the process's default engine images (once, at start; later calls are ignored).
    pub fn install(self) {
        let _ = ENGINE_IMAGES.set(self);
    }

    /// The process's default engine images.
    pub fn current() -> &'static EngineImages {
        ENGINE_IMAGES.get_or_init(EngineImages::default)
    }
}

/// The tag of an image reference (`None`: a digest-only or untagged reference).
fn image_tag(image: &str) -> Option<&str> {
    let name = image.split('@').next().unwrap_or_default();
    let last = name.rsplit('/').next().unwrap_or_default();
    last.split_once(':')
        .map(|(_, t)| t)
        .filter(|t| !t.is_empty())
}

impl EngineSpec {
    /// The image of `pool`'s engine pods: `image`, else the default engine image for its
    /// accelerators (CUDA when the pool requests GPUs).
    pub fn image_for(&self, pool: &NodePool) -> String {
        if let Some(i) = &self.image {
            return i.clone();
        }
        let d = EngineImages::current();
        if pool.gpu.count > 0 {
            d.cuda.clone()
        } else {
            d.cpu.clone()
        }
    }

    /// The version that keys cost tables: `version`, else the image tag (the operator's
    /// version with the default images), else `latest`.
    pub fn effective_version(&self) -> String {
        if let Some(v) = &self.version {
            return v.clone();
        }
        match &self.image {
            Some(i) => image_tag(i).unwrap_or("latest").to_string(),
            None => env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

impl DSparkDeploymentSpec {
    /// Who owns the replica count: `spec.scaling.mode`, or, while unset, `External` when
    /// `spec.replicas` is set and `SLO` otherwise.
    pub fn scaling_mode(&self) -> ScalingMode {
        match self.scaling.as_ref().and_then(|s| s.mode) {
            Some(m) => m,
            None if self.replicas.is_some() => ScalingMode::External,
            None => ScalingMode::Slo,
        }
    }

    /// The engine's drain deadline, seconds.
    pub fn drain_seconds(&self) -> u32 {
        self.engine
            .drain_timeout_seconds
            .unwrap_or(DEFAULT_DRAIN_SECONDS)
    }

    /// The `model` or `drafter` source.
    pub fn source(&self, role: &str) -> Option<&ModelSource> {
        match role {
            "model" => Some(&self.model),
            "drafter" => self.drafter.as_ref(),
            _ => None,
        }
    }
}

impl DSparkDeployment {
    /// The revision resolved for the `role` source as the spec names it now (a resolution of
    /// a source the spec no longer names does not count).
    pub fn resolved(&self, role: &str) -> Option<&ResolvedSource> {
        let uri = self.spec.source(role)?.fetch_uri()?;
        self.status
            .as_ref()?
            .resolved_sources
            .iter()
            .find(|r| r.role == role && r.source == uri)
    }

    /// What keys `role`'s part of a cost table: a volume's identity, or a remote source's
    /// identity plus `@` and its resolved revision (a new commit is a new table); `None`
    /// while a remote source is not resolved yet.
    fn keyed_identity(&self, role: &str) -> Option<String> {
        let src = self.spec.source(role)?;
        if src.fetch_uri().is_none() {
            return Some(src.identity());
        }
        self.resolved(role)
            .map(|r| format!("{}@{}", src.identity(), r.revision))
    }

    /// The cost-table key of `pool`; `None` until every remote source has been resolved by
    /// a first fetch (no table is measured for weights whose revision is unknown).
    pub fn cost_table_key(&self, pool: &NodePool) -> Option<CostTableKey> {
        Some(CostTableKey {
            model_id: self.keyed_identity("model")?,
            drafter_id: match &self.spec.drafter {
                Some(_) => Some(self.keyed_identity("drafter")?),
                None => None,
            },
            engine_version: self.spec.engine.effective_version(),
            node_type: pool.node_type.clone(),
        })
    }

    /// The remote sources not resolved yet, as the spec names them.
    pub fn unresolved_sources(&self) -> Vec<String> {
        SOURCE_ROLES
            .iter()
            .filter_map(|role| {
                let uri = self.spec.source(role)?.fetch_uri()?;
                self.resolved(role).is_none().then_some(uri)
            })
            .collect()
    }
}
