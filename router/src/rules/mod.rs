//! Rules and targets: the rule-match stage between contract checks and durable fan-out.
//!
//! A [`RuleSet`] is loaded from a directory of rule files kept in git (YAML or JSON; see
//! `SPEC.md`, "Rules and targets"), checked as a whole with `file:line:col` diagnostics, and
//! then asked which rules (and so which targets) an event matches. A set is immutable; a
//! reload builds a new one and swaps it in.

pub mod automaton;
#[cfg(test)]
mod cases;
mod loader;
pub mod pattern;
mod source;
pub mod watch;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::event::{CloudEvent, FieldError};
use crate::policy::PolicyConfig;
pub use automaton::{CompiledMatcher, MatchError, MatcherStats};
pub use pattern::{Pattern, PatternError, simple_match};

/// How serious a [`Diagnostic`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The rule set is refused.
    Error,
    /// The rule set is accepted, but something looks wrong.
    Warning,
}

/// One problem found while loading rule files, at a 1-based `line:col` of `file`. Problems
/// that concern no position in a file (an unreadable directory) have line and col 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnostic {
    /// The file as shown to the user (for [`RuleSet::load_dir`], the directory joined with the
    /// file's relative path).
    pub file: String,
    /// 1-based line (0 when not about a position).
    pub line: usize,
    /// 1-based column, in characters (0 when not about a position).
    pub col: usize,
    /// What is wrong.
    pub message: String,
    /// Error or warning.
    pub severity: Severity,
}

impl Diagnostic {
    /// Whether this is an error (rather than a warning).
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: ", self.file)?;
        } else {
            write!(f, "{}:{}:{}: ", self.file, self.line, self.col)?;
        }
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        f.write_str(&self.message)
    }
}

/// Where a target delivers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TargetKind {
    /// HTTP POST of the structured CloudEvent.
    Webhook {
        /// `http://` or `https://` URL.
        url: String,
        /// Extra request headers (never secrets; those come from the environment).
        #[serde(default)]
        headers: BTreeMap<String, String>,
        /// Name of the environment variable holding the Standard Webhooks signing secret.
        #[serde(default)]
        secret_env: Option<String>,
        /// Headers whose values are secrets (`Authorization`, an API key): header name → the
        /// name of the environment variable (or secrets-file entry) that holds the value.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        headers_env: BTreeMap<String, String>,
        /// Deliver several events per request, as a CloudEvents batch (opt-in).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        batch: Option<WebhookBatch>,
    },
    /// An uploaded WASM handler.
    Handler {
        /// Handler name.
        name: String,
    },
    /// Publish to a NATS subject.
    Nats {
        /// Subject to publish to.
        subject: String,
    },
}

/// Batched delivery for a webhook: each request carries up to `max_events` due entries as one
/// `application/cloudevents-batch+json` array (as Azure Event Grid's batched delivery does),
/// so a busy target costs one request per batch instead of one per event. The batch succeeds
/// or fails as a whole; each entry keeps its own attempts, backoff and DLQ fate. Entries are
/// batched from what is due when the worker leases; with a `window`, fewer than a full batch
/// wait up to that long for more (as EventBridge Pipes' batching window and Kafka's
/// `linger.ms` do), trading that much delivery latency for fuller, cheaper requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookBatch {
    /// Most events in one request (1–1000).
    pub max_events: u32,
    /// Most bytes of one request's body; an event larger than this goes alone.
    pub max_bytes: u64,
    /// How long fewer than `max_events` due events wait for more before they are sent,
    /// counted from when the oldest of them became due (0: sent at once). Target
    /// configurations saved before this field existed read as 0.
    #[serde(default, with = "crate::policy::config::duration_str")]
    pub window: std::time::Duration,
}

impl WebhookBatch {
    /// `max_events` when not given.
    pub const DEFAULT_MAX_EVENTS: u32 = 100;
    /// `max_bytes` when not given: 1 MiB.
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 20;
    /// The largest `max_events` (as ingest's default batch limit).
    pub const MAX_EVENTS: u32 = 1000;
    /// The smallest `max_bytes`.
    pub const MIN_BYTES: u64 = 1024;
    /// The largest `max_bytes`: 64 MiB.
    pub const MAX_BYTES: u64 = 64 << 20;
    /// The longest `window`: a batch that waits longer than this is a queue, not a batch.
    pub const MAX_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
}

impl TargetKind {
    /// Where it delivers, in one line (`webhook http://…`, `handler name`, `nats subject`):
    /// two targets with the same destination deliver to the same place. A webhook's URL is
    /// in its parsed form (scheme and host lower case, a default port dropped, an empty path
    /// as `/`), as the HTTP client sends it: `HTTP://Host:80` is `http://host/`, and compared
    /// as written the check that keeps a system event from the place it is about let an
    /// alert about a failing receiver go to that same receiver.
    pub fn destination(&self) -> String {
        match self {
            Self::Webhook { url, .. } => match reqwest::Url::parse(url) {
                Ok(parsed) => format!("webhook {parsed}"),
                // The loader refuses such a URL; as written is the best there is.
                Err(_) => format!("webhook {url}"),
            },
            Self::Handler { name } => format!("handler {name}"),
            Self::Nats { subject } => format!("nats {subject}"),
        }
    }

    /// The service it depends on, in one line: a webhook's origin (`webhook
    /// http://host:port`, its paths being one service's endpoints), a handler, a NATS
    /// subject. What `router config explain` sums worst cases over.
    pub fn dependency(&self) -> String {
        match self {
            Self::Webhook { url, .. } => match reqwest::Url::parse(url) {
                Ok(parsed) => format!("webhook {}", parsed.origin().ascii_serialization()),
                Err(_) => format!("webhook {url}"),
            },
            other => other.destination(),
        }
    }

    /// The batching of a webhook that batches.
    pub fn batch(&self) -> Option<&WebhookBatch> {
        match self {
            Self::Webhook { batch, .. } => batch.as_ref(),
            _ => None,
        }
    }
}

/// One delivery target of a rule, with its policy resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetSpec {
    /// Stable id used by queues, metrics and the DLQ: explicit, or `<rule name>-<index>`
    /// (0-based position in the rule's `targets`).
    pub id: String,
    /// Name of the rule that owns the target.
    pub rule: String,
    /// Where it delivers.
    pub kind: TargetKind,
    /// The policy name given in the file (`None` means the default policy).
    pub policy_name: Option<String>,
    /// The resolved policy.
    pub policy: PolicyConfig,
}

/// What one event can cost a target at worst: what `router config explain` prints and
/// `/v1/targets` shows as `worst_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorstCase {
    /// Attempts ([`PolicyConfig::worst_case`]).
    pub attempts: u32,
    /// Time before the DLQ on backoff alone, every attempt running into its timeout (and
    /// first waiting out a batching webhook's `window`).
    pub time: std::time::Duration,
    /// The same with every wait stretched by a `Retry-After` up to `retry_after_max`
    /// ([`PolicyConfig::worst_case_with_retry_after`]).
    pub with_retry_after: std::time::Duration,
    /// When something can stop the whole target (its breaker open, a receiver's
    /// `Retry-After` holding it off): nothing is leased meanwhile, so an entry whose
    /// `max_age` passes then goes to the DLQ only when leasing resumes — `max_age` plus the
    /// longest of `timeout`, the window, `breaker.open_for` and (webhooks) `retry_after_max`.
    /// `None` when nothing can (no breaker, and no Retry-After the target honours).
    pub if_blocked: Option<std::time::Duration>,
}

impl TargetSpec {
    /// The target's worst case. A batching webhook's `window` may hold each attempt back
    /// ([`PolicyConfig::worst_case_lingering`]). Webhooks (429/503) and handlers (a retry
    /// with a delay) can stretch every wait with a `Retry-After`; a NATS publish cannot, so
    /// its `with_retry_after` is the backoff's.
    pub fn worst_case(&self) -> WorstCase {
        let window = self
            .kind
            .batch()
            .map_or(std::time::Duration::ZERO, |b| b.window);
        let (attempts, time) = self.policy.worst_case_lingering(window);
        let with_retry_after = match self.kind {
            TargetKind::Nats { .. } => time,
            _ => self.policy.worst_case_with_retry_after_lingering(window),
        };
        // Only a webhook's 429/503 holds the whole target off; a handler's delay is its
        // event's own retry, scheduled within max_age.
        let hold_off = match self.kind {
            TargetKind::Webhook { .. } => Some(self.policy.retry.retry_after_max),
            _ => None,
        }
        .filter(|d| !d.is_zero());
        let open_for = self.policy.breaker.as_ref().map(|b| b.open_for);
        let if_blocked = open_for.max(hold_off).map(|block| {
            self.policy
                .retry
                .max_age
                .saturating_add(block.max(self.policy.timeout).max(window))
        });
        WorstCase {
            attempts,
            time,
            with_retry_after,
            if_blocked,
        }
    }
}

/// One rule: a pattern and the targets that matching events fan out to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    /// Unique name across the set.
    pub name: String,
    /// Free text.
    pub description: Option<String>,
    /// Disabled rules are loaded and checked but never match.
    pub enabled: bool,
    /// File the rule comes from (relative to the rules directory).
    pub file: String,
    /// 1-based line of the rule in `file`.
    pub line: usize,
    /// The compiled pattern.
    #[serde(skip)]
    pub pattern: Pattern,
    /// The pattern as written (JSON form), for display.
    pub pattern_json: Value,
    /// Ids of the rule's targets, in file order (keys of [`RuleSet::targets`]).
    pub target_ids: Vec<String>,
}

impl Rule {
    /// Whether this rule is enabled and its pattern matches `event`.
    pub fn matches(&self, event: &Value) -> bool {
        self.enabled && self.pattern.matches(event)
    }
}

/// A rule that matched an event, with the targets to fan out to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleMatch {
    /// Rule name.
    pub rule: String,
    /// Target ids, in file order.
    pub target_ids: Vec<String>,
}

/// A complete, checked set of rules, policies and targets.
///
/// The enabled rules' patterns are compiled into one [`CompiledMatcher`] when the set is
/// loaded; [`RuleSet::matches`] goes through it. The set is immutable by design: changing
/// `rules` after loading does not recompile the matcher (load a new set instead).
#[derive(Debug, Clone, Serialize)]
pub struct RuleSet {
    /// First 12 hex digits of SHA-256 over every file's relative path and bytes, in order.
    pub version: String,
    /// Relative paths of the files, sorted.
    pub files: Vec<String>,
    /// Named policies from all files.
    pub policies: BTreeMap<String, PolicyConfig>,
    /// Rules in file order (files sorted by path, rules in document order).
    pub rules: Vec<Rule>,
    /// Every target by id.
    pub targets: BTreeMap<String, TargetSpec>,
    /// The enabled rules' patterns as one automaton (rule indices into `rules`).
    #[serde(skip)]
    matcher: Arc<CompiledMatcher>,
}

impl PartialEq for RuleSet {
    /// Sets are equal when their contents are; the matcher is derived from `rules`.
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version
            && self.files == other.files
            && self.policies == other.policies
            && self.rules == other.rules
            && self.targets == other.targets
    }
}

/// A dependency that several targets deliver to, and what one event that matched all of
/// them could cost it at worst (`router config explain`): the SPEC counts worst cases per
/// dependency, and three targets with 10 attempts each on one receiver are 30 attempts of
/// it per event, each target's own row showing 10.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DependencyCost {
    /// [`TargetKind::dependency`].
    pub dependency: String,
    /// The ids of the targets delivering there (in id order).
    pub targets: Vec<String>,
    /// The rules those targets belong to.
    pub rules: std::collections::BTreeSet<String>,
    /// The sum of their worst-case attempts.
    pub attempts: u32,
    /// The longest of their worst-case times (they deliver in parallel).
    pub time: std::time::Duration,
}

impl RuleSet {
    /// The dependencies that two or more targets deliver to, with their summed worst cases,
    /// by dependency. Whether one event can match every one of them depends on the
    /// patterns; targets of one rule always get the same events.
    pub fn shared_dependencies(&self) -> Vec<DependencyCost> {
        let mut by: BTreeMap<String, DependencyCost> = BTreeMap::new();
        for t in self.targets.values() {
            let dependency = t.kind.dependency();
            let worst = t.worst_case();
            let d = by
                .entry(dependency.clone())
                .or_insert_with(|| DependencyCost {
                    dependency,
                    targets: Vec::new(),
                    rules: Default::default(),
                    attempts: 0,
                    time: std::time::Duration::ZERO,
                });
            d.targets.push(t.id.clone());
            d.rules.insert(t.rule.clone());
            d.attempts = d.attempts.saturating_add(worst.attempts);
            d.time = d.time.max(worst.time);
        }
        by.into_values().filter(|d| d.targets.len() > 1).collect()
    }

    /// A set with no files, rules or targets (what runs before any rules are loaded).
    pub fn empty() -> Self {
        let (set, errors) = RuleSet::assemble(
            version_of(&[]),
            Vec::new(),
            BTreeMap::new(),
            Vec::new(),
            BTreeMap::new(),
        );
        debug_assert!(errors.is_empty());
        set
    }

    /// Builds a set and its matcher from checked parts. Rules the matcher rejects (over a
    /// complexity cap) come back as `(rule index, reason)`; the set then matches nothing.
    pub(crate) fn assemble(
        version: String,
        files: Vec<String>,
        policies: BTreeMap<String, PolicyConfig>,
        rules: Vec<Rule>,
        targets: BTreeMap<String, TargetSpec>,
    ) -> (RuleSet, Vec<(usize, String)>) {
        let enabled: Vec<(usize, &Pattern)> = rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.enabled)
            .map(|(i, r)| (i, &r.pattern))
            .collect();
        let (matcher, errors) = match CompiledMatcher::build(&enabled) {
            Ok(m) => (m, Vec::new()),
            Err(errors) => (CompiledMatcher::empty(), errors),
        };
        let set = RuleSet {
            version,
            files,
            policies,
            rules,
            targets,
            matcher: Arc::new(matcher),
        };
        (set, errors)
    }

    /// Loads every `.yaml`, `.yml` and `.json` file under `dir` (recursively, sorted by
    /// relative path; hidden files and directories and other files are ignored; symlinks to
    /// files and to directories are followed, a loop back into the walk is left out with a
    /// warning, and a symlink that leads nowhere is left out with a warning: see
    /// [`RuleSet::check_dir`] for CI).
    ///
    /// On success returns the set and its warnings. On failure returns every diagnostic
    /// found — all errors, not just the first — with the warnings among them.
    pub fn load_dir(dir: &Path) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
        loader::load_dir(dir, loader::Dangling::Warn, None, &[])
    }

    /// [`RuleSet::load_dir`] for the running router: with `operator_secrets`, the secrets its
    /// configuration names (config key, variable:
    /// [`crate::config::Config::operator_secrets`]), a webhook naming one of them in
    /// `secret_env` or `headers_env` is an error at that name.
    pub fn load_dir_for_config(
        dir: &Path,
        operator_secrets: &[(&'static str, String)],
    ) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
        loader::load_dir(dir, loader::Dangling::Warn, None, operator_secrets)
    }

    /// [`RuleSet::load_dir`] for `router rules check`: a symlink that leads nowhere is an
    /// error (a rule file the set was meant to have), not a warning. With `known_handlers`
    /// (the handlers the deployment will have, e.g. the `*.wasm` files of
    /// `handlers.preload_dir`), a handler target naming none of them is an error at its
    /// `handler:`, found in the same pass as every other problem. Rule files alone cannot
    /// say which handlers exist, since teams upload them over the API; the live router
    /// instead keeps such a target's queue waiting until the handler is uploaded.
    pub fn check_dir(
        dir: &Path,
        known_handlers: Option<&std::collections::BTreeSet<String>>,
    ) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
        loader::load_dir(dir, loader::Dangling::Error, known_handlers, &[])
    }

    /// The version of the rule files under `dir` as they are on disk now (no parsing): equal
    /// to a set's [`RuleSet::version`] when that set is what the directory holds.
    ///
    /// # Errors
    /// The directory or a file in it cannot be read.
    pub fn disk_version(dir: &Path) -> std::io::Result<String> {
        loader::disk_version(dir)
    }

    /// Loads a set from in-memory files: `(path, text)` pairs, where `path` is both what
    /// diagnostics show and what the version hashes. Files are taken in the order given
    /// (pass them sorted); the extension decides JSON (`.json`) or YAML (anything else).
    pub fn from_sources(
        files: &[(&str, &str)],
    ) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
        let inputs: Vec<loader::SourceFile> = files
            .iter()
            .map(|(path, text)| loader::SourceFile {
                display: (*path).to_string(),
                rel: (*path).to_string(),
                text: (*text).to_string(),
            })
            .collect();
        loader::load(&inputs, Vec::new(), None, &[])
    }

    /// The enabled rules whose pattern matches `event` (structured CloudEvent JSON), in
    /// file order, each with its target ids. Goes through the compiled matcher, so the cost
    /// does not grow with the number of rules.
    pub fn matches(&self, event: &Value) -> Vec<RuleMatch> {
        self.rule_matches(self.matcher.matches(event))
    }

    /// [`RuleSet::matches`] on raw JSON bytes, reading only the fields some pattern mentions
    /// (see [`CompiledMatcher::matches_bytes`]).
    pub fn matches_bytes(&self, json: &[u8]) -> Result<Vec<RuleMatch>, MatchError> {
        Ok(self.rule_matches(self.matcher.matches_bytes(json)?))
    }

    /// [`RuleSet::matches`] computed by the pattern interpreter, rule by rule: the reference
    /// the compiled matcher must agree with (for tests and `rules test` cross-checks).
    pub fn matches_interpreted(&self, event: &Value) -> Vec<RuleMatch> {
        self.rules
            .iter()
            .filter(|r| r.matches(event))
            .map(|r| RuleMatch {
                rule: r.name.clone(),
                target_ids: r.target_ids.clone(),
            })
            .collect()
    }

    /// Size of the compiled matcher.
    pub fn matcher_stats(&self) -> MatcherStats {
        self.matcher.stats()
    }

    fn rule_matches(&self, indices: Vec<usize>) -> Vec<RuleMatch> {
        indices
            .into_iter()
            .filter_map(|i| self.rules.get(i))
            .map(|r| RuleMatch {
                rule: r.name.clone(),
                target_ids: r.target_ids.clone(),
            })
            .collect()
    }

    /// [`RuleSet::matches`] for a parsed CloudEvent.
    pub fn matches_event(&self, event: &CloudEvent) -> Vec<RuleMatch> {
        self.rule_matches(self.matcher.matches_event(event))
    }

    /// [`RuleSet::matches_event`], adding the matcher's work to `steps` (see
    /// [`CompiledMatcher::matches_counting`]).
    pub fn matches_event_counting(&self, event: &CloudEvent, steps: &mut u64) -> Vec<RuleMatch> {
        self.rule_matches(self.matcher.matches_event_counting(event, steps))
    }

    /// Bytes of matching work an event of `len` bytes may cost, in units of reading one byte
    /// (see [`CompiledMatcher::cost_per_byte`]): what decides whether its matching leaves the
    /// async reactor.
    pub fn match_cost(&self, len: usize) -> usize {
        let per_byte = usize::try_from(self.matcher.cost_per_byte()).unwrap_or(usize::MAX);
        len.saturating_mul(per_byte)
    }

    /// What `rules test` answers for `event` (structured CloudEvent JSON): the event is
    /// checked as ingest checks it, then matched as the live router matches it. Before, any
    /// JSON was matched as it was: `{"id":"x"}` fired the rules with `exists: false`, `data:
    /// null` matched `exists: true` unlike on the live path, and an event pasted from the
    /// EventBridge docs matched nothing without a word.
    ///
    /// # Errors
    /// Every envelope problem of `event`, each with its JSON pointer (and a hint when it is
    /// an EventBridge event rather than a CloudEvent).
    pub fn test_event(&self, event: Value) -> Result<Vec<RuleMatch>, Vec<FieldError>> {
        let eventbridge = event.get("specversion").is_none()
            && (event.get("detail-type").is_some() || event.get("detail").is_some());
        match crate::ingest::parse::event_from_json(event, "") {
            Ok(ev) => Ok(self.matches_event(&ev)),
            Err(mut errors) => {
                if eventbridge {
                    errors.insert(
                        0,
                        FieldError::new(
                            "",
                            "this looks like an EventBridge event: the router routes \
                             CloudEvents, whose `type` and `data` are EventBridge's \
                             `detail-type` and `detail` (patterns may use either name)",
                        ),
                    );
                }
                Err(errors)
            }
        }
    }

    /// The rule called `name`.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The target with id `id`.
    pub fn target(&self, id: &str) -> Option<&TargetSpec> {
        self.targets.get(id)
    }
}

/// `version` of a set of `(relative path, bytes)` files: the first 12 hex digits of SHA-256
/// over each file's length-prefixed path and length-prefixed content, in order.
pub fn version_of(files: &[(&str, &[u8])]) -> String {
    let mut h = Sha256::new();
    for (path, bytes) in files {
        h.update((path.len() as u64).to_le_bytes());
        h.update(path.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    let mut hex = hex::encode(h.finalize());
    hex.truncate(12);
    hex
}

#[cfg(test)]
mod schema_tests;

#[cfg(test)]
mod destination_tests {
    use super::*;

    fn webhook(url: &str) -> TargetKind {
        TargetKind::Webhook {
            url: url.into(),
            headers: BTreeMap::new(),
            secret_env: None,
            headers_env: BTreeMap::new(),
            batch: None,
        }
    }

    /// Spellings of one URL are one destination; a different path or port is another.
    #[test]
    fn spellings_of_one_webhook_url_are_one_destination() {
        let d = webhook("http://127.0.0.1:19310/hold").destination();
        for same in [
            "HTTP://127.0.0.1:19310/hold",
            "http://127.0.0.1:19310/hold",
            "Http://127.0.0.1:19310/hold",
        ] {
            assert_eq!(webhook(same).destination(), d, "{same}");
        }
        assert_eq!(
            webhook("https://Hooks.Example.COM:443").destination(),
            webhook("https://hooks.example.com/").destination()
        );
        assert_eq!(
            webhook("http://example.com:80/a").destination(),
            webhook("http://example.com/a").destination()
        );
        for other in [
            "http://127.0.0.1:19311/hold",
            "http://127.0.0.1:19310/hold/",
            "http://127.0.0.1:19310/Hold",
            "https://127.0.0.1:19310/hold",
        ] {
            assert_ne!(webhook(other).destination(), d, "{other}");
        }
    }
}

#[cfg(test)]
mod test_event_tests {
    use super::*;
    use serde_json::json;

    const RULES: &str = "rules:\n  - name: no-subject\n    pattern:\n      subject: [{exists: false}]\n    targets:\n      - webhook: http://127.0.0.1:9/a\n  - name: has-data\n    pattern:\n      data: [{exists: true}]\n    targets:\n      - webhook: http://127.0.0.1:9/b\n";

    fn set() -> RuleSet {
        RuleSet::from_sources(&[("r.yaml", RULES)])
            .expect("rules")
            .0
    }

    fn names(m: Vec<RuleMatch>) -> Vec<String> {
        m.into_iter().map(|m| m.rule).collect()
    }

    #[test]
    fn a_value_that_is_not_an_event_is_refused_not_matched() {
        let errors = set()
            .test_event(json!({"id": "x"}))
            .expect_err("no envelope");
        let pointers: Vec<&str> = errors.iter().map(|e| e.pointer.as_str()).collect();
        assert!(pointers.contains(&"/specversion"), "{errors:?}");
        assert!(pointers.contains(&"/source"), "{errors:?}");
        assert!(set().test_event(json!([1, 2])).is_err());
    }

    #[test]
    fn an_event_is_matched_as_the_live_router_matches_it() {
        let ev = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t",
                        "data": null});
        // Ingest drops a null attribute: the live path never sees `data`.
        assert_eq!(names(set().test_event(ev).expect("valid")), ["no-subject"]);
        let ev = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t",
                        "subject": "x", "data": "text"});
        assert_eq!(names(set().test_event(ev).expect("valid")), ["has-data"]);
    }

    #[test]
    fn an_eventbridge_event_is_told_apart() {
        let ev = json!({"version": "0", "id": "1", "detail-type": "Order Placed",
                        "source": "com.shop", "detail": {"total": 5}});
        let errors = set().test_event(ev).expect_err("not a CloudEvent");
        assert!(errors[0].message.contains("EventBridge"), "{errors:?}");
    }
}
