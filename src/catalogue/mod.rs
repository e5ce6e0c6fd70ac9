//! The catalogue: sellers (stores), their products and coupons, created through the admin API.
//! Input is parsed into these types or refused with the field that is wrong; the database's
//! constraints are the last word (their names map to errors below).

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use crate::money::{Currency, Money, MoneyError};

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub Uuid);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }

        impl std::str::FromStr for $name {
            type Err = CatalogueError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s.trim())
                    .map($name)
                    .map_err(|_| CatalogueError::Invalid {
                        field: $what,
                        problem: format!("{s:?} is not an id"),
                    })
            }
        }
    };
}

id_type!(
    /// A seller (a store).
    SellerId,
    "seller_id"
);
id_type!(ProductId, "product_id");
id_type!(CouponId, "coupon_id");

payfleet_queue::text_enum! {
    pub enum PayoutFrequency {
        Daily = "daily",
        Weekly = "weekly",
        Monthly = "monthly",
    }
}

payfleet_queue::text_enum! {
    /// One-off products and subscriptions are never in the same order.
    pub enum ProductKind {
        OneOff = "one_off",
        Subscription = "subscription",
    }
}

payfleet_queue::text_enum! {
    pub enum Interval {
        Day = "day",
        Week = "week",
        Month = "month",
        Year = "year",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    #[error("{field}: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
    #[error("no seller {0}")]
    UnknownSeller(String),
    #[error("no product {0}")]
    UnknownProduct(String),
    #[error("coupon code {0} is taken")]
    CodeTaken(String),
    #[error(transparent)]
    Database(sqlx::Error),
}

fn invalid(field: &'static str, problem: impl Into<String>) -> CatalogueError {
    CatalogueError::Invalid {
        field,
        problem: problem.into(),
    }
}

impl From<sqlx::Error> for CatalogueError {
    /// A foreign key or unique constraint names what was wrong with the input.
    fn from(e: sqlx::Error) -> Self {
        match crate::db::constraint(&e) {
            Some("products_seller_id_fkey" | "coupons_seller_id_fkey") => {
                Self::UnknownSeller("named in the request".into())
            }
            Some("coupons_product_id_fkey") => Self::UnknownProduct("named in the request".into()),
            Some("coupons_code_key") => Self::CodeTaken("in the request".into()),
            _ => Self::Database(e),
        }
    }
}

fn money_field(field: &'static str, amount: &str, currency: &str) -> Result<Money, CatalogueError> {
    Money::parse(amount, currency).map_err(|e| match e {
        MoneyError::Currency(_) => invalid("currency", e.to_string()),
        other => invalid(field, other.to_string()),
    })
}

fn name_field(field: &'static str, name: &str) -> Result<String, CatalogueError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err(invalid(field, "must be 1 to 200 characters"));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid(field, "must not contain control characters"));
    }
    Ok(name.to_owned())
}

// ---- sellers -------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewSeller {
    pub name: String,
    pub payout_frequency: PayoutFrequency,
    /// A decimal string ("50.00").
    pub payout_minimum: String,
    pub holding_days: Option<i32>,
    pub stripe_account: Option<String>,
    /// A minimum per currency (`{"BRL": "50.00", "JPY": "5000"}`); `payout_minimum` is the
    /// minimum of any currency not named.
    #[serde(default)]
    pub payout_minimums: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Seller {
    pub id: SellerId,
    pub name: String,
    pub payout_frequency: PayoutFrequency,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub payout_minimum: Decimal,
    pub holding_days: i32,
    pub stripe_account: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The minimums per currency it was made with (`payout_minimum` for any other).
    #[sqlx(skip)]
    pub payout_minimums: std::collections::BTreeMap<String, String>,
}

/// The default holding period: sales become available for payout this many days after payment.
pub const DEFAULT_HOLDING_DAYS: i32 = 14;

pub async fn create_seller(pool: &PgPool, new: NewSeller) -> Result<Seller, CatalogueError> {
    let name = name_field("name", &new.name)?;
    let minimum: Decimal = new
        .payout_minimum
        .trim()
        .parse()
        .map_err(|_| invalid("payout_minimum", "must be a decimal string like \"50.00\""))?;
    if minimum.is_sign_negative() || minimum >= crate::money::MAX_AMOUNT || minimum.scale() > 4 {
        return Err(invalid(
            "payout_minimum",
            "must be zero or more, below a trillion, with at most 4 decimals",
        ));
    }
    let holding_days = new.holding_days.unwrap_or(DEFAULT_HOLDING_DAYS);
    if !(0..=365).contains(&holding_days) {
        return Err(invalid("holding_days", "must be 0 to 365"));
    }
    let stripe_account = new.stripe_account.map(|a| a.trim().to_owned());
    if let Some(a) = &stripe_account
        && !(a.starts_with("acct_")
            && a.len() > 5
            && a[5..].chars().all(|c| c.is_ascii_alphanumeric()))
    {
        return Err(invalid("stripe_account", "must look like acct_..."));
    }
    let mut minimums = Vec::with_capacity(new.payout_minimums.len());
    for (currency, amount) in &new.payout_minimums {
        let m = Money::parse(amount, currency).map_err(|e| {
            invalid(
                "payout_minimums",
                format!("{currency} {amount:?} is not an amount of that currency: {e}"),
            )
        })?;
        if m.amount().is_sign_negative() {
            return Err(invalid("payout_minimums", "a minimum is zero or more"));
        }
        minimums.push(m);
    }
    let mut tx = pool.begin().await?;
    let mut seller: Seller = sqlx::query_as(
        "INSERT INTO sellers (name, payout_frequency, payout_minimum, holding_days, stripe_account)
         VALUES ($1, $2, $3, $4, $5)
         RETURNING id, name, payout_frequency, payout_minimum, holding_days, stripe_account, created_at",
    )
    .bind(name)
    .bind(new.payout_frequency)
    .bind(minimum)
    .bind(holding_days)
    .bind(stripe_account)
    .fetch_one(&mut *tx)
    .await?;
    for m in &minimums {
        sqlx::query(
            "INSERT INTO seller_payout_minimums (seller_id, currency, minimum) VALUES ($1, $2, $3)",
        )
        .bind(seller.id)
        .bind(m.currency().as_str())
        .bind(m.amount())
        .execute(&mut *tx)
        .await?;
        seller.payout_minimums.insert(
            m.currency().to_string(),
            crate::money::amount_text(m.amount(), m.currency().as_str()),
        );
    }
    tx.commit().await?;
    Ok(seller)
}

pub async fn seller<'c>(
    db: impl PgExecutor<'c>,
    id: SellerId,
) -> Result<Option<Seller>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, name, payout_frequency, payout_minimum, holding_days, stripe_account, created_at
         FROM sellers WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

// ---- products ------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewProduct {
    pub seller_id: String,
    pub name: String,
    pub kind: ProductKind,
    /// A decimal string ("19.90").
    pub price: String,
    pub currency: String,
    pub interval: Option<Interval>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Product {
    pub id: ProductId,
    pub seller_id: SellerId,
    pub name: String,
    pub kind: ProductKind,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub price: Decimal,
    pub currency: String,
    pub interval: Option<Interval>,
    pub created_at: DateTime<Utc>,
}

impl Product {
    /// The price as money (the schema keeps it positive, in a known currency).
    pub fn unit_price(&self) -> Result<Money, MoneyError> {
        Money::new(self.price, self.currency.parse::<Currency>()?)
    }
}

const PRODUCT_COLUMNS: &str =
    "id, seller_id, name, kind, price, currency::text AS currency, \"interval\", created_at";

pub async fn create_product(pool: &PgPool, new: NewProduct) -> Result<Product, CatalogueError> {
    let seller_id: SellerId = new.seller_id.parse()?;
    let name = name_field("name", &new.name)?;
    let price = money_field("price", &new.price, &new.currency)?;
    if price.is_zero() {
        return Err(invalid("price", "must be more than zero"));
    }
    match (new.kind, new.interval) {
        (ProductKind::Subscription, None) => {
            return Err(invalid(
                "interval",
                "a subscription needs one (day, week, month, year)",
            ));
        }
        (ProductKind::OneOff, Some(_)) => {
            return Err(invalid("interval", "only subscriptions have one"));
        }
        _ => {}
    }
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO products (seller_id, name, kind, price, currency, \"interval\")
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING {PRODUCT_COLUMNS}"
    )))
    .bind(seller_id)
    .bind(name)
    .bind(new.kind)
    .bind(price.amount())
    .bind(price.currency().as_str())
    .bind(new.interval)
    .fetch_one(pool)
    .await
    .map(|product: Product| Product {
        // As every amount is written: "19.90", not the column's "19.9000".
        price: price.amount(),
        ..product
    })
    .map_err(|e| match CatalogueError::from(e) {
        CatalogueError::UnknownSeller(_) => CatalogueError::UnknownSeller(seller_id.to_string()),
        other => other,
    })
}

pub async fn products<'c>(
    db: impl PgExecutor<'c>,
    ids: &[ProductId],
) -> Result<Vec<Product>, sqlx::Error> {
    // The ids as a sub-select's value: with their count in view the planner planned the
    // statement again at every call (README, "Plans made once").
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {PRODUCT_COLUMNS} FROM products WHERE id = ANY(ARRAY(SELECT unnest($1::uuid[])))"
    )))
    .bind(ids)
    .fetch_all(db)
    .await
}

// ---- coupons -------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewCoupon {
    pub code: String,
    pub percent_off: Option<String>,
    pub amount_off: Option<String>,
    pub currency: Option<String>,
    pub max_redemptions: Option<i32>,
    pub valid_from: Option<DateTime<Utc>>,
    pub valid_until: Option<DateTime<Utc>>,
    pub seller_id: Option<String>,
    pub product_id: Option<String>,
}

/// What a coupon takes off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discount {
    /// A percentage of each line it applies to.
    Percent(Decimal),
    /// A fixed amount off one order in its currency.
    Amount(Money),
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct CouponRow {
    id: CouponId,
    code: String,
    percent_off: Option<Decimal>,
    amount_off: Option<Decimal>,
    currency: Option<String>,
    max_redemptions: Option<i32>,
    redemptions: i32,
    valid_from: Option<DateTime<Utc>>,
    valid_until: Option<DateTime<Utc>>,
    seller_id: Option<SellerId>,
    product_id: Option<ProductId>,
}

#[derive(Debug, Clone)]
pub struct Coupon {
    pub id: CouponId,
    pub code: String,
    pub discount: Discount,
    pub max_redemptions: Option<i32>,
    pub redemptions: i32,
    pub valid_from: Option<DateTime<Utc>>,
    pub valid_until: Option<DateTime<Utc>>,
    pub seller_id: Option<SellerId>,
    pub product_id: Option<ProductId>,
}

impl TryFrom<CouponRow> for Coupon {
    type Error = MoneyError;
    fn try_from(r: CouponRow) -> Result<Self, MoneyError> {
        let discount = match (r.percent_off, r.amount_off, r.currency) {
            (Some(p), _, _) => Discount::Percent(p),
            (None, Some(a), Some(c)) => Discount::Amount(Money::new(a, c.parse()?)?),
            // The schema keeps exactly one kind of discount.
            _ => Discount::Percent(Decimal::ZERO),
        };
        Ok(Self {
            id: r.id,
            code: r.code,
            discount,
            max_redemptions: r.max_redemptions,
            redemptions: r.redemptions,
            valid_from: r.valid_from,
            valid_until: r.valid_until,
            seller_id: r.seller_id,
            product_id: r.product_id,
        })
    }
}

impl Coupon {
    pub fn is_valid_at(&self, now: DateTime<Utc>) -> bool {
        self.valid_from.is_none_or(|f| f <= now) && self.valid_until.is_none_or(|u| now < u)
    }
}

/// A coupon as the API writes it: a percentage off, or an amount off in a currency.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Coupon)]
struct CouponWire<'a> {
    id: CouponId,
    code: &'a str,
    /// A percentage off each line it applies to ("10", "12.5").
    #[serde(skip_serializing_if = "Option::is_none")]
    percent_off: Option<String>,
    /// An amount off one order, in `currency`.
    #[serde(skip_serializing_if = "Option::is_none")]
    amount_off: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    currency: Option<String>,
    max_redemptions: Option<i32>,
    redemptions: i32,
    valid_from: Option<DateTime<Utc>>,
    valid_until: Option<DateTime<Utc>>,
    seller_id: Option<SellerId>,
    product_id: Option<ProductId>,
}

impl Serialize for Coupon {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (percent_off, amount_off, currency) = match self.discount {
            Discount::Percent(p) => (Some(p.normalize().to_string()), None, None),
            Discount::Amount(m) => (
                None,
                Some(m.amount().to_string()),
                Some(m.currency().as_str().to_owned()),
            ),
        };
        CouponWire {
            id: self.id,
            code: &self.code,
            percent_off,
            amount_off,
            currency,
            max_redemptions: self.max_redemptions,
            redemptions: self.redemptions,
            valid_from: self.valid_from,
            valid_until: self.valid_until,
            seller_id: self.seller_id,
            product_id: self.product_id,
        }
        .serialize(s)
    }
}

impl utoipa::PartialSchema for Coupon {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        <CouponWire<'static> as utoipa::PartialSchema>::schema()
    }
}

impl utoipa::ToSchema for Coupon {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        <CouponWire<'static> as utoipa::ToSchema>::schemas(schemas);
    }
}

const COUPON_COLUMNS: &str =
    "id, code, percent_off, amount_off, currency::text AS currency, max_redemptions, redemptions,
     valid_from, valid_until, seller_id, product_id";

pub async fn create_coupon(pool: &PgPool, new: NewCoupon) -> Result<Coupon, CatalogueError> {
    let code = new.code.trim().to_ascii_uppercase();
    if code.is_empty()
        || code.len() > 64
        || !code
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(invalid("code", "must be 1 to 64 letters, digits, _ or -"));
    }
    let (percent, amount, currency) = match (&new.percent_off, &new.amount_off) {
        (Some(p), None) => {
            if new.currency.is_some() {
                return Err(invalid("currency", "only an amount_off coupon has one"));
            }
            let p: Decimal = p
                .trim()
                .parse()
                .map_err(|_| invalid("percent_off", "must be a decimal string like \"10\""))?;
            if p <= Decimal::ZERO || p > Decimal::ONE_HUNDRED || p.normalize().scale() > 2 {
                return Err(invalid(
                    "percent_off",
                    "must be more than 0 and at most 100, with at most 2 decimals",
                ));
            }
            (Some(p), None, None)
        }
        (None, Some(a)) => {
            let currency = new
                .currency
                .as_deref()
                .ok_or_else(|| invalid("currency", "an amount_off coupon needs one"))?;
            let m = money_field("amount_off", a, currency)?;
            if m.is_zero() {
                return Err(invalid("amount_off", "must be more than zero"));
            }
            (None, Some(m.amount()), Some(m.currency().to_string()))
        }
        _ => {
            return Err(invalid(
                "percent_off",
                "give exactly one of percent_off and amount_off",
            ));
        }
    };
    if new.max_redemptions.is_some_and(|m| m < 1) {
        return Err(invalid("max_redemptions", "must be at least 1"));
    }
    if let (Some(f), Some(u)) = (new.valid_from, new.valid_until)
        && f >= u
    {
        return Err(invalid("valid_until", "must be after valid_from"));
    }
    let seller_id: Option<SellerId> = new.seller_id.as_deref().map(str::parse).transpose()?;
    let product_id: Option<ProductId> = new.product_id.as_deref().map(str::parse).transpose()?;
    let row: CouponRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO coupons (code, percent_off, amount_off, currency, max_redemptions, valid_from, valid_until,
                              seller_id, product_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {COUPON_COLUMNS}"
    )))
    .bind(&code)
    .bind(percent)
    .bind(amount)
    .bind(currency)
    .bind(new.max_redemptions)
    .bind(new.valid_from)
    .bind(new.valid_until)
    .bind(seller_id)
    .bind(product_id)
    .fetch_one(pool)
    .await
    .map_err(|e| match CatalogueError::from(e) {
        CatalogueError::UnknownSeller(_) => {
            CatalogueError::UnknownSeller(seller_id.map(|s| s.to_string()).unwrap_or_default())
        }
        CatalogueError::UnknownProduct(_) => {
            CatalogueError::UnknownProduct(product_id.map(|p| p.to_string()).unwrap_or_default())
        }
        CatalogueError::CodeTaken(_) => CatalogueError::CodeTaken(code.clone()),
        other => other,
    })?;
    Coupon::try_from(row).map_err(|e| invalid("amount_off", e.to_string()))
}

/// The coupon with this code (any case), locked for the caller's transaction: its redemptions
/// are counted under this lock.
pub async fn lock_coupon(
    tx: &mut sqlx::PgConnection,
    code: &str,
) -> Result<Option<Coupon>, sqlx::Error> {
    let row: Option<CouponRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COUPON_COLUMNS} FROM coupons WHERE code = upper($1) FOR UPDATE"
    )))
    .bind(code.trim())
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.and_then(|r| Coupon::try_from(r).ok()))
}

/// Takes `n` redemptions of a coupon, or none if that would pass its limit. Returns whether it
/// did. The CHECK constraint is the last barrier if a caller forgot the lock.
pub async fn redeem(
    tx: &mut sqlx::PgConnection,
    coupon: CouponId,
    n: i32,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE coupons SET redemptions = redemptions + $2
         WHERE id = $1 AND (max_redemptions IS NULL OR redemptions + $2 <= max_redemptions)",
    )
    .bind(coupon)
    .bind(n)
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives back one redemption (an order that held it expired).
pub async fn release_redemption(
    tx: &mut sqlx::PgConnection,
    coupon: CouponId,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE coupons SET redemptions = redemptions - 1 WHERE id = $1 AND redemptions > 0",
    )
    .bind(coupon)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{one_connection, plan_counts};

    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn reading_a_carts_products_keeps_its_plan(pool: PgPool) {
        let pool = one_connection(&pool).await;
        for n in [1_u128, 3, 1, 2, 5, 1, 4, 2] {
            let ids: Vec<ProductId> = (0..n)
                .map(|i| ProductId(Uuid::from_u128(n << 8 | i)))
                .collect();
            assert!(products(&pool, &ids).await.unwrap().is_empty());
        }
        let (generic, custom) = plan_counts(&pool, "FROM products WHERE id = ANY").await;
        assert_eq!(
            (generic, custom),
            (3, 5),
            "planned for its values five times, then once for all"
        );
    }
}
