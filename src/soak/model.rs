//! The soak's own account of the money: a second implementation of the pricing, fee, split and
//! take-back rules as README.md and PRODUCT.md state them, written without the library's code, so
//! that a rule the library gets wrong shows as a difference rather than agreeing with itself.
//!
//! - A percentage coupon takes that percentage off each line, rounded half-even to the cent; a
//!   fixed coupon takes its amount (at most the subtotal) off the first order of the cart.
//! - The fee is `fee_percent` of the total, rounded half-even; the seller's net the rest.
//! - Everything taken back from a sale (refunds, disputes open or lost) counts up to the total;
//!   the seller bears `taken × net / total` rounded half-even on that running total.

use std::collections::BTreeMap;

use rust_decimal::{Decimal, RoundingStrategy};

/// Rounds to the cent, half to even (BRL, the soak's currency, has two decimals).
pub fn cents(d: Decimal) -> Decimal {
    d.round_dp_with_strategy(2, RoundingStrategy::MidpointNearestEven)
}

/// A coupon the soak uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Coupon {
    PercentOff(Decimal),
    AmountOff(Decimal),
}

/// An order's amounts as the rules make them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priced {
    pub subtotal: Decimal,
    pub discount: Decimal,
    pub total: Decimal,
    pub fee: Decimal,
    pub net: Decimal,
}

/// Prices one order of `lines` (unit price, quantity); `first` says whether it is the cart's
/// first order (the one a fixed coupon applies to).
pub fn price(
    lines: &[(Decimal, u32)],
    coupon: Option<Coupon>,
    first: bool,
    fee_percent: Decimal,
) -> Priced {
    let subtotal: Decimal = lines.iter().map(|(p, q)| p * Decimal::from(*q)).sum();
    let discount = match coupon {
        Some(Coupon::PercentOff(pct)) => lines
            .iter()
            .map(|(p, q)| cents(p * Decimal::from(*q) * pct / Decimal::ONE_HUNDRED))
            .sum(),
        Some(Coupon::AmountOff(amount)) if first => amount.min(subtotal),
        _ => Decimal::ZERO,
    };
    let total = subtotal - discount;
    let fee = cents(total * fee_percent / Decimal::ONE_HUNDRED);
    Priced {
        subtotal,
        discount,
        total,
        fee,
        net: total - fee,
    }
}

/// What the seller keeps of a sale of `total` (net `net`) once `taken` was taken back.
pub fn seller_keeps(total: Decimal, net: Decimal, taken: Decimal) -> Decimal {
    let taken = taken.min(total);
    if total.is_zero() {
        return net;
    }
    net - cents(taken * net / total)
}

/// How a dispute the soak opened ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisputeEnd {
    Open,
    Won,
    Lost,
}

/// What the soak expects of one order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Paid in time: confirmed once, one sale.
    Paid,
    /// Never paid, or paid after it expired (that payment given back): no sale.
    Unpaid,
    /// Paid so near its expiry that either may win; the order's own answer decides, and its
    /// money must then follow that answer.
    InDoubt,
}

/// One order the soak made, and everything it did to it.
#[derive(Debug, Clone)]
pub struct Order {
    pub number: i64,
    pub seller: String,
    pub buyer: String,
    pub priced: Priced,
    pub fate: Fate,
    pub with_coins: bool,
    /// Refunds that went through (the operator's, the gateway dashboard's).
    pub refunds: Vec<Decimal>,
    pub disputes: Vec<(Decimal, DisputeEnd)>,
    /// Sessions paid after the order could take them: each must be given back whole.
    pub given_back: Vec<(String, Decimal)>,
}

impl Order {
    /// Everything taken back from the sale.
    pub fn taken(&self) -> Decimal {
        let refunds: Decimal = self.refunds.iter().sum();
        let disputes: Decimal = self
            .disputes
            .iter()
            .filter(|(_, end)| *end != DisputeEnd::Won)
            .map(|(a, _)| *a)
            .sum();
        refunds + disputes
    }

    /// What its seller keeps of it, when it was paid.
    pub fn kept(&self) -> Decimal {
        seller_keeps(self.priced.total, self.priced.net, self.taken())
    }
}

/// Everything the soak sent, and what follows from it.
#[derive(Debug, Default)]
pub struct Model {
    pub orders: BTreeMap<i64, Order>,
    /// Coins granted per buyer.
    pub granted: BTreeMap<String, Decimal>,
    /// Checkouts sent twice with one Idempotency-Key, and those answered with other orders.
    pub repeats: usize,
    pub repeats_differing: Vec<String>,
    /// Answers that were not what the API states (a checkout priced otherwise, a refusal).
    pub surprises: Vec<String>,
}

impl Model {
    /// Each seller's money as the model sees it: the orders decided paid (`paid` answers for
    /// those in doubt), each with what its seller keeps.
    pub fn sellers(&self, paid: &dyn Fn(i64) -> bool) -> BTreeMap<String, Decimal> {
        let mut out = BTreeMap::new();
        for o in self.orders.values() {
            let entry = out.entry(o.seller.clone()).or_insert(Decimal::ZERO);
            let is_paid = match o.fate {
                Fate::Paid => true,
                Fate::Unpaid => false,
                Fate::InDoubt => paid(o.number),
            };
            if is_paid {
                *entry += o.kept();
            }
        }
        out
    }

    /// Each buyer's coins: granted, less the orders they paid with coins (those that took them),
    /// plus what came back by refunds.
    pub fn wallets(&self, paid: &dyn Fn(i64) -> bool) -> BTreeMap<String, Decimal> {
        let mut out = self.granted.clone();
        for o in self.orders.values().filter(|o| o.with_coins) {
            let took = match o.fate {
                Fate::Paid => true,
                Fate::Unpaid => false,
                Fate::InDoubt => paid(o.number),
            };
            if took {
                let w = out.entry(o.buyer.clone()).or_insert(Decimal::ZERO);
                *w -= o.priced.total - o.refunds.iter().sum::<Decimal>();
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(s: &str) -> Decimal {
        s.parse().unwrap()
    }

    #[test]
    fn the_fee_is_a_tenth_rounded_half_even_and_the_net_the_rest() {
        let p = price(&[(d("19.90"), 1)], None, true, d("10"));
        assert_eq!((p.total, p.fee, p.net), (d("19.90"), d("1.99"), d("17.91")));
        // 0.125 rounds to 0.12 (even), 0.135 to 0.14.
        let p = price(&[(d("1.25"), 1)], None, true, d("10"));
        assert_eq!((p.fee, p.net), (d("0.12"), d("1.13")));
        let p = price(&[(d("1.35"), 1)], None, true, d("10"));
        assert_eq!((p.fee, p.net), (d("0.14"), d("1.21")));
    }

    #[test]
    fn coupons_take_their_part_off() {
        let p = price(
            &[(d("33.33"), 2), (d("7.77"), 1)],
            Some(Coupon::PercentOff(d("15"))),
            true,
            d("10"),
        );
        // 66.66 × 0.15 = 9.999 -> 10.00; 7.77 × 0.15 = 1.1655 -> 1.17
        assert_eq!(p.discount, d("11.17"));
        assert_eq!(p.total, d("63.26"));
        let p = price(
            &[(d("2.00"), 1)],
            Some(Coupon::AmountOff(d("3.00"))),
            true,
            d("10"),
        );
        assert_eq!((p.discount, p.total), (d("2.00"), d("0.00")));
        let p = price(
            &[(d("19.90"), 1)],
            Some(Coupon::AmountOff(d("3.00"))),
            false,
            d("10"),
        );
        assert_eq!(p.discount, d("0"));
    }

    #[test]
    fn a_full_take_back_leaves_the_seller_nothing() {
        assert_eq!(seller_keeps(d("19.90"), d("17.91"), d("19.90")), d("0"));
        assert_eq!(seller_keeps(d("19.90"), d("17.91"), d("50")), d("0"));
        assert_eq!(seller_keeps(d("19.90"), d("17.91"), d("0")), d("17.91"));
    }

    proptest! {
        /// Fee and net add up to the total; the seller's part of any take-back is between none
        /// and all of the net, and grows with what is taken.
        #[test]
        fn no_cent_is_made_or_lost(cents_total in 1i64..10_000_000, a in 0i64..10_000_000, b in 0i64..10_000_000) {
            let total = Decimal::new(cents_total, 2);
            let p = price(&[(total, 1)], None, true, d("10"));
            prop_assert_eq!(p.fee + p.net, p.total);
            let (lo, hi) = (Decimal::new(a.min(b), 2), Decimal::new(a.max(b), 2));
            let keep_lo = seller_keeps(p.total, p.net, lo);
            let keep_hi = seller_keeps(p.total, p.net, hi);
            prop_assert!(keep_hi <= keep_lo);
            prop_assert!(keep_hi >= Decimal::ZERO && keep_lo <= p.net);
        }
    }
}
