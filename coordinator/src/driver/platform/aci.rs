//! `backend: aci`: workers as Azure Container Instances container groups (`physalia_backends::aci`)
//! in `infra/azure`'s subnet, a token from Azure's credential chain.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use physalia_backends::aci::{AciBackend, AciConfig, DefaultAzureToken, RegistryPull};
use physalia_backends::{Backend, Prepared};

use super::{Launch, Platform, Reach, Worker};
use crate::driver::Observer;
use crate::driver::resolved::ResolvedJob;
use crate::spec::{AciSettings, JobSpec};

pub struct Aci;

impl Platform for Aci {
    fn backend(
        &self,
        job: &ResolvedJob,
        _: &str,
        _: &Path,
        _: usize,
        _: &dyn Observer,
    ) -> Result<Box<dyn Backend>> {
        let a = settings(&job.spec)?;
        let token = Arc::new(DefaultAzureToken::from_env());
        let backend = AciBackend::new(config(a), token).context("connecting to Azure")?;
        Ok(Box::new(backend))
    }

    fn reach(&self, job: &ResolvedJob, _: &Prepared) -> Result<Reach> {
        super::cloud_reach(job)
    }

    fn worker(&self, job: &ResolvedJob, w: Worker) -> Result<Launch> {
        let a = settings(&job.spec)?;
        super::cloud_worker(job, w, &a.image, a.mesh_port.unwrap_or(super::MESH_PORT))
    }

    /// Which of the group's identities is the coordinator's (`AZURE_MSI_RESOURCE_ID`: a group that
    /// pulls from a registry holds the pull identity too, and the metadata service then wants to be
    /// told).
    fn coordinator_env(&self, job: &ResolvedJob, env: &mut BTreeMap<String, String>) {
        if let Some(id) = job
            .spec
            .backend
            .aci
            .as_ref()
            .and_then(|a| a.coordinator_identity_id.as_ref())
        {
            env.insert("AZURE_MSI_RESOURCE_ID".into(), id.clone());
        }
    }
}

fn settings(job: &JobSpec) -> Result<&AciSettings> {
    job.backend
        .aci
        .as_ref()
        .context("backend.aci: the aci backend needs its settings (infra/azure's outputs)")
}

/// `backend.aci` as the ACI backend's configuration (`arm_endpoint`: another cloud's Resource Manager).
fn config(a: &AciSettings) -> AciConfig {
    let mut cfg = AciConfig::new(
        &a.subscription_id,
        &a.resource_group,
        &a.location,
        &a.subnet_id,
    );
    cfg.registry = a.registry.as_ref().map(|r| RegistryPull {
        server: r.server.clone(),
        identity_id: r.identity_id.clone(),
    });
    cfg.coordinator_identity_id = a.coordinator_identity_id.clone();
    if let Some(endpoint) = &a.arm_endpoint {
        cfg.endpoint = endpoint.trim_end_matches('/').to_string();
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The aci section becomes its backend's configuration (cluster mode's generic path builds it
    /// from it).
    #[test]
    fn aci_section_becomes_the_backend_config() {
        let a = AciSettings {
            subscription_id: "sub".into(),
            resource_group: "rg".into(),
            location: "eastus".into(),
            subnet_id: "/subscriptions/sub/x/subnets/w".into(),
            registry: Some(crate::spec::AciRegistry {
                server: "r.azurecr.io".into(),
                identity_id: "/subscriptions/sub/pull".into(),
            }),
            image: "img".into(),
            coordinator_identity_id: Some("/subscriptions/sub/coordinator".into()),
            coordinator_image: None,
            sku: None,
            arm_endpoint: Some("https://management.chinacloudapi.cn/".into()),
            mesh_port: None,
        };
        let cfg = config(&a);
        assert_eq!(cfg.endpoint, "https://management.chinacloudapi.cn");
        let public = config(&AciSettings {
            arm_endpoint: None,
            ..a.clone()
        });
        assert_eq!(public.endpoint, "https://management.azure.com");
        assert_eq!(
            (cfg.subscription_id.as_str(), cfg.resource_group.as_str()),
            ("sub", "rg")
        );
        assert_eq!(cfg.subnet_id, "/subscriptions/sub/x/subnets/w");
        assert_eq!(cfg.registry.unwrap().server, "r.azurecr.io");
        assert_eq!(
            cfg.coordinator_identity_id.as_deref(),
            Some("/subscriptions/sub/coordinator")
        );
    }
}
