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
