//! Rendering a chat body with the model's template as vLLM 0.33 renders it: the template
//! transformers would pick ([`Template`]), the variables vLLM passes it ([`variables`]), the
//! conversation as vLLM builds it ([`crate::chat`]), and, where the template writes contents
//! only as they are, a render with placeholders for the contents ([`Fields`], [`pieces`]), so
//! that a turn costs per message rather than per byte.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use indexmap::IndexMap;
use minijinja::{Environment, Value};
use xxhash_rust::xxh3::xxh3_64;

use crate::template::{self, ContentFormat};
use crate::{cache, chat, Error, ModelTokens, TokenizerConfig};

/// One of a model's chat templates, and what is learnt of it.
pub(crate) struct Template {
    env: Environment<'static>,
    pub(crate) format: ContentFormat,
    /// Whether a conversation may be rendered with placeholders for its contents (see
    /// [`template::content_is_text_only`]); turned off for good once a render reads a whole
    /// message.
    pub(crate) splice: AtomicBool,
    /// Set by a placeholder render that read a whole message.
    whole: Arc<AtomicBool>,
    /// The template names no `developer` role: vLLM makes developer messages system ones
    /// ([`chat::developer_as_system`]).
    developer_as_system: bool,
    /// What the keys of its converted messages and skeletons are salted with: they are made
    /// for its content format, and note its reads.
    salt: u64,
}

impl Template {
    /// `source` set up as transformers sets up Jinja; `path` names it in errors.
    pub(crate) fn new(
        source: &str,
        path: &Path,
        salt: u64,
        config: &TokenizerConfig,
    ) -> Result<Self, Error> {
        let marked = |s: &str| s.contains(MARK) || s.to_ascii_lowercase().contains("uf8ff");
        let env = template::environment(source.to_owned()).map_err(|e| Error::Key {
            path: path.to_owned(),
            key: "chat_template".into(),
            msg: format!("{e:#}"),
        })?;
        let format = template::detect_content_format(source);
        let splice = format == ContentFormat::String
            && template::content_is_text_only(&env)
            && !marked(source)
            && ![
                &config.bos_token,
                &config.eos_token,
                &config.unk_token,
                &config.pad_token,
            ]
            .iter()
            .any(|t| t.as_deref().is_some_and(marked));
        Ok(Template {
            env,
            format,
            splice: AtomicBool::new(splice),
            whole: Arc::new(AtomicBool::new(false)),
            developer_as_system: !chat::template_knows_developer(source),
            salt,
        })
    }
}

/// The variables a template gets besides the messages, by name.
type Variables = IndexMap<String, Value>;

/// What vLLM 0.33 passes the template from a chat body besides its messages, in two merges
/// (`merge_kwargs`). `build_chat_params` sets over the request's `chat_template_kwargs` its own
/// `add_generation_prompt` (true unless set), `continue_final_message`, and where set
/// `documents` and `reasoning_effort` (with `enable_thinking`, effort not `none`, unless the
/// kwargs name it); `with_defaults` then sets all that over the server's defaults (the tools,
/// `tokenize`), which drops every null and `"auto"`. The kwargs may replace the tools; names
/// transformers takes as its own arguments fail there, and are refused here.
/// `continue_final_message` is transformers' to act on, never the template's.
fn variables(b: &chat::ChatBody) -> Result<Variables, Error> {
    let continued = b.continue_final_message.unwrap_or(false);
    let generation = b.add_generation_prompt.unwrap_or(true);
    if continued && generation {
        // vLLM's request model refuses it (or transformers does, where the body left the
        // generation prompt to its default).
        return Err(Error::Body(
            "continue_final_message and add_generation_prompt are both true".into(),
        ));
    }
    let mut vars: Variables = match b.chat_template_kwargs {
        Some(kw) if kw != "null" => serde_json::from_str(kw)
            .map_err(|e| Error::Body(format!("chat_template_kwargs: {e}")))?,
        _ => IndexMap::new(),
    };
    let user_thinking = vars.contains_key("enable_thinking");
    vars.insert("add_generation_prompt".into(), Value::from(generation));
    if let Some(docs) = b.documents {
        let docs: Value =
            serde_json::from_str(docs).map_err(|e| Error::Body(format!("documents: {e}")))?;
        vars.insert("documents".into(), docs);
    }
    if let Some(effort) = b.reasoning_effort.as_deref() {
        if effort != "auto" {
            vars.insert("reasoning_effort".into(), Value::from(effort));
        }
        if !user_thinking {
            vars.insert("enable_thinking".into(), Value::from(effort != "none"));
        }
    }
    vars.retain(|_, v| !v.is_none() && v.as_str() != Some("auto"));
    vars.shift_remove("continue_final_message");
    vars.shift_remove("tokenize");
    let taken = [
        "messages",
        "conversation",
        "chat_template",
        "tokenizer",
        "model_config",
    ];
    if let Some(k) = taken.iter().find(|k| vars.contains_key(**k)) {
        return Err(Error::Body(format!(
            "chat_template_kwargs: `{k}` cannot be set there"
        )));
    }
    Ok(vars)
}

/// Python's `str.isspace`: Unicode's white space and the four ASCII separators.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// What transformers appends to a continued last message's content to find where it ends in
/// the rendering.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Placeholder `i` is `MARK i END`: private-use characters, refused in bodies and templates.
pub(crate) const MARK: char = '\u{F8FF}';
const END: char = '\u{F8FE}';

/// A placeholder render's text, and the content of each message (None where it was not
/// replaced).
type Placeheld = (String, Vec<Option<Value>>);

/// A message whose content is a placeholder, and that content.
#[derive(Clone)]
pub(crate) struct Skeleton {
    value: Value,
    content: Option<Value>,
    bytes: usize,
}

impl cache::Weigh for Skeleton {
    fn weight(&self) -> usize {
        self.bytes + 64
    }
}

/// A message as the template sees it, that notes when it is read whole (iterated, dumped,
/// printed) rather than field by field: a placeholder render is then not the same text.
#[derive(Debug)]
struct Fields {
    map: IndexMap<Value, Value>,
    whole: Arc<AtomicBool>,
}

impl minijinja::value::Object for Fields {
    fn repr(self: &Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.map.get(key).cloned()
    }

    /// `message.role` and the like: a scan of a message's few fields, not a hash.
    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.map
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> minijinja::value::Enumerator {
        self.whole.store(true, Ordering::SeqCst);
        minijinja::value::Enumerator::Values(self.map.keys().cloned().collect())
    }

    /// The number of fields is the same with a placeholder: `message|length` reads no content.
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.map.len())
    }

    /// As a map's truth, without enumerating: `{% if message %}` reads no content.
    fn is_true(self: &Arc<Self>) -> bool {
        !self.map.is_empty()
    }

    /// `message.get(key)` with a key the template computed (a constant `'content'` is refused
    /// by the scan) is a read of the content this cannot follow. The method itself is left to
    /// pycompat's callback.
    fn call_method(
        self: &Arc<Self>,
        _state: &mut minijinja::State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, minijinja::Error> {
        if method == "get" && args.first().and_then(Value::as_str) == Some("content") {
            self.whole.store(true, Ordering::SeqCst);
        }
        Err(minijinja::Error::from(minijinja::ErrorKind::UnknownMethod))
    }
}

/// Renders that used placeholders (their pieces were all whole placeholders), for tests.
pub(crate) static PLACEHOLDER_RENDERS: AtomicU64 = AtomicU64::new(0);

/// How many chat renders so far, in this process, used placeholders for contents.
#[doc(hidden)]
pub fn placeholder_renders() -> u64 {
    PLACEHOLDER_RENDERS.load(Ordering::Relaxed)
}

/// What a message's cache key is salted with: its conversion depends on how calls are handed.
fn calls_salt(calls: chat::Calls) -> u64 {
    match calls {
        chat::Calls::Validated => 0,
        chat::Calls::AsBuilt => 0xA5A5_5A5A_C3C3_3C3C,
    }
}

/// `text` as pieces with each placeholder replaced by its content (with the index of its
/// message), or None if a mark is not a whole placeholder of a non-empty content.
pub(crate) fn pieces<'a>(
    text: &'a str,
    contents: &'a [Option<Value>],
) -> Option<Vec<(&'a str, Option<usize>)>> {
    let mut out = Vec::with_capacity(2 * contents.len() + 1);
    let mut rest = text;
    while let Some(at) = rest.find(MARK) {
        out.push((&rest[..at], None));
        let after = &rest[at + MARK.len_utf8()..];
        let end = after.find(END)?;
        let digits = &after[..end];
        if digits.is_empty() || !digits.bytes().all(|d| d.is_ascii_digit()) {
            return None;
        }
        let i: usize = digits.parse().ok()?;
        out.push((contents.get(i)?.as_ref()?.as_str()?, Some(i)));
        rest = &after[end + END.len_utf8()..];
    }
    out.push((rest, None));
    Some(out)
}

impl ModelTokens {
    /// The template transformers renders this body with, and the variables vLLM passes it
    /// besides the messages ([`variables`]). The template is the one named `tool_use` where
    /// there are tools (even an empty list, the body's or the kwargs') and the model names one,
    /// else the default.
    fn prepare(&self, b: &chat::ChatBody) -> Result<(&Template, Variables), Error> {
        let vars = variables(b)?;
        let named = self
            .tool_use
            .as_ref()
            .filter(|_| b.tools.is_some() || vars.contains_key("tools"));
        let t = named
            .or(self.default.as_ref())
            .ok_or_else(|| Error::NoTemplate {
                path: self.config_path.clone(),
            })?;
        Ok((t, vars))
    }

    /// The text vLLM would tokenize for this chat body.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, Error> {
        let b = chat::ChatBody::parse(body)?;
        self.render(&b)
    }

    pub(crate) fn render(&self, b: &chat::ChatBody) -> Result<String, Error> {
        let hashes: Vec<u64> = b.messages.iter().map(|m| xxh3_64(m.as_bytes())).collect();
        self.render_hashed(b, &hashes)
    }

    /// The whole render, given the hash of each message's raw JSON.
    pub(crate) fn render_hashed(
        &self,
        b: &chat::ChatBody,
        hashes: &[u64],
    ) -> Result<String, Error> {
        let (t, vars) = self.prepare(b)?;
        // Each message is converted once: a resent history costs a hash per message here.
        let mut messages = Vec::with_capacity(b.messages.len());
        {
            let mut seen = self.messages.lock().expect("message lock");
            for (raw, &hash) in b.messages.iter().zip(hashes) {
                let key = hash ^ calls_salt(b.calls) ^ t.salt;
                let value = match seen.get(&key) {
                    Some((v, _)) => v.clone(),
                    None => {
                        let v = chat::message(raw, t.format, b.calls)?;
                        seen.put(key, (v.clone(), raw.len()));
                        v
                    }
                };
                messages.push(value);
            }
            seen.trim();
        }
        self.render_messages(t, vars, b, messages)
    }

    /// The text with each non-empty content a placeholder, and the contents, or None where that
    /// could differ from the whole render (the template reads contents or whole messages, the
    /// body holds the placeholder mark, or its last message is continued). [`pieces`] then
    /// checks the placeholders and puts the contents back. Its cost grows with the number of
    /// messages, not their size.
    pub(crate) fn render_spliced(
        &self,
        b: &chat::ChatBody,
        hashes: &[u64],
    ) -> Result<Option<Placeheld>, Error> {
        // An error is left for the whole render to give.
        let Ok((t, vars)) = self.prepare(b) else {
            return Ok(None);
        };
        let small = [
            b.tools,
            b.chat_template_kwargs,
            b.documents,
            b.reasoning_effort.as_deref(),
        ];
        if !t.splice.load(Ordering::SeqCst)
            || b.continue_final_message == Some(true)
            || small.iter().flatten().any(|r| self.marker.is_match(r))
        {
            return Ok(None);
        }
        let mut messages = Vec::with_capacity(b.messages.len());
        let mut contents = Vec::with_capacity(b.messages.len());
        {
            let mut seen = self.skeletons.lock().expect("skeleton lock");
            for (i, (raw, h)) in b.messages.iter().zip(hashes).enumerate() {
                // The placeholder names the position, so the position is part of the key.
                let key = h
                    ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ calls_salt(b.calls)
                    ^ t.salt;
                let skel = match seen.get(&key) {
                    Some(s) => s.clone(),
                    None if self.marker.is_match(raw) => return Ok(None),
                    None => {
                        let mut fields = chat::fields(raw, t.format, b.calls)?;
                        let content = fields
                            .get("content")
                            .filter(|c| c.as_str().is_some_and(|s| !s.is_empty()))
                            .cloned();
                        if content.is_some() {
                            fields.insert("content", Value::from(format!("{MARK}{i}{END}")));
                        }
                        let s = Skeleton {
                            value: Value::from_object(Fields {
                                map: fields
                                    .into_iter()
                                    .map(|(k, v)| (Value::from(k), v))
                                    .collect(),
                                whole: t.whole.clone(),
                            }),
                            content,
                            bytes: raw.len(),
                        };
                        seen.put(key, s.clone());
                        s
                    }
                };
                messages.push(skel.value);
                contents.push(skel.content);
            }
            seen.trim();
        }
        // Developer messages merged into the system message move contents: rendered whole.
        let developer = |m: &Value| {
            m.get_attr("role")
                .is_ok_and(|r| r.as_str() == Some("developer"))
        };
        if t.developer_as_system && messages.iter().any(developer) {
            return Ok(None);
        }
        let Ok(text) = self.render_messages(t, vars, b, messages) else {
            return Ok(None);
        };
        if t.whole.load(Ordering::SeqCst) {
            t.splice.store(false, Ordering::SeqCst);
            return Ok(None);
        }
        Ok(Some((text, contents)))
    }

    /// The template rendered with these messages and `vars` ([`variables`]); a continued last
    /// message is cut where its content ends, as transformers cuts it.
    fn render_messages(
        &self,
        t: &Template,
        mut vars: Variables,
        b: &chat::ChatBody,
        messages: Vec<Value>,
    ) -> Result<String, Error> {
        let mut messages = match t.developer_as_system {
            true => chat::developer_as_system(messages),
            false => messages,
        };
        let final_text = match b.continue_final_message == Some(true) {
            true => {
                let last = messages.last_mut().ok_or_else(|| {
                    Error::Body("continue_final_message with no message to continue".into())
                })?;
                let (tagged, text) = chat::with_content_suffix(last, CONTINUE_TAG)?;
                *last = tagged;
                Some(text)
            }
            false => None,
        };
        // The kwargs' tools replace the body's, as they come.
        let tools = match vars.shift_remove("tools") {
            Some(tools) => tools,
            None => chat::tools(b.tools)?,
        };
        let mut ctx: IndexMap<String, Value> = IndexMap::new();
        // transformers passes the special tokens under the kwargs: the kwargs win.
        for (key, tok) in [
            ("bos_token", &self.config.bos_token),
            ("eos_token", &self.config.eos_token),
            ("unk_token", &self.config.unk_token),
            ("pad_token", &self.config.pad_token),
        ] {
            if let Some(tok) = tok {
                ctx.insert(key.into(), Value::from(tok.as_str()));
            }
        }
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert("tools".into(), tools);
        ctx.insert("documents".into(), Value::from(()));
        ctx.extend(vars);
        let tmpl = t
            .env
            .get_template(template::NAME)
            .map_err(|e| Error::Template(format!("{e:#}")))?;
        let mut text = tmpl
            .render(chat::obj(ctx))
            .map_err(|e| Error::Template(format!("{e:#}")))?;
        if let Some(content) = final_text {
            let tag = CONTINUE_TAG.trim();
            let at = text
                .rfind(tag)
                .filter(|_| text.contains(content.trim_matches(py_space)))
                .ok_or_else(|| {
                    Error::Template(
                        "continue_final_message: the final message does not appear in the \
                         rendering"
                            .into(),
                    )
                })?;
            let spaced = text[at..].starts_with(CONTINUE_TAG);
            text.truncate(at);
            if !spaced {
                // The template trimmed the message's trailing space.
                text.truncate(text.trim_end_matches(py_space).len());
            }
        }
        Ok(text)
    }
}
