//! One pod: its volumes materialised under a per-pod directory, one supervised container per
//! container of the spec (its image run by the OCI runtime, see `oci`), HTTP/TCP probes against the pod's loopback IP, and the pod
//! status written back to the apiserver. Deletion stops the processes (SIGTERM, SIGKILL after
//! the grace period) and removes the pod (grace 0).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus, KeyToPath, ObjectFieldSelector, PersistentVolume,
    PersistentVolumeClaim, Pod, Probe, Secret, Service, ServiceAccount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::oci::{self, Bind, OciRun, PullError};
use crate::rewrite;

/// Where the service-account token is mounted in containers.
pub const SA_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Where containers under the OCI runtime find the kubeconfig of their ServiceAccount.
const KUBECONFIG_MOUNT: &str = "/var/run/dspark-test-kubelet/kubeconfig";

/// Settings shared by every pod.
pub struct Shared {
    pub client: Client,
    pub state_dir: PathBuf,
    /// The apiserver URL given to pods (kubeconfig) and its host/port (in-cluster env).
    pub apiserver_url: String,
    pub max_grace: i64,
    pub pass_env: Vec<String>,
    /// Runs every container from its image.
    pub oci: oci::Runtime,
}

/// Why a pod's processes must stop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// The pod is being deleted: stop within this grace (seconds), then remove the pod.
    Delete(i64),
    /// The kubelet is shutting down: stop the processes, leave the pod.
    Shutdown,
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// A container state: waiting for `reason`.
fn waiting(reason: &str, message: Option<String>) -> Option<ContainerState> {
    Some(ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message,
        }),
        ..Default::default()
    })
}

/// The status of container `c` before it runs: not ready, never restarted, waiting for
/// `reason`.
fn not_started(c: &Container, reason: &str) -> ContainerStatus {
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone().unwrap_or_default(),
        image_id: String::new(),
        ready: false,
        restart_count: 0,
        state: waiting(reason, None),
        ..Default::default()
    }
}

/// Runs `pod` until it is deleted (or the kubelet stops).
pub async fn run_pod(
    shared: Arc<Shared>,
    pod: Pod,
    ip: Ipv4Addr,
    host_ip: String,
    mut stop: watch::Receiver<Option<Stop>>,
) {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let uid = pod.uid().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &ns);
    let dir = shared
        .state_dir
        .join("pods")
        .join(format!("{ns}_{name}_{}", &uid[..uid.len().min(8)]));
    let spec = pod.spec.clone().unwrap_or_default();
    let restart = spec
        .restart_policy
        .clone()
        .unwrap_or_else(|| "Always".into());
    let mut status = PodView {
        ip: ip.to_string(),
        host_ip,
        start: now(),
        containers: spec
            .containers
            .iter()
            .map(|c| ContainerStatus {
                started: Some(false),
                ..not_started(c, "ContainerCreating")
            })
            .collect(),
        init: spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| not_started(c, "PodInitializing"))
            .collect(),
        done: vec![false; spec.containers.len()],
        phase: "Pending".into(),
        message: None,
        reason: None,
    };
    status.write(&api, &name).await;

    // Set up the containers; a failed set-up is retried (a missing ConfigMap, a Service
    // without ready pods yet), except for pods that never restart, which fail after a minute.
    let first = std::time::Instant::now();
    let mut pull_failures = 0u32;
    let prepared = loop {
        match prepare(&shared, &pod, &dir, ip, &status.host_ip).await {
            Ok(p) => break Some(p),
            Err(e) => {
                let msg = format!("{e:#}");
                warn!(pod = %format!("{ns}/{name}"), "set-up failed: {msg}");
                // An image that cannot be pulled marks its containers (ErrImagePull, then
                // ImagePullBackOff while waiting for the next try); anything else marks all.
                let pull = e.chain().find_map(|x| x.downcast_ref::<PullError>());
                let reason = if pull.is_some() {
                    "ErrImagePull"
                } else {
                    "CreateContainerConfigError"
                };
                for c in status.containers.iter_mut().chain(status.init.iter_mut()) {
                    if pull.is_none_or(|p| p.image == c.image) {
                        c.state = waiting(reason, Some(msg.clone()));
                    }
                }
                if restart == "Never" && first.elapsed() > Duration::from_secs(60) {
                    status.phase = "Failed".into();
                    status.reason = Some(reason.into());
                    status.message = Some(msg);
                    status.write(&api, &name).await;
                    break None;
                }
                status.write(&api, &name).await;
                // Back off (3 s, doubling to 20 s for pulls, as a kubelet's image back-off).
                let wait = match pull {
                    Some(p) => {
                        pull_failures += 1;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        for c in status.containers.iter_mut().chain(status.init.iter_mut()) {
                            if c.image == p.image {
                                c.state = waiting(
                                    "ImagePullBackOff",
                                    Some(format!(
                                        "Back-off pulling image {:?}: {}",
                                        p.image, p.message
                                    )),
                                );
                            }
                        }
                        status.write(&api, &name).await;
                        Duration::from_secs((3u64 << pull_failures.min(3)).min(20))
                    }
                    None => Duration::from_secs(3),
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => {}
                }
                if stop.borrow().is_some() {
                    break None;
                }
            }
        }
    };

    let (tx, mut rx) = mpsc::channel::<(usize, ContainerStatus, bool)>(64);
    let mut running = 0;
    let mut refresher = None;
    if let Some((inits, prepared)) = prepared {
        info!(pod = %format!("{ns}/{name}"), %ip, dir = %dir.display(), "starting");
        let (client, pod, dir) = (shared.client.clone(), pod.clone(), dir.clone());
        refresher = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if let Err(e) = refresh_volumes(&client, &pod, &dir).await {
                    warn!(pod = %pod.name_any(), "refreshing volumes: {e:#}");
                }
            }
        }));
        // Init containers, one after the other, each to success (retried with back-off
        // unless the pod never restarts); the containers start only after all of them.
        let mut initialized = true;
        for (i, c) in inits.into_iter().enumerate() {
            let c = Arc::new(ContainerRun {
                idx: i,
                restart_policy: if restart == "Never" {
                    "Never"
                } else {
                    "OnFailure"
                }
                .into(),
                ip,
                pgid_dir: shared.state_dir.join("pgids"),
                max_grace: shared.max_grace,
                ..c
            });
            let (itx, mut irx) = mpsc::channel::<(usize, ContainerStatus, bool)>(16);
            tokio::spawn(supervise(c, stop.clone(), itx));
            let mut ok = false;
            while let Some((_, cs, done)) = irx.recv().await {
                ok = cs
                    .state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.exit_code == 0);
                status.init[i] = cs;
                if stop.borrow().is_none() {
                    status.write(&api, &name).await;
                }
                if done {
                    break;
                }
            }
            if !ok || stop.borrow().is_some() {
                initialized = false;
                break;
            }
        }
        if !initialized && restart == "Never" && stop.borrow().is_none() {
            status.phase = "Failed".into();
            status.reason = Some("InitContainerFailed".into());
            status.write(&api, &name).await;
        }
        for (i, c) in prepared.into_iter().enumerate().filter(|_| initialized) {
            let c = Arc::new(ContainerRun {
                idx: i,
                restart_policy: restart.clone(),
                ip,
                pgid_dir: shared.state_dir.join("pgids"),
                max_grace: shared.max_grace,
                ..c
            });
            tokio::spawn(supervise(c, stop.clone(), tx.clone()));
            running += 1;
        }
    }
    drop(tx);
    while running > 0 {
        let Some((i, cs, done)) = rx.recv().await else {
            break;
        };
        status.containers[i] = cs;
        if done {
            status.done[i] = true;
            running -= 1;
        }
        let why = *stop.borrow();
        if why == Some(Stop::Shutdown) {
            continue;
        }
        status.update_phase(why.is_some());
        status.write(&api, &name).await;
    }

    if let Some(r) = refresher {
        r.abort();
    }
    // Everything has exited: wait for the deletion (or the shutdown), then remove the pod.
    while stop.borrow().is_none() {
        if stop.changed().await.is_err() {
            return;
        }
    }
    let why = *stop.borrow();
    if let Some(Stop::Delete(_)) = why {
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(&name, &dp).await {
            Ok(_) => info!(pod = %format!("{ns}/{name}"), "deleted"),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => warn!(pod = %format!("{ns}/{name}"), "delete failed: {e}"),
        }
    }
}

/// The pod status this kubelet writes.
struct PodView {
    ip: String,
    host_ip: String,
    start: Time,
    containers: Vec<ContainerStatus>,
    init: Vec<ContainerStatus>,
    done: Vec<bool>,
    phase: String,
    reason: Option<String>,
    message: Option<String>,
}

impl PodView {
    fn update_phase(&mut self, stopping: bool) {
        if self.done.iter().all(|d| *d) {
            let ok = self.containers.iter().all(|c| {
                c.state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.exit_code == 0)
            });
            self.phase = if ok { "Succeeded" } else { "Failed" }.into();
        } else if self
            .containers
            .iter()
            .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            || self.containers.iter().any(|c| c.restart_count > 0)
        {
            self.phase = "Running".into();
        }
        if stopping {
            for c in &mut self.containers {
                c.ready = false;
            }
        }
    }

    async fn write(&self, api: &Api<Pod>, name: &str) {
        let all_ready = self.containers.iter().all(|c| c.ready);
        let running = self.phase == "Running";
        let cond = |t: &str, ok: bool| {
            json!({
                "type": t,
                "status": if ok { "True" } else { "False" },
                "lastTransitionTime": self.start,
            })
        };
        let started = self.phase != "Pending";
        let initialized = self.init.iter().all(|c| {
            c.state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some_and(|t| t.exit_code == 0)
        });
        let patch = json!({
            "status": {
                "phase": self.phase,
                "reason": self.reason,
                "message": self.message,
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "hostIP": self.host_ip,
                "hostIPs": [{"ip": self.host_ip}],
                "startTime": self.start,
                "conditions": [
                    cond("PodScheduled", true),
                    cond("Initialized", initialized),
                    cond("PodReadyToStartContainers", started),
                    cond("ContainersReady", all_ready && running),
                    cond("Ready", all_ready && running),
                ],
                "containerStatuses": self.containers,
                "initContainerStatuses": self.init,
            }
        });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => warn!(pod = name, "status update failed: {e}"),
        }
    }
}

/// What one container needs to run.
struct ContainerRun {
    idx: usize,
    name: String,
    image: String,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    log: PathBuf,
    termination_file: PathBuf,
    fallback_to_logs: bool,
    restart_policy: String,
    ip: Ipv4Addr,
    ports: BTreeMap<String, i32>,
    startup: Option<Probe>,
    readiness: Option<Probe>,
    liveness: Option<Probe>,
    pgid_dir: PathBuf,
    max_grace: i64,
    /// The container (its `program` is the OCI runtime).
    oci: OciRun,
    /// What the status reports as `imageID`.
    image_id: String,
}

async fn field_value(pod: &Pod, path: &str, ip: Ipv4Addr, host_ip: &str) -> Option<String> {
    let label = |prefix: &str, map: Option<&BTreeMap<String, String>>| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?.to_string();
        map?.get(&key).cloned()
    };
    Some(match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        "spec.nodeName" => pod.spec.as_ref()?.node_name.clone()?,
        "spec.serviceAccountName" => pod
            .spec
            .as_ref()?
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into()),
        "status.podIP" | "status.podIPs" => ip.to_string(),
        "status.hostIP" | "status.hostIPs" => host_ip.to_string(),
        p if p.starts_with("metadata.labels['") => {
            label("metadata.labels['", pod.metadata.labels.as_ref())?
        }
        p if p.starts_with("metadata.annotations['") => {
            label("metadata.annotations['", pod.metadata.annotations.as_ref())?
        }
        _ => return None,
    })
}

/// Writes `bytes` to `path` when they differ from what is there, atomically (a reader
/// polling the file never sees half of it).
fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Re-reads the ConfigMap and Secret volumes of a running pod (a kubelet propagates their
/// updates, e.g. a cost table stored after the pod started).
async fn refresh_volumes(client: &Client, pod: &Pod, dir: &Path) -> anyhow::Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let vdir = dir.join("volumes").join(&v.name);
        if let Some(cm) = &v.config_map {
            let data = key_data::<ConfigMap>(client, &ns, &cm.name, true).await?;
            write_items(&vdir, &data, cm.items.as_ref())?;
        } else if let Some(sec) = &v.secret {
            let name = sec.secret_name.clone().unwrap_or_default();
            let data = key_data::<Secret>(client, &ns, &name, true).await?;
            write_items(&vdir, &data, sec.items.as_ref())?;
        }
    }
    Ok(())
}

/// Writes `data` (key -> bytes) into `dir`, all keys or the listed `items`.
fn write_items(
    dir: &Path,
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&Vec<KeyToPath>>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    match items {
        Some(items) => {
            for it in items {
                let v = data
                    .get(&it.key)
                    .ok_or_else(|| anyhow!("key {} is missing", it.key))?;
                write_file(&dir.join(&it.path), v)?;
            }
        }
        None => {
            for (k, v) in data {
                write_file(&dir.join(k), v)?;
            }
        }
    }
    Ok(())
}

/// The keys of a ConfigMap or Secret with their bytes.
trait KeyData:
    kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + k8s_openapi::Resource
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
    fn key_data(self) -> BTreeMap<String, Vec<u8>>;
}

impl KeyData for ConfigMap {
    fn key_data(self) -> BTreeMap<String, Vec<u8>> {
        let mut out: BTreeMap<String, Vec<u8>> = self
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .collect();
        for (k, v) in self.binary_data.unwrap_or_default() {
            out.insert(k, v.0);
        }
        out
    }
}

impl KeyData for Secret {
    fn key_data(self) -> BTreeMap<String, Vec<u8>> {
        self.data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect()
    }
}

/// The data of the `K` (ConfigMap or Secret) `ns/name`; empty when there is none and it is
/// `optional`.
async fn key_data<K: KeyData>(
    client: &Client,
    ns: &str,
    name: &str,
    optional: bool,
) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    match api.get_opt(name).await? {
        Some(o) => Ok(o.key_data()),
        None if optional => Ok(BTreeMap::new()),
        None => bail!(
            "{} {ns}/{name} not found",
            <K as k8s_openapi::Resource>::KIND
        ),
    }
}

async fn sa_token(client: &Client, pod: &Pod, expiration: i64) -> anyhow::Result<String> {
    let ns = pod.namespace().unwrap_or_default();
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            attestations: None,
            expiration_seconds: Some(expiration.max(86_400)),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
        }),
        ..Default::default()
    };
    let r = api
        .create_token_request(&sa, &PostParams::default(), &tr)
        .await
        .with_context(|| format!("requesting a token for ServiceAccount {ns}/{sa}"))?;
    Ok(r.status.and_then(|s| s.token).unwrap_or_default())
}

/// Materialises every volume of the pod; returns volume name -> host path.
async fn volumes(
    client: &Client,
    pod: &Pod,
    dir: &Path,
    ip: Ipv4Addr,
    host_ip: &str,
) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let ns = pod.namespace().unwrap_or_default();
    let mut out = BTreeMap::new();
    for v in pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default()
    {
        let vdir = dir.join("volumes").join(&v.name);
        let path = if let Some(hp) = &v.host_path {
            let p = PathBuf::from(&hp.path);
            match hp.type_.as_deref() {
                Some("DirectoryOrCreate") => std::fs::create_dir_all(&p)?,
                Some("FileOrCreate") if !p.exists() => write_file(&p, b"")?,
                _ if !p.exists() => bail!("hostPath {} does not exist", hp.path),
                _ => {}
            }
            p
        } else if v.empty_dir.is_some() {
            std::fs::create_dir_all(&vdir)?;
            vdir
        } else if let Some(cm) = &v.config_map {
            let data =
                key_data::<ConfigMap>(client, &ns, &cm.name, cm.optional == Some(true)).await?;
            write_items(&vdir, &data, cm.items.as_ref())?;
            vdir
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let data = key_data::<Secret>(client, &ns, &name, s.optional == Some(true)).await?;
            write_items(&vdir, &data, s.items.as_ref())?;
            vdir
        } else if let Some(d) = &v.downward_api {
            std::fs::create_dir_all(&vdir)?;
            for it in d.items.iter().flatten() {
                if let Some(ObjectFieldSelector { field_path, .. }) = &it.field_ref {
                    let val = field_value(pod, field_path, ip, host_ip)
                        .await
                        .unwrap_or_default();
                    write_file(&vdir.join(&it.path), val.as_bytes())?;
                }
            }
            vdir
        } else if let Some(p) = &v.projected {
            std::fs::create_dir_all(&vdir)?;
            for src in p.sources.iter().flatten() {
                if let Some(t) = &src.service_account_token {
                    let token = sa_token(client, pod, t.expiration_seconds.unwrap_or(3600)).await?;
                    write_file(&vdir.join(&t.path), token.as_bytes())?;
                }
                if let Some(cm) = &src.config_map {
                    let data =
                        key_data::<ConfigMap>(client, &ns, &cm.name, cm.optional == Some(true))
                            .await?;
                    write_items(&vdir, &data, cm.items.as_ref())?;
                }
                if let Some(s) = &src.secret {
                    let data =
                        key_data::<Secret>(client, &ns, &s.name, s.optional == Some(true)).await?;
                    write_items(&vdir, &data, s.items.as_ref())?;
                }
                if let Some(d) = &src.downward_api {
                    for it in d.items.iter().flatten() {
                        if let Some(f) = &it.field_ref {
                            let val = field_value(pod, &f.field_path, ip, host_ip)
                                .await
                                .unwrap_or_default();
                            write_file(&vdir.join(&it.path), val.as_bytes())?;
                        }
                    }
                }
            }
            vdir
        } else if let Some(img) = &v.image {
            image_volume(img.reference.as_deref().unwrap_or_default(), &vdir).await?
        } else if let Some(pvc) = &v.persistent_volume_claim {
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
            let c = claims.get(&pvc.claim_name).await?;
            let pv_name = c
                .spec
                .and_then(|s| s.volume_name)
                .ok_or_else(|| anyhow!("PVC {} is not bound", pvc.claim_name))?;
            let pv = Api::<PersistentVolume>::all(client.clone())
                .get(&pv_name)
                .await?;
            let spec = pv.spec.unwrap_or_default();
            PathBuf::from(
                spec.host_path
                    .map(|h| h.path)
                    .or(spec.local.map(|l| l.path))
                    .ok_or_else(|| anyhow!("PV {pv_name} is neither hostPath nor local"))?,
            )
        } else {
            bail!("volume {}: unsupported volume type", v.name);
        };
        out.insert(v.name.clone(), path);
    }
    Ok(out)
}

/// An image volume (Kubernetes 1.33+, `volumes[].image`): the image's files, no command.
/// Pulled from its registry (loopback only; plain HTTP, as the test registry serves) by
/// `skopeo` into an OCI layout and its layers unpacked by `umoci`, once per pod; returns the
/// unpacked root file system. A pull that fails keeps the pod in its set-up retries with
/// the tool's message, as a kubelet's ErrImagePull would.
async fn image_volume(reference: &str, vdir: &Path) -> anyhow::Result<PathBuf> {
    anyhow::ensure!(!reference.is_empty(), "image volume without a reference");
    if let Some(host) = rewrite::non_loopback_url(&format!("docker://{reference}")) {
        bail!("image volume {reference} names {host}, which is not a loopback registry");
    }
    let rootfs = vdir.join("rootfs");
    let pulled = vdir.join("pulled");
    if pulled.exists() {
        return Ok(rootfs);
    }
    let layout = vdir.join("layout");
    let _ = std::fs::remove_dir_all(vdir);
    std::fs::create_dir_all(vdir)?;
    let run = |program: &'static str, args: Vec<String>| async move {
        let out = tokio::process::Command::new(program)
            .args(&args)
            .output()
            .await
            .with_context(|| format!("{program} (is it installed?)"))?;
        anyhow::ensure!(
            out.status.success(),
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    };
    run(
        "skopeo",
        vec![
            "copy".into(),
            "-q".into(),
            "--src-tls-verify=false".into(),
            format!("docker://{reference}"),
            format!("oci:{}:volume", layout.display()),
        ],
    )
    .await
    .with_context(|| format!("pulling image volume {reference}"))?;
    run(
        "umoci",
        vec![
            "raw".into(),
            "unpack".into(),
            "--rootless".into(),
            "--image".into(),
            format!("{}:volume", layout.display()),
            rootfs.to_string_lossy().into_owned(),
        ],
    )
    .await
    .with_context(|| format!("unpacking image volume {reference}"))?;
    let _ = std::fs::remove_dir_all(&layout);
    write_file(&pulled, reference.as_bytes())?;
    Ok(rootfs)
}

/// Replaces `<svc>.<ns>.svc[:port]` with the IP (and target port) of a ready pod of that
/// Service: nothing here can resolve cluster DNS, and a lookup must not leave loopback.
async fn resolve_services(client: &Client, arg: &str) -> anyhow::Result<String> {
    let hosts = rewrite::service_hosts(arg);
    if hosts.is_empty() {
        return Ok(arg.to_string());
    }
    let mut out = String::new();
    let mut last = 0;
    for (start, end, svc, ns, port) in hosts {
        let s = Api::<Service>::namespaced(client.clone(), &ns)
            .get(&svc)
            .await
            .with_context(|| format!("Service {ns}/{svc}"))?;
        let spec = s.spec.unwrap_or_default();
        let selector = spec
            .selector
            .unwrap_or_default()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let pods = Api::<Pod>::namespaced(client.clone(), &ns)
            .list(&ListParams::default().labels(&selector))
            .await?;
        let ready = pods.items.iter().find(|p| {
            p.status.as_ref().is_some_and(|st| {
                st.pod_ip.is_some()
                    && st
                        .conditions
                        .iter()
                        .flatten()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        });
        let Some(target) = ready else {
            bail!("Service {ns}/{svc} has no ready pod yet");
        };
        let ip = target
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        out.push_str(&arg[last..start]);
        out.push_str(&ip);
        last = end;
        if let Some(port) = port {
            let sp = spec
                .ports
                .iter()
                .flatten()
                .find(|p| p.port == i32::from(port));
            let target_port = match sp.and_then(|p| p.target_port.clone()) {
                Some(IntOrString::Int(n)) => n,
                Some(IntOrString::String(name)) => target
                    .spec
                    .iter()
                    .flat_map(|s| s.containers.iter())
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .map(|p| p.container_port)
                    .ok_or_else(|| anyhow!("Service {ns}/{svc}: no container port {name}"))?,
                None => i32::from(port),
            };
            out.push_str(&format!(":{target_port}"));
            last = end + 1 + port.to_string().len();
        }
    }
    out.push_str(&arg[last..]);
    Ok(out)
}

/// Sets the group of `path` and everything under it (symlinks themselves, not their targets).
fn chown_tree(path: &Path, gid: u32) -> anyhow::Result<()> {
    std::os::unix::fs::lchown(path, None, Some(gid))
        .with_context(|| format!("chown {}", path.display()))?;
    if path.is_dir() && !path.is_symlink() {
        for e in std::fs::read_dir(path)? {
            chown_tree(&e?.path(), gid)?;
        }
    }
    Ok(())
}

/// Builds every container's command line, environment and paths: (init containers, containers).
async fn prepare(
    shared: &Shared,
    pod: &Pod,
    dir: &Path,
    ip: Ipv4Addr,
    host_ip: &str,
) -> anyhow::Result<(Vec<ContainerRun>, Vec<ContainerRun>)> {
    let client = &shared.client;
    let ns = pod.namespace().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    std::fs::create_dir_all(dir.join("home"))?;
    let vols = volumes(client, pod, dir, ip, host_ip).await?;
    // Containers run as their users: the pod's own volumes are group-owned by `fsGroup` (as a
    // kubelet's volume ownership management does); emptyDirs are 0777.
    let fs_group = spec.security_context.as_ref().and_then(|s| s.fs_group);
    for v in spec.volumes.iter().flatten() {
        let Some(path) = vols.get(&v.name) else {
            continue;
        };
        if v.empty_dir.is_some() {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))?;
        }
        let own = v.empty_dir.is_some()
            || v.config_map.is_some()
            || v.secret.is_some()
            || v.projected.is_some()
            || v.downward_api.is_some();
        if let (true, Some(g)) = (own, fs_group) {
            chown_tree(path, u32::try_from(g).unwrap_or(0))?;
        }
    }
    let api_url = shared.apiserver_url.trim_end_matches('/');
    let (api_host, api_port) = api_url
        .trim_start_matches("https://")
        .rsplit_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .unwrap_or_else(|| ("127.0.0.1".into(), "443".into()));
    let mut inits = Vec::new();
    for c in spec.init_containers.iter().flatten() {
        inits.push(
            prepare_container(
                shared, pod, c, dir, ip, host_ip, &vols, &ns, api_url, &api_host, &api_port,
            )
            .await
            .with_context(|| format!("init container {}", c.name))?,
        );
    }
    let mut out = Vec::new();
    for c in &spec.containers {
        out.push(
            prepare_container(
                shared, pod, c, dir, ip, host_ip, &vols, &ns, api_url, &api_host, &api_port,
            )
            .await
            .with_context(|| format!("container {}", c.name))?,
        );
    }
    Ok((inits, out))
}

#[allow(clippy::too_many_arguments)]
async fn prepare_container(
    shared: &Shared,
    pod: &Pod,
    c: &Container,
    dir: &Path,
    ip: Ipv4Addr,
    host_ip: &str,
    vols: &BTreeMap<String, PathBuf>,
    ns: &str,
    api_url: &str,
    api_host: &str,
    api_port: &str,
) -> anyhow::Result<ContainerRun> {
    let client = &shared.client;
    let image_ref = c.image.clone().unwrap_or_default();
    // The image is pulled first: its env, user and entrypoint count.
    let rt = &shared.oci;
    let img = oci::pull(&image_ref, &rt.images).await?;
    // Containers see the volumes bind-mounted at their mount paths.
    let mut binds = Vec::new();
    let mut sa_dir = None;
    for m in c.volume_mounts.iter().flatten() {
        let base = vols
            .get(&m.name)
            .ok_or_else(|| anyhow!("volumeMount of unknown volume {}", m.name))?;
        let host = match m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            Some(sub) => base.join(sub),
            None => base.clone(),
        };
        binds.push(Bind {
            destination: m.mount_path.clone(),
            source: host.clone(),
            readonly: m.read_only == Some(true),
        });
        if m.mount_path.trim_end_matches('/') == SA_MOUNT {
            sa_dir = Some(host);
        }
    }
    let term_file = dir.join(format!("{}.termination-log", c.name));
    let term_path = c
        .termination_message_path
        .clone()
        .unwrap_or_else(|| "/dev/termination-log".into());
    binds.push(Bind {
        destination: term_path,
        source: term_file.clone(),
        readonly: false,
    });

    // Environment: a clean one (the kubelet's own credentials never leak into pods), the
    // image's variables first.
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut set = |env: &mut BTreeMap<String, String>, k: &str, v: String| {
        if !order.iter().any(|o| o == k) {
            order.push(k.to_string());
        }
        env.insert(k.to_string(), v);
    };
    set(
        &mut env,
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    for l in img.config.env.iter().flatten() {
        let (k, v) = l.split_once('=').unwrap_or((l, ""));
        set(&mut env, k, v.to_string());
    }
    if !env.contains_key("HOME") {
        set(&mut env, "HOME", "/".into());
    }
    set(&mut env, "HOSTNAME", pod.name_any());
    set(&mut env, "KUBERNETES_SERVICE_HOST", api_host.to_string());
    set(&mut env, "KUBERNETES_SERVICE_PORT", api_port.to_string());
    for k in &shared.pass_env {
        if let Ok(v) = std::env::var(k) {
            set(&mut env, k, v);
        }
    }
    if sa_dir.is_some() {
        // kube clients read in-cluster credentials from a fixed path and a Service address
        // that does not exist here; give them a kubeconfig with the pod's own ServiceAccount
        // token instead (so RBAC is really exercised).
        let kc = dir.join(format!("{}.kubeconfig", c.name));
        let (ca, token) = (
            Path::new(SA_MOUNT).join("ca.crt"),
            Path::new(SA_MOUNT).join("token"),
        );
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {api_url}\n    certificate-authority: {ca}\nusers:\n- name: u\n  user:\n    tokenFile: {token}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n    namespace: {ns}\ncurrent-context: c\n",
            ca = ca.display(),
            token = token.display(),
        );
        write_file(&kc, text.as_bytes())?;
        binds.push(Bind {
            destination: KUBECONFIG_MOUNT.into(),
            source: kc,
            readonly: true,
        });
        set(&mut env, "KUBECONFIG", KUBECONFIG_MOUNT.into());
    }
    // envFrom first (each key of the Secret / ConfigMap, with the prefix), then env, which
    // wins on a clash: the kubelet's order.
    for from in c.env_from.iter().flatten() {
        let data = if let Some(r) = &from.secret_ref {
            key_data::<Secret>(client, ns, &r.name, r.optional == Some(true)).await?
        } else if let Some(r) = &from.config_map_ref {
            key_data::<ConfigMap>(client, ns, &r.name, r.optional == Some(true)).await?
        } else {
            continue;
        };
        let prefix = from.prefix.as_deref().unwrap_or_default();
        for (k, v) in data {
            set(
                &mut env,
                &format!("{prefix}{k}"),
                String::from_utf8_lossy(&v).into_owned(),
            );
        }
    }
    for e in c.env.iter().flatten() {
        let value = if let Some(v) = &e.value {
            rewrite::expand(v, &env)
        } else if let Some(from) = &e.value_from {
            if let Some(f) = &from.field_ref {
                field_value(pod, &f.field_path, ip, host_ip)
                    .await
                    .unwrap_or_default()
            } else if let Some(r) = &from.config_map_key_ref {
                let d =
                    key_data::<ConfigMap>(client, ns, &r.name, r.optional == Some(true)).await?;
                d.get(&r.key)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default()
            } else if let Some(r) = &from.secret_key_ref {
                let d = key_data::<Secret>(client, ns, &r.name, r.optional == Some(true)).await?;
                d.get(&r.key)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default()
            } else {
                String::new()
            }
        } else {
            String::new()
        };
        let value = rewrite::bind_to_pod_ip(&value, &ip.to_string());
        set(&mut env, &e.name, value);
    }
    let env: Vec<(String, String)> = order.iter().map(|k| (k.clone(), env[k].clone())).collect();

    // The command line: the Kubernetes rule over the image's entrypoint and cmd.
    let raw_args = oci::process_args(&img.config, c.command.as_deref(), c.args.as_deref())?;
    let env_map: BTreeMap<String, String> = env.iter().cloned().collect();
    let mut args = Vec::new();
    for a in &raw_args {
        let a = rewrite::expand(a, &env_map);
        let a = resolve_services(client, &a).await?;
        let a = rewrite::bind_to_pod_ip(&a, &ip.to_string());
        if let Some(host) = rewrite::non_loopback_url(&a) {
            bail!("argument {a:?} names {host}, which is not a loopback address");
        }
        args.push(a);
    }
    let ports = c
        .ports
        .iter()
        .flatten()
        .filter_map(|p| Some((p.name.clone()?, p.container_port)))
        .collect();
    // The container's bundle: config.json from the pod spec over umoci's config for the image.
    let pod_sc = pod.spec.as_ref().and_then(|s| s.security_context.clone());
    let sc = c.security_context.clone().unwrap_or_default();
    let (uid, gid) = oci::user(
        img.config.user.as_deref(),
        sc.run_as_user
            .or(pod_sc.as_ref().and_then(|p| p.run_as_user)),
        sc.run_as_group
            .or(pod_sc.as_ref().and_then(|p| p.run_as_group)),
        &img.rootfs,
    )?;
    let non_root = sc
        .run_as_non_root
        .or(pod_sc.as_ref().and_then(|p| p.run_as_non_root));
    if non_root == Some(true) && uid == 0 {
        bail!("container has runAsNonRoot and image will run as root");
    }
    let mut additional_gids: Vec<u32> = pod_sc
        .as_ref()
        .and_then(|p| p.fs_group)
        .into_iter()
        .chain(
            pod_sc
                .as_ref()
                .and_then(|p| p.supplemental_groups.clone())
                .into_iter()
                .flatten(),
        )
        .filter_map(|g| u32::try_from(g).ok())
        .collect();
    additional_gids.dedup();
    let bundle = dir.join(format!("{}.bundle", c.name));
    let readonly_root = sc.read_only_root_filesystem == Some(true);
    let rootfs = if readonly_root {
        img.rootfs.clone()
    } else {
        oci::private_rootfs(&img, &bundle).await?
    };
    let caps = sc.capabilities.as_ref().map(|k| {
        let defaults: Vec<String> = img.base["process"]["capabilities"]["bounding"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        oci::capabilities(
            &defaults,
            k.drop.as_deref().unwrap_or_default(),
            k.add.as_deref().unwrap_or_default(),
        )
    });
    let spec = oci::RunSpec {
        args,
        env,
        cwd: c
            .working_dir
            .clone()
            .or(img.config.working_dir.clone())
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| "/".into()),
        uid,
        gid,
        additional_gids,
        rootfs,
        readonly_root,
        binds,
        hostname: pod.name_any(),
        no_new_privileges: sc.allow_privilege_escalation == Some(false),
        capabilities: caps,
    };
    oci::write_bundle(&bundle, &oci::bundle_config(&img.base, &spec))?;
    let o = OciRun {
        runtime: rt.program.clone(),
        root: rt.root.clone(),
        id: oci::container_id(&pod.uid().unwrap_or_default(), &c.name),
        bundle,
    };
    Ok(ContainerRun {
        name: c.name.clone(),
        image: image_ref.clone(),
        image_id: img.pinned.clone(),
        program: rt.program.clone(),
        args: o.run_args(),
        // The runtime itself gets the kubelet's PATH only; the container's env is in the bundle.
        env: vec![(
            "PATH".into(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
        )],
        cwd: dir.to_path_buf(),
        log: dir.join(format!("{}.log", c.name)),
        termination_file: term_file,
        fallback_to_logs: c.termination_message_policy.as_deref() == Some("FallbackToLogsOnError"),
        ports,
        startup: c.startup_probe.clone(),
        readiness: c.readiness_probe.clone(),
        liveness: c.liveness_probe.clone(),
        oci: o,
        // Filled in by run_pod.
        idx: 0,
        restart_policy: String::new(),
        ip,
        pgid_dir: PathBuf::new(),
        max_grace: 0,
    })
}

/// One probe's bookkeeping.
struct ProbeState {
    probe: Probe,
    next: Instant,
    successes: i32,
    failures: i32,
}

impl ProbeState {
    fn new(p: &Probe, from: Instant) -> Self {
        Self {
            probe: p.clone(),
            next: from + Duration::from_secs(p.initial_delay_seconds.unwrap_or(0).max(0) as u64),
            successes: 0,
            failures: 0,
        }
    }
    fn period(&self) -> Duration {
        Duration::from_secs(self.probe.period_seconds.unwrap_or(10).max(1) as u64)
    }
    /// Records a result; `Some(true)` once successThreshold is reached, `Some(false)` once
    /// failureThreshold is.
    fn record(&mut self, ok: bool) -> Option<bool> {
        self.next = Instant::now() + self.period();
        if ok {
            self.failures = 0;
            self.successes += 1;
            (self.successes >= self.probe.success_threshold.unwrap_or(1).max(1)).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (self.failures >= self.probe.failure_threshold.unwrap_or(3).max(1)).then_some(false)
        }
    }
}

/// Runs a probe once against the pod IP.
async fn probe_once(p: &Probe, ip: Ipv4Addr, ports: &BTreeMap<String, i32>) -> bool {
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1) as u64);
    let port_of = |port: &IntOrString| match port {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(s) => ports.get(s).copied().or_else(|| s.parse().ok()),
    };
    let fut = async {
        if let Some(h) = &p.http_get {
            let port = port_of(&h.port)?;
            let mut s = tokio::net::TcpStream::connect((ip, port as u16))
                .await
                .ok()?;
            let path = h.path.clone().unwrap_or_else(|| "/".into());
            let req = format!(
                "GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nUser-Agent: dspark-test-kubelet\r\nConnection: close\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await.ok()?;
            let mut buf = vec![0u8; 256];
            let mut n = 0;
            while n < 16 {
                let k = s.read(&mut buf[n..]).await.ok()?;
                if k == 0 {
                    break;
                }
                n += k;
            }
            let code = rewrite::http_status(&String::from_utf8_lossy(&buf[..n]))?;
            Some((200..400).contains(&code))
        } else if let Some(t) = &p.tcp_socket {
            let port = port_of(&t.port)?;
            Some(
                tokio::net::TcpStream::connect((ip, port as u16))
                    .await
                    .is_ok(),
            )
        } else {
            // exec / grpc probes are not run: counted as passing.
            Some(true)
        }
    };
    matches!(tokio::time::timeout(timeout, fut).await, Ok(Some(true)))
}

/// Signals a container through the OCI runtime (its init process; a SIGKILL ends its PID
/// namespace).
fn signal(c: &ContainerRun, sig: i32) {
    c.oci
        .signal(if sig == libc::SIGKILL { "KILL" } else { "TERM" });
}

fn signal_group(pgid: i32, sig: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) on a process group this kubelet created; no memory is touched.
        unsafe {
            libc::kill(-pgid, sig);
        }
    }
}

/// Runs one container, restarting it per the pod's restart policy, until it is done or
/// stopped; reports each state change.
async fn supervise(
    c: Arc<ContainerRun>,
    mut stop: watch::Receiver<Option<Stop>>,
    tx: mpsc::Sender<(usize, ContainerStatus, bool)>,
) {
    let mut restarts = 0;
    let mut last_state: Option<ContainerState> = None;
    let _ = std::fs::create_dir_all(&c.pgid_dir);
    loop {
        // Writable by the container's user, as a kubelet's termination-log file is.
        let _ = std::fs::write(&c.termination_file, b"");
        let _ =
            std::fs::set_permissions(&c.termination_file, std::fs::Permissions::from_mode(0o666));
        c.oci.delete(); // the state of a previous run of this container, if any
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&c.log);
        let log_start = std::fs::metadata(&c.log).map(|m| m.len()).unwrap_or(0);
        let started_at = now();
        let mut status = ContainerStatus {
            name: c.name.clone(),
            image: c.image.clone(),
            image_id: c.image_id.clone(),
            restart_count: restarts,
            last_state: last_state.clone(),
            ..Default::default()
        };
        let spawned = log.map_err(anyhow::Error::from).and_then(|log| {
            let err = log.try_clone()?;
            let mut cmd = tokio::process::Command::new(&c.program);
            cmd.args(&c.args)
                .env_clear()
                .envs(c.env.iter().map(|(k, v)| (k, v)))
                .current_dir(&c.cwd)
                .stdin(std::process::Stdio::null())
                .stdout(log)
                .stderr(err)
                .process_group(0);
            Ok(cmd.spawn()?)
        });
        let mut stopped = false;
        let (code, reason, extra) = match spawned {
            Err(e) => (128, "StartError".to_string(), format!("{e:#}")),
            Ok(mut child) => {
                let pgid = child.id().unwrap_or(0) as i32;
                let pgid_file = c.pgid_dir.join(pgid.to_string());
                let _ = std::fs::write(&pgid_file, b"");
                let t0 = Instant::now();
                let mut startup = c.startup.as_ref().map(|p| ProbeState::new(p, t0));
                let mut readiness = c.readiness.as_ref().map(|p| ProbeState::new(p, t0));
                let mut liveness = c.liveness.as_ref().map(|p| ProbeState::new(p, t0));
                let mut started = startup.is_none();
                let mut ready = readiness.is_none() && started;
                let report = |status: &mut ContainerStatus, started: bool, ready: bool| {
                    status.started = Some(started);
                    status.ready = ready;
                    status.container_id = Some(format!("runc://{}", c.oci.id));
                    status.state = Some(ContainerState {
                        running: Some(ContainerStateRunning {
                            started_at: Some(started_at.clone()),
                        }),
                        ..Default::default()
                    });
                };
                report(&mut status, started, ready);
                let _ = tx.send((c.idx, status.clone(), false)).await;
                let mut killed_by_probe = None;
                let exit = loop {
                    let next = [
                        startup.as_ref().filter(|_| !started).map(|p| p.next),
                        readiness.as_ref().filter(|_| started).map(|p| p.next),
                        liveness.as_ref().filter(|_| started).map(|p| p.next),
                    ]
                    .into_iter()
                    .flatten()
                    .min()
                    .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                    tokio::select! {
                        r = child.wait() => break r.ok(),
                        _ = stop.changed() => {
                            let why = *stop.borrow();
                            if let Some(why) = why {
                                let grace = match why {
                                    Stop::Delete(g) => g.clamp(0, c.max_grace),
                                    Stop::Shutdown => 5,
                                };
                                stopped = true;
                                signal(&c, libc::SIGTERM);
                                match tokio::time::timeout(Duration::from_secs(grace as u64), child.wait()).await {
                                    Ok(r) => break r.ok(),
                                    Err(_) => {
                                        signal(&c, libc::SIGKILL);
                                        break child.wait().await.ok();
                                    }
                                }
                            }
                        }
                        _ = tokio::time::sleep_until(next) => {
                            let before = (started, ready);
                            if !started {
                                if let Some(p) = startup.as_mut() {
                                    match p.record(probe_once(&p.probe, c.ip, &c.ports).await) {
                                        Some(true) => {
                                            started = true;
                                            let now = Instant::now();
                                            if let Some(r) = readiness.as_mut() { r.next = r.next.max(now); }
                                            if let Some(l) = liveness.as_mut() { l.next = l.next.max(now); }
                                            ready = readiness.is_none();
                                        }
                                        Some(false) => killed_by_probe = Some("startup"),
                                        None => {}
                                    }
                                }
                            } else {
                                if let Some(p) = readiness.as_mut() {
                                    if Instant::now() >= p.next {
                                        if let Some(v) = p.record(probe_once(&p.probe, c.ip, &c.ports).await) {
                                            ready = v;
                                        }
                                    }
                                }
                                if let Some(p) = liveness.as_mut() {
                                    if Instant::now() >= p.next
                                        && p.record(probe_once(&p.probe, c.ip, &c.ports).await) == Some(false)
                                    {
                                        killed_by_probe = Some("liveness");
                                    }
                                }
                            }
                            if let Some(which) = killed_by_probe {
                                warn!(container = %c.name, "{which} probe failed; restarting");
                                signal(&c, libc::SIGTERM);
                                if tokio::time::timeout(Duration::from_secs(5), child.wait()).await.is_err() {
                                    signal(&c, libc::SIGKILL);
                                }
                                break child.wait().await.ok();
                            }
                            if (started, ready) != before {
                                report(&mut status, started, ready);
                                let _ = tx.send((c.idx, status.clone(), false)).await;
                            }
                        }
                    }
                };
                // Leftover children of the container die with it.
                signal_group(pgid, libc::SIGKILL);
                let _ = std::fs::remove_file(&pgid_file);
                // No pid file means the container's process never started (a missing
                // entrypoint, a mount that failed): the runtime said why.
                let never_started = !c.oci.pid_file().exists();
                c.oci.delete();
                use std::os::unix::process::ExitStatusExt;
                let code = exit
                    .map(|s| s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)))
                    .unwrap_or(137);
                if never_started && !stopped {
                    let log = std::fs::read(&c.log).unwrap_or_default();
                    let from = (log_start as usize).min(log.len());
                    let said = String::from_utf8_lossy(&log[from..]).trim().to_string();
                    (128, "StartError".to_string(), said)
                } else {
                    let reason = if code == 0 && killed_by_probe.is_none() {
                        "Completed"
                    } else {
                        "Error"
                    };
                    (code, reason.to_string(), String::new())
                }
            }
        };
        let mut message = std::fs::read(&c.termination_file)
            .map(|b| String::from_utf8_lossy(&b[..b.len().min(4096)]).into_owned())
            .unwrap_or_default();
        if message.trim().is_empty() && !extra.is_empty() {
            message = extra;
        } else if message.trim().is_empty() && c.fallback_to_logs && code != 0 {
            let log = std::fs::read(&c.log).unwrap_or_default();
            let tail = &log[log.len().saturating_sub(2048)..];
            message = String::from_utf8_lossy(tail).into_owned();
        }
        let terminated = ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: code,
                reason: Some(reason),
                message: (!message.is_empty()).then_some(message),
                started_at: Some(started_at),
                finished_at: Some(now()),
                container_id: status.container_id.clone(),
                signal: None,
            }),
            ..Default::default()
        };
        let again = !stopped
            && match c.restart_policy.as_str() {
                "Never" => false,
                "OnFailure" => code != 0,
                _ => true,
            };
        status.ready = false;
        status.started = Some(false);
        status.state = Some(terminated.clone());
        info!(container = %c.name, code, restart = again, "container exited");
        let _ = tx.send((c.idx, status.clone(), !again)).await;
        if !again {
            return;
        }
        // Back off like CrashLoopBackOff (1 s doubling, at most 20 s), unless stopped.
        let wait = Duration::from_secs((1u64 << restarts.min(5)).min(20));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {}
        }
        if stop.borrow().is_some() {
            let _ = tx.send((c.idx, status.clone(), true)).await;
            return;
        }
        restarts += 1;
        last_state = Some(terminated);
    }
}
