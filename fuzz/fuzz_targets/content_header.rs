//! cargo-fuzz target: `ringmq::amqp::fuzz::content_header`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::content_header(data));
