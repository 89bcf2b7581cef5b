//! Loading and checking rule files: turns a directory (or in-memory files) into a
//! [`RuleSet`] for the rule-match stage, or into the full list of `file:line:col` problems.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::automaton;
use super::pattern::Pattern;
use super::source::{self, Node, NodeKind, SourceError};
use super::{
    Diagnostic, Rule, RuleSet, Severity, TargetKind, TargetSpec, WebhookBatch, version_of,
};
use crate::policy::config::uses_month_unit;
use crate::policy::{PolicyConfig, WORST_CASE_ATTEMPTS_SMELL};

/// Whether `c` cannot be in an HTTP header value: what `http::HeaderValue::from_str` refuses
/// (control characters other than tab, and DEL; text beyond ASCII passes).
fn not_in_header_value(c: char) -> bool {
    c.is_ascii_control() && c != '\t'
}

/// `$schema` lets a JSON rule file name its schema (`schemas/rules.schema.json`) for editors;
/// YAML files can use a `# yaml-language-server: $schema=…` comment instead. It is not read.
const FILE_KEYS: &[&str] = &["$schema", "policies", "rules"];
const RULE_KEYS: &[&str] = &["name", "description", "enabled", "pattern", "targets"];
const TARGET_KEYS: &[&str] = &[
    "webhook",
    "handler",
    "nats",
    "id",
    "policy",
    "headers",
    "headers_env",
    "secret_env",
    "batch",
];
const TARGET_KINDS: &[&str] = &["webhook", "handler", "nats"];
/// Policy sections whose fields are checked one by one to locate serde errors.
const POLICY_SECTIONS: &[&str] = &["retry", "breaker", "throttle"];
/// Header names (lower case) that the router sets for every attempt, or that decide how the
/// HTTP message is framed and routed: a rule file's value would truncate or corrupt the body
/// (`content-length: 5` cuts it to five bytes, and the receiver's 200 would record a delivery
/// of a broken event) or contradict the router's own (`content-type`, `idempotency-key`, the
/// signature headers).
const RESERVED_HEADERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-type",
    "content-encoding",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];
/// The Standard Webhooks header namespace (lower case): the router sets `webhook-id`,
/// `-timestamp` and `-signature`, and the rest of the namespace is the specification's to
/// grow; a rule file's `webhook-version` or `webhook-signature-alg` would read, to a
/// receiver, as part of the signature's contract.
const RESERVED_HEADER_PREFIX: &str = "webhook-";
/// Header names (lower case) that carry credentials and so do not belong in git.
const SECRET_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie"];
const SECRET_WORDS: &[&str] = &[
    "token",
    "secret",
    "password",
    "api-key",
    "apikey",
    "signature",
];

/// One rule file to load.
pub(crate) struct SourceFile {
    /// Path as shown in diagnostics.
    pub display: String,
    /// Path relative to the rules directory (hashed into the version, kept in the set).
    pub rel: String,
    /// File content.
    pub text: String,
}

/// How a symlink that leads nowhere is reported: an error for `rules check` (CI), a warning
/// for the running router. A Kubernetes ConfigMap update leaves a removed key's link dangling
/// for a moment (its `..data` swapped, the stale link removed next): refusing that reload
/// would flag a failing reload for a change that is about to be whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dangling {
    /// An error: the set does not load.
    Error,
    /// A warning: the link is left out.
    Warn,
}

/// See [`RuleSet::load_dir`].
pub(crate) fn load_dir(
    dir: &Path,
    dangling: Dangling,
    known_handlers: Option<&std::collections::BTreeSet<String>>,
    operator_secrets: &[(&'static str, String)],
) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
    let dir_display = dir.display().to_string();
    let mut found = Vec::new();
    let mut walked = Walk {
        out: &mut found,
        diags: Vec::new(),
        dangling,
        ancestors: dir.canonicalize().into_iter().collect(),
    };
    let result = walked.walk(dir, "");
    let walk_diags = std::mem::take(&mut walked.diags);
    if let Err(e) = result {
        return Err(vec![Diagnostic {
            file: dir_display,
            line: 0,
            col: 0,
            message: format!("cannot read rules directory: {e}"),
            severity: Severity::Error,
        }]);
    }
    found.sort();
    let mut diags = walk_diags;
    if found.is_empty() {
        diags.push(Diagnostic {
            file: dir_display,
            line: 0,
            col: 0,
            message: "no rule files (.yaml, .yml, .json) found".to_string(),
            severity: Severity::Warning,
        });
    }
    let mut inputs = Vec::new();
    for (rel, path) in found {
        let display = path.display().to_string();
        match fs::read(&path).map(String::from_utf8) {
            Ok(Ok(text)) => inputs.push(SourceFile { display, rel, text }),
            Ok(Err(e)) => diags.push(Diagnostic {
                file: display,
                line: 1,
                col: 1,
                message: format!("file is not valid UTF-8: {e}"),
                severity: Severity::Error,
            }),
            Err(e) => diags.push(Diagnostic {
                file: display,
                line: 0,
                col: 0,
                message: format!("cannot read file: {e}"),
                severity: Severity::Error,
            }),
        }
    }
    load(&inputs, diags, known_handlers, operator_secrets)
}

/// The version (see [`crate::rules::version_of`]) of the rule files under `dir` as they are
/// on disk now, without parsing them: whether the live set is still what the directory
/// holds.
pub(crate) fn disk_version(dir: &Path) -> io::Result<String> {
    let mut found = Vec::new();
    Walk {
        out: &mut found,
        diags: Vec::new(),
        dangling: Dangling::Warn,
        ancestors: dir.canonicalize().into_iter().collect(),
    }
    .walk(dir, "")?;
    found.sort();
    let mut files = Vec::with_capacity(found.len());
    for (rel, path) in found {
        files.push((rel, fs::read(&path)?));
    }
    let hashed: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(rel, bytes)| (rel.as_str(), bytes.as_slice()))
        .collect();
    Ok(version_of(&hashed))
}

/// Whether `name` has a rule file's extension (`.yaml`, `.yml`, `.json`).
pub(crate) fn is_rule_file(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".yaml") || lower.ends_with(".yml") || lower.ends_with(".json")
}

/// A walk of a rules directory: the rule files found, and what it had to say about links.
struct Walk<'a> {
    out: &'a mut Vec<(String, PathBuf)>,
    diags: Vec<Diagnostic>,
    dangling: Dangling,
    /// The directories being walked, resolved: a link back to one of them is a loop.
    ancestors: Vec<PathBuf>,
}

impl Walk<'_> {
    /// Collects the rule files under `dir`. Hidden entries are skipped (`.git`, and the
    /// `..data` and `..<timestamp>` entries of a Kubernetes ConfigMap mount, whose visible
    /// files are links into them). Links are followed, to files and to directories (a
    /// team's rules linked in); one that leads nowhere, or back into the walk, is reported.
    fn walk(&mut self, dir: &Path, prefix: &str) -> io::Result<()> {
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            let path = entry.path();
            let ft = entry.file_type()?;
            if ft.is_dir() {
                self.enter(&path, &rel)?;
            } else if ft.is_file() {
                if is_rule_file(&name) {
                    self.out.push((rel, path));
                }
            } else if ft.is_symlink() {
                match fs::metadata(&path) {
                    Ok(m) if m.is_dir() => self.enter(&path, &rel)?,
                    Ok(m) if m.is_file() && is_rule_file(&name) => self.out.push((rel, path)),
                    Ok(_) => {}
                    // A rule file, or what may have been a directory of them (a name
                    // without an extension); a dangling `README.md` is no rule's business.
                    Err(e) if is_rule_file(&name) || !name.contains('.') => {
                        let to = fs::read_link(&path)
                            .map_or_else(|_| "?".to_string(), |t| t.display().to_string());
                        let (severity, then) = match self.dangling {
                            Dangling::Error => (Severity::Error, ""),
                            Dangling::Warn => (Severity::Warning, "; left out"),
                        };
                        self.diags.push(Diagnostic {
                            file: path.display().to_string(),
                            line: 0,
                            col: 0,
                            message: format!("symlink to {to} leads nowhere ({e}){then}"),
                            severity,
                        });
                    }
                    Err(_) => {}
                }
            }
        }
        Ok(())
    }

    /// Walks subdirectory `path` (a directory or a link to one) unless it leads back into the
    /// walk.
    fn enter(&mut self, path: &Path, rel: &str) -> io::Result<()> {
        let real = path.canonicalize()?;
        if self.ancestors.contains(&real) {
            self.diags.push(Diagnostic {
                file: path.display().to_string(),
                line: 0,
                col: 0,
                message: format!(
                    "symlink loop: {} is a directory this walk is already in; left out",
                    real.display()
                ),
                severity: Severity::Warning,
            });
            return Ok(());
        }
        self.ancestors.push(real);
        let result = self.walk(path, rel);
        self.ancestors.pop();
        result
    }
}

/// Loads already-read files; `diags` holds problems found before parsing. With
/// `known_handlers`, a handler target naming none of them is an error at its `handler:`.
/// `operator_secrets` (config key, variable) are the secrets the router's configuration
/// names: a webhook naming one is an error (see [`crate::config::Config::operator_secrets`]).
pub(crate) fn load(
    files: &[SourceFile],
    diags: Vec<Diagnostic>,
    known_handlers: Option<&std::collections::BTreeSet<String>>,
    operator_secrets: &[(&'static str, String)],
) -> Result<(RuleSet, Vec<Diagnostic>), Vec<Diagnostic>> {
    let mut cx = Cx {
        diags,
        known_handlers,
        operator_secrets,
        secret_uses: Vec::new(),
        pending_secret_uses: Vec::new(),
        policies: BTreeMap::new(),
        policy_locs: HashMap::new(),
        used_policies: HashSet::new(),
        rules: Vec::new(),
        rule_locs: HashMap::new(),
        targets: BTreeMap::new(),
        target_locs: HashMap::new(),
        texts: files
            .iter()
            .map(|f| (f.display.as_str(), f.text.as_str()))
            .collect(),
    };
    let mut parsed = Vec::new();
    for f in files {
        let is_json = f.rel.to_ascii_lowercase().ends_with(".json");
        match source::parse(&f.text, is_json) {
            Ok(Some(node)) => parsed.push((f, node)),
            Ok(None) => {}
            Err(errs) => {
                for SourceError { line, col, message } in errs {
                    cx.push(&f.display, line, col, message, Severity::Error);
                }
            }
        }
    }
    let mut roots = Vec::new();
    for (f, node) in &parsed {
        match node.kind {
            NodeKind::Map(_) => {
                cx.check_keys(&f.display, node, FILE_KEYS, "rule file");
                if let Some(schema) = node.get("$schema") {
                    cx.string(&f.display, schema, "$schema");
                }
                roots.push((*f, node));
            }
            NodeKind::Null => {}
            _ => cx.err(
                &f.display,
                node,
                format!(
                    "a rule file must be a mapping with `policies` and/or `rules`, not {}",
                    node.type_name()
                ),
            ),
        }
    }
    // Policies first: names are global, and rules in any file may use them.
    for (f, root) in &roots {
        if let Some(pols) = root.get("policies") {
            match &pols.kind {
                NodeKind::Map(entries) => {
                    for (k, v) in entries {
                        cx.policy(&f.display, k, v);
                    }
                }
                NodeKind::Null => {}
                _ => cx.err(
                    &f.display,
                    pols,
                    format!(
                        "`policies` must be a mapping of policy name to policy, not {}",
                        pols.type_name()
                    ),
                ),
            }
        }
    }
    for (f, root) in &roots {
        if let Some(rules) = root.get("rules") {
            match &rules.kind {
                NodeKind::Seq(items) => {
                    for item in items {
                        cx.rule(f, item);
                    }
                }
                NodeKind::Null => {}
                _ => cx.err(
                    &f.display,
                    rules,
                    format!("`rules` must be a list of rules, not {}", rules.type_name()),
                ),
            }
        }
    }
    cx.check_secret_destinations();
    let mut unused: Vec<(String, String, usize, usize)> = cx
        .policy_locs
        .iter()
        .filter(|(name, _)| !cx.used_policies.contains(*name))
        .map(|(name, (file, line, col))| (name.clone(), file.clone(), *line, *col))
        .collect();
    unused.sort();
    for (name, file, line, col) in unused {
        cx.push(
            &file,
            line,
            col,
            format!("policy `{name}` is not used by any target"),
            Severity::Warning,
        );
    }

    let hashed: Vec<(&str, &[u8])> = files
        .iter()
        .map(|f| (f.rel.as_str(), f.text.as_bytes()))
        .collect();
    let (set, rejected) = RuleSet::assemble(
        version_of(&hashed),
        files.iter().map(|f| f.rel.clone()).collect(),
        cx.policies,
        cx.rules,
        cx.targets,
    );
    // Per-rule caps were checked with each pattern; what is left is the set-wide state cap.
    for (i, message) in rejected {
        if let Some(rule) = set.rules.get(i) {
            let display = files
                .iter()
                .find(|f| f.rel == rule.file)
                .map_or(rule.file.as_str(), |f| f.display.as_str());
            cx.diags.push(Diagnostic {
                file: display.to_string(),
                line: rule.line,
                col: 1,
                message: format!("rule `{}`: {message}", rule.name),
                severity: Severity::Error,
            });
        }
    }

    let order: HashMap<&str, usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.display.as_str(), i + 1))
        .collect();
    let mut diags = cx.diags;
    diags.sort_by_key(|d| {
        (
            order.get(d.file.as_str()).copied().unwrap_or(0),
            d.line,
            d.col,
        )
    });
    if diags.iter().any(Diagnostic::is_error) {
        return Err(diags);
    }
    Ok((set, diags))
}

/// A location: display file, line, col.
type Loc = (String, usize, usize);

/// A policy as decoded from its node.
enum Decoded {
    /// Every field decoded.
    Whole(PolicyConfig),
    /// Some did not (each reported): the policy made of the fields that did, if they make
    /// one, to check those too.
    Partly(Option<PolicyConfig>),
}

fn loc_str((file, line, col): &Loc) -> String {
    format!("{file}:{line}:{col}")
}

/// Where a webhook reads a secret (`secret_env` or a `headers_env` entry).
struct SecretUse {
    /// The variable (or secrets-file entry) name.
    name: String,
    /// `secret_env` or `headers_env.<header>`.
    field: String,
    loc: Loc,
    /// The target's id (set once it is known).
    target: String,
    /// The origin (scheme, host, port) of the URL the secret is sent to.
    origin: String,
}

/// Loader state across all files.
struct Cx<'a> {
    diags: Vec<Diagnostic>,
    /// The handlers the deployment has (`rules check --handlers`), when known.
    known_handlers: Option<&'a std::collections::BTreeSet<String>>,
    /// The secrets the router's configuration names (config key, variable), when known.
    operator_secrets: &'a [(&'static str, String)],
    /// Every secret a loaded webhook reads, for [`Cx::check_secret_destinations`].
    secret_uses: Vec<SecretUse>,
    /// The uses of the target being read, kept once it loads and its id is known.
    pending_secret_uses: Vec<SecretUse>,
    policies: BTreeMap<String, PolicyConfig>,
    policy_locs: HashMap<String, Loc>,
    used_policies: HashSet<String>,
    rules: Vec<Rule>,
    rule_locs: HashMap<String, Loc>,
    targets: BTreeMap<String, TargetSpec>,
    target_locs: HashMap<String, Loc>,
    /// Each file's text by its display name, for checks that need a scalar as written.
    texts: HashMap<&'a str, &'a str>,
}

impl Cx<'_> {
    fn push(&mut self, file: &str, line: usize, col: usize, message: String, sev: Severity) {
        self.diags.push(Diagnostic {
            file: file.to_string(),
            line,
            col,
            message,
            severity: sev,
        });
    }

    fn err(&mut self, file: &str, at: &Node, message: impl Into<String>) {
        self.push(file, at.line, at.col, message.into(), Severity::Error);
    }

    /// Records that the target being read sends the secret `var` (its `field`, at `at`);
    /// false, after reporting it, when `var` is one the router's configuration uses: a rule
    /// file's author chooses the URL, and would have the router send its NATS credentials
    /// there.
    fn secret_use(&mut self, file: &str, at: &Node, var: &str, field: String) -> bool {
        if let Some((key, _)) = self.operator_secrets.iter().find(|(_, v)| v == var) {
            self.err(
                file,
                at,
                format!(
                    "`{field}` names `{var}`, which the router's configuration uses (`{key}`): a rule file cannot send the router's own credentials to a webhook"
                ),
            );
            return false;
        }
        self.pending_secret_uses.push(SecretUse {
            name: var.to_string(),
            field,
            loc: (file.to_string(), at.line, at.col),
            target: String::new(),
            origin: String::new(),
        });
        true
    }

    /// One secret, one destination: a secret name read by webhooks whose URLs have different
    /// origins is an error at each use whose origin differs from the first use's, naming
    /// both. Without it, any rule file could copy another target's signing secret or
    /// credential (`headers_env: { X-Copy: WEBHOOK_SECRET_ERP }`) into a header to a URL of
    /// its choice. Targets at one origin (paths of one receiver) may share a secret.
    fn check_secret_destinations(&mut self) {
        let mut first: HashMap<&str, &SecretUse> = HashMap::new();
        let mut problems = Vec::new();
        for u in &self.secret_uses {
            match first.get(u.name.as_str()) {
                None => {
                    first.insert(&u.name, u);
                }
                Some(f) if f.origin != u.origin => problems.push((
                    u.loc.clone(),
                    format!(
                        "`{}` names `{}`, which target `{}` already sends to {} (`{}` at {}): a secret goes to one destination only, and target `{}` sends to {}; give each receiver its own secret",
                        u.field,
                        u.name,
                        f.target,
                        f.origin,
                        f.field,
                        loc_str(&f.loc),
                        u.target,
                        u.origin
                    ),
                )),
                Some(_) => {}
            }
        }
        for ((file, line, col), message) in problems {
            self.push(&file, line, col, message, Severity::Error);
        }
    }

    /// The policies a target may name, for its error messages.
    fn defined_policies(&self) -> String {
        if self.policies.is_empty() {
            "no policies are defined".to_string()
        } else {
            let names: Vec<&str> = self.policies.keys().map(String::as_str).collect();
            format!("defined: {}", names.join(", "))
        }
    }

    fn warn(&mut self, file: &str, at: &Node, message: impl Into<String>) {
        self.push(file, at.line, at.col, message.into(), Severity::Warning);
    }

    fn check_keys(&mut self, file: &str, node: &Node, allowed: &[&str], what: &str) {
        for (k, _) in node.as_map().unwrap_or_default() {
            let key = k.as_str().unwrap_or_default();
            if !allowed.contains(&key) {
                self.err(
                    file,
                    k,
                    format!(
                        "unknown key `{key}` in {what} (expected one of: {})",
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    /// A string field, reporting a wrong type.
    fn string<'a>(&mut self, file: &str, node: &'a Node, what: &str) -> Option<&'a str> {
        match node.as_str() {
            Some(s) => Some(s),
            None => {
                self.err(
                    file,
                    node,
                    format!("`{what}` must be a string, not {}", node.type_name()),
                );
                None
            }
        }
    }

    // ---------------------------------------------------------------- policies

    fn policy(&mut self, file: &str, key: &Node, node: &Node) {
        let name = key.as_str().unwrap_or_default().to_string();
        if !valid_name(&name) {
            self.err(file, key, format!("invalid policy name `{name}`"));
        }
        if let Some(first) = self.policy_locs.get(&name) {
            let first = loc_str(first);
            self.err(
                file,
                key,
                format!("duplicate policy `{name}` (first defined at {first})"),
            );
            return;
        }
        self.policy_locs
            .insert(name.clone(), (file.to_string(), key.line, key.col));
        let policy = match self.decode_policy(file, &name, node) {
            Decoded::Whole(p) => p,
            Decoded::Partly(rest) => {
                // The fields that did decode are still checked, so one round of `rules
                // check` reports both kinds of problem.
                for problem in rest
                    .as_ref()
                    .map(PolicyConfig::validate)
                    .unwrap_or_default()
                {
                    let at = problem_node(node, key, &problem);
                    self.err(file, at, format!("policy `{name}`: {problem}"));
                }
                // Keep the name known so targets using it do not add "unknown policy" noise.
                self.policies.insert(name, PolicyConfig::default());
                return;
            }
        };
        let problems = policy.validate();
        for problem in &problems {
            let at = problem_node(node, key, problem);
            self.err(file, at, format!("policy `{name}`: {problem}"));
        }
        self.warn_month_durations(file, node);
        // The worst case of a refused policy is not worth a warning beside its errors.
        let (attempts, _) = policy.worst_case();
        if problems.is_empty() && attempts > WORST_CASE_ATTEMPTS_SMELL {
            let at = node
                .get("retry")
                .and_then(|r| r.get("max_attempts"))
                .unwrap_or(key);
            self.warn(
                file,
                at,
                format!(
                    "worst case {attempts} attempts per event; more than {WORST_CASE_ATTEMPTS_SMELL} is a smell"
                ),
            );
        }
        self.policies.insert(name, policy);
    }

    /// Durations are humantime strings, where `M` is a month and `m` a minute: `max_age: 5M`
    /// waits five months, almost certainly not what was meant, and valid all the same.
    fn warn_month_durations(&mut self, file: &str, policy: &Node) {
        // Durations sit at the policy's top level (`timeout`) or one section down.
        for (k, v) in policy.as_map().unwrap_or_default() {
            match v.as_map() {
                Some(section) => {
                    for (k2, v2) in section {
                        self.warn_month_duration(file, k2, v2);
                    }
                }
                None => self.warn_month_duration(file, k, v),
            }
        }
    }

    fn warn_month_duration(&mut self, file: &str, key: &Node, value: &Node) {
        if let Some(text) = value.as_str().filter(|t| uses_month_unit(t)) {
            let key = key.as_str().unwrap_or_default();
            self.warn(
                file,
                value,
                format!("`{key}: {text}` counts in months (`M`); minutes are `m` or `min`"),
            );
        }
    }

    fn decode_policy(&mut self, file: &str, name: &str, node: &Node) -> Decoded {
        match node.kind {
            NodeKind::Null => return Decoded::Whole(PolicyConfig::default()),
            NodeKind::Map(_) => {}
            _ => {
                self.err(
                    file,
                    node,
                    format!("a policy must be a mapping, not {}", node.type_name()),
                );
                return Decoded::Partly(None);
            }
        }
        let mut json = node.to_json();
        let whole = match serde_json::from_value::<PolicyConfig>(json.clone()) {
            Ok(p) => return Decoded::Whole(p),
            Err(e) => e,
        };
        // Locate the problem(s): decode each field (and each field of the nested sections)
        // on its own; every field has a default, so only the bad ones fail. What fails is
        // taken out of `json`, which then holds the fields that decode.
        let before = self.diags.len();
        for (k, v) in node.as_map().unwrap_or_default() {
            let key = k.as_str().unwrap_or_default();
            let vj = v.to_json();
            let single = serde_json::json!({ key: vj });
            let Err(e) = serde_json::from_value::<PolicyConfig>(single) else {
                continue;
            };
            let inner_before = self.diags.len();
            if POLICY_SECTIONS.contains(&key) {
                for (k2, v2) in v.as_map().unwrap_or_default() {
                    let key2 = k2.as_str().unwrap_or_default();
                    let v2j = v2.to_json();
                    let nested = serde_json::json!({ key: { key2: v2j } });
                    if let Err(e2) = serde_json::from_value::<PolicyConfig>(nested) {
                        self.serde_err(file, name, (k2, v2), Some(key), &e2);
                        if let Some(section) = json.get_mut(key).and_then(Value::as_object_mut) {
                            section.remove(key2);
                        }
                    }
                }
            }
            if self.diags.len() == inner_before {
                self.serde_err(file, name, (k, v), None, &e);
                if let Some(fields) = json.as_object_mut() {
                    fields.remove(key);
                }
            }
        }
        if self.diags.len() == before {
            self.err(file, node, format!("policy `{name}`: {whole}"));
            return Decoded::Partly(None);
        }
        Decoded::Partly(serde_json::from_value(json).ok())
    }

    /// A field of policy `name` that does not decode (`section` is its section, e.g.
    /// `retry`, when nested): the error at the value, or at the key for an unknown one.
    fn serde_err(
        &mut self,
        file: &str,
        name: &str,
        (key, value): (&Node, &Node),
        section: Option<&str>,
        e: &serde_json::Error,
    ) {
        let msg = e.to_string();
        let field = key.as_str().unwrap_or_default();
        if msg.starts_with("unknown field") {
            let within = section.map(|s| format!("{s}: ")).unwrap_or_default();
            self.err(file, key, format!("policy `{name}`: {within}{msg}"));
        } else {
            let path = match section {
                Some(s) => format!("{s}.{field}"),
                None => field.to_string(),
            };
            self.err(file, value, format!("policy `{name}`: {path}: {msg}"));
        }
    }

    // ---------------------------------------------------------------- rules

    fn rule(&mut self, f: &SourceFile, node: &Node) {
        let file = f.display.as_str();
        if node.as_map().is_none() {
            self.err(
                file,
                node,
                format!("a rule must be a mapping, not {}", node.type_name()),
            );
            return;
        }
        self.check_keys(file, node, RULE_KEYS, "rule");
        let mut ok = true;
        let name = match node.get("name") {
            None => {
                self.err(file, node, "rule is missing `name`");
                None
            }
            Some(n) => match self.string(file, n, "name") {
                Some(s) if valid_name(s) => {
                    if let Some(first) = self.rule_locs.get(s) {
                        let first = loc_str(first);
                        self.err(
                            file,
                            n,
                            format!("duplicate rule name `{s}` (first defined at {first})"),
                        );
                        ok = false;
                    } else {
                        self.rule_locs
                            .insert(s.to_string(), (file.to_string(), n.line, n.col));
                    }
                    Some(s.to_string())
                }
                Some(s) => {
                    self.err(
                        file,
                        n,
                        format!(
                            "invalid rule name `{s}`: use a non-empty name without spaces or `/`"
                        ),
                    );
                    None
                }
                None => None,
            },
        };
        let description = match node.get("description") {
            None => None,
            Some(Node {
                kind: NodeKind::Null,
                ..
            }) => None,
            Some(d) => self.string(file, d, "description").map(str::to_string),
        };
        let enabled = match node.get("enabled") {
            None => true,
            Some(Node {
                kind: NodeKind::Bool(b),
                ..
            }) => *b,
            Some(other) => {
                self.err(
                    file,
                    other,
                    format!("`enabled` must be true or false, not {}", other.type_name()),
                );
                true
            }
        };
        let compiled = match node.get("pattern") {
            None => {
                self.err(file, node, "rule is missing `pattern`");
                None
            }
            Some(p) => self.pattern(file, p),
        };
        let mut target_ids = Vec::new();
        match node.get("targets") {
            None => self.err(file, node, "rule is missing `targets`"),
            Some(t) => match &t.kind {
                NodeKind::Seq(items) if items.is_empty() => {
                    self.err(file, t, "rule has no targets (`targets` is empty)")
                }
                NodeKind::Seq(items) => {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(id) = self.target(file, name.as_deref(), i, item) {
                            target_ids.push(id);
                        }
                    }
                }
                _ => self.err(
                    file,
                    t,
                    format!("`targets` must be a list, not {}", t.type_name()),
                ),
            },
        }
        if let (true, Some(name), Some((pattern, pattern_json))) = (ok, name, compiled) {
            self.rules.push(Rule {
                name,
                description,
                enabled,
                file: f.rel.clone(),
                line: node.line,
                pattern,
                pattern_json,
                target_ids,
            });
        }
    }

    fn pattern(&mut self, file: &str, p: &Node) -> Option<(Pattern, Value)> {
        let json = p.to_json();
        match Pattern::compile(&json) {
            Ok(pattern) => match automaton::check_pattern(&pattern) {
                Ok(()) => {
                    for w in crate::rules::pattern::warnings(&json) {
                        let at = p.at_pointer(&w.pointer);
                        self.warn(file, at, format!("pattern {}: {}", w.pointer, w.message));
                    }
                    Some((pattern, json))
                }
                Err(msg) => {
                    self.err(file, p, format!("pattern: {msg}"));
                    None
                }
            },
            Err(errs) => {
                for e in errs {
                    let at = p.at_pointer(&e.pointer);
                    let msg = if e.pointer.is_empty() {
                        format!("pattern: {}", e.message)
                    } else {
                        format!("pattern {}: {}", e.pointer, e.message)
                    };
                    self.err(file, at, msg);
                }
                None
            }
        }
    }

    /// Target `index` of rule `rule` (`None`: the rule has no valid name, already reported;
    /// its targets are checked, but one without an `id` has none to register under).
    fn target(
        &mut self,
        file: &str,
        rule: Option<&str>,
        index: usize,
        node: &Node,
    ) -> Option<String> {
        self.pending_secret_uses.clear();
        if node.as_map().is_none() {
            self.err(
                file,
                node,
                format!("a target must be a mapping, not {}", node.type_name()),
            );
            return None;
        }
        self.check_keys(file, node, TARGET_KEYS, "target");
        let kinds: Vec<(&Node, &Node)> = node
            .as_map()
            .unwrap_or_default()
            .iter()
            .filter(|(k, _)| TARGET_KINDS.contains(&k.as_str().unwrap_or_default()))
            .map(|(k, v)| (k, v))
            .collect();
        let mut ok = true;
        let kind = match kinds.as_slice() {
            [] => {
                self.err(
                    file,
                    node,
                    "a target needs exactly one of `webhook`, `handler` or `nats`",
                );
                None
            }
            [(k, v)] => self.target_kind(file, node, k.as_str().unwrap_or_default(), v),
            [(k1, _), (k2, _), ..] => {
                self.err(
                    file,
                    k2,
                    format!(
                        "a target has exactly one kind; this one has both `{}` and `{}`",
                        k1.as_str().unwrap_or_default(),
                        k2.as_str().unwrap_or_default()
                    ),
                );
                None
            }
        };
        let is_webhook = matches!(kind, Some(TargetKind::Webhook { .. }))
            || kinds.iter().any(|(k, _)| k.as_str() == Some("webhook"));
        for only_webhook in ["headers", "headers_env", "secret_env", "batch"] {
            if !is_webhook && let Some(k) = node.key_node(only_webhook) {
                self.err(
                    file,
                    k,
                    format!("`{only_webhook}` applies to webhook targets only"),
                );
                ok = false;
            }
        }
        let (id, id_node) = match node.get("id") {
            // A rule without a name gives its targets no derived ids (`<unnamed>-0` for two
            // such rules cascaded into "duplicate target id"): the rest is still checked.
            None if rule.is_none() => (String::new(), node),
            None => (format!("{}-{index}", rule.unwrap_or_default()), node),
            Some(n) => match self.string(file, n, "id") {
                Some(s) if valid_name(s) => (s.to_string(), n),
                Some(s) => {
                    self.err(
                        file,
                        n,
                        format!(
                            "invalid target id `{s}`: use a non-empty id without spaces or `/`"
                        ),
                    );
                    return None;
                }
                None => return None,
            },
        };
        if id == crate::store::NO_TARGET {
            self.err(
                file,
                id_node,
                format!(
                    "target id `{id}` is reserved: metrics and the DLQ API name dead letters without a target so"
                ),
            );
            return None;
        }
        if let Some(prefix) = RESERVED_TARGET_PREFIXES
            .iter()
            .find(|p| id.starts_with(**p))
        {
            // Target states and operators' pause and rule records share one key space.
            let what = if node.get("id").is_some() {
                "set an id"
            } else {
                "rename the rule or set an id"
            };
            self.err(
                file,
                id_node,
                format!(
                    "target id `{id}` starts with `{prefix}`, which is kept for operators' pause and rule records: {what} without it"
                ),
            );
            ok = false;
        }
        if let (Some(TargetKind::Handler { name }), Some(known), Some((_, at))) =
            (&kind, self.known_handlers, kinds.first())
            && !known.contains(name)
        {
            let known_list = if known.is_empty() {
                "none".to_string()
            } else {
                known
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let target = match (rule, id.is_empty()) {
                (Some(rule), false) => format!("rule `{rule}`, target `{id}`: "),
                _ => String::new(),
            };
            self.err(
                file,
                at,
                format!("{target}no handler named `{name}` (known: {known_list})"),
            );
            ok = false;
        }
        if id.is_empty() {
            // No id to register (an unnamed rule's).
        } else if let Some(first) = self.target_locs.get(&id) {
            let first = loc_str(first);
            self.err(
                file,
                id_node,
                format!("duplicate target id `{id}` (first used at {first})"),
            );
            ok = false;
        } else {
            self.target_locs
                .insert(id.clone(), (file.to_string(), id_node.line, id_node.col));
        }
        let (policy_name, policy) = match node.get("policy") {
            None => (None, PolicyConfig::default()),
            // `policy:` with nothing after it: say what to write rather than "not null".
            Some(n) if matches!(n.kind, NodeKind::Null) => {
                let names = self.defined_policies();
                self.err(
                    file,
                    n,
                    format!(
                        "`policy` is empty: name a policy ({names}), or remove the key for the default policy"
                    ),
                );
                return None;
            }
            Some(n) => match self.string(file, n, "policy") {
                Some(p) => match self.policies.get(p) {
                    Some(policy) => {
                        self.used_policies.insert(p.to_string());
                        (Some(p.to_string()), policy.clone())
                    }
                    None => {
                        let hint = self.defined_policies();
                        self.err(file, n, format!("unknown policy `{p}` ({hint})"));
                        return None;
                    }
                },
                None => return None,
            },
        };
        let kind = kind?;
        if !ok {
            return None;
        }
        for mut u in std::mem::take(&mut self.pending_secret_uses) {
            u.target.clone_from(&id);
            self.secret_uses.push(u);
        }
        self.targets.insert(
            id.clone(),
            TargetSpec {
                id: id.clone(),
                rule: rule?.to_string(),
                kind,
                policy_name,
                policy,
            },
        );
        Some(id)
    }

    /// A webhook's `batch: { max_events, max_bytes, window }`, each optional, checked against
    /// its bounds; `None` after reporting what is wrong.
    fn webhook_batch(&mut self, file: &str, node: &Node) -> Option<WebhookBatch> {
        let Some(entries) = node.as_map() else {
            self.err(
                file,
                node,
                format!(
                    "`batch` must be a mapping such as `{{ max_events: 100 }}`, not {}",
                    node.type_name()
                ),
            );
            return None;
        };
        let mut batch = WebhookBatch {
            max_events: WebhookBatch::DEFAULT_MAX_EVENTS,
            max_bytes: WebhookBatch::DEFAULT_MAX_BYTES,
            window: std::time::Duration::ZERO,
        };
        let mut ok = true;
        for (k, v) in entries {
            let key = k.as_str().unwrap_or_default();
            if key == "window" {
                match self.batch_window(file, v) {
                    Some(w) => batch.window = w,
                    None => ok = false,
                }
                continue;
            }
            let (lo, hi) = match key {
                "max_events" => (1, u64::from(WebhookBatch::MAX_EVENTS)),
                "max_bytes" => (WebhookBatch::MIN_BYTES, WebhookBatch::MAX_BYTES),
                _ => {
                    self.err(
                        file,
                        k,
                        format!(
                            "unknown key `batch.{key}` (expected `max_events`, `max_bytes` or `window`)"
                        ),
                    );
                    ok = false;
                    continue;
                }
            };
            match &v.kind {
                NodeKind::Number(n) if n.as_u64().is_some_and(|n| (lo..=hi).contains(&n)) => {
                    let n = n.as_u64().unwrap_or_default();
                    if key == "max_events" {
                        batch.max_events = u32::try_from(n).unwrap_or(WebhookBatch::MAX_EVENTS);
                    } else {
                        batch.max_bytes = n;
                    }
                }
                _ => {
                    self.err(
                        file,
                        v,
                        format!("`batch.{key}` must be an integer from {lo} to {hi}"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(batch)
    }

    /// `batch.window`: a humantime duration up to `WebhookBatch::MAX_WINDOW`.
    fn batch_window(&mut self, file: &str, v: &Node) -> Option<std::time::Duration> {
        let Some(text) = v.as_str() else {
            self.err(
                file,
                v,
                format!(
                    "`batch.window` must be a duration such as `20ms`, not {}",
                    v.type_name()
                ),
            );
            return None;
        };
        let message = match humantime::parse_duration(text) {
            // (A month, `1M`, is past the bound, so no month warning is needed here.)
            Ok(d) if d <= WebhookBatch::MAX_WINDOW => return Some(d),
            Ok(_) => format!(
                "`batch.window: {text}` is longer than the most a batch may wait, {}",
                crate::policy::config::format_duration(WebhookBatch::MAX_WINDOW)
            ),
            Err(e) => {
                format!("`batch.window: {text}` is not a duration such as `20ms` or `1s`: {e}")
            }
        };
        self.err(file, v, message);
        None
    }

    fn target_kind(
        &mut self,
        file: &str,
        target: &Node,
        kind: &str,
        v: &Node,
    ) -> Option<TargetKind> {
        let value = self.string(file, v, kind)?;
        match kind {
            "webhook" => {
                let mut ok = true;
                if let Err(msg) = check_url(value) {
                    self.err(file, v, msg);
                    ok = false;
                }
                let mut headers = BTreeMap::new();
                if let Some(h) = target.get("headers") {
                    match h.as_map() {
                        Some(entries) => {
                            for (k, hv) in entries {
                                let name = k.as_str().unwrap_or_default();
                                if let Some(msg) = header_name_problem(name) {
                                    self.err(file, k, msg);
                                    ok = false;
                                    continue;
                                }
                                let val = match &hv.kind {
                                    NodeKind::Str(s) => s.clone(),
                                    // YAML reads `0x10`, `0o20` or `+16` as 16, which is
                                    // what would be sent: not what the file says.
                                    NodeKind::Number(i) if !i.is_f64() => {
                                        let decimal = i.to_string();
                                        let written = self
                                            .texts
                                            .get(file)
                                            .map(|t| scalar_as_written(t, hv.line, hv.col));
                                        match written {
                                            Some(w) if w != decimal => {
                                                self.err(
                                                    file,
                                                    hv,
                                                    format!(
                                                        "header `{name}`: quote the value (\"…\"): `{w}` is the number {decimal}, and would be sent as `{decimal}`"
                                                    ),
                                                );
                                                ok = false;
                                                continue;
                                            }
                                            _ => decimal,
                                        }
                                    }
                                    NodeKind::Bool(b) => b.to_string(),
                                    // Sent as text, a float would not be what the file says:
                                    // `1.0` renders as `1`, `2.50` as `2.5`.
                                    NodeKind::Number(x) => {
                                        self.err(
                                            file,
                                            hv,
                                            format!(
                                                "header `{name}`: quote the value (\"…\"): as a number it would be sent as `{}`",
                                                x
                                            ),
                                        );
                                        ok = false;
                                        continue;
                                    }
                                    _ => {
                                        self.err(
                                            file,
                                            hv,
                                            format!(
                                                "header `{name}` must have a string value, not {}",
                                                hv.type_name()
                                            ),
                                        );
                                        ok = false;
                                        continue;
                                    }
                                };
                                // The HTTP client's own check (`HeaderValue::from_str`, which the
                                // webhook target applies when it starts): a control character
                                // other than tab (CR, LF, NUL, VT, DEL...) passed `rules check`
                                // and then kept the target from starting.
                                if let Some(c) = val.chars().find(|&c| not_in_header_value(c)) {
                                    let what = if matches!(c, '\r' | '\n') {
                                        "a line break".to_string()
                                    } else {
                                        format!("the control character U+{:04X}", u32::from(c))
                                    };
                                    self.err(
                                        file,
                                        hv,
                                        format!("header `{name}` value contains {what}, which an HTTP header cannot carry"),
                                    );
                                    ok = false;
                                    continue;
                                }
                                // A credential in a file kept in git is readable by
                                // everyone who can read the repository (and the API shows
                                // the headers): the plain credential headers are refused, and
                                // names that merely look like one are warned about.
                                if SECRET_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
                                    self.err(
                                        file,
                                        k,
                                        format!(
                                            "header `{name}` carries a credential: name the environment variable (or secrets-file entry) that holds it under `headers_env: {{ {name}: VAR }}` instead of writing it in a rule file"
                                        ),
                                    );
                                    ok = false;
                                    continue;
                                }
                                if looks_secret(name) {
                                    self.warn(
                                        file,
                                        k,
                                        format!(
                                            "header `{name}` looks like a credential; secrets must come from the environment or the secrets file (`headers_env`), not rule files"
                                        ),
                                    );
                                }
                                headers.insert(name.to_string(), val);
                            }
                        }
                        None => {
                            self.err(
                                file,
                                h,
                                format!(
                                    "`headers` must be a mapping of name to value, not {}",
                                    h.type_name()
                                ),
                            );
                            ok = false;
                        }
                    }
                }
                let mut headers_env = BTreeMap::new();
                if let Some(h) = target.get("headers_env") {
                    match h.as_map() {
                        Some(entries) => {
                            for (k, hv) in entries {
                                let name = k.as_str().unwrap_or_default();
                                let twice = headers
                                    .keys()
                                    .any(|h: &String| h.eq_ignore_ascii_case(name));
                                let problem = header_name_problem(name).or_else(|| {
                                    twice.then(|| {
                                        format!(
                                            "header `{name}` is in both `headers` and `headers_env`: keep one"
                                        )
                                    })
                                });
                                if let Some(msg) = problem {
                                    self.err(file, k, msg);
                                    ok = false;
                                    continue;
                                }
                                match hv.as_str() {
                                    Some(var) if valid_env_name(var) => {
                                        let field = format!("headers_env.{name}");
                                        if !self.secret_use(file, hv, var, field) {
                                            ok = false;
                                            continue;
                                        }
                                        headers_env.insert(name.to_string(), var.to_string());
                                    }
                                    _ => {
                                        self.err(
                                            file,
                                            hv,
                                            format!(
                                                "`headers_env.{name}` must name an environment variable (letters, digits, `_`; not `ROUTER_…`, which configures the router) that holds the header's value"
                                            ),
                                        );
                                        ok = false;
                                    }
                                }
                            }
                        }
                        None => {
                            self.err(
                                file,
                                h,
                                format!(
                                    "`headers_env` must be a mapping of header name to environment variable, not {}",
                                    h.type_name()
                                ),
                            );
                            ok = false;
                        }
                    }
                }
                let secret_env = match target.get("secret_env") {
                    None => None,
                    Some(n) => match self.string(file, n, "secret_env") {
                        Some(s) if valid_env_name(s) => {
                            ok &= self.secret_use(file, n, s, "secret_env".to_string());
                            Some(s.to_string())
                        }
                        Some(s) => {
                            self.err(
                                file,
                                n,
                                format!(
                                    "`secret_env` must name an environment variable (letters, digits, `_`; not `ROUTER_…`, which configures the router), not `{s}`"
                                ),
                            );
                            ok = false;
                            None
                        }
                        None => {
                            ok = false;
                            None
                        }
                    },
                };
                let batch = match target.get("batch") {
                    None => None,
                    Some(b) => {
                        let parsed = self.webhook_batch(file, b);
                        ok &= parsed.is_some();
                        parsed
                    }
                };
                // Where the secrets go: the URL's origin, as the HTTP client parses it.
                match reqwest::Url::parse(value) {
                    Ok(parsed) if ok => {
                        let origin = parsed.origin().ascii_serialization();
                        for u in &mut self.pending_secret_uses {
                            u.origin.clone_from(&origin);
                        }
                    }
                    _ => ok = false,
                }
                ok.then(|| TargetKind::Webhook {
                    url: value.to_string(),
                    headers,
                    secret_env,
                    headers_env,
                    batch,
                })
            }
            "handler" => {
                // The upload API's rule, not the generic name's: a name no handler can be
                // uploaded under would pass the check and its events wait until max_age.
                if crate::wasm::valid_handler_name(value) {
                    Some(TargetKind::Handler {
                        name: value.to_string(),
                    })
                } else {
                    self.err(
                        file,
                        v,
                        format!(
                            "invalid handler name `{value}`: handler names are 1 to 64 characters of a-z, 0-9, '_' and '-', starting with a letter or digit (no handler can be uploaded under any other)"
                        ),
                    );
                    None
                }
            }
            _ => match check_subject(value) {
                Ok(()) => Some(TargetKind::Nats {
                    subject: value.to_string(),
                }),
                Err(msg) => {
                    self.err(file, v, msg);
                    None
                }
            },
        }
    }
}

/// The node a policy problem is about: the dotted path its message starts with
/// (`retry.base_delay ...`), as deep as it exists in the file, else the policy's name.
fn problem_node<'a>(policy: &'a Node, key: &'a Node, problem: &str) -> &'a Node {
    let path = problem.split_whitespace().next().unwrap_or_default();
    let mut found = key;
    let mut cur = policy;
    for seg in path.split('.') {
        match cur.get(seg) {
            Some(n) => {
                found = n;
                cur = n;
            }
            None => break,
        }
    }
    found
}

/// Names of rules, targets, policies and handlers: non-empty, at most 200 bytes, no
/// whitespace, control characters or `/` (they appear in URLs, metrics and logs).
/// Target id prefixes the store's target-state records keep for operators' records
/// (`deliver::PAUSE_STATE_PREFIX`, `app::RULE_STATE_PREFIX`): a target named so would read
/// another's pause or write over it.
const RESERVED_TARGET_PREFIXES: [&str; 2] = [
    crate::deliver::PAUSE_STATE_PREFIX,
    crate::app::RULE_STATE_PREFIX,
];

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 200
        && !s
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '/')
}

/// A variable name a rule file may take a secret from. Not `ROUTER_…`: every such variable
/// is read as a configuration key at start, and a secret there stops the router with
/// "unknown field".
fn valid_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with("ROUTER_")
}

/// The plain scalar that starts at 1-based `line`:`col` of `text`, as written (up to the
/// first character that ends a plain scalar in flow or block context).
fn scalar_as_written(text: &str, line: usize, col: usize) -> &str {
    let Some(l) = text.lines().nth(line.saturating_sub(1)) else {
        return "";
    };
    let start = l
        .char_indices()
        .nth(col.saturating_sub(1))
        .map_or(l.len(), |(i, _)| i);
    let rest = &l[start..];
    let end = rest
        .find(|c: char| c.is_whitespace() || matches!(c, ',' | '}' | ']' | '#'))
        .unwrap_or(rest.len());
    &rest[..end]
}

fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
}

/// What is wrong with `name` as a header a rule file sets (in `headers` or `headers_env`):
/// not a header name, or one the router sets itself or that frames the request.
fn header_name_problem(name: &str) -> Option<String> {
    if !valid_header_name(name) {
        Some(format!("invalid header name `{name}`"))
    } else if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
        Some(format!(
            "header `{name}` is set by the router (or frames the request) and cannot be set in a rule file"
        ))
    } else if name
        .to_ascii_lowercase()
        .starts_with(RESERVED_HEADER_PREFIX)
    {
        Some(format!(
            "header `{name}` is in the Standard Webhooks namespace (`webhook-*`), which the router's signature headers own, and cannot be set in a rule file"
        ))
    } else {
        None
    }
}

fn looks_secret(header: &str) -> bool {
    let h = header.to_ascii_lowercase();
    SECRET_HEADERS.contains(&h.as_str()) || SECRET_WORDS.iter().any(|w| h.contains(w))
}

/// Minimal absolute-URL check: `http`/`https` scheme, a host, an optional numeric port, no
/// credentials and no whitespace.
fn check_url(url: &str) -> Result<(), String> {
    // Every message shows the URL with its credentials cut out: they land in CI logs, the
    // router's log and `/v1/status`, whichever other mistake the URL has.
    let shown = redact_userinfo(url);
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("webhook URL `{shown}` contains whitespace"));
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!(
            "webhook URL `{shown}` must be an absolute http:// or https:// URL"
        ));
    };
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        // The scheme is echoed only when it looks like one: in `user:pw@host://…` it is the
        // credentials.
        let looks_like_scheme = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        return Err(if looks_like_scheme {
            format!("webhook URL `{shown}` must use http or https, not `{scheme}`")
        } else {
            format!("webhook URL `{shown}` must use http or https")
        });
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        // `secret_env` is the signing secret, not a credential the receiver checks; the hint
        // names the header way.
        return Err(format!(
            "webhook URL `{shown}` must not contain credentials (a rule file is kept in git); send them as a header from the environment or the secrets file, e.g. `headers_env: {{ Authorization: WEBHOOK_SECRET_… }}` holding `Basic <base64 of user:password>`"
        ));
    }
    let bad_host = || format!("webhook URL `{shown}` has an invalid host");
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, "")) if h.parse::<std::net::Ipv6Addr>().is_ok() => (h, None),
            Some((h, rest)) if h.parse::<std::net::Ipv6Addr>().is_ok() => {
                (h, Some(rest.strip_prefix(':').ok_or_else(bad_host)?))
            }
            _ => return Err(bad_host()),
        }
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(format!("webhook URL `{shown}` has no host"));
    }
    if let Some(p) = port
        && (p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()) || p.parse::<u16>().is_err())
    {
        return Err(format!("webhook URL `{shown}` has an invalid port"));
    }
    // What the HTTP client will parse it with: a host it refuses (`exa<mple.com`, `bad%host`)
    // is refused here rather than failing every attempt.
    if let Err(e) = reqwest::Url::parse(url) {
        return Err(format!("webhook URL `{shown}` is not a valid URL: {e}"));
    }
    Ok(())
}

/// `url` as messages show it: from after the scheme's `://` (or from the start, without one)
/// to its last `@` replaced by `…`. The last `@` of the whole URL, not of the authority as a
/// parser would cut it: a password written with an unescaped `/`, `?` or `#` moves where the
/// authority ends (`http://erp:pa/ss@host/` reads as host `erp`, port `pa`), and its tail
/// would be echoed by the "invalid port" message. An `@` in a path or query hides more of a
/// URL than needed, in a message that still says what is wrong.
fn redact_userinfo(url: &str) -> std::borrow::Cow<'_, str> {
    let Some(at) = url.rfind('@') else {
        return url.into();
    };
    let start = url
        .find("://")
        .map(|i| i + "://".len())
        .filter(|&s| s <= at)
        .unwrap_or(0);
    format!("{}…{}", &url[..start], &url[at..]).into()
}

/// A NATS subject to publish to: dot-separated non-empty tokens, no whitespace, no wildcards,
/// and none of the server's own namespaces: a first token starting with `$` (`$JS.API.…`
/// is the JetStream API, where an event published to `$JS.API.STREAM.DELETE.X` deletes a
/// stream; `$KV.…` writes a key-value bucket; `$SYS.…` the system account) or `_INBOX`
/// (other clients' reply subjects, where an event would answer someone else's request).
fn check_subject(s: &str) -> Result<(), String> {
    if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("invalid NATS subject `{s}`"));
    }
    let first = s.split('.').next().unwrap_or_default();
    if first.starts_with('$') {
        return Err(format!(
            "NATS subject `{s}` is in the server's reserved `$` namespace (the JetStream API, key-value buckets, the system account): a target publishes to an application subject"
        ));
    }
    if first == "_INBOX" {
        return Err(format!(
            "NATS subject `{s}` is a reply inbox (`_INBOX.…`): a target publishes to an application subject, not into other clients' replies"
        ));
    }
    for token in s.split('.') {
        if token.is_empty() {
            return Err(format!("NATS subject `{s}` has an empty token"));
        }
        if token == "*" || token == ">" {
            return Err(format!(
                "NATS subject `{s}` contains the wildcard `{token}`; targets publish to a concrete subject"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
