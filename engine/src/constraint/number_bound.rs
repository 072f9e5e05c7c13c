//! The number bound of compact JSON outputs: no run of more than
//! [`MAX_NUMBER_DIGITS`] digits outside strings, followed token by token (rollback pops).

use super::{Mask, MAX_NUMBER_DIGITS};
use std::sync::Arc;

/// Per token: how many digits it starts with, and its bytes (to follow where the output
/// is in the JSON text).
pub(super) struct Digits {
    words: Vec<Vec<u8>>,
    /// Digits a token starts with (saturating at 255).
    lead: Vec<u8>,
    /// The tokens that start with a digit.
    led: Vec<u32>,
}

impl Digits {
    pub(super) fn new(words: &[Vec<u8>]) -> Self {
        let lead: Vec<u8> = words
            .iter()
            .map(|w| {
                if w.first() == Some(&0xFF) {
                    0
                } else {
                    w.iter().take_while(|b| b.is_ascii_digit()).count().min(255) as u8
                }
            })
            .collect();
        let led = (0..lead.len() as u32)
            .filter(|&t| lead[t as usize] > 0)
            .collect();
        Self {
            words: words.to_vec(),
            lead,
            led,
        }
    }
}

/// Where the output is in the JSON text: inside a string (and after a backslash), and how
/// many digits in a row it ends with outside strings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct ScanState {
    pub(super) in_string: bool,
    escaped: bool,
    pub(super) run: usize,
}

impl ScanState {
    pub(super) fn advance(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                self.run = 0;
            } else if b == b'"' {
                self.in_string = true;
                self.run = 0;
            } else if b.is_ascii_digit() {
                self.run += 1;
            } else {
                self.run = 0;
            }
        }
        self
    }
}

/// The number bound of a JSON constraint: one scan state per consumed token (rollback pops).
#[derive(Clone)]
pub(super) struct JsonScan {
    digits: Arc<Digits>,
    states: Vec<ScanState>,
}

impl JsonScan {
    /// At the start of the output.
    pub(super) fn new(digits: Arc<Digits>) -> Self {
        Self {
            digits,
            states: vec![ScanState::default()],
        }
    }

    fn last(&self) -> ScanState {
        self.states.last().copied().unwrap_or_default()
    }

    /// Takes out of `mask` the tokens that would make a run of more than
    /// [`MAX_NUMBER_DIGITS`] digits outside a string, unless nothing else would be left
    /// (a grammar that needs the digits, e.g. a long `const`, gets them).
    pub(super) fn bound(&self, mask: &mut Mask) {
        let st = self.last();
        if st.in_string {
            return;
        }
        let room = MAX_NUMBER_DIGITS.saturating_sub(st.run);
        let over: Vec<u32> = self
            .digits
            .led
            .iter()
            .copied()
            .filter(|&t| self.digits.lead[t as usize] as usize > room && mask.is_allowed(t))
            .collect();
        for &t in &over {
            mask.disallow_token(t);
        }
        if mask.is_zero() {
            for t in over {
                mask.allow_token(t);
            }
        }
    }

    pub(super) fn consume(&mut self, tok: u32) {
        let bytes = self
            .digits
            .words
            .get(tok as usize)
            .filter(|w| w.first() != Some(&0xFF))
            .map_or(&[][..], Vec::as_slice);
        let next = self.last().advance(bytes);
        self.states.push(next);
    }

    pub(super) fn rollback(&mut self, n: usize) {
        let keep = self.states.len().saturating_sub(n).max(1);
        self.states.truncate(keep);
    }
}
