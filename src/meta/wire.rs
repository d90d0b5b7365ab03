//! Byte-level building blocks of the metadata's binary formats, shared by the command codec
//! (`codec.rs`), the `meta.log` records (`record.rs`, `storage.rs`) and the serde helpers of the
//! topology (`topology.rs`): LEB128 varints, varint-length-prefixed strings and field tables,
//! the AMQP 0-9-1 field-table wire form (spec section 4.2.5.5), and a bounds-checked `Reader`
//! whose failures are [`DecodeError`]s.

use amq_protocol::types::FieldTable;

/// Error decoding a command batch: the entry is not one this code wrote.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad command batch at byte {at}: {what}")]
pub struct DecodeError {
    /// Byte offset in the entry data where decoding failed.
    pub at: usize,
    /// What was wrong.
    pub what: &'static str,
}

/// LEB128 unsigned varint (1 byte for values < 128, at most 10 bytes).
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint length, then the bytes.
pub(crate) fn put_blob(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn put_table(out: &mut Vec<u8>, t: &FieldTable) {
    if t.inner().is_empty() {
        put_varint(out, 0);
        return;
    }
    let bytes = field_table_to_wire(t);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(&bytes);
}

/// Encodes a field table in its AMQP 0-9-1 wire form (4-byte big-endian length, then entries;
/// spec section 4.2.5.5).
pub fn field_table_to_wire(t: &FieldTable) -> Vec<u8> {
    use amq_protocol::types::generation::gen_field_table;
    match gen_field_table(t)(Vec::new().into()) {
        Ok(ctx) => ctx.write,
        // Writing to a Vec cannot fail short of allocation failure, which aborts anyway.
        Err(e) => unreachable!("field table generation into a Vec failed: {e:?}"),
    }
}

/// Decodes a field table from its AMQP 0-9-1 wire form; `None` when malformed or followed by
/// trailing bytes.
pub fn field_table_from_wire(bytes: &[u8]) -> Option<FieldTable> {
    use amq_protocol::types::parsing::parse_field_table;
    match parse_field_table(bytes) {
        Ok(([], t)) => Some(t),
        _ => None,
    }
}

pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn err(&self, what: &'static str) -> DecodeError {
        DecodeError { at: self.pos, what }
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        let b = *self.buf.get(self.pos).ok_or_else(|| self.err("truncated"))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(self.err("varint overflows u64"));
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| self.err("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn len(&mut self) -> Result<usize, DecodeError> {
        let n = self.varint()?;
        usize::try_from(n).map_err(|_| self.err("length out of range"))
    }

    /// A varint-length-prefixed byte string.
    pub(crate) fn blob(&mut self) -> Result<bytes::Bytes, DecodeError> {
        let n = self.len()?;
        Ok(bytes::Bytes::copy_from_slice(self.bytes(n)?))
    }

    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.len()?;
        let at = self.pos;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError { at, what: "string is not UTF-8" })
    }

    pub(crate) fn table(&mut self) -> Result<FieldTable, DecodeError> {
        let n = self.len()?;
        if n == 0 {
            return Ok(FieldTable::default());
        }
        let at = self.pos;
        let b = self.bytes(n)?;
        field_table_from_wire(b).ok_or(DecodeError { at, what: "malformed field table" })
    }
}
