//! How the router's two NATS clients authenticate and secure their connection: the `nats:`
//! targets' connection (`[nats]`) and the JetStream store (`[store.jetstream]`). Both sections
//! have the same keys with the same meaning; this module is where they are validated (at
//! start, by the config) and turned into the client's options, once for both.
//!
//! Secrets (a token, a password) are never in the configuration: its keys name a variable,
//! looked up in the environment, then in the secrets file. The login is read when the client
//! is built (a secret missing then refuses it) and again at every connect and reconnect, so a
//! password, token or `.creds` file rotated on disk is used from the next reconnect on,
//! without a restart; a login that cannot be read again then keeps the last one that could.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use crate::deliver::SecretResolver;

/// The authentication and TLS keys of one NATS section (`[nats]` or `[store.jetstream]`),
/// with the section's name so that every refusal names its key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NatsAuth {
    /// The section the keys are in (`nats`, `store.jetstream`), for error texts.
    pub section: &'static str,
    /// A NATS `.creds` file (user JWT and NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// The variable that holds a token.
    pub token_env: Option<String>,
    /// User name, with `password_env`.
    pub user: Option<String>,
    /// The variable that holds `user`'s password.
    pub password_env: Option<String>,
    /// PEM file of the CA(s) the server's certificate must chain to.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate (mTLS), with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
}

/// Why a section's credentials could not be used. Each names the key and, for a secret, the
/// variable, never its value.
#[derive(Debug, thiserror::Error)]
pub enum NatsAuthError {
    /// `credentials_file` could not be read or parsed.
    #[error("{section}.credentials_file {path}: {source}")]
    Credentials {
        /// The section (`nats`, `store.jetstream`).
        section: &'static str,
        /// The configured path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// `token_env` names a variable that is not set.
    #[error("{section}.token_env {var}: not set in the environment or the secrets file")]
    Token {
        /// The section.
        section: &'static str,
        /// The variable.
        var: String,
    },
    /// `password_env` names a variable that is not set.
    #[error("{section}.password_env {var}: not set in the environment or the secrets file")]
    Password {
        /// The section.
        section: &'static str,
        /// The variable.
        var: String,
    },
}

impl NatsAuth {
    /// Checks what the types alone do not rule out: one way to authenticate at most, the
    /// keys that go in pairs, and the files (which the client would read only when it
    /// connects, failing every connect from then on). The error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let s = self.section;
        let ways = [
            self.credentials_file.is_some(),
            self.token_env.is_some(),
            self.user.is_some() || self.password_env.is_some(),
        ];
        if ways.iter().filter(|w| **w).count() > 1 {
            return Err(format!(
                "{s}.credentials_file, {s}.token_env and {s}.user (with {s}.password_env) are exclusive: set one"
            ));
        }
        if self.user.is_some() != self.password_env.is_some() {
            return Err(format!(
                "{s}.user and {s}.password_env go together: set both or neither"
            ));
        }
        if self.user.as_deref().is_some_and(str::is_empty) {
            return Err(format!("{s}.user must not be empty"));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(format!(
                "{s}.tls_cert_file and {s}.tls_key_file go together: set both or neither"
            ));
        }
        for (key, file) in [
            ("credentials_file", &self.credentials_file),
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
        ] {
            if let Some(path) = file
                && let Err(e) = std::fs::File::open(path)
            {
                return Err(format!("{s}.{key} {}: {e}", path.display()));
            }
        }
        Ok(())
    }

    /// The variable `token_env` or `password_env` names (at most one is set).
    pub fn secret_var(&self) -> Option<&str> {
        self.token_env.as_deref().or(self.password_env.as_deref())
    }

    /// The error for the configured secret variable when `secrets` does not resolve it.
    pub fn missing_secret(
        &self,
        secrets: &dyn Fn(&str) -> Option<String>,
    ) -> Option<NatsAuthError> {
        let section = self.section;
        if let Some(var) = &self.token_env
            && secrets(var).is_none()
        {
            return Some(NatsAuthError::Token {
                section,
                var: var.clone(),
            });
        }
        if let Some(var) = &self.password_env
            && secrets(var).is_none()
        {
            return Some(NatsAuthError::Password {
                section,
                var: var.clone(),
            });
        }
        None
    }

    /// Reads what the keys name as it is now: the token or password through `secrets` (the
    /// environment, then the secrets file), and the credentials file (which must parse). The
    /// credentials keep `secrets` to read the login again at each connect.
    pub fn resolve(&self, secrets: SecretResolver) -> Result<NatsCredentials, NatsAuthError> {
        let login = self.read_login(&*secrets)?.map(|login| {
            Arc::new(Relogin {
                auth: self.clone(),
                secrets,
                last: Mutex::new(login),
            })
        });
        Ok(NatsCredentials {
            section: self.section,
            login,
            tls_ca_file: self.tls_ca_file.clone(),
            client_cert: self.tls_cert_file.clone().zip(self.tls_key_file.clone()),
        })
    }

    /// The login the keys give now (`None` when no key asks for one): the one place the
    /// credentials file and the secrets are read, at the start and at every connect.
    fn read_login(
        &self,
        secrets: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Login>, NatsAuthError> {
        let section = self.section;
        if let Some(path) = &self.credentials_file {
            let creds = |source| NatsAuthError::Credentials {
                section,
                path: path.display().to_string(),
                source,
            };
            let text = std::fs::read_to_string(path).map_err(creds)?;
            let (jwt, key) = parse_creds(&text).map_err(creds)?;
            return Ok(Some(Login::Creds {
                jwt,
                key: Arc::new(key),
            }));
        }
        if let Some(var) = &self.token_env {
            let token = secrets(var).ok_or_else(|| NatsAuthError::Token {
                section,
                var: var.clone(),
            })?;
            return Ok(Some(Login::Token(token)));
        }
        if let Some(var) = &self.password_env {
            let password = secrets(var).ok_or_else(|| NatsAuthError::Password {
                section,
                var: var.clone(),
            })?;
            // `validate` pairs `user` with `password_env`.
            if let Some(user) = &self.user {
                return Ok(Some(Login::UserPassword {
                    user: user.clone(),
                    password,
                }));
            }
        }
        Ok(None)
    }

    /// One line saying how these keys make the client connect, for `router config explain`:
    /// the files and variables they name and whether each variable is set (`is_set`), never a
    /// secret's value.
    pub fn describe(&self, is_set: &dyn Fn(&str) -> bool) -> String {
        let s = self.section;
        let var = |key: &str, name: &str| {
            let state = if is_set(name) { "set" } else { "NOT SET" };
            format!("{s}.{key} = {name:?} ({state})")
        };
        let auth = match (&self.credentials_file, &self.token_env, &self.user) {
            (Some(path), _, _) => format!("{s}.credentials_file = {:?}", path.display()),
            (_, Some(token), _) => var("token_env", token),
            (_, _, Some(user)) => format!(
                "{s}.user = {user:?}, {}",
                self.password_env
                    .as_deref()
                    .map_or_else(String::new, |p| var("password_env", p))
            ),
            _ => "no credentials".to_string(),
        };
        let file = |key: &str, path: &Option<PathBuf>| {
            path.as_deref()
                .map(|p: &Path| format!("{s}.{key} = {:?}", p.display()))
        };
        let tls: Vec<String> = [
            file("tls_ca_file", &self.tls_ca_file),
            file("tls_cert_file", &self.tls_cert_file),
            file("tls_key_file", &self.tls_key_file),
        ]
        .into_iter()
        .flatten()
        .collect();
        let tls = if tls.is_empty() {
            "TLS when the URL is tls:// or the server requires it".to_string()
        } else {
            format!("TLS required: {}", tls.join(", "))
        };
        format!("auth: {auth}; {tls}")
    }
}

/// What a section's keys resolved to (`NatsAuth::resolve`): ready to become the client's
/// options (`options`), whose login is read again at each connect. Its `Debug` shows which
/// form of login is configured, never a secret.
#[derive(Clone, Default)]
pub struct NatsCredentials {
    section: &'static str,
    /// The login and how to read it again; `None` when the keys ask for none.
    login: Option<Arc<Relogin>>,
    tls_ca_file: Option<PathBuf>,
    /// Client certificate and its key.
    client_cert: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let auth = self.login.as_ref().map(|l| &l.auth);
        f.debug_struct("NatsCredentials")
            .field("section", &self.section)
            .field(
                "credentials_file",
                &auth.and_then(|a| a.credentials_file.as_ref()),
            )
            .field("token_env", &auth.and_then(|a| a.token_env.as_ref()))
            .field("user", &auth.and_then(|a| a.user.as_ref()))
            .field("password_env", &auth.and_then(|a| a.password_env.as_ref()))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("client_cert", &self.client_cert)
            .finish()
    }
}

impl NatsCredentials {
    /// The client's options with these credentials and TLS settings, for the caller to add
    /// its own to. The login is an auth callback (it replaces any other form the client
    /// has), so each connect and reconnect reads the credentials file and the secret again
    /// (`Relogin::current`). A CA or client certificate makes TLS required: it is meant for
    /// TLS, and the client must never fall back to plain text on a server that does not offer
    /// it. The client reads the TLS files at each connect itself.
    pub fn options(&self) -> async_nats::ConnectOptions {
        let mut opts = match &self.login {
            Some(login) => {
                let login = login.clone();
                async_nats::ConnectOptions::with_auth_callback(move |nonce| {
                    std::future::ready(login.current().auth(&nonce))
                })
            }
            None => async_nats::ConnectOptions::new(),
        };
        if let Some(ca) = &self.tls_ca_file {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_cert {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_ca_file.is_some() || self.client_cert.is_some() {
            opts = opts.require_tls(true);
        }
        opts
    }

    /// What to check when the server refused the connection's authentication: the keys that
    /// gave the credentials, or that none were given.
    pub fn refusal_hint(&self) -> String {
        let s = self.section;
        match self.login.as_ref().map(|l| &l.auth) {
            Some(a) if a.credentials_file.is_some() => {
                format!("the server refused the credentials of {s}.credentials_file")
            }
            Some(a) if a.token_env.is_some() => {
                format!("the server refused the token {s}.token_env names")
            }
            Some(_) => {
                format!("the server refused {s}.user with the password {s}.password_env names")
            }
            None => format!(
                "the server requires credentials: set {s}.user and {s}.password_env (or {s}.token_env, {s}.credentials_file)"
            ),
        }
    }
}

/// A section's login with what it takes to read it again: the keys, the secret resolver
/// (the environment, then the secrets file as it is on disk now) and the last login read.
struct Relogin {
    auth: NatsAuth,
    secrets: SecretResolver,
    /// The login of the last read that worked: what a connect uses when the credentials file
    /// or the secret cannot be read (a file being replaced, an entry taken out by mistake).
    last: Mutex<Login>,
}

impl Relogin {
    /// The login as the keys give it now, or the last one that could be read (with a
    /// warning naming the key). Called by the client at each connect, after the server's
    /// greeting: it reads a small file at most, rarely, so it does so where it runs rather
    /// than on a blocking thread.
    fn current(&self) -> Login {
        let now = self.auth.read_login(&*self.secrets);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match now {
            Ok(Some(login)) => {
                if !login.same_as(&last) {
                    tracing::info!(
                        section = self.auth.section,
                        "NATS login changed since the last connect: connecting with the new one"
                    );
                    *last = login;
                }
            }
            // The keys ask for a login (else there would be no `Relogin`): not reached.
            Ok(None) => {}
            Err(e) => tracing::warn!(
                section = self.auth.section,
                error = %e,
                "NATS login could not be read again for a connect: connecting with the one last read"
            ),
        }
        last.clone()
    }
}

/// One login, as the server's CONNECT takes it.
#[derive(Clone)]
enum Login {
    /// A `.creds` file's user JWT, and the NKey that signs the server's nonce.
    Creds {
        jwt: String,
        key: Arc<nkeys::KeyPair>,
    },
    Token(String),
    UserPassword {
        user: String,
        password: String,
    },
}

impl Login {
    /// Whether `other` logs in the same way (to log a rotation once, not at every connect).
    fn same_as(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Creds { jwt, key }, Self::Creds { jwt: j, key: k }) => {
                jwt == j && key.public_key() == k.public_key()
            }
            (Self::Token(a), Self::Token(b)) => a == b,
            (
                Self::UserPassword { user, password },
                Self::UserPassword {
                    user: u,
                    password: p,
                },
            ) => user == u && password == p,
            _ => false,
        }
    }

    /// The client's answer to a server that sent `nonce`.
    fn auth(&self, nonce: &[u8]) -> Result<async_nats::Auth, async_nats::AuthError> {
        let mut auth = async_nats::Auth::new();
        match self {
            Self::Creds { jwt, key } => {
                auth.jwt = Some(jwt.clone());
                auth.signature = Some(key.sign(nonce).map_err(async_nats::AuthError::new)?);
            }
            Self::Token(token) => auth.token = Some(token.clone()),
            Self::UserPassword { user, password } => {
                auth.username = Some(user.clone());
                auth.password = Some(password.clone());
            }
        }
        Ok(auth)
    }
}

/// One decorated block of a `.creds` file: a `---…---` line, the value, a `---…---` line.
/// The same expression as async-nats' own reader, so a file it takes is taken here.
static CREDS_BLOCK: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(r"\s*(?:(?:[-]{3,}.*[-]{3,}\r?\n)([\w\-.=]+)(?:\r?\n[-]{3,}.*[-]{3,}\r?\n))")
        .expect("valid expression")
});

/// A `.creds` file's user JWT (its first block) and NKey seed (its second), as async-nats
/// reads them, with its error texts.
fn parse_creds(text: &str) -> Result<(String, nkeys::KeyPair), std::io::Error> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let mut blocks = CREDS_BLOCK
        .captures_iter(text)
        .filter_map(|c| c.get(1).map(|m| m.as_str()));
    let jwt = blocks
        .next()
        .ok_or_else(|| invalid("cannot parse user JWT from the credentials file"))?;
    let seed = blocks
        .next()
        .ok_or_else(|| invalid("cannot parse nkey from the credentials file"))?;
    let key = nkeys::KeyPair::from_seed(seed)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok((jwt.to_string(), key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> NatsAuth {
        NatsAuth {
            section: "store.jetstream",
            ..NatsAuth::default()
        }
    }

    /// The two exclusive forms, the pairs and the files are refused with the section's keys.
    #[test]
    fn refusals_name_the_sections_keys() {
        let cases = [
            (
                NatsAuth {
                    token_env: Some("T".into()),
                    user: Some("u".into()),
                    password_env: Some("P".into()),
                    ..auth()
                },
                "store.jetstream.credentials_file, store.jetstream.token_env and store.jetstream.user (with store.jetstream.password_env) are exclusive: set one",
            ),
            (
                NatsAuth {
                    user: Some("u".into()),
                    ..auth()
                },
                "store.jetstream.user and store.jetstream.password_env go together",
            ),
            (
                NatsAuth {
                    user: Some(String::new()),
                    password_env: Some("P".into()),
                    ..auth()
                },
                "store.jetstream.user must not be empty",
            ),
            (
                NatsAuth {
                    tls_key_file: Some("/nonexistent/k.pem".into()),
                    ..auth()
                },
                "store.jetstream.tls_cert_file and store.jetstream.tls_key_file go together",
            ),
            (
                NatsAuth {
                    tls_ca_file: Some("/nonexistent/ca.pem".into()),
                    ..auth()
                },
                "store.jetstream.tls_ca_file /nonexistent/ca.pem: No such file",
            ),
            (
                NatsAuth {
                    credentials_file: Some("/nonexistent/r.creds".into()),
                    ..auth()
                },
                "store.jetstream.credentials_file /nonexistent/r.creds: No such file",
            ),
        ];
        for (a, want) in cases {
            let e = a.validate().expect_err(want);
            assert!(e.starts_with(want), "{e}");
        }
        assert_eq!(auth().validate(), Ok(()));
    }

    /// A variable that does not resolve is named with its key; one that does goes into the
    /// login, and neither `Debug` nor any error shows its value.
    #[test]
    fn secrets_resolve_through_the_resolver_and_stay_hidden() {
        let secrets: SecretResolver =
            Arc::new(|name: &str| (name == "PW").then(|| "hunter2".to_string()));
        let a = NatsAuth {
            user: Some("router".into()),
            password_env: Some("NOPE".into()),
            ..auth()
        };
        let e = a.resolve(secrets.clone()).expect_err("not set");
        assert_eq!(
            e.to_string(),
            "store.jetstream.password_env NOPE: not set in the environment or the secrets file"
        );
        let t = NatsAuth {
            token_env: Some("NOPE".into()),
            ..auth()
        };
        assert_eq!(
            t.missing_secret(&*secrets)
                .map(|e| e.to_string())
                .as_deref(),
            Some("store.jetstream.token_env NOPE: not set in the environment or the secrets file")
        );
        let ok = NatsAuth {
            password_env: Some("PW".into()),
            ..a
        };
        let creds = ok.resolve(secrets).expect("resolved");
        assert!(!format!("{creds:?}").contains("hunter2"), "{creds:?}");
        let login = login_of(&creds, b"nonce");
        assert_eq!(login.username.as_deref(), Some("router"));
        assert_eq!(login.password.as_deref(), Some("hunter2"));
        let _options = creds.options();
        assert!(
            creds
                .refusal_hint()
                .contains("store.jetstream.password_env")
        );
        let line = ok.describe(&|name| name == "PW");
        assert_eq!(
            line,
            "auth: store.jetstream.user = \"router\", store.jetstream.password_env = \"PW\" (set); TLS when the URL is tls:// or the server requires it"
        );
        assert!(!line.contains("hunter2"));
    }

    /// A credentials file that is not a `.creds` file is refused when it is resolved (at
    /// start), naming the key and the file.
    #[test]
    fn a_credentials_file_that_does_not_parse_names_its_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("bad.creds");
        std::fs::write(&path, "not a creds file").expect("write");
        let a = NatsAuth {
            credentials_file: Some(path.clone()),
            ..auth()
        };
        let e = a.resolve(Arc::new(|_| None)).expect_err("refused");
        assert_eq!(
            e.to_string(),
            format!(
                "store.jetstream.credentials_file {}: cannot parse user JWT from the credentials file",
                path.display()
            )
        );
    }

    /// What the client would send at a connect to a server whose nonce is `nonce`.
    fn login_of(creds: &NatsCredentials, nonce: &[u8]) -> async_nats::Auth {
        creds
            .login
            .as_ref()
            .expect("a login")
            .current()
            .auth(nonce)
            .expect("auth")
    }

    /// A `.creds` file as `nsc` writes it, with a user JWT of `jwt` and `key`'s seed.
    fn creds_file(jwt: &str, key: &nkeys::KeyPair) -> String {
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n\n\
             *************************************************************\n",
            key.seed().expect("seed")
        )
    }

    /// Each connect reads the password again: a rotated one is sent from the next connect on,
    /// and one that no longer resolves (taken out of the secrets file) leaves the last one
    /// that did, rather than no login at all.
    #[test]
    fn each_connect_reads_the_password_again_and_keeps_the_last_good_one() {
        let secret = Arc::new(Mutex::new(Some("first".to_string())));
        let s = secret.clone();
        let secrets: SecretResolver = Arc::new(move |name: &str| {
            (name == "PW")
                .then(|| s.lock().expect("lock").clone())
                .flatten()
        });
        let creds = NatsAuth {
            user: Some("router".into()),
            password_env: Some("PW".into()),
            ..auth()
        }
        .resolve(secrets)
        .expect("resolved");
        assert_eq!(login_of(&creds, b"n").password.as_deref(), Some("first"));
        *secret.lock().expect("lock") = Some("second".into());
        assert_eq!(login_of(&creds, b"n").password.as_deref(), Some("second"));
        *secret.lock().expect("lock") = None;
        assert_eq!(login_of(&creds, b"n").password.as_deref(), Some("second"));
        *secret.lock().expect("lock") = Some("third".into());
        assert_eq!(login_of(&creds, b"n").password.as_deref(), Some("third"));
    }

    /// A `.creds` file is read again at each connect: the nonce is signed with the seed in
    /// the file now (async-nats would take the same file), a file replaced by one that does
    /// not parse, or removed, leaves the last one that did.
    #[test]
    fn each_connect_reads_the_credentials_file_again() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("router.creds");
        let first = nkeys::KeyPair::new_user();
        let text = creds_file("eyJmaXJzdA.eyJvbmUi.c2ln", &first);
        assert!(async_nats::ConnectOptions::with_credentials(&text).is_ok());
        std::fs::write(&path, text).expect("write");
        let creds = NatsAuth {
            credentials_file: Some(path.clone()),
            ..auth()
        }
        .resolve(Arc::new(|_| None))
        .expect("resolved");
        let signed_by = |key: &nkeys::KeyPair, login: &async_nats::Auth| {
            let sig = login.signature.as_deref().expect("a signature");
            key.verify(b"the nonce", sig).is_ok()
        };
        let login = login_of(&creds, b"the nonce");
        assert_eq!(login.jwt.as_deref(), Some("eyJmaXJzdA.eyJvbmUi.c2ln"));
        assert!(signed_by(&first, &login));

        let second = nkeys::KeyPair::new_user();
        std::fs::write(&path, creds_file("eyJzZWNvbmQ.eyJ0d28i.c2ln", &second)).expect("write");
        let login = login_of(&creds, b"the nonce");
        assert_eq!(login.jwt.as_deref(), Some("eyJzZWNvbmQ.eyJ0d28i.c2ln"));
        assert!(signed_by(&second, &login) && !signed_by(&first, &login));

        for broken in [Some("half a file"), None] {
            match broken {
                Some(text) => std::fs::write(&path, text).expect("write"),
                None => std::fs::remove_file(&path).expect("remove"),
            }
            let login = login_of(&creds, b"the nonce");
            assert_eq!(login.jwt.as_deref(), Some("eyJzZWNvbmQ.eyJ0d28i.c2ln"));
            assert!(signed_by(&second, &login));
        }
    }
}
