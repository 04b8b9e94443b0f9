//! The [`Link`] across machines: a full mesh of QUIC connections, mutually authenticated with the job CA.
//!
//! Forming the mesh takes two steps, because in tests (and on some platforms) a worker learns its port only
//! by binding it: [`QuicEndpoint::bind`] opens the UDP socket and starts accepting, then
//! [`QuicEndpoint::join`] takes every rank's address and returns the [`QuicLink`] once all peers are
//! connected. Rank `i` dials every rank `j > i` and accepts every rank `j < i`, one connection per pair.
//!
//! Who is who: a dialer checks the server's certificate names `worker-<j>` for the rank it dialled (rustls
//! does this as server-name verification). An acceptor reads the dialer's hello, which claims a rank, and
//! checks the dialer's client certificate names `worker-<claimed>`. Either way the certificate has already
//! been verified against the job CA during the handshake; a client with no certificate or one from another
//! CA never gets this far. Every refused connection is logged (`warn!`, with the peer's address and the
//! reason) and counted ([`QuicEndpoint::refusals`], [`QuicLink::refusals`]).
//!
//! Each pair talks over one bidirectional stream of length-prefixed [`Frame`]s, which keeps frames ordered
//! per pair as [`Link`] requires. Per peer a writer task drains an unbounded queue into the stream (so
//! `send` never waits) and a reader task moves decoded frames into a queue that `recv` waits on with a
//! timeout. The link owns its tokio runtime and blocks on it: it is a blocking API, not to be used (or
//! dropped) inside an async context.
//!
//! Dropping the link closes it gracefully: it finishes its streams, waits (at most
//! [`QuicOptions::linger`]) for its peers to acknowledge every frame and to finish theirs, then closes the
//! endpoint, so the last frames of a collective are never lost to an early exit.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, Incoming, ReadExactError, RecvStream, SendStream, VarInt};
use rustls_pki_types::CertificateDer;
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::WireError;
use crate::frame::{Frame, FrameHeader, HEADER_LEN, Phase};
use crate::link::{Link, Traffic, Waiting, check_incoming, check_outgoing, check_peer};
use crate::tls::{TlsIdentity, check_cert_name, client_config, server_config, worker_name};

/// QUIC application close code for a refused connection.
const REFUSED: u32 = 1;
/// QUIC application close code for a link closed normally.
const DONE: u32 = 0;
/// QUIC application close code for a link aborted by its worker ([`MeshAbort`]).
const ABORTED: u32 = 2;
/// How many refusals [`QuicEndpoint::refusal_log`] keeps.
const REFUSAL_LOG_LEN: usize = 64;

#[derive(Debug, Clone)]
pub struct QuicOptions {
    /// The bound on every [`Link::recv`].
    pub recv_timeout: Duration,
    /// The bound on forming the whole mesh in [`QuicEndpoint::join`].
    pub join_timeout: Duration,
    /// How long a dropped link waits for its frames to be acknowledged and its peers to finish.
    pub linger: Duration,
    /// A connection with no traffic (keep-alives included) for this long is lost.
    pub idle_timeout: Duration,
    pub keep_alive: Duration,
    /// The largest UDP payload path MTU discovery probes for (quinn's default, 1452, fits a 1500-byte
    /// Ethernet frame; loopback and cloud networks with jumbo frames carry more, and discovery never
    /// exceeds what the path delivers).
    pub max_udp_payload: u16,
}

impl Default for QuicOptions {
    fn default() -> Self {
        QuicOptions {
            recv_timeout: crate::link::DEFAULT_TIMEOUT,
            join_timeout: Duration::from_secs(60),
            linger: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_udp_payload: 1452,
        }
    }
}

/// A connection the endpoint refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub addr: SocketAddr,
    pub reason: String,
}

#[derive(Default)]
struct Refusals {
    count: AtomicU64,
    log: Mutex<VecDeque<Refusal>>,
}

impl Refusals {
    fn refuse(&self, addr: SocketAddr, reason: String) {
        warn!(peer = %addr, %reason, "refused connection");
        self.count.fetch_add(1, Ordering::SeqCst);
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() == REFUSAL_LOG_LEN {
            log.pop_front();
        }
        log.push_back(Refusal { addr, reason });
    }

    fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    fn log(&self) -> Vec<Refusal> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// The first frame on every pair's stream, in each direction.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    world: usize,
}

/// An authenticated, identified connection from a lower rank, waiting for [`QuicEndpoint::join`].
struct Accepted {
    rank: usize,
    world: usize,
    addr: SocketAddr,
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
}

/// A bound endpoint that accepts job members, before the mesh is formed.
pub struct QuicEndpoint {
    rank: usize,
    job: u64,
    options: QuicOptions,
    endpoint: Endpoint,
    client: quinn::ClientConfig,
    refusals: Arc<Refusals>,
    accepted: UnboundedReceiver<Accepted>,
    local_addr: SocketAddr,
    waiting: Waiting,
    abort: MeshAbort,
    rt: Runtime,
}

impl QuicEndpoint {
    /// Binds `addr` (port 0 picks one) as rank `rank` of job `job` and starts accepting connections.
    pub fn bind(
        rank: usize,
        job: u64,
        identity: &TlsIdentity,
        addr: SocketAddr,
        options: QuicOptions,
    ) -> Result<QuicEndpoint, WireError> {
        if rank > usize::from(u16::MAX) {
            return Err(WireError::Usage(format!(
                "rank {rank} does not fit in a frame header"
            )));
        }
        let tls_error =
            |e: &dyn std::fmt::Display| WireError::Tls(rustls::Error::General(e.to_string()));
        let server_crypto =
            QuicServerConfig::try_from(server_config(identity)?).map_err(|e| tls_error(&e))?;
        let client_crypto =
            QuicClientConfig::try_from(client_config(identity)?).map_err(|e| tls_error(&e))?;
        let mut transport = quinn::TransportConfig::default();
        transport
            .max_idle_timeout(Some(
                options.idle_timeout.try_into().map_err(|e| tls_error(&e))?,
            ))
            .keep_alive_interval(Some(options.keep_alive))
            // Halo and gradient messages are megabytes; the default windows are tuned for the internet.
            .stream_receive_window(VarInt::from_u32(32 << 20))
            .send_window(64 << 20);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(options.max_udp_payload);
        transport.mtu_discovery_config(Some(mtu));
        let transport = Arc::new(transport);
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);

        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name(format!("physalia-quic-{rank}"))
            .build()?;
        let endpoint = {
            let _runtime = rt.enter();
            Endpoint::server(server, addr)?
        };
        let local_addr = endpoint.local_addr()?;
        let refusals = Arc::new(Refusals::default());
        let (tx, accepted) = unbounded_channel();
        rt.spawn(accept_loop(
            endpoint.clone(),
            job,
            options.join_timeout,
            refusals.clone(),
            tx,
        ));
        debug!(rank, %local_addr, "quic endpoint bound");
        let abort = MeshAbort {
            endpoint: Arc::new(std::sync::Mutex::new(Some(endpoint.clone()))),
        };
        Ok(QuicEndpoint {
            rank,
            job,
            options,
            endpoint,
            client,
            refusals,
            accepted,
            local_addr,
            waiting: Waiting::default(),
            abort,
            rt,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The peer the link this endpoint becomes waits on (shared with it): readable before the mesh is
    /// joined, by a heartbeat thread that outlives the join.
    pub fn waiting(&self) -> Waiting {
        self.waiting.clone()
    }

    /// Connections refused so far (no certificate, another job's CA, a certificate for another rank...).
    pub fn refusals(&self) -> u64 {
        self.refusals.count()
    }

    /// The latest refusals, oldest first.
    pub fn refusal_log(&self) -> Vec<Refusal> {
        self.refusals.log()
    }

    /// A handle that aborts this endpoint and the link it becomes, from any thread (see [`MeshAbort`]).
    pub fn abort_handle(&self) -> MeshAbort {
        self.abort.clone()
    }

    /// Connects to every peer (`peers[r]` is rank `r`'s address; this rank's own entry is ignored) and
    /// returns the link once the mesh is complete, or an error naming the missing ranks after
    /// [`QuicOptions::join_timeout`].
    pub fn join(mut self, peers: &[SocketAddr]) -> Result<QuicLink, WireError> {
        let (me, world) = (self.rank, peers.len());
        if me >= world || world > usize::from(u16::MAX) + 1 {
            return Err(WireError::Usage(format!("rank {me} in a world of {world}")));
        }
        let deadline = Instant::now() + self.options.join_timeout;
        let mut streams: Vec<Option<(Connection, SendStream, RecvStream)>> =
            (0..world).map(|_| None).collect();
        let QuicEndpoint {
            job,
            ref options,
            ref endpoint,
            ref client,
            ref refusals,
            ref mut accepted,
            ref rt,
            ref waiting,
            ..
        } = self;
        let joined = rt.block_on(async {
            let dials: Vec<_> = (me + 1..world)
                .map(|peer| {
                    let task = dial(
                        endpoint.clone(),
                        client.clone(),
                        peers[peer],
                        peer,
                        me,
                        world,
                        job,
                        deadline,
                    );
                    (peer, tokio::spawn(task))
                })
                .collect();
            while (0..me).any(|r| streams[r].is_none()) {
                let missing: Vec<usize> = (0..me).filter(|&r| streams[r].is_none()).collect();
                let Ok(next) = tokio::time::timeout_at(deadline, accepted.recv()).await else {
                    return Err(WireError::Join(format!(
                        "rank {me}: ranks {missing:?} did not connect within {:?}",
                        options.join_timeout
                    )));
                };
                let Some(mut a) = next else {
                    return Err(WireError::Join("the endpoint stopped accepting".into()));
                };
                let taken = streams[a.rank.min(world - 1)]
                    .as_ref()
                    .is_some_and(|(conn, _, _)| conn.close_reason().is_none());
                let reason = if a.rank >= me {
                    Some(format!("rank {} must be dialled by rank {me}, not dial it", a.rank))
                } else if a.world != world {
                    Some(format!("it sees a world of {}, this rank {world}", a.world))
                } else if taken {
                    Some(format!("rank {} is already connected", a.rank))
                } else {
                    None
                };
                if let Some(reason) = reason {
                    a.conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
                    refusals.refuse(a.addr, reason);
                    continue;
                }
                let hello = hello_frame(me, job, world)?;
                if let Err(e) = write_frame(&mut a.send, hello).await {
                    debug!(peer = a.rank, error = %e, "lost an accepted connection before the hello");
                    continue;
                }
                streams[a.rank] = Some((a.conn, a.send, a.recv));
            }
            for (peer, task) in dials {
                // a dial still under way blocks this rank on that peer, as a `recv` would: the heartbeat
                // says so, and a peer slow to answer (delayed, lossy, frozen) is the one blamed, not this
                // rank, silent only because it waits (the acceptor's side waits passively, unmarked)
                let joined = {
                    let _waiting = waiting.on(peer);
                    task.await.map_err(|e| WireError::Join(e.to_string()))?
                };
                let connected = joined.map_err(|reason| {
                    WireError::Join(format!(
                        "rank {me} could not connect to rank {peer} at {}: {reason}",
                        peers[peer]
                    ))
                })?;
                streams[peer] = Some(connected);
            }
            Ok(())
        });
        if let Err(e) = joined {
            // an endpoint that never became a link must not stay bound through the handles given out
            // (a worker rebinds its fixed mesh port for the next mesh)
            self.abort.release();
            return Err(e);
        }

        let peers_state = {
            let _runtime = self.rt.enter();
            streams
                .into_iter()
                .enumerate()
                .map(|(rank, s)| s.map(|(conn, send, recv)| Peer::start(rank, conn, send, recv)))
                .collect()
        };
        // Valid members that connect after the mesh is complete are refused too.
        let refusals = self.refusals.clone();
        let mut late = std::mem::replace(&mut self.accepted, unbounded_channel().1);
        self.rt.spawn(async move {
            while let Some(a) = late.recv().await {
                let reason = format!("rank {} connected after the mesh was complete", a.rank);
                a.conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
                refusals.refuse(a.addr, reason);
            }
        });
        debug!(rank = me, world, "joined the mesh");
        Ok(QuicLink {
            rank: me,
            job: self.job,
            timeout: self.options.recv_timeout,
            linger: self.options.linger,
            peers: peers_state,
            traffic: Traffic::default(),
            refusals: self.refusals,
            local_addr: self.local_addr,
            waiting: self.waiting,
            abort: self.abort,
            endpoint: self.endpoint,
            rt: self.rt,
        })
    }
}

/// One connected peer: the queues its writer and reader tasks serve.
struct Peer {
    conn: Connection,
    to: Option<UnboundedSender<Frame>>,
    from: UnboundedReceiver<Result<Frame, String>>,
    write_error: Arc<Mutex<Option<String>>>,
    writer: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
}

impl Peer {
    /// Spawns the writer and reader tasks; must run inside the link's runtime.
    fn start(rank: usize, conn: Connection, mut send: SendStream, mut recv: RecvStream) -> Peer {
        let (to, mut outgoing) = unbounded_channel::<Frame>();
        let (incoming, from) = unbounded_channel();
        let write_error = Arc::new(Mutex::new(None));
        let error_slot = write_error.clone();
        let writer = tokio::spawn(async move {
            while let Some(frame) = outgoing.recv().await {
                if let Err(e) = write_frame(&mut send, frame).await {
                    debug!(peer = rank, error = %e, "writer stopped");
                    *error_slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return;
                }
            }
            // The link is closing: finish the stream and wait until the peer has acknowledged all of it.
            let _ = send.finish();
            let _ = send.stopped().await;
        });
        let reader = tokio::spawn(async move {
            loop {
                let next = match read_frame_bounded(&mut recv, u64::MAX).await {
                    Ok(Some(frame)) => Ok(frame),
                    Ok(None) => Err("it closed its link".to_string()),
                    Err(e) => Err(e),
                };
                let stop = next.is_err();
                if incoming.send(next).is_err() || stop {
                    return;
                }
            }
        });
        Peer {
            conn,
            to: Some(to),
            from,
            write_error,
            writer: Some(writer),
            reader: Some(reader),
        }
    }
}

/// Aborts a mesh endpoint from another thread: every connection closes at once, so a `recv` or
/// `send` blocked on a peer returns [`WireError::PeerLost`] instead of waiting out its timeout, and the
/// peers see the link closed too. A worker whose coordinator cancels the epoch in flight (a peer of the
/// job was lost and is being replaced) uses it to stop waiting for a peer that will never answer.
///
/// The handle does not keep the endpoint alive: once the link is dropped its socket is released (a
/// worker rebinds the same fixed mesh port for its next mesh) and an abort does nothing.
#[derive(Clone)]
pub struct MeshAbort {
    endpoint: Arc<std::sync::Mutex<Option<Endpoint>>>,
}

impl MeshAbort {
    /// Closes every connection of the endpoint, now. Idempotent; nothing after the link was dropped.
    pub fn abort(&self) {
        if let Some(endpoint) = &*self.endpoint.lock().unwrap_or_else(|e| e.into_inner()) {
            endpoint.close(VarInt::from_u32(ABORTED), b"aborted by the worker");
        }
    }

    /// Lets the endpoint go (the link is being dropped).
    fn release(&self) {
        self.endpoint
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }
}

impl std::fmt::Debug for MeshAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshAbort").finish_non_exhaustive()
    }
}

/// The QUIC implementation of [`Link`]; see the module doc.
pub struct QuicLink {
    rank: usize,
    job: u64,
    timeout: Duration,
    linger: Duration,
    peers: Vec<Option<Peer>>,
    traffic: Traffic,
    refusals: Arc<Refusals>,
    local_addr: SocketAddr,
    waiting: Waiting,
    abort: MeshAbort,
    endpoint: Endpoint,
    // Last, so it is dropped after everything that runs on it.
    rt: Runtime,
}

impl QuicLink {
    pub fn refusals(&self) -> u64 {
        self.refusals.count()
    }

    pub fn refusal_log(&self) -> Vec<Refusal> {
        self.refusals.log()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The peer a `recv` is blocked on right now (see [`Waiting`]).
    pub fn waiting(&self) -> Waiting {
        self.waiting.clone()
    }

    /// A handle that aborts this link from any thread (see [`MeshAbort`]).
    pub fn abort_handle(&self) -> MeshAbort {
        self.abort.clone()
    }

    /// Closes the link (what dropping it does), waiting at most the linger time.
    pub fn close(self) {}
}

impl Link for QuicLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.peers.len()
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
        let state = self.peers[peer]
            .as_ref()
            .expect("every other rank is connected after join");
        let lost = |state: &Peer| {
            let reason = state
                .write_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            WireError::PeerLost {
                peer,
                reason: reason.unwrap_or_else(|| "the link is closed".into()),
            }
        };
        let Some(to) = state.to.as_ref() else {
            return Err(lost(state));
        };
        // Counted before queueing: the writer may fail later, which the next send or recv reports.
        self.traffic.record_sent(&frame);
        to.send(frame).map_err(|_| lost(state))
    }

    fn recv_timeout(&mut self, peer: usize, timeout: Duration) -> Result<Frame, WireError> {
        check_peer(self.rank, self.world(), peer)?;
        let state = self.peers[peer]
            .as_mut()
            .expect("every other rank is connected after join");
        // The timer must be created inside the runtime, hence the async block.
        let next = {
            let _waiting = self.waiting.on(peer);
            self.rt
                .block_on(async { tokio::time::timeout(timeout, state.from.recv()).await })
        };
        let frame = match next {
            Err(_) => {
                return Err(WireError::Timeout {
                    peer,
                    awaited: "a frame".into(),
                    waited: timeout,
                });
            }
            Ok(None) => {
                let reason = state
                    .conn
                    .close_reason()
                    .map_or_else(|| "its stream ended".to_string(), |e| e.to_string());
                return Err(WireError::PeerLost { peer, reason });
            }
            Ok(Some(Err(reason))) => return Err(WireError::PeerLost { peer, reason }),
            Ok(Some(Ok(frame))) => frame,
        };
        check_incoming(self.job, peer, &frame)?;
        self.traffic.record_received(&frame);
        Ok(frame)
    }

    fn traffic(&self) -> &Traffic {
        &self.traffic
    }
}

impl Drop for QuicLink {
    fn drop(&mut self) {
        // the handles given out must not keep the socket bound
        self.abort.release();
        let mut tasks = Vec::new();
        for peer in self.peers.iter_mut().flatten() {
            // Closing the queue lets the writer finish the stream once everything queued is written.
            peer.to = None;
            tasks.extend(peer.writer.take());
            // The reader ends when the peer finishes its own stream, i.e. when the peer is done with us.
            tasks.extend(peer.reader.take());
        }
        let linger = self.linger;
        let endpoint = self.endpoint.clone();
        self.rt.block_on(async move {
            let all = async {
                for task in tasks {
                    let _ = task.await;
                }
            };
            if tokio::time::timeout(linger, all).await.is_err() {
                debug!("closing the link before every peer finished");
            }
            endpoint.close(VarInt::from_u32(DONE), b"done");
            let _ = tokio::time::timeout(linger.min(Duration::from_secs(1)), endpoint.wait_idle())
                .await;
        });
    }
}

fn hello_frame(rank: usize, job: u64, world: usize) -> Result<Frame, WireError> {
    Frame::control(FrameHeader::control(rank as u16, job), &Hello { world })
}

/// Reads a hello and returns `(claimed rank, claimed world)`.
async fn read_hello(recv: &mut RecvStream, job: u64) -> Result<(usize, usize), String> {
    let frame = read_frame_bounded(recv, u64::MAX)
        .await?
        .ok_or("the stream ended before the hello")?;
    if frame.header.phase != Phase::Control {
        return Err(format!(
            "expected a hello, got a {} frame",
            frame.header.phase
        ));
    }
    if frame.header.job != job {
        return Err(format!(
            "hello for job {:#x}, this is job {job:#x}",
            frame.header.job
        ));
    }
    let hello: Hello = frame.control_value().map_err(|e| e.to_string())?;
    Ok((usize::from(frame.header.sender), hello.world))
}

async fn write_frame(send: &mut SendStream, frame: Frame) -> Result<(), String> {
    let header = frame.header.encode(frame.payload.len() as u64);
    send.write_all(&header).await.map_err(|e| e.to_string())?;
    if !frame.payload.is_empty() {
        send.write_chunk(Bytes::from(frame.payload))
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The next frame on `recv`, or `None` if the peer finished the stream between frames. Memory grows with the
/// bytes that actually arrive, never with what a header announces; a header announcing more than
/// `max_payload` bytes is refused before any of them is read.
pub async fn read_frame_bounded(
    recv: &mut RecvStream,
    max_payload: u64,
) -> Result<Option<Frame>, String> {
    let mut head = [0u8; HEADER_LEN];
    match recv.read_exact(&mut head).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let (header, len) = FrameHeader::decode(&head).map_err(|e| e.to_string())?;
    if len > max_payload {
        return Err(format!(
            "a {} frame announces {len} bytes, more than the {max_payload} allowed",
            header.phase
        ));
    }
    let len = usize::try_from(len).map_err(|_| format!("a payload of {len} bytes"))?;
    const STEP: usize = 4 << 20;
    let mut payload = Vec::with_capacity(len.min(STEP));
    while payload.len() < len {
        let start = payload.len();
        payload.resize(start + (len - start).min(STEP), 0);
        recv.read_exact(&mut payload[start..])
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(Some(Frame { header, payload }))
}

async fn accept_loop(
    endpoint: Endpoint,
    job: u64,
    hello_timeout: Duration,
    refusals: Arc<Refusals>,
    accepted: UnboundedSender<Accepted>,
) {
    while let Some(incoming) = endpoint.accept().await {
        tokio::spawn(admit(
            incoming,
            job,
            hello_timeout,
            refusals.clone(),
            accepted.clone(),
        ));
    }
}

/// Completes the handshake (which verifies the client certificate against the job CA), reads the hello and
/// checks the certificate names the claimed rank.
async fn admit(
    incoming: Incoming,
    job: u64,
    hello_timeout: Duration,
    refusals: Arc<Refusals>,
    accepted: UnboundedSender<Accepted>,
) {
    let addr = incoming.remote_address();
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => return refusals.refuse(addr, format!("handshake failed: {e}")),
    };
    let identified = async {
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| format!("no stream: {e}"))?;
        let (rank, world) = read_hello(&mut recv, job).await?;
        let certs = peer_certificates(&conn)?;
        let name = worker_name(rank);
        check_cert_name(&certs[0], &name).map_err(|e| {
            format!("claims rank {rank} but its certificate is not for {name}: {e}")
        })?;
        Ok::<_, String>((rank, world, send, recv))
    };
    match tokio::time::timeout(hello_timeout, identified).await {
        Ok(Ok((rank, world, send, recv))) => {
            debug!(peer = rank, %addr, "accepted");
            // A closed channel means the endpoint is gone; the connection closes with it.
            let _ = accepted.send(Accepted {
                rank,
                world,
                addr,
                conn,
                send,
                recv,
            });
        }
        Ok(Err(reason)) => {
            conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
            refusals.refuse(addr, reason);
        }
        Err(_) => {
            let reason = format!("no hello within {hello_timeout:?}");
            conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
            refusals.refuse(addr, reason);
        }
    }
}

/// The certificate chain a peer presented in the handshake (already verified against the job CA).
pub fn peer_certificates(conn: &Connection) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|certs| *certs)
        .unwrap_or_default();
    if certs.is_empty() {
        return Err("no peer certificate".into());
    }
    Ok(certs)
}

/// Dials `peer` until the mesh deadline: the peer may not be listening yet.
#[allow(clippy::too_many_arguments)]
async fn dial(
    endpoint: Endpoint,
    client: quinn::ClientConfig,
    addr: SocketAddr,
    peer: usize,
    me: usize,
    world: usize,
    job: u64,
    deadline: Instant,
) -> Result<(Connection, SendStream, RecvStream), String> {
    let name = worker_name(peer);
    let mut last_error = String::from("no attempt before the deadline");
    while Instant::now() < deadline {
        let connecting = match endpoint.connect_with(client.clone(), addr, &name) {
            // closed under the join ([`MeshAbort`]): no later attempt can succeed
            Err(quinn::ConnectError::EndpointStopping) => {
                return Err("the join was aborted (the endpoint is closed)".into());
            }
            other => other.map_err(|e| e.to_string()),
        };
        let attempt = async {
            let connecting = connecting?;
            // A peer that is not listening yet never answers: give each attempt a short handshake budget.
            let conn = tokio::time::timeout(Duration::from_secs(2), connecting)
                .await
                .map_err(|_| "no handshake within 2s".to_string())?
                .map_err(|e| format!("handshake failed: {e}"))?;
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            write_frame(
                &mut send,
                hello_frame(me, job, world).map_err(|e| e.to_string())?,
            )
            .await?;
            // The peer answers once it joins, which may be a while: wait until the mesh deadline.
            let (rank, peer_world) = tokio::time::timeout_at(deadline, read_hello(&mut recv, job))
                .await
                .map_err(|_| "connected, but no hello back before the deadline".to_string())??;
            if rank != peer || peer_world != world {
                let reason = format!(
                    "answered as rank {rank} of {peer_world}, expected rank {peer} of {world}"
                );
                conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
                return Err(reason);
            }
            Ok((conn, send, recv))
        };
        match attempt.await {
            Ok(connected) => return Ok(connected),
            Err(e) => {
                debug!(peer, %addr, error = %e, "dial failed, retrying");
                last_error = e;
            }
        }
        tokio::time::sleep_until((Instant::now() + Duration::from_millis(100)).min(deadline)).await;
    }
    Err(last_error)
}
