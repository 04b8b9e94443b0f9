//! Following and stopping jobs from their record: `physalia list`, `status`, `logs` and `cancel`.
//!
//! Each reads the job directory only (`job.json`, `status.json`, `metrics.jsonl`, `logs/`), so it works
//! from any process that can read the job store, whether the job's coordinator runs, died or ended. A
//! job is named by its directory, or by its directory's name or job name under the output folder (the
//! newest job of that name). With `--dir URL` (or a job's URL), the job is in an object store: its
//! record is downloaded (`store::Fetched`) and read the same way, and `cancel` puts its request there.
//!
//! A record that says `running` may outlive its coordinator (killed, machine lost): its heartbeat
//! (`updated_unix_s`, rewritten every few seconds) goes stale, and on the coordinator's own host its
//! process is gone. These commands report such a job as `lost` and say how to continue it; `cancel`
//! then stops what the dead coordinator left (containers, secrets) and records the job as cancelled.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use physalia_control::record::unix_now;
use physalia_control::{HEARTBEAT_S, JobState, JobStatus, MetricsLine};
use serde::Serialize;

use crate::find::{job_dirs, job_id, resolve};
use crate::jobdir::{CANCEL_FILE, write_atomic, write_json};
use crate::output::{OutputFormat, Terminal};
use crate::spec::JobSpec;
use crate::store::{self, Fetched};
use physalia_coordinator::driver::{cluster, distributed};

/// A coordinator on another host is taken for dead after this much silence.
const SILENT_S: f64 = 12.0 * HEARTBEAT_S;

#[derive(Args)]
pub struct ListArgs {
    /// The folder of job directories or the job store's URL (a job file's `output.dir`), as `report`
    /// takes a job; the same as `--dir`.
    #[arg(value_name = "DIR", conflicts_with = "dir")]
    store: Option<PathBuf>,
    /// The folder of job directories (a job file's `output.dir`).
    #[arg(long, default_value = "jobs")]
    dir: PathBuf,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

#[derive(Args)]
pub struct StatusArgs {
    /// A job directory, or a job's (directory) name under `--dir`.
    job: String,
    #[arg(long, default_value = "jobs")]
    dir: PathBuf,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

#[derive(Args)]
pub struct LogsArgs {
    /// A job directory, or a job's (directory) name under `--dir`.
    job: String,
    /// A worker's output (every launch of that rank, in order); `coordinator`: a cluster-mode
    /// coordinator's output as its platform keeps it; without it, the coordinator's log in the record.
    #[arg(long, value_parser = parse_rank)]
    rank: Option<Rank>,
    /// Keep printing what is written until the job ends.
    #[arg(long, short)]
    follow: bool,
    #[arg(long, default_value = "jobs")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct CancelArgs {
    /// A job directory, or a job's (directory) name under `--dir`.
    job: String,
    #[arg(long, default_value = "jobs")]
    dir: PathBuf,
    /// Seconds to wait for the coordinator to stop the job.
    #[arg(long, default_value_t = 60.0)]
    wait: f64,
}

/// What `logs --rank` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rank {
    Worker(usize),
    Coordinator,
}

fn parse_rank(s: &str) -> Result<Rank, String> {
    match s {
        "coordinator" => Ok(Rank::Coordinator),
        n => n
            .parse()
            .map(Rank::Worker)
            .map_err(|_| format!("{n:?} is neither a worker's rank (0, 1, ...) nor `coordinator`")),
    }
}

/// A job as its record shows it.
#[derive(Debug, Serialize)]
pub struct JobView {
    /// The job directory's name: the job's id.
    pub job: String,
    pub dir: PathBuf,
    /// `running`, `succeeded`, `failed`, `cancelled`, or `lost` (recorded as running, but its
    /// coordinator is gone).
    pub state: String,
    pub status: JobStatus,
    /// The last recorded epoch's numbers.
    pub last_epoch: Option<LastEpoch>,
    /// Seconds since the coordinator last wrote the status.
    pub updated_s_ago: f64,
    /// A cluster-mode job's coordinator on its platform (its `coordinator.json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform_coordinator: Option<physalia_backends::CoordinatorHandle>,
}

/// The last recorded epoch: rank 0's metrics (loss and accuracies are global) and the worker count.
#[derive(Debug, Serialize)]
pub struct LastEpoch {
    #[serde(flatten)]
    pub metrics: physalia_gnn::EpochMetrics,
    pub workers: usize,
}

impl JobView {
    /// Reads the job in `dir`.
    pub fn read(dir: &Path) -> Result<JobView> {
        let status = JobStatus::read(&dir.join("status.json")).map_err(anyhow::Error::msg)?;
        let metrics = dir.join("metrics.jsonl");
        let text = std::fs::read_to_string(&metrics)
            .with_context(|| format!("{}: cannot read", metrics.display()))?;
        let lines = MetricsLine::parse_all(&text, &metrics.display().to_string())
            .map_err(anyhow::Error::msg)?;
        let last_epoch = lines.last().map(|l| LastEpoch {
            metrics: l.metrics.clone(),
            workers: l.worker_count(),
        });
        let updated_s_ago = (unix_now() - status.updated_unix_s).max(0.0);
        let lost = status.state == JobState::Running
            && match &status.coordinator {
                Some(c) if c.is_gone_here() => true,
                Some(c) if c.host == physalia_control::record::host_name() => false,
                _ => updated_s_ago > SILENT_S,
            };
        Ok(JobView {
            job: job_id(dir),
            dir: dir.to_path_buf(),
            state: if lost {
                "lost".into()
            } else {
                status.state.as_str().into()
            },
            status,
            last_epoch,
            updated_s_ago,
            platform_coordinator: cluster::recorded_handle(dir)?,
        })
    }

    fn is_lost(&self) -> bool {
        self.state == "lost"
    }

    /// The few lines `physalia status` prints.
    fn render(&self) -> String {
        let s = &self.status;
        let mut out = format!("job {} ({})\n", self.job, self.dir.display());
        let backend = s.backend.as_deref().unwrap_or("local");
        let mut line = format!("state: {}, epoch {} of {}", self.state, s.epoch, s.epochs);
        if s.state == JobState::Running && s.workers > 0 && !self.is_lost() {
            line.push_str(&format!(" on {} workers", s.workers));
        }
        // a job that is no longer running has its whole bill in the record
        let bill = match s.state == JobState::Running && !self.is_lost() {
            true => "so far",
            false => "in all",
        };
        line.push_str(&format!(", {backend} backend, ${:.4} {bill}\n", s.usd));
        out.push_str(&line);
        if let Some(e) = &s.error {
            out.push_str(&format!("error: {e}\n"));
        }
        if let Some(LastEpoch {
            metrics: e,
            workers,
        }) = &self.last_epoch
        {
            out.push_str(&format!(
                "last epoch {}: loss {:.4}, train {}, val {}, test {}, {:.3} s on {workers} workers\n",
                e.epoch,
                e.loss,
                acc(e.train_acc),
                acc(e.val_acc),
                acc(e.test_acc),
                e.train_s,
            ));
        }
        if let Some(c) = &s.coordinator {
            out.push_str(&format!(
                "coordinator: pid {} on {}, last heard {:.0} s ago\n",
                c.pid, c.host, self.updated_s_ago
            ));
        }
        if let Some(h) = &self.platform_coordinator {
            let objects: Vec<String> = h
                .objects
                .iter()
                .map(|o| format!("{} {}", o.kind, o.id))
                .collect();
            out.push_str(&format!(
                "cluster mode: the coordinator runs on {} in {} ({})\n",
                h.backend,
                h.scope,
                objects.join(", ")
            ));
        }
        if self.is_lost() {
            out.push_str(&format!(
                "its coordinator is gone: `physalia submit --resume {}` continues it from its last \
                 checkpoint, `physalia cancel {}` ends it\n",
                self.dir.display(),
                self.dir.display()
            ));
        }
        out
    }
}

fn acc(a: Option<f64>) -> String {
    a.map(|a| format!("{a:.4}")).unwrap_or_else(|| "-".into())
}

/// The job `job` names under `root` as a local folder: the job directory itself, or a copy of a job in
/// an object store (`root` or `job` a URL), kept as long as the [`Fetched`] lives.
fn located(job: &str, root: &Path) -> Result<(PathBuf, Option<Fetched>)> {
    if store::is_url(root) || job.contains("://") {
        let f = Fetched::locate(job, root)?;
        Ok((f.dir.clone(), Some(f)))
    } else {
        Ok((resolve(job, root)?, None))
    }
}

/// Reads the job in `dir`, naming it by its URL when it was fetched from a store.
fn view_of(dir: &Path, fetched: Option<&Fetched>) -> Result<JobView> {
    let mut view = JobView::read(dir)?;
    if let Some(f) = fetched {
        view.dir = PathBuf::from(f.url());
    }
    Ok(view)
}

pub fn list(a: &ListArgs) -> Result<()> {
    let mut views = Vec::new();
    let mut unreadable = Vec::new();
    let dir = a.store.as_ref().unwrap_or(&a.dir);
    if store::is_url(dir) {
        let remote = store::Remote::open(&dir.to_string_lossy())?;
        let tmp = tempfile::tempdir()?;
        for id in remote.jobs()? {
            match remote
                .fetch(&id, tmp.path())
                .and_then(|d| JobView::read(&d))
            {
                Ok(mut v) => {
                    v.dir = PathBuf::from(format!("{}/{id}", remote.url()));
                    views.push(v)
                }
                Err(e) => unreadable.push(format!("{e:#}")),
            }
        }
    } else {
        if !dir.is_dir() {
            bail!("{}: no such folder of jobs", dir.display());
        }
        for d in job_dirs(dir) {
            match JobView::read(&d) {
                Ok(v) => views.push(v),
                Err(e) => unreadable.push(format!("{e:#}")),
            }
        }
    }
    views.sort_by(|a, b| {
        a.status
            .started_unix_s
            .total_cmp(&b.status.started_unix_s)
            .then_with(|| a.job.cmp(&b.job))
    });
    match a.output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&views)?),
        OutputFormat::Text => {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "{:<40} {:<10} {:>11} {:>7} {:<10} {:>10}",
                "JOB", "STATE", "EPOCH", "WORKERS", "BACKEND", "USD"
            )?;
            for v in &views {
                let s = &v.status;
                writeln!(
                    out,
                    "{:<40} {:<10} {:>11} {:>7} {:<10} {:>10.4}",
                    v.job,
                    v.state,
                    format!("{}/{}", s.epoch, s.epochs),
                    // a running job's workers now, an ended one's in its last epoch
                    match (&v.last_epoch, s.state == JobState::Running && !v.is_lost()) {
                        (_, true) => s.workers.to_string(),
                        (Some(last), false) => last.workers.to_string(),
                        (None, false) => "-".into(),
                    },
                    s.backend.as_deref().unwrap_or("local"),
                    s.usd
                )?;
            }
        }
    }
    for e in unreadable {
        eprintln!("warning: {e}");
    }
    Ok(())
}

pub fn status(a: &StatusArgs) -> Result<()> {
    let (dir, fetched) = located(&a.job, &a.dir)?;
    let view = view_of(&dir, fetched.as_ref())?;
    match a.output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&view)?),
        OutputFormat::Text => print!("{}", view.render()),
    }
    Ok(())
}

/// A rank's log files, launch by launch (`worker-R.log`, `worker-R.seg1.log`, ...).
fn rank_logs(logs: &Path, rank: usize) -> Vec<PathBuf> {
    let mut segs: Vec<(u32, PathBuf)> = std::fs::read_dir(logs)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rest = name
                .strip_prefix(&format!("worker-{rank}"))?
                .strip_suffix(".log")?;
            let seg = match rest {
                "" => 0,
                r => r.strip_prefix(".seg")?.parse().ok()?,
            };
            Some((seg, e.path()))
        })
        .collect();
    segs.sort();
    segs.into_iter().map(|(_, p)| p).collect()
}

pub fn logs(a: &LogsArgs) -> Result<()> {
    let (dir, fetched) = located(&a.job, &a.dir)?;
    if a.rank == Some(Rank::Coordinator) {
        return coordinator_logs(&dir, fetched.as_ref(), a.follow);
    }
    let rank = a.rank.map(|r| match r {
        Rank::Worker(r) => r,
        Rank::Coordinator => unreachable!("handled above"),
    });
    let logs = dir.join("logs");
    let files = || match rank {
        Some(r) => rank_logs(&logs, r),
        None => vec![logs.join("coordinator.log")]
            .into_iter()
            .filter(|p| p.exists())
            .collect(),
    };
    let first = files();
    if first.is_empty() && !a.follow {
        match rank {
            Some(r) => bail!(
                "job {}: no output of rank {r} (logs/worker-{r}*.log); ranks start at 0",
                job_id(&dir)
            ),
            None => bail!("job {}: no coordinator log yet", job_id(&dir)),
        }
    }
    let mut out = std::io::stdout().lock();
    // how far each file has been printed
    let mut printed: Vec<(PathBuf, u64)> = Vec::new();
    let mut print_new = |out: &mut std::io::StdoutLock<'_>| -> Result<()> {
        for path in files() {
            let done = match printed.iter_mut().find(|(p, _)| *p == path) {
                Some((_, n)) => n,
                None => {
                    printed.push((path.clone(), 0));
                    &mut printed.last_mut().expect("just pushed").1
                }
            };
            let mut f = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(_) => continue,
            };
            f.seek(std::io::SeekFrom::Start(*done))?;
            let mut buf = Vec::new();
            f.read_to_end(&mut buf)?;
            *done += buf.len() as u64;
            match out.write_all(&buf) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                r => r?,
            }
        }
        out.flush().or_else(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => Ok(()),
            _ => Err(e),
        })?;
        Ok(())
    };
    print_new(&mut out)?;
    if !a.follow {
        return Ok(());
    }
    loop {
        if let Some(f) = &fetched {
            f.refresh()?;
        }
        let view = JobView::read(&dir)?;
        let over = view.status.state.is_final() || view.is_lost();
        print_new(&mut out)?;
        if over {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `logs --rank coordinator`: a cluster-mode coordinator's output from its platform (CloudWatch Logs,
/// the pod's log, the container group's), until the job ends with `follow`.
fn coordinator_logs(dir: &Path, fetched: Option<&Fetched>, follow: bool) -> Result<()> {
    let id = job_id(dir);
    let Some(handle) = cluster::recorded_handle(dir)? else {
        bail!(
            "job {id} ran no coordinator on a platform (client mode): `physalia logs {id}` shows its \
             coordinator's log"
        );
    };
    let spec = recorded_spec(dir)?;
    let mut shown = 0;
    let mut out = std::io::stdout().lock();
    let mut over_since: Option<Instant> = None;
    loop {
        if let Some(f) = fetched {
            f.refresh()?;
        }
        let v = JobView::read(dir)?;
        let (text, ended) = match cluster::coordinator_logs(&spec, &handle) {
            Ok(read) => read,
            // a finished job's coordinator is deleted with its platform's copy of the output (ACI's
            // group, Kubernetes' pod); the coordinator's own log is in the job's record
            Err(e) if v.status.state.is_final() || v.is_lost() => {
                let stored = dir.join("logs").join("coordinator.log");
                let text = std::fs::read_to_string(&stored).map_err(|_| {
                    e.context(format!(
                        "job {id} ended and its record has no logs/coordinator.log"
                    ))
                })?;
                if shown == 0 {
                    eprintln!(
                        "note: the platform no longer has job {id}'s coordinator; its log from the \
                         job's record follows"
                    );
                }
                (text, true)
            }
            Err(e) => return Err(e),
        };
        // the job's end is recorded a moment before its coordinator's last words and exit
        let over = (v.status.state.is_final() || v.is_lost())
            && (ended
                || over_since
                    .get_or_insert_with(Instant::now)
                    .elapsed()
                    .as_secs()
                    >= 30);
        if text.len() > shown {
            match out.write_all(&text.as_bytes()[shown..]) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                r => r?,
            }
            let _ = out.flush();
            shown = text.len();
        }
        if !follow || over {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn recorded_spec(dir: &Path) -> Result<JobSpec> {
    let spec_path = dir.join("job.json");
    let text = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("{}: cannot read", spec_path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: not a job record", spec_path.display()))
}

/// Stops a cluster-mode job's coordinator and deletes its platform objects (a client-mode job has
/// none): after its job ended, or when it is gone.
fn stop_recorded_coordinator(dir: &Path) -> Result<()> {
    if let Some(handle) = cluster::recorded_handle(dir)? {
        cluster::stop_coordinator(&recorded_spec(dir)?, &handle)?;
    }
    Ok(())
}

pub fn cancel(a: &CancelArgs) -> Result<()> {
    let (dir, fetched) = located(&a.job, &a.dir)?;
    let view = JobView::read(&dir)?;
    let id = job_id(&dir);
    if view.status.state.is_final() {
        // a detached cluster-mode job's coordinator may outlive its record's end
        stop_recorded_coordinator(&dir)?;
        println!("job {id} already {}", view.status.state.as_str());
        return Ok(());
    }
    match &fetched {
        // the coordinator's mirror copies it into the job's folder
        Some(f) => f.remote.put(&id, CANCEL_FILE, b"cancel\n".to_vec()),
        None => write_atomic(&dir.join(CANCEL_FILE), b"cancel\n"),
    }
    .with_context(|| format!("asking job {id} to stop"))?;
    if view.is_lost() {
        // nobody will act on the request: stop what the dead coordinator left, then say so in the record
        distributed::clean_up_after(
            &dir,
            &view.status,
            &Terminal::new(OutputFormat::Text, false),
        )?;
        stop_recorded_coordinator(&dir)?;
        let mut status = view.status;
        status.state = JobState::Cancelled;
        status.workers = 0;
        status.launches.clear();
        status.updated_unix_s = unix_now();
        write_json(&dir.join("status.json"), &status)?;
        if let Some(f) = &fetched {
            f.remote
                .put(&id, "status.json", std::fs::read(dir.join("status.json"))?)?;
        }
        println!("job {id} cancelled (its coordinator was gone; its workers were stopped here)");
        return Ok(());
    }
    let t0 = Instant::now();
    loop {
        if let Some(f) = &fetched {
            f.refresh()?;
        }
        let view = JobView::read(&dir)?;
        if view.status.state.is_final() {
            // the coordinator stopped every worker and recorded it: now the coordinator itself
            stop_recorded_coordinator(&dir)?;
            println!("job {id} {}", view.status.state.as_str());
            return Ok(());
        }
        if t0.elapsed().as_secs_f64() > a.wait {
            bail!(
                "job {id}: asked its coordinator to stop, and it has not within {} s; `physalia status \
                 {}` shows when it does",
                a.wait,
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
