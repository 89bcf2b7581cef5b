//! `hostile`: misbehaves on purpose, by `data.mode`, to prove the router's sandbox limits:
//! `loop` (never returns), `oom` (memory bomb), `stack` (unbounded recursion), `panic`,
//! `output` (`data.size`: `many` = 10,000 emissions, `big` = one 2 MiB emission), `log` (a
//! flood of 20,000 lines of about 110 bytes, over 30 times the default cap, then a normal
//! return), `slow` (on its first attempt only, busy for `data.ms` milliseconds, which the
//! invocation timeout cuts short — it cannot outlive its lease, since the invocation is bounded
//! by the policy timeout and the lease outlasts that; the lease-loss test stalls the worker
//! after the invocation with a failpoint instead — then, on every attempt that gets that far,
//! records `slow:<event id>` = one `x` per attempt in kv and emits `hostile.slow.done`),
//! `sleep` (asks to sleep an hour: the router traps a guest that waits on a clock, since the
//! wait would block in the host where epoch interruption cannot reach it, so this ends at once
//! as `handler_trap`), `forge` (emits one event of type `data.type` with `data.data`, e.g. a
//! fake `router.dlq.added`: the router holds emissions to the uploader's ingest scope), `kv`
//! (writes `data.n` keys, `data.prefix` (default `k`) and a number of 5 digits or more, with
//! empty values: the operations cap), `spin` (logs `spin: start`, is busy for `data.ms`
//! milliseconds, logs `spin: end`: each log line keeps its own time).
//! Anything else: returns nothing.

use std::hint::black_box;

use router_sdk::{Delivery, Descriptor, Emit, Event, Handler, HandlerError, kv, log};

/// The handler.
pub struct Hostile;

/// Recurses (practically) forever. The values kept live across the call are wasm locals, so each
/// frame grows the engine's native stack, not the shadow stack in linear memory: the guest hits
/// the host's stack limit (a clean stack-overflow trap) long before it could corrupt memory.
#[inline(never)]
fn recurse(n: u64) -> u64 {
    if n == 0 {
        return 1;
    }
    let (a, b, c, d) = (
        n.wrapping_mul(3),
        n ^ 0x55,
        n.rotate_left(7),
        n.wrapping_add(11),
    );
    let (e, f, g, h) = (a ^ c, b.wrapping_mul(d), c.rotate_right(3), d ^ a);
    let r = recurse(n - 1);
    r.wrapping_mul(a | 1) ^ b ^ c.wrapping_add(d) ^ e ^ f.wrapping_sub(g) ^ h
}

impl Handler for Hostile {
    fn describe() -> Descriptor {
        Descriptor::new("hostile", env!("CARGO_PKG_VERSION"))
    }

    fn handle(event: &Event, delivery: &Delivery) -> Result<Vec<Emit>, HandlerError> {
        let data = event.data_value()?;
        let mode = data
            .get("mode")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        match mode {
            "loop" => {
                let mut i = 0u64;
                loop {
                    i = black_box(i.wrapping_add(1));
                }
            }
            "oom" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![0xA5; 1 << 20]);
                    black_box(&hoard);
                }
            }
            "stack" => {
                black_box(recurse(black_box(u64::MAX)));
                Ok(Vec::new())
            }
            "panic" => panic!("hostile handler panicked on purpose (event {})", event.id),
            "sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(3600));
                Ok(Vec::new())
            }
            "output" => {
                if data.get("size").and_then(serde_json::Value::as_str) == Some("big") {
                    let blob = "x".repeat(2 << 20);
                    return Ok(vec![Emit::json("hostile.big", &blob)?]);
                }
                Ok((0..10_000)
                    .map(|i| Emit::new(format!("hostile.many.{i}")))
                    .collect())
            }
            "log" => {
                let line = "y".repeat(100);
                for i in 0..20_000 {
                    log::info!("flood {i}: {line}");
                }
                Ok(Vec::new())
            }
            "slow" => {
                if delivery.attempt == 1 {
                    let ms = data
                        .get("ms")
                        .and_then(serde_json::Value::as_u64)
                        .unwrap_or(0);
                    let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
                    while std::time::Instant::now() < until {
                        black_box(0u64);
                    }
                }
                log::info!("slow: attempt {} done", delivery.attempt);
                // One byte per attempt: the stored length tells which attempt's write won.
                let mark = "x".repeat(delivery.attempt as usize);
                kv::set(&format!("slow:{}", event.id), mark.as_bytes(), None);
                Ok(vec![Emit::new("hostile.slow.done")])
            }
            "forge" => {
                let ty = data
                    .get("type")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("hostile.forged");
                let body = data.get("data").cloned().unwrap_or(serde_json::Value::Null);
                Ok(vec![Emit::json(ty, &body)?])
            }
            "spin" => {
                let ms = data
                    .get("ms")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                log::info!("spin: start");
                let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
                while std::time::Instant::now() < until {
                    black_box(0u64);
                }
                log::info!("spin: end");
                Ok(Vec::new())
            }
            "kv" => {
                let n = data.get("n").and_then(serde_json::Value::as_u64).unwrap_or(0);
                let prefix = data
                    .get("prefix")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("k");
                for i in 0..n {
                    kv::set(&format!("{prefix}{i:05}"), b"", None);
                }
                Ok(Vec::new())
            }
            _ => Ok(Vec::new()),
        }
    }
}

router_sdk::export_handler!(Hostile);
