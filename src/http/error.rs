//! The one HTTP error type: every failure a handler can meet, its status and its code, in one
//! place. Domain errors map here (and only here) to their answers; database constraint names
//! have already been turned into domain errors by their contexts.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::catalogue::CatalogueError;
use crate::db::is_transient;
use crate::gateways::GatewayError;
use crate::ledger::LedgerError;
use crate::ledger::coins::CoinError;
use crate::ledger::payouts::PayoutError;
use crate::orders::ReopenError;
use crate::orders::checkout::CheckoutError;
use crate::orders::coin_payment::CoinPaymentError;
use crate::orders::subscriptions::CancelError;
use crate::payments::events::ReplayError;
use crate::payments::order_refunds::RefundError;
use crate::payments::subscriptions::CancelAtGatewayError;
use crate::webhooks::{RejectedWebhook, StoreError};
use payfleet_queue::QueueError;
use payfleet_queue::admin::AdminError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    /// No credential, or one that is not ours (an unknown or revoked key).
    #[error("{0}")]
    Unauthenticated(String),
    /// A credential that may not do this.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// The endpoint exists but does not take the request's method (its `Allow` header says
    /// which it takes).
    #[error("this endpoint does not take that method; its Allow header lists those it takes")]
    MethodNotAllowed,
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    #[error("{message}")]
    Unprocessable { code: &'static str, message: String },
    /// A body of another media type than the endpoint reads (it reads JSON).
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("the body is larger than this endpoint takes{}", .0.map(|n| format!(" ({n} bytes)")).unwrap_or_default())]
    PayloadTooLarge(Option<usize>),
    /// The body did not arrive within the time a request is given.
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    /// Too many failed credentials from this address.
    #[error("too many failed attempts from this address; try again in {} s", .0.as_secs().max(1))]
    TooManyRequests(std::time::Duration),
    #[error("the service is unavailable; nothing was stored, try again later")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A dependency is down: `message` says what it means for this request (and is answered),
    /// `detail` why (and is only logged).
    #[error("{message}")]
    DependencyDown {
        code: &'static str,
        message: String,
        detail: String,
    },
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

tokio::task_local! {
    /// The id of the request being answered (set by the request span), so that an error's
    /// answer and its log line name the same request.
    pub(super) static REQUEST_ID: String;
}

pub(super) fn request_id() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::BadRequest {
            code: "bad_request",
            message: message.into(),
        }
    }

    pub(super) fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            Self::BadRequest { code, .. } => (StatusCode::BAD_REQUEST, code),
            Self::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            Self::Conflict { code, .. } => (StatusCode::CONFLICT, code),
            Self::Unprocessable { code, .. } => (StatusCode::UNPROCESSABLE_ENTITY, code),
            Self::UnsupportedMediaType(_) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            Self::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            Self::BodyTimeout => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            Self::TooManyRequests(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"),
            Self::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Self::DependencyDown { code, .. } => (StatusCode::SERVICE_UNAVAILABLE, code),
            Self::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }

    /// What the caller is told. A 5xx says only what it means for the request: the internal
    /// error's own text (the database's, the broker's, a gateway's) goes to the log, under the
    /// same request id.
    pub(super) fn public_message(&self) -> String {
        match self {
            Self::Internal(_) => {
                "an internal error: the log has what happened, under this request id".into()
            }
            other => other.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        self.log();
        let mut error = json!({"code": code, "message": self.public_message()});
        if let Some(id) = request_id() {
            error["request_id"] = serde_json::Value::String(id);
        }
        let mut resp = (status, Json(json!({ "error": error }))).into_response();
        let retry_after = match &self {
            Self::TooManyRequests(left) => Some(left.as_secs().max(1)),
            _ if status == StatusCode::SERVICE_UNAVAILABLE => Some(5),
            _ => None,
        };
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from(secs));
        }
        if matches!(self, Self::BodyTimeout) {
            // The rest of the body may never come: the connection is not kept.
            resp.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        resp
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if is_transient(&e) {
            Self::Unavailable(Box::new(e))
        } else {
            Self::Internal(Box::new(e))
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        if e.is_unavailable() {
            // Its own words say why (the writer's queue is full, the database is down), never
            // the driver's: those are only in the detail, which is logged.
            Self::DependencyDown {
                code: "unavailable",
                message: format!("{e}; nothing was stored, send it again later"),
                detail: payfleet_queue::error_chain(&e),
            }
        } else {
            Self::Internal(Box::new(e))
        }
    }
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::NotFound(_) => Self::NotFound(e.to_string()),
            AdminError::WrongState { .. } => Self::Conflict {
                code: "job_state",
                message: e.to_string(),
            },
            AdminError::KeyTaken { .. } => Self::Conflict {
                code: "job_key_taken",
                message: e.to_string(),
            },
            AdminError::Database(e) => e.into(),
        }
    }
}

impl From<ReplayError> for ApiError {
    fn from(e: ReplayError) -> Self {
        match e {
            ReplayError::NotFound(_) => Self::NotFound(e.to_string()),
            ReplayError::AlreadyProcessed { .. } => Self::Conflict {
                code: "event_processed",
                message: e.to_string(),
            },
            ReplayError::Queue(e) => e.into(),
            ReplayError::Database(e) => e.into(),
        }
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Database(e) => e.into(),
            other => Self::Internal(Box::new(other)),
        }
    }
}

impl ApiError {
    /// Logs what an operator needs to know about a failure answered by a 5xx.
    pub(super) fn log(&self) {
        match self {
            Self::Unavailable(e) => {
                tracing::warn!(error = %payfleet_queue::error_chain(e.as_ref()), "answering 503")
            }
            Self::DependencyDown {
                message, detail, ..
            } => tracing::warn!(%message, %detail, "answering 503"),
            Self::Internal(e) => {
                tracing::error!(error = %payfleet_queue::error_chain(e.as_ref()), "answering 500")
            }
            _ => {}
        }
    }

    /// A body that could not be read: too large for `limit` (when known), too slow, or broken.
    pub fn from_body(r: BytesRejection, limit: Option<usize>) -> Self {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::PayloadTooLarge(limit)
        } else if super::server::is_body_timeout(&r) {
            Self::BodyTimeout
        } else {
            Self::bad_request(r.body_text())
        }
    }
}

impl From<RejectedWebhook> for ApiError {
    fn from(e: RejectedWebhook) -> Self {
        match e {
            RejectedWebhook::Disabled(_) => Self::NotFound(e.to_string()),
            RejectedWebhook::Signature(_) => Self::Unauthenticated(e.to_string()),
            RejectedWebhook::Malformed(_) => Self::bad_request(e.to_string()),
            RejectedWebhook::Aborted(_) => Self::Internal(Box::new(e)),
        }
    }
}

impl From<CatalogueError> for ApiError {
    fn from(e: CatalogueError) -> Self {
        let message = e.to_string();
        match e {
            CatalogueError::Invalid { .. } => Self::Unprocessable {
                code: "invalid_request",
                message,
            },
            CatalogueError::UnknownSeller(_) => Self::Unprocessable {
                code: "unknown_seller",
                message,
            },
            CatalogueError::UnknownProduct(_) => Self::Unprocessable {
                code: "unknown_product",
                message,
            },
            CatalogueError::CodeTaken(_) => Self::Conflict {
                code: "coupon_code_taken",
                message,
            },
            CatalogueError::Database(e) => e.into(),
        }
    }
}

impl From<CheckoutError> for ApiError {
    fn from(e: CheckoutError) -> Self {
        let message = e.to_string();
        let unprocessable = |code| Self::Unprocessable {
            code,
            message: message.clone(),
        };
        match e {
            CheckoutError::MissingKey => Self::BadRequest {
                code: "missing_idempotency_key",
                message,
            },
            CheckoutError::BadKey => Self::BadRequest {
                code: "invalid_idempotency_key",
                message,
            },
            CheckoutError::BadRequest(_) => Self::bad_request(message),
            CheckoutError::KeyReused => unprocessable("idempotency_key_reused"),
            CheckoutError::KeyInUse => Self::Conflict {
                code: "idempotency_key_in_use",
                message,
            },
            CheckoutError::UnknownProduct(_) => unprocessable("unknown_product"),
            CheckoutError::InvalidItems(_) => unprocessable("invalid_items"),
            CheckoutError::CouponUnavailable(_) => unprocessable("coupon_unavailable"),
            CheckoutError::GatewayUnavailable(_) => unprocessable("gateway_unavailable"),
            CheckoutError::InvalidBuyer(_) => unprocessable("invalid_request"),
            CheckoutError::LinksUnavailable { orders, reason } => Self::DependencyDown {
                code: "payment_link_unavailable",
                message: format!(
                    "orders {orders:?} are kept, but the payment side did not give their payment links; send the same request again, or POST /orders/{{number}}/payment, to get them"
                ),
                detail: reason,
            },
            CheckoutError::LinksRefused { .. } => unprocessable("payment_link_refused"),
            CheckoutError::Deadline(_) => Self::Unavailable(Box::new(e)),
            CheckoutError::Queue(e) => e.into(),
            CheckoutError::Database(e) => e.into(),
        }
    }
}

impl From<ReopenError> for ApiError {
    fn from(e: ReopenError) -> Self {
        let message = e.to_string();
        match e {
            ReopenError::NotFound(_) => Self::NotFound(message),
            ReopenError::NotPayable { .. } => Self::Conflict {
                code: "order_not_payable",
                message,
            },
            ReopenError::Renewal(_) => Self::Conflict {
                code: "renewal_not_reopenable",
                message,
            },
            ReopenError::Queue(e) => e.into(),
            ReopenError::Database(e) => e.into(),
        }
    }
}

impl From<RefundError> for ApiError {
    fn from(e: RefundError) -> Self {
        let message = e.to_string();
        match e {
            RefundError::NoOrder(_) | RefundError::NoRequest(_) => Self::NotFound(message),
            RefundError::NotRefundable { .. } => Self::Conflict {
                code: "order_not_refundable",
                message,
            },
            RefundError::InvalidAmount(_) | RefundError::InvalidReason => Self::Unprocessable {
                code: "invalid_request",
                message,
            },
            RefundError::Exceeds { .. } => Self::Unprocessable {
                code: "refund_exceeds_payment",
                message,
            },
            RefundError::KeyReused => Self::Unprocessable {
                code: "idempotency_key_reused",
                message,
            },
            RefundError::GatewayDisabled(_) => Self::Unprocessable {
                code: "gateway_unavailable",
                message,
            },
            RefundError::Record(e) if e.is_transient() => Self::Unavailable(Box::new(e)),
            RefundError::Record(e) => Self::Internal(Box::new(e)),
            RefundError::Coins(crate::ledger::coins::CoinError::Database(e))
            | RefundError::Coins(crate::ledger::coins::CoinError::Ledger(
                crate::ledger::LedgerError::Database(e),
            )) => e.into(),
            RefundError::Coins(e) => Self::Internal(Box::new(e)),
            RefundError::Queue(e) => e.into(),
            RefundError::Database(e) => e.into(),
        }
    }
}

impl From<CancelAtGatewayError> for ApiError {
    fn from(e: CancelAtGatewayError) -> Self {
        let message = e.to_string();
        match e {
            CancelAtGatewayError::Cancel(CancelError::NotFound(_)) => Self::NotFound(message),
            CancelAtGatewayError::Cancel(CancelError::Queue(e)) => e.into(),
            CancelAtGatewayError::Cancel(CancelError::Database(e))
            | CancelAtGatewayError::Database(e) => e.into(),
            CancelAtGatewayError::NotCancellable { .. } => Self::Conflict {
                code: "cancel_not_supported",
                message,
            },
            CancelAtGatewayError::Gateway(GatewayError::Database(e)) => e.into(),
            CancelAtGatewayError::Gateway(e)
                if e.is_transient() || e.is_ours() || e.is_the_platforms() =>
            {
                Self::DependencyDown {
                code: "gateway_unavailable",
                message: "the gateway could not be asked to cancel the subscription; nothing changed, try again".into(),
                detail: payfleet_queue::error_chain(&e),
                }
            }
            CancelAtGatewayError::Gateway(e) => Self::Conflict {
                code: "gateway_refused",
                message: format!("the gateway refused to cancel the subscription: {e}"),
            },
        }
    }
}

impl From<PayoutError> for ApiError {
    fn from(e: PayoutError) -> Self {
        let message = e.to_string();
        match e {
            PayoutError::NotFound(_) => Self::NotFound(message),
            PayoutError::Decided { .. } => Self::Conflict {
                code: "payout_decided",
                message,
            },
            PayoutError::Ledger(e) => e.into(),
            PayoutError::Database(e) => e.into(),
            other @ PayoutError::Sellers { .. } => Self::Internal(Box::new(other)),
        }
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Database(e) => e.into(),
            other => Self::Internal(Box::new(other)),
        }
    }
}

impl From<CoinError> for ApiError {
    fn from(e: CoinError) -> Self {
        let message = e.to_string();
        match e {
            CoinError::Insufficient { .. } => Self::Unprocessable {
                code: "coins_insufficient",
                message,
            },
            CoinError::UnknownReservation(_) => Self::NotFound(message),
            CoinError::Decided { .. } => Self::Conflict {
                code: "reservation_decided",
                message,
            },
            CoinError::Conflict(_) => Self::Unprocessable {
                code: "idempotency_key_reused",
                message,
            },
            CoinError::Ledger(e) => e.into(),
            CoinError::Database(e) => e.into(),
        }
    }
}

impl From<CoinPaymentError> for ApiError {
    fn from(e: CoinPaymentError) -> Self {
        let message = e.to_string();
        match e {
            CoinPaymentError::NotFound(_) => Self::NotFound(message),
            CoinPaymentError::NotPayable { .. } | CoinPaymentError::Subscription(_) => {
                Self::Conflict {
                    code: "order_not_payable",
                    message,
                }
            }
            CoinPaymentError::Refused { code, .. } => Self::Unprocessable {
                code: if code == "coins_insufficient" {
                    "coins_insufficient"
                } else {
                    "coins_refused"
                },
                message,
            },
            CoinPaymentError::Unavailable(detail) => Self::DependencyDown {
                code: "coins_unavailable",
                message: "the coins service did not answer; nothing was spent, ask again".into(),
                detail,
            },
            CoinPaymentError::Ledger(e) => e.into(),
            CoinPaymentError::Queue(e) => e.into(),
            CoinPaymentError::Database(e) => e.into(),
        }
    }
}
