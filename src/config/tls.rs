//! The amqps listener's settings (`--tls-listen`, `--tls-cert`, `--tls-key`, `--tls-ca`,
//! `--tls-fail-if-no-peer-cert`) and the rustls server configuration built from them at load,
//! so that a missing or malformed file stops the start with an error naming its path.
//!
//! # Invariants
//! - A loaded [`Tls`] has at least one listen address, a certificate chain of at least one
//!   certificate, and a private key that matches the chain's first certificate.
//! - With a CA bundle, a client certificate is asked for and verified against it (a bad one
//!   fails the TLS handshake); without one, none is asked for. `fail_if_no_peer_cert` (only
//!   meaningful with a CA bundle) makes a client that presents none fail the handshake too.
//! - The crypto provider is rustls's `ring`; protocol versions are rustls's safe defaults
//!   (TLS 1.2 and 1.3).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_rustls::rustls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use super::ConfigError;

/// The TLS settings as given (flags over the TOML file), before any file is read.
#[derive(Clone, Debug, Default)]
pub struct TlsSettings {
    /// amqps listen addresses; empty: no TLS listener.
    pub listen: Vec<SocketAddr>,
    /// PEM file with the server's certificate chain, leaf first.
    pub cert: Option<PathBuf>,
    /// PEM file with the server's private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key: Option<PathBuf>,
    /// PEM file with the CA certificates that client certificates are verified against.
    pub ca: Option<PathBuf>,
    /// Refuse a client that presents no certificate (RabbitMQ's `fail_if_no_peer_cert`).
    pub fail_if_no_peer_cert: bool,
}

/// The amqps listener: where it listens and the rustls configuration it accepts with.
#[derive(Clone, Debug)]
pub struct Tls {
    /// amqps listen addresses (at least one).
    pub listen: Vec<SocketAddr>,
    /// Client certificates are asked for and verified (a CA bundle was given): a verified
    /// client may log in with the EXTERNAL mechanism.
    pub verify_peer: bool,
    /// The rustls server configuration shared by every core's acceptor.
    pub server: Arc<ServerConfig>,
}

impl TlsSettings {
    /// Reads the certificate, key and CA files and builds the server configuration; `None`
    /// when no TLS listen address is given.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting and the path: a TLS option without
    /// `tls_listen`, `tls_listen` without `tls_cert` or `tls_key`, a file that cannot be read,
    /// holds no PEM certificate (or key), or a key that does not match the certificate.
    pub fn build(&self) -> Result<Option<Tls>, ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.listen.is_empty() {
            if self.cert.is_some() || self.key.is_some() || self.ca.is_some() || self.fail_if_no_peer_cert {
                return invalid("tls_cert, tls_key, tls_ca and tls_fail_if_no_peer_cert need tls_listen (the amqps address)".into());
            }
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            return invalid("tls_listen needs tls_cert (PEM certificate chain) and tls_key (PEM private key)".into());
        };
        if self.fail_if_no_peer_cert && self.ca.is_none() {
            return invalid("tls_fail_if_no_peer_cert needs tls_ca (the CA bundle client certificates are verified against)".into());
        }
        let chain = read_certs("tls_cert", cert)?;
        let key_der = PrivateKeyDer::from_pem_file(cert_path(key)?)
            .map_err(|e| ConfigError::Invalid(format!("tls_key {}: no PEM private key read: {e}", key.display())))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError::Invalid(format!("TLS: {e}")))?;
        let builder = match &self.ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in read_certs("tls_ca", ca)? {
                    roots.add(c).map_err(|e| ConfigError::Invalid(format!("tls_ca {}: {e}", ca.display())))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                let verifier = if self.fail_if_no_peer_cert { verifier } else { verifier.allow_unauthenticated() };
                let verifier = verifier.build().map_err(|e| ConfigError::Invalid(format!("tls_ca {}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let server = builder
            .with_single_cert(chain, key_der)
            .map_err(|e| ConfigError::Invalid(format!("tls_cert {} with tls_key {}: {e}", cert.display(), key.display())))?;
        Ok(Some(Tls { listen: self.listen.clone(), verify_peer: self.ca.is_some(), server: Arc::new(server) }))
    }
}

/// `path` when it can be opened (so that a missing file is reported as such, not as "no PEM").
fn cert_path(path: &Path) -> Result<&Path, ConfigError> {
    std::fs::File::open(path).map_err(|e| ConfigError::Invalid(format!("cannot read {}: {e}", path.display())))?;
    Ok(path)
}

/// Every PEM certificate of `path` (at least one); `what` names the setting in errors.
fn read_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bad = |e: String| ConfigError::Invalid(format!("{what} {}: {e}", path.display()));
    let certs = CertificateDer::pem_file_iter(cert_path(path)?)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in the file".into()));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and its key, as PEM files in `dir`.
    fn self_signed(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert, ck.cert.pem()).expect("write");
        std::fs::write(&key, ck.signing_key.serialize_pem()).expect("write");
        (cert, key)
    }

    fn settings(cert: &Path, key: &Path) -> TlsSettings {
        TlsSettings {
            listen: vec!["127.0.0.1:5671".parse().expect("literal")],
            cert: Some(cert.into()),
            key: Some(key.into()),
            ..Default::default()
        }
    }

    fn refused(s: &TlsSettings) -> String {
        match s.build() {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn no_listen_is_no_tls_and_a_stray_option_is_refused() {
        assert!(TlsSettings::default().build().expect("ok").is_none());
        let m = refused(&TlsSettings { cert: Some("x.pem".into()), ..Default::default() });
        assert!(m.contains("need tls_listen"), "{m}");
    }

    #[test]
    fn a_good_pair_builds_and_the_ca_turns_on_peer_verification() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = self_signed(dir.path(), "server");
        let tls = settings(&cert, &key).build().expect("builds").expect("on");
        assert!(!tls.verify_peer);
        let tls = TlsSettings { ca: Some(cert.clone()), ..settings(&cert, &key) }.build().expect("builds").expect("on");
        assert!(tls.verify_peer);
    }

    #[test]
    fn missing_empty_and_mismatched_files_name_their_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = self_signed(dir.path(), "a");
        let (_, other_key) = self_signed(dir.path(), "b");
        let missing = dir.path().join("missing.pem");
        let m = refused(&settings(&missing, &key));
        assert!(m.contains("missing.pem") && m.contains("cannot read"), "{m}");
        let m = refused(&settings(&cert, &missing));
        assert!(m.contains("missing.pem"), "{m}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not pem\n").expect("write");
        let m = refused(&settings(&empty, &key));
        assert!(m.contains("empty.pem") && m.contains("no PEM certificate"), "{m}");
        let m = refused(&settings(&cert, &empty));
        assert!(m.contains("tls_key") && m.contains("empty.pem"), "{m}");
        let m = refused(&settings(&cert, &other_key));
        assert!(m.contains("a.pem") && m.contains("b.key"), "{m}");
        let m = refused(&TlsSettings { ca: Some(empty.clone()), ..settings(&cert, &key) });
        assert!(m.contains("tls_ca") && m.contains("empty.pem"), "{m}");
        let m = refused(&TlsSettings { key: None, ..settings(&cert, &key) });
        assert!(m.contains("needs tls_cert"), "{m}");
        let m = refused(&TlsSettings { fail_if_no_peer_cert: true, ..settings(&cert, &key) });
        assert!(m.contains("needs tls_ca"), "{m}");
    }
}
