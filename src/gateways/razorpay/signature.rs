//! Razorpay's signing scheme: the raw body's HMAC.

use crate::gateways::signature::{SignatureError, any_matches, bounded};
use crate::secret::hmac_sha256;

/// Razorpay: `X-Razorpay-Signature` is the hex HMAC-SHA256 of the raw body.
pub fn razorpay(secret: &str, header: Option<&str>, body: &[u8]) -> Result<(), SignatureError> {
    const H: &str = "X-Razorpay-Signature";
    let header = header.ok_or(SignatureError::MissingHeader(H))?;
    bounded(H, header)?;
    let sig = hex::decode(header.trim()).map_err(|_| SignatureError::Mismatch(H))?;
    if sig.len() != 32 {
        return Err(SignatureError::Mismatch(H));
    }
    let want = hmac_sha256(secret.as_bytes(), &[body]);
    if !any_matches(&want, [sig.as_slice()]) {
        return Err(SignatureError::Mismatch(H));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::signature::hex_hmac;
    #[test]
    fn razorpay_signs_the_raw_body() {
        let body = b"{\"event\":\"payment.captured\"}\n";
        let sig = hex_hmac(b"rzp_secret", &[body]);
        assert_eq!(razorpay("rzp_secret", Some(&sig), body), Ok(()));
        // A trailing newline is part of what was signed.
        assert_eq!(
            razorpay("rzp_secret", Some(&sig), &body[..body.len() - 1]),
            Err(SignatureError::Mismatch("X-Razorpay-Signature"))
        );
        // The checkout payment signature vector uses the same primitive.
        assert_eq!(
            hex_hmac(b"key_secret", &[b"fake_order_id|fake_payment_id"]),
            "b2335e3b0801106b84a7faff035df56ecffde06918c9ddd1f0fafbb37a51cc89"
        );
    }
}
