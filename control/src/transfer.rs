//! Files over the control connection: the data plane that needs no disk shared by the coordinator and
//! its workers.
//!
//! After registering, a worker opens one more bidirectional stream of its (mutually authenticated)
//! control connection per transfer. The first frame is a [`Request`]: `Get` an artifact the coordinator
//! serves ([`Files::serve`]), or `Put` an [`Upload`] (rank 0's checkpoints and model, a worker's part it
//! cut: [`Files::expect_part`]). Then the bytes flow
//! raw, in chunks of [`CHUNK`], written to a temporary file beside the destination and hashed as they go,
//! so memory stays bounded whatever the file's size (QUIC's flow control holds the sender back). The
//! receiver checks the size and the xxh3 checksum the request or the reply announced, then renames the file
//! into place: a transfer is whole or absent. A `Put` is answered once the file is in place, so a worker
//! that reports an epoch after uploading its checkpoint knows the coordinator holds it.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use quinn::{RecvStream, SendStream};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use xxhash_rust::xxh3::Xxh3;

pub use bytes::Bytes;

use crate::messages::{Artifact, Upload};

/// Bytes read or written at a time.
pub const CHUNK: usize = 1 << 20;

/// A worker's request on a transfer stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    Get { name: String },
    Put { what: Upload, size: u64, xxh3: u64 },
}

/// The coordinator's answer: to a `Get`, before the bytes; to a `Put`, after storing them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Sending { size: u64, xxh3: u64 },
    Stored,
    Refused { reason: String },
}

/// xxh3-64 and size of a file, read in chunks.
pub fn file_xxh3(path: &Path) -> std::io::Result<(u64, u64)> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, h.digest()))
}

/// Bytes the coordinator serves from somewhere other than its disk: a store's object streamed
/// through it to the worker (a chunked dataset's chunk in cluster mode), never held whole.
pub trait Source: Send + Sync {
    /// Starts reading the bytes: they arrive in order on the channel, an `Err` ends them.
    fn open(&self) -> tokio::sync::mpsc::Receiver<Result<Bytes, String>>;
}

#[derive(Clone)]
enum Origin {
    File(PathBuf),
    Stream(Arc<dyn Source>),
}

struct Served {
    origin: Origin,
    size: u64,
    xxh3: u64,
}

#[derive(Default)]
struct Table {
    served: BTreeMap<String, Served>,
    /// Checksums by (path, size, modification time): a file served again is not read again.
    known: BTreeMap<(PathBuf, u64, std::time::SystemTime), u64>,
    uploads: Option<PathBuf>,
    /// Where each part a worker cuts away from this disk is stored ([`Files::expect_part`]).
    parts: BTreeMap<usize, PathBuf>,
}

/// What the coordinator serves and where uploads go, shared by every launch of a job (checksums are
/// computed once per file).
#[derive(Clone, Default)]
pub struct Files(Arc<Mutex<Table>>);

impl Files {
    /// Uploads are stored under `job_dir` (see [`Upload::relative_path`]).
    pub fn new(job_dir: Option<PathBuf>) -> Files {
        let files = Files::default();
        files.0.lock().expect("not poisoned").uploads = job_dir;
        files
    }

    /// Serves the file at `path` under `name` and describes it.
    pub fn serve(&self, name: &str, path: &Path) -> std::io::Result<Artifact> {
        let path = std::path::absolute(path)?;
        let meta = std::fs::metadata(&path)?;
        let key = (path.clone(), meta.len(), meta.modified()?);
        let cached = self
            .0
            .lock()
            .expect("not poisoned")
            .known
            .get(&key)
            .copied();
        let (size, xxh3) = match cached {
            Some(h) => (meta.len(), h),
            None => {
                let (size, h) = file_xxh3(&path)?;
                self.0.lock().expect("not poisoned").known.insert(key, h);
                (size, h)
            }
        };
        let served = self.serve_known(name, &path, size, xxh3);
        Ok(Artifact {
            path: Some(path),
            ..served
        })
    }

    /// Serves the file at `path` under `name` with the size and checksum the caller already knows (a
    /// chunked dataset's manifest lists them): nothing is read until a worker asks, and the worker
    /// checks what it got against them as always.
    pub fn serve_known(&self, name: &str, path: &Path, size: u64, xxh3: u64) -> Artifact {
        self.insert(name, Origin::File(path.to_path_buf()), size, xxh3)
    }

    /// Serves `source`'s bytes under `name`, with the size and checksum the caller knows (a manifest's):
    /// they are streamed through when a worker asks, and the worker checks them as always.
    pub fn serve_from(
        &self,
        name: &str,
        source: Arc<dyn Source>,
        size: u64,
        xxh3: u64,
    ) -> Artifact {
        self.insert(name, Origin::Stream(source), size, xxh3)
    }

    fn insert(&self, name: &str, origin: Origin, size: u64, xxh3: u64) -> Artifact {
        self.0
            .lock()
            .expect("not poisoned")
            .served
            .insert(name.to_string(), Served { origin, size, xxh3 });
        Artifact {
            name: name.to_string(),
            size,
            xxh3,
            path: None,
            url: None,
        }
    }

    /// Takes part `part`, uploaded by the worker of that rank ([`Upload::Part`]), into `dest`.
    pub fn expect_part(&self, part: usize, dest: &Path) {
        let mut t = self.0.lock().expect("not poisoned");
        t.parts.insert(part, dest.to_path_buf());
    }

    /// Takes no more parts: the set they belong to is committed (or abandoned).
    pub fn expect_no_parts(&self) {
        self.0.lock().expect("not poisoned").parts.clear();
    }

    fn lookup(&self, name: &str) -> Option<(Origin, u64, u64)> {
        let t = self.0.lock().expect("not poisoned");
        t.served
            .get(name)
            .map(|s| (s.origin.clone(), s.size, s.xxh3))
    }

    /// Where worker `rank`'s upload of `what` goes, or why it is refused.
    fn upload_path(&self, what: Upload, rank: usize) -> Result<PathBuf, String> {
        let t = self.0.lock().expect("not poisoned");
        match what {
            Upload::Part { part } if part != rank => Err(format!(
                "worker {rank} may upload its own part only, not part {part}"
            )),
            Upload::Part { part } => t
                .parts
                .get(&part)
                .cloned()
                .ok_or_else(|| format!("this coordinator expects no part {part}")),
            _ if rank != 0 => Err(format!("worker {rank} may not upload; only rank 0 does")),
            _ => t
                .uploads
                .as_ref()
                .map(|d| d.join(what.relative_path()))
                .ok_or_else(|| "this coordinator takes no uploads".to_string()),
        }
    }
}

/// Where a fetched file's bytes come from: a transfer stream of the control connection, or the body of
/// an HTTP response (a store's signed URL).
pub(crate) trait Incoming {
    /// The next bytes, at most `max`; `None` at the end.
    async fn next(&mut self, max: usize) -> Result<Option<Bytes>, String>;
}

impl Incoming for RecvStream {
    async fn next(&mut self, max: usize) -> Result<Option<Bytes>, String> {
        match self.read_chunk(max, true).await {
            Ok(c) => Ok(c.map(|c| c.bytes)),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Incoming for reqwest::Response {
    async fn next(&mut self, _: usize) -> Result<Option<Bytes>, String> {
        // the URL is a credential: the error is told without it
        self.chunk().await.map_err(http_error)
    }
}

/// Bytes arriving are progress: a worker that fetches a large file at a slow store's pace uses little
/// CPU, and its heartbeat (which counts CPU time) would fall silent and get it stopped as stalled. This
/// beats, at most once a second, while bytes arrive; a fetch that stalls stays silent.
pub(crate) struct Beating<'a, I> {
    inner: &'a mut I,
    beat: crate::channel::Heartbeat,
    last: std::time::Instant,
}

impl<'a, I: Incoming> Beating<'a, I> {
    pub(crate) fn new(inner: &'a mut I, beat: crate::channel::Heartbeat) -> Self {
        Beating {
            inner,
            beat,
            last: std::time::Instant::now(),
        }
    }
}

impl<I: Incoming> Incoming for Beating<'_, I> {
    async fn next(&mut self, max: usize) -> Result<Option<Bytes>, String> {
        let got = self.inner.next(max).await;
        if matches!(got, Ok(Some(_))) && self.last.elapsed() >= std::time::Duration::from_secs(1) {
            self.beat.beat();
            self.last = std::time::Instant::now();
        }
        got
    }
}

/// An HTTP client's error and its causes, without the URL (a signed URL's query is a credential).
fn http_error(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// GETs `url` (a store's signed URL) into `dest` with the announced size and checksum, as a transfer of
/// the control connection is received: whole or absent. Errors name neither the URL nor its signature.
pub(crate) async fn download(
    client: &reqwest::Client,
    url: &crate::messages::SignedUrl,
    (dest, size, xxh3): (&Path, u64, u64),
    beat: crate::channel::Heartbeat,
) -> Result<(), String> {
    let mut response = client.get(url.expose()).send().await.map_err(http_error)?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("{} answered {status}", url.address()));
    }
    if let Some(n) = response.content_length()
        && n != size
    {
        return Err(format!(
            "{} holds {n} bytes, the manifest says {size}",
            url.address()
        ));
    }
    receive_file(&mut Beating::new(&mut response, beat), dest, size, xxh3).await
}

/// Receives exactly `size` bytes from `recv` into `dest` (through a temporary file beside it), checking
/// the checksum; nothing is left at `dest` or beside it on any error.
pub(crate) async fn receive_file(
    recv: &mut impl Incoming,
    dest: &Path,
    size: u64,
    xxh3: u64,
) -> Result<(), String> {
    let dir = dest
        .parent()
        .ok_or_else(|| format!("{}: no parent folder", dest.display()))?;
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| format!("creating {}: {e}", dir.display()))?;
    // unique per transfer: a prefetch and a fetch of the same file may run at once in one process
    static TRANSFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.partial-{}-{}",
        dest.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id(),
        TRANSFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = async {
        // an HTTP body arrives in pieces of a few KiB: each a write of its own would be a blocking-pool
        // round trip; they are gathered into writes of up to a MiB
        let mut file = tokio::io::BufWriter::with_capacity(
            1 << 20,
            tokio::fs::File::create(&tmp)
                .await
                .map_err(|e| format!("creating {}: {e}", tmp.display()))?,
        );
        let mut h = Xxh3::new();
        let mut got = 0u64;
        while got < size {
            let want = CHUNK.min((size - got) as usize);
            let piece = match recv.next(want).await {
                Ok(Some(piece)) => piece,
                Ok(None) => return Err(format!("the stream ended after {got} of {size} bytes")),
                Err(e) => return Err(format!("after {got} of {size} bytes: {e}")),
            };
            if piece.len() as u64 > size - got {
                return Err(format!("more than the announced {size} bytes"));
            }
            h.update(&piece);
            file.write_all(&piece)
                .await
                .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
            got += piece.len() as u64;
        }
        // nothing may follow the announced bytes
        if let Ok(Some(extra)) = recv.next(1).await
            && !extra.is_empty()
        {
            return Err(format!("more than the announced {size} bytes"));
        }
        if h.digest() != xxh3 {
            return Err(format!(
                "checksum mismatch: got xxh3 {:016x}, expected {xxh3:016x}",
                h.digest()
            ));
        }
        file.flush()
            .await
            .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        file.get_ref()
            .sync_all()
            .await
            .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        drop(file);
        tokio::fs::rename(&tmp, dest)
            .await
            .map_err(|e| format!("renaming into {}: {e}", dest.display()))
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
}

/// Sends the file at `path` raw, in chunks, then finishes the stream.
/// With `beat`, beats it at most once a second while bytes leave (a worker's upload to a busy coordinator
/// moves at the coordinator's pace and uses little CPU: see [`Beating`]).
pub(crate) async fn send_file(
    send: &mut SendStream,
    path: &Path,
    size: u64,
    beat: Option<crate::channel::Heartbeat>,
) -> Result<(), String> {
    let mut last = std::time::Instant::now();
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    while sent < size {
        let want = CHUNK.min((size - sent) as usize);
        let n = file
            .read(&mut buf[..want])
            .await
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        if n == 0 {
            return Err(format!("{} shrank while it was sent", path.display()));
        }
        send.write_all(&buf[..n]).await.map_err(|e| e.to_string())?;
        sent += n as u64;
        if let Some(b) = &beat
            && last.elapsed() >= std::time::Duration::from_secs(1)
        {
            b.beat();
            last = std::time::Instant::now();
        }
    }
    send.finish().map_err(|e| e.to_string())
}

/// Sends `size` bytes from `source` raw, then finishes the stream; fewer or more bytes than `size` is an
/// error (the worker, which checks the checksum too, sees the stream reset).
async fn send_stream(
    send: &mut SendStream,
    source: &dyn Source,
    name: &str,
    size: u64,
) -> Result<(), String> {
    let mut rx = source.open();
    let mut sent = 0u64;
    while let Some(chunk) = rx.recv().await {
        let chunk = chunk.map_err(|e| format!("reading {name}: {e}"))?;
        sent += chunk.len() as u64;
        if sent > size {
            return Err(format!("{name} is longer than its {size} bytes"));
        }
        send.write_all(&chunk).await.map_err(|e| e.to_string())?;
    }
    if sent != size {
        return Err(format!("{name} ended after {sent} of its {size} bytes"));
    }
    send.finish().map_err(|e| e.to_string())
}

/// The coordinator's side of one transfer stream of worker `rank`.
pub(crate) async fn serve_stream(
    rank: usize,
    job: u64,
    files: Files,
    mut send: SendStream,
    mut recv: RecvStream,
) -> Result<(), String> {
    let frame = crate::channel::read_frame(&mut recv)
        .await?
        .ok_or("the transfer stream ended before its request")?;
    let request: Request = frame.control_value().map_err(|e| e.to_string())?;
    let reply =
        |r: Reply| physalia_wire::Frame::control(crate::channel::coordinator_header(job), &r);
    match request {
        Request::Get { name } => {
            let Some((origin, size, xxh3)) = files.lookup(&name) else {
                let frame = reply(Reply::Refused {
                    reason: format!("no artifact named {name:?}"),
                })
                .map_err(|e| e.to_string())?;
                crate::channel::write_frame(&mut send, &frame).await?;
                let _ = send.finish();
                return Err(format!(
                    "worker {rank} asked for an unknown artifact {name:?}"
                ));
            };
            let frame = reply(Reply::Sending { size, xxh3 }).map_err(|e| e.to_string())?;
            crate::channel::write_frame(&mut send, &frame).await?;
            let sent = match &origin {
                Origin::File(path) => send_file(&mut send, path, size, None).await,
                Origin::Stream(source) => {
                    send_stream(&mut send, source.as_ref(), &name, size).await
                }
            };
            if let Err(e) = sent {
                // the worker sees a reset stream, not a short file it might take for whole
                let _ = send.reset(quinn::VarInt::from_u32(1));
                return Err(e);
            }
            let _ = send.stopped().await;
            Ok(())
        }
        Request::Put { what, size, xxh3 } => {
            let dest = files.upload_path(what, rank);
            let answer = match dest {
                Ok(dest) => match receive_file(&mut recv, &dest, size, xxh3).await {
                    Ok(()) => Reply::Stored,
                    Err(e) => Reply::Refused {
                        reason: format!("storing {}: {e}", dest.display()),
                    },
                },
                Err(reason) => Reply::Refused { reason },
            };
            let refused = match &answer {
                Reply::Refused { reason } => Some(reason.clone()),
                _ => None,
            };
            let frame = reply(answer).map_err(|e| e.to_string())?;
            crate::channel::write_frame(&mut send, &frame).await?;
            let _ = send.finish();
            let _ = send.stopped().await;
            refused.map_or(Ok(()), Err)
        }
    }
}

/// True when the file at `path` is `artifact`'s bytes.
pub fn holds(path: &Path, artifact: &Artifact) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == artifact.size)
        && file_xxh3(path).is_ok_and(|(size, h)| size == artifact.size && h == artifact.xxh3)
}

/// The file name a fetched artifact gets in a worker's folder: its name with anything but
/// `[A-Za-z0-9._-]` replaced, never hidden, never `..`.
pub fn local_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-".contains(c) || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("a-{s}")
}
