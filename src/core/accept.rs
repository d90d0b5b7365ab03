//! Listening sockets and accept threads: each core binds the same address with
//! SO_REUSEPORT, so the kernel spreads connections over the cores, and a small blocking
//! thread per core accepts and hands each connection to its core through a channel.
//!
//! Accepting happens on a plain thread with accept(2), not through io_uring: a listening
//! socket with an accept pending in an io_uring outlives a killed process until the kernel
//! tears the ring down (seen here taking over 10 s after kill -9 under load), and with
//! SO_REUSEPORT a restarted broker would share the port with it and see connections reset.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Decides at accept whether a connection from `peer` is kept (true) or closed at once.
pub type Admit = Arc<dyn Fn(SocketAddr) -> bool + Send + Sync>;

/// Waits (up to 10 s) until no other socket listens on `addr`; refuses at once when a live
/// process listens there ([`listener_process`]: another broker, a RabbitMQ), naming it.
///
/// Every core binds with SO_REUSEPORT, which would also let us share the port with a
/// listener that is still alive, for instance one of a killed ringmq whose io_uring the
/// kernel has not torn down yet: the kernel would then hand part of the new connections
/// to that dead listener, and they would be reset. A plain bind (SO_REUSEADDR only, never
/// listening) fails while any listener exists, so it tells us when the port is really ours.
///
/// # Errors
/// When the port stays taken for 10 s, or binding fails otherwise.
pub fn wait_port_free(addr: SocketAddr) -> std::io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // bind(2) without listen(2): a probe that listened would, for an instant, accept a
        // client's connection and reset it (a client that saw the port accept could then
        // find the rest of the broker not yet up).
        let probe = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))
            .and_then(|s| s.set_reuse_address(true).map(|_| s))
            .and_then(|s| s.bind(&addr.into()).map(|_| s));
        match probe {
            Ok(probe) => {
                drop(probe);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                // A live process's listener does not go away by waiting: say who holds it now.
                // Only a listener no process holds (a killed ringmq's, until the kernel tears
                // its io_uring down) is worth the wait.
                if let Some(owner) = listener_process(addr) {
                    return Err(std::io::Error::new(e.kind(), format!("cannot listen on {addr}: in use by {owner}")));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))),
        }
    }
}

/// The live process listening where `addr` would ("pid 1234 (beam.smp)"), found through
/// /proc/net/tcp and tcp6 (a listening socket on the port whose address is `addr`'s, or
/// either one unspecified: its inode) and /proc/*/fd; None when no process holds such a
/// socket, when this process does, or when /proc cannot tell (not permitted).
pub fn listener_process(addr: SocketAddr) -> Option<String> {
    // Columns: sl local_address rem_address st … inode; local_address is HEXIP:HEXPORT (the
    // IP as 32-bit words in host order), st 0A is LISTEN.
    let overlaps = |hex_ip: &str| {
        proc_net_ip(hex_ip).is_some_and(|ip| ip.is_unspecified() || addr.ip().is_unspecified() || ip.to_canonical() == addr.ip())
    };
    let mut inodes: Vec<String> = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        inodes.extend(text.lines().skip(1).filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let (ip, port) = cols.get(1)?.rsplit_once(':')?;
            let listens = u16::from_str_radix(port, 16).ok()? == addr.port() && *cols.get(3)? == "0A" && overlaps(ip);
            listens.then(|| format!("socket:[{}]", cols.get(9).copied().unwrap_or("")))
        }));
    }
    if inodes.is_empty() {
        return None;
    }
    let me = std::process::id().to_string();
    for proc in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = proc.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else { continue };
            if inodes.iter().any(|i| target.as_os_str() == i.as_str()) {
                let name = std::fs::read_to_string(proc.path().join("comm")).unwrap_or_default();
                return Some(format!("pid {pid} ({})", name.trim()));
            }
        }
    }
    None
}

/// An address as /proc/net/tcp{,6} prints it: 8 or 32 hex digits, 32-bit words in host order.
fn proc_net_ip(hex: &str) -> Option<std::net::IpAddr> {
    let words = (0..hex.len() / 8).map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok()).collect::<Option<Vec<u32>>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    match bytes.len() {
        4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(bytes.as_slice()).ok()?).into()),
        16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).ok()?).into()),
        _ => None,
    }
}

/// Binds core `core`'s listening sockets, one per address of `addrs` (SO_REUSEADDR,
/// SO_REUSEPORT, backlog 1,024; an IPv6 socket is IPv6-only when `addrs` also has an IPv4
/// address on its port, so `0.0.0.0:5672` and `[::]:5672` go together), and starts an accept
/// thread `ringmq-accept-{core}` per socket, which hands each accepted, non-blocking
/// connection that `admit` keeps to the returned channel.
///
/// # Errors
/// When a socket cannot be bound (the error names the address) or a thread cannot start.
pub fn listen(core: u32, addrs: &[SocketAddr], admit: Admit) -> std::io::Result<flume::Receiver<TcpStream>> {
    use socket2::{Domain, Protocol, Socket, Type};
    let (tx, rx) = flume::unbounded();
    for &addr in addrs {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        if addr.is_ipv6() && addrs.iter().any(|a| a.is_ipv4() && a.port() == addr.port()) {
            socket.set_only_v6(true)?;
        }
        socket.bind(&addr.into()).map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        socket.listen(1024)?;
        let listener: TcpListener = socket.into();
        let (tx, admit) = (tx.clone(), admit.clone());
        std::thread::Builder::new().name(format!("ringmq-accept-{core}")).spawn(move || loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    if !admit(peer) {
                        drop(stream);
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if tx.send(stream).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        })?;
    }
    Ok(rx)
}

/// Hands an accepted std stream to the current executor's io_uring.
pub fn into_glommio(stream: TcpStream) -> glommio::net::TcpStream {
    // SAFETY: the fd comes from a std TcpStream we own and give up here.
    unsafe { glommio::net::TcpStream::from_raw_fd(stream.into_raw_fd()) }
}
