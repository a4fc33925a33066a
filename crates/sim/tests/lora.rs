//! kvroute-sim serving LoRA adapters, over HTTP: what `/v1/models` lists, vLLM's 404 for an
//! adapter it does not serve, adapters loaded on demand or at run time (vLLM's
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`), and `vllm:lora_requests_info`.

mod support;

use serde_json::{json, Value};
use support::{get, metrics, post_json, post_raw, prompt_of, start};

fn completion(model: &str, seed: usize) -> Value {
    json!({"model": model, "prompt": prompt_of(40, seed), "max_tokens": 2})
}

/// The `vllm:lora_requests_info` series with the newest timestamp: (labels, value).
fn newest_lora_info(text: &str) -> (String, f64) {
    text.lines()
        .filter_map(|l| l.strip_prefix("vllm:lora_requests_info{"))
        .filter_map(|l| l.rsplit_once("} "))
        .map(|(labels, v)| (labels.to_owned(), v.trim().parse::<f64>().unwrap()))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("a vllm:lora_requests_info series")
}

#[tokio::test]
async fn adapters_are_listed_with_their_parent_and_unknown_ones_are_refused() {
    let sim = start(&[
        "--lora-modules",
        "sql=/adapters/sql",
        "chat",
        "--max-loras",
        "2",
    ])
    .await;
    let url = sim.url();
    let (status, body) = get(&url, "/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    let listed: Vec<(String, Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_owned(), m["parent"].clone()))
        .collect();
    assert_eq!(
        listed,
        [
            ("kvroute-sim".to_owned(), Value::Null),
            ("sql".to_owned(), json!("kvroute-sim")),
            ("chat".to_owned(), json!("kvroute-sim")),
        ]
    );
    // An adapter answers under its own name.
    let (status, answer) = post_json(&url, "/v1/completions", &completion("sql", 1)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "sql");
    // One it does not serve: vLLM's 404.
    let (status, err) = post_json(&url, "/v1/completions", &completion("poetry", 1)).await;
    assert_eq!(status, 404, "{err}");
    assert_eq!(
        err["error"]["message"],
        "The model `poetry` does not exist."
    );
    // The gauge: max_lora, and the state after the request (nothing running).
    let (labels, stamp) = newest_lora_info(&metrics(&url).await);
    assert_eq!(
        labels,
        r#"max_lora="2",waiting_lora_adapters="",running_lora_adapters="""#
    );
    assert!(stamp > 1.7e9, "a Unix time in seconds: {stamp}");
    // The sql adapter ran: a series once showed it running.
    assert!(metrics(&url)
        .await
        .contains(r#"running_lora_adapters="sql""#));
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn with_lora_any_an_adapter_is_served_on_first_use_and_listed_from_then_on() {
    let sim = start(&["--lora-any", "--max-loras", "4", "--lora-load-ms", "5"]).await;
    let url = sim.url();
    let (status, answer) = post_json(
        &url,
        "/v1/chat/completions",
        &json!({
            "model": "fresh", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let (_, body) = get(&url, "/v1/models").await;
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][1]["id"], "fresh");
    assert_eq!(models["data"][1]["parent"], "kvroute-sim");
    sim.stop().await.unwrap();
}

/// The ids `/v1/models` lists after the base model's.
async fn listed_adapters(url: &str) -> Vec<String> {
    let (_, body) = get(url, "/v1/models").await;
    let models: Value = serde_json::from_str(&body).unwrap();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data[0]["id"], "kvroute-sim");
    assert!(data[1..].iter().all(|m| m["parent"] == "kvroute-sim"));
    data[1..]
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time_as_vllm_answers() {
    let sim = start(&["--lora-modules", "sql", "--max-loras", "2"]).await;
    let url = sim.url();
    let load = json!({"lora_name": "chat", "lora_path": "/adapters/chat"});
    let (status, text) = post_raw(&url, "/v1/load_lora_adapter", &load).await;
    assert_eq!(
        (status, text.as_str()),
        (200, "Success: LoRA adapter 'chat' added successfully.")
    );
    assert_eq!(listed_adapters(&url).await, ["sql", "chat"]);
    let (status, answer) = post_json(&url, "/v1/completions", &completion("chat", 1)).await;
    assert_eq!(status, 200, "{answer}");
    // Loaded twice: vLLM's 400.
    let (status, err) = post_json(&url, "/v1/load_lora_adapter", &load).await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["type"], "InvalidUserInput");
    assert_eq!(
        err["error"]["message"],
        "The lora adapter 'chat' has already been loaded."
    );
    let (status, _) = post_json(&url, "/v1/load_lora_adapter", &json!({"lora_name": "x"})).await;
    assert_eq!(status, 400);
    // Unloaded: no longer listed nor served; unloading it again is vLLM's 404.
    let unload = json!({"lora_name": "chat"});
    let (status, text) = post_raw(&url, "/v1/unload_lora_adapter", &unload).await;
    assert_eq!(
        (status, text.as_str()),
        (200, "Success: LoRA adapter 'chat' removed successfully.")
    );
    assert_eq!(listed_adapters(&url).await, ["sql"]);
    let (status, _) = post_json(&url, "/v1/completions", &completion("chat", 2)).await;
    assert_eq!(status, 404);
    let (status, err) = post_json(&url, "/v1/unload_lora_adapter", &unload).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(
        err["error"]["message"],
        "The lora adapter 'chat' cannot be found."
    );
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn without_adapters_any_other_model_is_refused_and_no_lora_gauge_is_exported() {
    let sim = start(&[]).await;
    let url = sim.url();
    let (status, _) = post_json(&url, "/v1/completions", &completion("sql", 1)).await;
    assert_eq!(status, 404);
    assert!(!metrics(&url).await.contains("vllm:lora_requests_info"));
    sim.stop().await.unwrap();
}
