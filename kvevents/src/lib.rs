//! vLLM's KV cache events as they cross the wire: the msgpack batch a replica publishes each
//! engine step, the ZMQ frames around it, and the replay socket's request and end marker.
//! Pure: it turns bytes into values and back, and opens no socket.
//!
//! The facts, from vLLM 0.33's `vllm/distributed/kv_events.py` (msgspec structs):
//! - A batch is an array `[ts, events, data_parallel_rank?]`; a reader takes it two long too
//!   (msgspec's omitted trailing default), though msgspec writes a nil rank as nil.
//! - An event is a tagged map: `{"type": "BlockStored", "block_hashes": …, …}` (the tag is the
//!   class name), fields in declaration order, fields at their default omitted. Older vLLM
//!   encoded events as arrays with the tag first (`["BlockStored", hashes, …]`, trailing
//!   defaults omitted); [`decode_batch`] reads both, [`encode_batch`] writes maps, as 0.33 and
//!   vLLM's router 0.1.17 (which refuses arrays: "KV event must be a tagged map") do.
//! - Block hashes are u64 integers (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default) or the
//!   raw hash bytes (32 for sha256) when that setting is 0.
//! - Frames: `[topic, seq as 8 bytes big-endian, payload]`, topic `""` by default.
//! - Replay (a ROUTER socket): a client (DEALER or REQ) sends `[empty, start seq as 8 bytes
//!   big-endian]`; the publisher answers with every buffered batch whose seq is at least that,
//!   each as `[empty, topic, seq, payload]`, then `[empty, empty, -1 as 8 bytes, empty]`. The
//!   buffer holds the last 10,000 batches by default; there is no snapshot.
//! - Data parallelism: rank r publishes on the configured port + r (both sockets), and stamps
//!   its rank in each batch.
//!
//! Decoding tolerates what a newer publisher may add: unknown fields (map keys or trailing array
//! items) are ignored, and an event with an unknown tag is skipped and counted, never failing
//! its batch.

use std::fmt;

pub use rmpv::Value;

/// The topic vLLM publishes on unless configured (`KVEventsConfig.topic`).
pub const DEFAULT_TOPIC: &str = "";
/// The replay buffer's default length in batches (`KVEventsConfig.buffer_steps`).
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;
/// The sequence number of the replay socket's end marker.
pub const END_SEQ: i64 = -1;

/// A block's hash as the publisher sends it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    Int(u64),
    /// The raw hash (32 bytes of sha256 in vLLM) when int hashes are off.
    Bytes(Vec<u8>),
}

/// Where a block lives. vLLM names `GPU`, `CPU` and `STORAGE`; others pass through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    Other(String),
}

impl Medium {
    pub fn parse(s: &str) -> Medium {
        match s {
            "GPU" => Medium::Gpu,
            "CPU" => Medium::Cpu,
            "STORAGE" => Medium::Storage,
            other => Medium::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Other(s) => s,
        }
    }
}

/// Blocks that entered a cache tier. Fields after `lora_name` default to `None`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of every block, `block_size` each, in order.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// Deprecated in vLLM in favour of `lora_name`.
    pub lora_id: Option<i64>,
    pub medium: Option<Medium>,
    pub lora_name: Option<String>,
    /// One entry per block: the values (LoRA name, multimodal ids, `cache_salt`…) its hash
    /// covers besides the tokens, as sent.
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// Blocks that left a cache tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    pub medium: Option<Medium>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    /// The replica's cache is empty (a reset, or a restart).
    AllBlocksCleared,
}

/// One engine step's events.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch {
    /// Seconds since the epoch, as the publisher's clock had it.
    pub ts: f64,
    pub events: Vec<Event>,
    pub data_parallel_rank: Option<u32>,
    /// Events with a tag this crate does not know, skipped (never encoded).
    pub skipped: usize,
}

/// Why a payload or a frame set is not a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

fn err<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

/// Decodes one batch payload (the third frame).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, Error> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| Error(format!("not msgpack: {e}")))?;
    let Value::Array(items) = v else {
        return err("a batch must be an array [ts, events, data_parallel_rank?]");
    };
    let ts = match items.first() {
        Some(Value::F64(f)) => *f,
        Some(Value::F32(f)) => f64::from(*f),
        Some(v) if v.as_i64().is_some() => v.as_i64().unwrap_or(0) as f64,
        _ => return err("a batch's first item (ts) must be a number"),
    };
    let Some(Value::Array(raw)) = items.get(1) else {
        return err("a batch's second item (events) must be an array");
    };
    let data_parallel_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(uint(v, "data_parallel_rank")?),
    };
    let mut batch = Batch {
        ts,
        data_parallel_rank,
        ..Batch::default()
    };
    for ev in raw {
        match decode_event(ev)? {
            Some(e) => batch.events.push(e),
            None => batch.skipped += 1,
        }
    }
    Ok(batch)
}

/// Field access over either layout: a map by name, or an array by position after the tag.
enum Fields<'a> {
    Map(&'a [(Value, Value)]),
    Array(&'a [Value]),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, pos: usize) -> Option<&'a Value> {
        let v = match self {
            Fields::Map(kv) => kv
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Fields::Array(a) => a.get(pos),
        };
        v.filter(|v| !v.is_nil())
    }
}

/// `Ok(None)`: an event whose tag is unknown.
fn decode_event(v: &Value) -> Result<Option<Event>, Error> {
    let (tag, f) = match v {
        Value::Map(kv) => {
            let tag = kv.iter().find(|(k, _)| k.as_str() == Some("type"));
            (tag.and_then(|(_, t)| t.as_str()), Fields::Map(kv))
        }
        Value::Array(a) => (
            a.first().and_then(Value::as_str),
            Fields::Array(a.get(1..).unwrap_or(&[])),
        ),
        _ => return err("an event must be a tagged map or array"),
    };
    let Some(tag) = tag else {
        return err("an event has no string tag");
    };
    Ok(Some(match tag {
        "BlockStored" => Event::BlockStored(BlockStored {
            block_hashes: hashes(f.get("block_hashes", 0), "block_hashes")?,
            parent_block_hash: f.get("parent_block_hash", 1).map(hash).transpose()?,
            token_ids: u32s(f.get("token_ids", 2), "token_ids")?,
            block_size: f
                .get("block_size", 3)
                .map_or(err("BlockStored has no block_size"), |v| {
                    uint(v, "block_size")
                })?,
            lora_id: f
                .get("lora_id", 4)
                .map(|v| v.as_i64().ok_or(Error("lora_id must be an integer".into())))
                .transpose()?,
            medium: f
                .get("medium", 5)
                .map(|v| text(v, "medium").map(|s| Medium::parse(&s)))
                .transpose()?,
            lora_name: opt_text(f.get("lora_name", 6), "lora_name")?,
            extra_keys: f.get("extra_keys", 7).map(extra_keys).transpose()?,
            group_idx: f
                .get("group_idx", 8)
                .map(|v| uint(v, "group_idx"))
                .transpose()?,
            kv_cache_spec_kind: opt_text(f.get("kv_cache_spec_kind", 9), "kv_cache_spec_kind")?,
            kv_cache_spec_sliding_window: f
                .get("kv_cache_spec_sliding_window", 10)
                .map(|v| uint(v, "kv_cache_spec_sliding_window"))
                .transpose()?,
            locality: opt_text(f.get("locality", 11), "locality")?,
            ownership: opt_text(f.get("ownership", 12), "ownership")?,
            session_id: opt_text(f.get("session_id", 13), "session_id")?,
            lookahead_token_ids: f
                .get("lookahead_token_ids", 14)
                .map(|v| match v {
                    Value::Array(a) => a
                        .iter()
                        .map(|l| u32s(Some(l), "lookahead_token_ids"))
                        .collect(),
                    _ => err("lookahead_token_ids must be an array"),
                })
                .transpose()?,
        }),
        "BlockRemoved" => Event::BlockRemoved(BlockRemoved {
            block_hashes: hashes(f.get("block_hashes", 0), "block_hashes")?,
            medium: f
                .get("medium", 1)
                .map(|v| text(v, "medium").map(|s| Medium::parse(&s)))
                .transpose()?,
            group_idx: f
                .get("group_idx", 2)
                .map(|v| uint(v, "group_idx"))
                .transpose()?,
            locality: opt_text(f.get("locality", 3), "locality")?,
            ownership: opt_text(f.get("ownership", 4), "ownership")?,
        }),
        "AllBlocksCleared" => Event::AllBlocksCleared,
        _ => return Ok(None),
    }))
}

fn uint(v: &Value, what: &str) -> Result<u32, Error> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(Error(format!("{what} must be an unsigned integer")))
}

fn text(v: &Value, what: &str) -> Result<String, Error> {
    v.as_str()
        .map(str::to_string)
        .ok_or(Error(format!("{what} must be a string")))
}

fn opt_text(v: Option<&Value>, what: &str) -> Result<Option<String>, Error> {
    v.map(|v| text(v, what)).transpose()
}

fn hash(v: &Value) -> Result<BlockHash, Error> {
    match v {
        Value::Binary(b) => Ok(BlockHash::Bytes(b.clone())),
        // An int that msgpack carried as signed (a publisher that masks to 63 bits or not).
        v => v
            .as_u64()
            .or_else(|| v.as_i64().map(|i| i as u64))
            .map(BlockHash::Int)
            .ok_or(Error("a block hash must be an integer or bytes".into())),
    }
}

fn hashes(v: Option<&Value>, what: &str) -> Result<Vec<BlockHash>, Error> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => err(format!("{what} must be an array")),
    }
}

fn u32s(v: Option<&Value>, what: &str) -> Result<Vec<u32>, Error> {
    match v {
        Some(Value::Array(a)) => a.iter().map(|t| uint(t, what)).collect(),
        _ => err(format!("{what} must be an array")),
    }
}

fn extra_keys(v: &Value) -> Result<Vec<Option<Vec<Value>>>, Error> {
    let Value::Array(a) = v else {
        return err("extra_keys must be an array");
    };
    a.iter()
        .map(|k| match k {
            Value::Nil => Ok(None),
            Value::Array(items) => Ok(Some(items.clone())),
            _ => err("an extra_keys entry must be an array or nil"),
        })
        .collect()
}

/// Encodes a batch as vLLM 0.33 does: events as tagged maps, defaults omitted.
pub fn encode_batch(batch: &Batch) -> Vec<u8> {
    // msgspec writes the rank even when it is nil (seen with msgspec 0.19); so do we.
    let items = vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(encode_event).collect()),
        batch.data_parallel_rank.map_or(Value::Nil, Value::from),
    ];
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(items));
    out
}

fn encode_event(e: &Event) -> Value {
    let mut m: Vec<(Value, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| m.push((Value::from(k), v));
    match e {
        Event::BlockStored(b) => {
            put("type", Value::from("BlockStored"));
            put("block_hashes", enc_hashes(&b.block_hashes));
            // Fields without a default are always written, nil or not.
            put(
                "parent_block_hash",
                b.parent_block_hash.as_ref().map_or(Value::Nil, enc_hash),
            );
            put("token_ids", enc_u32s(&b.token_ids));
            put("block_size", Value::from(b.block_size));
            put("lora_id", b.lora_id.map_or(Value::Nil, Value::from));
            put(
                "medium",
                b.medium
                    .as_ref()
                    .map_or(Value::Nil, |m| Value::from(m.as_str())),
            );
            put(
                "lora_name",
                b.lora_name.as_deref().map_or(Value::Nil, Value::from),
            );
            if let Some(k) = &b.extra_keys {
                let keys = k.iter().map(|e| e.clone().map_or(Value::Nil, Value::Array));
                put("extra_keys", Value::Array(keys.collect()));
            }
            if let Some(g) = b.group_idx {
                put("group_idx", Value::from(g));
            }
            opt_put(&mut put, "kv_cache_spec_kind", &b.kv_cache_spec_kind);
            if let Some(w) = b.kv_cache_spec_sliding_window {
                put("kv_cache_spec_sliding_window", Value::from(w));
            }
            opt_put(&mut put, "locality", &b.locality);
            opt_put(&mut put, "ownership", &b.ownership);
            opt_put(&mut put, "session_id", &b.session_id);
            if let Some(l) = &b.lookahead_token_ids {
                put(
                    "lookahead_token_ids",
                    Value::Array(l.iter().map(|t| enc_u32s(t)).collect()),
                );
            }
        }
        Event::BlockRemoved(b) => {
            put("type", Value::from("BlockRemoved"));
            put("block_hashes", enc_hashes(&b.block_hashes));
            put(
                "medium",
                b.medium
                    .as_ref()
                    .map_or(Value::Nil, |m| Value::from(m.as_str())),
            );
            if let Some(g) = b.group_idx {
                put("group_idx", Value::from(g));
            }
            opt_put(&mut put, "locality", &b.locality);
            opt_put(&mut put, "ownership", &b.ownership);
        }
        Event::AllBlocksCleared => put("type", Value::from("AllBlocksCleared")),
    }
    Value::Map(m)
}

fn opt_put(put: &mut impl FnMut(&str, Value), k: &str, v: &Option<String>) {
    if let Some(s) = v {
        put(k, Value::from(s.as_str()));
    }
}

fn enc_hash(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(i) => Value::from(*i),
        BlockHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn enc_hashes(h: &[BlockHash]) -> Value {
    Value::Array(h.iter().map(enc_hash).collect())
}

fn enc_u32s(t: &[u32]) -> Value {
    Value::Array(t.iter().map(|&t| Value::from(t)).collect())
}

/// The publisher's three frames for a batch: topic, sequence, payload.
pub fn frames(topic: &str, seq: u64, payload: Vec<u8>) -> [Vec<u8>; 3] {
    [
        topic.as_bytes().to_vec(),
        seq.to_be_bytes().to_vec(),
        payload,
    ]
}

/// A sequence frame's number; `Ok(-1)` is the replay end marker ([`END_SEQ`]).
pub fn parse_seq(frame: &[u8]) -> Result<i64, Error> {
    let b: [u8; 8] = frame
        .try_into()
        .map_err(|_| Error(format!("a sequence frame has 8 bytes, not {}", frame.len())))?;
    Ok(i64::from_be_bytes(b))
}

/// A received message: `[topic, seq, payload]` from the PUB socket, or the same after the
/// empty delimiter from the replay socket.
pub fn parse_frames<'a>(frames: &[&'a [u8]]) -> Result<(&'a [u8], i64, &'a [u8]), Error> {
    let f = match frames {
        [empty, rest @ ..] if empty.is_empty() && rest.len() == 3 => rest,
        f => f,
    };
    match f {
        [topic, seq, payload] => Ok((topic, parse_seq(seq)?, payload)),
        _ => err(format!("a KV event message has 3 frames, not {}", f.len())),
    }
}

/// What a replay client sends after the empty delimiter: the first sequence it wants.
pub fn replay_request(start_seq: u64) -> [u8; 8] {
    start_seq.to_be_bytes()
}

/// The start sequence of a replay request as the ROUTER socket receives it
/// (`[identity, empty, seq]`); `None` for anything else (vLLM logs and ignores it).
pub fn parse_replay_request(frames: &[&[u8]]) -> Option<u64> {
    match frames {
        [_identity, [], seq] => parse_seq(seq).ok().map(|s| s as u64),
        _ => None,
    }
}

/// The replay socket's end marker frames after the client's identity: `[empty, empty, -1, empty]`.
pub fn replay_end() -> [Vec<u8>; 4] {
    [
        Vec::new(),
        Vec::new(),
        END_SEQ.to_be_bytes().to_vec(),
        Vec::new(),
    ]
}

/// Rank `rank`'s endpoint, as vLLM's (and SGLang's) data-parallel rank k binds its event
/// sockets: a tcp port moves by the rank (port 0, any free port, stays 0); inproc gets
/// `_dp{rank}`. An error for another transport, a port that is not a number, or one the rank
/// moves past 65535.
pub fn endpoint_for_rank(endpoint: &str, rank: u32) -> Result<String, Error> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    let Some(address) = endpoint.strip_prefix("tcp://") else {
        return err(format!("endpoint {endpoint}: must be tcp:// or inproc://"));
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return err(format!("endpoint {endpoint}: no port"));
    };
    let port: u16 = port
        .parse()
        .map_err(|_| Error(format!("endpoint {endpoint}: the port is not a number")))?;
    if port == 0 {
        return Ok(endpoint.to_string());
    }
    match u16::try_from(u32::from(port) + rank) {
        Ok(p) => Ok(format!("tcp://{host}:{p}")),
        Err(_) => err(format!(
            "endpoint {endpoint}: rank {rank} moves it past port 65535"
        )),
    }
}

#[cfg(test)]
mod tests;
