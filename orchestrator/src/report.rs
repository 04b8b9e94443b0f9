//! `physalia report JOB`: one self-contained HTML page (inline SVG, no scripts, no external files) with the
//! job's curves and the tables behind them: loss and accuracy against training time, workers per epoch,
//! bytes exchanged per epoch, cumulative cost, and the scaling events (rescales, retried epochs after a lost
//! worker). Works on running and failed jobs too: it reads what the job directory holds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::Value;

#[derive(Args)]
pub struct ReportArgs {
    /// The job directory (as `submit` printed it).
    job: PathBuf,
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
}

pub fn run(a: &ReportArgs) -> Result<()> {
    let out = a.out.clone().unwrap_or_else(|| a.job.join("report.html"));
    write(&a.job, &out)?;
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
    let mut elapsed = 0.0;
    let mut usd = 0.0;
    // repeated runs: the report shows the first
    for line in lines.iter().filter(|l| l.run == 0) {
        let m = &line.metrics;
        elapsed += m.train_s + m.eval_s;
        usd += line.usd;
        let bytes = match line.workers.is_empty() {
            true => m.exchange.bytes_sent,
            false => line.workers.iter().map(|w| w.exchange.bytes_sent).sum(),
        };
        rows.push(Row {
            epoch: m.epoch as u64,
            elapsed_s: elapsed,
            loss: m.loss,
            val: m.val_acc,
            test: m.test_acc,
            workers: line.worker_count(),
            bytes,
            usd,
        });
    }
    Ok(rows)
}

fn render(job: &Path) -> Result<String> {
    if !job.is_dir() {
        bail!("{}: not a job directory", job.display());
    }
    let rows = rows(job)?;
    let spec = read_json(&job.join("job.json")).unwrap_or(Value::Null);
    let status = read_json(&job.join("status.json")).unwrap_or(Value::Null);
    let summary = read_json(&job.join("summary.json")).unwrap_or(Value::Null);
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
        esc(status["state"].as_str().unwrap_or("unknown")),
        status["error"]
            .as_str()
            .map(|e| format!(" — {}", esc(e)))
            .unwrap_or_default(),
        esc(spec["model"]["kind"].as_str().unwrap_or("?")),
        spec["model"]["layers"],
        spec["train"]["epochs"],
        rows.len()
    );
    if let Some(acc) = summary["runs"][0]["test_acc_at_best_val"].as_f64() {
        let _ = write!(
            h,
            "<p>test accuracy at best validation: <b>{acc:.4}</b></p>"
        );
    }
    let t: Vec<f64> = rows.iter().map(|r| r.elapsed_s).collect();
    let ep: Vec<f64> = rows.iter().map(|r| r.epoch as f64).collect();
    h.push_str("<h2>Loss against training time</h2>");
    h.push_str(&svg_plot(
        &[("loss", series(&t, rows.iter().map(|r| Some(r.loss))))],
        "seconds",
        "loss",
    ));
    h.push_str("<h2>Accuracy against training time</h2>");
    h.push_str(&svg_plot(
        &[
            ("validation", series(&t, rows.iter().map(|r| r.val))),
            ("test", series(&t, rows.iter().map(|r| r.test))),
        ],
        "seconds",
        "accuracy",
    ));
    h.push_str("<h2>Workers per epoch</h2>");
    h.push_str(&svg_plot(
        &[(
            "workers",
            series(&ep, rows.iter().map(|r| Some(r.workers as f64))),
        )],
        "epoch",
        "workers",
    ));
    h.push_str("<h2>Bytes exchanged per epoch</h2>");
    h.push_str(&svg_plot(
        &[(
            "MiB",
            series(&ep, rows.iter().map(|r| Some(r.bytes as f64 / 1048576.0))),
        )],
        "epoch",
        "MiB",
    ));
    h.push_str("<h2>Cost over time</h2>");
    h.push_str(&svg_plot(
        &[("USD", series(&t, rows.iter().map(|r| Some(r.usd))))],
        "seconds",
        "USD (cumulative)",
    ));
    if let Some(events) = summary["scaling_events"].as_array() {
        h.push_str("<h2>Scaling events</h2><table><tr><th>after epoch</th><th>event</th><th>rule</th></tr>");
        for e in events {
            let _ = write!(
                h,
                "<tr><td>{}</td><td style=\"text-align:left\">{}</td><td>{}</td></tr>",
                e["epoch"],
                esc(e["event"].as_str().unwrap_or("")),
                esc(e["rule"].as_str().unwrap_or("")),
            );
        }
        h.push_str("</table>");
    }
    h.push_str(
        "<h2>Epochs</h2><table><tr><th>epoch</th><th>time s</th><th>loss</th><th>val</th><th>test</th>\
         <th>workers</th><th>MiB sent</th><th>USD</th></tr>",
    );
    let acc = |a: Option<f64>| a.map(|a| format!("{a:.4}")).unwrap_or_else(|| "-".into());
    for r in &rows {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.3}</td><td>{:.4}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td><td>{:.4}</td></tr>",
            r.epoch,
            r.elapsed_s,
            r.loss,
            acc(r.val),
            acc(r.test),
            r.workers,
            r.bytes as f64 / 1048576.0,
            r.usd
        );
    }
    h.push_str("</table></body></html>\n");
    Ok(h)
}

fn series(x: &[f64], y: impl Iterator<Item = Option<f64>>) -> Vec<(f64, f64)> {
    x.iter()
        .zip(y)
        .filter_map(|(&x, y)| y.filter(|v| v.is_finite()).map(|y| (x, y)))
        .collect()
}

const COLORS: [&str; 3] = ["#1f77b4", "#d62728", "#2ca02c"];

/// A line chart as inline SVG, with axes, four ticks per axis and a legend.
fn svg_plot(lines: &[(&str, Vec<(f64, f64)>)], x_label: &str, y_label: &str) -> String {
    let (w, hgt, l, r, t, b) = (720.0, 260.0, 70.0, 20.0, 20.0, 40.0);
    let pts: Vec<(f64, f64)> = lines.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    if pts.is_empty() {
        return "<p>(no data)</p>".into();
    }
    let span = |v: &mut dyn Iterator<Item = f64>| {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for x in v {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        if hi - lo < 1e-12 {
            (lo - 0.5, hi + 0.5)
        } else {
            (lo, hi)
        }
    };
    let (x0, x1) = span(&mut pts.iter().map(|p| p.0));
    let (y0, y1) = span(&mut pts.iter().map(|p| p.1));
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| hgt - b - (y - y0) / (y1 - y0) * (hgt - t - b);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{hgt}\" viewBox=\"0 0 {w} {hgt}\">"
    );
    let _ = write!(
        s,
        "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#333\"/><line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{0}\" stroke=\"#333\"/>",
        hgt - b,
        w - r
    );
    for i in 0..=4 {
        let fx = x0 + (x1 - x0) * i as f64 / 4.0;
        let fy = y0 + (y1 - y0) * i as f64 / 4.0;
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
            px(fx),
            hgt - b + 15.0,
            tick(fx),
            l - 5.0,
            py(fy) + 4.0,
            tick(fy)
        );
    }
    let _ = write!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">{}</text>\
         <text x=\"14\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 {:.1})\">{}</text>",
        (l + w - r) / 2.0,
        hgt - 6.0,
        esc(x_label),
        hgt / 2.0,
        hgt / 2.0,
        esc(y_label)
    );
    for (i, (name, p)) in lines.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = p
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{c}\">{}</text>",
            path.join(" "),
            w - r - 120.0,
            t + 14.0 * (i as f64 + 1.0),
            esc(name)
        );
    }
    s.push_str("</svg>");
    s
}

fn tick(v: f64) -> String {
    if v.abs() >= 1000.0 || (v != 0.0 && v.abs() < 0.01) {
        format!("{v:.2e}")
    } else {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
