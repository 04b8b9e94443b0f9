//! The control channel between the coordinator and its workers: the messages, and both ends of one QUIC
//! connection per worker carrying them.
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
//! order. Both ends are blocking APIs over a private tokio runtime; neither may be used inside an async
//! context.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use physalia_gnn::{EpochMetrics, ModelConfig, TrainConfig, TrainSummary};
use physalia_wire::{
    Dtype, Frame, FrameHeader, HEADER_LEN, Phase, TlsIdentity, WireError, check_cert_name,
    peer_certificates,
};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, Incoming, ReadExactError, RecvStream, SendStream, VarInt};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

use crate::ExchangeOptions;

/// The certificate name of the coordinator's control endpoint.
pub const COORDINATOR_NAME: &str = "coordinator";
/// The `sender` field of frames the coordinator sends.
const COORDINATOR_SENDER: u16 = u16::MAX;
/// Control messages are small (a summary with per-epoch metrics is the largest); anything bigger is garbage.
const MAX_CONTROL_BYTES: u64 = 64 << 20;
const REFUSED: u32 = 1;

/// Worker to coordinator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToCoordinator {
    /// The first message: who I am and where my mesh endpoint listens.
    Register {
        rank: usize,
        pid: u32,
        mesh_addr: SocketAddr,
    },
    /// One training epoch finished (metrics are global; `exchange` is this worker's).
    Epoch { rank: usize, metrics: EpochMetrics },
    /// Training finished; rank 0 has written the model.
    Done {
        rank: usize,
        summary: TrainSummary,
        peak_rss_bytes: Option<u64>,
    },
    /// Training failed on this worker.
    Failed { rank: usize, error: String },
}

/// What a worker trains: sent once every worker has registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Assignment {
    /// Mesh address of every rank, by rank.
    pub peers: Vec<SocketAddr>,
    pub part_path: PathBuf,
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub seed: u64,
    pub exchange: ExchangeOptions,
    pub row_normalize: bool,
    /// Where to write the model (rank 0 only).
    pub model_out: Option<PathBuf>,
    /// The bound on every wait for a peer inside an epoch.
    pub epoch_timeout_s: f64,
    /// How the job is parallelised; data and model parallelism read the dataset itself (structure, splits,
    /// and for model parallelism this worker's feature columns).
    #[serde(default)]
    pub mode: TrainMode,
    #[serde(default)]
    pub minibatch: Option<crate::minibatch::MiniBatchOptions>,
    #[serde(default)]
    pub dataset_path: Option<PathBuf>,
    /// Continue from this checkpoint (partition parallelism).
    #[serde(default)]
    pub resume_from: Option<PathBuf>,
    /// Rank 0 writes `epoch-<e>.safetensors` here after every epoch, before reporting the epoch.
    #[serde(default)]
    pub checkpoint_dir: Option<PathBuf>,
}

/// The checkpoint file of `epoch` in a checkpoint folder.
pub fn checkpoint_path(dir: &std::path::Path, epoch: usize) -> PathBuf {
    dir.join(format!("epoch-{epoch:06}.safetensors"))
}

/// The three ways a job splits its work over workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainMode {
    /// Full-graph training on METIS partitions with halo exchange.
    #[default]
    Partition,
    /// Mini-batches of each worker's own seeds; gradients all-reduced every step.
    Data,
    /// P3: features split by column; the first layer's partial products go to the batch owners.
    Model,
}

/// Coordinator to worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    Assign(Box<Assignment>),
    /// Stop now (another worker failed, or the job was cancelled).
    Stop {
        reason: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("control channel: {0}")]
    Protocol(String),
}

fn header(sender: u16, job: u64) -> FrameHeader {
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

async fn write_frame(send: &mut SendStream, frame: &Frame) -> Result<(), String> {
    send.write_chunk(Bytes::from(frame.encode()))
        .await
        .map_err(|e| e.to_string())
}

async fn read_frame(recv: &mut RecvStream) -> Result<Option<Frame>, String> {
    let mut head = [0u8; HEADER_LEN];
    match recv.read_exact(&mut head).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let (header, len) = FrameHeader::decode(&head).map_err(|e| e.to_string())?;
    if header.phase != Phase::Control || len > MAX_CONTROL_BYTES {
        return Err(format!(
            "expected a control message, got a {} frame of {len} bytes",
            header.phase
        ));
    }
    let mut payload = vec![0u8; len as usize];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Some(Frame { header, payload }))
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
    /// `world` workers. A connection must register within `register_timeout` of its handshake.
    pub fn bind(
        identity: &TlsIdentity,
        job: u64,
        world: usize,
        addr: SocketAddr,
        register_timeout: Duration,
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

/// A worker's end of the control channel.
pub struct ControlClient {
    rank: usize,
    job: u64,
    conn: Connection,
    send: SendStream,
    endpoint: Endpoint,
    incoming: Option<mpsc::Receiver<Result<ToWorker, String>>>,
    rt: Runtime,
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
        Ok(ControlClient {
            rank,
            job,
            conn,
            send,
            endpoint,
            incoming: Some(incoming),
            rt,
        })
    }

    pub fn send(&mut self, msg: &ToCoordinator) -> Result<(), ControlError> {
        let frame = Frame::control(header(self.rank as u16, self.job), msg)?;
        let send = &mut self.send;
        self.rt
            .block_on(write_frame(send, &frame))
            .map_err(ControlError::Protocol)
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

    /// Hands the stream of incoming messages (ending with an `Err` when the connection ends) to a watcher.
    pub fn take_incoming(&mut self) -> Option<mpsc::Receiver<Result<ToWorker, String>>> {
        self.incoming.take()
    }

    /// Finishes the stream and waits (at most `linger`) until the coordinator has read everything.
    pub fn finish(mut self, linger: Duration) {
        let _ = self.send.finish();
        let (send, conn, endpoint) = (&mut self.send, self.conn.clone(), self.endpoint.clone());
        self.rt.block_on(async move {
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
}
