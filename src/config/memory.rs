//! `--memory-high-watermark`: RabbitMQ's `vm_memory_high_watermark`, as a fraction of the
//! memory available to the process (`0.4`: RabbitMQ's `.relative`) or as a byte count
//! (`536870912`, `512MiB`, `1GB`: its `.absolute`).

use std::fmt;

/// Default: 0.4 of the available memory (RabbitMQ's default before 4.0).
pub const DEFAULT_MEMORY_HIGH_WATERMARK: Watermark = Watermark::Relative(0.4);

/// The memory alarm's threshold as configured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Watermark {
    /// A fraction of the available memory (RAM, or the cgroup's limit when lower); 0 turns
    /// the alarm off.
    Relative(f64),
    /// Bytes of resident memory.
    Absolute(u64),
}

impl Watermark {
    /// Parses `0.4` (a fraction, 0 ≤ x < 1; `0` is off), `536870912` (bytes), or a byte count
    /// with a unit: `kB`/`MB`/`GB` (powers of 1000) or `KiB`/`MiB`/`GiB` (powers of 1024).
    ///
    /// # Errors
    /// A message naming the value when it is none of these.
    pub fn parse(s: &str) -> Result<Watermark, String> {
        let t = s.trim();
        let bad = || format!("{s:?}: expected a fraction such as 0.4, or bytes such as 536870912 or 512MiB");
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = (&t[..split], t[split..].trim());
        if unit.is_empty() && num.contains('.') {
            let f: f64 = num.parse().map_err(|_| bad())?;
            return if (0.0..1.0).contains(&f) { Ok(Watermark::Relative(f)) } else { Err(bad()) };
        }
        if num.is_empty() || num.contains('.') {
            return Err(bad());
        }
        let n: u64 = num.parse().map_err(|_| bad())?;
        let scale: u64 = match unit.to_ascii_lowercase().as_str() {
            "" if n == 0 => return Ok(Watermark::Relative(0.0)),
            "" | "b" => 1,
            "kb" | "k" => 1_000,
            "mb" | "m" => 1_000_000,
            "gb" | "g" => 1_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            _ => return Err(bad()),
        };
        n.checked_mul(scale).map(Watermark::Absolute).ok_or_else(bad)
    }

    /// Parses a byte count alone (`50000000`, `50MB`, `1GiB`: the units of [`Watermark::parse`]),
    /// as `--disk-free-limit` and `ringmqctl set_disk_free_limit` take it.
    ///
    /// # Errors
    /// A message naming the value when it is not a byte count.
    pub fn parse_bytes(s: &str) -> Result<u64, String> {
        match Watermark::parse(s) {
            Ok(Watermark::Absolute(n)) => Ok(n),
            Ok(Watermark::Relative(0.0)) => Ok(0),
            _ => Err(format!("{s:?}: expected bytes such as 50000000, 50MB or 1GiB")),
        }
    }

    /// The threshold in bytes for a process that may use `available` bytes; 0 = off.
    pub fn bytes(self, available: u64) -> u64 {
        match self {
            Watermark::Relative(f) => (available as f64 * f) as u64,
            Watermark::Absolute(n) => n,
        }
    }
}

/// A TOML byte count given as a number (`50000000`) or as the flag takes it (`"50MB"`,
/// `"1GiB"`: [`Watermark::parse_bytes`]), for `disk_free_limit`.
///
/// # Errors
/// The parse error of a text that is not a byte count, or a value of another type.
pub(super) fn bytes_or_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Bytes {
        Number(u64),
        Text(String),
    }
    match <Bytes as serde::Deserialize>::deserialize(d)? {
        Bytes::Number(n) => Ok(Some(n)),
        Bytes::Text(t) => Watermark::parse_bytes(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

impl fmt::Display for Watermark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Watermark::Relative(x) => write!(f, "{x}"),
            Watermark::Absolute(n) => write!(f, "{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_disk_free_limit_takes_a_number_or_the_flags_text() {
        use super::super::tests::load;
        assert_eq!(load(&[], "disk_free_limit = \"1GB\"").unwrap().disk_free_limit, 1_000_000_000);
        assert_eq!(load(&[], "disk_free_limit = \"512MiB\"").unwrap().disk_free_limit, 512 << 20);
        assert_eq!(load(&[], "disk_free_limit = 50000000").unwrap().disk_free_limit, 50_000_000);
        let e = toml::from_str::<super::super::FileConfig>("disk_free_limit = \"lots\"").unwrap_err();
        assert!(e.to_string().contains("expected bytes"), "{e}");
    }

    #[test]
    fn fractions_bytes_and_units() {
        assert_eq!(Watermark::parse("0.4"), Ok(Watermark::Relative(0.4)));
        assert_eq!(Watermark::parse("0"), Ok(Watermark::Relative(0.0)));
        assert_eq!(Watermark::parse("536870912"), Ok(Watermark::Absolute(536_870_912)));
        assert_eq!(Watermark::parse("512MiB"), Ok(Watermark::Absolute(512 << 20)));
        assert_eq!(Watermark::parse("1 GB"), Ok(Watermark::Absolute(1_000_000_000)));
        assert_eq!(Watermark::parse("2gib"), Ok(Watermark::Absolute(2 << 30)));
        for bad in ["", "1.5", "-1", "0.4GB", "12XB", "abc", "99999999999999999999GB"] {
            assert!(Watermark::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn byte_counts_alone() {
        assert_eq!(Watermark::parse_bytes("50MB"), Ok(50_000_000));
        assert_eq!(Watermark::parse_bytes("0"), Ok(0));
        assert_eq!(Watermark::parse_bytes("1024"), Ok(1024));
        assert!(Watermark::parse_bytes("0.4").is_err());
        assert!(Watermark::parse_bytes("lots").is_err());
    }

    #[test]
    fn bytes_of_a_fraction_follow_the_available_memory() {
        assert_eq!(Watermark::Relative(0.5).bytes(1 << 30), 1 << 29);
        assert_eq!(Watermark::Relative(0.0).bytes(1 << 30), 0);
        assert_eq!(Watermark::Absolute(7).bytes(1 << 30), 7);
    }
}
