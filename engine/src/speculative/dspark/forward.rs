//! The parallel backbone: the drafter's context cache fed with the target's hidden states,
//! and the forward over a block that gives the per-position hidden states.

use super::*;

/// One sequence's committed positions `start..start + n` for
/// [`DSparkDrafter::append_contexts`].
pub struct ContextFeed<'a> {
    /// The sequence's block table in the drafter cache, covering `start + n`.
    pub table: &'a [u32],
    pub start: usize,
    /// The target's outputs of `target_layers()` for those positions, `[n, hidden]` each.
    pub hidden: &'a [Tensor],
}

impl DSparkDrafter {
    pub(super) fn kv_dim(&self) -> usize {
        self.cfg.num_key_value_heads * self.cfg.head_dim
    }

    /// The drafter's own context KV cache (one layer per drafter layer), f32.
    pub fn new_cache(
        &self,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<KvCache> {
        self.new_cache_as(budget_bytes, block_size, device, DType::F32)
    }

    /// [`Self::new_cache`] of `dtype` (f32 or f16): serving keeps the drafter's keys and
    /// values in the target cache's type (f16 halves what a draft reads of them).
    pub fn new_cache_as(
        &self,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<KvCache> {
        KvCache::new_as(
            self.layers.len(),
            self.kv_dim(),
            budget_bytes,
            block_size,
            device,
            dtype,
        )
    }

    pub(super) fn check_cache(&self, kv: &KvCache) -> Result<()> {
        if kv.k.len() != self.layers.len() || kv.kv_dim() != self.kv_dim() {
            bail!(
                "KV cache has {} layers of width {}, the drafter needs {} of width {} (use DSparkDrafter::new_cache)",
                kv.k.len(),
                kv.kv_dim(),
                self.layers.len(),
                self.kv_dim()
            );
        }
        Ok(())
    }

    /// RoPE rows for absolute positions.
    pub(super) fn rope_at(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let max = self.rope_cos.dim(0)?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= max) {
            bail!("position {p} exceeds the drafter's context of {max}");
        }
        let pos = Tensor::new(positions, &self.device)?;
        Ok((
            self.rope_cos.index_select(&pos, 0)?,
            self.rope_sin.index_select(&pos, 0)?,
        ))
    }

    /// Keys (k_norm, RoPE) and values of `x` `[T, hidden]` for layer `l`, each `[T, kv_dim]`
    /// (one parallel region for both projections on the CPU kernels).
    pub(super) fn key_values(
        &self,
        l: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let [k, v]: [Tensor; 2] = crate::model::linear::forward_many(&[&l.k, &l.v], x)?
            .try_into()
            .map_err(|_| anyhow::anyhow!("two projections give two outputs"))?;
        Ok((self.rotated_keys(l, &k, cos, sin)?, v.contiguous()?))
    }

    /// Projected keys `k` `[T, kv_dim]` of layer `l` normed (k_norm) and rotated (RoPE).
    fn rotated_keys(&self, l: &Layer, k: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let t = k.dim(0)?;
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim);
        let k = rms_norm(&k.reshape((t, nkv, hd))?, &l.k_norm, self.eps)?;
        Ok(rope(&k, cos, sin)?.reshape((t, nkv * hd))?)
    }

    /// Context features of committed tokens at positions `[start, start + n)`: `hidden[i]` is
    /// the target's output of `target_layers()[i]` for those tokens (`[n, hidden]` each).
    /// Computes `hidden_norm(fc(concat))` and writes every drafter layer's keys/values into
    /// the slots of `table` (which must cover `start + n`). With `context_input`, returns the
    /// feature of the last position (`[hidden]`) for the next [`DraftRequest::last_context`].
    pub fn append_context(
        &self,
        kv: &mut KvCache,
        table: &[u32],
        start: usize,
        hidden: &[Tensor],
    ) -> Result<Option<Tensor>> {
        let feed = ContextFeed {
            table,
            start,
            hidden,
        };
        Ok(self.append_contexts(kv, &[feed])?.pop().flatten())
    }

    /// [`Self::append_context`] for several sequences in one batched pass (one `fc`, one
    /// projection per layer and one cache write for all their rows): the engine feeds every
    /// sequence that is about to draft this way. Returns each feed's last context feature
    /// (`None` for an empty feed or without `context_input`), in input order.
    pub fn append_contexts(
        &self,
        kv: &mut KvCache,
        feeds: &[ContextFeed<'_>],
    ) -> Result<Vec<Option<Tensor>>> {
        self.count_call();
        self.check_cache(kv)?;
        let layers = self.cfg.target_layer_ids.len();
        let mut positions: Vec<u32> = Vec::new();
        let mut slots: Vec<u32> = Vec::new();
        let mut rows: Vec<Vec<&Tensor>> = vec![Vec::new(); layers];
        let mut last_row: Vec<Option<usize>> = Vec::with_capacity(feeds.len());
        for f in feeds {
            if f.hidden.len() != layers {
                bail!(
                    "append_context got {} hidden-state tensors, the drafter uses {layers} target layers",
                    f.hidden.len()
                );
            }
            let n = f.hidden[0].dim(0)?;
            for h in f.hidden {
                if h.dims() != [n, self.cfg.hidden_size] {
                    bail!(
                        "append_context: hidden states of shape {:?}, expected [{n}, {}]",
                        h.dims(),
                        self.cfg.hidden_size
                    );
                }
            }
            if n == 0 {
                last_row.push(None);
                continue;
            }
            if f.table.len() * kv.block_size < f.start + n {
                bail!(
                    "append_context: block table of {} blocks does not cover position {}",
                    f.table.len(),
                    f.start + n - 1
                );
            }
            positions.extend((f.start..f.start + n).map(|p| p as u32));
            slots.extend((f.start..f.start + n).map(|p| kv.slot(f.table, p) as u32));
            for (li, h) in f.hidden.iter().enumerate() {
                rows[li].push(h);
            }
            last_row.push(Some(positions.len() - 1));
        }
        if positions.is_empty() {
            return Ok(vec![None; feeds.len()]);
        }
        let (cos, sin) = self.rope_at(&positions)?;
        let idx = kv.slot_index(slots)?;
        let per_layer: Vec<Tensor> = rows
            .iter()
            .map(|r| Tensor::cat(r, 0))
            .collect::<candle_core::Result<_>>()?;
        let ctx = self.fc.forward(&Tensor::cat(&per_layer, 1)?)?;
        let ctx = rms_norm(&ctx, &self.hidden_norm, self.eps)?;
        for (li, l) in self.layers.iter().enumerate() {
            let (k, v) = self.key_values(l, &ctx, &cos, &sin)?;
            kv.write(li, &idx, &k, &v)?;
        }
        last_row
            .into_iter()
            .map(|r| match r {
                Some(r) if self.cfg.context_input => Ok(Some(ctx.get(r)?)),
                _ => Ok(None),
            })
            .collect()
    }

    /// Embeddings of `ids`: the checkpoint's own table when it has one, else the target's.
    pub(super) fn embed(&self, target: &Model, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, &self.device)?;
        Ok(match &self.own_embed {
            Some(e) => e.index_select(&ids, 0)?,
            None => target.embed(&ids)?,
        })
    }

    /// The LM head of the drafts: the checkpoint's own, the draft-vocabulary rows of the
    /// target's, or the target's.
    pub(super) fn lm_logits(&self, target: &Model, h: &Tensor) -> Result<Tensor> {
        Ok(match (&self.own_lm_head, &self.draft_lm_head) {
            (Some(l), _) => l.forward(h)?,
            (None, Some(l)) => l.forward(h)?,
            (None, None) => target.weights.lm_head.forward(h)?,
        })
    }

    /// The parallel backbone over all requests' blocks in one batched forward: returns the
    /// normed block outputs `h` `[rows, hidden]` (each request's `block_rows(gamma)` rows,
    /// in request order) and the row of each request's first draft. Writes the blocks'
    /// keys/values into the cache at `anchor_pos..anchor_pos + block_rows(gamma)`.
    pub(super) fn backbone(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &[DraftRequest<'_>],
    ) -> Result<(Tensor, Vec<usize>)> {
        let cfg = &self.cfg;
        let b = reqs.len();
        let mut embed_idx = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut seqs = Vec::with_capacity(b);
        let mut first_draft = Vec::with_capacity(b);
        for (i, r) in reqs.iter().enumerate() {
            let rows = cfg.block_rows(r.gamma);
            let end = r.anchor_pos + rows;
            first_draft.push(positions.len() + usize::from(cfg.skip_anchor_row));
            seqs.push(AttnSeq {
                q_start: positions.len(),
                q_len: rows,
                q_pos0: r.anchor_pos,
                kv_len: end,
                block_table: r.block_table.to_vec(),
            });
            embed_idx.push(i as u32);
            embed_idx.extend(std::iter::repeat_n(b as u32, rows - 1));
            for p in r.anchor_pos..end {
                positions.push(p as u32);
                slots.push(kv.slot(r.block_table, p) as u32);
            }
        }
        let t = positions.len();
        let dev = &self.device;
        let anchors: Vec<u32> = reqs.iter().map(|r| r.anchor).collect();
        // Rows 0..b: the anchors' embeddings; row b: the mask input.
        let inputs = Tensor::cat(&[self.embed(target, &anchors)?, self.mask_row.clone()], 0)?;
        let mut x = inputs.index_select(&Tensor::new(embed_idx.as_slice(), dev)?, 0)?;
        if cfg.context_input {
            let rows = reqs
                .iter()
                .map(|r| {
                    let c = r.last_context.context(
                        "this drafter (context_input) needs each request's last context feature",
                    )?;
                    let n = cfg.block_rows(r.gamma);
                    Ok(c.reshape((1, cfg.hidden_size))?
                        .broadcast_as((n, cfg.hidden_size))?)
                })
                .collect::<Result<Vec<_>>>()?;
            x = (x + Tensor::cat(&rows, 0)?)?;
        }
        let (cos, sin) = self.rope_at(&positions)?;
        let idx = kv.slot_index(slots)?;
        let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let attn = PagedAttention {
            seqs: Arc::new(AttnBatch::new(seqs)),
            num_heads: nh,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            block_size: kv.block_size,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            causal: false,
        };
        for (li, l) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &l.input_norm, self.eps)?;
            // q, k and v in one parallel region (the input quantised once).
            let [q, k, v]: [Tensor; 3] =
                crate::model::linear::forward_many(&[&l.q, &l.k, &l.v], &h)?
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("three projections give three outputs"))?;
            let k = self.rotated_keys(l, &k, &cos, &sin)?;
            kv.write(li, &idx, &k, &v.contiguous()?)?;
            let q = rms_norm(&q.reshape((t, nh, hd))?, &l.q_norm, self.eps)?;
            let a = attn.forward(&rope(&q, &cos, &sin)?, &kv.k[li], &kv.v[li])?;
            x = (x + l.o.forward(&a)?)?;
            let h = rms_norm(&x, &l.post_norm, self.eps)?;
            let gu = crate::model::linear::forward_glu(
                &l.gate,
                &l.up,
                &h,
                crate::model::config::Activation::Silu,
            )?;
            x = (&x + l.down.forward(&gu)?)?;
        }
        Ok((rms_norm(&x, &self.norm, self.eps)?, first_draft))
    }
}
