//! Several router processes sharing one NATS JetStream store (SPEC "Storage and scale"): only
//! in the suite's JetStream pass (`scripts/jetstream-e2e.sh`); on the embedded store each
//! router has a file of its own and there is nothing to share.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

/// Two routers on one JetStream stream of their own (named after `tag` and this process),
/// with the same rules and contracts.
fn two_routers(tag: &str, rules: &str, contracts: &[(&str, &str)]) -> (RouterProc, RouterProc) {
    let stream = format!("{tag}{}", std::process::id());
    let prefix = format!("{}.{}", tag.to_lowercase(), std::process::id());
    let env = [
        ("ROUTER_STORE__JETSTREAM__STREAM", stream.as_str()),
        ("ROUTER_STORE__JETSTREAM__PREFIX", prefix.as_str()),
    ];
    let a = RouterProc::start_with_env(&[("r.yaml", rules)], contracts, &env);
    let b = RouterProc::start_with_env(&[("r.yaml", rules)], contracts, &env);
    (a, b)
}

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
    let (mut a, b) = two_routers("CLUSTER", &rules, &[]);
    // Each node says which it is: the id in its data dir, what its jobs name as runner.
    for r in [&a, &b] {
        let id = std::fs::read_to_string(r.data_dir().join("node-id")).expect("node-id");
        let (_, status) = get_json(r, "/v1/status").await;
        assert_eq!(status["node"].as_str(), Some(id.trim()), "{status}");
    }
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

/// A handler uploaded to one router of a cluster is installed on the others: the other node
/// runs it alone once the first is gone, a node that was down takes in what changed meanwhile
/// at start, and a delete on one node removes it from the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_uploaded_to_one_router_runs_on_every_router() {
    use crate::handlers::{plugin, put_handler};
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let sink = Receiver::ok().await;
    let rules = format!(
        "policies:\n  fast:\n    timeout: 10s\n    retry: {{ max_attempts: 20, base_delay: 50ms, max_delay: 1s }}\n\
         rules:\n  - name: to-enrich\n    pattern:\n      type: [order.created]\n    targets:\n      - handler: enrich\n        policy: fast\n\
         \x20 - name: enriched-out\n    pattern:\n      type: [order.created.enriched]\n    targets:\n      - webhook: {}\n        id: out\n",
        sink.url()
    );
    let (mut a, b) = two_routers("HANDLERS", &rules, &[]);

    let (s, v1) = put_handler(&a, "enrich", plugin("enrich")).await;
    assert_eq!(s, 201, "{v1}");
    // B installs it from the shared catalog (it follows it every 2 s; the bound allows for
    // compiling on a loaded machine).
    let on_b = eventually(Duration::from_secs(60), || async {
        let (s, h) = get_json(&b, "/v1/handlers/enrich").await;
        (s == 200 && h["active"]["sha256"] == v1["sha256"]).then_some(h)
    })
    .await;
    assert!(
        on_b.is_some(),
        "B never installed the handler uploaded to A"
    );
    let (_, st) = get_json(&b, "/v1/status").await;
    assert_eq!(st["handler_catalog"]["shared"], true, "{st}");
    assert!(st["handler_catalog"]["last_sync_at"].is_string(), "{st}");

    // With A gone, B runs the handler for every event.
    a.kill9();
    for i in 0..10 {
        let ev = event(&format!("o{i}"), "order.created", json!({"total": i}));
        assert_eq!(post_event(&b, &ev).await.0, 202);
    }
    assert!(
        sink.wait_for(Duration::from_secs(60), |s| s.len() >= 10)
            .await,
        "only {} of 10 enriched events from B",
        sink.count()
    );

    // A second version uploaded on B while A is down: A has it as soon as it is back.
    let mut bytes = plugin("enrich");
    bytes.extend_from_slice(&[0, 9, 4, b'n', b'o', b't', b'e', 1, 2, 3, 4]);
    let (s, v2) = put_handler(&b, "enrich", bytes).await;
    assert_eq!((s, v2["version"].as_u64()), (201, Some(2)), "{v2}");
    a.restart();
    let (_, h) = get_json(&a, "/v1/handlers/enrich").await;
    assert_eq!(h["active"]["version"], 2, "{h}");

    // A rollback on A reaches B; a delete on B reaches A.
    let (s, back) = post_json(&a, "/v1/handlers/enrich/rollback", json!({"version": "1"})).await;
    assert_eq!(s, 200, "{back}");
    let rolled = eventually(Duration::from_secs(30), || async {
        let (_, h) = get_json(&b, "/v1/handlers/enrich").await;
        (h["active"]["version"] == 1).then_some(())
    })
    .await;
    assert!(rolled.is_some(), "B did not follow A's rollback");
    let deleted = client()
        .delete(b.url("/v1/handlers/enrich"))
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status().as_u16(), 200);
    let gone = eventually(Duration::from_secs(30), || async {
        (get_json(&a, "/v1/handlers/enrich").await.0 == 404).then_some(())
    })
    .await;
    assert!(gone.is_some(), "A kept a handler deleted on B");
}

/// A contract put over the API on one router of a cluster applies on the others (written into
/// each one's contracts directory and reloaded), a router that was down takes in what was
/// uploaded meanwhile before it serves, and a router that restarts does not write an upload
/// again over a change made to its directory since (as a deploy from git would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_uploaded_to_one_router_applies_on_every_router() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "hook");
    let v1 = r#"{"type": "object", "required": ["y"]}"#;
    let (a, mut b) = two_routers("CONTRACTS", &rules, &[("t/v1.json", v1)]);

    let v2 = json!({"type": "object", "required": ["z"]});
    let (code, body) = put_json(&a, "/v1/contracts/t/v2", v2.clone()).await;
    assert_eq!(code, 201, "{body}");
    let on_b = eventually(Duration::from_secs(30), || async {
        (get_json(&b, "/v1/contracts/t/v2").await.0 == 200).then_some(())
    })
    .await;
    assert!(on_b.is_some(), "B never applied the contract uploaded to A");
    let file = b.dir.path().join("contracts/t/v2.json");
    let on_disk: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("B's copy")).expect("JSON");
    assert_eq!(on_disk, v2);
    // B checks v2 events against it: a violation, not an unknown version.
    let mut ev = event("v2-without-z", "t", json!({"y": 1}));
    ev["dataversion"] = json!(2);
    let (_, res) = post_event(&b, &ev).await;
    assert_eq!(res["results"][0]["status"], "quarantined", "{res}");
    assert_eq!(res["results"][0]["reason"], "contract_violation", "{res}");
    let (_, st) = get_json(&b, "/v1/status").await;
    assert!(st["contract_catalog"]["last_sync_at"].is_string(), "{st}");
    assert_eq!(st["contract_catalog"]["contract_errors"], json!({}), "{st}");

    // B's directory changes after the upload (a compatible edit deployed from git): a restart
    // keeps the edit.
    let edited =
        r#"{"type": "object", "required": ["z"], "properties": {"w": {"type": "string"}}}"#;
    std::fs::write(&file, edited).expect("edit");
    let reloaded = eventually(Duration::from_secs(30), || async {
        let (_, c) = get_json(&b, "/v1/contracts/t/v2").await;
        c["schema"]["properties"]["w"].is_object().then_some(())
    })
    .await;
    assert!(reloaded.is_some(), "B did not reload its edited directory");
    b.kill9();
    // v3 is uploaded while B is down: B has it as soon as it serves, so its first v3 event
    // is checked against it (not quarantined as an unknown version, for good).
    let (code, body) = put_json(&a, "/v1/contracts/t/v3", json!({"required": ["x"]})).await;
    assert_eq!(code, 201, "{body}");
    b.restart();
    let mut ev = event("v3-without-x", "t", json!({}));
    ev["dataversion"] = json!(3);
    let (_, res) = post_event(&b, &ev).await;
    assert_eq!(res["results"][0]["reason"], "contract_violation", "{res}");
    let log = b.log_text();
    let applied = log.rfind("contract uploaded on another node applied");
    let listening = log.rfind("router listening");
    assert!(
        applied.is_some() && applied < listening,
        "B served before it took in v3:\n{log}"
    );
    // Longer than a sync interval (2 s): the first sync runs at start.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        std::fs::read_to_string(&file).expect("B's copy"),
        edited,
        "the restart wrote the old upload over the edit"
    );
    let (_, c) = get_json(&b, "/v1/contracts/t/v2").await;
    assert!(c["schema"]["properties"]["w"].is_object(), "{c}");
}

/// A NATS server of one test's own (the JetStream pass's shared one cannot be stopped without
/// failing every other test): started on a free port with a store directory it keeps across a
/// kill and restart.
struct OwnNats {
    bin: std::path::PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    child: Option<std::process::Child>,
}

impl OwnNats {
    /// `None` outside the JetStream pass, whose script names the server binary.
    fn start() -> Option<Self> {
        let bin = std::env::var_os("E2E_NATS_SERVER")?.into();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut n = Self {
            bin,
            dir: tempfile::tempdir().expect("tempdir"),
            port,
            child: None,
        };
        n.spawn();
        Some(n)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let conf = self.dir.path().join("server.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{}\nmax_payload: 8MB\njetstream {{ store_dir: \"{}\", sync_interval: always }}\n",
                self.port,
                self.dir.path().join("js").display()
            ),
        )
        .expect("server config");
        let child = std::process::Command::new(&self.bin)
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// While the store is unreachable, a contract upload is refused with 503 and `Retry-After`
/// (the store's fault, not the file's) and changes nothing on the node that got it; once the
/// store is back, the same upload goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_upload_while_the_store_is_down_changes_nothing() {
    let Some(mut nats) = OwnNats::start().filter(|_| RouterProc::on_jetstream()) else {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    };
    let rcv = Receiver::ok().await;
    let url = nats.url();
    let a = RouterProc::start_with_env(
        &[("r.yaml", &webhook_rule("r", "t", &rcv.url(), "hook"))],
        &[("t/v1.json", r#"{"type": "object"}"#)],
        &[
            ("ROUTER_STORE__JETSTREAM__URL", url.as_str()),
            ("ROUTER_STORE__JETSTREAM__TIMEOUT", "2s"),
        ],
    );
    let v2 = json!({"type": "object", "required": ["z"]});
    nats.kill();
    let resp = client()
        .put(a.url("/v1/contracts/t/v2"))
        .json(&v2)
        .send()
        .await
        .expect("put");
    let (status, retry_after) = (resp.status().as_u16(), retry_after_header(&resp));
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 503, "{body}");
    assert!(retry_after.is_some(), "503 without Retry-After");
    assert_eq!(get_json(&a, "/v1/contracts/t/v2").await.0, 404);
    assert!(!a.dir.path().join("contracts/t/v2.json").exists());

    // Back: sent again, it goes through (200 rather than 201 when the write that timed out
    // reached the store after all, and the sync applied it first).
    nats.spawn();
    let through = eventually(Duration::from_secs(60), || async {
        let (code, body) = put_json(&a, "/v1/contracts/t/v2", v2.clone()).await;
        (code == 200 || code == 201).then_some(body)
    })
    .await;
    assert!(
        through.is_some(),
        "the upload never went through once the store was back"
    );
    assert_eq!(get_json(&a, "/v1/contracts/t/v2").await.0, 200);
}

/// A store outage under a router (its own nats-server, killed and started again while an
/// attempt is under way): meanwhile the router says it is not ready and why, answers at once
/// (ingest and a pause: 503 without waiting out the store's timeout), and its scrapes stay
/// quick with the store's size unknown, not 0; afterwards, what it refused is never applied
/// (the client held such writes and sent them on its reconnect: the pause took effect once
/// the store was back), and the delivery whose finish fell in the outage is recorded with its
/// one attempt instead of being sent again after its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_reported_at_once_and_leaves_nothing_behind() {
    use std::sync::Arc;
    use std::time::Instant;
    let Some(mut nats) = OwnNats::start().filter(|_| RouterProc::on_jetstream()) else {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    };
    // The receiver takes 2 s to answer: time to stop the store during the attempt.
    let rcv = Receiver::scripted(Arc::new(|_, _| (200, Duration::from_secs(2), vec![]))).await;
    let rules = rules_yaml(
        "  slow:\n    timeout: 10s\n    retry: { max_attempts: 2, base_delay: 100ms }",
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: hook\n        policy: slow",
                rcv.url()
            )],
        )],
    );
    let url = nats.url();
    let a = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[
            ("ROUTER_STORE__JETSTREAM__URL", url.as_str()),
            ("ROUTER_STORE__JETSTREAM__TIMEOUT", "2s"),
        ],
    );
    assert_eq!(post_event(&a, &event("e1", "t", json!({}))).await.0, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(10), |r| !r.is_empty())
            .await,
        "the attempt never reached the receiver"
    );
    nats.kill();

    let not_ready = eventually(Duration::from_secs(5), || async {
        let r = client().get(a.url("/readyz")).send().await.ok()?;
        (r.status().as_u16() == 503).then_some(())
    })
    .await;
    assert!(
        not_ready.is_some(),
        "/readyz stayed ready with the store down"
    );
    // Well under Prometheus' 10 s scrape timeout (bounded at 2 s; 5 s here for a loaded
    // machine).
    let t = Instant::now();
    let (_, status) = get_json(&a, "/v1/status").await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "status took {:?}",
        t.elapsed()
    );
    assert_eq!(status["store"]["writable"], false, "{status}");
    assert!(status["store"]["bytes"].is_null(), "{status}");
    let t = Instant::now();
    let metrics = metrics_text(&a).await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "/metrics took {:?}",
        t.elapsed()
    );
    assert!(metrics.contains("\nrouter_store_up 0\n"), "{metrics}");
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("router_store_bytes ")),
        "{metrics}"
    );
    // At once: the store's timeout is 2 s.
    let t = Instant::now();
    let (code, body) = post_event(&a, &event("e2", "t", json!({}))).await;
    assert_eq!(code, 503, "{body}");
    let (code, body) = post_json(&a, "/v1/targets/hook/pause", json!({})).await;
    assert_eq!(code, 503, "{body}");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "refusals took {:?}",
        t.elapsed()
    );

    nats.spawn();
    let ready = eventually(Duration::from_secs(30), || async {
        let r = client().get(a.url("/readyz")).send().await.ok()?;
        (r.status().as_u16() == 200).then_some(())
    })
    .await;
    assert!(ready.is_some(), "/readyz never became ready again");
    // Recorded once the store was back, well within the lease (10 s + 30 s).
    let delivered = eventually(Duration::from_secs(20), || async {
        let f = fate(&a, "e1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("the delivery was not recorded once the store was back");
    assert_eq!(
        delivered["targets"][0]["attempts"].as_array().map(Vec::len),
        Some(1),
        "{delivered}"
    );
    // The refused pause stays refused (the node follows stored pauses every 2 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, t) = get_json(&a, "/v1/targets/hook").await;
    assert_eq!(
        t["paused"], false,
        "a pause refused with 503 took effect: {t}"
    );
    assert_eq!(rcv.count(), 1, "the event was sent again");
    let (_, status) = get_json(&a, "/v1/status").await;
    assert_eq!(status["store"]["writable"], true, "{status}");
}

/// Containment made on one router holds on every router: a target paused through one node gets
/// no attempts from any node until it is resumed (through another), and a rule disabled on one
/// node routes nothing anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_or_a_disabled_rule_on_one_router_holds_on_every_router() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::ok().await;
    let side = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[
            (
                "main",
                "t",
                &[format!("webhook: {}\n        id: hook", rcv.url())],
            ),
            (
                "side",
                "t",
                &[format!("webhook: {}\n        id: side", side.url())],
            ),
        ],
    );
    let (a, b) = two_routers("CONTAIN", &rules, &[]);

    assert_eq!(
        post_json(&a, "/v1/targets/hook/pause", json!({})).await.0,
        200
    );
    assert_eq!(
        post_json(&a, "/v1/rules/side/disable", json!({})).await.0,
        200
    );
    // B follows within its 2 s interval; then events posted to B wait in the paused queue and
    // match only the enabled rule.
    let followed = eventually(Duration::from_secs(20), || async {
        let (_, t) = get_json(&b, "/v1/targets/hook").await;
        (t["paused"] == true).then_some(())
    })
    .await;
    assert!(followed.is_some(), "B never showed A's pause");
    // The follower's own metric says so too, and its status shows it reads the others' state.
    let m = metrics_text(&b).await;
    assert_eq!(
        counter(&m, "router_target_paused{target=\"hook\"}"),
        1,
        "{}",
        metric_lines(&m, "router_target_paused")
    );
    let (_, status) = get_json(&b, "/v1/status").await;
    let sync = &status["containment_sync"];
    assert!(
        sync["last_sync_at"].is_string() && sync["error"].is_null(),
        "{sync}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    for i in 0..10 {
        let ev = event(&format!("p{i}"), "t", json!({}));
        assert_eq!(post_event(&b, &ev).await.0, 202);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rcv.count(), 0, "a paused target got attempts from B");
    assert_eq!(side.count(), 0, "a disabled rule routed on B");
    let f = fate(&b, "p0").await;
    assert_eq!(f["matched_rules"], json!(["main"]), "{f}");

    // Resumed through B: every node delivers again, A included.
    assert_eq!(
        post_json(&b, "/v1/targets/hook/resume", json!({})).await.0,
        200
    );
    assert!(
        rcv.wait_for(Duration::from_secs(30), |s| s.len() >= 10)
            .await,
        "only {} of 10 delivered after the resume",
        rcv.count()
    );
    let resumed_on_a = eventually(Duration::from_secs(20), || async {
        let (_, t) = get_json(&a, "/v1/targets/hook").await;
        (t["paused"] == false).then_some(())
    })
    .await;
    assert!(resumed_on_a.is_some(), "A kept the target paused");
    let m = metrics_text(&a).await;
    assert_eq!(
        counter(&m, "router_target_paused{target=\"hook\"}"),
        0,
        "A's metric kept the pause it took through its own API: {}",
        metric_lines(&m, "router_target_paused")
    );
}

/// A receiver's `Retry-After` holds every router off, not only the one it answered: the
/// others follow the pause from the target's stored state (within their 2 s interval), so a
/// backlog posted to any router waits for the pause to end instead of each router spending an
/// attempt per entry on the 429s the receiver announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_answered_to_one_router_holds_off_every_router() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    // The first request ever: 429 with Retry-After: 8. Every other: 200.
    let rcv = Receiver::retry_after_first(Duration::ZERO, 8).await;
    let policy =
        "  p:\n    retry: { max_attempts: 2, base_delay: 10ms, max_delay: 10ms, jitter: none }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: ra\n        policy: p",
                rcv.url()
            )],
        )],
    );
    let (a, b) = two_routers("RETRYAFTER", &rules, &[]);
    assert_eq!(post_event(&a, &event("first", "t", json!({}))).await.0, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| !s.is_empty())
            .await
    );
    let answered_at = rcv.received()[0].at;
    // Whichever router sent it, both show the pause: one from the answer, the other from the
    // stored state.
    for r in [&a, &b] {
        let shown = eventually(Duration::from_secs(6), || async {
            let (_, t) = get_json(r, "/v1/targets/ra").await;
            t["retry_after_until"].as_str().map(str::to_string)
        })
        .await;
        assert!(
            shown.is_some(),
            "a router never showed the Retry-After pause"
        );
    }
    for i in 0..6 {
        let r = if i % 2 == 0 { &a } else { &b };
        let ev = event(&format!("next-{i}"), "t", json!({}));
        assert_eq!(post_event(r, &ev).await.0, 202);
    }
    assert!(
        rcv.wait_for(Duration::from_secs(40), |s| s.len() >= 8)
            .await,
        "only {} requests: the first, its retry and the six after the pause",
        rcv.count()
    );
    let got = rcv.received();
    for g in &got[1..] {
        // 8 s asked; the routers' clocks are the test's, less a little for the rounding of
        // the header's seconds.
        assert!(
            g.at - answered_at >= Duration::from_millis(7_500),
            "{} sent {:?} after the 429",
            g.event_id(),
            g.at - answered_at
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        rcv.count(),
        8,
        "one request per event, and one retry of the first"
    );
}

/// An operator's resume through one router lifts a receiver's Retry-After hold on every
/// router: the others read the lift from the operator's record (within their 2 s interval)
/// and do not take the lifted hold up again from the target's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_on_one_router_lifts_a_retry_after_hold_on_every_router() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    // The first request ever: 429 with Retry-After: 900. Every other: 200.
    let rcv = Receiver::retry_after_first(Duration::ZERO, 900).await;
    let policy =
        "  p:\n    retry: { max_attempts: 5, base_delay: 10ms, max_delay: 10ms, jitter: none }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: ra\n        policy: p",
                rcv.url()
            )],
        )],
    );
    let (a, b) = two_routers("LIFT", &rules, &[]);
    assert_eq!(post_event(&a, &event("first", "t", json!({}))).await.0, 202);
    async fn held(r: &RouterProc) -> bool {
        get_json(r, "/v1/targets/ra").await.1["retry_after_until"].is_string()
    }
    for r in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(10), || async {
                held(r).await.then_some(())
            })
            .await
            .is_some(),
            "a router never showed the Retry-After hold"
        );
    }
    let (s, t) = post_json(&a, "/v1/targets/ra/resume", json!({})).await;
    assert_eq!(s, 200, "{t}");
    // The follower's interval is 2 s; 10 s for a loaded machine.
    assert!(
        eventually(Duration::from_secs(10), || async {
            (!held(&b).await).then_some(())
        })
        .await
        .is_some(),
        "the other router still holds off after the resume"
    );
    for i in 0..4 {
        let r = if i % 2 == 0 { &a } else { &b };
        assert_eq!(
            post_event(r, &event(&format!("next-{i}"), "t", json!({})))
                .await
                .0,
            202
        );
    }
    assert!(
        rcv.wait_for(Duration::from_secs(20), |s| s
            .iter()
            .filter(|x| x.event_id().starts_with("next-"))
            .count()
            == 4)
            .await,
        "the events after the resume were delivered through both routers"
    );
    // A few follower rounds later neither router has taken the lifted hold up again.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!held(&a).await && !held(&b).await);
}

/// A redrive job runs on one router of a cluster: an operator pauses it through another router
/// and it stops everywhere; resumed, it goes on; when the router running it dies, another takes
/// it over and finishes it, moving each entry once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_job_runs_on_one_router_and_outlives_it() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let broken = Arc::new(AtomicBool::new(true));
    let b2 = broken.clone();
    let rcv = Receiver::scripted(Arc::new(move |_, _| {
        let status = if b2.load(Ordering::SeqCst) { 400 } else { 200 };
        (status, Duration::ZERO, vec![])
    }))
    .await;
    let rules = webhook_rule("r", "t", &rcv.url(), "consumer");
    let (mut a, b) = two_routers("JOBS", &rules, &[]);
    let n = 60;
    let batch: Vec<_> = (0..n)
        .map(|i| event(&format!("j{i}"), "t", json!({})))
        .collect();
    post_batch(&a, &batch).await;
    let in_dlq = eventually(Duration::from_secs(30), || async {
        let (_, l) = get_json(&b, "/v1/dlq?target=consumer&limit=1000").await;
        (l["entries"].as_array().map(Vec::len) == Some(n)).then_some(())
    })
    .await;
    assert!(in_dlq.is_some(), "the events did not reach the DLQ");
    broken.store(false, Ordering::SeqCst);
    let before = rcv.count();

    let (s, job) = post_json(
        &a,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "consumer"}, "rate_per_sec": 4}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let path = format!("/v1/dlq/redrive/{id}");
    let (_, seen) = get_json(&b, &path).await;
    let runner_a = seen["runner"].as_str().expect("a runner").to_string();

    // Paused through B: the runner on A stops.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (s, p) = post_json(&b, &format!("{path}/pause"), json!({})).await;
    assert_eq!(s, 200, "{p}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, on_a) = get_json(&a, &path).await;
    assert_eq!(on_a["state"], "paused", "{on_a}");
    let paused_at = rcv.count();
    assert!(
        paused_at < before + n,
        "the job finished before it could be paused"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rcv.count(), paused_at, "deliveries went on after the pause");

    // Resumed on A, then A dies: B takes the job over (30 s without a renewal, checked every
    // 10 s) and finishes it.
    let (s, r) = post_json(&a, &format!("{path}/resume"), json!({})).await;
    assert_eq!(s, 200, "{r}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.kill9();
    let done = eventually(Duration::from_secs(120), || async {
        let (_, j) = get_json(&b, &path).await;
        (j["state"] == "done").then_some(j)
    })
    .await
    .expect("the job was not finished after its router died");
    assert_ne!(done["runner"].as_str(), Some(runner_a.as_str()), "{done}");
    let (_, l) = get_json(&b, "/v1/dlq?target=consumer").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(0), "{l}");
    // Received after the fix: each event answered 200 at least once (a redelivery of an
    // attempt in flight when A died carries the same key).
    let redelivered = || {
        rcv.received()
            .iter()
            .skip(before)
            .map(Received::event_id)
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    assert!(
        rcv.wait_for(Duration::from_secs(30), |_| redelivered() >= n)
            .await,
        "only {} of {n} events delivered after the fix",
        redelivered()
    );
    for i in [0, n / 2, n - 1] {
        let f = fate(&b, &format!("j{i}")).await;
        assert_eq!(
            f["targets"][0]["redrive_count"], 1,
            "moved more than once: {f}"
        );
    }
}

/// A redrive moves the dead letters that existed when it was created, each once, and no
/// others. Each router numbers its dead letters from a block of its own, so a dead letter made
/// after the job by the router with the older block has a lower id than the job's newest
/// entries: the job moved those too, among them its own entries failing again, moving an entry
/// twice and counting past its total. (An audit saw it as "moved 207 of total 200" after a
/// takeover: entries a router killed -9 held were dead-lettered again by the other when their
/// leases ran out.) Here each router's dead letters are made while the other is stopped
/// (SIGSTOP), and the job runs on A, with the older block, against a receiver still refusing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_moves_only_the_dead_letters_there_were_each_once() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::status(400).await;
    let rules = webhook_rule("r", "t", &rcv.url(), "hook");
    let (a, b) = two_routers("REMARK", &rules, &[]);
    /// Waits until `r` lists `n` dead letters of `hook`.
    async fn dead(r: &RouterProc, n: usize) {
        let listed = eventually(Duration::from_secs(60), || async {
            let (_, l) = get_json(r, "/v1/dlq?target=hook&limit=1000").await;
            (l["entries"].as_array().map(Vec::len) == Some(n)).then_some(())
        })
        .await;
        assert!(
            listed.is_some(),
            "{} never listed {n} dead letters",
            r.url("")
        );
    }
    let batch = |prefix: &str| -> Vec<Value> {
        (0..10)
            .map(|i| event(&format!("{prefix}{i}"), "t", json!({})))
            .collect()
    };
    // A's dead letters first (its block of ids), then B's (the next block, above).
    b.signal("STOP");
    post_batch(&a, &batch("x")).await;
    dead(&a, 10).await;
    b.signal("CONT");
    a.signal("STOP");
    post_batch(&b, &batch("y")).await;
    dead(&b, 20).await;
    a.signal("CONT");
    // The job on A, delivering alone: what fails again is numbered from A's block.
    b.signal("STOP");
    dead(&a, 20).await;
    let (s, job) = post_json(
        &a,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "hook"}, "rate_per_sec": 4}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    assert_eq!(job["total"], 20, "{job}");
    let path = format!("/v1/dlq/redrive/{}", job["id"].as_str().expect("job id"));
    // 20 entries at 4/s take 5 s; a job chasing what fails again went on well past 20.
    let ended = eventually(Duration::from_secs(90), || async {
        let (_, j) = get_json(&a, &path).await;
        let past = j["moved"].as_u64().unwrap_or(0) > 20;
        (j["state"] == "done" || past).then_some(j)
    })
    .await
    .expect("the job did not finish");
    assert_eq!(ended["state"], "done", "{ended}");
    assert_eq!(
        (&ended["moved"], &ended["failed"], &ended["skipped"]),
        (&json!(20), &json!(0), &json!(0)),
        "{ended}"
    );
    // Each event sent twice: refused, then redriven once and refused again, back in the DLQ
    // for the operator to redrive after the fix.
    assert!(
        rcv.wait_for(Duration::from_secs(30), |r| r.len() >= 40)
            .await,
        "only {} deliveries",
        rcv.count()
    );
    dead(&a, 20).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in rcv.received() {
        *per_id.entry(r.event_id()).or_default() += 1;
    }
    assert_eq!(per_id.len(), 20, "{per_id:?}");
    assert!(per_id.values().all(|&n| n == 2), "{per_id:?}");
    b.signal("CONT");
}

/// A replay job paused through one router and resumed at once through the router running it,
/// before that router's runner has read the pause (at 0.5/s it reads the stored job only before
/// a step, the first due after 2 s), still has one runner: each archived event is replayed
/// once. (The resume used to start a second runner beside the first, and both replayed every
/// event.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_paused_elsewhere_and_resumed_on_its_runner_runs_once() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("r", "t", &rcv.url(), "hook");
    let (a, b) = two_routers("JOBRACE", &rules, &[]);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let n = 4;
    let batch: Vec<_> = (0..n)
        .map(|i| event(&format!("p{i}"), "t", json!({})))
        .collect();
    post_batch(&a, &batch).await;
    assert!(
        rcv.wait_for(Duration::from_secs(30), |s| s.len() >= n)
            .await,
        "the events were not delivered"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let to = chrono::Utc::now();

    let (s, job) = post_json(
        &a,
        "/v1/replay",
        json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": 0.5}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let path = format!("/v1/replay/{id}");
    let (s, p) = post_json(&b, &format!("{path}/pause"), json!({})).await;
    assert_eq!(s, 200, "{p}");
    let (s, r) = post_json(&a, &format!("{path}/resume"), json!({})).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["state"], "running", "{r}");

    let done = eventually(Duration::from_secs(60), || async {
        let (_, j) = get_json(&a, &path).await;
        (j["state"] == "done").then_some(j)
    })
    .await
    .expect("the replay did not finish");
    assert_eq!(done["moved"], n, "{done}");
    // Time for a second runner's late deliveries to arrive, were there one.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut replays: std::collections::HashMap<String, usize> = Default::default();
    for g in rcv.received() {
        if g.body["replay"] == id.as_str() {
            *replays.entry(g.event_id()).or_default() += 1;
        }
    }
    assert_eq!(replays.len(), n, "{replays:?}");
    assert!(
        replays.values().all(|&c| c == 1),
        "an event replayed more than once: {replays:?}"
    );
}

/// A throttle's rate holds for the cluster, not per router: two routers split a target's
/// 10/s between them, so 40 events take about 4 s to deliver, not 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_keep_to_one_throttle_rate_together() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "  slow:\n    throttle: { rate_per_sec: 10, burst: 2 }",
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: erp\n        policy: slow",
                rcv.url()
            )],
        )],
    );
    let (a, b) = two_routers("THROTTLE", &rules, &[]);
    // Each node counts the other within its announcement interval (5 s).
    for r in [&a, &b] {
        let shared = eventually(Duration::from_secs(20), || async {
            let (_, t) = get_json(r, "/v1/targets/erp").await;
            (t["throttle_share"]["nodes"] == 2).then_some(t)
        })
        .await;
        let t = shared.expect("both nodes counted");
        assert_eq!(t["throttle_share"]["rate_per_sec"], 5.0, "{t}");
    }
    let (_, st) = get_json(&a, "/v1/status").await;
    assert_eq!(st["nodes"], 2, "{st}");

    let n = 40;
    let started = std::time::Instant::now();
    for chunk in 0..(n / 10) {
        let batch: Vec<_> = (0..10)
            .map(|i| event(&format!("s{}", chunk * 10 + i), "t", json!({})))
            .collect();
        post_batch(if chunk % 2 == 0 { &a } else { &b }, &batch).await;
    }
    assert!(
        rcv.wait_for(Duration::from_secs(60), |s| s.len() >= n)
            .await,
        "only {} of {n} delivered",
        rcv.count()
    );
    let took = started.elapsed().as_secs_f64();
    // 40 at 10/s together is 4 s less the two nodes' bursts (2 × 1 token, each node's burst
    // of 2 being halved): at least ~3.6 s. Each node at the full rate would take about 2 s.
    assert!(
        took >= 3.0,
        "40 events took {took:.2}s: the nodes did not share the rate"
    );
}

/// A breaker opened on one router opens the others' for the same target once they too have
/// seen it fail: here B's own threshold is out of reach (1,000 requests), so only following
/// A's breaker can open it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_opened_on_one_router_opens_on_the_others_that_saw_failures() {
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let rcv = Receiver::status(500).await;
    let rules_with = |min_requests: u32| {
        rules_yaml(
            &format!(
                "  guarded:\n    retry: {{ max_attempts: 50, base_delay: 50ms, max_delay: 200ms }}\n    breaker: {{ failure_rate: 0.5, min_requests: {min_requests}, window: 60s, open_for: 120s }}"
            ),
            &[(
                "r",
                "t",
                &[format!(
                    "webhook: {}\n        id: erp\n        policy: guarded",
                    rcv.url()
                )],
            )],
        )
    };
    let stream = format!("BREAKER{}", std::process::id());
    let prefix = format!("breaker.{}", std::process::id());
    let env = [
        ("ROUTER_STORE__JETSTREAM__STREAM", stream.as_str()),
        ("ROUTER_STORE__JETSTREAM__PREFIX", prefix.as_str()),
    ];
    let a = RouterProc::start_with_env(&[("r.yaml", &rules_with(3))], &[], &env);
    let b = RouterProc::start_with_env(&[("r.yaml", &rules_with(1000))], &[], &env);
    let batch: Vec<_> = (0..20)
        .map(|i| event(&format!("b{i}"), "t", json!({})))
        .collect();
    post_batch(&a, &batch).await;
    let open_until = |r: &RouterProc| {
        let r = r.url("/v1/targets/erp");
        async move {
            let t: serde_json::Value = client().get(r).send().await.ok()?.json().await.ok()?;
            (t["breaker"]["state"] == "open").then(|| t["breaker"]["open_until"].clone())
        }
    };
    let on_a = eventually(Duration::from_secs(30), || open_until(&a))
        .await
        .expect("A's breaker opened");
    let on_b = eventually(Duration::from_secs(30), || open_until(&b))
        .await
        .expect("B followed A's open breaker");
    assert_eq!(on_b, on_a, "B is open until A's time");
    let (_, t) = get_json(&b, "/v1/targets/erp").await;
    assert!(
        t["breaker"]["window_requests"].as_u64().unwrap_or(0) < 1000,
        "B could not have opened on its own: {t}"
    );
}

/// Handler ownership holds across nodes: a team's handler uploaded through one router cannot
/// be deleted or rolled back by another team through a router that has not installed it yet
/// (the check is made on the catalog's record, in the round that would write it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_team_cannot_delete_a_teams_handler_through_another_router() {
    use crate::handlers::plugin;
    if !RouterProc::on_jetstream() {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    }
    let stream = format!("OWNERS{}", std::process::id());
    let prefix = format!("owners.{}", std::process::id());
    let env = [
        ("ROUTER_STORE__JETSTREAM__STREAM", stream.as_str()),
        ("ROUTER_STORE__JETSTREAM__PREFIX", prefix.as_str()),
    ];
    let auth: String = [("billing-ci", "billing"), ("crm-ci", "crm")]
        .iter()
        .map(|(name, team)| {
            format!(
                "[[auth.tokens]]\nname = \"{name}\"\nteam = \"{team}\"\nsha256 = \"{}\"\nscopes = [\"handlers:*\"]\n\n",
                token_sha256(name)
            )
        })
        .collect();
    let a = RouterProc::start_full(&[], &[], &env, Some(&auth));
    let b = RouterProc::start_full(&[], &[], &env, Some(&auth));
    // A body is a component (PUT) or JSON (a rollback's).
    let send = |r: &RouterProc, method: &str, path: &str, token: &str, body: Option<Vec<u8>>| {
        let mut rb = client()
            .request(method.parse().expect("method"), r.url(path))
            .bearer_auth(token);
        if let Some(b) = body {
            let ct = if method == "PUT" {
                "application/wasm"
            } else {
                "application/json"
            };
            rb = rb.header("content-type", ct).body(b);
        }
        async move {
            let resp = rb.send().await.expect("send");
            let s = resp.status().as_u16();
            (s, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (s, v1) = send(
        &a,
        "PUT",
        "/v1/handlers/enrich",
        "billing-ci",
        Some(plugin("enrich")),
    )
    .await;
    assert_eq!(s, 201, "{v1}");
    // At once, through B (which follows the catalog every 2 s and may not have it yet).
    let (s, b1) = send(&b, "DELETE", "/v1/handlers/enrich", "crm-ci", None).await;
    assert_eq!(s, 403, "{b1}");
    let rollback = serde_json::to_vec(&json!({"version": "1"})).expect("json");
    let (s, b2) = send(
        &b,
        "POST",
        "/v1/handlers/enrich/rollback",
        "crm-ci",
        Some(rollback),
    )
    .await;
    assert_eq!(s, 403, "{b2}");
    // The handler is still there, on both.
    let (s, h) = send(&a, "GET", "/v1/handlers/enrich", "billing-ci", None).await;
    assert_eq!((s, h["owner"].as_str()), (200, Some("billing")), "{h}");
    let on_b = eventually(Duration::from_secs(60), || async {
        let (s, h) = get_json_as(&b, "/v1/handlers/enrich", "billing-ci").await;
        (s == 200 && h["active"]["sha256"] == v1["sha256"]).then_some(h)
    })
    .await;
    assert!(on_b.is_some(), "B never installed billing's handler");
    // The owner deletes it through B: gone on A too.
    let (s, d) = send(&b, "DELETE", "/v1/handlers/enrich", "billing-ci", None).await;
    assert_eq!(s, 200, "{d}");
}

async fn get_json_as(r: &RouterProc, path: &str, token: &str) -> (u16, Value) {
    let resp = client()
        .get(r.url(path))
        .bearer_auth(token)
        .send()
        .await
        .expect("get");
    let status = resp.status().as_u16();
    (status, resp.json::<Value>().await.unwrap_or(Value::Null))
}

/// A second router started on the data dir of one still running (a shared store's node
/// identity) refuses to start. Before, it reclaimed every lease of that identity as a dead
/// node's and sent the running node's deliveries in flight again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_router_on_a_live_nodes_data_dir_refuses_to_start() {
    let Ok(url) = std::env::var("E2E_JETSTREAM_URL") else {
        eprintln!("skipped: needs the JetStream pass (scripts/jetstream-e2e.sh)");
        return;
    };
    let stream = format!("NODELOCK{}", std::process::id());
    let prefix = format!("nodelock.{}", std::process::id());
    let env = [
        ("ROUTER_STORE__JETSTREAM__STREAM", stream.as_str()),
        ("ROUTER_STORE__JETSTREAM__PREFIX", prefix.as_str()),
    ];
    let a = RouterProc::start_with_env(&[], &[], &env);
    let mut second = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(a.data_dir())
        .arg("--rules")
        .arg(a.dir.path().join("rules"))
        .arg("--contracts")
        .arg(a.dir.path().join("contracts"))
        .env("ROUTER_STORE__BACKEND", "jetstream")
        .env("ROUTER_STORE__JETSTREAM__URL", &url)
        .env("ROUTER_STORE__JETSTREAM__STREAM", &stream)
        .env("ROUTER_STORE__JETSTREAM__PREFIX", &prefix)
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // Generous: the refusal comes before the store is opened.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = second.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = second.kill();
            panic!("the second router kept running on a live node's data dir");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().expect("stderr"), &mut stderr)
        .expect("stderr");
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("is in use by another router"), "{stderr}");
    let (status, _) = get_json(&a, "/readyz").await;
    assert_eq!(status, 200, "the first router carries on");
}
