//! The JetStream store against servers that require authentication or TLS, as production NATS
//! does (`[store.jetstream]` user and password, token, TLS files). Each test starts its own
//! nats-server with a config file, so it runs in both passes of the suite (on the embedded
//! store's pass too: its routers are put on this server by their own configuration).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

/// A nats-server of one test's own, with JetStream (`sync_interval: always`) and `extra`
/// configuration (an `authorization` or `tls` block).
struct AuthServer {
    port: u16,
    dir: tempfile::TempDir,
    child: std::process::Child,
}

/// The nats-server binary: the JetStream pass's (`E2E_NATS_SERVER`), `JETSTREAM_TEST_SERVER`,
/// or the one `scripts/nats-server.sh` installs under the target dir.
fn nats_server_binary() -> PathBuf {
    for var in ["E2E_NATS_SERVER", "JETSTREAM_TEST_SERVER"] {
        if let Some(p) = std::env::var_os(var) {
            return p.into();
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nats-server");
    std::fs::read_dir(&root)
        .ok()
        .and_then(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path().join("nats-server"))
                .filter(|p| p.is_file())
                .max()
        })
        .unwrap_or_else(|| {
            panic!(
                "no nats-server under {}: run `bash scripts/nats-server.sh`, or set \
                 JETSTREAM_TEST_SERVER to a nats-server 2.12+ binary",
                root.display()
            )
        })
}

impl AuthServer {
    fn start(extra: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = tempfile::tempdir().expect("tempdir");
        let child = Self::spawn(port, dir.path(), extra);
        Self { port, dir, child }
    }

    /// Stops the server and starts it again on the same port and store with `extra` in
    /// place of its configuration's (clients are cut off and must connect again).
    fn restart(&mut self, extra: &str) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(self.port, self.dir.path(), extra);
    }

    /// A nats-server on `port` with its config, store and log in `dir`, once it listens.
    fn spawn(port: u16, dir: &Path, extra: &str) -> std::process::Child {
        let conf = dir.join("server.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\nmax_payload: 8MB\njetstream {{ store_dir: {:?}, sync_interval: always }}\n{extra}\n",
                dir.join("js").display().to_string()
            ),
        )
        .expect("server config");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .expect("log");
        let child = std::process::Command::new(nats_server_binary())
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        // A cold start takes tens of milliseconds; 20 s is for a machine under heavy load.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen within 20 s: {}",
                std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for AuthServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- nats-server log ----\n{}",
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
            );
        }
    }
}

/// A router on `server`'s JetStream store with `keys` in its `[store.jetstream]`, sending
/// events of type `t` to `rcv`, and `env` besides.
fn router_on(server: &AuthServer, keys: &str, rcv: &Receiver, env: &[(&str, &str)]) -> RouterProc {
    let url = server.url();
    let config =
        format!("[store]\nbackend = \"jetstream\"\n[store.jetstream]\nurl = \"{url}\"\n{keys}");
    // The JetStream pass points every router at its shared server through this variable,
    // which a config file does not override: set to this test's server the same way.
    let mut env = env.to_vec();
    env.push(("ROUTER_STORE__JETSTREAM__URL", url.as_str()));
    RouterProc::start_full(
        &[("r.yaml", &webhook_rule("r", "t", &rcv.url(), "hook"))],
        &[],
        &env,
        Some(&config),
    )
}

/// The router accepts an event (202: it is in the store) and delivers it.
async fn accepts_and_delivers(r: &RouterProc, rcv: &Receiver, id: &str) {
    let (status, body) = post_event(r, &event(id, "t", json!({"n": 1}))).await;
    assert_eq!(status, 202, "{body}");
    assert!(
        rcv.wait_for(Duration::from_secs(30), |seen| seen
            .iter()
            .any(|s| s.event_id() == id))
            .await,
        "event {id} was not delivered; log:\n{}",
        r.log_text()
    );
}

/// `router serve` on `r`'s directories and config (stopped first), expecting it to refuse to
/// start: its stderr.
fn refused(r: &mut RouterProc) -> String {
    let rules = r.dir.path().join("rules");
    let contracts = r.dir.path().join("contracts");
    let (code, err) = r.serve_refused(&rules, &contracts);
    assert_ne!(code, Some(0), "{err}");
    err
}

/// A server that requires a user and password: with `user` and the password from the
/// variable `password_env` names, the router starts, accepts and delivers. A wrong password
/// stops the start with an error naming store.jetstream and the keys to check (not the
/// password); a variable not set stops it naming the key and the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_requires_a_user_and_password() {
    let server = AuthServer::start(
        "authorization {\n  users = [ { user: router, password: S3cretPassw0rd } ]\n}",
    );
    let rcv = Receiver::ok().await;
    let mut r = router_on(
        &server,
        "user = \"router\"\npassword_env = \"E2E_STORE_PASSWORD\"\n",
        &rcv,
        &[("E2E_STORE_PASSWORD", "S3cretPassw0rd")],
    );
    accepts_and_delivers(&r, &rcv, "user-1").await;
    assert!(r.sigterm().success());

    r.set_env("E2E_STORE_PASSWORD", Some("Wr0ngPassw0rd"));
    let err = refused(&mut r);
    assert!(
        err.contains(&format!("store.jetstream: connect to {}", server.url()))
            && err.contains("authorization violation")
            && err.contains(
                "the server refused store.jetstream.user with the password store.jetstream.password_env names"
            ),
        "{err}"
    );
    assert!(!err.contains("Wr0ngPassw0rd"), "{err}");

    r.set_env("E2E_STORE_PASSWORD", None);
    let err = refused(&mut r);
    assert!(
        err.contains(
            "store.jetstream.password_env E2E_STORE_PASSWORD: not set in the environment or the secrets file"
        ),
        "{err}"
    );
}

/// A server that requires a token: the router starts with the token `token_env` names, and a
/// wrong one stops the start, naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_requires_a_token() {
    let server = AuthServer::start("authorization {\n  token: \"t0kenS3cret\"\n}");
    let rcv = Receiver::ok().await;
    let mut r = router_on(
        &server,
        "token_env = \"E2E_STORE_TOKEN\"\n",
        &rcv,
        &[("E2E_STORE_TOKEN", "t0kenS3cret")],
    );
    accepts_and_delivers(&r, &rcv, "token-1").await;
    assert!(r.sigterm().success());

    r.set_env("E2E_STORE_TOKEN", Some("n0tTheT0ken"));
    let err = refused(&mut r);
    assert!(
        err.contains("store.jetstream: connect to")
            && err.contains("the server refused the token store.jetstream.token_env names"),
        "{err}"
    );
    assert!(!err.contains("n0tTheT0ken"), "{err}");
}

/// A server that requires TLS and verifies clients (mTLS) against a private CA: the
/// `tls_*` files get the router in, and it accepts and delivers. Without a client
/// certificate the server refuses the router, and the start fails naming store.jetstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_requires_tls_and_a_client_certificate() {
    let certs = tempfile::tempdir().expect("tempdir");
    let ca_key = rcgen::KeyPair::generate().expect("ca key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("ca");
    let write = |name: &str, text: String| {
        let path = certs.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.display().to_string()
    };
    let issue = |name: &str, sans: &[&str]| {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params")
                .signed_by(&key, &ca)
                .expect("sign");
        (
            write(&format!("{name}.pem"), cert.pem()),
            write(&format!("{name}-key.pem"), key.serialize_pem()),
        )
    };
    let (server_cert, server_key) = issue("server", &["127.0.0.1", "localhost"]);
    let (client_cert, client_key) = issue("client", &["router"]);
    let ca_file = write("ca.pem", ca.pem());
    let server = AuthServer::start(&format!(
        "tls {{\n  cert_file: {server_cert:?}\n  key_file: {server_key:?}\n  ca_file: {ca_file:?}\n  verify: true\n  timeout: 2\n}}"
    ));
    let rcv = Receiver::ok().await;
    let mut r = router_on(
        &server,
        &format!(
            "tls_ca_file = {ca_file:?}\ntls_cert_file = {client_cert:?}\ntls_key_file = {client_key:?}\n"
        ),
        &rcv,
        &[],
    );
    accepts_and_delivers(&r, &rcv, "tls-1").await;
    assert!(r.sigterm().success());

    // The same router without its client certificate.
    std::fs::write(
        r.dir.path().join("router.toml"),
        format!(
            "[store]\nbackend = \"jetstream\"\n[store.jetstream]\nurl = \"{}\"\ntls_ca_file = {ca_file:?}\n",
            server.url()
        ),
    )
    .expect("config");
    let err = refused(&mut r);
    assert!(
        err.contains(&format!("store.jetstream: connect to {}", server.url())),
        "{err}"
    );
}

/// The server's users while the router's password is `password`: `router` (the router's
/// store and its `nats:` targets) and `watcher` (the test's own client, never rotated).
fn users(password: &str) -> String {
    format!(
        "authorization {{\n  users = [\n    {{ user: router, password: {password:?} }}\n    {{ user: watcher, password: \"W4tcherPassw0rd\" }}\n  ]\n}}"
    )
}

/// Writes the secrets file as an operator's tooling would: whole, in one rename.
fn write_secrets(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write secrets");
    std::fs::rename(&tmp, path).expect("rename secrets");
}

/// Whether `id`'s one target shows it delivered within 30 s (a retry waiting for a
/// reconnect included).
async fn delivered(r: &RouterProc, id: &str) -> bool {
    eventually(Duration::from_secs(30), || async {
        (fate(r, id).await["targets"][0]["state"] == "delivered").then_some(())
    })
    .await
    .is_some()
}

/// A password rotated on the server and in the secrets file is picked up without a restart:
/// the store's and the `nats:` targets' connections, cut off by the server's restart with the
/// new password, fail to log in until the secrets file has it, and then log in with it at
/// their next reconnect. Events posted before and after both reach the stream of their
/// subject, through the same router process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_rotated_in_the_secrets_file_is_used_at_the_next_reconnect() {
    let mut server = AuthServer::start(&users("0ldPassw0rd"));
    let watcher = async_nats::ConnectOptions::with_user_and_password(
        "watcher".into(),
        "W4tcherPassw0rd".into(),
    )
    .connect(server.url())
    .await
    .expect("the test's client");
    let mut stream = async_nats::jetstream::new(watcher)
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ROTATED".into(),
            subjects: vec!["rotated.>".into()],
            ..Default::default()
        })
        .await
        .expect("stream");

    let secrets_dir = tempfile::tempdir().expect("tempdir");
    let secrets = secrets_dir.path().join("secrets.toml");
    write_secrets(&secrets, "E2E_ROTATED_PASSWORD = \"0ldPassw0rd\"\n");
    let url = server.url();
    let login = "user = \"router\"\npassword_env = \"E2E_ROTATED_PASSWORD\"\n";
    let config = format!(
        "secrets_file = {:?}\n[store]\nbackend = \"jetstream\"\n[store.jetstream]\nurl = \"{url}\"\n{login}[nats]\nurl = \"{url}\"\n{login}",
        secrets.display().to_string()
    );
    // Retries close together, so the event waiting for the reconnect goes as soon as it can.
    let rules = rules_yaml(
        "  fast:\n    timeout: 2s\n    retry: { max_attempts: 200, base_delay: 100ms, max_delay: 500ms, jitter: none }",
        &[(
            "to-nats",
            "t",
            &["nats: rotated.events\n        policy: fast".to_string()],
        )],
    );
    // The JetStream pass points every router at its shared server through this variable,
    // which a config file does not override: set to this test's server the same way.
    let r = RouterProc::start_full(
        &[("r.yaml", &rules)],
        &[],
        &[("ROUTER_STORE__JETSTREAM__URL", url.as_str())],
        Some(&config),
    );
    let (status, body) = post_event(&r, &event("rot-1", "t", json!({"n": 1}))).await;
    assert_eq!(status, 202, "{body}");
    assert!(
        delivered(&r, "rot-1").await,
        "{}\n{}",
        fate(&r, "rot-1").await,
        r.log_text()
    );

    // The server now takes only the new password; the router's clients are cut off and
    // their reconnects refused, until the secrets file has it too (some seconds later, as an
    // operator's two steps would be).
    server.restart(&users("N3wPassw0rd"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    write_secrets(&secrets, "E2E_ROTATED_PASSWORD = \"N3wPassw0rd\"\n");

    // The store is back once its client has logged in again: the client's reconnect delay is
    // at most 4 s; 60 s is for a loaded machine.
    let accepted = eventually(Duration::from_secs(60), || async {
        let (status, body) = post_event(&r, &event("rot-2", "t", json!({"n": 2}))).await;
        (status == 202).then_some(body)
    })
    .await;
    assert!(
        accepted.is_some(),
        "the store did not accept an event after the rotation; log:\n{}",
        r.log_text()
    );
    assert!(
        delivered(&r, "rot-2").await,
        "the nats: target did not deliver after the rotation: {}\n{}",
        fate(&r, "rot-2").await,
        r.log_text()
    );
    let ids: Vec<String> = {
        let info = stream.info().await.expect("stream info");
        let mut ids = Vec::new();
        for seq in 1..=info.state.last_sequence {
            let msg = stream.get_raw_message(seq).await.expect("message");
            let ev: serde_json::Value = serde_json::from_slice(&msg.payload).expect("JSON");
            ids.push(ev["id"].as_str().unwrap_or_default().to_string());
        }
        ids
    };
    assert_eq!(ids, ["rot-1", "rot-2"], "{ids:?}");
    let log = r.log_text();
    assert!(
        log.contains("NATS login changed since the last connect"),
        "{log}"
    );
    assert!(
        !log.contains("N3wPassw0rd") && !log.contains("0ldPassw0rd"),
        "{log}"
    );
}
