//! The operator CLI against a running router that wants bearer tokens: `router dlq`,
//! `router targets`, `router replay`, `router handlers` and `router rules disable|enable` as a
//! person at 3 a.m. runs them, with the token in `ROUTER_TOKEN`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;

/// Runs `router ARGS…` with `ROUTER_TOKEN` set to `token` (or unset); returns (success,
/// stdout, stderr).
async fn run_router(token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_router"));
    cmd.args(args)
        .env_remove("ROUTER_TOKEN")
        .env_remove("ROUTER_API");
    if let Some(t) = token {
        cmd.env("ROUTER_TOKEN", t);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the command finished")
        .expect("run the command");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the API client `router ARGS… --api <router>`, as [`run_router`].
async fn cli(r: &RouterProc, token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let api = r.url("");
    run_router(token, &[args, &["--api", &api]].concat()).await
}

async fn cli_json(r: &RouterProc, args: &[&str]) -> Value {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let (ok, out, err) = cli(r, Some("ops-token"), &with_json).await;
    assert!(ok, "router {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("router {args:?}: {e}: {out}"))
}

/// Rule names and target ids may hold characters a URL gives meaning to (`#`, `?`, `%`): the
/// CLI encodes them as path segments, so containment works on them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_contains_rules_and_targets_whose_names_a_url_would_cut() {
    let rcv = Receiver::ok().await;
    let rules = webhook_rule("orders#v2", "t", &rcv.url(), "erp?eu%1");
    let config = format!(
        "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nscopes = [\"admin\"]\n",
        token_sha256("ops-token")
    );
    let off = "rules:\n  - name: off\n    enabled: false\n    pattern: { type: [u] }\n    targets:\n      - webhook: http://127.0.0.1:9/x\n        id: off-t\n";
    let r = RouterProc::start_full(
        &[("r.yaml", &rules), ("off.yaml", off)],
        &[],
        &[],
        Some(&config),
    );
    // A rule its file turns off cannot be enabled by the switch, and is not said to be.
    let (ok, _, err) = cli(&r, Some("ops-token"), &["rules", "enable", "off"]).await;
    assert!(
        !ok && err.contains("409") && err.contains("enabled: false"),
        "{err}"
    );
    let paused = cli_json(&r, &["targets", "pause", "erp?eu%1"]).await;
    assert_eq!(paused["paused"], true, "{paused}");
    let resumed = cli_json(&r, &["targets", "resume", "erp?eu%1"]).await;
    assert_eq!(resumed["paused"], false, "{resumed}");
    let off = cli_json(&r, &["rules", "disable", "orders#v2"]).await;
    assert_eq!(off["enabled"], false, "{off}");
    // `rules ls` shows both, each with its state.
    let (ok, table, err) = cli(&r, Some("ops-token"), &["rules", "ls"]).await;
    assert!(ok, "{err}");
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        row("orders#v2").contains("disabled (operator: ops, ")
            && row("orders#v2").contains("erp?eu%1"),
        "{table}"
    );
    assert!(row("off ").contains("disabled (file)"), "{table}");
}

/// The DLQ runbook of `docs/operations.md`, by CLI: see the dead letter, contain the target,
/// fix the receiver, redrive, resume; plus the rule switch and a handler upload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_cli_authenticates_with_router_token() {
    let fixed = Arc::new(AtomicBool::new(false));
    let erp = {
        let fixed = fixed.clone();
        Receiver::scripted(Arc::new(move |_, _| {
            let status = if fixed.load(Ordering::SeqCst) {
                200
            } else {
                400
            };
            (status, Duration::ZERO, vec![])
        }))
        .await
    };
    let rules = webhook_rule("orders", "order.paid", &erp.url(), "erp");
    let config = format!(
        "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nscopes = [\"admin\"]\n",
        token_sha256("ops-token")
    );
    let r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));

    // A dead letter to look at: the receiver refuses the event (400 = permanent).
    let resp = client()
        .post(r.url("/v1/events"))
        .bearer_auth("ops-token")
        .header("content-type", "application/cloudevents+json")
        .body(event("o-1", "order.paid", json!({ "total": 5 })).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(resp.status(), 202);
    let listed = eventually(Duration::from_secs(20), || async {
        let l = cli_json(&r, &["dlq", "ls"]).await;
        (l["entries"].as_array().map(Vec::len) == Some(1)).then_some(l)
    })
    .await
    .expect("the CLI lists the dead letter");
    let entry = &listed["entries"][0];
    assert_eq!(entry["target"], "erp");
    assert_eq!(entry["reason"], "permanent_error");

    // Without a token: refused, and the message says how to pass one.
    let (ok, _, err) = cli(&r, None, &["dlq", "ls"]).await;
    assert!(!ok);
    assert!(err.contains("401"), "{err}");
    assert!(err.contains("ROUTER_TOKEN"), "{err}");
    // A wrong token is named as such.
    let (ok, _, err) = cli(&r, Some("not-the-token"), &["dlq", "ls"]).await;
    assert!(!ok);
    assert!(err.contains("was not accepted"), "{err}");

    // Inspect: the readable list, one entry whole, the summary.
    let (ok, table, err) = cli(&r, Some("ops-token"), &["dlq", "ls"]).await;
    assert!(ok, "{err}");
    assert!(
        table.contains("erp") && table.contains("permanent_error"),
        "{table}"
    );
    let id = entry["id"].as_str().expect("entry id");
    let shown = cli_json(&r, &["dlq", "show", id]).await;
    assert_eq!(shown["id"], id, "{shown}");
    assert_eq!(shown["event"]["id"], "o-1", "{shown}");
    let summary = cli_json(&r, &["dlq", "summary"]).await;
    assert!(summary.to_string().contains("permanent_error"), "{summary}");

    // Contain: pause the target.
    let paused = cli_json(&r, &["targets", "pause", "erp"]).await;
    assert_eq!(paused["paused"], true, "{paused}");
    let targets = cli_json(&r, &["targets", "ls"]).await;
    assert_eq!(targets["targets"][0]["paused"], true, "{targets}");

    // Fix, then redrive (following the job) while paused: the entry waits in its queue.
    fixed.store(true, Ordering::SeqCst);
    let dry = cli_json(&r, &["dlq", "purge", "--target", "erp", "--dry-run"]).await;
    assert_eq!(
        (dry["matched"].as_u64(), dry["purged"].as_u64()),
        (Some(1), Some(0)),
        "{dry}"
    );
    let (ok, out, progress) = cli(
        &r,
        Some("ops-token"),
        &[
            "dlq", "redrive", "--target", "erp", "--rate", "50", "--wait", "--json",
        ],
    )
    .await;
    assert!(ok, "redrive failed: {progress}");
    let job: Value = serde_json::from_str(&out).expect("the job as JSON");
    // Not a terminal: the progress is logged a line per change, the last one the end state,
    // with no carriage returns to garble a runbook's log.
    let lines: Vec<&str> = progress.lines().collect();
    assert!(
        !progress.contains('\r')
            && lines
                .last()
                .is_some_and(|l| l.ends_with("1/1 moved, 0 failed, 0 skipped — done")),
        "{progress:?}"
    );
    assert_eq!(
        (job["state"].as_str(), job["moved"].as_u64()),
        (Some("done"), Some(1)),
        "{job}"
    );
    let after = cli_json(&r, &["dlq", "ls"]).await;
    assert_eq!(
        after["entries"].as_array().map(Vec::len),
        Some(0),
        "{after}"
    );
    let queued = cli_json(&r, &["targets", "ls"]).await;
    assert_eq!(queued["targets"][0]["queued"], 1, "{queued}");
    assert_eq!(erp.count(), 1, "a paused target got an attempt");

    // Resume: the redriven event is delivered.
    let resumed = cli_json(&r, &["targets", "resume", "erp"]).await;
    assert_eq!(resumed["paused"], false, "{resumed}");
    assert!(
        erp.wait_for(Duration::from_secs(20), |got| got.len() == 2)
            .await,
        "the redriven event was not delivered after resume"
    );
    let f = eventually(Duration::from_secs(20), || async {
        let f: Value = client()
            .get(r.url("/v1/events/o-1?source=/test"))
            .bearer_auth("ops-token")
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (f["targets"][0]["state"] == "delivered").then_some(f)
    })
    .await;
    assert!(f.is_some(), "the event's fate never became delivered");

    // Replay the last hour through the current rules: delivered again, marked as a replay.
    let from = chrono::Utc::now() - chrono::Duration::hours(1);
    let to = chrono::Utc::now() + chrono::Duration::minutes(1);
    let replay = cli_json(
        &r,
        &[
            "replay",
            "--from",
            &from.to_rfc3339(),
            "--to",
            &to.to_rfc3339(),
            "--rate",
            "50",
            "--wait",
        ],
    )
    .await;
    assert_eq!(replay["state"], "done", "{replay}");
    assert!(
        erp.wait_for(Duration::from_secs(20), |got| got.len() == 3)
            .await,
        "the replayed event was not delivered"
    );
    let got = erp.received();
    assert_eq!(got[2].event_id(), "o-1");
    assert_eq!(got[2].body["replay"], replay["id"], "the replay marker");
    assert_eq!(
        got[1].header("idempotency-key"),
        got[0].header("idempotency-key"),
        "a redrive keeps the idempotency key"
    );
    assert_ne!(
        got[2].header("idempotency-key"),
        got[1].header("idempotency-key"),
        "a replay gets its own"
    );

    // A rule switched off and on.
    let off = cli_json(&r, &["rules", "disable", "orders"]).await;
    assert_eq!(off["enabled"], false, "{off}");
    let on = cli_json(&r, &["rules", "enable", "orders"]).await;
    assert_eq!(on["enabled"], true, "{on}");

    // A handler pushed from a file, then listed.
    let noop = crate::handlers::plugins().join("noop.wasm");
    let pushed = cli_json(
        &r,
        &[
            "handlers",
            "push",
            "noop",
            noop.to_str().expect("utf-8 path"),
        ],
    )
    .await;
    assert_eq!(pushed["version"], 1, "{pushed}");
    let (ok, list, err) = cli(&r, Some("ops-token"), &["handlers", "list"]).await;
    assert!(ok, "{err}");
    assert!(list.contains("noop"), "{list}");

    // A contract pushed from a file: a new version lists what it breaks; an incompatible
    // change to a live version is refused with the reason and a failing exit.
    let schemas = tempfile::tempdir().expect("tmp");
    let file = |name: &str, schema: Value| {
        let p = schemas.path().join(name);
        std::fs::write(&p, serde_json::to_string_pretty(&schema).expect("JSON")).expect("write");
        p.to_str().expect("utf-8 path").to_string()
    };
    let v1 = file(
        "v1.json",
        json!({"type": "object", "properties": {"sku": {"type": "string"}}}),
    );
    let v2 = file(
        "v2.json",
        json!({"type": "object", "required": ["sku"], "properties": {"sku": {"type": "string"}}}),
    );
    let (ok, out, err) = cli(
        &r,
        Some("ops-token"),
        &["contracts", "push", "stock.moved", "v1", &v1],
    )
    .await;
    assert!(
        ok && out.contains("live as stock.moved v1 (new version"),
        "{out}{err}"
    );
    assert_eq!(
        std::fs::read_to_string(r.dir.path().join("contracts/stock.moved/v1.json")).ok(),
        std::fs::read_to_string(&v1).ok(),
        "the router keeps the file as written"
    );
    let (ok, out, err) = cli(
        &r,
        Some("ops-token"),
        &["contracts", "push", "stock.moved", "2", &v2],
    )
    .await;
    assert!(ok, "{err}");
    assert!(
        out.contains("breaking changes against v1:") && out.contains("`sku`"),
        "{out}"
    );
    let (ok, out, err) = cli(
        &r,
        Some("ops-token"),
        &["contracts", "push", "stock.moved", "v1", &v2],
    )
    .await;
    assert!(!ok, "{out}");
    assert!(
        err.contains("409") && err.contains("publish it as v3"),
        "{err}"
    );

    // Rule files checked against the handlers this router has, before deploying them.
    let repo = tempfile::tempdir().expect("tmp");
    let rules = |handler: &str| {
        format!(
            "rules:\n  - name: enrich\n    pattern: {{ type: [order.paid] }}\n    targets:\n      - handler: noop\n      - handler: {handler}\n"
        )
    };
    let (repo_dir, api) = (repo.path().to_str().expect("utf-8 path"), r.url(""));
    let check_args = ["rules", "check", repo_dir, "--handlers-on", &api];
    let check = |token| run_router(token, &check_args);
    std::fs::write(repo.path().join("r.yaml"), rules("invoicing")).expect("write");
    let (ok, text, _) = check(Some("ops-token")).await;
    assert!(!ok, "{text}");
    assert!(
        text.contains("r.yaml:6:18: rule `enrich`, target `enrich-1`: no handler named `invoicing` (known: noop)"),
        "{text}"
    );
    assert!(!text.contains("`noop` (known"), "{text}");
    std::fs::write(repo.path().join("r.yaml"), rules("noop")).expect("write");
    let (ok, text, _) = check(Some("ops-token")).await;
    assert!(ok, "{text}");
    // Without the token the check cannot ask, and says so instead of passing.
    let (ok, _, err) = check(None).await;
    assert!(!ok);
    assert!(
        err.contains("cannot list the handlers") && err.contains("401"),
        "{err}"
    );
}

/// `router bench ingest` against an authenticated router: every event accepted, and the
/// report says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_tool_sends_its_token_and_reports_what_was_accepted() {
    let config = format!(
        "[[auth.tokens]]\nname = \"load\"\nsha256 = \"{}\"\nscopes = [\"ingest:bench.*\", \"read\"]\n",
        token_sha256("load-token")
    );
    let r = RouterProc::start_full(&[], &[], &[], Some(&config));
    let url = r.url("/v1/events");
    let bench_args = [
        "bench",
        "ingest",
        "--url",
        &url,
        "--events",
        "300",
        "--concurrency",
        "4",
        "--batch",
        "3",
        "--size",
        "256",
    ];
    let run = |token| run_router(token, &bench_args);
    let (ok, text, _) = run(Some("load-token")).await;
    assert!(ok, "{text}");
    assert!(
        text.contains("events ok:      300 accepted, 0 duplicate, 0 quarantined"),
        "{text}"
    );
    assert!(text.contains("failed reqs:    0"), "{text}");
    assert!(text.contains("events/s"), "{text}");
    let metrics: String = client()
        .get(r.url("/metrics"))
        .bearer_auth("load-token")
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let accepted = metric_lines(&metrics, "router_ingest_events_total{status=\"accepted\"}");
    assert!(accepted.ends_with(" 300"), "{accepted}");

    // Without the token every request is refused, and the report counts them as failed.
    let (_, text, _) = run(None).await;
    assert!(text.contains("events ok:      0"), "{text}");
    assert!(text.contains("failed reqs:    100"), "{text}");
}

/// `router contracts check` in a contracts repository's CI: a new version that breaks the one
/// before is what versions are for (a note, exit 0, as the upload API answers 201); a
/// deployed version edited incompatibly in place, or removed, fails against the base (as the
/// upload API answers 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contracts_check_fails_on_in_place_changes_to_deployed_versions_only() {
    let v1 = r#"{"type": "object", "properties": {"total": {"type": "number"}}}"#;
    // Documented in place: any value still passes there.
    let v1_optional_added = r#"{"type": "object", "properties": {"total": {"type": "number"}, "note": {"description": "free text"}}}"#;
    // Typed in place: `note: 5` passed the open v1 and would be quarantined.
    let v1_optional_typed = r#"{"type": "object", "properties": {"total": {"type": "number"}, "note": {"type": "string"}}}"#;
    let v1_retyped =
        "{\n  \"type\": \"object\",\n  \"properties\": {\"total\": {\"type\": \"string\"}}\n}";
    let v2_breaking =
        r#"{"type": "object", "required": ["total"], "properties": {"total": {"type": "string"}}}"#;
    let dirs = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, files: &[(&str, &str)]| {
        let d = dirs.path().join(name);
        for (f, text) in files {
            let p = d.join(f);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        }
        d.display().to_string()
    };
    let base = write("base", &[("order/v1.json", v1)]);
    let new_version = write(
        "new-version",
        &[
            ("order/v1.json", v1_optional_added),
            ("order/v2.json", v2_breaking),
        ],
    );
    let edited = write("edited", &[("order/v1.json", v1_retyped)]);
    let typed = write("typed", &[("order/v1.json", v1_optional_typed)]);
    let removed = write("removed", &[("order/v2.json", v2_breaking)]);

    let (ok, out, err) = run_router(None, &["contracts", "check", &new_version]).await;
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("note: ") && out.contains("incompatible with v1"),
        "{out}"
    );
    let (ok, out, err) = run_router(
        None,
        &["contracts", "check", &new_version, "--against", &base],
    )
    .await;
    assert!(
        ok,
        "an optional property documented in place and a new version: {out}{err}"
    );
    let (ok, out, _) = run_router(None, &["contracts", "check", &typed, "--against", &base]).await;
    assert!(!ok && out.contains("new property `note`"), "{out}");

    let (ok, out, err) =
        run_router(None, &["contracts", "check", &edited, "--against", &base]).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("order/v1.json:3:")
            && out.contains("incompatible change to v1 in place")
            && out.contains("publish it as v2"),
        "{out}"
    );
    assert!(err.contains("1 incompatible change"), "{err}");
    let (ok, out, _) =
        run_router(None, &["contracts", "check", &removed, "--against", &base]).await;
    assert!(!ok && out.contains("v1 was removed"), "{out}");
    let (ok, _, err) = run_router(
        None,
        &["contracts", "check", &edited, "--against", "/no/such/dir"],
    )
    .await;
    assert!(!ok && err.contains("no such directory"), "{err}");
}

/// A `modes.toml` entry for a type without a contract does nothing: the server warns at
/// start, and `contracts check` said nothing. It is a warning there too (exit 0), as `rules
/// check` prints its warnings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contracts_check_warns_about_a_mode_for_a_type_without_a_contract() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("order")).expect("mkdir");
    std::fs::write(dir.path().join("order/v1.json"), r#"{"type": "object"}"#).expect("contract");
    std::fs::write(
        dir.path().join("modes.toml"),
        "\"order\" = \"enforce\"\n\"ordr\" = \"enforce\"\n",
    )
    .expect("modes");
    let (ok, out, err) = run_router(
        None,
        &["contracts", "check", &dir.path().display().to_string()],
    )
    .await;
    assert!(ok, "a warning, not an error: {out}{err}");
    let warnings: Vec<&str> = out.lines().filter(|l| l.contains("warning:")).collect();
    assert_eq!(warnings.len(), 1, "{out}");
    assert!(
        warnings[0]
            .contains("modes.toml: warning: sets a mode for type ordr, which has no contract"),
        "{out}"
    );
}

/// `rules check` counts its errors, not its warnings: one error beside an unused policy's
/// warning said "2 problem(s)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_check_counts_errors_and_warnings_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("r.yaml"),
        "policies:\n  spare: {}\nrules:\n  - name: a\n    pattern: {type: [x]}\n    targets: [{handler: h, policy: nope}]\n",
    )
    .expect("rules");
    let (ok, out, err) =
        run_router(None, &["rules", "check", &dir.path().display().to_string()]).await;
    assert!(!ok, "{out}");
    assert!(out.contains("warning: policy `spare` is not used"), "{out}");
    assert!(out.contains("unknown policy `nope`"), "{out}");
    assert_eq!(err.trim(), "1 error(s), 1 warning(s)", "{err}");
}

/// A reader that closes the pipe early (`router rules test … | head`, `router dlq jobs | true`)
/// ends the command quietly with 141 (what a shell shows for a command a closed pipe ended):
/// `println!` panicked on the failed write, with a backtrace and status 101. The pipe's read
/// end is closed before the command starts, so every write it makes fails.
#[test]
fn output_into_a_closed_pipe_ends_the_command_quietly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(
        rules.join("r.yaml"),
        webhook_rule("orders", "t", "http://127.0.0.1:9/x", "erp"),
    )
    .expect("rule file");
    let ev = dir.path().join("ev.json");
    std::fs::write(&ev, event("e1", "t", json!({})).to_string()).expect("event file");
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["rules", "test"])
        .arg(&rules)
        .arg(&ev)
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run router rules test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A redrive or purge of the whole DLQ that does not say so is refused in the CLI's words:
/// the flag is `--all` (the API's answer named its `"all": true`, which is no flag of
/// `router dlq`). A dry run of a purge only counts, and needs no flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_dlq_redrive_or_purge_without_all_names_the_flag() {
    let r = RouterProc::start(&[], &[]);
    for what in ["redrive", "purge"] {
        let (ok, _, err) = cli(&r, None, &["dlq", what]).await;
        assert!(!ok, "{what} of the whole DLQ without --all: {err}");
        assert!(
            err.contains(&format!("or pass --all to {what} every entry"))
                && !err.contains("\"all\": true"),
            "{what}: {err}"
        );
        let (ok, _, err) = cli(&r, None, &["dlq", what, "--all", "--json"]).await;
        assert!(ok, "{what} --all: {err}");
    }
    let (ok, _, err) = cli(&r, None, &["dlq", "purge", "--dry-run"]).await;
    assert!(ok, "a dry run only counts: {err}");
}

/// `router handlers push` checks the name with the router's rule before sending, and says it
/// in the router's words: an empty name got a 404 "no such route", and a name with a space
/// the router's "never percent-encoded", about the CLI's own encoding. Nothing is sent: the
/// API address here has no router behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_push_refuses_a_name_the_router_would_refuse_before_sending() {
    let noop = crate::handlers::plugins().join("noop.wasm");
    let noop = noop.to_str().expect("utf-8 path");
    for name in ["", "lab x", "Lab", "billing.v2"] {
        let (ok, out, err) = run_router(
            None,
            &[
                "handlers",
                "push",
                name,
                noop,
                "--api",
                "http://127.0.0.1:9",
            ],
        )
        .await;
        assert!(!ok, "{name:?}: {out}");
        assert!(
            err.contains(&format!("invalid handler name {name:?}"))
                && err.contains("use 1-64 characters of a-z, 0-9, '_' and '-'"),
            "{name:?}: {err}"
        );
    }
    for args in [
        &["handlers", "logs", "lab x"][..],
        &["handlers", "rollback", "", "1"],
    ] {
        let (ok, _, err) =
            run_router(None, &[args, &["--api", "http://127.0.0.1:9"]].concat()).await;
        assert!(
            !ok && err.contains("invalid handler name"),
            "{args:?}: {err}"
        );
    }
}

/// `router token new` refuses an empty name, as the router refuses such a token at start,
/// and prints no token: before, it printed one with `name = ""` for the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_new_refuses_an_empty_name() {
    let (ok, out, err) = run_router(None, &["token", "new", "", "--scope", "read"]).await;
    assert!(!ok, "{out}{err}");
    assert!(err.contains("name must not be empty"), "{err}");
    assert!(
        !out.contains("rtr_") && !err.contains("rtr_"),
        "a token was printed: {out}{err}"
    );
    let (ok, out, err) = run_router(None, &["token", "new", "ci", "--scope", "read"]).await;
    assert!(ok && out.starts_with("rtr_"), "{out}{err}");
}

/// Runs `router ARGS…` in `cwd` with no `ROUTER_*` configuration; returns (exit code,
/// stdout, stderr).
async fn run_router_in(cwd: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_router"));
    cmd.args(args).current_dir(cwd);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ROUTER_") {
            cmd.env_remove(k);
        }
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the command finished")
        .expect("run the command");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `router config explain` reads the configuration as `router serve` does: with no config
/// and no `./rules` it prints an empty table (serve runs with no rules); it failed with
/// "cannot read rules directory". A configured directory that does not exist is refused with
/// serve's own message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_explain_reads_the_setup_serve_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, out, err) = run_router_in(dir.path(), &["config", "explain"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out.lines().count(), 1, "only the header: {out}");
    assert!(out.starts_with("TARGET"), "{out}");
    assert!(
        err.contains("rules directory ./rules does not exist: no rules loaded"),
        "{err}"
    );
    std::fs::write(dir.path().join("router.toml"), "rules_dir = \"./rulez\"\n").expect("config");
    let (code, out, err) = run_router_in(
        dir.path(),
        &["config", "explain", "--config", "router.toml"],
    )
    .await;
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(
        err.contains(
            "rules directory ./rulez does not exist (a typo, or a volume not mounted?): point --rules (rules_dir) at the right one"
        ),
        "{err}"
    );
    let (code, _, err) = run_router_in(dir.path(), &["config", "explain", "nope"]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("rules directory nope does not exist") && err.contains("the DIR argument"),
        "{err}"
    );
}

/// What holds an entry back without spending attempts is not in explain's numbers: ordering,
/// `on_dead_letter: hold`, a handler not uploaded, a secret not set. Each gets a note where it
/// applies (an ordered key's fifth event reached the DLQ after twice the printed worst case;
/// a held key's entries waited far past max_age), and none where it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_explain_notes_what_holds_entries_without_spending_attempts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules");
    std::fs::create_dir_all(&rules).expect("rules dir");
    std::fs::write(
        rules.join("r.yaml"),
        [
            "policies:",
            "  ordered:",
            "    ordering: partitionkey",
            "    on_dead_letter: hold",
            "    retry: { max_attempts: 3, base_delay: 1s, max_delay: 1s, jitter: none, max_age: 1h }",
            "rules:",
            "  - name: r",
            "    pattern: { type: [t] }",
            "    targets:",
            "      - { webhook: \"http://127.0.0.1:9/a\", id: ordered, policy: ordered }",
            "      - { handler: invoicing, id: handler }",
            "      - { webhook: \"http://127.0.0.1:9/b\", id: signed, secret_env: WEBHOOK_SECRET_X }",
            "      - { webhook: \"http://127.0.0.1:9/c\", id: plain }",
        ]
        .join("\n"),
    )
    .expect("rules");
    let (code, out, err) = run_router_in(dir.path(), &["config", "explain"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let row = |id: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("no row for {id}: {out}"))
            .to_string()
    };
    let ordered = row("ordered");
    assert!(
        ordered.contains("ordered by partitionkey: an entry first waits behind the earlier entries of its key")
            && ordered.contains("on_dead_letter: hold: after a dead letter the key's later entries wait for an operator's release, without bound"),
        "{ordered}"
    );
    assert!(
        row("handler").contains(
            "while handler invoicing is not uploaded (or not loaded) the target waits, spending no attempt, up to max_age (1day)"
        ),
        "{out}"
    );
    assert!(
        row("signed").contains("while a secret it names is not set the target cannot start"),
        "{out}"
    );
    let plain = row("plain");
    assert!(
        !plain.contains("ordered") && !plain.contains("cannot start") && !plain.contains("handler"),
        "{plain}"
    );
    // Per dependency: the three webhooks on 127.0.0.1:9 are one receiver, whose row sums
    // their worst-case attempts.
    let dep = out
        .lines()
        .find(|l| l.starts_with("webhook http://127.0.0.1:9 "))
        .unwrap_or_else(|| panic!("no dependency row: {out}"));
    let cols: Vec<&str> = dep.split_whitespace().collect();
    let sum: u32 = ["ordered", "signed", "plain"]
        .iter()
        .map(|id| {
            row(id)
                .split_whitespace()
                .nth(3)
                .and_then(|n| n.parse::<u32>().ok())
                .expect("attempts")
        })
        .sum();
    assert_eq!(cols[2], "3", "{dep}");
    assert_eq!(cols[3], sum.to_string(), "{dep}");
    assert!(dep.contains("ordered, plain, signed (rule r)"), "{dep}");
    assert!(
        !out.contains("handler invoicing  "),
        "a dependency of one target has no row: {out}"
    );
}

/// With the JetStream store, `router config explain` shows how the store connects: its
/// credential and TLS keys, the variable a secret comes from and whether it is set (from the
/// secrets file here), never the secret; a variable not set is flagged as stopping the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_explain_shows_the_stores_credential_keys_but_never_a_secret() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("secrets.toml"),
        "E2E_EXPLAIN_STORE_TOKEN = \"Sup3rS3cretT0ken\"\n",
    )
    .expect("secrets");
    std::fs::write(dir.path().join("ca.pem"), "x").expect("ca");
    let config = |keys: &str| {
        format!(
            "secrets_file = \"secrets.toml\"\n[store]\nbackend = \"jetstream\"\n[store.jetstream]\nurl = \"nats://nats.example:4222\"\n{keys}"
        )
    };
    std::fs::write(
        dir.path().join("router.toml"),
        config("token_env = \"E2E_EXPLAIN_STORE_TOKEN\"\ntls_ca_file = \"ca.pem\"\n"),
    )
    .expect("config");
    let (code, out, err) = run_router_in(
        dir.path(),
        &["config", "explain", "--config", "router.toml"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("store: jetstream at nats://nats.example:4222 (stream ROUTER_STORE")
            && out.contains(
                "auth: store.jetstream.token_env = \"E2E_EXPLAIN_STORE_TOKEN\" (set); TLS required: store.jetstream.tls_ca_file = \"ca.pem\""
            ),
        "{out}"
    );
    assert!(
        !out.contains("Sup3rS3cretT0ken") && !err.contains("Sup3rS3cretT0ken"),
        "{out}{err}"
    );
    std::fs::write(
        dir.path().join("router.toml"),
        config("user = \"router\"\npassword_env = \"E2E_EXPLAIN_NEVER_SET\"\n"),
    )
    .expect("config");
    let (code, out, err) = run_router_in(
        dir.path(),
        &["config", "explain", "--config", "router.toml"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains(
            "auth: store.jetstream.user = \"router\", store.jetstream.password_env = \"E2E_EXPLAIN_NEVER_SET\" (NOT SET)"
        ) && out.contains("(`router serve` does not start until it is set)"),
        "{out}"
    );
    assert!(!out.contains("nats targets:"), "no nats: target: {out}");
    // With a `nats:` target, `[nats]` is shown the same way.
    std::fs::create_dir_all(dir.path().join("rules")).expect("rules dir");
    std::fs::write(
        dir.path().join("rules/r.yaml"),
        "rules:\n  - name: r\n    pattern: { type: [t] }\n    targets:\n      - nats: orders.paid\n",
    )
    .expect("rules");
    let (code, out, err) = run_router_in(
        dir.path(),
        &["config", "explain", "--config", "router.toml"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("nats targets: nats://127.0.0.1:4222; auth: no credentials; TLS when the URL is tls:// or the server requires it"),
        "{out}"
    );
}

/// Runs `router status ARGS… --api <router>` without a token (nor any other `ROUTER_*`
/// variable); returns (exit code, stdout, stderr).
async fn status_of(r: &RouterProc, args: &[&str]) -> (Option<i32>, String, String) {
    let api = r.url("");
    let args = [&["status"], args, &["--api", &api]].concat();
    run_router_in(std::path::Path::new("."), &args).await
}

/// `router status` exits 0 on a quiet router, and 1 once something needs an operator, naming
/// each thing: a new dead letter, a paused target. `--recent` says how new a dead letter must
/// be to count; the report goes back to 0 when the pause is lifted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_status_says_what_needs_attention_and_exits_by_it() {
    let refuses = Receiver::scripted(Arc::new(|_, _| (400, Duration::ZERO, vec![]))).await;
    let takes = Receiver::ok().await;
    let rules = rules_yaml(
        "",
        &[
            (
                "orders",
                "order.paid",
                &[format!("webhook: {}\n        id: erp", refuses.url())],
            ),
            (
                "audit",
                "order.shipped",
                &[format!("webhook: {}\n        id: audit", takes.url())],
            ),
        ],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);

    let (code, out, err) = status_of(&r, &[]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("nothing needs attention"), "{out}");
    assert!(out.contains("targets 2 · queued 0"), "{out}");

    // The receiver refuses it (400): a dead letter, new.
    post_event(&r, &event("o-1", "order.paid", json!({ "total": 5 }))).await;
    // Both lines, not only the exit code: the recent dead letters and the DLQ depth are read
    // apart (the summary of the last hour, then /v1/status), and on a loaded machine a status
    // run between the two reads saw the new dead letter and a depth of 0.
    let out = eventually(Duration::from_secs(20), || async {
        let (code, out, _) = status_of(&r, &[]).await;
        (code == Some(1) && out.contains("dlq 1 dead letter(s)")).then_some(out)
    })
    .await
    .expect("status turns to 1 with the dead letter");
    assert!(
        out.contains("1 new dead letter(s) in the last 1h: erp permanent_error ×1"),
        "{out}"
    );
    assert!(out.contains("dlq 1 dead letter(s)"), "{out}");

    let paused = client()
        .post(r.url("/v1/targets/audit/pause"))
        .send()
        .await
        .expect("pause");
    assert_eq!(paused.status(), 200);
    let (code, out, _) = status_of(&r, &["--json"]).await;
    assert_eq!(code, Some(1), "{out}");
    let v: Value = serde_json::from_str(&out).expect("json");
    let attention: Vec<&str> = v["attention"]
        .as_array()
        .expect("attention")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(attention.len(), 2, "{attention:?}");
    assert!(
        attention
            .iter()
            .any(|a| a.starts_with("target audit is paused")),
        "{attention:?}"
    );
    assert_eq!(v["status"]["ready"], true);
    // `targets ls --problems` shows the paused one alone.
    let (ok, out, err) = cli(&r, None, &["targets", "ls", "--problems", "--json"]).await;
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&out).expect("json");
    let ids: Vec<&str> = listed["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert_eq!(ids, ["audit"], "{out}");

    // Older than `--recent` (the router's clock read to the second: 4 s is past 1 s with
    // room), the dead letter is history: only the pause is left, then nothing.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (code, out, _) = status_of(&r, &["--recent", "1s"]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(!out.contains("new dead letter"), "{out}");
    assert!(out.contains("target audit is paused"), "{out}");
    let resumed = client()
        .post(r.url("/v1/targets/audit/resume"))
        .send()
        .await
        .expect("resume");
    assert_eq!(resumed.status(), 200);
    let (code, out, _) = status_of(&r, &["--recent", "1s"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("nothing needs attention"), "{out}");
}

/// Past a thousand targets and rules the API answers a page at a time: `router targets ls`
/// (and `--problems`, which the router filters), `router rules ls` and `router status` follow
/// the pages and show every one, the paused target on the second page included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_shows_targets_and_rules_past_the_first_page() {
    const N: usize = 1_005;
    let rcv = Receiver::ok().await;
    let mut rules = String::from("rules:\n");
    for i in 0..N {
        rules.push_str(&format!(
            "  - name: r{i:04}\n    pattern: {{ type: [r.{i}] }}\n    targets:\n      - webhook: {}\n        id: c{i}\n",
            rcv.url()
        ));
    }
    let r = RouterProc::start(&[("many.yaml", &rules)], &[]);
    // By id `c999` sorts last (after `c1004`): on the second page of 1000.
    let (status, v) = post_json(&r, "/v1/targets/c999/pause", json!({})).await;
    assert_eq!(status, 200, "{v}");
    let (_, first) = get_json(&r, "/v1/targets").await;
    assert_eq!(first["targets"].as_array().map(Vec::len), Some(1000));

    let (ok, out, err) = cli(&r, None, &["targets", "ls"]).await;
    assert!(ok, "{err}");
    let rows = out.lines().filter(|l| l.starts_with('c')).count();
    assert_eq!(rows, N, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("c999 ") && l.contains("paused")),
        "{out}"
    );
    let (ok, out, err) = cli(&r, None, &["targets", "ls", "--json"]).await;
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(listed["targets"].as_array().map(Vec::len), Some(N));
    assert_eq!(listed["next"], Value::Null);
    let (ok, out, err) = cli(&r, None, &["targets", "ls", "--problems", "--json"]).await;
    assert!(ok, "{err}");
    let problems: Value = serde_json::from_str(&out).expect("json");
    let ids: Vec<&str> = problems["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert_eq!(ids, ["c999"], "{out}");

    let (ok, out, err) = cli(&r, None, &["rules", "ls", "--json"]).await;
    assert!(ok, "{err}");
    let rules: Value = serde_json::from_str(&out).expect("json");
    let names: Vec<&str> = rules["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter_map(|x| x["name"].as_str())
        .collect();
    assert_eq!(names.len(), N);
    assert_eq!(names.last(), Some(&"r1004"));

    let (code, out, _) = status_of(&r, &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains(&format!("targets {N} ")), "{out}");
    assert!(out.contains("target c999 is paused"), "{out}");
}

/// A handler target whose handler is not uploaded (a typo in the rule) is a problem: its
/// `/v1/targets` row says the handler's state, `router status` lists it under "needs
/// attention" and exits 1, and `targets ls --problems` lists it. Once a reload removes the
/// target, `/v1/status` says its entries cannot drain instead of "drain under its last
/// configuration". Before, all of this was one `/v1/status` warning and exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_target_whose_handler_is_not_uploaded_needs_attention() {
    let rules = rules_yaml(
        "",
        &[(
            "enrich",
            "t",
            &["handler: enrichh\n        id: h".to_string()],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (_, b) = post_event(&r, &event("m-1", "t", json!({}))).await;
    assert_eq!(b["results"][0]["status"], "accepted", "{b}");
    let (_, t) = get_json(&r, "/v1/targets/h").await;
    assert_eq!(t["handler"]["name"], "enrichh", "{t}");
    assert_eq!(t["handler"]["state"], "not_uploaded", "{t}");

    let (code, out, err) = status_of(&r, &[]).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("needs attention (1):\n  - target h: handler \"enrichh\" is not uploaded (or was deleted): its deliveries wait for it"),
        "{out}"
    );
    let (ok, out, err) = cli(&r, None, &["targets", "ls", "--problems"]).await;
    assert!(ok, "{err}");
    assert!(
        out.lines().nth(1).is_some_and(|l| l.starts_with("h ")),
        "{out}"
    );
    assert!(
        out.contains("why queues wait:\n  h: handler \"enrichh\""),
        "{out}"
    );

    // The rule goes; its queued entry has nothing to drain it.
    let old = get_json(&r, "/v1/status").await.1["rules"]["version"].clone();
    let other = "rules:\n  - name: other\n    pattern: { type: [u] }\n    targets:\n      - webhook: http://127.0.0.1:9/x\n        id: other\n";
    let dir = r.dir.path().join("rules");
    std::fs::write(dir.join(".r.yaml.tmp"), other).expect("write");
    std::fs::rename(dir.join(".r.yaml.tmp"), dir.join("r.yaml")).expect("rename");
    let warning = eventually(Duration::from_secs(15), || async {
        let (_, st) = get_json(&r, "/v1/status").await;
        if st["rules"]["version"] == old {
            return None;
        }
        st["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .find(|w| w.starts_with("target h "))
            .map(str::to_string)
    })
    .await
    .expect("a warning for the removed target");
    assert!(
        warning.starts_with("target h is no longer in the rules and its 1 queued entries cannot drain under its last configuration (handler \"enrichh\" is not uploaded (or was deleted)): they wait up to their max_age"),
        "{warning}"
    );
    assert!(
        warning.contains("delivery.on_target_removed = \"dead_letter\""),
        "{warning}"
    );
}

/// The queue-depth cap shows before it dead-letters anything: `max_queue_depth` in
/// `/v1/targets`, the `router_queue_max_depth` gauge, a CAP column in `router targets ls`,
/// and once the queue reaches it a note that new entries go to the DLQ as
/// `target_overflow`, which `router status` lists. Before, the cap appeared nowhere until
/// events were already being dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_depth_cap_shows_before_it_dead_letters() {
    let rcv = Receiver::ok().await;
    let rules = rules_yaml(
        "  capped:\n    max_queue_depth: 5",
        &[(
            "to-crm",
            "t",
            &[format!(
                "webhook: {}\n        id: crm\n        policy: capped",
                rcv.url()
            )],
        )],
    );
    let r = RouterProc::start(&[("r.yaml", &rules)], &[]);
    let (_, t) = get_json(&r, "/v1/targets/crm").await;
    assert_eq!(t["max_queue_depth"], 5, "{t}");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("router_queue_max_depth{target=\"crm\"} 5"),
        "{}",
        metric_lines(&m, "max_depth")
    );
    let (ok, out, err) = cli(&r, None, &["targets", "ls"]).await;
    assert!(ok, "{err}");
    assert!(out.starts_with("TARGET  QUEUED  CAP "), "{out}");
    assert!(!out.contains("why queues wait"), "{out}");

    // Paused and forgotten: the queue fills to its cap.
    let (status, _) = post_json(&r, "/v1/targets/crm/pause", json!({})).await;
    assert_eq!(status, 200);
    for i in 0..5 {
        post_event(&r, &event(&format!("c-{i}"), "t", json!({}))).await;
    }
    let (code, out, err) = status_of(&r, &[]).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("  - target crm: queue at its depth cap (5): new entries go to the DLQ as target_overflow"),
        "{out}"
    );
    let (ok, out, err) = cli(&r, None, &["targets", "ls", "--problems"]).await;
    assert!(ok, "{err}");
    assert!(
        out.contains(
            "  crm: queue at its depth cap (5): new entries go to the DLQ as target_overflow"
        ),
        "{out}"
    );
}

/// A rule an operator disabled says since when and by which token, in `GET /v1/rules` and
/// `router rules ls`, and still does after a restart (stored with the switch); `router
/// status` lists it under "needs attention" and exits 1 until it is enabled. Before, the
/// switch was a bare boolean and `router status` said nothing needs attention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_disabled_by_an_operator_says_since_when_and_by_whom() {
    let rules = webhook_rule("orders-to-erp", "order.paid", "http://127.0.0.1:9/x", "erp");
    let config = format!(
        "[[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nscopes = [\"admin\"]\n",
        token_sha256("ops-token")
    );
    let mut r = RouterProc::start_full(&[("r.yaml", &rules)], &[], &[], Some(&config));
    let off = cli_json(&r, &["rules", "disable", "orders-to-erp"]).await;
    assert_eq!(off["enabled"], false, "{off}");
    let body = event("o-1", "order.paid", json!({}))
        .to_string()
        .into_bytes();
    let (status, b) = send_as(
        &r,
        "POST",
        "/v1/events",
        "ops-token",
        Some(("application/cloudevents+json", body)),
    )
    .await;
    assert_eq!(b["results"][0]["status"], "accepted", "{status}: {b}");
    let rule = |v: &Value| v["rules"][0].clone();
    let listed = cli_json(&r, &["rules", "ls"]).await;
    let at = rule(&listed)["disabled_at"]
        .as_str()
        .expect("disabled_at")
        .to_string();
    assert!(
        chrono::DateTime::parse_from_rfc3339(&at).is_ok(),
        "{listed}"
    );
    assert_eq!(rule(&listed)["disabled_by"], "ops", "{listed}");
    assert_eq!(listed["unrouted_rule_disabled_events"], 1, "{listed}");

    r.restart();
    let listed = cli_json(&r, &["rules", "ls"]).await;
    assert_eq!(rule(&listed)["disabled_by_operator"], true, "{listed}");
    assert_eq!(rule(&listed)["disabled_at"], at.as_str(), "{listed}");
    assert_eq!(rule(&listed)["disabled_by"], "ops", "{listed}");
    let (ok, out, err) = cli(&r, Some("ops-token"), &["rules", "ls"]).await;
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("disabled (operator: ops, {at})")),
        "{out}"
    );
    let (ok, out, err) = cli(&r, Some("ops-token"), &["status"]).await;
    assert!(!ok, "status exits 1: {out}{err}");
    assert!(
        out.contains(&format!(
            "  - rule orders-to-erp disabled by an operator (ops) since {at}: the events only it matches are routed nowhere"
        )),
        "{out}"
    );
    // Enabled again: nothing is left to say.
    cli_json(&r, &["rules", "enable", "orders-to-erp"]).await;
    let listed = cli_json(&r, &["rules", "ls"]).await;
    assert_eq!(rule(&listed)["disabled_at"], Value::Null, "{listed}");
    let (ok, out, err) = cli(&r, Some("ops-token"), &["status"]).await;
    assert!(ok, "{out}{err}");
}

/// A contract file that starts with a UTF-8 byte-order mark (some editors write one) is taken
/// alike by `router contracts check`, the watched directory, `router contracts push` and the
/// upload API. The directory and the check took it while the push failed locally and the API
/// answered 400 "the schema is not JSON".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_with_a_byte_order_mark_is_taken_by_the_check_the_push_and_the_api() {
    let repo = tempfile::tempdir().expect("tmp");
    let bom = "\u{feff}{\"type\": \"object\", \"required\": [\"n\"]}";
    std::fs::create_dir_all(repo.path().join("bom.t")).expect("mkdir");
    let file = repo.path().join("bom.t/v1.json");
    std::fs::write(&file, bom).expect("write");
    let dir = repo.path().to_str().expect("utf-8 path");
    let (ok, out, err) = run_router(None, &["contracts", "check", dir]).await;
    assert!(ok && out.contains("1 contracts"), "{out}{err}");

    let r = RouterProc::start(&[], &[("bom.dir/v1.json", bom)]);
    assert_eq!(get_json(&r, "/v1/contracts/bom.dir/v1").await.0, 200);
    let (ok, out, err) = cli(
        &r,
        None,
        &[
            "contracts",
            "push",
            "bom.t",
            "v1",
            file.to_str().expect("utf-8 path"),
        ],
    )
    .await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        std::fs::read_to_string(r.dir.path().join("contracts/bom.t/v1.json")).ok(),
        Some(bom.to_owned()),
        "the router keeps the file as written"
    );
    let resp = client()
        .put(r.url("/v1/contracts/bom.api/v1"))
        .header("content-type", "application/json")
        .body(bom)
        .send()
        .await
        .expect("put");
    let code = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    assert_eq!(code, 201, "{body}");
    // Each of them applies.
    for ty in ["bom.dir", "bom.t", "bom.api"] {
        let (_, b) = post_event(&r, &event(&format!("e-{ty}"), ty, json!({}))).await;
        assert_eq!(b["results"][0]["status"], "quarantined", "{ty}: {b}");
    }
}

/// Contract versions are bounded to what ingest accepts as a `dataversion` (1 to 2147483647,
/// a CloudEvents Integer): a file or an upload above it is refused naming the range (it could
/// never apply; the API took v2147483648 with 201), and an in-place change to the highest one
/// says no version is left instead of panicking on the overflow of "publish it as v(N+1)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_versions_stop_at_the_highest_dataversion() {
    let r = RouterProc::start(&[], &[]);
    let (code, body) = put_json(&r, "/v1/contracts/huge/v2147483648", json!({})).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["errors"].to_string().contains("2147483647"), "{body}");
    let (code, body) = put_json(&r, "/v1/contracts/huge/v2147483647", json!({})).await;
    assert_eq!(code, 201, "{body}");

    let repo = tempfile::tempdir().expect("tmp");
    let write = |rel: &str, text: &str| {
        let p = repo.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    };
    write("high/t/v2147483648.json", "{}");
    let dir = |sub: &str| repo.path().join(sub).to_str().expect("utf-8").to_owned();
    let (ok, out, err) = run_router(None, &["contracts", "check", &dir("high")]).await;
    assert!(!ok, "{out}{err}");
    assert!(
        out.contains("v2147483648.json") && out.contains("1 to 2147483647"),
        "{out}{err}"
    );
    write("base/t/v2147483647.json", r#"{"type": "object"}"#);
    write("new/t/v2147483647.json", r#"{"type": "array"}"#);
    let (ok, out, err) = run_router(
        None,
        &["contracts", "check", &dir("new"), "--against", &dir("base")],
    )
    .await;
    assert!(!ok, "{out}{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        out.contains("no version is left above v2147483647"),
        "{out}{err}"
    );
}
