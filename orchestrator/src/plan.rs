//! `physalia plan`: the planner's answer for a job file, from the dataset's statistics and the partition sets
//! stored beside it, the built-in catalog (plus the user's) and, when given, a calibration profile.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use physalia_coordinator::driver::dataset;
use physalia_coordinator::driver::plan::{
    AsWritten, as_written, request, request_from, stats_graph,
};
use physalia_planner::{CalibrationProfile, Catalog};

use crate::output::{OutputFormat, Terminal};
use crate::spec;

#[derive(Args)]
pub struct PlanArgs {
    /// The job file (YAML).
    #[arg(required_unless_present = "replay")]
    job: Option<PathBuf>,
    /// Price a finished job otherwise: the planner's model fitted to its record (JOB_DIR as `submit`
    /// printed it), then its own launches, other worker counts and SKUs, its scaling policy replayed, and a
    /// fixed cluster sized for its peak.
    #[arg(long, value_name = "JOB_DIR", conflicts_with_all = ["job", "as_written", "overrides", "backend", "catalog", "calibration"])]
    replay: Option<PathBuf>,
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
    /// Plan for this platform only (and, with `--as-written`, predict on its section's SKU) instead of the
    /// job file's `goal.backends`.
    #[arg(long, value_name = "NAME", value_parser = crate::backend_arg())]
    backend: Option<spec::BackendKind>,
    /// A catalog of your own (YAML, the format of `infra/catalog/`), merged with the built-in one.
    #[arg(long)]
    catalog: Option<PathBuf>,
    /// A calibration profile of this machine (YAML or JSON), used for the `local` SKU.
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// Rows of alternatives and rejections to print.
    #[arg(long, default_value_t = 8)]
    rows: usize,
    /// Predict the job file's own settings (`parallelism`, `workers`, `minibatch`, `exchange`) on its
    /// backend's SKU instead of searching for a plan.
    #[arg(long)]
    as_written: bool,
    /// With `--as-written`: the SKU to predict on, when the job's backend has more than one in the catalog.
    /// With `--replay`: a SKU to price the job on besides its own (repeatable; default: every CPU SKU of
    /// the cloud platforms when the job's costs nothing).
    #[arg(long)]
    sku: Vec<String>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

pub fn run(a: &PlanArgs) -> Result<()> {
    if let Some(dir) = &a.replay {
        let r = crate::replay::replay(dir, &a.sku)?;
        match a.output {
            OutputFormat::Json => println!("{}", serde_json::to_string(&r)?),
            OutputFormat::Text => print!("{}", r.render()),
        }
        return Ok(());
    }
    let Some(job) = &a.job else {
        anyhow::bail!("name a job file, or --replay JOB_DIR");
    };
    if a.sku.len() > 1 || (!a.sku.is_empty() && !a.as_written) {
        anyhow::bail!("--sku: one SKU, with --as-written (or several with --replay)");
    }
    let spec = spec::load_on(job, &a.overrides, a.backend)?;
    // a graph given by its statistics alone is planned without loading anything
    let mut req = match &spec.dataset.stats {
        Some(st) => request_from(&spec, stats_graph(st), Vec::new())?,
        None => request(
            &spec,
            &dataset::load(&spec.dataset, &Terminal::new(a.output, false))?,
        )?,
    };
    if let Some(b) = a.backend {
        req.constraints.backends = vec![b];
    }
    let mut catalog = Catalog::builtin();
    if let Some(path) = &a.catalog {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the catalog", path.display()))?;
        catalog = catalog.merge(Catalog::from_yaml_str(&text, &path.display().to_string())?)?;
    }
    let calibration = match &a.calibration {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!("{}: cannot read the calibration profile", path.display())
            })?;
            Some(CalibrationProfile::from_yaml_str(
                &text,
                &path.display().to_string(),
            )?)
        }
        None => None,
    };
    if a.as_written {
        let w = as_written(
            &spec,
            &req,
            &catalog,
            a.sku.first().map(String::as_str),
            calibration.as_ref(),
        )?;
        match a.output {
            OutputFormat::Json => println!("{}", serde_json::to_string(&w)?),
            OutputFormat::Text => print!("{}", render_as_written(&w)),
        }
        return Ok(());
    }
    let plan = physalia_planner::plan(&req, &catalog, calibration.as_ref())?;
    match a.output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&plan)?),
        OutputFormat::Text => print!("{}", plan.render_brief(a.rows)),
    }
    Ok(())
}

/// What `physalia plan --as-written` prints in text.
fn render_as_written(w: &AsWritten) -> String {
    use physalia_planner::render::{bytes, epoch_terms, secs, usd};
    let (c, p, t, m) = (
        &w.candidate,
        &w.prediction,
        &w.prediction.time,
        &w.prediction.memory,
    );
    let resources = if w.sku.shared_host && c.workers > 1 {
        format!("{} processes sharing {}", c.workers, w.sku.device_label())
    } else {
        format!("{} x {}", c.workers, w.sku.device_label())
    };
    let mut out = format!(
        "as written: {} ({resources}): {} per epoch, {} in all ({} setup), {}\n",
        c.describe(),
        secs(t.epoch_s),
        secs(t.total_s),
        secs(t.setup_s),
        usd(p.usd_total)
    );
    out.push_str(&format!(
        "epoch: {}; {} steps\n",
        epoch_terms(t),
        p.steps_per_epoch
    ));
    out.push_str(&format!(
        "memory per worker: {} of {} usable\n",
        bytes(m.device_bytes),
        bytes(m.device_usable_bytes)
    ));
    if let Some(step) = &w.partition {
        out.push_str(&format!("partition step: {}\n", step.why));
    }
    out.push_str(if w.calibrated {
        "rates: the calibration profile\n"
    } else if w.sku.backend.on_this_machine() {
        "rates: catalog peaks x efficiency (run `physalia calibrate` and pass --calibration)\n"
    } else {
        "rates: catalog peaks x efficiency\n"
    });
    out
}
