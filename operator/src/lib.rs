//! The DSpark operator: runs DSpark engine pools on Kubernetes.
//!
//! It owns the `serving.dspark.dev/v1alpha1` resources ([`crd`]: the types, their CEL rules and
//! the committed CRD YAML): for each `DSparkDeployment`
//! it keeps, per node pool, an engine Deployment, a Service, a PodDisruptionBudget and a
//! cost-table ConfigMap ([`reconcile::pool`]); it measures SPS(B) cost tables with profiling
//! Jobs, stores them in shared `DSparkCostTable` resources and pushes them to engine pods
//! ([`reconcile::profiling`], [`reconcile::costs`]); and it sizes the pools by SLO
//! ([`autoscale`]: a pure policy fed by metrics scraped from the pods or read from Prometheus).
//!
//! It must not know how the engine computes anything: it speaks only the engine's command
//! line, its admin API and its Prometheus metrics, whose payloads live in `dspark-types`.
#![forbid(unsafe_code)]
#![deny(warnings)]

pub mod autoscale;
pub mod crd;
mod error;
pub mod http;
pub mod leader;
pub mod reconcile;
pub mod telemetry;

pub use error::{Error, Result};
