//! This process's measurements of its own work, on `prometheus-client` (the Prometheus
//! project's Rust client: no global registry, so each process, and each app a test starts,
//! holds its own; typed label sets; lean, with no exporter of its own to run, since `/metrics`
//! serves it beside the fleet-wide gauges read from the database).
//!
//! - `payfleet_job_run_seconds{queue,kind,outcome}`: each run's time, by how it ended
//!   (`complete`, `retry`, `fail`, `snooze`, `cancel`, `release`); its `_count` is the
//!   outcomes' counter.
//! - `payfleet_job_start_delay_seconds{queue}`: from a job's due time to its start.
//! - `payfleet_http_request_duration_seconds{route,status}`: each answer's time, by route
//!   template (`/orders/{number}`, never the id itself) and status class (`2xx`...).
//! - `payfleet_webhook_to_effect_seconds{gateway}`: from a payment event's receipt to the end
//!   of its processing (its effect committed).
//! - `payfleet_amqp_messages_total{event}`: order messages `published`, `confirmed` and
//!   `nacked` by the broker, `returned` by it (routed to no queue), `consumed` (handled and
//!   acknowledged), `redelivered` (a handler failed: delivered again) and `dead` (kept for an
//!   operator after every attempt failed). A batch whose marks fail to commit is published
//!   again, and counted again: the broker did take it twice.
//! - `payfleet_rpc_calls_total{rpc,result}`: RPC calls (`payment_links`, `coins`) `answered`,
//!   `timeout` (no answer in time) or `failed` (not connected, not sent, lost).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    queue: String,
    kind: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    route: String,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GatewayLabels {
    gateway: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageLabels {
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    rpc: &'static str,
    result: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// The RPCs (their request queues' names), counted from zero.
const RPCS: [&str; 2] = ["payment_links", "coins"];

/// What happened to an order message.
#[derive(Debug, Clone, Copy)]
pub enum MessageEvent {
    Published,
    Confirmed,
    Nacked,
    /// Confirmed, but came back: no queue's binding took it (and the alternate exchange's
    /// either). Put off in the outbox like a refused one.
    Returned,
    Consumed,
    Redelivered,
    Dead,
}

impl MessageEvent {
    fn as_str(self) -> &'static str {
        match self {
            Self::Published => "published",
            Self::Confirmed => "confirmed",
            Self::Nacked => "nacked",
            Self::Returned => "returned",
            Self::Consumed => "consumed",
            Self::Redelivered => "redelivered",
            Self::Dead => "dead",
        }
    }
}

/// How an RPC call ended.
#[derive(Debug, Clone, Copy)]
pub enum RpcResult {
    Answered,
    Timeout,
    Failed,
}

/// 0.5 ms to about 65 s, doubling: a claim's millisecond and a gateway call's seconds alike.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

struct Inner {
    registry: Registry,
    job_runs: Histograms<JobLabels>,
    job_delay: Histograms<QueueLabels>,
    http: Histograms<HttpLabels>,
    webhook_to_effect: Histograms<GatewayLabels>,
    messages: Family<MessageLabels, Counter>,
    rpc: Family<RpcLabels, Counter>,
}

/// The process's metrics; cloning shares them.
#[derive(Clone)]
pub struct Telemetry(Arc<Inner>);

impl Default for Telemetry {
    fn default() -> Self {
        let mut registry = Registry::default();
        let job_runs: Histograms<JobLabels> = Family::new_with_constructor(seconds);
        let job_delay: Histograms<QueueLabels> = Family::new_with_constructor(seconds);
        let http: Histograms<HttpLabels> = Family::new_with_constructor(seconds);
        let webhook_to_effect: Histograms<GatewayLabels> = Family::new_with_constructor(seconds);
        registry.register(
            "payfleet_job_run_seconds",
            "Job runs by queue, kind and outcome, and how long each ran",
            job_runs.clone(),
        );
        registry.register(
            "payfleet_job_start_delay_seconds",
            "From a job's due time to its start",
            job_delay.clone(),
        );
        registry.register(
            "payfleet_http_request_duration_seconds",
            "HTTP answers by route template and status class, and how long each took",
            http.clone(),
        );
        registry.register(
            "payfleet_webhook_to_effect_seconds",
            "From a payment event's receipt to the end of its processing",
            webhook_to_effect.clone(),
        );
        let messages: Family<MessageLabels, Counter> = Family::default();
        let rpc: Family<RpcLabels, Counter> = Family::default();
        registry.register(
            "payfleet_amqp_messages",
            "Order messages published, confirmed and nacked by the broker, consumed, redelivered and dead",
            messages.clone(),
        );
        registry.register(
            "payfleet_rpc_calls",
            "RPC calls by RPC and how they ended",
            rpc.clone(),
        );
        // Every counter from zero, so a rate over it is right from the process's start.
        for event in [
            MessageEvent::Published,
            MessageEvent::Confirmed,
            MessageEvent::Nacked,
            MessageEvent::Returned,
            MessageEvent::Consumed,
            MessageEvent::Redelivered,
            MessageEvent::Dead,
        ] {
            let _ = messages.get_or_create(&MessageLabels {
                event: event.as_str(),
            });
        }
        for rpc_name in RPCS {
            for result in ["answered", "timeout", "failed"] {
                let _ = rpc.get_or_create(&RpcLabels {
                    rpc: rpc_name,
                    result,
                });
            }
        }
        Self(Arc::new(Inner {
            registry,
            job_runs,
            job_delay,
            http,
            webhook_to_effect,
            messages,
            rpc,
        }))
    }
}

impl Telemetry {
    pub fn http_answered(&self, route: &str, status: u16, took: Duration) {
        let status = match status {
            100..=199 => "1xx",
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            _ => "5xx",
        };
        self.0
            .http
            .get_or_create(&HttpLabels {
                route: route.to_owned(),
                status,
            })
            .observe(took.as_secs_f64());
    }

    pub fn event_processed(&self, gateway: crate::gateways::GatewayName, since_receipt: Duration) {
        self.0
            .webhook_to_effect
            .get_or_create(&GatewayLabels {
                gateway: gateway.as_str(),
            })
            .observe(since_receipt.as_secs_f64());
    }

    pub fn message(&self, event: MessageEvent, n: u64) {
        self.0
            .messages
            .get_or_create(&MessageLabels {
                event: event.as_str(),
            })
            .inc_by(n);
    }

    pub fn rpc_call(&self, rpc: &'static str, result: RpcResult) {
        let result = match result {
            RpcResult::Answered => "answered",
            RpcResult::Timeout => "timeout",
            RpcResult::Failed => "failed",
        };
        self.0.rpc.get_or_create(&RpcLabels { rpc, result }).inc();
    }

    /// Appends the metrics in the Prometheus text format. The client writes OpenMetrics, whose
    /// counter families are named without the `_total` their samples carry; the classic text
    /// format `/metrics` serves (and `promtool check metrics`) names the family as its samples,
    /// so the `# HELP` and `# TYPE` lines of counters gain the suffix.
    pub fn render(&self, out: &mut String) -> std::fmt::Result {
        let mut open_metrics = String::new();
        prometheus_client::encoding::text::encode_registry(&mut open_metrics, &self.0.registry)?;
        let counters: Vec<&str> = open_metrics
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
            .collect();
        for line in open_metrics.lines() {
            let renamed = ["# HELP ", "# TYPE "].iter().find_map(|tag| {
                let rest = line.strip_prefix(tag)?;
                let (name, tail) = rest.split_once(' ')?;
                counters
                    .contains(&name)
                    .then(|| format!("{tag}{name}_total {tail}"))
            });
            match renamed {
                Some(l) => out.push_str(&l),
                None => out.push_str(line),
            }
            out.push('\n');
        }
        Ok(())
    }
}

impl payfleet_queue::RunObserver for Telemetry {
    fn run_ended(&self, run: &payfleet_queue::RunReport<'_>) {
        self.0
            .job_runs
            .get_or_create(&JobLabels {
                queue: run.queue.to_owned(),
                kind: run.kind.to_owned(),
                outcome: run.outcome.as_str(),
            })
            .observe(run.took.as_secs_f64());
        self.0
            .job_delay
            .get_or_create(&QueueLabels {
                queue: run.queue.to_owned(),
            })
            .observe(run.waited.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counters are rendered as the classic text format names them: the family as its samples.
    #[test]
    fn counter_families_carry_their_samples_suffix() {
        let t = Telemetry::default();
        t.rpc_call("coins", RpcResult::Timeout);
        let mut text = String::new();
        t.render(&mut text).unwrap();
        assert!(
            text.contains("# TYPE payfleet_rpc_calls_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP payfleet_rpc_calls_total RPC calls"),
            "{text}"
        );
        assert!(
            text.contains("payfleet_rpc_calls_total{rpc=\"coins\",result=\"timeout\"} 1\n"),
            "{text}"
        );
    }
}
