//! What the apiserver checks at admission beyond the types: the Kubernetes name and value
//! formats the operator copies into pods (the same rules Kubernetes applies to those pod
//! fields), bounds, and the schema transforms that put them on the Kubernetes types the spec
//! embeds (tolerations, environment variables, object references).
//!
//! Rules on the operator's own strings are CEL (`x-kubernetes-validations`, a message that
//! names the field, checked client-side by the unit tests); rules inside embedded Kubernetes
//! types are OpenAPI (`pattern`, `enum`, bounds: no CEL cost, and the apiserver names the
//! field path). Every string and list a CEL rule reads is bounded, so each rule's estimated
//! cost stays far below the apiserver's per-rule budget.
//!
//! The patterns are RE2 and Rust `regex` syntax without a backslash, so they can also sit in
//! a CEL string literal.

use schemars::Schema;
use serde_json::{json, Value};

/// A DNS-1123 label (Service, pool and container names).
pub const DNS1123_LABEL: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// A DNS-1123 subdomain (Secret, ConfigMap, PVC, ServiceAccount, PriorityClass names).
pub const DNS1123_SUBDOMAIN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A qualified name with an optional DNS prefix (label keys, toleration keys, resources).
pub const QUALIFIED_NAME: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$";
/// An extended resource name (`DOMAIN/NAME`, e.g. `nvidia.com/gpu`, `amd.com/gpu`).
pub const EXTENDED_RESOURCE: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$";
/// A label value (empty, or letters, digits, `-`, `_`, `.` starting and ending alphanumeric).
pub const LABEL_VALUE: &str = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";
/// An environment variable name (the C identifier-like names every runtime accepts).
pub const ENV_NAME: &str = "^[-._a-zA-Z][-._a-zA-Z0-9]*$";
/// An `http://` or `https://` URL with a host (printable ASCII, no spaces).
pub const HTTP_URL: &str = "^https?://[!-.0-~]+(/[!-~]*)?$";
/// One path component: printable ASCII but `/`, not `..` (`[!-,0-~-]` is any but `/` and
/// `.`; `[!-.0-~]` any but `/`).
macro_rules! component {
    () => {
        "([!-,0-~-][!-.0-~]*|[.]|[.][!-,0-~-][!-.0-~]*|[.][.][!-.0-~]+)"
    };
}
/// An absolute path on a node, without a `..` component (what a hostPath volume needs: the
/// engine would read a relative one from its working directory).
pub const ABSOLUTE_PATH: &str = concat!("^(/", component!(), ")+/?$");
/// A path inside a volume, without a `..` component (leading `/`s are ignored; `/` alone is
/// the volume's root).
pub const VOLUME_PATH: &str = concat!("^(/*", component!(), "(/", component!(), ")*/?|/+)$");
/// An image reference (printable ASCII, no spaces).
pub const IMAGE_REFERENCE: &str = "^[!-~]+$";
/// The image pull policies.
pub const PULL_POLICIES: [&str; 3] = ["Always", "IfNotPresent", "Never"];
/// The toleration operators and effects.
pub const TOLERATION_OPERATORS: [&str; 2] = ["Exists", "Equal"];
pub const TAINT_EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];

/// Bounds of what the spec embeds (lists, maps, strings).
pub const MAX_TOLERATIONS: u64 = 32;
pub const MAX_ENV: u64 = 128;
pub const MAX_ARGS: u64 = 64;
pub const MAX_ARG_LENGTH: u64 = 4096;
pub const MAX_SELECTOR_TERMS: u64 = 32;
pub const MAX_PULL_SECRETS: u64 = 16;
/// Replicas of one pool (a Deployment's replicas are an int32; a pool above this is a typo).
pub const MAX_POOL_REPLICAS: i64 = 1000;
/// The spec's total (`spec.replicas`): every pool at its maximum.
pub const MAX_TOTAL_REPLICAS: i64 = 8 * MAX_POOL_REPLICAS;

/// `x` as `self.matches('PATTERN')` for a CEL rule.
pub fn matches(pattern: &str) -> String {
    format!("self.matches('{pattern}')")
}

/// The object schema of a list's items (inlined by kube's generator).
fn items(schema: &mut Schema) -> Option<&mut serde_json::Map<String, Value>> {
    schema.get_mut("items")?.as_object_mut()
}

/// Sets `keyword` on property `name` of the object schema `obj`.
fn constrain(obj: &mut serde_json::Map<String, Value>, name: &str, keyword: &str, v: Value) {
    if let Some(p) = obj
        .get_mut("properties")
        .and_then(|p| p.get_mut(name))
        .and_then(Value::as_object_mut)
    {
        p.insert(keyword.into(), v);
    }
}

/// `tolerations`: at most [`MAX_TOLERATIONS`]; an operator of `Exists` / `Equal`, an effect
/// of the taint effects, a key that is a qualified name and a value that is a label value
/// (what Kubernetes checks on a pod's tolerations).
pub fn tolerations(schema: &mut Schema) {
    schema.insert("maxItems".into(), json!(MAX_TOLERATIONS));
    if let Some(t) = items(schema) {
        constrain(t, "operator", "enum", json!(TOLERATION_OPERATORS));
        constrain(t, "effect", "enum", json!(TAINT_EFFECTS));
        constrain(t, "key", "maxLength", json!(317));
        constrain(t, "key", "pattern", json!(QUALIFIED_NAME));
        constrain(t, "value", "maxLength", json!(63));
        constrain(t, "value", "pattern", json!(LABEL_VALUE));
    }
}

/// `env`: at most [`MAX_ENV`] variables with names Kubernetes accepts.
pub fn env(schema: &mut Schema) {
    schema.insert("maxItems".into(), json!(MAX_ENV));
    if let Some(e) = items(schema) {
        constrain(e, "name", "maxLength", json!(253));
        constrain(e, "name", "pattern", json!(ENV_NAME));
    }
}

/// A list of `{name}` references (image pull secrets): bounded, each a DNS-1123 subdomain.
pub fn name_refs(schema: &mut Schema) {
    schema.insert("maxItems".into(), json!(MAX_PULL_SECRETS));
    if let Some(r) = items(schema) {
        constrain(r, "name", "maxLength", json!(253));
        constrain(r, "name", "pattern", json!(DNS1123_SUBDOMAIN));
    }
}

/// One `{name}` reference (an S3 credentials Secret): a DNS-1123 subdomain.
pub fn name_ref(schema: &mut Schema) {
    if let Some(o) = schema.as_object_mut() {
        constrain(o, "name", "maxLength", json!(253));
        constrain(o, "name", "pattern", json!(DNS1123_SUBDOMAIN));
    }
}

/// A node selector: bounded, values that are label values. (Keys are checked by the
/// operator's CEL rule for their length; a map key cannot carry an OpenAPI pattern.)
pub fn node_selector(schema: &mut Schema) {
    schema.insert("maxProperties".into(), json!(MAX_SELECTOR_TERMS));
    if let Some(v) = schema
        .get_mut("additionalProperties")
        .and_then(Value::as_object_mut)
    {
        v.insert("maxLength".into(), json!(63));
        v.insert("pattern".into(), json!(LABEL_VALUE));
    }
}

/// `args`: bounded list of bounded strings.
pub fn args(schema: &mut Schema) {
    schema.insert("maxItems".into(), json!(MAX_ARGS));
    if let Some(a) = schema.get_mut("items").and_then(Value::as_object_mut) {
        a.insert("maxLength".into(), json!(MAX_ARG_LENGTH));
    }
}

/// An image pull policy.
pub fn pull_policy(schema: &mut Schema) {
    let mut values: Vec<Value> = PULL_POLICIES.iter().map(|p| json!(p)).collect();
    // An `Option`'s schema admits null (a `null` type, later `nullable`); so must its `enum`.
    let null = json!("null");
    let admits_null = match schema.get("type") {
        Some(Value::Array(types)) => types.contains(&null),
        Some(t) => *t == null,
        None => false,
    };
    if admits_null || schema.get("nullable") == Some(&json!(true)) {
        values.push(Value::Null);
    }
    schema.insert("enum".into(), Value::Array(values));
}
