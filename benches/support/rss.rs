//! The process's resident set, for the memory figures of the benchmarks.

/// The resident set size of this process in bytes (`VmRSS`), or 0 where unknown.
pub(crate) fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
