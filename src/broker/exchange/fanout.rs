//! Fanout exchange: every binding matches, the routing key is ignored (spec 3.1.3.2).

/// Always true.
pub fn matches() -> bool {
    true
}
