//! The ext_proc messages as kvroute reads and writes them: header maps and values, the
//! request's head, body pieces, the destination's dynamic metadata, the subset hint, and the
//! model-name rewrite.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use prost_types::value::Kind;

use super::pb::core::{self as core_pb, header_value_option::HeaderAppendAction};
use super::pb::ext_proc::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    ProcessingResponse, StreamedBodyResponse,
};
use super::{DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::error::GatewayError;

/// The largest body piece sent back to the gateway (GIE's limit, under gRPC's 64 KiB frame).
pub const BODY_PIECE: usize = 62_000;

/// The request as its headers describe it.
#[derive(Debug)]
pub(crate) struct Head {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
}

/// A response carrying `response`.
pub(crate) fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

pub(crate) fn with_metadata(
    mut response: ProcessingResponse,
    metadata: prost_types::Struct,
) -> ProcessingResponse {
    response.dynamic_metadata = Some(metadata);
    response
}

/// A common response applying `mutation`, asking the gateway to route again on it.
pub(crate) fn common(mutation: HeaderMutation) -> CommonResponse {
    let clear_route_cache = !mutation.set_headers.is_empty();
    CommonResponse {
        header_mutation: Some(mutation),
        clear_route_cache,
        ..Default::default()
    }
}

/// `body` as `StreamedBodyResponse` pieces of at most [`BODY_PIECE`] bytes, the last with
/// `end_of_stream` (one empty piece for an empty body).
pub(crate) fn streamed(
    body: Bytes,
    wrap: fn(BodyResponse) -> processing_response::Response,
) -> Vec<ProcessingResponse> {
    let n = body.len().div_ceil(BODY_PIECE).max(1);
    (0..n)
        .map(|i| {
            let piece = body.slice(i * BODY_PIECE..((i + 1) * BODY_PIECE).min(body.len()));
            answer(wrap(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: piece.to_vec(),
                                end_of_stream: i + 1 == n,
                                ..Default::default()
                            },
                        )),
                    }),
                    ..Default::default()
                }),
            }))
        })
        .collect()
}

/// Sets a header, overwriting whatever the client sent.
pub(crate) fn set(name: &str, value: &str) -> core_pb::HeaderValueOption {
    set_bytes(name, value.as_bytes())
}

pub(crate) fn set_bytes(name: &str, value: &[u8]) -> core_pb::HeaderValueOption {
    core_pb::HeaderValueOption {
        header: Some(core_pb::HeaderValue {
            key: name.to_owned(),
            raw_value: value.to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A header's value as the gateway sent it (`raw_value`, else `value`).
pub(crate) fn header(map: &core_pb::HeaderMap, name: &str) -> Option<Vec<u8>> {
    map.headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| raw(h).to_vec())
}

pub(crate) fn raw(h: &core_pb::HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The request's method, path and headers (pseudo-headers out of the map).
pub(crate) fn head_of(map: core_pb::HeaderMap) -> Head {
    let mut head = Head {
        method: Method::POST,
        path: "/".to_owned(),
        headers: HeaderMap::with_capacity(map.headers.len()),
    };
    for h in &map.headers {
        let value = raw(h);
        match h.key.as_str() {
            ":method" => {
                if let Ok(m) = Method::from_bytes(value) {
                    head.method = m;
                }
            }
            ":path" => head.path = String::from_utf8_lossy(value).into_owned(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(v)) = (
                    HeaderName::from_bytes(k.as_bytes()),
                    HeaderValue::from_bytes(value),
                ) {
                    head.headers.append(name, v);
                }
            }
        }
    }
    head
}

/// The first of `names` the request carries, as text.
pub(crate) fn first(headers: &HeaderMap, names: &[&str]) -> Option<String> {
    names
        .iter()
        .find_map(|n| headers.get(*n)?.to_str().ok())
        .map(str::to_owned)
}

/// The chosen endpoint as the gateway dials it: the worker URL's `host:port`.
pub fn endpoint_of(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let authority = uri.authority()?;
    if authority.port().is_some() {
        return Some(authority.as_str().rsplit('@').next()?.to_owned());
    }
    let port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    Some(format!("{}:{port}", authority.host()))
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": endpoint}}`.
pub(crate) fn destination_metadata(endpoint: &str) -> prost_types::Struct {
    let inner = prost_types::Struct {
        fields: [(
            DESTINATION_HEADER.to_owned(),
            prost_types::Value {
                kind: Some(Kind::StringValue(endpoint.to_owned())),
            },
        )]
        .into(),
    };
    prost_types::Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            prost_types::Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// The gateway's subset hint: a list of `ip:port` (or one comma-separated string).
pub(crate) fn subset_hint(metadata: &core_pb::Metadata) -> Option<Vec<String>> {
    let hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match value.kind.as_ref()? {
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    out.push(s.trim().to_owned());
                }
            }
        }
        Kind::StringValue(s) => out.extend(s.split(',').map(|e| e.trim().to_owned())),
        _ => return None,
    }
    Some(out)
}

/// The body with `model` set to `target`, and the model it named (`(sent, target)`).
pub(crate) fn rewrite_model(
    body: &Bytes,
    target: &str,
) -> Result<(Bytes, Option<(String, String)>), GatewayError> {
    let mut value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(GatewayError::InvalidJson)?;
    let sent = value
        .get("model")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_owned();
    value.insert("model".to_owned(), serde_json::Value::from(target));
    let rewritten = serde_json::to_vec(&value).map_err(GatewayError::InvalidJson)?;
    Ok((Bytes::from(rewritten), Some((sent, target.to_owned()))))
}

/// A response chunk with the served model's name given back as the client sent it.
pub(crate) fn rename_model(chunk: &[u8], served: &str, sent: &str) -> Vec<u8> {
    let mut out = chunk.to_vec();
    for (from, to) in [
        (
            format!("\"model\":{}", json_str(served)),
            format!("\"model\":{}", json_str(sent)),
        ),
        (
            format!("\"model\": {}", json_str(served)),
            format!("\"model\": {}", json_str(sent)),
        ),
    ] {
        out = replace_all(&out, from.as_bytes(), to.as_bytes());
    }
    out
}

fn json_str(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

fn replace_all(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut rest = haystack;
    while let Some(at) = memchr::memmem::find(rest, from) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(to);
        rest = &rest[at + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn endpoints_are_host_and_port() {
        assert_eq!(
            endpoint_of("http://10.0.0.1:8000").as_deref(),
            Some("10.0.0.1:8000")
        );
        assert_eq!(
            endpoint_of("http://10.0.0.1").as_deref(),
            Some("10.0.0.1:80")
        );
        assert_eq!(
            endpoint_of("https://engine.local").as_deref(),
            Some("engine.local:443")
        );
        assert_eq!(
            endpoint_of("http://[fd00::1]:8000/v1").as_deref(),
            Some("[fd00::1]:8000")
        );
        assert_eq!(endpoint_of("not a url"), None);
    }

    #[test]
    fn bodies_go_back_in_pieces_of_at_most_62000_bytes() {
        let body = Bytes::from(vec![b'x'; 150_001]);
        let pieces = streamed(body, processing_response::Response::RequestBody);
        let sizes: Vec<(usize, bool)> = pieces
            .iter()
            .map(|p| match &p.response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match b.response.as_ref().and_then(|r| r.body_mutation.as_ref()) {
                        Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                        }) => (s.body.len(), s.end_of_stream),
                        other => panic!("not a streamed body: {other:?}"),
                    }
                }
                other => panic!("not a request body answer: {other:?}"),
            })
            .collect();
        assert_eq!(
            sizes,
            vec![(62_000, false), (62_000, false), (26_001, true)]
        );
        let empty = streamed(Bytes::new(), processing_response::Response::RequestBody);
        assert_eq!(empty.len(), 1, "an empty body is one last piece");
    }

    #[test]
    fn the_model_is_rewritten_and_named_back() {
        let (body, rewrite) =
            rewrite_model(&Bytes::from_static(br#"{"model":"chat","x":1}"#), "llama-3").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["model"], "llama-3");
        assert_eq!(v["x"], 1);
        assert_eq!(rewrite, Some(("chat".to_owned(), "llama-3".to_owned())));
        let back = rename_model(br#"data: {"id":"1","model":"llama-3"}"#, "llama-3", "chat");
        assert_eq!(back, br#"data: {"id":"1","model":"chat"}"#.to_vec());
        assert!(rewrite_model(&Bytes::from_static(b"[1]"), "m").is_err());
    }

    #[test]
    fn the_subset_hint_reads_a_list_or_a_string() {
        let list = prost_types::Value {
            kind: Some(Kind::ListValue(prost_types::ListValue {
                values: vec![prost_types::Value {
                    kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
                }],
            })),
        };
        let metadata = |v: prost_types::Value| core_pb::Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_owned(),
                prost_types::Struct {
                    fields: [(SUBSET_KEY.to_owned(), v)].into(),
                },
            )]),
            ..Default::default()
        };
        assert_eq!(
            subset_hint(&metadata(list)),
            Some(vec!["10.0.0.1:8000".to_owned()])
        );
        let text = prost_types::Value {
            kind: Some(Kind::StringValue("a:1, b:2".into())),
        };
        assert_eq!(
            subset_hint(&metadata(text)),
            Some(vec!["a:1".to_owned(), "b:2".to_owned()])
        );
        assert_eq!(subset_hint(&core_pb::Metadata::default()), None);
    }

    #[test]
    fn the_head_keeps_the_path_and_the_raw_values() {
        let map = core_pb::HeaderMap {
            headers: vec![
                core_pb::HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/chat/completions".to_vec(),
                    ..Default::default()
                },
                core_pb::HeaderValue {
                    key: ":method".into(),
                    value: "GET".into(),
                    ..Default::default()
                },
                core_pb::HeaderValue {
                    key: "x-kvroute-worker".into(),
                    raw_value: b"a".to_vec(),
                    ..Default::default()
                },
            ],
        };
        let head = head_of(map);
        assert_eq!(head.path, "/v1/chat/completions");
        assert_eq!(head.method, Method::GET);
        assert_eq!(head.headers["x-kvroute-worker"], "a");
    }
}
