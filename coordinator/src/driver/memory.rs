//! What memory this machine (or this process's cgroup) has: read by admission, which refuses a job
//! that cannot fit, and by the planner's request, which chooses a partitioner that fits.

/// This machine's available memory (`MemAvailable` of `/proc/meminfo`), bytes.
pub fn available_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Memory the coordinator has for partitioning: this machine's available memory, or less where a
/// cgroup limits the process (a cluster-mode coordinator's container: `memory.max` of cgroup v2).
pub fn partition_memory_bytes() -> Option<f64> {
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|t| t.trim().parse::<f64>().ok());
    match (available_bytes(), limit) {
        (Some(a), Some(l)) => Some(a.min(l)),
        (a, l) => a.or(l),
    }
}
