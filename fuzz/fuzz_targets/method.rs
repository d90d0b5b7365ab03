//! cargo-fuzz target: `ringmq::amqp::fuzz::method`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::method(data));
