//! Containers run FROM their images (`--image-runtime runc`): the image is pulled by digest
//! from a loopback registry (`skopeo`) into an OCI layout cached per digest and unpacked once
//! (`umoci`); each container gets an OCI runtime bundle whose `config.json` is written from
//! the pod spec the way a CRI runtime writes it (the image's entrypoint and command under the
//! pod's `command` / `args`, the image's env under the pod's, the user from the security
//! context or the image, the pod's volumes bind-mounted at their mount paths, a read-only root
//! when asked). `runc` runs it in the host network namespace (pod IPs are loopback addresses).
//!
//! The pure parts (references, the Kubernetes command rule, users, the bundle's config) are
//! unit-tested here; the pulls and runs are exercised by `make e2e`.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context as _};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::rewrite;

/// An image that could not be pulled: the pod shows `ErrImagePull`, then `ImagePullBackOff`.
#[derive(Debug)]
pub struct PullError {
    pub image: String,
    pub message: String,
}

impl std::fmt::Display for PullError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "failed to pull image {:?}: {}", self.image, self.message)
    }
}

impl std::error::Error for PullError {}

/// The parts of an image's configuration a runtime uses (OCI image spec, `config`).
#[derive(Debug, Default, Clone, Deserialize)]
pub struct ImageConfig {
    #[serde(rename = "Entrypoint", default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    pub cmd: Option<Vec<String>>,
    #[serde(rename = "Env", default)]
    pub env: Option<Vec<String>>,
    #[serde(rename = "User", default)]
    pub user: Option<String>,
    #[serde(rename = "WorkingDir", default)]
    pub working_dir: Option<String>,
}

/// A pulled and unpacked image.
#[derive(Debug, Clone)]
pub struct Image {
    /// `REPOSITORY@sha256:...`: what the container status reports as `imageID`.
    pub pinned: String,
    /// The unpacked root file system (shared, never written by a container).
    pub rootfs: PathBuf,
    /// The OCI layout it came from (for private copies of the root file system).
    pub layout: String,
    /// umoci's runtime config for it: the default mounts, namespaces and masked paths.
    pub base: Value,
    pub config: ImageConfig,
}

/// `REG/REPO:TAG@sha256:D` -> `REG/REPO@sha256:D` (with a digest the tag is ignored, as
/// container runtimes do); a reference without a digest is returned as it is.
pub fn without_tag(reference: &str) -> String {
    match reference.split_once('@') {
        Some((_, digest)) => format!("{}@{digest}", repository(reference)),
        None => reference.to_string(),
    }
}

/// The repository part of a reference (no tag, no digest).
fn repository(reference: &str) -> String {
    let name = reference.split('@').next().unwrap_or(reference);
    match name.rsplit_once('/') {
        Some((dir, last)) => format!("{dir}/{}", last.split(':').next().unwrap_or(last)),
        None => name.split(':').next().unwrap_or(name).to_string(),
    }
}

/// The process of a container (Kubernetes' rule): `command` replaces the image's entrypoint
/// and drops its cmd; `args` replaces the cmd.
pub fn process_args(
    image: &ImageConfig,
    command: Option<&[String]>,
    args: Option<&[String]>,
) -> anyhow::Result<Vec<String>> {
    let command = command.filter(|c| !c.is_empty());
    let args = args.filter(|a| !a.is_empty());
    let mut out: Vec<String> = match command {
        Some(c) => c.to_vec(),
        None => image.entrypoint.clone().unwrap_or_default(),
    };
    match (command, args) {
        (_, Some(a)) => out.extend(a.iter().cloned()),
        (None, None) => out.extend(image.cmd.clone().unwrap_or_default()),
        (Some(_), None) => {}
    }
    if out.is_empty() {
        bail!("no command specified: the image has no entrypoint or cmd and the container sets no command");
    }
    Ok(out)
}

/// The user of a container: `runAsUser` / `runAsGroup` (container, else pod) over the image's
/// `USER` (`uid[:gid]`, or names looked up in the image's /etc/passwd and /etc/group).
pub fn user(
    image_user: Option<&str>,
    run_as_user: Option<i64>,
    run_as_group: Option<i64>,
    rootfs: &Path,
) -> anyhow::Result<(u32, u32)> {
    let lookup = |file: &str, name: &str| -> Option<(u32, Option<u32>)> {
        let text = std::fs::read_to_string(rootfs.join(file)).ok()?;
        text.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.first() != Some(&name) {
                return None;
            }
            Some((
                f.get(2)?.parse().ok()?,
                f.get(3).and_then(|g| g.parse().ok()),
            ))
        })
    };
    let (mut uid, mut gid) = (0u32, 0u32);
    if let Some(u) = image_user.filter(|u| !u.is_empty()) {
        let (name, group) = match u.split_once(':') {
            Some((n, g)) => (n, Some(g)),
            None => (u, None),
        };
        match name.parse::<u32>() {
            Ok(n) => uid = n,
            Err(_) => {
                let (n, g) = lookup("etc/passwd", name).ok_or_else(|| {
                    anyhow!("image user {name:?} is not in the image's /etc/passwd")
                })?;
                uid = n;
                gid = g.unwrap_or(0);
            }
        }
        if let Some(g) = group {
            gid = match g.parse::<u32>() {
                Ok(n) => n,
                Err(_) => {
                    lookup("etc/group", g)
                        .ok_or_else(|| {
                            anyhow!("image group {g:?} is not in the image's /etc/group")
                        })?
                        .0
                }
            };
        }
    }
    if let Some(u) = run_as_user {
        uid = u32::try_from(u).context("runAsUser out of range")?;
    }
    if let Some(g) = run_as_group {
        gid = u32::try_from(g).context("runAsGroup out of range")?;
    }
    Ok((uid, gid))
}

/// A bind mount into the container.
#[derive(Debug, Clone, PartialEq)]
pub struct Bind {
    pub destination: String,
    pub source: PathBuf,
    pub readonly: bool,
}

/// What the bundle's config says about one container (the rest comes from umoci's defaults).
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    pub rootfs: PathBuf,
    pub readonly_root: bool,
    pub binds: Vec<Bind>,
    pub hostname: String,
    pub no_new_privileges: bool,
    /// Capabilities left after the security context's `drop` / `add` (`None`: the runtime's
    /// defaults).
    pub capabilities: Option<Vec<String>>,
}

/// The bundle's `config.json`: umoci's config for the image with the container's process,
/// user, root and mounts; the host network namespace (pod IPs are loopback addresses on the
/// host) and no cgroup limits (the test kubelet enforces no resources).
pub fn bundle_config(base: &Value, spec: &RunSpec) -> Value {
    let mut c = base.clone();
    c["ociVersion"] = c.get("ociVersion").cloned().unwrap_or(json!("1.0.2"));
    let p = &mut c["process"];
    p["terminal"] = json!(false);
    p["args"] = json!(spec.args);
    p["env"] = json!(spec
        .env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>());
    p["cwd"] = json!(spec.cwd);
    p["user"] = json!({
        "uid": spec.uid,
        "gid": spec.gid,
        "additionalGids": spec.additional_gids,
    });
    p["noNewPrivileges"] = json!(spec.no_new_privileges);
    if let Some(caps) = &spec.capabilities {
        p["capabilities"] = json!({
            "bounding": caps, "effective": caps, "permitted": caps,
            "inheritable": [], "ambient": [],
        });
    }
    c["root"] = json!({"path": spec.rootfs, "readonly": spec.readonly_root});
    c["hostname"] = json!(spec.hostname);
    let binds: Vec<&str> = spec.binds.iter().map(|b| b.destination.as_str()).collect();
    let mut mounts: Vec<Value> = c["mounts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| {
            m["type"] != "cgroup" && !binds.contains(&m["destination"].as_str().unwrap_or_default())
        })
        .collect();
    // Shortest destination first, so a mount inside another lands on top of it.
    let mut ordered: Vec<&Bind> = spec.binds.iter().collect();
    ordered.sort_by_key(|b| b.destination.matches('/').count());
    for b in ordered {
        mounts.push(json!({
            "destination": b.destination,
            "type": "bind",
            "source": b.source,
            "options": ["rbind", if b.readonly { "ro" } else { "rw" }],
        }));
    }
    c["mounts"] = json!(mounts);
    let linux = &mut c["linux"];
    if let Some(ns) = linux["namespaces"].as_array() {
        let kept: Vec<Value> = ns
            .iter()
            .filter(|n| n["type"] != "network" && n["type"] != "cgroup" && n["type"] != "user")
            .cloned()
            .collect();
        linux["namespaces"] = json!(kept);
    }
    if let Some(l) = linux.as_object_mut() {
        l.remove("resources");
        l.remove("cgroupsPath");
        l.remove("uidMappings");
        l.remove("gidMappings");
    }
    c
}

/// Capabilities after a security context's `drop` and `add` over `defaults` (names without
/// the `CAP_` prefix, as Kubernetes writes them).
pub fn capabilities(defaults: &[String], drop: &[String], add: &[String]) -> Vec<String> {
    let norm = |c: &str| {
        let c = c.to_ascii_uppercase();
        if c.starts_with("CAP_") {
            c
        } else {
            format!("CAP_{c}")
        }
    };
    let drop_all = drop.iter().any(|d| d.eq_ignore_ascii_case("ALL"));
    let dropped: Vec<String> = drop.iter().map(|d| norm(d)).collect();
    let mut out: Vec<String> = if drop_all {
        Vec::new()
    } else {
        defaults
            .iter()
            .filter(|c| !dropped.contains(c))
            .cloned()
            .collect()
    };
    for a in add {
        let a = norm(a);
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

async fn tool(program: &str, args: &[String]) -> Result<String, String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|e| format!("{program} (is it installed?): {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.first().map(String::as_str).unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One pull at a time: pods of the same image start together, and a pull is cached.
static PULLS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Pulls `reference` (a loopback registry, plain HTTP) by digest and unpacks it, once per
/// digest under `cache`.
pub async fn pull(reference: &str, cache: &Path) -> Result<Image, PullError> {
    let err = |message: String| PullError {
        image: reference.to_string(),
        message,
    };
    if reference.is_empty() {
        return Err(err("the container names no image".into()));
    }
    let reference_nt = without_tag(reference);
    if let Some(host) = rewrite::non_loopback_url(&format!("docker://{reference_nt}")) {
        return Err(err(format!(
            "the registry {host:?} is not a loopback address: this test kubelet pulls only from registries on 127.0.0.0/8"
        )));
    }
    let _one = PULLS.lock().await;
    let digest = match reference_nt.split_once('@') {
        Some((_, d)) => d.to_string(),
        None => tool(
            "skopeo",
            &[
                "inspect".into(),
                "--tls-verify=false".into(),
                "--format".into(),
                "{{.Digest}}".into(),
                format!("docker://{reference_nt}"),
            ],
        )
        .await
        .map_err(err)?
        .trim()
        .to_string(),
    };
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| err(format!("malformed digest {digest:?}")))?;
    let pinned = format!("{}@{digest}", repository(&reference_nt));
    let dir = cache.join(hex);
    let layout = format!("{}:image", dir.join("layout").display());
    let bundle = dir.join("bundle");
    if !dir.join(".done").exists() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        tool(
            "skopeo",
            &[
                "copy".into(),
                "-q".into(),
                "--src-tls-verify=false".into(),
                format!("docker://{pinned}"),
                format!("oci:{layout}"),
            ],
        )
        .await
        .map_err(err)?;
        tool(
            "umoci",
            &[
                "unpack".into(),
                "--image".into(),
                layout.clone(),
                bundle.to_string_lossy().into_owned(),
            ],
        )
        .await
        .map_err(|e| err(format!("unpacking: {e}")))?;
        std::fs::write(dir.join(".done"), pinned.as_bytes())
            .map_err(|e| err(format!("{}: {e}", dir.display())))?;
    }
    let base: Value = std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| err("the unpacked bundle has no readable config.json".into()))?;
    let config = image_config(&dir.join("layout")).map_err(|e| err(format!("{e:#}")))?;
    Ok(Image {
        pinned,
        rootfs: bundle.join("rootfs"),
        layout,
        base,
        config,
    })
}

/// The image configuration in an OCI layout of one image: index -> manifest -> config.
fn image_config(layout: &Path) -> anyhow::Result<ImageConfig> {
    let blob = |digest: &str| -> anyhow::Result<Value> {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let p = layout.join("blobs/sha256").join(hex);
        Ok(serde_json::from_slice(
            &std::fs::read(&p).with_context(|| p.display().to_string())?,
        )?)
    };
    let index: Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let manifest = blob(
        index["manifests"][0]["digest"]
            .as_str()
            .ok_or_else(|| anyhow!("layout index without a manifest"))?,
    )?;
    let config = blob(
        manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| anyhow!("manifest without a config"))?,
    )?;
    Ok(serde_json::from_value(config["config"].clone()).unwrap_or_default())
}

/// A private, writable copy of an image's root file system (for containers without
/// `readOnlyRootFilesystem`), unpacked into `into`.
pub async fn private_rootfs(image: &Image, into: &Path) -> anyhow::Result<PathBuf> {
    let rootfs = into.join("rootfs");
    if rootfs.exists() {
        return Ok(rootfs);
    }
    let tmp = into.with_extension("unpack");
    let _ = std::fs::remove_dir_all(&tmp);
    tool(
        "umoci",
        &[
            "unpack".into(),
            "--image".into(),
            image.layout.clone(),
            tmp.to_string_lossy().into_owned(),
        ],
    )
    .await
    .map_err(|e| anyhow!(e))?;
    std::fs::create_dir_all(into)?;
    std::fs::rename(tmp.join("rootfs"), &rootfs)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(rootfs)
}

/// The kubelet's OCI runtime settings (`--image-runtime runc`).
#[derive(Debug, Clone)]
pub struct Runtime {
    /// The runtime binary (`runc`).
    pub program: String,
    /// Its state root (`--root`): this kubelet's containers only.
    pub root: PathBuf,
    /// Pulled images, one directory per digest.
    pub images: PathBuf,
}

/// How a container runs under the OCI runtime: its id, bundle and the runtime's state root.
#[derive(Debug, Clone)]
pub struct OciRun {
    pub runtime: String,
    pub root: PathBuf,
    pub id: String,
    pub bundle: PathBuf,
}

impl OciRun {
    /// `runtime --root R run --bundle B --pid-file P ID`: the runtime stays in the foreground
    /// as the container's parent and exits with its status.
    pub fn run_args(&self) -> Vec<String> {
        vec![
            "--root".into(),
            self.root.to_string_lossy().into_owned(),
            "run".into(),
            "--bundle".into(),
            self.bundle.to_string_lossy().into_owned(),
            "--pid-file".into(),
            self.pid_file().to_string_lossy().into_owned(),
            self.id.clone(),
        ]
    }

    /// Written by the runtime once the container's process exists: without it, the
    /// container never started (a missing entrypoint, a bad mount).
    pub fn pid_file(&self) -> PathBuf {
        self.bundle.join("container.pid")
    }

    fn runtime_cmd(&self, args: &[&str]) {
        let _ = std::process::Command::new(&self.runtime)
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }

    /// Sends `sig` to the container's init process (and so, at SIGKILL, to all of it: its
    /// PID namespace ends with it).
    pub fn signal(&self, sig: &str) {
        self.runtime_cmd(&["kill", &self.id, sig]);
    }

    /// Removes the container's runtime state (and kills what is left of it).
    pub fn delete(&self) {
        self.runtime_cmd(&["delete", "-f", &self.id]);
        let _ = std::fs::remove_file(self.pid_file());
    }
}

/// Container ids: `<pod uid prefix>-<container>`, unique among this kubelet's containers.
pub fn container_id(pod_uid: &str, container: &str) -> String {
    let uid: String = pod_uid.chars().filter(|c| *c != '-').take(12).collect();
    format!("{uid}-{container}")
}

/// Writes `config` as the bundle's config.json.
pub fn write_bundle(bundle: &Path, config: &Value) -> anyhow::Result<()> {
    std::fs::create_dir_all(bundle)?;
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(config)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn references_drop_the_tag_under_a_digest() {
        let d = "sha256:".to_string() + &"a".repeat(64);
        assert_eq!(
            without_tag(&format!("127.0.0.1:5000/dspark/engine:0.1.0@{d}")),
            format!("127.0.0.1:5000/dspark/engine@{d}")
        );
        assert_eq!(
            without_tag("127.0.0.1:5000/dspark/engine:0.1.0"),
            "127.0.0.1:5000/dspark/engine:0.1.0"
        );
        assert_eq!(
            repository("127.0.0.1:5000/dspark/engine:0.1.0"),
            "127.0.0.1:5000/dspark/engine"
        );
        assert_eq!(repository("engine"), "engine");
    }

    #[test]
    fn command_replaces_the_entrypoint_and_args_the_cmd() {
        let img = ImageConfig {
            entrypoint: Some(s(&["/usr/local/bin/dspark-engine"])),
            cmd: Some(s(&["serve"])),
            ..Default::default()
        };
        let cmd = s(&["dspark-engine", "fetch"]);
        let args = s(&["--model", "m"]);
        assert_eq!(
            process_args(&img, None, None).unwrap(),
            s(&["/usr/local/bin/dspark-engine", "serve"])
        );
        assert_eq!(
            process_args(&img, None, Some(&args)).unwrap(),
            s(&["/usr/local/bin/dspark-engine", "--model", "m"])
        );
        assert_eq!(
            process_args(&img, Some(&cmd), None).unwrap(),
            s(&["dspark-engine", "fetch"])
        );
        assert_eq!(
            process_args(&img, Some(&cmd), Some(&args)).unwrap(),
            s(&["dspark-engine", "fetch", "--model", "m"])
        );
        let err = process_args(&ImageConfig::default(), None, Some(&[])).unwrap_err();
        assert!(err.to_string().contains("no command"), "{err}");
    }

    #[test]
    fn users_come_from_the_security_context_over_the_image() {
        let dir = std::env::temp_dir().join(format!("oci-user-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("etc")).unwrap();
        std::fs::write(
            dir.join("etc/passwd"),
            "root:x:0:0::/root:/sbin/nologin\nnonroot:x:65532:65533::/home:/sbin/nologin\n",
        )
        .unwrap();
        std::fs::write(dir.join("etc/group"), "root:x:0:\nstaff:x:50:\n").unwrap();
        assert_eq!(
            user(Some("65532:65532"), None, None, &dir).unwrap(),
            (65532, 65532)
        );
        assert_eq!(
            user(Some("nonroot"), None, None, &dir).unwrap(),
            (65532, 65533)
        );
        assert_eq!(
            user(Some("nonroot:staff"), None, None, &dir).unwrap(),
            (65532, 50)
        );
        assert_eq!(
            user(Some("7"), Some(1000), Some(2000), &dir).unwrap(),
            (1000, 2000)
        );
        assert_eq!(user(None, None, None, &dir).unwrap(), (0, 0));
        assert!(user(Some("nobody-here"), None, None, &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn capabilities_follow_drop_and_add() {
        let d = s(&["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE"]);
        assert!(capabilities(&d, &s(&["ALL"]), &[]).is_empty());
        assert_eq!(
            capabilities(&d, &s(&["kill"]), &s(&["SYS_NICE"])),
            s(&["CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE", "CAP_SYS_NICE"])
        );
    }

    #[test]
    fn the_bundle_runs_the_pod_spec_in_the_host_network() {
        let base = json!({
            "ociVersion": "1.0.2",
            "process": {"terminal": true, "args": ["sh"], "env": [], "cwd": "/",
                        "capabilities": {"bounding": ["CAP_KILL"]}},
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
            ],
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                               {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"}],
                "resources": {"devices": []},
                "cgroupsPath": "x",
                "maskedPaths": ["/proc/kcore"],
            },
        });
        let spec = RunSpec {
            args: s(&["dspark-engine", "serve", "--host", "127.1.0.3"]),
            env: vec![("PATH".into(), "/usr/local/bin".into())],
            cwd: "/".into(),
            uid: 65532,
            gid: 65532,
            additional_gids: vec![65532],
            rootfs: "/var/images/x/rootfs".into(),
            readonly_root: true,
            binds: vec![
                Bind {
                    destination: "/var/lib/dspark/models/m.gguf".into(),
                    source: "/host/m.gguf".into(),
                    readonly: true,
                },
                Bind {
                    destination: "/tmp".into(),
                    source: "/pods/p/volumes/tmp".into(),
                    readonly: false,
                },
            ],
            hostname: "e2e-h100-abc".into(),
            no_new_privileges: true,
            capabilities: Some(vec![]),
        };
        let c = bundle_config(&base, &spec);
        assert_eq!(c["process"]["args"], json!(spec.args));
        assert_eq!(c["process"]["terminal"], false);
        assert_eq!(c["process"]["env"], json!(["PATH=/usr/local/bin"]));
        assert_eq!(c["process"]["user"]["uid"], 65532);
        assert_eq!(c["process"]["user"]["additionalGids"], json!([65532]));
        assert_eq!(c["process"]["capabilities"]["effective"], json!([]));
        assert_eq!(
            c["root"],
            json!({"path": "/var/images/x/rootfs", "readonly": true})
        );
        assert_eq!(c["hostname"], "e2e-h100-abc");
        let ns: Vec<&str> = c["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        assert_eq!(ns, ["pid", "ipc", "uts", "mount"]);
        assert!(c["linux"].get("resources").is_none() && c["linux"].get("cgroupsPath").is_none());
        assert_eq!(c["linux"]["maskedPaths"], json!(["/proc/kcore"]));
        let mounts = c["mounts"].as_array().unwrap();
        let dests: Vec<&str> = mounts
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        // The image's tmpfs at /tmp gives way to the pod's volume; no cgroup mount.
        assert_eq!(dests, ["/proc", "/tmp", "/var/lib/dspark/models/m.gguf"]);
        assert_eq!(mounts[1]["source"], "/pods/p/volumes/tmp");
        assert_eq!(mounts[1]["options"], json!(["rbind", "rw"]));
        assert_eq!(mounts[2]["options"], json!(["rbind", "ro"]));
    }

    #[test]
    fn container_ids_are_short_and_unique_per_pod() {
        assert_eq!(
            container_id("0f3c2a1b-aaaa-bbbb-cccc-123456789abc", "fetch-model"),
            "0f3c2a1baaaa-fetch-model"
        );
    }
}
