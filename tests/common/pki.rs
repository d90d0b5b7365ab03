//! Test certificates, made at test time with rcgen into a temp dir, and a blocking rustls
//! client config: for the TLS tests (tests/tls.rs: amqps, tests/management_tls.rs: HTTPS).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_rustls::rustls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate and its key as PEM files.
pub struct Pem {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The test PKI: a CA, a server certificate and client certificates it signed, and a client
/// certificate from another CA.
pub struct Pki {
    _dir: tempfile::TempDir,
    pub ca: PathBuf,
    /// CN=localhost, for localhost and 127.0.0.1.
    pub server: Pem,
    /// CN=guest, signed by the CA.
    pub guest: Pem,
    /// CN=nobody (no such user), signed by the CA.
    pub nobody: Pem,
    /// CN=guest, signed by another CA.
    pub rogue: Pem,
}

fn ca_params(name: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign, rcgen::KeyUsagePurpose::DigitalSignature];
    p
}

fn write_pem(dir: &Path, name: &str, cert: &rcgen::Certificate, key: &rcgen::KeyPair) -> Pem {
    let pem = Pem { cert: dir.join(format!("{name}.crt")), key: dir.join(format!("{name}.key")) };
    std::fs::write(&pem.cert, cert.pem()).expect("write cert");
    std::fs::write(&pem.key, key.serialize_pem()).expect("write key");
    pem
}

/// A leaf certificate for `sans` with subject CN `cn`, signed by `issuer`.
fn leaf(dir: &Path, name: &str, cn: &str, sans: &[&str], issuer: &rcgen::Issuer<'_, rcgen::KeyPair>) -> Pem {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("params");
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    p.use_authority_key_identifier_extension = true;
    let cert = p.signed_by(&key, issuer).expect("sign");
    write_pem(dir, name, &cert, &key)
}

impl Pki {
    /// Makes the CA and the certificates in a fresh temp dir (removed on drop).
    pub fn new() -> Pki {
        let dir = tempfile::Builder::new().prefix("ringmq-tls-").tempdir().expect("tempdir");
        let d = dir.path();
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let ca_cert = ca_params("ringmq test CA").self_signed(&ca_key).expect("ca");
        let ca = write_pem(d, "ca", &ca_cert, &ca_key).cert;
        let issuer = rcgen::Issuer::new(ca_params("ringmq test CA"), ca_key);
        let server = leaf(d, "server", "localhost", &["localhost", "127.0.0.1"], &issuer);
        let guest = leaf(d, "guest", "guest", &[], &issuer);
        let nobody = leaf(d, "nobody", "nobody", &[], &issuer);
        let rogue_key = rcgen::KeyPair::generate().expect("key");
        let rogue_issuer = rcgen::Issuer::new(ca_params("some other CA"), rogue_key);
        let rogue = leaf(d, "rogue", "guest", &[], &rogue_issuer);
        Pki { _dir: dir, ca, server, guest, nobody, rogue }
    }
}

/// `p` as a `&str`-able string (test paths are UTF-8).
pub fn path(p: &Path) -> String {
    p.to_str().expect("utf-8 path").to_owned()
}

/// A rustls client config (ring provider) trusting `ca`, presenting `client` if given, and
/// offering the ALPN protocols `alpn`.
pub fn client_config(ca: &Path, client: Option<&Pem>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).expect("ca") {
        roots.add(c.expect("ca cert")).expect("add");
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let mut config = match client {
        Some(c) => {
            let chain = CertificateDer::pem_file_iter(&c.cert).expect("cert").collect::<Result<Vec<_>, _>>().expect("cert");
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(&c.key).expect("key")).expect("client auth")
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}
