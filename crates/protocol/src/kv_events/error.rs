//! Why a KV-event payload or frame could not be read.

use std::fmt;

/// Why a KV-event payload or `seq` frame could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvEventError {
    /// The payload is not one well-formed msgpack value (truncated, bad marker, too deep).
    #[error("KV-event payload is not valid msgpack: {0}")]
    Msgpack(#[source] rmpv::decode::Error),
    /// The payload holds more bytes after the batch.
    #[error("KV-event payload has {count} trailing bytes after the batch")]
    TrailingBytes { count: usize },
    /// The batch is neither an array nor a map.
    #[error("KV-event batch must be a msgpack array or map, found {found}")]
    BatchShape { found: &'static str },
    /// An event is neither an array nor a map.
    #[error("KV event {index} must be a msgpack array or map, found {found}")]
    EventShape { index: usize, found: &'static str },
    /// An event has no type tag (an empty array, or a map without `"type"`).
    #[error("KV event {index} has no type tag")]
    MissingEventType { index: usize },
    /// An event's type tag is not a string.
    #[error("KV event {index} has a type tag that is not a string: found {found}")]
    EventTypeNotString { index: usize, found: &'static str },
    /// An event's type is none of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    #[error("KV event {index} has unknown type {name:?}")]
    UnknownEventType { index: usize, name: String },
    /// A required field is absent.
    #[error("{at}: missing field `{field}`")]
    MissingField { at: Location, field: &'static str },
    /// A field (or an element of it) has the wrong msgpack type.
    #[error("{at}: field `{field}` must be {expected}, found {found}")]
    WrongType {
        at: Location,
        field: &'static str,
        expected: &'static str,
        found: &'static str,
    },
    /// A token id does not fit in a `u32`.
    #[error("{at}: token id {value} is out of range for u32")]
    TokenIdOutOfRange { at: Location, value: i128 },
    /// An integer field does not fit its type.
    #[error("{at}: field `{field}` = {value} is out of range for {target}")]
    IntOutOfRange {
        at: Location,
        field: &'static str,
        value: i128,
        target: &'static str,
    },
    /// A `seq` frame is not 8 bytes long.
    #[error("KV-event seq frame must be 8 bytes, found {len}")]
    SeqLength { len: usize },
}

/// Where in a batch a field error was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// The batch itself (`ts`, `events`, `data_parallel_rank`).
    Batch,
    /// The event at `index` (from 0) in the batch's events, of type `kind`.
    Event { index: usize, kind: &'static str },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Batch => f.write_str("KV-event batch"),
            Self::Event { index, kind } => write!(f, "KV event {index} ({kind})"),
        }
    }
}
