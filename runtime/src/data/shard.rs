//! llm.c's token shard format (`dev/data/data_common.py`, `write_datafile`), read and written.
//!
//! A shard is a header of 256 little-endian int32s, then the tokens:
//! - `header[0]`: the magic, 20240520 for GPT-2's uint16 tokens (version 1, `header[1]`), or
//!   20240801 for llm.c's Llama-3 uint32 tokens (version 7);
//! - `header[2]`: the number of tokens after the 1024 header bytes;
//! - the rest of the header is zero.
//!
//! llm.c's own loader (`llmc/dataloader.h`) reads only the GPT-2 kind; its preparation scripts
//! write both. Tessera reads both and writes uint16 shards when every id fits 16 bits.

use std::io::Write;

/// Bytes of the header: 256 int32s.
pub const HEADER_BYTES: usize = 256 * 4;
/// llm.c's magic of GPT-2 (uint16) shards.
pub const MAGIC_U16: i32 = 20240520;
/// Their version.
pub const VERSION_U16: i32 = 1;
/// llm.c's magic of Llama-3 (uint32) shards.
pub const MAGIC_U32: i32 = 20240801;
/// Their version.
pub const VERSION_U32: i32 = 7;

/// Bytes per token of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    U16,
    U32,
}

impl Width {
    pub fn bytes(self) -> usize {
        match self {
            Width::U16 => 2,
            Width::U32 => 4,
        }
    }

    /// The narrowest width that holds every id below `vocab`.
    pub fn for_vocab(vocab: u64) -> Width {
        if vocab <= 1 << 16 {
            Width::U16
        } else {
            Width::U32
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Width::U16 => "uint16",
            Width::U32 => "uint32",
        }
    }
}

/// Whether a file's first four bytes are one of llm.c's token-shard magics.
pub fn has_magic(first: &[u8]) -> bool {
    first.len() >= 4 && {
        let m = i32::from_le_bytes([first[0], first[1], first[2], first[3]]);
        m == MAGIC_U16 || m == MAGIC_U32
    }
}

/// What a shard's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub width: Width,
    pub tokens: u64,
}

/// Reads and checks a shard's header against the file's size. The error is the problem and
/// its fix, without the file's name (the caller adds it).
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<Header, (String, String)> {
    let remake = "re-create the shard (`tessera data prepare`, or llm.c's dev/data scripts)";
    if bytes.len() < HEADER_BYTES {
        return Err((
            format!(
                "{} bytes is shorter than an llm.c shard's header of {HEADER_BYTES} bytes (truncated?)",
                bytes.len()
            ),
            remake.into(),
        ));
    }
    let int = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let (magic, version, count) = (int(0), int(1), int(2));
    let width = match (magic, version) {
        (MAGIC_U16, VERSION_U16) => Width::U16,
        (MAGIC_U32, VERSION_U32) => Width::U32,
        (MAGIC_U16 | MAGIC_U32, v) => {
            return Err((
                format!(
                    "unknown llm.c shard version {v} for magic {magic} (known: {MAGIC_U16} version {VERSION_U16}, uint16 tokens; {MAGIC_U32} version {VERSION_U32}, uint32 tokens)"
                ),
                remake.into(),
            ))
        }
        _ => {
            return Err((
                format!(
                    "wrong magic {magic}: an llm.c shard starts with {MAGIC_U16} (uint16 tokens) or {MAGIC_U32} (uint32 tokens)"
                ),
                "pass an llm.c shard, or drop --data-format llmc to read the file as headerless tokens (nanoGPT's .bin)".into(),
            ))
        }
    };
    if count < 0 {
        return Err((
            format!("the header's token count is negative ({count})"),
            remake.into(),
        ));
    }
    let tokens = count as u64;
    let body = file_len.saturating_sub(HEADER_BYTES as u64);
    let held = body / width.bytes() as u64;
    if held != tokens || !body.is_multiple_of(width.bytes() as u64) {
        let partial = if !body.is_multiple_of(width.bytes() as u64) {
            format!(" and {} stray bytes", body % width.bytes() as u64)
        } else {
            String::new()
        };
        let why = if held < tokens {
            " (truncated?)"
        } else {
            " (bytes appended after the tokens?)"
        };
        return Err((
            format!("the header says {tokens} tokens, the file holds {held}{partial}{why}"),
            remake.into(),
        ));
    }
    Ok(Header { width, tokens })
}

/// The 1024 header bytes of a shard of `tokens` tokens of `width`.
pub fn header_bytes(width: Width, tokens: u64) -> [u8; HEADER_BYTES] {
    let (magic, version) = match width {
        Width::U16 => (MAGIC_U16, VERSION_U16),
        Width::U32 => (MAGIC_U32, VERSION_U32),
    };
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&magic.to_le_bytes());
    h[4..8].copy_from_slice(&version.to_le_bytes());
    h[8..12].copy_from_slice(&(tokens as i32).to_le_bytes());
    h
}

/// The most tokens one shard may hold (the header's count is an int32).
pub const MAX_SHARD_TOKENS: u64 = i32::MAX as u64;

/// Writes a whole shard: header, then the tokens little-endian. Every id must fit `width`
/// (the caller chose it from the vocabulary), and there are at most [`MAX_SHARD_TOKENS`].
pub fn write_shard<W: Write>(out: &mut W, tokens: &[u32], width: Width) -> std::io::Result<()> {
    assert!(tokens.len() as u64 <= MAX_SHARD_TOKENS, "shard too large");
    out.write_all(&header_bytes(width, tokens.len() as u64))?;
    let mut buf = Vec::with_capacity(64 * 1024);
    for chunk in tokens.chunks(16 * 1024) {
        buf.clear();
        match width {
            Width::U16 => {
                for &t in chunk {
                    debug_assert!(t <= u32::from(u16::MAX));
                    buf.extend_from_slice(&(t as u16).to_le_bytes());
                }
            }
            Width::U32 => {
                for &t in chunk {
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        out.write_all(&buf)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(tokens: &[u32], width: Width) -> Vec<u8> {
        let mut v = Vec::new();
        write_shard(&mut v, tokens, width).unwrap();
        v
    }

    #[test]
    fn a_written_shard_has_llmc_header_and_little_endian_tokens() {
        let v = shard(&[1, 258, 65535], Width::U16);
        assert_eq!(v.len(), 1024 + 6);
        // 20240520 = 0x0134_D888; version 1; count 3; zeros after.
        assert_eq!(&v[..12], &[0x88, 0xd8, 0x34, 0x01, 1, 0, 0, 0, 3, 0, 0, 0]);
        assert!(v[12..1024].iter().all(|b| *b == 0));
        assert_eq!(&v[1024..], &[1, 0, 2, 1, 255, 255]);
        let h = parse_header(&v, v.len() as u64).unwrap();
        assert_eq!(
            h,
            Header {
                width: Width::U16,
                tokens: 3
            }
        );
        let w = shard(&[70000], Width::U32);
        assert_eq!(&w[..8], &[0xa1, 0xd9, 0x34, 0x01, 7, 0, 0, 0]);
        assert_eq!(parse_header(&w, w.len() as u64).unwrap().width, Width::U32);
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let v = shard(&[1, 2, 3], Width::U16);
        let (p, _) = parse_header(&v, v.len() as u64 - 2).unwrap_err();
        assert!(
            p.contains("header says 3 tokens, the file holds 2") && p.contains("truncated"),
            "{p}"
        );
        let (p, _) = parse_header(&v, v.len() as u64 + 2).unwrap_err();
        assert!(p.contains("the file holds 4"), "{p}");
        let mut bad = v.clone();
        bad[4] = 3;
        let (p, _) = parse_header(&bad, v.len() as u64).unwrap_err();
        assert!(p.contains("unknown llm.c shard version 3"), "{p}");
        bad[0] = 0;
        let (p, _) = parse_header(&bad, v.len() as u64).unwrap_err();
        assert!(p.contains("wrong magic"), "{p}");
        let (p, _) = parse_header(&v[..100], 100).unwrap_err();
        assert!(p.contains("shorter than"), "{p}");
        assert!(has_magic(&v) && !has_magic(&[0, 0, 0, 0]) && !has_magic(&v[..2]));
    }
}
