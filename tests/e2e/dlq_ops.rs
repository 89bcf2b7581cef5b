//! DLQ operations: contain (pause, disable), inspect (summary), redrive (rate, restart-safe),
//! purge, alerts, and replay of a time range.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::*;

/// Kills and restarts the router every 600 ms until the job at `path` is `done` (at most 30
/// times); asserts it was killed at least twice mid-way and returns the finished job.
async fn kill_until_done(r: &mut RouterProc, path: &str) -> Value {
    let mut kills = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (_, j) = get_json(r, path).await;
        if j["state"] == "done" {
            break;
        }
        r.kill9();
        r.restart();
        kills += 1;
        assert!(kills < 30, "the job never finished: {j}");
    }
    eprintln!("{path} finished after {kills} kill -9s");
    assert!(kills >= 2, "the test did not kill the job mid-way");
    get_json(r, path).await.1
}

fn broken_receiver(broken: Arc<AtomicBool>) -> Script {
    Arc::new(move |_, _| {
        (
            if broken.load(Ordering::SeqCst) {
                500
            } else {
                200
            },
            Duration::ZERO,
            vec![],
        )
    })
}

const ONE_SHOT: &str =
    "  one-shot:\n    retry: { max_attempts: 2, base_delay: 10ms, max_delay: 10ms }";

/// A consumer broken for a period: its events land in the DLQ; the summary shows one burst with
/// one reason; after the fix a redrive at a set rate delivers all of them, the DLQ is empty and
/// the delivered counts match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_consumer_is_redriven_after_the_fix_at_the_set_rate() {
    let broken = Arc::new(AtomicBool::new(true));
    let rcv = Receiver::scripted(broken_receiver(broken.clone())).await;
    let alerts = Receiver::ok().await;
    let rules = format!(
        "{}  - name: page-on-dlq\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: {}\n        id: pager\n",
        rules_yaml(
            ONE_SHOT,
            &[(
                "orders",
                "t",
                &[format!(
                    "webhook: {}\n        id: consumer\n        policy: one-shot",
                    rcv.url()
                )]
            )]
        ),
        alerts.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let batch: Vec<_> = (0..40)
        .map(|i| event(&format!("x{i}"), "t", json!({"i": i})))
        .collect();
    post_batch(&r, &batch).await;
    let dlq_full = eventually(Duration::from_secs(15), || async {
        let (_, l) = get_json(&r, "/v1/dlq?target=consumer&limit=1000").await;
        (l["entries"].as_array().map(Vec::len) == Some(40)).then_some(())
    })
    .await;
    assert!(dlq_full.is_some(), "events did not reach the DLQ");
    // Alerts: dlq.added events reached the pager (rate-limited, so at least some).
    assert!(
        alerts
            .wait_for(Duration::from_secs(10), |s| !s.is_empty())
            .await,
        "no router.dlq.added alert"
    );
    assert_eq!(alerts.received()[0].body["data"]["target"], "consumer");
    // Summary: one group, one reason, one bucket.
    let (_, sum) = get_json(&r, "/v1/dlq/summary?bucket=1h").await;
    let groups = sum["groups"].as_array().expect("groups");
    let consumer: Vec<_> = groups
        .iter()
        .filter(|g| g["target"] == "consumer")
        .collect();
    assert_eq!(consumer.len(), 1, "{sum}");
    assert_eq!(consumer[0]["reason"], "retries_exhausted");
    assert_eq!(consumer[0]["count"], 40);
    // One burst: one bucket, or two when the burst straddles an hour (buckets start at whole
    // hours: a clean-clone run failed at 12:59:57), then one hour apart.
    let hist = consumer[0]["histogram"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let counted: u64 = hist.iter().filter_map(|b| b["count"].as_u64()).sum();
    assert_eq!(counted, 40, "{sum}");
    let starts: Vec<chrono::DateTime<chrono::Utc>> = hist
        .iter()
        .filter_map(|b| b["bucket"].as_str()?.parse().ok())
        .collect();
    match starts.as_slice() {
        [_] => {}
        [a, b] => assert_eq!(*b - *a, chrono::Duration::hours(1), "{sum}"),
        _ => panic!("one burst in one or two adjacent buckets: {sum}"),
    }
    // Purge dry run counts and changes nothing.
    let (_, p) = post_json(
        &r,
        "/v1/dlq/purge",
        json!({"filter": {"target": "consumer"}, "dry_run": true}),
    )
    .await;
    assert_eq!(p["matched"], 40);
    // Fix, then redrive at 20/s.
    broken.store(false, Ordering::SeqCst);
    let before = rcv.count();
    let started = Instant::now();
    let (s, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "consumer"}, "rate_per_sec": 20}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    assert_eq!(job["total"], 40);
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{id}"),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(done["moved"], 40);
    // Its progress is a metric too.
    assert_eq!(
        counter(
            &metrics_text(&r).await,
            "router_job_items_total{kind=\"redrive\",outcome=\"moved\"}"
        ),
        40
    );
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() >= before + 40)
            .await
    );
    let took = started.elapsed().as_secs_f64();
    // 40 entries at 20/s take about 2 s; allow the first second's burst.
    assert!(
        took >= 1.4,
        "redrive faster than its rate: 40 in {took:.2}s"
    );
    let (_, l) = get_json(&r, "/v1/dlq?target=consumer").await;
    assert_eq!(
        l["entries"].as_array().map(Vec::len),
        Some(0),
        "DLQ not empty after redrive"
    );
    let redelivered: HashSet<_> = rcv
        .received()
        .iter()
        .skip(before)
        .map(Received::event_id)
        .collect();
    assert_eq!(redelivered.len(), 40);
    let f = fate(&r, "x7").await;
    assert_eq!(f["targets"][0]["state"], "delivered");
    assert_eq!(f["targets"][0]["redrive_count"], 1);
}

/// A redrive job killed repeatedly resumes each time and moves every entry exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_job_survives_repeated_kill_9() {
    let broken = Arc::new(AtomicBool::new(true));
    let rcv = Receiver::scripted(broken_receiver(broken.clone())).await;
    let rules = rules_yaml(
        ONE_SHOT,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: c\n        policy: one-shot",
                rcv.url()
            )],
        )],
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let batch: Vec<_> = (0..60)
        .map(|i| event(&format!("k{i}"), "t", json!({})))
        .collect();
    post_raw(
        &r,
        "application/cloudevents-batch+json",
        serde_json::to_vec(&batch).expect("json"),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(15), || async {
            let (_, l) = get_json(&r, "/v1/dlq?limit=1000").await;
            (l["entries"].as_array().map(Vec::len) == Some(60)).then_some(())
        })
        .await
        .is_some()
    );
    broken.store(false, Ordering::SeqCst);
    let (_, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"rate_per_sec": 25, "all": true}),
    )
    .await;
    let id = job["id"].as_str().expect("id").to_string();
    let j = kill_until_done(&mut r, &format!("/v1/dlq/redrive/{id}")).await;
    assert_eq!(j["moved"], 60, "{j}");
    // Exactly once: every entry was moved once (redrive_count 1) and nothing is left behind.
    for i in 0..60 {
        let f = fate(&r, &format!("k{i}")).await;
        assert_eq!(f["targets"][0]["redrive_count"], 1, "k{i}: {f}");
    }
    assert!(
        rcv.wait_for(Duration::from_secs(20), |s| s
            .iter()
            .filter(|x| x.at.elapsed() < Duration::from_secs(600))
            .map(Received::event_id)
            .collect::<HashSet<_>>()
            .len()
            == 60)
            .await
    );
    let (_, l) = get_json(&r, "/v1/dlq").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_a_time_range_delivers_exactly_the_matching_archived_events() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "c");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let send = |prefix: &'static str| {
        let r = &r;
        async move {
            let batch: Vec<_> = (0..10)
                .map(|i| {
                    event(
                        &format!("{prefix}{i}"),
                        "t",
                        json!({"color": if i % 2 == 0 { "red" } else { "blue" }}),
                    )
                })
                .collect();
            post_raw(
                r,
                "application/cloudevents-batch+json",
                serde_json::to_vec(&batch).expect("json"),
            )
            .await;
        }
    };
    send("before").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let from = chrono::Utc::now();
    send("inside").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let to = chrono::Utc::now();
    send("after").await;
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() >= 30)
            .await
    );
    let first_keys: HashMap<String, String> = rcv
        .received()
        .iter()
        .map(|g| {
            (
                g.event_id(),
                g.header("idempotency-key").unwrap_or_default(),
            )
        })
        .collect();
    let before = rcv.count();
    let (s, job) = post_json(
        &r,
        "/v1/replay",
        json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "filter": {"data": {"color": ["red"]}}, "rate_per_sec": 100}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    assert_eq!(
        job["total"], 10,
        "the range's archived events, counted at creation: {job}"
    );
    let id = job["id"].as_str().expect("id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    assert_eq!(
        (&done["moved"], &done["skipped"], &done["total"]),
        (&json!(5), &json!(5), &json!(10)),
        "{done}"
    );
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() >= before + 5)
            .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replayed: Vec<Received> = rcv.received().into_iter().skip(before).collect();
    let ids: HashSet<_> = replayed.iter().map(Received::event_id).collect();
    let want: HashSet<_> = (0..10).step_by(2).map(|i| format!("inside{i}")).collect();
    assert_eq!(ids, want);
    assert_eq!(replayed.len(), 5);
    for g in &replayed {
        assert_eq!(
            g.body["replay"],
            id.as_str(),
            "replayed deliveries carry the replay marker"
        );
        assert_ne!(
            g.header("idempotency-key"),
            first_keys.get(&g.event_id()).cloned(),
            "replay gets its own idempotency key"
        );
    }
    // The fate tells the replayed copy from the original: it names its replay (two copies
    // with different keys and nothing saying why, before).
    let f = fate(&r, "inside0").await;
    let targets = f["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 2, "{f}");
    assert!(targets[0].get("replay").is_none(), "the original: {f}");
    assert_eq!(targets[1]["replay"], id.as_str(), "{f}");
}

/// The disabled-rule runbook: two rules match the same events, `to-erp` (target `erp`) and
/// `to-audit` (target `audit`). `to-erp` is disabled while events arrive (audit gets them,
/// erp does not), then enabled; the window is replayed with `rules: ["to-erp"]`: erp gets
/// each event once and audit nothing more. Before, a replay went through every rule and
/// audit got each event a second time under a new idempotency key. `targets` narrows the
/// same way (by the CLI's `--target` here), and an unknown rule is a 400 pointing at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_restricted_to_a_rule_delivers_only_to_its_targets() {
    let erp = Receiver::ok().await;
    let audit = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[
            (
                "to-erp",
                "order.paid",
                &[format!("webhook: {}\n        id: erp", erp.url())],
            ),
            (
                "to-audit",
                "order.paid",
                &[format!("webhook: {}\n        id: audit", audit.url())],
            ),
        ],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_json(&r, "/v1/rules/to-erp/disable", json!({})).await.0,
        200
    );
    let from = chrono::Utc::now();
    for i in 0..3 {
        post_event(&r, &event(&format!("p-{i}"), "order.paid", json!({}))).await;
    }
    assert!(
        audit
            .wait_for(Duration::from_secs(10), |s| s.len() >= 3)
            .await
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let to = chrono::Utc::now();
    assert_eq!(
        post_json(&r, "/v1/rules/to-erp/enable", json!({})).await.0,
        200
    );
    assert_eq!(erp.count(), 0, "the disabled rule routed events");

    // A typo: refused at its element with the closest name, nothing created.
    let range = |extra: Value| {
        let mut body =
            json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": 100});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let (s, e) = post_json(&r, "/v1/replay", range(json!({"rules": ["to-erq"]}))).await;
    assert_eq!(s, 400, "{e}");
    assert_eq!(e["errors"][0]["pointer"], "/rules/0", "{e}");
    assert!(
        e["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("did you mean \"to-erp\"?")),
        "{e}"
    );
    let (s, e) = post_json(&r, "/v1/replay", range(json!({"targets": []}))).await;
    assert_eq!(
        (s, &e["errors"][0]["pointer"]),
        (400, &json!("/targets")),
        "{e}"
    );

    let (s, job) = post_json(&r, "/v1/replay", range(json!({"rules": ["to-erp"]}))).await;
    assert_eq!(s, 201, "{job}");
    assert_eq!(job["spec"]["rules"], json!(["to-erp"]), "{job}");
    let id = job["id"].as_str().expect("id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    assert_eq!(
        (&done["moved"], &done["skipped"], &done["total"]),
        (&json!(3), &json!(0), &json!(3)),
        "{done}"
    );
    assert!(
        erp.wait_for(Duration::from_secs(10), |s| s.len() >= 3)
            .await
    );
    // Long enough for a copy queued for audit to arrive (each took milliseconds above).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let per_event = |rcv: &Receiver| {
        let mut n: HashMap<String, usize> = HashMap::new();
        for g in rcv.received() {
            *n.entry(g.event_id()).or_default() += 1;
        }
        n
    };
    let once: HashMap<String, usize> = (0..3).map(|i| (format!("p-{i}"), 1)).collect();
    assert_eq!(per_event(&erp), once, "erp gets each missed event once");
    assert_eq!(
        per_event(&audit),
        once,
        "audit had them: the replay sent none again"
    );
    for g in erp.received() {
        assert_eq!(g.body["replay"], id.as_str(), "{}", g.body);
    }

    // By target, from the CLI: only audit gets copies (a receiver that lost its data).
    let (code, err) = router_cli(
        &r,
        &[
            "replay",
            "--from",
            &from.to_rfc3339(),
            "--to",
            &to.to_rfc3339(),
            "--rate",
            "100",
            "--target",
            "audit",
            "--wait",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    assert!(
        audit
            .wait_for(Duration::from_secs(10), |s| s.len() >= 6)
            .await
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let twice: HashMap<String, usize> = (0..3).map(|i| (format!("p-{i}"), 2)).collect();
    assert_eq!(per_event(&audit), twice);
    assert_eq!(
        per_event(&erp),
        once,
        "erp got nothing from the audit replay"
    );
}

/// Replayed copies that meet their target's full queue go to the DLQ as `target_overflow`:
/// new dead letters, counted in `router_dlq_entries_total` and announced as
/// `router.dlq.added` like the copies refused at acceptance (they were only the job's
/// `failed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_copies_past_the_depth_cap_are_counted_and_announced() {
    let rcv = Receiver::ok().await;
    let alerts = Receiver::ok().await;
    let rules = format!(
        "{}  - name: page-on-dlq\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: {}\n        id: pager\n",
        rules_yaml(
            "  capped:\n    max_queue_depth: 4",
            &[(
                "r",
                "t",
                &[format!(
                    "webhook: {}\n        id: c\n        policy: capped",
                    rcv.url()
                )]
            )]
        ),
        alerts.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    // Paused, `c` keeps what it is given: four accepted events fill its queue to the cap.
    assert_eq!(post_json(&r, "/v1/targets/c/pause", json!({})).await.0, 200);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let batch: Vec<_> = (0..4)
        .map(|i| event(&format!("x{i}"), "t", json!({"i": i})))
        .collect();
    post_batch(&r, &batch).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let to = chrono::Utc::now() + chrono::Duration::milliseconds(10);
    let (s, job) = post_json(
        &r,
        "/v1/replay",
        json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": 100}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    // Each event counts once: failed, not also moved ("4/4 moved, 4 failed").
    assert_eq!(
        (&done["moved"], &done["failed"]),
        (&json!(0), &json!(4)),
        "every copy overflowed: {done}"
    );
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(
            &m,
            "router_dlq_entries_total{target=\"c\",reason=\"target_overflow\"}"
        ),
        4,
        "{}",
        metric_lines(&m, "router_dlq_entries")
    );
    assert_eq!(
        counter(
            &m,
            "router_job_items_total{kind=\"replay\",outcome=\"moved\"}"
        ),
        0,
        "{}",
        metric_lines(&m, "router_job_items")
    );
    let overflow_alerts = |s: &[Received]| {
        s.iter()
            .filter(|a| {
                a.body["type"] == "router.dlq.added"
                    && a.body["data"]["reason"] == "target_overflow"
                    && a.body["data"]["target"] == "c"
            })
            .count()
    };
    assert!(
        alerts
            .wait_for(Duration::from_secs(10), |s| overflow_alerts(s) == 4)
            .await,
        "a router.dlq.added per overflowed copy: {:?}",
        alerts
            .received()
            .iter()
            .map(|a| a.body["data"].clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(rcv.count(), 0, "paused");
}

/// Runs `router ARGS… --api <router>`; returns (exit code, stderr).
async fn router_cli(r: &RouterProc, args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_router"))
            .args(args)
            .args(["--api", &r.url("")])
            .env_remove("ROUTER_TOKEN")
            .env_remove("ROUTER_API")
            .output(),
    )
    .await
    .expect("the command finished")
    .expect("run the command");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The archive sweep does not wait for a replay: a slow replay of events about to pass the
/// archive's retention loses the rest of them to the sweep. The job says so (it used to end
/// `done`, "3/40 moved, 0 failed, 0 skipped", and `--wait` exited 0): the events it never
/// reached are `expired`, its `last_error` says how many and why, the metric counts them, and
/// `router replay --wait` exits 1. A replay of a range before the archive's horizon says
/// where the horizon is when it is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_the_archive_sweep_outruns_counts_the_events_it_lost_as_expired() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "c");
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[
            ("ROUTER_ARCHIVE__RETENTION", "2s"),
            ("ROUTER_DELIVERY__RETENTION", "2s"),
            ("ROUTER_INGEST__DEDUP_WINDOW", "2s"),
            ("ROUTER_DELIVERY__SWEEP_INTERVAL", "200ms"),
        ],
    );
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let batch: Vec<_> = (0..40)
        .map(|i| event(&format!("x{i}"), "t", json!({})))
        .collect();
    post_batch(&r, &batch).await;
    // Delivered, so that nothing holds them past the retention.
    assert!(queues_drained(&r, Duration::from_secs(20)).await);
    let to = chrono::Utc::now() + chrono::Duration::seconds(1);
    // One event a second: the sweep removes the rest 2 s after their acceptance, long before
    // the job could reach them (40 s). Bounded by how soon they were delivered, not by the
    // rate: the job ends once the archive has nothing left of its range.
    let started = Instant::now();
    let (code, err) = router_cli(
        &r,
        &[
            "replay",
            "--from",
            &from.to_rfc3339(),
            "--to",
            &to.to_rfc3339(),
            "--rate",
            "1",
            "--wait",
        ],
    )
    .await;
    assert_eq!(code, Some(1), "--wait fails when events expired: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains(" expired — done"), "{err}");
    assert!(err.contains("the job ended done with 0 failed, "), "{err}");
    assert!(err.contains("removed from the archive"), "{err}");
    let (_, list) = get_json(&r, "/v1/replay?kind=replay").await;
    let id = list["jobs"][0]["id"].as_str().expect("the job").to_string();
    let (_, j) = get_json(&r, &format!("/v1/replay/{id}")).await;
    let n = |k: &str| j[k].as_u64().unwrap_or(0);
    assert_eq!(j["state"], "done", "{j}");
    assert_eq!(n("total"), 40, "{j}");
    assert!(n("expired") > 0, "{j}");
    assert_eq!(
        n("moved") + n("failed") + n("skipped") + n("expired"),
        n("total"),
        "every event of the range is accounted for: {j}"
    );
    let why = j["last_error"].as_str().unwrap_or_default();
    assert!(
        why.starts_with(&format!(
            "{} of the range's 40 events were removed from the archive",
            n("expired")
        )) && why.contains("archive.retention = 2s"),
        "{j}"
    );
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(
            &m,
            "router_job_items_total{kind=\"replay\",outcome=\"expired\"}"
        ),
        n("expired"),
        "{}",
        metric_lines(&m, "router_job_items")
    );
    assert!(
        r.log_text()
            .contains("a replay ended short of events of its range that the archive sweep removed"),
        "a warning is logged"
    );

    // A range before the archive's horizon: accepted, and said when it is created.
    let (code, err) = router_cli(
        &r,
        &[
            "replay",
            "--from",
            "1900-01-01T00:00:00Z",
            "--to",
            &chrono::Utc::now().to_rfc3339(),
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("warning: events accepted before ")
            && err.contains("are no longer archived (archive.retention = 2s)"),
        "{err}"
    );
    let (_, list) = get_json(&r, "/v1/replay?kind=replay").await;
    let old = &list["jobs"][0];
    assert_eq!(old["warnings"].as_array().map(Vec::len), Some(1), "{old}");
}

/// A job nobody watches is still seen: `GET /v1/status` lists the running and paused jobs
/// with their progress and when each last went through an item, and `router_jobs` counts
/// them by kind and state. A rate below what the runner runs at is refused (it was accepted,
/// echoed, and run at 0.001/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_and_paused_jobs_show_in_the_status_and_the_metrics() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "c");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let batch: Vec<_> = (0..5)
        .map(|i| event(&format!("s{i}"), "t", json!({})))
        .collect();
    post_batch(&r, &batch).await;
    let to = chrono::Utc::now() + chrono::Duration::seconds(1);
    let range =
        |rate: f64| json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": rate});
    for rate in [1e-300, 0.0001] {
        let (s, b) = post_json(&r, "/v1/replay", range(rate)).await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (400, &json!("/rate_per_sec")),
            "{b}"
        );
        let (s, b) = post_json(
            &r,
            "/v1/dlq/redrive",
            json!({"all": true, "rate_per_sec": rate}),
        )
        .await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (400, &json!("/rate_per_sec")),
            "{b}"
        );
    }
    // One event every 2 s: running for a while.
    let (s, job) = post_json(&r, "/v1/replay", range(0.5)).await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("id").to_string();
    let listed = |status: &Value| {
        status["jobs"]["active"]
            .as_array()
            .and_then(|a| a.iter().find(|j| j["id"] == id.as_str()).cloned())
    };
    // Its first item comes about 2 s after its creation.
    let shown = eventually(Duration::from_secs(15), || async {
        let (_, st) = get_json(&r, "/v1/status").await;
        listed(&st).filter(|j| j["last_item_at"].is_string())
    })
    .await
    .expect("the running job in the status, having gone through an item");
    assert_eq!(
        (&shown["kind"], &shown["state"]),
        (&json!("replay"), &json!("running")),
        "{shown}"
    );
    assert_eq!(shown["total"], 5, "{shown}");
    let m = metrics_text(&r).await;
    let jobs = |m: &str, state: &str| {
        counter(
            m,
            &format!("router_jobs{{kind=\"replay\",state=\"{state}\"}}"),
        )
    };
    assert_eq!(
        (jobs(&m, "running"), jobs(&m, "paused")),
        (1, 0),
        "{}",
        metric_lines(&m, "router_jobs")
    );
    assert_eq!(
        post_json(&r, &format!("/v1/replay/{id}/pause"), json!({}))
            .await
            .0,
        200
    );
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(
        listed(&st).map(|j| j["state"].clone()),
        Some(json!("paused")),
        "{st}"
    );
    let m = metrics_text(&r).await;
    assert_eq!(
        (jobs(&m, "running"), jobs(&m, "paused")),
        (0, 1),
        "{}",
        metric_lines(&m, "router_jobs")
    );
    // Ended, it leaves both.
    assert_eq!(
        post_json(&r, &format!("/v1/replay/{id}/cancel"), json!({}))
            .await
            .0,
        200
    );
    let (_, st) = get_json(&r, "/v1/status").await;
    assert_eq!(listed(&st), None, "{st}");
    let m = metrics_text(&r).await;
    assert_eq!((jobs(&m, "running"), jobs(&m, "paused")), (0, 0));
}

/// A replay job resumes from its durable cursor after each kill -9: every archived event of
/// the range is replayed, none twice under different keys, and the job ends `done` having
/// moved each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_job_survives_repeated_kill_9() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "c");
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let batch: Vec<_> = (0..60)
        .map(|i| event(&format!("a{i}"), "t", json!({})))
        .collect();
    post_batch(&r, &batch).await;
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() >= 60)
            .await
    );
    // Acknowledged too: a first delivery redelivered after a kill would look like a replay.
    assert!(queues_drained(&r, Duration::from_secs(20)).await);
    let to = chrono::Utc::now() + chrono::Duration::seconds(1);
    let first = rcv.count();
    let (s, job) = post_json(
        &r,
        "/v1/replay",
        json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": 25}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("id").to_string();
    let j = kill_until_done(&mut r, &format!("/v1/replay/{id}")).await;
    assert_eq!(j["moved"], 60, "{j}");
    assert!(
        rcv.wait_for(Duration::from_secs(20), |s| s[first..]
            .iter()
            .map(Received::event_id)
            .collect::<HashSet<_>>()
            .len()
            == 60)
            .await,
        "not every archived event was replayed"
    );
    assert!(queues_drained(&r, Duration::from_secs(20)).await);
    // A replay redelivered after a kill keeps its replay key: one key per event in the replay.
    let replayed = &rcv.received()[first..];
    for g in replayed {
        assert_eq!(g.body["replay"], id.as_str(), "{}", g.body);
    }
    let keys = keys_by_event(replayed);
    assert!(
        keys.values().all(|k| k.len() == 1),
        "a replayed event arrived under two keys: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_disable_contain_without_losing_anything() {
    let rcv = Receiver::ok().await;
    let other = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[
            (
                "main",
                "t",
                &[format!("webhook: {}\n        id: main", rcv.url())],
            ),
            (
                "side",
                "t",
                &[format!("webhook: {}\n        id: side", other.url())],
            ),
        ],
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_json(&r, "/v1/targets/main/pause", json!({})).await.0,
        200
    );
    assert_eq!(
        post_json(&r, "/v1/rules/side/disable", json!({})).await.0,
        200
    );
    assert_eq!(
        post_json(&r, "/v1/rules/nope/disable", json!({})).await.0,
        404
    );
    for i in 0..5 {
        post_event(&r, &event(&format!("p{i}"), "t", json!({}))).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(rcv.count(), 0, "a paused target got attempts");
    assert_eq!(other.count(), 0, "a disabled rule matched");
    let (_, t) = get_json(&r, "/v1/targets/main").await;
    assert_eq!(t["paused"], true);
    assert_eq!(t["queued"], 5);
    // Both survive a restart.
    r.kill9();
    r.restart();
    post_event(&r, &event("p-after", "t", json!({}))).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rcv.count(), 0);
    assert_eq!(other.count(), 0);
    assert_eq!(
        post_json(&r, "/v1/targets/main/resume", json!({})).await.0,
        200
    );
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 6)
            .await,
        "the queue did not drain after resume"
    );
    assert_eq!(
        post_json(&r, "/v1/rules/side/enable", json!({})).await.0,
        200
    );
    post_event(&r, &event("p-enabled", "t", json!({}))).await;
    assert!(
        other
            .wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
}

/// Events a disabled rule would have routed, and events no rule matches, are accepted and go
/// to no target: that is counted by cause, logged, and their fate names the rule that matches
/// them and that it is disabled. Before, nothing but the archive knew of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_routed_nowhere_are_counted_and_their_fate_says_why() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[(
            "only",
            "t",
            &[format!("webhook: {}\n        id: main", rcv.url())],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(
        post_event(&r, &event("routed", "t", json!({}))).await.0,
        202
    );
    assert_eq!(
        post_json(&r, "/v1/rules/only/disable", json!({})).await.0,
        200
    );
    assert_eq!(
        post_event(&r, &event("during", "t", json!({}))).await.0,
        202
    );
    assert_eq!(
        post_event(&r, &event("typo", "t.other", json!({}))).await.0,
        202
    );
    let m = metrics_text(&r).await;
    assert_eq!(
        (
            counter(&m, "router_ingest_unrouted_total{cause=\"rule_disabled\"}"),
            counter(&m, "router_ingest_unrouted_total{cause=\"no_match\"}"),
        ),
        (1, 1),
        "{}",
        metric_lines(&m, "unrouted")
    );
    let f = fate(&r, "during").await;
    assert_eq!(f["matched_rules"], json!([]), "{f}");
    assert_eq!(
        f["unrouted_matches_now"],
        json!([{ "rule": "only", "disabled_by_operator": true }]),
        "{f}"
    );
    let f = fate(&r, "typo").await;
    assert_eq!(f["unrouted_matches_now"], json!([]), "{f}");
    let f = fate(&r, "routed").await;
    assert!(f["unrouted_matches_now"].is_null(), "{f}");
    assert!(
        r.log_text().contains("routed to no target"),
        "a WARN line says so"
    );
}

/// Pausing a target mid-backlog: once the attempts in flight end, no entry stays leased and
/// every undelivered event still has zero attempts; after resuming, each is delivered once,
/// on its first attempt. (Also the guard for any leasing ahead of free slots, which must give
/// such entries back unattempted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_mid_backlog_spends_no_attempts_and_loses_nothing() {
    let rcv = Receiver::scripted(Arc::new(|_, _| (200, Duration::from_millis(300), vec![]))).await;
    let policy = "  two-at-a-time:\n    throttle: { max_concurrency: 2 }";
    let rules = rules_yaml(
        policy,
        &[(
            "main",
            "t",
            &[format!(
                "webhook: {}\n        id: main\n        policy: two-at-a-time",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let ids: Vec<String> = (0..20).map(|i| format!("la{i}")).collect();
    for id in &ids {
        assert_eq!(post_event(&r, &event(id, "t", json!({}))).await.0, 202);
    }
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| !s.is_empty())
            .await,
        "nothing delivered"
    );
    assert_eq!(
        post_json(&r, "/v1/targets/main/pause", json!({})).await.0,
        200
    );
    // The two attempts in flight end (300 ms each); what was leased ahead goes back.
    let settled = eventually(Duration::from_secs(10), || async {
        let (_, t) = get_json(&r, "/v1/targets/main").await;
        (t["in_flight"] == 0).then_some(t)
    })
    .await;
    assert!(settled.is_some(), "entries stayed leased while paused");
    let delivered: HashSet<String> = rcv.received().iter().map(Received::event_id).collect();
    assert!(
        delivered.len() < ids.len(),
        "all delivered before the pause"
    );
    for id in &ids {
        let f = fate(&r, id).await;
        let t = &f["targets"][0];
        if delivered.contains(id) {
            assert_eq!(t["state"], "delivered", "{f}");
        } else {
            assert_eq!(t["state"], "queued", "{f}");
            assert_eq!(
                t["attempt_count"], 0,
                "an attempt was spent while paused: {f}"
            );
        }
    }
    assert_eq!(
        post_json(&r, "/v1/targets/main/resume", json!({})).await.0,
        200
    );
    assert!(
        rcv.wait_for(Duration::from_secs(30), |s| s.len() >= ids.len())
            .await,
        "the queue did not drain after resume"
    );
    for id in &ids {
        let f = eventually(Duration::from_secs(5), || async {
            let f = fate(&r, id).await;
            (f["targets"][0]["state"] == "delivered").then_some(f)
        })
        .await
        .expect("delivered");
        assert_eq!(f["targets"][0]["attempt_count"], 1, "{f}");
    }
    assert_eq!(rcv.count(), ids.len(), "an event was delivered twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantined_events_are_revalidated_when_redriven() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml("", &[("r", "order", &[format!("webhook: {}", rcv.url())])]);
    let strict = r#"{"type": "object", "required": ["id"]}"#;
    let r = RouterProc::start(&[("r.yaml", &rules)], &[("order/v1.json", strict)]);
    let (_, b) = post_event(&r, &event("q1", "order", json!({"name": "no id"}))).await;
    assert_eq!(b["results"][0]["status"], "quarantined");
    // Redrive before the fix: still invalid, stays in the DLQ (failed 1).
    let (_, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"reason": "contract_violation"}, "rate_per_sec": 50}),
    )
    .await;
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{}", job["id"].as_str().unwrap_or("")),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        (done["moved"].clone(), done["failed"].clone()),
        (json!(0), json!(1))
    );
    // The contract is relaxed; the redrive now routes it through the current rules.
    std::fs::write(
        r.dir.path().join("contracts/order/v1.json"),
        r#"{"type": "object"}"#,
    )
    .expect("write");
    let _ = client().post(r.url("/v1/admin/reload")).send().await;
    let (_, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"reason": "contract_violation"}, "rate_per_sec": 50}),
    )
    .await;
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{}", job["id"].as_str().unwrap_or("")),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(done["moved"], 1, "{done}");
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await
    );
    assert_eq!(fate(&r, "q1").await["quarantined"], false);
}

/// A quarantined event its producer has since sent again, fixed, is not routed by a redrive
/// once the contract is relaxed: the receiver got the fixed copy, and the redrive delivered the
/// stale one after it, under the same idempotency key. It stays in the DLQ saying why, and the
/// event's fate lists it (the fate showed the fixed copy alone, no trace of the quarantine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_copy_sent_again_fixed_is_not_redriven() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml("", &[("r", "order", &[format!("webhook: {}", rcv.url())])]);
    let strict =
        r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#;
    let r = RouterProc::start(&[("r.yaml", &rules)], &[("order/v1.json", strict)]);
    let (_, b) = post_event(&r, &event("dup1", "order", json!({"n": "5"}))).await;
    assert_eq!(b["results"][0]["status"], "quarantined", "{b}");
    let (_, b) = post_event(&r, &event("dup1", "order", json!({"n": 5}))).await;
    assert_eq!(b["results"][0]["status"], "accepted", "{b}");
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 1)
            .await,
        "the fixed copy was not delivered"
    );
    let f = fate(&r, "dup1").await;
    assert_eq!(f["quarantined"], false, "{f}");
    let previous = f["previous_copies"].as_array().expect("previous copies");
    assert_eq!(previous.len(), 1, "{f}");
    let dead = previous[0]["dlq"][0].clone();
    assert_eq!(dead["reason"], "contract_violation", "{f}");
    // The contract now takes strings too: the quarantined copy would pass it.
    std::fs::write(
        r.dir.path().join("contracts/order/v1.json"),
        r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": ["integer", "string"]}}}"#,
    )
    .expect("write");
    let _ = client().post(r.url("/v1/admin/reload")).send().await;
    let (_, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"reason": "contract_violation"}, "rate_per_sec": 50}),
    )
    .await;
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{}", job["id"].as_str().unwrap_or("")),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        (done["moved"].clone(), done["failed"].clone()),
        (json!(0), json!(1)),
        "{done}"
    );
    // Nothing was queued for the receiver (a routed copy is queued in the job's own step).
    let (_, targets) = get_json(&r, "/v1/targets").await;
    let depth: u64 = targets["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t["queued"].as_u64().unwrap_or(0) + t["in_flight"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(depth, 0, "{targets}");
    assert_eq!(rcv.count(), 1, "the stale copy was delivered");
    let (_, kept) = get_json(
        &r,
        &format!("/v1/dlq/{}", dead["id"].as_str().unwrap_or("")),
    )
    .await;
    let why = kept["not_redriven"]["message"].as_str().unwrap_or_default();
    assert!(why.contains("a later copy of this event"), "{kept}");
    let f = fate(&r, "dup1").await;
    assert_eq!(
        f["previous_copies"][0]["dlq"][0]["not_redriven"]["message"], why,
        "{f}"
    );
}

/// A redriven entry waiting again (its target paused) shows the attempts it failed before the
/// redrive, as `history`, and their last error: the fate said no attempt, no error, and its
/// DLQ entry, which had them, was gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_entrys_fate_shows_the_attempts_before_the_redrive() {
    let refusing = Receiver::status(400).await;
    let rules = webhook_rule("r", "order", &refusing.url(), "hook");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    post_event(&r, &event("h1", "order", json!({"id": 1}))).await;
    let dead = eventually(Duration::from_secs(15), || async {
        let f = fate(&r, "h1").await;
        (f["targets"][0]["state"] == "dlq").then_some(f)
    })
    .await
    .expect("the permanent failure is dead-lettered");
    let failed = dead["targets"][0]["attempts"].clone();
    assert_eq!(failed.as_array().map(Vec::len), Some(1), "{dead}");
    let (s, _) = post_json(&r, "/v1/targets/hook/pause", json!({})).await;
    assert_eq!(s, 200);
    let (_, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "hook"}, "rate_per_sec": 50}),
    )
    .await;
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{}", job["id"].as_str().unwrap_or("")),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(done["moved"], 1, "{done}");
    let f = fate(&r, "h1").await;
    let t = &f["targets"][0];
    assert_eq!(t["state"], "queued", "{f}");
    assert_eq!(t["attempts"], json!([]), "{f}");
    assert_eq!(t["history"], failed, "{f}");
    assert_eq!(t["last_error"], failed[0]["error"], "{f}");
    assert!(t["last_error"].is_string(), "{f}");
    assert_eq!(t["redrive_count"], 1, "{f}");
    assert_eq!(f["dlq"], json!([]), "{f}");
}

/// The job list is newest first and paged; bad query values are 400s naming the parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_list_is_newest_first_paged_and_filtered() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "hook");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (s, job) = post_json(
            &r,
            "/v1/dlq/redrive",
            json!({"filter": {"target": "hook"}, "rate_per_sec": 1}),
        )
        .await;
        assert_eq!(s, 201, "{job}");
        ids.push(job["id"].as_str().expect("id").to_string());
        // Distinct creation times, so that newest-first is the order they were made in.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let listed = |b: &Value| -> Vec<String> {
        b["jobs"].as_array().map_or(Vec::new(), |j| {
            j.iter()
                .filter_map(|j| j["id"].as_str().map(str::to_string))
                .collect()
        })
    };
    let (s, page) = get_json(&r, "/v1/dlq/redrive?limit=2").await;
    assert_eq!(s, 200, "{page}");
    assert_eq!(listed(&page), [ids[2].clone(), ids[1].clone()], "{page}");
    let next = page["next"].as_str().expect("a full page has a cursor");
    let (_, rest) = get_json(&r, &format!("/v1/dlq/redrive?limit=2&after={next}")).await;
    assert_eq!(listed(&rest), [ids[0].clone()], "{rest}");
    assert_eq!(rest["next"], Value::Null);
    let (_, replays) = get_json(&r, "/v1/replay?kind=replay").await;
    assert_eq!(listed(&replays), Vec::<String>::new());
    // Nothing to move: each job ends at once.
    let done = eventually(Duration::from_secs(20), || async {
        let (_, done) = get_json(&r, "/v1/dlq/redrive?state=done").await;
        (listed(&done).len() == 3).then_some(())
    })
    .await;
    assert!(done.is_some(), "the three jobs did not end");
    for (query, pointer) in [
        ("limit=0", "/limit"),
        ("limit=lots", "/limit"),
        ("state=asleep", "/state"),
        ("after=redrive-99", "/after"),
    ] {
        let (s, b) = get_json(&r, &format!("/v1/dlq/redrive?{query}")).await;
        assert_eq!(s, 400, "{query}: {b}");
        assert_eq!(b["errors"][0]["pointer"], pointer, "{query}: {b}");
    }
}

/// Under `on_dead_letter: hold` the newest dead letter of a key holds it. Purging that dead
/// letter releases the key (the purge answer names it) and the events queued behind it go;
/// purging an older dead letter of the same key, which holds nothing, leaves the hold alone.
/// Before, a purge never released a key: everything behind it waited for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_the_dead_letter_that_holds_a_key_releases_it() {
    // Events whose data says `fail` are refused for good (400: no retries).
    let rcv = Receiver::scripted(Arc::new(|ev, _| {
        let status = if ev["data"]["fail"] == true { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: ordered\n        policy: held",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    // Each event has a source of its own, so a purge can pick one dead letter.
    let keyed = |id: &str, fail: bool| {
        let mut e = event(id, "t", json!({ "fail": fail }));
        e["partitionkey"] = json!("K");
        e["source"] = json!(format!("/{id}"));
        e
    };
    let held = || async {
        let (_, t) = get_json(&r, "/v1/targets/ordered").await;
        t["held_keys"].clone()
    };
    let purge = |source: &'static str| {
        let r = &r;
        async move {
            let (status, p) = post_json(
                r,
                "/v1/dlq/purge",
                json!({ "filter": { "target": "ordered", "source": source } }),
            )
            .await;
            assert_eq!(status, 200, "{p}");
            assert_eq!(p["purged"], 1, "{p}");
            p["released_keys"].clone()
        }
    };
    // `old` fails and holds K; an operator releases K by hand; `new` fails and holds K again,
    // with `behind` queued after it.
    post_batch(&r, &[keyed("old", true)]).await;
    eventually(Duration::from_secs(15), || async {
        (held().await == json!(["K"])).then_some(())
    })
    .await
    .expect("the first dead letter holds K");
    let (status, _) = post_json(&r, "/v1/targets/ordered/keys/K/release", json!({})).await;
    assert_eq!(status, 200);
    post_batch(&r, &[keyed("new", true), keyed("behind", false)]).await;
    eventually(Duration::from_secs(15), || async {
        let (_, l) = get_json(&r, "/v1/dlq?target=ordered").await;
        (l["entries"].as_array().map(Vec::len) == Some(2) && held().await == json!(["K"]))
            .then_some(())
    })
    .await
    .expect("the second dead letter holds K again");
    let (_, l) = get_json(&r, "/v1/dlq?target=ordered").await;
    assert_eq!(l["entries"][0]["ordering_key"], "K", "{l}");

    // A dry run names the keys the purge would release, and releases nothing: the older dead
    // letter holds nothing; the newer one holds K, and so does a purge of both (the later
    // one it matches would be purged too). Before, a dry run said `released_keys: []`.
    for (filter, expected) in [
        (json!({ "target": "ordered", "source": "/old" }), json!([])),
        (
            json!({ "target": "ordered", "source": "/new" }),
            json!([{ "target": "ordered", "key": "K" }]),
        ),
        (
            json!({ "target": "ordered" }),
            json!([{ "target": "ordered", "key": "K" }]),
        ),
    ] {
        let (status, p) = post_json(
            &r,
            "/v1/dlq/purge",
            json!({ "filter": filter, "dry_run": true }),
        )
        .await;
        assert_eq!(status, 200, "{p}");
        assert_eq!(p["purged"], 0, "{p}");
        assert_eq!(p["released_keys"], json!([]), "{p}");
        assert_eq!(p["would_release_keys"], expected, "{filter}: {p}");
    }
    assert_eq!(held().await, json!(["K"]));

    // The older dead letter holds nothing: purging it keeps the hold, and `behind` waits.
    assert_eq!(purge("/old").await, json!([]));
    assert_eq!(held().await, json!(["K"]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!rcv.distinct_ids().contains("behind"), "K is still held");

    // Purging the one that holds K releases it; `behind` is delivered.
    assert_eq!(
        purge("/new").await,
        json!([{ "target": "ordered", "key": "K" }])
    );
    assert_eq!(held().await, json!([]));
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s
            .iter()
            .any(|x| x.event_id() == "behind"))
            .await,
        "the event behind the purged dead letter was delivered"
    );
}

/// Runs `router ARGS… --api <router>`; returns (exit code, stdout).
async fn router_cli_out(r: &RouterProc, args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_router"))
            .args(args)
            .args(["--api", &r.url("")])
            .env_remove("ROUTER_TOKEN")
            .env_remove("ROUTER_API")
            .output(),
    )
    .await
    .expect("the command finished")
    .expect("run the command");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A held key is visible where an operator looks first (`router targets ls` says it, with
/// the command that releases it), the fate of an entry behind it names the key itself in the
/// release path (it printed the literal `{key}`), and `router targets release-key` lets the
/// entry go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_shows_in_targets_ls_and_the_cli_releases_it() {
    let rcv = Receiver::scripted(Arc::new(|ev, _| {
        let status = if ev["data"]["fail"] == true { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: ordered\n        policy: held",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let keyed = |id: &str, fail: bool| {
        let mut e = event(id, "t", json!({ "fail": fail }));
        e["partitionkey"] = json!("K/1");
        e
    };
    post_batch(&r, &[keyed("first", true), keyed("behind", false)]).await;
    let waiting = eventually(Duration::from_secs(15), || async {
        let f = fate(&r, "behind").await;
        f["targets"][0]["waiting_on"]
            .as_str()
            .filter(|w| w.contains("held after a dead letter"))
            .map(str::to_owned)
    })
    .await
    .expect("the entry behind the dead letter waits for its key");
    assert!(
        waiting.contains("`router targets release-key ordered \"K/1\"`")
            && waiting.contains("POST /v1/targets/ordered/keys/K%2F1/release"),
        "{waiting}"
    );
    let (code, out) = router_cli_out(&r, &["targets", "ls"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("ordered: 1 ordering key(s) held after a dead letter (\"K/1\")")
            && out.contains("`router targets release-key ordered <key>`"),
        "{out}"
    );
    let (code, out) = router_cli_out(&r, &["targets", "release-key", "ordered", "K/1"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("released key \"K/1\" of \"ordered\""), "{out}");
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s
            .iter()
            .any(|x| x.event_id() == "behind"))
            .await,
        "the event behind the released key was delivered"
    );
    let (code, _) = router_cli_out(&r, &["targets", "release-key", "ordered", "K/1"]).await;
    assert_ne!(code, Some(0), "a key no longer held is refused (404)");
}

/// An ordering key longer than 256 bytes is kept as its digest (`sha256:<hex>`): a held key
/// of 70,000 characters could not be released before (the release URL went past the
/// request head's bound, 431), and each queued entry kept the whole key in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_held_key_is_shown_and_released_as_its_digest() {
    let rcv = Receiver::scripted(Arc::new(|ev, _| {
        let status = if ev["data"]["fail"] == true { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: ordered\n        policy: held",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let long = "k".repeat(70_000);
    let keyed = |id: &str, fail: bool| {
        let mut e = event(id, "t", json!({ "fail": fail }));
        e["partitionkey"] = json!(long);
        e
    };
    post_batch(&r, &[keyed("first", true), keyed("behind", false)]).await;
    let key = eventually(Duration::from_secs(15), || async {
        let (_, t) = get_json(&r, "/v1/targets/ordered").await;
        t["held_keys"][0].as_str().map(str::to_owned)
    })
    .await
    .expect("the dead letter holds its key");
    assert!(key.starts_with("sha256:") && key.len() == 71, "{key}");
    assert_eq!(fate(&r, "behind").await["targets"][0]["ordering_key"], key);
    let (status, b) = post_json(
        &r,
        &format!("/v1/targets/ordered/keys/{key}/release"),
        json!({}),
    )
    .await;
    assert_eq!(status, 200, "{b}");
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s
            .iter()
            .any(|x| x.event_id() == "behind"))
            .await,
        "the event behind the released key was delivered"
    );
}

/// Releasing a held key whose waiting entries are past max_age moves them all to the DLQ
/// (`max_age_exceeded`, unsent) and lets the key go on: before, each release dead-lettered one
/// of them, which held the key again, so a backlog of N took N releases. Their fates said so
/// beforehand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_held_key_moves_its_expired_entries_to_the_dlq_at_once() {
    let rcv = Receiver::scripted(Arc::new(|ev, _| {
        let status = if ev["data"]["fail"] == true { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold\n    retry: { max_attempts: 1, max_age: 1s }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: aged\n        policy: held",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let keyed = |id: &str, fail: bool| {
        let mut e = event(id, "t", json!({ "fail": fail }));
        e["partitionkey"] = json!("AG");
        e
    };
    let mut batch = vec![keyed("ag-1", true)];
    batch.extend((2..=6).map(|i| keyed(&format!("ag-{i}"), false)));
    post_batch(&r, &batch).await;
    eventually(Duration::from_secs(15), || async {
        let (_, t) = get_json(&r, "/v1/targets/aged").await;
        (t["held_keys"] == json!(["AG"])).then_some(())
    })
    .await
    .expect("the dead letter holds AG");
    // Past max_age (1 s) with a margin for a slow machine.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiting = fate(&r, "ag-2").await["targets"][0]["waiting_on"].clone();
    assert!(
        waiting
            .as_str()
            .is_some_and(|w| w.contains("held") && w.contains("past its max_age")),
        "{waiting}"
    );
    let (status, b) = post_json(&r, "/v1/targets/aged/keys/AG/release", json!({})).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["dead_lettered_past_max_age"], 5, "{b}");
    let (_, t) = get_json(&r, "/v1/targets/aged").await;
    assert_eq!(t["held_keys"], json!([]), "not held again: {t}");
    let (_, l) = get_json(&r, "/v1/dlq?target=aged&reason=max_age_exceeded").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(5), "{l}");
    // The key goes on: a new event of it is delivered.
    post_batch(&r, &[keyed("ag-7", false)]).await;
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s
            .iter()
            .any(|x| x.event_id() == "ag-7"))
            .await,
        "the released key's next event was delivered"
    );
    assert!(
        !rcv.distinct_ids().contains("ag-2"),
        "expired entries are not sent"
    );
}

/// `router.dlq.added` says which ordering key the dead letter is of, whether it now holds
/// that key, and its DLQ entry's id: an alert route could not tell that a key had stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_announcement_names_its_key_the_hold_and_its_entry() {
    let rcv = Receiver::status(400).await;
    let alerts = Receiver::ok().await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold";
    let rules = format!(
        "{}  - name: page-on-dlq\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: {}\n        id: pager\n",
        rules_yaml(
            policy,
            &[(
                "r",
                "t",
                &[format!(
                    "webhook: {}\n        id: ordered\n        policy: held",
                    rcv.url()
                )]
            )]
        ),
        alerts.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let mut e = event("k-1", "t", json!({}));
    e["partitionkey"] = json!("K");
    post_batch(&r, &[e, event("plain", "t", json!({}))]).await;
    assert!(
        alerts
            .wait_for(Duration::from_secs(15), |s| s.len() >= 2)
            .await,
        "two router.dlq.added alerts"
    );
    let (_, l) = get_json(&r, "/v1/dlq?target=ordered").await;
    let dlq_id_of = |id: &str| {
        l["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["event"]["id"] == id)
            .map(|d| d["id"].clone())
            .unwrap_or_default()
    };
    let data_of = |id: &str| {
        alerts
            .received()
            .into_iter()
            .map(|a| a.body["data"].clone())
            .find(|d| d["event"]["id"] == id)
            .unwrap_or_default()
    };
    let keyed = data_of("k-1");
    assert_eq!(keyed["ordering_key"], "K", "{keyed}");
    assert_eq!(keyed["key_held"], true, "{keyed}");
    assert_eq!(keyed["dlq_id"], dlq_id_of("k-1"), "{keyed} {l}");
    let plain = data_of("plain");
    assert_eq!(plain["ordering_key"], Value::Null, "{plain}");
    assert_eq!(plain["key_held"], false, "{plain}");
    assert_eq!(plain["dlq_id"], dlq_id_of("plain"), "{plain} {l}");
}

/// A contract that no `data` meets (it needs a field nobody sends).
const NEVER_VALID: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["never_sent"]
}"#;

/// The alert route's own queue at its cap: the announcements that overflow it are dead
/// letters like any other, counted in `router_dlq_entries_total` (the system-event router
/// discarded the store's answer, and an audit found 123 DLQ entries no metric counted), and
/// announced no further (the alert path would feed on its own failures).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_that_overflow_the_alert_queue_are_counted_dead_letters() {
    let alerts = Receiver::ok().await;
    let rules = format!(
        "policies:\n  capped:\n    max_queue_depth: 3\nrules:\n  - name: page-on-dlq\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: {}\n        id: pager\n        policy: capped\n",
        alerts.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[("t/v1.json", NEVER_VALID)]);
    // Paused, the pager keeps three announcements; the others overflow.
    assert_eq!(
        post_json(&r, "/v1/targets/pager/pause", json!({})).await.0,
        200
    );
    let batch: Vec<_> = (0..30)
        .map(|i| event(&format!("p{i}"), "t", json!({"i": i})))
        .collect();
    post_batch(&r, &batch).await;
    let overflowed = "router_dlq_entries_total{target=\"pager\",reason=\"target_overflow\"}";
    // Every announcement is made once all 30 are queued or dead letters. On the embedded
    // store the cap is exact (3 queued, 27 overflow); on JetStream each announcement is its
    // own accept, checked against a view of the queue that may lag its own writes by a few,
    // so more may be queued: there every overflow must still be counted.
    let strict = !RouterProc::on_jetstream();
    let dead = eventually(Duration::from_secs(20), || async {
        let (_, t) = get_json(&r, "/v1/targets/pager").await;
        let (queued, dlq) = (t["queued"].as_u64()?, t["dlq"].as_u64()?);
        (queued + dlq == 30).then_some(dlq)
    })
    .await
    .expect("all 30 announcements made");
    if strict {
        assert_eq!(dead, 27, "the queue's cap of 3");
    }
    let counted = eventually(Duration::from_secs(20), || async {
        let n = counter(&metrics_text(&r).await, overflowed);
        (n >= dead).then_some(n)
    })
    .await;
    assert_eq!(
        counted,
        Some(dead),
        "announcements past the cap were not counted"
    );
    let (_, l) = get_json(&r, "/v1/dlq?target=pager&limit=100").await;
    assert_eq!(
        l["entries"].as_array().map(|e| e.len() as u64),
        Some(dead),
        "{l}"
    );
    // Nothing more comes of them: no announcement of the overflow, so no more dead letters.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(&m, overflowed),
        dead,
        "{}",
        metric_lines(&m, "dlq_entries")
    );
    assert_eq!(
        counter(
            &m,
            "router_dlq_entries_total{target=\"none\",reason=\"contract_violation\"}"
        ),
        30
    );
    assert_eq!(alerts.count(), 0, "paused");
}

/// A handler's emission that goes to the DLQ (here it fails its contract) is announced as
/// about the handler's target, so a rule that sends `router.dlq.added` to that same handler
/// does not hand the handler its own failure (it did: the announcement was about no
/// target). The announcement counts one hop more than the emission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emissions_dead_letter_is_not_announced_to_the_handler_that_emitted_it() {
    use crate::handlers::{plugin, put_handler};
    let alerts = Receiver::ok().await;
    let rules = format!(
        "rules:\n  - name: enrich-all\n    pattern:\n      type: [order, router.dlq.added]\n    targets:\n      - handler: enrich\n        id: e\n  - name: page-on-dlq\n    pattern:\n      type: [router.dlq.added]\n    targets:\n      - webhook: {}\n        id: pager\n",
        alerts.url()
    );
    let r = RouterProc::start(
        &[("r.yaml", &rules)],
        &[("order.enriched/v1.json", NEVER_VALID)],
    );
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    assert_eq!(
        post_event(&r, &event("o1", "order", json!({"a": 1})))
            .await
            .0,
        202
    );
    assert!(
        alerts
            .wait_for(Duration::from_secs(30), |s| !s.is_empty())
            .await,
        "no router.dlq.added for the quarantined emission"
    );
    let alert = alerts.received()[0].body.clone();
    assert_eq!(
        (&alert["subject"], &alert["data"]["emitted_by"]),
        (&json!("e"), &json!("e")),
        "about the emitting target: {alert}"
    );
    assert_eq!(alert["data"]["target"], Value::Null, "{alert}");
    assert_eq!(alert["data"]["reason"], "contract_violation", "{alert}");
    assert_eq!(alert["hops"], 2, "the emission's hop plus one: {alert}");
    // The handler ran for the order only, never for the announcement of its own emission.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, t) = get_json(&r, "/v1/targets/e").await;
    assert_eq!(t["delivered"], 1, "{t}");
    assert_eq!(alerts.count(), 1);
}

/// Dead letters without a target (quarantined at ingest) are `target="none"` in the metrics;
/// the same name selects them in the DLQ API, so the DLQ an alert names is the one an operator
/// lists. Before, `?target=none` listed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letters_without_a_target_are_listed_as_target_none() {
    let refusing = Receiver::status(400).await;
    let rules = rules_yaml(
        "",
        &[(
            "r",
            "order",
            &[format!("webhook: {}\n        id: hook", refusing.url())],
        )],
    );
    let strict = r#"{"type": "object", "required": ["id"]}"#;
    let r = RouterProc::start(&[("r.yaml", &rules)], &[("order/v1.json", strict)]);
    let (_, b) = post_event(&r, &event("q1", "order", json!({"name": "no id"}))).await;
    assert_eq!(b["results"][0]["status"], "quarantined");
    let (_, b) = post_event(&r, &event("p1", "order", json!({"id": 1}))).await;
    assert_eq!(b["results"][0]["status"], "accepted");
    eventually(Duration::from_secs(15), || async {
        let (_, l) = get_json(&r, "/v1/dlq").await;
        (l["entries"].as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await
    .expect("both dead letters");
    let (status, l) = get_json(&r, "/v1/dlq?target=none").await;
    assert_eq!(status, 200, "{l}");
    let ids: Vec<_> = l["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["event"]["id"].clone())
        .collect();
    assert_eq!(ids, [json!("q1")], "{l}");
    let (_, s) = get_json(&r, "/v1/dlq/summary?target=none").await;
    assert_eq!(s["groups"].as_array().map(Vec::len), Some(1), "{s}");
    assert_eq!(s["groups"][0]["reason"], "contract_violation", "{s}");
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains("router_dlq_depth{target=\"none\"} 1"),
        "{}",
        metric_lines(&metrics, "router_dlq_depth")
    );
    let (status, p) = post_json(
        &r,
        "/v1/dlq/purge",
        json!({ "filter": { "target": "none" }, "dry_run": true }),
    )
    .await;
    assert_eq!((status, p["matched"].clone()), (200, json!(1)), "{p}");
}

/// Once an operator purged an event's dead letter, its fate says `purged` for that target: it
/// said `dlq` with an empty `dlq` list, and the reader went looking for an entry that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_dead_letter_shows_as_purged_in_the_fate() {
    let refusing = Receiver::status(400).await;
    let rules = webhook_rule("r", "order", &refusing.url(), "hook");
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (_, b) = post_event(&r, &event("p1", "order", json!({"id": 1}))).await;
    assert_eq!(b["results"][0]["status"], "accepted", "{b}");
    let dead = eventually(Duration::from_secs(15), || async {
        let f = fate(&r, "p1").await;
        (f["targets"][0]["state"] == "dlq").then_some(f)
    })
    .await
    .expect("the permanent failure is dead-lettered");
    assert_eq!(dead["dlq"].as_array().map(Vec::len), Some(1), "{dead}");
    let (s, p) = post_json(&r, "/v1/dlq/purge", json!({"filter": {"target": "hook"}})).await;
    assert_eq!((s, p["purged"].clone()), (200, json!(1)), "{p}");
    let f = fate(&r, "p1").await;
    assert_eq!(f["dlq"], json!([]), "{f}");
    assert_eq!(f["targets"][0]["state"], "purged", "{f}");
}

/// The fate and a dead letter show the event's `data` as the producer sent it (and as every
/// target receives it): built as a JSON value, an integer past what `f64` holds exactly showed
/// as 1.8446744073709552e+19, and `1.10` as 1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fate_and_the_dlq_show_data_as_sent() {
    let a = Receiver::status(400).await;
    let r = RouterProc::start(&[("r.yaml", &webhook_rule("r", "t", &a.url(), "a"))], &[]);
    let body = r#"{"specversion":"1.0","id":"big","source":"/test","type":"t","data":{"n":18446744073709551616,"f":1.10}}"#;
    let resp = client()
        .post(r.url("/v1/events"))
        .header("content-type", "application/cloudevents+json")
        .body(body)
        .send()
        .await
        .expect("post");
    assert_eq!(resp.status(), 202);
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    let r = &r;
    let text = |path: String| async move {
        client()
            .get(r.url(&path))
            .send()
            .await
            .expect("get")
            .text()
            .await
            .expect("text")
    };
    let sent = r#""data":{"n":18446744073709551616,"f":1.10}"#;
    let fate_text = text("/v1/events/big?source=/test".to_owned()).await;
    assert!(fate_text.contains(sent), "{fate_text}");
    let id = eventually(Duration::from_secs(10), || async {
        let (_, dlq) = get_json(r, "/v1/dlq").await;
        dlq["entries"][0]["id"].as_str().map(str::to_owned)
    })
    .await
    .expect("a dead letter");
    let entry = text(format!("/v1/dlq/{id}")).await;
    assert!(entry.contains(sent), "{entry}");
    assert_eq!(
        entry.matches("\"event\":").count(),
        1,
        "one event member: {entry}"
    );
    let v: Value = serde_json::from_str(&entry).expect("JSON");
    assert_eq!(v["event"]["id"], "big", "{v}");
}

/// A removed target's entries behind a held ordering key do not drain: `/v1/status` says so
/// and names the key (before, its warning said only that the queue drains under the last
/// configuration, and the operator waited for entries that wait for a release: the day-2
/// audit). Released, they drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_targets_entries_behind_a_held_key_are_said_to_wait_for_a_release() {
    let rcv = Receiver::scripted(Arc::new(|ev, _| {
        let status = if ev["data"]["fail"] == true { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let policy = "  held:\n    ordering: partitionkey\n    on_dead_letter: hold";
    let target = format!(
        "webhook: {}\n        id: ordered\n        policy: held",
        rcv.url()
    );
    let rules = rules_yaml(policy, &[("r", "t", std::slice::from_ref(&target))]);
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let keyed = |id: &str, fail: bool| {
        let mut e = event(id, "t", json!({ "fail": fail }));
        e["partitionkey"] = json!("K");
        e
    };
    post_batch(&r, &[keyed("first", true), keyed("behind", false)]).await;
    eventually(Duration::from_secs(15), || async {
        let (_, t) = get_json(&r, "/v1/targets/ordered").await;
        (t["held_keys"] == json!(["K"]) && t["queued"] == 1).then_some(())
    })
    .await
    .expect("the dead letter holds K with one entry behind it");
    // The rule goes; the target stays only to drain.
    std::fs::write(
        r.dir.path().join("rules").join("r.yaml"),
        rules_yaml(
            policy,
            &[(
                "other",
                "u",
                std::slice::from_ref(&target.replace("id: ordered", "id: other")),
            )],
        ),
    )
    .expect("rules");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let warnings = get_json(&r, "/v1/status").await.1["warnings"].to_string();
    assert!(
        warnings.contains("target ordered is no longer in the rules; its 1 queued entries drain under its last configuration, except the 1 behind its held ordering key(s) \\\"K\\\": they wait for `router targets release-key ordered <key>`"),
        "{warnings}"
    );
    let (s, _) = post_json(&r, "/v1/targets/ordered/keys/K/release", json!({})).await;
    assert_eq!(s, 200);
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s
            .iter()
            .any(|x| x.event_id() == "behind"))
            .await,
        "released, the entry behind drains"
    );
}
