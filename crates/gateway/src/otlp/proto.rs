//! The OTLP trace messages kvroute sends, as protobuf: the subset of
//! `opentelemetry/proto/collector/trace/v1/trace_service.proto` and the `trace`, `common` and
//! `resource` protos it uses, with their field numbers and types. Fields kvroute never sets
//! (events, links, array values) are left out: a decoder reads their absence as empty.

use prost::Message;

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceResponse {
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<ExportTracePartialSuccess>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExportTracePartialSuccess {
    #[prost(int64, tag = "1")]
    pub rejected_spans: i64,
    #[prost(string, tag = "2")]
    pub error_message: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(string, tag = "3")]
    pub trace_state: String,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
    /// The W3C trace flags in bits 0-7; bit 8 says bit 9 is set, bit 9 that the parent is
    /// remote.
    #[prost(fixed32, tag = "16")]
    pub flags: u32,
}

/// `Span.SpanKind`.
pub const SPAN_KIND_SERVER: i32 = 2;
pub const SPAN_KIND_CLIENT: i32 = 3;

#[derive(Clone, PartialEq, Message)]
pub struct Status {
    #[prost(string, tag = "2")]
    pub message: String,
    /// `Status.StatusCode`: 0 unset, 1 ok, 2 error.
    #[prost(int32, tag = "3")]
    pub code: i32,
}

pub const STATUS_ERROR: i32 = 2;

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    #[prost(oneof = "Value", tags = "1, 2, 3, 4")]
    pub value: Option<Value>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(string, tag = "1")]
    String(String),
    #[prost(bool, tag = "2")]
    Bool(bool),
    #[prost(int64, tag = "3")]
    Int(i64),
    #[prost(double, tag = "4")]
    Double(f64),
}

impl KeyValue {
    pub fn new(key: impl Into<String>, value: Value) -> Self {
        Self {
            key: key.into(),
            value: Some(AnyValue { value: Some(value) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of a known message, field by field: what a decoder of the real protos reads
    /// (the receiver test decodes whole batches with `opentelemetry-proto`).
    #[test]
    fn a_span_encodes_with_the_protos_field_numbers() {
        let span = Span {
            trace_id: vec![1; 16],
            name: "x".into(),
            kind: SPAN_KIND_SERVER,
            start_time_unix_nano: 5,
            flags: 0x101,
            attributes: vec![KeyValue::new("k", Value::Int(7))],
            ..Default::default()
        };
        let bytes = span.encode_to_vec();
        let mut want = vec![0x0a, 16];
        want.extend([1; 16]);
        want.extend([0x2a, 1, b'x']); // 5: name
        want.extend([0x30, 2]); // 6: kind, varint
        want.extend([0x39, 5, 0, 0, 0, 0, 0, 0, 0]); // 7: fixed64
                                                     // 9: KeyValue { 1: "k", 2: AnyValue { 3: 7 } }
        want.extend([0x4a, 7, 0x0a, 1, b'k', 0x12, 2, 0x18, 7]);
        want.extend([0x85, 0x01, 0x01, 0x01, 0, 0]); // 16: fixed32
        assert_eq!(bytes, want);
        assert_eq!(Span::decode(bytes.as_slice()).unwrap(), span);
    }
}
