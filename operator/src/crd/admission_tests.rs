//! The CRD's admission rules against the contract they enforce, and against the apiserver's
//! CEL cost limits.
//!
//! - The rules that spell a contract grammar (the source URI, the experiment arms, the Hub
//!   files) are evaluated from the GENERATED schema on a table of valid and invalid strings,
//!   and must agree with the contract's parser on each: a disagreement fails here.
//! - The enums of speculation modes and scheduler policies in the schema are the contract's
//!   `ALL` lists.
//! - Every CEL rule that walks a string or a list reads only bounded ones, and its estimated
//!   cost (the apiserver's model: string traversal 0.1 per character times 0.25 per regex
//!   character, times the list sizes it iterates) stays under the per-call budget.

use serde_json::{json, Value};

use super::schema_check::{refusals, schema};
use dspark_types::contract::experiment::{arm_pattern, parse_arm};
use dspark_types::contract::source::{hf_file_pattern, SourceUri};
use dspark_types::{PolicyKind, Speculation};

/// The smallest valid manifest, with `f` applied to its JSON.
fn manifest(f: impl FnOnce(&mut Value)) -> Value {
    let mut v = json!({
        "apiVersion": "serving.dspark.dev/v1alpha1",
        "kind": "DSparkDeployment",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"uri": "hf://o/r"},
            "pools": [{"name": "gpu", "nodeType": "a100", "maxReplicas": 2}],
            "slo": {"ttftP95Ms": 500, "itlP95Ms": 50},
        }
    });
    f(&mut v);
    v
}

/// Whether the manifest with `f` applied is refused with a message containing `needle`.
fn refused(needle: &str, f: impl FnOnce(&mut Value)) -> bool {
    refusals(&manifest(f)).iter().any(|m| m.contains(needle))
}

#[test]
fn the_minimal_manifest_is_admitted() {
    assert_eq!(refusals(&manifest(|_| {})), Vec::<String>::new());
}

/// The `uri` rule in the generated CRD accepts exactly what the contract's parser admits.
#[test]
fn the_uri_rule_is_the_contracts_grammar() {
    let table = [
        "hf://o/r",
        "hf://Qwen/Qwen3-0.6B",
        "hf://o/r@main",
        "hf://o/r@v1.0/sub/model.Q4_1.gguf",
        "hf://o/r@a@b/x",
        "hf://o/r/",
        "hf://o/r/a.json,*.safetensors,b/*.gguf",
        "hf://o/r/.hidden/x",
        "hf://o/r/.../x",
        "hf://o/r/./x",
        "hf://o/r/../x",
        "hf://o/r/a,,b",
        "hf://o/r/a,",
        "hf://o/r//x",
        "hf://o/r@/x",
        "hf://o/r@",
        "hf://justone",
        "hf://o/r x",
        "hf://o/r/é",
        "hf://o/r/a b",
        "hf://o!/r",
        "HF://o/r",
        "s3://b/k",
        "s3://b/k/",
        "s3://b/",
        "s3:///k",
        "s3://b",
        "https://h",
        "https://h/p?x=1#f",
        "https:///x",
        "https://h/a b",
        "http://h/x",
        "file:///models/a.gguf",
        "/models/a.gguf",
        "models/a.gguf",
        "gs://b/k",
        "",
        " hf://o/r",
    ];
    for s in table {
        let admitted = SourceUri::parse_admissible(s).is_ok();
        let rule_admits = !refused("unknown model URI scheme", |v| {
            v["spec"]["model"]["uri"] = json!(s)
        });
        assert_eq!(rule_admits, admitted, "'{s}': CRD rule vs contract parser");
    }
}

/// The arms rule in the generated CRD accepts exactly what the contract's parser accepts.
#[test]
fn the_arm_rule_is_the_contracts_grammar() {
    let table = [
        "dspark",
        "none",
        "fixed:1",
        "fixed:9",
        "fixed:10",
        "fixed:59",
        "fixed:64",
        "fixed:65",
        "fixed:100",
        "fixed:0",
        "fixed:07",
        "fixed:",
        "fixed",
        "threshold:0",
        "threshold:1",
        "threshold:.5",
        "threshold:0.5",
        "threshold:1.0",
        "threshold:1.00",
        "threshold:1.5",
        "threshold:2",
        "threshold:00.5",
        "threshold:0.",
        "threshold:1e-1",
        "threshold:+0.5",
        "threshold:",
        "dspark:1",
        "ngram",
        "DSPARK",
    ];
    let re = regex::Regex::new(&arm_pattern()).unwrap();
    for a in table {
        let parsed = parse_arm(a).is_ok();
        assert_eq!(re.is_match(a), parsed, "'{a}': pattern vs contract parser");
        let other = if a == "none" { "dspark" } else { "none" };
        let rule_admits = !refused("scheduler.experiment.arms: each arm", |v| {
            v["spec"]["scheduler"] = json!({"experiment": {"arms": [other, a]}})
        });
        assert_eq!(rule_admits, parsed, "'{a}': CRD rule vs contract parser");
    }
}

/// A typed Hub source's files are admitted exactly when the URI the operator formats from
/// them is one the contract admits.
#[test]
fn the_hub_files_rule_matches_the_formatted_uri() {
    let re = regex::Regex::new(&hf_file_pattern()).unwrap();
    for f in [
        "m.gguf",
        "/m.gguf",
        "//x/m.gguf",
        "sub/m.gguf",
        "*.safetensors",
        "a,b",
        "../x",
        "a//b",
        "a/..",
        ".x",
        "a b",
        "",
        "/",
    ] {
        let admitted = !refused("huggingFace.files", |v| {
            v["spec"]["model"] = json!({"huggingFace": {"repo": "o/r", "files": [f]}})
        });
        let uri = format!("hf://o/r/{}", f.trim_start_matches('/'));
        let parses = !f.trim_start_matches('/').is_empty()
            && SourceUri::parse_admissible(&uri).is_ok()
            && !f.contains(',');
        assert_eq!(admitted, parses, "'{f}' ({uri})");
        assert_eq!(re.is_match(f), parses, "'{f}': pattern");
    }
}

/// The schema's speculation and policy values are the contract's lists.
#[test]
fn enums_are_the_contracts_lists() {
    let s = schema();
    let spec = &s["properties"]["spec"]["properties"];
    let values = |v: &Value| -> Vec<String> {
        v["enum"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect()
    };
    let want: Vec<_> = Speculation::ALL
        .iter()
        .map(|k| k.flag().to_string())
        .collect();
    assert_eq!(values(&spec["speculation"]), want);
    let mut want: Vec<_> = PolicyKind::ALL
        .iter()
        .map(|k| k.flag().to_string())
        .collect();
    want.insert(0, "none".into());
    assert_eq!(values(&spec["scheduler"]["properties"]["policy"]), want);
}

/// One case: the error expected and the edit that provokes it.
type Case = (&'static str, Box<dyn FnOnce(&mut Value)>);

/// The held-out cases of issue 51 and the other fields the operator copies into pods are
/// refused, each naming its field.
#[test]
fn fields_copied_into_pods_are_validated() {
    let cases: Vec<Case> = vec![
        (
            "hostPath.path must be an absolute path",
            Box::new(|v| {
                v["spec"]["model"] =
                    json!({"hostPath": {"path": "models/x.gguf"}, "allowHostPath": true})
            }),
        ),
        (
            "autoscaling.prometheusUrl must be an http",
            Box::new(|v| {
                v["spec"]["autoscaling"] =
                    json!({"metricsSource": "Prometheus", "prometheusUrl": "prometheus:9090"})
            }),
        ),
        (
            "spec.pools[].maxReplicas must be at most 1000",
            Box::new(|v| v["spec"]["pools"][0]["maxReplicas"] = json!(4_000_000)),
        ),
        (
            "spec.pools[].gpu.resourceName must be an extended resource",
            Box::new(|v| v["spec"]["pools"][0]["gpu"] = json!({"resourceName": "nvidia gpu"})),
        ),
        (
            "spec.pools[0].tolerations[0].operator",
            Box::new(|v| {
                v["spec"]["pools"][0]["tolerations"] = json!([{"key": "k", "operator": "In"}])
            }),
        ),
        (
            "spec.pools[0].tolerations[0].effect",
            Box::new(|v| {
                v["spec"]["pools"][0]["tolerations"] =
                    json!([{"key": "k", "operator": "Exists", "effect": "Never"}])
            }),
        ),
        (
            "spec.pools[0].nodeSelector[k]",
            Box::new(|v| v["spec"]["pools"][0]["nodeSelector"] = json!({"k": "not a label value"})),
        ),
        (
            "spec.engine.env[0].name",
            Box::new(|v| v["spec"]["engine"] = json!({"env": [{"name": "A=B", "value": "x"}]})),
        ),
        (
            "spec.engine.imagePullPolicy",
            Box::new(|v| v["spec"]["engine"] = json!({"imagePullPolicy": "Sometimes"})),
        ),
        (
            "spec.engine.image",
            Box::new(|v| v["spec"]["engine"] = json!({"image": "dspark engine"})),
        ),
        (
            "spec.replicas",
            Box::new(|v| v["spec"]["replicas"] = json!(-1)),
        ),
        (
            "spec.model.pvc.claimName",
            Box::new(|v| v["spec"]["model"] = json!({"pvc": {"claimName": "Models", "path": "m"}})),
        ),
        (
            "spec.model.pvc.path",
            Box::new(|v| {
                v["spec"]["model"] = json!({"pvc": {"claimName": "models", "path": "../etc"}})
            }),
        ),
        (
            "spec.podTemplate.spec.serviceAccountName",
            Box::new(|v| {
                v["spec"]["podTemplate"] = json!({"spec": {"serviceAccountName": "Not_A_Name"}})
            }),
        ),
        (
            "spec.podTemplate.spec.imagePullSecrets[0].name",
            Box::new(|v| {
                v["spec"]["podTemplate"] = json!({"spec": {"imagePullSecrets": [{"name": "a b"}]}})
            }),
        ),
        (
            "s3.endpoint must be an http",
            Box::new(|v| {
                v["spec"]["model"] = json!({"s3": {"uri": "s3://b/k", "endpoint": "minio:9000"}})
            }),
        ),
        (
            "spec.slo.windowSeconds",
            Box::new(|v| v["spec"]["slo"]["windowSeconds"] = json!(10_000_000)),
        ),
        (
            "spec.scheduler.gamma",
            Box::new(|v| v["spec"]["scheduler"] = json!({"gamma": 65})),
        ),
        (
            "spec.speculation",
            Box::new(|v| v["spec"]["speculation"] = json!("dspark")),
        ),
    ];
    for (needle, f) in cases {
        let m = manifest(f);
        let r = refusals(&m);
        assert!(r.iter().any(|x| x.contains(needle)), "{needle}: {r:?}");
    }
}

/// Every CEL rule of the CRD, with the schema node it sits on and how many times it can run
/// per object (the product of the list sizes above it).
fn rules(node: &Value, times: u64, out: &mut Vec<(String, Value, u64)>) {
    for r in node["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.push((r["rule"].as_str().unwrap().to_string(), node.clone(), times));
    }
    if let Some(p) = node["properties"].as_object() {
        for v in p.values() {
            rules(v, times, out);
        }
    }
    if node["items"].is_object() {
        let n = node["maxItems"].as_u64().unwrap_or(u64::MAX / 1_000_000);
        rules(&node["items"], times.saturating_mul(n), out);
    }
    if node["additionalProperties"].is_object() {
        let n = node["maxProperties"]
            .as_u64()
            .unwrap_or(u64::MAX / 1_000_000);
        rules(&node["additionalProperties"], times.saturating_mul(n), out);
    }
}

/// Rules that walk strings or lists read only bounded ones, and cost little.
#[test]
fn cel_rules_are_bounded_and_cheap() {
    let mut all = Vec::new();
    rules(&schema(), 1, &mut all);
    assert!(all.len() >= 30, "{} rules", all.len());
    for (rule, node, times) in &all {
        // The rule's estimated cost: each `matches` costs 0.1 per character of the string
        // times 0.25 per character of the regex; inside `.all(...)` times the list's size.
        let mut cost = 1.0;
        if let Some(i) = rule.find(".matches('") {
            let pattern_len = rule[i + 10..].find("')").unwrap() as f64;
            let (len, n) = if rule.starts_with("self.matches(") {
                (node["maxLength"].as_f64(), 1.0)
            } else if rule.starts_with("self.all(") {
                (
                    node["items"]["maxLength"].as_f64(),
                    node["maxItems"].as_f64().unwrap_or(f64::INFINITY),
                )
            } else if let Some((list, _)) = rule
                .strip_prefix("self.")
                .and_then(|r| r.split_once(".all("))
            {
                let l = &node["properties"][list];
                (
                    l["items"]["maxLength"].as_f64(),
                    l["maxItems"].as_f64().unwrap_or(f64::INFINITY),
                )
            } else if rule.starts_with("self.metadata.name.") {
                // The apiserver bounds object names (253).
                (Some(253.0), 1.0)
            } else {
                (None, 1.0)
            };
            let len = len.unwrap_or_else(|| panic!("{rule}: matches on an unbounded string"));
            cost = n * (1.0 + len * 0.1).ceil() * (pattern_len * 0.25).ceil();
        }
        assert!(cost < 1_000_000.0, "{rule}: estimated cost {cost}");
        assert!(
            cost * (*times as f64) < 10_000_000.0,
            "{rule}: runs {times} times at {cost}"
        );
        for walk in [".all(", ".exists(", ".exists_one(", ".filter(", ".map("] {
            if let Some(list) = rule
                .strip_prefix("self.")
                .and_then(|r| r.split(walk).next())
            {
                if rule.contains(walk) && !list.contains(['(', ' ', '.']) {
                    let l = &node["properties"][list];
                    assert!(
                        l["maxItems"].is_u64() || l["maxProperties"].is_u64(),
                        "{rule}: walks the unbounded {list}"
                    );
                }
            }
        }
    }
}
