//! The crate's one error type. Variants carry what an operator needs to act: which peer, which field,
//! which sizes, what was awaited.

use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame too short: {needed} bytes needed, {got} available")]
    Truncated { needed: u64, got: u64 },
    #[error("bad frame magic {found:02x?} (expected {expected:02x?})")]
    BadMagic { found: [u8; 4], expected: [u8; 4] },
    #[error("unsupported frame version {found} (this build speaks version {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("bad frame field {field}: {value}")]
    BadField { field: &'static str, value: u64 },
    #[error("frame payload is {got} bytes, but {rows} x {cols} {dtype} needs {expected}")]
    PayloadLength {
        rows: u32,
        cols: u32,
        dtype: &'static str,
        expected: u64,
        got: u64,
    },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge { len: u64, max: u64 },
    #[error("{got} trailing bytes after the frame")]
    TrailingBytes { got: u64 },
    #[error("payload of {len} bytes is not a whole number of {dtype} values")]
    Misaligned { len: usize, dtype: &'static str },
    #[error("bad control message: {0}")]
    Control(#[from] serde_json::Error),

    #[error("rank {rank}: no such peer {peer} (world of {world})")]
    NoSuchPeer {
        rank: usize,
        peer: usize,
        world: usize,
    },
    #[error("timed out after {}ms waiting for rank {peer} to send {awaited}", waited.as_millis())]
    Timeout {
        peer: usize,
        awaited: String,
        waited: Duration,
    },
    #[error("lost rank {peer}: {reason}")]
    PeerLost { peer: usize, reason: String },
    #[error("unexpected frame from rank {peer}: {what}")]
    Unexpected { peer: usize, what: String },
    #[error("bad collective arguments: {0}")]
    Usage(String),

    #[error("certificate authority: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("tls: {0}")]
    Tls(#[from] rustls::Error),
    #[error("bad pem ({what}): {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("quic endpoint: {0}")]
    Io(#[from] std::io::Error),
    #[error("joining the mesh: {0}")]
    Join(String),
    #[error("refused connection from {addr}: {reason}")]
    Refused { addr: SocketAddr, reason: String },
}

impl WireError {
    /// Names what the caller was waiting for, so a timeout says "halo rows of epoch 3 layer 1 forward"
    /// instead of "a frame".
    pub fn awaiting(self, what: impl Into<String>) -> Self {
        match self {
            WireError::Timeout { peer, waited, .. } => WireError::Timeout {
                peer,
                awaited: what.into(),
                waited,
            },
            other => other,
        }
    }
}
