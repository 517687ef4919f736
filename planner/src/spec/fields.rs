//! Reading typed, located fields out of a parsed TOML spec.
//!
//! The raw spec structs keep each value as `Spanned<…>` so that semantic errors (a zero, a
//! negative, an unknown enum value) point at the exact line and column. Required keys are
//! `Option`s checked here, because toml reports a missing field at line 1, column 1.

use serde::Deserialize;
use toml::Spanned;

use crate::error::Diagnostic;
use crate::source::{near_key, Source};

/// A TOML number: integers are accepted where a float is expected (`memory_gib = 80`).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Num {
    Int(i64),
    Float(f64),
}

impl Num {
    pub fn as_f64(self) -> f64 {
        match self {
            Num::Int(i) => i as f64,
            Num::Float(f) => f,
        }
    }
}

pub type Field<T> = Option<Spanned<T>>;

/// Field access for one source file.
pub struct Fields<'a> {
    pub src: &'a Source,
}

impl<'a> Fields<'a> {
    pub fn err(
        &self,
        span: Option<std::ops::Range<usize>>,
        field: &str,
        problem: impl Into<String>,
        fix: impl Into<String>,
    ) -> Diagnostic {
        Diagnostic::new(&self.src.path, field, problem, fix).at(self.src.locate(span))
    }

    fn missing(&self, table: &str, field: &str, hint: &str) -> Diagnostic {
        let loc = if table.is_empty() {
            Some((1, 1))
        } else {
            self.src.table_header(table)
        };
        let path = dotted(table, field);
        let where_ = if table.is_empty() {
            "at the top of the file".to_string()
        } else {
            format!("under [{table}]")
        };
        Diagnostic::new(
            &self.src.path,
            &path,
            format!("required key `{field}` is missing"),
            format!("add `{field} = {hint}` {where_}"),
        )
        .at(loc)
    }

    /// A required positive integer.
    pub fn pos_int(
        &self,
        table: &str,
        field: &str,
        v: &Field<i64>,
        hint: &str,
    ) -> Result<u64, Diagnostic> {
        match v {
            None => Err(self.missing(table, field, hint)),
            Some(s) => self.check_pos(table, field, s),
        }
    }

    /// An optional positive integer.
    pub fn opt_pos_int(
        &self,
        table: &str,
        field: &str,
        v: &Field<i64>,
    ) -> Result<Option<u64>, Diagnostic> {
        v.as_ref()
            .map(|s| self.check_pos(table, field, s))
            .transpose()
    }

    /// An optional integer that may be zero but not negative.
    pub fn opt_nonneg_int(
        &self,
        table: &str,
        field: &str,
        v: &Field<i64>,
    ) -> Result<Option<u64>, Diagnostic> {
        v.as_ref()
            .map(|s| {
                let value = *s.get_ref();
                if value < 0 {
                    return Err(self.err(
                        Some(s.span()),
                        &dotted(table, field),
                        format!("must be zero or a positive integer, found {value}"),
                        format!("set `{field}` to 0 or more"),
                    ));
                }
                Ok(value as u64)
            })
            .transpose()
    }

    /// An optional boolean.
    pub fn opt_bool(&self, v: &Field<bool>) -> Option<bool> {
        v.as_ref().map(|s| *s.get_ref())
    }

    fn check_pos(&self, table: &str, field: &str, s: &Spanned<i64>) -> Result<u64, Diagnostic> {
        let value = *s.get_ref();
        if value <= 0 {
            return Err(self.err(
                Some(s.span()),
                &dotted(table, field),
                format!("must be a positive integer, found {value}"),
                format!("set `{field}` to a value of at least 1"),
            ));
        }
        Ok(value as u64)
    }

    /// A required positive number (integer or float).
    pub fn pos_num(
        &self,
        table: &str,
        field: &str,
        v: &Field<Num>,
        hint: &str,
    ) -> Result<f64, Diagnostic> {
        match v {
            None => Err(self.missing(table, field, hint)),
            Some(s) => self.check_pos_num(table, field, s, false),
        }
    }

    /// An optional number that may be zero but not negative.
    pub fn opt_nonneg_num(
        &self,
        table: &str,
        field: &str,
        v: &Field<Num>,
    ) -> Result<Option<f64>, Diagnostic> {
        self.opt_num(table, field, v, true)
    }

    /// An optional positive number.
    pub fn opt_pos_num(
        &self,
        table: &str,
        field: &str,
        v: &Field<Num>,
    ) -> Result<Option<f64>, Diagnostic> {
        self.opt_num(table, field, v, false)
    }

    fn opt_num(
        &self,
        table: &str,
        field: &str,
        v: &Field<Num>,
        zero_ok: bool,
    ) -> Result<Option<f64>, Diagnostic> {
        v.as_ref()
            .map(|s| self.check_pos_num(table, field, s, zero_ok))
            .transpose()
    }

    fn check_pos_num(
        &self,
        table: &str,
        field: &str,
        s: &Spanned<Num>,
        zero_ok: bool,
    ) -> Result<f64, Diagnostic> {
        let value = s.get_ref().as_f64();
        let bad = !value.is_finite() || value < 0.0 || (!zero_ok && value == 0.0);
        if bad {
            let want = if zero_ok { "zero or more" } else { "positive" };
            return Err(self.err(
                Some(s.span()),
                &dotted(table, field),
                format!("must be a {want} number, found {value}"),
                format!("set `{field}` to a {want} number"),
            ));
        }
        Ok(value)
    }

    /// A required string.
    pub fn string(
        &self,
        table: &str,
        field: &str,
        v: &Field<String>,
        hint: &str,
    ) -> Result<String, Diagnostic> {
        match v {
            None => Err(self.missing(table, field, hint)),
            Some(s) if s.get_ref().trim().is_empty() => Err(self.err(
                Some(s.span()),
                &dotted(table, field),
                "must not be empty",
                format!("set `{field} = {hint}`"),
            )),
            Some(s) => Ok(s.get_ref().clone()),
        }
    }

    /// One of a fixed set of names.
    pub fn choice<T: Copy>(
        &self,
        table: &str,
        field: &str,
        v: &Field<String>,
        options: &[(&str, T)],
        default: Option<T>,
    ) -> Result<T, Diagnostic> {
        let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
        match v {
            None => default.ok_or_else(|| self.missing(table, field, &format!("\"{}\"", names[0]))),
            Some(s) => {
                let found = s.get_ref().as_str();
                if let Some((_, t)) = options.iter().find(|(n, _)| *n == found) {
                    return Ok(*t);
                }
                let fix = match near_key(found, &names) {
                    Some(k) => format!(
                        "did you mean \"{k}\"? The options are: {}",
                        names.join(" | ")
                    ),
                    None => format!("use one of: {}", names.join(" | ")),
                };
                Err(self.err(
                    Some(s.span()),
                    &dotted(table, field),
                    format!("unknown value \"{found}\""),
                    fix,
                ))
            }
        }
    }
}

pub fn dotted(table: &str, field: &str) -> String {
    if table.is_empty() {
        field.to_string()
    } else {
        format!("{table}.{field}")
    }
}

/// The `[table]` whose body holds `line` (1-based): the last header above it, or "" at the top.
fn table_above(src: &Source, line: usize) -> String {
    src.text
        .lines()
        .take(line.saturating_sub(1))
        .filter_map(|l| {
            let name = l.trim().strip_prefix('[')?.trim_start_matches('[');
            Some(name.split(']').next()?.trim().to_string())
        })
        .last()
        .unwrap_or_default()
}

/// The dotted key assigned on `line` (`architecture.hidden`), if that line is a `key = value`.
fn key_on_line(src: &Source, line: usize) -> Option<String> {
    let text = src.text.lines().nth(line.checked_sub(1)?)?;
    let (key, _) = text.split_once('=')?;
    let key = key.trim();
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    bare.then(|| dotted(&table_above(src, line), key))
}

/// Turns a toml parse or type error into a diagnostic; unknown keys get a near-key suggestion.
pub fn toml_error(src: &Source, e: &toml::de::Error, known_keys: &[&str]) -> Diagnostic {
    let message = e.message().trim().to_string();
    let location = src.locate(e.span());
    let line = location.map_or(0, |(l, _)| l);
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let found = rest.split('`').next().unwrap_or("");
        let options: Vec<&str> = message
            .split("expected ")
            .nth(1)
            .map(|list| list.split('`').skip(1).step_by(2).collect())
            .unwrap_or_default();
        let candidates = if options.is_empty() {
            known_keys.to_vec()
        } else {
            options.clone()
        };
        let fix = match near_key(found, &candidates) {
            Some(k) => format!("did you mean `{k}`? (keys are documented in specs/README.md)"),
            None => format!(
                "remove it; the keys allowed here are: {}",
                candidates.join(", ")
            ),
        };
        let field = dotted(&table_above(src, line), found);
        return Diagnostic::new(&src.path, field, format!("unknown key `{found}`"), fix)
            .at(location);
    }
    // A syntax or type error names no field: take the key assigned on the line it points at.
    let field = message
        .split('`')
        .nth(1)
        .filter(|_| message.contains("field"))
        .map(str::to_string)
        .or_else(|| key_on_line(src, line))
        .unwrap_or_else(|| "-".to_string());
    Diagnostic::new(
        &src.path,
        field,
        format!("invalid TOML: {message}"),
        "fix the syntax or the value's type at the location shown (see specs/README.md for each key's type)",
    )
    .at(location)
}
