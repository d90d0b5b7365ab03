//! Topic exchange (spec 3.1.3.3): keys are dot-separated words; in a binding pattern `*`
//! matches exactly one word and `#` matches zero or more words.

/// Does the binding `pattern` match `routing_key`?
pub fn matches(pattern: &str, routing_key: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = if routing_key.is_empty() { vec![""] } else { routing_key.split('.').collect() };
    // Iterative matcher with backtracking to the last `#` (like glob `*`).
    let (mut pi, mut ki) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    loop {
        if pi < p.len() && p[pi] == "#" {
            star = Some((pi, ki));
            pi += 1;
            continue;
        }
        if ki == k.len() {
            if pi == p.len() {
                return true;
            }
        } else if pi < p.len() && (p[pi] == "*" || p[pi] == k[ki]) {
            pi += 1;
            ki += 1;
            continue;
        }
        match star {
            Some((sp, sk)) if sk < k.len() => {
                star = Some((sp, sk + 1));
                pi = sp + 1;
                ki = sk + 1;
            }
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::matches;
    use proptest::prelude::*;

    #[test]
    fn spec_examples() {
        assert!(matches("*.stock.#", "usd.stock"));
        assert!(matches("*.stock.#", "eur.stock.db"));
        assert!(!matches("*.stock.#", "stock.nasdaq"));
        assert!(matches("#", ""));
        assert!(matches("#", "a.b.c"));
        assert!(matches("a.#", "a"));
        assert!(matches("a.#.b", "a.b"));
        assert!(matches("a.#.b", "a.x.y.b"));
        assert!(!matches("a.#.b", "a.x.y.c"));
        assert!(matches("#.b", "b"));
        assert!(!matches("a.*", "a"));
        assert!(matches("a.*.c", "a.b.c"));
        assert!(matches("", ""));
        assert!(!matches("", "a"));
        assert!(matches("#.#", "a.b"));
    }

    proptest! {
        #[test]
        fn exact_key_matches_itself(words in proptest::collection::vec("[a-z]{1,3}", 1..6)) {
            let key = words.join(".");
            prop_assert!(matches(&key, &key));
            prop_assert!(matches("#", &key));
            let stars = vec!["*"; words.len()].join(".");
            prop_assert!(matches(&stars, &key));
        }
    }
}
