//! One sequence's grammar state: the allowed tokens at the current position, committed and
//! draft tokens consumed, rejected drafts rolled back.

use super::number_bound::JsonScan;
use super::Mask;
use anyhow::{anyhow, Result};
use llguidance::Matcher;

/// One sequence's grammar state.
pub struct Constraint {
    pub(super) m: Matcher,
    pub(super) consumed: usize,
    /// JSON outputs of the compact style: the number bound.
    pub(super) json: Option<JsonScan>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} tokens)", self.consumed)
    }
}

impl Constraint {
    /// A constraint in the failed state llguidance leaves a matcher in after an internal
    /// error (every call answers `msg`): what the engine must survive for one request
    /// without failing the others.
    pub fn failed(msg: &str) -> Self {
        Self {
            m: Matcher::new(Err(anyhow!("{msg}"))),
            consumed: 0,
            json: None,
        }
    }

    /// An independent copy of this state (the `n` choices of one request).
    pub fn fork(&self) -> Self {
        Self {
            m: self.m.deep_clone(),
            consumed: self.consumed,
            json: self.json.clone(),
        }
    }

    /// The tokens allowed next (end tokens once the grammar may stop).
    pub fn mask(&mut self) -> Result<Mask> {
        let mut m = self.m.compute_mask_or_eos().map_err(|e| anyhow!(e))?;
        if let Some(j) = &self.json {
            j.bound(&mut m);
        }
        Ok(m)
    }

    /// Advances past a committed (or provisionally, a draft) token.
    pub fn consume(&mut self, tok: u32) -> Result<()> {
        self.m.consume_token(tok).map_err(|e| anyhow!(e))?;
        self.consumed += 1;
        if let Some(j) = &mut self.json {
            j.consume(tok);
        }
        Ok(())
    }

    /// Undoes the last `n` consumed tokens (rejected drafts).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > 0 {
            self.m.rollback(n).map_err(|e| anyhow!(e))?;
            self.consumed -= n;
            if let Some(j) = &mut self.json {
                j.rollback(n);
            }
        }
        Ok(())
    }
    /// The grammar is complete and allows nothing more but the end.
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }
}
