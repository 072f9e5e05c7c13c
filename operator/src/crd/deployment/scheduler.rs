//! `spec.scheduler`: the engine's verify-length policy, its parameters and the online
//! policy experiment.

use dspark_types::contract::experiment;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::SchedulerPolicy;

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
    #[schemars(range(min = 1, max = experiment::MAX_GAMMA))]
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
    validation = Rule::new(format!("self.arms.all(a, a.matches('{}'))", experiment::arm_pattern())).message(format!("scheduler.experiment.arms: each arm is {}", experiment::ARM_GRAMMAR).as_str()),
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
