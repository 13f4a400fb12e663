//! The link's messages: what one instance tells the others, written and read here (pure, so
//! both ends are tested together).

use std::sync::Arc;

use super::{Change, LoadReport, Message, Table};
use crate::protocol::api::prompt::Link;

/// A message on the link's channels: `sender|kind|...`, the sender being `instance#nonce`;
/// pure, so both ends are tested here.
/// Replica ids are letters, digits, `-`, `_` and `.` (the conf checks it), so `|`, `;`, `=`,
/// `,` and `:` separate fields safely. Load travels in [`encode_load`].
pub fn encode(instance: &str, change: &Change) -> String {
    match change {
        Change::Pin {
            table,
            key,
            replica,
        } => format!("{instance}|pin|{}|{key:016x}|{replica}", table.tag()),
        Change::Drain { replica, draining } => {
            format!("{instance}|drain|{}|{replica}", u8::from(*draining))
        }
        Change::Replica { id, conf } => {
            format!("{instance}|replica|{id}|{}", conf.as_deref().unwrap_or(""))
        }
        Change::Prefilled { replica, links } => {
            let mut m = format!("{instance}|index|{replica}|");
            for (i, l) in links.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                m.push_str(&format!("{sep}{:x}:{}", l.hash, l.bytes));
            }
            m
        }
    }
}

/// Load per replica: `instance|load|gpu0=1,0,0;gpu1=...` (`loadsnap` for a snapshot).
pub fn encode_load(instance: &str, snapshot: bool, replicas: &[(String, LoadReport)]) -> String {
    let kind = if snapshot { "loadsnap" } else { "load" };
    let list: Vec<String> = replicas
        .iter()
        .map(|(r, l)| format!("{r}={},{},{}", l.in_flight, l.waiting, l.queued_tokens))
        .collect();
    format!("{instance}|{kind}|{}", list.join(";"))
}

/// The instance that sent a message, and its process's nonce (empty when there is none).
pub fn sender(sender: &str) -> (&str, &str) {
    sender.split_once('#').unwrap_or((sender, ""))
}

/// The sender and the content of a message, or None for anything else.
pub fn decode(message: &str) -> Option<(&str, Message)> {
    let mut f = message.splitn(3, '|');
    let (instance, kind, rest) = (f.next()?, f.next()?, f.next()?);
    let change = match kind {
        "replica" => {
            let (id, conf) = rest.split_once('|')?;
            if id.is_empty() {
                return None;
            }
            Change::Replica {
                id: id.to_string(),
                conf: (!conf.is_empty()).then(|| conf.to_string()),
            }
        }
        "pin" => {
            let mut f = rest.split('|');
            let change = Change::Pin {
                table: Table::from_tag(f.next()?)?,
                key: u64::from_str_radix(f.next()?, 16).ok()?,
                replica: Arc::from(f.next()?),
            };
            f.next().is_none().then_some(change)?
        }
        "drain" => {
            let (flag, replica) = rest.split_once('|')?;
            if replica.contains('|') {
                return None;
            }
            Change::Drain {
                replica: Arc::from(replica),
                draining: flag == "1",
            }
        }
        "index" => {
            let (replica, list) = rest.split_once('|')?;
            let links = list
                .split(',')
                .filter(|l| !l.is_empty())
                .map(|l| {
                    let (hash, bytes) = l.split_once(':')?;
                    Some(Link {
                        hash: u64::from_str_radix(hash, 16).ok()?,
                        part_end: false,
                        bytes: bytes.parse().ok()?,
                    })
                })
                .collect::<Option<Vec<Link>>>()?;
            Change::Prefilled {
                replica: Arc::from(replica),
                links,
            }
        }
        "load" | "loadsnap" => {
            let replicas = rest
                .split(';')
                .filter(|r| !r.is_empty())
                .map(|r| {
                    let (id, n) = r.split_once('=')?;
                    // Loads are counts: never negative, and bounded so that sums cannot overflow.
                    let mut n = n
                        .split(',')
                        .map(|v| v.parse::<i64>().ok().filter(|v| (0..1 << 48).contains(v)));
                    let load = LoadReport {
                        in_flight: n.next()??,
                        waiting: n.next()??,
                        queued_tokens: n.next()??,
                    };
                    n.next().is_none().then(|| (id.to_string(), load))
                })
                .collect::<Option<Vec<_>>>()?;
            let snapshot = kind == "loadsnap";
            return Some((instance, Message::Load { snapshot, replicas }));
        }
        _ => return None,
    };
    (!instance.is_empty()).then_some((instance, Message::Change(change)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_ignored() {
        let changes = [
            Change::Pin {
                table: Table::Affinity,
                key: 0xdead_beef_0000_0001,
                replica: Arc::from("gpu0"),
            },
            Change::Pin {
                table: Table::Stored,
                key: 7,
                replica: Arc::from("gpu-1.b"),
            },
            Change::Drain {
                replica: Arc::from("gpu1"),
                draining: true,
            },
            Change::Drain {
                replica: Arc::from("gpu1"),
                draining: false,
            },
            Change::Replica {
                id: "gpu2".into(),
                conf: Some(r#"{"id":"gpu2","address":"10.0.0.7:8000","api_key":"a|b"}"#.into()),
            },
            Change::Replica {
                id: "gpu2".into(),
                conf: None,
            },
            Change::Prefilled {
                replica: Arc::from("gpu0"),
                links: vec![
                    Link {
                        hash: u64::MAX,
                        part_end: false,
                        bytes: 1024,
                    },
                    Link {
                        hash: 0,
                        part_end: false,
                        bytes: 1900,
                    },
                ],
            },
            Change::Prefilled {
                replica: Arc::from("gpu0"),
                links: vec![],
            },
        ];
        for c in changes {
            let m = encode("host-1", &c);
            assert_eq!(decode(&m), Some(("host-1", Message::Change(c))), "{m}");
        }
        let load = |in_flight, waiting, queued_tokens| LoadReport {
            in_flight,
            waiting,
            queued_tokens,
        };
        for snapshot in [true, false] {
            for replicas in [
                vec![],
                vec![("gpu0".to_string(), load(1, 1, 4000))],
                vec![
                    ("gpu0".to_string(), load(0, 0, 0)),
                    ("gpu-1.b".to_string(), load(3, 2, 1 << 40)),
                ],
            ] {
                let m = encode_load("host-1", snapshot, &replicas);
                let want = Message::Load { snapshot, replicas };
                assert_eq!(decode(&m), Some(("host-1", want)), "{m}");
            }
        }
        for bad in [
            "",
            "x",
            "a|pin|z|1|r",
            "a|pin|a|zz|r",
            "a|drain|1",
            "a|pin|a|1|r|extra",
            "a|nope|1|2",
            "a|index|gpu0|zz:1",
            "a|index|gpu0|1:",
            "a|load|gpu0=1,2",
            "a|load|gpu0=1,2,3,4",
            "a|loadsnap|gpu0",
            "a|load|gpu0=-1,0,0",
            "a|loadsnap|gpu0=1,1,99999999999999999",
            "|drain|1|gpu0",
        ] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
