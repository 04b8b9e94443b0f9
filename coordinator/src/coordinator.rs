//! The coordinator of a multi-worker job, as a state machine: it is fed [`Event`]s (a worker registered,
//! reported an epoch, finished, failed, lost its connection, exited; or just time passing) with the time
//! they happened, and answers with [`Action`]s (send the assignments, an epoch is complete, the job
//! finished, the job failed with this one error). It owns no sockets, processes or clock, so its failure
//! handling is tested with plain values; `distributed.rs` is the IO shell around it.
//!
//! Failure handling: every wait is bounded. Registration must complete within the registration timeout,
//! and during training every worker must be heard (an epoch, or the heartbeat it sends while it computes)
//! within the epoch timeout of its previous message. When a
//! worker fails, its peers usually fail soon after (they lose it mid-exchange), so the first failure opens
//! a short grace window ([`FAILURE_GRACE`]) in which further evidence is collected; then the most direct
//! cause is reported, in this order: a worker killed by a signal, a worker that exited or vanished without
//! saying why, a worker that reported an error, a worker that went silent, and last a worker that could
//! not reach its peers (stalled by a frozen peer or a cut link; retried like a lost worker). A worker
//! sends its summary and then exits, and the exit may be noticed first: a summary arriving within the
//! window withdraws its own worker's exit (not a signal) from the evidence. A worker killed by a signal
//! is the most direct cause there is: once one is seen the window closes after [`SIGNAL_GRACE`] (long
//! enough for workers killed together to be seen together, so two lost workers are not taken for one).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use physalia_gnn::{EpochMetrics, TrainSummary};

/// How long to collect evidence after the first sign of failure before naming the cause.
pub const FAILURE_GRACE: Duration = Duration::from_millis(1500);

/// The grace once a worker killed by a signal is among the evidence: nothing names a cause better, so
/// only other workers killed at the same moment are waited for (a platform reports them in one answer;
/// local processes are polled continuously).
pub const SIGNAL_GRACE: Duration = Duration::from_millis(250);

/// A worker's control round trip at least this long, and [`SLOW_RTT_FACTOR`] times every other
/// worker's, marks it as the one behind a slow network when a silence is to be blamed: a region's or a
/// cluster network's round trips are a few milliseconds, and QUIC's estimate before any sample is 333 ms,
/// above this, but every beat comes after the handshake's samples.
const SLOW_RTT: Duration = Duration::from_millis(100);
const SLOW_RTT_FACTOR: u32 = 5;

#[derive(Debug, Clone)]
pub enum Event {
    Registered {
        rank: usize,
        pid: u32,
        mesh_addr: SocketAddr,
    },
    Epoch {
        rank: usize,
        metrics: EpochMetrics,
    },
    Done {
        rank: usize,
        summary: TrainSummary,
        peak_rss_bytes: Option<u64>,
    },
    Failed {
        rank: usize,
        error: String,
    },
    /// The worker's heartbeat: it is computing, inside an epoch however long. `rtt`: its control
    /// connection's round-trip time when the beat arrived.
    Alive {
        rank: usize,
        rtt: Duration,
    },
    /// The worker is blocked waiting for a frame from its peer `on` (its heartbeat while it uses no CPU):
    /// not progress, but whom its silence is to be blamed on. `rtt` as for `Alive`.
    Waiting {
        rank: usize,
        on: usize,
        rtt: Duration,
    },
    /// The worker could not exchange with its peers (its report of a network or peer fault).
    PeerLost {
        rank: usize,
        error: String,
    },
    /// The worker's control connection ended.
    Lost {
        rank: usize,
        reason: String,
    },
    /// The worker's process ended: `how` is e.g. `exited with signal 9` or `exited with code 1`.
    Exited {
        rank: usize,
        how: String,
        by_signal: bool,
    },
    /// Nothing happened; lets timeouts fire.
    Tick,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Every worker registered: send each the assignment with these mesh addresses (by rank).
    Assign { peers: Vec<SocketAddr> },
    /// Every worker reported `epoch`: their metrics by rank.
    EpochComplete {
        epoch: usize,
        by_rank: Vec<EpochMetrics>,
    },
    /// Every worker finished; their summaries and peak memory by rank.
    Finished {
        summaries: Vec<TrainSummary>,
        peak_rss_bytes: Vec<Option<u64>>,
    },
    /// The launch failed: stop and kill every worker, report this. `lost`: the cause is a worker that
    /// died, vanished or went silent (worth retrying from the last checkpoint), not an error a worker
    /// reported about its own work (bad data, a bad setting: retrying would fail the same way).
    Fail { error: String, lost: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Registering,
    Training,
    Over,
}

#[derive(Debug, Default, Clone)]
struct Worker {
    pid: Option<u32>,
    mesh_addr: Option<SocketAddr>,
    last_heard: Option<Instant>,
    /// Last epoch reported.
    epoch: usize,
    done: Option<(TrainSummary, Option<u64>)>,
    reported_error: Option<String>,
    /// It reported that it could not reach its peers; its exit and lost connection are explained by that.
    peer_lost: bool,
    /// The peer it last said it waits on, and when; cleared when it beats (computes) again.
    waits_on: Option<(usize, Instant)>,
    /// Its control connection's round-trip time at its latest beat or wait.
    rtt: Option<Duration>,
    /// Its process ended or its control connection did, before it finished.
    gone: bool,
}

/// A sign of failure, collected through the grace.
struct Evidence {
    /// Lower is a more direct cause.
    priority: u8,
    message: String,
    /// The worker whose process or control connection ending it reports.
    ended: Option<usize>,
    /// That end is an exit without a signal: the worker's summary, arriving after it, withdraws it.
    exit: bool,
}

pub struct Coordinator {
    world: usize,
    register_timeout: Duration,
    epoch_timeout: Duration,
    started: Instant,
    stage: Stage,
    workers: Vec<Worker>,
    /// Reports of epochs not yet complete, by epoch then rank.
    pending: std::collections::BTreeMap<usize, Vec<Option<EpochMetrics>>>,
    evidence: Vec<Evidence>,
    failing_since: Option<Instant>,
    /// The one worker a silence is blamed on, where the evidence names exactly one: the rank every other
    /// silent worker waits on (directly or through a chain), or the only silent worker.
    stalled_by: Option<usize>,
    /// The epoch the launch continues after (0: from scratch): its workers' first epoch is the next.
    resumed: usize,
}

impl Coordinator {
    pub fn new(
        world: usize,
        register_timeout: Duration,
        epoch_timeout: Duration,
        now: Instant,
    ) -> Coordinator {
        Coordinator {
            world,
            register_timeout,
            epoch_timeout,
            started: now,
            stage: Stage::Registering,
            workers: vec![Worker::default(); world],
            pending: Default::default(),
            evidence: Vec::new(),
            failing_since: None,
            stalled_by: None,
            resumed: 0,
        }
    }

    /// The launch continues after epoch `epoch` (a resize, a replacement, a restart from a checkpoint):
    /// its workers have reported up to it, and a failure before their first report is in the next.
    pub fn resume_after(&mut self, epoch: usize) {
        self.resumed = epoch;
        for w in &mut self.workers {
            w.epoch = epoch;
        }
    }

    /// The process id a worker registered with, if it did.
    pub fn set_pid(&mut self, rank: usize, pid: u32) {
        if let Some(w) = self.workers.get_mut(rank) {
            w.pid = Some(pid);
        }
    }

    /// The workers whose process or control connection ended before they finished, by rank.
    pub fn gone(&self) -> Vec<usize> {
        (0..self.world).filter(|&r| self.workers[r].gone).collect()
    }

    /// The workers lost to the launch: those [`Self::gone`], else the one worker a silence is blamed on
    /// (frozen, or cut off, while every other silent worker waits on it). A silent worker's process may
    /// still run: whoever replaces it stops it first.
    pub fn lost(&self) -> Vec<usize> {
        let gone = self.gone();
        if !gone.is_empty() {
            return gone;
        }
        self.stalled_by.into_iter().collect()
    }

    /// Whether the workers were assigned (training had started) when the launch ended or now.
    pub fn was_training(&self) -> bool {
        self.workers.iter().all(|w| w.mesh_addr.is_some())
    }

    #[cfg(test)]
    pub fn is_over(&self) -> bool {
        self.stage == Stage::Over
    }

    fn who(&self, rank: usize) -> String {
        match self.workers[rank].pid {
            Some(pid) => format!("worker {rank} (pid {pid})"),
            None => format!("worker {rank}"),
        }
    }

    fn when(&self, rank: usize) -> String {
        let w = &self.workers[rank];
        match self.stage {
            _ if w.done.is_some() => "after finishing".into(),
            Stage::Registering => "before training started".into(),
            _ => format!("during epoch {}", w.epoch + 1),
        }
    }

    fn suspect(&mut self, now: Instant, priority: u8, message: String) {
        self.push_evidence(now, priority, message, None, false);
    }

    /// Evidence that worker `rank`'s process ended (`exit`: without a signal) or its connection did. A
    /// worker sends its summary and then exits; the exit can be seen before the summary arrives, so that
    /// summary withdraws the evidence of an exit.
    fn suspect_end(
        &mut self,
        now: Instant,
        priority: u8,
        message: String,
        rank: usize,
        exit: bool,
    ) {
        self.push_evidence(now, priority, message, Some(rank), exit);
    }

    fn push_evidence(
        &mut self,
        now: Instant,
        priority: u8,
        message: String,
        ended: Option<usize>,
        exit: bool,
    ) {
        self.evidence.push(Evidence {
            priority,
            message,
            ended,
            exit,
        });
        self.failing_since.get_or_insert(now);
    }

    /// Which workers make progress: those heard from within the epoch timeout (a beat, an epoch), and
    /// those waiting (by a wait reported within it) on a worker that makes progress, through chains of
    /// waits. A cycle of waits with nobody computing in it (a cut link, a delayed worker waiting on its
    /// waiters) makes no progress.
    fn progressing(&self, now: Instant) -> Vec<bool> {
        let recent = |t: Instant| now.duration_since(t) <= self.epoch_timeout;
        let mut progressing: Vec<bool> = self
            .workers
            .iter()
            .map(|w| w.waits_on.is_none() && w.last_heard.is_some_and(recent))
            .collect();
        // each pass adds the waiters of the last pass's workers; a chain is at most `world` long
        for _ in 0..self.world {
            let mut grew = false;
            for r in 0..self.world {
                if progressing[r] {
                    continue;
                }
                if let Some(on) = self.waits(r, now)
                    && progressing[on]
                {
                    progressing[r] = true;
                    grew = true;
                }
            }
            if !grew {
                break;
            }
        }
        progressing
    }

    /// The rank the silent workers wait on, by their latest waits (reported within the epoch timeout):
    /// the one most of them wait on directly, then through chains of waits, then the longest silent. A
    /// worker blocked on a peer beats not at all (it uses no CPU), so its silence says only that it
    /// waits; the peer named by the waits (a delayed, frozen or cut-off worker) is the cause.
    fn waited_on(&self, silent: &[usize], now: Instant) -> Option<(usize, Vec<usize>)> {
        let on = |r: usize| self.waits(r, now);
        // a worker behind a delaying network waits on its peers as they wait on it (its frames in are
        // late too), and a peer whose accept it waits on waits passively, unmarked, so the waits alone
        // can point past it; its round trip to the coordinator, far above everyone else's, does not
        if let Some((slow, _, _)) = self.slow_link()
            && silent
                .iter()
                .any(|&r| r == slow || self.waits_through(r, slow, now))
        {
            let waiters = silent
                .iter()
                .copied()
                .filter(|&r| on(r) == Some(slow))
                .collect();
            return Some((slow, waiters));
        }
        let mut waiters: Vec<Vec<usize>> = vec![Vec::new(); self.world];
        // behind the direct waits, whom each silent worker waits on through a chain of waits (`a`
        // waits on `b`, which waits on `c`: `c` stalls both), each rank once
        let mut through = vec![0usize; self.world];
        for &r in silent {
            let Some(first) = on(r) else { continue };
            waiters[first].push(r);
            let mut seen = vec![false; self.world];
            seen[r] = true;
            let mut next = Some(first);
            while let Some(n) = next.filter(|&n| !seen[n]) {
                seen[n] = true;
                through[n] += 1;
                next = on(n);
            }
        }
        // the most direct waiters, then the most waiters through chains, then the longest silent
        // (`silent` is ordered longest silent first; max_by_key keeps the last maximum, hence Reverse)
        let order = |r: usize| silent.iter().position(|&s| s == r).unwrap_or(silent.len());
        (0..self.world)
            .filter(|&r| !waiters[r].is_empty())
            .max_by_key(|&r| (waiters[r].len(), through[r], std::cmp::Reverse(order(r))))
            .map(|r| (r, std::mem::take(&mut waiters[r])))
    }

    /// The unfinished worker whose control connection's round trip is far above every other's (at
    /// least [`SLOW_RTT`] and [`SLOW_RTT_FACTOR`] times the others' largest), with its round trip and
    /// the others' largest: a worker behind a slow or lossy network (a delayed link, a congested or
    /// distant host). None while fewer than two round trips are known.
    fn slow_link(&self) -> Option<(usize, Duration, Duration)> {
        let known: Vec<(usize, Duration)> = (0..self.world)
            .filter(|&r| self.workers[r].done.is_none())
            .filter_map(|r| self.workers[r].rtt.map(|rtt| (r, rtt)))
            .collect();
        let &(slow, rtt) = known.iter().max_by_key(|(_, rtt)| *rtt)?;
        let others = known
            .iter()
            .filter(|(r, _)| *r != slow)
            .map(|(_, rtt)| *rtt)
            .max()?;
        (rtt >= SLOW_RTT && rtt >= others * SLOW_RTT_FACTOR).then_some((slow, rtt, others))
    }

    /// Whether `r` waits on `cause`, directly or through a chain of waits reported within the epoch
    /// timeout.
    fn waits_through(&self, r: usize, cause: usize, now: Instant) -> bool {
        let mut at = r;
        for _ in 0..self.world {
            match self.waits(at, now) {
                Some(on) if on == cause => return true,
                Some(on) => at = on,
                None => return false,
            }
        }
        false
    }

    /// The peer `r` waits on now, by its latest wait reported within the epoch timeout.
    fn mesh_wait(&self, r: usize, now: Instant) -> Option<usize> {
        self.workers[r]
            .waits_on
            .filter(|(_, at)| now.duration_since(*at) <= self.epoch_timeout)
            .map(|(on, _)| on)
    }

    /// Whom `r` waits on now: the peer of its [`Self::mesh_wait`], else, when it reported an epoch an
    /// unfinished worker has not, the worker furthest behind (the longest silent of those). Workers
    /// train in lockstep, so one that is an epoch ahead cannot go on without the others: a gated worker
    /// waits for its launch's word, which waits for the epoch's last report, blocked on the control
    /// stream rather than on a peer (so it reports no wait) and using no CPU (so it beats not at all).
    fn waits(&self, r: usize, now: Instant) -> Option<usize> {
        self.mesh_wait(r, now).or_else(|| self.behind(r))
    }

    /// The unfinished worker furthest behind `r` (the longest silent of those), if `r` reported an
    /// epoch it has not.
    fn behind(&self, r: usize) -> Option<usize> {
        let ahead = self.workers[r].epoch;
        (0..self.world)
            .filter(|&q| q != r && self.workers[q].done.is_none() && self.workers[q].epoch < ahead)
            .min_by_key(|&q| (self.workers[q].epoch, self.workers[q].last_heard))
    }

    /// The failure line for `silent` (every worker silent past the timeout, longest silent first).
    /// `waited`: whom they wait on and its direct waiters ([`Self::waited_on`]).
    fn silence(
        &self,
        silent: &[usize],
        waited: Option<(usize, Vec<usize>)>,
        now: Instant,
    ) -> String {
        let timeout = self.epoch_timeout.as_secs_f64();
        let names = |ranks: &[usize]| {
            ranks
                .iter()
                .map(|&r| format!("worker {r}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let Some((cause, waiters)) = waited else {
            let (&first, others) = silent.split_first().expect("some worker is silent");
            let mut msg = format!(
                "{} sent nothing for {timeout} s {}",
                self.who(first),
                self.when(first)
            );
            if !others.is_empty() {
                msg.push_str(&format!(
                    " (silent too: {}; a frozen worker or a cut link stalls its peers)",
                    names(others)
                ));
            }
            return msg;
        };
        let mut msg = if silent.contains(&cause) {
            format!(
                "{} sent nothing for {timeout} s {}",
                self.who(cause),
                self.when(cause)
            )
        } else {
            // it computes, but its peers have waited on it longer than the timeout
            format!(
                "{} kept its peers waiting for more than {timeout} s {}",
                self.who(cause),
                self.when(cause)
            )
        };
        let others: Vec<usize> = silent
            .iter()
            .copied()
            .filter(|r| *r != cause && !waiters.contains(r))
            .collect();
        // waits on the mesh, and workers an epoch ahead waiting for the epoch's last report
        let (on_mesh, ahead): (Vec<usize>, Vec<usize>) = waiters
            .iter()
            .partition(|&&r| self.mesh_wait(r, now) == Some(cause));
        let endpoint = self.workers[cause].mesh_addr;
        let mut why = Vec::new();
        if let Some((slow, rtt, others)) = self.slow_link()
            && slow == cause
        {
            // a network's round trips are often under a millisecond
            let ms = |d: Duration| match d.as_secs_f64() * 1e3 {
                ms if ms < 10.0 => format!("{ms:.1} ms"),
                ms => format!("{ms:.0} ms"),
            };
            why.push(format!(
                "its round trip to the coordinator takes {}, the other workers' at most {}",
                ms(rtt),
                ms(others)
            ));
        }
        if !on_mesh.is_empty() {
            why.push(match endpoint {
                Some(addr) => format!(
                    "{} waited on it at its mesh endpoint {addr}",
                    names(&on_mesh)
                ),
                None => format!("{} waited on it", names(&on_mesh)),
            });
        }
        if !ahead.is_empty() {
            why.push(format!(
                "{} finished epoch {} and waited for its report",
                names(&ahead),
                self.workers[cause].epoch + 1
            ));
        }
        msg.push_str(&format!(" ({}", why.join("; ")));
        if !others.is_empty() {
            msg.push_str(&format!("; silent too: {}", names(&others)));
        }
        match endpoint {
            // before any epoch the workers are joining the mesh: a peer nobody can reach stalls them
            // the same way, and a firewall closing the mesh port is the usual cause
            Some(addr) if self.workers.iter().all(|w| w.epoch == self.resumed) => msg.push_str(&format!(
                "; before the first epoch the workers join the mesh: a firewall, security group \
                 or NetworkPolicy that does not open UDP port {} between the workers stalls them, as \
                 does a slow, frozen or cut-off worker)",
                addr.port()
            )),
            _ => msg.push_str("; a slow, frozen or cut-off worker stalls its peers)"),
        }
        msg
    }

    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        if self.stage == Stage::Over {
            return Vec::new();
        }
        let mut out: Vec<Action> = self.handle_event(event, now).into_iter().collect();
        self.check_timeouts(now);
        out.extend(self.poll_end(now));
        out
    }

    /// What `event` says of its worker; an assignment once every worker registered, a completed epoch
    /// once every worker reported it.
    fn handle_event(&mut self, event: Event, now: Instant) -> Option<Action> {
        if let Event::Lost { rank, .. } | Event::Exited { rank, .. } = &event
            && let Some(w) = self.workers.get_mut(*rank)
            && w.done.is_none()
        {
            w.gone = true;
        }
        match event {
            Event::Registered {
                rank,
                pid,
                mesh_addr,
            } if rank < self.world => {
                return self.on_registered(rank, pid, mesh_addr, now);
            }
            Event::Epoch { rank, metrics } if rank < self.world => {
                return self.on_epoch(rank, metrics, now);
            }
            Event::Done {
                rank,
                summary,
                peak_rss_bytes,
            } if rank < self.world => {
                self.workers[rank].last_heard = Some(now);
                self.workers[rank].done = Some((summary, peak_rss_bytes));
                // its exit or closed connection, seen before this summary arrived, was a finished
                // worker's
                self.workers[rank].gone = false;
                // its exit, seen before this summary arrived, was the end of a finished worker
                self.evidence.retain(|e| !(e.exit && e.ended == Some(rank)));
                if self.evidence.is_empty() {
                    self.failing_since = None;
                }
            }
            Event::Failed { rank, error } if rank < self.world => {
                let msg = format!("{} failed {}: {error}", self.who(rank), self.when(rank));
                self.workers[rank].reported_error = Some(error);
                self.suspect(now, 2, msg);
            }
            // the weakest evidence: a worker stalled by a frozen peer or a cut link says so, and the
            // frozen peer's silence (or a kill) names the cause better if it comes within the grace
            Event::PeerLost { rank, error } if rank < self.world => {
                let msg = format!(
                    "{} could not exchange with its peers {}: {error}",
                    self.who(rank),
                    self.when(rank)
                );
                self.workers[rank].peer_lost = true;
                self.suspect(now, 5, msg);
            }
            // a worker that finished or reported its own error is not lost
            Event::Lost { rank, reason }
                if rank < self.world
                    && self.workers[rank].done.is_none()
                    && self.workers[rank].reported_error.is_none()
                    && !self.workers[rank].peer_lost =>
            {
                let msg = format!("{} {reason} {}", self.who(rank), self.when(rank));
                self.suspect_end(now, 1, msg, rank, false);
            }
            Event::Exited {
                rank,
                how,
                by_signal,
            } if rank < self.world => {
                let w = &self.workers[rank];
                if w.done.is_none() {
                    let msg = format!("{} {how} {}", self.who(rank), self.when(rank));
                    let priority = if by_signal {
                        0
                    } else if w.reported_error.is_some() {
                        3
                    } else if w.peer_lost {
                        6
                    } else {
                        1
                    };
                    self.suspect_end(now, priority, msg, rank, !by_signal);
                }
            }
            Event::Alive { rank, rtt } if rank < self.world => {
                let w = &mut self.workers[rank];
                w.last_heard = Some(now);
                w.waits_on = None;
                w.rtt = Some(rtt);
            }
            Event::Waiting { rank, on, rtt }
                if rank < self.world && on < self.world && on != rank =>
            {
                let w = &mut self.workers[rank];
                w.waits_on = Some((on, now));
                w.rtt = Some(rtt);
            }
            Event::Tick => {}
            // an out-of-range rank cannot happen: the server checks ranks against the world
            _ => {}
        }
        None
    }

    /// A worker registered its mesh address: once all have, training starts and they are assigned.
    fn on_registered(
        &mut self,
        rank: usize,
        pid: u32,
        mesh_addr: SocketAddr,
        now: Instant,
    ) -> Option<Action> {
        let w = &mut self.workers[rank];
        w.pid = Some(pid);
        w.mesh_addr = Some(mesh_addr);
        w.last_heard = Some(now);
        if self.stage == Stage::Registering && self.workers.iter().all(|w| w.mesh_addr.is_some()) {
            self.stage = Stage::Training;
            for w in &mut self.workers {
                w.last_heard = Some(now);
            }
            let peers = self
                .workers
                .iter()
                .map(|w| w.mesh_addr.expect("all registered"))
                .collect();
            return Some(Action::Assign { peers });
        }
        None
    }

    /// A worker's epoch metrics: the epoch is complete once every worker reported it.
    fn on_epoch(&mut self, rank: usize, metrics: EpochMetrics, now: Instant) -> Option<Action> {
        let w = &mut self.workers[rank];
        w.last_heard = Some(now);
        w.epoch = metrics.epoch;
        let epoch = metrics.epoch;
        let slot = self
            .pending
            .entry(epoch)
            .or_insert_with(|| vec![None; self.world]);
        slot[rank] = Some(metrics);
        if slot.iter().all(Option::is_some) {
            let by_rank = self
                .pending
                .remove(&epoch)
                .expect("present")
                .into_iter()
                .flatten()
                .collect();
            return Some(Action::EpochComplete { epoch, by_rank });
        }
        None
    }

    /// Registration and silence timeouts, turned into evidence.
    fn check_timeouts(&mut self, now: Instant) {
        match self.stage {
            Stage::Registering if now.duration_since(self.started) > self.register_timeout => {
                let missing: Vec<usize> = (0..self.world)
                    .filter(|&r| self.workers[r].mesh_addr.is_none())
                    .collect();
                if let Some(&r) = missing.first() {
                    let msg = format!(
                        "{} did not register within {} s",
                        self.who(r),
                        self.register_timeout.as_secs_f64()
                    );
                    if self.failing_since.is_none() {
                        self.suspect(now, 4, msg);
                    }
                }
            }
            // silence is looked for until one is found, also while weaker evidence waits out its grace
            Stage::Training if !self.evidence.iter().any(|e| e.priority == 4) => {
                let silent_for = |w: &Worker| {
                    w.last_heard
                        .map(|t| now.duration_since(t))
                        .unwrap_or_default()
                };
                let progressing = self.progressing(now);
                let mut silent: Vec<usize> = (0..self.world)
                    .filter(|&r| {
                        let w = &self.workers[r];
                        // a worker that reported its peers unreachable is waiting, not the cause; one
                        // waiting on a worker that computes is part of a long epoch, not a stall
                        w.done.is_none()
                            && !w.peer_lost
                            && !progressing[r]
                            && silent_for(w) > self.epoch_timeout
                    })
                    .collect();
                // the worker silent longest stopped first: the others are likely waiting on it (or on
                // the same cut link); the line names them too
                silent.sort_by_key(|&r| std::cmp::Reverse(silent_for(&self.workers[r])));
                if !silent.is_empty() {
                    let waited = self.waited_on(&silent, now);
                    self.stalled_by = match &waited {
                        // one rank explains every silence: the others wait on it
                        &Some((cause, _))
                            if silent
                                .iter()
                                .all(|&r| r == cause || self.waits_through(r, cause, now)) =>
                        {
                            Some(cause)
                        }
                        Some(_) => None,
                        None => match silent[..] {
                            [only] => Some(only),
                            _ => None,
                        },
                    };
                    let msg = self.silence(&silent, waited, now);
                    self.suspect(now, 4, msg);
                }
            }
            _ => {}
        }
    }

    /// The launch's end once its evidence outlived the grace (or a timeout fired), or every worker is
    /// done; nothing while a failure waits out its grace.
    fn poll_end(&mut self, now: Instant) -> Option<Action> {
        if let Some(since) = self.failing_since {
            let waited = now.duration_since(since);
            if waited >= FAILURE_GRACE
                || self.evidence.iter().any(|e| e.priority == 4)
                || (waited >= SIGNAL_GRACE && self.evidence.iter().any(|e| e.priority == 0))
            {
                let mut ranked: Vec<&Evidence> = self.evidence.iter().collect();
                ranked.sort_by_key(|e| e.priority);
                let first = ranked.first().expect("failing implies evidence");
                let (priority, mut error) = (first.priority, first.message.clone());
                // workers whose processes or connections ended together are named together, each
                // once (by its most direct line: a kill before a closed connection)
                if priority <= 1 {
                    let mut named = vec![first.ended];
                    let mut also = Vec::new();
                    for e in ranked
                        .iter()
                        .filter(|e| e.priority <= 1 && e.ended.is_some())
                    {
                        if !named.contains(&e.ended) {
                            named.push(e.ended);
                            also.push(e.message.as_str());
                        }
                    }
                    if !also.is_empty() {
                        error = format!("{error} (and {})", also.join("; "));
                    }
                }
                self.stage = Stage::Over;
                return Some(Action::Fail {
                    error,
                    // 2 and 3: the worker reported an error of its own
                    lost: !matches!(priority, 2 | 3),
                });
            }
            return None;
        }
        if self.workers.iter().all(|w| w.done.is_some()) {
            self.stage = Stage::Over;
            let (summaries, peak_rss_bytes) = self
                .workers
                .iter_mut()
                .map(|w| w.done.take().expect("all done"))
                .unzip();
            return Some(Action::Finished {
                summaries,
                peak_rss_bytes,
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(epoch: usize) -> EpochMetrics {
        EpochMetrics {
            epoch,
            loss: 1.0,
            train_acc: None,
            val_acc: None,
            test_acc: None,
            train_s: 0.1,
            eval_s: 0.0,
            exchange: Default::default(),
            batches: None,
            device: None,
            prepare_s: None,
        }
    }

    fn summary() -> TrainSummary {
        TrainSummary {
            epochs: vec![metrics(1)],
            best_epoch: None,
            best_val_acc: None,
            test_acc_at_best_val: None,
            stopped_early: false,
        }
    }

    /// A round trip within one network.
    const LAN: Duration = Duration::from_millis(1);

    fn started(n: usize, t0: Instant) -> Coordinator {
        let mut c = Coordinator::new(n, Duration::from_secs(30), Duration::from_secs(60), t0);
        for r in 0..n {
            let a = c.handle(
                Event::Registered {
                    rank: r,
                    pid: 100 + r as u32,
                    mesh_addr: format!("127.0.0.1:{}", 5000 + r).parse().unwrap(),
                },
                t0,
            );
            assert_eq!(a.len(), usize::from(r == n - 1));
        }
        c
    }

    #[test]
    fn a_clean_job_completes_epochs_then_finishes() {
        let t0 = Instant::now();
        let mut c = started(2, t0);
        assert!(
            c.handle(
                Event::Epoch {
                    rank: 1,
                    metrics: metrics(1)
                },
                t0
            )
            .is_empty()
        );
        let a = c.handle(
            Event::Epoch {
                rank: 0,
                metrics: metrics(1),
            },
            t0,
        );
        assert!(
            matches!(&a[..], [Action::EpochComplete { epoch: 1, by_rank }] if by_rank.len() == 2)
        );
        assert!(
            c.handle(
                Event::Done {
                    rank: 0,
                    summary: summary(),
                    peak_rss_bytes: None
                },
                t0
            )
            .is_empty()
        );
        let a = c.handle(
            Event::Done {
                rank: 1,
                summary: summary(),
                peak_rss_bytes: Some(1),
            },
            t0,
        );
        assert!(matches!(&a[..], [Action::Finished { .. }]));
        // exits after finishing are not failures
        assert!(
            c.handle(
                Event::Exited {
                    rank: 0,
                    how: "exited with code 0".into(),
                    by_signal: false
                },
                t0
            )
            .is_empty()
        );
    }

    #[test]
    fn a_killed_worker_is_named_even_when_its_peers_report_first() {
        let t0 = Instant::now();
        let mut c = started(3, t0);
        for r in 0..3 {
            c.handle(
                Event::Epoch {
                    rank: r,
                    metrics: metrics(1),
                },
                t0,
            );
        }
        let t1 = t0 + Duration::from_secs(1);
        assert!(
            c.handle(
                Event::Failed {
                    rank: 0,
                    error: "peer 1 lost".into()
                },
                t1
            )
            .is_empty()
        );
        assert!(
            c.handle(
                Event::Exited {
                    rank: 1,
                    how: "exited with signal 9".into(),
                    by_signal: true
                },
                t1
            )
            .is_empty()
        );
        let a = c.handle(Event::Tick, t1 + FAILURE_GRACE);
        assert_eq!(
            a,
            vec![Action::Fail {
                error: "worker 1 (pid 101) exited with signal 9 during epoch 2".into(),
                lost: true,
            }]
        );
        assert!(c.is_over());
    }

    /// A kill by a signal closes the grace early: the cause cannot be named better, and the replacement
    /// (or relaunch) starts 1.25 s sooner. Workers killed together are still seen together.
    #[test]
    fn a_worker_killed_by_a_signal_ends_the_launch_after_the_short_grace() {
        let t0 = Instant::now();
        let killed = |c: &mut Coordinator, rank: usize, t: Instant| {
            c.handle(
                Event::Exited {
                    rank,
                    how: "exited with signal 9".into(),
                    by_signal: true,
                },
                t,
            )
        };
        let closed = |c: &mut Coordinator, rank: usize, t: Instant| {
            c.handle(
                Event::Lost {
                    rank,
                    reason: "closed its connection".into(),
                },
                t,
            )
        };
        let mut c = started(3, t0);
        let t1 = t0 + Duration::from_secs(1);
        // its connection closing comes first (weaker evidence), then the exit
        assert!(closed(&mut c, 1, t1).is_empty());
        assert!(killed(&mut c, 1, t1 + Duration::from_millis(50)).is_empty());
        assert!(
            c.handle(Event::Tick, t1 + SIGNAL_GRACE - Duration::from_millis(1))
                .is_empty()
        );
        assert_eq!(
            c.handle(Event::Tick, t1 + SIGNAL_GRACE),
            vec![Action::Fail {
                error: "worker 1 (pid 101) exited with signal 9 during epoch 1".into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [1]);

        // a launch that continues after epoch 3 (resized, replaced, restarted) loses a worker before its
        // first report: in epoch 4, not 1
        let mut c = started(3, t0);
        c.resume_after(3);
        assert!(killed(&mut c, 1, t1).is_empty());
        assert_eq!(
            c.handle(Event::Tick, t1 + SIGNAL_GRACE),
            vec![Action::Fail {
                error: "worker 1 (pid 101) exited with signal 9 during epoch 4".into(),
                lost: true,
            }]
        );

        // two killed at once: both are gone when the launch ends, and the line names both, each once
        let mut c = started(3, t0);
        assert!(killed(&mut c, 0, t1).is_empty());
        assert!(closed(&mut c, 2, t1 + Duration::from_millis(50)).is_empty());
        assert!(killed(&mut c, 2, t1 + Duration::from_millis(100)).is_empty());
        assert!(closed(&mut c, 0, t1 + Duration::from_millis(150)).is_empty());
        assert_eq!(
            c.handle(Event::Tick, t1 + SIGNAL_GRACE),
            vec![Action::Fail {
                error: "worker 0 (pid 100) exited with signal 9 during epoch 1 (and worker 2 (pid 102) \
                        exited with signal 9 during epoch 1)"
                    .into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [0, 2]);

        // without a signal the whole grace is waited for
        let mut c = started(3, t0);
        assert!(closed(&mut c, 1, t1).is_empty());
        assert!(c.handle(Event::Tick, t1 + SIGNAL_GRACE).is_empty());
        assert!(!c.handle(Event::Tick, t1 + FAILURE_GRACE).is_empty());
    }

    #[test]
    fn an_exit_seen_before_the_summary_is_no_failure() {
        // the worker sends its summary, then exits; the exit is noticed first
        let t0 = Instant::now();
        let mut c = started(2, t0);
        let exited = |c: &mut Coordinator, rank, how: &str, by_signal, t| {
            c.handle(
                Event::Exited {
                    rank,
                    how: how.into(),
                    by_signal,
                },
                t,
            )
        };
        let done = |c: &mut Coordinator, rank, t| {
            c.handle(
                Event::Done {
                    rank,
                    summary: summary(),
                    peak_rss_bytes: None,
                },
                t,
            )
        };
        assert!(exited(&mut c, 0, "exited with code 0", false, t0).is_empty());
        let t1 = t0 + Duration::from_millis(5);
        assert!(done(&mut c, 0, t1).is_empty());
        assert!(c.handle(Event::Tick, t1 + FAILURE_GRACE).is_empty());
        assert!(matches!(
            &done(&mut c, 1, t1 + FAILURE_GRACE)[..],
            [Action::Finished { .. }]
        ));

        // a summary withdraws only its own worker's exit: a peer killed meanwhile is still the cause
        let mut c = started(2, t0);
        exited(&mut c, 0, "exited with code 0", false, t0);
        exited(&mut c, 1, "exited with signal 9", true, t0);
        assert!(done(&mut c, 0, t1).is_empty());
        assert_eq!(
            c.handle(Event::Tick, t0 + FAILURE_GRACE),
            vec![Action::Fail {
                error: "worker 1 (pid 101) exited with signal 9 during epoch 1".into(),
                lost: true,
            }]
        );

        // no summary within the grace window: the exit is the failure
        let mut c = started(2, t0);
        exited(&mut c, 0, "exited with code 0", false, t0);
        assert!(matches!(
            &c.handle(Event::Tick, t0 + FAILURE_GRACE)[..],
            [Action::Fail { error, lost: true }] if error.contains("worker 0") && error.contains("code 0")
        ));
    }

    #[test]
    fn silence_and_missing_registrations_time_out() {
        let t0 = Instant::now();
        let mut c = started(2, t0);
        c.handle(
            Event::Epoch {
                rank: 0,
                metrics: metrics(1),
            },
            t0 + Duration::from_secs(50),
        );
        let a = c.handle(Event::Tick, t0 + Duration::from_secs(61));
        assert_eq!(
            a,
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 1".into(),
                lost: true,
            }]
        );
        // the only silent worker is the one lost (its process may still run: a replacement stops it)
        assert_eq!(c.gone(), Vec::<usize>::new());
        assert_eq!(c.lost(), [1]);

        // every worker silent, two of them having reported the epoch the third has not: they wait on it
        // (workers train in lockstep), so it is named, and lost, alone
        let mut c = started(3, t0);
        for r in [0, 2] {
            c.handle(
                Event::Epoch {
                    rank: r,
                    metrics: metrics(1),
                },
                t0 + Duration::from_secs(5),
            );
        }
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_secs(66)),
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 1 (worker 0, worker 2 \
                        finished epoch 1 and waited for its report; a slow, frozen or cut-off worker \
                        stalls its peers)"
                    .into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [1]);

        // every worker silent in the same epoch (a cut link stalls the collectives) and no wait reported:
        // the one silent longest, the others named; nothing says which one stalled the others, so none
        // is known to be lost
        let mut c = started(3, t0);
        for (r, s) in [(0, 3), (1, 5), (2, 4)] {
            c.handle(
                Event::Alive { rank: r, rtt: LAN },
                t0 + Duration::from_secs(s),
            );
        }
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_secs(66)),
            vec![Action::Fail {
                error: "worker 0 (pid 100) sent nothing for 60 s during epoch 1 (silent too: worker 2, \
                        worker 1; a frozen worker or a cut link stalls its peers)"
                    .into(),
                lost: true,
            }]
        );
        assert!(c.lost().is_empty());

        let mut c = Coordinator::new(2, Duration::from_secs(30), Duration::from_secs(60), t0);
        c.handle(
            Event::Registered {
                rank: 0,
                pid: 7,
                mesh_addr: "127.0.0.1:1".parse().unwrap(),
            },
            t0,
        );
        assert!(
            c.handle(Event::Tick, t0 + Duration::from_secs(29))
                .is_empty()
        );
        let a = c.handle(Event::Tick, t0 + Duration::from_secs(31));
        assert_eq!(
            a,
            vec![Action::Fail {
                error: "worker 1 did not register within 30 s".into(),
                lost: true,
            }]
        );
    }

    #[test]
    fn a_worker_that_cannot_reach_its_peers_is_retried_and_a_silent_peer_is_named_first() {
        let t0 = Instant::now();
        let peer_lost = |c: &mut Coordinator, rank: usize, t: Instant| {
            c.handle(
                Event::PeerLost {
                    rank,
                    error: "timed out after 60000ms waiting for rank 2".into(),
                },
                t,
            )
        };
        // a cut link: the worker says so, then exits with code 1 and its connection ends; the report
        // is the cause, and the job is retried (lost), not failed for the worker's own error
        let mut c = started(3, t0);
        let t1 = t0 + Duration::from_secs(10);
        assert!(peer_lost(&mut c, 1, t1).is_empty());
        let exit = Event::Exited {
            rank: 1,
            how: "exited with code 1".into(),
            by_signal: false,
        };
        assert!(c.handle(exit, t1).is_empty());
        assert!(
            c.handle(
                Event::Lost {
                    rank: 1,
                    reason: "closed its connection".into()
                },
                t1
            )
            .is_empty()
        );
        assert_eq!(
            c.handle(Event::Tick, t1 + FAILURE_GRACE),
            vec![Action::Fail {
                error: "worker 1 (pid 101) could not exchange with its peers during epoch 1: timed out \
                        after 60000ms waiting for rank 2"
                    .into(),
                lost: true,
            }]
        );

        // a frozen worker 2: its peers time out waiting for it, and its own silence names it
        let mut c = started(3, t0);
        for r in [0, 1] {
            c.handle(
                Event::Epoch {
                    rank: r,
                    metrics: metrics(1),
                },
                t0 + Duration::from_secs(2),
            );
        }
        assert!(peer_lost(&mut c, 0, t0 + Duration::from_secs(60)).is_empty());
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_millis(60_500)),
            vec![Action::Fail {
                error: "worker 2 (pid 102) sent nothing for 60 s during epoch 1".into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [2]);
    }

    /// Workers an epoch ahead of a peer wait for it (a gated worker waits for its launch's word, which
    /// waits for the epoch's last report) without reporting a wait on the mesh and without beating: a
    /// long epoch of the peer behind is no stall, and once that peer falls silent it alone is blamed.
    #[test]
    fn workers_an_epoch_ahead_wait_on_the_worker_behind() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let epoch = |c: &mut Coordinator, rank: usize, e: usize, t: Instant| {
            c.handle(
                Event::Epoch {
                    rank,
                    metrics: metrics(e),
                },
                t,
            )
        };
        let mut c = started(3, t0);
        for r in 0..3 {
            epoch(&mut c, r, 1, at(1));
        }
        for r in [0, 2] {
            assert!(epoch(&mut c, r, 2, at(5)).is_empty());
        }
        // worker 1 computes epoch 2 for five minutes: its peers' silence is waiting, not a stall
        for s in (10..=300).step_by(10) {
            assert!(
                c.handle(Event::Alive { rank: 1, rtt: LAN }, at(s))
                    .is_empty()
            );
            assert!(c.handle(Event::Tick, at(s)).is_empty(), "at {s} s");
        }
        // then it freezes: it is named, and the workers ahead wait on it
        assert_eq!(
            c.handle(Event::Tick, at(361)),
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 2 (worker 0, worker 2 \
                        finished epoch 2 and waited for its report; a slow, frozen or cut-off worker \
                        stalls its peers)"
                    .into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [1]);

        // two workers behind, both silent: neither explains the other's silence, nobody is blamed alone
        let mut c = started(3, t0);
        for r in 0..3 {
            epoch(&mut c, r, 1, at(1));
        }
        assert!(epoch(&mut c, 0, 2, at(5)).is_empty());
        assert!(matches!(
            &c.handle(Event::Tick, at(70))[..],
            [Action::Fail { lost: true, .. }]
        ));
        assert!(c.lost().is_empty(), "{:?}", c.lost());
    }

    /// Worker 1 behind a delaying network during the mesh join (network_faults' tight-timeout delay as
    /// it once failed): 0 waits on 1, 1 waits on its dial to 2 (its packets are late), and 2, waiting to
    /// accept 1's connection, waits passively and reports nothing. The waits alone point at 2, at the
    /// chain's end; worker 1's control round trip, 400 ms against everyone else's 1 ms, names it.
    #[test]
    fn a_worker_behind_a_slow_network_is_blamed_by_its_round_trip() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let join = "before the first epoch the workers join the mesh: a firewall, security group or \
                    NetworkPolicy that does not open UDP port";
        // 90 ms is not slow (a far region's round trip), nor is 400 ms when everyone's is 100 ms
        for (rtt_1, rtt_others, blamed) in [
            (LAN, LAN, 2),
            (Duration::from_millis(90), LAN, 2),
            (Duration::from_millis(400), Duration::from_millis(100), 2),
            (Duration::from_millis(400), LAN, 1),
        ] {
            let mut c = started(3, t0);
            assert!(
                c.handle(
                    Event::Alive {
                        rank: 2,
                        rtt: rtt_others
                    },
                    at(1)
                )
                .is_empty()
            );
            for s in (10..=60).step_by(10) {
                let wait = |rank, on, rtt| Event::Waiting { rank, on, rtt };
                assert!(c.handle(wait(0, 1, rtt_others), at(s)).is_empty());
                assert!(c.handle(wait(1, 2, rtt_1), at(s)).is_empty());
            }
            let error = match &c.handle(Event::Tick, at(64))[..] {
                [Action::Fail { error, lost: true }] => error.clone(),
                other => panic!("{other:?}"),
            };
            if blamed == 2 {
                assert!(
                    error.starts_with(&format!(
                        "worker 2 (pid 102) sent nothing for 60 s during epoch 1 (worker 1 waited on it \
                         at its mesh endpoint 127.0.0.1:5002; silent too: worker 0; {join} 5002"
                    )),
                    "{error}"
                );
                // 0 waits on 2 through 1
                assert_eq!(c.lost(), [2]);
            } else {
                assert_eq!(
                    error,
                    format!(
                        "worker 1 (pid 101) sent nothing for 60 s during epoch 1 (its round trip to the \
                         coordinator takes 400 ms, the other workers' at most 1.0 ms; worker 0 waited on it \
                         at its mesh endpoint 127.0.0.1:5001; silent too: worker 2; {join} 5001 between \
                         the workers stalls them, as does a slow, frozen or cut-off worker)"
                    )
                );
                // worker 2's silence is not explained by a wait: every worker is relaunched
                assert!(c.lost().is_empty(), "{:?}", c.lost());
            }
        }
    }

    #[test]
    fn the_silence_is_blamed_on_the_worker_its_peers_wait_on() {
        let t0 = Instant::now();
        let wait = |c: &mut Coordinator, rank: usize, on: usize, t: Instant| {
            assert!(
                c.handle(Event::Waiting { rank, on, rtt: LAN }, t)
                    .is_empty()
            );
        };
        // worker 1 behind a slow link: everyone is silent; 0 and 2 wait on 1, and 1 waits on 0 (its
        // frames in are slow too). Worker 0, silent longest, is not the cause: 1 is.
        let mut c = started(3, t0);
        for r in [1, 2] {
            c.handle(
                Event::Epoch {
                    rank: r,
                    metrics: metrics(1),
                },
                t0 + Duration::from_secs(3),
            );
        }
        for s in (10..=60).step_by(10) {
            let t = t0 + Duration::from_secs(s);
            wait(&mut c, 0, 1, t);
            wait(&mut c, 2, 1, t);
            wait(&mut c, 1, 0, t);
        }
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_secs(64)),
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 2 (worker 0, worker 2 waited \
                        on it at its mesh endpoint 127.0.0.1:5001; a slow, frozen or cut-off worker stalls \
                        its peers)"
                    .into(),
                lost: true,
            }]
        );
        assert_eq!(c.lost(), [1]);

        // worker 1 computes (beats) while 0 waits on it and 2 waits on 0: a long epoch, not a stall,
        // however long; once worker 1 stops beating, it is named, the chain of waiters with it
        let mut c = started(3, t0);
        for s in (10..=300).step_by(10) {
            let t = t0 + Duration::from_secs(s);
            assert!(c.handle(Event::Alive { rank: 1, rtt: LAN }, t).is_empty());
            wait(&mut c, 0, 1, t);
            wait(&mut c, 2, 0, t);
            assert!(c.handle(Event::Tick, t).is_empty(), "at {s} s");
        }
        for s in (310..=360).step_by(10) {
            let t = t0 + Duration::from_secs(s);
            wait(&mut c, 0, 1, t);
            wait(&mut c, 2, 0, t);
        }
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_secs(361)),
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 1 (worker 0 waited on it at \
                        its mesh endpoint 127.0.0.1:5001; silent too: worker 2; before the first epoch the \
                        workers join the mesh: a firewall, security group or NetworkPolicy that does not \
                        open UDP port 5001 between the workers stalls them, as does a slow, frozen or \
                        cut-off worker)"
                    .into(),
                lost: true,
            }]
        );
        // worker 2 waits on it through worker 0
        assert_eq!(c.lost(), [1]);

        // a wait reported longer ago than the timeout, or a beat since, blames nobody: the old line
        let mut c = started(2, t0);
        wait(&mut c, 0, 1, t0 + Duration::from_secs(1));
        assert!(
            c.handle(
                Event::Alive { rank: 1, rtt: LAN },
                t0 + Duration::from_secs(1)
            )
            .is_empty()
        );
        assert_eq!(
            c.handle(Event::Tick, t0 + Duration::from_secs(62)),
            vec![Action::Fail {
                error: "worker 0 (pid 100) sent nothing for 60 s during epoch 1 (silent too: worker 1; a \
                        frozen worker or a cut link stalls its peers)"
                    .into(),
                lost: true,
            }]
        );
        assert!(c.lost().is_empty());
        // a wait on itself or on a rank outside the job is ignored
        let mut c = started(2, t0);
        wait(&mut c, 0, 0, t0 + Duration::from_secs(30));
        wait(&mut c, 0, 9, t0 + Duration::from_secs(30));
        assert!(matches!(
            &c.handle(Event::Tick, t0 + Duration::from_secs(61))[..],
            [Action::Fail { error, .. }] if error.contains("silent too")
        ));
    }

    #[test]
    fn a_heartbeat_keeps_a_long_epoch_from_being_a_silence() {
        let t0 = Instant::now();
        let mut c = started(2, t0);
        // epoch 1 takes 150 s; both workers beat every 15 s meanwhile
        for s in (15..=150).step_by(15) {
            let t = t0 + Duration::from_secs(s);
            for rank in 0..2 {
                assert!(c.handle(Event::Alive { rank, rtt: LAN }, t).is_empty());
            }
            assert!(c.handle(Event::Tick, t).is_empty(), "at {s} s");
        }
        // worker 1 stops beating (frozen): 60 s later it is the silence
        let t = t0 + Duration::from_secs(150);
        for s in (165..=210).step_by(15) {
            c.handle(
                Event::Alive { rank: 0, rtt: LAN },
                t0 + Duration::from_secs(s),
            );
        }
        assert_eq!(
            c.handle(Event::Tick, t + Duration::from_secs(61)),
            vec![Action::Fail {
                error: "worker 1 (pid 101) sent nothing for 60 s during epoch 1".into(),
                lost: true,
            }]
        );
    }

    #[test]
    fn an_error_a_worker_reports_is_not_a_lost_worker() {
        // bad data or a bad setting fails the same way on every retry: the job fails at once
        let t0 = Instant::now();
        let mut c = started(2, t0);
        c.handle(
            Event::Failed {
                rank: 1,
                error: "features row 7 is NaN".into(),
            },
            t0,
        );
        c.handle(
            Event::Exited {
                rank: 1,
                how: "exited with code 1".into(),
                by_signal: false,
            },
            t0,
        );
        assert_eq!(
            c.handle(Event::Tick, t0 + FAILURE_GRACE),
            vec![Action::Fail {
                error: "worker 1 (pid 101) failed during epoch 1: features row 7 is NaN".into(),
                lost: false,
            }]
        );
    }
}
