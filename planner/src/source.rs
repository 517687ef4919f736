//! A source file held in memory, for locating spans and suggesting near keys.
//!
//! Only text utilities live here: no parsing of specs.

use std::path::{Path, PathBuf};

use crate::error::Diagnostic;

/// The most bytes read from a spec, config or plan (the largest preset plan is well under
/// 1 MiB).
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// The text of an input file and its path.
#[derive(Debug, Clone)]
pub struct Source {
    pub path: PathBuf,
    pub text: String,
}

impl Source {
    /// Reads a file; a missing, unreadable, oversized or non-UTF-8 file becomes a diagnostic.
    /// At most [`MAX_INPUT_BYTES`] are read, so `/dev/zero` or a wrong multi-gigabyte file is
    /// refused at once instead of filling memory.
    pub fn read(path: &Path) -> Result<Source, Diagnostic> {
        use std::io::Read;
        let bad = |problem: String, fix: &str| Diagnostic::new(path, "-", problem, fix);
        let fix = "check the path; presets live in specs/models/ and specs/clusters/";
        let file = std::fs::File::open(path)
            .map_err(|e| bad(format!("cannot read the file: {e}"), fix))?;
        let mut bytes = Vec::new();
        file.take(MAX_INPUT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(format!("cannot read the file: {e}"), fix))?;
        if bytes.len() as u64 > MAX_INPUT_BYTES {
            return Err(bad(
                format!(
                    "the file is larger than {} MiB, far more than any spec or plan",
                    MAX_INPUT_BYTES >> 20
                ),
                "pass a model spec, a cluster spec or a plan.json",
            ));
        }
        let text = String::from_utf8(bytes).map_err(|e| {
            bad(
                format!(
                    "not UTF-8 text (byte {} is invalid)",
                    e.utf8_error().valid_up_to()
                ),
                "pass a TOML spec or a JSON plan or config, saved as UTF-8",
            )
        })?;
        Ok(Source {
            path: path.to_path_buf(),
            text,
        })
    }

    pub fn from_text(path: impl Into<PathBuf>, text: impl Into<String>) -> Source {
        Source {
            path: path.into(),
            text: text.into(),
        }
    }

    /// 1-based (line, column) of a byte offset.
    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }

    /// Location of a span, if any.
    pub fn locate(&self, span: Option<std::ops::Range<usize>>) -> Option<(usize, usize)> {
        span.map(|s| self.line_col(s.start))
    }

    /// Location of a `[table]` header, for errors about a key missing from it.
    pub fn table_header(&self, table: &str) -> Option<(usize, usize)> {
        let needle = format!("[{table}]");
        let mut offset = 0;
        for line in self.text.split_inclusive('\n') {
            if line.trim_start().starts_with(&needle) {
                return Some(self.line_col(offset));
            }
            offset += line.len();
        }
        None
    }
}

impl Source {
    /// Line and column of a dotted key (`device.memory_gib`) in TOML text: the `key =` line
    /// inside the `[table]` named by all but the last part, or the table's header if the key
    /// is not written there.
    pub fn toml_key(&self, dotted: &str) -> Option<(usize, usize)> {
        let (table, key) = dotted.rsplit_once('.').unwrap_or(("", dotted));
        let mut inside = table.is_empty();
        let mut offset = 0;
        for line in self.text.split_inclusive('\n') {
            let trimmed = line.trim_start();
            if trimmed.starts_with('[') {
                let name = trimmed
                    .trim_start_matches('[')
                    .split(']')
                    .next()
                    .unwrap_or("");
                inside = name.trim() == table;
            } else if inside {
                if let Some(rest) = trimmed.strip_prefix(key) {
                    if rest.trim_start().starts_with('=') {
                        let indent = line.len() - trimmed.len();
                        return Some(self.line_col(offset + indent));
                    }
                }
            }
            offset += line.len();
        }
        if table.is_empty() {
            None
        } else {
            self.table_header(table)
        }
    }

    /// Line and column of a key in JSON text, found by following a dotted path
    /// (`parallel.world`; an index such as `per_stage[2]` is located at its array's key): each
    /// part is the first `"key":` after the previous one.
    pub fn json_key(&self, dotted: &str) -> Option<(usize, usize)> {
        let mut from = 0;
        let mut start = None;
        for part in dotted.split('.') {
            let part = part.split('[').next().unwrap_or(part);
            let needle = format!("\"{part}\"");
            loop {
                let Some(at) = self.text.get(from..).and_then(|t| t.find(&needle)) else {
                    return start.map(|s| self.line_col(s));
                };
                let s = from + at;
                from = s + needle.len();
                if self.text[from..].trim_start().starts_with(':') {
                    start = Some(s);
                    break;
                }
            }
        }
        start.map(|s| self.line_col(s))
    }
}

/// The known key closest to `found` by edit distance, if it is plausibly a typo.
pub fn near_key<'a>(found: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(found, k), *k))
        .filter(|(d, k)| *d <= (k.len().max(found.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one() {
        let s = Source::from_text("x.toml", "a = 1\nbb = 2\n");
        assert_eq!(s.line_col(0), (1, 1));
        assert_eq!(s.line_col(6), (2, 1));
        assert_eq!(s.line_col(9), (2, 4));
    }

    #[test]
    fn toml_key_finds_the_line_inside_its_table() {
        let s = Source::from_text(
            "c.toml",
            "name = \"x\"\n[device]\nname = \"d\"\n  memory_gib = 80\n[overhead]\n",
        );
        assert_eq!(s.toml_key("name"), Some((1, 1)));
        assert_eq!(s.toml_key("device.name"), Some((3, 1)));
        assert_eq!(s.toml_key("device.memory_gib"), Some((4, 3)));
        // Not written: the table's header; no table: nothing.
        assert_eq!(s.toml_key("overhead.fragmentation"), Some((5, 1)));
        assert_eq!(s.toml_key("calibration.memory_efficiency"), None);
    }

    #[test]
    fn json_key_follows_the_path() {
        let s = Source::from_text(
            "p.json",
            "{\n \"a\": {\"world\": 1},\n \"b\": {\"world\": 2}\n}",
        );
        assert_eq!(s.json_key("b.world"), Some((3, 8)));
        assert_eq!(s.json_key("a.world"), Some((2, 8)));
        // A missing last part: where the path was last found.
        assert_eq!(s.json_key("b.nothing"), Some((3, 2)));
    }

    #[test]
    fn near_key_suggests_typos_only() {
        let keys = ["hidden", "heads", "kv_heads", "layers"];
        assert_eq!(near_key("hiden", &keys), Some("hidden"));
        assert_eq!(near_key("kv_head", &keys), Some("kv_heads"));
        assert_eq!(near_key("completely_else", &keys), None);
    }
}
