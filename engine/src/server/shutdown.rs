//! Graceful shutdown (`serve` on SIGTERM): admission stops (`/ready` and new requests get
//! 503), the requests in flight may finish for at most the drain timeout, then the ones left
//! are ended with an error (503 in OpenAI format, or an error event before `[DONE]` when
//! streaming) so that every client gets an answer before the process exits.

use crate::engine::Event;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedSender, WeakUnboundedSender};

use super::AppState;

/// The requests in flight, as the server can end them, and whether it has.
#[derive(Default)]
pub struct Shutdown {
    /// Set once the drain deadline passed: requests still submitted are ended at once.
    cancelled: AtomicBool,
    /// The engine-event channels of the requests in flight (weak: a request's channel still
    /// closes when the engine drops its end).
    live: Mutex<Vec<WeakUnboundedSender<Event>>>,
}

/// Why the requests left at the drain deadline end.
pub const CANCELLED: &str =
    "the server is shutting down and its drain timeout passed before this request finished; retry on another replica";

impl Shutdown {
    /// Follows one choice's event channel, so that [`Shutdown::cancel_all`] can end it.
    pub fn track(&self, events: &UnboundedSender<Event>) {
        if self.cancelled() {
            let _ = events.send(Event::Error(CANCELLED.into()));
            return;
        }
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(events.downgrade());
    }

    /// Whether the drain deadline has passed (requests then fail with 503, not 500).
    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Ends every request still in flight with [`CANCELLED`] (its response then says so);
    /// returns how many channels were still open.
    pub fn cancel_all(&self) -> usize {
        self.cancelled.store(true, Ordering::SeqCst);
        let live = std::mem::take(&mut *self.live.lock().unwrap_or_else(|e| e.into_inner()));
        live.iter()
            .filter_map(|w| w.upgrade())
            .filter(|tx| tx.send(Event::Error(CANCELLED.into())).is_ok())
            .count()
    }
}

/// What a drain did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Requests in flight when it began.
    pub inflight: usize,
    /// Requests ended with an error at the deadline.
    pub cancelled: usize,
}

/// How long the responses of cancelled requests may take to be written before exit.
const FLUSH: Duration = Duration::from_secs(2);
/// How often the drain looks at the requests in flight.
const POLL: Duration = Duration::from_millis(20);

/// Stops admission, waits up to `timeout` for the requests in flight to finish, ends the
/// rest with an error and waits (briefly) until their answers are written.
pub async fn drain(st: &AppState, timeout: Duration) -> Drained {
    st.draining.store(true, Ordering::SeqCst);
    let inflight = st.inflight.load(Ordering::SeqCst);
    tracing::info!(
        inflight,
        "draining before exit (up to {:.0} s)",
        timeout.as_secs_f64()
    );
    let left = wait_inflight(st, timeout).await;
    if left == 0 {
        tracing::info!("drained; exiting");
        return Drained {
            inflight,
            cancelled: 0,
        };
    }
    let cancelled = st.shutdown.cancel_all();
    tracing::warn!(
        left,
        cancelled,
        "drain timeout passed; ending the requests left with an error"
    );
    let unanswered = wait_inflight(st, FLUSH).await;
    if unanswered > 0 {
        tracing::warn!(unanswered, "exiting with requests still unanswered");
    }
    Drained {
        inflight,
        cancelled,
    }
}

/// Waits until no request is in flight or `limit` passed; returns how many are left.
async fn wait_inflight(st: &AppState, limit: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = st.inflight.load(Ordering::SeqCst);
        if left == 0 || tokio::time::Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(POLL).await;
    }
}
