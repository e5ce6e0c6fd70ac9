//! `POST /webhooks/{gateway}`: verify, store, answer. Every refusal is counted by gateway and
//! reason (`payfleet_webhooks_refused_total`), so a wrong secret shows on a dashboard.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Query, Request, State};
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

/// The delivery is stored (or was before: a gateway's retry).
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct Receipt {
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

/// A gateway's signed event: verified over the raw body by the gateway's own scheme, stored
/// once (a delivery seen before answers `duplicate`), processed by the workers.
#[utoipa::path(
    post,
    path = "/webhooks/{gateway}",
    tag = "webhooks",
    params(("gateway" = GatewayName, Path, description = "Whose event: the gateway's own signature scheme checks it.")),
    request_body(content = Object, content_type = "application/json", description = "The event as the gateway signed it (Mercado Pago: its notification)."),
    responses(
        (status = 200, description = "Stored, or stored before.", body = Receipt),
        (status = 400, description = "`bad_request`: malformed (the signed body does not read as the gateway's event).", body = super::openapi::ErrorBody),
        (status = 401, description = "`unauthenticated`: a missing or wrong signature, or a timestamp out of tolerance.", body = super::openapi::ErrorBody),
        (status = 404, description = "`not_found`: an unknown gateway, or one not enabled here.", body = super::openapi::ErrorBody),
        (status = 408, description = "`request_timeout`: the body did not arrive in time.", body = super::openapi::ErrorBody),
        (status = 413, description = "`payload_too_large`: a body over `PAYFLEET_WEBHOOK_BODY_LIMIT`.", body = super::openapi::ErrorBody),
        (status = 503, description = "`unavailable`: the event could not be stored; the gateway retries (`Retry-After`).", body = super::openapi::ErrorBody),
    ),
)]
async fn receive(
    _caller: Gateway,
    State(state): State<WebhookState>,
    Path(gateway): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    request: Request,
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
    // Read only now: a name no gateway of ours answers to costs its sender no body read.
    let body = Bytes::from_request(request, &()).await.map_err(|r| {
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
