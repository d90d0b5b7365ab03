//! Which core owns a queue: one pure function, recorded in the metadata at declare time.

/// Owner core of queue `name` in `vhost` among `cores` cores: FNV-1a over
/// `vhost \0 name`, modulo `cores`. Stable across runs and platforms.
pub fn owner_core(vhost: &str, name: &str, cores: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in vhost.bytes().chain(std::iter::once(0)).chain(name.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % cores.max(1) as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn in_range_and_stable(v in ".{0,8}", n in ".{0,16}", cores in 1u32..64) {
            let c = owner_core(&v, &n, cores);
            prop_assert!(c < cores);
            prop_assert_eq!(c, owner_core(&v, &n, cores));
        }
    }

    #[test]
    fn spreads() {
        let mut seen = [0u32; 4];
        for i in 0..400 {
            seen[owner_core("/", &format!("q{i}"), 4) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }
}
