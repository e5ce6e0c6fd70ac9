//! The hosted gateway's payment page (`/pay/{session}`): the order's amount with "pay" and
//! "fail" buttons; the form's POST records the outcome at the gateway, which then delivers its
//! signed event to the receiver like any gateway would. Also the page that opens Razorpay
//! Checkout for a Razorpay order, and the pages Stripe sends buyers back to.

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::get;
use serde::Deserialize;

use super::html::{self, escape};
use super::{ApiError, AppState};
use crate::gateways::hosted::{self, HostedGateway, Outcome};
use crate::gateways::{GatewayName, PaymentGateway};
use crate::orders;

pub(super) fn routes(state: AppState) -> axum::Router {
    axum::Router::new()
        .route("/pay/{session}", get(page).post(decide))
        .route("/pay/razorpay/{order_id}", get(razorpay_page))
        .route(
            "/orders/paid",
            get(|| async {
                Html(layout(
                    "Payment received",
                    "<p>Thank you: your payment is being confirmed.</p>",
                ))
            }),
        )
        .route(
            "/orders/cancelled",
            get(|| async { Html(layout("Payment cancelled", "<p>No payment was taken.</p>")) }),
        )
        .with_state(state)
}

fn layout(title: &str, body: &str) -> String {
    html::page(
        title,
        "body{font-family:sans-serif;max-width:32rem;margin:3rem auto}button{font-size:1.1rem;margin-right:1rem}",
        body,
    )
}

fn hosted_gateway(state: &AppState, gateway: GatewayName) -> Result<HostedGateway, ApiError> {
    state
        .hosted
        .iter()
        .find(|g| g.name() == gateway)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("gateway {gateway} is not enabled")))
}

async fn page(
    State(state): State<AppState>,
    Path(session): Path<String>,
) -> Result<Html<String>, ApiError> {
    let p = hosted::payment(&state.pool, &session)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no payment session {session}")))?;
    let order = orders::view(&state.pool, p.order_number).await?;
    let amount = p.money().map(|m| m.to_string()).unwrap_or_default();
    let title = format!("Order {}: {amount}", p.order_number);
    let body = match (p.status.as_str(), order.as_ref().map(|o| o.status)) {
        ("pending", Some(s)) if s.is_payable() => format!(
            "<p>Pay {amount} to the marketplace for order {n}.</p>\
             <form method=\"post\"><button name=\"outcome\" value=\"succeeded\">Pay</button>\
             <button name=\"outcome\" value=\"failed\">Fail</button></form>",
            amount = escape(&amount),
            n = p.order_number
        ),
        ("pending", Some(s)) => format!("<p>This order is {s}: it cannot be paid any more.</p>"),
        (status, _) => format!("<p>This payment is {}.</p>", escape(status)),
    };
    Ok(Html(layout(&title, &body)))
}

#[derive(Deserialize)]
struct Decision {
    outcome: String,
}

async fn decide(
    State(state): State<AppState>,
    Path(session): Path<String>,
    form: Result<Form<Decision>, FormRejection>,
) -> Result<(StatusCode, Html<String>), ApiError> {
    let Form(form) = form.map_err(|e| ApiError::BadRequest {
        code: "invalid_form",
        message: format!("expected a form with outcome=succeeded or outcome=failed: {e}"),
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
    let p = hosted::payment(&state.pool, &session)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no payment session {session}")))?;
    let payable = orders::view(&state.pool, p.order_number)
        .await?
        .is_some_and(|o| o.status.is_payable());
    if !payable && p.status == "pending" {
        return Ok((
            StatusCode::CONFLICT,
            Html(layout(
                "Not payable",
                "<p>This order cannot be paid any more.</p>",
            )),
        ));
    }
    let gateway = hosted_gateway(&state, p.gateway)?;
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
    Ok((
        StatusCode::OK,
        Html(layout(
            &format!("Order {}", p.order_number),
            &format!("<p>{text}</p>"),
        )),
    ))
}

async fn razorpay_page(
    State(state): State<AppState>,
    Path(order_id): Path<String>,
) -> Result<Html<String>, ApiError> {
    let key_id = state
        .razorpay_key_id
        .clone()
        .ok_or_else(|| ApiError::NotFound("gateway razorpay is not enabled".into()))?;
    let body = format!(
        "<p>Opening Razorpay Checkout…</p>\
         <script src=\"https://checkout.razorpay.com/v1/checkout.js\"></script>\
         <script>new Razorpay({{key:\"{k}\",order_id:\"{o}\",callback_url:\"/orders/paid\"}}).open();</script>",
        k = escape(&key_id),
        o = escape(&order_id)
    );
    Ok(Html(layout("Pay with Razorpay", &body)))
}
