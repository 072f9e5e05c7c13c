//! Observability of the step loop: the queue and KV gauges, per-token latency (TTFT, ITL,
//! also per experiment arm), the per-request OpenTelemetry GenAI metrics and span fields,
//! and the online policy experiment's clock.

use super::request::FinishReason;
use super::seq::Seq;
use super::Engine;
use crate::experiment::Window;
use crate::metrics::{ExperimentMetrics, FinishLabel};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Engine {
    /// Puts the experiment's current arm in force (policy, `active` gauges).
    pub(super) fn apply_arm(&mut self) {
        let Some(e) = &self.experiment else {
            return;
        };
        let arm = e.arm().clone();
        for a in &e.arms {
            self.metrics
                .experiment
                .active
                .get_or_create(&ExperimentMetrics::label(&a.label))
                .set((a.label == arm.label) as i64);
        }
        self.spec.set_policy(arm.policy);
    }

    /// The experiment's finished windows (`GET /experiment`), when one runs.
    pub fn experiment_log(&self) -> Option<Arc<std::sync::Mutex<Vec<Window>>>> {
        self.experiment.as_ref().map(|e| e.log.clone())
    }

    /// Advances the experiment clock by one step and switches arms at a window's end.
    pub(super) fn experiment_tick(&mut self) {
        let Some(e) = &mut self.experiment else {
            return;
        };
        let running: Vec<u64> = self.running.iter().map(|s| s.id).collect();
        let before = ExperimentMetrics::label(&e.arm().label);
        let (dt, switched) = e.tick(Instant::now(), &running);
        let running = running.len();
        let switched = switched.is_some();
        let m = &self.metrics.experiment;
        m.seconds.get_or_create(&before).inc_by(dt);
        m.running_seconds
            .get_or_create(&before)
            .inc_by(dt * running as f64);
        if switched {
            m.windows.get_or_create(&before).inc();
            self.apply_arm();
        }
    }

    /// Publishes the waiting / running counts (admission control reads them) and gauges.
    pub(super) fn publish_counts(&self) {
        self.waiting_count
            .store(self.waiting.len(), Ordering::SeqCst);
        self.running_count
            .store(self.running.len(), Ordering::SeqCst);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.running.set(self.running.len() as i64);
        let used = self.kv.total_blocks() - self.kv.free_blocks();
        self.metrics
            .kv_usage
            .set(used as f64 / self.kv.total_blocks() as f64);
        self.metrics
            .prefix_blocks
            .set(self.kv.registered_blocks() as i64);
        let evicted = self.kv.prefix_stats().evictions;
        let seen = self.metrics.prefix_evictions.get();
        if evicted > seen {
            self.metrics.prefix_evictions.inc_by(evicted - seen);
        }
    }

    /// Records a committed token's latency: TTFT for the first, otherwise the inter-token
    /// gap (`gap`: the time since the previous commit divided by the tokens it commits).
    pub(super) fn observe_token(&mut self, i: usize, gap: Option<f64>) {
        let now = Instant::now();
        let s = &mut self.running[i];
        // While a window settles (see [`crate::experiment`]) nothing is counted for its arm.
        let arm = self.experiment.as_mut().and_then(|e| {
            e.tokens(1);
            e.measuring()
                .then(|| ExperimentMetrics::label(&e.arm().label))
        });
        let em = &self.metrics.experiment;
        if let Some(a) = &arm {
            em.tokens.get_or_create(a).inc();
        }
        match gap {
            None if s.last_token.is_none() => {
                let t = (now - s.req.arrived).as_secs_f64();
                self.metrics.ttft.observe(t);
                if let Some(a) = &arm {
                    em.ttft.get_or_create(a).observe(t);
                }
                let g = &self.metrics.genai;
                g.ttft.record(t, &g.attrs(s.req.operation));
                s.enter_phase("decode");
            }
            None => {}
            Some(g) => {
                self.metrics.itl.observe(g);
                if let Some(a) = &arm {
                    em.itl.get_or_create(a).observe(g);
                }
            }
        }
        if s.first_token.is_none() {
            s.first_token = Some(now);
        }
        s.last_token = Some(now);
        self.metrics.generation_tokens.inc();
    }

    /// Records a finished request: end-to-end latency, GenAI duration / token usage, the
    /// request span's usage fields and one log line carrying its trace id.
    pub(super) fn observe_finish(&mut self, s: &mut Seq, reason: FinishReason) {
        let e2e = s.req.arrived.elapsed().as_secs_f64();
        self.metrics.e2e.observe(e2e);
        let g = &self.metrics.genai;
        let attrs = g.attrs(s.req.operation);
        g.request_duration.record(e2e, &attrs);
        if let (Some(first), Some(last)) = (s.first_token, s.last_token) {
            if s.generated() > 1 {
                let per = (last - first).as_secs_f64() / (s.generated() - 1) as f64;
                g.time_per_output_token.record(per, &attrs);
            }
        }
        for (kind, n) in [("input", s.prompt_len), ("output", s.generated())] {
            let mut a = attrs.to_vec();
            a.push(opentelemetry::KeyValue::new("gen_ai.token.type", kind));
            g.token_usage.record(n as u64, &a);
        }
        let span = &s.req.span;
        span.record("gen_ai.usage.input_tokens", s.prompt_len as u64);
        span.record("gen_ai.usage.output_tokens", s.generated() as u64);
        span.record("gen_ai.response.finish_reasons", reason.as_str());
        span.record("dspark.draft_tokens", s.draft_tokens as u64);
        span.record("dspark.accepted_draft_tokens", s.accepted_tokens as u64);
        // With tracing on, one log line per request that carries its trace id.
        if let Some(trace_id) = dspark_telemetry::trace_id(span) {
            tracing::info!(
                trace_id,
                operation = s.req.operation,
                prompt_tokens = s.prompt_len,
                completion_tokens = s.generated(),
                accepted_draft_tokens = s.accepted_tokens,
                finish_reason = reason.as_str(),
                e2e_s = e2e,
                "request finished"
            );
        }
        s.phase = tracing::Span::none();
        self.metrics
            .request_success
            .get_or_create(&FinishLabel {
                finished_reason: reason.as_str().into(),
            })
            .inc();
    }
}
