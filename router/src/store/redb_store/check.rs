//! `router store check`: a stopped router's store file verified page by page, then its
//! records decoded one by one.
//!
//! redb checks its pages' checksums only when it repairs a file that was not closed cleanly;
//! a cleanly closed file damaged since (a bad disk, a stray write, a bad copy) is trusted,
//! and a damaged page then makes a read index out of its bounds and panic, at start or in a
//! delivery. This check opens the file with redb's integrity check on (every page of the
//! committed trees verified, `Builder::set_check_integrity_on_open`), refusing the repair that
//! would roll the file back to an earlier commit (that would drop acknowledged events
//! silently), and then decodes every event, queue entry and dead letter.

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable};

use super::{DLQ, ENTRIES, EVENTS, META, dec, dec_entry, dec_event, read_u64};
use crate::store::{DlqEntry, FORMAT_VERSION, OLDEST_READABLE_FORMAT, StoreError};

/// How many unreadable records the report names (the count goes on).
const NAMED: usize = 20;

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every page verifies and every record decodes.
    Sound,
    /// The pages verify, but some records do not decode (`CheckReport::unreadable`).
    RecordsDamaged,
    /// The file does not verify (the message says how), or has a format this build does not
    /// read.
    Damaged(String),
}

/// The result of [`check_dir`].
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The store file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// The verdict.
    pub verdict: Verdict,
    /// Whether the records were read (not when the file does not verify).
    pub read: bool,
    /// The on-disk format version (`None`: never written, a new store).
    pub format_version: Option<u64>,
    /// Records read: events, queue entries with rows of their own, dead letters.
    pub records: (u64, u64, u64),
    /// How many records do not decode.
    pub unreadable_count: u64,
    /// The first of them, each as "table key: error".
    pub unreadable: Vec<String>,
    /// Whether a group log (`router.log`, `router.log2`) is beside it: its groups are applied
    /// to the file at the next start, and are not checked here.
    pub group_log: bool,
}

/// Why the check could not be made (as opposed to a damaged file, which is a verdict).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The directory or its file cannot be used.
    #[error("{0}")]
    Dir(String),
    /// A router (or another check) has the file open.
    #[error(
        "{0} is open in another process (a running router?): stop the router, then check again"
    )]
    InUse(PathBuf),
    /// Reading the file failed (I/O).
    #[error("reading {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        error: String,
    },
}

/// Checks the store in `dir` (a stopped router's `data_dir`).
pub fn check_dir(dir: &Path) -> Result<CheckReport, CheckError> {
    if !dir.is_dir() {
        return Err(CheckError::Dir(if dir.exists() {
            format!("{} is not a directory", dir.display())
        } else {
            format!("{} does not exist", dir.display())
        }));
    }
    let path = dir.join("router.redb");
    let bytes = std::fs::metadata(&path)
        .map_err(|e| CheckError::Dir(format!("{}: {e}", path.display())))?
        .len();
    let group_log = super::FILE_NAMES.iter().any(|n| dir.join(n).exists());
    let mut report = CheckReport {
        path: path.clone(),
        bytes,
        verdict: Verdict::Sound,
        read: false,
        format_version: None,
        records: (0, 0, 0),
        unreadable_count: 0,
        unreadable: Vec::new(),
        group_log,
    };
    let mut builder = Database::builder();
    builder.set_check_integrity_on_open(true);
    // Past the first pass, a repair falls back to the commit before the newest: refused, the
    // operator decides (a restore from a backup may be better than losing the last commit).
    builder.set_repair_callback(|s| {
        if s.progress() >= 0.3 && s.progress() < 0.6 {
            s.abort();
        }
    });
    let opened = super::catching(|| builder.open(&path));
    let db = match opened {
        Ok(Ok(db)) => db,
        Ok(Err(redb::DatabaseError::DatabaseAlreadyOpen)) => return Err(CheckError::InUse(path)),
        Ok(Err(redb::DatabaseError::RepairAborted)) => {
            report.verdict = Verdict::Damaged(
                "the newest commit does not verify; redb could only roll the file back to the \
                 commit before it (losing what that commit stored)"
                    .into(),
            );
            return Ok(report);
        }
        // Not a redb file at all (its header overwritten): damaged, not unreadable.
        Ok(Err(redb::DatabaseError::Storage(redb::StorageError::Io(e))))
            if e.kind() != std::io::ErrorKind::InvalidData =>
        {
            return Err(CheckError::Io {
                path,
                error: e.to_string(),
            });
        }
        Ok(Err(e)) => {
            report.verdict = Verdict::Damaged(e.to_string());
            return Ok(report);
        }
        Err(p) => {
            report.verdict = Verdict::Damaged(format!(
                "redb panicked verifying it ({})",
                panic_message(p.as_ref())
            ));
            return Ok(report);
        }
    };
    match super::catching(|| read_records(&db, &mut report)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => report.verdict = Verdict::Damaged(e.to_string()),
        Err(p) => {
            report.verdict = Verdict::Damaged(format!(
                "redb panicked reading its records ({})",
                panic_message(p.as_ref())
            ));
        }
    }
    Ok(report)
}

/// Decodes every record, counting those that do not decode.
fn read_records(db: &Database, report: &mut CheckReport) -> Result<(), StoreError> {
    let r = db.begin_read()?;
    report.read = true;
    let version = match r.open_table(META) {
        Ok(meta) => read_u64(&meta, "format_version")?,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    report.format_version = version;
    if let Some(v) = version
        && !(u64::from(OLDEST_READABLE_FORMAT)..=u64::from(FORMAT_VERSION)).contains(&v)
    {
        report.verdict = Verdict::Damaged(format!(
            "store format version {v}: this build reads versions {OLDEST_READABLE_FORMAT} to \
             {FORMAT_VERSION}"
        ));
        return Ok(());
    }
    let mut bad = |what: String| {
        report.unreadable_count += 1;
        if report.unreadable.len() < NAMED {
            report.unreadable.push(what);
        }
    };
    let mut counts = (0, 0, 0);
    if let Ok(t) = r.open_table(EVENTS) {
        for row in t.iter()? {
            let (k, v) = row?;
            counts.0 += 1;
            if let Err(e) = dec_event(k.value(), v.value()) {
                bad(format!("event {}: {e}", k.value()));
            }
        }
    }
    if let Ok(t) = r.open_table(ENTRIES) {
        for row in t.iter()? {
            let (k, v) = row?;
            counts.1 += 1;
            if let Err(e) = dec_entry(k.value(), v.value()) {
                let (seq, idx) = k.value();
                bad(format!("queue entry {seq}.{idx}: {e}"));
            }
        }
    }
    if let Ok(t) = r.open_table(DLQ) {
        for row in t.iter()? {
            let (k, v) = row?;
            counts.2 += 1;
            if let Err(e) = dec::<DlqEntry>("dlq", v.value()) {
                bad(format!("DLQ entry {}: {e}", k.value()));
            }
        }
    }
    report.records = counts;
    if report.unreadable_count > 0 {
        report.verdict = Verdict::RecordsDamaged;
    }
    Ok(())
}

/// A panic's message, when it has one.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_events::new_event;
    use crate::store::{RedbStore, Store as _, StoreOptions};

    /// Accepts three events into a store in `dir` and closes it cleanly.
    async fn store_with_events(dir: &Path) -> u64 {
        let s = RedbStore::open_dir(dir, StoreOptions::default()).expect("open");
        let r = s
            .accept(
                (1..=3)
                    .map(|i| new_event("/s", &i.to_string(), &["a"], 1000))
                    .collect(),
            )
            .await
            .expect("accept");
        let crate::store::AcceptOutcome::Accepted { seq, .. } = r[1] else {
            panic!("{r:?}")
        };
        s.close().await.expect("close");
        drop(s);
        seq
    }

    #[tokio::test]
    async fn a_sound_store_is_said_sound() {
        let dir = tempfile::tempdir().expect("tempdir");
        store_with_events(dir.path()).await;
        let r = super::super::tests::when_free(|| check_dir(dir.path())).await;
        assert_eq!(r.verdict, Verdict::Sound, "{r:?}");
        assert_eq!(r.records.0, 3);
        assert_eq!(r.format_version, Some(u64::from(FORMAT_VERSION)));
    }

    /// A page changed outside redb in a cleanly closed file: the plain open trusts it (and a
    /// read may panic); the check says the file is damaged.
    #[tokio::test]
    async fn a_damaged_page_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        store_with_events(dir.path()).await;
        let path = dir.path().join("router.redb");
        super::super::tests::when_free(|| check_dir(dir.path())).await;
        let mut bytes = std::fs::read(&path).expect("read");
        // Every page past the header: whichever holds the trees, its checksum fails.
        for b in bytes.iter_mut().skip(4096) {
            *b ^= 0x5a;
        }
        std::fs::write(&path, &bytes).expect("write");
        let r = check_dir(dir.path()).expect("checked");
        assert!(matches!(r.verdict, Verdict::Damaged(_)), "{r:?}");
    }

    /// Pages that verify holding a record that does not decode: named with its key.
    #[tokio::test]
    async fn a_record_that_does_not_decode_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bad = store_with_events(dir.path()).await;
        {
            let db =
                super::super::tests::when_free(|| Database::create(dir.path().join("router.redb")))
                    .await;
            let txn = db.begin_write().expect("write");
            txn.open_table(EVENTS)
                .expect("events")
                .insert(bad, b"{oops".as_slice())
                .expect("insert");
            txn.commit().expect("commit");
        }
        let r = check_dir(dir.path()).expect("checked");
        assert_eq!(r.verdict, Verdict::RecordsDamaged, "{r:?}");
        assert_eq!(r.unreadable_count, 1);
        assert!(
            r.unreadable[0].starts_with(&format!("event {bad}:")),
            "{r:?}"
        );
    }

    #[test]
    fn a_file_for_a_directory_is_said_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").expect("write");
        let e = check_dir(&file).expect_err("not a directory");
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }
}
