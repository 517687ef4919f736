//! The host tier of a GPU node, measured on the machine this runs on (`tessera calibrate
//! --host`): its memory, the rate of the runtime's own AdamW on all its cores, and, given a
//! directory on the node's NVMe, that drive's sequential write and read rate with the page
//! cache bypassed (`O_DIRECT`) and the filesystem's size.

use std::path::Path;
use std::time::Instant;

use crate::backend::cpu::kernels::adamw_update;
use crate::backend::AdamWStep;

/// Parameters each thread updates per timed AdamW pass: 16 Mi, 256 MiB of fp32 state per
/// thread (parameter, gradient, m, v), far beyond any cache, as a model's shards are.
pub const ADAMW_PARAMS_PER_THREAD: usize = 1 << 24;

/// Timed passes of the AdamW measurement; the fastest is kept (a pass slowed by another
/// process says less about the host than the fastest does).
pub const ADAMW_PASSES: usize = 5;

/// Bytes the NVMe measurement writes and reads back.
pub const NVME_BYTES: usize = 1 << 30;

/// The host's memory, GiB (`MemTotal` of /proc/meminfo), where it can be read.
pub fn memory_gib() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / (1024.0 * 1024.0))
}

/// Billions of parameters per second that `threads` threads update together with the
/// runtime's AdamW kernel (`backend::cpu::kernels::adamw_update`, what the executor's host step
/// runs), each on its own 16 Mi parameters: the fastest of [`ADAMW_PASSES`] timed passes after
/// one untimed.
pub fn adamw_gparams_per_s(threads: usize) -> f64 {
    let threads = threads.max(1);
    let n = ADAMW_PARAMS_PER_THREAD;
    let mut states: Vec<[Vec<f32>; 4]> = (0..threads)
        .map(|t| {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i + t) % 97) as f32 * 1e-3 - 0.05)
                .collect();
            [vec![0.01; n], g, vec![0.0; n], vec![0.0; n]]
        })
        .collect();
    let mut best = f64::INFINITY;
    for pass in 0..=ADAMW_PASSES {
        let step = AdamWStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            t: pass as u64 + 1,
            grad_scale: 1.0,
        };
        let start = Instant::now();
        let step = &step;
        std::thread::scope(|s| {
            for [p, g, m, v] in states.iter_mut() {
                s.spawn(move || adamw_update(p, g, m, v, step));
            }
        });
        if pass > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    (threads * n) as f64 / best / 1e9
}

/// A drive's measured rates and the size of the filesystem it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nvme {
    pub write_gbps: f64,
    pub read_gbps: f64,
    pub gib: f64,
}

impl Nvme {
    /// The rate offload's equal volumes of reads and writes see: the harmonic mean
    /// 2rw/(r + w) (the time of a byte read plus a byte written, per two bytes).
    pub fn gbps(&self) -> f64 {
        2.0 * self.read_gbps * self.write_gbps / (self.read_gbps + self.write_gbps)
    }
}

/// Writes [`NVME_BYTES`] to a file in `dir` and reads them back, both with `O_DIRECT` (no page
/// cache), and removes it; the filesystem's size from `statvfs`.
#[cfg(unix)]
pub fn nvme(dir: &Path) -> std::io::Result<Nvme> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    const ALIGN: usize = 4096;
    const CHUNK: usize = 64 << 20;
    // O_DIRECT needs an aligned buffer: a Vec of 4 KiB blocks is aligned to its element.
    #[repr(C, align(4096))]
    #[derive(Clone, Copy)]
    struct Block([u8; ALIGN]);
    let mut blocks = vec![Block([0x5a; ALIGN]); CHUNK / ALIGN];
    let path = dir.join(format!(".tessera-nvme-probe-{}", std::process::id()));
    let result: std::io::Result<(f64, f64)> = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let start = Instant::now();
        for _ in 0..NVME_BYTES / CHUNK {
            // SAFETY: `blocks` is CHUNK bytes of plain data, viewed as bytes.
            let bytes = unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), CHUNK) };
            f.write_all(bytes)?;
        }
        f.sync_all()?;
        let write = start.elapsed().as_secs_f64();
        drop(f);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let start = Instant::now();
        for _ in 0..NVME_BYTES / CHUNK {
            // SAFETY: as above, mutably; any byte pattern is a valid Block.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), CHUNK) };
            f.read_exact(bytes)?;
        }
        let read = start.elapsed().as_secs_f64();
        Ok((write, read))
    })();
    let _ = std::fs::remove_file(&path);
    let (write, read) = result?;
    let gib = filesystem_gib(dir)?;
    Ok(Nvme {
        write_gbps: NVME_BYTES as f64 / write / 1e9,
        read_gbps: NVME_BYTES as f64 / read / 1e9,
        gib,
    })
}

#[cfg(not(unix))]
pub fn nvme(_dir: &Path) -> std::io::Result<Nvme> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "the NVMe measurement needs O_DIRECT (Linux)",
    ))
}

#[cfg(unix)]
fn filesystem_gib(dir: &Path) -> std::io::Result<f64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs writes the struct it is given; `c` is a valid NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_blocks as f64 * s.f_frsize as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_harmonic_mean_weighs_the_slower_direction() {
        let n = Nvme {
            write_gbps: 5.0,
            read_gbps: 10.0,
            gib: 1.0,
        };
        assert!((n.gbps() - 20.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn the_host_s_memory_is_read() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(memory_gib().is_some_and(|g| g > 0.0));
        }
    }
}
