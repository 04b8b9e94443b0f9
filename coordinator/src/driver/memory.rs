//! What memory this machine (or this process's cgroup) has: read by admission, which refuses a job
//! that cannot fit, and by the planner's request, which chooses a partitioner that fits.

/// This machine's available memory (`MemAvailable` of `/proc/meminfo`), bytes.
pub fn available_bytes() -> Option<f64> {
    physalia_control::memory::available_bytes().map(|b| b as f64)
}

/// Memory the coordinator has for partitioning: this machine's available memory, or less where a
/// cgroup limits the process (a cluster-mode coordinator's container: `memory.max` of cgroup v2).
pub fn partition_memory_bytes() -> Option<f64> {
    let limit = physalia_control::memory::cgroup_limit_bytes().map(|b| b as f64);
    match (available_bytes(), limit) {
        (Some(a), Some(l)) => Some(a.min(l)),
        (a, l) => a.or(l),
    }
}
