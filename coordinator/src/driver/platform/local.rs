//! `backend: local`: worker processes on this machine (`physalia_backends::local`), running this
//! executable's `worker` subcommand; the control endpoint and the mesh on loopback.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use physalia_backends::{Backend, Prepared};

use super::{Launch, Platform, Reach, Worker};
use crate::driver::Observer;
use crate::driver::resolved::ResolvedJob;

pub struct Local;

impl Platform for Local {
    fn workers_read_coordinator_disk(&self) -> bool {
        true
    }

    fn backend(
        &self,
        _: &ResolvedJob,
        _: &str,
        job_dir: &Path,
        segment: usize,
        _: &dyn Observer,
    ) -> Result<Box<dyn Backend>> {
        Ok(crate::driver::workers::local_backend(job_dir, segment))
    }

    fn reach(&self, _: &ResolvedJob, prepared: &Prepared) -> Result<Reach> {
        Ok(Reach::at(prepared.control_ip))
    }

    fn worker(&self, _: &ResolvedJob, w: Worker) -> Result<Launch> {
        let spec = crate::driver::workers::local_spec(
            w.local_command,
            w.job_id,
            w.segment,
            w.coordinator,
            w.threads,
            w.secrets,
        );
        // the backend writes each rank's output into logs/ itself, and asking it is cheap
        Ok(Launch {
            spec,
            copy_logs: false,
            poll_every: Duration::ZERO,
        })
    }
}
