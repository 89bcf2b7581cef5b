//! DLQ reads on the embedded store: one target's page and summary out of a large DLQ, read
//! through the by-target index, against the same reads made by scanning the whole DLQ (the
//! baseline: a filter without a target, on the rule only that target's entries have).
//!
//! A second group summarises a whole DLQ of `retries_exhausted` dead letters, each with its
//! five failed attempts (what a DLQ behind an outage holds): the unfiltered summary an
//! operator's first look at the DLQ asks for, which has no index to use.
//!
//! Run: `cargo bench --bench dlq -- --warm-up-time 1 --measurement-time 3 --sample-size 20`
//! (`DLQ_ENTRIES` sets the size of the busy target's DLQ, default 200,000; `DLQ_EXHAUSTED`
//! the size of the second group's, default 50,000).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use router::store::{
    AttemptEnd, AttemptResult, Disposition, DlqFilter, DlqHead, DlqReason, DlqSummary, NewEntry,
    NewEvent, RedbStore, Store, StoreOptions,
};

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
            hold_key: false,
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

/// Attempts of each `retries_exhausted` dead letter in [`whole_summary`].
const ATTEMPTS: usize = 5;

fn whole_summary(c: &mut Criterion) {
    let n: u64 = std::env::var("DLQ_EXHAUSTED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbStore::open_dir(dir.path(), StoreOptions::default()).expect("store");
    rt.block_on(async {
        for chunk in 0..n.div_ceil(1000) {
            let batch: Vec<NewEvent> = (0..1000.min(n - chunk * 1000))
                .map(|i| {
                    let mut e = dead_letter(chunk * 1000 + i, "erp", "orders-to-erp", 1000);
                    e.targets[0].max_depth = None;
                    e
                })
                .collect();
            store.accept(batch).await.expect("accept");
        }
        // Each entry fails ATTEMPTS times, the last one dead-lettering it.
        let mut now = 2000;
        for attempt in 1..=ATTEMPTS {
            now += 1000;
            loop {
                let leased = store.lease("erp", now, 1000, 60_000).await.expect("lease");
                if leased.is_empty() {
                    break;
                }
                let finishes = leased.into_iter().map(|l| {
                    let disposition = if attempt == ATTEMPTS {
                        Disposition::DeadLetter {
                            reason: DlqReason::RetriesExhausted,
                            hold: false,
                        }
                    } else {
                        Disposition::Retry { due_at: now + 500 }
                    };
                    let end = AttemptEnd {
                        finished_at: now,
                        result: AttemptResult::Retryable,
                        status: Some(503),
                        error: Some(
                            "HTTP 503 Service Unavailable: upstream connect error or \
                             disconnect/reset before headers"
                                .into(),
                        ),
                        outbox: None,
                    };
                    store.finish(l.entry.id, l.lease, end, disposition, now)
                });
                for f in futures::future::join_all(finishes).await {
                    f.expect("finish");
                }
            }
        }
    });
    let all = DlqFilter::default();
    let rows = store.dlq_summary(&all, 3_600_000).expect("summary");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].count, n, "every entry is a dead letter");
    let page = store.dlq_list(&all, None, 1).expect("list");
    assert_eq!(page[0].attempts.len(), ATTEMPTS);
    let mut g = c.benchmark_group(format!("dlq_of_{n}_retries_exhausted"));
    g.bench_function("summary_of_all", |b| {
        b.iter(|| black_box(store.dlq_summary(&all, 3_600_000).expect("summary").len()));
    });
    // The baseline in the same run: every entry decoded whole, as the summary did before it
    // read only the heads (here through a listing of the whole DLQ, which also holds the
    // entries in memory at once: a little dearer than the old summary's pass).
    g.bench_function("summary_of_all_decoding_whole_entries", |b| {
        b.iter(|| {
            let entries = store.dlq_list(&all, None, usize::MAX).expect("list");
            let mut summary = DlqSummary::new(3_600_000);
            for e in &entries {
                summary.add(&DlqHead::of(e));
            }
            black_box(summary.rows().len())
        });
    });
    g.finish();
}

criterion_group!(benches, dlq, whole_summary);
criterion_main!(benches);
