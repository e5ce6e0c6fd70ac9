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
