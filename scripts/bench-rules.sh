# Sourced by the benchmark scripts. bench_rules DIR writes DIR/bench.yaml: `bench.event`
# events go to the webhook sink at 127.0.0.1:19998 (target `sink`), whose queue may hold a
# whole run (the default depth cap, 100,000, would send most of a batched run to the DLQ as
# target_overflow, a cheaper path than a real fan-out).
bench_rules() {
  mkdir -p "$1"
  cat > "$1/bench.yaml" <<YAML
policies:
  bench:
    max_queue_depth: 10000000
rules:
  - name: bench
    pattern: { type: [bench.event] }
    targets:
      - webhook: http://127.0.0.1:19998/hook
        id: sink
        policy: bench
YAML
}
