//! Mercado Pago's signing scheme: the signed manifest names the resource, not the body.

use std::borrow::Cow;

use crate::gateways::signature::{SignatureError, any_matches, malformed, pairs, within};
use crate::secret::hmac_sha256;

/// `data.id` as the manifest signs it: Mercado Pago lowercases an alphanumeric id before
/// signing, so `ABC123` and `abc123` carry the same signature. Whatever names a delivery (its
/// event id) must use this form too, or one signed notification could be stored once per
/// spelling of its id.
pub fn signed_data_id(id: &str) -> Cow<'_, str> {
    if id.chars().all(|c| c.is_ascii_alphanumeric()) {
        Cow::Owned(id.to_ascii_lowercase())
    } else {
        Cow::Borrowed(id)
    }
}

/// Mercado Pago: `x-signature: ts=<ts>,v1=<hex>` over the manifest
/// `id:{data.id};request-id:{x-request-id};ts:{ts};`, leaving out the parts that are missing.
/// `ts` is in milliseconds. The body is not signed.
pub fn mercadopago(
    secret: &str,
    x_signature: Option<&str>,
    request_id: Option<&str>,
    data_id: Option<&str>,
    now: i64,
    tolerance: i64,
) -> Result<(), SignatureError> {
    const H: &str = "x-signature";
    let header = x_signature.ok_or(SignatureError::MissingHeader(H))?;
    let mut ts: Option<&str> = None;
    let mut v1: Option<&str> = None;
    for (k, v) in pairs(header, H)? {
        match k {
            "ts" => ts = Some(v),
            "v1" => v1 = Some(v),
            _ => {}
        }
    }
    let ts = ts.ok_or(malformed(H, "no ts"))?;
    let v1 = v1.ok_or(malformed(H, "no v1 signature"))?;
    let ts_ms: i64 = ts
        .parse()
        .map_err(|_| malformed(H, "ts is not an integer"))?;
    if !within(ts_ms / 1000, now, tolerance) {
        return Err(SignatureError::Timestamp(tolerance));
    }
    let data_id = data_id.filter(|s| !s.is_empty());
    let request_id = request_id.filter(|s| !s.is_empty());
    if data_id.is_some_and(|d| d.len() > 256) || request_id.is_some_and(|r| r.len() > 256) {
        return Err(malformed(
            H,
            "data.id or x-request-id longer than 256 bytes",
        ));
    }
    let mut manifest = String::new();
    if let Some(id) = data_id {
        manifest.push_str(&format!("id:{};", signed_data_id(id)));
    }
    if let Some(rid) = request_id {
        manifest.push_str(&format!("request-id:{rid};"));
    }
    manifest.push_str(&format!("ts:{ts};"));
    let sig = hex::decode(v1).map_err(|_| SignatureError::Mismatch(H))?;
    let want = hmac_sha256(secret.as_bytes(), &[manifest.as_bytes()]);
    if !any_matches(&want, [sig.as_slice()]) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::signature::hex_hmac;
    const DAY: i64 = 86_400;

    #[test]
    fn mercadopago_vector() {
        let ts = 1742505638683i64;
        let header =
            "ts=1742505638683,v1=85aaea44adced84bf23e95db43da124f818caad473052e8d0ecd46c5319c231e";
        let rid = Some("bb56a2f1-6aae-46ac-982e-9dcd3581d08e");
        let now = ts / 1000;
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123456"),
                now,
                300
            ),
            Ok(())
        );
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123457"),
                now,
                300
            ),
            Err(SignatureError::Mismatch("x-signature"))
        );
        assert_eq!(
            mercadopago(
                "v1-test-secret-not-a-real-key",
                Some(header),
                rid,
                Some("123456"),
                now + DAY,
                300
            ),
            Err(SignatureError::Timestamp(300))
        );
    }

    #[test]
    fn mercadopago_lowercases_alphanumeric_ids_and_omits_missing_parts() {
        let manifest = "id:abc123;ts:1700000000000;";
        let header = format!(
            "ts=1700000000000,v1={}",
            hex_hmac(b"s", &[manifest.as_bytes()])
        );
        assert_eq!(
            mercadopago("s", Some(&header), None, Some("ABC123"), 1700000000, 300),
            Ok(())
        );
    }
}
