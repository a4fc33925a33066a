//! Where a prompt's text may be cut so that its two sides, tokenised apart, give exactly the
//! ids of the whole: the safe cut points the prefix cache ([`crate::PrefixCache`]) keys on.
//!
//! A Hugging Face tokenizer works in stages: it splits the text around its added tokens,
//! normalises each piece, pre-tokenises it into words, and runs its model on each word. No
//! stage looks across a boundary of the stage before, so a cut is safe when it provably falls
//! on one of those boundaries and neither side sees anything of the other:
//!
//! - **After an added token** that is matched as itself (not normalised when a normaliser is
//!   set, no `single_word` or `rstrip`, and no other added token contains it or overlaps its
//!   ends), when each piece is processed alone whatever its offset (no `Metaspace` with
//!   `prepend_scheme: first`, which only prefixes the piece at offset 0). With an
//!   `lstrip` token in the vocabulary, also only before a character that is not whitespace.
//! - **After a newline** for the GPT-2 byte-level pre-tokenizer (`ByteLevel` with its regex,
//!   no prefix space, no normaliser, no added token holding a newline or stripping spaces):
//!   when the character before the newline and the one after it are not whitespace, the
//!   newline is a word of its own in the whole text (`\s+(?!\S)` fails before the next
//!   character and `\s+` takes the newline alone; no other branch of the regex takes a
//!   newline) and in the part before the cut (`\s+(?!\S)` at the end), so the words on each
//!   side are the same as in the whole.
//!
//! Anything else is never cut: a tokenizer whose stages are not among these gets no cut
//! points, and the cache passes its prompts through whole.

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, PostProcessor};

/// The cut rules of one tokenizer, decided once at load.
#[derive(Debug, Default)]
pub(crate) struct Cuts {
    /// The added tokens a cut may follow, matched leftmost-longest as the tokenizer does.
    after_tokens: Option<AhoCorasick>,
    /// Whether a token cut also needs a non-whitespace character after it.
    token_needs_text_after: bool,
    /// Whether newlines between two non-whitespace characters are cut points.
    newlines: bool,
    /// The ids `encode(text, true)` puts before `encode(text, false)`, when it adds nothing
    /// else (`None`: prompts with special tokens are not cut).
    pub special_prefix: Option<Vec<u32>>,
}

type Tk = tokenizers::Tokenizer;

impl Cuts {
    pub fn of(tokenizer: &Tk) -> Self {
        let normalizer = tokenizer.get_normalizer();
        let pre = tokenizer.get_pre_tokenizer();
        let added: Vec<AddedToken> = tokenizer.get_added_tokens_decoder().into_values().collect();
        let any_lstrip = added.iter().any(|t| t.lstrip);
        let any_strip = added.iter().any(|t| t.lstrip || t.rstrip);
        let encode_specials = tokenizer.get_added_vocabulary().get_encode_special_tokens();

        let pieces_alone = pre.is_none_or(pieces_independent);
        let after_tokens = pieces_alone
            .then(|| {
                let eligible: Vec<&str> = added
                    .iter()
                    .filter(|t| !(t.special && encode_specials))
                    .filter(|t| !t.single_word && !t.rstrip && !t.content.is_empty())
                    .filter(|t| !t.normalized || normalizer.is_none())
                    .filter(|t| {
                        added
                            .iter()
                            .all(|u| u.content == t.content || !entangled(&t.content, &u.content))
                    })
                    .map(|t| t.content.as_str())
                    .collect();
                (!eligible.is_empty()).then(|| {
                    AhoCorasick::builder()
                        .match_kind(MatchKind::LeftmostLongest)
                        .build(eligible)
                        .ok()
                })
            })
            .flatten()
            .flatten();
        let newlines = normalizer.is_none()
            && matches!(pre, Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space)
            && !any_strip
            && added.iter().all(|t| !t.content.contains('\n'));
        Self {
            after_tokens,
            token_needs_text_after: any_lstrip,
            newlines,
            special_prefix: special_prefix(tokenizer),
        }
    }

    /// Whether any text can be cut at all.
    pub fn any(&self) -> bool {
        self.after_tokens.is_some() || self.newlines
    }

    /// The safe cut points of `text`, ascending, each strictly inside it.
    pub fn find(&self, text: &str) -> Vec<usize> {
        let mut cuts = Vec::new();
        let text_after = |c: usize| {
            text[c..]
                .chars()
                .next()
                .is_some_and(|ch| !ch.is_whitespace())
        };
        if let Some(tokens) = &self.after_tokens {
            for m in tokens.find_iter(text) {
                let c = m.end();
                if c < text.len() && (!self.token_needs_text_after || text_after(c)) {
                    cuts.push(c);
                }
            }
        }
        if self.newlines {
            let bytes = text.as_bytes();
            for at in memchr::memchr_iter(b'\n', bytes) {
                let c = at + 1;
                let before = text[..at].chars().next_back();
                if before.is_some_and(|ch| !ch.is_whitespace()) && text_after(c) {
                    cuts.push(c);
                }
            }
            cuts.sort_unstable();
            cuts.dedup();
        }
        cuts
    }
}

/// Whether every piece between added tokens is pre-tokenised the same wherever it stands.
fn pieces_independent(pre: &PreTokenizerWrapper) -> bool {
    match pre {
        PreTokenizerWrapper::Metaspace(m) => m.get_prepend_scheme() != PrependScheme::First,
        PreTokenizerWrapper::Sequence(s) => s.as_ref().iter().all(pieces_independent),
        _ => true,
    }
}

/// Whether `u` could take part of `t`'s text when both are matched: it contains `t`, or one
/// ends with what the other starts with.
fn entangled(t: &str, u: &str) -> bool {
    let overlaps = |a: &str, b: &str| {
        (1..a.len().min(b.len()))
            .filter(|&n| a.is_char_boundary(a.len() - n) && b.is_char_boundary(n))
            .any(|n| a[a.len() - n..] == b[..n])
    };
    u.contains(t) || overlaps(t, u) || overlaps(u, t)
}

/// The special ids the post-processor puts before a single sequence, when it puts nothing
/// after it.
fn special_prefix(tokenizer: &Tk) -> Option<Vec<u32>> {
    match tokenizer.get_post_processor() {
        None | Some(PostProcessorWrapper::ByteLevel(_)) => Some(Vec::new()),
        Some(p @ PostProcessorWrapper::Template(t)) => {
            // The single-sequence template: special tokens, then the sequence, last.
            let template = serde_json::to_value(t).ok()?;
            let (last, before) = template.get("single")?.as_array()?.split_last()?;
            if last.get("Sequence").is_none()
                || before.iter().any(|p| p.get("SpecialToken").is_none())
            {
                return None;
            }
            let ids = tokenizer.encode_fast("", true).ok()?.get_ids().to_vec();
            (ids.len() == p.added_tokens(false)).then_some(ids)
        }
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entangled_tokens_are_those_sharing_text() {
        assert!(entangled("<a>", "<a>b"));
        assert!(entangled("<a>", "x<"));
        assert!(entangled("<a>", ">y"));
        assert!(!entangled("<a>", "<b>"));
        assert!(!entangled("<|im_end|>", "<|im_start|>"));
    }

    #[test]
    fn normaliser_none_and_no_tokens_cut_nowhere() {
        assert!(!Cuts::default().any());
        assert!(Cuts::default().find("a\nb").is_empty());
    }
}
