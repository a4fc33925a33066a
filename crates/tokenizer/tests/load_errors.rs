//! Bad paths and bad files give errors that say which file and what is wrong.

mod common;

use kvroute_tokenizer::{Tokenizer, TokenizerError};
use serde_json::json;

use common::ScratchDir;

#[test]
fn a_missing_path_is_not_found() {
    let dir = ScratchDir::new("missing");
    let path = dir.path().join("nope");
    let err = Tokenizer::load(&path).unwrap_err();
    assert!(matches!(err, TokenizerError::NotFound { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("tokenizer path {} does not exist", path.display())
    );
}

#[test]
fn a_directory_without_tokenizer_json_says_so() {
    let dir = ScratchDir::new("empty");
    let err = Tokenizer::load(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::MissingTokenizerJson { .. }),
        "{err:?}"
    );
    assert!(err.to_string().ends_with("has no tokenizer.json"), "{err}");
}

#[test]
fn invalid_json_names_the_file() {
    let dir = ScratchDir::new("badjson");
    dir.write("tokenizer.json", "{\"version\": ");
    let err = Tokenizer::load(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidJson { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer.json is not valid JSON: EOF"),
        "{msg}"
    );

    let dir = ScratchDir::model("badconfig", &json!({}));
    dir.write("tokenizer_config.json", "{chat_template: 1}");
    let err = Tokenizer::load(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer_config.json is not valid JSON"),
        "{msg}"
    );
}

#[test]
fn json_that_is_not_a_tokenizer_is_refused() {
    let dir = ScratchDir::new("notatokenizer");
    dir.write("tokenizer.json", "{\"hello\": 1}");
    let err = Tokenizer::load(&dir.path().join("tokenizer.json")).unwrap_err();
    assert!(
        matches!(err, TokenizerError::InvalidTokenizer { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("is not a tokenizer"), "{err}");
}

#[test]
fn config_fields_of_the_wrong_shape_are_refused() {
    for (config, expect) in [
        (
            json!({"chat_template": 3}),
            "chat_template must be a string or a list",
        ),
        (
            json!({"chat_template": [{"name": "default"}]}),
            "needs a string \"name\" and \"template\"",
        ),
        (
            json!({"eos_token": {"id": 1}}),
            "eos_token has no string \"content\"",
        ),
        (json!({"bos_token": 0}), "bos_token must be a string"),
    ] {
        let dir = ScratchDir::model("shape", &config);
        let err = Tokenizer::load(dir.path()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::InvalidConfig { .. }),
            "{config}: {err:?}"
        );
        assert!(err.to_string().contains(expect), "{config}: {err}");
    }
}
