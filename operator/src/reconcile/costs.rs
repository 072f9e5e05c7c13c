//! Cost tables: the shared `DSparkCostTable` resource of each pool's key (owned by every
//! deployment that uses it, so it lives while one does), and pushing a stored table to the
//! ready engine pods of a pool over their admin API (`PUT /admin/v1/cost-table`). The
//! pool's mounted ConfigMap is the fallback when a push fails.

use dspark_types::contract::paths;
use std::sync::Arc;
use std::time::Duration;

use dspark_types::{AdminState, CostTable, ErrorBody, PushResponse};
use hyper::Method;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};

use super::names::{LABEL_MANAGED_BY, MANAGER};
use crate::crd::{cost_table_name, CostTableKey, DSparkCostTable, DSparkDeployment};
use crate::http::{pod_url, HttpClient, PodTarget};
use crate::{Error, Result};

/// Owner references of a cost table: every deployment in `all` with a pool keyed by `key`,
/// sorted by name (none is the controller: the table is shared).
pub fn owners_of(key: &CostTableKey, all: &[&DSparkDeployment]) -> Vec<OwnerReference> {
    let mut owners: Vec<OwnerReference> = all
        .iter()
        .filter(|d| d.meta().deletion_timestamp.is_none())
        .filter(|d| {
            d.spec
                .pools
                .iter()
                .any(|p| d.cost_table_key(p).as_ref() == Some(key))
        })
        .filter_map(|d| {
            let mut o = d.controller_owner_ref(&())?;
            o.controller = None;
            o.block_owner_deletion = None;
            Some(o)
        })
        .collect();
    owners.sort_by(|a, b| a.name.cmp(&b.name));
    owners.dedup_by(|a, b| a.uid == b.uid);
    owners
}

/// Applies the cost table of `key` (spec and owners) and returns it with its status.
pub(super) async fn ensure_cost_table(
    ctx: &super::context::Context,
    ns: &str,
    key: &CostTableKey,
    owners: Vec<OwnerReference>,
) -> Result<Arc<DSparkCostTable>> {
    let name = cost_table_name(key);
    let patch = serde_json::json!({
        "apiVersion": DSparkCostTable::api_version(&()),
        "kind": DSparkCostTable::kind(&()),
        "metadata": {
            "name": name,
            "labels": { LABEL_MANAGED_BY: MANAGER },
            "ownerReferences": owners,
        },
        "spec": key.spec(),
    });
    super::writers::apply_body::<DSparkCostTable>(ctx, ns, &name, &patch).await
}

/// The controller owner reference of `meta`, if any.
fn controller_uid(meta: &kube::api::ObjectMeta) -> Option<(&str, &str)> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| (o.kind.as_str(), o.uid.as_str()))
}

/// The pods of `pods` this deployment (`owner_uid`) owns through the owner chain
/// pod -> ReplicaSet -> `deployment` -> DSparkDeployment: each link a controller reference
/// naming the next object's uid. Labels alone (anyone can copy them) are not enough.
pub fn owned_pods(
    pods: &[Pod],
    replica_sets: &[ReplicaSet],
    deployment: Option<&Deployment>,
    owner_uid: &str,
) -> Vec<Pod> {
    let Some(dep) = deployment else {
        return Vec::new();
    };
    let Some(dep_uid) = dep.metadata.uid.as_deref() else {
        return Vec::new();
    };
    if owner_uid.is_empty()
        || controller_uid(&dep.metadata) != Some(("DSparkDeployment", owner_uid))
    {
        return Vec::new();
    }
    let rs_uids: Vec<&str> = replica_sets
        .iter()
        .filter(|rs| controller_uid(&rs.metadata) == Some(("Deployment", dep_uid)))
        .filter_map(|rs| rs.metadata.uid.as_deref())
        .collect();
    pods.iter()
        .filter(|p| {
            controller_uid(&p.metadata)
                .is_some_and(|(kind, uid)| kind == "ReplicaSet" && rs_uids.contains(&uid))
        })
        .cloned()
        .collect()
}

/// Ready pods with an IP, sorted by name.
pub fn ready_pods(pods: &[Pod]) -> Vec<PodTarget> {
    let mut out: Vec<PodTarget> = pods
        .iter()
        .filter(|p| p.meta().deletion_timestamp.is_none())
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let ip = status.pod_ip.clone().filter(|ip| !ip.is_empty())?;
            ready.then(|| PodTarget {
                name: p.name_any(),
                ip,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// What a push did to one pod.
#[derive(Debug, Clone, PartialEq)]
pub enum PushOutcome {
    /// The pod already held a table with this digest.
    Current,
    /// The pod took the table.
    Pushed(PushResponse),
}

/// Pushes `table` to one pod: skipped when `GET /admin/v1/state` shows the same digest;
/// transport errors and 5xx are retried `attempts` times with a doubling pause; a 4xx is
/// final and reported with the engine's error message.
pub async fn push_to_pod(
    http: &HttpClient,
    pod: &PodTarget,
    admin_port: i32,
    token: &str,
    table: &CostTable,
    attempts: u32,
) -> Result<PushOutcome> {
    let digest = table.digest();
    let state_url = pod_url(&pod.ip, admin_port, paths::ADMIN_STATE);
    let put_url = pod_url(&pod.ip, admin_port, paths::ADMIN_COST_TABLE);
    let err = |url: &str, message: String| Error::Engine {
        pod: pod.name.clone(),
        url: url.to_string(),
        message,
    };
    let mut pause = Duration::from_millis(200);
    let mut last = String::new();
    for attempt in 0..attempts.max(1) {
        if attempt > 0 {
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
        if let Ok(r) = http.send(Method::GET, &state_url, Some(token), None).await {
            if r.status == 200 {
                if let Ok(state) = serde_json::from_str::<AdminState>(&r.body) {
                    if state.cost_table_digest == digest {
                        return Ok(PushOutcome::Current);
                    }
                }
            }
        }
        match http
            .send(
                Method::PUT,
                &put_url,
                Some(token),
                Some(table.to_json_pretty()),
            )
            .await
        {
            Ok(r) if r.status == 200 => {
                return serde_json::from_str::<PushResponse>(&r.body)
                    .map(PushOutcome::Pushed)
                    .map_err(|e| err(&put_url, format!("unexpected answer to a push: {e}")));
            }
            Ok(r) if (400..500).contains(&r.status) => {
                let why = serde_json::from_str::<ErrorBody>(&r.body)
                    .map(|b| b.error.message)
                    .unwrap_or(r.body);
                return Err(err(
                    &put_url,
                    format!("refused the cost table ({}): {why}", r.status),
                ));
            }
            Ok(r) => last = format!("HTTP {}: {}", r.status, r.body),
            Err(e) => last = e,
        }
    }
    Err(err(
        &put_url,
        format!("push failed after {} attempts: {last}", attempts.max(1)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::pool::tests::sample;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn owners_are_every_deployment_using_the_key() {
        let a = sample();
        let mut b = sample();
        b.metadata.name = Some("other".into());
        b.metadata.uid = Some("uid-2".into());
        let mut c = sample();
        c.metadata.name = Some("different-model".into());
        c.metadata.uid = Some("uid-3".into());
        c.spec.model.id = Some("another".into());
        let key = a.cost_table_key(&a.spec.pools[0]).unwrap();
        let owners = owners_of(&key, &[&c, &b, &a]);
        let names: Vec<&str> = owners.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, vec!["other", "qwen3-8b"]);
        assert!(owners.iter().all(|o| o.controller.is_none()));
    }

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.status = Some(PodStatus {
            pod_ip: ip.map(Into::into),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        p
    }

    fn with_controller<K: kube::Resource>(mut o: K, uid: &str, kind: &str, owner: &str) -> K {
        o.meta_mut().uid = Some(uid.into());
        o.meta_mut().owner_references = Some(vec![OwnerReference {
            kind: kind.into(),
            uid: owner.into(),
            controller: Some(true),
            ..Default::default()
        }]);
        o
    }

    /// Only the chain pod -> ReplicaSet -> Deployment -> this deployment counts.
    #[test]
    fn owned_pods_follow_the_owner_chain() {
        let dep = with_controller(Deployment::default(), "dep", "DSparkDeployment", "dsd");
        let rs = with_controller(ReplicaSet::default(), "rs", "Deployment", "dep");
        let stray_rs = with_controller(ReplicaSet::default(), "rs2", "Deployment", "other");
        let mine = with_controller(
            pod("mine", Some("127.1.0.2"), true),
            "p1",
            "ReplicaSet",
            "rs",
        );
        let stray = with_controller(
            pod("stray", Some("127.1.0.3"), true),
            "p2",
            "ReplicaSet",
            "rs2",
        );
        let forged = with_controller(pod("forged", Some("127.1.0.4"), true), "p3", "Job", "rs");
        let bare = pod("bare", Some("127.1.0.5"), true);
        let pods = [mine, stray, forged, bare];
        let names = |v: Vec<Pod>| v.iter().map(|p| p.name_any()).collect::<Vec<_>>();
        let rss = [rs, stray_rs];
        assert_eq!(names(owned_pods(&pods, &rss, Some(&dep), "dsd")), ["mine"]);
        assert!(owned_pods(&pods, &rss, Some(&dep), "another-dsd").is_empty());
        assert!(owned_pods(&pods, &rss, None, "dsd").is_empty());
    }

    #[test]
    fn only_ready_pods_with_an_ip() {
        let pods = [
            pod("b", Some("127.1.0.3"), true),
            pod("a", Some("127.1.0.2"), true),
            pod("c", None, true),
            pod("d", Some("127.1.0.4"), false),
        ];
        let r = ready_pods(&pods);
        assert_eq!(
            r.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            vec!["a", "b"]
        );
        assert_eq!(pod_url("127.1.0.2", 8001, "/x"), "http://127.1.0.2:8001/x");
        assert_eq!(pod_url("::1", 8001, "/x"), "http://[::1]:8001/x");
    }

    /// A fake engine admin API answering each connection with the next canned response.
    async fn fake_engine(
        responses: Vec<(u16, String)>,
    ) -> (String, tokio::task::JoinHandle<Vec<String>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let handle = tokio::spawn(async move {
            let mut seen = Vec::new();
            for (status, body) in responses {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 65536];
                let mut req = String::new();
                loop {
                    let n = s.read(&mut buf).await.unwrap();
                    req.push_str(&String::from_utf8_lossy(&buf[..n]));
                    let Some(head_end) = req.find("\r\n\r\n") else {
                        continue;
                    };
                    let len = req[..head_end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap())
                        })
                        .unwrap_or(0);
                    if req.len() >= head_end + 4 + len || n == 0 {
                        break;
                    }
                }
                seen.push(req.lines().next().unwrap_or_default().to_string());
                let resp = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(resp.as_bytes()).await.unwrap();
            }
            seen
        });
        (format!("127.0.0.1:{port}"), handle)
    }

    /// Pushes `t` (3 attempts) to a fake engine answering `responses`: the outcome, and the
    /// request lines the engine saw once it has answered them all.
    async fn push_to_fake(
        http: &HttpClient,
        t: &CostTable,
        responses: Vec<(u16, String)>,
    ) -> (Result<PushOutcome>, Vec<String>) {
        let (addr, h) = fake_engine(responses).await;
        let (ip, port) = addr.split_once(':').unwrap();
        let target = PodTarget {
            name: "p".into(),
            ip: ip.into(),
        };
        let out = push_to_pod(http, &target, port.parse().unwrap(), "tok", t, 3).await;
        (out, h.await.unwrap())
    }

    fn table() -> CostTable {
        CostTable::from_json(r#"{"schema":1,"model_id":"m","engine_version":"0.1.0","device":"cpu","dtype":"q4","measured_at":"2026-11-29T09:00:00Z","points":[[1,100.0],[8,50.0]]}"#).unwrap()
    }

    fn state(digest: &str) -> String {
        serde_json::to_string(&AdminState {
            model_id: "m".into(),
            engine_version: "0.1.0".into(),
            device: "cpu".into(),
            speculation: "none".into(),
            policy: "dspark".into(),
            cost_table_source: dspark_types::CostTableSource::Default,
            cost_table_revision: 0,
            cost_table_digest: digest.into(),
            requests_running: 0,
            requests_waiting: 0,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn push_skips_current_pods_pushes_others_and_reports_refusals() {
        let http = HttpClient::new(Duration::from_secs(2));
        let t = table();
        let (out, _) = push_to_fake(&http, &t, vec![(200, state(&t.digest()))]).await;
        assert_eq!(out.unwrap(), PushOutcome::Current);

        let ok = serde_json::to_string(&PushResponse {
            revision: 2,
            digest: t.digest(),
        })
        .unwrap();
        let (out, seen) = push_to_fake(&http, &t, vec![(200, state("old")), (200, ok)]).await;
        assert!(matches!(
            out.unwrap(),
            PushOutcome::Pushed(PushResponse { revision: 2, .. })
        ));
        assert_eq!(
            seen,
            vec![
                "GET /admin/v1/state HTTP/1.1",
                "PUT /admin/v1/cost-table HTTP/1.1"
            ]
        );

        let refusal = serde_json::to_string(&ErrorBody::new(
            "invalid_request_error",
            "cost table for device 'cpu' does not match",
        ))
        .unwrap();
        let (out, _) = push_to_fake(&http, &t, vec![(200, state("old")), (400, refusal)]).await;
        let e = out.unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");

        // 5xx twice, then success: retried.
        let ok = serde_json::to_string(&PushResponse {
            revision: 3,
            digest: t.digest(),
        })
        .unwrap();
        let responses = vec![
            (200, state("old")),
            (503, "busy".into()),
            (200, state("old")),
            (503, "busy".into()),
            (200, state("old")),
            (200, ok),
        ];
        let (out, _) = push_to_fake(&http, &t, responses).await;
        assert!(matches!(
            out.unwrap(),
            PushOutcome::Pushed(PushResponse { revision: 3, .. })
        ));
    }
}
