//! The binary frame every message between workers travels in: a fixed 40-byte little-endian header, then the
//! payload.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "PHYW"
//!      4     2  version (1)
//!      6     2  sender rank
//!      8     8  job id
//!     16     4  epoch
//!     20     2  layer
//!     22     1  phase    (0 forward, 1 backward, 2 all-reduce, 3 control, 4 fetch, 5 shuffle)
//!     23     1  dtype    (0 f32, 1 f16, 2 bf16, 3 f64, 4 u32, 5 u8)
//!     24     4  rows
//!     28     4  cols
//!     32     8  payload length in bytes
//! ```
//!
//! The header says what the payload is, so the receiver can check it got the rows it expected (the right
//! epoch, layer, phase and shape) before it touches them. For tensor phases the payload is exactly
//! `rows * cols * dtype size` bytes of little-endian values; control frames carry JSON. Decoding never
//! panics and never allocates more than the bytes it was given.
//!
//! Exchanged rows may travel as f16 or bf16 ([`encode_f32`] / [`decode_f32`]), halving the bytes at the
//! cost of rounding (relative error at most 2^-11 for f16 in its normal range, 2^-8 for bf16).

use half::{bf16, f16};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::WireError;

pub const MAGIC: [u8; 4] = *b"PHYW";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;
/// Sanity bound on one payload (64 GiB): a header announcing more is garbage.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 36;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    Forward = 0,
    Backward = 1,
    AllReduce = 2,
    Control = 3,
    /// Feature rows fetched by id (data parallelism): id requests and their replies.
    Fetch = 4,
    /// Dataset rows moved to the workers that own them while the workers cut their parts (bytes).
    Shuffle = 5,
}

impl Phase {
    pub fn from_u8(value: u8) -> Option<Phase> {
        Some(match value {
            0 => Phase::Forward,
            1 => Phase::Backward,
            2 => Phase::AllReduce,
            3 => Phase::Control,
            4 => Phase::Fetch,
            5 => Phase::Shuffle,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::AllReduce => "all-reduce",
            Phase::Control => "control",
            Phase::Fetch => "fetch",
            Phase::Shuffle => "shuffle",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type of a tensor payload. `F64` carries small scalar vectors (losses, counts) exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    F64 = 3,
    /// Node ids (requests for rows).
    U32 = 4,
    /// Opaque bytes, `rows` of them in one column (a shuffle's records).
    U8 = 5,
}

impl Dtype {
    pub fn from_u8(value: u8) -> Option<Dtype> {
        Some(match value {
            0 => Dtype::F32,
            1 => Dtype::F16,
            2 => Dtype::BF16,
            3 => Dtype::F64,
            4 => Dtype::U32,
            5 => Dtype::U8,
            _ => return None,
        })
    }

    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F32 | Dtype::U32 => 4,
            Dtype::F64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
            Dtype::F64 => "f64",
            Dtype::U32 => "u32",
            Dtype::U8 => "u8",
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a payload is and who sent it. The payload length is not stored here: [`Frame`] derives it from
/// its payload, so the two cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub sender: u16,
    pub job: u64,
    pub epoch: u32,
    pub layer: u16,
    pub phase: Phase,
    pub dtype: Dtype,
    pub rows: u32,
    pub cols: u32,
}

impl FrameHeader {
    /// The header of a control message (a JSON payload, [`Frame::control`]) from `sender` in `job`: no
    /// epoch, layer or shape.
    pub fn control(sender: u16, job: u64) -> FrameHeader {
        FrameHeader {
            sender,
            job,
            epoch: 0,
            layer: 0,
            phase: Phase::Control,
            dtype: Dtype::F32,
            rows: 0,
            cols: 0,
        }
    }

    pub fn encode(&self, payload_len: u64) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&self.sender.to_le_bytes());
        out[8..16].copy_from_slice(&self.job.to_le_bytes());
        out[16..20].copy_from_slice(&self.epoch.to_le_bytes());
        out[20..22].copy_from_slice(&self.layer.to_le_bytes());
        out[22] = self.phase as u8;
        out[23] = self.dtype as u8;
        out[24..28].copy_from_slice(&self.rows.to_le_bytes());
        out[28..32].copy_from_slice(&self.cols.to_le_bytes());
        out[32..40].copy_from_slice(&payload_len.to_le_bytes());
        out
    }

    /// Decodes the first [`HEADER_LEN`] bytes of `buf` and returns the header with the announced payload
    /// length, after checking that the length agrees with the shape and stays under [`MAX_PAYLOAD_BYTES`].
    pub fn decode(buf: &[u8]) -> Result<(FrameHeader, u64), WireError> {
        let Some(buf) = buf.get(..HEADER_LEN) else {
            return Err(WireError::Truncated {
                needed: HEADER_LEN as u64,
                got: buf.len() as u64,
            });
        };
        let u16_at = |i: usize| u16::from_le_bytes([buf[i], buf[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic {
                found: magic,
                expected: MAGIC,
            });
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(WireError::UnsupportedVersion {
                found: version,
                supported: VERSION,
            });
        }
        let phase = Phase::from_u8(buf[22]).ok_or(WireError::BadField {
            field: "phase",
            value: u64::from(buf[22]),
        })?;
        let dtype = Dtype::from_u8(buf[23]).ok_or(WireError::BadField {
            field: "dtype",
            value: u64::from(buf[23]),
        })?;
        let header = FrameHeader {
            sender: u16_at(6),
            job: u64_at(8),
            epoch: u32_at(16),
            layer: u16_at(20),
            phase,
            dtype,
            rows: u32_at(24),
            cols: u32_at(28),
        };
        let payload_len = u64_at(32);
        header.check_payload_len(payload_len)?;
        Ok((header, payload_len))
    }

    /// Bytes a tensor payload of this shape takes; `None` for control frames, whose payload is free-form.
    pub fn tensor_bytes(&self) -> Option<u64> {
        if self.phase == Phase::Control {
            return None;
        }
        // u32 x u32 x 8 fits in u128; anything over u64 is rejected by the caller's comparison.
        let bytes = u128::from(self.rows) * u128::from(self.cols) * self.dtype.size_bytes() as u128;
        Some(u64::try_from(bytes).unwrap_or(u64::MAX))
    }

    pub fn check_payload_len(&self, len: u64) -> Result<(), WireError> {
        if len > MAX_PAYLOAD_BYTES {
            return Err(WireError::PayloadTooLarge {
                len,
                max: MAX_PAYLOAD_BYTES,
            });
        }
        match self.tensor_bytes() {
            Some(expected) if expected != len => Err(WireError::PayloadLength {
                rows: self.rows,
                cols: self.cols,
                dtype: self.dtype.name(),
                expected,
                got: len,
            }),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub header: FrameHeader,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A tensor frame of `rows x cols` values, encoded as `header.dtype` (rounded if 16-bit). The header's
    /// `rows`/`cols` are overwritten with the given shape.
    pub fn tensor(
        mut header: FrameHeader,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Frame, WireError> {
        let too_big = |what: &'static str, n: usize| WireError::BadField {
            field: what,
            value: n as u64,
        };
        header.rows = u32::try_from(rows).map_err(|_| too_big("rows", rows))?;
        header.cols = u32::try_from(cols).map_err(|_| too_big("cols", cols))?;
        if rows.checked_mul(cols) != Some(values.len()) {
            return Err(WireError::Usage(format!(
                "{} values do not fill {rows} x {cols}",
                values.len()
            )));
        }
        let frame = Frame {
            header,
            payload: encode_f32(values, header.dtype),
        };
        frame.validate()?;
        Ok(frame)
    }

    /// A control frame carrying `value` as JSON.
    pub fn control<T: Serialize>(mut header: FrameHeader, value: &T) -> Result<Frame, WireError> {
        header.phase = Phase::Control;
        header.rows = 0;
        header.cols = 0;
        let frame = Frame {
            header,
            payload: serde_json::to_vec(value)?,
        };
        frame.validate()?;
        Ok(frame)
    }

    pub fn control_value<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        if self.header.phase != Phase::Control {
            return Err(WireError::BadField {
                field: "phase",
                value: self.header.phase as u64,
            });
        }
        Ok(serde_json::from_slice(&self.payload)?)
    }

    /// The payload as f32 values (widened from 16-bit if it travelled compressed).
    pub fn to_f32(&self) -> Result<Vec<f32>, WireError> {
        decode_f32(&self.payload, self.header.dtype)
    }

    pub fn validate(&self) -> Result<(), WireError> {
        self.header.check_payload_len(self.payload.len() as u64)
    }

    /// Header plus payload: what this frame costs on the wire.
    pub fn wire_len(&self) -> u64 {
        (HEADER_LEN + self.payload.len()) as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&self.header.encode(self.payload.len() as u64));
        out.extend_from_slice(&self.payload);
        out
    }

    /// Decodes exactly one frame occupying all of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Frame, WireError> {
        let (header, payload_len) = FrameHeader::decode(buf)?;
        let rest = &buf[HEADER_LEN..];
        let have = rest.len() as u64;
        if have < payload_len {
            return Err(WireError::Truncated {
                needed: HEADER_LEN as u64 + payload_len,
                got: buf.len() as u64,
            });
        }
        if have > payload_len {
            return Err(WireError::TrailingBytes {
                got: have - payload_len,
            });
        }
        Ok(Frame {
            header,
            payload: rest.to_vec(),
        })
    }
}

/// Little-endian bytes of `values` in `dtype`: exact for f32 and f64, rounded to nearest-even for f16/bf16.
/// `U32` carries the f32 bit patterns unchanged (ids travel through [`encode_u32`]); `U8` each value as one
/// byte, saturated to 0..=255 (bytes travel as they are: [`crate::all_to_all_bytes`]).
pub fn encode_f32(values: &[f32], dtype: Dtype) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size_bytes());
    match dtype {
        Dtype::U8 => out.extend(values.iter().map(|v| *v as u8)),
        Dtype::F32 | Dtype::U32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        Dtype::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
        Dtype::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes())),
        Dtype::F64 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f64::from(*v).to_le_bytes())),
    }
    out
}

/// The inverse of [`encode_f32`]. f64 payloads are narrowed to f32 (use [`decode_f64`] to keep them).
pub fn decode_f32(bytes: &[u8], dtype: Dtype) -> Result<Vec<f32>, WireError> {
    let size = dtype.size_bytes();
    if !bytes.len().is_multiple_of(size) {
        return Err(WireError::Misaligned {
            len: bytes.len(),
            dtype: dtype.name(),
        });
    }
    let chunks = bytes.chunks_exact(size);
    Ok(match dtype {
        Dtype::U8 => bytes.iter().map(|b| f32::from(*b)).collect(),
        Dtype::F32 | Dtype::U32 => chunks
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => chunks
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::BF16 => chunks
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F64 => chunks.map(|c| f64_from(c) as f32).collect(),
    })
}

pub fn encode_u32(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn decode_u32(bytes: &[u8]) -> Result<Vec<u32>, WireError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(WireError::Misaligned {
            len: bytes.len(),
            dtype: "u32",
        });
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

pub fn encode_f64(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn decode_f64(bytes: &[u8]) -> Result<Vec<f64>, WireError> {
    if !bytes.len().is_multiple_of(8) {
        return Err(WireError::Misaligned {
            len: bytes.len(),
            dtype: "f64",
        });
    }
    Ok(bytes.chunks_exact(8).map(f64_from).collect())
}

fn f64_from(c: &[u8]) -> f64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(c);
    f64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: a seeded stream for the fuzz loops, so any failure replays from its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn f32(&mut self) -> f32 {
            // Uniform in [-1000, 1000), with some tiny values mixed in.
            let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
            let v = (u - 0.5) * 2000.0;
            if self.below(8) == 0 { v * 1e-6 } else { v }
        }
    }

    fn header(phase: Phase, dtype: Dtype) -> FrameHeader {
        FrameHeader {
            sender: 3,
            job: 0xdead_beef_cafe,
            epoch: 7,
            layer: 2,
            phase,
            dtype,
            rows: 0,
            cols: 0,
        }
    }

    #[test]
    fn round_trip_random_frames() {
        let mut rng = Rng(0x5eed_0001);
        for _ in 0..500 {
            let phase = Phase::from_u8(rng.below(3) as u8).unwrap();
            let dtype = Dtype::from_u8(rng.below(4) as u8).unwrap();
            let rows = rng.below(9) as usize;
            let cols = rng.below(9) as usize;
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
            let mut h = header(phase, dtype);
            h.epoch = rng.next() as u32;
            h.layer = rng.next() as u16;
            h.sender = rng.next() as u16;
            h.job = rng.next();
            let frame = Frame::tensor(h, &values, rows, cols).unwrap();
            let bytes = frame.encode();
            assert_eq!(bytes.len() as u64, frame.wire_len());
            let back = Frame::decode(&bytes).unwrap();
            assert_eq!(back, frame);
            let decoded = back.to_f32().unwrap();
            if matches!(dtype, Dtype::F32 | Dtype::F64) {
                assert_eq!(
                    decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn control_round_trip() {
        let frame = Frame::control(header(Phase::Control, Dtype::F32), &("hello", 3u32)).unwrap();
        let back = Frame::decode(&frame.encode()).unwrap();
        assert_eq!(
            back.control_value::<(String, u32)>().unwrap(),
            ("hello".to_string(), 3)
        );
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = Rng(0x5eed_0002);
        let valid = Frame::tensor(
            header(Phase::Forward, Dtype::F32),
            &[1.0, 2.0, 3.0, 4.0],
            2,
            2,
        )
        .unwrap()
        .encode();
        let mut accepted = 0;
        for round in 0..20_000 {
            let bytes: Vec<u8> = match round % 3 {
                // Pure noise of any length.
                0 => (0..rng.below(80)).map(|_| rng.next() as u8).collect(),
                // A valid frame with a few bytes flipped.
                1 => {
                    let mut b = valid.clone();
                    for _ in 0..1 + rng.below(3) {
                        let i = rng.below(b.len() as u64) as usize;
                        b[i] ^= 1 + rng.below(255) as u8;
                    }
                    b
                }
                // A valid frame cut short or extended.
                _ => {
                    let mut b = valid.clone();
                    let n = rng.below(b.len() as u64 + 8) as usize;
                    b.resize(n, rng.next() as u8);
                    b
                }
            };
            if let Ok(frame) = Frame::decode(&bytes) {
                accepted += 1;
                // Whatever decodes is self-consistent.
                frame.validate().unwrap();
                let _ = frame.to_f32();
            }
        }
        // Flips inside the payload or the non-structural header fields still decode.
        assert!(accepted > 0);
    }

    #[test]
    fn clear_errors() {
        let valid = Frame::tensor(header(Phase::Backward, Dtype::F16), &[1.0, 2.0], 1, 2)
            .unwrap()
            .encode();
        let mut b = valid.clone();
        b[0] = b'X';
        assert!(matches!(Frame::decode(&b), Err(WireError::BadMagic { .. })));
        let mut b = valid.clone();
        b[4] = 9;
        let err = Frame::decode(&b).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unsupported frame version 9 (this build speaks version 1)"
        );
        let mut b = valid.clone();
        b[24] = 5;
        let err = Frame::decode(&b).unwrap_err();
        assert_eq!(
            err.to_string(),
            "frame payload is 4 bytes, but 5 x 2 f16 needs 20"
        );
        assert!(matches!(
            Frame::decode(&valid[..10]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            Frame::decode(&valid[..41]),
            Err(WireError::Truncated { .. })
        ));
        let mut b = valid.clone();
        b.push(0);
        assert!(matches!(
            Frame::decode(&b),
            Err(WireError::TrailingBytes { got: 1 })
        ));
        let mut b = valid.clone();
        b[22] = 7;
        assert_eq!(
            Frame::decode(&b).unwrap_err().to_string(),
            "bad frame field phase: 7"
        );
        // A huge announced shape is refused before anything is allocated.
        let mut b = valid;
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        b[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        b[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Frame::decode(&b),
            Err(WireError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn compression_error_bounds() {
        let mut rng = Rng(0x5eed_0003);
        let values: Vec<f32> = (0..100_000).map(|_| rng.f32()).collect();
        for (dtype, rel_bound) in [(Dtype::F16, 2f32.powi(-11)), (Dtype::BF16, 2f32.powi(-8))] {
            let bytes = encode_f32(&values, dtype);
            assert_eq!(bytes.len(), values.len() * 2);
            let back = decode_f32(&bytes, dtype).unwrap();
            for (v, b) in values.iter().zip(&back) {
                let err = (v - b).abs();
                // f16's normal range starts at 2^-14; below it the spacing is absolute (2^-24).
                let bound = if dtype == Dtype::F16 && v.abs() < 6.1e-5 {
                    2f32.powi(-25)
                } else {
                    rel_bound * v.abs()
                };
                assert!(err <= bound, "{dtype}: {v} -> {b}, error {err} > {bound}");
            }
            // Exactly representable values survive unchanged.
            let exact = [0.0f32, -0.0, 1.0, -2.5, 0.125, 1024.0];
            let back = decode_f32(&encode_f32(&exact, dtype), dtype).unwrap();
            assert_eq!(
                back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                exact.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        // f16 overflows to infinity past 65504; bf16 keeps f32's range.
        assert!(decode_f32(&encode_f32(&[1e6], Dtype::F16), Dtype::F16).unwrap()[0].is_infinite());
        let big = decode_f32(&encode_f32(&[1e30], Dtype::BF16), Dtype::BF16).unwrap()[0];
        assert!((big - 1e30).abs() <= 1e30 * 2f32.powi(-8));
    }

    #[test]
    fn misaligned_payload_is_an_error() {
        assert!(matches!(
            decode_f32(&[0, 0, 0], Dtype::F32),
            Err(WireError::Misaligned { .. })
        ));
        assert!(matches!(
            decode_f64(&[0; 9]),
            Err(WireError::Misaligned { .. })
        ));
    }
}
