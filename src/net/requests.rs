//! Inbound DHT requests that carry something to store: a record put or a provider
//! announcement, each checked before it is kept ([`on_request`]); records refused as
//! forged are counted in the peer's status.

use super::behaviour::Behaviour;
use super::task::State;
use crate::dht;
use libp2p::kad::store::RecordStore;
use libp2p::{kad, Swarm};

/// Counts a record refused as forged.
pub(super) fn count_forged(st: &mut State, e: &dht::RecordError) {
    if matches!(e, dht::RecordError::Forged(_)) {
        st.status.forged_records += 1;
    }
}

/// Stores what a valid inbound put or provider announcement carries (records are filtered:
/// each is checked before it is kept).
pub(super) fn on_request(
    swarm: &mut Swarm<Behaviour>,
    st: &mut State,
    request: kad::InboundRequest,
    now: u64,
) {
    match request {
        kad::InboundRequest::PutRecord {
            source,
            record: Some(record),
            ..
        } => match dht::validate(record.key.as_ref(), &record.value, now) {
            Ok(()) => {
                if let Err(e) = swarm.behaviour_mut().kad.store_mut().put(record) {
                    tracing::warn!(target: "shoal::net", %source, "cannot store a record: {e:?}");
                }
            }
            Err(e) => {
                count_forged(st, &e);
                tracing::debug!(target: "shoal::net", %source, "refused a record: {e}");
            }
        },
        kad::InboundRequest::AddProvider {
            record: Some(record),
        } if dht::record::is_provider_key(record.key.as_ref()) => {
            if let Err(e) = swarm.behaviour_mut().kad.store_mut().add_provider(record) {
                tracing::warn!(target: "shoal::net", "cannot store a provider record: {e:?}");
            }
        }
        _ => {}
    }
}
