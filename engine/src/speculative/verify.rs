//! Lossless verification of a draft block by rejection sampling.
//!
//! Left to right, draft token `y_j ~ q_j` is accepted with probability
//! `min(1, p_j(y_j) / q_j(y_j))`; at the first rejection a replacement is drawn from
//! `norm(max(0, p_j - q_j))` and the rest of the block is dropped; if every token passes, a
//! bonus token is drawn from `p_{k+1}`. `p_j` is the target's processed distribution
//! (temperature, top-k, top-p), so the committed tokens follow exactly the law of plain
//! sampling. With greedy `p` this reduces to: accept while `y_j == argmax p_j`, then emit
//! `argmax p_j`.

use crate::sampling::{sample_dense, Dist};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Result of verifying one block.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Draft tokens accepted (a prefix of the block).
    pub accepted: usize,
    /// Tokens to commit: the accepted drafts followed by the replacement or bonus token.
    pub tokens: Vec<u32>,
}

/// Verifies `draft` (with its draft distributions `q`) against the target distributions
/// `p` (`p.len() == draft.len() + 1`; `p[j]` is the target at the position of draft `j`).
pub fn verify(draft: &[u32], q: &[Dist], p: &[Dist], rng: &mut ChaCha8Rng) -> Verdict {
    debug_assert_eq!(p.len(), draft.len() + 1);
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (j, &y) in draft.iter().enumerate() {
        let pj = &p[j];
        let accept = match (pj, &q[j]) {
            (Dist::Greedy(t), _) => *t == y,
            (pj, qj) => {
                let py = pj.prob(y);
                let qy = qj.prob(y);
                qy > 0.0 && (py >= qy || rng.random::<f32>() * qy < py)
            }
        };
        if accept {
            tokens.push(y);
            continue;
        }
        let replacement = match (pj, &q[j]) {
            (Dist::Greedy(t), _) => *t,
            (Dist::Probs(pp), qj) => {
                // max(0, p - q): p itself wherever q is 0 (off a draft vocabulary), so only
                // q's support is visited (8,192 ids instead of 49,152 lookups).
                let mut residual = pp.clone();
                match qj {
                    Dist::Greedy(t) => {
                        let r = &mut residual[*t as usize];
                        *r = (*r - 1.0).max(0.0);
                    }
                    Dist::Probs(qq) => {
                        for (r, &q) in residual.iter_mut().zip(qq) {
                            *r = (*r - q).max(0.0);
                        }
                    }
                    Dist::Sparse { vocab, probs } => {
                        for (&id, &q) in vocab.ids.iter().zip(probs) {
                            let r = &mut residual[id as usize];
                            *r = (*r - q).max(0.0);
                        }
                    }
                }
                if residual.iter().sum::<f32>() > 0.0 {
                    sample_dense(&residual, rng)
                } else {
                    sample_dense(pp, rng)
                }
            }
            // A target on a subset of the vocabulary (not produced by the engine today, but
            // a valid law): the residual lives on the same subset.
            (Dist::Sparse { vocab, probs }, qj) => {
                let residual: Vec<f32> = probs
                    .iter()
                    .zip(&vocab.ids)
                    .map(|(&x, &id)| (x - qj.prob(id)).max(0.0))
                    .collect();
                if residual.iter().sum::<f32>() > 0.0 {
                    vocab.ids[sample_dense(&residual, rng) as usize]
                } else {
                    pj.sample(rng)
                }
            }
        };
        tokens.push(replacement);
        return Verdict {
            accepted: j,
            tokens,
        };
    }
    let bonus = p[draft.len()].sample(rng);
    tokens.push(bonus);
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use std::collections::HashMap;

    /// A tiny "language model" over V tokens: the next-token law depends on the previous
    /// token (a fixed random bigram table), sharpened or flattened by a temperature.
    struct Bigram {
        table: Vec<Vec<f32>>,
    }

    impl Bigram {
        fn new(v: usize, seed: u64, sharp: f32) -> Self {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let table = (0..v)
                .map(|_| {
                    let l: Vec<f32> = (0..v).map(|_| rng.random::<f32>() * sharp).collect();
                    let m = l.iter().cloned().fold(f32::MIN, f32::max);
                    let e: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
                    let s: f32 = e.iter().sum();
                    e.into_iter().map(|x| x / s).collect()
                })
                .collect();
            Self { table }
        }
        fn dist(&self, prev: u32) -> Dist {
            Dist::Probs(self.table[prev as usize].clone())
        }
    }

    /// Generates `len` tokens after token 0 speculatively: the drafter proposes blocks of
    /// `gamma` from its own law, the target verifies.
    fn speculative(
        target: &Bigram,
        draft: &dyn Fn(u32) -> Dist,
        gamma: usize,
        len: usize,
        rng: &mut ChaCha8Rng,
    ) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::new();
        let mut last = 0u32;
        while out.len() < len {
            let mut ys = Vec::new();
            let mut qs = Vec::new();
            let mut prev = last;
            for _ in 0..gamma {
                let q = draft(prev);
                let y = q.sample(rng);
                ys.push(y);
                qs.push(q);
                prev = y;
            }
            let mut ps = vec![target.dist(last)];
            for &y in &ys {
                ps.push(target.dist(y));
            }
            let v = verify(&ys, &qs, &ps, rng);
            for t in v.tokens {
                if out.len() < len {
                    out.push(t);
                    last = t;
                }
            }
        }
        out
    }

    /// Chi-square statistic of observed sequence counts against the exact joint law.
    fn chi_square(
        target: &Bigram,
        counts: &HashMap<Vec<u32>, usize>,
        n: usize,
        len: usize,
    ) -> (f64, usize) {
        let law = |seq: &[u32]| {
            let mut p = 1.0f64;
            let mut prev = 0u32;
            for &t in seq {
                p *= target.table[prev as usize][t as usize] as f64;
                prev = t;
            }
            p
        };
        chi_square_law(&law, target.table.len(), counts, n, len)
    }

    /// Chi-square statistic of observed counts of `len`-token sequences over `v` tokens
    /// against `law` (infinite when a sequence of probability 0 was drawn).
    fn chi_square_law(
        law: &dyn Fn(&[u32]) -> f64,
        v: usize,
        counts: &HashMap<Vec<u32>, usize>,
        n: usize,
        len: usize,
    ) -> (f64, usize) {
        let mut chi = 0.0;
        let mut cells = 0;
        let total = v.pow(len as u32);
        for idx in 0..total {
            let mut seq = Vec::with_capacity(len);
            let mut x = idx;
            for _ in 0..len {
                seq.push((x % v) as u32);
                x /= v;
            }
            let expected = law(&seq) * n as f64;
            let observed = *counts.get(&seq).unwrap_or(&0) as f64;
            if expected == 0.0 {
                if observed > 0.0 {
                    // A sequence the law never produces: no statistic can pass.
                    return (f64::INFINITY, cells);
                }
                continue;
            }
            chi += (observed - expected).powi(2) / expected;
            cells += 1;
        }
        (chi, cells - 1)
    }

    fn check_lossless(name: &str, draft: &dyn Fn(u32) -> Dist, gamma: usize) {
        let target = Bigram::new(6, 11, 3.0);
        let len = 3;
        let n = 120_000;
        let mut rng = ChaCha8Rng::seed_from_u64(2024);
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for _ in 0..n {
            *counts
                .entry(speculative(&target, draft, gamma, len, &mut rng))
                .or_default() += 1;
        }
        let (chi, dof) = chi_square(&target, &counts, n, len);
        // Chi-square with 215 degrees of freedom: mean 215, sd ~20.7. The bound 215 + 5 sd
        // has a false-alarm rate below 1e-5 (normal approximation, slightly conservative).
        let bound = dof as f64 + 5.0 * (2.0 * dof as f64).sqrt();
        println!("{name}: chi2 = {chi:.1} over {dof} dof (bound {bound:.1})");
        assert!(
            chi < bound,
            "{name}: speculative samples do not follow the target law (chi2 {chi:.1} > {bound:.1})"
        );
    }

    #[test]
    fn sampling_is_lossless_with_a_good_drafter() {
        let close = Bigram::new(6, 11, 2.5); // same table shape, softer
        check_lossless("good drafter", &|prev| close.dist(prev), 3);
    }

    #[test]
    fn sampling_is_lossless_with_a_bad_drafter() {
        let bad = Bigram::new(6, 999, 6.0); // unrelated and overconfident
        check_lossless("bad drafter", &|prev| bad.dist(prev), 4);
    }

    /// A drafter with a reduced vocabulary (ids 1, 3, 4 only), its law given sparsely as
    /// the DSpark drafter's `draft_vocab` gives it: tokens outside it can only come from the
    /// residual, and the output still follows the target.
    #[test]
    fn sampling_is_lossless_with_a_reduced_vocabulary_drafter() {
        let close = Bigram::new(6, 11, 2.5);
        let vocab = std::sync::Arc::new(crate::sampling::SubVocab::new(vec![1, 3, 4], 6));
        check_lossless(
            "reduced-vocabulary drafter",
            &|prev| {
                let full = &close.table[prev as usize];
                let mass: f32 = vocab.ids.iter().map(|&i| full[i as usize]).sum();
                Dist::Sparse {
                    vocab: vocab.clone(),
                    probs: vocab.ids.iter().map(|&i| full[i as usize] / mass).collect(),
                }
            },
            3,
        );
    }

    #[test]
    fn sampling_is_lossless_with_a_deterministic_drafter() {
        // n-gram style: a point mass (always proposes prev + 1).
        check_lossless(
            "point-mass drafter",
            &|prev| Dist::Greedy((prev + 1) % 6),
            2,
        );
    }

    #[test]
    fn the_test_detects_a_lossy_rule() {
        // Accepting every draft token is lossy: the same statistic must fail.
        let target = Bigram::new(6, 11, 3.0);
        let bad = Bigram::new(6, 999, 6.0);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let n = 50_000;
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for _ in 0..n {
            let mut seq = Vec::new();
            let mut prev = 0;
            for _ in 0..3 {
                let t = bad.dist(prev).sample(&mut rng);
                seq.push(t);
                prev = t;
            }
            *counts.entry(seq).or_default() += 1;
        }
        let (chi, dof) = chi_square(&target, &counts, n, 3);
        assert!(chi > dof as f64 + 5.0 * (2.0 * dof as f64).sqrt());
    }

    /// Sampling settings whose law depends on every earlier token; `truncate` adds min-p
    /// and top-p.
    fn penalised(truncate: bool) -> crate::sampling::SamplingParams {
        let (min_p, top_p) = if truncate { (0.004, 0.97) } else { (0.0, 1.0) };
        crate::sampling::SamplingParams {
            temperature: 0.9,
            presence_penalty: 0.8,
            frequency_penalty: 0.5,
            repetition_penalty: 1.4,
            logit_bias: vec![(2, 1.5), (5, -0.7)],
            min_p,
            top_p,
            ..Default::default()
        }
    }

    fn logits(target: &Bigram, prev: u32) -> Vec<f32> {
        target.table[prev as usize].iter().map(|p| p.ln()).collect()
    }

    /// The exact law of `seq` after prompt `[0]` with penalised sampling.
    fn penalised_law(target: &Bigram, sp: &crate::sampling::SamplingParams, seq: &[u32]) -> f64 {
        let mut h = crate::sampling::History::new(&[0], sp);
        let (mut p, mut prev) = (1.0f64, 0u32);
        for &t in seq {
            p *= crate::sampling::target_dist(&logits(target, prev), sp, &h).prob(t) as f64;
            h.push(t);
            prev = t;
        }
        p
    }

    /// [`speculative`] with penalties, each block judged by the engine's own
    /// [`crate::speculative::acceptance::judge`]; with `stale`, every position is judged by
    /// the history before the block instead (the bug engines have shipped).
    fn speculative_penalised(
        target: &Bigram,
        draft: &Bigram,
        gamma: usize,
        len: usize,
        sp: &crate::sampling::SamplingParams,
        stale: bool,
        rng: &mut ChaCha8Rng,
    ) -> Vec<u32> {
        let mut h = crate::sampling::History::new(&[0], sp);
        let mut out: Vec<u32> = Vec::new();
        let mut last = 0u32;
        while out.len() < len {
            let (ys, qs, rows) = draft_and_score(target, draft, last, gamma, rng);
            let tokens = if stale {
                let ps: Vec<Dist> = rows
                    .iter()
                    .map(|r| crate::sampling::target_dist(r, sp, &h))
                    .collect();
                verify(&ys, &qs, &ps, rng).tokens
            } else {
                let p = block(ys, qs);
                judge_block(sp, &h, rng, None, &p, &rows)
            };
            for t in tokens {
                if out.len() < len {
                    out.push(t);
                    h.push(t);
                    last = t;
                }
            }
        }
        out
    }

    /// A draft block as the engine carries it.
    /// `gamma` draft tokens after `last` sampled from `draft`, their laws, and the target's
    /// logits rows of the block (after `last`, then after each draft token).
    fn draft_and_score(
        target: &Bigram,
        draft: &Bigram,
        last: u32,
        gamma: usize,
        rng: &mut ChaCha8Rng,
    ) -> (Vec<u32>, Vec<Dist>, Vec<Vec<f32>>) {
        let (mut ys, mut qs, mut prev) = (Vec::new(), Vec::new(), last);
        for _ in 0..gamma {
            let q = draft.dist(prev);
            let y = q.sample(rng);
            ys.push(y);
            qs.push(q);
            prev = y;
        }
        let mut rows = vec![logits(target, last)];
        rows.extend(ys.iter().map(|&y| logits(target, y)));
        (ys, qs, rows)
    }

    fn block(tokens: Vec<u32>, q: Vec<Dist>) -> crate::speculative::Proposal {
        crate::speculative::Proposal {
            confidence: vec![1.0; tokens.len()],
            tokens,
            q,
        }
    }

    /// The engine's `judge` on one block (the grammar work computed inside it, as for a
    /// sequence whose masks were not computed beside the forward).
    fn judge_block(
        sp: &crate::sampling::SamplingParams,
        h: &crate::sampling::History,
        rng: &mut ChaCha8Rng,
        grammar: Option<&mut Toy>,
        p: &crate::speculative::Proposal,
        rows: &[Vec<f32>],
    ) -> Vec<u32> {
        use crate::speculative::acceptance::{judge, Judging};
        let s = Judging {
            params: sp,
            history: h,
            rng,
            grammar,
        };
        judge(s, Some(p), rows, None).expect("judge").0
    }

    fn penalised_chi(truncate: bool, stale: bool, n: usize) -> (f64, f64) {
        let target = Bigram::new(6, 11, 3.0);
        let draft = Bigram::new(6, 11, 2.5);
        let sp = penalised(truncate);
        let mut rng = ChaCha8Rng::seed_from_u64(77);
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for _ in 0..n {
            let seq = speculative_penalised(&target, &draft, 3, 3, &sp, stale, &mut rng);
            *counts.entry(seq).or_default() += 1;
        }
        let law = |seq: &[u32]| penalised_law(&target, &sp, seq);
        let (chi, dof) = chi_square_law(&law, 6, &counts, n, 3);
        (chi, dof as f64 + 5.0 * (2.0 * dof as f64).sqrt())
    }

    /// Presence, frequency and repetition penalties, logit bias, min-p and top-p together:
    /// speculative sampling follows the penalised target law when each block position is
    /// judged after the drafts before it.
    #[test]
    fn sampling_with_penalties_and_bias_is_lossless() {
        for truncate in [false, true] {
            let (chi, bound) = penalised_chi(truncate, false, 120_000);
            println!("penalised (truncate {truncate}): chi2 = {chi:.1} (bound {bound:.1})");
            assert!(
                chi < bound,
                "truncate {truncate}: chi2 {chi:.1} > {bound:.1}"
            );
        }
    }

    /// The same statistic catches the stale-history rule.
    #[test]
    fn the_test_detects_penalties_that_ignore_the_block() {
        let (chi, bound) = penalised_chi(false, true, 60_000);
        println!("stale penalties: chi2 = {chi:.1} (bound {bound:.1})");
        assert!(chi > bound, "chi2 {chi:.1} <= {bound:.1}");
    }

    /// A toy grammar over 6 tokens: never repeat the previous token, and token 5 only
    /// right after token 0 (the start counts as 0).
    fn grammar_mask(prev: u32) -> crate::constraint::Mask {
        let mut m = crate::constraint::Mask::alloc_ones(6);
        m.disallow_token(prev);
        if prev != 0 {
            m.disallow_token(5);
        }
        m
    }

    use crate::speculative::acceptance::Grammar;

    /// The toy grammar's state, driven by the engine's `judge` as it drives llguidance: the
    /// tokens consumed so far.
    #[derive(Default)]
    struct Toy(Vec<u32>);

    impl Grammar for Toy {
        fn mask(&mut self) -> anyhow::Result<crate::constraint::Mask> {
            Ok(grammar_mask(self.0.last().copied().unwrap_or(0)))
        }
        fn rollback(&mut self, n: usize) -> anyhow::Result<()> {
            anyhow::ensure!(n <= self.0.len(), "rollback past the start");
            self.0.truncate(self.0.len() - n);
            Ok(())
        }
        fn consume(&mut self, tok: u32) -> anyhow::Result<()> {
            let m = self.mask()?;
            anyhow::ensure!(m.is_allowed(tok), "token {tok} breaks the grammar");
            self.0.push(tok);
            Ok(())
        }
        fn is_stopped(&self) -> bool {
            false
        }
    }

    /// Constrained speculative sampling through the engine's `judge`: the draft (from an
    /// unconstrained drafter) is judged against the masked, penalised target law of each
    /// position after the drafts before it, up to and including its first token the grammar
    /// forbids (which is rejected for certain).
    fn speculative_constrained(
        target: &Bigram,
        draft: &Bigram,
        len: usize,
        sp: &crate::sampling::SamplingParams,
        rng: &mut ChaCha8Rng,
    ) -> Vec<u32> {
        let mut h = crate::sampling::History::new(&[0], sp);
        let mut g = Toy::default();
        let (mut out, mut last) = (Vec::new(), 0u32);
        while out.len() < len {
            let (ys, qs, rows) = draft_and_score(target, draft, last, 3, rng);
            let p = block(ys, qs);
            for t in judge_block(sp, &h, rng, Some(&mut g), &p, &rows) {
                if out.len() < len {
                    out.push(t);
                    h.push(t);
                    last = t;
                }
            }
        }
        out
    }

    /// Structured outputs stay lossless: the sequences follow the constrained (and
    /// penalised) target law exactly, and none breaks the grammar. (Cutting the block before
    /// its forbidden token and sampling the target's law there fails this test: chi2 3556
    /// over 88 dof.)
    #[test]
    fn constrained_sampling_is_lossless() {
        let target = Bigram::new(6, 11, 3.0);
        let draft = Bigram::new(6, 11, 2.5);
        let sp = penalised(false);
        let law = |seq: &[u32]| {
            let mut h = crate::sampling::History::new(&[0], &sp);
            let (mut p, mut prev) = (1.0f64, 0u32);
            for &t in seq {
                let m = grammar_mask(prev);
                let d =
                    crate::sampling::target_dist_masked(&logits(&target, prev), &sp, &h, Some(&m));
                p *= d.prob(t) as f64;
                h.push(t);
                prev = t;
            }
            p
        };
        let n = 100_000;
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for _ in 0..n {
            let seq = speculative_constrained(&target, &draft, 3, &sp, &mut rng);
            *counts.entry(seq).or_default() += 1;
        }
        let (chi, dof) = chi_square_law(&law, 6, &counts, n, 3);
        let bound = dof as f64 + 5.0 * (2.0 * dof as f64).sqrt();
        println!("constrained: chi2 = {chi:.1} over {dof} dof (bound {bound:.1})");
        assert!(chi < bound, "chi2 {chi:.1} > {bound:.1}");
    }

    #[test]
    fn greedy_accepts_the_matching_prefix_then_corrects() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let p = vec![
            Dist::Greedy(5),
            Dist::Greedy(6),
            Dist::Greedy(9),
            Dist::Greedy(1),
        ];
        let q = vec![Dist::Greedy(5), Dist::Greedy(6), Dist::Greedy(7)];
        let v = verify(&[5, 6, 7], &q, &p, &mut rng);
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                tokens: vec![5, 6, 9]
            }
        );
        let v = verify(&[5, 6, 9], &q, &p, &mut rng);
        assert_eq!(
            v,
            Verdict {
                accepted: 3,
                tokens: vec![5, 6, 9, 1]
            }
        );
    }
}
