//! What a replica tells its stage mates of its progress: its counts when they change (at
//! once when it steps, fills the step's batch, or first changes after a step; otherwise
//! at a pace that slows with the stage's size until the batch is half full), and the same
//! as a heartbeat when nothing changed, also while it waits on a long freeze or apply.

use super::actor::State;
use super::plan::{self, View};
use crate::stage::service::ReplicaStatus;
use crate::wire::msg::AvgMsg;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A replica's progress goes to its mates at most this many times per heartbeat when it
/// changes (at once when it steps, fills the step's batch, or first changes after a step).
const CHANGES_PER_HEARTBEAT: u32 = 3;

/// The shortest wait between two progress messages sent for a change (the default
/// heartbeat ÷ [`CHANGES_PER_HEARTBEAT`]), and the wait once the step's batch is half full.
const MIN_CHANGE_EVERY: Duration = Duration::from_millis(100);

impl State {
    /// Sends progress on change (at most every [`MIN_CHANGE_EVERY`], or
    /// [`CHANGES_PER_HEARTBEAT`] times a heartbeat while the step's batch is less than half
    /// full; at once when the step changed, for the first change after that, and when it
    /// fills the step's batch) or as a heartbeat.
    pub(super) fn heartbeat(&mut self, st: &ReplicaStatus) {
        let now_sig = (
            st.params_step,
            st.accum_step,
            st.accum_count,
            st.frozen_count,
            st.owed_count,
            st.shared_hash.clone(),
        );
        let since = self.last_sent_at.elapsed();
        let changed = self.last_sent.as_ref() != Some(&now_sig);
        let stepped = self.last_sent.as_ref().map(|l| l.0) != Some(st.params_step);
        // What this replica knows the stage holds toward its step (read only on a change:
        // this runs at every tick).
        let held = if !changed {
            0
        } else {
            let mine = View::of(st, Instant::now());
            let s = st.params_step;
            let others: u64 = self
                .views
                .values()
                .filter(|v| v.params_step == s)
                .map(|v| v.pending_at(s))
                .sum();
            mine.pending_at(s) + others
        };
        let target = self.cfg.target.max(1);
        // The change that fills the step's batch is sent at once: the leader is waiting
        // for it.
        let filled = changed && held >= target;
        // So is the first change after a step's: the other replicas learn of this one's
        // first microbatch before theirs fill the step on their own (which made a step
        // hold both, half as large again).
        let first = changed && self.sent_at_step < 2;
        // Other changes are sent at most every 100 ms (not one message per microbatch to
        // every replica) once the step's batch is half full; before that, in a large
        // stage, at most three times a heartbeat: 45 replicas sending each change to every
        // mate were ~2,500 messages a second at a third of the swarm's rate, and a view a
        // few seconds old matters only near the end of a step's batch.
        let change_every = if 2 * held >= target {
            MIN_CHANGE_EVERY
        } else {
            (self.cfg.heartbeat / CHANGES_PER_HEARTBEAT).max(MIN_CHANGE_EVERY)
        };
        if stepped
            || filled
            || first
            || (changed && since >= change_every)
            || since >= self.cfg.heartbeat
        {
            let mine = View::of(st, Instant::now());
            let input = self.input(&mine);
            let msg = AvgMsg::Progress {
                params_step: st.params_step,
                accum_step: st.accum_step,
                count: st.accum_count,
                frozen: st.frozen_count,
                hash: st.shared_hash.clone(),
                uplink: self.stats.uplink.load(Ordering::Relaxed),
                owed: st.owed_count,
                lost: plan::seen_lost(&input, mine.at, &self.cfg),
                ahead: input.ahead,
            };
            for p in self.others() {
                self.send(p, msg.clone());
            }
            self.last_sent = Some(now_sig);
            self.last_sent_at = Instant::now();
            self.sent_at_step = if stepped { 1 } else { self.sent_at_step + 1 };
        }
    }

    /// Waits for `job` (a freeze or an apply: seconds on a large stage) while telling the
    /// stage's other replicas every heartbeat that this one is alive, as `st` showed it: a
    /// mate deciding meanwhile must not count it gone.
    pub(super) async fn beating<T>(
        &mut self,
        st: &ReplicaStatus,
        mut job: tokio::task::JoinHandle<T>,
    ) -> Result<T, tokio::task::JoinError> {
        loop {
            tokio::select! {
                r = &mut job => return r,
                () = tokio::time::sleep(self.cfg.heartbeat) => self.heartbeat(st),
            }
        }
    }
}
