//! The routing policies and the trait they share.
//!
//! | policy | choice |
//! |---|---|
//! | `random` | uniform over the candidates |
//! | `round_robin` | the next candidate in turn (one counter per policy instance) |
//! | `power_of_two` | two distinct random candidates; the one with fewer requests in flight |
//! | `consistent_hash` | a ring of 160 virtual nodes per worker; the key is the session key, else the prompt text |
//! | `rendezvous_hash` | the candidate with the highest `mix64(hash(key), hash(worker))`, same key |
//! | `prefix_hash` | the first `prefix_token_count` characters of the prompt on the ring; a target loaded above `load_factor` x the mean goes to the least-loaded candidate |
//! | `manual` | a sticky map from session key to worker; new keys and keyless requests go to the least-loaded candidate |
//! | `cache_aware` | SGLang's approximate radix tree over request text (see [`CacheAware`]) |
//! | `llm_d` | llm-d's weighted scorers: prefix cache, queue, KV utilisation (see [`LlmD`]) |
//! | `kv_aware` | Dynamo's cost over KV overlap and load (see [`KvAware`]) |
//! | `least_load` | smg's: the shortest expected wait from the engines' reported load (see [`LeastLoad`]) |
//! | `passthrough` | smg's: the first eligible candidate, for a gateway in front of one engine |
//!
//! "Least loaded" always breaks ties at random, so keyless serial traffic (every load zero)
//! spreads instead of piling onto the first worker.

mod cache_aware;
mod hashing;
mod kv_aware;
mod least_load;
mod llm_d;
mod load;
mod manual;
pub mod predict;
#[cfg(test)]
mod snapshot_tests;

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rand::RngCore;

use crate::{Candidate, Decision, RouteRequest};

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use hashing::{ConsistentHash, PrefixHash, RendezvousHash};
pub use kv_aware::{
    sample_ranks, sample_size, Cluster, CostModel, KvAware, KvAwareConfig, MemoryCost, PromptTerms,
    AUTO_SAMPLE_FROM_RANKS, AUTO_SAMPLE_RANKS, DEFAULT_OWN_DECODE_WEIGHT, SPEED_EVIDENCE,
    SPEED_NOISE,
};
pub use least_load::{LeastLoad, LeastLoadConfig, Passthrough};
pub use llm_d::{LlmD, LlmDConfig, PrefixSource};
pub(crate) use load::least_at_random;
pub use load::{PowerOfTwo, Random, RoundRobin};
pub use manual::{AssignmentMode, Manual};

/// A routing policy. Implementations are cheap to call concurrently: any state they keep
/// is behind atomics or a short, never-awaited lock.
pub trait Policy: Send + Sync + fmt::Debug {
    fn kind(&self) -> PolicyKind;

    /// Whether its candidates need the KV index's overlap (`Candidate::kv`): kv_aware's do,
    /// and llm_d's with the exact prefix source.
    fn reads_kv_index(&self) -> bool {
        self.kind() == PolicyKind::KvAware
    }

    /// Chooses one of `candidates`, or `None` when the slice is empty.
    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision>;

    /// As [`Policy::select`], given what [`Policy::costs`] returned for the same candidates
    /// and request: a policy that chooses by those costs need not compute them again.
    fn select_costed(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        _costs: Option<&[f64]>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        self.select(candidates, request, rng)
    }

    /// Each candidate's cost, for policies that score (`kv_aware`); `None` otherwise.
    fn costs(
        &self,
        _candidates: &[Candidate<'_>],
        _request: &RouteRequest<'_>,
    ) -> Option<Vec<f64>> {
        None
    }

    /// The costs that place a request with latency targets among the candidates predicted
    /// to meet them ([`crate::slo::choose`]): [`Policy::costs`] less any price of a
    /// candidate's speed, which the targets already judge, so that a loose target leaves the
    /// fast engines to the tight ones.
    fn target_costs(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
    ) -> Option<Vec<f64>> {
        self.costs(candidates, request)
    }

    /// The policy as `kv_aware`, for a caller that scores its candidates itself
    /// ([`KvAware::decides_on_load`]).
    fn kv_aware(&self) -> Option<&KvAware> {
        None
    }

    /// Periodic upkeep (eviction), called by the gateway every second with the time.
    fn maintain(&self, _now: std::time::Instant) {}

    /// A worker left the pool: forget what the policy keeps about it.
    fn forget_worker(&self, _worker: &kvroute_protocol::WorkerId) {}

    /// Another router replica sent `request` to (`worker`, `dp_rank`): learn what `select`
    /// would have learnt had it been chosen here (replica sync). Of `request`, only
    /// `session_key`, `text`, `tokens`, `prompt_tokens`, `block_size` and `now` are set.
    fn observe(
        &self,
        _worker: &kvroute_protocol::WorkerId,
        _dp_rank: Option<u32>,
        _request: &RouteRequest<'_>,
    ) {
    }

    /// What the policy has learnt, as of `now`, as observations that rebuild it when
    /// replayed in order through [`Policy::restore`] (a starting replica's snapshot): the
    /// most recent ones whose [`Observed::bytes`] fit in `max_bytes`, oldest first.
    /// Policies without learnt state give none.
    fn snapshot(&self, _now: std::time::Instant, _max_bytes: usize) -> Vec<Observation> {
        Vec::new()
    }

    /// Learns `observations` (from a peer's [`Policy::snapshot`]) as of `now`, in order.
    fn restore(&self, _observations: &[Observation], _now: std::time::Instant) {}
}

/// One thing a policy learnt about a (worker, rank), in a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub worker: kvroute_protocol::WorkerId,
    pub dp_rank: Option<u32>,
    /// How long before the snapshot it was last used.
    pub age: Duration,
    pub learnt: Observed,
}

impl Observation {
    /// When it was last used, for a snapshot taken at `now` (`now` itself where the clock
    /// does not reach that far back).
    pub fn at(&self, now: Instant) -> Instant {
        now.checked_sub(self.age).unwrap_or(now)
    }
}

/// What was learnt.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// `cache_aware`: a text the rank was sent.
    Text(String),
    /// `llm_d`: block hashes the rank holds, least recent first.
    Blocks(Vec<u64>),
    /// `manual` (and session affinity): a session key bound to the rank.
    Session(String),
}

impl Observed {
    /// The payload's size, for snapshot budgets.
    pub fn bytes(&self) -> usize {
        match self {
            Observed::Text(t) | Observed::Session(t) => t.len(),
            Observed::Blocks(b) => b.len() * 8,
        }
    }
}

/// The decode half's policy of a disaggregated cluster and its parameters: the one named,
/// with `base`'s parameters; by default `kv_aware` scoring load only (overlap credit 0, as
/// Dynamo's decode half, and no prefill-interference term: a decode engine receives the
/// prompt's KV and computes none of it).
pub fn decode_policy(named: Option<PolicyKind>, base: &PolicyConfig) -> (PolicyKind, PolicyConfig) {
    let mut config = base.clone();
    if named.is_none() {
        config.kv_aware.overlap_score_credit = 0.0;
        config.kv_aware.prefill_interference_weight = 0.0;
    }
    (named.unwrap_or(PolicyKind::KvAware), config)
}

/// Every policy name kvroute accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Random,
    RoundRobin,
    PowerOfTwo,
    ConsistentHash,
    RendezvousHash,
    PrefixHash,
    Manual,
    CacheAware,
    LlmD,
    KvAware,
    LeastLoad,
    Passthrough,
}

impl PolicyKind {
    /// Whether the policy reads the prompt's text for a request with this session key (the
    /// hashing policies key on the session when there is one).
    pub fn needs_text(self, session_key: Option<&str>) -> bool {
        use PolicyKind::*;
        match self {
            ConsistentHash | RendezvousHash => session_key.is_none(),
            PrefixHash | CacheAware => true,
            Random | RoundRobin | PowerOfTwo | Manual | LlmD | KvAware | LeastLoad
            | Passthrough => false,
        }
    }

    pub const ALL: [PolicyKind; 12] = [
        PolicyKind::Random,
        PolicyKind::RoundRobin,
        PolicyKind::PowerOfTwo,
        PolicyKind::ConsistentHash,
        PolicyKind::RendezvousHash,
        PolicyKind::PrefixHash,
        PolicyKind::Manual,
        PolicyKind::CacheAware,
        PolicyKind::LlmD,
        PolicyKind::KvAware,
        PolicyKind::LeastLoad,
        PolicyKind::Passthrough,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::RendezvousHash => "rendezvous_hash",
            PolicyKind::PrefixHash => "prefix_hash",
            PolicyKind::Manual => "manual",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::LlmD => "llm_d",
            PolicyKind::KvAware => "kv_aware",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::Passthrough => "passthrough",
        }
    }

    /// The valid names, comma-separated, for error messages.
    pub fn valid_names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown policy '{}'; valid policies: {}",
            self.0,
            PolicyKind::valid_names()
        )
    }
}

impl std::error::Error for UnknownPolicy {}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // `consistent_hashing` is SGLang's spelling of the same policy; vllm-router's
        // `sticky_least_loaded` (sticky sessions, new ones to the least loaded) is `manual`.
        let s = match s {
            "consistent_hashing" => "consistent_hash",
            "sticky_least_loaded" => "manual",
            s => s,
        };
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// The parameters of every policy; each policy reads its own.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Virtual nodes per worker on the hash ring (`consistent_hash`, `prefix_hash`).
    pub virtual_nodes: u32,
    /// Characters of the prompt `prefix_hash` keys on.
    pub prefix_token_count: usize,
    /// `prefix_hash` leaves its target when its load exceeds this multiple of the mean.
    pub prefix_hash_load_factor: f64,
    /// `manual` forgets a session key idle this long.
    pub max_idle: Duration,
    /// `manual` keeps at most this many session keys.
    pub max_sessions: usize,
    /// How `manual` places a new session key.
    pub assignment_mode: AssignmentMode,
    /// `kv_aware`'s cost model.
    pub kv_aware: KvAwareConfig,
    pub cache_aware: CacheAwareConfig,
    pub llm_d: LlmDConfig,
    pub least_load: LeastLoadConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            virtual_nodes: 160,
            prefix_token_count: 256,
            prefix_hash_load_factor: 1.25,
            max_idle: Duration::from_secs(4 * 3600),
            max_sessions: 1 << 20,
            assignment_mode: AssignmentMode::MinLoad,
            kv_aware: KvAwareConfig::default(),
            cache_aware: CacheAwareConfig::default(),
            llm_d: LlmDConfig::default(),
            least_load: LeastLoadConfig::default(),
        }
    }
}

/// Builds a fresh policy instance (with its own state) of `kind`.
pub fn build_policy(kind: PolicyKind, config: &PolicyConfig) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Random => Box::new(Random),
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo),
        PolicyKind::ConsistentHash => Box::new(ConsistentHash::new(config.virtual_nodes)),
        PolicyKind::RendezvousHash => Box::new(RendezvousHash),
        PolicyKind::PrefixHash => Box::new(PrefixHash::new(
            config.virtual_nodes,
            config.prefix_token_count,
            config.prefix_hash_load_factor,
        )),
        PolicyKind::Manual => Box::new(Manual::new(
            config.max_idle,
            config.max_sessions,
            config.assignment_mode,
        )),
        PolicyKind::KvAware => Box::new(KvAware::new(config.kv_aware.clone())),
        PolicyKind::CacheAware => Box::new(CacheAware::new(config.cache_aware.clone())),
        PolicyKind::LlmD => Box::new(LlmD::new(config.llm_d.clone())),
        PolicyKind::LeastLoad => Box::new(LeastLoad::new(config.least_load.clone())),
        PolicyKind::Passthrough => Box::new(Passthrough),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use std::time::Instant;

    use kvroute_protocol::WorkerId;

    use crate::{Candidate, RouteRequest};

    pub fn ids(n: usize) -> Vec<WorkerId> {
        (0..n)
            .map(|i| WorkerId::new(format!("http://w{i}:8000")))
            .collect()
    }

    pub fn cands<'a>(ids: &'a [WorkerId], loads: &[u64]) -> Vec<Candidate<'a>> {
        ids.iter()
            .zip(loads)
            .map(|(worker, &in_flight)| Candidate::new(worker, in_flight))
            .collect()
    }

    pub fn req<'a>(key: Option<&'a str>, text: &'a str, now: Instant) -> RouteRequest<'a> {
        RouteRequest::simple(key, text, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_lists_valid_names() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        assert_eq!(
            "consistent_hashing".parse::<PolicyKind>().unwrap(),
            PolicyKind::ConsistentHash
        );
        assert_eq!(
            "sticky_least_loaded".parse::<PolicyKind>().unwrap(),
            PolicyKind::Manual
        );
        let err = "nope".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(err.contains("'nope'"), "{err}");
        for k in PolicyKind::ALL {
            assert!(err.contains(k.name()), "{err}");
        }
    }

    #[test]
    fn every_policy_returns_none_on_no_candidates() {
        let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(1);
        let r = test_support::req(Some("k"), "t", std::time::Instant::now());
        for k in PolicyKind::ALL {
            let p = build_policy(k, &PolicyConfig::default());
            assert_eq!(p.kind(), k);
            assert!(p.select(&[], &r, &mut rng).is_none(), "{k}");
        }
    }
}
