//! Pricing a cart: the server's own prices and coupons (what the client says a thing costs is
//! never read), one order per seller and kind, the coupon's discount, the platform's fee.
//!
//! Rules:
//! - Items group into orders by seller and kind (one-off or subscription), in the order the
//!   cart first names them. One order holds one currency; a subscription order one interval.
//! - A percentage coupon takes that percentage off each line it applies to (its seller, its
//!   product, or every line), rounded half-even to the currency's minor unit.
//! - A fixed-amount coupon takes its amount off the first order it applies to in its currency,
//!   at most that order's eligible subtotal, spread over its eligible lines in cart order.
//! - Each order that got a discount holds one redemption of the coupon.
//! - The platform fee is `fee_percent` of the order's total, rounded half-even to the minor
//!   unit; the seller's net is the rest, so fee + net = total exactly.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;

use crate::catalogue::{Coupon, Discount, Interval, Product, ProductKind, SellerId};
use crate::money::{Currency, Money};

/// Why a cart cannot be priced. Each maps to a 422 with its code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PricingError {
    #[error("{0}")]
    InvalidItems(String),
    #[error("{0}")]
    CouponUnavailable(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PricedLine {
    pub product: Product,
    pub quantity: u32,
    pub unit_price: Money,
    pub subtotal: Money,
    pub discount: Money,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PricedOrder {
    pub seller_id: SellerId,
    pub kind: ProductKind,
    pub interval: Option<Interval>,
    pub currency: Currency,
    pub lines: Vec<PricedLine>,
    pub subtotal: Money,
    pub discount: Money,
    pub total: Money,
    pub platform_fee: Money,
    pub seller_net: Money,
}

impl PricedOrder {
    pub fn uses_coupon(&self) -> bool {
        !self.discount.is_zero()
    }
}

fn too_large() -> PricingError {
    PricingError::InvalidItems("the amounts are beyond what an order can hold".into())
}

fn applies(coupon: &Coupon, product: &Product) -> bool {
    coupon.seller_id.is_none_or(|s| s == product.seller_id)
        && coupon.product_id.is_none_or(|p| p == product.id)
}

/// Prices a cart. `items` are the cart's lines with their products, in cart order.
pub fn price(
    items: &[(Product, u32)],
    coupon: Option<&Coupon>,
    fee_percent: Decimal,
    now: DateTime<Utc>,
) -> Result<Vec<PricedOrder>, PricingError> {
    if items.is_empty() {
        return Err(PricingError::InvalidItems("the cart is empty".into()));
    }
    // Group by seller and kind, keeping the cart's order.
    let mut groups: Vec<((SellerId, ProductKind), Vec<PricedLine>)> = Vec::new();
    for (product, quantity) in items {
        if *quantity == 0 {
            return Err(PricingError::InvalidItems(
                "a quantity must be at least 1".into(),
            ));
        }
        let unit_price = product
            .unit_price()
            .map_err(|e| PricingError::InvalidItems(format!("product {}: {e}", product.id)))?;
        let subtotal = unit_price.times(*quantity).ok_or_else(too_large)?;
        let line = PricedLine {
            product: product.clone(),
            quantity: *quantity,
            unit_price,
            subtotal,
            discount: Money::zero(unit_price.currency()),
        };
        let key = (product.seller_id, product.kind);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, lines)) => lines.push(line),
            None => groups.push((key, vec![line])),
        }
    }

    if let Some(c) = coupon {
        if !c.is_valid_at(now) {
            return Err(PricingError::CouponUnavailable(format!(
                "coupon {} is not valid now",
                c.code
            )));
        }
        if c.max_redemptions.is_some_and(|m| c.redemptions >= m) {
            return Err(PricingError::CouponUnavailable(format!(
                "coupon {} is used up",
                c.code
            )));
        }
    }

    let mut orders = Vec::with_capacity(groups.len());
    let mut fixed_left: Option<Money> = match coupon.map(|c| c.discount) {
        Some(Discount::Amount(m)) => Some(m),
        _ => None,
    };
    for ((seller_id, kind), mut lines) in groups {
        let currency = lines[0].unit_price.currency();
        if lines.iter().any(|l| l.unit_price.currency() != currency) {
            return Err(PricingError::InvalidItems(format!(
                "the products of seller {seller_id} are in different currencies; buy them in separate checkouts"
            )));
        }
        let interval = lines[0].product.interval;
        if lines.iter().any(|l| l.product.interval != interval) {
            return Err(PricingError::InvalidItems(format!(
                "the subscriptions of seller {seller_id} have different intervals; buy them in separate checkouts"
            )));
        }
        if let Some(c) = coupon {
            match c.discount {
                Discount::Percent(p) => {
                    for l in lines.iter_mut().filter(|l| applies(c, &l.product)) {
                        l.discount = l.subtotal.percent(p).ok_or_else(too_large)?;
                    }
                }
                Discount::Amount(_) => {
                    if let Some(left) = fixed_left.filter(|m| m.currency() == currency) {
                        let mut left = left;
                        for l in lines.iter_mut().filter(|l| applies(c, &l.product)) {
                            let take = left.min(l.subtotal);
                            l.discount = take;
                            left = left.checked_sub(&take).ok_or_else(too_large)?;
                            if left.is_zero() {
                                break;
                            }
                        }
                        // The first order it applied to used it, whatever was left.
                        if lines.iter().any(|l| !l.discount.is_zero()) {
                            fixed_left = None;
                        }
                    }
                }
            }
        }
        let mut subtotal = Money::zero(currency);
        let mut discount = Money::zero(currency);
        for l in &lines {
            subtotal = subtotal.checked_add(&l.subtotal).ok_or_else(too_large)?;
            discount = discount.checked_add(&l.discount).ok_or_else(too_large)?;
        }
        let total = subtotal.checked_sub(&discount).ok_or_else(too_large)?;
        let platform_fee = total.percent(fee_percent).ok_or_else(too_large)?;
        let seller_net = total.checked_sub(&platform_fee).ok_or_else(too_large)?;
        orders.push(PricedOrder {
            seller_id,
            kind,
            interval,
            currency,
            lines,
            subtotal,
            discount,
            total,
            platform_fee,
            seller_net,
        });
    }
    if let Some(c) = coupon
        && !orders.iter().any(PricedOrder::uses_coupon)
    {
        return Err(PricingError::CouponUnavailable(format!(
            "coupon {} does not apply to these items",
            c.code
        )));
    }
    if orders.iter().any(|o| o.total.is_zero()) {
        return Err(PricingError::InvalidItems(
            "an order would cost nothing; payment links need an amount".into(),
        ));
    }
    Ok(orders)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::{CouponId, ProductId};
    use uuid::Uuid;

    fn seller(n: u8) -> SellerId {
        SellerId(Uuid::from_bytes([n; 16]))
    }

    fn product(n: u8, seller_n: u8, price: &str, currency: &str, kind: ProductKind) -> Product {
        Product {
            id: ProductId(Uuid::from_bytes([100 + n; 16])),
            seller_id: seller(seller_n),
            name: format!("p{n}"),
            kind,
            price: price.parse().unwrap(),
            currency: currency.into(),
            interval: (kind == ProductKind::Subscription).then_some(Interval::Month),
            created_at: Utc::now(),
        }
    }

    fn coupon(discount: Discount) -> Coupon {
        Coupon {
            id: CouponId(Uuid::nil()),
            code: "C".into(),
            discount,
            max_redemptions: None,
            redemptions: 0,
            valid_from: None,
            valid_until: None,
            seller_id: None,
            product_id: None,
        }
    }

    fn m(s: &str) -> String {
        s.to_owned()
    }

    #[test]
    fn one_order_per_seller_and_kind_in_cart_order() {
        let items = [
            (product(1, 1, "10.00", "BRL", ProductKind::OneOff), 2),
            (product(2, 2, "5.00", "BRL", ProductKind::OneOff), 1),
            (product(3, 1, "7.50", "BRL", ProductKind::Subscription), 1),
            (product(4, 1, "1.25", "BRL", ProductKind::OneOff), 4),
        ];
        let orders = price(&items, None, "10".parse().unwrap(), Utc::now()).unwrap();
        let summary: Vec<(SellerId, ProductKind, String, String, String)> = orders
            .iter()
            .map(|o| {
                (
                    o.seller_id,
                    o.kind,
                    o.total.amount().to_string(),
                    o.platform_fee.amount().to_string(),
                    o.seller_net.amount().to_string(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    seller(1),
                    ProductKind::OneOff,
                    m("25.00"),
                    m("2.50"),
                    m("22.50")
                ),
                (
                    seller(2),
                    ProductKind::OneOff,
                    m("5.00"),
                    m("0.50"),
                    m("4.50")
                ),
                (
                    seller(1),
                    ProductKind::Subscription,
                    m("7.50"),
                    m("0.75"),
                    m("6.75")
                ),
            ]
        );
    }

    #[test]
    fn the_fee_rounds_half_even_and_fee_plus_net_is_the_total() {
        // 10 % of 0.25 is 0.025: the fee is 0.02 (even), the net 0.23.
        let items = [(product(1, 1, "0.25", "BRL", ProductKind::OneOff), 1)];
        let o = &price(&items, None, "10".parse().unwrap(), Utc::now()).unwrap()[0];
        assert_eq!(
            (
                o.platform_fee.amount().to_string(),
                o.seller_net.amount().to_string()
            ),
            (m("0.02"), m("0.23"))
        );
        let items = [(product(1, 1, "0.35", "BRL", ProductKind::OneOff), 1)];
        let o = &price(&items, None, "10".parse().unwrap(), Utc::now()).unwrap()[0];
        assert_eq!(o.platform_fee.amount().to_string(), "0.04");
        for cents in 1..500 {
            let p = format!("{}.{:02}", cents / 100, cents % 100);
            let items = [(product(1, 1, &p, "BRL", ProductKind::OneOff), 3)];
            let o = &price(&items, None, "12.5".parse().unwrap(), Utc::now()).unwrap()[0];
            assert_eq!(
                o.platform_fee.checked_add(&o.seller_net),
                Some(o.total),
                "{p}"
            );
        }
    }

    #[test]
    fn percentage_coupons_apply_to_their_lines_only() {
        let items = [
            (product(1, 1, "10.00", "BRL", ProductKind::OneOff), 1),
            (product(2, 2, "20.00", "BRL", ProductKind::OneOff), 1),
        ];
        let mut c = coupon(Discount::Percent("15".parse().unwrap()));
        c.seller_id = Some(seller(2));
        let orders = price(&items, Some(&c), Decimal::ZERO, Utc::now()).unwrap();
        assert_eq!(orders[0].discount.amount().to_string(), "0.00");
        assert_eq!(orders[1].discount.amount().to_string(), "3.00");
        assert_eq!(orders[1].total.amount().to_string(), "17.00");
        // 12.5 % of 0.10 is 0.0125 -> 0.01.
        let items = [(product(1, 1, "0.10", "BRL", ProductKind::OneOff), 1)];
        let c = coupon(Discount::Percent("12.5".parse().unwrap()));
        let o = &price(&items, Some(&c), Decimal::ZERO, Utc::now()).unwrap()[0];
        assert_eq!(o.discount.amount().to_string(), "0.01");
    }

    #[test]
    fn a_fixed_coupon_takes_its_amount_off_one_order_at_most_its_subtotal() {
        let items = [
            (product(1, 1, "3.00", "BRL", ProductKind::OneOff), 1),
            (product(2, 2, "20.00", "BRL", ProductKind::OneOff), 1),
        ];
        let c = coupon(Discount::Amount(Money::parse("5.00", "BRL").unwrap()));
        let orders = price(&items, Some(&c), Decimal::ZERO, Utc::now());
        // The first order (3.00) would cost nothing: refused rather than a free order.
        assert!(matches!(orders, Err(PricingError::InvalidItems(_))));
        let items = [
            (product(1, 1, "30.00", "BRL", ProductKind::OneOff), 1),
            (product(2, 2, "20.00", "BRL", ProductKind::OneOff), 1),
        ];
        let orders = price(&items, Some(&c), Decimal::ZERO, Utc::now()).unwrap();
        assert_eq!(orders[0].total.amount().to_string(), "25.00");
        assert_eq!(orders[1].total.amount().to_string(), "20.00");
        // In another currency it applies to nothing.
        let usd = coupon(Discount::Amount(Money::parse("5.00", "USD").unwrap()));
        assert!(matches!(
            price(&items, Some(&usd), Decimal::ZERO, Utc::now()),
            Err(PricingError::CouponUnavailable(_))
        ));
    }

    #[test]
    fn bad_carts_and_unusable_coupons_are_refused() {
        let now = Utc::now();
        assert!(matches!(
            price(&[], None, Decimal::ZERO, now),
            Err(PricingError::InvalidItems(_))
        ));
        let zero = [(product(1, 1, "1.00", "BRL", ProductKind::OneOff), 0)];
        assert!(matches!(
            price(&zero, None, Decimal::ZERO, now),
            Err(PricingError::InvalidItems(_))
        ));
        let mixed = [
            (product(1, 1, "1.00", "BRL", ProductKind::OneOff), 1),
            (product(2, 1, "1.00", "USD", ProductKind::OneOff), 1),
        ];
        assert!(matches!(
            price(&mixed, None, Decimal::ZERO, now),
            Err(PricingError::InvalidItems(_))
        ));
        let huge = [(
            product(1, 1, "900000000000.00", "BRL", ProductKind::OneOff),
            2,
        )];
        assert!(matches!(
            price(&huge, None, Decimal::ZERO, now),
            Err(PricingError::InvalidItems(_))
        ));
        let ok = [(product(1, 1, "10.00", "BRL", ProductKind::OneOff), 1)];
        let mut expired = coupon(Discount::Percent("10".parse().unwrap()));
        expired.valid_until = Some(now - chrono::Duration::seconds(1));
        assert!(matches!(
            price(&ok, Some(&expired), Decimal::ZERO, now),
            Err(PricingError::CouponUnavailable(_))
        ));
        let mut used_up = coupon(Discount::Percent("10".parse().unwrap()));
        used_up.max_redemptions = Some(2);
        used_up.redemptions = 2;
        assert!(matches!(
            price(&ok, Some(&used_up), Decimal::ZERO, now),
            Err(PricingError::CouponUnavailable(_))
        ));
        let mut other_product = coupon(Discount::Percent("10".parse().unwrap()));
        other_product.product_id = Some(ProductId(Uuid::from_bytes([7; 16])));
        assert!(matches!(
            price(&ok, Some(&other_product), Decimal::ZERO, now),
            Err(PricingError::CouponUnavailable(_))
        ));
    }
}
