#!/usr/bin/env python3
"""A router with many webhook targets under a burst: what delivery costs the receivers.

Usage: BIN=target/release/router scripts/bench-many-targets.py TARGETS EVENTS_PER_TARGET [NOFILE]

Generates one rule per customer (`source: [/cust/<i>]` -> webhook target `c<i>`, all to one
`router bench sink` on its own path), starts the sink and the router (with the open-file
limit NOFILE, soft and hard, when given) in a temporary directory, posts TARGETS x
EVENTS_PER_TARGET events in batches of 1000 over 4 connections, and watches until every event
is delivered or dead-lettered (at most 300 s). Prints one JSON line: time to drain, delivered,
dead letters, attempts retried, breakers not closed, the most descriptors the router held and
connections to the sink open at once, and the router's log lines about running out of
descriptors. With the same total, a healthy router's retries and dead letters should not grow
with the number of targets (docs/BENCHMARKS.md, "Many targets").
"""
import http.client
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

BIN = os.environ.get("BIN", "target/release/router")
PORT, SINK = 21860, 21861


def free_env():
    # ROUTER_* variables are configuration keys of the router: none of the caller's.
    return {k: v for k, v in os.environ.items() if not k.startswith("ROUTER_")}


def rules(path, n):
    policy = """policies:
  std:
    timeout: 2s
    retry: { max_attempts: 5, base_delay: 200ms, max_delay: 5s, jitter: full, max_age: 1h }
    breaker: { failure_rate: 0.5, min_requests: 10, window: 30s, open_for: 10s, half_open_probes: 1 }
rules:
"""
    body = "".join(
        f"""  - name: cust-{i}
    pattern: {{ source: [/cust/{i}] }}
    targets:
      - webhook: http://127.0.0.1:{SINK}/t/{i}
        id: c{i}
        policy: std
"""
        for i in range(n)
    )
    with open(os.path.join(path, "cust.yaml"), "w") as f:
        f.write(policy + body)


def get(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=30) as r:
        return r.read()


def all_targets():
    # `/v1/targets` answers 1000 targets a page: follow `next`.
    targets, after = [], None
    while True:
        page = json.loads(get("/v1/targets" + (f"?after={after}" if after else "")))
        targets += page["targets"]
        after = page.get("next")
        if not after:
            return targets


def send(n_targets, total):
    batches = (total + 999) // 1000
    counter = iter(range(batches))
    lock = threading.Lock()
    statuses = []

    def worker():
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
        while True:
            with lock:
                k = next(counter, None)
            if k is None:
                return
            evs = [
                {
                    "specversion": "1.0",
                    "id": f"b{k}-{j}",
                    "source": f"/cust/{(k * 1000 + j) % n_targets}",
                    "type": "cust.evt",
                    "data": {"pad": "x" * 100},
                }
                for j in range(min(1000, total - k * 1000))
            ]
            c.request("POST", "/v1/events", json.dumps(evs), {"content-type": "application/cloudevents-batch+json"})
            r = c.getresponse()
            r.read()
            with lock:
                statuses.append(r.status)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    return threads, statuses


def main():
    n, k = int(sys.argv[1]), int(sys.argv[2])
    nofile = int(sys.argv[3]) if len(sys.argv) > 3 else None
    total = n * k
    work = tempfile.mkdtemp(prefix="many-targets-")
    for d in ("rules", "contracts", "data"):
        os.makedirs(os.path.join(work, d))
    rules(os.path.join(work, "rules"), n)
    sink = subprocess.Popen([BIN, "bench", "sink", "--listen", f"127.0.0.1:{SINK}"], env=free_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log_path = os.path.join(work, "router.log")
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    router = subprocess.Popen(
        [BIN, "serve", "--listen", f"127.0.0.1:{PORT}", "--data-dir", os.path.join(work, "data"),
         "--rules", os.path.join(work, "rules"), "--contracts", os.path.join(work, "contracts")],
        env=free_env(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT, preexec_fn=limit)
    try:
        for _ in range(600):
            try:
                get("/readyz")
                break
            except Exception:
                if router.poll() is not None:
                    sys.exit(f"the router exited ({router.returncode}); see {log_path}")
                time.sleep(0.1)
        started = time.time()
        threads, statuses = send(n, total)
        most = {"fds": 0, "conns": 0}
        while True:
            most["fds"] = max(most["fds"], len(os.listdir(f"/proc/{router.pid}/fd")))
            ss = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{SINK} )"],
                                capture_output=True, text=True).stdout
            most["conns"] = max(most["conns"], len(ss.splitlines()))
            targets = all_targets()
            delivered = sum(t["delivered"] for t in targets)
            dead = sum(t["dlq"] for t in targets)
            if delivered + dead >= total or time.time() - started > 300:
                break
            time.sleep(0.5)
        for t in threads:
            t.join()
        with open(log_path) as f:
            exhausted = sum(1 for line in f if "Too many open files" in line or "os error 24" in line)
        print(json.dumps({
            "targets": n, "events": total, "nofile": nofile,
            "accepted_requests": statuses.count(202), "requests": len(statuses),
            "drain_s": round(time.time() - started, 1), "delivered": delivered, "dlq": dead,
            "retried": sum(t["retried"] for t in targets),
            "breakers_not_closed": sum(1 for t in targets if (t.get("breaker") or {}).get("state", "closed") != "closed"),
            "most_fds": most["fds"], "most_sink_connections": most["conns"],
            "log_lines_out_of_descriptors": exhausted,
        }))
    finally:
        for p in (router, sink):
            p.terminate()
            p.wait(30)
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
