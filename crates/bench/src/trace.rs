//! Traces: Mooncake JSONL, and turning a request's hash ids into prompt tokens.
//!
//! A Mooncake line is `{"timestamp": ms, "input_length": n, "output_length": m,
//! "hash_ids": [...]}`, one hash id per `hash_block_size` (512) tokens of the prompt; equal ids
//! at the start of two prompts mean an equal prefix. Each id becomes a fixed pseudo-random
//! block of tokens (seeded by the id), so equal ids give equal token prefixes.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the start.
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("line {line}: {reason}")]
    Line { line: usize, reason: String },
}

/// Parses Mooncake JSONL text; blank lines are skipped, anything else malformed is an error
/// naming its line.
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(line).map_err(|e| TraceError::Line {
            line: i + 1,
            reason: e.to_string(),
        })?;
        if r.input_length == 0 {
            return Err(TraceError::Line {
                line: i + 1,
                reason: "input_length is 0".into(),
            });
        }
        out.push(r);
    }
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// Drops the first `n` requests and moves the rest so that the first starts at 0.
pub fn skip(requests: &mut Vec<TraceRequest>, n: usize) {
    requests.drain(..n.min(requests.len()));
    let first = requests.first().map_or(0, |r| r.timestamp);
    for r in requests.iter_mut() {
        r.timestamp -= first;
    }
}

/// `k` copies of `requests` interleaved: `k` times the rate over the same span, as `k` clusters'
/// users sharing one router. Copy `c` (from 0) arrives `c / k` of the mean gap later than the
/// original, and its hash ids are offset by `c` times one more than the largest id, so no two
/// copies share a prefix (copy 0 is the original). Sorted by arrival, copies in order on ties.
pub fn copies(requests: &[TraceRequest], k: usize) -> Vec<TraceRequest> {
    if k <= 1 || requests.is_empty() {
        return requests.to_vec();
    }
    let span = requests.last().map_or(0, |r| r.timestamp) - requests[0].timestamp;
    let gap = span as f64 / requests.len() as f64;
    let stride = requests
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .max()
        .map_or(1, |m| m + 1);
    let mut out: Vec<TraceRequest> = (0..k)
        .flat_map(|c| {
            let at = (gap * c as f64 / k as f64) as u64;
            requests.iter().map(move |r| TraceRequest {
                timestamp: r.timestamp + at,
                hash_ids: r.hash_ids.iter().map(|h| h + stride * c as u64).collect(),
                ..r.clone()
            })
        })
        .collect();
    out.sort_by_key(|r| r.timestamp);
    out
}

/// `requests` as Mooncake JSONL, one line each: what [`load`] reads back, and what Dynamo's
/// replay takes (a generated workload run through both routers).
pub fn save(path: &Path, requests: &[TraceRequest]) -> Result<(), TraceError> {
    let mut text = String::new();
    for r in requests {
        text.push_str(&serde_json::to_string(r).expect("a trace request serialises"));
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|source| TraceError::Write {
        path: path.display().to_string(),
        source,
    })
}

pub fn load(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text)
}

/// The prompt of `r` as `input_length` pseudo-random values: each hash id seeds a block of
/// `block` values (ids past the list: blocks unique to the request), the last block cut.
pub fn prompt_values(r: &TraceRequest, block: usize) -> impl Iterator<Item = u64> + '_ {
    (0..r.input_length).scan((usize::MAX, 0u64), move |(blk, x), pos| {
        if pos / block != *blk {
            *blk = pos / block;
            let id = r
                .hash_ids
                .get(*blk)
                .copied()
                .unwrap_or(u64::MAX - (r.timestamp << 16) - *blk as u64);
            *x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        }
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        Some(*x)
    })
}

/// The prompt of `r` as token ids below `vocab` (see [`prompt_values`]).
pub fn prompt_tokens(r: &TraceRequest, block: usize, vocab: u32) -> Vec<u32> {
    prompt_values(r, block)
        .map(|x| (x % u64::from(vocab)) as u32)
        .collect()
}

/// The prompt of `r` as lowercase letters, one per value (one token each through the
/// fallback tokenizer).
pub fn prompt_text(r: &TraceRequest, block: usize) -> String {
    prompt_values(r, block)
        .map(|x| (b'a' + (x % 26) as u8) as char)
        .collect()
}

/// The share of prompt tokens an unbounded cache that has seen every earlier request would
/// reuse (the trace's upper bound on prefix reuse), counting hash blocks: a reused block counts
/// as far as an earlier request had it (a partial last block that a later prompt extends, as
/// in a multi-turn chat, counts its earlier length), and the reuse stops after a block counted
/// short.
pub fn hit_bound(trace: &[TraceRequest], block: usize) -> f64 {
    // Each prefix of hash ids seen, with the most tokens of its last block seen.
    let mut seen: std::collections::HashMap<Vec<u64>, usize> = std::collections::HashMap::new();
    let (mut reused, mut total) = (0usize, 0usize);
    for r in trace {
        total += r.input_length;
        let mut prefix = Vec::new();
        let mut hit = true;
        for (i, id) in r.hash_ids.iter().enumerate() {
            prefix.push(*id);
            let len = block.min(r.input_length.saturating_sub(i * block));
            let had = seen.get(&prefix).copied().unwrap_or(0);
            if hit {
                reused += len.min(had);
                hit = had >= len;
            }
            if had < len {
                seen.insert(prefix.clone(), len);
            }
        }
    }
    reused as f64 / total.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_workload_loads_back_the_same() {
        let requests = crate::synthetic::Synthetic::Agentic(Default::default()).generate(512, 3);
        assert!(requests.len() > 100);
        let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agentic.jsonl");
        save(&path, &requests).unwrap();
        assert_eq!(load(&path).unwrap(), requests);
        // A path that cannot be written is an error naming it, not a panic.
        let bad = dir.join("missing").join("x.jsonl");
        let e = save(&bad, &requests).unwrap_err().to_string();
        assert!(
            e.starts_with("cannot write") && e.contains("missing"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn copies_interleave_in_time_and_share_no_prefix() {
        let r = |timestamp, hash_ids: Vec<u64>| TraceRequest {
            timestamp,
            input_length: 16 * hash_ids.len(),
            output_length: 1,
            hash_ids,
        };
        let trace = vec![r(0, vec![0, 1]), r(100, vec![0, 2]), r(200, vec![3])];
        assert_eq!(copies(&trace, 1), trace);
        let c = copies(&trace, 4);
        assert_eq!(c.len(), 12);
        // Mean gap 200 / 3 ms: copy c arrives c * 16 ms later; ids offset by c * 4.
        let firsts: Vec<(u64, Vec<u64>)> = c[..4]
            .iter()
            .map(|r| (r.timestamp, r.hash_ids.clone()))
            .collect();
        assert_eq!(
            firsts,
            vec![
                (0, vec![0, 1]),
                (16, vec![4, 5]),
                (33, vec![8, 9]),
                (50, vec![12, 13])
            ]
        );
        assert!(c.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let ids: std::collections::HashSet<u64> =
            c.iter().flat_map(|r| r.hash_ids.iter().copied()).collect();
        assert_eq!(ids.len(), 16, "4 distinct ids per copy, none shared");
    }

    #[test]
    fn bad_lines_name_their_line() {
        let text = "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n\n{\"timestamp\": 1}\n";
        let e = parse(text).unwrap_err().to_string();
        assert!(e.starts_with("line 3:"), "{e}");
        assert!(parse("not json")
            .unwrap_err()
            .to_string()
            .starts_with("line 1:"));
        let ok = parse("{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [2]}").unwrap();
        assert_eq!(
            ok.iter().map(|r| r.timestamp).collect::<Vec<_>>(),
            [1, 5],
            "sorted by arrival"
        );
    }

    #[test]
    fn equal_hash_ids_give_equal_token_and_text_prefixes() {
        let a = TraceRequest {
            timestamp: 0,
            input_length: 1200,
            output_length: 1,
            hash_ids: vec![7, 8, 9],
        };
        let b = TraceRequest {
            timestamp: 9,
            input_length: 1100,
            output_length: 1,
            hash_ids: vec![7, 8, 4],
        };
        let (ta, tb) = (prompt_tokens(&a, 512, 32000), prompt_tokens(&b, 512, 32000));
        assert_eq!((ta.len(), tb.len()), (1200, 1100));
        assert_eq!(ta[..1024], tb[..1024]);
        assert_ne!(ta[1024..1100], tb[1024..1100]);
        assert!(ta.iter().all(|&t| t < 32000));
        // The same as text (what a replay sends).
        let (ta, tb) = (prompt_text(&a, 512), prompt_text(&b, 512));
        assert_eq!((ta.len(), tb.len()), (1200, 1100));
        assert_eq!(ta[..1024], tb[..1024]);
        assert_ne!(ta[1024..1100], tb[1024..1100]);
    }

    #[test]
    fn the_hit_bound_counts_reused_leading_blocks() {
        let t = |ts, len, ids: Vec<u64>| TraceRequest {
            timestamp: ts,
            input_length: len,
            output_length: 1,
            hash_ids: ids,
        };
        let trace = vec![
            t(0, 1024, vec![1, 2]),
            t(1, 1024, vec![1, 3]),
            t(2, 600, vec![1, 2]),
        ];
        // Reused: 512 (second request's first block) + 600 (third: 512 + 88).
        let expected = (512.0 + 600.0) / (1024.0 + 1024.0 + 600.0);
        assert!((hit_bound(&trace, 512) - expected).abs() < 1e-12);
    }

    #[test]
    fn the_hit_bound_counts_a_partial_block_as_far_as_it_was_seen() {
        let t = |ts, len, ids: Vec<u64>| TraceRequest {
            timestamp: ts,
            input_length: len,
            output_length: 1,
            hash_ids: ids,
        };
        // A chat: 700 tokens, then 1100 extending them (block 2 grows from 188 to 512 tokens).
        let trace = vec![
            t(0, 700, vec![1, 2]),
            t(1, 1100, vec![1, 2, 3]),
            t(2, 1100, vec![1, 2, 3]),
        ];
        let expected = (700.0 + 1100.0) / (700.0 + 1100.0 + 1100.0);
        assert!((hit_bound(&trace, 512) - expected).abs() < 1e-12);
    }

    #[test]
    fn skip_leaves_out_the_first_requests_and_starts_the_rest_at_zero() {
        let at = |ms| TraceRequest {
            timestamp: ms,
            input_length: 1,
            output_length: 1,
            hash_ids: vec![ms],
        };
        let mut r = vec![at(0), at(10), at(25), at(40)];
        skip(&mut r, 2);
        let times: Vec<(u64, u64)> = r.iter().map(|r| (r.timestamp, r.hash_ids[0])).collect();
        assert_eq!(times, [(0, 25), (15, 40)]);
        skip(&mut r, 9);
        assert!(r.is_empty());
    }
}
