//! Compiled code of stored handler versions (artifacts), kept on disk by the handler registry
//! so that a restart or a rollback loads machine code instead of compiling, and checked before
//! every load so that it never runs code the router did not write for that component.
//!
//! Loading compiled code is trusting it: wasmtime maps it executable as it is (which is why
//! `Component::deserialize` is an `unsafe fn`). wasmtime's own cache, used before, loaded its
//! files unchecked (zstd frames without a content checksum): one flipped bit ran as garbage
//! native code (SIGSEGV on the handler's first delivery, SIGILL at every start), and another
//! component's file copied over one ran as that handler. Here every artifact carries a SHA-256
//! over everything it holds, the fingerprint of the engine that compiled it and the SHA-256 of
//! its component, and [`Artifacts::load`] checks all three right before handing the bytes to
//! wasmtime. Whatever fails a check is reported, and the registry removes it and compiles the
//! component again.
//!
//! Format of an artifact file (`<component sha256>.cwasm`, beside its component in the
//! registry): [`MAGIC`], then the SHA-256 of the rest, then the engine fingerprint (32 bytes),
//! the component's SHA-256 (32 bytes) and the serialized component (`Component::serialize`).
//! A file is written whole (temp file, fsync, rename), so a crash leaves the old file or the
//! new one, and the checksum catches whatever else the disk does to it.

use std::fs;
use std::hash::Hasher;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use thiserror::Error;
use wasmtime::Engine;
use wasmtime::component::Component;

/// First bytes of an artifact file (the last two digits are its format).
const MAGIC: &[u8; 8] = b"RTRCWA01";

/// Bytes before the serialized component: magic, checksum, engine fingerprint, component hash.
const HEADER_LEN: usize = MAGIC.len() + 32 + 32 + 32;

/// File extension of an artifact.
pub(crate) const EXTENSION: &str = "cwasm";

/// Why a stored artifact is not used.
#[derive(Debug, Error)]
pub(crate) enum ArtifactError {
    /// No artifact is stored (the usual case for a version never loaded on this node).
    #[error("no compiled code stored at {0}")]
    Missing(PathBuf),
    /// The file could not be read.
    #[error("cannot read compiled code {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not what the router wrote for this component (truncated, changed on disk,
    /// or another component's).
    #[error("compiled code {path} fails its check: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Which check failed.
        reason: &'static str,
    },
    /// Written by a router whose engine compiles differently (another wasmtime version, or
    /// another setting such as fuel): intact, but of no use to this engine.
    #[error("compiled code {0} was compiled by another wasmtime version or engine configuration")]
    OtherEngine(PathBuf),
    /// wasmtime refused code that passed the checks (it checks the engine's compatibility
    /// again, so this is unexpected).
    #[error("wasmtime refused compiled code {path}: {message}")]
    Refused {
        /// The file.
        path: PathBuf,
        /// wasmtime's error.
        message: String,
    },
    /// Writing an artifact failed.
    #[error("cannot store compiled code {path}: {message}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl ArtifactError {
    /// Whether this is a file that something damaged or replaced (worth a warning), rather
    /// than none at all or one left by another engine configuration.
    pub(crate) fn is_damage(&self) -> bool {
        matches!(
            self,
            Self::Read { .. } | Self::Corrupt { .. } | Self::Refused { .. }
        )
    }
}

/// Reads and writes artifacts for one engine.
#[derive(Debug, Clone)]
pub(crate) struct Artifacts {
    /// The engine's [`fingerprint`].
    fingerprint: [u8; 32],
}

impl Artifacts {
    /// Artifacts compiled by `engine`.
    pub(crate) fn new(engine: &Engine) -> Self {
        Self {
            fingerprint: fingerprint(engine),
        }
    }

    /// The compiled code of component `sha256` (lowercase hex) stored at `path`, once the file
    /// passed every check (see the module docs).
    pub(crate) fn load(
        &self,
        engine: &Engine,
        path: &Path,
        sha256: &str,
    ) -> Result<Component, ArtifactError> {
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ArtifactError::Missing(path.to_owned()));
            }
            Err(source) => {
                return Err(ArtifactError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let code = self.check(&bytes, sha256).map_err(|check| match check {
            Check::Corrupt(reason) => ArtifactError::Corrupt {
                path: path.to_owned(),
                reason,
            },
            Check::OtherEngine => ArtifactError::OtherEngine(path.to_owned()),
        })?;
        // SAFETY: `Component::deserialize` maps `code` as executable machine code, so it must
        // be what `Component::serialize` produced for an engine compatible with this one. It
        // is: `check` has just verified, on the bytes read into memory here (so nothing can
        // change them in between), the SHA-256 this router computed over exactly these bytes
        // when it wrote them, along with this engine's fingerprint and this component's hash
        // that it recorded beside them. A file damaged or replaced on disk (another
        // component's, another engine's) fails that check and never gets here. wasmtime also
        // checks the code's header against the engine's configuration before using it.
        #[allow(unsafe_code)]
        let loaded = unsafe { Component::deserialize(engine, code) };
        loaded.map_err(|e| ArtifactError::Refused {
            path: path.to_owned(),
            message: format!("{e:#}"),
        })
    }

    /// The serialized component inside `bytes`, if they are an intact artifact of component
    /// `sha256` compiled by this engine.
    fn check<'a>(&self, bytes: &'a [u8], sha256: &str) -> Result<&'a [u8], Check> {
        if bytes.len() < HEADER_LEN {
            return Err(Check::Corrupt("shorter than its header"));
        }
        let (magic, rest) = bytes.split_at(MAGIC.len());
        if magic != MAGIC {
            return Err(Check::Corrupt("not a compiled-code file of this router"));
        }
        let (checksum, body) = rest.split_at(32);
        if Sha256::digest(body).as_slice() != checksum {
            return Err(Check::Corrupt("its SHA-256 does not match its contents"));
        }
        let (fingerprint, body) = body.split_at(32);
        let (component, code) = body.split_at(32);
        if hex::encode(component) != sha256 {
            return Err(Check::Corrupt("it holds the code of another component"));
        }
        if fingerprint != self.fingerprint {
            return Err(Check::OtherEngine);
        }
        Ok(code)
    }

    /// Stores `component` (component `sha256`'s compiled code) at `path`, replacing what is
    /// there.
    pub(crate) fn store(
        &self,
        path: &Path,
        sha256: &str,
        component: &Component,
    ) -> Result<(), ArtifactError> {
        let err = |message: String| ArtifactError::Write {
            path: path.to_owned(),
            message,
        };
        let hash = hex::decode(sha256)
            .ok()
            .filter(|h| h.len() == 32)
            .ok_or_else(|| err(format!("{sha256:?} is not a SHA-256")))?;
        let code = component.serialize().map_err(|e| err(format!("{e:#}")))?;
        let mut digest = Sha256::new();
        digest.update(self.fingerprint);
        digest.update(&hash);
        digest.update(&code);
        let checksum = digest.finalize();
        write_atomic(
            path,
            &[MAGIC, &checksum[..], &self.fingerprint, &hash, &code],
        )
        .map_err(|e| err(e.to_string()))
    }
}

/// A failed [`Artifacts::check`].
#[derive(Debug, PartialEq, Eq)]
enum Check {
    Corrupt(&'static str),
    OtherEngine,
}

/// What identifies the code `engine` compiles: wasmtime's compatibility hash (the target, the
/// compiler's flags, the tunables and features, wasmtime's version) fed into a SHA-256, which,
/// unlike std's hasher, gives the same answer in every build of the router.
fn fingerprint(engine: &Engine) -> [u8; 32] {
    struct Sha256Hasher(Sha256);
    impl Hasher for Sha256Hasher {
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            // Only the full digest is used (below); `Hasher` requires this.
            let digest = self.0.clone().finalize();
            u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
        }
    }
    let mut hasher = Sha256Hasher(Sha256::new());
    std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
    hasher.0.finalize().into()
}

/// Distinguishes the temp files of writes running at once (two rollbacks loading the same
/// version), which would otherwise interleave their bytes in one file.
static WRITES: AtomicU64 = AtomicU64::new(0);

/// Writes `parts` to `path` whole: a temp file beside it, fsync, rename, fsync of the
/// directory. The temp file's name ends in `.tmp` and starts with a dot (see [`is_leftover`]).
fn write_atomic(path: &Path, parts: &[&[u8]]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.{}-{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = fs::File::create(&tmp)?;
        for part in parts {
            f.write_all(part)?;
        }
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        // Best effort: a temp file left over is removed at the next start.
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// The component hash an artifact file is named for (`<sha256>.cwasm`), if `file_name` is one.
pub(crate) fn artifact_of(file_name: &str) -> Option<&str> {
    file_name
        .strip_suffix(EXTENSION)
        .and_then(|f| f.strip_suffix('.'))
        .filter(|f| !f.starts_with('.'))
}

/// Whether `file_name` is the temp file of an artifact write that never finished (a crash, or
/// a failed write): removed at the registry's open, when no write can be running.
pub(crate) fn is_leftover(file_name: &str) -> bool {
    file_name.starts_with('.')
        && file_name.ends_with(".tmp")
        && file_name.contains(&format!(".{EXTENSION}."))
}

/// Removes the compilation cache of routers before this one (wasmtime's own cache, in
/// `<handlers dir>/compiled`), whose files were loaded unchecked. Returns the bytes it held,
/// or `None` when there was none. The handlers it cached are compiled once more, at their
/// first load, and kept as artifacts from then on.
pub(crate) fn remove_legacy_cache(dir: &Path) -> std::io::Result<Option<u64>> {
    if !dir.is_dir() {
        return Ok(None);
    }
    let bytes = disk_usage(dir);
    fs::remove_dir_all(dir)?;
    Ok(Some(bytes))
}

fn disk_usage(dir: &Path) -> u64 {
    let Ok(listing) = fs::read_dir(dir) else {
        return 0;
    };
    listing
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => disk_usage(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A component with no imports or exports: compiles in milliseconds.
    fn empty_component(engine: &Engine) -> Component {
        Component::new(engine, wat::parse_str("(component)").unwrap()).unwrap()
    }

    const SHA: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const OTHER: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    #[test]
    fn an_intact_artifact_loads_and_every_damage_is_caught() {
        let engine = Engine::default();
        let artifacts = Artifacts::new(&engine);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{SHA}.cwasm"));
        assert!(matches!(
            artifacts.load(&engine, &path, SHA),
            Err(ArtifactError::Missing(_))
        ));
        artifacts
            .store(&path, SHA, &empty_component(&engine))
            .unwrap();
        artifacts.load(&engine, &path, SHA).unwrap();
        let good = fs::read(&path).unwrap();
        assert_eq!(
            artifacts.check(&good, SHA).unwrap().len(),
            good.len() - HEADER_LEN
        );
        // Any single flipped bit, anywhere in the file, fails the check.
        for i in (0..good.len())
            .step_by(97)
            .chain([0, 8, 40, 72, 104, good.len() - 1])
        {
            let mut bad = good.clone();
            bad[i] ^= 1 << (i % 8);
            assert!(
                matches!(artifacts.check(&bad, SHA), Err(Check::Corrupt(_))),
                "a bit flipped at {i} passed"
            );
        }
        assert_eq!(
            artifacts.check(&good[..good.len() - 1], SHA),
            Err(Check::Corrupt("its SHA-256 does not match its contents"))
        );
        assert_eq!(
            artifacts.check(&good[..10], SHA),
            Err(Check::Corrupt("shorter than its header"))
        );
        // Another component's intact artifact, copied over this one.
        assert_eq!(
            artifacts.check(&good, OTHER),
            Err(Check::Corrupt("it holds the code of another component"))
        );
        // An engine compiling differently (fuel on) does not take it.
        let fuel = Engine::new(wasmtime::Config::new().consume_fuel(true)).unwrap();
        assert_eq!(
            Artifacts::new(&fuel).check(&good, SHA),
            Err(Check::OtherEngine)
        );
        assert_eq!(fingerprint(&engine), fingerprint(&Engine::default()));
    }

    #[test]
    fn artifact_file_names() {
        assert_eq!(artifact_of(&format!("{SHA}.cwasm")), Some(SHA));
        assert_eq!(artifact_of(&format!("{SHA}.wasm")), None);
        assert_eq!(artifact_of("index.json"), None);
        let leftover = format!(".{SHA}.cwasm.123-4.tmp");
        assert_eq!(artifact_of(&leftover), None);
        assert!(is_leftover(&leftover));
        assert!(!is_leftover(&format!(".{SHA}.wasm.tmp")));
        assert!(!is_leftover(".index.json.tmp"));
    }

    #[test]
    fn the_legacy_cache_is_removed_whole() {
        let dir = tempfile::tempdir().unwrap();
        let legacy = dir.path().join("compiled");
        assert_eq!(remove_legacy_cache(&legacy).unwrap(), None);
        let modules = legacy.join("modules/wasmtime-48.0.8");
        fs::create_dir_all(&modules).unwrap();
        fs::write(modules.join("key"), [0u8; 100]).unwrap();
        fs::write(modules.join("key.stats"), [0u8; 5]).unwrap();
        assert_eq!(remove_legacy_cache(&legacy).unwrap(), Some(105));
        assert!(!legacy.exists());
    }
}
