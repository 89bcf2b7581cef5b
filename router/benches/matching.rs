//! Rule-matching benchmark: the compiled matcher per operator family × rule count, from raw
//! bytes (`matches_bytes`, and `matches_bytes_trusted` which stops reading once every
//! mentioned field was seen) and from a parsed `Value` (`matches`), plus compile time, with
//! the interpreter as baseline.
//!
//! Data: `python3 /work/shared/bench/gen_citylots.py 213068 /tmp/citylots.jsonl.gz`
//! (override the path with `CITYLOTS`); the first 20,000 features are used (`CITYLOTS_LINES`).
//! Each FEATURE is matched as is (not wrapped in a CloudEvent).
//!
//! Run: `cargo bench --bench matching -- --warm-up-time 1 --measurement-time 3 --sample-size 10`
//! (`CPU_TABLE=1` first prints throughput per thread-CPU-second for every cell).

use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use router::rules::{CompiledMatcher, Pattern};
use serde_json::{Value, json};

const COUNTS: &[usize] = &[1, 100, 1_000, 10_000];

struct Data {
    lines: Vec<Vec<u8>>,
    values: Vec<Value>,
}

fn load() -> Data {
    let path = std::env::var("CITYLOTS").unwrap_or_else(|_| "/tmp/citylots.jsonl.gz".to_string());
    let limit: usize = std::env::var("CITYLOTS_LINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let file = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "{path}: {e}; generate it with `python3 /work/shared/bench/gen_citylots.py 213068 {path}`"
        )
    });
    let reader = BufReader::new(flate2::read::GzDecoder::new(file));
    let lines: Vec<Vec<u8>> = reader
        .lines()
        .take(limit)
        .map(|l| l.expect("read line").into_bytes())
        .collect();
    let values = lines
        .iter()
        .map(|l| serde_json::from_slice(l).expect("valid JSON"))
        .collect();
    Data { lines, values }
}

/// Deterministic xorshift.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn prop<'a>(v: &'a Value, k: &str) -> &'a str {
    v["properties"][k].as_str().unwrap_or("")
}

fn first(v: &Value, k: &str) -> f64 {
    v["geometry"]["firstCoordinates"][k].as_f64().unwrap_or(0.0)
}

/// The operator families. Values are sampled from the data (so rules do match), and every
/// rule is selective: a typical feature matches about `rules / 20,000` rules, so the output
/// does not grow into the thousands per event.
const FAMILIES: &[&str] = &[
    "exact",
    "prefix",
    "suffix",
    "wildcard",
    "numeric",
    "anything-but",
    "array-of-objects",
    "or",
];

fn rule(family: &str, data: &Data, r: &mut Rng) -> Value {
    let v = &data.values[r.below(data.values.len())];
    let mbl = prop(v, "MAPBLKLOT");
    match family {
        "exact" => json!({"properties": {"MAPBLKLOT": [mbl]}}),
        "prefix" => json!({"properties": {"MAPBLKLOT": [{"prefix": &mbl[..mbl.len().min(6)]}]}}),
        "suffix" => {
            json!({"properties": {"MAPBLKLOT": [{"suffix": &mbl[mbl.len().saturating_sub(6)..]}]}})
        }
        "wildcard" => {
            let (a, b) = (
                &mbl[..mbl.len().min(3)],
                &mbl[mbl.len().saturating_sub(3)..],
            );
            json!({"properties": {"MAPBLKLOT": [{"wildcard": format!("{a}*{b}")}]}})
        }
        "numeric" => {
            let x = first(v, "x");
            json!({"geometry": {"firstCoordinates": {"x": [{"numeric": [">=", x - 2e-6, "<", x + 2e-6]}]}}})
        }
        // A lone anything-but matches nearly every feature (the output would be the whole
        // rule set), so each rule pairs it with the block number it applies to.
        "anything-but" => {
            json!({"properties": {"BLOCK_NUM": [prop(v, "BLOCK_NUM")],
                                  "STREET": [{"anything-but": ["MISSION", "MARKET", prop(v, "STREET")]}]}})
        }
        // x and y of the same point of the polygon (array consistency).
        "array-of-objects" => {
            let ring = v["geometry"]["coordinates"][0]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let p = ring
                .get(r.below(ring.len().max(1)))
                .cloned()
                .unwrap_or(Value::Null);
            let (x, y) = (
                p["x"].as_f64().unwrap_or(0.0),
                p["y"].as_f64().unwrap_or(0.0),
            );
            json!({"geometry": {"coordinates": {
                "x": [{"numeric": [">=", x - 1e-6, "<=", x + 1e-6]}],
                "y": [{"numeric": [">=", y - 1e-6, "<=", y + 1e-6]}]}}})
        }
        _ => {
            let y = first(v, "y");
            json!({"$or": [
                {"properties": {"MAPBLKLOT": [mbl]}},
                {"geometry": {"firstCoordinates": {"y": [{"numeric": [">", y - 1e-6, "<", y + 1e-6]}]}}},
                {"properties": {"STREET": [prop(v, "STREET")], "BLKLOT": [{"prefix": &mbl[..4]}], "LOT_NUM": ["999"]}},
            ]})
        }
    }
}

fn patterns(family: &str, n: usize, data: &Data) -> Vec<Pattern> {
    let mut r = Rng(0x5DEE_CE66_D1CE_u64 ^ family.len() as u64);
    (0..n)
        .map(|_| Pattern::compile(&rule(family, data, &mut r)).expect("valid pattern"))
        .collect()
}

fn build(ps: &[Pattern]) -> CompiledMatcher {
    let refs: Vec<(usize, &Pattern)> = ps.iter().enumerate().collect();
    CompiledMatcher::build(&refs).expect("build")
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (Linux), in seconds.
fn thread_cpu_seconds() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = s.split_whitespace().next()?.parse().ok()?;
    Some(ns / 1e9)
}

/// With `CPU_TABLE=1`: events per second of *thread CPU time* for every family × count ×
/// mode, as a markdown table on stderr. On a machine shared with other work this is a steadier
/// figure than criterion's wall-clock throughput (it leaves out time the thread waited for a
/// core, though not cache interference).
fn cpu_table(data: &Data) {
    if std::env::var("CPU_TABLE").is_err() || thread_cpu_seconds().is_none() {
        return;
    }
    eprintln!("| family | rules | bytes (ev/s CPU) | bytes-trusted | value |");
    eprintln!("|---|---:|---:|---:|---:|");
    for family in FAMILIES {
        for &count in COUNTS {
            let m = build(&patterns(family, count, data));
            let mut row = Vec::new();
            for mode in 0..3 {
                let (mut events, mut total) = (0usize, 0usize);
                let start = thread_cpu_seconds().unwrap_or(0.0);
                let mut spent = 0.0;
                while spent < 0.6 {
                    for (line, v) in data.lines.iter().zip(&data.values) {
                        total += match mode {
                            0 => m.matches_bytes(black_box(line)).map_or(0, |r| r.len()),
                            1 => m
                                .matches_bytes_trusted(black_box(line))
                                .map_or(0, |r| r.len()),
                            _ => m.matches(black_box(v)).len(),
                        };
                    }
                    events += data.lines.len();
                    spent = thread_cpu_seconds().unwrap_or(0.0) - start;
                }
                black_box(total);
                row.push(format!("{:.0}", events as f64 / spent));
            }
            eprintln!("| {family} | {count} | {} |", row.join(" | "));
        }
    }
}

fn bench_families(c: &mut Criterion) {
    let data = load();
    cpu_table(&data);
    let n = data.lines.len() as u64;
    for family in FAMILIES {
        let mut g = c.benchmark_group(format!("match/{family}"));
        g.throughput(Throughput::Elements(n));
        for &count in COUNTS {
            let ps = patterns(family, count, &data);
            let m = build(&ps);
            // Sanity: the automaton agrees with the interpreter on a sample, and report how
            // many rules a feature matches on average.
            let mut matched = 0usize;
            for (i, v) in data.values.iter().enumerate() {
                let got = m.matches(v);
                if i < 300 && count <= 1_000 {
                    let want: Vec<usize> = (0..ps.len()).filter(|j| ps[*j].matches(v)).collect();
                    assert_eq!(got, want, "{family} {count}");
                }
                matched += got.len();
            }
            eprintln!(
                "{family} × {count}: {:?}; {:.3} matches per feature",
                m.stats(),
                matched as f64 / n as f64
            );
            g.bench_with_input(BenchmarkId::new("bytes", count), &m, |b, m| {
                b.iter(|| {
                    let mut total = 0usize;
                    for line in &data.lines {
                        total += m.matches_bytes(black_box(line)).map_or(0, |r| r.len());
                    }
                    total
                })
            });
            g.bench_with_input(BenchmarkId::new("bytes-trusted", count), &m, |b, m| {
                b.iter(|| {
                    let mut total = 0usize;
                    for line in &data.lines {
                        total += m
                            .matches_bytes_trusted(black_box(line))
                            .map_or(0, |r| r.len());
                    }
                    total
                })
            });
            g.bench_with_input(BenchmarkId::new("value", count), &m, |b, m| {
                b.iter(|| {
                    let mut total = 0usize;
                    for v in &data.values {
                        total += m.matches(black_box(v)).len();
                    }
                    total
                })
            });
        }
        g.finish();
    }
}

/// The baseline: the interpreter (rule by rule) against the compiled matcher on the same
/// 2,000 features, so 1,000 interpreted rules stay measurable and both see the same (smaller,
/// more cache-friendly) working set.
fn bench_interpreter(c: &mut Criterion) {
    let data = load();
    let sample = 2_000.min(data.lines.len());
    let (lines, values) = (&data.lines[..sample], &data.values[..sample]);
    let mut g = c.benchmark_group("baseline");
    g.throughput(Throughput::Elements(sample as u64));
    for family in ["exact", "numeric"] {
        for count in [1usize, 1_000] {
            let ps = patterns(family, count, &data);
            let m = build(&ps);
            g.bench_with_input(
                BenchmarkId::new(format!("interpreter/{family}/value"), count),
                &ps,
                |b, ps| {
                    b.iter(|| {
                        let mut total = 0usize;
                        for v in values {
                            total += ps.iter().filter(|p| p.matches(black_box(v))).count();
                        }
                        total
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("interpreter/{family}/bytes"), count),
                &ps,
                |b, ps| {
                    b.iter(|| {
                        let mut total = 0usize;
                        for line in lines {
                            let v: Value = serde_json::from_slice(black_box(line)).expect("JSON");
                            total += ps.iter().filter(|p| p.matches(&v)).count();
                        }
                        total
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("automaton/{family}/value"), count),
                &m,
                |b, m| {
                    b.iter(|| {
                        let mut total = 0usize;
                        for v in values {
                            total += m.matches(black_box(v)).len();
                        }
                        total
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("automaton/{family}/bytes"), count),
                &m,
                |b, m| {
                    b.iter(|| {
                        let mut total = 0usize;
                        for line in lines {
                            total += m.matches_bytes(black_box(line)).map_or(0, |r| r.len());
                        }
                        total
                    })
                },
            );
        }
    }
    g.finish();
}

/// Compiling 10,000 rules: all families mixed, 1,250 each.
fn bench_compile(c: &mut Criterion) {
    let data = load();
    let mut ps = Vec::new();
    let mut jsons = Vec::new();
    for family in FAMILIES {
        let mut r = Rng(0xC0FFEE ^ family.len() as u64);
        for _ in 0..1_250 {
            let j = rule(family, &data, &mut r);
            ps.push(Pattern::compile(&j).expect("valid"));
            jsons.push(j);
        }
    }
    let t = Instant::now();
    let m = build(&ps);
    eprintln!(
        "compile 10,000 mixed rules: {:?} once; {:?}",
        t.elapsed(),
        m.stats()
    );
    let mut g = c.benchmark_group("compile");
    g.throughput(Throughput::Elements(ps.len() as u64));
    g.bench_function("automaton/10000", |b| b.iter(|| build(black_box(&ps))));
    g.bench_function("json+automaton/10000", |b| {
        b.iter(|| {
            let ps: Vec<Pattern> = jsons
                .iter()
                .map(|j| Pattern::compile(black_box(j)).expect("valid"))
                .collect();
            build(&ps)
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    targets = bench_families, bench_interpreter, bench_compile
}
criterion_main!(benches);
