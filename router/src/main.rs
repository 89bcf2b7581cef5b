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
    /// Rule files: check and test.
    Rules {
        #[command(subcommand)]
        cmd: RulesCmd,
    },
    /// Contracts: check.
    Contracts {
        #[command(subcommand)]
        cmd: ContractsCmd,
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
}

#[derive(Subcommand)]
enum RulesCmd {
    /// Validate every rule file in DIR; prints file:line:col: message per problem, exit 1 on any error.
    Check { dir: PathBuf },
    /// Print, as JSON, the rules and targets in DIR that EVENT (a structured CloudEvent JSON file) matches.
    Test { dir: PathBuf, event: PathBuf },
}

#[derive(Subcommand)]
enum ContractsCmd {
    /// Validate every contract in DIR and check each version against the previous one.
    Check { dir: PathBuf },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Per target: the worst-case number of attempts an event can receive and the longest time
    /// before it reaches the DLQ, from its policy.
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
    /// Send events to POST /v1/events and report events/s and latency percentiles.
    Ingest {
        #[arg(long, default_value = "http://127.0.0.1:8080/v1/events")]
        url: String,
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Approximate bytes per event.
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// Fixed rate in events/s (open loop); default: as fast as possible.
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long = "type", default_value = "bench.event")]
        event_type: String,
    },
    /// A receiver that parses and discards (baseline endpoint and fast webhook).
    Sink {
        #[arg(long, default_value = "127.0.0.1:9999")]
        listen: SocketAddr,
        #[arg(long, default_value_t = 202)]
        status: u16,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
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
            let mut cfg = Config::load(config.as_deref(), std::env::vars())?;
            if let Some(l) = listen {
                cfg.listen = l;
            }
            if let Some(d) = data_dir {
                cfg.data_dir = d;
            }
            if let Some(r) = rules {
                cfg.rules_dir = r;
            }
            if let Some(c) = contracts {
                cfg.contracts_dir = c;
            }
            router::telemetry::init_tracing(cfg.log_format == router::config::LogFormat::Json);
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(cfg.listen)
                    .await
                    .with_context(|| format!("cannot listen on {}", cfg.listen))?;
                let shutdown = CancellationToken::new();
                let s = shutdown.clone();
                tokio::spawn(async move {
                    wait_for_signal().await;
                    tracing::info!("signal received: stopping ingest");
                    s.cancel();
                });
                router::app::run(cfg, listener, shutdown).await?;
                Ok::<_, anyhow::Error>(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Rules {
            cmd: RulesCmd::Check { dir },
        } => match RuleSet::load_dir(&dir) {
            Ok((set, warnings)) => {
                for w in &warnings {
                    println!("{w}");
                }
                println!(
                    "ok: {} rules, {} targets, {} policies in {} files (version {})",
                    set.rules.len(),
                    set.targets.len(),
                    set.policies.len(),
                    set.files.len(),
                    set.version
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(errors) => {
                for e in &errors {
                    println!("{e}");
                }
                eprintln!("{} problem(s)", errors.len());
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Rules {
            cmd: RulesCmd::Test { dir, event },
        } => {
            let (set, _) = RuleSet::load_dir(&dir).map_err(|errors| {
                anyhow::anyhow!(
                    "rules are invalid:\n{}",
                    errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            })?;
            let text = std::fs::read_to_string(&event)
                .with_context(|| format!("reading {}", event.display()))?;
            let ev: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", event.display()))?;
            let matches: Vec<_> = set
                .matches(&ev)
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
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "matches": matches }))?
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Contracts {
            cmd: ContractsCmd::Check { dir },
        } => match ContractSet::load_dir(&dir) {
            Ok(set) => {
                let report = set.compatibility_report();
                for d in &report {
                    println!("{d}");
                }
                println!(
                    "{} contracts (version {})",
                    set.contracts().len(),
                    set.version()
                );
                Ok(if report.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                })
            }
            Err(errors) => {
                for e in &errors {
                    println!("{e}");
                }
                eprintln!("{} problem(s)", errors.len());
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Config {
            cmd: ConfigCmd::Explain { dir, config },
        } => {
            let cfg = Config::load(config.as_deref(), std::env::vars())?;
            let dir = dir.unwrap_or(cfg.rules_dir);
            let (set, _) = RuleSet::load_dir(&dir).map_err(|errors| {
                anyhow::anyhow!(
                    "rules are invalid:\n{}",
                    errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            })?;
            println!(
                "{:<32} {:<28} {:<12} {:>8} {:>14}  notes",
                "TARGET", "RULE", "POLICY", "ATTEMPTS", "WORST CASE"
            );
            for t in set.targets.values() {
                let (attempts, time) = t.policy.worst_case();
                let mut notes = Vec::new();
                if attempts > router::policy::WORST_CASE_ATTEMPTS_SMELL {
                    notes.push(format!(
                        "more than {} attempts is a smell",
                        router::policy::WORST_CASE_ATTEMPTS_SMELL
                    ));
                }
                if time >= t.policy.retry.max_age {
                    notes.push("bounded by max_age".to_string());
                }
                println!(
                    "{:<32} {:<28} {:<12} {:>8} {:>14}  {}",
                    t.id,
                    t.rule,
                    t.policy_name.as_deref().unwrap_or("(default)"),
                    attempts,
                    humantime::format_duration(time).to_string(),
                    notes.join("; ")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            cmd:
                BenchCmd::Ingest {
                    url,
                    events,
                    concurrency,
                    batch,
                    size,
                    rate,
                    event_type,
                },
        } => {
            let report = rt
                .block_on(router::bench::run_ingest(router::bench::IngestBench {
                    url,
                    events,
                    concurrency,
                    batch,
                    size,
                    rate,
                    event_type,
                }))
                .map_err(anyhow::Error::msg)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            cmd: BenchCmd::Sink { listen, status },
        } => {
            rt.block_on(router::bench::run_sink(
                listen,
                status,
                Arc::new(AtomicU64::new(0)),
            ))?;
            Ok(ExitCode::SUCCESS)
        }
    }
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
