//! The on-disk format: file names, the segment header, record framing and the
//! `format` marker file. Pure functions only (no I/O), so they are unit-tested here.
//!
//! All integers are little-endian. See the crate doc for the full layout.

use std::path::{Path, PathBuf};

/// Per-shard record offset: 0, 1, 2, … dense within a shard.
pub type Offset = u64;

/// Direct-I/O alignment of every write position and length, in bytes.
pub const ALIGN: usize = 4096;
/// Size of the segment header block at byte 0 of every `.seg` file, in bytes.
pub const SEG_HEADER_BYTES: usize = 4096;
/// Bytes of the fixed record head (len, crc, offset, flags, kind, reserved, header_len).
pub const RECORD_HEAD_BYTES: usize = 24;
/// Largest `header` accepted by `append`, in bytes (1 MiB).
pub const MAX_HEADER_BYTES: usize = 1 << 20;
/// Largest `body` accepted by `append`, in bytes (128 MiB).
pub const MAX_BODY_BYTES: usize = 128 << 20;
/// Largest framed record, in bytes.
pub const MAX_RECORD_BYTES: usize = RECORD_HEAD_BYTES + MAX_HEADER_BYTES + MAX_BODY_BYTES;
/// Format version written in the marker file, segment headers and side files.
pub const FORMAT_VERSION: u32 = 1;
/// Record kind byte of a data record (the only kind in version 1).
pub const RECORD_KIND_DATA: u8 = 1;

/// Magic of a segment header.
pub const SEG_MAGIC: &[u8; 8] = b"RMQSEG\0\x01";
/// Magic of an index file header.
pub const IDX_MAGIC: &[u8; 8] = b"RMQIDX\0\x01";
/// Magic of a deletion-bitmap file header.
pub const DEL_MAGIC: &[u8; 8] = b"RMQDEL\0\x01";
/// Bytes of the header of `.idx` and `.del` files (one page, so the entries/bits
/// that follow are page-aligned).
pub const SIDE_HEADER_BYTES: usize = 4096;
/// Name of the marker file written first in every shard directory.
pub const FORMAT_FILE: &str = "format";
/// First line of the marker file; the file is padded with zeros to [`ALIGN`] bytes.
pub const FORMAT_LINE: &str = "ringmq-shard format 1\n";

/// Kind of a per-segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// Record data, written with direct I/O.
    Seg,
    /// Offset index (u32 position per record), memory-mapped.
    Idx,
    /// Deletion bitmap (1 bit per record, 1 = deleted), memory-mapped.
    Del,
}

impl FileKind {
    fn ext(self) -> &'static str {
        match self {
            FileKind::Seg => "seg",
            FileKind::Idx => "idx",
            FileKind::Del => "del",
        }
    }
}

/// Path of a segment's file: `<dir>/<base as 20 decimal digits>.<seg|idx|del>`.
pub fn seg_path(dir: &Path, base: Offset, kind: FileKind) -> PathBuf {
    dir.join(format!("{base:020}.{}", kind.ext()))
}

/// Parses a file name made by [`seg_path`]; `None` for any other name.
pub fn parse_seg_name(name: &str) -> Option<(Offset, FileKind)> {
    let (stem, ext) = name.split_once('.')?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let kind = match ext {
        "seg" => FileKind::Seg,
        "idx" => FileKind::Idx,
        "del" => FileKind::Del,
        _ => return None,
    };
    Some((stem.parse().ok()?, kind))
}

/// Rounds `v` up to a multiple of [`ALIGN`].
pub fn align_up(v: u64) -> u64 {
    (v + ALIGN as u64 - 1) & !(ALIGN as u64 - 1)
}

/// Rounds `v` down to a multiple of [`ALIGN`].
pub fn align_down(v: u64) -> u64 {
    v & !(ALIGN as u64 - 1)
}

/// The 4096-byte segment header: magic, version, header size, base offset,
/// configured segment size, CRC32 of bytes 0..32.
pub fn encode_seg_header(base: Offset, segment_bytes: u64, out: &mut [u8]) {
    out[..SEG_HEADER_BYTES].fill(0);
    out[0..8].copy_from_slice(SEG_MAGIC);
    out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(SEG_HEADER_BYTES as u32).to_le_bytes());
    out[16..24].copy_from_slice(&base.to_le_bytes());
    out[24..32].copy_from_slice(&segment_bytes.to_le_bytes());
    let crc = crc32fast::hash(&out[0..32]);
    out[32..36].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a segment header; returns the base offset it names or why it is bad.
pub fn decode_seg_header(buf: &[u8]) -> Result<Offset, String> {
    if buf.len() < 36 {
        return Err(format!("segment header is {} bytes, need 36", buf.len()));
    }
    if &buf[0..8] != SEG_MAGIC {
        return Err("bad segment magic".into());
    }
    let crc = u32::from_le_bytes(buf[32..36].try_into().unwrap());
    if crc != crc32fast::hash(&buf[0..32]) {
        return Err("segment header CRC mismatch".into());
    }
    let version = u32::from_le_bytes(buf[8..12].try_into().unwrap());
    if version != FORMAT_VERSION {
        return Err(format!("unsupported segment version {version} (this build reads {FORMAT_VERSION})"));
    }
    Ok(u64::from_le_bytes(buf[16..24].try_into().unwrap()))
}

/// Framed length of a record with these parts, in bytes.
pub fn record_len(header_len: usize, body_len: usize) -> usize {
    RECORD_HEAD_BYTES + header_len + body_len
}

/// The 24-byte record head for `offset`/`flags`/`header`/`body`, CRC included.
///
/// Layout: `len u32 | crc u32 | offset u64 | flags u8 | kind u8 | 0u16 | header_len u32`;
/// the CRC32 (IEEE, crc32fast) covers bytes 8.. of the record (head tail, header, body).
pub fn encode_record_head(offset: Offset, flags: u8, header: &[u8], body: &[u8]) -> [u8; RECORD_HEAD_BYTES] {
    let mut h = [0u8; RECORD_HEAD_BYTES];
    let len = record_len(header.len(), body.len()) as u32;
    h[0..4].copy_from_slice(&len.to_le_bytes());
    h[8..16].copy_from_slice(&offset.to_le_bytes());
    h[16] = flags;
    h[17] = RECORD_KIND_DATA;
    h[20..24].copy_from_slice(&(header.len() as u32).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[8..24]);
    crc.update(header);
    crc.update(body);
    h[4..8].copy_from_slice(&crc.finalize().to_le_bytes());
    h
}

/// A record parsed from bytes (borrowing them).
#[derive(Debug, PartialEq, Eq)]
pub struct RawRecord<'a> {
    /// Offset stored in the record.
    pub offset: Offset,
    /// Flags byte.
    pub flags: u8,
    /// Opaque header bytes.
    pub header: &'a [u8],
    /// Opaque body bytes.
    pub body: &'a [u8],
    /// Framed length, in bytes.
    pub len: usize,
}

/// Outcome of parsing at one position.
#[derive(Debug, PartialEq, Eq)]
pub enum Parse<'a> {
    /// A whole, CRC-valid record.
    Record(RawRecord<'a>),
    /// Zero length field: the end of written data (padding).
    End,
    /// The length field says `need` bytes but fewer are available.
    Short {
        /// Framed length claimed by the record, in bytes.
        need: usize,
    },
    /// Bytes that are not a valid record (why).
    Bad(String),
}

/// Parses one record at the start of `buf`.
pub fn parse_record(buf: &[u8]) -> Parse<'_> {
    if buf.len() < 4 {
        return if buf.iter().all(|&b| b == 0) { Parse::End } else { Parse::Short { need: RECORD_HEAD_BYTES } };
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().unwrap()) as usize;
    if len == 0 {
        return Parse::End;
    }
    if !(RECORD_HEAD_BYTES..=MAX_RECORD_BYTES).contains(&len) {
        return Parse::Bad(format!("record length {len} out of range"));
    }
    if buf.len() < len {
        return Parse::Short { need: len };
    }
    let rec = &buf[..len];
    let crc = u32::from_le_bytes(rec[4..8].try_into().unwrap());
    if crc != crc32fast::hash(&rec[8..]) {
        return Parse::Bad("CRC mismatch".into());
    }
    if rec[17] != RECORD_KIND_DATA {
        return Parse::Bad(format!("unknown record kind {}", rec[17]));
    }
    let hlen = u32::from_le_bytes(rec[20..24].try_into().unwrap()) as usize;
    if hlen > len - RECORD_HEAD_BYTES {
        return Parse::Bad(format!("header length {hlen} exceeds record length {len}"));
    }
    Parse::Record(RawRecord {
        offset: u64::from_le_bytes(rec[8..16].try_into().unwrap()),
        flags: rec[16],
        header: &rec[RECORD_HEAD_BYTES..RECORD_HEAD_BYTES + hlen],
        body: &rec[RECORD_HEAD_BYTES + hlen..],
        len,
    })
}

/// What a record head says, read without the rest of the record: `(len, offset, flags)`.
///
/// `None` if `buf` is shorter than [`RECORD_HEAD_BYTES`], the length field is out of range,
/// or the kind is not a data record. The CRC is not checked (it covers the whole record):
/// recovery uses this to learn the flags of a sealed segment's records without reading
/// their bodies, and a caller must compare `len` and `offset` with what it expects.
pub fn parse_record_head(buf: &[u8]) -> Option<(usize, Offset, u8)> {
    if buf.len() < RECORD_HEAD_BYTES {
        return None;
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().unwrap()) as usize;
    if !(RECORD_HEAD_BYTES..=MAX_RECORD_BYTES).contains(&len) || buf[17] != RECORD_KIND_DATA {
        return None;
    }
    Some((len, u64::from_le_bytes(buf[8..16].try_into().unwrap()), buf[16]))
}

/// Content of the `format` marker file: [`FORMAT_LINE`] padded with zeros to [`ALIGN`] bytes.
pub fn format_file_bytes() -> Vec<u8> {
    let mut v = vec![0u8; ALIGN];
    v[..FORMAT_LINE.len()].copy_from_slice(FORMAT_LINE.as_bytes());
    v
}

/// Checks the marker file content; `Err(why)` if it is another format or version.
pub fn check_format_file(buf: &[u8]) -> Result<(), String> {
    let line_end = buf.iter().position(|&b| b == b'\n').map(|p| p + 1).unwrap_or(buf.len());
    let line = String::from_utf8_lossy(&buf[..line_end]);
    if line == FORMAT_LINE {
        Ok(())
    } else {
        Err(format!("expected {FORMAT_LINE:?}, found {:?}", line.chars().take(64).collect::<String>()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(offset: u64, flags: u8, h: &[u8], b: &[u8]) -> Vec<u8> {
        let mut v = encode_record_head(offset, flags, h, b).to_vec();
        v.extend_from_slice(h);
        v.extend_from_slice(b);
        v
    }

    #[test]
    fn record_roundtrip() {
        let v = frame(42, 3, b"hdr", b"body!");
        match parse_record(&v) {
            Parse::Record(r) => {
                assert_eq!((r.offset, r.flags, r.header, r.body, r.len), (42, 3, &b"hdr"[..], &b"body!"[..], v.len()));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn record_head_alone() {
        let v = frame(42, 5, b"hdr", b"body!");
        assert_eq!(parse_record_head(&v[..RECORD_HEAD_BYTES]), Some((v.len(), 42, 5)));
        assert_eq!(parse_record_head(&v[..RECORD_HEAD_BYTES - 1]), None);
        assert_eq!(parse_record_head(&[0u8; RECORD_HEAD_BYTES]), None, "a zero length is no record");
        let mut w = v.clone();
        w[17] = 9;
        assert_eq!(parse_record_head(&w), None, "unknown kind");
    }

    #[test]
    fn corrupt_and_short_and_end() {
        let mut v = frame(1, 0, b"", b"abc");
        assert_eq!(parse_record(&v[..10]), Parse::Short { need: v.len() });
        let last = v.len() - 1;
        v[last] ^= 1;
        assert!(matches!(parse_record(&v), Parse::Bad(_)));
        assert_eq!(parse_record(&[0u8; 100]), Parse::End);
        assert!(matches!(parse_record(&[0xff; 100]), Parse::Bad(_)));
    }

    #[test]
    fn names_and_headers() {
        let p = seg_path(Path::new("/d"), 77, FileKind::Idx);
        assert_eq!(p, Path::new("/d/00000000000000000077.idx"));
        assert_eq!(parse_seg_name("00000000000000000077.idx"), Some((77, FileKind::Idx)));
        assert_eq!(parse_seg_name("format"), None);
        assert_eq!(parse_seg_name("0077.seg"), None);
        let mut h = vec![0u8; SEG_HEADER_BYTES];
        encode_seg_header(99, 1 << 20, &mut h);
        assert_eq!(decode_seg_header(&h), Ok(99));
        h[20] ^= 1;
        assert!(decode_seg_header(&h).is_err());
        assert!(check_format_file(&format_file_bytes()).is_ok());
        assert!(check_format_file(b"ringmq-shard format 2\n").is_err());
        assert_eq!((align_up(1), align_up(4096), align_down(4097)), (4096, 4096, 4096));
    }
}
