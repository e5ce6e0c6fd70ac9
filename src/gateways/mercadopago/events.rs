//! Mercado Pago. A notification only names a resource (`data.id`) and its body is not signed,
//! so the payment's state is fetched from the API before anything is recorded.

use serde_json::Value;

use crate::gateways::{EventError, Interpretation, LookupResource, PaymentStatus};

/// Payment `status`.
pub fn payment_status(s: &str) -> PaymentStatus {
    match s {
        "approved" | "refunded" | "charged_back" | "in_mediation" => PaymentStatus::Succeeded,
        "rejected" | "cancelled" => PaymentStatus::Failed,
        _ => PaymentStatus::Pending,
    }
}

pub fn interpret(body: &[u8]) -> Result<Interpretation, EventError> {
    let v: Value = serde_json::from_slice(body)?;
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
    let resource = match kind {
        "payment" => LookupResource::Payment,
        "subscription_authorized_payment" => LookupResource::AuthorizedPayment,
        "subscription_preapproval" => LookupResource::Preapproval,
        _ => {
            return Ok(Interpretation::Ignore(format!(
                "notification type {kind:?} is not acted on"
            )));
        }
    };
    let id = match v.get("data").and_then(|d| d.get("id")) {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => return Err(EventError::Missing("data.id")),
    };
    Ok(Interpretation::Lookup {
        resource,
        resource_id: id,
    })
}
