//! CPU-heavy work reached from async code (a store scan, a contract check of a large event,
//! rule matching with costly wildcards): run so that it does not hold a runtime worker thread,
//! and with it every task queued there (ingest, `/healthz`), for its whole length.

/// Runs `work` with the runtime's other tasks moved off this worker thread meanwhile
/// (`block_in_place`), so ingest is not held up behind an operator's query or a redrive's
/// check. Inline where that cannot be done (a current-thread runtime, as in unit tests, or no
/// runtime). Unlike `spawn_blocking`, `work` may borrow: the caller waits where it is.
pub(crate) fn off_reactor<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// [`off_reactor`] when `weight` (bytes, or matching cost in bytes) is at least
/// [`crate::ingest::BLOCKING_CHECK_BYTES`]; inline below it, where the work is microseconds
/// and moving the worker's tasks would cost more.
pub(crate) fn off_reactor_if_large<T>(weight: usize, work: impl FnOnce() -> T) -> T {
    if weight < crate::ingest::BLOCKING_CHECK_BYTES {
        work()
    } else {
        off_reactor(work)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::time::Duration;

    /// How many turns a ticking task got on a one-worker runtime while `work` ran inline in
    /// this task.
    async fn turns_while(work: impl FnOnce()) -> u64 {
        crate::ingest::reactor_turns_during(async { work() })
            .await
            .1
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn heavy_work_leaves_the_worker_to_other_tasks() {
        // The test's own body runs on the thread that started the runtime: spawned, it runs
        // on the one worker, with the ticker.
        tokio::spawn(on_the_worker()).await.expect("the checks");
    }

    async fn on_the_worker() {
        let busy = || std::thread::sleep(Duration::from_millis(200));
        // Inline, the one worker is held: the ticker cannot run at all.
        assert_eq!(turns_while(busy).await, 0);
        // Below the threshold, inline too: a hand-off would cost more than the work.
        let small = turns_while(|| {
            off_reactor_if_large(crate::ingest::BLOCKING_CHECK_BYTES - 1, busy);
        })
        .await;
        assert_eq!(small, 0);
        // Past it, the worker's tasks move to another thread for the duration: the work
        // waits (up to a bound far past any scheduling delay of a loaded machine) until the
        // ticker has run. Last, since the thread this task ends on may no longer be the one
        // that holds the worker.
        let ran = Arc::new(AtomicU64::new(0));
        let seen = ran.clone();
        let ticker = tokio::spawn(async move {
            loop {
                seen.fetch_add(1, Relaxed);
                tokio::task::yield_now().await;
            }
        });
        while ran.load(Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        let before = ran.load(Relaxed);
        let moved = off_reactor_if_large(crate::ingest::BLOCKING_CHECK_BYTES, || {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while ran.load(Relaxed) == before && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            ran.load(Relaxed) > before
        });
        ticker.abort();
        assert!(moved, "the ticker never ran while the work blocked");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_current_thread_runtime_runs_it_inline() {
        let here = std::thread::current().id();
        assert_eq!(off_reactor(|| std::thread::current().id()), here);
    }
}
