//! Unit tests of a round's bookkeeping.

use super::*;
use crate::wire::CodecSpec;

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn frame(values: &[f32]) -> TestResult<Arc<Vec<u8>>> {
    let mut f = Vec::new();
    wire::encode_f32(&[values.len()], values, &CodecSpec::F32, &mut f)?;
    Ok(Arc::new(f))
}

#[test]
fn a_layout_cuts_the_gradient_into_chunks_and_the_chunks_into_parts() -> TestResult {
    let l = Layout::new(25, 3, 4);
    // Seven chunks (six of 4 floats, one of 1), parts of 3, 2 and 2 chunks.
    assert_eq!(l.count(), 7);
    assert_eq!((l.chunks(0), l.chunks(1), l.chunks(2)), (0..3, 3..5, 5..7));
    assert_eq!(l.range(2), Some(8..12));
    assert_eq!(l.range(6), Some(24..25));
    assert_eq!(l.range(7), None);
    assert_eq!((l.owner(4), l.owner(7)), (Some(1), None));
    assert_eq!(l.chunks(3), 0..0);
    let mut seen = [0; 25];
    for p in 0..3 {
        for c in l.chunks(p) {
            for i in l.range(c).ok_or("no range")? {
                seen[i] += 1;
            }
        }
    }
    assert!(seen.iter().all(|&s| s == 1));
    // Chunks do not depend on the members: a retry with other members sends the same
    // frames.
    let two = Layout::new(25, 2, 4);
    assert!((0..7).all(|c| two.range(c) == l.range(c)));
    // More members than chunks: some parts have none.
    let tiny = Layout::new(1, 2, 4);
    assert_eq!((tiny.chunks(0), tiny.chunks(1)), (0..1, 1..1));
    assert_eq!(Layout::new(0, 2, 4).range(0), Some(0..0));
    Ok(())
}

#[test]
fn chunks_are_sized_by_the_gradient_alone() -> TestResult {
    assert_eq!(chunk_for(0), MIN_CHUNK);
    assert_eq!(chunk_for(5_000), MIN_CHUNK);
    assert_eq!(chunk_for(200_000), 12_500);
    assert_eq!(chunk_for(1 << 30), PART_CHUNK);
    Ok(())
}

#[test]
fn a_chunk_is_reduced_when_every_member_sent_it_and_not_twice() -> TestResult {
    // Three members, this replica is member 1: its part is chunk 1, values 3..6.
    let l = Layout::new(9, 3, 3);
    let mut t = Tally::new((4, 9), l, 1);
    let own = [3.0f32, 3.0, 3.0];
    assert_eq!(
        t.add_part(0, 1, 2, &[1.0, 2.0, 3.0], (&own, 1)),
        Taken::Waiting
    );
    assert!(matches!(
        t.add_part(0, 1, 2, &[1.0, 2.0, 3.0], (&own, 1)),
        Taken::Refused(_)
    ));
    assert!(matches!(
        t.add_part(2, 1, 1, &[1.0], (&own, 1)),
        Taken::Refused(_)
    ));
    assert!(matches!(
        t.add_part(2, 0, 1, &[1.0; 3], (&own, 1)),
        Taken::Refused("a chunk of another part")
    ));
    assert!(matches!(
        t.add_part(1, 1, 1, &[1.0; 3], (&own, 1)),
        Taken::Refused(_)
    ));
    assert_eq!(
        t.add_part(2, 1, 1, &[4.0, 3.0, 2.0], (&own, 1)),
        Taken::Reduced {
            chunk: 1,
            avg: vec![2.0, 2.0, 2.0],
            total: 4
        }
    );
    assert!(matches!(
        t.add_part(2, 1, 1, &[4.0, 3.0, 2.0], (&own, 1)),
        Taken::Refused(_)
    ));
    assert_eq!(t.counts(), (0, 3));
    Ok(())
}

#[test]
fn the_gradient_is_assembled_once_every_reduced_chunk_is_in() -> TestResult {
    // Chunks 0..2, 2..4, 4..5; part 0 has chunks 0 and 1, part 1 chunk 2.
    let l = Layout::new(5, 2, 2);
    let mut t = Tally::new((1, 1), l, 0);
    assert!(t.add_reduced(1, 2, frame(&[5.0])?, 6));
    assert!(!t.add_reduced(1, 2, frame(&[5.0])?, 6), "duplicate");
    assert!(!t.add_reduced(0, 0, frame(&[1.0])?, 6), "wrong length");
    assert!(!t.add_reduced(0, 0, frame(&[1.0, 2.0])?, 7), "other total");
    assert!(
        !t.add_reduced(0, 5, frame(&[1.0, 2.0])?, 6),
        "no such chunk"
    );
    assert!(!t.add_reduced(1, 0, frame(&[1.0, 2.0])?, 6), "not its part");
    assert!(t.add_reduced(0, 0, frame(&[1.0, 2.0])?, 6));
    assert!(!t.complete());
    assert!(t.take_reduced().is_none());
    assert!(t.add_reduced(0, 1, frame(&[3.0, 4.0])?, 6));
    let (chunks, total) = t.take_reduced().ok_or("not complete")?;
    assert_eq!(total, 6);
    assert!(Frames::new(chunks[1..].to_vec(), 5).is_err(), "a gap");
    let f = Frames::new(chunks, 5)?;
    assert_eq!(f.read(0..5)?, vec![1.0, 2.0, 3.0, 4.0, 5.0]);
    // Ranges across chunk boundaries, in any order.
    assert_eq!(f.read(3..5)?, vec![4.0, 5.0]);
    assert_eq!(f.read(1..4)?, vec![2.0, 3.0, 4.0]);
    assert_eq!(f.read(2..2)?, Vec::<f32>::new());
    assert!(f.read(4..6).is_err());
    Ok(())
}

#[test]
fn a_round_of_one_reduces_its_own_sum() -> TestResult {
    let l = Layout::new(3, 1, 2);
    let mut t = Tally::new((0, 1), l, 0);
    let own = [2.0f32, 4.0, 6.0];
    let r = t.reduce_alone(1, (&own[2..], 2));
    assert_eq!(
        r,
        Taken::Reduced {
            chunk: 1,
            avg: vec![3.0],
            total: 2
        }
    );
    assert!(matches!(
        t.reduce_alone(1, (&own[2..], 2)),
        Taken::Refused(_)
    ));
    Ok(())
}

#[test]
fn a_rejected_copy_is_left_out_and_centered_clip_reduces_the_rest() -> TestResult {
    // Three members, one chunk of 2 floats owned by member 0.
    let l = Layout::new(2, 3, 2);
    let own = [2.0f32, 4.0];
    let mut t = Tally::new((1, 1), l.clone(), 0);
    assert_eq!(t.add_part(1, 0, 2, &[6.0, 8.0], (&own, 2)), Taken::Waiting);
    // Member 2's copy was rejected: the mean is over members 0 and 1 only.
    assert_eq!(
        t.exclude_part(2, 0, 3, (&own, 2)),
        Taken::Reduced {
            chunk: 0,
            avg: vec![2.0, 3.0],
            total: 7
        }
    );
    // CenteredClip: three agreeing members and nothing else give their mean gradient.
    let cc = Aggregate::CenteredClip { tau: 1.0, iters: 5 };
    let mut t = Tally::new((1, 1), l, 0).with_aggregate(cc);
    assert_eq!(t.add_part(1, 0, 1, &[1.0, 2.0], (&own, 2)), Taken::Waiting);
    match t.add_part(2, 0, 4, &[4.0, 8.0], (&own, 2)) {
        Taken::Reduced { avg, total, .. } => {
            assert_eq!(total, 7);
            assert!((avg[0] - 1.0).abs() < 1e-6 && (avg[1] - 2.0).abs() < 1e-6);
        }
        other => return Err(format!("not reduced: {other:?}").into()),
    }
    Ok(())
}

#[test]
fn a_round_with_a_rejected_copy_still_completes_with_one_total() -> TestResult {
    // Two members (the soak's stall): chunks 0..2, 2..4, 4..6; member 0 (this replica)
    // owns chunks 0 and 1, and member 1's copy of chunk 1 is rejected. Both reduced chunks
    // carry the step's total, so they are taken (a total that differs between chunks is
    // refused, and the round never completed) and the gradient is assembled.
    let l = Layout::new(6, 2, 2);
    let own = [1.0f32, 1.0, 2.0, 2.0];
    let mut t = Tally::new((5, 1), l, 0).with_own_declared(16);
    let mut totals = Vec::new();
    for (c, taken) in [
        (0, t.add_part(1, 0, 16, &[3.0, 3.0], (&own[..2], 16))),
        (1, t.exclude_part(1, 1, 16, (&own[2..], 16))),
    ] {
        let Taken::Reduced { avg, total, .. } = taken else {
            return Err(format!("chunk {c} was not reduced").into());
        };
        totals.push(total);
        assert!(t.add_reduced(0, c, frame(&avg)?, total), "chunk {c}");
    }
    assert_eq!(totals, [32, 32]);
    assert!(t.add_reduced(1, 2, frame(&[0.5, 0.5])?, 32));
    let (chunks, total) = t.take_reduced().ok_or("not complete")?;
    assert_eq!(total, 32);
    // Chunk 0 averages both copies over 32 samples; chunk 1 is this replica's alone.
    let f = Frames::new(chunks, 6)?;
    assert_eq!(f.read(0..6)?, vec![0.125, 0.125, 0.125, 0.125, 0.5, 0.5]);
    Ok(())
}
