//! Authentication and scopes: bearer tokens from config, stored as SHA-256 hashes (never the
//! token), compared in constant time. Each token has a name and scopes:
//! `ingest:<type-glob>`, `ingest-source:<source-glob>`, `handlers:<name-glob>`,
//! `dlq:<target-glob>`, `read`, `admin`.
//! Missing or wrong token → 401; valid but out of scope → 403 naming the scope needed.
//!
//! The two ingest scopes each restrict when present: a token with `ingest:` scopes may send
//! only those types, one with `ingest-source:` scopes only those sources, one with both must
//! satisfy both. A producer confined to its own sources cannot claim another's (`source`, `id`)
//! and so cannot make the dedup window swallow that producer's events.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The lowest `rate_per_sec` a token may have: one event in 1000 s. Below it a refusal's
/// Retry-After runs to days or years, which is a lock-out, not a rate.
pub const MIN_TOKEN_RATE: f64 = 0.001;

/// One configured token (`[[auth.tokens]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds it (team or producer); shown in logs and 403s, never the token.
    pub name: String,
    /// Hex SHA-256 of the token.
    pub sha256: String,
    /// Scopes granted.
    pub scopes: Vec<String>,
    /// Ingest rate limit for this token (events per second); none = unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<f64>,
    /// The team the token belongs to (default: its name). Handlers belong to the team of
    /// their first uploader: only that team's tokens (or an administrator) can upload over,
    /// roll back or delete them, so a team rotates its tokens by giving the new one the same
    /// team, and overlapping `handlers:` globs never let one team replace another's handler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
}

/// The caller, once authenticated.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    /// Token name.
    pub name: String,
    /// Its team (the token's `team`, or its name).
    pub team: String,
    /// Scopes.
    pub scopes: Vec<String>,
}

/// What a route needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// `ingest:<type>` for each event type.
    Ingest(String),
    /// `ingest-source:<source>` for each event source (when the token restricts sources).
    IngestSource(String),
    /// `handlers:<name>`.
    Handlers(String),
    /// `dlq:<target>`.
    Dlq(String),
    /// `read`.
    Read,
    /// `admin`.
    Admin,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ingest(t) => write!(f, "ingest:{t}"),
            Self::IngestSource(s) => write!(f, "ingest-source:{s}"),
            Self::Handlers(n) => write!(f, "handlers:{n}"),
            Self::Dlq(t) => write!(f, "dlq:{t}"),
            Self::Read => f.write_str("read"),
            Self::Admin => f.write_str("admin"),
        }
    }
}

/// Glob match with `*` (any run, including empty). Case-sensitive.
pub fn glob(pattern: &str, s: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), s.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0usize, 0usize, None, 0usize);
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some(sp) = star {
            pi = sp + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

impl Principal {
    /// Whether this caller holds `needed`. `admin` holds everything; `read` is implied by
    /// any `dlq:` or `handlers:` scope only for their own objects (checked by the caller).
    pub fn allows(&self, needed: &Scope) -> bool {
        self.scopes.iter().any(|s| {
            if s == "admin" {
                return true;
            }
            match needed {
                Scope::Read => s == "read",
                Scope::Admin => false,
                Scope::Ingest(t) => s.strip_prefix("ingest:").is_some_and(|g| glob(g, t)),
                Scope::IngestSource(src) => s
                    .strip_prefix("ingest-source:")
                    .is_some_and(|g| glob(g, src)),
                Scope::Handlers(n) => s.strip_prefix("handlers:").is_some_and(|g| glob(g, n)),
                Scope::Dlq(t) => s.strip_prefix("dlq:").is_some_and(|g| glob(g, t)),
            }
        })
    }
}

impl Principal {
    /// The principal of a configured token.
    pub fn of(c: &TokenConfig) -> Self {
        Self {
            name: c.name.clone(),
            team: c.team.clone().unwrap_or_else(|| c.name.clone()),
            scopes: c.scopes.clone(),
        }
    }

    /// This caller as the uploader of a handler version.
    pub fn uploader(&self) -> crate::wasm::Uploader {
        crate::wasm::Uploader {
            token: self.name.clone(),
            team: self.team.clone(),
            admin: self.allows(&Scope::Admin),
            preload: false,
            for_team: None,
        }
    }

    /// Whether this caller holds `handlers:` scopes (lists the handlers they cover).
    pub fn has_handler_scopes(&self) -> bool {
        self.scopes.iter().any(|s| s.starts_with("handlers:"))
    }

    /// Whether this caller holds `dlq:` scopes (reads its own targets' dead letters and jobs).
    pub fn has_dlq_scopes(&self) -> bool {
        self.scopes.iter().any(|s| s.starts_with("dlq:"))
    }

    /// The scope this caller lacks to send an event of type `ty` from `source`, if any.
    /// `ingest:` scopes restrict types and `ingest-source:` scopes restrict sources, each only
    /// when the token has at least one of that kind; a token with neither sends nothing.
    /// `source` is `None` where the router sets the source itself (a handler's emissions).
    pub fn ingest_denial(&self, ty: &str, source: Option<&str>) -> Option<Scope> {
        if self.scopes.iter().any(|s| s == "admin") {
            return None;
        }
        let has = |prefix: &str| self.scopes.iter().any(|s| s.starts_with(prefix));
        let (types, sources) = (has("ingest:"), has("ingest-source:"));
        let ty_scope = Scope::Ingest(ty.to_string());
        if (types || !sources) && !self.allows(&ty_scope) {
            return Some(ty_scope);
        }
        let source_scope = Scope::IngestSource(source?.to_string());
        (sources && !self.allows(&source_scope)).then_some(source_scope)
    }
}

/// Why the pattern of scope `s` (known kind, non-empty pattern) can never be what its author
/// meant, if it cannot: a scope is matched character for character, so `ingest: order.*`
/// (a space), `dlq:erp ` or `dlq:erp,crm` (one scope per list element) would load and then
/// never match, and the token would be refused for reasons its config does not show.
fn scope_pattern_problem(s: &str) -> Option<String> {
    let pattern = s.split_once(':').map_or("", |(_, p)| p);
    if let Some(c) = pattern
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || *c == ',')
    {
        return Some(format!(
            "the pattern contains {c:?}; patterns have no spaces, commas or control characters (give each pattern its own scope: [\"dlq:erp\", \"dlq:crm\"])"
        ));
    }
    if s.starts_with("handlers:")
        && let Some(c) = pattern
            .chars()
            .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '-' | '*'))
    {
        return Some(format!(
            "the pattern contains {c:?}; handler names are a-z, 0-9, '_' and '-' (and '*' in a pattern)"
        ));
    }
    None
}

/// Source prefixes of the router's own events: a handler's emissions (`handler://<name>`, with
/// ids derived from the delivery by a public hash, so they can be computed in advance) and
/// system events (`router://…`: `router.dlq.added`, `router.breaker.*`). An event sent to
/// ingest with such a source could take a handler's future (`source`, `id`), so that the real
/// emission is dropped as a duplicate, or pass for a system event.
pub const RESERVED_SOURCE_PREFIXES: [&str; 2] = ["handler://", "router://"];

/// The reserved prefix `source` starts with, if any (the scheme compared case-insensitively, as
/// URI schemes are).
pub fn reserved_source_prefix(source: &str) -> Option<&'static str> {
    RESERVED_SOURCE_PREFIXES.into_iter().find(|p| {
        source
            .get(..p.len())
            .is_some_and(|h| h.eq_ignore_ascii_case(p))
    })
}

/// The type prefix of system events (`router.dlq.added`, `router.breaker.opened`, …): rules
/// route them to alerting, so a producer sending one under its own source could raise a false
/// alert (or hide a real one among fakes).
pub const RESERVED_TYPE_PREFIX: &str = "router.";

impl Principal {
    /// A caller named and teamed `t` with `scopes` (tests of scope decisions).
    #[cfg(test)]
    pub(crate) fn with_scopes(scopes: &[&str]) -> Self {
        Self {
            name: "t".into(),
            team: "t".into(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The scope this caller lacks to send an event of type `ty` when it is a system event's
    /// ([`RESERVED_TYPE_PREFIX`]), if any: as for reserved sources, only `admin` or an
    /// `ingest:` pattern that itself starts with `router.` covers it (`ingest:*` does not).
    pub fn reserved_type_denial(&self, ty: &str) -> Option<Scope> {
        (ty.starts_with(RESERVED_TYPE_PREFIX)
            && !self.covers_reserved("ingest:", RESERVED_TYPE_PREFIX, ty))
        .then(|| Scope::Ingest(ty.to_string()))
    }

    /// The scope this caller lacks to send an event from `source` when that source is one of
    /// the router's own ([`RESERVED_SOURCE_PREFIXES`]), if any. Only `admin` or an
    /// `ingest-source:` pattern that itself starts with the prefix (`ingest-source:handler://*`,
    /// for a router downstream of another) covers it: `ingest-source:*`, or no source scope
    /// at all, does not.
    pub fn reserved_source_denial(&self, source: &str) -> Option<Scope> {
        let prefix = reserved_source_prefix(source)?;
        (!self.covers_reserved("ingest-source:", prefix, source))
            .then(|| Scope::IngestSource(source.to_string()))
    }

    /// Whether `admin`, or a `kind` scope whose pattern itself starts with `reserved` and
    /// matches `value`, covers a reserved value (a pattern reaching it only through `*` does
    /// not).
    fn covers_reserved(&self, kind: &str, reserved: &str, value: &str) -> bool {
        self.scopes.iter().any(|s| s == "admin")
            || self
                .scopes
                .iter()
                .filter_map(|s| s.strip_prefix(kind))
                .any(|g| g.starts_with(reserved) && glob(g, value))
    }
}

/// Uploader name of handlers preloaded from the operator's `handlers.preload_dir`: they are the
/// operator's own, so no token may take this name.
pub const PRELOAD_OWNER: &str = "preload";

/// The configured tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    tokens: Vec<([u8; 32], TokenConfig)>,
}

/// A problem in the `[auth]` configuration.
#[derive(Debug, thiserror::Error)]
#[error("auth.tokens[{index}] ({name}): {message}")]
pub struct TokenConfigError {
    index: usize,
    name: String,
    message: String,
}

impl Tokens {
    /// Validates the configured tokens.
    pub fn new(cfg: &[TokenConfig]) -> Result<Self, TokenConfigError> {
        let mut tokens: Vec<([u8; 32], TokenConfig)> = Vec::new();
        for (index, t) in cfg.iter().enumerate() {
            let err = |message: String| TokenConfigError {
                index,
                name: t.name.clone(),
                message,
            };
            // The name is how logs, 403s and handler owners say who acted: an empty one says
            // nobody.
            if t.name.trim().is_empty() {
                return Err(err(
                    "name must not be empty (it names the token's holder in logs and 403s)".into(),
                ));
            }
            // Names key the per-token ingest limits and the emitters of handlers' events: a
            // second token of the same name would share (and set) the first one's.
            if let Some(i) = cfg[..index].iter().position(|o| o.name == t.name) {
                return Err(err(format!(
                    "the name is already used by auth.tokens[{i}]; token names must be unique"
                )));
            }
            if t.name == PRELOAD_OWNER || t.team.as_deref() == Some(PRELOAD_OWNER) {
                return Err(err(format!(
                    "the name {PRELOAD_OWNER:?} is reserved for preloaded handlers (token name and team)"
                )));
            }
            if t.team.as_deref().is_some_and(str::is_empty) {
                return Err(err(
                    "team must not be empty (leave it out to use the token's name)".into(),
                ));
            }
            // A rate of zero or less (or NaN) is no rate: the limiter let a first request
            // through and answered the next ones 429 with a Retry-After of 1000000 s (11
            // days). An infinite one built no limiter at all.
            // Nor is one below a thousandth (1e-9 made every refusal a Retry-After of years).
            if let Some(rate) = t.rate_per_sec
                && !(rate.is_finite() && rate >= MIN_TOKEN_RATE)
            {
                return Err(err(format!(
                    "rate_per_sec = {rate} is not a rate: give a number of events per second of at least {MIN_TOKEN_RATE} (one event in 1000 s), or leave it out for no limit"
                )));
            }
            let bytes =
                hex::decode(&t.sha256).map_err(|e| err(format!("sha256 is not hex: {e}")))?;
            let hash: [u8; 32] = bytes
                .try_into()
                .map_err(|_| err("sha256 must be 32 bytes (64 hex digits)".into()))?;
            for s in &t.scopes {
                let ok = s == "read"
                    || s == "admin"
                    || ["ingest:", "ingest-source:", "handlers:", "dlq:"]
                        .iter()
                        .any(|p| s.strip_prefix(p).is_some_and(|g| !g.is_empty()));
                if !ok {
                    return Err(err(format!(
                        "unknown scope {s:?}; use ingest:<type-glob>, ingest-source:<source-glob>, handlers:<name-glob>, dlq:<target-glob>, read or admin"
                    )));
                }
                if let Some(why) = scope_pattern_problem(s) {
                    return Err(err(format!("scope {s:?}: {why}")));
                }
            }
            if let Some(i) = tokens.iter().position(|(h, _)| *h == hash) {
                return Err(err(format!(
                    "the same token (sha256) as auth.tokens[{i}]; a token must name one principal"
                )));
            }
            tokens.push((hash, t.clone()));
        }
        Ok(Self { tokens })
    }

    /// The configured tokens, in their configuration's order.
    pub fn configs(&self) -> Vec<TokenConfig> {
        self.tokens.iter().map(|(_, c)| c.clone()).collect()
    }

    /// Whether any token is configured (auth is on).
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Finds the token whose hash matches `presented`, comparing every configured hash in
    /// constant time (no early exit on the first match).
    pub fn authenticate(&self, presented: &str) -> Option<Principal> {
        let h: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for (hash, cfg) in &self.tokens {
            if bool::from(hash.ct_eq(&h)) {
                found = Some(cfg);
            }
        }
        found.map(Principal::of)
    }

    /// The configuration of the token named `name`.
    pub fn config(&self, name: &str) -> Option<&TokenConfig> {
        self.tokens.iter().map(|(_, c)| c).find(|c| c.name == name)
    }

    /// Whose scopes a handler version's emissions are checked against: the token that
    /// uploaded it (while a token of that name is of the version's team) or, once that token
    /// is gone (rotated), every token of its team together. `None` when neither is configured
    /// any more.
    pub fn uploader_principal(&self, token: &str, team: Option<&str>) -> Option<Principal> {
        if let Some(c) = self.config(token) {
            let p = Principal::of(c);
            // A name reused by another team's token is not the uploader.
            if team.is_none_or(|t| t == p.team) {
                return Some(p);
            }
        }
        let team = team?;
        let mates: Vec<&TokenConfig> = self
            .tokens
            .iter()
            .map(|(_, c)| c)
            .filter(|c| c.team.as_deref().unwrap_or(&c.name) == team)
            .collect();
        (!mates.is_empty()).then(|| Principal {
            name: format!("team {team}"),
            team: team.to_string(),
            scopes: mates
                .iter()
                .flat_map(|c| c.scopes.iter().cloned())
                .collect(),
        })
    }
}

/// A new random token (printed once by `router token new`) and its hash.
pub fn new_token() -> (String, String) {
    let bytes: [u8; 32] = rand::random();
    let token = format!("rtr_{}", hex::encode(bytes));
    let hash = hex::encode(Sha256::digest(token.as_bytes()));
    (token, hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("order.*", "order.paid"));
        assert!(glob("*", "anything"));
        assert!(glob("a*c*e", "abcde"));
        assert!(!glob("order.*", "orders"));
        assert!(glob("exact", "exact"));
        assert!(!glob("exact", "exactly"));
    }

    #[test]
    fn tokens_authenticate_by_hash_and_scopes_apply() {
        let (token, hash) = new_token();
        let t = Tokens::new(&[TokenConfig {
            name: "shop".into(),
            sha256: hash,
            scopes: vec!["ingest:order.*".into(), "dlq:erp".into()],
            rate_per_sec: None,
            team: None,
        }])
        .expect("valid");
        let p = t.authenticate(&token).expect("known token");
        assert_eq!(p.name, "shop");
        assert!(t.authenticate("rtr_wrong").is_none());
        assert!(p.allows(&Scope::Ingest("order.paid".into())));
        assert!(!p.allows(&Scope::Ingest("user.created".into())));
        assert!(p.allows(&Scope::Dlq("erp".into())));
        assert!(!p.allows(&Scope::Dlq("crm".into())));
        assert!(!p.allows(&Scope::Admin));
        assert!(!p.allows(&Scope::Read));
        let admin = Principal {
            name: "ops".into(),
            team: "ops".into(),
            scopes: vec!["admin".into()],
        };
        assert!(admin.allows(&Scope::Handlers("x".into())));
    }

    #[test]
    fn ingest_scopes_restrict_types_and_sources_each_when_present() {
        let p = Principal::with_scopes;
        let denial = |p: &Principal, ty: &str, src: &str| {
            p.ingest_denial(ty, Some(src)).map(|s| s.to_string())
        };
        let types_only = p(&["ingest:order.*"]);
        assert_eq!(denial(&types_only, "order.paid", "https://anyone"), None);
        assert_eq!(
            denial(&types_only, "user.created", "https://anyone").as_deref(),
            Some("ingest:user.created")
        );
        let sources_only = p(&["ingest-source:https://shop.example/*"]);
        assert_eq!(
            denial(&sources_only, "anything", "https://shop.example/eu"),
            None
        );
        assert_eq!(
            denial(&sources_only, "anything", "https://crm.example").as_deref(),
            Some("ingest-source:https://crm.example")
        );
        let both = p(&["ingest:order.*", "ingest-source:/shop/*"]);
        assert_eq!(denial(&both, "order.paid", "/shop/1"), None);
        assert_eq!(
            denial(&both, "user.created", "/shop/1").as_deref(),
            Some("ingest:user.created")
        );
        assert_eq!(
            denial(&both, "order.paid", "/crm/1").as_deref(),
            Some("ingest-source:/crm/1")
        );
        // No ingest scope of either kind: nothing may be sent; admin sends anything.
        assert_eq!(
            denial(&p(&["read", "dlq:erp"]), "order.paid", "/shop").as_deref(),
            Some("ingest:order.paid")
        );
        assert_eq!(denial(&p(&["admin"]), "x", "/y"), None);
        // A handler's emissions carry the router's source: only their type is checked.
        assert_eq!(sources_only.ingest_denial("anything", None), None);
        assert_eq!(
            both.ingest_denial("user.created", None)
                .map(|s| s.to_string())
                .as_deref(),
            Some("ingest:user.created")
        );
    }

    #[test]
    fn system_event_types_need_a_scope_that_names_them() {
        let p = Principal::with_scopes;
        let denial = |p: &Principal, ty: &str| p.reserved_type_denial(ty).map(|s| s.to_string());
        for scopes in [&["ingest:*"][..], &["ingest:r*"], &[]] {
            assert_eq!(
                denial(&p(scopes), "router.dlq.added").as_deref(),
                Some("ingest:router.dlq.added"),
                "{scopes:?}"
            );
        }
        for scopes in [
            &["admin"][..],
            &["ingest:router.*"],
            &["ingest:router.dlq.added"],
        ] {
            assert_eq!(denial(&p(scopes), "router.dlq.added"), None, "{scopes:?}");
        }
        assert_eq!(
            denial(&p(&["ingest:router.breaker.*"]), "router.dlq.added").as_deref(),
            Some("ingest:router.dlq.added")
        );
        // Not a system event's type.
        assert_eq!(denial(&p(&["ingest:*"]), "order.router.created"), None);
        assert_eq!(denial(&p(&["ingest:*"]), "routers.added"), None);
    }

    #[test]
    fn the_routers_own_sources_need_a_scope_that_names_them() {
        let p = Principal::with_scopes;
        let denial =
            |p: &Principal, src: &str| p.reserved_source_denial(src).map(|s| s.to_string());
        let sources = [
            "handler://enrich",
            "router://targets/erp",
            "router://ingest",
            "HANDLER://enrich",
            "Router://ingest",
        ];
        // No source scope, a bare `*`, or a glob that reaches the prefix only by `*`: refused.
        for scopes in [
            &["ingest:*"][..],
            &["ingest-source:*"],
            &["ingest:*", "ingest-source:*"],
            &["ingest-source:h*"],
            &["ingest-source:*://*"],
            &["read", "handlers:*", "dlq:*"],
        ] {
            for src in sources {
                assert_eq!(
                    denial(&p(scopes), src),
                    Some(format!("ingest-source:{src}")),
                    "{scopes:?} {src}"
                );
            }
        }
        // A pattern that starts with the prefix, and matches.
        let downstream = p(&["ingest-source:handler://*"]);
        assert_eq!(denial(&downstream, "handler://enrich"), None);
        assert!(denial(&downstream, "router://ingest").is_some());
        let one = p(&["ingest-source:handler://enrich", "ingest-source:*"]);
        assert_eq!(denial(&one, "handler://enrich"), None);
        assert!(denial(&one, "handler://invoice").is_some());
        assert_eq!(
            denial(&p(&["ingest-source:router://*"]), "router://ingest"),
            None
        );
        // Administrators (and so every caller when auth is off) send anything.
        for src in sources {
            assert_eq!(denial(&p(&["admin"]), src), None, "{src}");
        }
        // Other sources are not this check's business.
        for src in [
            "/shop",
            "https://handler.example",
            "handler:/x",
            "routers://x",
            "h",
        ] {
            assert_eq!(denial(&p(&["ingest:*"]), src), None, "{src}");
        }
    }

    #[test]
    fn a_rotated_uploaders_team_mates_stand_in_for_it() {
        let token = |name: &str, team: Option<&str>, scopes: &[&str]| TokenConfig {
            name: name.into(),
            sha256: hex::encode(Sha256::digest(name.as_bytes())),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            rate_per_sec: None,
            team: team.map(str::to_string),
        };
        let tokens = Tokens::new(&[
            token("billing-2026", Some("billing"), &["ingest:invoice.*"]),
            token("billing-emails", Some("billing"), &["ingest:email.*"]),
            token("crm", None, &["ingest:crm.*"]),
        ])
        .expect("valid");
        // The uploader's own token, when it is still configured.
        let p = tokens.uploader_principal("crm", Some("crm")).expect("crm");
        assert_eq!((p.name.as_str(), p.team.as_str()), ("crm", "crm"));
        // Gone: every token of its team together.
        let p = tokens
            .uploader_principal("billing-2025", Some("billing"))
            .expect("team mates");
        assert!(p.allows(&Scope::Ingest("invoice.paid".into())));
        assert!(p.allows(&Scope::Ingest("email.sent".into())));
        assert!(!p.allows(&Scope::Ingest("crm.lead".into())));
        // Gone with no team recorded (an older version), or a team with no token left.
        assert!(tokens.uploader_principal("billing-2025", None).is_none());
        // A token name reused by another team does not lend that team's scopes.
        let p = tokens
            .uploader_principal("crm", Some("billing"))
            .expect("billing's tokens");
        assert!(!p.allows(&Scope::Ingest("crm.lead".into())));
        assert!(p.allows(&Scope::Ingest("invoice.paid".into())));
        assert!(tokens.uploader_principal("x", Some("gone")).is_none());
    }

    #[test]
    fn bad_token_config_is_refused() {
        let bad = |sha: &str, scope: &str| {
            Tokens::new(&[TokenConfig {
                name: "x".into(),
                sha256: sha.into(),
                scopes: vec![scope.into()],
                rate_per_sec: None,
                team: None,
            }])
            .is_err()
        };
        assert!(bad("zz", "read"));
        assert!(bad("abcd", "read"));
        assert!(bad(&"a".repeat(64), "write"));
        assert!(bad(&"a".repeat(64), "ingest:"));
        assert!(bad(&"a".repeat(64), "ingest-source:"));
        assert!(!bad(&"a".repeat(64), "ingest-source:/shop/*"));
        assert!(!bad(&"a".repeat(64), "ingest:*"));
    }

    /// A pattern that would load and then never match is refused at load, naming the token
    /// and the scope.
    #[test]
    fn scope_typos_are_refused_at_load() {
        let load = |scope: &str| {
            Tokens::new(&[TokenConfig {
                name: "shop".into(),
                sha256: "a".repeat(64),
                scopes: vec![scope.into()],
                rate_per_sec: None,
                team: None,
            }])
        };
        for typo in [
            "ingest: order.*",
            "ingest:order.* ",
            "dlq:erp ",
            "dlq:erp,crm",
            "dlq:erp\tcrm",
            "ingest-source:/shop/\u{7}",
            "handlers:Enrich",
            "handlers:enrich.v2",
            "handlers:team/enrich",
        ] {
            let e = load(typo).expect_err(typo).to_string();
            assert!(e.contains("auth.tokens[0] (shop)"), "{typo}: {e}");
            assert!(e.contains(&format!("{typo:?}")), "{typo}: {e}");
        }
        for fine in [
            "ingest:order.*",
            "ingest-source:https://shop.example/*",
            "dlq:erp-*",
            "handlers:billing-*",
            "handlers:enrich_v2",
            "handlers:*",
        ] {
            assert!(load(fine).is_ok(), "{fine}");
        }
    }

    /// A rate that is not a positive finite number is refused at load, naming the token: a
    /// zero, negative or NaN rate locked the token out after its first request (Retry-After
    /// 1000000), an infinite one set no limit.
    #[test]
    fn a_rate_that_admits_nothing_is_refused_at_load() {
        let load = |rate: f64| {
            Tokens::new(&[TokenConfig {
                name: "shop".into(),
                sha256: "a".repeat(64),
                scopes: vec!["ingest:*".into()],
                rate_per_sec: Some(rate),
                team: None,
            }])
        };
        for rate in [
            0.0,
            -0.0,
            -5.0,
            1e-9,
            0.0009,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            let e = load(rate).expect_err(&rate.to_string()).to_string();
            assert!(
                e.contains("auth.tokens[0] (shop)") && e.contains("rate_per_sec"),
                "{rate}: {e}"
            );
        }
        for rate in [0.001, 1.0, 500.0, 1e9] {
            assert!(load(rate).is_ok(), "{rate}");
        }
    }

    /// A token needs a name (`router token new ''` and a config alike): logs, 403s and handler
    /// owners name the token's holder by it.
    #[test]
    fn an_empty_token_name_is_refused() {
        let load = |name: &str| {
            Tokens::new(&[TokenConfig {
                name: name.into(),
                sha256: "a".repeat(64),
                scopes: vec!["read".into()],
                rate_per_sec: None,
                team: None,
            }])
        };
        for name in ["", " ", "\t"] {
            let e = load(name).expect_err(name).to_string();
            assert!(e.contains("name must not be empty"), "{name:?}: {e}");
        }
        assert!(load("ci").is_ok());
    }

    #[test]
    fn token_names_and_tokens_are_unique() {
        let token = |name: &str, sha: char| TokenConfig {
            name: name.into(),
            sha256: sha.to_string().repeat(64),
            scopes: vec!["read".into()],
            rate_per_sec: None,
            team: None,
        };
        let e = Tokens::new(&[token("ci", 'a'), token("ci", 'b')]).unwrap_err();
        assert!(
            e.to_string().contains("already used by auth.tokens[0]"),
            "{e}"
        );
        let e = Tokens::new(&[token("ci", 'a'), token("ops", 'a')]).unwrap_err();
        assert!(e.to_string().contains("same token"), "{e}");
        assert!(Tokens::new(&[token("ci", 'a'), token("ops", 'b')]).is_ok());
    }

    #[test]
    fn head_needs_what_get_needs() {
        let head = route_need(&http::Method::HEAD, "/v1/status");
        assert_eq!(head, route_need(&http::Method::GET, "/v1/status"));
        assert_eq!(head, Need::Read);
        // `read` reads one handler's metadata by HEAD as by GET; never its logs, never a change.
        use http::Method as M;
        for m in [M::GET, M::HEAD] {
            assert!(reads_handler_metadata(&m, "/v1/handlers/{name}"), "{m}");
            assert!(
                !reads_handler_metadata(&m, "/v1/handlers/{name}/logs"),
                "{m}"
            );
        }
        for m in [M::PUT, M::DELETE, M::POST] {
            assert!(!reads_handler_metadata(&m, "/v1/handlers/{name}"), "{m}");
        }
    }

    /// Every (method, route) that a token without `admin` may use is one the route answers:
    /// the 405 for the others can never hide a route that is open to it.
    #[test]
    fn the_routes_open_to_other_tokens_are_methods_the_route_answers() {
        use http::Method as M;
        let routes = [
            "/v1/events",
            "/v1/events/{id}",
            "/v1/dlq",
            "/v1/dlq/summary",
            "/v1/dlq/purge",
            "/v1/dlq/redrive",
            "/v1/dlq/redrive/{job}",
            "/v1/dlq/redrive/{job}/{action}",
            "/v1/dlq/{id}",
            "/v1/replay",
            "/v1/replay/{job}",
            "/v1/replay/{job}/{action}",
            "/v1/rules",
            "/v1/rules/test",
            "/v1/rules/{name}/{action}",
            "/v1/targets",
            "/v1/targets/{id}",
            "/v1/targets/{id}/pause",
            "/v1/targets/{id}/resume",
            "/v1/targets/{id}/keys/{key}/release",
            "/v1/contracts",
            "/v1/contracts/{type}/{version}",
            "/v1/admin/reload",
            "/v1/status",
            "/metrics",
            "/v1/handlers",
            "/v1/handlers/{name}",
            "/v1/handlers/{name}/rollback",
            "/v1/handlers/{name}/logs",
            "/healthz",
            "/readyz",
        ];
        for route in routes {
            let allowed = route_methods(route).unwrap_or_else(|| panic!("{route} listed"));
            for m in [M::GET, M::HEAD, M::POST, M::PUT, M::DELETE, M::PATCH] {
                // `Nothing` routes pass the layer whatever the method (axum answers 405).
                if !matches!(route_need(&m, route), Need::Admin | Need::Nothing) {
                    assert!(allowed.contains(&m), "{m} {route}");
                }
            }
        }
        assert_eq!(route_methods("/v1/nope"), None);
    }
}

/// What a route requires before its handler runs (finer checks that need the body happen in
/// the handler, using the `Principal` put in the request's extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Nothing (health probes).
    Nothing,
    /// A valid token; the handler checks the scope (ingest types, DLQ targets).
    Token,
    /// `handlers:<name>` for the handler named in the path (or `admin`; for reading one,
    /// `read` too), checked before the request's body is read: an upload is up to
    /// `handlers.max_upload_bytes`, not to be buffered for a token that may not send it.
    Handler,
    /// `read` (or `admin`).
    Read,
    /// `admin`.
    Admin,
}

/// The requirement of each route, by method and route pattern. Every route of the API is
/// listed; an unlisted one requires `admin`, so a new route is closed until classified.
pub fn route_need(method: &http::Method, route: &str) -> Need {
    use http::Method as M;
    // HEAD is answered by the GET route (without the body): it needs what GET needs.
    let method = if method == M::HEAD { &M::GET } else { method };
    match (method, route) {
        (_, "/healthz" | "/readyz") => Need::Nothing,
        (&M::POST, "/v1/events") => Need::Token,
        // A team reads its own targets' dead letters and redrive jobs (checked in the handler).
        (
            &M::GET,
            "/v1/dlq"
            | "/v1/dlq/summary"
            | "/v1/dlq/{id}"
            | "/v1/dlq/redrive"
            | "/v1/dlq/redrive/{job}",
        ) => Need::Token,
        (&M::POST, "/v1/dlq/redrive" | "/v1/dlq/purge" | "/v1/dlq/redrive/{job}/{action}") => {
            Need::Token
        }
        // A team's handlers: `handlers:<name>`.
        (&M::GET | &M::PUT | &M::DELETE, "/v1/handlers/{name}")
        | (&M::POST, "/v1/handlers/{name}/rollback")
        | (&M::GET, "/v1/handlers/{name}/logs") => Need::Handler,
        // `read`, or a team's `handlers:` scopes for the handlers they cover (the list is
        // filtered by the route).
        (&M::GET, "/v1/handlers") => Need::Token,
        (
            &M::GET,
            "/v1/events/{id}"
            | "/v1/targets"
            | "/v1/targets/{id}"
            | "/v1/rules"
            | "/v1/status"
            | "/metrics"
            | "/v1/contracts"
            | "/v1/contracts/{type}/{version}",
        )
        | (&M::GET, "/v1/replay" | "/v1/replay/{job}")
        | (&M::POST, "/v1/rules/test") => Need::Read,
        _ => Need::Admin,
    }
}

/// Whether `method route` reads one handler's metadata (its versions and owner), which `read`
/// may do as well as `handlers:<name>`; its logs are its team's alone. HEAD is GET without the
/// body, so it is allowed what GET is.
pub fn reads_handler_metadata(method: &http::Method, route: &str) -> bool {
    matches!(*method, http::Method::GET | http::Method::HEAD) && route == "/v1/handlers/{name}"
}

/// The methods each route of the API answers (HEAD with GET), for the 405 that a token
/// gets when it sends a route a method it does not have: without this the route's
/// requirement, `admin` for an unlisted (method, route), answered 403 first. A route missing
/// here only keeps the 403; it opens nothing.
pub fn route_methods(route: &str) -> Option<&'static [http::Method]> {
    use http::Method as M;
    const GET: &[M] = &[M::GET, M::HEAD];
    const POST: &[M] = &[M::POST];
    const GET_POST: &[M] = &[M::GET, M::HEAD, M::POST];
    Some(match route {
        "/v1/events" | "/v1/dlq/purge" | "/v1/dlq/redrive/{job}/{action}" | "/v1/rules/test" => {
            POST
        }
        "/v1/replay/{job}/{action}"
        | "/v1/rules/{name}/{action}"
        | "/v1/targets/{id}/pause"
        | "/v1/targets/{id}/resume"
        | "/v1/targets/{id}/keys/{key}/release"
        | "/v1/admin/reload"
        | "/v1/handlers/{name}/rollback" => POST,
        "/v1/dlq/redrive" | "/v1/replay" => GET_POST,
        "/v1/contracts/{type}/{version}" => &[M::GET, M::HEAD, M::PUT],
        "/v1/handlers/{name}" => &[M::GET, M::HEAD, M::PUT, M::DELETE],
        "/v1/events/{id}"
        | "/v1/dlq"
        | "/v1/dlq/summary"
        | "/v1/dlq/{id}"
        | "/v1/dlq/redrive/{job}"
        | "/v1/replay/{job}"
        | "/v1/targets"
        | "/v1/targets/{id}"
        | "/v1/rules"
        | "/v1/contracts"
        | "/v1/status"
        | "/metrics"
        | "/v1/handlers"
        | "/v1/handlers/{name}/logs"
        | "/healthz"
        | "/readyz" => GET,
        _ => return None,
    })
}

/// The 405 answer (its body is the error shape `app::json_rejections` gives axum's own).
fn method_not_allowed(allowed: &[http::Method]) -> axum::response::Response {
    use axum::response::IntoResponse;
    let allow = allowed
        .iter()
        .map(http::Method::as_str)
        .collect::<Vec<_>>()
        .join(",");
    let mut r = http::StatusCode::METHOD_NOT_ALLOWED.into_response();
    if let Ok(v) = http::HeaderValue::from_str(&allow) {
        r.headers_mut().insert(http::header::ALLOW, v);
    }
    r
}

/// The 401 answer.
pub fn unauthorized(msg: &str) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut r = crate::ingest::error_response(
        http::StatusCode::UNAUTHORIZED,
        "authentication required",
        vec![crate::event::FieldError::new("/authorization", msg)],
    );
    r.headers_mut()
        .insert("www-authenticate", http::HeaderValue::from_static("Bearer"));
    r.into_response()
}

/// The 403 answer, naming the scope that was needed.
pub fn forbidden(p: &Principal, needed: &str) -> axum::response::Response {
    crate::ingest::error_response(
        http::StatusCode::FORBIDDEN,
        "out of scope",
        vec![crate::event::FieldError::new(
            "/authorization",
            format!("token {:?} lacks scope {needed}", p.name),
        )],
    )
}

/// Checks the scope in a handler: `Ok(())` or the 403 to return.
pub fn require(p: &Principal, needed: &Scope) -> Result<(), Box<axum::response::Response>> {
    if p.allows(needed) {
        Ok(())
    } else {
        Err(Box::new(forbidden(p, &needed.to_string())))
    }
}

/// The middleware: authenticates the bearer token and applies the route's requirement.
pub async fn layer(
    axum::extract::State(app): axum::extract::State<std::sync::Arc<crate::app::App>>,
    matched: Option<axum::extract::MatchedPath>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = matched.as_ref().map_or("", |m| m.as_str());
    let need = route_need(req.method(), route);
    if need == Need::Nothing {
        return next.run(req).await;
    }
    let tokens = app.tokens.load();
    let principal = if tokens.enabled() {
        let header = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        // The scheme name is case-insensitive (RFC 9110 §11.1): `bearer` and `BEARER` too.
        let token = header.and_then(|h| {
            let (scheme, token) = h.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(token)
        });
        let Some(token) = token else {
            return unauthorized("send `Authorization: Bearer <token>`");
        };
        match tokens.authenticate(token.trim()) {
            Some(p) => p,
            None => {
                tracing::warn!(route, "request with an unknown token");
                return unauthorized("unknown token");
            }
        }
    } else {
        // No tokens configured: the router only listens on loopback (or was started with
        // `auth.insecure`), and every local caller is an administrator.
        Principal {
            name: "local".into(),
            team: "local".into(),
            scopes: vec!["admin".into()],
        }
    };
    let ok = match need {
        Need::Read => principal.allows(&Scope::Read),
        Need::Admin => principal.allows(&Scope::Admin),
        Need::Handler => {
            // `/v1/handlers/{name}[/...]`: the name is the third segment. A handler name is
            // a-z, 0-9, `_` and `-`, so it is never percent-encoded; an encoded one is refused
            // rather than decoded differently from the route's own `Path`.
            let name = req.uri().path().split('/').nth(3).unwrap_or_default();
            if name.contains('%') {
                return crate::ingest::error_response(
                    http::StatusCode::BAD_REQUEST,
                    "invalid handler name",
                    vec![crate::event::FieldError::new(
                        "/name",
                        "handler names are a-z, 0-9, '_' and '-', never percent-encoded",
                    )],
                );
            }
            let scope = Scope::Handlers(name.to_string());
            let read_one = reads_handler_metadata(req.method(), route);
            if !(principal.allows(&scope) || (read_one && principal.allows(&Scope::Read))) {
                return forbidden(&principal, &scope.to_string());
            }
            true
        }
        Need::Nothing | Need::Token => true,
    };
    if !ok {
        // A method the route does not have is that, whoever asks (the token is valid).
        if let Some(allowed) = route_methods(route)
            && !allowed.contains(req.method())
        {
            return method_not_allowed(allowed);
        }
        let needed = if need == Need::Read { "read" } else { "admin" };
        return forbidden(&principal, needed);
    }
    req.extensions_mut().insert(principal);
    next.run(req).await
}
