//! Bulk throughput of one QUIC link between two endpoints of this process over loopback, at each of the
//! given largest UDP payloads that path MTU discovery may probe for (`QuicOptions::max_udp_payload`).
//!
//! `cargo run --release -p physalia-wire --example loopback -- MIB PAYLOAD...` (e.g. `512 1452 8952 65527`):
//! each payload's line gives MB/s (the median of three transfers of MIB MiB in 4 MiB frames).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use physalia_wire::{
    Dtype, Frame, FrameHeader, JobCa, Link, Phase, QuicEndpoint, QuicOptions, worker_name,
};

fn transfer(mib: usize, max_udp_payload: u16) -> Result<f64, Box<dyn std::error::Error>> {
    let ca = JobCa::new("loopback")?;
    let job = ca.job_key();
    let ids = [ca.identity(&worker_name(0))?, ca.identity(&worker_name(1))?];
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let options = QuicOptions {
        recv_timeout: Duration::from_secs(120),
        max_udp_payload,
        ..QuicOptions::default()
    };
    let e0 = QuicEndpoint::bind(0, job, &ids[0], any, options.clone())?;
    let e1 = QuicEndpoint::bind(1, job, &ids[1], any, options)?;
    let addrs = vec![e0.local_addr(), e1.local_addr()];
    let chunk = 1 << 20; // floats: 4 MiB a frame
    let frames = (mib / 4).max(1);
    let header = move |sender: u16| FrameHeader {
        sender,
        job,
        epoch: 0,
        layer: 0,
        phase: Phase::Forward,
        dtype: Dtype::F32,
        rows: 0,
        cols: 0,
    };
    let a1 = addrs.clone();
    let peer = std::thread::spawn(move || -> Result<(), String> {
        let mut link = e1.join(&a1).map_err(|e| e.to_string())?;
        for _ in 0..frames {
            link.recv(0).map_err(|e| e.to_string())?;
        }
        let done = Frame::tensor(header(1), &[0.0], 1, 1).map_err(|e| e.to_string())?;
        link.send(0, done).map_err(|e| e.to_string())?;
        Ok(())
    });
    let mut link = e0.join(&addrs)?;
    let data = vec![1.0f32; chunk];
    let t0 = Instant::now();
    for _ in 0..frames {
        link.send(1, Frame::tensor(header(0), &data, chunk, 1)?)?;
    }
    link.recv(1)?;
    let s = t0.elapsed().as_secs_f64();
    peer.join().map_err(|_| "the receiving thread panicked")??;
    Ok((frames * chunk * 4) as f64 / s / 1e6)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: loopback MIB PAYLOAD...";
    let mib: usize = args.first().ok_or(usage)?.parse()?;
    for p in &args[1..] {
        let payload: u16 = p.parse()?;
        let mut rates = (0..3)
            .map(|_| transfer(mib, payload))
            .collect::<Result<Vec<_>, _>>()?;
        rates.sort_by(f64::total_cmp);
        println!(
            "max UDP payload {payload:5}: {:7.0} MB/s (min {:.0}, max {:.0})",
            rates[1], rates[0], rates[2]
        );
    }
    Ok(())
}
