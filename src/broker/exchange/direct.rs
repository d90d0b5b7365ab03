//! Direct exchange: a binding matches when its key equals the routing key (spec 3.1.3.1).

/// `binding_key == routing_key`.
pub fn matches(binding_key: &str, routing_key: &str) -> bool {
    binding_key == routing_key
}
