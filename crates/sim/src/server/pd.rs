//! Prefill/decode disaggregation: what an engine of each [`Role`] does with the fields a P/D
//! router adds to a request, in the two protocols routers speak.
//!
//! **vLLM (NIXL connector).** The router sends the prompt to a prefill engine with
//! `max_tokens: 1`, `stream: false` and `"kv_transfer_params": {"do_remote_decode": true}`.
//! A `prefill` engine computes it as usual (its blocks cached, its KV events published) and
//! answers the usual body plus a top-level `kv_transfer_params` in the shape of vLLM's
//! `NixlConnector.request_finished` ([`transfer_params`]): `do_remote_prefill: true`, the
//! blocks that hold the prompt, its engine id and side-channel address, and
//! `remote_prefill_cached_tokens` (its prefix-cache hit, as vLLM 0.31 sends). The router then
//! sends the original request with that object to a decode engine. A `decode` engine seeing
//! `do_remote_prefill: true` receives the prompt's KV instead of computing it (see
//! [`crate::engine`]: the tokens its own prefix cache lacks cross the link in
//! `tokens x kv_bytes_per_token x 8 / (kv_transfer_gbps x 1e9) / speedup` seconds), caches and
//! publishes the blocks, and decodes `max_tokens` tokens.
//!
//! **SGLang (bootstrap).** The router adds `bootstrap_host`, `bootstrap_port` and a random
//! integer `bootstrap_room` and sends the request to a prefill and a decode engine at once.
//! The `prefill` engine computes the prompt and answers with one token (as SGLang's prefill
//! server does); when it serves `--bootstrap-port` it also completes the room there (see
//! [`super::bootstrap`]). The `decode` engine asks `bootstrap_host:bootstrap_port` for the
//! room and waits until its prefill is done (an error if that prefill failed); when nothing
//! answers the protocol there it does not wait. Then it receives the KV as above.
//!
//! **Reported `cached_tokens` on a decode engine**: the prefill engine's prefix-cache hit
//! when it is known (`remote_prefill_cached_tokens`, or the room's answer), as vLLM 0.31
//! reports it (vLLM PR #54222), clamped to the prompt; otherwise, for vLLM's protocol, the
//! whole prompt, as earlier vLLM counts every received token as cached (vLLM issues #43370,
//! #47136); for the bootstrap protocol, the decode engine's own prefix-cache hit.
//!
//! A `both` engine ignores every disaggregation field; a `prefill` engine serves a request
//! without them normally; a `decode` engine computes the prompt of a request without them
//! (the decode-only path of conditional disaggregation).
//!
//! Simplified: no KV moves; a prefill engine frees its blocks when its answer is done (vLLM
//! keeps them until the decode engine has read them; here they stay cached until evicted);
//! `kv_transfer_params` comes only with non-streaming answers, as in vLLM.

use serde::Deserialize;
use serde_json::{json, Value};

use super::bootstrap::{self, RoomGuard, RoomOutcome};
use super::error::ApiError;
use super::metrics::TransferCounters;
use super::AppState;
use crate::config::Role;
use crate::engine::PromptKv;

/// The disaggregation fields of a completion or chat request.
#[derive(Debug, Default, Deserialize)]
pub struct DisaggFields {
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
    #[serde(default)]
    pub bootstrap_host: Option<String>,
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    #[serde(default)]
    pub bootstrap_room: Option<u64>,
}

/// The fields of vLLM's `kv_transfer_params` the engines read; the others are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: Option<bool>,
    #[serde(default)]
    pub do_remote_prefill: Option<bool>,
    /// Read only when an integer, as vLLM does.
    #[serde(default)]
    pub remote_prefill_cached_tokens: Option<Value>,
}

/// What an engine does with a request, by its role and the request's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Compute it as an aggregated engine.
    Local,
    /// Compute it and answer with `kv_transfer_params` (when not streaming).
    PrefillForDecode,
    /// Compute its prompt and one token, then complete its bootstrap room.
    PrefillForRoom(u64),
    /// Receive its prompt's KV, named by `kv_transfer_params`.
    DecodeTransferred {
        /// `remote_prefill_cached_tokens`, when given.
        prefill_cached_tokens: Option<u64>,
    },
    /// Wait for its bootstrap room's prefill (where one answers), then receive its KV.
    DecodeRoom {
        host: Option<String>,
        port: Option<u16>,
        room: u64,
    },
}

/// Decides what `role` does with a request carrying `fields`: vLLM's fields take
/// precedence over SGLang's.
pub fn plan(role: Role, fields: &DisaggFields) -> Plan {
    let params = fields.kv_transfer_params.as_ref();
    match role {
        Role::Both => Plan::Local,
        Role::Prefill => {
            if params.and_then(|p| p.do_remote_decode) == Some(true) {
                Plan::PrefillForDecode
            } else if let Some(room) = fields.bootstrap_room {
                Plan::PrefillForRoom(room)
            } else {
                Plan::Local
            }
        }
        Role::Decode => {
            if let Some(p) = params.filter(|p| p.do_remote_prefill == Some(true)) {
                Plan::DecodeTransferred {
                    prefill_cached_tokens: p
                        .remote_prefill_cached_tokens
                        .as_ref()
                        .and_then(|v| v.as_i64())
                        .map(|n| n.max(0) as u64),
                }
            } else if let Some(room) = fields.bootstrap_room {
                Plan::DecodeRoom {
                    host: fields.bootstrap_host.clone(),
                    port: fields.bootstrap_port,
                    room,
                }
            } else {
                Plan::Local
            }
        }
    }
}

/// Where a prefill engine says its KV can be read from (vLLM's NIXL side channel; here the
/// bootstrap port when served, else the HTTP port).
#[derive(Debug, Clone)]
pub struct SideChannel {
    /// vLLM's `engine_id` of the data-parallel rank.
    pub engine_id: String,
    pub host: String,
    pub port: u16,
}

/// The `kv_transfer_params` a prefill engine answers, as vLLM's `NixlConnector` builds them
/// (plus `remote_prefill_cached_tokens`, as vLLM 0.31 adds).
pub fn transfer_params(
    side: &SideChannel,
    request_id: &str,
    blocks: &[u32],
    cached_tokens: usize,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks,
        "remote_engine_id": side.engine_id,
        "remote_request_id": request_id,
        "remote_host": side.host,
        "remote_port": side.port,
        "tp_size": 1,
        "remote_prefill_cached_tokens": cached_tokens,
    })
}

/// A prefill served for a decode engine: counted, and its room completed, when its last
/// token is out; if dropped before, its room fails.
#[derive(Debug)]
pub struct RemotePrefill {
    pub room: Option<RoomGuard>,
    pub sent: TransferCounters,
}

impl RemotePrefill {
    pub fn done(self, prompt_tokens: usize, cached_tokens: usize) {
        self.sent.count(prompt_tokens);
        if let Some(room) = self.room {
            room.ready(prompt_tokens, cached_tokens);
        }
    }
}

/// The `cached_tokens` an engine reports (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachedTokens {
    /// Its own prefix-cache hit.
    Local,
    /// Known from the prefill engine, or the whole prompt.
    Exactly(usize),
}

impl CachedTokens {
    /// A decode engine's report, for a prompt of `prompt_tokens` received by transfer.
    fn for_decode(plan: &Plan, prefill_cached: Option<u64>, prompt_tokens: usize) -> Self {
        match (plan, prefill_cached) {
            (_, Some(n)) => Self::Exactly(n.min(prompt_tokens as u64) as usize),
            (Plan::DecodeTransferred { .. }, None) => Self::Exactly(prompt_tokens),
            _ => Self::Local,
        }
    }

    pub fn report(self, local: usize) -> usize {
        match self {
            Self::Local => local,
            Self::Exactly(n) => n,
        }
    }
}

/// How the server runs a request, once its plan is made (and, for a bootstrap decode, its
/// room's prefill has ended).
#[derive(Debug)]
pub struct Prepared {
    pub max_tokens: usize,
    pub prompt_kv: PromptKv,
    /// A prefill served for a decode engine.
    pub remote_prefill: Option<RemotePrefill>,
    /// Answer with `kv_transfer_params`.
    pub answer_params: bool,
    pub cached_tokens: CachedTokens,
}

impl AppState {
    /// Plans a request for `rank` and waits for what it needs first.
    pub(super) async fn prepare(
        &self,
        rank: usize,
        fields: &DisaggFields,
        stream: bool,
        max_tokens: usize,
        prompt_tokens: usize,
    ) -> Result<Prepared, ApiError> {
        let plan = plan(self.args.role, fields);
        let mut prepared = Prepared {
            max_tokens,
            prompt_kv: PromptKv::Compute,
            remote_prefill: None,
            answer_params: false,
            cached_tokens: CachedTokens::Local,
        };
        let sent = || self.sent[rank].clone();
        match &plan {
            Plan::Local => {}
            // Streaming answers carry no kv_transfer_params (as vLLM's): a plain request.
            Plan::PrefillForDecode if stream => {}
            Plan::PrefillForDecode => {
                prepared.answer_params = true;
                prepared.remote_prefill = Some(RemotePrefill {
                    room: None,
                    sent: sent(),
                });
            }
            &Plan::PrefillForRoom(room) => {
                // SGLang's prefill server answers with the first token only.
                prepared.max_tokens = 1;
                prepared.remote_prefill = Some(RemotePrefill {
                    room: Some(self.rooms.open(room)),
                    sent: sent(),
                });
            }
            &Plan::DecodeTransferred {
                prefill_cached_tokens,
            } => {
                prepared.prompt_kv = PromptKv::Transfer;
                prepared.cached_tokens =
                    CachedTokens::for_decode(&plan, prefill_cached_tokens, prompt_tokens);
            }
            Plan::DecodeRoom { host, port, room } => {
                let prefill = match (host, port) {
                    (Some(host), Some(port)) => tokio::select! {
                        waited = bootstrap::wait_for_room(host, *port, *room) => {
                            waited.map_err(|e| ApiError::unavailable(e.to_string()))?
                        }
                        // A graceful stop does not wait for rooms.
                        _ = self.stopping.cancelled() => {
                            return Err(ApiError::unavailable("engine stopped"));
                        }
                    },
                    _ => None,
                };
                let prefill_cached = match prefill {
                    Some(RoomOutcome::Ready { cached_tokens, .. }) => Some(cached_tokens as u64),
                    _ => None,
                };
                prepared.prompt_kv = PromptKv::Transfer;
                prepared.cached_tokens =
                    CachedTokens::for_decode(&plan, prefill_cached, prompt_tokens);
            }
        }
        Ok(prepared)
    }

    /// Where rank `rank` says its KV can be read from.
    pub(super) fn side_channel(&self, rank: usize) -> SideChannel {
        let port = self
            .args
            .bootstrap_port
            .unwrap_or_else(|| self.http_addr.get().map_or(self.args.port, |a| a.port()));
        SideChannel {
            engine_id: format!("{}_dp{rank}", self.args.instance_id),
            host: self.args.host.clone(),
            port,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(body: Value) -> DisaggFields {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn each_role_plans_by_the_fields_it_understands() {
        let nixl_p = fields(json!({"kv_transfer_params": {"do_remote_decode": true}}));
        let nixl_d = fields(json!({"kv_transfer_params": {
            "do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_prefill_cached_tokens": 32,
        }}));
        let room = fields(
            json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}),
        );
        let none = fields(json!({}));
        for f in [&nixl_p, &nixl_d, &room, &none] {
            assert_eq!(plan(Role::Both, f), Plan::Local);
        }
        assert_eq!(plan(Role::Prefill, &nixl_p), Plan::PrefillForDecode);
        assert_eq!(plan(Role::Prefill, &room), Plan::PrefillForRoom(7));
        assert_eq!(plan(Role::Prefill, &nixl_d), Plan::Local);
        assert_eq!(plan(Role::Prefill, &none), Plan::Local);
        assert_eq!(
            plan(Role::Decode, &nixl_d),
            Plan::DecodeTransferred {
                prefill_cached_tokens: Some(32)
            }
        );
        assert_eq!(
            plan(Role::Decode, &room),
            Plan::DecodeRoom {
                host: Some("10.0.0.1".into()),
                port: Some(8998),
                room: 7
            }
        );
        assert_eq!(plan(Role::Decode, &nixl_p), Plan::Local);
        assert_eq!(plan(Role::Decode, &none), Plan::Local);
        // Not an integer: ignored, as vLLM does; negative: 0.
        for (v, expected) in [
            (json!("32"), None),
            (json!(1.5), None),
            (json!(-5), Some(0)),
        ] {
            let f = fields(json!({"kv_transfer_params": {
                "do_remote_prefill": true, "remote_prefill_cached_tokens": v,
            }}));
            assert_eq!(
                plan(Role::Decode, &f),
                Plan::DecodeTransferred {
                    prefill_cached_tokens: expected
                }
            );
        }
        let explicit_false = fields(json!({"kv_transfer_params": {"do_remote_prefill": false}}));
        assert_eq!(plan(Role::Decode, &explicit_false), Plan::Local);
    }

    #[test]
    fn decode_engines_report_the_prefills_cache_hit_when_known() {
        let nixl = Plan::DecodeTransferred {
            prefill_cached_tokens: None,
        };
        let room = Plan::DecodeRoom {
            host: None,
            port: None,
            room: 1,
        };
        let report =
            |plan, prefill, local| CachedTokens::for_decode(plan, prefill, 100).report(local);
        assert_eq!(report(&nixl, Some(32), 16), 32);
        assert_eq!(report(&nixl, Some(9999), 16), 100, "clamped to the prompt");
        assert_eq!(report(&nixl, None, 16), 100, "earlier vLLM: all received");
        assert_eq!(report(&room, Some(48), 16), 48);
        assert_eq!(report(&room, None, 16), 16, "unknown: the local hit");
    }

    #[test]
    fn transfer_params_have_vllms_nixl_shape() {
        let side = SideChannel {
            engine_id: "sim_dp0".into(),
            host: "127.0.0.1".into(),
            port: 8100,
        };
        let p = transfer_params(&side, "cmpl-1", &[4, 5], 16);
        assert_eq!(
            p,
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [4, 5], "remote_engine_id": "sim_dp0",
                "remote_request_id": "cmpl-1", "remote_host": "127.0.0.1", "remote_port": 8100,
                "tp_size": 1, "remote_prefill_cached_tokens": 16,
            })
        );
        // What a decode engine reads back from it.
        let f: DisaggFields = serde_json::from_value(json!({"kv_transfer_params": p})).unwrap();
        assert_eq!(
            plan(Role::Decode, &f),
            Plan::DecodeTransferred {
                prefill_cached_tokens: Some(16)
            }
        );
    }
}
