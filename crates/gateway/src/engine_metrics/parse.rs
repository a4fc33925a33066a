//! A small Prometheus text-format parser, reading only what the router needs from an
//! engine's `/metrics`.
//!
//! Every line is checked, as Prometheus itself does when it scrapes: a body with one line
//! that is neither a comment (`# HELP`, `# TYPE`, `# EOF`, any `#` line), a blank line nor a
//! well-formed sample is rejected as a whole, so HTML, JSON or a truncated line never pass
//! for readings. A sample is
//!
//! ```text
//! name [ "{" label="value" { "," label="value" } [ "," ] "}" ] value [ timestamp ] [ "#" exemplar ]
//! ```
//!
//! with `name` in `[a-zA-Z_:][a-zA-Z0-9_:]*`, label values escaped with `\\`, `\"` and `\n`,
//! values any float Rust reads (`NaN`, `+Inf`, `-Inf`, exponents), blanks (spaces, tabs)
//! between tokens and `\r\n` line ends tolerated.
//!
//! Of the samples, these are kept, per engine rank (label `engine` in vLLM, `dp_rank` in
//! SGLang, rank 0 without either); when a series appears twice for a rank, the last wins:
//!
//! | reading | vLLM | SGLang |
//! |---|---|---|
//! | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | kv_usage | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//! | num_gpu_blocks, block_size | labels of `vllm:cache_config_info` | |
//!
//! and, for the whole engine (vLLM labels it with no rank), its LoRA adapters
//! ([`LoraReading`]) from `vllm:lora_requests_info{running_lora_adapters,
//! waiting_lora_adapters, max_lora}`: vLLM keeps one series per state it has been in, each
//! valued with the time it was last in it, so the series with the greatest value is read.
//! vLLM (0.32) declares the family (`# HELP`, `# TYPE`) from its start but writes its first
//! series only once it has served a request: a declared family without a series is an
//! engine with no adapter running or waiting (its slots unknown: one).

use std::borrow::Cow;

/// Why a body is not Prometheus text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct ParseError {
    /// 1-based.
    pub line: usize,
    pub reason: &'static str,
}

/// What one engine rank reported; `None` for a series the body did not have.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankReading {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per engine KV block (`block_size` label of `vllm:cache_config_info`).
    pub block_size: Option<u64>,
}

/// The engine's LoRA adapters, as its newest `vllm:lora_requests_info` series says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraReading {
    /// Adapters of the running requests.
    pub running: Vec<String>,
    /// Adapters of the waiting requests.
    pub waiting: Vec<String>,
    /// Adapter slots (`max_lora`).
    pub max_lora: usize,
    /// The series' value: when the engine was last in this state (Unix seconds).
    pub stamp: f64,
}

/// The readings of every rank found in one body, by rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineReadings {
    ranks: Vec<(u32, RankReading)>,
    /// The engine's adapters, when it serves LoRA adapters.
    pub lora: Option<LoraReading>,
}

impl EngineReadings {
    pub fn rank(&self, rank: u32) -> Option<&RankReading> {
        self.ranks.iter().find(|(r, _)| *r == rank).map(|(_, v)| v)
    }

    /// The ranks found, in order of first appearance.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &RankReading)> {
        self.ranks.iter().map(|(r, v)| (*r, v))
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    fn rank_mut(&mut self, rank: u32) -> &mut RankReading {
        let i = match self.ranks.iter().position(|(r, _)| *r == rank) {
            Some(i) => i,
            None => {
                self.ranks.push((rank, RankReading::default()));
                self.ranks.len() - 1
            }
        };
        &mut self.ranks[i].1
    }

    /// Keeps what `sample` says, if it is a series the router reads.
    fn absorb(&mut self, sample: &Sample<'_>) {
        let rank = || {
            let label = sample.label("engine").or_else(|| sample.label("dp_rank"))?;
            label.trim().parse::<u32>().ok()
        };
        let v = sample.value;
        match sample.name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                self.rank_mut(rank().unwrap_or(0)).waiting = Some(v);
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                self.rank_mut(rank().unwrap_or(0)).running = Some(v);
            }
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => {
                self.rank_mut(rank().unwrap_or(0)).kv_usage = Some(v);
            }
            "vllm:gpu_cache_usage_perc" => {
                // The older name, used only where the newer is absent.
                let r = self.rank_mut(rank().unwrap_or(0));
                r.kv_usage.get_or_insert(v);
            }
            "vllm:lora_requests_info" => {
                if self.lora.as_ref().is_some_and(|l| l.stamp >= v) {
                    return;
                }
                let names = |label| -> Vec<String> {
                    sample.label(label).map_or_else(Vec::new, |s| {
                        s.split(',')
                            .map(str::trim)
                            .filter(|n| !n.is_empty())
                            .map(str::to_owned)
                            .collect()
                    })
                };
                let max_lora = sample.label("max_lora").and_then(|m| m.trim().parse().ok());
                self.lora = Some(LoraReading {
                    running: names("running_lora_adapters"),
                    waiting: names("waiting_lora_adapters"),
                    max_lora: max_lora.unwrap_or(1),
                    stamp: v,
                });
            }
            "vllm:cache_config_info" => {
                let int = |name| sample.label(name)?.trim().parse::<u64>().ok();
                let (blocks, block_size) = (int("num_gpu_blocks"), int("block_size"));
                let r = self.rank_mut(rank().unwrap_or(0));
                r.num_gpu_blocks = blocks.filter(|&n| n > 0).or(r.num_gpu_blocks);
                r.block_size = block_size.filter(|&n| n > 0).or(r.block_size);
            }
            _ => {}
        }
    }
}

/// Parses a `/metrics` body.
pub fn parse(body: &str) -> Result<EngineReadings, ParseError> {
    let mut readings = EngineReadings::default();
    let mut sample = Sample::default();
    let mut declares_lora = false;
    for (i, line) in body.lines().enumerate() {
        let line = skip_blanks(line);
        if let Some(comment) = line.strip_prefix('#') {
            declares_lora = declares_lora || declares(comment, "vllm:lora_requests_info");
            continue;
        }
        if line.is_empty() {
            continue;
        }
        sample.parse(line).map_err(|reason| ParseError {
            line: i + 1,
            reason,
        })?;
        readings.absorb(&sample);
    }
    if declares_lora && readings.lora.is_none() {
        readings.lora = Some(LoraReading {
            max_lora: 1,
            stamp: f64::NEG_INFINITY,
            ..LoraReading::default()
        });
    }
    Ok(readings)
}

/// Whether a comment line (after its `#`) is the `HELP` or `TYPE` line of family `name`.
fn declares(comment: &str, name: &str) -> bool {
    let words = comment.trim_start_matches(|c: char| c.is_ascii_whitespace());
    let Some(rest) = words
        .strip_prefix("HELP")
        .or_else(|| words.strip_prefix("TYPE"))
    else {
        return false;
    };
    let after = rest.trim_start_matches(|c: char| c.is_ascii_whitespace());
    // The keyword ends at a blank, and the name at a blank or the line's end.
    after.len() < rest.len()
        && after
            .strip_prefix(name)
            .is_some_and(|end| end.is_empty() || end.starts_with(|c: char| c.is_ascii_whitespace()))
}

/// A blank between a line's parts: a space, a tab, a carriage return.
fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r')
}

/// `s` past its leading blanks.
fn skip_blanks(s: &str) -> &str {
    let n = s.bytes().take_while(|&b| is_blank(b)).count();
    &s[n..]
}

/// One sample line, borrowed from the body (label values are owned only when escaped).
#[derive(Debug, Default)]
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, Cow<'a, str>)>,
    value: f64,
}

impl<'a> Sample<'a> {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }

    fn parse(&mut self, line: &'a str) -> Result<(), &'static str> {
        self.labels.clear();
        let mut c = Cursor { rest: line };
        self.name = c.name(METRIC_NAME).ok_or("expected a metric name")?;
        c.skip_blanks();
        if c.eat(b'{') {
            self.parse_labels(&mut c)?;
            c.skip_blanks();
        }
        let value = c.token().ok_or("expected a value")?;
        self.value = parse_float(value).ok_or("the value is not a number")?;
        c.skip_blanks();
        if !c.rest.starts_with('#') {
            if let Some(ts) = c.token() {
                parse_float(ts)
                    .filter(|t| t.is_finite())
                    .ok_or("the timestamp is not a number")?;
                c.skip_blanks();
            }
        }
        // An OpenMetrics exemplar (`# {...} value`) may follow; nothing else may.
        if c.rest.is_empty() || c.rest.starts_with('#') {
            Ok(())
        } else {
            Err("unexpected text after the value")
        }
    }

    fn parse_labels(&mut self, c: &mut Cursor<'a>) -> Result<(), &'static str> {
        loop {
            c.skip_blanks();
            if c.eat(b'}') {
                return Ok(());
            }
            let name = c.name(LABEL_NAME).ok_or("expected a label name")?;
            c.skip_blanks();
            if !c.eat(b'=') {
                return Err("expected '=' after a label name");
            }
            c.skip_blanks();
            let value = c.quoted()?;
            self.labels.push((name, value));
            c.skip_blanks();
            if c.eat(b',') {
                continue;
            }
            if c.eat(b'}') {
                return Ok(());
            }
            return Err("expected ',' or '}' in the labels");
        }
    }
}

/// A name's bytes by class: a letter or `_` (anywhere), `:` (metric names only), a digit
/// (not first).
const LETTER: u8 = 1;
const COLON: u8 = 2;
const DIGIT: u8 = 4;
const METRIC_NAME: u8 = LETTER | COLON;
const LABEL_NAME: u8 = LETTER;

/// Each byte's class (one table load a byte: names are most of a body's bytes).
static CLASS: [u8; 256] = {
    let mut class = [0; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        class[b] = if byte.is_ascii_alphabetic() || byte == b'_' {
            LETTER
        } else if byte == b':' {
            COLON
        } else if byte.is_ascii_digit() {
            DIGIT
        } else {
            0
        };
        b += 1;
    }
    class
};

fn parse_float(s: &str) -> Option<f64> {
    // Most values are whole (`3`, `140.0`): read exactly as an integer (below 2^53), the rest
    // by Rust's parser, which reads `NaN`, `+Inf`, `-Inf` and `Infinity` in any case, as Go's.
    let whole = s.strip_suffix(".0").unwrap_or(s);
    if (1..=15).contains(&whole.len()) && whole.bytes().all(|b| b.is_ascii_digit()) {
        return whole.parse::<u64>().ok().map(|n| n as f64);
    }
    s.parse::<f64>().ok()
}

struct Cursor<'a> {
    rest: &'a str,
}

impl<'a> Cursor<'a> {
    fn eat(&mut self, b: u8) -> bool {
        match self.rest.as_bytes().first() {
            Some(&x) if x == b => {
                self.rest = &self.rest[1..];
                true
            }
            _ => false,
        }
    }

    fn skip_blanks(&mut self) {
        self.rest = skip_blanks(self.rest);
    }

    /// The longest name of bytes of the classes `first` (digits may follow), if any.
    fn name(&mut self, first: u8) -> Option<&'a str> {
        let bytes = self.rest.as_bytes();
        if bytes
            .first()
            .is_none_or(|&b| CLASS[usize::from(b)] & first == 0)
        {
            return None;
        }
        let rest = first | DIGIT;
        let n = 1 + bytes[1..]
            .iter()
            .take_while(|&&b| CLASS[usize::from(b)] & rest != 0)
            .count();
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Some(head)
    }

    /// The next run of non-blank characters.
    fn token(&mut self) -> Option<&'a str> {
        let n = (self.rest.bytes().position(is_blank)).unwrap_or(self.rest.len());
        (n > 0).then(|| {
            let (head, tail) = self.rest.split_at(n);
            self.rest = tail;
            head
        })
    }

    /// A double-quoted label value, unescaped.
    fn quoted(&mut self) -> Result<Cow<'a, str>, &'static str> {
        if !self.eat(b'"') {
            return Err("expected a quoted label value");
        }
        let bytes = self.rest.as_bytes();
        let mut owned: Option<String> = None;
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'"' => {
                    let value = match owned {
                        Some(mut s) => {
                            s.push_str(&self.rest[start..i]);
                            Cow::Owned(s)
                        }
                        None => Cow::Borrowed(&self.rest[..i]),
                    };
                    self.rest = &self.rest[i + 1..];
                    return Ok(value);
                }
                b'\\' => {
                    let unescaped = match bytes.get(i + 1) {
                        Some(b'\\') => '\\',
                        Some(b'"') => '"',
                        Some(b'n') => '\n',
                        _ => return Err("invalid escape in a label value"),
                    };
                    let s = owned.get_or_insert_with(String::new);
                    s.push_str(&self.rest[start..i]);
                    s.push(unescaped);
                    i += 2;
                    start = i;
                }
                _ => i += 1,
            }
        }
        Err("unterminated label value")
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 1e-2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="16384",num_cpu_blocks="None"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="16384",num_cpu_blocks="None"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} NaN
# EOF
"#;

    #[test]
    fn reads_vllm_per_engine() {
        let r = parse(VLLM).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            r.rank(0),
            Some(&RankReading {
                waiting: Some(7.0),
                running: Some(3.0),
                kv_usage: Some(0.25),
                num_gpu_blocks: Some(16384),
                block_size: Some(16),
            })
        );
        let one = r.rank(1).unwrap();
        assert_eq!(
            (one.waiting, one.running, one.kv_usage),
            (Some(0.0), Some(1.0), Some(0.01))
        );
        assert!(r.rank(2).is_none());
    }

    #[test]
    fn reads_sglang_and_the_older_vllm_name() {
        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 4\n\
                      sglang:num_running_reqs{model_name=\"m\"} 2\n\
                      sglang:token_usage{model_name=\"m\"} 0.5\n";
        let r = parse(sglang).unwrap();
        let z = r.rank(0).unwrap();
        assert_eq!(
            (z.waiting, z.running, z.kv_usage),
            (Some(4.0), Some(2.0), Some(0.5))
        );
        let dp = "sglang:num_queue_reqs{dp_rank=\"3\"} 1\n";
        assert_eq!(parse(dp).unwrap().rank(3).unwrap().waiting, Some(1.0));
        // The older name fills kv_usage only where the newer is absent, in either order.
        let old = "vllm:gpu_cache_usage_perc 0.75\n";
        assert_eq!(parse(old).unwrap().rank(0).unwrap().kv_usage, Some(0.75));
        let both = "vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.75\n";
        assert_eq!(parse(both).unwrap().rank(0).unwrap().kv_usage, Some(0.5));
        let both = "vllm:gpu_cache_usage_perc 0.75\nvllm:kv_cache_usage_perc 0.5\n";
        assert_eq!(parse(both).unwrap().rank(0).unwrap().kv_usage, Some(0.5));
    }

    #[test]
    fn tolerates_the_format_s_variations() {
        let text = "  vllm:num_requests_waiting{engine=\"0\",} +Inf 1700000000000\r\n\
                    vllm:num_requests_running { engine = \"0\" , model_name=\"a \\\"q\\\" \\\\ \\n\" }\t-Inf\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} NaN # {trace_id=\"x\"} 1\n\
                    \n   \t\n\
                    other_metric 12\n\
                    # any comment at all\n";
        let r = parse(text).unwrap();
        let z = r.rank(0).unwrap();
        assert_eq!(z.waiting, Some(f64::INFINITY));
        assert_eq!(z.running, Some(f64::NEG_INFINITY));
        assert!(z.kv_usage.unwrap().is_nan());
        assert_eq!(parse("").unwrap(), EngineReadings::default());
    }

    #[test]
    fn escaped_label_values_are_unescaped() {
        let mut s = Sample::default();
        s.parse(r#"m{a="x\"y\\z\nw",b="plain"} 1"#).unwrap();
        assert_eq!(s.label("a"), Some("x\"y\\z\nw"));
        assert!(matches!(s.labels[1].1, Cow::Borrowed("plain")));
    }

    #[test]
    fn the_newest_lora_series_is_the_engines_adapters() {
        let body = "\
vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",running_lora_adapters=\"sql\"} 1.7e9
vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"b\",running_lora_adapters=\"sql,chat\"} 1.70000001e9
vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 1.6e9
";
        let lora = parse(body).unwrap().lora.unwrap();
        assert_eq!(lora.running, ["sql", "chat"]);
        assert_eq!(lora.waiting, ["b"]);
        assert_eq!(lora.max_lora, 4);
        assert!(parse("vllm:num_requests_waiting 0\n")
            .unwrap()
            .lora
            .is_none());
    }

    #[test]
    fn vllms_lora_series_as_vllm_0_32_writes_them() {
        // Taken from a vLLM 0.32 engine on CPU (--enable-lora --max-loras 1): before its
        // first request, the family without a series; running a request of `sql`, `sql` in
        // both labels; then idle, a newer series with both empty.
        let fresh = "\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
# HELP vllm:num_requests_running Number of requests in model execution batches.
";
        let idle = LoraReading {
            max_lora: 1,
            stamp: f64::NEG_INFINITY,
            ..LoraReading::default()
        };
        assert_eq!(parse(fresh).unwrap().lora, Some(idle));
        let running = "\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"sql\"} 1.7963059742836576e+09
";
        let lora = parse(running).unwrap().lora.unwrap();
        assert_eq!(
            (lora.running, lora.waiting),
            (vec!["sql".to_owned()], vec!["sql".to_owned()])
        );
        let idle_again = format!(
            "{running}vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}} 1.7963059789588418e+09\n"
        );
        let lora = parse(&idle_again).unwrap().lora.unwrap();
        assert!(lora.running.is_empty() && lora.waiting.is_empty());
        assert_eq!(lora.max_lora, 1);
        // Another family's comments declare nothing.
        assert!(parse("# TYPE vllm:lora_requests_info_total counter\n")
            .unwrap()
            .lora
            .is_none());
    }

    #[test]
    fn rejects_what_is_not_prometheus_text() {
        for body in [
            "<!DOCTYPE html>\n<html><body>Not Found</body></html>\n",
            "{\"error\": \"not found\"}",
            "OK",
            "vllm:num_requests_waiting",
            "vllm:num_requests_waiting{engine=\"0\"}",
            "vllm:num_requests_waiting{engine=\"0} 1",
            "vllm:num_requests_waiting{engine=0} 1",
            "vllm:num_requests_waiting{engine=\"0\" 1",
            "vllm:num_requests_waiting{engine=\"\\x\"} 1",
            "vllm:num_requests_waiting 1 2 3",
            "vllm:num_requests_waiting one",
            "vllm:num_requests_waiting 1 soon",
            "1abc 2",
            "vllm:num_requests_waiting 1\ngarbage here\n",
        ] {
            assert!(parse(body).is_err(), "accepted {body:?}");
        }
        let err = parse("# ok\nm 1\n<html>\n").unwrap_err();
        assert_eq!(err.line, 3);
    }

    #[test]
    fn never_panics_on_random_or_truncated_input() {
        let mut rng = SmallRng::seed_from_u64(11);
        let alphabet = b"{}\",=\\ \t\r\n#:_aZ09.+-eInfNa\xc3\xa9";
        for n in 0..VLLM.len() {
            let _ = parse(&VLLM[..n]);
        }
        for _ in 0..20_000 {
            let len = rng.random_range(0..120);
            let bytes: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let _ = parse(&String::from_utf8_lossy(&bytes));
            // Mutations of a valid body.
            let mut body = VLLM.as_bytes().to_vec();
            for _ in 0..rng.random_range(1..6) {
                let at = rng.random_range(0..body.len());
                body[at] = alphabet[rng.random_range(0..alphabet.len())];
            }
            let _ = parse(&String::from_utf8_lossy(&body));
        }
    }
}
