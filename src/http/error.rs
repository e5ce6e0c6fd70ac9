//! The one HTTP error type: every failure a handler can meet, and its status, in one place.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::db::is_transient;
use crate::queue::QueueError;
use crate::webhooks::{RejectedWebhook, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    NotFound(String),
    #[error("the body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("unavailable ({0}); nothing was stored, try again later")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ApiError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Self::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            Self::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Self::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        match &self {
            Self::Unavailable(e) => tracing::warn!(error = %e, "answering 503"),
            Self::Internal(e) => tracing::error!(error = %e, "answering 500"),
            _ => {}
        }
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

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Database(e) => e.into(),
            other => Self::Internal(Box::new(other)),
        }
    }
}

impl ApiError {
    /// A body that could not be read: too large for `limit`, or broken.
    pub fn from_body(r: BytesRejection, limit: usize) -> Self {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::PayloadTooLarge(limit)
        } else {
            Self::BadRequest(r.body_text())
        }
    }
}

impl From<RejectedWebhook> for ApiError {
    fn from(e: RejectedWebhook) -> Self {
        match e {
            RejectedWebhook::Disabled(_) => Self::NotFound(e.to_string()),
            RejectedWebhook::Signature(_) => Self::Unauthorized(e.to_string()),
            RejectedWebhook::Malformed(_) => Self::BadRequest(e.to_string()),
            RejectedWebhook::Aborted(_) => Self::Internal(Box::new(e)),
        }
    }
}
