//! Download progress: a bar when stderr is a terminal, else a log line every 10 % (or 15 s),
//! which is what an init container's log shows.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Reporter {
    inner: Arc<Mutex<State>>,
}

struct State {
    bar: Option<indicatif::ProgressBar>,
    file: String,
    total: u64,
    done: u64,
    logged_at: Instant,
    logged_pct: u64,
    started: Instant,
}

impl Default for Reporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Reporter {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Mutex::new(State {
                bar: None,
                file: String::new(),
                total: 0,
                done: 0,
                logged_at: Instant::now(),
                logged_pct: 0,
                started: Instant::now(),
            })),
        }
    }

    /// A new file of `total` bytes starts (`already` of them were there from before).
    pub fn start(&self, file: &str, total: u64, already: u64) {
        let mut s = self.inner.lock().expect("progress lock");
        s.file = file.to_string();
        s.total = total;
        s.done = already;
        s.started = Instant::now();
        s.logged_at = Instant::now();
        s.logged_pct = (already * 100).checked_div(total).unwrap_or(0);
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
                )
                .expect("valid template"),
            );
            bar.set_message(file.to_string());
            bar.set_position(already);
            s.bar = Some(bar);
        } else {
            tracing::info!(
                file,
                total_mb = mb(total),
                resumed_from_mb = mb(already),
                "download started"
            );
        }
    }

    pub fn add(&self, n: u64) {
        let mut s = self.inner.lock().expect("progress lock");
        s.done += n;
        if let Some(b) = &s.bar {
            b.set_position(s.done);
            return;
        }
        let pct = (s.done * 100).checked_div(s.total).unwrap_or(0);
        if pct >= s.logged_pct + 10 || s.logged_at.elapsed() > Duration::from_secs(15) {
            s.logged_pct = pct / 10 * 10;
            s.logged_at = Instant::now();
            tracing::info!(
                file = s.file.as_str(),
                done_mb = mb(s.done),
                total_mb = mb(s.total),
                percent = pct,
                "downloading"
            );
        }
    }

    pub fn finish(&self) {
        let mut s = self.inner.lock().expect("progress lock");
        if let Some(b) = s.bar.take() {
            b.finish_and_clear();
        }
        let secs = s.started.elapsed().as_secs_f64();
        tracing::info!(
            file = s.file.as_str(),
            total_mb = mb(s.total),
            seconds = format!("{secs:.1}"),
            "download finished"
        );
    }
}

fn mb(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

impl hf_hub::api::tokio::Progress for Reporter {
    async fn init(&mut self, size: usize, filename: &str) {
        self.start(filename, size as u64, 0);
    }
    async fn update(&mut self, size: usize) {
        self.add(size as u64);
    }
    async fn finish(&mut self) {
        Reporter::finish(self);
    }
}
