//! The management API's HTTPS listener: `--management-tls-listen` (RabbitMQ's
//! `management.ssl.port`, conventionally 15671), its certificate, key and CA bundle
//! (RabbitMQ's `management.ssl.certfile`, `keyfile`, `cacertfile`), and the rustls server
//! configuration built from them at load.
//!
//! # Which files
//! 1. Certificate and key: `management_tls_cert` with `management_tls_key` (both or
//!    neither); neither: the amqps listener's `tls_cert` with `tls_key` (which need no
//!    `tls_listen` for this). Neither pair: the start is refused, naming both.
//! 2. CA bundle: `management_tls_ca`, else `tls_ca`, else none (no client certificate asked
//!    for). A presented certificate must verify against it; it does not log anyone in (the
//!    API still wants basic auth, as RabbitMQ's).
//! 3. `management_tls_fail_if_no_peer_cert` is this listener's own: the amqps listener's
//!    `tls_fail_if_no_peer_cert` is not inherited (browsers and scrapers seldom carry a client
//!    certificate; RabbitMQ keeps `management.ssl.fail_if_no_peer_cert` apart too).
//!
//! # Invariants
//! A loaded [`ManagementTls`] has a certificate chain, a key that matches it, and offers ALPN
//! `http/1.1` only (the server speaks HTTP/1.1).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use futures_rustls::rustls::ServerConfig;

use super::tls::{server_config, ServerFiles, Setting, TlsSettings};
use super::ConfigError;

/// The management HTTPS settings as given (flags over the TOML file), before any file is read.
#[derive(Clone, Debug, Default)]
pub struct ManagementTlsSettings {
    /// HTTPS listen address; `None`: no HTTPS listener.
    pub listen: Option<SocketAddr>,
    /// PEM certificate chain, leaf first; `None`: `tls_cert`.
    pub cert: Option<PathBuf>,
    /// PEM private key; `None`: `tls_key`.
    pub key: Option<PathBuf>,
    /// PEM CA bundle for client certificates; `None`: `tls_ca`.
    pub ca: Option<PathBuf>,
    /// Refuse a client that presents no certificate.
    pub fail_if_no_peer_cert: bool,
}

/// The management API's HTTPS listener: its address and the rustls configuration it accepts
/// with.
#[derive(Clone, Debug)]
pub struct ManagementTls {
    /// HTTPS listen address.
    pub listen: SocketAddr,
    /// Client certificates are asked for and verified (a CA bundle was given or inherited).
    pub verify_peer: bool,
    /// The setting the certificate came from: `management_tls_cert` or `tls_cert` (for the
    /// start's log line).
    pub cert_from: &'static str,
    /// The rustls server configuration (ALPN `http/1.1`).
    pub server: Arc<ServerConfig>,
}

impl ManagementTlsSettings {
    /// Picks the files as the module doc says (`amqp`: the amqps settings, which lend theirs),
    /// reads them and builds the server configuration; `None` without a listen address.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming what is missing or wrong: a `management_tls_*` setting
    /// without `management_tls_listen`; no certificate and key (neither pair given); one of
    /// `management_tls_cert`/`management_tls_key` without the other; fail-if-no-peer-cert
    /// without a CA bundle; and the file errors of the amqps listener's build (the setting and
    /// path named).
    pub fn build(&self, amqp: &TlsSettings) -> Result<Option<ManagementTls>, ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        let Some(listen) = self.listen else {
            if self.cert.is_some() || self.key.is_some() || self.ca.is_some() || self.fail_if_no_peer_cert {
                return invalid(
                    "management_tls_cert, management_tls_key, management_tls_ca and management_tls_fail_if_no_peer_cert need management_tls_listen (the management API's HTTPS address)",
                );
            }
            return Ok(None);
        };
        let (cert, key) = match (&self.cert, &self.key, &amqp.cert, &amqp.key) {
            (Some(c), Some(k), _, _) => (Setting { name: "management_tls_cert", path: c }, Setting { name: "management_tls_key", path: k }),
            (None, None, Some(c), Some(k)) => (Setting { name: "tls_cert", path: c }, Setting { name: "tls_key", path: k }),
            (Some(_), None, _, _) => return invalid("management_tls_cert needs management_tls_key (the PEM private key)"),
            (None, Some(_), _, _) => return invalid("management_tls_key needs management_tls_cert (the PEM certificate chain)"),
            (None, None, _, _) => {
                return invalid(
                    "management_tls_listen needs a certificate and key: management_tls_cert and management_tls_key, or tls_cert and tls_key (shared with the amqps listener)",
                )
            }
        };
        let ca = match (&self.ca, &amqp.ca) {
            (Some(path), _) => Some(Setting { name: "management_tls_ca", path }),
            (None, Some(path)) => Some(Setting { name: "tls_ca", path }),
            (None, None) => None,
        };
        if self.fail_if_no_peer_cert && ca.is_none() {
            return invalid("management_tls_fail_if_no_peer_cert needs a CA bundle: management_tls_ca or tls_ca");
        }
        let mut server = server_config(&ServerFiles { cert, key, ca, fail_if_no_peer_cert: self.fail_if_no_peer_cert })?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(ManagementTls { listen, verify_peer: ca.is_some(), cert_from: cert.name, server: Arc::new(server) }))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::tests::{load, refused};

    /// A self-signed certificate for localhost and its key as PEM files `name.pem`/`name.key`
    /// in `dir`: their paths as strings.
    fn self_signed(dir: &Path, name: &str) -> (String, String) {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert, ck.cert.pem()).expect("write");
        std::fs::write(&key, ck.signing_key.serialize_pem()).expect("write");
        (cert.display().to_string(), key.display().to_string())
    }

    const LISTEN: [&str; 2] = ["--management-tls-listen", "127.0.0.1:15671"];

    #[test]
    fn off_by_default_and_its_options_need_the_listen_address() {
        assert!(load(&[], "").unwrap().management_tls.is_none());
        let m = refused(&["--management-tls-ca", "ca.pem"], "");
        assert!(m.contains("need management_tls_listen"), "{m}");
        let m = refused(&[], "management_tls_fail_if_no_peer_cert = true");
        assert!(m.contains("need management_tls_listen"), "{m}");
    }

    #[test]
    fn its_own_pair_wins_and_the_amqps_pair_is_the_fallback() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (c1, k1) = self_signed(dir.path(), "amqps");
        let (c2, k2) = self_signed(dir.path(), "mgmt");
        let own = load(&[&LISTEN[..], &["--management-tls-cert", &c2, "--management-tls-key", &k2]].concat(), "").unwrap();
        let own = own.management_tls.expect("on");
        assert_eq!((own.listen.port(), own.cert_from, own.verify_peer), (15671, "management_tls_cert", false));
        assert_eq!(own.server.alpn_protocols, vec![b"http/1.1".to_vec()]);
        // tls_cert/tls_key without tls_listen: lent to the management listener, no amqps one.
        let lent = load(&[&LISTEN[..], &["--tls-cert", &c1, "--tls-key", &k1]].concat(), "").unwrap();
        assert!(lent.tls.is_none());
        assert_eq!(lent.management_tls.expect("on").cert_from, "tls_cert");
        // The TOML keys, and the CA inherited from tls_ca.
        let toml = format!("management_tls_listen = \"127.0.0.1:15671\"\ntls_cert = {c1:?}\ntls_key = {k1:?}\ntls_ca = {c1:?}\n");
        let from_file = load(&[], &toml).unwrap().management_tls.expect("on");
        assert!(from_file.verify_peer);
        // With its own pair and its own CA, the amqps files lent to nothing are refused.
        let m = refused(
            &[&LISTEN[..], &["--management-tls-cert", &c2, "--management-tls-key", &k2, "--management-tls-ca", &c2, "--tls-ca", &c1]]
                .concat(),
            "",
        );
        assert!(m.contains("tls_ca is used by no listener") && m.contains("has its own"), "{m}");
    }

    #[test]
    fn what_is_missing_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (c, k) = self_signed(dir.path(), "mgmt");
        let m = refused(&LISTEN, "");
        assert!(m.contains("management_tls_cert and management_tls_key, or tls_cert and tls_key"), "{m}");
        let m = refused(&[&LISTEN[..], &["--management-tls-cert", &c]].concat(), "");
        assert!(m.contains("management_tls_cert needs management_tls_key"), "{m}");
        let m = refused(&[&LISTEN[..], &["--management-tls-key", &k, "--tls-cert", &c, "--tls-key", &k]].concat(), "");
        assert!(m.contains("management_tls_key needs management_tls_cert"), "{m}");
        let pair = ["--management-tls-cert", c.as_str(), "--management-tls-key", k.as_str()];
        let m = refused(&[&LISTEN[..], &pair, &["--management-tls-fail-if-no-peer-cert"]].concat(), "");
        assert!(m.contains("needs a CA bundle: management_tls_ca or tls_ca"), "{m}");
        let missing = dir.path().join("missing.pem").display().to_string();
        let m = refused(&[&LISTEN[..], &["--management-tls-cert", &missing, "--management-tls-key", &k]].concat(), "");
        assert!(m.contains("missing.pem") && m.contains("cannot read"), "{m}");
        let m = refused(&[&LISTEN[..], &pair, &["--management-tls-ca", &k]].concat(), "");
        assert!(m.contains("management_tls_ca") && m.contains("mgmt.key"), "{m}");
        let m = refused(&[&LISTEN[..], &pair, &["--management-listen", "127.0.0.1:15671"]].concat(), "");
        assert!(m.contains("management TLS listen address 127.0.0.1:15671 is also"), "{m}");
    }
}
