//! The internal gateway bills its own subscriptions (`subscription_billing`, a recurring job):
//! each pass cancels the past-due subscriptions that cannot recover, opens a renewal order per
//! (subscription, period) that ended (`orders::subscriptions::open_due`), and charges every
//! renewal waiting for it: a new one, or a failed one's next attempt. A charge goes through the
//! gateway's session like a buyer's payment and comes back as its signed event
//! (`subscription.renewed` or `subscription.renewal_failed`), so the renewal order is confirmed,
//! and its sale posted, by the same event path as any order, once.
//!
//! Only the simulator charges here (its answer set per subscription by
//! `POST /admin/subscriptions/{id}/simulate`). Where the internal gateway collects through
//! Stripe on the platform's account (`PAYFLEET_INTERNAL_ACQUIRER=stripe`), its subscription
//! checkouts start Stripe subscriptions there, and Stripe bills each period: its invoices come
//! back as the internal gateway's renewals (`payments::subscriptions`), so this pass has
//! nothing to charge.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sqlx::PgPool;

use crate::gateways::GatewayName;
use crate::gateways::hosted::{HostedGateway, Outcome, RenewalCharge};
use crate::messaging::rpc::{PaymentLinkReply, PaymentLinkRequest, PaymentLinks, RpcError};
use crate::orders::subscriptions::{self, Billing};
use crate::orders::{self, checkout};
use crate::payments::links::LinkService;
use payfleet_queue::JobError;

/// Renewals charged per pass at most; the rest wait for the next one.
const PER_PASS: i64 = 500;

/// In a worker the payment side is this process: its links are made without the RPC.
impl PaymentLinks for LinkService {
    fn create<'a>(
        &'a self,
        request: &'a PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = Result<PaymentLinkReply, RpcError>> + Send + 'a>> {
        Box::pin(async move { Ok(self.link(request.clone()).await) })
    }
}

/// What the billing pass needs: the payment side's links, the internal gateway (where its
/// payments are simulated), how renewals are priced and how long a period is.
pub struct Biller {
    pub links: LinkService,
    pub internal: Option<HostedGateway>,
    pub billing: Billing,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub opened: usize,
    pub charged: usize,
    pub canceled: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    #[error(transparent)]
    Queue(#[from] payfleet_queue::QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Gateway(#[from] crate::gateways::GatewayError),
}

impl From<BillingError> for JobError {
    fn from(e: BillingError) -> Self {
        // Every step is idempotent: the next attempt (or pass) goes on where this one stopped.
        JobError::retry(e)
    }
}

/// One billing pass.
pub async fn bill(pool: &PgPool, biller: &Biller) -> Result<Report, BillingError> {
    let Some(internal) = &biller.internal else {
        tracing::debug!(
            "subscription billing: the internal gateway's acquirer bills its subscriptions; nothing to charge here"
        );
        return Ok(Report::default());
    };
    let gateway = GatewayName::Internal;
    let opened = subscriptions::open_due(pool, gateway, &biller.billing, PER_PASS).await?;
    let mut report = Report {
        opened: opened.renewals,
        canceled: opened.canceled,
        charged: 0,
    };
    for renewal in subscriptions::to_charge(pool, gateway, PER_PASS).await? {
        let Some(order) = orders::view(pool, renewal.number).await? else {
            continue;
        };
        let session = match order.payment {
            Some(link) => link.session_id,
            None => match checkout::link(pool, &biller.links, &order, biller.billing.fee_percent)
                .await
            {
                Ok(Some(link)) => link.session_id,
                // Stored meanwhile by another pass: it charges it.
                Ok(None) => continue,
                Err((reason, _)) => {
                    tracing::warn!(order = renewal.number, %reason, "no session for the renewal; the next pass tries again");
                    continue;
                }
            },
        };
        let outcome = if renewal.simulated_success {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        };
        let charge = RenewalCharge {
            subscription_id: renewal.subscription_id.to_string(),
            period_start: renewal.period_start,
            period_end: renewal.period_end,
        };
        internal.charge_renewal(&session, outcome, &charge).await?;
        report.charged += 1;
    }
    Ok(report)
}

/// The `subscription_billing` recurring job.
pub fn add_task(tasks: &mut crate::recurring::Tasks, biller: Biller) {
    let biller = Arc::new(biller);
    tasks.add("subscription_billing", move |pool, _period| {
        let biller = biller.clone();
        async move {
            let r = bill(&pool, &biller).await?;
            tracing::info!(
                opened = r.opened,
                charged = r.charged,
                canceled = r.canceled,
                "subscription billing done"
            );
            Ok(())
        }
    });
}
