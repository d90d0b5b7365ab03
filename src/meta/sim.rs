//! The deterministic simulator of the metadata group (tests only).
