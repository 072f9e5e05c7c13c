//! Pruning: what a deployment made but its spec no longer names goes away in the reconcile
//! that sees the change.
//!
//! - Pool objects (engine Deployment, Service, PodDisruptionBudget, cost-table ConfigMap) of a
//!   pool that was removed or renamed are deleted. An object is a candidate only when it
//!   carries the deployment's label AND this deployment's controller owner reference; it is
//!   deleted by uid (a precondition), so a namesake created since is never touched.
//! - Cost tables of keys the spec no longer uses (a new model, drafter or engine version, a
//!   pool gone) lose this deployment's owner reference, and only that one; a table that no
//!   deployment references any more is deleted, and the garbage collector deletes its
//!   profiling Jobs (which the table owns).
//!
//! The selection is pure ([`to_prune`], [`to_release`]); [`pool_objects`] and
//! [`cost_tables`] do the I/O.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use std::sync::Arc;

use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Api, Resource, ResourceExt};

use super::cache::Cached;
use super::context::Context;
use super::names::{
    cost_table_config_map_name, pool_object_name, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER,
};
use crate::crd::{cost_table_name, DSparkCostTable, DSparkDeployment};
use crate::{Error, Result};

/// Names of the objects of one kind that the spec of `dsd` asks for.
pub struct Wanted {
    pub deployments: BTreeSet<String>,
    pub services: BTreeSet<String>,
    pub pdbs: BTreeSet<String>,
    pub config_maps: BTreeSet<String>,
    pub cost_tables: BTreeSet<String>,
}

/// What the spec of `dsd` asks for, by kind.
pub fn wanted(dsd: &DSparkDeployment) -> Wanted {
    let pools = &dsd.spec.pools;
    let per_pool: BTreeSet<String> = pools.iter().map(|p| pool_object_name(dsd, p)).collect();
    let mut services = per_pool.clone();
    services.insert(dsd.name_any());
    Wanted {
        deployments: per_pool.clone(),
        services,
        pdbs: per_pool,
        config_maps: pools
            .iter()
            .map(|p| cost_table_config_map_name(dsd, p))
            .collect(),
        cost_tables: pools
            .iter()
            .filter_map(|p| dsd.cost_table_key(p))
            .map(|k| cost_table_name(&k))
            .collect(),
    }
}

/// Whether `owners` names the object with `uid` as controller.
fn controlled_by(owners: &[OwnerReference], uid: &str) -> bool {
    owners
        .iter()
        .any(|r| r.uid == uid && r.controller == Some(true))
}

/// `(name, uid)` of the objects to delete: controlled by `owner_uid`, not wanted.
pub fn to_prune<'a, K: Resource + 'a>(
    objects: impl IntoIterator<Item = &'a K>,
    owner_uid: &str,
    wanted: &BTreeSet<String>,
) -> Vec<(String, Option<String>)> {
    objects
        .into_iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .filter(|o| controlled_by(o.owner_references(), owner_uid))
        .filter(|o| !wanted.contains(&o.name_any()))
        .map(|o| (o.name_any(), o.uid()))
        .collect()
}

/// Deletes the pool objects of `dsd` that its spec no longer names. Returns `Kind name` of
/// each object deleted.
///
/// `fresh`: list from the API server (the first reconcile of a generation, when pruning has
/// work to do and a cache a moment behind would miss it); else from the watch caches.
pub(super) async fn pool_objects(
    ctx: &Context,
    ns: &str,
    dsd: &DSparkDeployment,
    fresh: bool,
) -> Result<Vec<String>> {
    let Some(uid) = dsd.uid() else {
        return Ok(Vec::new());
    };
    let w = wanted(dsd);
    let mut done = Vec::new();
    done.extend(prune_kind::<Deployment>(ctx, ns, dsd, &uid, &w.deployments, fresh).await?);
    done.extend(prune_kind::<Service>(ctx, ns, dsd, &uid, &w.services, fresh).await?);
    done.extend(prune_kind::<PodDisruptionBudget>(ctx, ns, dsd, &uid, &w.pdbs, fresh).await?);
    done.extend(prune_kind::<ConfigMap>(ctx, ns, dsd, &uid, &w.config_maps, fresh).await?);
    Ok(done)
}

/// The objects of kind `K` in `ns` labelled as made for `dsd`: listed, or cached.
async fn labelled<K: Cached>(
    ctx: &Context,
    ns: &str,
    dsd: &DSparkDeployment,
    fresh: bool,
) -> Result<Vec<Arc<K>>> {
    let name = dsd.name_any();
    let selector = format!("{LABEL_DEPLOYMENT}={name}");
    if fresh {
        let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
        let list = api
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|source| Error::Prune {
                kind: K::kind(&()).into(),
                name: format!("(list in {ns})"),
                source,
            })?;
        return Ok(list.items.into_iter().map(Arc::new).collect());
    }
    let by_label = BTreeMap::from([(LABEL_DEPLOYMENT.to_string(), name)]);
    Ok(super::cache::selected(K::store(&ctx.caches), ns, &by_label)
        .into_iter()
        .map(Arc::new)
        .collect())
}

async fn prune_kind<K: Cached>(
    ctx: &Context,
    ns: &str,
    dsd: &DSparkDeployment,
    uid: &str,
    wanted: &BTreeSet<String>,
    fresh: bool,
) -> Result<Vec<String>> {
    let kind = K::kind(&()).to_string();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let cached = labelled::<K>(ctx, ns, dsd, fresh).await?;
    let mut done = Vec::new();
    for (name, object_uid) in to_prune(cached.iter().map(|o| o.as_ref()), uid, wanted) {
        let dp = DeleteParams::background().preconditions(Preconditions {
            uid: object_uid,
            resource_version: None,
        });
        match api.delete(&name, &dp).await {
            Ok(_) => done.push(format!("{kind} {name}")),
            // Gone already, or replaced by a namesake: nothing of ours to delete.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(source) => {
                return Err(Error::Prune {
                    kind: kind.clone(),
                    name,
                    source,
                })
            }
        }
    }
    Ok(done)
}

/// Cost tables to release: those that name `owner_uid` among their owners (as index `i` of
/// `ownerReferences`) but are not wanted.
pub fn to_release<'a>(
    tables: impl IntoIterator<Item = &'a DSparkCostTable>,
    owner_uid: &str,
    wanted: &BTreeSet<String>,
) -> Vec<(String, usize)> {
    tables
        .into_iter()
        .filter(|t| t.meta().deletion_timestamp.is_none())
        .filter(|t| !wanted.contains(&t.name_any()))
        .filter_map(|t| {
            let i = t
                .owner_references()
                .iter()
                .position(|r| r.uid == owner_uid)?;
            Some((t.name_any(), i))
        })
        .collect()
}

/// What happened to a cost table this deployment stopped using.
#[derive(Debug, Clone, PartialEq)]
pub enum Released {
    /// Other deployments still use it: only this deployment's owner reference went.
    Kept(String),
    /// Nobody uses it any more: deleted (its profiling Jobs go with it).
    Deleted(String),
}

/// Releases the cost tables `dsd` no longer uses: removes this deployment's owner reference
/// (a JSON patch that tests the reference's uid at its index, so a concurrent change of the
/// list makes it fail instead of removing another owner; the next reconcile tries again), then
/// deletes a table left without owners (precondition: the resource version just written, so
/// a deployment that took the table up meanwhile keeps it).
///
/// `fresh` as for [`pool_objects`]. Returns what was released and whether every release
/// went through (false when a concurrent change made one wait for the next reconcile).
pub(super) async fn cost_tables(
    ctx: &Context,
    ns: &str,
    dsd: &DSparkDeployment,
    fresh: bool,
) -> Result<(Vec<Released>, bool)> {
    let Some(uid) = dsd.uid() else {
        return Ok((Vec::new(), true));
    };
    let api: Api<DSparkCostTable> = Api::namespaced(ctx.client.clone(), ns);
    let err = |name: String| {
        move |source| Error::Prune {
            kind: "DSparkCostTable".into(),
            name,
            source,
        }
    };
    let managed = format!("{LABEL_MANAGED_BY}={MANAGER}");
    let cached: Vec<Arc<DSparkCostTable>> = if fresh {
        api.list(&ListParams::default().labels(&managed))
            .await
            .map_err(err(format!("(list in {ns})")))?
            .items
            .into_iter()
            .map(Arc::new)
            .collect()
    } else {
        ctx.caches
            .cost_tables
            .state()
            .into_iter()
            .filter(|t| t.meta().namespace.as_deref() == Some(ns))
            .collect()
    };
    let mut done = Vec::new();
    let mut complete = true;
    for (name, i) in to_release(
        cached.iter().map(|t| t.as_ref()),
        &uid,
        &wanted(dsd).cost_tables,
    ) {
        let patch: Patch<()> = Patch::Json(
            serde_json::from_value(serde_json::json!([
                {"op": "test", "path": format!("/metadata/ownerReferences/{i}/uid"), "value": uid},
                {"op": "remove", "path": format!("/metadata/ownerReferences/{i}")},
            ]))
            .map_err(|source| Error::Serialize {
                what: "owner-reference patch",
                source,
            })?,
        );
        let table = match api
            .patch(
                &name,
                &PatchParams {
                    field_manager: Some(MANAGER.into()),
                    ..Default::default()
                },
                &patch,
            )
            .await
        {
            Ok(t) => {
                ctx.caches.forget::<DSparkCostTable>(ns, &name);
                t
            }
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            // Its owners changed under us (the test op failed): next reconcile.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 422 => {
                complete = false;
                continue;
            }
            Err(e) => return Err(err(name)(e)),
        };
        if !table.owner_references().is_empty() {
            done.push(Released::Kept(name));
            continue;
        }
        let dp = DeleteParams::background().preconditions(Preconditions {
            uid: table.uid(),
            resource_version: table.resource_version(),
        });
        match api.delete(&name, &dp).await {
            Ok(_) => done.push(Released::Deleted(name)),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(kube::Error::Api(e)) if e.code == 409 => complete = false,
            Err(e) => return Err(err(name)(e)),
        }
    }
    Ok((done, complete))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::pool::tests::sample;

    fn owned_by(name: &str, uid: &str, controller: bool) -> Deployment {
        let mut d = Deployment::default();
        d.metadata.name = Some(name.into());
        d.metadata.uid = Some(format!("{name}-uid"));
        d.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "serving.dspark.dev/v1alpha1".into(),
            kind: "DSparkDeployment".into(),
            name: "qwen3-8b".into(),
            uid: uid.into(),
            controller: Some(controller),
            block_owner_deletion: None,
        }]);
        d
    }

    #[test]
    fn wanted_names_every_object_of_the_spec() {
        let d = sample();
        let w = wanted(&d);
        let v = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>();
        assert_eq!(v(&w.deployments), ["qwen3-8b-a100", "qwen3-8b-h100"]);
        assert_eq!(
            v(&w.services),
            ["qwen3-8b", "qwen3-8b-a100", "qwen3-8b-h100"]
        );
        assert_eq!(
            v(&w.config_maps),
            ["qwen3-8b-a100-cost-table", "qwen3-8b-h100-cost-table"]
        );
        assert_eq!(w.cost_tables.len(), 2);
    }

    #[test]
    fn only_unwanted_objects_this_deployment_controls_are_pruned() {
        let wanted = BTreeSet::from(["qwen3-8b-h100".to_string()]);
        let mut deleting = owned_by("qwen3-8b-old", "uid-1", true);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-11-29T10:00:00Z".parse().unwrap(),
            ));
        let objects = [
            owned_by("qwen3-8b-h100", "uid-1", true),
            owned_by("qwen3-8b-a100", "uid-1", true),
            owned_by("qwen3-8b-l4", "uid-2", true),
            owned_by("qwen3-8b-t4", "uid-1", false),
            Deployment {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some("qwen3-8b-notes".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
            deleting,
        ];
        assert_eq!(
            to_prune(&objects, "uid-1", &wanted),
            [(
                "qwen3-8b-a100".to_string(),
                Some("qwen3-8b-a100-uid".to_string())
            )]
        );
    }

    #[test]
    fn tables_are_released_by_this_owners_index_only_when_unwanted() {
        let owner = |uid: &str| OwnerReference {
            api_version: "serving.dspark.dev/v1alpha1".into(),
            kind: "DSparkDeployment".into(),
            name: uid.into(),
            uid: uid.into(),
            controller: None,
            block_owner_deletion: None,
        };
        let table = |name: &str, owners: &[&str]| {
            let spec = crate::crd::DSparkCostTableSpec {
                model_id: "m".into(),
                drafter_id: None,
                engine_version: "0.1.0".into(),
                node_type: "h100-80gb".into(),
            };
            let mut t = DSparkCostTable::new(name, spec);
            t.metadata.owner_references = Some(owners.iter().map(|u| owner(u)).collect());
            t
        };
        let tables = [
            table("old-shared", &["uid-0", "uid-1"]),
            table("old-mine", &["uid-1"]),
            table("current", &["uid-1", "uid-2"]),
            table("others", &["uid-2"]),
        ];
        let wanted = BTreeSet::from(["current".to_string()]);
        assert_eq!(
            to_release(&tables, "uid-1", &wanted),
            [("old-shared".to_string(), 1), ("old-mine".to_string(), 0)]
        );
    }
}
