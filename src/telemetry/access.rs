//! The access log: one line per request, `key=value` or JSON (conf `access_log`).
//!
//! Headers are never logged, so keys in `Authorization` cannot leak through it.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Kv,
    Json,
    Off,
}

#[derive(Debug, Serialize)]
pub struct Record<'a> {
    pub request_id: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub model: Option<&'a str>,
    pub route: &'a str,
    pub replica: &'a str,
    pub attempts: u32,
    pub failovers: u32,
    pub status: u16,
    pub ttfb_ms: Option<f64>,
    pub duration_ms: f64,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Overload protection: `-` (went on at once), `queued`, or why it was refused.
    pub overload: Option<&'a str>,
    pub queue_ms: Option<f64>,
}

/// A value as one token of a key=value line: quoted when it holds spaces, quotes or `=`.
fn kv_value(v: &str) -> String {
    if v.is_empty() || v.contains([' ', '"', '=', '\n']) {
        format!("{v:?}")
    } else {
        v.to_owned()
    }
}

impl Record<'_> {
    pub fn render(&self, format: Format) -> Option<String> {
        match format {
            Format::Off => None,
            Format::Json => serde_json::to_string(self).ok(),
            Format::Kv => {
                let opt = |v: Option<u64>| v.map_or("-".to_owned(), |n| n.to_string());
                Some(format!(
                    "request_id={} method={} path={} model={} route={} replica={} attempts={} failovers={} status={} ttfb_ms={} duration_ms={:.1} prompt_tokens={} cached_tokens={}{}",
                    kv_value(self.request_id),
                    self.method,
                    kv_value(self.path),
                    kv_value(self.model.unwrap_or("-")),
                    self.route,
                    kv_value(self.replica),
                    self.attempts,
                    self.failovers,
                    self.status,
                    self.ttfb_ms.map_or("-".to_owned(), |t| format!("{t:.1}")),
                    self.duration_ms,
                    opt(self.prompt_tokens),
                    opt(self.cached_tokens),
                    self.overload.map_or(String::new(), |o| format!(
                        " overload={o} queue_ms={}",
                        self.queue_ms.map_or("-".to_owned(), |t| format!("{t:.1}"))
                    )),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record<'static> {
        Record {
            request_id: "abc",
            method: "POST",
            path: "/v1/chat/completions",
            model: Some("my model"),
            route: "pinned",
            replica: "gpu0",
            attempts: 2,
            failovers: 1,
            status: 200,
            ttfb_ms: Some(12.34),
            duration_ms: 56.78,
            prompt_tokens: Some(900),
            cached_tokens: None,
            overload: None,
            queue_ms: None,
        }
    }

    #[test]
    fn kv_lines_are_stable_and_quote_what_needs_it() {
        assert_eq!(
            record().render(Format::Kv).expect("test fixture"),
            "request_id=abc method=POST path=/v1/chat/completions model=\"my model\" route=pinned replica=gpu0 attempts=2 failovers=1 status=200 ttfb_ms=12.3 duration_ms=56.8 prompt_tokens=900 cached_tokens=-"
        );
    }

    #[test]
    fn json_lines_parse() {
        let v: serde_json::Value =
            serde_json::from_str(&record().render(Format::Json).expect("test fixture"))
                .expect("test fixture");
        assert_eq!(v["replica"], "gpu0");
        assert_eq!(v["cached_tokens"], serde_json::Value::Null);
        let queued = Record {
            overload: Some("queued"),
            queue_ms: Some(250.0),
            ..record()
        };
        let line = queued.render(Format::Kv).expect("kv");
        assert!(line.ends_with(" overload=queued queue_ms=250.0"), "{line}");
        assert_eq!(record().render(Format::Off), None);
    }
}
