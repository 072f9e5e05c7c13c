//! Pod-level settings shared by engine and profiling pods: placement and security with
//! `spec.podTemplate` merged in, the template's metadata, the grace period that follows the
//! engine's drain deadline, container security, resources and HTTP probes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, HTTPGetAction, PodSecurityContext, PodSpec,
    Probe, ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::ENGINE_UID;
use crate::crd::{DSparkDeployment, NodePool, PodTemplateOverrides, GRACE_MARGIN_SECONDS};
use crate::reconcile::names::{NODE_TYPE_LABEL, RESERVED_LABEL_PREFIX};
use dspark_types::contract::flags::{self, arg};

/// A part of `spec.podTemplate` (its default when the template or the part is unset).
fn template_part<T: Default>(
    dsd: &DSparkDeployment,
    part: impl FnOnce(&PodTemplateOverrides) -> Option<T>,
) -> T {
    dsd.spec
        .pod_template
        .as_ref()
        .and_then(part)
        .unwrap_or_default()
}

/// Pod-level placement and security shared by engine and profiling pods, with
/// `spec.podTemplate` merged in: its node selector and tolerations are added to the pool's
/// (the pool's terms and the node-type label win), its other fields set. The service-account
/// token stays unmounted.
pub fn pod_spec_base(
    dsd: &DSparkDeployment,
    pool: &NodePool,
    containers: Vec<Container>,
    volumes: Vec<Volume>,
) -> PodSpec {
    let t = template_part(dsd, |t| t.spec.clone());
    let mut node_selector = t.node_selector.clone();
    node_selector.extend(pool.node_selector.clone());
    node_selector.insert(NODE_TYPE_LABEL.into(), pool.node_type.clone());
    let mut tolerations = pool.tolerations.clone();
    tolerations.extend(t.tolerations.iter().cloned());
    PodSpec {
        containers,
        volumes: Some(volumes),
        node_selector: Some(node_selector),
        tolerations: (!tolerations.is_empty()).then_some(tolerations),
        automount_service_account_token: Some(false),
        image_pull_secrets: (!t.image_pull_secrets.is_empty()).then_some(t.image_pull_secrets),
        service_account_name: t.service_account_name,
        priority_class_name: t.priority_class_name,
        runtime_class_name: t.runtime_class_name,
        affinity: t.affinity,
        topology_spread_constraints: (!t.topology_spread_constraints.is_empty())
            .then_some(t.topology_spread_constraints),
        termination_grace_period_seconds: Some(
            t.termination_grace_period_seconds
                .unwrap_or_else(|| i64::from(drain_seconds(dsd)) + GRACE_MARGIN_SECONDS),
        ),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(ENGINE_UID),
            run_as_group: Some(ENGINE_UID),
            fs_group: Some(ENGINE_UID),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The metadata of a pod template: `labels` over `spec.podTemplate.metadata`'s (the
/// operator's labels win and the template's `serving.dspark.dev/*` labels are dropped, so
/// selectors keep working), and its annotations.
pub fn pod_template_meta(dsd: &DSparkDeployment, labels: BTreeMap<String, String>) -> ObjectMeta {
    let t = template_part(dsd, |t| t.metadata.clone());
    // Labels under the operator's prefix select pods into pools and Services: never taken
    // from the template.
    let mut all: BTreeMap<String, String> = t
        .labels
        .into_iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_LABEL_PREFIX))
        .collect();
    all.extend(labels);
    ObjectMeta {
        labels: Some(all),
        annotations: (!t.annotations.is_empty()).then_some(t.annotations),
        ..Default::default()
    }
}

/// The `--drain-timeout-secs` value in `engine.args`, if the user passes it there.
pub(super) fn drain_in_args(dsd: &DSparkDeployment) -> Option<u32> {
    let args = &dsd.spec.engine.args;
    args.iter().enumerate().find_map(|(i, a)| {
        let flag = arg(flags::DRAIN_TIMEOUT_SECS);
        if let Some(v) = a.strip_prefix(&flag).and_then(|v| v.strip_prefix('=')) {
            return v.parse().ok();
        }
        (*a == flag)
            .then(|| args.get(i + 1)?.parse().ok())
            .flatten()
    })
}

/// The engine's drain deadline: `--drain-timeout-secs` in `engine.args`, else
/// `engine.drainTimeoutSeconds` (default 30).
pub fn drain_seconds(dsd: &DSparkDeployment) -> u32 {
    drain_in_args(dsd).unwrap_or_else(|| dsd.spec.drain_seconds())
}

/// Non-root, read-only root filesystem, no privilege escalation, no capabilities.
pub fn container_security() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The engine's resources plus the pool's accelerators (request = limit).
pub fn resources(dsd: &DSparkDeployment, pool: &NodePool) -> ResourceRequirements {
    let mut r = dsd.spec.engine.resources.clone().unwrap_or_default();
    if pool.gpu.count > 0 {
        let q = Quantity(pool.gpu.count.to_string());
        r.requests
            .get_or_insert_with(BTreeMap::new)
            .insert(pool.gpu.resource_name.clone(), q.clone());
        r.limits
            .get_or_insert_with(BTreeMap::new)
            .insert(pool.gpu.resource_name.clone(), q);
    }
    r
}

pub(super) fn tmp_volume() -> (Volume, VolumeMount) {
    (
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..Default::default()
        },
    )
}

pub(super) fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Default::default()
    }
}
