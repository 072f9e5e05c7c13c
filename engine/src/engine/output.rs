//! Output handling: a committed token becomes text (incremental detokenizing), stop
//! strings and end-of-sequence tokens end the sequence, and text that might still become a
//! stop string is held back until it is decided.

use super::request::{Event, FinishReason, TokenLogprob};
use super::seq::Seq;
use crate::sampling::logprobs;
use crate::tokenizer::TextTokenizer;

/// Appends `tok` to `s`, streams what became final (text and, when asked for, the token's
/// logprobs from the target's `logits` row) and says whether the sequence is done.
pub(super) fn emit_token(
    s: &mut Seq,
    tok: u32,
    logits: &[f32],
    tokz: &TextTokenizer,
) -> Option<FinishReason> {
    s.tokens.push(tok);
    s.history.push(tok);
    let mut lps = Vec::new();
    if let Some(k) = s.req.logprobs {
        let (lp, top) = logprobs(logits, tok, k);
        lps.push(TokenLogprob {
            id: tok,
            text: tokz.token_text(tok),
            logprob: lp,
            top: top
                .into_iter()
                .map(|(id, l)| (tokz.token_text(id), l))
                .collect(),
        });
    }
    let is_eos = !s.req.ignore_eos && tokz.stop_ids.contains(&tok);
    let mut reason = None;
    if is_eos {
        reason = Some(FinishReason::Stop);
    } else {
        let gen_start = s.prompt_len;
        let delta = s.decoder.step(tokz, &s.tokens[gen_start..]);
        let search_from = s.text.len().saturating_sub(max_len(&s.req.stop));
        s.text.push_str(&delta);
        if let Some(cut) = find_stop(&s.text, &s.req.stop, search_from) {
            s.text.truncate(cut);
            reason = Some(FinishReason::Stop);
        } else if s.generated() >= s.req.max_tokens {
            reason = Some(FinishReason::Length);
        }
    }
    let safe = if reason.is_some() {
        s.text.len()
    } else {
        s.text.len() - holdback(&s.text, &s.req.stop)
    };
    let text = if safe > s.sent {
        let t = s.text[s.sent..safe].to_string();
        s.sent = safe;
        t
    } else {
        String::new()
    };
    if !text.is_empty() || !lps.is_empty() {
        let _ = s.req.events.send(Event::Delta {
            text,
            logprobs: lps,
        });
    }
    reason
}

/// Sends the text still held back (a sequence that ends for another reason than a token).
pub(super) fn flush(s: &mut Seq) {
    if s.text.len() > s.sent {
        let text = s.text[s.sent..].to_string();
        s.sent = s.text.len();
        let _ = s.req.events.send(Event::Delta {
            text,
            logprobs: Vec::new(),
        });
    }
}

fn max_len(stops: &[String]) -> usize {
    stops.iter().map(|s| s.len()).max().unwrap_or(0)
}

/// Byte offset where the earliest stop string starts, searching from `from` (snapped to a
/// char boundary).
fn find_stop(text: &str, stops: &[String], from: usize) -> Option<usize> {
    let mut from = from.min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from))
        .min()
}

/// Bytes at the end of `text` that might be the start of a stop string and so must not be
/// streamed yet.
fn holdback(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for s in stops {
        for k in (1..s.len().min(text.len() + 1)).rev() {
            if k <= best {
                break;
            }
            if text.is_char_boundary(text.len() - k)
                && s.is_char_boundary(k)
                && text.ends_with(&s[..k])
            {
                best = k;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_and_holdback() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(find_stop("abc\n\ndef", &stops, 0), Some(3));
        assert_eq!(find_stop("abcEN", &stops, 0), None);
        assert_eq!(holdback("abcEN", &stops), 2);
        assert_eq!(holdback("abc\n", &stops), 1);
        assert_eq!(holdback("abc", &stops), 0);
        assert_eq!(holdback("ééE", &["Eé".to_string()]), 1);
    }
}
