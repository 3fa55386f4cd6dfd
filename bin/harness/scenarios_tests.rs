//! Unit tests of the scenarios and their bound.

use super::*;

/// What a test that fails on an error returns.
type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Bench options no scenario here starts processes with.
fn options() -> BenchOptions {
    BenchOptions {
        exe: PathBuf::new(),
        warmup: 0.0,
        seconds: 0.0,
        samples: None,
        concurrency: 1,
    }
}

#[test]
fn bound_counts_the_trainer_hops() -> TestResult {
    let opts = options();
    let s = scenario("homogeneous", &opts)
        .and_then(|v| v.into_iter().next())
        .ok_or("no homogeneous setup")?;
    // Unlimited compute: links bound it. Per sample (f32 sizes, ratio 1): a middle
    // replica receives 3 activations of 16 KiB; a trainer sends every input twice.
    let (b, what, _) = bound(&s, &[f64::INFINITY; 8], 1.0, None);
    let act = 4.0 * 64.0 * 64.0;
    let ids = 4.0 * 64.0;
    let trainer_out: f64 = (2.0 * ids + act) + 2.0 * 3.0 * act + (act + ids);
    let want = 2.0 * 12.5e6 / trainer_out;
    assert_eq!(what, "trainer links");
    assert!((b - want).abs() < 1e-6 * want, "{b} vs {want}");
    // Slow compute: 250 samples/s per replica, 500 per stage, binds.
    let (b, what, slowest) = bound(&s, &[250.0; 8], 0.25, None);
    assert_eq!((b, slowest), (500.0, 500.0));
    assert!(what.contains("compute"), "{what}");
    // The same replicas computing for real on 2 shared cores: a sample costs 4 stages
    // x 1/250 core seconds, so 2 cores do 125 samples/s, below every stage's 500.
    let (b, what, slowest) = bound(&s, &[250.0; 8], 0.25, Some(2.0));
    assert!(
        (b - 125.0).abs() < 1e-9 && (slowest - 125.0).abs() < 1e-9,
        "{b}"
    );
    assert!(what.contains("shared cores"), "{what}");
    Ok(())
}

#[test]
fn every_scenario_is_defined_and_link_args_round_trip() -> TestResult {
    let opts = options();
    for name in SCENARIOS {
        let setups = scenario(name, &opts).ok_or(format!("no scenario {name}"))?;
        assert!(!setups.is_empty());
        for s in setups {
            s.run.validate()?;
            for r in &s.replicas {
                let back = LinkSpec::parse(&link_arg(&r.link))?;
                let (Some(up), Some(want)) = (back.up, r.link.up) else {
                    return Err(format!("{name}: a link without an uplink").into());
                };
                assert!((up - want).abs() < 1.0);
                assert_eq!(back.rtt, r.link.rtt);
            }
        }
    }
    assert!(scenario("nope", &opts).is_none());
    Ok(())
}

#[test]
fn stage_times_come_from_the_counters_and_window_differences() {
    let c = CounterSnapshot {
        jobs: 10,
        compute_us: 200_000,
        decode_us: 1_000,
        encode_us: 2_000,
        stage_in: 1_500_000,
        ..CounterSnapshot::default()
    };
    let t = StageTimes::of(&c);
    assert_eq!(
        (t.jobs, t.compute_ms, t.codec_ms, t.in_mb),
        (10.0, 200.0, 3.0, 1.5)
    );
    assert!(t.line().contains("compute 20.0 ms"));
    let later = StageTimes::of(&CounterSnapshot {
        jobs: 30,
        compute_us: 700_000,
        ..c
    });
    let w = later.since(&t, 1_000.0);
    assert_eq!((w.jobs, w.compute_ms), (20.0, 500.0));
    assert_eq!(w.busy(), Some(0.5));
    assert_eq!(t.busy(), None);
}
