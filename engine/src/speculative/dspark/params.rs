//! Every parameter a drafter has: checkpoint names, shapes and initialisation.

use super::*;

/// How a parameter is initialised by [`DSparkDrafter::random`].
pub(super) enum Init {
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform(f32),
}

pub(super) struct ParamSpec {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) init: Init,
}

/// Every tensor a drafter with `cfg` has: checkpoint name and shape (the training code
/// builds its variables from this list, so trained weights load here unchanged).
pub fn param_shapes(cfg: &DSparkConfig) -> Vec<(String, Vec<usize>)> {
    param_specs(cfg)
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect()
}

/// Every tensor a drafter with `cfg` has, with its shape.
pub(super) fn param_specs(cfg: &DSparkConfig) -> Vec<ParamSpec> {
    let (h, v, r) = (cfg.hidden_size, cfg.vocab_size, cfg.markov_rank);
    let (q_dim, kv_dim) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    );
    let mut specs = Vec::new();
    let mut add =
        |name: String, shape: Vec<usize>, init: Init| specs.push(ParamSpec { name, shape, init });
    let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f32).sqrt());
    let ctx = cfg.target_layer_ids.len() * h;
    add("fc.weight".into(), vec![h, ctx], lin(ctx));
    add("hidden_norm.weight".into(), vec![h], Init::Ones);
    add("norm.weight".into(), vec![h], Init::Ones);
    for i in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("layers.{i}.{s}.weight");
        add(p("input_layernorm"), vec![h], Init::Ones);
        add(p("post_attention_layernorm"), vec![h], Init::Ones);
        add(p("self_attn.q_proj"), vec![q_dim, h], lin(h));
        add(p("self_attn.k_proj"), vec![kv_dim, h], lin(h));
        add(p("self_attn.v_proj"), vec![kv_dim, h], lin(h));
        add(p("self_attn.o_proj"), vec![h, q_dim], lin(q_dim));
        add(p("self_attn.q_norm"), vec![cfg.head_dim], Init::Ones);
        add(p("self_attn.k_norm"), vec![cfg.head_dim], Init::Ones);
        add(p("mlp.gate_proj"), vec![cfg.intermediate_size, h], lin(h));
        add(p("mlp.up_proj"), vec![cfg.intermediate_size, h], lin(h));
        add(
            p("mlp.down_proj"),
            vec![h, cfg.intermediate_size],
            lin(cfg.intermediate_size),
        );
    }
    if cfg.markov_head_type != HeadKind::Parallel {
        add(head::W1.into(), vec![cfg.w1_rows(), r], Init::Uniform(1.0));
        add(head::W2.into(), vec![cfg.draft_vocab_size(), r], lin(r));
    }
    if cfg.markov_head_type == HeadKind::Rnn {
        add(head::RNN_W.into(), vec![3 * r, 2 * r + h], lin(2 * r + h));
        add(head::RNN_B.into(), vec![3 * r], lin(2 * r + h));
    }
    if cfg.markov_head_type == HeadKind::Gated {
        add(head::GATE_W.into(), vec![r, h + r], lin(h + r));
        add(head::GATE_B.into(), vec![r], lin(h + r));
    }
    if cfg.own_embeddings {
        add(EMBED.into(), vec![v, h], Init::Uniform(1.0));
        add(LM_HEAD.into(), vec![v, h], lin(h));
    }
    if cfg.enable_confidence_head {
        let fan_in = cfg.confidence_fan_in();
        add(head::CONF_W.into(), vec![1, fan_in], lin(fan_in));
        add(head::CONF_B.into(), vec![1], lin(fan_in));
    }
    if cfg.mask_token_id as usize >= v {
        add("mask_embedding".into(), vec![h], lin(h));
    }
    specs
}
