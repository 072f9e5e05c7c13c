//! What keys a deployment's cost tables: each source's identity plus its resolved revision,
//! the engine version and the pool's node type.

use super::{DSparkDeployment, NodePool, ResolvedSource, SOURCE_ROLES};
use crate::crd::cost_table::CostTableKey;

impl DSparkDeployment {
    /// The revision resolved for the `role` source as the spec names it now (a resolution of
    /// a source the spec no longer names does not count).
    pub fn resolved(&self, role: &str) -> Option<&ResolvedSource> {
        let uri = self.spec.source(role)?.fetch_uri()?;
        self.status
            .as_ref()?
            .resolved_sources
            .iter()
            .find(|r| r.role == role && r.source == uri)
    }

    /// What keys `role`'s part of a cost table: a volume's identity, or a remote source's
    /// identity plus `@` and its resolved revision (a new commit is a new table); `None`
    /// while a remote source is not resolved yet.
    fn keyed_identity(&self, role: &str) -> Option<String> {
        let src = self.spec.source(role)?;
        if src.fetch_uri().is_none() {
            return Some(src.identity());
        }
        self.resolved(role)
            .map(|r| format!("{}@{}", src.identity(), r.revision))
    }

    /// The cost-table key of `pool`; `None` until every remote source has been resolved by
    /// a first fetch (no table is measured for weights whose revision is unknown).
    pub fn cost_table_key(&self, pool: &NodePool) -> Option<CostTableKey> {
        Some(CostTableKey {
            model_id: self.keyed_identity("model")?,
            drafter_id: match &self.spec.drafter {
                Some(_) => Some(self.keyed_identity("drafter")?),
                None => None,
            },
            engine_version: self.spec.engine.effective_version(),
            node_type: pool.node_type.clone(),
        })
    }

    /// The remote sources not resolved yet, as the spec names them.
    pub fn unresolved_sources(&self) -> Vec<String> {
        SOURCE_ROLES
            .iter()
            .filter_map(|role| {
                let uri = self.spec.source(role)?.fetch_uri()?;
                self.resolved(role).is_none().then_some(uri)
            })
            .collect()
    }
}
