//! The peers' flags, read before clap parses the command line.
//!
//! `peer_flags.tsv` has one row for each flag of smg 1.13 `launch`, vllm-router 0.1.17,
//! sglang-router 0.3.2, Dynamo 1.6.1's frontend and llm-d's endpoint picker (llm-d-router
//! 0.10, the flags its charts pass and the rest of its `epp` command). Its columns are the
//! flag, each peer's default, kvroute's decision (`same`, `alias:--flag`, `new:--flag`,
//! `noop`, `noop:value`, `noop:bool` or `refused`), how the meanings differ, and for a
//! refused flag why (`not applicable: ...` or `not supported yet: ...`).
//!
//! [`pre_parse`] reads the command line first: a no-op flag is taken out with its value, if
//! it has one (`noop` takes none; `noop:value` one, `--flag V` or `--flag=V`; `noop:bool`
//! is a Go boolean, `--flag` or `--flag=BOOL`; llm-d's `-v N`, `-v=N` and `-vN` are its
//! `--v`), and returned, for `main` to log; a flag whose values kvroute maps onto one of its own
//! (`--router-mode kv` is `--policy kv_aware`) is rewritten; and a flag of the table that
//! kvroute takes in neither way nor by its parser exits with status 2 and a message naming
//! it and saying why, instead of clap's generic "unexpected argument". The table's `alias:`
//! and `new:` rows kvroute has not built yet are refused as not supported yet.
//! [`flags_table`] writes the table as [`TABLE_PAGE`] shows it.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt::Write as _;

use clap::Parser;

use super::Args;

const TABLE: &str = include_str!("peer_flags.tsv");

/// How a `noop` row's `differs` begins; the rest is why.
const NOOP: &str = "accepted as a no-op: ";

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFlag {
    pub flag: &'static str,
    /// Each peer's default; `-` where the peer has no such flag.
    pub smg: &'static str,
    pub vllm_router: &'static str,
    pub sglang_router: &'static str,
    pub dynamo: &'static str,
    /// llm-d's endpoint picker (llm-d-router 0.10).
    pub llm_d_epp: &'static str,
    /// `same`, `alias:--flag`, `new:--flag`, `noop`, `noop:value`, `noop:bool` or `refused`.
    pub decision: &'static str,
    pub differs: &'static str,
    pub why: &'static str,
}

/// Every row of the table.
pub fn peer_flags() -> impl Iterator<Item = PeerFlag> {
    TABLE.lines().skip(1).filter_map(|line| {
        let cols: Vec<&'static str> = line.split('\t').collect();
        (cols.len() == 9).then(|| PeerFlag {
            flag: cols[0],
            smg: cols[1],
            vllm_router: cols[2],
            sglang_router: cols[3],
            dynamo: cols[4],
            llm_d_epp: cols[5],
            decision: cols[6],
            differs: cols[7],
            why: cols[8],
        })
    })
}

/// The long flags (and their aliases) kvroute's parser takes.
pub fn own_flags() -> HashSet<String> {
    let cmd = <Args as clap::CommandFactory>::command();
    cmd.get_arguments().flat_map(arg_names).collect()
}

/// An argument's long name and aliases, as `--name`.
fn arg_names(a: &clap::Arg) -> Vec<String> {
    a.get_long()
        .into_iter()
        .chain(a.get_all_aliases().unwrap_or_default())
        .map(|l| format!("--{l}"))
        .collect()
}

/// A peer's flag accepted as a no-op: taken off the command line and logged at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoopFlag {
    pub flag: &'static str,
    /// Why it changes nothing in kvroute.
    pub why: &'static str,
    pub takes: NoopValue,
}

/// What a no-op flag takes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoopValue {
    /// Nothing (`noop`): `--flag=V` is an error.
    Nothing,
    /// One value (`noop:value`): `--flag V` or `--flag=V`.
    Value,
    /// A Go boolean (`noop:bool`): `--flag` or `--flag=BOOL`; a next word is not its value.
    Bool,
}

fn noop_flag(flag: &str) -> Option<NoopFlag> {
    peer_flags().find(|r| r.flag == flag).and_then(|r| {
        let takes = match r.decision {
            "noop" => NoopValue::Nothing,
            "noop:value" => NoopValue::Value,
            "noop:bool" => NoopValue::Bool,
            _ => return None,
        };
        Some(NoopFlag {
            flag: r.flag,
            why: r.differs.strip_prefix(NOOP).unwrap_or(r.differs),
            takes,
        })
    })
}

/// llm-d's `-v N`, `-v=N` and `-vN` (pflag's shorthand) as its `--v`.
fn long_verbosity(text: &str) -> Option<String> {
    let rest = text.strip_prefix("-v")?;
    let long = rest.is_empty() || rest.starts_with('=') || rest.bytes().all(|b| b.is_ascii_digit());
    long.then(|| {
        match rest
            .strip_prefix('=')
            .or((!rest.is_empty()).then_some(rest))
        {
            Some(value) => format!("--v={value}"),
            None => "--v".to_owned(),
        }
    })
}

/// A peer's flag whose values map onto one of kvroute's flags: rewritten to that flag
/// before clap reads the command line.
struct Mapped {
    flag: &'static str,
    target: &'static str,
    /// The target's value for the peer's, or why there is none.
    map: fn(&str) -> Result<String, String>,
}

const MAPPED: [Mapped; 3] = [
    Mapped {
        flag: "--load-monitor-interval",
        target: "--metrics-refresh-ms",
        map: seconds_as_ms,
    },
    Mapped {
        flag: "--kv-connector",
        target: "--pd-protocol",
        map: kv_connector,
    },
    Mapped {
        flag: "--router-mode",
        target: "--policy",
        map: router_mode,
    },
];

/// smg's `--load-monitor-interval` is in seconds, kvroute's `--metrics-refresh-ms` in ms.
fn seconds_as_ms(value: &str) -> Result<String, String> {
    value
        .parse::<u64>()
        .ok()
        .and_then(|secs| secs.checked_mul(1000))
        .map(|ms| ms.to_string())
        .ok_or_else(|| "expected whole seconds".to_owned())
}

/// vllm-router's P/D connector: NIXL is how kvroute's `vllm` protocol moves the KV cache.
fn kv_connector(value: &str) -> Result<String, String> {
    match value {
        "nixl" => Ok("vllm".to_owned()),
        "mooncake" => Err("not supported yet: the Mooncake connector (nixl is)".to_owned()),
        "moriio" => Err("not supported yet: the MoRI-IO connector (nixl is)".to_owned()),
        _ => Err("expected nixl, mooncake or moriio".to_owned()),
    }
}

/// Dynamo's router modes as kvroute's policies.
fn router_mode(value: &str) -> Result<String, String> {
    Ok(match value {
        "kv" => "kv_aware",
        "round-robin" => "round_robin",
        "random" => "random",
        "power-of-two" => "power_of_two",
        "least-loaded" => {
            return Err("not supported yet: kvroute has no fewest-in-flight policy \
                        (--policy least_load estimates the expected wait from the engines' \
                        reports)"
                .to_owned())
        }
        "direct" => {
            return Err(
                "not supported yet: a mode that refuses requests naming no worker \
                        (kvroute honours nvext.backend_instance_id and x-worker-instance-id \
                        as pins under every policy)"
                    .to_owned(),
            )
        }
        "device-aware-weighted" => {
            return Err("not applicable: Dynamo's CPU/CUDA device types".to_owned())
        }
        _ => {
            return Err(
                "expected kv, round-robin, random, power-of-two, least-loaded, \
                        direct or device-aware-weighted"
                    .to_owned(),
            )
        }
    }
    .to_owned())
}

/// Whether kvroute takes `flag`: its parser knows it, or the pre-parser maps or drops it.
fn accepted(flag: &str, own: &HashSet<String>) -> bool {
    own.contains(flag) || MAPPED.iter().any(|m| m.flag == flag) || noop_flag(flag).is_some()
}

/// The long name and aliases of one of kvroute's flags.
fn names_of(long: &str) -> Vec<String> {
    let cmd = <Args as clap::CommandFactory>::command();
    let names = cmd
        .get_arguments()
        .find(|a| a.get_long().is_some_and(|l| format!("--{l}") == long))
        .map(arg_names)
        .unwrap_or_default();
    names
}

/// Why `flag`, a peer's, is refused; `None` when kvroute takes it or no peer has it.
fn refusal_of(flag: &str, own: &HashSet<String>) -> Option<String> {
    if accepted(flag, own) {
        return None;
    }
    let row = peer_flags().find(|r| r.flag == flag)?;
    Some(match row.decision {
        "refused" => format!("{flag} is refused: {}", row.why),
        d => {
            let planned = d.split_once(':').map_or("", |(_, f)| f);
            format!(
                "{flag} is not supported yet: a peer's flag kvroute will take (as {planned}); \
                 see crates/gateway/src/config/peer_flags.tsv"
            )
        }
    })
}

/// The command line as the pre-parser leaves it for clap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreParsed {
    /// The program's name, then the arguments: no-op flags taken out, mapped flags
    /// rewritten to kvroute's.
    pub args: Vec<OsString>,
    /// The no-op flags given, in order.
    pub noops: Vec<NoopFlag>,
}

impl PreParsed {
    /// Parses what is left, as `main` does: the arguments, with the no-op flags recorded.
    pub fn parse(self) -> Result<Args, clap::Error> {
        let mut args = Args::try_parse_from(self.args)?;
        args.peer_noop_flags = self.noops.iter().map(|n| n.flag.to_owned()).collect();
        Ok(args)
    }
}

/// Reads the peers' flags off the command line (the program's name first): no-op flags are
/// taken out, mapped flags rewritten, and a refused one is an error naming it and why, as is
/// a mapped flag's value kvroute has no counterpart for.
pub fn pre_parse(args: impl IntoIterator<Item = OsString>) -> Result<PreParsed, String> {
    let own = own_flags();
    let mut args = args.into_iter().peekable();
    let mut out = PreParsed::default();
    out.args.extend(args.next());
    let mut mapped: Vec<&Mapped> = Vec::new();
    let mut given: Vec<String> = Vec::new();
    while let Some(arg) = args.next() {
        let short_v = arg.to_str().and_then(long_verbosity);
        let Some(text) = short_v
            .as_deref()
            .or_else(|| arg.to_str().filter(|t| t.starts_with("--")))
        else {
            out.args.push(arg);
            continue;
        };
        if text == "--" {
            out.args.push(arg);
            out.args.extend(args);
            break;
        }
        let (flag, inline) = match text.split_once('=') {
            Some((flag, value)) => (flag, Some(value)),
            None => (text, None),
        };
        if let Some(noop) = noop_flag(flag) {
            match (noop.takes, inline) {
                (NoopValue::Nothing, Some(_)) => return Err(format!("{flag} takes no value")),
                // The guard takes the value off the command line.
                (NoopValue::Value, None) if args.next().is_none() => {
                    return Err(format!("{flag} needs a value"))
                }
                (NoopValue::Bool, Some(v)) => {
                    super::load::parse_go_bool(v).map_err(|e| format!("{flag}={v}: {e}"))?;
                }
                _ => {}
            }
            out.noops.push(noop);
            continue;
        }
        if let Some(m) = MAPPED.iter().find(|m| m.flag == flag) {
            let value = match inline {
                Some(v) => v.to_owned(),
                None => match args.next_if(|v| v.to_str().is_some_and(|v| !v.starts_with("--"))) {
                    Some(v) => v.to_string_lossy().into_owned(),
                    None => return Err(format!("{flag} needs a value")),
                },
            };
            if mapped.iter().any(|g| g.flag == m.flag) {
                return Err(format!("{flag} given twice"));
            }
            let target_value = (m.map)(&value).map_err(|why| format!("{flag} {value}: {why}"))?;
            out.args.push(m.target.into());
            out.args.push(target_value.into());
            mapped.push(m);
            continue;
        }
        if let Some(refused) = refusal_of(flag, &own) {
            return Err(refused);
        }
        given.push(flag.to_owned());
        out.args.push(arg);
    }
    for m in mapped {
        let target = names_of(m.target);
        if let Some(both) = given.iter().find(|g| target.contains(g)) {
            return Err(format!(
                "{} and {both} both set {}; give one of them",
                m.flag, m.target
            ));
        }
    }
    Ok(out)
}

/// The page, from the repository's root, that shows the table [`flags_table`] writes.
pub const TABLE_PAGE: &str = "docs/configuration.md";

/// [`TABLE_PAGE`]'s heading of the section [`flags_table`] writes.
pub const TABLE_HEADING: &str = "## Flags of the peer routers";

/// What kvroute does with a row's flag, as [`TABLE_PAGE`]'s table says it.
fn kvroute_column(row: &PeerFlag, own: &HashSet<String>) -> String {
    match row.decision {
        "same" => "same".to_owned(),
        "noop" | "noop:value" | "noop:bool" => "accepted, no effect".to_owned(),
        "refused" => format!("refused: {}", row.why),
        d => {
            let target = d.split_once(':').map_or(d, |(_, f)| f);
            if !accepted(row.flag, own) {
                format!("not supported yet (planned as `{target}`)")
            } else if target == row.flag {
                "same".to_owned()
            } else {
                format!("alias of `{target}`")
            }
        }
    }
}

/// Text for a table cell: pipes, markup and HTML escaped.
fn cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '|' | '*' | '\\' | '`' => {
                out.push('\\');
                out.push(c);
            }
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    out
}

/// [`TABLE_PAGE`]'s section on the peers' flags, generated from the table and the parser: a
/// paragraph with the counts, then one row per flag in a `<details>` block.
pub fn flags_table() -> String {
    let own = own_flags();
    let rows: Vec<(PeerFlag, String)> = peer_flags()
        .map(|r| {
            let k = kvroute_column(&r, &own);
            (r, k)
        })
        .collect();
    let count = |p: &str| rows.iter().filter(|(_, k)| k.starts_with(p)).count();
    let mut s = format!("{TABLE_HEADING}\n\n");
    let counts = format!(
        "smg 1.13 `launch`, vllm-router 0.1.17, sglang-router 0.3.2, Dynamo 1.6.1's frontend \
         and llm-d's endpoint picker (llm-d-router 0.10) have {total} flags between them (`--help` and `--version` aside). kvroute takes \
         {same} under the same name and {alias} as another name of one of its flags (the \
         values of `--router-mode`, `--kv-connector` and `--load-monitor-interval` are mapped \
         onto kvroute's); it accepts {noop} as no-ops (they ask for what kvroute always does; \
         each is logged at start and listed as `peer_noop_flags` by `--dump-config-to`); it \
         refuses {refused} (exit status 2, naming the flag and why), and {planned} more until \
         they are built (refused likewise, as not supported yet). A peer's default is `-` \
         where the peer has no such flag. Generated from \
         `crates/gateway/src/config/peer_flags.tsv` and kvroute's parser by \
         `config::peers::flags_table`; a test fails when this section differs from it \
         (`KVROUTE_BLESS=1 cargo test -p kvroute-gateway --lib peer_flag_table` rewrites it).",
        total = rows.len(),
        same = count("same"),
        alias = count("alias of"),
        noop = count("accepted"),
        refused = count("refused"),
        planned = count("not supported yet"),
    );
    s.push_str(&wrap(&counts, 95));
    let _ = writeln!(
        s,
        "\n<details><summary>Every flag of the five peers ({}) and what kvroute does with it\
         </summary>\n",
        rows.len()
    );
    s.push_str(
        "| flag | smg 1.13 | vllm-router 0.1.17 | sglang-router 0.3.2 | Dynamo 1.6.1 | \
         llm-d EPP 0.10 | kvroute | differs |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (r, kvroute) in &rows {
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {} | {} | {} | {} | {} |",
            r.flag,
            cell(r.smg),
            cell(r.vllm_router),
            cell(r.sglang_router),
            cell(r.dynamo),
            cell(r.llm_d_epp),
            cell_keeping_code(kvroute),
            cell(r.differs),
        );
    }
    s.push_str("\n</details>\n");
    s
}

/// `text` in lines of at most `width` characters (a longer word has a line of its own),
/// each ending in a newline.
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            out.push_str(&line);
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// [`cell`] for text whose backticks are markup of ours.
fn cell_keeping_code(text: &str) -> String {
    text.split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                part.to_owned()
            } else {
                cell(part)
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

/// The section of `page` headed [`TABLE_HEADING`], up to the next `## ` heading or the end.
pub fn flags_section(page: &str) -> Option<&str> {
    let start = page.find(&format!("{TABLE_HEADING}\n"))?;
    let rest = &page[start..];
    let end = rest[TABLE_HEADING.len()..]
        .find("\n## ")
        .map_or(rest.len(), |i| TABLE_HEADING.len() + i + 1);
    Some(&rest[..end])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use serde_json::Value;

    use super::*;

    /// Why the command line is refused before clap reads it, if it is.
    fn refusal(args: impl IntoIterator<Item = OsString>) -> Option<String> {
        pre_parse(args).err()
    }

    fn argv(a: &[&str]) -> Vec<OsString> {
        std::iter::once("kvroute")
            .chain(a.iter().copied())
            .map(OsString::from)
            .collect()
    }

    /// The command line through the pre-parser and clap, as `main` reads it.
    fn parsed(a: &[&str]) -> Result<Args, String> {
        pre_parse(argv(a))?.parse().map_err(|e| e.to_string())
    }

    fn dump(args: &Args) -> Value {
        serde_json::from_str(&args.dump_json()).unwrap()
    }

    #[test]
    fn the_table_agrees_with_the_parser() {
        let own = own_flags();
        let rows: Vec<PeerFlag> = peer_flags().collect();
        assert_eq!(
            rows.len(),
            TABLE.lines().count() - 1,
            "a row without 9 columns"
        );
        assert!(rows.len() > 350, "{} rows", rows.len());
        let mut seen = HashSet::new();
        for row in &rows {
            assert!(seen.insert(row.flag), "{} twice", row.flag);
            // Only refused rows say why.
            assert_eq!(
                row.why.is_empty(),
                row.decision != "refused",
                "{}",
                row.flag
            );
            match row.decision {
                // A flag the table calls kvroute's own is one.
                "same" => assert!(own.contains(row.flag), "{} is not kvroute's", row.flag),
                // A no-op is not also one of kvroute's flags, and says why it changes nothing.
                "noop" | "noop:value" | "noop:bool" => {
                    assert!(!own.contains(row.flag), "{} is kvroute's", row.flag);
                    assert!(row.differs.starts_with(NOOP), "{}", row.flag);
                    assert!(noop_flag(row.flag).is_some_and(|n| !n.why.is_empty()));
                }
                // The scan never shadows one of kvroute's flags.
                "refused" => {
                    assert!(!own.contains(row.flag), "{} is kvroute's", row.flag);
                    assert!(
                        row.why.starts_with("not applicable: ")
                            || row.why.starts_with("not supported yet: "),
                        "{}: {}",
                        row.flag,
                        row.why
                    );
                }
                d => {
                    let (kind, target) = d.split_once(':').unwrap_or((d, ""));
                    assert!(
                        matches!(kind, "alias" | "new") && target.starts_with("--"),
                        "{}: {d}",
                        row.flag
                    );
                    // A flag built under its own name is `same`.
                    assert!(
                        !(target == row.flag && own.contains(row.flag)),
                        "{} is built: make it `same`",
                        row.flag
                    );
                    // An alias names one of kvroute's flags, or one planned.
                    if kind == "alias" {
                        assert!(
                            own.contains(target) || rows.iter().any(|r| r.decision == d),
                            "{}: {target}",
                            row.flag
                        );
                    }
                }
            }
        }
        // Every mapped flag is an alias row of its target.
        for m in &MAPPED {
            let row = rows.iter().find(|r| r.flag == m.flag).unwrap();
            assert_eq!(row.decision, format!("alias:{}", m.target));
            assert!(own.contains(m.target), "{}", m.target);
        }
    }

    #[test]
    fn a_peer_flag_is_refused_by_name_and_kvroutes_pass() {
        let msg = refusal(argv(&["--port", "1", "--job-queue-capacity=5"])).unwrap();
        assert!(
            msg.starts_with("--job-queue-capacity is refused: not applicable"),
            "{msg}"
        );
        let msg = refusal(argv(&["--cb-window-duration-secs", "10"])).unwrap();
        assert!(
            msg.contains("not supported yet") && msg.contains("--cb-window-duration-secs"),
            "{msg}"
        );
        let msg = refusal(argv(&["--no-enable-anthropic-api"])).unwrap();
        assert!(
            msg.contains("not supported yet: turning /v1/messages off"),
            "{msg}"
        );
        // A peer's name kvroute takes as an alias is not refused.
        assert_eq!(refusal(argv(&["--kv-cache-block-size", "16"])), None);
        assert_eq!(refusal(argv(&["--load-monitor-interval", "10"])), None);
        assert_eq!(
            refusal(argv(&["--worker-urls", "http://a", "--queue-size", "3"])),
            None
        );
        // Not a peer's: left to the parser's own error.
        assert_eq!(refusal(argv(&["--no-such-flag"])), None);
        // After `--`, nothing is a flag.
        assert_eq!(refusal(argv(&["--", "--job-queue-capacity"])), None);
    }

    #[test]
    fn no_op_flags_are_taken_out_and_returned() {
        let pre = pre_parse(argv(&[
            "--enforce-disagg",
            "--port",
            "1",
            "--enable-anthropic-api",
        ]))
        .unwrap();
        assert_eq!(pre.args, argv(&["--port", "1"]));
        let flags: Vec<_> = pre.noops.iter().map(|n| n.flag).collect();
        assert_eq!(flags, ["--enforce-disagg", "--enable-anthropic-api"]);
        assert!(pre.noops[1].why.contains("/v1/messages"), "{:?}", pre.noops);
        let args = pre.parse().unwrap();
        assert_eq!(
            args.peer_noop_flags,
            ["--enforce-disagg", "--enable-anthropic-api"]
        );
        let err = pre_parse(argv(&["--enable-igw=true"])).unwrap_err();
        assert_eq!(err, "--enable-igw takes no value");
    }

    #[test]
    fn llm_ds_no_op_flags_take_their_values() {
        let pre = pre_parse(argv(&[
            "--zap-encoder",
            "json",
            "--v=4",
            "--tracing=false",
            "--port",
            "1",
            "-v",
            "2",
            "-v=3",
            "-v5",
            "--ha-enable-leader-election",
            "--metrics-endpoint-auth=False",
            "--refresh-metrics-interval=100ms",
            "--metrics-staleness-threshold",
            "2s",
            "--allow-experimental-plugins=true",
        ]))
        .unwrap();
        assert_eq!(pre.args, argv(&["--port", "1"]));
        let flags: Vec<_> = pre.noops.iter().map(|n| n.flag).collect();
        assert_eq!(
            flags,
            [
                "--zap-encoder",
                "--v",
                "--tracing",
                "--v",
                "--v",
                "--v",
                "--ha-enable-leader-election",
                "--metrics-endpoint-auth",
                "--refresh-metrics-interval",
                "--metrics-staleness-threshold",
                "--allow-experimental-plugins",
            ]
        );
        // A Go boolean flag does not take the next word: it stays for clap (which refuses it).
        let pre = pre_parse(argv(&["--tracing", "false"])).unwrap();
        assert_eq!(pre.args, argv(&["false"]));
        let err = pre_parse(argv(&["--tracing=maybe"])).unwrap_err();
        assert!(
            err.starts_with("--tracing=maybe: maybe is not a boolean"),
            "{err}"
        );
        assert_eq!(
            pre_parse(argv(&["--zap-encoder"])).unwrap_err(),
            "--zap-encoder needs a value"
        );
        assert_eq!(pre_parse(argv(&["-v"])).unwrap_err(), "--v needs a value");
        // Not llm-d's shorthand: left to clap.
        assert_eq!(pre_parse(argv(&["-vx"])).unwrap().args, argv(&["-vx"]));
    }

    #[test]
    fn llm_ds_deployment_arguments_parse() {
        let args = parsed(&[
            "--pool-name",
            "my-pool",
            "--pool-namespace",
            "ns",
            "--pool-group",
            "inference.networking.k8s.io",
            "--zap-encoder",
            "json",
            "--config-file",
            "/config/epp.yaml",
            "--ha-enable-leader-election",
            "--grpc-health-port",
            "9003",
            "--secure-serving=false",
            "--v=4",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
        ])
        .unwrap();
        assert_eq!(args.pool_name.as_deref(), Some("my-pool"));
        assert_eq!(args.secure_serving, Some(false));
        assert_eq!(args.peer_noop_flags.len(), 5, "{:?}", args.peer_noop_flags);
        let standalone = parsed(&[
            "--endpoint-selector",
            "app=vllm",
            "--endpoint-target-ports",
            "8000,8001",
        ])
        .unwrap();
        assert_eq!(standalone.endpoint_target_ports, [8000, 8001]);
        let err = parsed(&["--drain-timeout", "30s"]).unwrap_err();
        assert!(
            err.starts_with("--drain-timeout is refused: not supported yet"),
            "{err}"
        );
    }

    #[test]
    fn assignment_mode_takes_the_peers_min_load() {
        for v in ["min_load", "min-load"] {
            let args = parsed(&["--assignment-mode", v]).unwrap();
            assert_eq!(
                args.assignment_mode,
                Some(crate::config::AssignmentModeArg::MinLoad)
            );
        }
        let err = parsed(&["--assignment-mode", "min_group"]).unwrap_err();
        assert!(
            err.contains("min_group") && err.contains("--assignment-mode"),
            "{err}"
        );
    }

    #[test]
    fn log_level_critical_is_error() {
        let args = parsed(&["--log-level", "critical"]).unwrap();
        assert_eq!(args.log_level, Some(crate::config::LogLevel::Error));
        let file = Args::from_text("log_level: critical\n").unwrap();
        assert_eq!(file.log_level, Some(crate::config::LogLevel::Error));
    }

    #[test]
    fn prefill_none_is_no_bootstrap_port() {
        let settings = parsed(&[
            "--prefill",
            "http://p1:8000",
            "none",
            "--prefill",
            "http://p2:8000",
            "8998",
            "--prefill",
            "http://p3:8000",
            "--decode",
            "http://d:8000",
        ])
        .unwrap()
        .into_settings()
        .unwrap();
        let ports: Vec<_> = settings
            .workers
            .iter()
            .map(|w| (w.url.as_str(), w.bootstrap_port))
            .collect();
        assert_eq!(
            ports[..3],
            [
                ("http://p1:8000", None),
                ("http://p2:8000", Some(8998)),
                ("http://p3:8000", None)
            ]
        );
        // `none` with no URL before it.
        let err = Args::from_text("prefill: [none]\n")
            .unwrap()
            .into_settings()
            .unwrap_err();
        assert!(err.to_string().contains("prefill"), "{err}");
    }

    #[test]
    fn router_ttl_secs_takes_dynamos_float_spelling() {
        assert_eq!(
            parsed(&["--router-ttl-secs", "120.0"])
                .unwrap()
                .router_ttl_secs,
            Some(120)
        );
        assert_eq!(
            parsed(&["--router-ttl-secs", "90"])
                .unwrap()
                .router_ttl_secs,
            Some(90)
        );
        for bad in ["1.5", "-3", "soon"] {
            let err = parsed(&[&format!("--router-ttl-secs={bad}")]).unwrap_err();
            assert!(
                err.contains("--router-ttl-secs") && err.contains(bad),
                "{err}"
            );
        }
        let err = parsed(&["--router-ttl-secs", "1.5"]).unwrap_err();
        assert!(err.contains("whole seconds"), "{err}");
    }

    #[test]
    fn load_monitor_interval_is_seconds_of_metrics_refresh_ms() {
        for a in [
            &["--load-monitor-interval", "10"][..],
            &["--load-monitor-interval=10"],
        ] {
            assert_eq!(parsed(a).unwrap().metrics_refresh_ms, Some(10_000), "{a:?}");
        }
        let err = parsed(&["--load-monitor-interval", "1.5"]).unwrap_err();
        assert_eq!(err, "--load-monitor-interval 1.5: expected whole seconds");
        let err = parsed(&["--load-monitor-interval"]).unwrap_err();
        assert_eq!(err, "--load-monitor-interval needs a value");
        let err =
            parsed(&["--load-monitor-interval", "1", "--metrics-refresh-ms", "5"]).unwrap_err();
        assert!(
            err.contains("--load-monitor-interval and --metrics-refresh-ms"),
            "{err}"
        );
    }

    #[test]
    fn kv_connector_nixl_is_the_vllm_protocol() {
        let args = parsed(&["--kv-connector", "nixl"]).unwrap();
        assert_eq!(args.pd_protocol, Some(crate::config::PdProtocol::Vllm));
        for (v, says) in [
            ("mooncake", "not supported yet: the Mooncake connector"),
            ("moriio", "not supported yet: the MoRI-IO connector"),
            ("ucx", "expected nixl, mooncake or moriio"),
        ] {
            let err = parsed(&["--kv-connector", v]).unwrap_err();
            assert!(
                err.starts_with(&format!("--kv-connector {v}: {says}")),
                "{err}"
            );
        }
        let err = parsed(&["--pd-protocol", "sglang", "--kv-connector", "nixl"]).unwrap_err();
        assert!(
            err.contains("--kv-connector and --pd-protocol both set"),
            "{err}"
        );
    }

    #[test]
    fn router_mode_is_a_policy() {
        use kvroute_core::PolicyKind;
        for (mode, policy) in [
            ("kv", PolicyKind::KvAware),
            ("round-robin", PolicyKind::RoundRobin),
            ("random", PolicyKind::Random),
            ("power-of-two", PolicyKind::PowerOfTwo),
        ] {
            assert_eq!(
                parsed(&["--router-mode", mode]).unwrap().policy,
                Some(policy)
            );
        }
        for (mode, says) in [
            (
                "least-loaded",
                "not supported yet: kvroute has no fewest-in-flight policy",
            ),
            (
                "direct",
                "not supported yet: a mode that refuses requests naming no worker",
            ),
            ("device-aware-weighted", "not applicable"),
            ("fastest", "expected kv, round-robin"),
        ] {
            let err = parsed(&["--router-mode", mode]).unwrap_err();
            assert!(
                err.starts_with(&format!("--router-mode {mode}: {says}")),
                "{err}"
            );
        }
        let err = parsed(&["--router-mode", "kv", "--policy", "kv_aware"]).unwrap_err();
        assert_eq!(
            err,
            "--router-mode and --policy both set --policy; give one of them"
        );
        let err = parsed(&["--router-mode", "kv", "--router-mode=random"]).unwrap_err();
        assert_eq!(err, "--router-mode given twice");
    }

    /// A value for a flag of kvroute's parser, where "3" would not parse or would read
    /// oddly.
    fn sample_overrides() -> HashMap<&'static str, &'static str> {
        HashMap::from([
            ("--policy", "round_robin"),
            ("--prefill-policy", "round_robin"),
            ("--decode-policy", "round_robin"),
            ("--worker-urls", "http://127.0.0.1:9"),
            ("--prefill", "http://127.0.0.1:9"),
            ("--decode", "http://127.0.0.1:9"),
            ("--replica-sync", "nats://127.0.0.1:4222"),
            ("--selector", "app=engine"),
            ("--prefill-selector", "app=engine"),
            ("--decode-selector", "app=engine"),
            ("--host", "0.0.0.0"),
            ("--prometheus-host", "0.0.0.0"),
            ("--health-check-endpoint", "/ready"),
            ("--otlp-traces-endpoint", "localhost:4317"),
            ("--routing-key-headers", "x-tenant"),
            ("--tokenizer", "/models/llama"),
            ("--secure-serving", "false"),
            // Mapped by the pre-parser.
            ("--load-monitor-interval", "7"),
            ("--kv-connector", "nixl"),
            ("--router-mode", "kv"),
        ])
    }

    /// Walks the table: every peer flag kvroute takes parses as `main` reads it and shows in
    /// the dump of the settings; every other one is refused by name.
    #[test]
    fn every_flag_kvroute_takes_shows_in_the_dump_and_the_rest_are_refused() {
        let own = own_flags();
        let cmd = <Args as clap::CommandFactory>::command();
        let overrides = sample_overrides();
        let default = dump(&parsed(&[]).unwrap());
        let secrets = [
            "admin_api_key",
            "client_api_key",
            "api_key",
            "tenant_api_key",
        ];
        let mut walked = 0;
        for row in peer_flags() {
            if !accepted(row.flag, &own) {
                let err = parsed(&[row.flag, "x"]).unwrap_err();
                assert!(err.starts_with(row.flag), "{}: {err}", row.flag);
                continue;
            }
            walked += 1;
            if let Some(noop) = noop_flag(row.flag) {
                let line: &[&str] = match noop.takes {
                    NoopValue::Nothing | NoopValue::Bool => &[row.flag],
                    NoopValue::Value => &[row.flag, "x"],
                };
                let args = parsed(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
                let mut d = dump(&args);
                assert_eq!(d["peer_noop_flags"], serde_json::json!([row.flag]));
                d["peer_noop_flags"] = serde_json::json!([]);
                assert_eq!(d, default, "{} changes a setting", row.flag);
                continue;
            }
            // The flag clap reads: the flag itself, or what the pre-parser maps it to.
            let target = MAPPED
                .iter()
                .find(|m| m.flag == row.flag)
                .map_or(row.flag, |m| m.target);
            let arg = cmd
                .get_arguments()
                .find(|a| {
                    a.get_long()
                        .into_iter()
                        .chain(a.get_all_aliases().unwrap_or_default())
                        .any(|l| format!("--{l}") == target)
                })
                .unwrap_or_else(|| panic!("{target} is not kvroute's"));
            let key = arg.get_id().as_str();
            let takes_value = arg.get_action().takes_values();
            let possible = arg.get_possible_values();
            let sample = overrides
                .get(row.flag)
                .copied()
                .or_else(|| possible.first().map(|p| p.get_name()))
                .unwrap_or("3");
            let joined = format!("{}={sample}", row.flag);
            let line: Vec<&str> = if arg.is_require_equals_set() {
                vec![&joined]
            } else if takes_value {
                vec![row.flag, sample]
            } else {
                vec![row.flag]
            };
            let args = parsed(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            let d = dump(&args);
            if key == "dump_config_to" {
                // Not part of the config file's schema.
                assert!(args.dump_config_to.is_some());
                assert_eq!(d, default);
                continue;
            }
            if secrets.contains(&key) {
                // Parsed, and left out of the dump.
                assert_eq!(d, default, "{line:?} shows in the dump");
                continue;
            }
            assert_ne!(d[key], default[key], "{line:?}: {key} unchanged");
        }
        assert!(walked > 100, "{walked} flags walked");
    }

    #[test]
    fn the_mapped_flags_show_as_their_targets_in_the_dump() {
        let args = parsed(&[
            "--router-mode",
            "power-of-two",
            "--kv-connector=nixl",
            "--load-monitor-interval",
            "2",
            "--no-serve-indexer",
        ])
        .unwrap();
        let d = dump(&args);
        assert_eq!(d["policy"], "power_of_two");
        assert_eq!(d["pd_protocol"], "vllm");
        assert_eq!(d["metrics_refresh_ms"], 2000);
        assert_eq!(
            d["peer_noop_flags"],
            serde_json::json!(["--no-serve-indexer"])
        );
        // The dump loads back with the no-op flags listed.
        let back = Args::from_text(&args.dump_json()).unwrap();
        assert_eq!(back.peer_noop_flags, ["--no-serve-indexer"]);
    }

    /// The table [`TABLE_PAGE`] shows is the generated one; `KVROUTE_BLESS=1` rewrites it
    /// (in place, or at the page's end when the page has no such section yet).
    #[test]
    fn the_peer_flag_table_is_the_generated_one() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let path = format!("{root}/{TABLE_PAGE}");
        let page = std::fs::read_to_string(&path).unwrap();
        let fresh = flags_table();
        let current = flags_section(&page);
        if current.map(str::trim_end) == Some(fresh.trim_end()) {
            return;
        }
        if std::env::var_os("KVROUTE_BLESS").is_some_and(|v| v == "1") {
            let updated = match current {
                Some(old) => page.replacen(old.trim_end(), fresh.trim_end(), 1),
                None => format!("{}\n\n{fresh}", page.trim_end()),
            };
            std::fs::write(&path, updated).unwrap();
            return;
        }
        let out = format!("{root}/target/peer-flags-table.md");
        let written = std::fs::create_dir_all(format!("{root}/target"))
            .and_then(|()| std::fs::write(&out, &fresh))
            .is_ok();
        panic!(
            "{TABLE_PAGE}'s section '{TABLE_HEADING}' differs from the table (peer_flags.tsv and \
             the parser); {} or rerun with KVROUTE_BLESS=1 to write it:\n{fresh}",
            if written {
                format!("the fresh text is in {out}: paste it")
            } else {
                "paste the text below".to_owned()
            }
        );
    }

    #[test]
    fn the_table_cells_escape_markdown() {
        assert_eq!(cell("a|b *x* <key>"), "a\\|b \\*x\\* &lt;key&gt;");
        assert_eq!(
            cell_keeping_code("alias of `--x` a|b"),
            "alias of `--x` a\\|b"
        );
        assert_eq!(wrap("aa bb cc dddddd e", 5), "aa bb\ncc\ndddddd\ne\n");
        let text = "# t\n\n## Flags of the peer routers\n\nx\n\n## Layout\n";
        assert_eq!(
            flags_section(text),
            Some("## Flags of the peer routers\n\nx\n\n")
        );
        let own = own_flags();
        let kv = |flag: &str| kvroute_column(&peer_flags().find(|r| r.flag == flag).unwrap(), &own);
        assert_eq!(kv("--port"), "same");
        assert_eq!(kv("--http-port"), "alias of `--port`");
        assert_eq!(kv("--router-mode"), "alias of `--policy`");
        assert_eq!(kv("--enforce-disagg"), "accepted, no effect");
        assert!(kv("--job-queue-capacity").starts_with("refused: not applicable: "));
        assert_eq!(
            kv("--cb-window-duration-secs"),
            "not supported yet (planned as `--cb-window-duration-secs`)"
        );
    }
}
