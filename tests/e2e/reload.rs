//! Hot reload of rules and contracts against the running binary.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

/// Writes contract file `rel` (`<type>/v<N>.json`) into the router's contracts directory.
fn write_contract(r: &RouterProc, rel: &str, text: &str) {
    let path = r.dir.path().join("contracts").join(rel);
    std::fs::create_dir_all(path.parent().expect("a type directory")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

fn write_rules(r: &RouterProc, name: &str, text: &str) {
    // Write to a temp file and rename, as editors and `git checkout` do, so the watcher never
    // sees a half-written file.
    let dir = r.dir.path().join("rules");
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
}

async fn status(r: &RouterProc) -> Value {
    get_json(r, "/v1/status").await.1
}

async fn wait_version_change(r: &RouterProc, old: &str) -> String {
    eventually(Duration::from_secs(10), || async {
        let v = status(r).await["rules"]["version"]
            .as_str()
            .unwrap_or("")
            .to_string();
        (v != old).then_some(v)
    })
    .await
    .expect("the watcher reloaded the rules")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_reload_on_change_and_a_broken_file_is_refused() {
    let a = Receiver::ok().await;
    let b = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[],
    );
    let v1 = status(&r).await["rules"]["version"]
        .as_str()
        .expect("version")
        .to_string();
    assert_eq!(
        post_event(&r, &event("before", "t", json!({}))).await.0,
        202
    );
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);

    // Change: route `t` to b instead.
    write_rules(&r, "r.yaml", &webhook_rule("to-b", "t", &b.url(), "b"));
    let v2 = wait_version_change(&r, &v1).await;
    assert_eq!(post_event(&r, &event("after", "t", json!({}))).await.0, 202);
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    assert_eq!(a.count(), 1, "the old rule no longer matches");
    assert_eq!(fate(&r, "before").await["ruleset_version"], v1.as_str());
    assert_eq!(fate(&r, "after").await["ruleset_version"], v2.as_str());

    // Break it: the old set stays live, the error is visible.
    write_rules(
        &r,
        "r.yaml",
        "rules:\n  - name: broken\n    pattern: { type: [{ numeric: [\"<<\", 1] }] }\n    targets: []\n",
    );
    let err = eventually(Duration::from_secs(10), || async {
        let s = status(&r).await;
        s["reload"]["last_error"].as_str().map(str::to_string)
    })
    .await
    .expect("the refused reload is visible in /v1/status");
    assert!(err.contains("r.yaml:"), "error names the file: {err}");
    assert_eq!(status(&r).await["rules"]["version"], v2.as_str());
    assert_eq!(
        post_event(&r, &event("during-broken", "t", json!({})))
            .await
            .0,
        202
    );
    assert!(
        b.wait_for(Duration::from_secs(10), |s| s.len() == 2).await,
        "the old set still routes"
    );
    let metrics = metrics_text(&r).await;
    assert!(
        metrics.contains("router_reloads_total{result=\"error\"}"),
        "{metrics}"
    );

    // The admin endpoint answers 422 with the errors while the file is broken: each one a
    // problem of the file, with its position (no heading line posing as an error).
    let (code, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(code, 422, "{body}");
    let errors = body["errors"].as_array().expect("errors");
    assert!(!errors.is_empty(), "{body}");
    assert!(
        errors
            .iter()
            .all(|e| e["message"].as_str().is_some_and(|m| m.contains("r.yaml:"))),
        "{body}"
    );
    // Fix it again: a new file is added too.
    write_rules(&r, "r.yaml", &webhook_rule("to-b", "t", &b.url(), "b"));
    write_rules(&r, "extra.yaml", &webhook_rule("extra", "u", &a.url(), "a"));
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    let (_, rules) = get_json(&r, "/v1/rules").await;
    let names: Vec<_> = rules["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|x| x["name"].clone())
        .collect();
    assert!(
        names.contains(&json!("extra")) && names.contains(&json!("to-b")),
        "{names:?}"
    );
    // The live set answers /v1/rules/test.
    let resp = client()
        .post(r.url("/v1/rules/test"))
        .json(&event("x", "u", json!({})))
        .send()
        .await
        .expect("test");
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["matches"][0]["rule"], "extra");
    assert_eq!(status(&r).await["reload"]["last_error"], Value::Null);
}

/// The rules directory moved away (a deploy's `mv`, a volume unmounted) is not an empty rule
/// set: the reload is refused and the old rules stay live. A target that could not start when
/// the router did (its signing secret unset), left unchanged, does not hold back other changes:
/// it stays a warning, shown in `/v1/status` and replaced at each reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_rules_directory_or_an_unchanged_broken_target_never_blocks_or_empties_rules() {
    let a = Receiver::ok().await;
    let signed = "rules:\n  - name: signed\n    pattern: { type: [s] }\n    targets:\n      - webhook: http://127.0.0.1:9/x\n        id: signed\n        secret_env: E2E_SECRET_NEVER_SET\n";
    let r = RouterProc::start(
        &[
            ("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a")),
            ("signed.yaml", signed),
        ],
        &[],
    );
    let st = status(&r).await;
    assert!(
        st["warnings"].to_string().contains("E2E_SECRET_NEVER_SET"),
        "{st}"
    );
    // An unrelated change goes live despite the target that still cannot start.
    write_rules(
        &r,
        "extra.yaml",
        &webhook_rule("extra", "u", &a.url(), "a2"),
    );
    let (_, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert!(body["rules_version"].is_string(), "{body}");
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(3), "{rules}");
    assert!(
        status(&r).await["warnings"]
            .to_string()
            .contains("E2E_SECRET_NEVER_SET")
    );
    // The directory goes away: refused, the three rules stay, the error says why.
    let dir = r.dir.path().join("rules");
    std::fs::rename(&dir, r.dir.path().join("rules.moved")).expect("move the rules away");
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 422);
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(3), "{rules}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(err.contains("does not exist"), "{err}");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_reload_failing 1"),
        "{}",
        metric_lines(&m, "reload")
    );
    // The target that cannot start is listed, with why.
    let (_, t) = get_json(&r, "/v1/targets/signed").await;
    assert!(
        t["worker"]
            .as_str()
            .is_some_and(|w| w.starts_with("not running:") && w.contains("E2E_SECRET_NEVER_SET")),
        "{t}"
    );
    assert_eq!(post_event(&r, &event("still", "t", json!({}))).await.0, 202);
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
}

/// The contracts directory moved away is not "no contracts": the reload is refused, and the
/// live contracts keep quarantining what breaks them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_contracts_directory_never_turns_the_checks_off() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[(
            "t/v1.json",
            r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#,
        )],
    );
    let dir = r.dir.path().join("contracts");
    std::fs::rename(&dir, r.dir.path().join("contracts.moved")).expect("move the contracts away");
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 422);
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(
        err.contains("contracts directory") && err.contains("does not exist"),
        "{err}"
    );
    let (s, body) = post_event(&r, &event("bad", "t", json!({"n": "x"}))).await;
    assert_eq!(
        (s, &body["results"][0]["status"]),
        (202, &json!("quarantined")),
        "{body}"
    );
    let (s, body) = post_event(&r, &event("good", "t", json!({"n": 1}))).await;
    assert_eq!(
        (s, &body["results"][0]["status"]),
        (202, &json!("accepted")),
        "{body}"
    );
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
}

/// A broken contract file does not hold back a rule fix: rules and contracts reload apart. The
/// new rule goes live, the previous contracts stay live (and keep checking), and the
/// contract's error shows in `/v1/status` and the metrics until the file is fixed. The whole
/// reload used to be refused, so an urgent rule waited for someone else's contract.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_contract_file_does_not_hold_back_a_rule_change() {
    let a = Receiver::ok().await;
    let b = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[(
            "t/v1.json",
            r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#,
        )],
    );
    let contracts_version = status(&r).await["contracts"]["version"].clone();
    write_contract(&r, "ct.broken/v1.json", r#"{"type": "objec"}"#);
    let err = eventually(Duration::from_secs(10), || async {
        status(&r).await["reload"]["last_error"]
            .as_str()
            .map(str::to_string)
    })
    .await
    .expect("the broken contract is reported");
    assert!(err.contains("ct.broken/v1.json"), "{err}");

    // An urgent rule fix, while the contract file is still broken.
    write_rules(
        &r,
        "urgent.yaml",
        &webhook_rule("urgent-fix", "u", &b.url(), "b"),
    );
    let live = eventually(Duration::from_secs(10), || async {
        let (_, rules) = get_json(&r, "/v1/rules").await;
        rules["rules"]
            .as_array()
            .is_some_and(|l| l.iter().any(|x| x["name"] == "urgent-fix"))
            .then_some(())
    })
    .await;
    assert!(
        live.is_some(),
        "the new rule never went live: {}",
        status(&r).await
    );
    assert_eq!(
        post_event(&r, &event("urgent", "u", json!({}))).await.0,
        202
    );
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);

    // The contracts are as they were: `t` still checked, the broken one not loaded.
    let s = status(&r).await;
    assert_eq!(s["contracts"]["version"], contracts_version, "{s}");
    let (_, body) = post_event(&r, &event("bad", "t", json!({"n": "x"}))).await;
    assert_eq!(body["results"][0]["status"], "quarantined", "{body}");
    let (code, _) = get_json(&r, "/v1/contracts/ct.broken/v1").await;
    assert_eq!(code, 404);
    // And the refusal is still shown, as for a broken rule file.
    let err = s["reload"]["last_error"].as_str().unwrap_or("");
    assert!(err.contains("ct.broken/v1.json"), "{s}");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_reload_failing 1"),
        "{}",
        metric_lines(&m, "reload")
    );
    let (code, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(code, 422, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("contracts refused")),
        "{body}"
    );
    assert!(
        body["errors"].to_string().contains("ct.broken/v1.json"),
        "{body}"
    );

    // Fixed: the contract loads, the error clears.
    write_contract(&r, "ct.broken/v1.json", r#"{"type": "object"}"#);
    let cleared = eventually(Duration::from_secs(10), || async {
        status(&r).await["reload"]["last_error"]
            .is_null()
            .then_some(())
    })
    .await;
    assert!(cleared.is_some(), "{}", status(&r).await);
    assert_eq!(get_json(&r, "/v1/contracts/ct.broken/v1").await.0, 200);
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_reload_failing 0"),
        "{}",
        metric_lines(&m, "reload")
    );
}

/// The contracts directory emptied (a sync caught half-way) is not "no contracts" either: the
/// reload is refused, visibly, and an enforced type is still answered 422. It used to go live
/// with a WARN line only, and the type's bad events were accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_contracts_directory_never_turns_the_checks_off() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[
            (
                "t/v1.json",
                r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#,
            ),
            ("modes.toml", "t = \"enforce\"\n"),
        ],
    );
    assert_eq!(
        post_event(&r, &event("bad0", "t", json!({"n": "x"})))
            .await
            .0,
        422
    );
    let dir = r.dir.path().join("contracts");
    std::fs::remove_dir_all(dir.join("t")).expect("empty the contracts directory");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(err.contains("holds no contract"), "{err}");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_reload_failing 1"),
        "{}",
        metric_lines(&m, "reload")
    );
    assert_eq!(
        post_event(&r, &event("bad1", "t", json!({"n": "x"})))
            .await
            .0,
        422
    );
    let (s, body) = post_event(&r, &event("good", "t", json!({"n": 1}))).await;
    assert_eq!(
        (s, &body["results"][0]["status"]),
        (202, &json!("accepted")),
        "{body}"
    );
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
}

/// A router whose only target, `old`, takes one event at a time (20 ms each) from a
/// receiver it returns; `n` events `{prefix}{i}` are accepted for it, then its rule is removed
/// from the rules directory and the reload is waited for, most of the queue still waiting.
async fn removed_while_queued(n: usize, prefix: &str) -> (RouterProc, Receiver) {
    let slow = Receiver::scripted(std::sync::Arc::new(|_, _| {
        (200, Duration::from_millis(20), vec![])
    }))
    .await;
    let policy = "  one-at-a-time:\n    throttle: { max_concurrency: 1 }";
    let r = RouterProc::start(
        &[(
            "r.yaml",
            &rules_yaml(
                policy,
                &[(
                    "r",
                    "t",
                    &[format!(
                        "webhook: {}\n        id: old\n        policy: one-at-a-time",
                        slow.url()
                    )],
                )],
            ),
        )],
        &[],
    );
    let batch: Vec<_> = (0..n)
        .map(|i| event(&format!("{prefix}{i}"), "t", json!({})))
        .collect();
    post_batch(&r, &batch).await;
    // The version before the write, so a reload that comes quickly is not missed.
    let v = status(&r).await["rules"]["version"]
        .as_str()
        .unwrap_or("")
        .to_string();
    write_rules(&r, "r.yaml", "rules: []\n");
    let _ = wait_version_change(&r, &v).await;
    (r, slow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_drains_under_its_last_configuration() {
    let (r, slow) = removed_while_queued(100, "d").await;
    assert!(
        slow.wait_for(Duration::from_secs(30), |s| s.len() >= 100)
            .await,
        "the removed target's queue was stranded"
    );
    let (_, t) = get_json(&r, "/v1/targets/old").await;
    assert_eq!(t["in_rule_set"], false);
}

/// `/v1/status` lists a target a live reload removed while its queue drains, and no longer
/// once it has drained. The list was made at start only: a reload's removals were missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_a_removed_target_while_it_drains() {
    let (r, slow) = removed_while_queued(200, "w").await;
    let warnings = status(&r).await["warnings"].to_string();
    assert!(
        warnings.contains("target old is no longer in the rules")
            && warnings.contains("drain under its last configuration"),
        "{warnings}"
    );
    assert!(
        slow.wait_for(Duration::from_secs(60), |s| s.len() >= 200)
            .await,
        "the removed target's queue was stranded"
    );
    let gone = eventually(Duration::from_secs(15), || async {
        let w = status(&r).await["warnings"].to_string();
        (!w.contains("target old")).then_some(())
    })
    .await;
    assert!(gone.is_some(), "{}", status(&r).await["warnings"]);
}

/// A target whose worker never started (its signing secret unset since the router started)
/// and that a live reload removes does not strand its queue: its last configuration still
/// cannot start, so its entries go to the DLQ as `target_removed`, saying why. They used to
/// stay queued with no worker until a restart, the log saying they drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_whose_worker_never_started_does_not_strand_its_queue() {
    let a = Receiver::ok().await;
    let signed = "rules:\n  - name: signed\n    pattern: { type: [s] }\n    targets:\n      - webhook: http://127.0.0.1:9/x\n        id: signed\n        secret_env: E2E_STRANDED_SECRET_NEVER_SET\n";
    let r = RouterProc::start(
        &[
            ("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a")),
            ("signed.yaml", signed),
        ],
        &[],
    );
    post_batch(
        &r,
        &[event("s1", "s", json!({})), event("s2", "s", json!({}))],
    )
    .await;
    let (_, t) = get_json(&r, "/v1/targets/signed").await;
    assert_eq!(t["queued"], 2, "{t}");
    std::fs::remove_file(r.dir.path().join("rules/signed.yaml")).expect("remove the rule");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let l = target_removed_entries(&r, 2)
        .await
        .expect("the removed target's queue was stranded");
    let errors = l["entries"][0]["errors"].to_string();
    assert!(
        errors.contains("cannot start") && errors.contains("E2E_STRANDED_SECRET_NEVER_SET"),
        "{errors}"
    );
    let (_, t) = get_json(&r, "/v1/targets/signed").await;
    assert_eq!(t["queued"].as_u64().unwrap_or(0), 0, "{t}");
    // The rest of the router carries on.
    assert_eq!(post_event(&r, &event("t1", "t", json!({}))).await.0, 202);
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
}

/// A removed target's queue still drains after a kill -9: its last configuration comes back
/// from the store, since the rules directory no longer has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_drains_after_a_kill_9() {
    let (mut r, slow) = removed_while_queued(200, "k").await;
    // Killed while most of the queue still waits (200 events one at a time, 20 ms each).
    let (_, t) = get_json(&r, "/v1/targets/old").await;
    assert_eq!(t["in_rule_set"], false, "{t}");
    r.kill9();
    let before = slow.distinct_ids().len();
    assert!(before < 200, "the queue drained before the kill: {before}");
    r.restart();
    assert!(
        slow.wait_for(Duration::from_secs(60), |s| {
            s.iter()
                .map(Received::event_id)
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= 200
        })
        .await,
        "the removed target's queue was stranded by the restart: {} of 200 delivered ({before} \
         before the kill)",
        slow.distinct_ids().len()
    );
    let (_, t) = get_json(&r, "/v1/targets/old").await;
    assert_eq!(t["in_rule_set"], false, "{t}");
    assert_eq!(t["queued"], 0, "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_can_dead_letter_its_queue_instead() {
    let never = Receiver::status(503).await;
    let mut r = RouterProc::start_with_env(
        &[("r.yaml", &retrying_rule(&never.url(), "id: gone"))],
        &[],
        &[("ROUTER_DELIVERY__ON_TARGET_REMOVED", "dead_letter")],
    );
    let (s, _) = post_raw(
        &r,
        "application/cloudevents-batch+json",
        serde_json::to_vec(
            &(0..10)
                .map(|i| event(&format!("g{i}"), "t", json!({})))
                .collect::<Vec<_>>(),
        )
        .expect("json"),
    )
    .await;
    assert_eq!(s, 202);
    assert!(
        never
            .wait_for(Duration::from_secs(10), |s| s.len() >= 10)
            .await
    );
    // The new set has only an alert rule: the removed target's entries are announced too.
    let alerts = Receiver::ok().await;
    write_rules(
        &r,
        "r.yaml",
        &rules_yaml(
            "",
            &[(
                "alerts",
                "router.dlq.added",
                &[format!("webhook: {}", alerts.url())],
            )],
        ),
    );
    let l = eventually(Duration::from_secs(15), || async {
        let (_, l) = get_json(&r, "/v1/dlq?reason=target_removed").await;
        (l["entries"].as_array().map(Vec::len) == Some(10)).then_some(l)
    })
    .await;
    assert!(
        l.is_some(),
        "entries of the removed target did not reach the DLQ as target_removed"
    );
    let announced = |s: &[Received]| -> u64 {
        s.iter()
            .filter(|a| a.body["data"]["reason"] == "target_removed")
            .filter_map(|a| a.body["data"]["count"].as_u64())
            .sum()
    };
    assert!(
        alerts
            .wait_for(Duration::from_secs(15), |s| announced(s) == 10)
            .await,
        "router.dlq.added did not announce the 10 entries: {:?}",
        alerts
            .received()
            .iter()
            .map(|a| a.body.clone())
            .collect::<Vec<_>>()
    );
    // A redrive does not send them back to the removed target (its worker still runs here,
    // under the configuration it was removed with): they stay, saying why.
    let (s, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"reason": "target_removed"}, "rate_per_sec": 1000}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = eventually(Duration::from_secs(15), || async {
        let (_, j) = get_json(&r, &format!("/v1/dlq/redrive/{id}")).await;
        (j["state"] == "done").then_some(j)
    })
    .await
    .expect("the redrive ends");
    assert_eq!(
        (done["moved"].clone(), done["failed"].clone()),
        (json!(0), json!(10)),
        "{done}"
    );
    let (_, after) = get_json(&r, "/v1/dlq?reason=target_removed").await;
    assert_eq!(
        after["entries"].as_array().map(Vec::len),
        Some(10),
        "{after}"
    );
    let listed = l.expect("listed");
    let (kept, before) = (&after["entries"][0], &listed["entries"][0]);
    assert!(
        kept["not_redriven"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no longer in the rules")),
        "{kept}"
    );
    assert_eq!(kept["not_redriven"]["job"], id.as_str(), "{kept}");
    // The failure's own error and the redrive count stay: it was not redriven.
    assert_eq!(kept["errors"], before["errors"], "{kept}");
    assert_eq!(kept["redrive_count"], 0, "{kept}");
    r.kill9();
}

/// A router with no contracts and one rule sending events of type `t` to `rcv`.
fn routing_t_to(rcv: &Receiver) -> RouterProc {
    RouterProc::start(
        &[(
            "r.yaml",
            &rules_yaml("", &[("r", "t", &[format!("webhook: {}", rcv.url())])]),
        )],
        &[],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contracts_reload_and_an_invalid_schema_is_refused() {
    let rcv = Receiver::ok().await;
    let r = routing_t_to(&rcv);
    assert_eq!(
        post_event(&r, &event("free", "t", json!({"x": 1}))).await.1["results"][0]["status"],
        "accepted"
    );
    write_contract(&r, "t/v1.json", r#"{"type": "object", "required": ["y"]}"#);
    let ok = eventually(Duration::from_secs(10), || async {
        let (_, b) = post_event(
            &r,
            &event(&format!("c{}", rand_suffix()), "t", json!({"x": 1})),
        )
        .await;
        (b["results"][0]["status"] == "quarantined").then_some(())
    })
    .await;
    assert!(ok.is_some(), "the new contract never applied");
    write_contract(
        &r,
        "t/v2.json",
        r#"{"type": "object", "properties": {"y": {"type": "nope"}}}"#,
    );
    let err = eventually(Duration::from_secs(10), || async {
        status(&r).await["reload"]["last_error"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert!(
        err.is_some_and(|e| e.contains("v2.json")),
        "invalid schema not reported"
    );
    // v1 still enforced.
    let (_, b) = post_event(&r, &event("still", "t", json!({"x": 1}))).await;
    assert_eq!(b["results"][0]["status"], "quarantined");
}

/// `PUT /v1/contracts/{type}/{version}` writes the file into the watched directory and the
/// contract applies to the very next event; when the directory will not reload (here a broken
/// contract file beside it), the upload is refused and leaves the directory as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploaded_contract_applies_at_once_and_a_refused_one_changes_nothing() {
    let rcv = Receiver::ok().await;
    let r = routing_t_to(&rcv);
    let v1 = json!({"type": "object", "required": ["y"]});
    let (code, body) = put_json(&r, "/v1/contracts/t/v1", v1.clone()).await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["compared_with"], Value::Null, "{body}");
    let (_, b) = post_event(&r, &event("after-upload", "t", json!({"x": 1}))).await;
    assert_eq!(b["results"][0]["status"], "quarantined", "{b}");
    let dir = r.dir.path().join("contracts/t");
    let on_disk: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("v1.json")).expect("the uploaded file"),
    )
    .expect("JSON");
    assert_eq!(on_disk, v1);

    // Another contract file broken in the directory: the contracts would not reload.
    write_contract(&r, "z/v1.json", "{ not json");
    let err = eventually(Duration::from_secs(10), || async {
        status(&r).await["reload"]["last_error"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert!(err.is_some(), "the broken contract file was not noticed");
    let (code, body) = put_json(&r, "/v1/contracts/t/v2", json!({"type": "object"})).await;
    assert_eq!(code, 409, "{body}");
    assert!(
        body["errors"].to_string().contains("z/v1.json"),
        "the answer names what would not reload: {body}"
    );
    let left: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        left,
        vec!["v1.json".to_string()],
        "the directory is as it was"
    );
    let (code, _) = get_json(&r, "/v1/contracts/t/v2").await;
    assert_eq!(code, 404);
    let (_, b) = post_event(&r, &event("still-v1", "t", json!({"x": 1}))).await;
    assert_eq!(
        b["results"][0]["status"], "quarantined",
        "v1 still applies: {b}"
    );
}

/// A version put between two live ones is compared with both neighbours: the answer says what
/// it breaks from the one before and what the one after it breaks, so a gap filled late cannot
/// silently make the chain incompatible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_put_between_two_versions_is_compared_with_the_next_one_too() {
    let rcv = Receiver::ok().await;
    let r = routing_t_to(&rcv);
    let (code, body) = put_json(&r, "/v1/contracts/t/v1", json!({"type": "object"})).await;
    assert_eq!(code, 201, "{body}");
    let v3 = json!({"type": "object", "required": ["y"], "properties": {"y": {"type": "integer"}}});
    let (code, body) = put_json(&r, "/v1/contracts/t/v3", v3).await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["compared_with"], "v1", "{body}");
    assert_eq!(body.get("next_version"), None, "v3 is the last: {body}");

    let v2 = json!({"type": "object", "properties": {"z": {"type": "string"}}});
    let (code, body) = put_json(&r, "/v1/contracts/t/v2", v2).await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["compared_with"], "v1", "{body}");
    assert_eq!(
        body["breaking_changes"],
        json!([]),
        "an optional field: {body}"
    );
    assert_eq!(body["next_version"], "v3", "{body}");
    let next = body["next_breaking_changes"].to_string();
    assert!(
        next.contains("required") && next.contains('y'),
        "v3 requires y, which v2 does not: {body}"
    );
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// 100 reloads while events flow: every event's fate names the rule-set version it matched,
/// and that version is one that actually routed it to the target it reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_reloads_under_load() {
    let a = Receiver::ok().await;
    let b = Receiver::ok().await;
    let rules_for = |n: usize| {
        let (id, url) = if n.is_multiple_of(2) {
            ("a", a.url())
        } else {
            ("b", b.url())
        };
        rules_yaml(
            "",
            &[(
                &format!("gen-{n}"),
                "t",
                &[format!("webhook: {url}\n        id: {id}")],
            )],
        )
    };
    let r = RouterProc::start(&[("r.yaml", &rules_for(0))], &[]);
    let url = r.url("/v1/events");
    let loader = tokio::spawn(async move {
        let c = client();
        let mut n = 0;
        for i in 0..600 {
            let body = event(&format!("l{i}"), "t", json!({})).to_string();
            if let Ok(resp) = c
                .post(&url)
                .header("content-type", "application/cloudevents+json")
                .body(body)
                .send()
                .await
                && resp.status().as_u16() == 202
            {
                n += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        n
    });
    let mut versions = std::collections::HashMap::new();
    for n in 1..=100 {
        write_rules(&r, "r.yaml", &rules_for(n));
        let resp = client()
            .post(r.url("/v1/admin/reload"))
            .send()
            .await
            .expect("reload");
        let rep: Value = resp.json().await.expect("json");
        versions.insert(rep["rules_version"].as_str().unwrap_or("").to_string(), n);
    }
    let sent = loader.await.expect("loader");
    assert_eq!(sent, 600);
    assert!(
        eventually(Duration::from_secs(30), || async {
            (a.distinct_ids().len() + b.distinct_ids().len() >= 600).then_some(())
        })
        .await
        .is_some(),
        "not every event was delivered"
    );
    let (got_a, got_b) = (a.distinct_ids(), b.distinct_ids());
    for i in (0..600).step_by(7) {
        let id = format!("l{i}");
        let f = fate(&r, &id).await;
        let v = f["ruleset_version"].as_str().unwrap_or("").to_string();
        let rule = f["matched_rules"][0].as_str().unwrap_or("").to_string();
        let n: usize = rule.trim_start_matches("gen-").parse().expect("rule name");
        // The version names a set whose only rule is the one that matched.
        if let Some(vn) = versions.get(&v) {
            assert_eq!(
                *vn, n,
                "{id}: version {v} is generation {vn} but matched gen-{n}"
            );
        }
        let went_to_a = got_a.contains(&id);
        assert_eq!(
            went_to_a,
            n.is_multiple_of(2),
            "{id} matched gen-{n} but reached the other target"
        );
        assert!(
            got_a.contains(&id) != got_b.contains(&id),
            "{id} reached both or neither"
        );
    }
}

/// A removed target brought back by the next reload (a quick revert, a rule moved between two
/// files in two saves) is live again: with `on_target_removed = "dead_letter"`, the loop that
/// moves what comes back from attempts in flight stops, and new events for it are delivered,
/// not dead-lettered as `target_removed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_removed_and_put_back_delivers_its_new_events() {
    // The first request is held 3 s: an attempt in flight keeps the removal's loop going.
    let rcv = Receiver::scripted(Arc::new(|_, n| {
        (
            200,
            Duration::from_millis(if n == 0 { 3000 } else { 0 }),
            vec![],
        )
    }))
    .await;
    let policy = "  one:\n    timeout: 10s\n    throttle: { max_concurrency: 1 }";
    let rules = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {}\n        id: h\n        policy: one",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_DELIVERY__ON_TARGET_REMOVED", "dead_letter")],
    );
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    write_rules(&r, "r.yaml", "rules: []\n");
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    write_rules(&r, "r.yaml", &rules);
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    for id in ["e2", "e3"] {
        assert_eq!(post_event(&r, &event(id, "t", json!({}))).await.0, 202);
    }
    let all = |s: &[Received]| {
        let ids: HashSet<String> = s.iter().map(Received::event_id).collect();
        ["e1", "e2", "e3"].iter().all(|i| ids.contains(*i))
    };
    assert!(
        rcv.wait_for(Duration::from_secs(20), all).await,
        "received {:?}",
        rcv.received()
            .iter()
            .map(Received::event_id)
            .collect::<Vec<_>>()
    );
    let (_, l) = get_json(&r, "/v1/dlq").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(0), "{l}");
}

/// Rule `r`: events of type `t` to one webhook at `url` that retries for a long while (50
/// attempts, 1 s apart), with the target's other lines (`id: …`) as given.
fn retrying_rule(url: &str, target: &str) -> String {
    rules_yaml(
        "  p:\n    retry: { max_attempts: 50, base_delay: 1s, max_delay: 1s }",
        &[(
            "r",
            "t",
            &[format!(
                "webhook: {url}\n        {target}\n        policy: p"
            )],
        )],
    )
}

/// Sends `n` events `{prefix}{i}` to the router's only rule, waits until `never` has seen an
/// attempt of each, kills the router, empties its rules (and does `meanwhile`), and restarts it.
async fn removed_while_down(
    r: &mut RouterProc,
    never: &Receiver,
    prefix: &str,
    n: usize,
    meanwhile: impl FnOnce(),
) {
    post_batch(
        r,
        &(0..n)
            .map(|i| event(&format!("{prefix}{i}"), "t", json!({})))
            .collect::<Vec<_>>(),
    )
    .await;
    assert!(
        never
            .wait_for(Duration::from_secs(10), |s| s.len() >= n)
            .await
    );
    r.kill9();
    write_rules(r, "r.yaml", "rules: []\n");
    meanwhile();
    r.restart();
}

/// The DLQ's `target_removed` entries once there are `n` of them (`None` after 15 s).
async fn target_removed_entries(r: &RouterProc, n: usize) -> Option<Value> {
    eventually(Duration::from_secs(15), || async {
        let (_, l) = get_json(r, "/v1/dlq?reason=target_removed").await;
        (l["entries"].as_array().map(Vec::len) == Some(n)).then_some(l)
    })
    .await
}

/// `on_target_removed = "dead_letter"` holds for a target removed while the router was down:
/// at start its queue goes to the DLQ as `target_removed`, instead of draining to the
/// endpoint the rules no longer name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_removed_while_down_is_dead_lettered_at_start_when_so_configured() {
    let never = Receiver::status(503).await;
    let rules = retrying_rule(&never.url(), "id: gone");
    let mut r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_DELIVERY__ON_TARGET_REMOVED", "dead_letter")],
    );
    removed_while_down(&mut r, &never, "w", 5, || {}).await;
    let l = target_removed_entries(&r, 5).await;
    assert!(
        l.is_some(),
        "the removed target's queue was not dead-lettered at start"
    );
    let seen = never.count();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        never.count(),
        seen,
        "the removed target kept being attempted"
    );
    let st = status(&r).await;
    assert!(
        st["warnings"].to_string().contains("target_removed"),
        "{st}"
    );
}

/// A start on a rules directory that is not there (a typo in `--rules`, a volume not
/// mounted) or that holds no rule file while entries wait is refused, as a reload refuses it:
/// it used to count as "no rules", and every queue was treated as removed (dead-lettered
/// as `target_removed` with `on_target_removed = "dead_letter"`, and every new event accepted
/// and routed nowhere while `/readyz` said ready). A configured contracts directory that is not
/// there stops the start too. A file that says `rules: []` removes them on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_emptied_rules_directory_at_start_stops_the_router() {
    let never = Receiver::status(503).await;
    let rules = retrying_rule(&never.url(), "id: kept");
    let mut r = RouterProc::start_with_env(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_DELIVERY__ON_TARGET_REMOVED", "dead_letter")],
    );
    post_batch(&r, &[event("m1", "t", json!({}))]).await;
    assert!(
        never
            .wait_for(Duration::from_secs(10), |s| !s.is_empty())
            .await
    );
    r.kill9();
    let (rules_dir, contracts_dir) = (r.dir.path().join("rules"), r.dir.path().join("contracts"));

    let (code, err) = r.serve_refused(&r.dir.path().join("rulez"), &contracts_dir);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("rules directory") && err.contains("rulez") && err.contains("does not exist"),
        "{err}"
    );
    let (code, err) = r.serve_refused(&rules_dir, &r.dir.path().join("contractz"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("contracts directory") && err.contains("contractz"),
        "{err}"
    );
    std::fs::remove_file(rules_dir.join("r.yaml")).expect("empty the rules directory");
    let (code, err) = r.serve_refused(&rules_dir, &contracts_dir);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("holds no rule file") && err.contains("kept") && err.contains("rules: []"),
        "{err}"
    );

    // The rules back: nothing was dead-lettered meanwhile, and the entry is still retried.
    write_rules(&r, "r.yaml", &rules);
    r.restart();
    let (_, l) = get_json(&r, "/v1/dlq").await;
    assert_eq!(l["entries"].as_array().map(Vec::len), Some(0), "{l}");
    let seen = never.count();
    assert!(
        never
            .wait_for(Duration::from_secs(10), |s| s.len() > seen)
            .await,
        "the entry is no longer retried"
    );
    // `rules: []` says it: the target is removed, as configured.
    r.kill9();
    write_rules(&r, "r.yaml", "rules: []\n");
    r.restart();
    assert!(
        target_removed_entries(&r, 1).await.is_some(),
        "the removed target's entry was not dead-lettered"
    );
}

/// A removed target whose last configuration cannot start any more (its signing secret was
/// taken out of the secrets file too) does not strand its queue: at start its entries go to
/// the DLQ as `target_removed`, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_that_cannot_start_dead_letters_its_queue_saying_why() {
    let never = Receiver::status(503).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let secrets = dir.path().join("secrets.toml");
    std::fs::write(
        &secrets,
        "E2E_GONE_SECRET = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n",
    )
    .expect("secrets");
    let config = format!("secrets_file = {:?}\n", secrets.display().to_string());
    let rules = retrying_rule(
        &never.url(),
        "id: signed\n        secret_env: E2E_GONE_SECRET",
    );
    let mut r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
    removed_while_down(&mut r, &never, "s", 3, || {
        std::fs::write(&secrets, "").expect("secret removed")
    })
    .await;
    let l = target_removed_entries(&r, 3)
        .await
        .expect("the removed target's queue was stranded");
    let errors = l["entries"][0]["errors"].to_string();
    assert!(
        errors.contains("cannot start") && errors.contains("E2E_GONE_SECRET"),
        "{errors}"
    );
    let (_, t) = get_json(&r, "/v1/targets/signed").await;
    assert_eq!(t["queued"].as_u64().unwrap_or(0), 0, "{t}");
}

/// Targets without explicit ids are numbered by position: removing the first of a rule's two
/// targets would have the second's id name the first's queue, and deliver its waiting events
/// to the wrong receiver. That reload is refused while they wait; a URL edited in place is
/// not a move, and the waiting entries go to the new URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_moves_a_queue_to_another_targets_destination_is_refused() {
    let a = Receiver::status(503).await;
    let b = Receiver::ok().await;
    let c = Receiver::ok().await;
    let policy = "  slow:\n    retry: { max_attempts: 50, base_delay: 500ms, max_delay: 500ms }";
    let both = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[
                format!("webhook: {}\n        policy: slow", a.url()),
                format!("webhook: {}\n        policy: slow", b.url()),
            ],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &both)], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    assert!(a.wait_for(Duration::from_secs(10), |s| !s.is_empty()).await);
    // Without a's target, b's becomes r-0, the id of a's waiting entry.
    let only_b = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[format!("webhook: {}\n        policy: slow", b.url())],
        )],
    );
    write_rules(&r, "r.yaml", &only_b);
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(
        err.contains("target r-0") && err.contains("explicit ids"),
        "{err}"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(b.count(), 1, "b received a's waiting event");
    // The same position with a new URL no target had: a's entry goes there.
    let moved = rules_yaml(
        policy,
        &[(
            "r",
            "t",
            &[
                format!("webhook: {}\n        policy: slow", c.url()),
                format!("webhook: {}\n        policy: slow", b.url()),
            ],
        )],
    );
    write_rules(&r, "r.yaml", &moved);
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert!(c.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    assert_eq!(b.count(), 1);
}

/// An id that would move with only dead letters is refused too: a redrive of them would
/// deliver to the neighbour that took the id (it was let through when no entry was queued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_moves_dead_letters_to_another_targets_destination_is_refused() {
    let a = Receiver::status(400).await;
    let b = Receiver::ok().await;
    let both = rules_yaml(
        "",
        &[(
            "r",
            "t",
            &[
                format!("webhook: {}", a.url()),
                format!("webhook: {}", b.url()),
            ],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &both)], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    eventually(Duration::from_secs(10), || async {
        let (_, dlq) = get_json(&r, "/v1/dlq?target=r-0").await;
        (dlq["entries"].as_array().map_or(0, Vec::len) == 1).then_some(())
    })
    .await
    .expect("a's event is a dead letter of r-0");
    write_rules(
        &r,
        "r.yaml",
        &rules_yaml("", &[("r", "t", &[format!("webhook: {}", b.url())])]),
    );
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(
        err.contains("target r-0") && err.contains("1 dead letters"),
        "{err}"
    );
}

/// A rules directory emptied of rule files (a checkout or sync caught half-way) does not take
/// every rule away; a file saying `rules: []` does, on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_rules_directory_is_refused_and_rules_empty_is_not() {
    let a = Receiver::ok().await;
    let r = routing_t_to(&a);
    std::fs::remove_file(r.dir.path().join("rules/r.yaml")).expect("remove the rule file");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    assert!(body.to_string().contains("holds no rule file"), "{body}");
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(1), "{rules}");
    write_rules(&r, "r.yaml", "rules: []\n");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(0), "{rules}");
}

/// An operator's switch on a rule renamed since is listed (it would stop a rule of that name
/// that came back) and can be cleared while no rule has the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_left_on_a_renamed_rule_is_listed_and_can_be_cleared() {
    let a = Receiver::ok().await;
    let r = routing_t_to(&a);
    assert_eq!(post_json(&r, "/v1/rules/r/disable", json!({})).await.0, 200);
    write_rules(
        &r,
        "r.yaml",
        &rules_yaml("", &[("r2", "t", &[format!("webhook: {}", a.url())])]),
    );
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["disabled_absent"], json!(["r"]), "{rules}");
    assert_eq!(post_json(&r, "/v1/rules/r/disable", json!({})).await.0, 404);
    let (s, body) = post_json(&r, "/v1/rules/r/enable", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["disabled_absent"], json!([]), "{rules}");
    assert_eq!(post_json(&r, "/v1/rules/r/enable", json!({})).await.0, 404);
}

/// Rules and contracts reload apart: with a broken rule file in the directory, a contract
/// uploaded over the API and one dropped into the directory both go live (the upload says the
/// rules were refused), while the previous rules stay live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_rule_file_does_not_hold_contract_changes_back() {
    let a = Receiver::ok().await;
    let r = routing_t_to(&a);
    write_rules(
        &r,
        "broken.yaml",
        "rules: [ {name: x, pattern: {type: [u]}\n",
    );
    let (s, body) = put_json(
        &r,
        "/v1/contracts/t/v1",
        json!({"type": "object", "required": ["n"]}),
    )
    .await;
    assert_eq!(s, 201, "{body}");
    assert!(
        body["rules_error"]
            .as_str()
            .is_some_and(|e| e.contains("broken.yaml")),
        "{body}"
    );
    let (_, b) = post_event(&r, &event("no-n", "t", json!({}))).await;
    assert_eq!(
        b["results"][0]["status"], "quarantined",
        "the contract is live: {b}"
    );
    // One dropped into the directory goes live with the next reload too.
    write_contract(&r, "u/v1.json", r#"{"type": "object", "required": ["m"]}"#);
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    assert!(
        body.to_string().contains("contracts reload apart"),
        "{body}"
    );
    let (_, list) = get_json(&r, "/v1/contracts").await;
    assert!(list.to_string().contains("\"u\""), "{list}");
    let st = status(&r).await;
    assert!(
        st["reload"]["last_error"]
            .to_string()
            .contains("broken.yaml"),
        "{st}"
    );
    let (_, rules) = get_json(&r, "/v1/rules").await;
    assert_eq!(rules["rules"].as_array().map(Vec::len), Some(1), "{rules}");
    assert_eq!(
        post_event(&r, &event("ok", "t", json!({"n": 1}))).await.0,
        202
    );
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
}

/// `/v1/rules` names the commit of the checkout the live set came from. Committing an edit
/// changes only `.git/`, which the watcher ignores: the commit noted at the edit's reload
/// (`<old>-dirty`) stayed until some unrelated reload. It is read again while the files are
/// still the live set's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_commit_follows_a_commit_of_the_live_files() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[],
    );
    let dir = r.dir.path().join("rules");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&dir)
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(args)
            .output()
            .expect("git runs");
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    git(&["init", "-q"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "first"]);
    let first = git(&["rev-parse", "HEAD"]);
    let commit = || async { get_json(&r, "/v1/rules").await.1["git_commit"].clone() };
    assert_eq!(commit().await, first.as_str());

    let v1 = status(&r).await["rules"]["version"]
        .as_str()
        .expect("version")
        .to_string();
    write_rules(&r, "r.yaml", &webhook_rule("to-a2", "t", &a.url(), "a"));
    wait_version_change(&r, &v1).await;
    assert_eq!(commit().await, format!("{first}-dirty").as_str());
    git(&["commit", "-q", "-am", "second"]);
    let second = git(&["rev-parse", "HEAD"]);
    assert_ne!(first, second);
    assert_eq!(
        commit().await,
        second.as_str(),
        "the commit, not the stale -dirty"
    );
}

/// Rule `r` with targets `r-0` (to `a`, retried slowly) and `r-1` (to `b`), or `b`'s alone
/// (which then takes the id `r-0`).
fn two_then_one(a: &Receiver, b: &Receiver, both: bool) -> String {
    let policy = "  slow:\n    retry: { max_attempts: 50, base_delay: 500ms, max_delay: 500ms }";
    let mut targets = Vec::new();
    if both {
        targets.push(format!("webhook: {}\n        policy: slow", a.url()));
    }
    targets.push(format!("webhook: {}\n        policy: slow", b.url()));
    rules_yaml(policy, &[("r", "t", &targets)])
}

/// A restart on files that move an id with queued entries to another target's destination
/// (a deploy that drops a rule's first target) is refused as the reload is, naming the
/// target, its file and line and what to do: it used to overwrite the id's saved
/// configuration and deliver the first target's queue to the second's receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_moves_a_queue_to_another_targets_destination_is_refused() {
    let a = Receiver::status(503).await;
    let b = Receiver::ok().await;
    let mut r = RouterProc::start(&[("r.yaml", &two_then_one(&a, &b, true))], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    assert!(a.wait_for(Duration::from_secs(10), |s| !s.is_empty()).await);
    // b's delivery acked before the kill: an ack the kill cut off is sent again after the
    // restart (at least once), which is not the move this test looks for.
    eventually(Duration::from_secs(10), || async {
        let f = fate(&r, "e1").await;
        f["targets"]
            .as_array()?
            .iter()
            .any(|t| t["target"] == "r-1" && t["state"] == "delivered")
            .then_some(())
    })
    .await
    .expect("b's delivery recorded");
    r.kill9();
    write_rules(&r, "r.yaml", &two_then_one(&a, &b, false));
    let (rules_dir, contracts_dir) = (r.dir.path().join("rules"), r.dir.path().join("contracts"));
    let (code, err) = r.serve_refused(&rules_dir, &contracts_dir);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("target r-0 (r.yaml:")
            && err.contains("1 entries wait for webhook")
            && err.contains("explicit ids"),
        "{err}"
    );
    // The previous files back: a's entry is still a's, and b never saw it.
    write_rules(&r, "r.yaml", &two_then_one(&a, &b, true));
    r.restart();
    let seen = a.count();
    assert!(
        a.wait_for(Duration::from_secs(10), |s| s.len() > seen)
            .await,
        "a's entry is no longer retried to a"
    );
    assert_eq!(b.count(), 1, "b received a's waiting event");
}

/// The move is refused when it comes in two reloads too (the file removed, then put back
/// with the first target dropped): the check compares with what the store knows of the id
/// (its saved configuration while it has dead letters), not only with the live set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_in_two_reloads_is_refused_too() {
    let a = Receiver::status(400).await;
    let b = Receiver::ok().await;
    let other = Receiver::ok().await;
    let r = RouterProc::start(
        &[
            ("r.yaml", &two_then_one(&a, &b, true)),
            ("other.yaml", &webhook_rule("o", "o", &other.url(), "o")),
        ],
        &[],
    );
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(b.wait_for(Duration::from_secs(10), |s| s.len() == 1).await);
    eventually(Duration::from_secs(10), || async {
        let (_, dlq) = get_json(&r, "/v1/dlq?target=r-0").await;
        (dlq["entries"].as_array().map_or(0, Vec::len) == 1).then_some(())
    })
    .await
    .expect("a's event is a dead letter of r-0");
    std::fs::remove_file(r.dir.path().join("rules/r.yaml")).expect("remove r.yaml");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    write_rules(&r, "r.yaml", &two_then_one(&a, &b, false));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(
        err.contains("target r-0") && err.contains("1 dead letters"),
        "{err}"
    );
}

/// A target removed from the rules is forgotten once drained: its worker stops, and its
/// `/v1/targets` row and its paused, breaker and queue series go (an alert on an open breaker
/// of a target long gone never cleared). Its dead letters stay: `router_dlq_depth`, `/v1/dlq`
/// and `/v1/targets/{id}` still show them. Put back, it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_target_is_forgotten_once_drained_but_its_dead_letters_stay() {
    let down = Receiver::status(500).await;
    let other = Receiver::ok().await;
    let policy = "  p:\n    retry: { max_attempts: 1 }\n    breaker: { failure_rate: 0.5, min_requests: 3, window: 30s, open_for: 600s }";
    let d = rules_yaml(
        policy,
        &[(
            "rd",
            "t.d",
            &[format!(
                "webhook: {}\n        id: d\n        policy: p",
                down.url()
            )],
        )],
    );
    let r = RouterProc::start(
        &[
            ("d.yaml", &d),
            ("other.yaml", &webhook_rule("o", "o", &other.url(), "o")),
        ],
        &[],
    );
    for i in 0..3 {
        assert_eq!(
            post_event(&r, &event(&format!("d{i}"), "t.d", json!({})))
                .await
                .0,
            202
        );
    }
    eventually(Duration::from_secs(15), || async {
        let (_, t) = get_json(&r, "/v1/targets/d").await;
        (t["dlq"] == 3 && t["breaker"]["state"] == "open").then_some(())
    })
    .await
    .expect("d has 3 dead letters and its breaker open");
    assert!(
        metrics_text(&r)
            .await
            .contains("router_breaker_state{target=\"d\"} 1")
    );

    std::fs::remove_file(r.dir.path().join("rules/d.yaml")).expect("remove d.yaml");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let listed = || async {
        let (_, l) = get_json(&r, "/v1/targets").await;
        l["targets"]
            .as_array()
            .is_some_and(|a| a.iter().any(|t| t["id"] == "d"))
    };
    eventually(Duration::from_secs(10), || async {
        (!listed().await).then_some(())
    })
    .await
    .expect("the removed, drained target is still listed in /v1/targets");
    let m = metrics_text(&r).await;
    for gone in [
        "router_breaker_state{target=\"d\"}",
        "router_target_paused{target=\"d\"}",
        "router_queue_depth{target=\"d\"}",
        "router_queue_in_flight{target=\"d\"}",
    ] {
        assert!(!m.contains(gone), "{gone} still in:\n{m}");
    }
    assert!(m.contains("router_dlq_depth{target=\"d\"} 3"), "{m}");
    let (s, t) = get_json(&r, "/v1/targets/d").await;
    assert_eq!((s, t["dlq"].as_u64()), (200, Some(3)), "{t}");
    assert!(
        t["worker"]
            .as_str()
            .is_some_and(|w| w.starts_with("not running")),
        "{t}"
    );

    // Put back: its worker runs again (under its saved breaker state).
    write_rules(&r, "d.yaml", &d);
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert!(listed().await);
    assert!(
        metrics_text(&r)
            .await
            .contains("router_target_paused{target=\"d\"} 0")
    );
}

/// `/v1/status` shows the same commit as `/v1/rules`: a commit of the live files shows
/// there within a few seconds (it stayed `<old>-dirty` until someone read `/v1/rules`), and an
/// editor's swap file beside the rules (which the loader skips) does not make it `-dirty`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_commit_follows_a_commit_and_ignores_swap_files() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(
        &[("r.yaml", &webhook_rule("to-a", "t", &a.url(), "a"))],
        &[],
    );
    let dir = r.dir.path().join("rules");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&dir)
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(args)
            .output()
            .expect("git runs");
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    git(&["init", "-q"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "first"]);
    let first = git(&["rev-parse", "HEAD"]);
    let status_commit = |want: String| {
        let r = &r;
        async move {
            eventually(Duration::from_secs(10), || async {
                let c = status(r).await["reload"]["rules_git_commit"].clone();
                (c == want.as_str()).then_some(())
            })
            .await
            .is_some()
        }
    };
    assert!(status_commit(first.clone()).await, "{}", status(&r).await);
    std::fs::write(dir.join(".r.yaml.swp"), "swap").expect("swap file");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        status(&r).await["reload"]["rules_git_commit"],
        first.as_str(),
        "a swap file made the live set dirty"
    );
    let v1 = status(&r).await["rules"]["version"]
        .as_str()
        .expect("version")
        .to_string();
    write_rules(&r, "r.yaml", &webhook_rule("to-a2", "t", &a.url(), "a"));
    wait_version_change(&r, &v1).await;
    assert!(status_commit(format!("{first}-dirty")).await);
    git(&["commit", "-q", "-am", "second"]);
    let second = git(&["rev-parse", "HEAD"]);
    assert!(
        status_commit(second).await,
        "the status kept the stale commit: {}",
        status(&r).await
    );
}

/// A removed target that is paused is listed in `/v1/status` as paused, waiting for a
/// resume: it said its entries drained, and the operator waited for a drain that never came.
/// Resumed, it drains, and the warning goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_a_removed_paused_target_waits_for_a_resume() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(&[("r.yaml", &webhook_rule("r", "t", &a.url(), "p"))], &[]);
    let (s, body) = post_json(&r, "/v1/targets/p/pause", json!({})).await;
    assert_eq!(s, 200, "{body}");
    post_batch(
        &r,
        &(0..3)
            .map(|i| event(&format!("p{i}"), "t", json!({})))
            .collect::<Vec<_>>(),
    )
    .await;
    write_rules(&r, "r.yaml", "rules: []\n");
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let warnings = status(&r).await["warnings"].to_string();
    assert!(
        warnings.contains("target p is no longer in the rules and is paused")
            && warnings.contains("/v1/targets/p/resume")
            && !warnings.contains("entries drain under"),
        "{warnings}"
    );
    // Still paused a few seconds later: not forgotten while entries wait.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(a.count(), 0);
    let (s, body) = post_json(&r, "/v1/targets/p/resume", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert!(a.wait_for(Duration::from_secs(10), |s| s.len() == 3).await);
    let gone = eventually(Duration::from_secs(15), || async {
        let w = status(&r).await["warnings"].to_string();
        (!w.contains("target p ")).then_some(())
    })
    .await;
    assert!(gone.is_some(), "{}", status(&r).await["warnings"]);
}

/// A reload that revokes or breaks the secret of a running target (its rule unchanged) is
/// refused like one whose target cannot start: the old worker goes on with the secrets it
/// started with, `/v1/status` and the metrics show the refusal, and the message names a
/// `headers_env` credential as a header, not a signing secret. It used to answer 200 with a
/// warning that the target "still has no worker" while that worker kept sending the revoked
/// credential, and a restart on the same files would not start the target at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_breaks_a_running_targets_secret_is_refused_and_the_worker_goes_on() {
    let rcv = Receiver::ok().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let secrets = dir.path().join("secrets.toml");
    let write_secrets = |signing: &str, auth: Option<&str>| {
        let mut text = format!("E2E_LIVE_SECRET = \"{signing}\"\n");
        if let Some(auth) = auth {
            text.push_str(&format!("E2E_LIVE_AUTH = \"{auth}\"\n"));
        }
        std::fs::write(&secrets, text).expect("secrets");
    };
    let key = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    write_secrets(key, Some("Bearer old-token"));
    let config = format!("secrets_file = {:?}\n", secrets.display().to_string());
    let rules = rules_yaml(
        "",
        &[(
            "signed",
            "t",
            &[format!(
                "webhook: {}\n        id: signed\n        secret_env: E2E_LIVE_SECRET\n        headers_env: {{ Authorization: E2E_LIVE_AUTH }}",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
    let delivered = |n: usize| rcv.wait_for(Duration::from_secs(10), move |s| s.len() == n);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    assert!(delivered(1).await);

    // A placeholder signing secret, then the credential revoked: each reload is refused.
    for (signing, auth, names) in [
        (
            "changeme",
            Some("Bearer old-token"),
            "signing secret E2E_LIVE_SECRET",
        ),
        (
            key,
            None,
            "header Authorization from E2E_LIVE_AUTH (headers_env)",
        ),
    ] {
        write_secrets(signing, auth);
        let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
        assert_eq!(s, 422, "{body}");
        let err = status(&r).await["reload"]["last_error"].to_string();
        assert!(
            err.contains("target signed")
                && err.contains(names)
                && err.contains("its worker goes on with the secrets it started with"),
            "{err}"
        );
        assert!(!err.contains("signing secret E2E_LIVE_AUTH"), "{err}");
    }
    let st = status(&r).await;
    assert_eq!(st["reload"]["failed_reloads"], 2, "{st}");
    let m = metrics_text(&r).await;
    assert_eq!(
        counter(&m, "router_reloads_total{result=\"error\"}"),
        2,
        "{}",
        metric_lines(&m, "reload")
    );
    assert!(
        m.contains("router_reload_failing 1"),
        "{}",
        metric_lines(&m, "reload")
    );
    // The worker runs on, with the secrets it started with (`worker` is set only for a
    // target with none).
    let (_, t) = get_json(&r, "/v1/targets/signed").await;
    assert!(t.get("worker").is_none() && t["delivered"] == 1, "{t}");
    assert_eq!(post_event(&r, &event("e2", "t", json!({}))).await.0, 202);
    assert!(delivered(2).await);
    assert_eq!(
        rcv.received()[1].header("authorization").as_deref(),
        Some("Bearer old-token")
    );

    // Fixed: the reload goes through and rebuilds the target with the new credential.
    write_secrets(key, Some("Bearer new-token"));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["targets_started"], json!(["signed"]), "{body}");
    assert_eq!(status(&r).await["reload"]["last_error"], Value::Null);
    assert_eq!(post_event(&r, &event("e3", "t", json!({}))).await.0, 202);
    assert!(delivered(3).await);
    assert_eq!(
        rcv.received()[2].header("authorization").as_deref(),
        Some("Bearer new-token")
    );
}

/// Each rule counts the events it matched and routed, as EventBridge's `MatchedEvents`:
/// duplicates, unmatched events and matches of a disabled rule do not count; the count and
/// the last match show in `/v1/rules` and `/metrics`, and a rule removed by a reload loses
/// its series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rule_counts_the_events_it_matched_and_a_removed_rule_loses_its_series() {
    let a = Receiver::ok().await;
    let r = RouterProc::start(
        &[(
            "r.yaml",
            &rules_yaml(
                "",
                &[
                    ("r1", "t", &[format!("webhook: {}", a.url())]),
                    ("r2", "u", &[format!("webhook: {}", a.url())]),
                ],
            ),
        )],
        &[],
    );
    for (id, ty) in [
        ("e1", "t"),
        ("e1", "t"),
        ("e2", "t"),
        ("e3", "u"),
        ("e4", "x"),
    ] {
        assert_eq!(post_event(&r, &event(id, ty, json!({}))).await.0, 202);
    }
    post_batch(
        &r,
        &[event("e5", "t", json!({})), event("e6", "t", json!({}))],
    )
    .await;
    assert_eq!(
        post_json(&r, "/v1/rules/r2/disable", json!({})).await.0,
        200
    );
    assert_eq!(post_event(&r, &event("e7", "u", json!({}))).await.0, 202);
    let (_, rules) = get_json(&r, "/v1/rules").await;
    let rule = |name: &str| {
        rules["rules"]
            .as_array()
            .and_then(|rs| rs.iter().find(|x| x["name"] == name))
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(rule("r1")["matched_events"], 4, "{rules}");
    assert_eq!(rule("r2")["matched_events"], 1, "{rules}");
    assert!(rule("r1")["last_matched_at"].is_string(), "{rules}");
    let metrics = metrics_text(&r).await;
    assert_eq!(
        counter(&metrics, "router_rule_matched_events_total{rule=\"r1\"}"),
        4,
        "{}",
        metric_lines(&metrics, "router_rule_matched")
    );
    assert_eq!(
        counter(&metrics, "router_rule_matched_events_total{rule=\"r2\"}"),
        1
    );
    write_rules(
        &r,
        "r.yaml",
        &rules_yaml("", &[("r1", "t", &[format!("webhook: {}", a.url())])]),
    );
    assert_eq!(post_json(&r, "/v1/admin/reload", json!({})).await.0, 200);
    let metrics = metrics_text(&r).await;
    assert!(
        !metrics.contains("router_rule_matched_events_total{rule=\"r2\"}"),
        "{}",
        metric_lines(&metrics, "router_rule_matched")
    );
    assert_eq!(
        counter(&metrics, "router_rule_matched_events_total{rule=\"r1\"}"),
        4
    );
}

/// A receiver answering `status` (503 or 200, switched by the test), with `Retry-After:
/// retry_after` seconds on a 503 when given.
async fn switchable(
    status: &Arc<std::sync::atomic::AtomicU16>,
    retry_after: Option<u32>,
) -> Receiver {
    let status = status.clone();
    Receiver::scripted(Arc::new(move |_, _| {
        let s = status.load(std::sync::atomic::Ordering::SeqCst);
        let headers = match retry_after {
            Some(secs) if s == 503 => vec![("retry-after", secs.to_string())],
            _ => vec![],
        };
        (s, Duration::ZERO, headers)
    }))
    .await
}

const SLOW: &str = "  slow:\n    retry: { max_attempts: 50, base_delay: 500ms, max_delay: 500ms, retry_after_max: 10m }";

/// Rule `payments` with webhooks to `urls`, in order, numbered `payments-0`, ... (day-2
/// audit, finding 1).
fn payments(urls: &[String]) -> String {
    let targets: Vec<String> = urls
        .iter()
        .map(|u| format!("webhook: {u}\n        policy: slow"))
        .collect();
    rules_yaml(SLOW, &[("payments", "t", &targets)])
}

/// A target inserted before a waiting one takes its id: `payments-0` (to `/erp`, entries
/// waiting) would send to the new `/audit`, its queue with it, while `/erp` becomes
/// `payments-1`. The reload took that for a URL edited in place and delivered the waiting
/// entries to the audit receiver; it is refused now, naming both ids and the explicit id that
/// keeps the queue with its receiver, and a start on the same files is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_inserted_before_a_waiting_one_does_not_take_its_queue() {
    let erp = Receiver::status(503).await;
    let audit = Receiver::ok().await;
    let mut r = RouterProc::start(&[("r.yaml", &payments(&[erp.url()]))], &[]);
    assert_eq!(post_event(&r, &event("pay-1", "t", json!({}))).await.0, 202);
    assert!(
        erp.wait_for(Duration::from_secs(10), |s| !s.is_empty())
            .await
    );
    let inserted = payments(&[audit.url(), erp.url()]);
    write_rules(&r, "r.yaml", &inserted);
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 422, "{body}");
    let err = status(&r).await["reload"]["last_error"].to_string();
    assert!(
        err.contains("target payments-0 (r.yaml:")
            && err.contains("is now target payments-1's")
            && err.contains("1 entries wait for webhook")
            && err.contains("`id: payments-0` on the target now numbered payments-1"),
        "{err}"
    );
    // Not one of erp's retries reached the audit receiver meanwhile (two backoffs' worth).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        audit.count(),
        0,
        "the audit receiver got erp's waiting event"
    );
    // The same files at a start: refused, the entry still erp's.
    r.kill9();
    let (rules_dir, contracts_dir) = (r.dir.path().join("rules"), r.dir.path().join("contracts"));
    let (code, err) = r.serve_refused(&rules_dir, &contracts_dir);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is now target payments-1's"), "{err}");
    // The fix the message suggests: the erp target keeps its id, the audit one is new.
    let explicit = rules_yaml(
        SLOW,
        &[(
            "payments",
            "t",
            &[
                format!(
                    "webhook: {}\n        policy: slow\n        id: audit",
                    audit.url()
                ),
                format!(
                    "webhook: {}\n        policy: slow\n        id: payments-0",
                    erp.url()
                ),
            ],
        )],
    );
    write_rules(&r, "r.yaml", &explicit);
    r.restart();
    let seen = erp.count();
    assert!(
        erp.wait_for(Duration::from_secs(10), |s| s.len() > seen)
            .await,
        "erp's entry is no longer retried to erp"
    );
    assert_eq!(
        audit.count(),
        0,
        "the audit receiver got erp's waiting event"
    );
}

/// A pause follows its receiver through a rename: the reload that renames a paused target's
/// rule starts the new id paused, says so in its warnings, and the pause holds across a
/// restart (day-2 audit, finding 3). The new id used to start unpaused: new events went at
/// once to the receiver the operator had paused, ahead of the old id's waiting ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_follows_the_receiver_when_a_reload_renames_the_target() {
    let rcv = Receiver::ok().await;
    let rule = |name: &str| rules_yaml("", &[(name, "t", &[format!("webhook: {}", rcv.url())])]);
    let mut r = RouterProc::start(&[("r.yaml", &rule("erp"))], &[]);
    let (s, body) = post_json(&r, "/v1/targets/erp-0/pause", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(post_event(&r, &event("q1", "t", json!({}))).await.0, 202);
    write_rules(&r, "r.yaml", &rule("orders-to-erp"));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let warnings = body["warnings"].to_string();
    assert!(
        warnings.contains("target orders-to-erp-0 starts paused")
            && warnings.contains("paused target erp-0"),
        "{body}"
    );
    assert_eq!(post_event(&r, &event("q2", "t", json!({}))).await.0, 202);
    let (_, t) = get_json(&r, "/v1/targets/orders-to-erp-0").await;
    assert_eq!(t["paused"], true, "{t}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(rcv.count(), 0, "the paused receiver got an event");
    // Persisted like any pause.
    r.restart();
    let (_, t) = get_json(&r, "/v1/targets/orders-to-erp-0").await;
    assert_eq!(t["paused"], true, "{t}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        rcv.count(),
        0,
        "the paused receiver got an event after a restart"
    );
    for id in ["erp-0", "orders-to-erp-0"] {
        let (s, body) = post_json(&r, &format!("/v1/targets/{id}/resume"), json!({})).await;
        assert_eq!(s, 200, "{body}");
    }
    assert!(
        rcv.wait_for(Duration::from_secs(10), |s| s.len() == 2)
            .await,
        "both events delivered after the resumes"
    );
}

/// With `on_target_removed = "dead_letter"`, a rule renamed (same receiver) sends the old
/// id's queue to the DLQ: the reload answer now says how many and where the destination is
/// live, and a redrive of the old id's dead letters delivers them to the live target with its
/// destination, saying so in the job (day-2 audit, finding 4). They used to stay in the DLQ
/// for good ("no longer in the rules") and the reload said nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_renamed_target_are_redriven_to_its_receiver() {
    let answer = Arc::new(std::sync::atomic::AtomicU16::new(503));
    let erp = switchable(&answer, None).await;
    let rule = |name: &str| {
        rules_yaml(
            SLOW,
            &[(
                name,
                "t",
                &[format!("webhook: {}\n        policy: slow", erp.url())],
            )],
        )
    };
    let r = RouterProc::start_with_env(
        &[("r.yaml", &rule("payments"))],
        &[],
        &[("ROUTER_DELIVERY__ON_TARGET_REMOVED", "dead_letter")],
    );
    for id in ["p1", "p2"] {
        assert_eq!(post_event(&r, &event(id, "t", json!({}))).await.0, 202);
    }
    assert!(
        erp.wait_for(Duration::from_secs(10), |s| s.len() >= 2)
            .await
    );
    write_rules(&r, "r.yaml", &rule("payments-to-erp"));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let warnings = body["warnings"].to_string();
    assert!(
        warnings.contains("target payments-0 is no longer in the rules")
            && warnings.contains("went to the DLQ as target_removed")
            && warnings.contains("is live as target payments-to-erp-0"),
        "{body}"
    );
    let dead = eventually(Duration::from_secs(10), || async {
        let (_, l) = get_json(&r, "/v1/dlq?target=payments-0").await;
        (l["entries"].as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await;
    assert!(
        dead.is_some(),
        "the renamed target's queue is not in the DLQ"
    );
    answer.store(200, std::sync::atomic::Ordering::SeqCst);
    let seen = erp.count();
    let (s, job) = post_json(
        &r,
        "/v1/dlq/redrive",
        json!({"filter": {"target": "payments-0"}, "rate_per_sec": 1000}),
    )
    .await;
    assert_eq!(s, 201, "{job}");
    let id = job["id"].as_str().expect("job id").to_string();
    let done = job_done(
        &r,
        &format!("/v1/dlq/redrive/{id}"),
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(
        (&done["moved"], &done["failed"]),
        (&json!(2), &json!(0)),
        "{done}"
    );
    assert!(
        done["warnings"]
            .to_string()
            .contains("redriven to target payments-to-erp-0"),
        "{done}"
    );
    assert!(
        erp.wait_for(Duration::from_secs(10), |s| {
            s[seen..]
                .iter()
                .filter(|a| a.event_id() == "p1" || a.event_id() == "p2")
                .count()
                == 2
        })
        .await,
        "the redriven dead letters did not reach their receiver"
    );
    eventually(Duration::from_secs(10), || async {
        let f = fate(&r, "p1").await;
        f["targets"]
            .as_array()?
            .iter()
            .any(|t| t["target"] == "payments-to-erp-0" && t["state"] == "delivered")
            .then_some(())
    })
    .await
    .expect("p1 delivered under the live id");
}

/// Waits until target `w` is under its receiver's Retry-After pause.
async fn retry_after_held(r: &RouterProc) {
    eventually(Duration::from_secs(10), || async {
        let (_, t) = get_json(r, "/v1/targets/w").await;
        t["retry_after_until"].as_str().map(str::to_string)
    })
    .await
    .expect("the receiver's Retry-After pause is in effect");
}

/// A webhook switched to another URL (a failover to a backup) no longer waits out the old
/// receiver's Retry-After pause: the reload clears it (and the breaker), and so does a start
/// on files changed while the router was down (day-2 audit, finding 5). The backup used to get
/// nothing for up to `retry_after_max`, under a fate saying its receiver asked to wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_url_does_not_inherit_the_old_receivers_retry_after() {
    let busy = Arc::new(std::sync::atomic::AtomicU16::new(503));
    let primary = switchable(&busy, Some(600)).await;
    let backup = Receiver::ok().await;
    let to = |url: &str| {
        rules_yaml(
            SLOW,
            &[(
                "r",
                "t",
                &[format!(
                    "webhook: {url}\n        policy: slow\n        id: w"
                )],
            )],
        )
    };
    // On a store several nodes share (JetStream), the entry that got the Retry-After waits
    // for it itself (its next attempt time is the hold's end, as documented for a resume):
    // there only the target's hold is cleared, and the events after the switch go at once.
    let own_wait = RouterProc::on_jetstream();
    let got = |b: &Receiver, ids: &[&str]| {
        let b = b.clone();
        let ids: Vec<String> = ids
            .iter()
            .filter(|id| !own_wait || id.ends_with('b'))
            .map(|id| id.to_string())
            .collect();
        async move {
            b.wait_for(Duration::from_secs(10), |s| {
                ids.iter().all(|id| s.iter().any(|a| a.event_id() == *id))
            })
            .await
        }
    };
    let mut r = RouterProc::start(&[("r.yaml", &to(&primary.url()))], &[]);
    assert_eq!(post_event(&r, &event("e1", "t", json!({}))).await.0, 202);
    retry_after_held(&r).await;
    write_rules(&r, "r.yaml", &to(&backup.url()));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    let (_, t) = get_json(&r, "/v1/targets/w").await;
    assert!(t["retry_after_until"].is_null(), "{t}");
    assert_eq!(post_event(&r, &event("e1b", "t", json!({}))).await.0, 202);
    assert!(
        got(&backup, &["e1", "e1b"]).await,
        "the backup got nothing: the old receiver's Retry-After held it"
    );
    // Back to the primary, held again; then switched while the router is down.
    write_rules(&r, "r.yaml", &to(&primary.url()));
    let (s, body) = post_json(&r, "/v1/admin/reload", json!({})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(post_event(&r, &event("e2", "t", json!({}))).await.0, 202);
    retry_after_held(&r).await;
    r.kill9();
    write_rules(&r, "r.yaml", &to(&backup.url()));
    r.restart();
    let (_, t) = get_json(&r, "/v1/targets/w").await;
    assert!(t["retry_after_until"].is_null(), "{t}");
    assert_eq!(post_event(&r, &event("e2b", "t", json!({}))).await.0, 202);
    assert!(
        got(&backup, &["e2", "e2b"]).await,
        "after a start the backup got nothing: the old receiver's Retry-After held it"
    );
}
