//! Process counters for `/metrics`, in the Prometheus text format. Queue depths are read from
//! the database at scrape time, so every process reports the same fleet-wide numbers.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::PgPool;

use crate::gateways::GatewayName;
use crate::webhooks::Stored;

static WEBHOOKS: [[AtomicU64; 2]; 5] = [const { [const { AtomicU64::new(0) }; 2] }; 5];

pub fn webhook_received(gateway: GatewayName, status: Stored) {
    let g = GatewayName::ALL
        .iter()
        .position(|x| *x == gateway)
        .unwrap_or(0);
    let s = match status {
        Stored::Accepted => 0,
        Stored::Duplicate => 1,
    };
    WEBHOOKS[g][s].fetch_add(1, Ordering::Relaxed);
}

pub async fn render(pool: &PgPool) -> Result<String, sqlx::Error> {
    let mut out = String::new();
    out.push_str("# HELP payfleet_webhooks_total Verified webhooks stored (accepted) or recognised as repeats (duplicate).\n");
    out.push_str("# TYPE payfleet_webhooks_total counter\n");
    for (gi, g) in GatewayName::ALL.iter().enumerate() {
        for (si, s) in ["accepted", "duplicate"].iter().enumerate() {
            let n = WEBHOOKS[gi][si].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "payfleet_webhooks_total{{gateway=\"{g}\",status=\"{s}\"}} {n}"
            );
        }
    }
    out.push_str("# HELP payfleet_jobs Jobs by queue and state.\n# TYPE payfleet_jobs gauge\n");
    for c in crate::queue::admin::counts(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_jobs{{queue=\"{}\",state=\"{}\"}} {}",
            c.queue, c.state, c.count
        );
    }
    let unprocessed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NULL")
            .fetch_one(pool)
            .await?;
    out.push_str("# HELP payfleet_payment_events_unprocessed Stored events not yet processed.\n");
    out.push_str("# TYPE payfleet_payment_events_unprocessed gauge\n");
    let _ = writeln!(out, "payfleet_payment_events_unprocessed {unprocessed}");
    Ok(out)
}
