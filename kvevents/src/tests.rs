//! Table tests over hand-built msgpack (rmpv values) and bytes that msgspec wrote.

use super::*;

/// A case's name, its input and what it should give (`Err(())`: any error).
type Case<I, O> = (&'static str, I, Result<O, ()>);
/// What [`parse_frames`] gives: topic, sequence, payload.
type Parsed<'a> = (&'a [u8], i64, &'a [u8]);

fn s(v: &str) -> Value {
    Value::from(v)
}

fn arr(v: Vec<Value>) -> Value {
    Value::Array(v)
}

fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn batch_of(events: Vec<Value>) -> Vec<u8> {
    bytes(&arr(vec![Value::F64(1.5), arr(events), Value::from(0)]))
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn stored(
    hashes: Vec<BlockHash>,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    size: u32,
) -> BlockStored {
    BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: size,
        ..BlockStored::default()
    }
}

#[test]
fn events_decode_from_either_layout() {
    let h32 = vec![7u8; 32];
    let cases: Vec<(&str, Value, Option<Event>)> = vec![
        (
            "map BlockStored, required fields only, int hashes",
            map(vec![
                ("type", s("BlockStored")),
                (
                    "block_hashes",
                    arr(vec![Value::from(1u64), Value::from(u64::MAX)]),
                ),
                ("parent_block_hash", Value::Nil),
                ("token_ids", arr(vec![Value::from(5), Value::from(6)])),
                ("block_size", Value::from(1)),
                ("lora_id", Value::Nil),
                ("medium", s("GPU")),
                ("lora_name", Value::Nil),
            ]),
            Some(Event::BlockStored(BlockStored {
                medium: Some(Medium::Gpu),
                ..stored(
                    vec![BlockHash::Int(1), BlockHash::Int(u64::MAX)],
                    None,
                    vec![5, 6],
                    1,
                )
            })),
        ),
        (
            "map BlockStored, byte hashes, every optional field, an unknown key",
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![Value::Binary(h32.clone())])),
                ("parent_block_hash", Value::Binary(vec![9; 32])),
                ("token_ids", arr(vec![Value::from(1), Value::from(2)])),
                ("block_size", Value::from(2)),
                ("lora_id", Value::from(3)),
                ("medium", s("CPU")),
                ("lora_name", s("ad")),
                ("extra_keys", arr(vec![arr(vec![s("ad"), s("salt")])])),
                ("group_idx", Value::from(1)),
                ("kv_cache_spec_kind", s("full_attention")),
                ("kv_cache_spec_sliding_window", Value::from(128)),
                ("locality", s("LOCAL")),
                ("ownership", s("tier2")),
                ("session_id", s("sess")),
                ("lookahead_token_ids", arr(vec![arr(vec![Value::from(3)])])),
                ("a_field_from_the_future", Value::from(true)),
            ]),
            Some(Event::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::Bytes(h32.clone())],
                parent_block_hash: Some(BlockHash::Bytes(vec![9; 32])),
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: Some(3),
                medium: Some(Medium::Cpu),
                lora_name: Some("ad".into()),
                extra_keys: Some(vec![Some(vec![s("ad"), s("salt")])]),
                group_idx: Some(1),
                kv_cache_spec_kind: Some("full_attention".into()),
                kv_cache_spec_sliding_window: Some(128),
                locality: Some("LOCAL".into()),
                ownership: Some("tier2".into()),
                session_id: Some("sess".into()),
                lookahead_token_ids: Some(vec![vec![3]]),
            })),
        ),
        (
            "legacy array BlockStored, short (four fields, the rest default)",
            arr(vec![
                s("BlockStored"),
                arr(vec![Value::from(4)]),
                Value::from(3),
                arr(vec![Value::from(8)]),
                Value::from(1),
            ]),
            Some(Event::BlockStored(stored(
                vec![BlockHash::Int(4)],
                Some(BlockHash::Int(3)),
                vec![8],
                1,
            ))),
        ),
        (
            "legacy array BlockStored with trailing unknown items",
            arr(vec![
                s("BlockStored"),
                arr(vec![Value::from(4)]),
                Value::Nil,
                arr(vec![Value::from(8)]),
                Value::from(1),
                Value::Nil,
                s("STORAGE"),
                Value::Nil,
                Value::Nil,
                Value::from(0),
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::Nil,
                s("unknown"),
                s("unknown too"),
            ]),
            Some(Event::BlockStored(BlockStored {
                medium: Some(Medium::Storage),
                group_idx: Some(0),
                ..stored(vec![BlockHash::Int(4)], None, vec![8], 1)
            })),
        ),
        (
            "map BlockRemoved",
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", arr(vec![Value::from(2)])),
                ("medium", s("GPU")),
            ]),
            Some(Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(2)],
                medium: Some(Medium::Gpu),
                ..BlockRemoved::default()
            })),
        ),
        (
            "array BlockRemoved, byte hash, medium omitted, unknown medium elsewhere",
            arr(vec![
                s("BlockRemoved"),
                arr(vec![Value::Binary(h32.clone())]),
            ]),
            Some(Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Bytes(h32.clone())],
                ..BlockRemoved::default()
            })),
        ),
        (
            "map BlockRemoved with a medium vLLM does not name, group and locality",
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", arr(vec![])),
                ("medium", s("NVME")),
                ("group_idx", Value::from(2)),
                ("locality", s("REMOTE")),
            ]),
            Some(Event::BlockRemoved(BlockRemoved {
                medium: Some(Medium::Other("NVME".into())),
                group_idx: Some(2),
                locality: Some("REMOTE".into()),
                ..BlockRemoved::default()
            })),
        ),
        (
            "map AllBlocksCleared",
            map(vec![("type", s("AllBlocksCleared"))]),
            Some(Event::AllBlocksCleared),
        ),
        (
            "array AllBlocksCleared",
            arr(vec![s("AllBlocksCleared")]),
            Some(Event::AllBlocksCleared),
        ),
        (
            "unknown map tag",
            map(vec![("type", s("BlockPromoted")), ("x", Value::from(1))]),
            None,
        ),
        (
            "unknown array tag",
            arr(vec![s("BlockPromoted"), Value::from(1)]),
            None,
        ),
    ];
    for (name, event, want) in cases {
        let batch = decode_batch(&batch_of(vec![event])).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.events.first().cloned(), want, "{name}");
        assert_eq!(batch.skipped, usize::from(want.is_none()), "{name}");
    }
}

#[test]
fn an_unknown_event_does_not_fail_its_batch() {
    let b = decode_batch(&batch_of(vec![
        map(vec![("type", s("SomethingNew"))]),
        map(vec![("type", s("AllBlocksCleared"))]),
    ]))
    .unwrap();
    assert_eq!((b.events, b.skipped), (vec![Event::AllBlocksCleared], 1));
}

#[test]
fn batches_decode_with_and_without_a_rank() {
    let cases: Vec<Case<Value, Option<u32>>> = vec![
        (
            "two long",
            arr(vec![Value::F64(1.0), arr(vec![])]),
            Ok(None),
        ),
        (
            "nil rank",
            arr(vec![Value::F64(1.0), arr(vec![]), Value::Nil]),
            Ok(None),
        ),
        (
            "rank 3",
            arr(vec![Value::F64(1.0), arr(vec![]), Value::from(3)]),
            Ok(Some(3)),
        ),
        (
            "an extra trailing item",
            arr(vec![Value::F64(1.0), arr(vec![]), Value::from(1), s("x")]),
            Ok(Some(1)),
        ),
        (
            "integer ts",
            arr(vec![Value::from(1), arr(vec![])]),
            Ok(None),
        ),
        ("not an array", map(vec![("ts", Value::F64(1.0))]), Err(())),
        ("no events", arr(vec![Value::F64(1.0)]), Err(())),
        ("a string ts", arr(vec![s("now"), arr(vec![])]), Err(())),
    ];
    for (name, v, want) in cases {
        let got = decode_batch(&bytes(&v))
            .map(|b| b.data_parallel_rank)
            .map_err(|_| ());
        assert_eq!(got, want, "{name}");
    }
    assert!(decode_batch(&[0xc1]).is_err(), "not msgpack");
}

#[test]
fn malformed_known_events_fail() {
    for (name, ev) in [
        (
            "BlockStored without block_size",
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![])),
                ("token_ids", arr(vec![])),
            ]),
        ),
        (
            "a string hash",
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", arr(vec![s("h")])),
            ]),
        ),
        ("no tag", map(vec![("block_hashes", arr(vec![]))])),
        ("not a map or array", Value::from(3)),
    ] {
        assert!(decode_batch(&batch_of(vec![ev])).is_err(), "{name}");
    }
}

/// Bytes msgspec 0.19 wrote for vLLM 0.33's structs (the tests' only foreign input): ours
/// decode them and encode them back byte for byte.
#[test]
fn msgspec_bytes_round_trip() {
    let cases = [
        (
            "int hashes, GPU, rank 0, a clear",
            "93cb3ff80000000000009288a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647393010203aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c081a474797065b0416c6c426c6f636b73436c656172656400",
            Batch {
                ts: 1.5,
                events: vec![
                    Event::BlockStored(BlockStored {
                        medium: Some(Medium::Gpu),
                        ..stored(vec![BlockHash::Int(1), BlockHash::Int(2)], None, vec![1, 2, 3], 16)
                    }),
                    Event::AllBlocksCleared,
                ],
                data_parallel_rank: Some(0),
                skipped: 0,
            },
        ),
        (
            "32-byte hashes, CPU, a LoRA and a salt, group 1, no rank",
            "93cb4000000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f636b5f68617368c4200202020202020202020202020202020202020202020202020202020202020202a9746f6b656e5f6964739407070707aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65a26164aa65787472615f6b6579739192a26164a473616c74a967726f75705f69647801c0",
            Batch {
                ts: 2.0,
                events: vec![Event::BlockStored(BlockStored {
                    medium: Some(Medium::Cpu),
                    lora_name: Some("ad".into()),
                    extra_keys: Some(vec![Some(vec![s("ad"), s("salt")])]),
                    group_idx: Some(1),
                    ..stored(vec![BlockHash::Bytes(vec![1; 32])], Some(BlockHash::Bytes(vec![2; 32])), vec![7; 4], 4)
                })],
                data_parallel_rank: None,
                skipped: 0,
            },
        ),
    ];
    for (name, h, want) in cases {
        let wire = hex(h);
        assert_eq!(decode_batch(&wire).as_ref(), Ok(&want), "{name}");
        assert_eq!(encode_batch(&want), wire, "{name}");
    }
}

#[test]
fn every_event_round_trips() {
    let b = Batch {
        ts: 3.25,
        events: vec![
            Event::BlockStored(BlockStored {
                lora_id: Some(2),
                kv_cache_spec_kind: Some("sliding_window".into()),
                kv_cache_spec_sliding_window: Some(64),
                ownership: Some("o".into()),
                session_id: Some("s".into()),
                locality: Some("LOCAL".into()),
                lookahead_token_ids: Some(vec![vec![1, 2]]),
                extra_keys: Some(vec![None]),
                ..stored(vec![BlockHash::Int(9)], Some(BlockHash::Int(8)), vec![1], 1)
            }),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(9), BlockHash::Bytes(vec![3; 32])],
                medium: Some(Medium::Storage),
                group_idx: Some(0),
                locality: Some("REMOTE".into()),
                ownership: Some("t".into()),
            }),
            Event::AllBlocksCleared,
        ],
        data_parallel_rank: Some(1),
        skipped: 0,
    };
    assert_eq!(decode_batch(&encode_batch(&b)), Ok(b));
}

#[test]
fn frames_and_replay() {
    let [topic, seq, payload] = frames("kv@a", 258, vec![1, 2]);
    assert_eq!(
        (topic.as_slice(), seq.as_slice(), payload.as_slice()),
        (&b"kv@a"[..], &[0, 0, 0, 0, 0, 0, 1, 2][..], &[1u8, 2][..])
    );
    let cases: Vec<Case<Vec<&[u8]>, Parsed>> = vec![
        (
            "live",
            vec![b"", &[0, 0, 0, 0, 0, 0, 0, 5], b"p"],
            Ok((b"", 5, b"p")),
        ),
        (
            "replayed, after the delimiter",
            vec![b"", b"t", &[0, 0, 0, 0, 0, 0, 0, 6], b"p"],
            Ok((b"t", 6, b"p")),
        ),
        (
            "end marker",
            vec![b"", b"", &[0xff; 8], b""],
            Ok((b"", END_SEQ, b"")),
        ),
        ("short seq", vec![b"", &[1, 2], b"p"], Err(())),
        ("two frames", vec![b"", b"p"], Err(())),
    ];
    for (name, f, want) in cases {
        assert_eq!(parse_frames(&f).map_err(|_| ()), want, "{name}");
    }
    let end = replay_end();
    assert_eq!(
        parse_frames(&end.iter().map(Vec::as_slice).collect::<Vec<_>>())
            .unwrap()
            .1,
        END_SEQ
    );
    let req = replay_request(7);
    assert_eq!(parse_replay_request(&[b"id", b"", &req]), Some(7));
    assert_eq!(parse_replay_request(&[b"id", &req]), None, "no delimiter");
}

#[test]
fn ranks_offset_the_port() {
    let cases = [
        ("tcp://*:5557", 0, Ok("tcp://*:5557")),
        ("tcp://*:5557", 2, Ok("tcp://*:5559")),
        ("tcp://127.0.0.1:0", 3, Ok("tcp://127.0.0.1:0")),
        ("inproc://cache", 1, Ok("inproc://cache_dp1")),
        ("ipc:///tmp/kv", 1, Err(())),
        ("tcp://h:x", 1, Err(())),
        ("tcp://[::1]:5557", 1, Ok("tcp://[::1]:5558")),
        ("tcp://h:65535", 0, Ok("tcp://h:65535")),
        ("tcp://h:65535", 1, Err(())),
        ("tcp://h", 1, Err(())),
    ];
    for (ep, rank, want) in cases {
        assert_eq!(
            endpoint_for_rank(ep, rank).map_err(|_| ()),
            want.map(String::from),
            "{ep} {rank}"
        );
    }
    let no_port = endpoint_for_rank("tcp://h", 1).expect_err("no port");
    assert!(no_port.to_string().contains("no port"), "{no_port}");
}
