//! OpenAI completions: `prompt` as a string, a list of strings, token ids, or lists of token
//! ids — each prompt of a batch one part. Mixed types are not read.

use super::json::Elements;
use super::{Reader, Top};

pub(super) fn read(top: &Top, r: &mut Reader) -> Option<()> {
    let raw = top.prompt?;
    if let Some(t) = raw.string() {
        r.part("prompt");
        r.text(Some(t));
        return Some(());
    }
    let items = raw.elements()?;
    // The first item says which form the list can be; a list that turns out mixed is unread
    // (what was fed meanwhile is dropped with the chain).
    match items.clone().next().map(|first| first.text[0]) {
        None | Some(b'-' | b'0'..=b'9') => tokens(items, r),
        Some(b'"') => {
            for t in items {
                r.part("prompt");
                r.text(Some(t.string()?));
            }
            Some(())
        }
        Some(b'[') => items.map(|ids| tokens(ids.elements()?, r)).collect(),
        _ => None,
    }
}

/// One part of token ids, each as 4 little-endian bytes.
fn tokens(ids: Elements, r: &mut Reader) -> Option<()> {
    r.part("tokens");
    r.h.begin_fragment();
    let mut buf = [0u8; 256];
    let mut n = 0;
    for id in ids {
        buf[n..n + 4].copy_from_slice(&id.u32()?.to_le_bytes());
        n += 4;
        if n == buf.len() {
            r.h.extend(&buf);
            n = 0;
        }
    }
    r.h.extend(&buf[..n]);
    Some(())
}
