//! The engine version that keys cost tables: `engine.version`, else the image's tag.

use super::EngineSpec;

/// The tag of an image reference (`None`: a digest-only or untagged reference).
fn image_tag(image: &str) -> Option<&str> {
    let name = image.split('@').next().unwrap_or_default();
    let last = name.rsplit('/').next().unwrap_or_default();
    last.split_once(':')
        .map(|(_, t)| t)
        .filter(|t| !t.is_empty())
}

impl EngineSpec {
    /// The version that keys cost tables: `version`, else the image tag (the operator's
    /// version with the default images), else `latest`.
    pub fn effective_version(&self) -> String {
        if let Some(v) = &self.version {
            return v.clone();
        }
        match &self.image {
            Some(i) => image_tag(i).unwrap_or("latest").to_string(),
            None => env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}
