#![no_main]
#[path = "../targets.rs"]
mod targets;
libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::redis_lookup_reply(data));
