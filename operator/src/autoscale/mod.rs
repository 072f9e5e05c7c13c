//! SLO autoscaling: [`metrics`] turns engine metrics into per-pool observations, [`policy`]
//! (pure) decides replicas from them, [`source`] fetches the metrics (scraping pods or
//! querying Prometheus).

pub mod metrics;
pub mod policy;
pub mod source;

#[cfg(test)]
mod sim_tests;
