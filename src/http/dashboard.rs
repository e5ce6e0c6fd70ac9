//! The operator dashboard (`/admin/ui`), served by the receiver: queues, failed jobs with retry
//! and discard, unprocessed events with replay, recurring jobs with their last and next run,
//! past-due subscriptions, consistency findings; a page per job, order, seller and payment
//! event, and jobs filtered and paged (`pages`). Plain server-rendered pages and forms; no script.
//!
//! Signing in takes the admin token once and gives a session cookie: `HttpOnly` (no script
//! reads it), `SameSite=Strict` (no other site's page sends it), `Secure` when the public URL is
//! https, for 8 hours. The cookie is an expiry and a nonce signed (HMAC-SHA256) with a key derived
//! from the admin token by HKDF, so changing the token signs every session out and the cookie
//! never carries anything the token could be worked back from. Signing out keeps the session's
//! nonce until it would have expired (`dashboard_sessions_signed_out`): a copy of the cookie is
//! then no session either. Every form carries a
//! CSRF token derived from the session's nonce, checked before anything changes: a forged post
//! needs both the cookie and the token. Failed sign-ins count against the address like any wrong
//! credential (`callers`): after ten in 15 minutes it gets 429.

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::header::{COOKIE, LOCATION, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::callers::Anyone;
use super::html::{self, escape};
use super::{ApiError, Routes};
use crate::auth::Token;
use crate::payments::events::{self, Replayed};
use crate::secret::hmac_sha256;
use payfleet_queue::JobId;
use payfleet_queue::admin as jobs;

pub(super) mod pages;

/// What the dashboard: the pool, who may sign in, where buyers reach us, the schedules, and whether its cookie is `Secure`.
#[derive(Clone)]
pub struct DashboardState {
    pub pool: sqlx::PgPool,
    pub callers: super::Callers,
    pub public_url: String,
    pub recurring: crate::recurring::Schedules,
    pub secure_cookies: bool,
}

const COOKIE_NAME: &str = "payfleet_session";
const SESSION_SECS: i64 = 8 * 3600;
/// Rows shown per table; the CLI lists the rest.
const ROWS: i64 = 50;

pub(super) fn routes(state: DashboardState) -> Routes {
    Routes::default()
        .route("/admin/ui", get(dashboard))
        // A sign-in form is a token; its body is read before anything else is checked.
        .route(
            "/admin/ui/session",
            post(sign_in).layer(axum::extract::DefaultBodyLimit::max(4096)),
        )
        .route("/admin/ui/sign-out", post(sign_out))
        .route("/admin/ui/jobs", get(pages::jobs_page))
        .route("/admin/ui/jobs/{id}", get(pages::job_page))
        .route("/admin/ui/jobs/{id}/{action}", post(job_action))
        .route("/admin/ui/queues/{queue}/{action}", post(queue_action))
        .route("/admin/ui/order", get(pages::order_lookup))
        .route("/admin/ui/orders/{number}", get(pages::order_page))
        .route("/admin/ui/events/{id}", get(pages::event_page))
        .route("/admin/ui/events/{id}/replay", post(replay_event))
        .route("/admin/ui/sellers/{id}", get(pages::seller_page))
        .route("/admin/ui/events/replay-all", post(replay_all))
        .with_state(state)
}

/// A signed-in operator's session: its nonce keys the CSRF token of its forms.
struct Session {
    nonce: String,
    /// When its cookie stops being a session (Unix seconds).
    expires: i64,
}

fn mac(token: &Token, message: &str) -> [u8; 32] {
    hmac_sha256(
        &token.derive_key("dashboard session"),
        &[message.as_bytes()],
    )
}

impl Session {
    fn start(token: &Token, now: DateTime<Utc>) -> (Self, String) {
        let nonce = format!("{:032x}", rand::random::<u128>());
        let expires = now.timestamp() + SESSION_SECS;
        let signature = hex::encode(mac(token, &format!("session|{expires}|{nonce}")));
        (
            Self {
                nonce: nonce.clone(),
                expires,
            },
            format!("{expires}.{nonce}.{signature}"),
        )
    }

    /// The session of a request's cookie, if it is ours, signed with the current token and not
    /// expired.
    fn from_headers(token: &Token, headers: &HeaderMap, now: DateTime<Utc>) -> Option<Self> {
        let value = headers
            .get_all(COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().strip_prefix(COOKIE_NAME)?.strip_prefix('='))
            .next()?;
        let mut parts = value.splitn(3, '.');
        let (expires, nonce, signature) = (parts.next()?, parts.next()?, parts.next()?);
        let signature = hex::decode(signature).ok()?;
        let want = mac(token, &format!("session|{expires}|{nonce}"));
        if !bool::from(want.as_slice().ct_eq(&signature)) {
            return None;
        }
        let expires = expires.parse::<i64>().ok()?;
        (expires > now.timestamp()).then(|| Self {
            nonce: nonce.to_owned(),
            expires,
        })
    }

    fn csrf(&self, token: &Token) -> String {
        hex::encode(mac(token, &format!("csrf|{}", self.nonce)))
    }

    /// The signature of a notice (its text in hex) for this session.
    fn notice_mac(&self, token: &Token, text: &str) -> [u8; 32] {
        mac(token, &format!("notice|{}|{text}", self.nonce))
    }

    fn check_csrf(&self, token: &Token, given: &str) -> bool {
        bool::from(self.csrf(token).as_bytes().ct_eq(given.as_bytes()))
    }
}

/// A page answer: the dashboard's pages and its errors are HTML, not JSON.
struct Page {
    status: StatusCode,
    title: &'static str,
    body: String,
    headers: Vec<(axum::http::HeaderName, HeaderValue)>,
}

impl Page {
    fn new(status: StatusCode, title: &'static str, body: String) -> Self {
        Self {
            status,
            title,
            body,
            headers: Vec::new(),
        }
    }

    /// After a change: back to the dashboard (post, redirect, get), with `notice` for it to
    /// show once ([`NOTICE_COOKIE`]).
    fn done(notice: &str) -> Self {
        let mut page = Self::new(StatusCode::SEE_OTHER, "Done", String::new());
        page.headers
            .push((LOCATION, HeaderValue::from_static("/admin/ui")));
        if let Ok(v) = HeaderValue::from_str(&format!(
            "{NOTICE_COOKIE}={notice}; Path=/admin/ui; Max-Age=60; HttpOnly; SameSite=Strict"
        )) {
            page.headers.push((SET_COOKIE, v));
        }
        page
    }
}

impl IntoResponse for Page {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Html(html::page(self.title, CSS, &self.body))).into_response();
        for (name, value) in self.headers {
            resp.headers_mut().append(name, value);
        }
        resp.headers_mut()
            .insert("cache-control", HeaderValue::from_static("no-store"));
        resp.headers_mut().insert(
            "content-security-policy",
            HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"),
        );
        resp
    }
}

impl From<ApiError> for Page {
    fn from(e: ApiError) -> Self {
        e.log();
        let (status, _) = e.status_and_code();
        let retry = if status == StatusCode::SERVICE_UNAVAILABLE {
            " Try again in a few seconds."
        } else {
            ""
        };
        let request = super::error::request_id()
            .map(|id| format!(" (request {})", escape(&id)))
            .unwrap_or_default();
        Page::new(
            status,
            "Not done",
            format!(
                "<p class=\"error\" role=\"alert\">{}{request}{retry}</p><p><a href=\"/admin/ui\">Back to the dashboard</a></p>",
                escape(&e.public_message())
            ),
        )
    }
}

impl From<sqlx::Error> for Page {
    fn from(e: sqlx::Error) -> Self {
        ApiError::from(e).into()
    }
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

const CSS: &str = "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1b1f24}\
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #ccd}\
table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #dde;padding:.25rem .5rem;text-align:left;vertical-align:top}\
th{background:#f3f4f7}td.n{text-align:right}form.inline{display:inline}\
.error{color:#a40000}.notice{background:#e8f5e9;padding:.5rem}.muted{color:#667}\
.bad{background:#fdecea}pre{white-space:pre-wrap;max-width:40rem;margin:0}";

fn token_of(state: &DashboardState) -> Result<&Token, Page> {
    state.callers.admin().ok_or_else(|| {
        Page::new(
            StatusCode::FORBIDDEN,
            "Dashboard off",
            "<p>The dashboard and the admin API are off: set PAYFLEET_ADMIN_TOKEN to turn them on.</p>"
                .into(),
        )
    })
}

fn sign_in_page(status: StatusCode, problem: Option<&str>) -> Page {
    let problem = problem
        .map(|p| format!("<p class=\"error\" role=\"alert\">{}</p>", escape(p)))
        .unwrap_or_default();
    Page::new(
        status,
        "payfleet: sign in",
        format!(
            "{problem}<form method=\"post\" action=\"/admin/ui/session\">\
             <label>Admin token <input type=\"password\" name=\"token\" autocomplete=\"current-password\" required></label> \
             <button type=\"submit\">Sign in</button></form>"
        ),
    )
}

#[derive(Deserialize)]
struct SignIn {
    token: String,
}

/// The address a request comes from, as the callers' limiter counts it.
struct Client(std::net::IpAddr);

impl FromRequestParts<DashboardState> for Client {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &DashboardState,
    ) -> Result<Self, Self::Rejection> {
        Ok(Client(state.callers.client(parts)))
    }
}

#[utoipa::path(
    post,
    path = "/admin/ui/session",
    tag = "dashboard",
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "`token`: the admin token. Only from the dashboard's own origin."),
    responses(
        (status = 303, description = "Signed in: the session cookie is set, on to the dashboard."),
        (status = 400, description = "No token sent.", content_type = "text/html", body = String),
        (status = 401, description = "A wrong token (counted against the address).", content_type = "text/html", body = String),
        (status = 403, description = "A form from another origin, or the dashboard is off.", content_type = "text/html", body = String),
        (status = 413, description = "A form too large.", content_type = "text/html", body = String),
        (status = 429, description = "Too many failed credentials from this address (`Retry-After`).", content_type = "text/html", body = String),
    ),
)]
async fn sign_in(
    _caller: Anyone,
    State(state): State<DashboardState>,
    Client(client): Client,
    headers: axum::http::HeaderMap,
    form: Result<Form<SignIn>, FormRejection>,
) -> Page {
    let token = match token_of(&state) {
        Ok(t) => t,
        Err(page) => return page,
    };
    // Another site's page posting wrong tokens from an operator's browser would lock the
    // operator's address out: such a form is refused, and counts as no guess.
    if !super::html::same_origin(&headers, &state.public_url) {
        return sign_in_page(
            StatusCode::FORBIDDEN,
            Some("this form was sent from another site: sign in from the dashboard's own page"),
        );
    }
    if let Err(e) = state.callers.gate(client) {
        let mut page = sign_in_page(StatusCode::TOO_MANY_REQUESTS, Some(&format!("{e}")));
        if let ApiError::TooManyRequests(left) = e {
            page.headers.push((
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(left.as_secs().max(1)),
            ));
        }
        return page;
    }
    let form = match form {
        Ok(Form(form)) => form,
        Err(FormRejection::BytesRejection(r)) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return sign_in_page(
                StatusCode::PAYLOAD_TOO_LARGE,
                Some("this form is too large"),
            );
        }
        Err(_) => return sign_in_page(StatusCode::BAD_REQUEST, Some("send the admin token")),
    };
    if !token.matches(form.token.trim()) {
        state.callers.failed(
            client,
            "POST /admin/ui/session",
            "wrong admin token at sign-in",
        );
        return sign_in_page(StatusCode::UNAUTHORIZED, Some("wrong admin token"));
    }
    let (_, cookie) = Session::start(token, Utc::now());
    let secure = if state.secure_cookies { "; Secure" } else { "" };
    let mut page = Page::new(StatusCode::SEE_OTHER, "Signed in", String::new());
    page.headers
        .push((LOCATION, HeaderValue::from_static("/admin/ui")));
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{COOKIE_NAME}={cookie}; Path=/admin/ui; Max-Age={SESSION_SECS}; HttpOnly; SameSite=Strict{secure}"
    )) {
        page.headers.push((SET_COOKIE, v));
    }
    page
}

#[derive(Deserialize)]
struct Csrf {
    csrf: String,
}

/// A signed-in operator: the dashboard's caller for everything but the sign-in. 401 (the
/// sign-in page) without a session.
struct OperatorSession {
    session: Session,
    token: Token,
}

impl FromRequestParts<DashboardState> for OperatorSession {
    type Rejection = Page;

    async fn from_request_parts(parts: &mut Parts, state: &DashboardState) -> Result<Self, Page> {
        let token = token_of(state)?.clone();
        let ended = || {
            sign_in_page(
                StatusCode::UNAUTHORIZED,
                Some("sign in first (your session ended, or this form came from elsewhere)"),
            )
        };
        let session = live_session(state, &token, &parts.headers)
            .await?
            .ok_or_else(ended)?;
        Ok(Self { session, token })
    }
}

/// The session of a request's cookie, if it is one ([`Session::from_headers`]) and was not signed
/// out.
async fn live_session(
    state: &DashboardState,
    token: &Token,
    headers: &HeaderMap,
) -> Result<Option<Session>, Page> {
    let Some(session) = Session::from_headers(token, headers, Utc::now()) else {
        return Ok(None);
    };
    let signed_out: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM dashboard_sessions_signed_out WHERE nonce = $1)",
    )
    .bind(&session.nonce)
    .fetch_one(&state.pool)
    .await?;
    Ok((!signed_out).then_some(session))
}

impl OperatorSession {
    /// After a change: back to the dashboard, which says `what` was done. The notice is signed
    /// for this session, as its CSRF token is: a cookie planted by anyone else (a sibling
    /// subdomain's, one set over plain http) is no notice ([`notice`]).
    fn done(&self, what: &str) -> Page {
        let text = hex::encode(what);
        Page::done(&format!(
            "{text}.{}",
            hex::encode(self.session.notice_mac(&self.token, &text))
        ))
    }

    /// The CSRF token its pages' forms carry.
    fn csrf(&self) -> String {
        self.session.csrf(&self.token)
    }

    /// A form post's CSRF token: nothing changes without it.
    fn check(&self, form: Option<&Csrf>) -> Result<(), Page> {
        match form {
            Some(f) if self.session.check_csrf(&self.token, &f.csrf) => Ok(()),
            _ => Err(Page::new(
                StatusCode::FORBIDDEN,
                "Not done",
                "<p class=\"error\" role=\"alert\">This form is not one the dashboard gave you (its CSRF token is missing or wrong): nothing was changed.</p>\
                 <p><a href=\"/admin/ui\">Back to the dashboard</a></p>"
                    .into(),
            )),
        }
    }
}

#[utoipa::path(
    post,
    path = "/admin/ui/sign-out",
    tag = "dashboard",
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "The form: its `csrf` token."),
    responses(
        (status = 200, description = "Signed out: the sign-in page, the cookie cleared.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
async fn sign_out(
    State(state): State<DashboardState>,
    operator: OperatorSession,
    form: Result<Form<Csrf>, FormRejection>,
) -> Page {
    if let Err(page) = operator.check(form.as_deref().ok()) {
        return page;
    }
    // Kept until the session would have ended anyway; those whose time has passed go.
    let ended = async {
        let mut tx = state.pool.begin().await?;
        sqlx::query("DELETE FROM dashboard_sessions_signed_out WHERE expires_at < now()")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO dashboard_sessions_signed_out (nonce, expires_at)
             VALUES ($1, to_timestamp($2)) ON CONFLICT (nonce) DO NOTHING",
        )
        .bind(&operator.session.nonce)
        .bind(operator.session.expires as f64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }
    .await;
    if let Err(e) = ended {
        return ApiError::from(e).into();
    }
    let mut page = sign_in_page(StatusCode::OK, None);
    page.headers.push((
        SET_COOKIE,
        HeaderValue::from_static(
            "payfleet_session=; Path=/admin/ui; Max-Age=0; HttpOnly; SameSite=Strict",
        ),
    ));
    page
}

fn id_of(raw: &str) -> Result<i64, Page> {
    raw.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiError::bad_request(format!("{raw:?} is not an id")).into())
}

/// What an operator can do to a job from the dashboard.
#[derive(Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum JobAction {
    /// A dead or retrying job runs again now.
    Retry,
    /// A waiting job is given up (kept, and can be retried).
    Discard,
    /// A waiting job (scheduled for later, or retrying) runs now.
    Run,
}

#[utoipa::path(
    post,
    path = "/admin/ui/jobs/{id}/{action}",
    tag = "dashboard",
    params(
        ("id" = i64, Path, description = "The job's id."),
        ("action" = String, Path, description = "`retry`, `discard` or `run`."),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "The form: its `csrf` token."),
    responses(
        (status = 303, description = "Done: back to the dashboard, saying what."),
        (status = 404, description = "No such job or action.", content_type = "text/html", body = String),
        (status = 409, description = "The job is not in a state the action takes.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
async fn job_action(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    path: Result<Path<(String, JobAction)>, axum::extract::rejection::PathRejection>,
    form: Result<Form<Csrf>, FormRejection>,
) -> Result<Page, Page> {
    operator.check(form.as_deref().ok())?;
    let Path((raw, action)) = path.map_err(|_| {
        Page::from(ApiError::NotFound(
            "no such job action: retry, discard or run".into(),
        ))
    })?;
    let id = id_of(&raw)?;
    let done = match action {
        JobAction::Retry => {
            jobs::retry(&state.pool, JobId(id))
                .await
                .map_err(ApiError::from)?;
            format!("job {id} will run again now")
        }
        JobAction::Discard => {
            jobs::discard(&state.pool, JobId(id))
                .await
                .map_err(ApiError::from)?;
            format!("job {id} is discarded (kept, and can be retried)")
        }
        JobAction::Run => {
            jobs::run_now(&state.pool, JobId(id))
                .await
                .map_err(ApiError::from)?;
            format!("job {id} is due now")
        }
    };
    tracing::info!(job = id, "{done} (from the dashboard)");
    Ok(operator.done(&done))
}

/// Pausing and resuming a queue from the dashboard.
#[derive(Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum QueueAction {
    /// No worker claims from it within a second; runs under way end as usual.
    Pause,
    Resume,
}

#[utoipa::path(
    post,
    path = "/admin/ui/queues/{queue}/{action}",
    tag = "dashboard",
    params(
        ("queue" = String, Path, description = "The queue."),
        ("action" = String, Path, description = "`pause` or `resume`."),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "The form: its `csrf` token."),
    responses(
        (status = 303, description = "Done: the fleet honours it within a second."),
        (status = 404, description = "No such queue or action.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
async fn queue_action(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    path: Result<Path<(String, QueueAction)>, axum::extract::rejection::PathRejection>,
    form: Result<Form<Csrf>, FormRejection>,
) -> Result<Page, Page> {
    operator.check(form.as_deref().ok())?;
    let Path((queue, action)) = path.map_err(|_| {
        Page::from(ApiError::NotFound(
            "no such queue action: pause or resume".into(),
        ))
    })?;
    if queue.is_empty()
        || queue.len() > 100
        || !queue
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(ApiError::bad_request(format!("{queue:?} is not a queue name")).into());
    }
    let done = match action {
        QueueAction::Pause => {
            jobs::pause(&state.pool, &queue).await?;
            format!("queue {queue} is paused: no worker claims from it within a second")
        }
        QueueAction::Resume => {
            jobs::resume(&state.pool, &queue).await?;
            format!("queue {queue} is resumed")
        }
    };
    tracing::info!(%queue, "{done} (from the dashboard)");
    Ok(operator.done(&done))
}

#[utoipa::path(
    post,
    path = "/admin/ui/events/{id}/replay",
    tag = "dashboard",
    params(
        ("id" = i64, Path, description = "The payment event's id."),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "The form: its `csrf` token."),
    responses(
        (status = 303, description = "Done: the event is queued for processing again."),
        (status = 404, description = "No such event.", content_type = "text/html", body = String),
        (status = 409, description = "The event was processed.", content_type = "text/html", body = String),
    ),
    security(("dashboard_session" = [])),
)]
async fn replay_event(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    Path(raw): Path<String>,
    form: Result<Form<Csrf>, FormRejection>,
) -> Result<Page, Page> {
    operator.check(form.as_deref().ok())?;
    let id = id_of(&raw)?;
    let replayed = events::replay(&state.pool, id)
        .await
        .map_err(ApiError::from)?;
    tracing::info!(event = id, "event replayed from the dashboard");
    Ok(operator.done(&match replayed {
        Replayed::Queued => format!("event {id} is queued for processing"),
        Replayed::AlreadyQueued => format!("event {id} already has a waiting job"),
    }))
}

#[utoipa::path(
    post,
    path = "/admin/ui/events/replay-all",
    tag = "dashboard",
    request_body(content = String, content_type = "application/x-www-form-urlencoded", description = "The form: its `csrf` token."),
    responses(
        (status = 303, description = "Done: every rejected event is queued again."),
    ),
    security(("dashboard_session" = [])),
)]
async fn replay_all(
    operator: OperatorSession,
    State(state): State<DashboardState>,
    form: Result<Form<Csrf>, FormRejection>,
) -> Result<Page, Page> {
    operator.check(form.as_deref().ok())?;
    let queued = events::replay_all(&state.pool)
        .await
        .map_err(ApiError::from)?;
    tracing::info!(
        queued,
        "every unprocessed event replayed from the dashboard"
    );
    Ok(operator.done(&format!("{queued} events queued for processing")))
}

/// The cookie that carries an action's notice ("job 42 retried") through its redirect to the
/// dashboard, which shows it once and clears it. It was a `?done=` query: a link anyone could
/// make showed words of its sender's choosing on the operator's dashboard, under "Done:" (a
/// token rotated, a page to sign in again at). A link cannot set a cookie of ours; one set by
/// a sibling subdomain or over plain http carries no signature of the session's.
const NOTICE_COOKIE: &str = "payfleet_notice";

/// The notice an action of `session` left for the dashboard ([`NOTICE_COOKIE`]), if one reads
/// as such and is signed for it.
fn notice(headers: &HeaderMap, session: &Session, token: &Token) -> Option<String> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(NOTICE_COOKIE)?.strip_prefix('='))
        .find_map(|value| {
            let (text, signature) = value.split_once('.')?;
            let signature = hex::decode(signature).ok()?;
            let want = session.notice_mac(token, text);
            if !bool::from(want.as_slice().ct_eq(&signature)) {
                return None;
            }
            String::from_utf8(hex::decode(text).ok()?).ok()
        })
        .filter(|n| !n.is_empty() && n.len() <= 200)
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "<span class=\"muted\">none</span>".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
    )
}

fn button(action: &str, csrf: &str, label: &str) -> String {
    format!(
        "<form class=\"inline\" method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
         <button type=\"submit\">{}</button></form>",
        escape(action),
        escape(label)
    )
}

fn table(id: &str, headers: &[&str], rows: Vec<String>, empty: &str) -> String {
    if rows.is_empty() {
        return format!("<p id=\"{id}\" class=\"muted\">{}</p>", escape(empty));
    }
    let head: String = headers
        .iter()
        .map(|h| format!("<th>{}</th>", escape(h)))
        .collect();
    format!(
        "<table id=\"{id}\"><thead><tr>{head}</tr></thead><tbody>{}</tbody></table>",
        rows.concat()
    )
}

/// Anyone gets the sign-in form; a signed-in operator the dashboard.
#[utoipa::path(
    get,
    path = "/admin/ui",
    tag = "dashboard",
    responses(
        (status = 200, description = "The dashboard, or its sign-in page.", content_type = "text/html", body = String),
        (status = 403, description = "The dashboard is off (no admin token).", content_type = "text/html", body = String),
    ),
)]
async fn dashboard(
    _caller: Anyone,
    State(state): State<DashboardState>,
    headers: HeaderMap,
) -> Result<Page, Page> {
    let token = token_of(&state)?;
    let Some(session) = live_session(&state, token, &headers).await? else {
        return Ok(sign_in_page(StatusCode::OK, None));
    };
    let csrf = session.csrf(token);
    let pool = &state.pool;
    let mut body = String::new();
    body.push_str(&format!(
        "<p>{} {} · <a href=\"/admin/ui/jobs\">All jobs</a></p>\
         <form id=\"order-lookup\" method=\"get\" action=\"/admin/ui/order\">\
         <label>Order number <input name=\"number\" inputmode=\"numeric\"></label> \
         <button type=\"submit\">Open</button></form>",
        button("/admin/ui/sign-out", &csrf, "Sign out"),
        "<a href=\"/admin/ui\">Refresh</a>"
    ));
    let shown = notice(&headers, &session, token);
    if let Some(done) = &shown {
        body.push_str(&format!(
            "<p class=\"notice\" role=\"status\">Done: {}</p>",
            escape(done)
        ));
    }

    // The last hour, a minute a column.
    body.push_str("<h2>The last hour</h2>");
    body.push_str(&pages::hour_chart(pool).await?);

    // Queues: live counts and backlog age.
    let counts = jobs::live_counts(pool).await?;
    let due = jobs::due_by_queue(pool).await?;
    let paused = jobs::paused(pool).await?;
    let mut queues: Vec<&str> = counts
        .iter()
        .map(|c| c.queue.as_str())
        .chain(due.iter().map(|d| d.queue.as_str()))
        .chain(paused.iter().map(|(q, _)| q.as_str()))
        .collect();
    queues.sort_unstable();
    queues.dedup();
    let rows = queues
        .iter()
        .map(|q| {
            let n = |state: &str| {
                counts
                    .iter()
                    .find(|c| c.queue == *q && c.state.as_str() == state)
                    .map_or(0, |c| c.count)
            };
            let d = due.iter().find(|d| d.queue == *q);
            let pause = match paused.iter().find(|(p, _)| p == q) {
                Some((_, since)) => format!(
                    "paused since {} {}",
                    time(Some(*since)),
                    button(&format!("/admin/ui/queues/{q}/resume"), &csrf, "Resume")
                ),
                None => button(&format!("/admin/ui/queues/{q}/pause"), &csrf, "Pause"),
            };
            format!(
                "<tr id=\"queue-{}\"><td><a href=\"/admin/ui/jobs?queue={}\">{}</a></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{:.1} s</td><td>{pause}</td></tr>",
                escape(q),
                escape(q),
                escape(q),
                d.map_or(0, |d| d.due),
                n("available"),
                n("retryable"),
                n("running"),
                n("discarded"),
                d.map_or(0.0, |d| d.oldest_due_secs),
            )
        })
        .collect();
    let outbox = crate::orders::outbox::backlog(pool).await?;
    body.push_str("<h2>Queues</h2>");
    body.push_str(&table(
        "queues",
        &[
            "queue",
            "due now",
            "available (incl. scheduled)",
            "retrying",
            "running",
            "dead",
            "oldest due waits",
            "",
        ],
        rows,
        "No jobs waiting, running or dead.",
    ));
    body.push_str(&format!(
        "<p>Order messages not yet confirmed by the broker: {} (oldest {:.1} s; refused by the broker and waiting for their next attempt: {}, <code>payfleet messages unpublished</code>).</p>",
        outbox.unpublished, outbox.oldest_secs, outbox.refused
    ));

    // Failed jobs.
    let failed = jobs::failed(pool, ROWS).await?;
    let rows = failed
        .iter()
        .map(|j| {
            let actions = if j.state.as_str() == "retryable" {
                format!(
                    "{} {}",
                    button(&format!("/admin/ui/jobs/{}/retry", j.id), &csrf, "Retry now"),
                    button(&format!("/admin/ui/jobs/{}/discard", j.id), &csrf, "Discard")
                )
            } else {
                button(&format!("/admin/ui/jobs/{}/retry", j.id), &csrf, "Retry")
            };
            format!(
                "<tr id=\"job-{id}\"><td><a href=\"/admin/ui/jobs/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}/{}</td><td>{}</td><td><pre>{}</pre></td><td>{actions}</td></tr>",
                escape(&j.queue),
                escape(&j.kind),
                escape(j.key.as_deref().unwrap_or("")),
                if j.state.as_str() == "retryable" { "retrying" } else { "dead" },
                j.attempt,
                j.max_attempts,
                time(j.at),
                escape(j.last_error.as_deref().unwrap_or("")),
                id = j.id,
            )
        })
        .collect();
    body.push_str("<h2>Failed jobs</h2><p class=\"muted\">Retrying: failed and will run again at the time shown (retry now, or discard to give up; a discarded job is kept). Dead: used its attempts or was discarded (retry gives it one more).</p>");
    body.push_str(&table(
        "failed-jobs",
        &[
            "id",
            "queue",
            "kind",
            "key",
            "state",
            "attempt",
            "runs again at / dead since",
            "last error",
            "",
        ],
        rows,
        "No failed jobs.",
    ));

    // Unprocessed events.
    let unprocessed = events::unprocessed(pool, ROWS).await?;
    let rows = unprocessed
        .iter()
        .map(|e| {
            format!(
                "<tr id=\"event-{id}\"><td><a href=\"/admin/ui/events/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                e.gateway,
                escape(&e.event_id),
                escape(e.event_type.as_deref().unwrap_or("")),
                time(Some(e.received_at)),
                e.state(),
                escape(e.detail.as_deref().unwrap_or("")),
                e.job.map_or("none (replay it)", |s| s.as_str()),
                button(&format!("/admin/ui/events/{}/replay", e.id), &csrf, "Replay"),
                id = e.id,
            )
        })
        .collect();
    body.push_str("<h2>Unprocessed events</h2><p class=\"muted\">Pending: no outcome yet. Waiting: for the payment it refers to. Rejected: cannot apply as it stands (fix, then replay).</p>");
    if !unprocessed.is_empty() {
        body.push_str(&format!(
            "<p>{}</p>",
            button(
                "/admin/ui/events/replay-all",
                &csrf,
                "Replay every event without a job"
            )
        ));
    }
    body.push_str(&table(
        "events",
        &[
            "id", "gateway", "event id", "type", "received", "state", "why", "job", "",
        ],
        rows,
        "Every stored event is processed.",
    ));

    // Recurring jobs.
    let recurring = crate::recurring::overview(pool, &state.recurring, Utc::now()).await?;
    let rows = recurring
        .iter()
        .map(|r| {
            let bad = matches!(r.last_state.as_deref(), Some("failed"));
            format!(
                "<tr{}><td>{}</td><td><code>{}</code> {}</td><td>{}</td><td>{} {}</td><td>{}</td></tr>",
                if bad { " class=\"bad\"" } else { "" },
                escape(&r.name),
                escape(&r.cron),
                escape(&r.timezone),
                if r.enabled { "yes" } else { "no" },
                time(r.last_period),
                escape(r.last_state.as_deref().unwrap_or("")),
                time(r.next_period),
            )
        })
        .collect();
    body.push_str("<h2>Recurring jobs</h2>");
    body.push_str(&table(
        "recurring",
        &["name", "schedule", "enabled", "last run", "next run"],
        rows,
        "No recurring jobs are scheduled (PAYFLEET_RECURRING=off).",
    ));

    // Past-due subscriptions.
    let past_due = crate::orders::subscriptions::past_due(pool, ROWS).await?;
    let rows = past_due
        .iter()
        .map(|s| {
            format!(
                "<tr class=\"bad\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} {}</td><td>{} to {}</td></tr>",
                s.id,
                s.order_number,
                s.seller_id,
                s.gateway,
                escape(&s.amount),
                escape(&s.currency),
                time(Some(s.current_period_start)),
                time(Some(s.current_period_end)),
            )
        })
        .collect();
    body.push_str("<h2>Past-due subscriptions</h2><p class=\"muted\">Their current renewal failed: retried by the billing run, canceled after its last attempt.</p>");
    body.push_str(&table(
        "past-due",
        &[
            "subscription",
            "first order",
            "seller",
            "gateway",
            "renewal",
            "period",
        ],
        rows,
        "No subscription is past due.",
    ));

    // Consistency findings.
    let findings = crate::consistency::open(pool, ROWS).await?;
    let rows = findings
        .iter()
        .map(|f| {
            format!(
                "<tr class=\"bad\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&f.check_name),
                escape(&f.subject),
                escape(&f.detail),
                time(Some(f.first_seen)),
                time(Some(f.last_seen)),
            )
        })
        .collect();
    body.push_str("<h2>Consistency findings</h2>");
    body.push_str(&table(
        "findings",
        &["check", "subject", "detail", "first seen", "last seen"],
        rows,
        "No open findings: every invariant held at the last check.",
    ));
    let mut page = Page::new(StatusCode::OK, "payfleet operations", body);
    if shown.is_some() {
        // Shown once.
        page.headers.push((
            SET_COOKIE,
            HeaderValue::from_static(
                "payfleet_notice=; Path=/admin/ui; Max-Age=0; HttpOnly; SameSite=Strict",
            ),
        ));
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(cookie: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(COOKIE, HeaderValue::from_str(cookie).unwrap());
        h
    }

    #[test]
    fn a_session_holds_only_with_its_own_signature_token_and_time() {
        let token = Token::parse("admin-token-0123456789-0123456789").unwrap();
        let now = Utc::now();
        let (session, cookie) = Session::start(&token, now);
        let ok = Session::from_headers(
            &token,
            &headers(&format!("a=b; {COOKIE_NAME}={cookie}")),
            now,
        )
        .unwrap();
        assert_eq!(ok.nonce, session.nonce);
        assert!(ok.check_csrf(&token, &session.csrf(&token)));
        assert!(!ok.check_csrf(&token, ""));
        // Another token (rotated), a changed expiry, an expired session: none holds.
        let other = Token::parse("admin-token-9876543210-9876543210").unwrap();
        assert!(
            Session::from_headers(&other, &headers(&format!("{COOKIE_NAME}={cookie}")), now)
                .is_none()
        );
        let (expires, rest) = cookie.split_once('.').unwrap();
        let later: i64 = expires.parse::<i64>().unwrap() + 3600;
        assert!(
            Session::from_headers(
                &token,
                &headers(&format!("{COOKIE_NAME}={later}.{rest}")),
                now
            )
            .is_none()
        );
        let after = now + chrono::Duration::seconds(SESSION_SECS + 1);
        assert!(
            Session::from_headers(&token, &headers(&format!("{COOKIE_NAME}={cookie}")), after)
                .is_none()
        );
        assert!(Session::from_headers(&token, &headers("payfleet_session=garbage"), now).is_none());
    }
}
