//! Without a tokenizer, the crate is exactly `kvroute_protocol::fallback`.

use kvroute_protocol::fallback::{self, ChatEnd};
use kvroute_tokenizer::{ChatOptions, Tokenizer};
use serde_json::json;

#[test]
fn prompts_are_their_bytes() {
    let t = Tokenizer::fallback();
    assert!(t.is_fallback() && Tokenizer::default().is_fallback());
    for text in ["hello there, router", "", "héllo ✓"] {
        assert_eq!(t.encode_prompt(text).unwrap(), fallback::encode(text));
        assert_eq!(t.encode(text, false).unwrap(), fallback::encode(text));
    }
    let ids = t.encode_prompt("héllo").unwrap();
    assert_eq!(t.decode(&ids).unwrap(), fallback::decode(&ids));
    assert_eq!(t.vocab_size(), 256);
    assert_eq!(t.eos_token_id(), None);
}

#[test]
fn chats_are_role_content_lines() {
    let t = Tokenizer::fallback();
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "hello"},
            {"type": "image_url", "image_url": {"url": "u"}},
            {"type": "text", "text": "there"}
        ]},
        {"role": "assistant", "content": null},
        {"role": "user"}
    ]);
    let lines = [
        ("system", "be brief"),
        ("user", "hello there"),
        ("assistant", ""),
        ("user", ""),
    ];
    let expected = fallback::render_chat(lines, ChatEnd::GenerationPrompt);
    // The golden rendering of the default options.
    assert_eq!(
        expected,
        "system: be brief\nuser: hello there\nassistant: \nuser: \nassistant: "
    );
    let opts = ChatOptions::default();
    assert_eq!(t.render_chat(&messages, &opts).unwrap(), expected);
    assert_eq!(
        t.encode_chat(&messages, &opts).unwrap(),
        fallback::encode(&expected)
    );
    assert!(t.encode_chat(&json!([{"content": "x"}]), &opts).is_err());
}

#[test]
fn chat_options_end_the_chat_as_a_template_does() {
    let t = Tokenizer::fallback();
    let messages = json!([
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi,"}, "I am"]}
    ]);
    let closed = ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render_chat(&messages, &closed).unwrap(),
        "user: hello\nassistant: Hi, I am\n"
    );
    // A continuation: the final message stays open, nothing follows the text so far.
    let continuation = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let rendered = t.render_chat(&messages, &continuation).unwrap();
    assert_eq!(rendered, "user: hello\nassistant: Hi, I am");
    assert_eq!(
        t.encode_chat(&messages, &continuation).unwrap(),
        fallback::encode(&rendered)
    );
    // The same through chat_template_kwargs, as vLLM merges them.
    let kwargs = json!({"add_generation_prompt": false, "continue_final_message": true});
    let by_kwargs = ChatOptions {
        chat_template_kwargs: Some(&kwargs),
        ..ChatOptions::default()
    };
    assert_eq!(t.render_chat(&messages, &by_kwargs).unwrap(), rendered);
    // Both set is refused, as vLLM refuses it; so is continuing nothing.
    let both = ChatOptions {
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let err = t.render_chat(&messages, &both).unwrap_err().to_string();
    assert!(err.contains("cannot both be set"), "{err}");
    let err = t.render_chat(&json!([]), &continuation).unwrap_err();
    assert!(err.to_string().contains("no message to continue"), "{err}");
}
