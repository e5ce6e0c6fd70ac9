//! The payment side of the payment-link RPC: one gateway session per order and payment attempt,
//! created once. Asking again (a retry after a timeout) returns the same session; the gateway is
//! asked with an idempotency key per order and attempt (unique across installations), so even
//! two requests racing create one session where the gateway honours it, and the first stored
//! wins.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use sqlx::PgPool;

use crate::gateways::GatewayRegistry;
use crate::gateways::api::SessionRequest;
use crate::messaging::rpc::{Handler, PaymentLink, PaymentLinkReply, PaymentLinkRequest};

pub struct LinkService {
    pub pool: PgPool,
    pub gateways: GatewayRegistry,
}

fn failed(code: &str, message: impl Into<String>, retryable: bool) -> PaymentLinkReply {
    PaymentLinkReply::Failed {
        code: code.to_owned(),
        message: message.into(),
        retryable,
    }
}

impl LinkService {
    pub async fn link(&self, r: PaymentLinkRequest) -> PaymentLinkReply {
        match self.stored(r.order_number, r.attempt).await {
            Ok(Some((session_id, url))) => return PaymentLinkReply::Created { session_id, url },
            Ok(None) => {}
            Err(e) => return failed("unavailable", e.to_string(), true),
        }
        let Some(gateway) = self.gateways.get(r.gateway) else {
            return failed(
                "gateway_unavailable",
                format!("gateway {} is not enabled on the payment side", r.gateway),
                false,
            );
        };
        let mut metadata = BTreeMap::new();
        metadata.insert("order_number".to_owned(), r.order_number.to_string());
        metadata.insert("attempt".to_owned(), r.attempt.to_string());
        metadata.insert("seller_id".to_owned(), r.seller_id.clone());
        metadata.insert(
            "platform_fee".to_owned(),
            r.platform_fee.amount().to_string(),
        );
        if let Some(net) = r.amount.checked_sub(&r.platform_fee) {
            metadata.insert("seller_net".to_owned(), net.amount().to_string());
        }
        if let Some(account) = &r.seller_account {
            metadata.insert("seller_account".to_owned(), account.clone());
        }
        let request = SessionRequest {
            order_number: r.order_number,
            attempt: r.attempt,
            amount: r.amount,
            platform_fee: r.platform_fee,
            seller_account: r.seller_account.clone(),
            description: r.description.clone(),
            recurring_interval: r.recurring_interval.clone(),
            metadata: metadata.clone(),
            idempotency_key: format!("payfleet-{}", r.link_key),
            reference: format!("pf-{}", r.link_key),
            expires_at: r.expires_at,
        };
        let session = match gateway.create_session(&request).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(order = r.order_number, gateway = %r.gateway, error = %e, "the gateway did not create a session");
                return failed(e.code(), e.to_string(), e.is_transient());
            }
        };
        let stored = self.store(&r, &session, &metadata).await;
        match stored {
            Ok((session_id, url)) => PaymentLinkReply::Created { session_id, url },
            Err(e) => failed("unavailable", e.to_string(), true),
        }
    }

    /// Keeps the session; the first stored wins when two requests raced (the gateway was asked
    /// with the same idempotency key, so it is normally the same session anyway).
    async fn store(
        &self,
        r: &PaymentLinkRequest,
        session: &crate::gateways::api::Session,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(String, String), sqlx::Error> {
        // Committed without waiting for its flush: the link reaches a buyer only once the order
        // side has stored it with a synchronous commit, which flushes this one too (the log is
        // one sequence). Lost in a crash before that, the link is asked again, and the gateway,
        // asked with the same idempotency key, gives the same session.
        let stored: Option<(String, String)> = sqlx::query_as(
            "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee, metadata)
             SELECT $1, $9, $2, $3, $4, $5, $6, $7, $8
             FROM (SELECT set_config('synchronous_commit', 'off', true)) c
             ON CONFLICT (order_number, attempt) DO NOTHING
             RETURNING session_id, url",
        )
        .bind(r.order_number)
        .bind(r.gateway)
        .bind(&session.session_id)
        .bind(&session.url)
        .bind(r.amount.amount())
        .bind(r.amount.currency().as_str())
        .bind(r.platform_fee.amount())
        .bind(serde_json::to_value(metadata).unwrap_or_default())
        .bind(r.attempt)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(stored) = stored {
            return Ok(stored);
        }
        // Another request stored one first: a separate statement sees its row.
        self.stored(r.order_number, r.attempt)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    async fn stored(
        &self,
        order: i64,
        attempt: i32,
    ) -> Result<Option<(String, String)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT session_id, url FROM payment_sessions WHERE order_number = $1 AND attempt = $2",
        )
        .bind(order)
        .bind(attempt)
        .fetch_optional(&self.pool)
        .await
    }
}

impl Handler<PaymentLink> for LinkService {
    fn handle(
        &self,
        request: PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = PaymentLinkReply> + Send + '_>> {
        Box::pin(self.link(request))
    }
}
