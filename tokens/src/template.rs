//! A Hugging Face chat template in minijinja, set up as transformers sets up Jinja: trimmed
//! blocks, Python's string and dict methods, `raise_exception`, and Python's `json.dumps` as
//! `tojson`.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use std::fmt::Write;

/// How the template reads `message.content`: as a string, or as a list of parts it loops over
/// (vLLM's `--chat-template-content-format auto` decides the same way, once per template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

/// vLLM walks the template's syntax tree for a `for` loop over a message's `content`; this looks
/// for the same loop in the source text.
pub fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(at) = rest.find("for ") {
        rest = &rest[at + 4..];
        let head: String = rest
            .chars()
            .take_while(|c| *c != '%' && *c != '}')
            .collect();
        if let Some((_, iter)) = head.split_once(" in ") {
            let iter = iter.trim().trim_end_matches(['-', '+']).trim_end();
            if iter.ends_with("content")
                || iter.ends_with("['content']")
                || iter.ends_with("[\"content\"]")
            {
                return ContentFormat::OpenAi;
            }
        }
    }
    ContentFormat::String
}

pub const NAME: &str = "chat";

pub fn environment(source: String) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_filter("tojson", tojson);
    env.add_template_owned(NAME, source)?;
    Ok(env)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=…, separators=…,
/// sort_keys=…)`, so `{"a": 1, "b": [2, 3]}` with Python's spaces, not minijinja's HTML-safe
/// compact form.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        Some(v) if v.kind() == ValueKind::Number => Some(" ".repeat(i64::try_from(v)? as usize)),
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        _ => None,
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let style = Style {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dump(&value, &style, 0, &mut out)?;
    Ok(out)
}

struct Style {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn newline(style: &Style, depth: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn dump(v: &Value, style: &Style, depth: usize, out: &mut String) -> Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            // Integers as they are; floats as Python's repr writes them in the common cases.
            if v.is_integer() {
                let _ = write!(out, "{}", i128::try_from(v.clone())?);
                return Ok(());
            }
            let f = f64::try_from(v.clone())?;
            if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
                let _ = write!(out, "{f:.1}");
            } else {
                out.push_str(&serde_json::to_string(&f).unwrap_or_else(|_| "NaN".into()));
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or("")).expect("a string"))
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(style, depth + 1, out);
                dump(item, style, depth + 1, out)?;
            }
            newline(style, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(style, depth + 1, out);
                let name = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&name).expect("a string"));
                out.push_str(&style.key);
                dump(&v.get_item(k)?, style, depth + 1, out)?;
            }
            newline(style, depth, out);
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&v.to_string()).expect("a string")),
    }
    Ok(())
}

/// Whether the template only ever writes a message's `content` out as it is: each read of a
/// `content` attribute or item goes, through `+` and `~` only, to the output, or is tested for
/// truth or with `is string`/`defined`/`none`. Such a template renders the same text with each
/// non-empty content swapped for a placeholder and the content put back in its place after. Any
/// other read (a filter, a method, a comparison, `in`, a slice, stored in a variable, captured
/// in a macro or a `set` block) answers no, and so does any instruction the scan does not know,
/// a constant that names `content` other than as an item key (`map(attribute='content')`, a
/// list of keys), an item looked up by a computed key whose value is not only read an attribute
/// of, and anything that changes how output is written (`autoescape`). Reads of the whole
/// message (`tojson`, `items()`, `get(key)`) are not seen here; the placeholder render watches
/// for those itself. The instructions are minijinja's own (`unstable_machinery`), which is why
/// minijinja is pinned at one version.
pub fn content_is_text_only(env: &Environment<'_>) -> bool {
    let Ok(tmpl) = env.get_template(NAME) else {
        return false;
    };
    let compiled = minijinja::machinery::get_compiled_template(&tmpl);
    if !compiled.blocks.is_empty() {
        return false;
    }
    let ins = &compiled.instructions;
    let targets = jump_targets(ins);
    let mut i = 0;
    while ins.get(i).is_some() {
        if !reads_content_as_text(ins, i, &targets) {
            return false;
        }
        i += 1;
    }
    true
}

/// Where jumps land: an instruction there can be reached other than from the one before it.
fn jump_targets(ins: &minijinja::machinery::Instructions<'_>) -> std::collections::HashSet<u32> {
    use minijinja::machinery::Instruction as I;
    let mut out = std::collections::HashSet::new();
    let mut i = 0;
    while let Some(op) = ins.get(i) {
        if let I::Jump(t)
        | I::JumpIfFalse(t)
        | I::JumpIfFalseOrPop(t)
        | I::JumpIfTrueOrPop(t)
        | I::Iterate(t) = op
        {
            out.insert(*t);
        }
        i += 1;
    }
    out
}

/// Whether instruction `i` keeps contents text only: a read of `content` written as it is, or
/// an instruction known not to read contents otherwise nor change how output is written.
fn reads_content_as_text(
    ins: &minijinja::machinery::Instructions<'_>,
    i: u32,
    targets: &std::collections::HashSet<u32>,
) -> bool {
    use minijinja::machinery::Instruction as I;
    // The next instruction runs only after this one (no jump lands on it).
    let then =
        |want: fn(&I<'_>) -> bool| !targets.contains(&(i + 1)) && ins.get(i + 1).is_some_and(want);
    let Some(op) = ins.get(i) else {
        return false;
    };
    match op {
        I::GetAttr("content") => written_as_is(ins, i + 1),
        // `x['content']`, and the same folded from `'con' ~ 'tent'`.
        I::LoadConst(v) if v.as_str() == Some("content") && then(|n| matches!(n, I::GetItem)) => {
            written_as_is(ins, i + 2)
        }
        // A constant key, of another field.
        I::LoadConst(v) if v.as_str().is_some() && then(|n| matches!(n, I::GetItem)) => true,
        // Text that holds the word, written out (a system prompt's "content").
        I::LoadConst(v) if v.as_str().is_some() && names_content(v) => written_as_is(ins, i + 1),
        // Folded kwargs (`attribute='content'`), lists and maps of keys.
        I::LoadConst(v) => !names_content(v),
        // A computed key could be `content`: only an attribute of what it gives may be read
        // (a string has none, so a content and its placeholder give the same).
        I::GetItem => {
            let constant_key =
                !targets.contains(&i) && i > 0 && matches!(ins.get(i - 1), Some(I::LoadConst(_)));
            constant_key || then(|n| matches!(n, I::GetAttr(_)))
        }
        I::EmitRaw(_)
        | I::StoreLocal(_)
        | I::Lookup(_)
        | I::GetAttr(_)
        | I::SetAttr(_)
        | I::Slice
        | I::BuildMap(_)
        | I::BuildKwargs(_)
        | I::MergeKwargs(_)
        | I::BuildList(_)
        | I::BuildTuple(_)
        | I::UnpackList(_)
        | I::UnpackLists(_)
        | I::Add
        | I::Sub
        | I::Mul
        | I::Div
        | I::IntDiv
        | I::Rem
        | I::Pow
        | I::Neg
        | I::Eq
        | I::Ne
        | I::Gt
        | I::Gte
        | I::Lt
        | I::Lte
        | I::Not
        | I::StringConcat
        | I::In
        | I::CompareAndPreserve(_)
        | I::ApplyFilter(..)
        | I::PerformTest(..)
        | I::Emit
        | I::PushLoop(_)
        | I::PushWith
        | I::Iterate(_)
        | I::PushDidNotIterate
        | I::PopFrame
        | I::PopLoopFrame
        | I::Jump(_)
        | I::JumpIfFalse(_)
        | I::JumpIfFalseOrPop(_)
        | I::JumpIfTrueOrPop(_)
        | I::CallFunction(..)
        | I::CallMethod(..)
        | I::CallObject(_)
        | I::DupTop
        | I::DiscardTop
        | I::Swap => true,
        // Autoescape, captures (`filter`, `set` blocks, macros, `call`), recursion, includes
        // and blocks, and whatever a later minijinja adds.
        _ => false,
    }
}

/// Whether a constant holds the string `content` anywhere: as a string, or in a list, tuple,
/// map (key or value) or kwargs.
fn names_content(v: &Value) -> bool {
    if let Some(s) = v.as_str() {
        return s.contains("content");
    }
    let Ok(mut items) = v.try_iter() else {
        return false;
    };
    let map = v.kind() == ValueKind::Map;
    items.any(|item| {
        names_content(&item) || (map && v.get_item(&item).is_ok_and(|x| names_content(&x)))
    })
}

/// Follows the value on top of the stack at `at` (a content) through straight-line code.
fn written_as_is(ins: &minijinja::machinery::Instructions<'_>, mut at: u32) -> bool {
    use minijinja::machinery::Instruction as I;
    // How many values sit above the content on the stack.
    let mut above = 0usize;
    while let Some(op) = ins.get(at) {
        match op {
            I::LoadConst(_) | I::Lookup(_) => above += 1,
            I::GetAttr(_) if above > 0 => {}
            I::GetItem if above > 1 => above -= 1,
            // A concatenation with the content in it is still the content, written as it is.
            I::Add | I::StringConcat => above = above.saturating_sub(1),
            I::Emit | I::JumpIfFalse(_) | I::Not if above == 0 => return true,
            I::PerformTest(name, _, _)
                if above == 0 && matches!(*name, "string" | "defined" | "undefined" | "none") =>
            {
                return true
            }
            _ => return false,
        }
        at += 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let env = environment(template.to_owned()).unwrap();
        env.get_template(NAME).unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_writes_python_json_dumps() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, 3.0], "a": {"x": "é<\n"}, "e": {}, "n": null, "t": true}"#,
        )
        .unwrap();
        let ctx = minijinja::context! { v => v };
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            r#"{"b": [1, 2.5, 3.0], "a": {"x": "é<\n"}, "e": {}, "n": null, "t": true}"#
        );
        assert_eq!(
            render("{{ v.b | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  3.0\n]"
        );
        assert_eq!(
            render(
                "{{ v | tojson(sort_keys=true, separators=(',', ':')) }}",
                ctx
            ),
            r#"{"a":{"x":"é<\n"},"b":[1,2.5,3.0],"e":{},"n":null,"t":true}"#
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let ctx = minijinja::context! { s => "  hi  ", d => minijinja::context!{ k => 1 } };
        assert_eq!(
            render("{{ s.strip() }}|{{ s.startswith('  h') }}", ctx.clone()),
            "hi|True"
        );
        assert_eq!(
            render(
                "{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}",
                ctx.clone()
            ),
            "k=1"
        );
        let env = environment("{{ raise_exception('no system here') }}".into()).unwrap();
        let e = env.get_template(NAME).unwrap().render(ctx).unwrap_err();
        assert!(e.to_string().contains("no system here"), "{e}");
    }

    #[test]
    fn content_written_as_is_or_not() {
        let yes = [
            "{{ messages[0].content }}",
            "{% for m in messages %}{{ '<' + m.role + '>' + m['content'] + '</>' }}{% endfor %}",
            "{% for m in messages %}{% if m.content %}{{ m.content ~ '.' }}{% endif %}{% endfor %}",
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
            "{{ 'Answer with the content only.' }}{{ messages[0].content }}",
            "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}",
            "{{ messages[0]['con' ~ 'tent'] }}",
            // A computed index whose message is only read an attribute of.
            "{% for m in messages %}{% if not loop.first and messages[loop.index0 - 1].role == 'user' %}-{% endif %}{{ m.content }}{% endfor %}",
            "{% for m in messages|selectattr('role', 'equalto', 'user') %}{{ m.content }}{% endfor %}",
            crate::fixture::CHATML_TOOLS,
        ];
        let no = [
            "{{ messages[0].content | trim }}",
            "{{ messages[0].content.strip() }}",
            "{% if '</think>' in messages[0].content %}x{% endif %}",
            "{{ messages[0].content[1:] }}",
            "{% set c = messages[0].content %}{{ c }}",
            "{% if messages[0].content == 'x' %}x{% endif %}",
            "{{ messages[0].get('content') }}",
            "{% filter upper %}{{ messages[0].content }}{% endfilter %}",
            "{% macro m(x) %}{{ x.content }}{% endmacro %}{{ m(messages[0]) | trim }}",
            "{{ (messages[0].content if true else '') | upper }}",
            // `content` folded into constant kwargs or lists.
            "{{ messages|map(attribute='content')|map('trim')|join }}",
            "{{ messages|map(attribute='x.content')|join }}",
            "{% for m in messages|sort(attribute='content') %}{{ m.role }}{% endfor %}",
            "{% for g in messages|groupby(attribute='content') %}{{ g.grouper }}{% endfor %}",
            "{{ messages|unique(attribute='content')|length }}",
            "{% for m in messages %}{% for k in ['role', 'content'] %}{{ m[k]|trim }}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for k, v in {'content': 1}|items %}{{ m[k]|trim }}{% endfor %}{% endfor %}",
            "{% set k = 'content' %}{{ messages[0][k] | trim }}",
            // Computed keys.
            "{% for m in messages %}{{ m[field] | trim }}{% endfor %}",
            "{{ messages[0][field] }}",
            "{{ messages[0][field][0] }}",
            "{{ messages[0][a if b else 'role'] }}",
            // Output written differently.
            "{% autoescape true %}{{ messages[0].content }}{% endautoescape %}",
            "{% autoescape true %}{{ messages[0].role }}{% endautoescape %}",
            "{% set x %}{{ messages[0].role }}{% endset %}{{ messages[0].content }}",
            "{% for m in messages recursive %}{{ m.content }}{{ loop(m.children) }}{% endfor %}",
            crate::fixture::LLAMA3_LIKE,
            crate::fixture::QWEN3_LIKE,
        ];
        for t in yes {
            assert!(content_is_text_only(&environment(t.into()).unwrap()), "{t}");
        }
        for t in no {
            assert!(
                !content_is_text_only(&environment(t.into()).unwrap()),
                "{t}"
            );
        }
    }

    #[test]
    fn content_format_follows_the_template() {
        assert_eq!(
            detect_content_format("{{ message['content'] }}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{%- for c in m.content -%}{% endfor %}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{% for message in messages %}{% endfor %}"),
            ContentFormat::String
        );
    }
}
