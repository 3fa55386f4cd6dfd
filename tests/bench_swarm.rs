//! `shoal bench swarm` and `shoal bench converge` end to end. Swarm: a 10-second
//! homogeneous scenario (sim stages behind emulated 100 Mbit/s, 50 ms links, as separate
//! processes) completes and reports a sane bound. Converge: a short run of two modes. No
//! speed is asserted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::process::Command;

/// Runs `shoal bench ARGS... --json FILE`, requires success, and returns what it printed
/// and the rows it wrote.
fn run_bench(args: &[&str]) -> (String, Vec<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (stdout, rows.as_array().unwrap().clone())
}

#[test]
fn homogeneous_scenario_completes_with_a_sane_bound() {
    let (stdout, rows) = run_bench(&[
        "swarm",
        "--scenario",
        "homogeneous",
        "--seconds",
        "10",
        "--warmup",
        "3",
    ]);
    assert!(stdout.contains("efficiency"), "{stdout}");
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["scenario"], "homogeneous");
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    // 4 stages x 2 sim replicas of 4 ms per sample: compute allows at most 500 samples/s,
    // and the links allow less or more, but never nothing.
    let bound = f("bound");
    assert!(bound > 10.0 && bound <= 500.0 + 1e-6, "bound {bound}");
    let sps = f("samples_per_s");
    assert!(sps.is_finite() && sps > 0.0, "samples/s {sps}");
    assert!(r["completed"].as_u64().unwrap() > 0, "{r}");
    let eff = f("efficiency");
    assert!((eff - sps / bound).abs() < 1e-9);
    // No swarm beats its bound (beyond the measuring window's error).
    assert!(eff > 0.0 && eff < 1.1, "efficiency {eff}");
    assert!(f("bytes_per_sample") > 0.0);
    // Replicas report their peak memory (Linux): a peer is more than a few MiB.
    if cfg!(target_os = "linux") {
        assert!(f("peak_rss_mib") > 4.0, "{r}");
    }
    // Trainers are stopped gracefully: every sample fed is completed or reported failed.
    assert_eq!(r["vanished"], 0, "{r}");
}

#[test]
fn a_sim_run_needs_allow_sim_and_a_bad_link_spec_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = shoal::config::RunConfig::tiny();
    cfg.stages.kind = shoal::config::StageKind::Sim;
    cfg.stages.sim_ms_per_sample = Some(2.0);
    cfg.validate().unwrap();
    let path = dir.path().join("sim.toml");
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .current_dir(dir.path())
            .args(["peer", "--run"])
            .arg(&path)
            .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--stage", "0"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, err) = run(&[]);
    assert!(!ok);
    assert!(err.contains("--allow-sim"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let (ok, err) = run(&["--emulate-link", "bw=5"]);
    assert!(!ok);
    assert!(err.contains("bad link spec"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `shoal bench converge` in short: every mode asked for trains the same samples on real
/// stages behind emulated links, keeps its replicas identical, learns something, and the
/// JSON rows carry the keys the converge check reads. No speed is asserted.
#[test]
fn bench_converge_trains_every_mode_on_the_same_samples() {
    let (stdout, rows) = run_bench(&["converge", "--samples", "640", "--modes", "no-sync,delayed"]);
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["no-sync", "delayed", "local"], "{stdout}");
    for r in &rows {
        // 2 trainers x 20 microbatches of 16.
        assert_eq!(r["samples"], 640, "{r}");
        assert_eq!(r["identical"], true, "{r}");
        let eval = r["eval_loss"].as_f64().unwrap();
        // Better than uniform over the 16 tokens (ln 16 = 2.77) after 20 steps.
        assert!(eval.is_finite() && eval < 2.6, "{r}");
        assert!(r["samples_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r.get("seconds_to_target").is_some(), "{r}");
        // Without waiting, a step grows while the previous round runs (more so on a busy
        // machine), so only a few steps are certain: each holds at least the target batch.
        let steps = r["steps"].as_u64().unwrap();
        assert!((3..=20).contains(&steps), "{r}");
    }
    // A bad mode is one line and a failure.
    let bad = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["bench", "converge", "--modes", "eventually"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("unknown mode") && err.trim().lines().count() == 1,
        "{err}"
    );
}
