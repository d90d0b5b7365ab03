//! The record format of `meta.log`, as [`DiskStorage`](super::storage::DiskStorage) writes and
//! replays it: framing, checksums, and the payload of each record kind. Pure byte work; the file
//! itself is handled in `storage.rs`.
//!
//! # Format
//! The magic `RMQMLOG1` (8 bytes), then records. A record is
//! `[payload length: u32 LE][crc32 of payload: u32 LE][payload]`; the payload's first byte is its
//! kind:
//! - `1` Entry: `index u64 LE, term u64 LE, entry type u8, context length varint, context,
//!   data` (data runs to the end of the payload; it is a command batch, see `codec.rs`);
//! - `2` HardState: `term u64 LE, vote u64 LE, commit u64 LE`;
//! - `3` ConfState: its protobuf encoding (raft-rs `eraftpb.ConfState`).

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, EntryType, HardState};

use super::wire::{put_varint, Reader};

pub(super) const LOG_MAGIC: &[u8; 8] = b"RMQMLOG1";
/// Record header: payload length (4 bytes) + crc32 (4 bytes).
pub(super) const RECORD_HEADER: usize = 8;
/// Largest payload a record may have (bytes); a larger length field is damage.
pub(super) const MAX_RECORD: usize = 256 << 20;

pub(super) const KIND_ENTRY: u8 = 1;
pub(super) const KIND_HARD_STATE: u8 = 2;
pub(super) const KIND_CONF_STATE: u8 = 3;

pub(super) enum RecordParse<'a> {
    Ok(&'a [u8]),
    Torn,
}

pub(super) fn parse_record(b: &[u8]) -> RecordParse<'_> {
    if b.len() < RECORD_HEADER {
        return RecordParse::Torn;
    }
    let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let crc = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    if len == 0 || len > MAX_RECORD || b.len() - RECORD_HEADER < len {
        return RecordParse::Torn;
    }
    let payload = &b[RECORD_HEADER..RECORD_HEADER + len];
    if crc32fast::hash(payload) != crc {
        return RecordParse::Torn;
    }
    RecordParse::Ok(payload)
}

/// True when a valid record starts anywhere after the bad record at the start of `b`: then the
/// damage is in the middle of the log, not a torn tail (an interrupted append leaves only a
/// prefix of its bytes, or zeros, never a valid record after an invalid one). Scans byte by
/// byte; candidates must have a plausible length and kind before their CRC is computed, and
/// the CRC work is capped (past the cap the log counts as damaged: refuse rather than guess).
pub(super) fn valid_record_follows(b: &[u8]) -> bool {
    const CRC_BUDGET: usize = 256 << 20;
    let mut spent = 0usize;
    for p in 1..b.len().saturating_sub(RECORD_HEADER) {
        let c = &b[p..];
        let len = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        if len == 0 || len > MAX_RECORD || c.len() - RECORD_HEADER < len {
            continue;
        }
        if !matches!(c[RECORD_HEADER], KIND_ENTRY | KIND_HARD_STATE | KIND_CONF_STATE) {
            continue;
        }
        spent += len;
        if spent > CRC_BUDGET {
            return true;
        }
        if matches!(parse_record(c), RecordParse::Ok(_)) {
            return true;
        }
    }
    false
}

pub(super) fn begin_record(out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEADER]);
    at
}

pub(super) fn end_record(out: &mut [u8], at: usize) {
    let payload = &out[at + RECORD_HEADER..];
    let len = payload.len() as u32;
    let crc = crc32fast::hash(payload);
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
}

pub(super) fn push_entry(out: &mut Vec<u8>, e: &Entry) {
    let at = begin_record(out);
    out.push(KIND_ENTRY);
    out.extend_from_slice(&e.index.to_le_bytes());
    out.extend_from_slice(&e.term.to_le_bytes());
    out.push(match e.get_entry_type() {
        EntryType::EntryNormal => 0,
        EntryType::EntryConfChange => 1,
        EntryType::EntryConfChangeV2 => 2,
    });
    put_varint(out, e.context.len() as u64);
    out.extend_from_slice(&e.context);
    out.extend_from_slice(&e.data);
    end_record(out, at);
}

pub(super) fn decode_entry(b: &[u8]) -> Option<Entry> {
    let mut r = Reader { buf: b, pos: 0 };
    let index = u64::from_le_bytes(r.bytes(8).ok()?.try_into().ok()?);
    let term = u64::from_le_bytes(r.bytes(8).ok()?.try_into().ok()?);
    let ty = match r.u8().ok()? {
        0 => EntryType::EntryNormal,
        1 => EntryType::EntryConfChange,
        2 => EntryType::EntryConfChangeV2,
        _ => return None,
    };
    let ctx_len = usize::try_from(r.varint().ok()?).ok()?;
    let ctx = r.bytes(ctx_len).ok()?.to_vec();
    let data = b[r.pos..].to_vec();
    Some(Entry { index, term, entry_type: ty, context: ctx.into(), data: data.into(), ..Default::default() })
}

pub(super) fn push_hard_state(out: &mut Vec<u8>, hs: &HardState) {
    let at = begin_record(out);
    out.push(KIND_HARD_STATE);
    out.extend_from_slice(&hs.term.to_le_bytes());
    out.extend_from_slice(&hs.vote.to_le_bytes());
    out.extend_from_slice(&hs.commit.to_le_bytes());
    end_record(out, at);
}

pub(super) fn push_conf_state(out: &mut Vec<u8>, cs: &ConfState) {
    let at = begin_record(out);
    out.push(KIND_CONF_STATE);
    // Encoding a plain message into a Vec cannot fail.
    let bytes = cs.write_to_bytes().unwrap_or_default();
    out.extend_from_slice(&bytes);
    end_record(out, at);
}
