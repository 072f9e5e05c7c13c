//! Checkpoint layouts a drafter folder can come in, and their mapping to [`DSparkConfig`]:
//! - `native`: this engine's own `config.json` ([`DSparkConfig`] as serialised);
//! - `deepspec`: a folder saved by DeepSeek's DeepSpec `Qwen3DSparkModel` (`save_pretrained`):
//!   a copy of the target's Qwen3 config plus `block_size`, `mask_token_id`,
//!   `target_layer_ids`, `markov_rank`, `markov_head_type` (vanilla / gated / rnn),
//!   `enable_confidence_head`, `confidence_head_with_markov`; tensors as the module names
//!   them, with copies of the target's `embed_tokens` and `lm_head`. Its DFlash drafters are
//!   the same model with `markov_rank = 0`;
//! - `dflash`: a z-lab `DFlashDraftModel` folder: Qwen3 config, `block_size` at the top level
//!   or in `dflash_config`, `dflash_config.{mask_token_id, target_layer_ids}`, no embedding or
//!   LM head (the target's are used), and the anchor row's output is not a draft.
//!
//! Both reference layouts run the whole block through the backbone whatever the number of
//! drafts wanted ([`DSparkConfig::full_block`]). What does not fit is refused with an error
//! naming the key and what was expected.

use super::{head, DSparkConfig, HeadKind, EMBED, LM_HEAD};
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Where a drafter checkpoint comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    Native,
    #[value(name = "deepspec")]
    DeepSpec,
    #[value(name = "dflash")]
    DFlash,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::Native => "native",
            Layout::DeepSpec => "deepspec",
            Layout::DFlash => "dflash",
        }
    }
}

/// The RNN head's projection: DeepSpec keeps it inside `markov_head`.
const DEEPSPEC_RNN_W: &str = "markov_head.joint_proj.weight";
const DEEPSPEC_RNN_B: &str = "markov_head.joint_proj.bias";

/// The layout of a parsed `config.json`.
pub fn detect(cfg: &Value) -> Layout {
    let arch = cfg
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or_default();
    if arch.ends_with("DSparkModel") {
        Layout::DeepSpec
    } else if arch == "DFlashDraftModel" || cfg.get("dflash_config").is_some() {
        Layout::DFlash
    } else {
        Layout::Native
    }
}

/// A drafter config read from a folder's `config.json`, in whichever layout.
pub struct Imported {
    pub layout: Layout,
    pub cfg: DSparkConfig,
    /// Target layers the checkpoint was trained for (`num_target_layers`), when it says.
    pub num_target_layers: Option<usize>,
}

fn get<'a>(cfg: &'a Value, key: &str, what: &str) -> Result<&'a Value> {
    cfg.get(key)
        .filter(|v| !v.is_null())
        .with_context(|| format!("key '{key}' is missing (expected {what})"))
}

fn usize_at(cfg: &Value, key: &str) -> Result<usize> {
    let v = get(cfg, key, "a non-negative integer")?;
    v.as_u64()
        .map(|x| x as usize)
        .with_context(|| format!("key '{key}' is {v}, expected a non-negative integer"))
}

fn f64_at(cfg: &Value, key: &str) -> Result<f64> {
    let v = get(cfg, key, "a number")?;
    v.as_f64()
        .with_context(|| format!("key '{key}' is {v}, expected a number"))
}

fn bool_at(cfg: &Value, key: &str) -> Result<bool> {
    let v = get(cfg, key, "true or false")?;
    v.as_bool()
        .with_context(|| format!("key '{key}' is {v}, expected true or false"))
}

fn layer_ids(v: &Value, key: &str) -> Result<Vec<usize>> {
    let arr = v
        .as_array()
        .with_context(|| format!("key '{key}' is {v}, expected a list of target layer ids"))?;
    arr.iter()
        .map(|x| match x.as_i64() {
            Some(-1) => bail!(
                "key '{key}' holds -1 (the embedding output): this engine feeds target layer outputs only (ids 0..)"
            ),
            Some(i) if i >= 0 => Ok(i as usize),
            _ => bail!("key '{key}' holds {x}, expected target layer ids >= 0"),
        })
        .collect()
}

/// The Qwen3 dimensions every layout copies from the target, checked for what the drafter
/// implements (no attention bias, SiLU, full attention, default RoPE).
fn qwen3_dims(c: &Value) -> Result<DSparkConfig> {
    if let Some(t) = c.get("model_type").and_then(Value::as_str) {
        if t != "qwen3" {
            bail!("key 'model_type' is '{t}', expected 'qwen3' (the Qwen3 drafter)");
        }
    }
    if c.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        bail!("key 'attention_bias' is true, expected false (Qwen3 projections have no bias)");
    }
    if let Some(a) = c.get("hidden_act").and_then(Value::as_str) {
        if a != "silu" {
            bail!("key 'hidden_act' is '{a}', expected 'silu'");
        }
    }
    if let Some(types) = c.get("layer_types").and_then(Value::as_array) {
        if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            bail!("key 'layer_types' holds {t}, expected 'full_attention' only");
        }
    }
    let rope_theta = match c.get("rope_theta").and_then(Value::as_f64) {
        Some(t) => t,
        None => {
            let rp = get(
                c,
                "rope_parameters",
                "rope_theta or rope_parameters.rope_theta",
            )?;
            if let Some(kind) = rp.get("rope_type").and_then(Value::as_str) {
                if kind != "default" {
                    bail!("key 'rope_parameters.rope_type' is '{kind}', expected 'default'");
                }
            }
            f64_at(rp, "rope_theta").context("in rope_parameters")?
        }
    };
    if let Some(s) = c.get("rope_scaling").filter(|v| !v.is_null()) {
        bail!("key 'rope_scaling' is {s}, expected null (scaled RoPE is not implemented)");
    }
    let hidden = usize_at(c, "hidden_size")?;
    let heads = usize_at(c, "num_attention_heads")?;
    let head_dim = match c.get("head_dim").filter(|v| !v.is_null()) {
        Some(_) => usize_at(c, "head_dim")?,
        None => hidden / heads.max(1),
    };
    Ok(DSparkConfig {
        hidden_size: hidden,
        vocab_size: usize_at(c, "vocab_size")?,
        num_attention_heads: heads,
        num_key_value_heads: match c.get("num_key_value_heads").filter(|v| !v.is_null()) {
            Some(_) => usize_at(c, "num_key_value_heads")?,
            None => heads,
        },
        head_dim,
        intermediate_size: usize_at(c, "intermediate_size")?,
        rms_norm_eps: f64_at(c, "rms_norm_eps")?,
        rope_theta,
        num_hidden_layers: usize_at(c, "num_hidden_layers")?,
        block_size: 0,
        mask_token_id: 0,
        target_layer_ids: Vec::new(),
        markov_rank: 0,
        markov_head_type: HeadKind::Parallel,
        enable_confidence_head: false,
        confidence_head_with_markov: true,
        skip_anchor_row: false,
        full_block: true,
        own_embeddings: false,
        context_input: false,
        sts_temperatures: None,
        sts_offsets: None,
        sts_temperatures_greedy: None,
        sts_offsets_greedy: None,
        draft_vocab: None,
        compact_w1: false,
    })
}

fn num_target_layers(c: &Value) -> Result<Option<usize>> {
    c.get("num_target_layers")
        .filter(|v| !v.is_null())
        .map(|_| usize_at(c, "num_target_layers"))
        .transpose()
}

fn import_deepspec(c: &Value) -> Result<Imported> {
    let arch = c["architectures"][0].as_str().unwrap_or_default();
    if arch != "Qwen3DSparkModel" {
        bail!("key 'architectures' is ['{arch}'], expected ['Qwen3DSparkModel'] (only the Qwen3 DSpark drafter is implemented)");
    }
    let mut cfg = qwen3_dims(c)?;
    cfg.block_size = usize_at(c, "block_size")?;
    cfg.mask_token_id = usize_at(c, "mask_token_id")? as u32;
    cfg.target_layer_ids = layer_ids(
        get(c, "target_layer_ids", "a list of target layer ids")?,
        "target_layer_ids",
    )?;
    let rank = usize_at(c, "markov_rank")?;
    cfg.markov_rank = rank;
    cfg.markov_head_type = if rank == 0 {
        HeadKind::Parallel
    } else {
        let v = get(c, "markov_head_type", "'vanilla', 'gated' or 'rnn'")?;
        match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("vanilla") => HeadKind::Markov,
            Some("gated") => HeadKind::Gated,
            Some("rnn") => HeadKind::Rnn,
            _ => bail!("key 'markov_head_type' is {v}, expected 'vanilla', 'gated' or 'rnn'"),
        }
    };
    cfg.enable_confidence_head = bool_at(c, "enable_confidence_head")?;
    cfg.confidence_head_with_markov =
        cfg.enable_confidence_head && bool_at(c, "confidence_head_with_markov")?;
    if cfg.confidence_head_with_markov && rank == 0 {
        bail!("key 'confidence_head_with_markov' is true but 'markov_rank' is 0 (expected a Markov head to read W1 from)");
    }
    if c.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        bail!(
            "key 'tie_word_embeddings' is true, expected false (DeepSpec stores its own lm_head)"
        );
    }
    cfg.own_embeddings = true;
    Ok(Imported {
        layout: Layout::DeepSpec,
        cfg,
        num_target_layers: num_target_layers(c)?,
    })
}

/// z-lab's default target layers: `round(1 + i (N - 4) / (L - 1))` (the middle one for L = 1).
fn dflash_default_layers(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers == 1 {
        return vec![num_target_layers / 2];
    }
    let span = num_target_layers as f64 - 4.0;
    (0..num_draft_layers)
        .map(|i| (1.0 + i as f64 * span / (num_draft_layers - 1) as f64).round_ties_even() as usize)
        .collect()
}

fn import_dflash(c: &Value) -> Result<Imported> {
    let mut cfg = qwen3_dims(c)?;
    let sub = get(c, "dflash_config", "an object with mask_token_id")?;
    let top = c.get("block_size").filter(|v| !v.is_null());
    let inner = sub.get("block_size").filter(|v| !v.is_null());
    let block = match (top, inner) {
        (Some(_), Some(_)) => {
            let (a, b) = (usize_at(c, "block_size")?, usize_at(sub, "block_size")?);
            if a != b {
                bail!("key 'block_size' is {a} but 'dflash_config.block_size' is {b}, expected one value");
            }
            a
        }
        (Some(_), None) => usize_at(c, "block_size")?,
        (None, Some(_)) => usize_at(sub, "block_size").context("in dflash_config")?,
        (None, None) => {
            bail!("key 'block_size' is missing (expected it at the top level or in dflash_config)")
        }
    };
    if block < 2 {
        bail!("key 'block_size' is {block}, expected at least 2 (the anchor and one draft)");
    }
    cfg.block_size = block - 1;
    cfg.skip_anchor_row = true;
    cfg.mask_token_id = usize_at(sub, "mask_token_id").context("in dflash_config")? as u32;
    let n_target = num_target_layers(c)?;
    cfg.target_layer_ids = match sub.get("target_layer_ids").filter(|v| !v.is_null()) {
        Some(v) => layer_ids(v, "dflash_config.target_layer_ids")?,
        None => {
            let n = n_target.context(
                "key 'dflash_config.target_layer_ids' is missing and so is 'num_target_layers' (expected one of them)",
            )?;
            dflash_default_layers(n, cfg.num_hidden_layers)
        }
    };
    Ok(Imported {
        layout: Layout::DFlash,
        cfg,
        num_target_layers: n_target,
    })
}

/// The drafter config of a folder's `config.json` text, in whichever layout.
pub fn import_config(text: &str) -> Result<Imported> {
    let c: Value = serde_json::from_str(text).context("not JSON")?;
    match detect(&c) {
        Layout::Native if c.get("architectures").is_some() => bail!(
            "key 'architectures' is {}, expected ['Qwen3DSparkModel'] (DeepSpec DSpark), ['DFlashDraftModel'] (z-lab DFlash) or none (this engine's own drafter config)",
            c["architectures"]
        ),
        Layout::Native => Ok(Imported {
            layout: Layout::Native,
            cfg: serde_json::from_value(c).context("not a DSpark drafter config")?,
            num_target_layers: None,
        }),
        Layout::DeepSpec => import_deepspec(&c).context("DeepSpec DSpark config"),
        Layout::DFlash => import_dflash(&c).context("z-lab DFlash config"),
    }
}

/// Renames a reference layout's tensors to this engine's names; a tensor the layout does
/// not have for `cfg` is refused.
pub fn import_tensors(
    layout: Layout,
    cfg: &DSparkConfig,
    tensors: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    if layout == Layout::Native {
        return Ok(tensors);
    }
    let expected: std::collections::HashSet<String> = super::param_shapes(cfg)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut out = HashMap::new();
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    let mut tensors = tensors;
    for name in names {
        let t = tensors.remove(&name).expect("listed");
        let ours = match name.as_str() {
            DEEPSPEC_RNN_W if layout == Layout::DeepSpec => head::RNN_W.to_string(),
            DEEPSPEC_RNN_B if layout == Layout::DeepSpec => head::RNN_B.to_string(),
            n => n.to_string(),
        };
        if !expected.contains(&ours) {
            bail!(
                "unexpected tensor '{name}' for a {} checkpoint with this config (expected only: {})",
                layout.name(),
                expected_names(layout, cfg).join(", ")
            );
        }
        out.insert(ours, t);
    }
    Ok(out)
}

fn export_name(layout: Layout, ours: &str) -> String {
    match (layout, ours) {
        (Layout::DeepSpec, head::RNN_W) => DEEPSPEC_RNN_W.into(),
        (Layout::DeepSpec, head::RNN_B) => DEEPSPEC_RNN_B.into(),
        _ => ours.into(),
    }
}

/// The tensor names of `layout` for `cfg` (layers collapsed to `layers.N.*`).
fn expected_names(layout: Layout, cfg: &DSparkConfig) -> Vec<String> {
    let mut v: Vec<String> = super::param_shapes(cfg)
        .into_iter()
        .filter(|(n, _)| !n.starts_with("layers.") || n.starts_with("layers.0."))
        .map(|(n, _)| export_name(layout, &n).replacen("layers.0.", "layers.N.", 1))
        .collect();
    v.sort();
    v
}

/// `config.json` and tensors of `cfg` + `params` (this engine's names) in `layout`;
/// `embed` and `lm_head` (`[V, hidden]`) are written when the layout stores them.
pub fn export(
    layout: Layout,
    cfg: &DSparkConfig,
    params: &BTreeMap<String, Tensor>,
    num_target_layers: usize,
    embeddings: Option<(Tensor, Tensor)>,
) -> Result<(Value, HashMap<String, Tensor>)> {
    if layout == Layout::Native {
        return Ok((
            serde_json::to_value(cfg)?,
            params.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        ));
    }
    let refuse = |what: &str| -> Result<()> {
        bail!(
            "this drafter cannot be written in the {} layout: {what}",
            layout.name()
        )
    };
    if cfg.draft_vocab.is_some() || cfg.compact_w1 {
        refuse("it has a reduced draft vocabulary (draft_vocab), which the layout has no key for")?;
    }
    if cfg.context_input {
        refuse("it uses context_input, which the reference model does not compute")?;
    }
    if cfg.mask_token_id as usize >= cfg.vocab_size {
        refuse("its mask input is a dedicated mask_embedding row; the layout takes a mask_token_id inside the vocabulary")?;
    }
    let mut c = json!({
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_target_layers": num_target_layers,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "layer_types": vec!["full_attention"; cfg.num_hidden_layers],
    });
    let mut tensors: HashMap<String, Tensor> = params
        .iter()
        .filter(|(k, _)| k.as_str() != EMBED && k.as_str() != LM_HEAD)
        .map(|(k, v)| (export_name(layout, k), v.clone()))
        .collect();
    match layout {
        Layout::DeepSpec => {
            if cfg.skip_anchor_row {
                refuse("its anchor row is not a draft (a DFlash drafter): write it as dflash")?;
            }
            let (embed, lm_head) =
                embeddings.context("the DeepSpec layout stores the embedding and LM head")?;
            tensors.insert(EMBED.into(), embed);
            tensors.insert(LM_HEAD.into(), lm_head);
            c["architectures"] = json!(["Qwen3DSparkModel"]);
            c["block_size"] = json!(cfg.block_size);
            c["mask_token_id"] = json!(cfg.mask_token_id);
            c["target_layer_ids"] = json!(cfg.target_layer_ids);
            c["num_anchors"] = json!(512);
            let rank = match cfg.markov_head_type {
                HeadKind::Parallel => 0,
                _ => cfg.markov_rank,
            };
            c["markov_rank"] = json!(rank);
            if rank > 0 {
                c["markov_head_type"] = json!(match cfg.markov_head_type {
                    HeadKind::Gated => "gated",
                    HeadKind::Rnn => "rnn",
                    _ => "vanilla",
                });
            }
            c["enable_confidence_head"] = json!(cfg.enable_confidence_head);
            if cfg.enable_confidence_head {
                c["confidence_head_with_markov"] =
                    json!(cfg.confidence_head_with_markov && rank > 0);
            }
        }
        Layout::DFlash => {
            if !cfg.skip_anchor_row {
                refuse(
                    "its anchor row predicts the first draft (DSpark); DFlash discards that row",
                )?;
            }
            if cfg.markov_head_type != HeadKind::Parallel || cfg.enable_confidence_head {
                refuse("it has a sequential or confidence head; DFlash has neither")?;
            }
            c["architectures"] = json!(["DFlashDraftModel"]);
            c["block_size"] = json!(cfg.block_size + 1);
            c["dflash_config"] = json!({
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": cfg.target_layer_ids,
            });
        }
        Layout::Native => unreachable!(),
    }
    Ok((c, tensors))
}

/// The tensors of a folder: `model.safetensors`, or the shards an index names.
pub fn read_weights(dir: &Path, dev: &candle_core::Device) -> Result<HashMap<String, Tensor>> {
    let single = dir.join(super::WEIGHTS_FILE);
    if single.exists() {
        return candle_core::safetensors::load(&single, dev)
            .with_context(|| format!("cannot read drafter weights {}", single.display()));
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).with_context(|| {
        format!(
            "cannot read drafter weights: neither {} nor {} exists",
            single.display(),
            index.display()
        )
    })?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("{}: key 'weight_map' is missing", index.display()))?;
    let mut files: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    files.sort_unstable();
    files.dedup();
    let mut out = HashMap::new();
    for f in files {
        let p = dir.join(f);
        out.extend(
            candle_core::safetensors::load(&p, dev)
                .with_context(|| format!("cannot read drafter weights {}", p.display()))?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dflash_default_layers_match_the_reference_formula() {
        assert_eq!(dflash_default_layers(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(dflash_default_layers(28, 1), vec![14]);
    }

    #[test]
    fn refusals_name_the_key_and_what_was_expected() {
        let base = json!({
            "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 64,
            "vocab_size": 100, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "intermediate_size": 96, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "num_hidden_layers": 1, "block_size": 7, "mask_token_id": 99,
            "target_layer_ids": [0, 1], "markov_rank": 8, "markov_head_type": "vanilla",
            "enable_confidence_head": true, "confidence_head_with_markov": true,
        });
        let err = |edit: &dyn Fn(&mut Value)| {
            let mut c = base.clone();
            edit(&mut c);
            format!(
                "{:#}",
                import_config(&c.to_string()).err().expect("refused")
            )
        };
        let ok = import_config(&base.to_string()).unwrap();
        assert_eq!(ok.layout, Layout::DeepSpec);
        assert_eq!(ok.cfg.markov_head_type, HeadKind::Markov);
        assert!(ok.cfg.own_embeddings && ok.cfg.full_block);
        let e = err(&|c| c["markov_head_type"] = json!("lstm"));
        assert!(
            e.contains("'markov_head_type'") && e.contains("'vanilla', 'gated' or 'rnn'"),
            "{e}"
        );
        let e = err(&|c| {
            c.as_object_mut().unwrap().remove("mask_token_id");
        });
        assert!(e.contains("'mask_token_id' is missing"), "{e}");
        let e = err(&|c| c["target_layer_ids"] = json!([-1, 2]));
        assert!(e.contains("-1"), "{e}");
        let e = err(&|c| c["architectures"] = json!(["LlamaForCausalLMEagle3"]));
        assert!(
            e.contains("'architectures'") && e.contains("DFlashDraftModel"),
            "{e}"
        );
        let e = err(&|c| c["architectures"] = json!(["Gemma4DSparkModel"]));
        assert!(e.contains("Qwen3DSparkModel"), "{e}");
        let e = err(&|c| c["attention_bias"] = json!(true));
        assert!(e.contains("'attention_bias'"), "{e}");
        let e = err(&|c| {
            c["architectures"] = json!(["DFlashDraftModel"]);
            c["dflash_config"] = json!({"mask_token_id": 5, "block_size": 8});
        });
        assert!(e.contains("'dflash_config.block_size' is 8"), "{e}");
    }
}
