//! The endpoint picker (`kvroute --epp`): the Gateway API Inference Extension's picker
//! behind an Envoy-class gateway, over Envoy's ext_proc v3.
//!
//! The gateway proxies; kvroute only decides. For each request the gateway opens one
//! `ExternalProcessor/Process` stream and sends the request's headers and body. kvroute
//! routes it through the proxy's own stages (admission, the router queue, [`crate::forward`]'s
//! pick, with every policy, hint and threshold), then answers with the chosen endpoint's
//! `ip:port` in `x-gateway-destination-endpoint` (and in the dynamic metadata under
//! `envoy.lb`), and the body back. The response then flows through the same stream: its
//! first body chunk ends the request's prefill, its end (or the stream's) releases it.
//! See [`exchange`] for the messages, in order, and [`serve`] for the listeners.
//!
//! It does not proxy, retry, migrate a stream or split P/D halves: the gateway owns the
//! connection to the model server.

pub mod exchange;
pub mod health;
pub mod serve;
pub mod wire;

/// Envoy's ext_proc v3 types and service, compiled from `proto/` by `build.rs`.
#[allow(clippy::all, missing_docs, missing_debug_implementations)]
pub mod pb {
    pub mod envoy {
        pub mod annotations {}
        pub mod config {
            pub mod core {
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
        pub mod extensions {
            pub mod filters {
                pub mod http {
                    pub mod ext_proc {
                        pub mod v3 {
                            tonic::include_proto!("envoy.extensions.filters.http.ext_proc.v3");
                        }
                    }
                }
            }
        }
        pub mod service {
            pub mod ext_proc {
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ext_proc.v3");
                }
            }
        }
        pub mod r#type {
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.v3");
            }
        }
    }
    pub mod xds {
        pub mod annotations {
            pub mod v3 {
                tonic::include_proto!("xds.annotations.v3");
            }
        }
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("xds.core.v3");
            }
        }
    }
    pub mod udpa {
        pub mod annotations {
            tonic::include_proto!("udpa.annotations");
        }
    }
    pub mod validate {
        tonic::include_proto!("validate");
    }

    pub use envoy::config::core::v3 as core;
    pub use envoy::extensions::filters::http::ext_proc::v3 as mode;
    pub use envoy::service::ext_proc::v3 as ext_proc;
}

/// The header naming the chosen endpoint, `ip:port`, to the gateway.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace the destination also goes under.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The gateway's subset hint: the metadata namespace and its key.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
