//! The client keys ([`KeyList`]): those of the conf, of an environment variable and of a file
//! (read again when it changes, by [`super::secrets`]' reloader), each checked, never quoted in
//! an error, and never printed (Debug says how many and where from).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use arc_swap::ArcSwap;

use super::secrets::{read, watch, Watched};

/// The shortest client key accepted.
pub const MIN_KEY_CHARS: usize = 8;

/// One client key's check; the message names `at` and never quotes the key.
pub fn check_key(key: &str, at: &str) -> Result<(), String> {
    if key.chars().count() < MIN_KEY_CHARS {
        return Err(format!(
            "{at}: each key must be at least {MIN_KEY_CHARS} characters"
        ));
    }
    if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "{at}: a key may not contain spaces or control characters"
        ));
    }
    Ok(())
}

/// The keys of an `api_keys_file`: one a line, alone or after its name (`alice sk-...`); blank
/// lines and `#` comments are ignored. A key keeps its name across a rotation: two lines may
/// give one name (the old key and the new), and what is kept for a name (the balancer's
/// Responses store) is kept for both.
pub fn parse_key_file(text: &str) -> Result<Vec<(Option<String>, String)>, String> {
    let mut keys = vec![];
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("line {}", i + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (name, key) = match fields[..] {
            [key] => (None, key),
            [name, key] => {
                let ok = name.len() <= 64
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
                if !ok {
                    return Err(format!(
                        "{at}: a name is up to 64 letters, digits, `-`, `_` or `.`"
                    ));
                }
                (Some(name.to_owned()), key)
            }
            _ => {
                return Err(format!(
                    "{at}: a line is a key, or a name and a key; a key may not contain spaces"
                ))
            }
        };
        check_key(key, &at)?;
        keys.push((name, key.to_string()));
    }
    Ok(keys)
}

/// The keys of an `api_keys_env` variable: separated by commas or newlines, each trimmed.
pub fn parse_key_env(text: &str) -> Result<Vec<String>, String> {
    let mut keys = vec![];
    for (i, key) in text
        .split([',', '\n'])
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .enumerate()
    {
        check_key(key, &format!("key {}", i + 1))?;
        keys.push(key.to_string());
    }
    Ok(keys)
}

/// The client keys: those of the conf and of the environment, fixed at start, and those of a
/// file, read again when it changes. Read per request, cheaply ([`KeyList::current`]).
pub struct KeyList {
    fixed: Vec<String>,
    file: Option<PathBuf>,
    current: ArcSwap<Vec<String>>,
    /// The names the file gives its keys (key → name).
    names: ArcSwap<HashMap<String, Arc<str>>>,
    loaded: Mutex<Vec<u8>>,
    sources: String,
    /// Some keys are written in the conf.
    in_conf: bool,
}

impl KeyList {
    /// No keys: every request passes.
    pub fn none() -> Arc<KeyList> {
        Arc::new(KeyList {
            fixed: vec![],
            file: None,
            current: ArcSwap::from_pointee(vec![]),
            names: ArcSwap::from_pointee(HashMap::new()),
            loaded: Mutex::new(vec![]),
            sources: String::new(),
            in_conf: false,
        })
    }

    /// The keys of `literal` (the conf), the variable `env` and the file `file`; `key` is the
    /// conf section, for messages. A file or variable named but holding no key is refused: an
    /// empty list would open the API.
    pub fn new(
        literal: &[String],
        env: Option<&str>,
        file: Option<&Path>,
        key: &str,
    ) -> Result<Arc<KeyList>, String> {
        let mut fixed = vec![];
        let mut sources = vec![];
        for (i, k) in literal.iter().enumerate() {
            check_key(k, &format!("{key}.api_keys[{i}]"))?;
            fixed.push(k.clone());
        }
        if !literal.is_empty() {
            sources.push("the conf".to_string());
        }
        if let Some(name) = env {
            let at = format!("{key}.api_keys_env: environment variable {name}");
            let text = std::env::var(name).map_err(|e| format!("{at}: {e}"))?;
            let keys = parse_key_env(&text).map_err(|e| format!("{at}: {e}"))?;
            if keys.is_empty() {
                return Err(format!("{at}: no key in it"));
            }
            fixed.extend(keys);
            sources.push(format!("environment variable {name}"));
        }
        let mut loaded = vec![];
        let mut from_file = vec![];
        if let Some(path) = file {
            let at = format!("{key}.api_keys_file");
            loaded = read(path).map_err(|e| format!("{at}: {e}"))?;
            from_file = file_keys(&loaded, path).map_err(|e| format!("{at}: {e}"))?;
            sources.push(format!("file {}", path.display()));
        }
        let names = names_of(&from_file);
        let from_file: Vec<String> = from_file.into_iter().map(|(_, k)| k).collect();
        let list = Arc::new(KeyList {
            current: ArcSwap::from_pointee([fixed.clone(), from_file].concat()),
            names: ArcSwap::from_pointee(names),
            fixed,
            file: file.map(Path::to_path_buf),
            loaded: Mutex::new(loaded),
            sources: sources.join(", "),
            in_conf: !literal.is_empty(),
        });
        if file.is_some() {
            watch(Arc::downgrade(&list) as Weak<dyn Watched>);
        }
        Ok(list)
    }

    /// The keys accepted now; empty: no key is needed.
    pub fn current(&self) -> arc_swap::Guard<Arc<Vec<String>>> {
        self.current.load()
    }

    pub fn is_empty(&self) -> bool {
        self.current.load().is_empty()
    }

    /// The name `api_keys_file` gives `key` (one of [`KeyList::current`]), if any.
    pub fn name_of(&self, key: &[u8]) -> Option<Arc<str>> {
        let key = std::str::from_utf8(key).ok()?;
        self.names.load().get(key).cloned()
    }

    /// Some keys are written in the conf itself (`api_keys:`).
    pub fn in_conf(&self) -> bool {
        self.in_conf
    }
}

fn names_of(keys: &[(Option<String>, String)]) -> HashMap<String, Arc<str>> {
    keys.iter()
        .filter_map(|(n, k)| Some((k.clone(), Arc::from(n.as_deref()?))))
        .collect()
}

/// The keys of a key file's bytes, with their names; none at all is an error.
fn file_keys(bytes: &[u8], path: &Path) -> Result<Vec<(Option<String>, String)>, String> {
    let text =
        std::str::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8 text", path.display()))?;
    let keys = parse_key_file(text).map_err(|e| format!("{}: {e}", path.display()))?;
    if keys.is_empty() {
        return Err(format!(
            "{}: no key in it (an empty list would let every client in)",
            path.display()
        ));
    }
    Ok(keys)
}

impl std::fmt::Debug for KeyList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KeyList({} keys from {:?})",
            self.current.load().len(),
            self.sources
        )
    }
}

impl Watched for KeyList {
    fn reload(&self) -> Result<bool, String> {
        let Some(path) = &self.file else {
            return Ok(false);
        };
        let bytes = read(path)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if *loaded == bytes {
            return Ok(false);
        }
        let keys = file_keys(&bytes, path)?;
        self.names.store(Arc::new(names_of(&keys)));
        let keys: Vec<String> = keys.into_iter().map(|(_, k)| k).collect();
        self.current
            .store(Arc::new([self.fixed.clone(), keys].concat()));
        *loaded = bytes;
        Ok(true)
    }

    fn name(&self) -> String {
        match &self.file {
            Some(p) => format!("api_keys_file {}", p.display()),
            None => "api keys".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_and_variables_parse_and_never_quote_a_key() {
        let ok: [(&str, &[&str]); 4] = [
            (
                "k1-abcdefgh\n\n  # a comment\nk2-abcdefgh  \n",
                &["k1-abcdefgh", "k2-abcdefgh"],
            ),
            ("", &[]),
            ("# only a comment\n\n", &[]),
            ("\r\nk3-abcdefgh\r\n", &["k3-abcdefgh"]),
        ];
        for (text, want) in ok {
            let keys: Vec<String> = parse_key_file(text)
                .unwrap()
                .into_iter()
                .map(|(_, k)| k)
                .collect();
            assert_eq!(keys, want, "{text:?}");
        }
        assert_eq!(
            parse_key_file("alice k1-abcdefgh\n  bob\tk2-abcdefgh\nk3-abcdefgh\n").unwrap(),
            [
                (Some("alice".to_string()), "k1-abcdefgh".to_string()),
                (Some("bob".to_string()), "k2-abcdefgh".to_string()),
                (None, "k3-abcdefgh".to_string()),
            ]
        );
        for (text, needle) in [
            ("k1-abcdefgh\nshort\n", "line 2"),
            ("has a space-in-it\n", "spaces"),
            ("al/ice k1-abcdefgh\n", "a name"),
            ("alice short\n", "line 1"),
        ] {
            let e = parse_key_file(text).unwrap_err();
            assert!(e.contains(needle), "{e}");
            assert!(!e.contains("short") || needle != "line 2", "{e}");
        }
        assert_eq!(
            parse_key_env("k1-abcdefgh, k2-abcdefgh\nk3-abcdefgh,,").unwrap(),
            ["k1-abcdefgh", "k2-abcdefgh", "k3-abcdefgh"]
        );
        let e = parse_key_env("k1-abcdefgh,tiny").unwrap_err();
        assert!(e.contains("key 2") && !e.contains("tiny"), "{e}");
    }

    #[test]
    fn a_changed_key_file_is_read_again_and_a_bad_one_keeps_the_old_keys() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        std::fs::write(&keys, "client-key-1\n").unwrap();
        let list = KeyList::new(&["conf-key-123".into()], None, Some(&keys), "inferlb").unwrap();
        assert_eq!(**list.current(), ["conf-key-123", "client-key-1"]);
        for bad in ["", "# all commented out\n", "client-key-2\nshort\n"] {
            std::fs::write(&keys, bad).unwrap();
            assert!(list.reload().is_err(), "{bad:?}");
            assert_eq!(
                **list.current(),
                ["conf-key-123", "client-key-1"],
                "{bad:?}"
            );
        }
        std::fs::write(&keys, "client-key-2\n").unwrap();
        assert_eq!(list.reload(), Ok(true));
        assert_eq!(**list.current(), ["conf-key-123", "client-key-2"]);
        let shown = format!("{list:?}");
        assert!(
            !shown.contains("client-key") && !shown.contains("conf-key"),
            "{shown}"
        );
        // An empty file at start is refused too.
        std::fs::write(&keys, "\n").unwrap();
        assert!(KeyList::new(&[], None, Some(&keys), "inferlb").is_err());
    }
}
