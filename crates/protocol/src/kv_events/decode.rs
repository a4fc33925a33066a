//! Decoding: a well-formed batch is read directly from its bytes ([`super::direct`]); any
//! other payload is read once into an [`rmpv::ValueRef`] tree that borrows its strings and
//! byte strings from the payload, then walked into the typed batch, which says what is wrong
//! with it.
//!
//! Each record (the batch, each event) is read through [`Fields`], which looks a field up by
//! position in the array form and by name in the map form, so every record's schema is
//! written once for both forms.

use std::borrow::Cow;

use rmpv::{Integer, Value, ValueRef};

use super::error::{KvEventError, Location};
use super::{BlockHashValue, BlockHashes, BlockRemoved, BlockStored, KvEvent, KvEventBatch};

/// The recursion limit handed to rmpv, which spends one unit per container and one or two per
/// string, so this allows about 40 levels of nesting: ample for the schema (five levels, plus
/// whatever `extra_keys` holds), and a small, bounded stack whatever the input.
const MAX_DEPTH: usize = 128;

/// Decodes one payload (the third frame of a message) into a batch.
///
/// Accepts every variant described in the [module docs](super): the batch as an array of
/// two or three elements or as a map, each event as a positional array or a tagged map, block
/// hashes as ints or byte strings. Fields this crate does not model are ignored; anything
/// else that does not fit the schema, including bytes after the batch, is an error.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    match super::direct::decode(payload) {
        Some(batch) => Ok(batch),
        None => decode_batch_via_tree(payload),
    }
}

/// [`decode_batch`] through the tree whatever the payload: the same answer, 2.6-4.3x slower
/// on what engines send (the baseline of `kvroute-bench`'s `decode_cost` example).
pub fn decode_batch_via_tree(payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, MAX_DEPTH)
        .map_err(KvEventError::Msgpack)?;
    if !rest.is_empty() {
        return Err(KvEventError::TrailingBytes { count: rest.len() });
    }
    let batch = match &value {
        ValueRef::Array(items) => Body::Positional(items),
        ValueRef::Map(entries) => Body::Named(entries),
        other => {
            return Err(KvEventError::BatchShape {
                found: type_name(other),
            });
        }
    };
    let fields = Fields {
        at: Location::Batch,
        body: batch,
    };
    Ok(KvEventBatch {
        ts: fields.require(0, "ts")?.f64()?,
        events: fields
            .require(1, "events")?
            .array()?
            .iter()
            .enumerate()
            .map(|(index, event)| decode_event(index, event))
            .collect::<Result<_, _>>()?,
        dp_rank: fields
            .get(2, "data_parallel_rank")
            .map(Field::u32)
            .transpose()?,
    })
}

fn decode_event(index: usize, value: &ValueRef<'_>) -> Result<KvEvent, KvEventError> {
    let (tag, body) = match value {
        ValueRef::Array(items) => {
            let (tag, rest) = items
                .split_first()
                .ok_or(KvEventError::MissingEventType { index })?;
            (tag, Body::Positional(rest))
        }
        ValueRef::Map(entries) => {
            let tag = lookup(entries, "type").ok_or(KvEventError::MissingEventType { index })?;
            (tag, Body::Named(entries))
        }
        other => {
            return Err(KvEventError::EventShape {
                index,
                found: type_name(other),
            });
        }
    };
    let ValueRef::String(name) = tag else {
        return Err(KvEventError::EventTypeNotString {
            index,
            found: type_name(tag),
        });
    };
    let fields = |kind| Fields {
        at: Location::Event { index, kind },
        body,
    };
    match name.as_bytes() {
        b"BlockStored" => block_stored(fields("BlockStored")).map(KvEvent::BlockStored),
        b"BlockRemoved" => block_removed(fields("BlockRemoved")).map(KvEvent::BlockRemoved),
        b"AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(KvEventError::UnknownEventType {
            index,
            name: String::from_utf8_lossy(other).into_owned(),
        }),
    }
}

/// Positions count from the element after the tag.
fn block_stored(fields: Fields<'_, '_>) -> Result<BlockStored, KvEventError> {
    Ok(BlockStored {
        block_hashes: fields.require(0, "block_hashes")?.block_hashes()?,
        parent_block_hash: fields
            .get(1, "parent_block_hash")
            .map(Field::block_hash)
            .transpose()?,
        token_ids: fields.require(2, "token_ids")?.token_ids()?,
        block_size: fields.require(3, "block_size")?.u32()?,
        lora_id: fields.get(4, "lora_id").map(Field::i64).transpose()?,
        medium: fields.get(5, "medium").map(Field::medium).transpose()?,
        lora_name: fields.get(6, "lora_name").map(Field::string).transpose()?,
        extra_keys: fields
            .get(7, "extra_keys")
            .map(Field::extra_keys)
            .transpose()?,
    })
}

/// Positions count from the element after the tag.
fn block_removed(fields: Fields<'_, '_>) -> Result<BlockRemoved, KvEventError> {
    Ok(BlockRemoved {
        block_hashes: fields.require(0, "block_hashes")?.block_hashes()?,
        medium: fields.get(1, "medium").map(Field::medium).transpose()?,
    })
}

/// A record's fields, in either form.
#[derive(Clone, Copy)]
enum Body<'v, 'a> {
    Positional(&'v [ValueRef<'a>]),
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

/// A record's fields and where the record is, for error messages.
#[derive(Clone, Copy)]
struct Fields<'v, 'a> {
    at: Location,
    body: Body<'v, 'a>,
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field at `position` in the array form, or under `name` in the map form.
    fn lookup(self, position: usize, name: &'static str) -> Option<Field<'v, 'a>> {
        let value = match self.body {
            Body::Positional(items) => items.get(position),
            Body::Named(entries) => lookup(entries, name),
        }?;
        Some(Field {
            at: self.at,
            name,
            value,
        })
    }

    /// A field that must be present (nil included: the type check then says what was wrong).
    fn require(self, position: usize, name: &'static str) -> Result<Field<'v, 'a>, KvEventError> {
        self.lookup(position, name)
            .ok_or(KvEventError::MissingField {
                at: self.at,
                field: name,
            })
    }

    /// An optional field: `None` when absent or nil.
    fn get(self, position: usize, name: &'static str) -> Option<Field<'v, 'a>> {
        self.lookup(position, name)
            .filter(|field| !matches!(field.value, ValueRef::Nil))
    }
}

/// The value under the string key `name`, the first one if the key repeats.
fn lookup<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    name: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .find(|(key, _)| matches!(key, ValueRef::String(key) if key.as_bytes() == name.as_bytes()))
        .map(|(_, value)| value)
}

/// One field's value, with its name and record for error messages.
#[derive(Clone, Copy)]
struct Field<'v, 'a> {
    at: Location,
    name: &'static str,
    value: &'v ValueRef<'a>,
}

impl<'v, 'a> Field<'v, 'a> {
    fn wrong_type(self, expected: &'static str, found: &'static str) -> KvEventError {
        KvEventError::WrongType {
            at: self.at,
            field: self.name,
            expected,
            found,
        }
    }

    fn out_of_range(self, value: Integer, target: &'static str) -> KvEventError {
        KvEventError::IntOutOfRange {
            at: self.at,
            field: self.name,
            value: to_i128(value),
            target,
        }
    }

    fn array(self) -> Result<&'v [ValueRef<'a>], KvEventError> {
        match self.value {
            ValueRef::Array(items) => Ok(items),
            other => Err(self.wrong_type("an array", type_name(other))),
        }
    }

    fn integer(self) -> Result<Integer, KvEventError> {
        match self.value {
            ValueRef::Integer(n) => Ok(*n),
            other => Err(self.wrong_type("an int", type_name(other))),
        }
    }

    fn f64(self) -> Result<f64, KvEventError> {
        match self.value {
            ValueRef::F64(x) => Ok(*x),
            ValueRef::F32(x) => Ok(f64::from(*x)),
            ValueRef::Integer(n) => Ok(n.as_f64().unwrap_or_default()),
            other => Err(self.wrong_type("a number", type_name(other))),
        }
    }

    fn u32(self) -> Result<u32, KvEventError> {
        let n = self.integer()?;
        n.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.out_of_range(n, "u32"))
    }

    fn i64(self) -> Result<i64, KvEventError> {
        let n = self.integer()?;
        n.as_i64().ok_or_else(|| self.out_of_range(n, "i64"))
    }

    /// A UTF-8 str, borrowed from the payload.
    fn str(self) -> Result<&'v str, KvEventError> {
        match self.value {
            ValueRef::String(s) => (s.as_str())
                .ok_or_else(|| self.wrong_type("a UTF-8 string", "a string that is not UTF-8")),
            other => Err(self.wrong_type("a string", type_name(other))),
        }
    }

    fn string(self) -> Result<String, KvEventError> {
        self.str().map(str::to_owned)
    }

    fn medium(self) -> Result<Cow<'static, str>, KvEventError> {
        self.str().map(super::medium)
    }

    fn block_hash(self) -> Result<BlockHashValue, KvEventError> {
        self.hash_of(self.value)
    }

    fn block_hashes(self) -> Result<BlockHashes, KvEventError> {
        self.array()?.iter().map(|v| self.hash_of(v)).collect()
    }

    /// A hash is an int (a negative one read as its two's-complement bits) or a byte string
    /// (bin, or str whatever its encoding).
    fn hash_of(self, value: &ValueRef<'_>) -> Result<BlockHashValue, KvEventError> {
        match value {
            ValueRef::Integer(n) => Ok(BlockHashValue::U64(to_u64_bits(*n))),
            ValueRef::Binary(bytes) => Ok(BlockHashValue::Bytes(bytes.to_vec())),
            ValueRef::String(s) => Ok(BlockHashValue::Bytes(s.as_bytes().to_vec())),
            other => Err(self.wrong_type("an int or a byte string", type_name(other))),
        }
    }

    fn token_ids(self) -> Result<Vec<u32>, KvEventError> {
        self.array()?
            .iter()
            .map(|v| match v {
                ValueRef::Integer(n) => n.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or(
                    KvEventError::TokenIdOutOfRange {
                        at: self.at,
                        value: to_i128(*n),
                    },
                ),
                other => Err(self.wrong_type("an array of ints", type_name(other))),
            })
            .collect()
    }

    fn extra_keys(self) -> Result<Vec<Option<Value>>, KvEventError> {
        Ok(self
            .array()?
            .iter()
            .map(|v| match v {
                ValueRef::Nil => None,
                other => Some(other.to_owned()),
            })
            .collect())
    }
}

/// The integer's 64 bits: a negative one as its two's complement.
fn to_u64_bits(n: Integer) -> u64 {
    match n.as_u64() {
        Some(n) => n,
        // A msgpack int is a u64 or a negative i64, so this branch always has a value.
        None => n.as_i64().map_or(0, |n| n as u64),
    }
}

fn to_i128(n: Integer) -> i128 {
    match n.as_u64() {
        Some(n) => i128::from(n),
        None => n.as_i64().map_or(0, i128::from),
    }
}

/// The msgpack type of `value`, for error messages.
fn type_name(value: &ValueRef<'_>) -> &'static str {
    match value {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a bool",
        ValueRef::Integer(_) => "an int",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "a byte string",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an ext value",
    }
}
