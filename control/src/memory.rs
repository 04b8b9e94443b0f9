//! What memory this process may use: the machine's available memory, and the limit of its cgroup (a
//! container's). The coordinator sizes its partitioning and admits jobs by it; a worker decides by it
//! whether to hold its next part beside the one it trains on.

/// This machine's available memory (`MemAvailable` of `/proc/meminfo`), bytes.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This process's cgroup's memory limit (cgroup v2's `memory.max`), bytes; `None` without one ("max").
pub fn cgroup_limit_bytes() -> Option<u64> {
    read_bytes("/sys/fs/cgroup/memory.max")
}

/// What this process may still allocate: the machine's available memory, or less where its cgroup's
/// limit leaves less (`memory.max` less `memory.current`). `None` where neither can be read.
pub fn headroom_bytes() -> Option<u64> {
    let cgroup = cgroup_limit_bytes()
        .zip(read_bytes("/sys/fs/cgroup/memory.current"))
        .map(|(max, current)| max.saturating_sub(current));
    match (available_bytes(), cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

fn read_bytes(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Linux the machine's available memory is known, and the headroom is at most it.
    #[test]
    fn the_headroom_is_at_most_the_available_memory() {
        let available = available_bytes().expect("/proc/meminfo has MemAvailable");
        assert!(available > 0);
        let headroom = headroom_bytes().expect("known where the available memory is");
        assert!(headroom <= available, "{headroom} > {available}");
    }
}
