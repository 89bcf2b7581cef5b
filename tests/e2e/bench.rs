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

/// A receiver answering some requests 503 with `Retry-After`: the report names the failures
/// by status with a count, their events and the header; the latency line counts the
/// successful requests; the run exits 1 unless `--allow-failures`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_are_broken_down_and_fail_the_run_unless_allowed() {
    let rcv = Receiver::scripted(std::sync::Arc::new(|ev, _| {
        if ev["data"]["order_id"].as_u64().unwrap_or(0) % 4 == 0 {
            (503, Duration::ZERO, vec![("retry-after", "7".to_string())])
        } else {
            (202, Duration::ZERO, vec![])
        }
    }))
    .await;
    let url = rcv.url();
    let args = [
        "--url",
        &url,
        "--events",
        "40",
        "--concurrency",
        "2",
        "--size",
        "256",
    ];
    let (code, out, err) = bench_ingest(&args).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains("events ok:      30 acknowledged"), "{out}");
    assert!(
        out.contains("failed reqs:    10 of 40 requests, 10 events"),
        "{out}"
    );
    assert!(
        out.contains(
            "  10 × 503 Service Unavailable (10 events), 10 with Retry-After (first: \"7\")"
        ),
        "{out}"
    );
    assert!(out.contains("latency (fail): "), "{out}");
    assert!(err.contains("10 of 40 requests failed"), "{err}");

    let (code, out, err) = bench_ingest(&[&args[..], &["--allow-failures"]].concat()).await;
    assert_eq!(code, Some(0), "{out}{err}");
}

/// Nothing listening: every request fails as a refused connection, which the report says,
/// and even `--allow-failures` exits 1 (the run measured nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_reported_as_such_and_fails_the_run() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("http://127.0.0.1:{port}/v1/events");
    let (code, out, err) = bench_ingest(&[
        "--url",
        &url,
        "--events",
        "6",
        "--concurrency",
        "2",
        "--allow-failures",
    ])
    .await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("6 × connect: connection refused (6 events)"),
        "{out}"
    );
    assert!(
        out.contains("latency (req):  no request succeeded"),
        "{out}"
    );
    assert!(err.contains("every request failed"), "{err}");
}

/// A router that takes requests and never answers: Ctrl-C stops the run, which prints what it
/// did (and what it abandoned) and exits 130, instead of hanging until the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_a_hung_run_and_prints_its_report() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/v1/events", listener.local_addr().expect("addr"));
    let hung = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args([
            "bench",
            "ingest",
            "--url",
            &url,
            "--events",
            "50",
            "--concurrency",
            "3",
        ])
        .env_remove("ROUTER_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn bench ingest");
    let pid = child.id().expect("pid").to_string();
    // Time to connect and send its first requests (generous: a loaded machine).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = tokio::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .await
        .expect("kill -INT");
    assert!(sent.success());
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("stopped within 30 s of Ctrl-C (its request timeout is 60 s)")
        .expect("output");
    hung.abort();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(130), "{stdout}{stderr}");
    assert!(stdout.starts_with("run id:         "), "{stdout}");
    assert!(
        stdout.contains(
            "interrupted:    stopped before the end; 3 requests in flight abandoned (3 events)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("failed reqs:    0"), "{stdout}");
    assert!(stderr.contains("interrupted"), "{stderr}");
}

/// `--timeout`: a request a router does not answer in time is a failure of its own kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_timeout_is_a_failure_of_its_own_kind() {
    let rcv = Receiver::scripted(std::sync::Arc::new(|ev, _| {
        let slow = ev["data"]["order_id"].as_u64() == Some(0);
        (
            202,
            if slow {
                Duration::from_secs(5)
            } else {
                Duration::ZERO
            },
            vec![],
        )
    }))
    .await;
    let url = rcv.url();
    let (code, out, err) = bench_ingest(&[
        "--url",
        &url,
        "--events",
        "4",
        "--concurrency",
        "1",
        "--timeout",
        "300ms",
    ])
    .await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("failed reqs:    1 of 4 requests, 1 events"),
        "{out}"
    );
    assert!(
        out.contains("  1 × timed out (1 events): \"no complete answer within 300ms\""),
        "{out}"
    );
    assert!(out.contains("events ok:      3 acknowledged"), "{out}");
}
