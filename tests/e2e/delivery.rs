//! Fan-out, retries, permanent failures, isolation between targets, DLQ and fate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

const FAST_RETRY: &str = "  fast:\n    timeout: 2s\n    retry: { max_attempts: 5, base_delay: 200ms, max_delay: 2s, jitter: none }";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_reaches_three_webhooks_once_each() {
    let (a, b, c) = (
        Receiver::ok().await,
        Receiver::ok().await,
        Receiver::ok().await,
    );
    let rules = rules_yaml(
        "",
        &[(
            "orders",
            "order.created",
            &[
                format!("webhook: {}", a.url()),
                format!("webhook: {}", b.url()),
                format!("webhook: {}", c.url()),
            ],
        )],
    );
    let r = RouterProc::start(&[("orders.yaml", &rules)], &[]);
    let mut ev = event("o-1", "order.created", json!({"total": 10}));
    ev["traceparent"] = json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    let (status, body) = post_event(&r, &ev).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["results"][0]["status"], "accepted");
    for rcv in [&a, &b, &c] {
        assert!(
            rcv.wait_for(Duration::from_secs(10), |s| !s.is_empty())
                .await,
            "a target got nothing"
        );
    }
    // Give any stray duplicate a moment to show up, then check exactly-once in the happy path.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut keys = std::collections::HashSet::new();
    for rcv in [&a, &b, &c] {
        let got = rcv.received();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].body["id"], "o-1");
        assert_eq!(got[0].body["data"]["total"], 10);
        assert_eq!(
            got[0].header("content-type").as_deref(),
            Some("application/cloudevents+json")
        );
        assert_eq!(
            got[0].header("traceparent").as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        keys.insert(got[0].header("idempotency-key").expect("idempotency key"));
    }
    assert_eq!(keys.len(), 3, "each target has its own idempotency key");
    let f = eventually(Duration::from_secs(5), || async {
        let f = fate(&r, "o-1").await;
        let all = f["targets"]
            .as_array()?
            .iter()
            .all(|t| t["state"] == "delivered");
        all.then_some(f)
    })
    .await
    .expect("fate shows delivered everywhere");
    assert_eq!(f["matched_rules"], json!(["orders"]));
    assert_eq!(f["targets"].as_array().map(Vec::len), Some(3));
    assert_eq!(f["targets"][0]["attempts"][0]["status"], 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_are_retried_with_growing_waits() {
    // 500 for the first two attempts, then 200. jitter: none makes the waits exact caps.
    let flaky = Receiver::scripted(Arc::new(|_, n| {
        (if n < 2 { 500 } else { 200 }, Duration::ZERO, vec![])
    }))
    .await;
    let rules = rules_yaml(
        FAST_RETRY,
        &[(
            "r",
            "t",
            &[format!("webhook: {}\n        policy: fast", flaky.url())],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(
        flaky
            .wait_for(Duration::from_secs(15), |s| s.len() >= 3)
            .await,
        "third attempt never came"
    );
    let got = flaky.received();
    let w1 = got[1].at - got[0].at;
    let w2 = got[2].at - got[1].at;
    // Waits are base·2^(n-1): 200 ms then 400 ms (lower bounds exact; upper bounds generous
    // for a loaded CI machine).
    assert!(
        w1 >= Duration::from_millis(190) && w1 < Duration::from_secs(3),
        "first wait {w1:?}"
    );
    assert!(
        w2 >= Duration::from_millis(390) && w2 < Duration::from_secs(4),
        "second wait {w2:?}"
    );
    assert!(w2 > w1, "waits grow: {w1:?} then {w2:?}");
    let keys: std::collections::HashSet<_> =
        got.iter().map(|g| g.header("idempotency-key")).collect();
    assert_eq!(keys.len(), 1, "Idempotency-Key is stable across retries");
    let f = eventually(Duration::from_secs(5), || async {
        let f = fate(&r, "e1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("delivered");
    let attempts = f["targets"][0]["attempts"]
        .as_array()
        .expect("attempts")
        .clone();
    assert_eq!(attempts.len(), 3);
    assert_eq!(attempts[0]["status"], 500);
    assert_eq!(attempts[0]["result"], "retryable");
    assert_eq!(attempts[2]["result"], "delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_goes_to_the_dlq_at_once_and_others_are_unaffected() {
    let bad = Receiver::status(400).await;
    let good = Receiver::ok().await;
    let rules = rules_yaml(
        FAST_RETRY,
        &[(
            "r",
            "t",
            &[
                format!(
                    "webhook: {}\n        id: strict-target\n        policy: fast",
                    bad.url()
                ),
                format!("webhook: {}\n        id: happy-target", good.url()),
            ],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_event(&r, &event("e1", "t", json!({"x": 1}))).await.0,
        202
    );
    assert!(
        good.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
    let list = eventually(Duration::from_secs(10), || async {
        let (_, l) = get_json(&r, "/v1/dlq?target=strict-target").await;
        (l["entries"].as_array().map(Vec::len) == Some(1)).then_some(l)
    })
    .await
    .expect("one DLQ entry");
    let entry = &list["entries"][0];
    assert_eq!(entry["reason"], "permanent_error");
    assert_eq!(entry["target"], "strict-target");
    assert_eq!(entry["rule"], "r");
    assert_eq!(entry["attempt_count"], 1);
    assert_eq!(entry["attempts"][0]["status"], 400);
    assert_eq!(bad.count(), 1, "a permanent failure is not retried");
    // Show one entry: the full event is there. Reading twice changes nothing.
    let id = entry["id"].as_str().expect("id").to_string();
    let (s1, one) = get_json(&r, &format!("/v1/dlq/{id}")).await;
    let (_, again) = get_json(&r, &format!("/v1/dlq/{id}")).await;
    assert_eq!(s1, 200);
    assert_eq!(one, again);
    assert_eq!(one["event"]["data"]["x"], 1);
    // Filters.
    let (_, none) = get_json(&r, "/v1/dlq?reason=retries_exhausted").await;
    assert_eq!(none["entries"].as_array().map(Vec::len), Some(0));
    let (s, _) = get_json(&r, "/v1/dlq?reason=nonsense").await;
    assert_eq!(s, 400);
    let f = fate(&r, "e1").await;
    let states: Vec<_> = f["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .map(|t| (t["target"].clone(), t["state"].clone()))
        .collect();
    assert!(
        states.contains(&(json!("strict-target"), json!("dlq"))),
        "{states:?}"
    );
    assert!(
        states.contains(&(json!("happy-target"), json!("delivered"))),
        "{states:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_exhausted_end_in_the_dlq_with_every_attempt() {
    let down = Receiver::status(503).await;
    let policy = "  short:\n    timeout: 1s\n    retry: { max_attempts: 3, base_delay: 50ms, max_delay: 100ms }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!("webhook: {}\n        policy: short", down.url())],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    let list = eventually(Duration::from_secs(10), || async {
        let (_, l) = get_json(&r, "/v1/dlq").await;
        (l["entries"].as_array().map(Vec::len) == Some(1)).then_some(l)
    })
    .await
    .expect("dead-lettered");
    assert_eq!(list["entries"][0]["reason"], "retries_exhausted");
    assert_eq!(list["entries"][0]["attempt_count"], 3);
    assert_eq!(down.count(), 3);
    let errors: Vec<_> = list["entries"][0]["attempts"]
        .as_array()
        .expect("attempts")
        .iter()
        .map(|a| a["status"].clone())
        .collect();
    assert_eq!(errors, vec![json!(503), json!(503), json!(503)]);
}

/// A target that is down (connection refused) or hangs must not delay a healthy one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_slow_target_does_not_delay_others() {
    let healthy = Receiver::ok().await;
    let slow = Receiver::scripted(Arc::new(|_, _| (200, Duration::from_secs(20), vec![]))).await;
    // A port with nothing listening.
    let dead_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let policy =
        "  p:\n    timeout: 30s\n    retry: { max_attempts: 10, base_delay: 100ms, max_delay: 1s }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[
                format!("webhook: {}\n        id: healthy", healthy.url()),
                format!(
                    "webhook: {}\n        id: slow\n        policy: p",
                    slow.url()
                ),
                format!(
                    "webhook: http://127.0.0.1:{dead_port}/hook\n        id: dead\n        policy: p"
                ),
            ],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let n = 200;
    let started = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|i| event(&format!("e{i}"), "t", json!({"i": i})))
            .collect();
        post_batch(&r, &batch).await;
    }
    assert!(
        healthy
            .wait_for(Duration::from_secs(20), |s| s.len() >= n)
            .await,
        "healthy target got {} of {n}",
        healthy.count()
    );
    let took = started.elapsed();
    eprintln!("healthy target received {n} events in {took:?} while the others were slow/dead");
    // The slow target holds at most its concurrency in flight; the healthy one finished long
    // before a single slow attempt (20 s) could complete.
    assert!(
        took < Duration::from_secs(15),
        "healthy delivery took {took:?}"
    );
    let (_, t) = get_json(&r, "/v1/targets").await;
    let targets = t["targets"].as_array().expect("targets");
    let slow_t = targets
        .iter()
        .find(|x| x["id"] == "slow")
        .expect("slow listed");
    assert!(slow_t["in_flight"].as_u64().unwrap_or(0) > 0, "{slow_t}");
    assert!(slow_t["oldest_age_seconds"].as_f64().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_status_answer() {
    let ok = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &ok.url(), "m");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(ok.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    assert_eq!(get_json(&r, "/healthz").await.0, 200);
    assert_eq!(get_json(&r, "/readyz").await.0, 200);
    let (s, st) = get_json(&r, "/v1/status").await;
    assert_eq!(s, 200);
    assert_eq!(st["ready"], true);
    assert_eq!(st["rules"]["rules"], 1);
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"][0]["name"], "r");
    assert_eq!(rules["rules"][0]["line"], 2);
    let text = eventually(Duration::from_secs(5), || async {
        let t = client()
            .get(r.url("/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        t.contains("router_deliveries_total{target=\"m\",result=\"delivered\"} 1")
            .then_some(t)
    })
    .await
    .expect("delivery counted");
    for m in [
        "router_ingest_events_total{status=\"accepted\"} 1",
        "router_queue_depth{target=\"m\"} 0",
        "router_store_commit_seconds_bucket",
        "router_queue_oldest_age_seconds",
        "router_dlq_depth{target=\"m\"} 0",
    ] {
        assert!(text.contains(m), "missing {m} in\n{text}");
    }
}

/// Each thread of the router process by name, with its nice value (from `/proc`).
#[cfg(target_os = "linux")]
fn thread_nices(pid: u32) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc task dir") {
        let dir = task.expect("task entry").path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue; // the thread ended while we looked
        };
        // Fields after the parenthesised name: state is field 3, nice field 19.
        let rest = &stat[stat.rfind(')').expect("stat has a name") + 2..];
        let nice: i64 = rest
            .split(' ')
            .nth(16)
            .expect("nice field")
            .parse()
            .expect("nice");
        out.push((comm.trim().to_string(), nice));
    }
    out
}

/// Delivery runs on threads of its own at `delivery.nice` above ingest's priority, so a
/// saturated machine answers producers first; events are still delivered from them.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_runs_on_its_own_threads_below_ingests_priority() {
    let ok = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &ok.url(), "w");
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[
            ("ROUTER_DELIVERY__NICE", "7"),
            ("ROUTER_DELIVERY__THREADS", "3"),
        ],
    );
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(ok.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    let (_, st) = get_json(&r, "/v1/status").await;
    // The test process runs at some nice value n; the router inherits it, delivery is n + 7.
    let threads = thread_nices(r.pid());
    let ingest: Vec<i64> = threads
        .iter()
        .filter(|(name, _)| name == "router-ingest")
        .map(|(_, n)| *n)
        .collect();
    let delivery: Vec<i64> = threads
        .iter()
        .filter(|(name, _)| name == "router-delivery")
        .map(|(_, n)| *n)
        .collect();
    assert!(!ingest.is_empty(), "no ingest threads in {threads:?}");
    let base = ingest[0];
    assert!(ingest.iter().all(|n| *n == base), "{threads:?}");
    let want = (base + 7).min(19);
    assert!(delivery.len() >= 3, "three delivery workers in {threads:?}");
    assert!(delivery.iter().all(|n| *n == want), "{threads:?}");
    let d = &st["delivery"];
    assert_eq!(
        (&d["threads"], &d["nice"], &d["error"]),
        (&json!(3), &json!(want), &json!(null)),
        "{st}"
    );
    // The one attempt may still be ending when the receiver has seen it.
    assert!(d["in_flight"].as_u64().is_some_and(|n| n <= 1), "{st}");
    assert!(
        st["delivery"]["max_in_flight"]
            .as_u64()
            .is_some_and(|n| (64..=4096).contains(&n)),
        "derived from the open-file limit: {st}"
    );
}

/// A finish the store refuses as contended (its records kept changing under concurrent
/// finishes; forced here with a failure point, as one test cannot make a store lose that race
/// sixteen times in a row) puts the entry back without counting the attempt: the event is
/// sent again and delivered, its fate shows one attempt, and the metric counts the contention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_finish_is_retried_without_counting_the_attempt() {
    let rcv = Receiver::ok().await;
    let rules = format!(
        "policies:\n{FAST_RETRY}\nrules:\n  - name: r\n    pattern: {{ type: [order.created] }}\n    targets:\n      - webhook: {}\n        id: hook\n        policy: fast\n",
        rcv.url()
    );
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("EVENT_ROUTER_FAIL_AT", "finish_contended:hook")],
    );
    let (status, body) = post_event(&r, &event("c-1", "order.created", json!({}))).await;
    assert_eq!(status, 202, "{body}");
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "c-1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("delivered after the contended finish");
    assert_eq!(f["targets"][0]["attempt_count"], 1, "{f}");
    assert_eq!(
        rcv.count(),
        2,
        "sent once for the refused finish, once more"
    );
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_deliveries_total{target=\"hook\",result=\"contended\"} 1"),
        "{}",
        metric_lines(&m, "router_deliveries_total")
    );
}

/// `count` receivers that answer 200 after `delay`, and the most requests all of them had in
/// flight at once. A request counts as in flight until shortly before its answer goes out,
/// after `delay` (the receiver's own sleep); the router can send the next one only after
/// reading that answer. The count is dropped 25 ms before the answer: dropped by a timer of
/// the same deadline as the answer's, it raced it, and on a loaded machine the router read
/// the answer, sent its next request and had it counted before the drop ran (a peak of 17
/// at a cap of 16). A cap broken by the router would overlap for most of the 250 ms of a
/// request, and still be counted.
async fn receivers_counting_overlap(
    count: usize,
    delay: Duration,
) -> (Vec<Receiver>, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let current = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let mut receivers = Vec::new();
    for _ in 0..count {
        let (current, peak) = (current.clone(), peak.clone());
        receivers.push(
            Receiver::scripted(Arc::new(move |_, _| {
                let now = current.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let current = current.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay.saturating_sub(Duration::from_millis(25))).await;
                    current.fetch_sub(1, Ordering::SeqCst);
                });
                (200, delay, vec![])
            }))
            .await,
        );
    }
    (receivers, peak)
}

/// `delivery.max_in_flight` bounds the attempts in flight across all targets: 20 webhook
/// targets of one rule, 8 slots each (160 in all), against slow receivers, with the cap at 16.
/// The receivers never see more than 16 requests at once, every event reaches every target
/// exactly once, and waiting for a permit spends no attempt (nothing is retried or put back:
/// entries wait unleased in their queues). Before the cap the receivers saw up to 160.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_bounds_attempts_across_all_targets() {
    use std::sync::atomic::Ordering;
    const TARGETS: usize = 20;
    const EVENTS: usize = 12;
    const CAP: usize = 16;
    // Long enough that the targets' 160 slots would all be busy at once without the cap.
    let (receivers, peak) = receivers_counting_overlap(TARGETS, Duration::from_millis(250)).await;
    let targets: Vec<String> = receivers
        .iter()
        .enumerate()
        .map(|(i, rc)| format!("webhook: {}\n        id: t{i}", rc.url()))
        .collect();
    let rules = rules_yaml("", &[("fan", "fan.out", &targets)]);
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[
            ("ROUTER_DELIVERY__CONCURRENCY", "8"),
            ("ROUTER_DELIVERY__MAX_IN_FLIGHT", "16"),
        ],
    );
    let events: Vec<_> = (0..EVENTS)
        .map(|i| event(&format!("e{i}"), "fan.out", json!({ "i": i })))
        .collect();
    post_batch(&r, &events).await;
    // 240 requests of 250 ms, 16 at a time: about 4 s; generous for a loaded machine.
    for (i, rc) in receivers.iter().enumerate() {
        assert!(
            rc.wait_for(Duration::from_secs(120), |s| s.len() >= EVENTS)
                .await,
            "target t{i} got {} of {EVENTS}",
            rc.count()
        );
    }
    assert!(queues_drained(&r, Duration::from_secs(30)).await);
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= CAP,
        "the receivers saw {peak} requests at once (cap {CAP})"
    );
    // The cap was reached (the test shows the bound, not an idle router).
    assert!(peak >= CAP / 2, "peak {peak}");
    for (i, rc) in receivers.iter().enumerate() {
        assert_eq!(rc.count(), EVENTS, "t{i}: each event exactly once");
        assert_eq!(rc.distinct_ids().len(), EVENTS, "t{i}");
    }
    let m = metrics_text(&r).await;
    for i in 0..TARGETS {
        assert_eq!(
            counter(
                &m,
                &format!("router_deliveries_total{{target=\"t{i}\",result=\"delivered\"}}")
            ),
            EVENTS as u64,
            "{}",
            metric_lines(&m, "router_deliveries_total")
        );
    }
    assert!(
        !m.contains("result=\"retried\"") && !m.contains("result=\"deferred\""),
        "waiting for a permit spends no attempt: {}",
        metric_lines(&m, "router_deliveries_total")
    );
    assert!(counter(&m, "router_delivery_permit_waits_total") > 0, "{m}");
    assert_eq!(counter(&m, "router_delivery_max_in_flight"), CAP as u64);
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(st["delivery"]["max_in_flight"], json!(CAP), "{st}");
    assert_eq!(st["delivery"]["in_flight"], json!(0), "{st}");
    // Each entry's fate: one attempt, delivered.
    let f = fate(&r, "e0").await;
    let per_target = f["targets"].as_array().expect("targets");
    assert_eq!(per_target.len(), TARGETS, "{f}");
    assert!(
        per_target
            .iter()
            .all(|t| t["attempts"].as_array().is_some_and(|a| a.len() == 1)),
        "one attempt per target: {f}"
    );
}

/// `delivery.max_in_flight_bytes` bounds the bytes of events that leased deliveries hold
/// across all targets: 10 webhook targets with slow receivers, 4 events of 512 KiB each,
/// the cap at 4 MiB. The receivers never see more than 8 requests at once (4 MiB / 512 KiB;
/// each target's 32 slots and the count cap would let all 40 go together, as they did before
/// the byte bound), and every event is delivered exactly once, none of them retried: waiting
/// for room spends no attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_bytes_bounds_the_events_held_across_all_targets() {
    use std::sync::atomic::Ordering;
    const TARGETS: usize = 10;
    const PER_TARGET: usize = 4;
    const CAP: usize = 4 << 20;
    const SIZE: usize = 512 << 10;
    // Long enough that the requests would overlap without the bound.
    let (receivers, peak) = receivers_counting_overlap(TARGETS, Duration::from_millis(500)).await;
    let targets: Vec<Vec<String>> = receivers
        .iter()
        .enumerate()
        .map(|(i, rc)| vec![format!("webhook: {}\n        id: t{i}", rc.url())])
        .collect();
    let names: Vec<(String, String)> = (0..TARGETS)
        .map(|i| (format!("r{i}"), format!("big.t{i}")))
        .collect();
    let rules: Vec<(&str, &str, &[String])> = names
        .iter()
        .zip(&targets)
        .map(|((n, t), ts)| (n.as_str(), t.as_str(), ts.as_slice()))
        .collect();
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules_yaml("", &rules))],
        &[],
        &[("ROUTER_DELIVERY__MAX_IN_FLIGHT_BYTES", &CAP.to_string())],
    );
    let data = "x".repeat(SIZE);
    for n in 0..PER_TARGET {
        for i in 0..TARGETS {
            let ev = event(&format!("e{i}-{n}"), &format!("big.t{i}"), json!(data));
            let (status, body) = post_event(&r, &ev).await;
            assert_eq!(status, 202, "{body}");
        }
    }
    for (i, rc) in receivers.iter().enumerate() {
        assert!(
            rc.wait_for(Duration::from_secs(120), |s| s.len() >= PER_TARGET)
                .await,
            "target t{i} got {} of {PER_TARGET}",
            rc.count()
        );
    }
    assert!(queues_drained(&r, Duration::from_secs(30)).await);
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= CAP / SIZE,
        "the receivers saw {peak} requests of 512 KiB at once (cap 4 MiB)"
    );
    assert!(peak >= 2, "peak {peak}: the bound, not an idle router");
    for (i, rc) in receivers.iter().enumerate() {
        assert_eq!(rc.count(), PER_TARGET, "t{i}: each event exactly once");
        assert_eq!(rc.distinct_ids().len(), PER_TARGET, "t{i}");
    }
    let m = metrics_text(&r).await;
    assert!(
        !m.contains("result=\"retried\""),
        "waiting for room spends no attempt: {}",
        metric_lines(&m, "router_deliveries_total")
    );
    assert_eq!(
        counter(&m, "router_delivery_max_in_flight_bytes"),
        CAP as u64
    );
    assert_eq!(counter(&m, "router_delivery_in_flight_bytes"), 0);
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(st["delivery"]["max_in_flight_bytes"], json!(CAP), "{st}");
    assert_eq!(st["delivery"]["in_flight_bytes"], json!(0), "{st}");
}

/// A few targets whose receivers never answer cannot hold the byte pool against a healthy
/// target: 4 webhook targets with 6 events of 512 KiB each (12 MiB) fill an 8 MiB
/// `delivery.max_in_flight_bytes` and hold their events for their 30 s timeout; the healthy
/// target's small events, sent once they do, are delivered within seconds. Before the fair
/// share the stuck targets' workers queued for bytes in FIFO order, every KiB that came back
/// went to them, and the healthy target waited for their timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_stuck_on_large_events_do_not_hold_the_byte_pool_against_a_healthy_one() {
    const STUCK: usize = 4;
    const PER_STUCK: usize = 6;
    const CAP: u64 = 8 << 20;
    const SIZE: usize = 512 << 10;
    const HEALTHY: usize = 20;
    // They accept the request and answer long after the 30 s timeout.
    let mut stuck = Vec::new();
    for _ in 0..STUCK {
        stuck.push(
            Receiver::scripted(Arc::new(|_, _| (200, Duration::from_secs(120), vec![]))).await,
        );
    }
    let healthy = Receiver::ok().await;
    let policy =
        "  stuck:\n    timeout: 30s\n    retry: { max_attempts: 3, base_delay: 1s, max_delay: 1s }";
    let targets: Vec<Vec<String>> = stuck
        .iter()
        .enumerate()
        .map(|(i, rc)| {
            vec![format!(
                "webhook: {}\n        id: stuck{i}\n        policy: stuck",
                rc.url()
            )]
        })
        .chain([vec![format!(
            "webhook: {}\n        id: healthy",
            healthy.url()
        )]])
        .collect();
    let names: Vec<(String, String)> = (0..STUCK)
        .map(|i| (format!("r{i}"), format!("big.t{i}")))
        .chain([("small".to_string(), "small".to_string())])
        .collect();
    let rules: Vec<(&str, &str, &[String])> = names
        .iter()
        .zip(&targets)
        .map(|((n, t), ts)| (n.as_str(), t.as_str(), ts.as_slice()))
        .collect();
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules_yaml(policy, &rules))],
        &[],
        &[("ROUTER_DELIVERY__MAX_IN_FLIGHT_BYTES", &CAP.to_string())],
    );
    let data = "x".repeat(SIZE);
    for n in 0..PER_STUCK {
        for i in 0..STUCK {
            let ev = event(&format!("big{i}-{n}"), &format!("big.t{i}"), json!(data));
            let (status, body) = post_event(&r, &ev).await;
            assert_eq!(status, 202, "{body}");
        }
    }
    // The stuck targets hold what they can: at least 12 of their events (of 24; 15 fit),
    // each held until its timeout.
    let filled = eventually(Duration::from_secs(30), || async {
        let sent: usize = stuck.iter().map(Receiver::count).sum();
        let (_, st) = get_json(&r, "/v1/status").await;
        let held = st["delivery"]["in_flight_bytes"].as_u64()?;
        (sent >= 12 && held >= 12 * (SIZE as u64 + 1024)).then_some(held)
    })
    .await;
    assert!(
        filled.is_some(),
        "the stuck targets did not fill the pool: {} requests",
        stuck.iter().map(Receiver::count).sum::<usize>()
    );
    let started = Instant::now();
    let small: Vec<_> = (0..HEALTHY)
        .map(|i| event(&format!("small{i}"), "small", json!({ "i": i })))
        .collect();
    post_batch(&r, &small).await;
    // 20 small events to a receiver answering at once: well under a second; 10 s is
    // generous for a loaded machine and a third of the stuck targets' timeout.
    assert!(
        healthy
            .wait_for(Duration::from_secs(10), |s| s.len() >= HEALTHY)
            .await,
        "the healthy target got {} of {HEALTHY} in {:?} while the stuck ones held the byte pool",
        healthy.count(),
        started.elapsed()
    );
    eprintln!(
        "healthy target received {HEALTHY} events in {:?} with the byte pool held by stuck targets",
        started.elapsed()
    );
    let (_, st) = get_json(&r, "/v1/status").await;
    let held = st["delivery"]["in_flight_bytes"].as_u64().unwrap_or(0);
    assert!(held <= CAP, "{st}");
    assert!(held >= 12 * (SIZE as u64 + 1024), "{st}");
    assert!(
        st["delivery"]["byte_fair_share"].as_u64().unwrap_or(0) > 0,
        "{st}"
    );
    // Each stuck target shows the bytes it holds; the stuck ones waited at their share.
    let (_, t) = get_json(&r, "/v1/targets").await;
    let listed = t["targets"].as_array().expect("targets");
    let by_id = |id: &str| {
        listed
            .iter()
            .find(|x| x["id"] == id)
            .unwrap_or_else(|| panic!("{id} listed: {t}"))
            .clone()
    };
    let stuck_held: u64 = (0..STUCK)
        .map(|i| {
            by_id(&format!("stuck{i}"))["in_flight_bytes"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert!(
        stuck_held >= 12 * (SIZE as u64 + 1024) && stuck_held <= CAP,
        "the stuck targets hold their events: {t}"
    );
    let waits: u64 = (0..STUCK)
        .map(|i| {
            by_id(&format!("stuck{i}"))["byte_share_waits"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert!(waits > 0, "{t}");
    let m = metrics_text(&r).await;
    let metric_waits: u64 = (0..STUCK)
        .map(|i| {
            counter(
                &m,
                &format!("router_delivery_byte_share_waits_total{{target=\"stuck{i}\"}}"),
            )
        })
        .sum();
    assert_eq!(
        metric_waits,
        waits,
        "{}",
        metric_lines(&m, "router_delivery_byte_share_waits")
    );
    assert_eq!(by_id("healthy")["byte_share_waits"], json!(0), "{t}");
}

/// An attempt's event counts against `delivery.max_in_flight_bytes` until its result is
/// recorded, not only while it is sent: the event is held until then. With the commit of the
/// result stalled (a delay point before the ack), the attempt has given back its slot and its
/// `delivery.max_in_flight` permit, and still holds the event's bytes; once recorded, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_holds_its_event_s_bytes_until_its_result_is_recorded() {
    let rc = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[(
            "r",
            "held.bytes",
            &[format!("webhook: {}\n        id: hook", rc.url())],
        )],
    );
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("EVENT_ROUTER_DELAY_AT", "before_ack:hook:4000")],
    );
    let ev = event("e1", "held.bytes", json!("x".repeat(200 << 10)));
    let (status, body) = post_event(&r, &ev).await;
    assert_eq!(status, 202, "{body}");
    assert!(
        rc.wait_for(Duration::from_secs(30), |s| !s.is_empty())
            .await
    );
    // Answered; its result waits to be committed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(st["delivery"]["in_flight"], json!(0), "{st}");
    let held = st["delivery"]["in_flight_bytes"].as_u64().unwrap_or(0);
    assert!(held >= 200 << 10, "{st}");
    assert!(queues_drained(&r, Duration::from_secs(30)).await);
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(st["delivery"]["in_flight_bytes"], json!(0), "{st}");
    assert_eq!(rc.count(), 1);
}
