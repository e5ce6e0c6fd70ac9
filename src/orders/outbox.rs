//! The order messages' outbox: `order_events`, written in the transaction of the change it
//! reports ([`super::record_event`], and checkout's numbering statement for `created`), and
//! read here alone. The relay (`messaging::orders`) publishes what [`OrderOutbox`] gives it.

use sqlx::{PgConnection, PgPool};

use crate::messaging::orders::{Outbox, Unpublished};

/// Up to $1 unpublished order messages, oldest first, locked (skipping those another relay
/// holds), each with its order. The messages are taken before they are joined to their orders:
/// written as one join with the limit last, a plan that finds the unpublished rows through a
/// bitmap (the one the planner picks while its statistics still count few of them, as in a
/// drained backlog or after a broker outage) joined every waiting message to its order and
/// sorted them all to keep 200: a read's work grew with the backlog it was there to clear
/// (README, "The relay reads what it takes").
pub const TAKE: &str =
    "SELECT e.id, e.kind, e.payload, e.created_at, e.traceparent, o.number, o.kind AS order_kind,
            o.seller_id::text AS seller_id, o.buyer_id, o.total, o.currency::text AS currency
     FROM (SELECT id, order_id, kind, payload, created_at, traceparent FROM order_events
           WHERE published_at IS NULL
           ORDER BY id LIMIT $1
           FOR UPDATE SKIP LOCKED) e
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

    async fn publish_again(&self, tx: &mut PgConnection, id: i64) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE order_events SET published_at = NULL WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Unpublished order events and the age of the oldest, for the gauges.
pub async fn backlog(pool: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at))::float8, 0)
         FROM order_events WHERE published_at IS NULL",
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
