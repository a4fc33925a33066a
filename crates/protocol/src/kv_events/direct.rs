//! The direct reader: a batch read straight from the payload's bytes, with no tree of values
//! and no allocation besides the batch's own. A positional record (the batch array engines
//! send, a positional event) is read in place, in one walk; a map (vLLM 0.32's tagged
//! events, a map batch) is walked once to find its fields' bytes (the first of a repeated
//! name), then each field is read into its type.
//!
//! It answers for well-formed batches of the schema and nothing else: on any error, a
//! non-nil `extra_keys` entry (an arbitrary value, which the batch keeps as an
//! [`rmpv::Value`]) or an unknown field nested deeper than [`MAX_SKIP_DEPTH`], it gives up
//! and [`super::decode_batch`] reads the payload through the tree, which says what is wrong.
//! Where it answers, it answers as the tree does (a test holds the two to it).

use std::borrow::Cow;

use super::{BlockHashValue, BlockHashes, BlockRemoved, BlockStored, KvEvent, KvEventBatch};

/// How deep an unknown field's values may nest before the payload is left to the tree.
const MAX_SKIP_DEPTH: usize = 16;

/// The batch in `payload`, if the direct reader answers for it.
pub(super) fn decode(payload: &[u8]) -> Option<KvEventBatch> {
    let mut reader = Reader { bytes: payload };
    let batch = match reader.bytes.first()? {
        // An array `[ts, events, rank]` (what engines send) is read in place.
        0x90..=0x9F | 0xDC | 0xDD => {
            let n = reader.array()?;
            let ts = reader.f64()?;
            let events = reader.events()?;
            let dp_rank = match n.checked_sub(2)? {
                0 => None,
                _ => reader.optional(Reader::u32)?,
            };
            for _ in 3..n {
                reader.skip(MAX_SKIP_DEPTH)?;
            }
            KvEventBatch {
                ts,
                events,
                dp_rank,
            }
        }
        _ => {
            let Head::Map(n) = reader.head()? else {
                return None;
            };
            let mut fields = [None; 3];
            reader.named(n, &["ts", "events", "data_parallel_rank"], &mut fields)?;
            let [ts, events, rank] = fields;
            KvEventBatch {
                ts: field(ts?)?.f64()?,
                events: field(events?)?.events()?,
                dp_rank: optional(rank, Reader::u32)?,
            }
        }
    };
    reader.bytes.is_empty().then_some(batch)
}

/// The names of an event's fields; in the array form the tag is the first element and the
/// fields follow in this order (`BlockRemoved`: its hashes, then its medium).
const EVENT_FIELDS: [&str; 9] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];

/// A value's head: its type and what it holds, a container's element count.
enum Head<'a> {
    Nil,
    Bool,
    Uint(u64),
    /// A negative int.
    Neg(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

impl Head<'_> {
    fn int(n: i64) -> Self {
        match u64::try_from(n) {
            Ok(n) => Self::Uint(n),
            Err(_) => Self::Neg(n),
        }
    }
}

/// A reader of msgpack values from the front of `bytes`; every method returns `None` where
/// the bytes end early or hold what it does not expect.
struct Reader<'a> {
    bytes: &'a [u8],
}

/// A reader of one field's bytes, if present.
fn field(bytes: &[u8]) -> Option<Reader<'_>> {
    Some(Reader { bytes })
}

/// An optional field read with `read`: `Some(None)` when absent or nil.
fn optional<'a, T>(
    bytes: Option<&'a [u8]>,
    read: impl FnOnce(&mut Reader<'a>) -> Option<T>,
) -> Option<Option<T>> {
    match bytes {
        None | Some([0xC0]) => Some(None),
        Some(bytes) => read(&mut Reader { bytes }).map(Some),
    }
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.bytes.len() {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Some(head)
    }

    fn be<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.be::<1>()?[0])
    }

    fn u16(&mut self) -> Option<usize> {
        Some(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn u32_len(&mut self) -> Option<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).ok()
    }

    fn head(&mut self) -> Option<Head<'a>> {
        let marker = self.u8()?;
        Some(match marker {
            0x00..=0x7F => Head::Uint(u64::from(marker)),
            0x80..=0x8F => Head::Map(usize::from(marker & 0x0F)),
            0x90..=0x9F => Head::Array(usize::from(marker & 0x0F)),
            0xA0..=0xBF => Head::Str(self.take(usize::from(marker & 0x1F))?),
            0xC0 => Head::Nil,
            0xC1 => return None,
            0xC2 | 0xC3 => Head::Bool,
            0xC4 => {
                let n = usize::from(self.u8()?);
                Head::Bin(self.take(n)?)
            }
            0xC5 => {
                let n = self.u16()?;
                Head::Bin(self.take(n)?)
            }
            0xC6 => {
                let n = self.u32_len()?;
                Head::Bin(self.take(n)?)
            }
            0xC7..=0xC9 => {
                let n = match marker {
                    0xC7 => usize::from(self.u8()?),
                    0xC8 => self.u16()?,
                    _ => self.u32_len()?,
                };
                self.take(n.checked_add(1)?)?;
                Head::Ext
            }
            0xCA => Head::F32(f32::from_be_bytes(self.be()?)),
            0xCB => Head::F64(f64::from_be_bytes(self.be()?)),
            0xCC => Head::Uint(u64::from(self.u8()?)),
            0xCD => Head::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            0xCE => Head::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            0xCF => Head::Uint(u64::from_be_bytes(self.be()?)),
            0xD0 => Head::int(i64::from(i8::from_be_bytes(self.be()?))),
            0xD1 => Head::int(i64::from(i16::from_be_bytes(self.be()?))),
            0xD2 => Head::int(i64::from(i32::from_be_bytes(self.be()?))),
            0xD3 => Head::int(i64::from_be_bytes(self.be()?)),
            // fixext 1, 2, 4, 8, 16: a type byte and the data.
            0xD4..=0xD8 => {
                self.take(1 + (1 << (marker - 0xD4)))?;
                Head::Ext
            }
            0xD9 => {
                let n = usize::from(self.u8()?);
                Head::Str(self.take(n)?)
            }
            0xDA => {
                let n = self.u16()?;
                Head::Str(self.take(n)?)
            }
            0xDB => {
                let n = self.u32_len()?;
                Head::Str(self.take(n)?)
            }
            0xDC => Head::Array(self.u16()?),
            0xDD => Head::Array(self.u32_len()?),
            0xDE => Head::Map(self.u16()?),
            0xDF => Head::Map(self.u32_len()?),
            0xE0..=0xFF => Head::Neg(i64::from(marker as i8)),
        })
    }

    /// Skips one value, what it holds included (every element takes a byte at least, so a
    /// hostile count ends with the bytes).
    fn skip(&mut self, depth: usize) -> Option<()> {
        let marker = self.u8()?;
        let (bytes, elements) = match marker {
            0x00..=0x7F | 0xC0 | 0xC2 | 0xC3 | 0xE0..=0xFF => (0, 0),
            0x80..=0x8F => (0, 2 * usize::from(marker & 0x0F)),
            0x90..=0x9F => (0, usize::from(marker & 0x0F)),
            0xA0..=0xBF => (usize::from(marker & 0x1F), 0),
            0xC1 => return None,
            0xC4 | 0xD9 => (usize::from(self.u8()?), 0),
            0xC5 | 0xDA => (self.u16()?, 0),
            0xC6 | 0xDB => (self.u32_len()?, 0),
            0xC7 => (usize::from(self.u8()?) + 1, 0),
            0xC8 => (self.u16()? + 1, 0),
            0xC9 => (self.u32_len()?.checked_add(1)?, 0),
            0xCC | 0xD0 => (1, 0),
            0xCD | 0xD1 => (2, 0),
            0xCA | 0xCE | 0xD2 => (4, 0),
            0xCB | 0xCF | 0xD3 => (8, 0),
            0xD4..=0xD8 => (1 + (1 << (marker - 0xD4)), 0),
            0xDC => (0, self.u16()?),
            0xDD => (0, self.u32_len()?),
            0xDE => (0, 2 * self.u16()?),
            0xDF => (0, self.u32_len()?.checked_mul(2)?),
        };
        self.take(bytes)?;
        if elements > 0 {
            let depth = depth.checked_sub(1)?;
            for _ in 0..elements {
                self.skip(depth)?;
            }
        }
        Some(())
    }

    /// One value's bytes, skipped over.
    fn raw(&mut self) -> Option<&'a [u8]> {
        let start = self.bytes;
        self.skip(MAX_SKIP_DEPTH)?;
        Some(&start[..start.len() - self.bytes.len()])
    }

    /// `n` key-value pairs into the fields of `names`: the first value of each name, other
    /// names skipped.
    fn named<const N: usize>(
        &mut self,
        n: usize,
        names: &[&str; N],
        fields: &mut [Option<&'a [u8]>; N],
    ) -> Option<()> {
        for _ in 0..n {
            let key = match self.head()? {
                Head::Str(key) => Some(key),
                Head::Array(_) | Head::Map(_) => return None,
                _ => None,
            };
            let value = self.raw()?;
            let slot = key.and_then(|key| names.iter().position(|name| name.as_bytes() == key));
            if let Some(slot) = slot.map(|i| &mut fields[i]) {
                slot.get_or_insert(value);
            }
        }
        Some(())
    }

    fn events(&mut self) -> Option<Vec<KvEvent>> {
        let count = self.array()?;
        let mut events = Vec::with_capacity(count.min(self.bytes.len()));
        for _ in 0..count {
            events.push(self.event()?);
        }
        Some(events)
    }

    /// One event, in either form: a positional array read in place, a tagged map through its
    /// fields' bytes.
    fn event(&mut self) -> Option<KvEvent> {
        let n = match self.head()? {
            Head::Array(n) => n,
            Head::Map(n) => return self.named_event(n),
            _ => return None,
        };
        let rest = n.checked_sub(1)?;
        let Head::Str(tag) = self.head()? else {
            return None;
        };
        let event = match tag {
            b"BlockStored" => {
                let mut stored = BlockStored {
                    block_hashes: BlockHashes::new(),
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: 0,
                    lora_id: None,
                    medium: None,
                    lora_name: None,
                    extra_keys: None,
                };
                // block_hashes, token_ids and block_size are required.
                if rest < 4 {
                    return None;
                }
                for position in 0..rest {
                    match position {
                        0 => stored.block_hashes = self.hashes()?,
                        1 => stored.parent_block_hash = self.optional(Reader::hash)?,
                        2 => stored.token_ids = self.tokens()?,
                        3 => stored.block_size = self.u32()?,
                        4 => stored.lora_id = self.optional(Reader::i64)?,
                        5 => stored.medium = self.optional(Reader::medium)?,
                        6 => stored.lora_name = self.optional(Reader::string)?,
                        7 => stored.extra_keys = self.optional(Reader::no_extra_keys)?,
                        _ => self.skip(MAX_SKIP_DEPTH)?,
                    }
                }
                KvEvent::BlockStored(stored)
            }
            b"BlockRemoved" => {
                let mut removed = BlockRemoved {
                    block_hashes: BlockHashes::new(),
                    medium: None,
                };
                if rest < 1 {
                    return None;
                }
                for position in 0..rest {
                    match position {
                        0 => removed.block_hashes = self.hashes()?,
                        1 => removed.medium = self.optional(Reader::medium)?,
                        _ => self.skip(MAX_SKIP_DEPTH)?,
                    }
                }
                KvEvent::BlockRemoved(removed)
            }
            b"AllBlocksCleared" => {
                for _ in 0..rest {
                    self.skip(MAX_SKIP_DEPTH)?;
                }
                KvEvent::AllBlocksCleared
            }
            _ => return None,
        };
        Some(event)
    }

    /// A tagged-map event of `n` entries.
    fn named_event(&mut self, n: usize) -> Option<KvEvent> {
        let mut fields = [None; EVENT_FIELDS.len()];
        self.named(n, &EVENT_FIELDS, &mut fields)?;
        let [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra] = fields;
        match field(tag?)?.head()? {
            Head::Str(b"BlockStored") => Some(KvEvent::BlockStored(BlockStored {
                block_hashes: field(hashes?)?.hashes()?,
                parent_block_hash: optional(parent, Reader::hash)?,
                token_ids: field(tokens?)?.tokens()?,
                block_size: field(block_size?)?.u32()?,
                lora_id: optional(lora_id, Reader::i64)?,
                medium: optional(medium, Reader::medium)?,
                lora_name: optional(lora_name, Reader::string)?,
                extra_keys: optional(extra, Reader::no_extra_keys)?,
            })),
            Head::Str(b"BlockRemoved") => Some(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: field(hashes?)?.hashes()?,
                medium: optional(medium, Reader::medium)?,
            })),
            Head::Str(b"AllBlocksCleared") => Some(KvEvent::AllBlocksCleared),
            _ => None,
        }
    }

    /// A field read with `read` in place: `None` for a nil.
    fn optional<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        match self.bytes.first()? {
            0xC0 => {
                self.bytes = &self.bytes[1..];
                Some(None)
            }
            _ => read(self).map(Some),
        }
    }

    fn array(&mut self) -> Option<usize> {
        match self.head()? {
            Head::Array(n) => Some(n),
            _ => None,
        }
    }

    fn f64(&mut self) -> Option<f64> {
        match self.head()? {
            Head::F64(x) => Some(x),
            Head::F32(x) => Some(f64::from(x)),
            Head::Uint(n) => Some(n as f64),
            Head::Neg(n) => Some(n as f64),
            _ => None,
        }
    }

    fn u32(&mut self) -> Option<u32> {
        // Token ids: a fixint or a uint16 mostly.
        match *self.bytes {
            [marker @ 0x00..=0x7F, ..] => {
                self.bytes = &self.bytes[1..];
                Some(u32::from(marker))
            }
            [0xCD, high, low, ..] => {
                self.bytes = &self.bytes[3..];
                Some(u32::from(u16::from_be_bytes([high, low])))
            }
            _ => match self.head()? {
                Head::Uint(n) => u32::try_from(n).ok(),
                _ => None,
            },
        }
    }

    fn i64(&mut self) -> Option<i64> {
        match self.head()? {
            Head::Uint(n) => i64::try_from(n).ok(),
            Head::Neg(n) => Some(n),
            _ => None,
        }
    }

    /// A UTF-8 str, borrowed from the payload.
    fn str(&mut self) -> Option<&'a str> {
        match self.head()? {
            Head::Str(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    fn string(&mut self) -> Option<String> {
        self.str().map(str::to_owned)
    }

    fn medium(&mut self) -> Option<Cow<'static, str>> {
        self.str().map(super::medium)
    }

    /// An int (a negative one as its two's-complement bits) or a byte string (bin or str).
    fn hash(&mut self) -> Option<BlockHashValue> {
        match self.head()? {
            Head::Uint(n) => Some(BlockHashValue::U64(n)),
            Head::Neg(n) => Some(BlockHashValue::U64(n as u64)),
            Head::Bin(bytes) | Head::Str(bytes) => Some(BlockHashValue::Bytes(bytes.to_vec())),
            _ => None,
        }
    }

    fn hashes(&mut self) -> Option<BlockHashes> {
        let n = self.array()?;
        let mut hashes = BlockHashes::with_capacity(n.min(self.bytes.len()));
        for _ in 0..n {
            hashes.push(self.hash()?);
        }
        Some(hashes)
    }

    fn tokens(&mut self) -> Option<Vec<u32>> {
        let n = self.array()?;
        let mut tokens = Vec::with_capacity(n.min(self.bytes.len()));
        for _ in 0..n {
            tokens.push(self.u32()?);
        }
        Some(tokens)
    }

    /// `extra_keys` whose every entry is nil (what vLLM sends for blocks without any).
    fn no_extra_keys(&mut self) -> Option<Vec<Option<rmpv::Value>>> {
        let n = self.array()?;
        for _ in 0..n {
            if !matches!(self.head()?, Head::Nil) {
                return None;
            }
        }
        Some(vec![None; n])
    }
}
