//! The QUIC mesh on loopback: it computes exactly what the in-memory twin computes, and it lets in only
//! members of the job.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use physalia_wire::{
    Dtype, JobCa, Link, MemLink, Phase, QuicEndpoint, QuicLink, QuicOptions, Tag, TlsIdentity,
    Traffic, WireError, all_reduce_sum, all_reduce_sum_f64, client_config, halo_exchange,
    worker_name,
};

const JOB: u64 = 0x0123_4567_89ab_cdef;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn options() -> QuicOptions {
    QuicOptions {
        recv_timeout: Duration::from_secs(30),
        join_timeout: Duration::from_secs(20),
        linger: Duration::from_secs(2),
        ..QuicOptions::default()
    }
}

/// Binds `identities.len()` endpoints, then joins them from one thread each.
fn quic_mesh(
    identities: Vec<TlsIdentity>,
    options: QuicOptions,
) -> Vec<Result<QuicLink, WireError>> {
    let endpoints: Vec<QuicEndpoint> = identities
        .iter()
        .enumerate()
        .map(|(rank, id)| QuicEndpoint::bind(rank, JOB, id, loopback(), options.clone()).unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = endpoints.iter().map(|e| e.local_addr()).collect();
    let handles: Vec<_> = endpoints
        .into_iter()
        .map(|ep| {
            let addrs = addrs.clone();
            thread::spawn(move || ep.join(&addrs))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn job_identities(ca: &JobCa, n: usize) -> Vec<TlsIdentity> {
    (0..n)
        .map(|r| ca.identity(&worker_name(r)).unwrap())
        .collect()
}

/// What one rank computes: halo exchanges both ways (f32 and bf16) and all-reduces (f32, large, and f64).
#[derive(Debug, PartialEq)]
struct Outcome {
    forward: Vec<(usize, Vec<u32>)>,
    backward: Vec<(usize, Vec<u32>)>,
    grads: Vec<u32>,
    scalars: Vec<u64>,
    traffic: Traffic,
}

fn workload<L: Link>(link: &mut L) -> Outcome {
    let (me, world) = (link.rank(), link.world());
    let cols = 16;
    let value = |from: usize, to: usize, i: usize| {
        ((from * 31 + to * 7 + i) as f32).sin() * 10f32.powi((i % 7) as i32 - 3)
    };
    // Rank r sends r + p + 1 rows to peer p.
    let peers: Vec<usize> = (0..world).filter(|&p| p != me).collect();
    let send: Vec<(usize, Vec<f32>)> = peers
        .iter()
        .map(|&p| {
            (
                p,
                (0..(me + p + 1) * cols).map(|i| value(me, p, i)).collect(),
            )
        })
        .collect();
    let recv: Vec<(usize, usize)> = peers.iter().map(|&p| (p, me + p + 1)).collect();
    let bits = |rows: Vec<(usize, Vec<f32>)>| {
        rows.into_iter()
            .map(|(p, v)| (p, v.iter().map(|x| x.to_bits()).collect()))
            .collect()
    };
    let forward = halo_exchange(
        link,
        Tag::new(3, 1, Phase::Forward),
        &send,
        &recv,
        cols,
        Dtype::F32,
    )
    .unwrap();
    for (p, rows) in &forward {
        let expected: Vec<f32> = (0..rows.len()).map(|i| value(*p, me, i)).collect();
        assert_eq!(rows, &expected);
    }
    let backward = halo_exchange(
        link,
        Tag::new(3, 1, Phase::Backward),
        &send,
        &recv,
        cols,
        Dtype::BF16,
    )
    .unwrap();
    // 1 MiB of gradients: several QUIC flow-control windows' worth of chunks.
    let mut grads: Vec<f32> = (0..(1 << 18) + 3).map(|i| value(me, me, i)).collect();
    all_reduce_sum(link, Tag::all_reduce(3, 0), &mut grads).unwrap();
    let mut scalars = vec![me as f64 * 0.1, 1.0, 1e-17];
    all_reduce_sum_f64(link, Tag::all_reduce(3, u16::MAX), &mut scalars).unwrap();
    Outcome {
        forward: bits(forward),
        backward: bits(backward),
        grads: grads.iter().map(|x| x.to_bits()).collect(),
        scalars: scalars.iter().map(|x| x.to_bits()).collect(),
        traffic: link.traffic().clone(),
    }
}

#[test]
fn three_rank_quic_mesh_matches_the_in_memory_twin_bit_for_bit() {
    let ca = JobCa::new("job-mesh").unwrap();
    let quic: Vec<_> = quic_mesh(job_identities(&ca, 3), options())
        .into_iter()
        .map(|link| {
            let mut link = link.unwrap();
            thread::spawn(move || workload(&mut link))
        })
        .collect();
    let quic: Vec<Outcome> = quic.into_iter().map(|h| h.join().unwrap()).collect();
    let mem: Vec<_> = MemLink::mesh_for_job(JOB, 3)
        .into_iter()
        .map(|mut link| thread::spawn(move || workload(&mut link)))
        .collect();
    let mem: Vec<Outcome> = mem.into_iter().map(|h| h.join().unwrap()).collect();
    for rank in 0..3 {
        assert_eq!(quic[rank], mem[rank], "rank {rank}");
        // Bitwise identical everywhere.
        assert_eq!(quic[rank].grads, quic[0].grads);
        assert_eq!(quic[rank].scalars, quic[0].scalars);
    }
    // bf16 halves the payload of the same rows.
    let (fwd, _) = quic[0].traffic.get(1, Phase::Forward);
    let (bwd, _) = quic[0].traffic.get(1, Phase::Backward);
    assert_eq!(fwd.payload_bytes, 2 * bwd.payload_bytes);
}

/// Polls `ep`'s refusals until there is one, or fails after 10 s.
fn first_refusal(refusals: impl Fn() -> Vec<physalia_wire::Refusal>) -> physalia_wire::Refusal {
    let start = Instant::now();
    loop {
        if let Some(r) = refusals().into_iter().next() {
            return r;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no refusal recorded"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Connects to `server` as an outsider with `config` and tries to say hello; returns what the outsider saw.
fn intrude(server: SocketAddr, config: rustls::ClientConfig) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(config).unwrap();
        let mut endpoint = quinn::Endpoint::client(loopback()).unwrap();
        endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
        let attempt = async {
            let conn = endpoint
                .connect(server, "worker-0")
                .unwrap()
                .await
                .map_err(|e| e.to_string())?;
            // TLS 1.3 lets the client finish before the server has judged its certificate: push a stream
            // and wait for the verdict.
            let (mut send, _recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            let _ = send.write_all(b"PHYW").await;
            Err::<(), String>(conn.closed().await.to_string())
        };
        let outcome = tokio::time::timeout(Duration::from_secs(10), attempt).await;
        format!("{outcome:?}")
    })
}

#[test]
fn a_certificate_from_another_jobs_ca_is_refused() {
    let ca = JobCa::new("job-a").unwrap();
    let other = JobCa::new("job-b").unwrap();
    let member = ca.identity(&worker_name(0)).unwrap();
    let ep = QuicEndpoint::bind(0, JOB, &member, loopback(), options()).unwrap();
    // The worst case: the outsider trusts our CA (its certificate is public) and holds a certificate with a
    // member's name, but issued by another job's CA.
    let (cert_pem, key_pem) = other.issue(&worker_name(1)).unwrap();
    let outsider = TlsIdentity {
        ca_pem: ca.cert_pem(),
        cert_pem,
        key_pem,
    };
    let seen = intrude(ep.local_addr(), client_config(&outsider).unwrap());
    let refusal = first_refusal(|| ep.refusal_log());
    assert_eq!(ep.refusals(), 1);
    assert!(refusal.reason.contains("handshake failed"), "{refusal:?}");
    assert!(refusal.reason.contains("UnknownIssuer"), "{refusal:?}");
    assert!(seen.contains("Err"), "the outsider got through: {seen}");
}

#[test]
fn a_client_without_a_certificate_is_refused() {
    let ca = JobCa::new("job-a").unwrap();
    let ep = QuicEndpoint::bind(
        0,
        JOB,
        &ca.identity(&worker_name(0)).unwrap(),
        loopback(),
        options(),
    )
    .unwrap();
    physalia_wire::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::pem::PemObject::pem_slice_iter(ca.cert_pem().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![physalia_wire::tls::ALPN.to_vec()];
    let seen = intrude(ep.local_addr(), config);
    let refusal = first_refusal(|| ep.refusal_log());
    assert_eq!(ep.refusals(), 1);
    assert!(
        refusal.reason.contains("peer sent no certificates"),
        "{refusal:?}"
    );
    assert!(seen.contains("Err"), "the outsider got through: {seen}");
}

#[test]
fn a_member_claiming_another_rank_is_refused() {
    let ca = JobCa::new("job-a").unwrap();
    // Rank 0's process holds worker-5's certificate: valid for the job, wrong for the rank it claims.
    let identities = [
        ca.identity(&worker_name(5)).unwrap(),
        ca.identity(&worker_name(1)).unwrap(),
    ];
    let endpoints: Vec<QuicEndpoint> = identities
        .iter()
        .enumerate()
        .map(|(rank, id)| {
            let options = QuicOptions {
                join_timeout: Duration::from_secs(2),
                ..options()
            };
            QuicEndpoint::bind(rank, JOB, id, loopback(), options).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = endpoints.iter().map(|e| e.local_addr()).collect();
    let mut endpoints = endpoints.into_iter();
    let impostor = endpoints.next().unwrap();
    let honest = endpoints.next().unwrap();
    let impostor = {
        let addrs = addrs.clone();
        thread::spawn(move || impostor.join(&addrs))
    };
    let refusal = first_refusal(|| honest.refusal_log());
    assert!(
        refusal
            .reason
            .contains("claims rank 0 but its certificate is not for worker-0"),
        "{refusal:?}"
    );
    let err = honest.join(&addrs).err().unwrap().to_string();
    assert!(err.contains("ranks [0] did not connect"), "{err}");
    assert!(impostor.join().unwrap().is_err());
}

#[test]
fn a_silent_peer_times_out_and_a_closed_one_is_lost() {
    let ca = JobCa::new("job-a").unwrap();
    let options = QuicOptions {
        linger: Duration::from_millis(300),
        ..options()
    };
    let mut links: Vec<QuicLink> = quic_mesh(job_identities(&ca, 2), options)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // while rank 0 waits, another thread (a heartbeat's) reads whom it waits on; after, nobody
    let waiting = links[0].waiting();
    assert_eq!(waiting.peer(), None);
    let watcher = {
        let waiting = waiting.clone();
        thread::spawn(move || {
            let until = std::time::Instant::now() + Duration::from_millis(150);
            let mut seen = None;
            while seen.is_none() && std::time::Instant::now() < until {
                seen = waiting.peer();
            }
            seen
        })
    };
    let err = links[0]
        .recv_timeout(1, Duration::from_millis(200))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "timed out after 200ms waiting for rank 1 to send a frame"
    );
    assert_eq!(watcher.join().unwrap(), Some(1));
    assert_eq!(waiting.peer(), None, "the wait ended");
    links.pop(); // rank 1 closes
    let err = links[0]
        .recv_timeout(1, Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(err, WireError::PeerLost { peer: 1, .. }), "{err}");
}

/// A worker whose peer dies while the mesh forms is aborted by its coordinator: the join (dialling a
/// rank that never answers, or waiting for one to dial it) ends with the abort, not at the join timeout,
/// and the fixed mesh port binds again for the next mesh.
#[test]
fn an_aborted_join_ends_at_once_and_releases_its_port() {
    let ca = JobCa::new("job-a").unwrap();
    // rank 1 of 3 never comes: rank 0 dials it, rank 2 waits for it to dial
    let silent: SocketAddr = {
        let s = std::net::UdpSocket::bind(loopback()).unwrap();
        s.local_addr().unwrap()
    };
    for me in [0usize, 2] {
        let id = ca.identity(&worker_name(me)).unwrap();
        let endpoint = QuicEndpoint::bind(me, JOB, &id, loopback(), options()).unwrap();
        let port = endpoint.local_addr();
        let mut peers = vec![silent; 3];
        peers[me] = port;
        let abort = endpoint.abort_handle();
        let aborter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            abort.abort();
            abort
        });
        let t = Instant::now();
        let err = match endpoint.join(&peers) {
            Ok(_) => panic!("rank {me} joined a mesh whose rank 1 never came"),
            Err(e) => e,
        };
        let handle = aborter.join().unwrap();
        assert!(matches!(err, WireError::Join(_)), "rank {me}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "rank {me}: the join ended with the abort, not its 20 s timeout ({:?}): {err}",
            t.elapsed()
        );
        // the handle does not hold the socket of an endpoint that never became a link
        let again = QuicEndpoint::bind(me, JOB, &id, port, options()).unwrap();
        assert_eq!(again.local_addr(), port);
        handle.abort();
    }
}

#[test]
fn an_aborted_link_stops_waiting_at_once_and_its_peer_sees_it_closed() {
    let ca = JobCa::new("job-a").unwrap();
    let options = QuicOptions {
        linger: Duration::from_millis(300),
        ..options()
    };
    let mut links: Vec<QuicLink> = quic_mesh(job_identities(&ca, 3), options)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // rank 0 waits for rank 2, which is silent (as a killed peer is); another thread aborts rank 0
    let abort = links[0].abort_handle();
    let aborter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        abort.abort();
    });
    let t = Instant::now();
    let err = links[0]
        .recv_timeout(2, Duration::from_secs(30))
        .unwrap_err();
    aborter.join().unwrap();
    assert!(matches!(err, WireError::PeerLost { peer: 2, .. }), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the wait ended with the abort, not its 30 s timeout ({:?})",
        t.elapsed()
    );
    // sending on the aborted link fails too, once the writer saw the close
    let frame = physalia_wire::Frame::control(
        physalia_wire::FrameHeader::control(0, JOB),
        &serde_json::json!({"x": 1}),
    )
    .unwrap();
    let mut sent = Ok(());
    for _ in 0..50 {
        sent = links[0].send(1, frame.clone());
        if sent.is_err() {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    assert!(sent.is_err(), "a send on an aborted link fails");
    // rank 1, waiting for rank 0, sees its link closed rather than waiting out its timeout
    let err = links[1]
        .recv_timeout(0, Duration::from_secs(30))
        .unwrap_err();
    assert!(matches!(err, WireError::PeerLost { peer: 0, .. }), "{err}");
    // a second abort, and dropping the aborted link, are harmless
    let handle = links[0].abort_handle();
    handle.abort();
    let port = links[0].local_addr();
    drop(links);
    // the handle does not hold the socket: the port binds again (a resized worker's fixed mesh port)
    let id = ca.identity(&worker_name(0)).unwrap();
    let again = QuicEndpoint::bind(0, JOB, &id, port, crate::options()).unwrap();
    assert_eq!(again.local_addr(), port);
    handle.abort();
}
