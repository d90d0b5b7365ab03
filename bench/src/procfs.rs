//! What the bench reads from /proc: CPU time and RSS of a process, and which process
//! listens on a TCP port (proc(5): /proc/net/tcp, /proc/<pid>/fd, /proc/<pid>/stat).

use std::fs;
use std::io;

/// CPU time (user + system, all threads) of process `pid` in µs, from fields 14 and 15
/// (`utime`, `stime`, clock ticks) of /proc/<pid>/stat. Resolution is one clock tick
/// (10 ms at the usual 100 Hz).
///
/// # Errors
/// The process is gone or the file cannot be parsed.
pub fn process_cpu_us(pid: u32) -> io::Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces and parentheses: skip past the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad /proc stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 → index 11, stime → index 12.
    let parse = |i: usize| -> io::Result<u64> {
        fields.get(i).and_then(|f| f.parse::<u64>().ok()).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad /proc stat field"))
    };
    let ticks = parse(11)? + parse(12)?;
    Ok(ticks * 1_000_000 / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

/// CPU time (user + system, all threads) of this process in µs, from getrusage(2).
pub fn self_cpu_us() -> u64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Resident set size of `pid` in bytes (VmRSS of /proc/<pid>/status), `None` if gone.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The process that owns a socket listening on TCP `port` (IPv4 or IPv6), found by
/// matching the socket inode of /proc/net/tcp{,6} against every /proc/<pid>/fd link.
/// Needs permission to read other processes' fds (same user or root). Returns `None`
/// when no such local process is visible (e.g. the broker runs on another host or in
/// another PID namespace).
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() < 10 || cols[3] != "0A" {
                continue; // 0A = TCP_LISTEN
            }
            let local_port = cols[1].rsplit_once(':').and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) {
                inodes.push(format!("socket:[{}]", cols[9]));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    let me = std::process::id();
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            if let Ok(link) = fs::read_link(fd.path()) {
                if inodes.iter().any(|i| link.as_os_str() == i.as_str()) {
                    return Some(pid);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_is_readable_both_ways() {
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        assert!(process_cpu_us(std::process::id()).is_ok());
        assert!(rss_bytes(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn finds_the_listener_of_a_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // Our own pid is skipped on purpose (the bench never measures itself as the broker).
        assert_eq!(pid_listening_on(port), None);
    }
}
