//! The provider's truth about a payment, derived from every fact known about it: what event
//! processing records (`payments`) and what the order shows beside its own state (`orders`).
//! The derivation depends on which facts are known, never on the order they arrived in.

use rust_decimal::Decimal;

use crate::gateways::DisputeStatus;

payfleet_queue::text_enum! {
    /// `payment_orders.status`.
    pub enum PaymentOrderStatus {
        Pending = "pending",
        Succeeded = "succeeded",
        Failed = "failed",
        PartiallyRefunded = "partially_refunded",
        Refunded = "refunded",
        Disputed = "disputed",
        ChargedBack = "charged_back",
    }
}

impl PaymentOrderStatus {
    /// Every state past a success means the money was taken once.
    pub fn implies_paid(&self) -> bool {
        !matches!(self, Self::Pending | Self::Failed)
    }
}

/// Facts known about a payment, whatever order they arrived in. Refunds and disputes are only
/// recorded against a payment known to have succeeded (an early one waits for it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    pub succeeded: bool,
    pub failed: bool,
    pub amount: Option<Decimal>,
    pub refunded: Decimal,
    pub disputes: Vec<DisputeStatus>,
}

/// A lost dispute, then an open one, then refunds, then success or failure. Disputes closed in
/// the seller's favour or by a refund leave the status to the other facts.
pub fn derive_status(f: &Facts) -> PaymentOrderStatus {
    if f.disputes.contains(&DisputeStatus::Lost) {
        PaymentOrderStatus::ChargedBack
    } else if f.disputes.contains(&DisputeStatus::Open) {
        PaymentOrderStatus::Disputed
    } else if f.refunded > Decimal::ZERO {
        match f.amount {
            Some(a) if f.refunded >= a => PaymentOrderStatus::Refunded,
            _ => PaymentOrderStatus::PartiallyRefunded,
        }
    } else if f.succeeded {
        PaymentOrderStatus::Succeeded
    } else if f.failed {
        PaymentOrderStatus::Failed
    } else {
        PaymentOrderStatus::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        s.parse().unwrap()
    }

    fn paid(amount: &str) -> Facts {
        Facts {
            succeeded: true,
            amount: Some(d(amount)),
            ..Facts::default()
        }
    }

    #[test]
    fn refunds_partial_and_whole() {
        let whole = Facts {
            refunded: d("10"),
            ..paid("10")
        };
        assert_eq!(derive_status(&whole), PaymentOrderStatus::Refunded);
        let partial = Facts {
            refunded: d("4"),
            ..paid("10")
        };
        assert_eq!(
            derive_status(&partial),
            PaymentOrderStatus::PartiallyRefunded
        );
    }

    #[test]
    fn a_late_failure_never_undoes_a_success() {
        let failed_then_paid = Facts {
            failed: true,
            ..paid("10")
        };
        assert_eq!(
            derive_status(&failed_then_paid),
            PaymentOrderStatus::Succeeded
        );
    }

    #[test]
    fn disputes_hold_until_decided_and_only_a_loss_charges_back() {
        let open = Facts {
            disputes: vec![DisputeStatus::Open],
            ..paid("10")
        };
        assert_eq!(derive_status(&open), PaymentOrderStatus::Disputed);
        let won = Facts {
            disputes: vec![DisputeStatus::Won],
            ..paid("10")
        };
        assert_eq!(derive_status(&won), PaymentOrderStatus::Succeeded);
        let lost = Facts {
            disputes: vec![DisputeStatus::Won, DisputeStatus::Lost],
            ..paid("10")
        };
        assert_eq!(derive_status(&lost), PaymentOrderStatus::ChargedBack);
        // Closed by a refund: the refund is what the payment shows.
        let refunded = Facts {
            disputes: vec![DisputeStatus::Refunded],
            refunded: d("10"),
            ..paid("10")
        };
        assert_eq!(derive_status(&refunded), PaymentOrderStatus::Refunded);
    }
}
