//! The hop into the last stage with pushed activations: the forward of the stage before it
//! is asked to push its output to a replica of the last stage, and the trainer's call to
//! that replica (the targets only) goes out at the same moment and waits there for it. The
//! activations cross one link instead of two, and the microbatch reaches the loss one
//! one-way latency sooner (see [`crate::stage::service::push`]).
//!
//! Whatever goes wrong falls back to the plain way: a push that failed leaves the output in
//! the forward's answer; a last-stage call that failed after the push gets the forward run
//! again. No sample is lost to the hop.

use super::call::{call_stage, lane, pick, settle, settle_failed, swap_reason, Failure};
use super::{Ctx, Micro, Owed, TrainerStats};
use crate::stage::client::{BackwardReply, CallError};
use crate::wire::msg::ErrorKind;
use candle_core::Tensor;
use libp2p::PeerId;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How the hop into the last stage went.
pub(super) enum Hop {
    /// The last stage answered: its replica and its reply, and the step the forward before
    /// it was computed at.
    Done(PeerId, BackwardReply, u64),
    /// Call the last stage the plain way, with this input (the forward's output, when its
    /// push failed, and the step it was computed at) or, when `None`, after running the
    /// forward again.
    Plain(Option<(Tensor, u64)>),
}

/// Runs stage `s`'s forward of microbatch `micro` pushing into a replica of
/// stage `s + 1`, the last, called with `targets`; `tag`: the synchronous step the
/// microbatch belongs to; `first`: the replica of stage 0 that admitted it, whose lane
/// ([`lane`]) the two stages' replicas are taken from when usable. `Err`: stage `s` had no
/// usable replica, or the step closed.
pub(super) async fn into_last(
    ctx: &Ctx,
    s: usize,
    micro: Micro,
    input: &Tensor,
    targets: &Tensor,
    owed: &mut Owed<'_>,
    first: Option<PeerId>,
) -> Result<Hop, Failure> {
    let Micro { id: mb, tag, n } = micro;
    let last = s + 1;
    let prefer = |stage| first.and_then(|p| lane(ctx, stage, p));
    let Some(to) = pick(ctx, last, prefer(last), n, Instant::now())? else {
        return Ok(Hop::Plain(None));
    };
    let t0 = Instant::now();
    let step = tag.unwrap_or_else(|| ctx.stats.stage_steps[last].load(Ordering::Relaxed));
    let bwd = ctx.client.backward_pushed(to, last, step, mb, targets);
    let fwd = call_stage(ctx, s, prefer(s), n, |peer, step| {
        let c = ctx.client.clone();
        let input = input.clone();
        let step = tag.unwrap_or(step);
        async move { c.forward_pushing(peer, s, step, mb, &input, to).await }
    });
    tokio::pin!(bwd);
    tokio::pin!(fwd);
    // The last stage answers first only to refuse (it waits for the push otherwise).
    let mut early: Option<Result<BackwardReply, CallError>> = None;
    let forward = loop {
        tokio::select! {
            f = &mut fwd => break f,
            r = &mut bwd, if early.is_none() => early = Some(r),
        }
    };
    let (out, fwd_step) = match forward {
        Ok((peer, (out, step))) => {
            owed.add(s, peer);
            (out, step)
        }
        Err(reason) => {
            settle(ctx, last, to, n, Err(Duration::ZERO));
            return Err(reason);
        }
    };
    ctx.stats.stage_steps[s].fetch_max(fwd_step, Ordering::Relaxed);
    ctx.stats.step.fetch_max(fwd_step, Ordering::Relaxed);
    let answer = match (early, &out) {
        (Some(r), _) => r,
        // The push failed: the output came back instead; the call there would only wait.
        (None, Some(_)) => {
            settle(ctx, last, to, n, Err(Duration::from_millis(200)));
            return Ok(Hop::Plain(out.map(|o| (o, fwd_step))));
        }
        (None, None) => bwd.await,
    };
    let secs = t0.elapsed().as_secs_f64();
    tracing::trace!(target: "shoal::trainer", stage = last, ms = secs * 1e3, "pushed call");
    match answer {
        Ok(reply) => {
            settle(ctx, last, to, n, Ok(secs));
            Ok(Hop::Done(to, reply, fwd_step))
        }
        Err(e) => {
            settle_failed(ctx, last, to, n, &e);
            if e.kind() == Some(ErrorKind::StepClosed) {
                // The step stage `s` put it in closed at the last stage: start it again.
                tracing::debug!(target: "shoal::trainer", stage = last, "{e}");
                return Err(Failure::Closed);
            }
            ctx.stats.swaps.fetch_add(1, Ordering::Relaxed);
            TrainerStats::bump(&ctx.stats.swap_reasons, &swap_reason(&e), 1);
            Ok(Hop::Plain(out.map(|o| (o, fwd_step))))
        }
    }
}
