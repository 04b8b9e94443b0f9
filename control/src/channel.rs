//! The control connection between the coordinator and its workers: both ends of one QUIC connection per
//! worker, carrying the [messages](crate::messages) and the [files](crate::transfer) of the job.
//!
//! The coordinator is not a rank of the training mesh (the mesh's collectives run over exactly the N
//! workers), so it does not use [`physalia_wire::QuicEndpoint`]: it runs a [`ControlServer`], a plain quinn
//! server with the same mutual-TLS configuration as the mesh ([`physalia_wire::server_config`]): the
//! handshake refuses a client whose certificate does not chain to the job CA, or that has none. The
//! coordinator's own certificate is named [`COORDINATOR_NAME`]; a worker dials it with
//! [`ControlClient::connect`] and checks that name. The first message on a connection must be
//! [`ToCoordinator::Register`], and the client certificate must name `worker-<rank>` for the rank it
//! claims. Every refusal becomes a [`ServerEvent::Refused`] (the coordinator logs it) and is counted.
//!
//! Messages are [`Frame::control`] JSON frames on one bidirectional stream per worker, so they arrive in
//! order; a worker's [`LogSender`] puts its log lines on the same stream from any thread, without waiting. Each file transfer ([`ControlClient::fetch`], [`ControlClient::upload`]) is a further stream of
//! the same connection. Both ends are blocking APIs over a private tokio runtime; neither may be used
//! inside an async context.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use physalia_wire::{
    Frame, FrameHeader, Phase, TlsIdentity, WireError, check_cert_name, peer_certificates,
};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, Incoming, RecvStream, SendStream, VarInt};
use tokio::runtime::Runtime;
use tokio::sync::Mutex;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

use crate::messages::{Artifact, ToCoordinator, ToWorker, Upload};
use crate::transfer::{self, Files, Reply, Request};

/// The certificate name of the coordinator's control endpoint.
pub const COORDINATOR_NAME: &str = "coordinator";
/// The `sender` field of frames the coordinator sends.
const COORDINATOR_SENDER: u16 = u16::MAX;
/// Control messages are small (a summary with per-epoch metrics is the largest, about 1 KiB an epoch);
/// anything bigger is garbage.
pub const MAX_CONTROL_BYTES: u64 = 16 << 20;
const REFUSED: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("control channel: {0}")]
    Protocol(String),
}

pub(crate) fn coordinator_header(job: u64) -> FrameHeader {
    header(COORDINATOR_SENDER, job)
}

fn header(sender: u16, job: u64) -> FrameHeader {
    FrameHeader::control(sender, job)
}

pub(crate) async fn write_frame(send: &mut SendStream, frame: &Frame) -> Result<(), String> {
    send.write_chunk(Bytes::from(frame.encode()))
        .await
        .map_err(|e| e.to_string())
}

/// The next control message's frame, or `None` at the end of the stream. A header announcing more than
/// [`MAX_CONTROL_BYTES`] is refused before anything is read, and memory grows with the bytes that arrive,
/// as on the mesh.
pub(crate) async fn read_frame(recv: &mut RecvStream) -> Result<Option<Frame>, String> {
    let Some(frame) = physalia_wire::read_frame_bounded(recv, MAX_CONTROL_BYTES).await? else {
        return Ok(None);
    };
    if frame.header.phase != Phase::Control {
        return Err(format!(
            "expected a control message, got a {} frame",
            frame.header.phase
        ));
    }
    Ok(Some(frame))
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(VarInt::from_u32(30_000).into()))
        .keep_alive_interval(Some(Duration::from_secs(5)));
    Arc::new(t)
}

fn tls_err(e: impl std::fmt::Display) -> ControlError {
    ControlError::Wire(WireError::Tls(rustls::Error::General(e.to_string())))
}

fn runtime(name: &str) -> Result<Runtime, ControlError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name(name)
        .build()?)
}

/// What the control server saw.
#[derive(Debug)]
pub enum ServerEvent {
    /// A worker authenticated and registered; `outbox` sends it messages.
    Registered {
        rank: usize,
        pid: u32,
        mesh_addr: SocketAddr,
        outbox: Outbox,
    },
    Message {
        rank: usize,
        msg: ToCoordinator,
    },
    /// A registered worker is making progress inside an epoch (its heartbeat, a QUIC datagram on its
    /// authenticated connection): it is not silent, whatever its epoch's length. `rtt`: the connection's
    /// round-trip time as QUIC estimates it now (a worker behind a delaying network shows it here).
    Alive {
        rank: usize,
        rtt: Duration,
    },
    /// A registered worker is blocked waiting for a frame from its peer `on` (its heartbeat while it uses
    /// no CPU): not progress, but whom to blame if the wait outlasts the timeout. `rtt` as for `Alive`.
    Waiting {
        rank: usize,
        on: usize,
        rtt: Duration,
    },
    /// A registered worker's connection ended or broke.
    Lost {
        rank: usize,
        reason: String,
    },
    /// A connection was refused (bad or missing certificate, wrong job, bad first message).
    Refused {
        addr: SocketAddr,
        reason: String,
    },
    /// A registered worker's file transfer failed or was refused (the worker sees the error too).
    Transfer {
        rank: usize,
        error: String,
    },
}

/// Sends messages to one registered worker without waiting.
#[derive(Debug, Clone)]
pub struct Outbox(UnboundedSender<ToWorker>);

impl Outbox {
    /// False if the connection is gone.
    pub fn send(&self, msg: ToWorker) -> bool {
        self.0.send(msg).is_ok()
    }
}

/// The coordinator's end: accepts the job's workers; see the module doc.
pub struct ControlServer {
    endpoint: Endpoint,
    local_addr: SocketAddr,
    events: mpsc::Receiver<ServerEvent>,
    refusals: Arc<AtomicU64>,
    rt: Runtime,
}

impl ControlServer {
    /// Binds `addr` with the coordinator's identity (a certificate named [`COORDINATOR_NAME`]) for a job of
    /// `world` workers. A connection must register within `register_timeout` of its handshake. Registered
    /// workers fetch what `files` serves and upload where it says.
    pub fn bind(
        identity: &TlsIdentity,
        job: u64,
        world: usize,
        addr: SocketAddr,
        register_timeout: Duration,
        files: Files,
    ) -> Result<ControlServer, ControlError> {
        let crypto =
            QuicServerConfig::try_from(physalia_wire::server_config(identity)?).map_err(tls_err)?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(transport());
        let rt = runtime("physalia-control")?;
        let endpoint = {
            let _guard = rt.enter();
            Endpoint::server(server, addr)?
        };
        let local_addr = endpoint.local_addr()?;
        let (tx, events) = mpsc::channel();
        let refusals = Arc::new(AtomicU64::new(0));
        let (ep, count) = (endpoint.clone(), refusals.clone());
        rt.spawn(async move {
            while let Some(incoming) = ep.accept().await {
                tokio::spawn(admit(
                    incoming,
                    job,
                    world,
                    register_timeout,
                    tx.clone(),
                    count.clone(),
                    files.clone(),
                ));
            }
        });
        Ok(ControlServer {
            endpoint,
            local_addr,
            events,
            refusals,
            rt,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Connections refused so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::SeqCst)
    }

    /// The next event, or `None` after `timeout` without one.
    pub fn next_event(&self, timeout: Duration) -> Option<ServerEvent> {
        self.events.recv_timeout(timeout).ok()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let endpoint = self.endpoint.clone();
        self.rt.block_on(async move {
            endpoint.close(VarInt::from_u32(0), b"done");
            let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        });
    }
}

async fn admit(
    incoming: Incoming,
    job: u64,
    world: usize,
    register_timeout: Duration,
    events: mpsc::Sender<ServerEvent>,
    refusals: Arc<AtomicU64>,
    files: Files,
) {
    let addr = incoming.remote_address();
    let refuse = |reason: String| {
        refusals.fetch_add(1, Ordering::SeqCst);
        let _ = events.send(ServerEvent::Refused { addr, reason });
    };
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => return refuse(format!("handshake failed: {e}")),
    };
    let registered = async {
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| format!("no stream: {e}"))?;
        let frame = read_frame(&mut recv)
            .await?
            .ok_or("the stream ended before registering")?;
        if frame.header.job != job {
            return Err(format!(
                "registers for job {:#x}, this is job {job:#x}",
                frame.header.job
            ));
        }
        let msg: ToCoordinator = frame.control_value().map_err(|e| e.to_string())?;
        let ToCoordinator::Register {
            rank,
            pid,
            mesh_addr,
        } = msg
        else {
            return Err("the first message is not a registration".to_string());
        };
        if rank >= world {
            return Err(format!("claims rank {rank} in a job of {world} workers"));
        }
        let name = physalia_wire::worker_name(rank);
        check_cert_name(&peer_certificates(&conn)?[0], &name).map_err(|e| {
            format!("claims rank {rank} but its certificate is not for {name}: {e}")
        })?;
        Ok((rank, pid, mesh_addr, send, recv))
    };
    let (rank, pid, mesh_addr, mut send, mut recv) =
        match tokio::time::timeout(register_timeout, registered).await {
            Ok(Ok(r)) => r,
            Ok(Err(reason)) => {
                conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
                return refuse(reason);
            }
            Err(_) => {
                let reason = format!("did not register within {register_timeout:?}");
                conn.close(VarInt::from_u32(REFUSED), reason.as_bytes());
                return refuse(reason);
            }
        };
    // datagrams are heartbeats: the connection's TLS identity is the rank; the bytes say whether it
    // computes or waits on a peer
    let (beats, beat_events) = (conn.clone(), events.clone());
    tokio::spawn(async move {
        while let Ok(beat) = beats.read_datagram().await {
            let rtt = beats.rtt();
            let event = match decode_beat(&beat) {
                Beat::Waiting { on } => ServerEvent::Waiting { rank, on, rtt },
                Beat::Alive => ServerEvent::Alive { rank, rtt },
            };
            if beat_events.send(event).is_err() {
                return;
            }
        }
    });
    // every further stream of the connection is one file transfer
    let (streams, transfer_events) = (conn.clone(), events.clone());
    tokio::spawn(async move {
        while let Ok((send, recv)) = streams.accept_bi().await {
            let (files, events) = (files.clone(), transfer_events.clone());
            tokio::spawn(async move {
                if let Err(error) = transfer::serve_stream(rank, job, files, send, recv).await {
                    let _ = events.send(ServerEvent::Transfer { rank, error });
                }
            });
        }
    });
    let (tx, mut outgoing) = unbounded_channel::<ToWorker>();
    tokio::spawn(async move {
        while let Some(msg) = outgoing.recv().await {
            let Ok(frame) = Frame::control(header(COORDINATOR_SENDER, job), &msg) else {
                return;
            };
            if write_frame(&mut send, &frame).await.is_err() {
                return;
            }
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    });
    if events
        .send(ServerEvent::Registered {
            rank,
            pid,
            mesh_addr,
            outbox: Outbox(tx),
        })
        .is_err()
    {
        return;
    }
    let reason = loop {
        match read_frame(&mut recv).await {
            Ok(Some(frame)) => match frame.control_value::<ToCoordinator>() {
                Ok(msg) => {
                    if events.send(ServerEvent::Message { rank, msg }).is_err() {
                        return;
                    }
                }
                Err(e) => break format!("sent a bad message: {e}"),
            },
            Ok(None) => break "closed its control connection".to_string(),
            Err(e) => break format!("lost its control connection: {e}"),
        }
    };
    let _ = events.send(ServerEvent::Lost { rank, reason });
}

/// Sends a worker's heartbeats: unreliable QUIC datagrams on its control connection, which the
/// coordinator counts as hearing from the worker ([`ServerEvent::Alive`]).
#[derive(Clone)]
pub struct Heartbeat {
    conn: Connection,
}

impl Heartbeat {
    /// One beat; false once the connection is gone (nothing more will arrive).
    pub fn beat(&self) -> bool {
        self.send(Bytes::from_static(ALIVE))
    }

    /// Says this worker is blocked waiting for a frame from its peer `on` (not a beat: it makes no
    /// progress); false once the connection is gone.
    pub fn waiting_on(&self, on: usize) -> bool {
        let Ok(on) = u32::try_from(on) else {
            return true;
        };
        let mut beat = WAITING.to_vec();
        beat.extend_from_slice(&on.to_le_bytes());
        self.send(Bytes::from(beat))
    }

    fn send(&self, beat: Bytes) -> bool {
        match self.conn.send_datagram(beat) {
            Ok(()) => true,
            // a datagram too large or not yet negotiable: the next beat may pass
            Err(quinn::SendDatagramError::ConnectionLost(_)) => false,
            Err(_) => true,
        }
    }
}

const ALIVE: &[u8] = b"alive";
const WAITING: &[u8] = b"wait";

/// What a heartbeat datagram says.
#[derive(Debug, PartialEq, Eq)]
enum Beat {
    Alive,
    Waiting { on: usize },
}

/// `wait` and a little-endian u32 rank is a wait; anything else from the authenticated worker counts as a
/// beat, as every datagram did before waits were reported.
fn decode_beat(bytes: &[u8]) -> Beat {
    match bytes.strip_prefix(WAITING) {
        Some(&[a, b, c, d]) => Beat::Waiting {
            on: u32::from_le_bytes([a, b, c, d]) as usize,
        },
        _ => Beat::Alive,
    }
}

/// Puts a worker's log lines on its control stream from any thread (a mesh runtime's included) without
/// waiting: a line that finds [`LOG_BACKLOG`] lines not yet written is dropped (the worker's own log keeps
/// it), so a flood of warnings never blocks training or grows memory.
#[derive(Clone)]
pub struct LogSender {
    rank: usize,
    tx: tokio::sync::mpsc::Sender<Frame>,
    header: FrameHeader,
}

/// Log lines a worker may have queued for its control stream.
pub const LOG_BACKLOG: usize = 256;

impl LogSender {
    /// Queues `line` (cut at [`crate::messages::MAX_LOG_LINE_BYTES`]); false if it was dropped or the
    /// connection is gone.
    pub fn send(&self, level: &str, line: &str) -> bool {
        let max = crate::messages::MAX_LOG_LINE_BYTES;
        let line = if line.len() > max {
            let mut end = max - 3;
            while !line.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}...", &line[..end])
        } else {
            line.to_string()
        };
        let msg = ToCoordinator::Log {
            rank: self.rank,
            level: level.to_string(),
            line,
        };
        match Frame::control(self.header, &msg) {
            Ok(frame) => self.tx.try_send(frame).is_ok(),
            Err(_) => false,
        }
    }
}

/// A worker's end of the control channel.
pub struct ControlClient {
    rank: usize,
    job: u64,
    conn: Connection,
    /// Shared with the task that writes [`LogSender`]'s lines: whole frames, one writer at a time.
    send: Arc<Mutex<SendStream>>,
    log: LogSender,
    endpoint: Endpoint,
    incoming: Option<mpsc::Receiver<Result<ToWorker, String>>>,
    rt: Runtime,
    /// The HTTP client of artifacts with a signed URL, made on first use.
    http: Option<reqwest::Client>,
    /// Artifacts read from their signed URL, not through the coordinator: count and bytes.
    direct: (u64, u64),
    /// Artifacts a [`Prefetcher`] is fetching now: [`ControlClient::fetch`] of one waits for it.
    in_flight: Arc<InFlight>,
}

/// Names of the artifacts being fetched on other threads, and a signal when one is done.
#[derive(Debug, Default)]
struct InFlight {
    names: std::sync::Mutex<std::collections::HashSet<String>>,
    done: std::sync::Condvar,
}

impl InFlight {
    /// Marks `name` in flight; false when it already is (another thread fetches it).
    fn start(&self, name: &str) -> bool {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.insert(name.to_string())
    }

    fn end(&self, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.remove(name);
        self.done.notify_all();
    }

    /// Waits until no other thread fetches `name`.
    fn wait(&self, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        while names.contains(name) {
            names = self.done.wait(names).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Fetches artifacts on a thread of the caller's while the connection's owner goes on (training): the
/// part deltas of a foreseen resize ([`ToWorker::Prefetch`]). A later [`ControlClient::fetch`] of the same
/// artifact waits for it and finds the copy. Through the coordinator only (an artifact with a signed URL
/// is left to the fetch that needs it).
#[derive(Clone)]
pub struct Prefetcher {
    rank: usize,
    job: u64,
    conn: Connection,
    rt: tokio::runtime::Handle,
    in_flight: Arc<InFlight>,
}

impl Prefetcher {
    /// `artifact` fetched into `dir` unless this machine holds it already (where the coordinator keeps it,
    /// or an earlier copy in `dir`) or another thread fetches it now. Returns the copy's path, or `None`
    /// when nothing was fetched.
    pub fn fetch(&self, artifact: &Artifact, dir: &Path) -> Result<Option<PathBuf>, ControlError> {
        if artifact.url.is_some() || !self.in_flight.start(&artifact.name) {
            return Ok(None);
        }
        let local = dir.join(transfer::local_name(&artifact.name));
        let fetched = match held_copy(artifact, dir) {
            Some(_) => Ok(None),
            None => get_file(
                &self.rt,
                &self.conn,
                (self.rank, self.job),
                artifact,
                &local,
            )
            .map(|()| Some(local)),
        };
        self.in_flight.end(&artifact.name);
        fetched
    }

    /// Where this machine holds `artifact`, checked: the coordinator's path, or a copy in `dir`.
    pub fn held_copy(&self, artifact: &Artifact, dir: &Path) -> Option<PathBuf> {
        held_copy(artifact, dir)
    }
}

/// Where this machine holds `artifact`, checked against its size and checksum: the coordinator's path
/// (a worker on its machine reads it in place), or a copy an earlier fetch left in `dir`.
fn held_copy(artifact: &Artifact, dir: &Path) -> Option<PathBuf> {
    if let Some(p) = &artifact.path
        && transfer::holds(p, artifact)
    {
        return Some(p.clone());
    }
    let local = dir.join(transfer::local_name(&artifact.name));
    transfer::holds(&local, artifact).then_some(local)
}

/// Asks the coordinator for `artifact` on `conn` and receives it into `dest`, checked against its size
/// and checksum.
fn get_file(
    rt: &tokio::runtime::Handle,
    conn: &Connection,
    (rank, job): (usize, u64),
    artifact: &Artifact,
    dest: &Path,
) -> Result<(), ControlError> {
    let request = Frame::control(
        header(rank as u16, job),
        &Request::Get {
            name: artifact.name.clone(),
        },
    )?;
    let conn = conn.clone();
    let (size, xxh3) = (artifact.size, artifact.xxh3);
    let name = artifact.name.clone();
    let dest = dest.to_path_buf();
    rt.block_on(async move {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        write_frame(&mut send, &request).await?;
        let _ = send.finish();
        let reply: Reply = read_frame(&mut recv)
            .await?
            .ok_or("no reply")?
            .control_value()
            .map_err(|e| e.to_string())?;
        match reply {
            Reply::Sending { size: s, xxh3: h } if (s, h) == (size, xxh3) => {
                let mut beating = transfer::Beating::new(&mut recv, Heartbeat { conn: conn.clone() });
                transfer::receive_file(&mut beating, &dest, size, xxh3).await
            }
            Reply::Sending { size: s, xxh3: h } => Err(format!(
                "the coordinator serves {s} bytes with xxh3 {h:016x}; the assignment announced {size} \
                 bytes with xxh3 {xxh3:016x}"
            )),
            Reply::Refused { reason } => Err(reason),
            Reply::Stored => Err("unexpected reply".into()),
        }
    })
    .map_err(|e| ControlError::Protocol(format!("fetching {name}: {e}")))
}

impl ControlClient {
    /// Connects to the coordinator at `addr` (retrying until `timeout`) and registers.
    pub fn connect(
        addr: SocketAddr,
        identity: &TlsIdentity,
        rank: usize,
        job: u64,
        mesh_addr: SocketAddr,
        timeout: Duration,
    ) -> Result<ControlClient, ControlError> {
        let crypto =
            QuicClientConfig::try_from(physalia_wire::client_config(identity)?).map_err(tls_err)?;
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(transport());
        let rt = runtime(&format!("physalia-control-{rank}"))?;
        let bind: SocketAddr = match addr.ip() {
            IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let endpoint = {
            let _guard = rt.enter();
            Endpoint::client(bind)?
        };
        let register = Frame::control(
            header(rank as u16, job),
            &ToCoordinator::Register {
                rank,
                pid: std::process::id(),
                mesh_addr,
            },
        )?;
        let (conn, send, recv) = rt
            .block_on(async {
                let deadline = tokio::time::Instant::now() + timeout;
                let mut last = String::from("no attempt");
                while tokio::time::Instant::now() < deadline {
                    let attempt = async {
                        let connecting = endpoint
                            .connect_with(client.clone(), addr, COORDINATOR_NAME)
                            .map_err(|e| e.to_string())?;
                        let conn = tokio::time::timeout(Duration::from_secs(5), connecting)
                            .await
                            .map_err(|_| "no handshake within 5s".to_string())?
                            .map_err(|e| format!("handshake failed: {e}"))?;
                        let (mut send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
                        write_frame(&mut send, &register).await?;
                        Ok::<_, String>((conn, send, recv))
                    };
                    match attempt.await {
                        Ok(c) => return Ok(c),
                        Err(e) => last = e,
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(last)
            })
            .map_err(|e| {
                ControlError::Protocol(format!("connecting to the coordinator at {addr}: {e}"))
            })?;
        let (tx, incoming) = mpsc::channel();
        let mut recv: RecvStream = recv;
        rt.spawn(async move {
            loop {
                let next = match read_frame(&mut recv).await {
                    Ok(Some(frame)) => frame.control_value::<ToWorker>().map_err(|e| e.to_string()),
                    Ok(None) => Err("the coordinator closed the control connection".to_string()),
                    Err(e) => Err(format!("lost the coordinator: {e}")),
                };
                let stop = next.is_err();
                if tx.send(next).is_err() || stop {
                    return;
                }
            }
        });
        let send = Arc::new(Mutex::new(send));
        let (log_tx, mut log_rx) = tokio::sync::mpsc::channel::<Frame>(LOG_BACKLOG);
        let stream = send.clone();
        rt.spawn(async move {
            while let Some(frame) = log_rx.recv().await {
                let mut s = stream.lock().await;
                if write_frame(&mut s, &frame).await.is_err() {
                    return;
                }
            }
        });
        Ok(ControlClient {
            rank,
            job,
            conn,
            send,
            log: LogSender {
                rank,
                tx: log_tx,
                header: header(rank as u16, job),
            },
            endpoint,
            incoming: Some(incoming),
            rt,
            http: None,
            direct: (0, 0),
            in_flight: Arc::default(),
        })
    }

    pub fn send(&mut self, msg: &ToCoordinator) -> Result<(), ControlError> {
        let frame = Frame::control(header(self.rank as u16, self.job), msg)?;
        let send = self.send.clone();
        self.rt
            .block_on(async move { write_frame(&mut *send.lock().await, &frame).await })
            .map_err(ControlError::Protocol)
    }

    /// A handle any thread puts log lines on this connection with (see [`LogSender`]).
    pub fn log_sender(&self) -> LogSender {
        self.log.clone()
    }

    /// The next message from the coordinator, waiting at most `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<ToWorker, ControlError> {
        let incoming = self
            .incoming
            .as_ref()
            .ok_or_else(|| ControlError::Protocol("the incoming messages were taken".into()))?;
        match incoming.recv_timeout(timeout) {
            Ok(Ok(msg)) => Ok(msg),
            Ok(Err(reason)) => Err(ControlError::Protocol(reason)),
            Err(_) => Err(ControlError::Protocol(format!(
                "no message from the coordinator within {timeout:?}"
            ))),
        }
    }

    /// `artifact` as a file on this machine: where the coordinator keeps it if this machine holds the same
    /// bytes there, else a copy in `dir` (fetched now unless an earlier fetch left it), checked against the
    /// artifact's size and checksum either way.
    pub fn fetch(&mut self, artifact: &Artifact, dir: &Path) -> Result<PathBuf, ControlError> {
        // a prefetch of it on another thread: its copy is the one to read
        self.in_flight.wait(&artifact.name);
        if let Some(p) = held_copy(artifact, dir) {
            return Ok(p);
        }
        let local = dir.join(transfer::local_name(&artifact.name));
        if let Some(url) = &artifact.url {
            match self.download(url, &local, artifact) {
                Ok(()) => {
                    self.direct.0 += 1;
                    self.direct.1 += artifact.size;
                    return Ok(local);
                }
                Err(e) => tracing::warn!(
                    artifact = %artifact.name,
                    "reading it from the store failed ({e}); fetching it through the coordinator"
                ),
            }
        }
        get_file(
            self.rt.handle(),
            &self.conn,
            (self.rank, self.job),
            artifact,
            &local,
        )?;
        Ok(local)
    }

    /// A handle that fetches artifacts on another thread while this connection's owner goes on.
    pub fn prefetcher(&self) -> Prefetcher {
        Prefetcher {
            rank: self.rank,
            job: self.job,
            conn: self.conn.clone(),
            rt: self.rt.handle().clone(),
            in_flight: self.in_flight.clone(),
        }
    }

    /// GETs `url` into `dest` (an artifact's signed URL), checked against the artifact's size and checksum.
    fn download(
        &mut self,
        url: &crate::messages::SignedUrl,
        dest: &Path,
        artifact: &Artifact,
    ) -> Result<(), String> {
        let http = match &self.http {
            Some(c) => c.clone(),
            None => {
                let c = reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .build()
                    .map_err(|e| format!("an HTTP client: {e}"))?;
                self.http = Some(c.clone());
                c
            }
        };
        let (size, xxh3) = (artifact.size, artifact.xxh3);
        let beat = self.heartbeat();
        self.rt
            .block_on(transfer::download(&http, url, (dest, size, xxh3), beat))
    }

    /// Artifacts this worker read from their signed URLs rather than through the coordinator: how many,
    /// and their bytes.
    pub fn fetched_directly(&self) -> (u64, u64) {
        self.direct
    }

    /// Sends the file at `path` to the coordinator to keep as `what`, and returns once it is stored.
    pub fn upload(&mut self, what: Upload, path: &Path) -> Result<(), ControlError> {
        let (size, xxh3) = transfer::file_xxh3(path)?;
        let request = Frame::control(
            header(self.rank as u16, self.job),
            &Request::Put { what, size, xxh3 },
        )?;
        let conn = self.conn.clone();
        let path = path.to_path_buf();
        let beat = self.heartbeat();
        self.rt
            .block_on(async move {
                let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
                write_frame(&mut send, &request).await?;
                // a refusal may come before every byte is sent: the reply says why either way
                let sent = transfer::send_file(&mut send, &path, size, Some(beat)).await;
                let reply = match read_frame(&mut recv).await {
                    Ok(Some(frame)) => frame.control_value::<Reply>().map_err(|e| e.to_string()),
                    Ok(None) => Err("no reply".to_string()),
                    Err(e) => Err(e),
                };
                match (reply, sent) {
                    (Ok(Reply::Refused { reason }), _) => Err(reason),
                    (Ok(Reply::Stored), Ok(())) => Ok(()),
                    (_, Err(e)) | (Err(e), Ok(())) => Err(e),
                    (Ok(_), Ok(())) => Err("unexpected reply".into()),
                }
            })
            .map_err(|e| ControlError::Protocol(format!("uploading {what:?}: {e}")))
    }

    /// A handle another thread beats with while this worker makes progress inside an epoch.
    pub fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            conn: self.conn.clone(),
        }
    }

    /// Hands the stream of incoming messages (ending with an `Err` when the connection ends) to a watcher.
    pub fn take_incoming(&mut self) -> Option<mpsc::Receiver<Result<ToWorker, String>>> {
        self.incoming.take()
    }

    /// Finishes the stream and waits (at most `linger`) until the coordinator has read everything.
    pub fn finish(self, linger: Duration) {
        let (send, conn, endpoint) = (self.send.clone(), self.conn.clone(), self.endpoint.clone());
        self.rt.block_on(async move {
            let mut send = send.lock().await;
            let _ = send.finish();
            let _ = tokio::time::timeout(linger, send.stopped()).await;
            conn.close(VarInt::from_u32(0), b"done");
            let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use physalia_wire::{JobCa, job_key, worker_name};

    fn server(ca: &JobCa) -> ControlServer {
        let identity = ca.identity(COORDINATOR_NAME).unwrap();
        ControlServer::bind(
            &identity,
            ca.job_key(),
            2,
            "127.0.0.1:0".parse().unwrap(),
            Duration::from_secs(5),
            Files::default(),
        )
        .unwrap()
    }

    fn next_refusal(s: &ControlServer) -> String {
        for _ in 0..50 {
            match s.next_event(Duration::from_millis(200)) {
                Some(ServerEvent::Refused { reason, .. }) => return reason,
                Some(other) => panic!("expected a refusal, got {other:?}"),
                None => {}
            }
        }
        panic!("no refusal within 10 s");
    }

    #[test]
    fn a_worker_of_the_job_registers_and_exchanges_messages() {
        let ca = JobCa::new("job-a").unwrap();
        let s = server(&ca);
        let id = ca.identity(&worker_name(1)).unwrap();
        let mesh: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut c = ControlClient::connect(
            s.local_addr(),
            &id,
            1,
            ca.job_key(),
            mesh,
            Duration::from_secs(5),
        )
        .unwrap();
        let Some(ServerEvent::Registered {
            rank,
            mesh_addr,
            outbox,
            ..
        }) = s.next_event(Duration::from_secs(5))
        else {
            panic!("no registration");
        };
        assert_eq!((rank, mesh_addr), (1, mesh));
        assert!(outbox.send(ToWorker::Stop {
            reason: "test".into()
        }));
        let ToWorker::Stop { reason } = c.recv_timeout(Duration::from_secs(5)).unwrap() else {
            panic!()
        };
        assert_eq!(reason, "test");
        c.send(&ToCoordinator::Failed {
            rank: 1,
            error: "x".into(),
        })
        .unwrap();
        assert!(matches!(
            s.next_event(Duration::from_secs(5)),
            Some(ServerEvent::Message { rank: 1, .. })
        ));
        assert_eq!(s.refusals(), 0);
    }

    #[test]
    fn a_certificate_from_another_job_is_refused() {
        let ca = JobCa::new("job-a").unwrap();
        let other = JobCa::new("job-b").unwrap();
        let s = server(&ca);
        // Trusts this job's CA (so the client goes through with the handshake) but presents another
        // job's certificate: the server's client verification must refuse it.
        let (cert_pem, key_pem) = other.issue(&worker_name(0)).unwrap();
        let id = TlsIdentity {
            ca_pem: ca.cert_pem(),
            cert_pem,
            key_pem,
        };
        let mesh: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let r = ControlClient::connect(
            s.local_addr(),
            &id,
            0,
            job_key("job-a"),
            mesh,
            Duration::from_millis(1500),
        );
        let reason = next_refusal(&s);
        assert!(reason.contains("handshake failed"), "{reason}");
        assert!(s.refusals() >= 1);
        // Whatever the client saw, it never registered.
        drop(r);
        assert!(!matches!(
            s.next_event(Duration::from_millis(300)),
            Some(ServerEvent::Registered { .. })
        ));
    }

    #[test]
    fn a_certificate_for_another_rank_is_refused() {
        let ca = JobCa::new("job-a").unwrap();
        let s = server(&ca);
        let id = ca.identity(&worker_name(0)).unwrap();
        let mesh: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let _c = ControlClient::connect(
            s.local_addr(),
            &id,
            1,
            ca.job_key(),
            mesh,
            Duration::from_secs(5),
        );
        let reason = next_refusal(&s);
        assert!(reason.contains("claims rank 1"), "{reason}");
    }

    fn registered(s: &ControlServer, ca: &JobCa, rank: usize) -> ControlClient {
        let id = ca.identity(&worker_name(rank)).unwrap();
        let c = ControlClient::connect(
            s.local_addr(),
            &id,
            rank,
            ca.job_key(),
            "127.0.0.1:9".parse().unwrap(),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(matches!(
            s.next_event(Duration::from_secs(5)),
            Some(ServerEvent::Registered { .. })
        ));
        c
    }

    #[test]
    fn heartbeats_say_whether_a_worker_computes_or_whom_it_waits_on() {
        let ca = JobCa::new("job-a").unwrap();
        let s = server(&ca);
        let c = registered(&s, &ca, 1);
        let beat = c.heartbeat();
        let mut got = Vec::new();
        // datagrams are unreliable: beat until each kind has arrived once (loopback loses none in practice)
        for _ in 0..50 {
            assert!(beat.beat());
            assert!(beat.waiting_on(0));
            while let Some(e) = s.next_event(Duration::from_millis(100)) {
                // each beat carries the connection's round trip: a loopback's, well under a second
                let e = match e {
                    ServerEvent::Alive { rank, rtt } | ServerEvent::Waiting { rank, rtt, .. }
                        if rtt.is_zero() || rtt >= Duration::from_secs(1) =>
                    {
                        panic!("worker {rank}'s round trip over loopback: {rtt:?}")
                    }
                    ServerEvent::Alive { rank, .. } => format!("Alive {{ rank: {rank} }}"),
                    ServerEvent::Waiting { rank, on, .. } => {
                        format!("Waiting {{ rank: {rank}, on: {on} }}")
                    }
                    e => format!("{e:?}"),
                };
                got.push(e);
            }
            if got.iter().any(|e| e.starts_with("Alive"))
                && got.iter().any(|e| e.starts_with("Waiting"))
            {
                break;
            }
        }
        assert!(got.contains(&"Alive { rank: 1 }".to_string()), "{got:?}");
        assert!(
            got.contains(&"Waiting { rank: 1, on: 0 }".to_string()),
            "{got:?}"
        );
    }

    #[test]
    fn a_beat_is_alive_unless_it_is_a_well_formed_wait() {
        assert_eq!(decode_beat(b"alive"), Beat::Alive);
        assert_eq!(decode_beat(b"wait\x02\0\0\0"), Beat::Waiting { on: 2 });
        // a short or long wait, or any other bytes, counts only as a sign of life
        assert_eq!(decode_beat(b"wait\x02"), Beat::Alive);
        assert_eq!(decode_beat(b"wait\x02\0\0\0\0"), Beat::Alive);
        assert_eq!(decode_beat(b""), Beat::Alive);
    }

    fn file_server(ca: &JobCa, files: Files) -> ControlServer {
        ControlServer::bind(
            &ca.identity(COORDINATOR_NAME).unwrap(),
            ca.job_key(),
            2,
            "127.0.0.1:0".parse().unwrap(),
            Duration::from_secs(5),
            files,
        )
        .unwrap()
    }

    /// Bytes that are not all alike, larger than a few chunks.
    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7919 % 251) as u8).collect()
    }

    #[test]
    fn a_worker_fetches_an_artifact_it_cannot_read_and_gets_exactly_its_bytes() {
        let served = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let bytes = payload(3 * transfer::CHUNK + 12345);
        let src = served.path().join("part.safetensors");
        std::fs::write(&src, &bytes).unwrap();
        let ca = JobCa::new("job-f").unwrap();
        let files = Files::new(None);
        let mut artifact = files.serve("part-1", &src).unwrap();
        assert_eq!(artifact.size, bytes.len() as u64);
        let s = file_server(&ca, files);
        let mut c = registered(&s, &ca, 1);
        // as a container sees it: the coordinator's path is not there
        artifact.path = Some(PathBuf::from("/nonexistent/part.safetensors"));
        let got = c.fetch(&artifact, work.path()).unwrap();
        assert!(got.starts_with(work.path()), "{got:?}");
        assert_eq!(std::fs::read(&got).unwrap(), bytes);
        // nothing but the file is left in the folder
        assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 1);
        // on the coordinator's machine the file is read in place
        artifact.path = Some(src.clone());
        assert_eq!(c.fetch(&artifact, work.path()).unwrap(), src);
    }

    /// A prefetch (`ToWorker::Prefetch`) fetches on a thread of its own; a later fetch of the same
    /// artifact reads its copy (the coordinator could not serve it again: its file is gone), and one on the
    /// coordinator's machine fetches nothing.
    #[test]
    fn a_prefetched_artifact_is_the_copy_a_later_fetch_reads() {
        let served = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let bytes = payload(2 * transfer::CHUNK + 777);
        let src = served.path().join("delta0.bin");
        std::fs::write(&src, &bytes).unwrap();
        let ca = JobCa::new("job-p").unwrap();
        let files = Files::new(None);
        let mut artifact = files.serve("part-prep0-k2-0", &src).unwrap();
        let s = file_server(&ca, files);
        let mut c = registered(&s, &ca, 0);
        let local_artifact = artifact.clone();
        artifact.path = Some(PathBuf::from("/nonexistent/delta0.bin"));
        let prefetcher = c.prefetcher();
        let (a, dir) = (artifact.clone(), work.path().to_path_buf());
        let got = std::thread::spawn(move || prefetcher.fetch(&a, &dir))
            .join()
            .unwrap()
            .unwrap()
            .expect("fetched");
        assert_eq!(std::fs::read(&got).unwrap(), bytes);
        // a second prefetch finds the copy and fetches nothing
        assert_eq!(c.prefetcher().fetch(&artifact, work.path()).unwrap(), None);
        std::fs::remove_file(&src).unwrap();
        assert_eq!(c.fetch(&artifact, work.path()).unwrap(), got);
        assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 1);
        // where the coordinator's path holds the file, nothing is prefetched
        std::fs::write(&src, &bytes).unwrap();
        assert_eq!(
            c.prefetcher().fetch(&local_artifact, work.path()).unwrap(),
            None
        );
    }

    /// A fetch waits for a prefetch of the same artifact in flight on another thread, not for others.
    #[test]
    fn a_fetch_waits_for_the_prefetch_of_its_artifact_in_flight() {
        let f = Arc::new(InFlight::default());
        assert!(f.start("a"));
        assert!(!f.start("a"), "one fetch of a name at a time");
        f.wait("b");
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiter = {
            let (f, done) = (f.clone(), done.clone());
            std::thread::spawn(move || {
                f.wait("a");
                done.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !done.load(std::sync::atomic::Ordering::SeqCst),
            "did not wait"
        );
        f.end("a");
        waiter.join().unwrap();
        assert!(done.load(std::sync::atomic::Ordering::SeqCst));
        assert!(f.start("a"), "free again");
    }

    /// A store's object as the coordinator streams it through: `bytes` in uneven pieces, then, when
    /// `fail` is set, an error instead of the rest.
    struct Piecewise {
        bytes: Vec<u8>,
        fail: Option<usize>,
    }

    impl transfer::Source for Piecewise {
        fn open(&self) -> tokio::sync::mpsc::Receiver<Result<bytes::Bytes, String>> {
            let (tx, rx) = tokio::sync::mpsc::channel(2);
            let (bytes, fail) = (self.bytes.clone(), self.fail);
            std::thread::spawn(move || {
                let end = fail.unwrap_or(bytes.len());
                for piece in bytes[..end].chunks(300_001) {
                    if tx
                        .blocking_send(Ok(bytes::Bytes::copy_from_slice(piece)))
                        .is_err()
                    {
                        return;
                    }
                }
                if fail.is_some() {
                    let _ = tx.blocking_send(Err("the store reset the connection".into()));
                }
            });
            rx
        }
    }

    #[test]
    fn a_streamed_artifact_arrives_whole_and_a_broken_stream_leaves_nothing() {
        let work = tempfile::tempdir().unwrap();
        let bytes = payload(2 * transfer::CHUNK + 777);
        let xxh3 = xxhash_rust::xxh3::xxh3_64(&bytes);
        let size = bytes.len() as u64;
        let ca = JobCa::new("job-s").unwrap();
        let files = Files::new(None);
        let whole = files.serve_from(
            "dataset-chunk/x/0.bin",
            std::sync::Arc::new(Piecewise {
                bytes: bytes.clone(),
                fail: None,
            }),
            size,
            xxh3,
        );
        let broken = files.serve_from(
            "dataset-chunk/x/1.bin",
            std::sync::Arc::new(Piecewise {
                bytes: bytes.clone(),
                fail: Some(transfer::CHUNK + 5),
            }),
            size,
            xxh3,
        );
        // the manifest says more bytes than the store has
        let short = files.serve_from(
            "dataset-chunk/x/2.bin",
            std::sync::Arc::new(Piecewise {
                bytes: bytes[..1000].to_vec(),
                fail: None,
            }),
            size,
            xxh3,
        );
        let s = file_server(&ca, files);
        let mut c = registered(&s, &ca, 1);
        let got = c.fetch(&whole, work.path()).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), bytes);
        std::fs::remove_file(&got).unwrap();
        for artifact in [&broken, &short] {
            let e = c.fetch(artifact, work.path()).unwrap_err().to_string();
            assert!(e.contains(&artifact.name), "{e}");
        }
        assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0);
    }

    /// A store on loopback answering GETs of signed URLs as S3 answers presigned ones: the object's
    /// bytes when the query carries the right signature, 403 otherwise, 404 for an unknown key. Serves
    /// until dropped; counts the requests it answered with bytes.
    struct SignedStore {
        addr: std::net::SocketAddr,
        served: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl SignedStore {
        fn start(objects: Vec<(&'static str, Vec<u8>)>) -> SignedStore {
            use std::io::{BufRead as _, Write as _};
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let count = served.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    let Ok(mut conn) = conn else { return };
                    let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        continue;
                    }
                    // the headers, to the blank line
                    let mut h = String::new();
                    while reader.read_line(&mut h).is_ok_and(|n| n > 2) {
                        h.clear();
                    }
                    let target = line.split(' ').nth(1).unwrap_or_default().to_string();
                    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                    let (code, body) = match objects.iter().find(|(k, _)| path == format!("/{k}")) {
                        None => ("404 Not Found", b"NoSuchKey".to_vec()),
                        Some(_) if query != "X-Amz-Signature=good" => {
                            ("403 Forbidden", b"SignatureDoesNotMatch".to_vec())
                        }
                        Some((_, bytes)) => {
                            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            ("200 OK", bytes.clone())
                        }
                    };
                    let _ = write!(
                        conn,
                        "HTTP/1.1 {code}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    // a key under `slow/` comes in ten pieces 300 ms apart, as from a busy store
                    if path.starts_with("/slow/") {
                        for piece in body.chunks(body.len().div_ceil(10).max(1)) {
                            std::thread::sleep(Duration::from_millis(300));
                            let _ = conn.write_all(piece);
                            let _ = conn.flush();
                        }
                    } else {
                        let _ = conn.write_all(&body);
                    }
                }
            });
            SignedStore { addr, served }
        }

        fn url(&self, key: &str, signature: &str) -> crate::messages::SignedUrl {
            crate::messages::SignedUrl::new(format!(
                "http://{}/{key}?X-Amz-Signature={signature}",
                self.addr
            ))
        }
    }

    /// Issue 31: an artifact with a signed URL is read from the store by the worker itself, checked
    /// against the announced size and checksum; when the URL fails (refused, the wrong bytes) the worker
    /// fetches it through the coordinator instead, and no error or log shows the signature.
    #[test]
    fn an_artifact_with_a_signed_url_is_read_from_the_store_and_through_the_coordinator_when_that_fails()
     {
        let served = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let bytes = payload(transfer::CHUNK + 4321);
        let src = served.path().join("chunk");
        std::fs::write(&src, &bytes).unwrap();
        let store = SignedStore::start(vec![
            ("ds/0.bin", bytes.clone()),
            ("ds/1.bin", bytes[..1000].to_vec()),
        ]);
        let ca = JobCa::new("job-u").unwrap();
        let files = Files::new(None);
        let mut relayed = files.serve("dataset-chunk/0.bin", &src).unwrap();
        relayed.path = None;
        let s = file_server(&ca, files);
        let mut c = registered(&s, &ca, 0);

        // from the store: no request reaches the coordinator (its name is not even served there)
        let direct = Artifact {
            name: "not-served".into(),
            url: Some(store.url("ds/0.bin", "good")),
            ..relayed.clone()
        };
        let got = c.fetch(&direct, work.path()).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), bytes);
        assert_eq!(c.fetched_directly(), (1, bytes.len() as u64));
        std::fs::remove_file(&got).unwrap();

        // refused (a wrong signature), short, unknown: through the coordinator, the same bytes
        for url in [
            store.url("ds/0.bin", "forged"),
            store.url("ds/1.bin", "good"),
            store.url("ds/2.bin", "good"),
        ] {
            let artifact = Artifact {
                url: Some(url),
                ..relayed.clone()
            };
            let got = c.fetch(&artifact, work.path()).unwrap();
            assert_eq!(std::fs::read(&got).unwrap(), bytes);
            std::fs::remove_file(&got).unwrap();
        }
        assert_eq!(c.fetched_directly().0, 1);
        assert_eq!(store.served.load(std::sync::atomic::Ordering::SeqCst), 2);

        // a URL that fails for an artifact the coordinator does not serve: the error names the
        // artifact, never the signature, and nothing is left behind
        let lost = Artifact {
            name: "not-served".into(),
            url: Some(store.url("ds/0.bin", "forged")),
            ..relayed.clone()
        };
        let e = c.fetch(&lost, work.path()).unwrap_err().to_string();
        assert!(e.contains("not-served") && !e.contains("forged"), "{e}");
        assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0);

        // the URL is shown without its query
        let url = store.url("ds/0.bin", "secret");
        for shown in [format!("{url}"), format!("{url:?}"), format!("{direct:?}")] {
            assert!(
                !shown.contains("secret") && !shown.contains("good"),
                "{shown}"
            );
        }
        assert!(format!("{url}").contains("/ds/0.bin"));
    }

    /// A fetch whose bytes keep arriving, however slowly, beats the worker's heartbeat (its CPU time
    /// would not: it waits on the network), so the coordinator does not stop it as silent.
    #[test]
    fn bytes_arriving_slowly_beat_the_heartbeat() {
        let work = tempfile::tempdir().unwrap();
        let bytes = payload(100_000);
        let store = SignedStore::start(vec![("slow/0.bin", bytes.clone())]);
        let ca = JobCa::new("job-b").unwrap();
        let s = file_server(&ca, Files::new(None));
        let mut c = registered(&s, &ca, 1);
        while s.next_event(Duration::from_millis(100)).is_some() {}
        let artifact = Artifact {
            name: "chunk".into(),
            size: bytes.len() as u64,
            xxh3: xxhash_rust::xxh3::xxh3_64(&bytes),
            path: None,
            url: Some(store.url("slow/0.bin", "good")),
        };
        let got = c.fetch(&artifact, work.path()).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), bytes);
        let mut events = Vec::new();
        while let Some(e) = s.next_event(Duration::from_millis(200)) {
            events.push(format!("{e:?}"));
        }
        // about three seconds of arrivals: a beat a second (datagrams; loopback loses none in practice)
        assert!(
            events
                .iter()
                .any(|e| e.starts_with("Alive { rank: 1, rtt: ")),
            "{events:?}"
        );
    }

    #[test]
    fn a_fetch_that_does_not_match_the_announced_checksum_leaves_nothing() {
        let served = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let src = served.path().join("ds");
        std::fs::write(&src, payload(5000)).unwrap();
        let ca = JobCa::new("job-f").unwrap();
        let files = Files::new(None);
        let mut artifact = files.serve("dataset", &src).unwrap();
        let s = file_server(&ca, files);
        let mut c = registered(&s, &ca, 0);
        artifact.path = None;
        artifact.xxh3 ^= 1;
        let e = c.fetch(&artifact, work.path()).unwrap_err().to_string();
        assert!(
            e.contains("fetching dataset") && e.contains("announced"),
            "{e}"
        );
        let unknown = Artifact {
            name: "secrets".into(),
            size: 1,
            xxh3: 0,
            path: None,
            url: None,
        };
        let e = c.fetch(&unknown, work.path()).unwrap_err().to_string();
        assert!(e.contains("no artifact named \"secrets\""), "{e}");
        assert_eq!(std::fs::read_dir(work.path()).unwrap().count(), 0);
    }

    #[test]
    fn rank_zero_uploads_checkpoints_and_the_model_and_no_other_rank_may() {
        let job = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let ca = JobCa::new("job-u").unwrap();
        let s = file_server(&ca, Files::new(Some(job.path().to_path_buf())));
        let mut c0 = registered(&s, &ca, 0);
        let mut c1 = registered(&s, &ca, 1);
        let ck = work.path().join("ck");
        let bytes = payload(2 * transfer::CHUNK + 1);
        std::fs::write(&ck, &bytes).unwrap();
        c0.upload(Upload::Checkpoint { epoch: 5 }, &ck).unwrap();
        let stored = job.path().join("checkpoints/epoch-000005.safetensors");
        assert_eq!(std::fs::read(&stored).unwrap(), bytes);
        c0.upload(Upload::Model, &ck).unwrap();
        assert_eq!(
            std::fs::read(job.path().join("model.safetensors")).unwrap(),
            bytes
        );
        let e = c1.upload(Upload::Model, &ck).unwrap_err().to_string();
        assert!(e.contains("only rank 0"), "{e}");
        // only the two files, no temporary left over
        let names: Vec<_> = std::fs::read_dir(job.path().join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["epoch-000005.safetensors"]);
    }

    #[test]
    fn a_worker_uploads_its_own_part_where_the_coordinator_expects_it_and_no_other() {
        let job = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let ca = JobCa::new("job-p").unwrap();
        let files = Files::new(Some(job.path().to_path_buf()));
        let set = job.path().join("data.parts/k2-seed0");
        files.expect_part(1, &set.join("part1.safetensors"));
        let s = file_server(&ca, files.clone());
        let mut c0 = registered(&s, &ca, 0);
        let mut c1 = registered(&s, &ca, 1);
        let part = work.path().join("part");
        let bytes = payload(transfer::CHUNK + 7);
        std::fs::write(&part, &bytes).unwrap();
        c1.upload(Upload::Part { part: 1 }, &part).unwrap();
        assert_eq!(std::fs::read(set.join("part1.safetensors")).unwrap(), bytes);
        // another worker's part, and a part nobody expects, are refused; nothing else is written
        let e = c0
            .upload(Upload::Part { part: 1 }, &part)
            .unwrap_err()
            .to_string();
        assert!(e.contains("its own part only"), "{e}");
        let e = c0
            .upload(Upload::Part { part: 0 }, &part)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expects no part 0"), "{e}");
        let names: Vec<_> = std::fs::read_dir(&set)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["part1.safetensors"]);
        assert!(!job.path().join("parts").exists());
        // once the set is committed, no part is taken any more
        files.expect_no_parts();
        let e = c1
            .upload(Upload::Part { part: 1 }, &part)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expects no part 1"), "{e}");
    }

    #[test]
    fn a_peer_announcing_a_huge_frame_is_refused_before_anything_is_read() {
        let ca = JobCa::new("job-h").unwrap();
        let s = file_server(&ca, Files::default());
        let c = registered(&s, &ca, 1);
        // a transfer stream whose first header announces 1 GiB and sends nothing more
        let head = physalia_wire::FrameHeader {
            sender: 1,
            job: ca.job_key(),
            ..coordinator_header(ca.job_key())
        }
        .encode(1 << 30);
        let conn = c.conn.clone();
        c.rt.block_on(async move {
            let (mut send, _recv) = conn.open_bi().await.unwrap();
            send.write_all(&head).await.unwrap();
        });
        let error = loop {
            match s.next_event(Duration::from_secs(5)) {
                Some(ServerEvent::Transfer { rank: 1, error }) => break error,
                Some(_) => {}
                None => panic!("no refusal"),
            }
        };
        assert!(
            error.contains("announces 1073741824 bytes, more than the 16777216 allowed"),
            "{error}"
        );
    }
}
