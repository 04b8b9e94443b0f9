//! `backend: docker`: workers as containers of the worker image on the job's own bridge network of
//! this machine's Docker Engine (`physalia_backends::docker`); the images come from `crate::driver::image`.

use std::path::Path;

use anyhow::{Result, bail};
use physalia_backends::docker::{DockerBackend, DockerConfig};
use physalia_backends::{Backend, Prepared};

use super::{Launch, Platform, Reach, Worker};
use crate::driver::Observer;
use crate::driver::image::{self, WORKER_UID};
use crate::driver::resolved::ResolvedJob;
use crate::driver::workers::{block_on, worker_binary};

/// The mesh port every worker binds in its own container.
const MESH_PORT: u16 = 7000;
const SECRETS_IN_CONTAINER: &str = "/run/secrets/physalia";

pub struct Docker;

impl Platform for Docker {
    fn backend(
        &self,
        job: &ResolvedJob,
        job_id: &str,
        _: &Path,
        _: usize,
        obs: &dyn Observer,
    ) -> Result<Box<dyn Backend>> {
        // GPU workers run the CUDA image (the job's `gpu_image`, or the one built from this
        // physalia-worker)
        if job.gpu.is_some() {
            let gpu = image::gpu_image(job.spec.backend.gpu_image(), &worker_binary()?, obs)?;
            return backend_with(job_id, Some(gpu));
        }
        backend(job_id)
    }

    fn reach(&self, _: &ResolvedJob, prepared: &Prepared) -> Result<Reach> {
        // the job network's gateway: only the job's containers and this machine reach it
        Ok(Reach::at(prepared.control_ip))
    }

    fn worker(&self, job: &ResolvedJob, w: Worker) -> Result<Launch> {
        let named = job
            .spec
            .backend
            .docker
            .as_ref()
            .and_then(|d| d.image.as_deref());
        let image = match named {
            Some(named) => image::named_image(named)?,
            None => image::ensure_image(&worker_binary()?, w.obs)?,
        };
        let spec = crate::driver::workers::worker_spec(
            w.job_id,
            w.segment,
            image,
            Vec::new(),
            w.coordinator,
            w.threads,
            w.secrets,
            MESH_PORT,
        );
        Ok(Launch::copying_logs(
            spec,
            std::time::Duration::from_millis(500),
        ))
    }

    fn release(&self, _: &ResolvedJob, job_id: &str) -> Result<()> {
        // every launch's containers are gone by now; the network goes with the job
        // no engine answering: nothing was made
        let Ok(backend) = backend(job_id) else {
            return Ok(());
        };
        block_on(backend.release(job_id))??;
        Ok(())
    }
}

/// A name Docker accepts for the job's network: lowercase letters, digits and '-'.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// The docker backend of a job: its containers on the job's own bridge network (made by
/// `Backend::prepare`), running as the image's non-root user, secrets copied in, nothing mounted.
/// Workers that ask for a GPU run the CUDA image of the `physalia-worker` beside `physalia`
/// ([`image::cuda_image_tag`]; `physalia image build --cuda` or [`image::ensure_cuda_image`] builds it).
pub fn backend(job_id: &str) -> Result<Box<dyn Backend>> {
    let gpu_image = worker_binary()
        .ok()
        .and_then(|w| image::cuda_image_tag(&w).ok());
    backend_with(job_id, gpu_image)
}

/// [`backend`] with the image of GPU workers named (the job's `backend.docker.gpu_image`, see
/// [`image::gpu_image`]); `None` runs the spec's image on GPUs too.
pub fn backend_with(job_id: &str, gpu_image: Option<String>) -> Result<Box<dyn Backend>> {
    if !image::available() {
        bail!(
            "backend docker: no Docker Engine answers (`docker info` failed); start it or use `backend: local`"
        );
    }
    Ok(Box::new(DockerBackend::new(config(job_id, gpu_image))?))
}

pub fn config(job_id: &str, gpu_image: Option<String>) -> DockerConfig {
    let mut cfg = DockerConfig::new(format!("physalia-{}", sanitize(job_id)));
    cfg.user = Some((WORKER_UID, WORKER_UID));
    cfg.secrets_dir = SECRETS_IN_CONTAINER.into();
    cfg.gpu_image = gpu_image;
    cfg
}
