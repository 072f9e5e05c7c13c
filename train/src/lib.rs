//! `dspark-train`: drafter training, calibration and evaluation over the engine library.
//!
//! It owns self-distilled data ([`data`]), a differentiable drafter with the serving
//! drafter's parameters ([`model`]), the DSpark loss ([`loss`]), AdamW with warm-up + cosine
//! and clipping ([`optim`]), Sequential Temperature Scaling ([`calibrate`]), the acceptance
//! evaluation ([`eval`]) and its PNG plots ([`plots`], the `plots` feature), and the
//! `dspark-train train|calibrate|eval` commands ([`cli`]).
//!
//! Layering: this crate sits on top of `dspark-engine` (the target model, the serving
//! drafter, sampling and verification, the shared loaders); the engine never imports from
//! it, so the serving binary links neither the training code nor plotters and fontconfig.
//! No `unsafe` here.
//!
//! A training run lives in one folder: `config.json` + `model.safetensors` (the serving
//! checkpoint, bf16, loadable by `DSparkDrafter::load`) and `train/` (f32 variables,
//! optimiser moments and `state.json`), from which an interrupted run resumes exactly.

#![forbid(unsafe_code)]

pub mod calibrate;
pub mod cli;
pub mod data;
pub mod eval;
pub mod loss;
pub mod model;
pub mod optim;
#[cfg(feature = "plots")]
pub mod plots;
#[cfg(test)]
mod tests;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use data::{Dataset, Sequence};
use dspark_engine::model::Model;
use dspark_engine::speculative::dspark::{DSparkConfig, DSparkDrafter, HeadKind};
use loss::{dspark_loss, LossConfig, Targets};
use model::TrainDrafter;
use optim::{AdamW, OptimConfig};
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// Everything that defines a training run (stored in `train/state.json`; a resumed run must
/// match it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub head: HeadKind,
    pub block_size: usize,
    pub layers: usize,
    pub rank: usize,
    /// Rows of the draft LM head (0: the full vocabulary).
    pub draft_vocab: usize,
    pub steps: usize,
    pub seqs_per_step: usize,
    pub anchors_per_seq: usize,
    pub seed: u64,
    pub heldout_frac: f64,
    pub loss: LossConfig,
    pub optim: OptimConfig,
    /// [`DSparkConfig::context_input`].
    #[serde(default)]
    pub context_input: bool,
    /// Warm start: the drafter checkpoint folder whose weights replace the random
    /// initialisation (fresh optimiser and schedule). Its architecture must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<std::path::PathBuf>,
    /// Width of the drafter layers' MLP (0: the target's).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub intermediate: usize,
    /// Start every drafter layer from the target's last layer ([`init_from_target`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub init_from_target: bool,
    /// Train W1 compact ([`DSparkConfig::compact_w1`]; needs a draft vocabulary).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compact_w1: bool,
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainState {
    pub config: TrainConfig,
    pub step: usize,
    pub seconds: f64,
    pub block_tokens: usize,
    /// `(step, loss, ce, l1, bce, c*, acc@1)` every logged step.
    pub log: Vec<(usize, f32, f32, f32, f32, f32, f32)>,
    pub dataset: String,
}

const STATE: &str = "train/state.json";
const VARS: &str = "train/vars.safetensors";
const OPT: &str = "train/optim.safetensors";

/// Maps target ids to draft-vocabulary rows.
pub struct VocabMap {
    pub rows: HashMap<u32, u32>,
    pub size: usize,
}

impl VocabMap {
    pub fn new(cfg: &DSparkConfig) -> Self {
        match &cfg.draft_vocab {
            Some(v) => Self {
                rows: v
                    .iter()
                    .enumerate()
                    .map(|(i, &id)| (id, i as u32))
                    .collect(),
                size: v.len(),
            },
            None => Self {
                rows: (0..cfg.vocab_size as u32).map(|i| (i, i)).collect(),
                size: cfg.vocab_size,
            },
        }
    }
}

/// Loss targets of the blocks at `anchors` of `s`, on `dev` (the drafter's device).
pub fn targets(
    s: &Sequence,
    anchors: &[usize],
    gamma: usize,
    k: usize,
    vm: &VocabMap,
    dev: &candle_core::Device,
) -> Result<Targets> {
    let rows = anchors.len() * gamma;
    let mut y = Vec::with_capacity(rows);
    let mut p = vec![0f32; rows * vm.size];
    let mut p_out = Vec::with_capacity(rows);
    for (i, &a) in anchors.iter().enumerate() {
        for j in 0..gamma {
            let r = i * gamma + j;
            y.push(vm.rows.get(&s.tokens[a + j + 1]).copied());
            let (ids, ps) = s.topk(a + j, k);
            let mut out = 0.0;
            for (&id, &pr) in ids.iter().zip(ps) {
                match vm.rows.get(&id) {
                    Some(&d) => p[r * vm.size + d as usize] = pr,
                    None => out += pr,
                }
            }
            p_out.push(out);
        }
    }
    Ok(Targets {
        y,
        p: Tensor::from_vec(p, (rows, vm.size), dev)?,
        p_out,
    })
}

/// Up to `n` distinct random anchors of `s`, ascending.
pub fn pick_anchors(s: &Sequence, gamma: usize, n: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let Some(r) = s.anchor_range(gamma) else {
        return Vec::new();
    };
    let len = r.end() - r.start() + 1;
    let mut a: Vec<usize> = sample(rng, len, n.min(len))
        .into_iter()
        .map(|i| r.start() + i)
        .collect();
    a.sort_unstable();
    a
}

/// The drafter config of a new run.
pub fn new_config(target: &Model, ds: &Dataset, tc: &TrainConfig) -> DSparkConfig {
    let mut cfg = DSparkDrafter::default_config(target, tc.head, tc.block_size);
    cfg.num_hidden_layers = tc.layers;
    cfg.markov_rank = tc.rank;
    cfg.context_input = tc.context_input;
    cfg.target_layer_ids = ds.meta.target_layers.clone();
    // Training runs every block whole (`block_size` rows attending to each other both
    // ways), so the serving backbone must too: a shorter block would change every row's
    // attention and with it the drafts (acceptance fell from 0.33 to 0.22 at gamma 1 on the
    // Qwen2.5-Coder-1.5B drafter before this, issue #50).
    cfg.full_block = true;
    if tc.intermediate > 0 {
        cfg.intermediate_size = tc.intermediate;
    }
    if tc.draft_vocab > 0 && tc.draft_vocab < target.cfg.vocab_size {
        cfg.draft_vocab = Some(ds.draft_vocab(tc.draft_vocab));
        cfg.compact_w1 = tc.compact_w1 && tc.head != HeadKind::Parallel;
    }
    cfg
}

/// Progress of one step, for the caller's progress bar.
pub struct StepReport {
    pub step: usize,
    pub loss: f32,
    pub acc1: f32,
    pub lr: f64,
    pub tokens_per_s: f64,
}

/// The weights of the checkpoint at `dir` under `cfg` (STS temperatures dropped); an error
/// naming the difference when its architecture is not `cfg`'s. The checkpoint keeps its own
/// draft vocabulary when it has the size `cfg` asks for (a run on more data would otherwise
/// pick a slightly different set of ids and could not continue from it), and its compact
/// W1 if it has one.
fn warm_start(target: &Model, cfg: DSparkConfig, dir: &Path) -> Result<DSparkDrafter> {
    let d = DSparkDrafter::load(dir, target)
        .with_context(|| format!("--init {}: cannot load the drafter", dir.display()))?;
    let c = d.config();
    let mut want = cfg.without_sts();
    if c.draft_vocab.is_some() && c.draft_vocab_size() == cfg.draft_vocab_size() {
        want.draft_vocab = c.draft_vocab.clone();
        // A compact W1 (`convert --compact-w1`) trains on in that form.
        want.compact_w1 = c.compact_w1;
    }
    // Checkpoints written before `full_block` was set by training are the same weights.
    let mut have = c.without_sts();
    have.full_block = want.full_block;
    if have != want {
        bail!(
            "--init {}: its drafter (head {:?}, block {}, layers {}, rank {}, target layers {:?}, draft vocab {}, context input {}) differs from this run's (head {:?}, block {}, layers {}, rank {}, target layers {:?}, draft vocab {}, context input {})",
            dir.display(),
            c.markov_head_type,
            c.block_size,
            c.num_hidden_layers,
            c.markov_rank,
            c.target_layer_ids,
            c.draft_vocab_size(),
            c.context_input,
            cfg.markov_head_type,
            cfg.block_size,
            cfg.num_hidden_layers,
            cfg.markov_rank,
            cfg.target_layer_ids,
            cfg.draft_vocab_size(),
            cfg.context_input
        );
    }
    let tensors = d
        .tensors()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    DSparkDrafter::from_tensors(target, want, tensors, DType::F32)
}

/// A random drafter whose layers start as the target's last layer: attention projections
/// (q/k/v biases dropped: the drafter has none) and norms as they are, and of the MLP the
/// `intermediate_size` neurons with the largest `|gate_i| * |up_i| * |down_:,i|` (all of them
/// when the widths match). The drafter reads the target's own hidden states, so its one
/// layer starts as a copy of the layer that maps them to the next token's state; training
/// starts from a working transformer block instead of noise (q/k norms, which Llama and Qwen2
/// targets lack, start at 1). The drafter's final norm is the target's final norm.
pub fn init_from_target(target: &Model, cfg: DSparkConfig, seed: u64) -> Result<DSparkDrafter> {
    let random = DSparkDrafter::random(target, cfg.clone(), seed)?;
    let mut tensors: HashMap<String, Tensor> = random
        .tensors()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let last = target
        .weights
        .layers
        .last()
        .context("the target has no layers")?;
    let dense = |l: &dspark_engine::model::Linear| -> Result<Tensor> {
        Ok(match &**l {
            candle_core::quantized::QMatMul::QTensor(q) => q.dequantize(&target.device)?,
            candle_core::quantized::QMatMul::Tensor(t)
            | candle_core::quantized::QMatMul::TensorF16(t) => t.to_dtype(DType::F32)?,
        })
    };
    let (gate, up, down) = (dense(&last.gate)?, dense(&last.up)?, dense(&last.down)?);
    let inter = cfg.intermediate_size;
    let keep: Vec<u32> = if inter >= gate.dim(0)? {
        (0..gate.dim(0)? as u32).collect()
    } else {
        let norm = |t: &Tensor, dim: usize| -> Result<Vec<f32>> {
            Ok(t.sqr()?.sum(dim)?.sqrt()?.to_vec1::<f32>()?)
        };
        let (g, u, d) = (norm(&gate, 1)?, norm(&up, 1)?, norm(&down, 0)?);
        let mut idx: Vec<u32> = (0..g.len() as u32).collect();
        let score = |i: u32| g[i as usize] * u[i as usize] * d[i as usize];
        idx.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
        idx.truncate(inter);
        idx.sort_unstable();
        idx
    };
    let keep = Tensor::new(keep.as_slice(), &target.device)?;
    // The drafter's final norm feeds the target's LM head rows, as the target's final norm
    // does: with its weights (Qwen2.5's are far from 1) the first logits are on the target's
    // scale instead of several times flatter.
    tensors.insert("norm.weight".into(), target.weights.final_norm.clone());
    for i in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("layers.{i}.{s}.weight");
        let mut set = |name: String, t: Tensor| -> Result<()> {
            let want = tensors
                .get(&name)
                .with_context(|| format!("drafter has no {name}"))?
                .dims()
                .to_vec();
            ensure!(
                t.dims() == want,
                "{name}: target gives {:?}, drafter needs {want:?}",
                t.dims()
            );
            tensors.insert(name, t);
            Ok(())
        };
        set(p("input_layernorm"), last.attn_norm.clone())?;
        set(p("post_attention_layernorm"), last.ffn_norm.clone())?;
        set(p("self_attn.q_proj"), dense(&last.wq)?)?;
        set(p("self_attn.k_proj"), dense(&last.wk)?)?;
        set(p("self_attn.v_proj"), dense(&last.wv)?)?;
        set(p("self_attn.o_proj"), dense(&last.wo)?)?;
        if let (Some(qn), Some(kn)) = (&last.q_norm, &last.k_norm) {
            set(p("self_attn.q_norm"), qn.clone())?;
            set(p("self_attn.k_norm"), kn.clone())?;
        }
        set(p("mlp.gate_proj"), gate.index_select(&keep, 0)?)?;
        set(p("mlp.up_proj"), up.index_select(&keep, 0)?)?;
        set(p("mlp.down_proj"), down.index_select(&keep, 1)?)?;
    }
    // bf16-exact, as `random` makes them (save + load reproduce the run).
    for t in tensors.values_mut() {
        *t = t.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
    }
    DSparkDrafter::from_tensors(target, cfg, tensors, DType::BF16)
}

/// Trains (or resumes) a drafter in `out`.
pub fn train(
    target: &Model,
    ds: &Dataset,
    tc: &TrainConfig,
    out: &Path,
    save_every: usize,
    report: &mut dyn FnMut(&StepReport),
) -> Result<TrainState> {
    let state_path = out.join(STATE);
    let (drafter, mut state) = if state_path.exists() {
        let st: TrainState = serde_json::from_str(&std::fs::read_to_string(&state_path)?)
            .with_context(|| format!("{} is not a training state", state_path.display()))?;
        if st.config != *tc {
            bail!(
                "{} holds a run with different settings ({:?}); use another --out or the same settings",
                out.display(),
                st.config
            );
        }
        let d = DSparkDrafter::load(out, target)?;
        let d_cfg = d.config().without_sts();
        let vars = candle_core::safetensors::load(out.join(VARS), &target.device)
            .with_context(|| format!("cannot read {}", out.join(VARS).display()))?;
        (
            DSparkDrafter::from_tensors(target, d_cfg, vars, DType::F32)?,
            st,
        )
    } else {
        let cfg = new_config(target, ds, tc);
        let d = match &tc.init {
            None if tc.init_from_target => init_from_target(target, cfg, tc.seed)?,
            None => DSparkDrafter::random(target, cfg, tc.seed)?,
            Some(dir) => warm_start(target, cfg, dir)?,
        };
        (
            d,
            TrainState {
                config: tc.clone(),
                step: 0,
                seconds: 0.0,
                block_tokens: 0,
                log: Vec::new(),
                dataset: ds.meta.model_id.clone(),
            },
        )
    };
    ds.check_fits(target, &drafter.config().target_layer_ids)?;
    let td = TrainDrafter::new(target, &drafter)?;
    drop(drafter);
    let mut opt = AdamW::new(td.vars(), tc.optim)?;
    if state.step > 0 {
        opt.load(&out.join(OPT), state.step)?;
    }
    let (train_idx, _) = ds.split(tc.heldout_frac);
    let usable: Vec<usize> = train_idx
        .into_iter()
        .filter(|&i| ds.seqs[i].anchor_range(tc.block_size).is_some())
        .collect();
    ensure!(
        !usable.is_empty(),
        "no training sequence is long enough for a block of {}",
        tc.block_size
    );
    let vm = VocabMap::new(&td.cfg);
    let gamma = tc.block_size;
    let k = ds.meta.topk;
    let t0 = Instant::now();
    let base_seconds = state.seconds;
    while state.step < tc.steps {
        let step = state.step;
        let ts = Instant::now();
        let mut rng =
            ChaCha8Rng::seed_from_u64(tc.seed.wrapping_mul(0x9E37_79B9).wrapping_add(step as u64));
        let mut total: Option<Tensor> = None;
        let (mut sums, mut rows, mut hits, mut n_rows) = ([0f32; 5], 0usize, 0usize, 0usize);
        for _ in 0..tc.seqs_per_step {
            let s = &ds.seqs[usable[rng.random_range(0..usable.len())]];
            let anchors = pick_anchors(s, gamma, tc.anchors_per_seq, &mut rng);
            let out = td.forward_seq(target, s, &anchors)?;
            let t = targets(s, &anchors, gamma, k, &vm, &target.device)?;
            let parts = dspark_loss(&out, &t, gamma, &tc.loss)?;
            let l = (parts.total.clone() / tc.seqs_per_step as f64)?;
            total = Some(match total {
                Some(x) => (x + l)?,
                None => l,
            });
            for (acc, v) in sums.iter_mut().zip([
                parts.total.to_scalar::<f32>()?,
                parts.ce,
                parts.l1,
                parts.bce,
                parts.c_star,
            ]) {
                *acc += v / tc.seqs_per_step as f32;
            }
            rows += anchors.len() * gamma;
            hits += parts.hits[0].0;
            n_rows += parts.hits[0].1;
        }
        let total = total.expect("seqs_per_step >= 1");
        let mut grads = total.backward()?;
        optim::clip_grad_norm(&mut grads, opt.vars(), tc.optim.clip)?;
        let lr = tc.optim.lr_at(step, tc.steps);
        opt.step(&grads, lr)?;
        state.step += 1;
        state.block_tokens += rows;
        let acc1 = hits as f32 / n_rows.max(1) as f32;
        if step % 10 == 0 || state.step == tc.steps {
            state
                .log
                .push((step, sums[0], sums[1], sums[2], sums[3], sums[4], acc1));
        }
        report(&StepReport {
            step: state.step,
            loss: sums[0],
            acc1,
            lr,
            tokens_per_s: rows as f64 / ts.elapsed().as_secs_f64(),
        });
        state.seconds = base_seconds + t0.elapsed().as_secs_f64();
        if state.step % save_every.max(1) == 0 || state.step == tc.steps {
            save_run(target, &td, &opt, &state, out)?;
        }
    }
    Ok(state)
}

/// Writes the serving checkpoint (bf16) and the resumable training state.
fn save_run(
    target: &Model,
    td: &TrainDrafter,
    opt: &AdamW,
    st: &TrainState,
    out: &Path,
) -> Result<()> {
    std::fs::create_dir_all(out.join("train"))?;
    td.to_drafter(target, DType::BF16)?.save(out)?;
    let vars: HashMap<String, Tensor> = td
        .vars()
        .into_iter()
        .map(|(k, v)| (k, v.as_tensor().detach()))
        .collect();
    candle_core::safetensors::save(&vars, out.join(VARS))?;
    opt.save(&out.join(OPT))?;
    let tmp = out.join("train/state.json.tmp");
    std::fs::write(&tmp, serde_json::to_string(st)?)?;
    std::fs::rename(&tmp, out.join(STATE))?;
    Ok(())
}
