#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kv_fuzz::redis_lookup_reply(data));
