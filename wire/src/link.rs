//! The [`Link`]: how one worker sends frames to, and receives frames from, each of its peers.
//!
//! The API is blocking on purpose. The engine's `Exchange` is synchronous, and collectives written as plain
//! loops of `send` and `recv` are easy to read and deterministic. Two rules make such loops safe:
//!
//! - `send` never waits for the peer (frames queue without bound), so "everyone sends, then everyone
//!   receives" cannot deadlock;
//! - `recv` waits for the next frame from one named peer, in the order that peer sent them, and never longer
//!   than the link's timeout; a timeout names the peer.
//!
//! [`MemLink`] is the in-memory twin over channels, one ordered channel per ordered pair of ranks; the QUIC
//! link ([`crate::QuicLink`]) keeps the same contract across machines. Both count every byte in
//! [`Traffic`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use serde::Serialize;

use crate::WireError;
use crate::frame::{Frame, HEADER_LEN, Phase};

/// The default bound on every wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

pub trait Link: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// The job id stamped on and checked in every frame.
    fn job(&self) -> u64;
    fn timeout(&self) -> Duration;
    fn set_timeout(&mut self, timeout: Duration);

    /// Queues `frame` for `peer` without waiting for it to be received. The frame's `sender` and `job` must
    /// be this link's.
    fn send(&mut self, peer: usize, frame: Frame) -> Result<(), WireError>;

    /// The next frame from `peer`, waiting at most `timeout`.
    fn recv_timeout(&mut self, peer: usize, timeout: Duration) -> Result<Frame, WireError>;

    /// The next frame from `peer`, waiting at most [`Link::timeout`].
    fn recv(&mut self, peer: usize) -> Result<Frame, WireError> {
        let timeout = self.timeout();
        self.recv_timeout(peer, timeout)
    }

    /// Bytes and frames moved so far.
    fn traffic(&self) -> &Traffic;
}

/// The peer a link's owner is blocked on in `recv` right now, readable from any thread: a worker's
/// heartbeat says whom it waits for, so the coordinator can blame the rank its workers wait on rather
/// than a worker that is silent only because it waits. Clones share one value.
#[derive(Debug, Clone, Default)]
pub struct Waiting(Arc<AtomicUsize>);

impl Waiting {
    /// The peer waited on, if a `recv` is blocked now.
    pub fn peer(&self) -> Option<usize> {
        self.0.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Marks a wait on `peer` for as long as the returned guard lives.
    pub fn on(&self, peer: usize) -> WaitGuard<'_> {
        self.0.store(peer + 1, Ordering::Relaxed);
        WaitGuard(self)
    }
}

/// Clears a [`Waiting`] when dropped (the wait ended, whatever its outcome).
pub struct WaitGuard<'a>(&'a Waiting);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.0.store(0, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TrafficCounts {
    pub frames: u64,
    pub header_bytes: u64,
    pub payload_bytes: u64,
}

impl TrafficCounts {
    pub fn bytes(&self) -> u64 {
        self.header_bytes + self.payload_bytes
    }

    fn add(&mut self, frame: &Frame) {
        self.frames += 1;
        self.header_bytes += HEADER_LEN as u64;
        self.payload_bytes += frame.payload.len() as u64;
    }
}

/// Frames and bytes sent and received, in total and per (layer, phase), so a worker can report what each
/// layer's halo exchange and the gradient all-reduce cost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traffic {
    pub sent: TrafficCounts,
    pub received: TrafficCounts,
    /// `(layer, phase) -> (sent, received)`.
    pub by_layer_phase: BTreeMap<(u16, Phase), (TrafficCounts, TrafficCounts)>,
}

impl Traffic {
    pub fn record_sent(&mut self, frame: &Frame) {
        self.sent.add(frame);
        let key = (frame.header.layer, frame.header.phase);
        self.by_layer_phase.entry(key).or_default().0.add(frame);
    }

    pub fn record_received(&mut self, frame: &Frame) {
        self.received.add(frame);
        let key = (frame.header.layer, frame.header.phase);
        self.by_layer_phase.entry(key).or_default().1.add(frame);
    }

    /// `(sent, received)` for one layer and phase; zero if nothing moved.
    pub fn get(&self, layer: u16, phase: Phase) -> (TrafficCounts, TrafficCounts) {
        self.by_layer_phase
            .get(&(layer, phase))
            .copied()
            .unwrap_or_default()
    }
}

/// Checks that `peer` is another rank of the mesh.
pub(crate) fn check_peer(rank: usize, world: usize, peer: usize) -> Result<(), WireError> {
    if peer >= world || peer == rank {
        return Err(WireError::NoSuchPeer { rank, peer, world });
    }
    Ok(())
}

/// Checks an outgoing frame: well-formed and stamped with this link's rank and job.
pub(crate) fn check_outgoing(rank: usize, job: u64, frame: &Frame) -> Result<(), WireError> {
    frame.validate()?;
    if usize::from(frame.header.sender) != rank || frame.header.job != job {
        return Err(WireError::Usage(format!(
            "frame stamped sender {} job {:#x}, but this link is rank {} of job {:#x}",
            frame.header.sender, frame.header.job, rank, job
        )));
    }
    Ok(())
}

/// Checks an incoming frame came from the peer it arrived from, for this job.
pub(crate) fn check_incoming(job: u64, peer: usize, frame: &Frame) -> Result<(), WireError> {
    if usize::from(frame.header.sender) != peer || frame.header.job != job {
        return Err(WireError::Unexpected {
            peer,
            what: format!(
                "frame claims sender {} job {:#x}, expected sender {peer} job {job:#x}",
                frame.header.sender, frame.header.job
            ),
        });
    }
    frame.validate()
}

/// One rank of an in-memory mesh: frames move through channels, never through bytes, but are validated and
/// counted exactly as on the wire.
#[derive(Debug)]
pub struct MemLink {
    rank: usize,
    job: u64,
    timeout: Duration,
    /// `to[p]`: the channel to peer `p` (`None` for this rank).
    to: Vec<Option<Sender<Frame>>>,
    /// `from[p]`: the channel from peer `p`.
    from: Vec<Option<Receiver<Frame>>>,
    traffic: Traffic,
}

impl MemLink {
    /// `n` linked ranks of job 0, to be moved to one thread each.
    pub fn mesh(n: usize) -> Vec<MemLink> {
        MemLink::mesh_for_job(0, n)
    }

    pub fn mesh_for_job(job: u64, n: usize) -> Vec<MemLink> {
        assert!(n <= usize::from(u16::MAX) + 1, "ranks travel as u16");
        let mut links: Vec<MemLink> = (0..n)
            .map(|rank| MemLink {
                rank,
                job,
                timeout: DEFAULT_TIMEOUT,
                to: (0..n).map(|_| None).collect(),
                from: (0..n).map(|_| None).collect(),
                traffic: Traffic::default(),
            })
            .collect();
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    let (tx, rx) = channel();
                    links[a].to[b] = Some(tx);
                    links[b].from[a] = Some(rx);
                }
            }
        }
        links
    }
}

impl Link for MemLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn job(&self) -> u64 {
        self.job
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn send(&mut self, peer: usize, frame: Frame) -> Result<(), WireError> {
        check_peer(self.rank, self.world(), peer)?;
        check_outgoing(self.rank, self.job, &frame)?;
        self.traffic.record_sent(&frame);
        let tx = self.to[peer]
            .as_ref()
            .expect("check_peer excludes this rank");
        tx.send(frame).map_err(|_| WireError::PeerLost {
            peer,
            reason: "its link was dropped".into(),
        })
    }

    fn recv_timeout(&mut self, peer: usize, timeout: Duration) -> Result<Frame, WireError> {
        check_peer(self.rank, self.world(), peer)?;
        let rx = self.from[peer]
            .as_ref()
            .expect("check_peer excludes this rank");
        let frame = match rx.recv_timeout(timeout) {
            Ok(frame) => frame,
            Err(RecvTimeoutError::Timeout) => {
                return Err(WireError::Timeout {
                    peer,
                    awaited: "a frame".into(),
                    waited: timeout,
                });
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(WireError::PeerLost {
                    peer,
                    reason: "its link was dropped".into(),
                });
            }
        };
        check_incoming(self.job, peer, &frame)?;
        self.traffic.record_received(&frame);
        Ok(frame)
    }

    fn traffic(&self) -> &Traffic {
        &self.traffic
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Dtype, FrameHeader};

    fn frame(sender: u16, epoch: u32) -> Frame {
        let header = FrameHeader {
            sender,
            job: 0,
            epoch,
            layer: 1,
            phase: Phase::Forward,
            dtype: Dtype::F32,
            rows: 0,
            cols: 0,
        };
        Frame::tensor(header, &[1.0, 2.0], 1, 2).unwrap()
    }

    #[test]
    fn frames_arrive_in_order_per_pair_and_are_counted() {
        let mut links = MemLink::mesh(3);
        for epoch in 0..5 {
            links[0].send(2, frame(0, epoch)).unwrap();
        }
        links[1].send(2, frame(1, 99)).unwrap();
        let l2 = &mut links[2];
        assert_eq!(l2.recv(1).unwrap().header.epoch, 99);
        for epoch in 0..5 {
            assert_eq!(l2.recv(0).unwrap().header.epoch, epoch);
        }
        assert_eq!(l2.traffic().received.frames, 6);
        assert_eq!(l2.traffic().received.bytes(), 6 * (40 + 8));
        assert_eq!(
            links[0].traffic().get(1, Phase::Forward).0.payload_bytes,
            5 * 8
        );
    }

    #[test]
    fn recv_times_out_naming_the_peer() {
        let mut links = MemLink::mesh(2);
        let err = links[0]
            .recv_timeout(1, Duration::from_millis(20))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "timed out after 20ms waiting for rank 1 to send a frame"
        );
    }

    #[test]
    fn misaddressed_frames_are_refused() {
        let mut links = MemLink::mesh(2);
        assert!(matches!(
            links[0].send(0, frame(0, 0)),
            Err(WireError::NoSuchPeer { .. })
        ));
        assert!(matches!(
            links[0].send(5, frame(0, 0)),
            Err(WireError::NoSuchPeer { .. })
        ));
        // Stamped with another rank's identity.
        assert!(matches!(
            links[0].send(1, frame(1, 0)),
            Err(WireError::Usage(_))
        ));
    }
}
