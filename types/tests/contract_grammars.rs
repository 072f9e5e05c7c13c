//! The source-URI and experiment-arm grammars of `dspark_types::contract`: what parses, what
//! is refused and with which message, and display round trips.

use dspark_types::contract::experiment::{parse_arm, parse_arms, ArmKind, MAX_GAMMA};
use dspark_types::contract::source::SourceUri;

#[test]
fn sources_parse_display_and_say_whether_they_are_remote() {
    let hf = |r: &str, v: Option<&str>, f: Option<&str>| SourceUri::HuggingFace {
        repo: r.into(),
        revision: v.map(Into::into),
        file: f.map(Into::into),
    };
    let p = |s: &str| s.parse::<SourceUri>().unwrap();
    assert_eq!(p("hf://Qwen/Qwen3-0.6B"), hf("Qwen/Qwen3-0.6B", None, None));
    assert_eq!(
        p("hf://org/repo@v1.0/sub/model.Q4_1.gguf"),
        hf("org/repo", Some("v1.0"), Some("sub/model.Q4_1.gguf"))
    );
    assert_eq!(
        p("/models/a.gguf"),
        SourceUri::Local("/models/a.gguf".into())
    );
    // `file://` is a local path for everyone: the engine reads it, the operator mounts it.
    assert_eq!(
        p("file:///models/a.gguf"),
        SourceUri::Local("/models/a.gguf".into())
    );
    assert!(!p("file:///models/a.gguf").is_remote());
    assert!(!SourceUri::names_remote("file:///m"));
    assert!(SourceUri::names_remote("hf://o/r"));
    assert!(SourceUri::names_remote("s3://b/k"));
    assert!(!SourceUri::names_remote("/models/cache/x"));
    for s in [
        "hf://org/repo@v1/x.gguf",
        "hf://o/r/a.json,b/*.gguf",
        "s3://b/k",
        "hf://o/r",
        "https://h/p",
    ] {
        assert_eq!(p(s).to_string(), s);
    }
    let e = |s: &str| s.parse::<SourceUri>().unwrap_err().to_string();
    assert!(e("gs://x/y").contains("unknown model source scheme 'gs://'"));
    assert!(e("hf://justone").contains("ORG/REPO"));
    assert!(e("hf://o/r@/f").contains("revision"));
    assert!(e("hf://o/r/a.json,,b").contains("bad file path ''"));
    assert!(e("s3://bucket").contains("s3://BUCKET/KEY"));
    assert!(e("https:///x").contains("no host"));
    // What a DSparkDeployment's `uri` may name: remote, admissible scheme, no spaces.
    assert!(SourceUri::parse_admissible("hf://o/r@main/m.gguf").is_ok());
    for bad in [
        "http://h/x",
        "file:///m",
        "/m",
        "hf://o/r /x",
        "hf://o/r/é",
        "",
    ] {
        assert!(SourceUri::parse_admissible(bad).is_err(), "{bad}");
    }
}

#[test]
fn arms_follow_one_grammar() {
    assert_eq!(parse_arm("dspark"), Ok(ArmKind::Dspark));
    assert_eq!(parse_arm("none"), Ok(ArmKind::None));
    assert_eq!(parse_arm("fixed:3"), Ok(ArmKind::Fixed(3)));
    assert_eq!(parse_arm("fixed:64"), Ok(ArmKind::Fixed(MAX_GAMMA)));
    assert_eq!(parse_arm("threshold:.5"), Ok(ArmKind::Threshold(0.5)));
    assert_eq!(parse_arm("threshold:1.00"), Ok(ArmKind::Threshold(1.0)));
    assert_eq!(parse_arm("threshold:0"), Ok(ArmKind::Threshold(0.0)));
    for bad in [
        "fixed:0",
        "fixed:65",
        "fixed:100",
        "fixed:07",
        "fixed:",
        "fixed",
        "threshold:1.5",
        "threshold:2",
        "threshold:1e-1",
        "threshold:+0.5",
        "threshold:0.",
        "dspark:3",
        "none:1",
        "ngram",
        "",
    ] {
        assert!(parse_arm(bad).is_err(), "{bad}");
    }
    let arms = parse_arms("dspark, none,fixed:3").unwrap();
    assert_eq!(arms.len(), 3);
    assert_eq!(arms[2], ("fixed:3".to_string(), ArmKind::Fixed(3)));
    assert!(parse_arms("dspark").unwrap_err().contains("at least two"));
    assert!(parse_arms("dspark,dspark").unwrap_err().contains("twice"));
}
