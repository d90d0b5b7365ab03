//! A minimal blocking AMQP 0-9-1 client over a std `TcpStream`, for tests that must control
//! the exact bytes on the wire (bad input, dropped sockets).
//!
//! Frames (spec 0-9-1 §4.2.3): type u8, channel u16, size u32, payload, frame-end 0xCE.
//! Every read has a socket timeout ([`READ_TIMEOUT`]) and every loop a bounded count, so a
//! silent broker fails the test instead of hanging it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;
pub const FRAME_END: u8 = 0xCE;
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One frame as read from the socket.
#[derive(Debug, Clone)]
pub struct Frame {
    pub ty: u8,
    pub channel: u16,
    pub payload: Vec<u8>,
}

impl Frame {
    /// (class id, method id) of a method frame.
    pub fn method_id(&self) -> Option<(u16, u16)> {
        if self.ty != FRAME_METHOD || self.payload.len() < 4 {
            return None;
        }
        let p = &self.payload;
        Some((u16::from_be_bytes([p[0], p[1]]), u16::from_be_bytes([p[2], p[3]])))
    }
}

/// What the broker sent when it closed something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// connection.close with (reply code, reply text, failing class id, failing method id)
    Connection { code: u16, text: String, class: u16, method: u16 },
    /// channel.close on a channel with (reply code, reply text, class id, method id)
    Channel { channel: u16, code: u16, text: String, class: u16, method: u16 },
    /// the socket closed without a close method
    Eof,
}

impl Closed {
    pub fn code(&self) -> Option<u16> {
        match self {
            Closed::Connection { code, .. } | Closed::Channel { code, .. } => Some(*code),
            Closed::Eof => None,
        }
    }
}

/// queue.declare arguments (spec 1.7.2.1): reserved, queue name, no flags, and `table` (the
/// encoded fields of the arguments table) behind its length.
pub fn queue_declare_args(queue: &str, table: &[u8]) -> Vec<u8> {
    let mut a = Vec::new();
    a.extend_from_slice(&0u16.to_be_bytes());
    shortstr(&mut a, queue);
    a.push(0);
    a.extend_from_slice(&(table.len() as u32).to_be_bytes());
    a.extend_from_slice(table);
    a
}

/// Field encoders (spec §4.2.5).
pub fn shortstr(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

pub fn longstr(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A method payload: class id, method id, then the encoded arguments.
pub fn method(class: u16, method: u16, args: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + args.len());
    p.extend_from_slice(&class.to_be_bytes());
    p.extend_from_slice(&method.to_be_bytes());
    p.extend_from_slice(args);
    p
}

/// Encode a whole frame.
pub fn frame(ty: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + payload.len());
    f.push(ty);
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(FRAME_END);
    f
}

struct Reader<'a>(&'a [u8]);
impl Reader<'_> {
    fn u16(&mut self) -> u16 {
        let v = u16::from_be_bytes([self.0[0], self.0[1]]);
        self.0 = &self.0[2..];
        v
    }
    fn u32(&mut self) -> u32 {
        let v = u32::from_be_bytes(self.0[..4].try_into().unwrap());
        self.0 = &self.0[4..];
        v
    }
    fn u64(&mut self) -> u64 {
        let v = u64::from_be_bytes(self.0[..8].try_into().unwrap());
        self.0 = &self.0[8..];
        v
    }
    fn u8(&mut self) -> u8 {
        let v = self.0[0];
        self.0 = &self.0[1..];
        v
    }
    fn shortstr(&mut self) -> String {
        let n = self.u8() as usize;
        let s = String::from_utf8_lossy(&self.0[..n]).into_owned();
        self.0 = &self.0[n..];
        s
    }
}

/// A decoded basic.deliver / basic.get-ok with its content.
#[derive(Debug, Clone)]
pub struct RawDelivery {
    pub channel: u16,
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub body: Vec<u8>,
}

/// A raw connection.
pub struct RawConn {
    pub sock: TcpStream,
    /// frame_max the broker proposed in connection.tune (bytes)
    pub frame_max: u32,
    buf: Vec<u8>,
}

impl RawConn {
    /// TCP connect with read/write timeouts, nothing sent yet.
    pub fn tcp(addr: SocketAddr) -> RawConn {
        let sock = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("tcp connect");
        sock.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        sock.set_write_timeout(Some(READ_TIMEOUT)).unwrap();
        sock.set_nodelay(true).unwrap();
        RawConn { sock, frame_max: 0, buf: Vec::new() }
    }

    /// Connect and complete the handshake (PLAIN guest/guest, vhost "/", heartbeat 0, the
    /// broker's frame_max); the connection is open, no channel yet.
    pub fn open(addr: SocketAddr) -> RawConn {
        Self::open_with_properties(addr, &[])
    }

    /// [`RawConn::open`] announcing the client capability `consumer_cancel_notify` (so the
    /// broker sends basic.cancel when a consumed queue goes).
    pub fn open_notify(addr: SocketAddr) -> RawConn {
        Self::open_with_properties(addr, &capabilities(&["consumer_cancel_notify"]))
    }

    /// [`RawConn::open`] with `entries` (encoded field-table entries, no length prefix) as
    /// connection.start-ok's client-properties.
    pub fn open_with_properties(addr: SocketAddr, entries: &[u8]) -> RawConn {
        let mut c = Self::tcp(addr);
        c.write(PROTOCOL_HEADER);
        let start = c.read_method();
        assert_eq!(start.method_id(), Some((10, 10)), "expected connection.start");
        let mut a = Vec::new();
        a.extend_from_slice(&(entries.len() as u32).to_be_bytes()); // client-properties
        a.extend_from_slice(entries);
        shortstr(&mut a, "PLAIN");
        longstr(&mut a, b"\0guest\0guest");
        shortstr(&mut a, "en_US");
        c.send_method(0, 10, 11, &a);
        let tune = c.read_method();
        assert_eq!(tune.method_id(), Some((10, 30)), "expected connection.tune, got {tune:?}");
        let mut r = Reader(&tune.payload[4..]);
        let channel_max = r.u16();
        let frame_max = r.u32();
        c.frame_max = frame_max;
        let mut a = Vec::new();
        a.extend_from_slice(&channel_max.to_be_bytes());
        a.extend_from_slice(&frame_max.to_be_bytes());
        a.extend_from_slice(&0u16.to_be_bytes());
        c.send_method(0, 10, 31, &a);
        let mut a = Vec::new();
        shortstr(&mut a, "/");
        shortstr(&mut a, "");
        a.push(0);
        c.send_method(0, 10, 40, &a);
        let ok = c.read_method();
        assert_eq!(ok.method_id(), Some((10, 41)), "expected connection.open-ok, got {ok:?}");
        c
    }

    pub fn write(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("socket write");
    }

    /// Write, ignoring errors (the broker may already have closed the socket).
    pub fn write_lossy(&mut self, bytes: &[u8]) {
        let _ = self.sock.write_all(bytes);
    }

    pub fn send_method(&mut self, channel: u16, class: u16, meth: u16, args: &[u8]) {
        let f = frame(FRAME_METHOD, channel, &method(class, meth, args));
        self.write(&f);
    }

    /// channel.open on `channel`, waiting for open-ok.
    pub fn open_channel(&mut self, channel: u16) {
        let mut a = Vec::new();
        shortstr(&mut a, "");
        self.send_method(channel, 20, 10, &a);
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((20, 11)), "expected channel.open-ok, got {ok:?}");
    }

    /// queue.declare (non-durable, not exclusive, not auto-delete), waiting for declare-ok.
    pub fn queue_declare(&mut self, channel: u16, queue: &str) {
        self.send_method(channel, 50, 10, &queue_declare_args(queue, &[]));
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((50, 11)), "expected queue.declare-ok, got {ok:?}");
    }

    /// basic.qos prefetch_count, waiting for qos-ok.
    pub fn basic_qos(&mut self, channel: u16, prefetch: u16) {
        let mut a = Vec::new();
        a.extend_from_slice(&0u32.to_be_bytes());
        a.extend_from_slice(&prefetch.to_be_bytes());
        a.push(0);
        self.send_method(channel, 60, 10, &a);
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((60, 11)), "expected basic.qos-ok, got {ok:?}");
    }

    /// basic.consume (manual ack), waiting for consume-ok.
    pub fn basic_consume(&mut self, channel: u16, queue: &str, tag: &str) {
        let mut a = Vec::new();
        a.extend_from_slice(&0u16.to_be_bytes());
        shortstr(&mut a, queue);
        shortstr(&mut a, tag);
        a.push(0);
        a.extend_from_slice(&0u32.to_be_bytes());
        self.send_method(channel, 60, 20, &a);
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((60, 21)), "expected basic.consume-ok, got {ok:?}");
    }

    /// The three frames of a basic.publish with an empty property list.
    pub fn publish_frames(channel: u16, exchange: &str, key: &str, body: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&0u16.to_be_bytes());
        shortstr(&mut a, exchange);
        shortstr(&mut a, key);
        a.push(0);
        let mut out = frame(FRAME_METHOD, channel, &method(60, 40, &a));
        out.extend(frame(FRAME_HEADER, channel, &content_header(body.len() as u64)));
        out.extend(frame(FRAME_BODY, channel, body));
        out
    }

    /// The three frames of a basic.publish of a persistent message (delivery-mode 2, the
    /// only property set).
    pub fn persistent_publish_frames(channel: u16, exchange: &str, key: &str, body: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&0u16.to_be_bytes());
        shortstr(&mut a, exchange);
        shortstr(&mut a, key);
        a.push(0);
        let mut header = Vec::new();
        header.extend_from_slice(&60u16.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&0x1000u16.to_be_bytes());
        header.push(2);
        let mut out = frame(FRAME_METHOD, channel, &method(60, 40, &a));
        out.extend(frame(FRAME_HEADER, channel, &header));
        out.extend(frame(FRAME_BODY, channel, body));
        out
    }

    /// queue.declare of a durable queue, waiting for declare-ok, then confirm.select,
    /// waiting for select-ok.
    pub fn durable_queue_in_confirm_mode(&mut self, channel: u16, queue: &str) {
        let mut a = Vec::new();
        a.extend_from_slice(&0u16.to_be_bytes());
        shortstr(&mut a, queue);
        a.push(0b0000_0010); // durable
        a.extend_from_slice(&0u32.to_be_bytes());
        self.send_method(channel, 50, 10, &a);
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((50, 11)), "expected queue.declare-ok, got {ok:?}");
        self.send_method(channel, 85, 10, &[0]);
        let ok = self.read_method();
        assert_eq!(ok.method_id(), Some((85, 11)), "expected confirm.select-ok, got {ok:?}");
    }

    pub fn publish(&mut self, channel: u16, exchange: &str, key: &str, body: &[u8]) {
        let f = Self::publish_frames(channel, exchange, key, body);
        self.write(&f);
    }

    /// Read exactly one frame (skipping heartbeats); None on EOF / reset / timeout.
    pub fn read_frame(&mut self) -> Option<Frame> {
        let deadline = Instant::now() + READ_TIMEOUT;
        for _ in 0..10_000 {
            if let Some(f) = self.parse_buffered() {
                if f.ty == FRAME_HEARTBEAT {
                    continue;
                }
                return Some(f);
            }
            if Instant::now() > deadline {
                return None;
            }
            let mut tmp = [0u8; 65536];
            match self.sock.read(&mut tmp) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(_) => return None,
            }
        }
        None
    }

    fn parse_buffered(&mut self) -> Option<Frame> {
        if self.buf.len() < 7 {
            return None;
        }
        let size = u32::from_be_bytes(self.buf[3..7].try_into().unwrap()) as usize;
        if self.buf.len() < 7 + size + 1 {
            return None;
        }
        let f = Frame { ty: self.buf[0], channel: u16::from_be_bytes([self.buf[1], self.buf[2]]), payload: self.buf[7..7 + size].to_vec() };
        assert_eq!(self.buf[7 + size], FRAME_END, "broker sent a bad frame-end");
        self.buf.drain(..7 + size + 1);
        Some(f)
    }

    /// Read the next method frame (panics on EOF or a non-method frame).
    pub fn read_method(&mut self) -> Frame {
        let f = self.read_frame().expect("expected a method frame, got EOF/timeout");
        assert_eq!(f.ty, FRAME_METHOD, "expected a method frame, got {f:?}");
        f
    }

    /// Raw bytes available before EOF or timeout (at most `max`), for the protocol-header test.
    pub fn read_raw(&mut self, max: usize) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.buf);
        let deadline = Instant::now() + READ_TIMEOUT;
        while out.len() < max && Instant::now() < deadline {
            let mut tmp = [0u8; 4096];
            match self.sock.read(&mut tmp) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&tmp[..n]),
            }
        }
        out
    }

    /// Read frames until the broker closes the connection or a channel (bounded: 1000 frames);
    /// answers with the matching close-ok. Other frames (deliveries…) are skipped.
    pub fn expect_close(&mut self) -> Closed {
        for _ in 0..1000 {
            let Some(f) = self.read_frame() else { return Closed::Eof };
            match f.method_id() {
                Some((10, 50)) => {
                    let mut r = Reader(&f.payload[4..]);
                    let code = r.u16();
                    let text = r.shortstr();
                    let (class, method) = (r.u16(), r.u16());
                    self.write_lossy(&frame(FRAME_METHOD, 0, &self::method(10, 51, &[])));
                    return Closed::Connection { code, text, class, method };
                }
                Some((20, 40)) => {
                    let mut r = Reader(&f.payload[4..]);
                    let code = r.u16();
                    let text = r.shortstr();
                    let (class, method) = (r.u16(), r.u16());
                    self.write_lossy(&frame(FRAME_METHOD, f.channel, &self::method(20, 41, &[])));
                    return Closed::Channel { channel: f.channel, code, text, class, method };
                }
                _ => continue,
            }
        }
        panic!("no close within 1000 frames")
    }

    /// After a connection.close was answered, the broker must close the socket (EOF).
    pub fn expect_eof(&mut self) -> bool {
        for _ in 0..100 {
            if self.read_frame().is_none() {
                return true;
            }
        }
        false
    }

    /// Read the next basic.deliver or basic.get-ok with its header and body frames.
    pub fn read_delivery(&mut self) -> Option<RawDelivery> {
        let f = self.read_frame()?;
        let (channel, tag, redelivered) = match f.method_id() {
            Some((60, 60)) => {
                let mut r = Reader(&f.payload[4..]);
                let _ctag = r.shortstr();
                let tag = r.u64();
                let red = r.u8() & 1 == 1;
                (f.channel, tag, red)
            }
            Some((60, 71)) => {
                let mut r = Reader(&f.payload[4..]);
                let tag = r.u64();
                let red = r.u8() & 1 == 1;
                (f.channel, tag, red)
            }
            other => panic!("expected basic.deliver/get-ok, got {other:?} {f:?}"),
        };
        let h = self.read_frame()?;
        assert_eq!(h.ty, FRAME_HEADER, "expected a content header");
        let size = Reader(&h.payload[4..]).u64() as usize;
        let mut body = Vec::with_capacity(size);
        for _ in 0..100_000 {
            if body.len() >= size {
                break;
            }
            let b = self.read_frame()?;
            assert_eq!(b.ty, FRAME_BODY, "expected a body frame");
            body.extend_from_slice(&b.payload);
        }
        Some(RawDelivery { channel, delivery_tag: tag, redelivered, body })
    }
}

/// A content header payload for class basic with no properties.
pub fn content_header(body_size: u64) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&60u16.to_be_bytes());
    p.extend_from_slice(&0u16.to_be_bytes());
    p.extend_from_slice(&body_size.to_be_bytes());
    p.extend_from_slice(&0u16.to_be_bytes());
    p
}

/// Client-properties entries (no length prefix) announcing `names` as capabilities (true).
pub fn capabilities(names: &[&str]) -> Vec<u8> {
    let mut caps = Vec::new();
    for name in names {
        shortstr(&mut caps, name);
        caps.extend_from_slice(b"t\x01");
    }
    let mut entries = Vec::new();
    shortstr(&mut entries, "capabilities");
    entries.push(b'F');
    entries.extend_from_slice(&(caps.len() as u32).to_be_bytes());
    entries.extend_from_slice(&caps);
    entries
}

/// Decode a u64 at the start of a slice (big-endian).
pub fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}
