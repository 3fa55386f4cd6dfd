//! The one retry policy of stage-protocol calls.
//!
//! The network layer answers every stream it accepts (a stream a busy replica has no room
//! for hears `overloaded`, see `net::streams`), so a call is never lost to a dropped
//! stream and nothing here exists for that. What may be retried, and only where a caller
//! asks for it with a [`Retry`]: a call that met a busy replica (`overloaded`), a broken
//! connection or no answer in time, after a pause that doubles each time. Whether a
//! request may reach a replica twice is [`may_resend`]'s call; a caller with a better
//! choice than the same replica again (a trainer, which swaps in another replica) does
//! not retry here at all.

use super::CallError;
use crate::wire::msg::{Call, ErrorKind, Request};
use std::time::Duration;

/// How often, and how patiently, one call is tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Tries in all (1: no retry).
    pub tries: u32,
    /// The pause after the first failure; it doubles after each.
    pub first_pause: Duration,
    /// The longest pause.
    pub max_pause: Duration,
}

impl Retry {
    /// One try.
    pub const ONCE: Retry = Retry {
        tries: 1,
        first_pause: Duration::ZERO,
        max_pause: Duration::ZERO,
    };

    /// An averaging round's message: a lost one stalls the round until its deadline.
    pub const ROUND_MESSAGE: Retry = Retry {
        tries: 8,
        first_pause: Duration::from_millis(50),
        max_pause: Duration::from_secs(1),
    };

    /// The pause after failed try `i` (0-based).
    pub fn pause(&self, i: u32) -> Duration {
        self.first_pause
            .saturating_mul(1u32 << i.min(16))
            .min(self.max_pause)
    }

    /// Runs `call` until it succeeds, fails for good, `tries` are spent, or `live` says
    /// the call no longer matters (then the last error, or none if it never ran).
    pub async fn run<T, F, Fut>(
        &self,
        live: impl Fn() -> bool,
        mut call: F,
    ) -> Option<Result<T, CallError>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, CallError>>,
    {
        let mut last = None;
        for i in 0..self.tries.max(1) {
            if !live() {
                break;
            }
            match call().await {
                Ok(v) => return Some(Ok(v)),
                Err(e) if !may_retry(&e) || i + 1 >= self.tries => return Some(Err(e)),
                Err(e) => {
                    tracing::debug!(try_ = i, "call failed, trying again: {e}");
                    last = Some(Err(e));
                    tokio::time::sleep(self.pause(i)).await;
                }
            }
        }
        last
    }
}

/// Whether a failed call may succeed if tried again: the replica was busy, the connection
/// broke, or no answer came in time. A refusal of what was sent (bad tensor, stale step,
/// unknown run...) is the answer.
pub fn may_retry(e: &CallError) -> bool {
    match e {
        CallError::Net(_) | CallError::Io(_) | CallError::Timeout(_) => true,
        CallError::Remote { kind, .. } => *kind == ErrorKind::Overloaded,
        CallError::Wire(_) | CallError::Protocol(_) => false,
    }
}

/// Whether `req` may reach the replica twice: everything but averaging messages. Reads
/// and forwards change nothing a second one would repeat, and a replica accumulates a
/// microbatch's backward once whatever it is sent (its id is admitted once); an averaging
/// part sent twice is refused as a duplicate, and counted against its sender.
pub fn may_resend(req: &Request) -> bool {
    !matches!(req.call, Call::Avg { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::NetError;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn remote(kind: ErrorKind) -> CallError {
        CallError::Remote {
            kind,
            message: String::new(),
            step: 0,
        }
    }

    #[test]
    fn busy_broken_and_silent_calls_may_be_retried_refusals_may_not() {
        assert!(may_retry(&remote(ErrorKind::Overloaded)));
        assert!(may_retry(&CallError::Net(NetError::Stopped)));
        assert!(may_retry(&CallError::Timeout(Duration::from_secs(1))));
        assert!(!may_retry(&remote(ErrorKind::StaleStep)));
        assert!(!may_retry(&remote(ErrorKind::BadTensor)));
        assert!(!may_retry(&CallError::Protocol("x".into())));
    }

    #[test]
    fn pauses_double_up_to_the_longest() {
        let r = Retry::ROUND_MESSAGE;
        assert_eq!(r.pause(0), Duration::from_millis(50));
        assert_eq!(r.pause(2), Duration::from_millis(200));
        assert_eq!(r.pause(10), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_call_is_tried_until_it_succeeds_or_fails_for_good() {
        let n = AtomicU32::new(0);
        let r = Retry::ROUND_MESSAGE
            .run(
                || true,
                || async {
                    match n.fetch_add(1, Ordering::Relaxed) {
                        0 | 1 => Err(remote(ErrorKind::Overloaded)),
                        _ => Ok(7),
                    }
                },
            )
            .await;
        assert!(matches!(r, Some(Ok(7))));
        assert_eq!(n.load(Ordering::Relaxed), 3);
        let n = AtomicU32::new(0);
        let r: Option<Result<(), _>> = Retry::ROUND_MESSAGE
            .run(
                || true,
                || async {
                    n.fetch_add(1, Ordering::Relaxed);
                    Err(remote(ErrorKind::StaleStep))
                },
            )
            .await;
        assert!(matches!(r, Some(Err(_))));
        assert_eq!(n.load(Ordering::Relaxed), 1, "a refusal is the answer");
        let r: Option<Result<(), CallError>> = Retry::ROUND_MESSAGE
            .run(|| false, || async { Ok(()) })
            .await;
        assert!(r.is_none(), "a call that no longer matters is not made");
    }
}
