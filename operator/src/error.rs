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
            Self::CostTable { .. } => "InvalidCostTable",
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
