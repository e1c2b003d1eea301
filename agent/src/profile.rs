//! Device profiles (`firmware-targets/profiles/*.toml`, built into the agent): a backend, a
//! thread count, a batch size and a memory budget per kind of device, picked in a site's config
//! with `profile = "<name>"`. A key the config sets itself wins over its profile's; `doctor`
//! checks the profile against the machine (memory, GPU device nodes).

use anyhow::{Result, bail};
use serde::Deserialize;

/// The built-in profiles: name and TOML.
const PROFILES: [(&str, &str); 4] = [
    (
        "x86-cpu",
        include_str!("../../firmware-targets/profiles/x86-cpu.toml"),
    ),
    (
        "arm-cpu",
        include_str!("../../firmware-targets/profiles/arm-cpu.toml"),
    ),
    (
        "jetson-orin",
        include_str!("../../firmware-targets/profiles/jetson-orin.toml"),
    ),
    (
        "desktop-gpu",
        include_str!("../../firmware-targets/profiles/desktop-gpu.toml"),
    ),
];

/// One device profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// What device it is for.
    pub description: String,
    /// The compute backend.
    pub backend: String,
    /// CPU threads; -1 is every core but one.
    pub threads: i64,
    /// Training batch size.
    pub batch_size: usize,
    /// The most memory the agent should take, MiB.
    pub memory_budget_mib: u64,
    /// Device nodes a GPU backend needs (checked by `doctor`).
    #[serde(default)]
    pub gpu_devices: Vec<String>,
}

/// The names of the built-in profiles.
pub fn names() -> Vec<&'static str> {
    PROFILES.iter().map(|(n, _)| *n).collect()
}

/// The built-in profile `name`.
pub fn get(name: &str) -> Result<Profile> {
    let Some((_, text)) = PROFILES.iter().find(|(n, _)| *n == name) else {
        bail!(
            "no device profile `{name}` (there are {})",
            names().join(", ")
        );
    };
    Ok(toml::from_str(text)?)
}

impl Profile {
    /// The thread count on this machine (-1: every core but one, at least one).
    pub fn threads_here(&self) -> usize {
        match usize::try_from(self.threads) {
            Ok(t) if t > 0 => t,
            _ => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .saturating_sub(1)
                .max(1),
        }
    }

    /// Fills the keys of a site's config (`table`) that it leaves to the profile: `backend`,
    /// `threads`, `memory_budget_mib` and `[train] batch_size`.
    pub fn fill(&self, table: &mut toml::Table) {
        let put = |t: &mut toml::Table, k: &str, v: toml::Value| {
            t.entry(k).or_insert(v);
        };
        put(table, "backend", self.backend.clone().into());
        put(table, "threads", (self.threads_here() as i64).into());
        put(
            table,
            "memory_budget_mib",
            (self.memory_budget_mib as i64).into(),
        );
        if let Some(train) = table
            .entry("train")
            .or_insert(toml::Value::Table(Default::default()))
            .as_table_mut()
        {
            put(train, "batch_size", (self.batch_size as i64).into());
        }
    }
}

/// Memory of this machine in MiB (`/proc/meminfo`'s MemTotal), where it can be read.
pub fn machine_mib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_profile_reads_and_fills_only_what_a_config_leaves_open() {
        for n in names() {
            let p = get(n).unwrap();
            assert!(p.batch_size > 0 && p.memory_budget_mib > 0, "{n}");
            assert_eq!(p.backend == "flex", p.gpu_devices.is_empty(), "{n}");
        }
        assert!(get("toaster").unwrap_err().to_string().contains("x86-cpu"));
        let p = get("jetson-orin").unwrap();
        let mut t: toml::Table = toml::from_str("threads = 2\n[train]\nlr = 0.1\n").unwrap();
        p.fill(&mut t);
        assert_eq!(
            t["threads"].as_integer(),
            Some(2),
            "the config's own value wins"
        );
        assert_eq!(t["backend"].as_str(), Some("vulkan"));
        assert_eq!(t["train"]["batch_size"].as_integer(), Some(32));
        assert_eq!(t["train"]["lr"].as_float(), Some(0.1));
        assert!(get("x86-cpu").unwrap().threads_here() >= 1);
    }
}
