use super::*;

fn key(node: &str) -> CostTableKey {
    CostTableKey {
        model_id: "smollm2-135m".into(),
        drafter_id: None,
        engine_version: "0.1.0".into(),
        node_type: node.into(),
    }
}

#[test]
fn cost_table_names_are_stable_and_distinct() {
    let a = cost_table_name(&key("h200"));
    assert_eq!(a, cost_table_name(&key("h200")));
    assert!(a.starts_with("h200-"));
    assert_ne!(a, cost_table_name(&key("l4")));
    let mut k = key("h200");
    k.drafter_id = Some("d".into());
    assert_ne!(a, cost_table_name(&k));
    assert!(a.len() <= 63);
    let long = cost_table_name(&key("NVIDIA_H200 SXM 141GB with a very long name indeed"));
    assert!(long.len() <= 63, "{long}");
    assert!(long
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
}

/// Names the owned objects could not carry are refused by the CEL rules, naming the field.
#[test]
fn names_that_cannot_become_object_names_are_refused() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/samples/dsparkdeployment-smollm2.yaml"
    ))
    .unwrap();
    let base: DSparkDeployment = serde_yaml::from_str(&text).unwrap();
    let refused = |f: &dyn Fn(&mut DSparkDeployment)| -> Vec<String> {
        let mut d = base.clone();
        f(&mut d);
        match kube::core::cel::validate_cel(&d) {
            Ok(()) => Vec::new(),
            Err(e) => e.into_vec().into_iter().map(|e| e.message).collect(),
        }
    };
    assert!(refused(&|_| {}).is_empty());
    assert!(refused(&|d| {
        d.metadata.name = Some(format!("m{}", "0".repeat(39)));
        d.spec.pools[0].name = "p-a-a-a-a-a-a-a-a-az".into();
        d.spec.pools[0].node_type = "NVIDIA-H200_SXM.141GB".into();
    })
    .is_empty());
    for (name, field) in [
        ("8b-model", "metadata.name"),
        ("smollm2.q4", "metadata.name"),
    ] {
        let m = refused(&|d| d.metadata.name = Some(name.into()));
        assert!(m.iter().any(|m| m.starts_with(field)), "{name}: {m:?}");
    }
    for pool in ["qwen3.8b", "8b", "a100-", "A100"] {
        let m = refused(&|d| d.spec.pools[0].name = pool.into());
        assert!(
            m.iter().any(|m| m.starts_with("spec.pools[].name")),
            "{pool}: {m:?}"
        );
    }
    for nt in ["a100 80gb", "-a100", "a100/80"] {
        let m = refused(&|d| d.spec.pools[0].node_type = nt.into());
        assert!(
            m.iter().any(|m| m.starts_with("spec.pools[].nodeType")),
            "{nt}: {m:?}"
        );
    }
}

#[test]
fn engine_version_defaults_to_the_image_tag() {
    let mut e = EngineSpec {
        image: Some("registry:5000/dspark/engine:0.3.1".into()),
        ..Default::default()
    };
    assert_eq!(e.effective_version(), "0.3.1");
    e.image = Some("registry:5000/dspark/engine".into());
    assert_eq!(e.effective_version(), "latest");
    e.image = Some("engine:1.2@sha256:abc".into());
    assert_eq!(e.effective_version(), "1.2");
    e.version = Some("9.9".into());
    assert_eq!(e.effective_version(), "9.9");
}

#[test]
fn a_hugging_face_source_fetches_every_file_it_names() {
    let src = |files: &[&str]| ModelSource {
        hugging_face: Some(HuggingFaceSource {
            repo: "org/repo".into(),
            revision: Some("v1".into()),
            files: files.iter().map(|f| f.to_string()).collect(),
            token_secret_ref: None,
        }),
        ..Default::default()
    };
    assert_eq!(src(&[]).fetch_uri().unwrap(), "hf://org/repo@v1");
    assert_eq!(
        src(&["m.Q4_1.gguf"]).fetch_uri().unwrap(),
        "hf://org/repo@v1/m.Q4_1.gguf"
    );
    assert_eq!(
        src(&["config.json", "/*.safetensors", "tokenizer.json"])
            .fetch_uri()
            .unwrap(),
        "hf://org/repo@v1/config.json,*.safetensors,tokenizer.json"
    );
}
