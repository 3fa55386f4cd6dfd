//! Unit tests of the gradient checks and the ban book.

use super::*;

#[test]
fn non_finite_and_outsized_chunks_are_rejected_with_a_reason() {
    let mut g = Guard::new(10.0);
    assert!(g.check_part(0, &[1.0, f32::NAN], 1).is_err());
    assert!(g.check_part(0, &[f32::INFINITY], 1).is_err());
    assert!(g.check_part(0, &[1.0], 0).is_err(), "a sum of no samples");
    assert!(g.check_part(0, &[0.0], 0).is_ok());
    // No history yet: anything finite passes and builds it.
    for i in 0..MIN_HISTORY {
        assert!(g.check_part(0, &[3.0 + i as f32, 4.0], 2).is_ok());
    }
    // 9× the median norm per sample passes, 11× does not; another chunk has its own history.
    let m = 2.5f32;
    assert!(g.check_part(0, &[9.0 * 2.0 * m, 0.0], 2).is_ok());
    let err = g.check_part(0, &[11.0 * 2.0 * m * 1.2, 0.0], 2);
    assert!(err.is_err_and(|e| e.contains("median")));
    assert!(g.check_part(1, &[1000.0], 1).is_ok());
    // Off: only finiteness is checked.
    let mut off = Guard::new(0.0);
    for _ in 0..MIN_HISTORY {
        assert!(off.check_part(0, &[1.0], 1).is_ok());
    }
    assert!(off.check_part(0, &[1e9], 1).is_ok());
}

#[test]
fn three_strikes_in_three_attempts_ban_for_a_doubling_period() {
    let mut g = Guard::default();
    let p = PeerId::random();
    let t0 = Instant::now();
    assert!(!g.strike(p, (1, 1), "nan", t0));
    // The same attempt counts once.
    assert!(!g.strike(p, (1, 1), "nan", t0));
    assert!(!g.strike(p, (2, 7), "nan", t0));
    assert!(!g.is_banned(&p, t0));
    assert!(g.strike(p, (3, 1), "nan again", t0));
    assert!(g.is_banned(&p, t0));
    assert!(g.is_banned(&p, t0 + FIRST_BAN - Duration::from_millis(1)));
    assert!(!g.is_banned(&p, t0 + FIRST_BAN));
    let b = g.banned(t0);
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].reason.as_str(), b[0].bans), ("nan again", 1));
    // The second ban is twice as long.
    let t1 = t0 + FIRST_BAN;
    for (i, k) in [(4, 1), (5, 1), (6, 1)].into_iter().enumerate() {
        assert_eq!(g.strike(p, k, "x", t1), i == 2);
    }
    assert!(g.is_banned(&p, t1 + FIRST_BAN * 2 - Duration::from_millis(1)));
    assert!(!g.is_banned(&p, t1 + FIRST_BAN * 2));
    assert!(g.banned(t1 + FIRST_BAN * 2).is_empty());
}
