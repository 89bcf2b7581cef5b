//! WASM handlers end to end: upload and validation, versions and rollback, handler targets
//! under the same queues and policies, emitted events re-entering the pipeline, idempotent KV
//! effects, hostile handlers contained, logs, and the compiled-code cache across a restart.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

/// The example plugins, built once per test run by plugins/build.sh (the README's test
/// command builds them first, so this is normally a quick no-op check).
pub(crate) fn plugins() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = root.join("target/plugins");
        let status = std::process::Command::new("bash")
            .arg(root.join("plugins/build.sh"))
            .env("OUT", &out)
            .status()
            .expect("run plugins/build.sh");
        assert!(
            status.success(),
            "plugins/build.sh failed: install the wasm32-wasip2 target and Python 3 (see README)"
        );
        out
    })
}

pub(crate) fn plugin(name: &str) -> Vec<u8> {
    std::fs::read(plugins().join(format!("{name}.wasm"))).expect("plugin built")
}

pub(crate) async fn put_handler(r: &RouterProc, name: &str, bytes: Vec<u8>) -> (u16, Value) {
    let resp = client()
        .put(r.url(&format!("/v1/handlers/{name}")))
        .body(bytes)
        // Validating means compiling: the 18 MB Python component takes tens of seconds on a
        // loaded 2-core machine with the debug build.
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .expect("put");
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

async fn logs(r: &RouterProc, name: &str) -> Vec<Value> {
    get_json(r, &format!("/v1/handlers/{name}/logs")).await.1["lines"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The attempt numbers of the `hostile` handler's "slow: attempt N done" log lines, sorted.
fn slow_attempts(lines: &[Value]) -> Vec<u64> {
    let mut done: Vec<u64> = lines
        .iter()
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("slow: attempt"))
        })
        .filter_map(|l| l["attempt"].as_u64())
        .collect();
    done.sort_unstable();
    done
}

const FAST: &str =
    "  fast:\n    timeout: 10s\n    retry: { max_attempts: 5, base_delay: 50ms, max_delay: 200ms }";

/// A handler runtime that cannot start (here its default directory, `<data_dir>/handlers`,
/// is a file) stops a start whose rules have a handler target: before, the router said it was
/// ready and answered 202 to events that then waited, with no worker to apply their max_age,
/// until a restart. A `preload_dir` typo is refused by the configuration, naming the variable.
/// Without a handler target the router serves its webhooks, and `/readyz` and `/v1/status`
/// say the runtime is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_runtime_that_cannot_start_stops_a_start_that_needs_it_and_is_said_otherwise() {
    let hook = Receiver::ok().await;
    let webhook_only = rules_yaml(
        "",
        &[(
            "hooks",
            "t.both",
            &[format!("webhook: {}\n        id: hook", hook.url())],
        )],
    );
    let mut r = RouterProc::start(&[("r.yaml", &webhook_only)], &[]);
    let (code, ready) = get_json(&r, "/readyz").await;
    assert_eq!((code, ready), (200, json!({ "status": "ready" })));
    r.sigterm();
    let handlers = r.data_dir().join("handlers");
    std::fs::remove_dir_all(&handlers).expect("the runtime made its directory");
    std::fs::write(&handlers, "not a directory").expect("a file in its place");

    let both = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        both.path().join("r.yaml"),
        rules_yaml(
            "",
            &[(
                "both",
                "t.both",
                &[
                    "handler: noop\n        id: wasm".to_string(),
                    format!("webhook: {}\n        id: hook", hook.url()),
                ],
            )],
        ),
    )
    .expect("rules");
    let contracts = r.dir.path().join("contracts");
    let (code, log) = r.serve_refused(both.path(), &contracts);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(
            "the WASM handler runtime cannot start (handlers.dir (default: <data_dir>/handlers) "
        ) && log.contains("and the rules have handler targets (wasm)"),
        "{log}"
    );

    let missing = tempfile::tempdir().expect("tempdir");
    let missing = missing.path().join("no-such-plugins");
    let missing = missing.to_str().expect("utf-8 path");
    r.set_env("ROUTER_HANDLERS__PRELOAD_DIR", Some(missing));
    let (code, log) = r.serve_refused(&r.dir.path().join("rules"), &contracts);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!("handlers.preload_dir {missing}: No such file"))
            && log.contains("(set by ROUTER_HANDLERS__PRELOAD_DIR)"),
        "{log}"
    );
    r.set_env("ROUTER_HANDLERS__PRELOAD_DIR", None);

    r.restart();
    let (code, ready) = get_json(&r, "/readyz").await;
    assert_eq!(code, 200, "{ready}");
    assert!(
        ready["degraded"][0].as_str().is_some_and(|d| d
            .starts_with("WASM handler runtime unavailable")
            && d.contains("handlers.dir")),
        "{ready}"
    );
    let (_, status) = get_json(&r, "/v1/status").await;
    assert!(
        status["warnings"]
            .to_string()
            .contains("WASM handler runtime unavailable"),
        "{status}"
    );
    let (code, body) = post_event(&r, &event("e-1", "t.both", json!({}))).await;
    assert_eq!(code, 202, "{body}");
    assert!(
        hook.wait_for(Duration::from_secs(10), |got| got.len() == 1)
            .await,
        "the webhook delivers while handlers cannot run"
    );
}

/// A preloaded handler is uploaded at the first start only: a restart leaves the versions as
/// they are, so a newer upload or a rollback made since stays in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_undo_changes_made_since_a_handler_was_preloaded() {
    let pre = tempfile::tempdir().expect("tempdir");
    std::fs::write(pre.path().join("noop.wasm"), plugin("noop")).expect("write");
    let mut r = RouterProc::start_with_env(
        &[],
        &[],
        &[(
            "ROUTER_HANDLERS__PRELOAD_DIR",
            pre.path().to_str().expect("utf-8 path"),
        )],
    );
    let (_, h) = get_json(&r, "/v1/handlers/noop").await;
    assert_eq!(h["active"]["version"], 1, "{h}");
    assert_eq!(h["active"]["uploader"], "preload", "{h}");
    let mut bytes = plugin("noop");
    bytes.extend_from_slice(&[0, 9, 4, b'n', b'o', b't', b'e', 1, 2, 3, 4]);
    let (s, v2) = put_handler(&r, "noop", bytes).await;
    assert_eq!((s, v2["version"].as_u64()), (201, Some(2)), "{v2}");
    r.kill9();
    r.restart();
    let (_, h) = get_json(&r, "/v1/handlers/noop").await;
    assert_eq!(
        h["active"]["version"], 2,
        "the restart re-activated the preloaded version: {h}"
    );
    assert_eq!(h["versions"].as_array().map(Vec::len), Some(2), "{h}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_are_validated_versioned_and_rolled_back() {
    let r = RouterProc::start(&[], &[]);
    let (s, b) = put_handler(&r, "enrich", b"not wasm at all".to_vec()).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("not a WebAssembly component"),
        "{b}"
    );
    let (s, b) = put_handler(&r, "other-name", plugin("enrich")).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("describe()"),
        "{b}"
    );
    let (s, v1) = put_handler(&r, "enrich", plugin("enrich")).await;
    assert_eq!(s, 201, "{v1}");
    assert_eq!(v1["version"], 1);
    assert_eq!(v1["sha256"].as_str().map(str::len), Some(64));
    // A second version (different bytes: the Python build of the same handler has another name,
    // so append a custom section to the same component to get new bytes).
    let mut bytes = plugin("enrich");
    bytes.extend_from_slice(&[0, 9, 4, b'n', b'o', b't', b'e', 1, 2, 3, 4]);
    let (s, v2) = put_handler(&r, "enrich", bytes).await;
    assert_eq!(s, 201, "{v2}");
    assert_eq!(v2["version"], 2);
    let (_, info) = get_json(&r, "/v1/handlers/enrich").await;
    assert_eq!(info["active"]["version"], 2);
    assert_eq!(info["versions"].as_array().map(Vec::len), Some(2));
    let resp = client()
        .post(r.url("/v1/handlers/enrich/rollback"))
        .json(&json!({"version": "1"}))
        .send()
        .await
        .expect("rollback");
    assert_eq!(resp.status().as_u16(), 200);
    let (_, info) = get_json(&r, "/v1/handlers/enrich").await;
    assert_eq!(info["active"]["version"], 1);
    assert_eq!(get_json(&r, "/v1/handlers/nope").await.0, 404);
}

/// The version answers say what happened: uploading bytes already stored creates nothing
/// (200, not 201), a version that cannot be one is a 400 naming the accepted forms (not a
/// 404), a name that is not one is refused as a percent-encoded one is, and the listing says
/// who switched the active version and when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_answers_say_what_happened_and_who_switched() {
    let r = RouterProc::start(&[], &[]);
    let listed = || async {
        let (_, list) = get_json(&r, "/v1/handlers").await;
        list["handlers"][0].clone()
    };
    let (s, v1) = put_handler(&r, "noop", plugin("noop")).await;
    assert_eq!((s, &v1["version"]), (201, &json!(1)), "{v1}");
    let h = listed().await;
    assert_eq!(h["activated_by"], "local", "{h}");
    let first_at = h["activated_at"].as_str().unwrap_or_default().to_string();
    assert!(first_at.ends_with('Z'), "{h}");
    // The active version's bytes again: nothing created or switched.
    let (s, again) = put_handler(&r, "noop", plugin("noop")).await;
    assert_eq!((s, &again["version"]), (200, &json!(1)), "{again}");
    assert_eq!(listed().await["activated_at"], first_at.as_str());
    let mut bytes = plugin("noop");
    bytes.extend_from_slice(&[0, 9, 4, b'n', b'o', b't', b'e', 1, 2, 3, 4]);
    let (s, v2) = put_handler(&r, "noop", bytes).await;
    assert_eq!((s, &v2["version"]), (201, &json!(2)), "{v2}");
    // An older version's bytes re-activate it: still nothing created, but a switch.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (s, back) = put_handler(&r, "noop", plugin("noop")).await;
    assert_eq!((s, &back["version"]), (200, &json!(1)), "{back}");
    let h = listed().await;
    assert_eq!(h["active"]["version"], 1, "{h}");
    assert!(
        h["activated_at"].as_str().unwrap_or_default() > first_at.as_str(),
        "{h}"
    );
    for malformed in ["abc", "abcdef1", "v"] {
        let (s, b) = post_json(
            &r,
            "/v1/handlers/noop/rollback",
            json!({ "version": malformed }),
        )
        .await;
        assert_eq!(
            (s, &b["errors"][0]["pointer"]),
            (400, &json!("/version")),
            "{b}"
        );
        let msg = b["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("at least 8 hex digits"), "{malformed}: {b}");
    }
    let (s, b) = post_json(&r, "/v1/handlers/noop/rollback", json!({"version": "9"})).await;
    assert_eq!(s, 404, "{b}");
    let (s, b) = post_json(&r, "/v1/handlers/noop/rollback", json!({"version": "v2"})).await;
    assert_eq!(s, 200, "{b}");
    let h = listed().await;
    assert_eq!(
        (&h["active"]["version"], &h["activated_by"]),
        (&json!(2), &json!("local")),
        "{h}"
    );
    // A name that is not one: the same answer, encoded or not.
    for name in ["UPPER", "%41"] {
        let (s, b) = put_handler(&r, name, plugin("noop")).await;
        assert_eq!(
            (s, &b["error"], &b["errors"][0]["pointer"]),
            (400, &json!("invalid handler name"), &json!("/name")),
            "{name}: {b}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_events_re_enter_the_pipeline_from_rust_and_python_handlers() {
    let sink = Receiver::ok().await;
    let rules = format!(
        "{}  - name: enriched-out\n    pattern:\n      type: [{{ suffix: .enriched }}]\n    targets:\n      - webhook: {}\n        id: out\n",
        rules_yaml(
            FAST,
            &[
                (
                    "to-rust",
                    "order.created",
                    &["handler: enrich\n        policy: fast".to_string()]
                ),
                (
                    "to-py",
                    "order.placed",
                    &["handler: enrich_py\n        policy: fast".to_string()]
                )
            ]
        ),
        sink.url()
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    assert_eq!(
        put_handler(&r, "enrich_py", plugin("enrich_py")).await.0,
        201
    );
    assert_eq!(
        post_event(
            &r,
            &event("o1", "order.created", json!({"total": 5, "sku": "a"}))
        )
        .await
        .0,
        202
    );
    assert_eq!(
        post_event(
            &r,
            &event("o2", "order.placed", json!({"total": 5, "sku": "a"}))
        )
        .await
        .0,
        202
    );
    assert!(
        sink.wait_for(Duration::from_secs(30), |s| s.len() >= 2)
            .await,
        "no enriched events: {}",
        sink.count()
    );
    let got = sink.received();
    let rust = got
        .iter()
        .find(|g| g.body["type"] == "order.created.enriched")
        .expect("rust emission");
    let py = got
        .iter()
        .find(|g| g.body["type"] == "order.placed.enriched")
        .expect("python emission");
    assert_eq!(rust.body["source"], "handler://enrich");
    assert_eq!(py.body["source"], "handler://enrich_py");
    assert_eq!(rust.body["hops"], 1);
    assert_eq!(rust.body["data"]["enriched"], true);
    // The WIT interface is not Rust-only: same data from both languages.
    assert_eq!(rust.body["data"], py.body["data"]);
    // Restart: the compiled code comes from the on-disk cache, not a recompilation.
    r.kill9();
    r.restart();
    let (_, list) = get_json(&r, "/v1/handlers").await;
    assert_eq!(
        list["compilations"], 0,
        "handlers were recompiled after restart: {list}"
    );
    assert_eq!(
        post_event(&r, &event("o3", "order.created", json!({"total": 1})))
            .await
            .0,
        202
    );
    assert!(
        sink.wait_for(Duration::from_secs(30), |s| s.len() >= 3)
            .await
    );
}

/// The stored compiled code of a handler damaged while the router is stopped (one flipped bit
/// used to crash the whole router at the handler's first delivery, or at every start) is
/// caught at the next start: removed with a warning, the component compiled again, and the
/// handler delivers. The compilation cache of an earlier router version (wasmtime's own,
/// unchecked) is removed at that start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_compiled_code_is_compiled_again_at_the_next_start() {
    let sink = Receiver::ok().await;
    let rules = format!(
        "{}  - name: enriched-out\n    pattern:\n      type: [{{ suffix: .enriched }}]\n    targets:\n      - webhook: {}\n        id: out\n",
        rules_yaml(
            FAST,
            &[(
                "to-rust",
                "order.created",
                &["handler: enrich\n        policy: fast".to_string()]
            )]
        ),
        sink.url()
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    let enrich = r.data_dir().join("handlers/registry/enrich");
    let compiled: Vec<PathBuf> = std::fs::read_dir(&enrich)
        .expect("enrich's directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    assert_eq!(compiled.len(), 1, "enrich's compiled code: {compiled:?}");
    r.kill9();
    // A bit flipped in the middle of the machine code.
    let mut bytes = std::fs::read(&compiled[0]).expect("compiled code");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&compiled[0], &bytes).expect("write");
    // What an earlier router version left.
    let legacy = r
        .data_dir()
        .join("handlers/compiled/modules/wasmtime-48.0.8");
    std::fs::create_dir_all(&legacy).expect("mkdir");
    std::fs::write(legacy.join("key"), b"unchecked").expect("write");
    r.restart();
    let log = r.log_text();
    assert!(
        log.contains("stored compiled code of a handler version failed its check; removed it and compiling the component again handler=\"enrich\"")
            && log.contains("fails its check: its SHA-256 does not match its contents"),
        "{log}"
    );
    assert!(
        log.contains("removed wasmtime's unchecked compilation cache of an earlier router version"),
        "{log}"
    );
    assert!(!r.data_dir().join("handlers/compiled").exists());
    // Compiled in the background, after the router started listening.
    let list = eventually(Duration::from_secs(120), || async {
        let (_, list) = get_json(&r, "/v1/handlers").await;
        (list["handlers"][0]["state"] == "loaded").then_some(list)
    })
    .await
    .expect("enrich compiled again");
    assert_eq!(list["compilations"], 1, "{list}");
    assert_eq!(
        post_event(&r, &event("d1", "order.created", json!({"total": 1})))
            .await
            .0,
        202
    );
    assert!(
        sink.wait_for(Duration::from_secs(30), |s| s.len() == 1)
            .await,
        "enrich did not deliver after the restart"
    );
    assert_eq!(sink.received()[0].body["data"]["enriched"], true);
    assert!(
        r.wait_exit(Duration::from_millis(200)).is_none(),
        "the router exited"
    );
    // Stored again, checked: the next start loads it.
    r.restart();
    let (_, list) = get_json(&r, "/v1/handlers").await;
    assert_eq!(list["compilations"], 0, "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_failures_follow_the_delivery_policies() {
    let r = RouterProc::start(
        &[(
            "r.yaml",
            &rules_yaml(
                FAST,
                &[
                    (
                        "to-strict",
                        "strict",
                        &["handler: strict\n        id: strict\n        policy: fast".to_string()],
                    ),
                    (
                        "to-flaky",
                        "flaky",
                        &["handler: flaky\n        id: flaky\n        policy: fast".to_string()],
                    ),
                    (
                        "to-invoice",
                        "order.paid",
                        &[
                            "handler: invoice\n        id: invoice\n        policy: fast"
                                .to_string(),
                        ],
                    ),
                ],
            ),
        )],
        &[],
    );
    for name in ["strict", "flaky", "invoice"] {
        assert_eq!(put_handler(&r, name, plugin(name)).await.0, 201);
    }
    post_event(&r, &event("s1", "strict", json!({"valid": false}))).await;
    post_event(&r, &event("f1", "flaky", json!({"fail_times": 2}))).await;
    // Two events of the same order: the invoice is recorded once.
    post_event(&r, &event("i1", "order.paid", json!({"order_id": "A-1"}))).await;
    post_event(&r, &event("i2", "order.paid", json!({"order_id": "A-1"}))).await;
    let dlq = eventually(Duration::from_secs(20), || async {
        let (_, l) = get_json(&r, "/v1/dlq?target=strict").await;
        (l["entries"].as_array().map(Vec::len) == Some(1)).then_some(l)
    })
    .await
    .expect("strict failure dead-lettered");
    assert_eq!(dlq["entries"][0]["reason"], "permanent_error");
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "f1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("flaky delivered after its retries");
    assert_eq!(f["targets"][0]["attempt_count"], 3, "{f}");
    assert!(
        f["targets"][0]["attempts"][0]["error"]
            .as_str()
            .unwrap_or("")
            .contains("retry")
    );
    // The handlers' own `fail` and `retry` answers are in their logs, with the event id and
    // attempt: a team with only `handlers:` scope sees why its deliveries were dead-lettered.
    let line = |lines: &[Value], prefix: &str| {
        lines
            .iter()
            .find(|l| l["message"].as_str().is_some_and(|m| m.starts_with(prefix)))
            .cloned()
    };
    let failed = line(&logs(&r, "strict").await, "failed: ").expect("strict's failure logged");
    assert_eq!(
        (&failed["level"], &failed["event_id"], &failed["attempt"]),
        (&json!("error"), &json!("s1"), &json!(1)),
        "{failed}"
    );
    let retried = logs(&r, "flaky")
        .await
        .into_iter()
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("retry requested (after 100ms): flaky: attempt"))
        })
        .collect::<Vec<_>>();
    let mut attempts: Vec<u64> = retried
        .iter()
        .filter_map(|l| l["attempt"].as_u64())
        .collect();
    attempts.sort_unstable();
    assert_eq!(attempts, [1, 2], "{retried:?}");
    assert!(
        retried
            .iter()
            .all(|l| l["level"] == "warn" && l["event_id"] == "f1"),
        "{retried:?}"
    );
    let lines = eventually(Duration::from_secs(20), || async {
        let l = logs(&r, "invoice").await;
        (l.len() >= 2).then_some(l)
    })
    .await
    .expect("invoice logs");
    let msgs: Vec<String> = lines
        .iter()
        .map(|l| l["message"].as_str().unwrap_or("").to_string())
        .collect();
    // The record is written once: the second delivery sees it. (If both ran at the same time,
    // both logged "recorded", but the second commit's compare-and-set failed, nothing of it was
    // written, and its re-run found the record.)
    assert!(
        msgs.iter().any(|m| m.contains("already recorded")),
        "{msgs:?}"
    );
    let recorded = msgs
        .iter()
        .filter(|m| m.starts_with("recorded invoice:A-1"))
        .count();
    if recorded == 2 {
        // The losing commit's conflict spends no attempt (it leaves no attempt record): it
        // is counted, and both deliveries end delivered.
        let m = metrics_text(&r).await;
        assert!(
            counter(
                &m,
                "router_deliveries_total{target=\"invoice\",result=\"conflict\"}"
            ) >= 1,
            "two records without a conflict: {}",
            metric_lines(&m, "deliveries")
        );
        for id in ["i1", "i2"] {
            let f = eventually(Duration::from_secs(20), || async {
                let f = fate(&r, id).await;
                (f["targets"][0]["state"] == "delivered").then_some(f)
            })
            .await;
            assert!(f.is_some(), "{id} delivered");
        }
    } else {
        assert_eq!(recorded, 1, "{msgs:?}");
    }
    assert!(lines[0]["event_id"].is_string() && lines[0]["attempt"].is_number());
}

/// A type a handler does not accept (its descriptor) is dead-lettered at once as
/// `not_accepted` (not `unknown_version`, the contracts' reason), and a redrive gives it back to that handler alone: the other targets of
/// the event, which had it already, do not get it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_the_handler_does_not_accept_is_redriven_to_that_handler_alone() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        FAST,
        &[(
            "refunds",
            "order.refunded",
            &[
                "handler: invoice\n        id: invoice\n        policy: fast".to_string(),
                format!("webhook: {}\n        id: books", rcv.url()),
            ],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    post_event(
        &r,
        &event("rf1", "order.refunded", json!({"order_id": "R"})),
    )
    .await;
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "rf1").await;
        let state = |t: &str| {
            f["targets"]
                .as_array()
                .and_then(|ts| ts.iter().find(|x| x["target"] == t))
                .map(|x| x["state"].clone())
        };
        (state("invoice") == Some(json!("dlq")) && state("books") == Some(json!("delivered")))
            .then_some(f)
    })
    .await
    .expect("invoice dead-letters it, books gets it");
    let dead = &f["dlq"][0];
    assert_eq!(dead["reason"], "not_accepted", "{f}");
    let inv = f["targets"]
        .as_array()
        .and_then(|ts| ts.iter().find(|x| x["target"] == "invoice"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        inv["attempts"].as_array().map(Vec::len),
        Some(1),
        "no retries: {f}"
    );
    assert!(
        inv["attempts"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("does not accept order.refunded")),
        "{f}"
    );
    let (s, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "invoice"}}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{id}"),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(done["moved"], 1, "{done}");
    // Back to invoice, which still does not accept it: in the DLQ again after one more attempt
    // (a fresh count of attempts; the DLQ entry lists both).
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "rf1").await;
        let inv = f["targets"]
            .as_array()
            .and_then(|ts| ts.iter().find(|x| x["target"] == "invoice"))
            .cloned()
            .unwrap_or_default();
        let again = inv["redrive_count"] == 1 && inv["state"] == "dlq";
        let listed = f["dlq"].as_array().map(Vec::len) == Some(1)
            && f["dlq"][0]["attempts"].as_array().map(Vec::len) == Some(2);
        (again && listed).then_some(f)
    })
    .await;
    assert!(f.is_some(), "{}", fate(&r, "rf1").await);
    // books got it once: the redrive did not route the event again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rcv.count(), 1, "{:?}", rcv.received());
}

/// Each hostile mode costs its invocation only: classified, retried under the policy, and a
/// healthy handler's deliveries continue meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_handlers_are_contained() {
    let sink = Receiver::ok().await;
    let policy = "  hostile:\n    timeout: 10s\n    retry: { max_attempts: 2, base_delay: 50ms, max_delay: 100ms }";
    let rules = format!(
        "{}  - name: out\n    pattern:\n      type: [{{ suffix: .enriched }}]\n    targets:\n      - webhook: {}\n",
        rules_yaml(
            policy,
            &[
                (
                    "to-hostile",
                    "hostile",
                    &[
                        "handler: hostile\n        id: hostile\n        policy: hostile"
                            .to_string()
                    ]
                ),
                (
                    "to-enrich",
                    "healthy",
                    &["handler: enrich\n        id: enrich".to_string()]
                ),
            ],
        ),
        sink.url()
    );
    // The memory bomb must reach its cap before the timeout: at 1 s, on two cores loaded by
    // other work, it timed out first (`handler_timeout` instead of `handler_oom`).
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_HANDLERS__TIMEOUT", "4s")],
    );
    assert_eq!(put_handler(&r, "hostile", plugin("hostile")).await.0, 201);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    let modes = ["loop", "oom", "stack", "panic", "output", "sleep", "log"];
    for m in modes {
        post_event(&r, &event(&format!("h-{m}"), "hostile", json!({"mode": m}))).await;
    }
    let batch: Vec<_> = (0..50)
        .map(|i| event(&format!("ok{i}"), "healthy", json!({"i": i})))
        .collect();
    post_raw(
        &r,
        "application/cloudevents-batch+json",
        serde_json::to_vec(&batch).expect("json"),
    )
    .await;
    assert!(
        sink.wait_for(Duration::from_secs(30), |s| s.len() >= 50)
            .await,
        "healthy handler starved: {}",
        sink.count()
    );
    // Each limit's error names the key that sets it (what the team asks the operator to
    // raise), after the class prefix that metrics and alerts match.
    let expect = [
        ("loop", "handler_timeout", Some("(handlers.timeout)")),
        ("oom", "handler_oom", Some("(handlers.memory_bytes)")),
        ("stack", "handler_trap", None),
        ("panic", "handler_trap", None),
        // A breached limit is permanent: the same event breaches it again.
        ("output", "handler_limit", Some("(handlers.max_emitted)")),
        // Waiting on a clock traps (it would block where the timeout cannot reach).
        ("sleep", "handler_trap", None),
    ];
    for (m, class, key) in expect {
        let f = eventually(Duration::from_secs(30), || async {
            let f = fate(&r, &format!("h-{m}")).await;
            (f["targets"][0]["state"] == "dlq").then_some(f)
        })
        .await
        .unwrap_or_else(|| panic!("hostile {m} never reached the DLQ"));
        let err = f["targets"][0]["attempts"][0]["error"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(err.starts_with(class), "{m}: {err}");
        if let Some(key) = key {
            assert!(
                err.lines().next().is_some_and(|l| l.contains(key)),
                "{m}: {err}"
            );
        }
        let reason = if m == "output" {
            "permanent_error"
        } else {
            "retries_exhausted"
        };
        assert_eq!(f["dlq"][0]["reason"], reason, "{m}");
    }
    // Each outcome is counted by kind.
    let m = metrics_text(&r).await;
    for outcome in ["timeout", "oom", "trap", "limit"] {
        assert!(
            counter(
                &m,
                &format!(
                    "router_handler_invocations_total{{handler=\"hostile\",outcome=\"{outcome}\"}}"
                )
            ) >= 1,
            "{outcome}: {}",
            metric_lines(&m, "handler_invocations")
        );
    }
    // Traps keep their message (the guest's panic text), in the attempt and in the logs.
    let f = fate(&r, "h-panic").await;
    assert!(
        f["targets"][0]["attempts"][0]["error"]
            .as_str()
            .unwrap_or("")
            .contains("panicked on purpose"),
        "{f}"
    );
    let lines = logs(&r, "hostile").await;
    assert!(
        !lines.is_empty() && lines.len() <= 200,
        "logs are capped: {}",
        lines.len()
    );
    // Filters: one event's lines, and only errors (the classified failures are logged as such).
    let (_, panic_lines) =
        get_json(&r, "/v1/handlers/hostile/logs?event_id=h-panic&limit=5000").await;
    let panic_lines = panic_lines["lines"].as_array().cloned().unwrap_or_default();
    assert!(!panic_lines.is_empty(), "the panic's lines are kept");
    assert!(
        panic_lines
            .iter()
            .all(|l| l["event_id"] == "h-panic" && l["source"] == "/test"),
        "{panic_lines:?}"
    );
    // An event is (source, id): the same id from another source is another event.
    let (_, other) = get_json(
        &r,
        "/v1/handlers/hostile/logs?event_id=h-panic&source=/elsewhere",
    )
    .await;
    assert_eq!(other["lines"], json!([]), "{other}");
    let (_, errors) = get_json(&r, "/v1/handlers/hostile/logs?level=error&limit=5000").await;
    let errors = errors["lines"].as_array().cloned().unwrap_or_default();
    assert!(
        errors.iter().any(|l| l["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("handler_timeout"))),
        "{errors:?}"
    );
    assert!(errors.iter().all(|l| l["level"] == "error"), "{errors:?}");
    let (status, _) = get_json(&r, "/v1/handlers/hostile/logs?level=loud").await;
    assert_eq!(status, 400, "an unknown level is refused");
    // The log flood completes (logs capped; on a loaded machine perhaps at a later attempt)
    // and the router is still up.
    let f = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "h-log").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await;
    assert!(f.is_some(), "{}", fate(&r, "h-log").await);
    assert_eq!(get_json(&r, "/healthz").await.0, 200);
}

/// A handler target's policy timeout bounds its invocations below `handlers.timeout` (5 s by
/// default here): a looping handler under `timeout: 400ms` is stopped near 400 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_timeout_bounds_a_handler_invocation() {
    let policy = "  quick:\n    timeout: 400ms\n    retry: { max_attempts: 1 }";
    let rules = rules_yaml(
        policy,
        &[(
            "to-hostile",
            "hostile",
            &["handler: hostile\n        id: hostile\n        policy: quick".to_string()],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "hostile", plugin("hostile")).await.0, 201);
    post_event(&r, &event("q-loop", "hostile", json!({"mode": "loop"}))).await;
    let f = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "q-loop").await;
        (f["targets"][0]["state"] == "dlq").then_some(f)
    })
    .await
    .expect("the looping invocation reaches the DLQ");
    let attempt = &f["targets"][0]["attempts"][0];
    let error = attempt["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("handler_timeout: no answer within"),
        "{f}"
    );
    // Epoch interruption ticks and a loaded machine add to 400 ms, but nowhere near 5 s.
    let latency = attempt["latency_ms"].as_u64().unwrap_or(u64::MAX);
    assert!(latency < 3_000, "{latency} ms: {f}");
}

/// Each captured log line keeps the time the handler logged it: a line before a slow step
/// reads as before it. Every line of an invocation was stamped with the time it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_log_lines_keep_the_time_they_were_logged() {
    let rules = rules_yaml(
        FAST,
        &[(
            "to-hostile",
            "hostile",
            &["handler: hostile\n        id: hostile\n        policy: fast".to_string()],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "hostile", plugin("hostile")).await.0, 201);
    let ev = event("spin-1", "hostile", json!({"mode": "spin", "ms": 1500}));
    assert_eq!(post_event(&r, &ev).await.0, 202);
    let at = |lines: &[Value], message: &str| {
        lines
            .iter()
            .find(|l| l["message"] == message)
            .and_then(|l| l["at"].as_str())
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
    };
    let (start, end) = eventually(Duration::from_secs(30), || async {
        let lines = logs(&r, "hostile").await;
        at(&lines, "spin: start").zip(at(&lines, "spin: end"))
    })
    .await
    .expect("both lines logged");
    // The handler was busy 1.5 s between them (a loaded machine only stretches that).
    let apart = (end - start).num_milliseconds();
    assert!(apart >= 1_400, "{start} .. {end}: {apart} ms apart");
}

/// A handler's logs are read back to the oldest line kept, a page at a time (`before`), by
/// attempt; an empty `event_id` is a 400 rather than a quiet empty page; the lines the
/// per-invocation cap dropped are counted by a metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_logs_page_back_to_the_oldest_line_and_count_what_the_cap_dropped() {
    let rules = rules_yaml(
        FAST,
        &[(
            "to-hostile",
            "hostile",
            &["handler: hostile\n        id: hostile\n        policy: fast".to_string()],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "hostile", plugin("hostile")).await.0, 201);
    let ev = event("flood-1", "hostile", json!({"mode": "log"}));
    assert_eq!(post_event(&r, &ev).await.0, 202);
    eventually(Duration::from_secs(30), || async {
        (fate(&r, "flood-1").await["targets"][0]["state"] == "delivered").then_some(())
    })
    .await
    .expect("the flood is handled");
    // Page back 100 lines at a time: every line kept, once, newest page first.
    let mut seen: Vec<u64> = Vec::new();
    let mut path = "/v1/handlers/hostile/logs?limit=100".to_string();
    let mut pages = 0;
    loop {
        let (s, page) = get_json(&r, &path).await;
        assert_eq!(s, 200, "{page}");
        let seqs: Vec<u64> = page["lines"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["seq"].as_u64())
            .collect();
        seen.splice(0..0, seqs);
        pages += 1;
        match page["next_before"].as_u64() {
            Some(before) => path = format!("/v1/handlers/hostile/logs?limit=100&before={before}"),
            None => break,
        }
    }
    let total = seen.len() as u64;
    assert!(pages > 1 && total > 100, "{pages} pages, {total} lines");
    assert_eq!(seen, (1..=total).collect::<Vec<_>>());
    // The cap's note is the last line; the metric counts what it dropped.
    let (_, last) = get_json(&r, "/v1/handlers/hostile/logs?limit=1").await;
    let note = last["lines"][0]["message"].as_str().unwrap_or_default();
    let dropped: u64 = note
        .split(" more lines")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {note:?}"));
    let metrics = metrics_text(&r).await;
    assert_eq!(
        counter(
            &metrics,
            "router_handler_log_lines_dropped_total{handler=\"hostile\"}"
        ),
        dropped,
        "{}",
        metric_lines(&metrics, "log_lines_dropped")
    );
    // By attempt: all of them were the first's.
    let (_, first) = get_json(&r, "/v1/handlers/hostile/logs?attempt=1&limit=5000").await;
    assert_eq!(
        first["lines"].as_array().map(Vec::len),
        Some(total as usize)
    );
    let (_, second) = get_json(&r, "/v1/handlers/hostile/logs?attempt=2").await;
    assert_eq!(second["lines"], json!([]), "{second}");
    let (s, b) = get_json(&r, "/v1/handlers/hostile/logs?event_id=").await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (400, &json!("/event_id")),
        "{b}"
    );
}

/// `order.created` → handler `enrich`; its `order.created.enriched` emissions → `rcv`.
fn enrich_then_webhook(rcv: &Receiver) -> String {
    format!(
        "rules:\n  - name: orders\n    pattern: {{ type: [order.created] }}\n    targets:\n      - handler: enrich\n  - name: enriched\n    pattern: {{ type: [order.created.enriched] }}\n    targets:\n      - webhook: {}\n",
        rcv.url()
    )
}

/// A replay re-runs a handler on its archived input: what the handler emits then carries the
/// replay's marker, as the replayed delivery did, under new ids (derived from the replay's own
/// idempotency key), so a receiver downstream can tell it from new business.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_a_handler_emits_during_a_replay_carry_its_marker() {
    let rcv = Receiver::ok().await;
    let r = RouterProc::start(&[("r.yaml", &enrich_then_webhook(&rcv))], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let ev = event("o1", "order.created", json!({"total": 5, "sku": "a"}));
    assert_eq!(post_event(&r, &ev).await.0, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 1)
            .await
    );
    let first = rcv.received()[0].body.clone();
    assert!(first.get("replay").is_none(), "{first}");
    // The parent's fate leads to what its handler emitted, and that to its own fate.
    let parent = fate(&r, "o1").await;
    let emitted = &parent["targets"][0]["emitted"];
    assert_eq!(
        emitted,
        &json!([{"source": "handler://enrich", "id": first["id"]}]),
        "{parent}"
    );
    let (s, child) = get_json(
        &r,
        &format!(
            "/v1/events/{}?source=handler://enrich",
            first["id"].as_str().unwrap_or_default()
        ),
    )
    .await;
    assert_eq!(s, 200, "{child}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let to = chrono::Utc::now();
    let (s, job) = post_json(
        &r,
        "/v1/replay",
        json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "filter": {"type": ["order.created"]}, "rate_per_sec": 100}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    assert_eq!(done["moved"], 1, "{done}");
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 2)
            .await,
        "the replayed delivery's emission reaches the webhook"
    );
    let again = rcv.received()[1].body.clone();
    assert_eq!(again["type"], "order.created.enriched", "{again}");
    assert_eq!(again["replay"], id.as_str(), "{again}");
    assert_ne!(again["id"], first["id"], "{again}");
}

/// A replay of a window without a filter holds the parent and the handler's archived
/// emission: it replays the parent (the handler runs again and emits anew) and skips the
/// archived emission, so the receiver gets one replayed copy of the derived event, not two.
/// `include_emitted` replays the archived emission too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_delivers_each_handler_emission_once() {
    let rcv = Receiver::ok().await;
    let r = RouterProc::start(&[("r.yaml", &enrich_then_webhook(&rcv))], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    let from = chrono::Utc::now() - chrono::Duration::seconds(1);
    let ev = event("o-rp", "order.created", json!({"total": 6, "sku": "a"}));
    assert_eq!(post_event(&r, &ev).await.0, 202);
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 1)
            .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let to = chrono::Utc::now();
    let replay = |include: bool| json!({"from": from.to_rfc3339(), "to": to.to_rfc3339(), "rate_per_sec": 100, "include_emitted": include});
    let (s, job) = post_json(&r, "/v1/replay", replay(false)).await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    assert_eq!(
        (
            &done["total"],
            &done["moved"],
            &done["skipped"],
            &done["skipped_emitted"]
        ),
        (&json!(2), &json!(1), &json!(1), &json!(1)),
        "{done}"
    );
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 2)
            .await
    );
    // Time for a second copy, had the archived emission been replayed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = rcv.received();
    assert_eq!(
        got.len(),
        2,
        "{:?}",
        got.iter().map(|g| &g.body).collect::<Vec<_>>()
    );
    assert_eq!(got[1].body["replay"], id.as_str(), "{}", got[1].body);
    // Asked for, the archived emission is replayed as well: two more copies.
    let (s, job) = post_json(&r, "/v1/replay", replay(true)).await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(&r, &format!("/v1/replay/{id}"), Duration::from_secs(20)).await;
    assert_eq!(
        (&done["moved"], &done["skipped_emitted"]),
        (&json!(2), &json!(0)),
        "{done}"
    );
    assert!(
        rcv.wait_for(Duration::from_secs(15), |s| s.len() == 4)
            .await,
        "{:?}",
        rcv.received().iter().map(|g| &g.body).collect::<Vec<_>>()
    );
}

/// A handler belongs to its first uploader's team: another team's token whose `handlers:` glob
/// covers the name still cannot upload over it, roll it back or delete it; a rotated token of
/// the same team and an administrator can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_team_can_never_change_a_teams_handler() {
    let tokens = [
        ("ops", None, "admin"),
        ("billing-ci", Some("billing"), "handlers:*"),
        ("billing-ci-2027", Some("billing"), "handlers:*"),
        ("crm-ci", None, "handlers:*"),
    ];
    let auth = tokens_config(&tokens);
    let r = RouterProc::start_full(&[], &[], &[], Some(&auth));
    let with_bytes = |tag: u8| {
        let mut b = plugin("enrich");
        b.extend_from_slice(&[0, 6, 4, b't', b'e', b'a', b'm', tag]);
        b
    };
    // The same handler name, uploaded with `token` (the bytes varied by `tag`).
    let upload_as = |token: &'static str, tag: u8| {
        send_as(
            &r,
            "PUT",
            "/v1/handlers/enrich",
            token,
            Some(("application/wasm", with_bytes(tag))),
        )
    };
    let (s, b) = upload_as("billing-ci", 1).await;
    assert_eq!(s, 201, "{b}");
    // The CRM team's glob covers the name; the handler is still not theirs.
    let (s, b) = upload_as("crm-ci", 2).await;
    assert_eq!(s, 403, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("billing"),
        "{b}"
    );
    let rollback = serde_json::to_vec(&json!({"version": "1"})).expect("json");
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/handlers/enrich/rollback",
        "crm-ci",
        Some(("application/json", rollback.clone())),
    )
    .await;
    assert_eq!(s, 403, "{b}");
    let (s, b) = send_as(&r, "DELETE", "/v1/handlers/enrich", "crm-ci", None).await;
    assert_eq!(s, 403, "{b}");
    let (s, info) = send_as(&r, "GET", "/v1/handlers/enrich", "crm-ci", None).await;
    assert_eq!(s, 200, "{info}");
    assert_eq!(info["owner"], "billing", "{info}");
    assert_eq!(info["versions"].as_array().map(Vec::len), Some(1), "{info}");
    // A rotated token of the team, then an administrator.
    let (s, b) = upload_as("billing-ci-2027", 3).await;
    assert_eq!((s, b["version"].as_u64()), (201, Some(2)), "{b}");
    assert_eq!(b["team"], "billing", "{b}");
    let (s, b) = send_as(
        &r,
        "POST",
        "/v1/handlers/enrich/rollback",
        "ops",
        Some(("application/json", rollback)),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = send_as(&r, "DELETE", "/v1/handlers/enrich", "billing-ci-2027", None).await;
    assert_eq!((s, &b["name_kept_by"]), (200, &json!("billing")), "{b}");
    // Deleted, its name still the team's: its queued deliveries go to no other team's code.
    let (s, _) = send_as(&r, "GET", "/v1/handlers/enrich", "crm-ci", None).await;
    assert_eq!(s, 404);
    let (s, b) = upload_as("crm-ci", 4).await;
    assert_eq!(s, 403, "{b}");
    let (s, b) = send_as(
        &r,
        "DELETE",
        "/v1/handlers/enrich?release=true",
        "crm-ci",
        None,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    let (s, b) = send_as(&r, "DELETE", "/v1/handlers/enrich", "billing-ci", None).await;
    assert_eq!(s, 404, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("stays with team \"billing\""),
        "{b}"
    );
    // Its team releases the name: free for whoever uploads next.
    let (s, b) = send_as(
        &r,
        "DELETE",
        "/v1/handlers/enrich?release=true",
        "billing-ci",
        None,
    )
    .await;
    assert_eq!((s, &b["released"]), (200, &json!("enrich")), "{b}");
    let (s, b) = upload_as("crm-ci", 4).await;
    assert_eq!(s, 201, "{b}");
    let (_, info) = send_as(&r, "GET", "/v1/handlers/enrich", "crm-ci", None).await;
    assert_eq!(info["owner"], "crm-ci", "{info}");
    assert_eq!(info["versions"].as_array().map(Vec::len), Some(1), "{info}");
    // An administrator uploads a handler for a team: it is that team's from the start, and
    // no other team claims it by uploading next. A team token cannot upload for a team.
    let put = |token: &'static str, path: &'static str, tag: u8| {
        send_as(
            &r,
            "PUT",
            path,
            token,
            Some(("application/wasm", with_bytes(tag))),
        )
    };
    // (Here: an administrator hands the handler over to billing.) No other query is taken.
    let (s, b) = put("ops", "/v1/handlers/enrich?team=billing", 5).await;
    assert_eq!(s, 201, "{b}");
    let (_, info) = send_as(&r, "GET", "/v1/handlers/enrich", "ops", None).await;
    assert_eq!(info["owner"], "billing", "{info}");
    let (s, b) = put("crm-ci", "/v1/handlers/enrich", 6).await;
    assert_eq!(s, 403, "{b}");
    let (s, b) = put("crm-ci", "/v1/handlers/enrich?team=crm-ci", 7).await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (403, &json!("/team")),
        "{b}"
    );
    let (s, b) = put("ops", "/v1/handlers/enrich?dry_run=1", 8).await;
    assert_eq!(
        (s, &b["errors"][0]["pointer"]),
        (400, &json!("/dry_run")),
        "{b}"
    );
}

/// A released name takes nothing of the last team with it: the handler's key-value entries and
/// logs stay while the team keeps the name after a delete, and are removed when it releases it,
/// so the next team to claim the name cannot read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_handler_name_leaves_no_key_value_entries_or_logs() {
    let tokens = [
        ("ops", None, "admin"),
        ("billing-ci", Some("billing"), "handlers:*"),
        ("crm-ci", Some("crm"), "handlers:*"),
    ];
    let auth = tokens_config(&tokens);
    let rules = "rules:\n  - name: paid\n    pattern: { type: [order.paid] }\n    targets:\n      - handler: invoice\n";
    let r = RouterProc::start_full(&[("r.yaml", rules)], &[], &[], Some(&auth));
    let invoice = || Some(("application/wasm", plugin("invoice")));
    let (s, b) = send_as(&r, "PUT", "/v1/handlers/invoice", "billing-ci", invoice()).await;
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
    let kv_keys = |status: Value| status["handler_kv"]["namespaces"]["invoice"]["keys"].as_u64();
    let recorded = eventually(Duration::from_secs(30), || async {
        let (_, status) = send_as(&r, "GET", "/v1/status", "ops", None).await;
        (kv_keys(status) == Some(1)).then_some(())
    })
    .await;
    assert!(
        recorded.is_some(),
        "the handler's key-value entry was not written"
    );
    let lines = |b: &Value| b["lines"].as_array().map_or(0, Vec::len);
    let (_, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "billing-ci", None).await;
    assert!(lines(&l) > 0, "{l}");

    // Deleted, the name kept: entries and logs stay for the team's next upload.
    let (s, b) = send_as(&r, "DELETE", "/v1/handlers/invoice", "billing-ci", None).await;
    assert_eq!(s, 200, "{b}");
    let (_, status) = send_as(&r, "GET", "/v1/status", "ops", None).await;
    assert_eq!(kv_keys(status.clone()), Some(1), "{}", status["handler_kv"]);
    let (_, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "billing-ci", None).await;
    assert!(lines(&l) > 0, "{l}");

    // Released: both gone before another team can claim the name.
    let (s, b) = send_as(
        &r,
        "DELETE",
        "/v1/handlers/invoice?release=true",
        "billing-ci",
        None,
    )
    .await;
    assert_eq!((s, &b["released"]), (200, &json!("invoice")), "{b}");
    let (_, status) = send_as(&r, "GET", "/v1/status", "ops", None).await;
    // Not listed at all, on either store: the JetStream store kept the namespace's usage
    // records at zero keys, and listed it for good.
    assert!(
        status["handler_kv"]["namespaces"].get("invoice").is_none(),
        "{}",
        status["handler_kv"]
    );
    // Its COMPLETED record too: the next team's handler would get the stored result of a
    // key the old one completed (an event sent again past the dedup window) and never run.
    assert_eq!(
        status["records"]["completed"]["count"], 0,
        "{}",
        status["records"]
    );
    let (s, b) = send_as(&r, "PUT", "/v1/handlers/invoice", "crm-ci", invoice()).await;
    assert_eq!(s, 201, "{b}");
    let (s, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "crm-ci", None).await;
    assert_eq!((s, lines(&l)), (200, 0), "{l}");
}

/// An emitted event whose target's queue is at its depth cap goes to the DLQ as
/// `target_overflow` inside the ack's commit, and is counted and announced like any other new
/// dead letter.
/// A released name takes none of the last team's queued deliveries with it: a delivery
/// queued for the deleted handler (waiting for its team's next upload) goes to the DLQ as
/// `handler_released` when the team releases the name, so the next team to claim the name
/// never runs it, and an operator can still redrive it deliberately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_handler_names_queued_deliveries_never_reach_the_next_team() {
    let tokens = [
        ("ops", None, "admin"),
        ("billing-ci", Some("billing"), "handlers:*"),
        ("crm-ci", Some("crm"), "handlers:*"),
    ];
    let auth = tokens_config(&tokens);
    let rules = "rules:\n  - name: paid\n    pattern: { type: [order.paid] }\n    targets:\n      - handler: invoice\n        id: invoicing\n";
    let r = RouterProc::start_full(&[("r.yaml", rules)], &[], &[], Some(&auth));
    let invoice = || Some(("application/wasm", plugin("invoice")));
    let (s, b) = send_as(&r, "PUT", "/v1/handlers/invoice", "billing-ci", invoice()).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = send_as(&r, "DELETE", "/v1/handlers/invoice", "billing-ci", None).await;
    assert_eq!((s, &b["name_kept_by"]), (200, &json!("billing")), "{b}");
    // Billing's order, queued while its handler is deleted: it waits for billing's upload.
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
    let fate_of = || async {
        send_as(&r, "GET", "/v1/events/paid-1?source=/test", "ops", None)
            .await
            .1
    };
    let waiting = eventually(Duration::from_secs(20), || async {
        let (_, t) = send_as(&r, "GET", "/v1/targets/invoicing", "ops", None).await;
        (t["deferred"].as_u64().unwrap_or(0) >= 1).then_some(())
    })
    .await;
    assert!(
        waiting.is_some(),
        "the delivery did not wait for the upload"
    );
    // Released: the delivery is a dead letter before another team can claim the name.
    let (s, b) = send_as(
        &r,
        "DELETE",
        "/v1/handlers/invoice?release=true",
        "billing-ci",
        None,
    )
    .await;
    assert_eq!((s, &b["released"]), (200, &json!("invoice")), "{b}");
    let f = fate_of().await;
    assert_eq!(f["targets"][0]["state"], "dlq", "{f}");
    let (_, l) = send_as(&r, "GET", "/v1/dlq?reason=handler_released", "ops", None).await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(1), "{l}");
    assert_eq!(l["entries"][0]["target"], "invoicing", "{l}");
    assert!(
        l["entries"][0]["errors"]
            .to_string()
            .contains("was released"),
        "{l}"
    );
    // CRM claims the name: its handler never sees billing's order (deliveries waiting for a
    // handler are retried every 5 s; this waits well past that).
    let (s, b) = send_as(&r, "PUT", "/v1/handlers/invoice", "crm-ci", invoice()).await;
    assert_eq!(s, 201, "{b}");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (s, l) = send_as(&r, "GET", "/v1/handlers/invoice/logs", "crm-ci", None).await;
    assert_eq!(s, 200, "{l}");
    assert_eq!(l["lines"].as_array().map(Vec::len), Some(0), "{l}");
    let f = fate_of().await;
    assert_eq!(f["targets"][0]["state"], "dlq", "{f}");
}

/// A plain delete never removes a handler's key-value entries or logs, even when no team owns
/// it (auth off, the default): `invoice` deleted and uploaded again still knows order A-1 was
/// invoiced, so a second payment event for it is a no-op, not a second invoice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_unowned_handler_keeps_its_key_value_entries_and_logs() {
    let rules = "rules:\n  - name: paid\n    pattern: { type: [order.paid] }\n    targets:\n      - handler: invoice\n";
    let r = RouterProc::start(&[("r.yaml", rules)], &[]);
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    let says = |needle: &'static str| {
        let r = &r;
        move || async move {
            logs(r, "invoice")
                .await
                .into_iter()
                .find(|l| l["message"].as_str().is_some_and(|m| m.contains(needle)))
        }
    };
    let (s, b) = post_event(&r, &event("o-1", "order.paid", json!({"order_id": "A-1"}))).await;
    assert_eq!(s, 202, "{b}");
    let first = eventually(Duration::from_secs(30), says("recorded invoice:A-1")).await;
    assert!(first.is_some(), "the first payment was not recorded");
    let resp = client()
        .delete(r.url("/v1/handlers/invoice"))
        .send()
        .await
        .expect("delete");
    assert_eq!(resp.status().as_u16(), 200);
    let b: Value = resp.json().await.expect("json");
    assert_eq!(b, json!({"deleted": "invoice", "name_kept_by": null}));
    let (s, _) = get_json(&r, "/v1/handlers/invoice").await;
    assert_eq!(s, 404);
    // Its logs stay readable while it is deleted; deleting again says what is kept.
    assert!(!logs(&r, "invoice").await.is_empty());
    let resp = client()
        .delete(r.url("/v1/handlers/invoice"))
        .send()
        .await
        .expect("delete");
    assert_eq!(resp.status().as_u16(), 404);
    let b: Value = resp.json().await.expect("json");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("key-value entries and logs are kept"),
        "{b}"
    );
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    let (s, b) = post_event(&r, &event("o-2", "order.paid", json!({"order_id": "A-1"}))).await;
    assert_eq!(s, 202, "{b}");
    let second = eventually(
        Duration::from_secs(30),
        says("invoice:A-1 already recorded"),
    )
    .await;
    assert!(second.is_some(), "{:?}", logs(&r, "invoice").await);
    assert_eq!(second.expect("checked")["event_id"], "o-2");
    assert!(
        says("recorded invoice:A-1")().await.is_some(),
        "the first upload's log lines are kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_events_past_a_queue_cap_are_counted_dead_letters() {
    let down = Receiver::status(503).await;
    let alerts = Receiver::ok().await;
    let rules = format!(
        "policies:\n  capped:\n    max_queue_depth: 2\n    retry: {{ max_attempts: 100, base_delay: 10s, max_delay: 10s }}\nrules:\n  - name: orders\n    pattern: {{ type: [order.created] }}\n    targets:\n      - handler: enrich\n  - name: enriched\n    pattern: {{ type: [order.created.enriched] }}\n    targets:\n      - webhook: {}\n        id: capped-out\n        policy: capped\n  - name: alerts\n    pattern: {{ type: [router.dlq.added] }}\n    targets:\n      - webhook: {}\n        id: pager\n",
        down.url(),
        alerts.url()
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    for i in 0..6 {
        let ev = event(&format!("cap-{i}"), "order.created", json!({"order_id": i}));
        assert_eq!(post_event(&r, &ev).await.0, 202);
    }
    // Two emitted copies fit the cap; four overflow.
    let counted = eventually(Duration::from_secs(30), || async {
        let m = metrics_text(&r).await;
        let n = counter(
            &m,
            "router_dlq_entries_total{target=\"capped-out\",reason=\"target_overflow\"}",
        );
        (n >= 4).then_some(n)
    })
    .await;
    assert_eq!(counted, Some(4), "overflowed emissions were not counted");
    let (_, l) = get_json(&r, "/v1/dlq?reason=target_overflow&target=capped-out").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(4), "{l}");
    assert!(
        alerts
            .wait_for(Duration::from_secs(20), |got| {
                got.iter()
                    .filter(|g| g.body["data"]["reason"] == "target_overflow")
                    .count()
                    == 4
            })
            .await,
        "router.dlq.added was not raised for each: {:?}",
        alerts.received()
    );
    let alert = alerts
        .received()
        .into_iter()
        .find(|g| g.body["data"]["reason"] == "target_overflow");
    let alert = alert.expect("an overflow alert");
    assert_eq!(
        alert.body["data"]["target"], "capped-out",
        "{:?}",
        alert.body
    );
    assert_eq!(
        alert.body["data"]["event"]["type"],
        "order.created.enriched"
    );
}

/// Emitted events must fall within the ingest scope of the handler's owner (the token that
/// uploaded it); others go to the DLQ as `scope_violation`, never routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emissions_outside_the_owner_scope_are_dead_lettered() {
    use sha2::Digest;
    let sha = |t: &str| hex::encode(sha2::Sha256::digest(t.as_bytes()));
    let rcv = Receiver::ok().await;
    let rules = enrich_then_webhook(&rcv);
    let authed = |token: &'static str| move |rb: reqwest::RequestBuilder| rb.bearer_auth(token);
    for (team_scope, allowed) in [("ingest:payment.*", false), ("ingest:order.*", true)] {
        let config = format!(
            "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nscopes = [\"admin\"]\n\n[[auth.tokens]]\nname = \"team\"\nsha256 = \"{}\"\nscopes = [\"handlers:enrich\", \"{team_scope}\"]\n",
            sha("ops-token"),
            sha("team-token")
        );
        let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
        let put = authed("team-token")(client().put(r.url("/v1/handlers/enrich")))
            .body(plugin("enrich"))
            .send()
            .await
            .expect("put");
        assert_eq!(put.status().as_u16(), 201, "the team uploads its handler");
        let id = format!("scope-{allowed}");
        let post = authed("ops-token")(client().post(r.url("/v1/events")))
            .header("content-type", "application/cloudevents+json")
            .json(&event(&id, "order.created", json!({"order_id": "o1"})))
            .send()
            .await
            .expect("post");
        assert_eq!(post.status().as_u16(), 202);
        if allowed {
            assert!(
                rcv.wait_for(Duration::from_secs(20), |s| s
                    .iter()
                    .any(|x| x.body["type"] == "order.created.enriched"))
                    .await,
                "within scope: the emitted event is routed"
            );
        } else {
            let entry = eventually(Duration::from_secs(20), || async {
                let resp =
                    authed("ops-token")(client().get(r.url("/v1/dlq?reason=scope_violation")))
                        .send()
                        .await
                        .ok()?;
                let v: Value = resp.json().await.ok()?;
                v["entries"].as_array()?.first().cloned()
            })
            .await
            .expect("a scope_violation DLQ entry");
            assert_eq!(entry["event"]["type"], "order.created.enriched", "{entry}");
            let msg = entry["errors"][0]["message"].as_str().unwrap_or_default();
            assert!(msg.contains("ingest:order.created.enriched"), "{msg}");
            assert_eq!(rcv.count(), 0, "out of scope: never routed");
            // A dead letter like any other: counted.
            let metrics = authed("ops-token")(client().get(r.url("/metrics")))
                .send()
                .await
                .expect("metrics")
                .text()
                .await
                .expect("metrics text");
            assert_eq!(
                counter(
                    &metrics,
                    "router_dlq_entries_total{target=\"none\",reason=\"scope_violation\"}"
                ),
                1,
                "{}",
                metric_lines(&metrics, "router_dlq_entries")
            );
        }
    }
}

/// A handler's emission dead-lettered before any target (here outside its owner's ingest
/// scope) is its team's to see: the delivery reads `delivered`, so the handler's log says
/// which emission went to the DLQ and why, and the team lists and shows the dead letter with
/// its own token (`emitted_by=`), which another team's `handlers:` glob does not open. Before,
/// the log had only the handler's own line, and the entry (target `none`) needed `read`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_team_sees_its_dead_lettered_emissions_in_its_log_and_dlq() {
    let rcv = Receiver::ok().await;
    let rules = enrich_then_webhook(&rcv);
    let config = tokens_config(&[
        ("ops", None, "admin"),
        ("team", None, "handlers:enrich"),
        ("other", None, "handlers:*"),
    ]);
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
    let (s, b) = send_as(
        &r,
        "PUT",
        "/v1/handlers/enrich",
        "team",
        Some(("application/wasm", plugin("enrich"))),
    )
    .await;
    assert_eq!(s, 201, "the team uploads its handler: {b}");
    let ev = event("dead-emit-1", "order.created", json!({"order_id": "o1"}));
    let (s, _) = send_as(
        &r,
        "POST",
        "/v1/events",
        "ops",
        Some(("application/cloudevents+json", ev.to_string().into_bytes())),
    )
    .await;
    assert_eq!(s, 202);
    // The team's token has no ingest scope at all: the emission is a scope_violation.
    let entry = eventually(Duration::from_secs(20), || async {
        let (s, v) = send_as(&r, "GET", "/v1/dlq?emitted_by=enrich", "team", None).await;
        assert_eq!(
            s, 200,
            "the handler's team lists its emissions' dead letters: {v}"
        );
        v["entries"].as_array()?.first().cloned()
    })
    .await
    .expect("the team's listing shows the dead-lettered emission");
    assert_eq!(entry["reason"], "scope_violation", "{entry}");
    assert_eq!(entry["target"], Value::Null, "{entry}");
    assert_eq!(entry["event"]["type"], "order.created.enriched", "{entry}");
    assert_eq!(entry["emitted_by"]["handler"], "enrich", "{entry}");
    assert_eq!(entry["emitted_by"]["event_id"], "dead-emit-1", "{entry}");
    assert!(
        entry["emitted_by"]["target"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{entry}"
    );
    let id = entry["id"].as_str().expect("id").to_string();
    let (s, shown) = send_as(&r, "GET", &format!("/v1/dlq/{id}"), "team", None).await;
    assert_eq!(s, 200, "the team shows it: {shown}");
    assert_eq!(shown["emitted_by"], entry["emitted_by"]);
    // The handler's log says so, on the delivery's event and attempt.
    let (s, logs) = send_as(
        &r,
        "GET",
        "/v1/handlers/enrich/logs?event_id=dead-emit-1&level=warn",
        "team",
        None,
    )
    .await;
    assert_eq!(s, 200, "{logs}");
    let emitted_id = entry["event"]["id"].as_str().expect("emitted id");
    let line = logs["lines"]
        .as_array()
        .and_then(|l| {
            l.iter().find(|l| {
                l["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("dead-lettered as scope_violation"))
            })
        })
        .unwrap_or_else(|| panic!("no warn line about the dead-lettered emission: {logs}"));
    let msg = line["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(emitted_id)
            && msg.contains("order.created.enriched")
            && msg.contains("ingest:order.created.enriched")
            && msg.contains("--emitted-by enrich"),
        "{msg}"
    );
    assert_eq!(line["level"], "warn", "{line}");
    assert_eq!(line["attempt"], 1, "{line}");
    // Another team's glob covering the name opens neither the listing nor the entry.
    let (s, v) = send_as(&r, "GET", "/v1/dlq?emitted_by=enrich", "other", None).await;
    assert_eq!(s, 403, "{v}");
    let (s, v) = send_as(&r, "GET", &format!("/v1/dlq/{id}"), "other", None).await;
    assert_eq!(s, 403, "{v}");
    // The other quarantined dead letters stay closed, and the refusal says where to look.
    let (s, v) = send_as(&r, "GET", "/v1/dlq?target=none", "team", None).await;
    assert_eq!(s, 403, "{v}");
    assert!(v.to_string().contains("emitted_by=<handler>"), "{v}");
    let (s, v) = send_as(&r, "GET", "/v1/dlq?emitted_by=", "ops", None).await;
    assert_eq!(s, 400, "an empty handler name matches nothing: {v}");
}

/// COMPLETED: a delivery whose idempotency key was handled before gets the stored result; the
/// handler is not run again. Here the same event is accepted again once its (short) dedup
/// window has passed: the same key, so the handler's enriched event is not emitted twice —
/// without the record it would be, since the re-emitted id is past the dedup window too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_delivery_returns_its_stored_result_without_running_again() {
    let rcv = Receiver::ok().await;
    let rules = enrich_then_webhook(&rcv);
    let config = "[ingest]\ndedup_window = \"1s\"\n";
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(config));
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    let ev = event("c-1", "order.created", json!({"order_id": "o1"}));
    let (s, b) = post_event(&r, &ev).await;
    assert_eq!(
        (s, b["results"][0]["status"].as_str()),
        (202, Some("accepted"))
    );
    assert!(
        rcv.wait_for(Duration::from_secs(20), |s| s.len() == 1)
            .await,
        "the first delivery runs the handler"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (s, b) = post_event(&r, &ev).await;
    assert_eq!(
        (s, b["results"][0]["status"].as_str()),
        (202, Some("accepted")),
        "past the dedup window the event is accepted again"
    );
    let hit = eventually(Duration::from_secs(20), || async {
        logs(&r, "enrich").await.into_iter().find(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.contains("completed earlier"))
        })
    })
    .await
    .expect("the second delivery is answered from COMPLETED");
    assert!(
        hit["message"]
            .as_str()
            .unwrap_or_default()
            .contains("emitted"),
        "{hit}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(rcv.count(), 1, "the handler did not run (and emit) again");
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains("router_handler_completed_hits_total{handler=\"enrich\"} 1"),
        "{}",
        metric_lines(&metrics, "completed")
    );
}

/// kill -9 while handlers work through their queues: after the restart every accepted event's
/// emission arrives, each source event yields exactly one emitted event id (a re-run of an
/// interrupted delivery emits the same id, which ingest dedup absorbs; an ack that committed
/// is never re-run), and `invoice` holds exactly one record per paid order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_handler_load_emits_each_event_exactly_once() {
    let rcv = Receiver::ok().await;
    let rules = format!(
        "{}  - name: paid
    pattern: {{ type: [order.paid] }}
    targets:
      - handler: invoice
        id: invoice
",
        enrich_then_webhook(&rcv)
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    const N: usize = 3000;
    // Every third event of a batch is a payment (for invoice): PAID payments in all.
    const PAID: usize = N / 50 * 17;
    for b in 0..N / 50 {
        let batch: Vec<Value> = (0..50)
            .map(|i| {
                let n = b * 50 + i;
                event(&format!("k-{n}"), "order.created", json!({"order_id": n}))
            })
            .chain((0..50).step_by(3).map(|i| {
                let n = b * 50 + i;
                event(&format!("p-{n}"), "order.paid", json!({"order_id": n}))
            }))
            .collect();
        post_batch(&r, &batch).await;
    }
    // Kill once the handler is part-way through the queue.
    assert!(
        rcv.wait_for(Duration::from_secs(60), |s| s.len() >= 300)
            .await,
        "the handler made no progress"
    );
    r.kill9();
    let before = rcv.distinct_ids().len();
    r.restart();
    let all = rcv
        .wait_for(Duration::from_secs(120), |s| {
            s.iter()
                .filter_map(|x| x.body["data"]["order_id"].as_u64())
                .collect::<std::collections::HashSet<_>>()
                .len()
                == N
        })
        .await;
    assert!(
        all,
        "emissions missing after the restart (had {before} distinct before the kill)"
    );
    // Let any redelivery land, then: one emitted id per source event, never two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut ids_per_order: std::collections::HashMap<u64, std::collections::HashSet<String>> =
        Default::default();
    for x in rcv.received() {
        if let Some(o) = x.body["data"]["order_id"].as_u64() {
            ids_per_order.entry(o).or_default().insert(x.event_id());
        }
    }
    assert_eq!(ids_per_order.len(), N);
    let twice: Vec<_> = ids_per_order
        .iter()
        .filter(|(_, ids)| ids.len() != 1)
        .take(5)
        .collect();
    assert!(
        twice.is_empty(),
        "a source event emitted two different ids: {twice:?}"
    );
    // One invoice record per paid order (keys are per order: a lost effect would show as a
    // missing key), and no payment dead-lettered.
    let want = format!("router_handler_kv_keys{{handler=\"invoice\"}} {PAID}");
    let kv = eventually(Duration::from_secs(60), || async {
        metrics_text(&r).await.contains(&want).then_some(())
    })
    .await;
    if kv.is_none() {
        let m = metrics_text(&r).await;
        panic!("want {want}:\n{}", metric_lines(&m, "invoice"));
    }
    let (_, dlq) = get_json(&r, "/v1/dlq").await;
    assert_eq!(dlq["entries"].as_array().map(Vec::len), Some(0), "{dlq}");
    eprintln!(
        "{before} distinct emissions before kill -9; {} deliveries at the receiver for {N} events",
        rcv.count()
    );
}

/// A crash injected in the window a kill from outside cannot hit on purpose: the handler has
/// run and its outbox is built, the ack is not committed yet. After the restart the delivery
/// runs again and commits once: exactly one key-value effect (`invoice`) and exactly one
/// emitted event (`enrich`), and the handlers' logs — kept on disk — show both runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_handling_and_commit_leaves_exactly_one_effect() {
    const CRASH: &str = "EVENT_ROUTER_CRASH_AT";
    let rcv = Receiver::ok().await;
    let rules = format!(
        "rules:\n  - name: paid\n    pattern: {{ type: [order.paid] }}\n    targets:\n      - handler: invoice\n        id: invoice\n  - name: created\n    pattern: {{ type: [order.created] }}\n    targets:\n      - handler: enrich\n        id: enrich\n  - name: enriched\n    pattern: {{ type: [order.created.enriched] }}\n    targets:\n      - webhook: {}\n",
        rcv.url()
    );
    let mut r =
        RouterProc::start_with_env(&[("r.yaml", &rules)], &[], &[(CRASH, "before_ack:invoice")]);
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);

    // 1. invoice runs (buffering its KV write) and the process dies before the ack.
    let paid = event("paid-1", "order.paid", json!({"order_id": 7}));
    let status = post_event_before_a_crash(&r, &paid).await;
    assert!(matches!(status, Some(202) | None), "{status:?}");
    let exit = r.wait_exit(Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the router did not stop at the crash point: {exit:?}"
    );
    // 2. Restarted (armed for enrich now): invoice runs again and commits.
    r.set_env(CRASH, Some("before_ack:enrich"));
    r.restart();
    let delivered = |f: &Value| f["targets"][0]["state"] == "delivered";
    let f = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "paid-1").await;
        delivered(&f).then_some(f)
    })
    .await
    .expect("the interrupted invoice delivery completes after the restart");
    let attempts = f["targets"][0]["attempts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(attempts.len(), 2, "{f}");
    // enrich runs, its emitted event is built, and the process dies before the ack.
    let created = event("created-1", "order.created", json!({"order_id": 8}));
    let status = post_event_before_a_crash(&r, &created).await;
    assert!(matches!(status, Some(202) | None), "{status:?}");
    let exit = r.wait_exit(Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the router did not stop at the second crash point: {exit:?}"
    );
    assert_eq!(rcv.count(), 0, "nothing was emitted before the ack");
    // 3. Restarted unarmed: enrich runs again; its emission is committed with the ack.
    r.set_env(CRASH, None);
    r.restart();
    if !rcv
        .wait_for(Duration::from_secs(30), |s| !s.is_empty())
        .await
    {
        panic!(
            "the re-run's emission did not arrive; fate: {}",
            fate(&r, "created-1").await
        );
    }
    // The same order paid again: invoice finds its one record.
    let again = event("paid-2", "order.paid", json!({"order_id": 7}));
    assert_eq!(post_event(&r, &again).await.0, 202);
    let lines = eventually(Duration::from_secs(30), || async {
        let lines = logs(&r, "invoice").await;
        lines
            .iter()
            .any(|l| l["event_id"] == "paid-2")
            .then_some(lines)
    })
    .await
    .expect("invoice handled the second payment");
    let of = |id: &str| -> Vec<(u64, String)> {
        lines
            .iter()
            .filter(|l| l["event_id"] == id)
            .map(|l| {
                (
                    l["attempt"].as_u64().unwrap_or(0),
                    l["message"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    };
    // Both runs of the first delivery logged "recorded" (the first one's write never
    // committed); the second payment finds the record the re-run committed.
    assert_eq!(
        of("paid-1"),
        vec![
            (1, "recorded invoice:7".to_string()),
            (2, "recorded invoice:7".to_string())
        ],
        "{lines:?}"
    );
    assert_eq!(
        of("paid-2"),
        vec![(1, "invoice:7 already recorded; nothing to do".to_string())]
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        rcv.count(),
        1,
        "exactly one emitted event: {:?}",
        rcv.received()
    );
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains("router_handler_kv_keys{handler=\"invoice\"} 1"),
        "exactly one key-value effect:\n{}",
        metric_lines(&metrics, "handler_kv")
    );
}

/// A handler's key-value namespace is bounded: the write that would pass the bound fails its
/// invocation (retried under the policy, then dead-lettered with the reason in its attempts),
/// nothing of it is stored, and the namespace's size shows in `/v1/status` and `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_kv_namespace_fails_the_growing_write_and_shows_its_size() {
    let rules = rules_yaml(
        FAST,
        &[(
            "paid",
            "order.paid",
            &["handler: invoice\n        id: invoice\n        policy: fast".to_string()],
        )],
    );
    // One invoice record counts ~155 bytes (key plus a JSON value with two ids, plus 64 for
    // the entry): one fits, two do not.
    let config = "[handlers]\nkv_max_bytes = 250\n";
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(config));
    assert_eq!(put_handler(&r, "invoice", plugin("invoice")).await.0, 201);
    assert_eq!(
        post_event(&r, &event("kv-1", "order.paid", json!({"order_id": 1})))
            .await
            .0,
        202
    );
    eventually(Duration::from_secs(30), || async {
        (fate(&r, "kv-1").await["targets"][0]["state"] == "delivered").then_some(())
    })
    .await
    .expect("the first record fits");
    assert_eq!(
        post_event(&r, &event("kv-2", "order.paid", json!({"order_id": 2})))
            .await
            .0,
        202
    );
    let f = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "kv-2").await;
        (f["targets"][0]["state"] == "dlq").then_some(f)
    })
    .await
    .expect("the second record does not fit: retried, then dead-lettered");
    let err = f["targets"][0]["attempts"][0]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(err.contains("kv namespace is full"), "{f}");
    let (_, status) = get_json(&r, "/v1/status").await;
    let ns = &status["handler_kv"]["namespaces"]["invoice"];
    assert_eq!(ns["keys"], 1, "{status}");
    let bytes = ns["bytes"].as_u64().unwrap_or(0);
    assert!((50 + 64..=250).contains(&bytes), "{status}");
    assert_eq!(status["handler_kv"]["max_bytes"], 250);
    // The other bounded records show beside it: the first payment left a COMPLETED record.
    assert_eq!(status["records"]["completed"]["count"], 1, "{status}");
    // The two payments (and, once routed, the router.dlq.added system event of the second).
    let events = status["records"]["events"]["count"].as_u64().unwrap_or(0);
    assert!((2..=3).contains(&events), "{status}");
    assert_eq!(status["store"]["ingest_refused"], false, "{status}");
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains(&format!(
            "router_handler_kv_bytes{{handler=\"invoice\"}} {bytes}"
        )),
        "{metrics}"
    );
}

/// A lease that runs out under a stalled worker: the first attempt's handler has run, and its
/// worker stalls (a failpoint) past the lease before committing; the entry goes back to the
/// queue and a second attempt runs and commits meanwhile; when the first wakes, its ack is
/// refused by the lease's fencing token and nothing of its outbox is written. Exactly one
/// emission and one key-value write (the winning attempt's: the second, or a later one when a
/// loaded machine made the second outlive its lease too) remain. A live invocation cannot
/// outlive its lease: it is bounded by the policy timeout, which the lease covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_under_a_stalled_worker_refuses_the_late_ack() {
    let rcv = Receiver::ok().await;
    let policy = "  slow:\n    timeout: 2s\n    retry: { max_attempts: 5, base_delay: 50ms, max_delay: 100ms }";
    let rules = format!(
        "{}  - name: done\n    pattern: {{ type: [hostile.slow.done] }}\n    targets:\n      - webhook: {}\n",
        rules_yaml(
            policy,
            &[(
                "slow",
                "hostile",
                &["handler: hostile\n        id: hostile\n        policy: slow".to_string()],
            )],
        ),
        rcv.url()
    );
    // The lease is the policy timeout plus the margin (2.2 s); the first attempt's worker
    // stalls 5 s between the invocation and its commit.
    let config = "[delivery]\nlease_margin = \"200ms\"\n";
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[("EVENT_ROUTER_DELAY_AT", "before_ack:hostile:5000")],
        Some(config),
    );
    assert_eq!(put_handler(&r, "hostile", plugin("hostile")).await.0, 201);
    let ev = event("slow-1", "hostile", json!({"mode": "slow", "ms": 0}));
    assert_eq!(post_event(&r, &ev).await.0, 202);
    // The second attempt is fast and commits while the first one is stalled.
    assert!(
        rcv.wait_for(Duration::from_secs(20), |s| !s.is_empty())
            .await,
        "the second attempt's emission arrives"
    );
    // The first attempt commits about 5 s in; its ack is fenced. On a loaded machine a later
    // attempt could outlive its lease too: then it is fenced as well and the next one wins. Whatever the count, every attempt but the
    // winner (the last one) is fenced and only the winner's effects are kept.
    let settled = eventually(Duration::from_secs(20), || async {
        let m = metrics_text(&r).await;
        let fenced = counter(
            &m,
            "router_deliveries_total{target=\"hostile\",result=\"fenced\"}",
        );
        let attempts = slow_attempts(&logs(&r, "hostile").await);
        let winner = *attempts.last()?;
        let delivered = fate(&r, "slow-1").await["targets"][0]["state"] == "delivered";
        (delivered && fenced >= 1 && attempts.contains(&1) && fenced + 1 == winner)
            .then_some(attempts)
    })
    .await;
    let Some(attempts) = settled else {
        let m = metrics_text(&r).await;
        panic!(
            "the late acks were not fenced:\n{}\nattempts logged: {:?}\nfate: {}",
            metric_lines(&m, "deliveries"),
            slow_attempts(&logs(&r, "hostile").await),
            fate(&r, "slow-1").await
        );
    };
    // Every attempt ran once (the logs say so), and none after the winner.
    let winner = *attempts.last().expect("settled on at least one attempt");
    assert_eq!(attempts, (1..=winner).collect::<Vec<_>>());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(rcv.count(), 1, "exactly one emission: {:?}", rcv.received());
    // One key, holding the winner's value (one `x` per attempt): key "slow:slow-1" (11 bytes)
    // plus `winner` bytes, plus the 64 each entry counts. A fenced attempt's write would make
    // it longer or shorter.
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains("router_handler_kv_keys{handler=\"hostile\"} 1")
            && metrics.contains(&format!(
                "router_handler_kv_bytes{{handler=\"hostile\"}} {}\n",
                11 + winner + 64
            )),
        "winner {winner}: {}",
        metric_lines(&metrics, "handler_kv")
    );
    let f = fate(&r, "slow-1").await;
    assert_eq!(f["targets"][0]["state"], "delivered", "{f}");
    assert_eq!(
        f["targets"][0]["attempts"].as_array().map(Vec::len),
        Some(usize::try_from(winner).expect("small")),
        "{f}"
    );
}

/// A delivery to a handler not uploaded yet waits without spending attempts, and says so: it
/// counts as `deferred` (not `retried`), the target shows it, and the upload lets it through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_to_a_handler_not_uploaded_waits_visibly_without_attempts() {
    let rules = "rules:\n  - name: r\n    pattern: { type: [t] }\n    targets:\n      - handler: noop\n        id: later\n";
    let r = RouterProc::start(&[("r.yaml", rules)], &[]);
    assert_eq!(post_event(&r, &event("w1", "t", json!({}))).await.0, 202);
    let m = eventually(Duration::from_secs(20), || async {
        let m = metrics_text(&r).await;
        (counter(
            &m,
            "router_deliveries_total{target=\"later\",result=\"deferred\"}",
        ) >= 1)
            .then_some(m)
    })
    .await
    .expect("counted as deferred");
    assert_eq!(
        counter(
            &m,
            "router_deliveries_total{target=\"later\",result=\"retried\"}"
        ),
        0,
        "{}",
        metric_lines(&m, "deliveries")
    );
    let (_, t) = get_json(&r, "/v1/targets/later").await;
    assert!(t["deferred"].as_u64().unwrap_or(0) >= 1, "{t}");
    let f = fate(&r, "w1").await;
    assert_eq!(f["targets"][0]["attempt_count"], 0, "{f}");
    assert!(
        r.log_text()
            .contains("delivery put back without spending an attempt"),
        "the wait is logged"
    );
    // The documented alert (`router_handler_loaded == 0`) sees a handler the rules route to
    // but that is not uploaded: the series used to be absent until the first upload.
    assert!(
        m.contains("router_handler_loaded{handler=\"noop\"} 0"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
    assert_eq!(put_handler(&r, "noop", plugin("noop")).await.0, 201);
    let done = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "w1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await
    .expect("delivered once uploaded");
    assert_eq!(done["targets"][0]["attempt_count"], 1, "{done}");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_handler_loaded{handler=\"noop\"} 1"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
    // A delete (a mistaken one, say) shows as 0 again, not as no series.
    let resp = client()
        .delete(r.url("/v1/handlers/noop"))
        .send()
        .await
        .expect("delete");
    assert!(resp.status().is_success(), "{}", resp.status());
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_handler_loaded{handler=\"noop\"} 0"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
}

/// A delivery to a handler that has no active version says why it waits, in its fate and in
/// `/v1/status` (read from the registry at each request): it showed queued with no reason
/// anywhere but an INFO log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_waiting_for_a_missing_handler_says_so() {
    let rules = rules_yaml(
        "",
        &[("r", "t", &["handler: absent\n        id: h".to_string()])],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (_, b) = post_event(&r, &event("w1", "t", json!({}))).await;
    assert_eq!(b["results"][0]["status"], "accepted", "{b}");
    let f = eventually(Duration::from_secs(15), || async {
        let f = fate(&r, "w1").await;
        f["targets"][0]["waiting_on"]
            .as_str()
            .is_some_and(|w| w.contains("\"absent\" is not uploaded"))
            .then_some(f)
    })
    .await;
    assert!(f.is_some(), "{}", fate(&r, "w1").await);
    let (_, status) = get_json(&r, "/v1/status").await;
    assert!(
        status["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w.as_str().is_some_and(|w| w.contains(
                "target h: handler \"absent\" is not uploaded (or was deleted): its deliveries wait"
            ))),
        "{status}"
    );
}

/// A team's `handlers:` token lists the handlers its glob covers (`router handlers list`,
/// which `push` points a team to when it stops waiting): it was refused for lacking `read`.
/// `read` lists every handler; a token with neither scope is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_token_lists_the_handlers_it_covers() {
    let tokens = [
        ("ops", None, "admin"),
        ("viewer", None, "read"),
        ("billing-ci", Some("billing"), "handlers:inv*"),
        ("producer", None, "ingest:*"),
    ];
    let auth = tokens_config(&tokens);
    let r = RouterProc::start_full(&[], &[], &[], Some(&auth));
    for name in ["invoice", "noop"] {
        let body = Some(("application/wasm", plugin(name)));
        let (s, b) = send_as(&r, "PUT", &format!("/v1/handlers/{name}"), "ops", body).await;
        assert_eq!(s, 201, "{b}");
    }
    let names = |b: &Value| -> Vec<String> {
        b["handlers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h["name"].as_str().map(str::to_string))
            .collect()
    };
    let (s, b) = send_as(&r, "GET", "/v1/handlers", "billing-ci", None).await;
    assert_eq!((s, names(&b)), (200, vec!["invoice".to_string()]), "{b}");
    let (s, b) = send_as(&r, "GET", "/v1/handlers", "viewer", None).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(names(&b), ["invoice", "noop"]);
    let (s, b) = send_as(&r, "GET", "/v1/handlers", "producer", None).await;
    assert_eq!(s, 403, "{b}");
}

/// A start whose handlers must be compiled again (here `handlers.fuel` switched on, as a
/// router upgrade does) serves at once: the compilation runs in the background (stretched
/// here by a delay point), and meanwhile the handler is listed as `loading`, its deliveries
/// wait saying so, `/v1/status` and `router_handler_loaded` show it, and ingest answers.
/// Before, the router listened only once every such handler was compiled (45 s for the 18 MB
/// Python example). A stop does not wait for the compilation either; the next start compiles
/// it and the waiting event is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_compiled_again_at_start_do_not_hold_up_the_api() {
    let sink = Receiver::ok().await;
    let rules = format!(
        "{}  - name: enriched-out\n    pattern:\n      type: [{{ suffix: .enriched }}]\n    targets:\n      - webhook: {}\n        id: out\n",
        rules_yaml(
            FAST,
            &[(
                "to-rust",
                "order.created",
                &["handler: enrich\n        id: h\n        policy: fast".to_string()]
            )]
        ),
        sink.url()
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    assert_eq!(put_handler(&r, "enrich", plugin("enrich")).await.0, 201);
    r.sigterm();
    r.set_env("ROUTER_HANDLERS__FUEL", Some("100000000"));
    // Far longer than this part of the test: the compilation is pending throughout.
    r.set_env(
        "EVENT_ROUTER_DELAY_AT",
        Some("deferred_compile:enrich:600000"),
    );
    r.restart();
    assert!(
        r.log_text().contains("compiling_in_background=1"),
        "{}",
        r.log_text()
    );
    assert_eq!(get_json(&r, "/healthz").await.0, 200);
    assert_eq!(get_json(&r, "/readyz").await.0, 200, "ready for events");
    assert_eq!(
        post_event(&r, &event("c1", "order.created", json!({"total": 1})))
            .await
            .0,
        202
    );
    let (_, h) = get_json(&r, "/v1/handlers/enrich").await;
    assert_eq!(h["state"], "loading", "{h}");
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "c1").await;
        f["targets"][0]["waiting_on"]
            .as_str()
            .is_some_and(|w| w.contains("handler \"enrich\" version 1 is being compiled"))
            .then_some(f)
    })
    .await;
    assert!(f.is_some(), "{}", fate(&r, "c1").await);
    let (_, status) = get_json(&r, "/v1/status").await;
    assert!(
        status["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w.as_str().is_some_and(
                |w| w.starts_with("target h: handler \"enrich\" version 1 is being compiled")
            )),
        "{status}"
    );
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_handler_loaded{handler=\"enrich\"} 0"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
    // The stop does not wait for the compilation (a blocking thread nobody awaits): the
    // harness gives it 30 s, the delay is ten minutes.
    let stopping = std::time::Instant::now();
    assert!(r.sigterm().success());
    assert!(
        stopping.elapsed() < Duration::from_secs(20),
        "{:?}",
        stopping.elapsed()
    );
    r.set_env("EVENT_ROUTER_DELAY_AT", None);
    r.restart();
    // Compiling the 188 KB example takes about a second; generous for a loaded machine.
    let loaded = eventually(Duration::from_secs(120), || async {
        let (_, h) = get_json(&r, "/v1/handlers/enrich").await;
        (h["state"] == "loaded").then_some(h)
    })
    .await;
    assert!(loaded.is_some(), "{}", r.log_text());
    assert!(
        sink.wait_for(Duration::from_secs(60), |s| s.len() == 1)
            .await,
        "the waiting event was not delivered once loaded"
    );
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_handler_loaded{handler=\"enrich\"} 1"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
}

/// A handler whose stored component is damaged is listed as `failed` with why, its
/// deliveries and `/v1/status` give that cause (they said "not uploaded"), and
/// `router_handler_loaded` is 0. Uploading the same bytes again repairs it for good: the
/// damaged file was kept before, and the next start failed the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_failed_to_load_says_why_and_a_reupload_repairs_it() {
    let rules = rules_yaml(
        "",
        &[("r", "t", &["handler: noop\n        id: h".to_string()])],
    );
    let mut r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (_, v) = put_handler(&r, "noop", plugin("noop")).await;
    let sha = v["sha256"].as_str().expect("sha256").to_string();
    r.sigterm();
    let component = r
        .data_dir()
        .join(format!("handlers/registry/noop/{sha}.wasm"));
    let mut bytes = std::fs::read(&component).expect("component");
    let middle = bytes.len() / 2;
    bytes[middle..middle + 4].copy_from_slice(b"XXXX");
    std::fs::write(&component, bytes).expect("write");
    r.restart();
    let (_, h) = get_json(&r, "/v1/handlers/noop").await;
    assert_eq!(h["state"], "failed", "{h}");
    assert!(
        h["load_error"]
            .as_str()
            .is_some_and(|e| e.contains("does not match its SHA-256")),
        "{h}"
    );
    assert_eq!(post_event(&r, &event("w1", "t", json!({}))).await.0, 202);
    let f = eventually(Duration::from_secs(20), || async {
        let f = fate(&r, "w1").await;
        f["targets"][0]["waiting_on"]
            .as_str()
            .is_some_and(|w| {
                w.contains("handler \"noop\" could not be loaded (cannot load \"noop\" version 1")
            })
            .then_some(f)
    })
    .await;
    assert!(f.is_some(), "{}", fate(&r, "w1").await);
    let (_, status) = get_json(&r, "/v1/status").await;
    assert!(
        status["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w
                .as_str()
                .is_some_and(|w| w.starts_with("target h: handler \"noop\" could not be loaded"))),
        "{status}"
    );
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_handler_loaded{handler=\"noop\"} 0"),
        "{}",
        metric_lines(&m, "handler_loaded")
    );
    assert_eq!(put_handler(&r, "noop", plugin("noop")).await.0, 200);
    r.sigterm();
    r.restart();
    let (_, h) = get_json(&r, "/v1/handlers/noop").await;
    assert_eq!(
        (&h["state"], &h["load_error"]),
        (&json!("loaded"), &Value::Null),
        "{h}"
    );
    let done = eventually(Duration::from_secs(30), || async {
        let f = fate(&r, "w1").await;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await;
    assert!(done.is_some(), "{}", fate(&r, "w1").await);
}

/// An upload whose client gave up while it compiled neither holds the router's exit nor
/// activates itself after the router stopped (its compilation is stretched here, as a large
/// component's is). Before, the process waited for it and, on a node alone, committed it after
/// logging `stopped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_abandoned_by_its_client_neither_holds_the_exit_nor_activates_after_it() {
    let mut r = RouterProc::start_with_env(
        &[],
        &[],
        &[("EVENT_ROUTER_DELAY_AT", "upload_compile:noop:20000")],
    );
    let gave_up = client()
        .put(r.url("/v1/handlers/noop"))
        .body(plugin("noop"))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    let stopping = std::time::Instant::now();
    assert!(r.sigterm().success());
    // Within the grace period (10 s by default), not after the 20 s stall.
    assert!(
        stopping.elapsed() < Duration::from_secs(12),
        "{:?}",
        stopping.elapsed()
    );
    assert!(
        !r.log_text().contains("handler version activated"),
        "{}",
        r.log_text()
    );
    r.set_env("EVENT_ROUTER_DELAY_AT", None);
    r.restart();
    assert_eq!(get_json(&r, "/v1/handlers/noop").await.0, 404);
}
