//! A replica's job queue: forwards and backwards waiting for the compute thread, in two
//! lanes. The compute thread takes a waiting backward before any forward, and a backward
//! finds room however many forwards wait (each lane holds up to the queue's capacity).
//!
//! Why: a backward finishes a microbatch (its kept forward is freed, its samples count),
//! a forward starts one. With one first-come lane a replica whose queue was full of
//! forwards refused the backwards of microbatches already half done, or ran them after
//! every forward ahead of them: in a 200-peer sim whose trainers filled the queues of the
//! few replicas they knew, each backward hop waited a whole queue (~7 s). Backwards first
//! is what one-forward-one-backward pipeline schedules do for the same reason.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;

/// Which lane a job waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// Finishes a microbatch: taken first.
    Backward,
    /// Starts (or continues) one.
    Forward,
}

struct Lanes<J> {
    backward: VecDeque<J>,
    forward: VecDeque<J>,
    closed: bool,
}

impl Lane {
    /// The lane of a call `op` (only forwards and backwards are queued).
    pub(super) fn of(op: crate::wire::msg::Op) -> Self {
        match op {
            crate::wire::msg::Op::Backward => Self::Backward,
            _ => Self::Forward,
        }
    }
}

/// The queue between the replica's streams and its compute thread.
pub(super) struct JobQueue<J> {
    lanes: Mutex<Lanes<J>>,
    ready: Condvar,
    cap: usize,
}

impl<J> JobQueue<J> {
    /// A queue holding up to `cap` jobs in each lane.
    pub(super) fn new(cap: usize) -> Self {
        Self {
            lanes: Mutex::new(Lanes {
                backward: VecDeque::new(),
                forward: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            cap: cap.max(1),
        }
    }

    /// Whether `lane` has room for one more job now.
    pub(super) fn has_room(&self, lane: Lane) -> bool {
        let l = self.lanes.lock();
        !l.closed
            && match lane {
                Lane::Backward => l.backward.len() < self.cap,
                Lane::Forward => l.forward.len() < self.cap,
            }
    }

    /// Queues `job` in `lane`; gives it back when that lane is full or the queue closed.
    pub(super) fn push(&self, lane: Lane, job: J) -> Result<(), J> {
        let mut l = self.lanes.lock();
        if l.closed {
            return Err(job);
        }
        let q = match lane {
            Lane::Backward => &mut l.backward,
            Lane::Forward => &mut l.forward,
        };
        if q.len() >= self.cap {
            return Err(job);
        }
        q.push_back(job);
        drop(l);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job, backwards first, waiting for one; `None` once the queue is closed and
    /// empty.
    pub(super) fn pop(&self) -> Option<J> {
        let mut l = self.lanes.lock();
        loop {
            if let Some(j) = l.backward.pop_front().or_else(|| l.forward.pop_front()) {
                return Some(j);
            }
            if l.closed {
                return None;
            }
            self.ready.wait(&mut l);
        }
    }

    /// Whether [`close`](Self::close) was called.
    pub(super) fn is_closed(&self) -> bool {
        self.lanes.lock().closed
    }

    /// Takes no more jobs; the compute thread finishes the queued ones, then [`pop`]
    /// returns `None`.
    pub(super) fn close(&self) {
        self.lanes.lock().closed = true;
        self.ready.notify_all();
    }

    /// Closes the queue and drops what waits in it (their callers hear that the compute
    /// thread stopped): the compute thread failed.
    pub(super) fn abandon(&self) {
        let dropped = {
            let mut l = self.lanes.lock();
            l.closed = true;
            (
                std::mem::take(&mut l.backward),
                std::mem::take(&mut l.forward),
            )
        };
        drop(dropped);
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn backwards_go_first_and_find_room_behind_a_full_forward_lane() {
        let q = JobQueue::new(2);
        q.push(Lane::Forward, "f1").unwrap();
        q.push(Lane::Forward, "f2").unwrap();
        // The forward lane is full; a backward still gets in, and is taken first.
        assert_eq!(q.push(Lane::Forward, "f3"), Err("f3"));
        q.push(Lane::Backward, "b1").unwrap();
        q.push(Lane::Backward, "b2").unwrap();
        assert_eq!(q.push(Lane::Backward, "b3"), Err("b3"));
        assert_eq!(q.pop(), Some("b1"));
        q.push(Lane::Backward, "b3").unwrap();
        assert_eq!(q.pop(), Some("b2"));
        assert_eq!(q.pop(), Some("b3"));
        assert_eq!(q.pop(), Some("f1"));
        // Closed: nothing more gets in, what waits is still served, then the end.
        q.close();
        assert!(q.is_closed());
        assert_eq!(q.push(Lane::Backward, "b4"), Err("b4"));
        assert_eq!(q.pop(), Some("f2"));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn a_waiting_compute_thread_wakes_for_a_job_and_for_the_close() {
        let q = Arc::new(JobQueue::new(1));
        let worker = {
            let q = Arc::clone(&q);
            std::thread::spawn(move || {
                let mut got = Vec::new();
                while let Some(j) = q.pop() {
                    got.push(j);
                }
                got
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.push(Lane::Forward, 1).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.push(Lane::Backward, 2).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.close();
        assert_eq!(worker.join().unwrap(), vec![1, 2]);
        // Abandoned: what waits is dropped, not served.
        let q = JobQueue::new(4);
        q.push(Lane::Forward, 1).unwrap();
        q.abandon();
        assert_eq!(q.pop(), None);
    }
}
