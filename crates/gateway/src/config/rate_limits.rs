//! Per-tenant rate limits from smg's file (`--tenant-rate-limit-enabled`,
//! `--tenant-rate-limit-config FILE`), read and checked once at start.
//!
//! The file is smg's YAML as is:
//!
//! ```yaml
//! default_policy:                 # every tenant not listed below
//!   tokens_per_minute: 100000
//!   requests_per_minute: 600
//! tenants:
//!   - tenant_key: auth:team-a     # a canonical tenant key (docs/tenants.md)
//!     tokens_per_minute: 500000
//!     requests_per_minute: 3000
//!     model_rules:                # at most one matches a request: exact, else longest prefix
//!       - rule_id: big
//!         matcher: {type: prefix, value: llama-70b}
//!         tokens_per_minute: 50000
//!         requests_per_minute: 100
//! ```
//!
//! A bad file is an error naming the entry (`tenants[1] (auth:team-b): model_rules[0]
//! (big): ...`); `kvroute` exits 2 on it, as smg refuses to start.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One scope's limits: the per-minute figures (each a bucket's capacity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub tokens_per_minute: u32,
    pub requests_per_minute: u32,
}

/// A model rule, checked: its id (a bucket's name) and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRule {
    pub rule_id: String,
    pub limits: Limits,
}

/// One tenant's policy (or the default): its own limits and its model rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantPolicy {
    pub limits: Option<Limits>,
    exact: HashMap<String, ModelRule>,
    /// Longest prefix first.
    prefixes: Vec<(String, ModelRule)>,
}

impl TenantPolicy {
    /// The tenant's limits (always set once checked).
    pub fn limits(&self) -> Limits {
        self.limits.expect("a checked policy has limits")
    }

    /// The model rule named `id`.
    pub fn rule_by_id(&self, id: &str) -> Option<&ModelRule> {
        (self.exact.values())
            .chain(self.prefixes.iter().map(|(_, r)| r))
            .find(|r| r.rule_id == id)
    }

    /// The model rule for `model`, if one matches: the exact one, else the longest prefix.
    pub fn rule_for(&self, model: &str) -> Option<&ModelRule> {
        self.exact.get(model).or_else(|| {
            self.prefixes
                .iter()
                .find(|(p, _)| model.starts_with(p.as_str()))
                .map(|(_, r)| r)
        })
    }
}

/// The checked file: the default policy and each listed tenant's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitPolicy {
    pub default: TenantPolicy,
    pub tenants: HashMap<String, TenantPolicy>,
}

impl RateLimitPolicy {
    /// `tenant`'s policy: its own, else the default.
    pub fn policy_for(&self, tenant: &str) -> &TenantPolicy {
        self.tenants.get(tenant).unwrap_or(&self.default)
    }
}

/// Why the file cannot be used: the entry and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("--tenant-rate-limit-config {}: {entry}: {problem}", path.display())]
pub struct RateLimitFileError {
    pub path: PathBuf,
    /// `the file`, `default_policy`, `tenants[1] (auth:team-b)`, ... `model_rules[0] (big)`.
    pub entry: String,
    pub problem: String,
}

// The file's shape, smg's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    default_policy: PolicySpec,
    #[serde(default)]
    tenants: Vec<PolicySpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicySpec {
    #[serde(default)]
    tenant_key: Option<String>,
    tokens_per_minute: u32,
    requests_per_minute: u32,
    #[serde(default)]
    model_rules: Vec<RuleSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    rule_id: String,
    matcher: MatcherSpec,
    tokens_per_minute: u32,
    requests_per_minute: u32,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum MatcherSpec {
    Exact { value: String },
    Prefix { value: String },
}

/// What is wrong with an entry (the caller names the entry).
type Problem = (String, String);

fn problem(entry: &str, what: impl Into<String>) -> Problem {
    (entry.to_owned(), what.into())
}

/// Reads and checks the file at `path`; `header:` tenants need `trusted_header` (else no
/// request could ever be that tenant).
pub fn load(path: &Path, trusted_header: bool) -> Result<RateLimitPolicy, RateLimitFileError> {
    let error = |(entry, problem): Problem| RateLimitFileError {
        path: path.to_owned(),
        entry,
        problem,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| error(problem("the file", format!("cannot read it: {e}"))))?;
    parse(&text, trusted_header).map_err(error)
}

/// Parses and checks the file's text.
fn parse(text: &str, trusted_header: bool) -> Result<RateLimitPolicy, Problem> {
    let spec: FileSpec =
        serde_yaml_ng::from_str(text).map_err(|e| problem("the file", e.to_string()))?;
    if spec.default_policy.tenant_key.is_some() {
        return Err(problem("default_policy", "must not set tenant_key"));
    }
    let default = policy("default_policy", &spec.default_policy)?;
    let mut tenants = HashMap::new();
    for (i, t) in spec.tenants.iter().enumerate() {
        let key = t.tenant_key.as_deref().unwrap_or("");
        let entry = format!("tenants[{i}] ({key})");
        if key.trim().is_empty() {
            return Err(problem(&format!("tenants[{i}]"), "tenant_key is missing"));
        }
        if key.trim() != key {
            return Err(problem(&entry, "tenant_key has spaces around it"));
        }
        if !canonical(key) {
            return Err(problem(
                &entry,
                "tenant_key is not a canonical tenant key (auth:<id>, header:<id>, ip:<address> or anonymous)",
            ));
        }
        if key.starts_with("header:") && !trusted_header {
            return Err(problem(
                &entry,
                "a header: tenant needs --trust-tenant-header (no request could be this tenant)",
            ));
        }
        if tenants.insert(key.to_owned(), policy(&entry, t)?).is_some() {
            return Err(problem(&entry, "tenant_key is listed twice"));
        }
    }
    Ok(RateLimitPolicy { default, tenants })
}

/// A canonical tenant key, as kvroute (and smg) resolve them.
fn canonical(key: &str) -> bool {
    if key == "anonymous" {
        return true;
    }
    if let Some(id) = key.strip_prefix("auth:") {
        return !id.is_empty();
    }
    if let Some(id) = key.strip_prefix("header:") {
        return !id.is_empty() && id.bytes().all(|b| b == b'\t' || (0x20..=0x7e).contains(&b));
    }
    if let Some(addr) = key.strip_prefix("ip:") {
        return addr.parse::<IpAddr>().is_ok_and(|a| a.to_string() == addr);
    }
    false
}

fn limits(entry: &str, tpm: u32, rpm: u32) -> Result<Limits, Problem> {
    if tpm == 0 {
        return Err(problem(entry, "tokens_per_minute must be > 0"));
    }
    if rpm == 0 {
        return Err(problem(entry, "requests_per_minute must be > 0"));
    }
    Ok(Limits {
        tokens_per_minute: tpm,
        requests_per_minute: rpm,
    })
}

/// One policy, checked: positive limits, rule ids `[A-Za-z0-9._-]+` and unique, matcher
/// values non-empty, unpadded and not given twice.
fn policy(entry: &str, spec: &PolicySpec) -> Result<TenantPolicy, Problem> {
    let mut p = TenantPolicy {
        limits: Some(limits(
            entry,
            spec.tokens_per_minute,
            spec.requests_per_minute,
        )?),
        ..TenantPolicy::default()
    };
    let mut ids = HashSet::new();
    for (i, r) in spec.model_rules.iter().enumerate() {
        let entry = format!("{entry}: model_rules[{i}] ({})", r.rule_id);
        let id_ok = !r.rule_id.is_empty()
            && (r.rule_id.chars()).all(|c| c.is_ascii_alphanumeric() || ".-_".contains(c));
        if !id_ok {
            return Err(problem(&entry, "rule_id must match [A-Za-z0-9._-]+"));
        }
        if !ids.insert(r.rule_id.as_str()) {
            return Err(problem(&entry, "rule_id is given twice"));
        }
        let rule = ModelRule {
            rule_id: r.rule_id.clone(),
            limits: limits(&entry, r.tokens_per_minute, r.requests_per_minute)?,
        };
        let (MatcherSpec::Exact { value } | MatcherSpec::Prefix { value }) = &r.matcher;
        if value.trim().is_empty() {
            return Err(problem(&entry, "the matcher's value is empty"));
        }
        if value.trim() != value {
            return Err(problem(&entry, "the matcher's value has spaces around it"));
        }
        let twice = match &r.matcher {
            MatcherSpec::Exact { value } => p.exact.insert(value.clone(), rule).is_some(),
            MatcherSpec::Prefix { value } => {
                let twice = p.prefixes.iter().any(|(v, _)| v == value);
                p.prefixes.push((value.clone(), rule));
                twice
            }
        };
        if twice {
            return Err(problem(&entry, "another rule has the same matcher"));
        }
    }
    p.prefixes.sort_by_key(|(v, _)| std::cmp::Reverse(v.len()));
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT: &str = "default_policy: {tokens_per_minute: 1000, requests_per_minute: 60}\n";

    fn parsed(tenants: &str) -> Result<RateLimitPolicy, Problem> {
        parse(&format!("{DEFAULT}tenants:\n{tenants}"), false)
    }

    #[test]
    fn smgs_file_reads_and_rules_match_exact_then_longest_prefix() {
        let p = parsed(
            "  - tenant_key: auth:team-a\n    tokens_per_minute: 5000\n    requests_per_minute: 300\n    model_rules:\n      - {rule_id: short, matcher: {type: prefix, value: gpt-}, tokens_per_minute: 10, requests_per_minute: 1}\n      - {rule_id: long, matcher: {type: prefix, value: gpt-4-}, tokens_per_minute: 10, requests_per_minute: 1}\n      - {rule_id: exact, matcher: {type: exact, value: gpt-4-turbo}, tokens_per_minute: 10, requests_per_minute: 1}\n",
        )
        .unwrap();
        assert_eq!(p.policy_for("anonymous").limits().tokens_per_minute, 1000);
        let a = p.policy_for("auth:team-a");
        assert_eq!(a.limits().requests_per_minute, 300);
        assert_eq!(a.rule_for("gpt-4-turbo").unwrap().rule_id, "exact");
        assert_eq!(a.rule_for("gpt-4-mini").unwrap().rule_id, "long");
        assert_eq!(a.rule_for("gpt-3").unwrap().rule_id, "short");
        assert!(a.rule_for("llama").is_none());
    }

    #[test]
    fn a_bad_entry_is_named() {
        let rule = |m: &str, id: &str| {
            format!("  - tenant_key: auth:a\n    tokens_per_minute: 1\n    requests_per_minute: 1\n    model_rules:\n      - {{rule_id: {id}, matcher: {m}, tokens_per_minute: 1, requests_per_minute: 1}}\n")
        };
        let cases = [
            (
                "  - tenant_key: auth:a\n    tokens_per_minute: 0\n    requests_per_minute: 1\n"
                    .to_owned(),
                "tenants[0] (auth:a)",
                "tokens_per_minute",
            ),
            (
                "  - tokens_per_minute: 1\n    requests_per_minute: 1\n".to_owned(),
                "tenants[0]",
                "missing",
            ),
            (
                "  - {tenant_key: team-a, tokens_per_minute: 1, requests_per_minute: 1}\n"
                    .to_owned(),
                "tenants[0] (team-a)",
                "canonical",
            ),
            (
                "  - {tenant_key: header:x, tokens_per_minute: 1, requests_per_minute: 1}\n"
                    .to_owned(),
                "tenants[0] (header:x)",
                "--trust-tenant-header",
            ),
            (
                "  - {tenant_key: auth:a, tokens_per_minute: 1, requests_per_minute: 1}\n  - {tenant_key: auth:a, tokens_per_minute: 1, requests_per_minute: 1}\n".to_owned(),
                "tenants[1] (auth:a)",
                "twice",
            ),
            (
                rule("{type: exact, value: ''}", "r"),
                "tenants[0] (auth:a): model_rules[0] (r)",
                "empty",
            ),
            (
                rule("{type: exact, value: m}", "bad/id"),
                "model_rules[0] (bad/id)",
                "rule_id",
            ),
            (
                rule("{type: regex, value: m}", "r"),
                "the file",
                "regex",
            ),
            (
                "  - {tenant_key: ip:01.2.3.4, tokens_per_minute: 1, requests_per_minute: 1}\n"
                    .to_owned(),
                "tenants[0] (ip:01.2.3.4)",
                "canonical",
            ),
        ];
        for (tenants, entry, why) in cases {
            let (e, p) = parsed(&tenants).unwrap_err();
            assert!(
                e.contains(entry) && (e.contains(why) || p.contains(why)),
                "{tenants}: {e}: {p}"
            );
        }
        let (e, p) = parse(
            "default_policy: {tenant_key: auth:a, tokens_per_minute: 1, requests_per_minute: 1}",
            false,
        )
        .unwrap_err();
        assert_eq!(
            (e.as_str(), p.as_str()),
            ("default_policy", "must not set tenant_key")
        );
        // A misspelt key is refused, not ignored.
        assert!(parse(&format!("{DEFAULT}tenant: []\n"), false).is_err());
        assert!(
            parse("tenants: []\n", false).is_err(),
            "default_policy is required"
        );
    }
}
