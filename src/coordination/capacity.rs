//! How many policies a replica can hold: set by `--capacity`, or derived from its memory
//! limit (the cgroup's), and advertised on its member Lease so that the leader never gives
//! it more (`sharding::capacity`).

use std::path::Path;
use std::str::FromStr;

/// What every replica takes before its first policy, with room for its requests in flight:
/// an idle replica measures about 18 MiB (docs/benchmarks.md, "The baseline").
pub const BASELINE_BYTES: u64 = 32 << 20;
/// Memory per policy held: 880 to 940 bytes measured at rest from 1,000 to 50,000 policies
/// (docs/benchmarks.md, "Memory per policy"). Peaks add a part that barely grows with the
/// slice: 17.7 MiB above an idle replica for 5,000 policies built through the first
/// handoffs, 20.1 MiB for 20,000 on one replica (docs/benchmarks.md, "A fleet over its
/// capacity"). Twice the slope and the baseline's margin cover both.
pub const BYTES_PER_POLICY: u64 = 2048;

/// `--capacity`: a number of policies, `auto` (from the memory limit) or `none`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    Auto,
    Unbounded,
    Policies(u64),
}

impl FromStr for Capacity {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "auto" => Ok(Capacity::Auto),
            "none" => Ok(Capacity::Unbounded),
            n => n.parse().map(Capacity::Policies).map_err(|_| {
                format!("--capacity {n:?}: expected a number of policies, auto (from the memory limit) or none")
            }),
        }
    }
}

impl Capacity {
    /// The policies this replica can hold; `None`: no bound (no memory limit either).
    pub fn resolve(self) -> Option<u64> {
        match self {
            Capacity::Policies(n) => Some(n),
            Capacity::Unbounded => None,
            Capacity::Auto => memory_limit(Path::new("/sys/fs/cgroup")).map(from_memory_limit),
        }
    }
}

/// The policies that fit in `limit` bytes.
pub fn from_memory_limit(limit: u64) -> u64 {
    limit.saturating_sub(BASELINE_BYTES) / BYTES_PER_POLICY
}

/// This process's memory limit under the cgroup filesystem at `root`: cgroup v2's
/// `memory.max`, or v1's `memory/memory.limit_in_bytes`; `None` when unlimited or unknown.
pub fn memory_limit(root: &Path) -> Option<u64> {
    let read = |file: &str| std::fs::read_to_string(root.join(file)).ok();
    let limit = read("memory.max").or_else(|| read("memory/memory.limit_in_bytes"))?;
    // v2 writes "max"; v1 writes a number near 2^63 for no limit.
    limit.trim().parse::<u64>().ok().filter(|bytes| *bytes < 1 << 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numbers_auto_and_none_and_says_what_else_it_wants() {
        assert_eq!("auto".parse::<Capacity>(), Ok(Capacity::Auto));
        assert_eq!("none".parse::<Capacity>(), Ok(Capacity::Unbounded));
        assert_eq!("5000".parse::<Capacity>(), Ok(Capacity::Policies(5000)));
        assert!("5k".parse::<Capacity>().unwrap_err().contains("a number of policies"));
        assert_eq!(Capacity::Policies(7).resolve(), Some(7));
        assert_eq!(Capacity::Unbounded.resolve(), None);
    }

    #[test]
    fn the_deployed_limit_holds_about_a_hundred_thousand() {
        // deploy/base/statefulset.yaml: 256Mi (docs/operations.md, "Capacity").
        assert_eq!(from_memory_limit(256 << 20), 114_688);
        assert_eq!(from_memory_limit(16 << 20), 0, "below the baseline: room for nothing");
    }

    #[test]
    fn reads_cgroup_v2_and_v1_limits() {
        let dir = std::env::temp_dir().join(format!("tpo-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("memory")).unwrap();
        std::fs::write(dir.join("memory/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(memory_limit(&dir), None, "v1 without a limit");
        std::fs::write(dir.join("memory/memory.limit_in_bytes"), "268435456\n").unwrap();
        assert_eq!(memory_limit(&dir), Some(256 << 20), "v1");
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(memory_limit(&dir), None, "v2 without a limit");
        std::fs::write(dir.join("memory.max"), "134217728\n").unwrap();
        assert_eq!(memory_limit(&dir), Some(128 << 20), "v2 comes first");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
