//! Proposing draft blocks: the sequential head left to right over the backbone's outputs,
//! request parameters, grammars, confidences and STS; and the greedy trace for reference checks.

use super::*;

/// One request's drafting input.
pub struct DraftRequest<'a> {
    /// Last committed token `x_0`.
    pub anchor: u32,
    /// Its absolute position; the drafter context holds positions `< anchor_pos`.
    pub anchor_pos: usize,
    /// The request's block table in the DRAFTER cache, covering `anchor_pos + gamma`.
    pub block_table: &'a [u32],
    /// Draft tokens wanted, `1..=block_size`.
    pub gamma: usize,
    pub params: &'a SamplingParams,
    /// The tokens the request's penalties read (its generated tokens); `None`: the drafter
    /// ignores penalties (the verification stays lossless either way; this only helps the
    /// drafts get accepted).
    pub history: Option<&'a History>,
    pub rng: &'a mut ChaCha8Rng,
    /// The context feature of position `anchor_pos - 1` as returned by the last
    /// [`DSparkDrafter::append_context`]; required when the config has `context_input`.
    pub last_context: Option<&'a Tensor>,
}

/// Options of [`DSparkDrafter::propose_with`].
#[derive(Default, Clone, Copy)]
pub struct ProposeOptions<'a> {
    /// Stop a request's block once the running product of its confidences (its prefix
    /// survival) falls below this: later positions cannot be worth verifying. 0: draft
    /// every requested position.
    pub min_survival: f32,
    /// Online recalibration applied to each confidence as it is produced (so the early stop
    /// and the returned block see the calibrated values).
    pub calibration: Option<&'a OnlineCalibration>,
}

/// Everything one greedy block computed ([`DSparkDrafter::trace_greedy`]), per draft position
/// k: base logits `U_k` and sequential-head bias `B_k` (over the draft vocabulary; zeros for
/// the parallel head), the raw confidence logit (before sigmoid and STS; None without a
/// confidence head) and the greedy token (target id).
#[derive(Debug, Clone)]
pub struct BlockTrace {
    pub base_logits: Vec<Vec<f32>>,
    pub bias: Vec<Vec<f32>>,
    pub confidence_logits: Option<Vec<f32>>,
    pub tokens: Vec<u32>,
}

impl DSparkDrafter {
    /// Position `k`'s calibration `(T_k, b_k)` for a request in this decoding mode.
    pub(super) fn sts_for(&self, greedy: bool, k: usize) -> (f32, f32) {
        let c = &self.cfg;
        match (greedy, &c.sts_temperatures_greedy) {
            (true, Some(t)) => (t[k], c.sts_offsets_greedy.as_ref().map_or(0.0, |b| b[k])),
            _ => (
                c.sts_temperatures.as_ref().map_or(1.0, |t| t[k]),
                c.sts_offsets.as_ref().map_or(0.0, |b| b[k]),
            ),
        }
    }

    /// Drafts one block per request in ONE batched drafter forward (see the module docs for
    /// the equations). The blocks' keys/values are written into the drafter cache at
    /// `anchor_pos..anchor_pos + gamma`; `append_context` overwrites them when tokens commit.
    pub fn propose(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
    ) -> Result<Vec<Proposal>> {
        self.propose_with(kv, target, reqs, &ProposeOptions::default())
    }

    /// [`DSparkDrafter::propose`] with an early stop and online calibration: a request whose
    /// prefix survival falls below `opts.min_survival` gets a shorter block (its remaining
    /// positions are not drafted, and the sequential loop ends when every request stopped).
    pub fn propose_with(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
    ) -> Result<Vec<Proposal>> {
        self.propose_under(kv, target, reqs, opts, &mut [])
    }

    /// [`DSparkDrafter::propose_with`] under grammars: `grammars[i]` (when given; the
    /// slice is empty or one per request) masks request `i`'s proposals position by
    /// position, walked along its draft and rolled back after, so no draft token is one
    /// the grammar forbids (a block ends early where it allows no draft-vocabulary token).
    pub fn propose_under(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
        grammars: &mut [Option<&mut crate::constraint::Constraint>],
    ) -> Result<Vec<Proposal>> {
        if !grammars.is_empty() && grammars.len() != reqs.len() {
            bail!(
                "{} grammars for {} draft requests",
                grammars.len(),
                reqs.len()
            );
        }
        // The grammars come back as they were, whatever happens.
        let mut consumed = vec![0usize; grammars.len()];
        let r = self.propose_inner(kv, target, reqs, opts, grammars, &mut consumed);
        for (g, &n) in grammars.iter_mut().zip(&consumed) {
            if let Some(g) = g {
                g.rollback(n)?;
            }
        }
        r
    }

    pub(super) fn propose_inner(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
        grammars: &mut [Option<&mut crate::constraint::Constraint>],
        consumed: &mut [usize],
    ) -> Result<Vec<Proposal>> {
        self.count_call();
        self.check_cache(kv)?;
        for r in reqs.iter() {
            if r.gamma == 0 || r.gamma > self.cfg.block_size {
                bail!(
                    "gamma {} is outside 1..={} (the drafter's block_size)",
                    r.gamma,
                    self.cfg.block_size
                );
            }
            if r.anchor as usize >= self.cfg.vocab_size {
                bail!(
                    "anchor token {} is outside the vocabulary of {}",
                    r.anchor,
                    self.cfg.vocab_size
                );
            }
            let end = r.anchor_pos + self.cfg.block_rows(r.gamma);
            if r.block_table.len() * kv.block_size < end {
                bail!(
                    "drafter block table of {} blocks does not cover the block at {}..{end}",
                    r.block_table.len(),
                    r.anchor_pos,
                );
            }
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let (h, row0) = self.backbone(kv, target, reqs)?;
        let vd = self.cfg.draft_vocab_size();
        let base: Vec<f32> = self.lm_logits(target, &h)?.flatten_all()?.to_vec1()?;
        let conf_h = self
            .confidence
            .as_ref()
            .map(|c| c.hidden_part(&h))
            .transpose()?;
        let max_gamma = reqs.iter().map(|r| r.gamma).max().unwrap_or(0);
        let mut blocks: Vec<Proposal> = reqs
            .iter()
            .map(|r| Proposal {
                tokens: Vec::with_capacity(r.gamma),
                q: Vec::with_capacity(r.gamma),
                confidence: Vec::with_capacity(r.gamma),
            })
            .collect();
        let mut prev: Vec<u32> = reqs.iter().map(|r| r.anchor).collect();
        let mut state = None;
        // Per request: its block length so far may still grow, and its prefix survival.
        let mut open: Vec<bool> = vec![true; reqs.len()];
        let mut surv: Vec<f32> = vec![1.0; reqs.len()];
        for k in 0..max_gamma {
            if !open.iter().zip(reqs.iter()).any(|(&o, r)| o && k < r.gamma) {
                break;
            }
            // Requests whose block is shorter repeat their last row; their results are unused.
            let rows: Vec<u32> = reqs
                .iter()
                .zip(&row0)
                .map(|(r, &s)| (s + k.min(r.gamma - 1)) as u32)
                .collect();
            let w1_rows: Vec<u32> = match &self.w1_index {
                Some(index) => prev.iter().map(|&t| index[t as usize]).collect(),
                None => prev.clone(),
            };
            let step = self.seq_head.step(&w1_rows, &h, &rows, &mut state)?;
            let conf_e = match (&self.confidence, &step.prev_embedding) {
                (Some(c), Some(e)) => c.prev_part(e)?,
                _ => None,
            };
            for (i, r) in reqs.iter_mut().enumerate() {
                if k >= r.gamma || !open[i] {
                    continue;
                }
                let row = rows[i] as usize;
                let mut logits = base[row * vd..(row + 1) * vd].to_vec();
                if let Some(bias) = &step.bias {
                    for (l, b) in logits.iter_mut().zip(&bias[i * vd..(i + 1) * vd]) {
                        *l += b;
                    }
                }
                if r.params.edits_logits() {
                    // The request's bias and penalties, after this block's drafts so far.
                    let mut h = r.history.cloned().unwrap_or_default();
                    for &t in &blocks[i].tokens {
                        h.push(t);
                    }
                    match &self.sub_vocab {
                        Some(v) => edit_logits(&mut logits, r.params, &h, |t| v.position(t)),
                        None => edit_logits(&mut logits, r.params, &h, |t| Some(t as usize)),
                    }
                }
                if let Some(Some(g)) = grammars.get_mut(i) {
                    if !self.mask_draft(g, &mut logits)? {
                        open[i] = false;
                        continue;
                    }
                }
                let q = target_probs(&logits, r.params);
                let x = q.sample(r.rng);
                let z = match (&self.confidence, &conf_h) {
                    (Some(c), Some(zh)) => zh[row] + conf_e.as_ref().map_or(0.0, |e| e[i]) + c.bias,
                    _ => head::raw_logit(&logits, x),
                };
                let greedy = matches!(q, Dist::Greedy(_));
                let (t_k, b_k) = self.sts_for(greedy, k);
                let (tok, q) = self.to_target_vocab(x, q);
                let mut conf = sigmoid(z / t_k + b_k);
                if let Some(oc) = opts.calibration {
                    conf = oc.adjust_one(greedy, k, conf);
                }
                if let Some(Some(g)) = grammars.get_mut(i) {
                    g.consume(tok)?;
                    consumed[i] += 1;
                }
                let blk = &mut blocks[i];
                blk.tokens.push(tok);
                blk.q.push(q);
                blk.confidence.push(conf);
                prev[i] = tok;
                surv[i] *= if conf.is_nan() {
                    0.0
                } else {
                    conf.clamp(0.0, 1.0)
                };
                if surv[i] < opts.min_survival {
                    open[i] = false;
                }
            }
        }
        Ok(blocks)
    }

    /// Masks draft-vocabulary `logits` to what grammar `g` allows next; false when it
    /// allows none of them (or only the end).
    pub(super) fn mask_draft(
        &self,
        g: &mut crate::constraint::Constraint,
        logits: &mut [f32],
    ) -> Result<bool> {
        if g.is_stopped() {
            return Ok(false);
        }
        let m = g.mask()?;
        let mut any = false;
        for (d, l) in logits.iter_mut().enumerate() {
            let t = match &self.sub_vocab {
                Some(v) => v.ids[d],
                None => d as u32,
            };
            if m.is_allowed(t) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(any)
    }

    /// One full block drafted greedily (argmax of `U_k + B_k`, no request parameters, no
    /// STS) with every intermediate value, for checks against reference implementations:
    /// the same backbone and heads as [`Self::propose`].
    pub fn trace_greedy(
        &self,
        kv: &mut KvCache,
        target: &Model,
        anchor: u32,
        anchor_pos: usize,
        block_table: &[u32],
    ) -> Result<BlockTrace> {
        self.check_cache(kv)?;
        let params = SamplingParams::default();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let gamma = self.cfg.block_size;
        let reqs = [DraftRequest {
            anchor,
            anchor_pos,
            block_table,
            gamma,
            params: &params,
            history: None,
            rng: &mut rng,
            last_context: None,
        }];
        let (h, row0) = self.backbone(kv, target, &reqs)?;
        let rows = h.narrow(0, row0[0], gamma)?;
        let base: Vec<Vec<f32>> = self.lm_logits(target, &rows)?.to_vec2()?;
        let conf_h = self
            .confidence
            .as_ref()
            .map(|c| c.hidden_part(&rows))
            .transpose()?;
        let mut out = BlockTrace {
            base_logits: base.clone(),
            bias: Vec::with_capacity(gamma),
            confidence_logits: conf_h.as_ref().map(|_| Vec::with_capacity(gamma)),
            tokens: Vec::with_capacity(gamma),
        };
        let mut prev = anchor;
        let mut state = None;
        for (k, base_k) in base.iter().enumerate() {
            let w1_row = match &self.w1_index {
                Some(index) => index[prev as usize],
                None => prev,
            };
            let step = self
                .seq_head
                .step(&[w1_row], &rows, &[k as u32], &mut state)?;
            let bias = step.bias.unwrap_or_else(|| vec![0.0; base_k.len()]);
            let logits: Vec<f32> = base_k.iter().zip(&bias).map(|(u, b)| u + b).collect();
            let x = crate::model::argmax(&logits);
            if let (Some(c), Some(zh), Some(z)) =
                (&self.confidence, &conf_h, out.confidence_logits.as_mut())
            {
                let e = match &step.prev_embedding {
                    Some(e) => c.prev_part(e)?.map_or(0.0, |v| v[0]),
                    None => 0.0,
                };
                z.push(zh[k] + e + c.bias);
            }
            let tok = self.sub_vocab.as_ref().map_or(x, |v| v.ids[x as usize]);
            out.bias.push(bias);
            out.tokens.push(tok);
            prev = tok;
        }
        Ok(out)
    }

    /// Maps a draft-vocabulary token and distribution to target ids (identity without a
    /// reduced vocabulary).
    pub(super) fn to_target_vocab(&self, x: u32, q: Dist) -> (u32, Dist) {
        let Some(vocab) = &self.sub_vocab else {
            return (x, q);
        };
        let q = match q {
            Dist::Greedy(t) => Dist::Greedy(vocab.ids[t as usize]),
            Dist::Probs(probs) => Dist::Sparse {
                vocab: vocab.clone(),
                probs,
            },
            sparse @ Dist::Sparse { .. } => sparse,
        };
        (vocab.ids[x as usize], q)
    }
}
