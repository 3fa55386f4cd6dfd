//! Provider walks that end early: a reader that asked for the providers found within a
//! patience ([`super::NetHandle::get_providers_within`]) gets them then, and the walk is
//! finished so it reports its last step.

use super::behaviour::Behaviour;
use super::task::State;
use libp2p::Swarm;
use std::time::{Duration, Instant};

/// How often walks past their patience are looked for.
pub(super) const WALK_END_CHECK: Duration = Duration::from_millis(250);

/// Ends the walks past their patience (each then reports its last step) and forgets those
/// that ended on their own.
pub(super) fn end_walks(swarm: &mut Swarm<Behaviour>, st: &mut State) {
    let now = Instant::now();
    st.walk_ends.retain(|(at, id)| {
        let Some(mut q) = swarm.behaviour_mut().kad.query_mut(id) else {
            return false;
        };
        if *at <= now {
            q.finish();
            return false;
        }
        true
    });
}
