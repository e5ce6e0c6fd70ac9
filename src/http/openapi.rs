//! The API's OpenAPI 3.1 description, generated from the handlers' own types and their
//! `#[utoipa::path]` attributes, served at `GET /openapi.json` (public: it describes, it holds
//! nothing) and committed as `docs/openapi.json` (`payfleet openapi` writes it; a test fails
//! when the committed file is not what this build describes).
//!
//! An error answer is `{"error": {"code", "message", "request_id"}}`. Each operation names the
//! codes of each of its error statuses in the status's description, in backticks; [`document`]
//! turns them into the schema's `enum` of `error.code`, so a validator checks the code too. The
//! answers every operation of a kind can give are added here once rather than on each handler:
//! 500 `internal` and 503 `unavailable` on all; 401, 403 and 429 on those that take a
//! credential; 400 `bad_request`, 408, 413, 415 and 422 `invalid_request` on those that read a
//! JSON body. The dashboard answers its errors as HTML pages.

use std::collections::BTreeSet;

use serde_json::{Value, json};
use utoipa::OpenApi;

use super::{admin, dashboard, health, ledger, metrics, orders, pay, webhooks};

/// The error shape, one for every endpoint (`ApiError`'s answer).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorBody {
    error: ErrorDetail,
}

#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorDetail {
    /// What went wrong, for programs: each operation lists the codes of each status.
    code: String,
    /// What went wrong, for people.
    message: String,
    /// The request's id (also the `x-request-id` header), under which the log has the rest.
    request_id: Option<String>,
}

/// A text enum (`payfleet_queue::text_enum!`) is a string of its values.
macro_rules! text_enum_schemas {
    ($($ty:ident),+ $(,)?) => {
        $(
            impl utoipa::PartialSchema for $ty {
                fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::schema::Type::String)
                        .enum_values(Some($ty::ALL.iter().map(|v| v.as_str())))
                        .into()
                }
            }

            impl utoipa::ToSchema for $ty {}
        )+
    };
}

/// A typed id is a UUID.
macro_rules! uuid_schemas {
    ($($ty:ident),+ $(,)?) => {
        $(
            impl utoipa::PartialSchema for $ty {
                fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::schema::Type::String)
                        .format(Some(utoipa::openapi::schema::SchemaFormat::Custom(
                            "uuid".into(),
                        )))
                        .into()
                }
            }

            impl utoipa::ToSchema for $ty {}
        )+
    };
}

use crate::auth::api_keys::ApiKeyId;
use crate::catalogue::{CouponId, Interval, PayoutFrequency, ProductId, ProductKind, SellerId};
use crate::gateways::GatewayName;
use crate::ledger::TransferKind;
use crate::ledger::payouts::PayoutState;
use crate::orders::OrderStatus;
use crate::orders::subscriptions::{SubscriptionId, SubscriptionStatus};
use crate::payment_status::PaymentOrderStatus;
use crate::payments::order_refunds::RefundState;

text_enum_schemas!(
    GatewayName,
    Interval,
    PayoutFrequency,
    ProductKind,
    TransferKind,
    PayoutState,
    OrderStatus,
    SubscriptionStatus,
    PaymentOrderStatus,
    RefundState,
);
uuid_schemas!(ApiKeyId, CouponId, ProductId, SellerId, SubscriptionId);

#[derive(OpenApi)]
#[openapi(
    info(
        title = "payfleet",
        description = "Marketplace payments: checkouts, orders, subscriptions, the sellers' money, \
            gateway webhooks and the operator's admin API. Amounts are decimal strings with their \
            currency beside them. README.md's Endpoints section and docs/security.md say who may \
            call what.",
    ),
    paths(
        webhooks::receive,
        orders::checkout,
        orders::order,
        orders::reopen,
        orders::pay_with_coins,
        orders::subscription,
        orders::cancel_subscription,
        ledger::balances,
        ledger::entries,
        ledger::seller_payouts,
        ledger::seller_invoices,
        ledger::invoice,
        ledger::invoice_page,
        ledger::wallets,
        admin::create_api_key,
        admin::list_api_keys,
        admin::revoke_api_key,
        admin::create_seller,
        admin::create_product,
        admin::create_coupon,
        admin::expire_order,
        admin::simulate_renewals,
        admin::unmatched,
        admin::refund_order,
        admin::order_refunds,
        admin::consistency_findings,
        admin::reconciliation_findings,
        admin::recurring_jobs,
        admin::workers,
        admin::recurring_runs,
        admin::pending_payouts,
        admin::payout_paid,
        admin::payout_failed,
        admin::grant_coins,
        pay::page,
        pay::decide,
        pay::razorpay_page,
        pay::paid_page,
        pay::paid_page_posted,
        pay::cancelled_page,
        dashboard::dashboard,
        dashboard::sign_in,
        dashboard::sign_out,
        dashboard::pages::jobs_page,
        dashboard::pages::job_page,
        dashboard::job_action,
        dashboard::queue_action,
        dashboard::pages::order_lookup,
        dashboard::pages::order_page,
        dashboard::pages::event_page,
        dashboard::replay_event,
        dashboard::pages::seller_page,
        dashboard::replay_all,
        health::healthz,
        health::readyz,
        metrics::metrics_text,
        description,
    ),
    components(schemas(ErrorBody)),
    modifiers(&Credentials),
    tags(
        (name = "webhooks", description = "Gateways deliver their signed events."),
        (name = "orders", description = "The marketplace backend: checkouts, orders, subscriptions."),
        (name = "money", description = "The sellers' balances, ledger, payouts and invoices; the buyers' coins."),
        (name = "admin", description = "The operator's API (the admin token)."),
        (name = "payment pages", description = "Buyers' browsers: the payment simulator's pages and the pages gateways send buyers back to."),
        (name = "dashboard", description = "The operator's dashboard (HTML, a session cookie made from the admin token)."),
        (name = "operations", description = "Probes, metrics and this description."),
    )
)]
struct ApiDoc;

/// The credentials, as security schemes.
struct Credentials;

impl utoipa::Modify for Credentials {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder};
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer = |what: &str| {
            utoipa::openapi::security::SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(what))
                    .build(),
            )
        };
        components.add_security_scheme(
            "api_key",
            bearer(
                "An API key (`pfk_...`, `POST /admin/api-keys`); the admin token may do what any \
                 key may. A key bound to a seller reads only that seller.",
            ),
        );
        components.add_security_scheme(
            "admin_token",
            bearer("The admin token, `PAYFLEET_ADMIN_TOKEN`."),
        );
        components.add_security_scheme(
            "metrics_token",
            bearer("The admin token or `PAYFLEET_METRICS_TOKEN`."),
        );
        components.add_security_scheme(
            "dashboard_session",
            utoipa::openapi::security::SecurityScheme::ApiKey(ApiKey::Cookie(
                ApiKeyValue::with_description(
                    "payfleet_session",
                    "The dashboard's session, made by `POST /admin/ui/session`.",
                ),
            )),
        );
    }
}

/// This API's description: `GET /openapi.json`.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "This description (OpenAPI 3.1).", body = Object)),
)]
async fn description(_caller: super::callers::Anyone) -> impl axum::response::IntoResponse {
    // Anyone may ask, as often as they like: the answer is built once per process.
    static SERVED: std::sync::LazyLock<axum::body::Bytes> =
        std::sync::LazyLock::new(|| serde_json::to_vec(&document()).unwrap_or_default().into());
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        SERVED.clone(),
    )
}

pub(super) fn routes() -> super::Routes {
    super::Routes::default().route("/openapi.json", axum::routing::get(description))
}

/// The description, as served and committed.
pub fn document() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_else(|_| json!({}));
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for item in paths.values_mut().filter_map(Value::as_object_mut) {
            for op in item.values_mut().filter_map(Value::as_object_mut) {
                complete(op);
            }
        }
    }
    doc
}

/// Adds an operation's common error answers, and each error answer's codes to its schema.
fn complete(op: &mut serde_json::Map<String, Value>) {
    let secured = op
        .get("security")
        .and_then(Value::as_array)
        .is_some_and(|s| !s.is_empty());
    let reads_json = op
        .get("requestBody")
        .and_then(|b| b.pointer("/content/application~1json"))
        .is_some();
    // The dashboard answers its errors as pages.
    let html = op
        .get("tags")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t == "dashboard"));
    let mut common: Vec<(&str, &str, &str)> = vec![
        (
            "500",
            "internal",
            "An internal error; the log has it, under the request id.",
        ),
        (
            "503",
            "unavailable",
            "A dependency (the database) is down: nothing was stored, try again (`Retry-After`).",
        ),
        (
            "503",
            "answer_timeout",
            "The request did not finish within the server's answer timeout (a lock or the database held it) and was stopped: ask again, with the same Idempotency-Key where the endpoint takes one.",
        ),
    ];
    if secured {
        common.extend([
            (
                "401",
                "unauthenticated",
                "No credential, or one that is not ours.",
            ),
            ("403", "forbidden", "A credential that may not do this."),
            (
                "429",
                "too_many_requests",
                "Too many failed credentials from this address (`Retry-After`).",
            ),
        ]);
    }
    if reads_json {
        common.extend([
            ("400", "bad_request", "A body that does not read as JSON."),
            ("408", "request_timeout", "The body did not arrive in time."),
            (
                "413",
                "payload_too_large",
                "A body larger than this endpoint takes.",
            ),
            (
                "415",
                "unsupported_media_type",
                "A body not sent as `application/json`.",
            ),
            ("422", "invalid_request", "JSON of the wrong shape."),
        ]);
    }
    let responses = op
        .entry("responses")
        .or_insert_with(|| json!({}))
        .as_object_mut();
    let Some(responses) = responses else { return };
    for (status, code, description) in common {
        let said = format!("`{code}`: {description}");
        let response = responses
            .entry(status)
            .or_insert_with(|| json!({ "description": said }));
        if let Some(d) = response.get_mut("description")
            && let Some(text) = d.as_str()
            && !text.contains(&format!("`{code}`"))
        {
            *d = Value::String(format!("{text} {said}"));
        }
    }
    for (status, response) in responses.iter_mut() {
        if !status.starts_with('4') && !status.starts_with('5') {
            continue;
        }
        if html {
            response["content"] = json!({ "text/html": { "schema": { "type": "string" } } });
            continue;
        }
        // An answer of its own shape (`/readyz`'s checks, a page) keeps it.
        let own = response.get("content").is_some()
            && response.pointer("/content/application~1json/schema/$ref")
                != Some(&json!("#/components/schemas/ErrorBody"));
        if own {
            continue;
        }
        let codes = codes_in(response["description"].as_str().unwrap_or_default());
        response["content"] = json!({
            "application/json": {
                "schema": {
                    "allOf": [{ "$ref": "#/components/schemas/ErrorBody" }],
                    "properties": { "error": { "properties": { "code": { "enum": codes } } } },
                }
            }
        });
    }
}

/// The error codes a description names: its words in backticks that are codes (lower case
/// letters and underscores).
fn codes_in(description: &str) -> Vec<String> {
    description
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .map(str::to_owned)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_backticked_words() {
        assert_eq!(
            codes_in("`order_not_payable`: paid already; `Retry-After` `renewal_not_reopenable`"),
            vec!["order_not_payable", "renewal_not_reopenable"]
        );
    }

    #[test]
    fn every_error_answer_lists_its_codes() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, response) in op["responses"].as_object().unwrap() {
                    let json = response["content"].get("application/json").is_some();
                    if (status.starts_with('4') || status.starts_with('5'))
                        && json
                        && path != "/readyz"
                    {
                        let codes = &response["content"]["application/json"]["schema"]["properties"]
                            ["error"]["properties"]["code"]["enum"];
                        assert!(
                            !codes.as_array().unwrap().is_empty(),
                            "{method} {path} {status} names no code"
                        );
                    }
                }
            }
        }
    }
}
