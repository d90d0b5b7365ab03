//! cargo-fuzz target: `ringmq::amqp::fuzz::topic`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::topic(data));
