//! Security and limits: tokens and scopes, per-token rate limits, queue-depth overflow, the
//! disk high-water mark, webhook signatures, and safe defaults.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

fn auth_config() -> String {
    format!(
        r#"
[[auth.tokens]]
name = "ops"
sha256 = "{}"
scopes = ["admin"]

[[auth.tokens]]
name = "shop"
sha256 = "{}"
scopes = ["ingest:order.*", "dlq:erp"]
rate_per_sec = 5

[[auth.tokens]]
name = "viewer"
sha256 = "{}"
scopes = ["read"]
"#,
        token_sha256("ops-token"),
        token_sha256("shop-token"),
        token_sha256("viewer-token")
    )
}

async fn call(
    r: &RouterProc,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = client().request(method.parse().expect("method"), r.url(path));
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    if let Some(b) = body {
        rb = rb
            .header("content-type", "application/cloudevents+json")
            .body(b.to_string());
    }
    let resp = rb.send().await.expect("send");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// Every route × no token / wrong token / out of scope / in scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auth_matrix() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("orders", "order.paid", &rcv.url(), "erp");
    // A second team's target, so that its redrive below names a target the router knows.
    let crm = webhook_rule("users", "user.created", &rcv.url(), "crm");
    let r = RouterProc::start_full(
        &[("r.yaml", &rules), ("crm.yaml", &crm)],
        &[],
        &[],
        Some(&auth_config()),
    );
    let ev = event("a1", "order.paid", json!({}));
    // (method, path, body, token in scope, token out of scope)
    let cases: Vec<(&str, &str, Option<Value>, &str, &str)> = vec![
        (
            "POST",
            "/v1/events",
            Some(ev.clone()),
            "shop-token",
            "viewer-token",
        ),
        (
            "GET",
            "/v1/events/a1?source=/test",
            None,
            "viewer-token",
            "shop-token",
        ),
        ("GET", "/v1/targets", None, "viewer-token", "shop-token"),
        ("GET", "/v1/targets/erp", None, "viewer-token", "shop-token"),
        ("GET", "/v1/rules", None, "viewer-token", "shop-token"),
        ("GET", "/v1/status", None, "viewer-token", "shop-token"),
        ("GET", "/metrics", None, "viewer-token", "shop-token"),
        ("GET", "/v1/dlq", None, "viewer-token", "shop-token"),
        (
            "GET",
            "/v1/dlq?target=erp",
            None,
            "shop-token",
            "viewer-token-wrong-scope-placeholder",
        ),
        ("GET", "/v1/dlq/summary", None, "viewer-token", "shop-token"),
        (
            "POST",
            "/v1/targets/erp/pause",
            None,
            "ops-token",
            "viewer-token",
        ),
        (
            "POST",
            "/v1/targets/erp/resume",
            None,
            "ops-token",
            "shop-token",
        ),
        (
            "POST",
            "/v1/admin/reload",
            None,
            "ops-token",
            "viewer-token",
        ),
        (
            "POST",
            "/v1/rules/orders/disable",
            None,
            "ops-token",
            "shop-token",
        ),
        (
            "POST",
            "/v1/rules/orders/enable",
            None,
            "ops-token",
            "viewer-token",
        ),
    ];
    for (m, path, body, good, bad) in cases {
        let (s, _) = call(&r, m, path, None, body.clone()).await;
        assert_eq!(s, 401, "{m} {path} without a token");
        let (s, _) = call(&r, m, path, Some("nope"), body.clone()).await;
        assert_eq!(s, 401, "{m} {path} with a wrong token");
        if !bad.ends_with("placeholder") {
            let (s, b) = call(&r, m, path, Some(bad), body.clone()).await;
            assert_eq!(s, 403, "{m} {path} out of scope: {b}");
            assert!(
                b["errors"][0]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("lacks scope"),
                "{b}"
            );
        }
        let (s, b) = call(&r, m, path, Some(good), body.clone()).await;
        assert!((200..300).contains(&s), "{m} {path} in scope: {s} {b}");
    }
    // Health probes need no token.
    assert_eq!(call(&r, "GET", "/healthz", None, None).await.0, 200);
    // Ingest scope is per event type; nothing is stored on a 403.
    let (s, b) = call(
        &r,
        "POST",
        "/v1/events",
        Some("shop-token"),
        Some(event("u1", "user.created", json!({}))),
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("ingest:user.created")
    );
    assert_eq!(
        call(
            &r,
            "GET",
            "/v1/events/u1?source=/test",
            Some("ops-token"),
            None
        )
        .await
        .0,
        404
    );
    // DLQ scope: a team can never redrive another team's dead letters.
    let redrive = |target: &str| json!({"filter": {"target": target}, "rate_per_sec": 5});
    let (s, _) = call(
        &r,
        "POST",
        "/v1/dlq/redrive",
        Some("shop-token"),
        Some(redrive("crm")),
    )
    .await;
    assert_eq!(s, 403);
    let (s, _) = call(
        &r,
        "POST",
        "/v1/dlq/redrive",
        Some("shop-token"),
        Some(json!({"rate_per_sec": 5})),
    )
    .await;
    assert_eq!(s, 403, "a redrive without a target filter is admin-only");
    let (s, b) = call(
        &r,
        "POST",
        "/v1/dlq/redrive",
        Some("shop-token"),
        Some(redrive("erp")),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    // The team follows its own job, and sees only its own jobs; another target's job is not
    // its to read.
    let own = b["id"].as_str().expect("job id").to_string();
    let (s, b) = call(
        &r,
        "POST",
        "/v1/dlq/redrive",
        Some("ops-token"),
        Some(redrive("crm")),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    let other = b["id"].as_str().expect("job id").to_string();
    let path = format!("/v1/dlq/redrive/{own}");
    let (s, b) = call(&r, "GET", &path, Some("shop-token"), None).await;
    assert_eq!((s, b["id"].as_str()), (200, Some(own.as_str())), "{b}");
    let (s, b) = call(
        &r,
        "GET",
        &format!("/v1/dlq/redrive/{other}"),
        Some("shop-token"),
        None,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(
        !b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("crm"),
        "another team's target is not named: {b}"
    );
    let (s, b) = call(&r, "GET", "/v1/dlq/redrive", Some("shop-token"), None).await;
    assert_eq!(s, 200, "{b}");
    let ids: Vec<&str> = b["jobs"].as_array().map_or(Vec::new(), |j| {
        j.iter().filter_map(|j| j["id"].as_str()).collect()
    });
    assert_eq!(ids, [own.as_str()], "{b}");
    let (s, b) = call(&r, "GET", "/v1/dlq/redrive", Some("viewer-token"), None).await;
    assert_eq!(
        (s, b["jobs"].as_array().map(Vec::len)),
        (200, Some(2)),
        "{b}"
    );
    // Controlling another team's job is refused without naming its target, and a job that
    // does not exist (yet) is 404: nothing is changed unchecked, so a token cannot cancel the
    // next job id before an administrator creates it.
    let (s, b) = call(
        &r,
        "POST",
        &format!("/v1/dlq/redrive/{other}/cancel"),
        Some("shop-token"),
        None,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(!b.to_string().contains("crm"), "{b}");
    let (s, b) = call(
        &r,
        "POST",
        "/v1/dlq/redrive/redrive-999/cancel",
        Some("shop-token"),
        None,
    )
    .await;
    // A missing job gets the same 403 as another team's: a team token learns nothing of
    // which jobs exist.
    assert_eq!(
        (s, b["errors"][0]["pointer"].as_str()),
        (403, Some("/authorization")),
        "{b}"
    );
    let (s, b) = call(
        &r,
        "GET",
        &format!("/v1/dlq/redrive/{other}"),
        Some("ops-token"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_ne!(b["state"], "cancelled", "{b}");
    // A replay job is not a redrive job: not found under /v1/dlq/redrive (for a team token,
    // the same 403 as any job it cannot see).
    let (s, b) = call(
        &r,
        "POST",
        "/v1/replay",
        Some("ops-token"),
        Some(json!({"from": "2026-01-01T00:00:00Z", "to": "2026-01-01T00:00:01Z", "rate_per_sec": 1})),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    let replay = b["id"].as_str().expect("job id").to_string();
    for token in ["shop-token", "ops-token"] {
        let (s, b) = call(
            &r,
            "POST",
            &format!("/v1/dlq/redrive/{replay}/cancel"),
            Some(token),
            None,
        )
        .await;
        let want = if token == "shop-token" { 403 } else { 404 };
        assert_eq!(s, want, "{token}: {b}");
    }
    // The changes take no query parameters: an option sent there is refused, not ignored.
    let (s, b) = call(
        &r,
        "POST",
        "/v1/dlq/purge?dry_run=true",
        Some("ops-token"),
        Some(json!({"filter": {"target": "erp"}})),
    )
    .await;
    assert_eq!(
        (s, b["errors"][0]["pointer"].as_str()),
        (400, Some("/dry_run")),
        "{b}"
    );
    // The Bearer scheme is case-insensitive; HEAD needs what GET needs.
    let c = client();
    for scheme in ["bearer", "BEARER"] {
        let resp = c
            .get(r.url("/v1/status"))
            .header("authorization", format!("{scheme} viewer-token"))
            .send()
            .await
            .expect("status");
        assert_eq!(resp.status(), 200, "{scheme}");
    }
    let resp = c
        .head(r.url("/v1/status"))
        .header("authorization", "Bearer viewer-token")
        .send()
        .await
        .expect("head");
    assert_eq!(resp.status(), 200);
}

/// Producers confined to their own sources: one cannot claim another's (`source`, `id`), so it
/// cannot make the dedup window swallow that producer's next event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_confined_to_its_sources_cannot_claim_another_producers_ids() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("orders", "order.paid", &rcv.url(), "erp");
    let auth = format!(
        r#"
[[auth.tokens]]
name = "shop"
sha256 = "{}"
scopes = ["ingest:order.*", "ingest-source:/shop/*"]

[[auth.tokens]]
name = "crm"
sha256 = "{}"
scopes = ["ingest-source:/crm"]
"#,
        token_sha256("shop-token"),
        token_sha256("crm-token")
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&auth));
    let from = |source: &str, id: &str| json!({"specversion": "1.0", "id": id, "source": source, "type": "order.paid", "data": {}});
    // The shop token tries the CRM's next (source, id): refused, nothing stored.
    let (s, body) = call(
        &r,
        "POST",
        "/v1/events",
        Some("shop-token"),
        Some(from("/crm", "c-1")),
    )
    .await;
    assert_eq!(s, 403, "{body}");
    let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("ingest-source:/crm"), "{body}");
    // A batch with one foreign source is refused whole.
    let batch = json!([from("/shop/eu", "s-0"), from("/crm", "c-1")]);
    let resp = client()
        .post(r.url("/v1/events"))
        .bearer_auth("shop-token")
        .header("content-type", "application/cloudevents-batch+json")
        .body(batch.to_string())
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 403);
    // The CRM's own event with that id is accepted and delivered, not answered as a duplicate.
    let (s, body) = call(
        &r,
        "POST",
        "/v1/events",
        Some("crm-token"),
        Some(from("/crm", "c-1")),
    )
    .await;
    assert_eq!(s, 202, "{body}");
    assert_eq!(body["results"][0]["status"], "accepted", "{body}");
    // Each token's own sources pass; the shop's type scope still applies.
    let (s, body) = call(
        &r,
        "POST",
        "/v1/events",
        Some("shop-token"),
        Some(from("/shop/eu", "s-1")),
    )
    .await;
    assert_eq!(s, 202, "{body}");
    let mut other_type = from("/shop/eu", "s-2");
    other_type["type"] = json!("user.created");
    let (s, body) = call(
        &r,
        "POST",
        "/v1/events",
        Some("shop-token"),
        Some(other_type),
    )
    .await;
    assert_eq!(s, 403, "{body}");
    assert!(
        rcv.wait_for(Duration::from_secs(20), |got| got.len() >= 2)
            .await,
        "the two accepted events were not delivered"
    );
    let delivered = rcv
        .settled_count(Duration::from_secs(1), Duration::from_secs(20))
        .await;
    assert_eq!(delivered, 2, "{:?}", rcv.received());
    let mut sources: Vec<String> = rcv
        .received()
        .iter()
        .map(|g| g.body["source"].as_str().unwrap_or_default().to_string())
        .collect();
    sources.sort();
    assert_eq!(
        sources,
        ["/crm", "/shop/eu"],
        "s-0 of the refused batch was stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_over_its_rate_gets_429_with_retry_after() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[("orders", "order.paid", &[format!("webhook: {}", rcv.url())])],
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&auth_config()));
    let mut statuses = Vec::new();
    let mut retry_after = None;
    // All at once, so the test does not depend on how fast this machine sends them.
    let sends = (0..20).map(|i| {
        client()
            .post(r.url("/v1/events"))
            .bearer_auth("shop-token")
            .header("content-type", "application/cloudevents+json")
            .body(event(&format!("r{i}"), "order.paid", json!({})).to_string())
            .send()
    });
    for resp in futures::future::join_all(sends).await {
        let resp = resp.expect("send");
        if resp.status().as_u16() == 429 {
            retry_after = retry_after_header(&resp);
        }
        statuses.push(resp.status().as_u16());
    }
    let ok = statuses.iter().filter(|s| **s == 202).count();
    assert!(
        (5..20).contains(&ok),
        "rate 5/s with burst 5 let {ok} of 20 through: {statuses:?}"
    );
    assert!(
        retry_after.is_some_and(|v| v.parse::<u64>().is_ok_and(|n| n >= 1)),
        "429 without Retry-After"
    );
    // A batch larger than the burst could never pass: 413 at once, not a 429 to retry.
    let batch: Vec<Value> = (0..6)
        .map(|i| event(&format!("big{i}"), "order.paid", json!({})))
        .collect();
    let resp = client()
        .post(r.url("/v1/events"))
        .bearer_auth("shop-token")
        .header("content-type", "application/cloudevents-batch+json")
        .body(Value::Array(batch).to_string())
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 413);
    let body: Value = resp.json().await.expect("json");
    let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("at most 5 at once"), "{body}");
    assert_eq!(
        fate(&r, "big0").await["targets"],
        Value::Null,
        "nothing stored"
    );
    // The admin token has no limit.
    let (s, _) = call(
        &r,
        "POST",
        "/v1/events",
        Some("ops-token"),
        Some(event("adm", "order.paid", json!({}))),
    )
    .await;
    assert_eq!(s, 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_target_overflows_to_the_dlq_and_never_blocks_others() {
    let dead = Receiver::status(503).await;
    let healthy = Receiver::ok().await;
    let alerts = Receiver::ok().await;
    let policy = "  capped:\n    max_queue_depth: 5\n    retry: { max_attempts: 100, base_delay: 5s, max_delay: 5s }";
    let rules = rules_yaml(
        policy,
        &[
            (
                "r",
                "t",
                &[
                    format!(
                        "webhook: {}\n        id: dead\n        policy: capped",
                        dead.url()
                    ),
                    format!("webhook: {}\n        id: healthy", healthy.url()),
                ],
            ),
            (
                "alerts",
                "router.dlq.added",
                &[format!("webhook: {}\n        id: pager", alerts.url())],
            ),
        ],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    for i in 0..20 {
        let (s, _) = post_event(&r, &event(&format!("o{i}"), "t", json!({}))).await;
        assert_eq!(s, 202, "ingest refused while one target is dead");
    }
    assert!(
        healthy
            .wait_for(Duration::from_secs(10), |s| s.len() == 20)
            .await
    );
    let (_, l) = get_json(&r, "/v1/dlq?reason=target_overflow&limit=100").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(15), "{l}");
    let (_, t) = get_json(&r, "/v1/targets/dead").await;
    assert_eq!(
        t["queued"].as_u64().unwrap_or(0) + t["in_flight"].as_u64().unwrap_or(0),
        5
    );
    // Each overflowed copy is a dead letter like any other: counted, and announced.
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(
            &m,
            "router_dlq_entries_total{target=\"dead\",reason=\"target_overflow\"}"
        ),
        15,
        "{}",
        metric_lines(&m, "router_dlq_entries")
    );
    assert!(
        alerts
            .wait_for(Duration::from_secs(10), |s| {
                s.iter()
                    .filter(|a| {
                        a.body["data"]["reason"] == "target_overflow"
                            && a.body["data"]["target"] == "dead"
                    })
                    .count()
                    == 15
            })
            .await,
        "a router.dlq.added per overflowed copy: {:?}",
        alerts
            .received()
            .iter()
            .map(|a| a.body["data"].clone())
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_disk_high_water_mark_ingest_answers_503_and_delivery_goes_on() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml("", &[("r", "t", &[format!("webhook: {}", rcv.url())])]);
    // Any store is larger than 1 KiB: the mark is passed at the first check.
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_STORE__MAX_DISK_BYTES", "1024")],
    );
    let refused = eventually(Duration::from_secs(5), || async {
        let resp = client()
            .post(r.url("/v1/events"))
            .header("content-type", "application/cloudevents+json")
            .body(event("late", "t", json!({})).to_string())
            .send()
            .await
            .ok()?;
        (resp.status().as_u16() == 503).then(|| resp.headers().get("retry-after").cloned())
    })
    .await;
    assert!(
        refused.is_some_and(|h| h.is_some()),
        "no 503 with Retry-After past the high-water mark"
    );
    assert_eq!(get_json(&r, "/healthz").await.0, 200);
    // The status says why ingest refuses, in its warnings too (the alerting path).
    let (_, status) = get_json(&r, "/v1/status").await;
    assert_eq!(status["store"]["ingest_refused"], true, "{status}");
    assert!(
        status["warnings"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w
                .as_str()
                .is_some_and(|w| w.contains("past its disk high-water mark")))),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_signed_per_standard_webhooks_with_rotation() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        secret_env: WEBHOOK_SECRET_TEST_HOOK",
                rcv.url()
            )],
        )],
    );
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[(
            "WEBHOOK_SECRET_TEST_HOOK",
            &format!("{secret} whsec_c2Vjb25kLXNpZ25pbmcta2V5LTAy"),
        )],
    );
    assert_eq!(
        post_event(&r, &event("s1", "t", json!({"a": 1}))).await.0,
        202
    );
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
    let got = &rcv.received()[0];
    let id = got.header("webhook-id").expect("webhook-id");
    let ts: u64 = got
        .header("webhook-timestamp")
        .expect("timestamp")
        .parse()
        .expect("number");
    let sigs = got.header("webhook-signature").expect("signature");
    assert_eq!(id, got.header("idempotency-key").expect("key"));
    assert_eq!(
        sigs.split(' ').count(),
        2,
        "two active secrets, two signatures: {sigs}"
    );
    // Verify the first signature independently of the router's code.
    use base64::Engine as _;
    use hmac::Mac;
    let key = base64::engine::general_purpose::STANDARD
        .decode(&secret[6..])
        .expect("b64");
    let body = serde_json::to_vec(&got.body).expect("json");
    // The receiver re-serialised the body; sign what the router sent: same JSON, same order.
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("key");
    mac.update(format!("{id}.{ts}.").as_bytes());
    mac.update(&body);
    let want = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    );
    assert_eq!(sigs.split(' ').next(), Some(want.as_str()));
}

#[test]
fn no_tokens_on_a_public_address_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--rules")
        .arg(dir.path().join("rules"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without auth tokens"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_loris_connection_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let r = RouterProc::start_with_env(&[], &[], &[("ROUTER_SERVER__HEADER_READ_TIMEOUT", "1s")]);
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    s.write_all(b"POST /v1/events HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    // Never finish the headers: the server must give up on us.
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
    assert!(read.is_ok(), "the connection was kept open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_webhooks_verify_the_receiver_certificate() {
    let (rcv, ca_pem) = Receiver::tls().await;
    let rules = rules_yaml(
        "",
        &[("r", "t", &[format!("webhook: {}", rcv.https_url())])],
    );
    // Trusted through `delivery.tls_ca_file` (a private CA): delivered over TLS.
    let dir = tempfile::tempdir().expect("tmp");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &ca_pem).expect("write ca");
    let config = format!("[delivery]\ntls_ca_file = {:?}\n", ca.display().to_string());
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
    assert_eq!(
        post_event(&r, &event("tls-1", "t", json!({"a": 1})))
            .await
            .0,
        202
    );
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 1)
            .await,
        "the HTTPS receiver got the event"
    );
    assert_eq!(rcv.received()[0].event_id(), "tls-1");
    drop(r);

    // System roots only: the self-signed certificate is refused, the attempt fails with a
    // certificate error in the event's fate, and the event waits for a retry (not lost).
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_event(&r, &event("tls-2", "t", json!({"a": 2})))
            .await
            .0,
        202
    );
    let f = eventually(Duration::from_secs(15), || async {
        let f = fate(&r, "tls-2").await;
        (f["targets"][0]["attempts"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
            && f["targets"][0]["attempts"][0]["error"].is_string())
        .then_some(f)
    })
    .await
    .expect("a failed attempt");
    let err = f["targets"][0]["attempts"][0]["error"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(
        err.contains("certificate") || err.contains("tls") || err.contains("connect"),
        "{err}"
    );
    // Between attempts the target is `retrying`; with full jitter the next attempt can be
    // due at once, so it may already be `in_flight` again. Either way it is neither delivered
    // nor dead-lettered.
    let state = f["targets"][0]["state"].as_str().unwrap_or_default();
    assert!(matches!(state, "retrying" | "in_flight"), "{f}");
    assert_eq!(f["dlq"], json!([]), "{f}");
    assert_eq!(rcv.count(), 1, "nothing reached the receiver without trust");
}

/// The API reads a body only for a caller allowed to send it, bounded in size and time, and
/// answers what it cannot route in its JSON error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_bounds_bodies_and_answers_every_refusal_in_its_error_shape() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = format!("[server]\nrequest_timeout = \"2s\"\n\n{}", auth_config());
    let r = RouterProc::start_full(&[], &[], &[], Some(&config));
    // A 60 MB upload announced by a token without `handlers:` scope: refused at once, before
    // a byte of its body is read (it never sends one).
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    s.write_all(
        b"PUT /v1/handlers/enrich HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer shop-token\r\nContent-Type: application/wasm\r\nContent-Length: 60000000\r\n\r\n",
    )
    .await
    .expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("answered without waiting for the body")
        .expect("read");
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(head.contains("handlers:enrich"), "{head}");
    // The body left unread, the server closes the connection after the answer, and says so:
    // a client keeping it for its next request would see that request fail.
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    // A request whose body was read keeps its connection.
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    s.write_all(
        b"POST /v1/dlq/purge HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ops-token\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n{\"filter\": {\"all\": true}, \"x\": 1}",
    )
    .await
    .expect("write");
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("answered")
        .expect("read");
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 4"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    // An allowed caller whose body does not come: 408 after server.request_timeout.
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    s.write_all(
        b"POST /v1/dlq/purge HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ops-token\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
    )
    .await
    .expect("write");
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("the slow body is given up on")
        .expect("read");
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    // Too large for the route: 413 in the error shape.
    let resp = client()
        .post(r.url("/v1/dlq/purge"))
        .bearer_auth("ops-token")
        .header("content-type", "application/json")
        .body(vec![b' '; 3 << 20])
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 413);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["error"], "request body too large", "{body}");
    // A handler name is never percent-encoded: refused, not decoded past the scope check.
    let (s, b) = call(&r, "GET", "/v1/handlers/%65nrich", Some("ops-token"), None).await;
    assert_eq!(
        (s, b["errors"][0]["pointer"].as_str()),
        (400, Some("/name")),
        "{b}"
    );
    // No such route, and a method the route does not take: the error shape too.
    let (s, b) = call(&r, "GET", "/v1/nope", Some("ops-token"), None).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (404, Some("no such route")),
        "{b}"
    );
    let resp = client()
        .delete(r.url("/v1/rules"))
        .bearer_auth("ops-token")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 405);
    assert!(resp.headers().contains_key("allow"));
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["error"], "method not allowed", "{body}");
    // A token without `admin` gets the 405 too (not a 403 for a route it could never use).
    for (method, path, allow) in [
        ("DELETE", "/v1/rules", "GET,HEAD"),
        ("GET", "/v1/admin/reload", "POST"),
        ("POST", "/v1/handlers/enrich", "GET,HEAD,PUT,DELETE"),
    ] {
        let resp = client()
            .request(method.parse().expect("method"), r.url(path))
            .bearer_auth("viewer-token")
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        assert_eq!(
            resp.headers().get("allow").and_then(|v| v.to_str().ok()),
            Some(allow),
            "{method} {path}"
        );
        let body: Value = resp.json().await.expect("json");
        assert_eq!(body["error"], "method not allowed", "{body}");
    }
    // Values that parse but make no sense.
    for (method, path, body, pointer) in [
        ("GET", "/v1/replay?staet=running", None, "/staet"),
        (
            "GET",
            "/v1/dlq?since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z",
            None,
            "/until",
        ),
        (
            "POST",
            "/v1/dlq/redrive",
            Some(json!({"filter": {"target": "x"}, "rate_per_sec": 50000})),
            "/rate_per_sec",
        ),
        (
            "POST",
            "/v1/replay",
            Some(
                json!({"from": "2999-01-01T00:00:00Z", "to": "3000-01-01T00:00:00Z", "rate_per_sec": 1}),
            ),
            "/from",
        ),
    ] {
        let mut rb = client()
            .request(method.parse().expect("method"), r.url(path))
            .bearer_auth("ops-token");
        if let Some(b) = body {
            rb = rb
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = rb.send().await.expect("send");
        let status = resp.status().as_u16();
        let b: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 400, "{method} {path}: {b}");
        assert_eq!(b["errors"][0]["pointer"], pointer, "{method} {path}: {b}");
    }
    // A replay whose `to` is in the future ends at its creation.
    let from = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let (s, job) = call(
        &r,
        "POST",
        "/v1/replay",
        Some("ops-token"),
        Some(json!({"from": from, "to": "2999-01-01T00:00:00Z", "rate_per_sec": 1})),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let to_ms = job["spec"]["to_ms"].as_i64().expect("to_ms");
    assert!(
        to_ms <= chrono::Utc::now().timestamp_millis(),
        "the replay would follow ingest: {job}"
    );
}

/// Credential headers come from the environment (`headers_env`), never from the rule files:
/// the receiver gets the value, and neither the rules API nor the rule test shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhooks_credential_header_comes_from_the_environment() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: erp\n        headers: {{ X-Team: billing }}\n        headers_env: {{ Authorization: WEBHOOK_SECRET_E2E_ERP_AUTHORIZATION }}",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[(
            "WEBHOOK_SECRET_E2E_ERP_AUTHORIZATION",
            "Bearer s3cret-from-env",
        )],
    );
    assert_eq!(post_event(&r, &event("h1", "t", json!({}))).await.0, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
    let got = &rcv.received()[0];
    assert_eq!(
        got.headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer s3cret-from-env")
    );
    assert_eq!(
        got.headers.get("x-team").and_then(|v| v.to_str().ok()),
        Some("billing")
    );
    let (_, rules) = get_json(&r, "/v1/targets/erp").await;
    assert!(!rules.to_string().contains("s3cret"), "{rules}");
    let resp = client()
        .post(r.url("/v1/rules/test"))
        .json(&event("x", "t", json!({})))
        .send()
        .await
        .expect("test");
    let body = resp.text().await.expect("body");
    assert!(!body.contains("s3cret"), "{body}");
}

/// Sends `method path` with `headers` and an optional body (its content type among the
/// headers); returns (status, JSON body or null).
async fn send_with(
    r: &RouterProc,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Value) {
    let mut rb = client().request(method.parse().expect("method"), r.url(path));
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    if let Some(b) = body {
        rb = rb.body(b.to_string());
    }
    let resp = rb.send().await.expect("send");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// With no tokens every local caller is an administrator, so a web page open in the
/// operator's browser must not be able to act through it: not by posting a form (text/plain),
/// not by a cross-origin request, and not by rebinding a name of its own to 127.0.0.1. The CLI,
/// curl and producers (no Origin, a loopback Host, JSON) are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_drive_a_router_without_tokens() {
    let rejecting = Receiver::status(400).await;
    let rules = webhook_rule("orders", "order.paid", &rejecting.url(), "erp");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_event(&r, &event("p1", "order.paid", json!({})))
            .await
            .0,
        202
    );
    let dead_letters = || async {
        get_json(&r, "/v1/dlq?target=erp").await.1["entries"]
            .as_array()
            .map_or(0, Vec::len)
    };
    assert!(
        eventually(Duration::from_secs(20), || async {
            (dead_letters().await == 1).then_some(())
        })
        .await
        .is_some(),
        "the rejected event reached the DLQ"
    );
    let purge_all = r#"{"filter": {}, "all": true}"#;

    // A form on any site can post text/plain: it is not taken as the JSON it looks like.
    let (s, b) = send_with(
        &r,
        "POST",
        "/v1/dlq/purge",
        &[("content-type", "text/plain")],
        Some(purge_all),
    )
    .await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (415, &json!("/content-type")),
        "{b}"
    );
    // Nor is a body without a content type.
    let (s, b) = send_with(&r, "POST", "/v1/dlq/purge", &[], Some(purge_all)).await;
    assert_eq!(s, 415, "{b}");
    // A page's request says where it comes from: refused, JSON or not, body or not.
    let page = [("origin", "http://evil.example")];
    for (method, path, ct, body) in [
        ("POST", "/v1/dlq/purge", "application/json", Some(purge_all)),
        ("POST", "/v1/targets/erp/pause", "", None),
        (
            "POST",
            "/v1/events",
            "application/cloudevents+json",
            Some(r#"{"specversion":"1.0","id":"x","source":"/evil","type":"order.paid"}"#),
        ),
        ("GET", "/v1/dlq?target=erp", "", None),
    ] {
        let mut headers = page.to_vec();
        if !ct.is_empty() {
            headers.push(("content-type", ct));
        }
        let (s, b) = send_with(&r, method, path, &headers, body).await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (403, &json!("/origin")),
            "{method} {path}: {b}"
        );
    }
    // A request without Origin that the browser marks as another site's (an <img>, a link).
    let (s, b) = send_with(
        &r,
        "GET",
        "/v1/dlq?target=erp",
        &[("sec-fetch-site", "cross-site")],
        None,
    )
    .await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/sec-fetch-site")),
        "{b}"
    );
    // DNS rebinding: the page's own name, now resolving to 127.0.0.1, so the request is
    // "same-origin" for the browser; the name in Host gives it away.
    let rebound = format!("evil.example:{}", r.addr.port());
    let rebound_origin = format!("http://{rebound}");
    for (method, path, body) in [
        ("GET", "/v1/dlq?target=erp", None),
        ("POST", "/v1/dlq/purge", Some(purge_all)),
    ] {
        let (s, b) = send_with(
            &r,
            method,
            path,
            &[
                ("host", &rebound),
                ("origin", &rebound_origin),
                ("content-type", "application/json"),
            ],
            body,
        )
        .await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (403, &json!("/host")),
            "{method} {path}: {b}"
        );
        assert!(
            b["errors"][0]["message"]
                .as_str()
                .unwrap_or("")
                .contains("DNS rebinding"),
            "{b}"
        );
    }
    // Nothing of it happened.
    assert_eq!(dead_letters().await, 1, "the DLQ was purged");
    let (_, t) = get_json(&r, "/v1/targets/erp").await;
    assert_eq!(t["paused"], false, "{t}");
    assert_eq!(
        get_json(&r, "/v1/events/x?source=/evil").await.0,
        404,
        "the page's event was stored"
    );

    // Programs: a loopback name in Host (any port), no Origin, JSON or no body.
    let localhost = format!("localhost:{}", r.addr.port());
    let (s, b) = send_with(
        &r,
        "POST",
        "/v1/targets/erp/pause",
        &[("host", &localhost)],
        None,
    )
    .await;
    assert_eq!((s, &b["paused"]), (200, &json!(true)), "{b}");
    let (s, b) = send_with(
        &r,
        "POST",
        "/v1/dlq/purge",
        &[("content-type", "application/json; charset=utf-8")],
        Some(purge_all),
    )
    .await;
    assert_eq!((s, &b["purged"]), (200, &json!(1)), "{b}");
    // And the operator is told that auth is off.
    let (_, status) = get_json(&r, "/v1/status").await;
    assert!(
        status["warnings"].to_string().contains("auth is off"),
        "{}",
        status["warnings"]
    );
    assert!(r.log_text().contains("auth is off"), "no start-up warning");
}

/// With tokens a router is reached by whatever name its clients use (a proxy, a DNS name),
/// and a web page's request is still refused: a browser would not attach the token, but a
/// request it makes on a page's behalf has no business here either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_any_host_is_served_but_no_web_page() {
    let r = RouterProc::start_full(&[], &[], &[], Some(&auth_config()));
    let bearer = "Bearer viewer-token";
    let (s, b) = send_with(
        &r,
        "GET",
        "/v1/status",
        &[("host", "router.internal"), ("authorization", bearer)],
        None,
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert!(
        !b["warnings"].to_string().contains("auth is off"),
        "{}",
        b["warnings"]
    );
    let (s, b) = send_with(
        &r,
        "GET",
        "/v1/status",
        &[
            ("host", "router.internal"),
            ("origin", "https://router.internal"),
            ("authorization", bearer),
        ],
        None,
    )
    .await;
    assert_eq!(s, 200, "its own origin, behind a TLS proxy: {b}");
    let (s, b) = send_with(
        &r,
        "GET",
        "/v1/status",
        &[
            ("host", "router.internal"),
            ("origin", "https://wiki.internal"),
            ("authorization", bearer),
        ],
        None,
    )
    .await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/origin")),
        "{b}"
    );
}

/// A handler's emitted events carry `handler://<name>` and ids any producer can compute, and
/// system events `router://…`: a producer that could send those sources could make the dedup
/// window swallow a handler's real emission, or forge a `router.dlq.added`. Only an
/// administrator, or a token whose `ingest-source:` pattern names the prefix (a router
/// downstream of another), sends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_sources_are_reserved_at_ingest() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("alerts", "router.dlq.added", &rcv.url(), "pager");
    let auth = format!(
        "{}{}",
        auth_config(),
        tokens_config(&[
            ("anywhere", None, "ingest-source:*"),
            // Two scopes (the helper writes the string between the brackets' quotes).
            (
                "downstream",
                None,
                "ingest-source:handler://*\", \"ingest:router.*",
            ),
        ])
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&auth));
    let from = |source: &str, id: &str| json!({"specversion": "1.0", "id": id, "source": source, "type": "router.dlq.added", "data": {}});
    let post = |token: &'static str, ct: &'static str, body: String| {
        let url = r.url("/v1/events");
        async move {
            let resp = client()
                .post(url)
                .bearer_auth(token)
                .header("content-type", ct)
                .body(body)
                .send()
                .await
                .expect("send");
            let s = resp.status().as_u16();
            (s, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let structured = "application/cloudevents+json";
    // No source restriction, or `ingest-source:*`: the router's sources are not covered.
    for (token, source) in [
        ("shop-token", "router://targets/erp"),
        ("anywhere", "router://ingest"),
        ("anywhere", "handler://enrich"),
        ("downstream", "router://ingest"),
    ] {
        let (s, b) = post(token, structured, from(source, "f-1").to_string()).await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (403, &json!("/source")),
            "{token} {source}: {b}"
        );
        let msg = b["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(&format!("ingest-source:{source}")), "{b}");
    }
    // A batch names the element; nothing of it is stored.
    let mut ok = from("/shop", "ok-1");
    ok["type"] = json!("order.created");
    let batch = json!([ok, from("handler://enrich", "f-2")]);
    let (s, b) = post(
        "anywhere",
        "application/cloudevents-batch+json",
        batch.to_string(),
    )
    .await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/1/source")),
        "{b}"
    );
    let (s, _) = get_json_as(&r, "/v1/events/ok-1?source=/shop", "ops-token").await;
    assert_eq!(s, 404, "an element of the refused batch was stored");
    // Binary mode: the ce-source header.
    let resp = client()
        .post(r.url("/v1/events"))
        .bearer_auth("anywhere")
        .header("ce-specversion", "1.0")
        .header("ce-id", "f-3")
        .header("ce-source", "router://targets/erp")
        .header("ce-type", "router.dlq.added")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 403);
    let b: Value = resp.json().await.expect("json");
    assert_eq!(b["errors"][0]["pointer"], "/ce-source", "{b}");
    // A system event's type under the producer's own source: a false alert. Refused unless
    // an `ingest:` pattern names `router.` itself.
    let (s, b) = post("anywhere", structured, from("/shop", "f-4").to_string()).await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/type")),
        "{b}"
    );
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("ingest:router.dlq.added"),
        "{b}"
    );
    // Allowed: the prefix named by the scope, and an administrator.
    let (s, b) = post(
        "downstream",
        structured,
        from("handler://enrich", "d-1").to_string(),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    let (s, b) = post(
        "ops-token",
        structured,
        from("router://ingest", "o-1").to_string(),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    // Only those two reached the alert route.
    assert!(
        rcv.wait_for(Duration::from_secs(20), |got| got.len() >= 2)
            .await,
        "the accepted events were not delivered"
    );
    let delivered = rcv
        .settled_count(Duration::from_secs(1), Duration::from_secs(20))
        .await;
    assert_eq!(delivered, 2, "{:?}", rcv.received());
    drop(r);

    // Without tokens (every local caller an administrator) they are accepted as before.
    let r = RouterProc::start(&[], &[]);
    let (s, b) = post_event(&r, &from("handler://enrich", "n-1")).await;
    assert_eq!(s, 202, "{b}");
}

/// What ingest refuses a team it refuses the team's handler too: a handler uploaded by a token
/// with `ingest:*` that emits `router.dlq.added` (a false page to on-call) has that emission
/// dead-lettered as `scope_violation`, never routed; an administrator's upload may emit it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_handler_cannot_emit_a_system_event_its_token_may_not_send() {
    let pager = Receiver::ok().await;
    let rules = format!(
        "rules:\n  - name: misbehave\n    pattern: {{ type: [hostile.run] }}\n    targets:\n      - handler: hostile\n        id: hostile\n  - name: alerts\n    pattern: {{ type: [router.dlq.added] }}\n    targets:\n      - webhook: {}\n        id: pager\n",
        pager.url()
    );
    let auth = tokens_config(&[
        ("ops-token", None, "admin"),
        ("team-token", None, "ingest:*\", \"handlers:hostile"),
    ]);
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&auth));
    let forge = |id: &str| {
        let ev = event(
            id,
            "hostile.run",
            json!({"mode": "forge", "type": "router.dlq.added", "data": {"target": "erp", "reason": "retries_exhausted"}}),
        );
        ("application/cloudevents+json", ev.to_string().into_bytes())
    };
    // The team itself is refused the type at ingest …
    let direct = event("direct-1", "router.dlq.added", json!({}));
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/events",
        "team-token",
        Some((
            "application/cloudevents+json",
            direct.to_string().into_bytes(),
        )),
    )
    .await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/type")),
        "{b}"
    );
    // … and so is its handler.
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/hostile",
        "team-token",
        Some(("application/wasm", crate::handlers::plugin("hostile"))),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/events",
        "team-token",
        Some(forge("forge-1")),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    let entry = eventually(Duration::from_secs(30), || async {
        let (s, v) = get_json_as(&r, "/v1/dlq?reason=scope_violation", "ops-token").await;
        (s == 200).then(|| v["entries"].as_array()?.first().cloned())?
    })
    .await
    .expect("a scope_violation dead letter for the forged emission");
    assert_eq!(entry["event"]["type"], "router.dlq.added", "{entry}");
    assert_eq!(entry["event"]["source"], "handler://hostile", "{entry}");
    let msg = entry["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("ingest:router.dlq.added") && msg.contains("system events"),
        "{msg}"
    );
    // Never routed to the alert rule (and a dead letter of a `router.*` event is not itself
    // announced, so the pager hears nothing at all).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(pager.count(), 0, "{:?}", pager.received());

    // An administrator's upload is the operator's: its emission is routed. (Other bytes, a
    // custom section added: the same bytes would re-activate the team's version.)
    let mut ops_bytes = crate::handlers::plugin("hostile");
    ops_bytes.extend_from_slice(&[0, 4, 3, b'o', b'p', b's']);
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/hostile",
        "ops-token",
        Some(("application/wasm", ops_bytes)),
    )
    .await;
    assert_eq!((s, &b["version"]), (201, &json!(2)), "{b}");
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/events",
        "ops-token",
        Some(forge("forge-2")),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    assert!(
        pager
            .wait_for(Duration::from_secs(30), |got| got
                .iter()
                .any(|g| g.body["source"] == "handler://hostile"))
            .await,
        "an administrator's handler emits system events: {:?}",
        pager.received()
    );
}

async fn get_json_as(r: &RouterProc, path: &str, token: &str) -> (u16, Value) {
    let resp = client()
        .get(r.url(path))
        .bearer_auth(token)
        .send()
        .await
        .expect("get");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// A handler's logs (event contents, its state) are its team's: another team's token whose
/// `handlers:` glob covers the name reads its metadata, not its logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_team_cannot_read_a_teams_handler_logs() {
    let auth = tokens_config(&[
        ("ops", None, "admin"),
        ("billing-ci", Some("billing"), "handlers:*"),
        ("crm-ci", None, "handlers:*"),
    ]);
    let rules = "rules:\n  - name: paid\n    pattern: { type: [order.paid] }\n    targets:\n      - handler: invoice\n";
    let r = RouterProc::start_full(&[("r.yaml", rules)], &[], &[], Some(&auth));
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/invoice",
        "billing-ci",
        Some(("application/wasm", crate::handlers::plugin("invoice"))),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    let ev = event("paid-1", "order.paid", json!({"order_id": "A-1"}));
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/events",
        "ops",
        Some(("application/cloudevents+json", ev.to_string().into_bytes())),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    let lines = |b: &Value| b["lines"].as_array().map_or(0, Vec::len);
    let logged = eventually(Duration::from_secs(30), || async {
        let (s, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "billing-ci", None).await;
        (s == 200 && lines(&l) > 0).then_some(())
    })
    .await;
    assert!(logged.is_some(), "the handler logged nothing for its team");
    let (s, b) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "crm-ci", None).await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/authorization")),
        "{b}"
    );
    let msg = b["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("belongs to team \"billing\""), "{b}");
    // The metadata stays readable; an administrator reads the logs.
    let (s, info) = send_as(&r, "GET", "/v1/handlers/invoice", "crm-ci", None).await;
    assert_eq!((s, &info["owner"]), (200, &json!("billing")), "{info}");
    let (s, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "ops", None).await;
    assert!(s == 200 && lines(&l) > 0, "{s} {l}");
}

/// Sends the head of a handler upload declaring `len` bytes of body, and none of it: the
/// answer's head, which must come within 5 s (the router's request timeout is longer).
async fn upload_head_answer(r: &RouterProc, name: &str, token: &str, len: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    let head = format!(
        "PUT /v1/handlers/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/wasm\r\nContent-Length: {len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("answered without waiting for the body or an upload slot")
        .expect("read");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// An upload is refused from its path, token and headers before it takes one of the two
/// upload slots or its body is read. Another team's token, whose `handlers:*` glob passes the
/// scope check, took a slot and waited for its body before the owner check answered 403: two
/// such requests held both slots for a request timeout. A body declared past
/// `handlers.max_upload_bytes` waited out that timeout for a 408 instead of a 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_is_refused_from_its_headers_before_it_takes_a_slot() {
    let auth = tokens_config(&[
        ("billing-ci", Some("billing"), "handlers:*"),
        ("crm-ci", None, "handlers:*"),
    ]);
    let config = format!("[server]\nrequest_timeout = \"30s\"\n\n{auth}");
    let r = RouterProc::start_full(&[], &[], &[], Some(&config));
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/noop",
        "billing-ci",
        Some(("application/wasm", crate::handlers::plugin("noop"))),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    // Three at once: more than the slots, each answered at once (none holds one).
    let refused =
        futures::future::join_all((0..3).map(|_| upload_head_answer(&r, "noop", "crm-ci", 1000)))
            .await;
    for head in refused {
        assert!(head.starts_with("HTTP/1.1 403"), "{head}");
        assert!(head.contains("billing"), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("connection: close"),
            "{head}"
        );
    }
    // The owner's upload declared past max_upload_bytes (64 MiB by default): 413 at once.
    let head = upload_head_answer(&r, "noop", "billing-ci", 70_000_000).await;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    // The limit and the key that sets it (it said ingest's "request body too large").
    assert!(
        head.contains("67108864") && head.contains("handlers.max_upload_bytes"),
        "{head}"
    );
    // The owner's next upload finds the slots free.
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/hostile",
        "billing-ci",
        Some(("application/wasm", crate::handlers::plugin("hostile"))),
    )
    .await;
    assert_eq!(s, 201, "{b}");
}

/// A component sent without a declared length (chunked) and found past
/// `handlers.max_upload_bytes` while it is read gets the upload's 413, naming the key and the
/// limit in force, not ingest's "request body too large".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_past_the_limit_names_handlers_max_upload_bytes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let r = RouterProc::start_full(&[], &[], &[], Some("[handlers]\nmax_upload_bytes = 4096\n"));
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    let chunk = vec![b'x'; 1024];
    let mut req = b"PUT /v1/handlers/big HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/wasm\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        req.extend_from_slice(b"400\r\n");
        req.extend_from_slice(&chunk);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    s.write_all(&req).await.expect("write");
    // Until the JSON body is complete (the connection may stay open).
    let mut answer = String::new();
    let mut buf = vec![0u8; 4096];
    while !answer.trim_end().ends_with('}') {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => answer.push_str(&String::from_utf8_lossy(&buf[..n])),
            _ => break,
        }
    }
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("handler component too large")
            && answer.contains("upload limit of 4096 bytes (handlers.max_upload_bytes)"),
        "{answer}"
    );
}

/// Starts `router serve` with `config`; the process's stderr once it exited, or `None` if it
/// was still serving after 30 s (then it is killed).
fn serve_exit_output(config: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("router.toml");
    std::fs::write(&path, config).expect("write config");
    // The rules directory exists, so that a config the router takes starts it (a missing
    // directory would stop it too, for another reason).
    std::fs::create_dir_all(dir.path().join("rules")).expect("rules dir");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&path)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--rules")
        .arg(dir.path().join("rules"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut err = String::new();
    use std::io::Read as _;
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    Some(err)
}

/// A scope is matched character for character: a space, a trailing blank or two patterns in
/// one string would load, never match, and leave the token refused for no reason its config
/// shows. The router refuses to start instead, naming the token and the scope.
#[test]
fn a_scope_typo_stops_the_router_at_start() {
    for (scope, why) in [
        ("ingest: order.*", "' '"),
        ("dlq:erp,crm", "','"),
        ("handlers:Billing-*", "'B'"),
    ] {
        let config = format!(
            "[[auth.tokens]]\nname = \"shop\"\nsha256 = \"{}\"\nscopes = [\"read\", \"{scope}\"]\n",
            token_sha256("shop-token")
        );
        let err = serve_exit_output(&config)
            .unwrap_or_else(|| panic!("the router started with scope {scope:?}"));
        // Once: the message was printed again as its own source.
        assert_eq!(
            err.matches("auth.tokens[0] (shop)").count(),
            1,
            "{scope}: {err}"
        );
        assert!(err.contains(&format!("{scope:?}")), "{scope}: {err}");
        assert!(err.contains(why), "{scope}: {err}");
    }
}

/// A token's `rate_per_sec` that is not a positive number stops the router at start, naming
/// the token: before, 0, a negative rate or NaN was taken, and the token's requests after its
/// first were answered 429 with a Retry-After of 1000000 s; `inf` set no limit.
#[test]
fn a_rate_that_admits_nothing_stops_the_router_at_start() {
    for rate in ["0", "-1", "nan", "inf"] {
        let config = format!(
            "[[auth.tokens]]\nname = \"shop\"\nsha256 = \"{}\"\nscopes = [\"ingest:*\"]\nrate_per_sec = {rate}\n",
            token_sha256("shop-token")
        );
        let err = serve_exit_output(&config)
            .unwrap_or_else(|| panic!("the router started with rate_per_sec = {rate}"));
        assert!(
            err.contains("auth.tokens[0] (shop)") && err.contains("rate_per_sec"),
            "{rate}: {err}"
        );
    }
}

/// `server.max_header_bytes` (default 65536) is the limit on the request head: a head over it
/// is answered 431 (by hyper, without a body), one under it is served. Before, the value only
/// sized hyper's read buffer, which a read could overshoot: heads of up to about 110,000 bytes
/// were served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_over_max_header_bytes_is_431() {
    let r = RouterProc::start(&[], &[]);
    let status = |pad: usize| {
        let url = r.url("/healthz");
        async move {
            client()
                .get(url)
                .header("x-pad", "a".repeat(pad))
                .send()
                .await
                .expect("an answer, not a reset")
                .status()
                .as_u16()
        }
    };
    assert_eq!(status(60_000).await, 200);
    // A little over the limit, so that the server has read the whole head when it answers
    // (a larger one is answered with bytes unread, and the client may see a reset instead).
    assert_eq!(status(70_000).await, 431);
}

/// No body is decoded: a handler upload or an API change sent with a `Content-Encoding` is
/// refused as such (415, pointer `/content-encoding`), not as an invalid component or
/// malformed JSON, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_change_is_refused_as_such() {
    let r = RouterProc::start(&[], &[]);
    let upload = client()
        .put(r.url("/v1/handlers/noop"))
        .header("content-type", "application/wasm")
        .header("content-encoding", "gzip")
        .body(crate::handlers::plugin("noop"))
        .send()
        .await
        .expect("upload");
    assert_eq!(upload.status().as_u16(), 415);
    let body: Value = upload.json().await.expect("json");
    assert_eq!(body["errors"][0]["pointer"], "/content-encoding", "{body}");
    assert_eq!(get_json(&r, "/v1/handlers/noop").await.0, 404);
    let purge = client()
        .post(r.url("/v1/dlq/purge"))
        .header("content-type", "application/json")
        .header("content-encoding", "br")
        .body(r#"{"filter": {"all": true}}"#)
        .send()
        .await
        .expect("purge");
    assert_eq!(purge.status().as_u16(), 415);
    let body: Value = purge.json().await.expect("json");
    assert_eq!(body["errors"][0]["pointer"], "/content-encoding", "{body}");
}

/// A job list's `after=<job id>` resolves only among the caller's jobs: another team's job
/// answers exactly as one that does not exist, so paging does not tell a team which jobs
/// other teams run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cursor_does_not_reveal_another_teams_job() {
    // Both teams' targets in the rules: a redrive naming an unknown target is refused.
    let erp = webhook_rule("orders", "order.paid", "http://127.0.0.1:9/erp", "erp");
    let crm = webhook_rule("users", "user.created", "http://127.0.0.1:9/crm", "crm");
    let r = RouterProc::start_full(
        &[("erp.yaml", &erp), ("crm.yaml", &crm)],
        &[],
        &[],
        Some(&auth_config()),
    );
    let redrive = |token: &'static str, target: &str| {
        call(
            &r,
            "POST",
            "/v1/dlq/redrive",
            Some(token),
            Some(json!({"filter": {"target": target}, "rate_per_sec": 5})),
        )
    };
    let (s, own) = redrive("shop-token", "erp").await;
    assert_eq!(s, 201, "{own}");
    let (s, other) = redrive("ops-token", "crm").await;
    assert_eq!(s, 201, "{other}");
    let page_after = |job: &str| {
        let path = format!("/v1/dlq/redrive?after={job}");
        let r = &r;
        async move { call(r, "GET", &path, Some("shop-token"), None).await }
    };
    let missing = page_after("redrive-999").await;
    assert_eq!(missing.0, 400, "{}", missing.1);
    let others = page_after(other["id"].as_str().expect("id")).await;
    assert_eq!(
        others, missing,
        "another team's job answers as a missing one"
    );
    let (s, b) = page_after(own["id"].as_str().expect("id")).await;
    assert_eq!(s, 200, "its own job is a cursor: {b}");
    // `read` sees every job, and pages after any.
    let (s, b) = call(
        &r,
        "GET",
        &format!(
            "/v1/dlq/redrive?after={}",
            other["id"].as_str().expect("id")
        ),
        Some("viewer-token"),
        None,
    )
    .await;
    assert_eq!(s, 200, "{b}");
}

/// HEAD is GET without the body: a reader's HEAD gets what its GET gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_is_answered_as_get() {
    let r = RouterProc::start_full(&[], &[], &[], Some(&auth_config()));
    for path in ["/v1/handlers/enrich", "/v1/dlq?limit=5", "/v1/status"] {
        let status = |method: reqwest::Method| {
            let url = r.url(path);
            async move {
                client()
                    .request(method, url)
                    .bearer_auth("viewer-token")
                    .send()
                    .await
                    .expect("send")
                    .status()
                    .as_u16()
            }
        };
        let (get, head) = (
            status(reqwest::Method::GET).await,
            status(reqwest::Method::HEAD).await,
        );
        assert_eq!(head, get, "HEAD {path}");
    }
}

/// A router with a `dlq:*` token ("teams") beside `auth_config`'s, and one quarantined event
/// (a dead letter without a target): the router and that dead letter's id.
async fn with_a_dead_letter_without_a_target() -> (RouterProc, String) {
    let rules = webhook_rule("orders", "order.paid", "http://127.0.0.1:9/erp", "erp");
    let strict = r#"{"type": "object", "required": ["id"]}"#;
    let config = format!(
        "{}\n{}",
        auth_config(),
        tokens_config(&[("teams-token", Some("teams"), "dlq:*")])
    );
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[("order.paid/v1.json", strict)],
        &[],
        Some(&config),
    );
    let ev = event("q1", "order.paid", json!({"name": "no id"}));
    let (s, b) = call(&r, "POST", "/v1/events", Some("ops-token"), Some(ev)).await;
    assert_eq!(
        (s, &b["results"][0]["status"]),
        (202, &json!("quarantined")),
        "{b}"
    );
    let (s, l) = call(&r, "GET", "/v1/dlq?target=none", Some("viewer-token"), None).await;
    assert_eq!(s, 200, "{l}");
    let id = l["entries"][0]["id"]
        .as_str()
        .expect("the dead letter")
        .to_string();
    (r, id)
}

/// The dead letters without a target are `read`/`admin` only (docs/configuration.md): a
/// redrive over them (`target: none`) is an administrator's job that no `dlq:` glob reaches,
/// not even `dlq:*` (which matches the name "none"). Before, a `dlq:*` token listed, read,
/// paused and cancelled it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_over_the_dead_letters_without_a_target_is_no_teams() {
    let (r, _) = with_a_dead_letter_without_a_target().await;
    let body = json!({"filter": {"target": "none"}, "rate_per_sec": 1});
    let (s, _) = call(
        &r,
        "POST",
        "/v1/dlq/redrive",
        Some("teams-token"),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 403, "a team cannot start it");
    let (s, job) = call(&r, "POST", "/v1/dlq/redrive", Some("ops-token"), Some(body)).await;
    assert_eq!(s, 201, "{job}");
    let path = format!("/v1/dlq/redrive/{}", job["id"].as_str().expect("job id"));
    let (s, missing) = call(
        &r,
        "GET",
        "/v1/dlq/redrive/redrive-999",
        Some("teams-token"),
        None,
    )
    .await;
    assert_eq!(s, 403, "{missing}");
    let (s, b) = call(&r, "GET", &path, Some("teams-token"), None).await;
    assert_eq!(
        (s, &b),
        (403, &missing),
        "the same 403 as a job that does not exist"
    );
    let (s, b) = call(&r, "GET", "/v1/dlq/redrive", Some("teams-token"), None).await;
    assert_eq!((s, &b["jobs"]), (200, &json!([])), "{b}");
    for action in ["pause", "cancel"] {
        let control = |to: String| {
            let r = &r;
            async move { call(r, "POST", &to, Some("teams-token"), None).await }
        };
        let missing = control(format!("/v1/dlq/redrive/redrive-999/{action}")).await;
        assert_eq!(missing.0, 403, "{}", missing.1);
        let b = control(format!("{path}/{action}")).await;
        assert_eq!(
            b, missing,
            "{action}: the same 403 as a job that does not exist"
        );
    }
    let (s, b) = call(&r, "GET", &path, Some("viewer-token"), None).await;
    assert_eq!(s, 200, "{b}");
    assert!(
        !matches!(b["state"].as_str(), Some("paused" | "cancelled")),
        "a refused control changed the job: {b}"
    );
}

/// A dead letter without a target (a quarantined event, with its full event) is not a
/// team's to read by id either: `dlq:*` gets the 403 of another team's entry or of an id that
/// does not exist, as its list with `target=none` is refused. Before, `dlq:*` read every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_without_a_target_is_not_a_teams_to_show() {
    let (r, id) = with_a_dead_letter_without_a_target().await;
    let (s, missing) = call(&r, "GET", "/v1/dlq/999999", Some("teams-token"), None).await;
    assert_eq!(s, 403, "{missing}");
    let (s, b) = call(
        &r,
        "GET",
        &format!("/v1/dlq/{id}"),
        Some("teams-token"),
        None,
    )
    .await;
    assert_eq!(
        (s, &b),
        (403, &missing),
        "the same 403 as an id that does not exist"
    );
    let (s, b) = call(
        &r,
        "GET",
        &format!("/v1/dlq/{id}"),
        Some("viewer-token"),
        None,
    )
    .await;
    assert_eq!((s, &b["event"]["id"]), (200, &json!("q1")), "{b}");
}

/// A type or source outside the token's ingest scopes is refused pointing at that attribute
/// of that event (`/type`, `/<index>/source`, `/ce-type`), as a reserved source is, with the
/// message naming the token and the scope it lacks. Before, every such 403 pointed at
/// `/authorization`, and a producer could not tell which element of a batch to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_scope_event_is_refused_pointing_at_its_attribute() {
    let auth = format!(
        "{}{}",
        auth_config(),
        tokens_config(&[("eu-shop", None, "ingest-source:/shop/eu")])
    );
    let r = RouterProc::start_full(&[], &[], &[], Some(&auth));
    let ev = |id: &str, ty: &str, source: &str| json!({"specversion": "1.0", "id": id, "source": source, "type": ty});
    let post = |token: &'static str, headers: Vec<(&'static str, String)>, body: String| {
        let url = r.url("/v1/events");
        async move {
            let mut rb = client().post(url).bearer_auth(token).body(body);
            for (k, v) in headers {
                rb = rb.header(k, v);
            }
            let resp = rb.send().await.expect("send");
            let s = resp.status().as_u16();
            (s, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let ct = |ct: &str| vec![("content-type", ct.to_string())];
    let binary = |ty: &str, source: &str| {
        vec![
            ("ce-specversion", "1.0".to_string()),
            ("ce-id", "b-1".to_string()),
            ("ce-type", ty.to_string()),
            ("ce-source", source.to_string()),
        ]
    };
    let cases = [
        (
            "shop-token",
            ct("application/cloudevents+json"),
            ev("s-1", "user.created", "/test").to_string(),
            "/type",
            "ingest:user.created",
        ),
        (
            "shop-token",
            ct("application/cloudevents-batch+json"),
            json!([
                ev("s-2", "order.paid", "/test"),
                ev("s-3", "user.created", "/test")
            ])
            .to_string(),
            "/1/type",
            "ingest:user.created",
        ),
        (
            "shop-token",
            binary("user.created", "/test"),
            String::new(),
            "/ce-type",
            "ingest:user.created",
        ),
        (
            "eu-shop",
            ct("application/cloudevents+json"),
            ev("s-4", "order.paid", "/shop/us").to_string(),
            "/source",
            "ingest-source:/shop/us",
        ),
        (
            "eu-shop",
            ct("application/json"),
            json!([
                ev("s-5", "order.paid", "/shop/eu"),
                ev("s-6", "order.paid", "/shop/us")
            ])
            .to_string(),
            "/1/source",
            "ingest-source:/shop/us",
        ),
        (
            "eu-shop",
            binary("order.paid", "/shop/us"),
            String::new(),
            "/ce-source",
            "ingest-source:/shop/us",
        ),
    ];
    for (token, headers, body, pointer, scope) in cases {
        let name = token.trim_end_matches("-token");
        let (s, b) = post(token, headers, body).await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (403, &json!(pointer)),
            "{token} {pointer}: {b}"
        );
        let msg = b["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(&format!("token {name:?} lacks scope {scope}")),
            "{b}"
        );
    }
    for (id, source) in [("s-2", "/test"), ("s-5", "/shop/eu")] {
        let (s, _) =
            get_json_as(&r, &format!("/v1/events/{id}?source={source}"), "ops-token").await;
        assert_eq!(s, 404, "{id} of a refused batch was stored");
    }
}

/// A saturated ingest answers 503 with `Retry-After` instead of making producers wait until
/// their own timeouts: past `ingest.max_in_flight_bytes` a request waits `admission_wait`
/// for room, then is refused, nothing stored; once room is free it passes. Before, nothing
/// bounded the requests in flight (64 producers of 1 MB batches waited 5-7 s each, audited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_ingest_answers_503_with_retry_after_and_recovers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let r = RouterProc::start_with_env(
        &[],
        &[],
        &[
            ("ROUTER_INGEST__MAX_IN_FLIGHT_BYTES", "2000"),
            ("ROUTER_INGEST__ADMISSION_WAIT", "300ms"),
        ],
    );
    // A request holding 1,300+ bytes of room: most of its body has arrived, the rest is
    // slow (room is held for the bytes received, not the declared length).
    let held = event("held", "t", json!({ "pad": "x".repeat(1_300) })).to_string();
    assert!(held.len() > 1_300 && held.len() < 2_000, "{}", held.len());
    let mut slow = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/cloudevents+json\r\ncontent-length: {}\r\n\r\n",
        held.len()
    );
    slow.write_all(head.as_bytes()).await.expect("write head");
    let sent = held.len() - 10;
    slow.write_all(&held.as_bytes()[..sent])
        .await
        .expect("write most of the body");
    // Held once the server read it: the metric shows it.
    let in_flight = eventually(Duration::from_secs(10), || async {
        let m = metrics_text(&r).await;
        (counter(&m, "router_ingest_in_flight_bytes") >= sent as u64).then_some(())
    })
    .await;
    assert!(in_flight.is_some(), "{}", metrics_text(&r).await);
    // Another producer's event finds no room within the wait: 503, Retry-After.
    let other = event("other", "t", json!({ "pad": "y".repeat(700) }));
    assert!(sent + other.to_string().len() > 2_000);
    let started = std::time::Instant::now();
    let resp = send_raw(&r, "application/cloudevents+json", other.to_string()).await;
    assert_eq!(resp.status().as_u16(), 503);
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(retry_after_header(&resp).as_deref(), Some("1"));
    let body: Value = resp.json().await.expect("json");
    assert_eq!(
        body["error"],
        "the router is saturated; retry after the indicated time"
    );
    let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("ingest.max_in_flight_bytes"), "{msg}");
    assert_eq!(
        get_json(&r, "/v1/events/other?source=/test").await.0,
        404,
        "nothing stored"
    );
    let (_, status) = get_json(&r, "/v1/status").await;
    assert_eq!(status["ingest"]["saturated_total"], 1, "{status}");
    assert_eq!(status["ingest"]["max_in_flight_bytes"], 2000);
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(&m, "router_ingest_saturated_total{bound=\"bytes\"}"),
        1,
        "{m}"
    );
    // The held request completes, and the room is free again.
    slow.write_all(&held.as_bytes()[sent..])
        .await
        .expect("write the rest");
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), slow.read(&mut answer))
        .await
        .expect("answered")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    assert_eq!(post_event(&r, &other).await.0, 202);
}

/// Past `server.max_connections` a new connection is answered 503 with `Retry-After` and a
/// JSON body and closed; once a connection closes, new ones are served again. Before, one
/// client could open connections until the process ran out of file descriptors (audited:
/// 20,000 slow-body connections, `accept failed: Too many open files`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_answered_503_and_closed() {
    let r = RouterProc::start_with_env(&[], &[], &[("ROUTER_SERVER__MAX_CONNECTIONS", "3")]);
    // The harness's readiness check has closed its connection by now; three idle ones hold
    // every slot (until the header read timeout, 10 s).
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(
            tokio::net::TcpStream::connect(r.addr)
                .await
                .expect("connect"),
        );
    }
    let refused = eventually(Duration::from_secs(5), || async {
        let resp = client().get(r.url("/healthz")).send().await.ok()?;
        (resp.status().as_u16() == 503).then_some(resp)
    })
    .await
    .expect("a fourth connection refused");
    assert_eq!(retry_after_header(&refused).as_deref(), Some("1"));
    assert_eq!(
        refused
            .headers()
            .get("connection")
            .and_then(|v| v.to_str().ok()),
        Some("close")
    );
    let body: Value = refused.json().await.expect("json");
    assert_eq!(body["error"], "too many open connections");
    let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("server.max_connections"), "{msg}");
    drop(idle.pop());
    // Served again once the server has seen the close (`client()` is a new client each
    // time: no pooled connection).
    let served = eventually(Duration::from_secs(5), || async {
        let resp = client().get(r.url("/v1/status")).send().await.ok()?;
        (resp.status().as_u16() == 200).then_some(resp)
    })
    .await
    .expect("served after a slot was freed");
    let status: Value = served.json().await.expect("json");
    assert_eq!(status["connections"]["max"], 3, "{status}");
    assert!(
        status["connections"]["refused_total"].as_u64() >= Some(1),
        "{status}"
    );
}

/// With `server.ops_listen`, probes and the scrape have connections of their own: while
/// producers hold every one of `server.max_connections` (and the main address answers its
/// own `/healthz` 503, as above), the ops address still answers `/healthz`, `/readyz` and
/// `/metrics`, and nothing else. Before, a liveness probe at the cap got the producers' 503
/// and an orchestrator restarted a router that was only busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ops_address_answers_probes_while_producers_hold_every_connection() {
    let r = RouterProc::start_with_env(
        &[],
        &[],
        &[
            ("ROUTER_SERVER__MAX_CONNECTIONS", "3"),
            ("ROUTER_SERVER__OPS_LISTEN", "127.0.0.1:0"),
            ("ROUTER_SERVER__OPS_MAX_CONNECTIONS", "2"),
        ],
    );
    // From the log, not /v1/status: a request to the main address now could still hold its
    // slot when the idle connections below arrive, and one of them would be the refused one.
    let log = r.log_text();
    let ops_addr: std::net::SocketAddr = log
        .lines()
        .find(|l| l.contains("ops address listening"))
        .and_then(|l| l.split("listen=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("ops address in the log:\n{log}"));
    let ops_url = |path: &str| format!("http://{ops_addr}{path}");
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(
            tokio::net::TcpStream::connect(r.addr)
                .await
                .expect("connect"),
        );
    }
    eventually(Duration::from_secs(5), || async {
        let resp = client().get(r.url("/healthz")).send().await.ok()?;
        (resp.status().as_u16() == 503).then_some(())
    })
    .await
    .expect("the main address refuses a fourth connection");
    for path in ["/healthz", "/readyz", "/metrics"] {
        let resp = client().get(ops_url(path)).send().await.expect(path);
        assert_eq!(resp.status().as_u16(), 200, "{path} on the ops address");
        if path == "/metrics" {
            let text = resp.text().await.expect("metrics");
            let refused = text
                .lines()
                .find_map(|l| l.strip_prefix("router_http_connections_refused_total "))
                .and_then(|v| v.trim().parse::<f64>().ok());
            assert!(refused >= Some(1.0), "the main address's refusals:\n{text}");
            assert!(text.contains("router_http_ops_connections "), "{text}");
        }
    }
    // Nothing else: not the API, not ingest.
    let resp = client()
        .get(ops_url("/v1/status"))
        .send()
        .await
        .expect("status");
    assert_eq!(resp.status().as_u16(), 404);
    let resp = client()
        .post(ops_url("/v1/events"))
        .header("content-type", "application/cloudevents+json")
        .body(r#"{"specversion":"1.0","id":"1","source":"s","type":"t"}"#)
        .send()
        .await
        .expect("post");
    assert_eq!(resp.status().as_u16(), 404);
    // Its own cap: two idle connections hold it, a third gets the 503 naming its key.
    let mut ops_idle = Vec::new();
    for _ in 0..2 {
        ops_idle.push(
            tokio::net::TcpStream::connect(ops_addr)
                .await
                .expect("connect"),
        );
    }
    let refused = eventually(Duration::from_secs(5), || async {
        let resp = client().get(ops_url("/healthz")).send().await.ok()?;
        (resp.status().as_u16() == 503).then_some(resp)
    })
    .await
    .expect("a third ops connection refused");
    let body: Value = refused.json().await.expect("json");
    let msg = body["errors"][0]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("server.ops_max_connections"), "{msg}");
    // Both counts in /v1/status once the main address has a slot again.
    drop(idle);
    let status: Value = eventually(Duration::from_secs(5), || async {
        let resp = client().get(r.url("/v1/status")).send().await.ok()?;
        if resp.status().as_u16() != 200 {
            return None;
        }
        resp.json::<Value>().await.ok()
    })
    .await
    .expect("status once the producers' connections closed");
    let ops = &status["connections"]["ops"];
    assert_eq!(ops["listen"], ops_addr.to_string(), "{status}");
    assert_eq!(ops["max"], 2, "{status}");
    assert!(ops["refused_total"].as_u64() >= Some(1), "{status}");
}

/// An ops address that is taken stops the start, naming the key.
#[test]
fn a_taken_ops_address_stops_the_start_naming_its_key() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(dir.path().join("rules")).expect("rules");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--rules")
        .arg(dir.path().join("rules"))
        .env("ROUTER_SERVER__OPS_LISTEN", addr.to_string())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot listen on {addr} (server.ops_listen)")),
        "{err}"
    );
}

/// A token removed from the configuration file (a leaked one) is refused after a reload,
/// SIGHUP or `POST /v1/admin/reload`: before, the reload re-read only rules and contracts,
/// reported success, and the token worked until a restart (the day-2 audit). Other keys
/// changed since the start are named in the reload's warnings as applying at the next
/// restart; a file that does not read leaves the tokens as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_removed_from_the_config_file_is_refused_after_a_reload() {
    let both = tokens_config(&[("ops-admin", None, "admin"), ("leaked", None, "read")]);
    let r = RouterProc::start_full(&[], &[], &[], Some(&both));
    assert_eq!(
        send_as(&r, "GET", "/v1/targets", "leaked", None).await.0,
        200
    );
    let config = r.dir.path().join("router.toml");
    let only_admin = tokens_config(&[("ops-admin", None, "admin")]);
    std::fs::write(
        &config,
        format!("{only_admin}[delivery]\nmax_in_flight = 77\n"),
    )
    .expect("config");
    r.signal("HUP");
    let refused = eventually(Duration::from_secs(20), || async {
        (send_as(&r, "GET", "/v1/targets", "leaked", None).await.0 == 401).then_some(())
    })
    .await;
    assert!(
        refused.is_some(),
        "the removed token still works after SIGHUP"
    );
    let reload = |body: &'static str| {
        let r = &r;
        async move {
            send_as(
                r,
                "POST",
                "/v1/admin/reload",
                "ops-admin",
                Some(("application/json", body.as_bytes().to_vec())),
            )
            .await
        }
    };
    let (s, body) = reload("{}").await;
    assert_eq!(s, 200, "{body}");
    let warnings = body["warnings"].to_string();
    assert!(
        warnings.contains(
            "the configuration file changed since the start: delivery.max_in_flight apply at the next restart"
        ) && !warnings.contains("auth.tokens:"),
        "{warnings}"
    );
    // A file that does not read: the tokens stay, the reload says why.
    std::fs::write(
        &config,
        format!("{only_admin}[delivery]\nmax_in_fligth = 1\n"),
    )
    .expect("config");
    let (s, body) = reload("{}").await;
    assert_eq!(s, 200, "{body}");
    assert!(
        body["warnings"]
            .to_string()
            .contains("the configuration file was not read again"),
        "{body}"
    );
    assert_eq!(
        send_as(&r, "GET", "/v1/targets", "ops-admin", None).await.0,
        200
    );
    assert_eq!(
        send_as(&r, "GET", "/v1/targets", "leaked", None).await.0,
        401
    );
}
