//! The crate's one error type.

/// Everything a reconcile or a loop of the operator can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    #[error("applying {kind} {name}: {}", api_message(source))]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("pruning {kind} {name}: {}", api_message(source))]
    Prune {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("could not serialize {what}: {source}")]
    Serialize {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("object {0} has no namespace; DSpark resources are namespaced")]
    NoNamespace(String),
    #[error("engine pod {pod} at {url}: {message}")]
    Engine {
        pod: String,
        url: String,
        message: String,
    },
    #[error("the watch caches never filled: {0}")]
    Cache(String),
    #[error("the CRD {name} was not Established within {seconds} s")]
    CrdNotEstablished { name: String, seconds: u64 },
    #[error("cannot generate the engines' admin token: {0}")]
    Token(#[source] std::io::Error),
    #[error("invalid cost table from {source_name}: {error}; the engine keeps its current table")]
    CostTable {
        source_name: String,
        #[source]
        error: dspark_types::CostTableError,
    },
}

impl Error {
    /// For `map_err` on an apply (or patch) of the `K` named `name`.
    pub fn applying<K: kube::Resource<DynamicType = ()>>(
        name: &str,
    ) -> impl FnOnce(kube::Error) -> Self + '_ {
        move |source| Self::Apply {
            kind: K::kind(&()).into(),
            name: name.to_string(),
            source,
        }
    }

    /// A CamelCase reason for conditions and Events.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Kube(_) => "APIError",
            Self::Apply { .. } => "ApplyFailed",
            Self::Prune { .. } => "PruneFailed",
            Self::Serialize { .. } => "SerializeFailed",
            Self::NoNamespace(_) => "NoNamespace",
            Self::Engine { .. } => "EngineError",
            Self::Token(_) => "AdminTokenFailed",
            Self::Cache(_) => "CacheFailed",
            Self::CrdNotEstablished { .. } => "CrdNotEstablished",
            Self::CostTable { .. } => "InvalidCostTable",
        }
    }
}

impl Error {
    /// Whether retrying alone is likely to cure it: a conflict, throttling, an apiserver
    /// fault (5xx) or no answer at all. A refusal (any other 4xx: invalid, forbidden, denied
    /// by admission) needs someone to change something.
    pub fn is_transient(&self) -> bool {
        let kube = match self {
            Self::Kube(e) | Self::Apply { source: e, .. } | Self::Prune { source: e, .. } => e,
            Self::Engine { .. } => return true,
            _ => return false,
        };
        match kube {
            kube::Error::Api(s) => matches!(s.code, 409 | 429) || s.code >= 500,
            _ => true,
        }
    }
}

/// The apiserver's own message (and code) for an API error; the error itself otherwise.
fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({} {})", s.message, s.code, s.reason),
        e => e.to_string(),
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn refusals_are_not_transient_and_carry_the_apiservers_message() {
        let denied = Error::Apply {
            kind: "Service".into(),
            name: "smollm2-a100".into(),
            source: api(
                403,
                "Forbidden",
                "ValidatingAdmissionPolicy 'p' denied request",
            ),
        };
        assert!(!denied.is_transient());
        assert_eq!(denied.reason(), "ApplyFailed");
        assert_eq!(
            denied.to_string(),
            "applying Service smollm2-a100: ValidatingAdmissionPolicy 'p' denied request (403 Forbidden)"
        );
        for code in [409, 429, 500, 503] {
            assert!(Error::Kube(api(code, "x", "y")).is_transient(), "{code}");
        }
        assert!(!Error::Kube(api(422, "Invalid", "bad")).is_transient());
        assert!(!Error::NoNamespace("x".into()).is_transient());
    }
}
