//! payfleet: the background job worker fleet behind a marketplace's payments.
//!
//! Layout (one module per bounded context; the root only assembles). Arrows point one way:
//! `secret`, `money`, `db`, `tls` -> `gateways` -> `queue`, `messaging`, `catalogue` -> `auth` ->
//! `ledger`, `payment_status`, `recurring` -> `orders` -> `payments` -> `webhooks` -> `http` ->
//! `config`, `startup` -> `cli`, `demo`, `bench`.
//! - `secret`     values that never print (secrets, URLs with passwords)
//! - `money`      [`money::Money`]: decimal plus currency
//! - `db`         the pool, migrations, which errors are outages, enums stored as text
//! - `tls`        the process's one TLS provider
//! - `gateways`   each gateway's events and status mappers (safe defaults), the API clients
//! - `queue`      the PostgreSQL job queue and the worker fleet (executor, completer, leases,
//!   listener, maintenance; its SQL in `queue::store`)
//! - `messaging`  the shared RabbitMQ connection, the RPCs (payment links, coins) and the
//!   order messages (outbox relay, routing by order type)
//! - `catalogue`  sellers, products, coupons
//! - `auth`       who may call: the admin token (kept as a digest), API keys (kept as hashes,
//!   bound to a seller or not), the limiter on failed credentials per address
//! - `ledger`     double entry: sales, refunds, disputes, holding period, payouts, commission
//!   invoices, coins, and their recurring jobs
//! - `payment_status` the provider's truth derived from facts, shared by payments and orders
//! - `orders`     checkout (concurrent checkouts written together), pricing, expiry, paying
//!   with coins: the business truth
//! - `payments`   event processing (facts, waiting and rejected events, replay; the plain first
//!   payments many to a transaction in `payments::batch`), payment links, refunds
//! - `webhooks`   signature schemes, the verified [`webhooks::Webhook`], the batching writer
//! - `consistency` the invariants checked by a recurring job, findings an operator lists
//! - `recurring`  schedules from jobs/recurring.toml, each period run once by the fleet
//! - `http`       the routes of each area, one extractor per kind of caller (`http::callers`),
//!   the one API error type, the server and its limits, health and metrics
//! - `config`, `startup`, `cli`: environment, the one way to assemble a process, subcommands;
//!   `demo`: drives a running fleet; `bench`: the benchmarks

pub mod auth;
pub mod bench;
pub mod catalogue;
pub mod cli;
pub mod config;
pub mod consistency;
pub mod db;
pub mod demo;
pub mod gateways;
pub mod http;
pub mod ledger;
pub mod messaging;
pub mod money;
pub mod orders;
pub mod payment_status;
pub mod payments;
pub mod queue;
pub mod recurring;
pub mod secret;
pub mod startup;
pub mod tls;
pub mod webhooks;
