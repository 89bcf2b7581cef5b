//! Handler logs kept for the owning team: every captured line (with event id, attempt and
//! version) is appended to the handler's own file under the handlers directory, so the lines
//! survive a restart, and read back by `GET /v1/handlers/{name}/logs`.
//!
//! Each handler has a current file and one rotated predecessor; the current file is rotated
//! when it passes half of the per-handler budget, so a handler never holds more than its budget
//! on disk however much it logs (the per-invocation cap bounds each line burst). Appends go to
//! the page cache without an fsync: logs are for reading, not a durability promise, and an
//! fsync per line would cost more than the invocation.
//!
//! Every line gets the handler's next sequence number (`seq`), continued across restarts from
//! the files, so a reader pages back through everything kept with `before=<seq>` instead of
//! seeing only the newest lines.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// One captured handler log line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRecord {
    /// Position in the handler's log, from 1, assigned when the line is written (what is
    /// handed in is ignored); 0 for lines written before positions were kept.
    #[serde(default)]
    pub seq: u64,
    /// RFC 3339.
    pub at: String,
    /// Level.
    pub level: String,
    /// Message (traps keep theirs).
    pub message: String,
    /// The event being handled.
    pub event_id: String,
    /// Its source: with `event_id`, what identifies the event (two producers may use one
    /// id). None in lines written before it was kept.
    #[serde(default)]
    pub source: Option<String>,
    /// Attempt number.
    pub attempt: u32,
    /// Handler version (sha256 prefix).
    pub version: String,
}

/// Which lines a read returns.
#[derive(Debug, Clone, Default)]
pub struct LogQuery {
    /// Most recent lines to return.
    pub limit: usize,
    /// Only lines of this event.
    pub event_id: Option<String>,
    /// Only lines of events from this source (lines written before sources were kept have
    /// none, and do not match).
    pub source: Option<String>,
    /// Only lines at this level or above (`trace` < `debug` < `info` < `warn` < `error`).
    pub min_level: Option<String>,
    /// Only lines older than this position (`seq`): the page before one that started there.
    pub before: Option<u64>,
    /// Only lines of this attempt.
    pub attempt: Option<u32>,
}

fn level_rank(level: &str) -> u8 {
    match level {
        "trace" => 0,
        "debug" => 1,
        "info" => 2,
        "warn" => 3,
        _ => 4,
    }
}

fn ends_with_newline(file: &mut File, size: u64) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(size - 1))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last)?;
    Ok(last[0] == b'\n')
}

/// Per-handler log files under one directory.
pub struct HandlerLogs {
    dir: PathBuf,
    /// Bytes kept per handler on disk (current plus rotated file).
    budget: u64,
    /// Open current files and their sizes, and the next line positions, by handler.
    open: Mutex<Writers>,
}

/// What the writers keep per handler, under one lock.
#[derive(Default)]
struct Writers {
    /// Open current files and their sizes.
    files: HashMap<String, (File, u64)>,
    /// The next line's `seq`, once read from the files (kept across rotations).
    next_seq: HashMap<String, u64>,
}

impl HandlerLogs {
    /// Logs kept in `dir` (created if missing), at most `budget` bytes per handler.
    pub fn open(dir: &Path, budget: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            budget: budget.max(2),
            open: Mutex::new(Writers::default()),
        })
    }

    fn current(&self, handler: &str) -> PathBuf {
        self.dir.join(format!("{handler}.log"))
    }

    fn rotated(&self, handler: &str) -> PathBuf {
        self.dir.join(format!("{handler}.log.1"))
    }

    /// Appends one line to `handler`'s log. A failed write is reported to the router's own log
    /// and otherwise ignored: a full disk must not fail the delivery whose line it was.
    pub fn push(&self, handler: &str, rec: &LogRecord) {
        self.push_all(handler, std::slice::from_ref(rec));
    }

    /// Appends the lines of one invocation to `handler`'s log, in order, numbering them: one
    /// lock and as few writes as the rotation allows (a chatty handler's 64 KiB of lines was a
    /// write call per line on the delivery's thread). Failures as for `push`.
    pub fn push_all(&self, handler: &str, recs: &[LogRecord]) {
        if !crate::wasm::valid_handler_name(handler) || recs.is_empty() {
            // Names reach here from the registry or rule files; never let one pick a path.
            return;
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // Numbered (so serialized) under the lock, for the numbers to follow the file's order.
        let mut seq = match open.next_seq.get(handler) {
            Some(&n) => n,
            None => match self.last_seq(handler) {
                Ok(last) => last + 1,
                Err(e) => {
                    tracing::warn!(handler, error = %e, "could not read handler log positions; not writing its lines");
                    return;
                }
            },
        };
        // Chunks never exceed half the budget, so one always fits in a freshly rotated file
        // and disk use stays within the budget.
        let half = usize::try_from(self.budget / 2).unwrap_or(usize::MAX);
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        let mut chunk = Vec::new();
        for rec in recs {
            let numbered = LogRecord { seq, ..rec.clone() };
            let Ok(mut line) = serde_json::to_vec(&numbered) else {
                continue;
            };
            seq += 1;
            line.push(b'\n');
            if !chunk.is_empty() && chunk.len() + line.len() > half {
                chunks.push(std::mem::take(&mut chunk));
            }
            chunk.extend_from_slice(&line);
        }
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
        // Numbers handed out stay used even if a write fails: a gap, never a repeat.
        open.next_seq.insert(handler.to_string(), seq);
        for chunk in &chunks {
            if let Err(e) = self.append(&mut open.files, handler, chunk) {
                open.files.remove(handler);
                tracing::warn!(handler, error = %e, "could not write handler log lines");
                return;
            }
        }
    }

    /// The highest `seq` in `handler`'s files (0 when there are none): where numbering goes
    /// on after a restart. Read once per handler per process (the files hold at most the
    /// budget).
    fn last_seq(&self, handler: &str) -> std::io::Result<u64> {
        let mut last = 0;
        for path in [self.rotated(handler), self.current(handler)] {
            let file = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for_each_record(file, |rec| last = last.max(rec.seq))?;
        }
        Ok(last)
    }

    fn append(
        &self,
        open: &mut HashMap<String, (File, u64)>,
        handler: &str,
        line: &[u8],
    ) -> std::io::Result<()> {
        let half = self.budget / 2;
        if let Some((_, size)) = open.get(handler)
            && *size > 0
            && size + line.len() as u64 > half
        {
            open.remove(handler);
            std::fs::rename(self.current(handler), self.rotated(handler))?;
        }
        if !open.contains_key(handler) {
            let path = self.current(handler);
            let mut file = OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .open(&path)?;
            let mut size = file.metadata()?.len();
            if size > 0 && !ends_with_newline(&mut file, size)? {
                // A line torn by a crash mid-write: end it, so the next line parses.
                file.write_all(b"\n")?;
                size += 1;
            }
            open.insert(handler.to_string(), (file, size));
            if size > 0 && size + line.len() as u64 > half {
                // Left over from an earlier run: rotate before writing.
                return self.append(open, handler, line);
            }
        }
        let Some((file, size)) = open.get_mut(handler) else {
            return Ok(());
        };
        file.write_all(line)?;
        *size += line.len() as u64;
        Ok(())
    }

    /// Removes `handler`'s lines (its name was freed: the next team to claim it must not read
    /// them).
    pub fn forget(&self, handler: &str) -> std::io::Result<()> {
        if !crate::wasm::valid_handler_name(handler) {
            return Ok(());
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.files.remove(handler);
        open.next_seq.remove(handler);
        for path in [self.current(handler), self.rotated(handler)] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// The most recent lines of `handler` matching `q`, oldest first.
    pub fn recent(&self, handler: &str, q: &LogQuery) -> std::io::Result<Vec<LogRecord>> {
        if !crate::wasm::valid_handler_name(handler) || q.limit == 0 {
            return Ok(Vec::new());
        }
        // Both files are opened under the writers' lock, so a rotation cannot move lines
        // between them; they are read after it is released (an open file keeps its lines when
        // renamed), so a large read does not hold up every handler's log writes.
        let files = {
            let _open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let mut files = Vec::with_capacity(2);
            for path in [self.rotated(handler), self.current(handler)] {
                match File::open(&path) {
                    Ok(f) => files.push(f),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            files
        };
        let min = q.min_level.as_deref().map_or(0, level_rank);
        let mut out = std::collections::VecDeque::with_capacity(q.limit.min(4096));
        for file in files {
            for_each_record(file, |rec| {
                if q.event_id.as_ref().is_some_and(|id| *id != rec.event_id)
                    || q.source.is_some() && q.source != rec.source
                    || q.attempt.is_some_and(|a| a != rec.attempt)
                    || q.before.is_some_and(|b| rec.seq >= b)
                    || level_rank(&rec.level) < min
                {
                    return;
                }
                if out.len() == q.limit {
                    out.pop_front();
                }
                out.push_back(rec);
            })?;
        }
        Ok(out.into())
    }
}

/// Calls `f` with every record of a log file, in order. A line that does not parse (cut short
/// by a crash mid-write) is skipped, not an error: read as bytes, since one torn inside a
/// character is not UTF-8 (`lines()` failed the whole read on it, and every read after it
/// until the file rotated).
fn for_each_record(file: File, mut f: impl FnMut(LogRecord)) -> std::io::Result<()> {
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        if let Ok(rec) = serde_json::from_slice::<LogRecord>(&line) {
            f(rec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: usize, level: &str) -> LogRecord {
        LogRecord {
            seq: 0,
            at: "2026-11-30T00:00:00Z".into(),
            level: level.into(),
            message: format!("line {i}"),
            event_id: format!("e{}", i % 3),
            source: Some(format!("/s{}", i % 2)),
            attempt: 1,
            version: "abc".into(),
        }
    }

    /// Bytes of all files in `dir`.
    fn disk_use(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    fn all(n: usize) -> LogQuery {
        LogQuery {
            limit: n,
            ..LogQuery::default()
        }
    }

    #[test]
    fn lines_survive_reopening_and_filter_by_event_and_level() {
        let dir = tempfile::tempdir().unwrap();
        {
            let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
            for i in 0..10 {
                logs.push("h", &rec(i, if i % 2 == 0 { "info" } else { "error" }));
            }
            logs.push("other", &rec(99, "info"));
        }
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        let got = logs.recent("h", &all(3)).unwrap();
        let msgs: Vec<_> = got.iter().map(|r| r.message.as_str()).collect();
        assert_eq!(msgs, ["line 7", "line 8", "line 9"]);
        let q = LogQuery {
            limit: 100,
            event_id: Some("e1".into()),
            min_level: Some("warn".into()),
            ..LogQuery::default()
        };
        let msgs: Vec<_> = logs
            .recent("h", &q)
            .unwrap()
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["line 1", "line 7"]);
        // One id from two sources is two events: `source` tells their lines apart.
        let q = LogQuery {
            limit: 100,
            event_id: Some("e1".into()),
            source: Some("/s0".into()),
            ..LogQuery::default()
        };
        let msgs: Vec<_> = logs
            .recent("h", &q)
            .unwrap()
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["line 4"]);
        assert_eq!(logs.recent("other", &all(10)).unwrap().len(), 1);
        assert!(logs.recent("nobody", &all(10)).unwrap().is_empty());
    }

    #[test]
    fn an_invocations_lines_are_written_together_in_order_within_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let budget = 4096;
        let logs = HandlerLogs::open(dir.path(), budget).unwrap();
        // Batches of 37 lines, each batch larger than half the budget.
        for b in 0..20 {
            let batch: Vec<LogRecord> = (b * 37..(b + 1) * 37).map(|i| rec(i, "info")).collect();
            logs.push_all("h", &batch);
        }
        let used = disk_use(dir.path());
        assert!(used <= budget, "{used} bytes on disk");
        let got = logs.recent("h", &all(10_000)).unwrap();
        assert_eq!(got.last().unwrap().message, format!("line {}", 20 * 37 - 1));
        let first: usize = got[0].message[5..].parse().unwrap();
        assert_eq!(first + got.len(), 20 * 37, "contiguous up to the newest");
        logs.push_all("h", &[]);
        logs.push_all("../escape", &[rec(1, "info")]);
        assert_eq!(logs.recent("h", &all(10_000)).unwrap().len(), got.len());
    }

    #[test]
    fn disk_use_stays_within_the_budget_and_keeps_the_newest_lines() {
        let dir = tempfile::tempdir().unwrap();
        let budget = 4096;
        let logs = HandlerLogs::open(dir.path(), budget).unwrap();
        for i in 0..1000 {
            logs.push("h", &rec(i, "info"));
        }
        let used = disk_use(dir.path());
        assert!(used <= budget, "{used} bytes on disk");
        let got = logs.recent("h", &all(10_000)).unwrap();
        assert!(got.len() > 10, "{} lines kept", got.len());
        assert_eq!(got.last().unwrap().message, "line 999");
        // Oldest first, contiguous up to the newest.
        let first: usize = got[0].message[5..].parse().unwrap();
        assert_eq!(first + got.len(), 1000);
    }

    #[test]
    fn names_that_are_not_handler_names_never_become_paths() {
        let dir = tempfile::tempdir().unwrap();
        let logs = HandlerLogs::open(dir.path().join("logs").as_path(), 1 << 20).unwrap();
        logs.push("../escape", &rec(1, "info"));
        assert!(!dir.path().join("escape.log").exists());
        assert!(logs.recent("../escape", &all(10)).unwrap().is_empty());
    }

    fn seqs(lines: &[LogRecord]) -> Vec<u64> {
        lines.iter().map(|r| r.seq).collect()
    }

    /// Every line is numbered, on across a restart and a rotation, so that a reader pages
    /// back through all that is kept (`before`), not only the newest lines.
    #[test]
    fn lines_are_numbered_across_restarts_and_paged_back() {
        let dir = tempfile::tempdir().unwrap();
        {
            let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
            let batch: Vec<LogRecord> = (0..10).map(|i| rec(i, "info")).collect();
            logs.push_all("h", &batch);
        }
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        let mut attempt2 = rec(10, "info");
        attempt2.attempt = 2;
        logs.push_all("h", &[attempt2, rec(11, "info")]);
        let page = |before: Option<u64>| {
            let q = LogQuery {
                limit: 5,
                before,
                ..LogQuery::default()
            };
            seqs(&logs.recent("h", &q).unwrap())
        };
        assert_eq!(page(None), [8, 9, 10, 11, 12]);
        assert_eq!(page(Some(8)), [3, 4, 5, 6, 7]);
        assert_eq!(page(Some(3)), [1, 2]);
        assert!(page(Some(1)).is_empty());
        let q = LogQuery {
            limit: 10,
            attempt: Some(2),
            ..LogQuery::default()
        };
        assert_eq!(seqs(&logs.recent("h", &q).unwrap()), [11]);
        // A rotation keeps the numbering going; what is kept stays contiguous.
        let small = tempfile::tempdir().unwrap();
        let logs = HandlerLogs::open(small.path(), 4096).unwrap();
        for i in 0..300 {
            logs.push("h", &rec(i, "info"));
        }
        let kept = seqs(&logs.recent("h", &all(10_000)).unwrap());
        assert_eq!(kept.last(), Some(&300));
        assert_eq!(kept[0] + kept.len() as u64 - 1, 300, "{kept:?}");
        drop(logs);
        let logs = HandlerLogs::open(small.path(), 4096).unwrap();
        logs.push("h", &rec(300, "info"));
        assert_eq!(seqs(&logs.recent("h", &all(1)).unwrap()), [301]);
    }

    /// A line torn inside a multi-byte character (or damaged on disk) is not UTF-8: it is
    /// skipped like any other torn line, where it made every read fail.
    #[test]
    fn a_line_that_is_not_utf8_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        logs.push("h", &rec(1, "info"));
        drop(logs);
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join("h.log"))
            .unwrap();
        f.write_all(b"{\"at\":\"2026\xe2\x82\n").unwrap();
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        logs.push("h", &rec(2, "info"));
        let msgs: Vec<_> = logs
            .recent("h", &all(10))
            .unwrap()
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["line 1", "line 2"]);
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        logs.push("h", &rec(1, "info"));
        drop(logs);
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join("h.log"))
            .unwrap();
        f.write_all(b"{\"at\":\"2026").unwrap();
        let logs = HandlerLogs::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(logs.recent("h", &all(10)).unwrap().len(), 1);
        // The writer ends the torn line before appending, so the next line is not lost.
        logs.push("h", &rec(2, "info"));
        let msgs: Vec<_> = logs
            .recent("h", &all(10))
            .unwrap()
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["line 1", "line 2"]);
    }
}
