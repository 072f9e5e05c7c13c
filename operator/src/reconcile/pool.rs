//! Builders of the objects one node pool owns: the engine Deployment, its Service, its
//! PodDisruptionBudget and its cost-table ConfigMap; plus the deployment-wide Service and
//! admin-token Secret. Names and labels come from `names.rs`, the engine's flags, variables,
//! ports and paths from `dspark_types::contract`. Pure: object in, objects out (applied with
//! server-side apply).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, HostPathVolumeSource, ImageVolumeSource,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SeccompProfile, Secret, SecretEnvSource, SecretKeySelector,
    SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::ResourceExt;

use super::names::{
    admin_secret_name, base_labels, cost_table_config_map_name, meta, pool_labels,
    pool_object_name, pool_selector, LABEL_DEPLOYMENT, NODE_TYPE_LABEL, RESERVED_LABEL_PREFIX,
};
use crate::crd::{DSparkDeployment, ModelSource, NodePool, GRACE_MARGIN_SECONDS};
use dspark_types::contract::flags::{self, arg};
use dspark_types::contract::{env as cenv, paths, pins, ports};

/// Engine ports (the contract's).
pub const HTTP_PORT: i32 = ports::HTTP as i32;
pub const ADMIN_PORT: i32 = ports::ADMIN as i32;
/// Where the pool's cost table is mounted.
pub const COST_TABLE_DIR: &str = "/etc/dspark/cost-table";
pub const COST_TABLE_KEY: &str = "cost-table.json";
/// Where the admin token is mounted.
pub const ADMIN_TOKEN_DIR: &str = "/etc/dspark/admin";
pub const ADMIN_TOKEN_KEY: &str = "token";
/// UID the engine runs as (non-root).
pub const ENGINE_UID: i64 = 65532;

/// Where the model cache volume is mounted (fetch init containers and engine).
pub const MODEL_CACHE_DIR: &str = "/models/cache";
pub const MODEL_CACHE_VOLUME: &str = "model-cache";
/// Init containers that fetch remote sources; a failure is in their termination message.
pub const FETCH_MODEL_CONTAINER: &str = "fetch-model";
pub const FETCH_DRAFTER_CONTAINER: &str = "fetch-drafter";

/// A model source as the container sees it: the path (or URI) to pass and the volume to
/// mount, or, for a remote source, what its fetch needs.
pub struct Mounted {
    pub path: String,
    pub volume: Option<(Volume, VolumeMount)>,
    pub remote: Option<Remote>,
}

/// A remote source: fetched by an init container into the cache volume, then served from
/// there by the engine (same URI, same cache).
pub struct Remote {
    pub env: Vec<EnvVar>,
    pub env_from: Vec<EnvFromSource>,
    pub hugging_face: bool,
}

fn var(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }
}

/// Mounts `src` under `/models/{name}` (read-only) and returns the path the engine reads.
pub fn mount_model(src: &ModelSource, name: &str) -> Mounted {
    let dir = format!("/models/{name}");
    if let Some(uri) = src.fetch_uri() {
        let mut env = Vec::new();
        let mut env_from = Vec::new();
        if let Some(t) = src
            .hugging_face
            .as_ref()
            .and_then(|h| h.token_secret_ref.as_ref())
        {
            env.push(EnvVar {
                name: "HF_TOKEN".into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: t.name.clone(),
                        key: t.key.clone().unwrap_or_else(|| "token".into()),
                        optional: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        if let Some(s3) = &src.s3 {
            if let Some(e) = &s3.endpoint {
                env.push(var("AWS_ENDPOINT_URL", e.clone()));
            }
            env.push(var(
                "AWS_REGION",
                s3.region.clone().unwrap_or_else(|| "us-east-1".into()),
            ));
            if let Some(r) = &s3.secret_ref {
                env_from.push(EnvFromSource {
                    secret_ref: Some(SecretEnvSource {
                        name: r.name.clone(),
                        optional: None,
                    }),
                    ..Default::default()
                });
            }
        }
        return Mounted {
            path: uri.clone(),
            volume: None,
            remote: Some(Remote {
                env,
                env_from,
                hugging_face: uri.starts_with("hf://"),
            }),
        };
    }
    if let Some(img) = &src.image {
        let volume = Volume {
            name: name.into(),
            image: Some(ImageVolumeSource {
                reference: Some(img.reference.clone()),
                pull_policy: img.pull_policy.clone(),
            }),
            ..Default::default()
        };
        let mount = VolumeMount {
            name: name.into(),
            mount_path: dir.clone(),
            read_only: Some(true),
            ..Default::default()
        };
        let path = match img.path.as_deref().map(|p| p.trim_matches('/')) {
            Some(p) if !p.is_empty() => format!("{dir}/{p}"),
            _ => dir.clone(),
        };
        return Mounted {
            path,
            volume: Some((volume, mount)),
            remote: None,
        };
    }
    if let Some(pvc) = &src.pvc {
        let volume = Volume {
            name: name.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: pvc.claim_name.clone(),
                read_only: Some(true),
            }),
            ..Default::default()
        };
        let mount = VolumeMount {
            name: name.into(),
            mount_path: dir.clone(),
            read_only: Some(true),
            ..Default::default()
        };
        return Mounted {
            path: format!("{dir}/{}", pvc.path.trim_start_matches('/')),
            volume: Some((volume, mount)),
            remote: None,
        };
    }
    let hp = src.host_path.clone().unwrap_or(crate::crd::HostPathSource {
        path: String::new(),
    });
    let base = hp
        .path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty())
        .unwrap_or("model");
    let path = format!("{dir}/{base}");
    let volume = Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: hp.path.clone(),
            type_: None,
        }),
        ..Default::default()
    };
    let mount = VolumeMount {
        name: name.into(),
        mount_path: path.clone(),
        read_only: Some(true),
        ..Default::default()
    };
    Mounted {
        path,
        volume: Some((volume, mount)),
        remote: None,
    }
}

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

/// Where the pool's ConfigMap is mounted for its revision pins (fetches, engine, profiling).
pub const PINS_DIR: &str = "/etc/dspark/pins";
const PINS_VOLUME: &str = "revision-pins";

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
    let cache_mount = VolumeMount {
        name: MODEL_CACHE_VOLUME.into(),
        mount_path: MODEL_CACHE_DIR.into(),
        ..Default::default()
    };
    // The pool's ConfigMap, for its `revision-pins` (optional: there are none until a first
    // fetch resolved a source, and a missing file pins nothing).
    let pins_mount = VolumeMount {
        name: PINS_VOLUME.into(),
        mount_path: PINS_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    };
    let pins_var = var(cenv::REVISION_PINS, format!("{PINS_DIR}/{}", pins::KEY));
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
        let mut env = r.env.clone();
        env.push(pins_var.clone());
        env.extend(dsd.spec.engine.env.iter().cloned());
        plan.init_containers.push(Container {
            name: container.into(),
            image: Some(dsd.spec.engine.image_for(pool)),
            image_pull_policy: dsd.spec.engine.image_pull_policy.clone(),
            command: Some(vec!["dspark-engine".into()]),
            args: Some(vec![
                "fetch".into(),
                m.path.clone(),
                arg(flags::CACHE),
                MODEL_CACHE_DIR.into(),
                arg(flags::TERMINATION_LOG),
                "/dev/termination-log".into(),
            ]),
            env: Some(env),
            env_from: (!r.env_from.is_empty()).then(|| r.env_from.clone()),
            termination_message_path: Some("/dev/termination-log".into()),
            termination_message_policy: Some("FallbackToLogsOnError".into()),
            security_context: Some(container_security()),
            volume_mounts: Some(vec![cache_mount.clone(), pins_mount.clone()]),
            ..Default::default()
        });
        for e in &r.env {
            if !plan.env.iter().any(|x| x.name == e.name) {
                plan.env.push(e.clone());
            }
        }
        plan.env_from.extend(r.env_from.iter().cloned());
    }
    if plan.remote {
        let cache = dsd.spec.model_cache.clone().unwrap_or_default();
        plan.volumes.push(Volume {
            name: MODEL_CACHE_VOLUME.into(),
            persistent_volume_claim: cache.claim_name.as_ref().map(|c| {
                PersistentVolumeClaimVolumeSource {
                    claim_name: c.clone(),
                    read_only: None,
                }
            }),
            empty_dir: cache.claim_name.is_none().then(|| EmptyDirVolumeSource {
                size_limit: cache.size_limit.clone(),
                ..Default::default()
            }),
            ..Default::default()
        });
        plan.mounts.push(cache_mount);
        plan.volumes.push(Volume {
            name: PINS_VOLUME.into(),
            config_map: Some(ConfigMapVolumeSource {
                name: cost_table_config_map_name(dsd, pool),
                optional: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        });
        plan.mounts.push(pins_mount);
        plan.env.push(pins_var);
        // The engine serves what the init container fetched (the cache's refs), without
        // asking the Hub again: a commit pushed in between cannot change the weights.
        if hugging_face {
            plan.env.push(var("HF_HUB_OFFLINE", "1".into()));
        }
    }
    plan
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
    let t = dsd
        .spec
        .pod_template
        .as_ref()
        .and_then(|t| t.spec.clone())
        .unwrap_or_default();
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
    let t = dsd
        .spec
        .pod_template
        .as_ref()
        .and_then(|t| t.metadata.clone())
        .unwrap_or_default();
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
fn drain_in_args(dsd: &DSparkDeployment) -> Option<u32> {
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

fn tmp_volume() -> (Volume, VolumeMount) {
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

/// A URI the engine fetches (not a path in a volume).
fn is_remote(path: &str) -> bool {
    path.contains("://")
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

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
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

/// The pins file's text: the resolved revision of every remote source as the spec names it
/// (`None` before any is resolved). The fetches, the engine and profiling read it (see
/// `dspark_types::contract::pins`).
pub fn revision_pins(dsd: &DSparkDeployment) -> Option<String> {
    let resolved: Vec<_> = crate::crd::SOURCE_ROLES
        .iter()
        .filter_map(|role| dsd.resolved(role))
        .collect();
    (!resolved.is_empty()).then(|| {
        pins::render(
            resolved
                .iter()
                .map(|r| (r.source.as_str(), r.revision.as_str())),
        )
    })
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::*;
    use crate::reconcile::names::{selector_string, LABEL_POOL};

    pub(crate) fn sample() -> DSparkDeployment {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config/samples/dsparkdeployment-two-pools.yaml"
        ))
        .unwrap();
        let mut d: DSparkDeployment = serde_yaml::from_str(&text).unwrap();
        d.metadata.namespace = Some("ns".into());
        d.metadata.uid = Some("uid-1".into());
        d
    }

    #[test]
    fn engine_deployment_matches_the_pool() {
        let d = sample();
        let pool = &d.spec.pools[1];
        let dep = engine_deployment(&d, pool, 3, true);
        assert_eq!(dep.metadata.name.as_deref(), Some("qwen3-8b-a100"));
        assert_eq!(dep.metadata.namespace.as_deref(), Some("ns"));
        let owner = &dep.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("DSparkDeployment", "uid-1", Some(true))
        );
        let spec = dep.spec;
        assert_eq!(spec.replicas, Some(3));
        let pod = spec.template.spec.unwrap();
        let ns = pod.node_selector.unwrap();
        assert_eq!(ns[NODE_TYPE_LABEL], "a100-80gb");
        assert_eq!(ns["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-80GB");
        assert_eq!(
            pod.tolerations.unwrap()[0].key.as_deref(),
            Some("nvidia.com/gpu")
        );
        assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
        let c = &pod.containers[0];
        let res = c.resources.as_ref().unwrap();
        assert_eq!(
            res.limits.as_ref().unwrap()["nvidia.com/gpu"],
            Quantity("1".into())
        );
        assert_eq!(
            res.requests.as_ref().unwrap()["nvidia.com/gpu"],
            Quantity("1".into())
        );
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let args = c.args.as_ref().unwrap().join(" ");
        assert_eq!(
            args,
            "serve --model /models/model/qwen3-8b --drafter /models/drafter/qwen3-8b-dspark-b7 \
             --speculation dspark-rnn --policy threshold --host 0.0.0.0 --port 8000 \
             --admin-port 8001 --admin-token-file /etc/dspark/admin/token \
             --drain-timeout-secs 60 \
             --cost-table /etc/dspark/cost-table/cost-table.json --max-batch-tokens 8192"
        );
        // The sample's drain deadline (60 s) plus the margin; its pod template and rollout.
        assert_eq!(pod.termination_grace_period_seconds, Some(75));
        assert_eq!(
            pod.image_pull_secrets.as_ref().unwrap()[0].name,
            "registry-credentials"
        );
        let tpl = spec.template.metadata.as_ref().unwrap();
        assert_eq!(
            tpl.annotations.as_ref().unwrap()["example.com/team"],
            "ml-serving"
        );
        let ru = spec
            .strategy
            .as_ref()
            .unwrap()
            .rolling_update
            .as_ref()
            .unwrap();
        assert_eq!(
            (ru.max_surge.clone(), ru.max_unavailable.clone()),
            (Some(IntOrString::Int(0)), Some(IntOrString::Int(1))),
            "the a100 pool takes the defaults"
        );
        assert_eq!(
            rolling_update(&d.spec.pools[0]).max_surge,
            Some(IntOrString::Int(1))
        );
        assert_eq!(
            c.command.as_deref(),
            Some(&["dspark-engine".to_string()][..])
        );
        let probe = |p: &Option<Probe>| {
            p.as_ref()
                .unwrap()
                .http_get
                .as_ref()
                .unwrap()
                .path
                .clone()
                .unwrap()
        };
        assert_eq!(probe(&c.readiness_probe), "/ready");
        assert_eq!(probe(&c.liveness_probe), "/health");
        let ports: Vec<i32> = c
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.container_port)
            .collect();
        assert_eq!(ports, vec![8000, 8001]);
        let mounts: BTreeMap<String, String> = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| (m.name.clone(), m.mount_path.clone()))
            .collect();
        assert_eq!(mounts["cost-table"], "/etc/dspark/cost-table");
        assert_eq!(mounts["admin-token"], "/etc/dspark/admin");
        assert_eq!(mounts["model"], "/models/model");
        assert_eq!(mounts["tmp"], "/tmp");
        let vols: BTreeMap<String, Volume> = pod
            .volumes
            .unwrap()
            .into_iter()
            .map(|v| (v.name.clone(), v))
            .collect();
        assert_eq!(
            vols["cost-table"].config_map.as_ref().unwrap().name,
            "qwen3-8b-a100-cost-table"
        );
        assert_eq!(
            vols["admin-token"]
                .secret
                .as_ref()
                .unwrap()
                .secret_name
                .as_deref(),
            Some("qwen3-8b-admin-token")
        );
        assert_eq!(
            vols["model"]
                .persistent_volume_claim
                .as_ref()
                .unwrap()
                .claim_name,
            "models"
        );
        let env = env_of(c);
        assert_eq!(env["DSPARK_GAMMA"], "7");
        assert_eq!(env["DSPARK_THRESHOLD"], "0.4");
        assert_eq!(env["DSPARK_ONLINE_CALIBRATION"], "0.05");
        assert!(!env.contains_key("DSPARK_POLICY_EXPERIMENT"));
        let mut d2 = d.clone();
        d2.spec.scheduler.as_mut().unwrap().experiment = Some(crate::crd::ExperimentSpec {
            arms: vec!["dspark".into(), "none".into()],
            window_seconds: Some(60),
        });
        let dep2 = engine_deployment(&d2, pool, 3, true);
        let env2 = env_of(&dep2.spec.template.spec.unwrap().containers[0]);
        assert_eq!(env2["DSPARK_POLICY_EXPERIMENT"], "dspark,none");
        assert_eq!(env2["DSPARK_EXPERIMENT_WINDOW"], "60");
        assert_eq!(env["RUST_LOG"], "info");
        assert_eq!(spec.selector.match_labels.unwrap()[LABEL_POOL], "a100");
    }

    /// A container's environment as name -> value.
    fn env_of(c: &Container) -> BTreeMap<String, String> {
        c.env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn no_table_no_flag_and_host_path_models_mount_the_file() {
        let mut d = sample();
        d.spec.model = ModelSource {
            host_path: Some(HostPathSource {
                path: "/data/m/smollm2.gguf".into(),
            }),
            ..Default::default()
        };
        d.spec.drafter = None;
        d.spec.scheduler = None;
        d.spec.speculation = None;
        d.spec.engine.args.clear();
        let dep = engine_deployment(&d, &d.spec.pools[0], 1, false);
        let pod = dep.spec.template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(
            c.args.as_ref().unwrap().join(" "),
            "serve --model /models/model/smollm2.gguf --host 0.0.0.0 --port 8000 --admin-port 8001 \
             --admin-token-file /etc/dspark/admin/token --drain-timeout-secs 60"
        );
        let model = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "model")
            .unwrap();
        assert_eq!(model.host_path.unwrap().path, "/data/m/smollm2.gguf");
        // A pool without accelerators requests none.
        let mut cpu = d.spec.pools[0].clone();
        cpu.gpu.count = 0;
        let r = resources(&d, &cpu);
        assert!(r.limits.is_none() && r.requests.is_none());
    }

    /// A Hugging Face source: an init container fetches it into the cache volume (token from
    /// the Secret, its error in the termination message); the engine serves the same URI from
    /// the same cache offline; start-up budgets reach the probe and the Deployment.
    #[test]
    fn remote_sources_are_fetched_by_an_init_container() {
        let mut d = sample();
        d.spec.model = ModelSource {
            hugging_face: Some(crate::crd::HuggingFaceSource {
                repo: "org/repo".into(),
                revision: Some("v1".into()),
                files: vec!["m.Q4_1.gguf".into()],
                token_secret_ref: Some(crate::crd::SecretKeyRef {
                    name: "hf".into(),
                    key: None,
                }),
            }),
            ..Default::default()
        };
        d.spec.drafter = Some(ModelSource {
            image: Some(crate::crd::ImageSource {
                reference: "registry.local/drafters/d:1".into(),
                path: Some("/drafter".into()),
                pull_policy: None,
            }),
            ..Default::default()
        });
        d.spec.model_cache = Some(crate::crd::ModelCacheSpec {
            claim_name: Some("models".into()),
            size_limit: None,
        });
        d.spec.startup = Some(crate::crd::StartupSpec {
            startup_probe_seconds: Some(600),
            progress_deadline_seconds: None,
        });
        let dep = engine_deployment(&d, &d.spec.pools[0], 1, false);
        assert_eq!(dep.spec.progress_deadline_seconds, Some(3600));
        let pod = dep.spec.template.spec.unwrap();
        let init = pod.init_containers.as_ref().unwrap();
        assert_eq!(init.len(), 1, "only the remote source is fetched");
        assert_eq!(init[0].name, FETCH_MODEL_CONTAINER);
        assert_eq!(
            init[0].args.as_ref().unwrap().join(" "),
            "fetch hf://org/repo@v1/m.Q4_1.gguf --cache /models/cache --termination-log /dev/termination-log"
        );
        assert_eq!(
            init[0].termination_message_policy.as_deref(),
            Some("FallbackToLogsOnError")
        );
        let token = init[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "HF_TOKEN")
            .unwrap();
        let sel = token
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!((sel.name.as_str(), sel.key.as_str()), ("hf", "token"));
        let c = &pod.containers[0];
        let args = c.args.as_ref().unwrap().join(" ");
        assert!(
            args.starts_with(
                "serve --model hf://org/repo@v1/m.Q4_1.gguf --drafter /models/drafter/drafter --cache /models/cache"
            ),
            "{args}"
        );
        let env = env_of(c);
        assert_eq!(env["HF_HUB_OFFLINE"], "1");
        assert_eq!(
            c.startup_probe.as_ref().unwrap().failure_threshold,
            Some(120)
        );
        let vols: BTreeMap<String, Volume> = pod
            .volumes
            .unwrap()
            .into_iter()
            .map(|v| (v.name.clone(), v))
            .collect();
        assert_eq!(
            vols[MODEL_CACHE_VOLUME]
                .persistent_volume_claim
                .as_ref()
                .unwrap()
                .claim_name,
            "models"
        );
        assert_eq!(
            vols["drafter"].image.as_ref().unwrap().reference.as_deref(),
            Some("registry.local/drafters/d:1")
        );
        // The profiling Job fetches the same way.
        let ct = crate::crd::DSparkCostTable::new(
            "t",
            crate::crd::DSparkCostTableSpec {
                model_id: d.spec.model.identity(),
                drafter_id: None,
                engine_version: "0.1.0".into(),
                node_type: "a100".into(),
            },
        );
        let job = crate::reconcile::profiling::profiling_job(&d, &d.spec.pools[0], &ct, "j");
        let jp = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(jp.init_containers.unwrap()[0].name, FETCH_MODEL_CONTAINER);
        assert!(jp.containers[0]
            .args
            .as_ref()
            .unwrap()
            .contains(&"--cache".to_string()));

        // Revision pins: the fetches, the engine and the profiling container read the pool
        // ConfigMap's `revision-pins`, which holds the resolved commit once there is one.
        let pins_path = format!("{PINS_DIR}/{}", pins::KEY);
        for c in [&init[0], c, &jp.containers[0]] {
            assert_eq!(env_of(c)[cenv::REVISION_PINS], pins_path, "{}", c.name);
            assert!(
                c.volume_mounts
                    .iter()
                    .flatten()
                    .any(|m| m.name == PINS_VOLUME && m.mount_path == PINS_DIR),
                "{}",
                c.name
            );
        }
        let pins_volume = vols[PINS_VOLUME].config_map.as_ref().unwrap();
        assert_eq!(
            pins_volume.name,
            cost_table_config_map_name(&d, &d.spec.pools[0])
        );
        assert_eq!(pins_volume.optional, Some(true));
        let cm = cost_table_config_map(&d, &d.spec.pools[0], None);
        assert!(cm.data.is_none(), "nothing resolved, nothing pinned");
        d.status = Some(crate::crd::DSparkDeploymentStatus {
            resolved_sources: vec![crate::crd::ResolvedSource {
                role: "model".into(),
                source: "hf://org/repo@v1/m.Q4_1.gguf".into(),
                revision: "c0ffee".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        let cm = cost_table_config_map(&d, &d.spec.pools[0], Some("{}"));
        let data = cm.data.unwrap();
        assert_eq!(data[pins::KEY], "hf://org/repo@v1/m.Q4_1.gguf c0ffee\n");
        assert_eq!(data[COST_TABLE_KEY], "{}");
        assert_eq!(
            d.cost_table_key(&d.spec.pools[0]).unwrap().model_id,
            "hf://org/repo@v1/m.Q4_1.gguf@c0ffee"
        );
    }

    /// Without `spec.engine.image` a pool runs the engine image of the operator's version:
    /// the CUDA one where it requests GPUs, the CPU one elsewhere (fetch init containers and
    /// profiling Jobs too); the cost tables are keyed by that version.
    #[test]
    fn the_default_engine_image_follows_the_pools_accelerators() {
        let mut d = sample();
        d.spec.engine.image = None;
        d.spec.engine.version = None;
        let v = env!("CARGO_PKG_VERSION");
        let mut cpu = d.spec.pools[0].clone();
        cpu.gpu.count = 0;
        let gpu = &d.spec.pools[1].clone();
        assert_eq!(gpu.gpu.count, 1);
        let image_of = |d: &DSparkDeployment, p: &NodePool| {
            engine_deployment(d, p, 1, false)
                .spec
                .template
                .spec
                .unwrap()
                .containers[0]
                .image
                .clone()
                .unwrap()
        };
        assert_eq!(image_of(&d, gpu), format!("dspark/engine-cuda:{v}"));
        assert_eq!(image_of(&d, &cpu), format!("dspark/engine:{v}"));
        assert_eq!(d.spec.engine.effective_version(), v);
        let ct = crate::crd::DSparkCostTable::new(
            "t",
            crate::crd::DSparkCostTableSpec {
                model_id: "m".into(),
                drafter_id: None,
                engine_version: v.into(),
                node_type: cpu.node_type.clone(),
            },
        );
        let job = crate::reconcile::profiling::profiling_job(&d, &cpu, &ct, "j");
        let c = &job.spec.unwrap().template.spec.unwrap().containers[0];
        assert_eq!(
            c.image.as_deref(),
            Some(format!("dspark/engine:{v}").as_str())
        );
        // An explicit image wins, and its tag keys the tables.
        d.spec.engine.image = Some("registry.local/dspark/engine:1.2.3".into());
        assert_eq!(image_of(&d, gpu), "registry.local/dspark/engine:1.2.3");
        assert_eq!(d.spec.engine.effective_version(), "1.2.3");
        d.spec.engine.image = Some("registry.local/dspark/engine@sha256:00".into());
        assert_eq!(d.spec.engine.effective_version(), "latest");
    }

    /// The drain flag is not passed twice; the grace period follows the flag the user passes,
    /// or the template's own value; template labels never replace the operator's.
    #[test]
    fn drain_flag_grace_period_and_template_labels() {
        let mut d = sample();
        d.spec.engine.args = vec!["--drain-timeout-secs=120".into()];
        let pool = &d.spec.pools[0];
        let dep = engine_deployment(&d, pool, 1, false);
        let pod = dep.spec.template.spec.as_ref().unwrap();
        let args = pod.containers[0].args.clone().unwrap();
        assert_eq!(
            args.iter()
                .filter(|a| a.starts_with("--drain-timeout-secs"))
                .count(),
            1,
            "{args:?}"
        );
        assert_eq!(pod.termination_grace_period_seconds, Some(135));
        let t = d.spec.pod_template.get_or_insert_with(Default::default);
        t.spec
            .get_or_insert_with(Default::default)
            .termination_grace_period_seconds = Some(7);
        t.metadata
            .get_or_insert_with(Default::default)
            .labels
            .insert(LABEL_POOL.into(), "other".into());
        let dep = engine_deployment(&d, &d.spec.pools[0], 1, false);
        let tpl = dep.spec.template;
        assert_eq!(tpl.spec.unwrap().termination_grace_period_seconds, Some(7));
        assert_eq!(tpl.metadata.unwrap().labels.unwrap()[LABEL_POOL], "h100");
    }

    #[test]
    fn services_pdb_config_map_and_secret() {
        let d = sample();
        let pool = &d.spec.pools[0];
        let s = pool_service(&d, pool);
        let spec = s.spec.unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("qwen3-8b-h100"));
        assert_eq!(spec.selector.unwrap()[LABEL_POOL], "h100");
        assert_eq!(spec.ports.unwrap()[0].port, 8000);
        let all = deployment_service(&d);
        assert_eq!(all.metadata.name.as_deref(), Some("qwen3-8b"));
        assert!(!all.spec.unwrap().selector.unwrap().contains_key(LABEL_POOL));
        let pdb = pool_pdb(&d, pool);
        assert_eq!(pdb.spec.unwrap().max_unavailable, Some(IntOrString::Int(1)));
        let cm = cost_table_config_map(&d, pool, Some("{}"));
        assert_eq!(cm.data.unwrap()[COST_TABLE_KEY], "{}");
        assert!(cost_table_config_map(&d, pool, None).data.is_none());
        let sec = admin_secret(&d, "abc");
        assert_eq!(sec.data.unwrap()[ADMIN_TOKEN_KEY].0, b"abc");
        assert_eq!(
            selector_string(&d),
            "serving.dspark.dev/deployment=qwen3-8b"
        );
    }
}
