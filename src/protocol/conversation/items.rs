//! `GET /v1/responses/{id}/input_items`: an exchange's input items, paged as OpenAI pages them.

use std::borrow::Cow;

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{elements, Exchange};
use crate::protocol::members::Members;

/// `GET /v1/responses/{id}/input_items`' query: OpenAI's paging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub after: Option<String>,
    pub before: Option<String>,
    pub limit: usize,
    /// Oldest first; OpenAI's default is newest first.
    pub ascending: bool,
}

/// Reads the paging query, or why not (`limit` 1 to 100, `order` asc or desc).
pub fn page(query: Option<&str>) -> Result<Page, String> {
    let mut page = Page {
        after: None,
        before: None,
        limit: 20,
        ascending: false,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "after" => page.after = Some(v.to_owned()).filter(|v| !v.is_empty()),
            "before" => page.before = Some(v.to_owned()).filter(|v| !v.is_empty()),
            "limit" => {
                page.limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| format!("limit: `{v}` is not an integer from 1 to 100"))?
            }
            "order" => {
                page.ascending = match v {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(format!("order: `{v}` is not `asc` or `desc`")),
                }
            }
            // `include[]` and the like change what an item shows, not which: ignored.
            _ => {}
        }
    }
    Ok(page)
}

/// One page of an exchange's input items, in OpenAI's list shape. An item sent without an
/// `id` is given one made from the response's id and its place, the same on every call.
pub fn input_items(e: &Exchange, page: &Page) -> Bytes {
    let mut items: Vec<(String, Cow<'_, RawValue>)> = elements(&e.input)
        .into_iter()
        .enumerate()
        .map(|(i, item)| with_id(&e.id, i, item))
        .collect();
    if !page.ascending {
        items.reverse();
    }
    let start = match &page.after {
        Some(after) => items
            .iter()
            .position(|(id, _)| id == after)
            .map_or(items.len(), |p| p + 1),
        None => 0,
    };
    let (start, end, has_more) = match &page.before {
        // The page just before that item, in the same order: more lie before it.
        Some(before) => {
            let until = items
                .iter()
                .position(|(id, _)| id == before)
                .unwrap_or(start)
                .max(start);
            let from = until.saturating_sub(page.limit).max(start);
            (from, until, from > start)
        }
        None => {
            let end = (start + page.limit).min(items.len());
            (start, end, end < items.len())
        }
    };
    let shown = &items[start..end];
    let mut out = String::from(r#"{"object":"list","data":["#);
    for (i, (_, item)) in shown.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item.get());
    }
    let id = |x: Option<&(String, Cow<RawValue>)>| {
        x.map_or("null".to_owned(), |(id, _)| {
            serde_json::to_string(id).expect("a string serialises")
        })
    };
    out.push_str(&format!(
        r#"],"first_id":{},"last_id":{},"has_more":{}}}"#,
        id(shown.first()),
        id(shown.last()),
        has_more
    ));
    Bytes::from(out)
}

fn with_id<'a>(response: &str, i: usize, item: &'a RawValue) -> (String, Cow<'a, RawValue>) {
    let Ok(mut m) = Members::parse(item.get().as_bytes()) else {
        return (format!("item_{i}"), Cow::Borrowed(item));
    };
    // A message's text content, as OpenAI lists it: a list of parts.
    let text: Option<String> = m
        .get("content")
        .and_then(|c| serde_json::from_str::<String>(c.get()).ok());
    let given = m
        .get("id")
        .and_then(|id| serde_json::from_str::<String>(id.get()).ok());
    if let Some(text) = &text {
        let role: Option<String> = m
            .get("role")
            .and_then(|r| serde_json::from_str(r.get()).ok());
        let kind = if role.as_deref() == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        let parts = serde_json::json!([{"type": kind, "text": text}]);
        m.set("content", &parts.to_string());
        if !m.has("type") {
            m.set("type", "\"message\"");
        }
    }
    if let (Some(id), None) = (&given, &text) {
        return (id.clone(), Cow::Borrowed(item));
    }
    let id = given.unwrap_or_else(|| {
        let h = xxhash_rust::xxh3::xxh3_64(response.as_bytes());
        format!("msg_{h:016x}{i:04x}")
    });
    m.set(
        "id",
        &serde_json::to_string(&id).expect("a string serialises"),
    );
    let text = String::from_utf8(m.bytes().to_vec()).expect("JSON is UTF-8");
    (id, Cow::Owned(RawValue::from_string(text).expect("JSON")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn value(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("JSON")
    }

    fn exchange(id: &str, input: Value) -> Exchange {
        Exchange {
            id: id.into(),
            scope: 7,
            ancestors: vec![],
            input: serde_json::value::to_raw_value(&input).expect("JSON"),
            response: RawValue::from_string("{}".into()).expect("JSON"),
            stored_at: 1,
        }
    }

    #[test]
    fn input_items_are_paged_as_openai_does() {
        let e = exchange(
            "resp_1",
            json!([
                {"type":"message","role":"user","content":"a"},
                {"type":"function_call_output","call_id":"c","output":"b","id":"fco_1"},
                {"type":"message","role":"user","content":"c"}
            ]),
        );
        let list = |q: &str| value(&input_items(&e, &page(Some(q)).expect("query")));
        let all = list("order=asc");
        assert_eq!(all["object"], json!("list"));
        assert_eq!(all["data"].as_array().map(Vec::len), Some(3));
        assert_eq!(all["data"][1]["id"], json!("fco_1"));
        assert_eq!(all["has_more"], json!(false));
        let first = all["first_id"].as_str().expect("an id").to_owned();
        assert_eq!(list("order=asc")["first_id"], json!(first), "stable ids");
        let desc = list("limit=2");
        assert_eq!(
            desc["data"][0]["content"],
            json!([{"type": "input_text", "text": "c"}]),
            "newest first, its text as OpenAI lists it"
        );
        assert_eq!(desc["has_more"], json!(true));
        let next = list(&format!(
            "limit=2&after={}",
            desc["last_id"].as_str().expect("id")
        ));
        assert_eq!(next["data"].as_array().map(Vec::len), Some(1));
        assert_eq!(next["last_id"], json!(first));
        assert_eq!(next["has_more"], json!(false));
        let back = list(&format!(
            "limit=1&before={}",
            next["last_id"].as_str().expect("id")
        ));
        assert_eq!(back["data"][0]["id"], desc["last_id"], "the page before");
        assert_eq!(back["has_more"], json!(true), "the newest lies before it");
        let first_page = list(&format!(
            "limit=5&before={}",
            desc["last_id"].as_str().expect("id")
        ));
        assert_eq!(
            first_page["has_more"],
            json!(false),
            "nothing before the newest"
        );
        assert_eq!(list("before=unknown")["has_more"], json!(false));
        let none = list("after=unknown");
        assert_eq!(none["data"], json!([]));
        assert_eq!(none["first_id"], Value::Null);
        assert!(page(Some("limit=0")).is_err() && page(Some("order=up")).is_err());
    }
}
