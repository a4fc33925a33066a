//! The generators' flags: one clap struct for all three, each flag naming the generators it
//! applies to; [`SyntheticArgs::resolve`] refuses a flag given to another generator, fills the
//! unset ones with that generator's defaults and checks the values once.

use super::{Agentic, MultiTurn, SharedPrefix, Synthetic, SyntheticKind};

/// A flag that does not fit the generator or a value it cannot use.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SyntheticError {
    #[error("--{flag} applies to --synthetic {} only", names(kinds))]
    OtherKind {
        flag: &'static str,
        kinds: &'static [SyntheticKind],
    },
    #[error("--{flag} must be positive")]
    NotPositive { flag: &'static str },
    #[error("--min-turns ({min}) must be at most --max-turns ({max})")]
    TurnRange { min: usize, max: usize },
}

/// "shared-prefix and agentic".
fn names(kinds: &[SyntheticKind]) -> String {
    let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
    names.join(" and ")
}

/// The generators' flags; each applies to one generator (or some), unset ones take that
/// generator's default.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Synthetic workload (with --synthetic)")]
pub struct SyntheticArgs {
    /// shared-prefix: groups, each with its own system prompt [default: 150]
    #[arg(long, conflicts_with = "trace")]
    pub groups: Option<usize>,
    /// shared-prefix: prompts per group [default: 5]
    #[arg(long, conflicts_with = "trace")]
    pub prompts_per_group: Option<usize>,
    /// shared-prefix, agentic: tokens of a group's (an agent type's) system prompt; shared as whole hash blocks [default: 6000 shared-prefix, 6144 agentic]
    #[arg(long, conflicts_with = "trace")]
    pub system_prompt_len: Option<usize>,
    /// shared-prefix: tokens of each prompt's own question [default: 1200]
    #[arg(long, conflicts_with = "trace")]
    pub question_len: Option<usize>,
    /// multi-turn: conversations [default: 100]
    #[arg(long, conflicts_with = "trace")]
    pub conversations: Option<usize>,
    /// multi-turn: turns per conversation [default: 5]
    #[arg(long, conflicts_with = "trace")]
    pub turns: Option<usize>,
    /// multi-turn: tokens of each new user message [default: 500]
    #[arg(long, conflicts_with = "trace")]
    pub turn_len: Option<usize>,
    /// agentic: agent types, each with its own system prompt and tools [default: 4]
    #[arg(long, conflicts_with = "trace")]
    pub agent_types: Option<usize>,
    /// agentic: agent sessions [default: 100]
    #[arg(long, conflicts_with = "trace")]
    pub sessions: Option<usize>,
    /// agentic: fewest steps (requests) in a session, drawn uniformly up to --max-turns [default: 5]
    #[arg(long, conflicts_with = "trace")]
    pub min_turns: Option<usize>,
    /// agentic: most steps in a session [default: 30]
    #[arg(long, conflicts_with = "trace")]
    pub max_turns: Option<usize>,
    /// agentic: median tokens of a tool's result (log-normal, up to 32x the median) [default: 300]
    #[arg(long, conflicts_with = "trace")]
    pub tool_result_len: Option<usize>,
    /// agentic: mean milliseconds a tool runs before the next step (exponential) [default: 1000]
    #[arg(long, conflicts_with = "trace")]
    pub tool_time_ms: Option<u64>,
    /// agentic: sessions started per second, Poisson [default: 1]
    #[arg(long, conflicts_with = "trace")]
    pub session_rate: Option<f64>,
    /// Output tokens per request (agentic: of a session's final answer; its tool calls draw 50-300) [default: 1000 shared-prefix, 200 multi-turn, 800 agentic]
    #[arg(long, conflicts_with = "trace")]
    pub output_len: Option<usize>,
    /// shared-prefix, multi-turn: mean arrivals per second, Poisson [default: 10]
    #[arg(long, conflicts_with = "trace")]
    pub request_rate: Option<f64>,
}

impl SyntheticArgs {
    /// The workload of `kind`, or which flag does not fit it.
    pub fn resolve(&self, kind: SyntheticKind) -> Result<Synthetic, SyntheticError> {
        self.refuse_other_kinds(kind)?;
        let spec = match kind {
            SyntheticKind::SharedPrefix => {
                let d = SharedPrefix::default();
                Synthetic::SharedPrefix(SharedPrefix {
                    groups: self.groups.unwrap_or(d.groups),
                    prompts_per_group: self.prompts_per_group.unwrap_or(d.prompts_per_group),
                    system_prompt_len: self.system_prompt_len.unwrap_or(d.system_prompt_len),
                    question_len: self.question_len.unwrap_or(d.question_len),
                    output_len: self.output_len.unwrap_or(d.output_len),
                    request_rate: self.request_rate.unwrap_or(d.request_rate),
                })
            }
            SyntheticKind::MultiTurn => {
                let d = MultiTurn::default();
                Synthetic::MultiTurn(MultiTurn {
                    conversations: self.conversations.unwrap_or(d.conversations),
                    turns: self.turns.unwrap_or(d.turns),
                    turn_len: self.turn_len.unwrap_or(d.turn_len),
                    output_len: self.output_len.unwrap_or(d.output_len),
                    request_rate: self.request_rate.unwrap_or(d.request_rate),
                })
            }
            SyntheticKind::Agentic => {
                let d = Agentic::default();
                Synthetic::Agentic(Agentic {
                    agent_types: self.agent_types.unwrap_or(d.agent_types),
                    sessions: self.sessions.unwrap_or(d.sessions),
                    min_turns: self.min_turns.unwrap_or(d.min_turns),
                    max_turns: self.max_turns.unwrap_or(d.max_turns),
                    system_prompt_len: self.system_prompt_len.unwrap_or(d.system_prompt_len),
                    tool_result_len: self.tool_result_len.unwrap_or(d.tool_result_len),
                    tool_time_ms: self.tool_time_ms.unwrap_or(d.tool_time_ms),
                    output_len: self.output_len.unwrap_or(d.output_len),
                    session_rate: self.session_rate.unwrap_or(d.session_rate),
                })
            }
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The first flag given that `kind` does not take.
    fn refuse_other_kinds(&self, kind: SyntheticKind) -> Result<(), SyntheticError> {
        use SyntheticKind::{Agentic as A, MultiTurn as M, SharedPrefix as S};
        let flags: [(&'static str, bool, &'static [SyntheticKind]); 16] = [
            ("groups", self.groups.is_some(), &[S]),
            ("prompts-per-group", self.prompts_per_group.is_some(), &[S]),
            (
                "system-prompt-len",
                self.system_prompt_len.is_some(),
                &[S, A],
            ),
            ("question-len", self.question_len.is_some(), &[S]),
            ("conversations", self.conversations.is_some(), &[M]),
            ("turns", self.turns.is_some(), &[M]),
            ("turn-len", self.turn_len.is_some(), &[M]),
            ("agent-types", self.agent_types.is_some(), &[A]),
            ("sessions", self.sessions.is_some(), &[A]),
            ("min-turns", self.min_turns.is_some(), &[A]),
            ("max-turns", self.max_turns.is_some(), &[A]),
            ("tool-result-len", self.tool_result_len.is_some(), &[A]),
            ("tool-time-ms", self.tool_time_ms.is_some(), &[A]),
            ("session-rate", self.session_rate.is_some(), &[A]),
            ("output-len", self.output_len.is_some(), &[S, M, A]),
            ("request-rate", self.request_rate.is_some(), &[S, M]),
        ];
        match flags
            .into_iter()
            .find(|(_, set, kinds)| *set && !kinds.contains(&kind))
        {
            Some((flag, _, kinds)) => Err(SyntheticError::OtherKind { flag, kinds }),
            None => Ok(()),
        }
    }
}

impl Synthetic {
    /// The first value the generator cannot use.
    fn validate(&self) -> Result<(), SyntheticError> {
        let rate = |r: f64| r > 0.0 && r.is_finite();
        let checks = match self {
            Synthetic::SharedPrefix(s) => vec![
                ("groups", s.groups > 0),
                ("prompts-per-group", s.prompts_per_group > 0),
                ("question-len", s.question_len > 0),
                ("request-rate", rate(s.request_rate)),
            ],
            Synthetic::MultiTurn(m) => vec![
                ("conversations", m.conversations > 0),
                ("turns", m.turns > 0),
                ("turn-len", m.turn_len > 0),
                ("request-rate", rate(m.request_rate)),
            ],
            Synthetic::Agentic(a) => {
                if a.min_turns > a.max_turns {
                    return Err(SyntheticError::TurnRange {
                        min: a.min_turns,
                        max: a.max_turns,
                    });
                }
                vec![
                    ("agent-types", a.agent_types > 0),
                    ("sessions", a.sessions > 0),
                    ("min-turns", a.min_turns > 0),
                    ("tool-result-len", a.tool_result_len > 0),
                    ("session-rate", rate(a.session_rate)),
                ]
            }
        };
        match checks.into_iter().find(|(_, ok)| !ok) {
            Some((flag, _)) => Err(SyntheticError::NotPositive { flag }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command};

    use super::*;

    #[test]
    fn flags_resolve_with_defaults_and_refuse_the_other_generator() {
        let args = SyntheticArgs {
            groups: Some(4),
            ..SyntheticArgs::default()
        };
        assert_eq!(
            args.resolve(SyntheticKind::SharedPrefix),
            Ok(Synthetic::SharedPrefix(SharedPrefix {
                groups: 4,
                ..SharedPrefix::default()
            }))
        );
        assert_eq!(
            args.resolve(SyntheticKind::MultiTurn)
                .unwrap_err()
                .to_string(),
            "--groups applies to --synthetic shared-prefix only"
        );
        let zero = SyntheticArgs {
            turns: Some(0),
            ..SyntheticArgs::default()
        };
        assert_eq!(
            zero.resolve(SyntheticKind::MultiTurn),
            Err(SyntheticError::NotPositive { flag: "turns" })
        );
    }

    #[test]
    fn agentic_takes_its_own_flags_and_the_shared_ones() {
        let args = SyntheticArgs {
            sessions: Some(7),
            system_prompt_len: Some(2048),
            output_len: Some(50),
            ..SyntheticArgs::default()
        };
        assert_eq!(
            args.resolve(SyntheticKind::Agentic),
            Ok(Synthetic::Agentic(Agentic {
                sessions: 7,
                system_prompt_len: 2048,
                output_len: 50,
                ..Agentic::default()
            }))
        );
        let refused = |args: SyntheticArgs, kind| args.resolve(kind).unwrap_err().to_string();
        assert_eq!(
            refused(args, SyntheticKind::MultiTurn),
            "--system-prompt-len applies to --synthetic shared-prefix and agentic only"
        );
        for (args, message) in [
            (
                SyntheticArgs {
                    turns: Some(3),
                    ..SyntheticArgs::default()
                },
                "--turns applies to --synthetic multi-turn only",
            ),
            (
                SyntheticArgs {
                    request_rate: Some(3.0),
                    ..SyntheticArgs::default()
                },
                "--request-rate applies to --synthetic shared-prefix and multi-turn only",
            ),
        ] {
            assert_eq!(refused(args, SyntheticKind::Agentic), message);
        }
        for kind in [SyntheticKind::SharedPrefix, SyntheticKind::MultiTurn] {
            let args = SyntheticArgs {
                session_rate: Some(2.0),
                ..SyntheticArgs::default()
            };
            assert_eq!(
                refused(args, kind),
                "--session-rate applies to --synthetic agentic only"
            );
        }
    }

    #[test]
    fn agentic_refuses_values_it_cannot_use() {
        let resolve = |args: SyntheticArgs| args.resolve(SyntheticKind::Agentic);
        assert_eq!(
            resolve(SyntheticArgs {
                min_turns: Some(9),
                max_turns: Some(3),
                ..SyntheticArgs::default()
            }),
            Err(SyntheticError::TurnRange { min: 9, max: 3 })
        );
        for (args, flag) in [
            (
                SyntheticArgs {
                    agent_types: Some(0),
                    ..SyntheticArgs::default()
                },
                "agent-types",
            ),
            (
                SyntheticArgs {
                    min_turns: Some(0),
                    ..SyntheticArgs::default()
                },
                "min-turns",
            ),
            (
                SyntheticArgs {
                    session_rate: Some(f64::INFINITY),
                    ..SyntheticArgs::default()
                },
                "session-rate",
            ),
        ] {
            assert_eq!(resolve(args), Err(SyntheticError::NotPositive { flag }));
        }
    }

    #[test]
    fn the_help_states_the_defaults() {
        let command = Command::new("t").arg(clap::Arg::new("trace").long("trace"));
        let help = SyntheticArgs::augment_args(command)
            .render_long_help()
            .to_string();
        let (s, m, a) = (
            SharedPrefix::default(),
            MultiTurn::default(),
            Agentic::default(),
        );
        for (flag, default) in [
            ("--groups", s.groups.to_string()),
            ("--prompts-per-group", s.prompts_per_group.to_string()),
            ("--question-len", s.question_len.to_string()),
            ("--conversations", m.conversations.to_string()),
            ("--turns", m.turns.to_string()),
            ("--turn-len", m.turn_len.to_string()),
            ("--agent-types", a.agent_types.to_string()),
            ("--sessions", a.sessions.to_string()),
            ("--min-turns", a.min_turns.to_string()),
            ("--max-turns", a.max_turns.to_string()),
            ("--tool-result-len", a.tool_result_len.to_string()),
            ("--tool-time-ms", a.tool_time_ms.to_string()),
            ("--session-rate", a.session_rate.to_string()),
            ("--request-rate", s.request_rate.to_string()),
            (
                "--system-prompt-len",
                format!(
                    "{} shared-prefix, {} agentic",
                    s.system_prompt_len, a.system_prompt_len
                ),
            ),
            (
                "--output-len",
                format!(
                    "{} shared-prefix, {} multi-turn, {} agentic",
                    s.output_len, m.output_len, a.output_len
                ),
            ),
        ] {
            let mut lines = help.lines();
            lines
                .find(|l| l.trim_start().starts_with(&format!("{flag} <")))
                .unwrap_or_else(|| panic!("{flag} in {help}"));
            let doc = lines.next().unwrap_or_default();
            assert!(
                doc.ends_with(&format!("[default: {default}]")),
                "{flag}: {doc}"
            );
        }
        assert_eq!(s.request_rate, m.request_rate);
    }
}
