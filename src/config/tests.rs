//! Unit tests of the run config: parsing, validation, defaults.

use super::*;

#[test]
fn tiny_parses_and_even_split_covers_all_layers() {
    let mut cfg = RunConfig::tiny();
    for s in 1..=cfg.model.n_layers {
        cfg.stages.count = s;
        let r = cfg.stage_ranges();
        assert_eq!(r.len(), s);
        assert_eq!(r[0].0, 0);
        assert_eq!(r[s - 1].1, cfg.model.n_layers);
        assert!(r.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 < w[0].1));
    }
}

#[test]
fn bad_values_are_one_line_errors() {
    let base = include_str!("../../configs/tiny.toml");
    for (find, replace) in [
        ("n_heads = 4", "n_heads = 3"),
        ("count = 2", "count = 9"),
        ("activations = \"int8\"", "activations = \"int3\""),
    ] {
        assert!(base.contains(find), "tiny.toml lacks {find}");
        let text = base.replace(find, replace);
        let err = RunConfig::from_toml(&text, "x.toml").expect_err(replace);
        assert!(!err.to_string().contains('\n'), "{err}");
    }
    let err = RunConfig::from_toml("[model]\nvocab = 3\nbogus = 1", "x.toml").unwrap_err();
    assert!(err.to_string().contains("bogus"), "{err}");
}

#[test]
fn a_bad_subspace_is_refused_in_one_line() {
    let llama =
        include_str!("../../configs/tiny.toml").replace("[model]", "[model]\nfamily = \"llama\"");
    let with = |codec: &str| {
        let text = llama.replace(
            "activations = \"int8\"",
            &format!("activations = \"{codec}\""),
        );
        RunConfig::from_toml(&text, "x.toml")
    };
    let ok = with("subspace:8").expect("rank 8 of 64 is fine");
    assert_eq!(ok.boundary_width(), 9);
    for (codec, says) in [
        ("subspace:0", "1..=64"),
        ("subspace:65", "1..=64"),
        ("subspace:x", "subspace:RANK"),
        ("lowrank:8", "subspace:RANK"),
    ] {
        let err = with(codec).expect_err(codec).to_string();
        assert!(err.contains(says) && !err.contains('\n'), "{codec}: {err}");
    }
    let gpt = include_str!("../../configs/tiny.toml")
        .replace("activations = \"int8\"", "activations = \"subspace:8\"");
    let err = RunConfig::from_toml(&gpt, "x.toml")
        .expect_err("gpt")
        .to_string();
    assert!(err.contains("llama"), "{err}");
}

#[test]
fn explicit_cuts_are_used() {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 2;
    cfg.stages.cuts = vec![1];
    cfg.validate().expect("cuts [1] are valid");
    assert_eq!(cfg.stage_ranges(), vec![(0, 1), (1, cfg.model.n_layers)]);
    cfg.stages.cuts = vec![0];
    assert!(cfg.validate().is_err());
}

/// What a test that fails on an error returns.
type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn the_built_in_tiny_config_is_the_shipped_file() -> TestResult {
    let parsed =
        RunConfig::from_toml(include_str!("../../configs/tiny.toml"), "configs/tiny.toml")?;
    assert_eq!(RunConfig::tiny(), parsed);
    assert_eq!(OptimizerConfig::default(), toml::from_str("")?);
    assert_eq!(TrainingConfig::default(), toml::from_str("")?);
    Ok(())
}

#[test]
fn averaging_knobs_are_optional_and_checked() -> TestResult {
    let base = include_str!("../../configs/tiny.toml");
    let plain = RunConfig::from_toml(base, "x.toml")?;
    assert_eq!(plain.averaging, AveragingConfig::default());
    // Absent knobs leave the canonical text (and so the run id) as it was.
    assert!(!toml::to_string(&plain)?.contains("averaging"));
    let set = format!("{base}\n[averaging]\nround_timeout_s = 60.0\nheartbeat_ms = 500\n");
    let cfg = RunConfig::from_toml(&set, "x.toml")?;
    assert_eq!(cfg.averaging.round_timeout_s, Some(60.0));
    assert_eq!(cfg.averaging.heartbeat_ms, Some(500));
    let cc = format!("{base}\n[averaging]\naggregate = \"centered_clip\"\nclip_tau = 2.0\n");
    let cfg = RunConfig::from_toml(&cc, "x.toml")?;
    assert_eq!(cfg.averaging.aggregate, Some(AggregateKind::CenteredClip));
    assert_eq!(cfg.averaging.clip_tau, Some(2.0));
    for bad in [
        "round_timeout_s = 0.0",
        "round_timeout_s = -1.0",
        "heartbeat_ms = 1",
        "aggregate = \"median\"",
        "clip_tau = 0.0",
        "clip_iters = 0",
        "max_norm_ratio = 0.5",
        "outer_every = 8",
        "mode = \"outer\"\nouter_every = 0",
        "mode = \"outer\"\nouter_density = 0.0",
        "mode = \"outer\"\nouter_density = 1.5",
        "mode = \"outer\"\nouter_momentum = 1.0",
        "mode = \"outer\"\nouter_lr = 0.0",
        "mode = \"outer\"\naggregate = \"centered_clip\"",
        "mode = \"outer\"\nouter_codec = \"int3\"",
        "mode = \"sometimes\"",
    ] {
        let text = format!("{base}\n[averaging]\n{bad}\n");
        match RunConfig::from_toml(&text, "x.toml") {
            Ok(_) => panic!("{bad} was accepted"),
            // A range error names the knob; serde's names the values it accepts.
            Err(err) => assert!(
                err.to_string().contains("averaging.")
                    || err.to_string().contains("centered_clip")
                    || err.to_string().contains("codec")
                    || err.to_string().contains("unknown variant"),
                "{bad}: {err}"
            ),
        }
    }
    // Outer mode: defaults by density (SparseLoCo's when sparse, DiLoCo's when whole).
    let outer = format!("{base}\n[averaging]\nmode = \"outer\"\n");
    let o = RunConfig::from_toml(&outer, "x.toml")?.averaging.outer();
    let o = o.ok_or("outer mode has outer settings")?;
    assert_eq!(
        (o.every, o.lr, o.momentum),
        (AveragingConfig::OUTER_EVERY, 1.0, 0.0)
    );
    assert_eq!(o.codec.to_string(), "int4+zstd1");
    let whole = format!("{outer}outer_density = 1.0\n");
    let o = RunConfig::from_toml(&whole, "x.toml")?.averaging.outer();
    let o = o.ok_or("outer mode has outer settings")?;
    assert_eq!((o.lr, o.momentum), (0.7, 0.9));
    assert!(plain.averaging.outer().is_none());
    Ok(())
}
