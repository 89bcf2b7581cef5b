//! The `router` command: parses the CLI, loads config, calls into the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::Context;
use clap::{Parser, Subcommand};
use router::config::Config;
use router::contract::ContractSet;
use router::rules::RuleSet;
use tokio_util::sync::CancellationToken;

/// `println!` for the command's output: a reader that goes away before the end (`router dlq ls
/// | head`) ends the process quietly (status 141, as a shell shows for a command a closed pipe
/// ended) rather than with `println!`'s panic and backtrace.
macro_rules! outln {
    ($($arg:tt)*) => {
        router::cli::write_stdout(format_args!($($arg)*))
    };
}

// The pipeline allocates many small, short-lived buffers per event (JSON values, records);
// mimalloc handles that pattern markedly better than glibc's allocator under two threads.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "router",
    version,
    about = "A WebAssembly-pluggable CloudEvents router"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the router (HTTP API, delivery workers).
    Serve {
        /// TOML config file; without it, embedded defaults (+ ROUTER_* env).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Address to listen on (overrides the config).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Store directory (overrides the config).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Rules directory (overrides the config).
        #[arg(long)]
        rules: Option<PathBuf>,
        /// Contracts directory (overrides the config).
        #[arg(long)]
        contracts: Option<PathBuf>,
    },
    /// The router at a glance, and what needs an operator now (client of the API). Exit 0:
    /// nothing needs attention; 1: something does (listed under "needs attention"); 2: the
    /// router could not be asked.
    Status {
        #[command(flatten)]
        api: Api,
        /// Dead letters newer than this count as needing attention.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        recent: std::time::Duration,
    },
    /// Rules: check and test rule files; list, enable and disable the live rules (`ls`,
    /// `enable`, `disable`: client of the API).
    Rules {
        #[command(subcommand)]
        cmd: RulesCmd,
    },
    /// Contracts: check a directory, or push one version to a running router.
    Contracts {
        #[command(subcommand)]
        cmd: ContractsCmd,
    },
    /// Dead letters (client of the API).
    Dlq {
        #[command(flatten)]
        api: Api,
        #[command(subcommand)]
        cmd: DlqCmd,
    },
    /// Re-route archived events of a time range through the current rules (client of the API).
    Replay {
        #[command(flatten)]
        api: Api,
        /// RFC 3339 start of the acceptance-time range.
        #[arg(long)]
        from: String,
        /// RFC 3339 end (exclusive).
        #[arg(long)]
        to: String,
        /// An event pattern (JSON) the replayed events must match.
        #[arg(long)]
        filter: Option<String>,
        /// Events per second.
        #[arg(long, default_value_t = 10.0)]
        rate: f64,
        /// Replay the handlers' archived emissions too (by default they are skipped: the
        /// replay runs the handlers again, which emit them anew).
        #[arg(long)]
        include_emitted: bool,
        /// Replay the events that fail their type's current contract too (by default they
        /// are skipped, counted as `skipped_contract`, as ingest would quarantine them now).
        #[arg(long)]
        ignore_contracts: bool,
        /// Queue copies only for this rule's targets (repeatable). Without it every rule the
        /// events match now gets them, and targets that already had them get them again under
        /// new idempotency keys: after `rules disable`/`enable`, name the rule.
        #[arg(long = "rule", value_name = "NAME")]
        rules: Vec<String>,
        /// Queue copies only for this target (repeatable; with --rule, only those of the
        /// rules' targets).
        #[arg(long = "target", value_name = "ID")]
        targets: Vec<String>,
        /// Follow the job's progress until it ends.
        #[arg(long)]
        wait: bool,
    },
    /// Targets: list, pause, resume, release an ordering key held after a dead letter (client
    /// of the API).
    Targets {
        #[command(flatten)]
        api: Api,
        #[command(subcommand)]
        cmd: TargetsCmd,
    },
    /// WASM handlers: push, list, rollback, read a handler's logs (client of the API).
    Handlers {
        #[command(flatten)]
        api: Api,
        #[command(subcommand)]
        cmd: HandlersCmd,
    },
    /// Bearer tokens.
    Token {
        #[command(subcommand)]
        cmd: TokenCmd,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        cmd: ConfigCmd,
    },
    /// Load tools.
    Bench {
        #[command(subcommand)]
        cmd: BenchCmd,
    },
    /// The embedded store's file (a stopped router's data directory).
    Store {
        #[command(subcommand)]
        cmd: StoreCmd,
    },
}

#[derive(Subcommand)]
enum StoreCmd {
    /// Verify the store file page by page (redb's integrity check, which a cleanly closed file
    /// otherwise never gets) and decode every record. The router must be stopped. Exit 0: sound;
    /// 1: damaged (what to do: docs/operations.md, "A damaged store file"); 2: could not check.
    Check {
        /// The router's data directory (holding router.redb).
        #[arg(long)]
        data_dir: PathBuf,
    },
}

#[derive(clap::Args, Clone)]
struct Api {
    /// Router API base URL.
    #[arg(
        long,
        global = true,
        default_value = "http://127.0.0.1:8080",
        env = "ROUTER_API"
    )]
    api: String,
    /// Bearer token for a router with `[[auth.tokens]]` (better passed in the environment than
    /// on the command line, where `ps` shows it).
    #[arg(long, global = true, env = "ROUTER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
}

impl Api {
    fn client(&self) -> router::cli::Client {
        router::cli::Client::new(&self.api, self.token.as_deref())
    }
}

#[derive(clap::Args, Clone, Default)]
struct DlqFilterArgs {
    /// Only entries of this target id.
    #[arg(long)]
    target: Option<String>,
    /// Only entries with this reason: contract_violation, unknown_version, permanent_error,
    /// retries_exhausted, max_age_exceeded, loop_detected, target_removed, target_overflow,
    /// scope_violation, handler_released, corrupt_record or not_accepted.
    #[arg(long)]
    reason: Option<String>,
    /// Only entries of this rule.
    #[arg(long)]
    rule: Option<String>,
    /// Only events of this CloudEvents type.
    #[arg(long = "type")]
    ty: Option<String>,
    /// Only events of this CloudEvents source.
    #[arg(long)]
    source: Option<String>,
    /// Only entries whose last failure is at or after this time (RFC 3339).
    #[arg(long)]
    since: Option<String>,
    /// Only entries whose last failure is before this time (RFC 3339).
    #[arg(long)]
    until: Option<String>,
}

impl DlqFilterArgs {
    /// Refuses a `what` (redrive, purge) of the whole DLQ that does not say `--all`, in the
    /// CLI's words: the server's refusal names the API's `"all": true`, which is no flag here.
    fn check_all(&self, what: &str, all: bool) -> anyhow::Result<()> {
        if all || self.json().as_object().is_some_and(|m| !m.is_empty()) {
            return Ok(());
        }
        anyhow::bail!(
            "an empty filter would {what} the whole DLQ: give at least one of --target, --reason, --rule, --type, --source, --since, --until; or pass --all to {what} every entry"
        )
    }

    fn json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, v) in [
            ("target", &self.target),
            ("reason", &self.reason),
            ("rule", &self.rule),
            ("type", &self.ty),
            ("source", &self.source),
            ("since", &self.since),
            ("until", &self.until),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), v.clone().into());
            }
        }
        m.into()
    }

    fn query(&self, extra: &[(&str, &Option<String>)]) -> String {
        let mut pairs: Vec<(&str, &Option<String>)> = vec![
            ("target", &self.target),
            ("reason", &self.reason),
            ("rule", &self.rule),
            ("type", &self.ty),
            ("source", &self.source),
            ("since", &self.since),
            ("until", &self.until),
        ];
        pairs.extend_from_slice(extra);
        router::cli::query(&pairs)
    }
}

#[derive(Subcommand)]
enum DlqCmd {
    /// List entries (never changes anything).
    Ls {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// Only events this handler emitted that went to the DLQ before any target (out of
        /// its owner's ingest scope, past the hop limit, failing a contract); the handler's
        /// team lists them with its own token.
        #[arg(long)]
        emitted_by: Option<String>,
        /// Entries per page, 1 to 1000 (default 100).
        #[arg(long)]
        limit: Option<String>,
        /// Cursor: list entries after this entry id (the `next` of the previous page).
        #[arg(long)]
        after: Option<String>,
    },
    /// Counts by target × reason with a histogram over time.
    Summary {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// Bucket width, whole seconds (at least 1s), e.g. 90s, 5m, 1h, 1d.
        #[arg(long)]
        bucket: Option<String>,
    },
    /// One entry with its event and every attempt.
    Show { id: String },
    /// Move matching entries back to their queues at a set rate (a job; with no filter, only
    /// with --all).
    Redrive {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// Entries moved back per second.
        #[arg(long, default_value_t = 10.0)]
        rate: f64,
        /// Follow the job's progress until it ends.
        #[arg(long)]
        wait: bool,
        /// Redrive every entry of the DLQ (required when no filter is given).
        #[arg(long)]
        all: bool,
    },
    /// Delete matching entries (with no filter, only with --all).
    Purge {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// Only count.
        #[arg(long)]
        dry_run: bool,
        /// Purge every entry of the DLQ (required when no filter is given).
        #[arg(long)]
        all: bool,
    },
    /// Redrive and replay jobs: list (newest first), or show/pause/resume/cancel one.
    Jobs {
        /// A job's id (without it: the list).
        id: Option<String>,
        /// pause, resume or cancel.
        action: Option<String>,
        /// List only jobs in this state (running, paused, cancelled, done).
        #[arg(long)]
        state: Option<String>,
        /// List at most this many (server default 100, at most 1000).
        #[arg(long)]
        limit: Option<String>,
    },
}

#[derive(Subcommand)]
enum TargetsCmd {
    /// Every target with queue, breaker and counters.
    Ls {
        /// Only the targets that need an operator: paused, held off by their receiver, breaker
        /// open or half-open, ordering keys held, or not running (with many targets, the few
        /// that matter).
        #[arg(long)]
        problems: bool,
    },
    /// Stop attempts to a target (its queue fills).
    Pause { id: String },
    /// Resume a paused target; also lifts a receiver's Retry-After hold (paused or not).
    Resume { id: String },
    /// Let an ordering key held after a dead letter (`on_dead_letter: hold`) proceed; the
    /// key's waiting entries already past max_age go to the DLQ first.
    ReleaseKey { id: String, key: String },
}

#[derive(Subcommand)]
enum RulesCmd {
    /// Validate every rule file in DIR; prints file:line:col: message per problem, exit 1 on any error.
    Check {
        dir: PathBuf,
        /// Also require every handler target's handler to be one of the `*.wasm` components in
        /// this directory (named by file stem, as `handlers.preload_dir` loads them).
        #[arg(long, value_name = "DIR")]
        handlers: Option<PathBuf>,
        /// Also require every handler target's handler to have an active version on the router
        /// whose API is at URL (`GET /v1/handlers`, with the token in `ROUTER_TOKEN`): the
        /// check before deploying rule files to it.
        #[arg(long, value_name = "URL", conflicts_with = "handlers")]
        handlers_on: Option<String>,
        /// Bearer token for `--handlers-on`.
        #[arg(long, env = "ROUTER_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Print, as JSON, the rules and targets in DIR that EVENT (a structured CloudEvent JSON file) matches.
    Test { dir: PathBuf, event: PathBuf },
    /// List the live rules: file:line, enabled, targets, and the events each matched on the
    /// router (since it started) with the last match. Client of the API.
    Ls {
        #[command(flatten)]
        api: Api,
    },
    /// Disable a live rule (persisted; overrides the files until enabled). Client of the API.
    Disable {
        name: String,
        #[command(flatten)]
        api: Api,
    },
    /// Enable a rule disabled with `disable`. Client of the API.
    Enable {
        name: String,
        #[command(flatten)]
        api: Api,
    },
}

#[derive(Subcommand)]
enum ContractsCmd {
    /// Validate every contract in DIR and report what each version breaks against the
    /// previous one (a breaking change is what a new version is for: reported, exit 0).
    /// With `--against BASE` (the same directory as deployed, e.g. a checkout of the main
    /// branch), exit 1 when a version BASE has was changed incompatibly in place or removed:
    /// the check for a contracts repository's CI, as the upload API refuses such a change.
    Check {
        dir: PathBuf,
        /// The contracts directory as deployed, to find versions edited in place.
        #[arg(long, value_name = "BASE")]
        against: Option<PathBuf>,
    },
    /// Put FILE (a JSON Schema) live as the contract of TYPE at VERSION on a running router
    /// (`PUT /v1/contracts/{type}/v{N}`): a new version prints its breaking changes against
    /// the one before; an incompatible change to a live version is refused. Client of the API.
    Push {
        /// The event type.
        #[arg(value_name = "TYPE")]
        ty: String,
        /// The `dataversion`: `v2` or `2`.
        version: String,
        /// The schema file.
        file: PathBuf,
        #[command(flatten)]
        api: Api,
    },
}

#[derive(Subcommand)]
enum HandlersCmd {
    /// Upload a component (validated before it becomes active).
    Push {
        name: String,
        file: PathBuf,
        /// An administrator's upload for a team: the handler becomes that team's.
        #[arg(long)]
        team: Option<String>,
        /// How long to wait for the router's answer: it compiles and checks the component
        /// first, which for a large one (a Python handler) on a busy machine takes minutes.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Every handler with its active version.
    List,
    /// Activate an earlier version (number or sha256 prefix).
    Rollback { name: String, version: String },
    /// Recent log lines of a handler (kept on disk by the router, size-capped).
    Logs {
        name: String,
        /// Only lines written while handling this event id.
        #[arg(long = "event")]
        event_id: Option<String>,
        /// Only lines of events from this source (with --event: that one event).
        #[arg(long)]
        source: Option<String>,
        /// Only lines at this level or above (trace, debug, info, warn, error).
        #[arg(long)]
        level: Option<String>,
        /// At most this many of the most recent matching lines (server default 200).
        #[arg(long)]
        limit: Option<String>,
        /// Only lines of this attempt.
        #[arg(long)]
        attempt: Option<String>,
        /// Only lines older than this position: the `--before` printed after the page before
        /// (`next_before` with --json).
        #[arg(long)]
        before: Option<String>,
    },
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Prints a new random token once, and the config lines (with its SHA-256) to add.
    New {
        /// Who holds it (team or producer).
        name: String,
        /// Scopes: ingest:<type-glob>, ingest-source:<source-glob>, handlers:<name-glob>,
        /// dlq:<target-glob>, read, admin.
        #[arg(long = "scope", required = true)]
        scopes: Vec<String>,
        /// The team it belongs to (default: NAME): handlers belong to their first uploader's
        /// team, so a replacement token for a team takes the same team.
        #[arg(long)]
        team: Option<String>,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Per target: the worst-case number of attempts an event can receive and the longest time
    /// before it reaches the DLQ, from its policy. The numbers are per entry from its first
    /// attempt; what holds an entry before that, or between attempts without spending one
    /// (ordering, on_dead_letter: hold, a handler not uploaded, a target that cannot start),
    /// is in the notes.
    Explain {
        /// Rules directory (default: the configured rules_dir).
        dir: Option<PathBuf>,
        /// TOML config file.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Send events to POST /v1/events and report events/s and latency percentiles. Exits 1
    /// when any request failed (see --allow-failures), 130 when interrupted, 2 on an error.
    Ingest(router::bench::IngestBench),
    /// Accept events straight into a store in DIR (no HTTP): the store's group commit alone.
    Store(router::bench::StoreBench),
    /// Accept, deliver and then sweep events in a store in DIR: the sweeper's cost per event
    /// and per commit.
    Sweep(router::bench::SweepBench),
    /// A receiver that parses and discards (baseline endpoint and fast webhook).
    Sink(router::bench::SinkBench),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            let cause: &(dyn std::error::Error + 'static) = e.as_ref();
            router::errln!("error: {}", router::cli::error_chain(cause));
            ExitCode::from(2)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    // Ingest, the admin API and the background tasks; delivery has a runtime of its own
    // (`deliver::DeliveryThreads`) at a lower priority.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("router-ingest")
        .enable_all()
        .build()?;
    match cli.cmd {
        Cmd::Serve {
            config,
            listen,
            data_dir,
            rules,
            contracts,
        } => {
            let env = Config::env_vars();
            // Kept in the configuration: a reload reads it again the same way.
            let origin = router::config::ConfigOrigin {
                file: config,
                listen,
                data_dir,
                rules_dir: rules,
                contracts_dir: contracts,
            };
            let (cfg, config_warnings) = origin.load()?;
            router::telemetry::init_tracing(cfg.log_format == router::config::LogFormat::Json);
            // Before `run` derives server.max_connections and delivery.max_in_flight from it.
            #[cfg(unix)]
            match router::config::raise_open_file_limit() {
                Ok(router::config::OpenFileLimit::Raised(from, to)) => {
                    tracing::info!(from, to, "raised the soft open-file limit to the hard limit")
                }
                Ok(router::config::OpenFileLimit::Unchanged(limit)) => {
                    tracing::info!(limit, "open-file limit already at the hard limit")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not raise the soft open-file limit to the hard limit; the descriptors the router derives its connection and delivery bounds from stay at the soft limit")
                }
            }
            for w in &config_warnings {
                tracing::warn!("config: {w}");
            }
            let links = router::config::kubernetes_service_links(&env);
            if !links.is_empty() {
                tracing::info!(variables = ?links, "ignored as Kubernetes service links of a Service named `router`, not configuration keys");
            }
            let served = rt.block_on(async move {
                // SIGHUP's default action ends the process: until the reload trigger listens
                // (after the store opens and the handlers load, seconds on a large store), a
                // HUP sent to reload would have killed the router. A handler registered now
                // stays for the process; a HUP that comes before the trigger listens is
                // dropped (send it again, or POST /v1/admin/reload).
                #[cfg(unix)]
                let _early_hup =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
                let listener = tokio::net::TcpListener::bind(cfg.listen)
                    .await
                    .with_context(|| format!("cannot listen on {}", cfg.listen))?;
                let shutdown = CancellationToken::new();
                let s = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    // Cancelled first: nothing a log line can do may keep the router running.
                    s.cancel();
                    tracing::info!("signal received: stopping ingest");
                });
                router::app::run(cfg, listener, shutdown).await?;
                Ok::<_, anyhow::Error>(())
            });
            // `run` has finished its shutdown within its grace period. What a drop of the
            // runtime would still wait for is blocking work nobody awaits any more: above all
            // a handler compilation whose upload's client gave up (tens of seconds for a large
            // component, and it can activate nothing once `run` closed the registry). A short
            // bound, not none: a file write finishing on a blocking thread gets its moment.
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
            served?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Rules {
            cmd:
                RulesCmd::Check {
                    dir,
                    handlers,
                    handlers_on,
                    token,
                },
        } => {
            let known: Option<std::collections::BTreeSet<String>> = match (handlers, handlers_on)
            {
                (Some(h), _) => Some(
                    router::wasm::component_files(&h)
                        .with_context(|| {
                            format!("cannot read the handlers directory {}", h.display())
                        })?
                        .into_iter()
                        .map(|(name, _)| name)
                        .collect(),
                ),
                (None, Some(url)) => {
                    let c = router::cli::Client::new(&url, token.as_deref());
                    let v = rt
                        .block_on(c.call(reqwest::Method::GET, "/v1/handlers", None))
                        .with_context(|| format!("cannot list the handlers of {url}"))?;
                    Some(router::cli::active_handlers(&v))
                }
                (None, None) => None,
            };
            // Unknown handlers are errors of the same pass as the loader's own.
            match RuleSet::check_dir(&dir, known.as_ref()) {
                Ok((set, warnings)) => {
                    for w in &warnings {
                        outln!("{w}");
                    }
                    outln!(
                        "ok: {} rules, {} targets, {} policies in {} files (version {})",
                        set.rules.len(),
                        set.targets.len(),
                        set.policies.len(),
                        set.files.len(),
                        set.version
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(diagnostics) => {
                    for d in &diagnostics {
                        outln!("{d}");
                    }
                    // Warnings are printed among the errors but are not problems.
                    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
                    let warnings = diagnostics.len() - errors;
                    if warnings == 0 {
                        router::errln!("{errors} error(s)");
                    } else {
                        router::errln!("{errors} error(s), {warnings} warning(s)");
                    }
                    Ok(ExitCode::from(1))
                }
            }
        }
        Cmd::Rules {
            cmd: RulesCmd::Test { dir, event },
        } => {
            let (set, _) = RuleSet::load_dir(&dir).map_err(|e| rules_invalid(&e))?;
            let text = std::fs::read_to_string(&event)
                .with_context(|| format!("reading {}", event.display()))?;
            let ev: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", event.display()))?;
            let matched = match set.test_event(ev) {
                Ok(m) => m,
                Err(errors) => {
                    router::errln!("{} is not a valid CloudEvent:", event.display());
                    for e in &errors {
                        router::errln!("  {}: {}", if e.pointer.is_empty() { "(event)" } else { &e.pointer }, e.message);
                    }
                    return Ok(ExitCode::from(1));
                }
            };
            let matches: Vec<_> = matched
                .into_iter()
                .map(|m| {
                    let targets: Vec<_> = m
                        .target_ids
                        .iter()
                        .filter_map(|t| set.targets.get(t))
                        .map(|t| serde_json::json!({ "id": t.id, "kind": t.kind, "policy": t.policy_name }))
                        .collect();
                    serde_json::json!({ "rule": m.rule, "targets": targets })
                })
                .collect();
            outln!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "matches": matches }))?
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Contracts {
            cmd: ContractsCmd::Check { dir, against },
        } => match ContractSet::load_dir(&dir) {
            Ok(set) => {
                let base = match &against {
                    // A base that does not load is the base's problem, not this change's: it
                    // is said, and nothing is compared with it.
                    Some(b) if !b.exists() => {
                        anyhow::bail!("--against {}: no such directory", b.display())
                    }
                    Some(b) => match ContractSet::load_dir(b) {
                        Ok(base) => Some(base),
                        Err(errors) => {
                            for e in &errors {
                                router::errln!("base: {e}");
                            }
                            anyhow::bail!(
                                "--against {}: the base contracts do not load ({} problem(s))",
                                b.display(),
                                errors.len()
                            )
                        }
                    },
                    None => None,
                };
                // As the server warns at start and reload, and as `rules check` prints its
                // warnings: said, exit 0.
                for t in set.modes_without_contract() {
                    outln!(
                        "{}: warning: sets a mode for type {t}, which has no contract; it has no effect",
                        dir.join(router::contract::MODES_FILE).display()
                    );
                }
                for d in set.compatibility_report() {
                    outln!("note: {d} (a new version may break; its consumers must accept it)");
                }
                let in_place = base.map(|b| set.changes_from(&b)).unwrap_or_default();
                for d in &in_place {
                    outln!("{d}");
                }
                outln!(
                    "{} contracts (version {})",
                    set.contracts().len(),
                    set.version()
                );
                Ok(if in_place.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    router::errln!("{} incompatible change(s) to deployed versions", in_place.len());
                    ExitCode::from(1)
                })
            }
            Err(errors) => {
                for e in &errors {
                    outln!("{e}");
                }
                router::errln!("{} problem(s)", errors.len());
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Contracts {
            cmd:
                ContractsCmd::Push {
                    ty,
                    version,
                    file,
                    api,
                },
        } => rt.block_on(contract_push(&api, &ty, &version, &file)),
        Cmd::Rules {
            cmd: RulesCmd::Ls { api },
        } => rt.block_on(async move {
            let v = api.client().all_pages("/v1/rules", &[], "rules").await?;
            print_value(&api, &v, router::cli::rules_table);
            Ok(ExitCode::SUCCESS)
        }),
        Cmd::Rules {
            cmd: RulesCmd::Disable { name, api },
        } => rt.block_on(rule_toggle(&api, &name, "disable")),
        Cmd::Rules {
            cmd: RulesCmd::Enable { name, api },
        } => rt.block_on(rule_toggle(&api, &name, "enable")),
        Cmd::Dlq { api, cmd } => rt.block_on(dlq(api, cmd)),
        Cmd::Targets { api, cmd } => rt.block_on(targets(api, cmd)),
        Cmd::Status { api, recent } => rt.block_on(status(api, recent)),
        Cmd::Replay {
            api,
            from,
            to,
            filter,
            rate,
            include_emitted,
            ignore_contracts,
            rules,
            targets,
            wait,
        } => rt.block_on(async move {
            let c = api.client();
            let filter: Option<serde_json::Value> = match filter {
                Some(f) => Some(serde_json::from_str(&f).context("--filter is not JSON")?),
                None => None,
            };
            // Not given: no restriction (an empty list is refused by the API).
            let names = |v: Vec<String>| (!v.is_empty()).then_some(v);
            let job = c
                .call(reqwest::Method::POST, "/v1/replay", Some(serde_json::json!({ "from": from, "to": to, "filter": filter, "rate_per_sec": rate, "include_emitted": include_emitted, "ignore_contracts": ignore_contracts, "rules": names(rules), "targets": names(targets) })))
                .await?;
            router::cli::job_warnings(&job);
            if !wait {
                print_value(&api, &job, router::cli::job_line);
                return Ok(ExitCode::SUCCESS);
            }
            let job = router::cli::follow(&c, &format!("/v1/replay/{}", job["id"].as_str().unwrap_or(""))).await?;
            print_value(&api, &job, router::cli::job_line);
            Ok(router::cli::job_exit(&job))
        }),
        Cmd::Handlers { api, cmd } => rt.block_on(handlers(api, cmd)),
        Cmd::Token {
            cmd: TokenCmd::New { name, scopes, team },
        } => {
            let (token, hash) = router::auth::new_token();
            let cfg = router::auth::TokenConfig {
                name: name.clone(),
                sha256: hash,
                scopes,
                rate_per_sec: None,
                team,
            };
            router::auth::Tokens::new(std::slice::from_ref(&cfg))?;
            router::errln!("token for {name} (shown once; the router stores only its hash):");
            outln!("{token}");
            router::errln!("\nadd to the config file:\n");
            let scopes = cfg.scopes.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
            let team = cfg.team.as_ref().map(|t| format!("\nteam = {t:?}")).unwrap_or_default();
            router::errln!("[[auth.tokens]]\nname = {:?}{team}\nsha256 = {:?}\nscopes = [{scopes}]", cfg.name, cfg.sha256);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Config {
            cmd: ConfigCmd::Explain { dir, config },
        } => {
            let (cfg, config_warnings) =
                Config::load_with_warnings(config.as_deref(), Config::env_vars())?;
            for w in &config_warnings {
                router::errln!("warning: config: {w}");
            }
            // As `router serve` reads the same configuration: the built-in default `./rules`
            // may be absent (no rules), a directory named by the configuration or the DIR
            // argument may not.
            let explicit = dir.is_some();
            let dir = dir.unwrap_or_else(|| cfg.rules_dir.clone());
            let set = if !dir.exists() && !explicit && dir == Config::default().rules_dir {
                router::errln!("note: rules directory {} does not exist: no rules loaded, as `router serve` starts with none", dir.display());
                RuleSet::empty()
            } else if !dir.exists() {
                return Err(router::app::RunError::MissingDir {
                    what: "rules",
                    dir: dir.display().to_string(),
                    flag: if explicit { "the DIR argument" } else { "--rules (rules_dir)" },
                }
                .into());
            } else {
                RuleSet::load_dir_for_config(&dir, &cfg.operator_secrets())
                    .map_err(|e| rules_invalid(&e))?
                    .0
            };
            outln!(
                "{:<32} {:<28} {:<12} {:>8} {:>14} {:>18} {:>14} {:>10}  notes",
                "TARGET", "RULE", "POLICY", "ATTEMPTS", "WORST CASE", "WITH RETRY-AFTER", "IF BLOCKED", "QUEUE CAP"
            );
            for t in set.targets.values() {
                let router::rules::WorstCase {
                    attempts,
                    time,
                    with_retry_after,
                    if_blocked,
                } = t.worst_case();
                let mut notes = Vec::new();
                if attempts > router::policy::WORST_CASE_ATTEMPTS_SMELL {
                    notes.push(format!(
                        "more than {} attempts is a smell",
                        router::policy::WORST_CASE_ATTEMPTS_SMELL
                    ));
                }
                if attempts < t.policy.retry.max_attempts {
                    notes.push(format!(
                        "max_age allows {attempts} of {} attempts",
                        t.policy.retry.max_attempts
                    ));
                }
                if with_retry_after >= t.policy.retry.max_age {
                    notes.push("bounded by max_age (+ the last attempt's timeout)".to_string());
                }
                if t.policy.breaker.is_some() {
                    notes.push("waiting while the breaker is open spends no attempt (up to max_age)".to_string());
                }
                if if_blocked.is_some() {
                    // Nothing is leased while the target is stopped, and max_age is checked
                    // when an entry is leased.
                    notes.push("past max_age while the breaker is open or a Retry-After holds the target off: to the DLQ when that ends (IF BLOCKED)".to_string());
                }
                // What holds an entry back without spending attempts, and so is not in the
                // numbers (which count from an entry's first attempt).
                if let Some(key) = &t.policy.ordering {
                    notes.push(format!("ordered by {key}: an entry first waits behind the earlier entries of its key"));
                    if t.policy.on_dead_letter == router::policy::OnDeadLetter::Hold {
                        notes.push("on_dead_letter: hold: after a dead letter the key's later entries wait for an operator's release, without bound".to_string());
                    }
                }
                let max_age = humantime::format_duration(t.policy.retry.max_age);
                match &t.kind {
                    router::rules::TargetKind::Handler { name } => notes.push(format!(
                        "while handler {name} is not uploaded (or not loaded) the target waits, spending no attempt, up to max_age ({max_age})"
                    )),
                    router::rules::TargetKind::Webhook { secret_env, headers_env, .. }
                        if secret_env.is_some() || !headers_env.is_empty() =>
                    {
                        notes.push("while a secret it names is not set the target cannot start: its entries wait, without bound".to_string())
                    }
                    router::rules::TargetKind::Nats { .. }
                        if cfg.nats.token_env.is_some() || cfg.nats.password_env.is_some() =>
                    {
                        notes.push("while nats.token_env / nats.password_env is not set the target cannot start: its entries wait, without bound".to_string())
                    }
                    _ => {}
                }
                if let Some(b) = t.kind.batch().filter(|b| !b.window.is_zero()) {
                    notes.push(format!(
                        "each attempt may first wait the batch window ({})",
                        humantime::format_duration(b.window)
                    ));
                }
                outln!(
                    "{:<32} {:<28} {:<12} {:>8} {:>14} {:>18} {:>14} {:>10}  {}",
                    t.id,
                    t.rule,
                    t.policy_name.as_deref().unwrap_or("(default)"),
                    attempts,
                    humantime::format_duration(time).to_string(),
                    humantime::format_duration(with_retry_after).to_string(),
                    if_blocked.map_or_else(|| "-".to_string(), |d| humantime::format_duration(d).to_string()),
                    // max_queue_depth: past it new entries go to the DLQ as target_overflow.
                    t.policy.max_queue_depth,
                    notes.join("; ")
                );
            }
            // Per dependency (SPEC): targets sharing a receiver each show their own worst case
            // above; one event matching several of them costs the receiver their sum.
            let shared = set.shared_dependencies();
            if !shared.is_empty() {
                outln!(
                    "\nDependencies with several targets (what one event matching all of them costs it):\n{:<44} {:>8} {:>8} {:>14}  notes",
                    "DEPENDENCY", "TARGETS", "ATTEMPTS", "WORST CASE"
                );
            }
            for d in &shared {
                let mut notes = vec![format!(
                    "{} ({} {})",
                    d.targets.join(", "),
                    if d.rules.len() == 1 { "rule" } else { "rules" },
                    d.rules.iter().cloned().collect::<Vec<_>>().join(", ")
                )];
                if d.rules.len() > 1 {
                    notes.push("if one event matches all these rules".to_string());
                }
                if d.attempts > router::policy::WORST_CASE_ATTEMPTS_SMELL {
                    notes.push(format!(
                        "more than {} attempts is a smell",
                        router::policy::WORST_CASE_ATTEMPTS_SMELL
                    ));
                }
                outln!(
                    "{:<44} {:>8} {:>8} {:>14}  {}",
                    d.dependency,
                    d.targets.len(),
                    d.attempts,
                    humantime::format_duration(d.time).to_string(),
                    notes.join("; ")
                );
            }
            // How the router's NATS clients connect: the keys and the variables they name,
            // and whether each is set now (never a secret's value).
            let secrets_file = cfg
                .secrets_file
                .as_deref()
                .and_then(|p| router::config::read_secrets(p).ok())
                .unwrap_or_default();
            let is_set =
                |name: &str| std::env::var_os(name).is_some() || secrets_file.contains_key(name);
            if cfg.store.backend == router::config::StoreBackend::Jetstream {
                let js = &cfg.store.jetstream;
                let auth = js.auth();
                // The store is not optional: serve refuses to start without its secret.
                let unset = auth.missing_secret(&|n: &str| is_set(n).then(String::new));
                let stops = if unset.is_some() {
                    " (`router serve` does not start until it is set)"
                } else {
                    ""
                };
                outln!(
                    "\nstore: jetstream at {} (stream {}, prefix {}, replicas {}); {}{stops}",
                    js.url,
                    js.stream,
                    js.prefix,
                    js.replicas,
                    auth.describe(&is_set)
                );
            }
            if set
                .targets
                .values()
                .any(|t| matches!(t.kind, router::rules::TargetKind::Nats { .. }))
            {
                outln!(
                    "\nnats targets: {}; {}",
                    cfg.nats.url,
                    cfg.nats.auth().describe(&is_set)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Store {
            cmd: StoreCmd::Check { data_dir },
        } => store_check(&data_dir),
        Cmd::Bench {
            cmd: BenchCmd::Ingest(b),
        } => {
            let allow_failures = b.allow_failures;
            // Ctrl-C stops the run and prints what it did; a second one ends the process.
            let stop = tokio_util::sync::CancellationToken::new();
            let on_signal = stop.clone();
            rt.spawn(async move {
                if tokio::signal::ctrl_c().await.is_ok() {
                    router::errln!("interrupted: stopping (Ctrl-C again to quit at once)");
                    on_signal.cancel();
                }
                if tokio::signal::ctrl_c().await.is_ok() {
                    std::process::exit(130);
                }
            });
            let report = rt
                .block_on(router::bench::run_ingest(b, stop))
                .map_err(anyhow::Error::msg)?;
            outln!("{report}");
            if report.interrupted {
                router::errln!("interrupted: the report covers the requests finished before");
                return Ok(ExitCode::from(130));
            }
            // A failed request is a run that did not measure what it was asked to, unless the
            // refusals (429/503 of a saturating run) are the point and --allow-failures says so.
            if let Some(problem) = report.problem(allow_failures) {
                router::errln!("{problem}");
                return Ok(ExitCode::from(1));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            cmd: BenchCmd::Store(b),
        } => {
            // The store's own log lines (compactions; with `RUST_LOG=router::store=debug` each
            // dedup run it writes, with the time its memtable took to sort) go to stderr.
            router::telemetry::init_tracing(false);
            let report = rt
                .block_on(router::bench::run_store(b))
                .map_err(anyhow::Error::msg)?;
            outln!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            cmd: BenchCmd::Sweep(b),
        } => {
            let report = rt
                .block_on(router::bench::run_sweep(b))
                .map_err(anyhow::Error::msg)?;
            outln!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            cmd: BenchCmd::Sink(b),
        } => {
            rt.block_on(router::bench::run_sink(
                b.listen,
                b.status,
                Arc::new(AtomicU64::new(0)),
            ))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_value(api: &Api, v: &serde_json::Value, render: impl Fn(&serde_json::Value) -> String) {
    if api.json {
        outln!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        outln!("{}", render(v));
    }
}

async fn contract_push(
    api: &Api,
    ty: &str,
    version: &str,
    file: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    // Checked here for a clear local error, but sent as written: the router keeps the file's
    // text, and its errors give lines and columns of it. A byte-order mark is allowed, as the
    // contracts directory and the upload API allow it.
    serde_json::from_str::<serde_json::Value>(router::contract::strip_bom(&text))
        .with_context(|| format!("{} is not JSON", file.display()))?;
    let version = if version.starts_with('v') {
        version.to_string()
    } else {
        format!("v{version}")
    };
    let v = api
        .client()
        .call_bytes(
            reqwest::Method::PUT,
            &format!(
                "/v1/contracts/{}/{}",
                router::cli::seg(ty),
                router::cli::seg(&version)
            ),
            "application/json",
            text.into_bytes(),
        )
        .await?;
    print_value(api, &v, |v| {
        let mut out = format!(
            "{} live as {} {} ({}; contracts version {})",
            file.display(),
            v["type"].as_str().unwrap_or(ty),
            version,
            if v["replaced"] == true {
                "changed compatibly"
            } else {
                "new version"
            },
            v["contracts_version"].as_str().unwrap_or("")
        );
        let breaking = v["breaking_changes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let next_breaking = v["next_breaking_changes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for (heading, list) in [
            (
                v["compared_with"]
                    .as_str()
                    .map(|prev| format!("breaking changes against {prev}:")),
                &breaking,
            ),
            (
                v["next_version"]
                    .as_str()
                    .map(|next| format!("{next}, the version after it, breaks it:")),
                &next_breaking,
            ),
        ] {
            let (Some(heading), false) = (heading, list.is_empty()) else {
                continue;
            };
            out.push_str(&format!("\n{heading}"));
            for b in list {
                out.push_str(&format!(
                    "\n  {}: {}",
                    b["pointer"].as_str().unwrap_or(""),
                    b["message"].as_str().unwrap_or("")
                ));
            }
        }
        out
    });
    Ok(ExitCode::SUCCESS)
}

/// `router store check`: prints the verdict; exit 0 sound, 1 damaged.
fn store_check(dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    use router::store::Verdict;
    let r = router::store::check_dir(dir)?;
    let (events, entries, dlq) = r.records;
    outln!("file: {} ({} bytes)", r.path.display(), r.bytes);
    if r.read {
        match r.format_version {
            Some(v) => outln!("format version: {v}"),
            None => outln!("format version: none (a store never written)"),
        }
        outln!("records read: {events} events, {entries} queue entries, {dlq} DLQ entries");
    }
    if r.group_log {
        outln!(
            "group log: router.log is beside the file; its groups are applied at the next start (not checked here)"
        );
    }
    match &r.verdict {
        Verdict::Sound => {
            outln!("ok: every page verifies and every record decodes");
            Ok(ExitCode::SUCCESS)
        }
        Verdict::RecordsDamaged => {
            outln!(
                "damaged: {} records do not decode (the pages verify):",
                r.unreadable_count
            );
            for u in &r.unreadable {
                outln!("  {u}");
            }
            if r.unreadable_count > r.unreadable.len() as u64 {
                outln!(
                    "  … and {} more",
                    r.unreadable_count - r.unreadable.len() as u64
                );
            }
            outln!(
                "the router runs on this file: each delivery of an unreadable event goes to the DLQ as corrupt_record (docs/operations.md, \"A damaged store file\")"
            );
            Ok(ExitCode::from(1))
        }
        Verdict::Damaged(why) => {
            outln!("damaged: {why}");
            outln!(
                "do not start the router on this file: stop writing to the disk, keep a copy of the data directory, then restore the last backup of it or move router.redb aside and start empty (docs/operations.md, \"A damaged store file\")"
            );
            Ok(ExitCode::from(1))
        }
    }
}

/// The error of a rules directory that does not load: every problem, one a line.
fn rules_invalid(errors: &[impl ToString]) -> anyhow::Error {
    anyhow::anyhow!(
        "rules are invalid:\n{}",
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    )
}

async fn rule_toggle(api: &Api, name: &str, action: &str) -> anyhow::Result<ExitCode> {
    let c = api.client();
    let v = c
        .call(
            reqwest::Method::POST,
            &format!("/v1/rules/{}/{action}", router::cli::seg(name)),
            None,
        )
        .await?;
    print_value(api, &v, |v| {
        format!(
            "rule {} {}",
            v["rule"].as_str().unwrap_or(name),
            if v["enabled"] == true {
                "enabled"
            } else {
                "disabled"
            }
        )
    });
    Ok(ExitCode::SUCCESS)
}

/// Refuses a handler name the router would refuse, with the router's own words, before any
/// request: an empty name made the URL `/v1/handlers/` (a 404 "no such route"), and a
/// percent-encoded one (a space) got the router's "never percent-encoded", about an encoding
/// the CLI itself had done.
fn check_handler_name(name: &str) -> anyhow::Result<()> {
    if router::wasm::valid_handler_name(name) {
        Ok(())
    } else {
        Err(router::wasm::UploadError::InvalidName(name.to_owned()).into())
    }
}

async fn handlers(api: Api, cmd: HandlersCmd) -> anyhow::Result<ExitCode> {
    use reqwest::Method;
    let c = api.client();
    let v = match &cmd {
        HandlersCmd::Push {
            name,
            file,
            team,
            timeout,
        } => {
            check_handler_name(name)?;
            let bytes =
                std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            // Whoever gives up first, the router goes on: the component may still activate.
            api.client()
                .with_timeout(
                    *timeout,
                    "the upload may still complete: check `router handlers list`",
                )
                .call_bytes(
                    Method::PUT,
                    &format!(
                        "/v1/handlers/{}{}",
                        router::cli::seg(name),
                        router::cli::query(&[("team", team)])
                    ),
                    "application/wasm",
                    bytes,
                )
                .await?
        }
        HandlersCmd::List => c.call(Method::GET, "/v1/handlers", None).await?,
        HandlersCmd::Rollback { name, version } => {
            check_handler_name(name)?;
            c.call(
                Method::POST,
                &format!("/v1/handlers/{}/rollback", router::cli::seg(name)),
                Some(serde_json::json!({ "version": version })),
            )
            .await?
        }
        HandlersCmd::Logs {
            name,
            event_id,
            source,
            level,
            limit,
            attempt,
            before,
        } => {
            check_handler_name(name)?;
            let q = router::cli::query(&[
                ("event_id", event_id),
                ("source", source),
                ("level", level),
                ("limit", limit),
                ("attempt", attempt),
                ("before", before),
            ]);
            c.call(
                Method::GET,
                &format!("/v1/handlers/{}/logs{q}", router::cli::seg(name)),
                None,
            )
            .await?
        }
    };
    print_value(&api, &v, |v| match &cmd {
        HandlersCmd::List => router::cli::handlers_table(v),
        HandlersCmd::Logs { .. } => v["lines"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| {
                // The version that wrote the line (its content hash, as `handlers list`
                // shows it): after a bad upload and a rollback, which lines are whose is the
                // question.
                format!(
                    "{} {:5} [{}] {} {} #{} {}",
                    l["at"].as_str().unwrap_or(""),
                    l["level"].as_str().unwrap_or(""),
                    l["version"]
                        .as_str()
                        .map_or("-", |v| v.get(..12).unwrap_or(v)),
                    l["source"].as_str().unwrap_or("-"),
                    l["event_id"].as_str().unwrap_or(""),
                    l["attempt"],
                    l["message"].as_str().unwrap_or("")
                )
            })
            .chain(
                v["next_before"]
                    .as_u64()
                    .map(|n| format!("(older lines: --before {n})")),
            )
            .collect::<Vec<_>>()
            .join("\n"),
        _ => format!(
            "{} v{} sha256 {} (active)",
            v["descriptor"]["name"].as_str().unwrap_or(""),
            v["version"],
            v["sha256"].as_str().unwrap_or("")
        ),
    });
    Ok(ExitCode::SUCCESS)
}

/// `router status`: `/v1/status`, then the targets and the DLQ (all of it, and the last
/// `recent` of it by the router's clock) together. A part the token may not read is said in
/// the report; only `/v1/status` must answer.
async fn status(api: Api, recent: std::time::Duration) -> anyhow::Result<ExitCode> {
    use reqwest::Method;
    let c = api.client();
    let st = c.call(Method::GET, "/v1/status", None).await?;
    // The router's clock, not this machine's: started_at plus uptime, to the second.
    let now = st["started_at"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t + chrono::Duration::seconds(st["uptime_seconds"].as_i64().unwrap_or(0)))
        .map_or_else(chrono::Utc::now, |t| t.with_timezone(&chrono::Utc));
    let since = now - chrono::Duration::from_std(recent).unwrap_or(chrono::Duration::MAX);
    let since = since.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let recent_path = format!(
        "/v1/dlq/summary{}",
        router::cli::query(&[("since", &Some(since.clone()))])
    );
    let (targets, rules, dlq, dlq_recent) = tokio::join!(
        c.all_pages("/v1/targets", &[], "targets"),
        c.all_pages("/v1/rules", &[], "rules"),
        c.call(Method::GET, "/v1/dlq/summary", None),
        c.call(Method::GET, &recent_path, None),
    );
    let shown = |r: &Result<serde_json::Value, router::cli::CliError>| match r {
        Ok(v) => Ok(v.clone()),
        Err(e) => Err(e.to_string()),
    };
    let (targets, rules, dlq, dlq_recent) = (
        shown(&targets),
        shown(&rules),
        shown(&dlq),
        shown(&dlq_recent),
    );
    let report = router::cli::status_report(&router::cli::StatusInputs {
        status: &st,
        targets: targets.as_ref().map_err(Clone::clone),
        rules: rules.as_ref().map_err(Clone::clone),
        dlq: dlq.as_ref().map_err(Clone::clone),
        dlq_recent: dlq_recent.as_ref().map_err(Clone::clone),
        recent,
        since: &since,
    });
    if api.json {
        let part = |r: &Result<serde_json::Value, String>| match r {
            Ok(v) => v.clone(),
            Err(e) => serde_json::json!({ "error": e }),
        };
        let v = serde_json::json!({
            "status": st,
            "targets": part(&targets),
            "rules": part(&rules),
            "dlq": part(&dlq),
            "dlq_recent": part(&dlq_recent),
            "attention": report.attention,
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        outln!("{}", report.text);
    }
    Ok(if report.attention.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn targets(api: Api, cmd: TargetsCmd) -> anyhow::Result<ExitCode> {
    let c = api.client();
    let v = match &cmd {
        TargetsCmd::Ls { problems } => {
            // Every page; the router picks the targets that need an operator. Picked here
            // again by the same test: a router from before the filter ignores `problems`.
            let filter = problems.then(|| "true".to_string());
            let mut v = c
                .all_pages("/v1/targets", &[("problems", &filter)], "targets")
                .await?;
            if *problems && let Some(list) = v["targets"].as_array_mut() {
                list.retain(router::admin::targets::target_has_problems);
            }
            v
        }
        TargetsCmd::Pause { id } => {
            c.call(
                reqwest::Method::POST,
                &format!("/v1/targets/{}/pause", router::cli::seg(id)),
                None,
            )
            .await?
        }
        TargetsCmd::Resume { id } => {
            c.call(
                reqwest::Method::POST,
                &format!("/v1/targets/{}/resume", router::cli::seg(id)),
                None,
            )
            .await?
        }
        TargetsCmd::ReleaseKey { id, key } => {
            c.call(
                reqwest::Method::POST,
                &format!(
                    "/v1/targets/{}/keys/{}/release",
                    router::cli::seg(id),
                    router::cli::seg(key)
                ),
                None,
            )
            .await?
        }
    };
    match cmd {
        TargetsCmd::Ls { .. } => print_value(&api, &v, router::cli::targets_table),
        TargetsCmd::ReleaseKey { .. } => print_value(&api, &v, |r| {
            format!(
                "released key {} of {} ({} waiting entries past max_age moved to the DLQ)",
                r["key"], r["target"], r["dead_lettered_past_max_age"]
            )
        }),
        _ => print_value(&api, &v, |t| {
            router::cli::targets_table(&serde_json::json!({ "targets": [t] }))
        }),
    }
    Ok(ExitCode::SUCCESS)
}

async fn dlq(api: Api, cmd: DlqCmd) -> anyhow::Result<ExitCode> {
    use reqwest::Method;
    let c = api.client();
    match cmd {
        DlqCmd::Ls {
            filter,
            emitted_by,
            limit,
            after,
        } => {
            let v = c
                .call(
                    Method::GET,
                    &format!(
                        "/v1/dlq{}",
                        filter.query(&[
                            ("emitted_by", &emitted_by),
                            ("limit", &limit),
                            ("after", &after)
                        ])
                    ),
                    None,
                )
                .await?;
            print_value(&api, &v, router::cli::dlq_table);
        }
        DlqCmd::Summary { filter, bucket } => {
            let v = c
                .call(
                    Method::GET,
                    &format!("/v1/dlq/summary{}", filter.query(&[("bucket", &bucket)])),
                    None,
                )
                .await?;
            print_value(&api, &v, router::cli::summary_table);
        }
        DlqCmd::Show { id } => {
            let v = c.call(Method::GET, &format!("/v1/dlq/{id}"), None).await?;
            // An entry is best read whole.
            outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        }
        DlqCmd::Redrive {
            filter,
            rate,
            wait,
            all,
        } => {
            filter.check_all("redrive", all)?;
            let job = c
                .call(
                    Method::POST,
                    "/v1/dlq/redrive",
                    Some(
                        serde_json::json!({ "filter": filter.json(), "rate_per_sec": rate, "all": all }),
                    ),
                )
                .await?;
            if !wait {
                print_value(&api, &job, router::cli::job_line);
                return Ok(ExitCode::SUCCESS);
            }
            let job = router::cli::follow(
                &c,
                &format!("/v1/dlq/redrive/{}", job["id"].as_str().unwrap_or("")),
            )
            .await?;
            print_value(&api, &job, router::cli::job_line);
            return Ok(router::cli::job_exit(&job));
        }
        DlqCmd::Purge {
            filter,
            dry_run,
            all,
        } => {
            // A dry run only counts: the whole DLQ is a fair question.
            filter.check_all("purge", all || dry_run)?;
            let v = c
                .call(
                    Method::POST,
                    "/v1/dlq/purge",
                    Some(
                        serde_json::json!({ "filter": filter.json(), "dry_run": dry_run, "all": all }),
                    ),
                )
                .await?;
            print_value(&api, &v, |v| {
                if v["dry_run"] == true {
                    let mut out =
                        format!("{} entries match (dry run: nothing purged)", v["matched"]);
                    for k in v["would_release_keys"].as_array().into_iter().flatten() {
                        out.push_str(&format!(
                            "
ordering key {} of {} would be released (its holding dead letter matches): the entries queued behind it go out at once",
                            k["key"], k["target"]
                        ));
                    }
                    out
                } else {
                    let mut out = format!("{} entries purged", v["purged"]);
                    for k in v["released_keys"].as_array().into_iter().flatten() {
                        out.push_str(&format!(
                            "\nordering key {} of {} released (its holding dead letter was purged)",
                            k["key"], k["target"]
                        ));
                    }
                    out
                }
            });
        }
        DlqCmd::Jobs {
            id,
            action,
            state,
            limit,
        } => {
            let v = match (id, action) {
                (None, _) => {
                    let q = router::cli::query(&[("state", &state), ("limit", &limit)]);
                    c.call(Method::GET, &format!("/v1/dlq/redrive{q}"), None)
                        .await?
                }
                (Some(id), None) => {
                    let base = router::cli::job_route(&id);
                    c.call(Method::GET, &format!("{base}/{id}"), None).await?
                }
                (Some(id), Some(a)) => {
                    let base = router::cli::job_route(&id);
                    c.call(Method::POST, &format!("{base}/{id}/{a}"), None)
                        .await?
                }
            };
            print_value(&api, &v, |v| match v["jobs"].as_array() {
                Some(jobs) => jobs
                    .iter()
                    .map(router::cli::job_row)
                    .collect::<Vec<_>>()
                    .join("\n"),
                None => router::cli::job_row(v),
            });
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
