//! The dashboard's pages for working in: one job (its arguments, each attempt's error, who
//! holds it; retry, discard, run now), jobs filtered and paged, one order (its journey,
//! payments, refunds and disputes, ledger transfers, messages), one seller (balances, ledger
//! paged, payouts, invoices) and one payment event (its body as signed, its outcome; replay).

use axum::extract::{Path, Query, State};
use axum::http::header::LOCATION;
use axum::http::{HeaderValue, StatusCode};
use chrono::DurationRound;
use serde::Deserialize;

use super::{DashboardState, OperatorSession, Page, ROWS, button, id_of, table, time};
use crate::http::ApiError;
use crate::http::html::escape;
use payfleet_queue::admin::{self as jobs, JobFilter};
use payfleet_queue::{JobId, JobState};

/// A payment of an order's sessions: session, payment id, status, amount, refunded.
type PaymentRow = (String, Option<String>, String, Option<String>, String);

fn link(href: &str, text: &str) -> String {
    format!("<a href=\"{}\">{}</a>", escape(href), escape(text))
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// `GET /admin/ui/jobs/{id}`.
#[utoipa::path(
    get,
    path = "/admin/ui/jobs/{id}",
    tag = "dashboard",
    params(
        ("id" = i64, Path, description = "The job's id."),
    ),
    responses(
        (status = 200, description = "The job: arguments, attempts and errors, lease, keys, and its actions.", content_type = "text/html", body = String),
        (status = 404, description = "No such job.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn job_page(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    Path(raw): Path<String>,
) -> Result<Page, Page> {
    let id = id_of(&raw)?;
    let csrf = operator.csrf();
    let Some(j) = jobs::job(&state.pool, JobId(id)).await? else {
        return Err(ApiError::NotFound(format!(
            "no job {id} (a job that completed is not kept: what it did is in its own records)"
        ))
        .into());
    };
    let mut actions = Vec::new();
    if matches!(
        j.state,
        JobState::Discarded | JobState::Cancelled | JobState::Retryable
    ) {
        actions.push(button(
            &format!("/admin/ui/jobs/{id}/retry"),
            &csrf,
            "Retry",
        ));
    }
    if matches!(j.state, JobState::Available | JobState::Retryable) {
        actions.push(button(
            &format!("/admin/ui/jobs/{id}/run"),
            &csrf,
            "Run now",
        ));
        actions.push(button(
            &format!("/admin/ui/jobs/{id}/discard"),
            &csrf,
            "Discard",
        ));
    }
    let facts = [
        (
            "queue",
            link(&format!("/admin/ui/jobs?queue={}", j.queue), &j.queue),
        ),
        ("kind", escape(&j.kind)),
        ("state", escape(j.state.as_str())),
        ("attempt", format!("{} of {}", j.attempt, j.max_attempts)),
        ("key", escape(j.key.as_deref().unwrap_or("none"))),
        (
            "fairness key",
            escape(j.fairness_key.as_deref().unwrap_or("none")),
        ),
        ("runs at / ran at", time(Some(j.run_at))),
        ("enqueued", time(Some(j.created_at))),
        ("last started", time(j.attempted_at)),
        ("finished", time(j.finished_at)),
        (
            "lease holder",
            escape(j.locked_by.as_deref().unwrap_or("none (not running)")),
        ),
        ("lease ends", time(j.lease_expires_at)),
    ];
    let facts: String = facts
        .iter()
        .map(|(k, v)| format!("<tr><th>{}</th><td>{v}</td></tr>", escape(k)))
        .collect();
    let attempts: Vec<String> = j
        .errors
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let field = |k: &str| match &e[k] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            };
            format!(
                "<tr><td class=\"n\">{}</td><td>{}</td><td>{}</td><td><pre>{}</pre></td></tr>",
                escape(&field("attempt")),
                escape(&field("at")),
                escape(&field("worker")),
                escape(&field("error"))
            )
        })
        .collect();
    let body = format!(
        "<p>{} · {}</p><h2>Job {id}</h2><div id=\"job-actions\">{}</div><table id=\"job\">{facts}</table>\
         <h2>Arguments</h2><pre id=\"job-args\">{}</pre><h2>Failed attempts</h2>{}",
        link("/admin/ui", "Dashboard"),
        link("/admin/ui/jobs", "All jobs"),
        if actions.is_empty() {
            "<span class=\"muted\">Nothing to do: it is running, or done.</span>".to_owned()
        } else {
            actions.join(" ")
        },
        escape(&pretty(&j.payload)),
        table(
            "attempts",
            &["attempt", "at", "worker", "error"],
            attempts,
            "No attempt failed.",
        )
    );
    Ok(Page::new(StatusCode::OK, "payfleet job", body))
}

#[derive(Deserialize, Default)]
pub(super) struct JobsQuery {
    queue: Option<String>,
    kind: Option<String>,
    state: Option<String>,
    key: Option<String>,
    before: Option<i64>,
}

fn given(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// `GET /admin/ui/jobs?queue=&kind=&state=&key=&before=`: the kept jobs, newest first, 50 a
/// page.
#[utoipa::path(
    get,
    path = "/admin/ui/jobs",
    tag = "dashboard",
    params(
        ("queue" = Option<String>, Query, description = "Only this queue."),
        ("kind" = Option<String>, Query, description = "Only this kind."),
        ("state" = Option<String>, Query, description = "Only this state."),
        ("key" = Option<String>, Query, description = "Only this key."),
        ("before" = Option<i64>, Query, description = "Jobs before this id (the next page)."),
    ),
    responses(
        (status = 200, description = "Jobs, newest first, 50 a page.", content_type = "text/html", body = String),
        (status = 400, description = "A query that does not read, or an unknown state.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn jobs_page(
    _operator: OperatorSession,
    State(state): State<DashboardState>,
    query: Result<Query<JobsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Page, Page> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let wanted_state = match given(&q.state) {
        Some(s) => Some(s.parse::<JobState>().map_err(|_| {
            ApiError::bad_request(format!(
                "state {s:?} is not one of available, running, retryable, discarded, cancelled"
            ))
        })?),
        None => None,
    };
    let filter = JobFilter {
        queue: given(&q.queue),
        kind: given(&q.kind),
        state: wanted_state,
        key_prefix: given(&q.key),
        before: q.before.map(JobId),
    };
    let list = jobs::list(&state.pool, &filter, ROWS).await?;
    let rows: Vec<String> = list
        .iter()
        .map(|j| {
            format!(
                "<tr id=\"job-{id}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}/{}</td><td>{}</td></tr>",
                link(&format!("/admin/ui/jobs/{}", j.id.0), &j.id.0.to_string()),
                escape(&j.queue),
                escape(&j.kind),
                escape(j.key.as_deref().unwrap_or("")),
                escape(j.state.as_str()),
                j.attempt,
                j.max_attempts,
                time(Some(j.run_at)),
                id = j.id.0,
            )
        })
        .collect();
    let value = |v: &Option<String>| escape(v.as_deref().unwrap_or(""));
    let form = format!(
        "<form id=\"job-filter\" method=\"get\" action=\"/admin/ui/jobs\">\
         <label>queue <input name=\"queue\" value=\"{}\"></label> \
         <label>kind <input name=\"kind\" value=\"{}\"></label> \
         <label>state <input name=\"state\" value=\"{}\" placeholder=\"discarded\"></label> \
         <label>key starts with <input name=\"key\" value=\"{}\"></label> \
         <button type=\"submit\">Show</button></form>",
        value(&q.queue),
        value(&q.kind),
        value(&q.state),
        value(&q.key)
    );
    let next = if list.len() as i64 == ROWS {
        list.last().map(|last| {
            let mut params = vec![format!("before={}", last.id.0)];
            for (name, v) in [
                ("queue", &filter.queue),
                ("kind", &filter.kind),
                ("key", &filter.key_prefix),
            ] {
                if let Some(v) = v {
                    params.push(format!("{name}={}", super::url_escape(v)));
                }
            }
            if let Some(s) = filter.state {
                params.push(format!("state={}", s.as_str()));
            }
            format!(
                "<p>{}</p>",
                link(
                    &format!("/admin/ui/jobs?{}", params.join("&")),
                    "Older jobs"
                )
            )
        })
    } else {
        None
    };
    let body = format!(
        "<p>{}</p><h2>Jobs</h2><p class=\"muted\">Kept jobs, newest first: waiting, running, retrying, dead and cancelled (a completed job is deleted as it completes).</p>{form}{}{}",
        link("/admin/ui", "Dashboard"),
        table(
            "jobs",
            &["id", "queue", "kind", "key", "state", "attempt", "runs at"],
            rows,
            "No job matches."
        ),
        next.unwrap_or_default()
    );
    Ok(Page::new(StatusCode::OK, "payfleet jobs", body))
}

#[derive(Deserialize)]
pub(super) struct Lookup {
    number: Option<String>,
}

/// `GET /admin/ui/order?number=N`: the dashboard's lookup form, sent on to the order's page.
#[utoipa::path(
    get,
    path = "/admin/ui/order",
    tag = "dashboard",
    params(
        ("number" = String, Query, description = "The order's number."),
    ),
    responses(
        (status = 303, description = "On to the order's page."),
        (status = 404, description = "Not an order number.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn order_lookup(
    _operator: OperatorSession,
    Query(q): Query<Lookup>,
) -> Result<Page, Page> {
    let raw = q.number.unwrap_or_default();
    let number = id_of(raw.trim())?;
    let mut page = Page::new(StatusCode::SEE_OTHER, "Order", String::new());
    if let Ok(v) = HeaderValue::from_str(&format!("/admin/ui/orders/{number}")) {
        page.headers.push((LOCATION, v));
    }
    Ok(page)
}

/// `GET /admin/ui/orders/{number}`: the order, its journey, its money.
#[utoipa::path(
    get,
    path = "/admin/ui/orders/{number}",
    tag = "dashboard",
    params(
        ("number" = i64, Path, description = "The order's number."),
    ),
    responses(
        (status = 200, description = "The order: its journey, payment facts, refunds, ledger entries and messages.", content_type = "text/html", body = String),
        (status = 404, description = "No such order.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn order_page(
    _operator: OperatorSession,
    State(state): State<DashboardState>,
    Path(raw): Path<String>,
) -> Result<Page, Page> {
    let number = id_of(&raw)?;
    let pool = &state.pool;
    let Some(o) = crate::orders::view(pool, number).await? else {
        return Err(ApiError::NotFound(format!("no order {number}")).into());
    };
    let facts = [
        ("status", escape(o.status.as_str())),
        ("payment status", escape(o.payment_status.as_str())),
        (
            "seller",
            link(
                &format!("/admin/ui/sellers/{}", o.seller_id),
                &o.seller_id.to_string(),
            ),
        ),
        ("buyer", escape(&o.buyer_id)),
        ("kind", escape(o.kind.as_str())),
        (
            "total",
            format!("{} {}", escape(&o.total), escape(&o.currency)),
        ),
        ("discount", escape(&o.discount)),
        ("platform fee", escape(&o.platform_fee)),
        ("seller's net", escape(&o.seller_net)),
        ("refunded", escape(&o.amount_refunded)),
        ("gateway", escape(o.gateway.as_str())),
        (
            "payment session",
            escape(o.payment.as_ref().map_or("none", |p| p.session_id.as_str())),
        ),
        ("created", time(Some(o.created_at))),
        ("expires", time(Some(o.expires_at))),
        ("paid", time(o.paid_at)),
    ];
    let facts: String = facts
        .iter()
        .map(|(k, v)| format!("<tr><th>{}</th><td>{v}</td></tr>", escape(k)))
        .collect();

    let journey: Vec<String> = crate::orders::journey(pool, number)
        .await?
        .iter()
        .map(|s| {
            format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td><pre>{}</pre></td></tr>",
                escape(&s.kind),
                time(Some(s.created_at)),
                time(s.published_at),
                escape(&pretty(&s.payload))
            )
        })
        .collect();

    let payments: Vec<PaymentRow> = sqlx::query_as(
        "SELECT po.session_id, po.payment_id, po.status, po.amount::text, po.amount_refunded::text
         FROM payment_orders po
         JOIN payment_sessions ps ON ps.gateway = po.gateway AND ps.session_id = po.session_id
         WHERE ps.order_number = $1 ORDER BY po.id",
    )
    .bind(number)
    .fetch_all(pool)
    .await?;
    let payments: Vec<String> = payments
        .iter()
        .map(|(session, payment, status, amount, refunded)| {
            format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                escape(session),
                escape(payment.as_deref().unwrap_or("")),
                escape(status),
                escape(amount.as_deref().unwrap_or("")),
                escape(refunded)
            )
        })
        .collect();

    let taken: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT 'refund', r.refund_id, r.amount::text, 'succeeded'
         FROM payment_refunds r JOIN payment_orders po ON po.id = r.payment_order_id
         JOIN payment_sessions ps ON ps.gateway = po.gateway AND ps.session_id = po.session_id
         WHERE ps.order_number = $1
         UNION ALL
         SELECT 'dispute', d.dispute_id, d.amount::text, d.status
         FROM payment_disputes d JOIN payment_orders po ON po.id = d.payment_order_id
         JOIN payment_sessions ps ON ps.gateway = po.gateway AND ps.session_id = po.session_id
         WHERE ps.order_number = $1
         UNION ALL
         SELECT 'refund request', r.idempotency_key, r.amount::text, r.state
         FROM refund_requests r WHERE r.order_number = $1",
    )
    .bind(number)
    .fetch_all(pool)
    .await?;
    let taken: Vec<String> = taken
        .iter()
        .map(|(what, id, amount, state)| {
            format!(
                "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
                escape(what),
                escape(id),
                escape(amount),
                escape(state)
            )
        })
        .collect();

    let transfers: Vec<String> = crate::ledger::of_order(pool, number)
        .await?
        .iter()
        .map(|t| {
            format!(
                "<tr><td>{}</td><td>{}</td><td class=\"n\">{} {}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&t.kind),
                escape(&t.source_key),
                t.amount,
                escape(&t.currency),
                escape(&t.from_account),
                escape(&t.to_account),
                time(Some(t.created_at))
            )
        })
        .collect();

    let body = format!(
        "<p>{}</p><h2>Order {number}</h2><table id=\"order\">{facts}</table>\
         <h2>Journey and messages</h2>{}<h2>Payments</h2>{}<h2>Refunds and disputes</h2>{}\
         <h2>Ledger</h2>{}",
        link("/admin/ui", "Dashboard"),
        table(
            "journey",
            &["event", "at", "message published", "details"],
            journey,
            "No order events."
        ),
        table(
            "payments",
            &["session", "payment", "status", "amount", "refunded"],
            payments,
            "No payment reported yet."
        ),
        table(
            "taken-back",
            &["what", "id", "amount", "state"],
            taken,
            "Nothing refunded or disputed."
        ),
        table(
            "ledger",
            &["kind", "source", "amount", "from", "to", "posted"],
            transfers,
            "Nothing posted for this order."
        ),
    );
    Ok(Page::new(StatusCode::OK, "payfleet order", body))
}

#[derive(Deserialize)]
pub(super) struct After {
    after: Option<i64>,
}

/// `GET /admin/ui/sellers/{id}?after=`: a seller's balances, ledger (50 entries a page),
/// payouts and invoices.
#[utoipa::path(
    get,
    path = "/admin/ui/sellers/{id}",
    tag = "dashboard",
    params(
        ("id" = crate::catalogue::SellerId, Path, description = "The seller's id."),
        ("after" = Option<i64>, Query, description = "Ledger entries after this id."),
    ),
    responses(
        (status = 200, description = "The seller: balances, ledger (50 entries a page), payouts and invoices.", content_type = "text/html", body = String),
        (status = 404, description = "No such seller.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn seller_page(
    _operator: OperatorSession,
    State(state): State<DashboardState>,
    Path(raw): Path<String>,
    Query(after): Query<After>,
) -> Result<Page, Page> {
    let pool = &state.pool;
    let seller: crate::catalogue::SellerId = raw
        .parse()
        .map_err(|_| ApiError::NotFound(format!("no seller {raw:?}")))?;
    let Some(s) = crate::catalogue::seller(pool, seller).await? else {
        return Err(ApiError::NotFound(format!("no seller {raw:?}")).into());
    };
    let id = seller.to_string();
    let balances: Vec<String> = crate::ledger::balances(pool, &id)
        .await?
        .iter()
        .map(|b| {
            format!(
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                escape(&b.currency),
                escape(&b.pending),
                escape(&b.available),
                escape(&b.connected_sales)
            )
        })
        .collect();
    let after = after.after.unwrap_or(0).max(0);
    let entries = crate::ledger::entries(pool, &id, after, ROWS).await?;
    let next = (entries.len() as i64 == ROWS)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    let entries: Vec<String> = entries
        .iter()
        .map(|e| {
            let order = e.order_number.map_or(String::new(), |n| {
                link(&format!("/admin/ui/orders/{n}"), &n.to_string())
            });
            format!(
                "<tr><td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{} {}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{order}</td><td>{}</td></tr>",
                e.id,
                escape(&e.bucket),
                escape(e.kind.as_str()),
                e.amount,
                escape(&e.currency),
                e.balance_before,
                e.balance_after,
                escape(&e.source_key),
                time(Some(e.created_at))
            )
        })
        .collect();
    let payouts: Vec<String> = crate::ledger::payouts::list(pool, &id)
        .await?
        .iter()
        .map(|p| {
            format!(
                "<tr><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{} {}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                p.id,
                p.period_start,
                p.amount,
                escape(&p.currency),
                escape(p.state.as_str()),
                escape(p.failure.as_deref().unwrap_or("")),
                time(Some(p.created_at))
            )
        })
        .collect();
    let invoices: Vec<String> = crate::ledger::invoices::list(pool, seller)
        .await?
        .iter()
        .map(|i| {
            let totals: Vec<String> = i
                .totals
                .iter()
                .map(|t| format!("{} {}", t.commission, t.currency))
                .collect();
            format!(
                "<tr><td class=\"n\">{}</td><td>{} to {}</td><td>{}</td><td>{}</td></tr>",
                i.number,
                i.period_start,
                i.period_end,
                escape(&totals.join(", ")),
                time(Some(i.created_at))
            )
        })
        .collect();
    let body = format!(
        "<p>{}</p><h2>Seller {}</h2><p>{}</p><h2>Balances</h2>{}<h2>Ledger</h2>{}{}<h2>Payouts</h2>{}<h2>Commission invoices</h2>{}",
        link("/admin/ui", "Dashboard"),
        escape(&s.name),
        escape(&id),
        table(
            "balances",
            &["currency", "pending", "available", "paid by the gateway"],
            balances,
            "No money yet."
        ),
        table(
            "seller-ledger",
            &[
                "entry", "bucket", "kind", "amount", "before", "after", "source", "order", "posted"
            ],
            entries,
            "No entries."
        ),
        next.map_or(String::new(), |n| format!(
            "<p>{}</p>",
            link(
                &format!("/admin/ui/sellers/{id}?after={n}"),
                "Later entries"
            )
        )),
        table(
            "payouts",
            &["payout", "period", "amount", "state", "failure", "made"],
            payouts,
            "No payouts."
        ),
        table(
            "invoices",
            &["invoice", "period", "commission", "made"],
            invoices,
            "No invoices."
        ),
    );
    Ok(Page::new(StatusCode::OK, "payfleet seller", body))
}

/// `GET /admin/ui/events/{id}`: a stored payment event: its body, headers and outcome.
#[utoipa::path(
    get,
    path = "/admin/ui/events/{id}",
    tag = "dashboard",
    params(
        ("id" = i64, Path, description = "The event's id."),
    ),
    responses(
        (status = 200, description = "The payment event: its body, outcome and replay.", content_type = "text/html", body = String),
        (status = 404, description = "No such event.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
pub(super) async fn event_page(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    Path(raw): Path<String>,
) -> Result<Page, Page> {
    let id = id_of(&raw)?;
    let row: Option<EventRow> = sqlx::query_as(
        "SELECT gateway, event_id, event_type, raw_body, headers, received_at, processed_at,
                outcome, outcome_detail
         FROM payment_events WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&state.pool)
    .await?;
    let Some(e) = row else {
        return Err(ApiError::NotFound(format!("no event {id}")).into());
    };
    let body_text = match serde_json::from_slice::<serde_json::Value>(&e.raw_body) {
        Ok(v) => pretty(&v),
        Err(_) => String::from_utf8_lossy(&e.raw_body).into_owned(),
    };
    let facts = [
        ("gateway", escape(&e.gateway)),
        ("event id", escape(&e.event_id)),
        ("type", escape(e.event_type.as_deref().unwrap_or(""))),
        ("received", time(Some(e.received_at))),
        ("processed", time(e.processed_at)),
        (
            "outcome",
            escape(e.outcome.as_deref().unwrap_or("none yet")),
        ),
        ("detail", escape(e.outcome_detail.as_deref().unwrap_or(""))),
    ];
    let facts: String = facts
        .iter()
        .map(|(k, v)| format!("<tr><th>{}</th><td>{v}</td></tr>", escape(k)))
        .collect();
    let replay = if e.processed_at.is_none() {
        button(
            &format!("/admin/ui/events/{id}/replay"),
            &operator.csrf(),
            "Replay",
        )
    } else {
        "<span class=\"muted\">Processed: replaying it would change nothing.</span>".to_owned()
    };
    let body = format!(
        "<p>{}</p><h2>Payment event {id}</h2><div id=\"event-actions\">{replay}</div><table id=\"event\">{facts}</table>\
         <h2>Body (as signed)</h2><pre id=\"event-body\">{}</pre><h2>Headers</h2><pre>{}</pre>",
        link("/admin/ui", "Dashboard"),
        escape(&body_text),
        escape(&pretty(&e.headers))
    );
    Ok(Page::new(StatusCode::OK, "payfleet event", body))
}

#[derive(sqlx::FromRow)]
struct EventRow {
    gateway: String,
    event_id: String,
    event_type: Option<String>,
    raw_body: Vec<u8>,
    headers: serde_json::Value,
    received_at: chrono::DateTime<chrono::Utc>,
    processed_at: Option<chrono::DateTime<chrono::Utc>>,
    outcome: Option<String>,
    outcome_detail: Option<String>,
}

/// The last hour, a minute a column: payment events received (grey bars), processed (blue
/// line), and failures (red bars: failed job attempts and rejected events), as an SVG drawn here
/// (no script, so the strict CSP holds).
pub(super) async fn hour_chart(pool: &sqlx::PgPool) -> Result<String, sqlx::Error> {
    let now = chrono::Utc::now();
    let start = now
        .duration_trunc(chrono::TimeDelta::minutes(1))
        .unwrap_or(now)
        - chrono::TimeDelta::minutes(59);
    let mut received = [0i64; 60];
    let mut processed = [0i64; 60];
    let mut failed = [0i64; 60];
    let slot = |at: chrono::DateTime<chrono::Utc>| -> Option<usize> {
        usize::try_from((at - start).num_minutes())
            .ok()
            .filter(|i| *i < 60)
    };
    for (m, r, p, rejected) in crate::payments::events::per_minute(pool, start).await? {
        if let Some(i) = slot(m) {
            received[i] = r;
            processed[i] = p;
            failed[i] += rejected;
        }
    }
    for (m, n) in jobs::failures_per_minute(pool, start).await? {
        if let Some(i) = slot(m) {
            failed[i] += n;
        }
    }
    Ok(chart_svg(&received, &processed, &failed))
}

fn chart_svg(received: &[i64; 60], processed: &[i64; 60], failed: &[i64; 60]) -> String {
    const W: i64 = 720;
    const H: i64 = 160;
    const COL: i64 = W / 60;
    let top = received
        .iter()
        .chain(processed)
        .chain(failed)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let y = |v: i64| H - v * (H - 10) / top;
    let mut svg = format!(
        "<svg id=\"hour\" role=\"img\" aria-label=\"payment events received, processed and failures per minute over the last hour\" \
         width=\"{W}\" height=\"{}\" viewBox=\"0 0 {W} {}\" xmlns=\"http://www.w3.org/2000/svg\">\
         <rect x=\"0\" y=\"0\" width=\"{W}\" height=\"{H}\" fill=\"#f6f7f9\"/>",
        H + 20,
        H + 20
    );
    for (i, (r, f)) in received.iter().zip(failed).enumerate() {
        let x = i as i64 * COL;
        if *r > 0 {
            svg.push_str(&format!(
                "<rect x=\"{x}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#b8bec8\"><title>received {r}</title></rect>",
                y(*r),
                COL - 2,
                H - y(*r)
            ));
        }
        if *f > 0 {
            svg.push_str(&format!(
                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#c0392b\"><title>failures {f}</title></rect>",
                x + COL / 3,
                y(*f),
                COL / 3,
                H - y(*f)
            ));
        }
    }
    let points: Vec<String> = processed
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{},{}", i as i64 * COL + COL / 2, y(*p)))
        .collect();
    svg.push_str(&format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#1f5fbf\" stroke-width=\"2\"/>",
        points.join(" ")
    ));
    let total = |a: &[i64; 60]| a.iter().sum::<i64>();
    svg.push_str(&format!(
        "<text x=\"4\" y=\"{}\" font-size=\"12\" fill=\"#333\">an hour ago</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#333\" text-anchor=\"end\">now · peak {top} a minute</text></svg>",
        H + 15,
        W - 4,
        H + 15
    ));
    format!(
        "{svg}<p id=\"hour-totals\">In the last hour: {} events received (grey), {} processed (blue), {} failures (red: failed job attempts and rejected events).</p>",
        total(received),
        total(processed),
        total(failed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chart draws a bar per minute with traffic, a failure bar where there were failures,
    /// and the processed line through every minute, scaled to the busiest one.
    #[test]
    fn the_hour_chart_draws_each_minute() {
        let mut received = [0i64; 60];
        let mut processed = [0i64; 60];
        let mut failed = [0i64; 60];
        received[58] = 100;
        processed[59] = 50;
        failed[30] = 3;
        let svg = chart_svg(&received, &processed, &failed);
        assert!(svg.contains("<title>received 100</title>"), "{svg}");
        assert!(svg.contains("<title>failures 3</title>"), "{svg}");
        assert_eq!(svg.matches("<title>received").count(), 1);
        assert!(svg.contains("peak 100 a minute"), "{svg}");
        assert!(svg.contains("100 events received"), "{svg}");
        assert!(!svg.contains("<script"), "{svg}");
    }
}
