//! Several router processes sharing one NATS JetStream store (SPEC "Storage and scale"): only
//! in the suite's JetStream pass (`scripts/jetstream-e2e.sh`); on the embedded store each
//! router has a file of its own and there is nothing to share.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use crate::harness::*;

/// Two routers on one stream, producers posting to either: every event reaches the webhook
/// once, a (source, id) sent to both is stored once, either node shows any event's fate, and
/// when one node is killed the other delivers the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_on_one_jetstream_store_deliver_each_event_once() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "hook");
    let shared = format!("CLUSTER{}", std::process::id());
    let env = [
        ("ROUTER_STORE__JETSTREAM__STREAM", shared.as_str()),
        (
            "ROUTER_STORE__JETSTREAM__PREFIX",
            &format!("cluster.{}", std::process::id()),
        ),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, *v)).collect();
    let mut a = RouterProc::start_with_env(&[("r.yaml", &rules)], &[], &env);
    let b = RouterProc::start_with_env(&[("r.yaml", &rules)], &[], &env);
    let n = 400;
    for chunk in 0..(n / 50) {
        let batch: Vec<_> = (0..50)
            .map(|i| event(&format!("c{}", chunk * 50 + i), "t", json!({})))
            .collect();
        let node = if chunk % 2 == 0 { &a } else { &b };
        post_batch(node, &batch).await;
    }
    // The same event on both nodes at once: one copy.
    let same = serde_json::to_vec(&event("both", "t", json!({}))).expect("json");
    let (ra, rb) = tokio::join!(
        post_raw(&a, "application/cloudevents+json", same.clone()),
        post_raw(&b, "application/cloudevents+json", same),
    );
    let statuses: Vec<String> = [ra.1, rb.1]
        .iter()
        .map(|r| {
            r["results"][0]["status"]
                .as_str()
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    let mut sorted = statuses.clone();
    sorted.sort();
    assert_eq!(sorted, vec!["accepted", "duplicate"], "{statuses:?}");
    // A fate accepted on one node reads the same on the other.
    assert_eq!(fate(&b, "c0").await["event"]["id"], "c0");
    // Half-way, one node dies; the other carries on (its own leases reclaimed when the dead
    // one restarts, the rest delivered by the survivor).
    assert!(
        rcv.wait_for(Duration::from_secs(60), |s| s.len() >= n / 4)
            .await,
        "no progress"
    );
    a.kill9();
    assert!(
        rcv.wait_for(Duration::from_secs(90), |_| rcv.distinct_ids().len() > n)
            .await
            || rcv.distinct_ids().len() > n,
        "only {} of {} events delivered after a node died",
        rcv.distinct_ids().len(),
        n + 1
    );
    a.restart();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in rcv.received() {
        *per_id.entry(r.event_id()).or_default() += 1;
    }
    assert_eq!(per_id.len(), n + 1);
    // Redeliveries only for the attempts the killed node had in flight (same key).
    let twice = per_id.values().filter(|c| **c > 1).count();
    assert!(twice <= 64, "{twice} events delivered more than once");
    let (_, st) = get_json(&b, "/v1/status").await;
    assert_eq!(st["store"]["backend"], "jetstream");
}
