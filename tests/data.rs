//! Data sources: text and shards load, bad files give one-line errors, sampling is
//! deterministic per (seed, trainer) and differs between trainers.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use shoal::config::{DataConfig, RunConfig};
use shoal::data::{DataError, Sampler, TokenSource};

fn cfg_with(data: DataConfig, vocab: usize) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.model.vocab = vocab;
    cfg.model.seq_len = 8;
    cfg.data = data;
    cfg
}

#[test]
fn text_is_bytes_and_shards_are_u16() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, "héllo, shoal! ".repeat(4)).unwrap();
    let src = TokenSource::open(&cfg_with(DataConfig::Text { path: text }, 256)).unwrap();
    let TokenSource::Tokens { tokens, .. } = &src else {
        panic!("not tokens")
    };
    assert_eq!(tokens[0], b'h' as u32);
    assert_eq!(tokens[1], 0xC3); // 'é' is two UTF-8 bytes
    assert_eq!(tokens.len(), "héllo, shoal! ".len() * 4);

    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    let a: Vec<u8> = (0u16..10).flat_map(|t| t.to_le_bytes()).collect();
    let b: Vec<u8> = (100u16..110).flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(shards.join("000.bin"), a).unwrap();
    std::fs::write(shards.join("001.bin"), b).unwrap();
    std::fs::write(shards.join("notes.txt"), "ignored").unwrap();
    let src = TokenSource::open(&cfg_with(
        DataConfig::Shards {
            path: shards.clone(),
        },
        200,
    ))
    .unwrap();
    let TokenSource::Tokens { tokens, .. } = &src else {
        panic!("not tokens")
    };
    assert_eq!(tokens.len(), 20);
    assert_eq!((tokens[9], tokens[10]), (9, 100));

    // Every sampled sequence is a real window of the data, targets shifted by one.
    let mut s = Sampler::new(1, 0);
    let batch = s.next_batch(&src, 4, 8);
    for (x, y) in batch.inputs.chunks(8).zip(batch.targets.chunks(8)) {
        assert_eq!(&x[1..], &y[..7]);
        let at = tokens.iter().position(|&t| t == x[0]).unwrap();
        assert_eq!(&tokens[at..at + 8], x);
    }
    let e = TokenSource::open(&cfg_with(DataConfig::Shards { path: shards }, 50)).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::TokenOutOfRange {
                token: 109,
                vocab: 50,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn bad_files_give_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    let empty = dir.path().join("empty.txt");
    let short = dir.path().join("short.txt");
    let odd = dir.path().join("odd.bin");
    std::fs::write(&empty, "").unwrap();
    std::fs::write(&short, "abc").unwrap();
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let no_shards = dir.path().join("no-shards");
    std::fs::create_dir(&no_shards).unwrap();
    let cases = [
        (DataConfig::Text { path: missing }, "cannot read"),
        (DataConfig::Text { path: empty }, "empty"),
        (DataConfig::Text { path: short }, "needs 9"),
        (DataConfig::Shards { path: odd }, "odd number of bytes"),
        (DataConfig::Shards { path: no_shards }, "no .bin shards"),
    ];
    for (data, want) in cases {
        let e = TokenSource::open(&cfg_with(data, 256))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    }
}

#[test]
fn sampling_is_deterministic_per_trainer_and_differs_between_trainers() {
    let cfg = RunConfig::tiny();
    let src = TokenSource::open(&cfg).unwrap();
    let draw = |seed, trainer| {
        let mut s = Sampler::new(seed, trainer);
        (0..3)
            .map(|_| s.next_batch(&src, 4, 16))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(1, 0), draw(1, 0));
    assert_ne!(draw(1, 0), draw(1, 1));
    assert_ne!(draw(1, 0), draw(2, 0));
    let mut eval = Sampler::eval(1);
    assert_ne!(eval.next_batch(&src, 4, 16), draw(1, 0)[0]);
    assert!(draw(1, 0)
        .iter()
        .all(|b| b.inputs.iter().all(|&t| (t as usize) < cfg.model.vocab)));
}
