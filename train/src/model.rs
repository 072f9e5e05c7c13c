//! The drafter as a differentiable function of candle `Var`s, for training.
//!
//! Same parameters (names and shapes from [`param_shapes`]) and the same equations as the
//! serving drafter in `speculative/dspark.rs`, but over many blocks of one sequence at once, with
//! only autograd-capable ops (RMSNorm, RoPE, softmax and attention written out):
//! - context features `c_t = RMSNorm(fc(f(t)))` for every position before the last anchor;
//! - every anchor `a` is a block `[x_a, MASK x (gamma - 1)]` at positions `a..a + gamma`; its
//!   queries see the context keys of positions `< a` and the keys of their own block
//!   (bidirectionally), never another block: an additive mask over `[context; blocks]`;
//! - `U = h W_lm^T` with the target's LM head rows of the draft vocabulary (frozen, dense);
//! - the sequential head is teacher-forced: `x_{k-1}` is the data token (the anchor for
//!   k = 1), which at serving time is the drafted token whenever all earlier ones passed.
//!
//! The target's embedding and LM head are inputs, never variables, so they get no gradient
//! and are never stored.

use crate::data::Sequence;
use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::ops::{rms_norm_slow as rms_norm, sigmoid};
use candle_nn::VarMap;
use dspark_engine::model::Model;
use dspark_engine::speculative::dspark::{
    param_shapes, DSparkConfig, DSparkDrafter, HeadKind, CONF_B, CONF_W, RNN_B, RNN_W, W1, W2,
};
use std::collections::HashMap;

/// Frozen inputs taken from the target.
pub struct Frozen {
    /// LM head rows of the draft vocabulary, `[V_draft, hidden]` f32.
    pub lm_head: Tensor,
    pub rope_cos: Tensor,
    pub rope_sin: Tensor,
}

/// A trainable drafter: its config and one `Var` per checkpoint tensor.
pub struct TrainDrafter {
    pub cfg: DSparkConfig,
    pub varmap: VarMap,
    frozen: Frozen,
    device: Device,
}

/// Blocks of one sequence.
pub struct Blocks<'a> {
    /// Target hidden states of the drafter's target layers, concatenated: `[n, L * hidden]`
    /// for positions `0..n` (only rows before the last anchor are used).
    pub feats: &'a Tensor,
    /// Token ids; `tokens[a + k]` is the teacher-forced `x_k` of the block at anchor `a`.
    pub tokens: &'a [u32],
    /// Anchor positions, each `>= 1`, with `a + gamma <= tokens.len()`.
    pub anchors: &'a [usize],
}

/// Per block row (anchor-major, `anchors.len() * gamma` rows).
pub struct BlockOut {
    /// Draft logits `U_k + B_k` over the draft vocabulary, `[rows, V_draft]`.
    pub logits: Tensor,
    /// Confidence logits `z_k` (`c_k = sigmoid(z_k)`), `[rows]`; None without the head.
    pub conf_logit: Option<Tensor>,
}

/// Dense f32 rows of a (possibly quantized) matrix.
pub fn dense_rows(m: &QMatMul, rows: Option<&[u32]>, dev: &Device) -> Result<Tensor> {
    let w = match m {
        QMatMul::QTensor(q) => q.dequantize(dev)?,
        QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.to_dtype(DType::F32)?,
    };
    Ok(match rows {
        Some(r) => w.index_select(&Tensor::new(r, dev)?, 0)?,
        None => w,
    })
}

/// Half-split RoPE on `[T, heads, hd]` with `cos`/`sin` `[T, hd / 2]`, from autograd ops.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(2)?;
    let x1 = x.narrow(2, 0, hd / 2)?;
    let x2 = x.narrow(2, hd / 2, hd / 2)?;
    let cos = cos.unsqueeze(1)?;
    let sin = sin.unsqueeze(1)?;
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
    Ok(Tensor::cat(&[a, b], 2)?)
}

fn lin(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// Which operand of [`lin_frozen`] gets no gradient.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Frozen2 {
    /// `x` is data (the target's features): only `w`'s gradient is computed.
    Input,
    /// `w` is frozen (the target's LM head rows): only `x`'s gradient is computed.
    Weight,
}

/// `x w^T` for 2-D `x` `[t, in]` and `w` `[out, in]` as one custom op whose backward skips the
/// frozen side. candle's matmul backward computes both operands' gradients whether they are
/// tracked or not; for the context projection (`[t, L * hidden]` features) and the frozen
/// draft LM head that wasted work is ~6 of ~40 GFLOP per sequence (an estimate from the
/// shapes, not a measurement). Off the CPU it is the plain product.
pub fn lin_frozen(x: &Tensor, w: &Tensor, frozen: Frozen2) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return lin(x, w);
    }
    Ok(x.contiguous()?
        .apply_op2(&w.contiguous()?, LinFrozen(frozen))?)
}

struct LinFrozen(Frozen2);

impl candle_core::CustomOp2 for LinFrozen {
    fn name(&self) -> &'static str {
        "lin-frozen"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let view = |s: &candle_core::CpuStorage, l: &candle_core::Layout| {
            let (a, b) = l
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg("lin-frozen: strided operand".into()))?;
            Tensor::from_slice(&s.as_slice::<f32>()?[a..b], l.shape(), &Device::Cpu)
        };
        let y = view(s1, l1)?.matmul(&view(s2, l2)?.t()?)?;
        let (st, _) = y.storage_and_layout();
        match &*st {
            candle_core::Storage::Cpu(c) => Ok((c.clone(), y.shape().clone())),
            _ => unreachable!("a CPU product"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok(match self.0 {
            Frozen2::Input => (None, Some(grad.t()?.matmul(x)?)),
            Frozen2::Weight => (Some(grad.matmul(w)?), None),
        })
    }
}

impl TrainDrafter {
    /// Variables initialised from `init` (e.g. [`DSparkDrafter::random`] or a loaded
    /// checkpoint); `cfg` is `init`'s config.
    pub fn new(target: &Model, init: &DSparkDrafter) -> Result<Self> {
        let cfg = init.config().clone();
        cfg.validate(&target.cfg)?;
        ensure!(
            cfg.markov_head_type != HeadKind::Gated
                && !cfg.skip_anchor_row
                && !cfg.own_embeddings
                && cfg.confidence_head_with_markov,
            "training and calibration implement this engine's drafters only: not the gated head, \
             DFlash's skipped anchor row, a stored embedding / LM head or a confidence head \
             without W1 (convert a DeepSpec checkpoint with `dspark-engine convert` first; \
             online recalibration works with every drafter)"
        );
        let dev = target.device.clone();
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().expect("varmap lock");
            for (name, shape) in param_shapes(&cfg) {
                let t = init
                    .tensors()
                    .get(&name)
                    .with_context(|| format!("initial drafter lacks '{name}'"))?;
                ensure!(t.dims() == shape.as_slice(), "shape of '{name}'");
                data.insert(name, Var::from_tensor(&t.to_dtype(DType::F32)?)?);
            }
        }
        let lm_head = dense_rows(&target.weights.lm_head, cfg.draft_vocab.as_deref(), &dev)?;
        let (rope_cos, rope_sin) = dspark_engine::model::rope_table(
            cfg.rope_theta,
            cfg.head_dim,
            target.max_context(),
            &dev,
        )?;
        Ok(Self {
            cfg,
            varmap,
            frozen: Frozen {
                lm_head,
                rope_cos,
                rope_sin,
            },
            device: dev,
        })
    }

    /// The current weights as a serving drafter (config and STS temperatures included).
    pub fn to_drafter(&self, target: &Model, store_dtype: DType) -> Result<DSparkDrafter> {
        let tensors: HashMap<String, Tensor> = self
            .varmap
            .data()
            .lock()
            .expect("varmap lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect();
        DSparkDrafter::from_tensors(target, self.cfg.clone(), tensors, store_dtype)
    }

    /// All variables, in name order (deterministic for the optimiser).
    pub fn vars(&self) -> Vec<(String, Var)> {
        let data = self.varmap.data().lock().expect("varmap lock");
        let mut v: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn params(&self) -> HashMap<String, Tensor> {
        self.varmap
            .data()
            .lock()
            .expect("varmap lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// The blocks at `anchors` (ascending, not empty) of a dataset sequence: its features
    /// up to the last anchor (datasets live in host memory; the drafter may not) as f32 on
    /// the target's device, then [`Self::forward`].
    pub fn forward_seq(&self, target: &Model, s: &Sequence, anchors: &[usize]) -> Result<BlockOut> {
        let tmax = *anchors.last().context("no anchors")?;
        let feats = s
            .feats
            .narrow(0, 0, tmax)?
            .to_device(&target.device)?
            .to_dtype(DType::F32)?;
        self.forward(
            target,
            &Blocks {
                feats: &feats,
                tokens: &s.tokens,
                anchors,
            },
        )
    }

    /// Target-layer features and anchors of one sequence -> block logits and confidences.
    pub fn forward(&self, target: &Model, b: &Blocks<'_>) -> Result<BlockOut> {
        let cfg = &self.cfg;
        let dev = &self.device;
        let p = self.params();
        let get = |n: &str| -> Result<&Tensor> {
            p.get(n).with_context(|| format!("missing variable '{n}'"))
        };
        let gamma = cfg.block_size;
        let na = b.anchors.len();
        ensure!(na > 0, "no anchors");
        let n = gamma * na;
        for &a in b.anchors {
            if a == 0 || a + gamma > b.tokens.len() || a > b.feats.dim(0)? {
                bail!(
                    "anchor {a} is outside 1..={} for a block of {gamma} ({} tokens, {} feature rows)",
                    b.tokens.len().saturating_sub(gamma),
                    b.tokens.len(),
                    b.feats.dim(0)?
                );
            }
        }
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let t_ctx = *b.anchors.iter().max().expect("non-empty");
        // Context features.
        let ctx = lin_frozen(
            &b.feats.narrow(0, 0, t_ctx)?,
            get("fc.weight")?,
            Frozen2::Input,
        )?;
        let ctx = rms_norm(&ctx, get("hidden_norm.weight")?, eps)?;
        // Block inputs: anchor embedding then mask rows.
        let anchors_tok: Vec<u32> = b.anchors.iter().map(|&a| b.tokens[a]).collect();
        let emb = target.embed(&Tensor::new(anchors_tok.as_slice(), dev)?)?; // [na, h]
        let mask_row = if (cfg.mask_token_id as usize) < cfg.vocab_size {
            target.embed(&Tensor::new(&[cfg.mask_token_id], dev)?)?
        } else {
            get("mask_embedding")?.unsqueeze(0)?
        };
        let x0 = if gamma > 1 {
            let masks = mask_row.unsqueeze(0)?.broadcast_as((na, gamma - 1, h))?;
            Tensor::cat(&[emb.unsqueeze(1)?, masks], 1)?
        } else {
            emb.unsqueeze(1)?
        };
        let x0 = if cfg.context_input {
            // Row a - 1 of the context features, for every row of block a.
            let last: Vec<u32> = b.anchors.iter().map(|&a| (a - 1) as u32).collect();
            let c = ctx.index_select(&Tensor::new(last.as_slice(), dev)?, 0)?;
            x0.broadcast_add(&c.unsqueeze(1)?)?
        } else {
            x0
        };
        let mut x = x0.reshape((n, h))?;
        // Positions and the attention mask over [context; blocks].
        let mut blk_pos = Vec::with_capacity(n);
        for &a in b.anchors {
            blk_pos.extend((a..a + gamma).map(|p| p as u32));
        }
        let ctx_pos: Vec<u32> = (0..t_ctx as u32).collect();
        let s = t_ctx + n;
        // Large and finite (not -inf): exp underflows to exactly 0 with no NaN in backward.
        let mut mask = vec![-1e9f32; n * s];
        for (i, &a) in b.anchors.iter().enumerate() {
            for j in 0..gamma {
                let row = &mut mask[(i * gamma + j) * s..(i * gamma + j + 1) * s];
                row[..a].iter_mut().for_each(|m| *m = 0.0);
                row[t_ctx + i * gamma..t_ctx + (i + 1) * gamma]
                    .iter_mut()
                    .for_each(|m| *m = 0.0);
            }
        }
        let mask = Tensor::from_vec(mask, (1, n, s), dev)?;
        let idx = |v: &[u32]| Tensor::new(v, dev);
        let (bcos, bsin) = (
            self.frozen.rope_cos.index_select(&idx(&blk_pos)?, 0)?,
            self.frozen.rope_sin.index_select(&idx(&blk_pos)?, 0)?,
        );
        let (ccos, csin) = (
            self.frozen.rope_cos.index_select(&idx(&ctx_pos)?, 0)?,
            self.frozen.rope_sin.index_select(&idx(&ctx_pos)?, 0)?,
        );
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        for i in 0..cfg.num_hidden_layers {
            let w = |s: &str| get(&format!("layers.{i}.{s}.weight"));
            let hn = rms_norm(&x, w("input_layernorm")?, eps)?;
            let q = lin(&hn, w("self_attn.q_proj")?)?.reshape((n, nh, hd))?;
            let q = rope(&rms_norm(&q, w("self_attn.q_norm")?, eps)?, &bcos, &bsin)?;
            let keys = |inp: &Tensor, cos: &Tensor, sin: &Tensor| -> Result<(Tensor, Tensor)> {
                let t = inp.dim(0)?;
                let k = lin(inp, w("self_attn.k_proj")?)?.reshape((t, nkv, hd))?;
                let k = rope(&rms_norm(&k, w("self_attn.k_norm")?, eps)?, cos, sin)?;
                let v = lin(inp, w("self_attn.v_proj")?)?.reshape((t, nkv, hd))?;
                Ok((k, v))
            };
            let (kc, vc) = keys(&ctx, &ccos, &csin)?;
            let (kb, vb) = keys(&hn, &bcos, &bsin)?;
            // [nkv, s, hd] -> [nh, s, hd] (query head j uses key/value head j / group).
            let expand = |t: Tensor| -> Result<Tensor> {
                let t = t.transpose(0, 1)?.contiguous()?;
                Ok(t.unsqueeze(1)?
                    .broadcast_as((nkv, group, s, hd))?
                    .reshape((nh, s, hd))?)
            };
            let k = expand(Tensor::cat(&[kc, kb], 0)?)?;
            let v = expand(Tensor::cat(&[vc, vb], 0)?)?;
            let q = q.transpose(0, 1)?.contiguous()?; // [nh, n, hd]
            let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&scores, D::Minus1)?;
            let o = att
                .matmul(&v)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, nh * hd))?;
            x = (x + lin(&o, w("self_attn.o_proj")?)?)?;
            let hn = rms_norm(&x, w("post_attention_layernorm")?, eps)?;
            let g = candle_nn::ops::silu(&lin(&hn, w("mlp.gate_proj")?)?)?;
            let u = lin(&hn, w("mlp.up_proj")?)?;
            x = (&x + lin(&(g * u)?, w("mlp.down_proj")?)?)?;
        }
        let hfin = rms_norm(&x, get("norm.weight")?, eps)?; // [n, h]
        let base = lin_frozen(&hfin, &self.frozen.lm_head, Frozen2::Weight)?;
        // Sequential head, teacher-forced on the data tokens.
        let mut prev = Vec::with_capacity(n);
        for &a in b.anchors {
            prev.extend_from_slice(&b.tokens[a..a + gamma]);
        }
        if let Some(index) = cfg.w1_index() {
            prev.iter_mut().for_each(|t| *t = index[*t as usize]);
        }
        let (logits, e) = match cfg.markov_head_type {
            HeadKind::Parallel => (base, None),
            HeadKind::Gated => unreachable!("refused in TrainDrafter::new"),
            HeadKind::Markov => {
                let e = get(W1)?.index_select(&idx(&prev)?, 0)?;
                let bias = lin(&e, get(W2)?)?;
                ((base + bias)?, Some(e))
            }
            HeadKind::Rnn => {
                let e = get(W1)?.index_select(&idx(&prev)?, 0)?;
                let r = e.dim(1)?;
                let e3 = e.reshape((na, gamma, r))?;
                let h3 = hfin.reshape((na, gamma, h))?;
                let (pw, pb) = (get(RNN_W)?, get(RNN_B)?);
                let mut st = Tensor::zeros((na, r), DType::F32, dev)?;
                let mut outs = Vec::with_capacity(gamma);
                for k in 0..gamma {
                    let inp = Tensor::cat(
                        &[
                            st.clone(),
                            e3.narrow(1, k, 1)?.squeeze(1)?,
                            h3.narrow(1, k, 1)?.squeeze(1)?,
                        ],
                        1,
                    )?;
                    let gco = lin(&inp, pw)?.broadcast_add(pb)?;
                    let g = sigmoid(&gco.narrow(1, 0, r)?)?;
                    let c = gco.narrow(1, r, r)?.tanh()?;
                    st = ((&g * &st)? + (g.affine(-1.0, 1.0)? * c)?)?;
                    outs.push(gco.narrow(1, 2 * r, r)?.tanh()?);
                }
                let o = Tensor::stack(&outs, 1)?.reshape((n, r))?;
                let bias = lin(&o, get(W2)?)?;
                ((base + bias)?, Some(e))
            }
        };
        let conf_logit = if cfg.enable_confidence_head {
            let inp = match &e {
                Some(e) => Tensor::cat(&[&hfin, e], 1)?,
                None => hfin.clone(),
            };
            let z = lin(&inp, get(CONF_W)?)?.broadcast_add(get(CONF_B)?)?;
            Some(z.squeeze(1)?)
        } else {
            None
        };
        Ok(BlockOut { logits, conf_logit })
    }
}
