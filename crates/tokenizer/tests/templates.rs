//! Chat templates beyond the tiny one: HF's helpers, named templates, tools, options.

mod common;

use kvroute_tokenizer::{ChatOptions, Tokenizer, TokenizerError};
use serde_json::json;

use common::ScratchDir;

fn with_template(name: &str, template: &str) -> (ScratchDir, Tokenizer) {
    let dir = ScratchDir::model(
        name,
        &json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": template}),
    );
    let t = Tokenizer::load(dir.path()).unwrap();
    (dir, t)
}

#[test]
fn raise_exception_surfaces_as_a_clear_error() {
    let (_dir, t) = with_template(
        "raise",
        "{% if messages[0]['role'] != 'user' %}\
         {{ raise_exception('Conversations must start with a user message') }}\
         {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
    );
    let ok = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(t.render_chat(&ok, &ChatOptions::default()).unwrap(), "hi");

    let bad = json!([{"role": "assistant", "content": "hi"}]);
    let err = t.encode_chat(&bad, &ChatOptions::default()).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRaised(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "chat template raised an exception: Conversations must start with a user message"
    );
}

#[test]
fn template_text_keeps_its_special_tokens() {
    let (_dir, t) = with_template(
        "bos",
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}",
    );
    let messages = json!([{"role": "user", "content": "hello"}]);
    let rendered = t.render_chat(&messages, &ChatOptions::default()).unwrap();
    assert_eq!(rendered, "<|begin_of_text|>user: hello<|end_of_text|>");
    let ids = t.encode_chat(&messages, &ChatOptions::default()).unwrap();
    assert_eq!(
        ids.first(),
        Some(&0),
        "the template's BOS is tokenised as the BOS token"
    );
    assert_eq!(ids.last(), Some(&1));
    assert_eq!(
        ids.iter().filter(|&&id| id == 0).count(),
        1,
        "and no second BOS is added"
    );
}

#[test]
fn named_templates_object_tokens_tools_and_openai_content() {
    let dir = ScratchDir::model(
        "named",
        &json!({
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "special": true},
            "eos_token": {"content": "<|end_of_text|>"},
            "chat_template": [
                {"name": "default", "template":
                    "{{ bos_token }}{% for m in messages %}{% for p in m['content'] %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}{{ eos_token }}"},
                {"name": "tool_use", "template":
                    "{{ tools|tojson }}|{% for m in messages %}{{ m.role }}={{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments|tojson }}{% endif %};{% endfor %}"}
            ]
        }),
    );
    let t = Tokenizer::load(dir.path()).unwrap();
    assert_eq!(t.eos_token_id(), Some(1));

    // The default template loops over content, so vLLM hands it parts, a string included.
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]);
    assert_eq!(
        t.render_chat(&messages, &ChatOptions::default()).unwrap(),
        "<|begin_of_text|>[text:hi][text:a][text:b]<|end_of_text|>"
    );

    // With tools, `tool_use` is chosen; tools get pydantic's null fields; tool-call
    // arguments are parsed from their JSON string, keeping its key order.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let messages = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Paris\"}"}}]}
    ]);
    let opts = ChatOptions {
        tools: Some(&tools),
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render_chat(&messages, &opts).unwrap(),
        r#"[{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object"}}}]|user=weather?;assistant={"unit": "c", "city": "Paris"};"#
    );
}

#[test]
fn chat_template_kwargs_and_python_methods_reach_the_template() {
    let (_dir, t) = with_template(
        "kwargs",
        "{%- for m in messages %}\n  {{- m.content.strip().upper() }}\n{%- endfor %}\n\
         {% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}",
    );
    let messages = json!([{"role": "user", "content": "  hi  "}]);
    let plain = t.render_chat(&messages, &ChatOptions::default()).unwrap();
    // Checked with jinja2 3.1 (trim_blocks eats the newline after `{%- endfor %}`).
    assert_eq!(plain, "HI");
    let kwargs = json!({"enable_thinking": false});
    let opts = ChatOptions {
        chat_template_kwargs: Some(&kwargs),
        ..ChatOptions::default()
    };
    assert_eq!(t.render_chat(&messages, &opts).unwrap(), "HI/no_think");

    let reserved = json!({"tokenize": true});
    let opts = ChatOptions {
        chat_template_kwargs: Some(&reserved),
        ..ChatOptions::default()
    };
    let err = t.render_chat(&messages, &opts).unwrap_err().to_string();
    assert!(err.contains("\"tokenize\""), "{err}");
}

#[test]
fn chat_template_jinja_overrides_the_config() {
    let dir = ScratchDir::model("jinja", &json!({"chat_template": "from config"}));
    dir.write("chat_template.jinja", "from file: {{ messages|length }}\n");
    let t = Tokenizer::load(dir.path()).unwrap();
    let messages = json!([{"role": "user", "content": "x"}]);
    assert_eq!(
        t.render_chat(&messages, &ChatOptions::default()).unwrap(),
        "from file: 1"
    );
}

#[test]
fn a_model_without_a_template_encodes_prompts_but_not_chats() {
    let dir = ScratchDir::model("none", &json!({"bos_token": "<|begin_of_text|>"}));
    let t = Tokenizer::load(dir.path()).unwrap();
    assert_eq!(t.encode_prompt("hello there, router").unwrap()[0], 0);
    assert_eq!(t.eos_token_id(), None);
    let err = t
        .encode_chat(
            &json!([{"role": "user", "content": "x"}]),
            &ChatOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(err, TokenizerError::NoChatTemplate), "{err:?}");
}

#[test]
fn a_template_syntax_error_fails_the_load_with_the_template_error() {
    let dir = ScratchDir::model(
        "syntax",
        &json!({"chat_template": "{% for m in messages %}{{ m.content }}"}),
    );
    let err = Tokenizer::load(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::TemplateSyntax { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer_config.json") && msg.contains("syntax error"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected end of input"),
        "the template engine's own text is kept: {msg}"
    );
}
