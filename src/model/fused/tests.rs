//! Each fused kernel against its primitive-op form ([`super::primitive`]): values and
//! gradients.

use super::*;
use candle_core::{Device, Var};

/// What a test that fails on an error returns.
type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A random f32 tensor.
fn rand(shape: &[usize], seed: u64) -> Result<Tensor> {
    let mut rng = crate::rng::Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn close(a: &Tensor, b: &Tensor, tol: f32) -> TestResult {
    let (a, b) = (
        a.flatten_all()?.to_vec1::<f32>()?,
        b.flatten_all()?.to_vec1::<f32>()?,
    );
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {i}: fused {x}, reference {y}"
        );
    }
    Ok(())
}

/// The output of `f` on `inputs` and the gradients of Σ(out ⊙ r), for a fixed random r,
/// with respect to every input.
fn value_and_grads(
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> TestResult<(Tensor, Vec<Tensor>)> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts)?;
    let grads = (&out * &rand(out.dims(), 99)?)?.sum_all()?.backward()?;
    let g = ts
        .iter()
        .map(|t| grads.get(t).cloned().ok_or("an input got no gradient"))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((out, g))
}

/// Compares `fused_f` with `reference` on `inputs`: values, and every input's gradient.
fn check(
    inputs: &[Tensor],
    fused_f: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> TestResult {
    let (a, ga) = value_and_grads(inputs, &fused_f)?;
    let (b, gb) = value_and_grads(inputs, &reference)?;
    close(&a, &b, 1e-5)?;
    for (x, y) in ga.iter().zip(&gb) {
        close(x, y, 1e-4)?;
    }
    Ok(())
}

#[test]
fn gelu_matches_candles() -> TestResult {
    // Large enough to take the threaded path.
    let x = rand(&[64, 1024], 1)?;
    check(&[x], |t| gelu(&t[0]), |t| primitive::gelu(&t[0]))
}

#[test]
fn norms_match_the_primitive_forms() -> TestResult {
    let x = (rand(&[8, 16, 64], 2)? * 3.0)?;
    let w = (rand(&[64], 3)? + 1.0)?;
    let b = rand(&[64], 4)?;
    check(
        &[x.clone(), w.clone(), b],
        |t| layer_norm(&t[0], &t[1], &t[2], 1e-5),
        |t| primitive::layer_norm(&t[0], &t[1], &t[2], 1e-5),
    )?;
    check(
        &[x, w],
        |t| rms_norm(&t[0], &t[1], 1e-5),
        |t| primitive::rms_norm(&t[0], &t[1], 1e-5),
    )
}

#[test]
fn swiglu_matches_silu_times_up() -> TestResult {
    let (a, u) = (rand(&[4, 8, 96], 5)?, rand(&[4, 8, 96], 6)?);
    check(
        &[a, u],
        |t| swiglu(&t[0], &t[1]),
        |t| primitive::swiglu(&t[0], &t[1]),
    )
}

#[test]
fn causal_softmax_matches_the_masked_softmax_also_with_a_cache_offset() -> TestResult {
    let seq = 12;
    let mask = super::super::layers::causal_mask(seq, &Device::Cpu, DType::F32)?;
    for (t, s, pos) in [(12, 12, 0), (3, 10, 7), (1, 6, 5)] {
        let att = rand(&[2, 3, t, s], 7)?;
        check(
            &[att],
            |x| causal_softmax(&x[0], 0.25, pos, &mask),
            |x| primitive::causal_softmax(&x[0], 0.25, pos, &mask),
        )?;
    }
    Ok(())
}

#[test]
fn cross_entropy_matches_candles() -> TestResult {
    let logits = (rand(&[20, 33], 8)? * 4.0)?;
    let targets: Vec<u32> = (0..20).map(|i| (i * 7 % 33) as u32).collect();
    let t = Tensor::from_vec(targets, 20, &Device::Cpu)?;
    check(
        std::slice::from_ref(&logits),
        |x| cross_entropy(&x[0], &t),
        |x| primitive::cross_entropy(&x[0], &t),
    )?;
    // A target past the vocab is an error, not a read out of bounds.
    let bad = Tensor::from_vec(vec![40u32; 20], 20, &Device::Cpu)?;
    assert!(cross_entropy(&logits, &bad).is_err());
    Ok(())
}

#[test]
fn bias_add_matches_the_broadcast_for_a_bias_and_a_position_table() -> TestResult {
    let x = rand(&[4, 8, 96], 9)?;
    for b in [rand(&[96], 10)?, rand(&[8, 96], 11)?] {
        check(
            &[x.clone(), b],
            |t| bias_add(&t[0], &t[1]),
            |t| primitive::bias_add(&t[0], &t[1]),
        )?;
    }
    Ok(())
}
