//! The staged model's math: split = unsplit (logits and gradients), finite differences,
//! every parameter learns, checkpoints round-trip bit-identically.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use candle_core::{DType, Device, Tensor};
use shoal::config::{Family, RunConfig};
use shoal::model::optim::global_norm;
use shoal::model::{checkpoint, AdamW, Stage, Upstream};
use std::collections::HashMap;

type R = Result<(), Box<dyn std::error::Error>>;

fn with_stages(mut cfg: RunConfig, s: usize) -> RunConfig {
    cfg.stages.count = s;
    cfg.stages.cuts.clear();
    cfg.validate().expect("valid");
    cfg
}

/// The tiny config in both families (Llama with grouped-query attention: 4 heads, 2 kv).
fn families() -> Vec<(&'static str, RunConfig)> {
    let mut llama = RunConfig::tiny();
    llama.model.family = Family::Llama;
    llama.model.n_kv_heads = Some(2);
    llama.validate().expect("valid");
    vec![("gpt", RunConfig::tiny()), ("llama", llama)]
}

fn tokens(cfg: &RunConfig, b: usize, seed: u64, dev: &Device) -> (Tensor, Tensor) {
    let mut rng = shoal::rng::Rng::new(seed);
    let t = cfg.model.seq_len;
    let v: Vec<u32> = (0..b * (t + 1))
        .map(|_| rng.below(cfg.model.vocab as u64) as u32)
        .collect();
    let all = Tensor::from_vec(v, (b, t + 1), dev).unwrap();
    (
        all.narrow(1, 0, t).unwrap().contiguous().unwrap(),
        all.narrow(1, 1, t).unwrap().contiguous().unwrap(),
    )
}

fn build(cfg: &RunConfig, dtype: DType) -> Vec<Stage> {
    (0..cfg.stages.count)
        .map(|i| Stage::with_dtype(cfg, i, &Device::Cpu, dtype).unwrap())
        .collect()
}

/// Forward through every stage, then backward from the loss; gradients by parameter name.
fn staged_grads(stages: &[Stage], x: &Tensor, y: &Tensor) -> (f32, HashMap<String, Tensor>) {
    let mut inputs = vec![x.clone()];
    for s in &stages[..stages.len() - 1] {
        let out = s.forward(inputs.last().unwrap()).unwrap();
        inputs.push(out);
    }
    let mut grads = HashMap::new();
    let mut up: Option<Tensor> = None;
    let mut loss = f32::NAN;
    for (i, s) in stages.iter().enumerate().rev() {
        let g = match &up {
            None => s.backward(&inputs[i], Upstream::Targets(y)).unwrap(),
            Some(g) => s.backward(&inputs[i], Upstream::Grad(g)).unwrap(),
        };
        if let Some(l) = g.loss {
            loss = l;
        }
        for (name, t) in s.params().names().iter().zip(g.grads) {
            grads.insert(name.clone(), t);
        }
        up = g.grad_input;
    }
    (loss, grads)
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let d = global_norm(&[(a - b).unwrap()]).unwrap();
    let n = global_norm(std::slice::from_ref(a)).unwrap();
    d / n.max(1e-300)
}

#[test]
fn split_logits_equal_unsplit() -> R {
    for (family, base) in families() {
        split_logits_equal_unsplit_for(family, base)?;
    }
    Ok(())
}

fn split_logits_equal_unsplit_for(family: &str, base: RunConfig) -> R {
    let dev = Device::Cpu;
    let (x, _) = tokens(&base, 3, 1, &dev);
    let full = Stage::new(&with_stages(base.clone(), 1), 0, &dev)?;
    let want = full.forward(&x)?;
    for s in [2, 4] {
        let stages = build(&with_stages(base.clone(), s), DType::F32);
        let mut h = x.clone();
        for st in &stages {
            h = st.forward(&h)?;
        }
        assert_eq!(h.dims(), want.dims());
        let diff = (&h - &want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff <= 1e-5, "{family} S={s}: max abs diff {diff}");
    }
    Ok(())
}

#[test]
fn staged_gradients_equal_unsplit_autograd() -> R {
    for (family, base) in families() {
        staged_gradients_equal_unsplit_autograd_for(family, base)?;
    }
    Ok(())
}

fn staged_gradients_equal_unsplit_autograd_for(family: &str, base: RunConfig) -> R {
    let dev = Device::Cpu;
    let (x, y) = tokens(&base, 2, 2, &dev);
    // The unsplit model's own autograd: one graph from tokens to loss.
    let full = Stage::new(&with_stages(base.clone(), 1), 0, &dev)?;
    let store = full.loss(&x, &y)?.backward()?;
    let reference: HashMap<String, Tensor> = full
        .params()
        .names()
        .iter()
        .zip(full.params().vars())
        .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).expect("grad").clone()))
        .collect();
    for s in [1, 2, 4] {
        let stages = build(&with_stages(base.clone(), s), DType::F32);
        let (_, grads) = staged_grads(&stages, &x, &y);
        assert_eq!(
            grads.len(),
            reference.len(),
            "{family} S={s}: parameter sets differ"
        );
        for (name, want) in &reference {
            let e = rel_err(want, &grads[name]);
            assert!(e <= 1e-4, "{family} S={s} {name}: relative error {e}");
        }
    }
    Ok(())
}

#[test]
fn finite_differences_match_staged_backward() -> R {
    let text = r#"
        [model]
        vocab = 7
        d_model = 8
        n_layers = 2
        n_heads = 2
        seq_len = 5
        seed = 3
        [stages]
        count = 2
    "#;
    let probes = [
        ("wte", 9),
        ("wpe", 3),
        ("h.0.ln1.weight", 2),
        ("h.0.attn.qkv.weight", 17),
        ("h.0.attn.proj.bias", 1),
        ("h.1.mlp.fc.weight", 40),
        ("h.1.ln2.bias", 5),
        ("ln_f.weight", 4),
        ("lm_head.weight", 11),
    ];
    check_finite_differences(text, &probes)
}

/// A two-block Llama in two stages, small enough for finite differences.
const LLAMA_MICRO: &str = r#"
    [model]
    family = "llama"
    vocab = 7
    d_model = 8
    n_layers = 2
    n_heads = 2
    n_kv_heads = 1
    seq_len = 5
    seed = 3
    [stages]
    count = 2
"#;

#[test]
fn finite_differences_match_staged_backward_llama() -> R {
    let text = LLAMA_MICRO;
    let probes = [
        ("model.embed_tokens.weight", 9),
        ("model.layers.0.input_layernorm.weight", 2),
        ("model.layers.0.self_attn.q_proj.weight", 17),
        ("model.layers.0.self_attn.k_proj.weight", 5),
        ("model.layers.0.self_attn.v_proj.weight", 3),
        ("model.layers.1.self_attn.o_proj.weight", 7),
        ("model.layers.1.mlp.gate_proj.weight", 12),
        ("model.layers.1.mlp.up_proj.weight", 30),
        ("model.layers.1.mlp.down_proj.weight", 21),
        ("model.layers.1.post_attention_layernorm.weight", 6),
        ("model.norm.weight", 4),
        ("lm_head.weight", 11),
    ];
    check_finite_differences(text, &probes)
}

/// Central differences of the loss against the staged backward, at a few entries of
/// the named parameters of `text`'s model (f64).
fn check_finite_differences(text: &str, probes: &[(&str, usize)]) -> R {
    let cfg = RunConfig::from_toml(text, "micro")?;
    let dev = Device::Cpu;
    let stages = build(&cfg, DType::F64);
    let (x, y) = tokens(&cfg, 2, 9, &dev);
    let (_, grads) = staged_grads(&stages, &x, &y);
    let loss_now = |stages: &[Stage]| -> f64 {
        let h = stages[0].forward(&x).unwrap();
        stages[1].loss(&h, &y).unwrap().to_scalar::<f64>().unwrap()
    };

    let eps = 1e-5;
    for &(name, idx) in probes {
        let (si, pi) = stages
            .iter()
            .enumerate()
            .find_map(|(si, s)| {
                s.params()
                    .names()
                    .iter()
                    .position(|n| n == name)
                    .map(|pi| (si, pi))
            })
            .expect(name);
        let var = stages[si].params().vars()[pi].clone();
        let orig = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
        let shape = var.as_tensor().dims().to_vec();
        let eval = |delta: f64| {
            let mut v = orig.clone();
            v[idx] += delta;
            var.set(&Tensor::from_vec(v, shape.as_slice(), &dev).unwrap())
                .unwrap();
            loss_now(&stages)
        };
        let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
        eval(0.0);
        let analytic = grads[name].flatten_all()?.to_vec1::<f64>()?[idx];
        let tol = 1e-6 + 1e-4 * numeric.abs().max(analytic.abs());
        assert!(
            (numeric - analytic).abs() <= tol,
            "{name}[{idx}]: numeric {numeric:e} vs analytic {analytic:e}"
        );
        assert!(analytic != 0.0, "{name}[{idx}] has a zero gradient");
    }
    Ok(())
}

#[test]
fn every_parameter_receives_a_gradient() -> R {
    for (family, base) in families() {
        let n = every_parameter_learns(with_stages(base, 4))?;
        assert!(n > 10, "{family}: only {n} parameters");
    }
    Ok(())
}

/// Every parameter of `cfg`'s stages gets a finite non-zero gradient; returns how many.
fn every_parameter_learns(cfg: RunConfig) -> Result<usize, Box<dyn std::error::Error>> {
    let stages = build(&cfg, DType::F32);
    let (x, y) = tokens(&cfg, 2, 3, &Device::Cpu);
    let (loss, grads) = staged_grads(&stages, &x, &y);
    let expected = (cfg.model.vocab as f32).ln();
    // Logits start with a spread of ~√(d/(3·d)) ≈ 0.58 (fan-in init of the head over a
    // normalised input), which adds ~σ²/2 ≈ 0.17 nats to ln(vocab).
    assert!(
        (loss - expected).abs() < 0.4,
        "initial loss {loss} far from ln(vocab) {expected}"
    );
    let total: usize = stages.iter().map(|s| s.params().len()).sum();
    assert_eq!(grads.len(), total);
    for (name, g) in grads {
        let m = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(m > 0.0 && m.is_finite(), "{name}: max |grad| = {m}");
    }
    Ok(total)
}

#[test]
fn same_config_same_weights_on_every_peer() -> R {
    let cfg = with_stages(RunConfig::tiny(), 2);
    let a = Stage::new(&cfg, 1, &Device::Cpu)?;
    let b = Stage::new(&cfg, 1, &Device::Cpu)?;
    assert_eq!(a.params().hash()?, b.params().hash()?);
    let mut other = cfg.clone();
    other.model.seed += 1;
    let c = Stage::new(&other, 1, &Device::Cpu)?;
    assert_ne!(a.params().hash()?, c.params().hash()?);
    Ok(())
}

#[test]
fn checkpoint_round_trips_bit_identically() -> R {
    let cfg = with_stages(RunConfig::tiny(), 2);
    let dev = Device::Cpu;
    let stage = Stage::new(&cfg, 1, &dev)?;
    let mut opt = AdamW::new(&cfg.optimizer, cfg.training.steps, stage.params())?;
    let mut rng = shoal::rng::Rng::new(4);
    let h = Tensor::from_vec(
        (0..2 * cfg.model.seq_len * cfg.model.d_model)
            .map(|_| rng.normal() as f32)
            .collect::<Vec<_>>(),
        (2, cfg.model.seq_len, cfg.model.d_model),
        &dev,
    )?;
    let (_, y) = tokens(&cfg, 2, 5, &dev);
    for _ in 0..3 {
        let g = stage.backward(&h, Upstream::Targets(&y))?;
        opt.step(stage.params(), &g.grads)?;
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("stage1.safetensors");
    let info = checkpoint::Info {
        run: "run-a".into(),
        config: "[model]".into(),
        stage: 1,
        step: opt.step_count(),
        params_hash: format!("{:016x}", stage.params().hash()?),
        samples_applied: 48,
        samples_lost: 2,
    };
    checkpoint::save(&stage, &opt, &path, &info)?;
    assert_eq!(checkpoint::peek(&path)?, info);
    // Nothing but the checkpoint is left in the folder (the temp file was renamed).
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);

    let mut other_cfg = cfg.clone();
    other_cfg.model.seed = 99;
    let fresh = Stage::new(&other_cfg, 1, &dev)?;
    let mut fresh_opt = AdamW::new(&cfg.optimizer, cfg.training.steps, fresh.params())?;
    assert_ne!(fresh.params().hash()?, stage.params().hash()?);
    // Another run's checkpoint is refused before anything changes.
    let err = checkpoint::load(&fresh, &mut fresh_opt, &path, "run-b").unwrap_err();
    assert!(err.to_string().contains("run run-a"), "{err}");
    assert_ne!(fresh.params().hash()?, stage.params().hash()?);
    let step = checkpoint::load(&fresh, &mut fresh_opt, &path, "run-a")?.step;
    assert_eq!(step, 3);
    assert_eq!(fresh.params().hash()?, stage.params().hash()?);
    let bits = |ts: &[Tensor]| -> Vec<Vec<u32>> {
        ts.iter()
            .map(|t| {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|f| f.to_bits())
                    .collect()
            })
            .collect()
    };
    assert_eq!(bits(opt.moments().0), bits(fresh_opt.moments().0));
    assert_eq!(bits(opt.moments().1), bits(fresh_opt.moments().1));

    // The wrong stage's checkpoint is refused with a clear error.
    let stage0 = Stage::new(&cfg, 0, &dev)?;
    let mut opt0 = AdamW::new(&cfg.optimizer, 10, stage0.params())?;
    let err = checkpoint::load(&stage0, &mut opt0, &path, "run-a").unwrap_err();
    assert!(err.to_string().contains("stage"), "{err}");
    // A damaged file (one parameter byte flipped) does not load; a text file is not one.
    let mut bytes = std::fs::read(&path)?;
    let n = bytes.len();
    bytes[n - 1] ^= 0x40;
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, &bytes)?;
    let mut opt1 = AdamW::new(&cfg.optimizer, 10, fresh.params())?;
    assert!(checkpoint::load(&fresh, &mut opt1, &bad, "run-a").is_err());
    std::fs::write(&bad, "not a checkpoint")?;
    assert!(checkpoint::peek(&bad).is_err());
    Ok(())
}

#[test]
fn finite_differences_match_staged_backward_through_a_subspace_boundary() -> R {
    // Stage 0 writes the stream through rank-3 factors and sends 3 coefficients and the
    // token id per token; the last stage's blocks are full. The gradients that cross the
    // packed boundary must still be the loss's.
    let probes = [
        ("model.embed_tokens.sub", 5),
        ("model.layers.0.self_attn.q_proj.weight", 17),
        ("model.layers.0.self_attn.o_proj.sub.weight", 7),
        ("model.layers.0.mlp.down_proj.sub.weight", 20),
        ("model.layers.1.self_attn.o_proj.weight", 7),
        ("model.layers.1.mlp.down_proj.weight", 21),
        ("lm_head.weight", 11),
    ];
    let text = format!("{LLAMA_MICRO}\n[codecs]\nactivations = \"subspace:3\"\n");
    check_finite_differences(&text, &probes)
}

#[test]
fn a_subspace_model_exports_as_the_plain_llama_it_computes() -> R {
    let mut cfg = RunConfig::tiny();
    cfg.model.family = Family::Llama;
    cfg.codecs.activations = "subspace:4".parse()?;
    let cfg = with_stages(cfg, 2);
    let dev = Device::Cpu;
    let stages = build(&cfg, DType::F32);
    let (x, _) = tokens(&cfg, 2, 6, &dev);
    let boundary = stages[0].forward(&x)?;
    assert_eq!(
        boundary.dims(),
        &[2, cfg.model.seq_len, 5],
        "4 coefficients and the id"
    );
    let want = stages[1].forward(&boundary)?;
    // A boundary whose id column is not token ids is refused.
    let bad = (boundary.clone() + 0.5)?;
    assert!(stages[1].forward(&bad).is_err());

    let dir = tempfile::tempdir()?;
    let mut paths = Vec::new();
    for s in &stages {
        let opt = AdamW::new(&cfg.optimizer, 10, s.params())?;
        let path = dir.path().join(format!("stage{}.safetensors", s.index()));
        let info = checkpoint::Info {
            run: "run-s".into(),
            config: toml::to_string(&cfg)?,
            stage: s.index(),
            step: 0,
            params_hash: format!("{:016x}", s.params().hash()?),
            samples_applied: 0,
            samples_lost: 0,
        };
        checkpoint::save(s, &opt, &path, &info)?;
        paths.push(path);
    }
    let out = dir.path().join("model.safetensors");
    shoal::model::export::from_checkpoints(&paths, &out)?;
    let (plain, model) = shoal::model::export::load_model(&out, &dev)?;
    assert_eq!(plain.codecs.activations.subspace, None);
    assert!(model.params().names().iter().all(|n| !n.contains(".sub")));
    let got = model.forward(&x)?;
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-4, "exported logits differ by {diff}");
    Ok(())
}
