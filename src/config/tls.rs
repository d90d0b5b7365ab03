//! The TLS settings: the amqps listener's (`--tls-listen`, `--tls-cert`, `--tls-key`,
//! `--tls-ca`, `--tls-fail-if-no-peer-cert`) and the management API's HTTPS listener's
//! (`--management-tls-*`, [`super::management_tls`]), and the rustls server configurations
//! built from them at load, so that a missing or malformed file stops the start with an error
//! naming its setting and path.
//!
//! # Invariants
//! - A loaded [`Tls`] has at least one listen address, a certificate chain of at least one
//!   certificate, and a private key that matches the chain's first certificate.
//! - With a CA bundle, a client certificate is asked for and verified against it (a bad one
//!   fails the TLS handshake); without one, none is asked for. `fail_if_no_peer_cert` (only
//!   meaningful with a CA bundle) makes a client that presents none fail the handshake too.
//! - The crypto provider is rustls's `ring`; protocol versions are rustls's safe defaults
//!   (TLS 1.2 and 1.3).
//! - A TLS setting that no listener uses is refused (`tls_cert` without `tls_listen`, unless
//!   the management HTTPS listener borrows it), never silently ignored.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_rustls::rustls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use super::management_tls::{ManagementTls, ManagementTlsSettings};
use super::{ConfigError, FileConfig, OneOrMany};

/// The TLS flags, part of [`super::Cli`] (each also a TOML key, `_` for `-`).
#[derive(clap::Args, Debug, Default)]
pub struct TlsArgs {
    /// AMQP-over-TLS (amqps) listen address, conventionally port 5671; give it more than once
    /// to listen on several. Needs --tls-cert and --tls-key [default: none, no TLS listener]
    #[arg(long, value_name = "ADDR:PORT", action = clap::ArgAction::Append)]
    pub tls_listen: Vec<SocketAddr>,
    /// PEM file with the server's certificate chain, leaf first (for --tls-listen, and for
    /// --management-tls-listen without --management-tls-cert)
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM file with the server's private key: PKCS#8, RSA (PKCS#1) or EC (SEC1)
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// PEM file with CA certificates: clients are asked for a certificate, which must verify
    /// against them, and a client with one may log in with EXTERNAL as the user named by
    /// its subject's common name [default: none, no client certificates asked for]
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// With --tls-ca: refuse a TLS client that presents no certificate (RabbitMQ's
    /// fail_if_no_peer_cert)
    #[arg(long)]
    pub tls_fail_if_no_peer_cert: bool,
    /// Management API over HTTPS listen address, conventionally port 15671 (RabbitMQ's
    /// management.ssl.port); the plain --management-listen keeps serving beside it. Uses
    /// --management-tls-cert/--management-tls-key, else --tls-cert/--tls-key
    /// [default: none, no HTTPS listener]
    #[arg(long, value_name = "ADDR:PORT")]
    pub management_tls_listen: Option<SocketAddr>,
    /// PEM certificate chain of the management HTTPS listener (with --management-tls-key)
    /// [default: --tls-cert]
    #[arg(long, value_name = "FILE")]
    pub management_tls_cert: Option<PathBuf>,
    /// PEM private key of the management HTTPS listener (with --management-tls-cert)
    /// [default: --tls-key]
    #[arg(long, value_name = "FILE")]
    pub management_tls_key: Option<PathBuf>,
    /// PEM CA bundle the management HTTPS listener verifies client certificates against
    /// (a client without one still gets in, and still logs in with basic auth)
    /// [default: --tls-ca, else none asked for]
    #[arg(long, value_name = "FILE")]
    pub management_tls_ca: Option<PathBuf>,
    /// Refuse an HTTPS client of the management API that presents no certificate; needs a
    /// CA bundle (--management-tls-ca or --tls-ca). Not inherited from
    /// --tls-fail-if-no-peer-cert
    #[arg(long)]
    pub management_tls_fail_if_no_peer_cert: bool,
}

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

/// Flags over the file for both TLS listeners, then each built ([`TlsSettings::build`],
/// [`ManagementTlsSettings::build`]).
///
/// # Errors
/// [`ConfigError::Invalid`]: a setting no listener uses, or the builds' errors.
pub(super) fn load(args: TlsArgs, file: &FileConfig) -> Result<(Option<Tls>, Option<ManagementTls>), ConfigError> {
    let amqp = TlsSettings {
        listen: match (args.tls_listen, &file.tls_listen) {
            (given, _) if !given.is_empty() => given,
            (_, Some(OneOrMany::One(a))) => a.addrs.clone(),
            (_, Some(OneOrMany::Many(list))) => list.iter().flat_map(|a| a.addrs.iter().copied()).collect(),
            (_, None) => Vec::new(),
        },
        cert: args.tls_cert.or_else(|| file.tls_cert.clone()),
        key: args.tls_key.or_else(|| file.tls_key.clone()),
        ca: args.tls_ca.or_else(|| file.tls_ca.clone()),
        fail_if_no_peer_cert: args.tls_fail_if_no_peer_cert || file.tls_fail_if_no_peer_cert.unwrap_or(false),
    };
    let management = ManagementTlsSettings {
        listen: args.management_tls_listen.or(file.management_tls_listen),
        cert: args.management_tls_cert.or_else(|| file.management_tls_cert.clone()),
        key: args.management_tls_key.or_else(|| file.management_tls_key.clone()),
        ca: args.management_tls_ca.or_else(|| file.management_tls_ca.clone()),
        fail_if_no_peer_cert: args.management_tls_fail_if_no_peer_cert || file.management_tls_fail_if_no_peer_cert.unwrap_or(false),
    };
    let management_tls = management.build(&amqp)?;
    if amqp.listen.is_empty() {
        check_unused(&amqp, &management)?;
    }
    Ok((amqp.build()?, management_tls))
}

/// Refuses a TLS listen address that another listener of `c` also binds (see
/// [`super::same_socket`]): amqps on an AMQP address, management HTTPS on any other.
///
/// # Errors
/// [`ConfigError::Invalid`] naming both addresses.
pub(super) fn check_addresses(c: &super::Config) -> Result<(), ConfigError> {
    let clash = |what: &str, a: SocketAddr, other: &str, b: SocketAddr| {
        Err(ConfigError::Invalid(format!("the {what} listen address {a} is also the {other} listen address {b}")))
    };
    let amqps = c.tls.as_ref().map_or(&[][..], |t| &t.listen[..]);
    for &t in amqps {
        if let Some(&p) = c.listen.iter().find(|&&p| super::same_socket(t, p)) {
            return clash("TLS", t, "AMQP", p);
        }
    }
    let Some(m) = c.management_tls.as_ref().map(|m| m.listen) else { return Ok(()) };
    let others = c.listen.iter().map(|&a| ("AMQP", a)).chain(amqps.iter().map(|&a| ("amqps", a)));
    let others = others.chain(c.management_listen.map(|a| ("management", a))).chain([("metrics", c.metrics_listen)]);
    for (other, b) in others {
        if super::same_socket(m, b) {
            return clash("management TLS", m, other, b);
        }
    }
    Ok(())
}

/// Without an amqps listener, refuses the amqps settings the management HTTPS listener does
/// not borrow either (it borrows `tls_cert` and `tls_key` when it has no pair of its own, and
/// `tls_ca` when it has no CA of its own).
fn check_unused(amqp: &TlsSettings, management: &ManagementTlsSettings) -> Result<(), ConfigError> {
    let lends_pair = management.listen.is_some() && management.cert.is_none() && management.key.is_none();
    let lends_ca = management.listen.is_some() && management.ca.is_none();
    let unused = [
        (amqp.cert.is_some() && !lends_pair, "tls_cert"),
        (amqp.key.is_some() && !lends_pair, "tls_key"),
        (amqp.ca.is_some() && !lends_ca, "tls_ca"),
        (amqp.fail_if_no_peer_cert, "tls_fail_if_no_peer_cert"),
    ];
    match unused.iter().find(|(set, _)| *set) {
        Some((_, name)) => Err(ConfigError::Invalid(format!(
            "{name} is used by no listener: it needs tls_listen (the amqps address){}",
            if management.listen.is_some() { "; the management TLS listener has its own setting for it" } else { "" }
        ))),
        None => Ok(()),
    }
}

impl TlsSettings {
    /// Reads the certificate, key and CA files and builds the server configuration; `None`
    /// when no TLS listen address is given (whether settings without one are used elsewhere
    /// is [`load`]'s check).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting and the path: `tls_listen` without
    /// `tls_cert` or `tls_key`, `tls_fail_if_no_peer_cert` without `tls_ca`, a file that cannot be read, holds no PEM certificate (or
    /// key), or a key that does not match the certificate.
    pub fn build(&self) -> Result<Option<Tls>, ConfigError> {
        if self.listen.is_empty() {
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            return Err(ConfigError::Invalid("tls_listen needs tls_cert (PEM certificate chain) and tls_key (PEM private key)".into()));
        };
        if self.fail_if_no_peer_cert && self.ca.is_none() {
            return Err(ConfigError::Invalid(
                "tls_fail_if_no_peer_cert needs tls_ca (the CA bundle client certificates are verified against)".into(),
            ));
        }
        let server = server_config(&ServerFiles {
            cert: Setting { name: "tls_cert", path: cert },
            key: Setting { name: "tls_key", path: key },
            ca: self.ca.as_deref().map(|path| Setting { name: "tls_ca", path }),
            fail_if_no_peer_cert: self.fail_if_no_peer_cert,
        })?;
        Ok(Some(Tls { listen: self.listen.clone(), verify_peer: self.ca.is_some(), server: Arc::new(server) }))
    }
}

/// A file setting: its name (for errors, e.g. `tls_cert`) and its path.
#[derive(Clone, Copy, Debug)]
pub(super) struct Setting<'a> {
    /// The TOML name of the setting the path came from.
    pub name: &'static str,
    /// The file.
    pub path: &'a Path,
}

/// What one rustls server configuration is built from.
pub(super) struct ServerFiles<'a> {
    /// PEM certificate chain, leaf first.
    pub cert: Setting<'a>,
    /// PEM private key of the chain's leaf.
    pub key: Setting<'a>,
    /// PEM CA bundle for client certificates; `None`: none asked for.
    pub ca: Option<Setting<'a>>,
    /// With `ca`: a client without a certificate fails the handshake (without `ca` no
    /// certificate is asked for: the callers refuse that combination).
    pub fail_if_no_peer_cert: bool,
}

/// Reads `files` and builds a rustls server configuration on the ring provider.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the setting and path: a file that cannot be read or holds no
/// PEM item, a CA bundle rustls refuses, a key that does not match the certificate.
pub(super) fn server_config(files: &ServerFiles<'_>) -> Result<ServerConfig, ConfigError> {
    let (cert, key) = (files.cert, files.key);
    let chain = read_certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_file(cert_path(key.path)?)
        .map_err(|e| ConfigError::Invalid(format!("{} {}: no PEM private key read: {e}", key.name, key.path.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Invalid(format!("TLS: {e}")))?;
    let builder = match files.ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let bad = |e: String| ConfigError::Invalid(format!("{} {}: {e}", ca.name, ca.path.display()));
            let mut roots = RootCertStore::empty();
            for c in read_certs(ca)? {
                roots.add(c).map_err(|e| bad(e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if files.fail_if_no_peer_cert { verifier } else { verifier.allow_unauthenticated() };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| bad(e.to_string()))?)
        }
    };
    builder
        .with_single_cert(chain, key_der)
        .map_err(|e| ConfigError::Invalid(format!("{} {} with {} {}: {e}", cert.name, cert.path.display(), key.name, key.path.display())))
}

/// `path` when it can be opened (so that a missing file is reported as such, not as "no PEM").
fn cert_path(path: &Path) -> Result<&Path, ConfigError> {
    std::fs::File::open(path).map_err(|e| ConfigError::Invalid(format!("cannot read {}: {e}", path.display())))?;
    Ok(path)
}

/// Every PEM certificate of the file `s` names (at least one).
fn read_certs(s: Setting<'_>) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bad = |e: String| ConfigError::Invalid(format!("{} {}: {e}", s.name, s.path.display()));
    let certs = CertificateDer::pem_file_iter(cert_path(s.path)?)
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
        let m = crate::config::tests::refused(&["--tls-cert", "x.pem", "--tls-key", "x.key"], "");
        assert!(m.contains("tls_cert is used by no listener: it needs tls_listen"), "{m}");
        let m = crate::config::tests::refused(&[], "tls_fail_if_no_peer_cert = true");
        assert!(m.contains("tls_fail_if_no_peer_cert is used by no listener"), "{m}");
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
