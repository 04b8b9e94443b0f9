//! Cluster mode's platform primitive: the coordinator as one platform object next to its workers
//! (kubernetes: a Job; ecs: a Fargate task; aci: a container group), started from a [`CoordinatorSpec`]
//! and known afterwards only by a [`CoordinatorHandle`], plain data the job store keeps so any machine
//! that reads the store can follow, read and stop it.
//!
//! Unlike a worker, the coordinator holds no secret from the spec: its identity is the platform's (the
//! `physalia-coordinator` ServiceAccount, the ECS coordinator task role, a user-assigned managed identity),
//! and it issues the job's certificates itself once it runs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::WorkerState;
use crate::error::{Error, Result};
use crate::spec::{is_env_name, is_label_key, is_label_value};

/// What the coordinator of one job runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorSpec {
    /// The job's id; platform names are derived from it ([`crate::LaunchId::coordinator_name`]).
    pub job_id: String,
    /// The image holding the `physalia` CLI.
    pub image: String,
    /// The full command (`argv[0]` first); empty runs the image's entrypoint.
    pub command: Vec<String>,
    /// Plain environment. Never secrets: the coordinator's credentials come from the platform's identity.
    pub env: BTreeMap<String, String>,
    /// Virtual CPUs.
    pub cpu: f64,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// UDP port the coordinator's control endpoint listens on; workers dial it at the coordinator's IP.
    pub control_port: u16,
    /// Extra labels (kubernetes labels, ECS and ARM tags), e.g. the user's team. Keys and values follow
    /// Kubernetes label syntax, the strictest of the three.
    pub labels: BTreeMap<String, String>,
}

/// How many ports, from [`CoordinatorSpec::control_port`] on, a coordinator's platform object declares:
/// a launch whose port is taken (a prewarmed launch's control endpoint beside the running one's) binds
/// the next, and workers must reach it there too.
pub const CONTROL_PORTS: u16 = 8;

impl CoordinatorSpec {
    /// Every port the coordinator's control endpoints may listen on ([`CONTROL_PORTS`] of them).
    pub fn control_ports(&self) -> std::ops::RangeInclusive<u16> {
        self.control_port..=self.control_port.saturating_add(CONTROL_PORTS - 1)
    }

    /// Checks what every backend relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidSpec(format!("coordinator: {msg}")));
        if self.job_id.is_empty() {
            return bad("job_id is empty".into());
        }
        if self.image.trim().is_empty() {
            return bad("image is empty".into());
        }
        if !(self.cpu.is_finite() && self.cpu > 0.0) {
            return bad(format!("cpu must be a positive number, got {}", self.cpu));
        }
        if !(self.memory_gib.is_finite() && self.memory_gib > 0.0) {
            return bad(format!(
                "memory_gib must be a positive number, got {}",
                self.memory_gib
            ));
        }
        if self.control_port == 0 {
            return bad("control_port is 0; workers need a fixed port to dial".into());
        }
        if self.control_port > u16::MAX - (CONTROL_PORTS - 1) {
            return bad(format!(
                "control_port {} leaves no room for the {CONTROL_PORTS} ports a coordinator declares",
                self.control_port
            ));
        }
        for name in self.env.keys() {
            if !is_env_name(name) {
                return bad(format!(
                    "env name {name:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
                ));
            }
        }
        for (k, v) in &self.labels {
            if !is_label_key(k) {
                return bad(format!(
                    "label key {k:?} must be an optional DNS prefix and '/', then 1-63 characters of \
                     [A-Za-z0-9-_.] starting and ending alphanumeric"
                ));
            }
            if !is_label_value(v) {
                return bad(format!(
                    "label {k}'s value {v:?} must be at most 63 characters of [A-Za-z0-9-_.], starting \
                     and ending alphanumeric"
                ));
            }
        }
        Ok(())
    }
}

/// One platform object made for a coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlatformObject {
    /// `job.batch`, `task-definition`, `task`, `container-group`.
    pub kind: String,
    /// Its name, or ARN where the platform names objects by ARN (ecs).
    pub id: String,
}

/// A started coordinator, as the job store records it: enough for any process with the platform's
/// credentials to follow, read and stop it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorHandle {
    /// The backend that made it (`kubernetes`, `ecs`, `aci`).
    pub backend: String,
    pub job_id: String,
    /// Where it lives: the kubernetes namespace, the ECS cluster, the ARM resource group.
    pub scope: String,
    /// Every object made for it, in creation order; [`crate::Backend::stop_coordinator`] deletes them
    /// all.
    pub objects: Vec<PlatformObject>,
}

impl CoordinatorHandle {
    /// The id of the first object of `kind`.
    pub fn object(&self, kind: &str) -> Option<&str> {
        self.objects
            .iter()
            .find(|o| o.kind == kind)
            .map(|o| o.id.as_str())
    }

    /// An error unless this handle was made by `backend`.
    pub(crate) fn check_backend(&self, backend: crate::BackendName) -> Result<()> {
        if self.backend == backend {
            Ok(())
        } else {
            Err(Error::Config {
                backend,
                detail: format!(
                    "the coordinator of job {} was started by the {} backend, not this one",
                    self.job_id, self.backend
                ),
            })
        }
    }
}

/// Where a coordinator is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorStatus {
    /// `Pending` (scheduled, pulling), `Running`, `Succeeded` (exited 0), `Failed` (exited non-zero,
    /// could not start, or was stopped), `Unknown` (the platform no longer has it).
    pub state: WorkerState,
    /// The platform's reason for the state, when it gives one.
    pub detail: Option<String>,
    /// Its private address, once the platform assigned one: what workers dial.
    pub ip: Option<std::net::IpAddr>,
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec() -> CoordinatorSpec {
        CoordinatorSpec {
            job_id: "cora-1732000000".into(),
            image: "ghcr.io/physalia/physalia:0.1.0".into(),
            command: vec!["physalia".into(), "run-coordinator".into()],
            env: BTreeMap::from([("RUST_LOG".into(), "info".into())]),
            cpu: 1.0,
            memory_gib: 2.0,
            control_port: 7000,
            labels: BTreeMap::from([("team".into(), "graphs".into())]),
        }
    }

    #[test]
    fn validate_names_the_field() {
        assert!(spec().validate().is_ok());
        let check = |f: &dyn Fn(&mut CoordinatorSpec), needle: &str| {
            let mut s = spec();
            f(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        };
        check(&|s| s.image = " ".into(), "image is empty");
        check(&|s| s.memory_gib = 0.0, "memory_gib");
        check(&|s| s.control_port = 0, "control_port");
        check(
            &|s| {
                s.env.insert("1X".into(), "v".into());
            },
            "\"1X\"",
        );
        check(
            &|s| {
                s.labels.insert("team".into(), "a b".into());
            },
            "label team's value \"a b\"",
        );
        check(
            &|s| {
                s.labels.insert("-x".into(), "v".into());
            },
            "label key \"-x\"",
        );
    }

    #[test]
    fn handles_round_trip_through_json() {
        let h = CoordinatorHandle {
            backend: "ecs".into(),
            job_id: "j".into(),
            scope: "physalia".into(),
            objects: vec![PlatformObject {
                kind: "task".into(),
                id: "arn:aws:ecs:us-east-1:1:task/physalia/abc".into(),
            }],
        };
        let back: CoordinatorHandle =
            serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back, h);
        assert_eq!(
            back.object("task"),
            Some("arn:aws:ecs:us-east-1:1:task/physalia/abc")
        );
        assert!(back.check_backend("aci").is_err());
    }
}
