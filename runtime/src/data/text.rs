//! What a text input is, read the same way by `tessera run --data` (and `--val-data`) and by
//! `tessera data prepare`: the encoding rule, a `.jsonl` file's documents, and the refusal of
//! an input with no text.
//!
//! The encoding rule: text is UTF-8, never read lossily. A UTF-8 byte-order mark is dropped.
//! Refused, naming the file, what it looks like and how to convert it: a UTF-16 or UTF-32
//! byte-order mark; NUL bytes in the pattern of UTF-16 or UTF-32 text without one (mostly ASCII
//! text leaves a NUL in the unused byte of each code unit); any other NUL byte (binary data);
//! and invalid UTF-8, at its first bad byte (offset and line).
//!
//! Documents: a `.jsonl` file's lines are JSON objects whose `"text"` string is one document
//! each (as Hugging Face data sets such as FineWeb ship them); blank lines and documents with
//! no text are left out (each would be a lone separator). Any other file is one document.
//!
//! No text: a file that is empty or only whitespace (after a byte-order mark), or a `.jsonl`
//! file with no document, is refused before any tokenizer sees it, so the message is the same
//! under every tokenizer; an input whose text the tokenizer turns into no token is refused too.

use std::borrow::Cow;

use super::prepare::encode_documents;
use super::tokenizer::Tokenizer;
use super::DataError;

fn invalid(path: &str, problem: String, fix: String) -> DataError {
    DataError::Invalid {
        path: path.to_string(),
        problem,
        fix,
    }
}

/// The fix for text in another encoding.
fn convert(path: &str, from: &str) -> String {
    format!(
        "convert it to UTF-8, e.g. `iconv -f {from} -t UTF-8 {path} > converted.txt`, and pass that file"
    )
}

/// What the NUL bytes among a file's first 64 KiB say: UTF-32 or UTF-16 text without a
/// byte-order mark, or neither. UTF-32: a NUL in at least half of the code units' three high
/// bytes, and in at most an eighth of their low byte. UTF-16: NULs in at least an eighth of
/// the code units' high bytes (at least two), and four times more than in their low bytes.
fn nul_pattern(bytes: &[u8]) -> Option<&'static str> {
    let sample = &bytes[..bytes.len().min(1 << 16)];
    let mut at = [0usize; 4];
    for (i, b) in sample.iter().enumerate() {
        if *b == 0 {
            at[i % 4] += 1;
        }
    }
    let quads = sample.len().div_ceil(4);
    let most = |n: usize| n * 2 >= quads;
    let few = |n: usize| n * 8 <= quads;
    if most(at[1]) && most(at[2]) && most(at[3]) && few(at[0]) {
        return Some("UTF-32LE");
    }
    if most(at[0]) && most(at[1]) && most(at[2]) && few(at[3]) {
        return Some("UTF-32BE");
    }
    let (even, odd) = (at[0] + at[2], at[1] + at[3]);
    let units = sample.len().div_ceil(2);
    // One NUL is no pattern.
    if odd >= 2 && odd * 8 >= units && odd > 4 * even {
        return Some("UTF-16LE");
    }
    if even >= 2 && even * 8 >= units && even > 4 * odd {
        return Some("UTF-16BE");
    }
    None
}

/// The text of a file's bytes, by the module's encoding rule; `path` names it in errors.
pub fn decode<'a>(path: &str, bytes: &'a [u8]) -> Result<&'a str, DataError> {
    const BOMS: [(&[u8], &str); 4] = [
        (&[0xff, 0xfe, 0, 0], "UTF-32LE"),
        (&[0, 0, 0xfe, 0xff], "UTF-32BE"),
        (&[0xff, 0xfe], "UTF-16LE"),
        (&[0xfe, 0xff], "UTF-16BE"),
    ];
    if let Some((bom, encoding)) = BOMS.iter().find(|(bom, _)| bytes.starts_with(bom)) {
        let mark: Vec<String> = bom.iter().map(|b| format!("{b:02X}")).collect();
        return Err(invalid(
            path,
            format!(
                "is {encoding} text (it starts with the byte-order mark {}), not UTF-8",
                mark.join(" ")
            ),
            // iconv reads the byte order from the mark.
            convert(path, &encoding[..6]),
        ));
    }
    let skipped = if bytes.starts_with(b"\xef\xbb\xbf") {
        3
    } else {
        0
    };
    let body = &bytes[skipped..];
    if let Some(first) = body.iter().position(|b| *b == 0) {
        return Err(match nul_pattern(body) {
            Some(encoding) => invalid(
                path,
                format!(
                    "looks like {encoding} text without a byte-order mark (NUL bytes in the unused bytes of its code units), not UTF-8"
                ),
                convert(path, encoding),
            ),
            None => invalid(
                path,
                format!(
                    "holds a NUL byte at byte {}, so it is not UTF-8 text",
                    first + skipped
                ),
                format!("pass UTF-8 text (UTF-16 or UTF-32 text converts with iconv, e.g. `iconv -f UTF-16LE -t UTF-8 {path} > converted.txt`); token files go to `tessera run --data` named .bin (uint16 LE, or an llm.c shard) or .u32 (uint32 LE)"),
            ),
        });
    }
    std::str::from_utf8(body).map_err(|e| {
        let at = e.valid_up_to();
        let line = body[..at].iter().filter(|b| **b == b'\n').count() + 1;
        invalid(
            path,
            format!(
                "not UTF-8 text: byte 0x{:02X} at byte {} (line {line}) is not valid UTF-8, and text is never read lossily",
                body[at],
                at + skipped
            ),
            format!(
                "convert it to UTF-8 from its encoding, e.g. `iconv -f LATIN1 -t UTF-8 {path} > converted.txt`; or, if it holds tokens, name it .bin (uint16 LE, or an llm.c shard) or .u32 (uint32 LE)"
            ),
        )
    })
}

fn is_jsonl(path: &str) -> bool {
    path.ends_with(".jsonl")
}

/// The refusal of an input with no text (the same under every tokenizer).
fn no_text(path: &str, what: &str) -> DataError {
    invalid(
        path,
        format!("holds no text ({what})"),
        "pass a file with text in it, or leave this one out".into(),
    )
}

/// The documents of an input's text (see the module's docs); an input with no text is
/// refused.
pub fn documents<'a>(path: &str, text: &'a str) -> Result<Vec<Cow<'a, str>>, DataError> {
    if text.trim().is_empty() {
        return Err(no_text(path, "it is empty, or only whitespace"));
    }
    if !is_jsonl(path) {
        return Ok(vec![Cow::Borrowed(text)]);
    }
    let mut docs = Vec::new();
    let mut lines = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        lines += 1;
        let bad = |problem: String| {
            invalid(
                &format!("{path}:{}", i + 1),
                problem,
                "give each line as a JSON object with a \"text\" string, or name the file other than .jsonl to read it as plain text".into(),
            )
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        match v.get("text").and_then(serde_json::Value::as_str) {
            Some(t) if t.trim().is_empty() => {}
            Some(t) => docs.push(Cow::Owned(t.to_string())),
            None => return Err(bad("no \"text\" string in this object".into())),
        }
    }
    if docs.is_empty() {
        return Err(no_text(
            path,
            &format!("the \"text\" of each of its {lines} lines is empty, or only whitespace"),
        ));
    }
    Ok(docs)
}

/// Refuses tokens of which none is text (`separators` of them are separators).
fn some_text(
    path: &str,
    tokenizer: &Tokenizer,
    ids: Vec<u32>,
    separators: usize,
) -> Result<Vec<u32>, DataError> {
    if ids.len() > separators {
        return Ok(ids);
    }
    Err(invalid(
        path,
        format!(
            "the {} tokenizer makes no token of its text",
            tokenizer.name()
        ),
        "pass text this tokenizer reads, another --tokenizer, or leave this file out".into(),
    ))
}

/// The tokens `tessera data prepare` writes for an input: each document after the
/// tokenizer's separator, if it has one.
pub fn tokens_to_prepare(
    path: &str,
    bytes: &[u8],
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>, DataError> {
    let docs = documents(path, decode(path, bytes)?)?;
    let ids = encode_documents(tokenizer, &docs)?;
    let separators = docs.len() * usize::from(tokenizer.separator().is_some());
    some_text(path, tokenizer, ids, separators)
}

/// The tokens `tessera run` trains on for a text file: a `.jsonl` file's exactly as
/// [`tokens_to_prepare`] makes them; any other text as one run of tokens without a separator
/// (as earlier versions read it, so their losses and checkpoints' fingerprints hold).
pub fn tokens_to_run(
    path: &str,
    bytes: &[u8],
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>, DataError> {
    if is_jsonl(path) {
        return tokens_to_prepare(path, bytes, tokenizer);
    }
    let text = decode(path, bytes)?;
    documents(path, text)?;
    some_text(path, tokenizer, tokenizer.encode(text)?, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_patterns_name_the_encoding() {
        let text = "Tokens of text, ünïcödé too.";
        let le: Vec<u8> = text.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let be: Vec<u8> = text.encode_utf16().flat_map(u16::to_be_bytes).collect();
        let le32: Vec<u8> = text
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect();
        let be32: Vec<u8> = text
            .chars()
            .flat_map(|c| (c as u32).to_be_bytes())
            .collect();
        assert_eq!(nul_pattern(&le), Some("UTF-16LE"));
        assert_eq!(nul_pattern(&be), Some("UTF-16BE"));
        assert_eq!(nul_pattern(&le32), Some("UTF-32LE"));
        assert_eq!(nul_pattern(&be32), Some("UTF-32BE"));
        assert_eq!(nul_pattern(b"abc\0def"), None);
        assert_eq!(nul_pattern(&[0; 64]), None);
    }
}
