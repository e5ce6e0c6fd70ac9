//! Checkout, orders and subscriptions: `POST /checkout`, `GET /orders/{number}`,
//! `POST /orders/{number}/payment`, `POST /orders/{number}/coins`, `GET /subscriptions/{id}`.
//! All of them are the marketplace backend's (an API key): a key bound to a seller reads that
//! seller's orders and subscriptions and does nothing else here.

use axum::Json;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};

use super::callers::Backend;
use super::openapi::ErrorBody;
use super::{ApiError, JsonBody, Routes};
use crate::orders::checkout::MAX_BODY_BYTES;
use crate::orders::subscriptions::{self, SubscriptionId, SubscriptionView};
use crate::orders::{self, OrderView};

/// What the order API: the pool, the checkout writer and the order side's RPC client (payment links, coins).
#[derive(Clone)]
pub struct OrdersState {
    pub pool: sqlx::PgPool,
    pub checkout: crate::orders::checkout::Checkout,
    pub rpc: crate::messaging::rpc::RpcClient,
    pub callers: super::Callers,
    /// Asked to cancel the subscriptions they bill.
    pub gateways: crate::gateways::GatewayRegistry,
}

pub(super) fn routes(state: OrdersState) -> Routes {
    Routes::default()
        .route(
            "/checkout",
            post(checkout).layer(DefaultBodyLimit::max(MAX_BODY_BYTES)),
        )
        .route("/orders/{number}", get(order))
        .route("/orders/{number}/payment", post(reopen))
        .route("/orders/{number}/coins", post(pay_with_coins))
        .route("/subscriptions/{id}", get(subscription))
        .route("/subscriptions/{id}/cancel", post(cancel_subscription))
        .with_state(state)
}

/// Orders from a cart: one per seller, priced, numbered, each with its payment link (made over
/// the payment side's RPC). The same `Idempotency-Key` (the calling key's own) answers the same.
#[utoipa::path(
    post,
    path = "/checkout",
    tag = "orders",
    params(("Idempotency-Key" = String, Header, description = "1 to 255 visible characters, the calling API key's own: a repeat answers what the first request answered.")),
    request_body = crate::orders::checkout::CheckoutRequest,
    responses(
        (status = 201, description = "The orders, one per seller, each with its payment link (a repeat of the key: the first answer).", body = crate::orders::checkout::CheckoutAnswer),
        (status = 400, description = "`missing_idempotency_key`; `invalid_idempotency_key` (sent twice, not text, longer than 255 characters); `bad_request` (not JSON: invalid UTF-8, nested deeper than 128).", body = ErrorBody),
        (status = 403, description = "`forbidden`: a key bound to a seller cannot check out.", body = ErrorBody),
        (status = 409, description = "`idempotency_key_in_use`: a request with this key is still running.", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: over 64 KiB.", body = ErrorBody),
        (status = 422, description = "`unknown_product`, `coupon_unavailable`, `invalid_items` (at most 100 lines), `gateway_unavailable`, `idempotency_key_reused` (with a different request), `payment_link_refused`, `invalid_request`.", body = ErrorBody),
        (status = 503, description = "`payment_link_unavailable`: the orders are kept, the payment side did not give their links: repeat the request. `unavailable`: the database did not answer within the checkout's deadline (the payment side's timeout plus 10 s).", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn checkout(
    caller: Backend,
    State(state): State<OrdersState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    caller.acts_for_buyers()?;
    let key = idempotency_header(&headers)?;
    let answer = state
        .checkout
        .run(&caller.idempotency_owner(), key, body)
        .await?;
    Ok((StatusCode::CREATED, Json(answer)))
}

/// The request's `Idempotency-Key` as sent (`None` when absent). Sent twice, or not as text,
/// it names no one request: 400 `invalid_idempotency_key`, before anything is looked at.
pub(super) fn idempotency_header(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(crate::orders::checkout::CheckoutError::BadKey.into());
    }
    first
        .to_str()
        .map(Some)
        .map_err(|_| crate::orders::checkout::CheckoutError::BadKey.into())
}

/// An order number from the path; anything else is "no such order", in the JSON error shape.
pub(super) fn number(raw: &str) -> Result<i64, ApiError> {
    raw.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiError::NotFound(format!("no order {raw:?}")))
}

/// An order: its own status (the business truth) and its payment's, side by side.
#[utoipa::path(
    get,
    path = "/orders/{number}",
    tag = "orders",
    params(("number" = i64, Path, description = "The order's number.")),
    responses(
        (status = 200, description = "The order.", body = OrderView),
        (status = 404, description = "`not_found`: no such order, or another seller's.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn order(
    caller: Backend,
    State(state): State<OrdersState>,
    Path(raw): Path<String>,
) -> Result<Json<OrderView>, ApiError> {
    let n = number(&raw)?;
    let no_order = || ApiError::NotFound(format!("no order {n}"));
    // Another seller's order is "no order", as a missing one, read by the same one statement:
    // a seller's key cannot tell which numbers exist, by the answer or by its time.
    let order = orders::view_of_seller(&state.pool, n, caller.seller())
        .await?
        .ok_or_else(no_order)?;
    Ok(Json(order))
}

/// The buyer reopens payment: the expiry moves to a full period from now, and the order gets
/// its payment link if it had none yet.
#[utoipa::path(
    post,
    path = "/orders/{number}/payment",
    tag = "orders",
    params(("number" = i64, Path, description = "The order's number.")),
    responses(
        (status = 200, description = "The order, payable again: its expiry a full period from now.", body = OrderView),
        (status = 403, description = "`forbidden`: a key bound to a seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such order.", body = ErrorBody),
        (status = 409, description = "`order_not_payable`; `renewal_not_reopenable` (a subscription's renewal).", body = ErrorBody),
        (status = 503, description = "`payment_link_unavailable`: the order is payable, its link not made yet: ask again.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn reopen(
    caller: Backend,
    State(state): State<OrdersState>,
    Path(raw): Path<String>,
) -> Result<Json<OrderView>, ApiError> {
    caller.acts_for_buyers()?;
    let n = number(&raw)?;
    let order = orders::reopen(&state.pool, n, state.checkout.expiry).await?;
    if order.payment.is_none() {
        orders::checkout::link(
            &state.pool,
            state.checkout.links.as_ref(),
            &order,
            state.checkout.fee_percent,
        )
            .await
            .map_err(|(reason, _)| ApiError::DependencyDown {
                code: "payment_link_unavailable",
                message: format!(
                    "order {n} is kept and payable, but the payment side did not give its link; try again"
                ),
                detail: reason,
            })?;
    }
    let order = orders::view(&state.pool, n)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no order {n}")))?;
    Ok(Json(order))
}

/// The buyer pays the order with coins: reserved over the coins RPC, then the order is paid and
/// the coins spent. 422 `coins_insufficient` changes nothing; 503 `coins_unavailable` spends
/// nothing (ask again).
#[utoipa::path(
    post,
    path = "/orders/{number}/coins",
    tag = "orders",
    params(("number" = i64, Path, description = "The order's number.")),
    responses(
        (status = 200, description = "The order, paid with its buyer's coins.", body = OrderView),
        (status = 403, description = "`forbidden`: a key bound to a seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such order.", body = ErrorBody),
        (status = 409, description = "`order_not_payable`.", body = ErrorBody),
        (status = 422, description = "`coins_insufficient`, `invalid_request`: nothing changed.", body = ErrorBody),
        (status = 503, description = "`coins_unavailable`: nothing spent, ask again.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn pay_with_coins(
    caller: Backend,
    State(state): State<OrdersState>,
    Path(raw): Path<String>,
) -> Result<Json<OrderView>, ApiError> {
    caller.acts_for_buyers()?;
    let n = number(&raw)?;
    Ok(Json(
        orders::coin_payment::pay(&state.pool, &state.rpc, n).await?,
    ))
}

fn no_subscription(raw: &str) -> ApiError {
    ApiError::NotFound(format!("no subscription {raw:?}"))
}

/// A subscription id from the path; anything else is "no such subscription", as an unknown one.
pub(super) fn subscription_id(raw: &str) -> Result<SubscriptionId, ApiError> {
    raw.parse().map_err(|_| no_subscription(raw))
}

/// A subscription. Another seller's, or an id that is none, is "no subscription" alike.
#[utoipa::path(
    get,
    path = "/subscriptions/{id}",
    tag = "orders",
    params(("id" = SubscriptionId, Path, description = "The subscription's id.")),
    responses(
        (status = 200, description = "The subscription and its renewals, oldest period first.", body = SubscriptionView),
        (status = 404, description = "`not_found`: no such subscription, or another seller's.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn subscription(
    caller: Backend,
    State(state): State<OrdersState>,
    Path(raw): Path<String>,
) -> Result<Json<SubscriptionView>, ApiError> {
    let none = || no_subscription(&raw);
    let id = subscription_id(&raw)?;
    let found = subscriptions::view(&state.pool, id)
        .await?
        .ok_or_else(none)?;
    caller.may_read(found.seller_id).map_err(|_| none())?;
    Ok(Json(found))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Cancel {
    /// At the period's end rather than now.
    #[serde(default)]
    at_period_end: bool,
}

/// The buyer cancels a subscription, now or at its period's end: at the gateway that bills it
/// first, then here; 200 with the subscription (the same answer when it was canceled already).
/// 503 `gateway_unavailable` when the gateway cannot be asked (nothing changed); 409
/// `cancel_not_supported` for one whose gateway cannot be asked here.
#[utoipa::path(
    post,
    path = "/subscriptions/{id}/cancel",
    tag = "orders",
    params(("id" = SubscriptionId, Path, description = "The subscription's id.")),
    request_body = Cancel,
    responses(
        (status = 200, description = "The subscription, canceled now or at its period's end (the same answer when it was canceled already).", body = SubscriptionView),
        (status = 403, description = "`forbidden`: a key bound to a seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such subscription.", body = ErrorBody),
        (status = 409, description = "`gateway_refused` (the gateway refused); `cancel_not_supported` (its gateway cannot be asked here).", body = ErrorBody),
        (status = 503, description = "`gateway_unavailable`: the gateway could not be asked; nothing changed, ask again.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn cancel_subscription(
    caller: Backend,
    State(state): State<OrdersState>,
    Path(raw): Path<String>,
    JsonBody(body): JsonBody<Cancel>,
) -> Result<Json<SubscriptionView>, ApiError> {
    caller.acts_for_buyers()?;
    let id = subscription_id(&raw)?;
    match crate::payments::subscriptions::cancel(
        &state.pool,
        &state.gateways,
        id,
        body.at_period_end,
    )
    .await
    {
        Ok(view) => Ok(Json(view)),
        Err(crate::payments::subscriptions::CancelAtGatewayError::Cancel(
            subscriptions::CancelError::NotFound(_),
        )) => Err(no_subscription(&raw)),
        Err(e) => Err(e.into()),
    }
}
