//! The shared tiny Llama tokenizer, whose files real vLLM serves in `../peers`.

mod common;

use std::sync::Arc;

use kvroute_tokenizer::{ChatOptions, Tokenizer};
use serde_json::json;

use common::tiny_dir;

fn tiny() -> Tokenizer {
    Tokenizer::load(&tiny_dir()).unwrap()
}

#[test]
fn completion_prompt_matches_vllm_golden_ids() {
    // Checked against vLLM 0.32: BOS (0) first, added by the post-processor.
    let ids = tiny().encode_prompt("hello there, router").unwrap();
    assert_eq!(ids, vec![0, 337, 472, 261, 71, 14, 361]);
}

#[test]
fn loads_from_the_directory_or_the_tokenizer_json() {
    let from_dir = tiny();
    let from_file = Tokenizer::load(&tiny_dir().join("tokenizer.json")).unwrap();
    assert!(!from_dir.is_fallback());
    for t in [&from_dir, &from_file] {
        assert_eq!(t.vocab_size(), 512);
        assert_eq!(t.eos_token_id(), Some(1));
        assert_eq!(
            t.encode_prompt("hello there, router").unwrap(),
            vec![0, 337, 472, 261, 71, 14, 361]
        );
    }
    // The template was found beside the file too.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let opts = ChatOptions::default();
    assert_eq!(
        from_file.render_chat(&messages, &opts).unwrap(),
        from_dir.render_chat(&messages, &opts).unwrap()
    );
}

#[test]
fn chat_is_rendered_with_the_template_and_tokenised_without_special_tokens() {
    let t = tiny();
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"}
    ]);
    let opts = ChatOptions::default();
    // The template: `{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}`
    // then `assistant: ` when add_generation_prompt. The newline before `{% endfor %}` stays
    // (trim_blocks only eats a newline after a tag).
    let rendered = t.render_chat(&messages, &opts).unwrap();
    assert_eq!(rendered, "system: be brief\nuser: hello\nassistant: ");

    let ids = t.encode_chat(&messages, &opts).unwrap();
    assert_eq!(ids, t.encode(&rendered, false).unwrap());
    assert_ne!(ids[0], 0, "no BOS is added to a chat");
    assert_eq!(t.encode(&rendered, true).unwrap()[1..], ids[..]);

    let no_prompt = ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render_chat(&messages, &no_prompt).unwrap(),
        "system: be brief\nuser: hello\n"
    );
}

#[test]
fn content_parts_are_joined_with_newlines_for_a_string_template() {
    // vLLM hands a template that does not loop over content the text parts joined with
    // "\n"; empty texts and null content contribute nothing.
    let t = tiny();
    let messages = json!([
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "text", "text": ""},
            "second",
            {"type": "input_text", "text": "third"}
        ]},
        {"role": "assistant", "content": null},
        {"role": "user", "content": []}
    ]);
    let rendered = t.render_chat(&messages, &ChatOptions::default()).unwrap();
    assert_eq!(
        rendered,
        "user: first\nsecond\nthird\nassistant: \nuser: \nassistant: "
    );
    assert_eq!(
        t.encode_chat(&messages, &ChatOptions::default()).unwrap(),
        t.encode(&rendered, false).unwrap()
    );
}

#[test]
fn media_parts_and_malformed_messages_are_refused() {
    let t = tiny();
    let opts = ChatOptions::default();
    let image = json!([{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    ]}]);
    let err = t.encode_chat(&image, &opts).unwrap_err();
    assert!(err.to_string().contains("\"image_url\""), "{err}");

    for (messages, expect) in [
        (json!({"role": "user"}), "must be an array"),
        (json!([{"content": "x"}]), "\"role\""),
        (json!([{"role": "user", "content": 3}]), "content must be"),
        (
            json!([{"role": "user", "content": [{"text": "x"}]}]),
            "no \"type\"",
        ),
    ] {
        let err = t.encode_chat(&messages, &opts).unwrap_err().to_string();
        assert!(err.contains(expect), "{messages}: {err}");
    }
}

#[test]
fn continue_final_message_leaves_the_last_message_open() {
    let t = tiny();
    let messages = json!([
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi, I am"}
    ]);
    let opts = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render_chat(&messages, &opts).unwrap(),
        "user: hello\nassistant: Hi, I am"
    );
    let both = ChatOptions {
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let err = t.render_chat(&messages, &both).unwrap_err().to_string();
    assert!(err.contains("cannot both be set"), "{err}");
}

#[test]
fn the_template_and_the_fallback_end_a_chat_alike() {
    // The tiny template writes the fallback's `role: content` lines, so for plain string
    // contents the two renderings agree for every way a chat can end: that pins the
    // fallback's continuation to transformers' (the template's text cut at the final
    // message's end).
    let (tiny, fallback) = (tiny(), Tokenizer::fallback());
    let ends = [(true, false), (false, false), (false, true)];
    for messages in [
        json!([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi, I am"}]),
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]),
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "go on"}]),
    ] {
        for (add_generation_prompt, continue_final_message) in ends {
            let opts = ChatOptions {
                add_generation_prompt,
                continue_final_message,
                ..ChatOptions::default()
            };
            assert_eq!(
                tiny.render_chat(&messages, &opts).unwrap(),
                fallback.render_chat(&messages, &opts).unwrap(),
                "{messages} {opts:?}"
            );
        }
    }
}

#[test]
fn decode_skips_special_tokens() {
    let t = tiny();
    let ids = t.encode_prompt("hello there, router").unwrap();
    assert_eq!(t.decode(&ids).unwrap(), "hello there, router");
}

#[test]
fn shared_across_threads_behind_an_arc() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    let t = Arc::new(tiny());
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || t.encode_prompt(&format!("thread {i} says hello")).unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let ids = h.join().unwrap();
        assert_eq!(
            ids,
            t.encode_prompt(&format!("thread {i} says hello")).unwrap()
        );
    }
}
