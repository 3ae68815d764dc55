//! Chat template rendering and the typed errors of loading model files, on small files written
//! by the tests themselves.

use chat_tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};
use session_api::{ErrorKind, SeamError};
use std::path::Path;
mod support;

use support::CHATML;

fn write_config(dir: &Path, config: serde_json::Value) {
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec_pretty(&config).unwrap()).unwrap();
}

fn template_dir(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), serde_json::json!({ "chat_template": template, "bos_token": "<s>", "eos_token": "</s>" }));
    dir
}

fn chat(template: &str) -> ChatTemplate {
    ChatTemplate::from_model_dir(template_dir(template).path()).unwrap()
}

#[test]
fn chatml_renders_exact_text() {
    let dir = tempfile::tempdir().unwrap();
    write_config(
        dir.path(),
        serde_json::json!({
            "add_bos_token": false,
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "chat_template": CHATML,
        }),
    );
    let chat = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(chat.add_bos_token(), Some(false));
    assert_eq!(chat.source(), CHATML);

    let user_only = [ChatMessage::user("What is 2+2?")];
    assert_eq!(
        chat.apply(&user_only, true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );

    let with_system = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("Hello!"),
        ChatMessage::user("Bye"),
    ];
    assert_eq!(
        chat.apply(&with_system, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
}

#[test]
fn whitespace_control_matches_transformers() {
    // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it,
    // and the template's final newline is not kept. Checked against Python's jinja2 with
    // transformers' settings: "system\nuser\n".
    let template = "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}\n";
    let messages = [ChatMessage::system("a"), ChatMessage::user("b")];
    assert_eq!(chat(template).apply(&messages, false).unwrap(), "system\nuser\n");
    assert_eq!(chat("{{ bos_token }}\n").apply(&messages, false).unwrap(), "<s>");
}

#[test]
fn python_methods_filters_and_loop_controls() {
    let template = concat!(
        "{% for m in messages %}",
        "{% if m.content.startswith('stop') %}{% break %}{% endif %}",
        "[{{ m.role.upper() }}:{{ m.content.strip() | tojson }}{{ ',' if not loop.last }}]",
        "{% endfor %}",
        "{{ {'k': [1, 2.5, none, true], 'q': 'a\"<b>'} | tojson }}",
        "{{ messages[0] | tojson(indent=2) }}",
        "{{ eos_token }}{{ missing_variable }}",
    );
    let messages = [ChatMessage::user("  hi  "), ChatMessage::assistant("yo"), ChatMessage::user("stop here")];
    assert_eq!(
        chat(template).apply(&messages, false).unwrap(),
        "[USER:\"hi\",][ASSISTANT:\"yo\",]\
         {\"k\": [1, 2.5, null, true], \"q\": \"a\\\"<b>\"}\
         {\n  \"role\": \"user\",\n  \"content\": \"  hi  \"\n}</s>"
    );
}

#[test]
fn strftime_now_formats_the_current_date() {
    let rendered = chat("{{ strftime_now('%Y-%m-%d') }}").apply(&[], false).unwrap();
    let before = jiff::Zoned::now().date().to_string();
    assert!(rendered == before || rendered == jiff::Zoned::now().date().to_string(), "{rendered} vs {before}");
}

#[test]
fn raise_exception_is_a_typed_error() {
    let template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Tools are not supported: ' ~ m.content) }}{% endif %}{{ m.content }}{% endfor %}";
    let chat = chat(template);
    assert_eq!(chat.apply(&[ChatMessage::user("ok")], false).unwrap(), "ok");
    let err = chat.apply(&[ChatMessage::user("ok"), ChatMessage::new("tool", "calc")], false).unwrap_err();
    match &err {
        TokenizerError::TemplateException { message } => assert_eq!(message, "Tools are not supported: calc"),
        other => panic!("expected TemplateException, got {other:?}"),
    }
    let seam = SeamError::from(err);
    assert_eq!(seam.kind(), ErrorKind::InvalidInput);
    assert!(seam.to_string().contains("Tools are not supported: calc"), "{seam}");
}

#[test]
fn other_render_failures_are_typed() {
    let err = chat("{{ messages | tojson(bogus=1) }}").apply(&[], false).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender { .. }), "{err:?}");
    let err = chat("{{ strftime_now(42) }}").apply(&[], false).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender { .. }), "{err:?}");
}

#[test]
fn named_templates_choose_default_and_tokens_may_be_objects() {
    let dir = tempfile::tempdir().unwrap();
    write_config(
        dir.path(),
        serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}default{{ eos_token }}"},
            ],
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": {"content": "</s>", "special": true},
        }),
    );
    let chat = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(chat.apply(&[], true).unwrap(), "<s>default</s>");

    write_config(dir.path(), serde_json::json!({ "chat_template": [{"name": "tool_use", "template": "tools"}] }));
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MalformedConfig { message, .. } if message.contains("none named 'default'")),
        "{err:?}"
    );
}

#[test]
fn absent_special_tokens_render_empty() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), serde_json::json!({ "chat_template": "[{{ bos_token }}]", "bos_token": null }));
    assert_eq!(ChatTemplate::from_model_dir(dir.path()).unwrap().apply(&[], false).unwrap(), "[]");
}

#[test]
fn template_files_beside_the_config_are_used() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), serde_json::json!({ "bos_token": "<s>" }));
    std::fs::write(dir.path().join("chat_template.json"), r#"{"chat_template": "json:{{ bos_token }}"}"#).unwrap();
    assert_eq!(ChatTemplate::from_model_dir(dir.path()).unwrap().apply(&[], false).unwrap(), "json:<s>");
    // chat_template.jinja wins over chat_template.json, the config's own field over both.
    std::fs::write(dir.path().join("chat_template.jinja"), "jinja:{{ bos_token }}\n").unwrap();
    assert_eq!(ChatTemplate::from_model_dir(dir.path()).unwrap().apply(&[], false).unwrap(), "jinja:<s>");
    write_config(dir.path(), serde_json::json!({ "bos_token": "<s>", "chat_template": "config" }));
    assert_eq!(ChatTemplate::from_model_dir(dir.path()).unwrap().apply(&[], false).unwrap(), "config");
}

#[test]
fn missing_template_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), serde_json::json!({ "bos_token": "<s>", "eos_token": "</s>" }));
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, TokenizerError::NoChatTemplate { dir: d } if d == dir.path()), "{err:?}");
    let seam = SeamError::from(err);
    assert_eq!(seam.kind(), ErrorKind::ModelFormat);
    assert!(seam.to_string().contains("the model has no chat template"), "{seam}");
}

#[test]
fn missing_or_malformed_config_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, TokenizerError::MissingFile { path } if path.ends_with("tokenizer_config.json")), "{err:?}");
    assert_eq!(SeamError::from(err).kind(), ErrorKind::ModelFormat);

    std::fs::write(dir.path().join("tokenizer_config.json"), "{\"chat_template\": ").unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::MalformedConfig { .. }), "{err:?}");
    assert_eq!(SeamError::from(err).kind(), ErrorKind::ModelFormat);

    for bad in [
        serde_json::json!([1, 2]),
        serde_json::json!({"chat_template": 7}),
        serde_json::json!({"chat_template": "x", "bos_token": 1}),
        serde_json::json!({"chat_template": "x", "add_bos_token": "yes"}),
    ] {
        write_config(dir.path(), bad.clone());
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::MalformedConfig { .. }), "{bad}: {err:?}");
    }
}

#[test]
fn template_syntax_error_is_typed() {
    let dir = template_dir("{% for m in messages %}{{ m.content }}");
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateSyntax { .. }), "{err:?}");
    assert_eq!(SeamError::from(err).kind(), ErrorKind::ModelFormat);
    assert!(matches!(ChatTemplate::from_source("{{ }", None, None), Err(TokenizerError::TemplateSyntax { .. })));
}

#[test]
fn missing_or_malformed_tokenizer_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MissingFile { path } if path == &dir.path().join("tokenizer.json")),
        "{err:?}"
    );
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    let seam = SeamError::from(err);
    assert_eq!(seam.kind(), ErrorKind::ModelFormat);

    for bad in ["{not json", "{}", r#"{"model": {"type": "BPE", "vocab": 3}}"#] {
        std::fs::write(dir.path().join("tokenizer.json"), bad).unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::MalformedTokenizer { .. }), "{bad}: {err:?}");
        assert_eq!(SeamError::from(err).kind(), ErrorKind::ModelFormat);
    }
}
