//! Typed API errors, mapped to HTTP status codes and OpenAI error bodies in one place.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dspark_types::{ErrorBody, ErrorDetail};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }
    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("The model '{model}' does not exist; this server serves '{served}' (alias 'default')"),
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            message: message.into(),
            param: None,
            code: Some("queue_full"),
            retry_after: Some(1),
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: Some(5),
        }
    }
    /// A request body over `--max-request-bytes`.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: format!(
                "the request body is larger than this server's limit of {limit} bytes ({:.1} MiB)",
                limit as f64 / (1024.0 * 1024.0)
            ),
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }
    /// A request whose analysis would cost more than `--max-grammar-work` allows.
    pub fn over_budget(param: &str, message: impl Into<String>) -> Self {
        Self {
            code: Some("limit_exceeded"),
            ..Self::invalid(param, message)
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                param: self.param.clone(),
                code: self.code.map(String::from),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Malformed JSON bodies get the same OpenAI-style error shape.
impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(r: axum::extract::rejection::JsonRejection) -> Self {
        let mut e = ApiError::bad_request(format!("invalid JSON body: {}", r.body_text()));
        match r.status() {
            StatusCode::UNSUPPORTED_MEDIA_TYPE => e.status = StatusCode::UNSUPPORTED_MEDIA_TYPE,
            StatusCode::PAYLOAD_TOO_LARGE => {
                e.status = StatusCode::PAYLOAD_TOO_LARGE;
                e.code = Some("request_too_large");
            }
            _ => {}
        }
        e
    }
}
