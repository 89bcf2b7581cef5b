//! Watches the rules and contracts directories and asks for a reload when they change.
//!
//! File-system events come in bursts (an editor's save, a `git pull` touching many files), so
//! they are debounced: a reload is requested once the directory has been quiet for a moment.

use std::path::PathBuf;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// Quiet time after the last change before a reload is requested.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// How long a reload waits, past the debounce, for a file being written in place to be closed
/// by its writer (seen as a change of its data not yet followed by its close). Past it, the
/// files are loaded as they are: a writer that holds a rule file open for ever must not stop
/// reloads.
pub const WRITE_WAIT: Duration = Duration::from_secs(10);

/// How often the directories' listing (names, sizes, modification times, where a symlinked
/// directory points) is compared with the last one: the fallback for changes the OS watcher
/// does not report (a file system without inotify, such as some network mounts).
pub const POLL: Duration = Duration::from_secs(10);

/// Keeps the OS watcher alive; dropping it stops watching.
pub struct DirWatcher {
    _watcher: std::sync::Arc<std::sync::Mutex<notify::RecommendedWatcher>>,
}

/// Watches each of `dirs` recursively; a directory that does not exist yet is found through
/// its parent once it is created. Sends `()` on `tx` after each debounced burst of changes.
pub fn watch(dirs: &[PathBuf], tx: mpsc::Sender<()>) -> notify::Result<DirWatcher> {
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<Raw>();
    let raw_tx_for_poll = raw_tx.clone();
    // Only changes inside the watched directories count: a missing directory is watched
    // through its parent, whose other entries (e.g. the data directory) change all the time.
    let roots: Vec<PathBuf> = dirs
        .iter()
        .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone()))
        .collect();
    let dirs: Vec<PathBuf> = roots.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else {
            return;
        };
        let paths = || ev.paths.iter().filter(|p| counts(&roots, p)).cloned();
        use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
        match ev.kind {
            // A writer closed a file it wrote: what it wrote is all there. (Other accesses,
            // the reload's own reads among them, change nothing.)
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
                for p in paths() {
                    let _ = raw_tx.send(Raw::Closed(p));
                }
            }
            EventKind::Access(_) => {}
            // Data written into a file: it may be half there until its writer closes it (a
            // `cp`, `cat >`, `kubectl cp` or an editor saving in place write in chunks).
            EventKind::Modify(ModifyKind::Data(_)) => {
                for p in paths() {
                    let _ = raw_tx.send(Raw::Writing(p));
                }
            }
            EventKind::Remove(_) => {
                for p in paths() {
                    let _ = raw_tx.send(Raw::Gone(p));
                }
            }
            _ => {
                if paths().next().is_some() {
                    let _ = raw_tx.send(Raw::Changed);
                }
            }
        }
    })?;
    // Each directory's parent is watched too: a directory replaced as a whole (a symlink
    // flipped to another release, a deploy's `mv`) changes there, and the watch inside it
    // stays on the old one.
    let add_watches = |w: &mut notify::RecommendedWatcher| {
        for d in &dirs {
            if d.exists() {
                let _ = w.watch(d, RecursiveMode::Recursive);
            }
            if let Some(parent) = d.parent().filter(|p| p.exists()) {
                let _ = w.watch(parent, RecursiveMode::NonRecursive);
            }
        }
    };
    add_watches(&mut watcher);
    let watcher = std::sync::Arc::new(std::sync::Mutex::new(watcher));
    let w2 = watcher.clone();
    let poll_tx = raw_tx_for_poll;
    let poll_dirs = dirs.clone();
    // The listing as of the last reload requested, by either path: a change the OS watcher
    // reported is not reloaded a second time by the next poll.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(listing(&dirs)));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(POLL).await;
            // A directory walk: off the reactor.
            let d = poll_dirs.clone();
            let Ok(now) = tokio::task::spawn_blocking(move || listing(&d)).await else {
                return;
            };
            let changed = {
                let mut seen = seen2.lock().unwrap_or_else(|p| p.into_inner());
                let changed = *seen != now;
                *seen = now;
                changed
            };
            if changed && poll_tx.send(Raw::Changed).is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move {
        // Files written into and not closed yet by their writer.
        let mut writing = std::collections::HashSet::new();
        while let Some(first) = raw_rx.recv().await {
            let mut changed = first.apply(&mut writing);
            let burst = tokio::time::Instant::now();
            // Debounce: wait until no event arrived for DEBOUNCE and every file written into
            // has been closed by its writer: loaded at the debounce alone, a file written in
            // two chunks half a second apart went live cut after its first (its cut-off
            // targets removed, their queues dead-lettered with `on_target_removed =
            // "dead_letter"`, matching events routed nowhere meanwhile). Bounded by WRITE_WAIT.
            loop {
                match tokio::time::timeout(DEBOUNCE, raw_rx.recv()).await {
                    Ok(Some(ev)) => changed |= ev.apply(&mut writing),
                    Ok(None) => return,
                    Err(_) if writing.is_empty() => break,
                    Err(_) if burst.elapsed() >= WRITE_WAIT => {
                        tracing::warn!(files = ?writing, wait = ?WRITE_WAIT, "rule or contract files are still open for writing; loading them as they are");
                        writing.clear();
                        break;
                    }
                    Err(_) => {}
                }
            }
            if !changed {
                continue;
            }
            // A directory created or replaced since needs its own (recursive) watch now:
            // watching the path again follows it to what it is now.
            if let Ok(mut w) = w2.lock() {
                for d in dirs.iter().filter(|d| d.exists()) {
                    let _ = w.unwatch(d);
                    let _ = w.watch(d, RecursiveMode::Recursive);
                }
            }
            let d = dirs.clone();
            if let Ok(now) = tokio::task::spawn_blocking(move || listing(&d)).await {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = now;
            }
            if tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(DirWatcher { _watcher: watcher })
}

/// What the OS watcher (or the poll) reports, for the debounce.
#[derive(Debug)]
enum Raw {
    /// Something changed (a file created, renamed, its metadata; the poll's listing).
    Changed,
    /// Data was written into this file.
    Writing(PathBuf),
    /// A writer closed this file.
    Closed(PathBuf),
    /// This file was removed.
    Gone(PathBuf),
}

impl Raw {
    /// Notes what `self` says of the files being written; returns whether it is a change.
    fn apply(self, writing: &mut std::collections::HashSet<PathBuf>) -> bool {
        match self {
            Raw::Changed => true,
            Raw::Writing(p) => {
                writing.insert(p);
                true
            }
            // Closed after writing: the change was the writing. A file opened for writing
            // and closed without a write changed nothing.
            Raw::Closed(p) => {
                writing.remove(&p);
                false
            }
            Raw::Gone(p) => {
                writing.remove(&p);
                true
            }
        }
    }
}

/// Whether a change at `path` can change what is loaded: inside one of `roots`, and not under
/// a hidden name (`.git/`, an editor's `.rules.yaml.swp`), which the loaders skip. Changes in
/// `.git/` counted, a rules directory that is a git checkout reloaded itself forever: each
/// reload's `git status` (for `/v1/status`) writes `.git/index.lock`.
///
/// Except names starting `..` at the top: a Kubernetes ConfigMap or Secret volume changes
/// only there (its files are symlinks through `..data`, a symlink swapped to a new
/// `..<timestamp>` directory at each update).
fn counts(roots: &[PathBuf], path: &std::path::Path) -> bool {
    roots.iter().any(|r| {
        path.strip_prefix(r).is_ok_and(|rel| {
            let mut names = rel.components().map(|c| c.as_os_str().to_string_lossy());
            match names.next() {
                None => true,
                Some(first) if first.starts_with("..") => true,
                Some(first) => !first.starts_with('.') && !names.any(|n| n.starts_with('.')),
            }
        })
    })
}

/// What the poll compares: for each directory, where it resolves to and each file under it
/// (hidden names skipped, as the loaders skip them; symlinks followed, as the loaders read
/// them) with its size and modification time. Bounded: a directory of more than
/// `MAX_LISTED` entries is listed that far.
fn listing(dirs: &[PathBuf]) -> Vec<(PathBuf, u64, Option<std::time::SystemTime>)> {
    const MAX_LISTED: usize = 10_000;
    let mut out = Vec::new();
    for d in dirs {
        out.push((std::fs::canonicalize(d).unwrap_or_default(), 0, None));
        let mut stack = vec![d.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if out.len() >= MAX_LISTED {
                    return out;
                }
                if e.file_name().to_string_lossy().starts_with('.') {
                    continue;
                }
                let path = e.path();
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_dir() => stack.push(path),
                    Ok(m) => out.push((path, m.len(), m.modified().ok())),
                    Err(_) => {}
                }
            }
        }
    }
    out.sort();
    out
}

/// The git commit of `dir` when it is inside a git checkout (with `-dirty` when a file the
/// loader reads has uncommitted changes), else `None`. Two `git` runs.
pub fn git_commit(dir: &std::path::Path) -> Option<String> {
    let run = |args: &[&str]| {
        // Without optional locks: `git status` would otherwise refresh the index, writing
        // under `.git/` for what is only a read.
        std::process::Command::new("git")
            .arg("--no-optional-locks")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    // The directory's place in the checkout (`rules/`, or empty at its top), then HEAD.
    let out = run(&["rev-parse", "--show-prefix", "HEAD"])?;
    let mut lines = out.lines();
    let prefix = lines.next()?.to_owned();
    let head = lines.next()?.trim().to_owned();
    let status = run(&[
        "status",
        "--porcelain=v1",
        "-z",
        "--untracked-files=all",
        "--",
        ".",
    ]);
    let dirty = status.is_some_and(|s| dirty_rule_files(&s, &prefix));
    Some(if dirty { format!("{head}-dirty") } else { head })
}

/// Whether `git status --porcelain=v1 -z` output names a file the rules loader reads: one
/// under `prefix` (the directory's path in the checkout), with no hidden name on the way (an
/// editor's `.main.yaml.swp`, which the loader and the watcher skip, made the live set
/// `-dirty`) and a rule file's extension. A rename or copy names both paths.
fn dirty_rule_files(status: &str, prefix: &str) -> bool {
    let loaded = |path: &str| {
        let rel = path.strip_prefix(prefix).unwrap_or(path);
        let name = rel.rsplit('/').next().unwrap_or(rel);
        !rel.split('/').any(|c| c.starts_with('.')) && super::loader::is_rule_file(name)
    };
    let mut entries = status.split('\0').filter(|e| !e.is_empty());
    while let Some(entry) = entries.next() {
        let (code, path) = (entry.get(..2).unwrap_or(""), entry.get(3..).unwrap_or(""));
        if loaded(path) {
            return true;
        }
        // `R  new\0old`: the next entry is the path it came from.
        if code.contains(['R', 'C']) && entries.next().is_some_and(loaded) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_under_hidden_names_do_not_count() {
        let roots = vec![PathBuf::from("/srv/rules")];
        assert!(counts(
            &roots,
            std::path::Path::new("/srv/rules/orders.yaml")
        ));
        assert!(counts(
            &roots,
            std::path::Path::new("/srv/rules/team/a.yaml")
        ));
        assert!(counts(&roots, std::path::Path::new("/srv/rules")));
        assert!(!counts(
            &roots,
            std::path::Path::new("/srv/rules/.git/index.lock")
        ));
        assert!(!counts(
            &roots,
            std::path::Path::new("/srv/rules/.a.yaml.swp")
        ));
        assert!(!counts(
            &roots,
            std::path::Path::new("/srv/data/router.redb")
        ));
        // A ConfigMap volume's update: the `..data` symlink swapped.
        assert!(counts(&roots, std::path::Path::new("/srv/rules/..data")));
        assert!(counts(
            &roots,
            std::path::Path::new("/srv/rules/..2026_12_06_18_00_00.123/orders.yaml")
        ));
        assert!(!counts(
            &roots,
            std::path::Path::new("/srv/rules/team/..data")
        ));
    }

    async fn signalled(rx: &mut mpsc::Receiver<()>, within: Duration) -> bool {
        tokio::time::timeout(within, rx.recv()).await.is_ok()
    }

    /// A rules directory that is a symlink flipped to another release, and a ConfigMap
    /// volume's `..data` swap, each trigger a reload; so does a later edit in the new release
    /// (the watch follows the directory to what it is now).
    #[cfg(unix)]
    #[tokio::test]
    async fn a_directory_swapped_under_its_path_is_seen() {
        use std::os::unix::fs::symlink;
        let root = tempfile::tempdir().expect("tempdir");
        let p = |n: &str| root.path().join(n);
        for rel in ["rel1", "rel2"] {
            std::fs::create_dir(p(rel)).expect("mkdir");
            std::fs::write(p(rel).join("r.yaml"), rel).expect("write");
        }
        symlink(p("rel1"), p("current")).expect("symlink");
        // A ConfigMap volume: r.yaml -> ..data/r.yaml, ..data -> ..t1.
        let cm = p("cm");
        for t in ["..t1", "..t2"] {
            std::fs::create_dir_all(cm.join(t)).expect("mkdir");
            std::fs::write(cm.join(t).join("r.yaml"), t).expect("write");
        }
        symlink("..t1", cm.join("..data")).expect("symlink");
        symlink("..data/r.yaml", cm.join("r.yaml")).expect("symlink");

        let (tx, mut rx) = mpsc::channel(4);
        let _w = watch(&[p("current"), cm.clone()], tx).expect("watch");
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Flip `current` atomically, as deploy tools do.
        symlink(p("rel2"), p("current.new")).expect("symlink");
        std::fs::rename(p("current.new"), p("current")).expect("flip");
        assert!(signalled(&mut rx, Duration::from_secs(5)).await, "the flip");
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(p("rel2").join("r.yaml"), "edited").expect("edit");
        assert!(
            signalled(&mut rx, Duration::from_secs(5)).await,
            "an edit in the new release"
        );
        symlink("..t2", cm.join("..data.new")).expect("symlink");
        std::fs::rename(cm.join("..data.new"), cm.join("..data")).expect("swap");
        assert!(
            signalled(&mut rx, Duration::from_secs(5)).await,
            "the ConfigMap update"
        );
    }

    /// A file written in place in two chunks with a pause longer than the debounce between
    /// them is reloaded once, after its writer closed it, not after the first chunk.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_file_written_in_chunks_is_loaded_once_its_writer_closes_it() {
        use std::io::Write as _;
        let root = tempfile::tempdir().expect("tempdir");
        let d = root.path().join("rules");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::write(d.join("r.yaml"), "rules: []\n").expect("write");
        let (tx, mut rx) = mpsc::channel(4);
        let _w = watch(std::slice::from_ref(&d), tx).expect("watch");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut f = std::fs::File::create(d.join("r.yaml")).expect("open");
        f.write_all(b"rules:\n  - name: a\n").expect("write");
        f.flush().expect("flush");
        assert!(
            !signalled(&mut rx, DEBOUNCE * 4).await,
            "reloaded while the file was still being written"
        );
        f.write_all(b"    pattern: {}\n").expect("write");
        drop(f);
        assert!(
            signalled(&mut rx, Duration::from_secs(5)).await,
            "no reload once the writer closed the file"
        );
    }

    /// Only files the loader reads make the live set `-dirty`: not an editor's swap file nor
    /// any other hidden or non-rule file.
    #[test]
    fn hidden_and_non_rule_files_do_not_make_the_commit_dirty() {
        assert!(!dirty_rule_files("", "rules/"));
        assert!(!dirty_rule_files("?? rules/.main.yaml.swp\0", "rules/"));
        assert!(!dirty_rule_files(
            "?? rules/team/.x.yaml\0?? rules/README.md\0",
            "rules/"
        ));
        assert!(dirty_rule_files(" M rules/main.yaml\0", "rules/"));
        assert!(dirty_rule_files("?? team/b.yml\0", ""));
        // A hidden directory above the rules directory does not hide it.
        assert!(dirty_rule_files(
            " M .config/rules/a.json\0",
            ".config/rules/"
        ));
        assert!(dirty_rule_files(
            "R  rules/notes.txt\0rules/a.yaml\0",
            "rules/"
        ));
        assert!(!dirty_rule_files("R  rules/b.txt\0rules/a.txt\0", "rules/"));
    }

    /// In a checkout, a swap file leaves the commit clean and an edit of a rule file does not.
    #[test]
    fn the_commit_of_a_checkout_ignores_swap_files() {
        let root = tempfile::tempdir().expect("tempdir");
        let d = root.path().join("rules");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::write(d.join("main.yaml"), "rules: []\n").expect("write");
        let git = |args: &[&str]| {
            std::process::Command::new("git")
                .arg("-C")
                .arg(root.path())
                .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
                .args(args)
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !git(&["init", "-q"]) {
            eprintln!("git not available: skipped");
            return;
        }
        assert!(git(&["add", "-A"]) && git(&["commit", "-q", "-m", "c"]));
        let clean = git_commit(&d).expect("a commit");
        assert!(!clean.ends_with("-dirty"), "{clean}");
        std::fs::write(d.join(".main.yaml.swp"), "x").expect("swap");
        assert_eq!(git_commit(&d).as_deref(), Some(clean.as_str()));
        std::fs::write(d.join("main.yaml"), "rules: []\n# edit\n").expect("edit");
        assert_eq!(git_commit(&d), Some(format!("{clean}-dirty")));
    }

    #[test]
    fn the_poll_sees_a_swap_and_an_edit_but_not_hidden_files() {
        let root = tempfile::tempdir().expect("tempdir");
        let d = root.path().join("rules");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::write(d.join("r.yaml"), "a").expect("write");
        let before = listing(std::slice::from_ref(&d));
        std::fs::write(d.join(".r.yaml.swp"), "x").expect("write");
        assert_eq!(listing(std::slice::from_ref(&d)), before);
        std::fs::write(d.join("r.yaml"), "ab").expect("write");
        assert_ne!(listing(std::slice::from_ref(&d)), before);
    }
}
