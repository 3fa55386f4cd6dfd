//! Each fused kernel against its primitive-op form: values and gradients.

use super::*;
use candle_core::{Device, Var};

/// A random f32 tensor.
fn rand(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = crate::rng::Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn close(a: &Tensor, b: &Tensor, tol: f32) {
    let (a, b) = (
        a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {i}: fused {x}, reference {y}"
        );
    }
}

/// Compares `fused_f` with `reference` on `inputs`: values, and the gradients of
/// Σ(out ⊙ r) for a random r with respect to every input.
fn check(
    inputs: &[Tensor],
    fused_f: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts).unwrap();
        let r = rand(out.dims(), 99);
        let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<Tensor> = ts.iter().map(|t| grads.get(t).unwrap().clone()).collect();
        (out, g)
    };
    let (a, ga) = run(&fused_f);
    let (b, gb) = run(&reference);
    close(&a, &b, 1e-5);
    for (x, y) in ga.iter().zip(&gb) {
        close(x, y, 1e-4);
    }
}

#[test]
fn gelu_matches_candles() {
    // Large enough to take the threaded path.
    let x = rand(&[64, 1024], 1);
    check(&[x], |t| gelu(&t[0]), |t| t[0].gelu());
}

#[test]
fn norms_match_the_primitive_forms() {
    let x = (rand(&[8, 16, 64], 2) * 3.0).unwrap();
    let w = (rand(&[64], 3) + 1.0).unwrap();
    let b = rand(&[64], 4);
    let refln = |t: &[Tensor]| {
        let mean = t[0].mean_keepdim(D::Minus1)?;
        let xc = t[0].broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
            .broadcast_mul(&t[1])?
            .broadcast_add(&t[2])
    };
    check(
        &[x.clone(), w.clone(), b],
        |t| layer_norm(&t[0], &t[1], &t[2], 1e-5),
        refln,
    );
    let refrms = |t: &[Tensor]| {
        let ms = t[0].sqr()?.mean_keepdim(D::Minus1)?;
        t[0].broadcast_div(&(ms + 1e-5)?.sqrt()?)?
            .broadcast_mul(&t[1])
    };
    check(&[x, w], |t| rms_norm(&t[0], &t[1], 1e-5), refrms);
}

#[test]
fn swiglu_matches_silu_times_up() {
    let (a, u) = (rand(&[4, 8, 96], 5), rand(&[4, 8, 96], 6));
    check(
        &[a, u],
        |t| swiglu(&t[0], &t[1]),
        |t| candle_nn::ops::silu(&t[0])? * &t[1],
    );
}

#[test]
fn causal_softmax_matches_the_masked_softmax_also_with_a_cache_offset() {
    let seq = 12;
    let mask = super::super::layers::causal_mask(seq, &Device::Cpu, DType::F32).unwrap();
    for (t, s, pos) in [(12, 12, 0), (3, 10, 7), (1, 6, 5)] {
        let att = rand(&[2, 3, t, s], 7);
        let reference = |x: &[Tensor]| {
            let a = (&x[0] * 0.25)?.broadcast_add(&mask.narrow(0, pos, t)?.narrow(1, 0, s)?)?;
            candle_nn::ops::softmax(&a, D::Minus1)
        };
        check(
            &[att],
            |x| causal_softmax(&x[0], 0.25, pos, &mask),
            reference,
        );
    }
}

#[test]
fn cross_entropy_matches_candles() {
    let logits = (rand(&[20, 33], 8) * 4.0).unwrap();
    let targets: Vec<u32> = (0..20).map(|i| (i * 7 % 33) as u32).collect();
    let t = Tensor::from_vec(targets, 20, &Device::Cpu).unwrap();
    check(
        std::slice::from_ref(&logits),
        |x| cross_entropy(&x[0], &t),
        |x| candle_nn::loss::cross_entropy(&x[0], &t),
    );
    // A target past the vocab is an error, not a read out of bounds.
    let bad = Tensor::from_vec(vec![40u32; 20], 20, &Device::Cpu).unwrap();
    assert!(cross_entropy(&logits, &bad).is_err());
}
