//! `router bench ingest`, the load tool, against a real router and scripted receivers: what its
//! report counts, and its exit status.

use std::time::Duration;

use crate::harness::*;

/// Runs `router bench ingest ARGS…`; returns (exit code, stdout, stderr).
async fn bench_ingest(args: &[&str]) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_router"))
            .args(["bench", "ingest"])
            .args(args)
            .env_remove("ROUTER_TOKEN")
            .output(),
    )
    .await
    .expect("bench ingest finished")
    .expect("run bench ingest");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A contract in quarantine mode puts every event in the DLQ with a 202: the report counts
/// them as quarantined, not as events ok, and the throughput counts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantined_events_are_counted_apart_from_accepted_ones() {
    let contract = r#"{"type": "object", "required": ["never_sent"]}"#;
    let r = RouterProc::start(&[], &[("bench.event/v1.json", contract)]);
    let url = r.url("/v1/events");
    let (code, out, err) = bench_ingest(&[
        "--url",
        &url,
        "--events",
        "40",
        "--concurrency",
        "2",
        "--batch",
        "4",
        "--size",
        "256",
    ])
    .await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("events ok:      0 accepted, 0 duplicate, 40 quarantined"),
        "{out}"
    );
    assert!(out.contains("throughput:     0 events/s"), "{out}");
}
