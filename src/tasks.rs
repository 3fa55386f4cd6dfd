//! One task model for every long-lived task: a [`Tasks`] group, tokio-util's
//! `TaskTracker` (who is still running) and `CancellationToken` (stop, cooperatively, at
//! the next await) together.
//!
//! A component that starts background tasks (the network-facing loops of a stage service,
//! an averager, a trainer, a peer's keepers, the HTTP server) spawns them into its group;
//! stopping it cancels the group and waits for the tasks to end ([`Tasks::shutdown`]);
//! dropping it cancels them ([`Tasks::cancel_on_drop`]). A child group
//! ([`Tasks::child`]) is cancelled with its parent, so nothing started under a peer
//! outlives it.

use std::future::Future;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

/// A group of tasks stopped together.
#[derive(Debug, Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    cancel: CancellationToken,
}

impl Tasks {
    /// An empty group.
    pub fn new() -> Self {
        Self::default()
    }

    /// A group of its own, also cancelled when this one is.
    pub fn child(&self) -> Tasks {
        Tasks {
            tracker: TaskTracker::new(),
            cancel: self.cancel.child_token(),
        }
    }

    /// Spawns `f` into the group (in the current tracing span); it ends early, at its next
    /// await, when the group is cancelled (the handle then yields `None`).
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<Option<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let cancel = self.cancel.clone();
        self.tracker
            .spawn(tracing::Instrument::in_current_span(async move {
                cancel.run_until_cancelled(f).await
            }))
    }

    /// Spawns `f`, which ends on its own (a sender that drains its queue once its input
    /// closes): tracked, so [`shutdown`](Self::shutdown) waits for it, but not cancelled.
    pub fn spawn_draining<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(tracing::Instrument::in_current_span(f))
    }

    /// Cancels every task of the group (and of its children).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Whether the group was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves once the group is cancelled.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// Tasks still running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Cancels the group and waits up to `within` for its tasks to end; whether they did.
    pub async fn shutdown(&self, within: Duration) -> bool {
        self.cancel.cancel();
        self.tracker.close();
        tokio::time::timeout(within, self.tracker.wait())
            .await
            .is_ok()
    }

    /// A guard that cancels the group when dropped (held by the owner of the tasks).
    pub fn cancel_on_drop(&self) -> DropGuard {
        self.cancel.clone().drop_guard()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn shutdown_cancels_every_task_and_waits_for_it() {
        let tasks = Tasks::new();
        let ended = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let flag = Flag(Arc::clone(&ended));
        tasks.spawn(async move {
            let _flag = flag;
            std::future::pending::<()>().await
        });
        let child = tasks.child();
        let h = child.spawn(std::future::pending::<()>());
        assert_eq!(tasks.len(), 1);
        assert!(tasks.shutdown(Duration::from_secs(5)).await);
        assert!(
            ended.load(Ordering::Relaxed),
            "the task's state was dropped"
        );
        assert!(child.is_cancelled(), "a child is cancelled with its parent");
        assert_eq!(h.await.ok(), Some(None));
    }

    #[tokio::test]
    async fn a_guard_cancels_its_group_when_dropped_and_a_finished_task_keeps_its_output() {
        let tasks = Tasks::new();
        let done = tasks.spawn(async { 7 });
        assert_eq!(done.await.ok(), Some(Some(7)));
        let guard = tasks.cancel_on_drop();
        let h = tasks.spawn(std::future::pending::<()>());
        drop(guard);
        assert_eq!(h.await.ok(), Some(None));
    }
}
