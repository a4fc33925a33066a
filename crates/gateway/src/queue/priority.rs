//! A request's priority class and head start in the router queue. First match wins:
//!
//! | # | the request carries | its priority class |
//! |---|---|---|
//! | 1 | `x-smg-priority` (with `--priority-scheduler-enabled`) | that class (unknown: `default`), clamped to its tenant's `max_class` |
//! | 2 | Dynamo's `x-dynamo-request-strict-priority`, else `nvext.agent_hints.strict_priority` | 0 `default`, 1 `interactive`, 2 or more `system`; clamped likewise |
//! | 3 | nothing of the above | `default`, clamped likewise (so `bulk` for a tenant whose `max_class` is `bulk`) |
//!
//! Without `--priority-scheduler-enabled` the header is ignored and nothing is clamped
//! (Dynamo's router has no tenants). Dynamo's `x-dynamo-request-priority`, else
//! `nvext.agent_hints.priority` (or its old name `latency_sensitivity`), when positive, is a
//! head start in seconds within the class. Dynamo's headers override its body hints, as in
//! Dynamo.

use std::time::Duration;

use http::HeaderMap;
use kvroute_protocol::NvExt;

use crate::config::{PriorityClass, PrioritySettings};

/// smg's priority header.
pub const PRIORITY_HEADER: &str = "x-smg-priority";

/// Where a request stands in the router queue, besides its policy class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standing {
    pub class: PriorityClass,
    /// Counts as having arrived this much earlier, within its tenant and class.
    pub head_start: Duration,
}

impl Default for Standing {
    fn default() -> Self {
        Standing {
            class: PriorityClass::Default,
            head_start: Duration::ZERO,
        }
    }
}

/// Dynamo's strict tier as one of smg's classes.
fn strict_class(tier: u32) -> PriorityClass {
    match tier {
        0 => PriorityClass::Default,
        1 => PriorityClass::Interactive,
        _ => PriorityClass::System,
    }
}

/// The standing of a request of `tenant` with `headers` and `nvext` (see the module docs).
pub fn standing(
    priority: Option<&PrioritySettings>,
    headers: &HeaderMap,
    nvext: Option<&NvExt>,
    tenant: &str,
) -> Standing {
    let hints = nvext.and_then(|n| n.agent_hints.as_ref());
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let soft = header("x-dynamo-request-priority")
        .and_then(|v| v.parse::<f64>().ok())
        .or(hints.and_then(|h| h.priority));
    let head_start = soft
        .filter(|p| p.is_finite() && *p > 0.0)
        .map_or(Duration::ZERO, |p| Duration::from_secs_f64(p.min(1e9)));
    let strict = header("x-dynamo-request-strict-priority")
        .and_then(|v| v.parse::<u32>().ok())
        .or(hints.and_then(|h| h.strict_priority))
        .map(strict_class);
    let class = match priority {
        None => strict.unwrap_or(PriorityClass::Default),
        Some(p) => {
            let header = headers
                .get(PRIORITY_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(PriorityClass::from_header);
            let asked = header.or(strict).unwrap_or(PriorityClass::Default);
            asked.min(p.max_class_of(tenant))
        }
    };
    Standing { class, head_start }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kvroute_protocol::AgentHints;

    use super::*;
    use crate::config::ClassSettings;

    fn settings() -> PrioritySettings {
        PrioritySettings {
            classes: PriorityClass::TIERS.map(ClassSettings::default_for),
            max_class: HashMap::from([("auth:ops".to_owned(), PriorityClass::System)]),
            default_max_class: PriorityClass::Interactive,
        }
    }

    fn hints(strict: Option<u32>, priority: Option<f64>) -> NvExt {
        NvExt {
            agent_hints: Some(AgentHints {
                strict_priority: strict,
                priority,
                osl: None,
            }),
            ..NvExt::default()
        }
    }

    fn with_header(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(PRIORITY_HEADER, v.parse().unwrap());
        h
    }

    #[test]
    fn the_precedence_table_first_match_wins() {
        let p = settings();
        let none = HeaderMap::new();
        let of = |h: &HeaderMap, n: Option<&NvExt>, t: &str| standing(Some(&p), h, n, t).class;
        // 1: the header, over the hints; clamped.
        let strict2 = hints(Some(2), None);
        assert_eq!(
            of(&with_header("bulk"), Some(&strict2), "auth:ops"),
            PriorityClass::Bulk
        );
        assert_eq!(
            of(&with_header("SYSTEM"), None, "auth:ops"),
            PriorityClass::System
        );
        assert_eq!(
            of(&with_header("system"), None, "auth:x"),
            PriorityClass::Interactive
        );
        assert_eq!(
            of(&with_header("urgent"), None, "auth:x"),
            PriorityClass::Default
        );
        // 2: Dynamo's strict tier; clamped.
        assert_eq!(
            of(&none, Some(&hints(Some(0), None)), "auth:x"),
            PriorityClass::Default
        );
        assert_eq!(
            of(&none, Some(&hints(Some(1), None)), "auth:x"),
            PriorityClass::Interactive
        );
        assert_eq!(
            of(&none, Some(&strict2), "auth:x"),
            PriorityClass::Interactive
        );
        assert_eq!(of(&none, Some(&strict2), "auth:ops"), PriorityClass::System);
        // Dynamo's header overrides its body hint.
        let mut dynamo = HeaderMap::new();
        dynamo.insert("x-dynamo-request-strict-priority", "0".parse().unwrap());
        assert_eq!(
            of(&dynamo, Some(&strict2), "auth:ops"),
            PriorityClass::Default
        );
        // 3: the tenant's default.
        assert_eq!(of(&none, None, "auth:x"), PriorityClass::Default);
        let mut bulk_only = settings();
        bulk_only.default_max_class = PriorityClass::Bulk;
        assert_eq!(
            standing(Some(&bulk_only), &none, None, "t").class,
            PriorityClass::Bulk
        );
    }

    #[test]
    fn without_the_scheduler_only_dynamos_hints_count_unclamped() {
        let s = standing(
            None,
            &with_header("system"),
            Some(&hints(Some(7), Some(2.5))),
            "t",
        );
        assert_eq!(s.class, PriorityClass::System);
        assert_eq!(s.head_start, Duration::from_millis(2500));
        let s = standing(None, &with_header("system"), None, "t");
        assert_eq!(s, Standing::default());
        let mut dynamo = HeaderMap::new();
        dynamo.insert("x-dynamo-request-priority", "4".parse().unwrap());
        let s = standing(None, &dynamo, Some(&hints(None, Some(2.5))), "t");
        assert_eq!(s.head_start, Duration::from_secs(4));
        // A negative priority is no head start (Dynamo clamps it at zero in its queue).
        let s = standing(None, &HeaderMap::new(), Some(&hints(None, Some(-3.0))), "t");
        assert_eq!(s.head_start, Duration::ZERO);
    }
}
