//! Turning logits into tokens: temperature, top-k, top-p, seeded sampling and logprobs.
//!
//! [`target_probs`] is the target's *processed* distribution; speculative verification
//! compares draft tokens against exactly this distribution, so sampling with or without a
//! drafter draws from the same law.

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy(&self) -> bool {
        self.temperature <= 1e-5 || self.top_k == 1
    }
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

pub fn sample_dense(p: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let total: f32 = p.iter().sum();
    let mut u = rng.random::<f32>() * total;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            last = i;
            if u < x {
                return i as u32;
            }
            u -= x;
        }
    }
    last as u32
}

/// The target's processed distribution for one logits row.
pub fn target_probs(logits: &[f32], sp: &SamplingParams) -> Dist {
    if sp.greedy() {
        return Dist::Greedy(crate::model::argmax(logits));
    }
    let inv_t = 1.0 / sp.temperature;
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&l| ((l - max) * inv_t).exp()).collect();
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
    let s: f32 = p.iter().sum();
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
        let sp = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let Dist::Probs(p) = target_probs(&logits, &sp) else {
            panic!()
        };
        assert!(p[2] == 0.0 && p[3] == 0.0 && p[4] == 0.0);
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6);
        assert!((p[0] / p[1] - std::f32::consts::E).abs() < 1e-4);
        let sp = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let Dist::Probs(p) = target_probs(&logits, &sp) else {
            panic!()
        };
        assert_eq!(p[0], 1.0, "the top token alone holds > 50% of the mass");
        let sp = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert!(matches!(target_probs(&logits, &sp), Dist::Greedy(0)));
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
}
