//! cargo-fuzz target: `ringmq::amqp::fuzz::frames`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::frames(data));
