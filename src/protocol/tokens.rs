//! A request's prompt as token ids, for the models whose tokenizer the conf names
//! (`tokenizers:`): chat bodies rendered with the model's template as vLLM renders them,
//! completions prompts tokenized directly, token-id prompts as they are (`inferlb_tokens`).
//! What they are for: the replicas' KV events name blocks of token ids.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use inferlb_tokens::ModelTokens;
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

    /// The prompt's ids, when `model` has a tokenizer and the body is a chat or completions
    /// request it can read (`None` otherwise: the estimate serves it).
    ///
    /// A body that may name a `cache_salt` or hold images, audio or video is not tokenized:
    /// the replica's block hashes then cover more than the token ids, and ids alone would
    /// match blocks it cannot reuse. (Looked for as text: a false alarm only costs the
    /// estimate.)
    pub fn ids(&self, family: Family, path: &str, model: &str, body: &[u8]) -> Option<Vec<u32>> {
        let t = self.0.get(model)?;
        if BEYOND_TOKENS
            .iter()
            .any(|k| memchr::memmem::find(body, k.as_bytes()).is_some())
        {
            return None;
        }
        match family {
            Family::Chat if path.trim_end_matches('/') == "/v1/chat/completions" => {
                t.chat_ids(body).ok().map(|c| c.ids)
            }
            Family::Completions => completion_ids(t, body),
            _ => None,
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
    fn chat_and_completions_prompts_are_tokenized_others_are_not() {
        let (dir, t) = tokenizers();
        let direct = ModelTokens::from_dir(dir.path()).expect("load");
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"The quick brown fox"}]}"#;
        assert_eq!(
            t.ids(Family::Chat, "/v1/chat/completions", "m", chat),
            Some(direct.chat_ids_uncached(chat).expect("ids"))
        );
        let text = br#"{"model":"m","prompt":"The quick brown fox"}"#;
        let want = direct.prompt_ids("The quick brown fox").expect("ids");
        assert_eq!(
            t.ids(Family::Completions, "/v1/completions", "m", text),
            Some(want.clone())
        );
        let one = br#"{"model":"m","prompt":["The quick brown fox"]}"#;
        assert_eq!(
            t.ids(Family::Completions, "/v1/completions", "m", one),
            Some(want)
        );
        let ids = br#"{"model":"m","prompt":[5,6,7]}"#;
        assert_eq!(
            t.ids(Family::Completions, "/v1/completions", "m", ids),
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
            assert_eq!(t.ids(family, path, model, body), None, "{path} {model}");
        }
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
