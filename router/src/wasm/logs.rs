//! Handler logs kept for the owning team: every captured line (with event id, attempt and
//! version) is appended to the handler's own file under the handlers directory, so the lines
//! survive a restart, and read back by `GET /v1/handlers/{name}/logs`.
//!
//! Each handler has a current file and one rotated predecessor; the current file is rotated
//! when it passes half of the per-handler budget, so a handler never holds more than its budget
//! on disk however much it logs (the per-invocation cap bounds each line burst). Appends go to
//! the page cache without an fsync: logs are for reading, not a durability promise, and an
//! fsync per line would cost more than the invocation.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// One captured handler log line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRecord {
    /// RFC 3339.
    pub at: String,
    /// Level.
    pub level: String,
    /// Message (traps keep theirs).
    pub message: String,
    /// The event being handled.
    pub event_id: String,
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
    /// Only lines at this level or above (`trace` < `debug` < `info` < `warn` < `error`).
    pub min_level: Option<String>,
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
    /// Open current files and their sizes, by handler.
    open: Mutex<HashMap<String, (File, u64)>>,
}

impl HandlerLogs {
    /// Logs kept in `dir` (created if missing), at most `budget` bytes per handler.
    pub fn open(dir: &Path, budget: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            budget: budget.max(2),
            open: Mutex::new(HashMap::new()),
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

    /// Appends the lines of one invocation to `handler`'s log, in order: one lock and as few
    /// writes as the rotation allows (a chatty handler's 64 KiB of lines was a write call per
    /// line on the delivery's thread). Failures as for `push`.
    pub fn push_all(&self, handler: &str, recs: &[LogRecord]) {
        if !crate::wasm::valid_handler_name(handler) {
            // Names reach here from the registry or rule files; never let one pick a path.
            return;
        }
        // Chunks never exceed half the budget, so one always fits in a freshly rotated file
        // and disk use stays within the budget.
        let half = usize::try_from(self.budget / 2).unwrap_or(usize::MAX);
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        let mut chunk = Vec::new();
        for rec in recs {
            let Ok(mut line) = serde_json::to_vec(rec) else {
                continue;
            };
            line.push(b'\n');
            if !chunk.is_empty() && chunk.len() + line.len() > half {
                chunks.push(std::mem::take(&mut chunk));
            }
            chunk.extend_from_slice(&line);
        }
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        for chunk in &chunks {
            if let Err(e) = self.append(&mut open, handler, chunk) {
                open.remove(handler);
                tracing::warn!(handler, error = %e, "could not write handler log lines");
                return;
            }
        }
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
        open.remove(handler);
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
        let mut line = Vec::new();
        for file in files {
            let mut reader = BufReader::new(file);
            loop {
                line.clear();
                if reader.read_until(b'\n', &mut line)? == 0 {
                    break;
                }
                // A line cut short by a crash mid-write is skipped, not an error: read as
                // bytes, since one torn inside a character is not UTF-8 (`lines()` failed the
                // whole read on it, and every read after it until the file rotated).
                let Ok(rec) = serde_json::from_slice::<LogRecord>(&line) else {
                    continue;
                };
                if q.event_id.as_ref().is_some_and(|id| *id != rec.event_id)
                    || level_rank(&rec.level) < min
                {
                    continue;
                }
                if out.len() == q.limit {
                    out.pop_front();
                }
                out.push_back(rec);
            }
        }
        Ok(out.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: usize, level: &str) -> LogRecord {
        LogRecord {
            at: "2026-11-30T00:00:00Z".into(),
            level: level.into(),
            message: format!("line {i}"),
            event_id: format!("e{}", i % 3),
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
        };
        let msgs: Vec<_> = logs
            .recent("h", &q)
            .unwrap()
            .into_iter()
            .map(|r| r.message)
            .collect();
        assert_eq!(msgs, ["line 1", "line 7"]);
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
