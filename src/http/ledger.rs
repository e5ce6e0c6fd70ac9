//! The money read API: a seller's balances, ledger, payouts and commission invoices (JSON, and
//! a printable page per invoice), a buyer's coin wallets. Amounts are decimal strings in the
//! currency's minor unit, with the currency beside them.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::Html;
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};

use super::callers::Backend;
use super::html::{escape, page};
use super::{ApiError, Routes};
use crate::catalogue::{self, SellerId};
use crate::ledger::{self, coins, invoices, payouts};

/// What the ledger's read API: the pool.
#[derive(Clone)]
pub struct LedgerState {
    pub pool: sqlx::PgPool,
    pub callers: super::Callers,
}

pub(super) fn routes(state: LedgerState) -> Routes {
    Routes::default()
        .route("/sellers/{id}/balances", get(balances))
        .route("/sellers/{id}/ledger", get(entries))
        .route("/sellers/{id}/payouts", get(seller_payouts))
        .route("/sellers/{id}/invoices", get(seller_invoices))
        .route("/sellers/{id}/invoices/{number}", get(invoice))
        .route("/sellers/{id}/invoices/{number}/print", get(invoice_page))
        .route("/wallets/{buyer}", get(wallets))
        .with_state(state)
}

/// A seller named by the path, that the caller may read: 403 for a key bound to another seller
/// (checked before the seller is looked up, so it learns nothing of who exists), 404 (as JSON)
/// for an id that is not one, or not known.
async fn seller(
    state: &LedgerState,
    caller: &Backend,
    raw: &str,
) -> Result<catalogue::Seller, ApiError> {
    let id: SellerId = raw
        .parse()
        .map_err(|_| ApiError::NotFound(format!("no seller {raw:?}")))?;
    caller.may_read(id)?;
    catalogue::seller(&state.pool, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no seller {id}")))
}

async fn balances(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = ledger::balances(&state.pool, &s.id.to_string()).await?;
    Ok(Json(json!({ "seller_id": s.id, "balances": list })))
}

#[derive(Deserialize)]
struct Page {
    after: Option<i64>,
    limit: Option<i64>,
}

const MAX_PAGE: i64 = 500;

/// The seller's entries, oldest first; `next_after` continues the listing.
async fn entries(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
    page: Result<Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(page) = page.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = page.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit is 1 to {MAX_PAGE}, not {limit}"
        )));
    }
    let s = seller(&state, &caller, &raw).await?;
    let list = ledger::entries(
        &state.pool,
        &s.id.to_string(),
        page.after.unwrap_or(0),
        limit,
    )
    .await?;
    let next = (list.len() as i64 == limit)
        .then(|| list.last().map(|e| e.id))
        .flatten();
    Ok(Json(
        json!({ "seller_id": s.id, "entries": list, "next_after": next }),
    ))
}

async fn seller_payouts(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = payouts::list(&state.pool, &s.id.to_string()).await?;
    Ok(Json(json!({ "seller_id": s.id, "payouts": list })))
}

async fn seller_invoices(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = invoices::list(&state.pool, s.id).await?;
    Ok(Json(json!({ "seller_id": s.id, "invoices": list })))
}

async fn find_invoice(
    state: &LedgerState,
    caller: &Backend,
    raw: &str,
    number: &str,
) -> Result<invoices::Invoice, ApiError> {
    let s = seller(state, caller, raw).await?;
    let n: i64 = number
        .parse()
        .map_err(|_| ApiError::NotFound(format!("no invoice {number:?}")))?;
    invoices::get(&state.pool, s.id, n)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("seller {} has no invoice {n}", s.id)))
}

async fn invoice(
    caller: Backend,
    State(state): State<LedgerState>,
    Path((raw, number)): Path<(String, String)>,
) -> Result<Json<invoices::Invoice>, ApiError> {
    Ok(Json(find_invoice(&state, &caller, &raw, &number).await?))
}

const INVOICE_CSS: &str = "body{font-family:sans-serif;max-width:48rem;margin:2rem auto}\
    table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ccc;padding:.3rem;text-align:left}\
    td.n{text-align:right}@media print{body{margin:0}}";

/// The invoice as a page to print.
async fn invoice_page(
    caller: Backend,
    State(state): State<LedgerState>,
    Path((raw, number)): Path<(String, String)>,
) -> Result<Html<String>, ApiError> {
    let inv = find_invoice(&state, &caller, &raw, &number).await?;
    let mut body = format!(
        "<p>Seller: {}<br>Period: {} to {} (exclusive)<br>Issued: {}</p>\
         <table><thead><tr><th>#</th><th>Order</th><th>Description</th><th>Currency</th><th>Commission</th></tr></thead><tbody>",
        escape(&inv.seller_name),
        inv.period_start,
        inv.period_end,
        inv.created_at.format("%Y-%m-%d"),
    );
    for l in &inv.lines {
        body.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td></tr>",
            l.line,
            l.order_number,
            escape(&l.description),
            escape(&l.currency),
            escape(&l.commission)
        ));
    }
    body.push_str("</tbody></table><h2>Totals</h2><table><tbody>");
    for t in &inv.totals {
        body.push_str(&format!(
            "<tr><th>{}</th><td class=\"n\">{}</td></tr>",
            escape(&t.currency),
            escape(&t.commission)
        ));
    }
    body.push_str("</tbody></table>");
    Ok(Html(page(
        &format!("Commission invoice {}", inv.number),
        INVOICE_CSS,
        &body,
    )))
}

/// A buyer's coins: the backend's (whose own buyers they are), not a seller's key.
async fn wallets(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(buyer): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.acts_for_buyers()?;
    if buyer.is_empty() || buyer.chars().count() > 200 || buyer.chars().any(char::is_control) {
        return Err(ApiError::NotFound(format!("no buyer {buyer:?}")));
    }
    let list = coins::wallets(&state.pool, &buyer).await?;
    Ok(Json(json!({ "buyer_id": buyer, "wallets": list })))
}
