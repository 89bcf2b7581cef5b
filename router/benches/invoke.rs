//! Invocation overhead of WASM handlers: a no-op handler (fresh store + instantiate from the
//! pre-instantiated component + call + drop), and `enrich` on a 1 KB event against the same
//! enrichment as a native Rust function (and as the Python component, for scale).
//!
//! Run: `cargo bench --bench invoke` (builds the plugins with `plugins/build.sh` first).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use router::wasm::{
    DeliveryInfo, EmptyKv, EngineConfig, HandlerLimits, HandlerRegistry, InvocationOutcome,
    KvReader, WasmEngine, invoke,
};
use serde_json::{Map, Value, json};
use std::hint::black_box;

fn plugins() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::env::var_os("ROUTER_PLUGINS_OUT")
        .map_or_else(|| root.join("target/plugins"), PathBuf::from);
    let build = std::env::var_os("ROUTER_PLUGINS_TARGET_DIR")
        .map_or_else(|| root.join("target/plugins-build"), PathBuf::from);
    let status = Command::new("bash")
        .arg(root.join("plugins/build.sh"))
        .env("OUT", &out)
        .env("PLUGINS_TARGET_DIR", &build)
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .expect("run plugins/build.sh");
    assert!(status.success(), "plugins/build.sh failed");
    out
}

/// A structured CloudEvent whose JSON data is about 1 KB.
fn event_1kb() -> Value {
    let mut data = Map::new();
    for i in 0..20 {
        data.insert(
            format!("field_{i:02}"),
            json!(format!("value-{i:02}-{}", "x".repeat(24))),
        );
    }
    let event = json!({
        "specversion": "1.0", "id": "bench-1", "source": "/bench", "type": "order.created",
        "subject": "order/1", "datacontenttype": "application/json", "data": data,
    });
    let size = event["data"].to_string().len();
    assert!((900..1200).contains(&size), "data is {size} bytes");
    event
}

/// The same enrichment as the `enrich` plugin, natively: the baseline.
fn native_enrich(event: &Value) -> Option<Value> {
    let mut data = event.get("data")?.as_object()?.clone();
    let len = data.len();
    data.insert("enriched".into(), Value::Bool(true));
    data.insert("len".into(), Value::from(len));
    let ty = format!("{}.enriched", event.get("type")?.as_str()?);
    let mut out = json!({"type": ty, "datacontenttype": "application/json", "data": data});
    if let Some(subject) = event.get("subject") {
        out["subject"] = subject.clone();
    }
    Some(out)
}

fn benches(c: &mut Criterion) {
    let dir = plugins();
    let tmp = tempfile::tempdir().expect("tempdir");
    let engine = WasmEngine::new(EngineConfig::default()).expect("engine");
    let registry = HandlerRegistry::open(tmp.path().join("handlers"), engine).expect("registry");
    for name in ["noop", "enrich", "enrich_py"] {
        let bytes = std::fs::read(dir.join(format!("{name}.wasm"))).expect("plugin");
        registry.upload(name, &bytes, "bench").expect("upload");
    }
    let noop = registry.active("noop").expect("noop");
    let enrich = registry.active("enrich").expect("enrich");
    let enrich_py = registry.active("enrich_py").expect("enrich_py");
    let limits = HandlerLimits::default();
    let delivery = DeliveryInfo {
        attempt: 1,
        idempotency_key: "k".into(),
        rule: "r".into(),
        target: "t".into(),
    };
    let kv: Arc<dyn KvReader> = Arc::new(EmptyKv);
    let small = json!({"specversion": "1.0", "id": "1", "source": "/b", "type": "t"});
    let big = event_1kb();

    let check = invoke(&enrich, &big, &delivery, kv.clone(), &limits);
    assert!(
        matches!(&check.outcome, InvocationOutcome::Emitted(v) if v.len() == 1),
        "{:?}",
        check.outcome
    );

    c.bench_function("noop_invoke", |b| {
        b.iter(|| invoke(&noop, black_box(&small), &delivery, kv.clone(), &limits))
    });
    c.bench_function("enrich_1kb_wasm", |b| {
        b.iter(|| invoke(&enrich, black_box(&big), &delivery, kv.clone(), &limits))
    });
    c.bench_function("enrich_1kb_python", |b| {
        b.iter(|| invoke(&enrich_py, black_box(&big), &delivery, kv.clone(), &limits))
    });
    c.bench_function("enrich_1kb_native", |b| {
        b.iter(|| native_enrich(black_box(&big)))
    });
}

criterion_group!(invoke_benches, benches);
criterion_main!(invoke_benches);
