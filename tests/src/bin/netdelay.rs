//! `netdelay`: network delay without `sch_netem`, for `tests/network_faults.rs`. It binds a netfilter
//! queue in the network namespace it runs in (start it with `nsenter -t PID -n`), holds every packet that
//! iptables' `NFQUEUE` target hands it for a fixed time and then accepts it, dropping a seeded random
//! fraction instead. Verdicts by packet id may come in any order and at any time, so the queue is a FIFO of
//! held packets and nothing is copied but their metadata (copy range 0).
//!
//! ```text
//! netdelay QUEUE DELAY_MS LOSS STATS_FILE
//! ```
//!
//! Every 100 ms it rewrites `STATS_FILE` (whole, renamed into place):
//! `held H dropped D max_held_ms M`: packets accepted after the delay, packets dropped, and the longest a
//! packet was held, so a test can tell that the delay was real. It runs until it is killed; the rules that
//! feed it should say `--queue-bypass`, so packets pass undelayed once it is gone.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nfq::{Message, Queue, Verdict};

struct Args {
    queue: u16,
    delay: Duration,
    loss: f64,
    stats: PathBuf,
}

fn args() -> Result<Args, String> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let [queue, delay_ms, loss, stats] = a.as_slice() else {
        return Err("usage: netdelay QUEUE DELAY_MS LOSS STATS_FILE".into());
    };
    let loss: f64 = loss.parse().map_err(|e| format!("LOSS {loss:?}: {e}"))?;
    if !(0.0..=1.0).contains(&loss) {
        return Err(format!("LOSS {loss} is not a fraction"));
    }
    Ok(Args {
        queue: queue.parse().map_err(|e| format!("QUEUE {queue:?}: {e}"))?,
        delay: Duration::from_millis(
            delay_ms
                .parse()
                .map_err(|e| format!("DELAY_MS {delay_ms:?}: {e}"))?,
        ),
        loss,
        stats: PathBuf::from(stats),
    })
}

#[derive(Default)]
struct Stats {
    held: u64,
    dropped: u64,
    max_held: Duration,
}

impl Stats {
    fn write(&self, path: &Path) {
        let tmp = path.with_extension("tmp");
        let line = format!(
            "held {} dropped {} max_held_ms {}\n",
            self.held,
            self.dropped,
            self.max_held.as_millis()
        );
        if std::fs::write(&tmp, line).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

/// xorshift64*: the loss pattern is a function of the seed and the packet order.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn run(a: Args) -> std::io::Result<()> {
    let mut q = Queue::open()?;
    q.bind(a.queue)?;
    // metadata only: an accepted packet goes on as the kernel holds it, so no payload is copied
    q.set_copy_range(a.queue, 0)?;
    // more than the packets of a delay's worth of traffic; past it the kernel drops (and counts) them
    q.set_queue_max_len(a.queue, 65536)?;
    q.set_nonblocking(true);
    let mut held: VecDeque<(Instant, Message)> = VecDeque::new();
    let mut stats = Stats::default();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(a.queue));
    let mut last_write = Instant::now();
    stats.write(&a.stats);
    loop {
        loop {
            match q.recv() {
                Ok(m) => held.push_back((Instant::now(), m)),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // the answer to a verdict for a packet the kernel let go of (its device went away
                // with the container): nothing to do
                Err(e) if e.raw_os_error() == Some(ENOENT) => continue,
                Err(e) => return Err(e),
            }
        }
        let now = Instant::now();
        while let Some((at, _)) = held.front() {
            if now.duration_since(*at) < a.delay {
                break;
            }
            let (at, mut m) = held.pop_front().expect("the front exists");
            if rng.unit() < a.loss {
                m.set_verdict(Verdict::Drop);
                stats.dropped += 1;
            } else {
                m.set_verdict(Verdict::Accept);
                stats.held += 1;
                stats.max_held = stats.max_held.max(now.duration_since(at));
            }
            match q.verdict(m) {
                // the kernel let go of the packet (its device went away with the container)
                Err(e) if e.raw_os_error() == Some(ENOENT) => {}
                r => r?,
            }
        }
        if now.duration_since(last_write) >= Duration::from_millis(100) {
            stats.write(&a.stats);
            last_write = now;
        }
        // the hold's granularity: a packet waits its delay plus at most this
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Linux's ENOENT: a verdict for a packet id the kernel no longer holds.
const ENOENT: i32 = 2;

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("netdelay: {e}");
            return ExitCode::from(2);
        }
    };
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("netdelay: {e}");
            ExitCode::FAILURE
        }
    }
}
