//! The OpenAI-compatible HTTP API end to end, in process, on the real default model.

mod common;

use common::http::{client, error_message, get, get_json, post, post_response, sse};
use common::{metric, Server};
use dspark_engine::engine::EngineConfig;
use dspark_engine::runtime::AppOptions;
use dspark_engine::speculative::{Speculation, VerifyPolicy};
use dspark_engine::testutil::shipped_drafter;
use serde_json::{json, Value};
use std::sync::OnceLock;
use std::time::Duration;

fn spawn(engine: EngineConfig, kv_mb: usize) -> Server {
    spawn_with(engine, kv_mb, None)
}

fn spawn_with(engine: EngineConfig, kv_mb: usize, drafter: Option<std::path::PathBuf>) -> Server {
    common::serve(dspark_engine::server::router(start_state(
        engine, kv_mb, drafter,
    )))
}

fn start_state(
    engine: EngineConfig,
    kv_mb: usize,
    drafter: Option<std::path::PathBuf>,
) -> std::sync::Arc<dspark_engine::server::AppState> {
    common::engine::start(AppOptions {
        served_model_name: Some("smollm2".into()),
        kv_cache_mb: kv_mb,
        max_model_len: Some(2048),
        engine,
        drafter,
        ..common::engine::options(common::smollm2())
    })
}

/// An engine speculating with `speculation` (and `drafter` where given), verifying 4 drafts
/// per block, on a 64 MB cache.
fn spawn_speculating(speculation: Speculation, drafter: Option<std::path::PathBuf>) -> Server {
    spawn_with(
        EngineConfig {
            speculation,
            policy: VerifyPolicy::Fixed { gamma: 4 },
            ..Default::default()
        },
        64,
        drafter,
    )
}

/// An engine speculating with the shipped DSpark drafter, verifying 4 drafts per block.
fn spawn_shipped_drafter() -> Server {
    spawn_speculating(Speculation::DSparkMarkov, Some(shipped_drafter()))
}

/// An engine running at most `max_running` requests with `max_waiting` more queued, on a
/// 64 MB cache.
fn spawn_limited(max_running: usize, max_waiting: usize) -> Server {
    spawn(
        EngineConfig {
            max_running,
            max_waiting,
            ..Default::default()
        },
        64,
    )
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| spawn(EngineConfig::default(), 256))
}

/// The engine's `/metrics` page.
fn metrics_text(s: &Server) -> String {
    common::http::metrics_page(&s.base)
}

/// Reads the `/metrics` page up to `tries` times, `pause` apart, until `done` holds of it:
/// whether it did.
fn poll_metrics(s: &Server, tries: usize, pause: Duration, done: impl Fn(&str) -> bool) -> bool {
    for _ in 0..tries {
        if done(&metrics_text(s)) {
            return true;
        }
        std::thread::sleep(pause);
    }
    false
}

/// A `/tokenize` request that succeeds (200): its answer.
fn tokenize_ok(base: &str, body: Value) -> Value {
    let (code, r) = post(base, "/tokenize", body);
    assert_eq!(code, 200, "{r}");
    r
}

/// POSTs a chat completion of one user message (`chat`) to the API at `base`.
fn post_chat(base: &str, content: &str, extra: Value) -> (u16, Value) {
    post(base, "/v1/chat/completions", chat(content, extra))
}

/// A chat completion of one user message that succeeds (200): its answer.
fn chat_ok(base: &str, content: &str, extra: Value) -> Value {
    let (code, r) = post_chat(base, content, extra);
    assert_eq!(code, 200, "{r}");
    r
}

/// The text of a chat completion of one user message that ends where the model (or its
/// grammar) stopped, not at `max_tokens`.
fn chat_to_stop(base: &str, content: &str, extra: Value) -> String {
    let r = chat_ok(base, content, extra);
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    chat_content(&r).to_string()
}

/// The text of a chat completion's first choice.
fn chat_content(r: &Value) -> &str {
    r["choices"][0]["message"]["content"].as_str().unwrap()
}

/// The text and the usage (null when none came) of a streamed chat completion's `data:`
/// frames: chat chunks, `[DONE]` last.
fn streamed_chat(frames: &[String]) -> (String, Value) {
    assert_eq!(frames.last().unwrap(), "[DONE]");
    let mut text = String::new();
    let mut usage = Value::Null;
    for f in &frames[..frames.len() - 1] {
        let v: Value = serde_json::from_str(f).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, usage)
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "smollm2", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn chat_streaming_equals_non_streaming_greedy() {
    let s = server();
    let full = chat_ok(
        &s.base,
        "Name three colors.",
        json!({"max_tokens": 24, "temperature": 0, "ignore_eos": true}),
    );
    let text = chat_content(&full).to_string();
    assert!(!text.is_empty());
    assert_eq!(full["usage"]["completion_tokens"], 24);
    assert_eq!(full["choices"][0]["finish_reason"], "length");
    let frames = sse(
        &s.base,
        "/v1/chat/completions",
        chat(
            "Name three colors.",
            json!({"max_tokens": 24, "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let (streamed, usage) = streamed_chat(&frames);
    assert_eq!(
        streamed, text,
        "streamed text differs from the non-streamed answer"
    );
    assert_eq!(usage["completion_tokens"], 24);
}

#[test]
fn completions_stop_strings_and_logprobs() {
    let s = server();
    let prompt = "def add(a, b):\n";
    let (code, full) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "default", "prompt": prompt, "max_tokens": 32, "temperature": 0}),
    );
    assert_eq!(code, 200, "{full}");
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // Stop at a piece of the greedy continuation: the answer is what came before it.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let (_, stopped) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "default", "prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": [stop.clone()]}),
    );
    let expected = &text[..text.find(&stop).unwrap()];
    assert_eq!(stopped["choices"][0]["text"].as_str().unwrap(), expected);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    let (_, lp) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3}),
    );
    let lps = &lp["choices"][0]["logprobs"];
    assert_eq!(lps["token_logprobs"].as_array().unwrap().len(), 4);
    for (i, l) in lps["token_logprobs"].as_array().unwrap().iter().enumerate() {
        let l = l.as_f64().unwrap();
        assert!(l <= 0.0);
        // Greedy: the chosen token is the most likely one.
        let tops = lps["top_logprobs"][i].as_object().unwrap();
        assert_eq!(tops.len(), 3);
        let best = tops
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - l).abs() < 1e-4);
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let s = server();
    let body = chat(
        "Tell me a story.",
        json!({"max_tokens": 16, "temperature": 1.0, "seed": 1234}),
    );
    let (_, a) = post(&s.base, "/v1/chat/completions", body.clone());
    let (_, b) = post(&s.base, "/v1/chat/completions", body);
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
}

#[test]
fn concurrent_requests_batch_and_match_solo_greedy() {
    let s = server();
    let prompts = [
        "Count to five.",
        "What is 2+2?",
        "Write a haiku about the sea.",
        "Say hello in French.",
    ];
    let solo: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (_, r) = post_chat(&s.base, p, json!({"max_tokens": 20, "temperature": 0}));
            chat_content(&r).to_string()
        })
        .collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let base = s.base.clone();
            let body = chat(p, json!({"max_tokens": 20, "temperature": 0}));
            std::thread::spawn(move || {
                chat_content(&post(&base, "/v1/chat/completions", body).1).to_string()
            })
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(solo, together);
}

#[test]
fn invalid_requests_get_openai_errors() {
    let s = server();
    let (code, e) = post_chat(&s.base, "x", json!({"model": "gpt-4"}));
    assert_eq!(code, 404);
    assert_eq!(e["error"]["code"], "model_not_found");
    for (extra, param) in [
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"logit_bias": {"hello": 1}}), "logit_bias"),
        (json!({"logit_bias": {"99999999": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
    ] {
        let (code, e) = post_chat(&s.base, "x", extra.clone());
        assert_eq!(code, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{extra}: {e}");
    }
    let (code, e) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "smollm2", "prompt": [[1, 2], [3, -4]]}),
    );
    assert_eq!(code, 400, "{e}");
    assert!(error_message(&e).contains("prompt 1"), "{e}");
    let (code, e) = post_chat(&s.base, "x", json!({"max_tokens": 5000}));
    assert_eq!(code, 400);
    assert!(
        error_message(&e).contains("maximum context length is 2048"),
        "{e}"
    );
    let (code, _) = post_chat(&s.base, "x", json!({"temperature": 7}));
    assert_eq!(code, 400);
    let r = client()
        .post(format!("{}/v1/completions", s.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let (code, e) = post(
        &s.base,
        "/v1/chat/completions",
        json!({"model": "default", "messages": []}),
    );
    assert_eq!(code, 400, "{e}");
}

#[test]
fn models_health_ready_metrics() {
    let s = server();
    let m: Value = get_json(format!("{}/v1/models", s.base));
    assert_eq!(m["data"][0]["id"], "smollm2");
    assert_eq!(get(&format!("{}/health", s.base)).0, 200);
    let r: Value = get_json(format!("{}/ready", s.base));
    assert_eq!(r["status"], "ready");
    post(
        &s.base,
        "/v1/completions",
        json!({"model": "default", "prompt": "Hello", "max_tokens": 3}),
    );
    let text = metrics_text(s);
    for name in [
        "dspark_time_to_first_token_seconds_bucket",
        "dspark_inter_token_latency_seconds_bucket",
        "dspark_e2e_request_latency_seconds_count",
        "dspark_num_requests_running",
        "dspark_num_requests_waiting",
        "dspark_spec_decode_num_drafts_total",
        "dspark_spec_decode_num_draft_tokens_total",
        "dspark_spec_decode_num_accepted_tokens_total",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}");
    }
    let gen = metric(&text, "dspark_generation_tokens_total");
    assert!(gen >= 3.0, "generation tokens counter is {gen}");
}

#[test]
fn disconnected_client_frees_its_kv_blocks_and_full_queue_gives_429() {
    let s = spawn_limited(1, 1);
    // A long streaming request; read one frame, then hang up.
    {
        let mut r = post_response(
            &s.base,
            "/v1/completions",
            &json!({"model": "default", "prompt": "Once upon a time", "max_tokens": 1000, "stream": true, "temperature": 0.8, "ignore_eos": true}),
        );
        assert_eq!(r.status().as_u16(), 200);
        let mut buf = [0u8; 64];
        use std::io::Read;
        r.read_exact(&mut buf).unwrap();
        // The request holds KV blocks while it streams (the gauge is published per engine
        // step, which on a busy machine may come a little after the first bytes).
        let used = poll_metrics(&s, 50, Duration::from_millis(20), |text| {
            metric(text, "dspark_kv_cache_usage_ratio") > 0.0
        });
        assert!(used, "a streaming request holds no KV blocks");
    }
    let freed = poll_metrics(&s, 100, Duration::from_millis(100), |text| {
        metric(text, "dspark_kv_cache_usage_ratio") == 0.0
            && metric(text, "dspark_num_requests_running") == 0.0
    });
    assert!(freed, "KV blocks of a disconnected client were not freed");
    // One running + one waiting fill the engine; the next request is refused with 429.
    let long = json!({"model": "default", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0.8, "ignore_eos": true});
    let b1 = s.base.clone();
    let l1 = long.clone();
    let h1 = std::thread::spawn(move || post(&b1, "/v1/completions", l1).0);
    wait_ready(&s.base, "requests_running", 1);
    let b2 = s.base.clone();
    let l2 = long.clone();
    let h2 = std::thread::spawn(move || post(&b2, "/v1/completions", l2).0);
    wait_ready(&s.base, "requests_waiting", 1);
    let r = post_response(&s.base, "/v1/completions", &long);
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let e: Value = r.json().unwrap();
    assert!(error_message(&e).contains("queue is full"));
    assert_eq!(h1.join().unwrap(), 200);
    assert_eq!(h2.join().unwrap(), 200);
}

#[test]
fn speculative_engines_stream_the_same_greedy_text_over_http() {
    let plain = server();
    let body = |stream: bool| {
        chat(
            "Repeat after me: one two three, one two three, one two three.",
            json!({"max_tokens": 20, "temperature": 0, "ignore_eos": true, "stream": stream, "stream_options": {"include_usage": true}}),
        )
    };
    let (_, reference) = post(&plain.base, "/v1/chat/completions", body(false));
    let expected = chat_content(&reference).to_string();
    for speculation in [Speculation::Ngram, Speculation::DSparkMarkov] {
        let s = spawn_speculating(speculation, None);
        let frames = sse(&s.base, "/v1/chat/completions", body(true));
        let (text, usage) = streamed_chat(&frames);
        assert_eq!(
            text, expected,
            "{speculation:?} streamed different greedy text"
        );
        assert_eq!(usage["completion_tokens"], 20);
        assert!(
            usage["draft_tokens"].as_u64().unwrap() > 0,
            "{speculation:?} never drafted: {usage}"
        );
        let r: Value = get_json(format!("{}/ready", s.base));
        assert_eq!(r["speculation"], speculation.flag());
        let m = metrics_text(&s);
        assert!(metric(&m, "dspark_spec_decode_num_draft_tokens_total") > 0.0);
    }
}

/// `n` choices and several prompts: every choice is its own sequence (index `p * n + k`),
/// a seed makes each choice reproducible and the choices differ, usage counts each prompt
/// once, and the streamed choices carry the same text as the collected ones.
#[test]
fn n_choices_and_several_prompts() {
    let s = server();
    let body = json!({"model": "smollm2", "prompt": ["The capital of France is", "Once upon a time"],
                      "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 7});
    let (code, a) = post(&s.base, "/v1/completions", body.clone());
    assert_eq!(code, 200, "{a}");
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "three samples of one prompt are identical: {texts:?}"
    );
    // Choice k of a seeded request is the single request with seed + k.
    for (k, want) in texts.iter().take(3).enumerate() {
        let (_, one) = post(
            &s.base,
            "/v1/completions",
            json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12,
                   "temperature": 1.0, "seed": 7 + k}),
        );
        assert_eq!(
            one["choices"][0]["text"].as_str().unwrap(),
            *want,
            "choice {k}"
        );
    }
    let (_, b) = post(&s.base, "/v1/completions", body.clone());
    let again: Vec<&str> = b["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, again, "seeded choices repeat");
    let prompt_tokens = |prompt: &str| {
        let (_, one) = post(
            &s.base,
            "/v1/completions",
            json!({"model": "smollm2", "prompt": prompt, "max_tokens": 1}),
        );
        one["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let first_prompt_tokens = prompt_tokens("The capital of France is");
    let second_prompt_tokens = prompt_tokens("Once upon a time");
    assert_eq!(
        a["usage"]["prompt_tokens"].as_u64().unwrap(),
        first_prompt_tokens + second_prompt_tokens
    );
    // A prompt given as token ids is the same prompt.
    let (_, ids) = post(&s.base, "/tokenize", json!({"prompt": "Once upon a time"}));
    let (code, by_ids) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "smollm2", "prompt": ids["tokens"], "max_tokens": 12, "temperature": 1.0, "seed": 7}),
    );
    assert_eq!(code, 200, "{by_ids}");
    assert_eq!(by_ids["choices"][0]["text"], choices[3]["text"]);
    let completion: u64 = choices
        .iter()
        .map(|c| {
            if c["finish_reason"] == "length" {
                12
            } else {
                0
            }
        })
        .sum();
    assert!(a["usage"]["completion_tokens"].as_u64().unwrap() >= completion);
    // Streaming interleaves the choices; per index the text is the collected one.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let events = sse(&s.base, "/v1/completions", stream_body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut streamed = vec![String::new(); 6];
    let mut finished = vec![0; 6];
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
            continue;
        }
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        streamed[i].push_str(c["text"].as_str().unwrap());
        if !c["finish_reason"].is_null() {
            finished[i] += 1;
        }
    }
    assert_eq!(streamed, texts);
    assert_eq!(finished, vec![1; 6]);
    assert_eq!(
        usage.unwrap()["completion_tokens"],
        a["usage"]["completion_tokens"]
    );
    // Chat with n = 2 (greedy: both choices are the one greedy answer).
    let c = chat_ok(
        &s.base,
        "Say hi.",
        json!({"n": 2, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(c["choices"][1]["index"], 1);
    assert_eq!(c["choices"][0]["message"], c["choices"][1]["message"]);
}

/// `logit_bias` and the penalties change what is generated: banning the greedy first token
/// gives another one, and strong presence / frequency penalties stop a prompt that makes the
/// model repeat itself from being repeated. `/tokenize` gives the ids to bias.
#[test]
fn logit_bias_and_penalties_steer_the_output() {
    let s = server();
    let prompt = "1, 1, 1, 1, 1, 1, 1, 1,";
    let ask = |extra: Value| {
        let mut body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 16,
                              "temperature": 0, "logprobs": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, r) = post(&s.base, "/v1/completions", body);
        assert_eq!(code, 200, "{r}");
        r["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect::<Vec<String>>()
    };
    let plain = ask(json!({}));
    let tokenize = |text: String| -> Vec<u64> {
        let r = tokenize_ok(&s.base, json!({"model": "smollm2", "prompt": text}));
        assert_eq!(
            r["count"].as_u64().unwrap() as usize,
            r["tokens"].as_array().unwrap().len()
        );
        r["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let base = tokenize(prompt.to_string());
    let with_first = tokenize(format!("{prompt}{}", plain[0]));
    assert_eq!(
        with_first.len(),
        base.len() + 1,
        "{:?} vs {base:?}",
        with_first
    );
    let first_id = with_first[base.len()];
    let (_, d) = post(&s.base, "/detokenize", json!({"tokens": [first_id]}));
    assert_eq!(d["prompt"], plain[0].as_str());
    let banned = ask(json!({"logit_bias": {first_id.to_string(): -100}}));
    assert_ne!(banned[0], plain[0], "a -100 bias did not ban the token");
    assert!(!banned.contains(&plain[0]), "{banned:?}");
    let most_repeated = |t: &[String]| {
        t.iter()
            .map(|x| t.iter().filter(|y| *y == x).count())
            .max()
            .unwrap_or(0)
    };
    assert!(
        most_repeated(&plain) >= 4,
        "the prompt should make the model repeat: {plain:?}"
    );
    let penalised = ask(json!({"frequency_penalty": 2.0, "presence_penalty": 2.0}));
    assert!(
        most_repeated(&penalised) <= 2,
        "penalties did not stop the repetition: {plain:?} vs {penalised:?}"
    );
}

/// A multi-turn chat re-sends its history: the second request reports the cached prompt
/// tokens as OpenAI does (`usage.prompt_tokens_details.cached_tokens`), whole blocks of it,
/// and answers as without the cache; the metrics count the hits. An engine started without
/// prefix caching reports none.
#[test]
fn a_repeated_conversation_is_served_from_the_prefix_cache() {
    let s = server();
    let history = json!([
        {"role": "system", "content": "You are a terse assistant who answers in a few words. Never explain your answers unless asked, and never greet."},
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"}
    ]);
    let body = json!({"model": "smollm2", "messages": history, "max_tokens": 8, "temperature": 0});
    let (_, a) = post(&s.base, "/v1/chat/completions", body.clone());
    let (_, b) = post(&s.base, "/v1/chat/completions", body.clone());
    let prompt = b["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 16 && cached % 16 == 0 && cached < prompt,
        "{cached} of {prompt} cached: {b}"
    );
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let m = metrics_text(s);
    assert!(metric(&m, "dspark_prefix_cache_hits_total") >= cached as f64);
    assert!(metric(&m, "dspark_prefix_cache_queries_total") >= prompt as f64);
    let off = spawn(
        EngineConfig {
            prefix_cache: false,
            ..Default::default()
        },
        64,
    );
    post(&off.base, "/v1/chat/completions", body.clone());
    let (_, c) = post(&off.base, "/v1/chat/completions", body);
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(c["choices"][0]["message"], b["choices"][0]["message"]);
}

/// The `n` choices of one prompt prefill it once: the others wait for its full blocks and
/// start on them from the prefix cache (the prompt-token counter sees the prompt once, plus
/// each choice's last partial block).
#[test]
fn n_choices_of_one_prompt_prefill_it_once() {
    let s = spawn(EngineConfig::default(), 64);
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let before = metric(&metrics_text(&s), "dspark_prompt_tokens_total");
    let (code, r) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "smollm2", "prompt": prompt, "n": 4, "max_tokens": 4, "temperature": 1.0, "seed": 1}),
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"].as_array().unwrap().len(), 4);
    let len = r["usage"]["prompt_tokens"].as_f64().unwrap();
    let m = metrics_text(&s);
    let prefilled = metric(&m, "dspark_prompt_tokens_total") - before;
    println!("{prefilled} prompt tokens prefilled for 4 choices of {len}");
    assert!(len > 150.0, "{len}");
    assert!(
        prefilled <= len + 3.0 * 16.0,
        "{prefilled} prompt tokens prefilled for 4 x {len}"
    );
    assert!(metric(&m, "dspark_prefix_cache_hits_total") >= 3.0 * (len - 16.0));
}

/// Structured outputs: `response_format` json_schema / json_object and the guided regex and
/// Lark extensions give output that follows the constraint, and greedy speculative decoding
/// (n-gram and the shipped DSpark drafter) gives exactly the constrained plain output.
/// Bad grammars and two constraints at once are 400s naming the field.
#[test]
fn structured_outputs_follow_the_constraint_with_and_without_speculation() {
    let plain = server();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["name", "age", "languages"], "additionalProperties": false});
    let cases = [
        chat(
            "Describe a fictional programmer as JSON.",
            json!({"max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}}}),
        ),
        chat(
            "Give me a short JSON object with the name and country of Paris.",
            json!({"max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_object"}}),
        ),
        chat(
            "What is the phone number?",
            json!({"max_tokens": 20, "temperature": 0,
            "guided_regex": "[0-9]{3}-[0-9]{4}"}),
        ),
        chat(
            "Is the sky blue?",
            json!({"max_tokens": 10, "temperature": 0,
            "guided_grammar": "start: (\"yes\" | \"no\") \".\""}),
        ),
    ];
    let answer = |base: &str, body: &Value| -> (String, Value) {
        let (code, r) = post(base, "/v1/chat/completions", body.clone());
        assert_eq!(code, 200, "{r}");
        (chat_content(&r).to_string(), r)
    };
    let expected: Vec<String> = cases.iter().map(|c| answer(&plain.base, c).0).collect();
    println!("{expected:?}");
    let person: Value = serde_json::from_str(&expected[0]).expect("schema output parses");
    assert!(
        person["name"].is_string() && person["age"].is_i64() && person["languages"].is_array(),
        "{person}"
    );
    assert_eq!(person.as_object().unwrap().len(), 3, "{person}");
    let paris: Value = serde_json::from_str(&expected[1]).expect("json_object output parses");
    assert!(paris.is_object());
    let phone = &expected[2];
    assert!(
        phone.len() == 8
            && phone.chars().enumerate().all(|(i, c)| if i == 3 {
                c == '-'
            } else {
                c.is_ascii_digit()
            }),
        "{phone}"
    );
    assert!(
        expected[3] == "yes." || expected[3] == "no.",
        "{}",
        expected[3]
    );
    for (speculation, drafter) in [
        (Speculation::Ngram, None),
        (Speculation::DSparkMarkov, Some(shipped_drafter())),
    ] {
        let s = spawn_speculating(speculation, drafter);
        let mut drafted = 0;
        for (c, want) in cases.iter().zip(&expected) {
            let (got, r) = answer(&s.base, c);
            assert_eq!(&got, want, "{speculation:?}: constrained output differs");
            drafted += r["usage"]["draft_tokens"].as_u64().unwrap();
        }
        assert!(drafted > 0, "{speculation:?} never drafted");
    }
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (
            json!({"guided_regex": "a", "guided_grammar": "start: \"a\""}),
            "guided_grammar",
        ),
    ] {
        let (code, e) = post_chat(&plain.base, "x", extra.clone());
        assert_eq!(code, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{extra}: {e}");
    }
    // A schema whose shortest output needs more tokens than max_tokens allows is a 400
    // naming max_tokens and the bound; with room, the same schema completes, in no fewer
    // tokens than the bound said (it is a lower bound).
    let props: serde_json::Map<String, Value> = (0..48)
        .map(|i| {
            (
                format!("required_property_number_{i:02}"),
                json!({"type": "integer"}),
            )
        })
        .collect();
    let names: Vec<&String> = props.keys().collect();
    let wide = json!({"type": "object", "properties": props, "required": names,
        "additionalProperties": false});
    let body = |max_tokens: usize| {
        chat(
            "Fill in the form as JSON.",
            json!({"max_tokens": max_tokens, "temperature": 0, "response_format":
                {"type": "json_schema", "json_schema": {"name": "form", "schema": wide, "strict": true}}}),
        )
    };
    let (code, e) = post(&plain.base, "/v1/chat/completions", body(4));
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["error"]["param"], "max_tokens", "{e}");
    let msg = error_message(&e);
    let need: u64 = msg
        .split("at least ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no bound in {msg:?}"));
    assert!(need > 4, "{msg}");
    let (got, r) = answer(&plain.base, &body(1000));
    let form: Value = serde_json::from_str(&got).expect("the wide schema's output parses");
    assert_eq!(form.as_object().unwrap().len(), 48, "{form}");
    assert!(
        r["usage"]["completion_tokens"].as_u64().unwrap() >= need,
        "the bound {need} is above a real output's length: {r}"
    );
}

/// A request cancelled mid-stream leaves the prefix cache consistent: the same request
/// afterwards (starting on whatever the cancelled one registered) answers exactly as an
/// engine that never saw the cancelled one.
#[test]
fn a_cancelled_request_leaves_the_cache_consistent() {
    use std::io::Read;
    let body = chat(
        "Write a long story about a lighthouse keeper and a storm.",
        json!({"max_tokens": 48, "temperature": 0, "ignore_eos": true}),
    );
    let fresh = spawn(EngineConfig::default(), 64);
    let (_, want) = post(&fresh.base, "/v1/chat/completions", body.clone());
    let s = spawn(EngineConfig::default(), 64);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let mut r = post_response(&s.base, "/v1/chat/completions", &streaming);
    let mut buf = [0u8; 512];
    let _ = r.read(&mut buf).unwrap();
    drop(r);
    // The engine notices the hang-up at its next step and drops the sequence.
    wait_idle(&s.base);
    let (_, got) = post(&s.base, "/v1/chat/completions", body);
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    let m = metrics_text(&s);
    assert_eq!(
        metric(&m, "dspark_kv_cache_usage_ratio"),
        0.0,
        "blocks leaked"
    );
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

/// (name, arguments) of an answer's tool calls, checking the wire shape.
fn calls_of(r: &Value) -> Vec<(String, String)> {
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    choice["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {r}"))
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
            assert_eq!(c["type"], "function");
            let f = &c["function"];
            (
                f["name"].as_str().unwrap().to_string(),
                f["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The same calls assembled from a stream's `tool_calls` deltas, as clients do.
fn streamed_calls(frames: &[String]) -> Vec<(String, String)> {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut reason = Value::Null;
    for f in frames.iter().filter(|f| *f != "[DONE]") {
        let v: Value = serde_json::from_str(f).unwrap();
        let c = &v["choices"][0];
        if !c["finish_reason"].is_null() {
            reason = c["finish_reason"].clone();
        }
        for d in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(d["id"].as_str().unwrap().starts_with("call_"), "{d}");
                calls.push((
                    d["function"]["name"].as_str().unwrap().into(),
                    String::new(),
                ));
            }
            calls[i].1 += d["function"]["arguments"].as_str().unwrap();
        }
    }
    assert_eq!(reason, "tool_calls");
    calls
}

/// Tool calls: a named `tool_choice` and `required` force calls whose arguments follow the
/// tool's schema, streamed as OpenAI streams them (the same calls), greedy-identical with
/// the shipped DSpark drafter; `none` hides the tools; earlier calls and results in the
/// history are accepted; bad tools and choices are 400s naming the field.
#[test]
fn tool_calls_are_forced_parsed_streamed_and_lossless_under_speculation() {
    let plain = server();
    let named = chat(
        "What is the weather in Paris?",
        json!({"max_tokens": 60, "temperature": 0, "tools": weather_tools(),
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false}),
    );
    let required = chat(
        "Add 2 and 3, and tell me the weather in Oslo.",
        json!({"max_tokens": 120, "temperature": 0, "tools": weather_tools(),
            "tool_choice": "required"}),
    );
    let (code, r) = post(&plain.base, "/v1/chat/completions", named.clone());
    assert_eq!(code, 200, "{r}");
    let calls = calls_of(&r);
    assert_eq!(calls.len(), 1, "{r}");
    assert_eq!(calls[0].0, "get_weather");
    let args: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert!(args["city"].is_string(), "{args}");
    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
    assert!(r["choices"][0]["message"]["content"].is_null(), "{r}");
    let mut stream = named.clone();
    stream["stream"] = json!(true);
    assert_eq!(
        streamed_calls(&sse(&plain.base, "/v1/chat/completions", stream)),
        calls
    );
    let (code, r) = post(&plain.base, "/v1/chat/completions", required.clone());
    assert_eq!(code, 200, "{r}");
    let req_calls = calls_of(&r);
    for (name, a) in &req_calls {
        let a: Value = serde_json::from_str(a).unwrap();
        match name.as_str() {
            "add" => assert!(a["a"].is_i64() && a["b"].is_i64(), "{a}"),
            "get_weather" => assert!(a["city"].is_string(), "{a}"),
            other => panic!("unknown tool {other}"),
        }
    }
    // The drafter speculates under the call grammar and changes nothing.
    let spec = spawn_shipped_drafter();
    let mut drafted = 0;
    for (body, want) in [(&named, &calls), (&required, &req_calls)] {
        let (code, r) = post(&spec.base, "/v1/chat/completions", body.clone());
        assert_eq!(code, 200, "{r}");
        assert_eq!(&calls_of(&r), want, "speculation changed the calls");
        drafted += r["usage"]["draft_tokens"].as_u64().unwrap();
    }
    assert!(drafted > 0, "the drafter never drafted");
    // `none`: the tools are not shown (the prompt is the one without tools).
    let (_, bare) = post_chat(&plain.base, "Hi", json!({"max_tokens": 4}));
    let r = chat_ok(
        &plain.base,
        "Hi",
        json!({"max_tokens": 4, "tools": weather_tools(), "tool_choice": "none"}),
    );
    assert_eq!(r["usage"]["prompt_tokens"], bare["usage"]["prompt_tokens"]);
    assert!(r["choices"][0]["message"]["tool_calls"].is_null());
    // A conversation with an earlier call and its result.
    let history = json!({"model": "smollm2", "max_tokens": 20, "temperature": 0, "tools": weather_tools(),
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]});
    let (code, r) = post(&plain.base, "/v1/chat/completions", history.clone());
    assert_eq!(code, 200, "{r}");
    let m = &r["choices"][0]["message"];
    assert!(
        m["content"].is_string() || m["tool_calls"].is_array(),
        "{r}"
    );
    // Bad input.
    let mut dup = weather_tools();
    dup[1]["function"]["name"] = json!("get_weather");
    let mut bad_schema = weather_tools();
    bad_schema[1]["function"]["parameters"] = json!({"type": "nonsense"});
    let mut no_id = history.clone();
    no_id["messages"][2]
        .as_object_mut()
        .unwrap()
        .remove("tool_call_id");
    let mut bad_args = history.clone();
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = json!("{city: Paris");
    for (body, param) in [
        (chat("x", json!({"tools": dup})), "tools[1].function.name"),
        (chat("x", json!({"tools": bad_schema})), "tools"),
        (
            chat("x", json!({"tools": [{"type": "retrieval"}]})),
            "tools[0].type",
        ),
        (
            chat(
                "x",
                json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            ),
            "tools[0].function.name",
        ),
        (
            chat(
                "x",
                json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            ),
            "tool_choice",
        ),
        (chat("x", json!({"tool_choice": "required"})), "tool_choice"),
        (
            chat(
                "x",
                json!({"tools": weather_tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            ),
            "tool_choice",
        ),
        (no_id, "messages[2].tool_call_id"),
        (bad_args, "messages[1].tool_calls[0].function.arguments"),
    ] {
        let (code, e) = post(&plain.base, "/v1/chat/completions", body.clone());
        assert_eq!(code, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
}

/// A prompt one token past a block boundary, repeated, starts on cached blocks right up to
/// its last token, so it decodes at once: the context-input drafter (the shipped one) has
/// no context feature of the position before the anchor yet and must wait a token instead
/// of failing the engine step (it did: "needs each request's last context feature").
#[test]
fn a_prompt_cached_up_to_its_last_token_speculates_after_one_token() {
    let s = spawn_shipped_drafter();
    let t = tokenize_ok(
        &s.base,
        json!({"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large n stay fast.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"}),
    );
    let ids: Vec<u64> = t["tokens"].as_array().unwrap()[..33]
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let body = json!({"model": "smollm2", "prompt": ids, "max_tokens": 12, "temperature": 0});
    let (code, a) = post(&s.base, "/v1/completions", body.clone());
    assert_eq!(code, 200, "{a}");
    let (code, b) = post(&s.base, "/v1/completions", body);
    assert_eq!(code, 200, "{b}");
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"], 32,
        "{b}"
    );
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert!(b["usage"]["draft_tokens"].as_u64().unwrap() > 0, "{b}");
}

/// A request whose own state fails mid-step (its grammar in llguidance's error state) ends
/// with an error; the requests batched with it finish exactly as they would alone, and
/// the engine goes on serving.
#[test]
fn a_request_that_fails_fails_alone() {
    use dspark_engine::constraint::Constraint;
    use dspark_engine::engine::{Event, GenRequest};
    let st = start_state(EngineConfig::default(), 64, None);
    let prompt = st.tok.encode("The capital of France is", false).unwrap();
    let submit = |constraint: Option<Constraint>| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        st.engine
            .submit(GenRequest {
                params: dspark_engine::sampling::SamplingParams {
                    temperature: 0.0,
                    ..Default::default()
                },
                ignore_eos: true,
                constraint,
                ..GenRequest::new(prompt.clone(), 12, tx)
            })
            .unwrap();
        rx
    };
    let outcome = |mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>| -> Result<String, String> {
        let mut text = String::new();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                Event::Delta { text: t, .. } => text += &t,
                Event::Finished { .. } => return Ok(text),
                Event::Error(e) => return Err(e),
            }
        }
        Err("dropped".into())
    };
    let alone = outcome(submit(None)).expect("a plain request finishes");
    let (a, bad, b) = (
        submit(None),
        submit(Some(Constraint::failed("grammar exploded"))),
        submit(None),
    );
    let err = outcome(bad).expect_err("the broken request fails");
    assert!(err.contains("grammar exploded"), "{err}");
    assert_eq!(outcome(a).as_deref(), Ok(alone.as_str()));
    assert_eq!(outcome(b).as_deref(), Ok(alone.as_str()));
    assert_eq!(outcome(submit(None)).as_deref(), Ok(alone.as_str()));
}

/// An engine on its own, with its state (to serve it with other limits too).
fn fresh_state() -> std::sync::Arc<dspark_engine::server::AppState> {
    start_state(EngineConfig::default(), 64, None)
}

/// Request bodies over `--max-request-bytes` get 413 in the OpenAI error format, with the
/// limit in the message, whether the client declares the length or streams the body
/// (chunked), and however far over it is: the server reads the rest before answering, so
/// the client sees the answer, not a connection reset. A body under the limit is served.
#[test]
fn oversized_bodies_get_413_in_openai_format() {
    use dspark_engine::server::{router_with, Limits, DEFAULT_MAX_REQUEST_BYTES};
    let st = fresh_state();
    let default = common::serve(dspark_engine::server::router(st.clone()));
    let small = common::serve(router_with(
        st,
        Limits {
            max_request_bytes: 64 * 1024,
            ..Default::default()
        },
    ));
    let check = |r: reqwest::blocking::Response, limit: usize| {
        assert_eq!(r.status().as_u16(), 413);
        let e: Value = r.json().expect("an OpenAI error body");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["code"], "request_too_large", "{e}");
        let msg = error_message(&e);
        assert!(msg.contains(&limit.to_string()), "{msg}");
    };
    // Four 1 MB stop strings (4 MB), and 20 MB.
    let stop: Vec<String> = (0..4).map(|i| format!("{i}").repeat(1 << 20)).collect();
    let four = chat("x", json!({"stop": stop})).to_string();
    let twenty = chat("x", json!({"stop": ["y".repeat(20 << 20)]})).to_string();
    for body in [four.clone(), twenty] {
        let r = client()
            .post(format!("{}/v1/chat/completions", default.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .expect("an answer, not a reset");
        check(r, DEFAULT_MAX_REQUEST_BYTES);
    }
    // Chunked (no Content-Length): the limit is found while reading.
    let r = client()
        .post(format!("{}/v1/completions", default.base))
        .header("content-type", "application/json")
        .body(reqwest::blocking::Body::new(std::io::Cursor::new(
            four.into_bytes(),
        )))
        .send()
        .expect("an answer, not a reset");
    check(r, DEFAULT_MAX_REQUEST_BYTES);
    // The limit is the flag's: 100 KB is over 64 KiB here, under the default there.
    let padded = format!(
        "{}{}",
        json!({"model": "default", "prompt": "Hi", "max_tokens": 1}),
        " ".repeat(100 * 1024)
    );
    for (base, code) in [(&small.base, 413), (&default.base, 200)] {
        let r = client()
            .post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(padded.clone())
            .send()
            .unwrap();
        if code == 413 {
            check(r, 64 * 1024);
        } else {
            assert_eq!(r.status().as_u16(), 200, "{:?}", r.text());
        }
    }
}

/// A message without content (null or missing) is a 400 naming the field, except an
/// assistant message that carries tool calls (OpenAI allows that).
#[test]
fn null_message_content_is_a_400_naming_the_field() {
    let s = server();
    let msgs = |m: Value| json!({"model": "smollm2", "max_tokens": 1, "messages": m});
    for (body, param) in [
        (
            msgs(json!([{"role": "user", "content": null}])),
            "messages[0].content",
        ),
        (msgs(json!([{"role": "user"}])), "messages[0].content"),
        (
            msgs(json!([{"role": "system", "content": null}, {"role": "user", "content": "Hi"}])),
            "messages[0].content",
        ),
        (
            msgs(
                json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null},
                {"role": "user", "content": "Hi"}]),
            ),
            "messages[1].content",
        ),
        (
            msgs(json!([{"role": "user", "content": [{"type": "text", "text": null}]}])),
            "messages[0].content[0].text",
        ),
    ] {
        let (code, e) = post(&s.base, "/v1/chat/completions", body.clone());
        assert_eq!(code, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert!(error_message(&e).contains(param), "{e}");
    }
    let calls = msgs(json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]));
    let (code, r) = post(&s.base, "/v1/chat/completions", calls);
    assert_eq!(code, 200, "{r}");
}

/// A forced call (`required` with one tool, a named function, `required` without parallel
/// calls) ends the choice after the call with `finish_reason: "tool_calls"`, sampled,
/// streamed or not: the call grammar ends after the calls it allows (it used to allow more
/// calls for ever, and the model wrote them until `max_tokens`). `max_tokens` leaves room
/// for the longest call the schema allows (30 characters of city, a few tokens each).
#[test]
fn a_forced_tool_call_ends_the_choice() {
    let s = server();
    let one_tool = json!([weather_tools()[0].clone()]);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    // Without `additionalProperties` a schema allows any further property, and a small
    // model invents them until max_tokens: a forced call's arguments take only those listed.
    let open_tool = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"]}}}]);
    for (tools, choice, parallel) in [
        (open_tool, json!("required"), Value::Null),
        (one_tool.clone(), json!("required"), Value::Null),
        (one_tool, json!("required"), json!(true)),
        (weather_tools(), named, Value::Null),
        (weather_tools(), json!("required"), json!(false)),
    ] {
        for seed in 0..4 {
            let mut body = chat(
                "What is the weather in Paris?",
                json!({"max_tokens": 200, "temperature": 0.8, "seed": seed, "tools": tools,
                    "tool_choice": choice}),
            );
            if !parallel.is_null() {
                body["parallel_tool_calls"] = parallel.clone();
            }
            let (code, r) = post(&s.base, "/v1/chat/completions", body.clone());
            assert_eq!(code, 200, "{r}");
            let calls = calls_of(&r);
            assert_eq!(calls.len(), 1, "{body}: {r}");
            let args: Value = serde_json::from_str(&calls[0].1).unwrap();
            let declared: &[&str] = match calls[0].0.as_str() {
                "get_weather" => &["city", "unit"],
                _ => &["a", "b"],
            };
            assert!(
                args.as_object()
                    .unwrap()
                    .keys()
                    .all(|k| declared.contains(&k.as_str())),
                "{args}"
            );
            body["stream"] = json!(true);
            assert_eq!(
                streamed_calls(&sse(&s.base, "/v1/chat/completions", body)),
                calls
            );
        }
    }
}

/// Strips JSON string literals (what is left is the JSON's structure, numbers and
/// whitespace).
fn outside_strings(json: &str) -> String {
    let (mut out, mut in_str, mut esc) = (String::new(), false, false);
    for c in json.chars() {
        if in_str {
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
        } else {
            out.push(c);
        }
    }
    out
}

/// JSON outputs are compact by default (no whitespace between tokens) and their numbers
/// end: a model pushed to write digits for ever (logit_bias +100 on every digit) gets at
/// most 20 in a row and the answer completes (it ran into `max_tokens` before). A request
/// may still ask for whitespace (`guided_whitespace_pattern`).
#[test]
fn json_outputs_are_compact_and_their_numbers_end() {
    let s = server();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
        "score": {"type": "number"}}, "required": ["name", "age", "score"],
        "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": true}});
    for seed in 0..3 {
        let text = chat_to_stop(
            &s.base,
            "Describe a fictional athlete as JSON.",
            json!({"max_tokens": 250, "temperature": 0.8, "seed": seed, "response_format": rf}),
        );
        let v: Value = serde_json::from_str(&text).expect("the answer parses");
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
        assert!(
            !outside_strings(&text).contains(char::is_whitespace),
            "not compact: {text:?}"
        );
    }
    // Digits pushed as hard as logit_bias allows.
    let mut bias = serde_json::Map::new();
    for d in 0..10 {
        let (_, t) = post(
            &s.base,
            "/tokenize",
            json!({"prompt": d.to_string(), "add_special_tokens": false}),
        );
        if let [id] = t["tokens"].as_array().unwrap().as_slice() {
            bias.insert(id.to_string(), json!(100));
        }
    }
    assert!(!bias.is_empty(), "no single-digit tokens");
    let number = json!({"type": "json_schema", "json_schema": {"name": "n", "schema":
        {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}});
    let text = chat_to_stop(
        &s.base,
        "Write a number.",
        json!({"max_tokens": 200, "temperature": 0, "logit_bias": bias, "response_format": number}),
    );
    let longest = text
        .split(|c: char| !c.is_ascii_digit())
        .map(str::len)
        .max()
        .unwrap_or(0);
    assert!(longest <= 20, "a run of {longest} digits: {text}");
    assert!(text.starts_with("{\"x\":") && text.ends_with('}'), "{text}");
    // Flexible whitespace on request; an empty pattern is refused.
    chat_ok(
        &s.base,
        "Describe a fictional athlete as JSON.",
        json!({"max_tokens": 160, "temperature": 0, "response_format": rf,
                "guided_whitespace_pattern": "[ \\n]{0,2}"}),
    );
    let (code, e) = post_chat(
        &s.base,
        "x",
        json!({"response_format": rf, "guided_whitespace_pattern": ""}),
    );
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["error"]["param"], "guided_whitespace_pattern", "{e}");
}

/// The hostile schema of issue #51 (300 bytes: an object whose properties `l` and `r` are
/// itself and whose array property needs 64 of itself) is answered promptly; it used to
/// hang a core for good in the max_tokens check. A schema over `--max-grammar-work` is a
/// 400 that names the limit.
#[test]
fn schema_analysis_is_bounded() {
    use dspark_engine::server::{router_with, Limits};
    let s = server();
    let hostile = json!({"type": "object", "properties": {"l": {"$ref": "#"}, "r": {"$ref": "#"},
        "a": {"type": "array", "items": {"$ref": "#"}, "minItems": 64}},
        "required": ["l", "r", "a"]});
    assert!(hostile.to_string().len() < 300);
    let quick = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    for max_tokens in [1, 60] {
        let t = std::time::Instant::now();
        let r = quick
            .post(format!("{}/v1/chat/completions", s.base))
            .json(&chat(
                "x",
                json!({"max_tokens": max_tokens, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "t", "schema": hostile}}}),
            ))
            .send()
            .expect("answered within a minute");
        let code = r.status().as_u16();
        let body: Value = r.json().unwrap();
        assert!(code == 200 || code == 400, "{code}: {body}");
        if code == 400 && body["error"]["param"] != "max_tokens" {
            assert_eq!(body["error"]["code"], "limit_exceeded", "{body}");
            let msg = error_message(&body);
            assert!(msg.contains("--max-grammar-work"), "{msg}");
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }
    let tight = common::serve(router_with(
        fresh_state(),
        Limits {
            max_grammar_work: 50,
            ..Default::default()
        },
    ));
    let props: serde_json::Map<String, Value> = (0..100)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let names: Vec<&String> = props.keys().collect();
    let wide = json!({"type": "object", "properties": props, "required": names});
    let (code, e) = post_chat(
        &tight.base,
        "x",
        json!({"max_tokens": 500, "response_format": {"type": "json_schema",
                "json_schema": {"name": "w", "schema": wide}}}),
    );
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["error"]["param"], "response_format", "{e}");
    assert_eq!(e["error"]["code"], "limit_exceeded", "{e}");
    assert!(error_message(&e).contains("--max-grammar-work"), "{e}");
}

/// Polls `/ready` until nothing runs or waits.
fn wait_idle(base: &str) {
    let t = std::time::Instant::now();
    loop {
        let r: Value = get_json(format!("{base}/ready"));
        if r["requests_running"] == 0 && r["requests_waiting"] == 0 {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "never idle: {r}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls `/ready` until `requests_running` reaches `n`.
fn wait_running(base: &str, n: u64) {
    wait_ready(base, "requests_running", n)
}

/// Polls `/ready` until its count `field` reaches `n` (what a test waits for instead of
/// sleeping).
fn wait_ready(base: &str, field: &str, n: u64) {
    let t = std::time::Instant::now();
    loop {
        let r: Value = get_json(format!("{base}/ready"));
        if r[field].as_u64().unwrap_or(0) >= n {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{field} never reached {n}: {r}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// When the engine thread dies (a panic in a step, injected), `/health` and `/ready` answer
/// 503, the requests in flight end with an OpenAI-format error (a streamed one with an error
/// event before `[DONE]`), and new requests get 503.
#[test]
fn a_dead_engine_fails_probes_and_requests() {
    use std::io::BufRead;
    let faults = dspark_engine::engine::Faults::default();
    let s = spawn(
        EngineConfig {
            faults: faults.clone(),
            ..Default::default()
        },
        64,
    );
    let long = json!({"model": "default", "prompt": "Once upon a time", "max_tokens": 1500,
        "temperature": 0.8, "ignore_eos": true});
    let mut streamed = long.clone();
    streamed["stream"] = json!(true);
    let r = post_response(&s.base, "/v1/completions", &streamed);
    assert_eq!(r.status().as_u16(), 200);
    let mut lines = std::io::BufReader::new(r).lines();
    let first = lines
        .by_ref()
        .map(Result::unwrap)
        .find(|l| l.starts_with("data: "))
        .expect("a first chunk");
    assert!(!first.contains("error"), "{first}");
    let base = s.base.clone();
    let whole = std::thread::spawn(move || post(&base, "/v1/completions", long));
    wait_running(&s.base, 2);
    faults.panic_next_step();
    let rest: Vec<String> = lines
        .map(Result::unwrap)
        .filter_map(|l| l.strip_prefix("data: ").map(String::from))
        .collect();
    let (last, before) = rest.split_last().expect("frames after the fault");
    assert_eq!(last, "[DONE]", "{rest:?}");
    let err: Value = serde_json::from_str(before.last().expect("an error frame")).unwrap();
    assert!(error_message(&err).contains("panicked"), "{err}");
    let (code, e) = whole.join().unwrap();
    assert_eq!(code, 503, "{e}");
    assert_eq!(e["error"]["type"], "server_error", "{e}");
    for probe in ["/health", "/ready"] {
        let r = client().get(format!("{}{probe}", s.base)).send().unwrap();
        assert_eq!(r.status().as_u16(), 503, "{probe}");
    }
    let (code, e) = post(
        &s.base,
        "/v1/completions",
        json!({"model": "default", "prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(code, 503, "{e}");
    assert!(error_message(&e).contains("stopped"), "{e}");
}

/// An engine that makes no progress while requests wait (a step that hangs, injected)
/// fails `/health` and `/ready` after `--engine-stall-secs`, and passes them again once it
/// moves; the waiting request then completes.
#[test]
fn a_stalled_engine_fails_the_probes_until_it_moves() {
    use dspark_engine::server::{router_with, Limits};
    let faults = dspark_engine::engine::Faults::default();
    let s = common::serve(router_with(
        start_state(
            EngineConfig {
                faults: faults.clone(),
                ..Default::default()
            },
            64,
            None,
        ),
        Limits {
            engine_stall: Duration::from_millis(300),
            ..Default::default()
        },
    ));
    let probe = |path: &str| get(&format!("{}{path}", s.base)).0;
    let until = |path: &str, code: u16| {
        let t = std::time::Instant::now();
        while probe(path) != code {
            assert!(t.elapsed() < Duration::from_secs(60), "{path} never {code}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    assert_eq!(probe("/health"), 200);
    faults.stall_steps(true);
    let base = s.base.clone();
    let req = std::thread::spawn(move || {
        post(
            &base,
            "/v1/completions",
            json!({"model": "default", "prompt": "Hello", "max_tokens": 3}),
        )
    });
    until("/health", 503);
    let r: Value = get_json(format!("{}/ready", s.base));
    assert_eq!(r["status"], "engine_stalled", "{r}");
    assert!(
        r["engine_error"]
            .as_str()
            .unwrap()
            .contains("--engine-stall-secs"),
        "{r}"
    );
    faults.stall_steps(false);
    let (code, r) = req.join().unwrap();
    assert_eq!(code, 200, "{r}");
    until("/health", 200);
    assert_eq!(probe("/ready"), 200);
}

/// `tool_choice: auto` without `parallel_tool_calls`: once the model has written a complete
/// call its answer ends there, with that one call and `finish_reason: "tool_calls"`, streamed
/// or not. It used to write on until `max_tokens` (`length`): here a regex makes the model
/// write a call and then lets it write text for ever (`ignore_eos`), so without the stop at
/// the call's close tag every answer would run to the limit.
#[test]
fn an_auto_call_without_parallel_calls_ends_the_choice() {
    let s = server();
    let call = r#"<tool_call>\n\{"name":"get_weather","arguments":\{"city":"Paris","unit":"celsius"\}\}\n</tool_call>"#;
    for seed in 0..3 {
        let mut body = chat(
            "What is the weather in Paris?",
            json!({"max_tokens": 80, "ignore_eos": true, "temperature": 0.8, "seed": seed,
                "tools": weather_tools(), "tool_choice": "auto", "parallel_tool_calls": false,
                "guided_regex": format!("{call}[a-z<>/ \\n]*")}),
        );
        let (code, r) = post(&s.base, "/v1/chat/completions", body.clone());
        assert_eq!(code, 200, "{r}");
        let calls = calls_of(&r);
        assert_eq!(calls.len(), 1, "{r}");
        assert_eq!(calls[0].0, "get_weather");
        assert!(r["choices"][0]["message"]["content"].is_null(), "{r}");
        body["stream"] = json!(true);
        assert_eq!(
            streamed_calls(&sse(&s.base, "/v1/chat/completions", body)),
            calls
        );
    }
}

/// The text of a `/v1/responses` answer's message items.
fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn responses_greedy_equals_chat_and_streams_the_documented_events() {
    let s = server();
    let (code, chat_r) = post(
        &s.base,
        "/v1/chat/completions",
        json!({"model": "smollm2", "max_tokens": 20, "temperature": 0, "ignore_eos": true,
            "messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three colors."}]}),
    );
    assert_eq!(code, 200, "{chat_r}");
    let body = json!({"model": "smollm2", "max_output_tokens": 20, "temperature": 0,
        "ignore_eos": true, "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}]});
    let (code, r) = post(&s.base, "/v1/responses", body.clone());
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "incomplete", "{r}");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(output_text(&r), chat_content(&chat_r));
    assert_eq!(r["usage"]["input_tokens"], chat_r["usage"]["prompt_tokens"]);
    assert_eq!(r["usage"]["output_tokens"], 20);
    assert!(r["usage"]["input_tokens_details"]["cached_tokens"].is_u64());
    // Streamed: `event:` then `data:`, numbered, in the documented order, no `[DONE]`.
    let mut stream = body;
    stream["stream"] = json!(true);
    let text = post_response(&s.base, "/v1/responses", &stream)
        .text()
        .unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    let mut kinds = Vec::new();
    let mut deltas = String::new();
    for pair in lines.chunks(2) {
        let kind = pair[0]
            .strip_prefix("event: ")
            .expect("an event line first");
        let data: Value = serde_json::from_str(pair[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], kind);
        assert_eq!(data["sequence_number"], kinds.len());
        if kind == "response.output_text.delta" {
            deltas.push_str(data["delta"].as_str().unwrap());
        }
        if kind == "response.incomplete" {
            assert_eq!(output_text(&data["response"]), output_text(&r));
            assert_eq!(data["response"]["usage"]["output_tokens"], 20);
        }
        kinds.push(kind.to_string());
    }
    assert_eq!(deltas, output_text(&r));
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
}

#[test]
fn responses_tools_formats_and_refusals() {
    let s = server();
    let tool = json!({"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}});
    let (code, r) = post(
        &s.base,
        "/v1/responses",
        json!({"model": "smollm2", "input": "Weather in Paris?", "tools": [tool],
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0}),
    );
    assert_eq!(code, 200, "{r}");
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function_call item in {r}"))
        .clone();
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{args}");
    // The call and its output go back as input items.
    let (code, r2) = post(
        &s.base,
        "/v1/responses",
        json!({"model": "smollm2", "tools": [tool], "max_output_tokens": 8, "temperature": 0,
            "input": [{"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "{\"celsius\": 21}"}]}),
    );
    assert_eq!(code, 200, "{r2}");
    // text.format json_schema goes through the constraint engine.
    let (code, r3) = post(
        &s.base,
        "/v1/responses",
        json!({"model": "smollm2", "input": "A color as JSON.", "max_output_tokens": 40, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "c", "strict": true,
                "schema": {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"]}}}}),
    );
    assert_eq!(code, 200, "{r3}");
    let v: Value = serde_json::from_str(&output_text(&r3)).unwrap();
    assert!(v["color"].is_string(), "{v}");
    for (body, param) in [
        (
            json!({"model": "smollm2", "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"model": "smollm2", "input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"model": "smollm2", "input": [{"type": "reasoning", "summary": []}]}),
            "input[0].type",
        ),
        (
            json!({"model": "smollm2", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}),
            "tools[0].name",
        ),
    ] {
        let (code, e) = post(&s.base, "/v1/responses", body);
        assert_eq!(code, 400, "{e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
}

#[test]
fn model_retrieve_and_completion_echo() {
    let s = server();
    let r: Value = get_json(format!("{}/v1/models/smollm2", s.base));
    assert_eq!(r["id"], "smollm2");
    assert_eq!(r["object"], "model");
    let r = client()
        .get(format!("{}/v1/models/org/other", s.base))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "model_not_found");
    let body =
        json!({"model": "smollm2", "prompt": "The sky is", "max_tokens": 5, "temperature": 0});
    let (_, plain) = post(&s.base, "/v1/completions", body.clone());
    let mut echo = body.clone();
    echo["echo"] = json!(true);
    let (code, r) = post(&s.base, "/v1/completions", echo.clone());
    assert_eq!(code, 200, "{r}");
    let expected = format!(
        "The sky is{}",
        plain["choices"][0]["text"].as_str().unwrap()
    );
    assert_eq!(r["choices"][0]["text"], expected.as_str());
    echo["stream"] = json!(true);
    let streamed: String = sse(&s.base, "/v1/completions", echo.clone())
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(streamed, expected);
    echo["stream"] = json!(false);
    echo["logprobs"] = json!(1);
    let (code, e) = post(&s.base, "/v1/completions", echo);
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["error"]["param"], "echo");
}

/// A Gateway API Inference Extension endpoint picker reads the vLLM spellings: under load
/// they show the queue, the running batch and the KV blocks in use, and go back to zero.
#[test]
fn gie_model_server_metrics_follow_the_load() {
    let s = spawn_limited(2, 8);
    let text = metrics_text(&s);
    let info = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .unwrap_or_else(|| panic!("no vllm:cache_config_info in {text}"));
    assert!(
        info.contains(r#"block_size="16""#) && info.ends_with(" 1"),
        "{info}"
    );
    assert!(text.contains(r#"max_lora="0"} 1"#), "{text}");
    assert_eq!(metric(&text, "vllm:num_requests_waiting"), 0.0);
    let long = json!({"model": "default", "prompt": "Once upon a time", "max_tokens": 1000,
        "stream": true, "temperature": 0.8, "ignore_eos": true});
    let streams: Vec<_> = (0..6)
        .map(|_| post_response(&s.base, "/v1/completions", &long))
        .collect();
    let seen = poll_metrics(&s, 100, Duration::from_millis(50), |text| {
        let (waiting, running, kv) = (
            metric(text, "vllm:num_requests_waiting"),
            metric(text, "vllm:num_requests_running"),
            metric(text, "vllm:kv_cache_usage_perc"),
        );
        let loaded = waiting >= 4.0 && running == 2.0 && kv > 0.0;
        if loaded {
            assert_eq!(waiting, metric(text, "dspark_num_requests_waiting"));
            assert_eq!(kv, metric(text, "vllm:gpu_cache_usage_perc"));
        }
        loaded
    });
    assert!(
        seen,
        "the gauges never showed 4 waiting, 2 running and KV in use"
    );
    drop(streams);
    let idle = poll_metrics(&s, 100, Duration::from_millis(100), |text| {
        metric(text, "vllm:num_requests_waiting") == 0.0
            && metric(text, "vllm:num_requests_running") == 0.0
            && metric(text, "vllm:kv_cache_usage_perc") == 0.0
    });
    assert!(idle, "the GIE gauges did not go back to zero");
}
