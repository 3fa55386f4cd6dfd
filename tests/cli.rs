//! The binary's surface: bad input is one line and a non-zero exit; the benchmark prints
//! its table; local training prints progress and a summary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::process::{Command, Output};

fn shoal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run shoal")
}

#[test]
fn bad_input_is_one_clear_line_and_a_failure() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["train", "--local", "--config", "/nonexistent/x.toml"],
            "cannot read config",
        ),
        (
            &[
                "train",
                "--local",
                "--config",
                "configs/tiny.toml",
                "--activations",
                "int3",
            ],
            "unknown codec",
        ),
        (
            &[
                "train",
                "--local",
                "--config",
                "configs/tiny.toml",
                "--device",
                "tpu",
            ],
            "unknown device",
        ),
        (
            &[
                "train",
                "--local",
                "--config",
                "configs/tiny.toml",
                "--device",
                "cuda:0",
            ],
            "--features cuda",
        ),
        (
            &[
                "train",
                "--local",
                "--config",
                "configs/tiny.toml",
                "--stages",
                "9",
            ],
            "stages.count",
        ),
    ];
    for (args, want) in cases {
        let out = shoal(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bench_codec_prints_every_codec() {
    let out = shoal(&["bench", "codec", "--elements", "65536", "--reps", "1"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for codec in [
        "| f32 |",
        "| f16 |",
        "| bf16 |",
        "| int8 |",
        "| int8+zstd1 |",
    ] {
        assert!(text.contains(codec), "missing {codec} in\n{text}");
    }
}

#[test]
fn local_training_prints_loss_and_summary() {
    let out = shoal(&[
        "train",
        "--local",
        "--config",
        "configs/tiny.toml",
        "--steps",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("step      1/3  loss "), "{text}");
    assert!(
        text.contains("done: 3 steps") && text.contains("eval loss"),
        "{text}"
    );
}
