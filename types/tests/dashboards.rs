//! The dashboards, alert rules and scrape configuration read only metric series the contract
//! defines (`dspark_types::contract::metrics`), and the dashboard generator plots every
//! family: a renamed or dropped family breaks this test, not a panel in production.

use dspark_types::contract::metrics::{family_of, operator, ENGINE};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The checkout under test: `cargo test` sets CARGO_MANIFEST_DIR when it runs the binary (a
/// build cache shared by checkouts at different paths can hand this one a binary compiled
/// in another, whose compile-time value names that other checkout).
fn repo() -> PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR");
    let dir = dir
        .as_deref()
        .unwrap_or(env!("CARGO_MANIFEST_DIR").as_ref());
    Path::new(dir).join("..")
}

/// Files under `dir` (relative to the repository root) ending in `ext`.
fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no {ext} files in {dir}");
    out
}

/// Every `dspark_...` word in `text` (not the tail of a longer word such as a relabelled
/// pod label `..._serving_dspark_dev_pool`).
fn metric_words(text: &str) -> BTreeSet<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("dspark_") {
        if text[..i].chars().next_back().is_some_and(word) {
            continue;
        }
        let end = text[i..]
            .find(|c: char| !word(c))
            .map_or(text.len(), |n| i + n);
        out.insert(text[i..end].to_string());
    }
    out
}

/// A series a query reads, or a family named in a description.
fn known(word: &str) -> bool {
    family_of(word).is_some() || ENGINE.iter().chain(operator::ALL).any(|f| f.name == word)
}

#[test]
fn dashboards_and_rules_read_only_contract_series() {
    let mut sources = vec![repo().join("config/grafana/generate.py")];
    sources.extend(files("config/grafana", ".json"));
    sources.extend(files("charts/dspark-operator/dashboards", ".json"));
    sources.extend(files("config/prometheus", ".yaml"));
    sources.extend(files("charts/dspark-operator/templates", ".yaml"));
    let mut unknown = Vec::new();
    let mut seen = 0;
    for path in &sources {
        let text = std::fs::read_to_string(path).unwrap();
        for w in metric_words(&text) {
            seen += 1;
            if !known(&w) {
                unknown.push(format!("{}: {w}", path.display()));
            }
        }
    }
    assert!(
        seen > 50,
        "only {seen} metric names found: is the scan broken?"
    );
    assert!(
        unknown.is_empty(),
        "series the contract does not define:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn the_dashboard_generator_plots_every_family() {
    let text = std::fs::read_to_string(repo().join("config/grafana/generate.py")).unwrap();
    let words = metric_words(&text);
    let missing: Vec<&str> = ENGINE
        .iter()
        .chain(operator::ALL)
        .filter(|f| !words.iter().any(|w| f.owns(w) || w == f.name))
        .map(|f| f.name)
        .collect();
    assert!(missing.is_empty(), "families on no panel: {missing:?}");
}

#[test]
fn the_scan_finds_names_and_skips_label_tails() {
    let w = metric_words(
        "rate(dspark_engine_steps_total[1m]) __meta_kubernetes_pod_label_serving_dspark_dev_pool",
    );
    assert_eq!(
        w.into_iter().collect::<Vec<_>>(),
        ["dspark_engine_steps_total"]
    );
    assert!(known("dspark_engine_steps_total"));
    assert!(!known("dspark_engine_step_total"));
}
