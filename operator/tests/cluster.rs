//! Integration tests against a real apiserver (`tests/cluster/cluster.sh up`, then
//! `export KUBECONFIG=$(tests/cluster/cluster.sh kubeconfig)`). Without a reachable cluster
//! each test prints why and passes, unless `DSPARK_REQUIRE_CLUSTER=1`, where it fails.
//!
//! Each test works in a namespace of its own and deletes it at the end.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, ResourceExt};

use dspark_operator::crd::{AutoscalingMode, CostTablePhase, DSparkCostTable, DSparkDeployment};
use dspark_operator::reconcile::names::{LABEL_MANAGED_BY, MANAGER};
use dspark_operator::reconcile::{controller, error_policy, reconcile, Context};

/// A client for the test cluster, or `None` (after saying why) when there is none.
async fn cluster(test: &str) -> Option<Client> {
    // The operator's log goes to the test's captured output (shown when it fails):
    // warnings and what each reconcile did, so a timeout says which call kept failing.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,dspark_operator=info".into()),
        )
        .try_init();
    let require = std::env::var("DSPARK_REQUIRE_CLUSTER").as_deref() == Ok("1");
    let skip = |why: String| {
        if require {
            panic!("{test}: DSPARK_REQUIRE_CLUSTER=1 but {why}");
        }
        eprintln!(
            "SKIP {test}: {why} (start one with tests/cluster/cluster.sh up and export KUBECONFIG)"
        );
        None
    };
    if std::env::var_os("KUBECONFIG").is_none() {
        return skip("KUBECONFIG is not set".into());
    }
    let client = match Client::try_default().await {
        Ok(c) => c,
        Err(e) => return skip(format!("no usable kubeconfig: {e}")),
    };
    match tokio::time::timeout(Duration::from_secs(5), client.apiserver_version()).await {
        Ok(Ok(_)) => Some(client),
        Ok(Err(e)) => skip(format!("the apiserver does not answer: {e}")),
        Err(_) => skip("the apiserver does not answer within 5 s".into()),
    }
}

/// The test cluster with the CRDs installed and a fresh namespace `{ns_base}-{unique}`, or
/// `None` (after saying why) when there is no cluster.
async fn test_env(test: &str, ns_base: &str) -> Option<(Client, String)> {
    let client = cluster(test).await?;
    install_crds(&client).await;
    let ns = namespace(&client, ns_base).await;
    Some((client, ns))
}

fn repo(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// Applies the committed CRDs and waits until they are established.
async fn install_crds(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (file, _) in dspark_operator::crd::yaml::render().unwrap() {
        let text = std::fs::read_to_string(repo("crds").join(file)).unwrap();
        let crd: CustomResourceDefinition = serde_yaml::from_str(&text).unwrap();
        api.patch(
            &crd.name_any(),
            &PatchParams::apply("dspark-tests").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {file}: {e}"));
        let name = crd.name_any();
        wait_for(&format!("CRD {name} established"), || {
            let api = api.clone();
            let name = name.clone();
            async move {
                let c = api.get(&name).await.ok()?;
                c.status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            }
        })
        .await;
    }
}

async fn wait_for<T, F, Fut>(what: &str, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    wait_up_to(what, Duration::from_secs(60), f).await
}

/// [`wait_for`] with a deadline of its own.
async fn wait_up_to<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Whether the object `name` of kind `K` exists in `ns`.
async fn exists<K>(client: &Client, ns: &str, name: &str) -> bool
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
        .is_some()
}

/// Waits (as [`wait_for`]) until the named object exists.
async fn appears<K>(client: &Client, ns: &str, name: &str)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let what = format!("{} {name}", K::kind(&()));
    wait_for(&what, || async {
        exists::<K>(client, ns, name).await.then_some(())
    })
    .await
}

/// A fresh namespace `{base}-{unique}` (namespaces of earlier runs may still be terminating).
async fn namespace(client: &Client, base: &str) -> String {
    let api: Api<Namespace> = Api::all(client.clone());
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 1_000_000_000;
    let name = format!("{base}-{unique}");
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name }
    }))
    .unwrap();
    api.create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
    name
}

/// Deletes a test namespace. Pods are force-deleted until it is gone: no kubelet confirms
/// their end on fake nodes, which would leave the namespace terminating forever.
async fn drop_namespace(client: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), name);
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let api: Api<Namespace> = Api::all(client.clone());
    let _ = api.delete(name, &DeleteParams::default()).await;
    for _ in 0..60 {
        let _ = pods.delete_collection(&force, &ListParams::default()).await;
        if matches!(api.get_opt(name).await, Ok(None)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("namespace {name} is still terminating");
}

fn samples(dir: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(repo(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Admission: every sample is admitted and every invalid one (config/samples/invalid/, one
/// per rule: the held-out cases of issue 51, the Kubernetes formats of fields copied into
/// pods, the contract's grammars) is refused with server-side dry-run, 422, and a message
/// naming the field (its `# expect:` line). The manifests are sent as written (not through
/// the Rust types, which would refuse some of them before the apiserver sees them).
#[tokio::test]
async fn crds_accept_the_samples_and_refuse_the_invalid_ones_with_their_message() {
    let Some((client, ns)) = test_env("crds_accept_the_samples", "dspark-it-samples").await else {
        return;
    };
    let resource = ApiResource::erase::<DSparkDeployment>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    for (file, text) in samples("config/samples") {
        let obj: DynamicObject = serde_yaml::from_str(&text).unwrap();
        api.create(&dry, &obj)
            .await
            .unwrap_or_else(|e| panic!("sample {file} refused: {e}"));
    }
    let invalid = samples("config/samples/invalid");
    assert!(invalid.len() >= 38, "{} invalid samples", invalid.len());
    for (file, text) in invalid {
        let expect = dspark_operator::crd::yaml::expected_message(&text).unwrap();
        let obj: DynamicObject = serde_yaml::from_str(&text).unwrap();
        match api.create(&dry, &obj).await {
            Ok(_) => panic!("invalid sample {file} was accepted"),
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{file}: {e}");
                assert!(
                    e.message.contains(&expect),
                    "{file}: expected '{expect}' in '{}'",
                    e.message
                );
            }
            Err(e) => panic!("{file}: {e}"),
        }
    }
    drop_namespace(&client, &ns).await;
}

/// A sample DSparkDeployment from config/samples.
fn sample(file: &str) -> DSparkDeployment {
    serde_yaml::from_str(&std::fs::read_to_string(repo("config/samples").join(file)).unwrap())
        .unwrap()
}

/// The two-pool sample (Advisory mode), made to run here: a model URI instead of a PVC, no
/// drafter, metrics scraped from the pods instead of Prometheus.
fn two_pools() -> DSparkDeployment {
    let mut dsd = sample("dsparkdeployment-two-pools.yaml");
    // Weights on the node (no PVC to bind, no fetch to wait for: a remote source is profiled
    // only once a fetch resolved its revision, which needs a kubelet running init containers).
    dsd.spec.model.pvc = None;
    dsd.spec.model.host_path = Some(dspark_operator::crd::HostPathSource {
        path: "/var/lib/dspark/models/qwen3-8b".into(),
    });
    dsd.spec.model.allow_host_path = Some(true);
    dsd.spec.drafter = None;
    dsd.spec.autoscaling.metrics_source = Default::default();
    dsd.spec.autoscaling.prometheus_url = None;
    dsd
}

fn table_json(node_type: &str) -> String {
    format!(
        r#"{{"schema":1,"model_id":"smollm2","engine_version":"0.1.0","device":"NVIDIA A100","node_type":"{node_type}","dtype":"q4_1","measured_at":"2026-11-29T09:00:00Z","points":[[1,138.0],[2,74.0],[4,56.0],[8,37.5],[16,23.0]]}}"#
    )
}

/// Plays the kubelet for a profiling pod: marks its container terminated with `message`.
/// Waits for the deployment's first profiling Job and completes it with a cost table for
/// `node_type`, so that the pods carry --cost-table and the operator has a table to push.
async fn profile_first(client: &Client, ns: &str, node_type: &str) {
    let cts: Api<DSparkCostTable> = Api::namespaced(client.clone(), ns);
    let job = wait_for("a profiling Job", || {
        let cts = cts.clone();
        async move {
            cts.list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find_map(|c| c.status?.job)
        }
    })
    .await;
    finish_profiling_pod(client, ns, &job, &table_json(node_type)).await;
}

async fn finish_profiling_pod(client: &Client, ns: &str, job: &str, message: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = wait_for(&format!("pod of Job {job}"), || {
        let pods = pods.clone();
        async move {
            pods.list(&ListParams::default().labels(&format!("job-name={job}")))
                .await
                .ok()?
                .items
                .into_iter()
                .next()
        }
    })
    .await;
    let status = serde_json::json!({
        "status": {
            "phase": "Succeeded",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
            "containerStatuses": [{
                "name": "profile",
                "image": "dspark/engine:0.1.0",
                "imageID": "",
                "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": message,
                    "startedAt": "2026-11-29T09:00:00Z", "finishedAt": "2026-11-29T09:01:00Z"}}
            }]
        }
    });
    pods.patch_status(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .unwrap();
}

/// Runs the controller for namespace `ns` only, in the background.
fn run_controller(client: &Client, ns: &str) -> Running {
    run_controller_with(client, ns, Default::default())
}

/// [`run_controller`] reporting into `metrics` (give it a client from
/// `telemetry::counted_client` to count the API requests).
fn run_controller_with(
    client: &Client,
    ns: &str,
    metrics: std::sync::Arc<dspark_operator::telemetry::Metrics>,
) -> Running {
    let controller = controller(client, Some(ns));
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: Some("it".into()),
        },
    );
    let ctx = std::sync::Arc::new(Context::new(
        client.clone(),
        recorder,
        metrics.clone(),
        controller.store(),
        dspark_operator::reconcile::cache::Caches::start(client, Some(ns)),
    ));
    let task = tokio::spawn(
        controller
            .run(reconcile, error_policy, ctx)
            .for_each(|_| async {}),
    );
    Running { task, metrics }
}

/// A controller running in the test process, and its counters.
struct Running {
    task: tokio::task::JoinHandle<()>,
    metrics: std::sync::Arc<dspark_operator::telemetry::Metrics>,
}

impl Running {
    fn abort(&self) {
        self.task.abort();
    }

    /// Reconciles finished so far.
    fn finished(&self) -> u64 {
        self.metrics
            .reconciles
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until `n` more reconciles have finished (see [`reconciles_finish`]).
    async fn reconciles(&self, what: &str, n: u64) {
        self.reconciles_since(what, self.finished(), n).await
    }

    /// Waits until `n` reconciles have finished since [`Running::finished`] read `start`.
    async fn reconciles_since(&self, what: &str, start: u64, n: u64) {
        let c = || std::future::ready(Some(self.finished()));
        reconciles_finish(what, Some(start), n, c).await
    }
}

/// Waits until `n` reconciles finish after `start` (`None`: the count at this call); `count`
/// reads the operator's counter of finished reconciles (`None`: not readable yet). Reconciles are counted when they end
/// and kube-runtime never runs two of one object at once, so with one deployment `n = 2`
/// takes at least one whole reconcile that began after this call. Tests that show something
/// did NOT happen wait on this instead of sleeping: every such reconcile had its chance to
/// do it. The deployments under test reconcile every second (`autoscaling.periodSeconds: 1`).
async fn reconciles_finish<F, Fut>(what: &str, mut start: Option<u64>, n: u64, mut count: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<u64>>,
{
    let limit = Duration::from_secs(60);
    let deadline = Instant::now() + limit;
    loop {
        match (start, count().await) {
            (None, Some(c)) => start = Some(c),
            (Some(s), Some(c)) if c >= s + n => return,
            _ => {}
        }
        if Instant::now() >= deadline {
            panic!("timed out after {limit:?} waiting for {n} reconciles {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn scale_subresource_spreads_the_total_and_failed_profiling_backs_off() {
    let Some((client, ns)) = test_env("scale_subresource", "dspark-it-scale").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = two_pools();
    dsd.spec.scaling = Some(dspark_operator::crd::ScalingSpec {
        mode: Some(dspark_operator::crd::ScalingMode::External),
    });
    // A reconcile every second: each is a chance to start a Job too early.
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    // The /scale subresource sets the total; the policy spreads it over the pools.
    let scale = serde_json::json!({ "spec": { "replicas": 5 } });
    dsds.patch_scale("qwen3-8b", &PatchParams::default(), &Patch::Merge(&scale))
        .await
        .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for("5 replicas over both pools", || {
        let d = deployments.clone();
        async move {
            let h = d.get("qwen3-8b-h100").await.ok()?.spec.replicas?;
            let a = d.get("qwen3-8b-a100").await.ok()?.spec.replicas?;
            (h + a == 5 && h >= 1).then_some(())
        }
    })
    .await;
    let sc = dsds.get_scale("qwen3-8b").await.unwrap();
    assert_eq!(sc.spec.unwrap().replicas, Some(5));
    let selector = wait_for("the scale selector", || {
        let dsds = dsds.clone();
        async move { dsds.get_scale("qwen3-8b").await.ok()?.status?.selector }
    })
    .await;
    assert_eq!(selector, "serving.dspark.dev/deployment=qwen3-8b");

    // A profiling pod whose message is not a table: the cost table goes Failed with a retry
    // time, the condition says why, and no second Job starts before the retry time.
    let cts: Api<DSparkCostTable> = Api::namespaced(client.clone(), &ns);
    let ct = wait_for("a profiling Job", || {
        let cts = cts.clone();
        async move {
            cts.list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|c| {
                    c.spec.node_type == "h100-80gb"
                        && c.status.as_ref().and_then(|s| s.job.clone()).is_some()
                })
        }
    })
    .await;
    let job = ct.status.as_ref().unwrap().job.clone().unwrap();
    finish_profiling_pod(&client, &ns, &job, "{not a cost table").await;
    let failed = wait_for("the Failed phase", || {
        let cts = cts.clone();
        let name = ct.name_any();
        async move {
            let c = cts.get(&name).await.ok()?;
            (c.status.as_ref()?.phase == CostTablePhase::Failed).then_some(c)
        }
    })
    .await;
    let st = failed.status.unwrap();
    assert_eq!(st.failures, 1);
    assert!(st.retry_after.is_some());
    assert!(st.message.unwrap().contains("not valid JSON"));
    wait_for("the ProfilingFailed condition", || {
        let dsds = dsds.clone();
        async move {
            let d = dsds.get("qwen3-8b").await.ok()?;
            d.status?
                .conditions
                .iter()
                .any(|c| c.type_ == "Profiled" && c.reason == "ProfilingFailed")
                .then_some(())
        }
    })
    .await;
    handle.reconciles("after the profiling failure", 3).await;
    let jobs = Api::<Job>::namespaced(client.clone(), &ns)
        .list(
            &ListParams::default()
                .labels(&format!("serving.dspark.dev/cost-table={}", ct.name_any())),
        )
        .await
        .unwrap();
    assert_eq!(
        jobs.items.len(),
        1,
        "a second Job started before the retry time"
    );
    handle.abort();
    drop_namespace(&client, &ns).await;
}

#[tokio::test]
async fn reconcile_creates_the_pool_objects_profiles_and_garbage_collects() {
    let Some((client, ns)) =
        test_env("reconcile_creates_the_pool_objects", "dspark-it-reconcile").await
    else {
        return;
    };

    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);

    let dsd = sample("dsparkdeployment-smollm2.yaml");
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let dep = wait_for("engine Deployment", || {
        let d = deployments.clone();
        async move { d.get_opt("smollm2-a100").await.ok().flatten() }
    })
    .await;
    let pod = dep.spec.template.spec.unwrap();
    let c = &pod.containers[0];
    assert_eq!(
        c.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"].0,
        "1"
    );
    assert_eq!(
        pod.node_selector.unwrap()["dspark.dev/node-type"],
        "a100-80gb"
    );
    assert!(!c
        .args
        .as_ref()
        .unwrap()
        .contains(&"--cost-table".to_string()));
    let owners = dep.metadata.owner_references.unwrap();
    assert_eq!(owners[0].kind, "DSparkDeployment");

    // The pool's other objects are applied after its Deployment, within the same reconcile:
    // on a busy machine the test may look between two applies, so each is waited for.
    appears::<Service>(&client, &ns, "smollm2-a100").await;
    appears::<Service>(&client, &ns, "smollm2").await;
    appears::<PodDisruptionBudget>(&client, &ns, "smollm2-a100").await;
    appears::<ConfigMap>(&client, &ns, "smollm2-a100-cost-table").await;
    appears::<Secret>(&client, &ns, "smollm2-admin-token").await;

    // The profiling Job: pinned to the node type; its table lands in the cost table, the
    // ConfigMap and the Deployment's args.
    let cts: Api<DSparkCostTable> = Api::namespaced(client.clone(), &ns);
    let ct = wait_for("cost table with a Job", || {
        let cts = cts.clone();
        async move {
            cts.list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|c| c.status.as_ref().and_then(|s| s.job.clone()).is_some())
        }
    })
    .await;
    let job_name = ct.status.as_ref().unwrap().job.clone().unwrap();
    let job = Api::<Job>::namespaced(client.clone(), &ns)
        .get(&job_name)
        .await
        .unwrap();
    let jpod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        jpod.node_selector.unwrap()["dspark.dev/node-type"],
        "a100-80gb"
    );
    finish_profiling_pod(&client, &ns, &job_name, &table_json("a100-80gb")).await;
    let ct = wait_for("stored cost table", || {
        let cts = cts.clone();
        let name = ct.name_any();
        async move {
            let c = cts.get(&name).await.ok()?;
            (c.status.as_ref()?.phase == CostTablePhase::Ready).then_some(c)
        }
    })
    .await;
    assert_eq!(ct.status.as_ref().unwrap().revision, 1);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    wait_for("ConfigMap with the table", || {
        let cms = cms.clone();
        async move {
            let cm = cms.get("smollm2-a100-cost-table").await.ok()?;
            cm.data?.get("cost-table.json").map(|_| ())
        }
    })
    .await;
    wait_for("--cost-table in the engine args", || {
        let d = deployments.clone();
        async move {
            let dep = d.get("smollm2-a100").await.ok()?;
            let args = dep.spec.template.spec?.containers[0].args.clone()?;
            args.contains(&"--cost-table".to_string()).then_some(())
        }
    })
    .await;
    let status = wait_for("status with conditions", || {
        let dsds = dsds.clone();
        async move {
            let d = dsds.get("smollm2").await.ok()?;
            let s = d.status?;
            s.conditions
                .iter()
                .any(|c| c.type_ == "Profiled" && c.status == "True")
                .then_some(s)
        }
    })
    .await;
    assert_eq!(
        status.selector.as_deref(),
        Some("serving.dspark.dev/deployment=smollm2")
    );
    assert_eq!(status.pools[0].cost_table_revision, Some(1));

    // Deleting the DSparkDeployment garbage-collects what it owns.
    dsds.delete("smollm2", &DeleteParams::background())
        .await
        .unwrap();
    wait_for("garbage collection of the engine Deployment", || {
        let d = deployments.clone();
        async move {
            d.get_opt("smollm2-a100")
                .await
                .ok()?
                .is_none()
                .then_some(())
        }
    })
    .await;
    wait_for("garbage collection of the cost table", || {
        let cts = cts.clone();
        let name = ct.name_any();
        async move { cts.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    handle.abort();
    drop_namespace(&client, &ns).await;
}
/// A fake engine on a loopback address: `/metrics` on 8000 reports a slow ITL (all inter-token
/// gaps in (50, 100] ms, counters growing per scrape); the admin API on 8001 records pushes.
struct FakeEngine {
    pushes: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
    /// `/metrics` requests served.
    scrapes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn fake_engine(ip: &str) -> FakeEngine {
    fake_engine_with_itl(ip, true).await
}

/// [`fake_engine`]; `slow: false` puts every inter-token gap in (0, 10] ms instead.
async fn fake_engine_with_itl(ip: &str, slow: bool) -> FakeEngine {
    use axum::routing::{get, put};
    use std::sync::atomic::{AtomicU64, Ordering};
    let scrapes = std::sync::Arc::new(AtomicU64::new(0));
    let counted = scrapes.clone();
    let metrics = axum::Router::new().route(
        "/metrics",
        get(move || {
            let n = counted.fetch_add(1, Ordering::Relaxed) + 1;
            async move {
                let (tokens, requests) = (100 * n, 10 * n);
                let fast = if slow { 0 } else { tokens };
                format!(
                    "dspark_inter_token_latency_seconds_bucket{{le=\"0.01\"}} {fast}\n\
                     dspark_inter_token_latency_seconds_bucket{{le=\"0.05\"}} {fast}\n\
                     dspark_inter_token_latency_seconds_bucket{{le=\"0.1\"}} {tokens}\n\
                     dspark_inter_token_latency_seconds_bucket{{le=\"+Inf\"}} {tokens}\n\
                     dspark_inter_token_latency_seconds_count {tokens}\n\
                     dspark_time_to_first_token_seconds_bucket{{le=\"0.1\"}} {requests}\n\
                     dspark_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {requests}\n\
                     dspark_time_to_first_token_seconds_count {requests}\n\
                     dspark_e2e_request_latency_seconds_bucket{{le=\"+Inf\"}} {requests}\n\
                     dspark_e2e_request_latency_seconds_count {requests}\n\
                     dspark_num_requests_running 4\n\
                     dspark_num_requests_waiting 0\n"
                )
            }
        }),
    );
    let pushes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = pushes.clone();
    let admin = axum::Router::new()
        .route(
            "/admin/v1/state",
            get(|| async { (axum::http::StatusCode::SERVICE_UNAVAILABLE, "starting") }),
        )
        .route(
            "/admin/v1/cost-table",
            put(move |headers: axum::http::HeaderMap, body: String| {
                let seen = seen.clone();
                async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    seen.lock().unwrap().push((auth, body));
                    r#"{"revision":1,"digest":"d"}"#
                }
            }),
        );
    let mut tasks = Vec::new();
    for (port, app) in [(8000, metrics), (8001, admin)] {
        let listener = tokio::net::TcpListener::bind((ip, port)).await.unwrap();
        tasks.push(tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        }));
    }
    FakeEngine {
        pushes,
        scrapes,
        tasks,
    }
}

/// Plays the kubelet for an engine pod: Running and Ready at `ip`.
async fn make_ready(client: &Client, ns: &str, pod: &str, ip: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let status = serde_json::json!({
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"}
            ],
            "containerStatuses": [{
                "name": "engine", "image": "dspark/engine:0.1.0", "imageID": "",
                "ready": true, "restartCount": 0, "started": true,
                "state": {"running": {"startedAt": "2026-11-29T09:00:00Z"}}
            }]
        }
    });
    pods.patch_status(pod, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// The first engine pod of `pool` that `f` accepts.
async fn engine_pod(pods: &Api<Pod>, pool: &str, f: impl Fn(&Pod) -> bool) -> Pod {
    let labels = format!("serving.dspark.dev/pool={pool}");
    wait_for(&format!("an engine pod of pool {pool}"), || {
        let (pods, labels, f) = (pods.clone(), labels.clone(), &f);
        async move {
            pods.list(&ListParams::default().labels(&labels))
                .await
                .ok()?
                .items
                .into_iter()
                .find(|p| f(p))
        }
    })
    .await
}

#[tokio::test]
async fn ready_pods_get_the_table_pushed_and_a_breach_scales_the_pool_up() {
    let Some((client, ns)) =
        test_env("ready_pods_get_the_table_pushed", "dspark-it-autoscale").await
    else {
        return;
    };
    let ip = "127.1.77.1";
    let engine = fake_engine(ip).await;
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.slo.window_seconds = 4;
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    // Profile first, so that the pods carry --cost-table and the operator has a table to push.
    profile_first(&client, &ns, "a100-80gb").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = engine_pod(&pods, "a100", |p| {
        p.spec.as_ref().is_some_and(|s| {
            s.containers[0]
                .args
                .as_ref()
                .is_some_and(|a| a.contains(&"--cost-table".to_string()))
        })
    })
    .await;
    make_ready(&client, &ns, &pod.name_any(), ip).await;

    // The table is pushed with the admin token from the Secret.
    let (auth, body) = wait_for("a cost-table push", || {
        let pushes = engine.pushes.clone();
        async move { pushes.lock().unwrap().first().cloned() }
    })
    .await;
    let secret = Api::<Secret>::namespaced(client.clone(), &ns)
        .get("smollm2-admin-token")
        .await
        .unwrap();
    let token = String::from_utf8(secret.data.unwrap()["token"].0.clone()).unwrap();
    assert_eq!(auth, format!("Bearer {token}"));
    let pushed = dspark_types::CostTable::from_json(&body).unwrap();
    assert_eq!(pushed.node_type.as_deref(), Some("a100-80gb"));

    // p95 ITL ~97 ms against a 50 ms SLO: the pool grows, the status says why.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for("a scale-up", || {
        let d = deployments.clone();
        async move { (d.get("smollm2-a100").await.ok()?.spec.replicas? >= 2).then_some(()) }
    })
    .await;
    let status = wait_for("status with the breach", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("smollm2").await.ok()?.status?;
            (s.slo_status.as_deref() == Some("Breached") && s.last_scaling_decision.is_some())
                .then_some(s)
        }
    })
    .await;
    let decision = status.last_scaling_decision.unwrap();
    assert!(decision.applied);
    assert!(decision.to_replicas > decision.from_replicas);
    assert!(status.pools[0].itl_p95_ms.unwrap() > 50.0);
    assert!(status
        .conditions
        .iter()
        .any(|c| c.type_ == "MetricsAvailable" && c.status == "True"));
    handle.abort();
    for t in engine.tasks {
        t.abort();
    }
    drop_namespace(&client, &ns).await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One `dspark-operator` process (the real binary) watching namespace `ns`, its /metrics on a
/// free loopback port and its log in the temp directory; killed (SIGKILL) when dropped.
struct Operator {
    child: std::process::Child,
    port: u16,
}

impl Operator {
    fn spawn(ns: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("dspark-it-operator-{ns}-{port}.log"));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_dspark-operator"))
            .args(["--namespace", ns, "--http", &format!("127.0.0.1:{port}")])
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the operator's log file"))
            .spawn()
            .expect("the operator binary starts");
        Self { child, port }
    }

    /// SIGKILL: no graceful shutdown, the Lease is not released.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The value of an unlabelled series on the process's /metrics (`None`: no answer).
    async fn metric(&self, name: &str) -> Option<f64> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let io = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .ok()?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).await.ok()?;
            Some(text)
        };
        let text = tokio::time::timeout(Duration::from_secs(2), io)
            .await
            .ok()??;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Stops the collector when the test ends, pass or fail.
struct OtlpStack {
    otel_dir: std::path::PathBuf,
}

impl Drop for OtlpStack {
    fn drop(&mut self) {
        let _ = std::process::Command::new(repo("tests/otel/otelcol.sh"))
            .arg("down")
            .env("DSPARK_OTEL_DIR", &self.otel_dir)
            .status();
    }
}

/// The `dspark-operator` binary with OTLP on, against the real apiserver and the real
/// collector (tests/otel): every reconcile is a `reconcile` span naming the deployment, each
/// autoscaling evaluation an `autoscale decision` child span with its inputs and reason,
/// and the operator's counters and pool gauges arrive as OTLP metrics.
#[tokio::test]
async fn operator_exports_reconcile_and_autoscale_spans_over_otlp() {
    let Some((client, ns)) = test_env("operator_otlp", "dspark-it-otlp").await else {
        return;
    };
    let otel_dir = std::env::temp_dir().join(format!("dspark-it-otel-{}", std::process::id()));
    let http_port = free_port();
    let env = [
        ("DSPARK_OTEL_DIR", otel_dir.display().to_string()),
        ("DSPARK_OTEL_GRPC_PORT", free_port().to_string()),
        ("DSPARK_OTEL_HTTP_PORT", http_port.to_string()),
        ("DSPARK_OTEL_METRICS_PORT", free_port().to_string()),
    ];
    let up = std::process::Command::new(repo("tests/otel/otelcol.sh"))
        .args(["up", "--test"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .status()
        .expect("tests/otel/otelcol.sh runs");
    assert!(up.success(), "the collector did not start");
    let debug_log = otel_dir.join("debug-exporter.log");
    let _stack = OtlpStack { otel_dir };
    let _operator = Operator::spawn(
        &ns,
        &["--no-leader-election"],
        &[
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://127.0.0.1:{http_port}"),
            ),
            ("OTEL_SERVICE_NAME", "dspark-operator-it".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "500".into()),
        ],
    );

    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let mut dsd = two_pools();
    // A total fixed from outside: the policy runs (and decides) on every reconcile.
    dsd.spec.replicas = Some(3);
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    let key = format!("{ns}/qwen3-8b");
    let text = wait_for("reconcile + autoscale spans and operator metrics", || {
        let path = debug_log.clone();
        let key = key.clone();
        async move {
            let t = std::fs::read_to_string(&path).ok()?;
            (t.contains(&format!("deployment: Str({key})"))
                && t.contains("Name           : autoscale decision")
                && t.contains("Name: dspark.operator.reconciles")
                && t.contains("Name: dspark.operator.pool.desired_replicas"))
            .then_some(t)
        }
    })
    .await;
    // Span blocks: name, id, parent.
    let spans: Vec<(String, String, String, String)> = text
        .split("\nSpan #")
        .skip(1)
        .map(|b| {
            let field = |f: &str| {
                b.lines()
                    .find_map(|l| l.trim_start().strip_prefix(f))
                    .map(|v| v.trim_start_matches([' ', ':']).trim().to_string())
                    .unwrap_or_default()
            };
            (
                field("Name "),
                field("ID "),
                field("Parent ID "),
                b.to_string(),
            )
        })
        .collect();
    let reconciles: Vec<&String> = spans
        .iter()
        .filter(|s| s.0 == "reconcile" && s.3.contains(&format!("deployment: Str({key})")))
        .map(|s| &s.1)
        .collect();
    assert!(!reconciles.is_empty(), "no reconcile span for {key}");
    let decision = spans
        .iter()
        .find(|s| s.0 == "autoscale decision")
        .expect("an autoscale decision span");
    assert!(
        reconciles.contains(&&decision.2),
        "autoscale decision is not a child of a reconcile span: {}",
        decision.3
    );
    for attr in [
        "pool: Str(",
        "reason_code: Str(",
        "from: Int(",
        "to: Int(",
        "slo_ttft_p95_s: Double(",
    ] {
        assert!(decision.3.contains(attr), "{attr} missing: {}", decision.3);
    }
    assert!(
        spans
            .iter()
            .any(|s| s.0 == "autoscale decision"
                && s.3.contains("reason_code: Str(ExternalReplicas)")),
        "no decision spread spec.replicas"
    );
    assert!(text.contains("service.name: Str(dspark-operator-it)"));
    drop_namespace(&client, &ns).await;
}

/// Who leads now: the Lease's holder, and each replica's `dspark_operator_leader` gauge.
async fn leadership(
    leases: &Api<Lease>,
    lease: &str,
    replicas: &[Operator],
) -> (Option<String>, Vec<Option<f64>>) {
    let holder = leases
        .get_opt(lease)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity);
    let mut gauges = Vec::new();
    for r in replicas {
        gauges.push(r.metric("dspark_operator_leader").await);
    }
    (holder, gauges)
}

/// The one leader among `replicas` (named by `ids`), when the Lease and every gauge agree.
fn sole_leader(
    ids: &[&str],
    (holder, gauges): &(Option<String>, Vec<Option<f64>>),
) -> Option<usize> {
    let leaders: Vec<usize> = (0..ids.len()).filter(|&i| gauges[i] == Some(1.0)).collect();
    let followers = gauges.iter().filter(|g| **g == Some(0.0)).count();
    match leaders[..] {
        [i] if followers == ids.len() - 1 && holder.as_deref() == Some(ids[i]) => Some(i),
        _ => None,
    }
}

/// Two operator binaries on one Lease: at every sample exactly one is leader (by the Lease
/// and by its own gauge), only that one reconciles; SIGKILL it and the other takes over within
/// two lease durations and rolls a spec change through.
#[tokio::test]
async fn two_operator_replicas_never_both_act_and_the_follower_takes_over() {
    let Some((client, ns)) = test_env("leader_election", "dspark-it-leader").await else {
        return;
    };
    let lease = format!("{ns}-leader");
    let ids = ["a", "b"];
    let lease_seconds = 6;
    let mut replicas: Vec<Operator> = ids
        .iter()
        .map(|id| {
            Operator::spawn(
                &ns,
                &[
                    "--lease-namespace",
                    &ns,
                    "--lease-name",
                    &lease,
                    "--lease-seconds",
                    &lease_seconds.to_string(),
                    "--identity",
                    id,
                ],
                &[],
            )
        })
        .collect();
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let leader = wait_for("one leader", || {
        let (leases, lease, replicas) = (&leases, &lease, &replicas);
        async move { sole_leader(&ids, &leadership(leases, lease, replicas).await) }
    })
    .await;
    let follower = 1 - leader;

    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    dsds.create(
        &PostParams::default(),
        &sample("dsparkdeployment-smollm2.yaml"),
    )
    .await
    .unwrap();
    for _ in 0..20 {
        let seen = leadership(&leases, &lease, &replicas).await;
        assert_eq!(
            sole_leader(&ids, &seen),
            Some(leader),
            "not one leader: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for("the engine Deployment", || {
        let d = deployments.clone();
        async move { d.get_opt("smollm2-a100").await.ok().flatten() }
    })
    .await;
    const RECONCILES: &str = "dspark_operator_reconciles_total";
    assert!(replicas[leader].metric(RECONCILES).await.unwrap() >= 1.0);
    assert_eq!(
        replicas[follower].metric(RECONCILES).await,
        Some(0.0),
        "the follower reconciled"
    );

    // The leader dies without releasing the Lease: the follower takes over once it expires.
    replicas[leader].kill();
    let killed = Instant::now();
    wait_for("the follower to take over", || {
        let (leases, lease, r) = (&leases, &lease, &replicas[follower]);
        async move {
            let (holder, gauges) = leadership(leases, lease, std::slice::from_ref(r)).await;
            (holder.as_deref() == Some(ids[follower]) && gauges[0] == Some(1.0)).then_some(())
        }
    })
    .await;
    let took = killed.elapsed();
    assert!(
        took <= Duration::from_secs(2 * lease_seconds + 1),
        "takeover took {took:?}"
    );
    let transitions = leases
        .get(&lease)
        .await
        .unwrap()
        .spec
        .unwrap()
        .lease_transitions;
    assert!(transitions >= Some(1), "leaseTransitions {transitions:?}");

    // The new leader reconciles: a spec change rolls through.
    let patch = serde_json::json!({ "spec": { "engine": { "image": "dspark/engine:0.1.1" } } });
    dsds.patch("smollm2", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    wait_for("the new image in the engine Deployment", || {
        let d = deployments.clone();
        async move {
            let dep = d.get("smollm2-a100").await.ok()?;
            let image = dep.spec.template.spec?.containers[0].image.clone()?;
            (image == "dspark/engine:0.1.1").then_some(())
        }
    })
    .await;
    assert!(replicas[follower].metric(RECONCILES).await.unwrap() >= 1.0);
    eprintln!("leader election: takeover after {took:?}");
    drop(replicas);
    drop_namespace(&client, &ns).await;
}

/// Names of the objects of kind `K` in `ns` managed by the operator, each checked to be owned
/// by the DSparkDeployment with `uid`.
async fn managed<K>(client: &Client, ns: &str, owner_uid: &str) -> Vec<String>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let list = Api::<K>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGER}")))
        .await
        .unwrap();
    let mut names: Vec<String> = list
        .items
        .iter()
        .map(|o| {
            let owned = o
                .owner_references()
                .iter()
                .any(|r| r.uid == owner_uid && r.controller == Some(true));
            assert!(
                owned,
                "{} is not owned by the DSparkDeployment",
                o.name_any()
            );
            o.name_any()
        })
        .collect();
    names.sort();
    names
}

/// The operator binary is SIGKILLed as soon as the first engine Deployment of a two-pool
/// DSparkDeployment exists; a fresh one converges to exactly the expected objects (one of each
/// per pool, one profiling Job per node type, nothing twice) and observes the generation.
#[tokio::test]
async fn an_operator_restarted_mid_reconcile_converges_without_duplicates() {
    let Some((client, ns)) = test_env("restart_mid_reconcile", "dspark-it-restart").await else {
        return;
    };
    let mut first = Operator::spawn(&ns, &["--no-leader-election"], &[]);
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let mut dsd = two_pools();
    // A reconcile every second: each is a chance to create a duplicate.
    dsd.spec.autoscaling.period_seconds = 1;
    let dsd = dsds.create(&PostParams::default(), &dsd).await.unwrap();
    let uid = dsd.uid().unwrap();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let by_dsd = ListParams::default().labels("serving.dspark.dev/deployment=qwen3-8b");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = deployments
            .list_metadata(&by_dsd)
            .await
            .unwrap()
            .items
            .len();
        if found > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no engine Deployment within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill();
    let at_kill = (
        managed::<Deployment>(&client, &ns, &uid).await,
        managed::<Service>(&client, &ns, &uid).await,
        dsds.get("qwen3-8b").await.unwrap().status.is_some(),
    );
    eprintln!("killed with (Deployments, Services, status written) = {at_kill:?}");
    let second = Operator::spawn(&ns, &["--no-leader-election"], &[]);

    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    wait_for("the status to observe the generation", || {
        let (dsds, pdbs, by_dsd) = (dsds.clone(), pdbs.clone(), by_dsd.clone());
        async move {
            let d = dsds.get("qwen3-8b").await.ok()?;
            let s = d.status?;
            let pdbs = pdbs.list_metadata(&by_dsd).await.ok()?.items.len();
            (s.observed_generation == d.metadata.generation && s.pools.len() == 2 && pdbs == 2)
                .then_some(())
        }
    })
    .await;
    // Reconciles after converging: a chance for a duplicate to show up, were one coming.
    reconciles_finish(
        "of the restarted operator after converging",
        None,
        3,
        || async {
            second
                .metric("dspark_operator_reconciles_total")
                .await
                .map(|v| v as u64)
        },
    )
    .await;
    let pools = ["qwen3-8b-a100", "qwen3-8b-h100"];
    assert_eq!(managed::<Deployment>(&client, &ns, &uid).await, pools);
    assert_eq!(
        managed::<PodDisruptionBudget>(&client, &ns, &uid).await,
        pools
    );
    assert_eq!(
        managed::<Service>(&client, &ns, &uid).await,
        ["qwen3-8b", "qwen3-8b-a100", "qwen3-8b-h100"]
    );
    assert_eq!(
        managed::<ConfigMap>(&client, &ns, &uid).await,
        ["qwen3-8b-a100-cost-table", "qwen3-8b-h100-cost-table"]
    );
    assert_eq!(
        managed::<Secret>(&client, &ns, &uid).await,
        ["qwen3-8b-admin-token"]
    );

    // One cost table per node type, each with exactly one profiling Job (the one it names).
    let cts = Api::<DSparkCostTable>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let mut node_types: Vec<&str> = cts.iter().map(|c| c.spec.node_type.as_str()).collect();
    node_types.sort();
    assert_eq!(node_types, ["a100-80gb", "h100-80gb"]);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let all_jobs = jobs.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(
        all_jobs.items.len(),
        2,
        "profiling Jobs: {:?}",
        all_jobs.items
    );
    for ct in &cts {
        assert!(ct.owner_references().iter().any(|r| r.uid == uid));
        let of_ct = jobs
            .list_metadata(
                &ListParams::default()
                    .labels(&format!("serving.dspark.dev/cost-table={}", ct.name_any())),
            )
            .await
            .unwrap();
        let names: Vec<String> = of_ct.items.iter().map(|j| j.name_any()).collect();
        let named = ct.status.as_ref().and_then(|s| s.job.clone());
        assert_eq!(names.len(), 1, "Jobs of {}: {names:?}", ct.spec.node_type);
        assert_eq!(Some(names[0].clone()), named);
    }
    let d = dsds.get("qwen3-8b").await.unwrap();
    assert_eq!(d.status.unwrap().observed_generation, d.metadata.generation);
    drop_namespace(&client, &ns).await;
}

/// Advisory mode: an ITL breach makes the policy advise a scale-up, which is recorded in
/// status.lastScalingDecision (applied: false) and announced by a `ScalingAdvised` Event, while
/// the pool's Deployment keeps its replicas.
#[tokio::test]
async fn advisory_mode_records_the_decision_and_changes_nothing() {
    let Some((client, ns)) = test_env("advisory_mode", "dspark-it-advisory").await else {
        return;
    };
    let ip = "127.1.77.3";
    let engine = fake_engine(ip).await;
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.slo.window_seconds = 4;
    dsd.spec.autoscaling.period_seconds = 1;
    dsd.spec.autoscaling.mode = AutoscalingMode::Advisory;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = engine_pod(&pods, "a100", |_| true).await;
    make_ready(&client, &ns, &pod.name_any(), ip).await;

    // p95 ITL ~97 ms against a 50 ms SLO: 1 -> 2 advised, not applied.
    let status = wait_for("the advised decision in the status", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("smollm2").await.ok()?.status?;
            s.last_scaling_decision.is_some().then_some(s)
        }
    })
    .await;
    let decision = status.last_scaling_decision.unwrap();
    assert_eq!(decision.pool, "a100");
    assert!(!decision.applied, "{decision:?}");
    assert_eq!((decision.from_replicas, decision.to_replicas), (1, 2));
    assert!(decision.reason.contains("ITL"), "{}", decision.reason);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let event = wait_for("a ScalingAdvised Event", || {
        let events = events.clone();
        async move {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some("ScalingAdvised")
                        && e.involved_object.name.as_deref() == Some("smollm2")
                })
        }
    })
    .await;
    assert!(event.message.unwrap_or_default().contains("1 -> 2"));

    // Several more evaluations: the breach goes on, the Deployment stays at one replica.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for _ in 0..4 {
        let dep = deployments.get("smollm2-a100").await.unwrap();
        assert_eq!(dep.spec.replicas, Some(1), "advisory mode scaled");
        handle.reconciles("of the advisory evaluation", 2).await;
    }
    let s = dsds.get("smollm2").await.unwrap().status.unwrap();
    assert_eq!(s.slo_status.as_deref(), Some("Breached"));
    assert!(!s.last_scaling_decision.unwrap().applied);
    handle.abort();
    for t in engine.tasks {
        t.abort();
    }
    drop_namespace(&client, &ns).await;
}

/// The operator-made objects of each pool-level kind in `ns` (Deployments, Services,
/// PodDisruptionBudgets, ConfigMaps), each checked to be owned by the deployment with `uid`.
async fn pool_objects(client: &Client, ns: &str, uid: &str) -> [Vec<String>; 4] {
    [
        managed::<Deployment>(client, ns, uid).await,
        managed::<Service>(client, ns, uid).await,
        managed::<PodDisruptionBudget>(client, ns, uid).await,
        managed::<ConfigMap>(client, ns, uid).await,
    ]
}

fn expected_pool_objects(dsd: &str, pools: &[&str]) -> [Vec<String>; 4] {
    let names = |suffix: &str| -> Vec<String> {
        pools.iter().map(|p| format!("{dsd}-{p}{suffix}")).collect()
    };
    let mut services = names("");
    services.push(dsd.to_string());
    services.sort();
    [names(""), services, names(""), names("-cost-table")]
}

/// Renaming a pool (a100 -> l4) deletes the old pool's Deployment, Service,
/// PodDisruptionBudget and ConfigMap in the reconcile that sees the change (they are gone when
/// its status observes the new generation) and creates the new pool's; the other pool's
/// objects and the deployment Service stay, and so does an object that carries the
/// deployment's labels but not its owner reference.
#[tokio::test]
async fn renaming_a_pool_prunes_the_old_pools_objects() {
    let Some((client, ns)) = test_env("renaming_a_pool_prunes", "dspark-it-prune").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let stray: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "qwen3-8b-a100-notes",
            "labels": {
                "serving.dspark.dev/deployment": "qwen3-8b",
                "serving.dspark.dev/pool": "a100",
            },
        },
        "data": {"who": "not the operator"},
    }))
    .unwrap();
    cms.create(&PostParams::default(), &stray).await.unwrap();
    let handle = run_controller(&client, &ns);
    let dsd = dsds
        .create(&PostParams::default(), &two_pools())
        .await
        .unwrap();
    let uid = dsd.uid().unwrap();
    let before = expected_pool_objects("qwen3-8b", &["a100", "h100"]);
    wait_for("both pools' objects", || {
        let (client, ns, uid, before) = (client.clone(), ns.clone(), uid.clone(), &before);
        async move { (pool_objects(&client, &ns, &uid).await == *before).then_some(()) }
    })
    .await;

    let mut pools = dsd.spec.pools.clone();
    assert_eq!(pools[1].name, "a100");
    pools[1].name = "l4".into();
    let patched = dsds
        .patch(
            "qwen3-8b",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "pools": pools } })),
        )
        .await
        .unwrap();
    let generation = patched.metadata.generation;
    // At least that generation: the reconcile that sees the rename may write spec.replicas
    // (the pools' new total), a newer generation the next reconcile observes, possibly
    // between two polls.
    wait_for("the status to observe the rename", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("qwen3-8b").await.ok()?.status?;
            (s.observed_generation >= generation).then_some(())
        }
    })
    .await;
    assert_eq!(
        pool_objects(&client, &ns, &uid).await,
        expected_pool_objects("qwen3-8b", &["h100", "l4"]),
        "the reconcile that saw the rename left the old pool's objects (or lacks the new pool's)"
    );
    let now = dsds.get("qwen3-8b").await.unwrap();
    eprintln!(
        "rename at generation {generation:?}; now {:?}",
        now.metadata.generation
    );
    let s = now.status.unwrap();
    let names: Vec<&str> = s.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["h100", "l4"]);
    assert!(
        cms.get_opt("qwen3-8b-a100-notes").await.unwrap().is_some(),
        "a ConfigMap the deployment does not own was pruned"
    );

    // Removing a pool outright prunes it the same way.
    let patched = dsds
        .patch(
            "qwen3-8b",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "pools": [pools[0]] } })),
        )
        .await
        .unwrap();
    let generation = patched.metadata.generation;
    wait_for("the status to observe the removal", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("qwen3-8b").await.ok()?.status?;
            (s.observed_generation >= generation).then_some(())
        }
    })
    .await;
    assert_eq!(
        pool_objects(&client, &ns, &uid).await,
        expected_pool_objects("qwen3-8b", &["h100"])
    );
    handle.abort();
    drop_namespace(&client, &ns).await;
}

fn owner_uids(o: &impl ResourceExt) -> Vec<String> {
    let mut uids: Vec<String> = o.owner_references().iter().map(|r| r.uid.clone()).collect();
    uids.sort();
    uids
}

/// Two deployments share a cost table (same model, engine version and node type) and its
/// profiling Job. When one moves to a new engine version, only its owner reference leaves
/// the old table, which lives on for the other; when the other follows, nothing references
/// the old table any more: it is deleted, and its profiling Job with it.
#[tokio::test]
async fn a_new_engine_version_releases_the_old_cost_table_and_its_profiling_job() {
    let Some((client, ns)) = test_env("stale_cost_tables", "dspark-it-stale").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let cts: Api<DSparkCostTable> = Api::namespaced(client.clone(), &ns);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut a = sample("dsparkdeployment-smollm2.yaml");
    // A reconcile every second: each is a chance to release the old table too early.
    a.spec.autoscaling.period_seconds = 1;
    let mut b = a.clone();
    b.metadata.name = Some("smollm2-b".into());
    let a_uid = dsds
        .create(&PostParams::default(), &a)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let b_uid = dsds
        .create(&PostParams::default(), &b)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let mut both = vec![a_uid.clone(), b_uid.clone()];
    both.sort();

    let old = wait_for("one cost table owned by both, with a profiling Job", || {
        let (cts, both) = (cts.clone(), both.clone());
        async move {
            let list = cts.list(&ListParams::default()).await.ok()?.items;
            (list.len() == 1).then_some(())?;
            let c = list.into_iter().next()?;
            (owner_uids(&c) == both && c.status.as_ref()?.job.is_some()).then_some(c)
        }
    })
    .await;
    let old_name = old.name_any();
    let old_job = old.status.unwrap().job.unwrap();
    assert!(jobs.get_opt(&old_job).await.unwrap().is_some());

    let bump = |name: &'static str| {
        let dsds = dsds.clone();
        async move {
            dsds.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "engine": { "version": "0.2.0" } } })),
            )
            .await
            .unwrap();
        }
    };
    bump("smollm2").await;
    wait_for("the old table to be owned by smollm2-b only", || {
        let (cts, name, b_uid) = (cts.clone(), old_name.clone(), b_uid.clone());
        async move {
            let c = cts.get_opt(&name).await.ok()??;
            (owner_uids(&c) == [b_uid]).then_some(())
        }
    })
    .await;
    let new = wait_for("a table of engine 0.2.0 owned by smollm2", || {
        let (cts, a_uid) = (cts.clone(), a_uid.clone());
        async move {
            cts.list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|c| c.spec.engine_version == "0.2.0" && owner_uids(c).contains(&a_uid))
        }
    })
    .await;
    assert_ne!(new.name_any(), old_name);
    // Still in use by smollm2-b: the old table and its Job stay, reconciles later (two
    // deployments: five finished reconciles hold at least two whole ones after this point).
    handle.reconciles("with the new table", 5).await;
    assert!(cts.get_opt(&old_name).await.unwrap().is_some());
    assert!(jobs.get_opt(&old_job).await.unwrap().is_some());

    bump("smollm2-b").await;
    wait_for("the old table to be deleted", || {
        let (cts, name) = (cts.clone(), old_name.clone());
        async move { cts.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    wait_for("the old profiling Job to be collected", || {
        let (jobs, name) = (jobs.clone(), old_job.clone());
        async move { jobs.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    wait_for("the new table to be owned by both", || {
        let (cts, name, both) = (cts.clone(), new.name_any(), both.clone());
        async move {
            let c = cts.get_opt(&name).await.ok()??;
            (owner_uids(&c) == both).then_some(())
        }
    })
    .await;
    handle.abort();
    drop_namespace(&client, &ns).await;
}

const DENIED: &str = "no Services in this namespace (dspark test policy)";

/// A ValidatingAdmissionPolicy (and its binding) refusing every Service in namespace `ns`.
async fn deny_services(client: &Client, ns: &str) -> String {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let name = format!("{ns}-no-services");
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["services"],
            }]},
            "validations": [{"expression": "false", "message": DENIED}],
        },
    }))
    .unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": ns,
            }}},
        },
    }))
    .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    // In force once the apiserver has loaded it: a dry-run Service is refused.
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let probe: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "probe"},
        "spec": {"ports": [{"port": 80}]},
    }))
    .unwrap();
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait_for("the policy to refuse Services", || {
        let (services, probe, dry) = (services.clone(), probe.clone(), dry.clone());
        async move {
            match services.create(&dry, &probe).await {
                Err(kube::Error::Api(e)) if e.message.contains(DENIED) => Some(()),
                _ => None,
            }
        }
    })
    .await;
    name
}

async fn allow_services(client: &Client, name: &str) {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// An apply the apiserver refuses (an admission policy denies Services) makes the deployment
/// `Stalled` (kstatus: True, with the apiserver's message, on the observed generation) and
/// emits a Warning Event with that message; once the policy is gone a reconcile succeeds, the
/// Service exists, `Stalled` is cleared and a Normal Event says so.
#[tokio::test]
async fn a_refused_apply_stalls_the_deployment_with_the_apiservers_message_until_it_succeeds() {
    let Some((client, ns)) = test_env("refused_apply_stalls", "dspark-it-stalled").await else {
        return;
    };
    let policy = deny_services(&client, &ns).await;
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    dsds.create(
        &PostParams::default(),
        &sample("dsparkdeployment-smollm2.yaml"),
    )
    .await
    .unwrap();

    let (d, stalled) = wait_for("the Stalled condition", || {
        let dsds = dsds.clone();
        async move {
            let d = dsds.get("smollm2").await.ok()?;
            let c = d
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == "Stalled" && c.status == "True")?
                .clone();
            Some((d, c))
        }
    })
    .await;
    eprintln!("Stalled: {}: {}", stalled.reason, stalled.message);
    assert_eq!(stalled.reason, "ApplyFailed", "{stalled:?}");
    assert!(stalled.message.contains(DENIED), "{}", stalled.message);
    // The pool's and the deployment's Services are applied at once: the first refused
    // names the message, either one.
    assert!(
        stalled.message.contains("applying Service smollm2-a100:")
            || stalled.message.contains("applying Service smollm2:"),
        "{}",
        stalled.message
    );
    // kstatus reads Stalled only from a status that observed the object's generation.
    let generation = d.metadata.generation;
    assert_eq!(d.status.as_ref().unwrap().observed_generation, generation);
    assert_eq!(stalled.observed_generation, generation);

    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let find_event = |reason: &'static str, type_: &'static str| {
        let events = events.clone();
        async move {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.type_.as_deref() == Some(type_)
                        && e.involved_object.name.as_deref() == Some("smollm2")
                })
        }
    };
    let warning = wait_for("a Warning Event", || find_event("ApplyFailed", "Warning")).await;
    assert!(
        warning
            .message
            .as_deref()
            .unwrap_or_default()
            .contains(DENIED),
        "{warning:?}"
    );

    allow_services(&client, &policy).await;
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    wait_up_to(
        "Stalled to clear after the policy is gone",
        Duration::from_secs(120),
        || {
            let (dsds, services) = (dsds.clone(), services.clone());
            async move {
                let s = dsds.get("smollm2").await.ok()?.status?;
                let stalled = s
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Stalled" && c.status == "True");
                let svc = services.get_opt("smollm2").await.ok()?;
                (!stalled && svc.is_some()).then_some(())
            }
        },
    )
    .await;
    wait_for("a Normal Event for the recovery", || {
        find_event("Reconciled", "Normal")
    })
    .await;
    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// Names the owned objects could not carry are refused at admission, with a message naming
/// the field: a deployment name that is no DNS-1035 label (it names the deployment's
/// Service), a pool name that is none (part of the pool's Service name), a node type that is
/// no label value (the engine pods' node selector). The longest names allowed are accepted.
#[tokio::test]
async fn names_that_cannot_become_object_names_are_refused_naming_the_field() {
    let Some((client, ns)) = test_env("names_refused", "dspark-it-names").await else {
        return;
    };
    let api: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let base = sample("dsparkdeployment-smollm2.yaml");
    let with = |f: &dyn Fn(&mut DSparkDeployment)| {
        let mut d = base.clone();
        f(&mut d);
        d
    };
    let longest = with(&|d| {
        d.metadata.name = Some(format!("m{}", "0".repeat(39)));
        d.spec.pools[0].name = format!("p{}", "-a".repeat(9) + "z");
    });
    assert_eq!(longest.metadata.name.as_ref().unwrap().len(), 40);
    assert_eq!(longest.spec.pools[0].name.len(), 20);
    api.create(&dry, &longest)
        .await
        .unwrap_or_else(|e| panic!("the longest names were refused: {e}"));
    let cases = [
        (
            "a leading digit in the name",
            with(&|d| d.metadata.name = Some("8b-model".into())),
            "metadata.name must be a DNS-1035 label",
        ),
        (
            "a dot in the name",
            with(&|d| d.metadata.name = Some("smollm2.q4".into())),
            "metadata.name must be a DNS-1035 label",
        ),
        (
            "a dot in a pool name",
            with(&|d| d.spec.pools[0].name = "qwen3.8b".into()),
            "spec.pools[].name must be a DNS-1035 label",
        ),
        (
            "a leading digit in a pool name",
            with(&|d| d.spec.pools[0].name = "8b".into()),
            "spec.pools[].name must be a DNS-1035 label",
        ),
        (
            "a space in a node type",
            with(&|d| d.spec.pools[0].node_type = "a100 80gb".into()),
            "spec.pools[].nodeType must be a label value",
        ),
    ];
    for (what, obj, expect) in cases {
        match api.create(&dry, &obj).await {
            Ok(_) => panic!("{what}: accepted"),
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{what}: {e}");
                assert!(
                    e.message.contains(expect),
                    "{what}: expected '{expect}' in '{}'",
                    e.message
                );
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    drop_namespace(&client, &ns).await;
}

/// The condition `type_` of the deployment `name`, if its status has one.
async fn condition_of(
    dsds: &Api<DSparkDeployment>,
    name: &str,
    type_: &str,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    dsds.get(name)
        .await
        .ok()?
        .status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
}

/// Waits for condition `type_` of deployment `name` to have `status`; returns it.
async fn wait_condition(
    dsds: &Api<DSparkDeployment>,
    name: &str,
    type_: &str,
    status: &str,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    wait_for(&format!("{type_}={status}"), || async move {
        condition_of(dsds, name, type_)
            .await
            .filter(|c| c.status == status)
    })
    .await
}

/// `Available`, `Progressing` and `Ready` follow the pool Deployments as the deployment
/// controller reports them: one ready replica of one is available, complete and ready; a
/// scale-up to two keeps `Ready` and `Available` True while the new pod starts
/// (`Progressing`: RollingOut); a rollout past the Deployment's progress deadline makes
/// `Progressing` False with reason `RolloutStalled` (and `Ready` False, `Available` still
/// True: the old pod serves) with the Deployment's message.
#[tokio::test]
async fn rollout_conditions_follow_the_pool_deployments() {
    let Some((client, ns)) = test_env("rollout_conditions", "dspark-it-rollout").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.replicas = Some(1);
    dsd.spec.profiling.enabled = false;
    // A reconcile every second: each is a chance for `Ready` to flip.
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let first = engine_pod(&pods, "a100", |_| true).await;
    make_ready(&client, &ns, &first.name_any(), "127.1.77.5").await;

    let state = |d: &Api<DSparkDeployment>| {
        let d = d.clone();
        async move {
            let get = |t: &'static str| {
                let d = d.clone();
                async move {
                    condition_of(&d, "smollm2", t)
                        .await
                        .map(|c| (c.status, c.reason))
                }
            };
            (
                get("Ready").await,
                get("Available").await,
                get("Progressing").await,
            )
        }
    };
    let t = |s: &str, r: &str| Some((s.to_string(), r.to_string()));
    wait_for("one replica of one ready", || {
        let (dsds, t) = (dsds.clone(), &t);
        async move {
            let s = state(&dsds).await;
            (s == (
                t("True", "AllReplicasReady"),
                t("True", "MinimumReplicasAvailable"),
                t("True", "RolloutComplete"),
            ))
                .then_some(())
        }
    })
    .await;

    // A normal scale-up: the new pod is not ready yet; the deployment stays Ready.
    dsds.patch_scale(
        "smollm2",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "replicas": 2 } })),
    )
    .await
    .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for("the second pod", || {
        let pods = pods.clone();
        async move {
            let n = pods
                .list(&ListParams::default().labels("serving.dspark.dev/pool=a100"))
                .await
                .ok()?
                .items
                .len();
            (n == 2).then_some(())
        }
    })
    .await;
    wait_for("Progressing: RollingOut", || {
        let (dsds, t) = (dsds.clone(), &t);
        async move {
            let s = state(&dsds).await;
            (s.2 == t("True", "RollingOut")).then_some(s)
        }
    })
    .await;
    for _ in 0..6 {
        let (ready, available, _) = state(&dsds).await;
        assert_eq!(
            ready.as_ref().map(|r| r.0.as_str()),
            Some("True"),
            "Ready flipped on a scale-up: {ready:?}"
        );
        assert_eq!(available, t("True", "MinimumReplicasAvailable"));
        handle.reconciles("while the new pod starts", 1).await;
    }
    let status = dsds.get("smollm2").await.unwrap().status.unwrap();
    assert_eq!((status.ready_replicas, status.desired_replicas), (1, 2));

    // A rollout (new engine env: a new pod template) that cannot finish within the
    // Deployment's progress deadline (1 s, set by someone else; the operator's apply leaves
    // the field alone): the rollout is stalled, the old pod still serves.
    deployments
        .patch(
            "smollm2-a100",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "progressDeadlineSeconds": 1 } })),
        )
        .await
        .unwrap();
    dsds.patch(
        "smollm2",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "engine": {
            "env": [{"name": "DSPARK_ROLLOUT", "value": "2"}],
        } } })),
    )
    .await
    .unwrap();
    let c = wait_for("Progressing: RolloutStalled", || {
        let dsds = dsds.clone();
        async move {
            let c = condition_of(&dsds, "smollm2", "Progressing").await?;
            (c.status == "False" && c.reason == "RolloutStalled").then_some(c)
        }
    })
    .await;
    assert!(
        c.message.contains("a100") && c.message.contains("progress"),
        "{}",
        c.message
    );
    let ready = condition_of(&dsds, "smollm2", "Ready").await.unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "RolloutStalled")
    );
    let available = condition_of(&dsds, "smollm2", "Available").await.unwrap();
    assert_eq!(available.status, "True", "{available:?}");
    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// `GET .../scale` of `name`, if it answers.
async fn scale_of(dsds: &Api<DSparkDeployment>, name: &str) -> Option<(i32, i32)> {
    let s = dsds.get_scale(name).await.ok()?;
    // autoscaling/v1 omits a zero spec.replicas.
    Some((s.spec?.replicas.unwrap_or(0), s.status?.replicas))
}

/// `spec.replicas` of the Deployment `name`.
async fn replicas_of(deployments: &Api<Deployment>, name: &str) -> Option<i32> {
    deployments.get(name).await.ok()?.spec.replicas
}

/// The `/scale` contract in both scaling modes. SLO mode (a manifest without `spec.replicas`):
/// `/scale` answers with the autoscaler's total and a write there is put back. External mode
/// without `spec.replicas`: `/scale` answers with the current total, and a real autoscaling/v2
/// HPA (kube-controller-manager) gets the scale (`AbleToScale=True`) and raises the total to
/// its minimum, which the operator applies to the pool. A pool with `minReplicas: 0` scales to
/// zero; where the pools' minimum is above zero the apiserver refuses it.
#[tokio::test]
async fn scale_answers_in_both_modes_and_an_hpa_drives_the_external_total() {
    use dspark_operator::crd::{ScalingMode, ScalingSpec};
    use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
    let Some((client, ns)) = test_env("scale_answers_in_both_modes", "dspark-it-hpa").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);

    // SLO mode: the mode is written down, /scale reads the autoscaler's total (one replica).
    let slo = sample("dsparkdeployment-smollm2.yaml");
    assert!(slo.spec.replicas.is_none() && slo.spec.scaling.is_none());
    dsds.create(&PostParams::default(), &slo).await.unwrap();
    let got = wait_for("GET /scale of an SLO-mode deployment", || {
        let dsds = dsds.clone();
        async move { scale_of(&dsds, "smollm2").await }
    })
    .await;
    assert_eq!(got.0, 1, "/scale spec.replicas of the SLO total");
    let d = dsds.get("smollm2").await.unwrap();
    assert_eq!(
        d.spec.scaling.and_then(|s| s.mode),
        Some(ScalingMode::Slo),
        "the default mode is written down"
    );
    // `kubectl scale` does not take the count away from the SLO autoscaler.
    dsds.patch_scale(
        "smollm2",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "replicas": 3 } })),
    )
    .await
    .unwrap();
    wait_for("the SLO total back in /scale", || {
        let dsds = dsds.clone();
        async move { (scale_of(&dsds, "smollm2").await?.0 == 1).then_some(()) }
    })
    .await;
    assert_eq!(replicas_of(&deployments, "smollm2-a100").await, Some(1));

    // External mode, no spec.replicas: /scale answers with the current total.
    let mut ext = sample("dsparkdeployment-hpa.yaml");
    ext.spec.replicas = None;
    ext.spec.scaling = Some(ScalingSpec {
        mode: Some(ScalingMode::External),
    });
    dsds.create(&PostParams::default(), &ext).await.unwrap();
    wait_for("GET /scale of an External deployment", || {
        let dsds = dsds.clone();
        async move { (scale_of(&dsds, "hpa-driven").await?.0 == 1).then_some(()) }
    })
    .await;
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), &ns);
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(serde_json::json!({
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": { "name": "hpa-driven" },
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "serving.dspark.dev/v1alpha1",
                "kind": "DSparkDeployment",
                "name": "hpa-driven"
            },
            "minReplicas": 2,
            "maxReplicas": 3,
            "metrics": [{ "type": "Resource", "resource": {
                "name": "cpu", "target": { "type": "Utilization", "averageUtilization": 80 }
            } }]
        }
    }))
    .unwrap();
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    let able = wait_up_to("the HPA's AbleToScale", Duration::from_secs(150), || {
        let hpas = hpas.clone();
        async move {
            hpas.get("hpa-driven")
                .await
                .ok()?
                .status?
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "AbleToScale")
                .filter(|c| c.status == "True")
        }
    })
    .await;
    assert!(
        matches!(
            able.reason.as_deref(),
            Some("SucceededGetScale" | "SucceededRescale")
        ),
        "{able:?}"
    );
    wait_up_to(
        "the HPA's minimum on the pool",
        Duration::from_secs(90),
        || {
            let d = deployments.clone();
            async move { (replicas_of(&d, "hpa-driven-h100").await? == 2).then_some(()) }
        },
    )
    .await;
    assert_eq!(scale_of(&dsds, "hpa-driven").await.map(|s| s.0), Some(2));

    // Scale to zero: refused while the pools' minimum is 1, accepted with minReplicas 0.
    match dsds
        .patch_scale(
            "hpa-driven",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } })),
        )
        .await
    {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e}");
            assert!(
                e.message
                    .contains("below the sum of the pools' minReplicas"),
                "{e}"
            );
        }
        other => panic!("scale to 0 below the pools' minimum: {other:?}"),
    }
    let mut zero = sample("dsparkdeployment-hpa.yaml");
    zero.metadata.name = Some("to-zero".into());
    zero.spec.pools[0].min_replicas = 0;
    zero.spec.scaling = Some(ScalingSpec {
        mode: Some(ScalingMode::External),
    });
    dsds.create(&PostParams::default(), &zero).await.unwrap();
    wait_for("two replicas", || {
        let d = deployments.clone();
        async move { (replicas_of(&d, "to-zero-h100").await? == 2).then_some(()) }
    })
    .await;
    dsds.patch_scale(
        "to-zero",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } })),
    )
    .await
    .unwrap();
    wait_for("zero replicas", || {
        let d = deployments.clone();
        async move { (replicas_of(&d, "to-zero-h100").await? == 0).then_some(()) }
    })
    .await;
    wait_for("/scale at zero", || {
        let dsds = dsds.clone();
        async move { (scale_of(&dsds, "to-zero").await? == (0, 0)).then_some(()) }
    })
    .await;
    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// `spec.podTemplate` reaches the engine Deployments and the profiling Jobs (and so their
/// pods: the priority class is resolved by the apiserver's Priority admission), operator
/// labels win over the template's, the grace period covers the engine's drain deadline, and
/// each pool's rollout knobs (default maxSurge 0 / maxUnavailable 1) reach its Deployment.
#[tokio::test]
async fn the_pod_template_reaches_engine_and_profiling_pods() {
    use dspark_operator::crd::RolloutSpec;
    use k8s_openapi::api::core::v1::{PodSpec, ServiceAccount};
    use k8s_openapi::api::node::v1::RuntimeClass;
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let Some((client, ns)) = test_env("pod_template", "dspark-it-podtpl").await else {
        return;
    };
    let (pc_name, rc_name) = (format!("{ns}-high"), format!("{ns}-rt"));
    let pcs: Api<PriorityClass> = Api::all(client.clone());
    let rcs: Api<RuntimeClass> = Api::all(client.clone());
    pcs.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": { "name": pc_name }, "value": 100000
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    rcs.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": { "name": rc_name }, "handler": "runc"
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    Api::<ServiceAccount>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "engine" }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = two_pools();
    dsd.spec.engine.drain_timeout_seconds = Some(50);
    dsd.spec.pools[0].rollout = Some(RolloutSpec {
        max_surge: Some(IntOrString::Int(1)),
        max_unavailable: Some(IntOrString::Int(0)),
    });
    dsd.spec.pod_template = Some(
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "labels": { "team": "ml", "serving.dspark.dev/pool": "hijacked" },
                "annotations": { "example.com/owner": "ml-platform" }
            },
            "spec": {
                "imagePullSecrets": [{ "name": "regcred" }],
                "serviceAccountName": "engine",
                "priorityClassName": pc_name,
                "runtimeClassName": rc_name,
                "affinity": { "nodeAffinity": { "preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 10,
                    "preference": { "matchExpressions": [{
                        "key": "example.com/zone", "operator": "In", "values": ["z1"]
                    }] }
                }] } },
                "tolerations": [{ "key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule" }],
                "topologySpreadConstraints": [{
                    "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": { "matchLabels": { "serving.dspark.dev/deployment": "qwen3-8b" } }
                }],
                "nodeSelector": { "example.com/tier": "gpu", "dspark.dev/node-type": "elsewhere" }
            }
        }))
        .unwrap(),
    );
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    // Every pod spec the operator writes carries the merged fields.
    let check = |what: &str,
                 labels: &std::collections::BTreeMap<String, String>,
                 annotations: Option<&std::collections::BTreeMap<String, String>>,
                 pod: &PodSpec,
                 node_type: &str| {
        assert_eq!(labels.get("team").map(String::as_str), Some("ml"), "{what}");
        assert_ne!(
            labels.get("serving.dspark.dev/pool").map(String::as_str),
            Some("hijacked"),
            "{what}"
        );
        assert_eq!(
            annotations
                .and_then(|a| a.get("example.com/owner"))
                .map(String::as_str),
            Some("ml-platform"),
            "{what}"
        );
        assert_eq!(
            pod.image_pull_secrets.as_ref().map(|s| s[0].name.as_str()),
            Some("regcred"),
            "{what}"
        );
        assert_eq!(
            pod.service_account_name.as_deref(),
            Some("engine"),
            "{what}"
        );
        assert_eq!(pod.automount_service_account_token, Some(false), "{what}");
        assert_eq!(
            pod.priority_class_name.as_deref(),
            Some(pc_name.as_str()),
            "{what}"
        );
        assert_eq!(
            pod.runtime_class_name.as_deref(),
            Some(rc_name.as_str()),
            "{what}"
        );
        assert!(
            pod.affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .is_some(),
            "{what}"
        );
        let tolerations: Vec<&str> = pod
            .tolerations
            .iter()
            .flatten()
            .filter_map(|t| t.key.as_deref())
            .collect();
        assert!(
            tolerations.contains(&"nvidia.com/gpu")
                && tolerations.contains(&"example.com/dedicated"),
            "{what}: {tolerations:?}"
        );
        assert_eq!(
            pod.topology_spread_constraints.as_ref().map(|t| t.len()),
            Some(1),
            "{what}"
        );
        let sel = pod.node_selector.clone().unwrap_or_default();
        assert_eq!(
            sel.get("example.com/tier").map(String::as_str),
            Some("gpu"),
            "{what}"
        );
        assert_eq!(
            sel.get("dspark.dev/node-type").map(String::as_str),
            Some(node_type),
            "{what}"
        );
        assert_eq!(
            pod.termination_grace_period_seconds,
            Some(65),
            "{what}: drain 50 s + margin"
        );
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for (pool, node_type, strategy) in
        [("h100", "h100-80gb", (1, 0)), ("a100", "a100-80gb", (0, 1))]
    {
        let name = format!("qwen3-8b-{pool}");
        let d = wait_for(&format!("Deployment {name}"), || {
            let (d, name) = (deployments.clone(), name.clone());
            async move { d.get(&name).await.ok() }
        })
        .await;
        let spec = d.spec;
        let ru = spec.strategy.unwrap().rolling_update.unwrap();
        assert_eq!(
            (ru.max_surge, ru.max_unavailable),
            (
                Some(IntOrString::Int(strategy.0)),
                Some(IntOrString::Int(strategy.1))
            ),
            "{name} rollout"
        );
        let meta = spec.template.metadata.unwrap();
        let pod = spec.template.spec.unwrap();
        check(
            &name,
            meta.labels.as_ref().unwrap(),
            meta.annotations.as_ref(),
            &pod,
            node_type,
        );
        let args = pod.containers[0].args.clone().unwrap().join(" ");
        assert!(args.contains("--drain-timeout-secs 50"), "{args}");
    }
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let job = wait_for("a profiling Job", || {
        let jobs = jobs.clone();
        async move {
            jobs.list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|j| j.name_any().starts_with("h100-80gb"))
        }
    })
    .await;
    let tpl = job.spec.clone().unwrap().template;
    let meta = tpl.metadata.unwrap();
    check(
        "profiling Job",
        meta.labels.as_ref().unwrap(),
        meta.annotations.as_ref(),
        &tpl.spec.unwrap(),
        "h100-80gb",
    );

    // The pods exist with the class's priority (admission resolved it).
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for selector in [
        "serving.dspark.dev/pool=h100",
        &format!("job-name={}", job.name_any()),
    ] {
        let pod = wait_for(&format!("a pod of {selector}"), || {
            let (pods, selector) = (pods.clone(), selector.to_string());
            async move {
                pods.list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .next()
            }
        })
        .await;
        let spec = pod.spec.unwrap();
        assert_eq!(spec.priority, Some(100000), "{selector}");
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("engine"),
            "{selector}"
        );
    }
    handle.abort();
    drop_namespace(&client, &ns).await;
    let _ = pcs.delete(&pc_name, &DeleteParams::default()).await;
    let _ = rcs.delete(&rc_name, &DeleteParams::default()).await;
}

/// `spec.pools` and `status.conditions` are maps (by name, by type): a second field manager
/// adds a pool without a conflict and without touching the first one's, and a condition
/// another controller writes survives the operator's status writes.
#[tokio::test]
async fn pools_and_conditions_merge_by_key_across_field_managers() {
    let Some((client, ns)) = test_env("lists_merge_by_key", "dspark-it-lists").await else {
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.profiling.enabled = false;
    // A reconcile every second: each is a chance to drop the other manager's condition.
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.patch(
        "smollm2",
        &PatchParams::apply("team-a"),
        &Patch::Apply(&dsd),
    )
    .await
    .unwrap();
    let extra = serde_json::json!({
        "apiVersion": "serving.dspark.dev/v1alpha1", "kind": "DSparkDeployment",
        "metadata": { "name": "smollm2" },
        "spec": { "pools": [{
            "name": "h100", "nodeType": "h100-80gb", "minReplicas": 1, "maxReplicas": 2
        }] }
    });
    dsds.patch(
        "smollm2",
        &PatchParams::apply("team-b"),
        &Patch::Apply(&extra),
    )
    .await
    .unwrap_or_else(|e| panic!("a second manager adding a pool: {e}"));
    let pools = |d: &DSparkDeployment| -> Vec<String> {
        d.spec.pools.iter().map(|p| p.name.clone()).collect()
    };
    assert_eq!(pools(&dsds.get("smollm2").await.unwrap()), ["a100", "h100"]);
    // team-a applies its manifest again: team-b's pool stays.
    dsd.spec.slo.window_seconds = 30;
    dsds.patch(
        "smollm2",
        &PatchParams::apply("team-a"),
        &Patch::Apply(&dsd),
    )
    .await
    .unwrap();
    assert_eq!(pools(&dsds.get("smollm2").await.unwrap()), ["a100", "h100"]);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for name in ["smollm2-a100", "smollm2-h100"] {
        wait_for(&format!("Deployment {name}"), || {
            let d = deployments.clone();
            async move { d.get(name).await.ok() }
        })
        .await;
    }

    // A policy controller's condition next to the operator's.
    wait_for("the operator's Ready condition", || {
        let dsds = dsds.clone();
        async move { condition_of(&dsds, "smollm2", "Ready").await }
    })
    .await;
    let theirs = serde_json::json!({
        "apiVersion": "serving.dspark.dev/v1alpha1", "kind": "DSparkDeployment",
        "metadata": { "name": "smollm2" },
        "status": { "conditions": [{
            "type": "PolicyCompliant", "status": "True", "reason": "Checked",
            "message": "checked by the policy controller",
            "lastTransitionTime": "2026-01-01T00:00:00Z"
        }] }
    });
    dsds.patch_status(
        "smollm2",
        &PatchParams::apply("policy-bot"),
        &Patch::Apply(&theirs),
    )
    .await
    .unwrap_or_else(|e| panic!("another controller writing its condition: {e}"));
    // A spec change makes the operator write every one of its conditions again.
    dsds.patch(
        "smollm2",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "slo": { "windowSeconds": 20 } } })),
    )
    .await
    .unwrap();
    let generation = dsds.get("smollm2").await.unwrap().metadata.generation;
    let status = wait_for("the operator's conditions at the new generation", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("smollm2").await.ok()?.status?;
            s.conditions
                .iter()
                .filter(|c| c.type_ == "Ready")
                .all(|c| c.observed_generation >= generation)
                .then_some(s)
        }
    })
    .await;
    handle.reconciles("after the spec change", 3).await;
    let status = dsds.get("smollm2").await.unwrap().status.unwrap_or(status);
    let types: Vec<&str> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert!(types.contains(&"PolicyCompliant"), "{types:?}");
    assert!(
        types.contains(&"Ready") && types.contains(&"Scaling"),
        "{types:?}"
    );
    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// A Prometheus server (the real binary) on a free loopback port scraping `targets`
/// (`address`, target labels) every second; stopped when dropped.
struct Prometheus {
    child: std::process::Child,
    url: String,
    _dir: std::path::PathBuf,
}

impl Prometheus {
    async fn start(targets: &[(&str, serde_json::Value)]) -> Option<Self> {
        let bin = std::process::Command::new("prometheus")
            .arg("--version")
            .output();
        if bin.is_err() {
            eprintln!("prometheus is not installed");
            return None;
        }
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("dspark-it-prom-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let static_configs: Vec<serde_json::Value> = targets
            .iter()
            .map(|(a, l)| serde_json::json!({ "targets": [a], "labels": l }))
            .collect();
        let config = serde_json::json!({
            "global": { "scrape_interval": "1s", "evaluation_interval": "1s" },
            "scrape_configs": [{ "job_name": "dspark-engine", "static_configs": static_configs }]
        });
        std::fs::write(dir.join("prometheus.yml"), config.to_string()).unwrap();
        let child = std::process::Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus starts");
        let p = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        wait_for("Prometheus ready", || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
        })
        .await;
        Some(p)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Prometheus mode selects a pool's series by its labels: the pods of deployment `a-b` with
/// pool `c-d` (`a-b-c-d-*`) match the name prefix `a-b-c-` of deployment `a` with pool `b-c`,
/// yet each pool sees only its own engine's latency (one fast, one slow), as the real
/// Prometheus answers. (Deployment `a-b` with pool `c` cannot exist next to `a` with pool
/// `b-c` at all: both would own the Deployment `a-b-c`.)
#[tokio::test]
async fn prometheus_mode_selects_each_pools_series_by_labels() {
    use dspark_operator::crd::{DSparkDeploymentStatus, MetricsSource};
    let Some((client, ns)) = test_env("prometheus_labels", "dspark-it-prom").await else {
        return;
    };
    let (fast_ip, slow_ip) = ("127.1.78.1", "127.1.78.2");
    let fast = fake_engine_with_itl(fast_ip, false).await;
    let slow = fake_engine_with_itl(slow_ip, true).await;
    let labels = |pod: &str, deployment: &str, pool: &str| serde_json::json!({ "namespace": ns, "pod": pod, "deployment": deployment, "pool": pool });
    let targets = [
        (
            format!("{fast_ip}:8000"),
            labels("a-b-c-5d8f9-x1", "a", "b-c"),
        ),
        (
            format!("{slow_ip}:8000"),
            labels("a-b-c-d-7c6b4-y2", "a-b", "c-d"),
        ),
    ];
    let t: Vec<(&str, serde_json::Value)> = targets
        .iter()
        .map(|(a, l)| (a.as_str(), l.clone()))
        .collect();
    let Some(prom) = Prometheus::start(&t).await else {
        assert!(
            std::env::var("DSPARK_REQUIRE_CLUSTER").as_deref() != Ok("1"),
            "prometheus is required"
        );
        return;
    };
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    for (name, pool) in [("a", "b-c"), ("a-b", "c-d")] {
        let mut d = sample("dsparkdeployment-smollm2.yaml");
        d.metadata.name = Some(name.into());
        d.spec.pools[0].name = pool.into();
        d.spec.profiling.enabled = false;
        d.spec.slo.window_seconds = 5;
        d.spec.autoscaling.period_seconds = 1;
        d.spec.autoscaling.mode = AutoscalingMode::Advisory;
        d.spec.autoscaling.metrics_source = MetricsSource::Prometheus;
        d.spec.autoscaling.prometheus_url = Some(prom.url.clone());
        dsds.create(&PostParams::default(), &d).await.unwrap();
    }
    let itl = |s: &DSparkDeploymentStatus| s.pools.first().and_then(|p| p.itl_p95_ms);
    let (a, ab) = wait_up_to("both pools measured", Duration::from_secs(90), || {
        let dsds = dsds.clone();
        async move {
            let a = itl(&dsds.get("a").await.ok()?.status?)?;
            let ab = itl(&dsds.get("a-b").await.ok()?.status?)?;
            Some((a, ab))
        }
    })
    .await;
    assert!(
        a <= 10.0,
        "deployment a, pool b-c (fast engine only): p95 ITL {a} ms"
    );
    assert!(
        ab > 50.0,
        "deployment a-b, pool c (slow engine only): p95 ITL {ab} ms"
    );
    assert!(fast.scrapes.load(std::sync::atomic::Ordering::Relaxed) > 0);
    handle.abort();
    for t in fast.tasks.into_iter().chain(slow.tasks) {
        t.abort();
    }
    drop(prom);
    drop_namespace(&client, &ns).await;
}

/// The admin token (and the metrics scrape) reaches only pods this deployment owns through
/// pod -> ReplicaSet -> Deployment -> DSparkDeployment: a pod that only copies the engine
/// pods' labels gets no cost-table push and is never scraped.
#[tokio::test]
async fn the_admin_token_goes_only_to_pods_this_deployment_owns() {
    let Some((client, ns)) = test_env("admin_token_owned_pods", "dspark-it-owned").await else {
        return;
    };
    let (owned_ip, foreign_ip) = ("127.1.79.1", "127.1.79.2");
    let owned = fake_engine(owned_ip).await;
    let foreign = fake_engine(foreign_ip).await;
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.slo.window_seconds = 4;
    dsd.spec.autoscaling.period_seconds = 1;
    dsd.spec.autoscaling.mode = AutoscalingMode::Advisory;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();
    profile_first(&client, &ns, "a100-80gb").await;

    // A pod with the engine pods' labels that nothing of this deployment created.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let impostor: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "smollm2-a100-impostor", "labels": {
            "serving.dspark.dev/deployment": "smollm2", "serving.dspark.dev/pool": "a100",
            "app.kubernetes.io/component": "engine", "app.kubernetes.io/managed-by": "dspark-operator"
        } },
        "spec": { "nodeName": "gpu-a-0", "containers": [{ "name": "engine", "image": "dspark/engine:0.1.0" }] }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &impostor)
        .await
        .unwrap();
    make_ready(&client, &ns, "smollm2-a100-impostor", foreign_ip).await;
    let pod = engine_pod(&pods, "a100", |p| {
        !p.owner_references().is_empty()
            && p.spec.as_ref().is_some_and(|s| {
                s.containers[0]
                    .args
                    .as_ref()
                    .is_some_and(|a| a.contains(&"--cost-table".to_string()))
            })
    })
    .await;
    make_ready(&client, &ns, &pod.name_any(), owned_ip).await;
    wait_for("a push to the owned pod", || {
        let pushes = owned.pushes.clone();
        async move { pushes.lock().unwrap().first().cloned() }
    })
    .await;
    wait_for("a scrape of the owned pod", || {
        let n = owned.scrapes.load(std::sync::atomic::Ordering::Relaxed);
        async move { (n > 0).then_some(()) }
    })
    .await;
    // Reconciles after the owned pod's first push and scrape: each a chance to reach the
    // impostor, were it taken for an engine of this deployment.
    handle
        .reconciles("after the first push and scrape", 3)
        .await;
    assert!(
        foreign.pushes.lock().unwrap().is_empty(),
        "the admin token went to a pod this deployment does not own"
    );
    assert_eq!(
        foreign.scrapes.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a pod this deployment does not own was scraped"
    );
    handle.abort();
    for t in owned.tasks.into_iter().chain(foreign.tasks) {
        t.abort();
    }
    drop_namespace(&client, &ns).await;
}

/// A `huggingFace` source with a token Secret: the engine pods fetch it in a `fetch-model`
/// init container (HF_TOKEN from the Secret, into the model cache the engine then serves from
/// offline). When the fetch fails (here the Hub refused the token: the pod status the kubelet
/// reports, with the engine's error as the termination message) the deployment shows
/// `ModelAvailable=False`, reason `Unauthorized`, with that message, and a Warning Event; once
/// a pod's fetch completes, `ModelAvailable=True`.
#[tokio::test]
async fn a_failed_model_fetch_shows_as_model_available_false_with_an_event() {
    use dspark_operator::crd::{HuggingFaceSource, ModelSource, SecretKeyRef};
    let Some((client, ns)) = test_env("a_failed_model_fetch", "dspark-it-fetch").await else {
        return;
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "hf-token"},
        "stringData": {"token": "hf_wrong"}
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let handle = run_controller(&client, &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.model = ModelSource {
        hugging_face: Some(HuggingFaceSource {
            repo: "dspark-test/gated-qwen3".into(),
            token_secret_ref: Some(SecretKeyRef {
                name: "hf-token".into(),
                key: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = engine_pod(&pods, "a100", |_| true).await;
    let spec = pod.spec.clone().unwrap();
    let init = &spec.init_containers.as_ref().expect("an init container")[0];
    assert_eq!(init.name, "fetch-model");
    assert_eq!(
        init.args.as_ref().unwrap()[..4].join(" "),
        "fetch hf://dspark-test/gated-qwen3 --cache /models/cache"
    );
    let token = init
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
    assert_eq!((sel.name.as_str(), sel.key.as_str()), ("hf-token", "token"));
    assert!(spec.containers[0]
        .args
        .as_ref()
        .unwrap()
        .join(" ")
        .starts_with("serve --model hf://dspark-test/gated-qwen3 --cache /models/cache"));

    let refused = "cannot fetch hf://dspark-test/gated-qwen3: the Hub refused the token for dspark-test/gated-qwen3 (401 for hf://dspark-test/gated-qwen3@main): check that HF_TOKEN is valid and has been granted access to dspark-test/gated-qwen3";
    let fetch_status = |state: serde_json::Value, last: serde_json::Value| {
        serde_json::json!({"status": {
            "phase": "Pending",
            "initContainerStatuses": [{
                "name": "fetch-model", "image": "dspark/engine:0.1.0", "imageID": "",
                "ready": false, "restartCount": 1, "state": state, "lastState": last
            }]
        }})
    };
    let failed = fetch_status(
        serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
        serde_json::json!({"terminated": {"exitCode": 1, "reason": "Error", "message": refused}}),
    );
    pods.patch_status(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&failed),
    )
    .await
    .unwrap();
    let c = wait_condition(&dsds, "smollm2", "ModelAvailable", "False").await;
    assert_eq!(c.reason, "Unauthorized");
    assert!(
        c.message.contains("HF_TOKEN") && c.message.contains("fetch-model"),
        "{}",
        c.message
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let event = wait_for("an Unauthorized Warning Event", || {
        let events = events.clone();
        async move {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some("Unauthorized")
                        && e.type_.as_deref() == Some("Warning")
                        && e.involved_object.name.as_deref() == Some("smollm2")
                })
        }
    })
    .await;
    assert!(event
        .message
        .unwrap_or_default()
        .contains("refused the token"));

    // Nothing fetched yet: no cost table is keyed (its key needs the resolved revision).
    let c = wait_condition(&dsds, "smollm2", "Profiled", "False").await;
    assert_eq!(c.reason, "WaitingForRevision", "{c:?}");
    let tables: Api<DSparkCostTable> = Api::namespaced(client.clone(), &ns);
    assert!(tables
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());

    // The Secret is fixed and the next attempt succeeds; its termination message is the
    // fetch's report, with the commit `main` resolved to.
    let commit = "5a1e0c0ffee5a1e0c0ffee5a1e0c0ffee5a1e0c0";
    let report = serde_json::json!({
        "source": "hf://dspark-test/gated-qwen3", "path": "/models/cache/x",
        "revision": commit, "model_id": "gated-qwen3@5a1e0c0ffee5",
    })
    .to_string();
    let done = fetch_status(
        serde_json::json!({"terminated": {"exitCode": 0, "reason": "Completed", "message": report}}),
        serde_json::json!({"terminated": {"exitCode": 1, "reason": "Error", "message": refused}}),
    );
    pods.patch_status(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&done),
    )
    .await
    .unwrap();
    let c = wait_condition(&dsds, "smollm2", "ModelAvailable", "True").await;
    assert_eq!(c.reason, "Fetched");
    // The revision is recorded, keys the pool's cost table and is pinned in its ConfigMap.
    let resolved = wait_for("status.resolvedSources", || {
        let dsds = dsds.clone();
        async move {
            let s = dsds.get("smollm2").await.ok()?.status?;
            s.resolved_sources.first().cloned()
        }
    })
    .await;
    assert_eq!(
        (resolved.role.as_str(), resolved.revision.as_str()),
        ("model", commit)
    );
    assert_eq!(resolved.pod, pod.name_any());
    let table = wait_for("a cost table keyed by the commit", || {
        let tables = tables.clone();
        async move { tables.list(&ListParams::default()).await.ok()?.items.pop() }
    })
    .await;
    assert_eq!(
        table.spec.model_id,
        format!("hf://dspark-test/gated-qwen3@{commit}")
    );
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let pins = wait_for("the pool ConfigMap's revision pins", || {
        let cms = cms.clone();
        async move {
            cms.get("smollm2-a100-cost-table")
                .await
                .ok()?
                .data?
                .remove("revision-pins")
        }
    })
    .await;
    assert_eq!(pins, format!("hf://dspark-test/gated-qwen3 {commit}\n"));
    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// What the operator sent to the API server so far: (reconciles, reads, writes).
fn traffic(m: &dspark_operator::telemetry::Metrics) -> (u64, u64, u64) {
    use dspark_operator::telemetry::VerbLabel;
    let n = |verb| m.kube_requests.get_or_create(&VerbLabel { verb }).get();
    (
        m.reconciles.load(std::sync::atomic::Ordering::Relaxed),
        n("get"),
        n("create") + n("patch") + n("update") + n("delete") + n("other"),
    )
}

#[tokio::test]
async fn a_deployment_at_rest_costs_no_api_requests_and_drift_is_repaired() {
    let Some((client, ns)) = test_env("at_rest", "dspark-it-rest").await else {
        return;
    };
    let metrics = std::sync::Arc::new(dspark_operator::telemetry::Metrics::default());
    let config = kube::Config::infer().await.unwrap();
    let counted = dspark_operator::telemetry::counted_client(config, metrics.clone()).unwrap();
    let handle = run_controller_with(&counted, &ns, metrics.clone());
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    // A reconcile every second: a window of a few seconds holds several.
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();

    // Converged: two reconciles in a row finished without a write.
    let quiet = |what: &'static str| {
        let handle = &handle;
        let metrics = metrics.clone();
        wait_for(what, move || {
            let metrics = metrics.clone();
            async move {
                let (_, _, w0) = traffic(&metrics);
                handle.reconciles(what, 2).await;
                (traffic(&metrics).2 == w0).then_some(())
            }
        })
    };
    quiet("the deployment to come to rest").await;
    // At rest: reconciles keep running, from the caches, and send nothing at all.
    let before = traffic(&metrics);
    handle.reconciles("at rest", 3).await;
    let after = traffic(&metrics);
    assert_eq!(
        (after.1 - before.1, after.2 - before.2),
        (0, 0),
        "reads and writes at rest over {} reconciles",
        after.0 - before.0
    );

    // Drift: someone scales the engine Deployment, edits a Service, deletes the PDB.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let svc = services.get("smollm2-a100").await.unwrap();
    let want_selector = svc.spec.as_ref().unwrap().selector.clone().unwrap();
    let hijacked: std::collections::BTreeMap<_, _> = want_selector
        .keys()
        .map(|k| (k.clone(), "someone-else".to_string()))
        .collect();
    let by_hand = PatchParams::default();
    deployments
        .patch(
            "smollm2-a100",
            &by_hand,
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 9}})),
        )
        .await
        .unwrap();
    services
        .patch(
            "smollm2-a100",
            &by_hand,
            &Patch::Merge(serde_json::json!({"spec": {"selector": hijacked}})),
        )
        .await
        .unwrap();
    pdbs.delete("smollm2-a100", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the drift to be repaired", || {
        let (deployments, services, pdbs) = (deployments.clone(), services.clone(), pdbs.clone());
        let want_selector = want_selector.clone();
        async move {
            let d = deployments.get("smollm2-a100").await.ok()?;
            let s = services.get("smollm2-a100").await.ok()?;
            pdbs.get_opt("smollm2-a100").await.ok()??;
            // Back within the pool's bounds (the autoscaler starts from what it observes).
            let replicas = d.spec.replicas?;
            ((1..=4).contains(&replicas) && s.spec?.selector? == want_selector).then_some(())
        }
    })
    .await;
    // ... and the deployment comes back to rest.
    quiet("the deployment to come back to rest").await;

    handle.abort();
    drop_namespace(&client, &ns).await;
}

/// `spec.suspend: true` stops reconciling: `Suspended=True` (and an Event), a hand edit of an
/// owned object stays through many requeues; `false` repairs it at once and the condition goes.
#[tokio::test]
async fn a_suspended_deployment_is_left_alone_until_resumed() {
    let Some((client, ns)) = test_env("suspend", "dspark-it-suspend").await else {
        return;
    };
    let handle = run_controller(&client, &ns);
    let dsds: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let mut dsd = sample("dsparkdeployment-smollm2.yaml");
    dsd.spec.autoscaling.period_seconds = 1;
    dsds.create(&PostParams::default(), &dsd).await.unwrap();
    wait_for("the pool Deployment", || async {
        replicas_of(&deployments, "smollm2-a100").await
    })
    .await;
    assert!(condition_of(&dsds, "smollm2", "Suspended").await.is_none());

    let suspend = |on: bool| {
        let dsds = dsds.clone();
        async move {
            dsds.patch(
                "smollm2",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"suspend": on}})),
            )
            .await
            .unwrap();
        }
    };
    suspend(true).await;
    let c = wait_condition(&dsds, "smollm2", "Suspended", "True").await;
    assert_eq!(c.reason, "Suspended");
    assert!(c.message.contains("spec.suspend"), "{}", c.message);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    wait_for("a Suspended Event", || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Suspended"))
            .then_some(())
    })
    .await;

    // Hand-scaled while suspended: left as it is by the reconciles that follow (a running
    // operator repairs this within a second, see the test above). The patch triggers a
    // reconcile (the operator watches its Deployments) and one may be in flight; suspended,
    // nothing requeues, so after the first to finish a touch of the deployment's metadata
    // triggers another: the second to finish began after the patch.
    let start = handle.finished();
    deployments
        .patch(
            "smollm2-a100",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 9}})),
        )
        .await
        .unwrap();
    handle
        .reconciles_since("after the hand-scaling", start, 1)
        .await;
    dsds.patch(
        "smollm2",
        &PatchParams::default(),
        &Patch::Merge(
            serde_json::json!({"metadata": {"annotations": {"test.dspark.dev/touch": "1"}}}),
        ),
    )
    .await
    .unwrap();
    handle.reconciles_since("after the touch", start, 2).await;
    assert_eq!(replicas_of(&deployments, "smollm2-a100").await, Some(9));

    suspend(false).await;
    wait_for("the repair after resuming", || async {
        let r = replicas_of(&deployments, "smollm2-a100").await?;
        let gone = condition_of(&dsds, "smollm2", "Suspended").await.is_none();
        ((1..=4).contains(&r) && gone).then_some(())
    })
    .await;

    handle.abort();
    drop_namespace(&client, &ns).await;
}
