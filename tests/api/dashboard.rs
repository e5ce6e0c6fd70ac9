//! The operator dashboard in a real headless Chromium: signing in, what it shows, its actions,
//! and that a page on another site cannot act through a signed-in operator's browser.

use sqlx::PgPool;

use crate::browser::Browser;
use crate::helpers::*;

struct Seeded {
    dead: i64,
    retrying: i64,
    event: i64,
}

/// A dead job, a job waiting to retry, a rejected event, a consistency finding and a failed
/// recurring run: what an operator comes to the dashboard for.
async fn seed(pool: &PgPool) -> Seeded {
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO jobs (queue, kind, key, state, attempt, max_attempts, finished_at, errors)
         VALUES ('payments', 'deliver_hosted_event', 'hosted:s1', 'discarded', 25, 25, now(),
                 '[{\"error\": \"gateway answered 502\"}]') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let retrying: i64 = sqlx::query_scalar(
        "INSERT INTO jobs (queue, kind, state, attempt, max_attempts, run_at, errors)
         VALUES ('ledger', 'carry_out_refund', 'retryable', 3, 25, now() + interval '1 hour',
                 '[{\"error\": \"connection refused\"}]') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let event: i64 = sqlx::query_scalar(
        "INSERT INTO payment_events (gateway, event_id, event_type, raw_body, outcome, outcome_detail)
         VALUES ('internal', 'evt_refund_1', 'refund.succeeded', '\\x', 'rejected',
                 'refund of 50.00 is larger than the payment of 10.00') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO consistency_findings (check_name, subject, detail)
         VALUES ('sale_without_credit', 'order 7', 'order 7 is confirmed without its ledger credit')",
    )
    .execute(pool)
    .await
    .unwrap();
    // A subscription whose renewal failed.
    sqlx::query(
        "WITH s AS (INSERT INTO sellers (name, payout_frequency, payout_minimum)
                    VALUES ('Club House', 'weekly', 0) RETURNING id),
              p AS (INSERT INTO products (seller_id, name, kind, price, currency, \"interval\")
                    SELECT id, 'club', 'subscription', 19.90, 'BRL', 'month' FROM s RETURNING id, seller_id),
              c AS (INSERT INTO checkouts (buyer_id, gateway) VALUES ('b', 'internal') RETURNING id),
              o AS (INSERT INTO orders (number, checkout_id, seller_id, buyer_id, kind, \"interval\", currency,
                                        subtotal, total, platform_fee, seller_net, gateway, expires_at)
                    SELECT 9001, c.id, p.seller_id, 'b', 'subscription', 'month', 'BRL', 19.90, 19.90,
                           1.99, 17.91, 'internal', now() FROM c, p RETURNING number, seller_id)
         INSERT INTO subscriptions (order_number, seller_id, buyer_id, product_id, gateway, \"interval\",
                                    amount, currency, status, current_period_start, current_period_end)
         SELECT o.number, o.seller_id, 'b', p.id, 'internal', 'month', 19.90, 'BRL', 'past_due',
                now() - interval '1 day', now() + interval '29 days' FROM o, p",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO recurring_runs (name, period, state, error, finished_at)
         VALUES ('payouts', now() - interval '1 day', 'failed', 'bank file refused', now())",
    )
    .execute(pool)
    .await
    .unwrap();
    Seeded {
        dead,
        retrying,
        event,
    }
}

async fn job_state(pool: &PgPool, id: i64) -> String {
    sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Writes the page's screenshot to `target/tmp/<name>` (docs/ keeps copies).
async fn save_screenshot(browser: &mut Browser, name: &str) {
    let shot = browser.screenshot().await;
    std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name),
        &shot,
    )
    .unwrap();
}

/// The page's text holds each of `wanted`.
async fn page_shows(browser: &mut Browser, what: &str, wanted: &[&str]) {
    let text = browser.text().await;
    for w in wanted {
        assert!(text.contains(w), "the {what} lacks {w:?}: {text}");
    }
}

/// A page on another site that posts a form to the dashboard as soon as it loads.
async fn forging_site(target: String) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let page = format!(
        "<!doctype html><form method=post action=\"{target}\"><input name=csrf value=guess></form>\
         <script>document.forms[0].submit()</script>"
    );
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || async move { axum::response::Html(page) }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_operator_signs_in_sees_what_is_stuck_and_re_drives_it(pool: PgPool) {
    let mut config = test_config();
    config.recurring = payfleet::recurring::Schedules::built_in().unwrap();
    let app = spawn_app_with(pool.clone(), config).await;
    let seeded = seed(&pool).await;
    let base = format!("http://{}", app.addr);
    let mut browser = Browser::start().await;

    // Not signed in: the sign-in form, nothing else.
    browser.open(&format!("{base}/admin/ui")).await;
    assert_eq!(
        browser
            .eval("!!document.querySelector('input[name=token]')")
            .await,
        true
    );
    assert_eq!(
        browser.eval("!!document.querySelector('#queues')").await,
        false
    );
    browser
        .fill("input[name=token]", "not-the-token-at-all")
        .await;
    browser.click("button[type=submit]").await;
    assert!(browser.text().await.contains("wrong admin token"));
    assert_eq!(
        browser.eval("!!document.querySelector('#queues')").await,
        false
    );

    browser.fill("input[name=token]", ADMIN_TOKEN).await;
    browser.click("button[type=submit]").await;
    let text = browser.text().await;
    assert!(text.contains("payfleet operations"), "{text}");
    // The session cookie is out of scripts' reach.
    assert_eq!(browser.eval("document.cookie").await, "");
    // Each section shows what was seeded into it.
    for (id, wanted) in [
        ("queues", &["payments", "ledger"][..]),
        (
            "failed-jobs",
            &["gateway answered 502", "connection refused"][..],
        ),
        ("events", &["evt_refund_1", "larger than the payment"][..]),
        ("recurring", &["payouts", "failed", "invoices"][..]),
        ("findings", &["sale_without_credit"][..]),
        ("past-due", &["9001", "19.90 BRL"][..]),
    ] {
        let text = browser
            .eval(&format!("document.getElementById('{id}')?.innerText ?? ''"))
            .await
            .as_str()
            .unwrap()
            .to_owned();
        for w in wanted {
            assert!(text.contains(w), "#{id} lacks {w:?}: {text}");
        }
    }
    let shot = browser.screenshot().await;
    assert_eq!(&shot[..8], b"\x89PNG\r\n\x1a\n");
    std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png"),
        &shot,
    )
    .unwrap();

    // Re-driving: the dead job runs again, the retrying one is given up, the event replayed.
    browser.click(&format!("#job-{} button", seeded.dead)).await;
    assert!(
        browser
            .text()
            .await
            .contains(&format!("job {} will run again now", seeded.dead))
    );
    assert_eq!(job_state(&pool, seeded.dead).await, "available");
    browser
        .click(&format!(
            "#job-{} form[action$='/discard'] button",
            seeded.retrying
        ))
        .await;
    assert_eq!(job_state(&pool, seeded.retrying).await, "discarded");
    browser
        .click(&format!("#event-{} button", seeded.event))
        .await;
    assert!(browser.text().await.contains("queued for processing"));
    let replayed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE key = 'payment_event:internal:evt_refund_1' AND state = 'available'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(replayed, 1);
    // Acting on what cannot be acted on says why and changes nothing.
    browser
        .click(&format!("#job-{} button", seeded.retrying))
        .await;
    assert_eq!(job_state(&pool, seeded.retrying).await, "available");
    browser.open(&format!("{base}/admin/ui")).await;

    // Another site (localhost is not 127.0.0.1) posts to the dashboard from this signed-in
    // browser: the cookie is not sent (SameSite=Strict), and the guess of a CSRF token would
    // not do either. Nothing changes.
    let victim = seeded.retrying;
    sqlx::query("UPDATE jobs SET state = 'discarded', finished_at = now() WHERE id = $1")
        .bind(victim)
        .execute(&pool)
        .await
        .unwrap();
    let evil = forging_site(format!("{base}/admin/ui/jobs/{victim}/retry")).await;
    browser
        .open(&format!("http://localhost:{}/", evil.port()))
        .await;
    // The auto-submitted form's answer.
    for _ in 0..50 {
        if browser.text().await.contains("sign in first") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(browser.text().await.contains("sign in first"));
    assert_eq!(job_state(&pool, victim).await, "discarded");

    // Signing out ends the session.
    browser.open(&format!("{base}/admin/ui")).await;
    browser
        .click("form[action='/admin/ui/sign-out'] button")
        .await;
    browser.open(&format!("{base}/admin/ui")).await;
    assert_eq!(
        browser
            .eval("!!document.querySelector('input[name=token]')")
            .await,
        true
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_form_without_its_csrf_token_changes_nothing_even_with_the_cookie(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let seeded = seed(&pool).await;
    let base = format!("http://{}", app.addr);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = http
        .post(format!("{base}/admin/ui/session"))
        .form(&[("token", ADMIN_TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), 303);
    let set_cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    for attribute in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/admin/ui",
        "Max-Age=28800",
    ] {
        assert!(set_cookie.contains(attribute), "{set_cookie}");
    }
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    let retry = format!("{base}/admin/ui/jobs/{}/retry", seeded.dead);
    for form in [vec![], vec![("csrf", "0".repeat(64))]] {
        let answer = http
            .post(&retry)
            .header("cookie", &cookie)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 403);
    }
    assert_eq!(job_state(&pool, seeded.dead).await, "discarded");
    // A tampered cookie is no session.
    let tampered = cookie.replacen("payfleet_session=", "payfleet_session=9", 1);
    let page = http
        .get(format!("{base}/admin/ui"))
        .header("cookie", tampered)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("name=\"token\"") && !page.contains("id=\"queues\""));
    // A link cannot put words on the dashboard: only an action's own notice is shown.
    let answer = http
        .get(format!(
            "{base}/admin/ui?done=the%20admin%20token%20was%20rotated%2C%20sign%20in%20at%20evil.example"
        ))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let page = answer.text().await.unwrap();
    assert!(
        page.contains("id=\"queues\"") && !page.contains("Done:") && !page.contains("evil"),
        "{page}"
    );
    // With the page's own token it is done.
    let page = http
        .get(format!("{base}/admin/ui"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_owned();
    // No such action: a 404 page, nothing done.
    let answer = http
        .post(format!("{base}/admin/ui/jobs/{}/delete", seeded.retrying))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 404);
    assert_eq!(job_state(&pool, seeded.retrying).await, "retryable");
    let answer = http
        .post(&retry)
        .header("cookie", &cookie)
        .form(&[("csrf", csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 303);
    assert_eq!(job_state(&pool, seeded.dead).await, "available");
    // Back to the dashboard, which says once what was done.
    assert_eq!(answer.headers()["location"], "/admin/ui");
    let notice = answer.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        notice.starts_with("payfleet_notice=") && notice.contains("SameSite=Strict"),
        "{notice}"
    );
    let notice = notice.split(';').next().unwrap().to_owned();
    // One planted by anyone else (a sibling subdomain's cookie, one set over plain http) carries
    // no signature of the session's: no notice.
    for planted in [
        format!(
            "payfleet_notice={}",
            hex::encode("sign in again at evil.example")
        ),
        format!(
            "payfleet_notice={}.{}",
            hex::encode("sign in again at evil.example"),
            "0".repeat(64)
        ),
    ] {
        let page = http
            .get(format!("{base}/admin/ui"))
            .header("cookie", format!("{cookie}; {planted}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            page.contains("id=\"queues\"") && !page.contains("Done:"),
            "{page}"
        );
    }
    let shown = http
        .get(format!("{base}/admin/ui"))
        .header("cookie", format!("{cookie}; {notice}"))
        .send()
        .await
        .unwrap();
    let cleared = shown.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cleared.starts_with("payfleet_notice=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );
    let page = shown.text().await.unwrap();
    assert!(
        page.contains(&format!("Done: job {} will run again now", seeded.dead)),
        "{page}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn without_an_admin_token_the_dashboard_is_off(pool: PgPool) {
    let mut config = test_config();
    config.admin_token = None;
    let app = spawn_app_with(pool, config).await;
    let (status, body) = app.get("/admin/ui").await;
    assert_eq!(status, 403);
    assert!(body.contains("PAYFLEET_ADMIN_TOKEN"));
    let answer = app
        .http
        .post(format!("http://{}/admin/ui/session", app.addr))
        .form(&[("token", "")])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 403);
}

/// As an operator works: from a dead job to its page (its arguments, each attempt's error) and
/// its retry; from an order number to the order's page (its journey, its payment, its ledger
/// transfers); jobs filtered by queue and state.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_operator_opens_a_dead_job_and_retries_it_and_follows_an_order_to_its_ledger(
    pool: PgPool,
) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    let number = order["number"].as_i64().unwrap();
    let url = order["payment"]["url"].as_str().unwrap();
    assert_eq!(shop.app.pay(url, "succeeded").await.0, 200);
    wait_for(
        "the order to be paid and its sale posted",
        std::time::Duration::from_secs(20),
        async || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM ledger_transfers WHERE order_number = $1 AND kind = 'sale_credit'",
            )
            .bind(number)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO jobs (queue, kind, key, state, attempt, max_attempts, finished_at, payload, errors)
         VALUES ('payments', 'deliver_hosted_event', 'hosted_event:evt_lost', 'discarded', 3, 3, now(),
                 '{\"id\": \"evt_lost\"}',
                 '[{\"attempt\": 1, \"at\": \"2026-12-01T10:00:00Z\", \"worker\": \"w-1\", \"error\": \"receiver answered 502\"},
                   {\"attempt\": 3, \"at\": \"2026-12-01T10:05:00Z\", \"worker\": \"w-2\", \"error\": \"receiver timed out\"}]')
         RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    let base = format!("http://{}", shop.app.addr);
    let mut browser = Browser::start().await;
    browser.open(&format!("{base}/admin/ui")).await;
    browser.fill("input[name=token]", ADMIN_TOKEN).await;
    browser.click("button[type=submit]").await;

    // The dead job, opened from the dashboard's failed jobs.
    browser.click(&format!("#job-{dead} a")).await;
    page_shows(
        &mut browser,
        "job page",
        &[
            "evt_lost",
            "receiver answered 502",
            "receiver timed out",
            "w-2",
            "discarded",
            "3 of 3",
        ],
    )
    .await;
    save_screenshot(&mut browser, "dashboard-job.png").await;
    browser
        .click("#job-actions form[action$='/retry'] button")
        .await;
    assert!(
        browser
            .text()
            .await
            .contains(&format!("job {dead} will run again now"))
    );
    // The fleet runs it at once: one more attempt (its event is still lost, so it fails again),
    // whose failure is written when the run ends (after the attempt is counted, at its claim).
    wait_for(
        "the retried job to run once more and its failure to be written",
        std::time::Duration::from_secs(20),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT attempt = 4 AND jsonb_array_length(errors) = 3 FROM jobs WHERE id = $1",
            )
            .bind(dead)
            .fetch_one(&pool)
            .await
            .unwrap()
        },
    )
    .await;

    // The hour's chart counts the payment event received and the retried job's new failure.
    browser.open(&format!("{base}/admin/ui")).await;
    assert_eq!(
        browser.eval("!!document.querySelector('svg#hour')").await,
        true
    );
    let totals = browser
        .eval("document.getElementById('hour-totals')?.innerText ?? ''")
        .await
        .as_str()
        .unwrap()
        .to_owned();
    let count = |what: &str| -> i64 {
        let before = totals.split(what).next().unwrap_or_default();
        before
            .split_whitespace()
            .last()
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1)
    };
    assert!(count(" events received") >= 1, "{totals}");
    assert!(count(" processed") >= 1, "{totals}");
    assert!(count(" failures") >= 1, "{totals}");

    // The queue paused and resumed from the dashboard.
    browser
        .click("#queue-payments form[action$='/pause'] button")
        .await;
    assert!(browser.text().await.contains("queue payments is paused"));
    let paused: Vec<String> = sqlx::query_scalar("SELECT queue FROM queue_pauses")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(paused, ["payments"]);
    browser
        .click("#queue-payments form[action$='/resume'] button")
        .await;
    assert!(browser.text().await.contains("queue payments is resumed"));
    let paused: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_pauses")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(paused, 0);

    // Jobs filtered by queue and key find it.
    browser
        .open(&format!(
            "{base}/admin/ui/jobs?queue=payments&key=hosted_event:evt"
        ))
        .await;
    let text = browser
        .eval("document.getElementById('jobs')?.innerText ?? ''")
        .await;
    assert!(
        text.as_str().unwrap().contains("deliver_hosted_event"),
        "{text}"
    );

    // The order, by its number, down to its ledger transfers.
    browser.open(&format!("{base}/admin/ui")).await;
    browser
        .fill("#order-lookup input[name=number]", &number.to_string())
        .await;
    browser.click("#order-lookup button").await;
    for (id, wanted) in [
        ("order", &["paid", "20.00", "BRL"][..]),
        ("journey", &["created", "paid"][..]),
        ("payments", &["succeeded"][..]),
        (
            "ledger",
            &["sale_credit", "seller_pending", "fee", "platform_revenue"][..],
        ),
    ] {
        let text = browser
            .eval(&format!("document.getElementById('{id}')?.innerText ?? ''"))
            .await
            .as_str()
            .unwrap()
            .to_owned();
        for w in wanted {
            assert!(text.contains(w), "#{id} lacks {w:?}: {text}");
        }
    }
    save_screenshot(&mut browser, "dashboard-order.png").await;

    // On to its seller: balances, the ledger's entries, payouts, invoices.
    browser.click("#order a[href^='/admin/ui/sellers/']").await;
    page_shows(
        &mut browser,
        "seller page",
        &["Seller S", "18.00", "sale_credit", "No payouts."],
    )
    .await;
    save_screenshot(&mut browser, "dashboard-seller.png").await;

    // And the payment event that confirmed it, as the gateway signed it.
    let event: i64 = sqlx::query_scalar(
        "SELECT id FROM payment_events WHERE event_type = 'payment.succeeded' ORDER BY id LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    browser
        .open(&format!("{base}/admin/ui/events/{event}"))
        .await;
    page_shows(
        &mut browser,
        "event page",
        &["payment.succeeded", "applied", "webhook-id", "Processed"],
    )
    .await;
}

/// Signing out ends the session itself, not only its cookie in that browser: a copy of the
/// cookie (another tab's, a proxy's log, a stolen one) is no session afterwards, while another
/// session of the same operator goes on.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_signed_out_sessions_cookie_is_no_session_even_copied(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let base = format!("http://{}", app.addr);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let sign_in = async || {
        let signed_in = http
            .post(format!("{base}/admin/ui/session"))
            .form(&[("token", ADMIN_TOKEN)])
            .send()
            .await
            .unwrap();
        assert_eq!(signed_in.status(), 303);
        signed_in.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_owned()
    };
    let page = async |cookie: &str| {
        http.get(format!("{base}/admin/ui"))
            .header("cookie", cookie)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let copied = sign_in().await;
    let other = sign_in().await;
    let dashboard = page(&copied).await;
    assert!(dashboard.contains("id=\"queues\""), "{dashboard}");
    let csrf = dashboard
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_owned();
    let out = http
        .post(format!("{base}/admin/ui/sign-out"))
        .header("cookie", &copied)
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 200);
    let after = page(&copied).await;
    assert!(
        after.contains("name=\"token\"") && !after.contains("id=\"queues\""),
        "{after}"
    );
    assert!(page(&other).await.contains("id=\"queues\""));
}
