//! How the router's two NATS clients authenticate and secure their connection: the `nats:`
//! targets' connection (`[nats]`) and the JetStream store (`[store.jetstream]`). Both sections
//! have the same keys with the same meaning; this module is where they are validated (at
//! start, by the config) and turned into the client's options, once for both.
//!
//! Secrets (a token, a password) are never in the configuration: its keys name a variable,
//! looked up in the environment, then in the secrets file, when the client is built.

use std::path::{Path, PathBuf};

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
    /// environment, then the secrets file), and the credentials file.
    pub fn resolve(
        &self,
        secrets: &dyn Fn(&str) -> Option<String>,
    ) -> Result<NatsCredentials, NatsAuthError> {
        let section = self.section;
        if let Some(e) = self.missing_secret(secrets) {
            return Err(e);
        }
        let creds = match &self.credentials_file {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| NatsAuthError::Credentials {
                        section,
                        path: path.display().to_string(),
                        source,
                    })?;
                Some((path.clone(), text))
            }
            None => None,
        };
        Ok(NatsCredentials {
            section,
            creds,
            token: self.token_env.as_deref().and_then(secrets),
            user_password: match (&self.user, &self.password_env) {
                (Some(user), Some(var)) => secrets(var).map(|p| (user.clone(), p)),
                _ => None,
            },
            tls_ca_file: self.tls_ca_file.clone(),
            client_cert: self.tls_cert_file.clone().zip(self.tls_key_file.clone()),
        })
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

/// What a section's keys resolved to (`NatsAuth::resolve`): ready to go into the client's
/// options. Its `Debug` shows which forms are present, never a secret.
#[derive(Clone, Default)]
pub struct NatsCredentials {
    section: &'static str,
    /// The credentials file's path (for errors) and text.
    creds: Option<(PathBuf, String)>,
    token: Option<String>,
    user_password: Option<(String, String)>,
    tls_ca_file: Option<PathBuf>,
    /// Client certificate and its key.
    client_cert: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsCredentials")
            .field("section", &self.section)
            .field("credentials_file", &self.creds.as_ref().map(|(p, _)| p))
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("user", &self.user_password.as_ref().map(|(u, _)| u))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("client_cert", &self.client_cert)
            .finish()
    }
}

impl NatsCredentials {
    /// `opts` with these credentials and TLS settings. A CA or client certificate makes TLS
    /// required: it is meant for TLS, and the client must never fall back to plain text on a
    /// server that does not offer it.
    pub fn apply(
        &self,
        mut opts: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, NatsAuthError> {
        if let Some((path, text)) = &self.creds {
            opts = opts
                .credentials(text)
                .map_err(|source| NatsAuthError::Credentials {
                    section: self.section,
                    path: path.display().to_string(),
                    source,
                })?;
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        if let Some(ca) = &self.tls_ca_file {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_cert {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_ca_file.is_some() || self.client_cert.is_some() {
            opts = opts.require_tls(true);
        }
        if let Some((user, password)) = &self.user_password {
            opts = opts.user_and_password(user.clone(), password.clone());
        }
        Ok(opts)
    }

    /// What to check when the server refused the connection's authentication: the keys that
    /// gave the credentials, or that none were given.
    pub fn refusal_hint(&self) -> String {
        let s = self.section;
        if self.creds.is_some() {
            format!("the server refused the credentials of {s}.credentials_file")
        } else if self.token.is_some() {
            format!("the server refused the token {s}.token_env names")
        } else if self.user_password.is_some() {
            format!("the server refused {s}.user with the password {s}.password_env names")
        } else {
            format!(
                "the server requires credentials: set {s}.user and {s}.password_env (or {s}.token_env, {s}.credentials_file)"
            )
        }
    }
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
    /// options, and neither `Debug` nor any error shows its value.
    #[test]
    fn secrets_resolve_through_the_resolver_and_stay_hidden() {
        let secrets = |name: &str| (name == "PW").then(|| "hunter2".to_string());
        let a = NatsAuth {
            user: Some("router".into()),
            password_env: Some("NOPE".into()),
            ..auth()
        };
        let e = a.resolve(&secrets).expect_err("not set");
        assert_eq!(
            e.to_string(),
            "store.jetstream.password_env NOPE: not set in the environment or the secrets file"
        );
        let t = NatsAuth {
            token_env: Some("NOPE".into()),
            ..auth()
        };
        assert_eq!(
            t.missing_secret(&secrets).map(|e| e.to_string()).as_deref(),
            Some("store.jetstream.token_env NOPE: not set in the environment or the secrets file")
        );
        let ok = NatsAuth {
            password_env: Some("PW".into()),
            ..a
        };
        let creds = ok.resolve(&secrets).expect("resolved");
        assert!(!format!("{creds:?}").contains("hunter2"), "{creds:?}");
        assert!(creds.apply(async_nats::ConnectOptions::new()).is_ok());
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

    /// A credentials file that is not a `.creds` file is refused when the options are built,
    /// naming the key and the file.
    #[test]
    fn a_credentials_file_that_does_not_parse_names_its_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("bad.creds");
        std::fs::write(&path, "not a creds file").expect("write");
        let a = NatsAuth {
            credentials_file: Some(path.clone()),
            ..auth()
        };
        let creds = a.resolve(&|_| None).expect("read");
        let e = creds
            .apply(async_nats::ConnectOptions::new())
            .expect_err("refused");
        assert!(
            e.to_string().starts_with(&format!(
                "store.jetstream.credentials_file {}:",
                path.display()
            )),
            "{e}"
        );
    }
}
