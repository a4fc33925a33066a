//! The inputs and output of a routing decision.

use std::time::Instant;

use kvroute_protocol::WorkerId;

/// One worker that may take the request, with the load the router has sent it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub worker: &'a WorkerId,
    /// Requests the router has in flight on this worker.
    pub in_flight: u64,
}

/// What policies may read about a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The session key (`x-session-id`, `x-smg-routing-key`, `x-user-id`, or the body's
    /// `user`), if the request has one.
    pub session_key: Option<&'a str>,
    /// The prompt text (see `RoutingFields::routing_text`).
    pub text: &'a str,
    pub now: Instant,
}

/// The chosen candidate, as an index into the slice given to `select`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub index: usize,
}
