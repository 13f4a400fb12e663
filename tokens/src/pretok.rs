//! The model's pre-tokenizer with its split regex run by the `regex` crate instead of
//! `fancy-regex`, when that gives the same splits: the GPT-2 and Llama-3/Qwen2 patterns use one
//! look-ahead, `\s+(?!\S)|\s+` as their last two branches, which is a `\s+` that gives back its
//! last character when a non-space follows. Any other pre-tokenizer is run as it is.

use regex::Regex;
use regex_automata::{meta, Anchored, Input};
use serde_json::Value as Json;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::tokenizer::pattern::Pattern;
use tokenizers::{
    Offsets, PreTokenizedString, PreTokenizer, PreTokenizerWrapper, SplitDelimiterBehavior,
};

/// The look-ahead tail of the patterns this handles.
const TAIL: &str = r"|\s+(?!\S)|\s+";

/// A split pattern the `regex` crate runs with the splits `fancy-regex` gives.
#[derive(Debug)]
pub struct FastRegex {
    /// The pattern with `\s+(?!\S)|\s+` as `\s+`. A meta regex, for anchored searches: the
    /// splits of a text mostly follow each other, and a match known to start where the last one
    /// ended needs no reverse scan for its start.
    whole: meta::Regex,
    /// The branches before the tail, anchored: a whitespace match they give is kept whole.
    head: Option<Regex>,
}

impl FastRegex {
    /// The pattern as `regex` runs it, or None where it could split differently.
    pub fn new(pattern: &str) -> Option<Self> {
        let (whole, head) = match pattern.strip_suffix(TAIL) {
            // The head must stand alone, so that the tail's branches are top-level ones.
            Some(head) if !head.is_empty() => (
                format!(r"{head}|\s+"),
                Some(Regex::new(&format!("^(?:{head})")).ok()?),
            ),
            Some(_) => return None,
            None => (pattern.to_owned(), None),
        };
        // An empty match is where `fancy-regex` and `regex` step on differently.
        // Nor are anchors or word boundaries wanted: the head is run on the rest of the text.
        let hir = regex_syntax::Parser::new().parse(&whole).ok()?;
        let props = hir.properties();
        if props.minimum_len().unwrap_or(0) == 0 || !props.look_set().is_empty() {
            return None;
        }
        Some(Self {
            whole: meta::Regex::new(&whole).ok()?,
            head,
        })
    }

    /// The matches in `text`, as `fancy-regex` finds them.
    pub fn find_iter<'t>(&'t self, text: &'t str) -> impl Iterator<Item = (usize, usize)> + 't {
        let mut at = 0;
        std::iter::from_fn(move || {
            // Leftmost-first: a match that starts at `at` is the one an unanchored search finds.
            let from = Input::new(text).span(at..text.len());
            let m = match self.whole.search(&from.clone().anchored(Anchored::Yes)) {
                Some(m) => m,
                None => self.whole.search(&from)?,
            };
            let (start, mut end) = (m.start(), m.end());
            if let Some(head) = &self.head {
                let s = &text[start..end];
                // `\s+(?!\S)`: a run of two or more before a non-space leaves its last one. A
                // match the head does not give is the `\s+` branch's (leftmost-first), so all
                // `\s` (Unicode White_Space, as in `fancy-regex`); its first character is looked
                // at only so that the head is run again on whitespace matches alone.
                if end < text.len()
                    && s.starts_with(char::is_whitespace)
                    && s.chars().nth(1).is_some()
                    && !head.is_match(&text[start..])
                {
                    end -= s.chars().next_back().map_or(0, char::len_utf8);
                }
            }
            at = end;
            Some((start, end))
        })
    }
}

impl Pattern for &FastRegex {
    fn find_matches(&self, inside: &str) -> tokenizers::Result<Vec<(Offsets, bool)>> {
        // As tokenizers' own regex pattern splits.
        if inside.is_empty() {
            return Ok(vec![((0, 0), false)]);
        }
        let mut prev = 0;
        let mut splits = Vec::new();
        for (start, end) in self.find_iter(inside) {
            if prev != start {
                splits.push(((prev, start), false));
            }
            splits.push(((start, end), true));
            prev = end;
        }
        if prev != inside.len() {
            splits.push(((prev, inside.len()), false));
        }
        Ok(splits)
    }
}

#[derive(Debug)]
enum Step {
    /// A pre-tokenizer run as it is.
    Keep(Box<PreTokenizerWrapper>),
    /// `Split` with a regex (not inverted).
    Split(FastRegex, SplitDelimiterBehavior),
    /// `ByteLevel` with its regex: the prefix space, the split, then the byte mapping alone.
    ByteLevel {
        add_prefix_space: bool,
        split: FastRegex,
        bytes: ByteLevel,
    },
}

/// A pre-tokenizer that splits as the model's does.
#[derive(Debug)]
pub struct FastPre {
    steps: Vec<Step>,
}

/// GPT-2's pattern, as `ByteLevel` has it built in.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

impl FastPre {
    /// The faster equivalent of `pre`, or None where no step would be faster.
    pub fn new(pre: &PreTokenizerWrapper) -> Option<Self> {
        let json = serde_json::to_value(pre).ok()?;
        let mut steps = Vec::new();
        let list = match json.get("type").and_then(Json::as_str) {
            Some("Sequence") => json.get("pretokenizers")?.as_array()?.clone(),
            _ => vec![json],
        };
        for j in list {
            steps.push(Self::step(j)?);
        }
        if steps.iter().all(|s| matches!(s, Step::Keep(_))) {
            return None;
        }
        Some(Self { steps })
    }

    fn step(j: Json) -> Option<Step> {
        let kind = j.get("type").and_then(Json::as_str).unwrap_or("");
        if kind == "ByteLevel" && j.get("use_regex").and_then(Json::as_bool) != Some(false) {
            if let Some(split) = FastRegex::new(GPT2) {
                let flag = |k: &str| j.get(k).and_then(Json::as_bool);
                return Some(Step::ByteLevel {
                    add_prefix_space: flag("add_prefix_space")?,
                    split,
                    bytes: ByteLevel::new(false, flag("trim_offsets")?, false),
                });
            }
        }
        if kind == "Split" && j.get("invert").and_then(Json::as_bool) == Some(false) {
            let pattern = match j.get("pattern") {
                Some(p) => p
                    .get("Regex")
                    .and_then(Json::as_str)
                    .map(str::to_owned)
                    .or_else(|| p.get("String").and_then(Json::as_str).map(regex::escape)),
                None => None,
            };
            let behavior: Option<SplitDelimiterBehavior> =
                serde_json::from_value(j.get("behavior")?.clone()).ok();
            if let (Some(re), Some(b)) = (pattern.as_deref().and_then(FastRegex::new), behavior) {
                return Some(Step::Split(re, b));
            }
        }
        serde_json::from_value(j)
            .ok()
            .map(|p| Step::Keep(Box::new(p)))
    }
}

impl FastPre {
    /// The split regex and the byte mapping, where the pre-tokenizer is one regex split
    /// (isolated) and then the byte mapping alone (no prefix space): a text's splits are then
    /// its regex matches and the gaps between them, each mapped and tokenized on its own, so
    /// that a split's ids can be kept (`words.rs`).
    pub fn words(&self) -> Option<(&FastRegex, &ByteLevel)> {
        match self.steps.as_slice() {
            [Step::ByteLevel {
                add_prefix_space: false,
                split,
                bytes,
            }] => Some((split, bytes)),
            [Step::Split(split, SplitDelimiterBehavior::Isolated), Step::Keep(bytes)] => {
                match bytes.as_ref() {
                    PreTokenizerWrapper::ByteLevel(b) if !b.add_prefix_space && !b.use_regex => {
                        Some((split, b))
                    }
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

impl PreTokenizer for FastPre {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        for step in &self.steps {
            match step {
                Step::Keep(p) => p.pre_tokenize(pretokenized)?,
                Step::Split(re, behavior) => {
                    pretokenized.split(|_, normalized| normalized.split(re, *behavior))?
                }
                Step::ByteLevel {
                    add_prefix_space,
                    split,
                    bytes,
                } => {
                    pretokenized.split(|_, mut normalized| {
                        if *add_prefix_space && !normalized.get().starts_with(' ') {
                            normalized.prepend(" ");
                        }
                        normalized.split(split, SplitDelimiterBehavior::Isolated)
                    })?;
                    bytes.pre_tokenize(pretokenized)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Characters where the patterns' classes and `\s` could part: every Unicode White_Space,
    /// near-spaces that are not (U+180E, U+200B, U+FEFF), combining marks, non-ASCII digits,
    /// emoji (with a joiner and a variation selector), and the pattern's own punctuation.
    const EDGES: &[char] = &[
        ' ',
        '\t',
        '\n',
        '\r',
        '\x0b',
        '\x0c',
        '\u{85}',
        '\u{a0}',
        '\u{1680}',
        '\u{2000}',
        '\u{2001}',
        '\u{2002}',
        '\u{2003}',
        '\u{2004}',
        '\u{2005}',
        '\u{2006}',
        '\u{2007}',
        '\u{2008}',
        '\u{2009}',
        '\u{200a}',
        '\u{2028}',
        '\u{2029}',
        '\u{202f}',
        '\u{205f}',
        '\u{3000}',
        '\u{180e}',
        '\u{200b}',
        '\u{feff}',
        '\u{301}',
        '\u{308}',
        '\u{93f}',
        '\u{660}',
        '\u{967}',
        '\u{ff11}',
        '\u{2167}',
        '\u{1f600}',
        '\u{1f44d}',
        '\u{1f3fd}',
        '\u{200d}',
        '\u{fe0f}',
        'a',
        'Z',
        'e',
        '\u{e9}',
        '\u{6f22}',
        '1',
        '9',
        '\'',
        's',
        'L',
        '!',
        '.',
        '{',
        '"',
    ];

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]
        #[test]
        fn splits_as_fancy_regex_does_on_any_mix(
            which in 0..3usize,
            picks in proptest::collection::vec(0..EDGES.len(), 0..24),
        ) {
            let text: String = picks.into_iter().map(|i| EDGES[i]).collect();
            same_as_fancy([GPT2, LLAMA3, QWEN2][which], &text);
        }
    }

    fn same_as_fancy(pattern: &str, text: &str) {
        let fancy = fancy_regex::Regex::new(pattern).unwrap();
        let want: Vec<(usize, usize)> = fancy
            .find_iter(text)
            .map(|m| {
                let m = m.unwrap();
                (m.start(), m.end())
            })
            .collect();
        let fast = FastRegex::new(pattern).unwrap();
        let got: Vec<(usize, usize)> = fast.find_iter(text).collect();
        assert_eq!(got, want, "{pattern:?} on {text:?}");
    }

    #[test]
    fn splits_as_fancy_regex_does() {
        let texts = [
            "",
            " ",
            "  ",
            "a  b",
            "a \n\n b",
            "  \n\n  x",
            "x\t\t\ty   ",
            "\u{3000}\u{3000}漢字 é  \r\n\r\n  end",
            "it's  I'LL 12345  6 !!  ?? \n",
            "    def f():\n        return 1\n",
            "a \u{a0}\u{a0}b",
            "e\u{301}\u{301} \u{308}x  \u{93f}",
            "\u{660}\u{661}\u{662}\u{663} \u{967}\u{968} \u{ff11}\u{ff12}",
            "a\u{85}\u{85}b \u{1680}\u{1680}c\u{2000}\u{200a}d\u{2028}\u{2028}e\u{202f} \u{202f}f",
            "a\x0b\x0b b\x0c\x0c\nc",
            "\u{1f600}\u{1f600} \u{1f44d}\u{1f3fd}  \u{1f469}\u{200d}\u{1f4bb}\u{fe0f}",
            "end   ",
            "end \n\n\t ",
            "\u{2003}\u{2003}\u{2003}",
        ];
        for p in [GPT2, LLAMA3, QWEN2] {
            for t in texts {
                same_as_fancy(p, t);
            }
        }
    }

    #[test]
    fn patterns_it_cannot_run_the_same_are_refused() {
        assert!(FastRegex::new(r"\s+(?!\S)|\s+").is_none(), "no head");
        assert!(
            FastRegex::new(r"(a|\s+(?!\S)|\s+)").is_none(),
            "not top-level"
        );
        assert!(FastRegex::new(r"a*").is_none(), "empty matches");
        assert!(
            FastRegex::new(r"(?=a)b|\s+").is_none(),
            "other look-arounds"
        );
        assert!(FastRegex::new(r"\bx|\s+").is_none(), "word boundaries");
        assert!(FastRegex::new(r"\w+|\s+").is_some());
    }

    fn pre(json: serde_json::Value) -> PreTokenizerWrapper {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn unsupported_pre_tokenizers_keep_the_standard_one() {
        let split = |pattern: &str| serde_json::json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
        for p in [
            split(r"\s+(?!\S)|\s+"),
            split(r"\bx|\s+"),
            split(r"(?=a)b|\s+"),
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                split(r"a*"),
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ]}),
            serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true}),
            serde_json::json!({"type": "Whitespace"}),
        ] {
            assert!(FastPre::new(&pre(p.clone())).is_none(), "{p}");
        }
        assert!(FastPre::new(&pre(split(QWEN2))).is_some());
        assert!(FastPre::new(&pre(
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})
        ))
        .is_some());
    }
}
