//! The `InferencePool` (`inference.networking.k8s.io/v1`, Gateway API Inference Extension)
//! kept for `spec.inferencePool`: one per deployment, named after it, selecting every engine
//! pod of every pool (the deployment label plus the engine component label, so profiling
//! pods never serve) on the engines' HTTP port, owned by the deployment (the garbage
//! collector deletes it with it). Removing the field deletes it, by uid and only when this
//! deployment owns it. A cluster without the InferencePool CRD gets a Warning, not an error:
//! the rest of the deployment reconciles as usual.
//!
//! [`body`] is pure; [`sync`] does the I/O (server-side apply through a dynamic API, as
//! `k8s-openapi` has no GIE types).

use dspark_types::contract::ports;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, Preconditions,
};
use kube::{Api, Resource, ResourceExt};
use serde_json::{json, Value};

use super::context::Runtime;
use super::names::{owner, LABEL_COMPONENT, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER};
use super::writers::publish;
use super::Context;
use crate::crd::{DSparkDeployment, FailureMode};
use crate::{Error, Result};
use kube::runtime::events::EventType;
use tracing::{info, warn};

pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";
pub const PLURAL: &str = "inferencepools";

/// The API resource of GIE's v1 InferencePool.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// The InferencePool name of `dsd`: the deployment's own name.
pub fn pool_name(dsd: &DSparkDeployment) -> String {
    dsd.name_any()
}

/// The fields the operator owns in the InferencePool of `dsd`, or None when the spec asks
/// for none.
pub fn body(dsd: &DSparkDeployment) -> Option<Value> {
    let spec = dsd.spec.inference_pool.as_ref()?;
    let picker = &spec.endpoint_picker;
    let mut picker_ref = json!({
        "group": "",
        "kind": "Service",
        "name": picker.name,
        "port": { "number": picker.port },
    });
    if let Some(mode) = picker.failure_mode {
        picker_ref["failureMode"] = json!(match mode {
            FailureMode::FailOpen => "FailOpen",
            FailureMode::FailClose => "FailClose",
        });
    }
    Some(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": KIND,
        "metadata": {
            "name": pool_name(dsd),
            "namespace": dsd.namespace(),
            "labels": {
                LABEL_DEPLOYMENT: dsd.name_any(),
                LABEL_MANAGED_BY: MANAGER,
            },
            "ownerReferences": [owner(dsd)],
        },
        "spec": {
            "selector": { "matchLabels": {
                LABEL_DEPLOYMENT: dsd.name_any(),
                LABEL_COMPONENT: "engine",
            }},
            "targetPorts": [{ "number": ports::HTTP }],
            "endpointPickerRef": picker_ref,
        },
    }))
}

/// What [`sync`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The pool is applied (its name).
    Applied(String),
    /// The spec asks for none and none of this deployment's is left (`true`: one was deleted
    /// now).
    Absent { deleted: bool },
    /// The spec asks for one but the cluster has no InferencePool CRD.
    NoCrd,
}

/// Applies the InferencePool `dsd` asks for, or deletes the one it owns when it asks for
/// none (looked up only when `look` is set: the status says one exists, or the generation
/// is new).
pub async fn sync(ctx: &Context, ns: &str, dsd: &DSparkDeployment, look: bool) -> Result<Outcome> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), ns, &api_resource());
    let name = pool_name(dsd);
    let Some(body) = body(dsd) else {
        if !look {
            return Ok(Outcome::Absent { deleted: false });
        }
        let found = match api.get_opt(&name).await {
            Ok(found) => found,
            // No CRD: nothing can exist. Forbidden: this operator's RBAC (an older chart)
            // does not cover InferencePools, so it cannot have made one.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => None,
            Err(source) => return Err(apply_error(&name, source)),
        };
        let Some(found) = found else {
            return Ok(Outcome::Absent { deleted: false });
        };
        let uid = dsd.meta().uid.clone();
        let owned = found
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref());
        if !owned {
            return Ok(Outcome::Absent { deleted: false });
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: found.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        return match api.delete(&name, &params).await {
            Ok(_) => Ok(Outcome::Absent { deleted: true }),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
                Ok(Outcome::Absent { deleted: false })
            }
            Err(source) => Err(apply_error(&name, source)),
        };
    };
    match api
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(Outcome::Applied(name)),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Outcome::NoCrd),
        Err(source) => Err(apply_error(&name, source)),
    }
}

/// The InferencePool of `spec.inferencePool` applied (or pruned when the field is gone),
/// what exists remembered for the status; a cluster without the CRD gets one Warning per
/// generation.
pub(super) async fn phase(
    ctx: &Context,
    ns: &str,
    dsd: &DSparkDeployment,
    rt: &mut Runtime,
    fresh: bool,
) -> Result<()> {
    let had = dsd.status.as_ref().and_then(|s| s.inference_pool.as_ref());
    let look = fresh || had.is_some() || rt.inference_pool.is_some();
    rt.inference_pool = match sync(ctx, ns, dsd, look).await? {
        Outcome::Applied(name) => Some(name),
        Outcome::Absent { deleted } => {
            if deleted {
                let note = format!(
                    "deleted InferencePool {}: spec.inferencePool is unset",
                    pool_name(dsd)
                );
                info!("{note}");
                publish(ctx, dsd, EventType::Normal, "Pruned", note).await;
            }
            None
        }
        Outcome::NoCrd => {
            if rt.inference_pool_warned != dsd.metadata.generation {
                rt.inference_pool_warned = dsd.metadata.generation;
                let note = format!(
                    "spec.inferencePool is set but the cluster has no InferencePool CRD \
                     ({}.{}/{}): install the Gateway API Inference Extension's CRDs",
                    PLURAL, GROUP, VERSION
                );
                warn!("{note}");
                publish(
                    ctx,
                    dsd,
                    EventType::Warning,
                    "InferencePoolUnavailable",
                    note,
                )
                .await;
            }
            None
        }
    };
    Ok(())
}

fn apply_error(name: &str, source: kube::Error) -> Error {
    Error::Apply {
        kind: KIND.into(),
        name: name.to_string(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{EndpointPicker, InferencePoolSpec};

    fn dsd(pool: Option<InferencePoolSpec>) -> DSparkDeployment {
        let mut d: DSparkDeployment = serde_yaml::from_str(
            "apiVersion: serving.dspark.dev/v1alpha1\nkind: DSparkDeployment\n\
             metadata: {name: coder, namespace: ml, uid: u-1}\n\
             spec:\n  model: {uri: 'hf://Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF'}\n  \
             pools: [{name: a, nodeType: h100, maxReplicas: 2}, {name: b, nodeType: l4, maxReplicas: 2}]\n  \
             slo: {ttftP95Ms: 500, itlP95Ms: 50}\n",
        )
        .unwrap();
        d.spec.inference_pool = pool;
        d
    }

    #[test]
    fn no_field_no_pool() {
        assert_eq!(body(&dsd(None)), None);
    }

    #[test]
    fn the_pool_selects_every_engine_pod_on_the_serving_port() {
        let b = body(&dsd(Some(InferencePoolSpec {
            endpoint_picker: EndpointPicker {
                name: "coder-epp".into(),
                port: 9002,
                failure_mode: Some(FailureMode::FailOpen),
            },
        })))
        .unwrap();
        assert_eq!(b["apiVersion"], "inference.networking.k8s.io/v1");
        assert_eq!(b["metadata"]["name"], "coder");
        assert_eq!(b["metadata"]["namespace"], "ml");
        assert_eq!(b["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(b["metadata"]["ownerReferences"][0]["controller"], true);
        // Both pools' pods (no pool label), never profiling pods (component = engine).
        assert_eq!(
            b["spec"]["selector"]["matchLabels"],
            json!({"serving.dspark.dev/deployment": "coder", "app.kubernetes.io/component": "engine"})
        );
        assert_eq!(b["spec"]["targetPorts"], json!([{"number": 8000}]));
        assert_eq!(
            b["spec"]["endpointPickerRef"],
            json!({"group": "", "kind": "Service", "name": "coder-epp", "port": {"number": 9002}, "failureMode": "FailOpen"})
        );
    }

    #[test]
    fn the_picker_port_defaults_to_gies() {
        let spec: InferencePoolSpec =
            serde_json::from_value(json!({"endpointPicker": {"name": "epp"}})).unwrap();
        assert_eq!(spec.endpoint_picker.port, 9002);
        let b = body(&dsd(Some(spec))).unwrap();
        assert!(b["spec"]["endpointPickerRef"].get("failureMode").is_none());
    }
}
