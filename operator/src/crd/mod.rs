//! The custom resources of `serving.dspark.dev/v1alpha1`: [`DSparkDeployment`] (a served model
//! on one or more GPU node pools) and [`DSparkCostTable`] (a measured SPS(B) table per
//! (model, drafter, engine version, node type), shared by the deployments that match).
//!
//! Every field a user sets is validated at admission ([`admission`]: OpenAPI formats and
//! bounds, CEL rules whose message names the field, the contract's grammars); the same rules
//! are evaluated client-side in the unit tests (CEL through kube's evaluator, the OpenAPI
//! validations through `schema_check`), so the committed samples are checked without a
//! cluster.
//!
//! [`deployment`] holds the DSparkDeployment (spec, status and what the spec derives: scaling
//! mode, drain deadline, cost-table keys); [`engine_images`] the process's default engine
//! images; [`cost_table`] the DSparkCostTable, its key and name; [`yaml`] renders both as
//! the CRD YAML committed under `crds/`; [`install`] applies them to a cluster at the
//! operator's start (Helm never upgrades a chart's CRDs).

pub mod admission;
#[cfg(test)]
mod admission_tests;
pub mod cost_table;
pub mod deployment;
pub mod engine_images;
pub mod inference_pool;
pub mod install;
#[cfg(test)]
pub(crate) mod schema_check;
#[cfg(test)]
mod tests;
pub mod yaml;

pub use cost_table::*;
pub use deployment::*;
pub use engine_images::EngineImages;
pub use inference_pool::{EndpointPicker, FailureMode, InferencePoolSpec};
