#![no_main]
//! libFuzzer target: `physalia_tests::decode::Kind::PartDelta` (the CI replay of the corpus calls the same
//! entry point, tests/tests/fuzz_corpus.rs).

use libfuzzer_sys::fuzz_target;
use physalia_tests::decode::Kind;

fuzz_target!(|data: &[u8]| {
    let _ = Kind::PartDelta.decode(data);
});
