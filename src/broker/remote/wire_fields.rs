//! The binary forms of the plain types the data lane's frames are made of (see `wire.rs`'s
//! module doc): varint integers, zigzag `i32`, length-prefixed strings and bytes, queue keys,
//! stored messages, offset lists, and the generic pair, option and result forms.

use super::*;

/// Unsigned integers: varints; a `u16` or `u32` that does not fit is an error.
macro_rules! uint_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn put(&self, out: &mut Vec<u8>) {
                put_varint(out, u64::from(*self));
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
                let at = r.pos;
                let value = r.varint()?;
                Self::try_from(value).map_err(|_| WireError::OutOfRange { at, value })
            }
        }
    )*};
}
uint_field!(u16, u32, u64);

/// A signed 32-bit integer: its zigzag form as a varint.
impl Field for i32 {
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, u64::from(((*self << 1) ^ (*self >> 31)) as u32));
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let at = r.pos;
        let value = r.varint()?;
        let z = u32::try_from(value).map_err(|_| WireError::OutOfRange { at, value })?;
        Ok(((z >> 1) as i32) ^ -((z & 1) as i32))
    }
}

/// A boolean is a tag: 0 or 1.
impl Field for bool {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(u8::from(*self));
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(r.tag("bool", 1)? == 1)
    }
}

impl Field for String {
    fn put(&self, out: &mut Vec<u8>) {
        put_str(out, self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        r.str().map(str::to_owned)
    }
}

impl Field for QueueKey {
    fn put(&self, out: &mut Vec<u8>) {
        put_str(out, &self.vhost);
        put_str(out, &self.name);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let vhost = r.str()?;
        Ok(QueueKey::new(vhost, r.str()?))
    }
}

impl Field for Message {
    fn put(&self, out: &mut Vec<u8>) {
        for blob in [&self.header, &self.body] {
            put_varint(out, blob.len() as u64);
            out.extend_from_slice(blob);
        }
        out.push(self.flags);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(Message { header: r.blob()?, body: r.blob()?, flags: r.u8()? })
    }
}

/// Offsets: count, then zigzag-mapped wrapping differences (the module doc).
impl Field for Vec<u64> {
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.len() as u64);
        let mut prev = 0u64;
        for &o in self {
            let d = o.wrapping_sub(prev) as i64;
            put_varint(out, ((d << 1) ^ (d >> 63)) as u64);
            prev = o;
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let n = r.len()?;
        let mut offsets = Vec::with_capacity(n);
        let mut prev = 0u64;
        for _ in 0..n {
            let z = r.varint()?;
            prev = prev.wrapping_add((z >> 1) ^ (z & 1).wrapping_neg());
            offsets.push(prev);
        }
        Ok(offsets)
    }
}

impl Field for () {
    fn put(&self, _: &mut Vec<u8>) {}
    fn get(_: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(())
    }
}

impl<A: Field, B: Field> Field for (A, B) {
    fn put(&self, out: &mut Vec<u8>) {
        put!(out; self.0, self.1);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok((r.get()?, r.get()?))
    }
}

impl<T: Field> Field for Option<T> {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            None => out.push(0),
            Some(v) => put!(out, 1; v),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        match r.tag("option", 1)? {
            0 => Ok(None),
            _ => r.get().map(Some),
        }
    }
}

impl<T: Field> Field for Result<T, QueueError> {
    fn put(&self, out: &mut Vec<u8>) {
        let (tag, text) = match self {
            Ok(v) => return put!(out, 0; v),
            Err(QueueError::NotFound(s)) => (0, s),
            Err(QueueError::AccessRefused(s)) => (1, s),
            Err(QueueError::PreconditionFailed(s)) => (2, s),
            Err(QueueError::ResourceError(s)) => (3, s),
            Err(QueueError::InternalError(s)) => (4, s),
        };
        out.push(1);
        put!(out, tag; text);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        if r.tag("result", 1)? == 0 {
            return r.get().map(Ok);
        }
        let make = match r.tag("queue error", 4)? {
            0 => QueueError::NotFound,
            1 => QueueError::AccessRefused,
            2 => QueueError::PreconditionFailed,
            3 => QueueError::ResourceError,
            _ => QueueError::InternalError,
        };
        Ok(Err(make(r.get()?)))
    }
}
