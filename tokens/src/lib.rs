//! # inferlb-tokens
//!
//! Token ids for a request, as a vLLM replica would count them, cheaply enough for a load
//! balancer's request path.
//!
//! - [`ModelTokens::from_dir`] loads a model's `tokenizer.json` and `tokenizer_config.json`
//!   (and `chat_template.jinja`, which newer transformers save beside it and prefer).
//! - Chat bodies are rendered with the model's chat template the way vLLM renders them (vLLM's
//!   conversation, transformers' Jinja setup), then tokenized without added special tokens (the
//!   template carries the BOS). Completions prompts are tokenized with them; token-id prompts
//!   pass through ([`token_prompt`]).
//! - A per-conversation cache makes a resent history cost only its new turn: the ids of the
//!   longest earlier rendering that is still a byte prefix are reused up to their last added
//!   token (where tokenization splits), and only the rest is tokenized.
//!
//! It is for counting and hashing prompt tokens (prefix-cache routing, load in tokens). It is
//! not a chat server: it renders text content only (no images or audio), has no
//! `strftime_now`, and writes Python values (`True`, `None`, dicts) the way minijinja does when
//! a template prints them raw rather than through `tojson`.
//!
//! Cost (`cargo bench -p inferlb-tokens`, 2 shared cores, a 600-token trained BPE): a 400 KB
//! conversation takes about 145 ms cold and 1.0 to 1.6 ms with one new turn, of which the
//! render of the whole conversation is 0.3 to 0.6 ms and tokenizing the ~2 KB turn 0.35 to
//! 0.6 ms (`fancy-regex`; `onig` is about 1.6 times faster cold, but builds C).

mod cache;
pub mod chat;
pub mod config;
pub mod fixture;
pub mod template;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use aho_corasick::AhoCorasick;
use indexmap::IndexMap;
use minijinja::{Environment, Value};
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64, xxh3_64_with_seed};

pub use config::TokenizerConfig;
pub use template::ContentFormat;

/// What went wrong, naming the file and key where there is one.
#[derive(Debug)]
pub enum Error {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Json {
        path: PathBuf,
        msg: String,
    },
    Key {
        path: PathBuf,
        key: String,
        msg: String,
    },
    Tokenizer {
        path: PathBuf,
        msg: String,
    },
    /// The model has no chat template (`chat_template` in this file).
    NoTemplate {
        path: PathBuf,
    },
    Template(String),
    Body(String),
    Encode(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Json { path, msg } => write!(f, "{}: not valid JSON: {msg}", path.display()),
            Error::Key { path, key, msg } => write!(f, "{}: `{key}`: {msg}", path.display()),
            Error::Tokenizer { path, msg } => {
                write!(
                    f,
                    "{}: not a tokenizer this build can load: {msg}",
                    path.display()
                )
            }
            Error::NoTemplate { path } => {
                write!(
                    f,
                    "{}: `chat_template`: missing, so chat cannot be rendered",
                    path.display()
                )
            }
            Error::Template(m) => write!(f, "chat template: {m}"),
            Error::Body(m) => write!(f, "request body: {m}"),
            Error::Encode(m) => write!(f, "tokenizing: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// The default bound of the message cache.
pub const DEFAULT_CACHE_BYTES: usize = 256 << 20;

/// A chat request's ids, and how many of them came from the message cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTokens {
    pub ids: Vec<u32>,
    pub reused: usize,
}

/// One model's tokenizer and chat template, with its message cache.
pub struct ModelTokens {
    tokenizer: Tokenizer,
    env: Option<Environment<'static>>,
    config: TokenizerConfig,
    config_path: PathBuf,
    format: ContentFormat,
    /// Added tokens after which a rendering can be cut: not normalized, no right strip, not
    /// single-word (each of those would let the text after the cut change the match).
    cut_tokens: std::collections::HashMap<u32, String>,
    /// Every added token, to see that no match can straddle a cut.
    added: Option<AhoCorasick>,
    max_added: usize,
    /// False for pre-tokenizers that treat a text's first split apart (Metaspace's
    /// `prepend_scheme: first`): tokenizing a tail alone would differ from the whole.
    reuse: bool,
    cache: Mutex<cache::PrefixCache>,
    /// Messages as the template sees them, by the hash of their raw JSON.
    messages: Mutex<cache::Sized<(Value, usize)>>,
}

impl ModelTokens {
    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, Error> {
        let dir = dir.as_ref();
        let tk_path = dir.join("tokenizer.json");
        if !tk_path.exists() {
            return Err(Error::Io {
                path: tk_path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
            });
        }
        let mut tokenizer = Tokenizer::from_file(&tk_path).map_err(|e| Error::Tokenizer {
            path: tk_path.clone(),
            msg: e.to_string(),
        })?;
        // transformers turns these off unless a call asks for them.
        tokenizer
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer {
                path: tk_path.clone(),
                msg: e.to_string(),
            })?;
        tokenizer.with_padding(None);
        let config_path = dir.join("tokenizer_config.json");
        let mut config = if config_path.exists() {
            TokenizerConfig::from_file(&config_path)?
        } else {
            TokenizerConfig::default()
        };
        // Newer transformers save the template beside the config, and prefer that file.
        let jinja = dir.join("chat_template.jinja");
        let mut config_path = config_path;
        if jinja.exists() {
            config.chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|e| Error::Io {
                    path: jinja.clone(),
                    source: e,
                })?);
            config_path = jinja;
        }
        let (env, format) = match &config.chat_template {
            Some(source) => {
                let env = template::environment(source.clone()).map_err(|e| Error::Key {
                    path: config_path.clone(),
                    key: "chat_template".into(),
                    msg: format!("{e:#}"),
                })?;
                (Some(env), template::detect_content_format(source))
            }
            None => (None, ContentFormat::String),
        };
        let decoder = tokenizer.get_added_tokens_decoder();
        let cut_tokens = decoder
            .iter()
            .filter(|(_, t)| !t.normalized && !t.rstrip && !t.single_word && !t.content.is_empty())
            .map(|(id, t)| (*id, t.content.clone()))
            .collect();
        let contents: Vec<&str> = decoder
            .values()
            .map(|t| t.content.as_str())
            .filter(|c| !c.is_empty())
            .collect();
        let max_added = contents.iter().map(|c| c.len()).max().unwrap_or(0);
        let added = if contents.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&contents).map_err(|e| Error::Tokenizer {
                path: tk_path.clone(),
                msg: e.to_string(),
            })?)
        };
        let pre = serde_json::to_string(&tokenizer.get_pre_tokenizer()).unwrap_or_default();
        let reuse = !pre.contains("\"prepend_scheme\":\"first\"");
        Ok(Self {
            tokenizer,
            env,
            config,
            config_path,
            format,
            cut_tokens,
            added,
            max_added,
            reuse,
            cache: Mutex::new(cache::PrefixCache::new(DEFAULT_CACHE_BYTES)),
            messages: Mutex::new(cache::Sized::new(DEFAULT_CACHE_BYTES / 4)),
        })
    }

    /// The message cache bounded at `bytes` (ids at 4 bytes each, plus a little per entry).
    pub fn with_cache_bytes(self, bytes: usize) -> Self {
        Self {
            cache: Mutex::new(cache::PrefixCache::new(bytes)),
            messages: Mutex::new(cache::Sized::new(bytes / 4)),
            ..self
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Entries and bytes in the message cache.
    pub fn cache_usage(&self) -> (usize, usize) {
        let c = self.cache.lock().expect("cache lock");
        (c.len(), c.bytes())
    }

    /// The text vLLM would tokenize for this chat body.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, Error> {
        let b = chat::ChatBody::parse(body)?;
        self.render(&b)
    }

    fn render(&self, b: &chat::ChatBody) -> Result<String, Error> {
        let env = self.env.as_ref().ok_or_else(|| Error::NoTemplate {
            path: self.config_path.clone(),
        })?;
        // Each message is converted once: a resent history costs a hash per message here.
        let mut messages = Vec::with_capacity(b.messages.len());
        {
            let mut seen = self.messages.lock().expect("message lock");
            for raw in &b.messages {
                let key = xxh3_64(raw.get().as_bytes());
                let value = match seen.get(&key) {
                    Some((v, _)) => v.clone(),
                    None => {
                        let v = chat::message(raw, self.format)?;
                        seen.put(key, (v.clone(), raw.get().len()));
                        v
                    }
                };
                messages.push(value);
            }
            seen.trim();
        }
        let mut ctx: IndexMap<String, Value> = IndexMap::new();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert("tools".into(), chat::tools(b.tools)?);
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(b.add_generation_prompt.unwrap_or(true)),
        );
        for (key, tok) in [
            ("bos_token", &self.config.bos_token),
            ("eos_token", &self.config.eos_token),
            ("unk_token", &self.config.unk_token),
            ("pad_token", &self.config.pad_token),
        ] {
            if let Some(t) = tok {
                ctx.insert(key.into(), Value::from(t.as_str()));
            }
        }
        if let Some(kw) = b.chat_template_kwargs.filter(|k| k.get() != "null") {
            let kw: IndexMap<String, Value> = serde_json::from_str(kw.get())
                .map_err(|e| Error::Body(format!("chat_template_kwargs: {e}")))?;
            ctx.extend(kw);
        }
        let tmpl = env
            .get_template(template::NAME)
            .map_err(|e| Error::Template(format!("{e:#}")))?;
        tmpl.render(chat::obj(ctx))
            .map_err(|e| Error::Template(format!("{e:#}")))
    }

    fn encode(&self, text: &str, special: bool) -> Result<tokenizers::Encoding, Error> {
        self.tokenizer
            .encode(text, special)
            .map_err(|e| Error::Encode(e.to_string()))
    }

    /// The ids of a chat body, rendered and tokenized whole (the reference for the cached path).
    pub fn chat_ids_uncached(&self, body: &[u8]) -> Result<Vec<u32>, Error> {
        let text = self.render_chat(body)?;
        Ok(self.encode(&text, false)?.get_ids().to_vec())
    }

    /// The ids of a chat body, reusing what an earlier turn of the same conversation tokenized.
    pub fn chat_ids(&self, body: &[u8]) -> Result<ChatTokens, Error> {
        let b = chat::ChatBody::parse(body)?;
        let text = self.render(&b)?;
        if !self.reuse || b.messages.is_empty() {
            let ids = self.encode(&text, false)?.get_ids().to_vec();
            return Ok(ChatTokens { ids, reused: 0 });
        }
        // Keys: the tools and template kwargs, then each leading message, chained.
        let mut h = xxh3_64(b.tools.map(|t| t.get()).unwrap_or("").as_bytes())
            ^ xxh3_64(
                b.chat_template_kwargs
                    .map(|t| t.get())
                    .unwrap_or("")
                    .as_bytes(),
            )
            .rotate_left(1);
        let keys: Vec<u64> = b
            .messages
            .iter()
            .map(|m| {
                h = xxh3_64_with_seed(m.get().as_bytes(), h);
                h
            })
            .collect();
        let bytes = text.as_bytes();
        let hit = self.cache.lock().expect("cache lock").longest(&keys, |e| {
            e.cut <= bytes.len()
                && text.is_char_boundary(e.cut)
                && xxh3_128(&bytes[..e.cut]) == e.prefix_hash
                && !self.straddles(bytes, e.cut)
        });
        let (base_cut, base_ids): (usize, Arc<[u32]>) = hit.unwrap_or((0, Arc::from(Vec::new())));
        let tail = &text[base_cut..];
        let enc = self.encode(tail, false)?;
        let mut ids = Vec::with_capacity(base_ids.len() + enc.len());
        ids.extend_from_slice(&base_ids);
        ids.extend_from_slice(enc.get_ids());
        // The new cut: the last added token of the tail that a later text cannot change.
        let mut cut = None;
        for (i, (id, off)) in enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .enumerate()
            .rev()
        {
            if let Some(content) = self.cut_tokens.get(id) {
                let end = off.1;
                let len = content.len();
                if end >= len
                    && end <= tail.len()
                    && tail.as_bytes()[end - len..end] == *content.as_bytes()
                {
                    cut = Some((base_cut + end, base_ids.len() + i + 1));
                    break;
                }
            }
        }
        let entry = match cut {
            Some((c, n)) => Some(cache::Entry {
                cut: c,
                prefix_hash: xxh3_128(&bytes[..c]),
                ids: Arc::from(&ids[..n]),
            }),
            None if base_cut > 0 => Some(cache::Entry {
                cut: base_cut,
                prefix_hash: xxh3_128(&bytes[..base_cut]),
                ids: base_ids.clone(),
            }),
            None => None,
        };
        if let (Some(e), Some(key)) = (entry, keys.last()) {
            self.cache.lock().expect("cache lock").insert(*key, e);
        }
        Ok(ChatTokens {
            reused: base_ids.len(),
            ids,
        })
    }

    /// Whether an added token's text could match across `cut` in `text`.
    fn straddles(&self, text: &[u8], cut: usize) -> bool {
        let Some(ac) = &self.added else { return false };
        let lo = cut.saturating_sub(self.max_added.saturating_sub(1));
        let hi = (cut + self.max_added.saturating_sub(1)).min(text.len());
        ac.find_overlapping_iter(&text[lo..hi])
            .any(|m| lo + m.start() < cut && lo + m.end() > cut)
    }

    /// A completions prompt's ids (with the tokenizer's own special tokens, as vLLM adds them).
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>, Error> {
        Ok(self.encode(prompt, true)?.get_ids().to_vec())
    }
}

/// A prompt given as token ids is used as it is.
pub fn token_prompt(ids: &[u32]) -> &[u32] {
    ids
}
