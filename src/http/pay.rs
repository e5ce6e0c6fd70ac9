//! The hosted gateway's payment page (`/pay/{session}`): the order's amount with "pay" and
//! "fail" buttons; the form's POST records the outcome at the gateway, which then delivers its
//! signed event to the receiver like any gateway would. Also the page that opens Razorpay
//! Checkout for a Razorpay order, and the pages Stripe sends buyers back to.
//!
//! The pay/fail page is a simulator: it moves no real money. It is served only where the
//! payment simulator is on (`PAYFLEET_PAYMENT_SIMULATOR=on`: the hosted gateways are not
//! enabled otherwise, and `serve` refuses to start with them). Its form carries a token bound to
//! its session and rendered by the `GET` (an HMAC under a key derived from the gateway's
//! secret, valid an hour); a `POST` without it, or from another origin, is 403 and records
//! nothing. The page is never framed (`frame-ancestors 'none'`) nor cached, and sends no
//! referrer (its URL is the buyer's capability).

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use chrono::Utc;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::callers::{Anyone, Buyer};
use super::html::{self, escape};
use super::{ApiError, Routes};
use crate::gateways::GatewayName;
use crate::gateways::hosted::{self, HostedGateway, Outcome};
use crate::orders;
use crate::secret::hmac_sha256;

/// What the payment pages: the pool, the hosted gateways whose pages this receiver serves (none unless the simulator is on), the only origin their forms come from, and Razorpay's public key id.
#[derive(Clone)]
pub struct PayState {
    pub pool: sqlx::PgPool,
    pub hosted: Vec<crate::gateways::hosted::HostedGateway>,
    pub public_url: String,
    pub razorpay_key_id: Option<String>,
}

/// How long a rendered form may be posted back.
const FORM_SECS: i64 = 3600;

pub(super) fn routes(state: PayState) -> Routes {
    Routes::default()
        // A page's form is a few dozen bytes.
        .route(
            "/pay/{session}",
            get(page)
                .post(decide)
                .layer(axum::extract::DefaultBodyLimit::max(4096)),
        )
        .route("/pay/razorpay/{order_id}", get(razorpay_page))
        // Razorpay Checkout's `callback_url` is POSTed to (its payment's ids and signature, or
        // its error); nothing in that form is read: only the signed events decide.
        .route(
            "/orders/paid",
            get(paid_page)
                .post(paid_page_posted)
                .layer(axum::extract::DefaultBodyLimit::max(4096)),
        )
        .route("/orders/cancelled", get(cancelled_page))
        .with_state(state)
}

/// Where a gateway sends the buyer back after paying.
#[utoipa::path(
    get,
    path = "/orders/paid",
    tag = "payment pages",
    responses((status = 200, description = "Thanks: the payment is being confirmed.", content_type = "text/html", body = String)),
)]
async fn paid_page(_: Anyone) -> Response {
    returned()
}

/// Where Razorpay Checkout sends the buyer back (a form POST, after paying or failing to).
#[utoipa::path(
    post,
    path = "/orders/paid",
    tag = "payment pages",
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "Razorpay's fields (`razorpay_payment_id`, ..., or `error[...]`): not read; the gateway's signed events decide."),
    responses((status = 200, description = "The payment is being confirmed (or, if it did not go through, may be tried again).", content_type = "text/html", body = String)),
)]
async fn paid_page_posted(_: Anyone) -> Response {
    returned()
}

/// The page a buyer comes back to: what is known for sure is only that the gateway's signed
/// events will tell (a return can be made up, or come from a payment that failed).
fn returned() -> Response {
    guarded(
        StatusCode::OK,
        layout(
            "Payment sent",
            "<p>Thank you: your payment is being confirmed. If it did not go through, you can pay again from your order.</p>",
        ),
        None,
    )
}

/// Where a gateway sends the buyer back after cancelling.
#[utoipa::path(
    get,
    path = "/orders/cancelled",
    tag = "payment pages",
    responses((status = 200, description = "No payment was taken.", content_type = "text/html", body = String)),
)]
async fn cancelled_page(_: Anyone) -> Response {
    guarded(
        StatusCode::OK,
        layout("Payment cancelled", "<p>No payment was taken.</p>"),
        None,
    )
}

fn layout(title: &str, body: &str) -> String {
    html::page(
        title,
        "body{font-family:sans-serif;max-width:32rem;margin:3rem auto}button{font-size:1.1rem;margin-right:1rem}",
        body,
    )
}

/// A payment page's answer: not framed, not cached, no referrer; `script` allows the one script
/// source a page loads (Razorpay Checkout's).
fn guarded(status: StatusCode, html: String, script: Option<&str>) -> Response {
    let mut resp = (status, Html(html)).into_response();
    let csp = match script {
        Some(src) => format!(
            "default-src 'none'; script-src {src} 'unsafe-inline'; connect-src {src}; frame-src {src}; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"
        ),
        None => "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'".into(),
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&csp) {
        h.insert("content-security-policy", v);
    }
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// The form token of a session's page: `{expires}.{hex mac}`.
fn form_token(gateway: &HostedGateway, session: &str, now: i64) -> String {
    let expires = now + FORM_SECS;
    let mac = hmac_sha256(
        &gateway.page_key(),
        &[
            b"pay|",
            session.as_bytes(),
            b"|",
            expires.to_string().as_bytes(),
        ],
    );
    format!("{expires}.{}", hex::encode(mac))
}

fn form_token_holds(gateway: &HostedGateway, session: &str, given: &str, now: i64) -> bool {
    let Some((expires, mac)) = given.split_once('.') else {
        return false;
    };
    let (Ok(expires_at), Ok(mac)) = (expires.parse::<i64>(), hex::decode(mac)) else {
        return false;
    };
    let want = hmac_sha256(
        &gateway.page_key(),
        &[b"pay|", session.as_bytes(), b"|", expires.as_bytes()],
    );
    bool::from(want.as_slice().ct_eq(&mac)) && expires_at > now
}

fn hosted_gateway(state: &PayState, gateway: GatewayName) -> Result<HostedGateway, ApiError> {
    state
        .hosted
        .iter()
        .find(|g| g.name() == gateway)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("gateway {gateway} is not enabled")))
}

/// Whether a page for `session` may exist here at all. Nothing is read (not the database, not
/// the request's form) for a page this receiver cannot serve (the simulator off: no hosted
/// gateway) or for an id no session can have: 404, whatever else the request says.
fn served(state: &PayState, session: &str) -> Result<(), ApiError> {
    if state.hosted.is_empty() || !hosted::is_session_id(session) {
        return Err(ApiError::NotFound(format!("no payment session {session}")));
    }
    Ok(())
}

/// The session of a page, on a hosted gateway this receiver serves pages for.
async fn session_of(
    state: &PayState,
    session: &str,
) -> Result<(hosted::HostedPayment, HostedGateway), ApiError> {
    let not_found = || ApiError::NotFound(format!("no payment session {session}"));
    served(state, session)?;
    let p = hosted::payment(&state.pool, session)
        .await?
        .ok_or_else(not_found)?;
    let gateway = hosted_gateway(state, p.gateway).map_err(|_| not_found())?;
    Ok((p, gateway))
}

#[utoipa::path(
    get,
    path = "/pay/{session}",
    tag = "payment pages",
    params(
        ("session" = String, Path, description = "The payment session, from the order's payment link."),
    ),
    responses(
        (status = 200, description = "The simulator's payment page: the amount, pay and fail (simulated: no money moves).", content_type = "text/html", body = String),
        (status = 404, description = "`not_found`: no such session, or the simulator is off.", body = super::openapi::ErrorBody),
    ),
)]
async fn page(
    _caller: Buyer,
    State(state): State<PayState>,
    Path(session): Path<String>,
) -> Result<Response, ApiError> {
    let (p, gateway) = session_of(&state, &session).await?;
    let order = orders::view(&state.pool, p.order_number).await?;
    let amount = p.money().map(|m| m.to_string()).unwrap_or_default();
    let title = format!("Order {}: {amount}", p.order_number);
    let body = match (p.status.as_str(), order.as_ref().map(|o| o.status)) {
        ("pending", Some(s)) if s.is_payable() => format!(
            "<p>Pay {amount} to the marketplace for order {n}.</p>\
             <p><strong>Simulated payment:</strong> no money moves.</p>\
             <form method=\"post\"><input type=\"hidden\" name=\"token\" value=\"{token}\">\
             <button name=\"outcome\" value=\"succeeded\">Pay</button>\
             <button name=\"outcome\" value=\"failed\">Fail</button></form>",
            amount = escape(&amount),
            n = p.order_number,
            token = escape(&form_token(&gateway, &session, Utc::now().timestamp())),
        ),
        ("pending", Some(s)) => format!("<p>This order is {s}: it cannot be paid any more.</p>"),
        (status, _) => format!("<p>This payment is {}.</p>", escape(status)),
    };
    Ok(guarded(StatusCode::OK, layout(&title, &body), None))
}

#[derive(Deserialize)]
struct Decision {
    outcome: String,
    token: Option<String>,
}

fn refused(message: &str) -> Response {
    tracing::warn!("payment page post refused: {message}");
    guarded(
        StatusCode::FORBIDDEN,
        layout("Not done", &format!("<p>{}</p>", escape(message))),
        None,
    )
}

#[utoipa::path(
    post,
    path = "/pay/{session}",
    tag = "payment pages",
    params(
        ("session" = String, Path, description = "The payment session, from the order's payment link."),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "`outcome` (`succeeded` or `failed`) and the page's form `token`. Only from this receiver's origin."),
    responses(
        (status = 200, description = "The outcome, recorded; the gateway delivers its signed event.", content_type = "text/html", body = String),
        (status = 403, description = "A form from another origin, or a wrong or stale token: nothing recorded.", content_type = "text/html", body = String),
        (status = 400, description = "`invalid_form`: a form that does not read.", body = super::openapi::ErrorBody),
        (status = 404, description = "`not_found`: no such session, or the simulator is off.", body = super::openapi::ErrorBody),
        (status = 408, description = "`request_timeout`: the body did not arrive in time.", body = super::openapi::ErrorBody),
        (status = 409, description = "The order cannot be paid any more.", content_type = "text/html", body = String),
        (status = 422, description = "`invalid_outcome`: an outcome other than `succeeded` or `failed`.", body = super::openapi::ErrorBody),
        (status = 413, description = "`payload_too_large`: a form over 4 KiB.", body = super::openapi::ErrorBody),
    ),
)]
async fn decide(
    _caller: Buyer,
    State(state): State<PayState>,
    Path(session): Path<String>,
    headers: HeaderMap,
    form: Result<Form<Decision>, FormRejection>,
) -> Result<Response, ApiError> {
    served(&state, &session)?;
    if !html::same_origin(&headers, &state.public_url) {
        return Ok(refused(
            "this form was sent from another site: nothing was recorded",
        ));
    }
    let Form(form) = form.map_err(|e| match e {
        FormRejection::BytesRejection(r) => ApiError::from_body(r, None),
        e => ApiError::BadRequest {
            code: "invalid_form",
            message: format!("expected a form with outcome=succeeded or outcome=failed: {e}"),
        },
    })?;
    let outcome = match form.outcome.as_str() {
        "succeeded" => Outcome::Succeeded,
        "failed" => Outcome::Failed,
        other => {
            return Err(ApiError::Unprocessable {
                code: "invalid_outcome",
                message: format!("outcome must be succeeded or failed, not {other:?}"),
            });
        }
    };
    let (p, gateway) = session_of(&state, &session).await?;
    let token_ok = form
        .token
        .as_deref()
        .is_some_and(|t| form_token_holds(&gateway, &session, t, Utc::now().timestamp()));
    if !token_ok {
        return Ok(refused(
            "this form is not one this page gave (its token is missing, wrong or expired): nothing was recorded; open the payment page again",
        ));
    }
    let payable = orders::view(&state.pool, p.order_number)
        .await?
        .is_some_and(|o| o.status.is_payable());
    if !payable && p.status == "pending" {
        return Ok(guarded(
            StatusCode::CONFLICT,
            layout("Not payable", "<p>This order cannot be paid any more.</p>"),
            None,
        ));
    }
    let decided = gateway
        .decide(&session, outcome)
        .await
        .map_err(|e| match e {
            crate::gateways::GatewayError::Database(db) => ApiError::from(db),
            other => ApiError::Internal(Box::new(other)),
        })?;
    let text = match decided.status.as_str() {
        "succeeded" => "Payment taken. The marketplace confirms your order in a moment.",
        "failed" => "The payment failed. Nothing was taken.",
        _ => "The payment is pending.",
    };
    Ok(guarded(
        StatusCode::OK,
        layout(
            &format!("Order {}", p.order_number),
            &format!("<p>{text}</p>"),
        ),
        None,
    ))
}

/// Razorpay's order ids: `order_` then letters and digits (14 of them today).
fn razorpay_order_id(id: &str) -> bool {
    id.strip_prefix("order_").is_some_and(|rest| {
        (1..=40).contains(&rest.len()) && rest.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

#[utoipa::path(
    get,
    path = "/pay/razorpay/{order_id}",
    tag = "payment pages",
    params(
        ("order_id" = String, Path, description = "Razorpay's order id, from the payment link."),
    ),
    responses(
        (status = 200, description = "Razorpay's checkout for the order (Razorpay's own script).", content_type = "text/html", body = String),
        (status = 404, description = "`not_found`: no such order, or Razorpay is not enabled.", body = super::openapi::ErrorBody),
    ),
)]
async fn razorpay_page(
    _caller: Buyer,
    State(state): State<PayState>,
    Path(order_id): Path<String>,
) -> Result<Response, ApiError> {
    let key_id = state
        .razorpay_key_id
        .clone()
        .ok_or_else(|| ApiError::NotFound("gateway razorpay is not enabled".into()))?;
    // Only Razorpay's own shape of order id (`order_` and letters and digits) is put in the
    // page's script: anything else any sender made up is no order of ours.
    if !razorpay_order_id(&order_id) {
        return Err(ApiError::NotFound("no such Razorpay order".into()));
    }
    // The values as JavaScript strings (JSON, `<` escaped so no `</script>` can end the block).
    let js = |v: &str| {
        serde_json::Value::from(v)
            .to_string()
            .replace('<', "\\u003c")
    };
    let body = format!(
        "<p>Opening Razorpay Checkout…</p>\
         <script src=\"https://checkout.razorpay.com/v1/checkout.js\"></script>\
         <script>new Razorpay({{key:{k},order_id:{o},callback_url:\"/orders/paid\"}}).open();</script>",
        k = js(&key_id),
        o = js(&order_id)
    );
    Ok(guarded(
        StatusCode::OK,
        layout("Pay with Razorpay", &body),
        Some("https://checkout.razorpay.com https://api.razorpay.com"),
    ))
}
