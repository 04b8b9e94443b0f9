//! `physalia plan --replay JOB_DIR`: what a finished job would have cost run otherwise. The planner's cost
//! model is fitted to the job's record (its per-epoch metrics, when each launch ran and each epoch ended),
//! then prices the same training (the same epochs, the same losses) under other worker counts, SKUs, the
//! job's scaling policy replayed, and a fixed-size cluster sized for the peak worker count: Hydrozoa's
//! comparison, throughput per dollar of an elastic job against a fixed cluster.
//!
//! The fit: the planner predicts each epoch's compute (with sampling), network (halo rows and all-reduce),
//! evaluation and fixed per-epoch overhead on the job's SKU; each of the four is scaled by the ratio of what
//! the job measured to what the model predicted over all its epochs, and where the job trained on a worker
//! count the whole epoch is scaled once more by that count's measured-to-fitted ratio (mean epoch over fitted
//! epoch: the sum of the epochs is what the job paid for). A launch costs its start-up (first epoch's end
//! less one epoch, measured) and its stop (last epoch's end to the stop), averaged over the job's launches;
//! on another SKU the planner's extra cold start and loading time is added. A resize in place (issue 33;
//! `resize: restart`, replica groups and chunked datasets relaunch instead) costs its pause (measured:
//! the last epoch before it to the first after, less an epoch) for every worker of either count, and its
//! joiners' start-up: billed while the others train when the policy prewarms them, in the pause otherwise.
//! The job's own launches priced this way must come to the ledger's worker-seconds (`tests/tests/replay.rs`:
//! within 10%).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use physalia_control::MetricsLine;
use physalia_gnn::EpochMetrics;
use physalia_planner::{CalibrationProfile, Catalog, PlanRequest, Sku, TimeBreakdown};
use serde::Serialize;

use crate::elastic::{Elastic, Stop};
use crate::job::{EpochEnd, LaunchSpan};
use crate::spec::{self, JobSpec, ParallelismSpec};
use physalia_control::JobSummary;
use physalia_coordinator::driver::dataset::{self, Source};
use physalia_coordinator::driver::{plan, summary};

/// A finished job's record, as the replay reads it.
pub(crate) struct Record {
    pub dir: PathBuf,
    pub spec: JobSpec,
    /// Run 0's epochs, in order.
    pub lines: Vec<MetricsLine>,
    pub launches: Vec<LaunchSpan>,
    pub epoch_ends: Vec<EpochEnd>,
    /// The ledger: worker-seconds and dollars billed.
    pub worker_s: f64,
    pub usd: f64,
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("{}: cannot read it", path.display()))
}

impl Record {
    pub(crate) fn read(dir: &Path) -> Result<Record> {
        if !dir.join("job.json").is_file() {
            bail!(
                "{}: not a finished job directory (no job.json; `physalia list` shows the jobs)",
                dir.display()
            );
        }
        let spec_path = dir.join("job.json");
        let spec: JobSpec = serde_json::from_str(&read_text(&spec_path)?)
            .with_context(|| format!("{}: not a job record", spec_path.display()))?;
        let metrics = dir.join("metrics.jsonl");
        let lines: Vec<MetricsLine> = MetricsLine::read_all(&metrics)
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .filter(|l| l.run == 0)
            .collect();
        if lines.is_empty() {
            bail!("{}: no recorded epoch to replay", metrics.display());
        }
        let summary_path = dir.join("summary.json");
        if !summary_path.is_file() {
            bail!("{}: the job has not finished", dir.display());
        }
        let summary = JobSummary::read(&summary_path).map_err(anyhow::Error::msg)?;
        let c = summary
            .coordinator_part("replay")
            .map_err(|e| anyhow::anyhow!("{}: {e}", summary_path.display()))?;
        let (launches, epoch_ends) = (c.launches.clone(), c.epoch_ends.clone());
        let (worker_s, usd) = (c.worker_seconds, summary.run.usd_total);
        Ok(Record {
            dir: dir.to_path_buf(),
            spec,
            lines,
            launches,
            epoch_ends,
            worker_s,
            usd,
        })
    }

    /// When epoch `e` ended, if recorded.
    fn end_of(&self, epoch: usize) -> Option<f64> {
        self.epoch_ends
            .iter()
            .find(|e| e.epoch == epoch)
            .map(|e| e.end_s)
    }

    /// Whether `span` ended as part of a launch resized in place (the one resized, or its joiners): it
    /// stopped when that launch started.
    fn resized_into(&self, span: &LaunchSpan) -> bool {
        span.stop_s.is_some_and(|stop| {
            self.launches
                .iter()
                .any(|t| t.in_place && t.start_s == stop)
        })
    }

    /// The launch that trained epoch `e` (the span its end lies in, with its worker count).
    fn launch_of(&self, line: &MetricsLine) -> Option<&LaunchSpan> {
        let end = self.end_of(line.metrics.epoch)?;
        self.launches.iter().find(|s| {
            s.workers == line.worker_count()
                && s.start_s <= end
                && s.stop_s.is_none_or(|stop| end <= stop)
        })
    }
}

/// What the record says of one epoch.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Measured {
    pub epoch: usize,
    pub workers: usize,
    /// Forward, backward and the optimizer (with sampling), the median rank's.
    pub compute_s: f64,
    /// Halo rows and all-reduce, the median rank's.
    pub network_s: f64,
    /// Sampling the trainer waited for (mini-batch jobs), rank 0's; part of `compute_s`.
    pub sample_s: f64,
    pub eval_s: f64,
    /// The slowest rank's training plus evaluation.
    pub busy_s: f64,
    /// From the previous epoch's end to this one's, within one launch.
    pub wall_s: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Each recorded epoch's time, split as the report stacks it.
pub(crate) fn measured(lines: &[MetricsLine], ends: &[EpochEnd]) -> Vec<Measured> {
    let end = |e: usize| ends.iter().find(|x| x.epoch == e).map(|x| x.end_s);
    let mut out: Vec<Measured> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let ranks = line.by_rank();
        let net = |m: &EpochMetrics| m.exchange.halo_s + m.exchange.all_reduce_s;
        let m = &line.metrics;
        let busy = ranks.iter().map(|r| r.train_s).fold(0.0, f64::max) + m.eval_s;
        // the previous epoch in the same launch: same workers and no new launch between
        let wall = match (i.checked_sub(1).map(|j| &lines[j]), end(m.epoch)) {
            (Some(prev), Some(b))
                if prev.worker_count() == line.worker_count()
                    && prev.metrics.epoch + 1 == m.epoch =>
            {
                end(prev.metrics.epoch).map(|a| b - a)
            }
            _ => None,
        };
        out.push(Measured {
            epoch: m.epoch,
            workers: line.worker_count(),
            compute_s: median(
                ranks
                    .iter()
                    .map(|r| (r.train_s - net(r)).max(0.0))
                    .collect(),
            ),
            network_s: median(ranks.iter().map(net).collect()),
            sample_s: m.batches.as_ref().map_or(0.0, |b| b.sample_wait_s),
            eval_s: m.eval_s,
            busy_s: busy,
            wall_s: wall,
        });
    }
    out
}

/// The planner's model of the job, fitted to its record.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Fit {
    /// Measured over predicted: compute (with sampling), network, evaluation, per-epoch overhead.
    pub compute: f64,
    pub network: f64,
    pub eval: f64,
    pub overhead: f64,
    /// Measured over fitted whole epochs, by worker count (the job's SKU only).
    pub per_workers: BTreeMap<usize, f64>,
    /// A launch's start-up (to its first epoch) and stop (after its last epoch), seconds, on the job's SKU:
    /// the mean over its launches.
    pub launch_start_s: f64,
    pub launch_stop_s: f64,
    /// Start-up by worker count, where measured (more processes start slower on a shared host).
    pub launch_by_workers: BTreeMap<usize, f64>,
    /// A resize in place (issue 33): the pause from the last epoch before it to the first after it, less
    /// that epoch, by the worker count it resized to; `None` where the job made none.
    pub resize_s: Option<f64>,
    pub resize_by_workers: BTreeMap<usize, f64>,
}

/// Predicts the job's epochs on any SKU and worker count with the planner, and applies the fit.
pub(crate) struct Model {
    spec: JobSpec,
    req: PlanRequest,
    catalog: Catalog,
    /// The SKU the job ran on.
    pub sku: Sku,
    pub fit: Fit,
    /// Whether the job read a chunked dataset (its resizes restart).
    chunked: bool,
}

/// One epoch and one launch of `workers` workers on a SKU, as the fitted model prices them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Priced {
    pub epoch_s: f64,
    /// Parts of `epoch_s` (fitted): network and evaluation.
    pub network_s: f64,
    pub eval_s: f64,
    /// A launch's start-up (to its first epoch, less that epoch).
    pub start_s: f64,
    pub fits_memory: bool,
    /// Bytes a worker sends per epoch (predicted).
    pub bytes: f64,
}

/// The planner's calibration for the local SKU (the one `plan::replan` scales too).
fn local_profile() -> CalibrationProfile {
    CalibrationProfile::dev_vm_2026_11()
}

impl Model {
    pub(crate) fn new(record: &Record) -> Result<Model> {
        let spec = &record.spec;
        // a generated dataset was written into the job directory, with its partitions beside it
        let written = record.dir.join("dataset.safetensors");
        let mut file = spec.clone();
        let source = if written.is_file() {
            file.dataset = spec::DatasetSpec {
                path: Some(written.clone()),
                synth: None,
                ..spec.dataset.clone()
            };
            Source::File(
                physalia_graph::Dataset::open_unverified(&written)
                    .with_context(|| format!("reading {}", written.display()))?,
            )
        } else {
            dataset::load(
                &spec.dataset,
                &physalia_coordinator::driver::Plain { quiet: true },
            )
            .context("loading the job's dataset")?
        };
        let req = plan::request(&file, &source)?;
        let chunked = matches!(source, Source::Chunked(_));
        drop(source);
        let catalog = Catalog::builtin();
        let price = summary::price(spec)?;
        let sku = catalog
            .get(&price.sku)
            .with_context(|| format!("the job's SKU `{}` is not in the catalog", price.sku))?
            .clone();
        let mut model = Model {
            spec: spec.clone(),
            req,
            catalog,
            sku,
            fit: Fit {
                compute: 1.0,
                network: 1.0,
                eval: 1.0,
                overhead: 1.0,
                per_workers: BTreeMap::new(),
                launch_start_s: 0.0,
                launch_stop_s: 0.0,
                launch_by_workers: BTreeMap::new(),
                resize_s: None,
                resize_by_workers: BTreeMap::new(),
            },
            chunked,
        };
        model.fit(record)?;
        Ok(model)
    }

    /// The planner's prediction (unfitted) for `workers` workers of the job's mode on `sku`.
    pub(crate) fn predict(
        &self,
        sku: &Sku,
        workers: usize,
    ) -> Result<physalia_planner::Prediction> {
        let mut spec = self.spec.clone();
        spec.workers = workers as u32;
        // replica groups keep their replicas when the count divides, else one group
        spec.parallelism = match spec.parallelism {
            ParallelismSpec::Groups(g) if (workers as u32).is_multiple_of(g.replicas) => {
                let k = workers as u32 / g.replicas;
                ParallelismSpec::Groups(spec::GroupsSpec {
                    partition: g.partition.map(|_| k),
                    data: g.data.map(|_| k),
                    replicas: g.replicas,
                })
            }
            ParallelismSpec::Groups(_) => ParallelismSpec::Mode(spec.mode()),
            m => m,
        };
        let profile = local_profile();
        let w = plan::as_written(
            &spec,
            &self.req,
            &self.catalog,
            Some(&sku.name),
            sku.backend.on_this_machine().then_some(&profile),
        )
        .with_context(|| format!("predicting {workers} workers on {}", sku.name))?;
        Ok(w.prediction)
    }

    fn parts(t: &TimeBreakdown) -> [f64; 4] {
        [
            t.compute_s + t.sample_s,
            t.exchange_s + t.allreduce_s,
            t.eval_s,
            t.overhead_s,
        ]
    }

    fn fit(&mut self, record: &Record) -> Result<()> {
        let measured = measured(&record.lines, &record.epoch_ends);
        let mut predicted: BTreeMap<usize, [f64; 4]> = BTreeMap::new();
        for m in &measured {
            if let std::collections::btree_map::Entry::Vacant(e) = predicted.entry(m.workers) {
                let p = self.predict(&self.sku, m.workers)?;
                e.insert(Self::parts(&p.time));
            }
        }
        // measured over predicted, summed over the epochs where the model predicts something
        let ratio = |got: &dyn Fn(&Measured) -> Option<f64>, part: usize| {
            let (mut a, mut b) = (0.0, 0.0);
            for m in &measured {
                let p = predicted[&m.workers][part];
                if let Some(g) = got(m)
                    && p > 0.0
                {
                    a += g;
                    b += p;
                }
            }
            if a > 0.0 && b > 0.0 { a / b } else { 1.0 }
        };
        self.fit.compute = ratio(&|m| Some(m.compute_s), 0);
        self.fit.network = ratio(&|m| Some(m.network_s), 1);
        self.fit.eval = ratio(&|m| Some(m.eval_s), 2);
        self.fit.overhead = ratio(&|m| m.wall_s.map(|w| (w - m.busy_s).max(0.0)), 3);
        // whole epochs at each measured worker count, against the fitted parts
        let fitted = |w: usize| {
            let p = predicted[&w];
            self.fit.compute * p[0]
                + self.fit.network * p[1]
                + self.fit.eval * p[2]
                + self.fit.overhead * p[3]
        };
        let mut walls: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        for m in &measured {
            if let Some(w) = m.wall_s {
                walls.entry(m.workers).or_default().push(w);
            }
        }
        // the mean, not the median: a job's cost is the sum of its epochs, and the median of epoch times
        // skewed by a few slow ones (a noisy host, a page-cache miss) prices the job below its ledger
        let mut per_workers = BTreeMap::new();
        for (w, v) in walls {
            let f = fitted(w);
            if f > 0.0 {
                per_workers.insert(w, v.iter().sum::<f64>() / v.len() as f64 / f);
            }
        }
        self.fit.per_workers = per_workers;
        // each launch that trained: its start-up and its stop; a launch resized in place, its pause
        let (mut starts, mut stops, mut resizes) = (Vec::new(), Vec::new(), Vec::new());
        let mut by_workers: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        let mut resize_by_workers: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        for span in record.launches.iter() {
            let ends: Vec<f64> = record
                .lines
                .iter()
                .filter(|l| record.launch_of(l).is_some_and(|s| s.launch == span.launch))
                .filter_map(|l| record.end_of(l.metrics.epoch))
                .collect();
            let (Some(first), Some(last)) = (
                ends.iter().copied().reduce(f64::min),
                ends.iter().copied().reduce(f64::max),
            ) else {
                continue;
            };
            let epoch = self.epoch_on_job_sku(span.workers, &predicted);
            if span.in_place {
                // from the last epoch before it (the launch it continues stopped at its start)
                let before = record
                    .epoch_ends
                    .iter()
                    .map(|e| e.end_s)
                    .filter(|&e| e <= span.start_s)
                    .reduce(f64::max)
                    .unwrap_or(span.start_s);
                let pause = (first - before - epoch).max(0.0);
                resizes.push(pause);
                resize_by_workers
                    .entry(span.workers)
                    .or_default()
                    .push(pause);
            } else {
                let start = (first - span.start_s - epoch).max(0.0);
                starts.push(start);
                by_workers.entry(span.workers).or_default().push(start);
            }
            // a launch resized in place stops when the resize is over: that is the pause, not a stop
            if let Some(stop) = span.stop_s
                && !record.resized_into(span)
            {
                stops.push((stop - last).max(0.0));
            }
        }
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        self.fit.launch_start_s = mean(&starts);
        self.fit.launch_stop_s = mean(&stops);
        self.fit.launch_by_workers = by_workers.iter().map(|(w, v)| (*w, mean(v))).collect();
        self.fit.resize_s = (!resizes.is_empty()).then(|| mean(&resizes));
        self.fit.resize_by_workers = resize_by_workers
            .iter()
            .map(|(w, v)| (*w, mean(v)))
            .collect();
        Ok(())
    }

    fn epoch_on_job_sku(&self, workers: usize, predicted: &BTreeMap<usize, [f64; 4]>) -> f64 {
        let p = predicted[&workers];
        let f = &self.fit;
        (f.compute * p[0] + f.network * p[1] + f.eval * p[2] + f.overhead * p[3])
            * f.per_workers.get(&workers).copied().unwrap_or(1.0)
    }

    /// An epoch and a launch of `workers` workers on `sku`, fitted.
    pub(crate) fn price(&self, sku: &Sku, workers: usize) -> Result<Priced> {
        let p = self.predict(sku, workers)?;
        let [c, n, v, o] = Self::parts(&p.time);
        let f = &self.fit;
        let same = sku.name == self.sku.name;
        let r = if same {
            f.per_workers.get(&workers).copied().unwrap_or(1.0)
        } else {
            1.0
        };
        let (network_s, eval_s) = (r * f.network * n, r * f.eval * v);
        let epoch_s = r * f.compute * c + network_s + eval_s + r * f.overhead * o;
        let mut start_s = f
            .launch_by_workers
            .get(&workers)
            .copied()
            .unwrap_or(f.launch_start_s);
        if !same {
            // the other SKU's cold start and loading, beyond what the job's SKU takes
            let here = self.predict(&self.sku, workers)?;
            start_s += (p.time.setup_s - here.time.setup_s).max(0.0);
        }
        let m = &p.memory;
        Ok(Priced {
            epoch_s,
            network_s,
            eval_s,
            start_s,
            fits_memory: m.device_bytes <= m.device_usable_bytes,
            bytes: p.exchange_bytes_per_epoch + p.allreduce_bytes_per_epoch,
        })
    }
}

/// Launches one after another.
type Schedule = Vec<Step>;

/// Epochs trained by one worker count, started as a launch or resized into in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Step {
    pub workers: usize,
    pub epochs: usize,
    /// Resized in place from the step before (the survivors go on; the joiners start, prewarmed or
    /// in the pause): no launch of its own.
    pub in_place: bool,
    /// Its joiners were started ahead and are paid for already (prewarmed: by the step before, or
    /// measured in the record).
    pub joiners_paid: bool,
    /// The policy's prewarm during this step: workers kept warm for a launch of this size, through
    /// `prewarm_epochs` of its epochs (0: none).
    pub prewarm_to: usize,
    pub prewarm_epochs: usize,
}

impl Step {
    fn launch(workers: usize, epochs: usize) -> Step {
        Step {
            workers,
            epochs,
            in_place: false,
            joiners_paid: false,
            prewarm_to: 0,
            prewarm_epochs: 0,
        }
    }
}

/// One priced way to run the job.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// `as run`, `policy`, `fixed`, `fixed at peak`.
    pub scenario: String,
    pub sku: String,
    /// Worker count of each launch, in order.
    pub workers: Vec<usize>,
    /// How each change of worker count is made: `in place` or `restart` (one fewer than `workers`).
    pub resizes: Vec<&'static str>,
    pub epochs: usize,
    /// Wall-clock seconds, launches one after another.
    pub wall_s: f64,
    pub worker_s: f64,
    pub usd: f64,
    /// Training nodes visited per dollar (`None` at a price of zero).
    pub nodes_per_usd: Option<f64>,
    /// This row's throughput per dollar (per worker-second at a price of zero) over the fixed cluster's
    /// sized for the peak, on the same SKU.
    pub vs_fixed_peak: Option<f64>,
    /// Whether every launch fits the SKU's memory (predicted).
    pub fits_memory: bool,
}

fn usd_of(sku: &Sku, wall_s: f64, worker_s: f64) -> f64 {
    // a shared host is paid once, whatever runs on it
    if sku.shared_host {
        wall_s * sku.usd_per_s()
    } else {
        worker_s * sku.usd_per_s()
    }
}

impl Model {
    /// Whether the job resizes in place (`JobSpec::resizes_in_place`; on every platform).
    fn in_place(&self) -> bool {
        self.spec.resizes_in_place(self.chunked)
    }

    /// A resize in place from `from` to `to` workers on `sku`: (wall seconds, worker-seconds). Every
    /// worker of either count is there through the pause (the job's measured pause; its launch start-up
    /// where it made none); joiners also start: paid for already when `joiners_paid` (prewarmed while
    /// the others trained: no one waits), else within the pause (on another SKU, with its longer cold
    /// start).
    fn resize(&self, sku: &Sku, from: usize, to: usize, joiners_paid: bool) -> Result<(f64, f64)> {
        let f = &self.fit;
        let pause = f
            .resize_by_workers
            .get(&to)
            .copied()
            .or(f.resize_s)
            .unwrap_or(f.launch_start_s);
        let joiners = to.saturating_sub(from);
        if joiners == 0 || joiners_paid {
            return Ok((pause, from.max(to) as f64 * pause));
        }
        // the measured pause holds the joiners' start on the job's SKU; another's cold start is longer
        let here = f
            .launch_by_workers
            .get(&joiners)
            .copied()
            .unwrap_or(f.launch_start_s);
        let extra = (self.price(sku, joiners)?.start_s - here).max(0.0);
        Ok((pause + extra, to as f64 * (pause + extra)))
    }

    fn row(&self, scenario: &str, sku: &Sku, schedule: &[Step]) -> Result<Row> {
        let (mut wall, mut worker_s, mut fits, mut epochs) = (0.0, 0.0, true, 0);
        let in_place = self.in_place();
        let mut resizes = Vec::new();
        let stop_s = self.fit.launch_stop_s;
        // a launch started ahead by the step before (a prewarm for a relaunch): its size
        let mut prewarmed_launch = None;
        for (i, step) in schedule.iter().enumerate() {
            let (w, n) = (step.workers, step.epochs);
            let p = self.price(sku, w)?;
            let train = n as f64 * p.epoch_s;
            let resized = |s: &Step| s.in_place && in_place;
            match i.checked_sub(1).map(|j| schedule[j].workers) {
                Some(from) if resized(step) => {
                    let (t, ws) = self.resize(sku, from, w, step.joiners_paid)?;
                    wall += t + train;
                    worker_s += ws + w as f64 * train;
                    resizes.push("in place");
                }
                previous => {
                    // a prewarmed launch of this size started while the one before trained
                    let start = if prewarmed_launch == Some(w) {
                        0.0
                    } else {
                        p.start_s
                    };
                    wall += start + train;
                    worker_s += w as f64 * (start + train);
                    if previous.is_some() {
                        resizes.push("restart");
                    }
                }
            }
            // the policy's prewarm: spares (in place) or a whole launch (a relaunch) started ahead and
            // kept warm while this step trains, paid whether or not a resize takes them
            prewarmed_launch = None;
            if step.prewarm_to > 0 && step.prewarm_epochs > 0 {
                let warm = if in_place {
                    step.prewarm_to.saturating_sub(w)
                } else {
                    step.prewarm_to
                };
                if warm > 0 {
                    let held = step.prewarm_epochs as f64 * p.epoch_s;
                    worker_s += warm as f64 * (self.price(sku, warm)?.start_s + held);
                    if !in_place {
                        prewarmed_launch = Some(step.prewarm_to);
                    }
                }
            }
            // a launch stops with the worker count it has then: after its last resize in place
            if schedule.get(i + 1).is_none_or(|next| !resized(next)) {
                wall += stop_s;
                worker_s += w as f64 * stop_s;
            }
            fits &= p.fits_memory;
            epochs += n;
        }
        let usd = usd_of(sku, wall, worker_s);
        let nodes = self.req.graph.train_nodes as f64 * epochs as f64;
        Ok(Row {
            scenario: scenario.into(),
            sku: sku.name.clone(),
            workers: schedule.iter().map(|s| s.workers).collect(),
            resizes,
            epochs,
            wall_s: wall,
            worker_s,
            usd,
            nodes_per_usd: (usd > 0.0).then(|| nodes / usd),
            vs_fixed_peak: None,
            fits_memory: fits,
        })
    }

    /// The job's scaling policy replayed on `sku`: the recorded losses, the fitted epoch times.
    fn policy_schedule(
        &self,
        record: &Record,
        sku: &Sku,
    ) -> Result<Option<(Schedule, Vec<String>)>> {
        let Some(policy) = record.spec.scaling.clone() else {
            return Ok(None);
        };
        let epochs_total = record.spec.train.epochs as usize;
        let mut w = record.lines[0].worker_count();
        let mut elastic = Elastic::new(policy, w as u32, epochs_total as u32, sku.usd_per_s());
        let mut schedule: Schedule = vec![Step::launch(w, 0)];
        let mut notes = Vec::new();
        for line in &record.lines {
            schedule.last_mut().expect("one launch").epochs += 1;
            let p = self.price(sku, w)?;
            let mut m = line.metrics.clone();
            m.train_s = p.epoch_s - p.eval_s;
            m.eval_s = p.eval_s;
            m.exchange.halo_s = p.network_s;
            m.exchange.all_reduce_s = 0.0;
            m.exchange.bytes_sent = p.bytes as u64;
            let by_rank = vec![m; w];
            let stop = elastic.after_epoch(&by_rank, epochs_total);
            // spares kept warm from here on, for a size the policy expects
            let target = elastic.prewarm_target().filter(|&t| t != w);
            let step = schedule.last_mut().expect("one launch");
            if let (None, Some(t)) = (&stop, target) {
                step.prewarm_to = t;
                step.prewarm_epochs += 1;
            }
            let prewarmed = step.prewarm_to;
            match stop {
                None => {}
                Some(Stop::Rescale { to, .. }) => {
                    w = to;
                    schedule.push(Step {
                        workers: w,
                        epochs: 0,
                        in_place: true,
                        joiners_paid: prewarmed == w,
                        prewarm_to: 0,
                        prewarm_epochs: 0,
                    });
                }
                Some(Stop::Reconfigure { what, .. }) => {
                    notes.push(format!("after epoch {}: {what}", m_epoch(line)));
                    schedule.push(Step::launch(w, 0));
                }
                Some(Stop::Replan { .. }) => notes.push(format!(
                    "after epoch {}: a replan (not replayed: the workers stay)",
                    m_epoch(line)
                )),
                Some(Stop::Finish) => break,
                Some(Stop::Lost { .. }) => {}
            }
        }
        schedule.retain(|s| s.epochs > 0);
        Ok(Some((schedule, notes)))
    }
}

fn m_epoch(l: &MetricsLine) -> usize {
    l.metrics.epoch
}

/// What `physalia plan --replay` prints.
#[derive(Debug, Serialize)]
pub(crate) struct Replay {
    pub job_dir: String,
    pub sku: String,
    pub epochs: usize,
    pub fit: Fit,
    /// The ledger: worker-seconds and dollars billed.
    pub ledger_worker_s: f64,
    pub ledger_usd: f64,
    /// The job's own launches priced by the fitted model.
    pub own: Row,
    /// `own.worker_s` over the ledger's, less one.
    pub own_error: f64,
    pub peak_workers: usize,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

/// Replays the job in `dir`, pricing it on its own SKU and on `skus` (none: every CPU SKU of the
/// catalog's cloud platforms when the job's SKU costs nothing).
pub(crate) fn replay(dir: &Path, skus: &[String]) -> Result<Replay> {
    let record = Record::read(dir)?;
    let model = Model::new(&record)?;
    let targets = target_skus(&model, skus)?;
    let own = own_schedule(&record);
    let peak = record
        .lines
        .iter()
        .map(MetricsLine::worker_count)
        .max()
        .unwrap_or(1);
    let epochs = record.lines.len();
    // on the job's own SKU its prewarms are measured (`untrained` below), not priced
    let own_measured: Schedule = own
        .iter()
        .map(|s| Step {
            prewarm_to: 0,
            prewarm_epochs: 0,
            ..*s
        })
        .collect();
    let mut own_row = model.row("as run", &model.sku, &own_measured)?;
    // launches that trained nothing (lost before an epoch, prewarms) at what they cost; joiners started
    // in a resize's pause are in its price
    let untrained: f64 = record
        .launches
        .iter()
        .filter(|s| {
            (s.prewarm || !record.resized_into(s))
                && !record
                    .lines
                    .iter()
                    .any(|l| record.launch_of(l).is_some_and(|x| x.launch == s.launch))
        })
        .map(|s| s.workers as f64 * (s.stop_s.unwrap_or(s.start_s) - s.start_s))
        .sum();
    own_row.worker_s += untrained;
    let mut notes = Vec::new();
    if untrained > 0.0 {
        notes.push(format!(
            "as run includes {untrained:.1} worker-s of launches that trained no epoch, as measured"
        ));
    }
    let mut rows = Vec::new();
    let counts = worker_counts(&record, peak);
    for sku in &targets {
        let mut block = Vec::new();
        if sku.name == model.sku.name {
            block.push(own_row.clone());
        } else {
            block.push(model.row("as run", sku, &own)?);
        }
        if let Some((schedule, n)) = model.policy_schedule(&record, sku)? {
            block.push(model.row("policy", sku, &schedule)?);
            for line in n {
                notes.push(format!("{}: {line}", sku.name));
            }
        }
        for &w in &counts {
            let name = if w == peak { "fixed at peak" } else { "fixed" };
            match model.row(name, sku, &[Step::launch(w, epochs)]) {
                Ok(r) => block.push(r),
                Err(e) => notes.push(format!("{} x {w}: {e:#}", sku.name)),
            }
        }
        // throughput per dollar against the fixed cluster sized for the peak (equal epochs: cost ratio)
        if let Some(fixed) = block
            .iter()
            .find(|r| r.scenario == "fixed at peak")
            .cloned()
        {
            for r in &mut block {
                r.vs_fixed_peak = if fixed.usd > 0.0 && r.usd > 0.0 {
                    Some(fixed.usd / r.usd)
                } else if r.worker_s > 0.0 {
                    Some(fixed.worker_s / r.worker_s)
                } else {
                    None
                };
            }
        }
        rows.extend(block);
    }
    if let Some(r) = rows.first() {
        own_row.vs_fixed_peak = r.vs_fixed_peak;
    }
    let own_error = if record.worker_s > 0.0 {
        own_row.worker_s / record.worker_s - 1.0
    } else {
        0.0
    };
    Ok(Replay {
        job_dir: record.dir.display().to_string(),
        sku: model.sku.name.clone(),
        epochs,
        fit: model.fit.clone(),
        ledger_worker_s: record.worker_s,
        ledger_usd: record.usd,
        own: own_row,
        own_error,
        peak_workers: peak,
        rows,
        notes,
    })
}

/// The SKUs a replay prices: the job's, those named, and where the job's cost nothing (this machine)
/// every CPU SKU of a cloud.
fn target_skus(model: &Model, skus: &[String]) -> Result<Vec<Sku>> {
    let mut targets: Vec<Sku> = vec![model.sku.clone()];
    for name in skus {
        let s = model
            .catalog
            .get(name)
            .with_context(|| format!("--sku: no SKU named `{name}` in the catalog"))?;
        if !targets.iter().any(|t| t.name == s.name) {
            targets.push(s.clone());
        }
    }
    if skus.is_empty() && model.sku.usd_per_s() == 0.0 {
        for s in &model.catalog.skus {
            if !s.is_gpu()
                && !s.backend.on_this_machine()
                && !targets.iter().any(|t| t.name == s.name)
            {
                targets.push(s.clone());
            }
        }
    }
    Ok(targets)
}

/// The job's own launches: the workers and epochs of each that trained.
fn own_schedule(record: &Record) -> Schedule {
    let mut own: Schedule = Vec::new();
    let mut previous = None;
    for line in &record.lines {
        let span = record.launch_of(line);
        let key = (line.worker_count(), span.map(|s| s.launch));
        match own.last_mut() {
            Some(last) if previous == Some(key) => last.epochs += 1,
            _ => {
                let in_place = !own.is_empty() && span.is_some_and(|s| s.in_place);
                // prewarmed joiners are in the record as launches of their own (`untrained`)
                let joiners_paid = in_place
                    && span.is_some_and(|s| {
                        record
                            .launches
                            .iter()
                            .any(|j| j.prewarm && j.stop_s == Some(s.start_s))
                    });
                own.push(Step {
                    workers: key.0,
                    epochs: 1,
                    in_place,
                    joiners_paid,
                    prewarm_to: 0,
                    prewarm_epochs: 0,
                })
            }
        }
        previous = Some(key);
    }
    // each prewarm, on the step it was kept warm through (what it costs on another SKU; on the job's
    // own the record has it as a launch)
    let mut first = 0;
    for step in own.iter_mut() {
        let ends: Vec<f64> = record.lines[first..first + step.epochs]
            .iter()
            .filter_map(|l| record.end_of(l.metrics.epoch))
            .collect();
        first += step.epochs;
        for p in record.launches.iter().filter(|p| p.prewarm) {
            let held = ends
                .iter()
                .filter(|&&e| p.start_s <= e && p.stop_s.is_none_or(|s| e < s))
                .count();
            if held > 0 && step.prewarm_epochs == 0 {
                // spares for a resize in place join the step's workers; a prewarmed relaunch is whole
                let joined = record.resized_into(p);
                step.prewarm_to = if joined {
                    step.workers + p.workers
                } else {
                    p.workers
                };
                step.prewarm_epochs = held;
            }
        }
    }
    own
}

/// The fixed worker counts a replay prices: powers of two up to the policy's maximum (or the peak),
/// and the peak.
fn worker_counts(record: &Record, peak: usize) -> Vec<usize> {
    let max_w = record
        .spec
        .scaling
        .as_ref()
        .map_or(peak, |p| (p.max_workers as usize).max(peak));
    let mut counts: Vec<usize> = (0..)
        .map(|i| 1usize << i)
        .take_while(|&w| w <= max_w)
        .collect();
    if !counts.contains(&peak) {
        counts.push(peak);
        counts.sort();
    }
    counts
}

impl Replay {
    /// The table `physalia plan --replay` prints.
    pub(crate) fn render(&self) -> String {
        let f = &self.fit;
        let mut out = format!(
            "replay of {}: {} epochs on {} (peak {} workers); the ledger billed {:.1} worker-s, ${:.4}\n",
            self.job_dir,
            self.epochs,
            self.sku,
            self.peak_workers,
            self.ledger_worker_s,
            self.ledger_usd
        );
        let per: Vec<String> = f
            .per_workers
            .iter()
            .map(|(w, r)| format!("{w}: {r:.2}x"))
            .collect();
        out.push_str(&format!(
            "fitted to the record: compute {:.2}x, network {:.2}x, eval {:.2}x, per-epoch overhead {:.2}x the \
             planner's; launch start {:.2} s, stop {:.2} s; resize in place {}; by worker count {}\n",
            f.compute,
            f.network,
            f.eval,
            f.overhead,
            f.launch_start_s,
            f.launch_stop_s,
            f.resize_s
                .map_or_else(|| "- (none made)".to_string(), |r| format!("{r:.2} s")),
            if per.is_empty() {
                "-".into()
            } else {
                per.join(", ")
            }
        ));
        out.push_str(&format!(
            "as run, priced by the fitted model: {:.1} worker-s, {:+.1}% against the ledger\n\n",
            self.own.worker_s,
            100.0 * self.own_error
        ));
        // `->` a relaunch, `=>` a resize in place
        let workers = |r: &Row| {
            let mut s = r.workers.first().map_or(String::new(), |w| w.to_string());
            for (w, how) in r.workers.iter().skip(1).zip(&r.resizes) {
                s.push_str(if *how == "in place" { "=>" } else { "->" });
                s.push_str(&w.to_string());
            }
            s
        };
        out.push_str(&format!(
            "{:<14} {:<16} {:>10} {:>9} {:>10} {:>10} {:>12} {:>8}  {}\n",
            "scenario",
            "sku",
            "workers",
            "time s",
            "worker-s",
            "USD",
            "nodes/$",
            "vs fixed",
            "memory"
        ));
        for r in &self.rows {
            out.push_str(&format!(
                "{:<14} {:<16} {:>10} {:>9.2} {:>10.1} {:>10.4} {:>12} {:>8}  {}\n",
                r.scenario,
                r.sku,
                workers(r),
                r.wall_s,
                r.worker_s,
                r.usd,
                r.nodes_per_usd
                    .map(|n| format!("{n:.3e}"))
                    .unwrap_or_else(|| "-".into()),
                r.vs_fixed_peak
                    .map(|v| format!("{v:.2}x"))
                    .unwrap_or_else(|| "-".into()),
                if r.fits_memory { "fits" } else { "too big" }
            ));
        }
        out.push_str(
            "\nvs fixed: throughput per dollar (per worker-second at a price of zero) over a fixed cluster \
             sized for the peak on the same SKU; other SKUs use the catalog's rates times the fitted \
             factors; workers: `->` a relaunch from the checkpoint, `=>` a resize in place (the survivors \
             go on; on platforms that resize in place)\n",
        );
        for n in &self.notes {
            out.push_str(&format!("note: {n}\n"));
        }
        out
    }
}
