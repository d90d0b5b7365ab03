//! Listen addresses as an operator writes them: `127.0.0.1:5672`, `[::]:5672`, or a host name
//! with a port (`localhost:5672`, `broker.internal:5672`), which listens on every address the
//! name resolves to (RabbitMQ's `listeners.tcp` takes host names too).

use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use serde::Deserialize;

/// One `--listen` value (or one TOML `listen` entry): the addresses it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAddr {
    /// What the operator wrote.
    pub text: String,
    /// The addresses to bind: one for an address, every resolved one (deduplicated, in the
    /// resolver's order) for a host name.
    pub addrs: Vec<SocketAddr>,
    /// Given as a host name rather than an address.
    pub named: bool,
}

impl FromStr for ListenAddr {
    type Err = String;

    /// Parses `ADDR:PORT` or `HOST:PORT` (resolved now, at start-up).
    ///
    /// # Errors
    /// A text naming the value when it is neither, or when the name does not resolve.
    fn from_str(s: &str) -> Result<ListenAddr, String> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(ListenAddr { text: s.to_string(), addrs: vec![a], named: false });
        }
        let Some((host, port)) = s.rsplit_once(':').filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) else {
            return Err(format!("{s:?}: expected ADDR:PORT or HOST:PORT, such as 127.0.0.1:5672, [::]:5672 or localhost:5672"));
        };
        let mut addrs: Vec<SocketAddr> = Vec::new();
        for a in (host, port.parse::<u16>().unwrap_or(0)).to_socket_addrs().map_err(|e| format!("{s:?}: cannot resolve {host:?}: {e}"))? {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
        if addrs.is_empty() {
            return Err(format!("{s:?}: {host:?} resolves to no address"));
        }
        Ok(ListenAddr { text: s.to_string(), addrs, named: true })
    }
}

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The IPv6 addresses of `given` that a host without IPv6 may skip with a warning rather than
/// refuse to start: those of a host name that also resolved to an IPv4 address (`localhost`
/// is `::1` and `127.0.0.1`).
pub fn optional_ipv6(given: &[ListenAddr]) -> Vec<SocketAddr> {
    given
        .iter()
        .filter(|l| l.named && l.addrs.iter().any(SocketAddr::is_ipv4))
        .flat_map(|l| l.addrs.iter().copied().filter(SocketAddr::is_ipv6))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_host_names() {
        let a: ListenAddr = "0.0.0.0:5680".parse().unwrap();
        assert_eq!((a.addrs, a.named), (vec!["0.0.0.0:5680".parse().unwrap()], false));
        let l: ListenAddr = "localhost:5681".parse().unwrap();
        assert!(l.named);
        assert!(l.addrs.contains(&"127.0.0.1:5681".parse().unwrap()), "{l:?}");
        assert!(l.addrs.iter().all(|a| a.port() == 5681 && a.ip().is_loopback()), "{l:?}");
        for ipv6 in optional_ipv6(&[l]) {
            assert_eq!(ipv6, "[::1]:5681".parse().unwrap());
        }
        for bad in ["localhost", "5672", ":5672", "localhost:x", "no-such-host.invalid:5672"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad} accepted");
        }
    }
}
