//! The admin API and the cost table in force, end to end on the real default model: the
//! token is required, bad tables are refused with the reason and the current one stays, an
//! accepted push shows in `/ready`, `/admin/v1/state` and metrics, and the `dspark` policy
//! follows the table (flat: long verify blocks; linear cost: no speculation) while staying
//! lossless.

mod common;

use common::http::{client, error_message, get_json};
use common::{metric, serve, Server};
use dspark_engine::engine::EngineConfig;
use dspark_engine::runtime::AppOptions;
use dspark_engine::speculative::{Speculation, VerifyPolicy};
use serde_json::{json, Value};

const TOKEN: &str = "s3cret-token";

struct Engine {
    api: Server,
    admin: Server,
}

fn spawn(speculation: Speculation, policy: VerifyPolicy) -> Engine {
    spawn_with(speculation, policy, false)
}

fn spawn_with(speculation: Speculation, policy: VerifyPolicy, startup_profile: bool) -> Engine {
    let engine = EngineConfig {
        speculation,
        policy,
        ..Default::default()
    };
    spawn_cfg(engine, startup_profile)
}

fn spawn_cfg(engine: EngineConfig, startup_profile: bool) -> Engine {
    let state = common::engine::start(AppOptions {
        served_model_name: Some("smollm2".into()),
        engine,
        startup_profile,
        ..common::engine::options(common::smollm2())
    });
    Engine {
        admin: serve(dspark_engine::server::admin::router(
            state.clone(),
            TOKEN.into(),
        )),
        api: serve(dspark_engine::server::router(state)),
    }
}

fn admin(e: &Engine, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, Value) {
    let c = client();
    let url = format!("{}{path}", e.admin.base);
    let mut r = match method {
        "GET" => c.get(url),
        _ => c.put(url).body(body.to_string()),
    };
    if let Some(t) = token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    let r = r.send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn metrics_text(e: &Engine) -> String {
    common::http::metrics_page(&e.api.base)
}

fn table(model_id: &str, points: &[(u32, f64)]) -> String {
    json!({
        "schema": 1, "model_id": model_id, "engine_version": dspark_engine::VERSION,
        "device": "cpu", "node_type": "test-node", "dtype": "q4_1",
        "measured_at": "2026-11-29T00:00:00Z", "points": points,
    })
    .to_string()
}

/// Greedy completion text and usage.
fn complete(e: &Engine) -> (String, Value) {
    let r: Value = client()
        .post(format!("{}/v1/completions", e.api.base))
        .json(&json!({"model": "smollm2", "prompt": "Count: one two three, one two three, one two three, one two three,",
                      "max_tokens": 24, "temperature": 0, "ignore_eos": true}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    (
        r["choices"][0]["text"].as_str().unwrap().to_string(),
        r["usage"].clone(),
    )
}

#[test]
fn admin_token_cost_table_refusals_and_the_scheduler_following_the_table() {
    let plain = spawn(Speculation::None, VerifyPolicy::Fixed { gamma: 4 });
    let (expected, _) = complete(&plain);
    let e = spawn(Speculation::Ngram, VerifyPolicy::Dspark { gamma: 8 });

    // Built-in default until a table arrives, and /ready says so.
    let r = get_json(format!("{}/ready", e.api.base));
    assert_eq!(r["policy"], "dspark");
    assert_eq!(r["cost_table"]["source"], "default");
    assert_eq!(r["cost_table"]["builtin_default"], true);
    assert_eq!(r["cost_table"]["revision"], 0);

    // The token is required.
    assert_eq!(admin(&e, "GET", "/admin/v1/state", None, "").0, 401);
    assert_eq!(
        admin(&e, "GET", "/admin/v1/state", Some("wrong"), "").0,
        401
    );
    let (code, state) = admin(&e, "GET", "/admin/v1/state", Some(TOKEN), "");
    assert_eq!(code, 200, "{state}");
    assert_eq!(state["cost_table_source"], "default");
    let model_id = state["model_id"].as_str().unwrap().to_string();
    let flat = table(&model_id, &[(1, 100.0), (64, 100.0)]);
    assert_eq!(admin(&e, "PUT", "/admin/v1/cost-table", None, &flat).0, 401);

    // Refusals say why and change nothing.
    for (body, code, why) in [
        ("{oops".to_string(), 400, "not valid JSON"),
        (
            table(&model_id, &[(1, 10.0), (4, 20.0)]),
            400,
            "not monotone",
        ),
        (table(&model_id, &[]), 400, "no points"),
        (
            table("some-other-model", &[(1, 10.0)]),
            409,
            "some-other-model",
        ),
        (
            table(&model_id, &[(1, 10.0)]).replace("\"cpu\"", "\"cuda\""),
            409,
            "device",
        ),
        (
            table(&model_id, &[(1, 10.0)]).replace(dspark_engine::VERSION, "99.0.0"),
            409,
            "incompatible",
        ),
    ] {
        let (c, v) = admin(&e, "PUT", "/admin/v1/cost-table", Some(TOKEN), &body);
        assert_eq!(c, code, "{v}");
        let msg = error_message(&v);
        assert!(msg.contains(why), "{msg}");
        assert_eq!(
            admin(&e, "GET", "/admin/v1/state", Some(TOKEN), "").1["cost_table_revision"],
            0
        );
    }
    let m = metrics_text(&e);
    assert_eq!(metric(&m, "dspark_cost_table_refusals_total"), 6.0);

    // A flat table: verifying is free, the scheduler sends whole blocks; still lossless.
    let (c, v) = admin(&e, "PUT", "/admin/v1/cost-table", Some(TOKEN), &flat);
    assert_eq!(c, 200, "{v}");
    assert_eq!(v["revision"], 1);
    let (text, usage) = complete(&e);
    assert_eq!(text, expected);
    let drafted_flat = usage["draft_tokens"].as_u64().unwrap();
    assert!(drafted_flat >= 8, "flat table but few drafts: {usage}");
    let r = get_json(format!("{}/ready", e.api.base));
    assert_eq!(r["cost_table"]["source"], "admin");
    assert_eq!(r["cost_table"]["revision"], 1);
    assert_eq!(r["cost_table"]["node_type"], "test-node");
    let state = admin(&e, "GET", "/admin/v1/state", Some(TOKEN), "").1;
    assert_eq!(state["cost_table_digest"], v["digest"]);
    assert_eq!(
        admin(&e, "GET", "/admin/v1/cost-table", Some(TOKEN), "").1["node_type"],
        "test-node"
    );

    // Cost linear in B: no draft token can pay for itself, the scheduler verifies none.
    let points: Vec<(u32, f64)> = [1u32, 2, 4, 8, 16, 32, 64]
        .iter()
        .map(|&b| (b, 100.0 / b as f64))
        .collect();
    let (c, v) = admin(
        &e,
        "PUT",
        "/admin/v1/cost-table",
        Some(TOKEN),
        &table(&model_id, &points),
    );
    assert_eq!((c, v["revision"].as_u64()), (200, Some(2)), "{v}");
    let (text, usage) = complete(&e);
    assert_eq!(text, expected);
    assert_eq!(usage["draft_tokens"], 0, "linear cost but drafted: {usage}");
    let m = metrics_text(&e);
    assert_eq!(metric(&m, "dspark_cost_table_revision"), 2.0);
    assert!(metric(&m, "dspark_scheduler_expected_tokens_total") > 0.0);
    assert!(
        metric(&m, "dspark_scheduler_committed_tokens_total") >= 46.0,
        "{m}"
    );
    assert!(m.contains("source=\"admin\"} 1"), "{m}");
    // Unverified n-gram drafts are still scored against the committed tokens.
    let live = metric(&m, "dspark_spec_decode_live_acceptance_rate");
    assert!(live > 0.0 && live < 1.0, "{m}");
}

/// Without a cost table, the dspark policy starts on a table measured on this machine:
/// source `startup_profile`, revision 1, decreasing SPS(B) that is not the built-in formula.
#[test]
fn startup_profile_installs_a_measured_table() {
    let e = spawn_with(Speculation::Ngram, VerifyPolicy::Dspark { gamma: 4 }, true);
    let (code, st) = admin(&e, "GET", "/admin/v1/state", Some(TOKEN), "");
    assert_eq!(code, 200, "{st}");
    assert_eq!(st["cost_table_source"], "startup_profile", "{st}");
    assert_eq!(st["cost_table_revision"], 1, "{st}");
    let (code, t) = admin(&e, "GET", "/admin/v1/cost-table", Some(TOKEN), "");
    assert_eq!(code, 200, "{t}");
    let pts: Vec<(u64, f64)> = t["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    assert_eq!(pts.first().map(|p| p.0), Some(1), "{t}");
    assert_eq!(pts.last().map(|p| p.0), Some(32), "{t}");
    assert!(
        pts.windows(2).all(|w| w[1].1 <= w[0].1),
        "SPS non-increasing: {pts:?}"
    );
    // The built-in default is SPS(B) = 100 / (1 + (B - 1) / 2): a measured table differs.
    assert!(
        pts.iter()
            .any(|&(b, s)| (s - 100.0 / (1.0 + (b as f64 - 1.0) / 2.0)).abs() > 1e-6),
        "{pts:?}"
    );
    let m = metrics_text(&e);
    assert_eq!(
        metric(
            &m,
            "dspark_cost_table_source{model_name=\"smollm2\",source=\"startup_profile\"}"
        ),
        1.0,
        "{m}"
    );
    let (text, _) = complete(&e);
    assert!(!text.is_empty());
}

/// The dspark policy does not run a drafter that cannot pay for itself: an untrained model
/// drafter (acceptance ~0) is skipped on most steps (probed every 16th), and the output stays
/// identical to plain decoding.
#[test]
fn the_dspark_policy_skips_a_drafter_that_does_not_pay() {
    let plain = spawn(Speculation::None, VerifyPolicy::Fixed { gamma: 4 });
    let (expected, _) = complete(&plain);
    // The model drafter alone: prompt lookup (on by default) would propose on some of these
    // steps instead of the gate (tests/spec_lossless.rs covers it).
    let cfg = EngineConfig {
        speculation: Speculation::DSparkMarkov,
        policy: VerifyPolicy::Dspark { gamma: 4 },
        prompt_lookup: false,
        ..Default::default()
    };
    let e = spawn_cfg(cfg, true);
    let (text, usage) = complete(&e);
    assert_eq!(text, expected);
    assert_eq!(usage["completion_tokens"], 24);
    let m = metrics_text(&e);
    let skipped = metric(
        &m,
        "dspark_spec_decode_draft_skipped_steps_total{model_name=\"smollm2\"}",
    );
    let drafts = metric(
        &m,
        "dspark_spec_decode_num_drafts_total{model_name=\"smollm2\"}",
    );
    // 23 decode steps after the prefill's token: most skip the drafter, and at least one
    // probes it (the probe's drafts may or may not be worth verifying).
    assert!(
        (12.0..=22.0).contains(&skipped),
        "skipped {skipped} of 23 steps\n{m}"
    );
    assert!(drafts <= 6.0, "drafts {drafts}\n{m}");
}
