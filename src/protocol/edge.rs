//! What passes the front door, decided on one form of the request target: the form the replica
//! routes on. Pure: [`normalise`] turns a target into that form (or says why it is ambiguous),
//! [`PathRule`] and [`forwarded_by_default`] say which paths are forwarded or open without a
//! key. Not for headers or bodies (`proxy::request`, `api::strip`).
//!
//! uvicorn (vLLM, SGLang) decodes every percent-escape before routing, even `%2F`, so a target
//! inferlb left encoded could name a path it never checked. Hence: unreserved escapes are
//! decoded here, and any other escape is refused rather than guessed at.

/// Why a request target was refused; each is a 400.
pub type Refused = &'static str;

fn unreserved(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

/// An origin-form target (`/path?query`) in the form the replica will route on: escapes of
/// unreserved characters decoded, repeated slashes merged, dot segments resolved (RFC 3986
/// 5.2.4). The query is kept as it came. Refused: any other `%`, a backslash, a control or
/// non-ASCII byte in the path; a control or non-ASCII byte in the query.
pub fn normalise(target: &[u8]) -> Result<String, Refused> {
    let (path, query) = match target.iter().position(|&b| b == b'?') {
        Some(q) => (&target[..q], Some(&target[q..])),
        None => (target, None),
    };
    if path.first() != Some(&b'/') {
        return Err("the request target must be a path starting with '/'");
    }
    if let Some(q) = query {
        if q.iter().any(|&b| b <= b' ' || b >= 0x7f || b == b'#') {
            return Err("the query has a control, non-ASCII or '#' byte");
        }
    }
    let mut decoded = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let c = path[i];
        match c {
            b'%' => {
                let d = path
                    .get(i + 1..i + 3)
                    .and_then(|h| Some((hex(h[0])? << 4) | hex(h[1])?))
                    .filter(|&d| unreserved(d))
                    .ok_or("the path has a percent-escape of a reserved or unsafe character")?;
                decoded.push(d);
                i += 3;
                continue;
            }
            b'\\' => return Err("the path has a backslash"),
            b'#' => return Err("the target has a fragment"),
            _ if c <= b' ' || c >= 0x7f => {
                return Err("the path has a control, space or non-ASCII byte")
            }
            _ => decoded.push(c),
        }
        i += 1;
    }
    // Only ASCII went in.
    let decoded = String::from_utf8(decoded).map_err(|_| "the path is not ASCII")?;
    let mut out = remove_dot_segments(&decoded);
    if let Some(q) = query {
        out.push_str(std::str::from_utf8(q).map_err(|_| "the query is not ASCII")?);
    }
    Ok(out)
}

/// Repeated slashes merged, then RFC 3986 5.2.4 on what remains: `.` dropped, `..` drops the
/// segment before it (never above the root); a path ending in either ends with a slash.
fn remove_dot_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut trailing = false;
    for seg in path.split('/').skip(1) {
        trailing = false;
        match seg {
            "" => trailing = true,
            "." => trailing = true,
            ".." => {
                out.pop();
                trailing = true;
            }
            s => out.push(s),
        }
    }
    let mut s = String::with_capacity(path.len());
    for seg in &out {
        s.push('/');
        s.push_str(seg);
    }
    if trailing || out.is_empty() {
        s.push('/');
    }
    s
}

/// One path of a conf list (`forward_paths`, `public_paths`): exact, or every path below a
/// prefix when written with a trailing `/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathRule {
    Exact(String),
    /// Paths that start with this and a slash, and go on.
    Below(String),
}

impl PathRule {
    /// A conf entry; it must already be in [`normalise`]d form (else it could never match).
    pub fn parse(text: &str) -> Result<PathRule, String> {
        let (base, below) = match text.strip_suffix("/*") {
            Some(b) => (b, true),
            None => (text, false),
        };
        let whole = if below {
            format!("{base}/")
        } else {
            base.into()
        };
        if base.contains('*') || text.contains('?') {
            return Err(format!(
                "{text:?}: only a trailing `/*` is a wildcard, and no query"
            ));
        }
        match normalise(whole.as_bytes()) {
            Ok(n) if n == whole => {}
            Ok(n) => {
                return Err(format!(
                    "{text:?} is not in normal form (it would be {n:?})"
                ))
            }
            Err(e) => return Err(format!("{text:?}: {e}")),
        }
        Ok(if below {
            PathRule::Below(base.into())
        } else {
            PathRule::Exact(base.into())
        })
    }

    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathRule::Exact(p) => path == p,
            PathRule::Below(p) => path
                .strip_prefix(p.as_str())
                .and_then(|rest| rest.strip_prefix('/'))
                .is_some_and(|rest| !rest.is_empty()),
        }
    }
}

/// Whether `path` matches any of `rules`.
pub fn any(rules: &[PathRule], path: &str) -> bool {
    rules.iter().any(|r| r.matches(path))
}

/// The paths forwarded with no conf: the inference endpoints inferlb routes (and Anthropic's
/// token count, OpenAI's embeddings), `/v1/models`, and a stored response's paths. Not a
/// replica's control or debugging endpoints (`/pause`, `/sleep`, `/flush_cache`,
/// `/collective_rpc`, `/v1/load_lora_adapter`, ...), nor its other inference paths
/// (`/invocations`, `/pooling`, `/tokenize`, `/generate`): `forward_paths` adds those.
pub fn forwarded_by_default(path: &str) -> bool {
    const EXACT: [&str; 7] = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/models",
    ];
    if EXACT.contains(&path) {
        return true;
    }
    // `/v1/responses/{id}`, `.../cancel`, `.../input_items`.
    let Some(rest) = path.strip_prefix("/v1/responses/") else {
        return false;
    };
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    !id.is_empty() && matches!(tail, "" | "cancel" | "input_items")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_normalised_to_the_form_the_replica_routes_on() {
        let cases: &[(&str, &str)] = &[
            ("/v1/chat/completions", "/v1/chat/completions"),
            ("/%761/chat/completions", "/v1/chat/completions"),
            ("/%76%31/chat/completions", "/v1/chat/completions"),
            ("/V1/chat/completions", "/V1/chat/completions"),
            ("/v1//chat/completions", "/v1/chat/completions"),
            ("//v1///chat/completions", "/v1/chat/completions"),
            ("/v1/./chat/completions", "/v1/chat/completions"),
            ("/v1/x/../chat/completions", "/v1/chat/completions"),
            ("/v1/x/%2e%2e/chat/completions", "/v1/chat/completions"),
            ("/%2e%2e/v1/chat/completions", "/v1/chat/completions"),
            ("/../../v1/models", "/v1/models"),
            ("/v1/models/.", "/v1/models/"),
            ("/v1/models/..", "/v1/"),
            ("/v1/models/", "/v1/models/"),
            ("/", "/"),
            ("/..", "/"),
            ("/v1/%7Euser", "/v1/~user"),
            (
                "/v1/chat/completions?a=%2F&b=1",
                "/v1/chat/completions?a=%2F&b=1",
            ),
            ("/v1//x/../chat?q=/../", "/v1/chat?q=/../"),
            ("/v1/models?", "/v1/models?"),
        ];
        for (target, want) in cases {
            assert_eq!(
                normalise(target.as_bytes()).as_deref(),
                Ok(*want),
                "{target}"
            );
        }
    }

    #[test]
    fn ambiguous_targets_are_refused() {
        let cases: &[&[u8]] = &[
            b"/v1/chat%2Fcompletions",
            b"/v1/chat%2fcompletions",
            b"/v1/chat/completions%00",
            b"/v1/chat/completions%",
            b"/v1/chat/completions%7",
            b"/v1/chat/completions%zz",
            b"/v1/%2525",
            b"/v1/%25",
            b"/v1/%20x",
            b"/v1\\chat\\completions",
            b"/v1/chat/completions\0",
            b"/v1/chat/compl\x01etions",
            b"/v1/caf\xc3\xa9",
            b"/v1/x\x7f",
            b"/v1/x#frag",
            b"/v1/models?q=\xff",
            b"/v1/models?q=a\x00",
            b"v1/models",
            b"*",
            b"",
        ];
        for target in cases {
            assert!(
                normalise(target).is_err(),
                "{}",
                String::from_utf8_lossy(target)
            );
        }
    }

    #[test]
    fn a_normalised_target_is_its_own_normal_form() {
        for target in ["/%761//x/../chat/./completions", "/a/b/../../..", "/v1/%7e"] {
            let once = normalise(target.as_bytes()).unwrap();
            assert_eq!(normalise(once.as_bytes()).unwrap(), once, "{target}");
        }
    }

    #[test]
    fn path_rules_are_exact_or_below_a_prefix_and_checked() {
        let exact = PathRule::parse("/tokenize").unwrap();
        assert!(exact.matches("/tokenize"));
        assert!(!exact.matches("/tokenize/x") && !exact.matches("/tokenizer"));
        let below = PathRule::parse("/sim/*").unwrap();
        assert_eq!(below, PathRule::Below("/sim".into()));
        for yes in ["/sim/echo", "/sim/a/b"] {
            assert!(below.matches(yes), "{yes}");
        }
        for no in ["/sim", "/sim/", "/simx/echo", "/v1/sim/echo"] {
            assert!(!below.matches(no), "{no}");
        }
        assert!(PathRule::parse("/*").unwrap().matches("/anything"));
        for bad in [
            "tokenize", "/a//b", "/a/../b", "/%76", "/a*", "/a/*/b", "/a?x=1", "/a\\b", "",
        ] {
            assert!(PathRule::parse(bad).is_err(), "{bad}");
        }
        let rules = [exact, below];
        assert!(any(&rules, "/sim/echo") && any(&rules, "/tokenize"));
        assert!(!any(&rules, "/health") && !any(&[], "/tokenize"));
    }

    #[test]
    fn the_default_allow_list_is_the_inference_api() {
        for yes in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/embeddings",
            "/v1/models",
            "/v1/responses/resp_1",
            "/v1/responses/resp_1/cancel",
            "/v1/responses/resp_1/input_items",
        ] {
            assert!(forwarded_by_default(yes), "{yes}");
        }
        for no in [
            "/",
            "/health",
            "/metrics",
            "/invocations",
            "/pooling",
            "/score",
            "/tokenize",
            "/detokenize",
            "/generate",
            "/flush_cache",
            "/pause",
            "/sleep",
            "/reset_prefix_cache",
            "/collective_rpc",
            "/v1/load_lora_adapter",
            "/v1/chat/completions/",
            "/v1/responses/",
            "/v1/responses//cancel",
            "/v1/responses/r/other",
            "/v1/responses/r/cancel/x",
            "/v1/models/m",
        ] {
            assert!(!forwarded_by_default(no), "{no}");
        }
    }
}
