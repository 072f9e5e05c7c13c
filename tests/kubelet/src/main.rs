//! `dspark-test-kubelet`: a kubelet for the local test control plane (tests/cluster). It runs
//! the pods bound to the nodes matching `--node-selector` as local processes, each on a
//! loopback IP of its own taken from the node's `spec.podCIDR` (127.1.N.0/24), and writes
//! their status (pod IP, container states, Ready from the HTTP probes it runs itself, exit
//! codes and termination messages). Deleting a pod stops its processes and removes it.
//!
//! kwok keeps playing the nodes (heartbeats); it must not play pods (no pod stages).
//! Containers run FROM their images: pulled by digest from a loopback registry, unpacked, and
//! run by an OCI runtime (`--image-runtime runc|crun`) with the pod's command, env, user,
//! mounts and read-only root (module `oci`).

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod oci;
mod pod;
mod rewrite;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::DeleteParams;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{watch, Notify};
use tracing::{info, warn};

use pod::{Shared, Stop};

#[derive(Parser, Debug)]
#[command(
    name = "dspark-test-kubelet",
    about = "Runs the pods of selected fake nodes as containers FROM their images (runc) on loopback IPs"
)]
struct Args {
    /// Label selector of the nodes this kubelet plays.
    #[arg(long, default_value = "dspark.dev/test-kubelet=true")]
    node_selector: String,
    /// Per-pod directories (volumes, logs, termination messages).
    #[arg(
        long,
        env = "DSPARK_KUBELET_DIR",
        default_value = "/tmp/dspark-cluster/kubelet"
    )]
    state_dir: PathBuf,
    /// Host environment variables passed to every container (when set).
    #[arg(long = "pass-env", default_values_t = ["RUST_BACKTRACE"].map(String::from))]
    pass_env: Vec<String>,
    /// Longest grace period honoured on deletion, seconds.
    #[arg(long, default_value_t = 30)]
    max_grace_seconds: i64,
    /// The OCI runtime that runs each container FROM its image: `runc` or `crun`.
    #[arg(long, env = "DSPARK_KUBELET_IMAGE_RUNTIME", default_value = "runc",
          value_parser = ["runc", "crun"])]
    image_runtime: String,
}

/// A pod this kubelet runs.
struct Running {
    stop: watch::Sender<Option<Stop>>,
    task: tokio::task::JoinHandle<()>,
    ip: Ipv4Addr,
}

/// The pod-IP range of a node: its loopback `spec.podCIDR`, else 127.5.<index>.0/24.
/// A store of the objects `cfg` selects, kept by a watch (retried with back-off) that wakes
/// the main loop on every change; `what` names the watch in warnings.
fn watched<K>(
    client: &Client,
    cfg: watcher::Config,
    wake: &Arc<Notify>,
    what: &'static str,
) -> reflector::Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store::<K>();
    let wake = wake.clone();
    let stream = reflector(writer, watcher(Api::<K>::all(client.clone()), cfg))
        .default_backoff()
        .touched_objects();
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(r) = stream.next().await {
            if let Err(e) = r {
                warn!("{what}: {e}");
            }
            wake.notify_one();
        }
    });
    store
}

fn node_range(node: &Node, index: usize) -> (Ipv4Addr, u8) {
    node.spec
        .as_ref()
        .and_then(|s| s.pod_cidr.as_deref())
        .and_then(rewrite::loopback_cidr)
        .unwrap_or((Ipv4Addr::new(127, 5, (index % 250) as u8, 0), 24))
}

fn node_ip(node: &Node) -> String {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
        .map(|a| a.address.clone())
        .unwrap_or_else(|| "127.0.0.1".into())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .with_ansi(false)
        .init();
    let args = Args::parse();
    let config = kube::Config::infer()
        .await
        .context("no Kubernetes configuration (KUBECONFIG)")?;
    let apiserver_url = config.cluster_url.to_string();
    let client = Client::try_from(config)?;
    std::fs::create_dir_all(args.state_dir.join("pods"))?;
    let oci = oci::Runtime {
        program: args.image_runtime.clone(),
        root: args.state_dir.join("runtime"),
        images: args.state_dir.join("images"),
    };
    for t in [oci.program.as_str(), "skopeo", "umoci"] {
        let found = std::process::Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        anyhow::ensure!(
            found,
            "--image-runtime {}: {t} is not installed (apt-get install runc skopeo umoci)",
            oci.program
        );
    }
    std::fs::create_dir_all(&oci.root)?;
    std::fs::create_dir_all(&oci.images)?;
    info!(selector = %args.node_selector, runtime = %args.image_runtime, dir = %args.state_dir.display(), "test kubelet starting");
    let shared = Arc::new(Shared {
        client: client.clone(),
        state_dir: args.state_dir.clone(),
        apiserver_url,
        max_grace: args.max_grace_seconds,
        pass_env: args.pass_env.clone(),
        oci,
    });

    let wake = Arc::new(Notify::new());
    let node_cfg = watcher::Config::default().labels(&args.node_selector);
    let nodes = watched::<Node>(&client, node_cfg, &wake, "node watch");
    let pod_cfg = watcher::Config::default().fields("spec.nodeName!=");
    let pods = watched::<Pod>(&client, pod_cfg, &wake, "pod watch");

    let mut running: HashMap<String, Running> = HashMap::new();
    let mut finalizing: BTreeSet<String> = BTreeSet::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        // Reap finished pods.
        running.retain(|_, r| !r.task.is_finished());

        let node_list = nodes.state();
        let node_index: BTreeMap<String, usize> = node_list
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name_any(), i))
            .collect();
        let mut seen = BTreeSet::new();
        for p in pods.state() {
            let uid = p.uid().unwrap_or_default();
            let node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let ours = node_index.contains_key(&node);
            if !ours && !running.contains_key(&uid) {
                continue;
            }
            seen.insert(uid.clone());
            let deleting = p.metadata.deletion_timestamp.is_some();
            if let Some(r) = running.get(&uid) {
                if deleting && r.stop.borrow().is_none() {
                    let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(30);
                    info!(pod = %format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()), grace, "stopping for deletion");
                    let _ = r.stop.send(Some(Stop::Delete(grace)));
                }
                continue;
            }
            let ns = p.namespace().unwrap_or_default();
            if deleting {
                // Not running here (finished, or from before a restart): finish the deletion.
                if finalizing.insert(uid.clone()) {
                    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
                    let name = p.name_any();
                    tokio::spawn(async move {
                        let dp = DeleteParams {
                            grace_period_seconds: Some(0),
                            ..Default::default()
                        };
                        if let Err(e) = api.delete(&name, &dp).await {
                            warn!(pod = %name, "finishing the deletion: {e}");
                        }
                    });
                }
                continue;
            }
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Succeeded" || phase == "Failed" {
                continue;
            }
            let Some(n) = node_list.iter().find(|n| n.name_any() == node) else {
                continue;
            };
            let (base, bits) = node_range(n, node_index[&node]);
            let used: BTreeSet<Ipv4Addr> = running.values().map(|r| r.ip).collect();
            let Some(ip) = rewrite::allocate(base, bits, &used) else {
                warn!(node = %node, "no free pod IP left in {base}/{bits}");
                continue;
            };
            let (tx, rx) = watch::channel(None);
            let task = tokio::spawn(pod::run_pod(
                shared.clone(),
                (*p).clone(),
                ip,
                node_ip(n),
                rx,
            ));
            running.insert(uid, Running { stop: tx, task, ip });
        }
        // Pods removed behind our back (force-deleted): stop their processes.
        for (uid, r) in &running {
            if !seen.contains(uid) && r.stop.borrow().is_none() {
                let _ = r.stop.send(Some(Stop::Delete(0)));
            }
        }
        finalizing.retain(|u| seen.contains(u));
    }

    info!(
        pods = running.len(),
        "shutting down; stopping every pod's processes"
    );
    for r in running.values() {
        let _ = r.stop.send(Some(Stop::Shutdown));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for (_, r) in running {
        let _ = tokio::time::timeout_at(deadline, r.task).await;
    }
    Ok(())
}
