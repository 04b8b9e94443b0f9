//! `backend: ecs`: workers as AWS ECS tasks (`physalia_backends::ecs`), in the subnets and security
//! groups of `infra/ecs`, credentials from aws-config's chain.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use physalia_backends::ecs::{Capacity, EcsBackend, EcsConfig};
use physalia_backends::{Backend, Prepared};

use super::{Launch, Platform, Reach, Worker};
use crate::driver::Observer;
use crate::driver::resolved::ResolvedJob;
use crate::spec::{EcsSettings, JobSpec};

pub struct Ecs;

impl Platform for Ecs {
    fn backend(
        &self,
        job: &ResolvedJob,
        _: &str,
        _: &Path,
        _: usize,
        _: &dyn Observer,
    ) -> Result<Box<dyn Backend>> {
        let e = settings(&job.spec)?;
        let cfg = config(e, job.gpu.is_some());
        let backend =
            crate::driver::workers::block_on(EcsBackend::from_env(cfg, e.region.clone()))?
                .context("connecting to AWS ECS")?;
        Ok(Box::new(backend))
    }

    fn reach(&self, job: &ResolvedJob, _: &Prepared) -> Result<Reach> {
        super::cloud_reach(job)
    }

    fn worker(&self, job: &ResolvedJob, w: Worker) -> Result<Launch> {
        let e = settings(&job.spec)?;
        super::cloud_worker(job, w, &e.image, e.mesh_port.unwrap_or(super::MESH_PORT))
    }
}

fn settings(job: &JobSpec) -> Result<&EcsSettings> {
    job.backend
        .ecs
        .as_ref()
        .context("backend.ecs: the ecs backend needs its settings (infra/ecs's outputs)")
}

/// `backend.ecs` as the ECS backend's configuration.
fn config(e: &EcsSettings, gpu: bool) -> EcsConfig {
    let mut cfg = EcsConfig::new(
        &e.cluster,
        e.subnets.clone(),
        e.security_groups.clone(),
        &e.execution_role_arn,
        &e.log_group,
    );
    cfg.capacity = match e.capacity.as_deref() {
        None if gpu => Capacity::Provider("physalia-gpu".into()),
        None => Capacity::Fargate,
        Some(c) if c.eq_ignore_ascii_case("fargate") => Capacity::Fargate,
        Some(c) if c.eq_ignore_ascii_case("ec2") => Capacity::Ec2,
        // FARGATE_SPOT and the cluster's own providers
        Some(c) => Capacity::Provider(c.to_string()),
    };
    cfg.task_role_arn = e.task_role_arn.clone();
    cfg.coordinator_task_role_arn = e.coordinator_task_role_arn.clone();
    cfg.gpu_image = e.gpu_image.clone();
    // a worker that does not run within a second or two of RUNNING is seen a poll later; ECS's own
    // placement takes far longer than this
    cfg.poll_interval = Duration::from_secs(1);
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(capacity: Option<&str>) -> EcsSettings {
        EcsSettings {
            region: None,
            cluster: "physalia".into(),
            subnets: vec!["subnet-1".into()],
            security_groups: vec!["sg-1".into()],
            execution_role_arn: "arn:aws:iam::123456789012:role/x".into(),
            task_role_arn: None,
            coordinator_task_role_arn: None,
            coordinator_image: None,
            log_group: "/physalia/workers".into(),
            capacity: capacity.map(String::from),
            image: "img".into(),
            gpu_image: None,
            sku: None,
            mesh_port: None,
        }
    }

    #[test]
    fn ecs_capacity_follows_the_section_and_the_gpu() {
        let cap = |c, gpu| config(&settings(c), gpu).capacity;
        assert_eq!(cap(None, false), Capacity::Fargate);
        assert_eq!(cap(None, true), Capacity::Provider("physalia-gpu".into()));
        assert_eq!(cap(Some("FARGATE"), false), Capacity::Fargate);
        assert_eq!(cap(Some("ec2"), true), Capacity::Ec2);
        assert_eq!(
            cap(Some("FARGATE_SPOT"), false),
            Capacity::Provider("FARGATE_SPOT".into())
        );
        assert_eq!(
            cap(Some("physalia-gpu"), true),
            Capacity::Provider("physalia-gpu".into())
        );
    }
}
