//! Plain server-rendered pages: escaping and the page around a body.

/// Text made safe for HTML content and attribute values.
pub(super) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// A page titled `title` (escaped here) around `body` (already HTML), with its own `css`.
pub(super) fn page(title: &str, css: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title>\
         <style>{css}</style></head><body><h1>{t}</h1>{body}</body></html>",
        t = escape(title)
    )
}

/// A form posted from one of our own pages: no browser sends another site's origin as ours. A
/// request without `Origin` and `Sec-Fetch-Site` (not a browser's) passes: what it carries (a
/// form token, a credential) still decides.
pub(super) fn same_origin(headers: &axum::http::HeaderMap, public_url: &str) -> bool {
    let ours = reqwest::Url::parse(public_url).map(|u| u.origin().ascii_serialization());
    let origin_ok = match (headers.get("origin").map(|v| v.to_str()), &ours) {
        (None, _) => true,
        (Some(Ok(origin)), Ok(ours)) => {
            reqwest::Url::parse(origin).is_ok_and(|o| o.origin().ascii_serialization() == *ours)
        }
        _ => false,
    };
    let site_ok = !matches!(
        headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()),
        Some("cross-site" | "same-site")
    );
    origin_ok && site_ok
}
