//! The fallback tokenizer, shared by the router and `kvroute-sim` when no tokenizer is
//! configured, so both produce identical token ids for identical requests.
//!
//! - Text is tokenised as its UTF-8 bytes: token id = byte value (0..=255). No special
//!   tokens are added.
//! - A chat is rendered as one `role: content\n` line per message (content parts' texts
//!   joined with single spaces), then `assistant: `, and that text is tokenised as above.
//! - Token ids become text again as bytes, decoded lossily as UTF-8.

/// Token ids of `text`: its bytes.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Text of `ids`: the bytes they stand for (ids above 255 are skipped), lossy UTF-8.
pub fn decode(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The chat rendering: `role: content\n` per message, then `assistant: `.
pub fn render_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out.push_str(role);
        out.push_str(": ");
        out.push_str(content);
        out.push('\n');
    }
    out.push_str("assistant: ");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_tokens_and_chats_are_lines() {
        assert_eq!(encode("hi é"), vec![104, 105, 32, 195, 169]);
        assert_eq!(decode(&encode("hi é")), "hi é");
        assert_eq!(
            render_chat([("system", "be brief"), ("user", "hello")]),
            "system: be brief\nuser: hello\nassistant: "
        );
        assert_eq!(render_chat([]), "assistant: ");
    }
}
