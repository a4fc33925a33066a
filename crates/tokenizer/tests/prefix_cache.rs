//! The prefix cache gives exactly the ids of a fresh tokenisation, for every template and
//! tokenizer the project ships or tests, on random multi-turn chats and growing prompts.

mod common;

use kvroute_tokenizer::{BlockChain, ChatOptions, Lookup, PrefixCache, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Value};

use common::{tiny_dir, ScratchDir};

/// Chat templates shaped like the common model families', written for these tests, run with
/// the tiny tokenizer (whose added tokens are `<|begin_of_text|>`, `<|end_of_text|>` and
/// `<|pad|>`; the other markers are plain text to it).
const TEMPLATES: [(&str, &str); 4] = [
    (
        "chatml",
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n\
         {{ m['content'] | trim }}<|eot_id|>{% endfor %}\
         {% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    (
        "mistral",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]\
         {% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
    ),
    (
        "gemma",
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n\
         {{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
];

/// Every tokenizer under test: the tiny one with its own template, and with each of the above.
fn tokenizers() -> Vec<(String, Option<ScratchDir>, Tokenizer)> {
    let mut all = vec![(
        "tiny-llama".to_owned(),
        None,
        Tokenizer::load(&tiny_dir()).unwrap(),
    )];
    for (name, template) in TEMPLATES {
        let dir = ScratchDir::model(
            name,
            &json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": template}),
        );
        let t = Tokenizer::load(dir.path()).unwrap();
        all.push((name.to_owned(), Some(dir), t));
    }
    all
}

fn chain() -> BlockChain {
    BlockChain {
        block_size: 4,
        hash: |parent, block| {
            let mut h = parent.unwrap_or(0x9e37_79b9);
            for id in block {
                h = h.rotate_left(7) ^ u64::from(*id).wrapping_mul(0x100_0000_01b3);
            }
            h
        },
    }
}

/// Text fragments chosen to sit on and around cut points: newlines alone and in runs, spaces
/// before and after them, the tokenizer's own special tokens, other templates' markers,
/// punctuation, digits and non-ASCII text.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z]{1,12}".prop_map(|s| s),
        Just(" ".to_owned()),
        Just("\n".to_owned()),
        Just("\n\n".to_owned()),
        Just(" \n".to_owned()),
        Just("\n ".to_owned()),
        Just("\t".to_owned()),
        // Code indentation: the tiny vocabulary merges a newline with the spaces after it.
        Just("\n    ".to_owned()),
        Just("    ".to_owned()),
        Just("\n\n   ".to_owned()),
        Just("<|end_of_text|>".to_owned()),
        Just("<|begin_of_text|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("```rust\nfn main() {}\n```".to_owned()),
        "[0-9]{1,6}".prop_map(|s| s),
        "[.,;:!?'\"(){}]{1,3}".prop_map(|s| s),
        Just("héllo wörld 中文 🙂".to_owned()),
        Just("it's we'll".to_owned()),
    ]
}

fn content() -> impl Strategy<Value = String> {
    prop::collection::vec(fragment(), 1..60).prop_map(|f| f.concat())
}

fn chat() -> impl Strategy<Value = (Option<String>, Vec<String>)> {
    (
        prop::option::of(content()),
        prop::collection::vec(content(), 2..9),
    )
}

fn messages(system: &Option<String>, turns: &[String]) -> Value {
    let mut m: Vec<Value> = system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect();
    for (i, t) in turns.iter().enumerate() {
        let role = if i.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        m.push(json!({"role": role, "content": t}));
    }
    Value::Array(m)
}

fn fresh_hashes(ids: &[u32]) -> Vec<u64> {
    let mut h = Vec::new();
    chain().extend(&mut h, ids);
    h
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// A conversation growing turn by turn, through one cache per tokenizer: every turn's ids
    /// and block hashes equal a fresh tokenisation's.
    #[test]
    fn cached_chats_equal_fresh_ones((system, turns) in chat()) {
        for (name, _dir, t) in tokenizers() {
            let cache = PrefixCache::new(1 << 20, Some(chain()));
            let opts = ChatOptions { add_generation_prompt: true, ..ChatOptions::default() };
            for n in 1..=turns.len() {
                let m = messages(&system, &turns[..n]);
                let fresh = t.encode_chat(&m, &opts).unwrap();
                let cached = t.encode_chat_cached(&m, &opts, &cache).unwrap();
                prop_assert_eq!(&cached.ids, &fresh, "{} at turn {}", name, n);
                prop_assert_eq!(cached.hashes, fresh_hashes(&fresh), "{} at turn {}", name, n);
            }
        }
    }

    /// Completion prompts that extend one another, with the BOS the post-processor adds.
    #[test]
    fn cached_prompts_equal_fresh_ones(parts in prop::collection::vec(content(), 1..8)) {
        let t = Tokenizer::load(&tiny_dir()).unwrap();
        let cache = PrefixCache::new(1 << 20, None);
        let mut prompt = String::new();
        for part in &parts {
            prompt.push_str(part);
            for special in [true, false] {
                let fresh = t.encode(&prompt, special).unwrap();
                prop_assert_eq!(t.encode_cached(&prompt, special, &cache).unwrap().ids, fresh);
            }
        }
        // A long prompt gone on with is a hit, BOS and all.
        let long = format!("{}{prompt}", "Context line.\n".repeat(60));
        t.encode_cached(&long, true, &cache).unwrap();
        let more = format!("{long}\nA question?");
        let got = t.encode_cached(&more, true, &cache).unwrap();
        prop_assert_eq!(got.lookup, Lookup::Hit);
        prop_assert_eq!(got.ids, t.encode_prompt(&more).unwrap());
    }
}

fn long_chat(turns: usize) -> Value {
    let turns: Vec<String> = (0..turns)
        .map(|i| format!("Turn {i}: here is some code.\n```\nlet x{i} = {i};\nprintln!(\"{{x{i}}}\");\n```\nAnd some prose to go with it, line after line.\n"))
        .collect();
    messages(&None, &turns)
}

#[test]
fn a_chat_extended_by_a_turn_reuses_its_history() {
    for (name, _dir, t) in tokenizers() {
        let cache = PrefixCache::new(1 << 20, None);
        let opts = ChatOptions {
            add_generation_prompt: true,
            ..ChatOptions::default()
        };
        let first = t.encode_chat_cached(&long_chat(20), &opts, &cache).unwrap();
        assert_eq!(first.lookup, Lookup::Miss, "{name}");
        let next = t.encode_chat_cached(&long_chat(21), &opts, &cache).unwrap();
        assert_eq!(next.lookup, Lookup::Hit, "{name}");
        assert!(
            next.reused * 100 >= next.ids.len() * 90,
            "{name}: {} of {} ids reused",
            next.reused,
            next.ids.len()
        );
        // The same chat again reuses all but its generation prompt.
        let again = t.encode_chat_cached(&long_chat(21), &opts, &cache).unwrap();
        assert_eq!(again.ids, next.ids);
        assert!(again.reused >= next.reused, "{name}");
    }
}

#[test]
fn short_prompts_and_the_fallback_bypass_the_cache() {
    let cache = PrefixCache::new(1 << 20, None);
    let tiny = Tokenizer::load(&tiny_dir()).unwrap();
    let short = tiny.encode_cached("a\nshort prompt", true, &cache).unwrap();
    assert_eq!(short.lookup, Lookup::Bypassed);
    assert_eq!(short.ids, tiny.encode_prompt("a\nshort prompt").unwrap());
    let long = "line\n".repeat(400);
    let fallback = Tokenizer::fallback();
    let got = fallback.encode_cached(&long, true, &cache).unwrap();
    assert_eq!(
        (got.lookup, got.ids),
        (Lookup::Bypassed, fallback.encode_prompt(&long).unwrap())
    );
    assert!(cache.is_empty());
}

#[test]
fn memory_stays_within_the_bound_over_many_conversations() {
    let t = Tokenizer::load(&tiny_dir()).unwrap();
    let bound = 256 * 1024;
    let cache = PrefixCache::new(bound, Some(chain()));
    for i in 0..2000 {
        let prompt = format!("conversation {i}\n{}", "some shared words\n".repeat(40));
        t.encode_cached(&prompt, false, &cache).unwrap();
        assert!(cache.bytes() <= bound);
    }
    assert!(cache.len() > 10 && cache.len() < 2000, "{}", cache.len());
}
