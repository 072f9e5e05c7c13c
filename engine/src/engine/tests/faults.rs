//! One sequence failing at a site of its step fails that request only; a panicking step and
//! a stalled loop are seen by the handles.

use super::*;

const MAX_TOKENS: usize = 24;

/// Runs [`PROMPTS`] together (the second constrained to a JSON object when `json`) on a
/// fresh speculating engine whose faults `arm` sets first; the outcomes and the engine.
fn run(json: bool, arm: impl FnOnce(&Faults)) -> (Vec<Outcome>, Engine, EngineHandle) {
    let faults = Faults::default();
    arm(&faults);
    let (mut e, h, tok, g) = engine(speculating(&faults));
    let mut rxs: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .map(|(k, p)| submit(&h, &tok, &g, p, MAX_TOKENS, json && k == 1))
        .collect();
    let out = drive(&mut e, &mut rxs);
    (out, e, h)
}

/// The `failing`-th request (1-based) fails at `site` after `after` tokens: it gets an
/// error naming the site, every other request's output is the one of a run without the
/// fault, no KV block or drafter context is left over, and the engine then serves the
/// failed prompt again (on the prefix blocks it left cached) exactly as before.
fn one_sequence_fails(site: FaultSite, failing: u64, after: usize, json: bool) {
    let (clean, _, _) = run(json, |_| {});
    assert!(
        clean
            .iter()
            .all(|o| matches!(o, Outcome::Done(_, n) if *n > 0)),
        "{clean:?}"
    );
    let (faulty, mut e, h) = run(json, |f| f.fail_sequence(site, failing, after));
    let k = failing as usize - 1;
    for (i, (a, b)) in clean.iter().zip(&faulty).enumerate() {
        if i == k {
            match b {
                Outcome::Failed(m) => assert!(m.contains(&format!("{site:?}")), "{m}"),
                o => panic!("request {failing} should have failed at {site:?}: {o:?}"),
            }
        } else {
            assert_eq!(a, b, "request {} changed by another's failure", i + 1);
        }
    }
    assert_all_free(&e);
    let tok = e.tok.clone();
    let g = Grammars::new(tok.clone(), e.model.cfg.vocab_size).unwrap();
    let mut rx = [submit(&h, &tok, &g, PROMPTS[k], MAX_TOKENS, json && k == 1)];
    assert_eq!(drive(&mut e, &mut rx)[0], clean[k]);
    assert_all_free(&e);
}

/// One test per case: `name: site, failing, after, json` runs [`one_sequence_fails`].
macro_rules! one_sequence_fails_tests {
    ($($(#[$doc:meta])* $name:ident: $site:ident, $failing:expr, $after:expr, $json:expr;)*) => {$(
        $(#[$doc])*
        #[test]
        fn $name() {
            one_sequence_fails(FaultSite::$site, $failing, $after, $json);
        }
    )*};
}

one_sequence_fails_tests! {
    a_sampling_failure_fails_its_request_only: Sampling, 2, 3, false;
    a_drafter_failure_fails_its_request_only: Drafter, 3, 5, false;
    a_grammar_failure_fails_its_request_only: Grammar, 2, 2, true;
    /// A failure in the prefill (before any logits) is the sequence's own too.
    a_failure_in_prefill_fails_its_request_only: Drafter, 1, 0, false;
}

/// A panic in the step ends the engine thread cleanly: every request in flight gets an
/// error event, the handle reports the failure, and later submissions are refused.
#[test]
fn a_panicking_step_fails_every_request_and_the_handle() {
    let faults = Faults::default();
    let (e, h, tok, g) = engine(speculating(&faults));
    let mut rxs: Vec<_> = PROMPTS[..2]
        .iter()
        .map(|p| submit(&h, &tok, &g, p, 2000, false))
        .collect();
    let t = std::thread::spawn(move || e.run());
    assert!(matches!(rxs[0].blocking_recv(), Some(Event::Delta { .. })));
    assert!(h.failure().is_none());
    faults.panic_next_step();
    t.join().expect("run catches the panic");
    for rx in &mut rxs {
        let last = std::iter::from_fn(|| rx.blocking_recv()).last();
        match last {
            Some(Event::Error(m)) => assert!(m.contains("panicked"), "{m}"),
            other => panic!("no error event: {other:?}"),
        }
    }
    assert!(h.failure().unwrap().contains("injected fault"));
    let r = h.submit(late_request(&tok));
    assert!(matches!(r, Err(SubmitError::Stopped)), "{:?}", r.err());
}

/// A request submitted after the engine died.
fn late_request(tok: &TextTokenizer) -> GenRequest {
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    GenRequest::new(tok.encode("Hi", tok.add_bos).unwrap(), 2, tx)
}

/// A loop that makes no progress while a request waits is reported stalled (the server
/// fails its probes on it), and no longer once it moves; the request then completes.
#[test]
fn a_stalled_loop_is_reported_until_it_moves() {
    let faults = Faults::default();
    let (e, h, tok, g) = engine(speculating(&faults));
    faults.stall_steps(true);
    let t = std::thread::spawn(move || e.run());
    let after = std::time::Duration::from_millis(100);
    assert!(h.stalled(after).is_none(), "idle is not stalled");
    let mut rx = submit(&h, &tok, &g, PROMPTS[0], 4, false);
    let t0 = std::time::Instant::now();
    while h.stalled(after).is_none() {
        assert!(t0.elapsed().as_secs() < 60, "never reported stalled");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    faults.stall_steps(false);
    let last = std::iter::from_fn(|| rx.blocking_recv()).last();
    assert!(matches!(last, Some(Event::Finished { .. })), "{last:?}");
    assert!(h.stalled(after).is_none());
    drop(h);
    t.join().unwrap();
}
