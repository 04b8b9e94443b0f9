//! The ARM request body of one worker's container group, as a pure function (the tests validate it
//! against the published ContainerGroup schema of api-version 2026-05-01).
//!
//! One container named `worker`; private IP in the configured subnet (the coordinator runs in the same
//! VNet); the mesh port open over UDP; `restartPolicy: Never` (the coordinator relaunches, ACI does not
//! restart); the rank's secret files in a `secret` volume mounted read-only at
//! [`CONTAINER_SECRETS_DIR`]. ACI keeps secret volumes in memory (tmpfs) and, like secure environment
//! values, does not return them from GET: the worker reads files as on every other backend, and no
//! secret appears in an environment value.

use base64::Engine as _;
use serde_json::{Value, json};

use super::AciConfig;
use crate::spec::{CONTAINER_SECRETS_DIR, ENV_RANK, WorkerSpec};
use crate::{CoordinatorSpec, LaunchId};

/// The container's name in every group.
pub const CONTAINER: &str = "worker";
/// Tags every group carries: the launch's base name, the rank, and the raw job id.
pub const TAG_LAUNCH: &str = "physalia-launch";
pub const TAG_RANK: &str = "physalia-rank";
pub const TAG_JOB_ID: &str = "physalia-job-id";
const SECRETS_VOLUME: &str = "physalia-secrets";
/// The container's name in the coordinator's group.
pub const COORDINATOR_CONTAINER: &str = "coordinator";
/// The coordinator group's tag; its value is the group's name.
pub const TAG_COORDINATOR: &str = "physalia-coordinator";

/// The coordinator's container group: one `coordinator` container with the spec's resources, plain
/// environment and control port (UDP, private IP in the workers' subnet), `restartPolicy: Never`, and the
/// user-assigned managed identity `identity_id` (its ARM calls run as that identity: no secret in the
/// group). Label keys become tags with `/` replaced by `_` (ARM tag names cannot hold `/`).
pub fn coordinator_group(cfg: &AciConfig, spec: &CoordinatorSpec, identity_id: &str) -> Value {
    let name = LaunchId::coordinator_name(&spec.job_id);
    let env: Vec<Value> = spec
        .env
        .iter()
        .map(|(name, value)| json!({ "name": name, "value": value }))
        .collect();
    let ports: Vec<Value> = spec
        .control_ports()
        .map(|port| json!({ "port": port, "protocol": "UDP" }))
        .collect();
    let mut container = json!({
        "image": spec.image,
        "environmentVariables": env,
        "ports": ports,
        "resources": {
            "requests": { "cpu": spec.cpu, "memoryInGB": memory_gb(spec.memory_gib) }
        }
    });
    if !spec.command.is_empty() {
        container["command"] = json!(spec.command);
    }
    let mut properties = json!({
        "containers": [{ "name": COORDINATOR_CONTAINER, "properties": container }],
        "osType": "Linux",
        "restartPolicy": "Never",
        "sku": "Standard",
        "ipAddress": { "type": "Private", "ports": ports },
        "subnetIds": [{ "id": cfg.subnet_id }]
    });
    let mut identities = serde_json::Map::new();
    identities.insert(identity_id.to_string(), json!({}));
    if let Some(pull) = &cfg.registry {
        properties["imageRegistryCredentials"] =
            json!([{ "server": pull.server, "identity": pull.identity_id }]);
        identities.insert(pull.identity_id.clone(), json!({}));
    }
    let mut tags: serde_json::Map<String, Value> = spec
        .labels
        .iter()
        .map(|(k, v)| (k.replace('/', "_"), json!(v)))
        .collect();
    tags.insert(TAG_COORDINATOR.into(), json!(name));
    tags.insert(TAG_JOB_ID.into(), json!(spec.job_id));
    json!({
        "location": cfg.location,
        "tags": tags,
        "identity": { "type": "UserAssigned", "userAssignedIdentities": identities },
        "properties": properties,
    })
}

/// The container group name of `rank`.
pub fn group_name(launch: &LaunchId, rank: usize) -> String {
    format!("{}-{rank}", launch.base_name())
}

/// ACI takes memory in GB steps of 0.1; round up so the worker never gets less than asked.
pub fn memory_gb(memory_gib: f64) -> f64 {
    (memory_gib * 10.0).ceil() / 10.0
}

/// The PUT body of rank `rank`'s container group. The spec must be valid and ask for no GPU.
pub fn container_group(cfg: &AciConfig, spec: &WorkerSpec, n_workers: usize, rank: usize) -> Value {
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    let mut env: Vec<Value> = spec
        .base_env(n_workers)
        .into_iter()
        .map(|(name, value)| json!({ "name": name, "value": value }))
        .collect();
    env.push(json!({ "name": ENV_RANK, "value": rank.to_string() }));
    let b64 = base64::engine::general_purpose::STANDARD;
    let secret_files: serde_json::Map<String, Value> = spec
        .secrets
        .iter()
        .map(|(file, v)| {
            (
                file.clone(),
                Value::String(b64.encode(v.for_rank(rank).expose())),
            )
        })
        .collect();
    let port = spec.network.mesh_port;

    let mut container = json!({
        "image": spec.image,
        "environmentVariables": env,
        "ports": [{ "port": port, "protocol": "UDP" }],
        "resources": {
            "requests": { "cpu": spec.cpu, "memoryInGB": memory_gb(spec.memory_gib) }
        },
        "volumeMounts": [
            { "name": SECRETS_VOLUME, "mountPath": CONTAINER_SECRETS_DIR, "readOnly": true }
        ]
    });
    if !spec.command.is_empty() {
        container["command"] = json!(spec.command);
    }

    let mut properties = json!({
        "containers": [{ "name": CONTAINER, "properties": container }],
        "osType": "Linux",
        "restartPolicy": "Never",
        "sku": "Standard",
        "ipAddress": { "type": "Private", "ports": [{ "port": port, "protocol": "UDP" }] },
        "subnetIds": [{ "id": cfg.subnet_id }],
        "volumes": [{ "name": SECRETS_VOLUME, "secret": secret_files }]
    });
    let mut group = json!({
        "location": cfg.location,
        "tags": {
            TAG_LAUNCH: launch.base_name(),
            TAG_RANK: rank.to_string(),
            TAG_JOB_ID: spec.job_id,
        },
    });
    if let Some(pull) = &cfg.registry {
        properties["imageRegistryCredentials"] =
            json!([{ "server": pull.server, "identity": pull.identity_id }]);
        group["identity"] = json!({
            "type": "UserAssigned",
            "userAssignedIdentities": { pull.identity_id.clone(): {} }
        });
    }
    group["properties"] = properties;
    group
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_rounds_up_to_a_tenth() {
        assert_eq!(memory_gb(8.0), 8.0);
        assert_eq!(memory_gb(1.01), 1.1);
        assert_eq!(memory_gb(0.05), 0.1);
    }
}
