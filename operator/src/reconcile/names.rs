//! What the operator calls the objects it owns and how it labels them: object names, the
//! labels (deployment, pool, component, manager) and selectors, the owner reference and
//! metadata every owned object carries. Pure.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use crate::crd::{DSparkDeployment, NodePool};

/// Label on every object and pod of a DSparkDeployment (the `/scale` selector).
pub const LABEL_DEPLOYMENT: &str = "serving.dspark.dev/deployment";
/// Labels under this prefix are the operator's: `spec.podTemplate` cannot set them.
pub const RESERVED_LABEL_PREFIX: &str = "serving.dspark.dev/";
/// Label naming the pool of an object or pod.
pub const LABEL_POOL: &str = "serving.dspark.dev/pool";
/// Node label holding the node type.
pub const NODE_TYPE_LABEL: &str = "dspark.dev/node-type";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGER: &str = "dspark-operator";
/// Label naming the cost table a profiling Job measures.
pub const LABEL_COST_TABLE: &str = "serving.dspark.dev/cost-table";
/// `app.kubernetes.io/component` of profiling Jobs and their pods.
pub const COMPONENT_PROFILER: &str = "profiler";

/// `{deployment}-{pool}`: the engine Deployment, Service and PDB of a pool.
pub fn pool_object_name(dsd: &DSparkDeployment, pool: &NodePool) -> String {
    format!("{}-{}", dsd.name_any(), pool.name)
}

/// `{deployment}-{pool}-cost-table`: the pool's cost-table ConfigMap.
pub fn cost_table_config_map_name(dsd: &DSparkDeployment, pool: &NodePool) -> String {
    format!("{}-{}-cost-table", dsd.name_any(), pool.name)
}

/// `{deployment}-admin-token`: the Secret holding the engines' admin bearer token.
pub fn admin_secret_name(dsd: &DSparkDeployment) -> String {
    format!("{}-admin-token", dsd.name_any())
}

/// The `/scale` label selector: every engine pod of the deployment.
pub fn selector_string(dsd: &DSparkDeployment) -> String {
    format!("{LABEL_DEPLOYMENT}={}", dsd.name_any())
}

pub(crate) fn owner(dsd: &DSparkDeployment) -> OwnerReference {
    dsd.controller_owner_ref(&())
        .expect("a stored DSparkDeployment has a uid")
}

pub(crate) fn base_labels(dsd: &DSparkDeployment) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_DEPLOYMENT.to_string(), dsd.name_any()),
        (LABEL_MANAGED_BY.to_string(), MANAGER.to_string()),
    ])
}

pub(crate) fn pool_selector(dsd: &DSparkDeployment, pool: &NodePool) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_DEPLOYMENT.to_string(), dsd.name_any()),
        (LABEL_POOL.to_string(), pool.name.clone()),
    ])
}

pub(crate) fn pool_labels(dsd: &DSparkDeployment, pool: &NodePool) -> BTreeMap<String, String> {
    let mut l = base_labels(dsd);
    l.extend(pool_selector(dsd, pool));
    l.insert(LABEL_COMPONENT.into(), "engine".into());
    l
}

pub(crate) fn meta(
    dsd: &DSparkDeployment,
    name: String,
    labels: BTreeMap<String, String>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: dsd.namespace(),
        labels: Some(labels),
        owner_references: Some(vec![owner(dsd)]),
        ..Default::default()
    }
}

/// The label selector of profiling Jobs (what the controller watches them by).
pub fn profiling_job_selector() -> String {
    format!("{LABEL_COMPONENT}={COMPONENT_PROFILER},{LABEL_MANAGED_BY}={MANAGER}")
}

/// The deployments (of `all`) that a profiling Job's progress concerns: those in the Job's
/// namespace with a pool whose cost table is the one the Job's `LABEL_COST_TABLE` names.
/// The controller reconciles them when the Job changes, so a finished profile is stored and
/// pushed at once rather than at the next periodic requeue.
pub fn users_of_profiling_job<'a>(
    job_namespace: Option<&str>,
    job_labels: Option<&BTreeMap<String, String>>,
    all: impl IntoIterator<Item = &'a DSparkDeployment>,
) -> Vec<&'a DSparkDeployment> {
    let Some(table) = job_labels.and_then(|l| l.get(LABEL_COST_TABLE)) else {
        return Vec::new();
    };
    all.into_iter()
        .filter(|d| d.namespace().as_deref() == job_namespace)
        .filter(|d| {
            d.spec
                .pools
                .iter()
                .filter_map(|p| d.cost_table_key(p))
                .any(|k| &crate::crd::cost_table_name(&k) == table)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::cost_table_name;
    use crate::reconcile::pool::tests::sample;

    #[test]
    fn a_profiling_job_concerns_the_deployments_using_its_table() {
        let mut a = sample();
        a.metadata.namespace = Some("ns".into());
        let table = cost_table_name(&a.cost_table_key(&a.spec.pools[0]).unwrap());
        let mut b = a.clone();
        b.metadata.name = Some("other".into());
        let mut elsewhere = a.clone();
        elsewhere.metadata.namespace = Some("ns2".into());
        let mut unrelated = a.clone();
        unrelated.metadata.name = Some("unrelated".into());
        for p in &mut unrelated.spec.pools {
            p.node_type = "never-profiled".into();
        }
        let all = [a.clone(), b.clone(), elsewhere, unrelated];
        let labels = BTreeMap::from([(LABEL_COST_TABLE.to_string(), table)]);
        let names = |v: Vec<&DSparkDeployment>| -> Vec<String> {
            v.into_iter().map(|d| d.name_any()).collect()
        };
        assert_eq!(
            names(users_of_profiling_job(Some("ns"), Some(&labels), &all)),
            [a.name_any(), b.name_any()]
        );
        assert!(users_of_profiling_job(Some("ns"), None, &all).is_empty());
        let other = BTreeMap::from([(LABEL_COST_TABLE.to_string(), "nope".to_string())]);
        assert!(users_of_profiling_job(Some("ns"), Some(&other), &all).is_empty());
        assert!(profiling_job_selector().contains("=profiler"));
    }
}
