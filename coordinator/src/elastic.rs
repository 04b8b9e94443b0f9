//! Elastic jobs, without IO: the scaling policy's view of the epochs so far, its decisions after each
//! epoch, and what to launch after a launch stopped (a resize, a lost worker, or the policy's stop). Every
//! job the coordinator runs has one (a job without a policy gets one that never fires, so lost workers are
//! still retried). The job's state machine (`job.rs`) feeds it real epochs; the simulation below feeds it
//! a fake cluster in virtual time.

use physalia_control::{MetricsLine, ScalingEvent};
use physalia_gnn::{EpochMetrics, TrainSummary};
use serde_json::{Value, json};

/// What an epoch cost: each worker's wall time in it times the price per worker-second.
pub fn epoch_usd(by_rank: &[EpochMetrics], price_per_worker_s: f64) -> f64 {
    by_rank.iter().map(|m| m.train_s + m.eval_s).sum::<f64>() * price_per_worker_s
}

/// Retries in a row (without an epoch completing in between) before a job fails, unless the job says.
/// One training run's result: its seed and what it learned, epoch by epoch.
pub struct RunResult {
    pub seed: u64,
    pub summary: TrainSummary,
}

pub const MAX_RETRIES: usize = crate::spec::DEFAULT_MAX_RETRIES as usize;

/// Why every worker of a launch was stopped after an epoch.
#[derive(Debug)]
pub enum Stop {
    Rescale {
        to: usize,
        rule: String,
        values: Value,
    },
    Lost {
        error: String,
        /// The ranks replaced, ascending: the lost workers' (a job that resizes in place: the others keep
        /// their processes); `None`: every worker is relaunched.
        replacing: Option<Vec<usize>>,
    },
    /// Same workers, other exchange settings (the plan's boundary sampling and staleness).
    Reconfigure {
        what: String,
        rule: String,
        values: Value,
    },
    /// Ask the planner again under `to`, with the measured epochs; the job applies its choice (mode,
    /// workers, exchange) or keeps going as it is.
    Replan {
        to: physalia_policies::Objective,
        rule: String,
        values: Value,
    },
    Finish,
}

/// A job with a scaling policy: the policy's inputs over all segments, and what happened.
pub struct Elastic {
    policy: physalia_policies::PolicySet,
    plan: physalia_policies::PlanState,
    history: Vec<physalia_policies::EpochRecord>,
    last_change: Option<u32>,
    /// Rank 0's metrics of every completed epoch, over all segments.
    metrics: Vec<EpochMetrics>,
    pub bytes: u64,
    pub usd: f64,
    price_per_worker_s: f64,
    retries: usize,
    max_retries: usize,
    /// Every worker's metrics of the last recorded epoch, for a replan.
    last_by_rank: Vec<EpochMetrics>,
    /// One line per rescale, retry or policy stop, with its epoch.
    pub events: Vec<ScalingEvent>,
    /// Spare workers the policy's `prewarm` asked for after the last epoch.
    prewarm: u32,
}

/// What to do after a launch stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Launch `workers` workers from the checkpoint of `resume_epoch` (0: from scratch).
    Relaunch { workers: usize, resume_epoch: usize },
    /// The policy stopped the job: it ends with the epochs so far.
    Finish,
    /// Too many retries.
    Fail(String),
}

impl Elastic {
    pub fn new(
        policy: physalia_policies::PolicySet,
        workers: u32,
        epochs: u32,
        price_per_worker_s: f64,
    ) -> Elastic {
        let mut plan = physalia_policies::PlanState::new(workers);
        plan.epochs_total = Some(epochs);
        Elastic {
            policy,
            plan,
            history: Vec::new(),
            last_change: None,
            metrics: Vec::new(),
            bytes: 0,
            usd: 0.0,
            price_per_worker_s,
            retries: 0,
            max_retries: MAX_RETRIES,
            last_by_rank: Vec::new(),
            prewarm: 0,
            events: Vec::new(),
        }
    }

    /// Takes in the recorded epochs of a job being resumed. A change of the worker count between two
    /// recorded epochs was the policy's decision after the first of them: it restarts the cooldown there,
    /// as it did in the run that recorded them. Returns the policy's decision after the last recorded epoch
    /// (made again: the coordinator that recorded it may have died before acting on it).
    pub fn replay(&mut self, lines: &[MetricsLine], epochs_total: usize) -> Option<Stop> {
        let mut previous: Option<(usize, usize)> = None;
        for line in lines {
            let by_rank = line.by_rank();
            if let Some((epoch, workers)) = previous
                && workers != by_rank.len()
            {
                self.last_change = Some(epoch as u32);
            }
            previous = Some((line.metrics.epoch, by_rank.len()));
            self.after_epoch_record(&by_rank);
        }
        if let Some(last) = lines.last() {
            self.plan.workers = last.worker_count() as u32;
        }
        self.decide(epochs_total)
    }

    /// Records an event; returns its line for the terminal.
    pub fn event(&mut self, epoch: usize, what: String, rule: Option<(String, Value)>) -> String {
        let line = format!("after epoch {epoch}: {what}");
        let (rule, values) = rule.unzip();
        self.events.push(ScalingEvent {
            epoch,
            event: what,
            rule,
            values,
        });
        line
    }

    /// Records a completed epoch and asks the policy what to do before the next one.
    pub fn after_epoch(&mut self, by_rank: &[EpochMetrics], epochs_total: usize) -> Option<Stop> {
        self.after_epoch_record(by_rank);
        self.decide(epochs_total)
    }

    fn after_epoch_record(&mut self, by_rank: &[EpochMetrics]) {
        self.last_by_rank = by_rank.to_vec();
        self.retries = 0;
        let m = &by_rank[0];
        let bytes: u64 = by_rank.iter().map(|m| m.exchange.bytes_sent).sum();
        let wait: f64 = by_rank
            .iter()
            .map(|m| {
                let busy = (m.train_s + m.eval_s).max(1e-9);
                ((m.exchange.halo_s + m.exchange.all_reduce_s) / busy).min(1.0)
            })
            .sum::<f64>()
            / by_rank.len() as f64;
        self.bytes += bytes;
        self.usd += epoch_usd(by_rank, self.price_per_worker_s);
        self.metrics.push(m.clone());
        self.history.push(physalia_policies::EpochRecord {
            epoch: m.epoch as u32,
            loss: m.loss,
            val_acc: m.val_acc,
            epoch_s: m.train_s + m.eval_s,
            wait_share: wait,
            bytes,
            workers: by_rank.len() as u32,
            usd_spent: self.usd,
            throughput_per_usd: None,
            grad_noise_scale: None,
        });
    }

    fn decide(&mut self, epochs_total: usize) -> Option<Stop> {
        let m = self.metrics.last()?.clone();
        if m.epoch >= epochs_total {
            return None;
        }
        let d =
            physalia_policies::evaluate(&self.policy, &self.history, &self.plan, self.last_change);
        self.prewarm = d.prewarm_workers;
        let change = d.change?;
        self.last_change = Some(m.epoch as u32);
        use physalia_policies::Effect;
        match &change.effect {
            Effect::Workers { to, .. } => {
                self.plan.workers = *to;
                Some(Stop::Rescale {
                    to: *to as usize,
                    rule: change.rule.clone(),
                    values: json!(change.values),
                })
            }
            Effect::Stop => {
                self.events.push(ScalingEvent {
                    epoch: m.epoch,
                    event: "stop".into(),
                    rule: Some(change.rule.clone()),
                    values: None,
                });
                Some(Stop::Finish)
            }
            Effect::BoundarySampling { from, to } => {
                self.plan.boundary_sampling = *to;
                Some(Stop::Reconfigure {
                    what: format!("boundary sampling {from} -> {to}"),
                    rule: change.rule.clone(),
                    values: json!(change.values),
                })
            }
            Effect::Staleness { from, to } => {
                self.plan.staleness = *to;
                Some(Stop::Reconfigure {
                    what: format!("staleness {from} -> {to} epochs"),
                    rule: change.rule.clone(),
                    values: json!(change.values),
                })
            }
            Effect::Replan { to, .. } => {
                self.plan.objective = *to;
                Some(Stop::Replan {
                    to: *to,
                    rule: change.rule.clone(),
                    values: json!(change.values),
                })
            }
        }
    }

    /// The job's result from every segment's epochs.
    pub fn summary(&self, seed: u64, stopped_early: bool) -> RunResult {
        let mut summary = TrainSummary::new(self.metrics.len());
        for m in &self.metrics {
            summary.observe(m.epoch, m.val_acc, m.test_acc);
        }
        summary.epochs = self.metrics.clone();
        summary.stopped_early = stopped_early;
        RunResult { seed, summary }
    }

    /// After a launch stopped after `after_epoch` for `why`: the next launch, the end, or failure.
    /// `workers` is the size of the launch that stopped; returns the line to print, if any.
    pub fn after_stop(
        &mut self,
        workers: usize,
        after_epoch: usize,
        why: Stop,
    ) -> (Next, Option<String>) {
        match why {
            Stop::Rescale { to, rule, values } => {
                let line = self.event(
                    after_epoch,
                    format!("workers {workers} -> {to}"),
                    Some((rule, values)),
                );
                (
                    Next::Relaunch {
                        workers: to,
                        resume_epoch: after_epoch,
                    },
                    Some(line),
                )
            }
            Stop::Lost { error, replacing } => {
                self.retries += 1;
                if self.retries > self.max_retries {
                    let error = match self.max_retries {
                        0 => format!("{error} (max_retries: 0)"),
                        n => format!("{error}; gave up after {n} retries in a row"),
                    };
                    return (Next::Fail(error), None);
                }
                let (what, how) = match replacing {
                    Some(r) => (
                        if r.len() == 1 { "a worker" } else { "workers" },
                        format!(
                            "replacing {}{}, the other {} keep their processes; ",
                            name_ranks(&r),
                            if r.len() == 1 { " alone" } else { "" },
                            workers - r.len()
                        ),
                    ),
                    None => ("a worker", String::new()),
                };
                let line = self.event(
                    after_epoch,
                    format!(
                        "lost {what} ({error}); {how}retrying epoch {} on {workers} workers",
                        after_epoch + 1
                    ),
                    None,
                );
                (
                    Next::Relaunch {
                        workers,
                        resume_epoch: after_epoch,
                    },
                    Some(line),
                )
            }
            Stop::Reconfigure { what, rule, values } => {
                let line = self.event(after_epoch, what, Some((rule, values)));
                (
                    Next::Relaunch {
                        workers,
                        resume_epoch: after_epoch,
                    },
                    Some(line),
                )
            }
            // the job asks the planner before it stops anything (`Elastic::replanned`); a replan that
            // reaches here relaunches what ran
            Stop::Replan { to, rule, values } => {
                let line = self.event(
                    after_epoch,
                    format!("replan ({}): relaunching as it was", to.as_str()),
                    Some((rule, values)),
                );
                (
                    Next::Relaunch {
                        workers,
                        resume_epoch: after_epoch,
                    },
                    Some(line),
                )
            }
            Stop::Finish => (Next::Finish, None),
        }
    }

    /// The worker counts the policy may move the plan to after some epoch, most likely first: the
    /// prewarm's target, then each rule's count in rule order (distinct, not the current count). An
    /// in-place resize prepares these partitionings while the job trains. A replan's choice is not
    /// foreseen.
    pub fn next_sizes(&self) -> Vec<usize> {
        let now = self.plan.workers as usize;
        let mut sizes: Vec<usize> = self.prewarm_target().into_iter().collect();
        for rule in &self.policy.rules {
            if let Ok(physalia_policies::Effect::Workers { to, .. }) =
                physalia_policies::effect(&self.policy, &self.plan, &rule.then)
            {
                sizes.push(to as usize);
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        sizes.retain(|&k| k != now && seen.insert(k));
        sizes
    }

    /// The size of the next launch to start early, when the policy's `prewarm` expects a scale-up: the
    /// current workers plus the spares it asked for.
    pub fn prewarm_target(&self) -> Option<usize> {
        (self.prewarm > 0).then(|| (self.plan.workers + self.prewarm) as usize)
    }

    /// Records what a replan after `epoch` chose (`what`), and takes its workers and exchange settings as
    /// the plan's; returns the line for the terminal.
    pub fn replanned(
        &mut self,
        epoch: usize,
        what: String,
        choice: Option<(u32, f64, u32)>,
        rule: String,
        values: Value,
    ) -> String {
        if let Some((workers, boundary_sampling, staleness)) = choice {
            self.plan.workers = workers;
            self.plan.boundary_sampling = boundary_sampling;
            self.plan.staleness = staleness;
            self.last_change = Some(epoch as u32);
        }
        self.event(epoch, what, Some((rule, values)))
    }

    /// The fewest and the most workers any recorded epoch trained on (`None` before the first).
    pub fn workers_range(&self) -> Option<[u32; 2]> {
        let min = self.history.iter().map(|h| h.workers).min()?;
        let max = self.history.iter().map(|h| h.workers).max()?;
        Some([min, max])
    }

    /// Workers of the plan now (the last launch's, or the next one's).
    pub fn workers(&self) -> u32 {
        self.plan.workers
    }

    /// Every worker's metrics of the last recorded epoch (empty before the first).
    pub fn last_by_rank(&self) -> &[EpochMetrics] {
        &self.last_by_rank
    }

    /// Retries in a row of a lost worker's epoch before the job fails.
    pub fn with_max_retries(mut self, max_retries: u32) -> Elastic {
        self.max_retries = max_retries as usize;
        self
    }

    /// Starts from the job's exchange settings.
    pub fn with_exchange(mut self, boundary_sampling: f64, staleness: u32) -> Elastic {
        self.plan.boundary_sampling = boundary_sampling;
        self.plan.staleness = staleness;
        self
    }

    /// The exchange settings the policy has chosen so far: boundary sampling rate and staleness.
    pub fn exchange(&self) -> (f64, u32) {
        (self.plan.boundary_sampling, self.plan.staleness)
    }
}

/// "worker 1", "workers 1-2" or "workers 0, 3": ranks (ascending) in lines and logs.
pub fn name_ranks(ranks: &[usize]) -> String {
    let contiguous = ranks.windows(2).all(|w| w[1] == w[0] + 1);
    match ranks {
        [] => "no worker".into(),
        [r] => format!("worker {r}"),
        [first, .., last] if contiguous => format!("workers {first}-{last}"),
        _ => format!(
            "workers {}",
            ranks
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod simulation {
    //! A simulated cluster in virtual time: the real policy evaluation and relaunch logic against a fake
    //! backend with cold starts and seeded worker loss. Training is exact, so an epoch's metrics are a
    //! function of the epoch alone (any worker count, any retry), as on the real engine.

    use physalia_gnn::rng::Stream;
    use physalia_policies::PolicySet;

    use super::*;

    /// The fake backend: cold start, compute shared by the workers plus a per-worker exchange cost, and a
    /// seeded chance that some worker dies during an epoch.
    struct Cluster {
        rng: Stream,
        draws: u64,
        cold_start_s: f64,
        loss_rate: f64,
    }

    impl Cluster {
        fn lost(&mut self) -> bool {
            self.draws += 1;
            self.rng.uniform(self.draws) < self.loss_rate as f32
        }
    }

    fn epoch_metrics(epoch: usize, workers: usize) -> Vec<EpochMetrics> {
        // a loss that flattens out, so plateau rules fire; exactness: independent of `workers`
        let loss = 0.3 + 0.7 * (-(epoch as f64) / 5.0).exp();
        (0..workers)
            .map(|_| {
                let mut m = EpochMetrics {
                    epoch,
                    loss,
                    train_acc: None,
                    val_acc: Some(1.0 - loss / 2.0),
                    test_acc: Some(1.0 - loss / 2.0),
                    train_s: 8.0 / workers as f64 + 0.3 * workers as f64,
                    eval_s: 0.1,
                    exchange: Default::default(),
                    batches: None,
                    device: None,
                    prepare_s: None,
                };
                m.exchange.bytes_sent = 1_000_000 * (workers as u64 - 1);
                m.exchange.halo_s = 0.05 * workers as f64;
                m
            })
            .collect()
    }

    struct Trace {
        /// Workers of every recorded epoch, in epoch order.
        workers: Vec<usize>,
        /// Epochs whose worker count changed, with the rule's cooldown.
        changes: Vec<usize>,
        retries: usize,
        /// Every epoch as trained (retried epochs appear more than once), and the virtual time at the end.
        attempts: Vec<usize>,
        clock_s: f64,
        decisions: Vec<ScalingEvent>,
    }

    /// Runs `epochs` epochs of a job starting at `workers` under `policy` on the fake cluster.
    #[allow(clippy::mut_range_bound)] // a relaunch restarts the epoch loop at its checkpoint
    fn simulate(
        policy: &PolicySet,
        workers: usize,
        epochs: usize,
        seed: u64,
        loss_rate: f64,
    ) -> Trace {
        let mut el = Elastic::new(policy.clone(), workers as u32, epochs as u32, 0.0);
        let mut cluster = Cluster {
            rng: Stream::new(seed, &[]),
            draws: 0,
            cold_start_s: 30.0,
            loss_rate,
        };
        let (mut n, mut next_epoch) = (workers, 1usize);
        let mut trace = Trace {
            workers: vec![],
            changes: vec![],
            retries: 0,
            attempts: vec![],
            clock_s: 0.0,
            decisions: vec![],
        };
        'launches: loop {
            trace.clock_s += cluster.cold_start_s;
            for epoch in next_epoch..=epochs {
                trace.attempts.push(epoch);
                let by_rank = epoch_metrics(epoch, n);
                trace.clock_s += by_rank[0].train_s + by_rank[0].eval_s;
                let stop = if cluster.lost() {
                    Some(Stop::Lost {
                        error: format!("worker {} exited with signal 9", epoch % n),
                        replacing: None,
                    })
                } else {
                    trace.workers.push(n);
                    el.after_epoch(&by_rank, epochs)
                };
                let Some(why) = stop else { continue };
                let after = if matches!(why, Stop::Lost { .. }) {
                    epoch - 1
                } else {
                    epoch
                };
                let changed = matches!(why, Stop::Rescale { .. });
                match el.after_stop(n, after, why) {
                    (
                        Next::Relaunch {
                            workers,
                            resume_epoch,
                        },
                        _,
                    ) => {
                        if changed {
                            trace.changes.push(after);
                        } else {
                            trace.retries += 1;
                        }
                        n = workers;
                        next_epoch = resume_epoch + 1;
                        continue 'launches;
                    }
                    (Next::Finish, _) => break 'launches,
                    (Next::Fail(e), _) => panic!("{e}"),
                }
            }
            break;
        }
        trace.decisions = el.events.clone();
        trace
    }

    fn policy(name: &str) -> PolicySet {
        let text = match name {
            "double-on-plateau" => include_str!("../../examples/policies/double-on-plateau.yaml"),
            "shrink-when-waiting" => {
                include_str!("../../examples/policies/shrink-when-waiting.yaml")
            }
            "grow-with-noise-scale" => {
                include_str!("../../examples/policies/grow-with-noise-scale.yaml")
            }
            "budget" => include_str!("../../examples/policies/budget.yaml"),
            other => panic!("no example policy {other}"),
        };
        physalia_policies::parse_str(text, name).unwrap()
    }

    #[test]
    fn example_policies_keep_their_invariants_on_a_lossy_cluster() {
        for name in [
            "double-on-plateau",
            "shrink-when-waiting",
            "grow-with-noise-scale",
            "budget",
        ] {
            let p = policy(name);
            for seed in 0..20 {
                let start = p.min_workers.max(1) as usize;
                let t = simulate(&p, start, 40, seed, 0.04);
                let what = format!("{name} seed {seed}");
                // worker count within bounds at every epoch
                for &w in &t.workers {
                    assert!(
                        (p.min_workers as usize..=p.max_workers as usize).contains(&w),
                        "{what}: {w} workers outside {}..{}",
                        p.min_workers,
                        p.max_workers
                    );
                }
                // no two changes within the cooldown (the shortest of the policy's and its rules')
                let cooldown = p
                    .rules
                    .iter()
                    .filter_map(|r| r.cooldown_epochs)
                    .chain([p.cooldown_epochs])
                    .min()
                    .unwrap() as usize;
                for pair in t.changes.windows(2) {
                    assert!(
                        pair[1] - pair[0] >= cooldown,
                        "{what}: changes after epochs {pair:?} within a cooldown of {cooldown}"
                    );
                }
                // every epoch recorded exactly once, in order, however often it was attempted; all 40
                // unless the policy stopped the job
                let recorded = t.workers.len();
                let stopped = t.decisions.iter().any(|d| d.event == "stop");
                assert!(
                    recorded == 40 || (stopped && recorded < 40),
                    "{what}: {recorded} epochs"
                );
                assert_eq!(
                    (1..=recorded).collect::<Vec<_>>(),
                    {
                        let mut v = t.attempts.clone();
                        v.sort();
                        v.dedup();
                        v.truncate(recorded);
                        v
                    },
                    "{what}: recorded epochs are not 1..={recorded}"
                );
                assert_eq!(
                    t.attempts.len() - recorded,
                    t.retries,
                    "{what}: one extra attempt per retry"
                );
            }
        }
    }

    /// The line `distributed.rs` appends to metrics.jsonl for an epoch.
    fn metrics_line(by_rank: &[EpochMetrics]) -> MetricsLine {
        MetricsLine::coordinated(0, by_rank, 0.0)
    }

    #[test]
    fn a_resumed_job_decides_as_the_uninterrupted_one() {
        // grows after every epoch it may: the cooldown alone spaces the changes
        let p = physalia_policies::parse_str(
            "min_workers: 1\nmax_workers: 64\ncooldown_epochs: 4\nrules:\n  - name: grow\n    \
             when: \"true\"\n    then: {multiply_workers: 2}\n",
            "grow.yaml",
        )
        .unwrap();
        let epochs = 16;
        // The uninterrupted run: the worker count before every epoch, and the decisions.
        let run = |el: &mut Elastic, from: usize, mut n: usize, lines: &mut Vec<MetricsLine>| {
            let mut changes = Vec::new();
            for epoch in from..=epochs {
                let by_rank = epoch_metrics(epoch, n);
                lines.push(metrics_line(&by_rank));
                if let Some(Stop::Rescale { to, .. }) = el.after_epoch(&by_rank, epochs) {
                    changes.push((epoch, to));
                    n = to;
                }
            }
            changes
        };
        let mut whole = Elastic::new(p.clone(), 1, epochs as u32, 0.0);
        let mut lines = Vec::new();
        let changes = run(&mut whole, 1, 1, &mut lines);
        assert_eq!(changes, [(1, 2), (5, 4), (9, 8), (13, 16)]);
        // The coordinator dies after each epoch in turn; a new one replays the record and goes on.
        for died_after in 1..epochs {
            let mut resumed = Elastic::new(p.clone(), 1, epochs as u32, 0.0);
            let workers = lines[died_after - 1].worker_count();
            // a change decided after the last recorded epoch is decided again
            let pending = resumed.replay(&lines[..died_after], epochs);
            let workers = match (pending, changes.iter().find(|c| c.0 == died_after)) {
                (Some(Stop::Rescale { to, .. }), Some(&(_, want))) => {
                    assert_eq!(to, want, "died after epoch {died_after}");
                    to
                }
                (None, None) => workers,
                (got, want) => panic!("died after epoch {died_after}: {got:?}, want {want:?}"),
            };
            let later = run(&mut resumed, died_after + 1, workers, &mut Vec::new());
            let want: Vec<_> = changes
                .iter()
                .copied()
                .filter(|c| c.0 > died_after)
                .collect();
            assert_eq!(later, want, "died after epoch {died_after}");
        }
    }

    #[test]
    fn a_failure_replays_from_its_seed() {
        let p = policy("double-on-plateau");
        let a = simulate(&p, 1, 40, 7, 0.08);
        let b = simulate(&p, 1, 40, 7, 0.08);
        assert!(a.retries > 0, "seed 7 loses no worker: pick another");
        assert_eq!(a.workers, b.workers);
        assert_eq!(a.attempts, b.attempts);
        assert_eq!(a.decisions, b.decisions);
        assert_eq!(a.clock_s, b.clock_s);
        let c = simulate(&p, 1, 40, 8, 0.08);
        assert_ne!(
            a.attempts, c.attempts,
            "another seed, another failure pattern"
        );
    }

    #[test]
    fn the_plateau_policy_grows_and_cold_starts_cost_virtual_time() {
        let p = policy("double-on-plateau");
        let t = simulate(&p, 1, 40, 0, 0.0);
        assert_eq!(t.retries, 0);
        assert!(
            !t.changes.is_empty(),
            "the plateau policy never fired: {:?}",
            t.decisions
        );
        assert!(t.workers.last() > t.workers.first(), "{:?}", t.workers);
        let launches = 1 + t.changes.len();
        assert!(
            t.clock_s >= launches as f64 * 30.0,
            "each launch pays its cold start"
        );
        // the recorded decisions name the rule that fired
        assert!(
            t.decisions
                .iter()
                .all(|d| d.rule.is_some() || !d.event.is_empty())
        );
    }

    #[test]
    fn too_many_losses_fail_the_job_with_the_cause() {
        let p = policy("double-on-plateau");
        let mut el = Elastic::new(p, 1, 10, 0.0);
        for i in 0..MAX_RETRIES {
            let (next, line) = el.after_stop(
                2,
                3,
                Stop::Lost {
                    error: format!("loss {i}"),
                    replacing: None,
                },
            );
            assert_eq!(
                next,
                Next::Relaunch {
                    workers: 2,
                    resume_epoch: 3
                }
            );
            assert!(line.unwrap().contains("retrying epoch 4"));
        }
        let (next, _) = el.after_stop(
            2,
            3,
            Stop::Lost {
                error: "worker 1 exited".into(),
                replacing: None,
            },
        );
        assert_eq!(
            next,
            Next::Fail(format!(
                "worker 1 exited; gave up after {MAX_RETRIES} retries in a row"
            ))
        );
        // a completed epoch resets the count
        let mut el = Elastic::new(policy("double-on-plateau"), 1, 10, 0.0);
        for _ in 0..MAX_RETRIES {
            el.after_stop(
                1,
                0,
                Stop::Lost {
                    error: "x".into(),
                    replacing: None,
                },
            );
        }
        el.after_epoch(&epoch_metrics(1, 1), 10);
        for _ in 0..MAX_RETRIES {
            let (next, _) = el.after_stop(
                1,
                1,
                Stop::Lost {
                    error: "x".into(),
                    replacing: None,
                },
            );
            assert!(matches!(next, Next::Relaunch { .. }), "{next:?}");
        }
    }

    #[test]
    fn the_job_sets_how_many_retries_in_a_row() {
        let lost = || Stop::Lost {
            error: "worker 1 exited with signal 9".into(),
            replacing: None,
        };
        let mut el = Elastic::new(policy("double-on-plateau"), 2, 10, 0.0).with_max_retries(0);
        assert_eq!(
            el.after_stop(2, 3, lost()).0,
            Next::Fail("worker 1 exited with signal 9 (max_retries: 0)".into())
        );
        let mut el = Elastic::new(policy("double-on-plateau"), 2, 10, 0.0).with_max_retries(1);
        assert!(matches!(
            el.after_stop(2, 3, lost()).0,
            Next::Relaunch { .. }
        ));
        assert_eq!(
            el.after_stop(2, 3, lost()).0,
            Next::Fail("worker 1 exited with signal 9; gave up after 1 retries in a row".into())
        );
    }
}
