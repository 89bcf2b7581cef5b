//! Batched webhook delivery (`batch:` on a webhook target): one request per batch of due
//! events, all or nothing, each event keeping its own attempts and DLQ fate.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

const BATCH: &str = "application/cloudevents-batch+json";

/// Accepts `n` events with ids `{prefix}{i}` in batches of 100.
async fn accept(r: &RouterProc, prefix: &str, n: usize, data: Value) {
    let events: Vec<Value> = (0..n)
        .map(|i| event(&format!("{prefix}{i}"), "t", data.clone()))
        .collect();
    for chunk in events.chunks(100) {
        post_batch(r, chunk).await;
    }
}

/// Rules sending every `t` event to one batching webhook, `bulk`, at `url`.
fn one_batching_target(url: &str, max_events: u32) -> String {
    format!(
        "rules:
  - name: r
    pattern: {{ type: [t] }}
    targets:
      - webhook: {url}
        id: bulk
        batch: {{ max_events: {max_events} }}
"
    )
}

/// Event ids per request a receiver saw, in arrival order.
fn requests(rcv: &Receiver) -> Vec<(Vec<String>, Received)> {
    rcv.received()
        .into_iter()
        .map(|r| {
            let ids = r.body.as_array().map_or_else(Vec::new, |a| {
                a.iter()
                    .map(|e| e["id"].as_str().unwrap_or_default().to_string())
                    .collect()
            });
            (ids, r)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batching_webhook_gets_events_in_batches_and_a_failed_batch_is_retried_whole() {
    // The first request the script answers fails with a 503; every later one succeeds. (Which
    // request that is says the script, not the arrival order the receiver records: concurrent
    // requests may be recorded in one order and answered in another.)
    let calls = Arc::new(AtomicUsize::new(0));
    let failed_ids = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (c, f) = (calls.clone(), failed_ids.clone());
    let bulk = Receiver::scripted(Arc::new(move |body: &Value, _| {
        let status = if c.fetch_add(1, Ordering::SeqCst) == 0 {
            *f.lock().expect("failed ids") = body
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e["id"].as_str().map(str::to_string))
                .collect();
            503
        } else {
            200
        };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    // Events of about 2 KB against 4 KiB requests: at most one per request.
    let small = Receiver::ok().await;
    let rules = format!(
        "policies:
  fast:
    timeout: 5s
    retry: {{ max_attempts: 5, base_delay: 200ms, max_delay: 1s }}
rules:
  - name: r
    pattern: {{ type: [t] }}
    targets:
      - webhook: {}
        id: bulk
        policy: fast
        batch: {{ max_events: 40 }}
      - webhook: {}
        id: small
        batch: {{ max_events: 10, max_bytes: 4096 }}
",
        bulk.url(),
        small.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    // Paused while 250 events arrive, so that they are all due when it resumes.
    for t in ["bulk", "small"] {
        let (s, b) = post_json(&r, &format!("/v1/targets/{t}/pause"), json!({})).await;
        assert_eq!(s, 200, "{b}");
    }
    accept(&r, "b-", 250, json!({"pad": "x".repeat(2000)})).await;
    for t in ["bulk", "small"] {
        let (s, b) = post_json(&r, &format!("/v1/targets/{t}/resume"), json!({})).await;
        assert_eq!(s, 200, "{b}");
    }

    // Every event arrives, and the failed batch's events once more.
    let failed_count = || failed_ids.lock().expect("failed ids").len();
    for (rcv, extra) in [(&bulk, true), (&small, false)] {
        let all = rcv
            .wait_for(Duration::from_secs(60), |seen| {
                let events: Vec<&str> = seen
                    .iter()
                    .flat_map(|r| r.body.as_array().into_iter().flatten())
                    .filter_map(|e| e["id"].as_str())
                    .collect();
                let distinct: HashSet<&str> = events.iter().copied().collect();
                distinct.len() == 250
                    && events.len() >= 250 + if extra { failed_count() } else { 0 }
            })
            .await;
        assert!(
            all,
            "not every event arrived at {}: {:?}",
            rcv.url(),
            requests(rcv)
                .iter()
                .map(|(ids, _)| ids.len())
                .collect::<Vec<_>>()
        );
    }
    let bulk_reqs = requests(&bulk);
    for (ids, req) in &bulk_reqs {
        assert_eq!(req.header("content-type").as_deref(), Some(BATCH));
        assert!(
            !ids.is_empty() && ids.len() <= 40,
            "a request of {}",
            ids.len()
        );
        assert!(
            req.header("idempotency-key")
                .is_some_and(|k| k.starts_with("batch-")),
            "{:?}",
            req.headers
        );
    }
    assert!(
        bulk_reqs.len() < 250 / 2,
        "{} requests for 250 events: not batched",
        bulk_reqs.len()
    );
    // Exactly once each, apart from the failed batch's events: twice.
    let failed: Vec<String> = failed_ids.lock().expect("failed ids").clone();
    assert!(!failed.is_empty(), "the first batch carried events");
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (ids, _) in &bulk_reqs {
        for id in ids {
            *count.entry(id).or_default() += 1;
        }
    }
    assert_eq!(count.len(), 250);
    for (id, n) in &count {
        let want = if failed.iter().any(|f| f == id) { 2 } else { 1 };
        assert_eq!(*n, want, "{id} received {n} times");
    }
    for (ids, req) in requests(&small) {
        assert_eq!(ids.len(), 1, "2 KB events in 4 KiB requests go alone");
        let len: usize = req
            .header("content-length")
            .and_then(|v| v.parse().ok())
            .expect("content-length");
        assert!(len <= 4096 || ids.len() == 1, "{len} bytes");
    }

    // The failed batch's events each show both attempts; the others one.
    let f = eventually(Duration::from_secs(10), || async {
        let f = fate(&r, &failed[0]).await;
        let t = f["targets"]
            .as_array()?
            .iter()
            .find(|t| t["target"] == "bulk")?
            .clone();
        (t["state"] == "delivered").then_some(t)
    })
    .await
    .expect("the failed batch's first event delivered");
    let attempts = f["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 2, "{f}");
    assert_eq!(attempts[0]["status"], 503);
    assert_eq!(attempts[1]["status"], 200);

    let m = metrics_text(&r).await;
    let series = "router_delivery_batch_events_total{target=\"bulk\"}";
    assert_eq!(
        counter(&m, series) as usize,
        250 + failed.len(),
        "{}",
        metric_lines(&m, series)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_batch_sends_each_of_its_events_to_the_dlq() {
    let rejecting = Receiver::status(400).await;
    let rules = one_batching_target(&rejecting.url(), 100);
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (s, b) = post_json(&r, "/v1/targets/bulk/pause", json!({})).await;
    assert_eq!(s, 200, "{b}");
    accept(&r, "p-", 30, json!({"n": 1})).await;
    // The fate says what the entries wait for.
    let f = fate(&r, "p-0").await;
    assert!(
        f["targets"][0]["waiting_on"]
            .as_str()
            .is_some_and(|w| w.contains("paused")),
        "{f}"
    );
    let (s, b) = post_json(&r, "/v1/targets/bulk/resume", json!({})).await;
    assert_eq!(s, 200, "{b}");
    let dlq = eventually(Duration::from_secs(20), || async {
        let (_, d) = get_json(&r, "/v1/dlq?target=bulk&limit=100").await;
        let entries = d["entries"].as_array()?.clone();
        (entries.len() == 30).then_some(entries)
    })
    .await
    .expect("every event of the batch in the DLQ");
    assert!(
        dlq.iter().all(|e| e["reason"] == "permanent_error"),
        "{dlq:?}"
    );
    let sent: usize = requests(&rejecting).iter().map(|(ids, _)| ids.len()).sum();
    assert_eq!(sent, 30, "each event sent once, never retried");
    assert!(requests(&rejecting).len() < 30, "not batched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_batch_that_fills_half_a_batch_is_handed_off_as_one_request() {
    let rcv = Receiver::ok().await;
    let rules = one_batching_target(&rcv.url(), 40);
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let handoffs = || async {
        counter(
            &metrics_text(&r).await,
            "router_delivery_handoffs_total{target=\"bulk\"}",
        )
    };

    // 30 events in one request, the target idle: leased in the accept's commit and sent at
    // once as one request, in the producer's order.
    let events: Vec<Value> = (0..30)
        .map(|i| event(&format!("h-{i}"), "t", json!({"n": i})))
        .collect();
    post_batch(&r, &events).await;
    assert!(
        rcv.wait_for(Duration::from_secs(20), |seen| !seen.is_empty())
            .await,
        "nothing arrived"
    );
    let want: Vec<String> = (0..30).map(|i| format!("h-{i}")).collect();
    let got = requests(&rcv);
    assert_eq!(
        got.len(),
        1,
        "{:?}",
        got.iter().map(|(ids, _)| ids).collect::<Vec<_>>()
    );
    assert_eq!(got[0].0, want);
    assert_eq!(handoffs().await, 30);
    let f = eventually(Duration::from_secs(10), || async {
        let f = fate(&r, "h-7").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("h-7 delivered");
    assert_eq!(
        f["targets"][0]["attempts"].as_array().map(Vec::len),
        Some(1),
        "{f}"
    );

    // 50 in one request: more than one request holds, so no handoff (the reservation is one
    // slot); the worker's leases send them, in requests of at most 40 (how many depends on
    // when the leases see them: on JetStream the queue view takes them in as it reads them).
    let events: Vec<Value> = (0..50)
        .map(|i| event(&format!("s-{i}"), "t", json!({"n": i})))
        .collect();
    post_batch(&r, &events).await;
    let s_ids = |seen: &[Received]| -> Vec<String> {
        seen.iter()
            .flat_map(|r| r.body.as_array().into_iter().flatten())
            .filter_map(|e| e["id"].as_str())
            .filter(|id| id.starts_with("s-"))
            .map(str::to_string)
            .collect()
    };
    assert!(
        rcv.wait_for(Duration::from_secs(20), |seen| s_ids(seen).len() >= 50)
            .await,
        "the 50 events did not arrive"
    );
    let got = requests(&rcv);
    assert!(
        got[1..].iter().all(|(ids, _)| ids.len() <= 40),
        "{:?}",
        got.iter().map(|(ids, _)| ids.len()).collect::<Vec<_>>()
    );
    let all = s_ids(&rcv.received());
    let distinct: HashSet<&String> = all.iter().collect();
    assert_eq!((all.len(), distinct.len()), (50, 50));
    assert_eq!(handoffs().await, 30);

    // Single events are left to the queue, whose lease batches what is due: no handoff.
    for i in 0..5 {
        let (status, body) =
            post_json(&r, "/v1/events", event(&format!("one-{i}"), "t", json!({}))).await;
        assert_eq!(status, 202, "{body}");
    }
    assert!(
        rcv.wait_for(Duration::from_secs(20), |seen| {
            seen.iter()
                .flat_map(|r| r.body.as_array().into_iter().flatten())
                .filter(|e| e["id"].as_str().is_some_and(|id| id.starts_with("one-")))
                .count()
                == 5
        })
        .await,
        "the single events did not arrive"
    );
    assert_eq!(handoffs().await, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_window_gathers_single_events_and_a_full_batch_goes_at_once() {
    // `slow` waits up to 3 s for 50 events, `full` up to 60 s for 5: ten single events reach
    // `slow` as one request once its window has passed, and `full` as two full batches long
    // before its window would.
    let slow = Receiver::ok().await;
    let full = Receiver::ok().await;
    let rules = format!(
        "rules:
  - name: r
    pattern: {{ type: [t] }}
    targets:
      - webhook: {}
        id: slow
        batch: {{ max_events: 50, window: 3s }}
      - webhook: {}
        id: full
        batch: {{ max_events: 5, window: 1m }}
",
        slow.url(),
        full.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let started = std::time::Instant::now();
    let posts = (0..10).map(|i| {
        let ev = event(&format!("w-{i}"), "t", json!({"n": i}));
        let r = &r;
        async move { post_event(r, &ev).await }
    });
    for (status, body) in futures::future::join_all(posts).await {
        assert_eq!(status, 202, "{body}");
    }
    let posted = started.elapsed();
    let sizes =
        |rcv: &Receiver| -> Vec<usize> { requests(rcv).iter().map(|(ids, _)| ids.len()).collect() };

    // Two full batches of five: neither waits for the minute.
    assert!(
        full.wait_for(Duration::from_secs(30), |seen| seen.len() >= 2)
            .await,
        "full batches waited: {:?}",
        sizes(&full)
    );
    assert_eq!(sizes(&full), vec![5, 5]);

    // One request with all ten, sent when the oldest had waited 3 s (the bound below is the
    // window itself, measured from before the first event was accepted; the upper one is
    // generous for a loaded machine).
    assert!(
        slow.wait_for(Duration::from_secs(30), |seen| !seen.is_empty())
            .await,
        "nothing arrived"
    );
    let got = requests(&slow);
    let arrived = got[0].1.at.duration_since(started);
    assert!(
        arrived >= Duration::from_millis(2_900) && arrived < Duration::from_secs(20),
        "the batch arrived {arrived:?} after the first post (posting took {posted:?})"
    );
    let mut seen = got[0].0.clone();
    seen.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("w-{i}")).collect();
    want.sort();
    assert_eq!(seen, want, "{:?}", sizes(&slow));
    // Nothing more comes after it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sizes(&slow), vec![10]);
}

/// A batch that `max_bytes` splits into more requests than the target has slots sends what
/// its slots carry and puts the rest back: each event is sent once. (The rest used to wait
/// for a slot under its lease; with a slow receiver the lease ran out, the entries were
/// leased again and sent a second time, and the late answers were discarded as fenced.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_split_past_its_slots_sends_each_event_once() {
    let slow = Receiver::scripted(Arc::new(|_: &Value, _| {
        (200, Duration::from_millis(700), vec![])
    }))
    .await;
    // One request at a time, 2.5 s leases (timeout 1.5 s + margin 1 s), one ~600 B event per
    // 1 KiB request: eight requests take about 6 s, past any one lease.
    let rules = format!(
        "policies:
  one-at-a-time:
    timeout: 1500ms
    throttle: {{ max_concurrency: 1 }}
rules:
  - name: r
    pattern: {{ type: [t] }}
    targets:
      - webhook: {}
        id: bulk
        policy: one-at-a-time
        batch: {{ max_events: 100, max_bytes: 1024 }}
",
        slow.url()
    );
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[],
        Some("[delivery]\nlease_margin = \"1s\"\n"),
    );
    let (s, b) = post_json(&r, "/v1/targets/bulk/pause", json!({})).await;
    assert_eq!(s, 200, "{b}");
    accept(&r, "s-", 8, json!({"pad": "x".repeat(500)})).await;
    let (s, b) = post_json(&r, "/v1/targets/bulk/resume", json!({})).await;
    assert_eq!(s, 200, "{b}");
    let ids = |rcv: &Receiver| -> Vec<String> {
        requests(rcv).into_iter().flat_map(|(ids, _)| ids).collect()
    };
    assert!(
        slow.wait_for(Duration::from_secs(60), |seen| seen.len() >= 8)
            .await,
        "{:?}",
        ids(&slow)
    );
    // Time for a duplicate to show, had a lease run out.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = ids(&slow);
    let distinct: HashSet<&String> = seen.iter().collect();
    assert_eq!((seen.len(), distinct.len()), (8, 8), "{seen:?}");
    assert!(
        requests(&slow).iter().all(|(ids, _)| ids.len() == 1),
        "one event per 1 KiB request"
    );
    for i in 0..8 {
        let f = fate(&r, &format!("s-{i}")).await;
        assert_eq!(f["targets"][0]["state"], "delivered", "{f}");
        assert_eq!(f["targets"][0]["attempt_count"], 1, "{f}");
    }
}

/// A receiver that answers 413 to a batch refuses the request, not its events: they go back
/// to the queue unattempted and go again in smaller batches (each of them used to go to the
/// DLQ as a permanent error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_as_too_large_is_sent_again_in_smaller_batches() {
    // Takes at most 5 events per request.
    let rcv = Receiver::scripted(Arc::new(|body: &Value, _| {
        let n = body.as_array().map_or(1, Vec::len);
        (if n > 5 { 413 } else { 200 }, Duration::ZERO, vec![])
    }))
    .await;
    let r = RouterProc::start(&[("r.yaml", &one_batching_target(&rcv.url(), 20))], &[]);
    let (s, b) = post_json(&r, "/v1/targets/bulk/pause", json!({})).await;
    assert_eq!(s, 200, "{b}");
    accept(&r, "big-", 20, json!({})).await;
    let (s, b) = post_json(&r, "/v1/targets/bulk/resume", json!({})).await;
    assert_eq!(s, 200, "{b}");
    let delivered = |seen: &[Received]| -> HashSet<String> {
        seen.iter()
            .filter(|r| r.body.as_array().is_some_and(|a| a.len() <= 5))
            .flat_map(|r| r.body.as_array().into_iter().flatten())
            .filter_map(|e| e["id"].as_str().map(str::to_string))
            .collect()
    };
    assert!(
        rcv.wait_for(Duration::from_secs(30), |seen| delivered(seen).len() == 20)
            .await,
        "{:?}",
        requests(&rcv)
            .iter()
            .map(|(ids, _)| ids.len())
            .collect::<Vec<_>>()
    );
    let (_, dlq) = get_json(&r, "/v1/dlq?target=bulk").await;
    assert_eq!(dlq["entries"].as_array().map(Vec::len), Some(0), "{dlq}");
    for i in [0, 19] {
        let f = fate(&r, &format!("big-{i}")).await;
        assert_eq!(f["targets"][0]["state"], "delivered", "{f}");
        assert_eq!(
            f["targets"][0]["attempt_count"], 1,
            "the refusals are not attempts: {f}"
        );
    }
}
