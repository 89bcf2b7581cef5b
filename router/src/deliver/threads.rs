//! The threads delivery runs on: a tokio runtime of its own, apart from ingest's, whose threads
//! can run at a higher nice value than ingest's (`delivery.nice`, off by default).
//!
//! Why: on a saturated machine ingest and delivery compete for the same CPUs, and with one
//! priority every delivered event (a lease, an outbound POST, an ack) takes CPU that the next
//! producer's request was waiting for: producers see their 202s slow down because the router
//! is busy delivering. A queue exists to absorb exactly that: accept now, deliver behind. With
//! delivery at a lower priority the kernel gives the larger share to ingest and the store
//! committer while the CPUs are saturated, and delivery drains the queues with what is left
//! (never nothing: a nice value below 19 keeps a real share), then at full speed once ingest
//! slows. A machine that is not saturated sees no difference. Blocking work started from
//! delivery (handler invocations) runs on this runtime's blocking threads, at the same
//! priority.

use std::sync::{Arc, OnceLock};

use tokio::runtime::{Handle, Runtime};

/// What the first delivery thread managed to set, for the start-up log.
type Applied = Arc<OnceLock<Result<i32, String>>>;

/// The delivery runtime as it runs, for `/v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeliveryThreadsStatus {
    /// Worker threads.
    pub threads: usize,
    /// The nice value they run at (`None` when it could not be read or set).
    pub nice: Option<i32>,
    /// Why the configured nice value could not be set (they then run at ingest's priority).
    pub error: Option<String>,
}

/// The delivery runtime. Dropping it stops its threads without waiting (shutdown waits for
/// in-flight attempts through the task tracker first).
pub struct DeliveryThreads {
    handle: Handle,
    /// Taken only by `drop`.
    rt: Option<Runtime>,
    threads: usize,
    applied: Applied,
}

impl DeliveryThreads {
    /// Starts `threads` worker threads (0 = one per CPU), each `nice` steps below the priority
    /// of the thread that starts them.
    pub fn start(threads: usize, nice: u8) -> std::io::Result<Self> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let applied: Applied = Arc::default();
        let on_start = applied.clone();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("router-delivery")
            .on_thread_start(move || {
                let result = lower_priority(nice);
                // The first thread's result is what the status reports; they all do the same.
                let _ = on_start.set(result);
            })
            .enable_all()
            .build()?;
        Ok(Self {
            handle: rt.handle().clone(),
            rt: Some(rt),
            threads,
            applied,
        })
    }

    /// Where delivery tasks are spawned.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// What the delivery threads run at, asked of one of them (so that a thread has started
    /// and set its priority before the answer is read).
    pub async fn status(&self) -> DeliveryThreadsStatus {
        let nice = self
            .handle
            .spawn(async { current_nice() })
            .await
            .ok()
            .flatten();
        let error = match self.applied.get() {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        };
        DeliveryThreadsStatus {
            threads: self.threads,
            nice,
            error,
        }
    }
}

impl Drop for DeliveryThreads {
    fn drop(&mut self) {
        // `shutdown_background` and not a plain drop: a runtime dropped inside another
        // runtime's async context panics, and the router drops this at the end of `run`.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Raises the calling thread's nice value by `by` (capped at 19), returning the value set.
/// Linux keeps a nice value per thread, so this changes the calling thread only.
#[cfg(target_os = "linux")]
fn lower_priority(by: u8) -> Result<i32, String> {
    let tid = rustix::thread::gettid();
    let current =
        rustix::process::getpriority_process(Some(tid)).map_err(|e| format!("getpriority: {e}"))?;
    let want = (current + i32::from(by)).min(19);
    if want != current {
        rustix::process::setpriority_process(Some(tid), want)
            .map_err(|e| format!("setpriority({want}): {e}"))?;
    }
    Ok(want)
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(by: u8) -> Result<i32, String> {
    if by == 0 {
        return Ok(0);
    }
    Err("per-thread nice values are only set on Linux".into())
}

/// The calling thread's nice value (tests and status).
#[cfg(target_os = "linux")]
pub fn current_nice() -> Option<i32> {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).ok()
}

/// The calling thread's nice value (tests and status).
#[cfg(not(target_os = "linux"))]
pub fn current_nice() -> Option<i32> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn delivery_threads_run_at_the_configured_nice_above_their_parent() {
        let parent = current_nice().expect("nice of the test thread");
        let threads = DeliveryThreads::start(1, 5).expect("runtime");
        let (on_worker, on_blocking) = threads.handle().block_on(async {
            let worker = current_nice();
            let blocking = tokio::task::spawn_blocking(current_nice)
                .await
                .expect("blocking task");
            (worker, blocking)
        });
        let want = (parent + 5).min(19);
        // block_on runs the future on this (test) thread; the runtime's own threads are what
        // the nice applies to, so ask one of them.
        let spawned = threads
            .handle()
            .block_on(async { tokio::spawn(async { current_nice() }).await })
            .expect("spawned task");
        assert_eq!(spawned, Some(want), "worker thread");
        assert_eq!(on_blocking, Some(want), "blocking-pool thread");
        assert_eq!(
            on_worker,
            Some(parent),
            "block_on stays on the calling thread"
        );
        let status = threads.handle().block_on(threads.status());
        assert_eq!(
            status,
            DeliveryThreadsStatus {
                threads: 1,
                nice: Some(want),
                error: None
            }
        );
        // The test thread itself is untouched.
        assert_eq!(current_nice(), Some(parent));
    }

    #[test]
    fn nice_zero_keeps_the_parents_priority() {
        let parent = current_nice().expect("nice of the test thread");
        let threads = DeliveryThreads::start(1, 0).expect("runtime");
        let spawned = threads
            .handle()
            .block_on(async { tokio::spawn(async { current_nice() }).await })
            .expect("spawned task");
        assert_eq!(spawned, Some(parent));
    }
}
