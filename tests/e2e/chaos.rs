//! Chaos: kill -9 again and again under a mixed load — single events, producer batches,
//! ordered keys, a flaky target that retries, a batching webhook and a WASM handler whose
//! emissions re-enter the pipeline — then one last restart and the ledger is checked: every
//! event that got 202 reached every target, no event reached only some of them, redeliveries
//! kept their Idempotency-Key, each key's events arrived in order, a handler re-run emitted
//! nothing twice under a new id, and nothing went to the DLQ. A second run does it all while
//! the sweeper removes events a second after their acceptance.
//!
//! `CHAOS_CYCLES` (default 4) sets the number of kills and `CHAOS_SEED` the seed of the
//! kill times (printed on every run, so a failure can be replayed); `scripts/chaos.sh` runs
//! many cycles.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::handlers::{plugin, put_handler};
use crate::harness::*;

/// What the producers learnt across all cycles.
#[derive(Default)]
struct Ledger {
    /// Ids of `t` events answered 202 (they go to plain, flaky, bulk and the handler).
    fanned: HashSet<String>,
    /// Ids of `o` events answered 202 (they go to the ordered target).
    ordered: HashSet<String>,
    /// Answers other than 202 that are not back-pressure: a failure of the test.
    unexpected: Vec<String>,
}

/// A small deterministic generator (SplitMix64) for kill times and batch sizes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const PAD: usize = 200;
/// Ordered keys, one sequential producer each.
const KEYS: usize = 4;

fn chaos_rules(plain: &str, flaky: &str, bulk: &str, ordered: &str, out: &str) -> String {
    format!(
        "policies:
  fast:
    timeout: 10s
    retry: {{ max_attempts: 100, base_delay: 20ms, max_delay: 200ms }}
    # A third of the flaky target's events fail twice: retries are two thirds of its first
    # attempts, which the default budget (10%) would spread over minutes. Not this test's
    # subject: the budget is as wide as it goes.
    retry_budget: 1.0
  ordered:
    ordering: partitionkey
    retry: {{ max_attempts: 100, base_delay: 20ms, max_delay: 200ms }}
rules:
  - name: fan
    pattern: {{ type: [t] }}
    targets:
      - webhook: {plain}
        id: plain
        policy: fast
      - webhook: {flaky}
        id: flaky
        policy: fast
      - webhook: {bulk}
        id: bulk
        policy: fast
        batch: {{ max_events: 20 }}
      - handler: enrich
        id: enrich
        policy: fast
  - name: ord
    pattern: {{ type: [o] }}
    targets:
      - webhook: {ordered}
        id: ordered
        policy: ordered
  - name: enriched-out
    pattern: {{ type: [t.enriched] }}
    targets:
      - webhook: {out}
        id: out
        policy: fast
"
    )
}

/// Posts `body` (structured or batch); `Some(true)` on 202, `Some(false)` on back-pressure or
/// an answer the ledger records as unexpected, `None` once the router is gone.
async fn post(
    c: &reqwest::Client,
    url: &str,
    content_type: &str,
    body: String,
    ledger: &Mutex<Ledger>,
) -> Option<bool> {
    let resp = c
        .post(url)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .ok()?;
    let status = resp.status().as_u16();
    match status {
        202 => {
            let v: Value = resp.json().await.ok()?;
            let all_accepted = v["results"]
                .as_array()
                .is_some_and(|r| r.iter().all(|x| x["status"] == "accepted"));
            if !all_accepted {
                ledger
                    .lock()
                    .expect("ledger")
                    .unexpected
                    .push(format!("202 with {v}"));
            }
            Some(all_accepted)
        }
        // Back-pressure (a compaction, the disk mark): retried by the caller.
        429 | 503 => {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Some(false)
        }
        _ => {
            let text = resp.text().await.unwrap_or_default();
            ledger
                .lock()
                .expect("ledger")
                .unexpected
                .push(format!("{status} {text}"));
            Some(false)
        }
    }
}

/// One cycle's producers, until `stop` or the router dies: `singles` tasks of single `t`
/// events, one task of `t` batches, and one sequential task per ordered key (its next number
/// carried over cycles in `next_n`).
#[allow(clippy::too_many_arguments)]
async fn produce(
    url: String,
    cycle: usize,
    singles: usize,
    batch_seed: u64,
    next_n: Arc<Vec<AtomicUsize>>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
) {
    let mut tasks = Vec::new();
    for task in 0..singles {
        let (url, ledger, stop) = (url.clone(), ledger.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("s{cycle}-{task}-{n}");
                let body = event(&id, "t", json!({"i": id, "pad": "x".repeat(PAD)})).to_string();
                match post(&c, &url, "application/cloudevents+json", body, &ledger).await {
                    None => return,
                    Some(true) => {
                        ledger.lock().expect("ledger").fanned.insert(id);
                        n += 1;
                    }
                    Some(false) => {}
                }
            }
        }));
    }
    {
        let (url, ledger, stop) = (url.clone(), ledger.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut rng = Rng(batch_seed);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let size = 1 + rng.below(40) as usize;
                let ids: Vec<String> = (0..size).map(|k| format!("b{cycle}-{n}-{k}")).collect();
                let batch: Vec<Value> = ids
                    .iter()
                    .map(|id| event(id, "t", json!({"i": id, "pad": "x".repeat(PAD)})))
                    .collect();
                let body = Value::Array(batch).to_string();
                match post(
                    &c,
                    &url,
                    "application/cloudevents-batch+json",
                    body,
                    &ledger,
                )
                .await
                {
                    None => return,
                    Some(true) => {
                        ledger.lock().expect("ledger").fanned.extend(ids);
                        n += 1;
                    }
                    Some(false) => {}
                }
            }
        }));
    }
    for key in 0..KEYS {
        let (url, ledger, stop, next_n) =
            (url.clone(), ledger.clone(), stop.clone(), next_n.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            while !stop.load(Ordering::Relaxed) {
                // Taken before the post: an event the router stored without answering keeps its
                // number, and the next one gets a higher number either way.
                let n = next_n[key].fetch_add(1, Ordering::Relaxed);
                let id = format!("o{key}-{n}");
                let mut ev = event(&id, "o", json!({"key": key, "n": n}));
                ev["partitionkey"] = json!(format!("k{key}"));
                match post(
                    &c,
                    &url,
                    "application/cloudevents+json",
                    ev.to_string(),
                    &ledger,
                )
                .await
                {
                    None => return,
                    Some(true) => {
                        ledger.lock().expect("ledger").ordered.insert(id);
                    }
                    Some(false) => {}
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Ids of the events in a batching webhook's requests (each body an array).
fn batched_ids(rcv: &Receiver) -> HashSet<String> {
    rcv.seen
        .lock()
        .expect("seen")
        .iter()
        .flat_map(|r| {
            r.body
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|e| e["id"].as_str().unwrap_or_default().to_string())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .collect()
}

/// The input ids the handler's emissions carry (`data.i`), each with the emitted event ids.
fn emitted(out: &Receiver) -> HashMap<String, HashSet<String>> {
    let mut m: HashMap<String, HashSet<String>> = HashMap::new();
    for r in out.seen.lock().expect("seen").iter() {
        let input = r.body["data"]["i"].as_str().unwrap_or_default().to_string();
        m.entry(input).or_default().insert(r.event_id());
    }
    m
}

fn sample<'a>(ids: impl Iterator<Item = &'a String>) -> Vec<&'a String> {
    let mut v: Vec<_> = ids.collect();
    v.sort();
    v.truncate(8);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_kill_9_under_mixed_load_loses_and_reorders_nothing() {
    chaos(&[], false).await;
}

/// The same while the sweeper removes finished events (and their dedup keys) a second after
/// they were accepted: sweeps, deliveries and kills interleave, and a sweep must never take an
/// event that a queue entry still needs. (Fates are not sampled: the sweep removes them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_kill_9_while_sweeping_loses_and_reorders_nothing() {
    chaos(&SWEEP_SOON, true).await;
}

/// One chaos run: the routers get `env`. With `sweeping` (the env makes the sweeper remove
/// events a second after acceptance), the fate API is not sampled at the end, and the last
/// router must be seen sweeping events.
async fn chaos(env: &[(&str, &str)], sweeping: bool) {
    let cycles: usize = std::env::var("CHAOS_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("chaos: {cycles} cycles, CHAOS_SEED={seed}");
    let mut rng = Rng(seed);

    let plain = Receiver::ok().await;
    // Every third event fails its first two attempts (a 503, then a 500), so retries are
    // waiting in the queue when the kills come.
    let flaky = Receiver::scripted(Arc::new(|ev: &Value, seen: usize| {
        let id = ev["id"].as_str().unwrap_or_default();
        let unlucky = id.bytes().map(u64::from).sum::<u64>() % 3 == 0;
        let status = match (unlucky, seen) {
            (true, 0) => 503,
            (true, 1) => 500,
            _ => 200,
        };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let bulk = Receiver::ok().await;
    let ordered = Receiver::ok().await;
    let out = Receiver::ok().await;
    let rules = chaos_rules(
        &plain.url(),
        &flaky.url(),
        &bulk.url(),
        &ordered.url(),
        &out.url(),
    );
    let mut r = RouterProc::start_with_env(&[("r.yaml", &rules)], &[], env);
    let (status, body) = put_handler(&r, "enrich", plugin("enrich")).await;
    assert_eq!(status, 201, "{body}");

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let next_n: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    for cycle in 0..cycles {
        if cycle > 0 {
            r.restart();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let producers = tokio::spawn(produce(
            r.url("/v1/events"),
            cycle,
            8,
            rng.next(),
            next_n.clone(),
            ledger.clone(),
            stop.clone(),
        ));
        // Anywhere from just after the start (recovery and redelivery of the last cycle's
        // backlog still running) to well into the load.
        let run = Duration::from_millis(100 + rng.below(2400));
        tokio::time::sleep(run).await;
        r.kill9();
        stop.store(true, Ordering::Relaxed);
        let _ = producers.await;
        let l = ledger.lock().expect("ledger");
        eprintln!(
            "cycle {cycle}: killed after {run:?}; 202'd so far: {} fanned, {} ordered",
            l.fanned.len(),
            l.ordered.len()
        );
    }
    r.restart();
    let (fanned, ordered_ids, unexpected) = {
        let l = ledger.lock().expect("ledger");
        (l.fanned.clone(), l.ordered.clone(), l.unexpected.clone())
    };
    assert!(
        unexpected.is_empty(),
        "unexpected answers: {:?}",
        &unexpected[..unexpected.len().min(5)]
    );
    assert!(
        !fanned.is_empty() && !ordered_ids.is_empty(),
        "no load got through"
    );

    // Everything that got 202 arrives (generous: a debug build on a loaded 2-core machine,
    // with retries and a WASM handler to run). Polled twice a second: each look goes over
    // every request the receivers saw.
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let arrived = loop {
        let missing = !fanned.is_subset(&ids(&plain))
            || !fanned.is_subset(&ids(&flaky))
            || !fanned.is_subset(&batched_ids(&bulk))
            || !fanned.is_subset(&emitted(&out).into_keys().collect())
            || !ordered_ids.is_subset(&ids(&ordered));
        if !missing {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let drained = queues_drained(&r, Duration::from_secs(60)).await;
    let plain_ids = ids(&plain);
    let flaky_ids = ids(&flaky);
    let bulk_ids = batched_ids(&bulk);
    let emitted = emitted(&out);
    let emitted_inputs: HashSet<String> = emitted.keys().cloned().collect();
    let ordered_got = ids(&ordered);
    for (name, got) in [
        ("plain", &plain_ids),
        ("flaky", &flaky_ids),
        ("bulk", &bulk_ids),
        ("handler emissions", &emitted_inputs),
    ] {
        let missing: Vec<_> = fanned.difference(got).collect();
        assert!(
            missing.is_empty(),
            "{name} is missing {} of {} events that got 202, e.g. {:?}",
            missing.len(),
            fanned.len(),
            sample(missing.into_iter())
        );
    }
    let missing: Vec<_> = ordered_ids.difference(&ordered_got).collect();
    assert!(
        missing.is_empty(),
        "ordered is missing {} of {} events that got 202, e.g. {:?}",
        missing.len(),
        ordered_ids.len(),
        sample(missing.into_iter())
    );
    assert!(arrived && drained, "queues did not drain");

    // No half-routed event: an event stored without its 202 (in flight at a kill) reached
    // every target of its rule or none.
    for (name, got) in [
        ("flaky", &flaky_ids),
        ("bulk", &bulk_ids),
        ("handler emissions", &emitted_inputs),
    ] {
        let only_plain: Vec<_> = plain_ids.difference(got).collect();
        let only_there: Vec<_> = got.difference(&plain_ids).collect();
        assert!(
            only_plain.is_empty() && only_there.is_empty(),
            "half-routed: {} only at plain, {} only at {name}, e.g. {:?} / {:?}",
            only_plain.len(),
            only_there.len(),
            sample(only_plain.into_iter()),
            sample(only_there.into_iter())
        );
    }

    // A redelivery keeps its Idempotency-Key; a handler re-run emits under the same id.
    for (name, rcv) in [
        ("plain", &plain),
        ("flaky", &flaky),
        ("ordered", &ordered),
        ("out", &out),
    ] {
        let keys = keys_by_event(&rcv.received());
        let changed: Vec<_> = keys
            .iter()
            .filter(|(_, k)| k.len() != 1)
            .map(|(id, _)| id)
            .collect();
        assert!(
            changed.is_empty(),
            "{name}: a redelivery changed its Idempotency-Key: {:?}",
            sample(changed.into_iter())
        );
    }
    let twice: Vec<_> = emitted
        .iter()
        .filter(|(_, ids)| ids.len() != 1)
        .map(|(input, _)| input)
        .collect();
    assert!(
        twice.is_empty(),
        "a handler re-run emitted under a new id: {:?}",
        sample(twice.into_iter())
    );

    // Per key, arrivals never go back: a redelivery after a kill repeats the last event, and
    // nothing later was sent before it was acknowledged.
    let mut last: BTreeMap<u64, u64> = BTreeMap::new();
    for g in ordered.received() {
        let (key, n) = (
            g.body["data"]["key"].as_u64().unwrap_or(u64::MAX),
            g.body["data"]["n"].as_u64().unwrap_or(0),
        );
        let prev = last.insert(key, n);
        assert!(
            prev.is_none_or(|p| p <= n),
            "key k{key}: event {n} arrived after {prev:?}"
        );
    }

    // What the API says agrees with what the receivers saw: a sample of the events that got
    // 202 each show all four targets delivered, with at least one attempt each (a flaky
    // target's retries, made across kills, are all on record: three for an unlucky event).
    let mut fanned_sorted: Vec<&String> = fanned.iter().collect();
    fanned_sorted.sort();
    for _ in 0..if sweeping { 0 } else { 40 } {
        let id = fanned_sorted[rng.below(fanned_sorted.len() as u64) as usize];
        let f = fate(&r, id).await;
        let targets = f["targets"].as_array().cloned().unwrap_or_default();
        assert_eq!(targets.len(), 4, "{id}: {f}");
        for t in &targets {
            assert_eq!(t["state"], "delivered", "{id}: {f}");
            let attempts = t["attempts"].as_array().map_or(0, Vec::len);
            assert!(attempts >= 1, "{id}: {f}");
            if t["target"] == "flaky" && id.bytes().map(u64::from).sum::<u64>() % 3 == 0 {
                assert!(
                    attempts >= 3,
                    "{id}: two failures and a success expected: {f}"
                );
            }
        }
    }

    // Nothing was dead-lettered: every target answers 2xx in the end, well within its
    // attempts.
    let (_, dlq) = get_json(&r, "/v1/dlq").await;
    let entries = dlq["entries"].as_array().map_or(0, Vec::len);
    assert_eq!(entries, 0, "dead letters: {dlq}");
    if sweeping {
        // The sweeper did run here (its debug lines are off; its counter is the evidence). The
        // last router's alone: counters start again with each process.
        let swept = eventually(Duration::from_secs(30), || async {
            let m = metrics_text(&r).await;
            let n = counter(&m, "router_swept_records_total{kind=\"event\"}");
            (n > 0).then_some(n)
        })
        .await;
        let events = swept.expect("the sweeper removed no event");
        eprintln!("chaos: the last router swept {events} events");
    }
    eprintln!(
        "chaos: {} fanned and {} ordered events got 202; redeliveries: plain {}, flaky {} \
         (with its retries), ordered {}, out {}",
        fanned.len(),
        ordered_ids.len(),
        plain.count() - plain_ids.len(),
        flaky.count() - flaky_ids.len(),
        ordered.count() - ordered_got.len(),
        out.count() - emitted.len(),
    );
}

/// Distinct event ids a (non-batching) receiver saw, read under its lock (no copy of the
/// requests).
fn ids(rcv: &Receiver) -> HashSet<String> {
    rcv.seen
        .lock()
        .expect("seen")
        .iter()
        .map(|r| r.body["id"].as_str().unwrap_or_default().to_string())
        .collect()
}
