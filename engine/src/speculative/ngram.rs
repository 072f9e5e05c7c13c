//! Prompt-lookup drafting (training-free): find the most recent earlier occurrence of the
//! sequence's last n tokens (longest n first) and propose the tokens that followed it.

/// Proposes up to `k` tokens for `tokens` (prompt + generated so far), trying suffix
/// lengths from `max_n` down to `min_n`.
pub fn propose(tokens: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent match that is not the suffix itself.
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                if to > from {
                    return tokens[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_latest_longest_match() {
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(propose(&t, 2, 1, 3), vec![5, 6]);
        assert_eq!(propose(&t, 5, 1, 3), vec![5, 6, 1, 2, 3]);
        assert!(propose(&[1, 2, 3], 4, 1, 3).is_empty());
        assert_eq!(propose(&[7, 8, 7], 3, 1, 2), vec![8, 7]);
    }
}
