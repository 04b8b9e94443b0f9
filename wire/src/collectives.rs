//! Halo exchange and all-reduce, written once over any [`Link`].
//!
//! Both follow the same shape: validate the arguments, send everything (sends never block), then receive
//! from each peer in a fixed order and check every header against what was expected. A mismatch (another
//! epoch, layer, phase, dtype or shape) is an error naming the peer, never silently wrong rows.
//!
//! # All-reduce: deterministic, bitwise identical on every rank
//!
//! [`all_reduce_sum`] is a direct reduce-scatter followed by an all-gather. The buffer of `N` values is cut
//! into `n` fixed chunks (chunk `c` is `[c*N/n, (c+1)*N/n)`), and chunk `c` is owned by rank `c`:
//!
//! 1. every rank sends chunk `c` of its buffer to rank `c`;
//! 2. rank `c` sums the `n` contributions to its chunk in rank order, `((x_0 + x_1) + x_2) + ...`;
//! 3. rank `c` sends the summed chunk to every other rank, which copies its bits.
//!
//! Each value is summed exactly once, by one rank, in an order fixed by ranks alone, so the result does not
//! depend on timing and is bitwise identical everywhere (and over [`crate::MemLink`] and
//! [`crate::QuicLink`] alike). Bytes moved per rank, each way: `sum_{c != rank} |chunk c| + (n-1) |chunk
//! rank|`, about `2 (n-1)/n * N * 4` bytes for f32 (the bandwidth of a ring all-reduce, in two steps instead
//! of `2 (n-1)`), plus `2 (n-1)` headers of 40 bytes.

use std::collections::BTreeSet;
use std::ops::{AddAssign, Range};

use crate::WireError;
use crate::frame::{
    Dtype, Frame, FrameHeader, Phase, decode_f32, decode_f64, decode_u32, encode_f32, encode_f64,
    encode_u32,
};
use crate::link::Link;

/// Which exchange a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    pub epoch: u32,
    pub layer: u16,
    pub phase: Phase,
}

impl Tag {
    pub fn new(epoch: u32, layer: u16, phase: Phase) -> Tag {
        Tag {
            epoch,
            layer,
            phase,
        }
    }

    pub fn all_reduce(epoch: u32, layer: u16) -> Tag {
        Tag {
            epoch,
            layer,
            phase: Phase::AllReduce,
        }
    }

    fn header(&self, link: &(impl Link + ?Sized), dtype: Dtype) -> FrameHeader {
        FrameHeader {
            sender: link.rank() as u16,
            job: link.job(),
            epoch: self.epoch,
            layer: self.layer,
            phase: self.phase,
            dtype,
            rows: 0,
            cols: 0,
        }
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "epoch {} layer {} {}",
            self.epoch, self.layer, self.phase
        )
    }
}

/// Sends each peer in `send` its rows and receives `n_rows` rows from each peer in `recv`.
///
/// `send[i] = (peer, rows)`: rows already gathered, row-major, `cols` wide. `recv[i] = (peer, n_rows)`.
/// Rows travel as `dtype` (f16/bf16 halves the bytes; the received rows are widened back to f32). Returns
/// the received rows in the order of `recv`.
///
/// The lists must agree across ranks: `q` is in this rank's `recv` list, with `n` rows, exactly when this
/// rank is in `q`'s `send` list with `n` rows (zero-row entries included: they still send a header).
pub fn halo_exchange<L, S>(
    link: &mut L,
    tag: Tag,
    send: &[(usize, S)],
    recv: &[(usize, usize)],
    cols: usize,
    dtype: Dtype,
) -> Result<Vec<(usize, Vec<f32>)>, WireError>
where
    L: Link + ?Sized,
    S: AsRef<[f32]>,
{
    if tag.phase == Phase::Control {
        return Err(WireError::Usage(
            "a halo exchange carries tensor rows, not control".into(),
        ));
    }
    if cols == 0 {
        return Err(WireError::Usage(
            "halo rows must be at least one column wide".into(),
        ));
    }
    if matches!(dtype, Dtype::F64 | Dtype::U32) {
        return Err(WireError::Usage(
            "halo rows travel as f32, f16 or bf16".into(),
        ));
    }
    unique_peers(send.iter().map(|(p, _)| *p), "send")?;
    unique_peers(recv.iter().map(|(p, _)| *p), "recv")?;
    let mut frames = Vec::with_capacity(send.len());
    for (peer, rows) in send {
        let rows = rows.as_ref();
        if !rows.len().is_multiple_of(cols) {
            return Err(WireError::Usage(format!(
                "{} values for rank {peer} are not whole rows of {cols}",
                rows.len()
            )));
        }
        frames.push((
            *peer,
            Frame::tensor(tag.header(link, dtype), rows, rows.len() / cols, cols)?,
        ));
    }
    for (peer, frame) in frames {
        link.send(peer, frame)?;
    }
    let mut out = Vec::with_capacity(recv.len());
    for &(peer, n_rows) in recv {
        let frame = link
            .recv(peer)
            .map_err(|e| e.awaiting(format!("halo rows of {tag}")))?;
        expect(peer, &frame, tag, dtype, n_rows, cols)?;
        out.push((peer, frame.to_f32()?));
    }
    Ok(out)
}

/// Rows fetched by id from their owners, every rank asking and answering in one lockstep round.
///
/// `requests[p]` are the ids this rank wants from peer `p` (every peer gets a request, possibly empty, so
/// each rank knows how many to wait for; the own entry is ignored). `serve` turns a peer's ids into its
/// rows (row-major, `cols` wide), or refuses them (an id it does not own). Returns the rows from each peer
/// in request order (empty for this rank). Bytes: 4 per id asked plus the rows in `dtype`, plus 2 headers
/// per peer each way.
pub fn fetch_rows<L, F>(
    link: &mut L,
    tag: Tag,
    requests: &[Vec<u32>],
    cols: usize,
    dtype: Dtype,
    mut serve: F,
) -> Result<Vec<Vec<f32>>, WireError>
where
    L: Link + ?Sized,
    F: FnMut(usize, &[u32]) -> Result<Vec<f32>, WireError>,
{
    let (me, world) = (link.rank(), link.world());
    if tag.phase != Phase::Fetch {
        return Err(WireError::Usage(format!(
            "a fetch is tagged {tag}, not fetch"
        )));
    }
    if requests.len() != world {
        return Err(WireError::Usage(format!(
            "{} request lists for {world} ranks",
            requests.len()
        )));
    }
    if cols == 0 || matches!(dtype, Dtype::F64 | Dtype::U32) {
        return Err(WireError::Usage(
            "fetched rows are at least one column of f32, f16 or bf16".into(),
        ));
    }
    for peer in (0..world).filter(|&p| p != me) {
        let ids = &requests[peer];
        let mut header = tag.header(link, Dtype::U32);
        header.rows = u32::try_from(ids.len())
            .map_err(|_| WireError::Usage(format!("{} ids in one request", ids.len())))?;
        header.cols = 1;
        let frame = Frame {
            header,
            payload: encode_u32(ids),
        };
        frame.validate()?;
        link.send(peer, frame)?;
    }
    for peer in (0..world).filter(|&p| p != me) {
        let frame = link
            .recv(peer)
            .map_err(|e| e.awaiting(format!("row requests of {tag}")))?;
        let n = frame.header.rows as usize;
        expect(peer, &frame, tag, Dtype::U32, n, 1)?;
        let ids = decode_u32(&frame.payload)?;
        let rows = serve(peer, &ids)?;
        if rows.len() != ids.len() * cols {
            return Err(WireError::Usage(format!(
                "served {} values for {} ids of {cols} columns",
                rows.len(),
                ids.len()
            )));
        }
        link.send(
            peer,
            Frame::tensor(tag.header(link, dtype), &rows, ids.len(), cols)?,
        )?;
    }
    let mut out = vec![Vec::new(); world];
    for peer in (0..world).filter(|&p| p != me) {
        // the request went out before any reply, so this reply is the next frame after the peer's request
        let frame = link
            .recv(peer)
            .map_err(|e| e.awaiting(format!("fetched rows of {tag}")))?;
        expect(peer, &frame, tag, dtype, requests[peer].len(), cols)?;
        out[peer] = frame.to_f32()?;
    }
    Ok(out)
}

/// Sends `out[q]` to every other rank `q` and returns what every rank sent to this one, by rank (this
/// rank's own entry is `out[rank]`, moved, not sent). Every rank calls it with the same tag, whose phase
/// must be [`Phase::Shuffle`]; the payloads are opaque bytes (at most `u32::MAX` each), checked only for
/// their tag. Bytes moved: the payloads plus one header per peer each way.
pub fn all_to_all_bytes<L: Link + ?Sized>(
    link: &mut L,
    tag: Tag,
    mut out: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, WireError> {
    let (me, world) = (link.rank(), link.world());
    if tag.phase != Phase::Shuffle {
        return Err(WireError::Usage(format!(
            "a shuffle is tagged {tag}, not shuffle"
        )));
    }
    if out.len() != world {
        return Err(WireError::Usage(format!(
            "{} payloads for {world} ranks",
            out.len()
        )));
    }
    let mut got = vec![Vec::new(); world];
    got[me] = std::mem::take(&mut out[me]);
    for (peer, payload) in out.into_iter().enumerate().filter(|(p, _)| *p != me) {
        let mut header = tag.header(link, Dtype::U8);
        header.rows = u32::try_from(payload.len()).map_err(|_| {
            WireError::Usage(format!("{} bytes in one shuffle payload", payload.len()))
        })?;
        header.cols = 1;
        let frame = Frame { header, payload };
        frame.validate()?;
        link.send(peer, frame)?;
    }
    for (peer, slot) in got.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        let frame = link
            .recv(peer)
            .map_err(|e| e.awaiting(format!("the records of {tag}")))?;
        let rows = frame.header.rows as usize;
        expect(peer, &frame, tag, Dtype::U8, rows, 1)?;
        *slot = frame.payload;
    }
    Ok(got)
}

/// Sums `data` over all ranks in place; see the module doc for the algorithm and its guarantees. Every rank
/// must pass a buffer of the same length and `tag.phase` must be [`Phase::AllReduce`].
pub fn all_reduce_sum<L: Link + ?Sized>(
    link: &mut L,
    tag: Tag,
    data: &mut [f32],
) -> Result<(), WireError> {
    all_reduce::<L, f32>(link, tag, data)
}

/// [`all_reduce_sum`] for f64 values (losses, counts), carried exactly.
pub fn all_reduce_sum_f64<L: Link + ?Sized>(
    link: &mut L,
    tag: Tag,
    data: &mut [f64],
) -> Result<(), WireError> {
    all_reduce::<L, f64>(link, tag, data)
}

trait Element: Copy + AddAssign {
    const DTYPE: Dtype;
    fn encode(values: &[Self]) -> Vec<u8>;
    fn decode(bytes: &[u8]) -> Result<Vec<Self>, WireError>;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn encode(values: &[f32]) -> Vec<u8> {
        encode_f32(values, Dtype::F32)
    }
    fn decode(bytes: &[u8]) -> Result<Vec<f32>, WireError> {
        decode_f32(bytes, Dtype::F32)
    }
}

impl Element for f64 {
    const DTYPE: Dtype = Dtype::F64;
    fn encode(values: &[f64]) -> Vec<u8> {
        encode_f64(values)
    }
    fn decode(bytes: &[u8]) -> Result<Vec<f64>, WireError> {
        decode_f64(bytes)
    }
}

fn all_reduce<L: Link + ?Sized, T: Element>(
    link: &mut L,
    tag: Tag,
    data: &mut [T],
) -> Result<(), WireError> {
    if tag.phase != Phase::AllReduce {
        return Err(WireError::Usage(format!(
            "an all-reduce is tagged {tag}, not all-reduce"
        )));
    }
    let (me, world) = (link.rank(), link.world());
    if world == 1 {
        return Ok(());
    }
    let chunk_frame = |link: &L, values: &[T]| -> Result<Frame, WireError> {
        let mut header = tag.header(link, T::DTYPE);
        header.rows = u32::try_from(values.len()).map_err(|_| {
            WireError::Usage(format!("{} values in one all-reduce chunk", values.len()))
        })?;
        header.cols = 1;
        let frame = Frame {
            header,
            payload: T::encode(values),
        };
        frame.validate()?;
        Ok(frame)
    };

    // Reduce-scatter: chunk c goes to its owner, rank c.
    for peer in (0..world).filter(|&p| p != me) {
        let frame = chunk_frame(link, &data[chunk(data.len(), world, peer)])?;
        link.send(peer, frame)?;
    }
    let mine = chunk(data.len(), world, me);
    let mut sum: Vec<T> = Vec::new();
    for rank in 0..world {
        let contribution = if rank == me {
            data[mine.clone()].to_vec()
        } else {
            let frame = link.recv(rank).map_err(|e| {
                e.awaiting(format!(
                    "its share of chunk {me} for the all-reduce of {tag}"
                ))
            })?;
            expect(rank, &frame, tag, T::DTYPE, mine.len(), 1)?;
            T::decode(&frame.payload)?
        };
        if rank == 0 {
            sum = contribution;
        } else {
            sum.iter_mut()
                .zip(&contribution)
                .for_each(|(s, c)| *s += *c);
        }
    }

    // All-gather: every owner sends its summed chunk to everyone.
    for peer in (0..world).filter(|&p| p != me) {
        let frame = chunk_frame(link, &sum)?;
        link.send(peer, frame)?;
    }
    data[mine].copy_from_slice(&sum);
    for peer in (0..world).filter(|&p| p != me) {
        let range = chunk(data.len(), world, peer);
        let frame = link
            .recv(peer)
            .map_err(|e| e.awaiting(format!("summed chunk {peer} for the all-reduce of {tag}")))?;
        expect(peer, &frame, tag, T::DTYPE, range.len(), 1)?;
        data[range].copy_from_slice(&T::decode(&frame.payload)?);
    }
    Ok(())
}

/// Chunk `c` of `n` values cut into `world` pieces.
fn chunk(n: usize, world: usize, c: usize) -> Range<usize> {
    let at = |c: usize| (c as u128 * n as u128 / world as u128) as usize;
    at(c)..at(c + 1)
}

fn unique_peers(peers: impl Iterator<Item = usize>, list: &str) -> Result<(), WireError> {
    let mut seen = BTreeSet::new();
    for peer in peers {
        if !seen.insert(peer) {
            return Err(WireError::Usage(format!(
                "rank {peer} appears twice in the {list} list"
            )));
        }
    }
    Ok(())
}

fn expect(
    peer: usize,
    frame: &Frame,
    tag: Tag,
    dtype: Dtype,
    rows: usize,
    cols: usize,
) -> Result<(), WireError> {
    let h = &frame.header;
    let got = Tag {
        epoch: h.epoch,
        layer: h.layer,
        phase: h.phase,
    };
    if got != tag || h.dtype != dtype || h.rows as usize != rows || h.cols as usize != cols {
        return Err(WireError::Unexpected {
            peer,
            what: format!(
                "expected {tag}, {rows} x {cols} {dtype}; got {got}, {} x {} {}",
                h.rows, h.cols, h.dtype
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::thread;
    use std::time::Duration;

    use super::*;
    use crate::MemLink;

    /// Runs `f` on every rank of an in-memory mesh, one thread each, and returns the results by rank.
    fn on_mesh<R: Send + 'static>(
        n: usize,
        f: impl Fn(&mut MemLink) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let handles: Vec<_> = MemLink::mesh(n)
            .into_iter()
            .map(|mut link| {
                let f = f.clone();
                thread::spawn(move || f(&mut link))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn buffer(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * 7919 + i * 104_729) % 1000) as f32 * 0.001 - 0.37)
            .collect()
    }

    #[test]
    fn all_to_all_bytes_delivers_each_payload_to_its_rank_and_checks_the_tag() {
        // rank r sends rank q the bytes [r, q] repeated r + q times (empty from 0 to 0)
        let results = on_mesh(3, |link| {
            let me = link.rank();
            let out = (0..3).map(|q| [me as u8, q as u8].repeat(me + q)).collect();
            let tag = Tag::new(7, 2, Phase::Shuffle);
            let got = all_to_all_bytes(link, tag, out).unwrap();
            // a second round under another tag: a rank tagging it wrongly is refused by its peers
            let bad = Tag::new(8, if me == 2 { 3 } else { 2 }, Phase::Shuffle);
            let second = all_to_all_bytes(link, bad, vec![vec![1]; 3]);
            (got, second.map_err(|e| e.to_string()))
        });
        for (me, (got, second)) in results.into_iter().enumerate() {
            for (q, bytes) in got.iter().enumerate() {
                assert_eq!(bytes, &[q as u8, me as u8].repeat(me + q), "{q} -> {me}");
            }
            // every rank gets a frame it did not expect: 0 and 1 from rank 2, rank 2 from rank 0
            let err = second.unwrap_err();
            let from = if me == 2 { 0 } else { 2 };
            assert!(err.contains(&format!("rank {from}")), "{me}: {err}");
        }
        let mut link = MemLink::mesh(1).pop().unwrap();
        let wrong = all_to_all_bytes(&mut link, Tag::new(0, 0, Phase::Fetch), vec![vec![]]);
        assert!(wrong.unwrap_err().to_string().contains("not shuffle"));
    }

    #[test]
    fn fetch_rows_returns_the_owners_rows_and_refusals_propagate() {
        // rank r owns rows whose value is 100 * r + id; rank r asks every peer p for ids r..r+p
        let results = on_mesh(3, |link| {
            let me = link.rank();
            let requests: Vec<Vec<u32>> = (0..3)
                .map(|p| {
                    if p == me {
                        vec![]
                    } else {
                        (me as u32..(me + p) as u32).collect()
                    }
                })
                .collect();
            fetch_rows(
                link,
                Tag::new(2, 0, Phase::Fetch),
                &requests,
                2,
                Dtype::F32,
                |_, ids| {
                    Ok(ids
                        .iter()
                        .flat_map(|&i| [100.0 * me as f32 + i as f32, -1.0])
                        .collect())
                },
            )
            .unwrap()
        });
        for (me, got) in results.iter().enumerate() {
            for (p, rows) in got.iter().enumerate() {
                let want: Vec<f32> = if p == me {
                    vec![]
                } else {
                    (me..me + p)
                        .flat_map(|i| [100.0 * p as f32 + i as f32, -1.0])
                        .collect()
                };
                assert_eq!(rows, &want, "rank {me} from {p}");
            }
        }
        let results = on_mesh(2, |link| {
            let requests = vec![vec![7u32], vec![7u32]];
            fetch_rows(
                link,
                Tag::new(1, 0, Phase::Fetch),
                &requests,
                1,
                Dtype::F32,
                |peer, _| {
                    Err(WireError::Usage(format!(
                        "rank {peer} asked for a row not owned here"
                    )))
                },
            )
            .map(|_| ())
        });
        assert!(results.iter().all(|r| r.is_err()));
    }

    #[test]
    fn chunks_cover_the_buffer() {
        for n in 0..20 {
            for world in 1..6 {
                let ranges: Vec<_> = (0..world).map(|c| chunk(n, world, c)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[world - 1].end, n);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for world in 1..=5 {
            for len in [0, 1, 3, 10, 1001] {
                let results = on_mesh(world, move |link| {
                    let mut data = buffer(link.rank(), len);
                    all_reduce_sum(link, Tag::all_reduce(1, 0), &mut data).unwrap();
                    data
                });
                let mut expected = buffer(0, len);
                for r in 1..world {
                    expected
                        .iter_mut()
                        .zip(buffer(r, len))
                        .for_each(|(e, v)| *e += v);
                }
                for data in &results {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(data), bits(&expected), "world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn all_reduce_f64_and_traffic() {
        let results = on_mesh(4, |link| {
            let mut v = vec![link.rank() as f64 + 0.1, 1.0];
            all_reduce_sum_f64(link, Tag::all_reduce(0, u16::MAX), &mut v).unwrap();
            (v, link.traffic().clone())
        });
        for (v, traffic) in &results {
            assert_eq!(v, &vec![0.1 + 1.1 + 2.1 + 3.1, 4.0]);
            // 2 (n-1) frames each way.
            assert_eq!(traffic.sent.frames, 6);
            assert_eq!(traffic.received.frames, 6);
        }
        // Each of the 2 values is sent to its owner by 3 ranks, then by the owner to 3 ranks.
        let total: u64 = results.iter().map(|(_, t)| t.sent.payload_bytes).sum();
        assert_eq!(total, 2 * (3 + 3) * 8);
    }

    #[test]
    fn halo_exchange_moves_rows_and_checks_them() {
        // Rank r sends r+1 rows to every other rank.
        let results = on_mesh(3, |link| {
            let me = link.rank();
            let cols = 4;
            let peers: Vec<usize> = (0..3).filter(|&p| p != me).collect();
            let send: Vec<(usize, Vec<f32>)> = peers
                .iter()
                .map(|&p| (p, vec![(me * 10 + p) as f32; (me + 1) * cols]))
                .collect();
            let recv: Vec<(usize, usize)> = peers.iter().map(|&p| (p, p + 1)).collect();
            let tag = Tag::new(2, 1, Phase::Forward);
            let f32_rows = halo_exchange(link, tag, &send, &recv, cols, Dtype::F32).unwrap();
            let tag = Tag::new(2, 1, Phase::Backward);
            let bf16_rows = halo_exchange(link, tag, &send, &recv, cols, Dtype::BF16).unwrap();
            (f32_rows, bf16_rows, link.traffic().clone())
        });
        for (me, (f32_rows, bf16_rows, traffic)) in results.iter().enumerate() {
            assert_eq!(f32_rows, bf16_rows, "small integers are exact in bf16");
            for (p, rows) in f32_rows {
                assert_eq!(rows, &vec![(p * 10 + me) as f32; (p + 1) * 4]);
            }
            let (fwd_sent, _) = traffic.get(1, Phase::Forward);
            let (bwd_sent, _) = traffic.get(1, Phase::Backward);
            assert_eq!(fwd_sent.payload_bytes, 2 * bwd_sent.payload_bytes);
        }
    }

    #[test]
    fn mismatched_tags_and_shapes_are_errors() {
        let results = on_mesh(2, |link| {
            let me = link.rank();
            let peer = 1 - me;
            // Rank 1 is one layer ahead.
            let tag = Tag::new(0, me as u16, Phase::Forward);
            let send = [(peer, vec![1.0f32; 4])];
            halo_exchange(link, tag, &send, &[(peer, 2)], 2, Dtype::F32).map(|_| ())
        });
        let err = results[0].as_ref().unwrap_err().to_string();
        assert_eq!(
            err,
            "unexpected frame from rank 1: expected epoch 0 layer 0 forward, 2 x 2 f32; \
             got epoch 0 layer 1 forward, 2 x 2 f32"
        );
        let results = on_mesh(2, |link| {
            let peer = 1 - link.rank();
            let send = [(peer, vec![1.0f32; 4])];
            // Both expect 3 rows, 2 arrive.
            halo_exchange(
                link,
                Tag::new(0, 0, Phase::Forward),
                &send,
                &[(peer, 3)],
                2,
                Dtype::F16,
            )
            .map(|_| ())
        });
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(WireError::Unexpected { .. })))
        );
    }

    #[test]
    fn a_silent_peer_times_out_with_context() {
        let mut links = MemLink::mesh(2);
        links[0].set_timeout(Duration::from_millis(30));
        let err = halo_exchange(
            &mut links[0],
            Tag::new(4, 1, Phase::Backward),
            &[(1, vec![0.0f32; 2])],
            &[(1, 1)],
            2,
            Dtype::F32,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "timed out after 30ms waiting for rank 1 to send halo rows of epoch 4 layer 1 backward"
        );
    }
}
