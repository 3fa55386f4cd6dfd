//! `shoal bench swarm` end to end: a 10-second homogeneous scenario (sim stages behind
//! emulated 100 Mbit/s, 50 ms links, as separate processes) completes and reports a sane
//! bound. No speed is asserted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::process::Command;

#[test]
fn homogeneous_scenario_completes_with_a_sane_bound() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args([
            "bench",
            "swarm",
            "--scenario",
            "homogeneous",
            "--seconds",
            "10",
        ])
        .args(["--warmup", "3", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("efficiency"), "{stdout}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
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
