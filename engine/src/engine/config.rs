//! The engine's knobs (`serve` flags map onto these).

use crate::experiment::Arm;
use crate::speculative::{Speculation, VerifyPolicy};
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
        }
    }
}
