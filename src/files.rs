//! Safe outputs, one rule for every subcommand that writes a file.
//!
//! - An output may not be one of the command's inputs, nor another output: files are compared
//!   by device and inode (so `./m.toml`, `m.toml`, a symlink to it and a hard link all match),
//!   and the error names both flags.
//! - A symlink is written through: its target changes, the link stays.
//! - A FIFO, a character or block device, and `-` (stdout) are written in place.
//! - A regular file (or a new one) is replaced atomically: the text goes to a uniquely named
//!   temporary file in the same folder (`tempfile::NamedTempFile`), which is fsynced and then
//!   renamed over the target. A failed write removes the temporary file and leaves the old file
//!   as it was.
//! - Streams (`--metrics`) are written a whole line at a time and flushed after each line; a
//!   failed write is an error at that line, naming the file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};

/// A file named on the command line, with the flag or argument that named it.
#[derive(Clone, Copy)]
pub struct Named<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
}

pub fn named<'a>(flag: &'a str, path: &'a Path) -> Named<'a> {
    Named { flag, path }
}

fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Device and inode of the file a path names (following symlinks), if it exists.
#[cfg(unix)]
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn identity(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok()
}

/// Refuses outputs that name an input file or another output, or that could not be written
/// (a folder, a missing or read-only folder): checked before the work, so that a long run
/// never ends in an output it cannot write.
pub fn check_outputs(inputs: &[Named], outputs: &[Named]) -> anyhow::Result<()> {
    let outputs: Vec<&Named> = outputs.iter().filter(|o| !is_stdout(o.path)).collect();
    for out in &outputs {
        check_writable(out)?;
    }
    for (i, out) in outputs.iter().enumerate() {
        let Some(id) = identity(out.path) else {
            // A new file cannot be an input; two new outputs with one name are caught by name.
            for other in &outputs[..i] {
                if other.path == out.path {
                    bail!(
                        "{} and {} both name {}\n  fix: give each output its own file",
                        other.flag,
                        out.flag,
                        out.path.display()
                    );
                }
            }
            continue;
        };
        for input in inputs {
            if identity(input.path).as_ref() == Some(&id) {
                bail!(
                    "{} {} is the same file as the input {} {}: writing it would destroy the input\n  fix: write the output to another file",
                    out.flag,
                    out.path.display(),
                    input.flag,
                    input.path.display()
                );
            }
        }
        for other in &outputs[..i] {
            if identity(other.path).as_ref() == Some(&id) {
                bail!(
                    "{} {} and {} {} are the same file\n  fix: give each output its own file",
                    other.flag,
                    other.path.display(),
                    out.flag,
                    out.path.display()
                );
            }
        }
    }
    Ok(())
}

/// The absolute path `path` names, its links and `..` resolved as far as it exists (the rest
/// appended as written).
fn absolute(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut p = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    loop {
        if let Ok(c) = std::fs::canonicalize(&p) {
            return rest.into_iter().rev().fold(c, |acc, part| acc.join(part));
        }
        match (p.file_name().map(|n| n.to_os_string()), p.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                p = parent.to_path_buf();
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Refuses outputs inside a checkpoint folder the command reads or writes (`folders`: the
/// flag, the folder, and "reads" or "writes"): a file there could replace part of a
/// checkpoint, or be pruned with it.
pub fn check_outside(outputs: &[Named], folders: &[(Named, &str)]) -> anyhow::Result<()> {
    for out in outputs.iter().filter(|o| !is_stdout(o.path)) {
        let at = absolute(&resolve_links(out.path)?);
        for (folder, verb) in folders {
            let dir = absolute(folder.path);
            if at.starts_with(&dir) {
                bail!(
                    "{} {} is inside {} {}, a checkpoint folder this run {verb}: the output could replace part of a checkpoint, or be removed with one\n  fix: write {} outside {}",
                    out.flag,
                    out.path.display(),
                    folder.flag,
                    folder.path.display(),
                    out.flag,
                    folder.path.display()
                );
            }
        }
    }
    Ok(())
}

/// Whether `out` can be written: a FIFO or device is left to the write itself; a regular or
/// new file needs its folder, where a probe file is created and removed.
fn check_writable(out: &Named) -> anyhow::Result<()> {
    let shown = out.path.display();
    match std::fs::metadata(out.path) {
        Ok(m) if m.is_dir() => bail!(
            "{} {shown} is a folder\n  fix: name a file, such as {}",
            out.flag,
            out.path.join("out").display()
        ),
        Ok(m) if !m.is_file() => return Ok(()),
        _ => {}
    }
    let target = resolve_links(out.path)?;
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    probe_dir(dir).map_err(|e| {
            anyhow!(
                "{} {shown}: cannot write in {}: {e}\n  fix: create the folder, or choose a writable one",
                out.flag,
                dir.display()
            )
        })
}

/// The path a chain of symlinks ends at (which need not exist yet).
fn resolve_links(path: &Path) -> anyhow::Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&p)
                    .with_context(|| format!("{}: cannot read the symlink", path.display()))?;
                p = match p.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            _ => return Ok(p),
        }
    }
    bail!(
        "{}: too many levels of symbolic links\n  fix: point the output at a file",
        path.display()
    )
}

fn write_error(path: &Path, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(
        "{}: cannot write: {e}\n  fix: check that the folder exists, is writable and has free space",
        path.display()
    )
}

/// Writes a whole output file by the rules of this module.
pub fn write_output(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if is_stdout(path) {
        let mut out = std::io::stdout().lock();
        return out
            .write_all(bytes)
            .and_then(|()| out.flush())
            .map_err(|e| write_error(Path::new("<stdout>"), e));
    }
    // What the path names after every link, as the kernel resolves it (this also follows the
    // magic links of /dev/stdout and /proc/self/fd, which name pipes, not paths).
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() && !m.is_dir() {
            return write_in_place(path, bytes);
        }
    }
    let target = resolve_links(path)?;
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => bail!(
            "{}: is a folder\n  fix: name a file, such as {}",
            path.display(),
            path.join("out").display()
        ),
        Ok(m) if !m.is_file() => write_in_place(&target, bytes),
        existing => replace_atomically(path, &target, bytes, existing.ok()),
    }
}

/// A FIFO, a device or a socket-like node: write into it, never replace the node.
fn write_in_place(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| write_error(path, e))?;
    f.write_all(bytes)
        .and_then(|()| f.flush())
        .map_err(|e| write_error(path, e))
}

fn replace_atomically(
    shown: &Path,
    target: &Path,
    bytes: &[u8],
    existing: Option<std::fs::Metadata>,
) -> anyhow::Result<()> {
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map_or("out".into(), |n| n.to_string_lossy().into_owned());
    let mut builder = tempfile::Builder::new();
    let prefix = format!(".{name}.");
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        // New files get 0666 less the umask, as `File::create` gives; a replaced file keeps
        // its mode.
        let mode = existing.as_ref().map_or(0o666, |m| m.permissions().mode());
        std::fs::Permissions::from_mode(mode)
    };
    #[cfg(unix)]
    builder.permissions(mode);
    let mut tmp = builder
        .tempfile_in(dir)
        .map_err(|e| write_error(shown, e))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.flush())
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| write_error(shown, e))?;
    tmp.persist(target)
        .map_err(|e| write_error(shown, e.error))?;
    // Make the rename itself durable; a folder that cannot be opened or synced is not an error.
    if let Ok(d) = File::open(dir) {
        d.sync_all().ok();
    }
    Ok(())
}

/// A line-oriented output stream (`--metrics`): each line is written whole and flushed.
pub struct LineStream {
    path: PathBuf,
    out: Box<dyn Write + Send>,
    line: Vec<u8>,
}

impl LineStream {
    /// Opens `path` for writing lines: `-` is stdout, a symlink is followed, a FIFO or device
    /// is written in place, a regular file is created or truncated.
    pub fn open(path: &Path) -> anyhow::Result<LineStream> {
        let out: Box<dyn Write + Send> = if is_stdout(path) {
            Box::new(std::io::stdout())
        } else {
            let special = std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir());
            let f = if special {
                OpenOptions::new().write(true).open(path)
            } else {
                File::create(resolve_links(path)?)
            };
            Box::new(f.map_err(|e| write_error(path, e))?)
        };
        Ok(LineStream {
            path: path.to_path_buf(),
            out,
            line: Vec::new(),
        })
    }

    /// A stream on a file the caller opened (a FIFO opened without blocking); `path` is named
    /// in errors.
    pub fn from_file(path: &Path, file: File) -> LineStream {
        LineStream {
            path: path.to_path_buf(),
            out: Box::new(file),
            line: Vec::new(),
        }
    }

    /// Writes one line (a newline is added) in one call and flushes it.
    pub fn line(&mut self, text: &str) -> anyhow::Result<()> {
        self.line.clear();
        self.line.extend_from_slice(text.as_bytes());
        self.line.push(b'\n');
        self.out
            .write_all(&self.line)
            .and_then(|()| self.out.flush())
            .map_err(|e| write_error(&self.path, e))
    }
}

/// Whether a file can be created in `dir`: a uniquely named probe file, removed at once.
pub fn probe_dir(dir: &Path) -> std::io::Result<()> {
    tempfile::Builder::new()
        .prefix(".tessera-probe.")
        .tempfile_in(dir)
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn leftovers(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn replaces_a_regular_file_and_leaves_no_temporary() {
        let d = dir();
        let p = d.path().join("out.json");
        std::fs::write(&p, "old").unwrap();
        write_output(&p, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(leftovers(d.path()), vec!["out.json"]);
    }

    #[cfg(unix)]
    #[test]
    fn writes_through_a_symlink() {
        let d = dir();
        let real = d.path().join("real.json");
        let link = d.path().join("link.json");
        std::fs::write(&real, "old").unwrap();
        std::os::unix::fs::symlink("real.json", &link).unwrap();
        write_output(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&real).unwrap(), "new");
    }

    #[cfg(unix)]
    #[test]
    fn a_dangling_symlink_creates_its_target() {
        let d = dir();
        let link = d.path().join("link.json");
        std::os::unix::fs::symlink("made.json", &link).unwrap();
        write_output(&link, b"x").unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("made.json")).unwrap(),
            "x"
        );
    }

    #[cfg(unix)]
    #[test]
    fn keeps_the_mode_of_a_replaced_file() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        let p = d.path().join("out.json");
        std::fs::write(&p, "old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_output(&p, b"new").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_device_is_written_in_place_and_a_full_one_is_an_error() {
        use std::os::unix::fs::FileTypeExt;
        let e = write_output(Path::new("/dev/full"), b"x").unwrap_err();
        assert!(e.to_string().contains("/dev/full"), "{e}");
        assert!(std::fs::metadata("/dev/full")
            .unwrap()
            .file_type()
            .is_char_device());
        write_output(Path::new("/dev/null"), b"x").unwrap();
    }

    #[test]
    fn a_failed_write_leaves_nothing_behind() {
        let d = dir();
        let p = d.path().join("missing-folder").join("out.json");
        assert!(write_output(&p, b"x").is_err());
        assert!(leftovers(d.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn outputs_may_not_name_inputs_by_any_path() {
        let d = dir();
        let input = d.path().join("m.toml");
        std::fs::write(&input, "x").unwrap();
        let hard = d.path().join("hard.toml");
        std::fs::hard_link(&input, &hard).unwrap();
        let link = d.path().join("link.toml");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let dotted = d.path().join(".").join("m.toml");
        for out in [&input, &hard, &link, &dotted] {
            let e = check_outputs(&[named("MODEL", &input)], &[named("-o", out)]).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("-o") && msg.contains("MODEL"), "{msg}");
        }
        let fresh = d.path().join("plan.json");
        check_outputs(&[named("MODEL", &input)], &[named("-o", &fresh)]).unwrap();
        let e = check_outputs(&[], &[named("-o", &fresh), named("--trace", &fresh)]).unwrap_err();
        assert!(e.to_string().contains("--trace"), "{e}");
    }

    #[test]
    fn stream_lines_are_whole() {
        let d = dir();
        let p = d.path().join("m.jsonl");
        let mut s = LineStream::open(&p).unwrap();
        s.line("{\"step\":0}").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"step\":0}\n");
        s.line("{\"step\":1}").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"step\":0}\n{\"step\":1}\n"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_stream_fails_at_the_line_naming_the_file() {
        let mut s = LineStream::open(Path::new("/dev/full")).unwrap();
        let e = s.line("x").unwrap_err();
        assert!(e.to_string().contains("/dev/full"), "{e}");
    }
}
