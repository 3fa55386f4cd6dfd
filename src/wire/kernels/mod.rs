//! The number-crunching inner loops of the codecs: f32 ⇄ f16, bf16 and blockwise int8.
//!
//! Plain safe loops written so that LLVM vectorises them, compiled twice on x86-64: once for
//! the baseline target and once with AVX2/F16C enabled, picked at run time. This module knows
//! nothing of frames or headers; it converts slices of equal length and nothing more.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// Adding this to a float in (-2^22, 2^22) leaves round-to-nearest-even of it in the low
/// mantissa bits, so the low byte of the sum's bits is the rounded value as a two's-complement
/// i8. This vectorises where a saturating `as i8` cast does not.
const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23

/// Runs `$body(args)` compiled for AVX2 (+FMA, F16C) when the CPU has it, else the baseline.
macro_rules! dispatch {
    ($avx2:ident, $body:ident, $($arg:expr),*) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports the features `$avx2` is compiled for, checked above.
                return unsafe { $avx2($($arg),*) };
            }
        }
        $body($($arg),*)
    }};
}

macro_rules! avx2_variant {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name($($arg: $ty),*) {
            $body($($arg),*)
        }
    };
}

/// Rounds a non-negative f32 up to the next bf16 (as bits), so that a bf16 scale never makes a
/// quantised value overflow ±127. NaN stays NaN.
#[inline(always)]
fn bf16_bits_round_up(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let hi = bits >> 16;
    if bits & 0xFFFF != 0 {
        (hi + 1) as u16
    } else {
        hi as u16
    }
}

#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round-to-nearest-even f32 → bf16 bits; NaN stays a quiet NaN.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let is_nan = (bits & 0x7FFF_FFFF) > 0x7F80_0000;
    if is_nan {
        ((bits >> 16) | 0x0040) as u16
    } else {
        rounded as u16
    }
}

/// The scale of a block: its absolute maximum over 127, rounded up to bf16.
#[inline(always)]
fn block_scale(xs: &[f32]) -> u16 {
    // Integer max over the sign-cleared bits orders non-negative floats correctly, puts NaN
    // above infinity, and vectorises without the NaN rules of `f32::max`.
    let m = xs
        .iter()
        .fold(0u32, |m, &v| m.max(v.to_bits() & 0x7FFF_FFFF));
    bf16_bits_round_up(f32::from_bits(m) / 127.0)
}

#[inline(always)]
fn quantize_block(xs: &[f32], scale_bits: u16, codes: &mut [u8]) {
    let scale = bf16_bits_to_f32(scale_bits);
    let inv = 1.0 / scale;
    if scale > 0.0 && scale.is_finite() && inv.is_finite() {
        for (q, &v) in codes.iter_mut().zip(xs) {
            *q = (v * inv + ROUND_MAGIC).to_bits() as u8;
        }
    } else {
        // Zero block, a scale so small its inverse overflows, or a non-finite block. The
        // first two quantise exactly by division; a non-finite scale decodes as NaN anyway.
        for (q, &v) in codes.iter_mut().zip(xs) {
            let y = if scale > 0.0 && scale.is_finite() {
                (v / scale).round_ties_even().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            *q = (y as i8) as u8;
        }
    }
}

#[inline(always)]
fn int8_encode_fixed<const B: usize>(src: &[f32], scales: &mut [u16], codes: &mut [u8]) {
    for ((xb, qb), s) in src
        .chunks_exact(B)
        .zip(codes.chunks_exact_mut(B))
        .zip(scales.iter_mut())
    {
        *s = block_scale(xb);
        quantize_block(xb, *s, qb);
    }
}

#[inline(always)]
fn int8_encode_body(src: &[f32], block: usize, scales: &mut [u16], codes: &mut [u8]) {
    let full = src.len() / block * block;
    let (head, tail) = src.split_at(full);
    let (codes_head, codes_tail) = codes.split_at_mut(full);
    let nfull = full / block;
    match block {
        32 => int8_encode_fixed::<32>(head, &mut scales[..nfull], codes_head),
        64 => int8_encode_fixed::<64>(head, &mut scales[..nfull], codes_head),
        128 => int8_encode_fixed::<128>(head, &mut scales[..nfull], codes_head),
        256 => int8_encode_fixed::<256>(head, &mut scales[..nfull], codes_head),
        _ => {
            for ((xb, qb), s) in head
                .chunks_exact(block)
                .zip(codes_head.chunks_exact_mut(block))
                .zip(scales.iter_mut())
            {
                *s = block_scale(xb);
                quantize_block(xb, *s, qb);
            }
        }
    }
    if !tail.is_empty() {
        let s = block_scale(tail);
        scales[nfull] = s;
        quantize_block(tail, s, codes_tail);
    }
}

#[inline(always)]
fn int8_decode_body(scales: &[u16], codes: &[u8], block: usize, dst: &mut [f32]) {
    for ((d, q), &s) in dst.chunks_mut(block).zip(codes.chunks(block)).zip(scales) {
        let scale = bf16_bits_to_f32(s);
        for (o, &c) in d.iter_mut().zip(q) {
            *o = (c as i8) as f32 * scale;
        }
    }
}

#[inline(always)]
fn bf16_encode_body(src: &[f32], dst: &mut [u16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16_bits(v);
    }
}

#[inline(always)]
fn bf16_decode_body(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = bf16_bits_to_f32(b);
    }
}

avx2_variant!(int8_encode_avx2, int8_encode_body, (src: &[f32], block: usize, scales: &mut [u16], codes: &mut [u8]));
avx2_variant!(int8_decode_avx2, int8_decode_body, (scales: &[u16], codes: &[u8], block: usize, dst: &mut [f32]));
avx2_variant!(bf16_decode_avx2, bf16_decode_body, (src: &[u16], dst: &mut [f32]));

/// Number of int8 blocks (and bf16 scales) for `n` values in blocks of `block`.
pub fn int8_blocks(n: usize, block: usize) -> usize {
    n.div_ceil(block)
}

/// Blockwise absmax int4 of `src` in blocks of `block`: two codes per byte (low nibble
/// first, each `code + 8` for a code in −7..=7), then one bf16 scale per block, rounded up
/// so every code fits. A block holding NaN or ±inf gets a NaN scale (it decodes as NaN).
pub fn int4_encode(src: &[f32], block: usize) -> (Vec<u8>, Vec<u16>) {
    let block = block.max(1);
    let mut codes = vec![0u8; src.len().div_ceil(2)];
    let mut scales = Vec::with_capacity(src.len().div_ceil(block));
    for (b, values) in src.chunks(block).enumerate() {
        let amax = values.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let finite = values.iter().all(|x| x.is_finite());
        let scale_bits = if !finite {
            0x7fc0u16
        } else {
            // Round the scale up to bf16 so that |x| / scale ≤ 7.
            let exact = amax / 7.0;
            let bits = exact.to_bits();
            let up = if bits & 0xffff == 0 {
                bits
            } else {
                bits + 0x1_0000
            };
            (up >> 16) as u16
        };
        let scale = f32::from_bits(u32::from(scale_bits) << 16);
        let inv = if finite && scale > 0.0 {
            1.0 / scale
        } else {
            0.0
        };
        for (i, x) in values.iter().enumerate() {
            let q = (x * inv).round().clamp(-7.0, 7.0) as i8;
            let at = b * block + i;
            let nibble = (q + 8) as u8;
            codes[at / 2] |= if at % 2 == 0 { nibble } else { nibble << 4 };
        }
        scales.push(scale_bits);
    }
    (codes, scales)
}

/// Decodes [`int4_encode`]'s codes and scales into `dst`.
pub fn int4_decode(scales: &[u16], codes: &[u8], block: usize, dst: &mut [f32]) {
    let block = block.max(1);
    for (i, d) in dst.iter_mut().enumerate() {
        let byte = codes.get(i / 2).copied().unwrap_or(8);
        let nibble = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        let scale = scales
            .get(i / block)
            .map_or(0.0, |s| f32::from_bits(u32::from(*s) << 16));
        *d = (f32::from(nibble) - 8.0) * scale;
    }
}

/// Blockwise absmax int8: `scales` gets one bf16 scale per block (`int8_blocks` of them),
/// `codes` one byte per value. Every value decodes to within half a step of its block's
/// scale; a block holding NaN or ±inf decodes as NaN.
pub fn int8_encode(src: &[f32], block: usize, scales: &mut [u16], codes: &mut [u8]) {
    debug_assert!(block > 0 && codes.len() == src.len());
    debug_assert_eq!(scales.len(), int8_blocks(src.len(), block));
    dispatch!(
        int8_encode_avx2,
        int8_encode_body,
        src,
        block,
        scales,
        codes
    )
}

/// Inverse of [`int8_encode`].
pub fn int8_decode(scales: &[u16], codes: &[u8], block: usize, dst: &mut [f32]) {
    debug_assert!(block > 0 && codes.len() == dst.len());
    dispatch!(
        int8_decode_avx2,
        int8_decode_body,
        scales,
        codes,
        block,
        dst
    )
}

/// f32 → bf16 bits, round to nearest even.
pub fn bf16_encode(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { x86::bf16_encode_avx2(src, dst) };
    }
    bf16_encode_body(src, dst)
}

/// bf16 bits → f32 (exact).
pub fn bf16_decode(src: &[u16], dst: &mut [f32]) {
    dispatch!(bf16_decode_avx2, bf16_decode_body, src, dst)
}

/// f32 → IEEE f16 bits, round to nearest even (F16C when the CPU has it).
pub fn f16_encode(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports F16C and AVX, checked just above.
        return unsafe { x86::f16_encode_f16c(src, dst) };
    }
    dst.reinterpret_cast_mut::<half::f16>()
        .convert_from_f32_slice(src);
}

/// IEEE f16 bits → f32 (exact).
pub fn f16_decode(src: &[u16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports F16C and AVX, checked just above.
        return unsafe { x86::f16_decode_f16c(src, dst) };
    }
    src.reinterpret_cast::<half::f16>()
        .convert_to_f32_slice(dst);
}

/// [`f16_decode`] for large outputs that will not be read again soon: when `dst` is 32-byte
/// aligned and the CPU has F16C, the stores bypass the cache (non-temporal), so memory is
/// not read just to be overwritten. Otherwise the same as [`f16_decode`].
pub fn f16_decode_streaming(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if (dst.as_ptr() as usize) % 32 == 0
        && std::arch::is_x86_feature_detected!("f16c")
        && std::arch::is_x86_feature_detected!("avx")
    {
        // SAFETY: the CPU supports F16C and AVX, and `dst` is 32-byte aligned, as the
        // streaming stores need; both checked just above.
        return unsafe { x86::f16_decode_stream(src, dst) };
    }
    f16_decode(src, dst)
}

/// [`bf16_decode`] with non-temporal stores when `dst` is 32-byte aligned and the CPU has
/// AVX2; see [`f16_decode_streaming`].
pub fn bf16_decode_streaming(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if (dst.as_ptr() as usize) % 32 == 0 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 and `dst` is 32-byte aligned; checked just above.
        return unsafe { x86::bf16_decode_stream(src, dst) };
    }
    bf16_decode(src, dst)
}

/// [`int8_decode`] with non-temporal stores, for large outputs: used when `dst` is 32-byte
/// aligned, `block` is a multiple of 8 and the CPU has AVX2; otherwise the same as
/// [`int8_decode`].
pub fn int8_decode_streaming(scales: &[u16], codes: &[u8], block: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if (dst.as_ptr() as usize) % 32 == 0
        && block % 8 == 0
        && std::arch::is_x86_feature_detected!("avx2")
    {
        // SAFETY: AVX2 is present, `dst` is 32-byte aligned and `block` a multiple of 8, so
        // every 8-value group of every block is 32-byte aligned; checked just above.
        return unsafe { x86::int8_decode_stream(scales, codes, block, dst) };
    }
    int8_decode(scales, codes, block, dst)
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_magic_gives_twos_complement_low_byte() {
        for k in -127i32..=127 {
            let y = k as f32 + 0.3;
            assert_eq!((y + ROUND_MAGIC).to_bits() as u8 as i8, k as i8);
        }
        // Ties go to even, as round_ties_even does.
        assert_eq!((2.5f32 + ROUND_MAGIC).to_bits() as u8 as i8, 2);
        assert_eq!((-3.5f32 + ROUND_MAGIC).to_bits() as u8 as i8, -4);
    }

    #[test]
    fn scale_rounds_up_so_codes_never_exceed_127() {
        let xs = [1.0f32, -0.999, 0.5, 1e-3];
        let s = block_scale(&xs);
        assert!(bf16_bits_to_f32(s) * 127.0 >= 1.0);
        let mut q = [0u8; 4];
        quantize_block(&xs, s, &mut q);
        assert!(q.iter().all(|&c| (c as i8) >= -127));
        // The scale is rounded up by less than one bf16 ulp (2^-7), so the absmax lands on
        // 126 or 127, never beyond.
        assert!(
            matches!(q[0] as i8, 126 | 127),
            "absmax coded as {}",
            q[0] as i8
        );
    }

    #[test]
    fn avx2_and_baseline_agree_bitwise() {
        let mut r = crate::rng::Rng::new(5);
        let src: Vec<f32> = (0..1000).map(|_| r.normal() as f32).collect();
        for block in [7usize, 64, 100] {
            let nb = int8_blocks(src.len(), block);
            let (mut s1, mut c1) = (vec![0u16; nb], vec![0u8; src.len()]);
            let (mut s2, mut c2) = (vec![0u16; nb], vec![0u8; src.len()]);
            int8_encode_body(&src, block, &mut s1, &mut c1);
            int8_encode(&src, block, &mut s2, &mut c2);
            assert_eq!((s1, c1), (s2, c2));
        }
        let (mut a, mut b) = (vec![0u16; src.len()], vec![0u16; src.len()]);
        bf16_encode_body(&src, &mut a);
        bf16_encode(&src, &mut b);
        assert_eq!(a, b);
        let special = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -3.3e38,
            7.0,
            8.0,
            9.0,
            1.5,
        ];
        let (mut e, mut f) = ([0u16; 16], [0u16; 16]);
        bf16_encode_body(&special, &mut e);
        bf16_encode(&special, &mut f);
        assert_eq!(e, f);
        // F16C and `half`'s portable conversion agree both ways (tail included).
        let odd = &src[..999];
        let (mut c, mut d) = (vec![0u16; 999], vec![0u16; 999]);
        f16_encode(odd, &mut c);
        d.reinterpret_cast_mut::<half::f16>()
            .convert_from_f32_slice(odd);
        assert_eq!(c, d);
        let (mut e, mut f) = (vec![0f32; 999], vec![0f32; 999]);
        f16_decode(&c, &mut e);
        c.reinterpret_cast::<half::f16>()
            .convert_to_f32_slice(&mut f);
        assert_eq!(e, f);
    }

    #[test]
    fn streaming_decoders_match_the_regular_ones() {
        let mut r = crate::rng::Rng::new(9);
        let src: Vec<f32> = (0..1003).map(|_| r.normal() as f32).collect();
        let mut bits = vec![0u16; src.len()];
        for f16 in [true, false] {
            if f16 {
                f16_encode(&src, &mut bits);
            } else {
                bf16_encode(&src, &mut bits);
            }
            // Every alignment of the output, so both the streaming and fallback paths run.
            let mut buf = vec![0f32; src.len() + 8];
            for off in 0..8 {
                let (mut a, b) = (vec![0f32; src.len()], &mut buf[off..off + src.len()]);
                if f16 {
                    f16_decode(&bits, &mut a);
                    f16_decode_streaming(&bits, b);
                } else {
                    bf16_decode(&bits, &mut a);
                    bf16_decode_streaming(&bits, b);
                }
                assert!(a
                    .iter()
                    .zip(b.iter())
                    .all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }

    #[test]
    fn streaming_int8_decode_matches_the_regular_one() {
        let mut r = crate::rng::Rng::new(10);
        let src: Vec<f32> = (0..1003).map(|_| r.normal() as f32).collect();
        for block in [7usize, 8, 64] {
            let nb = int8_blocks(src.len(), block);
            let (mut s, mut c) = (vec![0u16; nb], vec![0u8; src.len()]);
            int8_encode(&src, block, &mut s, &mut c);
            let mut want = vec![0f32; src.len()];
            int8_decode(&s, &c, block, &mut want);
            let mut buf = vec![0f32; src.len() + 8];
            for off in 0..8 {
                let got = &mut buf[off..off + src.len()];
                int8_decode_streaming(&s, &c, block, got);
                assert!(want
                    .iter()
                    .zip(got.iter())
                    .all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }

    #[test]
    fn zero_and_non_finite_blocks() {
        let zeros = [0.0f32; 8];
        let mut s = [0u16; 1];
        let mut q = [1u8; 8];
        int8_encode(&zeros, 8, &mut s, &mut q);
        let mut out = [1.0f32; 8];
        int8_decode(&s, &q, 8, &mut out);
        assert_eq!(out, [0.0; 8]);

        let bad = [1.0f32, f32::NAN, 2.0, 3.0];
        let mut s = [0u16; 1];
        let mut q = [0u8; 4];
        int8_encode(&bad, 4, &mut s, &mut q);
        let mut out = [0.0f32; 4];
        int8_decode(&s, &q, 4, &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
    }
}
