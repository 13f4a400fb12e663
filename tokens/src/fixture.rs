//! A small tokenizer directory made on the spot (a byte-level BPE trained on a few lines, and a
//! chat template), for tests and benches that must not download a model. Not for production.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// A ChatML template with tools, shaped like Qwen2.5's.
pub const CHATML_TOOLS: &str = include_str!("../templates/chatml_tools.jinja");
/// A Llama-3-like template: the BOS in the text, content parts looped over, tools as indented JSON.
pub const LLAMA3_LIKE: &str = include_str!("../templates/llama3_like.jinja");
/// A Qwen3-like template that drops the reasoning of turns before the last user query.
pub const QWEN3_LIKE: &str = include_str!("../templates/qwen3_like.jinja");

pub const SPECIAL: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

const CORPUS: &str = "The quick brown fox jumps over the lazy dog. A balancer routes requests to \
replicas that hold their prefix in cache. {\"name\": \"get_weather\", \"arguments\": {\"city\": \
\"Paris\", \"unit\": \"celsius\"}} You are a helpful assistant. What is the weather like today? \
tool_call tool_response think reasoning 0123456789 user assistant system function parameters \
object string properties required description type";

/// Writes `tokenizer.json` and `tokenizer_config.json` (with `template`) into `dir`.
pub fn write_dir(dir: &Path, template: &str) -> std::io::Result<()> {
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(600)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tk = Tokenizer::new(BPE::default());
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tk.with_decoder(Some(ByteLevel::default()));
    let lines: Vec<String> = CORPUS.split(". ").map(str::to_owned).collect();
    let mut wrapped = tokenizers::models::TrainerWrapper::from(trainer);
    tk.train(&mut wrapped, lines.into_iter())
        .map_err(std::io::Error::other)?;
    let specials: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
    tk.add_special_tokens(&specials);
    tk.save(dir.join("tokenizer.json"), false)
        .map_err(std::io::Error::other)?;
    let config = serde_json::json!({
        "chat_template": template,
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|im_end|>", "lstrip": false, "rstrip": false},
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string())
}
