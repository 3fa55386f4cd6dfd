//! A round as one replica runs it: the members message starts it (freeze, send the
//! parts chunk by chunk), parts of this replica's part are reduced chunk by chunk as they
//! arrive, reduced chunks are collected, and the update is applied (and kept for replicas
//! that catch up) once every chunk is in. The rest of the averager is in `actor`.

use super::actor::State;
use super::plan;
use super::round::{self, Key, Layout, Round, Taken, Tally};
use super::send::Bulk;
use super::server::Inbound;
use crate::wire::msg::AvgMsg;
use crate::wire::{self, Limits};
use libp2p::PeerId;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Whether round data of step `step` that came before its `Members` is kept at step
/// `now`: this step's, or, while this replica finishes its step, the next one's.
fn kept_early(step: u64, now: u64) -> bool {
    step == now || step == now + 1
}

impl State {
    /// Notes that `peer` sent something rejected in round attempt `key`: counted, and a
    /// strike, which may ban it (then it is forgotten as a member until the ban ends).
    pub(super) fn reject(&mut self, peer: PeerId, key: round::Key, why: &str) {
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        self.debug(|| format!("rejected a chunk of {peer}: {why}"));
        let now = Instant::now();
        if self.guard.strike(peer, key, why, now) {
            // What it held is lost to the step, as if it had left.
            if let Some(v) = self.views.remove(&peer) {
                self.left_lost += v.count + v.frozen;
            }
            self.debug(|| format!("banned {peer}"));
            // Its part of a running round will not be heard: retry without it now.
            if self
                .round
                .as_ref()
                .is_some_and(|r| r.members.contains(&peer))
            {
                self.stats.failed_attempts.fetch_add(1, Ordering::Relaxed);
                self.end_round(false);
            }
        }
        *self.stats.bans.lock() = self.guard.bans();
    }

    /// A part or reduced chunk: taken if it is for the running attempt, kept for later if
    /// it is for this step and came before its `Members`, else dropped.
    pub(super) async fn on_round_data(&mut self, m: Inbound) {
        let key = match &m.msg {
            AvgMsg::Part { step, attempt, .. } | AvgMsg::Reduced { step, attempt, .. } => {
                (*step, *attempt)
            }
            _ => return,
        };
        if self.tally.as_ref().map(Tally::key) != Some(key) {
            if kept_early(key.0, self.status().params_step) {
                self.early.push(m);
            }
            return;
        }
        if let Some(r) = &mut self.round {
            r.heard.insert(m.from);
        }
        let Some(frame) = m.frames.into_iter().next() else {
            return;
        };
        match m.msg {
            AvgMsg::Part { count, chunk, .. } => self.on_part(m.from, chunk, count, &frame),
            AvgMsg::Reduced {
                index,
                total,
                chunk,
                ..
            } => {
                // A reduced chunk is applied by every member as it is: one holding NaN or
                // ±inf ends the attempt (the leader retries) and is a strike.
                let mut values = Vec::new();
                let bad = match wire::decode_f32_into(&frame, &Limits::default(), &mut values) {
                    Ok(_) => super::guard::check_finite(&values).err(),
                    Err(e) => Some(e.to_string()),
                };
                if let Some(why) = bad {
                    self.reject(m.from, key, &format!("reduced chunk {chunk}: {why}"));
                    self.stats.failed_attempts.fetch_add(1, Ordering::Relaxed);
                    self.end_round(false);
                    return;
                }
                if let Some(t) = &mut self.tally {
                    t.add_reduced(index as usize, chunk, Arc::new(frame), total);
                }
            }
            _ => {}
        }
        self.try_complete().await;
    }

    /// Chunk `chunk` of member `from`'s sum for this replica's part.
    fn on_part(&mut self, from: PeerId, chunk: u32, count: u64, frame: &[u8]) {
        let (Some(r), Some(frozen)) = (&self.round, &self.frozen) else {
            return;
        };
        let Some(m) = r.members.iter().position(|p| *p == from) else {
            return;
        };
        let Some(range) = self.tally.as_ref().and_then(|t| t.layout().range(chunk)) else {
            return;
        };
        let key = r.key();
        let Ok(mut own) = frozen.sum.decode(chunk) else {
            return;
        };
        if own.len() != range.len() {
            return;
        }
        // This replica's own copy goes through the finiteness check too: a sum that
        // overflowed here is left out rather than sent to every member averaged.
        let mut own_count = frozen.count;
        if super::guard::check_finite(&own).is_err() {
            own.iter_mut().for_each(|x| *x = 0.0);
            own_count = 0;
        }
        let mut values = Vec::new();
        let check = match wire::decode_f32_into(frame, &Limits::default(), &mut values) {
            Ok(_) if values.len() == range.len() => self.guard.check_part(chunk, &values, count),
            Ok(_) => Err(format!(
                "a chunk of {} values, not {}",
                values.len(),
                range.len()
            )),
            Err(e) => Err(e.to_string()),
        };
        let taken = match check {
            Ok(()) => match &mut self.tally {
                Some(t) => t.add_part(m, chunk, count, &values, (&own, own_count)),
                None => return,
            },
            Err(why) => {
                self.reject(from, key, &format!("part chunk {chunk}: {why}"));
                match &mut self.tally {
                    Some(t) => t.exclude_part(m, chunk, count, (&own, own_count)),
                    None => return,
                }
            }
        };
        self.on_taken(taken);
    }

    /// Sends a reduced chunk of this replica's part to the others and keeps it.
    fn on_taken(&mut self, taken: Taken) {
        let Taken::Reduced { chunk, avg, total } = taken else {
            if let Taken::Refused(why) = taken {
                self.debug(|| format!("part chunk refused: {why}"));
            }
            return;
        };
        let Some(r) = &self.round else { return };
        let mut frame = Vec::new();
        if wire::encode_chunk(&avg, &self.cfg.chunk_codec(), &mut frame).is_err() {
            return;
        }
        let frame = Arc::new(frame);
        let (key, index) = (r.key(), r.index as u32);
        let to: Vec<PeerId> = r
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.me)
            .collect();
        let msg = AvgMsg::Reduced {
            step: key.0,
            attempt: key.1,
            index,
            total,
            chunk,
        };
        if let Some(t) = &mut self.tally {
            // Every member, this one too, applies exactly what was encoded.
            t.add_reduced(index as usize, chunk, Arc::clone(&frame), total);
        }
        if !to.is_empty() {
            self.send_bulk(Bulk::Reduced {
                key,
                msg,
                frame,
                to,
            });
        }
    }

    pub(super) async fn on_members(
        &mut self,
        step: u64,
        attempt: u32,
        members: Vec<PeerId>,
        lost: u64,
    ) {
        // This actor applies the steps and refreshes the status right after, so the
        // status is current here (no need to wait behind compute for the replica's lock).
        let st = self.status();
        if step == st.params_step + 1 && members.contains(&self.me) {
            // Still finishing this step (its last reduced chunks are on the way):
            // joined once it is applied.
            self.debug(|| format!("holding members {step}/{attempt} until step {step}"));
            self.next_members = Some((step, attempt, members, lost));
            return;
        }
        if step != st.params_step {
            self.debug(|| {
                format!(
                    "ignored members {step}/{attempt} at step {}",
                    st.params_step
                )
            });
            return;
        }
        let Some(index) = members.iter().position(|p| *p == self.me) else {
            return;
        };
        if self.round.as_ref().map(Round::key) == Some((step, attempt)) {
            return;
        }
        // Encoding the sum takes a while for a large stage: off the async threads.
        let (service, codec) = (Arc::clone(&self.service), self.cfg.codec);
        let chunk = round::chunk_for(self.n);
        let job = tokio::task::spawn_blocking(move || service.freeze(step, chunk, &codec));
        let frozen = self.beating(&st, job).await;
        let Ok(Ok(mut frozen)) = frozen else {
            self.debug(|| format!("freeze {step} failed"));
            return;
        };
        if let Some(bad) = self.cfg.tamper.and_then(|t| t.corrupt(step, &frozen.sum)) {
            frozen.sum = Arc::new(bad);
        }
        let key: Key = (step, attempt);
        let uplinks: Vec<u64> = members
            .iter()
            .map(|m| match self.views.get(m) {
                Some(v) => v.uplink,
                None => self.stats.uplink.load(Ordering::Relaxed),
            })
            .collect();
        let timeout = plan::round_timeout(
            self.cfg.round_timeout,
            self.gradient_bytes,
            members.len(),
            &uplinks,
        );
        // Each attempt of a step abandoned at its deadline doubles the next one's: links
        // not measured yet (or slower than measured) cost a few attempts, not one a floor.
        let failed = if self.timed_out.0 == step {
            self.timed_out.1
        } else {
            0
        };
        let timeout = plan::backoff(timeout, failed);
        // A new attempt replaces any other.
        self.end_round(false);
        let layout = Layout::new(frozen.sum.len(), members.len(), frozen.sum.chunk());
        self.joined = Some(step);
        self.round = Some(Round {
            step,
            attempt,
            members: members.clone(),
            index,
            lost,
            deadline: Instant::now() + timeout,
            started: Instant::now(),
            heard: Default::default(),
            span: tracing::info_span!(
                target: "shoal::averaging",
                "round",
                step,
                attempt,
                members = members.len()
            ),
        });
        self.tally = Some(
            Tally::new(key, layout.clone(), index)
                .with_aggregate(self.cfg.aggregate)
                .with_own_declared(frozen.count),
        );
        let to: Vec<(usize, PeerId)> = members
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .collect();
        if to.is_empty() {
            // A round of one: its own sum is the average.
            for c in layout.chunks(index) {
                let Ok(own) = frozen.sum.decode(c) else {
                    continue;
                };
                let taken = match &mut self.tally {
                    Some(t) => t.reduce_alone(c, (&own, frozen.count)),
                    None => continue,
                };
                self.on_taken(taken);
            }
        } else {
            self.send_bulk(Bulk::Parts {
                key,
                count: frozen.count,
                sum: Arc::clone(&frozen.sum),
                layout,
                to,
            });
        }
        self.frozen = Some(frozen);
        // Parts that came before this round's members.
        let early = std::mem::take(&mut self.early);
        for m in early {
            let k = match &m.msg {
                AvgMsg::Part { step, attempt, .. } | AvgMsg::Reduced { step, attempt, .. } => {
                    (*step, *attempt)
                }
                _ => continue,
            };
            if k == key {
                self.on_round_data(m).await;
            } else if kept_early(k.0, step) {
                self.early.push(m);
            }
        }
        self.try_complete().await;
    }

    async fn try_complete(&mut self) {
        let (Some(r), Some(t)) = (&self.round, &mut self.tally) else {
            return;
        };
        let Some((chunks, total)) = t.take_reduced() else {
            return;
        };
        let (step, lost, started, n) = (r.step, r.lost, r.started, self.n);
        let members = r.members.clone();
        let members_done = members.clone();
        let took = started.elapsed();
        // Communication is over: the frozen sum is no longer needed.
        self.end_round(true);
        self.early.retain(|m| {
            !matches!(&m.msg, AvgMsg::Part { step: s, .. } | AvgMsg::Reduced { step: s, .. } if *s <= step)
        });
        let replica = self.service.replica();
        let log = Arc::clone(&self.log);
        let st = self.status();
        let applied = tokio::task::spawn_blocking(move || {
            let avg = round::Frames::new(chunks, n)?;
            let mut r = replica.blocking_lock();
            r.apply(step, &avg, total, lost)
                .map_err(|e| e.to_string())?;
            // Kept for replicas that catch up (losing it only costs them a download).
            let kept =
                log.lock()
                    .record(step, total, lost, r.shared_hash(), &members, avg.chunks());
            if let Err(e) = kept {
                tracing::warn!(target: "shoal::averaging", step, "cannot keep the update for replay: {e}");
            }
            Ok::<(), String>(())
        });
        let applied = self.beating(&st, applied).await;
        match applied {
            Ok(Ok(())) => {
                self.stats
                    .members
                    .fetch_add(members_done.len() as u64, Ordering::Relaxed);
                self.last_members = members_done;
                self.debug(|| {
                    format!(
                        "applied {step}: averaged in {:.1} ms, applied after {:.1} ms, {total} samples",
                        took.as_secs_f64() * 1e3,
                        started.elapsed().as_secs_f64() * 1e3
                    )
                });
                self.stats.rounds.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .round_us
                    .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
                self.stats.record_round(took.as_secs_f64() * 1e3);
            }
            Ok(Err(e)) => self.debug(|| format!("step {step} not applied: {e}")),
            Err(e) => self.debug(|| format!("step {step} not applied: {e}")),
        }
        self.service.refresh_status().await;
        self.step
            .store(self.status().params_step, Ordering::Relaxed);
    }
}
