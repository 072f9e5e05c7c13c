//! The custom resources of `serving.dspark.dev/v1alpha1`: [`DSparkDeployment`] (a served model
//! on one or more GPU node pools) and [`DSparkCostTable`] (a measured SPS(B) table per
//! (model, drafter, engine version, node type), shared by the deployments that match).
//!
//! CEL rules (`x-kubernetes-validations`) reject nonsense at admission; the same rules are
//! evaluated client-side in the unit tests, so the committed samples are checked without a
//! cluster.
//!
//! [`deployment`] holds the DSparkDeployment (spec, status and what the spec derives: scaling
//! mode, drain deadline, cost-table keys); [`cost_table`] the DSparkCostTable, its key and
//! name; [`yaml`] renders both as the CRD YAML committed under `crds/`; [`install`] applies
//! them to a cluster at the operator's start (Helm never upgrades a chart's CRDs).

pub mod cost_table;
pub mod deployment;
pub mod inference_pool;
pub mod install;
#[cfg(test)]
mod tests;
pub mod yaml;

pub use cost_table::*;
pub use deployment::*;
pub use inference_pool::{EndpointPicker, FailureMode, InferencePoolSpec};
