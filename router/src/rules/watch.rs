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

/// Keeps the OS watcher alive; dropping it stops watching.
pub struct DirWatcher {
    _watcher: std::sync::Arc<std::sync::Mutex<notify::RecommendedWatcher>>,
}

/// Watches each of `dirs` recursively; a directory that does not exist yet is found through
/// its parent once it is created. Sends `()` on `tx` after each debounced burst of changes.
pub fn watch(dirs: &[PathBuf], tx: mpsc::Sender<()>) -> notify::Result<DirWatcher> {
    let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<()>();
    // Only changes inside the watched directories count: a missing directory is watched
    // through its parent, whose other entries (e.g. the data directory) change all the time.
    let roots: Vec<PathBuf> = dirs
        .iter()
        .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone()))
        .collect();
    let dirs: Vec<PathBuf> = roots.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res
            && !ev.kind.is_access()
            && ev.paths.iter().any(|p| counts(&roots, p))
        {
            let _ = raw_tx.send(());
        }
    })?;
    let add_watches = |w: &mut notify::RecommendedWatcher| {
        for d in &dirs {
            if d.exists() {
                let _ = w.watch(d, RecursiveMode::Recursive);
            } else if let Some(parent) = d.parent().filter(|p| p.exists()) {
                let _ = w.watch(parent, RecursiveMode::NonRecursive);
            }
        }
    };
    add_watches(&mut watcher);
    let watcher = std::sync::Arc::new(std::sync::Mutex::new(watcher));
    let w2 = watcher.clone();
    tokio::spawn(async move {
        while raw_rx.recv().await.is_some() {
            // Debounce: wait until no event arrived for DEBOUNCE.
            loop {
                match tokio::time::timeout(DEBOUNCE, raw_rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            // A directory created since may need its own (recursive) watch now.
            if let Ok(mut w) = w2.lock() {
                for d in dirs.iter().filter(|d| d.exists()) {
                    let _ = w.watch(d, RecursiveMode::Recursive);
                }
            }
            if tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(DirWatcher { _watcher: watcher })
}

/// Whether a change at `path` can change what is loaded: inside one of `roots`, and not under
/// a hidden name (`.git/`, an editor's `.rules.yaml.swp`), which the loaders skip. Changes in
/// `.git/` counted, a rules directory that is a git checkout reloaded itself forever: each
/// reload's `git status` (for `/v1/status`) writes `.git/index.lock`.
fn counts(roots: &[PathBuf], path: &std::path::Path) -> bool {
    roots.iter().any(|r| {
        path.strip_prefix(r).is_ok_and(|rel| {
            !rel.components()
                .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        })
    })
}

/// The git commit of `dir` when it is inside a git checkout (with `-dirty` when it has
/// uncommitted changes), else `None`.
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
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let head = run(&["rev-parse", "HEAD"])?;
    let dirty = run(&["status", "--porcelain", "--", "."]).is_some_and(|s| !s.is_empty());
    Some(if dirty { format!("{head}-dirty") } else { head })
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
    }
}
