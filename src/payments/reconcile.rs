//! Missed-webhook reconciliation (the `reconcile` recurring job). Gateways retry for days, but
//! a webhook can still be lost (a misconfigured endpoint, a gateway that gave up): a payment the
//! buyer made then never confirms its order. So for payments still pending after a grace period,
//! the gateway is asked (`PaymentGateway::status`: Stripe's Checkout Session, Mercado Pago's
//! payment search, Razorpay's order payments, the internal gateway's own record), and what it
//! says is stored as an event of our own (`source = 'reconciliation'`, with an id made of the
//! session and the status) and processed by the same job and path as a webhook: the
//! facts are recorded once whichever comes first, the webhook or the reconciliation, or both.
//!
//! A gateway that lists the events it could not deliver (Stripe: the events list with
//! `delivery_success=false`) is asked for that list first, once per seller account: those
//! events are stored under their own ids, exactly as their webhooks would have been, so a late
//! webhook is a duplicate; sessions an event settled are not asked about again.
//!
//! Disputes are asked about too: one open for [`DISPUTE_ASK_AFTER`] may have been decided by an
//! event we never received (`PaymentGateway::dispute_status`: Stripe's and Razorpay's dispute
//! objects, Mercado Pago's payment in mediation). A decision is stored as a reconciliation
//! event and processed like the webhook that was lost; each open dispute is asked at most daily
//! (and, open past any network's deadline, it is the consistency check `dispute_undecided`'s).
//!
//! A subscription the gateway bills whose period ended with nothing reported since (its
//! renewal's first event lost: no session to ask about) has its gateway asked for the charges
//! its billing made since ([`PERIOD_ASK_AFTER`] to [`PERIOD_WINDOW`] after the period's end,
//! every [`PERIOD_EVERY`] at most): each is stored as the event that would have reported it.
//!
//! A session whose order expired is asked about for a day as often as a pending one, then up to
//! [`LATE_WINDOW`] after the expiry, every [`LATE_EVERY`] at most and in a quarter of a run's
//! share: a voucher paid days late whose webhooks were all lost is still found, and given back.
//!
//! Each gateway is asked at most `per_run` sessions per run, spaced by `pace` (its rate
//! limit), least recently checked first. A gateway that does not answer is left for the next
//! run, and reported (a finding and a log line).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::ProcessPaymentEvent;
use crate::gateways::api::{DisputeQuery, PaymentState, UndeliveredEvent};
use crate::gateways::{
    DisputeStatus, EventError, Fact, GatewayName, GatewayRegistry, Interpretation, PaymentRef,
    PaymentStatus,
};
use crate::money::Money;
use payfleet_queue::{self as queue, QueueError};

/// The `event_type` of the events reconciliation stores.
pub const EVENT_TYPE: &str = "payfleet.reconciled";

/// The body of a reconciliation event.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Reconciled {
    session_id: String,
    payment_id: Option<String>,
    status: String,
    amount: Option<Money>,
    /// A dispute's decision (then `status` is the dispute's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dispute_id: Option<String>,
    /// The gateway's subscription the payment started (`PaymentState::subscription`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    subscription: Option<String>,
}

/// Reads a reconciliation event of `gateway`'s, as `gateways::interpret` reads a webhook.
pub fn interpret(gateway: GatewayName, body: &[u8]) -> Result<Interpretation, EventError> {
    let r: Reconciled = serde_json::from_slice(body)?;
    let payment = PaymentRef {
        session_id: Some(r.session_id),
        payment_id: r.payment_id,
    };
    if let Some(dispute_id) = r.dispute_id {
        // Where a dispute is its payment's state (a Mercado Pago mediation), the payment is
        // read again whole, so the refunds that ended it (lost with the same webhook) are
        // recorded with its decision.
        if crate::gateways::format(gateway).disputes_are_payment_state()
            && let Some(resource_id) = payment.payment_id.clone()
        {
            return Ok(Interpretation::Lookup {
                resource: crate::gateways::LookupResource::DisputedPayment,
                resource_id,
            });
        }
        return Ok(match r.status.parse::<DisputeStatus>() {
            Ok(status) if status.is_decided() => Interpretation::Update {
                payment,
                facts: vec![Fact::DisputeDecided { dispute_id, status }],
            },
            _ => Interpretation::Ignore("the gateway says the dispute is open".into()),
        });
    }
    let status = match r.status.as_str() {
        "succeeded" => PaymentStatus::Succeeded,
        "failed" => PaymentStatus::Failed,
        _ => return Ok(Interpretation::Ignore("the gateway says pending".into())),
    };
    // Where a payment's refunds and mediation are its own state (Mercado Pago: a payment found
    // `refunded` or `charged_back` counts as paid), the payment is read again whole, as its
    // lost notification would have been: its refunds and mediation are recorded with it. Taken
    // as a bare success, an order was confirmed and its sale posted on money the buyer already
    // had back, and nothing ever recorded the refund.
    // (A renewal's charge, a preapproval's, is read as its authorized payment reports it: its
    // payment looked up alone would be taken for the first payment's.)
    if status == PaymentStatus::Succeeded
        && crate::gateways::format(gateway).disputes_are_payment_state()
        && !payment
            .session_id
            .as_deref()
            .is_some_and(crate::gateways::mercadopago::is_renewal_session)
        && let Some(resource_id) = payment.payment_id.clone()
    {
        return Ok(Interpretation::Lookup {
            resource: crate::gateways::LookupResource::Payment,
            resource_id,
        });
    }
    let mut facts = vec![Fact::Payment {
        status,
        amount: r.amount,
    }];
    // As the session's own event says it: the renewals and the cancellation the gateway will
    // report name this subscription, and wait for it to be known.
    if let Some(subscription) = r
        .subscription
        .filter(|_| status == PaymentStatus::Succeeded)
    {
        facts.push(Fact::Subscribed { subscription });
    }
    Ok(Interpretation::Update { payment, facts })
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a payment may stay pending before the gateway is asked.
    pub grace: Duration,
    /// Most sessions asked of one gateway per run.
    pub per_run: usize,
    /// Time between two questions to the same gateway.
    pub pace: Duration,
}

impl Settings {
    /// `PAYFLEET_RECONCILE_GRACE_SECS` (300), `PAYFLEET_RECONCILE_PER_RUN` (100),
    /// `PAYFLEET_RECONCILE_PACE_MS` (200).
    pub fn from_env(env: &dyn crate::env::Env) -> Result<Self, crate::env::Invalid> {
        use crate::env::parsed_within;
        // Bounded so that no value turns reconciliation off without saying so (0 sessions a
        // run asks nothing, ever) or fails every run in the database (a grace beyond what an
        // interval holds).
        Ok(Self {
            grace: Duration::from_secs(parsed_within(
                env,
                "PAYFLEET_RECONCILE_GRACE_SECS",
                300u64,
                0..=30 * 24 * 3600,
            )?),
            per_run: parsed_within(env, "PAYFLEET_RECONCILE_PER_RUN", 100usize, 1..=100_000)?,
            pace: Duration::from_millis(parsed_within(
                env,
                "PAYFLEET_RECONCILE_PACE_MS",
                200u64,
                0..=60_000,
            )?),
        })
    }
}

/// What one run found, per gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub asked: usize,
    /// Payments the gateway settled that no webhook had told us about.
    pub found: usize,
    /// Gateways that did not answer (left for the next run).
    pub unreachable: Vec<GatewayName>,
}

#[derive(sqlx::FromRow)]
struct Pending {
    gateway: GatewayName,
    session_id: String,
    order_number: i64,
    seller_account: Option<String>,
    /// A failure of the session's payment was recorded already (its webhook came): asked
    /// about only for a later attempt's success, so the same failure again is no finding.
    failed_before: bool,
    /// Its order expired more than a day ago: asked within [`LATE_WINDOW`] only, every
    /// [`LATE_EVERY`] at most, in a quarter of the run's share.
    late: bool,
}

/// How long after its order expired a session is still asked about. A voucher (a boleto, an
/// OXXO ticket) is paid days after the checkout and settles business days after that, and
/// gateways retry a webhook for days: if all of that is lost, this is what still finds the
/// money the buyer paid, so it goes back to them (a late payment, given back).
pub const LATE_WINDOW: chrono::Duration = chrono::Duration::days(10);
/// How often a session expired more than a day ago is asked about, at most: a late payment
/// waits hours for its give-back, and abandoned checkouts (most of them) cost the gateway's
/// rate limit a question a few times a day each, not every run.
pub const LATE_EVERY: chrono::Duration = chrono::Duration::hours(6);

/// Of one gateway's `pending` sessions (current ones and late ones, each in the order they
/// are due), those asked in a run of `per_run`: late ones take up to a quarter of it (at least
/// one), the current ones the rest, and either takes what the other leaves.
fn share(pending: Vec<Pending>, per_run: usize) -> Vec<Pending> {
    let (late, current): (Vec<Pending>, Vec<Pending>) = pending.into_iter().partition(|p| p.late);
    let late_quota = per_run.div_ceil(4).min(late.len());
    let current_take = current.len().min(per_run - late_quota);
    let late_take = late.len().min(per_run - current_take);
    current
        .into_iter()
        .take(current_take)
        .chain(late.into_iter().take(late_take))
        .collect()
}

/// Adds the recurring `reconcile` task (jobs/recurring.toml): [`run`], its report logged.
pub fn add_task(
    tasks: &mut crate::recurring::Tasks,
    gateways: GatewayRegistry,
    settings: Settings,
) {
    let reconcile = std::sync::Arc::new((gateways, settings));
    tasks.add("reconcile", move |pool, _period| {
        let reconcile = reconcile.clone();
        async move {
            let (gateways, settings) = &*reconcile;
            let r = run(&pool, gateways, settings).await?;
            tracing::info!(asked = r.asked, found = r.found, unreachable = ?r.unreachable, "reconciliation done");
            Ok(())
        }
    });
}

/// One run: asks each enabled gateway about its payments pending past the grace period.
pub async fn run(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    settings: &Settings,
) -> Result<Report, QueueError> {
    let names: Vec<&str> = gateways.names().iter().map(|g| g.as_str()).collect();
    // A failed session is asked about again only where a later attempt may still succeed: on
    // gateways whose sessions take several attempts, and a renewal's session anywhere (its
    // `subscription` in the metadata) for [`PERIOD_WINDOW`] after it was opened: the gateway's
    // own billing retries the period's charge (Stripe's Smart Retries charge the same invoice
    // again, for weeks), and a retry that succeeded with its event lost would leave the
    // subscription past due and the period without its sale. Renewals never expire here (the
    // gateway's dunning decides), so the window is what ends the asking.
    let attempts: Vec<&str> = gateways
        .names()
        .iter()
        .filter(|g| crate::gateways::format(**g).attempts_per_session())
        .map(|g| g.as_str())
        .collect();
    // Each gateway's current sessions and its late ones, each list in the order they are due
    // and as long as a run's share: `share` then chooses between them. A paid order's other
    // sessions are late ones too, for as long after its payment: a voucher or boleto of an
    // earlier attempt, paid days after the order was paid another way (its coins, another
    // session) with its webhooks lost, was never asked about, and the buyer who paid twice was
    // never given it back. (The session that paid is not asked: it succeeded.)
    let pending: Vec<Pending> = sqlx::query_as(
        "SELECT gateway, session_id, order_number, seller_account, failed_before, late FROM (
             SELECT s.gateway, s.session_id, s.order_number, s.metadata ->> 'seller_account' AS seller_account,
                    po.failed_at IS NOT NULL AS failed_before, late,
                    row_number() OVER (PARTITION BY s.gateway, late
                                       ORDER BY s.checked_at NULLS FIRST, s.created_at) AS n
             FROM payment_sessions s
             JOIN order_money o ON o.number = s.order_number
             CROSS JOIN LATERAL (SELECT coalesce(NOT (o.payable OR o.expired_at > now() - interval '1 day'), true) AS late) l
             LEFT JOIN payment_orders po ON po.gateway = s.gateway AND po.session_id = s.session_id
             WHERE s.gateway = ANY($1)
               AND s.created_at < now() - make_interval(secs => $2)
               AND (o.payable
                    OR o.expired_at > now() - interval '1 day'
                    OR ((o.expired_at > now() - make_interval(secs => $5)
                         OR o.paid_at > now() - make_interval(secs => $5))
                        AND (s.checked_at IS NULL OR s.checked_at < now() - make_interval(secs => $6))))
               AND (po.id IS NULL OR (po.succeeded_at IS NULL
                                      AND (po.failed_at IS NULL OR s.gateway = ANY($4)
                                           OR (s.metadata ? 'subscription'
                                               AND s.created_at > now() - make_interval(secs => $7)))))
         ) due WHERE n <= $3
         ORDER BY gateway, late, n",
    )
    .bind(&names)
    .bind(settings.grace.as_secs_f64())
    .bind(settings.per_run as i64)
    .bind(&attempts)
    .bind(LATE_WINDOW.num_seconds() as f64)
    .bind(LATE_EVERY.num_seconds() as f64)
    .bind(PERIOD_WINDOW.num_seconds() as f64)
    .fetch_all(pool)
    .await?;
    let mut report = Report::default();
    // Gateways are asked concurrently, each at its own pace.
    let mut by_gateway: std::collections::HashMap<GatewayName, Vec<Pending>> = Default::default();
    for p in pending {
        by_gateway.entry(p.gateway).or_default().push(p);
    }
    let by_gateway = by_gateway
        .into_iter()
        .map(|(name, sessions)| (name, share(sessions, settings.per_run)));
    let runs = by_gateway.into_iter().map(|(name, sessions)| async move {
        ask_gateway(pool, gateways, settings, name, sessions).await
    });
    for (name, result) in futures_util::future::join_all(runs).await {
        let (asked, found, reachable) = result?;
        report.asked += asked;
        report.found += found;
        if !reachable {
            report.unreachable.push(name);
        }
    }
    for pass in [
        ask_about_disputes(pool, gateways, settings).await?,
        ask_about_periods(pool, gateways, settings).await?,
    ] {
        let (asked, found, unreachable) = pass;
        report.asked += asked;
        report.found += found;
        for name in unreachable {
            if !report.unreachable.contains(&name) {
                report.unreachable.push(name);
            }
        }
    }
    Ok(report)
}

/// How long after a gateway-billed subscription's period ended, with nothing reported since
/// (neither its renewal, paid or failed, nor its end), its gateway is asked about the charges
/// its billing made: Stripe finalizes a period's invoice about an hour after the period ends,
/// and charges it then.
pub const PERIOD_ASK_AFTER: chrono::Duration = chrono::Duration::hours(2);
/// How long after the period's end it is still asked about: Stripe keeps retrying a failed
/// charge for weeks (Smart Retries), and its events 30 days.
pub const PERIOD_WINDOW: chrono::Duration = chrono::Duration::days(30);
/// How often one period is asked about, at most.
pub const PERIOD_EVERY: chrono::Duration = chrono::Duration::hours(1);
/// Most overdue periods read per run, oldest first within [`PERIOD_WINDOW`] (of which
/// `per_run` are asked, the least recently asked first).
const OVERDUE_READ: i64 = 10_000;

/// Forgets when periods ended longer ago than [`PERIOD_WINDOW`] (and then some) were asked
/// about: they are not asked about again.
pub async fn prune_period_checks(pool: &PgPool) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(
        "DELETE FROM subscription_period_checks WHERE period_end < now() - make_interval(secs => $1)",
    )
    .bind((PERIOD_WINDOW + chrono::Duration::days(1)).num_seconds() as f64)
    .execute(pool)
    .await?
    .rows_affected())
}

#[derive(sqlx::FromRow)]
struct OverduePeriod {
    subscription_id: uuid::Uuid,
    period_end: DateTime<Utc>,
    gateway: GatewayName,
    order_number: i64,
    subscription_ref: String,
    seller_account: Option<String>,
}

/// Asks each gateway that bills subscriptions about the charges of those whose period ended
/// [`PERIOD_ASK_AFTER`] ago or more (within [`PERIOD_WINDOW`]) with nothing reported since:
/// the gateway's `PaymentGateway::period_charges`, each charge as the event that would have
/// reported it, stored under its own id and processed as that webhook is (the period's
/// renewal order, its sale once paid; the webhook arriving too changes nothing twice).
/// Least recently asked first, at most every [`PERIOD_EVERY`], `per_run` per run (all
/// gateways together), `pace` apart. Returns (asked, found, unreachable). The consistency check
/// `subscription_period_overdue` still reports a period nothing was found for after a day.
async fn ask_about_periods(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    settings: &Settings,
) -> Result<(usize, usize, Vec<GatewayName>), QueueError> {
    // Only the gateways that keep such a list: the others' periods would take a run's share
    // and never be asked.
    let listing: Vec<&str> = gateways
        .names()
        .iter()
        .filter(|g| gateways.get(**g).is_some_and(|g| g.lists_period_charges()))
        .map(|g| g.as_str())
        .collect();
    if listing.is_empty() {
        return Ok((0, 0, Vec::new()));
    }
    let now = Utc::now();
    let overdue = crate::orders::subscriptions::overdue(
        pool,
        now - PERIOD_WINDOW..now - PERIOD_ASK_AFTER,
        Some(&listing),
        OVERDUE_READ,
    )
    .await?;
    if overdue.is_empty() {
        return Ok((0, 0, Vec::new()));
    }
    // Each one's subscription at its gateway: what the payment its first order took started
    // (another attempt's session may name a subscription that never started).
    let due: Vec<OverduePeriod> = sqlx::query_as(
        "SELECT o.id AS subscription_id, o.period_end, r.gateway, o.number AS order_number,
                r.subscription_ref, r.seller_account
         FROM unnest($1::uuid[], $2::bigint[], $3::timestamptz[], $4::text[], $7::text[])
                AS o(id, number, period_end, gateway, first_session)
         CROSS JOIN LATERAL (
             SELECT s.gateway, po.subscription_ref, s.metadata ->> 'seller_account' AS seller_account
             FROM payment_sessions s
             JOIN payment_orders po ON po.gateway = s.gateway AND po.session_id = s.session_id
             WHERE s.order_number = o.number AND s.gateway = o.gateway AND s.session_id = o.first_session
               AND po.subscription_ref IS NOT NULL) r
         LEFT JOIN subscription_period_checks c ON c.subscription_id = o.id AND c.period_end = o.period_end
         WHERE c.checked_at IS NULL OR c.checked_at < now() - make_interval(secs => $5)
         ORDER BY c.checked_at NULLS FIRST, o.period_end
         LIMIT $6",
    )
    .bind(overdue.iter().map(|o| o.id.0).collect::<Vec<_>>())
    .bind(overdue.iter().map(|o| o.order_number).collect::<Vec<_>>())
    .bind(overdue.iter().map(|o| o.current_period_end).collect::<Vec<_>>())
    .bind(overdue.iter().map(|o| o.gateway.as_str()).collect::<Vec<_>>())
    .bind(PERIOD_EVERY.num_seconds() as f64)
    .bind(settings.per_run as i64)
    .bind(
        overdue
            .iter()
            .map(|o| o.first_session.as_deref())
            .collect::<Vec<_>>(),
    )
    .fetch_all(pool)
    .await?;
    let (mut asked, mut found, mut unreachable) = (0, 0, Vec::new());
    for d in due {
        let Some(gateway) =
            gateway_to_ask(gateways, &unreachable, d.gateway, asked, settings).await
        else {
            continue;
        };
        let p = Pending {
            gateway: d.gateway,
            session_id: d.subscription_ref.clone(),
            order_number: d.order_number,
            seller_account: d.seller_account.clone(),
            failed_before: false,
            late: false,
        };
        // From a day before the period's end: an invoice Stripe made early is the period's too.
        let since = d.period_end - chrono::Duration::days(1);
        let charges = gateway
            .period_charges(&d.subscription_ref, d.seller_account.as_deref(), since)
            .await;
        let (events_gateway, events) = match charges {
            Ok(Some(charges)) => charges,
            Ok(None) => (d.gateway, Vec::new()),
            Err(e) if e.is_transient() => {
                asked += 1;
                tracing::warn!(gateway = %d.gateway, subscription = %d.subscription_ref, error = %e, "reconciliation: the gateway does not answer about a subscription's charges; trying again next run");
                finding(pool, d.gateway, &p, "unreachable", &e.to_string()).await?;
                unreachable.push(d.gateway);
                continue;
            }
            Err(e) => {
                tracing::warn!(gateway = %d.gateway, subscription = %d.subscription_ref, error = %e, "reconciliation: the gateway refused to list a subscription's charges");
                // Reported once a day at most: a disconnected account refuses every hour.
                let reported: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM reconciliation_findings
                                    WHERE gateway = $1 AND session_id = $2 AND outcome = 'refused'
                                      AND found_at > now() - interval '1 day')",
                )
                .bind(d.gateway)
                .bind(&d.subscription_ref)
                .fetch_one(pool)
                .await?;
                if !reported {
                    finding(pool, d.gateway, &p, "refused", &e.to_string()).await?;
                }
                (d.gateway, Vec::new())
            }
        };
        asked += 1;
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO subscription_period_checks (subscription_id, period_end) VALUES ($1, $2)
             ON CONFLICT (subscription_id, period_end) DO UPDATE SET checked_at = now()",
        )
        .bind(d.subscription_id)
        .bind(d.period_end)
        .execute(&mut *tx)
        .await?;
        for event in &events {
            if !store_event(
                &mut tx,
                events_gateway,
                &event.event_id,
                &event.event_type,
                &event.body,
            )
            .await?
            {
                continue;
            }
            found += 1;
            let outcome = if event.event_id.ends_with(":failed") {
                "failed"
            } else {
                "succeeded"
            };
            let detail = format!(
                "the period ending {} had nothing reported; the gateway lists {} ({}), stored as event {}",
                d.period_end, event.event_type, d.subscription_ref, event.event_id
            );
            finding(&mut *tx, d.gateway, &p, outcome, &detail).await?;
            tracing::warn!(gateway = %d.gateway, subscription = %d.subscription_ref, event = %event.event_id, order = d.order_number,
                "reconciliation found a subscription's charge no webhook reported");
        }
        tx.commit().await?;
    }
    Ok((asked, found, unreachable))
}

/// The gateway to ask the next question of `name`'s, `pace` after the run's previous one:
/// none while it does not answer this run, or is not enabled here.
async fn gateway_to_ask(
    gateways: &GatewayRegistry,
    unreachable: &[GatewayName],
    name: GatewayName,
    asked: usize,
    settings: &Settings,
) -> Option<std::sync::Arc<dyn crate::gateways::PaymentGateway>> {
    if unreachable.contains(&name) {
        return None;
    }
    let gateway = gateways.get(name)?;
    if asked > 0 {
        tokio::time::sleep(settings.pace).await;
    }
    Some(gateway)
}

/// How long a dispute stays open before its gateway is asked whether it was decided (and then
/// at most daily). Most are decided within weeks, and their decision's event comes at once.
pub const DISPUTE_ASK_AFTER: chrono::Duration = chrono::Duration::days(7);

#[derive(sqlx::FromRow)]
struct OpenDispute {
    gateway: GatewayName,
    session_id: String,
    payment_id: Option<String>,
    dispute_id: String,
    order_number: i64,
    seller_account: Option<String>,
}

/// Asks each gateway about its disputes open past [`DISPUTE_ASK_AFTER`], least recently asked
/// first, `per_run` at most per gateway, `pace` apart. Returns (asked, decided, unreachable).
async fn ask_about_disputes(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    settings: &Settings,
) -> Result<(usize, usize, Vec<GatewayName>), QueueError> {
    let names: Vec<&str> = gateways.names().iter().map(|g| g.as_str()).collect();
    let open: Vec<OpenDispute> = sqlx::query_as(
        "SELECT gateway, session_id, payment_id, dispute_id, order_number, seller_account FROM (
             SELECT d.gateway, po.session_id, po.payment_id, d.dispute_id, s.order_number,
                    s.metadata ->> 'seller_account' AS seller_account,
                    row_number() OVER (PARTITION BY d.gateway ORDER BY d.checked_at NULLS FIRST, d.updated_at) AS n
             FROM payment_disputes d
             JOIN payment_orders po ON po.id = d.payment_order_id
             JOIN payment_sessions s ON s.gateway = po.gateway AND s.session_id = po.session_id
             WHERE d.gateway = ANY($1) AND d.status = 'open'
               AND d.updated_at < now() - make_interval(secs => $2)
               AND (d.checked_at IS NULL OR d.checked_at < now() - interval '1 day')
         ) due WHERE n <= $3",
    )
    .bind(&names)
    .bind(DISPUTE_ASK_AFTER.num_seconds() as f64)
    .bind(settings.per_run as i64)
    .fetch_all(pool)
    .await?;
    let (mut asked, mut decided, mut unreachable) = (0, 0, Vec::new());
    for d in open {
        let Some(gateway) =
            gateway_to_ask(gateways, &unreachable, d.gateway, asked, settings).await
        else {
            continue;
        };
        asked += 1;
        let p = Pending {
            gateway: d.gateway,
            session_id: d.session_id.clone(),
            order_number: d.order_number,
            seller_account: d.seller_account.clone(),
            failed_before: false,
            late: false,
        };
        let query = DisputeQuery {
            session_id: d.session_id.clone(),
            payment_id: d.payment_id.clone().unwrap_or_default(),
            dispute_id: d.dispute_id.clone(),
            seller_account: d.seller_account.clone(),
        };
        let asked_now = gateway.dispute_status(&query).await;
        let mut tx = pool.begin().await?;
        let status = match asked_now {
            Ok(status) => status,
            // Not answered: asked again next run (the gateway's other disputes wait for it).
            Err(e) if e.is_transient() => {
                drop(tx);
                tracing::warn!(gateway = %d.gateway, dispute = %d.dispute_id, error = %e, "reconciliation: the gateway does not answer about a dispute; trying again next run");
                let detail = format!("dispute {}: {e}", d.dispute_id);
                finding(pool, d.gateway, &p, "unreachable", &detail).await?;
                unreachable.push(d.gateway);
                continue;
            }
            // Refused: reported once a day at most, like any answer (the others are asked meanwhile).
            Err(e) => {
                tracing::warn!(gateway = %d.gateway, dispute = %d.dispute_id, error = %e, "reconciliation: the gateway refused the question about a dispute");
                let detail = format!("dispute {}: {e}", d.dispute_id);
                finding(&mut *tx, d.gateway, &p, "refused", &detail).await?;
                None
            }
        };
        sqlx::query(
            "UPDATE payment_disputes SET checked_at = now() WHERE gateway = $1 AND dispute_id = $2",
        )
        .bind(d.gateway)
        .bind(&d.dispute_id)
        .execute(&mut *tx)
        .await?;
        if let Some(status) = status.filter(DisputeStatus::is_decided) {
            let body = serde_json::to_vec(&Reconciled {
                session_id: d.session_id.clone(),
                payment_id: d.payment_id.clone(),
                status: status.as_str().to_owned(),
                amount: None,
                dispute_id: Some(d.dispute_id.clone()),
                subscription: None,
            })
            .map_err(QueueError::Encode)?;
            let event_id = format!("reconciled_dispute:{}:{status}", d.dispute_id);
            if store_event(&mut tx, d.gateway, &event_id, EVENT_TYPE, &body).await? {
                let detail = format!(
                    "the gateway says dispute {} is {status}; no webhook had said so",
                    d.dispute_id
                );
                finding(&mut *tx, d.gateway, &p, "dispute_decided", &detail).await?;
                decided += 1;
                tracing::warn!(gateway = %d.gateway, dispute = %d.dispute_id, order = d.order_number, %status,
                    "reconciliation found a dispute's decision no webhook reported");
            }
        }
        tx.commit().await?;
    }
    Ok((asked, decided, unreachable))
}

async fn ask_gateway(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    settings: &Settings,
    name: GatewayName,
    sessions: Vec<Pending>,
) -> (GatewayName, Result<(usize, usize, bool), QueueError>) {
    let Some(gateway) = gateways.get(name) else {
        return (name, Ok((0, 0, true)));
    };
    let (mut asked, mut found) = (0, 0);
    let mut accounts: Vec<Option<&str>> = sessions
        .iter()
        .map(|p| p.seller_account.as_deref())
        .collect();
    accounts.sort_unstable();
    accounts.dedup();
    // Sessions an undelivered event settled: nothing more to ask about them.
    let mut settled = std::collections::HashSet::new();
    let since = Utc::now() - EVENTS_WINDOW;
    for account in accounts {
        if asked > 0 {
            tokio::time::sleep(settings.pace).await;
        }
        let Some(first) = sessions
            .iter()
            .find(|p| p.seller_account.as_deref() == account)
        else {
            continue;
        };
        let events = match gateway
            .undelivered_events(since, account, settings.pace)
            .await
        {
            // No such list: every session is asked about below.
            Ok(None) => break,
            Ok(Some(events)) => events,
            Err(e) if e.is_transient() => {
                asked += 1;
                tracing::warn!(gateway = %name, error = %e, "reconciliation: the gateway's events list does not answer; trying again next run");
                let r = finding(pool, name, first, "unreachable", &e.to_string()).await;
                return (name, r.map(|_| (asked, found, false)));
            }
            Err(e) => {
                asked += 1;
                tracing::warn!(gateway = %name, error = %e, "reconciliation: the gateway refused the events list");
                if let Err(e) = finding(pool, name, first, "refused", &e.to_string()).await {
                    return (name, Err(e));
                }
                continue;
            }
        };
        asked += 1;
        for event in &events {
            match record_event(pool, name, &sessions, event).await {
                Ok(Some(session)) => {
                    found += 1;
                    settled.insert(session);
                }
                Ok(None) => {}
                Err(e) => return (name, Err(e)),
            }
        }
    }
    for p in sessions.iter().filter(|p| !settled.contains(&p.session_id)) {
        if asked > 0 {
            tokio::time::sleep(settings.pace).await;
        }
        asked += 1;
        let state = match gateway
            .status(&p.session_id, p.seller_account.as_deref())
            .await
        {
            Ok(state) => state,
            Err(e) if e.is_transient() => {
                tracing::warn!(gateway = %name, session = %p.session_id, error = %e, "reconciliation: the gateway does not answer; trying again next run");
                let r = finding(pool, name, p, "unreachable", &e.to_string()).await;
                return (name, r.map(|_| (asked, found, false)));
            }
            // Refused (a session it does not know, an account that no longer lets us ask):
            // reported, and asked again only after the others, as an answered session is, so a
            // run's share is not spent on the same refusals at every run.
            Err(e) => {
                tracing::warn!(gateway = %name, session = %p.session_id, error = %e, "reconciliation: the gateway refused the question");
                if let Err(e) = refused(pool, name, p, &e.to_string()).await {
                    return (name, Err(e));
                }
                continue;
            }
        };
        match record(pool, name, p, &state).await {
            Ok(true) => found += 1,
            Ok(false) => {}
            Err(e) => return (name, Err(e)),
        }
    }
    (name, Ok((asked, found, true)))
}

/// How far back the events list is read: Stripe keeps events 30 days; its retries end after 3.
const EVENTS_WINDOW: chrono::Duration = chrono::Duration::days(30);

/// Stores an event, once, with its processing job. Returns whether it was new.
async fn store_event(
    tx: &mut sqlx::PgConnection,
    gateway: GatewayName,
    event_id: &str,
    event_type: &str,
    body: &[u8],
) -> Result<bool, QueueError> {
    let stored: Option<i64> = sqlx::query_scalar(
        "INSERT INTO payment_events (gateway, event_id, event_type, raw_body, source)
         VALUES ($1, $2, $3, $4, 'reconciliation') ON CONFLICT (gateway, event_id) DO NOTHING RETURNING id",
    )
    .bind(gateway)
    .bind(event_id)
    .bind(event_type)
    .bind(body)
    .fetch_optional(&mut *tx)
    .await?;
    if stored.is_some() {
        queue::enqueue(
            &mut *tx,
            ProcessPaymentEvent::job_for_body(gateway, event_id, body)?,
        )
        .await?;
    }
    Ok(stored.is_some())
}

/// Stores an event the gateway could not deliver under its own id, as its webhook would have
/// been. Returns the pending session it settles, if it settles one.
async fn record_event(
    pool: &PgPool,
    gateway: GatewayName,
    pending: &[Pending],
    event: &UndeliveredEvent,
) -> Result<Option<String>, QueueError> {
    let mut tx = pool.begin().await?;
    let new = store_event(
        &mut tx,
        gateway,
        &event.event_id,
        &event.event_type,
        &event.body,
    )
    .await?;
    // Which pending session it settles, read as processing will read it.
    let settles = match crate::gateways::interpret(gateway, &event.body) {
        Ok(Interpretation::Update { payment, facts }) => {
            let status = facts.iter().find_map(|f| match f {
                Fact::Payment { status, .. } if *status != PaymentStatus::Pending => Some(*status),
                _ => None,
            });
            payment
                .session_id
                .zip(status)
                .and_then(|(s, st)| pending.iter().find(|p| p.session_id == s).map(|p| (p, st)))
        }
        _ => None,
    };
    // An event stored by an earlier run settles nothing new: its session is asked about as
    // any other (its processing may have left the payment pending).
    let settled = settles.filter(|_| new).map(|(p, _)| p.session_id.clone());
    if let (true, Some((p, status))) = (new, settles) {
        mark_checked(&mut tx, gateway, &p.session_id).await?;
        let status = if status == PaymentStatus::Succeeded {
            "succeeded"
        } else {
            "failed"
        };
        let detail = format!(
            "the gateway never delivered event {} ({})",
            event.event_id, event.event_type
        );
        finding(&mut *tx, gateway, p, status, &detail).await?;
        tracing::warn!(%gateway, event = %event.event_id, session = %p.session_id, order = p.order_number, status,
            "reconciliation found an event the gateway never delivered");
    }
    tx.commit().await?;
    Ok(settled)
}

/// Stores what the gateway said, if it settled the payment, as an event with its processing
/// job. Returns whether it was news.
async fn record(
    pool: &PgPool,
    gateway: GatewayName,
    p: &Pending,
    state: &PaymentState,
) -> Result<bool, QueueError> {
    let mut tx = pool.begin().await?;
    mark_checked(&mut tx, gateway, &p.session_id).await?;
    let status = match state.status {
        PaymentStatus::Succeeded => "succeeded",
        PaymentStatus::Failed if !p.failed_before => "failed",
        // Still failed, as its webhook said: nothing new to find.
        PaymentStatus::Failed | PaymentStatus::Pending => {
            tx.commit().await?;
            return Ok(false);
        }
    };
    let body = serde_json::to_vec(&Reconciled {
        session_id: p.session_id.clone(),
        payment_id: state.payment_id.clone(),
        status: status.to_owned(),
        amount: state.amount,
        dispute_id: None,
        subscription: state.subscription.clone(),
    })
    .map_err(QueueError::Encode)?;
    // The same finding twice is the same event.
    let event_id = format!("reconciled:{}:{status}", p.session_id);
    if !store_event(&mut tx, gateway, &event_id, EVENT_TYPE, &body).await? {
        tx.commit().await?;
        return Ok(false);
    }
    let detail = format!("the gateway says {status}; no webhook had said so");
    finding(&mut *tx, gateway, p, status, &detail).await?;
    tx.commit().await?;
    tracing::warn!(%gateway, session = %p.session_id, order = p.order_number, status, "reconciliation found a payment no webhook reported");
    Ok(true)
}

async fn refused(
    pool: &PgPool,
    gateway: GatewayName,
    p: &Pending,
    detail: &str,
) -> Result<(), QueueError> {
    let mut tx = pool.begin().await?;
    mark_checked(&mut tx, gateway, &p.session_id).await?;
    finding(&mut *tx, gateway, p, "refused", detail).await?;
    tx.commit().await?;
    Ok(())
}

async fn finding<'c>(
    db: impl sqlx::PgExecutor<'c>,
    gateway: GatewayName,
    p: &Pending,
    outcome: &str,
    detail: &str,
) -> Result<(), QueueError> {
    sqlx::query(
        "INSERT INTO reconciliation_findings (gateway, session_id, order_number, outcome, detail)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(gateway)
    .bind(&p.session_id)
    .bind(p.order_number)
    .bind(outcome)
    .bind(detail)
    .execute(db)
    .await?;
    Ok(())
}

/// Notes that the gateway was asked about a session now, so the next runs ask the others first.
async fn mark_checked(
    tx: &mut sqlx::PgConnection,
    gateway: GatewayName,
    session_id: &str,
) -> Result<(), QueueError> {
    sqlx::query(
        "UPDATE payment_sessions SET checked_at = now() WHERE gateway = $1 AND session_id = $2",
    )
    .bind(gateway)
    .bind(session_id)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
#[schema(as = ReconciliationFinding)]
pub struct Finding {
    pub id: i64,
    pub gateway: String,
    pub session_id: String,
    pub order_number: i64,
    pub outcome: String,
    pub detail: String,
    pub found_at: DateTime<Utc>,
}

/// The latest findings, newest first.
pub async fn findings(pool: &PgPool, limit: i64) -> Result<Vec<Finding>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, gateway, session_id, order_number, outcome, detail, found_at
         FROM reconciliation_findings ORDER BY id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Findings of the last day by gateway and outcome, for the gauge.
pub async fn recent_counts(pool: &PgPool) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT gateway, outcome, count(*) FROM reconciliation_findings
         WHERE found_at > now() - interval '1 day' GROUP BY gateway, outcome ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
}
