//! Rule-matching benchmark for `exists: false` under an array of objects: R rules, rule i
//! `{"source": ["nope-<i>"], "data": {"items": {"f<i>": [{"exists": false}]}}}` (the source
//! test fails for every event, so no rule can match), against an event whose `data.items`
//! holds E objects, none of which has any `f<i>`. The matching work should not grow with R:
//! no rule gets past its first test. Synthetic data, no files needed.
//!
//! Run: `cargo bench -p router --bench absence` (`CPU_TABLE=1` first prints microseconds of
//! thread CPU time per event for every cell, steadier than wall time on a shared machine).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use router::rules::{CompiledMatcher, Pattern};
use serde_json::{Value, json};

const RULES: &[usize] = &[10, 100, 1_000];
const ELEMENTS: &[usize] = &[10, 100];

fn matcher(rules: usize) -> CompiledMatcher {
    let ps: Vec<Pattern> = (0..rules)
        .map(|i| {
            let field = format!("f{i}");
            Pattern::compile(&json!({
                "source": [format!("nope-{i}")],
                "data": {"items": {field: [{"exists": false}]}}
            }))
            .expect("valid pattern")
        })
        .collect();
    let refs: Vec<(usize, &Pattern)> = ps.iter().enumerate().collect();
    CompiledMatcher::build(&refs).expect("build")
}

fn event(elements: usize) -> Value {
    let items: Vec<Value> = (0..elements)
        .map(|i| json!({"sku": format!("sku-{i}"), "qty": i}))
        .collect();
    json!({
        "specversion": "1.0", "id": "1", "source": "/bench", "type": "order.created",
        "data": {"items": items}
    })
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (Linux), in seconds.
fn thread_cpu_seconds() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = s.split_whitespace().next()?.parse().ok()?;
    Some(ns / 1e9)
}

/// With `CPU_TABLE=1`: microseconds of thread CPU per event for every R × E cell and both
/// flatteners (parsed value, raw bytes), with the automaton steps, as a markdown table.
fn cpu_table() {
    if std::env::var("CPU_TABLE").is_err() || thread_cpu_seconds().is_none() {
        return;
    }
    eprintln!("| rules | elements | value (µs CPU) | bytes (µs CPU) | steps |");
    eprintln!("|---:|---:|---:|---:|---:|");
    for &r in RULES {
        let m = matcher(r);
        for &e in ELEMENTS {
            let v = event(e);
            let bytes = serde_json::to_vec(&v).expect("serialize");
            let mut steps = 0;
            assert!(m.matches_counting(&v, &mut steps).is_empty());
            let mut cells = Vec::new();
            for mode in 0..2 {
                let (mut n, mut total) = (0u64, 0usize);
                let start = thread_cpu_seconds().unwrap_or(0.0);
                let mut spent = 0.0;
                while spent < 0.5 {
                    for _ in 0..64 {
                        total += match mode {
                            0 => m.matches(black_box(&v)).len(),
                            _ => m.matches_bytes(black_box(&bytes)).map_or(0, |x| x.len()),
                        };
                    }
                    n += 64;
                    spent = thread_cpu_seconds().unwrap_or(0.0) - start;
                }
                black_box(total);
                cells.push(format!("{:.2}", spent * 1e6 / n as f64));
            }
            eprintln!("| {r} | {e} | {} | {steps} |", cells.join(" | "));
        }
    }
}

fn bench_absence(c: &mut Criterion) {
    cpu_table();
    let mut g = c.benchmark_group("absence");
    for &r in RULES {
        let m = matcher(r);
        for &e in ELEMENTS {
            let v = event(e);
            let bytes = serde_json::to_vec(&v).expect("serialize");
            let id = format!("R{r}/E{e}");
            g.bench_with_input(BenchmarkId::new("value", &id), &v, |b, v| {
                b.iter(|| m.matches(black_box(v)))
            });
            g.bench_with_input(BenchmarkId::new("bytes", &id), &bytes, |b, bytes| {
                b.iter(|| m.matches_bytes(black_box(bytes)))
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    targets = bench_absence
}
criterion_main!(benches);
