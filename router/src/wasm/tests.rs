//! Integration tests of the WASM host against the real example plugins, built once per test run
//! by `plugins/build.sh` (which fails with a clear message when the wasm target or Python is
//! missing).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

/// The repository root (the crate lives in `<root>/router`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Directory holding `<name>.wasm` for every example plugin, built on first use.
fn plugins_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = repo_root();
        let out = std::env::var_os("ROUTER_PLUGINS_OUT").map_or_else(|| root.join("target/plugins"), PathBuf::from);
        let build = std::env::var_os("ROUTER_PLUGINS_TARGET_DIR")
            .map_or_else(|| root.join("target/plugins-build"), PathBuf::from);
        let script = root.join("plugins/build.sh");
        let status = Command::new("bash")
            .arg(&script)
            .env("OUT", &out)
            .env("PLUGINS_TARGET_DIR", &build)
            .env_remove("CARGO_TARGET_DIR")
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            status.success(),
            "{} failed ({status}); see its message above (missing wasm32-wasip2 target, python3 or network for componentize-py?)",
            script.display()
        );
        out
    })
}

/// The component of example plugin `name` (built on first use).
pub(crate) fn plugin(name: &str) -> Vec<u8> {
    let path = plugins_dir().join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One engine for the whole test binary. (Compiled code is kept per registry: each test's
/// registry compiles what it uploads.)
fn engine() -> Arc<WasmEngine> {
    static ENGINE: OnceLock<Arc<WasmEngine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| WasmEngine::new(EngineConfig::default()).expect("engine"))
        .clone()
}

/// A registry in a fresh temp dir on the shared engine, with the named plugins uploaded.
fn registry_with(names: &[&str]) -> (tempfile::TempDir, HandlerRegistry) {
    let dir = tempfile::tempdir().unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    for name in names {
        registry
            .upload(name, &plugin(name), "tests")
            .unwrap_or_else(|e| panic!("upload {name}: {e}"));
    }
    (dir, registry)
}

/// Shared handlers for tests that only invoke.
fn loaded(name: &str) -> Arc<LoadedHandler> {
    static REGISTRY: OnceLock<(tempfile::TempDir, HandlerRegistry)> = OnceLock::new();
    let (_, registry) = REGISTRY.get_or_init(|| {
        registry_with(&[
            "noop",
            "invoice",
            "enrich",
            "flaky",
            "strict",
            "hostile",
            "enrich_py",
        ])
    });
    registry
        .active(name)
        .unwrap_or_else(|| panic!("{name} is not active"))
}

fn event(id: &str, ty: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/tests", "type": ty, "subject": "s-1", "data": data})
}

fn delivery() -> DeliveryInfo {
    DeliveryInfo {
        attempt: 1,
        idempotency_key: "idem-1".into(),
        rule: "r".into(),
        target: "t".into(),
    }
}

fn run(name: &str, event: &Value, limits: &HandlerLimits) -> Invocation {
    invoke(&loaded(name), event, &delivery(), Arc::new(EmptyKv), limits)
}

/// A key-value store the tests commit writes to, as the router would after an ack.
#[derive(Default)]
struct MapKv(Mutex<HashMap<String, Vec<u8>>>);

impl KvReader for MapKv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(self.0.lock().unwrap().get(key).cloned())
    }
}

impl MapKv {
    fn commit(&self, writes: &[KvWrite]) {
        let mut map = self.0.lock().unwrap();
        for w in writes {
            match &w.value {
                Some(v) => map.insert(w.key.clone(), v.clone()),
                None => map.remove(&w.key),
            };
        }
    }
}

#[test]
fn enrich_emits_the_derived_event() {
    let inv = run(
        "enrich",
        &event("e1", "order.created", json!({"a": 1, "b": "x"})),
        &HandlerLimits::default(),
    );
    assert_eq!(
        inv.outcome,
        InvocationOutcome::Emitted(vec![json!({
            "type": "order.created.enriched",
            "subject": "s-1",
            "datacontenttype": "application/json",
            "data": {"a": 1, "b": "x", "enriched": true, "len": 2}
        })])
    );
    assert!(inv.kv_writes.is_empty() && inv.cas_checks.is_empty());
}

#[test]
fn enrich_py_gives_the_same_result_as_enrich() {
    let inputs = [
        json!({"a": 1, "b": "x"}),
        json!({}),
        json!({"nested": {"k": [1, 2, {"z": null}]}, "s": "héllo", "n": -3, "f": 2.5, "t": true}),
        json!({"enriched": false, "len": 99, "k": 1}),
    ];
    for (i, data) in inputs.into_iter().enumerate() {
        let ev = event(&format!("py{i}"), "order.created", data);
        let rust = run("enrich", &ev, &HandlerLimits::default());
        let py = run("enrich_py", &ev, &HandlerLimits::default());
        assert_eq!(
            py.outcome, rust.outcome,
            "input #{i}; python logs: {:?}",
            py.logs
        );
    }
    let not_object = event("py-bad", "t", json!([1, 2]));
    assert!(matches!(
        run("enrich", &not_object, &HandlerLimits::default()).outcome,
        InvocationOutcome::Fail(_)
    ));
    assert!(matches!(
        run("enrich_py", &not_object, &HandlerLimits::default()).outcome,
        InvocationOutcome::Fail(_)
    ));
}

#[test]
fn invoice_records_each_order_once_through_compare_and_set() {
    let kv = Arc::new(MapKv::default());
    let ev = event("i1", "order.paid", json!({"order_id": "A-17"}));
    let first = invoke(
        &loaded("invoice"),
        &ev,
        &delivery(),
        kv.clone(),
        &HandlerLimits::default(),
    );
    assert_eq!(first.outcome, InvocationOutcome::Emitted(vec![]));
    assert_eq!(first.kv_writes.len(), 1);
    assert_eq!(first.kv_writes[0].key, "invoice:A-17");
    let record: Value =
        serde_json::from_slice(first.kv_writes[0].value.as_deref().unwrap()).unwrap();
    assert_eq!(
        record,
        json!({"event_id": "i1", "idempotency_key": "idem-1"})
    );
    // The precondition the router re-checks at commit: the key was absent.
    assert_eq!(first.cas_checks, vec![("invoice:A-17".to_owned(), None)]);
    kv.commit(&first.kv_writes);

    let second = invoke(
        &loaded("invoice"),
        &ev,
        &delivery(),
        kv.clone(),
        &HandlerLimits::default(),
    );
    assert_eq!(second.outcome, InvocationOutcome::Emitted(vec![]));
    assert!(second.kv_writes.is_empty(), "{:?}", second.kv_writes);
    assert_eq!(
        second.cas_checks,
        vec![("invoice:A-17".to_owned(), first.kv_writes[0].value.clone())]
    );
    assert!(
        second
            .logs
            .iter()
            .any(|l| l.message.contains("already recorded")),
        "{:?}",
        second.logs
    );
}

#[test]
fn flaky_asks_for_retries_with_a_delay_then_succeeds() {
    let kv = Arc::new(MapKv::default());
    let ev = event("f1", "t", json!({"fail_times": 2}));
    for attempt in 1..=2 {
        let inv = invoke(
            &loaded("flaky"),
            &ev,
            &delivery(),
            kv.clone(),
            &HandlerLimits::default(),
        );
        match &inv.outcome {
            InvocationOutcome::Retry { delay, message } => {
                assert_eq!(*delay, Some(Duration::from_millis(100)));
                assert!(message.contains(&format!("attempt {attempt}")), "{message}");
            }
            other => panic!("attempt {attempt}: {other:?}"),
        }
        // Writes come back with a retry too: the router commits them with the attempt record.
        assert_eq!(inv.kv_writes.len(), 1);
        assert_eq!(inv.kv_writes[0].ttl_ms, Some(24 * 3600 * 1000));
        kv.commit(&inv.kv_writes);
    }
    let third = invoke(
        &loaded("flaky"),
        &ev,
        &delivery(),
        kv.clone(),
        &HandlerLimits::default(),
    );
    assert_eq!(third.outcome, InvocationOutcome::Emitted(vec![]));
    // The default is two failures.
    let default = event("f2", "t", json!({}));
    assert!(matches!(
        run("flaky", &default, &HandlerLimits::default()).outcome,
        InvocationOutcome::Retry { .. }
    ));
}

#[test]
fn strict_fails_permanently_unless_valid() {
    let ok = run(
        "strict",
        &event("s1", "t", json!({"valid": true})),
        &HandlerLimits::default(),
    );
    assert_eq!(ok.outcome, InvocationOutcome::Emitted(vec![]));
    for data in [json!({"valid": false}), json!({"valid": "true"}), json!({})] {
        let inv = run("strict", &event("s2", "t", data), &HandlerLimits::default());
        assert!(
            matches!(&inv.outcome, InvocationOutcome::Fail(m) if m.contains("data.valid is not true")),
            "{:?}",
            inv.outcome
        );
    }
}

#[test]
fn noop_emits_nothing() {
    let inv = run(
        "noop",
        &event("n1", "t", json!(null)),
        &HandlerLimits::default(),
    );
    assert_eq!(inv.outcome, InvocationOutcome::Emitted(vec![]));
    assert!(inv.logs.is_empty());
}

/// Runs `hostile` in `mode` while another thread keeps invoking `enrich`; returns the hostile
/// invocation after checking that every neighbour invocation succeeded.
fn hostile_with_neighbour(mode: Value, limits: &HandlerLimits) -> Invocation {
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let neighbour = {
        let (stop, ok) = (stop.clone(), ok.clone());
        std::thread::spawn(move || {
            let ev = event("n", "t", json!({"k": 1}));
            while !stop.load(Ordering::Relaxed) {
                let inv = run("enrich", &ev, &HandlerLimits::default());
                assert!(
                    matches!(inv.outcome, InvocationOutcome::Emitted(ref v) if v.len() == 1),
                    "{:?}",
                    inv.outcome
                );
                ok.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let inv = run("hostile", &event("h1", "t", mode), limits);
    // Let the neighbour finish at least one call after the hostile one, too.
    let seen = ok.load(Ordering::Relaxed);
    while ok.load(Ordering::Relaxed) <= seen {
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    neighbour
        .join()
        .expect("the neighbour handler failed while the hostile one ran");
    assert!(inv.kv_writes.is_empty() && inv.cas_checks.is_empty());
    inv
}

#[test]
fn hostile_loop_times_out() {
    let limits = HandlerLimits {
        timeout: Duration::from_millis(300),
        ..HandlerLimits::default()
    };
    let inv = hostile_with_neighbour(json!({"mode": "loop"}), &limits);
    assert_eq!(inv.outcome, InvocationOutcome::Timeout);
    // Generous bound: the deadline is 300 ms at a 10 ms tick; a loaded 2-core CI box may lag.
    assert!(
        inv.duration >= Duration::from_millis(290) && inv.duration < Duration::from_secs(3),
        "{:?}",
        inv.duration
    );
}

/// A guest that sleeps blocks in the host, where epoch interruption cannot reach it: waiting on
/// a clock traps at once instead of outliving the timeout (an hour here).
#[test]
fn hostile_sleep_traps_instead_of_outliving_its_timeout() {
    let limits = HandlerLimits {
        timeout: Duration::from_millis(300),
        ..HandlerLimits::default()
    };
    let inv = hostile_with_neighbour(json!({"mode": "sleep"}), &limits);
    // The router's explanation opens the message, not the wasm backtrace.
    match &inv.outcome {
        InvocationOutcome::Trap(m) => {
            assert!(m.lines().next().unwrap().contains("cannot sleep"), "{m}");
            assert_one_backtrace(m);
        }
        other => panic!("{other:?}"),
    }
    assert!(inv.duration < Duration::from_secs(3), "{:?}", inv.duration);
}

/// A trap's message holds the wasm backtrace once, after its first line.
fn assert_one_backtrace(m: &str) {
    assert_eq!(
        m.matches("error while executing at wasm backtrace:")
            .count(),
        1,
        "{m}"
    );
    assert!(!m.lines().next().unwrap().contains("backtrace"), "{m}");
    assert!(!m.contains("wasm trap: wasm trap"), "{m}");
}

#[test]
fn hostile_memory_bomb_is_oom() {
    let limits = HandlerLimits {
        memory_bytes: 32 << 20,
        ..HandlerLimits::default()
    };
    let inv = hostile_with_neighbour(json!({"mode": "oom"}), &limits);
    assert_eq!(inv.outcome, InvocationOutcome::Oom);
}

#[test]
fn hostile_deep_recursion_is_a_stack_overflow_trap() {
    let inv = hostile_with_neighbour(json!({"mode": "stack"}), &HandlerLimits::default());
    match inv.outcome {
        InvocationOutcome::Trap(m) => {
            assert_eq!(
                m.lines().next(),
                Some("wasm trap: stack overflow (call stack exhausted)"),
                "{m}"
            );
            assert_one_backtrace(&m);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_panic_is_a_trap_with_the_panic_message() {
    let inv = hostile_with_neighbour(json!({"mode": "panic"}), &HandlerLimits::default());
    match inv.outcome {
        InvocationOutcome::Trap(m) => {
            assert_eq!(
                m.lines().next(),
                Some(
                    "guest panicked: hostile handler panicked on purpose (event h1) (wasm trap: wasm `unreachable` instruction executed)"
                ),
                "{m}"
            );
            assert!(m.contains("\nguest stderr:\n"), "{m}");
            assert_one_backtrace(&m);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_output_floods_exceed_the_limits() {
    let inv = hostile_with_neighbour(json!({"mode": "output"}), &HandlerLimits::default());
    match inv.outcome {
        InvocationOutcome::LimitExceeded(m) => assert!(
            m.contains("emitted 10000 events") && m.ends_with("(handlers.max_emitted)"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    let inv = hostile_with_neighbour(
        json!({"mode": "output", "size": "big"}),
        &HandlerLimits::default(),
    );
    match inv.outcome {
        InvocationOutcome::LimitExceeded(m) => assert!(
            m.contains("bytes; the limit") && m.ends_with("(handlers.max_output_bytes)"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_log_flood_is_capped_and_the_call_completes() {
    let limits = HandlerLimits::default();
    let inv = hostile_with_neighbour(json!({"mode": "log"}), &limits);
    assert_eq!(inv.outcome, InvocationOutcome::Emitted(vec![]));
    let kept: usize = inv.logs.iter().map(|l| l.message.len()).sum();
    assert!(
        kept <= limits.max_log_bytes + 512,
        "{kept} bytes of logs kept"
    );
    let last = inv.logs.last().unwrap();
    assert!(
        last.message
            .contains("log limit of 65536 bytes per invocation reached"),
        "{}",
        last.message
    );
    // The count the router's metric adds, as the closing note says it.
    let kept_lines = inv.logs.len() as u64 - 1;
    assert_eq!(
        inv.log_lines_dropped + kept_lines,
        20_000,
        "{}",
        last.message
    );
    assert!(
        last.message
            .contains(&format!("{} more lines", inv.log_lines_dropped)),
        "{}",
        last.message
    );
}

#[test]
fn fuel_exhaustion_is_a_limit() {
    let dir = tempfile::tempdir().unwrap();
    let fuel_engine = WasmEngine::new(EngineConfig {
        fuel: true,
        ..EngineConfig::default()
    })
    .unwrap();
    let registry = HandlerRegistry::open(dir.path(), fuel_engine).unwrap();
    registry
        .upload("hostile", &plugin("hostile"), "tests")
        .unwrap();
    let limits = HandlerLimits {
        fuel: Some(5_000_000),
        ..HandlerLimits::default()
    };
    let h = registry.active("hostile").unwrap();
    let inv = invoke(
        &h,
        &event("f", "t", json!({"mode": "loop"})),
        &delivery(),
        Arc::new(EmptyKv),
        &limits,
    );
    // The budget and the key that sets it, so the team knows what to raise.
    assert_eq!(
        inv.outcome,
        InvocationOutcome::LimitExceeded(
            "fuel exhausted: the handler used up its budget of 5000000 instructions (handlers.fuel)"
                .into()
        )
    );
    let calm = invoke(
        &h,
        &event("f", "t", json!({})),
        &delivery(),
        Arc::new(EmptyKv),
        &limits,
    );
    assert_eq!(calm.outcome, InvocationOutcome::Emitted(vec![]));
}

#[test]
fn kv_writes_over_the_limit_cost_the_invocation_and_return_nothing() {
    let limits = HandlerLimits {
        max_kv_write_bytes: 16,
        ..HandlerLimits::default()
    };
    let inv = run(
        "invoice",
        &event("k", "order.paid", json!({"order_id": "A-1"})),
        &limits,
    );
    match inv.outcome {
        InvocationOutcome::LimitExceeded(m) => assert!(m.contains("kv writes"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(inv.kv_writes.is_empty() && inv.cas_checks.is_empty());
}

/// `limits::MAX_MEMORY_BYTES` is the engine's own bound: the configuration refuses more at
/// start, since past it the engine refuses its pool and the router ran with no handler
/// runtime at all.
#[test]
fn the_largest_memory_cap_is_what_the_engine_reserves() {
    let engine_with = |max_memory_bytes: usize| {
        WasmEngine::new(EngineConfig {
            max_instances: 1,
            max_memory_bytes,
            ..EngineConfig::default()
        })
    };
    let max = usize::try_from(limits::MAX_MEMORY_BYTES).expect("a 64-bit host");
    assert!(engine_with(max).is_ok());
    let err = engine_with(max + (64 << 10)).expect_err("past the reservation");
    assert!(err.to_string().contains("memory reservation"), "{err}");
}

/// Tiny writes by the thousand were each an operation of the store's single writer (140,000
/// of them held one commit, and every producer's ingest, for 8 s): past `max_kv_ops` the
/// invocation is a `handler_limit` and hands nothing to the commit.
#[test]
fn kv_operations_past_the_cap_cost_the_invocation_and_return_nothing() {
    let limits = HandlerLimits::default();
    let n = limits.max_kv_ops as u64;
    let at_cap = run(
        "hostile",
        &event("k", "t", json!({"mode": "kv", "n": n})),
        &limits,
    );
    assert_eq!(at_cap.outcome, InvocationOutcome::Emitted(vec![]));
    assert_eq!(at_cap.kv_writes.len(), limits.max_kv_ops);
    let past = run(
        "hostile",
        &event("k", "t", json!({"mode": "kv", "n": n + 1})),
        &limits,
    );
    match past.outcome {
        InvocationOutcome::LimitExceeded(m) => assert!(m.contains("handlers.max_kv_ops"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(past.kv_writes.is_empty());
}

#[test]
fn a_memory_cap_below_the_initial_memory_is_oom() {
    let limits = HandlerLimits {
        memory_bytes: 64 << 10,
        ..HandlerLimits::default()
    };
    assert_eq!(
        run("enrich", &event("m", "t", json!({})), &limits).outcome,
        InvocationOutcome::Oom
    );
}

#[test]
fn invalid_events_fail_without_running_the_handler() {
    let inv = run("noop", &json!({"id": "x"}), &HandlerLimits::default());
    assert!(
        matches!(inv.outcome, InvocationOutcome::Fail(ref m) if m.contains("\"source\"")),
        "{:?}",
        inv.outcome
    );
}

#[test]
fn upload_refuses_what_is_not_a_handler() {
    let (_dir, registry) = registry_with(&[]);
    let random: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    assert!(matches!(
        registry.upload("x", &random, "t"),
        Err(UploadError::NotComponent(_))
    ));
    let mut truncated = plugin("noop");
    truncated.truncate(truncated.len() / 2);
    assert!(matches!(
        registry.upload("noop", &truncated, "t"),
        Err(UploadError::Uncompilable(..))
    ));
    // A valid component whose memory minimum is past the pool's slot (1 GiB here) is no
    // less a component: the answer says what it needs more of, not "not a component".
    let big_memory = wat::parse_str(
        "(component (core module $m (memory 16384)) (core instance (instantiate $m)))",
    )
    .unwrap();
    let err = registry.upload("x", &big_memory, "t").unwrap_err();
    assert!(matches!(err, UploadError::Uncompilable(..)), "{err}");
    let text = err.to_string();
    assert!(
        !text.contains("not a WebAssembly component") && text.contains("handlers.memory_bytes"),
        "{text}"
    );

    let core = wat::parse_str("(module (func (export \"handle\")))").unwrap();
    let err = registry.upload("x", &core, "t").unwrap_err();
    assert!(matches!(err, UploadError::WrongWorld(_)), "{err}");
    assert!(err.to_string().contains("core WebAssembly module"), "{err}");

    let empty_component = wat::parse_str("(component)").unwrap();
    let err = registry.upload("x", &empty_component, "t").unwrap_err();
    assert!(matches!(err, UploadError::WrongWorld(_)), "{err}");

    let other_world = wat::parse_str(
        r#"(component (import "acme:other/thing@1.0.0" (instance (export "poke" (func)))))"#,
    )
    .unwrap();
    let err = registry.upload("x", &other_world, "t").unwrap_err();
    assert!(matches!(err, UploadError::WrongWorld(_)), "{err}");

    let err = registry
        .upload("not-noop", &plugin("noop"), "t")
        .unwrap_err();
    assert!(
        matches!(&err, UploadError::NameMismatch { expected, described } if expected == "not-noop" && described == "noop"),
        "{err}"
    );
    assert!(matches!(
        registry.upload("Bad/Name", &plugin("noop"), "t"),
        Err(UploadError::InvalidName(_))
    ));
    // Nothing of the refused uploads was stored.
    assert!(registry.list().is_empty());
}

/// The same component with a custom section appended: a different hash, the same behaviour.
fn variant_of(bytes: &[u8], tag: &str) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let name = b"router-test";
    let payload_len = 1 + name.len() + tag.len();
    out.push(0); // custom section
    out.push(u8::try_from(payload_len).unwrap());
    out.push(u8::try_from(name.len()).unwrap());
    out.extend_from_slice(name);
    out.extend_from_slice(tag.as_bytes());
    out
}

#[test]
fn versions_rollback_reupload_and_delete() {
    let (dir, registry) = registry_with(&[]);
    let v1_bytes = plugin("noop");
    let v2_bytes = variant_of(&v1_bytes, "v2");
    let v1 = registry.upload("noop", &v1_bytes, "alice").unwrap();
    let v2 = registry.upload("noop", &v2_bytes, "bob").unwrap();
    assert_eq!((v1.version, v2.version), (1, 2));
    assert_ne!(v1.sha256, v2.sha256);
    assert_eq!(v1.descriptor.name, "noop");
    assert_eq!(registry.active("noop").unwrap().version().sha256, v2.sha256);

    let back = registry.rollback("noop", "1").unwrap();
    assert_eq!(back, v1);
    assert_eq!(registry.active("noop").unwrap().version().version, 1);
    let forward = registry.rollback("noop", &v2.sha256[..12]).unwrap();
    assert_eq!(forward.version, 2);
    assert!(matches!(
        registry.rollback("noop", "9"),
        Err(RegistryError::UnknownVersion { .. })
    ));
    assert!(matches!(
        registry.rollback("nope", "1"),
        Err(RegistryError::UnknownHandler(_))
    ));

    // Re-uploading known bytes re-activates that version instead of adding one.
    let again = registry.upload("noop", &v1_bytes, "carol").unwrap();
    assert_eq!((again.version, again.uploader.as_str()), (1, "alice"));
    let info = registry.get("noop").unwrap();
    assert_eq!(info.versions.len(), 2);
    assert_eq!(info.active.unwrap().version, 1);

    // The index and the versions survive a reopen.
    let reopened = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    let info = reopened.get("noop").unwrap();
    assert_eq!(
        (info.versions.len(), info.active.map(|v| v.version)),
        (2, Some(1))
    );
    let h = reopened.active("noop").unwrap();
    assert_eq!(
        invoke(
            &h,
            &event("x", "t", json!({})),
            &delivery(),
            Arc::new(EmptyKv),
            &HandlerLimits::default()
        )
        .outcome,
        InvocationOutcome::Emitted(vec![])
    );

    assert!(reopened.delete("noop").unwrap());
    assert!(reopened.active("noop").is_none() && reopened.list().is_empty());
    // No team owned it, yet the delete only removes its versions: the name's record stays
    // (its key-value entries and logs with it) until a release.
    let kept: Vec<String> = std::fs::read_dir(dir.path().join("handlers/noop"))
        .unwrap()
        .filter_map(|d| d.ok()?.file_name().into_string().ok())
        .collect();
    assert_eq!(kept, ["index.json"]);
    assert!(!reopened.delete("noop").unwrap());
    // A running invocation's handle outlives the delete.
    assert_eq!(
        invoke(
            &h,
            &event("x", "t", json!({})),
            &delivery(),
            Arc::new(EmptyKv),
            &HandlerLimits::default()
        )
        .outcome,
        InvocationOutcome::Emitted(vec![])
    );
}

#[test]
fn past_keep_versions_the_oldest_version_and_its_component_go_but_never_the_active_one() {
    let dir = tempfile::tempdir().unwrap();
    let handlers = dir.path().join("handlers");
    let registry = HandlerRegistry::open(&handlers, engine())
        .unwrap()
        .with_keep_versions(2);
    let bytes: Vec<Vec<u8>> = (1..=4)
        .map(|n| variant_of(&plugin("noop"), &format!("v{n}")))
        .collect();
    let components = || {
        let mut files: Vec<String> = std::fs::read_dir(handlers.join("noop"))
            .unwrap()
            .filter_map(|d| d.ok()?.file_name().into_string().ok())
            .filter(|f| f.ends_with(".wasm"))
            .collect();
        files.sort();
        files
    };
    let numbers = |r: &HandlerRegistry| -> Vec<u32> {
        r.get("noop")
            .unwrap()
            .versions
            .iter()
            .map(|v| v.version)
            .collect()
    };
    let v1 = registry.upload("noop", &bytes[0], "t").unwrap();
    registry.upload("noop", &bytes[1], "t").unwrap();
    registry.upload("noop", &bytes[2], "t").unwrap();
    assert_eq!(numbers(&registry), [2, 3]);
    assert_eq!(components().len(), 2);
    assert!(!components().contains(&format!("{}.wasm", v1.sha256)));
    assert!(matches!(
        registry.rollback("noop", "1"),
        Err(RegistryError::UnknownVersion { .. })
    ));
    registry.upload("noop", &bytes[3], "t").unwrap();
    assert_eq!(numbers(&registry), [3, 4]);
    // The bytes of the forgotten version 1 come back as a new version.
    let again = registry.upload("noop", &bytes[0], "t").unwrap();
    assert_eq!(again.version, 5);
    assert_eq!(numbers(&registry), [4, 5]);
    assert_eq!(components().len(), 2);
    drop(registry);

    // The bound lowered while an old version is active (rolled back to): that version stays.
    let registry = HandlerRegistry::open(&handlers, engine())
        .unwrap()
        .with_keep_versions(3);
    let v6 = variant_of(&plugin("noop"), "v6");
    registry.upload("noop", &v6, "t").unwrap();
    registry.rollback("noop", "4").unwrap();
    drop(registry);
    let registry = HandlerRegistry::open(&handlers, engine())
        .unwrap()
        .with_keep_versions(1);
    // Version 4's bytes again: re-activated; the newest (6) is kept, and 4 as the active one.
    registry.upload("noop", &bytes[3], "t").unwrap();
    assert_eq!(numbers(&registry), [4, 6]);
    let v7 = registry
        .upload("noop", &variant_of(&plugin("noop"), "v7"), "t")
        .unwrap();
    assert_eq!((v7.version, numbers(&registry)), (7, vec![7]));
    assert_eq!(components(), [format!("{}.wasm", v7.sha256)]);
    // What is kept survives a reopen and the active version loads.
    let reopened = HandlerRegistry::open(&handlers, engine()).unwrap();
    assert_eq!(numbers(&reopened), [7]);
    assert_eq!(reopened.active("noop").unwrap().version().version, 7);
}

/// An administrator uploading for a team (`?team=`) gives the handler to that team: another
/// team can no longer take it over by uploading next. Without it, the first team to upload
/// claims it, as before.
#[test]
fn an_administrators_upload_for_a_team_gives_it_that_team() {
    let (_dir, registry) = registry_with(&[]);
    let ops = |team: Option<&str>| Uploader {
        for_team: team.map(str::to_owned),
        ..Uploader::from("ops")
    };
    let member = |team: &str| Uploader {
        token: format!("{team}-ci"),
        team: team.into(),
        admin: false,
        preload: false,
        // A non-administrator cannot give a handler away.
        for_team: Some("someone-else".into()),
    };
    registry
        .upload("noop", &plugin("noop"), ops(Some("billing")))
        .unwrap();
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing")
    );
    assert!(matches!(
        registry.upload("noop", &variant_of(&plugin("noop"), "x"), member("crm")),
        Err(UploadError::OwnedByAnotherTeam(_))
    ));
    registry
        .upload("noop", &variant_of(&plugin("noop"), "y"), member("billing"))
        .unwrap();
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing"),
        "a member's upload keeps it with its team"
    );
    // Unnamed, an administrator's upload leaves the handler to the first team that uploads.
    registry
        .upload("enrich", &plugin("enrich"), ops(None))
        .unwrap();
    assert_eq!(registry.get("enrich").unwrap().owner, None);
}

#[test]
fn a_handler_belongs_to_its_first_uploaders_team() {
    let (dir, registry) = registry_with(&[]);
    let member = |token: &str, team: &str| Uploader {
        token: token.into(),
        team: team.into(),
        admin: false,
        preload: false,
        for_team: None,
    };
    let v1 = registry
        .upload("noop", &plugin("noop"), member("billing-ci", "billing"))
        .unwrap();
    assert_eq!(v1.team.as_deref(), Some("billing"));
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing")
    );
    // Another team, whatever its scopes allowed the API to let through: refused, unchanged.
    let refused = registry.upload(
        "noop",
        &variant_of(&plugin("noop"), "x"),
        member("crm-ci", "crm"),
    );
    assert!(
        matches!(&refused, Err(UploadError::OwnedByAnotherTeam(e)) if e.owner == "billing"),
        "{refused:?}"
    );
    assert_eq!(registry.get("noop").unwrap().versions.len(), 1);
    // Nor roll it back or delete it.
    let crm = member("crm-ci", "crm");
    assert!(matches!(
        registry.rollback_as("noop", "1", &crm),
        Err(RegistryError::OwnedByAnotherTeam(_))
    ));
    assert!(matches!(
        registry.delete_as("noop", &crm, false),
        Err(RegistryError::OwnedByAnotherTeam(_))
    ));
    assert!(registry.active("noop").is_some());
    // The same team with a rotated token, and an administrator, may.
    let v2 = registry
        .upload(
            "noop",
            &variant_of(&plugin("noop"), "2"),
            member("billing-ci-2026", "billing"),
        )
        .unwrap();
    assert_eq!((v2.version, v2.uploader.as_str()), (2, "billing-ci-2026"));
    registry
        .upload("noop", &variant_of(&plugin("noop"), "3"), "ops")
        .unwrap();
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing"),
        "an administrator's upload does not take the handler over"
    );
    // Ownership is kept across a reopen, and after a delete (across a reopen too), until the
    // team releases the name.
    let reopened = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert_eq!(
        reopened.get("noop").unwrap().owner.as_deref(),
        Some("billing")
    );
    assert!(reopened.delete("noop").unwrap());
    assert!(reopened.get("noop").is_none() && reopened.list().is_empty());
    assert!(reopened.active("noop").is_none());
    let reopened = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert!(reopened.get("noop").is_none());
    assert!(matches!(
        reopened.upload("noop", &plugin("noop"), member("crm-ci", "crm")),
        Err(UploadError::OwnedByAnotherTeam(e)) if e.owner == "billing"
    ));
    assert!(matches!(
        reopened.rollback_as("noop", "1", &member("billing-ci", "billing")),
        Err(RegistryError::UnknownHandler(_))
    ));
    assert!(
        matches!(
            reopened.delete_as("noop", &member("billing-ci", "billing"), false),
            Ok(Deletion::Unknown)
        ),
        "deleting it again changes nothing"
    );
    assert!(matches!(
        reopened.delete_as("noop", &member("crm-ci", "crm"), true),
        Err(RegistryError::OwnedByAnotherTeam(_))
    ));
    assert!(matches!(
        reopened.delete_as("noop", &member("billing-ci", "billing"), true),
        Ok(Deletion::Released)
    ));
    assert!(!dir.path().join("handlers/noop").exists());
    let claimed = reopened
        .upload("noop", &plugin("noop"), member("crm-ci", "crm"))
        .unwrap();
    assert_eq!(claimed.version, 1);
    assert_eq!(reopened.get("noop").unwrap().owner.as_deref(), Some("crm"));

    // An administrator's first upload does not claim the name; the first team's does.
    reopened.upload("enrich", &plugin("enrich"), "ops").unwrap();
    assert_eq!(reopened.get("enrich").unwrap().owner, None);
    reopened
        .upload(
            "enrich",
            &variant_of(&plugin("enrich"), "b"),
            member("b-ci", "billing"),
        )
        .unwrap();
    assert_eq!(
        reopened.get("enrich").unwrap().owner.as_deref(),
        Some("billing")
    );
}

/// A plain delete never frees a name, even one no team owns (auth off, or only administrators
/// uploaded it): freeing is what removes the handler's key-value entries and logs for good,
/// and an idempotent handler's entries are its record of what it already did. The record
/// stays (across a reopen), anyone who may upload the name finds it again, and only a release
/// frees it. An older router refuses the record (format 2) rather than read it as free.
#[test]
fn a_plain_delete_of_an_unowned_handler_keeps_its_name_until_released() {
    let (dir, registry) = registry_with(&[]);
    registry.upload("noop", &plugin("noop"), "ops").unwrap();
    assert_eq!(registry.get("noop").unwrap().owner, None);
    assert_eq!(
        registry
            .delete_as("noop", &Uploader::from("ops"), false)
            .unwrap(),
        Deletion::Deleted { kept_by: None }
    );
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert!(registry.get("noop").is_none() && registry.active("noop").is_none());
    let kept = registry
        .index("noop")
        .expect("the deleted handler's record is kept");
    assert!(kept.deleted && kept.kept && kept.owner.is_none() && !kept.is_free());
    let stored: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("handlers/noop/index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(stored["format"], 2, "{stored}");
    assert_eq!(
        registry
            .delete_as("noop", &Uploader::from("ops"), false)
            .unwrap(),
        Deletion::Unknown,
        "deleting it again changes nothing"
    );
    // Uploaded again (here by a team, which claims it as it could before the delete): a new
    // history, format 1 again.
    let team = Uploader {
        token: "billing-ci".into(),
        team: "billing".into(),
        admin: false,
        preload: false,
        for_team: None,
    };
    let again = registry
        .upload("noop", &plugin("noop"), team.clone())
        .unwrap();
    assert_eq!(again.version, 1);
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing")
    );
    let index = registry.index("noop").unwrap();
    assert!(!index.kept && !index.deleted);

    // An administrator's handler deleted, then released: only the release frees the name.
    registry.upload("enrich", &plugin("enrich"), "ops").unwrap();
    assert_eq!(
        registry
            .delete_as("enrich", &Uploader::from("ops"), false)
            .unwrap(),
        Deletion::Deleted { kept_by: None }
    );
    assert!(dir.path().join("handlers/enrich/index.json").is_file());
    assert_eq!(
        registry.delete_as("enrich", &team, true).unwrap(),
        Deletion::Released
    );
    assert!(registry.index("enrich").is_none());
    assert!(!dir.path().join("handlers/enrich").exists());
    // Deleted and released at once.
    registry.upload("strict", &plugin("strict"), "ops").unwrap();
    assert_eq!(
        registry
            .delete_as("strict", &Uploader::from("ops"), true)
            .unwrap(),
        Deletion::Deleted { kept_by: None }
    );
    assert!(!dir.path().join("handlers/strict").exists());
}

#[test]
fn an_index_from_before_teams_belongs_to_its_first_uploader() {
    let (dir, registry) = registry_with(&[]);
    registry.upload("noop", &plugin("noop"), "billing").unwrap();
    drop(registry);
    // As written before ownership was kept: no owner, no team on the versions.
    let path = dir.path().join("handlers/noop/index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index.as_object_mut().unwrap().remove("owner");
    for v in index["versions"].as_array_mut().unwrap() {
        v.as_object_mut().unwrap().remove("team");
    }
    std::fs::write(&path, serde_json::to_vec(&index).unwrap()).unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert_eq!(
        registry.get("noop").unwrap().owner.as_deref(),
        Some("billing")
    );
    let other = Uploader {
        token: "crm-ci".into(),
        team: "crm".into(),
        admin: false,
        preload: false,
        for_team: None,
    };
    assert!(matches!(
        registry.upload("noop", &variant_of(&plugin("noop"), "x"), other.clone()),
        Err(UploadError::OwnedByAnotherTeam(_))
    ));
    assert!(matches!(
        registry.delete_as("noop", &other, false),
        Err(RegistryError::OwnedByAnotherTeam(_))
    ));
}

#[test]
fn preloaded_bytes_are_remembered_after_their_version_is_no_longer_kept() {
    let dir = tempfile::tempdir().unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine())
        .unwrap()
        .with_keep_versions(1);
    let preloaded = plugin("noop");
    registry
        .upload("noop", &preloaded, Uploader::preload("preload"))
        .unwrap();
    assert!(registry.was_preloaded("noop", &preloaded));
    // An operator's newer version; the preloaded one is no longer kept.
    registry
        .upload("noop", &variant_of(&preloaded, "v2"), "ops")
        .unwrap();
    assert!(registry.stored_version("noop", &preloaded).is_none());
    assert!(
        registry.was_preloaded("noop", &preloaded),
        "a start finding the same file leaves the handler as it is"
    );
    assert!(!registry.was_preloaded("noop", &variant_of(&preloaded, "v3")));
}

#[test]
fn reopening_loads_compiled_code_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default();
    let handlers = dir.path().join("handlers");
    {
        let engine = WasmEngine::new(config.clone()).unwrap();
        let registry = HandlerRegistry::open(&handlers, engine).unwrap();
        registry.upload("noop", &plugin("noop"), "t").unwrap();
        registry.upload("enrich", &plugin("enrich"), "t").unwrap();
        assert_eq!(registry.compilations(), 2);
    }
    // A "restart": a new engine and registry over the same directories.
    let engine = WasmEngine::new(config).unwrap();
    let registry = HandlerRegistry::open(&handlers, engine).unwrap();
    assert_eq!(registry.compilations(), 0);
    let h = registry.active("enrich").unwrap();
    let inv = invoke(
        &h,
        &event("c", "t", json!({"a": 1})),
        &delivery(),
        Arc::new(EmptyKv),
        &HandlerLimits::default(),
    );
    assert!(matches!(inv.outcome, InvocationOutcome::Emitted(ref v) if v.len() == 1));
}

/// What the tracing events of `f` (on this thread) wrote, as the router's log would show them.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    let (log, guard) = crate::telemetry::test_log::capture();
    let out = f();
    drop(guard);
    (out, log.text())
}

/// The stored compiled code of `name`'s active version.
fn compiled_code_path(handlers: &Path, registry: &HandlerRegistry, name: &str) -> PathBuf {
    let sha = registry.active(name).unwrap().version().sha256.clone();
    handlers.join(name).join(format!("{sha}.cwasm"))
}

/// Stored compiled code is machine code the router maps executable: one flipped bit in it
/// used to run as garbage (a SIGSEGV of the whole router at the handler's first delivery, or
/// SIGILL at every start), and another handler's file copied over it ran as that handler.
/// Each of those is now caught by its check at the next open: the file is removed with a
/// warning and the component compiled again, and the handler runs its own code.
#[test]
fn damaged_compiled_code_is_compiled_again_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let handlers = dir.path().join("handlers");
    let (path, noop_path) = {
        let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
        registry.upload("enrich", &plugin("enrich"), "t").unwrap();
        registry.upload("noop", &plugin("noop"), "t").unwrap();
        (
            compiled_code_path(&handlers, &registry, "enrich"),
            compiled_code_path(&handlers, &registry, "noop"),
        )
    };
    let good = std::fs::read(&path).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x10;
    let damages: [(&str, Vec<u8>, &str); 4] = [
        (
            "a flipped bit",
            flipped,
            "its SHA-256 does not match its contents",
        ),
        (
            "a truncated file",
            good[..good.len() - 4096].to_vec(),
            "its SHA-256 does not match its contents",
        ),
        (
            "another handler's compiled code",
            std::fs::read(&noop_path).unwrap(),
            "it holds the code of another component",
        ),
        ("an empty file", Vec::new(), "shorter than its header"),
    ];
    for (what, bytes, reason) in damages {
        std::fs::write(&path, &bytes).unwrap();
        let (registry, log) = logged(|| HandlerRegistry::open(&handlers, engine()).unwrap());
        assert_eq!(registry.compilations(), 1, "{what}: enrich compiled again");
        assert!(
            log.contains(&format!(
                "WARN router::wasm::registry: {} handler=\"enrich\"",
                registry::UNUSABLE_COMPILED_CODE
            )) && log.contains(&format!(
                "error=compiled code {} fails its check: {reason}",
                path.display()
            )),
            "{what}: {log}"
        );
        // It runs enrich's code, not the damaged file's.
        let inv = invoke(
            &registry.active("enrich").unwrap(),
            &event("d", "order.created", json!({"a": 1})),
            &delivery(),
            Arc::new(EmptyKv),
            &HandlerLimits::default(),
        );
        assert!(
            matches!(&inv.outcome, InvocationOutcome::Emitted(v) if v.len() == 1 && v[0]["data"]["enriched"] == true),
            "{what}: {:?}",
            inv.outcome
        );
        // Compiled again and stored again, checked: the next open loads it.
        assert_eq!(std::fs::read(&path).unwrap().len(), good.len(), "{what}");
        drop(registry);
        let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
        assert_eq!(registry.compilations(), 0, "{what}: stored again");
    }
}

/// The `*.cwasm` files (stored compiled code) under `dir`, by file name.
fn compiled_code_files(dir: &Path) -> Vec<String> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                dirs.push(e.path());
            } else if name.ends_with(".cwasm") || name.contains(".cwasm.") {
                files.push(name);
            }
        }
    }
    files.sort();
    files
}

/// Compiled code goes with its version: an upload past `keep_versions` removes the dropped
/// version's, a deleted handler's and a released name's go, a rejected upload stores none, and
/// an open removes any that no kept version refers to. Before, wasmtime's cache kept them all,
/// its size bounded by nothing the router controlled.
#[test]
fn compiled_code_is_removed_with_its_version() {
    let dir = tempfile::tempdir().unwrap();
    let handlers = dir.path().join("handlers");
    let registry = HandlerRegistry::open(&handlers, engine())
        .unwrap()
        .with_keep_versions(2);
    let noop = plugin("noop");
    let versions: Vec<Vec<u8>> = (1..=3)
        .map(|i| variant_of(&noop, &format!("v{i}")))
        .collect();
    let cwasm = |bytes: &[u8]| {
        use sha2::Digest;
        format!("{}.cwasm", hex::encode(sha2::Sha256::digest(bytes)))
    };
    let kept = |v: &[&Vec<u8>]| {
        let mut names: Vec<String> = v.iter().map(|b| cwasm(b)).collect();
        names.sort();
        names
    };
    for v in &versions {
        registry.upload("noop", v, "t").unwrap();
    }
    assert_eq!(
        compiled_code_files(&handlers),
        kept(&[&versions[1], &versions[2]]),
        "v1, dropped by keep_versions, took its compiled code along"
    );
    // A rejected upload (describe names another handler) stores nothing.
    assert!(matches!(
        registry.upload("other", &plugin("enrich"), "t"),
        Err(UploadError::NameMismatch { .. })
    ));
    assert_eq!(compiled_code_files(&handlers).len(), 2);
    // Left over by a crash between the index write and the removal, or a write that raced
    // one: removed at the next open, along with a temp file of an unfinished write.
    std::fs::copy(
        handlers.join("noop").join(cwasm(&versions[2])),
        handlers.join("noop").join(cwasm(&versions[0])),
    )
    .unwrap();
    let leftover = format!(".{}.12-3.tmp", cwasm(&versions[2]));
    std::fs::write(handlers.join("noop").join(&leftover), b"half").unwrap();
    drop(registry);
    let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
    assert_eq!(registry.compilations(), 0);
    assert_eq!(
        compiled_code_files(&handlers),
        kept(&[&versions[1], &versions[2]])
    );
    // A delete removes the versions and their compiled code; the name stays kept.
    registry.upload("enrich", &plugin("enrich"), "t").unwrap();
    assert!(registry.delete("noop").unwrap());
    assert_eq!(compiled_code_files(&handlers), kept(&[&plugin("enrich")]));
    // A release removes the handler's directory, compiled code and all.
    assert_eq!(
        registry
            .delete_as("enrich", &Uploader::from("ops"), true)
            .unwrap(),
        Deletion::Deleted { kept_by: None }
    );
    assert!(compiled_code_files(&handlers).is_empty());
}

#[test]
fn a_corrupt_stored_version_is_reported_not_fatal() {
    let (dir, registry) = registry_with(&["noop", "strict"]);
    let sha = registry.active("noop").unwrap().version().sha256.clone();
    drop(registry);
    std::fs::write(
        dir.path().join(format!("handlers/noop/{sha}.wasm")),
        b"garbage",
    )
    .unwrap();
    let reopened = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert!(reopened.active("noop").is_none());
    assert!(
        reopened
            .get("noop")
            .unwrap()
            .load_error
            .unwrap()
            .contains("SHA-256")
    );
    assert!(reopened.active("strict").is_some());
}

/// Overwrites 4 bytes in the middle of `noop`'s stored component (a disk that damaged it).
fn damage_component(handlers: &Path, name: &str, sha: &str) {
    let path = handlers.join(name).join(format!("{sha}.wasm"));
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle..middle + 4].copy_from_slice(b"XXXX");
    std::fs::write(&path, bytes).unwrap();
}

/// A stored component damaged on disk fails its version at the next open, shown as such
/// (`failed`, with why, and the same cause for its deliveries), not as a running handler.
/// Uploading the right bytes again repairs the file: it was kept unchecked before, so the 200
/// answer held only until the next start, which failed the handler again.
#[test]
fn a_reupload_repairs_a_damaged_component_and_a_failed_load_says_so() {
    let (dir, registry) = registry_with(&["noop"]);
    let handlers = dir.path().join("handlers");
    let sha = registry.active("noop").unwrap().version().sha256.clone();
    drop(registry);
    damage_component(&handlers, "noop", &sha);
    let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
    let info = registry.get("noop").unwrap();
    assert_eq!(info.state, HandlerState::Failed);
    assert!(
        info.load_error
            .unwrap()
            .contains("does not match its SHA-256")
    );
    match registry.lookup("noop") {
        Err(why @ NotLoaded::Failed { .. }) => {
            let why = why.to_string();
            assert!(
                why.starts_with(
                    "handler \"noop\" could not be loaded (cannot load \"noop\" version 1: "
                ) && why.ends_with("does not match its SHA-256); upload it again or roll it back"),
                "{why}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        registry.lookup("nothing").unwrap_err(),
        NotLoaded::NotUploaded("nothing".into())
    );
    // The same bytes again: the stored version, re-activated, and its file repaired.
    let v = registry.upload("noop", &plugin("noop"), "t").unwrap();
    assert_eq!(v.version, 1);
    assert_eq!(registry.get("noop").unwrap().state, HandlerState::Loaded);
    drop(registry);
    let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
    let info = registry.get("noop").unwrap();
    assert_eq!(
        (info.state, info.load_error),
        (HandlerState::Loaded, None),
        "the repair outlives a restart"
    );
}

/// On a shared catalog, a node whose copy of the active component is damaged fetches it
/// again rather than keeping it (it failed the version at its next start).
#[tokio::test]
async fn a_node_replaces_a_damaged_copy_of_a_catalog_component() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (b_dir, b) = node(&catalog);
    let v = a
        .upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    b.sync().await.unwrap();
    let handlers = b_dir.path().join("handlers");
    damage_component(&handlers, "noop", &v.sha256);
    assert!(!b.registry().has_component("noop", &v.sha256));
    // An upload made on this node stores the component: the damaged copy is replaced.
    b.upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    assert!(b.registry().has_component("noop", &v.sha256));
    let reopened = HandlerRegistry::open(&handlers, engine()).unwrap();
    assert_eq!(reopened.get("noop").unwrap().state, HandlerState::Loaded);
}

/// A start whose stored compiled code is of no use (here `handlers.fuel` switched on, as a
/// router upgrade does) opens without compiling: those handlers are `loading`, and their
/// deliveries say so, until `load_deferred` compiles them. Before, the open compiled them all
/// while the API and ingest waited (45 s for one 18 MB component).
#[test]
fn an_open_leaves_compilations_for_later() {
    let dir = tempfile::tempdir().unwrap();
    let handlers = dir.path().join("handlers");
    {
        let registry = HandlerRegistry::open(&handlers, engine()).unwrap();
        registry.upload("noop", &plugin("noop"), "t").unwrap();
        registry.upload("enrich", &plugin("enrich"), "t").unwrap();
    }
    let fueled = || {
        WasmEngine::new(EngineConfig {
            fuel: true,
            ..EngineConfig::default()
        })
        .unwrap()
    };
    let registry = HandlerRegistry::open_deferred(&handlers, fueled()).unwrap();
    assert_eq!(registry.compilations(), 0, "nothing compiled at open");
    assert!(registry.loading());
    for name in ["noop", "enrich"] {
        assert_eq!(registry.get(name).unwrap().state, HandlerState::Loading);
    }
    assert_eq!(
        registry.lookup("noop").unwrap_err(),
        NotLoaded::Loading {
            name: "noop".into(),
            version: 1
        }
    );
    // A shutdown before it began compiles nothing.
    registry.load_deferred(&|| true);
    assert_eq!(registry.compilations(), 0);
    // A change meanwhile stands: the upload loaded what it activates.
    let v2 = variant_of(&plugin("noop"), "v2");
    assert_eq!(registry.upload("noop", &v2, "t").unwrap().version, 2);
    registry.load_deferred(&|| false);
    assert!(!registry.loading());
    assert_eq!(registry.get("enrich").unwrap().state, HandlerState::Loaded);
    assert_eq!(registry.active("noop").unwrap().version().version, 2);
    assert_eq!(
        registry.compilations(),
        2,
        "enrich, and the upload of noop v2"
    );
    // Its compiled code was stored: the next open loads it at once.
    drop(registry);
    let registry = HandlerRegistry::open_deferred(&handlers, fueled()).unwrap();
    assert!(!registry.loading());
    assert_eq!(registry.get("enrich").unwrap().state, HandlerState::Loaded);
}

/// An upload whose caller gave up (a client that disconnects drops the request's future)
/// keeps its upload slot until its compilation has ended: released with the future, any
/// number of compilations ran at once. Here the upload is held between its compilation and
/// its commit; the slot stays taken until it is let go and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_upload_holds_its_slot_until_its_compilation_ends() {
    use futures::FutureExt;
    let (_dir, registry) = registry_with(&[]);
    let registry = Arc::new(registry);
    let changes = HandlerChanges::new(registry.clone(), None, Default::default());
    let slots = Arc::new(tokio::sync::Semaphore::new(1));
    let slot = slots.clone().acquire_owned().await.unwrap();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = {
        let registry = registry.clone();
        std::thread::spawn(move || {
            let _changes = registry.hold_changes();
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        })
    };
    held_rx.recv().unwrap();
    // Polled once (the compilation starts on a blocking thread), then dropped.
    let upload = changes.upload_holding("noop", plugin("noop").into(), "t", Some(slot));
    assert!(upload.now_or_never().is_none());
    assert_eq!(
        slots.available_permits(),
        0,
        "the slot is free while the compilation still runs"
    );
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    // Compiling noop takes well under a second; the bound only keeps a broken build from
    // hanging the suite.
    let freed = tokio::time::timeout(Duration::from_secs(120), slots.acquire()).await;
    assert!(freed.is_ok(), "the slot never came back");
    // Its commit ran after its caller left (the CLI says such an upload may still complete).
    assert!(registry.active("noop").is_some());
}

/// A closed registry (the router is stopping) changes nothing: an upload that was compiling
/// when the shutdown began used to activate itself after the router logged `stopped`.
#[tokio::test]
async fn a_closed_registry_changes_nothing() {
    let (dir, registry) = registry_with(&["noop"]);
    let registry = Arc::new(registry);
    let changes = HandlerChanges::new(registry.clone(), None, Default::default());
    registry.close();
    assert!(matches!(
        changes.upload("enrich", plugin("enrich").into(), "t").await,
        Err(UploadError::ShuttingDown)
    ));
    assert!(registry.get("enrich").is_none());
    assert!(!dir.path().join("handlers/enrich").exists());
    assert!(matches!(
        changes.rollback("noop", "1").await,
        Err(RegistryError::ShuttingDown)
    ));
    assert!(matches!(
        changes.delete("noop").await,
        Err(RegistryError::ShuttingDown)
    ));
    assert!(registry.active("noop").is_some());
}

/// A component in a [`MemCatalog`]: its bytes, revision and when it was written.
type MemComponent = (Vec<u8>, u64, i64);

/// The in-memory [`crate::store::HandlerCatalog`] the shared-handler tests run on: the same
/// compare-and-set contract as the JetStream one, and a switch that makes it unreachable.
#[derive(Default)]
struct MemCatalog {
    indexes: Mutex<HashMap<String, (u64, bytes::Bytes)>>,
    /// Each component's bytes, revision and when it was written (`now`).
    components: Mutex<HashMap<(String, String), MemComponent>>,
    revision: AtomicU64,
    down: AtomicBool,
    /// The catalog's clock, ms: what a component written now is stamped with.
    now: std::sync::atomic::AtomicI64,
}

impl MemCatalog {
    fn check(&self) -> Result<(), crate::store::StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(crate::store::StoreError::Backend(
                "catalog unreachable".into(),
            ))
        } else {
            Ok(())
        }
    }

    fn index_of(&self, name: &str) -> registry::HandlerIndex {
        let bytes = self.indexes.lock().unwrap()[name].1.clone();
        registry::HandlerIndex::from_bytes(&bytes).unwrap()
    }
}

impl crate::store::HandlerCatalog for MemCatalog {
    fn indexes(
        &self,
    ) -> futures::future::BoxFuture<
        '_,
        Result<Vec<crate::store::CatalogRecord>, crate::store::StoreError>,
    > {
        Box::pin(async move {
            self.check()?;
            Ok(self
                .indexes
                .lock()
                .unwrap()
                .iter()
                .map(|(name, (revision, index))| crate::store::CatalogRecord {
                    name: name.clone(),
                    revision: *revision,
                    index: index.clone(),
                })
                .collect())
        })
    }

    fn index(
        &self,
        name: &str,
    ) -> futures::future::BoxFuture<
        '_,
        Result<Option<crate::store::CatalogRecord>, crate::store::StoreError>,
    > {
        let name = name.to_string();
        Box::pin(async move {
            self.check()?;
            Ok(self
                .indexes
                .lock()
                .unwrap()
                .get(&name)
                .map(|(r, i)| crate::store::CatalogRecord {
                    name: name.clone(),
                    revision: *r,
                    index: i.clone(),
                }))
        })
    }

    fn put_index(
        &self,
        name: &str,
        index: bytes::Bytes,
        expect: u64,
    ) -> futures::future::BoxFuture<'_, Result<Option<u64>, crate::store::StoreError>> {
        let name = name.to_string();
        Box::pin(async move {
            self.check()?;
            // Yield first, so two nodes' changes interleave between their read and write.
            tokio::task::yield_now().await;
            let mut indexes = self.indexes.lock().unwrap();
            let current = indexes.get(&name).map_or(0, |(r, _)| *r);
            if current != expect {
                return Ok(None);
            }
            let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
            indexes.insert(name, (revision, index));
            Ok(Some(revision))
        })
    }

    fn put_component(
        &self,
        name: &str,
        sha256: &str,
        bytes: bytes::Bytes,
    ) -> futures::future::BoxFuture<'_, Result<(), crate::store::StoreError>> {
        let key = (name.to_string(), sha256.to_string());
        Box::pin(async move {
            self.check()?;
            let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
            let now = self.now.load(Ordering::SeqCst);
            self.components
                .lock()
                .unwrap()
                .insert(key, (bytes.to_vec(), revision, now));
            Ok(())
        })
    }

    fn component(
        &self,
        name: &str,
        sha256: &str,
        _size: u64,
    ) -> futures::future::BoxFuture<'_, Result<Option<Vec<u8>>, crate::store::StoreError>> {
        let key = (name.to_string(), sha256.to_string());
        Box::pin(async move {
            self.check()?;
            Ok(self
                .components
                .lock()
                .unwrap()
                .get(&key)
                .map(|c| c.0.clone()))
        })
    }

    fn stored_components(
        &self,
    ) -> futures::future::BoxFuture<
        '_,
        Result<Vec<crate::store::StoredComponent>, crate::store::StoreError>,
    > {
        Box::pin(async move {
            self.check()?;
            Ok(self
                .components
                .lock()
                .unwrap()
                .iter()
                .map(
                    |((name, sha256), (_, revision, at))| crate::store::StoredComponent {
                        name: name.clone(),
                        sha256: sha256.clone(),
                        records: vec![(format!("{name}.{sha256}"), *revision)],
                        written_ms: *at,
                    },
                )
                .collect())
        })
    }

    fn remove_components(
        &self,
        components: Vec<crate::store::StoredComponent>,
    ) -> futures::future::BoxFuture<'_, Result<usize, crate::store::StoreError>> {
        Box::pin(async move {
            self.check()?;
            let mut stored = self.components.lock().unwrap();
            let mut removed = 0;
            for c in components {
                let key = (c.name, c.sha256);
                if stored.get(&key).map(|s| s.1) == c.records.first().map(|r| r.1) {
                    stored.remove(&key);
                    removed += 1;
                }
            }
            Ok(removed)
        })
    }
}

/// A router node's handlers on a shared catalog: its own registry directory, the catalog.
fn node(catalog: &Arc<MemCatalog>) -> (tempfile::TempDir, HandlerChanges) {
    let (dir, registry) = registry_with(&[]);
    let shared: Arc<dyn crate::store::HandlerCatalog> = catalog.clone();
    let changes = HandlerChanges::new(Arc::new(registry), Some(shared), Default::default());
    (dir, changes)
}

fn active_sha(changes: &HandlerChanges, name: &str) -> Option<String> {
    changes
        .registry()
        .active(name)
        .map(|h| h.version().sha256.clone())
}

#[tokio::test]
async fn an_upload_rollback_and_delete_on_one_node_reach_the_others() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (b_dir, b) = node(&catalog);
    let v1_bytes = plugin("noop");
    let v2_bytes = variant_of(&v1_bytes, "shared-v2");

    let v1 = a
        .upload("noop", v1_bytes.clone().into(), "alice")
        .await
        .unwrap();
    assert_eq!(
        active_sha(&a, "noop"),
        Some(v1.sha256.clone()),
        "active at once where uploaded"
    );
    assert_eq!(active_sha(&b, "noop"), None);
    let report = b.sync().await.unwrap();
    assert_eq!(report.applied, vec!["noop".to_string()]);
    assert_eq!(active_sha(&b, "noop"), Some(v1.sha256.clone()));
    // B fetched the component into its own directory and runs it.
    assert!(
        b_dir
            .path()
            .join(format!("handlers/noop/{}.wasm", v1.sha256))
            .is_file()
    );
    let h = b.registry().active("noop").unwrap();
    assert_eq!(
        invoke(
            &h,
            &event("x", "t", json!({})),
            &delivery(),
            Arc::new(EmptyKv),
            &HandlerLimits::default()
        )
        .outcome,
        InvocationOutcome::Emitted(vec![])
    );
    // Nothing changed: a second sync does nothing.
    assert_eq!(b.sync().await.unwrap(), SyncReport::default());

    // Version numbers continue across nodes: B uploads v2, A rolls back to v1.
    let v2 = b.upload("noop", v2_bytes.into(), "bob").await.unwrap();
    assert_eq!(v2.version, 2);
    a.sync().await.unwrap();
    assert_eq!(active_sha(&a, "noop"), Some(v2.sha256.clone()));
    let back = a.rollback("noop", "1").await.unwrap();
    assert_eq!((back.version, back.uploader.as_str()), (1, "alice"));
    b.sync().await.unwrap();
    assert_eq!(active_sha(&b, "noop"), Some(v1.sha256.clone()));
    assert_eq!(b.registry().get("noop").unwrap().versions.len(), 2);
    assert!(matches!(
        b.rollback("noop", "7").await,
        Err(RegistryError::UnknownVersion { .. })
    ));
    assert!(matches!(
        b.rollback("nope", "1").await,
        Err(RegistryError::UnknownHandler(_))
    ));

    // Deleted on B: gone from A at its next sync. Its components stay in the catalog until a
    // sweep finds them unnamed for the grace period.
    assert!(b.delete("noop").await.unwrap());
    assert!(b.registry().get("noop").is_none());
    assert_eq!(catalog.components.lock().unwrap().len(), 2);
    assert_eq!(
        b.sweep_components(catalog::ORPHAN_GRACE_MS - 1)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        b.sweep_components(catalog::ORPHAN_GRACE_MS).await.unwrap(),
        2
    );
    assert!(catalog.components.lock().unwrap().is_empty());
    let report = a.sync().await.unwrap();
    assert_eq!(report.removed, vec!["noop".to_string()]);
    assert!(a.registry().get("noop").is_none());
    assert!(!a.delete("noop").await.unwrap());
    // Uploaded again after the delete: a new history.
    let again = a.upload("noop", v1_bytes.into(), "carol").await.unwrap();
    assert_eq!((again.version, again.uploader.as_str()), (1, "carol"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_on_two_nodes_at_once_both_keep_their_version() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (_b_dir, b) = node(&catalog);
    let base = plugin("noop");
    let (x, y) = (variant_of(&base, "from-a"), variant_of(&base, "from-b"));
    let (ra, rb) = tokio::join!(
        a.upload("noop", x.into(), "alice"),
        b.upload("noop", y.into(), "bob")
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let mut numbers = vec![ra.version, rb.version];
    numbers.sort_unstable();
    assert_eq!(numbers, vec![1, 2], "one version each, none lost");
    let index = catalog.index_of("noop");
    assert_eq!(index.versions.len(), 2);
    // Both nodes end on the version the catalog holds as active.
    a.sync().await.unwrap();
    b.sync().await.unwrap();
    assert_eq!(active_sha(&a, "noop"), index.active.clone());
    assert_eq!(active_sha(&b, "noop"), index.active);
}

#[tokio::test]
async fn a_node_publishes_handlers_it_had_and_drops_ones_deleted_while_it_was_away() {
    let catalog = Arc::new(MemCatalog::default());
    // A node that ran on its own before: two handlers in its directory.
    let (_dir, registry) = registry_with(&["noop", "strict"]);
    let shared: Arc<dyn crate::store::HandlerCatalog> = catalog.clone();
    let old = HandlerChanges::new(Arc::new(registry), Some(shared), Default::default());
    let mut report = old.sync().await.unwrap();
    report.published.sort();
    assert_eq!(
        report.published,
        vec!["noop".to_string(), "strict".to_string()]
    );
    let (_b_dir, b) = node(&catalog);
    b.sync().await.unwrap();
    assert!(b.registry().active("noop").is_some() && b.registry().active("strict").is_some());

    // Deleted on B while the old node is away: the old node drops its copy instead of
    // publishing it again.
    assert!(b.delete("strict").await.unwrap());
    let report = old.sync().await.unwrap();
    assert_eq!(report.removed, vec!["strict".to_string()]);
    assert!(report.published.is_empty());
    assert!(old.registry().get("strict").is_none());
    assert!(catalog.index_of("strict").deleted);
}

#[tokio::test]
async fn an_unreachable_catalog_refuses_changes_and_is_shown_until_it_returns() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (_b_dir, b) = node(&catalog);
    a.upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    catalog.down.store(true, Ordering::SeqCst);

    // An upload is refused and nothing is activated anywhere.
    let err = a
        .upload("strict", plugin("strict").into(), "alice")
        .await
        .unwrap_err();
    assert!(matches!(err, UploadError::Catalog(_)), "{err}");
    assert!(a.registry().get("strict").is_none());
    assert!(matches!(
        a.rollback("noop", "1").await,
        Err(RegistryError::Catalog(_))
    ));
    assert!(matches!(
        a.delete("noop").await,
        Err(RegistryError::Catalog(_))
    ));
    assert!(a.registry().active("noop").is_some());
    // A refused upload still validates first: a bad one says what is wrong with it.
    assert!(matches!(
        a.upload("noop", b"\0asm junk".to_vec().into(), "alice")
            .await,
        Err(UploadError::Uncompilable(..))
    ));

    // A sync fails, and the status says so until one succeeds.
    assert!(b.sync().await.is_err());
    let status = b.status();
    assert!(status.shared);
    assert!(
        status
            .health
            .error
            .as_deref()
            .unwrap()
            .contains("unreachable"),
        "{status:?}"
    );
    assert!(status.health.failing_since.is_some() && status.health.last_sync_at.is_none());
    catalog.down.store(false, Ordering::SeqCst);
    b.sync().await.unwrap();
    let status = b.status();
    assert!(
        status.health.error.is_none()
            && status.health.failing_since.is_none()
            && status.health.last_sync_at.is_some()
    );
    assert!(b.registry().active("noop").is_some());
}

/// A sweep removes the components no index names once the grace has passed, and nothing an
/// index names however old: a handler deleted and uploaded again keeps its bytes.
#[tokio::test]
async fn the_sweep_removes_only_components_no_index_names() {
    use crate::store::HandlerCatalog;
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let v1 = a
        .upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    // An upload whose index write never landed leaves its component alone.
    catalog
        .put_component("other", "ab12", bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    let late = 10 * catalog::ORPHAN_GRACE_MS;
    assert_eq!(a.sweep_components(late).await.unwrap(), 1);
    let left: Vec<_> = catalog.components.lock().unwrap().keys().cloned().collect();
    assert_eq!(left, vec![("noop".to_string(), v1.sha256.clone())]);
    // Deleted and uploaded again before a sweep: named again, kept, and a node that syncs
    // now installs it from the catalog.
    assert!(a.delete("noop").await.unwrap());
    let again = a
        .upload("noop", plugin("noop").into(), "bob")
        .await
        .unwrap();
    assert_eq!(again.sha256, v1.sha256);
    assert_eq!(a.sweep_components(late).await.unwrap(), 0);
    let (_b_dir, b) = node(&catalog);
    b.sync().await.unwrap();
    assert_eq!(active_sha(&b, "noop"), Some(v1.sha256));
}

#[tokio::test]
async fn a_catalog_version_that_cannot_be_fetched_is_shown_per_handler() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (_b_dir, b) = node(&catalog);
    let v = a
        .upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    let saved = std::mem::take(&mut *catalog.components.lock().unwrap());
    b.sync().await.unwrap();
    assert!(b.registry().active("noop").is_none());
    let status = b.status();
    assert!(
        status.handler_errors["noop"].contains(&v.sha256),
        "{status:?}"
    );
    // A fetch that failed is not marked as applied: once the component is there, the next
    // round installs it, with no new change to the handler.
    *catalog.components.lock().unwrap() = saved;
    assert_eq!(b.sync().await.unwrap().applied, vec!["noop".to_string()]);
    assert_eq!(active_sha(&b, "noop"), Some(v.sha256));
    assert!(b.status().handler_errors.is_empty());
}

#[tokio::test]
async fn a_rollback_to_a_version_fetched_from_the_catalog_survives_a_restart() {
    let catalog = Arc::new(MemCatalog::default());
    let (_a_dir, a) = node(&catalog);
    let (b_dir, b) = node(&catalog);
    let v1_bytes = plugin("noop");
    let v1 = a
        .upload("noop", v1_bytes.clone().into(), "alice")
        .await
        .unwrap();
    a.upload("noop", variant_of(&v1_bytes, "v2").into(), "alice")
        .await
        .unwrap();
    // B first syncs at v2, so it fetches v2's component only; it rolls back to v1.
    b.sync().await.unwrap();
    let component = |sha: &str| b_dir.path().join(format!("handlers/noop/{sha}.wasm"));
    assert!(!component(&v1.sha256).is_file());
    assert_eq!(b.rollback("noop", "1").await.unwrap().version, 1);
    assert!(component(&v1.sha256).is_file(), "B keeps what it runs");
    drop(b);

    // B restarts on its directory: v1 loads from its own copy, and its first sync (nothing
    // changed in the catalog) leaves it so.
    let registry = HandlerRegistry::open(b_dir.path().join("handlers"), engine()).unwrap();
    let shared: Arc<dyn crate::store::HandlerCatalog> = catalog.clone();
    let b = HandlerChanges::new(Arc::new(registry), Some(shared), Default::default());
    assert_eq!(active_sha(&b, "noop"), Some(v1.sha256.clone()));
    b.sync().await.unwrap();
    assert_eq!(active_sha(&b, "noop"), Some(v1.sha256));
    assert!(b.status().handler_errors.is_empty());
}

#[tokio::test]
async fn without_a_catalog_changes_go_to_the_registry_alone() {
    let (_dir, registry) = registry_with(&[]);
    let changes = HandlerChanges::new(Arc::new(registry), None, Default::default());
    let v = changes
        .upload("noop", plugin("noop").into(), "alice")
        .await
        .unwrap();
    assert_eq!(v.version, 1);
    assert_eq!(changes.sync().await.unwrap(), SyncReport::default());
    assert!(!changes.status().shared);
    assert_eq!(changes.rollback("noop", "1").await.unwrap().version, 1);
    assert!(changes.delete("noop").await.unwrap());
}

/// An index written by a newer router is refused, not half-read: an older node in a rolling
/// upgrade (or after a downgrade) would otherwise drop what it does not know when it writes
/// the index again. That costs that handler only: the registry opens, lists it with why, loads
/// the others, and refuses to change it (which would write over the file). A shared catalog's
/// record is refused by the same decoder.
#[test]
fn an_index_of_a_newer_format_is_refused() {
    let (dir, registry) = registry_with(&["noop", "strict"]);
    drop(registry);
    let path = dir.path().join("handlers/noop/index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index["format"] = serde_json::json!(99);
    let newer = serde_json::to_vec(&index).unwrap();
    std::fs::write(&path, &newer).unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert!(registry.active("noop").is_none());
    assert!(registry.active("strict").is_some());
    let listed = registry.get("noop").unwrap();
    let load_error = listed.load_error.unwrap();
    assert!(
        load_error.contains("format 99, newer than this router reads"),
        "{load_error}"
    );
    assert_eq!(
        registry
            .list()
            .iter()
            .map(|h| h.name.as_str())
            .collect::<Vec<_>>(),
        ["noop", "strict"]
    );
    // Nothing writes over the file: not an upload, a rollback or a delete.
    let upload = registry
        .upload("noop", &plugin("noop"), "tests")
        .unwrap_err();
    assert!(
        matches!(upload, UploadError::UnreadableIndex(_)),
        "{upload}"
    );
    assert!(matches!(
        registry.rollback("noop", "1"),
        Err(RegistryError::CorruptIndex { .. })
    ));
    assert!(matches!(
        registry.delete("noop"),
        Err(RegistryError::CorruptIndex { .. })
    ));
    assert_eq!(std::fs::read(&path).unwrap(), newer);
    assert!(registry.indexes().iter().all(|i| i.name != "noop"));
    assert!(registry::HandlerIndex::from_bytes(&newer).is_err());
    index["format"] = serde_json::json!(1);
    assert!(registry::HandlerIndex::from_bytes(&serde_json::to_vec(&index).unwrap()).is_ok());
}

/// An index that does not parse (or cannot be read) costs its handler only, as a newer one.
#[test]
fn a_corrupt_index_does_not_stop_the_registry_from_opening() {
    let (dir, registry) = registry_with(&["noop", "strict"]);
    drop(registry);
    std::fs::write(dir.path().join("handlers/strict/index.json"), b"{not json").unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine()).unwrap();
    assert!(registry.active("noop").is_some());
    assert!(registry.active("strict").is_none());
    let load_error = registry.get("strict").unwrap().load_error.unwrap();
    assert!(load_error.contains("corrupt handler index"), "{load_error}");
}

/// An engine with room for one invocation (plus the instances kept for `describe`), its
/// registry with `noop` uploaded, and `noop`.
fn one_instance_engine() -> (tempfile::TempDir, HandlerRegistry, Arc<LoadedHandler>) {
    let small = WasmEngine::new(EngineConfig {
        max_instances: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let registry = HandlerRegistry::open(dir.path(), small).unwrap();
    registry.upload("noop", &plugin("noop"), "tests").unwrap();
    let noop = registry.active("noop").unwrap();
    (dir, registry, noop)
}

/// A live instance of `h` from the engine's pool, as a running invocation holds one.
fn hold_instance(h: &LoadedHandler) -> wasmtime::Store<bindings::HostState> {
    let limits = HandlerLimits::default();
    let mut store = invoke::new_store(
        h.engine(),
        &limits,
        Arc::new(EmptyKv),
        invoke::hostcall_fuel(&limits),
    );
    h.pre().instantiate(&mut store).unwrap();
    store
}

/// `describe` (uploads, rollbacks, preloads) runs on instances the pool keeps for it: with
/// every invocation slot in use (`max_instances` = 1, one instance live), an upload still
/// passes instead of failing as "describe() failed: maximum concurrent limit reached".
#[test]
fn an_upload_while_every_invocation_slot_is_in_use_still_describes() {
    let (_dir, registry, noop) = one_instance_engine();
    let _running = hold_instance(&noop);
    registry
        .upload("strict", &plugin("strict"), "tests")
        .unwrap();
    assert!(registry.active("strict").is_some());
}

/// A full instance pool is no failure of the handler nor of the component being uploaded:
/// an invocation comes back `Busy` (put back unattempted) and an upload `UploadError::Busy`.
#[test]
fn a_full_instance_pool_is_busy_not_a_trap() {
    let (_dir, registry, noop) = one_instance_engine();
    let held: Vec<_> = (0..1 + engine::DESCRIBE_INSTANCES)
        .map(|_| hold_instance(&noop))
        .collect();
    let run = || {
        invoke(
            &noop,
            &event("p", "t", json!({})),
            &delivery(),
            Arc::new(EmptyKv),
            &HandlerLimits::default(),
        )
    };
    let inv = run();
    assert!(
        matches!(&inv.outcome, InvocationOutcome::Busy(m) if m.contains("maximum concurrent limit")),
        "{:?}",
        inv.outcome
    );
    assert!(!inv.outcome.is_handler_result());
    let upload = registry
        .upload("strict", &plugin("strict"), "tests")
        .unwrap_err();
    assert!(
        matches!(&upload, UploadError::Busy(m) if m.contains("busy")),
        "{upload}"
    );
    drop(held);
    assert_eq!(run().outcome, InvocationOutcome::Emitted(vec![]));
}

/// What the host copies out of the guest in one call is bounded by the store's hostcall fuel,
/// sized on the invocation's limits: a result over it stops the copy, as a permanent
/// `handler_limit` rather than a retried trap. (This also pins wasmtime's message for it,
/// whose error type is private: see `invoke::HOSTCALL_FUEL_EXHAUSTED`.)
#[test]
fn a_result_over_the_hostcall_fuel_is_a_limit() {
    let limits = HandlerLimits {
        max_kv_write_bytes: 64 << 10,
        ..HandlerLimits::default()
    };
    let fuel = invoke::hostcall_fuel(&limits);
    assert!(fuel < 2 << 20, "{fuel}");
    // One emission of 2 MiB of data.
    let inv = run(
        "hostile",
        &event("b", "t", json!({"mode": "output", "size": "big"})),
        &limits,
    );
    match inv.outcome {
        InvocationOutcome::LimitExceeded(m) => {
            assert!(
                m.contains(&format!("more than {fuel} bytes in one call")),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Within the fuel, the limits checked on the result still speak (default limits: the
    // same 2 MiB fits in the fuel, and is over `max_output_bytes`).
    assert!(invoke::hostcall_fuel(&HandlerLimits::default()) > (2 << 20) + 2);
}

/// A rollback (the 3 a.m. fix) loads its version's stored compiled code; it must not wait
/// while another handler's large upload compiles. Before, every compilation took one lock, and
/// a rollback waited out the whole compilation of a Python component.
#[test]
fn a_rollback_does_not_wait_for_another_handlers_compilation() {
    let dir = tempfile::tempdir().unwrap();
    let engine = WasmEngine::new(EngineConfig::default()).unwrap();
    let registry = HandlerRegistry::open(dir.path().join("handlers"), engine).unwrap();
    let noop = plugin("noop");
    registry.upload("noop", &noop, "t").unwrap();
    registry
        .upload("noop", &variant_of(&noop, "v2"), "t")
        .unwrap();
    assert_eq!(registry.compilations(), 2);
    // Not stored in this (fresh) registry: a full compilation, seconds for the Python runtime.
    let big = plugin("enrich_py");
    std::thread::scope(|s| {
        let upload = s.spawn(|| {
            let t = Instant::now();
            registry.upload("enrich_py", &big, "t").unwrap();
            t.elapsed()
        });
        // Let the compilation get going.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let back = registry.rollback("noop", "1").unwrap();
        let rollback = t.elapsed();
        assert_eq!(back.version, 1);
        let upload = upload.join().unwrap();
        // Generous: the rollback reads and loads one cached component (milliseconds); the
        // upload compiles a ~18 MB component from scratch. Waiting on it made the two about
        // equal.
        assert!(
            rollback * 4 < upload,
            "rollback took {rollback:?} beside an upload of {upload:?}"
        );
    });
    assert_eq!(
        registry.compilations(),
        3,
        "py compiled; the rollback hit the cache"
    );
    assert_eq!(registry.active("noop").unwrap().version().version, 1);
}
