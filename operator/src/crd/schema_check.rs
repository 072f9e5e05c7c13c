//! Test support: what the apiserver would refuse in a DSparkDeployment, client-side. The
//! CEL rules (`x-kubernetes-validations`) through kube's evaluator, and the OpenAPI value
//! validations of the CRD's schema (`pattern`, `enum`, bounds) through a small walker that
//! names each field as the apiserver does (`spec.pools[0].gpu.resourceName`).

use kube::CustomResourceExt;
use serde_json::Value;

use super::DSparkDeployment;

/// The CRD's OpenAPI schema of a DSparkDeployment.
pub fn schema() -> Value {
    let crd = DSparkDeployment::crd();
    let v = &crd.spec.versions[0];
    serde_json::to_value(
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("the CRD has a schema"),
    )
    .expect("a schema serializes")
}

/// Every refusal of `obj` (a manifest as sent): the OpenAPI violations as
/// `PATH: WHAT`, then the CEL rules' messages.
pub fn refusals(obj: &Value) -> Vec<String> {
    let mut out = Vec::new();
    openapi(&schema(), obj, "", &mut out);
    if let Ok(typed) = serde_json::from_value::<DSparkDeployment>(obj.clone()) {
        if let Err(e) = kube::core::cel::validate_cel(&typed) {
            out.extend(e.into_vec().into_iter().map(|e| e.message));
        }
    } else {
        out.push("the manifest does not parse as a DSparkDeployment".into());
    }
    out
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The OpenAPI value validations of `schema` on `v` at `path`.
pub fn openapi(schema: &Value, v: &Value, path: &str, out: &mut Vec<String>) {
    if v.is_null() {
        return;
    }
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            out.push(format!("{path}: Unsupported value: {v}"));
        }
    }
    match v {
        Value::String(s) => {
            let n = s.chars().count() as f64;
            if num("maxLength").is_some_and(|m| n > m) {
                out.push(format!("{path}: Too long"));
            }
            if num("minLength").is_some_and(|m| n < m) {
                out.push(format!("{path}: Too short"));
            }
            if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
                let re =
                    regex::Regex::new(p).unwrap_or_else(|e| panic!("{path}: pattern {p}: {e}"));
                if !re.is_match(s) {
                    out.push(format!("{path}: should match '{p}'"));
                }
            }
        }
        Value::Number(x) => {
            let x = x.as_f64().unwrap_or_default();
            if num("maximum").is_some_and(|m| x > m) {
                out.push(format!("{path}: should be less than or equal to"));
            }
            if num("minimum").is_some_and(|m| x < m) {
                out.push(format!("{path}: should be greater than or equal to"));
            }
        }
        Value::Array(a) => {
            if num("maxItems").is_some_and(|m| a.len() as f64 > m) {
                out.push(format!("{path}: Too many"));
            }
            if num("minItems").is_some_and(|m| (a.len() as f64) < m) {
                out.push(format!("{path}: Too few"));
            }
            if let Some(items) = schema.get("items") {
                for (i, x) in a.iter().enumerate() {
                    openapi(items, x, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::Object(o) => {
            if num("maxProperties").is_some_and(|m| o.len() as f64 > m) {
                out.push(format!("{path}: Too many"));
            }
            let props = schema.get("properties").and_then(Value::as_object);
            let extra = schema.get("additionalProperties").filter(|a| a.is_object());
            for (k, x) in o {
                match (props.and_then(|p| p.get(k)), extra) {
                    (Some(s), _) => openapi(s, x, &join(path, k), out),
                    (None, Some(s)) => openapi(s, x, &format!("{path}[{k}]"), out),
                    (None, None) => {}
                }
            }
        }
        Value::Bool(_) | Value::Null => {}
    }
}
