//! Platform names for a launch. Kubernetes object names and ACI container group names share a shape:
//! lowercase letters, digits and `-`, starting and ending alphanumeric, at most 63 characters. Job ids
//! are free text, so the name is derived: the id made safe, cut short, and suffixed with a hash of the
//! original when that changed anything, so two ids never share a name.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest base name: it leaves room for `-<rank>` (pod hostnames and container groups add the rank,
/// Kubernetes adds `-<index>-<5 random>` to pod names and the hostname must stay within 63).
const MAX_BASE: usize = 45;

/// One launch of a job: the job id and the launch's segment (see [`crate::WorkerSpec::segment`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LaunchId {
    pub job_id: String,
    pub segment: u32,
}

impl LaunchId {
    pub fn new(job_id: impl Into<String>, segment: u32) -> LaunchId {
        LaunchId {
            job_id: job_id.into(),
            segment,
        }
    }

    /// `physalia-<job>-s<segment>`: the Job, Service and Secret name on kubernetes, the container group
    /// prefix on aci. Also used as a label value (at most 63 characters of `[a-z0-9-]`).
    pub fn base_name(&self) -> String {
        with_suffix(&self.job_id, &format!("-s{}", self.segment))
    }

    /// `physalia-<job>-coordinator`: the name of job `job_id`'s coordinator object (kubernetes Job, ECS
    /// task definition family, ACI container group). Worker launches end in `-s<segment>`, so no worker
    /// object shares it.
    pub fn coordinator_name(job_id: &str) -> String {
        with_suffix(job_id, "-coordinator")
    }
}

/// `physalia-<job made safe>{suffix}`, at most [`MAX_BASE`] characters.
fn with_suffix(job_id: &str, suffix: &str) -> String {
    let safe = sanitize(job_id);
    let exact = safe == job_id;
    let room = MAX_BASE - "physalia-".len() - suffix.len();
    let body = if exact && safe.len() <= room {
        safe
    } else {
        let hash = format!("{:08x}", fnv1a(job_id.as_bytes()) as u32);
        let keep = room - hash.len() - 1;
        let cut = safe[..safe.len().min(keep)].trim_end_matches('-');
        if cut.is_empty() {
            hash
        } else {
            format!("{cut}-{hash}")
        }
    };
    format!("physalia-{body}{suffix}")
}

impl fmt::Display for LaunchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} segment {}", self.job_id, self.segment)
    }
}

fn sanitize(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for c in id.chars() {
        let c = c.to_ascii_lowercase();
        let c = if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '-'
        };
        if !(c == '-' && (out.is_empty() || out.ends_with('-'))) {
            out.push(c);
        }
    }
    out.trim_end_matches('-').to_string()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(name: &str) -> bool {
        name.len() <= MAX_BASE
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !name.starts_with('-')
            && !name.ends_with('-')
            && !name.contains("--")
    }

    #[test]
    fn names_are_platform_safe_and_distinct() {
        let cases = [
            ("cora-1732000000", 0, "physalia-cora-1732000000-s0"),
            ("cora-1732000000", 12, "physalia-cora-1732000000-s12"),
            ("Cora_Run 1", 0, "physalia-cora-run-1-6915daeb-s0"),
            ("cora-run-1", 0, "physalia-cora-run-1-s0"),
            ("---", 3, "physalia-de1b3246-s3"),
        ];
        for (job, seg, want) in cases {
            let got = LaunchId::new(job, seg).base_name();
            assert_eq!(got, want, "{job}");
            assert!(valid(&got), "{got}");
        }
        let long = "x".repeat(200);
        let a = LaunchId::new(format!("{long}a"), 4_000_000_000).base_name();
        let b = LaunchId::new(format!("{long}b"), 4_000_000_000).base_name();
        assert!(valid(&a) && valid(&b) && a != b, "{a} {b}");
        assert_eq!(
            LaunchId::coordinator_name("cora-1732000000"),
            "physalia-cora-1732000000-coordinator"
        );
        let c = LaunchId::coordinator_name(&long);
        assert!(valid(&c) && c.ends_with("-coordinator"), "{c}");
    }
}
