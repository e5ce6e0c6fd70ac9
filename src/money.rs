//! Amounts of money: a decimal and an ISO 4217 currency, never a float.

use std::fmt;
use std::str::FromStr;

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("{0:?} is not a currency code (three letters, like BRL)")]
    Currency(String),
    #[error("{0:?} is not an amount (a decimal string like \"19.90\")")]
    Amount(String),
    #[error("amount {0} has more decimals than {1} allows")]
    Precision(Decimal, Currency),
    #[error("amount must not be negative (got {0})")]
    Negative(Decimal),
    #[error("amount {0} is too large (at most 999999999999.9999 per amount)")]
    TooLarge(Decimal),
}

/// The largest amount payfleet stores: what `numeric(20, 4)` holds, with room for sums of many
/// of them in the same column type (ledger balances, invoice totals).
pub const MAX_AMOUNT: Decimal = Decimal::from_parts(3_567_587_328, 232, 0, false, 0);

/// An ISO 4217 code, upper case.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Currency([u8; 3]);

impl Currency {
    pub fn as_str(&self) -> &str {
        // Only ASCII letters are ever stored.
        std::str::from_utf8(&self.0).unwrap_or("???")
    }

    /// Digits after the decimal point in the currency's minor unit.
    pub fn exponent(&self) -> u32 {
        match self.as_str() {
            "BIF" | "CLP" | "DJF" | "GNF" | "JPY" | "KMF" | "KRW" | "MGA" | "PYG" | "RWF"
            | "UGX" | "VND" | "VUV" | "XAF" | "XOF" | "XPF" => 0,
            "BHD" | "JOD" | "KWD" | "OMR" | "TND" => 3,
            _ => 2,
        }
    }
}

impl FromStr for Currency {
    type Err = MoneyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let b = s.trim().as_bytes();
        if b.len() != 3 || !b.iter().all(u8::is_ascii_alphabetic) {
            return Err(MoneyError::Currency(s.to_owned()));
        }
        Ok(Self([
            b[0].to_ascii_uppercase(),
            b[1].to_ascii_uppercase(),
            b[2].to_ascii_uppercase(),
        ]))
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Currency({})", self.as_str())
    }
}

impl Serialize for Currency {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Currency {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A non-negative amount in a currency, with no more decimals than the currency has, below
/// [`MAX_AMOUNT`]. Serialised as `{"amount": "19.90", "currency": "BRL"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Money {
    amount: Decimal,
    currency: Currency,
}

impl Money {
    pub fn new(amount: Decimal, currency: Currency) -> Result<Self, MoneyError> {
        if amount.is_sign_negative() && !amount.is_zero() {
            return Err(MoneyError::Negative(amount));
        }
        if amount.normalize().scale() > currency.exponent() {
            return Err(MoneyError::Precision(amount, currency));
        }
        if amount >= MAX_AMOUNT {
            return Err(MoneyError::TooLarge(amount));
        }
        // Always written with the currency's minor-unit digits ("19.90", "500", "1.500").
        let mut amount = amount.normalize();
        amount.rescale(currency.exponent());
        Ok(Self { amount, currency })
    }

    /// From a decimal string such as `"19.90"` and a currency code.
    ///
    /// Only digits with at most one point between them (and a sign, to be refused as negative):
    /// not the exponents (`1e2`), separators (`1_000`) and leading `+` rust_decimal's own parser
    /// takes, and never rounded to fit (a 30-digit fraction is refused, not made 1.00).
    pub fn parse(amount: &str, currency: &str) -> Result<Self, MoneyError> {
        let currency: Currency = currency.parse()?;
        let text = amount.trim();
        let unsigned = text.strip_prefix('-').unwrap_or(text);
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let plain = match unsigned.split_once('.') {
            Some((whole, fraction)) => digits(whole) && digits(fraction),
            None => digits(unsigned),
        };
        let value = plain
            .then(|| Decimal::from_str_exact(text).ok())
            .flatten()
            .ok_or_else(|| MoneyError::Amount(amount.to_owned()))?;
        Self::new(value, currency)
    }

    /// From an integer count of minor units (cents, paise), as Stripe and Razorpay send them.
    pub fn from_minor(units: i64, currency: &str) -> Result<Self, MoneyError> {
        let currency: Currency = currency.parse()?;
        Self::new(Decimal::new(units, currency.exponent()), currency)
    }

    pub fn amount(&self) -> Decimal {
        self.amount
    }

    pub fn currency(&self) -> Currency {
        self.currency
    }

    /// The sum of two amounts of the same currency; `None` for different currencies or an
    /// amount beyond [`MAX_AMOUNT`].
    pub fn checked_add(&self, other: &Money) -> Option<Money> {
        if self.currency != other.currency {
            return None;
        }
        Money::new(self.amount.checked_add(other.amount)?, self.currency).ok()
    }

    /// The difference; `None` for different currencies or a negative result.
    pub fn checked_sub(&self, other: &Money) -> Option<Money> {
        if self.currency != other.currency {
            return None;
        }
        Money::new(self.amount.checked_sub(other.amount)?, self.currency).ok()
    }

    /// `quantity` times this amount; `None` beyond [`MAX_AMOUNT`].
    pub fn times(&self, quantity: u32) -> Option<Money> {
        Money::new(
            self.amount.checked_mul(Decimal::from(quantity))?,
            self.currency,
        )
        .ok()
    }

    pub fn zero(currency: Currency) -> Money {
        Money {
            amount: Decimal::new(0, currency.exponent()),
            currency,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.amount.is_zero()
    }

    /// `percent` % of this amount, rounded half-even (banker's rounding) to the currency's
    /// minor unit.
    pub fn percent(&self, percent: Decimal) -> Option<Money> {
        let exact = self
            .amount
            .checked_mul(percent)?
            .checked_div(Decimal::ONE_HUNDRED)?;
        let rounded = exact.round_dp_with_strategy(
            self.currency.exponent(),
            rust_decimal::RoundingStrategy::MidpointNearestEven,
        );
        Money::new(rounded, self.currency).ok()
    }

    /// This amount's share `part / whole` (a refund's part that the seller bears, say), rounded
    /// half-even to the currency's minor unit.
    pub fn share(&self, part: &Money, whole: &Money) -> Option<Money> {
        if whole.amount.is_zero()
            || part.currency != self.currency
            || whole.currency != self.currency
        {
            return None;
        }
        let exact = self
            .amount
            .checked_mul(part.amount)?
            .checked_div(whole.amount)?;
        let rounded = exact.round_dp_with_strategy(
            self.currency.exponent(),
            rust_decimal::RoundingStrategy::MidpointNearestEven,
        );
        Money::new(rounded, self.currency).ok()
    }

    /// The smaller of two amounts of the same currency.
    pub fn min(self, other: Money) -> Money {
        if other.amount < self.amount {
            other
        } else {
            self
        }
    }

    /// The amount in minor units (cents, paise), as Stripe and Razorpay want it.
    pub fn minor_units(&self) -> Option<i64> {
        let mut m = self.amount;
        m.rescale(self.currency.exponent());
        i64::try_from(m.mantissa()).ok()
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Wire {
            amount: String,
            currency: String,
        }
        let w = Wire::deserialize(d)?;
        Money::parse(&w.amount, &w.currency).map_err(serde::de::Error::custom)
    }
}

impl Serialize for Money {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Money", 2)?;
        st.serialize_field("amount", &self.amount.to_string())?;
        st.serialize_field("currency", &self.currency)?;
        st.end()
    }
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.amount, self.currency)
    }
}

/// A stored amount as the API writes it: a decimal string with (at least) the currency's
/// minor-unit digits ("19.90", "500" for yen); as stored if the currency is unknown.
pub fn amount_text(value: Decimal, currency: &str) -> String {
    let mut v = value.normalize();
    if let Ok(c) = currency.parse::<Currency>() {
        v.rescale(c.exponent().max(v.scale()));
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minor_units_follow_the_currency_exponent() {
        assert_eq!(
            Money::from_minor(1990, "brl").unwrap().amount().to_string(),
            "19.90"
        );
        assert_eq!(
            Money::from_minor(500, "JPY").unwrap().amount().to_string(),
            "500"
        );
        assert_eq!(
            Money::from_minor(1500, "kwd").unwrap().amount().to_string(),
            "1.500"
        );
    }

    #[test]
    fn bad_amounts_and_currencies_are_refused() {
        assert!(matches!(
            Money::parse("19.901", "BRL"),
            Err(MoneyError::Precision(..))
        ));
        assert!(matches!(
            Money::parse("-1", "BRL"),
            Err(MoneyError::Negative(_))
        ));
        assert!(matches!(
            Money::parse("abc", "BRL"),
            Err(MoneyError::Amount(_))
        ));
        assert!(matches!(
            Money::parse("1", "R$"),
            Err(MoneyError::Currency(_))
        ));
        assert_eq!(
            Money::parse("19.90", "brl").unwrap().to_string(),
            "19.90 BRL"
        );
        // Written with the currency's digits, however the input was.
        assert_eq!(
            Money::parse("19.9", "BRL").unwrap().to_string(),
            "19.90 BRL"
        );
        assert_eq!(
            Money::parse("10.0000", "BRL").unwrap().to_string(),
            "10.00 BRL"
        );
        assert_eq!(Money::parse("500.0", "JPY").unwrap().to_string(), "500 JPY");
        assert!(matches!(
            Money::parse("1000000000000", "BRL"),
            Err(MoneyError::TooLarge(_))
        ));
        assert!(Money::parse("999999999999.99", "BRL").is_ok());
        // Only plain decimals: rust_decimal's parser alone would take each of these (the last
        // rounded to 1.00).
        for odd in [
            "1e2",
            "1E2",
            "1_000",
            "+5",
            "5.",
            ".5",
            "1.2.3",
            "0x10",
            "",
            "-",
            "0.999999999999999999999999999999",
        ] {
            assert!(
                matches!(Money::parse(odd, "BRL"), Err(MoneyError::Amount(_))),
                "{odd:?}: {:?}",
                Money::parse(odd, "BRL")
            );
        }
        assert_eq!(
            Money::parse(" 7.5 ", "BRL").unwrap().to_string(),
            "7.50 BRL"
        );
    }

    #[test]
    fn the_limit_is_a_trillion() {
        assert_eq!(MAX_AMOUNT, Decimal::from(1_000_000_000_000i64));
    }

    #[test]
    fn percentages_round_half_even_to_the_minor_unit() {
        let fee = |amount: &str, currency: &str, pct: &str| {
            Money::parse(amount, currency)
                .unwrap()
                .percent(pct.parse().unwrap())
                .unwrap()
                .to_string()
        };
        // 10 % of 0.25 is 0.025: half-way, to the even cent.
        assert_eq!(fee("0.25", "BRL", "10"), "0.02 BRL");
        assert_eq!(fee("0.35", "BRL", "10"), "0.04 BRL");
        assert_eq!(fee("19.90", "BRL", "10"), "1.99 BRL");
        assert_eq!(fee("1005", "JPY", "10"), "100 JPY");
        assert_eq!(fee("1015", "JPY", "10"), "102 JPY");
        assert_eq!(fee("1.005", "KWD", "50"), "0.502 KWD");
        assert_eq!(fee("10.00", "BRL", "0"), "0.00 BRL");
        assert_eq!(
            Money::parse("19.90", "BRL").unwrap().minor_units(),
            Some(1990)
        );
        assert_eq!(Money::parse("500", "JPY").unwrap().minor_units(), Some(500));
    }
}
