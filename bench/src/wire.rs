//! AMQP 0-9-1 framing shared by the floor relay and the raw engine (spec section 4.2.3,
//! "General Frame Format"): frame constants, frame encoders, and a read buffer that hands
//! out whole frames in place, without copying or allocating per frame.

use amq_protocol::protocol::{gen_class, AMQPClass};

/// Frame type of a method frame.
pub const FRAME_METHOD: u8 = 1;
/// Frame type of a content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Frame type of a content body frame.
pub const FRAME_BODY: u8 = 3;
/// The octet that ends every frame.
pub const FRAME_END: u8 = 0xCE;
/// Bytes a frame adds around its payload: type (1), channel (2), size (4), frame-end (1).
pub const FRAME_OVERHEAD: usize = 8;

/// Appends one frame of type `kind` on `channel` carrying `payload`.
pub fn frame(out: &mut Vec<u8>, kind: u8, channel: u16, payload: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(FRAME_END);
}

/// Appends one method frame (encoded by amq-protocol).
pub fn method(out: &mut Vec<u8>, channel: u16, m: &AMQPClass) {
    // Writing into a Vec cannot fail short of allocation failure.
    let payload = cookie_factory::gen_simple(gen_class(m), Vec::new()).expect("encode a method");
    frame(out, FRAME_METHOD, channel, &payload);
}

/// One frame borrowed from a [`Reader`]'s buffer.
pub struct Frame<'a> {
    /// Frame type ([`FRAME_METHOD`], [`FRAME_HEADER`], [`FRAME_BODY`], 8 for a heartbeat).
    pub kind: u8,
    /// Channel number (0 for the connection).
    pub channel: u16,
    /// The payload, without the 7-byte header and the frame-end octet.
    pub payload: &'a [u8],
}

/// Bytes read from a socket, handed out a whole frame at a time.
///
/// Reads go into [`Reader::spare`]; [`Reader::next`] returns each complete frame as a
/// slice of the buffer. The buffer grows only to hold one frame larger than it.
pub struct Reader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Largest frame accepted (payload + [`FRAME_OVERHEAD`]), bytes.
    max_frame: usize,
}

/// Free space below which [`Reader::spare`] moves the unread bytes to the front, bytes.
const MIN_SPARE: usize = 16 << 10;

impl Reader {
    /// A reader with a `capacity`-byte buffer, accepting frames up to `max_frame` bytes.
    pub fn new(capacity: usize, max_frame: usize) -> Self {
        Reader { buf: vec![0; capacity.max(MIN_SPARE * 2)], start: 0, end: 0, max_frame }
    }

    /// Sets the largest frame accepted (payload + [`FRAME_OVERHEAD`], bytes), e.g. once
    /// connection.tune has fixed frame-max.
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// The free space to read into: at least 16 KiB, and room for the whole frame being
    /// received.
    pub fn spare(&mut self) -> &mut [u8] {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        let pending = self.pending_frame_len();
        if self.buf.len() - self.end < MIN_SPARE || self.start + pending > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
            if pending + MIN_SPARE > self.buf.len() {
                self.buf.resize(pending + MIN_SPARE, 0);
            }
        }
        &mut self.buf[self.end..]
    }

    /// Records that `n` bytes were read into [`Reader::spare`].
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// Length of the frame at the front (header included), 0 when its header is incomplete.
    fn pending_frame_len(&self) -> usize {
        if self.end - self.start < 7 {
            return 0;
        }
        let b = &self.buf[self.start..];
        (u32::from_be_bytes([b[3], b[4], b[5], b[6]]) as usize).saturating_add(FRAME_OVERHEAD).min(self.max_frame)
    }

    /// The next complete frame, `None` when more bytes are needed.
    ///
    /// # Errors
    /// A frame larger than the accepted maximum, or one not ended by [`FRAME_END`]: the
    /// peer does not speak AMQP 0-9-1 (or the stream is out of step) and the connection
    /// must be dropped.
    pub fn next(&mut self) -> Result<Option<Frame<'_>>, String> {
        let avail = self.end - self.start;
        if avail < 7 {
            return Ok(None);
        }
        let b = &self.buf[self.start..self.end];
        let size = u32::from_be_bytes([b[3], b[4], b[5], b[6]]) as usize;
        if size.saturating_add(FRAME_OVERHEAD) > self.max_frame {
            return Err(format!("frame of {size} bytes above frame-max {}", self.max_frame - FRAME_OVERHEAD));
        }
        if avail < size + FRAME_OVERHEAD {
            return Ok(None);
        }
        if b[7 + size] != FRAME_END {
            return Err(format!("frame not ended by 0xCE (type {}, {size} bytes)", b[0]));
        }
        let at = self.start;
        self.start += size + FRAME_OVERHEAD;
        let b = &self.buf[at..];
        Ok(Some(Frame { kind: b[0], channel: u16::from_be_bytes([b[1], b[2]]), payload: &b[7..7 + size] }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `bytes` to `r` in reads of at most `step` bytes (and at most what
    /// [`Reader::spare`] offers) and collects every frame.
    fn feed(r: &mut Reader, mut bytes: &[u8], step: usize) -> Vec<(u8, u16, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let spare = r.spare();
            let n = step.min(spare.len()).min(bytes.len());
            spare[..n].copy_from_slice(&bytes[..n]);
            r.filled(n);
            bytes = &bytes[n..];
            while let Some(f) = r.next().expect("well-formed") {
                out.push((f.kind, f.channel, f.payload.to_vec()));
            }
        }
        out
    }

    #[test]
    fn frames_split_anywhere_come_out_whole_and_in_order() {
        let mut bytes = Vec::new();
        let big = vec![9u8; 70_000];
        frame(&mut bytes, FRAME_METHOD, 0, b"abc");
        frame(&mut bytes, FRAME_BODY, 7, &big);
        frame(&mut bytes, 8, 0, b"");
        for step in [1, 5, 4096, 100_000] {
            let mut r = Reader::new(0, 131_072);
            let got = feed(&mut r, &bytes, step);
            assert_eq!(got.len(), 3, "step {step}");
            assert_eq!((got[0].0, got[0].1, &got[0].2[..]), (FRAME_METHOD, 0, &b"abc"[..]));
            assert_eq!((got[1].0, got[1].1, got[1].2.len()), (FRAME_BODY, 7, 70_000), "a frame larger than the buffer");
            assert_eq!((got[2].0, got[2].2.len()), (8, 0), "a heartbeat");
        }
    }

    #[test]
    fn a_frame_above_the_maximum_or_without_its_end_octet_is_an_error() {
        let mut bytes = Vec::new();
        frame(&mut bytes, FRAME_BODY, 1, &[0u8; 200]);
        let mut r = Reader::new(0, 100);
        r.spare()[..bytes.len()].copy_from_slice(&bytes);
        r.filled(bytes.len());
        assert!(r.next().is_err());
        let last = bytes.len() - 1;
        bytes[last] = 0;
        let mut r = Reader::new(0, 131_072);
        r.spare()[..bytes.len()].copy_from_slice(&bytes);
        r.filled(bytes.len());
        assert!(r.next().is_err());
    }
}
