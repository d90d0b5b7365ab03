//! The one thing the EXTERNAL mechanism needs from a client certificate: its subject's
//! common name (RabbitMQ's `ssl_cert_login_from = common_name`). Pure DER reading (X.690)
//! of the few fields in front of the subject (RFC 5280 4.1); rustls has already verified
//! the certificate, so this only walks it, and gives `None` on anything it cannot read.

/// DER tags used here (universal class, one byte).
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const INTEGER: u8 = 0x02;
const OID: u8 = 0x06;
/// `[0] EXPLICIT Version` in TBSCertificate.
const VERSION: u8 = 0xa0;
/// id-at-commonName, 2.5.4.3, as DER content bytes.
const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];

/// Splits one DER element off `input`: (tag, content, rest). `None` for a multi-byte tag,
/// an indefinite or over-long length, or content past the end.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    if tag & 0x1f == 0x1f {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The content of the element of `input` tagged `tag`, and what follows it.
fn expect(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (t, content, rest) = element(input)?;
    (t == tag).then_some((content, rest))
}

/// A directory string's text: UTF8String, PrintableString, IA5String, TeletexString (read as
/// UTF-8, as RabbitMQ does in practice) or BMPString (UTF-16BE).
fn directory_string(tag: u8, content: &[u8]) -> Option<String> {
    match tag {
        0x0c | 0x13 | 0x16 | 0x14 => std::str::from_utf8(content).ok().map(str::to_owned),
        0x1e if content.len().is_multiple_of(2) => {
            let units: Vec<u16> = content.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
            String::from_utf16(&units).ok()
        }
        _ => None,
    }
}

/// The subject common name of a DER-encoded X.509 certificate; several CN attributes are
/// joined with `,` in the order they appear. `None` when the subject has no common name or
/// the certificate cannot be read.
pub fn subject_common_name(cert_der: &[u8]) -> Option<String> {
    let (cert, _) = expect(cert_der, SEQUENCE)?;
    let (tbs, _) = expect(cert, SEQUENCE)?;
    let tbs = match element(tbs)? {
        (VERSION, _, rest) => rest,
        _ => tbs,
    };
    let (_serial, tbs) = expect(tbs, INTEGER)?;
    let (_signature, tbs) = expect(tbs, SEQUENCE)?;
    let (_issuer, tbs) = expect(tbs, SEQUENCE)?;
    let (_validity, tbs) = expect(tbs, SEQUENCE)?;
    let (mut rdns, _) = expect(tbs, SEQUENCE)?;
    let mut names = Vec::new();
    while !rdns.is_empty() {
        let (mut set, rest) = expect(rdns, SET)?;
        rdns = rest;
        while !set.is_empty() {
            let (attribute, rest) = expect(set, SEQUENCE)?;
            set = rest;
            let (oid, value) = expect(attribute, OID)?;
            if oid == COMMON_NAME {
                let (tag, content, _) = element(value)?;
                names.push(directory_string(tag, content)?);
            }
        }
    }
    (!names.is_empty()).then(|| names.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cert_with(subject: rcgen::DistinguishedName) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).expect("params");
        params.distinguished_name = subject;
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    #[test]
    fn reads_the_subject_common_name() {
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CountryName, "NL");
        dn.push(rcgen::DnType::OrganizationName, "ringmq tests");
        dn.push(rcgen::DnType::CommonName, "alice");
        assert_eq!(subject_common_name(&cert_with(dn)).as_deref(), Some("alice"));
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, rcgen::DnValue::PrintableString("bob".try_into().expect("printable")));
        assert_eq!(subject_common_name(&cert_with(dn)).as_deref(), Some("bob"));
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, rcgen::DnValue::BmpString("zoë".try_into().expect("bmp")));
        assert_eq!(subject_common_name(&cert_with(dn)).as_deref(), Some("zoë"));
    }

    #[test]
    fn no_common_name_or_garbage_is_none() {
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::OrganizationName, "no cn here");
        assert_eq!(subject_common_name(&cert_with(dn)), None);
        assert_eq!(subject_common_name(&[]), None);
        assert_eq!(subject_common_name(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, "carol");
        let der = cert_with(dn);
        assert_eq!(subject_common_name(&der[..der.len() / 2]), None, "a truncated certificate");
    }

    proptest! {
        #[test]
        fn never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = subject_common_name(&bytes);
        }
    }
}
