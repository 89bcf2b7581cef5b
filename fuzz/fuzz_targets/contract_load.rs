//! The contract loader (`ContractSet::from_files`): JSON Schema compilation, `modes.toml`,
//! diagnostics positions, the compatibility report and event checks.
//!
//! The input, up to its first NUL byte, is the schema `order.created/v2.json`, loaded beside
//! the fixed `order.created/v1.json` so the compatibility checker compares the two; the rest
//! (if any) is `modes.toml`. Checked: a refused set has diagnostics naming one of the files
//! with 1-based positions; an accepted set lists both versions, has a 12-hex-digit version
//! that does not change when loaded again, and checks a few events without panicking, with
//! violation errors located under `/data` (or `/data_base64`, `/dataversion`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use router::contract::{ContractMode, ContractOutcome, ContractSet, MODES_FILE};
use router::event::CloudEvent;
use serde_json::{Map, Value, json};

const V1: &str = r#"{
  "type": "object",
  "required": ["order_id", "total"],
  "properties": {
    "order_id": {"type": "string", "minLength": 1},
    "total": {"type": "number", "minimum": 0},
    "currency": {"enum": ["EUR", "USD"]}
  }
}"#;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(2, |b| *b == 0);
    let schema = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let modes = parts.next().map(String::from_utf8_lossy);
    let files = [
        ("order.created/v1.json", V1),
        ("order.created/v2.json", &*schema),
    ];
    let set = match ContractSet::from_files(&files, modes.as_deref()) {
        Ok(set) => set,
        Err(diags) => {
            assert!(!diags.is_empty(), "refused without a diagnostic");
            for d in &diags {
                assert!(
                    d.file == files[1].0 || d.file == MODES_FILE,
                    "diagnostic for {:?}",
                    d.file
                );
                assert!(d.line >= 1 && d.col >= 1, "position {}:{}", d.line, d.col);
                let _ = d.to_string();
            }
            return;
        }
    };
    let versions: Vec<u32> = set.contracts().iter().map(|c| c.version).collect();
    assert_eq!(versions, [1, 2]);
    let version = set.version();
    assert!(version.len() == 12 && version.bytes().all(|b| b.is_ascii_hexdigit()));
    let again = ContractSet::from_files(&files, modes.as_deref()).expect("loads twice");
    assert_eq!(
        again.version(),
        version,
        "version is not a function of the input"
    );

    for d in set.compatibility_report() {
        assert_eq!(d.file, files[1].0);
        assert!(d.line >= 1 && d.col >= 1);
    }
    let mode = set.mode("order.created");
    for data in [
        json!({"order_id": "o-1", "total": 12.5, "currency": "EUR"}),
        json!({"order_id": "", "total": -1}),
        json!([1, "two", null]),
        json!("text"),
        Value::Null,
    ] {
        for dataversion in [1u32, 2, 3] {
            let ev = event(data.clone(), dataversion);
            match set.check(&ev) {
                ContractOutcome::Pass => {}
                ContractOutcome::Violation {
                    mode: m, errors, ..
                } => {
                    assert_eq!(m, mode);
                    assert_ne!(m, ContractMode::Off, "a violation in mode off");
                    assert!(!errors.is_empty(), "a violation without errors");
                    for e in errors {
                        assert!(
                            e.pointer.starts_with("/data") || e.pointer == "/dataversion",
                            "violation at {:?}",
                            e.pointer
                        );
                    }
                }
            }
        }
    }
});

fn event(data: Value, dataversion: u32) -> CloudEvent {
    let mut extensions = Map::new();
    extensions.insert("dataversion".into(), Value::from(dataversion));
    CloudEvent {
        id: "1".into(),
        source: "fuzz".into(),
        ty: "order.created".into(),
        subject: None,
        time: None,
        datacontenttype: None,
        dataschema: None,
        data: (!data.is_null()).then(|| router::event::Data::from(data)),
        data_base64: None,
        extensions,
    }
}
