//! Resume: a local run stopped and resumed from its checkpoints ends bit-identical to one
//! that never stopped; checkpoints of another run are refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use shoal::config::RunConfig;
use shoal::model::checkpoint;
use shoal::train::{stage_checkpoint, train_local, LocalOptions};

fn run(cfg: &RunConfig, steps: u64, checkpoint: &std::path::Path, resume: bool) -> u64 {
    let opts = LocalOptions {
        steps: Some(steps),
        eval_batches: 1,
        checkpoint: Some(checkpoint.to_path_buf()),
        resume: resume.then(|| checkpoint.to_path_buf()),
        ..LocalOptions::default()
    };
    train_local(cfg, &opts, &mut |_| {}).unwrap().first_step
}

#[test]
fn a_resumed_local_run_ends_where_an_uninterrupted_one_does() {
    let mut cfg = RunConfig::tiny();
    cfg.training.steps = 6;
    let dir = tempfile::tempdir().unwrap();
    let (whole, parts) = (dir.path().join("whole"), dir.path().join("parts"));
    assert_eq!(run(&cfg, 6, &whole, false), 0);
    assert_eq!(run(&cfg, 3, &parts, false), 0);
    assert_eq!(
        checkpoint::peek(&stage_checkpoint(&parts, 1)).unwrap().step,
        3
    );
    assert_eq!(run(&cfg, 6, &parts, true), 3, "resumed at step 3");
    for s in 0..cfg.stages.count {
        let a = checkpoint::peek(&stage_checkpoint(&whole, s)).unwrap();
        let b = checkpoint::peek(&stage_checkpoint(&parts, s)).unwrap();
        assert_eq!((a.step, &a.params_hash), (6, &b.params_hash), "stage {s}");
        assert_eq!(a.run, b.run);
    }
    // Another config (another run id) is refused, and says so on one line.
    let mut other = cfg.clone();
    other.optimizer.lr *= 2.0;
    let opts = LocalOptions {
        steps: Some(7),
        resume: Some(parts.clone()),
        ..LocalOptions::default()
    };
    let err = train_local(&other, &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("a checkpoint of run") && !err.contains('\n'),
        "{err}"
    );
}
