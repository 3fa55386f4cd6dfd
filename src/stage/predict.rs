//! Weight prediction for delayed updates (as in PipeMare and SpecTrain): a gradient that
//! will be applied `h` updates after the parameters it is computed from is computed at
//! those parameters moved `h` times along the last update, θ + h·Δ, an estimate of the
//! parameters it is applied to.
//!
//! With delayed updates a replica's gradients go into the step being filled while the
//! previous one is averaged, and a microbatch's forward at the first stage runs before
//! updates its backward will follow; plain, such gradients are one step stale, and at the
//! tiny run's batch of 32 samples that costs as much as 7% of eval loss (`train --local`
//! with every gradient one step late, 400 steps: 0.918 → 0.985; computed at θ + Δ: 0.918).
//! The prediction changes which gradients are computed, never how they are averaged or
//! applied, so replicas stay bit-identical; a replica that never sees a lag (synchronous
//! steps) never moves its parameters for it.

use crate::model::ParamSet;
use candle_core::Tensor;

/// Stages of more parameters than this do not predict (the last update is a copy of the
/// parameters, and each predicted pass moves them twice).
pub const MAX_NUMEL: usize = 1 << 24;

/// Weight of a new observation in the running mean of the lag.
const LAG_WEIGHT: f64 = 0.1;

/// Below this expected lag a forward runs at the parameters as they are.
const MIN_HORIZON: f64 = 0.25;

/// The last update and the lag between forwards and the steps their gradients join.
#[derive(Debug)]
pub struct Predictor {
    enabled: bool,
    /// θ_p − θ_{p−1}, per parameter: `None` before the first update or after a state
    /// download.
    delta: Option<Vec<Tensor>>,
    /// Running mean of (step a gradient joined − step its forward ran at).
    lag: f64,
}

impl Predictor {
    /// A predictor, on or off.
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            delta: None,
            lag: 0.0,
        }
    }

    /// Whether a pass can run at predicted parameters (on, and an update to follow).
    pub fn active(&self) -> bool {
        self.enabled && self.delta.is_some()
    }

    /// The expected lag of a forward run now (0 when off or with no update to follow).
    pub fn horizon(&self) -> f64 {
        if self.enabled && self.delta.is_some() && self.lag >= MIN_HORIZON {
            self.lag
        } else {
            0.0
        }
    }

    /// A forward that ran at step `ran_at` had its gradient join step `joined`.
    pub fn observe(&mut self, ran_at: u64, joined: u64) {
        let lag = joined.saturating_sub(ran_at) as f64;
        self.lag += LAG_WEIGHT * (lag - self.lag);
    }

    /// A copy of the parameters before an update (none when off). The last update's Δ is
    /// freed first (this update's replaces it), so the copy takes its room: a stage holds
    /// one parameter-sized copy for prediction, not three, while it updates.
    pub fn before_update(&mut self, params: &ParamSet) -> candle_core::Result<Option<Vec<Tensor>>> {
        if !self.enabled {
            return Ok(None);
        }
        self.delta = None;
        params
            .vars()
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<candle_core::Result<Vec<_>>>()
            .map(Some)
    }

    /// Records the update just applied (`before`: the copy [`Self::before_update`] took),
    /// each parameter's copy freed as its Δ is made.
    pub fn after_update(
        &mut self,
        params: &ParamSet,
        before: Option<Vec<Tensor>>,
    ) -> candle_core::Result<()> {
        self.delta = match before {
            Some(b) => Some(
                params
                    .vars()
                    .iter()
                    .zip(b)
                    .map(|(v, old)| v.as_tensor() - old)
                    .collect::<candle_core::Result<Vec<_>>>()?,
            ),
            None => None,
        };
        Ok(())
    }

    /// Forgets the last update (the parameters were replaced).
    pub fn reset(&mut self) {
        self.delta = None;
    }

    /// Runs `f` with the parameters moved to θ + h·Δ and puts them back exactly (from a
    /// copy, not by subtracting) whatever `f` returns; `h` of 0 runs `f` as it is.
    pub fn shifted<T, E: From<candle_core::Error>>(
        &self,
        params: &ParamSet,
        h: f64,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let Some(delta) = self.delta.as_ref().filter(|_| self.enabled && h > 0.0) else {
            return f();
        };
        let vars = params.vars();
        let saved = vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (v, d) in vars.iter().zip(delta) {
            v.set(&(v.as_tensor() + d.affine(h, 0.0)?)?)?;
        }
        let out = f();
        for (v, s) in vars.iter().zip(&saved) {
            v.set(s)?;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::Stage;

    fn stage() -> Stage {
        let cfg = RunConfig::tiny();
        Stage::new(&cfg, 0, &candle_core::Device::Cpu).unwrap()
    }

    fn flat(p: &ParamSet) -> Vec<f32> {
        let ts: Vec<Tensor> = p.vars().iter().map(|v| v.as_tensor().clone()).collect();
        crate::stage::replica::flatten(&ts).unwrap()
    }

    #[test]
    fn a_shifted_pass_sees_the_predicted_parameters_and_leaves_them_bit_for_bit() {
        let s = stage();
        let p = s.params();
        let mut pr = Predictor::new(true);
        let before = pr.before_update(p).unwrap();
        let old = flat(p);
        // An "update": every parameter moves by 0.01.
        for v in p.vars() {
            v.set(&v.as_tensor().affine(1.0, 0.01).unwrap()).unwrap();
        }
        pr.after_update(p, before).unwrap();
        let now = flat(p);
        assert_eq!(pr.horizon(), 0.0, "no lag seen yet");
        for _ in 0..40 {
            pr.observe(3, 5);
        }
        let h = pr.horizon();
        assert!((1.9..2.0).contains(&h), "lag {h}");
        let seen = pr
            .shifted::<_, candle_core::Error>(p, h, || Ok(flat(p)))
            .unwrap();
        for ((a, b), c) in seen.iter().zip(&now).zip(&old) {
            let want = b + h as f32 * (b - c);
            assert!((a - want).abs() < 1e-5, "{a} vs {want}");
        }
        assert_eq!(flat(p), now, "restored exactly");
        // Off: nothing moves.
        let mut off = Predictor::new(false);
        assert!(off.before_update(p).unwrap().is_none());
        let seen = off
            .shifted::<_, candle_core::Error>(p, 2.0, || Ok(flat(p)))
            .unwrap();
        assert_eq!(seen, now);
    }
}
