//! Synchronous calls held for their step ([`crate::stage::sync`]): on stage 0 a forward
//! waits until the step accumulated there has room and is given that step; on a later
//! stage a call waits until its step is open here, or is refused once that step closed.
//! A call waiting for a step after this replica's is counted in `held_ahead`: the
//! averager's sign that stage 0 has moved on.

use super::conn::refusal;
use super::{Reply, Shared};
use crate::stage::sync;
use crate::wire::msg::{ErrorKind, Request};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a synchronous call is held for its step before it is refused `overloaded`.
const HOLD_LIMIT: Duration = Duration::from_secs(15);

/// Holds a synchronous call until its step is open here: on stage 0 (a forward), until the step
/// accumulated now has room for it ([`sync::admits`]), which assigns the microbatch that
/// step (`req.step`) and counts its samples as owed; elsewhere, until the microbatch's step
/// is open here, refused `step_closed` once this replica closed it (the compute thread
/// also refuses what finds its step closed).
pub(super) async fn hold_for_step(
    shared: &Arc<Shared>,
    req: &mut Request,
    frames: &[Vec<u8>],
) -> Result<(), Reply> {
    let samples = frames
        .first()
        .and_then(|f| crate::wire::parse_header(f, &shared.cfg.limits).ok())
        .and_then(|(h, _)| h.shape.first().copied())
        .unwrap_or(1) as u64;
    let started = Instant::now();
    // Counted in `held_ahead` while it waits for a step after this replica's.
    let mut ahead = Ahead(shared, false);
    // Since when the step it may join has been open (a share is waited for from then, not
    // from the forward's arrival: held across a step, it would take more than its share the
    // moment the step opens, before the other replicas' progress could say what they took).
    let mut open_since: Option<(u64, Instant)> = None;
    loop {
        let wake = shared.sync_changed.notified();
        {
            let now = Instant::now();
            let mut acc = shared.accum.lock();
            let s = acc.params_step;
            if shared.stage != 0 {
                // Its step open here: computed now. Closed here (one microbatch more than
                // the step took, in a race): refused, and started again in a later step. So
                // every stage closes a step on the microbatches stage 0 gave it.
                if s == req.step && acc.accum_step() == s {
                    return Ok(());
                }
                if s > req.step || acc.accum_step() > req.step {
                    let msg = sync::closed_message(req.step, s, acc.accum_step());
                    drop(acc);
                    return Err(refusal(shared, ErrorKind::StepClosed, msg));
                }
                ahead.set(req.step > s);
            } else if acc.accum_step() == s {
                let since = match open_since {
                    Some((step, t)) if step == s => t,
                    _ => {
                        open_since = Some((s, now));
                        now
                    }
                };
                let others = *shared.others.lock();
                let room = sync::Room {
                    target: shared.target,
                    own: acc.count + acc.owed.at_except(s, now, req.call.mb()),
                    others: if others.step == s {
                        others
                    } else {
                        sync::Others::default()
                    },
                    samples,
                    waited: now.saturating_duration_since(since),
                };
                if sync::admits(&room) {
                    tracing::debug!(mb = req.call.mb(), step = s, ?room, "admitted");
                    acc.owed.prune(s, now);
                    acc.owed.add(req.call.mb(), s, samples, now);
                    req.step = s;
                    drop(acc);
                    // The others hear of the room taken with the next progress.
                    shared.progress.notify_one();
                    return Ok(());
                }
            }
        }
        if started.elapsed() >= HOLD_LIMIT {
            tracing::debug!(mb = req.call.mb(), step = req.step, "held past the limit");
            return Err(refusal(
                shared,
                ErrorKind::Overloaded,
                format!(
                    "no step had room for this microbatch within {} s",
                    HOLD_LIMIT.as_secs()
                ),
            ));
        }
        tokio::select! {
            _ = wake => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// A held call's place in [`Shared::held_ahead`](super::Shared): counted while set,
/// uncounted when it leaves.
struct Ahead<'a>(&'a Shared, bool);

impl Ahead<'_> {
    fn set(&mut self, on: bool) {
        if on != self.1 {
            if on {
                self.0.held_ahead.fetch_add(1, Ordering::Relaxed);
            } else {
                self.0.held_ahead.fetch_sub(1, Ordering::Relaxed);
            }
            self.1 = on;
        }
    }
}

impl Drop for Ahead<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}
