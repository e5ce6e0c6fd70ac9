//! The order messages' outbox: `order_events`, written in the transaction of the change it
//! reports ([`super::record_event`], and checkout's numbering statement for `created`), and
//! read here alone. The relay (`messaging::orders`) publishes what [`OrderOutbox`] gives it.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use crate::messaging::orders::{self as messages, Outbox, Unpublished};

/// Up to $1 new order messages and a quarter as many the broker refused whose next attempt is
/// due, oldest first, locked (skipping those another relay holds), each with its order. Each
/// kind is read through its own index (`order_events_to_publish`, `order_events_put_off`), so
/// messages put off, however many, are never walked past to find the new ones. The messages are
/// taken before they are joined to their orders: written as one join with the limit last, a
/// plan that finds the unpublished rows through a bitmap (the one the planner picks while its
/// statistics still count few of them, as in a drained backlog or after a broker outage) joined
/// every waiting message to its order and sorted them all to keep 200: a read's work grew with
/// the backlog it was there to clear (README, "The relay reads what it takes").
pub const TAKE: &str = "WITH fresh AS (
         SELECT id, order_id, kind, payload, created_at, traceparent FROM order_events
         WHERE published_at IS NULL AND publish_after IS NULL
         ORDER BY id LIMIT $1
         FOR UPDATE SKIP LOCKED),
     due AS (
         SELECT id, order_id, kind, payload, created_at, traceparent FROM order_events
         WHERE published_at IS NULL AND publish_after IS NOT NULL AND publish_after <= now()
         ORDER BY publish_after LIMIT $1 / 4
         FOR UPDATE SKIP LOCKED)
     SELECT e.id, e.kind, e.payload, e.created_at, e.traceparent, o.number, o.kind AS order_kind,
            o.seller_id::text AS seller_id, o.buyer_id, o.total, o.currency::text AS currency
     FROM (SELECT * FROM fresh UNION ALL SELECT * FROM due) e
     JOIN orders o ON o.id = e.order_id
     ORDER BY e.id";

/// The order side's outbox, as the relay reads it.
#[derive(Debug, Clone, Copy, Default)]
pub struct OrderOutbox;

/// Marks the rows a relay published. An array the planner cannot see into: the literal one was
/// sized as most of a table without statistics, and every mark read all the order messages.
/// Planned while the outbox was small, it still scanned the table whole: the relay's
/// transaction begins with sequential scans off (`db::BEGIN_BY_KEYS`).
const MARK_PUBLISHED: &str = "UPDATE order_events SET published_at = now() WHERE id = ANY(ARRAY(SELECT unnest($1::bigint[])))";

impl Outbox for OrderOutbox {
    async fn take(&self, tx: &mut PgConnection, max: i64) -> Result<Vec<Unpublished>, sqlx::Error> {
        sqlx::query_as(TAKE).bind(max).fetch_all(&mut *tx).await
    }

    async fn mark_published(&self, tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
        sqlx::query(MARK_PUBLISHED)
            .bind(ids)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn put_off(
        &self,
        tx: &mut PgConnection,
        refused: &[(i64, String)],
    ) -> Result<(), sqlx::Error> {
        let (ids, errors): (Vec<i64>, Vec<&str>) =
            refused.iter().map(|(id, e)| (*id, e.as_str())).unzip();
        sqlx::query(PUT_OFF)
            .bind(&ids)
            .bind(&errors)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn publish_again(&self, tx: &mut PgConnection, id: i64) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(SEND_AGAIN).bind(id).execute(&mut *tx).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn written_at(
        &self,
        tx: &mut PgConnection,
        id: i64,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, sqlx::Error> {
        sqlx::query_scalar("SELECT created_at FROM order_events WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
    }
}

/// Counts a refusal of each row and puts it off: 2 s after the first, doubling up to two
/// minutes, so the rows behind a message the broker keeps refusing are taken meanwhile, a queue
/// refusing for an hour costs each of its messages thirty more tries, not hundreds, and messages
/// a whole broker refused (a quorum queue without its majority) go within two minutes of its
/// taking them again (`payfleet messages send --refused`: at once).
const PUT_OFF: &str = "UPDATE order_events e
     SET publish_attempts = e.publish_attempts + 1, publish_error = x.error,
         publish_after = now() + make_interval(secs => least(power(2, least(e.publish_attempts + 1, 20)), 120))
     FROM unnest($1::bigint[], $2::text[]) AS x(id, error)
     WHERE e.id = x.id";

/// Makes rows new again, published or not, their refusals forgotten: the relay sends them with
/// its next batch.
const SEND_AGAIN: &str = "UPDATE order_events
     SET published_at = NULL, publish_after = NULL, publish_attempts = 0, publish_error = NULL
     WHERE id = $1";

/// The same for every message the broker refused that is still unpublished.
const SEND_REFUSED: &str = "UPDATE order_events
     SET publish_after = NULL, publish_attempts = 0, publish_error = NULL
     WHERE published_at IS NULL AND publish_after IS NOT NULL";

/// An order message not yet confirmed by the broker, as an operator sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Waiting {
    pub message_id: String,
    pub routing_key: String,
    pub order_number: i64,
    pub created_at: DateTime<Utc>,
    /// How often the broker refused it.
    pub attempts: i32,
    /// The broker's last answer, when it refused it.
    pub last_error: Option<String>,
    /// When the relay takes it again, if it is put off.
    pub next_attempt: Option<DateTime<Utc>>,
}

/// The order messages not yet confirmed by the broker, oldest first.
pub async fn unpublished(pool: &PgPool, limit: i64) -> Result<Vec<Waiting>, sqlx::Error> {
    waiting(pool, limit, 0, None).await
}

/// Refusals in a row after which a message written more than the grace period ago is a finding:
/// refused by the broker on every attempt, not once by a blip.
const REFUSED_FINDING: i32 = 3;

/// The order messages the broker refused on [`REFUSED_FINDING`] attempts in a row or more,
/// written more than `grace` ago and still unpublished, oldest first.
pub async fn refused_since(
    pool: &PgPool,
    grace: std::time::Duration,
) -> Result<Vec<Waiting>, sqlx::Error> {
    waiting(pool, 1000, REFUSED_FINDING, Some(grace.as_secs_f64())).await
}

/// Up to `limit` unpublished order messages refused at least `min_attempts` times, written more
/// than `older_than_secs` ago if given: the new ones and the put-off ones each read through
/// their own index (`TAKE`), a refused one being put off until it is published or sent again.
async fn waiting(
    pool: &PgPool,
    limit: i64,
    min_attempts: i32,
    older_than_secs: Option<f64>,
) -> Result<Vec<Waiting>, sqlx::Error> {
    type Row = (
        i64,
        String,
        String,
        i64,
        DateTime<Utc>,
        i32,
        Option<String>,
        Option<DateTime<Utc>>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT e.id, e.kind, o.kind, o.number, e.created_at, e.publish_attempts, e.publish_error,
                e.publish_after
         FROM ((SELECT * FROM order_events
                WHERE published_at IS NULL AND publish_after IS NULL AND $2 = 0
                  AND ($3::float8 IS NULL OR created_at < now() - make_interval(secs => $3))
                ORDER BY id LIMIT $1)
               UNION ALL
               (SELECT * FROM order_events
                WHERE published_at IS NULL AND publish_after IS NOT NULL AND publish_attempts >= $2
                  AND ($3::float8 IS NULL OR created_at < now() - make_interval(secs => $3))
                ORDER BY id LIMIT $1)
               ORDER BY id LIMIT $1) e
         JOIN orders o ON o.id = e.order_id
         ORDER BY e.id",
    )
    .bind(limit)
    .bind(min_attempts)
    .bind(older_than_secs)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(
                id,
                event,
                order_kind,
                order_number,
                created_at,
                attempts,
                last_error,
                next_attempt,
            )| {
                Waiting {
                    message_id: messages::message_id(id),
                    routing_key: messages::routing_key(&order_kind, &event),
                    order_number,
                    created_at,
                    attempts,
                    last_error,
                    next_attempt,
                }
            },
        )
        .collect())
}

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("{0} is not an order message's id (they read order-event-<number>)")]
    NotAnOrderMessage(String),
    #[error("there is no order message {0}")]
    Unknown(String),
    #[error(
        "message {message_id} was written at {written_at} and published, longer ago than the consumers keep their records of the messages they handled: one that handled it would handle it again; send it with --force only once every consumer's side is checked"
    )]
    OlderThanRecords {
        message_id: String,
        written_at: chrono::DateTime<chrono::Utc>,
    },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Sends every message the broker refused now, without waiting for their next attempts (once
/// the cause is gone); returns how many.
pub async fn send_refused_now(pool: &PgPool) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(SEND_REFUSED)
        .execute(pool)
        .await?
        .rows_affected())
}

/// Sends an order message now: one the broker refused, without waiting for its next attempt
/// (once its cause is gone), or one published already, again (to a service that binds its type
/// since; a consumer that handled it drops it by its id, for as long as it keeps its records:
/// one published longer ago is sent again only with `force`).
pub async fn send_now(pool: &PgPool, message_id: &str, force: bool) -> Result<(), SendError> {
    let id = messages::outbox_id(message_id)
        .ok_or_else(|| SendError::NotAnOrderMessage(message_id.to_owned()))?;
    // A consumer keeps its record from the message's first handling (a repeat does not
    // renew it): a message published before is judged by when it was written, not by its
    // latest publishing. One never published (refused) reached no consumer.
    let written_at: Option<Option<chrono::DateTime<chrono::Utc>>> = sqlx::query_scalar(
        "SELECT CASE WHEN published_at IS NOT NULL THEN created_at END FROM order_events WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    if let Some(Some(written_at)) = written_at
        && messages::older_than_records(written_at)
        && !force
    {
        return Err(SendError::OlderThanRecords {
            message_id: message_id.to_owned(),
            written_at,
        });
    }
    let done = sqlx::query(SEND_AGAIN).bind(id).execute(pool).await?;
    if done.rows_affected() == 0 {
        return Err(SendError::Unknown(message_id.to_owned()));
    }
    Ok(())
}

/// The outbox's backlog, for the gauges and the dashboard.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct Backlog {
    /// Messages not yet confirmed by the broker.
    pub unpublished: i64,
    /// The age of the oldest of them, in seconds.
    pub oldest_secs: f64,
    /// Those the broker refused, each put off until its next attempt.
    pub refused: i64,
}

pub async fn backlog(pool: &PgPool) -> Result<Backlog, sqlx::Error> {
    // Each kind through its own index (`TAKE`).
    sqlx::query_as(
        "SELECT f.n + p.n AS unpublished,
                COALESCE(EXTRACT(EPOCH FROM now() - least(f.oldest, p.oldest))::float8, 0) AS oldest_secs,
                p.n AS refused
         FROM (SELECT count(*) AS n, min(created_at) AS oldest FROM order_events
               WHERE published_at IS NULL AND publish_after IS NULL) f,
              (SELECT count(*) AS n, min(created_at) AS oldest FROM order_events
               WHERE published_at IS NULL AND publish_after IS NOT NULL) p",
    )
    .fetch_one(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generic plan of [`MARK_PUBLISHED`] made in a transaction begun with `begin`.
    async fn mark_plan(pool: &PgPool, begin: &str) -> String {
        crate::db::generic_plan(
            pool,
            begin,
            &format!("(bigint[]) AS {MARK_PUBLISHED}"),
            "('{1}')",
        )
        .await
    }

    /// Planned while the outbox was small (here: empty, and its statistics say so, as after an
    /// automatic analyze on a new database), a relay's mark read every order message; in the
    /// relay's transaction it finds each by its key.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_mark_planned_on_a_small_outbox_finds_its_rows_by_key(pool: PgPool) {
        sqlx::query("ANALYZE order_events")
            .execute(&pool)
            .await
            .unwrap();
        let scanning = mark_plan(&pool, "BEGIN").await;
        assert!(
            scanning.contains("Seq Scan on order_events"),
            "the hazard: on an empty table the generic plan scans it\n{scanning}"
        );
        let relay = mark_plan(&pool, crate::db::BEGIN_BY_KEYS).await;
        assert!(!relay.contains("Seq Scan"), "{relay}");
        assert!(relay.contains("order_events_pkey"), "{relay}");
    }
}
