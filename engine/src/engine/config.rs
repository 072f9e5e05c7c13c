//! The engine's knobs (`serve` flags map onto these).

use crate::experiment::Arm;
use crate::speculative::{Speculation, VerifyPolicy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
    /// Test-only fault injection (no flag sets it): see [`Faults`].
    #[doc(hidden)]
    pub faults: Faults,
}

/// Test-only fault injection: a test keeps a clone and trips a fault in the running engine
/// to check what the server does then (no `serve` flag or variable reaches it).
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct Faults {
    panic_next_step: Arc<AtomicBool>,
    stall: Arc<AtomicBool>,
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
            faults: Faults::default(),
        }
    }
}
