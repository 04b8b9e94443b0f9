//! A plan as text: what `physalia plan` prints and what the golden files hold. Numbers carry
//! three or four significant digits, so the text does not change with the last bits of a
//! float.

use std::fmt::Write as _;

use crate::cost::Prediction;
use crate::search::{Plan, Reason};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

/// `12.3 GiB`, `540 MiB`.
pub fn bytes(b: f64) -> String {
    if b >= 1000.0 * GIB {
        format!("{:.2} TiB", b / GIB / 1024.0)
    } else if b >= GIB {
        format!("{} GiB", sig3(b / GIB))
    } else if b >= MIB {
        format!("{} MiB", sig3(b / MIB))
    } else {
        format!("{} KiB", sig3(b / 1024.0))
    }
}

/// `compute 1.2 s, sampling 0 s, exchange 310 ms, all-reduce 12 ms, evaluation 90 ms, overhead 5 ms`: an
/// epoch's predicted terms, as plans and their reasons print them.
pub fn epoch_terms(t: &crate::cost::TimeBreakdown) -> String {
    format!(
        "compute {}, sampling {}, exchange {}, all-reduce {}, evaluation {}, overhead {}",
        secs(t.compute_s),
        secs(t.sample_s),
        secs(t.exchange_s),
        secs(t.allreduce_s),
        secs(t.eval_s),
        secs(t.overhead_s),
    )
}

/// `850 ms`, `2.81 s`, `14.2 min`, `3.10 h`, `2.5 d`.
pub fn secs(s: f64) -> String {
    if s <= 0.0 {
        "0 s".to_string()
    } else if s < 1.0 {
        format!("{} ms", sig3(s * 1e3))
    } else if s < 120.0 {
        format!("{} s", sig3(s))
    } else if s < 7200.0 {
        format!("{} min", sig3(s / 60.0))
    } else if s < 3.0 * 86400.0 {
        format!("{} h", sig3(s / 3600.0))
    } else {
        format!("{} d", sig3(s / 86400.0))
    }
}

/// `$0`, `$0.0123`, `$12.35`, `$1234`.
pub fn usd(v: f64) -> String {
    if v <= 0.0 {
        "$0".to_string()
    } else if v < 1.0 {
        format!("${}", sig3(v))
    } else if v < 1000.0 {
        format!("${v:.2}")
    } else {
        format!("${v:.0}")
    }
}

/// Three significant digits, no exponent.
fn sig3(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let digits = v.abs().log10().floor() as i32;
    let decimals = (2 - digits).clamp(0, 9) as usize;
    format!("{v:.decimals$}")
}

fn row(p: &Prediction) -> String {
    format!(
        "{:>10} {:>10} {:>10} {:>10}",
        bytes(p.memory.device_bytes),
        secs(p.time.epoch_s),
        secs(p.time.total_s),
        usd(p.usd_total)
    )
}

impl Plan {
    /// The plan as text: the choice with its memory and time, why, the alternatives, and every
    /// rejected candidate with its reason.
    pub fn render(&self) -> String {
        self.render_rows(usize::MAX)
    }

    /// The plan as text with at most `rows` alternatives and rejected candidates each, the
    /// rest counted (for a terminal; [`Plan::render`] lists everything).
    pub fn render_brief(&self, rows: usize) -> String {
        self.render_rows(rows)
    }

    fn render_rows(&self, rows: usize) -> String {
        let mut out = String::new();
        let c = &self.chosen.candidate;
        let p = &self.chosen.prediction;
        let m = &p.memory;
        let t = &p.time;
        let _ = writeln!(out, "plan ({}): {}", self.objective.as_str(), c.describe());
        let _ = writeln!(
            out,
            "  mode {}, workers {}, parts {}, replicas {}, exchange {}, cache rows {}",
            c.mode.as_str(),
            c.workers,
            c.parts,
            c.replicas,
            c.exchange.label(),
            c.cache_rows
        );
        let gpu = self.sku.gpu.as_ref().map_or(String::new(), |g| {
            format!(", {} {} GiB", g.model, g.memory_gib)
        });
        let _ = writeln!(
            out,
            "  sku {} ({}; {} vCPU, {} GiB{gpu}; {}/h {})",
            self.sku.name,
            self.sku.backend.as_str(),
            self.sku.vcpus,
            self.sku.memory_gib,
            usd(self.sku.usd_per_s() * 3600.0),
            if self.sku.shared_host {
                "for the host, its workers sharing it"
            } else {
                "per worker"
            }
        );
        let _ = writeln!(
            out,
            "  memory per worker: device {} of {} usable, host {} of {} usable",
            bytes(m.device_bytes),
            bytes(m.device_usable_bytes),
            bytes(m.host_bytes),
            bytes(m.host_usable_bytes)
        );
        let _ = writeln!(
            out,
            "    features {}, structure {}, activations {}, halo {}, optimizer {}, cache {}, runtime {}",
            bytes(m.features_bytes),
            bytes(m.structure_bytes),
            bytes(m.activations_bytes),
            bytes(m.halo_bytes),
            bytes(m.optimizer_bytes),
            bytes(m.cache_bytes),
            bytes(m.runtime_bytes)
        );
        let _ = writeln!(
            out,
            "  epoch {} ({} steps): compute {}, sampling {}, exchange {}, all-reduce {}, evaluation {}, overhead {}",
            secs(t.epoch_s),
            p.steps_per_epoch,
            secs(t.compute_s),
            secs(t.sample_s),
            secs(t.exchange_s),
            secs(t.allreduce_s),
            secs(t.eval_s),
            secs(t.overhead_s)
        );
        let _ = writeln!(
            out,
            "  sent per worker per epoch: exchange {}, all-reduce {}, evaluation {}; halo rows {}, cache hit {:.0}%{}",
            bytes(p.exchange_bytes_per_epoch),
            bytes(p.allreduce_bytes_per_epoch),
            bytes(p.eval_bytes_per_epoch),
            p.halo_rows,
            100.0 * p.cache_hit_rate,
            if p.partition_estimated {
                " (partition estimated)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "  total {} (setup {}), {} per epoch, {} in all",
            secs(t.total_s),
            secs(t.setup_s),
            usd(p.usd_per_epoch),
            usd(p.usd_total)
        );
        if let Some(step) = &self.partition {
            let c = &step.chosen;
            let o = &step.other;
            let _ = writeln!(
                out,
                "  partition {} parts by {}{}: {}, {} of {} usable, cut {:.3}, {}; {} would take {}, {}, epochs +{}",
                step.parts,
                c.partitioner.as_str(),
                if step.stored { " (stored, reused)" } else { "" },
                secs(c.seconds),
                bytes(c.memory_bytes),
                bytes(step.memory_usable_bytes),
                c.cut_fraction,
                usd(step.usd),
                o.partitioner.as_str(),
                secs(o.seconds),
                bytes(o.memory_bytes),
                secs(o.epochs_extra_s)
            );
        }
        let _ = writeln!(out, "why:");
        for line in &self.explanation {
            let _ = writeln!(out, "  - {line}");
        }
        let _ = writeln!(
            out,
            "alternatives ({}):  {:>10} {:>10} {:>10} {:>10}",
            self.alternatives.len(),
            "mem/worker",
            "epoch",
            "total",
            "cost"
        );
        for a in self.alternatives.iter().take(rows) {
            let _ = writeln!(
                out,
                "  {:<48} {}",
                a.candidate.describe(),
                row(&a.prediction)
            );
        }
        if self.alternatives.len() > rows {
            let _ = writeln!(out, "  ... {} more", self.alternatives.len() - rows);
        }
        let _ = writeln!(out, "rejected ({}):", self.rejected.len());
        for r in self.rejected.iter().take(rows) {
            let _ = writeln!(out, "  {:<48} {}", r.candidate.describe(), r.reason);
        }
        if self.rejected.len() > rows {
            let mut counts: Vec<(&'static str, usize)> = Vec::new();
            for r in &self.rejected[rows..] {
                let kind = match r.reason {
                    Reason::Memory { .. } => "memory",
                    Reason::Deadline { .. } => "deadline",
                    Reason::Budget { .. } => "budget",
                    Reason::Unsupported { .. } => "unsupported",
                };
                match counts.iter_mut().find(|(k, _)| *k == kind) {
                    Some(c) => c.1 += 1,
                    None => counts.push((kind, 1)),
                }
            }
            let list: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
            let _ = writeln!(
                out,
                "  ... {} more ({})",
                self.rejected.len() - rows,
                list.join(", ")
            );
        }
        out
    }
}
