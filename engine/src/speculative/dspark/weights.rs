//! Building a drafter: random initialisation, loading and saving checkpoints (our form and
//! the downloaded layouts), and the derived forms (compact W1, no stored embeddings).

use super::*;

impl DSparkDrafter {
    /// A drafter config for `target`: its dimensions, one layer, the default target layers,
    /// rank 256, a confidence head and a dedicated mask row (`mask_token_id = vocab_size`).
    pub fn default_config(target: &Model, head: HeadKind, gamma: usize) -> DSparkConfig {
        let t = &target.cfg;
        DSparkConfig {
            hidden_size: t.hidden_size,
            vocab_size: t.vocab_size,
            num_attention_heads: t.num_heads,
            num_key_value_heads: t.num_kv_heads,
            head_dim: t.head_dim,
            intermediate_size: t.intermediate_size,
            rms_norm_eps: t.rms_eps,
            rope_theta: t.rope_theta,
            num_hidden_layers: default_num_layers(),
            block_size: gamma,
            mask_token_id: t.vocab_size as u32,
            target_layer_ids: default_target_layers(t.num_layers, 3),
            markov_rank: default_rank(),
            markov_head_type: head,
            enable_confidence_head: true,
            confidence_head_with_markov: true,
            skip_anchor_row: false,
            full_block: false,
            own_embeddings: false,
            context_input: false,
            sts_temperatures: None,
            sts_offsets: None,
            sts_temperatures_greedy: None,
            sts_offsets_greedy: None,
            draft_vocab: None,
            compact_w1: false,
        }
    }

    /// A randomly initialised drafter (PyTorch-style uniform fan-in init, norms at 1),
    /// deterministic per seed. Values are bf16-exact, so `save` + `load` reproduce it bit
    /// for bit.
    pub fn random(target: &Model, cfg: DSparkConfig, seed: u64) -> Result<Self> {
        cfg.check(&target.cfg)
            .map_err(|e| anyhow::anyhow!("invalid drafter config: {e}"))?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        for spec in param_specs(&cfg) {
            let n: usize = spec.shape.iter().product();
            let data: Vec<f32> = match spec.init {
                Init::Ones => vec![1.0; n],
                Init::Uniform(b) => (0..n).map(|_| rng.random_range(-b..=b)).collect(),
            };
            let t = Tensor::from_vec(data, spec.shape, &target.device)?
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?;
            tensors.insert(spec.name, t);
        }
        Self::build(
            target,
            cfg,
            tensors,
            DType::BF16,
            Path::new("<random init>"),
        )
    }

    /// A drafter from named tensors (e.g. trained variables), checked against `cfg` and
    /// `target`; `save` writes them in `store_dtype`.
    pub fn from_tensors(
        target: &Model,
        cfg: DSparkConfig,
        tensors: HashMap<String, Tensor>,
        store_dtype: DType,
    ) -> Result<Self> {
        cfg.validate(&target.cfg)?;
        Self::build(target, cfg, tensors, store_dtype, Path::new("<tensors>"))
    }

    /// Every parameter by checkpoint name (f32).
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.params
    }

    /// Loads a drafter folder for `target`: this engine's own layout, or a DeepSpec DSpark /
    /// z-lab DFlash checkpoint as those projects save it ([`layout`]).
    pub fn load(path: &Path, target: &Model) -> Result<Self> {
        Ok(Self::load_layout(path, target)?.0)
    }

    /// The drafter config of a folder, in whichever layout, with that layout.
    pub fn read_config(path: &Path) -> Result<(Layout, DSparkConfig)> {
        let imported = Self::import_config(&path.join(CONFIG_FILE))?;
        Ok((imported.layout, imported.cfg))
    }

    pub(super) fn import_config(cfg_path: &Path) -> Result<layout::Imported> {
        let text = std::fs::read_to_string(cfg_path)
            .with_context(|| format!("cannot read drafter config {}", cfg_path.display()))?;
        layout::import_config(&text)
            .with_context(|| format!("{} is not a valid drafter config", cfg_path.display()))
    }

    /// [`Self::load`], also returning the layout the folder was in.
    pub fn load_layout(path: &Path, target: &Model) -> Result<(Self, Layout)> {
        let cfg_path = path.join(CONFIG_FILE);
        let imported = Self::import_config(&cfg_path)?;
        let (kind, mut cfg) = (imported.layout, imported.cfg);
        if let Some(n) = imported.num_target_layers {
            if n != target.cfg.num_layers {
                bail!(
                    "{}: key 'num_target_layers' is {n}, expected the target's {} ({} has {} layers)",
                    cfg_path.display(),
                    target.cfg.num_layers,
                    target.id,
                    target.cfg.num_layers
                );
            }
        }
        if cfg.target_layer_ids.is_empty() {
            cfg.target_layer_ids = default_target_layers(target.cfg.num_layers, 3);
        }
        cfg.check(&target.cfg).map_err(|e| {
            anyhow::anyhow!(
                "{}: drafter does not fit target {}: {e}",
                cfg_path.display(),
                target.id
            )
        })?;
        let tensors = layout::read_weights(path, &target.device)?;
        let store_dtype = tensors.get("fc.weight").map_or(DType::BF16, |t| t.dtype());
        let tensors = layout::import_tensors(kind, &cfg, tensors)
            .with_context(|| format!("{}", path.display()))?;
        let d = Self::build(target, cfg, tensors, store_dtype, &path.join(WEIGHTS_FILE))?;
        Ok((d, kind))
    }

    /// Writes the drafter into `dir` in `layout`. The DeepSpec layout stores the embedding
    /// and LM head: the drafter's own copies, or the target's.
    pub fn save_as(&self, dir: &Path, layout: Layout, target: &Model) -> Result<()> {
        if layout == Layout::Native {
            return self.save(dir);
        }
        let embeddings = match (&self.own_embed, layout) {
            (Some(e), _) => Some((e.clone(), self.params[LM_HEAD].clone())),
            (None, Layout::DeepSpec) => Some(target_embeddings(target)?),
            _ => None,
        };
        let (cfg, tensors) = layout::export(
            layout,
            &self.cfg,
            &self.params,
            target.cfg.num_layers,
            embeddings,
        )?;
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cfg_path = dir.join(CONFIG_FILE);
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg)?)
            .with_context(|| format!("cannot write {}", cfg_path.display()))?;
        let mut out = HashMap::new();
        for (name, t) in tensors {
            out.insert(name, t.to_dtype(self.store_dtype)?);
        }
        let w_path = dir.join(WEIGHTS_FILE);
        candle_core::safetensors::save(&out, &w_path)
            .with_context(|| format!("cannot write {}", w_path.display()))
    }

    /// This drafter using the target's embedding and LM head instead of its own copies,
    /// with the largest |difference| between the copies and the target's (0 when it had none).
    pub fn without_own_embeddings(&self, target: &Model) -> Result<(Self, f32)> {
        let Some(own) = &self.own_embed else {
            return Ok((
                Self::from_tensors(
                    target,
                    self.cfg.clone(),
                    self.params
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                    self.store_dtype,
                )?,
                0.0,
            ));
        };
        let (embed, lm_head) = target_embeddings(target)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        let d = diff(own, &embed)?.max(diff(&self.params[LM_HEAD], &lm_head)?);
        let tensors = self
            .params
            .iter()
            .filter(|(k, _)| k.as_str() != EMBED && k.as_str() != LM_HEAD)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let cfg = DSparkConfig {
            own_embeddings: false,
            ..self.cfg.clone()
        };
        Ok((
            Self::from_tensors(target, cfg, tensors, self.store_dtype)?,
            d,
        ))
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if missing).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cfg_path = dir.join(CONFIG_FILE);
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&self.cfg)?)
            .with_context(|| format!("cannot write {}", cfg_path.display()))?;
        let mut out = HashMap::new();
        for (name, t) in &self.params {
            out.insert(name.clone(), t.to_dtype(self.store_dtype)?);
        }
        let w_path = dir.join(WEIGHTS_FILE);
        candle_core::safetensors::save(&out, &w_path)
            .with_context(|| format!("cannot write {}", w_path.display()))
    }

    /// Checks every tensor against `cfg` (errors name `origin`) and assembles the drafter.
    pub(super) fn build(
        target: &Model,
        cfg: DSparkConfig,
        mut tensors: HashMap<String, Tensor>,
        store_dtype: DType,
        origin: &Path,
    ) -> Result<Self> {
        let dev = target.device.clone();
        let mut params = BTreeMap::new();
        for spec in param_specs(&cfg) {
            let t = tensors
                .remove(&spec.name)
                .with_context(|| format!("{}: missing tensor '{}'", origin.display(), spec.name))?;
            if t.dims() != spec.shape.as_slice() {
                bail!(
                    "{}: tensor '{}' has shape {:?}, expected {:?} for this config and target",
                    origin.display(),
                    spec.name,
                    t.dims(),
                    spec.shape
                );
            }
            params.insert(spec.name, t.to_dtype(DType::F32)?.to_device(&dev)?);
        }
        let p = |name: &str| params[name].clone();
        let lin = |name: &str| Linear::dense(p(name));
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let n = |s: &str| format!("layers.{i}.{s}.weight");
                Layer {
                    input_norm: p(&n("input_layernorm")),
                    post_norm: p(&n("post_attention_layernorm")),
                    q: lin(&n("self_attn.q_proj")),
                    k: lin(&n("self_attn.k_proj")),
                    v: lin(&n("self_attn.v_proj")),
                    o: lin(&n("self_attn.o_proj")),
                    q_norm: p(&n("self_attn.q_norm")),
                    k_norm: p(&n("self_attn.k_norm")),
                    gate: lin(&n("mlp.gate_proj")),
                    up: lin(&n("mlp.up_proj")),
                    down: lin(&n("mlp.down_proj")),
                }
            })
            .collect();
        let seq_head = SeqHead::new(cfg.markov_head_type, &params);
        let confidence = cfg
            .enable_confidence_head
            .then(|| ConfidenceHead::new(&params, cfg.hidden_size))
            .transpose()?;
        let own_embed = cfg.own_embeddings.then(|| p(EMBED));
        let own_lm_head = cfg.own_embeddings.then(|| lin(LM_HEAD));
        let mask_row =
            if let (Some(e), true) = (&own_embed, (cfg.mask_token_id as usize) < cfg.vocab_size) {
                e.get(cfg.mask_token_id as usize)?.unsqueeze(0)?
            } else if (cfg.mask_token_id as usize) < cfg.vocab_size {
                target.embed(&Tensor::new(&[cfg.mask_token_id], &dev)?)?
            } else {
                p("mask_embedding").unsqueeze(0)?
            };
        let draft_lm_head = cfg
            .draft_vocab
            .as_ref()
            .map(|v| {
                select_rows(&target.weights.lm_head, v).map(crate::model::Linear::from_qmatmul)
            })
            .transpose()?;
        let (rope_cos, rope_sin) =
            crate::model::rope_table(cfg.rope_theta, cfg.head_dim, target.max_context(), &dev)?;
        let w1_index = cfg.w1_index();
        let sub_vocab = cfg
            .draft_vocab
            .clone()
            .map(|ids| Arc::new(crate::sampling::SubVocab::new(ids, cfg.vocab_size)));
        Ok(Self {
            sub_vocab,
            fc: lin("fc.weight"),
            hidden_norm: p("hidden_norm.weight"),
            norm: p("norm.weight"),
            eps: cfg.rms_norm_eps as f32,
            cfg,
            params,
            store_dtype,
            layers,
            seq_head,
            confidence,
            mask_row,
            draft_lm_head,
            own_embed,
            own_lm_head,
            w1_index,
            rope_cos,
            rope_sin,
            device: dev,
            calls: Default::default(),
        })
    }

    /// Serving speed on CPU: re-quantises the backbone's matrices (fc and every layer), the
    /// sequential head's `W2` and an own LM head to `format` for the engine's matmul kernels.
    /// candle's f32 matmul repacks the whole weight on every call, which made a 1-layer draft
    /// cost ~75 % of a target decode step. Drafts may change by the rounding (verification
    /// keeps the output exact); `save` still writes the original weights. No-op on other
    /// devices.
    pub fn use_cpu_kernels(&mut self, format: DrafterWeights) -> Result<()> {
        if !self.device.is_cpu() {
            return Ok(());
        }
        let q = |name: &str| kernel_linear(&self.params[name], format);
        self.fc = q("fc.weight")?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let n = |s: &str| format!("layers.{i}.{s}.weight");
            l.q = q(&n("self_attn.q_proj"))?;
            l.k = q(&n("self_attn.k_proj"))?;
            l.v = q(&n("self_attn.v_proj"))?;
            l.o = q(&n("self_attn.o_proj"))?;
            l.gate = q(&n("mlp.gate_proj"))?;
            l.up = q(&n("mlp.up_proj"))?;
            l.down = q(&n("mlp.down_proj"))?;
        }
        if self.own_lm_head.is_some() {
            self.own_lm_head = Some(q(LM_HEAD)?);
        }
        self.seq_head.use_cpu_kernels(&self.params, format)?;
        Ok(())
    }

    /// This drafter with `compact_w1` ([`DSparkConfig::compact_w1`]): `W1`'s rows of the
    /// draft vocabulary, then one shared row for every other target token, set to the mean
    /// of their rows. Drafts only change when the anchor is outside the draft vocabulary.
    pub fn compact_w1(&self, target: &Model) -> Result<Self> {
        let Some(vocab) = self.cfg.draft_vocab.as_ref() else {
            bail!("compact W1 needs a drafter with a reduced draft vocabulary (draft_vocab)");
        };
        if self.cfg.markov_head_type == HeadKind::Parallel {
            bail!("compact W1 needs a Markov or RNN head; the parallel head has no W1");
        }
        if self.cfg.compact_w1 {
            bail!("this drafter's W1 is already compact");
        }
        let w1 = &self.params[head::W1];
        let dev = w1.device();
        let in_vocab: HashSet<u32> = vocab.iter().copied().collect();
        let others: Vec<u32> = (0..self.cfg.vocab_size as u32)
            .filter(|t| !in_vocab.contains(t))
            .collect();
        let kept = w1.index_select(&Tensor::new(vocab.as_slice(), dev)?, 0)?;
        let shared = if others.is_empty() {
            kept.mean_keepdim(0)?
        } else {
            w1.index_select(&Tensor::new(others.as_slice(), dev)?, 0)?
                .mean_keepdim(0)?
        };
        let mut tensors: HashMap<String, Tensor> = self
            .params
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        tensors.insert(head::W1.into(), Tensor::cat(&[&kept, &shared], 0)?);
        let cfg = DSparkConfig {
            compact_w1: true,
            ..self.cfg.clone()
        };
        Self::from_tensors(target, cfg, tensors, self.store_dtype)
    }
}
