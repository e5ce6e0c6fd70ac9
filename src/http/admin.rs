//! The admin API: `Authorization: Bearer $PAYFLEET_ADMIN_TOKEN` (401 without it, 403 with a
//! wrong one). Without a configured token the admin API is off, and says so.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use subtle::ConstantTimeEq;

use super::{ApiError, AppState, JsonBody};
use crate::catalogue::{self, NewCoupon, NewProduct, NewSeller};
use crate::orders;
use crate::secret::Secret;

pub(super) fn routes(state: AppState) -> axum::Router {
    axum::Router::new()
        .route("/admin/sellers", post(create_seller))
        .route("/admin/products", post(create_product))
        .route("/admin/coupons", post(create_coupon))
        .route("/admin/orders/{number}/expire", post(expire_order))
        .route("/admin/unmatched-payments", get(unmatched))
        .with_state(state)
}

/// Checks the bearer token in constant time.
pub(super) fn authorize(token: Option<&Secret>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = token else {
        return Err(ApiError::Forbidden(
            "the admin API is off: set PAYFLEET_ADMIN_TOKEN to turn it on".into(),
        ));
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::Unauthorized("send Authorization: Bearer <admin token>".into()))?;
    if bool::from(given.trim().as_bytes().ct_eq(token.expose().as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::Forbidden("wrong admin token".into()))
    }
}

async fn create_seller(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<NewSeller>,
) -> Result<(StatusCode, Json<catalogue::Seller>), ApiError> {
    authorize(state.admin_token.as_ref(), &headers)?;
    let seller = catalogue::create_seller(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(seller)))
}

async fn create_product(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<NewProduct>,
) -> Result<(StatusCode, Json<catalogue::Product>), ApiError> {
    authorize(state.admin_token.as_ref(), &headers)?;
    let product = catalogue::create_product(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(product)))
}

async fn create_coupon(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<NewCoupon>,
) -> Result<(StatusCode, Json<catalogue::Coupon>), ApiError> {
    authorize(state.admin_token.as_ref(), &headers)?;
    let coupon = catalogue::create_coupon(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(coupon)))
}

/// Ends the wait of an unpaid order now: the workers expire it (its coupon given back).
async fn expire_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(raw): Path<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    authorize(state.admin_token.as_ref(), &headers)?;
    let number = super::orders::number(&raw)?;
    orders::expire_now(&state.pool, number).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"number": number, "status": "expiring"})),
    ))
}

/// Payments no checkout asked for, for an operator to look into.
async fn unmatched(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(state.admin_token.as_ref(), &headers)?;
    let list = crate::payments::events::unmatched(&state.pool, 200).await?;
    Ok(Json(serde_json::json!({ "unmatched_payments": list })))
}
