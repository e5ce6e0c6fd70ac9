//! An apalis worker on payfleet's queue: apalis handlers and tower layers (tracing, timeout,
//! concurrency), payfleet's claims, leases, stored backoff and replace-by-key.
//!
//! ```sh
//! cargo run --example apalis_worker   # DATABASE_URL, else the local payfleet database
//! ```
//!
//! It pushes five receipts (one of them twice under the same key: the second replaces the
//! first), runs a worker until the queue is drained, and prints what ran. The second receipt
//! fails its first attempt and runs again after payfleet's stored backoff (about 2 s).

use std::time::Duration;

use apalis::layers::WorkerBuilderExt;
use apalis_core::backend::TaskSink;
use apalis_core::error::BoxDynError;
use apalis_core::task::attempt::Attempt;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::worker::builder::WorkerBuilder;
use payfleet_queue::apalis::{PayfleetBackend, Settings};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SendReceipt {
    order: i64,
    email: String,
}

async fn send_receipt(receipt: SendReceipt, attempt: Attempt) -> Result<(), BoxDynError> {
    if receipt.order == 2 && attempt.current() == 1 {
        return Err("the mail server is busy".into());
    }
    println!(
        "receipt for order {} sent to {} (attempt {})",
        receipt.order,
        receipt.email,
        attempt.current()
    );
    Ok(())
}

/// Returns once no job of the queue is left to run.
async fn stop_when_drained(pool: &PgPool) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let left: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE queue = 'receipts' AND state IN ('available', 'retryable', 'running')",
        )
        .fetch_one(pool)
        .await;
        if matches!(left, Ok(0)) {
            return;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The local database `payfleet up` uses, unless told otherwise.
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/payfleet".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .connect(&url)
        .await?;
    payfleet_queue::pg::migrate(&pool).await?;

    let backend = PayfleetBackend::<SendReceipt>::new(
        pool.clone(),
        Settings::new("receipts", "send_receipt"),
    );
    let mut sink = backend.clone();
    for order in 1..=5 {
        let receipt = SendReceipt {
            order,
            email: format!("buyer{order}@example.com"),
        };
        sink.push_task(
            TaskBuilder::new(receipt)
                .idempotency_key(format!("receipt:{order}"))
                .build(),
        )
        .await?;
    }
    // The same key again, with a corrected address: it replaces the waiting job.
    sink.push_task(
        TaskBuilder::new(SendReceipt {
            order: 5,
            email: "corrected@example.com".into(),
        })
        .idempotency_key("receipt:5")
        .build(),
    )
    .await?;

    let worker = WorkerBuilder::new("receipts-1")
        .backend(backend)
        .enable_tracing()
        .timeout(Duration::from_secs(10))
        .concurrency(4)
        .build(send_receipt);
    worker
        .run_with_ctx(move |ctx| {
            let pool = pool.clone();
            async move {
                stop_when_drained(&pool).await;
                ctx.stop()
            }
        })
        .await?;
    Ok(())
}
