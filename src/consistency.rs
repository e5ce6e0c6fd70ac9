//! Consistency checks: the system's invariants, looked at by a recurring job (`consistency`).
//! Each violation is reported three ways: a log line with the ids, a row an operator can list
//! (`consistency_findings`, `GET /admin/consistency`, `payfleet consistency`), and the
//! `payfleet_consistency_violations{check}` gauge. A finding stays open while the violation
//! lasts and is resolved by the first run that no longer sees it.
//!
//! The checks (each given a grace period, so work in flight is not reported):
//! - `captured_payment_unconfirmed`: a captured payment whose order is not confirmed (nor the
//!   payment refunded or charged back), or a captured payment no checkout asked for that is not refunded;
//! - `sale_without_credit`: a paid order kept as a sale without its sale posted in the ledger
//!   (its credit, to the seller's pending balance or, paid to the seller directly, its
//!   connected one; its commission posted with it), with the ledger's reason when it refused it;
//! - `ledger_entries_differ`: an account whose entries do not sum to its balance, or a currency
//!   whose balances do not sum to zero;
//! - `coin_wallet_negative`: a coin wallet or reservation balance below zero;
//! - `taken_back_beyond_payment`: a gateway's refunds and open or lost disputes of a payment add
//!   up to more than was paid (the ledger takes back at most the payment: the rest is the
//!   platform's to recover from the gateway, not the seller's to bear twice); for a second
//!   payment on a session (given back), a dispute of money given back already;
//! - `event_unprocessed`: a stored event not processed past the grace period (pending, waiting
//!   for its payment, or rejected);
//! - `job_stuck`: a running job whose lease expired long ago (the rescue should have ended it);
//! - `dispute_undecided`: a dispute open for more than 75 days (card networks decide within
//!   that: its decision's event was likely lost; the disputed amount is held meanwhile), or a
//!   second payment's dispute open for more than a week (its give-back waits for it, and
//!   reconciliation asks only about the order's own payments' disputes);
//! - `order_message_dead`: an order message a consumer failed to handle on every attempt
//!   (`payfleet messages dead`, then `replay` once the consumer is fixed);
//! - `order_message_refused`: an order message the broker has refused three times in a row,
//!   written more than the grace period ago (a queue it is routed to full, or without its
//!   majority): the relay keeps trying it, backing off (`payfleet messages unpublished`, then
//!   `send` once the cause is gone);
//! - `refund_failed_after_done`: a refund recorded as done (the seller debited, the order
//!   refunded) that the gateway later reported failed or canceled: the buyer may not have the
//!   money back, and the platform holds it; an operator pays the buyer back another way and
//!   says so (`payfleet money refund-repaid`);
//! - `subscription_period_overdue`: a live subscription whose period ended more than a day
//!   ago with no renewal reported for the next one, paid or failed, nor its end: the gateway's
//!   invoice or cancellation event was lost (reconciliation asks Stripe and Mercado Pago
//!   about such a period's charges from two hours after its end, and found none; Razorpay is
//!   not asked), or the fleet's own billing is stuck;
//! - `payment_not_given_back`: a payment its order could not take because the order was paid
//!   already (a second payment on its session, another session's), recorded past the grace
//!   period and not given back whole (by refunds, or taken back by lost disputes), with no
//!   dispute of it open: its give-back job ended dead (a gateway's refusal, the payment's id
//!   never named) and may be deleted with the dead jobs a week later, so the payment itself is
//!   checked. `payfleet money give-back` asks the gateway again. (A late payment of an expired
//!   order is `captured_payment_unconfirmed`.)
//! - `coin_reservation_unsettled`: a buyer's coins still reserved past the grace period for an
//!   order that no longer waits for them (paid with them: to be spent; expired, cancelled or
//!   paid another way: to be given back), its `settle_coins` job having ended dead (and dead
//!   jobs are deleted after a week): `payfleet money settle-coins` settles it;
//! - `refund_under_way_too_long`: an operator's refund request still `requested` or `accepted`,
//!   its refund not recorded, three days after it last moved (one not yet asked of the gateway
//!   while a dispute of its payment is open is held on purpose, and not reported): its jobs ran out of attempts (the gateway down for
//!   hours, a refund pending for days) and its event was lost; its amount is held from the
//!   seller's payouts meanwhile. Asking for it again with its Idempotency-Key asks the gateway
//!   again (a `requested` one whose answer never came, first asked longer ago than the gateway
//!   keeps its idempotency key, is not asked: it ends `failed`, for an operator to look at the
//!   gateway: `payments::order_refunds::ASK_AGAIN_WITHIN`).
//! - `order_expiry_overdue`: an order still waiting for its payment past its expiry by more
//!   than the grace period, with no expiry job waiting: its job did not run (an operator
//!   discarded it, or it ended dead and was deleted with the dead jobs), so it would take a
//!   payment days later as its own, and keeps its coupon redemption; `POST
//!   /admin/orders/{n}/expire` expires it now. (A renewal a gateway bills has no expiry job of
//!   ours: the gateway's dunning decides it.)
//! - `refund_unconfirmed`: an operator's refund request ended `failed` because the gateway never
//!   answered within `payments::order_refunds::ASK_AGAIN_WITHIN` of its first ask, so it was
//!   not asked again: the gateway may have made the refund or not. Reported for 30 days after
//!   it ended, until a refund of the same payment and amount that no other request made is
//!   recorded since its first ask (the gateway's event records one it made); an operator looks
//!   at the gateway and, if none was made, asks for a new refund.
//! - `dispute_refund_unrecorded`: a payment (through the platform) whose disputes ended as a
//!   refund, from a week after the last ended to 30 days after, part of which only refunds
//!   recorded before them cover (migration 0088): the refund that ended them is not recorded.
//!   The payouts hold that part back until 30 days after they ended; an operator looks at the
//!   gateway for the refund, whose event records it.
//! - `payout_undecided`: a payout still waiting for the bank's answer a week after it was made
//!   ([`PAYOUT_DECIDED_WITHIN`]): its amount is in transit, neither the seller's to spend nor
//!   known to have reached them; an operator confirms it with the bank and records the answer
//!   (`POST /admin/payouts/{id}/paid` or `/failed`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::gateways::GatewayName;
use crate::orders::coin_payment::SettleCoins;
use crate::payments::RefundPayment;

/// A violation seen by a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub check: &'static str,
    /// What it is about, as ids an operator can look up ("order 42", "account 7").
    pub subject: String,
    pub detail: String,
}

/// The checks, by name.
pub const CHECKS: &[&str] = &[
    "captured_payment_unconfirmed",
    "sale_without_credit",
    "ledger_entries_differ",
    "coin_wallet_negative",
    "taken_back_beyond_payment",
    "event_unprocessed",
    "job_stuck",
    "dispute_undecided",
    "order_message_dead",
    "order_message_refused",
    "refund_failed_after_done",
    "subscription_period_overdue",
    "refund_under_way_too_long",
    "refund_unconfirmed",
    "payment_not_given_back",
    "coin_reservation_unsettled",
    "payout_undecided",
    "dispute_refund_unrecorded",
    "order_expiry_overdue",
];

/// The checks' settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long work in flight may take before the checks report it
    /// (`PAYFLEET_CONSISTENCY_GRACE_SECS`, 900).
    pub grace: Duration,
}

impl Settings {
    pub fn from_env(env: &dyn crate::env::Env) -> Result<Self, crate::env::Invalid> {
        Ok(Self {
            // At most a month: beyond what the checks' intervals hold, every run would fail.
            grace: Duration::from_secs(crate::env::parsed_within(
                env,
                "PAYFLEET_CONSISTENCY_GRACE_SECS",
                900u64,
                0..=30 * 24 * 3600,
            )?),
        })
    }
}

/// A check's rows, each an (`subject`, `detail`) its query formatted, as its violations.
fn violations(check: &'static str, rows: Vec<(String, String)>) -> impl Iterator<Item = Violation> {
    rows.into_iter().map(move |(subject, detail)| Violation {
        check,
        subject,
        detail,
    })
}

/// The keys a give-back of a payment of `gateway`'s `session` may hold: by its session, or by
/// the payment for a second payment on it.
fn give_back_keys(gateway: &str, session: &str, payment: &Option<String>) -> Vec<String> {
    let Ok(g) = gateway.parse::<GatewayName>() else {
        return Vec::new();
    };
    let mut keys = vec![RefundPayment::key_of(g, session)];
    if let Some(p) = payment {
        keys.push(RefundPayment::key_of(g, &format!("{session}:{p}")));
    }
    keys
}

/// Looks at every invariant now. `grace`: how long work in flight may take before it counts.
pub async fn check(pool: &PgPool, grace: Duration) -> Result<Vec<Violation>, sqlx::Error> {
    Ok(checked(pool, grace).await?.found)
}

/// At most this many rows a check reads at once (its statements' `LIMIT 1000`).
const CAP: usize = 1000;

/// What the checks found, and which of them read as many rows as they may: those saw only part
/// of what they would report, and a finding of theirs not seen this time may still be true.
struct Checked {
    found: Vec<Violation>,
    truncated: Vec<&'static str>,
}

/// Notes `check` as truncated when it read `read` rows, its cap.
fn note_cap(truncated: &mut Vec<&'static str>, check: &'static str, read: usize) {
    if read >= CAP {
        truncated.push(check);
    }
}

async fn checked(pool: &PgPool, grace: Duration) -> Result<Checked, sqlx::Error> {
    let grace_secs = grace.as_secs_f64();
    let mut found = Vec::new();
    let mut truncated = Vec::new();
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s, %s session %s', o.number, po.gateway, po.session_id),
                format('payment %s since %s, order %s: its event (payfleet events unprocessed) or its give-back (payfleet money give-back %s %s) did not end',
                       po.status, po.succeeded_at, o.status, po.gateway, po.session_id)
         FROM payment_orders po
         JOIN payment_sessions s ON s.gateway = po.gateway AND s.session_id = po.session_id
         JOIN order_money o ON o.number = s.order_number
         WHERE po.succeeded_at < now() - make_interval(secs => $1)
           -- Refunded, or taken back whole by a lost dispute: the buyer has the money.
           AND po.status NOT IN ('refunded', 'charged_back')
           AND o.paid_at IS NULL
         UNION ALL
         SELECT format('unmatched %s session %s', u.gateway, u.session_id),
                CASE WHEN u.given_back_at IS NULL THEN format('payment %s, no order asked for it', u.status)
                     WHEN u.status = 'disputed' THEN format('payment %s, no order could take it; given back since %s, and disputed: the dispute decides what is left to give back', u.status, u.given_back_at)
                     ELSE format('payment %s, no order could take it; given back since %s and not refunded whole: payfleet money give-back %s %s asks the gateway again',
                                 u.status, u.given_back_at, u.gateway, u.session_id) END
         FROM unmatched_payments u
         WHERE u.status IN ('succeeded', 'partially_refunded', 'disputed')
           AND u.updated_at < now() - make_interval(secs => $1)",
    )
    .bind(grace_secs)
    .fetch_all(pool)
    .await?;
    found.extend(violations("captured_payment_unconfirmed", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s', o.number),
                format('%s order paid at %s has no sale credit in the ledger%s',
                       CASE WHEN o.paid_with_coins THEN 'coins' ELSE o.gateway END, o.paid_at,
                       COALESCE(' (the ledger refused it: ' || d.failure || ')', ''))
         FROM order_money o LEFT JOIN ledger_sales_due d ON d.order_number = o.number
         WHERE o.paid_at < now() - make_interval(secs => $1)
           AND o.is_sale
           AND NOT EXISTS (SELECT 1 FROM ledger_transfers t WHERE t.source_key = 'sale:' || o.number)",
    )
    .bind(grace_secs)
    .fetch_all(pool)
    .await?;
    found.extend(violations("sale_without_credit", rows));
    let (accounts, currencies) = crate::ledger::check(pool).await?;
    for id in accounts {
        found.push(Violation {
            check: "ledger_entries_differ",
            subject: format!("account {id}"),
            detail: "its entries do not sum to its balance".into(),
        });
    }
    for c in currencies {
        found.push(Violation {
            check: "ledger_entries_differ",
            subject: format!("currency {c}"),
            detail: "its accounts' balances do not sum to zero".into(),
        });
    }
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('account %s', id), format('%s of buyer %s is %s %s', kind, owner, balance, currency)
         FROM ledger_accounts WHERE kind IN ('buyer_wallet', 'coins_reserved') AND balance < 0",
    )
    .fetch_all(pool)
    .await?;
    found.extend(violations("coin_wallet_negative", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT * FROM (
         SELECT format('%s session %s', po.gateway, po.session_id),
                format('refunds %s and disputes %s taken back of a payment of %s %s',
                       t.refunded, t.disputed, po.amount, po.currency)
         FROM payment_orders po
         CROSS JOIN LATERAL (
             SELECT COALESCE((SELECT sum(amount) FROM payment_refunds r WHERE r.payment_order_id = po.id), 0) AS refunded,
                    COALESCE((SELECT sum(amount) FROM payment_disputes d
                               WHERE d.payment_order_id = po.id AND d.status IN ('open', 'lost')), 0) AS disputed) t
         WHERE po.amount IS NOT NULL AND t.refunded + t.disputed > po.amount
         UNION ALL
         SELECT format('%s session %s, second payment %s', p.gateway, p.session_id, p.payment_id),
                format('given back %s and disputes %s taken back of a payment of %s %s: contest the disputes with the refunds',
                       p.amount_refunded, t.disputed, p.amount, p.currency)
         FROM second_payments p
         CROSS JOIN LATERAL (
             SELECT COALESCE(sum(amount), 0) AS disputed FROM second_payment_disputes d
              WHERE d.second_payment_id = p.id AND d.status IN ('open', 'lost')) t
         WHERE p.amount IS NOT NULL AND t.disputed > 0 AND p.amount_refunded + t.disputed > p.amount
         ) found ORDER BY 1 LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "taken_back_beyond_payment", rows.len());
    found.extend(violations("taken_back_beyond_payment", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('event %s (%s %s)', id, gateway, event_id),
                format('%s since %s%s', COALESCE(outcome, 'pending'), received_at,
                       COALESCE(': ' || outcome_detail, ''))
         FROM payment_events
         WHERE processed_at IS NULL AND received_at < now() - make_interval(secs => $1)
         ORDER BY id LIMIT 1000",
    )
    .bind(grace_secs)
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "event_unprocessed", rows.len());
    found.extend(violations("event_unprocessed", rows));
    let stuck = payfleet_queue::admin::stuck(pool, grace).await?;
    note_cap(&mut truncated, "job_stuck", stuck.len());
    found.extend(stuck.into_iter().map(|j| Violation {
        check: "job_stuck",
        subject: format!("job {} ({} on {})", j.id, j.kind, j.queue),
        detail: format!(
            "running on {}, lease expired at {}",
            j.locked_by.as_deref().unwrap_or("no one"),
            j.lease_expires_at.map_or_else(String::new, |t| t.to_string())
        ),
    }));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT * FROM (
         SELECT format('%s dispute %s', gateway, dispute_id),
                format('open since %s, %s %s held: ask the gateway for its decision', updated_at, amount, currency)
         FROM payment_disputes WHERE status = 'open' AND updated_at < now() - interval '75 days'
         UNION ALL
         SELECT format('%s dispute %s (of a second payment)', gateway, dispute_id),
                format('open since %s, %s %s: the give-back of that payment waits for it, and reconciliation does not ask about it: ask the gateway for its decision', updated_at, amount, currency)
         FROM second_payment_disputes WHERE status = 'open' AND updated_at < now() - interval '7 days'
         ) found ORDER BY 1 LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "dispute_undecided", rows.len());
    found.extend(violations("dispute_undecided", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('message %s for %s', message_id, consumer),
                format('%s attempts, dead since %s: %s', attempts, dead_at, last_error)
         FROM message_failures WHERE dead_at IS NOT NULL ORDER BY dead_at LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "order_message_dead", rows.len());
    found.extend(violations("order_message_dead", rows));
    let refused = crate::orders::outbox::refused_since(pool, grace).await?;
    note_cap(&mut truncated, "order_message_refused", refused.len());
    found.extend(refused.into_iter().map(|w| Violation {
        check: "order_message_refused",
        subject: format!("message {} (order {})", w.message_id, w.order_number),
        detail: format!(
            "{} refused {} times since {}: {}; `payfleet messages send {}` sends it at once",
            w.routing_key,
            w.attempts,
            w.created_at,
            w.last_error.as_deref().unwrap_or_default(),
            w.message_id
        ),
    }));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s, %s refund %s', s.order_number, r.gateway, r.refund_id),
                format('%s %s recorded refunded, then reported %s at %s: the buyer may not have it back',
                       r.amount, r.currency, e.state, e.ended_at)
         FROM (SELECT po.gateway, po.session_id, r.refund_id, r.amount, r.currency
               FROM payment_refunds r JOIN payment_orders po ON po.id = r.payment_order_id
               UNION ALL
               SELECT p.gateway, p.session_id, r.refund_id, r.amount, p.currency
               FROM second_payment_refunds r JOIN second_payments p ON p.id = r.second_payment_id) r
         JOIN refunds_ended e ON e.gateway = r.gateway AND e.refund_id = r.refund_id
         LEFT JOIN payment_sessions s ON s.gateway = r.gateway AND s.session_id = r.session_id
         WHERE e.repaid_at IS NULL
         ORDER BY e.ended_at LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "refund_failed_after_done", rows.len());
    found.extend(violations("refund_failed_after_done", rows));
    let expired_not = crate::orders::expiry::overdue(pool, grace, CAP as i64).await?;
    note_cap(&mut truncated, "order_expiry_overdue", expired_not.len());
    // Late, not lost: those whose expiry job is still to run (its queue paused, or behind).
    let keys: Vec<String> = expired_not
        .iter()
        .map(|(n, _)| crate::orders::expiry::ExpireOrder::key(*n))
        .collect();
    let waiting = payfleet_queue::admin::unfinished_keys(pool, &keys).await?;
    let expired_not = expired_not
        .into_iter()
        .filter(|(n, _)| !waiting.contains(&crate::orders::expiry::ExpireOrder::key(*n)));
    found.extend(expired_not.map(|(number, at)| Violation {
        check: "order_expiry_overdue",
        subject: format!("order {number}"),
        detail: format!(
            "still waiting for its payment, though it expired at {at}: its expiry job did not run (discarded, or dead); POST /admin/orders/{number}/expire expires it now"
        ),
    }));
    // A day past the period's end: a gateway charges at the end, or within the hour after.
    let overdue = crate::orders::subscriptions::overdue(
        pool,
        DateTime::<Utc>::UNIX_EPOCH..Utc::now() - chrono::Duration::days(1),
        None,
        CAP as i64,
    )
    .await?;
    note_cap(&mut truncated, "subscription_period_overdue", overdue.len());
    found.extend(overdue.into_iter().map(|s| Violation {
        check: "subscription_period_overdue",
        subject: format!(
            "subscription {} (order {}, {})",
            s.id, s.order_number, s.gateway
        ),
        detail: format!(
            "its period ended at {} and no renewal or end was reported since: ask {}",
            s.current_period_end, s.gateway
        ),
    }));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s, refund request %s', q.order_number, q.id),
                CASE WHEN q.state = 'requested' AND q.first_asked_at IS NOT NULL
                     THEN format('requested %s %s, first asked of %s at %s, its answer never came: POST /admin/orders/%s/refunds again with Idempotency-Key %s asks %s again within 20 hours of that first ask; later it ends failed (refund_unconfirmed), for you to look at %s',
                                 q.amount, q.currency, q.gateway, q.first_asked_at, q.order_number, q.idempotency_key, q.gateway, q.gateway)
                     ELSE format('%s %s %s since %s, not recorded: POST /admin/orders/%s/refunds again with Idempotency-Key %s asks %s again',
                                 q.state, q.amount, q.currency, q.updated_at, q.order_number, q.idempotency_key, q.gateway) END
         FROM refund_requests q
         WHERE q.state IN ('requested', 'accepted') AND q.updated_at < now() - interval '3 days'
           AND NOT EXISTS (SELECT 1 FROM payment_refunds r
                            WHERE r.gateway = q.gateway AND r.refund_id = q.refund_id)
           AND NOT refund_request_held(q.state, q.gateway, q.session_id)
         ORDER BY q.updated_at LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "refund_under_way_too_long", rows.len());
    found.extend(violations("refund_under_way_too_long", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s, refund request %s', q.order_number, q.id),
                format('%s %s ended unconfirmed at %s: first asked of %s at %s, its answer never came, and it was not asked again past the gateway''s idempotency window. Look at %s for a refund of this payment made for it (its event records one it made, and this finding goes); if none was made, ask for a new refund with a new Idempotency-Key. Reported for 30 days',
                       q.amount, q.currency, q.updated_at, q.gateway, q.first_asked_at, q.gateway)
         FROM refund_requests q
         WHERE q.state = 'failed' AND q.updated_at > now() - interval '30 days'
           AND refund_request_unconfirmed(q)
         ORDER BY q.updated_at LIMIT 1000",
    )
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "refund_unconfirmed", rows.len());
    found.extend(violations("refund_unconfirmed", rows));
    // The extra payments the order side recorded (its `extra_payment` messages), each
    // looked up on the payment side.
    let extra = crate::orders::extra_payments(pool, grace).await?;
    let numbers: Vec<i64> = extra.iter().map(|e| e.order_number).collect();
    let sessions: Vec<&str> = extra.iter().map(|e| e.session_id.as_str()).collect();
    let payments: Vec<Option<&str>> = extra.iter().map(|e| e.payment_id.as_deref()).collect();
    let rows: Vec<(String, String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT format('%s session %s, payment %s (order %s)', x.gateway, x.session_id,
                       COALESCE(x.payment_id, 'not named yet'), x.order_number),
                format('%s %s paid on %s, %s given back and %s taken back by disputes: payfleet money give-back %s %s%s asks the gateway again',
                       COALESCE(x.amount::text, 'an amount not known'), COALESCE(x.currency, ''), x.paid_at,
                       x.given, x.taken, x.gateway, x.session_id,
                       COALESCE(' --payment ' || x.payment_id, '')),
                x.gateway, x.session_id, x.payment_id
         FROM (
             SELECT p.gateway, p.session_id, p.payment_id, s.order_number, p.amount, p.currency::text AS currency,
                    p.created_at AS paid_at, p.amount_refunded AS given,
                    COALESCE(sum(d.amount) FILTER (WHERE d.status IN ('lost', 'refunded')), 0) AS taken,
                    bool_or(d.status = 'open') AS open
             FROM second_payments p
             LEFT JOIN payment_sessions s ON s.gateway = p.gateway AND s.session_id = p.session_id
             LEFT JOIN second_payment_disputes d ON d.second_payment_id = p.id
             WHERE p.created_at < now() - make_interval(secs => $1)
             GROUP BY p.id, s.order_number
             UNION ALL
             SELECT po.gateway, po.session_id, po.payment_id, s.order_number, po.amount, po.currency::text,
                    po.succeeded_at, po.amount_refunded,
                    COALESCE(sum(d.amount) FILTER (WHERE d.status IN ('lost', 'refunded')), 0),
                    bool_or(d.status = 'open')
             FROM unnest($2::bigint[], $3::text[], $4::text[]) AS e(order_number, session_id, payment_id)
             JOIN payment_sessions s ON s.order_number = e.order_number AND s.session_id = e.session_id
             JOIN payment_orders po ON po.gateway = s.gateway AND po.session_id = s.session_id
                                   AND (e.payment_id IS NULL OR po.payment_id = e.payment_id)
             LEFT JOIN payment_disputes d ON d.payment_order_id = po.id
             GROUP BY po.id, s.order_number
         ) x
         WHERE open IS NOT TRUE AND (x.amount IS NULL OR x.given + x.taken < x.amount)
         ORDER BY 1 LIMIT 1000",
    )
    .bind(grace_secs)
    .bind(&numbers)
    .bind(&sessions)
    .bind(&payments)
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "payment_not_given_back", rows.len());
    // Not while its give-back is under way: asked (or retried), or accepted and settling.
    let keys: Vec<String> = rows
        .iter()
        .flat_map(|(_, _, gateway, session, payment)| give_back_keys(gateway, session, payment))
        .collect();
    let asked = payfleet_queue::admin::unfinished_keys(pool, &keys).await?;
    let settling: Vec<(String, String)> =
        payfleet_queue::admin::unfinished_payloads(pool, "payments", "settle_refund")
            .await?
            .iter()
            .map(|p| {
                let field = |f: &str| p[f].as_str().unwrap_or_default().to_owned();
                (field("gateway"), field("session_id"))
            })
            .collect();
    let rows = rows
        .into_iter()
        .filter(|(_, _, gateway, session, payment)| {
            !give_back_keys(gateway, session, payment)
                .iter()
                .any(|k| asked.contains(k))
                && !settling.contains(&(gateway.clone(), session.clone()))
        })
        .map(|(subject, detail, ..)| (subject, detail))
        .collect();
    found.extend(violations("payment_not_given_back", rows));
    let rows: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT format('coin reservation %s (order %s)', r.id, COALESCE(r.order_number::text, 'none')),
                format('%s %s of buyer %s reserved since %s, for an order %s: payfleet money settle-coins %s %s them',
                       r.amount, r.currency, r.buyer_id, r.created_at,
                       CASE WHEN o.number IS NULL THEN 'that does not exist'
                            WHEN o.paid_with_coins AND o.coin_reservation = r.id THEN 'paid with them'
                            ELSE 'that no longer waits for them (' || o.status || ')' END,
                       r.id,
                       CASE WHEN o.paid_with_coins AND o.coin_reservation = r.id THEN 'spends' ELSE 'gives back' END),
                r.id
         FROM coin_reservations r
         LEFT JOIN order_money o ON o.number = r.order_number
         WHERE r.state = 'reserved' AND r.created_at < now() - make_interval(secs => $1)
           AND (o.number IS NULL OR o.paid_with_coins OR o.coin_reservation IS DISTINCT FROM r.id
                OR NOT o.payable)
         ORDER BY r.created_at LIMIT 1000",
    )
    .bind(grace_secs)
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "coin_reservation_unsettled", rows.len());
    // Not while its settling is under way (retried through an outage, say).
    let steps = |id: &str| [true, false].map(|approve| SettleCoins::key(id, approve));
    let keys: Vec<String> = rows.iter().flat_map(|(_, _, id)| steps(id)).collect();
    let settling = payfleet_queue::admin::unfinished_keys(pool, &keys).await?;
    let rows = rows
        .into_iter()
        .filter(|(_, _, id)| !steps(id).iter().any(|k| settling.contains(k)))
        .map(|(subject, detail, _)| (subject, detail))
        .collect();
    found.extend(violations("coin_reservation_unsettled", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('payout %s', id),
                format('%s %s of seller %s (period from %s) waiting for the bank since %s: confirm it with the bank, then `POST /admin/payouts/%s/paid` or `/failed`',
                       amount, currency, seller_id, period_start, created_at, id)
         FROM payouts WHERE state = 'pending' AND created_at < now() - make_interval(secs => $1)
         ORDER BY created_at LIMIT 1000",
    )
    .bind(PAYOUT_DECIDED_WITHIN.num_seconds() as f64)
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "payout_undecided", rows.len());
    found.extend(violations("payout_undecided", rows));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT format('order %s, %s session %s', s.order_number, po.gateway, po.session_id),
                format('%s %s of its disputes ended as a refund is covered only by refunds recorded before them, and the refund that ended them is not recorded, a week after: the payouts hold it back until 30 days after they ended, then pay it, and this finding goes then too. Look at %s for that refund: its event records it, and this finding goes',
                       payment_dispute_refund_unrecorded(po.id), po.currency, po.gateway)
         FROM payment_orders po
         JOIN payment_sessions s ON s.gateway = po.gateway AND s.session_id = po.session_id
         WHERE po.gateway = ANY($1)
           AND po.id IN (SELECT d.payment_order_id FROM payment_disputes d
                         WHERE d.status = 'refunded' AND d.refunded_before > 0
                           AND d.updated_at > now() - interval '30 days'
                         GROUP BY d.payment_order_id
                         HAVING max(d.updated_at) < now() - interval '7 days')
           AND payment_dispute_refund_unrecorded(po.id) > 0
         ORDER BY po.id LIMIT 1000",
    )
    .bind(crate::gateways::through_platform())
    .fetch_all(pool)
    .await?;
    note_cap(&mut truncated, "dispute_refund_unrecorded", rows.len());
    found.extend(violations("dispute_refund_unrecorded", rows));
    Ok(Checked { found, truncated })
}

/// How long a payout may wait for the bank's answer before `payout_undecided` reports it: the
/// slowest transfers (an international wire) settle within five business days, and meanwhile
/// the amount is in transit, neither the seller's to spend nor known to have reached them.
pub const PAYOUT_DECIDED_WITHIN: chrono::Duration = chrono::Duration::days(7);

/// What a run changed in the findings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Report {
    pub open: usize,
    pub new: usize,
    pub resolved: u64,
}

/// Adds the recurring `consistency` task (jobs/recurring.toml): [`run`], its report logged.
pub fn add_task(tasks: &mut crate::recurring::Tasks, grace: Duration) {
    tasks.add("consistency", move |pool, _period| async move {
        let report = run(&pool, grace).await?;
        tracing::info!(
            open = report.open,
            new = report.new,
            resolved = report.resolved,
            "consistency checked"
        );
        Ok(())
    });
}

/// Runs the checks and brings `consistency_findings` in line: new violations opened (and
/// logged with their ids), lasting ones seen again, gone ones resolved.
pub async fn run(pool: &PgPool, grace: Duration) -> Result<Report, sqlx::Error> {
    let Checked { found, truncated } = checked(pool, grace).await?;
    for check in &truncated {
        tracing::warn!(
            check,
            cap = CAP,
            "a consistency check found at least its cap of violations: only those are findings, and none of its findings is resolved until it finds fewer"
        );
    }
    let mut tx = pool.begin().await?;
    // One run at a time brings the findings in line (two at once would resolve each other's).
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('consistency_findings', 0))")
        .execute(&mut *tx)
        .await?;
    let mut new = 0;
    for v in &found {
        let opened: bool = sqlx::query_scalar(
            "INSERT INTO consistency_findings (check_name, subject, detail) VALUES ($1, $2, $3)
             ON CONFLICT (check_name, subject) WHERE resolved_at IS NULL
             DO UPDATE SET detail = EXCLUDED.detail, last_seen = now()
             RETURNING xmax = 0",
        )
        .bind(v.check)
        .bind(bounded(&v.subject, 200))
        .bind(bounded(&v.detail, 2000))
        .fetch_one(&mut *tx)
        .await?;
        if opened {
            new += 1;
            tracing::error!(check = v.check, subject = %v.subject, detail = %v.detail, "consistency violation");
        }
    }
    let checks: Vec<&str> = found.iter().map(|v| v.check).collect();
    let subjects: Vec<&str> = found.iter().map(|v| bounded(&v.subject, 200)).collect();
    let resolved = sqlx::query(
        "UPDATE consistency_findings f SET resolved_at = now()
         WHERE f.resolved_at IS NULL AND NOT (f.check_name = ANY($3))
           AND NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS s(check_name, subject)
                           WHERE s.check_name = f.check_name AND s.subject = f.subject)",
    )
    .bind(&checks)
    .bind(&subjects)
    .bind(&truncated)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    if resolved > 0 {
        tracing::info!(resolved, "consistency findings resolved");
    }
    Ok(Report {
        open: found.len(),
        new,
        resolved,
    })
}

/// `text` cut to at most `chars` characters: a finding's subject is its key in a unique index,
/// and its detail may carry a gateway's or a consumer's words of any length.
fn bounded(text: &str, chars: usize) -> &str {
    match text.char_indices().nth(chars) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
#[schema(as = ConsistencyFinding)]
pub struct Finding {
    pub id: i64,
    pub check_name: String,
    pub subject: String,
    pub detail: String,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

/// The open findings, oldest first.
pub async fn open(pool: &PgPool, limit: i64) -> Result<Vec<Finding>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, check_name, subject, detail, first_seen, last_seen FROM consistency_findings
         WHERE resolved_at IS NULL ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// The open findings of check `check`, oldest first: one check's, whatever floods another.
pub async fn open_of(pool: &PgPool, check: &str, limit: i64) -> Result<Vec<Finding>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, check_name, subject, detail, first_seen, last_seen FROM consistency_findings
         WHERE resolved_at IS NULL AND check_name = $1 ORDER BY id LIMIT $2",
    )
    .bind(check)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Open findings by check, every check listed (zero included), for the gauge.
pub async fn counts(pool: &PgPool) -> Result<Vec<(&'static str, i64)>, sqlx::Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT check_name, count(*) FROM consistency_findings WHERE resolved_at IS NULL GROUP BY check_name",
    )
    .fetch_all(pool)
    .await?;
    Ok(CHECKS
        .iter()
        .map(|c| {
            (
                *c,
                rows.iter()
                    .find(|(n, _)| n == c)
                    .map_or(0, |(_, count)| *count),
            )
        })
        .collect())
}
