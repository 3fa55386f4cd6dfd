//! What a replica accepts on the wire, derived from the run's manifest: the frame limits
//! (the largest tensor this run sends a replica, not a global cap) and, per request kind,
//! each tensor's dtype, rank and dimensions — checked on a frame's header before a byte of
//! its payload is read.

use crate::config::RunConfig;
use crate::wire::msg::PART_CHUNK;
use crate::wire::msg::{Op, Request};
use crate::wire::{DType, Header, Limits};

/// How much larger than the run's microbatch a tensor's batch dimension may be.
const BATCH_SLACK: usize = 2;

/// A tensor a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Token ids (or targets): u32 `[batch, seq]`.
    Tokens,
    /// Activations or their gradient: f32 `[batch, seq, width]` (`d_model`, or a subspace's
    /// rank and the token id).
    Hidden,
    /// A chunk of a gradient sum or of its average: f32 `[n]`, `n ≤ PART_CHUNK`.
    Part,
}

/// The shapes one replica of one stage accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    first: bool,
    last: bool,
    batch: usize,
    seq: usize,
    d: usize,
}

impl Expect {
    /// For stage `stage` of `cfg`.
    pub fn of(cfg: &RunConfig, stage: usize) -> Self {
        Self {
            first: stage == 0,
            last: stage + 1 == cfg.stages.count,
            batch: cfg.training.batch_size.max(1) * BATCH_SLACK,
            seq: cfg.model.seq_len.max(1),
            d: cfg.boundary_width().max(1),
        }
    }

    /// Frame limits: the largest tensor a request of this run carries.
    pub fn limits(&self) -> Limits {
        let elements = (self.batch * self.seq * self.d).max(PART_CHUNK) as u64;
        Limits {
            max_elements: elements,
            max_bytes: elements * 4,
        }
    }

    /// The tensors a request of kind `op` carries, in order (averaging messages carry at
    /// most one part).
    pub fn wants(&self, op: Op) -> &'static [Want] {
        let input = if self.first {
            Want::Tokens
        } else {
            Want::Hidden
        };
        let upstream = if self.last {
            Want::Tokens
        } else {
            Want::Hidden
        };
        match (op, input, upstream) {
            (Op::Forward, Want::Tokens, _) => &[Want::Tokens],
            (Op::Forward, _, _) => &[Want::Hidden],
            (Op::Backward, Want::Tokens, Want::Tokens) => &[Want::Tokens, Want::Tokens],
            (Op::Backward, Want::Tokens, _) => &[Want::Tokens, Want::Hidden],
            (Op::Backward, _, Want::Tokens) => &[Want::Hidden, Want::Tokens],
            (Op::Backward, _, _) => &[Want::Hidden, Want::Hidden],
            (Op::Avg, _, _) => &[Want::Part],
            // The first stage's input comes from the trainer, never from a stage before it.
            (Op::Push, Want::Tokens, _) => &[],
            (Op::Push, _, _) => &[Want::Hidden],
            (
                Op::Info | Op::StateInfo | Op::StateChunk | Op::StateHashes | Op::StateUpdate,
                _,
                _,
            ) => &[],
        }
    }

    /// The tensors `req` carries: those of its kind, less the input when it was pushed.
    pub fn wants_of(&self, req: &Request) -> &'static [Want] {
        let all = self.wants(req.op());
        match (req.job().pushed, req.op()) {
            (true, Op::Forward | Op::Backward) => all.get(1..).unwrap_or(&[]),
            _ => all,
        }
    }

    /// Whether a frame with header `h` is a `want` of this run.
    pub fn check(&self, want: Want, h: &Header) -> Result<(), String> {
        let (dtype, rank) = match want {
            Want::Tokens => (DType::U32, 2),
            Want::Hidden => (DType::F32, 3),
            Want::Part => (DType::F32, 1),
        };
        if h.dtype != dtype || h.shape.len() != rank {
            return Err(format!(
                "expected {dtype:?} of rank {rank} ({want:?}), got {:?} of shape {:?}",
                h.dtype, h.shape
            ));
        }
        let ok = match want {
            Want::Part => h.shape[0] <= PART_CHUNK,
            _ => {
                (1..=self.batch).contains(&h.shape[0])
                    && (1..=self.seq).contains(&h.shape[1])
                    && (want == Want::Tokens || h.shape[2] == self.d)
            }
        };
        if !ok {
            return Err(format!(
                "shape {:?} is not a {want:?} of this run (batch ≤ {}, seq ≤ {}, width {})",
                h.shape, self.batch, self.seq, self.d
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodecSpec, Quant};

    fn header(dtype: DType, shape: &[usize]) -> Header {
        Header {
            dtype,
            spec: CodecSpec {
                quant: Quant::Raw,
                block_size: 0,
                zstd_level: 0,
                ids_last: false,
            },
            shape: shape.to_vec(),
            payload_len: 0,
            checksum: 0,
            ids: crate::wire::ids::Ids::None,
            sparse: false,
        }
    }

    #[test]
    fn each_stage_takes_its_own_shapes_and_nothing_larger() {
        let mut cfg = RunConfig::tiny();
        cfg.stages.count = 3;
        let (b, s, d) = (
            cfg.training.batch_size,
            cfg.model.seq_len,
            cfg.model.d_model,
        );
        let first = Expect::of(&cfg, 0);
        let mid = Expect::of(&cfg, 1);
        let last = Expect::of(&cfg, 2);
        assert_eq!(first.wants(Op::Forward), &[Want::Tokens]);
        assert_eq!(mid.wants(Op::Backward), &[Want::Hidden, Want::Hidden]);
        assert_eq!(last.wants(Op::Backward), &[Want::Hidden, Want::Tokens]);
        assert!(last.wants(Op::Info).is_empty());
        let tokens = header(DType::U32, &[b, s]);
        let hidden = header(DType::F32, &[b, s, d]);
        assert!(first.check(Want::Tokens, &tokens).is_ok());
        assert!(mid.check(Want::Hidden, &hidden).is_ok());
        for (want, h) in [
            (Want::Hidden, header(DType::U32, &[b, s, d])),
            (Want::Hidden, header(DType::F32, &[b, s])),
            (Want::Hidden, header(DType::F32, &[b, s, d + 1])),
            (Want::Hidden, header(DType::F32, &[b, s + 1, d])),
            (Want::Tokens, header(DType::U32, &[b * BATCH_SLACK + 1, s])),
            (Want::Tokens, header(DType::U32, &[0, s])),
            (Want::Part, header(DType::F32, &[PART_CHUNK + 1])),
        ] {
            assert!(mid.check(want, &h).is_err(), "{want:?} {:?}", h.shape);
        }
        let l = mid.limits();
        assert!(l.max_elements >= (b * s * d) as u64 && l.max_elements < 64 << 20);
    }
}
