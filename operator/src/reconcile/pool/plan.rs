//! The model and drafter of a deployment as one pod needs them: each source mounted
//! ([`super::model_mount`]), remote ones fetched by init containers into the cache
//! ([`super::fetch`]) under the pool's revision pins ([`super::pins`]).

use k8s_openapi::api::core::v1::{Container, EnvFromSource, EnvVar, Volume, VolumeMount};

use super::fetch::{cache_mount, cache_volume, fetch_container};
use super::model_mount::mount_model;
use super::pins::{pins_mount, pins_var, pins_volume};
use super::{var, FETCH_DRAFTER_CONTAINER, FETCH_MODEL_CONTAINER};
use crate::crd::{DSparkDeployment, NodePool};
use dspark_types::contract::env as cenv;

/// The model and drafter of a deployment as one pod needs them: their paths, the volumes
/// and mounts, the fetch init containers and the environment the engine container adds.
pub struct ModelPlan {
    pub model: String,
    pub drafter: Option<String>,
    pub volumes: Vec<Volume>,
    pub mounts: Vec<VolumeMount>,
    pub init_containers: Vec<Container>,
    pub env: Vec<EnvVar>,
    pub env_from: Vec<EnvFromSource>,
    /// Some source is remote: the engine gets `--cache`.
    pub remote: bool,
}

pub fn model_plan(dsd: &DSparkDeployment, pool: &NodePool) -> ModelPlan {
    let model = mount_model(&dsd.spec.model, "model");
    let drafter = dsd.spec.drafter.as_ref().map(|d| mount_model(d, "drafter"));
    let mut plan = ModelPlan {
        model: model.path.clone(),
        drafter: drafter.as_ref().map(|d| d.path.clone()),
        volumes: Vec::new(),
        mounts: Vec::new(),
        init_containers: Vec::new(),
        env: Vec::new(),
        env_from: Vec::new(),
        remote: false,
    };
    let mut hugging_face = false;
    for (m, container) in std::iter::once((&model, FETCH_MODEL_CONTAINER))
        .chain(drafter.as_ref().map(|d| (d, FETCH_DRAFTER_CONTAINER)))
    {
        if let Some((v, vm)) = &m.volume {
            plan.volumes.push(v.clone());
            plan.mounts.push(vm.clone());
        }
        let Some(r) = &m.remote else { continue };
        plan.remote = true;
        hugging_face |= r.hugging_face;
        plan.init_containers
            .extend(fetch_container(dsd, pool, m, container));
        for e in &r.env {
            if !plan.env.iter().any(|x| x.name == e.name) {
                plan.env.push(e.clone());
            }
        }
        plan.env_from.extend(r.env_from.iter().cloned());
    }
    if plan.remote {
        plan.volumes.push(cache_volume(dsd));
        plan.mounts.push(cache_mount());
        plan.volumes.push(pins_volume(dsd, pool));
        plan.mounts.push(pins_mount());
        plan.env.push(pins_var());
        // The engine serves what the init container fetched (the cache's refs), without
        // asking the Hub again: a commit pushed in between cannot change the weights.
        if hugging_face {
            plan.env.push(var(cenv::HF_HUB_OFFLINE, "1".into()));
        }
    }
    plan
}
