//! Without a tokenizer, the crate is exactly `kvroute_protocol::fallback`.

use kvroute_protocol::fallback;
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
    let expected = fallback::render_chat([
        ("system", "be brief"),
        ("user", "hello there"),
        ("assistant", ""),
        ("user", ""),
    ]);
    // Options do not change the fallback rendering.
    let opts = ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    };
    assert_eq!(t.render_chat(&messages, &opts).unwrap(), expected);
    assert_eq!(
        t.encode_chat(&messages, &ChatOptions::default()).unwrap(),
        fallback::encode(&expected)
    );
    assert!(t.encode_chat(&json!([{"content": "x"}]), &opts).is_err());
}
