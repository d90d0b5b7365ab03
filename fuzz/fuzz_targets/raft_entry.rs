//! cargo-fuzz target: `ringmq::amqp::fuzz::raft_entry`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::raft_entry(data));
