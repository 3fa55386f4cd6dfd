//! Tensors as bytes: the self-describing frame, its codecs, and bounded decoding.
//!
//! Pure code: bytes in, tensors or a typed [`WireError`] out. No tokio, no libp2p, no candle;
//! the network layer reads frames off streams with [`header_len`] and [`parse_header`] and
//! hands the bytes here. Codecs: exact f32, f16, bf16 and blockwise absmax int8, each
//! optionally followed by zstd (see [`CodecSpec`] for names and [`frame`] for the layout);
//! an id column ([`ids`]) travels exactly beside any of them; a mostly-zero chunk of an
//! averaged vector travels as its nonzero values and their positions ([`sparse`]).
//!
//! Error bounds (checked by the property tests):
//! - `f32`: exact.
//! - `f16`: relative error ≤ 2⁻¹¹ for |x| in [6.1e-5, 65504]; absolute ≤ 2⁻²⁵ below;
//!   larger values overflow to ±inf.
//! - `bf16`: relative error ≤ 2⁻⁸ over the whole f32 range.
//! - `int8`: |x − x̂| ≤ s/2 where s is the block's scale, s ≤ absmax·(1 + 2⁻⁷)/127; a block
//!   holding NaN or ±inf decodes as NaN.

#[cfg(not(target_endian = "little"))]
compile_error!("shoal's wire format assumes a little-endian machine");

pub mod codec;
pub mod frame;
pub mod header;
pub mod ids;
pub mod kernels;
pub mod msg;
pub mod sparse;

pub use codec::{ActivationCodec, BadActivationCodec, BadCodecName, CodecSpec, DType, Quant};
pub use frame::encode_f32_sparse;
pub use frame::{
    decode, decode_f32_into, encode_f32, encode_u32, encoded_len, header_len, max_encoded_len,
    parse_header, Header, Limits, TensorData, WireError, WireTensor,
};
pub use sparse::{encode_chunk, ChunkCodec};
