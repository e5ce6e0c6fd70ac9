//! The money read API: a seller's balances, ledger, payouts and commission invoices (JSON, and
//! a printable page per invoice), a buyer's coin wallets. Amounts are decimal strings in the
//! currency's minor unit, with the currency beside them.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::Html;
use axum::routing::get;
use serde::{Deserialize, Serialize};

use super::callers::Backend;
use super::html::{escape, page};
use super::openapi::ErrorBody;
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

/// A seller's balances, one per currency.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct Balances {
    seller_id: SellerId,
    balances: Vec<ledger::Balance>,
}

/// A page of a seller's ledger, oldest first.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct Entries {
    seller_id: SellerId,
    entries: Vec<ledger::Entry>,
    /// The last entry's id when the page is full: `?after=` it for the next page.
    next_after: Option<i64>,
}

/// A seller's payouts, newest first.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct SellerPayouts {
    seller_id: SellerId,
    payouts: Vec<payouts::Payout>,
}

/// A seller's commission invoices.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct SellerInvoices {
    seller_id: SellerId,
    invoices: Vec<invoices::Invoice>,
}

/// A buyer's coin wallets, one per currency.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct Wallets {
    buyer_id: String,
    wallets: Vec<coins::Wallet>,
}

#[utoipa::path(
    get,
    path = "/sellers/{id}/balances",
    tag = "money",
    params(("id" = SellerId, Path, description = "The seller's id.")),
    responses(
        (status = 200, description = "Pending, available and connected sales per currency.", body = Balances),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn balances(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<Balances>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = ledger::balances(&state.pool, &s.id.to_string()).await?;
    Ok(Json(Balances {
        seller_id: s.id,
        balances: list,
    }))
}

#[derive(Deserialize)]
struct Page {
    after: Option<i64>,
    limit: Option<i64>,
}

const MAX_PAGE: i64 = 500;

/// The seller's entries, oldest first; `next_after` continues the listing.
#[utoipa::path(
    get,
    path = "/sellers/{id}/ledger",
    tag = "money",
    params(
        ("id" = SellerId, Path, description = "The seller's id."),
        ("after" = Option<i64>, Query, description = "Entries after this id (0 by default)."),
        ("limit" = Option<i64>, Query, description = "1 to 500 (100 by default)."),
    ),
    responses(
        (status = 200, description = "Entries with each balance before and after.", body = Entries),
        (status = 400, description = "`bad_request`: a limit outside 1 to 500, or a query that does not read.", body = ErrorBody),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn entries(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
    page: Result<Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Entries>, ApiError> {
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
    Ok(Json(Entries {
        seller_id: s.id,
        entries: list,
        next_after: next,
    }))
}

#[utoipa::path(
    get,
    path = "/sellers/{id}/payouts",
    tag = "money",
    params(("id" = SellerId, Path, description = "The seller's id.")),
    responses(
        (status = 200, description = "The seller's payouts, newest first.", body = SellerPayouts),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn seller_payouts(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<SellerPayouts>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = payouts::list(&state.pool, &s.id.to_string()).await?;
    Ok(Json(SellerPayouts {
        seller_id: s.id,
        payouts: list,
    }))
}

#[utoipa::path(
    get,
    path = "/sellers/{id}/invoices",
    tag = "money",
    params(("id" = SellerId, Path, description = "The seller's id.")),
    responses(
        (status = 200, description = "The seller's commission invoices.", body = SellerInvoices),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn seller_invoices(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(raw): Path<String>,
) -> Result<Json<SellerInvoices>, ApiError> {
    let s = seller(&state, &caller, &raw).await?;
    let list = invoices::list(&state.pool, s.id).await?;
    Ok(Json(SellerInvoices {
        seller_id: s.id,
        invoices: list,
    }))
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

#[utoipa::path(
    get,
    path = "/sellers/{id}/invoices/{number}",
    tag = "money",
    params(
        ("id" = SellerId, Path, description = "The seller's id."),
        ("number" = i64, Path, description = "The invoice's number."),
    ),
    responses(
        (status = 200, description = "The invoice: a line per order, totals per currency.", body = invoices::Invoice),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller or invoice.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
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
#[utoipa::path(
    get,
    path = "/sellers/{id}/invoices/{number}/print",
    tag = "money",
    params(
        ("id" = SellerId, Path, description = "The seller's id."),
        ("number" = i64, Path, description = "The invoice's number."),
    ),
    responses(
        (status = 200, description = "The invoice as a page to print.", content_type = "text/html", body = String),
        (status = 403, description = "`forbidden`: a key bound to another seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: no such seller or invoice.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
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
#[utoipa::path(
    get,
    path = "/wallets/{buyer}",
    tag = "money",
    params(("buyer" = String, Path, description = "The buyer's id, as the checkout named it.")),
    responses(
        (status = 200, description = "The buyer's wallets: balance and reserved, per currency.", body = Wallets),
        (status = 403, description = "`forbidden`: a key bound to a seller.", body = ErrorBody),
        (status = 404, description = "`not_found`: not a buyer id.", body = ErrorBody),
    ),
    security(("api_key" = [])),
)]
async fn wallets(
    caller: Backend,
    State(state): State<LedgerState>,
    Path(buyer): Path<String>,
) -> Result<Json<Wallets>, ApiError> {
    caller.acts_for_buyers()?;
    if buyer.is_empty() || buyer.chars().count() > 200 || buyer.chars().any(char::is_control) {
        return Err(ApiError::NotFound(format!("no buyer {buyer:?}")));
    }
    let list = coins::wallets(&state.pool, &buyer).await?;
    Ok(Json(Wallets {
        buyer_id: buyer,
        wallets: list,
    }))
}
