//! The Helm chart (charts/dspark-operator): its CRDs are the repository's, its RBAC is exactly
//! operator/deploy/rbac.yaml, it lints, and (against the local cluster, `tests/cluster/cluster.sh
//! up`, KUBECONFIG and helm on PATH: `eval "$(tests/cluster/cluster.sh env)"`) it installs, runs
//! the operator as a pod through the test kubelet (so the chart's RBAC, ServiceAccount token,
//! probes and leader election are really used), passes `helm test`, upgrades under a live
//! DSparkDeployment (the new pod takes the Lease, owned objects are kept, the deployment is
//! still reconciled) and uninstalls, leaving only the CRDs. The operator and the `helm test`
//! hook run FROM the image DSPARK_CHART_OPERATOR_IMAGE (`REGISTRY/REPOSITORY@sha256:...`, as
//! `make unit` pushes it to the loopback registry) through runc, installed by digest. Without a
//! cluster or that image the cluster test prints why and passes, unless
//! DSPARK_REQUIRE_CLUSTER=1.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn chart() -> PathBuf {
    repo("charts/dspark-operator")
}

fn require() -> bool {
    std::env::var("DSPARK_REQUIRE_CLUSTER").as_deref() == Ok("1")
}

/// `helm`, if on PATH.
fn helm() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("helm"))
        .find(|p| p.is_file())
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

/// `ours` holds exactly the `ext` files of `theirs`, byte for byte (`cp` is the fix).
fn assert_copies(ours: &Path, theirs: &Path, ext: &str) {
    let names = |dir: &Path| -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(ext))
            .collect()
    };
    let fix = format!("cp {}/*{ext} {}/", theirs.display(), ours.display());
    assert_eq!(
        names(ours),
        names(theirs),
        "{} must hold exactly the {ext} files of {}; {fix}",
        ours.display(),
        theirs.display()
    );
    for n in names(theirs) {
        assert!(
            std::fs::read(ours.join(&n)).unwrap() == std::fs::read(theirs.join(&n)).unwrap(),
            "{n} differs between {} and {}; {fix}",
            ours.display(),
            theirs.display()
        );
    }
}

#[test]
fn chart_crds_are_the_repository_crds() {
    assert_copies(&chart().join("crds"), &repo("crds"), ".yaml");
}

#[test]
fn chart_dashboards_are_the_repository_dashboards() {
    assert_copies(
        &chart().join("dashboards"),
        &repo("config/grafana"),
        ".json",
    );
}

/// (apiGroup, resource, verb, resourceNames) of the rules of every `kind` document in `docs`.
fn rule_set(docs: &[serde_yaml::Value], kind: &str) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    let strs = |v: &serde_yaml::Value| -> Vec<String> {
        v.as_sequence()
            .map(|s| {
                s.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    for d in docs.iter().filter(|d| d["kind"].as_str() == Some(kind)) {
        for r in d["rules"].as_sequence().into_iter().flatten() {
            let mut names = strs(&r["resourceNames"]);
            names.sort();
            let names = names.join(",");
            for g in strs(&r["apiGroups"]) {
                for res in strs(&r["resources"]) {
                    for v in strs(&r["verbs"]) {
                        out.insert((g.clone(), res.clone(), v, names.clone()));
                    }
                }
            }
        }
    }
    out
}

fn yaml_docs(text: &str) -> Vec<serde_yaml::Value> {
    serde_yaml::Deserializer::from_str(text)
        .filter_map(|d| {
            let v = serde_yaml::Value::deserialize(d).ok()?;
            (!v.is_null()).then_some(v)
        })
        .collect()
}

use serde::Deserialize;

#[test]
fn chart_lints_and_its_rbac_is_exactly_the_operators() {
    let Some(helm) = helm() else {
        assert!(
            !require(),
            "DSPARK_REQUIRE_CLUSTER=1 but helm is not on PATH"
        );
        eprintln!("SKIP: helm is not on PATH (eval \"$(tests/cluster/cluster.sh env)\")");
        return;
    };
    run(Command::new(&helm).args(["lint", "--strict"]).arg(chart())).unwrap();
    for extra in [
        &[][..],
        &[
            "--set",
            "watchNamespace=team-a",
            "--set",
            "leaderElection.enabled=false",
        ][..],
        &[
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "networkPolicy.enabled=true",
        ][..],
    ] {
        run(Command::new(&helm)
            .args(["lint", "--strict"])
            .arg(chart())
            .args(extra))
        .unwrap();
    }
    // A bad value is refused by values.schema.json.
    let bad = Command::new(&helm)
        .args(["template", "x"])
        .arg(chart())
        .args(["--set", "replicaCount=-1"])
        .output()
        .unwrap();
    assert!(
        !bad.status.success(),
        "values.schema.json let replicaCount=-1 through"
    );

    let rendered = run(Command::new(&helm)
        .args(["template", "x", "-n", "ops"])
        .arg(chart()))
    .unwrap();
    let docs = yaml_docs(&rendered);
    let reference = yaml_docs(&std::fs::read_to_string(repo("operator/deploy/rbac.yaml")).unwrap());
    for kind in ["ClusterRole", "Role"] {
        let (chart_rules, operator_rules) = (rule_set(&docs, kind), rule_set(&reference, kind));
        assert!(!operator_rules.is_empty());
        let extra: Vec<_> = chart_rules.difference(&operator_rules).collect();
        let missing: Vec<_> = operator_rules.difference(&chart_rules).collect();
        assert!(
            extra.is_empty() && missing.is_empty(),
            "{kind} rules of the chart differ from operator/deploy/rbac.yaml: \
             the chart grants more {extra:?}, lacks {missing:?}"
        );
    }
    let kinds: BTreeSet<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for k in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "Pod",
    ] {
        assert!(kinds.contains(k), "the chart renders no {k}: {kinds:?}");
    }
    assert!(!kinds.contains("ServiceMonitor") && !kinds.contains("NetworkPolicy"));
    let dep = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("Deployment"))
        .unwrap();
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        args.contains(&"--lease-name=x-dspark-operator-leader"),
        "{args:?}"
    );
    // The operator keeps its CRDs current by default; crds.apply=false drops the flag and the
    // CRD ClusterRole with it.
    assert!(args.contains(&"--apply-crds"), "{args:?}");
    let without = run(Command::new(&helm)
        .args(["template", "x", "-n", "ops", "--set", "crds.apply=false"])
        .arg(chart()))
    .unwrap();
    assert!(!without.contains("--apply-crds") && !without.contains("customresourcedefinitions"));
    // Images: the project's at the chart's appVersion; a registry prefixes the operator's and
    // the engines' (the defaults of deployments without spec.engine.image), a digest pins the
    // operator's, and a malformed digest is refused.
    let app_version = std::fs::read_to_string(chart().join("Chart.yaml"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .unwrap()
        .trim()
        .trim_matches('"')
        .to_string();
    assert_eq!(
        c["image"].as_str(),
        Some(format!("dspark/operator:{app_version}").as_str())
    );
    assert!(args.contains(&format!("--engine-image=dspark/engine:{app_version}").as_str()));
    assert!(
        args.contains(&format!("--engine-cuda-image=dspark/engine-cuda:{app_version}").as_str())
    );
    let digest = format!("sha256:{}", "ab".repeat(32));
    let pinned = run(Command::new(&helm)
        .args([
            "template",
            "x",
            "-n",
            "ops",
            "--set",
            "image.registry=reg.example:5000",
        ])
        .args(["--set", &format!("image.digest={digest}")])
        .args(["--set", "engineImages.tag=9.9.9"])
        .arg(chart()))
    .unwrap();
    assert!(pinned.contains(&format!(
        "image: \"reg.example:5000/dspark/operator@{digest}\""
    )));
    assert!(pinned.contains("--engine-image=reg.example:5000/dspark/engine:9.9.9"));
    assert!(pinned.contains("--engine-cuda-image=reg.example:5000/dspark/engine-cuda:9.9.9"));
    let bad_digest = Command::new(&helm)
        .args(["template", "x", "--set", "image.digest=latest"])
        .arg(chart())
        .output()
        .unwrap();
    assert!(
        !bad_digest.status.success(),
        "a digest of 'latest' was let through"
    );
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    assert_eq!(c["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert!(c["resources"]["limits"]["memory"].as_str().is_some());
}

/// Stops the kubelet this test started (and its pods' processes) even when the test fails.
struct Kubelet(Option<Child>);

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            // SIGTERM, so that it stops its pods' processes.
            // SAFETY: kill(2) on our own child; no memory is touched.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(15) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Polls `f` every 500 ms until it returns `Some`, for at most `secs` seconds.
fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out after {secs} s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A binary of the workspace: `$env` if set, else the one next to this test's binary (this
/// crate has none of its own, so Cargo gives it no `CARGO_BIN_EXE_*`; `cargo build --release
/// --workspace`, as `make build` runs, puts them there).
fn workspace_bin(name: &str, env: &str) -> Result<PathBuf, String> {
    let path = match std::env::var_os(env) {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .unwrap()
            .parent()
            .and_then(|p| p.parent())
            .unwrap()
            .join(name),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no {name} binary at {} (cargo build --release -p {name}, or set {env})",
            path.display()
        ))
    }
}

#[test]
fn chart_installs_runs_the_operator_passes_helm_test_and_uninstalls() {
    let skip = |why: &str| {
        assert!(!require(), "DSPARK_REQUIRE_CLUSTER=1 but {why}");
        eprintln!(
            "SKIP: {why} (tests/cluster/cluster.sh up; eval \"$(tests/cluster/cluster.sh env)\")"
        );
    };
    let Some(helm) = helm() else {
        return skip("helm is not on PATH");
    };
    if std::env::var_os("KUBECONFIG").is_none() {
        return skip("KUBECONFIG is not set");
    }
    let kubectl = helm.with_file_name("kubectl");
    let k = |args: &[&str]| run(Command::new(&kubectl).args(args));
    if k(&["get", "--raw", "/readyz"]).is_err() {
        return skip("the apiserver does not answer");
    }
    let test_kubelet = match workspace_bin("dspark-test-kubelet", "DSPARK_TEST_KUBELET_BIN") {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    // `REGISTRY/REPOSITORY@sha256:...` (make test pushes this tree's operator image to the
    // loopback registry): the operator and the helm test hook run FROM it through runc.
    let image = std::env::var("DSPARK_CHART_OPERATOR_IMAGE").unwrap_or_default();
    let Some((image_repo, image_digest)) = image.split_once("@sha256:") else {
        return skip(&format!(
            "DSPARK_CHART_OPERATOR_IMAGE ({image:?}) is not an operator image by digest \
             (make unit pushes one: scripts/images.sh push REGISTRY operator)"
        ));
    };
    let image_values = [
        format!("image.repository={image_repo}"),
        format!("image.digest=sha256:{image_digest}"),
    ];
    eprintln!("operator from {image}");
    let t0 = Instant::now();
    let ns = format!("dspark-chart-{}", std::process::id());
    let release = "chart-test";
    let uninstall = |timeout: &str| {
        let mut cmd = Command::new(&helm);
        cmd.args([
            "uninstall",
            release,
            "-n",
            &ns,
            "--wait",
            "--timeout",
            timeout,
        ]);
        cmd
    };
    let cluster_dir =
        std::env::var("DSPARK_CLUSTER_DIR").unwrap_or_else(|_| "/tmp/dspark-cluster".into());

    // A kubelet for the fake nodes, unless `cluster.sh kubelet-up` already runs one.
    let shared_kubelet = k(&[
        "get",
        "nodes",
        "-l",
        "dspark.dev/test-kubelet=true",
        "-o",
        "name",
    ])
    .map(|s| !s.trim().is_empty())
    .unwrap_or(false)
        && Path::new(&cluster_dir)
            .join("run/dspark-test-kubelet.pid")
            .exists();
    let _kubelet = if shared_kubelet {
        Kubelet(None)
    } else {
        k(&[
            "label",
            "node",
            "-l",
            "dspark.dev/fake-gpu-node=true",
            "dspark.dev/chart-test=true",
            "--overwrite",
        ])
        .unwrap();
        let dir = std::env::temp_dir().join(format!("dspark-chart-kubelet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join("kubelet.log")).unwrap();
        eprintln!("test kubelet log: {}", dir.join("kubelet.log").display());
        let child = Command::new(&test_kubelet)
            .args([
                "--node-selector",
                "dspark.dev/chart-test=true",
                "--image-runtime",
                "runc",
                "--state-dir",
            ])
            .arg(&dir)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        Kubelet(Some(child))
    };
    let node_label = if shared_kubelet {
        "dspark.dev/test-kubelet"
    } else {
        "dspark.dev/chart-test"
    };

    let result = std::panic::catch_unwind(|| {
        k(&["create", "namespace", &ns]).unwrap();
        let mut values: Vec<&str> = image_values
            .iter()
            .flat_map(|v| ["--set", v.as_str()])
            .collect();
        let selector = format!("nodeSelector.{}=true", node_label.replace('.', "\\."));
        values.extend([
            "--set-string",
            &selector,
            "--set",
            "tolerations[0].key=nvidia.com/gpu",
            "--set",
            "tolerations[0].operator=Exists",
            "--set",
            "leaderElection.leaseSeconds=6",
            "--set",
            "networkPolicy.enabled=true",
            "--set",
            "logLevel=info",
        ]);
        let out = run(Command::new(&helm)
            .args(["install", release])
            .arg(chart())
            .args(["-n", &ns, "--wait", "--timeout", "120s"])
            .args(&values))
        .unwrap();
        assert!(out.contains("helm test"), "NOTES.txt not shown: {out}");
        eprintln!(
            "[{:.1}s] installed; operator pod ready",
            t0.elapsed().as_secs_f64()
        );

        // The operator (running as its ServiceAccount) holds the leader Lease.
        let pod = k(&[
            "get",
            "pods",
            "-n",
            &ns,
            "-l",
            "app.kubernetes.io/component=operator",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])
        .unwrap();
        let leader = || {
            k(&[
                "get",
                "lease",
                "-n",
                &ns,
                "chart-test-dspark-operator-leader",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .ok()
            .filter(|h| !h.is_empty())
        };
        let holder = wait_for("the leader Lease", 60, leader);
        assert_eq!(holder, pod);
        let pod_field = |path: &str| {
            k(&[
                "get",
                "pod",
                "-n",
                &ns,
                &pod,
                "-o",
                &format!("jsonpath={path}"),
            ])
            .unwrap()
        };
        let ip = pod_field("{.status.podIP}");
        assert!(ip.starts_with("127."), "pod IP {ip} is not loopback");
        assert_eq!(
            pod_field("{.status.containerStatuses[0].imageID}"),
            image,
            "the operator pod does not run from the pushed image"
        );

        // Its ClusterRole is enough to reconcile a DSparkDeployment (no engines: 0 replicas,
        // no profiling, no autoscaling). The weights are a volume: a remote source gets its
        // cost table only once a fetch resolved its revision, and no pod fetches here.
        let dsd = r#"
apiVersion: serving.dspark.dev/v1alpha1
kind: DSparkDeployment
metadata: {name: rbac-probe}
spec:
  model: {id: m, hostPath: {path: /var/lib/dspark/models/m.gguf}, allowHostPath: true}
  engine: {image: dspark/engine:dev}
  pools:
    - {name: a100, nodeType: a100-80gb, minReplicas: 0, maxReplicas: 1}
  replicas: 0
  slo: {ttftP95Ms: 500, itlP95Ms: 50}
  profiling: {enabled: false}
  autoscaling: {enabled: false}
"#;
        let path = std::env::temp_dir().join(format!("{ns}-dsd.yaml"));
        std::fs::write(&path, dsd).unwrap();
        k(&["apply", "-n", &ns, "-f", path.to_str().unwrap()]).unwrap();
        for obj in [
            "deployment/rbac-probe-a100",
            "service/rbac-probe-a100",
            "poddisruptionbudget/rbac-probe-a100",
            "configmap/rbac-probe-a100-cost-table",
            "secret/rbac-probe-admin-token",
        ] {
            wait_for(&format!("the operator to create {obj}"), 60, || {
                k(&["get", "-n", &ns, obj]).ok()
            });
        }
        wait_for("a DSparkCostTable", 30, || {
            k(&["get", "dsct", "-n", &ns, "-o", "name"])
                .ok()
                .filter(|s| !s.trim().is_empty())
        });
        eprintln!(
            "[{:.1}s] the operator reconciled a DSparkDeployment",
            t0.elapsed().as_secs_f64()
        );

        // helm test: the hook pod GETs /healthz through the metrics Service.
        let out = run(Command::new(&helm).args(["test", release, "-n", &ns, "--timeout", "90s"]))
            .unwrap();
        assert!(out.contains("Succeeded"), "{out}");
        eprintln!("[{:.1}s] helm test passed", t0.elapsed().as_secs_f64());

        // helm upgrade with a live DSparkDeployment: a new operator pod takes the Lease over,
        // what the deployment owns is kept (same uids, not recreated), and the new operator
        // acts on a change to it.
        let owned = ["deployment/rbac-probe-a100", "service/rbac-probe-a100"];
        let uids = |objs: &[&str]| -> Vec<String> {
            objs.iter()
                .map(|o| k(&["get", "-n", &ns, o, "-o", "jsonpath={.metadata.uid}"]).unwrap())
                .collect()
        };
        let before = uids(&owned);
        let out = run(Command::new(&helm)
            .args(["upgrade", release])
            .arg(chart())
            .args(["-n", &ns, "--wait", "--timeout", "120s"])
            .args(&values)
            .args(["--set", "logLevel=debug"]))
        .unwrap();
        assert!(out.contains("REVISION: 2"), "{out}");
        let new_holder = wait_for("the upgraded operator to take the Lease", 90, || {
            leader().filter(|h| *h != pod)
        });
        assert_eq!(uids(&owned), before, "the upgrade recreated owned objects");
        k(&[
            "patch",
            "-n",
            &ns,
            "dsd",
            "rbac-probe",
            "--type=merge",
            "-p",
            r#"{"spec":{"engine":{"image":"dspark/engine:upgraded"}}}"#,
        ])
        .unwrap();
        wait_for("the upgraded operator to roll the engine image", 60, || {
            k(&[
                "get",
                "-n",
                &ns,
                "deployment/rbac-probe-a100",
                "-o",
                "jsonpath={.spec.template.spec.containers[0].image}",
            ])
            .ok()
            .filter(|i| i == "dspark/engine:upgraded")
        });
        assert_eq!(uids(&owned), before);
        eprintln!(
            "[{:.1}s] upgraded: {new_holder} leads and reconciles the live deployment",
            t0.elapsed().as_secs_f64()
        );

        k(&[
            "delete",
            "-n",
            &ns,
            "dsd",
            "rbac-probe",
            "--wait=true",
            "--timeout=60s",
        ])
        .unwrap();
        run(&mut uninstall("90s")).unwrap();
        wait_for("the operator pod to go", 60, || {
            k(&[
                "get",
                "pods",
                "-n",
                &ns,
                "-l",
                "app.kubernetes.io/name=dspark-operator",
                "-o",
                "name",
            ])
            .ok()
            .filter(|s| s.trim().is_empty())
        });
        let left = k(&[
            "get",
            "deploy,sa,role,rolebinding,service,networkpolicy",
            "-n",
            &ns,
            "-l",
            "app.kubernetes.io/instance=chart-test",
            "-o",
            "name",
        ])
        .unwrap();
        assert!(left.trim().is_empty(), "left after uninstall: {left}");
        let cluster_left = k(&[
            "get",
            "clusterrole,clusterrolebinding",
            "-l",
            "app.kubernetes.io/instance=chart-test",
            "-o",
            "name",
        ])
        .unwrap();
        assert!(
            cluster_left.trim().is_empty(),
            "left after uninstall: {cluster_left}"
        );
        // Helm convention: the CRDs stay.
        k(&[
            "get",
            "crd",
            "dsparkdeployments.serving.dspark.dev",
            "dsparkcosttables.serving.dspark.dev",
        ])
        .unwrap();
        eprintln!(
            "[{:.1}s] uninstalled; only the CRDs remain",
            t0.elapsed().as_secs_f64()
        );
    });
    let _ = uninstall("60s").output();
    let _ = k(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"]);
    if !shared_kubelet {
        let _ = k(&[
            "label",
            "node",
            "-l",
            "dspark.dev/chart-test=true",
            "dspark.dev/chart-test-",
        ]);
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    // Passed: the kubelet's directory (pod logs) is only worth keeping after a failure.
    drop(_kubelet);
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("dspark-chart-kubelet-{}", std::process::id())),
    );
    let _ = std::fs::remove_file(std::env::temp_dir().join(format!("{ns}-dsd.yaml")));
    eprintln!("chart test took {:.1}s", t0.elapsed().as_secs_f64());
}
