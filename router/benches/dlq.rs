//! DLQ reads on the embedded store: one target's page and summary out of a large DLQ, read
//! through the by-target index, against the same reads made by scanning the whole DLQ (the
//! baseline: a filter without a target, on the rule only that target's entries have).
//!
//! Run: `cargo bench --bench dlq -- --warm-up-time 1 --measurement-time 3 --sample-size 20`
//! (`DLQ_ENTRIES` sets the size of the busy target's DLQ, default 200,000).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use router::store::{DlqFilter, NewEntry, NewEvent, RedbStore, Store, StoreOptions};

/// An event accepted at `at` whose one copy, for `target` by `rule`, overflows its cap at once:
/// a `target_overflow` dead letter.
fn dead_letter(id: u64, target: &str, rule: &str, at: i64) -> NewEvent {
    let event = serde_json::from_value(serde_json::json!({
        "specversion": "1.0", "id": id.to_string(), "source": "/bench", "type": "t",
        "data": {"order_id": id, "note": "x".repeat(200)}
    }))
    .expect("event");
    NewEvent {
        event,
        accepted_at: at,
        ruleset_version: "v1".into(),
        matched_rules: vec![rule.into()],
        targets: vec![NewEntry {
            target_id: target.into(),
            rule: rule.into(),
            ordering_key: None,
            max_depth: Some(0),
            lease_ms: None,
        }],
        quarantine: None,
        dedup_window_ms: 86_400_000,
    }
}

fn dlq(c: &mut Criterion) {
    let busy: u64 = std::env::var("DLQ_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("store");
    // The busy target's dead letters, with the quiet one's 100 spread evenly among them.
    rt.block_on(async {
        let mut id = 0;
        for chunk in 0..busy / 1000 {
            let mut batch: Vec<NewEvent> = (0..1000)
                .map(|i| {
                    id += 1;
                    dead_letter(id, "busy", "busy-rule", 1000 + i)
                })
                .collect();
            if chunk % (busy / 1000 / 100).max(1) == 0 {
                id += 1;
                batch.push(dead_letter(id, "quiet", "quiet-rule", 2000));
            }
            store.accept(batch).await.expect("accept");
        }
    });
    let indexed = DlqFilter {
        target: Some("quiet".into()),
        ..DlqFilter::default()
    };
    let scanned = DlqFilter {
        rule: Some("quiet-rule".into()),
        ..DlqFilter::default()
    };
    assert_eq!(
        store.dlq_list(&indexed, None, 1000).expect("list"),
        store.dlq_list(&scanned, None, 1000).expect("list"),
        "the two reads select the same entries"
    );
    let mut g = c.benchmark_group(format!("dlq_of_quiet_target_among_{busy}"));
    g.bench_function("list_100_by_index", |b| {
        b.iter(|| black_box(store.dlq_list(&indexed, None, 100).expect("list").len()));
    });
    g.bench_function("list_100_by_scan", |b| {
        b.iter(|| black_box(store.dlq_list(&scanned, None, 100).expect("list").len()));
    });
    g.bench_function("summary_by_index", |b| {
        b.iter(|| {
            black_box(
                store
                    .dlq_summary(&indexed, 3_600_000)
                    .expect("summary")
                    .len(),
            )
        });
    });
    g.bench_function("summary_by_scan", |b| {
        b.iter(|| {
            black_box(
                store
                    .dlq_summary(&scanned, 3_600_000)
                    .expect("summary")
                    .len(),
            )
        });
    });
    g.finish();
}

criterion_group!(benches, dlq);
criterion_main!(benches);
