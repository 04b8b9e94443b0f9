//! `backend: kubernetes`: workers as the pods of an Indexed Job (`physalia_backends::kubernetes`) in
//! the namespace `infra/k8s` makes, credentials from the kubeconfig or the pod's service account.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use physalia_backends::kubernetes::{KubernetesBackend, KubernetesConfig};
use physalia_backends::{Backend, Prepared};

use super::{Launch, Platform, Reach, Worker};
use crate::driver::Observer;
use crate::driver::resolved::ResolvedJob;
use crate::spec::{JobSpec, KubernetesSettings};

pub struct Kubernetes;

impl Platform for Kubernetes {
    fn backend(
        &self,
        job: &ResolvedJob,
        _: &str,
        _: &Path,
        _: usize,
        _: &dyn Observer,
    ) -> Result<Box<dyn Backend>> {
        let k = settings(&job.spec)?;
        let backend = crate::driver::workers::block_on(KubernetesBackend::infer(
            config(k),
            k.context.as_deref(),
        ))?
        .context("connecting to Kubernetes")?;
        Ok(Box::new(backend))
    }

    fn reach(&self, job: &ResolvedJob, _: &Prepared) -> Result<Reach> {
        super::cloud_reach(job)
    }

    fn worker(&self, job: &ResolvedJob, w: Worker) -> Result<Launch> {
        super::cloud_worker(job, w, &settings(&job.spec)?.image, super::MESH_PORT)
    }
}

fn settings(job: &JobSpec) -> Result<&KubernetesSettings> {
    job.backend.kubernetes.as_ref().context(
        "backend.kubernetes: the kubernetes backend needs its settings (namespace, image, sku)",
    )
}

/// `backend.kubernetes` as the Kubernetes backend's configuration: the image's non-root user is the
/// pods' `fsGroup`, so the secret files are readable by it.
fn config(k: &KubernetesSettings) -> KubernetesConfig {
    KubernetesConfig {
        namespace: k.namespace.clone(),
        image_pull_secret: k.image_pull_secret.clone(),
        gpu_image: k.gpu_image.clone(),
        fs_group: Some(i64::from(crate::driver::image::WORKER_UID)),
        poll_interval: Duration::from_secs(1),
        node_selector: k.node_selector.clone(),
        scales_from_zero: k.scales_from_zero,
        tolerations: (k.tolerations.iter())
            .map(|t| {
                let (op, value, effect) = (
                    t.operator.as_deref(),
                    t.value.as_deref(),
                    t.effect.as_deref(),
                );
                physalia_backends::kubernetes::toleration(&t.key, op, value, effect)
            })
            .collect(),
        ..KubernetesConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kubernetes section becomes its backend's configuration (cluster mode's generic path builds
    /// it from it).
    #[test]
    fn kubernetes_section_becomes_the_backend_config() {
        let k = KubernetesSettings {
            context: None,
            namespace: "ml".into(),
            image: "img".into(),
            gpu_image: Some("img-cuda".into()),
            sku: None,
            image_pull_secret: Some("pull".into()),
            coordinator_image: None,
            node_selector: Default::default(),
            tolerations: Vec::new(),
            scales_from_zero: true,
        };
        let cfg = config(&k);
        assert_eq!(cfg.namespace, "ml");
        assert_eq!(cfg.gpu_image.as_deref(), Some("img-cuda"));
        assert_eq!(cfg.image_pull_secret.as_deref(), Some("pull"));
        assert_eq!(
            cfg.fs_group,
            Some(i64::from(crate::driver::image::WORKER_UID))
        );
        assert_eq!(cfg.coordinator_service_account, "physalia-coordinator");
        assert!(cfg.scales_from_zero);
    }
}
