//! Uploaded handlers: validation at upload, versions on disk with an index, rollback, and the
//! active pre-instantiated component per handler name.
//!
//! Layout under the registry directory: `<name>/index.json` (versions, which one is active),
//! `<name>/<sha256>.wasm` (the uploaded bytes) and `<name>/<sha256>.cwasm` (the version's
//! compiled code, see [`artifact`](super::artifact)), so reopening the registry after a restart,
//! or rolling back, loads machine code instead of compiling. Compiled code is checked before
//! every load; a file that fails its check is removed (with a warning) and the component
//! compiled again. It is written when a version is stored or first loaded here, and removed
//! with its component: a version past `keep_versions`, a deleted handler's versions, a
//! released name's directory. A rejected upload writes nothing.
//!
//! All methods block (file I/O, compilation): async callers use `spawn_blocking`.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;
use wasmtime::component::Component;

use super::artifact::{self, ArtifactError, Artifacts};
use super::bindings::{HandlerPre, HostState, wit};
use super::engine::WasmEngine;
use super::invoke;

/// Version of the `index.json` format: the newest this router reads.
const INDEX_FORMAT: u32 = 2;

/// The format of an index without `kept` (every index of a live handler): routers before
/// format 2 read it. Only a record that needs format 2 is written as such, so that in a
/// rolling upgrade an older node refuses it (and keeps serving what it has) instead of reading
/// a kept, unowned tombstone as a freed name and removing its logs.
const BASE_INDEX_FORMAT: u32 = 1;

/// What a handler's `describe` returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerDescriptor {
    /// The handler's name (equal to the name it is registered under).
    pub name: String,
    /// The handler's own version string.
    pub version: String,
    /// Accepted event types.
    pub accepts: Vec<AcceptedType>,
}

/// One accepted event type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptedType {
    /// The CloudEvents `type`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Accepted `dataversion`s; empty means all.
    pub versions: Vec<u32>,
}

impl HandlerDescriptor {
    /// Whether the handler declares it accepts `event_type` at `dataversion`. A handler that
    /// declares no types at all accepts everything.
    pub fn accepts(&self, event_type: &str, dataversion: u32) -> bool {
        self.accepts.is_empty()
            || self.accepts.iter().any(|a| {
                a.event_type == event_type
                    && (a.versions.is_empty() || a.versions.contains(&dataversion))
            })
    }

    /// What the handler accepts, as a person reads it: `order.paid (v1, v2), order.created
    /// (every version)`.
    pub fn accepts_text(&self) -> String {
        if self.accepts.is_empty() {
            return "every type".into();
        }
        self.accepts
            .iter()
            .map(|a| {
                let versions = if a.versions.is_empty() {
                    "every version".to_string()
                } else {
                    a.versions
                        .iter()
                        .map(|v| format!("v{v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                format!("{} ({versions})", a.event_type)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl From<wit::Descriptor> for HandlerDescriptor {
    fn from(d: wit::Descriptor) -> Self {
        Self {
            name: d.name,
            version: d.version,
            accepts: d
                .accepts
                .into_iter()
                .map(|a| AcceptedType {
                    event_type: a.type_,
                    versions: a.versions,
                })
                .collect(),
        }
    }
}

/// One uploaded version of a handler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// Sequence number per handler name, from 1.
    pub version: u32,
    /// SHA-256 of the component bytes (lowercase hex).
    pub sha256: String,
    /// Size of the component in bytes.
    pub size: u64,
    /// Who uploaded it (the token's principal).
    pub uploader: String,
    /// The uploader's team (its token's `team`, or its name): whose ingest scopes the
    /// version's emissions are checked against once that token is gone (rotated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// When (RFC 3339, UTC).
    pub uploaded_at: String,
    /// What `describe` returned at upload.
    pub descriptor: HandlerDescriptor,
}

/// A handler's versions and state, as listed by the admin API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HandlerInfo {
    /// The handler name.
    pub name: String,
    /// The active version, if any.
    pub active: Option<VersionInfo>,
    /// Every stored version, oldest first.
    pub versions: Vec<VersionInfo>,
    /// The team that owns it (the first uploader's), if known.
    pub owner: Option<String>,
    /// Whether `active` runs here: deliveries to a handler in any other state wait (without
    /// spending attempts) until it is loaded.
    pub state: HandlerState,
    /// Why the active version could not be loaded (state `failed`), if it could not.
    pub load_error: Option<String>,
    /// When the active version became active (RFC 3339, UTC): by its upload, a rollback, or
    /// an upload of its bytes again. `None` when that predates this record.
    pub activated_at: Option<String>,
    /// Who made it active (the token's name); `None` as for `activated_at`.
    pub activated_by: Option<String>,
}

/// Whether a handler's active version runs on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HandlerState {
    /// Its active version is compiled and runs.
    Loaded,
    /// Its active version's stored compiled code was missing or of no use to this engine (a
    /// router upgrade, `handlers.fuel` switched): it is being compiled in the background,
    /// after the start, so the API and ingest do not wait for it.
    Loading,
    /// Its active version (or its index) could not be loaded: `load_error` says why. An
    /// upload or a rollback replaces it.
    Failed,
    /// No version is active.
    Inactive,
}

/// Why a handler's deliveries cannot run here now ([`HandlerRegistry::lookup`]); its
/// `Display` is the cause an operator reads in a delivery's fate and in `/v1/status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotLoaded {
    /// No such handler, it was deleted, or no version of it is active.
    NotUploaded(String),
    /// Its active version is being compiled (see [`HandlerState::Loading`]).
    Loading {
        /// The handler.
        name: String,
        /// The version being compiled.
        version: u32,
    },
    /// Its active version could not be loaded.
    Failed {
        /// The handler.
        name: String,
        /// Why (its `load_error`).
        error: String,
    },
}

impl std::fmt::Display for NotLoaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotUploaded(name) => {
                write!(f, "handler {name:?} is not uploaded (or was deleted)")
            }
            Self::Loading { name, version } => write!(
                f,
                "handler {name:?} version {version} is being compiled (its stored compiled code was missing or of no use to this router)"
            ),
            Self::Failed { name, error } => write!(
                f,
                "handler {name:?} could not be loaded ({error}); upload it again or roll it back"
            ),
        }
    }
}

/// Who uploads a version: the token's name, its team, and whether it may change a handler
/// another team owns (an administrator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploader {
    /// The token's name.
    pub token: String,
    /// Its team.
    pub team: String,
    /// May change any team's handler.
    pub admin: bool,
    /// The operator's `handlers.preload_dir` at a start: the index remembers which bytes it
    /// preloaded, so a later start does not upload them again once they are no longer a kept
    /// version.
    pub preload: bool,
    /// An administrator's upload for a team (`?team=`): the handler becomes that team's, so
    /// no other team can take it over by uploading next. Ignored for other uploaders.
    pub for_team: Option<String>,
}

impl Uploader {
    /// The preload of `handlers.preload_dir`: team `preload`, which no token may have, and
    /// not an administrator, so it never replaces a handler a team owns.
    pub fn preload(token: &str) -> Self {
        Self {
            token: token.to_owned(),
            team: token.to_owned(),
            admin: false,
            preload: true,
            for_team: None,
        }
    }
}

/// An operator uploading directly (the registry's own API, preloads, tests): an administrator
/// whose team is its name.
impl From<&str> for Uploader {
    fn from(name: &str) -> Self {
        Self {
            token: name.to_owned(),
            team: name.to_owned(),
            admin: true,
            preload: false,
            for_team: None,
        }
    }
}

/// A handler's versions and which one is active: `<name>/index.json` in the registry
/// directory, and the record a shared catalog keeps per handler (`wasm::catalog`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandlerIndex {
    format: u32,
    pub(crate) name: String,
    pub(crate) active: Option<String>,
    pub(crate) versions: Vec<VersionInfo>,
    /// The team that owns the handler: the team of its first uploader. Another team's token
    /// cannot upload over it, roll it back or delete it, whatever its `handlers:` glob covers
    /// (an administrator can). `None` for indexes written before ownership was kept: the next
    /// upload claims it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) owner: Option<String>,
    /// The SHA-256 of the bytes last preloaded from `handlers.preload_dir`: a start finding
    /// the same file there leaves the handler as it is, even once that version is no longer
    /// kept (else a restart would bring old code back as a new version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) preloaded: Option<String>,
    /// The handler was deleted. Its record stays while a team owns the name (`owner`), so
    /// the name stays that team's (a delete does not hand the handler's queued deliveries to
    /// whichever team uploads the name next) until the team or an administrator releases it.
    /// In a shared catalog the record stays even without an owner, so a node that was down
    /// meanwhile deletes its copy instead of publishing it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) deleted: bool,
    /// Deleted without a release while no team owned it (only administrators uploaded it,
    /// or auth is off): like a team's kept name, its key-value entries and logs stay, and
    /// whoever may upload it (as before the delete) finds them. Only a release frees it. A
    /// deleted record with neither `owner` nor `kept` is a freed name. (Format 2.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) kept: bool,
    /// When `active` last changed (RFC 3339, UTC), and by whom (the token's name): an upload,
    /// a rollback, or bytes of a stored version uploaded again. Absent in indexes written
    /// before it was kept (older routers ignore it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) activated_at: Option<String>,
    /// See `activated_at`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) activated_by: Option<String>,
}

impl HandlerIndex {
    /// A handler with no versions yet.
    pub(crate) fn empty(name: &str) -> Self {
        Self {
            format: BASE_INDEX_FORMAT,
            name: name.to_owned(),
            active: None,
            versions: Vec::new(),
            owner: None,
            preloaded: None,
            deleted: false,
            kept: false,
            activated_at: None,
            activated_by: None,
        }
    }

    /// Makes the version with `sha256` active, recording when and by whom when that changes
    /// which version is active (the same one again changes nothing).
    fn activate(&mut self, sha256: &str, by: &str) {
        if self.active.as_deref() == Some(sha256) {
            return;
        }
        self.active = Some(sha256.to_owned());
        self.activated_at =
            Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
        self.activated_by = Some(by.to_owned());
    }

    /// A deleted handler's name that nothing holds any more: no team keeps it and its data
    /// is gone (released, or deleted before names were kept).
    pub(crate) fn is_free(&self) -> bool {
        self.deleted && self.owner.is_none() && !self.kept
    }

    /// The team that owns the handler: the one recorded or, for an index written before
    /// ownership was recorded, the uploader of its oldest version (tokens had no `team` then,
    /// so a token's team was its name).
    pub(crate) fn effective_owner(&self) -> Option<String> {
        if self.deleted {
            return self.owner.clone();
        }
        self.owner.clone().or_else(|| {
            let oldest = self.versions.iter().min_by_key(|v| v.version)?;
            oldest.team.is_none().then(|| oldest.uploader.clone())
        })
    }

    /// Refused when `who` may not change this handler: another team owns it and `who` is not
    /// an administrator.
    pub(crate) fn check_owner(&self, who: &Uploader) -> Result<(), OwnedByAnotherTeam> {
        match self.effective_owner() {
            Some(owner) if !who.admin && owner != who.team => Err(OwnedByAnotherTeam {
                name: self.name.clone(),
                owner,
            }),
            _ => Ok(()),
        }
    }

    /// The index with `v` stored and active: a new version numbered after the highest so far,
    /// or the stored version with the same bytes, re-activated. Past `keep` versions the oldest
    /// are forgotten (never the active one), so repeated uploads cannot fill the disk; their
    /// components are removed by the registry (`prune_components`) and, on a shared store, by
    /// the catalog's sweep.
    pub(crate) fn with_upload(
        mut self,
        v: &Validated,
        uploader: &Uploader,
        keep: usize,
    ) -> Result<(Self, VersionInfo), UploadError> {
        if self.deleted {
            // A new history; the name stays with the team that kept it.
            self = Self {
                owner: self.owner.take(),
                ..Self::empty(&self.name)
            };
        }
        self.check_owner(uploader)?;
        // The first team to upload claims it; an administrator's upload (an operator acting
        // for a team) does not, unless it names the team, which then owns it (an
        // administrator may also hand a handler over that way).
        match uploader.for_team.as_ref().filter(|_| uploader.admin) {
            Some(team) => self.owner = Some(team.clone()),
            None if self.owner.is_none() => {
                self.owner = self
                    .effective_owner()
                    .or_else(|| (!uploader.admin).then(|| uploader.team.clone()));
            }
            None => {}
        }
        let info = match self.versions.iter().find(|x| x.sha256 == v.sha256) {
            Some(existing) => existing.clone(),
            None => {
                let info = VersionInfo {
                    version: self.versions.iter().map(|x| x.version).max().unwrap_or(0) + 1,
                    sha256: v.sha256.clone(),
                    size: v.size,
                    uploader: uploader.token.clone(),
                    team: Some(uploader.team.clone()),
                    uploaded_at: chrono::Utc::now()
                        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    descriptor: v.descriptor.clone(),
                };
                self.versions.push(info.clone());
                info
            }
        };
        self.activate(&v.sha256, &uploader.token);
        if uploader.preload {
            self.preloaded = Some(v.sha256.clone());
        }
        self.keep_newest(keep);
        Ok((self, info))
    }

    /// Forgets the oldest versions past the `keep` newest (at least one), except the active one.
    fn keep_newest(&mut self, keep: usize) {
        let mut numbers: Vec<u32> = self.versions.iter().map(|v| v.version).collect();
        numbers.sort_unstable_by(|a, b| b.cmp(a));
        let Some(&oldest_kept) = numbers.get(keep.max(1) - 1) else {
            return;
        };
        let active = self.active.clone();
        self.versions
            .retain(|v| v.version >= oldest_kept || active.as_ref() == Some(&v.sha256));
    }

    /// The index with `version` (a number or hash prefix, as `rollback` takes) active, if
    /// `who` may change it.
    pub(crate) fn with_active(
        mut self,
        version: &str,
        who: &Uploader,
    ) -> Result<(Self, VersionInfo), RegistryError> {
        if self.deleted {
            return Err(RegistryError::UnknownHandler(self.name));
        }
        self.check_owner(who)?;
        let info = find_version(&self, &self.name, version)?.clone();
        self.activate(&info.sha256, &who.token);
        Ok((self, info))
    }

    /// The record kept once the handler is deleted: the name stays `owner`'s (`None`: free
    /// for any team).
    pub(crate) fn tombstone(name: &str, owner: Option<String>) -> Self {
        Self {
            deleted: true,
            owner,
            ..Self::empty(name)
        }
    }

    /// The record of a deleted handler no team owned, whose data stays (`kept`).
    fn kept_tombstone(name: &str) -> Self {
        Self {
            format: INDEX_FORMAT,
            kept: true,
            ..Self::tombstone(name, None)
        }
    }

    /// The record after `step` by `who`, or `None` when the step changes nothing: `Keep`
    /// deletes a live handler and keeps its name and data (for its team, or for whoever may
    /// upload it when no team owned it); `Hold`, a release's first step, deletes a live
    /// handler, or takes a deleted one's kept name, and holds the name for its team (for an
    /// unowned one, `who`'s) while its data is removed; `Free` gives up the name of a deleted
    /// handler. Refused when another team owns the handler or its kept name.
    pub(crate) fn deleted_by(
        &self,
        who: &Uploader,
        step: DeleteStep,
    ) -> Result<Option<Self>, OwnedByAnotherTeam> {
        if self.is_free() {
            return Ok(None);
        }
        let owner = self.effective_owner();
        self.check_owner(who)?;
        Ok(match (step, self.deleted) {
            (DeleteStep::Keep, false) => Some(match owner {
                Some(team) => Self::tombstone(&self.name, Some(team)),
                None => Self::kept_tombstone(&self.name),
            }),
            (DeleteStep::Hold, false) => Some(Self::tombstone(
                &self.name,
                Some(owner.unwrap_or_else(|| who.team.clone())),
            )),
            (DeleteStep::Hold, true) if owner.is_none() => {
                Some(Self::tombstone(&self.name, Some(who.team.clone())))
            }
            (DeleteStep::Free, true) => Some(Self::tombstone(&self.name, None)),
            _ => None,
        })
    }

    /// The active version's details.
    pub(crate) fn active_version(&self) -> Option<&VersionInfo> {
        let sha = self.active.as_ref()?;
        self.versions.iter().find(|v| &v.sha256 == sha)
    }

    /// The index as stored (`index.json`, or a catalog record).
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        // Plain data (strings, numbers): encoding cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// An index as stored. An index of a newer format than this router writes is refused,
    /// not read: in a rolling upgrade an older node would otherwise drop what it does not
    /// know (an owner, a deletion) when it next writes the record. Such a node keeps serving
    /// what it has and reports the record until it is upgraded.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let index: HandlerIndex = serde_json::from_slice(bytes)?;
        if index.format > INDEX_FORMAT {
            return Err(<serde_json::Error as serde::de::Error>::custom(format!(
                "the index of handler {:?} has format {}, newer than this router reads ({INDEX_FORMAT}): upgrade this node",
                index.name, index.format
            )));
        }
        Ok(index)
    }
}

/// A component that passed an upload's checks (it compiles, links against the handler
/// world, and `describe` answers with the name it is uploaded as), not stored yet.
pub struct Validated {
    name: String,
    sha256: String,
    size: u64,
    descriptor: HandlerDescriptor,
    pre: HandlerPre<HostState>,
    compiled: Compiled,
}

impl std::fmt::Debug for Validated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Validated")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .finish_non_exhaustive()
    }
}

impl Validated {
    /// The component's SHA-256 (lowercase hex).
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
}

/// The active version of a handler, compiled and pre-instantiated: each invocation only creates
/// a store and instantiates from here.
pub struct LoadedHandler {
    info: VersionInfo,
    pre: HandlerPre<HostState>,
    engine: Arc<WasmEngine>,
}

impl std::fmt::Debug for LoadedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedHandler")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl LoadedHandler {
    /// The handler name.
    pub fn name(&self) -> &str {
        &self.info.descriptor.name
    }

    /// The version this was loaded from.
    pub fn version(&self) -> &VersionInfo {
        &self.info
    }

    /// What the handler's `describe` returned.
    pub fn descriptor(&self) -> &HandlerDescriptor {
        &self.info.descriptor
    }

    pub(crate) fn pre(&self) -> &HandlerPre<HostState> {
        &self.pre
    }

    pub(crate) fn engine(&self) -> &Arc<WasmEngine> {
        &self.engine
    }
}

/// Why an upload was refused. Nothing is stored or activated in any of these cases.
#[derive(Debug, Error)]
pub enum UploadError {
    /// Handler names are 1–64 characters of `a-z`, `0-9`, `_`, `-`, starting with a letter or
    /// digit.
    #[error(
        "invalid handler name {0:?}: use 1-64 characters of a-z, 0-9, '_' and '-', starting with a letter or digit"
    )]
    InvalidName(String),
    /// Not a WebAssembly component at all.
    #[error("not a WebAssembly component: {0}")]
    NotComponent(String),
    /// Wasmtime did not compile it: bytes that do not validate as a component, or a valid
    /// component that needs more than the handler pool gives an instance (its memory
    /// minimum past `handlers.memory_bytes`, ...). Wasmtime's error says which; it is not
    /// parsed here, so the message names both possibilities.
    #[error(
        "the component cannot be compiled for this router: {0} (either it is not a valid component, or it needs more than an instance may have here: {1})"
    )]
    Uncompilable(String, String),
    /// A component (or core module) that does not implement the `router:handler/handler` world.
    #[error("the component does not implement the router:handler@0.1.0 `handler` world: {0}")]
    WrongWorld(String),
    /// `describe` trapped, timed out or ran out of memory.
    #[error("describe() failed: {0}")]
    DescribeFailed(String),
    /// The router had no instance free to run `describe` (other uploads were describing):
    /// nothing is wrong with the component, and the same upload may pass shortly. Nothing was
    /// stored. (An API answers it as unavailable, with a `Retry-After`.)
    #[error("{0}")]
    Busy(String),
    /// The handler's stored index cannot be read (see [`RegistryError::CorruptIndex`]):
    /// nothing changes the handler on this node until an operator fixes or removes it.
    #[error(transparent)]
    UnreadableIndex(Box<RegistryError>),
    /// `describe` names another handler.
    #[error(
        "describe() says the handler is named {described:?}, but it is uploaded as {expected:?}"
    )]
    NameMismatch {
        /// The name in the upload path.
        expected: String,
        /// The name `describe` returned.
        described: String,
    },
    /// Storing the component or the index failed.
    #[error("cannot store the handler: {0}")]
    Io(#[from] std::io::Error),
    /// The shared catalog (handlers on a store several nodes share) could not be read or
    /// written; nothing was activated.
    #[error("the shared handler catalog is unavailable: {0}")]
    Catalog(String),
    /// Another team owns a handler of that name.
    #[error(transparent)]
    OwnedByAnotherTeam(#[from] OwnedByAnotherTeam),
    /// The router is stopping ([`HandlerRegistry::close`]): nothing was stored or activated.
    #[error("the router is shutting down; nothing was changed")]
    ShuttingDown,
}

/// Failure of a registry operation other than upload.
#[derive(Debug, Error)]
pub enum RegistryError {
    /// No handler of that name.
    #[error("no handler named {0:?}")]
    UnknownHandler(String),
    /// No version matching the given number or hash.
    #[error("handler {name:?} has no version {version:?}")]
    UnknownVersion {
        /// The handler.
        name: String,
        /// What was asked for.
        version: String,
    },
    /// Words that cannot name a version at all (neither a number nor a hash prefix long
    /// enough to mean one).
    #[error(
        "{0:?} is not a version: give its number (e.g. \"3\" or \"v3\") or a prefix of its sha256 of at least 8 hex digits"
    )]
    InvalidVersion(String),
    /// A hash prefix matching more than one version.
    #[error("{0:?} matches more than one version; give more of the hash")]
    AmbiguousVersion(String),
    /// The stored version could not be loaded (missing or corrupt file, or it no longer links).
    #[error("cannot load {name:?} version {version}: {message}")]
    Load {
        /// The handler.
        name: String,
        /// The version number.
        version: u32,
        /// What went wrong.
        message: String,
    },
    /// Reading or writing the registry directory failed.
    #[error("handler registry I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The shared catalog (handlers on a store several nodes share) could not be read or
    /// written; nothing was changed.
    #[error("the shared handler catalog is unavailable: {0}")]
    Catalog(String),
    /// What a handler whose name was to be freed left (its queued deliveries, its key-value
    /// entries) could not be removed; the name stays kept.
    #[error("cannot release handler {name:?}, so its name stays kept: {message}")]
    Store {
        /// The handler.
        name: String,
        /// The store's error.
        message: String,
    },
    /// The router had no instance free to run the version's `describe` (a rollback checks
    /// it): nothing changed, and the same call may pass shortly. (An API answers it as
    /// unavailable, with a `Retry-After`.)
    #[error("{0}")]
    Busy(String),
    /// An `index.json` that cannot be read (it does not parse, or a newer router wrote it).
    /// At open the handler is listed with this as its `load_error`; changing it on this node
    /// is refused with this error, since writing over the file would lose what it holds.
    #[error("corrupt handler index {path}: {message}")]
    CorruptIndex {
        /// The file.
        path: PathBuf,
        /// The parse error.
        message: String,
    },
    /// Another team owns the handler.
    #[error(transparent)]
    OwnedByAnotherTeam(#[from] OwnedByAnotherTeam),
    /// The router is stopping ([`HandlerRegistry::close`]): nothing was changed.
    #[error("the router is shutting down; nothing was changed")]
    ShuttingDown,
}

/// A change refused because another team owns the handler (uploads, rollbacks and deletes
/// alike: `HandlerIndex::check_owner`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "handler {name:?} belongs to team {owner:?}; only its team or an administrator can change it"
)]
pub struct OwnedByAnotherTeam {
    /// The handler.
    pub name: String,
    /// Its owning team.
    pub owner: String,
}

/// A step of a delete. A plain delete is one `Keep` step. A release frees a name in two
/// steps, `Hold` then `Free`, with the handler's queued deliveries dead-lettered and its
/// key-value entries and logs removed in between (`HandlerChanges::delete_as`), so that a
/// crash half-way leaves the name held rather than free with the old team's data readable, or
/// its deliveries runnable, by the next team to claim it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeleteStep {
    /// Delete the handler's versions; the name and data stay (with its team, if any).
    Keep,
    /// Delete the handler's versions, if not yet, and hold the name while it is released.
    Hold,
    /// Give up a deleted handler's name.
    Free,
}

impl DeleteStep {
    /// The first step of a delete, releasing the name or not.
    pub(crate) fn first(release: bool) -> Self {
        if release { Self::Hold } else { Self::Keep }
    }
}

/// How a delete goes on after its first step (`DeleteStep::first`), given the record before
/// that step and whether the step deleted a live handler: `Ok(done)`, or `Err(owner)` when the
/// name is to be freed (`release`), with the team it was kept for, if any.
///
/// A plain delete never frees a name, even one no team owns: freeing removes the handler's
/// key-value entries (an idempotent handler's record of what it did) and logs for good, which
/// only an explicit release may do.
pub(crate) fn after_keep(
    before: Option<&HandlerIndex>,
    deleted: bool,
    release: bool,
) -> Result<Deletion, Option<String>> {
    let Some(before) = before else {
        return Ok(Deletion::Unknown);
    };
    if before.is_free() {
        return Ok(Deletion::Unknown);
    }
    let owner = before.effective_owner();
    if release {
        return Err(owner);
    }
    Ok(if deleted {
        Deletion::Deleted { kept_by: owner }
    } else {
        Deletion::Unknown
    })
}

/// What a delete did once its `Free` step ran (`freed`: it changed the record), after a
/// `Hold` step that deleted a live handler (`deleted`) kept for `owner`.
pub(crate) fn after_free(deleted: bool, freed: bool, owner: Option<String>) -> Deletion {
    match (deleted, freed) {
        (true, true) => Deletion::Deleted { kept_by: None },
        (true, false) => Deletion::Deleted { kept_by: owner },
        (false, true) => Deletion::Released,
        (false, false) => Deletion::Unknown,
    }
}

/// What a delete did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deletion {
    /// The handler and its versions are gone; `kept_by` still owns the name (`None`: free).
    Deleted {
        /// The team the name stays with.
        kept_by: Option<String>,
    },
    /// The handler was already deleted; its name is now free for any team.
    Released,
    /// No such handler (nor a kept name to release).
    Unknown,
}

struct Entry {
    index: HandlerIndex,
    active: Option<Arc<LoadedHandler>>,
    load_error: Option<String>,
    /// Its active version is left for [`HandlerRegistry::load_deferred`] to compile (set at
    /// open only; any change to the handler installs a new entry without it).
    loading: bool,
    /// The handler's `index.json` could not be read at open, and why: `index` is only a
    /// placeholder with its name, and the handler is changed here by nothing but a shared
    /// catalog's record (which is the truth there) until an operator fixes or removes the file.
    unreadable: Option<UnreadableIndex>,
}

/// Where and why a handler's index could not be read.
#[derive(Debug, Clone)]
struct UnreadableIndex {
    path: PathBuf,
    message: String,
}

impl UnreadableIndex {
    fn error(&self) -> RegistryError {
        RegistryError::CorruptIndex {
            path: self.path.clone(),
            message: self.message.clone(),
        }
    }
}

impl Entry {
    fn state(&self) -> HandlerState {
        if self.active.is_some() {
            HandlerState::Loaded
        } else if self.loading {
            HandlerState::Loading
        } else if self.load_error.is_some() {
            HandlerState::Failed
        } else {
            HandlerState::Inactive
        }
    }

    /// The loaded handler, or why there is none.
    fn lookup(&self, name: &str) -> Result<Arc<LoadedHandler>, NotLoaded> {
        if let Some(active) = &self.active {
            return Ok(active.clone());
        }
        if self.index.deleted {
            return Err(NotLoaded::NotUploaded(name.to_owned()));
        }
        match (self.loading, &self.load_error, self.index.active_version()) {
            (true, _, Some(v)) => Err(NotLoaded::Loading {
                name: name.to_owned(),
                version: v.version,
            }),
            (_, Some(error), _) => Err(NotLoaded::Failed {
                name: name.to_owned(),
                error: error.clone(),
            }),
            _ => Err(NotLoaded::NotUploaded(name.to_owned())),
        }
    }

    fn info(&self) -> HandlerInfo {
        HandlerInfo {
            name: self.index.name.clone(),
            active: self.index.active.as_ref().and_then(|sha| {
                self.index
                    .versions
                    .iter()
                    .find(|v| &v.sha256 == sha)
                    .cloned()
            }),
            versions: self.index.versions.clone(),
            owner: self.index.effective_owner(),
            state: self.state(),
            load_error: self.load_error.clone(),
            activated_at: self.index.activated_at.clone(),
            activated_by: self.index.activated_by.clone(),
        }
    }
}

/// The handler registry: see the module docs.
pub struct HandlerRegistry {
    dir: PathBuf,
    engine: Arc<WasmEngine>,
    entries: RwLock<HashMap<String, Entry>>,
    /// Serialises changes (upload's commit, rollback, delete) so index writes never interleave.
    /// Compilations are not serialised by it: an upload of a large component compiling for
    /// seconds must not hold up a rollback, whose version's compiled code is usually stored.
    write_lock: Mutex<()>,
    /// Reads and writes the versions' compiled code for this registry's engine.
    artifacts: Artifacts,
    /// Components compiled since the registry opened (not loaded from their compiled code).
    compilations: AtomicU64,
    /// Versions kept per handler (`handlers.keep_versions`).
    keep_versions: usize,
    /// Set by [`Self::close`] (with the write lock held): no change is made any more.
    closed: AtomicBool,
}

/// The warning logged when a version's stored compiled code fails its check (and is removed,
/// and the component compiled again).
pub(crate) const UNUSABLE_COMPILED_CODE: &str = "stored compiled code of a handler version failed its check; removed it and compiling the component again";

/// A component's compiled code, and whether it was compiled now (so not stored yet).
struct Compiled {
    component: Component,
    fresh: bool,
}

/// Versions kept per handler unless configured (`handlers.keep_versions`).
pub const DEFAULT_KEEP_VERSIONS: usize = 10;

impl std::fmt::Debug for HandlerRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerRegistry")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Whether `name` is a valid handler name.
pub fn valid_handler_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 64
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_' || *b == b'-')
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes `bytes` to `path` atomically (temp file, fsync, rename, fsync of the directory).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    fs::File::open(dir)?.sync_all()
}

impl HandlerRegistry {
    /// Opens (or creates) the registry in `dir` and loads every handler's active version,
    /// compiling those whose stored compiled code is missing or unusable
    /// ([`Self::open_deferred`] then [`Self::load_deferred`]).
    ///
    /// A handler whose active version cannot be loaded, or whose index cannot be read (corrupt,
    /// or of a newer format), stays listed with a `load_error` and no active version; the
    /// others are unaffected. One with an unreadable index is not changed here (uploads,
    /// rollbacks and deletes are refused with [`RegistryError::CorruptIndex`]) until the file
    /// is fixed or removed, since writing over it would lose what it holds.
    pub fn open(dir: impl Into<PathBuf>, engine: Arc<WasmEngine>) -> Result<Self, RegistryError> {
        let registry = Self::open_deferred(dir, engine)?;
        registry.load_deferred(&|| false);
        Ok(registry)
    }

    /// [`Self::open`] without compiling: a handler whose active version has usable stored
    /// compiled code is loaded from it (milliseconds), any other is left
    /// [`HandlerState::Loading`] for [`Self::load_deferred`]. A start compiled them all before
    /// serving: one 18 MB component kept ingest and `/healthz` from answering for 45 s after a
    /// router upgrade or a `handlers.fuel` switch (every compiled code of no use), N handlers N
    /// times that.
    pub fn open_deferred(
        dir: impl Into<PathBuf>,
        engine: Arc<WasmEngine>,
    ) -> Result<Self, RegistryError> {
        let dir = dir.into();
        fs::create_dir_all(&dir)?;
        let registry = Self {
            dir,
            artifacts: Artifacts::new(engine.engine()),
            engine,
            entries: RwLock::new(HashMap::new()),
            write_lock: Mutex::new(()),
            compilations: AtomicU64::new(0),
            keep_versions: DEFAULT_KEEP_VERSIONS,
            closed: AtomicBool::new(false),
        };
        let mut entries = HashMap::new();
        for dirent in fs::read_dir(&registry.dir)? {
            let dirent = dirent?;
            let name = dirent.file_name().to_string_lossy().into_owned();
            let index_path = dirent.path().join("index.json");
            if !valid_handler_name(&name) || !index_path.is_file() {
                continue;
            }
            // One unreadable index (corrupt, or written by a newer router) costs that handler
            // only: it is listed with why, and the others load.
            let read = fs::read(&index_path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| HandlerIndex::from_bytes(&bytes).map_err(|e| e.to_string()));
            let index = match read {
                Ok(index) => index,
                Err(message) => {
                    let unreadable = UnreadableIndex {
                        path: index_path.clone(),
                        message,
                    };
                    let error = unreadable.error();
                    tracing::error!(handler = %name, error = %error, "cannot read a handler's index; the handler is not loaded, and not changed here until the file is fixed or removed");
                    entries.insert(
                        name.clone(),
                        Entry {
                            index: HandlerIndex::empty(&name),
                            active: None,
                            load_error: Some(error.to_string()),
                            loading: false,
                            unreadable: Some(unreadable),
                        },
                    );
                    continue;
                }
            };
            // Compiled code that no kept version refers to (left by a crash between an index
            // write and the removal, or by a write that raced a removal) goes now.
            registry.prune_artifacts(&index, true);
            let active_version = index
                .active
                .as_ref()
                .and_then(|sha| index.versions.iter().find(|v| &v.sha256 == sha).cloned());
            let (active, load_error, loading) = match active_version {
                Some(info) => match registry.load_stored(&name, info) {
                    Ok(Some(loaded)) => (Some(Arc::new(loaded)), None, false),
                    Ok(None) => (None, None, true),
                    Err(e) => {
                        tracing::error!(handler = %name, error = %e, "cannot load the active handler version");
                        (None, Some(e.to_string()), false)
                    }
                },
                None => (None, None, false),
            };
            entries.insert(
                name,
                Entry {
                    index,
                    active,
                    load_error,
                    loading,
                    unreadable: None,
                },
            );
        }
        *registry
            .entries
            .write()
            .unwrap_or_else(PoisonError::into_inner) = entries;
        Ok(registry)
    }

    /// Compiles, one at a time, the active versions [`Self::open_deferred`] left
    /// [`HandlerState::Loading`], and makes each live as it is done, until none is left or
    /// `cancelled` says to stop (checked between compilations: one cannot be interrupted). A
    /// handler changed meanwhile (an upload, rollback or delete loads what it activates) keeps
    /// that change. One at a time: a start must not take every core from ingest and delivery.
    pub fn load_deferred(&self, cancelled: &dyn Fn() -> bool) {
        loop {
            if cancelled() {
                return;
            }
            let next = self
                .entries
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .filter(|(_, e)| e.loading)
                .map(|(name, e)| (name.clone(), e.index.active_version().cloned()))
                .min_by(|a, b| a.0.cmp(&b.0));
            let Some((name, info)) = next else {
                return;
            };
            let loaded = info.map(|info| {
                tracing::info!(handler = %name, version = info.version, "compiling a handler's active version in the background; its deliveries wait until it is loaded");
                // Tests stretch a compilation (milliseconds for a small one) to watch the
                // router while it runs.
                if let Some(stall) = crate::failpoint::delay_once("deferred_compile", &name) {
                    std::thread::sleep(stall);
                }
                let sha = info.sha256.clone();
                (sha, self.load_version(&name, info))
            });
            let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
            let Some(entry) = entries.get_mut(&name).filter(|e| e.loading) else {
                continue;
            };
            entry.loading = false;
            match loaded {
                Some((sha, Ok(handler))) if entry.index.active.as_deref() == Some(sha.as_str()) => {
                    tracing::info!(handler = %name, version = handler.info.version, "handler version loaded");
                    entry.active = Some(Arc::new(handler));
                }
                Some((_, Err(e))) => {
                    tracing::error!(handler = %name, error = %e, "cannot load the active handler version");
                    entry.load_error = Some(e.to_string());
                }
                _ => {}
            }
        }
    }

    /// Whether some active version still waits for [`Self::load_deferred`].
    pub fn loading(&self) -> bool {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .any(|e| e.loading)
    }

    /// Stops every change: once this returns, no upload, rollback, delete or catalog change
    /// writes or activates anything here (each is refused as
    /// [`RegistryError::ShuttingDown`]). A shutdown calls it: an upload whose client gave up
    /// still compiles on a blocking thread, and used to activate itself after the router had
    /// logged `stopped`. Waits for a change being written to finish.
    pub fn close(&self) {
        let _write = self
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Holds the lock every change takes to commit (tests: to keep an upload between its
    /// compilation and its commit).
    #[cfg(test)]
    pub(crate) fn hold_changes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether [`Self::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Refused once closed; called with the write lock held, so a change either finishes
    /// before `close` returns or is refused.
    fn check_open(&self) -> Result<(), RegistryError> {
        if self.is_closed() {
            return Err(RegistryError::ShuttingDown);
        }
        Ok(())
    }

    /// The registry keeping at most `n` versions per handler (at least 1; the active one is
    /// always kept).
    #[must_use]
    pub fn with_keep_versions(mut self, n: usize) -> Self {
        self.keep_versions = n.max(1);
        self
    }

    /// Versions kept per handler.
    pub fn keep_versions(&self) -> usize {
        self.keep_versions
    }

    /// Components compiled by this registry since it opened: those whose compiled code was not
    /// stored, or failed its check.
    pub fn compilations(&self) -> u64 {
        self.compilations.load(Ordering::Relaxed)
    }

    /// Checks `bytes` as a handler named `name` (see [`Validated`]) without storing anything.
    pub fn validate(&self, name: &str, bytes: &[u8]) -> Result<Validated, UploadError> {
        if !valid_handler_name(name) {
            return Err(UploadError::InvalidName(name.to_owned()));
        }
        if !bytes.starts_with(b"\0asm") {
            return Err(UploadError::NotComponent(
                "missing the \\0asm header".into(),
            ));
        }
        // Bytes 4..8 are the version and layer: 1, 0 for a core module (a component has 0x0d, 1).
        if bytes.get(4..8) == Some(&[1, 0, 0, 0][..]) {
            return Err(UploadError::WrongWorld(
                "this is a core WebAssembly module, not a component".into(),
            ));
        }
        let sha256 = sha256_hex(bytes);
        let compiled = self.compiled(name, &sha256, bytes).map_err(|e| {
            let c = self.engine.config();
            UploadError::Uncompilable(
                e,
                format!(
                    "{} bytes of linear memory (handlers.memory_bytes), {} core instances, {} table elements",
                    c.max_memory_bytes, c.max_core_instances_per_component, c.table_elements
                ),
            )
        })?;
        let pre = self
            .pre_instantiate(&compiled.component)
            .map_err(UploadError::WrongWorld)?;
        let descriptor = invoke::describe(&self.engine, &pre).map_err(|e| match e {
            invoke::DescribeError::Busy(m) => UploadError::Busy(m),
            invoke::DescribeError::Failed(m) => UploadError::DescribeFailed(m),
        })?;
        if descriptor.name != name {
            return Err(UploadError::NameMismatch {
                expected: name.to_owned(),
                described: descriptor.name,
            });
        }
        // Tests stretch a compilation (as a large component's is: tens of seconds) to stop
        // the router, or let its client give up, while it runs.
        if let Some(stall) = crate::failpoint::delay_once("upload_compile", name) {
            std::thread::sleep(stall);
        }
        Ok(Validated {
            name: name.to_owned(),
            sha256,
            size: bytes.len() as u64,
            descriptor,
            pre,
            compiled,
        })
    }

    /// Validates `bytes` as a handler named `name` and, only if it passes, stores it as a new
    /// version and activates it. Uploading bytes identical to a stored version re-activates that
    /// version.
    pub fn upload(
        &self,
        name: &str,
        bytes: &[u8],
        uploader: impl Into<Uploader>,
    ) -> Result<VersionInfo, UploadError> {
        let uploader = uploader.into();
        let validated = self.validate(name, bytes)?;
        let _write = self
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.is_closed() {
            return Err(UploadError::ShuttingDown);
        }
        self.check_readable(name)
            .map_err(|e| UploadError::UnreadableIndex(Box::new(e)))?;
        let index = self
            .index_of(name)
            .unwrap_or_else(|| HandlerIndex::empty(name));
        let (index, info) = index.with_upload(&validated, &uploader, self.keep_versions)?;
        self.store_component(name, &info.sha256, bytes)?;
        self.write_index(&index)?;
        self.prune_components(&index);
        self.keep_compiled(name, &info.sha256, &validated.compiled);
        self.install(
            index,
            Some(Arc::new(LoadedHandler {
                info: info.clone(),
                pre: validated.pre,
                engine: self.engine.clone(),
            })),
        );
        tracing::info!(handler = name, version = info.version, sha256 = %info.sha256, uploader = %uploader.token, "handler version activated");
        Ok(info)
    }

    /// Makes `index` (a shared catalog's record, `wasm::catalog`) this registry's state of its
    /// handler: a deleted one is removed; otherwise the index is written and its active version
    /// loaded, from `validated` when that is the active version (an upload made here), else
    /// from its component file, which the caller stores first. A version that cannot be loaded
    /// leaves the handler listed with its `load_error` and no active version, as at `open`.
    pub(crate) fn apply(
        &self,
        index: HandlerIndex,
        validated: Option<Validated>,
    ) -> Result<Option<VersionInfo>, RegistryError> {
        let _write = self
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.check_open()?;
        if index.deleted {
            self.remove(index)?;
            return Ok(None);
        }
        fs::create_dir_all(self.dir.join(&index.name))?;
        self.write_index(&index)?;
        self.prune_components(&index);
        let Some(info) = index.active_version().cloned() else {
            self.install(index, None);
            return Ok(None);
        };
        let loaded = match validated {
            Some(v) if v.sha256 == info.sha256 => {
                self.keep_compiled(&index.name, &info.sha256, &v.compiled);
                Ok(LoadedHandler {
                    info: info.clone(),
                    pre: v.pre,
                    engine: self.engine.clone(),
                })
            }
            _ => self.load_version(&index.name, info.clone()),
        };
        match loaded {
            Ok(loaded) => {
                self.install(index, Some(Arc::new(loaded)));
                Ok(Some(info))
            }
            Err(e) => {
                let name = index.name.clone();
                self.install(index, None);
                if let Some(entry) = self
                    .entries
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_mut(&name)
                {
                    entry.load_error = Some(e.to_string());
                }
                Err(e)
            }
        }
    }

    /// Whether the component `sha256` of `name` is stored here, intact (its bytes hash to
    /// `sha256`): a damaged copy is as good as none, and is fetched again.
    pub(crate) fn has_component(&self, name: &str, sha256: &str) -> bool {
        fs::read(self.component_path(name, sha256))
            .is_ok_and(|stored| sha256_hex(&stored) == sha256)
    }

    /// Stores a component's bytes, after checking they match `sha256`. A file already there is
    /// kept only when it holds these bytes; any other (damaged on disk, cut short) is replaced.
    /// Kept unchecked before, a damaged one outlived an upload of the right bytes (answered
    /// 200, and live from memory) and failed the version again at the next start.
    pub(crate) fn store_component(
        &self,
        name: &str,
        sha256: &str,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        if !valid_handler_name(name) || sha256_hex(bytes) != sha256 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("component of {name:?} does not match its SHA-256 {sha256}"),
            ));
        }
        if self.has_component(name, sha256) {
            return Ok(());
        }
        fs::create_dir_all(self.dir.join(name))?;
        write_atomic(&self.component_path(name, sha256), bytes)
    }

    /// A stored component's bytes.
    pub(crate) fn component_bytes(&self, name: &str, sha256: &str) -> std::io::Result<Vec<u8>> {
        fs::read(self.component_path(name, sha256))
    }

    /// Whether `bytes` are what was last preloaded as `name` (see `HandlerIndex::preloaded`).
    pub fn was_preloaded(&self, name: &str, bytes: &[u8]) -> bool {
        let sha256 = sha256_hex(bytes);
        self.index_of(name)
            .is_some_and(|i| i.preloaded.as_deref() == Some(sha256.as_str()))
    }

    /// The stored version of `name` whose component is `bytes`, if there is one.
    pub fn stored_version(&self, name: &str, bytes: &[u8]) -> Option<VersionInfo> {
        let sha256 = sha256_hex(bytes);
        self.index_of(name)?
            .versions
            .into_iter()
            .find(|v| v.sha256 == sha256)
    }

    /// Every handler's index, as stored here (those that could not be read left out).
    pub(crate) fn indexes(&self) -> Vec<HandlerIndex> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|e| e.unreadable.is_none())
            .map(|e| e.index.clone())
            .collect()
    }

    /// One handler's index, as stored here (for a deleted handler whose team keeps the name,
    /// its record).
    pub(crate) fn index(&self, name: &str) -> Option<HandlerIndex> {
        self.index_of(name)
    }

    /// Removes the component files of `index`'s handler that its index no longer names
    /// (versions past `keep_versions`), and their compiled code. Called with the write lock
    /// held, after the index is written: a crash in between leaves files no index names,
    /// removed by the next change (compiled code also by the next start). A file that cannot
    /// be removed is logged and tried again then.
    fn prune_components(&self, index: &HandlerIndex) {
        self.prune_artifacts(index, false);
        let dir = self.dir.join(&index.name);
        let Ok(listing) = fs::read_dir(&dir) else {
            return;
        };
        for dirent in listing.flatten() {
            let path = dirent.path();
            let Some(sha) = path
                .file_name()
                .and_then(|f| f.to_str())
                .and_then(|f| f.strip_suffix(".wasm"))
            else {
                continue;
            };
            if index.versions.iter().any(|v| v.sha256 == sha) {
                continue;
            }
            match fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(handler = %index.name, sha256 = sha, "component of a version no longer kept removed");
                }
                Err(e) => {
                    tracing::warn!(handler = %index.name, sha256 = sha, error = %e, "cannot remove the component of a version no longer kept; the next change tries again");
                }
            }
        }
    }

    /// Removes the compiled code of `index`'s handler that no version it keeps refers to and,
    /// with `leftovers` (at open, when no write can be running), the temp files of writes that
    /// never finished.
    fn prune_artifacts(&self, index: &HandlerIndex, leftovers: bool) {
        let Ok(listing) = fs::read_dir(self.dir.join(&index.name)) else {
            return;
        };
        for dirent in listing.flatten() {
            let file_name = dirent.file_name();
            let Some(file_name) = file_name.to_str() else {
                continue;
            };
            let unused = match artifact::artifact_of(file_name) {
                Some(sha) => !index.versions.iter().any(|v| v.sha256 == sha),
                None => leftovers && artifact::is_leftover(file_name),
            };
            if !unused {
                continue;
            }
            match fs::remove_file(dirent.path()) {
                Ok(()) => {
                    tracing::info!(handler = %index.name, file = file_name, "compiled code no kept version refers to removed");
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(handler = %index.name, file = file_name, error = %e, "cannot remove compiled code no kept version refers to; the next change or start tries again");
                }
            }
        }
    }

    fn component_path(&self, name: &str, sha256: &str) -> PathBuf {
        self.dir.join(name).join(format!("{sha256}.wasm"))
    }

    fn artifact_path(&self, name: &str, sha256: &str) -> PathBuf {
        self.dir
            .join(name)
            .join(format!("{sha256}.{}", artifact::EXTENSION))
    }

    /// Activates an earlier version, named by its number (`3` or `v3`) or its SHA-256 (or a
    /// unique prefix of at least 8 hex digits), as an operator.
    pub fn rollback(&self, name: &str, version: &str) -> Result<VersionInfo, RegistryError> {
        self.rollback_as(name, version, &Uploader::from("operator"))
    }

    /// [`Self::rollback`] by `who`, refused when another team owns the handler.
    pub fn rollback_as(
        &self,
        name: &str,
        version: &str,
        who: &Uploader,
    ) -> Result<VersionInfo, RegistryError> {
        // The version is loaded (from the compilation cache, or compiled) before the write
        // lock is taken, so a rollback never waits behind another handler's change, and the
        // choice is checked again under the lock in case that change removed the version.
        let chosen = || -> Result<(HandlerIndex, VersionInfo), RegistryError> {
            self.check_readable(name)?;
            self.index_of(name)
                .ok_or_else(|| RegistryError::UnknownHandler(name.to_owned()))?
                .with_active(version, who)
        };
        let (_, planned) = chosen()?;
        let loaded = Arc::new(self.load_version(name, planned)?);
        let _write = self
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.check_open()?;
        let (index, info) = chosen()?;
        if info != loaded.info {
            // A change in between made the same words name another version (a hash prefix
            // now ambiguous, the version pruned): refuse rather than guess.
            return Err(RegistryError::UnknownVersion {
                name: name.to_owned(),
                version: version.to_owned(),
            });
        }
        self.write_index(&index)?;
        self.install(index, Some(loaded));
        tracing::info!(handler = name, version = info.version, sha256 = %info.sha256, "handler rolled back");
        Ok(info)
    }

    /// Removes a handler's versions, as an operator; its name stays kept (with the team that
    /// owns it, if any) until released. Returns whether it existed.
    /// Invocations already running keep their `Arc<LoadedHandler>` and finish.
    pub fn delete(&self, name: &str) -> Result<bool, RegistryError> {
        let deletion = self.delete_as(name, &Uploader::from("operator"), false)?;
        Ok(deletion != Deletion::Unknown)
    }

    /// [`Self::delete`] by `who`, refused when another team owns the handler. The name stays
    /// (with its team, if any) unless `release`; releasing the name of a handler already
    /// deleted frees it. The registry alone keeps no key-value entries or logs:
    /// `HandlerChanges::delete_as` removes those before a name is freed.
    pub fn delete_as(
        &self,
        name: &str,
        who: &Uploader,
        release: bool,
    ) -> Result<Deletion, RegistryError> {
        let (before, changed) = self.delete_step(name, who, DeleteStep::first(release))?;
        let deleted = changed && before.as_ref().is_some_and(|b| !b.deleted);
        match after_keep(before.as_ref(), deleted, release) {
            Ok(done) => Ok(done),
            Err(owner) => {
                let (_, freed) = self.delete_step(name, who, DeleteStep::Free)?;
                Ok(after_free(deleted, freed, owner))
            }
        }
    }

    /// One step of a delete (`HandlerIndex::deleted_by`) on this registry: the record before
    /// it, and whether the step changed it.
    pub(crate) fn delete_step(
        &self,
        name: &str,
        who: &Uploader,
        step: DeleteStep,
    ) -> Result<(Option<HandlerIndex>, bool), RegistryError> {
        let _write = self
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.check_open()?;
        self.check_readable(name)?;
        let Some(before) = self.index_of(name) else {
            return Ok((None, false));
        };
        let Some(tombstone) = before.deleted_by(who, step)? else {
            return Ok((Some(before), false));
        };
        self.remove(tombstone)?;
        tracing::info!(handler = name, ?step, by = %who.token, "handler deleted");
        Ok((Some(before), true))
    }

    /// Makes `tombstone` (a deleted handler's record) this registry's state, with the write
    /// lock held: its components are removed and, while the name is kept, only its index
    /// stays; a freed name leaves nothing behind.
    fn remove(&self, tombstone: HandlerIndex) -> Result<(), RegistryError> {
        let name = tombstone.name.clone();
        let dir = self.dir.join(&name);
        if !tombstone.is_free() && valid_handler_name(&name) {
            fs::create_dir_all(&dir)?;
            self.write_index(&tombstone)?;
            self.prune_components(&tombstone);
            self.install(tombstone, None);
            return Ok(());
        }
        self.entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&name);
        if valid_handler_name(&name) && dir.is_dir() {
            fs::remove_dir_all(&dir)?;
        }
        Ok(())
    }

    /// Every handler, sorted by name.
    pub fn list(&self) -> Vec<HandlerInfo> {
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        let mut list: Vec<_> = entries
            .values()
            .filter(|e| !e.index.deleted)
            .map(Entry::info)
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// One handler's versions and state.
    pub fn get(&self, name: &str) -> Option<HandlerInfo> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .filter(|e| !e.index.deleted)
            .map(Entry::info)
    }

    /// The active version of `name`, ready to invoke.
    pub fn active(&self, name: &str) -> Option<Arc<LoadedHandler>> {
        self.lookup(name).ok()
    }

    /// The active version of `name`, ready to invoke, or why there is none (read at once, so
    /// the cause is that of the same moment).
    pub fn lookup(&self, name: &str) -> Result<Arc<LoadedHandler>, NotLoaded> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .map_or_else(
                || Err(NotLoaded::NotUploaded(name.to_owned())),
                |e| e.lookup(name),
            )
    }

    /// The index of `name`; `None` when there is none or it could not be read.
    fn index_of(&self, name: &str) -> Option<HandlerIndex> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .filter(|e| e.unreadable.is_none())
            .map(|e| e.index.clone())
    }

    /// Refused when the index of `name` could not be read at open: a change made here would
    /// write over it.
    fn check_readable(&self, name: &str) -> Result<(), RegistryError> {
        match self
            .entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .and_then(|e| e.unreadable.as_ref())
        {
            Some(unreadable) => Err(unreadable.error()),
            None => Ok(()),
        }
    }

    fn install(&self, index: HandlerIndex, active: Option<Arc<LoadedHandler>>) {
        let name = index.name.clone();
        self.entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                name,
                Entry {
                    index,
                    active,
                    load_error: None,
                    loading: false,
                    unreadable: None,
                },
            );
    }

    fn write_index(&self, index: &HandlerIndex) -> std::io::Result<()> {
        write_atomic(
            &self.dir.join(&index.name).join("index.json"),
            &index.to_bytes(),
        )
    }

    /// The compiled code of component `sha256` of `name` (whose bytes are `bytes`): its stored
    /// compiled code when that passes its checks, else compiled now. Stored compiled code that
    /// fails a check is removed, with a warning, and never loaded: a damaged file would run as
    /// garbage machine code (a crash of the whole router) or as another handler's code.
    fn compiled(&self, name: &str, sha256: &str, bytes: &[u8]) -> Result<Compiled, String> {
        if let Some(component) = self.stored_compiled(name, sha256) {
            return Ok(Compiled {
                component,
                fresh: false,
            });
        }
        let component =
            Component::new(self.engine.engine(), bytes).map_err(|e| format!("{e:#}"))?;
        self.compilations.fetch_add(1, Ordering::Relaxed);
        Ok(Compiled {
            component,
            fresh: true,
        })
    }

    /// The stored compiled code of component `sha256` of `name` when it passes its checks;
    /// `None` when there is none or it failed (then removed, with a warning).
    fn stored_compiled(&self, name: &str, sha256: &str) -> Option<Component> {
        let path = self.artifact_path(name, sha256);
        match self.artifacts.load(self.engine.engine(), &path, sha256) {
            Ok(component) => return Some(component),
            Err(ArtifactError::Missing(_)) => {}
            Err(e) => {
                if e.is_damage() {
                    tracing::warn!(handler = name, sha256, error = %e, "{UNUSABLE_COMPILED_CODE}");
                } else {
                    tracing::info!(handler = name, sha256, reason = %e, "stored compiled code is of no use to this engine; compiling the component again");
                }
                if let Err(e) = fs::remove_file(&path)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(handler = name, sha256, error = %e, "cannot remove unusable compiled code; it is checked and refused again at each load");
                }
            }
        }
        None
    }

    /// Stores `compiled` as the compiled code of component `sha256` of `name`, when it was
    /// compiled now (not loaded from there). A failure costs only speed: the next start
    /// compiles the component again.
    fn keep_compiled(&self, name: &str, sha256: &str, compiled: &Compiled) {
        if !compiled.fresh {
            return;
        }
        let path = self.artifact_path(name, sha256);
        if let Err(e) = self.artifacts.store(&path, sha256, &compiled.component) {
            tracing::warn!(handler = name, sha256, error = %e, "cannot store a version's compiled code; it is compiled again at its next load");
        }
    }

    fn pre_instantiate(&self, component: &Component) -> Result<HandlerPre<HostState>, String> {
        let pre = self
            .engine
            .linker()
            .instantiate_pre(component)
            .map_err(|e| format!("{e:#}"))?;
        HandlerPre::new(pre).map_err(|e| format!("{e:#}"))
    }

    /// The bytes of `info`'s component, checked against its hash.
    fn version_bytes(&self, name: &str, info: &VersionInfo) -> Result<Vec<u8>, RegistryError> {
        let load_err = |message: String| RegistryError::Load {
            name: name.to_owned(),
            version: info.version,
            message,
        };
        let path = self.component_path(name, &info.sha256);
        let bytes = fs::read(&path).map_err(|e| load_err(format!("{}: {e}", path.display())))?;
        if sha256_hex(&bytes) != info.sha256 {
            return Err(load_err(format!(
                "{} does not match its SHA-256",
                path.display()
            )));
        }
        Ok(bytes)
    }

    /// [`Self::load_version`] from stored compiled code only: `None` when it would have to
    /// compile. The component is checked all the same, so a damaged one fails here, at once.
    fn load_stored(
        &self,
        name: &str,
        info: VersionInfo,
    ) -> Result<Option<LoadedHandler>, RegistryError> {
        self.version_bytes(name, &info)?;
        let Some(component) = self.stored_compiled(name, &info.sha256) else {
            return Ok(None);
        };
        let pre = self
            .pre_instantiate(&component)
            .map_err(|message| RegistryError::Load {
                name: name.to_owned(),
                version: info.version,
                message,
            })?;
        Ok(Some(LoadedHandler {
            info,
            pre,
            engine: self.engine.clone(),
        }))
    }

    fn load_version(&self, name: &str, info: VersionInfo) -> Result<LoadedHandler, RegistryError> {
        let load_err = |message: String| RegistryError::Load {
            name: name.to_owned(),
            version: info.version,
            message,
        };
        let bytes = self.version_bytes(name, &info)?;
        let compiled = self
            .compiled(name, &info.sha256, &bytes)
            .map_err(&load_err)?;
        let pre = self
            .pre_instantiate(&compiled.component)
            .map_err(&load_err)?;
        self.keep_compiled(name, &info.sha256, &compiled);
        Ok(LoadedHandler {
            info,
            pre,
            engine: self.engine.clone(),
        })
    }
}

fn find_version<'a>(
    index: &'a HandlerIndex,
    name: &str,
    version: &str,
) -> Result<&'a VersionInfo, RegistryError> {
    let unknown = || RegistryError::UnknownVersion {
        name: name.to_owned(),
        version: version.to_owned(),
    };
    let number = version.strip_prefix('v').unwrap_or(version);
    if !number.is_empty() && number.len() < 8 && number.bytes().all(|b| b.is_ascii_digit()) {
        let n: u32 = number.parse().map_err(|_| unknown())?;
        return index
            .versions
            .iter()
            .find(|v| v.version == n)
            .ok_or_else(unknown);
    }
    let prefix = version.to_ascii_lowercase();
    if prefix.len() < 8 || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
        // Not a miss: nothing could ever match it (a 404 sent callers looking for a version).
        return Err(RegistryError::InvalidVersion(version.to_owned()));
    }
    let mut matches = index
        .versions
        .iter()
        .filter(|v| v.sha256.starts_with(&prefix));
    match (matches.next(), matches.next()) {
        (Some(v), None) => Ok(v),
        (Some(_), Some(_)) => Err(RegistryError::AmbiguousVersion(version.to_owned())),
        (None, _) => Err(unknown()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_names() {
        for ok in ["a", "enrich_py", "billing-v2", "0x"] {
            assert!(valid_handler_name(ok), "{ok}");
        }
        for bad in ["", "-a", "_a", "A", "a.b", "a/b", ".cache", &"a".repeat(65)] {
            assert!(!valid_handler_name(bad), "{bad}");
        }
    }

    fn version(n: u32, sha: &str) -> VersionInfo {
        VersionInfo {
            version: n,
            sha256: sha.into(),
            size: 1,
            uploader: "u".into(),
            team: None,
            uploaded_at: "t".into(),
            descriptor: HandlerDescriptor {
                name: "h".into(),
                version: "1".into(),
                accepts: vec![],
            },
        }
    }

    #[test]
    fn versions_are_found_by_number_or_hash_prefix() {
        let index = HandlerIndex {
            format: INDEX_FORMAT,
            name: "h".into(),
            active: None,
            versions: vec![
                version(1, "aaaaaaaa11"),
                version(2, "aaaaaaaa22"),
                version(12, "bbbbbbbb33"),
            ],
            owner: None,
            preloaded: None,
            deleted: false,
            kept: false,
            activated_at: None,
            activated_by: None,
        };
        assert_eq!(find_version(&index, "h", "2").unwrap().version, 2);
        assert_eq!(find_version(&index, "h", "v12").unwrap().version, 12);
        assert_eq!(find_version(&index, "h", "bbbbbbbb").unwrap().version, 12);
        assert!(matches!(
            find_version(&index, "h", "aaaaaaaa"),
            Err(RegistryError::AmbiguousVersion(_))
        ));
        assert!(matches!(
            find_version(&index, "h", "7"),
            Err(RegistryError::UnknownVersion { .. })
        ));
        assert!(matches!(
            find_version(&index, "h", "cccccccc"),
            Err(RegistryError::UnknownVersion { .. })
        ));
        // What cannot name a version is said so, not looked for.
        for malformed in ["zz", "abc", "abcdef1", "", "v", "bbbbbbb"] {
            assert!(
                matches!(
                    find_version(&index, "h", malformed),
                    Err(RegistryError::InvalidVersion(_))
                ),
                "{malformed:?}"
            );
        }
    }

    #[test]
    fn accepts_follows_the_descriptor() {
        let mut d = HandlerDescriptor {
            name: "h".into(),
            version: "1".into(),
            accepts: vec![],
        };
        assert!(d.accepts("anything", 9));
        d.accepts.push(AcceptedType {
            event_type: "order.paid".into(),
            versions: vec![2],
        });
        assert!(d.accepts("order.paid", 2));
        assert!(!d.accepts("order.paid", 1));
        assert!(!d.accepts("other", 2));
    }
}
