//! The engine images a deployment without `spec.engine.image` runs: the process's defaults,
//! set once at start from the operator's flags, and the choice per pool.

use super::deployment::{EngineSpec, NodePool};

/// The engine images a deployment without `spec.engine.image` runs: full references (a tag
/// or a digest), set once at start from the operator's flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineImages {
    /// For pools without GPUs.
    pub cpu: String,
    /// For pools that request GPUs (`--features cuda`, CUDA user-space libraries inside).
    pub cuda: String,
}

impl Default for EngineImages {
    fn default() -> Self {
        let v = env!("CARGO_PKG_VERSION");
        Self {
            cpu: format!("dspark/engine:{v}"),
            cuda: format!("dspark/engine-cuda:{v}"),
        }
    }
}

static ENGINE_IMAGES: std::sync::OnceLock<EngineImages> = std::sync::OnceLock::new();

impl EngineImages {
    /// Sets the process's default engine images (once, at start; later calls are ignored).
    pub fn install(self) {
        let _ = ENGINE_IMAGES.set(self);
    }

    /// The process's default engine images.
    pub fn current() -> &'static EngineImages {
        ENGINE_IMAGES.get_or_init(EngineImages::default)
    }
}

impl EngineSpec {
    /// The image of `pool`'s engine pods: `image`, else the default engine image for its
    /// accelerators (CUDA when the pool requests GPUs).
    pub fn image_for(&self, pool: &NodePool) -> String {
        if let Some(i) = &self.image {
            return i.clone();
        }
        let d = EngineImages::current();
        if pool.gpu.count > 0 {
            d.cuda.clone()
        } else {
            d.cpu.clone()
        }
    }
}
