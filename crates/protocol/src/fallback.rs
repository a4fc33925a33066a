//! The fallback tokenizer, shared by the router and `kvroute-sim` when no tokenizer is
//! configured, so both produce identical token ids for identical requests.
//!
//! - Text is tokenised as its UTF-8 bytes: token id = byte value (0..=255). No special
//!   tokens are added.
//! - A chat is rendered as one `role: content\n` line per message (content parts' texts
//!   joined with single spaces), then, as a chat template ends (see [`ChatEnd`]): by default
//!   `assistant: ` (the generation prompt); nothing more without a generation prompt; or,
//!   to continue the final message, that message's line without its newline. That text is
//!   tokenised as above.
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

/// How a rendered chat ends after its messages, as vLLM's chat options make a chat
/// template end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnd {
    /// The assistant's turn is opened: `assistant: ` (`add_generation_prompt`, vLLM's
    /// default).
    #[default]
    GenerationPrompt,
    /// Nothing after the last message's line (`add_generation_prompt: false`).
    Closed,
    /// The final message is left open, its line without the newline, so the model
    /// continues its text (`continue_final_message: true`). An empty chat renders empty.
    ContinueFinal,
}

/// The chat rendering: `role: content\n` per message, ended as `end` says.
pub fn render_chat<'a>(
    messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    end: ChatEnd,
) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out.push_str(role);
        out.push_str(": ");
        out.push_str(content);
        out.push('\n');
    }
    match end {
        ChatEnd::GenerationPrompt => out.push_str("assistant: "),
        ChatEnd::Closed => {}
        ChatEnd::ContinueFinal => {
            out.pop();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_tokens_and_chats_are_lines() {
        assert_eq!(encode("hi é"), vec![104, 105, 32, 195, 169]);
        assert_eq!(decode(&encode("hi é")), "hi é");
        let chat = [("system", "be brief"), ("user", "hello")];
        assert_eq!(
            render_chat(chat, ChatEnd::default()),
            "system: be brief\nuser: hello\nassistant: "
        );
        assert_eq!(render_chat([], ChatEnd::GenerationPrompt), "assistant: ");
    }

    #[test]
    fn a_chat_ends_as_its_options_say() {
        let chat = [("user", "hello"), ("assistant", "Hi, I am")];
        assert_eq!(
            render_chat(chat, ChatEnd::Closed),
            "user: hello\nassistant: Hi, I am\n"
        );
        // Continuing: the generated text so far, with nothing after it.
        assert_eq!(
            render_chat(chat, ChatEnd::ContinueFinal),
            "user: hello\nassistant: Hi, I am"
        );
        assert_eq!(
            render_chat([("user", "hi"), ("assistant", "")], ChatEnd::ContinueFinal),
            "user: hi\nassistant: "
        );
        assert_eq!(render_chat([], ChatEnd::Closed), "");
        assert_eq!(render_chat([], ChatEnd::ContinueFinal), "");
    }
}
