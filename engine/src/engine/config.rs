//! The engine's knobs (`serve` flags map onto these).

use crate::experiment::Arm;
use crate::speculative::{Speculation, VerifyPolicy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most tokens (B) in one target forward.
    pub max_batch_tokens: usize,
    /// Largest prefill chunk of one prompt per step.
    pub prefill_chunk: usize,
    pub max_running: usize,
    /// Admission queue bound; past it requests are refused (HTTP 429).
    pub max_waiting: usize,
    /// Drafter used for speculative decoding (`None` = plain decoding).
    pub speculation: Speculation,
    /// How many draft tokens each request verifies.
    pub policy: VerifyPolicy,
    /// Step of the online recalibration of a model drafter's confidences (0: off): see
    /// [`crate::speculative::recalibrate`].
    pub online_calibration: f32,
    /// The online policy experiment: arms alternated every window
    /// ([`crate::experiment`]); `policy` is unused then.
    pub experiment: Option<(Vec<Arm>, Duration)>,
    /// Automatic prefix caching of full prompt blocks (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
    /// Prompt lookup beside a model drafter ([`crate::speculative::lookup`]).
    pub prompt_lookup: bool,
    /// Test-only fault injection (no flag sets it): see [`Faults`].
    #[doc(hidden)]
    pub faults: Faults,
}

/// Test-only fault injection: a test keeps a clone and trips a fault in the running engine
/// to check what the server does then (no `serve` flag or variable reaches it): the step
/// panics ([`Faults::panic_next_step`]), the loop stalls ([`Faults::stall_steps`]), or one
/// sequence fails at one site of its step ([`Faults::fail_sequence`]).
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct Faults {
    panic_next_step: Arc<AtomicBool>,
    stall: Arc<AtomicBool>,
    /// Any sequence fault armed (the step checks nothing else otherwise).
    armed: Arc<AtomicBool>,
    sequences: Arc<Mutex<Vec<SequenceFault>>>,
}

/// Where in its step a sequence fails ([`Faults::fail_sequence`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultSite {
    /// Its drafter context (the speculator's commit of its hidden states).
    Drafter,
    /// Its grammar (the masks of a structured output).
    Grammar,
    /// Its sampling or verification (`judge`).
    Sampling,
}

#[derive(Debug, Clone, Copy)]
struct SequenceFault {
    site: FaultSite,
    request: u64,
    after_tokens: usize,
}

impl Faults {
    /// The engine thread panics in its next step that has work.
    pub fn panic_next_step(&self) {
        self.panic_next_step.store(true, Ordering::SeqCst);
    }

    pub(super) fn take_panic(&self) -> bool {
        self.panic_next_step.swap(false, Ordering::SeqCst)
    }

    /// While `on`, every step that has work hangs (the engine makes no progress).
    pub fn stall_steps(&self, on: bool) {
        self.stall.store(on, Ordering::SeqCst);
    }

    pub(super) fn stalled(&self) -> bool {
        self.stall.load(Ordering::SeqCst)
    }

    /// The `request`-th request the engine takes in (1-based, in submission order) fails at
    /// `site` in its first step with logits after it has generated `after_tokens` tokens.
    pub fn fail_sequence(&self, site: FaultSite, request: u64, after_tokens: usize) {
        self.sequences
            .lock()
            .expect("faults lock")
            .push(SequenceFault {
                site,
                request,
                after_tokens,
            });
        self.armed.store(true, Ordering::SeqCst);
    }

    /// The injected failure of sequence `id` at `site` now that it has `generated` tokens
    /// (each fault fires once).
    pub(super) fn check(&self, site: FaultSite, id: u64, generated: usize) -> anyhow::Result<()> {
        if !self.armed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut f = self.sequences.lock().expect("faults lock");
        let hit = f
            .iter()
            .position(|x| x.site == site && x.request == id && generated >= x.after_tokens);
        match hit {
            Some(i) => {
                f.remove(i);
                anyhow::bail!("injected fault (test only): {site:?} failed")
            }
            None => Ok(()),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            prefill_chunk: 256,
            max_running: 64,
            max_waiting: 256,
            speculation: Speculation::None,
            policy: VerifyPolicy::Fixed { gamma: 4 },
            online_calibration: crate::speculative::recalibrate::DEFAULT_STEP,
            experiment: None,
            prefix_cache: true,
            prompt_lookup: true,
            faults: Faults::default(),
        }
    }
}
