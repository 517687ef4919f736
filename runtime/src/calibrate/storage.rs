//! `tessera calibrate --storage DIR`: how fast this node writes a checkpoint to a folder. Each
//! of the node's writers (one per core, as a run's rank threads save their shards at once)
//! writes its share of [`STORAGE_BYTES`] to its own file through the page cache, then fsyncs
//! it, as a checkpoint save does (docs/checkpoints.md: each shard file written, fsynced, then
//! renamed); the rate is the bytes over the time until the last writer's fsync returns. The
//! files are removed after.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// Bytes written per measurement: 1 GiB, several times a small disk's write cache.
pub const STORAGE_BYTES: usize = 1 << 30;

/// GB/s this node wrote `bytes` to `dir` with `writers` threads (files written and fsynced).
pub fn write_gbps(dir: &Path, bytes: usize, writers: usize) -> std::io::Result<f64> {
    const CHUNK: usize = 8 << 20;
    let writers = writers.max(1);
    let share = (bytes / writers).max(CHUNK) / CHUNK * CHUNK;
    let paths: Vec<_> = (0..writers)
        .map(|w| dir.join(format!(".tessera-storage-probe-{}-{w}", std::process::id())))
        .collect();
    let chunk = vec![0x5au8; CHUNK];
    let start = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = paths
            .iter()
            .map(|p| {
                let chunk = &chunk;
                s.spawn(move || -> std::io::Result<()> {
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(p)?;
                    for _ in 0..share / CHUNK {
                        f.write_all(chunk)?;
                    }
                    f.sync_all()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a writer thread panicked")))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    for r in results {
        r?;
    }
    Ok((share * writers) as f64 / seconds / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_is_measured_and_left_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let gbps = write_gbps(dir.path(), 16 << 20, 2).unwrap();
        assert!(gbps > 0.0 && gbps.is_finite(), "{gbps}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(write_gbps(&dir.path().join("missing"), 16 << 20, 1).is_err());
    }
}
