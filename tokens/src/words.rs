//! A text's ids as the sum of its pre-tokenizer splits' ids, each split tokenized once.
//!
//! Where the pre-tokenizer is one regex split and then the byte mapping ([`FastPre::words`]),
//! and the model is a BPE without dropout, `tokenizers` tokenizes every split on its own: the
//! ids of a text are its added tokens' ids and, between them, the ids of each split of the
//! normalized text, in order. A conversation's text is mostly words seen before, so the ids
//! of each split are kept (bounded), and a text costs the added-token pass, the normalizer,
//! the split regex and a lookup per split, not the pipeline's per-byte alignments and
//! per-token strings. The added tokens and the normalizer are still `tokenizers`' own.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::tokenizer::pattern::Pattern;
use tokenizers::{
    Model, ModelWrapper, NormalizerWrapper, OffsetReferential, OffsetType, PreTokenizedString,
    PreTokenizer,
};

use crate::pretok::FastPre;
use crate::{Error, FastTokenizer};

/// Splits kept before the map is emptied and starts again: at most 64K of at most
/// [`WORD_BYTES`] bytes each, so at most about 24 MB (a few MB in use: a split is mostly a word
/// or a run of spaces, with its few ids).
pub const WORDS_KEPT: usize = 1 << 16;

/// Longer splits (a run of letters or punctuation in a blob) are tokenized each time.
pub const WORD_BYTES: usize = 64;

/// The kept splits, and how to tokenize one that is not kept.
///
/// Texts of one model are tokenized on several threads at once: lookups share a read lock,
/// which a text holds only between its misses; the splits it tokenized are kept under the
/// write lock once it is done. The map is a cache: a panic that poisoned the lock leaves it
/// usable.
pub struct Words {
    memo: RwLock<HashMap<Box<str>, Box<[u32]>>>,
    limit: usize,
}

/// A text's ids, and where its added tokens end.
pub struct Ids {
    pub ids: Vec<u32>,
    /// The end (a byte offset in the text) of each added token in it, with the number of ids
    /// up to and including it, in order.
    pub added: Vec<(u32, usize, usize)>,
}

impl Words {
    /// Split ids can be kept for this tokenizer: its pre-tokenizer splits once by a regex and
    /// then maps bytes, and its model is a BPE that tokenizes the same word the same way.
    pub fn for_tokenizer(t: &FastTokenizer) -> Option<Self> {
        t.get_pre_tokenizer()?.words()?;
        match t.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none() => Some(Self {
                memo: RwLock::new(HashMap::new()),
                limit: WORDS_KEPT,
            }),
            _ => None,
        }
    }

    /// The ids of `text` without added special tokens: what `t.encode(text, false)` gives.
    pub fn ids(&self, t: &FastTokenizer, text: &str) -> Result<Ids, Error> {
        let pre: &FastPre = t
            .get_pre_tokenizer()
            .ok_or_else(|| Error::Encode("no pre-tokenizer".into()))?;
        let (split, bytes) = pre
            .words()
            .ok_or_else(|| Error::Encode("not a split-then-bytes pre-tokenizer".into()))?;
        let pieces = t
            .get_added_vocabulary()
            .extract_and_normalize::<NormalizerWrapper>(t.get_normalizer(), text);
        let mut out = Ids {
            ids: Vec::with_capacity(text.len() / 3),
            added: Vec::new(),
        };
        // Splits this text tokenized (at most `limit`), kept once it is done (a repeat within
        // it is a hit).
        let mut fresh: HashMap<&str, Vec<u32>> = HashMap::new();
        let mut memo = self.memo.read().unwrap_or_else(PoisonError::into_inner);
        for (piece, offsets, tokens) in
            pieces.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            if let Some(tokens) = tokens {
                for tok in tokens {
                    out.ids.push(tok.id);
                }
                if let [tok] = tokens.as_slice() {
                    out.added.push((tok.id, offsets.1, out.ids.len()));
                }
                continue;
            }
            let splits = split
                .find_matches(piece)
                .map_err(|e| Error::Encode(e.to_string()))?;
            for ((a, b), _) in splits {
                let word = &piece[a..b];
                if word.is_empty() {
                    continue;
                }
                if let Some(ids) = memo.get(word) {
                    out.ids.extend_from_slice(ids);
                    continue;
                }
                if let Some(ids) = fresh.get(word) {
                    out.ids.extend_from_slice(ids);
                    continue;
                }
                // A split not kept is tokenized without the lock held.
                drop(memo);
                let ids = word_ids(t.get_model(), bytes, word)?;
                out.ids.extend_from_slice(&ids);
                if word.len() <= WORD_BYTES && fresh.len() < self.limit {
                    fresh.insert(word, ids);
                }
                memo = self.memo.read().unwrap_or_else(PoisonError::into_inner);
            }
        }
        drop(memo);
        if !fresh.is_empty() {
            // At most `limit` of them (the map's own bound), boxed before the lock is taken.
            let fresh: Vec<(Box<str>, Box<[u32]>)> = fresh
                .into_iter()
                .map(|(w, ids)| (w.into(), ids.into()))
                .collect();
            let mut memo = self.memo.write().unwrap_or_else(PoisonError::into_inner);
            if memo.len() + fresh.len() > self.limit {
                memo.clear();
            }
            memo.extend(fresh);
        }
        Ok(out)
    }
}

/// One split's ids: its bytes mapped, then the model.
fn word_ids(model: &ModelWrapper, bytes: &ByteLevel, word: &str) -> Result<Vec<u32>, Error> {
    let err = |e: tokenizers::Error| Error::Encode(e.to_string());
    let mut p = PreTokenizedString::from(word);
    bytes.pre_tokenize(&mut p).map_err(err)?;
    p.tokenize(|n| model.tokenize(n.get())).map_err(err)?;
    Ok(p.get_splits(OffsetReferential::Original, OffsetType::None)
        .into_iter()
        .flat_map(|(_, _, tokens)| tokens.iter().flatten().map(|t| t.id))
        .collect())
}

#[cfg(test)]
mod tests {
    use crate::{fixture, ModelTokens};

    #[test]
    fn a_full_map_starts_again_and_long_splits_are_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        fixture::write_dir(dir.path(), fixture::CHATML_TOOLS).unwrap();
        let mut m = ModelTokens::from_dir(dir.path()).unwrap();
        m.words.as_mut().expect("a byte-level BPE").limit = 3;
        let long = "x".repeat(super::WORD_BYTES + 1);
        let text = format!(
            "<|im_start|>user\nthe replica cache prefix weather Paris 42, {long} and of a<|im_end|>\n"
        );
        let want = m.tokenizer().encode(text.as_str(), false).unwrap();
        for _ in 0..3 {
            assert_eq!(m.text_ids(&text).unwrap(), want.get_ids());
            let memo = m.words.as_ref().unwrap().memo.read().unwrap();
            assert!(memo.len() <= 3, "{}", memo.len());
            assert!(!memo.keys().any(|k| k.len() > super::WORD_BYTES));
        }
    }

    #[test]
    fn texts_tokenized_on_several_threads_at_once_get_their_own_ids() {
        let dir = tempfile::tempdir().unwrap();
        fixture::write_dir(dir.path(), fixture::CHATML_TOOLS).unwrap();
        let mut m = ModelTokens::from_dir(dir.path()).unwrap();
        // A small map, emptied while other threads read it.
        m.words.as_mut().expect("a byte-level BPE").limit = 16;
        let texts: Vec<String> = (0..8)
            .map(|i| {
                let words = "cache prefix replica weather ".repeat(i * 20);
                format!("<|im_start|>user\nturn {i}: {words} Paris {i}{i}<|im_end|>\n")
            })
            .collect();
        let want: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| {
                m.tokenizer()
                    .encode(t.as_str(), false)
                    .unwrap()
                    .get_ids()
                    .to_vec()
            })
            .collect();
        std::thread::scope(|s| {
            for k in 0..4 {
                let (m, texts, want) = (&m, &texts, &want);
                s.spawn(move || {
                    for round in 0..10 {
                        for i in 0..texts.len() {
                            let i = (i + k + round) % texts.len();
                            assert_eq!(m.text_ids(&texts[i]).unwrap(), want[i], "text {i}");
                        }
                    }
                });
            }
        });
    }
}
