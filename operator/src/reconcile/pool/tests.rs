use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Probe, Volume};

use super::pins::PINS_VOLUME;
use super::*;
use crate::crd::*;
use crate::reconcile::names::{cost_table_config_map_name, NODE_TYPE_LABEL};
use crate::reconcile::names::{selector_string, LABEL_POOL};
use dspark_types::contract::{env as cenv, pins};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

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
    let vols = by_name(pod.volumes);
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

/// A pod's volumes (`spec.volumes`, which must be set) by name.
fn by_name(volumes: Option<Vec<Volume>>) -> BTreeMap<String, Volume> {
    volumes
        .unwrap()
        .into_iter()
        .map(|v| (v.name.clone(), v))
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
    let vols = by_name(pod.volumes);
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

/// Without a drain deadline in the spec the engine gets the default one on its command line,
/// the pod's grace period covers it plus the margin, and the probes use the engine's
/// liveness (`/health`, restarts a dead engine) and readiness (`/ready`, out of the Service
/// while loading or draining) paths on the HTTP port.
#[test]
fn default_drain_deadline_probes_and_grace_period() {
    let mut d = sample();
    d.spec.engine.drain_timeout_seconds = None;
    d.spec.engine.args.clear();
    let dep = engine_deployment(&d, &d.spec.pools[0], 1, false);
    let pod = dep.spec.template.spec.unwrap();
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    let i = args
        .iter()
        .position(|a| a == "--drain-timeout-secs")
        .unwrap();
    assert_eq!(args[i + 1], DEFAULT_DRAIN_SECONDS.to_string());
    assert_eq!(
        pod.termination_grace_period_seconds,
        Some(i64::from(DEFAULT_DRAIN_SECONDS) + GRACE_MARGIN_SECONDS)
    );
    let get = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let h = p.as_ref().unwrap().http_get.clone().unwrap();
        (h.path.unwrap(), h.port)
    };
    let http = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into());
    assert_eq!(
        get(&c.liveness_probe),
        ("/health".to_string(), http.clone())
    );
    assert_eq!(get(&c.readiness_probe), ("/ready".to_string(), http));
    let port = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("http"));
    assert_eq!(port.unwrap().container_port, HTTP_PORT);
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
