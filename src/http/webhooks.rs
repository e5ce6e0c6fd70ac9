//! `POST /webhooks/{gateway}`: verify, store, answer. Every refusal is counted by gateway and
//! reason (`payfleet_webhooks_refused_total`), so a wrong secret shows on a dashboard.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::post;
use serde::Serialize;

use super::callers::Gateway;
use super::{ApiError, Routes};
use crate::gateways::GatewayName;
use crate::webhooks::{Delivery, Stored};

/// What the webhook route: the verifier, the batching writer, the counters the metrics read and the body limit.
#[derive(Clone)]
pub struct WebhookState {
    pub verifier: crate::webhooks::Verifier,
    pub events: crate::webhooks::EventWriter,
    pub counters: std::sync::Arc<super::WebhookCounters>,
    /// The largest body taken (its refusal names it).
    pub body_limit: usize,
}

#[derive(Serialize)]
struct Receipt {
    status: Stored,
}

pub(super) fn routes(state: WebhookState) -> Routes {
    let body_limit = state.body_limit;
    Routes::default()
        .route(
            "/webhooks/{gateway}",
            post(receive).layer(DefaultBodyLimit::max(body_limit)),
        )
        .with_state(state)
}

async fn receive(
    _caller: Gateway,
    State(state): State<WebhookState>,
    Path(gateway): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Receipt>, ApiError> {
    // An unknown name is not counted by name: the sender chooses it.
    let gateway: GatewayName = gateway
        .parse()
        .map_err(|_| ApiError::NotFound(format!("unknown gateway {gateway:?}")))?;
    let refused = |reason: &'static str| state.counters.refused(gateway, reason);
    if !state.verifier.enabled(gateway) {
        refused("disabled");
        return Err(ApiError::NotFound(format!(
            "gateway {gateway} is not enabled"
        )));
    }
    let body = body.map_err(|r| {
        let e = ApiError::from_body(r, Some(state.body_limit));
        refused(match e {
            ApiError::PayloadTooLarge(_) => "too_large",
            _ => "unreadable_body",
        });
        e
    })?;
    let webhook = state
        .verifier
        .verify(Delivery {
            gateway,
            headers,
            query,
            body,
        })
        .await
        .inspect_err(|e| refused(e.reason()))?;
    let status = state.events.store(webhook).await.inspect_err(|e| {
        refused(if e.is_unavailable() {
            "unavailable"
        } else {
            "store_refused"
        })
    })?;
    state.counters.received(gateway, status);
    Ok(Json(Receipt { status }))
}
