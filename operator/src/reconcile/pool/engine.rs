//! A pool's engine Deployment: the `dspark-engine serve` container (arguments, environment,
//! ports, probes) on the pool's pod spec, and its rollout.

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, EnvVar, PodSpec, PodTemplateSpec,
    SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::plan::model_plan;
use super::pod::{
    container_security, drain_in_args, http_probe, pod_spec_base, pod_template_meta, resources,
    tmp_volume,
};
use super::{
    var, ADMIN_PORT, ADMIN_TOKEN_DIR, ADMIN_TOKEN_KEY, COST_TABLE_DIR, COST_TABLE_KEY, HTTP_PORT,
    MODEL_CACHE_DIR,
};
use crate::crd::{DSparkDeployment, NodePool};
use crate::reconcile::names::{
    admin_secret_name, cost_table_config_map_name, meta, pool_labels, pool_object_name,
    pool_selector,
};
use dspark_types::contract::flags::{self, arg};
use dspark_types::contract::source::SourceUri;
use dspark_types::contract::{env as cenv, paths};

/// The `dspark-engine serve` arguments of a pool's pods.
pub fn serve_args(
    dsd: &DSparkDeployment,
    model: &str,
    drafter: Option<&str>,
    has_table: bool,
) -> Vec<String> {
    let mut a: Vec<String> = vec!["serve".into(), arg(flags::MODEL), model.into()];
    if let Some(d) = drafter {
        a.extend([arg(flags::DRAFTER), d.into()]);
    }
    if [Some(model), drafter].into_iter().flatten().any(is_remote) {
        a.extend([arg(flags::CACHE), MODEL_CACHE_DIR.into()]);
    }
    if let Some(s) = dsd.spec.speculation {
        a.extend([arg(flags::SPECULATION), s.engine_flag().into()]);
    }
    if let Some(p) = dsd
        .spec
        .scheduler
        .as_ref()
        .and_then(|s| s.policy.engine_flag())
    {
        a.extend([arg(flags::POLICY), p.into()]);
    }
    a.extend([
        arg(flags::HOST),
        "0.0.0.0".into(),
        arg(flags::PORT),
        HTTP_PORT.to_string(),
        arg(flags::ADMIN_PORT),
        ADMIN_PORT.to_string(),
        arg(flags::ADMIN_TOKEN_FILE),
        format!("{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}"),
    ]);
    if drain_in_args(dsd).is_none() {
        a.extend([
            arg(flags::DRAIN_TIMEOUT_SECS),
            dsd.spec.drain_seconds().to_string(),
        ]);
    }
    if has_table {
        a.extend([
            arg(flags::COST_TABLE),
            format!("{COST_TABLE_DIR}/{COST_TABLE_KEY}"),
        ]);
    }
    a.extend(dsd.spec.engine.args.iter().cloned());
    a
}

/// A URI the engine fetches (not a path in a volume; the contract's grammar decides).
fn is_remote(path: &str) -> bool {
    SourceUri::names_remote(path)
}

fn engine_env(dsd: &DSparkDeployment, pool: &NodePool) -> Vec<EnvVar> {
    let mut env = vec![var(cenv::NODE_TYPE, pool.node_type.clone())];
    if let Some(s) = &dsd.spec.scheduler {
        if let Some(g) = s.gamma {
            env.push(var(cenv::GAMMA, g.to_string()));
        }
        if let Some(t) = s.threshold {
            env.push(var(cenv::THRESHOLD, t.to_string()));
        }
        if let Some(r) = s.online_calibration {
            env.push(var(cenv::ONLINE_CALIBRATION, r.to_string()));
        }
        if let Some(e) = &s.experiment {
            env.push(var(cenv::POLICY_EXPERIMENT, e.arms.join(",")));
            if let Some(w) = e.window_seconds {
                env.push(var(cenv::EXPERIMENT_WINDOW, w.to_string()));
            }
        }
    }
    env.extend(dsd.spec.engine.env.iter().cloned());
    env
}

/// The engine Deployment of `pool` with `replicas` replicas. `has_table`: the pool's ConfigMap
/// holds a cost table, so `--cost-table` is passed (before that the engine uses its default
/// table, and a table pushed over the admin API).
pub fn engine_deployment(
    dsd: &DSparkDeployment,
    pool: &NodePool,
    replicas: i32,
    has_table: bool,
) -> Deployment {
    let plan = model_plan(dsd, pool);
    let (tmp_v, tmp_m) = tmp_volume();
    let mut volumes = vec![
        tmp_v,
        Volume {
            name: "cost-table".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: cost_table_config_map_name(dsd, pool),
                optional: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "admin-token".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(admin_secret_name(dsd)),
                default_mode: Some(0o440),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    let mut mounts = vec![
        tmp_m,
        VolumeMount {
            name: "cost-table".into(),
            mount_path: COST_TABLE_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "admin-token".into(),
            mount_path: ADMIN_TOKEN_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        },
    ];
    volumes.extend(plan.volumes.iter().cloned());
    mounts.extend(plan.mounts.iter().cloned());
    let mut env = engine_env(dsd, pool);
    env.extend(plan.env.iter().cloned());
    let startup = dsd.spec.startup.clone().unwrap_or_default();
    let startup_seconds = startup
        .startup_probe_seconds
        .unwrap_or(crate::crd::DEFAULT_STARTUP_PROBE_SECONDS);
    let container = Container {
        name: "engine".into(),
        image: Some(dsd.spec.engine.image_for(pool)),
        image_pull_policy: dsd.spec.engine.image_pull_policy.clone(),
        command: Some(vec!["dspark-engine".into()]),
        args: Some(serve_args(
            dsd,
            &plan.model,
            plan.drafter.as_deref(),
            has_table,
        )),
        env: Some(env),
        env_from: (!plan.env_from.is_empty()).then(|| plan.env_from.clone()),
        ports: Some(vec![
            ContainerPort {
                name: Some("http".into()),
                container_port: HTTP_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some("admin".into()),
                container_port: ADMIN_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        resources: Some(resources(dsd, pool)),
        readiness_probe: Some(http_probe(paths::READY, 5, 3)),
        liveness_probe: Some(http_probe(paths::HEALTH, 10, 3)),
        startup_probe: Some(http_probe(paths::HEALTH, 5, (startup_seconds + 4) / 5)),
        security_context: Some(container_security()),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let labels = pool_labels(dsd, pool);
    Deployment {
        metadata: meta(dsd, pool_object_name(dsd, pool), labels.clone()),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(pool_selector(dsd, pool)),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(rolling_update(pool)),
            }),
            template: PodTemplateSpec {
                metadata: Some(pod_template_meta(dsd, labels)),
                spec: Some(PodSpec {
                    init_containers: (!plan.init_containers.is_empty())
                        .then(|| plan.init_containers.clone()),
                    ..pod_spec_base(dsd, pool, vec![container], volumes)
                }),
            },
            // Set when asked for, or when the rollout includes a download; otherwise left to
            // the Kubernetes default (and to whoever else sets it).
            progress_deadline_seconds: startup.progress_deadline_seconds.or(plan
                .remote
                .then_some(crate::crd::DEFAULT_PROGRESS_DEADLINE_SECONDS)),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The pool's rollout: `pools[].rollout`, by default maxSurge 0 and maxUnavailable 1 (a pool
/// whose nodes' accelerators are all taken cannot place a surge pod, so a surge-first rollout
/// would never progress).
pub fn rolling_update(pool: &NodePool) -> RollingUpdateDeployment {
    let r = pool.rollout.clone().unwrap_or_default();
    RollingUpdateDeployment {
        max_surge: Some(r.max_surge.unwrap_or(IntOrString::Int(0))),
        max_unavailable: Some(r.max_unavailable.unwrap_or(IntOrString::Int(1))),
    }
}
