//! The pool's Service, PodDisruptionBudget and cost-table ConfigMap, and the deployment-wide
//! Service and admin-token Secret.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::ResourceExt;

use super::pins::revision_pins;
use super::{ADMIN_TOKEN_KEY, COST_TABLE_KEY, HTTP_PORT};
use crate::crd::{DSparkDeployment, NodePool};
use crate::reconcile::names::{
    admin_secret_name, base_labels, cost_table_config_map_name, meta, pool_labels,
    pool_object_name, pool_selector, LABEL_DEPLOYMENT,
};
use dspark_types::contract::pins;

fn http_service(
    dsd: &DSparkDeployment,
    name: String,
    labels: BTreeMap<String, String>,
    selector: BTreeMap<String, String>,
) -> Service {
    Service {
        metadata: meta(dsd, name, labels),
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: HTTP_PORT,
                target_port: Some(IntOrString::String("http".into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pool's Service (OpenAI API of that pool's pods only).
pub fn pool_service(dsd: &DSparkDeployment, pool: &NodePool) -> Service {
    http_service(
        dsd,
        pool_object_name(dsd, pool),
        pool_labels(dsd, pool),
        pool_selector(dsd, pool),
    )
}

/// The deployment-wide Service over every pool (what clients use; lets extra capacity on
/// any pool serve all traffic).
pub fn deployment_service(dsd: &DSparkDeployment) -> Service {
    let selector = BTreeMap::from([(LABEL_DEPLOYMENT.to_string(), dsd.name_any())]);
    http_service(dsd, dsd.name_any(), base_labels(dsd), selector)
}

/// At most one engine pod of the pool down at a time for voluntary disruptions.
pub fn pool_pdb(dsd: &DSparkDeployment, pool: &NodePool) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(dsd, pool_object_name(dsd, pool), pool_labels(dsd, pool)),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(pool_selector(dsd, pool)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pool's cost-table ConfigMap; without a table it holds no data (the engine keeps its
/// default table).
pub fn cost_table_config_map(
    dsd: &DSparkDeployment,
    pool: &NodePool,
    table_json: Option<&str>,
) -> ConfigMap {
    ConfigMap {
        metadata: meta(
            dsd,
            cost_table_config_map_name(dsd, pool),
            pool_labels(dsd, pool),
        ),
        data: {
            let mut data = BTreeMap::new();
            if let Some(t) = table_json {
                data.insert(COST_TABLE_KEY.to_string(), t.to_string());
            }
            if let Some(p) = revision_pins(dsd) {
                data.insert(pins::KEY.to_string(), p);
            }
            (!data.is_empty()).then_some(data)
        },
        ..Default::default()
    }
}

/// The admin-token Secret holding `token`.
pub fn admin_secret(dsd: &DSparkDeployment, token: &str) -> Secret {
    Secret {
        metadata: meta(dsd, admin_secret_name(dsd), base_labels(dsd)),
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            ADMIN_TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}
