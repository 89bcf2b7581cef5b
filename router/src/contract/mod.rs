//! Pipeline stage 2 (envelope check → **contract** → rule match): versioned JSON Schema
//! contracts for the `data` of each (`type`, `dataversion`), loaded from a directory of
//! `<type>/v<N>.json` files plus an optional `modes.toml`, and checked per event.

mod compat;
mod fanout;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::Path;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use jsonschema::{Draft, Validator};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::{CloudEvent, FieldError};

use crate::text_pos::{JsonPositions, Lines};
pub use compat::check_compatibility;
pub(crate) use compat::{Issue as CompatIssue, compat_issues, in_place_issues};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// Name of the optional per-type mode file at the root of a contracts directory.
pub const MODES_FILE: &str = "modes.toml";

/// Directory nesting `load_dir` descends into (only `<type>/v<N>.json` is valid; deeper
/// `.json` files are reported, not silently skipped).
const MAX_DIR_DEPTH: usize = 4;

/// Base64 (standard alphabet), padding optional, as the ingest parser accepts it.
const BASE64_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// What happens to an event of a type whose `data` breaks its contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContractMode {
    /// 422 to the producer with the validation errors; nothing stored.
    Enforce,
    /// 202, stored in the DLQ with the reason; never routed or retried.
    #[default]
    Quarantine,
    /// Contracts for the type are not checked.
    Off,
}

impl ContractMode {
    /// The name used in `modes.toml` and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            ContractMode::Enforce => "enforce",
            ContractMode::Quarantine => "quarantine",
            ContractMode::Off => "off",
        }
    }
}

impl fmt::Display for ContractMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an event failed its contract (also the DLQ reason class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationReason {
    /// `data` does not validate against the schema (or is not JSON).
    ContractViolation,
    /// The type has contracts, but none for the event's `dataversion`.
    UnknownVersion,
}

impl ViolationReason {
    /// `"contract_violation"` or `"unknown_version"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ViolationReason::ContractViolation => "contract_violation",
            ViolationReason::UnknownVersion => "unknown_version",
        }
    }
}

impl fmt::Display for ViolationReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Result of checking one event against the contract set.
#[derive(Debug, Clone, PartialEq)]
pub enum ContractOutcome {
    /// `data` validated, or the type has no contract, or its mode is `off`.
    Pass,
    /// The event breaks its type's contract.
    Violation {
        /// `Enforce` or `Quarantine` (never `Off`).
        mode: ContractMode,
        /// Which kind of violation.
        reason: ViolationReason,
        /// Every problem, pointers relative to the event (`/data/...`, `/dataversion`).
        errors: Vec<FieldError>,
    },
}

/// A problem found while loading contracts, located in a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContractDiagnostic {
    /// The file (path under the loaded directory, or the relative name given to `from_files`).
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column (characters).
    pub col: usize,
    /// What is wrong.
    pub message: String,
    /// Where in the schema, as a JSON pointer ("" when the problem is not at one place in it).
    pub pointer: String,
}

impl ContractDiagnostic {
    fn new(file: &str, (line, col): (usize, usize), message: impl Into<String>) -> Self {
        Self {
            file: file.to_owned(),
            line,
            col,
            message: message.into(),
            pointer: String::new(),
        }
    }

    fn at_pointer(mut self, pointer: &str) -> Self {
        self.pointer = pointer.to_owned();
        self
    }
}

impl fmt::Display for ContractDiagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

/// Description of one loaded contract (for `/v1/contracts` and the CLI).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContractInfo {
    /// The event `type`.
    pub ty: String,
    /// The `dataversion` it applies to.
    pub version: u32,
    /// Relative path, e.g. `order.created/v2.json`.
    pub file: String,
    /// The schema as loaded.
    pub schema: Value,
}

struct Contract {
    /// Relative path (`order.created/v2.json`).
    file: String,
    /// Name used in diagnostics (path under the loaded directory).
    display: String,
    text: String,
    schema: Value,
    /// Decides valid or not, at full speed.
    validator: Validator,
    /// The same schema with a step counter in every subschema: lists the errors of data that
    /// failed, within [`MAX_VALIDATION_STEPS`] (see [`bounded_errors`]).
    counted: Validator,
}

/// An immutable, compiled set of contracts and modes. `Send + Sync`; share it behind an `Arc`
/// and swap the `Arc` on reload.
pub struct ContractSet {
    types: BTreeMap<String, BTreeMap<u32, Contract>>,
    modes: BTreeMap<String, ContractMode>,
    version: String,
}

impl fmt::Debug for ContractSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let types: BTreeMap<&str, Vec<u32>> = self
            .types
            .iter()
            .map(|(t, v)| (t.as_str(), v.keys().copied().collect()))
            .collect();
        f.debug_struct("ContractSet")
            .field("version", &self.version)
            .field("types", &types)
            .field("modes", &self.modes)
            .finish()
    }
}

/// One input file: path relative to the contracts root, name for diagnostics, contents.
struct Source {
    rel: String,
    display: String,
    text: String,
}

impl ContractSet {
    /// A set with no contracts: every event passes.
    pub fn empty() -> Self {
        Self {
            types: BTreeMap::new(),
            modes: BTreeMap::new(),
            version: content_hash(&[]),
        }
    }

    /// Loads a contracts directory: `<type>/v<N>.json` files and an optional root `modes.toml`.
    /// Hidden entries and non-`.json` files (README, notes…) are ignored.
    ///
    /// # Errors
    /// Every problem found (unreadable files, bad names, invalid JSON, schemas that do not
    /// compile, invalid `modes.toml`), each with file, line and column.
    pub fn load_dir(dir: &Path) -> Result<ContractSet, Vec<ContractDiagnostic>> {
        let mut sources = Vec::new();
        let mut modes = None;
        let mut diags = Vec::new();
        collect_dir(dir, dir, "", 0, &mut sources, &mut modes, &mut diags);
        Self::build_collected(sources, modes, diags)
    }

    /// Loads a contracts directory as it would be with `files` (`(relative path, text)`, as
    /// for [`ContractSet::from_files`]) written into it, without writing them: to learn
    /// whether a change would load before making it. A missing directory holds only `files`.
    ///
    /// # Errors
    /// Every problem found, as for [`ContractSet::load_dir`].
    pub fn load_dir_with(
        dir: &Path,
        files: &[(&str, &str)],
    ) -> Result<ContractSet, Vec<ContractDiagnostic>> {
        let mut sources = Vec::new();
        let mut modes = None;
        let mut diags = Vec::new();
        if dir.exists() {
            collect_dir(dir, dir, "", 0, &mut sources, &mut modes, &mut diags);
        }
        for (path, text) in files {
            let rel = path.trim_start_matches("./").to_owned();
            sources.retain(|s| s.rel != rel);
            sources.push(Source {
                display: dir.join(&rel).display().to_string(),
                rel,
                text: (*text).to_owned(),
            });
        }
        Self::build_collected(sources, modes, diags)
    }

    /// Builds what a directory walk collected; the walk's own problems (unreadable files) are
    /// reported with the build's.
    fn build_collected(
        sources: Vec<Source>,
        modes: Option<Source>,
        mut diags: Vec<ContractDiagnostic>,
    ) -> Result<ContractSet, Vec<ContractDiagnostic>> {
        match Self::build(sources, modes) {
            Ok(set) if diags.is_empty() => Ok(set),
            Ok(_) => Err(sorted(diags)),
            Err(mut more) => {
                diags.append(&mut more);
                Err(sorted(diags))
            }
        }
    }

    /// Builds a set from in-memory files (e.g. an API upload, tests): `(relative path, text)`
    /// pairs such as `("order.created/v1.json", "{...}")`, and the text of `modes.toml`.
    ///
    /// # Errors
    /// Every problem found, as for [`ContractSet::load_dir`].
    pub fn from_files(
        files: &[(&str, &str)],
        modes_toml: Option<&str>,
    ) -> Result<ContractSet, Vec<ContractDiagnostic>> {
        let sources = files
            .iter()
            .map(|(path, text)| {
                let rel = path.trim_start_matches("./").to_owned();
                Source {
                    display: rel.clone(),
                    rel,
                    text: (*text).to_owned(),
                }
            })
            .collect();
        let modes = modes_toml.map(|text| Source {
            rel: MODES_FILE.to_owned(),
            display: MODES_FILE.to_owned(),
            text: text.to_owned(),
        });
        Self::build(sources, modes).map_err(sorted)
    }

    fn build(
        sources: Vec<Source>,
        modes_src: Option<Source>,
    ) -> Result<ContractSet, Vec<ContractDiagnostic>> {
        let mut diags = Vec::new();
        let mut types: BTreeMap<String, BTreeMap<u32, Contract>> = BTreeMap::new();
        let mut hashed: Vec<(String, String)> = Vec::new();

        let modes = match &modes_src {
            Some(src) => {
                hashed.push((src.rel.clone(), src.text.clone()));
                parse_modes(src, &mut diags)
            }
            None => BTreeMap::new(),
        };

        for src in sources {
            let parts: Vec<&str> = src.rel.split('/').collect();
            let Some(name) = parts.last().copied() else {
                continue;
            };
            if !name.ends_with(".json") || parts.iter().any(|p| p.starts_with('.')) {
                continue; // README, notes, hidden files: not contracts.
            }
            let (ty, version) = match (parts.as_slice(), parse_version_name(name)) {
                ([ty, _], Some(v)) if !ty.is_empty() => ((*ty).to_owned(), v),
                ([_, _], None) => {
                    diags.push(ContractDiagnostic::new(
                        &src.display,
                        (1, 1),
                        format!(
                            "contract file name '{name}' must be v<N>.json with N from 1 to {MAX_VERSION} (the dataversions an event can carry), no leading zeros (e.g. v1.json)"
                        ),
                    ));
                    continue;
                }
                _ => {
                    diags.push(ContractDiagnostic::new(
                        &src.display,
                        (1, 1),
                        "contract files must be at <type>/v<N>.json (e.g. order.created/v1.json)",
                    ));
                    continue;
                }
            };
            if types.get(&ty).is_some_and(|v| v.contains_key(&version)) {
                diags.push(ContractDiagnostic::new(
                    &src.display,
                    (1, 1),
                    format!("duplicate contract for type '{ty}' v{version}"),
                ));
                continue;
            }
            // A byte-order mark (some Windows editors write one) is not JSON, but rule files
            // accept it, so contract files do too (and the upload API and `contracts push`,
            // through [`strip_bom`]); lines and columns are those of the text after it.
            let src = Source {
                text: strip_bom(&src.text).to_owned(),
                ..src
            };
            let schema: Value = match serde_json::from_str(&src.text) {
                Ok(v) => v,
                Err(e) => {
                    diags.push(ContractDiagnostic::new(
                        &src.display,
                        (e.line().max(1), e.column().max(1)),
                        format!("invalid JSON: {e}"),
                    ));
                    continue;
                }
            };
            let (validator, counted) = match compile(&src, &schema) {
                Ok(v) => v,
                Err(d) => {
                    diags.push(d);
                    continue;
                }
            };
            hashed.push((src.rel.clone(), src.text.clone()));
            types.entry(ty).or_default().insert(
                version,
                Contract {
                    file: src.rel,
                    display: src.display,
                    text: src.text,
                    schema,
                    validator,
                    counted,
                },
            );
        }

        if !diags.is_empty() {
            return Err(diags);
        }
        Ok(ContractSet {
            types,
            modes,
            version: content_hash(&hashed),
        })
    }

    /// Checks one event's `data` against the contract for its (`type`, `dataversion`).
    pub fn check(&self, ev: &CloudEvent) -> ContractOutcome {
        let Some(versions) = self.types.get(&ev.ty) else {
            return ContractOutcome::Pass;
        };
        let mode = self.mode(&ev.ty);
        if mode == ContractMode::Off {
            return ContractOutcome::Pass;
        }
        let violation = |reason, errors| ContractOutcome::Violation {
            mode,
            reason,
            errors,
        };
        let version = ev.dataversion();
        let Some(contract) = versions.get(&version) else {
            let known: Vec<String> = versions.keys().map(|v| v.to_string()).collect();
            return violation(
                ViolationReason::UnknownVersion,
                vec![FieldError::new(
                    "/dataversion",
                    format!(
                        "no contract for type '{}' dataversion {version}; known versions: {}",
                        ev.ty,
                        known.join(", ")
                    ),
                )],
            );
        };
        if !ev.data_is_json() {
            let got = ev
                .datacontenttype
                .as_deref()
                .unwrap_or("binary data (data_base64 without datacontenttype)");
            return violation(
                ViolationReason::ContractViolation,
                vec![FieldError::new(
                    "/data",
                    format!("contract requires JSON data, got {got}"),
                )],
            );
        }
        let decoded;
        // Where the errors point: the member the data came from. Data decoded from
        // `data_base64` is said to be so, since the event has no `data` member to look in.
        let (data, at) = match (&ev.data, &ev.data_base64) {
            (Some(d), _) => (d.value(), DataAt::Data),
            (None, Some(b64)) => match decode_json_base64(b64) {
                Ok(v) => {
                    decoded = v;
                    (&decoded, DataAt::Base64)
                }
                Err(msg) => {
                    return violation(
                        ViolationReason::ContractViolation,
                        vec![FieldError::new("/data_base64", msg)],
                    );
                }
            },
            // Checked as `null`, as JSON Schema reads a missing instance.
            (None, None) => (&Value::Null, DataAt::Absent),
        };
        // The plain validator answers the common case (valid data) at full speed; only data
        // that fails pays for the bounded, step-counted walk that lists what is wrong.
        if contract.validator.is_valid(data) {
            return ContractOutcome::Pass;
        }
        let errors = match at {
            // What the schema says about `null` ("null is not of type \"object\"") reads as
            // if the producer had sent `null`; the fix is to send the data at all.
            DataAt::Absent => vec![FieldError::new(
                "/data",
                format!(
                    "no data: the event has neither `data` (or it is null) nor `data_base64`, \
                     and the contract for type '{}' dataversion {version} requires data",
                    ev.ty
                ),
            )],
            at => bounded_errors(&contract.counted, data, at),
        };
        violation(ViolationReason::ContractViolation, errors)
    }

    /// The mode for a type (`quarantine` unless `modes.toml` says otherwise).
    pub fn mode(&self, ty: &str) -> ContractMode {
        self.modes.get(ty).copied().unwrap_or_default()
    }

    /// Every loaded contract, ordered by type then version.
    pub fn contracts(&self) -> Vec<ContractInfo> {
        self.types
            .iter()
            .flat_map(|(ty, versions)| {
                versions.iter().map(move |(v, c)| ContractInfo {
                    ty: ty.clone(),
                    version: *v,
                    file: c.file.clone(),
                    schema: c.schema.clone(),
                })
            })
            .collect()
    }

    /// What an operator should hear about this set against the live one, `before`: a type
    /// whose every version went (its events are no longer checked at all, enforce mode or
    /// not), and a `modes.toml` entry for a type without contracts (it does nothing).
    pub fn warnings_against(&self, before: &ContractSet) -> Vec<String> {
        let gone = before
            .types
            .keys()
            .filter(|t| !self.types.contains_key(*t))
            .map(|t| {
                format!(
                    "contracts: every version of type {t} was removed; its events are no longer checked"
                )
            });
        let idle = self.modes_without_contract().map(|t| {
            format!(
                "contracts: {MODES_FILE} sets a mode for type {t}, which has no contract; it has no effect"
            )
        });
        gone.chain(idle).collect()
    }

    /// The types `modes.toml` sets a mode for that have no contract (the mode does nothing:
    /// a misspelt type, or one whose contracts were removed).
    pub fn modes_without_contract(&self) -> impl Iterator<Item = &str> {
        self.modes
            .keys()
            .filter(|t| !self.types.contains_key(*t))
            .map(String::as_str)
    }

    /// The contract of `ty` at `version`, if loaded.
    pub fn get(&self, ty: &str, version: u32) -> Option<ContractInfo> {
        let c = self.types.get(ty)?.get(&version)?;
        Some(ContractInfo {
            ty: ty.to_owned(),
            version,
            file: c.file.clone(),
            schema: c.schema.clone(),
        })
    }

    /// Whether the set holds no contract at all.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    /// The highest loaded version of `ty`.
    pub fn latest_version(&self, ty: &str) -> Option<u32> {
        self.types.get(ty)?.keys().next_back().copied()
    }

    /// The highest loaded version of `ty` below `version`, with its schema: what a new
    /// `version` is compared with.
    pub fn previous(&self, ty: &str, version: u32) -> Option<(u32, Value)> {
        let (v, c) = self.types.get(ty)?.range(..version).next_back()?;
        Some((*v, c.schema.clone()))
    }

    /// The lowest loaded version of `ty` above `version`, with its schema: what an upload
    /// between two versions must also be compatible with for the chain to stay compatible.
    pub fn next(&self, ty: &str, version: u32) -> Option<(u32, Value)> {
        let (v, c) = self
            .types
            .get(ty)?
            .range(version.saturating_add(1)..)
            .next()?;
        Some((*v, c.schema.clone()))
    }

    /// A short content hash of the set (12 hex chars of FNV-1a 64 over the sorted contract
    /// files and `modes.toml`): equal inputs give equal versions.
    pub fn version(&self) -> String {
        self.version.clone()
    }

    /// Compatibility of each version with the one before it (consecutive loaded versions of
    /// the same type). Informational: loading never fails on it.
    pub fn compatibility_report(&self) -> Vec<ContractDiagnostic> {
        let mut out = Vec::new();
        for versions in self.types.values() {
            let list: Vec<(&u32, &Contract)> = versions.iter().collect();
            for pair in list.windows(2) {
                let [(old_v, old), (_, new)] = pair else {
                    continue;
                };
                out.extend(incompatibilities(old, new, false, |m| {
                    format!("incompatible with v{old_v}: {m}")
                }));
            }
        }
        out
    }

    /// What this set changed in place against `base` (the same directory at an earlier
    /// revision, as deployed): a version `base` has that was edited incompatibly, or removed.
    /// That is what a live version must never do — events already valid under it would be
    /// quarantined — and what the upload API refuses with 409; a breaking change belongs in a
    /// new version, which [`Self::compatibility_report`] only describes.
    pub fn changes_from(&self, base: &ContractSet) -> Vec<ContractDiagnostic> {
        let mut out = Vec::new();
        for (ty, versions) in &base.types {
            for (v, old) in versions {
                let Some(new) = self.types.get(ty).and_then(|vs| vs.get(v)) else {
                    out.push(ContractDiagnostic::new(
                        &old.display,
                        (1, 1),
                        format!(
                            "{ty} v{v} was removed: events sent as that version would be quarantined as unknown_version"
                        ),
                    ));
                    continue;
                };
                let latest = versions
                    .keys()
                    .last()
                    .copied()
                    .unwrap_or(*v)
                    .max(self.latest_version(ty).unwrap_or(*v));
                let publish = publish_as(latest);
                out.extend(incompatibilities(old, new, true, |m| {
                    format!("incompatible change to v{v} in place: {m}; {publish}")
                }));
            }
        }
        sorted(out)
    }
}

/// What `new` breaks of `old`, each located in `new`'s file (line, column and pointer) and
/// worded by `say` from the checker's message; `in_place` when `new` replaces `old` as the
/// same version (see [`compat::in_place_issues`]).
fn incompatibilities(
    old: &Contract,
    new: &Contract,
    in_place: bool,
    say: impl Fn(&str) -> String,
) -> Vec<ContractDiagnostic> {
    let issues = if in_place {
        compat::in_place_issues(&old.schema, &new.schema)
    } else {
        compat::compat_issues(&old.schema, &new.schema)
    };
    if issues.is_empty() {
        return Vec::new();
    }
    // Parsed once per file: a report can name thousands of places in it.
    let positions = JsonPositions::new(&new.text);
    issues
        .into_iter()
        .map(|issue| {
            let pos = positions
                .as_ref()
                .and_then(|p| p.locate(&issue.pointer))
                .unwrap_or((1, 1));
            ContractDiagnostic::new(&new.display, pos, say(&issue.message))
                .at_pointer(&issue.pointer)
        })
        .collect()
}

fn sorted(mut diags: Vec<ContractDiagnostic>) -> Vec<ContractDiagnostic> {
    diags.sort_by(|a, b| (&a.file, a.line, a.col).cmp(&(&b.file, b.line, b.col)));
    diags
}

/// `v<N>.json` with N from 1 to [`MAX_VERSION`] and no leading zeros.
fn parse_version_name(name: &str) -> Option<u32> {
    parse_version(name.strip_suffix(".json")?)
}

/// The highest contract version: the highest `dataversion` ingest accepts (a CloudEvents
/// Integer is 32-bit signed). A contract above it could never apply, and its type's events
/// would be quarantined as `unknown_version` naming it.
pub const MAX_VERSION: u32 = i32::MAX.unsigned_abs();

/// `v3` → 3: a contract version as its file is named (without `.json`) and as the API takes
/// it; N from 1 to [`MAX_VERSION`], no leading zeros.
pub fn parse_version(name: &str) -> Option<u32> {
    let digits = name.strip_prefix('v')?;
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().filter(|v| *v <= MAX_VERSION)
}

/// What an incompatible change to a live version should be published as instead: the version
/// after `latest`, the highest of its type.
pub fn publish_as(latest: u32) -> String {
    match latest.checked_add(1).filter(|v| *v <= MAX_VERSION) {
        Some(next) => format!("publish it as v{next}"),
        None => format!(
            "no version is left above v{latest} (the highest dataversion an event can carry): publish it under a new event type"
        ),
    }
}

/// `text` without a leading UTF-8 byte-order mark, which some editors write and JSON does not
/// allow: the contracts directory, the upload API and `router contracts push` all read a
/// contract file through this, so they take (or refuse) the same files.
pub fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

fn decode_json_base64(b64: &str) -> Result<Value, String> {
    let bytes = BASE64_LENIENT
        .decode(b64.as_bytes())
        .map_err(|e| format!("data_base64 is not valid base64: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        format!("datacontenttype is JSON but data_base64 does not decode to JSON: {e}")
    })
}

/// Compiles one schema: draft from `$schema` (2020-12 or draft-07; default 2020-12), formats
/// asserted.
fn compile(src: &Source, schema: &Value) -> Result<(Validator, Validator), ContractDiagnostic> {
    let at = |pointer: &str| {
        JsonPositions::new(&src.text)
            .and_then(|p| p.locate(pointer))
            .unwrap_or((1, 1))
    };
    if !schema.is_object() && !schema.is_boolean() {
        return Err(ContractDiagnostic::new(
            &src.display,
            (1, 1),
            "a contract must be a JSON Schema (an object or a boolean)",
        ));
    }
    let draft = match schema.get("$schema") {
        None => Draft::Draft202012,
        Some(Value::String(uri)) => match Draft::from_schema_uri(uri) {
            d @ (Draft::Draft202012 | Draft::Draft7) => d,
            _ => {
                return Err(ContractDiagnostic::new(
                    &src.display,
                    at("/$schema"),
                    format!(
                        "unsupported $schema '{uri}': contracts use JSON Schema 2020-12 \
                         (https://json-schema.org/draft/2020-12/schema) or draft-07 \
                         (http://json-schema.org/draft-07/schema#)"
                    ),
                )
                .at_pointer("/$schema"));
            }
        },
        Some(_) => {
            return Err(ContractDiagnostic::new(
                &src.display,
                at("/$schema"),
                "$schema must be a string URI",
            )
            .at_pointer("/$schema"));
        }
    };
    let options = || {
        jsonschema::options()
            .with_draft(draft)
            .should_validate_formats(true)
            // A misspelt format name ("emial") would otherwise check nothing, silently.
            .should_ignore_unknown_formats(false)
            // The linear `regex` engine, not fancy-regex: a backtracking pattern such as
            // `^(a|a)*(?!a)b$` took 8 s of CPU per 9 KB event (1M steps per string) on the
            // ingest workers. JSON Schema recommends a regex subset without lookaround and
            // backreferences, which is what this engine refuses, at load and upload (422
            // pointing at the pattern), instead of an event at a time.
            .with_pattern_options(jsonschema::PatternOptions::regex())
    };
    let build = |schema: &Value| options().build(schema);
    let refused = |e: jsonschema::ValidationError<'_>| {
        if let Some((pointer, message)) = external_reference(&e, schema) {
            return ContractDiagnostic::new(&src.display, at(&pointer), message)
                .at_pointer(&pointer);
        }
        if let Some((pointer, message)) = unknown_format(&e, draft) {
            return ContractDiagnostic::new(&src.display, at(&pointer), message)
                .at_pointer(&pointer);
        }
        let pointer = e.instance_path().as_str();
        let message = if let Some(why) = unsupported_pattern(&e) {
            format!("schema does not compile at {pointer}: {why}")
        } else if pointer.is_empty() {
            format!("schema does not compile: {e}")
        } else {
            format!("schema does not compile at {pointer}: {e}")
        };
        ContractDiagnostic::new(&src.display, at(pointer), message).at_pointer(pointer)
    };
    let validator = build(schema).map_err(refused)?;
    if let Some(f) = fanout::excessive_fan_out(schema) {
        return Err(ContractDiagnostic::new(
            &src.display,
            at(&f.pointer),
            format!(
                "schema fans out too much: the subschema at {} applies to one value in more \
                 than {} ways (allOf/anyOf/oneOf branches that refer to the same subschemas, \
                 level after level), so checking one small event could take millions of \
                 steps; refer to each subschema from one branch",
                if f.pointer.is_empty() {
                    "the root"
                } else {
                    &f.pointer
                },
                fanout::MAX_PATHS
            ),
        )
        .at_pointer(&f.pointer));
    }
    if let Some(probe) = referring_to_every_definition(schema)
        && let Err(e) = build(&probe)
    {
        // Only a problem inside a definition counts: the probe's own additions are sound,
        // and the rest of the schema compiled above.
        let pointer = e.instance_path().as_str();
        if pointer.starts_with("/$defs/") || pointer.starts_with("/definitions/") {
            return Err(refused(e));
        }
    }
    let counted = options()
        .with_keyword(STEP_KEYWORD, |_, _, _| Ok(Box::new(StepCounter)))
        .build(&with_step_counters(schema))
        .map_err(refused)?;
    Ok((validator, counted))
}

/// A `$ref` to another document (a URL, a sibling file) that the compile could not resolve:
/// where it is (its pointer, `/properties/b/$ref`) and what to do, for an error that says
/// neither (jsonschema reports it at the root, naming a build feature). `None` for any
/// other compile error.
fn external_reference(
    e: &jsonschema::ValidationError<'_>,
    schema: &Value,
) -> Option<(String, String)> {
    let jsonschema::error::ValidationErrorKind::Referencing(
        jsonschema::ReferencingError::Unretrievable { uri, .. },
    ) = e.kind()
    else {
        return None;
    };
    // The failing URI is the `$ref` resolved against its base: the `$ref` it ends with (the
    // longest, the most specific), else the first that leaves the document.
    let mut refs = Vec::new();
    collect_external_refs(schema, String::new(), &mut refs);
    let target = uri.split('#').next().unwrap_or(uri);
    let found = refs
        .iter()
        .filter(|(_, r)| {
            let doc = r.split('#').next().unwrap_or(r);
            !doc.is_empty() && target.ends_with(doc.trim_start_matches("./"))
        })
        .max_by_key(|(_, r)| r.len())
        .or_else(|| refs.first());
    let (pointer, reference) = match found {
        Some((pointer, r)) => (pointer.clone(), r.as_str()),
        None => (String::new(), uri.as_str()),
    };
    Some((
        pointer,
        format!(
            "$ref {} points outside this contract: contracts must be self-contained; only \
             local references (\"#/$defs/...\", \"#anchor\", or an $id within this file) \
             are resolved, never other files or URLs; copy what it refers to into \"$defs\"",
            truncate_chars(Value::String(reference.to_owned()).to_string(), 200)
        ),
    ))
}

/// Format names JSON Schema defines, of which [`known_formats`] keeps those the validator
/// checks.
const STANDARD_FORMATS: &[&str] = &[
    "date",
    "date-time",
    "duration",
    "email",
    "hostname",
    "idn-email",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "iri",
    "iri-reference",
    "json-pointer",
    "regex",
    "relative-json-pointer",
    "time",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
];

/// The formats a contract of `draft` may name: those the validator checks (asked of it, so
/// the list follows the library's features and the draft).
fn known_formats(draft: Draft) -> Vec<&'static str> {
    STANDARD_FORMATS
        .iter()
        .copied()
        .filter(|f| {
            jsonschema::options()
                .with_draft(draft)
                .should_validate_formats(true)
                .should_ignore_unknown_formats(false)
                .build(&serde_json::json!({ "format": f }))
                .is_ok()
        })
        .collect()
}

/// A `format` the validator does not know: where it is and what to do, for an error that
/// does not advise the library's "adjust configuration to ignore unrecognized formats" (the
/// router has no such setting, on purpose: a misspelt format would check nothing). `None` for
/// any other compile error.
fn unknown_format(e: &jsonschema::ValidationError<'_>, draft: Draft) -> Option<(String, String)> {
    let jsonschema::error::ValidationErrorKind::Custom { message, .. } = e.kind() else {
        return None;
    };
    // "Unknown format: '<name>'. <advice>": the name may itself hold a quote.
    let (name, _) = message
        .strip_prefix("Unknown format: '")?
        .rsplit_once("'. ")?;
    let pointer = e.schema_path().as_str().to_owned();
    Some((
        pointer,
        format!(
            "unknown format {}: contracts assert `format` (a value that does not match it fails \
             the contract), so it must be one the router checks: {}; fix the name, or use \
             `pattern` for a format of your own",
            truncate_chars(Value::String(name.to_owned()).to_string(), 100),
            known_formats(draft).join(", ")
        ),
    ))
}

/// Every `$ref`/`$dynamicRef` in `schema` that does not start with `#`, with its pointer, in
/// document order. Values under `enum`, `const` and the like are data and are skipped.
fn collect_external_refs(v: &Value, at: String, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let here = format!("{at}/{}", crate::event::pointer_token(k));
                match (k.as_str(), v) {
                    ("$ref" | "$dynamicRef", Value::String(r)) if !r.starts_with('#') => {
                        out.push((here, r.clone()));
                    }
                    ("enum" | "const" | "default" | "examples", _) => {}
                    _ => collect_external_refs(v, here, out),
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                collect_external_refs(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// Why a `pattern` (or `patternProperties` name) is refused, in words a schema author can act
/// on: jsonschema only says it "is not a regex". `None` for any other compile error.
fn unsupported_pattern(e: &jsonschema::ValidationError<'_>) -> Option<String> {
    let jsonschema::error::ValidationErrorKind::Format { format } = e.kind() else {
        return None;
    };
    let Value::String(pattern) = e.instance().as_ref() else {
        return None;
    };
    if format != "regex" {
        return None;
    }
    // The engine's own reason (e.g. "look-around … is not supported"), on its last line.
    let reason = regex::Regex::new(pattern)
        .err()
        .and_then(|e| {
            e.to_string()
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| format!(" ({})", l.trim().trim_start_matches("error: ")))
        })
        .unwrap_or_default();
    Some(format!(
        "pattern {} cannot be used{reason}: contracts match patterns with a linear-time \
         engine, which has no lookaround ((?=, (?!, (?<=, (?<!) and no backreferences (\\1), \
         the features that let one pattern take seconds on one value; rewrite it without them",
        truncate_chars(Value::String(pattern.clone()).to_string(), 200)
    ))
}

/// Errors kept per event: the first ones, then one summary error saying how many more there
/// were. Producers fix the first few and retry; thousands of copies of one mistake (a bad
/// item in each of 300,000 array elements) only fill the answer, the DLQ and the log.
pub const MAX_ERRORS_PER_EVENT: usize = 20;

/// Longest message kept per error, in characters (longer ones are cut with "…").
pub const MAX_ERROR_MESSAGE_CHARS: usize = 300;

/// How much of a failing value a message quotes, in bytes of its JSON: jsonschema's own
/// message repeats the whole value, which can be the whole event.
const VALUE_EXCERPT_BYTES: usize = 60;

/// Subschema visits one listing of errors may spend. jsonschema collects every error before
/// handing out the first, so taking the first few is not enough: a 1.5 KB schema of `allOf`s
/// over `$ref`s doubling at each level made 4 million errors (35 s, 500 MB) for a 70-byte
/// event. Past this budget the walk is abandoned and only the first error is reported.
pub const MAX_VALIDATION_STEPS: u64 = 50_000;

/// The keyword [`with_step_counters`] adds to every subschema of the counted validator.
const STEP_KEYWORD: &str = "x-router-validation-step";

thread_local! {
    /// Steps left to the walk running on this thread; unlimited outside [`with_step_budget`].
    static STEPS_LEFT: std::cell::Cell<u64> = const { std::cell::Cell::new(u64::MAX) };
}

/// The unwind payload of a walk that ran out of steps.
struct StepBudgetSpent;

/// A keyword that accepts everything and counts one step each time a subschema is visited.
/// jsonschema offers no way to stop a walk, so the counter unwinds out of it
/// (`resume_unwind`, which skips the panic hook: nothing is printed) and
/// [`with_step_budget`] catches exactly that payload.
struct StepCounter;

impl StepCounter {
    fn step(&self) {
        STEPS_LEFT.with(|left| match left.get() {
            0 => std::panic::resume_unwind(Box::new(StepBudgetSpent)),
            n => left.set(n - 1),
        });
    }
}

impl<'i> jsonschema::Keyword<'i> for StepCounter {
    fn validate(&self, _: &'i Value) -> Result<(), jsonschema::ValidationError<'i>> {
        self.step();
        Ok(())
    }

    fn is_valid(&self, _: &'i Value) -> bool {
        self.step();
        true
    }
}

/// Runs `f` with `steps` steps for the counted validator on this thread: `None` when they ran
/// out. Every validator state a walk touches is its own (jsonschema keeps the walk's context
/// and errors on the stack), so abandoning one leaves the shared validator sound.
fn with_step_budget<T>(steps: u64, f: impl FnOnce() -> T) -> Option<T> {
    STEPS_LEFT.with(|left| left.set(steps));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    STEPS_LEFT.with(|left| left.set(u64::MAX));
    match result {
        Ok(v) => Some(v),
        Err(payload) if payload.is::<StepBudgetSpent>() => None,
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

/// A copy of `schema` with [`STEP_KEYWORD`] in every subschema (every place a JSON Schema
/// keyword takes a schema), for the counted validator. Values that are data (`enum`,
/// `const`, `default`, `examples`) and the name maps themselves are left alone, so what the
/// copy accepts is what `schema` accepts.
fn with_step_counters(schema: &Value) -> Value {
    let mut copy = schema.clone();
    add_step_counters(&mut copy);
    copy
}

fn add_step_counters(schema: &mut Value) {
    let Value::Object(map) = schema else {
        return; // `true`/`false`: a leaf, nothing below it to count.
    };
    for (key, value) in map.iter_mut() {
        match key.as_str() {
            "additionalProperties"
            | "additionalItems"
            | "unevaluatedProperties"
            | "unevaluatedItems"
            | "contains"
            | "propertyNames"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contentSchema" => add_step_counters(value),
            // `items` is a schema, or (draft-07) an array of them.
            "items" | "allOf" | "anyOf" | "oneOf" | "prefixItems" => match value {
                Value::Array(list) => list.iter_mut().for_each(add_step_counters),
                other => add_step_counters(other),
            },
            // Name → schema maps; draft-07 `dependencies` values are schemas or name lists.
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas"
            | "dependencies" => {
                if let Value::Object(named) = value {
                    named.values_mut().for_each(add_step_counters);
                }
            }
            _ => {}
        }
    }
    map.insert(STEP_KEYWORD.to_owned(), Value::Bool(true));
}

/// Where the data an event is checked by came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataAt {
    /// The `data` member.
    Data,
    /// `data_base64`, decoded as JSON (the event has no `data` member).
    Base64,
    /// Neither member: checked as `null`.
    Absent,
}

impl DataAt {
    /// The event member error pointers start at.
    fn member(self) -> &'static str {
        match self {
            DataAt::Base64 => "/data_base64",
            DataAt::Data | DataAt::Absent => "/data",
        }
    }

    /// How a message says which data it is about.
    fn say(self, message: String) -> String {
        match self {
            DataAt::Base64 => format!("decoded data_base64: {message}"),
            DataAt::Data | DataAt::Absent => message,
        }
    }
}

/// What is wrong with `data`, which failed its contract, bounded: at most
/// [`MAX_ERRORS_PER_EVENT`] errors plus one summary, each message at most
/// [`MAX_ERROR_MESSAGE_CHARS`] long and quoting at most an excerpt of the failing value, and
/// the walk itself at most [`MAX_VALIDATION_STEPS`] subschema visits. Pointers start at the
/// member the data came from (`/data`, or `/data_base64` for decoded data, whose messages say
/// so).
fn bounded_errors(counted: &Validator, data: &Value, at: DataAt) -> Vec<FieldError> {
    let member = at.member();
    let field_error = |e: &jsonschema::ValidationError<'_>| {
        FieldError::new(
            format!("{member}{}", e.instance_path().as_str()),
            truncate_chars(at.say(short_message(e)), MAX_ERROR_MESSAGE_CHARS),
        )
    };
    let listed = with_step_budget(MAX_VALIDATION_STEPS, || {
        let mut total = 0usize;
        let mut kept = Vec::new();
        for e in counted.iter_errors(data) {
            if kept.len() < MAX_ERRORS_PER_EVENT {
                kept.push(field_error(&e));
            }
            total += 1;
        }
        (kept, total)
    });
    match listed {
        Some((mut kept, total)) => {
            if total > kept.len() {
                kept.push(FieldError::new(
                    member,
                    format!(
                        "… and {} more errors (only the first {MAX_ERRORS_PER_EVENT} are kept)",
                        total - kept.len()
                    ),
                ));
            }
            if kept.is_empty() {
                // The two validators disagree only if the counted copy lost a keyword; say
                // so rather than pass data the contract refuses.
                kept.push(FieldError::new(
                    member,
                    at.say("data does not match its contract".to_owned()),
                ));
            }
            kept
        }
        None => {
            // The first error alone comes from a short-circuiting walk (each keyword stops at
            // its first failure), itself bounded in case even that is too long.
            let first = with_step_budget(MAX_VALIDATION_STEPS, || {
                counted.validate(data).err().map(|e| field_error(&e))
            })
            .flatten()
            .unwrap_or_else(|| {
                FieldError::new(
                    member,
                    at.say("data does not match its contract".to_owned()),
                )
            });
            vec![
                first,
                FieldError::new(
                    member,
                    format!(
                        "… and possibly more errors: listing them stopped at the limit of {MAX_VALIDATION_STEPS} schema steps"
                    ),
                ),
            ]
        }
    }
}

/// jsonschema's message for `e`, without repeating a large failing value (an excerpt of its
/// JSON stands for it) and cut to [`MAX_ERROR_MESSAGE_CHARS`].
fn short_message(e: &jsonschema::ValidationError<'_>) -> String {
    let (excerpt, whole) = json_excerpt(e.instance(), VALUE_EXCERPT_BYTES);
    let message = if whole {
        e.to_string()
    } else {
        e.masked_with(format!("{excerpt}…")).to_string()
    };
    truncate_chars(message, MAX_ERROR_MESSAGE_CHARS)
}

/// The first `limit` bytes (at most) of `value`'s JSON, cut at a character boundary, and
/// whether that is all of it. Serialization stops once the limit is reached, so a large value
/// costs no more than a small one.
fn json_excerpt(value: &Value, limit: usize) -> (String, bool) {
    struct Capped {
        buf: Vec<u8>,
        limit: usize,
        full: bool,
    }
    impl std::io::Write for Capped {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let room = self.limit.saturating_sub(self.buf.len());
            if bytes.len() > room {
                self.buf.extend_from_slice(&bytes[..room]);
                self.full = true;
                return Err(std::io::Error::other("excerpt full"));
            }
            self.buf.extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut out = Capped {
        buf: Vec::new(),
        limit,
        full: false,
    };
    let whole = serde_json::to_writer(&mut out, value).is_ok() && !out.full;
    let text = match String::from_utf8(out.buf) {
        Ok(t) => t,
        Err(e) => {
            // Cut inside a character: keep what precedes it.
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).unwrap_or_default()
        }
    };
    (text, whole)
}

/// `s` cut to at most `max` characters (the last one "…" when cut).
fn truncate_chars(mut s: String, max: usize) -> String {
    if s.chars().nth(max).is_some() {
        let at = s
            .char_indices()
            .nth(max.saturating_sub(1))
            .map_or(0, |(at, _)| at);
        s.truncate(at);
        s.push('…');
    }
    s
}

/// What a definition's name keeps unescaped in a `$ref` fragment (RFC 3986 unreserved).
const FRAGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// jsonschema compiles only the subschemas validation can reach, so a root definition nothing
/// refers to yet would load with a broken regex or keyword, and fail the day a new version
/// starts using it. This is a copy of `schema` whose root also refers to every definition
/// (through an `anyOf` led by `true`, which changes nothing it accepts), for compiling only.
/// `None` when the schema has no definitions.
fn referring_to_every_definition(schema: &Value) -> Option<Value> {
    let root = schema.as_object()?;
    let mut refs = vec![Value::Bool(true)];
    for key in ["$defs", "definitions"] {
        if let Some(Value::Object(defs)) = root.get(key) {
            for name in defs.keys() {
                let token = crate::event::pointer_token(name);
                let fragment = utf8_percent_encode(&token, FRAGMENT).to_string();
                refs.push(serde_json::json!({ "$ref": format!("#/{key}/{fragment}") }));
            }
        }
    }
    if refs.len() == 1 {
        return None;
    }
    let mut probe = root.clone();
    let mut all_of = match probe.remove("allOf") {
        Some(Value::Array(items)) => items,
        Some(other) => vec![other],
        None => Vec::new(),
    };
    all_of.push(serde_json::json!({ "anyOf": refs }));
    probe.insert("allOf".to_string(), Value::Array(all_of));
    Some(Value::Object(probe))
}

fn parse_modes(
    src: &Source,
    diags: &mut Vec<ContractDiagnostic>,
) -> BTreeMap<String, ContractMode> {
    let mut modes = BTreeMap::new();
    let table: BTreeMap<String, toml::Spanned<toml::Value>> = match toml::from_str(&src.text) {
        Ok(t) => t,
        Err(e) => {
            let pos = e
                .span()
                .map_or((1, 1), |s| Lines::new(&src.text).at(s.start));
            diags.push(ContractDiagnostic::new(
                &src.display,
                pos,
                format!("invalid TOML: {}", e.message().trim_end()),
            ));
            return modes;
        }
    };
    let lines = Lines::new(&src.text);
    for (ty, value) in table {
        let pos = lines.at(value.span().start);
        match value.get_ref() {
            toml::Value::String(s) => match s.as_str() {
                "enforce" => {
                    modes.insert(ty, ContractMode::Enforce);
                }
                "quarantine" => {
                    modes.insert(ty, ContractMode::Quarantine);
                }
                "off" => {
                    modes.insert(ty, ContractMode::Off);
                }
                other => diags.push(ContractDiagnostic::new(
                    &src.display,
                    pos,
                    format!(
                        "unknown mode '{other}' for type '{ty}': expected enforce, quarantine or off"
                    ),
                )),
            },
            toml::Value::Table(_) => diags.push(ContractDiagnostic::new(
                &src.display,
                pos,
                format!(
                    "'{ty}' is a table, not a mode: quote type names that contain dots, \
                     e.g. \"{ty}.created\" = \"enforce\""
                ),
            )),
            _ => diags.push(ContractDiagnostic::new(
                &src.display,
                pos,
                format!("mode for type '{ty}' must be a string: enforce, quarantine or off"),
            )),
        }
    }
    modes
}

/// Gathers `.json` files (any depth up to [`MAX_DIR_DEPTH`]) and the root `modes.toml`.
fn collect_dir(
    root: &Path,
    dir: &Path,
    rel_prefix: &str,
    depth: usize,
    sources: &mut Vec<Source>,
    modes: &mut Option<Source>,
    diags: &mut Vec<ContractDiagnostic>,
) {
    let io_diag = |path: &Path, msg: String| {
        ContractDiagnostic::new(&path.display().to_string(), (1, 1), msg)
    };
    let entries = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) => {
            diags.push(io_diag(dir, format!("cannot read directory: {e}")));
            return;
        }
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            diags.push(io_diag(&path, "file name is not valid UTF-8".to_owned()));
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let rel = if rel_prefix.is_empty() {
            name.clone()
        } else {
            format!("{rel_prefix}/{name}")
        };
        let meta = match fs::metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                diags.push(io_diag(&path, format!("cannot read: {e}")));
                continue;
            }
        };
        if meta.is_dir() {
            if depth < MAX_DIR_DEPTH {
                collect_dir(root, &path, &rel, depth + 1, sources, modes, diags);
            }
            continue;
        }
        let is_modes = depth == 0 && name == MODES_FILE;
        if !is_modes && !name.ends_with(".json") {
            continue;
        }
        let text = match fs::read(&path).map(String::from_utf8) {
            Ok(Ok(t)) => t,
            Ok(Err(_)) => {
                diags.push(io_diag(&path, "file is not valid UTF-8".to_owned()));
                continue;
            }
            Err(e) => {
                diags.push(io_diag(&path, format!("cannot read: {e}")));
                continue;
            }
        };
        let src = Source {
            display: root.join(&rel).display().to_string(),
            rel,
            text,
        };
        if is_modes {
            *modes = Some(src);
        } else {
            sources.push(src);
        }
    }
}

/// FNV-1a 64 over the (path, contents) pairs in path order; first 12 hex digits.
fn content_hash(files: &[(String, String)]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    fn feed(h: &mut u64, bytes: &[u8]) {
        for &b in bytes {
            *h ^= u64::from(b);
            *h = h.wrapping_mul(PRIME);
        }
    }
    let mut sorted: Vec<&(String, String)> = files.iter().collect();
    sorted.sort();
    let mut h = OFFSET;
    for (path, text) in sorted {
        feed(&mut h, &(path.len() as u64).to_le_bytes());
        feed(&mut h, path.as_bytes());
        feed(&mut h, &(text.len() as u64).to_le_bytes());
        feed(&mut h, text.as_bytes());
    }
    let hex = format!("{h:016x}");
    hex[..12].to_owned()
}

#[cfg(test)]
mod tests;
