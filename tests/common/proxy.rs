//! A TCP proxy per directed link between cluster nodes, for partition tests: node i's
//! `--peers` names node j at the proxy of link i→j, which forwards to j's `--cluster-listen`.
//! Every connection node i dials to node j (its Raft, snapshot and data lanes to j) goes
//! through that proxy, in both byte directions; the lanes j dials to i go through j→i.
//!
//! [`Mode`]s: `Pass` forwards; `Reset` closes every connection of the link and closes each
//! new one at once (a peer that refuses: the nodes notice within a send); `Blackhole`
//! keeps the connections open and drops every byte both ways (a silent network: the nodes
//! notice by their timeouts only); `Stall` reads nothing either way, so the senders' buffers
//! fill and every byte waits (a frozen peer or a congested path), all delivered, none lost,
//! once the link passes again.
//!
//! # Invariants
//! - Threads only: an accept thread per proxy, two pump threads per connection. Each polls
//!   with a 50 ms timeout, so a mode change or the proxy's drop takes effect within it.
//! - Nothing outlives the proxy: `Drop` stops the threads and shuts every socket down.
#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often each thread looks at the mode and the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// What a link does with its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward both ways.
    Pass = 0,
    /// Close every connection; close each new one at once.
    Reset = 1,
    /// Keep connections open, drop every byte.
    Blackhole = 2,
    /// Keep connections open, read nothing: bytes wait and flow again on `Pass`.
    Stall = 3,
}

/// State shared by a proxy's threads.
struct Shared {
    target: SocketAddr,
    mode: AtomicU8,
    stop: AtomicBool,
    /// Both sockets of every live connection (to shut down on `Reset` and on drop).
    socks: Mutex<Vec<TcpStream>>,
}

impl Shared {
    fn mode(&self) -> Mode {
        match self.mode.load(Ordering::Acquire) {
            0 => Mode::Pass,
            1 => Mode::Reset,
            2 => Mode::Blackhole,
            _ => Mode::Stall,
        }
    }

    fn close_all(&self) {
        for s in self.socks.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// One directed link's proxy (see the module doc).
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`, in `Mode::Pass`.
    pub fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        listener.set_nonblocking(true).expect("proxy nonblocking");
        let addr = listener.local_addr().expect("proxy addr");
        let shared =
            Arc::new(Shared { target, mode: AtomicU8::new(Mode::Pass as u8), stop: AtomicBool::new(false), socks: Mutex::new(Vec::new()) });
        let s = shared.clone();
        std::thread::spawn(move || accept_loop(listener, s));
        Proxy { addr, shared }
    }

    /// Where the dialing node is told the peer listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the link's mode; `Reset` also closes the connections it has.
    pub fn set(&self, mode: Mode) {
        self.shared.mode.store(mode as u8, Ordering::Release);
        if mode == Mode::Reset {
            self.shared.close_all();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.close_all();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((inbound, _)) => {
                if shared.mode() == Mode::Reset {
                    continue; // dropped: closed at once
                }
                let Ok(outbound) = TcpStream::connect_timeout(&shared.target, Duration::from_secs(1)) else { continue };
                connect(inbound, outbound, &shared);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Starts the two pumps of one proxied connection.
fn connect(inbound: TcpStream, outbound: TcpStream, shared: &Arc<Shared>) {
    let _ = inbound.set_nonblocking(false);
    for s in [&inbound, &outbound] {
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(POLL));
    }
    let (Ok(in_w), Ok(out_w), Ok(in_k), Ok(out_k)) = (inbound.try_clone(), outbound.try_clone(), inbound.try_clone(), outbound.try_clone())
    else {
        return;
    };
    shared.socks.lock().unwrap().extend([in_k, out_k]);
    let (a, b) = (shared.clone(), shared.clone());
    std::thread::spawn(move || pump(inbound, out_w, a));
    std::thread::spawn(move || pump(outbound, in_w, b));
}

/// Copies `from` to `to` while the link passes; reads and drops while it is a blackhole;
/// reads nothing while it stalls; ends (closing both) at EOF, on an error, on `Reset` or on stop.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: Arc<Shared>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.stop.load(Ordering::Acquire) || shared.mode() == Mode::Reset {
            break;
        }
        if shared.mode() == Mode::Stall {
            std::thread::sleep(POLL);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                // Bytes read as the link began to stall wait with the others.
                while shared.mode() == Mode::Stall && !shared.stop.load(Ordering::Acquire) {
                    std::thread::sleep(POLL);
                }
                if shared.mode() == Mode::Pass && to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
