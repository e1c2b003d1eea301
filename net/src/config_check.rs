//! `config check` for the services' TOML files: every unknown key, wrong type and missing field
//! with its line and column, not only the first one serde stops at; and where a key is, for
//! checks of what a value names (a file that is not there).

use serde::de::DeserializeOwned;
use std::ops::Range;
use toml::de::{DeTable, DeValue};

/// A problem in a config file, where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub column: usize,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.column, self.message)
    }
}

/// The most problems one check reports (a file of garbage stops there).
const MOST: usize = 64;

/// Reads `text` as a `T`, or gives every problem serde finds: after each one, the entry it
/// points at is blanked (offsets and lines stay) and the text read again, so an unknown key
/// does not hide a wrong type below it. A syntax error stops the search, as does a problem that
/// names no single entry (a missing field).
pub fn check<T: DeserializeOwned>(text: &str) -> Result<T, Vec<Finding>> {
    let mut text = text.to_string();
    let mut found = Vec::new();
    let sorted = |mut f: Vec<Finding>| {
        f.sort_by_key(|f| (f.line, f.column));
        f
    };
    while found.len() < MOST {
        let table = match DeTable::parse(&text) {
            Ok(t) => t,
            Err(e) => {
                found.push(finding(&text, e.span(), e.message()));
                return Err(sorted(found));
            }
        };
        let err = match toml::from_str::<T>(&text) {
            Ok(v) if found.is_empty() => return Ok(v),
            Ok(_) => return Err(sorted(found)),
            Err(e) => e,
        };
        found.push(finding(&text, err.span(), err.message()));
        // An empty span is a whole table's (a missing field): no entry to blank.
        let entry = err
            .span()
            .filter(|at| !at.is_empty())
            .and_then(|at| innermost_entry(table.get_ref(), &at));
        match entry {
            Some(r) => blank(&mut text, r),
            None => return Err(sorted(found)),
        }
    }
    Err(sorted(found))
}

/// The line and column where the entry `path` (keys from the top, e.g. `["broker",
/// "ca_file"]`) of `text` starts, if it is there.
pub fn position(text: &str, path: &[&str]) -> Option<(usize, usize)> {
    let table = DeTable::parse(text).ok()?;
    let mut t: &DeTable<'_> = table.get_ref();
    let (last, parents) = path.split_last()?;
    for p in parents {
        match t.get(*p)?.get_ref() {
            DeValue::Table(inner) => t = inner,
            _ => return None,
        }
    }
    let (k, _) = t.get_key_value(*last)?;
    Some(line_col(text, k.span().start))
}

/// A finding at the entry `keys` of `text` (the file's start when it is not there).
pub fn at_entry(text: &str, keys: &[&str], message: String) -> Finding {
    let (line, column) = position(text, keys).unwrap_or((1, 1));
    Finding {
        line,
        column,
        message,
    }
}

/// A finding for each entry of `text` (its keys, the path it names, and whether that is a
/// folder) whose file or folder is not there; `real` maps a configured path to where it is read
/// (systemd's `$CREDENTIALS_DIRECTORY`, say).
pub fn missing_files(
    text: &str,
    entries: &[(&[&str], Option<&std::path::Path>, bool)],
    real: impl Fn(&std::path::Path) -> std::path::PathBuf,
) -> Vec<Finding> {
    entries
        .iter()
        .filter_map(|&(keys, path, folder)| {
            let path = real(path?);
            let there = if folder {
                path.is_dir()
            } else {
                path.is_file()
            };
            let what = if folder { "folder" } else { "file" };
            let message = format!("`{}`: no {what} {}", keys.join("."), path.display());
            (!there).then(|| at_entry(text, keys, message))
        })
        .collect()
}

/// A shipped example config (`configs/*.toml`, whose paths point at the repository's `run/`
/// from `configs/`) as `config init` writes it: its paths relative to the written file.
pub fn example(shipped: &str) -> String {
    shipped.replace("../run/", "run/").replace(
        "# Relative paths are relative to this file's folder (here: ../run is the repository's run/).",
        "# Relative paths are relative to this file's folder.",
    )
}

/// `config init`: writes `text` to `out`, a file that must not exist yet (an existing config is
/// never overwritten), then says so and what to do next (`next`).
pub fn init_file(out: &std::path::Path, text: &str, next: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("creating {} (an existing file is kept): {e}", out.display()),
            )
        })?;
    f.write_all(text.as_bytes())?;
    crate::service::print_out(format_args!("wrote {}; {next}", out.display()))
}

/// `config check`'s output: `<file>: ok`, or one `<file>:<line>:<column>: <problem>` line per
/// finding; returns the process's exit status (0, or 2 when anything was found).
pub fn report<T>(
    config: &std::path::Path,
    checked: &Result<T, Vec<Finding>>,
) -> std::io::Result<i32> {
    match checked {
        Ok(_) => crate::service::print_out(format_args!("{}: ok", config.display())).map(|()| 0),
        Err(found) => {
            let text: Vec<String> = found
                .iter()
                .map(|f| format!("{}:{f}", config.display()))
                .collect();
            crate::service::print_out(text.join("\n")).map(|()| 2)
        }
    }
}

/// A finding at `span` of `text` (the start of the file when there is none).
fn finding(text: &str, span: Option<Range<usize>>, message: &str) -> Finding {
    let (line, column) = line_col(text, span.map_or(0, |s| s.start));
    Finding {
        line,
        column,
        message: message.trim().replace('\n', " "),
    }
}

/// 1-based line and column of byte `at` in `text`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let at = at.min(text.len());
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// The byte range (key to the end of its value) of the innermost `key = value` entry of `t`
/// whose key or value holds `at`'s start.
fn innermost_entry(t: &DeTable<'_>, at: &Range<usize>) -> Option<Range<usize>> {
    for (k, v) in t.iter() {
        let whole = k.span().start..v.span().end.max(k.span().end);
        let holds = |r: &Range<usize>| r.start <= at.start && at.start < r.end.max(r.start + 1);
        // An error about a whole table (a missing field) spans more than any one entry.
        if (!holds(&k.span()) && !holds(&v.span())) || at.end > whole.end {
            continue;
        }
        if let Some(inner) = inner_entry(v.get_ref(), at) {
            return Some(inner);
        }
        // A table's header spans only itself: the entry is a key, not the section.
        if matches!(v.get_ref(), DeValue::Table(_)) && v.span().start > k.span().end {
            return None;
        }
        return Some(whole);
    }
    // Entries of a [section] lie outside its header's span: look inside every table.
    t.iter().find_map(|(_, v)| inner_entry(v.get_ref(), at))
}

/// [`innermost_entry`] inside a table, or inside the tables of an array.
fn inner_entry(v: &DeValue<'_>, at: &Range<usize>) -> Option<Range<usize>> {
    match v {
        DeValue::Table(t) => innermost_entry(t, at),
        DeValue::Array(a) => a.iter().find_map(|i| inner_entry(i.get_ref(), at)),
        _ => None,
    }
}

/// Replaces the bytes of `range` with spaces, keeping its line breaks.
fn blank(text: &mut String, range: Range<usize>) {
    let range = range.start.min(text.len())..range.end.min(text.len());
    let spaced: String = text[range.clone()]
        .chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect();
    text.replace_range(range, &spaced);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        host: String,
        #[serde(default)]
        port: u16,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        #[serde(default)]
        threads: Option<usize>,
        broker: Inner,
    }

    #[test]
    fn every_unknown_key_and_wrong_type_is_named_with_its_line_and_column() {
        let text = "name = \"a\"\nthreds = 2\nthreads = \"two\"\n\n[broker]\nhost = \"h\"\nprot = 1\nport = -3\n";
        let found = check::<Outer>(text).unwrap_err();
        let at: Vec<(usize, usize)> = found.iter().map(|f| (f.line, f.column)).collect();
        assert_eq!(at, [(2, 1), (3, 11), (7, 1), (8, 8)], "{found:?}");
        assert!(
            found[0].message.contains("unknown field `threds`"),
            "{found:?}"
        );
        assert!(found[1].message.contains("invalid type"), "{found:?}");
        assert!(
            found[2].message.contains("unknown field `prot`"),
            "{found:?}"
        );
        assert!(found[3].message.contains("invalid value"), "{found:?}");
        assert_eq!(found[0].to_string(), format!("2:1: {}", found[0].message));
    }

    #[test]
    fn a_good_file_reads_and_a_syntax_error_or_a_missing_field_stops_the_search() {
        let good = "name = \"a\"\n[broker]\nhost = \"h\"\n";
        assert_eq!(check::<Outer>(good).unwrap().broker.host, "h");
        let found = check::<Outer>("name = \"a\"\nthreads = \n").unwrap_err();
        assert_eq!((found.len(), found[0].line), (1, 2), "{found:?}");
        let found = check::<Outer>("name = \"a\"\nwho = 1\n").unwrap_err();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].message.contains("missing field `broker`")
                && found[1].message.contains("unknown field `who`"),
            "{found:?}"
        );
        assert_eq!(position(good, &["broker", "host"]), Some((3, 1)));
        assert_eq!(position(good, &["name"]), Some((1, 1)));
        assert_eq!(position(good, &["broker", "port"]), None);
    }
}
