//! Refunding a payment that arrived after its order expired (the stated rule: the order stays
//! expired and the buyer gets the money back, automatically, once). The job is keyed by the
//! session and the gateway is asked with an idempotency key of its own, so the refund happens
//! once however often the job runs; the gateway's refund event then records it as any refund.

use serde::{Deserialize, Serialize};

use crate::gateways::api::RefundRequest;
use crate::gateways::{GatewayName, GatewayRegistry};
use crate::money::Money;
use crate::queue::{Job, JobError, NewJob, QueueError};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RefundLatePayment {
    pub gateway: GatewayName,
    pub order_number: i64,
    pub session_id: String,
    pub payment_id: String,
    pub amount: Money,
    pub seller_account: Option<String>,
}

impl Job for RefundLatePayment {
    const KIND: &'static str = "refund_late_payment";
    const QUEUE: &'static str = "payments";
}

impl RefundLatePayment {
    pub fn job(&self) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?.key(format!("late_refund:{}:{}", self.gateway, self.session_id)))
    }

    pub async fn run(&self, gateways: &GatewayRegistry) -> Result<(), JobError> {
        let gateway = gateways.get(self.gateway).ok_or_else(|| {
            JobError::retry(format!(
                "gateway {} is not enabled in this worker; the refund waits for one that has it",
                self.gateway
            ))
        })?;
        let request = RefundRequest {
            session_id: self.session_id.clone(),
            payment_id: self.payment_id.clone(),
            amount: self.amount,
            seller_account: self.seller_account.clone(),
            idempotency_key: format!("payfleet-late-refund-{}-{}", self.gateway, self.session_id),
        };
        match gateway.refund(&request).await {
            Ok(receipt) => {
                tracing::info!(gateway = %self.gateway, order = self.order_number, refund = %receipt.refund_id, "late payment refunded");
                Ok(())
            }
            Err(e) if e.is_transient() => Err(JobError::retry(e)),
            Err(e) => Err(JobError::fail(e)),
        }
    }
}
