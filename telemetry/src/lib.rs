//! Logs, traces and metrics set-up shared by `dspark-engine` and `dspark-operator`.
//!
//! - Logs: `tracing` to stderr, human-readable by default, JSON with
//!   `DSPARK_LOG_FORMAT=json` (each line then carries the current `trace_id` when a span is
//!   exported over OTLP). Level filter from `RUST_LOG` (default `info`).
//! - Traces and metrics over OTLP/HTTP (protobuf), switched on by the standard variables:
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` (or the per-signal `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
//!   `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`), `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_METRIC_EXPORT_INTERVAL`; `OTEL_SDK_DISABLED=true`
//!   turns everything off. With no endpoint nothing is exported and the request-level spans
//!   (target [`TRACE_TARGET`]) are filtered out before they are built, so they cost nothing.
//! - W3C trace context (`traceparent`, `tracestate`) is the propagator: [`extract_context`]
//!   makes an incoming request's span a child of the caller's.

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Target of the per-request spans and per-step events: exported over OTLP, never logged,
/// and disabled entirely when OTLP is off.
pub const TRACE_TARGET: &str = "dspark::trace";

/// Keeps the exporters alive; dropping it flushes and shuts them down.
pub struct Telemetry {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
}

impl Telemetry {
    /// Whether spans and metrics are exported.
    pub fn otlp_enabled(&self) -> bool {
        self.tracer.is_some()
    }

    /// Flushes what is buffered (spans, metrics) now.
    pub fn flush(&self) {
        if let Some(t) = &self.tracer {
            let _ = t.force_flush();
        }
        if let Some(m) = &self.meter {
            let _ = m.force_flush();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(t) = self.tracer.take() {
            let _ = t.shutdown();
        }
        if let Some(m) = self.meter.take() {
            let _ = m.shutdown();
        }
    }
}

fn env_set(name: &str) -> bool {
    std::env::var(name)
        .map(|v| !v.trim().is_empty())
        .unwrap_or(false)
}

/// Whether the OTEL_* environment asks for OTLP export.
pub fn otlp_requested() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED")
        .map(|v| v.eq_ignore_ascii_case("true"))
        .unwrap_or(false);
    !disabled
        && (env_set("OTEL_EXPORTER_OTLP_ENDPOINT")
            || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            || env_set("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
}

/// Installs logging, and OTLP traces + metrics when the environment asks for them.
/// `service` is the default `service.name` (OTEL_SERVICE_NAME wins).
pub fn init(service: &str) -> anyhow::Result<Telemetry> {
    let json = std::env::var("DSPARK_LOG_FORMAT")
        .map(|v| v.eq_ignore_ascii_case("json"))
        .unwrap_or(false);
    let level = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    // Request spans are for export only: never printed as log lines.
    let log_filter = EnvFilter::try_new(format!("{level},{TRACE_TARGET}=off"))
        .unwrap_or_else(|_| EnvFilter::new(format!("info,{TRACE_TARGET}=off")));
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(log_filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(log_filter)
            .boxed()
    };
    if !otlp_requested() {
        tracing_subscriber::registry().with(fmt).try_init()?;
        return Ok(Telemetry {
            tracer: None,
            meter: None,
        });
    }
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    // Resource::builder() also reads OTEL_RESOURCE_ATTRIBUTES.
    let resource = Resource::builder()
        .with_service_name(service.clone())
        .build();
    let spans = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()?;
    let tracer = SdkTracerProvider::builder()
        .with_batch_exporter(spans)
        .with_resource(resource.clone())
        .build();
    let metrics = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .build()?;
    let meter = SdkMeterProvider::builder()
        .with_periodic_exporter(metrics)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(tracer.clone());
    opentelemetry::global::set_meter_provider(meter.clone());
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer.tracer(service))
        .with_filter(EnvFilter::new(format!("info,{TRACE_TARGET}=info")));
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()?;
    tracing::info!("OTLP export of traces and metrics is on");
    Ok(Telemetry {
        tracer: Some(tracer),
        meter: Some(meter),
    })
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The caller's trace context from W3C `traceparent`/`tracestate` headers (empty when
/// absent or when no propagator is installed).
pub fn extract_context(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Makes `span` a child of the caller's trace when the request carried one.
pub fn set_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = extract_context(headers);
    let _ = span.set_parent(cx);
}

/// The OpenTelemetry trace id of `span` (hex), when it is exported.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The global meter (a no-op until [`init`] installs OTLP export).
pub fn meter(name: &'static str) -> opentelemetry::metrics::Meter {
    opentelemetry::global::meter(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otlp_is_off_without_an_endpoint_and_when_disabled() {
        // Only this test touches these variables in this process.
        std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
        std::env::remove_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        std::env::remove_var("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT");
        assert!(!otlp_requested());
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        assert!(otlp_requested());
        std::env::set_var("OTEL_SDK_DISABLED", "true");
        assert!(!otlp_requested());
        std::env::remove_var("OTEL_SDK_DISABLED");
        std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    }

    #[test]
    fn traceparent_is_extracted() {
        use opentelemetry::trace::TraceContextExt;
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let mut h = http::HeaderMap::new();
        h.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let cx = extract_context(&h);
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(sc.is_remote());
    }
}
