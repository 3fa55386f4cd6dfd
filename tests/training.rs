//! Local training learns: the tiny model on the built-in corpus approaches the corpus's
//! entropy rate, and int8 activations train as well as f32.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use shoal::config::RunConfig;
use shoal::train::{train_local, LocalOptions, LocalReport};
use std::sync::OnceLock;

fn run(codec: &str) -> LocalReport {
    let mut cfg = RunConfig::tiny();
    cfg.codecs.activations = codec.parse().expect("codec");
    train_local(&cfg, &LocalOptions::default(), &mut |_| {}).expect("training")
}

/// The tiny config's own run (int8 activations), shared by both tests.
fn int8_run() -> &'static LocalReport {
    static RUN: OnceLock<LocalReport> = OnceLock::new();
    RUN.get_or_init(|| run("int8"))
}

#[test]
fn loss_falls_from_ln_vocab_to_near_the_entropy_rate() {
    let cfg = RunConfig::tiny();
    assert_eq!(cfg.codecs.activations.to_string(), "int8");
    let r = int8_run();
    let ln_v = (cfg.model.vocab as f64).ln();
    let first = r.losses[0] as f64;
    // The head's fan-in init gives logits a spread of ~0.58, ~0.17 nats above ln(vocab).
    assert!(
        (first - ln_v).abs() < 0.4,
        "first loss {first} vs ln(vocab) {ln_v}"
    );
    let h = r.entropy_rate.expect("built-in corpus");
    let gap = r.eval_loss - h;
    assert!(
        gap <= 0.15,
        "eval loss {} is {gap:.3} nats above the entropy rate {h:.3}",
        r.eval_loss
    );
    assert!(
        r.eval_loss >= r.best_loss.expect("built-in") - 0.02,
        "eval loss below the bound: {}",
        r.eval_loss
    );
    assert!(
        r.compression_ratio() > 3.7,
        "int8 ratio {}",
        r.compression_ratio()
    );
}

#[test]
fn int8_activations_reach_the_f32_loss_within_2_percent() {
    let f32_run = run("f32");
    let int8 = int8_run();
    let rel = (int8.eval_loss - f32_run.eval_loss) / f32_run.eval_loss;
    assert!(
        rel <= 0.02,
        "int8 eval loss {} vs f32 {} ({:+.2}%)",
        int8.eval_loss,
        f32_run.eval_loss,
        100.0 * rel
    );
    let ratio = f32_run.compression_ratio();
    assert!(ratio > 0.99 && ratio < 1.01, "f32 ratio {ratio}");
}
