//! What the ecs backend's preflight knows about AWS's quotas: which Service Quotas quota counts a
//! worker, and how many of its vCPUs a job needs at its peak.
//!
//! EC2's On-Demand instance quotas are vCPUs of running instances, one quota per instance family group
//! ("Running On-Demand G and VT instances", quota code L-DB2E81BA, and so on): a worker on a whole
//! `g5.xlarge` holds its 4 vCPUs whatever its task asks for. Fargate's quota is the vCPUs of running
//! tasks ("Fargate On-Demand vCPU resource count", L-3032A538; Spot has its own). A new account's G and
//! VT quota is often 0: without this check its job waits for a capacity provider that can never start
//! an instance, until the launch times out.

use crate::Demand;

use super::Capacity;

/// One Service Quotas quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// Service Quotas' service code (`ec2`, `fargate`).
    pub service: &'static str,
    pub code: &'static str,
    /// Its name in the Service Quotas console.
    pub name: &'static str,
}

const fn quota(service: &'static str, code: &'static str, name: &'static str) -> Quota {
    Quota {
        service,
        code,
        name,
    }
}

pub const FARGATE: Quota = quota(
    "fargate",
    "L-3032A538",
    "Fargate On-Demand vCPU resource count",
);
pub const FARGATE_SPOT: Quota = quota("fargate", "L-36FBB829", "Fargate Spot vCPU resource count");
pub const EC2_STANDARD: Quota = quota(
    "ec2",
    "L-1216C47A",
    "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
);
pub const EC2_G_VT: Quota = quota("ec2", "L-DB2E81BA", "Running On-Demand G and VT instances");
pub const EC2_P: Quota = quota("ec2", "L-417A185B", "Running On-Demand P instances");
pub const EC2_INF: Quota = quota("ec2", "L-1945791B", "Running On-Demand Inf instances");
pub const EC2_TRN: Quota = quota("ec2", "L-2C3B7624", "Running On-Demand Trn instances");
pub const EC2_DL: Quota = quota("ec2", "L-6E869C2A", "Running On-Demand DL instances");
pub const EC2_F: Quota = quota("ec2", "L-74FC7D96", "Running On-Demand F instances");
pub const EC2_X: Quota = quota("ec2", "L-7295265B", "Running On-Demand X instances");

/// The On-Demand quota an EC2 instance type's vCPUs count against, by its family's letters
/// (`g5.xlarge` -> G and VT); `None` for a family this table does not know (the check is skipped).
pub fn ec2_quota(instance_type: &str) -> Option<Quota> {
    let family: String = instance_type
        .chars()
        .take_while(|c| c.is_ascii_alphabetic())
        .collect::<String>()
        .to_ascii_lowercase();
    Some(match family.as_str() {
        "g" | "vt" => EC2_G_VT,
        "p" => EC2_P,
        "inf" => EC2_INF,
        "trn" => EC2_TRN,
        "dl" => EC2_DL,
        "f" => EC2_F,
        "x" => EC2_X,
        "a" | "c" | "d" | "h" | "i" | "m" | "r" | "t" | "z" => EC2_STANDARD,
        _ => return None,
    })
}

/// What a job's workers need of one quota at its peak.
#[derive(Clone, Debug, PartialEq)]
pub struct Need {
    pub quota: Quota,
    pub vcpus: f64,
    /// How the figure was reached, for the refusal: `3 workers on g5.xlarge, 4 vCPUs each`.
    pub why: String,
}

/// The quota the job's workers count against and how much of it they need at their peak
/// ([`Demand::peak_workers`]: one launch's, plus the launch still running beside a prewarmed one):
/// Fargate's by the task's vCPUs, EC2's by the instances' (`demand.machine_vcpus`, one worker's share
/// of its machine). `None` where no known quota applies (an instance family outside the table, or no
/// instance type named).
pub fn need(
    capacity: &Capacity,
    task_vcpus: f64,
    instance_types: &[String],
    demand: Demand,
) -> Option<Need> {
    let workers = demand.peak_workers();
    let plural = if workers == 1 { "worker" } else { "workers" };
    let note = demand.overlap_note();
    let fargate = |quota: Quota| Need {
        quota,
        vcpus: f64::from(workers) * task_vcpus,
        why: format!(
            "{workers} Fargate {plural} of {} vCPUs each{note}",
            trim(task_vcpus)
        ),
    };
    match capacity {
        Capacity::Fargate => Some(fargate(FARGATE)),
        Capacity::Provider(p) if p == "FARGATE" => Some(fargate(FARGATE)),
        Capacity::Provider(p) if p == "FARGATE_SPOT" => Some(fargate(FARGATE_SPOT)),
        Capacity::Ec2 | Capacity::Provider(_) => {
            // the placement may take several types; the first the table knows decides the quota
            let (ty, quota) = instance_types
                .iter()
                .find_map(|t| ec2_quota(t).map(|q| (t, q)))?;
            Some(Need {
                quota,
                vcpus: f64::from(workers) * demand.machine_vcpus,
                why: format!(
                    "{workers} {plural} on {ty}, {} vCPUs each{note}",
                    trim(demand.machine_vcpus)
                ),
            })
        }
    }
}

/// What already counts against a quota, as far as the ECS API shows it: the running (and pending)
/// Fargate tasks of the backend's cluster, or the cluster's container instances of the quota's
/// instance families. What runs elsewhere in the account and region (other clusters, EC2 instances
/// outside ECS, EKS pods on Fargate) counts too but is not seen: the quota may still be short.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// vCPUs in use: tasks' sizes, or instances' registered CPU.
    pub vcpus: f64,
    /// vCPUs of running instances of the SKU's types that run no task: the job's first workers are
    /// placed there without starting an instance (EC2 only; already in `vcpus`).
    pub idle_vcpus: f64,
    /// What was counted, for the refusal: `2 tasks of cluster physalia`.
    pub what: String,
}

/// The one-line refusal of a job whose peak, beside what already runs (`usage`), passes the quota's
/// `value` in `region`; `None` when it fits. Idle instances of the SKU's types take the job's first
/// workers, so only the rest needs new instances.
pub fn refusal(need: &Need, usage: &Usage, value: f64, region: &str) -> Option<String> {
    let reused = usage.idle_vcpus.min(need.vcpus);
    let new = need.vcpus - reused;
    let total = usage.vcpus + new;
    if total <= value {
        return None;
    }
    let q = need.quota;
    let why = if reused > 0.0 {
        format!(
            "{}, less the {} of idle instances of that type",
            need.why,
            trim(reused)
        )
    } else {
        need.why.clone()
    };
    let beside = if usage.vcpus > 0.0 {
        format!(
            " and {} are in use now ({}): {} in all",
            trim(usage.vcpus),
            usage.what,
            trim(total)
        )
    } else {
        String::new()
    };
    Some(format!(
        "the account's quota \"{}\" ({} {}) in {region} is {} vCPUs and this job needs {} at its \
         peak ({why}){beside}; what runs outside the cluster counts against it too and is not \
         counted here. Request an increase in the Service Quotas console or with `aws \
         service-quotas request-service-quota-increase --service-code {} --quota-code {} \
         --desired-value {} --region {region}`; nothing was created",
        q.name,
        q.service,
        q.code,
        trim(value),
        trim(new),
        q.service,
        q.code,
        trim(total.ceil()),
    ))
}

/// `4` rather than `4.0`, `0.5` as it is.
pub fn trim(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_families_map_to_their_quotas() {
        assert_eq!(ec2_quota("g5.xlarge"), Some(EC2_G_VT));
        assert_eq!(ec2_quota("g4dn.xlarge"), Some(EC2_G_VT));
        assert_eq!(ec2_quota("vt1.3xlarge"), Some(EC2_G_VT));
        assert_eq!(ec2_quota("p4d.24xlarge"), Some(EC2_P));
        assert_eq!(ec2_quota("p5.48xlarge"), Some(EC2_P));
        assert_eq!(ec2_quota("inf2.xlarge"), Some(EC2_INF));
        assert_eq!(ec2_quota("trn1.32xlarge"), Some(EC2_TRN));
        assert_eq!(ec2_quota("c7i.2xlarge"), Some(EC2_STANDARD));
        assert_eq!(ec2_quota("m6a.large"), Some(EC2_STANDARD));
        assert_eq!(ec2_quota("x2idn.16xlarge"), Some(EC2_X));
        assert_eq!(ec2_quota("mac2.metal"), None);
        assert_eq!(ec2_quota(""), None);
    }

    #[test]
    fn ec2_counts_the_machine_and_fargate_the_task() {
        let demand = Demand {
            workers: 3,
            overlap_workers: 0,
            machine_vcpus: 12.0,
        };
        let types = vec!["p4d.24xlarge".to_string()];
        let n = need(&Capacity::Provider("gpu".into()), 11.0, &types, demand).unwrap();
        assert_eq!((n.quota, n.vcpus), (EC2_P, 36.0));
        assert_eq!(n.why, "3 workers on p4d.24xlarge, 12 vCPUs each");
        let n = need(&Capacity::Fargate, 2.0, &types, demand).unwrap();
        assert_eq!((n.quota, n.vcpus), (FARGATE, 6.0));
        let n = need(&Capacity::Provider("FARGATE_SPOT".into()), 0.5, &[], demand).unwrap();
        assert_eq!((n.quota, n.vcpus), (FARGATE_SPOT, 1.5));
        assert_eq!(need(&Capacity::Ec2, 4.0, &[], demand), None);
        assert_eq!(
            need(&Capacity::Ec2, 4.0, &["mac2.metal".into()], demand),
            None
        );
    }

    #[test]
    fn the_refusal_names_the_quota_the_need_and_the_command() {
        let n = need(
            &Capacity::Ec2,
            4.0,
            &["g5.xlarge".into()],
            Demand {
                workers: 3,
                overlap_workers: 0,
                machine_vcpus: 4.0,
            },
        )
        .unwrap();
        let line = refusal(&n, &Usage::default(), 0.0, "eu-west-1").unwrap();
        assert!(!line.contains('\n'));
        for want in [
            "\"Running On-Demand G and VT instances\" (ec2 L-DB2E81BA) in eu-west-1 is 0 vCPUs",
            "needs 12 at its peak (3 workers on g5.xlarge, 4 vCPUs each);",
            "--desired-value 12 --region eu-west-1",
            "nothing was created",
        ] {
            assert!(line.contains(want), "{want:?} not in {line}");
        }
        assert_eq!(refusal(&n, &Usage::default(), 12.0, "eu-west-1"), None);
    }

    /// What already runs counts against the quota beside the job's peak, and a prewarmed launch
    /// overlaps the one it replaces: each alone fits, together they do not.
    #[test]
    fn running_tasks_and_a_prewarmed_launch_count_against_the_quota() {
        let three = Demand {
            workers: 3,
            overlap_workers: 0,
            machine_vcpus: 2.0,
        };
        let n = need(&Capacity::Fargate, 2.0, &[], three).unwrap();
        let running = Usage {
            vcpus: 4.0,
            idle_vcpus: 0.0,
            what: "2 tasks of cluster physalia".into(),
        };
        assert_eq!(refusal(&n, &Usage::default(), 8.0, "us-east-1"), None);
        let line = refusal(&n, &running, 8.0, "us-east-1").unwrap();
        assert!(
            line.contains(
                "is 8 vCPUs and this job needs 6 at its peak (3 Fargate workers of 2 vCPUs each) \
                 and 4 are in use now (2 tasks of cluster physalia): 10 in all;"
            ) && line.contains("--desired-value 10 "),
            "{line}"
        );
        // 3 workers prewarmed beside 2 still running: 5 at the peak
        let prewarm = Demand {
            overlap_workers: 2,
            ..three
        };
        let n = need(&Capacity::Fargate, 2.0, &[], prewarm).unwrap();
        assert_eq!(n.vcpus, 10.0);
        let line = refusal(&n, &Usage::default(), 8.0, "us-east-1").unwrap();
        assert!(
            line.contains(
                "needs 10 at its peak (5 Fargate workers of 2 vCPUs each; a prewarmed launch of 3 \
                 beside 2 still running)"
            ),
            "{line}"
        );
        // EC2: idle instances of the SKU's type take the first workers; the busy ones still count
        let n = need(
            &Capacity::Ec2,
            4.0,
            &["g5.xlarge".into()],
            Demand {
                machine_vcpus: 4.0,
                ..three
            },
        )
        .unwrap();
        let instances = Usage {
            vcpus: 8.0,
            idle_vcpus: 4.0,
            what: "2 instances of cluster physalia".into(),
        };
        // 8 in use + (12 - 4 idle) new = 16
        assert_eq!(refusal(&n, &instances, 16.0, "us-east-1"), None);
        let line = refusal(&n, &instances, 15.0, "us-east-1").unwrap();
        assert!(
            line.contains(
                "needs 8 at its peak (3 workers on g5.xlarge, 4 vCPUs each, less the 4 of idle \
                 instances of that type) and 8 are in use now (2 instances of cluster physalia): 16 \
                 in all"
            ),
            "{line}"
        );
    }
}
