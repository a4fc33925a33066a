//! Request options kvroute-sim reads as vLLM does: a chat's continuation
//! (`continue_final_message`, `add_generation_prompt`, `chat_template_kwargs`) and
//! `stream_options`.

mod support;

use std::sync::Arc;

use kvroute_sim::SimInstance;
use kvroute_tokenizer::{ChatFields, Tokenizer};
use serde_json::{json, Value};
use support::{args, post_json, post_raw, prompt_of, start};

/// The data events of an SSE body, `[DONE]` included, as text.
fn events(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect()
}

fn chunks(text: &str) -> Vec<Value> {
    let events = events(text);
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

/// The text a stream delivered.
fn streamed_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

fn continuation(messages: Value, so_far: &str) -> Value {
    let mut messages = messages.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": so_far}));
    json!({"messages": messages, "continue_final_message": true,
           "add_generation_prompt": false, "max_tokens": 4})
}

#[tokio::test]
async fn a_continuation_is_prompted_with_the_text_so_far_and_prefix_cached() {
    let sim = start(&[]).await;
    let url = sim.url();
    let messages = json!([{"role": "user", "content": prompt_of(100, 7)}]);
    let first = json!({"messages": messages, "max_tokens": 10, "stream": true});
    let (status, text) = post_raw(&url, "/v1/chat/completions", &first).await;
    assert_eq!(status, 200, "{text}");
    let first_chunks = chunks(&text);
    let so_far = streamed_text(&first_chunks);
    assert_eq!(so_far.len(), 10, "{so_far:?}");
    let first_prompt = first_chunks.last().unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    // "user: <100 letters>\nassistant: "
    assert_eq!(first_prompt, 6 + 100 + 1 + 11);

    // The continuation: the same prompt, then the text so far, with nothing after it.
    let body = continuation(messages.clone(), &so_far);
    let (status, render) = post_json(&url, "/v1/chat/completions/render", &body).await;
    assert_eq!(status, 200, "{render}");
    let expected = format!("user: {}\nassistant: {so_far}", prompt_of(100, 7));
    let ids: Vec<u32> = expected.bytes().map(u32::from).collect();
    assert_eq!(render["token_ids"], json!(ids));
    let (_, tokenized) = post_json(&url, "/tokenize", &body).await;
    assert_eq!(tokenized["tokens"], json!(ids), "{tokenized}");

    let (status, reply) = post_json(&url, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    let usage = &reply["usage"];
    assert_eq!(usage["prompt_tokens"], ids.len());
    assert_eq!(usage["completion_tokens"], 4);
    // The first request's prompt is cached, and the blocks its answer filled: the answer's
    // tokens are the text's bytes again.
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (first_prompt + 10 - 1) / 16 * 16, "{usage}");
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn chat_options_are_read_as_vllm_reads_them() {
    let sim = start(&[]).await;
    let url = sim.url();
    let messages =
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]);
    let ids = |text: &str| json!(text.bytes().map(u32::from).collect::<Vec<_>>());
    for (options, rendered) in [
        (json!({}), "user: hi\nassistant: Hel\nassistant: "),
        (
            json!({"add_generation_prompt": false}),
            "user: hi\nassistant: Hel\n",
        ),
        (
            json!({"chat_template_kwargs": {"add_generation_prompt": false,
                                            "continue_final_message": true}}),
            "user: hi\nassistant: Hel",
        ),
    ] {
        let mut body = options.clone();
        body["messages"] = messages.clone();
        let (status, render) = post_json(&url, "/v1/chat/completions/render", &body).await;
        assert_eq!(status, 200, "{options}: {render}");
        assert_eq!(render["token_ids"], ids(rendered), "{options}");
        let (_, tokenized) = post_json(&url, "/tokenize", &body).await;
        assert_eq!(tokenized["tokens"], ids(rendered), "{options}");
    }
    // Both set, or continuing with the generation prompt left on: a 400, as vLLM answers.
    for body in [
        json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": true}),
        json!({"messages": messages, "continue_final_message": true}),
    ] {
        let (status, reply) = post_json(&url, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains("cannot both be set"), "{message}");
    }
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn with_a_real_tokenizer_the_continuation_is_the_template_cut_open() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny-llama");
    let tokenizer = Arc::new(Tokenizer::load(&dir).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim = SimInstance::start(args(&[]), tokenizer.clone(), listener)
        .await
        .unwrap();
    let url = sim.url();
    let body = continuation(
        json!([{"role": "user", "content": "hello there"}]),
        "Hi, I am",
    );
    let (status, tokenized) = post_json(&url, "/tokenize", &body).await;
    assert_eq!(status, 200, "{tokenized}");
    let fields: ChatFields = serde_json::from_value(body.clone()).unwrap();
    let expected = tokenizer
        .encode_chat(&fields.messages, &fields.options())
        .unwrap();
    assert_eq!(tokenized["tokens"], json!(expected));
    assert_eq!(
        tokenizer.decode(&expected).unwrap(),
        "user: hello there\nassistant: Hi, I am"
    );
    sim.stop().await.unwrap();
}

/// A streamed request's chunks with `stream_options` (absent when `None`).
async fn stream(url: &str, path: &str, options: Option<Value>) -> Vec<Value> {
    let mut body = if path.contains("chat") {
        json!({"messages": [{"role": "user", "content": "hello"}]})
    } else {
        json!({"prompt": "hello"})
    };
    body["max_tokens"] = json!(3);
    body["stream"] = json!(true);
    if let Some(options) = options {
        body["stream_options"] = options;
    }
    let (status, text) = post_raw(url, path, &body).await;
    assert_eq!(status, 200, "{text}");
    chunks(&text)
}

#[tokio::test]
async fn stream_options_decide_which_chunks_carry_usage() {
    let sim = start(&[]).await;
    let url = sim.url();
    let chat = "/v1/chat/completions";
    // "user: hello\nassistant: " is 23 bytes.
    let prompt = 23;

    // The sim's default, and include_usage: a closing usage chunk only.
    for options in [None, Some(json!({"include_usage": true})), Some(json!({}))] {
        let c = stream(&url, chat, options.clone()).await;
        assert_eq!(c.len(), 1 + 3 + 1, "{options:?}");
        assert!(
            c[..4].iter().all(|c| c.get("usage").is_none()),
            "{options:?}"
        );
        assert_eq!(c[4]["choices"], json!([]));
        assert_eq!(c[4]["usage"]["completion_tokens"], 3);
        assert!(c[4]["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    }
    // include_usage off: no usage at all, continuous or not.
    for options in [
        json!({"include_usage": false}),
        json!({"include_usage": false, "continuous_usage_stats": true}),
    ] {
        let c = stream(&url, chat, Some(options.clone())).await;
        assert_eq!(c.len(), 1 + 3, "{options}");
        assert!(c.iter().all(|c| c.get("usage").is_none()), "{options}");
    }
    // continuous_usage_stats: every chunk carries the completion tokens sent so far.
    let c = stream(&url, chat, Some(json!({"continuous_usage_stats": true}))).await;
    assert_eq!(c.len(), 1 + 3 + 1);
    for (i, chunk) in c[..4].iter().enumerate() {
        assert_eq!(
            chunk["usage"],
            json!({"prompt_tokens": prompt, "completion_tokens": i, "total_tokens": prompt + i}),
            "chunk {i}"
        );
    }
    assert_eq!(c[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(c[4]["choices"], json!([]));
    assert_eq!(c[4]["usage"]["completion_tokens"], 3);

    // The same for completions, which have no role chunk.
    let c = stream(
        &url,
        "/v1/completions",
        Some(json!({"include_usage": true, "continuous_usage_stats": true})),
    )
    .await;
    assert_eq!(c.len(), 3 + 1);
    for (i, chunk) in c[..3].iter().enumerate() {
        assert_eq!(chunk["usage"]["completion_tokens"], i + 1, "chunk {i}");
        assert_eq!(chunk["usage"]["prompt_tokens"], 5);
        assert_eq!(chunk["choices"][0]["text"].as_str().unwrap().len(), 1);
    }
    assert_eq!(streamed_text(&c).len(), 3);
    sim.stop().await.unwrap();
}

/// `vllm:num_requests_{what}` of the engine at `url`.
async fn requests(url: &str, what: &str) -> f64 {
    let text = support::metrics(url).await;
    support::metric(&text, &format!("vllm:num_requests_{what}"), &[])
}

/// The order in which a kvroute-sim started with `flags` (one sequence at a time, slow)
/// finishes two queued requests, of priority 5 then -1, once the long request holding it
/// has gone.
async fn served_order(flags: &[&str]) -> Vec<&'static str> {
    let mut argv = vec!["--max-num-seqs", "1", "--speedup", "1"];
    argv.extend_from_slice(flags);
    let sim = start(&argv).await;
    let url = sim.url();
    let send = |prompt: String, max_tokens: usize, priority: i64, name: &'static str| {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "priority": priority});
        let url = url.clone();
        tokio::spawn(async move {
            let (status, text) = post_raw(&url, "/v1/completions", &body).await;
            assert_eq!(status, 200, "{text}");
            (tokio::time::Instant::now(), name)
        })
    };
    let holder = send(prompt_of(32, 1), 100_000, 0, "holder");
    support::wait_until("the long request runs", || async {
        requests(&url, "running").await == 1.0
    })
    .await;
    let low = send(prompt_of(32, 2), 2, 5, "low");
    support::wait_until("the low one waits", || async {
        requests(&url, "waiting").await == 1.0
    })
    .await;
    let high = send(prompt_of(32, 3), 2, -1, "high");
    support::wait_until("both wait", || async {
        requests(&url, "waiting").await == 2.0
    })
    .await;
    // The holder's client goes away: the engine drops it and serves the queue in order.
    holder.abort();
    let mut done = vec![low.await.unwrap(), high.await.unwrap()];
    done.sort();
    done.into_iter().map(|(_, name)| name).collect()
}

#[tokio::test]
async fn under_priority_scheduling_the_lower_priority_value_goes_first_and_fcfs_ignores_it() {
    let priority = served_order(&["--scheduling-policy", "priority"]).await;
    assert_eq!(priority, ["high", "low"]);
    // As vLLM 0.32: without priority scheduling a priority is taken and ignored.
    assert_eq!(served_order(&[]).await, ["low", "high"]);
}
