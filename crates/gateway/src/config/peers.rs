//! The peers' flags kvroute does not take, refused by name before the command line is
//! parsed.
//!
//! `peer_flags.tsv` has one row for each flag of smg 1.13 `launch`, vllm-router 0.1.17,
//! sglang-router 0.3.2 and Dynamo 1.6.1's frontend. Its columns are the flag, each peer's
//! default, kvroute's decision (`same`, `alias:--flag`, `new:--flag` or `refused`), how the
//! meanings differ, and for a refused flag why (`not applicable: ...` or
//! `not supported yet: ...`). A flag of that table that kvroute's own parser does not know
//! exits with status 2 and a message naming it and saying why, instead of clap's generic
//! "unexpected argument". The table's `alias:` and `new:` rows kvroute has not built yet
//! are refused as not supported yet.

use std::collections::HashSet;
use std::ffi::OsString;

const TABLE: &str = include_str!("peer_flags.tsv");

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFlag {
    pub flag: &'static str,
    /// `same`, `alias:--flag`, `new:--flag` or `refused`.
    pub decision: &'static str,
    pub why: &'static str,
}

/// Every row of the table.
pub fn peer_flags() -> impl Iterator<Item = PeerFlag> {
    TABLE.lines().skip(1).filter_map(|line| {
        let cols: Vec<&'static str> = line.split('\t').collect();
        (cols.len() == 8).then(|| PeerFlag {
            flag: cols[0],
            decision: cols[5],
            why: cols[7],
        })
    })
}

/// The long flags (and their aliases) kvroute's parser takes.
pub fn own_flags() -> HashSet<String> {
    let cmd = <super::Args as clap::CommandFactory>::command();
    cmd.get_arguments()
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(|l| format!("--{l}"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Why `flag`, a peer's, is refused; `None` when kvroute takes it or no peer has it.
fn refusal_of(flag: &str, own: &HashSet<String>) -> Option<String> {
    if own.contains(flag) {
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

/// The message for the first peer flag of `args` (the program's name first) that kvroute
/// refuses, if any.
pub fn refusal(args: impl IntoIterator<Item = OsString>) -> Option<String> {
    let own = own_flags();
    args.into_iter().skip(1).find_map(|arg| {
        let arg = arg.to_str()?;
        if !arg.starts_with("--") || arg == "--" {
            return None;
        }
        let flag = arg.split_once('=').map_or(arg, |(f, _)| f);
        refusal_of(flag, &own)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_agrees_with_the_parser() {
        let own = own_flags();
        let rows: Vec<PeerFlag> = peer_flags().collect();
        assert!(rows.len() > 350, "{} rows", rows.len());
        for row in &rows {
            match row.decision {
                // A flag the table calls kvroute's own is one.
                "same" => assert!(own.contains(row.flag), "{} is not kvroute's", row.flag),
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
                d => assert!(
                    d.starts_with("alias:--") || d.starts_with("new:--"),
                    "{}: {d}",
                    row.flag
                ),
            }
        }
    }

    #[test]
    fn a_peer_flag_is_refused_by_name_and_kvroutes_pass() {
        let args = |a: &[&str]| {
            std::iter::once("kvroute")
                .chain(a.iter().copied())
                .map(OsString::from)
                .collect::<Vec<_>>()
        };
        let msg = refusal(args(&["--port", "1", "--job-queue-capacity=5"])).unwrap();
        assert!(
            msg.starts_with("--job-queue-capacity is refused: not applicable"),
            "{msg}"
        );
        let msg = refusal(args(&["--load-monitor-interval", "10"])).unwrap();
        assert!(
            msg.contains("not supported yet") && msg.contains("--metrics-refresh-ms"),
            "{msg}"
        );
        // A peer's name kvroute takes as an alias is not refused.
        assert_eq!(refusal(args(&["--kv-cache-block-size", "16"])), None);
        assert_eq!(
            refusal(args(&["--worker-urls", "http://a", "--queue-size", "3"])),
            None
        );
        // Not a peer's: left to the parser's own error.
        assert_eq!(refusal(args(&["--no-such-flag"])), None);
    }
}
