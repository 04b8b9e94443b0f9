//! The whole job as one state machine, without IO: launches, assignments, epochs, the scaling policy,
//! retries of lost workers, prewarmed launches, resume and stop. It is fed [`JobEvent`]s (a launch started
//! or failed to start, a worker of some launch said or did something, time passed) with the time they
//! happened, and answers with [`JobAction`]s (start a launch, assign its workers, tell prewarmed workers
//! to keep waiting, stop a launch, record an epoch, finish, fail). `distributed.rs` runs it over a backend,
//! the control server and the job directory; the simulation below runs it over a fake cluster in virtual
//! time with every kind of fault, the coordinator's own death included.
//!
//! Within one launch the [`Coordinator`] decides when an epoch is complete and which worker failed first;
//! between launches the [`Elastic`] policy state decides what runs next. This machine joins them:
//!
//! - Every launch has an index (the job's segment; logs and secrets are named after it). A prewarmed
//!   launch takes the next index when it is started and is adopted by the next relaunch if its worker count
//!   is the one needed; otherwise it is stopped. A prewarm that fails to start, or loses a worker while it
//!   waits, is discarded with a line saying why: it never fails the job.
//! - An epoch is recorded once, when every worker of the current launch reported it (rank 0 wrote its
//!   checkpoint before reporting). Then the policy decides: keep going, rescale, reconfigure or stop.
//! - A lost worker (killed, exited, vanished, silent) or a launch that failed to start stops the launch
//!   and relaunches the same count from the last recorded epoch's checkpoint, `max_retries` times in a row
//!   at most. An error a worker reports about its own work is not retried. Modes that keep no checkpoint
//!   retry only before their first recorded epoch.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use physalia_control::TrainMode;
use physalia_gnn::{EpochMetrics, TrainSummary};
use physalia_policies::Objective;
use serde_json::Value;

use crate::coordinator::{Action, Coordinator, Event};
use crate::elastic::{Elastic, Next, Stop, epoch_usd};

/// What the machine needs to know about the job that the policy does not.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// Workers of the first launch (a resumed job: the last recorded epoch's).
    pub workers: usize,
    pub epochs: usize,
    pub seed: u64,
    pub register_timeout: Duration,
    pub epoch_timeout: Duration,
    /// Rank 0 writes a checkpoint after every epoch (partition parallelism), so any epoch can be retried.
    pub checkpoints: bool,
    /// The checkpoint the first launch starts from (0: from scratch).
    pub start_epoch: usize,
    /// The price of a worker-second: each epoch's cost, and the bill (every worker from its start to its
    /// stop, prewarmed and idle ones included).
    pub price_per_worker_s: f64,
    /// The price of the coordinator's second, from the job's start to its end (0 where it runs on the
    /// user's machine).
    pub coordinator_price_per_s: f64,
    /// How the first launch trains (a replan may change it).
    pub mode: TrainMode,
    /// Resize partition-parallel launches in place (issue 33): the survivors keep their processes and
    /// training state, joiners join their mesh, leavers stop; a resize that fails part-way restarts
    /// from the checkpoint as every resize of the other modes does.
    pub in_place: bool,
}

/// What a replan chose: the next launches' shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Replan {
    pub workers: usize,
    pub mode: TrainMode,
    pub boundary_sampling: f64,
    pub staleness: u32,
    /// One line on the choice and why (the planner's prediction against the measured epochs).
    pub why: String,
}

#[derive(Debug, Clone)]
// an epoch report is the large variant, and the common one: boxing it would allocate per epoch for nothing
#[allow(clippy::large_enum_variant)]
pub enum JobEvent {
    /// The backend started launch `launch` (the process ids by rank, where it knows them), or could not.
    Started {
        launch: usize,
        result: Result<Vec<Option<u32>>, String>,
    },
    /// A worker of launch `launch` registered, reported, failed or exited.
    Worker { launch: usize, event: Event },
    /// The planner's answer to [`JobAction::Replan`].
    Replanned(Result<Replan, String>),
    /// The answer to [`JobAction::Resize`]: every rank of launch `launch` is ready (pid where known,
    /// mesh address, by rank), or the resize failed part-way.
    Resized {
        launch: usize,
        result: Result<Vec<(Option<u32>, SocketAddr)>, String>,
    },
    /// Nothing happened; lets timeouts fire.
    Tick,
}

/// The joiners of an in-place resize: launch `launch` (its ranks join the resized mesh from the old
/// size up), prewarmed while the job trained or to be started by the resize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joiners {
    pub launch: usize,
    pub prewarmed: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum JobAction {
    /// Start `workers` workers as launch `launch`. `prewarm`: ahead of the relaunch that may use them.
    /// The driver answers with [`JobEvent::Started`].
    Launch {
        launch: usize,
        workers: usize,
        /// What it will train (model parallelism reads the whole dataset: no partitioning is made).
        mode: TrainMode,
        prewarm: bool,
    },
    /// Every worker of `launch` registered: send each its assignment, to continue from the checkpoint of
    /// `resume_epoch` (0: from scratch) with these exchange settings.
    Assign {
        launch: usize,
        peers: Vec<SocketAddr>,
        resume_epoch: usize,
        mode: TrainMode,
        boundary_sampling: f64,
        staleness: u32,
        /// Workers wait for [`JobAction::Continue`] after every epoch but the last (in-place resizes).
        gated: bool,
    },
    /// The policy asked for a new plan under `objective` after `epoch`: ask the planner, with the job as it
    /// runs now (`workers`, `mode`) and what every worker measured in that epoch, and answer with
    /// [`JobEvent::Replanned`]. The job keeps running meanwhile.
    Replan {
        epoch: usize,
        objective: Objective,
        workers: usize,
        mode: TrainMode,
        by_rank: Vec<EpochMetrics>,
    },
    /// Start `workers` workers as launch `launch` that join launch `joining`'s mesh as its ranks `base..`
    /// under its CA (the joiners of an in-place resize; `prewarm`: ahead of it). The driver answers
    /// with [`JobEvent::Started`].
    LaunchJoiners {
        launch: usize,
        joining: usize,
        base: usize,
        workers: usize,
        prewarm: bool,
    },
    /// Tell the workers of `launch` (gated: they wait after every epoch) to train the next epoch.
    Continue { launch: usize },
    /// `launch` trains gated, and the policy may resize it in place to any of `workers` (most likely
    /// first): make those partitionings now, against its current one, so that a resize's pause does not
    /// (the driver answers nothing; a resize to a count not prepared makes its own).
    Prepare { launch: usize, workers: Vec<usize> },
    /// Resize launch `from` in place into launch `to` of `workers` workers, continuing after
    /// `resume_epoch`: its ranks below `workers` pause keeping their state, the others stop, the joiners
    /// (ranks from `from`'s size up, launch `joiners`, prewarmed or started now) register, and a
    /// partitioning for `workers` that overlaps the current one is made. The driver answers with
    /// [`JobEvent::Resized`]; launch `to` is then assigned as any other.
    ///
    /// `replacing`: the ranks of lost workers (ascending), replaced alone: `workers` is the launch's size,
    /// every other rank is told to cancel the epoch in flight and pause keeping its process and part, the
    /// joiners (one launch) are one worker per rank replaced, taking it, and the partitioning stays as it
    /// is.
    Resize {
        from: usize,
        to: usize,
        workers: usize,
        /// The launch's training mode (partition or data parallelism).
        mode: TrainMode,
        resume_epoch: usize,
        joiners: Option<Joiners>,
        replacing: Option<Vec<usize>>,
    },
    /// Tell the registered workers of a prewarmed launch to keep waiting for `for_s` seconds.
    KeepWaiting { launch: usize, for_s: f64 },
    /// Stop every worker of `launch` and delete what it created. `finished`: its workers are ending on
    /// their own and may be given a moment to exit.
    StopLaunch {
        launch: usize,
        reason: String,
        finished: bool,
    },
    /// Every worker reported `epoch`: append it to the record (it counts from now on).
    Record {
        epoch: usize,
        by_rank: Vec<EpochMetrics>,
        usd: f64,
    },
    /// A line for the terminal and the coordinator's log (rescales, retries, discarded prewarms).
    Say(String),
    /// A line for the coordinator's log only.
    Log(String),
    /// The job is over: its result is in [`Job::outcome`].
    Finish,
    /// The job failed with this one error.
    Fail { error: String },
}

/// How a job ended: rank 0's epochs over every launch, and what the last launch's workers reported.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub summary: TrainSummary,
    /// Peak memory by rank of the launch that finished (empty when the policy stopped the job).
    pub worker_peak_rss: Vec<Option<u64>>,
    pub bytes_exchanged: u64,
    /// The bill: every launch's workers from their start to their stop, and the coordinator's time, at
    /// their prices.
    pub usd: f64,
    /// Worker-seconds billed (every launch, prewarmed and idle workers included).
    pub worker_s: f64,
    /// Seconds the coordinator was billed for (from the job's start to its end).
    pub coordinator_s: f64,
    /// Every launch the platform started, with when (seconds since the job started).
    pub launches: Vec<LaunchSpan>,
    /// When each recorded epoch completed (seconds since the job started).
    pub epochs: Vec<EpochEnd>,
}

/// A launch as the bill counts it and an epoch's end, in `summary.json` (`physalia plan --replay` fits
/// its model to these).
pub use physalia_control::record::{EpochEnd, LaunchSpan};

/// What the job costs as it runs: each launch's workers are billed from the moment the platform started
/// them to the moment the job stopped them, whatever they did meanwhile (trained, waited as a prewarm,
/// sat idle before a relaunch); the coordinator from the job's start to its end.
#[derive(Debug, Default)]
struct Ledger {
    /// Workers of each launch asked for, by launch.
    sizes: std::collections::BTreeMap<usize, usize>,
    /// When each running launch started.
    running: std::collections::BTreeMap<usize, Instant>,
    coordinator_since: Option<Instant>,
    worker_s: f64,
    coordinator_s: f64,
    /// When the job started: the spans' and epochs' origin.
    t0: Option<Instant>,
    /// Whether each launch asked for was a prewarm.
    prewarm: std::collections::BTreeMap<usize, bool>,
    spans: Vec<LaunchSpan>,
    epochs: Vec<EpochEnd>,
    /// A launch being resized in place, by the launch it becomes: the launches it is made of (the
    /// resized one and its joiners), billed until it starts.
    resizing: std::collections::BTreeMap<usize, Vec<usize>>,
}

impl Ledger {
    /// Takes in what one step of the job decided at `now` (and the launch it heard started, if any).
    fn account(&mut self, started: Option<usize>, out: &[JobAction], now: Instant) {
        let t0 = *self.t0.get_or_insert(now);
        let at = now.saturating_duration_since(t0).as_secs_f64();
        if let Some(launch) = started {
            // a launch resized in place takes over from the launches it is made of when it starts:
            // they are billed through the pause (survivors paused, joiners starting), it from here
            let from = self.resizing.remove(&launch);
            for l in from.iter().flatten() {
                self.stop(*l, now, at);
            }
            self.start(launch, from.is_some(), now, at);
        }
        for a in out {
            match a {
                JobAction::Launch {
                    launch,
                    workers,
                    prewarm,
                    ..
                }
                | JobAction::LaunchJoiners {
                    launch,
                    workers,
                    prewarm,
                    ..
                } => {
                    self.sizes.insert(*launch, *workers);
                    self.prewarm.insert(*launch, *prewarm);
                }
                // the resized launch is billed from its start (the job's `Resized`); the launches it
                // is made of, to it: joiners that were not prewarmed start now
                JobAction::Resize {
                    from,
                    to,
                    workers,
                    joiners,
                    replacing,
                    ..
                } => {
                    self.sizes.insert(*to, *workers);
                    self.prewarm.insert(*to, false);
                    if let Some(j) = joiners
                        && !j.prewarmed
                    {
                        let n = match replacing {
                            Some(ranks) => ranks.len(),
                            None => {
                                workers.saturating_sub(self.sizes.get(from).copied().unwrap_or(0))
                            }
                        };
                        self.sizes.insert(j.launch, n);
                        self.prewarm.insert(j.launch, false);
                        self.start(j.launch, false, now, at);
                    }
                    self.resizing.insert(
                        *to,
                        std::iter::once(*from)
                            .chain(joiners.map(|j| j.launch))
                            .collect(),
                    );
                }
                JobAction::StopLaunch { launch, .. } => self.stop(*launch, now, at),
                JobAction::Record { epoch, .. } => self.epochs.push(EpochEnd {
                    epoch: *epoch,
                    end_s: at,
                }),
                JobAction::Finish | JobAction::Fail { .. } => {
                    if let Some(t) = self.coordinator_since.take() {
                        self.coordinator_s += now.saturating_duration_since(t).as_secs_f64();
                    }
                }
                _ => {}
            }
        }
    }

    /// Starts billing `launch` at `now` (`at` seconds into the job); `in_place`: it continues the
    /// launch before it (a resize in place), not a start of its workers.
    fn start(&mut self, launch: usize, in_place: bool, now: Instant, at: f64) {
        self.running.insert(launch, now);
        self.spans.push(LaunchSpan {
            launch,
            workers: self.sizes.get(&launch).copied().unwrap_or(0),
            prewarm: self.prewarm.get(&launch).copied().unwrap_or(false),
            in_place,
            start_s: at,
            stop_s: None,
        });
    }

    /// Stops billing `launch` at `now` (`at` seconds into the job).
    fn stop(&mut self, launch: usize, now: Instant, at: f64) {
        if let Some(t) = self.running.remove(&launch) {
            let n = self.sizes.get(&launch).copied().unwrap_or(0);
            self.worker_s += n as f64 * now.saturating_duration_since(t).as_secs_f64();
            if let Some(s) = self.spans.iter_mut().rev().find(|s| s.launch == launch) {
                s.stop_s = Some(at);
            }
        }
    }

    fn usd(&self, cfg: &JobConfig) -> f64 {
        self.worker_s * cfg.price_per_worker_s + self.coordinator_s * cfg.coordinator_price_per_s
    }

    /// The bill as of `now`: the running launches' workers and the coordinator counted up to `now`.
    fn usd_at(&self, cfg: &JobConfig, now: Instant) -> f64 {
        let running: f64 = self
            .running
            .iter()
            .map(|(launch, since)| {
                let n = self.sizes.get(launch).copied().unwrap_or(0);
                n as f64 * now.saturating_duration_since(*since).as_secs_f64()
            })
            .sum();
        let coordinator = self
            .coordinator_since
            .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
        (self.worker_s + running) * cfg.price_per_worker_s
            + (self.coordinator_s + coordinator) * cfg.coordinator_price_per_s
    }
}

struct Current {
    launch: usize,
    n: usize,
    resume_epoch: usize,
    /// Created when the backend says the launch started.
    coord: Option<Coordinator>,
    /// Worker events that came before the coordinator existed (a prewarmed launch's registrations).
    early: Vec<Event>,
}

struct Prewarm {
    launch: usize,
    /// The mode it was launched for (a replan may change the job's).
    mode: TrainMode,
    n: usize,
    /// Joiners of the current launch's mesh from this rank up (an in-place resize's), not a launch of
    /// its own.
    join_base: Option<usize>,
    requested: Instant,
    started: Option<Vec<Option<u32>>>,
    early: Vec<Event>,
}

pub struct Job {
    cfg: JobConfig,
    elastic: Elastic,
    next_launch: usize,
    current: Option<Current>,
    prewarm: Option<Prewarm>,
    /// The launch during which a prewarm failed: no second try during it.
    prewarm_failed_in: Option<usize>,
    last_complete: usize,
    outcome: Option<Outcome>,
    over: bool,
    mode: TrainMode,
    /// A replan asked for and not answered yet: its epoch, rule, values and objective.
    replanning: Option<(usize, String, Value, Objective)>,
    /// An in-place resize asked for and not answered yet: the launch it resizes and its joiners'.
    resizing: Option<(usize, Option<usize>)>,
    /// The launch whose next partitionings were asked for (`JobAction::Prepare`).
    prepared: Option<usize>,
    ledger: Ledger,
}

impl Job {
    /// `first_launch`: the index of the job's first launch (a resumed job continues the numbering).
    pub fn new(cfg: JobConfig, elastic: Elastic, first_launch: usize) -> Job {
        let last_complete = cfg.start_epoch;
        let mode = cfg.mode;
        Job {
            cfg,
            elastic,
            next_launch: first_launch,
            current: None,
            prewarm: None,
            prewarm_failed_in: None,
            last_complete,
            outcome: None,
            over: false,
            mode,
            replanning: None,
            resizing: None,
            prepared: None,
            ledger: Ledger::default(),
        }
    }

    /// Starts the job. `pending`: the policy's decision after the last recorded epoch of a resumed job (its
    /// coordinator may have died before acting on it), acted on first.
    pub fn start(&mut self, pending: Option<Stop>, now: Instant) -> Vec<JobAction> {
        let mut out = Vec::new();
        self.ledger.coordinator_since = Some(now);
        match pending {
            // asked again with the last recorded epoch's measurements; the first launch waits for it
            Some(Stop::Replan { to, rule, values }) => {
                let epoch = self.cfg.start_epoch;
                self.replanning = Some((epoch, rule, values, to));
                out.push(JobAction::Replan {
                    epoch,
                    objective: to,
                    workers: self.cfg.workers,
                    mode: self.mode,
                    by_rank: self.elastic.last_by_rank().to_vec(),
                });
            }
            Some(why) => self.after_stop(self.cfg.workers, why, now, &mut out),
            None => self.relaunch(self.cfg.workers, self.cfg.start_epoch, now, &mut out),
        }
        self.account(None, &out, now);
        out
    }

    /// Bills what this step decided; the outcome of a finished job carries the whole bill.
    fn account(&mut self, started: Option<usize>, out: &[JobAction], now: Instant) {
        self.ledger.account(started, out, now);
        let usd = self.ledger.usd(&self.cfg);
        if let Some(o) = self.outcome.as_mut() {
            o.usd = usd;
            o.worker_s = self.ledger.worker_s;
            o.coordinator_s = self.ledger.coordinator_s;
            o.launches = self.ledger.spans.clone();
            o.epochs = self.ledger.epochs.clone();
        }
    }

    #[cfg(test)]
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// The result, once [`JobAction::Finish`] was returned.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// The policy's state: its events so far, the exchange settings it chose.
    pub fn elastic(&self) -> &Elastic {
        &self.elastic
    }

    /// The bill so far, as of `now` (the job's status shows it while the job runs).
    pub fn usd_at(&self, now: Instant) -> f64 {
        self.ledger.usd_at(&self.cfg, now)
    }

    /// The workers of the current launch.
    pub fn workers(&self) -> usize {
        self.current.as_ref().map_or(self.cfg.workers, |c| c.n)
    }

    fn prewarm_wait_s(&self) -> f64 {
        // the next epoch, then the relaunch
        2.0 * self.cfg.epoch_timeout.as_secs_f64() + self.cfg.register_timeout.as_secs_f64()
    }

    pub fn handle(&mut self, event: JobEvent, now: Instant) -> Vec<JobAction> {
        let mut out = Vec::new();
        if self.over {
            return out;
        }
        let started = match &event {
            JobEvent::Started {
                launch,
                result: Ok(_),
            }
            | JobEvent::Resized {
                launch,
                result: Ok(_),
            } => Some(*launch),
            _ => None,
        };
        self.step(event, now, &mut out);
        self.account(started, &out, now);
        out
    }

    fn step(&mut self, event: JobEvent, now: Instant, out: &mut Vec<JobAction>) {
        match event {
            JobEvent::Started { launch, result } => self.started(launch, result, now, out),
            JobEvent::Worker { launch, event } => {
                if self.current.as_ref().is_some_and(|c| c.launch == launch) {
                    let cur = self.current.as_mut().expect("checked");
                    match cur.coord.as_mut() {
                        Some(coord) => {
                            let actions = coord.handle(event, now);
                            self.coordinator_actions(actions, now, out);
                        }
                        None => cur.early.push(event),
                    }
                } else if self.prewarm.as_ref().is_some_and(|p| p.launch == launch) {
                    self.prewarm_event(event, out);
                }
                // anything else comes from a launch already stopped
            }
            JobEvent::Replanned(answer) => self.replanned(answer, now, out),
            JobEvent::Resized { launch, result } => self.resized(launch, result, now, out),
            JobEvent::Tick => {
                if let Some(coord) = self.current.as_mut().and_then(|c| c.coord.as_mut()) {
                    let actions = coord.handle(Event::Tick, now);
                    self.coordinator_actions(actions, now, out);
                }
            }
        }
    }

    fn started(
        &mut self,
        launch: usize,
        result: Result<Vec<Option<u32>>, String>,
        now: Instant,
        out: &mut Vec<JobAction>,
    ) {
        if self.current.as_ref().is_some_and(|c| c.launch == launch) {
            match result {
                Ok(pids) => self.begin(pids, now, out),
                // a launch that could not start is retried like a lost worker
                Err(error) => self.stop_current(
                    Stop::Lost {
                        error: format!("starting {} workers failed: {error}", self.workers()),
                        replacing: None,
                    },
                    now,
                    out,
                ),
            }
        } else if let Some(p) = self.prewarm.as_mut().filter(|p| p.launch == launch) {
            match result {
                Ok(pids) => p.started = Some(pids),
                Err(error) => {
                    let n = p.n;
                    self.discard_prewarm(format!("prewarming {n} workers failed: {error}"), out);
                }
            }
        }
    }

    /// The current launch's workers are running: its coordinator starts counting.
    fn begin(&mut self, pids: Vec<Option<u32>>, now: Instant, out: &mut Vec<JobAction>) {
        let cfg = &self.cfg;
        let cur = self.current.as_mut().expect("a current launch");
        let mut coord = Coordinator::new(cur.n, cfg.register_timeout, cfg.epoch_timeout, now);
        coord.resume_after(cur.resume_epoch);
        for (rank, pid) in pids.into_iter().enumerate() {
            if let Some(pid) = pid {
                coord.set_pid(rank, pid);
                out.push(JobAction::Log(format!("started worker {rank} pid {pid}")));
            }
        }
        let early = std::mem::take(&mut cur.early);
        let mut actions = Vec::new();
        for ev in early {
            actions.extend(coord.handle(ev, now));
        }
        cur.coord = Some(coord);
        self.coordinator_actions(actions, now, out);
    }

    fn prewarm_event(&mut self, event: Event, out: &mut Vec<JobAction>) {
        let p = self.prewarm.as_mut().expect("checked");
        let broken = match &event {
            Event::Exited { rank, how, .. } => Some(format!("worker {rank} {how}")),
            Event::Lost { rank, reason } => Some(format!("worker {rank} {reason}")),
            Event::Failed { rank, error } => Some(format!("worker {rank} failed: {error}")),
            _ => None,
        };
        match broken {
            Some(why) => {
                let n = p.n;
                self.discard_prewarm(format!("{n} prewarmed workers discarded: {why}"), out);
            }
            None => p.early.push(event),
        }
    }

    fn discard_prewarm(&mut self, line: String, out: &mut Vec<JobAction>) {
        let Some(p) = self.prewarm.take() else { return };
        self.prewarm_failed_in = self.current.as_ref().map(|c| c.launch);
        out.push(JobAction::StopLaunch {
            launch: p.launch,
            reason: line.clone(),
            finished: false,
        });
        let line = self.elastic.event(self.last_complete, line, None);
        out.push(JobAction::Say(line));
    }

    fn coordinator_actions(
        &mut self,
        actions: Vec<Action>,
        now: Instant,
        out: &mut Vec<JobAction>,
    ) {
        let Some(launch) = self.current.as_ref().map(|c| c.launch) else {
            return;
        };
        for action in actions {
            // a stop or a relaunch earlier in this batch ends what the old coordinator had to say
            let cur = match &self.current {
                Some(c) if c.launch == launch && !self.over => c,
                _ => return,
            };
            let resume_epoch = cur.resume_epoch;
            match action {
                Action::Assign { peers } => {
                    let (boundary_sampling, staleness) = self.elastic.exchange();
                    out.push(JobAction::Assign {
                        launch,
                        peers,
                        resume_epoch,
                        mode: self.mode,
                        boundary_sampling,
                        staleness,
                        gated: self.gated(),
                    });
                }
                Action::EpochComplete { epoch, by_rank } => {
                    if epoch <= self.last_complete {
                        // cannot happen: a launch starts after the last recorded epoch
                        continue;
                    }
                    self.last_complete = epoch;
                    let usd = epoch_usd(&by_rank, self.cfg.price_per_worker_s);
                    let stop = self.elastic.after_epoch(&by_rank, self.cfg.epochs);
                    out.push(JobAction::Record {
                        epoch,
                        by_rank,
                        usd,
                    });
                    match stop {
                        Some(Stop::Replan { to, rule, values }) => {
                            self.replanning = Some((epoch, rule, values, to));
                            out.push(JobAction::Replan {
                                epoch,
                                objective: to,
                                workers: self.workers(),
                                mode: self.mode,
                                // what the policy just saw: this epoch, every rank
                                by_rank: self.elastic.last_by_rank().to_vec(),
                            });
                        }
                        Some(why @ Stop::Rescale { .. }) if self.gated() => {
                            self.resize_in_place(why, now, out)
                        }
                        Some(why) => self.stop_current(why, now, out),
                        None => {
                            self.go_on(epoch, out);
                            self.maybe_prepare(out);
                            self.maybe_prewarm(epoch, now, out)
                        }
                    }
                }
                Action::Finished {
                    summaries,
                    peak_rss_bytes,
                } => {
                    let stopped_early = summaries.first().is_some_and(|s| s.stopped_early);
                    out.push(JobAction::StopLaunch {
                        launch,
                        reason: "finished".into(),
                        finished: true,
                    });
                    self.finish(stopped_early, peak_rss_bytes, out);
                }
                Action::Fail { error, lost } => {
                    let retry = lost && (self.cfg.checkpoints || self.last_complete == 0);
                    if retry && let Some(ranks) = self.replaceable() {
                        self.replace_lost(ranks, error, out);
                    } else if retry {
                        self.stop_current(
                            Stop::Lost {
                                error,
                                replacing: None,
                            },
                            now,
                            out,
                        );
                    } else {
                        out.push(JobAction::StopLaunch {
                            launch,
                            reason: error.clone(),
                            finished: false,
                        });
                        self.fail(error, out);
                    }
                }
            }
        }
    }

    /// After the first epoch a gated launch recorded: its partitioning is fixed while it trains, so the
    /// partitionings of the counts the policy may resize it to can be cut now, during its epochs (not
    /// as it starts: the workers' setup after a resize would share the cores with the cutting).
    fn maybe_prepare(&mut self, out: &mut Vec<JobAction>) {
        let Some(launch) = self.current.as_ref().map(|c| c.launch) else {
            return;
        };
        // data parallelism and P3 move no rows: a resize takes the stored set for the new count (P3 none)
        if !self.gated() || self.mode != TrainMode::Partition || self.prepared == Some(launch) {
            return;
        }
        self.prepared = Some(launch);
        let workers = self.elastic.next_sizes();
        if !workers.is_empty() {
            out.push(JobAction::Prepare { launch, workers });
        }
    }

    /// After a recorded epoch the policy may expect to grow soon: start the next launch's workers now, so
    /// their cold start overlaps this launch's epochs; a prewarm already waiting is told to keep waiting.
    fn maybe_prewarm(&mut self, epoch: usize, now: Instant, out: &mut Vec<JobAction>) {
        let current = self.current.as_ref().map(|c| c.launch);
        if let Some(p) = &self.prewarm {
            out.push(JobAction::KeepWaiting {
                launch: p.launch,
                for_s: self.prewarm_wait_s(),
            });
            return;
        }
        if self.prewarm_failed_in.is_some() && self.prewarm_failed_in == current {
            return;
        }
        let Some(m) = self.elastic.prewarm_target() else {
            return;
        };
        let launch = self.next_launch;
        // in place, only the joiners start: the ranks above the current launch's, in its mesh
        let join = match (self.gated(), self.current.as_ref()) {
            (true, Some(cur)) if m > cur.n => Some((cur.launch, cur.n)),
            (true, _) => return,
            (false, _) => None,
        };
        self.next_launch += 1;
        match join {
            Some((joining, base)) => {
                out.push(JobAction::Log(format!(
                    "prewarming {} workers to join launch {joining} in place after epoch {epoch}",
                    m - base
                )));
                out.push(JobAction::LaunchJoiners {
                    launch,
                    joining,
                    base,
                    workers: m - base,
                    prewarm: true,
                });
            }
            None => {
                out.push(JobAction::Log(format!(
                    "prewarming {m} workers after epoch {epoch}"
                )));
                out.push(JobAction::Launch {
                    launch,
                    workers: m,
                    mode: self.mode,
                    prewarm: true,
                });
            }
        }
        self.prewarm = Some(Prewarm {
            launch,
            mode: self.mode,
            n: join.map_or(m, |(_, base)| m - base),
            join_base: join.map(|(_, base)| base),
            requested: now,
            started: None,
            early: Vec::new(),
        });
    }

    /// Stops the current launch after the last recorded epoch and acts on why.
    fn stop_current(&mut self, why: Stop, now: Instant, out: &mut Vec<JobAction>) {
        let Some(cur) = self.current.take() else {
            return;
        };
        let reason = match &why {
            Stop::Rescale { to, rule, .. } => format!("rescaling to {to} workers (rule {rule})"),
            Stop::Lost { error, .. } => format!("retrying after: {error}"),
            Stop::Reconfigure { what, .. } => format!("relaunching with {what}"),
            Stop::Replan { to, .. } => format!("replanning ({})", to.as_str()),
            Stop::Finish => "the scaling policy stopped the job".into(),
        };
        out.push(JobAction::Log(format!(
            "after epoch {}: {reason}; stopping every worker",
            self.last_complete
        )));
        out.push(JobAction::StopLaunch {
            launch: cur.launch,
            reason,
            finished: false,
        });
        self.after_stop(cur.n, why, now, out);
    }

    /// What runs after a launch of `n` workers stopped (or before the first launch of a resumed job).
    fn after_stop(&mut self, n: usize, why: Stop, now: Instant, out: &mut Vec<JobAction>) {
        let (next, line) = self.elastic.after_stop(n, self.last_complete, why);
        if let Some(line) = line {
            out.push(JobAction::Say(line));
        }
        match next {
            Next::Relaunch {
                workers,
                resume_epoch,
            } => self.relaunch(workers, resume_epoch, now, out),
            Next::Finish => self.finish(true, Vec::new(), out),
            Next::Fail(error) => self.fail(error, out),
        }
    }

    fn relaunch(&mut self, n: usize, resume_epoch: usize, now: Instant, out: &mut Vec<JobAction>) {
        match self.prewarm.take() {
            Some(p) if p.n == n && p.mode == self.mode && p.join_base.is_none() => {
                out.push(JobAction::Log(format!(
                    "segment {}: using the {n} workers prewarmed {:.2} s ago",
                    p.launch,
                    now.saturating_duration_since(p.requested).as_secs_f64()
                )));
                self.current = Some(Current {
                    launch: p.launch,
                    n,
                    resume_epoch,
                    coord: None,
                    early: p.early,
                });
                if let Some(pids) = p.started {
                    self.begin(pids, now, out);
                }
            }
            other => {
                if let Some(p) = other {
                    let (line, reason) = match p.n == n {
                        true => {
                            let why = format!(
                                "{} is needed, not {}",
                                self.mode.as_str(),
                                p.mode.as_str()
                            );
                            (why.clone(), why)
                        }
                        false => (
                            format!("{n} are needed"),
                            format!("{n} workers are needed, not {}", p.n),
                        ),
                    };
                    out.push(JobAction::Log(format!(
                        "discarding {} prewarmed workers: {line}",
                        p.n
                    )));
                    out.push(JobAction::StopLaunch {
                        launch: p.launch,
                        reason,
                        finished: false,
                    });
                }
                let launch = self.next_launch;
                self.next_launch += 1;
                out.push(JobAction::Log(format!(
                    "segment {launch}: {n} workers, {}",
                    match resume_epoch {
                        0 => "from scratch".to_string(),
                        e => format!("resuming from the checkpoint of epoch {e}"),
                    }
                )));
                out.push(JobAction::Launch {
                    launch,
                    workers: n,
                    mode: self.mode,
                    prewarm: false,
                });
                self.current = Some(Current {
                    launch,
                    n,
                    resume_epoch,
                    coord: None,
                    early: Vec::new(),
                });
            }
        }
    }

    /// The planner answered: a different shape stops the current launch and relaunches the new one from
    /// the last recorded epoch; the same shape, or no answer, keeps the job running as it is.
    fn replanned(
        &mut self,
        answer: Result<Replan, String>,
        now: Instant,
        out: &mut Vec<JobAction>,
    ) {
        let Some((epoch, rule, values, objective)) = self.replanning.take() else {
            return;
        };
        let (boundary_sampling, staleness) = self.elastic.exchange();
        let workers = self.workers();
        let now_shape = |r: &Replan| {
            r.workers == workers
                && r.mode == self.mode
                && r.boundary_sampling == boundary_sampling
                && r.staleness == staleness
        };
        let o = objective.as_str();
        match answer {
            Ok(r) if !now_shape(&r) => {
                let line = self.elastic.replanned(
                    epoch,
                    format!(
                        "replanned ({o}): {} on {workers} -> {} on {} workers ({})",
                        self.mode.as_str(),
                        r.mode.as_str(),
                        r.workers,
                        r.why
                    ),
                    Some((r.workers as u32, r.boundary_sampling, r.staleness)),
                    rule,
                    values,
                );
                out.push(JobAction::Say(line));
                self.mode = r.mode;
                if let Some(cur) = self.current.take() {
                    out.push(JobAction::StopLaunch {
                        launch: cur.launch,
                        reason: format!("replanned ({o})"),
                        finished: false,
                    });
                }
                self.relaunch(r.workers, self.last_complete, now, out);
            }
            Ok(r) => {
                let line = self.elastic.replanned(
                    epoch,
                    format!(
                        "replan ({o}) keeps {} on {workers} workers ({})",
                        r.mode.as_str(),
                        r.why
                    ),
                    None,
                    rule,
                    values,
                );
                out.push(JobAction::Say(line));
                match self.current {
                    Some(_) => {
                        self.go_on(epoch, out);
                        self.maybe_prewarm(epoch, now, out)
                    }
                    None => self.relaunch(workers, self.last_complete, now, out),
                }
            }
            Err(e) => {
                let line = self.elastic.replanned(
                    epoch,
                    format!("replan ({o}) failed, keeping the job as it runs: {e}"),
                    None,
                    rule,
                    values,
                );
                out.push(JobAction::Say(line));
                match self.current {
                    Some(_) => self.go_on(epoch, out),
                    None => self.relaunch(workers, self.last_complete, now, out),
                }
            }
        }
    }

    /// Whether the current launches are resized in place: their workers wait for the coordinator's word
    /// after every epoch. Every mode (`JobSpec::resizes_in_place` decides `in_place`).
    fn gated(&self) -> bool {
        self.cfg.in_place
    }

    /// The job keeps its shape after `epoch`: gated workers go on (the last epoch is never gated).
    fn go_on(&mut self, epoch: usize, out: &mut Vec<JobAction>) {
        if let Some(cur) = &self.current
            && self.gated()
            && epoch < self.cfg.epochs
        {
            out.push(JobAction::Continue { launch: cur.launch });
        }
    }

    /// The policy resized a gated launch after the last recorded epoch: resize it in place (the driver
    /// answers [`JobEvent::Resized`]), with the joiners prewarmed for it or started now.
    fn resize_in_place(&mut self, why: Stop, now: Instant, out: &mut Vec<JobAction>) {
        let Some(cur) = self.current.take() else {
            return;
        };
        let (next, line) = self.elastic.after_stop(cur.n, self.last_complete, why);
        if let Some(line) = line {
            out.push(JobAction::Say(line));
        }
        let Some((workers, resume_epoch)) = self.continue_in_place(cur.launch, next, out) else {
            return;
        };
        let joiners = match self.prewarm.take() {
            Some(p) if p.join_base == Some(cur.n) && cur.n + p.n == workers => Some(Joiners {
                launch: p.launch,
                prewarmed: true,
            }),
            other => {
                if let Some(p) = other {
                    out.push(JobAction::Log(format!(
                        "discarding {} prewarmed workers: {workers} are needed",
                        p.join_base.unwrap_or(0) + p.n
                    )));
                    out.push(JobAction::StopLaunch {
                        launch: p.launch,
                        reason: format!("{workers} workers are needed, not {}", p.n),
                        finished: false,
                    });
                }
                (workers > cur.n).then(|| {
                    let launch = self.next_launch;
                    self.next_launch += 1;
                    Joiners {
                        launch,
                        prewarmed: false,
                    }
                })
            }
        };
        let to = self.next_launch;
        self.next_launch += 1;
        out.push(JobAction::Log(format!(
            "segment {to}: resizing launch {} in place, {} -> {workers} workers after epoch {resume_epoch}{}",
            cur.launch,
            cur.n,
            match joiners {
                Some(j) if j.prewarmed => format!(" (joiners prewarmed as launch {})", j.launch),
                Some(j) => format!(" (joiners started now as launch {})", j.launch),
                None => String::new(),
            }
        )));
        out.push(JobAction::Resize {
            from: cur.launch,
            to,
            workers,
            mode: self.mode,
            resume_epoch,
            joiners,
            replacing: None,
        });
        self.resizing = Some((cur.launch, joiners.map(|j| j.launch)));
        self.current = Some(Current {
            launch: to,
            n: workers,
            resume_epoch,
            coord: None,
            early: Vec::new(),
        });
        let _ = now;
    }

    /// The ranks to replace when the workers the current launch lost can be replaced alone: the launch
    /// is gated (resized in place) and was training with epochs left to train, workers' processes ended
    /// or their control connections did (a frozen or silent worker is not known to be gone, unless a
    /// silence is blamed on it), and some worker survives: the lost ranks, ascending (one launch of
    /// joiners takes any set of ranks). After the last epoch the others are finishing (exiting), so a
    /// relaunch from the last checkpoint hands over the model instead.
    fn replaceable(&self) -> Option<Vec<usize>> {
        if !self.gated() || self.last_complete >= self.cfg.epochs {
            return None;
        }
        let cur = self.current.as_ref()?;
        let coord = cur.coord.as_ref()?;
        let mut lost = coord.lost();
        lost.sort_unstable();
        lost.dedup();
        (!lost.is_empty() && lost.len() < cur.n && coord.was_training()).then_some(lost)
    }

    /// Workers of the gated launch were lost: replace them alone, as an in-place resize to the same size
    /// whose joiners take their ranks. The others cancel the epoch in flight and keep their processes
    /// and parts; the epoch after the last recorded one is trained again (answered by
    /// [`JobEvent::Resized`]; a replacement that fails restarts every worker from the checkpoint).
    fn replace_lost(&mut self, ranks: Vec<usize>, error: String, out: &mut Vec<JobAction>) {
        let Some(cur) = self.current.take() else {
            return;
        };
        let lost = Stop::Lost {
            error,
            replacing: Some(ranks.clone()),
        };
        let (next, line) = self.elastic.after_stop(cur.n, self.last_complete, lost);
        if let Some(line) = line {
            out.push(JobAction::Say(line));
        }
        let Some((_, resume_epoch)) = self.continue_in_place(cur.launch, next, out) else {
            return;
        };
        let to = self.next_launch;
        let joiner = to + 1;
        self.next_launch += 2;
        let which = crate::elastic::name_ranks(&ranks);
        out.push(JobAction::Log(format!(
            "segment {to}: replacing {which} of launch {} alone (launch {joiner}); the other {} keep \
             their processes and parts, continuing after epoch {resume_epoch}",
            cur.launch,
            cur.n - ranks.len()
        )));
        let joiners = Some(Joiners {
            launch: joiner,
            prewarmed: false,
        });
        out.push(JobAction::Resize {
            from: cur.launch,
            to,
            workers: cur.n,
            mode: self.mode,
            resume_epoch,
            joiners,
            replacing: Some(ranks),
        });
        self.resizing = Some((cur.launch, Some(joiner)));
        self.current = Some(Current {
            launch: to,
            n: cur.n,
            resume_epoch,
            coord: None,
            early: Vec::new(),
        });
    }

    /// What the policy said after launch `launch` was taken off for an in-place change: the worker count
    /// and epoch to continue with, or (the policy finished the job, or the retries ran out) nothing: the
    /// launch is stopped and the job ends here.
    fn continue_in_place(
        &mut self,
        launch: usize,
        next: Next,
        out: &mut Vec<JobAction>,
    ) -> Option<(usize, usize)> {
        let (reason, end) = match next {
            Next::Relaunch {
                workers,
                resume_epoch,
            } => return Some((workers, resume_epoch)),
            Next::Finish => ("the scaling policy stopped the job".to_string(), None),
            Next::Fail(error) => (error.clone(), Some(error)),
        };
        out.push(JobAction::StopLaunch {
            launch,
            reason,
            finished: false,
        });
        match end {
            None => self.finish(true, Vec::new(), out),
            Some(error) => self.fail(error, out),
        }
        None
    }

    /// The driver's answer to [`JobAction::Resize`]: the resized launch registers as a started one, or
    /// (a resize that failed part-way) every worker of it stops and the job restarts from the checkpoint.
    fn resized(
        &mut self,
        launch: usize,
        result: Result<Vec<(Option<u32>, SocketAddr)>, String>,
        now: Instant,
        out: &mut Vec<JobAction>,
    ) {
        if self.current.as_ref().is_none_or(|c| c.launch != launch) {
            return;
        }
        let Some((from, joiners)) = self.resizing.take() else {
            return;
        };
        match result {
            Ok(ready) => {
                let pids = ready.iter().map(|(pid, _)| *pid).collect();
                let cur = self.current.as_mut().expect("checked");
                cur.early = ready
                    .into_iter()
                    .enumerate()
                    .map(|(rank, (pid, mesh_addr))| Event::Registered {
                        rank,
                        pid: pid.unwrap_or(0),
                        mesh_addr,
                    })
                    .collect();
                self.begin(pids, now, out);
            }
            Err(error) => {
                let cur = self.current.take().expect("checked");
                for l in std::iter::once(from).chain(joiners) {
                    out.push(JobAction::StopLaunch {
                        launch: l,
                        reason: format!("the in-place resize failed: {error}"),
                        finished: false,
                    });
                }
                let line = self.elastic.event(
                    cur.resume_epoch,
                    format!(
                        "resizing in place to {} workers failed ({error}); restarting from the \
                         checkpoint of epoch {}",
                        cur.n, cur.resume_epoch
                    ),
                    None,
                );
                out.push(JobAction::Say(line));
                self.relaunch(cur.n, cur.resume_epoch, now, out);
            }
        }
    }

    fn stop_prewarm(&mut self, out: &mut Vec<JobAction>) {
        if let Some(p) = self.prewarm.take() {
            out.push(JobAction::StopLaunch {
                launch: p.launch,
                reason: "the job ended".into(),
                finished: false,
            });
        }
    }

    fn finish(
        &mut self,
        stopped_early: bool,
        worker_peak_rss: Vec<Option<u64>>,
        out: &mut Vec<JobAction>,
    ) {
        self.stop_prewarm(out);
        self.current = None;
        self.over = true;
        self.outcome = Some(Outcome {
            summary: self.elastic.summary(self.cfg.seed, stopped_early).summary,
            worker_peak_rss,
            bytes_exchanged: self.elastic.bytes,
            // billed once this step's stops are accounted (`Job::account`)
            usd: 0.0,
            worker_s: 0.0,
            coordinator_s: 0.0,
            launches: Vec::new(),
            epochs: Vec::new(),
        });
        out.push(JobAction::Finish);
    }

    fn fail(&mut self, error: String, out: &mut Vec<JobAction>) {
        self.stop_prewarm(out);
        self.current = None;
        self.over = true;
        out.push(JobAction::Fail { error });
    }
}

#[cfg(test)]
mod simulation {
    //! The whole job in virtual time, TigerBeetle's VOPR in miniature: a seeded fake cluster under the
    //! real [`Job`] (and through it the real [`Coordinator`] and [`Elastic`]), with launches that fail or
    //! start slowly, prewarms that fail, workers lost before registering, while waiting for the
    //! assignment and in any epoch, and the coordinator dying at any step and being resumed from the
    //! record and the newest checkpoint, as `submit --resume` does. Training is exact, so an epoch's
    //! metrics are a function of the epoch alone and the uninterrupted loss curve is known.
    //!
    //! A failing seed is printed; `PHYSALIA_SIM_SEED=<seed>` replays just that one.

    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

    use physalia_control::MetricsLine;
    use physalia_gnn::rng::Stream;
    use physalia_policies::PolicySet;
    use serde_json::json;

    use super::*;

    const EPOCHS: usize = 24;

    fn loss(epoch: usize) -> f64 {
        0.3 + 0.7 * (-(epoch as f64) / 5.0).exp()
    }

    /// An epoch's metrics: training is exact, so the loss depends on the epoch alone; a partition-parallel
    /// epoch spends most of its time waiting for halo rows (this cluster's network is slow), a data-parallel
    /// one little.
    fn metrics(epoch: usize, n: usize, mode: TrainMode) -> EpochMetrics {
        let train_s = 8.0 / n as f64 + 0.3 * n as f64;
        let halo_share = if mode == TrainMode::Partition {
            0.7
        } else {
            0.1
        };
        EpochMetrics {
            epoch,
            loss: loss(epoch),
            train_acc: None,
            val_acc: Some(1.0 - loss(epoch) / 2.0),
            test_acc: Some(1.0 - loss(epoch) / 2.0),
            train_s,
            eval_s: 0.1,
            exchange: physalia_gnn::ExchangeStats {
                halo_s: halo_share * train_s,
                ..Default::default()
            },
            batches: None,
            device: None,
            prepare_s: None,
        }
    }

    /// The planner of the simulated cluster: when the measured epochs spend most of their time on the
    /// halo exchange, data parallelism on twice the workers (at most 4) is faster; otherwise keep.
    fn fake_planner(
        workers: usize,
        mode: TrainMode,
        by_rank: &[EpochMetrics],
    ) -> Result<Replan, String> {
        if by_rank.is_empty() {
            return Err("no measured epoch".into());
        }
        let halo: f64 = by_rank.iter().map(|m| m.exchange.halo_s).sum();
        let train: f64 = by_rank.iter().map(|m| m.train_s).sum();
        let (workers, mode) = if halo > 0.5 * train {
            ((2 * workers).min(4), TrainMode::Data)
        } else {
            (workers, mode)
        };
        Ok(Replan {
            workers,
            mode,
            boundary_sampling: 1.0,
            staleness: 0,
            why: format!("measured halo share {:.2}", halo / train),
        })
    }

    fn summary() -> TrainSummary {
        TrainSummary {
            epochs: vec![],
            best_epoch: None,
            best_val_acc: None,
            test_acc_at_best_val: None,
            stopped_early: false,
        }
    }

    /// Chances of each fault, drawn per seed.
    #[derive(Debug, Clone, Copy)]
    struct Faults {
        launch_fails: f32,
        slow_start: f32,
        worker_lost: f32,
        coordinator_dies: f32,
    }

    /// What the simulated job costs in virtual time: its epochs, a launch's cold start, an epoch (by
    /// default the metrics' time on the launch's worker count), and the cut: the time the workers of a
    /// launch that starts from scratch (no committed partition set: the set is committed with the
    /// first epoch) spend cutting their parts before the first epoch.
    #[derive(Debug, Clone, Copy)]
    struct Workload {
        epochs: usize,
        cold_ms: u64,
        epoch_ms: Option<u64>,
        cut_ms: u64,
        epoch_timeout: Duration,
    }

    impl Default for Workload {
        fn default() -> Self {
            Workload {
                epochs: EPOCHS,
                cold_ms: 3_000,
                epoch_ms: None,
                cut_ms: 0,
                epoch_timeout: Duration::from_secs(60),
            }
        }
    }

    #[derive(Debug, Default)]
    struct SimLaunch {
        n: usize,
        prewarm: bool,
        stopped: bool,
        assigned: bool,
        /// Events of this launch after this virtual time never happen (a worker died: the mesh halts).
        halted_at: Option<u64>,
    }

    /// One scheduled thing: (time in ms, sequence, launch, event, bypasses a halt).
    type Item = (u64, u64, usize, u64);

    struct Sim {
        rng: Stream,
        draws: u64,
        faults: Faults,
        work: Workload,
        /// Workers lost while their launch cut its parts (after the assignment, before epoch 1).
        lost_while_cutting: usize,
        t0: Instant,
        now_ms: u64,
        seq: u64,
        queue: BinaryHeap<Reverse<Item>>,
        events: BTreeMap<u64, (JobEvent, bool)>,
        launches: BTreeMap<usize, SimLaunch>,
        /// The job store: metrics.jsonl's lines and the checkpoints on disk.
        record: Vec<MetricsLine>,
        checkpoints: BTreeSet<usize>,
        deaths: usize,
        lines: Vec<String>,
        /// Answers of the fake planner, handed to the job after the actions that asked.
        answers: Vec<JobEvent>,
        /// Every assignment: (launch, resume epoch, workers, mode).
        assigned: Vec<(usize, usize, usize, TrainMode)>,
        /// The worker counts each launch's next partitionings were prepared for, and the resizes in
        /// place whose count was (true) or was not (false) among its launch's.
        prepared: BTreeMap<usize, Vec<usize>>,
        resizes_prepared: Vec<bool>,
        /// Prices of a worker-second and of the coordinator's second.
        prices: (f64, f64),
        /// The bill as the platform sees it: when each launch's workers came up, and worker-milliseconds
        /// from then to the job's stop.
        started_ms: BTreeMap<usize, u64>,
        billed_worker_ms: u64,
        /// A resize in place, by the launch it makes: the launches it is made of, whose workers run
        /// (paused, or starting) until it is ready.
        resizing: BTreeMap<usize, Vec<usize>>,
        /// Lost workers replaced alone (their launch's others kept).
        replaced: usize,
    }

    impl Sim {
        /// Bills `launch`'s workers from their start to now.
        fn bill_stop(&mut self, launch: usize) {
            if let (Some(l), Some(t)) =
                (self.launches.get(&launch), self.started_ms.remove(&launch))
            {
                self.billed_worker_ms += l.n as u64 * (self.now_ms - t);
            }
        }

        fn draw(&mut self) -> f32 {
            self.draws += 1;
            self.rng.uniform(self.draws)
        }

        fn at(&mut self, ms: u64, launch: usize, event: JobEvent, forced: bool) {
            self.seq += 1;
            self.events.insert(self.seq, (event, forced));
            self.queue.push(Reverse((ms, self.seq, launch, self.seq)));
        }

        fn now(&self) -> Instant {
            self.t0 + Duration::from_millis(self.now_ms)
        }

        fn epoch_ms(&self, n: usize) -> u64 {
            self.work.epoch_ms.unwrap_or_else(|| {
                let m = metrics(1, n, TrainMode::Partition);
                ((m.train_s + m.eval_s) * 1000.0) as u64
            })
        }

        fn launch(&mut self, launch: usize, n: usize, prewarm: bool) {
            self.launches.insert(
                launch,
                SimLaunch {
                    n,
                    prewarm,
                    ..Default::default()
                },
            );
            let t = self.now_ms;
            if self.draw() < self.faults.launch_fails {
                self.at(
                    t + 2_000,
                    launch,
                    JobEvent::Started {
                        launch,
                        result: Err("no capacity".into()),
                    },
                    true,
                );
                return;
            }
            let cold = if self.draw() < self.faults.slow_start {
                self.work.cold_ms * 25 / 3
            } else {
                self.work.cold_ms
            };
            let pids = (0..n)
                .map(|r| Some(1000 * launch as u32 + r as u32))
                .collect();
            // the backend always answers (its launch call is bounded); a worker dead by then is seen later
            self.at(
                t + cold,
                launch,
                JobEvent::Started {
                    launch,
                    result: Ok(pids),
                },
                true,
            );
            for rank in 0..n {
                self.at(
                    t + cold + 100 + 37 * rank as u64,
                    launch,
                    JobEvent::Worker {
                        launch,
                        event: Event::Registered {
                            rank,
                            pid: 1000 * launch as u32 + rank as u32,
                            mesh_addr: format!("10.0.{launch}.{rank}:7000").parse().unwrap(),
                        },
                    },
                    false,
                );
            }
            // a worker of this launch may die at any moment of its life: before registering, while
            // waiting for its assignment, or in any epoch
            if self.draw() < self.faults.worker_lost {
                let rank = (self.draw() * n as f32) as usize % n;
                let life =
                    cold + 200 + self.work.cut_ms + self.epoch_ms(n) * self.work.epochs as u64;
                let at = t + (self.draw() as f64 * life as f64) as u64;
                self.at(
                    at,
                    launch,
                    JobEvent::Worker {
                        launch,
                        event: Event::Exited {
                            rank,
                            how: "exited with signal 9".into(),
                            by_signal: true,
                        },
                    },
                    true,
                );
                // its peers notice when they next need it
                for peer in (0..n).filter(|&p| p != rank) {
                    self.at(
                        at + 400,
                        launch,
                        JobEvent::Worker {
                            launch,
                            event: Event::Failed {
                                rank: peer,
                                error: format!("peer {rank} is gone"),
                            },
                        },
                        true,
                    );
                }
                self.launches.get_mut(&launch).unwrap().halted_at = Some(at);
            }
        }

        /// An in-place resize: the old launch's and the joiners' scheduled events end; the resized
        /// launch is ready shortly, unless a worker is lost meanwhile (a joiner, a leaver or a survivor),
        /// which fails the resize.
        fn resize(
            &mut self,
            from: usize,
            to: usize,
            n: usize,
            resume_epoch: usize,
            joiners: Option<Joiners>,
            // the count of the lost workers' ranks replaced
            replacing: Option<usize>,
        ) {
            assert_eq!(
                resume_epoch,
                self.record.len(),
                "resized after an unrecorded epoch"
            );
            assert!(!self.launches.contains_key(&to), "launch {to} reused");
            let n_old = {
                let l = &self.launches[&from];
                assert!(
                    !l.stopped && l.assigned,
                    "resized launch {from} is not training"
                );
                l.n
            };
            // their events end here; their workers run (and are billed) until the resize is over
            if let Some(j) = joiners
                && !j.prewarmed
            {
                // joiners started now
                self.launches.insert(
                    j.launch,
                    SimLaunch {
                        // lost workers' replacements: one per rank replaced
                        n: replacing.unwrap_or(n.saturating_sub(n_old)),
                        ..Default::default()
                    },
                );
                self.started_ms.insert(j.launch, self.now_ms);
            }
            for launch in std::iter::once(from).chain(joiners.map(|j| j.launch)) {
                if let Some(l) = self.launches.get_mut(&launch) {
                    l.stopped = true;
                }
            }
            self.resizing.insert(
                to,
                std::iter::once(from)
                    .chain(joiners.map(|j| j.launch))
                    .collect(),
            );
            self.launches.insert(
                to,
                SimLaunch {
                    n,
                    ..Default::default()
                },
            );
            let t = self.now_ms;
            let result = if self.draw() < self.faults.worker_lost / 2.0 {
                let who = match (self.draw() * 3.0) as usize {
                    0 if n > n_old || replacing.is_some() => "a joiner",
                    1 if n < n_old => "a leaver",
                    _ => "a survivor",
                };
                Err(format!("{who} was lost during the resize"))
            } else {
                Ok((0..n)
                    .map(|r| {
                        (
                            Some(1000 * to as u32 + r as u32),
                            format!("10.0.{to}.{r}:7000").parse().unwrap(),
                        )
                    })
                    .collect())
            };
            // a joiner that was not prewarmed starts now
            let cold = if joiners.is_some_and(|j| !j.prewarmed) {
                3_000
            } else {
                300
            };
            self.at(t + cold, to, JobEvent::Resized { launch: to, result }, true);
        }

        fn assign(&mut self, launch: usize, peers: usize, resume_epoch: usize, mode: TrainMode) {
            self.assigned.push((launch, resume_epoch, peers, mode));
            let l = self
                .launches
                .get_mut(&launch)
                .expect("assigned a launch never started");
            assert!(!l.stopped, "assigned a stopped launch {launch}");
            assert!(!l.assigned, "launch {launch} assigned twice");
            assert_eq!(peers, l.n, "launch {launch}: peers for another world size");
            l.assigned = true;
            let n = l.n;
            let halted_at = l.halted_at;
            let d = self.epoch_ms(n);
            // from scratch, the workers cut their parts first (no set is committed before epoch 1)
            let cut = if resume_epoch == 0 {
                self.work.cut_ms
            } else {
                0
            };
            if cut > 0 && halted_at.is_some_and(|h| h >= self.now_ms && h < self.now_ms + 50 + cut)
            {
                self.lost_while_cutting += 1;
            }
            let mut t = self.now_ms + 50 + cut;
            for epoch in resume_epoch + 1..=self.work.epochs {
                t += d;
                for rank in 0..n {
                    self.at(
                        t + 3 * ((rank * 7 + epoch) % n) as u64,
                        launch,
                        JobEvent::Worker {
                            launch,
                            event: Event::Epoch {
                                rank,
                                metrics: metrics(epoch, n, mode),
                            },
                        },
                        false,
                    );
                }
                // rank 0 writes the checkpoint before it reports the epoch
                self.seq += 1;
                self.queue
                    .push(Reverse((t - 1, self.seq, launch, u64::MAX - epoch as u64)));
            }
            // every rank reports its last epoch (spread over 3 ms a rank) before any says it is done
            let t = t + 3 * n as u64;
            for rank in 0..n {
                self.at(
                    t + 20 + rank as u64,
                    launch,
                    JobEvent::Worker {
                        launch,
                        event: Event::Done {
                            rank,
                            summary: summary(),
                            peak_rss_bytes: Some(1),
                        },
                    },
                    false,
                );
                self.at(
                    t + 40 + rank as u64,
                    launch,
                    JobEvent::Worker {
                        launch,
                        event: Event::Exited {
                            rank,
                            how: "exited with status 0".into(),
                            by_signal: false,
                        },
                    },
                    false,
                );
            }
        }

        /// Runs the actions, and hands the job the planner's answers to them; returns true when the job
        /// ended (finished or failed: the second in `failed`).
        fn feed(
            &mut self,
            job: &mut Job,
            actions: Vec<JobAction>,
            failed: &mut Option<String>,
        ) -> bool {
            let mut over = self.act(actions, failed);
            while !over && !self.answers.is_empty() {
                let answer = self.answers.remove(0);
                let actions = job.handle(answer, self.now());
                over = self.act(actions, failed);
            }
            self.answers.clear();
            over
        }

        fn act(&mut self, actions: Vec<JobAction>, failed: &mut Option<String>) -> bool {
            let mut over = false;
            for a in actions {
                match a {
                    JobAction::Launch {
                        launch,
                        workers,
                        prewarm,
                        ..
                    } => {
                        assert!(
                            !self.launches.contains_key(&launch),
                            "launch {launch} reused"
                        );
                        self.launch(launch, workers, prewarm);
                    }
                    JobAction::Assign {
                        launch,
                        peers,
                        resume_epoch,
                        mode,
                        ..
                    } => {
                        assert_eq!(
                            resume_epoch,
                            self.record.len(),
                            "launch {launch} resumes from epoch {resume_epoch}, the record has {}",
                            self.record.len()
                        );
                        assert!(
                            resume_epoch == 0 || self.checkpoints.contains(&resume_epoch),
                            "no checkpoint of epoch {resume_epoch}"
                        );
                        self.assign(launch, peers.len(), resume_epoch, mode);
                    }
                    JobAction::KeepWaiting { launch, .. } => {
                        let l = &self.launches[&launch];
                        assert!(
                            l.prewarm && !l.stopped && !l.assigned,
                            "kept waiting {launch}"
                        );
                    }
                    JobAction::StopLaunch { launch, .. } => {
                        if let Some(l) = self.launches.get_mut(&launch) {
                            l.stopped = true;
                        }
                        self.bill_stop(launch);
                    }
                    JobAction::Record { epoch, by_rank, .. } => {
                        assert_eq!(epoch, self.record.len() + 1, "recorded out of order");
                        assert!(
                            self.checkpoints.contains(&epoch),
                            "epoch {epoch} has no checkpoint"
                        );
                        self.record.push(MetricsLine::coordinated(0, &by_rank, 0.0));
                        // the driver deletes the checkpoint before
                        if epoch > 1 {
                            self.checkpoints.remove(&(epoch - 1));
                        }
                    }
                    JobAction::Replan {
                        workers,
                        mode,
                        by_rank,
                        ..
                    } => self
                        .answers
                        .push(JobEvent::Replanned(fake_planner(workers, mode, &by_rank))),
                    JobAction::Say(line) | JobAction::Log(line) => self.lines.push(line),
                    JobAction::LaunchJoiners {
                        launch,
                        joining,
                        workers,
                        ..
                    } => {
                        assert!(
                            !self.launches.contains_key(&launch),
                            "launch {launch} reused"
                        );
                        assert!(
                            self.launches.get(&joining).is_some_and(|l| !l.stopped),
                            "joiners of launch {joining}, which is not running"
                        );
                        self.launch(launch, workers, true);
                    }
                    // the simulated workers do not wait between epochs: their epochs are scheduled
                    JobAction::Continue { .. } => {}
                    JobAction::Prepare { launch, workers } => {
                        let l = &self.launches[&launch];
                        assert!(
                            l.assigned && !l.stopped,
                            "prepared for launch {launch}, which is not training"
                        );
                        assert!(
                            !workers.contains(&l.n),
                            "prepared launch {launch}'s own size"
                        );
                        assert!(
                            self.prepared.insert(launch, workers).is_none(),
                            "launch {launch} prepared twice"
                        );
                    }
                    JobAction::Resize {
                        from,
                        to,
                        workers,
                        resume_epoch,
                        joiners,
                        replacing,
                        ..
                    } => {
                        if let Some(ranks) = replacing {
                            let l = &self.launches[&from];
                            assert_eq!(workers, l.n, "a replacement keeps launch {from}'s size");
                            assert!(
                                !ranks.is_empty() && ranks.len() < l.n,
                                "replaced ranks {ranks:?} of {}: one survives",
                                l.n
                            );
                            assert!(
                                ranks.windows(2).all(|w| w[0] < w[1])
                                    && ranks.last().is_some_and(|&r| r < l.n),
                                "replaced ranks {ranks:?} of {}: ascending ranks of the launch",
                                l.n
                            );
                            assert!(
                                l.halted_at.is_some(),
                                "launch {from} lost no worker, yet one is replaced"
                            );
                            self.replaced += 1;
                            let n = ranks.len();
                            self.resize(from, to, workers, resume_epoch, joiners, Some(n));
                            continue;
                        }
                        // a launch resized after its first epoch has asked for its next counts
                        if let Some(sizes) = self.prepared.get(&from) {
                            assert!(
                                sizes.contains(&workers),
                                "launch {from} resized to {workers}, prepared {sizes:?}"
                            );
                        }
                        self.resizes_prepared
                            .push(self.prepared.contains_key(&from));
                        self.resize(from, to, workers, resume_epoch, joiners, None)
                    }
                    JobAction::Finish => over = true,
                    JobAction::Fail { error } => {
                        *failed = Some(error);
                        over = true;
                    }
                }
            }
            over
        }
    }

    fn never() -> PolicySet {
        serde_json::from_value(json!({ "max_workers": 3, "rules": [] })).unwrap()
    }

    fn double_on_plateau() -> PolicySet {
        let text = include_str!("../../examples/policies/double-on-plateau.yaml")
            .replace("max_workers: 16", "max_workers: 8");
        physalia_policies::parse_str(&text, "double-on-plateau.yaml").unwrap()
    }

    fn cfg(workers: usize, start_epoch: usize) -> JobConfig {
        JobConfig {
            workers,
            epochs: EPOCHS,
            seed: 0,
            register_timeout: Duration::from_secs(30),
            epoch_timeout: Duration::from_secs(60),
            checkpoints: true,
            start_epoch,
            price_per_worker_s: 0.0,
            coordinator_price_per_s: 0.0,
            mode: TrainMode::Partition,
            in_place: false,
        }
    }

    /// A new coordinator for the job store's state, as `submit --resume` makes it.
    fn resume(sim: &mut Sim, policy: &PolicySet, workers: usize) -> (Job, Vec<JobAction>) {
        let ck = sim
            .checkpoints
            .iter()
            .copied()
            .filter(|&e| e <= sim.record.len())
            .max()
            .unwrap_or(0);
        sim.record.truncate(ck);
        let epochs = sim.work.epochs;
        let mut el =
            Elastic::new(policy.clone(), workers as u32, epochs as u32, 0.0).with_max_retries(50);
        let mut n = workers;
        let mut pending = None;
        if ck > 0 {
            pending = el.replay(&sim.record, epochs);
            n = sim.record[ck - 1].worker_count();
        }
        let first = sim.launches.keys().next_back().map_or(0, |l| l + 1);
        let mut c = cfg(n, ck);
        c.epochs = epochs;
        c.epoch_timeout = sim.work.epoch_timeout;
        (c.price_per_worker_s, c.coordinator_price_per_s) = sim.prices;
        // as the driver decides it: partition parallelism resizes in place unless the policy restarts
        c.in_place = policy.resize == physalia_policies::Resize::InPlace;
        let mut job = Job::new(c, el, first);
        let actions = job.start(pending, sim.now());
        (job, actions)
    }

    struct Run {
        failed: Option<String>,
        sim: Sim,
        outcome: Option<Outcome>,
    }

    fn run(seed: u64, policy: &PolicySet, workers: usize) -> Run {
        let rng = Stream::new(seed, &[0x5133]);
        let f = |i: u64, max: f32| rng.uniform(i) * max;
        let faults = Faults {
            launch_fails: f(1, 0.25),
            slow_start: f(2, 0.5),
            worker_lost: f(3, 0.6),
            coordinator_dies: f(4, 0.01),
        };
        run_with(seed, policy, workers, faults)
    }

    fn run_with(seed: u64, policy: &PolicySet, workers: usize, faults: Faults) -> Run {
        run_priced(seed, policy, workers, faults, (0.0, 0.0))
    }

    fn run_priced(
        seed: u64,
        policy: &PolicySet,
        workers: usize,
        faults: Faults,
        prices: (f64, f64),
    ) -> Run {
        run_workload(seed, policy, workers, faults, prices, Workload::default())
    }

    fn run_workload(
        seed: u64,
        policy: &PolicySet,
        workers: usize,
        faults: Faults,
        prices: (f64, f64),
        work: Workload,
    ) -> Run {
        let mut sim = Sim {
            rng: Stream::new(seed, &[0xFA17]),
            draws: 0,
            faults,
            work,
            lost_while_cutting: 0,
            t0: Instant::now(),
            now_ms: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            launches: BTreeMap::new(),
            record: Vec::new(),
            checkpoints: BTreeSet::new(),
            deaths: 0,
            lines: Vec::new(),
            answers: Vec::new(),
            assigned: Vec::new(),
            prepared: BTreeMap::new(),
            resizes_prepared: Vec::new(),
            prices,
            started_ms: BTreeMap::new(),
            billed_worker_ms: 0,
            resizing: BTreeMap::new(),
            replaced: 0,
        };
        let mut failed = None;
        let (mut job, actions) = resume(&mut sim, policy, workers);
        let mut over = sim.feed(&mut job, actions, &mut failed);
        let mut next_tick = 500u64;
        let mut steps = 0;
        while !over {
            steps += 1;
            assert!(steps < 200_000, "seed {seed}: no end in sight");
            // the coordinator dies: every worker goes with it; a new one resumes from the store
            if sim.deaths < 5 && sim.draw() < sim.faults.coordinator_dies {
                sim.deaths += 1;
                for l in sim.launches.values_mut() {
                    l.stopped = true;
                }
                sim.queue.clear();
                let (j, actions) = resume(&mut sim, policy, workers);
                job = j;
                over = sim.feed(&mut job, actions, &mut failed);
                continue;
            }
            let next = sim.queue.peek().map(|Reverse(i)| i.0);
            let actions = match next {
                Some(t) if t <= next_tick => {
                    let Reverse((t, _, launch, key)) = sim.queue.pop().unwrap();
                    sim.now_ms = t;
                    let l = &sim.launches[&launch];
                    if key > u64::MAX - 1_000_000 {
                        // a checkpoint write
                        if !l.stopped && l.halted_at.is_none_or(|h| t < h) {
                            sim.checkpoints.insert((u64::MAX - key) as usize);
                        }
                        continue;
                    }
                    let (event, forced) = sim.events.remove(&key).unwrap();
                    let l = &sim.launches[&launch];
                    if l.stopped || (!forced && l.halted_at.is_some_and(|h| t >= h)) {
                        continue;
                    }
                    match &event {
                        JobEvent::Started { result: Ok(_), .. } => {
                            sim.started_ms.insert(launch, t);
                        }
                        JobEvent::Resized { result: Ok(_), .. } => {
                            for l in sim.resizing.remove(&launch).unwrap_or_default() {
                                sim.bill_stop(l);
                            }
                            sim.started_ms.insert(launch, t);
                        }
                        // a failed resize's launch never ran
                        JobEvent::Resized { result: Err(_), .. } => {
                            sim.launches.get_mut(&launch).unwrap().stopped = true;
                        }
                        _ => {}
                    }
                    job.handle(event, sim.now())
                }
                _ => {
                    sim.now_ms = next_tick;
                    next_tick += 500;
                    job.handle(JobEvent::Tick, sim.now())
                }
            };
            over = sim.feed(&mut job, actions, &mut failed);
        }
        let outcome = job.outcome().cloned();
        Run {
            failed,
            sim,
            outcome,
        }
    }

    fn check(seed: u64, policy: &PolicySet, workers: usize) {
        verify(seed, policy, &run(seed, policy, workers));
    }

    /// A finished run's record: every epoch once, in order, with the uninterrupted loss, on a worker
    /// count the policy allows; every launch stopped.
    fn verify(seed: u64, policy: &PolicySet, r: &Run) {
        let what = format!(
            "seed {seed} (replay: PHYSALIA_SIM_SEED={seed}), faults {:?}, coordinator deaths {}",
            r.sim.faults, r.sim.deaths
        );
        assert!(
            r.failed.is_none(),
            "{what}: the job failed: {:?}\n{}",
            r.failed,
            r.sim.lines.join("\n")
        );
        let outcome = r.outcome.as_ref().expect("a finished job has an outcome");
        // every epoch recorded exactly once, in order, with the uninterrupted run's loss
        let epochs: Vec<u64> = r
            .sim
            .record
            .iter()
            .map(|l| l.metrics.epoch as u64)
            .collect();
        let stopped = outcome.summary.stopped_early;
        assert!(
            epochs.len() == r.sim.work.epochs || stopped,
            "{what}: {} epochs recorded",
            epochs.len()
        );
        assert_eq!(
            epochs,
            (1..=epochs.len() as u64).collect::<Vec<_>>(),
            "{what}"
        );
        for l in &r.sim.record {
            let e = l.metrics.epoch;
            assert_eq!(l.metrics.loss, loss(e), "{what}: epoch {e}");
            let n = l.worker_count();
            assert!(
                (policy.min_workers.max(1) as usize..=policy.max_workers as usize).contains(&n),
                "{what}: epoch {e} on {n} workers"
            );
        }
        // the result covers the epochs of the last coordinator's record (a resumed one replays the rest)
        assert!(outcome.summary.epochs.len() <= epochs.len(), "{what}");
        // nothing outlives the job
        for (i, l) in &r.sim.launches {
            assert!(l.stopped, "{what}: launch {i} was never stopped");
        }
    }

    /// A 64-worker partition-parallel job on ogbn-papers100M end to end in virtual time (issue 31): the
    /// planner's prediction for 64 parts of its published sizes (GraphSAGE 2 x 128 on aks-d16s-v5) sets
    /// the cold start (158 s), the epoch (24 s) and, as the time the workers spend before their first
    /// epoch, its partition step (35 min: the planner's streamed assignment and cut, charged whole to
    /// every launch from scratch, though a real retry keeps the stored assignment); launches that fail
    /// or start slowly, workers lost at any moment (while they cut included) and coordinators that die
    /// leave every epoch recorded once with the uninterrupted curve on 64 workers. Without faults the job
    /// takes the cold start, the cut and the epochs, nothing more. The epoch timeout covers the cut: a
    /// real worker beats while it cuts (`beat_while_computing`), which this cluster does not model.
    #[test]
    fn a_64_worker_papers100m_job_runs_end_to_end_in_virtual_time() {
        use physalia_planner as planner;
        let (_, nodes, edges, feat_dim, classes, train_nodes) = crate::spec::KNOWN_GRAPHS
            .into_iter()
            .find(|g| g.0 == "ogbn-papers100M")
            .unwrap();
        let exchange = planner::ExchangeOptions {
            rematerialize: true,
            ..Default::default()
        };
        let req = planner::PlanRequest {
            graph: planner::GraphStats {
                nodes,
                edges,
                feat_dim,
                classes,
                train_nodes,
                feature_bytes_per_value: 4,
                chunked: true,
            },
            partitions: Vec::new(),
            model: planner::ModelShape {
                kind: planner::ModelKind::Sage,
                layers: 2,
                hidden: 128,
                heads: 1,
                out_heads: 1,
                input_dropout: 0.0,
            },
            train: planner::TrainShape {
                epochs: 10,
                batch_size: 1024,
                fanouts: vec![15, 10],
                eval_every: 1,
                cache_rows: None,
                exchange: exchange.clone(),
            },
            constraints: Default::default(),
            assumptions: Default::default(),
        };
        let catalog = planner::Catalog::builtin();
        let sku = catalog.get("aks-d16s-v5").unwrap();
        let candidate = planner::Candidate {
            mode: planner::Mode::Partition,
            workers: 64,
            parts: 64,
            replicas: 1,
            sku: sku.name.clone(),
            backend: sku.backend,
            exchange,
            cache_rows: 0,
        };
        let prediction = planner::predict(&req, sku, &candidate, None).unwrap();
        let step = planner::partition_step(&req, &candidate, &prediction).unwrap();
        let ms = |s: f64| (s * 1000.0).round() as u64;
        let work = Workload {
            epochs: 10,
            cold_ms: ms(prediction.time.setup_s),
            epoch_ms: Some(ms(prediction.time.epoch_s)),
            cut_ms: ms(step.chosen.seconds),
            epoch_timeout: Duration::from_secs_f64(
                2.0 * (step.chosen.seconds + prediction.time.epoch_s),
            ),
        };
        assert!(
            work.cut_ms > 60_000 && work.epoch_ms.unwrap() > 1_000 && work.cold_ms > 10_000,
            "{work:?}"
        );
        let fixed: PolicySet =
            serde_json::from_value(json!({ "min_workers": 64, "max_workers": 64, "rules": [] }))
                .unwrap();
        // no faults: the cold start, the cut and ten epochs (and the registrations' and reports' ms)
        let calm = Faults {
            launch_fails: 0.0,
            slow_start: 0.0,
            worker_lost: 0.0,
            coordinator_dies: 0.0,
        };
        let r = run_workload(0, &fixed, 64, calm, (0.0, 0.0), work);
        verify(0, &fixed, &r);
        let floor = work.cold_ms + work.cut_ms + 10 * work.epoch_ms.unwrap();
        assert!(
            r.sim.now_ms >= floor && r.sim.now_ms <= floor + 10_000,
            "{} ms against {floor} ms",
            r.sim.now_ms
        );
        assert!(r.sim.record.iter().all(|l| l.worker_count() == 64));
        // faults: every seed's record is the uninterrupted one; some seeds lose a worker while the
        // workers cut, and the retried launch cuts again before its first epoch
        let mut lost_while_cutting = 0;
        for seed in 0..24u64 {
            let rng = Stream::new(seed, &[0x3100]);
            let f = |i: u64, max: f32| rng.uniform(i) * max;
            let faults = Faults {
                launch_fails: f(1, 0.2),
                slow_start: f(2, 0.5),
                worker_lost: 0.2 + f(3, 0.6),
                coordinator_dies: f(4, 0.002),
            };
            let r = run_workload(seed, &fixed, 64, faults, (0.0, 0.0), work);
            verify(seed, &fixed, &r);
            assert!(r.sim.record.iter().all(|l| l.worker_count() == 64));
            assert!(r.sim.now_ms >= floor, "seed {seed}");
            lost_while_cutting += r.sim.lost_while_cutting;
        }
        assert!(
            lost_while_cutting > 0,
            "no seed lost a worker while cutting"
        );
        eprintln!(
            "papers100M on 64 x {}: {work:?}; workers lost while cutting over 24 seeds: {lost_while_cutting}",
            sku.name
        );
    }

    /// 1 -> 2 -> 4 -> 2 workers after epochs 3, 6 and 9, each resized in place.
    fn steps() -> PolicySet {
        physalia_policies::parse_str(
            "min_workers: 1\nmax_workers: 4\ncooldown_epochs: 0\nrules:\n  - name: two\n    when: epoch == 3\n    then: {set_workers: 2}\n  - name: four\n    when: epoch == 6\n    then: {set_workers: 4}\n  - name: back\n    when: epoch == 9\n    then: {set_workers: 2}\n",
            "steps.yaml",
        )
        .unwrap()
    }

    #[test]
    fn workers_lost_during_in_place_resizes_leave_the_curve_unchanged() {
        // a joiner, a leaver or a survivor lost while the job resizes in place fails the resize, which
        // restarts from the checkpoint: every epoch is recorded once with the uninterrupted loss
        let p = steps();
        let mut lost: BTreeMap<&str, usize> = BTreeMap::new();
        for seed in seeds() {
            check(seed, &p, 1);
            let r = run(seed, &p, 1);
            for who in ["a joiner", "a leaver", "a survivor"] {
                if r.sim
                    .lines
                    .iter()
                    .any(|l| l.contains(&format!("{who} was lost")))
                {
                    *lost.entry(who).or_default() += 1;
                }
            }
            let in_place = r
                .sim
                .lines
                .iter()
                .filter(|l| l.contains("in place, "))
                .count();
            assert!(
                in_place >= 1,
                "seed {seed}: no resize in place: {:?}",
                r.sim.lines
            );
        }
        if std::env::var("PHYSALIA_SIM_SEED").is_err() {
            for who in ["a joiner", "a leaver", "a survivor"] {
                assert!(lost.get(who).copied().unwrap_or(0) >= 3, "{who}: {lost:?}");
            }
        }
        // without faults each of the three resizes follows three epochs of its launch, and its count
        // was prepared while the launch trained (the simulation checks that a launch that prepared is
        // resized only to a count it prepared)
        let calm = Faults {
            launch_fails: 0.0,
            slow_start: 0.0,
            worker_lost: 0.0,
            coordinator_dies: 0.0,
        };
        let r = run_with(1, &p, 1, calm);
        assert_eq!(
            r.sim.resizes_prepared,
            [true, true, true],
            "{:?}",
            r.sim.lines
        );
    }

    fn seeds() -> Vec<u64> {
        match std::env::var("PHYSALIA_SIM_SEED") {
            Ok(s) => vec![s.parse().expect("PHYSALIA_SIM_SEED is a number")],
            Err(_) => (0..300).collect(),
        }
    }

    #[test]
    fn a_fixed_size_job_survives_every_fault() {
        for seed in seeds() {
            check(seed, &never(), 3);
        }
    }

    #[test]
    fn an_elastic_job_with_prewarm_survives_every_fault() {
        let p = double_on_plateau();
        for seed in seeds() {
            check(seed, &p, 1);
        }
    }

    #[test]
    fn the_simulation_exercises_every_fault() {
        // the faults above must actually happen, or the two tests prove nothing
        let p = double_on_plateau();
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for seed in 0..300 {
            let r = run(seed, &p, 1);
            let seen_line = |f: &dyn Fn(&str) -> bool| r.sim.lines.iter().any(|l| f(l));
            for (key, found) in [
                (
                    "retried lost worker",
                    seen_line(&|l| l.contains("lost a worker")),
                ),
                (
                    "failed launch",
                    seen_line(&|l| l.contains("starting ") && l.contains("failed")),
                ),
                (
                    "prewarm used",
                    seen_line(&|l| {
                        l.contains("workers prewarmed") || l.contains("joiners prewarmed")
                    }),
                ),
                (
                    "prewarm failed",
                    seen_line(&|l| l.contains("prewarming") && l.contains("failed")),
                ),
                (
                    "prewarm lost a worker",
                    seen_line(&|l| l.contains("prewarmed workers discarded")),
                ),
                ("rescale", seen_line(&|l| l.contains("workers 1 -> 2"))),
                (
                    "resized in place",
                    seen_line(&|l| l.contains("resizing launch") && l.contains("in place")),
                ),
                (
                    "in-place resize failed",
                    seen_line(&|l| l.contains("failed") && l.contains("lost during the resize")),
                ),
                // issue 33: a lost worker of a launch that resizes in place is replaced alone
                (
                    "lost worker replaced alone",
                    seen_line(&|l| l.contains("replacing worker") && l.contains("alone"))
                        && r.sim.replaced > 0,
                ),
            ] {
                if found {
                    *seen.entry(key).or_default() += 1;
                }
            }
            if r.sim.deaths > 0 {
                *seen.entry("coordinator died").or_default() += 1;
            }
        }
        for key in [
            "retried lost worker",
            "failed launch",
            "prewarm used",
            "prewarm failed",
            "prewarm lost a worker",
            "rescale",
            "resized in place",
            "in-place resize failed",
            "lost worker replaced alone",
            "coordinator died",
        ] {
            assert!(seen.get(key).copied().unwrap_or(0) >= 3, "{key}: {seen:?}");
        }
    }

    /// Launch 0's two workers (pids 7 and 8) start and register.
    fn start_two_workers(job: &mut Job, t0: Instant) {
        start_workers(job, 2, t0)
    }

    fn start_workers(job: &mut Job, n: usize, t0: Instant) {
        job.handle(
            JobEvent::Started {
                launch: 0,
                result: Ok((0..n).map(|r| Some(7 + r as u32)).collect()),
            },
            t0,
        );
        for rank in 0..n {
            job.handle(
                JobEvent::Worker {
                    launch: 0,
                    event: Event::Registered {
                        rank,
                        pid: 7 + rank as u32,
                        mesh_addr: "127.0.0.1:1".parse().unwrap(),
                    },
                },
                t0,
            );
        }
    }

    #[test]
    fn a_worker_error_fails_the_job_without_retrying() {
        let mut el = Elastic::new(never(), 2, EPOCHS as u32, 0.0);
        el = el.with_max_retries(3);
        let mut job = Job::new(cfg(2, 0), el, 0);
        let t0 = Instant::now();
        let a = job.start(None, t0);
        assert!(a.contains(&JobAction::Launch {
            launch: 0,
            workers: 2,
            mode: TrainMode::Partition,
            prewarm: false
        }));
        start_two_workers(&mut job, t0);
        job.handle(
            JobEvent::Worker {
                launch: 0,
                event: Event::Failed {
                    rank: 1,
                    error: "labels row 3 is 9, outside 0..7".into(),
                },
            },
            t0,
        );
        let a = job.handle(JobEvent::Tick, t0 + Duration::from_secs(2));
        assert!(
            matches!(a.last(), Some(JobAction::Fail { error }) if error.contains("labels row 3")),
            "{a:?}"
        );
        assert!(!a.iter().any(|a| matches!(a, JobAction::Launch { .. })));
        assert!(job.is_over());
    }

    /// Two workers of a launch that resizes in place (or not, `in_place`) are assigned and record epoch
    /// 1; then the workers named in `gone` are SIGKILLed during epoch 2. The actions after the grace.
    fn lose_workers(in_place: bool, gone: &[usize]) -> (Job, Vec<JobAction>, Instant) {
        lose_workers_after(in_place, gone, 1)
    }

    /// [`lose_workers`] after `recorded` epochs.
    fn lose_workers_after(
        in_place: bool,
        gone: &[usize],
        recorded: usize,
    ) -> (Job, Vec<JobAction>, Instant) {
        lose_of(2, in_place, gone, recorded)
    }

    /// [`lose_workers_after`] for a launch of `n` workers.
    fn lose_of(
        n: usize,
        in_place: bool,
        gone: &[usize],
        recorded: usize,
    ) -> (Job, Vec<JobAction>, Instant) {
        let el = Elastic::new(never(), n as u32, EPOCHS as u32, 0.0);
        let mut c = cfg(n, 0);
        c.in_place = in_place;
        let mut job = Job::new(c, el, 0);
        let t0 = Instant::now();
        job.start(None, t0);
        start_workers(&mut job, n, t0);
        for epoch in 1..=recorded {
            for rank in 0..n {
                job.handle(
                    JobEvent::Worker {
                        launch: 0,
                        event: Event::Epoch {
                            rank,
                            metrics: metrics(epoch, n, TrainMode::Partition),
                        },
                    },
                    t0,
                );
            }
        }
        for &rank in gone {
            job.handle(
                JobEvent::Worker {
                    launch: 0,
                    event: Event::Exited {
                        rank,
                        how: "exited with signal 9".into(),
                        by_signal: true,
                    },
                },
                t0,
            );
        }
        let a = job.handle(JobEvent::Tick, t0 + Duration::from_secs(2));
        (job, a, t0)
    }

    #[test]
    fn a_lost_worker_of_an_in_place_job_is_replaced_alone() {
        let (mut job, a, t0) = lose_workers(true, &[1]);
        // the launch is not stopped: launch 1 is launch 0 again with rank 1 replaced (launch 2)
        assert!(
            !a.iter()
                .any(|a| matches!(a, JobAction::StopLaunch { .. } | JobAction::Launch { .. })),
            "{a:?}"
        );
        assert!(
            a.contains(&JobAction::Resize {
                from: 0,
                to: 1,
                workers: 2,
                mode: TrainMode::Partition,
                resume_epoch: 1,
                joiners: Some(Joiners {
                    launch: 2,
                    prewarmed: false
                }),
                replacing: Some(vec![1]),
            }),
            "{a:?}"
        );
        assert!(
            a.iter().any(|a| matches!(a, JobAction::Say(l)
                if l.contains("replacing worker 1 alone") && l.contains("retrying epoch 2"))),
            "{a:?}"
        );
        // ready: launch 1 is assigned as any other, after epoch 1
        let ready = (0..2)
            .map(|r| {
                (
                    Some(10 + r),
                    format!("127.0.0.1:{}", 9000 + r).parse().unwrap(),
                )
            })
            .collect();
        let a = job.handle(
            JobEvent::Resized {
                launch: 1,
                result: Ok(ready),
            },
            t0 + Duration::from_secs(3),
        );
        assert!(
            a.iter().any(|a| matches!(
                a,
                JobAction::Assign {
                    launch: 1,
                    resume_epoch: 1,
                    gated: true,
                    ..
                }
            )),
            "{a:?}"
        );
    }

    #[test]
    fn a_replacement_that_fails_restarts_every_worker_from_the_checkpoint() {
        let (mut job, _, t0) = lose_workers(true, &[1]);
        let a = job.handle(
            JobEvent::Resized {
                launch: 1,
                result: Err("worker 0 exited with signal 9".into()),
            },
            t0 + Duration::from_secs(3),
        );
        for l in [0, 2] {
            assert!(
                a.iter()
                    .any(|a| matches!(a, JobAction::StopLaunch { launch, .. } if *launch == l)),
                "launch {l} is stopped: {a:?}"
            );
        }
        assert!(
            a.contains(&JobAction::Launch {
                launch: 3,
                workers: 2,
                mode: TrainMode::Partition,
                prewarm: false
            }),
            "{a:?}"
        );
    }

    #[test]
    fn two_lost_workers_or_a_job_that_restarts_relaunch_every_worker() {
        for (in_place, gone, recorded) in [
            (true, &[0, 1][..], 1),
            (false, &[1][..], 1),
            // after the last epoch: the others are finishing, a relaunch hands over the model
            (true, &[1][..], EPOCHS),
        ] {
            let (_, a, _) = lose_workers_after(in_place, gone, recorded);
            assert!(
                !a.iter().any(|a| matches!(a, JobAction::Resize { .. })),
                "in place {in_place}, lost {gone:?}: {a:?}"
            );
            assert!(
                a.iter()
                    .any(|a| matches!(a, JobAction::StopLaunch { launch: 0, .. }))
                    && a.contains(&JobAction::Launch {
                        launch: 1,
                        workers: 2,
                        mode: TrainMode::Partition,
                        prewarm: false
                    }),
                "in place {in_place}, lost {gone:?}: {a:?}"
            );
        }
    }

    /// Several workers lost at once are replaced together, in one launch of joiners taking their ranks
    /// (any set of them); the others, between them too, keep their processes. Only when no worker
    /// survives is every worker relaunched.
    #[test]
    fn lost_workers_are_replaced_together_and_the_others_keep_their_processes() {
        for (gone, replaced, line) in [
            (
                &[1, 2][..],
                Some(vec![1, 2]),
                "replacing workers 1-2, the other 2",
            ),
            (
                &[2, 0][..],
                Some(vec![0, 2]),
                "replacing workers 0, 2, the other 2",
            ),
            (
                &[3][..],
                Some(vec![3]),
                "replacing worker 3 alone, the other 3",
            ),
            (
                &[0, 3][..],
                Some(vec![0, 3]),
                "replacing workers 0, 3, the other 2",
            ),
            (&[0, 1, 2, 3][..], None, ""),
        ] {
            let (_, a, _) = lose_of(4, true, gone, 1);
            match &replaced {
                Some(ranks) => {
                    assert!(
                        a.contains(&JobAction::Resize {
                            from: 0,
                            to: 1,
                            workers: 4,
                            mode: TrainMode::Partition,
                            resume_epoch: 1,
                            joiners: Some(Joiners {
                                launch: 2,
                                prewarmed: false
                            }),
                            replacing: Some(ranks.clone()),
                        }),
                        "lost {gone:?}: {a:?}"
                    );
                    assert!(
                        !a.iter().any(|a| matches!(
                            a,
                            JobAction::StopLaunch { .. } | JobAction::Launch { .. }
                        )),
                        "lost {gone:?}: {a:?}"
                    );
                    assert!(
                        a.iter()
                            .any(|a| matches!(a, JobAction::Say(l) if l.contains(line))),
                        "lost {gone:?}, wanted {line:?}: {a:?}"
                    );
                }
                None => assert!(
                    a.contains(&JobAction::Launch {
                        launch: 1,
                        workers: 4,
                        mode: TrainMode::Partition,
                        prewarm: false
                    }) && !a.iter().any(|a| matches!(a, JobAction::Resize { .. })),
                    "lost {gone:?}: {a:?}"
                ),
            }
        }
    }

    /// A frozen worker is silent, not gone: its peer waits on it past the epoch timeout. The silence
    /// names it, and it alone is replaced (the driver stops its process first); two workers silent
    /// with nothing to say which stalled the other relaunch every worker.
    #[test]
    fn a_silent_worker_its_peer_waits_on_is_replaced_alone() {
        for (waits, replaced) in [(true, true), (false, false)] {
            let (mut job, _, t0) = lose_workers_after(true, &[], 1);
            for s in (10..=60).step_by(10) {
                if waits {
                    job.handle(
                        JobEvent::Worker {
                            launch: 0,
                            event: Event::Waiting {
                                rank: 0,
                                on: 1,
                                rtt: Duration::from_millis(1),
                            },
                        },
                        t0 + Duration::from_secs(s),
                    );
                }
            }
            let a = job.handle(JobEvent::Tick, t0 + Duration::from_secs(62));
            let resize = a.iter().any(|a| {
                matches!(
                    a,
                    JobAction::Resize {
                        workers: 2,
                        replacing: Some(ranks),
                        ..
                    } if *ranks == [1]
                )
            });
            assert_eq!(resize, replaced, "waits {waits}: {a:?}");
            if replaced {
                assert!(
                    a.iter().any(|a| matches!(a, JobAction::Say(l)
                        if l.contains("worker 1 (pid 8) sent nothing for 60 s")
                            && l.contains("replacing worker 1 alone"))),
                    "{a:?}"
                );
            } else {
                assert!(
                    a.iter()
                        .any(|a| matches!(a, JobAction::StopLaunch { launch: 0, .. })),
                    "{a:?}"
                );
            }
        }
    }

    fn replan_at(epoch: usize) -> PolicySet {
        physalia_policies::parse_str(
            &format!(
                "min_workers: 1\nmax_workers: 4\nrules:\n  - name: faster\n    when: epoch == {epoch}\n    \
                 then: {{replan: min_time}}\n"
            ),
            "replan.yaml",
        )
        .unwrap()
    }

    #[test]
    fn a_replan_changes_the_mode_when_the_measured_epochs_say_another_is_faster() {
        let none = Faults {
            launch_fails: 0.0,
            slow_start: 0.0,
            worker_lost: 0.0,
            coordinator_dies: 0.0,
        };
        let r = run_with(1, &replan_at(5), 2, none);
        assert!(
            r.failed.is_none(),
            "{:?}\n{}",
            r.failed,
            r.sim.lines.join("\n")
        );
        // partition on 2 until epoch 5, then what the planner chose from epoch 5's measurements
        let shapes: Vec<(usize, usize, TrainMode)> =
            r.sim.assigned.iter().map(|a| (a.1, a.2, a.3)).collect();
        assert_eq!(
            shapes,
            [(0, 2, TrainMode::Partition), (5, 4, TrainMode::Data)],
            "{}",
            r.sim.lines.join("\n")
        );
        let line = r
            .sim
            .lines
            .iter()
            .find(|l| l.contains("replanned"))
            .expect("a replan line");
        assert!(
            line.contains("replanned (min_time): partition on 2 -> data on 4 workers (measured halo share 0.70)"),
            "{line}"
        );
        // every epoch once, the loss curve unchanged
        assert_eq!(r.sim.record.len(), EPOCHS);
        assert!(
            r.sim
                .record
                .iter()
                .enumerate()
                .all(|(i, l)| l.metrics.epoch == i + 1 && l.metrics.loss == loss(i + 1))
        );
        assert_eq!(r.sim.record[4].worker_count(), 2);
        assert_eq!(r.sim.record[5].worker_count(), 4);
        // a replan whose answer is the job as it runs keeps the launch going
        let r = run_with(2, &replan_at(EPOCHS + 5), 2, none);
        assert_eq!(r.sim.assigned.len(), 1);
    }

    #[test]
    fn a_replanning_job_survives_every_fault() {
        for seed in seeds() {
            check(seed, &replan_at(5), 2);
        }
    }

    #[test]
    fn a_failed_replan_keeps_the_job_running() {
        let t0 = Instant::now();
        let el = Elastic::new(replan_at(1), 2, EPOCHS as u32, 0.0);
        let mut job = Job::new(cfg(2, 0), el, 0);
        let a = job.start(None, t0);
        assert!(
            matches!(
                a[..],
                [JobAction::Log(_), JobAction::Launch { launch: 0, .. }]
            ),
            "{a:?}"
        );
        start_two_workers(&mut job, t0);
        let mut asked = Vec::new();
        for rank in 0..2 {
            asked.extend(job.handle(
                JobEvent::Worker {
                    launch: 0,
                    event: Event::Epoch {
                        rank,
                        metrics: metrics(1, 2, TrainMode::Partition),
                    },
                },
                t0,
            ));
        }
        assert!(
            asked.iter().any(|a| matches!(a, JobAction::Replan { epoch: 1, workers: 2, by_rank, .. } if by_rank.len() == 2)),
            "{asked:?}"
        );
        let a = job.handle(JobEvent::Replanned(Err("no SKU fits".into())), t0);
        assert!(
            matches!(&a[..], [JobAction::Say(l)] if l.contains("replan (min_time) failed, keeping the job as it runs: no SKU fits")),
            "{a:?}"
        );
        assert!(!job.is_over());
        assert_eq!(job.workers(), 2);
    }

    #[test]
    fn the_bill_counts_every_started_worker_from_its_start_to_its_stop() {
        // prewarmed workers that wait, workers idle between a loss and the relaunch, launches that never
        // start (not billed) and the coordinator's own time: the job's bill is what the platform would charge
        for seed in seeds() {
            let rng = Stream::new(seed, &[0x5133]);
            let f = |i: u64, max: f32| rng.uniform(i) * max;
            let faults = Faults {
                launch_fails: f(1, 0.25),
                slow_start: f(2, 0.5),
                worker_lost: f(3, 0.6),
                coordinator_dies: 0.0,
            };
            let r = run_priced(seed, &double_on_plateau(), 2, faults, (2.0, 0.5));
            let outcome = r.outcome.expect("a finished job has an outcome");
            let worker_s = r.sim.billed_worker_ms as f64 / 1000.0;
            let coordinator_s = r.sim.now_ms as f64 / 1000.0;
            let want = 2.0 * worker_s + 0.5 * coordinator_s;
            assert!(
                (outcome.usd - want).abs() <= 1e-9 * want.max(1.0),
                "seed {seed}: billed {} for {worker_s} worker-s and {coordinator_s} s, want {want}",
                outcome.usd
            );
            assert!((outcome.worker_s - worker_s).abs() <= 1e-9 * worker_s.max(1.0));
            // at least the epochs' own time: training is part of the bill
            let trained: f64 = r
                .sim
                .record
                .iter()
                .map(|l| l.worker_count() as f64 * l.metrics.train_s)
                .sum();
            assert!(worker_s >= trained, "seed {seed}: {worker_s} < {trained}");
        }
    }
}
