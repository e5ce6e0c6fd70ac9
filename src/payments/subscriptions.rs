//! Subscriptions a gateway bills itself (Stripe's): the events of their renewals and changes,
//! and cancelling them there.
//!
//! A renewal's event names the gateway's subscription, the period it pays and its own payment
//! (Stripe's invoice and PaymentIntent). The subscription is found through its first payment,
//! which recorded the gateway's id from its own event (`Fact::Subscribed`); until that payment
//! is known the event waits (`subscription:<id>`), and the first payment's event wakes it. The
//! renewal order of the period is opened once (`orders::subscriptions::open_reported`), the
//! invoice becomes that order's session, and its facts then apply as any payment's do: one
//! sale, one fee, refunds and disputes like an order's.

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::apply::{self, Applied, Outcome};
use super::{ProcessError, RefundPayment};
use crate::gateways::api::SubscriptionEnd;
use crate::gateways::{
    Fact, GatewayName, GatewayRegistry, PaymentRef, PaymentStatus, Renewal, SubscriptionChange,
};
use crate::orders::subscriptions::{
    self, CancelError, Reported, ReportedRenewal, SubscriptionId, SubscriptionStatus,
    SubscriptionView,
};
use payfleet_queue::{self as queue, Job, JobContext, JobError, NewJob, QueueError, Worker};

/// A gateway subscription's first payment, as this side knows it.
#[derive(sqlx::FromRow)]
struct FirstPayment {
    id: i64,
    session_id: String,
    subscription_ref: Option<String>,
    order_number: i64,
    metadata: serde_json::Value,
    /// The payment started the order's subscription: its order took it, and it started no
    /// other gateway subscription. Else the gateway's subscription is a second one for the
    /// same order (a second paid checkout of it, a subscription made twice at the gateway
    /// naming the same first payment): it started nothing here.
    #[sqlx(skip)]
    started: bool,
}

/// The succeeded first payment of the gateway's subscription `subscription`, found by the id
/// its own event recorded or, where the event names it, by its session. Found by its session,
/// and the subscription's starter, it records the subscription's id for the events that name
/// only that.
async fn first_payment(
    tx: &mut PgConnection,
    gateway: GatewayName,
    subscription: &str,
    first_session: Option<&str>,
) -> Result<Option<FirstPayment>, sqlx::Error> {
    let found: Option<FirstPayment> = sqlx::query_as(
        "SELECT po.id, po.session_id, po.subscription_ref, ps.order_number, ps.metadata
         FROM payment_orders po
         JOIN payment_sessions ps ON ps.gateway = po.gateway AND ps.session_id = po.session_id
         WHERE po.gateway = $1 AND po.succeeded_at IS NOT NULL
           AND (po.subscription_ref = $2 OR po.session_id = $3)
         ORDER BY po.subscription_ref IS NOT DISTINCT FROM $2 DESC LIMIT 1",
    )
    .bind(gateway)
    .bind(subscription)
    .bind(first_session)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(mut first) = found else {
        return Ok(None);
    };
    first.started = first
        .subscription_ref
        .as_deref()
        .is_none_or(|r| r == subscription)
        && crate::orders::paid_through(tx, first.order_number, &first.session_id).await?;
    if first.started && first.subscription_ref.is_none() {
        sqlx::query(
            "UPDATE payment_orders SET subscription_ref = $2, updated_at = now()
             WHERE id = $1 AND subscription_ref IS NULL",
        )
        .bind(first.id)
        .bind(subscription)
        .execute(&mut *tx)
        .await?;
    }
    Ok(Some(first))
}

/// What an event waits on while its subscription's first payment is not known: that payment's
/// session where the event names it (its event wakes it), else the gateway's subscription.
fn wait_key(subscription: &str, first_session: Option<&str>) -> String {
    match first_session {
        Some(session) => format!("session:{session}"),
        None => apply::subscription_key(subscription),
    }
}

/// Applies a renewal's facts to the renewal order of its period, in the event's transaction.
pub(super) async fn renewal(
    tx: &mut PgConnection,
    gateway: GatewayName,
    renewal: &Renewal,
    payment: &PaymentRef,
    facts: &[Fact],
    event_id: Option<i64>,
    fee_percent: Decimal,
) -> Result<Outcome, ProcessError> {
    let key = wait_key(&renewal.subscription, renewal.first_session.as_deref());
    apply::lock_keys(tx, gateway, std::slice::from_ref(&key)).await?;
    let Some(first) = first_payment(
        tx,
        gateway,
        &renewal.subscription,
        renewal.first_session.as_deref(),
    )
    .await?
    else {
        return Ok(Applied::Waiting(key).into());
    };
    let Some(period) = renewal.period else {
        // The first period's own charge (the invoice billed when the subscription started):
        // its facts are the first payment's, which learns its payment id from them.
        let of_first = PaymentRef {
            session_id: Some(first.session_id.clone()),
            payment_id: payment.payment_id.clone(),
        };
        return apply::apply(tx, gateway, &of_first, facts, event_id).await;
    };
    let Some(session) = &payment.session_id else {
        return Ok(Applied::Waiting(key).into());
    };
    // What the period costs: the charge a success reports, else (a failure) what the failure
    // says is due, else what the subscription charges.
    let paid = paid_of(facts);
    if !first.started {
        let reason = format!(
            "a charge of subscription {}, a second one for order {}: the payment it names started another subscription, or is not the one its order took",
            renewal.subscription, first.order_number
        );
        return unstarted(
            tx,
            gateway,
            &renewal.subscription,
            payment,
            facts,
            event_id,
            &first,
            reason,
        )
        .await;
    }
    if known_renewal(tx, gateway, session).await? {
        return apply::apply(tx, gateway, payment, facts, event_id).await;
    }
    let amount = match paid.or(renewal.due) {
        Some(m) => m,
        None => match subscriptions::charge_of(tx, first.order_number).await? {
            Some(m) => m,
            None => return Ok(Applied::Waiting(key).into()),
        },
    };
    let reported = Reported {
        period_start: period.start,
        period_end: period.end,
        amount,
        fee: renewal.fee,
        fee_percent,
    };
    let (number, attempt, total, fee) = match subscriptions::open_reported(
        tx,
        first.order_number,
        &reported,
    )
    .await?
    {
        ReportedRenewal::Order {
            number,
            attempt,
            total,
            fee,
        } => (number, attempt, total, fee),
        ReportedRenewal::NoSubscription => {
            // Its first payment confirmed no order (given back, and the gateway asked to
            // stop billing).
            let reason = format!(
                "a renewal of subscription {}, which started no subscription here (its first payment, of order {}, was given back)",
                renewal.subscription, first.order_number
            );
            return unstarted(
                tx,
                gateway,
                &renewal.subscription,
                payment,
                facts,
                event_id,
                &first,
                reason,
            )
            .await;
        }
    };
    // Another charge of a period that has its renewal already (a reissued or manual invoice of
    // the same period): a session of its own, the renewal's next attempt, so its payment
    // confirms the renewal if nothing paid it, else is an extra payment given back. Under the
    // attempt the renewal has, the session was not recorded and its payment kept, unmatched.
    let attempt: i32 = sqlx::query_scalar(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM payment_sessions WHERE order_number = $1 AND attempt = $2)
                     THEN (SELECT max(attempt) + 1 FROM payment_sessions WHERE order_number = $1)
                     ELSE $2 END",
    )
    .bind(number)
    .bind(attempt)
    .fetch_one(&mut *tx)
    .await?;
    let mut metadata: BTreeMap<String, serde_json::Value> =
        serde_json::from_value(first.metadata).unwrap_or_default();
    metadata.insert("order_number".into(), number.to_string().into());
    metadata.insert("attempt".into(), attempt.to_string().into());
    metadata.insert("subscription".into(), renewal.subscription.clone().into());
    sqlx::query(
        "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee, metadata)
         VALUES ($1, $2, $3, $4, $5, $7, $8, $9, $6)
         ON CONFLICT DO NOTHING",
    )
    .bind(number)
    .bind(attempt)
    .bind(gateway)
    .bind(session)
    // Charged off-session, a renewal may have no page to show: its link then names it.
    .bind(
        renewal
            .url
            .clone()
            .unwrap_or_else(|| format!("urn:payfleet:{gateway}:renewal:{session}")),
    )
    .bind(serde_json::to_value(&metadata).unwrap_or_default())
    .bind(total.amount())
    .bind(total.currency().as_str())
    .bind(fee)
    .execute(&mut *tx)
    .await?;
    apply::apply(tx, gateway, payment, facts, event_id).await
}

/// What a charge's facts say was paid: its success's amount.
fn paid_of(facts: &[Fact]) -> Option<crate::money::Money> {
    facts.iter().find_map(|f| match f {
        Fact::Payment {
            status: PaymentStatus::Succeeded,
            amount: Some(m),
        } => Some(*m),
        _ => None,
    })
}

/// A charge of a gateway subscription that started nothing here (its first payment was given
/// back, or started another subscription): charged anyway (before the gateway stopped, or
/// because it could not be stopped), it is a payment no order takes, recorded as unmatched and
/// given back to the buyer, once, and the gateway is asked again to stop billing it.
#[allow(clippy::too_many_arguments)]
async fn unstarted(
    tx: &mut PgConnection,
    gateway: GatewayName,
    subscription: &str,
    payment: &PaymentRef,
    facts: &[Fact],
    event_id: Option<i64>,
    first: &FirstPayment,
    reason: String,
) -> Result<Outcome, ProcessError> {
    let outcome = apply::apply(tx, gateway, payment, facts, event_id).await?;
    if let (Some(paid), Some(session)) = (paid_of(facts), &payment.session_id) {
        let refund = RefundPayment {
            gateway,
            order_number: None,
            session_id: session.clone(),
            payment_id: payment.payment_id.clone(),
            amount: Some(paid),
            seller_account: super::seller_account(&first.metadata),
            reason,
            of_payment: false,
        };
        if apply::give_back_unmatched(tx, &refund).await? {
            let stop = StopUnstartedSubscription {
                gateway,
                subscription: subscription.to_owned(),
                seller_account: refund.seller_account.clone(),
                reason: refund.reason.clone(),
            };
            queue::enqueue(&mut *tx, stop.job_after(session)?).await?;
            tracing::warn!(%gateway, %subscription, session = %session, "a charge of a subscription that started nothing here: giving it back and asking the gateway again to stop it");
        }
    }
    Ok(outcome)
}

/// Whether a renewal's session (Stripe's invoice, ...) is recorded already: a retried charge
/// of the same invoice is the same renewal, whatever its period says.
async fn known_renewal(
    tx: &mut PgConnection,
    gateway: GatewayName,
    session: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM payment_sessions WHERE gateway = $1 AND session_id = $2)",
    )
    .bind(gateway)
    .bind(session)
    .fetch_one(&mut *tx)
    .await
}

/// Records a change the gateway made to a subscription, in the event's transaction.
pub(super) async fn change(
    tx: &mut PgConnection,
    gateway: GatewayName,
    subscription: &str,
    first_session: Option<&str>,
    change: SubscriptionChange,
) -> Result<Applied, ProcessError> {
    // The internal gateway (and the mock, which speaks its events) bills the subscriptions kept
    // here and names them by their own id (collected through Stripe, it names Stripe's
    // subscription instead, as Stripe does).
    if matches!(gateway, GatewayName::Internal | GatewayName::Mock)
        && let Ok(id) = subscription.parse::<SubscriptionId>()
    {
        let Some(first_order) = subscriptions::first_order_of(tx, id, gateway).await? else {
            return Ok(Applied::Unchanged);
        };
        return Ok(
            match subscriptions::apply_change(tx, first_order, change).await? {
                Some(true) => Applied::Changed,
                Some(false) | None => Applied::Unchanged,
            },
        );
    }
    let key = wait_key(subscription, first_session);
    apply::lock_keys(tx, gateway, std::slice::from_ref(&key)).await?;
    let Some(first) = first_payment(tx, gateway, subscription, first_session).await? else {
        return Ok(Applied::Waiting(key));
    };
    // A second gateway subscription for the order (its charges given back, and it stopped):
    // its end is not the subscription's here.
    if !first.started {
        return Ok(Applied::Unchanged);
    }
    Ok(
        match subscriptions::apply_change(tx, first.order_number, change).await? {
            Some(true) => Applied::Changed,
            // Already so, or no subscription here (its first payment was given back).
            Some(false) | None => Applied::Unchanged,
        },
    )
}

#[derive(Debug, thiserror::Error)]
pub enum CancelAtGatewayError {
    #[error(transparent)]
    Cancel(#[from] CancelError),
    /// The gateway that bills it is not enabled here, or keeps no id of it.
    #[error(
        "subscription {id} is billed by {gateway}, which cannot be asked to cancel it here: {why}"
    )]
    NotCancellable {
        id: SubscriptionId,
        gateway: GatewayName,
        why: String,
    },
    #[error("the gateway did not cancel the subscription")]
    Gateway(#[from] crate::gateways::GatewayError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Cancels a subscription now or at its period's end: at the gateway that bills it first (an
/// outage there changes nothing here, and the caller may ask again), then here, once. A
/// subscription the fleet bills itself (the internal gateway's, with the simulator) ends here
/// only; one its gateway bills is named there by the id its first payment's event recorded
/// (the internal gateway's, collected through Stripe, is billed on the platform's account). A
/// canceled subscription is answered as it is, and nothing is asked of the gateway again.
pub async fn cancel(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    id: SubscriptionId,
    at_period_end: bool,
) -> Result<SubscriptionView, CancelAtGatewayError> {
    let Some(sub) = subscriptions::view(pool, id).await? else {
        return Err(CancelError::NotFound(id).into());
    };
    if sub.status == SubscriptionStatus::Canceled {
        return Ok(sub);
    }
    // The gateway's subscription its order's own payment started (a second paid checkout of
    // the order started one too, stopped at the gateway: not this one).
    let started: Vec<(String, Option<String>, String)> = sqlx::query_as(
        "SELECT po.subscription_ref, ps.metadata->>'seller_account', po.session_id
         FROM payment_sessions ps
         JOIN payment_orders po ON po.gateway = ps.gateway AND po.session_id = ps.session_id
         WHERE ps.gateway = $1 AND ps.order_number = $2 AND po.subscription_ref IS NOT NULL
         ORDER BY po.id",
    )
    .bind(sub.gateway)
    .bind(sub.order_number)
    .fetch_all(pool)
    .await?;
    let mut found = None;
    let mut conn = pool.acquire().await?;
    for (reference, account, session) in started {
        if crate::orders::paid_through(&mut conn, sub.order_number, &session).await? {
            found = Some((reference, account));
            break;
        }
    }
    drop(conn);
    let not_cancellable = |why: &str| CancelAtGatewayError::NotCancellable {
        id,
        gateway: sub.gateway,
        why: why.to_owned(),
    };
    let mut at_period_end = at_period_end;
    match found {
        Some((reference, account)) => {
            let gateway = gateways
                .get(sub.gateway)
                .ok_or_else(|| not_cancellable("the gateway is not enabled in this process"))?;
            let end = gateway
                .cancel_subscription(&reference, account.as_deref(), at_period_end)
                .await?;
            // Ended there already (its end's event lost): no end of period will come to end it
            // here, so it ends now.
            if end == SubscriptionEnd::AlreadyEnded {
                at_period_end = false;
            }
        }
        None if sub.gateway == GatewayName::Internal => match gateways.get(GatewayName::Internal) {
            // The fleet bills it (the simulator's sessions are ours): it ends here.
            Some(g) if g.sessions_are_ours() => {}
            // Collected through an acquirer that bills it (Stripe): ended here only, the buyer
            // would go on being charged there.
            Some(_) => {
                return Err(not_cancellable(
                    "its acquirer bills it, and its first payment's event named no subscription of the acquirer's yet",
                ));
            }
            None => {
                return Err(not_cancellable(
                    "the gateway is not enabled in this process",
                ));
            }
        },
        None => {
            return Err(not_cancellable(
                "its first payment's event named no subscription of the gateway's",
            ));
        }
    }
    Ok(subscriptions::cancel(pool, id, at_period_end).await?)
}

/// Stops, at its gateway, a subscription whose first payment no order took (it came after its
/// order expired, or its order was paid through another session, or it was not the order's
/// amount): the payment is given back, no subscription starts here, and the gateway must not
/// bill the buyer for it again every period. Keyed by the subscription, so it is asked once,
/// and once more for each period the gateway bills after all ([`Self::job_after`]: each such
/// charge is given back too). A subscription the gateway says has ended already is stopped; a
/// gateway that refuses leaves the job dead, for an operator to cancel it by hand.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StopUnstartedSubscription {
    pub gateway: GatewayName,
    pub subscription: String,
    pub seller_account: Option<String>,
    pub reason: String,
}

impl Job for StopUnstartedSubscription {
    const KIND: &'static str = "stop_unstarted_subscription";
    const QUEUE: &'static str = "payments";
}

impl StopUnstartedSubscription {
    pub fn job(&self) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?.key(self.key()))
    }

    /// Asked again because the gateway billed the subscription once more (`charge`: that
    /// period's session): the first stop failed for good, or the gateway went on billing after
    /// it. Keyed by the charge, so each period billed asks once, whatever became of the first.
    pub fn job_after(&self, charge: &str) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?.key(format!("{}:{charge}", self.key())))
    }

    fn key(&self) -> String {
        format!(
            "stop_unstarted_subscription:{}:{}",
            self.gateway, self.subscription
        )
    }

    async fn run(&self, gateways: &GatewayRegistry) -> Result<(), JobError> {
        let gateway = gateways.get(self.gateway).ok_or_else(|| {
            JobError::retry(format!(
                "gateway {} is not enabled in this worker; the cancellation waits for one that has it",
                self.gateway
            ))
        })?;
        match gateway
            .cancel_subscription(&self.subscription, self.seller_account.as_deref(), false)
            .await
        {
            Ok(end) => {
                tracing::warn!(gateway = %self.gateway, subscription = %self.subscription, reason = %self.reason, ?end, "a subscription not live here is stopped at its gateway");
                Ok(())
            }
            Err(e) if e.is_transient() => Err(JobError::retry(e)),
            Err(e) => Err(JobError::fail(format!(
                "{} did not cancel subscription {} ({}): {e}; cancel it at the gateway by hand, then discard this job",
                self.gateway, self.subscription, self.reason
            ))),
        }
    }
}

/// Runs [`StopUnstartedSubscription`] with the gateways it asks.
#[derive(Clone)]
pub struct Stopper(pub GatewayRegistry);

impl Worker<StopUnstartedSubscription> for Stopper {
    async fn work(&self, _ctx: JobContext, job: StopUnstartedSubscription) -> Result<(), JobError> {
        job.run(&self.0).await
    }
}
