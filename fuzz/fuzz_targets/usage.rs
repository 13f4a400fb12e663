//! Any response body a replica could send, JSON or SSE, split anywhere: reading its usage
//! never panics and its counts stay in bounds (the fuzz profile builds with overflow checks).
#![no_main]

use inferlb::protocol::api::Family;
use inferlb::protocol::usage::{UsageReader, MAX_TOKENS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte: the family and whether it streams; the second: where it is split.
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let Some((&cut, body)) = rest.split_first() else {
        return;
    };
    let family = [Family::Chat, Family::Completions, Family::Responses, Family::Messages]
        [head as usize % 4];
    let sse = head & 4 != 0;
    let cut = (cut as usize * body.len()) / 255;
    let mut r = UsageReader::new(family, sse);
    r.feed(&body[..cut]);
    r.feed(&body[cut..]);
    let _ = r.response_id();
    if let Some(u) = r.finish() {
        assert!(u.prompt_tokens <= MAX_TOKENS, "{u:?}");
        assert!(u.cached_tokens <= u.prompt_tokens, "{u:?}");
        assert!(u.completion_tokens <= MAX_TOKENS, "{u:?}");
    }
});
