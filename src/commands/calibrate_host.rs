//! `tessera calibrate --host GPU-CLUSTER.toml`: the cluster spec with only its `[host]` table
//! replaced by this machine's, measured here (`tessera_runtime::calibrate::host`): the host's
//! memory, the runtime's own AdamW on all its cores, and with `--nvme-dir` that drive's rate and
//! size. `--gpu` writes the same `[host]` beside the `[calibration]` it measures.
//!
//! What this process cannot measure is kept from the input spec and said so in the table's
//! comments: the host↔device link (this binary copies nothing to a GPU) and, without
//! `--nvme-dir`, the NVMe.

use std::fmt::Write as _;
use std::path::Path;

use tessera_planner::spec::Host;
use tessera_planner::Cluster;
use tessera_runtime::calibrate::host;

/// This machine's `[host]` table, with the input's where nothing was measured, and its
/// comment lines.
pub fn measured_host(cluster: &Cluster, nvme_dir: Option<&Path>) -> anyhow::Result<String> {
    let input = &cluster.host;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("calibrate --host: AdamW on {threads} threads ...");
    let adamw = host::adamw_gparams_per_s(threads);
    let memory = host::memory_gib();
    let nvme = match nvme_dir {
        Some(dir) => {
            eprintln!(
                "calibrate --host: writing and reading {} MiB in {} (O_DIRECT) ...",
                host::NVME_BYTES >> 20,
                dir.display()
            );
            Some(host::nvme(dir).map_err(|e| {
                anyhow::anyhow!(
                    "--nvme-dir {}: the NVMe measurement failed: {e}\n  fix: pass a directory on the node's NVMe that this user can write, on a filesystem that supports O_DIRECT (not tmpfs), or drop --nvme-dir to keep the spec's NVMe",
                    dir.display()
                )
            })?)
        }
        None => None,
    };
    let h = Host {
        memory_gib: memory.map_or(input.memory_gib, |g| (g * 10.0).floor() / 10.0),
        link_gbps: input.link_gbps,
        nvme_gbps: nvme.map_or(input.nvme_gbps, |n| (n.gbps() * 100.0).round() / 100.0),
        nvme_gib: nvme.map_or(input.nvme_gib, |n| n.gib.floor()),
        adamw_gparams_per_s: (adamw * 1000.0).round() / 1000.0,
    };
    let mut notes = String::new();
    let _ = writeln!(
        notes,
        "# [host] measured on this machine by `tessera calibrate --host`:"
    );
    let _ = writeln!(
        notes,
        "# - memory_gib: {}",
        match memory {
            Some(_) => "MemTotal of /proc/meminfo".to_string(),
            None => "the input spec's (/proc/meminfo could not be read)".to_string(),
        }
    );
    let _ = writeln!(notes, "# - link_gbps: the input spec's (this command copies nothing to a GPU: nvbandwidth's host_to_device_memcpy measures it)");
    let _ = writeln!(
        notes,
        "# - adamw_gparams_per_s: the runtime's AdamW kernel on {threads} threads, {} Mi parameters each, the fastest of {} passes",
        host::ADAMW_PARAMS_PER_THREAD >> 20,
        host::ADAMW_PASSES
    );
    let _ = writeln!(
        notes,
        "# - nvme: {}",
        match (nvme, nvme_dir) {
            (Some(n), Some(d)) => format!(
                "{} written at {:.2} GB/s and read at {:.2} GB/s with O_DIRECT in {} (nvme_gbps is their harmonic mean); nvme_gib the size of its filesystem",
                mib(host::NVME_BYTES),
                n.write_gbps,
                n.read_gbps,
                d.display()
            ),
            _ => "the input spec's (no --nvme-dir)".to_string(),
        }
    );
    let mut table = h.toml_table("measured on this machine");
    if h.nvme_gib == 0.0 && h.nvme_gbps == 0.0 {
        // No NVMe stated: leave both keys out rather than write zeros a reader takes for a tier.
        table = table
            .lines()
            .filter(|l| !l.starts_with("nvme_"))
            .map(|l| format!("{l}\n"))
            .collect();
    }
    Ok(format!("{notes}{table}"))
}

fn mib(bytes: usize) -> String {
    format!("{} MiB", bytes >> 20)
}

/// This node's `[storage]` table, measured by writing to `dir`, with its comment lines.
pub fn measured_storage(dir: &Path) -> anyhow::Result<String> {
    use tessera_runtime::calibrate::storage;
    let writers = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!(
        "calibrate --storage: {} writers writing {} MiB in {} (each file fsynced) ...",
        writers,
        storage::STORAGE_BYTES >> 20,
        dir.display()
    );
    let gbps = storage::write_gbps(dir, storage::STORAGE_BYTES, writers).map_err(|e| {
        anyhow::anyhow!(
            "--storage {}: the write measurement failed: {e}\n  fix: pass an existing folder on the checkpoint filesystem that this user can write, with 1 GiB free",
            dir.display()
        )
    })?;
    let s = tessera_planner::spec::Storage {
        write_gbps: (gbps * 1000.0).round() / 1000.0,
    };
    Ok(format!(
        "# [storage] measured on this machine by `tessera calibrate --storage {}`: {} MiB written by\n# {writers} writers (one per core), each file fsynced, {:.3} GB/s to the last fsync\n{}",
        dir.display(),
        storage::STORAGE_BYTES >> 20,
        gbps,
        s.toml_table("measured on this machine")
    ))
}

/// `text` (a cluster spec) with its `[host]` table, if any, replaced by `table` at the end.
pub fn with_host(text: &str, table: &str) -> String {
    with_table(text, "host", table)
}

/// `text` (a cluster spec) with its `[name]` table, if any, replaced by `table` at the end.
pub fn with_table(text: &str, name: &str, table: &str) -> String {
    let header = format!("[{name}]");
    let mut out = String::new();
    let mut skipping = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with('[') {
            skipping = t.starts_with(&header);
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    format!("{}\n\n{table}", out.trim_end())
}

/// `text` (a calibrated spec) with the input's `[cost]`, `[reliability]` and `[storage]` tables,
/// where it states them: what the whole-run prediction reads, which a calibration measures
/// nothing of and must not drop.
pub fn with_whole_run_tables(text: &str, input: &Cluster) -> String {
    const OF: &str = "the input spec's";
    let tables = [
        ("cost", input.cost.map(|c| c.toml_table(OF))),
        ("reliability", input.reliability.map(|r| r.toml_table(OF))),
        ("storage", input.storage.map(|s| s.toml_table(OF))),
    ];
    let mut out = text.to_string();
    for (name, table) in tables {
        if let Some(table) = table {
            out = with_table(&out, name, &table);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_table_is_replaced_and_the_rest_kept() {
        let spec = "name = \"x\"\n[device]\nkind = \"gpu\"\n[host]\nmemory_gib = 1\n[overhead]\ncontext_gib = 0\n";
        let out = with_host(spec, "[host]\nmemory_gib = 2\n");
        assert!(out.contains("[device]\nkind = \"gpu\"\n[overhead]\ncontext_gib = 0"));
        assert!(!out.contains("memory_gib = 1"));
        assert!(out.ends_with("[host]\nmemory_gib = 2\n"));
    }
}
