//! Watch-backed caches of what the operator reads, and the memory of what it applied, so a
//! fleet at rest costs the API server nothing.
//!
//! Reads: every kind a reconcile looks at (the engine Deployments, their ReplicaSets and
//! pods, Services, PodDisruptionBudgets, ConfigMaps, cost tables and profiling Jobs) comes
//! from a reflector store fed by one watch per kind, filtered by the labels the operator puts
//! on what it makes. Secrets are not watched (that would need list/watch on every Secret of
//! the cluster): the admin token is read once and remembered (see `phases::run`). A cache may lag a write by a moment; every
//! decision that depends on it is either repeated by the next reconcile (status, replicas, pushes) or guarded by a
//! precondition (deletes by uid, owner-reference patches by test op).
//!
//! Writes: [`Caches::unchanged`] says whether an object the operator is about to apply is
//! exactly what it applied last time AND nobody has written it since (the cached object's
//! resourceVersion is the one the apply returned). Only then is the apply skipped; any
//! other writer (`kubectl edit`, a deletion, the Deployment controller's status) moves the
//! resourceVersion, so the next reconcile applies again and takes back the fields it owns.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::warn;

use super::names::{profiling_job_selector, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER};
use crate::crd::DSparkCostTable;

/// One store per kind the reconcile reads, and the applied-object memory.
pub struct Caches {
    pub deployments: Store<Deployment>,
    pub replica_sets: Store<ReplicaSet>,
    pub pods: Store<Pod>,
    pub services: Store<Service>,
    pub pdbs: Store<PodDisruptionBudget>,
    pub config_maps: Store<ConfigMap>,
    pub cost_tables: Store<DSparkCostTable>,
    pub profiling_jobs: Store<Job>,
    /// `kind/namespace/name` -> (digest of the object applied, resourceVersion it got).
    applied: Mutex<HashMap<String, (u64, String)>>,
    /// `Some` once every store has its first listing (or `Err` when a watch died before).
    ready: tokio::sync::watch::Receiver<Option<Result<(), String>>>,
}

/// A kind the operator applies, with the store that caches it.
pub trait Cached:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + DeserializeOwned
    + Serialize
    + Debug
    + Send
    + Sync
    + 'static
{
    fn store(c: &Caches) -> &Store<Self>;
}

macro_rules! cached {
    ($($kind:ty => $field:ident),* $(,)?) => {
        $(impl Cached for $kind {
            fn store(c: &Caches) -> &Store<Self> {
                &c.$field
            }
        })*
    };
}
cached!(
    Deployment => deployments,
    Service => services,
    PodDisruptionBudget => pdbs,
    ConfigMap => config_maps,
    DSparkCostTable => cost_tables,
);

/// Starts one watch per kind (in `namespace`, or all) feeding its store, on the current
/// tokio runtime. The watches run for the life of the process; [`Caches::ready`] waits for
/// their first listing.
fn start<K>(client: &kube::Client, namespace: Option<&str>, labels: &str) -> Store<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let (store, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default().labels(labels))
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                warn!(kind = %K::kind(&()), "watch: {e}");
            }
        }
    });
    store
}

impl Caches {
    /// Starts the watches. Objects the operator makes carry `managed-by`; engine pods and
    /// their ReplicaSets carry the deployment label (from the pod template).
    pub fn start(client: &kube::Client, namespace: Option<&str>) -> Self {
        let managed = format!("{LABEL_MANAGED_BY}={MANAGER}");
        let (tx, ready) = tokio::sync::watch::channel(None);
        let caches = Self {
            deployments: start(client, namespace, &managed),
            replica_sets: start(client, namespace, LABEL_DEPLOYMENT),
            pods: start(client, namespace, LABEL_DEPLOYMENT),
            services: start(client, namespace, &managed),
            pdbs: start(client, namespace, &managed),
            config_maps: start(client, namespace, &managed),
            cost_tables: start(client, namespace, &managed),
            profiling_jobs: start(client, namespace, &profiling_job_selector()),
            applied: Mutex::default(),
            ready,
        };
        // A store's own readiness future wakes only its last waiter (one oneshot receiver):
        // reconciles of several deployments waiting at once would hang all but one. One task
        // waits for the stores and tells every reconcile through a watch channel instead.
        let stores = (
            caches.deployments.clone(),
            caches.replica_sets.clone(),
            caches.pods.clone(),
            caches.services.clone(),
            caches.pdbs.clone(),
            caches.config_maps.clone(),
            caches.cost_tables.clone(),
            caches.profiling_jobs.clone(),
        );
        tokio::spawn(async move {
            let (d, rs, p, s, pdb, cm, ct, jobs) = &stores;
            let all = async {
                d.wait_until_ready().await?;
                rs.wait_until_ready().await?;
                p.wait_until_ready().await?;
                s.wait_until_ready().await?;
                pdb.wait_until_ready().await?;
                cm.wait_until_ready().await?;
                ct.wait_until_ready().await?;
                jobs.wait_until_ready().await
            };
            let _ = tx.send(Some(all.await.map_err(|e| e.to_string())));
        });
        caches
    }

    /// Waits until every store holds its first listing (at once after that); any number of
    /// reconciles may wait at the same time.
    pub async fn ready(&self) -> Result<(), String> {
        let mut rx = self.ready.clone();
        let seen = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| "the cache task stopped".to_string())?;
        seen.clone().unwrap_or(Ok(()))
    }

    /// The cached `name` in `ns`, if any.
    pub fn get<K: Cached>(&self, ns: &str, name: &str) -> Option<Arc<K>> {
        K::store(self).get(&ObjectRef::new(name).within(ns))
    }

    /// Whether applying `body` (the object `name` of kind `K`) can be skipped: the same body
    /// was applied last time and the cached copy still has the resourceVersion that apply
    /// returned. Returns the cached copy.
    pub fn unchanged<K: Cached>(
        &self,
        ns: &str,
        name: &str,
        body: &impl Serialize,
    ) -> Option<Arc<K>> {
        let cached = self.get::<K>(ns, name)?;
        let memory = self.applied.lock().expect("applied lock");
        let remembered = memory.get(&key::<K>(ns, name));
        fresh(
            remembered,
            digest(body),
            cached.resource_version().as_deref(),
        )
        .then_some(cached)
    }

    /// Remembers that `body` was applied to `name` and the server answered with `result`.
    pub fn remember<K: Cached>(&self, ns: &str, name: &str, body: &impl Serialize, result: &K) {
        let Some(rv) = result.resource_version() else {
            return;
        };
        self.applied
            .lock()
            .expect("applied lock")
            .insert(key::<K>(ns, name), (digest(body), rv));
    }

    /// Forgets what was applied to `name` (after another write of ours, such as a status
    /// patch, that the cache may not show yet): the next reconcile applies it again.
    pub fn forget<K: Cached>(&self, ns: &str, name: &str) {
        self.applied
            .lock()
            .expect("applied lock")
            .remove(&key::<K>(ns, name));
    }
}

/// The objects of `store` in `ns` carrying every label of `selector` (as a label selector
/// of equalities would list them).
pub fn selected<K: Resource + Clone>(
    store: &Store<K>,
    ns: &str,
    selector: &BTreeMap<String, String>,
) -> Vec<K>
where
    K::DynamicType: Hash + Eq + Clone,
{
    store
        .state()
        .iter()
        .filter(|o| {
            let m = o.meta();
            m.namespace.as_deref() == Some(ns)
                && selector
                    .iter()
                    .all(|(k, v)| m.labels.as_ref().and_then(|l| l.get(k)) == Some(v))
        })
        .map(|o| (**o).clone())
        .collect()
}

fn key<K: Cached>(ns: &str, name: &str) -> String {
    format!("{}/{ns}/{name}", K::kind(&()))
}

/// A digest of the serialized object (stable within the process: the memory is not persisted).
fn digest<K: Serialize>(obj: &K) -> u64 {
    let mut h = DefaultHasher::new();
    serde_json::to_vec(obj).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// The skip rule: remembered with this digest, and the cached copy is the one that apply
/// produced (no one wrote it since).
fn fresh(remembered: Option<&(u64, String)>, digest: u64, cached_rv: Option<&str>) -> bool {
    match (remembered, cached_rv) {
        (Some((d, rv)), Some(now)) => *d == digest && rv == now,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_apply_is_skipped_only_when_the_same_object_is_still_as_applied() {
        let mut a = ConfigMap::default();
        a.metadata.name = Some("t".into());
        let mut b = a.clone();
        b.data = Some([("k".to_string(), "v".to_string())].into());
        let (da, db) = (digest(&a), digest(&b));
        assert_ne!(da, db, "a changed object has another digest");
        assert_eq!(da, digest(&a.clone()));
        let memory = (da, "41".to_string());
        assert!(fresh(Some(&memory), da, Some("41")));
        // The spec changed: apply.
        assert!(!fresh(Some(&memory), db, Some("41")));
        // Someone else wrote it (or it was recreated): apply.
        assert!(!fresh(Some(&memory), da, Some("57")));
        // Never applied by this process, or not cached (deleted, or not seen yet): apply.
        assert!(!fresh(None, da, Some("41")));
        assert!(!fresh(Some(&memory), da, None));
    }
}
