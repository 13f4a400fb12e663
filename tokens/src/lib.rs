//! # inferlb-tokens
//!
//! Token ids for a request, as a vLLM replica would count them, cheaply enough for a load
//! balancer's request path.
//!
//! - [`ModelTokens::from_dir`] loads a model's `tokenizer.json` and `tokenizer_config.json`
//!   (and `chat_template.jinja`, which newer transformers save beside it and prefer).
//! - Chat bodies are rendered with the model's chat template the way vLLM renders them (vLLM's
//!   conversation, its merge of the request's fields over its `chat_template_kwargs`, the
//!   `tool_use` template for a body with tools, transformers' Jinja setup and its cut of a
//!   continued message), then tokenized without added special tokens (the template carries the
//!   BOS). Completions prompts are tokenized with them; token-id prompts
//!   pass through ([`token_prompt`]). Anthropic Messages and Responses bodies are first written
//!   as the chat body vLLM makes of them ([`convert`]); what that conversion does not know is
//!   refused, and the caller keeps its estimate.
//! - A per-conversation cache makes a resent history cost only its new turn: the ids of the
//!   longest earlier rendering that is still a byte prefix are reused up to their last added
//!   token (where tokenization splits), and only the rest is tokenized.
//!
//! It is for counting and hashing prompt tokens (prefix-cache routing, load in tokens). It is
//! not a chat server: it renders text content only (no images or audio), has no
//! `strftime_now`, and writes Python values (`True`, `None`, dicts) the way minijinja does when
//! a template prints them raw rather than through `tojson`.
//!
//! - Where the template writes contents only as they are ([`template::content_is_text_only`]),
//!   a turn renders the conversation with placeholders for contents and keeps the text as
//!   pieces, so that the render costs per message, not per byte; the split regex runs on the
//!   `regex` crate where that splits as `fancy-regex` does ([`pretok`]).
//!
//! - Where the pre-tokenizer splits once by a regex and then maps bytes (GPT-2's, Llama 3's,
//!   Qwen2's) and the model is a BPE, each split's ids are kept (`words.rs`): a new turn costs a
//!   lookup per word, not the pipeline's per-byte alignments and per-token strings.
//!
//! - A body is read once per conversation (`body.rs`): where its bytes up to a message's end are
//!   an earlier body's, the walk resumes there. The ids come back in the message cache's
//!   shared segments ([`TokenIds`]), not copied, and the cache's prefix check digests a content
//!   by its message's hash rather than its bytes.
//!
//! Cost (`cargo bench -p inferlb-tokens -- warm`, 2 shared cores, mimalloc, a 600-token trained
//! BPE; wall times move by up to 2x with the machine's load, so compare within one run): a
//! 400 KB conversation (400 messages) takes about 55 ms cold, and 0.49 ms with one new turn
//! (0.87-0.89 ms in the same run before the body was read once, the ids shared and the check
//! digested; 1.0 ms on an idle machine before that, 1.3 ms before the kept split ids, 3.9 ms
//! before placeholders and `regex`). Of that turn, the placeholder render of 400 messages is
//! about 0.3 ms (minijinja), tokenizing the ~2 KB turn 0.05 ms, and checking the body's bytes
//! against its history 0.05 ms. A 4 MB conversation's turn takes 3.9-4.1 ms (from 8.7), a 4 KB
//! one's 67-69 µs (from 72-74).

mod body;
mod cache;
pub mod chat;
pub mod config;
pub mod convert;
pub mod fixture;
mod ids;
pub mod pretok;
mod render;
mod rope;
pub mod template;
mod words;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use aho_corasick::AhoCorasick;
use minijinja::Value;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use render::{pieces, Skeleton, Template, MARK, PLACEHOLDER_RENDERS};
use rope::Rope;

pub use config::TokenizerConfig;
pub use ids::TokenIds;
pub use render::placeholder_renders;
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
    /// In the segments the message cache shares with the conversation's other turns.
    pub ids: TokenIds,
    pub reused: usize,
    /// Bytes of the rendered text the ids cover: all of it ([`ChatTokens::text_bytes`]) but
    /// where [`ModelTokens::chat_ids_within`] stopped early.
    pub covered_bytes: usize,
    pub text_bytes: usize,
}

impl ChatTokens {
    /// The ids are the whole prompt's, not a leading part.
    pub fn is_whole(&self) -> bool {
        self.covered_bytes >= self.text_bytes
    }
}

/// The model's tokenizer with the faster pre-tokenizer of [`pretok`].
pub(crate) type FastTokenizer = tokenizers::TokenizerImpl<
    tokenizers::ModelWrapper,
    tokenizers::NormalizerWrapper,
    pretok::FastPre,
    tokenizers::PostProcessorWrapper,
    tokenizers::DecoderWrapper,
>;

/// One model's tokenizer and chat template, with its message cache.
pub struct ModelTokens {
    tokenizer: Tokenizer,
    /// The same tokenizer with a faster pre-tokenizer, where it has one that splits the same.
    fast: Option<FastTokenizer>,
    /// The ids of each pre-tokenizer split seen, where the fast tokenizer's splits are
    /// tokenized each on its own.
    words: Option<words::Words>,
    /// The template transformers uses by default, and the one it uses for a request with
    /// tools where the model names one `tool_use`.
    default: Option<Template>,
    tool_use: Option<Template>,
    config: TokenizerConfig,
    config_path: PathBuf,
    /// Added tokens after which a rendering can be cut: not normalized, no right strip, not
    /// single-word (each of those would let the text after the cut change the match).
    cut_tokens: std::collections::HashMap<u32, String>,
    /// Every added token, to see that no match can straddle a cut.
    added: Option<AhoCorasick>,
    max_added: usize,
    /// Every added token again, matched leftmost-longest as the tokenizer splits them out,
    /// and whether each (by pattern index) is a cut token: where a budget may stop.
    splits: Option<(AhoCorasick, Vec<bool>)>,
    /// False for pre-tokenizers that treat a text's first split apart (Metaspace's
    /// `prepend_scheme: first`): tokenizing a tail alone would differ from the whole.
    reuse: bool,
    cache: Mutex<cache::PrefixCache>,
    /// Messages as the template sees them, by the hash of their raw JSON.
    messages: Mutex<cache::Sized<(Value, usize)>>,
    /// The placeholder mark as a message, the tools or the template arguments could hold it (raw
    /// or escaped): such a body is rendered whole.
    marker: AhoCorasick,
    /// Messages with their content as a placeholder, by the hash of their raw JSON and position.
    skeletons: Mutex<cache::Sized<Skeleton>>,
    /// Where the parts of bodies read lie, so that a resent history is not read again.
    shapes: body::Shapes,
    /// What vLLM probes this model's template for to convert Anthropic bodies, once.
    anthropic: std::sync::OnceLock<convert::AnthropicRules>,
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
        // Newer transformers save the templates as files beside the config: the default one,
        // and the named ones in a folder. Where there is any, transformers reads the files
        // alone, not the config's templates.
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|e| Error::Io {
                path: path.to_owned(),
                source: e,
            })
        };
        let jinja = dir.join("chat_template.jinja");
        let folder = dir.join("additional_chat_templates");
        let named_files = std::fs::read_dir(&folder)
            .map(|entries| {
                entries
                    .flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "jinja"))
            })
            .unwrap_or(false);
        let mut config_path = config_path;
        let mut tool_use_path = config_path.clone();
        if jinja.exists() || named_files {
            config.chat_template = None;
            config.tool_use_template = None;
            if jinja.exists() {
                config.chat_template = Some(read(&jinja)?);
                config_path = jinja;
            }
            let named = folder.join("tool_use.jinja");
            if named.exists() {
                config.tool_use_template = Some(read(&named)?);
                tool_use_path = named;
            }
        }
        let default = match &config.chat_template {
            Some(source) => Some(Template::new(source, &config_path, 0, &config)?),
            None => None,
        };
        let tool_use = match &config.tool_use_template {
            Some(source) => Some(Template::new(
                source,
                &tool_use_path,
                0xB5AD_4ECE_DA1C_E2A9,
                &config,
            )?),
            None => None,
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
        let built = |kind| {
            aho_corasick::AhoCorasickBuilder::new()
                .match_kind(kind)
                .build(&contents)
                .map_err(|e| Error::Tokenizer {
                    path: tk_path.clone(),
                    msg: e.to_string(),
                })
        };
        let (added, splits) = if contents.is_empty() {
            (None, None)
        } else {
            let cuts: std::collections::HashSet<&str> = decoder
                .values()
                .filter(|t| !t.normalized && !t.rstrip && !t.single_word)
                .map(|t| t.content.as_str())
                .collect();
            let is_cut = contents.iter().map(|c| cuts.contains(c)).collect();
            (
                Some(built(aho_corasick::MatchKind::Standard)?),
                Some((built(aho_corasick::MatchKind::LeftmostLongest)?, is_cut)),
            )
        };
        let pre = serde_json::to_string(&tokenizer.get_pre_tokenizer()).unwrap_or_default();
        let reuse = !pre.contains("\"prepend_scheme\":\"first\"");
        let fast = tokenizer
            .get_pre_tokenizer()
            .and_then(pretok::FastPre::new)
            .map(|pre| {
                let mut t = FastTokenizer::new(tokenizer.get_model().clone());
                t.with_normalizer(tokenizer.get_normalizer().cloned())
                    .with_pre_tokenizer(Some(pre))
                    .with_post_processor(tokenizer.get_post_processor().cloned())
                    .with_decoder(tokenizer.get_decoder().cloned())
                    .with_added_vocabulary(tokenizer.get_added_vocabulary().clone());
                t
            });
        let words = fast.as_ref().and_then(words::Words::for_tokenizer);
        Ok(Self {
            tokenizer,
            fast,
            words,
            default,
            tool_use,
            config,
            config_path,
            cut_tokens,
            added,
            max_added,
            splits,
            reuse,
            cache: Mutex::new(cache::PrefixCache::new(DEFAULT_CACHE_BYTES)),
            messages: Mutex::new(cache::Sized::new(DEFAULT_CACHE_BYTES / 4)),
            marker: aho_corasick::AhoCorasickBuilder::new()
                .ascii_case_insensitive(true)
                .build([MARK.to_string().as_str(), "\\uf8ff"])
                .map_err(|e| Error::Template(e.to_string()))?,
            skeletons: Mutex::new(cache::Sized::new(DEFAULT_CACHE_BYTES / 4)),
            shapes: body::Shapes::new(DEFAULT_CACHE_BYTES / 16),
            anthropic: std::sync::OnceLock::new(),
        })
    }

    /// The message cache bounded at `bytes` (ids at 4 bytes each, plus a little per entry).
    pub fn with_cache_bytes(self, bytes: usize) -> Self {
        Self {
            cache: Mutex::new(cache::PrefixCache::new(bytes)),
            messages: Mutex::new(cache::Sized::new(bytes / 4)),
            skeletons: Mutex::new(cache::Sized::new(bytes / 4)),
            shapes: body::Shapes::new(bytes / 16),
            ..self
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The default template's content format.
    pub fn content_format(&self) -> ContentFormat {
        self.default
            .as_ref()
            .map_or(ContentFormat::String, |t| t.format)
    }

    /// Whether chat bodies without tools are rendered with placeholders for their contents,
    /// put back after (the template writes contents only as they are, and has not read a whole
    /// message).
    pub fn renders_with_placeholders(&self) -> bool {
        self.default
            .as_ref()
            .is_some_and(|t| t.splice.load(Ordering::SeqCst))
    }

    /// Entries and bytes in the message cache.
    pub fn cache_usage(&self) -> (usize, usize) {
        let c = self.cache.lock().expect("cache lock");
        (c.len(), c.bytes())
    }

    /// How many chat bodies were read from where an earlier body's history ends (not again from
    /// their start).
    pub fn resumed_bodies(&self) -> u64 {
        self.shapes.resumed()
    }

    fn encode(&self, text: &str, special: bool) -> Result<tokenizers::Encoding, Error> {
        match &self.fast {
            Some(t) => t.encode(text, special),
            None => self.tokenizer.encode(text, special),
        }
        .map_err(|e| Error::Encode(e.to_string()))
    }

    /// `text`'s ids (no special tokens added), and the end of its last cut token with the
    /// number of ids up to it: the last added token a later text cannot change.
    fn ids_with_cut(&self, text: &str) -> Result<(Vec<u32>, Cut), Error> {
        let confirmed = |id: u32, end: usize| {
            self.cut_tokens.get(&id).is_some_and(|content| {
                let len = content.len();
                end >= len
                    && end <= text.len()
                    && text.as_bytes()[end - len..end] == *content.as_bytes()
            })
        };
        if let (Some(t), Some(w)) = (&self.fast, &self.words) {
            let got = w.ids(t, text)?;
            let cut = got
                .added
                .iter()
                .rev()
                .find(|(id, end, _)| confirmed(*id, *end))
                .map(|&(_, end, n)| (end, n));
            return Ok((got.ids, cut));
        }
        let enc = self.encode(text, false)?;
        let cut = enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .enumerate()
            .rev()
            .find(|(_, (id, off))| confirmed(**id, off.1))
            .map(|(i, (_, off))| (off.1, i + 1));
        Ok((enc.get_ids().to_vec(), cut))
    }

    /// The ids of `text` as the model's tokenizer gives them without added special tokens, by
    /// the fastest path this model has (the kept ids of its pre-tokenizer splits, where it
    /// splits once and maps bytes).
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, Error> {
        Ok(self.ids_with_cut(text)?.0)
    }

    /// Whether [`ModelTokens::text_ids`] keeps its splits' ids.
    pub fn keeps_split_ids(&self) -> bool {
        self.words.is_some()
    }

    /// The ids of a chat body, rendered and tokenized whole (the reference for the cached path).
    pub fn chat_ids_uncached(&self, body: &[u8]) -> Result<Vec<u32>, Error> {
        let text = self.render_chat(body)?;
        Ok(self.encode(&text, false)?.get_ids().to_vec())
    }

    /// The ids of a chat body, reusing what an earlier turn of the same conversation tokenized.
    pub fn chat_ids(&self, body: &[u8]) -> Result<ChatTokens, Error> {
        self.chat_ids_within(body, usize::MAX)
    }

    /// The same, but tokenizing at most about `budget` bytes of text beyond what the message
    /// cache gives: the ids stop after the last added token (a message's end, where a later
    /// text cannot change the tokenization) within the budget, and are a leading part of the
    /// whole prompt's ids. Enough to learn that no replica holds more than the first blocks of
    /// a new prompt without tokenizing all of it; a second call without a budget reuses what
    /// this one tokenized (it is cached like any turn).
    pub fn chat_ids_within(&self, body: &[u8], budget: usize) -> Result<ChatTokens, Error> {
        self.chat_ids_as(body, budget, chat::Calls::Validated)
    }

    /// [`Self::chat_ids_within`], its tool calls handed to the template as `calls` says.
    fn chat_ids_as(
        &self,
        body: &[u8],
        budget: usize,
        calls: chat::Calls,
    ) -> Result<ChatTokens, Error> {
        let (mut b, hashes) = self.shapes.read(body)?;
        b.calls = calls;
        // The text as pieces: the placeholder render's text between placeholders, and the
        // contents (not copied into one string: only the new tail is).
        let spliced = self.render_spliced(&b, &hashes)?;
        let whole: String;
        // The placeholders must all be whole ones of non-empty contents, else the whole render.
        let text = match spliced.as_ref().and_then(|(t, c)| pieces(t, c)) {
            Some(p) => {
                PLACEHOLDER_RENDERS.fetch_add(1, Ordering::Relaxed);
                let (pieces, of): (Vec<&str>, Vec<Option<usize>>) = p.into_iter().unzip();
                // A content stands for its message, named by the hash of its raw JSON.
                Rope::new(
                    pieces,
                    of.into_iter().map(|i| i.map(|i| hashes[i])).collect(),
                )
            }
            None => {
                whole = self.render_hashed(&b, &hashes)?;
                Rope::new(vec![whole.as_str()], vec![None])
            }
        };
        if !self.reuse || b.messages.is_empty() {
            let ids = self.ids_with_cut(&text.string_from(0))?.0;
            return Ok(ChatTokens {
                ids: ids.into(),
                reused: 0,
                covered_bytes: text.len,
                text_bytes: text.len,
            });
        }
        // Keys: what else reaches the template, then each leading message, chained.
        let mut h = xxh3_64(b.tools.unwrap_or("").as_bytes())
            ^ xxh3_64(b.chat_template_kwargs.unwrap_or("").as_bytes()).rotate_left(1)
            ^ xxh3_64(b.documents.unwrap_or("").as_bytes()).rotate_left(2)
            ^ xxh3_64(b.reasoning_effort.as_deref().unwrap_or("").as_bytes()).rotate_left(3)
            ^ u64::from(b.add_generation_prompt.unwrap_or(true))
            ^ u64::from(b.continue_final_message.unwrap_or(false)) << 1;
        let keys: Vec<u64> = hashes
            .iter()
            .map(|m| {
                h = xxh3_64_with_seed(&m.to_le_bytes(), h);
                h
            })
            .collect();
        let hit = self.cache.lock().expect("cache lock").longest(&keys, |e| {
            e.cut <= text.len
                && text.is_char_boundary(e.cut)
                && !self.straddles(&text, e.cut)
                && text.digest_to(e.cut) == e.prefix_hash
        });
        let (base_cut, base_ids) = hit.unwrap_or((0, Vec::new()));
        let base_len: usize = base_ids.iter().map(|s| s.len()).sum();
        let whole_tail = text.string_from(base_cut);
        let tail = match self.end_within(&text, base_cut, &whole_tail, budget) {
            Some(end) => &whole_tail[..end],
            None => whole_tail.as_str(),
        };
        let (tail_ids, cut) = self.ids_with_cut(tail)?;
        let tail_ids: Arc<[u32]> = tail_ids.into();
        // The tail's ids up to its last cut, which the new entry keeps (shared with the answer
        // where that is all of them).
        let to_cut: Option<Arc<[u32]>> = cut.map(|(_, n)| match n == tail_ids.len() {
            true => tail_ids.clone(),
            false => Arc::from(&tail_ids[..n]),
        });
        // Stopped within a budget: the ids stand only up to a cut the encoding confirms (an
        // added token the text search took for one may have been read otherwise).
        let stopped = tail.len() < whole_tail.len();
        let (kept, covered) = match (stopped, &to_cut, cut) {
            (false, _, _) => (tail_ids, base_cut + tail.len()),
            (true, Some(part), Some((end, _))) => (part.clone(), base_cut + end),
            (true, _, _) => return self.chat_ids_within(body, usize::MAX),
        };
        let mut segments = base_ids.clone();
        segments.push(kept);
        let ids = TokenIds::from_segments(segments);
        // The new entry shares the earlier one's ids and adds the tail's up to the cut.
        let entry = match (to_cut, cut) {
            (Some(part), Some((end, _))) => {
                let mut segments = base_ids;
                segments.push(part);
                Some(cache::Entry {
                    cut: base_cut + end,
                    prefix_hash: text.digest_to(base_cut + end),
                    ids: segments,
                })
            }
            _ if base_cut > 0 => Some(cache::Entry {
                cut: base_cut,
                prefix_hash: text.digest_to(base_cut),
                ids: base_ids,
            }),
            _ => None,
        };
        if let (Some(e), Some(key)) = (entry, keys.last()) {
            self.cache.lock().expect("cache lock").insert(*key, e);
        }
        Ok(ChatTokens {
            reused: base_len,
            ids,
            covered_bytes: covered,
            text_bytes: text.len,
        })
    }

    /// Where to stop tokenizing `tail` (the text from `from` on) to stay within `budget`
    /// bytes: just after the last cut token the tokenizer would split out within it (one
    /// leftmost-longest pass, as it matches added tokens) that no added token straddles, and
    /// in the budget's second half or later; None to tokenize it all (it fits, or no message
    /// ends there: a part of a few template tokens would tell nothing of a long first
    /// message).
    fn end_within(&self, text: &Rope, from: usize, tail: &str, budget: usize) -> Option<usize> {
        if tail.len() <= budget {
            return None;
        }
        let (ac, is_cut) = self.splits.as_ref()?;
        let mut limit = budget;
        while !tail.is_char_boundary(limit) {
            limit -= 1;
        }
        let end = ac
            .find_iter(&tail[..limit])
            .filter(|m| is_cut[m.pattern().as_usize()])
            .map(|m| m.end())
            .filter(|&end| !self.straddles(text, from + end))
            .last()?;
        (end >= budget / 2).then_some(end)
    }

    /// Whether an added token's text could match across `cut` in `text`.
    fn straddles(&self, text: &Rope, cut: usize) -> bool {
        let Some(ac) = &self.added else { return false };
        let lo = cut.saturating_sub(self.max_added.saturating_sub(1));
        let hi = (cut + self.max_added.saturating_sub(1)).min(text.len);
        ac.find_overlapping_iter(&text.bytes(lo, hi))
            .any(|m| lo + m.start() < cut && lo + m.end() > cut)
    }

    /// The ids of an Anthropic Messages body, rendered as vLLM renders it: converted to the chat
    /// body vLLM makes of it ([`convert::anthropic_chat`]), then as [`ModelTokens::chat_ids_within`].
    pub fn messages_ids_within(&self, body: &[u8], budget: usize) -> Result<ChatTokens, Error> {
        let chat = convert::anthropic_chat(body, &self.anthropic_rules())?;
        self.chat_ids_within(&chat, budget)
    }

    /// The ids of an OpenAI Responses body, as [`ModelTokens::messages_ids_within`] with
    /// [`convert::responses_chat`]. A Harmony model (gpt-oss: its template speaks in channels)
    /// renders Responses otherwise, and is refused.
    pub fn responses_ids_within(&self, body: &[u8], budget: usize) -> Result<ChatTokens, Error> {
        let harmony = self
            .config
            .chat_template
            .as_deref()
            .is_some_and(|t| t.contains("<|channel|>"));
        if harmony {
            return Err(Error::Body(
                "a Harmony model renders Responses its own way".into(),
            ));
        }
        let converted = convert::responses_chat(body)?;
        // vLLM hands the messages it built to the template as they are, calls unvalidated.
        self.chat_ids_as(&converted, budget, chat::Calls::AsBuilt)
    }

    /// What vLLM learns of the template before converting Anthropic bodies: whether it refuses
    /// a system message after the first (rendering `[system, user, system, user]` fails), and
    /// which effort thinking turned off becomes (`none`, unless `none` fails to render or
    /// renders as one of the efforts: `low`).
    pub fn anthropic_rules(&self) -> convert::AnthropicRules {
        *self.anthropic.get_or_init(|| {
            let m = |role: &str| format!(r#"{{"role":"{role}","content":"t"}}"#);
            let probe = format!(
                r#"{{"messages":[{},{},{},{}],"add_generation_prompt":false}}"#,
                m("system"),
                m("user"),
                m("system"),
                m("user")
            );
            let merge_inline_system = self.render_chat(probe.as_bytes()).is_err();
            let with_effort = |effort: &str| {
                let body = format!(
                    r#"{{"messages":[{{"role":"user","content":"Hi"}}],"chat_template_kwargs":{{"reasoning_effort":"{effort}","enable_thinking":{}}}}}"#,
                    effort != "none"
                );
                self.render_chat(body.as_bytes()).ok()
            };
            let disabled_thinking_effort = match with_effort("none") {
                None => "low",
                Some(none) => match convert::ANTHROPIC_EFFORTS
                    .iter()
                    .any(|e| with_effort(e).as_ref() == Some(&none))
                {
                    true => "low",
                    false => "none",
                },
            };
            convert::AnthropicRules {
                merge_inline_system,
                disabled_thinking_effort,
            }
        })
    }

    /// A completions prompt's ids (with the tokenizer's own special tokens, as vLLM adds them).
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>, Error> {
        Ok(self.encode(prompt, true)?.get_ids().to_vec())
    }
}

/// Where a text's last cut token ends, and the number of its ids up to there.
type Cut = Option<(usize, usize)>;

/// A prompt given as token ids is used as it is.
pub fn token_prompt(ids: &[u32]) -> &[u32] {
    ids
}
