//! The admin API: `Authorization: Bearer $PAYFLEET_ADMIN_TOKEN` (401 without it, 403 with a
//! wrong one), every handler taking an [`Operator`]. Without a configured token the admin API
//! is off, and says so.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{delete, get, post};

use super::callers::Operator;
use super::openapi::ErrorBody;
use super::{ApiError, JsonBody, Routes};
use crate::auth::api_keys::{self, ApiKeyError, ApiKeyId, NewApiKey};
use crate::catalogue::{self, NewCoupon, NewProduct, NewSeller};
use crate::ledger::coins;
use crate::ledger::payouts::{self, PayoutState};
use crate::orders;
use crate::orders::checkout::idempotency_key;
use crate::orders::subscriptions::SubscriptionId;
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
        .route("/admin/workers", get(workers))
        .route("/admin/recurring/{name}/runs", get(recurring_runs))
        .route("/admin/payouts", get(pending_payouts))
        .route("/admin/payouts/{id}/paid", post(payout_paid))
        .route("/admin/payouts/{id}/failed", post(payout_failed))
        .route("/admin/wallets/{buyer}/grants", post(grant_coins))
        .with_state(state)
}

/// A key just made: its record, and the key itself (shown this once).
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct NewKey {
    #[serde(flatten)]
    made: api_keys::ApiKey,
    /// The key to send as `Authorization: Bearer`: kept only as its SHA-256.
    key: String,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct ApiKeys {
    api_keys: Vec<api_keys::ApiKey>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Expiring {
    number: i64,
    /// `expiring`.
    status: String,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Simulated {
    id: orders::subscriptions::SubscriptionId,
    renewals: String,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct UnmatchedPayments {
    unmatched_payments: Vec<crate::payments::events::UnmatchedPayment>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Refunds {
    refunds: Vec<RefundView>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Payouts {
    payouts: Vec<payouts::Payout>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Recurring {
    recurring: Vec<recurring::Overview>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Runs {
    name: String,
    runs: Vec<recurring::RunView>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Workers {
    workers: Vec<WorkerView>,
}

/// A worker process of the fleet's census.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct WorkerView {
    /// `<host>-<pid>-<random>`, as its claims and its jobs' errors name it.
    id: String,
    /// The queues it works.
    queues: Vec<String>,
    started_at: chrono::DateTime<chrono::Utc>,
    /// Its row's last renewal (every second while it runs).
    seen_at: chrono::DateTime<chrono::Utc>,
    /// Renewed within the last ten seconds. A worker not live died without stopping: its jobs
    /// are rescued when their leases expire, and a live worker's next renewal deletes its row.
    live: bool,
}

impl From<payfleet_queue::census::WorkerRow> for WorkerView {
    fn from(w: payfleet_queue::census::WorkerRow) -> Self {
        Self {
            id: w.id,
            queues: w.queues,
            started_at: w.started_at,
            seen_at: w.seen_at,
            live: w.live,
        }
    }
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct ConsistencyFindings {
    /// The open findings (of the check asked for, if one was), oldest first, at most 1,000.
    findings: Vec<crate::consistency::Finding>,
    /// How many findings each check has open, every check named (zero included): what the
    /// list may not show when one check floods it.
    counts: std::collections::BTreeMap<&'static str, i64>,
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
pub(super) struct FindingsQuery {
    /// Only this check's findings (one of the names in `counts`).
    check: Option<String>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct ReconciliationFindings {
    findings: Vec<crate::payments::reconcile::Finding>,
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
#[utoipa::path(
    post,
    path = "/admin/api-keys",
    tag = "admin",
    request_body = NewApiKey,
    responses(
        (status = 201, description = "The key: its secret is in this answer only.", body = NewKey),
        (status = 422, description = "`invalid_request`; `unknown_seller`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn create_api_key(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewApiKey>,
) -> Result<(StatusCode, Json<NewKey>), ApiError> {
    let (made, key) = api_keys::create(&state.pool, body).await?;
    tracing::info!(api_key = %made.id, name = %made.name, seller = ?made.seller_id, "API key made");
    Ok((StatusCode::CREATED, Json(NewKey { made, key })))
}

/// Every API key, without the keys.
#[utoipa::path(
    get,
    path = "/admin/api-keys",
    tag = "admin",
    responses(
        (status = 200, description = "Every key, without its secret.", body = ApiKeys),
    ),
    security(("admin_token" = [])),
)]
async fn list_api_keys(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<ApiKeys>, ApiError> {
    let api_keys = api_keys::list(&state.pool).await?;
    Ok(Json(ApiKeys { api_keys }))
}

/// Revokes a key: refused by every process within a second.
#[utoipa::path(
    delete,
    path = "/admin/api-keys/{id}",
    tag = "admin",
    params(
        ("id" = ApiKeyId, Path, description = "The key's id."),
    ),
    responses(
        (status = 200, description = "The key, revoked: refused by every process within a second.", body = api_keys::ApiKey),
        (status = 404, description = "`not_found`: no such key.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn revoke_api_key(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(id): Path<String>,
) -> Result<Json<api_keys::ApiKey>, ApiError> {
    let key = api_keys::revoke(&state.pool, &id).await?;
    tracing::info!(api_key = %key.id, name = %key.name, "API key revoked");
    Ok(Json(key))
}

#[utoipa::path(
    post,
    path = "/admin/sellers",
    tag = "admin",
    request_body = NewSeller,
    responses(
        (status = 201, description = "The seller.", body = catalogue::Seller),
        (status = 422, description = "`invalid_request`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn create_seller(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewSeller>,
) -> Result<(StatusCode, Json<catalogue::Seller>), ApiError> {
    let seller = catalogue::create_seller(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(seller)))
}

#[utoipa::path(
    post,
    path = "/admin/products",
    tag = "admin",
    request_body = NewProduct,
    responses(
        (status = 201, description = "The product.", body = catalogue::Product),
        (status = 422, description = "`invalid_request`; `unknown_seller`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn create_product(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewProduct>,
) -> Result<(StatusCode, Json<catalogue::Product>), ApiError> {
    let product = catalogue::create_product(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(product)))
}

#[utoipa::path(
    post,
    path = "/admin/coupons",
    tag = "admin",
    request_body = NewCoupon,
    responses(
        (status = 201, description = "The coupon.", body = catalogue::Coupon),
        (status = 409, description = "`coupon_code_taken`.", body = ErrorBody),
        (status = 422, description = "`invalid_request`; `unknown_seller`; `unknown_product`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn create_coupon(
    _operator: Operator,
    State(state): State<AdminState>,
    JsonBody(body): JsonBody<NewCoupon>,
) -> Result<(StatusCode, Json<catalogue::Coupon>), ApiError> {
    let coupon = catalogue::create_coupon(&state.pool, body).await?;
    Ok((StatusCode::CREATED, Json(coupon)))
}

/// Ends the wait of an unpaid order now: the workers expire it (its coupon given back).
#[utoipa::path(
    post,
    path = "/admin/orders/{number}/expire",
    tag = "admin",
    params(
        ("number" = i64, Path, description = "The order's number."),
    ),
    responses(
        (status = 202, description = "The order's expiry job moved to now.", body = Expiring),
        (status = 404, description = "`not_found`: no such order.", body = ErrorBody),
        (status = 409, description = "`order_not_payable`: not waiting for its payment.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn expire_order(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<(StatusCode, Json<Expiring>), ApiError> {
    let number = super::orders::number(&raw)?;
    orders::expire_now(&state.pool, number).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Expiring {
            number,
            status: "expiring".into(),
        }),
    ))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Simulate {
    /// `fail` or `succeed`.
    renewals: String,
}

/// How the payment simulator answers a subscription's next renewals on the internal gateway:
/// `{"renewals": "fail|succeed"}`; 409 `simulator_off` where the simulator does not run.
#[utoipa::path(
    post,
    path = "/admin/subscriptions/{id}/simulate",
    tag = "admin",
    params(
        ("id" = SubscriptionId, Path, description = "The subscription's id."),
    ),
    request_body = Simulate,
    responses(
        (status = 200, description = "How the simulator answers the subscription's next renewals.", body = Simulated),
        (status = 404, description = "`not_found`: no such subscription.", body = ErrorBody),
        (status = 409, description = "`simulator_off`: the payment simulator does not run here (money is real).", body = ErrorBody),
        (status = 422, description = "`invalid_request`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn simulate_renewals(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
    JsonBody(body): JsonBody<Simulate>,
) -> Result<Json<Simulated>, ApiError> {
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
    Ok(Json(Simulated {
        id,
        renewals: body.renewals,
    }))
}

/// Payments no checkout asked for, for an operator to look into.
#[utoipa::path(
    get,
    path = "/admin/unmatched-payments",
    tag = "admin",
    responses(
        (status = 200, description = "Payments no checkout asked for, newest first (200 at most).", body = UnmatchedPayments),
    ),
    security(("admin_token" = [])),
)]
async fn unmatched(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<UnmatchedPayments>, ApiError> {
    let unmatched_payments = crate::payments::events::unmatched(&state.pool, 200).await?;
    Ok(Json(UnmatchedPayments { unmatched_payments }))
}

/// Refunds a paid order, wholly or in part: `Idempotency-Key` required; 201 when the gateway
/// refunded, 202 while it has not answered yet (the refund is carried out by a job), 422 when it
/// refused.
#[utoipa::path(
    post,
    path = "/admin/orders/{number}/refunds",
    tag = "admin",
    params(
        ("number" = i64, Path, description = "The order's number."),
        ("Idempotency-Key" = String, Header, description = "Required: the same key does it once."),
    ),
    request_body = NewRefund,
    responses(
        (status = 201, description = "Refunded (an order paid with coins: in coins, at once).", body = RefundView),
        (status = 202, description = "Asked; the gateway has not answered yet (a job asks again).", body = RefundView),
        (status = 400, description = "`missing_idempotency_key`; `invalid_idempotency_key`.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such order.", body = ErrorBody),
        (status = 409, description = "`order_not_refundable`; `idempotency_key_in_use` (its first request is still asking the gateway).", body = ErrorBody),
        (status = 422, description = "`refund_refused` (the gateway's reason); `refund_unconfirmed` (the gateway never answered within 20 hours of the first ask, and is not asked again: look at the gateway); `refund_exceeds_payment`; `idempotency_key_reused`; `gateway_unavailable`; `invalid_request`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
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
        // Its payment's dispute opened since: the job asks once the dispute has ended.
        Ok(CarriedOut::Held(view)) => view,
        // Not enabled in this receiver: a worker that has it carries the refund out.
        Err(RefundError::GatewayDisabled(_)) => view,
        Err(e) => return Err(e.into()),
    };
    match view.state {
        RefundState::Succeeded => Ok((StatusCode::CREATED, Json(view))),
        RefundState::Requested | RefundState::Accepted => Ok((StatusCode::ACCEPTED, Json(view))),
        RefundState::Failed if view.unanswered() => Err(ApiError::Unprocessable {
            code: "refund_unconfirmed",
            message: format!(
                "refund request {} ended unconfirmed: {}",
                view.id,
                view.failure.as_deref().unwrap_or_default()
            ),
        }),
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

#[utoipa::path(
    get,
    path = "/admin/orders/{number}/refunds",
    tag = "admin",
    params(
        ("number" = i64, Path, description = "The order's number."),
    ),
    responses(
        (status = 200, description = "The order's refund requests.", body = Refunds),
        (status = 404, description = "`not_found`: not an order number.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn order_refunds(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<Json<Refunds>, ApiError> {
    let number = super::orders::number(&raw)?;
    let refunds = order_refunds::of_order(&state.pool, number).await?;
    Ok(Json(Refunds { refunds }))
}

/// Payouts waiting for the bank's answer.
#[utoipa::path(
    get,
    path = "/admin/payouts",
    tag = "admin",
    responses(
        (status = 200, description = "Payouts waiting for the bank's answer.", body = Payouts),
    ),
    security(("admin_token" = [])),
)]
async fn pending_payouts(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<Payouts>, ApiError> {
    let payouts = payouts::in_state(&state.pool, PayoutState::Pending).await?;
    Ok(Json(Payouts { payouts }))
}

fn payout_id(raw: &str) -> Result<i64, ApiError> {
    raw.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiError::NotFound(format!("no payout {raw:?}")))
}

/// The bank paid the payout.
#[utoipa::path(
    post,
    path = "/admin/payouts/{id}/paid",
    tag = "admin",
    params(
        ("id" = i64, Path, description = "The payout's id."),
    ),
    responses(
        (status = 200, description = "The payout, paid (the same answer again is a no-op).", body = payouts::Payout),
        (status = 404, description = "`not_found`: no such payout.", body = ErrorBody),
        (status = 409, description = "`payout_decided`: the bank's other answer was recorded.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn payout_paid(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(raw): Path<String>,
) -> Result<Json<payouts::Payout>, ApiError> {
    let payout = payouts::decide(&state.pool, payout_id(&raw)?, None).await?;
    // Money's record of who said so: the admin token's holder, in this request's span.
    tracing::info!(payout = payout.id, seller = %payout.seller_id, amount = %payout.amount, currency = %payout.currency, "an operator recorded the payout paid");
    Ok(Json(payout))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
pub(super) struct Failure {
    /// The bank's reason: 1 to 500 printable characters.
    reason: String,
}

/// The bank refused the payout: the seller's available balance gets it back, once.
#[utoipa::path(
    post,
    path = "/admin/payouts/{id}/failed",
    tag = "admin",
    params(
        ("id" = i64, Path, description = "The payout's id."),
    ),
    request_body = Failure,
    responses(
        (status = 200, description = "The payout, failed: the seller's available balance has it back, once.", body = payouts::Payout),
        (status = 404, description = "`not_found`: no such payout.", body = ErrorBody),
        (status = 409, description = "`payout_decided`: the bank's other answer was recorded.", body = ErrorBody),
        (status = 422, description = "`invalid_request`: a reason of 1 to 500 printable characters.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
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
    tracing::info!(payout = payout.id, seller = %payout.seller_id, amount = %payout.amount, currency = %payout.currency, reason, "an operator recorded the payout failed");
    Ok(Json(payout))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
pub(super) struct Grant {
    /// A positive decimal string.
    amount: String,
    currency: String,
}

/// Gives a buyer coins; `Idempotency-Key` required (the same key grants once).
#[utoipa::path(
    post,
    path = "/admin/wallets/{buyer}/grants",
    tag = "admin",
    params(
        ("buyer" = String, Path, description = "The buyer's id."),
        ("Idempotency-Key" = String, Header, description = "Required: the same key does it once."),
    ),
    request_body = Grant,
    responses(
        (status = 201, description = "The buyer's wallet in the grant's currency.", body = coins::Wallet),
        (status = 400, description = "`missing_idempotency_key`; `invalid_idempotency_key`.", body = ErrorBody),
        (status = 422, description = "`invalid_request`; `idempotency_key_reused`.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
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
    tracing::info!(%buyer, %amount, idempotency_key = key, "an operator granted coins");
    Ok((StatusCode::CREATED, Json(wallet)))
}

/// The recurring jobs with their last and next run.
#[utoipa::path(
    get,
    path = "/admin/recurring",
    tag = "admin",
    responses(
        (status = 200, description = "The recurring jobs with their last and next run.", body = Recurring),
    ),
    security(("admin_token" = [])),
)]
async fn recurring_jobs(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<Recurring>, ApiError> {
    let recurring = recurring::overview(&state.pool, &state.recurring, chrono::Utc::now()).await?;
    Ok(Json(Recurring { recurring }))
}

#[derive(serde::Deserialize)]
struct Limit {
    limit: Option<i64>,
}

/// A recurring job's runs, newest first (`limit` 1 to 500, default 20).
#[utoipa::path(
    get,
    path = "/admin/recurring/{name}/runs",
    tag = "admin",
    params(
        ("name" = String, Path, description = "The recurring job's name."),
        ("limit" = Option<i64>, Query, description = "1 to 500 (20 by default)."),
    ),
    responses(
        (status = 200, description = "The job's runs, newest first.", body = Runs),
        (status = 400, description = "`bad_request`: a limit outside 1 to 500.", body = ErrorBody),
        (status = 404, description = "`not_found`: no recurring job of that name.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn recurring_runs(
    _operator: Operator,
    State(state): State<AdminState>,
    Path(name): Path<String>,
    limit: Result<Query<Limit>, QueryRejection>,
) -> Result<Json<Runs>, ApiError> {
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
    Ok(Json(Runs { name, runs }))
}

/// The fleet's worker processes as their census holds them (`payfleet jobs workers`): the live
/// ones first, then those gone without stopping, each by its start.
#[utoipa::path(
    get,
    path = "/admin/workers",
    tag = "admin",
    responses(
        (status = 200, description = "The worker processes, live ones first.", body = Workers),
    ),
    security(("admin_token" = [])),
)]
async fn workers(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<Workers>, ApiError> {
    let workers = payfleet_queue::census::workers(&state.pool)
        .await?
        .into_iter()
        .map(WorkerView::from)
        .collect();
    Ok(Json(Workers { workers }))
}

/// The consistency findings still open, oldest first, all or one check's, with every check's
/// count.
#[utoipa::path(
    get,
    path = "/admin/consistency",
    tag = "admin",
    params(FindingsQuery),
    responses(
        (status = 200, description = "The open consistency findings, oldest first, and each check's count.", body = ConsistencyFindings),
        (status = 400, description = "`bad_request`: a check of no such name.", body = ErrorBody),
    ),
    security(("admin_token" = [])),
)]
async fn consistency_findings(
    _operator: Operator,
    State(state): State<AdminState>,
    query: Result<Query<FindingsQuery>, QueryRejection>,
) -> Result<Json<ConsistencyFindings>, ApiError> {
    let Query(FindingsQuery { check }) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let findings = match check.as_deref() {
        None => crate::consistency::open(&state.pool, 1000).await?,
        Some(name) if crate::consistency::CHECKS.contains(&name) => {
            crate::consistency::open_of(&state.pool, name, 1000).await?
        }
        Some(name) => {
            return Err(ApiError::bad_request(format!(
                "no consistency check {name:?} (they are: {})",
                crate::consistency::CHECKS.join(", ")
            )));
        }
    };
    let counts = crate::consistency::counts(&state.pool)
        .await?
        .into_iter()
        .collect();
    Ok(Json(ConsistencyFindings { findings, counts }))
}

/// What missed-webhook reconciliation found, newest first.
#[utoipa::path(
    get,
    path = "/admin/reconciliation",
    tag = "admin",
    responses(
        (status = 200, description = "What missed-webhook reconciliation found, newest first.", body = ReconciliationFindings),
    ),
    security(("admin_token" = [])),
)]
async fn reconciliation_findings(
    _operator: Operator,
    State(state): State<AdminState>,
) -> Result<Json<ReconciliationFindings>, ApiError> {
    let findings = crate::payments::reconcile::findings(&state.pool, 500).await?;
    Ok(Json(ReconciliationFindings { findings }))
}
