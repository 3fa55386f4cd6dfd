//! Unit tests of the replica's gradient accumulation.

use super::*;
use crate::config::RunConfig;
use crate::model::Upstream;
use candle_core::Device;

/// What a test that fails on an error returns.
type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn one_stage() -> TestResult<(RunConfig, Replica)> {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 1;
    cfg.stages.cuts.clear();
    cfg.validate()?;
    let stage = Stage::new(&cfg, 0, &Device::Cpu)?;
    let r = Replica::new(&cfg, stage)?;
    Ok((cfg, r))
}

/// `n` random sequences of ids and their targets.
fn batch(cfg: &RunConfig, n: usize, seed: u64) -> TestResult<(Tensor, Tensor)> {
    let mut rng = crate::rng::Rng::new(seed);
    let t = cfg.model.seq_len;
    let ids: Vec<u32> = (0..n * (t + 1))
        .map(|_| rng.below(cfg.model.vocab as u64) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (n, t + 1), &Device::Cpu)?;
    Ok((
        all.narrow(1, 0, t)?.contiguous()?,
        all.narrow(1, 1, t)?.contiguous()?,
    ))
}

#[test]
fn a_step_sums_each_microbatch_once_into_one_buffer() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x1, y1) = batch(&cfg, 4, 1)?;
    let (x2, y2) = batch(&cfg, 2, 2)?;
    // What each microbatch's parameter gradients are (the replica keeps them to itself).
    let g1 = r.stage().backward(&x1, Upstream::Targets(&y1))?;
    let g2 = r.stage().backward(&x2, Upstream::Targets(&y2))?;
    let (back, fresh) = r.backward(&x1, Upstream::Targets(&y1), 1)?;
    assert!(fresh);
    assert!(back.grads.is_empty() && back.loss.is_some());
    let (_, fresh) = r.backward(&x2, Upstream::Targets(&y2), 2)?;
    assert!(fresh);
    // The same microbatch again (a retried call) is not accumulated twice.
    let (_, fresh) = r.backward(&x1, Upstream::Targets(&y1), 1)?;
    assert!(!fresh);
    assert_eq!(r.accum_count(), 6);
    // Frozen in f32 chunks of 1000 values: exact, and cut where asked.
    let f = r.freeze(0, 1000, &CodecSpec::F32)?;
    assert_eq!((f.step, f.count), (0, 6));
    let (a, b) = (flatten(&g1.grads)?, flatten(&g2.grads)?);
    assert_eq!((f.sum.len(), f.sum.chunk()), (a.len(), 1000));
    let mut sum = Vec::new();
    for c in 0..a.len().div_ceil(1000) {
        sum.extend(f.sum.decode(c as u32)?);
    }
    assert_eq!(sum.len(), a.len());
    for i in 0..a.len() {
        let want = 4.0 * a[i] + 2.0 * b[i];
        assert!(
            (sum[i] - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "{i}: {} vs {want}",
            sum[i]
        );
    }
    // Later microbatches count toward the next step; a retried round gets the same sum.
    let (x3, y3) = batch(&cfg, 3, 3)?;
    r.backward(&x3, Upstream::Targets(&y3), 3)?;
    assert_eq!(
        (r.accum_step(), r.accum_count(), r.frozen_count()),
        (1, 3, 6)
    );
    let again = r.freeze(0, 1000, &CodecSpec::F32)?;
    assert!(Arc::ptr_eq(&again.sum, &f.sum));
    assert!(
        r.freeze(1, 1000, &CodecSpec::F32).is_err(),
        "step 1 cannot freeze before step 0 applies"
    );
    Ok(())
}

#[test]
fn a_gradient_is_never_more_than_one_step_stale() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x, y) = batch(&cfg, 2, 4)?;
    let zeros = vec![0.0f32; r.stage().params().numel()];
    // A forward kept at step 0 while step 0's round runs: its gradient goes into step 1,
    // one step stale, through the kept graph.
    r.forward(&x, 7)?;
    r.freeze(0, 1000, &CodecSpec::F32)?;
    r.backward(&x, Upstream::Targets(&y), 7)?;
    assert_eq!(r.staleness(), (0, 1));
    // A forward kept at step 0, backward after step 0 applied and step 1 froze: through
    // the kept graph it would be two steps stale, so it is recomputed at step 1.
    r.forward(&x, 8)?;
    r.apply(0, &zeros.as_slice(), 2, 0)?;
    r.freeze(1, 1000, &CodecSpec::F32)?;
    let (g, fresh) = r.backward(&x, Upstream::Targets(&y), 8)?;
    assert!(fresh && g.loss.is_some());
    assert_eq!(r.staleness(), (1, 1));
    assert_eq!(r.accum_step(), 2);
    Ok(())
}

/// A replica (`predict` on or off) that has learnt a lag of one step, then kept a forward
/// at step 8 whose backward comes after step 8 applied: (recomputed kept forwards before
/// that backward, after it, largest staleness).
fn kept_across_an_update(predict: bool) -> TestResult<(u64, u64, u64)> {
    let (cfg, r) = one_stage()?;
    let mut r = r.with_prediction(predict);
    let (x, y) = batch(&cfg, 2, 6)?;
    let n = r.stage().params().numel();
    let upd: Vec<f32> = (0..n).map(|i| ((i % 5) as f32 - 2.0) * 1e-3).collect();
    // Backwards that join the step after their forward's teach the replica the lag.
    for s in 0..8u64 {
        r.forward(&x, 100 + s)?;
        r.freeze(s, 1000, &CodecSpec::F32)?;
        r.backward(&x, Upstream::Targets(&y), 100 + s)?;
        r.apply(s, &upd.as_slice(), 2, 0)?;
    }
    r.forward(&x, 200)?;
    r.freeze(8, 1000, &CodecSpec::F32)?;
    r.apply(8, &upd.as_slice(), 2, 0)?;
    let before = r.staleness().0;
    let (_, fresh) = r.backward(&x, Upstream::Targets(&y), 200)?;
    assert!(fresh);
    assert_eq!(r.accum_step(), 9);
    let (after, max) = r.staleness();
    Ok((before, after, max))
}

#[test]
fn a_forward_kept_before_an_update_is_used_only_where_it_ran_at_predicted_parameters() -> TestResult
{
    // Run at parameters moved by the lag: through the kept graph, one step stale.
    let (before, after, max) = kept_across_an_update(true)?;
    assert_eq!((after - before, max), (0, 1));
    // Without prediction it ran at step 8's parameters: recomputed at step 9's.
    let (before, after, max) = kept_across_an_update(false)?;
    assert_eq!((after - before, max), (1, 1));
    Ok(())
}

#[test]
fn a_frozen_sum_no_round_took_is_counted_as_dropped() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x, y) = batch(&cfg, 3, 5)?;
    r.backward(&x, Upstream::Targets(&y), 1)?;
    r.freeze(0, 1000, &CodecSpec::F32)?;
    r.backward(&x, Upstream::Targets(&y), 2)?;
    // Another step's sum is not this one: nothing dropped.
    assert_eq!(r.drop_unsent(1), 0);
    assert_eq!((r.frozen_count(), r.samples_dropped()), (3, 0));
    // Step 0's frozen samples are dropped and counted; those of step 1 stay.
    assert_eq!(r.drop_unsent(0), 3);
    assert_eq!((r.frozen_count(), r.samples_dropped()), (0, 3));
    assert_eq!((r.accum_step(), r.accum_count()), (0, 3));
    Ok(())
}

#[test]
fn samples_pending_toward_a_step_replayed_without_them_are_dropped() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x, y) = batch(&cfg, 3, 5)?;
    r.backward(&x, Upstream::Targets(&y), 1)?;
    // The others applied step 1 without them: nothing of step 0's to drop.
    assert_eq!(r.drop_pending(1), 0);
    // Step 0 is replayed: its 3 pending samples were in no update; they go, counted.
    assert_eq!(r.drop_pending(0), 3);
    assert_eq!((r.accum_count(), r.samples_dropped()), (0, 3));
    // Samples gathered for the step after a frozen one belong to that next step: kept.
    r.backward(&x, Upstream::Targets(&y), 2)?;
    r.freeze(0, 1000, &CodecSpec::F32)?;
    r.backward(&x, Upstream::Targets(&y), 3)?;
    assert_eq!(r.drop_pending(0), 0);
    assert_eq!((r.accum_step(), r.accum_count()), (1, 3));
    Ok(())
}

/// Sets the stage's parameters from one flat vector, in parameter order.
fn set_params(r: &Replica, flat: &[f32]) -> TestResult {
    let mut at = 0;
    for v in r.stage().params().vars() {
        let k = v.elem_count();
        v.set(&Tensor::from_slice(
            &flat[at..at + k],
            v.dims(),
            v.device(),
        )?)?;
        at += k;
    }
    Ok(())
}

#[test]
fn a_gradient_that_joins_the_next_step_is_computed_at_the_predicted_parameters() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x, y) = batch(&cfg, 2, 5)?;
    let n = r.stage().params().numel();
    let flat_params = |r: &Replica| -> TestResult<Vec<f32>> {
        let ts: Vec<Tensor> = r
            .stage()
            .params()
            .vars()
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect();
        Ok(flatten(&ts)?)
    };
    // One real update, so that there is a last update to predict with.
    let theta0 = flat_params(&r)?;
    let avg: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 1e-2).collect();
    r.apply(0, &avg.as_slice(), 4, 0)?;
    let theta1 = flat_params(&r)?;
    let hash1 = r.params_hash().to_string();
    // Step 1 is being averaged: this microbatch's gradient joins step 2, applied to
    // θ2 ≈ θ1 + (θ1 − θ0).
    r.freeze(1, 1000, &CodecSpec::F32)?;
    let (_, fresh) = r.backward(&x, Upstream::Targets(&y), 9)?;
    assert!(fresh);
    assert_eq!(
        r.params_hash(),
        hash1,
        "the parameters are put back exactly"
    );
    assert_eq!(flat_params(&r)?, theta1);
    // The same gradient by hand, at the predicted parameters.
    let predicted: Vec<f32> = theta1
        .iter()
        .zip(&theta0)
        .map(|(a, b)| a + (a - b))
        .collect();
    set_params(&r, &predicted)?;
    let want = flatten(&r.stage().backward(&x, Upstream::Targets(&y))?.grads)?;
    set_params(&r, &theta1)?;
    let plain = flatten(&r.stage().backward(&x, Upstream::Targets(&y))?.grads)?;
    // What the replica accumulated for step 2.
    r.apply(1, &vec![0.0f32; n].as_slice(), 0, 0)?;
    let f = r.freeze(2, 1000, &CodecSpec::F32)?;
    let mut got = Vec::new();
    for c in 0..n.div_ceil(1000) {
        got.extend(f.sum.decode(c as u32)?);
    }
    // The sum holds each microbatch's mean gradient times its 2 samples.
    let dist = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - 2.0 * y).abs())
            .fold(0.0f32, f32::max)
    };
    assert!(
        dist(&got, &want) < 1e-5,
        "off the predicted gradient by {}",
        dist(&got, &want)
    );
    assert!(dist(&got, &plain) > 1e-4, "the prediction changed nothing");
    Ok(())
}

#[test]
fn a_synchronous_microbatch_joins_its_own_step_or_is_refused() -> TestResult {
    let (cfg, mut r) = one_stage()?;
    let (x, y) = batch(&cfg, 4, 3)?;
    // A forward of step 0 runs at step 0's parameters and owes its samples to step 0.
    r.forward_sync(&x, 7, 0)?;
    assert_eq!(r.owed_count(), 4);
    // A step not reached yet is refused, and so forgets what it was owed there.
    assert!(matches!(
        r.forward_sync(&x, 8, 1),
        Err(SyncError::Closed(_))
    ));
    let (_, fresh, joined) = r.backward_sync(&x, Upstream::Targets(&y), 7, 0)?;
    assert!(fresh && joined == 0);
    assert_eq!((r.accum_count(), r.owed_count()), (4, 0));
    // The step froze: a late backward of it is refused and accumulates nothing, even
    // though its forward ran at step 0.
    r.forward_sync(&x, 9, 0)?;
    r.freeze(0, 1000, &CodecSpec::F32)?;
    let late = r.backward_sync(&x, Upstream::Targets(&y), 9, 0);
    assert!(matches!(late, Err(SyncError::Closed(_))), "{late:?}");
    assert_eq!(
        (r.accum_count(), r.frozen_count(), r.owed_count()),
        (0, 4, 0)
    );
    // Nor does a microbatch of step 1 get computed before step 0 is applied.
    assert!(matches!(
        r.backward_sync(&x, Upstream::Targets(&y), 10, 1),
        Err(SyncError::Closed(_))
    ));
    Ok(())
}

/// Two replicas of a one-stage run in `outer` mode (every 2 steps, outer lr 1, no
/// momentum, whole f32 pseudo-gradients).
fn outer_pair() -> TestResult<(RunConfig, Replica, Replica)> {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 1;
    cfg.stages.cuts.clear();
    cfg.averaging.mode = Some(crate::config::AveragingMode::Outer);
    cfg.averaging.outer_every = Some(2);
    cfg.averaging.outer_lr = Some(1.0);
    cfg.averaging.outer_momentum = Some(0.0);
    cfg.averaging.outer_density = Some(1.0);
    cfg.validate()?;
    let a = Replica::new(&cfg, Stage::new(&cfg, 0, &Device::Cpu)?)?;
    let b = Replica::new(&cfg, Stage::new(&cfg, 0, &Device::Cpu)?)?;
    Ok((cfg, a, b))
}

/// Every chunk of a frozen sum, decoded.
fn decoded(f: &Frozen) -> TestResult<Vec<f32>> {
    let mut out = Vec::new();
    for c in 0..f.sum.len().div_ceil(f.sum.chunk()) {
        out.extend(f.sum.decode(c as u32)?);
    }
    Ok(out)
}

#[test]
fn outer_replicas_step_on_their_own_samples_and_meet_at_the_outer_step() -> TestResult {
    let (cfg, mut a, mut b) = outer_pair()?;
    let mut stepped = (Vec::new(), Vec::new());
    for step in 0..2u64 {
        let (xa, ya) = batch(&cfg, 4, 10 + step)?;
        let (xb, yb) = batch(&cfg, 4, 20 + step)?;
        a.backward(&xa, Upstream::Targets(&ya), 100 + step)?;
        b.backward(&xb, Upstream::Targets(&yb), 200 + step)?;
        let (fa, fb) = (
            a.freeze(step, 1000, &CodecSpec::F32)?,
            b.freeze(step, 1000, &CodecSpec::F32)?,
        );
        assert_eq!(
            (fa.count, fb.count),
            (4, 4),
            "the samples are counted as taken"
        );
        let (da, db) = (decoded(&fa)?, decoded(&fb)?);
        stepped = (
            outer::params_flat(a.stage())?,
            outer::params_flat(b.stage())?,
        );
        if step == 0 {
            // Between outer steps: nothing to average, the replicas' parameters differ,
            // their outer parameters do not.
            assert!(da.iter().chain(&db).all(|x| *x == 0.0));
            assert!(
                fa.sum.bytes() < 64 * fa.sum.len().div_ceil(1000),
                "{} bytes",
                fa.sum.bytes()
            );
        }
        let avg: Vec<f32> = da.iter().zip(&db).map(|(x, y)| (x + y) / 2.0).collect();
        a.apply(step, &&avg[..], 8, 0)?;
        b.apply(step, &&avg[..], 8, 0)?;
        if step == 0 {
            assert_ne!(a.params_hash(), b.params_hash());
            assert_eq!(a.shared_hash(), b.shared_hash());
        }
    }
    // The outer step: with lr 1 and no momentum, both land on the mean of their own
    // parameters, and are identical.
    assert_eq!(a.params_hash(), b.params_hash());
    assert_eq!(a.shared_hash(), a.params_hash());
    let now = outer::params_flat(a.stage())?;
    for ((x, y), z) in stepped.0.iter().zip(&stepped.1).zip(&now) {
        assert!(((x + y) / 2.0 - z).abs() < 1e-5, "{x} {y} -> {z}");
    }
    // A joiner restored from a's snapshot holds the same outer state.
    let (_, _, mut c) = outer_pair()?;
    c.restore(&a.snapshot()?)?;
    assert_eq!(c.shared_hash(), a.shared_hash());
    Ok(())
}
