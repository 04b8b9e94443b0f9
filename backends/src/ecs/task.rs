//! What one ECS worker is, as plain data: the task size, the secret bundle, the names. The AWS calls are in
//! `mod.rs`; everything here is pure and unit-tested.

use std::collections::BTreeMap;

use base64::Engine;

use crate::error::{Error, Result};
use crate::{LaunchId, WorkerSpec};

/// Name of the environment variable the `secrets` container gets the rank's bundle in (from Secrets
/// Manager, through the task definition's `secrets`); `physalia-worker unpack-secrets` reads it.
pub const ENV_SECRET_BUNDLE: &str = "PHYSALIA_SECRET_BUNDLE";
/// `uid:gid` the unpacked files are given to (the worker image's user), for the `secrets` container.
pub const ENV_SECRETS_OWNER: &str = "PHYSALIA_SECRETS_OWNER";

/// Secrets Manager's limit on one secret value.
pub const MAX_SECRET_BYTES: usize = 65_536;

/// The task definition family of rank `rank`: `<base>_rank<r>`. One family per rank, because ECS cannot
/// override a container's `secrets` per task, and each rank must see only its own key. `_` never occurs in
/// a base name, so no other launch's family starts with `<base>_rank`.
pub fn family(launch: &LaunchId, rank: usize) -> String {
    format!("{}{rank}", family_prefix(launch))
}

pub fn family_prefix(launch: &LaunchId) -> String {
    format!("{}_rank", launch.base_name())
}

/// The Secrets Manager secret of rank `rank`: `physalia/<base>/rank-<r>`.
pub fn secret_name(launch: &LaunchId, rank: usize) -> String {
    format!("{}rank-{rank}", secret_prefix(launch))
}

pub fn secret_prefix(launch: &LaunchId) -> String {
    format!("physalia/{}/", launch.base_name())
}

/// The rank's secret files as one Secrets Manager value: a JSON object from file name to the file's bytes
/// in standard base64. `physalia-worker unpack-secrets` is its reader.
pub fn secret_bundle(spec: &WorkerSpec, rank: usize) -> Result<String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let files: BTreeMap<&str, String> = spec
        .secrets
        .iter()
        .map(|(name, value)| (name.as_str(), b64.encode(value.for_rank(rank).expose())))
        .collect();
    let text = serde_json::to_string(&files).expect("a map of strings serializes");
    if text.len() > MAX_SECRET_BYTES {
        return Err(Error::InvalidSpec(format!(
            "worker {rank}'s secret files come to {} bytes as a Secrets Manager value; the limit is \
             {MAX_SECRET_BYTES}",
            text.len()
        )));
    }
    Ok(text)
}

/// CPU units (1 vCPU = 1024) and MiB of a Fargate task: the smallest size Fargate offers that holds the
/// request. Fargate sells fixed pairs; asking for an unsupported pair is an error at RunTask, so round up
/// here and say what was chosen.
pub fn fargate_size(cpu: f64, memory_gib: f64) -> Result<(u32, u32)> {
    // (CPU units, smallest MiB, largest MiB, step MiB), from the ECS developer guide's table.
    const SIZES: [(u32, u32, u32, u32); 7] = [
        (256, 512, 2048, 512),
        (512, 1024, 4096, 1024),
        (1024, 2048, 8192, 1024),
        (2048, 4096, 16384, 1024),
        (4096, 8192, 30720, 1024),
        (8192, 16384, 61440, 4096),
        (16384, 32768, 122880, 8192),
    ];
    let want_cpu = (cpu * 1024.0).ceil() as u64;
    let want_mib = (memory_gib * 1024.0).ceil() as u64;
    for (units, lo, hi, step) in SIZES {
        if u64::from(units) < want_cpu || u64::from(hi) < want_mib {
            continue;
        }
        let mib = (want_mib.max(u64::from(lo))).div_ceil(u64::from(step)) * u64::from(step);
        // 256 CPU units takes 512, 1024 or 2048: the step from 512 is 512 but 1536 is not offered.
        let mib = if units == 256 && mib == 1536 {
            2048
        } else {
            mib
        };
        return Ok((units, mib as u32));
    }
    Err(Error::InvalidSpec(format!(
        "{cpu} vCPU and {memory_gib} GiB is larger than any Fargate task (16 vCPU, 120 GiB); use EC2 \
         capacity (capacity: ec2 or a capacity provider)"
    )))
}

/// CPU units and MiB of a container on EC2 capacity: exactly the request.
pub fn ec2_size(cpu: f64, memory_gib: f64) -> (u32, u32) {
    (
        (cpu * 1024.0).ceil() as u32,
        (memory_gib * 1024.0).ceil() as u32,
    )
}

/// The cluster query language expression that places a task on one of `types` (ECS's built-in attribute
/// `ecs.instance-type`, which names the instance type as EC2 does: `g5.xlarge`), or `None` for any.
pub fn instance_type_constraint(types: &[String]) -> Option<String> {
    match types {
        [] => None,
        [one] => Some(format!("attribute:ecs.instance-type == {one}")),
        many => Some(format!(
            "attribute:ecs.instance-type in [{}]",
            many.join(", ")
        )),
    }
}

/// The task's private IPv4 address, from its elastic network interface attachment (awsvpc mode).
pub fn eni_ip(task: &aws_sdk_ecs::types::Task) -> Option<std::net::IpAddr> {
    let from_attachment = task
        .attachments()
        .iter()
        .filter(|a| a.r#type() == Some("ElasticNetworkInterface"))
        .flat_map(|a| a.details())
        .find(|d| d.name() == Some("privateIPv4Address"))
        .and_then(|d| d.value());
    let from_container = || {
        task.containers()
            .iter()
            .flat_map(|c| c.network_interfaces())
            .find_map(|n| n.private_ipv4_address())
    };
    from_attachment
        .or_else(from_container)
        .and_then(|s| s.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests::spec;
    use crate::{SecretBytes, SecretValue};

    #[test]
    fn fargate_sizes_round_up_to_what_fargate_sells() {
        let cases = [
            (0.25, 0.5, (256, 512)),
            (0.25, 1.2, (256, 2048)),
            (0.25, 3.0, (512, 3072)),
            (1.0, 1.0, (1024, 2048)),
            (1.5, 2.0, (2048, 4096)),
            (2.0, 8.0, (2048, 8192)),
            (2.0, 20.0, (4096, 20480)),
            (8.0, 17.0, (8192, 20480)),
            (16.0, 100.0, (16384, 106496)),
        ];
        for (cpu, mem, want) in cases {
            assert_eq!(
                fargate_size(cpu, mem).unwrap(),
                want,
                "{cpu} vCPU {mem} GiB"
            );
        }
        let err = fargate_size(32.0, 8.0).unwrap_err().to_string();
        assert!(err.contains("larger than any Fargate task"), "{err}");
        assert!(fargate_size(4.0, 121.0).is_err());
    }

    #[test]
    fn tasks_are_placed_by_the_instance_type_ecs_reports() {
        assert_eq!(instance_type_constraint(&[]), None);
        assert_eq!(
            instance_type_constraint(&["g5.xlarge".into()]).as_deref(),
            Some("attribute:ecs.instance-type == g5.xlarge")
        );
        assert_eq!(
            instance_type_constraint(&["g5.xlarge".into(), "g6.xlarge".into()]).as_deref(),
            Some("attribute:ecs.instance-type in [g5.xlarge, g6.xlarge]")
        );
    }

    #[test]
    fn bundle_holds_the_ranks_own_files_only() {
        let mut s = spec();
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank(vec![SecretBytes::new("KEY0"), SecretBytes::new("KEY1")]),
        );
        let one: BTreeMap<String, String> =
            serde_json::from_str(&secret_bundle(&s, 1).unwrap()).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        assert_eq!(b64.decode(&one["key.pem"]).unwrap(), b"KEY1");
        assert_eq!(b64.decode(&one["ca.pem"]).unwrap(), b"CA");
        assert_eq!(one.len(), 2);
        s.secrets.insert(
            "big".into(),
            SecretValue::Same(SecretBytes::new(vec![0u8; 60_000])),
        );
        let err = secret_bundle(&s, 0).unwrap_err().to_string();
        assert!(err.contains("limit is 65536"), "{err}");
    }

    #[test]
    fn names_of_two_launches_never_share_a_prefix() {
        let a = LaunchId::new("a", 1);
        let b = LaunchId::new("a-s1-r5", 0);
        let c = LaunchId::new("a", 10);
        assert_eq!(family(&a, 3), "physalia-a-s1_rank3");
        assert_eq!(secret_name(&a, 3), "physalia/physalia-a-s1/rank-3");
        for other in [&b, &c] {
            assert!(!family(other, 0).starts_with(&family_prefix(&a)));
            assert!(!secret_name(other, 0).starts_with(&secret_prefix(&a)));
        }
    }
}
