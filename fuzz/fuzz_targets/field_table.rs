//! cargo-fuzz target: `ringmq::amqp::fuzz::field_table`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ringmq::amqp::fuzz::field_table(data));
