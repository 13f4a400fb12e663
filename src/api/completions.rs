//! OpenAI completions: `prompt` as a string, a list of strings, token ids, or lists of token
//! ids — each prompt of a batch one part. Mixed types are not read.

use super::prompt::PromptHasher;
use super::{field, Text, Top};

pub(super) fn read(top: &Top, h: &mut PromptHasher) -> Option<()> {
    let raw = top.prompt?;
    if let Some(t) = field::<Text>(Some(raw)) {
        h.begin_part("prompt");
        h.text(&t.0);
    } else if let Some(ids) = field::<Vec<u32>>(Some(raw)) {
        tokens(&ids, h);
    } else if let Some(batch) = field::<Vec<Text>>(Some(raw)) {
        for t in batch {
            h.begin_part("prompt");
            h.text(&t.0);
        }
    } else {
        for ids in field::<Vec<Vec<u32>>>(Some(raw))? {
            tokens(&ids, h);
        }
    }
    Some(())
}

fn tokens(ids: &[u32], h: &mut PromptHasher) {
    h.begin_part("tokens");
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    ids.iter()
        .for_each(|id| bytes.extend_from_slice(&id.to_le_bytes()));
    h.bytes(&bytes);
}
