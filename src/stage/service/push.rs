//! Activations pushed from one stage to the next: a forward asked to `push_to` a replica of
//! the next stage sends its output there ([`Call::Push`](crate::wire::msg::Call::Push))
//! instead of back to its caller, and the caller's request to that replica, marked
//! `pushed`, waits here for it. A microbatch's trip to the last stage then crosses three
//! one-way latencies (trainer → stage s, s → s+1, s+1 → trainer) instead of four, and its
//! activations one link instead of two.
//!
//! Held inputs are few and short-lived: at most [`HELD`] (the oldest go first) and none
//! older than [`HELD_FOR`]. A push nobody asks for is dropped that way; a request whose
//! push never comes is refused after [`WAIT`], and its caller sends the input itself.
//! While held, an input's bytes stay charged to its pusher's byte budget (the [`Charge`]
//! held with it), so a peer cannot park more here than it may have in requests.

use crate::wire::msg::Op;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Pushed inputs held at most.
pub const HELD: usize = 256;

/// How long a pushed input waits for its request.
pub const HELD_FOR: Duration = Duration::from_secs(30);

/// How long a `pushed` request waits for its input.
pub const WAIT: Duration = Duration::from_secs(10);

/// How long a push may take before the forward answers with its output instead: well
/// under a trainer's call timeout, so that a hung next replica costs the trainer a
/// fallback, not a timeout that would blame this replica.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// What a held input keeps charged to its pusher until it is taken or dropped.
pub type Charge = Box<dyn Send>;

/// One pushed input: its microbatch, the step its sender computed it at, the frame, when
/// it came, and its charge.
type Held = (u64, u64, Vec<u8>, Instant, Charge);

/// Inputs pushed to this replica, by microbatch.
#[derive(Default)]
pub struct Inbox {
    held: Mutex<VecDeque<Held>>,
    arrived: Notify,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("held", &self.len()).finish()
    }
}

impl Inbox {
    /// Holds the input `frame` of microbatch `mb`, computed at step `step` by the stage
    /// before (replacing one held for it), with what it keeps charged to its pusher.
    pub fn put(&self, mb: u64, step: u64, frame: Vec<u8>, charge: Charge) {
        let now = Instant::now();
        {
            let mut held = self.held.lock();
            held.retain(|(m, _, _, at, _)| *m != mb && now.duration_since(*at) < HELD_FOR);
            while held.len() >= HELD {
                held.pop_front();
            }
            held.push_back((mb, step, frame, now, charge));
        }
        self.arrived.notify_waiters();
    }

    /// Takes the input pushed for `mb` and the step it was computed at, waiting for it at
    /// most `wait`.
    pub async fn take(&self, mb: u64, wait: Duration) -> Option<(Vec<u8>, u64)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before looking, so that a push between the look and the wait
            // still wakes this one.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            {
                let mut held = self.held.lock();
                if let Some(i) = held.iter().position(|(m, _, _, _, _)| *m == mb) {
                    return held.remove(i).map(|(_, step, f, _, _)| (f, step));
                }
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return None;
            }
        }
    }

    /// Inputs held now.
    pub fn len(&self) -> usize {
        self.held.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Tensors a request of kind `op` carries: `base` for its kind, less the input when it
/// was pushed.
pub fn frames_of(op: Op, base: u8, pushed: bool) -> u8 {
    match (pushed, op) {
        (true, Op::Forward | Op::Backward) => base.saturating_sub(1),
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_gets_the_input_pushed_before_or_after_it_and_no_other() {
        let inbox = std::sync::Arc::new(Inbox::default());
        inbox.put(1, 4, vec![1], Box::new(()));
        assert_eq!(inbox.take(1, Duration::ZERO).await, Some((vec![1], 4)));
        assert_eq!(
            inbox.take(1, Duration::from_millis(20)).await,
            None,
            "taken once"
        );
        let later = {
            let inbox = std::sync::Arc::clone(&inbox);
            tokio::spawn(async move { inbox.take(2, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        inbox.put(3, 0, vec![3], Box::new(()));
        inbox.put(2, 0, vec![2], Box::new(()));
        assert_eq!(later.await.unwrap(), Some((vec![2], 0)));
        assert_eq!(inbox.len(), 1, "microbatch 3's input is still held");
    }

    #[test]
    fn the_oldest_inputs_go_first_when_too_many_are_held() {
        let inbox = Inbox::default();
        for mb in 0..(HELD as u64 + 5) {
            inbox.put(mb, 0, vec![0], Box::new(()));
        }
        assert_eq!(inbox.len(), HELD);
        let held = inbox.held.lock();
        assert_eq!(held.front().map(|e| e.0), Some(5));
    }

    #[tokio::test]
    async fn a_held_input_keeps_its_charge_until_taken_or_dropped() {
        let charged = std::sync::Arc::new(());
        let inbox = Inbox::default();
        inbox.put(1, 0, vec![1], Box::new(std::sync::Arc::clone(&charged)));
        inbox.put(2, 0, vec![2], Box::new(std::sync::Arc::clone(&charged)));
        assert_eq!(std::sync::Arc::strong_count(&charged), 3);
        inbox.take(1, Duration::ZERO).await;
        assert_eq!(std::sync::Arc::strong_count(&charged), 2, "taken: released");
        for mb in 10..(10 + HELD as u64) {
            inbox.put(mb, 0, vec![0], Box::new(()));
        }
        assert_eq!(
            std::sync::Arc::strong_count(&charged),
            1,
            "pushed out: released"
        );
    }
}
