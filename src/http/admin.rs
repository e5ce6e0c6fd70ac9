//! The admin API: `Authorization: Bearer $PAYFLEET_ADMIN_TOKEN` (401 without it, 403 with a
//! wrong one), every handler taking an [`Operator`]. Without a configured token the admin API
//! is off, and says so.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{delete, get, post};

use super::callers::Operator;
use super::{ApiError, JsonBody, Routes};
use crate::auth::api_keys::{self, ApiKeyError, NewApiKey};
use crate::catalogue::{self, NewCoupon, NewProduct, NewSeller};
use crate::ledger::coins;
use crate::ledger::payouts::{self, PayoutState};
use crate::orders;
use crate::orders::checkout::idempotency_key;
use crate::payments::order_refunds::{
    self, CarriedOut, NewRefund, RefundError, RefundState, RefundView,
};
use crate::recurring;

/// What the admin API: the pool, the gateways (an operator's refund) and the recurring jobs' schedules.
#[derive(Clone)]
pub struct AdminState {
    pub pool: sqlx::PgPool,
    pub gateways: crate::gateways::GatewayRegistry,
    pub recurring: crate::recurring::Schedules,
    pub callers: super::Callers,
    /// The payment simulator charges the internal gateway's renewals here: where it does not
    /// (money is real), nothing may set how it answers.
    pub simulates_renewals: bool,
}

pub(super) fn routes(state: AdminState) -> Routes {
    Routes::default()
        .route("/admin/api-keys", post(create_api_key).get(list_api_keys))
        .route("/admin/api-keys/{id}", delete(revoke_api_key))
        .route("/admin/sellers", post(create_seller))
        .route("/admin/products", post(create_product))
        .route("/admin/coupons", post(create_coupon))
        .route("/admin/orders/{number}/expire", post(expire_order))
        .route(
            "/admin/subscriptions/{id}/simulate",
            post(simulate_renewals),
        )
        .route("/admin/unmatched-payments", get(unmatched))
        .route(
            "/admin/orders/{number}/refunds",
            post(refund_order).get(order_refunds),
        )
        .route("/admin/consistency", get(consistency_findings))
        .route("/admin/reconciliation", get(reconciliation_findings))
        .route("/admin/recurring", get(recurring_jobs))
        .route("/admin/recurring/{name}/runs", get(recurring_runs))
        .route("/admin/payouts", get(pending_payouts))
        .route("/admin/payouts/{id}/paid", post(payout_paid))
        .route("/admin/payouts/{id}/failed", post(payout_failed))
        .route("/admin/wallets/{buyer}/grants", post(grant_coins))
        .with_state(state)
}

impl From<ApiKeyError> for ApiError {
    fn from(e: ApiKeyError) -> Self {
        let message = e.to_string();
        match e {
            ApiKeyError::InvalidName | ApiKeyError::InvalidSeller(_) => Self::Unprocessable {
                code: "invalid_request",
                message,
            },
            ApiKeyError::UnknownSeller(_) => Self::Unprocessable {
                code: "unknown_seller",
                message,
            },
            ApiKeyError::NotFound(_) => Self::NotFound(message),
            ApiKeyError::Database(e) => e.into(),
        }
    }
}

/// Makes an API key: the key is in this answer only (it is kept as a hash).
async fn create_api_key(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewApiKey>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let (made, key) = api_keys::create(&state.pool, body).await?;
    tracing::info!(api_key = %made.id, name = %made.name, seller = ?made.seller_id, "API key made");
    let mut answer = serde_json::to_value(&made).map_err(|e| ApiError::Internal(Box::new(e)))?;
    answer["key"] = serde_json::Value::String(key);
    Ok((StatusCode::CREATED, Json(answer)))
}

/// Every API key, without the keys.
async fn list_api_keys(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let keys = api_keys::list(&state.pool).await?;
    Ok(Json(serde_json::json!({ "api_keys": keys })))
}

/// Revokes a key: refused by every process within a second.
async fn revoke_api_key(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(id): Path<String>,
) -> Result<Json<api_keys::ApiKey>, ApiError> {
    let key = api_keys::revoke(&state.pool, &id).await?;
    tracing::info!(api_key = %key.id, name = %key.name, "API key revoked");
    Ok(Json(key))
}

async fn create_seller(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewSeller>,
) -> Result<(StatusCode, Json<catalogue::Seller>), ApiError> {
    let seller = catalogue::create_seller(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(seller)))
}

async fn create_product(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewProduct>,
) -> Result<(StatusCode, Json<catalogue::Product>), ApiError> {
    let product = catalogue::create_product(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(product)))
}

async fn create_coupon(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewCoupon>,
) -> Result<(StatusCode, Json<catalogue::Coupon>), ApiError> {
    let coupon = catalogue::create_coupon(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(coupon)))
}

/// Ends the wait of an unpaid order now: the workers expire it (its coupon given back).
async fn expire_order(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let number = super::orders::number(&raw)?;
    orders::expire_now(&state.pool, number).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"number": number, "status": "expiring"})),
    ))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Simulate {
    renewals: String,
}

/// How the payment simulator answers a subscription's next renewals on the internal gateway:
/// `{"renewals": "fail|succeed"}`; 409 `simulator_off` where the simulator does not run.
async fn simulate_renewals(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
    JsonBody(body): JsonBody<Simulate>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if !state.simulates_renewals {
        return Err(ApiError::Conflict {
            code: "simulator_off",
            message: "the payment simulator is off here: renewals are charged for real".into(),
        });
    }
    let succeed = match body.renewals.as_str() {
        "succeed" => true,
        "fail" => false,
        other => {
            return Err(ApiError::Unprocessable {
                code: "invalid_request",
                message: format!("renewals must be \"fail\" or \"succeed\", not {other:?}"),
            });
        }
    };
    let id = super::orders::subscription_id(&raw)?;
    if !orders::subscriptions::simulate(&state.pool, id, succeed).await? {
        return Err(ApiError::NotFound(format!("no subscription {raw:?}")));
    }
    Ok(Json(
        serde_json::json!({"id": id, "renewals": body.renewals}),
    ))
}

/// Payments no checkout asked for, for an operator to look into.
async fn unmatched(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let list = crate::payments::events::unmatched(&state.pool, 200).await?;
    Ok(Json(serde_json::json!({ "unmatched_payments": list })))
}

/// Refunds a paid order, wholly or in part: `Idempotency-Key` required; 201 when the gateway
/// refunded, 202 while it has not answered yet (the refund is carried out by a job), 422 when it
/// refused.
async fn refund_order(
    _operator: Operator,
    State(state): State<AdminState>,
    headers: HeaderMap,
    Path(raw): Path<String>,
    JsonBody(body): JsonBody<NewRefund>,
) -> Result<(StatusCode, Json<RefundView>), ApiError> {
    let number = super::orders::number(&raw)?;
    let key = idempotency_key(super::orders::idempotency_header(&headers)?)?;
    let (view, written) = order_refunds::request(&state.pool, number, key, &body).await?;
    // The same key again while its first request is still asking the gateway: that request's
    // outcome is the answer, once it has one (asking the gateway a second time at once would
    // only race the first).
    if !written
        && view.state == RefundState::Requested
        && view.created_at > chrono::Utc::now() - order_refunds::JOB_DELAY
    {
        return Err(ApiError::Conflict {
            code: "idempotency_key_in_use",
            message: format!(
                "refund request {} with this Idempotency-Key is still being carried out; ask again for its outcome",
                view.id
            ),
        });
    }
    let view = match order_refunds::carry_out(&state.pool, &state.gateways, view.id).await {
        Ok(CarriedOut::Answered(view)) => view,
        Ok(CarriedOut::NotYet(view, e)) => {
            tracing::warn!(refund_request = view.id, error = %e, "the gateway did not answer; the refund job will ask again");
            view
        }
        // Not enabled in this receiver: a worker that has it carries the refund out.
        Err(RefundError::GatewayDisabled(_)) => view,
        Err(e) => return Err(e.into()),
    };
    match view.state {
        RefundState::Succeeded => Ok((StatusCode::CREATED, Json(view))),
        RefundState::Requested | RefundState::Accepted => Ok((StatusCode::ACCEPTED, Json(view))),
        RefundState::Failed | RefundState::Canceled => Err(ApiError::Unprocessable {
            code: "refund_refused",
            message: format!(
                "the gateway refused refund request {}: {}",
                view.id,
                view.failure.as_deref().unwrap_or("no reason given")
            ),
        }),
    }
}

async fn order_refunds(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let number = super::orders::number(&raw)?;
    let list = order_refunds::of_order(&state.pool, number).await?;
    Ok(Json(serde_json::json!({ "refunds": list })))
}

/// Payouts waiting for the bank's answer.
async fn pending_payouts(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let list = payouts::in_state(&state.pool, PayoutState::Pending).await?;
    Ok(Json(serde_json::json!({ "payouts": list })))
}

fn payout_id(raw: &str) -> Result<i64, ApiError> {
    raw.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiError::NotFound(format!("no payout {raw:?}")))
}

/// The bank paid the payout.
async fn payout_paid(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<Json<payouts::Payout>, ApiError> {
    let payout = payouts::decide(&state.pool, payout_id(&raw)?, None).await?;
    Ok(Json(payout))
}

#[derive(serde::Deserialize)]
struct Failure {
    reason: String,
}

/// The bank refused the payout: the seller's available balance gets it back, once.
async fn payout_failed(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
    JsonBody(body): JsonBody<Failure>,
) -> Result<Json<payouts::Payout>, ApiError> {
    let reason = body.reason.trim();
    if reason.is_empty() || reason.chars().count() > 500 || reason.chars().any(char::is_control) {
        return Err(ApiError::Unprocessable {
            code: "invalid_request",
            message: "reason must be 1 to 500 printable characters".into(),
        });
    }
    let payout = payouts::decide(&state.pool, payout_id(&raw)?, Some(reason)).await?;
    Ok(Json(payout))
}

#[derive(serde::Deserialize)]
struct Grant {
    amount: String,
    currency: String,
}

/// Gives a buyer coins; `Idempotency-Key` required (the same key grants once).
async fn grant_coins(
    _operator: Operator,
    State(state): State<AdminState>,
    headers: HeaderMap,
    Path(buyer): Path<String>,
    JsonBody(body): JsonBody<Grant>,
) -> Result<(StatusCode, Json<coins::Wallet>), ApiError> {
    let key = idempotency_key(super::orders::idempotency_header(&headers)?)?;
    if buyer.is_empty() || buyer.chars().count() > 200 || buyer.chars().any(char::is_control) {
        return Err(ApiError::Unprocessable {
            code: "invalid_request",
            message: "buyer_id must be 1 to 200 printable characters".into(),
        });
    }
    let amount = crate::money::Money::parse(&body.amount, &body.currency).map_err(|e| {
        ApiError::Unprocessable {
            code: "invalid_request",
            message: e.to_string(),
        }
    })?;
    if amount.amount() <= rust_decimal::Decimal::ZERO {
        return Err(ApiError::Unprocessable {
            code: "invalid_request",
            message: "a grant is of a positive amount".into(),
        });
    }
    let wallet = coins::grant(&state.pool, &buyer, amount, key).await?;
    Ok((StatusCode::CREATED, Json(wallet)))
}

/// The recurring jobs with their last and next run.
async fn recurring_jobs(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let list = recurring::overview(&state.pool, &state.recurring, chrono::Utc::now()).await?;
    Ok(Json(serde_json::json!({ "recurring": list })))
}

#[derive(serde::Deserialize)]
struct Limit {
    limit: Option<i64>,
}

/// A recurring job's runs, newest first (`limit` 1 to 500, default 20).
async fn recurring_runs(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(name): Path<String>,
    limit: Result<Query<Limit>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(Limit { limit }) = limit.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = limit.unwrap_or(20);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit is 1 to 500, not {limit}"
        )));
    }
    if state.recurring.get(&name).is_none() {
        return Err(ApiError::NotFound(format!("no recurring job {name:?}")));
    }
    let runs = recurring::runs(&state.pool, &name, limit).await?;
    Ok(Json(serde_json::json!({ "name": name, "runs": runs })))
}

/// The consistency findings still open, oldest first.
async fn consistency_findings(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let findings = crate::consistency::open(&state.pool, 1000).await?;
    Ok(Json(serde_json::json!({ "findings": findings })))
}

/// What missed-webhook reconciliation found, newest first.
async fn reconciliation_findings(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let findings = crate::payments::reconcile::findings(&state.pool, 500).await?;
    Ok(Json(serde_json::json!({ "findings": findings })))
}
