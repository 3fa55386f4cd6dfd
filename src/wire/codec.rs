//! Codec names and parameters: what a run's config says about how tensors are compressed.
//!
//! Owns the `CodecSpec` value, its textual form (`int8`, `int8:128+zstd2`, `bf16+zstd`, ...)
//! and the sizes each codec's payload takes. It does not touch tensor data.

use std::fmt;
use std::str::FromStr;

/// The element type a frame carries before any compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float: activations, gradients, parameters.
    F32 = 0,
    /// 32-bit unsigned integer: token ids.
    U32 = 1,
}

impl DType {
    /// The header byte for this dtype.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The dtype for a header byte, if it names one.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::U32),
            _ => None,
        }
    }
}

/// How the elements are stored in the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Quant {
    /// The dtype's own 4 little-endian bytes; exact.
    Raw = 0,
    /// IEEE half precision, round to nearest even.
    F16 = 1,
    /// bfloat16, round to nearest even.
    Bf16 = 2,
    /// Blockwise absmax 8-bit: one bf16 scale per block, one signed byte per value.
    Int8 = 3,
    /// Blockwise absmax 4-bit: one bf16 scale per block, two values per byte (codes in
    /// −7..=7). For what error feedback corrects (outer averaging's pseudo-gradients).
    Int4 = 4,
}

impl Quant {
    /// The header byte for this codec.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The codec for a header byte, if it names one.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Raw),
            1 => Some(Self::F16),
            2 => Some(Self::Bf16),
            3 => Some(Self::Int8),
            4 => Some(Self::Int4),
            _ => None,
        }
    }
}

/// Default int8 block size: 64 values share one scale (measured in BENCHMARKS.md).
pub const DEFAULT_BLOCK: u32 = 64;
/// Largest accepted int8 block size.
pub const MAX_BLOCK: u32 = 1 << 20;
/// zstd levels a config may ask for; higher levels cost 10–100× the time for ~nothing.
pub const ZSTD_LEVELS: std::ops::RangeInclusive<u8> = 1..=3;

/// A codec and its parameters, as named in a run config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CodecSpec {
    /// The element encoding.
    pub quant: Quant,
    /// Values per scale for `Int8` and `Int4`; 0 for the other codecs.
    pub block_size: u32,
    /// zstd level applied after the element encoding; 0 means no zstd.
    pub zstd_level: u8,
    /// The last column of an f32 tensor holds whole-number ids (a subspace boundary's
    /// token ids): they travel exactly, after the coded values ([`super::ids`]). Set by
    /// [`ActivationCodec::wire`], never by a codec name.
    pub ids_last: bool,
}

impl CodecSpec {
    /// Exact f32, no compression.
    pub const F32: Self = Self {
        quant: Quant::Raw,
        block_size: 0,
        zstd_level: 0,
        ids_last: false,
    };

    /// Blockwise int8 with the default block size, no zstd.
    pub const INT8: Self = Self {
        quant: Quant::Int8,
        block_size: DEFAULT_BLOCK,
        zstd_level: 0,
        ids_last: false,
    };

    /// The same codec followed by zstd at `level`.
    pub fn with_zstd(self, level: u8) -> Self {
        Self {
            zstd_level: level,
            ..self
        }
    }

    /// Bytes of the payload before zstd for `n` values of `dtype`.
    pub fn raw_payload_len(&self, n: usize) -> Option<usize> {
        match self.quant {
            Quant::Raw => n.checked_mul(4),
            Quant::F16 | Quant::Bf16 => n.checked_mul(2),
            Quant::Int8 => {
                let blocks = n.div_ceil(self.block_size.max(1) as usize);
                blocks.checked_mul(2)?.checked_add(n)
            }
            Quant::Int4 => {
                let blocks = n.div_ceil(self.block_size.max(1) as usize);
                blocks.checked_mul(2)?.checked_add(n.div_ceil(2))
            }
        }
    }
}

/// Why a codec name did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown codec '{0}': expected f32, f16, bf16, int8[:BLOCK] or int4[:BLOCK], optionally +zstd[1-3] (e.g. int8+zstd)")]
pub struct BadCodecName(pub String);

impl FromStr for CodecSpec {
    type Err = BadCodecName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadCodecName(s.to_string());
        let lower = s.trim().to_ascii_lowercase();
        let (base, zstd) = match lower.split_once('+') {
            Some((b, z)) => (b, Some(z)),
            None => (lower.as_str(), None),
        };
        let zstd_level = match zstd {
            None => 0,
            Some("zstd") => 1,
            Some(z) => {
                let level: u8 = z
                    .strip_prefix("zstd")
                    .ok_or_else(bad)?
                    .parse()
                    .map_err(|_| bad())?;
                if !ZSTD_LEVELS.contains(&level) {
                    return Err(bad());
                }
                level
            }
        };
        let (name, block) = match base.split_once(':') {
            Some((n, b)) => (n, Some(b.parse::<u32>().map_err(|_| bad())?)),
            None => (base, None),
        };
        let (quant, block_size) = match (name, block) {
            ("f32", None) => (Quant::Raw, 0),
            ("f16", None) => (Quant::F16, 0),
            ("bf16", None) => (Quant::Bf16, 0),
            ("int8", None) => (Quant::Int8, DEFAULT_BLOCK),
            ("int8", Some(b)) if (1..=MAX_BLOCK).contains(&b) => (Quant::Int8, b),
            ("int4", None) => (Quant::Int4, DEFAULT_BLOCK),
            ("int4", Some(b)) if (1..=MAX_BLOCK).contains(&b) => (Quant::Int4, b),
            _ => return Err(bad()),
        };
        Ok(Self {
            quant,
            block_size,
            zstd_level,
            ids_last: false,
        })
    }
}

impl fmt::Display for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.quant {
            Quant::Raw => write!(f, "f32")?,
            Quant::F16 => write!(f, "f16")?,
            Quant::Bf16 => write!(f, "bf16")?,
            Quant::Int8 if self.block_size == DEFAULT_BLOCK => write!(f, "int8")?,
            Quant::Int8 => write!(f, "int8:{}", self.block_size)?,
            Quant::Int4 if self.block_size == DEFAULT_BLOCK => write!(f, "int4")?,
            Quant::Int4 => write!(f, "int4:{}", self.block_size)?,
        }
        if self.zstd_level > 0 {
            write!(f, "+zstd{}", self.zstd_level)?;
        }
        Ok(())
    }
}

impl serde::Serialize for CodecSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for CodecSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// How a run's activations travel between stages: a tensor codec, or a subspace of rank
/// `R` (`subspace:R`, `subspace:R+CODEC`: the model keeps its residual stream in a rank-`R`
/// subspace and a boundary carries `R` coefficients and the token id per token, the
/// coefficients through `CODEC`, int8 by default; see `model::subspace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ActivationCodec {
    /// The subspace rank, when the model keeps its residual stream in one.
    pub subspace: Option<u32>,
    /// The codec of the tensors between stages (the coefficients, under a subspace).
    pub spec: CodecSpec,
}

impl ActivationCodec {
    /// The codec frames between stages are written with (the id column exact under a
    /// subspace).
    pub fn wire(&self) -> CodecSpec {
        CodecSpec {
            ids_last: self.subspace.is_some(),
            ..self.spec
        }
    }
}

impl From<CodecSpec> for ActivationCodec {
    fn from(spec: CodecSpec) -> Self {
        Self {
            subspace: None,
            spec,
        }
    }
}

/// Why an activation codec name did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown codec '{0}' for activations: expected f32, f16, bf16 or int8[:BLOCK] (optionally +zstd[1-3]), or subspace:RANK[+CODEC] (e.g. subspace:8+int8)")]
pub struct BadActivationCodec(pub String);

impl FromStr for ActivationCodec {
    type Err = BadActivationCodec;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadActivationCodec(s.to_string());
        let lower = s.trim().to_ascii_lowercase();
        let Some(rest) = lower.strip_prefix("subspace:") else {
            return lower
                .parse::<CodecSpec>()
                .map(Self::from)
                .map_err(|_| bad());
        };
        let (rank, spec) = match rest.split_once('+') {
            Some((r, c)) => (r, c.parse::<CodecSpec>().map_err(|_| bad())?),
            None => (rest, CodecSpec::INT8),
        };
        Ok(Self {
            subspace: Some(rank.parse().map_err(|_| bad())?),
            spec,
        })
    }
}

impl fmt::Display for ActivationCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.subspace {
            None => write!(f, "{}", self.spec),
            Some(r) if self.spec == CodecSpec::INT8 => write!(f, "subspace:{r}"),
            Some(r) => write!(f, "subspace:{r}+{}", self.spec),
        }
    }
}

impl serde::Serialize for ActivationCodec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ActivationCodec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            "f32",
            "f16",
            "bf16",
            "int8",
            "int8:128",
            "int8+zstd1",
            "bf16+zstd3",
        ] {
            let spec: CodecSpec = name.parse().expect(name);
            assert_eq!(spec.to_string(), name);
        }
        assert_eq!(
            "int8+zstd".parse::<CodecSpec>(),
            Ok(CodecSpec::INT8.with_zstd(1))
        );
    }

    #[test]
    fn bad_names_are_refused() {
        for name in [
            "",
            "int3",
            "int4:0",
            "f32:64",
            "int8:0",
            "int8+zstd9",
            "int8+gzip",
            "int8:x",
        ] {
            assert!(name.parse::<CodecSpec>().is_err(), "{name} parsed");
        }
    }

    #[test]
    fn activation_codecs_name_a_codec_or_a_subspace() {
        for name in ["int8", "bf16+zstd1", "subspace:8", "subspace:16+f16+zstd2"] {
            let a: ActivationCodec = name.parse().expect(name);
            assert_eq!(a.to_string(), name);
        }
        let a: ActivationCodec = "subspace:8".parse().unwrap();
        assert_eq!(a.subspace, Some(8));
        assert!(a.wire().ids_last && a.wire().quant == Quant::Int8);
        assert!(!"int8".parse::<ActivationCodec>().unwrap().wire().ids_last);
        // Rank 0 parses: the config's check refuses it with the model's width in the line.
        assert_eq!(
            "subspace:0".parse::<ActivationCodec>().unwrap().subspace,
            Some(0)
        );
        for name in [
            "subspace",
            "subspace:",
            "subspace:x",
            "subspace:8+int3",
            "lowrank:8",
        ] {
            let e = name.parse::<ActivationCodec>().unwrap_err().to_string();
            assert!(e.contains("subspace:RANK"), "{name}: {e}");
        }
    }
}
