//! `physalia report JOB`: one self-contained HTML page (inline SVG, no scripts, no external files) with the
//! job's curves and the tables behind them: loss and accuracy against training time, workers per epoch (a
//! step plot), each epoch's time split into compute, halo wait, all-reduce, sampling and evaluation, bytes
//! exchanged per epoch, cumulative cost (dollars at the SKU's price, worker-seconds where it is zero), the
//! planner's predicted epoch time and bill beside the measured ones, and the scaling events (rescales,
//! retried epochs after a lost worker). Axes have round ticks (1, 2, 5 times a power of ten; counts whole).
//! Works on running and failed jobs too: it reads what the job directory holds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use physalia_control::{Coordinated, JobStatus, JobSummary, Summary};
use serde_json::Value;

#[derive(Args)]
pub struct ReportArgs {
    /// The job directory (as `submit` printed it), a job's (directory) name under `--dir` (as `status`
    /// and `logs` take it), or a job's URL in an object store.
    job: PathBuf,
    /// Where a job named by its name is looked for.
    #[arg(long, default_value = "jobs")]
    dir: PathBuf,
    /// Where to write the page; default `JOB/report.html`.
    #[arg(long, short)]
    out: Option<PathBuf>,
}

/// One epoch as the report plots it.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    epoch: u64,
    /// Training and evaluation seconds up to and including this epoch.
    elapsed_s: f64,
    loss: f64,
    val: Option<f64>,
    test: Option<f64>,
    workers: usize,
    bytes: u64,
    usd: f64,
    /// Workers' training and evaluation seconds up to and including this epoch.
    worker_s: f64,
    /// The slowest rank's epoch, split: compute, halo rows (or remote feature rows) waited for, all-reduce,
    /// sampling waited for, evaluation.
    compute_s: f64,
    halo_s: f64,
    all_reduce_s: f64,
    sample_s: f64,
    eval_s: f64,
}

pub fn run(a: &ReportArgs) -> Result<()> {
    // a job in an object store (its URL): read a copy, write the page here
    let fetched = match crate::store::is_url(&a.job) {
        true => Some(crate::store::Fetched::locate(
            &a.job.to_string_lossy(),
            Path::new(""),
        )?),
        false => None,
    };
    let job = match &fetched {
        Some(f) => f.dir.clone(),
        // a folder is read as the job it holds (a broken record is named as such); else a job's name
        None if a.job.is_dir() => a.job.clone(),
        None => crate::find::resolve(&a.job.to_string_lossy(), &a.dir)?,
    };
    let out = a.out.clone().unwrap_or_else(|| match &fetched {
        Some(f) => PathBuf::from(format!("{}.report.html", f.id)),
        None => job.join("report.html"),
    });
    write(&job, &out)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// Renders the report of the job in `job` to `out` (whole or not at all).
pub(crate) fn write(job: &Path, out: &Path) -> Result<()> {
    let html = render(job)?;
    let tmp = out.with_extension("html.tmp");
    std::fs::write(&tmp, html).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// A record file read through its type, `None` when it is not there (yet).
fn read_record<T>(path: &Path, read: fn(&Path) -> Result<T, String>) -> Result<Option<T>> {
    match path.is_file() {
        true => Ok(Some(read(path).map_err(anyhow::Error::msg)?)),
        false => Ok(None),
    }
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn rows(job: &Path) -> Result<Vec<Row>> {
    let path = job.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: cannot read the job's metrics", path.display()))?;
    let lines = physalia_control::MetricsLine::parse_all(&text, &path.display().to_string())
        .map_err(anyhow::Error::msg)?;
    let mut rows = Vec::new();
    let (mut elapsed, mut usd, mut worker_s) = (0.0, 0.0, 0.0);
    // repeated runs: the report shows the first
    for line in lines.iter().filter(|l| l.run == 0) {
        let m = &line.metrics;
        elapsed += m.train_s + m.eval_s;
        usd += line.usd;
        let ranks = line.by_rank();
        worker_s += ranks.iter().map(|r| r.train_s + r.eval_s).sum::<f64>();
        let bytes = match line.workers.is_empty() {
            true => m.exchange.bytes_sent,
            false => line.workers.iter().map(|w| w.exchange.bytes_sent).sum(),
        };
        // the slowest rank ends the epoch (ranks other than 0 report their time and exchange only)
        let slow = ranks
            .iter()
            .max_by(|a, b| a.train_s.total_cmp(&b.train_s))
            .unwrap_or(m);
        let (sample, fetch) = m
            .batches
            .as_ref()
            .map_or((0.0, 0.0), |b| (b.sample_wait_s, b.fetch_s));
        let halo = slow.exchange.halo_s + fetch;
        let all_reduce = slow.exchange.all_reduce_s;
        rows.push(Row {
            epoch: m.epoch as u64,
            elapsed_s: elapsed,
            loss: m.loss,
            val: m.val_acc,
            test: m.test_acc,
            workers: line.worker_count(),
            bytes,
            usd,
            worker_s,
            compute_s: (slow.train_s - halo - all_reduce - sample).max(0.0),
            halo_s: halo,
            all_reduce_s: all_reduce,
            sample_s: sample,
            eval_s: m.eval_s,
        });
    }
    Ok(rows)
}

/// The planner's prediction beside the measured epochs: per worker count, its epoch time unfitted (what
/// it predicted) and fitted to this job; and the job's bill, predicted and measured.
fn prediction(job: &Path, rows: &[Row], summary: &Coordinated, usd_total: f64) -> Result<String> {
    let record = crate::replay::Record::read(job)?;
    let model = crate::replay::Model::new(&record)?;
    let sku = model.sku.clone();
    let price = sku.usd_per_s();
    let mut h = String::from(
        "<h2>Planner's prediction and what was measured</h2><table><tr><th>workers</th><th>epochs</th>\
         <th>measured train + eval s (median, slowest worker)</th><th>planner's epoch s</th>\
         <th>fitted epoch s (wall, with coordination)</th></tr>",
    );
    let mut counts: Vec<usize> = rows.iter().map(|r| r.workers).collect();
    counts.sort();
    counts.dedup();
    let mut predicted_worker_s = 0.0;
    for w in counts {
        let of: Vec<f64> = rows
            .iter()
            .filter(|r| r.workers == w)
            .map(|r| r.compute_s + r.halo_s + r.all_reduce_s + r.sample_s + r.eval_s)
            .collect();
        let mut sorted = of.clone();
        sorted.sort_by(f64::total_cmp);
        let planner = model.predict(&sku, w)?;
        let fitted = model.price(&sku, w)?;
        // the planner's bill for these epochs, and a start-up per launch counted once per count
        predicted_worker_s +=
            w as f64 * (of.len() as f64 * planner.time.epoch_s + planner.time.setup_s);
        let _ = write!(
            h,
            "<tr><td>{w}</td><td>{}</td><td>{:.4}</td><td>{:.4}</td><td>{:.4}</td></tr>",
            of.len(),
            sorted[sorted.len() / 2],
            planner.time.epoch_s,
            fitted.epoch_s
        );
    }
    h.push_str("</table>");
    let ledger = summary.worker_seconds;
    let _ = write!(
        h,
        "<table><tr><th></th><th>worker-seconds</th><th>USD at {} (${:.4}/worker-hour)</th></tr>\
         <tr><td style=\"text-align:left\">planner's prediction</td><td>{:.1}</td><td>{:.4}</td></tr>\
         <tr><td style=\"text-align:left\">the ledger (every launch, start to stop)</td><td>{:.1}</td><td>{:.4}</td></tr></table>",
        esc(&sku.name),
        price * 3600.0,
        predicted_worker_s,
        predicted_worker_s * price,
        ledger,
        usd_total
    );
    h.push_str(
        "<p>`physalia plan --replay` prices this job on other worker counts and SKUs with the model \
         fitted to it.</p>",
    );
    Ok(h)
}

fn render(job: &Path) -> Result<String> {
    if !job.is_dir() {
        bail!("{}: not a job directory", job.display());
    }
    let rows = rows(job)?;
    let spec = read_json(&job.join("job.json")).unwrap_or(Value::Null);
    // a running or failed job has no summary yet; one that is there must read
    let status = read_record(&job.join("status.json"), JobStatus::read)?;
    let summary = read_record(&job.join("summary.json"), JobSummary::read)?;
    let name = job
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{n}</title><style>\
         body{{font:14px system-ui,sans-serif;margin:2em;max-width:980px}}\
         table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}\
         h2{{margin-top:1.5em}}svg{{background:#fafafa;border:1px solid #ddd}}</style></head><body>\
         <h1>Job {n}</h1>",
        n = esc(&name)
    );
    let _ = write!(
        h,
        "<p>state: <b>{}</b>{}; model {} ({} layers), {} epochs planned, {} recorded</p>",
        esc(status.as_ref().map_or("unknown", |s| s.state.as_str())),
        status
            .as_ref()
            .and_then(|s| s.error.as_deref())
            .map(|e| format!(" — {}", esc(e)))
            .unwrap_or_default(),
        esc(spec["model"]["kind"].as_str().unwrap_or("?")),
        spec["model"]["layers"],
        spec["train"]["epochs"],
        rows.len()
    );
    let best = summary.as_ref().and_then(|s| s.run.runs.first());
    if let Some(acc) = best.and_then(|r| r.test_acc_at_best_val) {
        let _ = write!(
            h,
            "<p>test accuracy at best validation: <b>{acc:.4}</b></p>"
        );
    }
    plots(&mut h, &rows);
    cost(&mut h, &rows, summary.as_ref().map(|s| &s.run));
    let coordinated = summary.as_ref().and_then(|s| s.coordinated.as_ref());
    // needs the finished job's record and its dataset: left out (with why) when either is missing
    if let (Some(s), Some(c)) = (&summary, coordinated) {
        match prediction(job, &rows, c, s.run.usd_total) {
            Ok(p) => h.push_str(&p),
            Err(e) => {
                let _ = write!(h, "<p>(no prediction: {})</p>", esc(&format!("{e:#}")));
            }
        }
    }
    partitions(&mut h, coordinated);
    scaling_events(&mut h, coordinated);
    epoch_table(&mut h, &rows);
    h.push_str("</body></html>\n");
    Ok(h)
}

/// Loss, accuracy, workers, each epoch's time and bytes against time or epoch.
fn plots(h: &mut String, rows: &[Row]) {
    let t: Vec<f64> = rows.iter().map(|r| r.elapsed_s).collect();
    let ep: Vec<f64> = rows.iter().map(|r| r.epoch as f64).collect();
    h.push_str("<h2>Loss against training time</h2>");
    h.push_str(&svg_plot(
        &[(
            "loss",
            series(&t, rows.iter().map(|r| Some(r.loss))),
            Style::Line,
        )],
        "seconds",
        "loss",
        false,
        false,
    ));
    h.push_str("<h2>Accuracy against training time</h2>");
    h.push_str(&svg_plot(
        &[
            (
                "validation",
                series(&t, rows.iter().map(|r| r.val)),
                Style::Line,
            ),
            (
                "test",
                series(&t, rows.iter().map(|r| r.test)),
                Style::Dashed,
            ),
        ],
        "seconds",
        "accuracy",
        false,
        false,
    ));
    h.push_str("<h2>Workers per epoch</h2>");
    h.push_str(&svg_plot(
        &[(
            "workers",
            series(&ep, rows.iter().map(|r| Some(r.workers as f64))),
            Style::Step,
        )],
        "epoch",
        "workers",
        true,
        true,
    ));
    h.push_str("<h2>Where each epoch's time goes</h2>");
    h.push_str(&svg_stacked(
        &ep,
        &[
            ("compute", rows.iter().map(|r| r.compute_s).collect()),
            ("halo wait", rows.iter().map(|r| r.halo_s).collect()),
            ("all-reduce", rows.iter().map(|r| r.all_reduce_s).collect()),
            ("sampling", rows.iter().map(|r| r.sample_s).collect()),
            ("evaluation", rows.iter().map(|r| r.eval_s).collect()),
        ],
        "epoch",
        "seconds (slowest worker)",
    ));
    h.push_str("<h2>Bytes exchanged per epoch</h2>");
    h.push_str(&svg_plot(
        &[(
            "MiB",
            series(&ep, rows.iter().map(|r| Some(r.bytes as f64 / 1048576.0))),
            Style::Line,
        )],
        "epoch",
        "MiB",
        true,
        false,
    ));
}

/// The bill over time: the SKU's dollars, or worker-seconds where it costs nothing.
fn cost(h: &mut String, rows: &[Row], summary: Option<&Summary>) {
    let t: Vec<f64> = rows.iter().map(|r| r.elapsed_s).collect();
    // a priced SKU's dollars; the local SKU costs nothing, so its worker-seconds
    let usd_per_hour = summary.map_or(0.0, |s| s.usd_per_worker_hour);
    let priced = usd_per_hour > 0.0;
    let _ = write!(
        h,
        "<h2>Cost over time</h2><p>{}</p>",
        if priced {
            format!(
                "at {} (${:.4} per worker-hour): each epoch's workers' training and evaluation seconds",
                esc(summary.map_or("?", |s| s.sku.as_str())),
                usd_per_hour
            )
        } else {
            format!(
                "{} costs nothing per worker-second: the workers' training and evaluation seconds",
                esc(summary.map_or("this machine", |s| s.sku.as_str()))
            )
        }
    );
    h.push_str(&if priced {
        svg_plot(
            &[(
                "USD",
                series(&t, rows.iter().map(|r| Some(r.usd))),
                Style::Line,
            )],
            "seconds",
            "USD (cumulative)",
            false,
            false,
        )
    } else {
        svg_plot(
            &[(
                "worker-seconds",
                series(&t, rows.iter().map(|r| Some(r.worker_s))),
                Style::Line,
            )],
            "seconds",
            "worker-seconds (cumulative)",
            false,
            false,
        )
    });
}

/// The policy's decisions, as `summary.json` lists them.
/// The partition set of each part count the job trained on: method, quality and time.
fn partitions(h: &mut String, summary: Option<&Coordinated>) {
    let Some(sets) = summary.map(|s| &s.partitions).filter(|p| !p.is_empty()) else {
        return;
    };
    h.push_str(
        "<h2>Partitions</h2><table><tr><th>parts</th><th>method</th><th>edge cut</th><th>cut fraction</th>\
         <th>balance</th><th>assignment s</th><th>whole set s</th><th>dataset read</th><th>why</th></tr>",
    );
    for p in sets {
        let secs = |s: Option<f64>| s.map_or_else(|| "-".into(), |s| format!("{s:.2}"));
        let why = if p.reused {
            "stored beside the dataset, reused".to_string()
        } else {
            p.why.clone().unwrap_or_default()
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.4}</td><td>{:.3}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td style=\"text-align:left\">{}</td></tr>",
            p.parts,
            esc(&p.method),
            p.edge_cut,
            p.cut_fraction,
            p.balance,
            secs(p.partition_seconds),
            if p.reused {
                "-".into()
            } else {
                format!("{:.2}", p.compute_seconds)
            },
            p.bytes_read.map_or_else(
                || "-".into(),
                |b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
            ),
            esc(&why),
        );
    }
    h.push_str("</table>");
}

fn scaling_events(h: &mut String, summary: Option<&Coordinated>) {
    if let Some(events) = summary.map(|s| &s.scaling_events) {
        h.push_str("<h2>Scaling events</h2><table><tr><th>after epoch</th><th>event</th><th>rule</th></tr>");
        for e in events {
            let _ = write!(
                h,
                "<tr><td>{}</td><td style=\"text-align:left\">{}</td><td>{}</td></tr>",
                e.epoch,
                esc(&e.event),
                esc(e.rule.as_deref().unwrap_or("")),
            );
        }
        h.push_str("</table>");
    }
}

/// Every recorded epoch, one row each.
fn epoch_table(h: &mut String, rows: &[Row]) {
    h.push_str(
        "<h2>Epochs</h2><table><tr><th>epoch</th><th>time s</th><th>loss</th><th>val</th><th>test</th>\
         <th>workers</th><th>compute s</th><th>halo s</th><th>all-reduce s</th><th>sampling s</th>\
         <th>eval s</th><th>MiB sent</th><th>USD</th></tr>",
    );
    let acc = |a: Option<f64>| a.map(|a| format!("{a:.4}")).unwrap_or_else(|| "-".into());
    for r in rows {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.3}</td><td>{:.4}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.4}</td>\
             <td>{:.4}</td><td>{:.4}</td><td>{:.4}</td><td>{:.4}</td><td>{:.2}</td><td>{:.4}</td></tr>",
            r.epoch,
            r.elapsed_s,
            r.loss,
            acc(r.val),
            acc(r.test),
            r.workers,
            r.compute_s,
            r.halo_s,
            r.all_reduce_s,
            r.sample_s,
            r.eval_s,
            r.bytes as f64 / 1048576.0,
            r.usd
        );
    }
    h.push_str("</table>");
}

fn series(x: &[f64], y: impl Iterator<Item = Option<f64>>) -> Vec<(f64, f64)> {
    x.iter()
        .zip(y)
        .filter_map(|(&x, y)| y.filter(|v| v.is_finite()).map(|y| (x, y)))
        .collect()
}

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// A named series of points and how it is drawn.
type Series<'a> = (&'a str, Vec<(f64, f64)>, Style);

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq)]
enum Style {
    Line,
    /// Holds each value until the next x (worker counts).
    Step,
    Dashed,
}

/// An axis: its range and round ticks (1, 2 or 5 times a power of ten).
#[derive(Debug, Clone, PartialEq)]
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    /// Decimals the tick labels need.
    decimals: usize,
}

/// Round ticks covering `lo..=hi`, about five of them; `integer`: steps of at least 1 (counts such as
/// workers or epochs never get fractional ticks).
fn axis(lo: f64, hi: f64, integer: bool) -> Axis {
    let (mut lo, mut hi) = (lo, hi);
    if !(lo.is_finite() && hi.is_finite()) {
        (lo, hi) = (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        let pad = if integer {
            1.0
        } else {
            (lo.abs() * 0.1).max(1e-3)
        };
        lo -= pad;
        hi += pad;
        if lo < 0.0 && (integer || hi > 0.0) && lo + pad >= 0.0 {
            lo = 0.0;
        }
    }
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * 0.999)
        .unwrap_or(10.0 * mag);
    if integer {
        step = step.max(1.0).round();
    }
    let first = (lo / step).floor();
    let last = (hi / step).ceil();
    let ticks: Vec<f64> = (0..=((last - first) as i64).max(1))
        .map(|i| (first + i as f64) * step)
        .collect();
    let decimals = if integer {
        0
    } else {
        (-step.log10().floor()).max(0.0) as usize
    };
    Axis {
        lo: ticks[0],
        hi: *ticks.last().expect("at least two ticks"),
        ticks,
        decimals,
    }
}

impl Axis {
    fn label(&self, v: f64) -> String {
        let a = v.abs();
        if a != 0.0 && !(1e-4..1e6).contains(&a) {
            return format!("{v:.1e}");
        }
        let s = format!("{:.*}", self.decimals, v);
        // no "-0"
        if s.trim_start_matches('-')
            .chars()
            .all(|c| c == '0' || c == '.')
        {
            s.trim_start_matches('-').to_string()
        } else {
            s
        }
    }
}

const W: f64 = 720.0;
const H: f64 = 260.0;
const L: f64 = 70.0;
const R: f64 = 150.0;
const T: f64 = 20.0;
const B: f64 = 40.0;

/// The frame of a chart: axes with their ticks and labels; returns the SVG so far and the mappings.
fn frame(
    x: &Axis,
    y: &Axis,
    x_label: &str,
    y_label: &str,
) -> (String, impl Fn(f64) -> f64, impl Fn(f64) -> f64) {
    let (x0, x1, y0, y1) = (x.lo, x.hi, y.lo, y.hi);
    let px = move |v: f64| L + (v - x0) / (x1 - x0) * (W - L - R);
    let py = move |v: f64| H - B - (v - y0) / (y1 - y0) * (H - T - B);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\">"
    );
    for &t in &x.ticks {
        let _ = write!(
            s,
            "<line x1=\"{0:.1}\" y1=\"{1}\" x2=\"{0:.1}\" y2=\"{2}\" stroke=\"#e4e4e4\"/>\
             <text x=\"{0:.1}\" y=\"{3}\" font-size=\"11\" text-anchor=\"middle\">{4}</text>",
            px(t),
            T,
            H - B,
            H - B + 15.0,
            x.label(t)
        );
    }
    for &t in &y.ticks {
        let _ = write!(
            s,
            "<line x1=\"{0}\" y1=\"{1:.1}\" x2=\"{2}\" y2=\"{1:.1}\" stroke=\"#e4e4e4\"/>\
             <text x=\"{3}\" y=\"{4:.1}\" font-size=\"11\" text-anchor=\"end\">{5}</text>",
            L,
            py(t),
            W - R,
            L - 5.0,
            py(t) + 4.0,
            y.label(t)
        );
    }
    let _ = write!(
        s,
        "<line x1=\"{L}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#333\"/>\
         <line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{0}\" stroke=\"#333\"/>\
         <text x=\"{2:.1}\" y=\"{3:.1}\" font-size=\"12\" text-anchor=\"middle\">{4}</text>\
         <text x=\"14\" y=\"{5:.1}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 {5:.1})\">{6}</text>",
        H - B,
        W - R,
        (L + W - R) / 2.0,
        H - 6.0,
        esc(x_label),
        H / 2.0,
        esc(y_label)
    );
    (s, px, py)
}

fn legend(s: &mut String, i: usize, name: &str, color: &str) {
    let y = T + 14.0 * (i as f64 + 1.0);
    let _ = write!(
        s,
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{color}\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{}</text>",
        W - R + 10.0,
        y - 9.0,
        W - R + 24.0,
        y,
        esc(name)
    );
}

/// A chart of lines (or steps) as inline SVG, with round ticks and a legend. `integer_y`: the y axis counts
/// things (workers).
fn svg_plot(
    lines: &[Series],
    x_label: &str,
    y_label: &str,
    integer_x: bool,
    integer_y: bool,
) -> String {
    let pts: Vec<(f64, f64)> = lines.iter().flat_map(|l| l.1.iter().copied()).collect();
    if pts.is_empty() {
        return "<p>(no data)</p>".into();
    }
    let min = |v: &mut dyn Iterator<Item = f64>| v.fold(f64::INFINITY, f64::min);
    let max = |v: &mut dyn Iterator<Item = f64>| v.fold(f64::NEG_INFINITY, f64::max);
    let x = axis(
        min(&mut pts.iter().map(|p| p.0)),
        max(&mut pts.iter().map(|p| p.0)),
        integer_x,
    );
    // counts and times start at zero
    let ylo = min(&mut pts.iter().map(|p| p.1));
    let y = axis(
        if integer_y { ylo.min(0.0) } else { ylo },
        max(&mut pts.iter().map(|p| p.1)),
        integer_y,
    );
    let (mut s, px, py) = frame(&x, &y, x_label, y_label);
    for (i, (name, p, style)) in lines.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut path: Vec<String> = Vec::new();
        for (j, &(xv, yv)) in p.iter().enumerate() {
            if *style == Style::Step && j > 0 {
                path.push(format!("{:.1},{:.1}", px(xv), py(p[j - 1].1)));
            }
            path.push(format!("{:.1},{:.1}", px(xv), py(yv)));
        }
        let dash = if *style == Style::Dashed {
            " stroke-dasharray=\"5,4\""
        } else {
            ""
        };
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>",
            path.join(" ")
        );
        legend(&mut s, i, name, c);
    }
    s.push_str("</svg>");
    s
}

/// Stacked bars, one per x, each split into `parts` (name, value per bar).
fn svg_stacked(x: &[f64], parts: &[(&str, Vec<f64>)], x_label: &str, y_label: &str) -> String {
    if x.is_empty() {
        return "<p>(no data)</p>".into();
    }
    let totals: Vec<f64> = (0..x.len())
        .map(|i| parts.iter().map(|p| p.1[i].max(0.0)).sum())
        .collect();
    // bars centred on whole x values; the outer ones may reach half a bar past the axis
    let xa = axis(
        x.iter().copied().fold(f64::INFINITY, f64::min).min(0.0),
        x.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        true,
    );
    let ya = axis(0.0, totals.iter().copied().fold(0.0, f64::max), false);
    let (mut s, px, py) = frame(&xa, &ya, x_label, y_label);
    let bar = ((W - L - R) / (xa.hi - xa.lo) * 0.8).max(1.0);
    for (i, &xv) in x.iter().enumerate() {
        let mut base = 0.0;
        for (k, (_, v)) in parts.iter().enumerate() {
            let h = v[i].max(0.0);
            if h <= 0.0 {
                continue;
            }
            let (top, bottom) = (py(base + h), py(base));
            let _ = write!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.2}\" fill=\"{}\"/>",
                px(xv) - bar / 2.0,
                top,
                bar,
                (bottom - top).max(0.0),
                COLORS[k % COLORS.len()]
            );
            base += h;
        }
    }
    for (k, (name, _)) in parts.iter().enumerate() {
        legend(&mut s, k, name, COLORS[k % COLORS.len()]);
    }
    s.push_str("</svg>");
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_data() {
        for (lo, hi, integer) in [
            (0.045, 1.75, false),
            (1.0, 4.0, true),
            (0.0, 0.0, false),
            (3.0, 3.0, true),
            (0.001234, 0.0987, false),
            (12.0, 1234.5, false),
            (1.0, 30.0, true),
        ] {
            let a = axis(lo, hi, integer);
            assert!(a.lo <= lo && a.hi >= hi, "{lo}..{hi}: {a:?}");
            assert!(a.ticks.len() >= 2 && a.ticks.len() <= 12, "{a:?}");
            let step = a.ticks[1] - a.ticks[0];
            let mant = step / 10f64.powf(step.log10().floor());
            assert!(
                [1.0, 2.0, 5.0].iter().any(|m| (mant - m).abs() < 1e-6),
                "{lo}..{hi}: step {step}"
            );
            if integer {
                assert!(
                    step >= 1.0 && a.ticks.iter().all(|t| t.fract() == 0.0),
                    "{a:?}"
                );
                assert!(a.ticks.iter().all(|t| !a.label(*t).contains('.')), "{a:?}");
            }
        }
        // the old report's workers axis read 0.045, 0.35, 0.655; now whole workers
        let a = axis(0.0, 4.0, true);
        let labels: Vec<String> = a.ticks.iter().map(|t| a.label(*t)).collect();
        assert_eq!(labels, ["0", "1", "2", "3", "4"]);
        let a = axis(0.045, 1.75, false);
        let labels: Vec<String> = a.ticks.iter().map(|t| a.label(*t)).collect();
        assert_eq!(labels, ["0.0", "0.5", "1.0", "1.5", "2.0"]);
    }

    #[test]
    fn a_step_plot_holds_each_value_until_the_next_epoch() {
        let svg = svg_plot(
            &[("workers", vec![(1.0, 1.0), (2.0, 2.0)], Style::Step)],
            "epoch",
            "workers",
            true,
            true,
        );
        // three points: (1,1), (2,1), (2,2)
        let pts = svg.split("points=\"").nth(1).unwrap();
        let pts: Vec<&str> = pts[..pts.find('"').unwrap()].split(' ').collect();
        assert_eq!(pts.len(), 3);
        assert_eq!(pts[1].split(',').nth(1), pts[0].split(',').nth(1));
        assert_eq!(pts[1].split(',').next(), pts[2].split(',').next());
    }
}
