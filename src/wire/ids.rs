//! The exact id column of a frame ([`super::CodecSpec::ids_last`]): a float tensor whose
//! last column holds integer ids (a subspace boundary's token ids, `model::subspace`)
//! travels with that column taken out of the lossy encoding and sent as integers after the
//! coded values — as nothing when every id is 0 (a gradient's column), else as u16 or u32,
//! whichever holds the largest.

use super::header::WireError;

/// How a frame carries its id column: header byte 9.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Ids {
    /// No id column: every value is coded.
    None = 0,
    /// An id column of zeros, not sent.
    Zero = 1,
    /// Ids as little-endian u16.
    U16 = 2,
    /// Ids as little-endian u32.
    U32 = 3,
}

/// Largest id a float holds exactly.
const MAX_EXACT: f32 = (1u32 << 24) as f32;

impl Ids {
    /// The header byte.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The mode a header byte names, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::None),
            1 => Some(Self::Zero),
            2 => Some(Self::U16),
            3 => Some(Self::U32),
            _ => None,
        }
    }

    /// Bytes each id takes in the payload.
    pub fn bytes(self) -> usize {
        match self {
            Self::None | Self::Zero => 0,
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }
}

/// Rows of a tensor of `shape` (one id each) and its last dim; `None` for rank 0 or a last
/// dim of 0.
pub fn rows_of(shape: &[usize]) -> Option<(usize, usize)> {
    let width = *shape.last()?;
    if width == 0 {
        return None;
    }
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    Some((n / width, width))
}

/// Splits `data` (rows of `width`) into the values to code (every column but the last) and
/// the ids (the last), choosing how the ids travel. Refuses an id column that does not
/// hold whole numbers in `0..2²⁴`.
pub fn split(data: &[f32], width: usize) -> Result<(Vec<f32>, Vec<u32>, Ids), WireError> {
    let rows = data.len() / width.max(1);
    let mut values = Vec::with_capacity(rows * (width - 1));
    let mut ids = Vec::with_capacity(rows);
    for row in data.chunks_exact(width) {
        let (v, id) = row.split_at(width - 1);
        values.extend_from_slice(v);
        let x = id[0];
        if !(x.fract() == 0.0 && (0.0..MAX_EXACT).contains(&x)) {
            return Err(WireError::BadInput(format!(
                "the id column holds {x}, not a whole number below 2^24"
            )));
        }
        ids.push(x as u32);
    }
    let max = ids.iter().copied().max().unwrap_or(0);
    let mode = match max {
        0 => Ids::Zero,
        1..=0xFFFF => Ids::U16,
        _ => Ids::U32,
    };
    Ok((values, ids, mode))
}

/// The ids as `mode` sends them.
pub fn to_bytes(ids: &[u32], mode: Ids) -> Vec<u8> {
    match mode {
        Ids::None | Ids::Zero => Vec::new(),
        Ids::U16 => ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect(),
        Ids::U32 => ids.iter().flat_map(|&i| i.to_le_bytes()).collect(),
    }
}

/// Writes rows of `width` into `out`: each row's coded `values`, then its id from `bytes`.
pub fn merge(values: &[f32], bytes: &[u8], mode: Ids, width: usize, out: &mut [f32]) {
    let w = width - 1;
    for (r, row) in out.chunks_exact_mut(width).enumerate() {
        let (v, id) = row.split_at_mut(w);
        v.copy_from_slice(&values[r * w..(r + 1) * w]);
        id[0] = match mode {
            Ids::None | Ids::Zero => 0.0,
            Ids::U16 => u16::from_le_bytes([bytes[2 * r], bytes[2 * r + 1]]) as f32,
            Ids::U32 => {
                let b = &bytes[4 * r..4 * r + 4];
                u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode, encode_f32, parse_header, CodecSpec, Limits, TensorData};

    fn frame(rows: &[[f32; 3]], spec: CodecSpec) -> Result<Vec<u8>, WireError> {
        let data: Vec<f32> = rows.iter().flatten().copied().collect();
        let mut out = Vec::new();
        encode_f32(&[1, rows.len(), 3], &data, &spec, &mut out)?;
        Ok(out)
    }

    #[test]
    fn the_id_column_travels_exactly_beside_lossy_values() -> Result<(), WireError> {
        let int8 = CodecSpec {
            ids_last: true,
            ..CodecSpec::INT8
        };
        let values = [[0.5f32, -1.25], [2.0, 0.01], [0.3, 0.7]];
        for (ids, mode) in [
            ([0.0f32, 0.0, 0.0], Ids::Zero),
            ([7.0, 255.0, 0.0], Ids::U16),
            ([70_000.0, 3.0, 16_777_215.0], Ids::U32),
        ] {
            for spec in [
                int8,
                int8.with_zstd(1),
                CodecSpec {
                    ids_last: true,
                    ..CodecSpec::F32
                },
            ] {
                let rows: Vec<[f32; 3]> = values
                    .iter()
                    .zip(ids)
                    .map(|(v, id)| [v[0], v[1], id])
                    .collect();
                let f = frame(&rows, spec)?;
                let (h, _) = parse_header(&f, &Limits::default())?;
                assert_eq!((h.ids, h.spec.ids_last), (mode, true));
                let TensorData::F32(back) = decode(&f, &Limits::default())?.data else {
                    panic!("an f32 frame decodes as f32");
                };
                for (r, row) in back.chunks(3).enumerate() {
                    assert_eq!(row[2], ids[r], "{spec:?}: ids exact");
                    for c in 0..2 {
                        assert!((row[c] - values[r][c]).abs() < 0.02, "{spec:?}: {row:?}");
                    }
                }
            }
        }
        // Under int8 the ids cost 2 bytes a row (u16) instead of taking the block's scale.
        let plain = frame(&[[0.5, 0.25, 9.0]; 64], CodecSpec::INT8)?;
        let with_ids = frame(&[[0.5, 0.25, 9.0]; 64], int8)?;
        assert!(
            with_ids.len() < plain.len() + 64,
            "{} vs {}",
            with_ids.len(),
            plain.len()
        );
        // A column that is not ids is refused; so is an unknown mode byte.
        for bad in [0.5f32, -1.0, f32::NAN, 2e7] {
            assert!(frame(&[[0.0, 0.0, bad]], int8).is_err(), "{bad}");
        }
        let mut f = frame(&[[0.0, 0.0, 1.0]], int8)?;
        f[9] = 4;
        assert!(parse_header(&f, &Limits::default()).is_err());
        Ok(())
    }
}
