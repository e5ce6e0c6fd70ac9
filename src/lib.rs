//! payfleet: the background job worker fleet behind a marketplace's payments.
//!
//! The job queue is its own crate, `payfleet-queue` (`crates/queue`): the queue, its schema and
//! migrations (their own table), the worker fleet, the apalis adapter. It knows nothing of
//! payments, and everything here may use it.
//!
//! Layout (one module per bounded context; the root only assembles). A module uses only
//! modules left of it in this chain (`tests/api/layout.rs` keeps it true):
//! `secret` -> `env`, `money`, `db`, `tls`, `traces`, `batches` -> `gateways` -> `telemetry` -> `messaging`, `catalogue` -> `auth` ->
//! `ledger`, `payment_status`, `recurring` -> `orders` -> `payments` -> `consistency` ->
//! `webhooks` -> `http` -> `config` -> `startup`. The binary (`src/main.rs`: `cli`, `demo`,
//! `bench`, `soak`, and `scratch`, the fleet of their own they run) sits on top and uses the library like any other program.
//! - `secret`     values that never print (secrets, URLs with passwords), and what they sign
//!   with: HMAC, keys derived per purpose, the Standard Webhooks secret
//! - `env`        where settings come from, reading and checking one variable (each context
//!   reads its own settings with it)
//! - `money`      [`money::Money`]: decimal plus currency
//! - `db`         the pool, the migrations (the queue's, then ours), which errors are about the
//!   row or a lost connection
//! - `tls`        the process's one TLS provider
//! - `batches`    requests that arrive while others are served, served together (one
//!   statement or one message for many callers)
//! - `traces`     spans over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the W3C
//!   trace context carried from a webhook to its job and through RabbitMQ's headers
//! - `gateways`   one folder per gateway (`gateways::stripe`, ...) holding all of it: its
//!   signature scheme, its events and status mappers (safe defaults), its API client, its
//!   settings; the rest reaches it through `gateways::EventFormat`, `gateways::SignatureCheck`
//!   and `gateways::PaymentGateway`
//! - `messaging`  the shared RabbitMQ connection, the RPCs (payment links, coins) and the
//!   order messages (outbox relay, routing by order type)
//! - `catalogue`  sellers, products, coupons
//! - `telemetry`  this process's histograms and counters (job runs, HTTP answers, webhook to
//!   effect, order messages, RPC calls), on `prometheus-client`, served by `/metrics` beside
//!   the database's gauges
//! - `auth`       who may call: the admin token (kept as a digest), API keys (kept as hashes,
//!   bound to a seller or not), the limiter on failed credentials per address
//! - `ledger`     double entry: sales, refunds, disputes, holding period, payouts, commission
//!   invoices, coins, and their recurring jobs
//! - `payment_status` the provider's truth derived from facts, shared by payments and orders
//! - `orders`     checkout (concurrent checkouts written together), pricing, expiry, paying
//!   with coins (`orders::coin_payment`): the business truth
//! - `payments`   event processing (facts, waiting and rejected events, replay; the plain first
//!   payments many to a transaction in `payments::batch`), payment links, refunds, the hosted
//!   gateways' deliveries (`payments::delivery`)
//! - `webhooks`   the verified [`webhooks::Webhook`] (each gateway's check, asked by name),
//!   the batching writer
//! - `consistency` the invariants checked by a recurring job, findings an operator lists
//! - `recurring`  schedules from jobs/recurring.toml, each period run once by the fleet
//! - `http`       the routes of each area, one extractor per kind of caller (`http::callers`),
//!   the one API error type, the server and its limits, health and metrics
//! - `config`     composes the settings each context reads itself (`<context>::Settings::
//!   from_env`) with the process's own (addresses, pools, tokens)
//! - `startup`    the one way to assemble a process (each context registers its job kinds
//!   with their workers; `startup::registry` lists those calls)

pub mod auth;
pub mod batches;
pub mod catalogue;
pub mod config;
pub mod consistency;
pub mod db;
pub mod env;
pub mod gateways;
pub mod http;
pub mod ledger;
pub mod messaging;
pub mod money;
pub mod orders;
pub mod payment_status;
pub mod payments;
pub mod recurring;
pub mod secret;
pub mod startup;
pub mod telemetry;
pub mod tls;
pub mod traces;
pub mod webhooks;
