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
use crate::ledger::LedgerError;
use crate::ledger::coins::CoinError;
use crate::ledger::payouts::PayoutError;
use crate::orders::ReopenError;
use crate::orders::checkout::CheckoutError;
use crate::orders::coins::CoinPaymentError;
use crate::payments::events::ReplayError;
use crate::payments::order_refunds::RefundError;
use crate::queue::QueueError;
use crate::queue::admin::AdminError;
use crate::webhooks::{RejectedWebhook, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    #[error("{message}")]
    Unprocessable { code: &'static str, message: String },
    #[error("the body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("unavailable ({0}); nothing was stored, try again later")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A dependency is down, with what it means for this request.
    #[error("{message}")]
    DependencyDown { code: &'static str, message: String },
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
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
            Self::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::Conflict { code, .. } => (StatusCode::CONFLICT, code),
            Self::Unprocessable { code, .. } => (StatusCode::UNPROCESSABLE_ENTITY, code),
            Self::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            Self::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Self::DependencyDown { code, .. } => (StatusCode::SERVICE_UNAVAILABLE, code),
            Self::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        self.log();
        let mut resp = (
            status,
            Json(json!({"error": {"code": code, "message": self.to_string()}})),
        )
            .into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("5"));
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
            Self::Unavailable(Box::new(e))
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
            Self::Unavailable(e) => tracing::warn!(error = %e, "answering 503"),
            Self::DependencyDown { message, .. } => tracing::warn!(%message, "answering 503"),
            Self::Internal(e) => tracing::error!(error = %e, "answering 500"),
            _ => {}
        }
    }

    /// A body that could not be read: too large for `limit`, or broken.
    pub fn from_body(r: BytesRejection, limit: usize) -> Self {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::PayloadTooLarge(limit)
        } else {
            Self::bad_request(r.body_text())
        }
    }
}

impl From<RejectedWebhook> for ApiError {
    fn from(e: RejectedWebhook) -> Self {
        match e {
            RejectedWebhook::Disabled(_) => Self::NotFound(e.to_string()),
            RejectedWebhook::Signature(_) => Self::Unauthorized(e.to_string()),
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
            CheckoutError::LinksUnavailable { .. } => Self::DependencyDown {
                code: "payment_link_unavailable",
                message,
            },
            CheckoutError::LinksRefused { .. } => unprocessable("payment_link_refused"),
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
            RefundError::Queue(e) => e.into(),
            RefundError::Database(e) => e.into(),
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
            CoinPaymentError::NotPayable { .. } => Self::Conflict {
                code: "order_not_payable",
                message,
            },
            CoinPaymentError::Refused { code, .. } => Self::Unprocessable {
                code: if code == "coins_insufficient" {
                    "coins_insufficient"
                } else {
                    "coins_refused"
                },
                message,
            },
            CoinPaymentError::Unavailable(_) => Self::DependencyDown {
                code: "coins_unavailable",
                message,
            },
            CoinPaymentError::Ledger(e) => e.into(),
            CoinPaymentError::Queue(e) => e.into(),
            CoinPaymentError::Database(e) => e.into(),
        }
    }
}
