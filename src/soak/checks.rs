//! What the soak checks once the fleet has settled: each row a promise, how many things it
//! looked at, and every violation found. The money rows compare the database with the soak's
//! own model (`super::model`), never with a computation of the library's.

use std::collections::{BTreeMap, HashMap};

use rust_decimal::Decimal;
use sqlx::PgPool;

use super::api::{Api, Who};
use super::model::{self, Fate, Model};

/// The table the soak's consumer of order messages writes, a row per handling (so a message
/// handled twice shows as two).
pub async fn prepare(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE soak_received (consumer text NOT NULL, message_id text NOT NULL,
                                     routing_key text NOT NULL, at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    sqlx::query("CREATE INDEX soak_received_message ON soak_received (message_id)")
        .execute(pool)
        .await?;
    Ok(())
}

/// One line of the table.
pub struct Row {
    pub name: &'static str,
    pub count: usize,
    pub violations: Vec<String>,
}

impl Row {
    fn new(name: &'static str, count: usize, violations: Vec<String>) -> Self {
        Self {
            name,
            count,
            violations,
        }
    }
}

/// Per order: paid or not, its sale credits and its `paid` order events.
struct Booked {
    paid: bool,
    sales: i64,
    confirmations: i64,
    status: String,
}

pub struct Inputs<'a> {
    pub pool: &'a PgPool,
    pub api: &'a Api,
    pub model: &'a Model,
    pub failures: &'a [String],
    pub journeys: usize,
    pub subscriptions: &'a [String],
    pub crashes: &'a [String],
    pub fee_percent: Decimal,
}

pub async fn run(i: Inputs<'_>) -> anyhow::Result<Vec<Row>> {
    let pool = i.pool;
    let mut rows = vec![
        Row::new(
            "journeys ran as the API states",
            i.journeys,
            i.failures.to_vec(),
        ),
        Row::new(
            "checkouts priced by the rules (coupons, fee, net)",
            i.model.orders.len(),
            i.model.surprises.clone(),
        ),
        Row::new(
            "a repeated Idempotency-Key answers the same orders",
            i.model.repeats,
            i.model.repeats_differing.clone(),
        ),
        Row::new(
            "fleet processes ended only when told",
            0,
            i.crashes.to_vec(),
        ),
    ];

    // Every order, as the database has it.
    let booked: HashMap<i64, Booked> = sqlx::query_as::<_, (i64, bool, i64, i64, String)>(
        "SELECT o.number, o.paid_at IS NOT NULL, COALESCE(s.n, 0), COALESCE(e.n, 0), o.status
         FROM orders o
         LEFT JOIN (SELECT order_number, count(*) AS n FROM ledger_transfers
                    WHERE kind = 'sale_credit' GROUP BY order_number) s ON s.order_number = o.number
         LEFT JOIN (SELECT order_id, count(*) AS n FROM order_events
                    WHERE kind = 'paid' GROUP BY order_id) e ON e.order_id = o.id",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|(n, paid, sales, confirmations, status)| {
        (
            n,
            Booked {
                paid,
                sales,
                confirmations,
                status,
            },
        )
    })
    .collect();
    let paid = |n: i64| booked.get(&n).is_some_and(|b| b.paid);

    // 1. Every paid order confirmed once; no sale for one that was not.
    let mut v = Vec::new();
    let mut in_doubt = 0;
    for o in i.model.orders.values() {
        let Some(b) = booked.get(&o.number) else {
            v.push(format!("order {} is not in the database", o.number));
            continue;
        };
        let expected_paid = match o.fate {
            Fate::Paid => true,
            Fate::Unpaid => false,
            Fate::InDoubt => {
                in_doubt += 1;
                b.paid
            }
        };
        if b.paid != expected_paid {
            v.push(format!(
                "order {}: the soak expected it {}, it is {}",
                o.number,
                if expected_paid { "paid" } else { "unpaid" },
                b.status
            ));
        }
    }
    for (n, b) in &booked {
        if b.sales != i64::from(b.paid) || b.confirmations != i64::from(b.paid) {
            v.push(format!(
                "order {n} ({}): {} sale credits, confirmed {} times",
                b.status, b.sales, b.confirmations
            ));
        }
    }
    rows.push(Row::new(
        "paid orders confirmed once, one sale each; none for an unpaid one",
        booked.len(),
        v,
    ));
    if in_doubt > 0 {
        rows.push(Row::new(
            "  (of which paid at their expiry: either outcome, its money checked)",
            in_doubt,
            Vec::new(),
        ));
    }

    // 2. Subscriptions: each paid renewal one sale; the renewals go into the sellers' model.
    let mut v = Vec::new();
    let mut renewals: BTreeMap<String, Decimal> = BTreeMap::new();
    let mut renewal_count = 0;
    for id in i.subscriptions {
        let a = i
            .api
            .get(&format!("/subscriptions/{id}"), Who::Backend)
            .await?;
        if !a.ok() {
            v.push(format!("subscription {id}: {} {}", a.status, a.body));
            continue;
        }
        let seller = a.body["seller_id"].as_str().unwrap_or_default().to_owned();
        let price: Decimal = a.body["amount"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_default();
        let mut periods = std::collections::HashSet::new();
        for r in a.body["renewals"].as_array().cloned().unwrap_or_default() {
            renewal_count += 1;
            let number = r["order_number"].as_i64().unwrap_or_default();
            if !periods.insert(r["period_start"].to_string()) {
                v.push(format!(
                    "subscription {id}: two renewals of period {}",
                    r["period_start"]
                ));
            }
            let b = booked.get(&number);
            match (r["state"].as_str(), b) {
                (Some("paid"), Some(b)) if b.paid && b.sales == 1 => {
                    *renewals.entry(seller.clone()).or_default() +=
                        model::price(&[(price, 1)], None, true, i.fee_percent).net;
                }
                (Some("paid"), _) => v.push(format!(
                    "subscription {id}: renewal order {number} is paid without its one sale"
                )),
                (_, Some(b)) if b.sales > 0 => v.push(format!(
                    "subscription {id}: renewal order {number} ({}) has a sale",
                    b.status
                )),
                _ => {}
            }
        }
        if a.body["status"] != "canceled" {
            v.push(format!(
                "subscription {id} is {} after being canceled",
                a.body["status"]
            ));
        }
    }
    rows.push(Row::new(
        "subscription renewals: one order and one sale per period",
        renewal_count,
        v,
    ));

    // 3. Each seller's money: what it holds (pending, available) and what it was paid out (or
    // is being paid), against the model.
    let mut expected = i.model.sellers(&paid);
    for (seller, extra) in renewals {
        *expected.entry(seller).or_default() += extra;
    }
    let held: HashMap<String, Decimal> = sqlx::query_as::<_, (String, Decimal)>(
        "SELECT owner, sum(balance) FROM ledger_accounts
         WHERE kind IN ('seller_pending', 'seller_available') AND currency = 'BRL' GROUP BY owner",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let paid_out: HashMap<String, Decimal> = sqlx::query_as::<_, (String, Decimal)>(
        "SELECT seller_id::text, sum(amount) FROM payouts WHERE state IN ('pending', 'paid') AND currency = 'BRL' GROUP BY seller_id",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let mut v = Vec::new();
    for (seller, want) in &expected {
        let has = held.get(seller).copied().unwrap_or_default()
            + paid_out.get(seller).copied().unwrap_or_default();
        if has != *want {
            v.push(format!(
                "seller {seller}: the ledger holds and paid out {has}, the model says {want}"
            ));
        }
    }
    rows.push(Row::new(
        "each seller's balances and payouts equal the model",
        expected.len(),
        v,
    ));

    // 4. The ledger's own sums.
    let (accounts, currencies) = payfleet::ledger::check(pool).await?;
    let mut v: Vec<String> = accounts
        .iter()
        .map(|a| format!("account {a}: entries do not sum to its balance"))
        .collect();
    v.extend(
        currencies
            .iter()
            .map(|c| format!("currency {c}: balances do not sum to zero")),
    );
    let transfers: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_transfers")
        .fetch_one(pool)
        .await?;
    rows.push(Row::new(
        "entries sum to balances, transfers to zero",
        usize::try_from(transfers).unwrap_or_default(),
        v,
    ));

    // 5. Never more taken back than paid.
    let over: Vec<(i64, Decimal, Decimal)> = sqlx::query_as(
        "SELECT o.number, o.total, COALESCE(sum(CASE WHEN t.kind IN ('refund_debit', 'fee_refund', 'dispute_debit', 'dispute_fee_debit') THEN t.amount
                                                   WHEN t.kind IN ('dispute_reversal', 'dispute_fee_reversal') THEN -t.amount END), 0) AS taken
         FROM orders o JOIN ledger_transfers t ON t.order_number = o.number
         GROUP BY o.number, o.total HAVING COALESCE(sum(CASE WHEN t.kind IN ('refund_debit', 'fee_refund', 'dispute_debit', 'dispute_fee_debit') THEN t.amount
                                                   WHEN t.kind IN ('dispute_reversal', 'dispute_fee_reversal') THEN -t.amount END), 0) > o.total",
    )
    .fetch_all(pool)
    .await?;
    let taken_back = i
        .model
        .orders
        .values()
        .filter(|o| !o.refunds.is_empty() || !o.disputes.is_empty())
        .count();
    rows.push(Row::new(
        "refunds plus lost disputes never above the payment",
        taken_back,
        over.iter()
            .map(|(n, total, taken)| format!("order {n}: {taken} taken back of {total}"))
            .collect(),
    ));

    // 6. Every payment the gateway took either is its order's payment or was given back whole,
    // once; and none was refunded beyond itself.
    let payments: Vec<(String, i64, Decimal, bool, Decimal, i64)> = sqlx::query_as(
        "SELECT p.session_id, p.order_number, p.amount,
                bool_or(o.paid_at IS NOT NULL AND o.session_id = p.session_id) IS TRUE,
                COALESCE(sum(r.amount), 0), count(r.refund_id)
         FROM internal_payments p
         LEFT JOIN orders o ON o.number = p.order_number
         LEFT JOIN internal_refunds r ON r.session_id = p.session_id
                                     AND (r.payment_id IS NULL OR r.payment_id = p.payment_id)
         WHERE p.status = 'succeeded'
         GROUP BY p.session_id, p.order_number, p.amount",
    )
    .fetch_all(pool)
    .await?;
    let mut v = Vec::new();
    for (session, number, amount, took, refunded, _) in &payments {
        if refunded > amount {
            v.push(format!(
                "session {session} (order {number}): {refunded} refunded of {amount}"
            ));
        }
        if !took && refunded != amount {
            v.push(format!("session {session} (order {number}): no order took it, {refunded} of {amount} given back"));
        }
    }
    // A late payment (the page's, or one only a signed event reported): its order ended unpaid,
    // so everything the session took is given back, in one refund.
    for o in i.model.orders.values().filter(|o| !paid(o.number)) {
        for (session, amount) in &o.given_back {
            let (refunded, count): (Decimal, i64) = sqlx::query_as(
                "SELECT COALESCE(sum(amount), 0), count(*) FROM internal_refunds WHERE session_id = $1",
            )
            .bind(session)
            .fetch_one(pool)
            .await?;
            if refunded != *amount || count != 1 {
                v.push(format!("order {}: its late payment on {session} given back in {count} refunds, {refunded} of {amount}", o.number));
            }
        }
    }
    let seconds: Vec<(String, String, Option<Decimal>, Decimal)> = sqlx::query_as(
        "SELECT session_id, payment_id, amount, amount_refunded FROM second_payments",
    )
    .fetch_all(pool)
    .await?;
    for (session, payment, amount, refunded) in &seconds {
        if amount.is_some_and(|a| a != *refunded) {
            v.push(format!(
                "second payment {payment} of session {session}: {refunded} of {amount:?} given back"
            ));
        }
    }
    rows.push(Row::new(
        "payments no order took given back whole, once",
        payments.len() + seconds.len(),
        v,
    ));

    // 7. Coins.
    let expected = i.model.wallets(&paid);
    let wallets: HashMap<String, Decimal> = sqlx::query_as::<_, (String, Decimal)>(
        "SELECT owner, balance FROM ledger_accounts WHERE kind = 'buyer_wallet' AND currency = 'BRL'",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let mut v = Vec::new();
    for (buyer, want) in &expected {
        let has = wallets.get(buyer).copied().unwrap_or_default();
        if has != *want {
            v.push(format!(
                "buyer {buyer}: wallet holds {has}, the model says {want}"
            ));
        }
        if has < Decimal::ZERO {
            v.push(format!("buyer {buyer}: wallet below zero ({has})"));
        }
    }
    let leaked: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT id, order_number FROM coin_reservations WHERE state = 'reserved'")
            .fetch_all(pool)
            .await?;
    v.extend(
        leaked
            .iter()
            .map(|(id, n)| format!("reservation {id} (order {n:?}) still held")),
    );
    let reserved: Vec<(String, Decimal)> = sqlx::query_as(
        "SELECT owner, balance FROM ledger_accounts WHERE kind = 'coins_reserved' AND balance <> 0",
    )
    .fetch_all(pool)
    .await?;
    v.extend(
        reserved
            .iter()
            .map(|(o, b)| format!("{o}: {b} coins reserved with nothing in flight")),
    );
    rows.push(Row::new(
        "coin wallets equal the model; none negative, no reservation leaked",
        expected.len(),
        v,
    ));

    // 8. Payouts and invoices.
    let twice: Vec<(String, String)> = sqlx::query_as(
        "SELECT seller_id::text, period_start::text FROM payouts GROUP BY seller_id, currency, period_start HAVING count(*) > 1",
    )
    .fetch_all(pool)
    .await?;
    let payouts: i64 = sqlx::query_scalar("SELECT count(*) FROM payouts")
        .fetch_one(pool)
        .await?;
    rows.push(Row::new(
        "one payout per seller and period",
        usize::try_from(payouts).unwrap_or_default(),
        twice
            .iter()
            .map(|(s, p)| format!("seller {s}: two payouts for the period of {p}"))
            .collect(),
    ));
    let numbers: Vec<i64> = sqlx::query_scalar("SELECT number FROM invoices ORDER BY number")
        .fetch_all(pool)
        .await?;
    let gaps: Vec<String> = numbers
        .iter()
        .enumerate()
        .filter(|(k, n)| **n != *k as i64 + 1)
        .take(5)
        .map(|(k, n)| format!("invoice #{} is numbered {n}", k + 1))
        .collect();
    rows.push(Row::new(
        "invoice numbers without gaps",
        numbers.len(),
        gaps,
    ));

    // 9. Nothing left behind.
    let unprocessed = payfleet::payments::events::unprocessed(pool, 50).await?;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(pool)
        .await?;
    rows.push(Row::new(
        "every stored event processed",
        usize::try_from(events).unwrap_or_default(),
        unprocessed
            .iter()
            .map(|e| {
                format!(
                    "event {} ({} {}): {} {}",
                    e.id,
                    e.gateway,
                    e.event_id,
                    e.state(),
                    e.detail.clone().unwrap_or_default()
                )
            })
            .collect(),
    ));
    let stuck: Vec<(i64, String, String, i32, String)> = sqlx::query_as(
        "SELECT id, kind, state, attempt, COALESCE(errors -> -1 ->> 'error', '') FROM jobs
         WHERE state IN ('discarded', 'retryable')
            OR (state = 'running' AND lease_expires_at < now())
            OR (state = 'available' AND run_at < now() - interval '30 seconds')
         ORDER BY id LIMIT 50",
    )
    .fetch_all(pool)
    .await?;
    let jobs: i64 = sqlx::query_scalar("SELECT last_value FROM jobs_id_seq")
        .fetch_one(pool)
        .await?;
    rows.push(Row::new(
        "no job dead, stuck or still retrying",
        usize::try_from(jobs).unwrap_or_default(),
        stuck
            .iter()
            .map(|(id, kind, state, attempt, err)| {
                format!("job {id} {kind} {state} after {attempt} attempts: {err}")
            })
            .collect(),
    ));

    // 10. Order messages: every one published, and handled once by the soak's consumer.
    let messages: Vec<(String, bool, i64)> = sqlx::query_as(
        "SELECT 'order-event-' || e.id, e.published_at IS NOT NULL, COALESCE(r.n, 0)
         FROM order_events e
         LEFT JOIN (SELECT message_id, count(*) AS n FROM soak_received GROUP BY message_id) r
                ON r.message_id = 'order-event-' || e.id",
    )
    .fetch_all(pool)
    .await?;
    let mut v = Vec::new();
    for (id, published, received) in &messages {
        if !published {
            v.push(format!("{id} never published"));
        } else if *received != 1 {
            v.push(format!("{id} handled {received} times"));
        }
    }
    let strays: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM soak_received r WHERE NOT EXISTS (
             SELECT 1 FROM order_events e WHERE 'order-event-' || e.id = r.message_id)",
    )
    .fetch_all(pool)
    .await?;
    v.extend(
        strays
            .iter()
            .map(|m| format!("{m} handled, but no order event made it")),
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM message_failures")
        .fetch_one(pool)
        .await?;
    if dead > 0 {
        v.push(format!("{dead} messages dead in message_failures"));
    }
    rows.push(Row::new(
        "order messages published and handled once each",
        messages.len(),
        v,
    ));

    // 11. The fleet's own invariants.
    payfleet::consistency::run(pool, std::time::Duration::ZERO).await?;
    let findings = payfleet::consistency::open(pool, 50).await?;
    rows.push(Row::new(
        "no open consistency finding",
        findings.len(),
        findings
            .iter()
            .map(|f| format!("{} {}: {}", f.check_name, f.subject, f.detail))
            .collect(),
    ));
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::model::{Order, Priced};

    fn inputs<'a>(pool: &'a PgPool, api: &'a Api, model: &'a Model) -> Inputs<'a> {
        Inputs {
            pool,
            api,
            model,
            failures: &[],
            journeys: 0,
            subscriptions: &[],
            crashes: &[],
            fee_percent: Decimal::TEN,
        }
    }

    fn violations<'a>(rows: &'a [Row], name: &str) -> &'a [String] {
        &rows
            .iter()
            .find(|r| r.name.starts_with(name))
            .expect(name)
            .violations
    }

    /// The checks hold on a fleet that did nothing, and find a paid order the database never
    /// confirmed, and the seller's money it lacks.
    #[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
    async fn the_checks_find_what_the_database_lacks(pool: PgPool) {
        payfleet::tls::install_provider();
        prepare(&pool).await.unwrap();
        let (secret, _) = payfleet::secret::StandardSecret::generate();
        let api = Api::new(
            "http://127.0.0.1:9".into(),
            String::new(),
            String::new(),
            secret,
        )
        .unwrap();
        let mut model = Model::default();
        let rows = run(inputs(&pool, &api, &model)).await.unwrap();
        let found: Vec<&String> = rows.iter().flat_map(|r| &r.violations).collect();
        assert!(found.is_empty(), "{found:?}");

        let total = Decimal::new(1990, 2);
        model.orders.insert(
            7,
            Order {
                number: 7,
                seller: "s1".into(),
                buyer: "b1".into(),
                priced: Priced {
                    subtotal: total,
                    discount: Decimal::ZERO,
                    total,
                    fee: Decimal::new(199, 2),
                    net: Decimal::new(1791, 2),
                },
                fate: Fate::Paid,
                with_coins: false,
                refunds: vec![Decimal::new(500, 2)],
                disputes: Vec::new(),
                given_back: Vec::new(),
            },
        );
        let rows = run(inputs(&pool, &api, &model)).await.unwrap();
        assert_eq!(
            violations(&rows, "paid orders confirmed once"),
            ["order 7 is not in the database"]
        );
        // 17.91 less 5.00 × 17.91 / 19.90 = 4.50: 13.41 owed.
        assert_eq!(
            violations(&rows, "each seller's balances"),
            ["seller s1: the ledger holds and paid out 0, the model says 13.41"]
        );
    }
}
