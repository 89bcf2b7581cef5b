//! `nats:` targets against the real NATS server with JetStream at 127.0.0.1:4222 (started on
//! the development and CI machines before the tests run; a test fails, saying so, when it is
//! not reachable). Every test uses its own subjects and streams, and deletes the streams it
//! made, so parallel and repeated runs never see each other's messages.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::harness::*;

const NATS_URL: &str = "nats://127.0.0.1:4222";

/// Short waits between retries, so a scenario that waits for a stream takes seconds.
const FAST_RETRY: &str = "  fast:\n    timeout: 2s\n    retry: { max_attempts: 200, base_delay: 100ms, max_delay: 500ms, jitter: none }";

/// The test's own client of the NATS server.
async fn nats() -> async_nats::Client {
    let connect = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .connect(NATS_URL);
    match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "the NATS server (with JetStream) at {NATS_URL} is not reachable: {e}. The nats \
             end-to-end tests need it: run `nats-server -js -a 127.0.0.1 -p 4222` (the project's \
             machines and CI start it before the tests)"
        ),
        Err(_) => panic!(
            "the NATS server at {NATS_URL} did not complete a handshake within 10s; the nats \
             end-to-end tests need a NATS server with JetStream there"
        ),
    }
}

/// A name no other test, run or process uses: `<prefix>-<pid>-<nanos>-<n>`.
fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A subject of this test alone.
fn unique_subject(what: &str) -> String {
    format!("router-e2e.{}", unique(what))
}

/// A JetStream stream capturing one subject, deleted when dropped (a failed test's too).
struct TempStream {
    name: String,
    stream: jetstream::stream::Stream,
}

impl TempStream {
    async fn create(client: &async_nats::Client, subject: &str) -> Self {
        let name = unique("router-e2e");
        let stream = jetstream::new(client.clone())
            .create_stream(jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![subject.to_string()],
                // Should a run die before dropping it, its messages expire on their own.
                max_age: Duration::from_secs(3600),
                ..Default::default()
            })
            .await
            .expect("create stream");
        Self { name, stream }
    }

    async fn messages(&mut self) -> u64 {
        self.stream
            .info()
            .await
            .expect("stream info")
            .state
            .messages
    }
}

impl Drop for TempStream {
    fn drop(&mut self) {
        // A runtime and client of its own: the test's may be unwinding.
        let name = self.name.clone();
        let deleted = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let client = async_nats::connect(NATS_URL).await.ok()?;
                jetstream::new(client).delete_stream(&name).await.ok()
            })
        })
        .join();
        if !matches!(deleted, Ok(Some(_))) {
            eprintln!("could not delete the test stream {}", self.name);
        }
    }
}

fn header(msg: &async_nats::HeaderMap, name: &str) -> Option<String> {
    msg.get(name).map(|v| v.as_str().to_string())
}

/// A port on loopback that nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The fate of `id` once its only target is in `state` (and `check` holds), within `within`.
async fn fate_when(
    r: &RouterProc,
    id: &str,
    within: Duration,
    check: impl Fn(&Value) -> bool,
) -> Option<Value> {
    eventually(within, || async {
        let f = fate(r, id).await;
        check(&f["targets"][0]).then_some(f)
    })
    .await
}

/// One event to a subscribed subject over core NATS: exactly one message, the structured
/// CloudEvent, with the idempotency key as `Nats-Msg-Id`.
async fn one_core_message(config: &str) {
    let nc = nats().await;
    let subject = unique_subject("core");
    let mut sub = nc.subscribe(subject.clone()).await.expect("subscribe");
    nc.flush().await.expect("flush");
    let rules = rules_yaml(
        "",
        &[("to-nats", "order.paid", &[format!("nats: {subject}")])],
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(config));
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut ev = event("n-1", "order.paid", json!({"order_id": "A-1", "total": 42}));
    ev["traceparent"] = json!(tp);
    let (status, body) = post_event(&r, &ev).await;
    assert_eq!(status, 202, "{body}");
    // Generous: the router connects to NATS when its target starts, before the event.
    let msg = tokio::time::timeout(Duration::from_secs(20), sub.next())
        .await
        .expect("a message within 20s")
        .expect("subscription open");
    let payload: Value = serde_json::from_slice(&msg.payload).expect("JSON payload");
    assert_eq!(payload["specversion"], "1.0");
    assert_eq!(payload["id"], "n-1");
    assert_eq!(payload["source"], "/test");
    assert_eq!(payload["type"], "order.paid");
    assert_eq!(payload["data"], json!({"order_id": "A-1", "total": 42}));
    let headers = msg.headers.expect("headers");
    let msg_id = header(&headers, "Nats-Msg-Id").expect("Nats-Msg-Id");
    assert_eq!(header(&headers, "Idempotency-Key"), Some(msg_id.clone()));
    assert_eq!(
        header(&headers, "Content-Type").as_deref(),
        Some("application/cloudevents+json")
    );
    assert_eq!(header(&headers, "traceparent").as_deref(), Some(tp));
    // Exactly one: nothing else arrives in the next second.
    let more = tokio::time::timeout(Duration::from_secs(1), sub.next()).await;
    assert!(more.is_err(), "a second message: {more:?}");
    let f = fate_when(&r, "n-1", Duration::from_secs(10), |t| {
        t["state"] == "delivered"
    })
    .await
    .expect("fate shows delivered");
    assert_eq!(f["targets"][0]["idempotency_key"], json!(msg_id));
    // An attempt waits up to nats.connect_timeout (2 s) for the connection the router opens
    // at start, so the first one normally delivers; on a machine loaded enough to take longer
    // it fails as a connection failure, and the retry delivers. Either way, one message.
    let attempts = f["targets"][0]["attempts"].as_array().expect("attempts");
    let (last, earlier) = attempts.split_last().expect("an attempt");
    assert_eq!(last["result"], "delivered", "{f}");
    for a in earlier {
        assert!(
            a["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("connection failed: not connected to NATS")),
            "{f}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_core_publishes_one_message_with_the_idempotency_key() {
    one_core_message("[nats]\nack = \"core\"\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_auto_without_a_stream_falls_back_to_core_nats() {
    // The default `nats.ack` is auto; no stream captures the test's subject.
    one_core_message(&format!("[nats]\nurl = \"{NATS_URL}\"\n")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stores_every_event_once_with_distinct_message_ids() {
    const N: usize = 50;
    let nc = nats().await;
    // The stream captures a wildcard; a core subscriber listens to the subject as well, and
    // must see each event once (it gets the JetStream publish; the stream answers it).
    let base = unique_subject("js");
    let subject = format!("{base}.orders");
    let mut stream = TempStream::create(&nc, &format!("{base}.>")).await;
    let mut sub = nc.subscribe(subject.clone()).await.expect("subscribe");
    nc.flush().await.expect("flush");
    let rules = rules_yaml(
        "",
        &[("to-js", "order.paid", &[format!("nats: {subject}")])],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    for i in 0..N {
        let (status, body) = post_event(
            &r,
            &event(&format!("j-{i}"), "order.paid", json!({ "n": i })),
        )
        .await;
        assert_eq!(status, 202, "{body}");
    }
    // Generous for a loaded 2-core machine; it takes well under a second here.
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream.messages().await < N as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..N {
        fate_when(&r, &format!("j-{i}"), Duration::from_secs(10), |t| {
            t["state"] == "delivered"
        })
        .await
        .unwrap_or_else(|| panic!("j-{i} delivered"));
    }
    assert_eq!(stream.messages().await, N as u64, "exactly N messages");
    let mut seen = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
        seen.push(m);
    }
    assert_eq!(seen.len(), N, "the core subscriber saw each event once");
    let mut msg_ids = HashSet::new();
    let mut event_ids = HashSet::new();
    for seq in 1..=N as u64 {
        let m = stream.stream.get_raw_message(seq).await.expect("message");
        let payload: Value = serde_json::from_slice(&m.payload).expect("JSON payload");
        event_ids.insert(payload["id"].as_str().expect("id").to_string());
        let id = header(&m.headers, "Nats-Msg-Id").expect("Nats-Msg-Id");
        assert_eq!(header(&m.headers, "Idempotency-Key"), Some(id.clone()));
        msg_ids.insert(id);
    }
    assert_eq!(msg_ids.len(), N, "distinct Nats-Msg-Id per event");
    let want: HashSet<String> = (0..N).map(|i| format!("j-{i}")).collect();
    assert_eq!(event_ids, want);
    // The stream's duplicate window is what makes a retry harmless: the same message id
    // again is acknowledged as a duplicate and not stored.
    let some_id = msg_ids.iter().next().expect("an id").clone();
    let ack = jetstream::new(nc.clone())
        .send_publish(
            subject.clone(),
            jetstream::message::PublishMessage::build()
                .payload("again".into())
                .message_id(some_id),
        )
        .await
        .expect("publish")
        .await
        .expect("ack");
    assert!(ack.duplicate, "{ack:?}");
    assert_eq!(stream.messages().await, N as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_jetstream_waits_for_a_stream_then_delivers_into_it() {
    let nc = nats().await;
    let subject = unique_subject("wait");
    let rules = rules_yaml(
        FAST_RETRY,
        &[(
            "to-js",
            "order.paid",
            &[format!("nats: {subject}\n        policy: fast")],
        )],
    );
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[],
        Some("[nats]\nack = \"jetstream\"\n"),
    );
    let (status, body) = post_event(&r, &event("w-1", "order.paid", json!({"x": 1}))).await;
    assert_eq!(status, 202, "{body}");
    let want = format!("no JetStream stream captures subject {subject}");
    let retrying = fate_when(&r, "w-1", Duration::from_secs(20), |t| {
        t["state"] == "retrying" && t["last_error"].as_str().is_some_and(|e| e.contains(&want))
    })
    .await;
    let Some(f) = retrying else {
        panic!(
            "fate never showed retrying with {want:?}: {}",
            fate(&r, "w-1").await
        )
    };
    assert_eq!(f["targets"][0]["attempts"][0]["result"], "retryable");
    assert!(f["dlq"].as_array().is_some_and(Vec::is_empty), "{f}");
    // Nothing went out as core NATS meanwhile: the stream gets the first and only copy.
    let mut stream = TempStream::create(&nc, &subject).await;
    // Retries come every 500 ms at most; 20 s is generous.
    let f = fate_when(&r, "w-1", Duration::from_secs(20), |t| {
        t["state"] == "delivered"
    })
    .await
    .expect("delivered once the stream exists");
    assert_eq!(stream.messages().await, 1);
    let m = stream.stream.get_raw_message(1).await.expect("message");
    let payload: Value = serde_json::from_slice(&m.payload).expect("JSON payload");
    assert_eq!(payload["id"], "w-1");
    assert_eq!(
        header(&m.headers, "Nats-Msg-Id").map(Value::from),
        Some(f["targets"][0]["idempotency_key"].clone())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_keeps_events_queued_until_it_is_there() {
    let nc = nats().await;
    let subject = unique_subject("down");
    let mut sub = nc.subscribe(subject.clone()).await.expect("subscribe");
    nc.flush().await.expect("flush");
    let port = closed_port();
    let rules = rules_yaml(
        FAST_RETRY,
        &[(
            "to-nats",
            "order.paid",
            &[format!("nats: {subject}\n        policy: fast")],
        )],
    );
    let mut r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[],
        Some(&format!(
            "[nats]\nurl = \"nats://127.0.0.1:{port}\"\nconnect_timeout = \"200ms\"\n"
        )),
    );
    // The router started with NATS down, and ingests.
    let (status, body) = post_event(&r, &event("d-1", "order.paid", json!({"x": 1}))).await;
    assert_eq!(status, 202, "{body}");
    let want = format!("connection failed: not connected to NATS at nats://127.0.0.1:{port}");
    let retrying = fate_when(&r, "d-1", Duration::from_secs(20), |t| {
        t["state"] == "retrying"
            && t["last_error"]
                .as_str()
                .is_some_and(|e| e.starts_with(&want))
    })
    .await;
    let Some(f) = retrying else {
        panic!(
            "fate never showed retrying with {want:?}: {}",
            fate(&r, "d-1").await
        )
    };
    assert!(f["dlq"].as_array().is_some_and(Vec::is_empty), "{f}");
    // A client still trying to connect does not hold up a clean stop.
    let stopped = Instant::now();
    let status = r.sigterm();
    assert!(status.success(), "exit status {status:?}\n{}", r.log_text());
    assert!(
        stopped.elapsed() < Duration::from_secs(15),
        "{:?}",
        stopped.elapsed()
    );
    // Nothing lost: the same data directory, now pointed at the real server (an environment
    // override of the file's nats.url), delivers the queued event.
    r.set_env("ROUTER_NATS__URL", Some(NATS_URL));
    r.restart();
    let msg = tokio::time::timeout(Duration::from_secs(20), sub.next())
        .await
        .expect("the queued event arrives after the restart")
        .expect("subscription open");
    let payload: Value = serde_json::from_slice(&msg.payload).expect("JSON payload");
    assert_eq!(payload["id"], "d-1");
    fate_when(&r, "d-1", Duration::from_secs(10), |t| {
        t["state"] == "delivered"
    })
    .await
    .expect("delivered");
    let more = tokio::time::timeout(Duration::from_secs(1), sub.next()).await;
    assert!(more.is_err(), "a second message: {more:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_nats_targets_never_connects() {
    let hook = Receiver::ok().await;
    let rules = rules_yaml("", &[("r", "t", &[format!("webhook: {}", hook.url())])]);
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[],
        Some(&format!(
            "[nats]\nurl = \"nats://127.0.0.1:{}\"\n",
            closed_port()
        )),
    );
    assert_eq!(post_event(&r, &event("e-1", "t", json!({}))).await.0, 202);
    assert!(
        hook.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
    // Long enough for a client to have tried and logged a few connects.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = r.log_text().to_lowercase();
    assert!(!log.contains("nats"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_servers_max_payload_goes_to_the_dlq_at_once() {
    let nc = nats().await;
    let max_payload = nc.server_info().max_payload;
    let subject = unique_subject("big");
    let rules = rules_yaml(
        FAST_RETRY,
        &[(
            "to-nats",
            "order.paid",
            &[format!("nats: {subject}\n        policy: fast")],
        )],
    );
    // Ingest takes twice the server's limit, so the event is accepted and cannot be published.
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[],
        Some(&format!("[ingest]\nmax_body_bytes = {}\n", 2 * max_payload)),
    );
    let big = "x".repeat(max_payload + 1024);
    let (status, body) = post_event(&r, &event("b-1", "order.paid", json!({ "blob": big }))).await;
    assert_eq!(status, 202, "{body}");
    let f = fate_when(&r, "b-1", Duration::from_secs(20), |t| t["state"] == "dlq")
        .await
        .expect("dead-lettered");
    let target = &f["targets"][0];
    assert_eq!(target["attempt_count"], 1, "not retried: {f}");
    assert_eq!(target["attempts"][0]["result"], "permanent");
    assert!(
        target["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("message too large for NATS")),
        "{f}"
    );
    assert_eq!(f["dlq"][0]["reason"], "permanent_error", "{f}");
}
