//! What every reconcile shares ([`Context`]: clients, caches, metrics, per-object memory)
//! and what the autoscaler remembers about one deployment between reconciles ([`Runtime`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;

use super::backoff::Backoff;
use super::cache;
use crate::autoscale::metrics::{PoolObservation, PoolWindow};
use crate::autoscale::policy::PolicyState;
use crate::crd::{DSparkDeployment, ScalingDecisionStatus};
use crate::http::HttpClient;
use crate::telemetry::Metrics;

/// Shared by every reconcile.
pub struct Context {
    pub client: kube::Client,
    pub http: HttpClient,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Every DSparkDeployment (the controller's cache): cost tables are owned by all their users.
    pub store: Store<DSparkDeployment>,
    /// What the reconciles read (watch-backed) and the memory of what they applied.
    pub caches: cache::Caches,
    /// Per-deployment memory of the autoscaler (kube-runtime never runs two reconciles of one
    /// object at once).
    pub(super) runtime: Mutex<BTreeMap<String, Runtime>>,
    pub(super) failures: Mutex<BTreeMap<String, Backoff>>,
    pub(super) started: Instant,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        store: Store<DSparkDeployment>,
        caches: cache::Caches,
    ) -> Self {
        Self {
            client,
            http: HttpClient::new(Duration::from_secs(5)),
            recorder,
            metrics,
            store,
            caches,
            runtime: Mutex::default(),
            failures: Mutex::default(),
            started: Instant::now(),
        }
    }
}

/// What the autoscaler remembers about one deployment between reconciles.
#[derive(Default)]
pub(super) struct Runtime {
    pub(super) policy: PolicyState,
    pub(super) windows: BTreeMap<String, PoolWindow>,
    pub(super) observations: BTreeMap<String, PoolObservation>,
    pub(super) breached: BTreeMap<String, Option<bool>>,
    pub(super) last_eval: Option<f64>,
    pub(super) last_decision: Option<ScalingDecisionStatus>,
    /// Digest each pod is known to hold.
    pub(super) pushed: BTreeMap<String, String>,
    /// The generation whose pruning completed (listed fresh from the API server).
    pub(super) pruned_generation: Option<i64>,
    /// The admin token and when it was read from its Secret.
    pub(super) admin_token: Option<(String, Instant)>,
    /// The remote sources' resolved revisions as the last reconcile saw them: in force even
    /// where the status cannot hold them (a CRD older than this operator).
    pub(super) resolved: Vec<crate::crd::ResolvedSource>,
    /// The InferencePool the last reconcile applied (`spec.inferencePool`).
    pub(super) inference_pool: Option<String>,
    /// The generation a missing InferencePool CRD was announced for.
    pub(super) inference_pool_warned: Option<i64>,
}
