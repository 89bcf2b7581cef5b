//! A private nats-server for the JetStream store's tests: its own port, its own store
//! directory, `sync_interval: always`, and kill -9 plus restart on the same directory; or a
//! cluster of them, for replicated streams.
//!
//! The binary is the one `scripts/nats-server.sh` installs into the target dir (the suite's
//! `scripts/test.sh` runs it first); `JETSTREAM_TEST_SERVER` names another. The machine's own
//! server (Debian's 2.9.10) is too old for the backend and is never used by these tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::records::RecordsConfig;

/// A running (or killed) private server.
pub struct TestServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// In a cluster: this server's name, its route port and every member's route port.
    cluster: Option<(String, u16, Vec<u16>)>,
    limits: Limits,
    /// Whether the server runs JetStream (all but `start_core_only`).
    jetstream: bool,
    /// More server configuration (`start_configured`): users and permissions, TLS.
    extra: String,
}

/// Server settings a test sets other than the default (`TestServer::start_with`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `max_payload`, the largest message the server takes (`8MB` by default here).
    pub max_payload: &'static str,
    /// Settings of JetStream's atomic batches (`jetstream { limits { batch { … } } }`), e.g.
    /// `max_inflight_per_stream: 1, timeout: "1s"` (empty: the server's defaults, 50 open
    /// batches per stream and a 10 s timeout).
    pub batch: &'static str,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload: "8MB",
            batch: "",
        }
    }
}

/// The server binary, or a panic that says how to get it.
fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("JETSTREAM_TEST_SERVER") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR").map_or_else(
        |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    let root = target.join("nats-server");
    let found = std::fs::read_dir(&root).ok().and_then(|d| {
        d.filter_map(Result::ok)
            .map(|e| e.path().join("nats-server"))
            .filter(|p| p.is_file())
            .max()
    });
    found.unwrap_or_else(|| {
        panic!(
            "no nats-server under {}: run `bash scripts/nats-server.sh` (scripts/test.sh does), \
             or set JETSTREAM_TEST_SERVER to a nats-server 2.12+ binary",
            root.display()
        )
    })
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

impl TestServer {
    /// Starts a server and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_with(Limits::default())
    }

    /// `start`, with other `limits`.
    pub fn start_with(limits: Limits) -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            bin: binary(),
            cluster: None,
            limits,
            jetstream: true,
            extra: String::new(),
        };
        s.spawn();
        s
    }

    /// A server without JetStream (core NATS only), for the `nats:` target's tests.
    pub fn start_core_only() -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            bin: binary(),
            cluster: None,
            limits: Limits::default(),
            jetstream: false,
            extra: String::new(),
        };
        s.spawn();
        s
    }

    /// A single server (with JetStream or without) whose configuration ends with `extra`, e.g.
    /// an `authorization { … }` block with users and permissions, or a `tls { … }` block; for
    /// the `nats:` target's tests.
    pub fn start_configured(jetstream: bool, extra: &str) -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            bin: binary(),
            cluster: None,
            limits: Limits::default(),
            jetstream,
            extra: extra.to_string(),
        };
        s.spawn();
        s
    }

    /// Starts `n` servers forming one cluster (for replicated streams; their JetStream syncs
    /// on its own schedule, as a replicated deployment does). A stream can be created once the
    /// cluster has elected its JetStream meta leader, a few seconds after this returns.
    pub fn cluster(n: usize) -> Vec<Self> {
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let mut servers: Vec<Self> = (0..n)
            .map(|i| Self {
                child: None,
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir"),
                bin: binary(),
                cluster: Some((format!("n{i}"), routes[i], routes.clone())),
                limits: Limits::default(),
                jetstream: true,
                extra: String::new(),
            })
            .collect();
        for s in &mut servers {
            s.spawn();
        }
        servers
    }

    /// This server's name in its cluster (`None` for a single server).
    pub fn name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|(name, _, _)| name.as_str())
    }

    /// Kills the server with SIGKILL and leaves it down.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill nats-server");
            c.wait().expect("reap nats-server");
        }
    }

    fn spawn(&mut self) {
        let conf = self.dir.path().join("server.conf");
        let store = self.dir.path().join("js");
        let Limits { max_payload, batch } = self.limits;
        let config = match &self.cluster {
            None if !self.jetstream => format!(
                "listen: 127.0.0.1:{}\nmax_payload: {max_payload}\n",
                self.port
            ),
            None => format!(
                "listen: 127.0.0.1:{}\nmax_payload: {max_payload}\njetstream {{\n  store_dir: {:?}\n  sync_interval: always\n  limits {{ batch {{ {batch} }} }}\n}}\n",
                self.port,
                store.display().to_string()
            ),
            Some((name, own, all)) => {
                let routes = all
                    .iter()
                    .map(|p| format!("nats-route://127.0.0.1:{p}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(
                    "server_name: {name}\nlisten: 127.0.0.1:{}\nmax_payload: {max_payload}\njetstream {{\n  store_dir: {:?}\n}}\ncluster {{\n  name: test\n  listen: 127.0.0.1:{own}\n  routes: [ {routes} ]\n}}\n",
                    self.port,
                    store.display().to_string()
                )
            }
        };
        let config = format!("{config}{}\n", self.extra);
        std::fs::write(&conf, config).expect("write server config");
        let log = std::fs::File::create(self.dir.path().join("server.log")).expect("log file");
        let child = Command::new(&self.bin)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        self.child = Some(child);
        // Ready when it accepts TCP connections; a cold start with JetStream takes tens of
        // milliseconds here, so 20 s is only there for a machine under heavy load.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen within 20 s; its log: {}",
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The server's URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A records configuration for stream `stream` on this server.
    pub fn records(&self, stream: &str) -> RecordsConfig {
        Self::records_on(&self.url(), stream)
    }

    /// A records configuration for stream `stream` on the server at `url`.
    pub fn records_on(url: &str, stream: &str) -> RecordsConfig {
        RecordsConfig {
            url: url.to_string(),
            stream: stream.to_string(),
            prefix: format!("rt{}", stream.to_lowercase()),
            replicas: 1,
            timeout: Duration::from_secs(10),
            max_record_bytes: (1 << 20) + (64 << 10),
            auth: Default::default(),
        }
    }

    /// Freezes the server (SIGSTOP): its connections stay open and nothing is answered, as a
    /// server that hangs or a network that drops packets without closing anything.
    pub fn stop_answering(&self) {
        self.signal("-STOP");
    }

    /// Undoes `stop_answering` (SIGCONT).
    pub fn answer_again(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let ok = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill {signal} {pid}");
    }

    /// Starts a server stopped by `kill` again, on the same store directory and port.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is still running");
        self.spawn();
    }

    /// Kills the server with SIGKILL (no shutdown of its own) and starts it again on the same
    /// store directory and port.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
