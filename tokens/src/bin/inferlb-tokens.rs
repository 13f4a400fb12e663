//! `inferlb-tokens DIR`: reads chat bodies as JSON lines on stdin and writes each one's token ids
//! (through the message cache) as a JSON line, `{"ids": [...], "reused": n}` or `{"error": "..."}`.
//! A line `{"prompt": "..."}` is a completions prompt instead. For the differential test
//! against transformers.

use std::io::{BufRead, Write};

use inferlb_tokens::ModelTokens;

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: inferlb-tokens TOKENIZER_DIR < requests.jsonl");
        std::process::exit(2);
    };
    let model = match ModelTokens::from_dir(&dir) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("inferlb-tokens: {e}");
            std::process::exit(1);
        }
    };
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        if line.trim().is_empty() {
            continue;
        }
        let prompt = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("prompt").and_then(|p| p.as_str()).map(str::to_owned));
        let answer = match prompt {
            Some(p) => model
                .prompt_ids(&p)
                .map(|ids| serde_json::json!({ "ids": ids })),
            None => model
                .chat_ids(line.as_bytes())
                .map(|t| serde_json::json!({ "ids": t.ids.to_vec(), "reused": t.reused })),
        };
        let answer = answer.unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
        writeln!(out, "{answer}").expect("stdout");
        out.flush().expect("stdout");
    }
}
