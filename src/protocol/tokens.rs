//! A request's prompt as token ids, for the models whose tokenizer the conf names
//! (`tokenizers:`): chat bodies rendered with the model's template as vLLM renders them (and
//! Anthropic Messages and Responses bodies as the chat bodies vLLM makes of them),
//! completions prompts tokenized directly, token-id prompts as they are (`inferlb_tokens`).
//! What they are for: the replicas' KV events name blocks of token ids.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use inferlb_tokens::{ModelTokens, TokenIds};
use serde::Deserialize;

use crate::protocol::api::Family;

/// Each configured model's tokenizer, loaded once at start.
#[derive(Default)]
pub struct Tokenizers(HashMap<String, ModelTokens>);

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut models: Vec<&String> = self.0.keys().collect();
        models.sort();
        f.debug_tuple("Tokenizers").field(&models).finish()
    }
}

impl Tokenizers {
    /// Loads every model's directory (`tokenizer.json`, `tokenizer_config.json`); an error
    /// names the model and the directory.
    pub fn load(dirs: &BTreeMap<String, PathBuf>) -> Result<Tokenizers, String> {
        let mut out = HashMap::new();
        for (model, dir) in dirs {
            let t = ModelTokens::from_dir(dir).map_err(|e| {
                format!(
                    "tokenizers.{model}: cannot load {}: {e}",
                    dir.to_string_lossy()
                )
            })?;
            out.insert(model.clone(), t);
        }
        Ok(Tokenizers(out))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn knows(&self, model: &str) -> bool {
        self.0.contains_key(model)
    }

    /// The prompt's ids, when `model` has a tokenizer and the body is a request it can read
    /// (`None` otherwise: the estimate serves it): chat and completions, and Anthropic Messages
    /// and Responses bodies converted to the chat body vLLM renders for them
    /// (`inferlb_tokens::convert`; not a continued response, whose history is on the replica).
    ///
    /// A body that may name a `cache_salt` or hold images, audio or video is not tokenized:
    /// the replica's block hashes then cover more than the token ids, and ids alone would
    /// match blocks it cannot reuse. (Looked for as text: a false alarm only costs the
    /// estimate.)
    ///
    /// A chat prompt is tokenized up to about `budget` bytes beyond what the message cache
    /// holds ([`ModelTokens::chat_ids_within`]): [`Ids::whole`] says whether the ids are all
    /// of it.
    pub fn ids(
        &self,
        family: Family,
        path: &str,
        model: &str,
        body: &[u8],
        budget: usize,
    ) -> Option<Ids> {
        let t = self.0.get(model)?;
        // One pass over the body for all of them, not one each (a warm 400 KB turn's ~10%).
        if BEYOND.is_match(body) {
            return None;
        }
        let c = match family {
            Family::Chat if path.trim_end_matches('/') == "/v1/chat/completions" => {
                t.chat_ids_within(body, budget)
            }
            Family::Messages => t.messages_ids_within(body, budget),
            Family::Responses => t.responses_ids_within(body, budget),
            Family::Completions => return completion_ids(t, body).map(Ids::whole),
            _ => return None,
        }
        .ok()?;
        // The whole prompt's length, from the part tokenized: its bytes a token.
        let total = match c.is_whole() {
            true => c.ids.len(),
            false => {
                let scaled =
                    c.ids.len() as u128 * c.text_bytes as u128 / c.covered_bytes.max(1) as u128;
                // More than the part, so that it is never taken for the whole.
                usize::try_from(scaled)
                    .unwrap_or(usize::MAX)
                    .max(c.ids.len() + 1)
            }
        };
        Some(Ids {
            whole: c.is_whole(),
            ids: c.ids,
            total,
        })
    }
}

/// A prompt's ids, or a leading part of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    /// In the tokenizer's shared segments.
    pub ids: TokenIds,
    /// `ids` are the whole prompt's.
    pub whole: bool,
    /// The whole prompt's length in tokens: `ids.len()` when whole, else estimated from the
    /// part tokenized.
    pub total: usize,
}

impl Ids {
    fn whole(ids: Vec<u32>) -> Ids {
        Ids {
            total: ids.len(),
            whole: true,
            ids: ids.into(),
        }
    }
}

/// Keys whose presence makes a replica's block hashes cover more than the prompt's tokens.
const BEYOND_TOKENS: &[&str] = &[
    "\"cache_salt\"",
    "\"image_url\"",
    "\"input_audio\"",
    "\"audio_url\"",
    "\"video_url\"",
    "\"input_image\"",
];

static BEYOND: std::sync::LazyLock<aho_corasick::AhoCorasick> = std::sync::LazyLock::new(|| {
    aho_corasick::AhoCorasick::new(BEYOND_TOKENS).expect("a few short literal keys")
});

/// A completions prompt: one text, or one list of token ids. A batch of prompts is several
/// requests to the replica, whose blocks are several chains: not looked up.
fn completion_ids(t: &ModelTokens, body: &[u8]) -> Option<Vec<u32>> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Prompt {
        Text(String),
        Ids(Vec<u32>),
        One([String; 1]),
    }
    #[derive(Deserialize)]
    struct Body {
        prompt: Prompt,
    }
    match serde_json::from_slice::<Body>(body).ok()?.prompt {
        Prompt::Text(s) | Prompt::One([s]) => t.prompt_ids(&s).ok(),
        Prompt::Ids(ids) => Some(inferlb_tokens::token_prompt(&ids).to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizers() -> (tempfile::TempDir, Tokenizers) {
        let dir = tempfile::tempdir().expect("tempdir");
        inferlb_tokens::fixture::write_dir(dir.path(), inferlb_tokens::fixture::CHATML_TOOLS)
            .expect("fixture");
        let dirs = BTreeMap::from([("m".to_string(), dir.path().to_path_buf())]);
        let t = Tokenizers::load(&dirs).expect("load");
        (dir, t)
    }

    #[test]
    fn chat_completions_messages_and_responses_prompts_are_tokenized_others_are_not() {
        let (dir, t) = tokenizers();
        let direct = ModelTokens::from_dir(dir.path()).expect("load");
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"The quick brown fox"}]}"#;
        let ids_of = |family, path, model, body| {
            t.ids(family, path, model, body, usize::MAX).map(|i| {
                assert!(i.whole && i.total == i.ids.len());
                i.ids.to_vec()
            })
        };
        assert_eq!(
            ids_of(Family::Chat, "/v1/chat/completions", "m", chat),
            Some(direct.chat_ids_uncached(chat).expect("ids"))
        );
        let text = br#"{"model":"m","prompt":"The quick brown fox"}"#;
        let want = direct.prompt_ids("The quick brown fox").expect("ids");
        assert_eq!(
            ids_of(Family::Completions, "/v1/completions", "m", text),
            Some(want.clone())
        );
        let one = br#"{"model":"m","prompt":["The quick brown fox"]}"#;
        assert_eq!(
            ids_of(Family::Completions, "/v1/completions", "m", one),
            Some(want)
        );
        let ids = br#"{"model":"m","prompt":[5,6,7]}"#;
        assert_eq!(
            ids_of(Family::Completions, "/v1/completions", "m", ids),
            Some(vec![5, 6, 7])
        );
        for (family, path, model, body) in [
            (Family::Chat, "/v1/chat/completions", "other", &chat[..]),
            (Family::Chat, "/v1/embeddings", "m", &chat[..]),
            (Family::Responses, "/v1/responses", "m", &chat[..]),
            (Family::Chat, "/v1/chat/completions", "m", &b"{not json"[..]),
            (
                Family::Completions,
                "/v1/completions",
                "m",
                &br#"{"prompt":["a","b"]}"#[..],
            ),
            (
                Family::Chat,
                "/v1/chat/completions",
                "m",
                &br#"{"messages":[{"role":"user","content":"hi"}],"cache_salt":"tenant-a"}"#[..],
            ),
            (
                Family::Chat,
                "/v1/chat/completions",
                "m",
                &br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}]}"#[..],
            ),
            (
                Family::Completions,
                "/v1/completions",
                "m",
                &br#"{"prompt":"hi","cache_salt":"tenant-a"}"#[..],
            ),
        ] {
            assert_eq!(ids_of(family, path, model, body), None, "{path} {model}");
        }
        let plain = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        assert!(ids_of(Family::Chat, "/v1/chat/completions", "m", plain).is_some());
        // Anthropic and Responses bodies: the ids of the chat body vLLM makes of them.
        let anthropic = br#"{"model":"m","max_tokens":5,"system":"Be brief.","messages":[{"role":"user","content":"The quick brown fox"}]}"#;
        let responses =
            br#"{"model":"m","instructions":"Be brief.","input":"The quick brown fox"}"#;
        let as_chat = br#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"The quick brown fox"}]}"#;
        let want = direct.chat_ids_uncached(as_chat).expect("ids");
        assert_eq!(
            ids_of(Family::Messages, "/v1/messages", "m", anthropic),
            Some(want.clone())
        );
        assert_eq!(
            ids_of(Family::Responses, "/v1/responses", "m", responses),
            Some(want)
        );
        let continued = br#"{"model":"m","previous_response_id":"resp_1","input":"more"}"#;
        assert_eq!(
            ids_of(Family::Responses, "/v1/responses", "m", continued),
            None
        );
        for key in BEYOND_TOKENS {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],{key}:1}}"#);
            let ids = t.ids(
                Family::Chat,
                "/v1/chat/completions",
                "m",
                body.as_bytes(),
                1,
            );
            assert_eq!(ids, None, "{key}");
        }
    }

    /// Within a budget, a long chat prompt's ids stop at a message's end: a leading part of
    /// the whole prompt's ids, its length estimated from the part; a second call without a
    /// budget gives them all, reusing the first part.
    #[test]
    fn a_budget_tokenizes_a_leading_part_that_the_whole_continues() {
        let (dir, t) = tokenizers();
        let direct = ModelTokens::from_dir(dir.path()).expect("load");
        let messages: Vec<serde_json::Value> = (0..40)
            .map(|i| {
                let words: Vec<String> = (0..60).map(|w| format!("w{}", (i * 7 + w) % 97)).collect();
                serde_json::json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": words.join(" ")})
            })
            .collect();
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        let want = direct.chat_ids_uncached(body.as_bytes()).expect("ids");
        let path = "/v1/chat/completions";
        let part = t
            .ids(Family::Chat, path, "m", body.as_bytes(), 2048)
            .expect("ids");
        assert!(!part.whole);
        assert!(
            !part.ids.is_empty() && part.ids.len() < want.len() / 4,
            "{}",
            part.ids.len()
        );
        assert_eq!(
            part.ids.to_vec()[..],
            want[..part.ids.len()],
            "a leading part"
        );
        let off = part.total.abs_diff(want.len());
        assert!(off < want.len() / 10, "{} for {}", part.total, want.len());
        let all = t
            .ids(Family::Chat, path, "m", body.as_bytes(), usize::MAX)
            .expect("ids");
        assert!(all.whole);
        assert_eq!(all.ids, want);
        // A first message longer than the budget: no message ends within it, so whole.
        let long: Vec<String> = (0..1500).map(|w| format!("w{}", w % 89)).collect();
        let first_long = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": long.join(" ")},
            {"role": "assistant", "content": "ok"},
        ]})
        .to_string();
        let one = t
            .ids(Family::Chat, path, "m", first_long.as_bytes(), 2048)
            .expect("ids");
        assert!(one.whole);
        assert_eq!(
            one.ids,
            direct.chat_ids_uncached(first_long.as_bytes()).unwrap()
        );
        // A budget larger than the prompt: whole at once.
        let big = t
            .ids(Family::Chat, path, "m", body.as_bytes(), 1 << 30)
            .expect("ids");
        assert!(big.whole);
        assert_eq!(big.ids, want);
    }

    #[test]
    fn a_directory_without_a_tokenizer_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dirs = BTreeMap::from([("m".to_string(), dir.path().to_path_buf())]);
        let e = Tokenizers::load(&dirs).expect_err("no tokenizer.json");
        assert!(
            e.contains("tokenizers.m") && e.contains(&*dir.path().to_string_lossy()),
            "{e}"
        );
    }
}
