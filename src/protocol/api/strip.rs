//! Top-level members a client may not send: dropped from its body before any replica reads it.
//!
//! Matched as the replica's Python `json` reads them: on the decoded key (`"kv\u005ftransfer"`
//! is `kv_transfer`), every occurrence (Python keeps the last of repeated keys). A body that
//! might name one but that the checker cannot read (Python also takes `NaN`, UTF-16, a BOM) is
//! refused rather than guessed at. Most bodies name none: a scan for the names' bytes, or for
//! a `\u00..` escape that could spell one, settles them without the checking pass.

use memchr::memmem;

use super::json::top_members;

/// Fields that steer a replica's internals (vLLM's KV transfer from a remote host, SGLang's
/// disaggregation bootstrap): only inferlb may set them.
pub const STEERING: [&str; 7] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    // SGLang's pairing and rank fields: where a decode's KV comes from is inferlb's to say.
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
];

#[derive(Debug, PartialEq, Eq)]
pub enum Stripped {
    /// No such member: forward the body as it came.
    Unchanged,
    /// The body without them.
    Body(Vec<u8>),
    /// It may hold one, and is not JSON this checker reads.
    Unreadable,
}

/// Whether `body` could hold a key in `names` as Python would decode it: a name's bytes, a
/// `\u00XX` escape of a character names use, or a NUL (UTF-16 and UTF-32 bodies, which
/// Python's `json.loads` detects).
fn might_name(body: &[u8], names: &[&str]) -> bool {
    if body.contains(&0)
        || names
            .iter()
            .any(|n| memmem::find(body, n.as_bytes()).is_some())
    {
        return true;
    }
    // The first hex digit of `\u00XX` for each ASCII byte a name holds.
    let mut first = [false; 8];
    for b in names.iter().flat_map(|n| n.bytes()) {
        first[usize::from((b >> 4) & 7)] = true;
    }
    memmem::find_iter(body, b"\\u00").any(|at| {
        body.get(at + 4)
            .and_then(|d| (*d as char).to_digit(8))
            .is_some_and(|d| first[d as usize])
    })
}

/// `body` without its top-level members named in `names`.
pub fn strip_members(body: &[u8], names: &[&str]) -> Stripped {
    if !might_name(body, names) {
        return Stripped::Unchanged;
    }
    let Ok(found) = top_members(body, names) else {
        return Stripped::Unreadable;
    };
    let Some(object) = found.filter(|o| o.members.iter().any(|m| m.2)) else {
        return Stripped::Unchanged;
    };
    let mut out = Vec::with_capacity(body.len());
    out.extend_from_slice(&body[..=object.open]);
    let kept = object.members.iter().filter(|m| !m.2);
    for (i, &(start, end, _)) in kept.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&body[start..end]);
    }
    out.extend_from_slice(&body[object.close..]);
    Stripped::Body(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(body: &str) -> Stripped {
        strip_members(body.as_bytes(), &STEERING)
    }

    fn body(s: &str) -> Stripped {
        Stripped::Body(s.as_bytes().to_vec())
    }

    #[test]
    fn steering_members_are_dropped_wherever_and_however_written() {
        let cases: &[(&str, Stripped)] = &[
            (
                r#"{"model":"m","kv_transfer_params":{"remote_host":"10.0.0.9"}}"#,
                body(r#"{"model":"m"}"#),
            ),
            (
                r#"{"kv_transfer_params":1,"model":"m","stream":true}"#,
                body(r#"{"model":"m","stream":true}"#),
            ),
            (
                r#" { "a" : 1 , "bootstrap_host" : "h" , "b" : [2] } "#,
                body(r#" {"a" : 1,"b" : [2]} "#),
            ),
            // Repeated: Python keeps the last, so every one goes.
            (
                r#"{"bootstrap_port":1,"m":2,"bootstrap_port":3,"bootstrap_room":4}"#,
                body(r#"{"m":2}"#),
            ),
            // Escaped keys decode to the same name in Python.
            (
                r#"{"kv\u005ftransfer_params":{},"m":1}"#,
                body(r#"{"m":1}"#),
            ),
            (r#"{"\u0062ootstrap_host":"x"}"#, body("{}")),
            (r#"{"bootstrap\u005Froom":7,"m":[]}"#, body(r#"{"m":[]}"#)),
            // Only top-level members steer a replica.
            (
                r#"{"m":{"kv_transfer_params":1},"x":"bootstrap_host"}"#,
                Stripped::Unchanged,
            ),
            (r#"{"model":"m","messages":[]}"#, Stripped::Unchanged),
            (r#"{"model":"caf\u00e9 \u001b[0m"}"#, Stripped::Unchanged),
            (r#"["kv_transfer_params"]"#, Stripped::Unchanged),
            // Not this key, nearly.
            (r#"{"kv_transfer_params_x":1}"#, Stripped::Unchanged),
            // Unreadable here but possibly holding one: refused.
            (r#"{"x":NaN,"kv_transfer_params":{}}"#, Stripped::Unreadable),
            (r#"{"kv_transfer_params":{}"#, Stripped::Unreadable),
            ("\u{feff}{\"kv_transfer_params\":{}}", Stripped::Unreadable),
            (r#"{"k\u0076_transfer_params":1,}"#, Stripped::Unreadable),
            // Unreadable but naming none: the replica answers it.
            (r#"{"x":NaN}"#, Stripped::Unchanged),
            ("hello", Stripped::Unchanged),
        ];
        for (input, want) in cases {
            assert_eq!(&strip(input), want, "{input}");
        }
    }

    #[test]
    fn utf16_bodies_are_never_passed_unread() {
        let text = r#"{"kv_transfer_params":{}}"#;
        let utf16: Vec<u8> = text.encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(strip_members(&utf16, &STEERING), Stripped::Unreadable);
    }

    #[test]
    fn what_is_kept_is_what_python_would_read_less_the_names() {
        let input =
            r#"{"a":1,"kv_transfer_params":{"x":[1,{"y":"}"}]},"b":"\"}","bootstrap_room":2}"#;
        let Stripped::Body(out) = strip(input) else {
            panic!("not stripped")
        };
        let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(v, serde_json::json!({"a": 1, "b": "\"}"}));
    }
}
