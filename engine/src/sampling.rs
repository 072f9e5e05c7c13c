//! Turning logits into tokens: logit bias, repetition / presence / frequency penalties,
//! temperature, min-p, top-k, top-p, seeded sampling and logprobs.
//!
//! [`target_dist`] is the target's *processed* distribution at one position, given the
//! tokens before it ([`History`]); speculative verification compares draft tokens against
//! exactly this distribution, and [`block_dists`] judges each position of a draft block
//! after the draft tokens before it (accepted, if verification reaches it), so sampling with
//! or without a drafter draws from the same law.
//!
//! The order is vLLM's: bias and penalties on the logits, then temperature, then min-p,
//! top-k and top-p on the probabilities. Greedy decoding takes the argmax of the biased,
//! penalised logits. Presence and frequency penalties count generated tokens (as OpenAI
//! defines them); the repetition penalty (an extension) also counts the prompt's.

use crate::kernels::vmath::lane_sum;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    pub seed: Option<u64>,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (0: off).
    pub min_p: f32,
    /// Subtracted from the logit of every token generated at least once (OpenAI, -2..2).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI, -2..2).
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens seen in the prompt or the
    /// output (1: off).
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (OpenAI `logit_bias`, -100..100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy(&self) -> bool {
        self.temperature <= 1e-5 || self.top_k == 1
    }

    /// The distribution depends on the tokens before the position (penalties).
    pub fn uses_history(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.uses_prompt()
    }

    /// The penalties read the prompt's tokens too.
    pub fn uses_prompt(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    /// The logits are changed before temperature (bias or penalties).
    pub fn edits_logits(&self) -> bool {
        self.uses_history() || !self.logit_bias.is_empty()
    }
}

/// The tokens a position's penalties read: how often each token was generated, and which
/// tokens the prompt holds (only when the repetition penalty needs them).
#[derive(Debug, Clone, Default)]
pub struct History {
    output: std::collections::HashMap<u32, u32>,
    prompt: std::collections::HashSet<u32>,
}

impl History {
    /// The history of a sequence with `prompt`, before any generated token.
    pub fn new(prompt: &[u32], sp: &SamplingParams) -> Self {
        let mut h = History::default();
        if sp.uses_prompt() {
            h.prompt.extend(prompt.iter().copied());
        }
        h
    }

    /// Records a generated token.
    pub fn push(&mut self, tok: u32) {
        *self.output.entry(tok).or_default() += 1;
    }
}

/// The logits after `logit_bias` and the penalties for `hist`, borrowed unchanged when the
/// request sets none.
pub fn processed_logits<'a>(
    logits: &'a [f32],
    sp: &SamplingParams,
    hist: &History,
) -> std::borrow::Cow<'a, [f32]> {
    if !sp.edits_logits() {
        return std::borrow::Cow::Borrowed(logits);
    }
    let mut l = logits.to_vec();
    edit_logits(&mut l, sp, hist, |id| Some(id as usize));
    std::borrow::Cow::Owned(l)
}

/// Applies `logit_bias` and the penalties for `hist` to `logits`, where token id `t` sits at
/// position `pos(t)` (`None`: not in this vocabulary). A drafter with a reduced vocabulary
/// edits its own logits the same way, so that it proposes what the target will accept.
pub fn edit_logits(
    logits: &mut [f32],
    sp: &SamplingParams,
    hist: &History,
    pos: impl Fn(u32) -> Option<usize>,
) {
    for &(id, b) in &sp.logit_bias {
        if let Some(i) = pos(id).filter(|&i| i < logits.len()) {
            logits[i] += b;
        }
    }
    if sp.repetition_penalty != 1.0 {
        let r = sp.repetition_penalty;
        let mut done = std::collections::HashSet::new();
        for &id in hist.output.keys().chain(hist.prompt.iter()) {
            if !done.insert(id) {
                continue;
            }
            if let Some(i) = pos(id).filter(|&i| i < logits.len()) {
                let x = &mut logits[i];
                *x = if *x > 0.0 { *x / r } else { *x * r };
            }
        }
    }
    if sp.presence_penalty != 0.0 || sp.frequency_penalty != 0.0 {
        for (&id, &n) in &hist.output {
            if let Some(i) = pos(id).filter(|&i| i < logits.len()) {
                logits[i] -= sp.presence_penalty + sp.frequency_penalty * n as f32;
            }
        }
    }
}

/// The target's processed distribution at a position whose earlier tokens are `hist`.
pub fn target_dist(logits: &[f32], sp: &SamplingParams, hist: &History) -> Dist {
    target_dist_masked(logits, sp, hist, None)
}

/// [`target_dist`] restricted to the tokens `mask` allows (a grammar's, see
/// [`crate::constraint`]): the others get probability 0, the rest keep their ratios.
pub fn target_dist_masked(
    logits: &[f32],
    sp: &SamplingParams,
    hist: &History,
    mask: Option<&crate::constraint::Mask>,
) -> Dist {
    let Some(mask) = mask else {
        return target_probs(&processed_logits(logits, sp, hist), sp);
    };
    let mut l = processed_logits(logits, sp, hist).into_owned();
    let mut any = false;
    for (i, x) in l.iter_mut().enumerate() {
        if mask.is_allowed(i as u32) {
            any = true;
        } else {
            *x = f32::NEG_INFINITY;
        }
    }
    if !any {
        // Nothing allowed (cannot happen with a grammar that allows its end tokens): the
        // unconstrained law, rather than a division by zero.
        return target_probs(&processed_logits(logits, sp, hist), sp);
    }
    target_probs(&l, sp)
}

/// The target's distributions for a verify block: `rows[j]` is judged after `hist` and the
/// draft tokens `draft[..j]` (the tokens verification has accepted when it reaches row j).
pub fn block_dists(
    rows: &[Vec<f32>],
    sp: &SamplingParams,
    hist: &History,
    draft: &[u32],
) -> Vec<Dist> {
    block_dists_masked(rows, sp, hist, draft, None)
}

/// [`block_dists`] with the grammar's mask of each position (`masks[j]`: after `draft[..j]`).
pub fn block_dists_masked(
    rows: &[Vec<f32>],
    sp: &SamplingParams,
    hist: &History,
    draft: &[u32],
    masks: Option<&[crate::constraint::Mask]>,
) -> Vec<Dist> {
    let mask = |j: usize| masks.map(|m| &m[j]);
    if !sp.uses_history() {
        return rows
            .iter()
            .enumerate()
            .map(|(j, r)| target_dist_masked(r, sp, hist, mask(j)))
            .collect();
    }
    let mut h = hist.clone();
    rows.iter()
        .enumerate()
        .map(|(j, r)| {
            if j > 0 {
                h.push(draft[j - 1]);
            }
            target_dist_masked(r, sp, &h, mask(j))
        })
        .collect()
}

/// A processed distribution over the vocabulary: dense probabilities that sum to 1, a point
/// mass for greedy decoding, or probabilities on a subset of the vocabulary (a drafter's
/// reduced vocabulary: every other id has probability 0), which spares a full-vocabulary
/// vector per drafted position.
#[derive(Debug, Clone)]
pub enum Dist {
    Greedy(u32),
    Probs(Vec<f32>),
    Sparse {
        vocab: std::sync::Arc<SubVocab>,
        /// `probs[i]` is the probability of `vocab.ids[i]`.
        probs: Vec<f32>,
    },
}

/// A subset of the vocabulary: its ids and the reverse index.
#[derive(Debug, Clone, PartialEq)]
pub struct SubVocab {
    pub ids: Vec<u32>,
    /// Full-vocabulary id -> position in `ids` (`u32::MAX`: not in the subset).
    index: Vec<u32>,
}

impl SubVocab {
    /// `ids` (distinct, each below `vocab_size`).
    pub fn new(ids: Vec<u32>, vocab_size: usize) -> Self {
        let mut index = vec![u32::MAX; vocab_size];
        for (i, &id) in ids.iter().enumerate() {
            index[id as usize] = i as u32;
        }
        Self { ids, index }
    }

    /// Position of full-vocabulary id `id` in the subset.
    pub fn position(&self, id: u32) -> Option<usize> {
        match self.index.get(id as usize) {
            Some(&i) if i != u32::MAX => Some(i as usize),
            _ => None,
        }
    }
}

impl Dist {
    pub fn prob(&self, id: u32) -> f32 {
        match self {
            Dist::Greedy(t) => (*t == id) as u32 as f32,
            Dist::Probs(p) => p[id as usize],
            Dist::Sparse { vocab, probs } => vocab.position(id).map_or(0.0, |i| probs[i]),
        }
    }

    pub fn sample(&self, rng: &mut ChaCha8Rng) -> u32 {
        match self {
            Dist::Greedy(t) => *t,
            Dist::Probs(p) => sample_dense(p, rng),
            Dist::Sparse { vocab, probs } => vocab.ids[sample_dense(probs, rng) as usize],
        }
    }

    /// The probabilities over the whole vocabulary of `vocab_size` ids (`None` for greedy).
    pub fn dense(&self, vocab_size: usize) -> Option<std::borrow::Cow<'_, [f32]>> {
        match self {
            Dist::Greedy(_) => None,
            Dist::Probs(p) => Some(std::borrow::Cow::Borrowed(p)),
            Dist::Sparse { vocab, probs } => {
                let mut full = vec![0f32; vocab_size];
                for (&id, &p) in vocab.ids.iter().zip(probs) {
                    full[id as usize] = p;
                }
                Some(std::borrow::Cow::Owned(full))
            }
        }
    }
}

/// Weights per block of [`sample_dense`]'s two-level walk.
const SAMPLE_BLOCK: usize = 256;

/// Draws index `i` with probability `p[i] / sum(p)` (weights need not be normalised; the
/// last positive one if rounding leaves the draw past the end).
///
/// Two levels, so that a 49,152-wide row costs block sums that vectorise and one walk of
/// 256 weights instead of a sequential sum and walk over all of them (~0.1 ms a sampled
/// token): the block whose running total passes `u`, then the index inside it.
pub fn sample_dense(p: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let sums: Vec<f32> = p.chunks(SAMPLE_BLOCK).map(lane_sum).collect();
    let total: f32 = sums.iter().sum();
    let mut u = rng.random::<f32>() * total;
    for (bi, &s) in sums.iter().enumerate() {
        if s <= 0.0 {
            continue;
        }
        if u >= s {
            u -= s;
            continue;
        }
        let base = bi * SAMPLE_BLOCK;
        let mut last_in = None;
        for (i, &x) in p[base..(base + SAMPLE_BLOCK).min(p.len())]
            .iter()
            .enumerate()
        {
            if x > 0.0 {
                last_in = Some(i);
                if u < x {
                    return (base + i) as u32;
                }
                u -= x;
            }
        }
        // Rounding left u at or past this block's last weight: it is the draw.
        if let Some(i) = last_in {
            return (base + i) as u32;
        }
    }
    // Rounding carried u past every block: the last positive weight.
    p.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

/// The distribution of one (already biased and penalised) logits row under temperature,
/// min-p, top-k and top-p.
pub fn target_probs(logits: &[f32], sp: &SamplingParams) -> Dist {
    if sp.greedy() {
        return Dist::Greedy(crate::model::argmax(logits));
    }
    let inv_t = 1.0 / sp.temperature;
    let max = crate::model::max_value(logits);
    // The vectorised exp (the softmax's polynomial): libm's scalar one took 0.16 ms per
    // 49,152-logit row and ~0.03 ms per 8,192-wide draft token, a fifth of a 7-token drafter
    // block at temperature 1. Its inputs are clamped at -88.4, so masked logits (-inf: a
    // grammar, a bias, top-k of the draft vocabulary) are set to exactly 0 after it.
    let mut p: Vec<f32> = logits.iter().map(|&l| (l - max) * inv_t).collect();
    crate::kernels::vmath::exp_in_place(&mut p);
    for (x, &l) in p.iter_mut().zip(logits) {
        if l == f32::NEG_INFINITY {
            *x = 0.0;
        }
    }
    if sp.min_p > 0.0 {
        // The most likely token has weight exp(0) = 1.
        for x in p.iter_mut() {
            if *x < sp.min_p {
                *x = 0.0;
            }
        }
    }
    let k = if sp.top_k > 0 && sp.top_k < p.len() {
        sp.top_k
    } else {
        p.len()
    };
    if k < p.len() || sp.top_p < 1.0 {
        // Candidates in descending probability; only the kept set needs sorting.
        let mut idx: Vec<u32> = (0..p.len() as u32).collect();
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| p[b as usize].total_cmp(&p[a as usize]));
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
        let total: f32 = idx.iter().map(|&i| p[i as usize]).sum();
        let mut keep = idx.len();
        if sp.top_p < 1.0 {
            let mut acc = 0.0;
            for (n, &i) in idx.iter().enumerate() {
                acc += p[i as usize] / total;
                if acc >= sp.top_p {
                    keep = n + 1;
                    break;
                }
            }
        }
        let mut q = vec![0f32; p.len()];
        for &i in &idx[..keep] {
            q[i as usize] = p[i as usize];
        }
        p = q;
    }
    let s = lane_sum(&p);
    for x in p.iter_mut() {
        *x /= s;
    }
    Dist::Probs(p)
}

/// Log-probability of `id` and the `top` most likely tokens under the raw model distribution.
pub fn logprobs(logits: &[f32], id: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let chosen = logits[id as usize] - lse;
    let mut tops = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(k);
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        tops = idx
            .into_iter()
            .map(|i| (i, logits[i as usize] - lse))
            .collect();
    }
    (chosen, tops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn top_k_and_top_p_keep_the_right_mass() {
        let logits = vec![3.0, 2.0, 1.0, 0.0, -1.0];
        let probs = |sp: SamplingParams| {
            let Dist::Probs(p) = target_probs(&logits, &sp) else {
                panic!()
            };
            p
        };
        let p = probs(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        });
        assert!(p[2] == 0.0 && p[3] == 0.0 && p[4] == 0.0);
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6);
        assert!((p[0] / p[1] - std::f32::consts::E).abs() < 1e-4);
        let p = probs(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        });
        assert_eq!(p[0], 1.0, "the top token alone holds > 50% of the mass");
        let sp = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert!(matches!(target_probs(&logits, &sp), Dist::Greedy(0)));
    }

    /// The vectorised exp: masked logits get exactly 0, the rest is the softmax at the
    /// temperature to f32 precision, over a row as long as a real vocabulary.
    #[test]
    fn temperature_probabilities_are_the_softmax_and_masks_stay_zero() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut logits: Vec<f32> = (0..49_157)
            .map(|_| rand::Rng::random_range(&mut rng, -30.0f32..12.0))
            .collect();
        for i in (5..logits.len()).step_by(97) {
            logits[i] = f32::NEG_INFINITY;
        }
        for t in [0.3f32, 1.0, 1.7] {
            let sp = SamplingParams {
                temperature: t,
                ..Default::default()
            };
            let Dist::Probs(p) = target_probs(&logits, &sp) else {
                panic!()
            };
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = logits
                .iter()
                .map(|&l| (((l - max) / t) as f64).exp())
                .collect();
            let z: f64 = e.iter().sum();
            for (i, (&q, &r)) in p.iter().zip(&e).enumerate() {
                if logits[i] == f32::NEG_INFINITY {
                    assert_eq!(q, 0.0, "masked token {i} at T = {t}");
                } else {
                    let r = r / z;
                    assert!(
                        (q as f64 - r).abs() <= 3e-5 * r + 1e-12,
                        "token {i} at T = {t}: {q} vs {r}"
                    );
                }
            }
        }
    }

    /// The two-level walk over a vocabulary-sized row: a lone weight anywhere (also in
    /// the partial last block) is always drawn, an all-zero row gives 0, and draws over
    /// weights spread across blocks (with empty blocks between) follow them.
    #[test]
    fn dense_sampling_over_many_blocks_follows_the_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = 49_157;
        for &at in &[0usize, 255, 256, 30_000, n - 1] {
            let mut p = vec![0f32; n];
            p[at] = 0.3;
            for _ in 0..20 {
                assert_eq!(sample_dense(&p, &mut rng), at as u32);
            }
        }
        assert_eq!(sample_dense(&vec![0f32; n], &mut rng), 0);
        // Five tokens in far-apart blocks carry the mass, the rest a thin uniform tail.
        let heavy = [
            (7usize, 0.3f32),
            (700, 0.2),
            (20_000, 0.25),
            (20_001, 0.05),
            (n - 2, 0.1),
        ];
        let mut p = vec![0f32; n];
        let tail = 0.1 / (n - heavy.len()) as f32;
        for (i, x) in p.iter_mut().enumerate() {
            if i % 1000 != 500 {
                *x = tail;
            }
        }
        for &(i, w) in &heavy {
            p[i] = w;
        }
        let draws = 40_000;
        let mut hits = std::collections::HashMap::new();
        for _ in 0..draws {
            *hits.entry(sample_dense(&p, &mut rng)).or_insert(0usize) += 1;
        }
        let total: f32 = p.iter().sum();
        for &(i, w) in &heavy {
            let want = (w / total) as f64;
            let got = hits.get(&(i as u32)).copied().unwrap_or(0) as f64 / draws as f64;
            let sd = (want * (1.0 - want) / draws as f64).sqrt();
            assert!((got - want).abs() < 5.0 * sd, "token {i}: {got} vs {want}");
        }
        assert!(
            hits.keys().all(|&i| p[i as usize] > 0.0),
            "drew a zero weight"
        );
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let p = vec![0.1, 0.6, 0.3];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[sample_dense(&p, &mut rng) as usize] += 1;
        }
        for i in 0..3 {
            let f = counts[i] as f32 / 30_000.0;
            assert!((f - p[i]).abs() < 0.015, "token {i}: {f} vs {}", p[i]);
        }
        let mut a = ChaCha8Rng::seed_from_u64(1);
        let mut b = ChaCha8Rng::seed_from_u64(1);
        let d = Dist::Probs(p);
        let xa: Vec<u32> = (0..20).map(|_| d.sample(&mut a)).collect();
        let xb: Vec<u32> = (0..20).map(|_| d.sample(&mut b)).collect();
        assert_eq!(xa, xb);
    }

    #[test]
    fn logprobs_are_normalised() {
        let logits = vec![1.0, 2.0, 3.0];
        let (lp, tops) = logprobs(&logits, 2, 2);
        let z: f32 = logits.iter().map(|l: &f32| l.exp()).sum();
        assert!((lp - (3.0f32.exp() / z).ln()).abs() < 1e-5);
        assert_eq!(tops[0].0, 2);
        assert_eq!(tops[1].0, 1);
    }

    #[test]
    fn bias_and_penalties_edit_the_logits_as_openai_and_vllm_define_them() {
        let logits = vec![2.0, 1.0, -1.0, 0.5];
        let sp = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(3, 10.0)],
            ..Default::default()
        };
        let mut h = History::new(&[2], &sp);
        h.push(0);
        h.push(0);
        h.push(1);
        let l = processed_logits(&logits, &sp, &h);
        // Token 0 twice: 2 - 0.5 - 2 * 0.25; token 1 once; token 2 only in the prompt (no
        // effect on presence / frequency); token 3 biased.
        assert_eq!(&l[..], &[1.0, 0.25, -1.0, 10.5]);
        let sp = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut h = History::new(&[2], &sp);
        h.push(0);
        let l = processed_logits(&logits, &sp, &h);
        // Positive logits are divided, negative ones multiplied; the prompt counts.
        assert_eq!(&l[..], &[1.0, 1.0, -2.0, 0.5]);
        // Nothing set: the row is borrowed untouched.
        let sp = SamplingParams::default();
        assert!(matches!(
            processed_logits(&logits, &sp, &History::new(&[1], &sp)),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn greedy_follows_the_processed_logits_and_min_p_cuts_the_tail() {
        let logits = vec![3.0, 2.9, 0.0];
        let greedy = SamplingParams {
            temperature: 0.0,
            frequency_penalty: 1.0,
            ..Default::default()
        };
        let mut h = History::default();
        assert!(matches!(target_dist(&logits, &greedy, &h), Dist::Greedy(0)));
        h.push(0);
        assert!(matches!(target_dist(&logits, &greedy, &h), Dist::Greedy(1)));
        let banned = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(0, -100.0), (1, -100.0)],
            ..Default::default()
        };
        assert!(matches!(
            target_dist(&logits, &banned, &History::default()),
            Dist::Greedy(2)
        ));
        // exp(-3) = 0.05 of the top token's weight: below min_p 0.1, kept at 0.01.
        for (min_p, kept) in [(0.1, false), (0.01, true)] {
            let sp = SamplingParams {
                min_p,
                ..Default::default()
            };
            let Dist::Probs(p) = target_dist(&logits, &sp, &History::default()) else {
                panic!()
            };
            assert_eq!(p[2] > 0.0, kept, "min_p {min_p}");
            assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn a_block_position_is_judged_after_the_drafts_before_it() {
        let rows = vec![vec![1.0, 0.0], vec![1.0, 0.0], vec![1.0, 0.0]];
        let sp = SamplingParams {
            temperature: 0.0,
            presence_penalty: 2.0,
            ..Default::default()
        };
        // Draft [0, 1]: row 0 sees nothing, row 1 sees token 0 (penalised: argmax 1), row 2
        // sees both (both penalised: argmax 0 again).
        let d = block_dists(&rows, &sp, &History::default(), &[0, 1]);
        let argmax: Vec<u32> = d
            .iter()
            .map(|d| d.sample(&mut ChaCha8Rng::seed_from_u64(0)))
            .collect();
        assert_eq!(argmax, vec![0, 1, 0]);
    }
}
