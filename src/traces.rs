//! Traces over OTLP/HTTP (protobuf), on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set: the spans the
//! processes already make (each request, each job run) exported by `tracing-opentelemetry`,
//! and the W3C trace context carried across the hops a payment takes, so that one payment is
//! one trace whatever process does each part:
//! - a request's span continues the caller's `traceparent` header;
//! - a stored webhook keeps its request's context in its processing job's arguments, and the
//!   job's `payment_event` span continues it (in whichever worker process runs it);
//! - an order message written by that processing keeps it (`order_events.traceparent`), the
//!   outbox relay sends it as the message's `traceparent` header, and each consumer's span
//!   continues it;
//! - the payment-link RPC sends the checkout's context the same way.
//!
//! Off (the default), nothing is installed: [`traceparent`] answers `None` at the cost of one
//! atomic load, and no context is stored or sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Whether spans are exported (set once, at start-up).
static ON: AtomicBool = AtomicBool::new(false);

/// The variable that turns export on (the OpenTelemetry SDKs' own name).
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

#[derive(Debug, thiserror::Error)]
#[error("OTLP trace export: {0}")]
pub struct TraceSetupError(#[from] opentelemetry_otlp::ExporterBuildError);

/// Flushes the spans still buffered when the process ends.
pub struct Exporter(SdkTracerProvider);

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("payfleet: flushing the last spans: {e}");
        }
    }
}

/// The layer exporting spans, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the exporter reads it
/// and the other `OTEL_EXPORTER_OTLP_*` variables); `role` names the process (`serve`, `work`)
/// beside `OTEL_SERVICE_NAME` (default `payfleet`).
#[allow(clippy::type_complexity)]
pub fn layer<S>(
    role: &str,
) -> Result<
    Option<(
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
        Exporter,
    )>,
    TraceSetupError,
>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if std::env::var_os(ENDPOINT_VAR).is_none_or(|v| v.is_empty()) {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "payfleet".into());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .with_attribute(opentelemetry::KeyValue::new(
            "payfleet.role",
            role.to_owned(),
        ))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("payfleet");
    ON.store(true, Ordering::Relaxed);
    Ok(Some((
        tracing_opentelemetry::layer().with_tracer(tracer),
        Exporter(provider),
    )))
}

/// Whether spans are exported by this process.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The current span's context as a W3C `traceparent`, to carry to the next hop; `None` when
/// traces are off (or the span is not sampled).
pub fn traceparent() -> Option<String> {
    if !on() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` continue the trace of `traceparent` (from another process), when traces are
/// on and it is a valid one; else it stays where it is. Call before the span is entered.
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|_| on()) else {
        return;
    };
    let carrier = HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    use opentelemetry::trace::TraceContextExt as _;
    if cx.span().span_context().is_valid() {
        // Refused only for a span that is not recorded (filtered out): nothing to continue.
        let _ = span.set_parent(cx);
    }
}

/// A span that exists only for the traces: `make`'s when they are on, else none (a span
/// no subscriber records costs nothing to enter), so a hop's own span adds no work to a process
/// that exports nothing.
pub fn hop_span(make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if on() { make() } else { tracing::Span::none() }
}

/// Whether `s` reads as a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`): what a sender
/// chose is continued only when it is one, and kept no longer than that.
pub fn is_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() == 4
        && [2, 32, 16, 2]
            .iter()
            .zip(&parts)
            .all(|(n, p)| p.len() == *n && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_costs_nothing() {
        assert!(!on());
        assert_eq!(traceparent(), None);
    }

    #[test]
    fn only_a_w3c_traceparent_is_continued() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e473Z-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(!is_traceparent(bad), "{bad:?}");
        }
    }
}
