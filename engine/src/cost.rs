//! The engine's current SPS(B) cost table and where it came from.
//!
//! Three sources: a built-in conservative default (no table given), a file (`--cost-table`,
//! polled and hot-reloaded when its content changes, e.g. a mounted ConfigMap whose symlinks
//! are swapped), and an admin push (`PUT /admin/v1/cost-table`). A table that is malformed,
//! non-monotone, or measured for another model, device or engine version is refused with the
//! reason and the current one stays. The engine takes one snapshot per step, so a swap is
//! atomic between steps.

use crate::metrics::Metrics;
use dspark_types::{CostTable, CostTableError, CostTableSource, COST_TABLE_SCHEMA};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// The table in force.
#[derive(Debug, Clone)]
pub struct ActiveTable {
    pub table: CostTable,
    pub source: CostTableSource,
    /// Bumped on every accepted swap; 0 is the built-in default.
    pub revision: u64,
    pub digest: String,
}

impl ActiveTable {
    /// SPS at `b` tokens.
    pub fn sps(&self, b: usize) -> f64 {
        self.table.sps(b.min(u32::MAX as usize) as u32)
    }
}

/// Shared between the engine thread (reads a snapshot per step), the admin API and the file
/// watcher (swap).
pub struct CostTables {
    current: RwLock<Arc<ActiveTable>>,
    model_id: String,
    device: String,
    /// Serialises installs so revisions are handed out in order.
    install_lock: Mutex<()>,
    metrics: Option<Arc<Metrics>>,
}

/// The built-in table used until a measured one arrives: SPS(1) = 100 and every extra
/// token costs half a single-token step (`SPS(B) = 100 / (1 + (B-1)/2)`), so verifying
/// pays only for drafts with high survival. This is steeper than the measured CPU and GPU
/// curves at small B (see docs/benchmarks.md), i.e. it errs toward shorter verify lengths.
pub fn default_table(model_id: &str, device: &str) -> CostTable {
    let points = [1u32, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        .iter()
        .map(|&b| (b, 100.0 / (1.0 + (b as f64 - 1.0) / 2.0)))
        .collect();
    CostTable {
        schema: COST_TABLE_SCHEMA,
        model_id: model_id.to_string(),
        drafter_id: None,
        engine_version: crate::VERSION.to_string(),
        device: device.to_string(),
        node_type: None,
        dtype: "builtin-default".into(),
        measured_at: "1970-01-01T00:00:00Z".into(),
        points,
        draft_points: Vec::new(),
    }
}

impl CostTables {
    /// Starts on the built-in default for this model and device.
    pub fn new(model_id: &str, device: &str, metrics: Option<Arc<Metrics>>) -> Self {
        let table = default_table(model_id, device);
        let active = ActiveTable {
            digest: table.digest(),
            table,
            source: CostTableSource::Default,
            revision: 0,
        };
        let s = Self {
            current: RwLock::new(Arc::new(active)),
            model_id: model_id.to_string(),
            device: device.to_string(),
            install_lock: Mutex::new(()),
            metrics,
        };
        s.publish();
        s
    }

    /// The table in force (a cheap snapshot).
    pub fn current(&self) -> Arc<ActiveTable> {
        self.current.read().expect("cost table lock").clone()
    }

    /// Parses, validates and checks `text` against this engine, then swaps it in. An
    /// identical table (same digest) keeps the current revision. On error nothing changes.
    pub fn install(
        &self,
        text: &str,
        source: CostTableSource,
    ) -> Result<Arc<ActiveTable>, CostTableError> {
        let res = CostTable::from_json(text).and_then(|t| {
            t.check_compatible(&self.model_id, &self.device, crate::VERSION)?;
            Ok(t)
        });
        let table = match res {
            Ok(t) => t,
            Err(e) => {
                if let Some(m) = &self.metrics {
                    m.cost_table_refusals.inc();
                }
                return Err(e);
            }
        };
        let _g = self.install_lock.lock().expect("install lock");
        let cur = self.current();
        let digest = table.digest();
        if digest == cur.digest && cur.source != CostTableSource::Default {
            return Ok(cur);
        }
        let active = Arc::new(ActiveTable {
            table,
            source,
            revision: cur.revision + 1,
            digest,
        });
        *self.current.write().expect("cost table lock") = active.clone();
        self.publish();
        tracing::info!(
            revision = active.revision,
            source = ?source,
            digest = %active.digest,
            "cost table installed"
        );
        Ok(active)
    }

    /// Loads `path` now, then polls it every `every` and reinstalls when its content
    /// changes; a bad new content is logged and counted, and the current table stays.
    /// At start-up an unreadable or invalid table is an error (a bad `--cost-table` fails
    /// fast), but a valid table measured for another model, device or engine version only
    /// logs an error, counts a refusal and leaves the built-in default in force: a mounted
    /// table that does not fit (a new commit of the weights, a moved S3 object) must not
    /// crash-loop a fleet over what is only a speed table.
    pub fn watch_file(self: &Arc<Self>, path: &Path, every: Duration) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read cost table {}: {e}", path.display()))?;
        match self.install(&text, CostTableSource::File) {
            Ok(_) => {}
            Err(
                e @ (CostTableError::WrongModel { .. }
                | CostTableError::WrongDevice { .. }
                | CostTableError::WrongEngineVersion { .. }),
            ) => tracing::error!(
                "cost table {} does not fit this engine, serving on the built-in default: {e}",
                path.display()
            ),
            Err(e) => anyhow::bail!("{}: {e}", path.display()),
        }
        let me = self.clone();
        let path: PathBuf = path.to_path_buf();
        std::thread::Builder::new()
            .name("cost-table-watch".into())
            .spawn(move || {
                let mut last = text;
                loop {
                    std::thread::sleep(every);
                    let Ok(now) = std::fs::read_to_string(&path) else {
                        // A ConfigMap update briefly removes the file: keep the table.
                        continue;
                    };
                    if now == last {
                        continue;
                    }
                    last = now;
                    if let Err(e) = me.install(&last, CostTableSource::File) {
                        tracing::error!(
                            "cost table {} changed but was refused, keeping revision {}: {e}",
                            path.display(),
                            me.current().revision
                        );
                    }
                }
            })?;
        Ok(())
    }

    fn publish(&self) {
        let Some(m) = &self.metrics else { return };
        let cur = self.current();
        m.cost_table_revision.set(cur.revision as i64);
        for s in [
            CostTableSource::Default,
            CostTableSource::File,
            CostTableSource::Admin,
            CostTableSource::StartupProfile,
        ] {
            m.cost_table_source
                .get_or_create(&crate::metrics::SourceLabel {
                    source: source_name(s).into(),
                })
                .set(i64::from(s == cur.source));
        }
    }
}

/// The snake_case name of a source, as in the admin API.
pub fn source_name(s: CostTableSource) -> &'static str {
    match s {
        CostTableSource::Default => "default",
        CostTableSource::File => "file",
        CostTableSource::Admin => "admin",
        CostTableSource::StartupProfile => "startup_profile",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(model: &str, points: &[(u32, f64)]) -> String {
        let mut t = default_table(model, "cpu");
        t.dtype = "q4_1".into();
        t.points = points.to_vec();
        serde_json::to_string(&t).unwrap()
    }

    /// A scratch folder holding `cost-table.json` with `table(model, points)`: the folder
    /// and the file.
    fn table_file(model: &str, points: &[(u32, f64)]) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = crate::testutil::scratch_dir("cost");
        let path = dir.join("cost-table.json");
        std::fs::write(&path, table(model, points)).unwrap();
        (dir, path)
    }

    /// Polls `done` every 10 ms, 200 times at most: whether it came true.
    fn wait_until(done: impl Fn() -> bool) -> bool {
        for _ in 0..200 {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn default_is_valid_and_monotone() {
        let t = default_table("m", "cpu");
        t.validate().unwrap();
        assert_eq!(t.sps(1), 100.0);
        assert!((t.sps(4) - 40.0).abs() < 1e-9);
    }

    #[test]
    fn install_refuses_bad_tables_and_keeps_the_current_one() {
        let c = CostTables::new("m", "cpu", None);
        assert_eq!(c.current().revision, 0);
        let good = table("m", &[(1, 100.0), (8, 50.0)]);
        let a = c.install(&good, CostTableSource::Admin).unwrap();
        assert_eq!((a.revision, a.source), (1, CostTableSource::Admin));
        for (bad, want) in [
            ("{not json".to_string(), "not valid JSON"),
            (table("m", &[(1, 10.0), (8, 50.0)]), "not monotone"),
            (table("other", &[(1, 10.0)]), "is for model 'other'"),
            (table("m", &[]), "no points"),
        ] {
            let e = c.install(&bad, CostTableSource::Admin).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
            assert_eq!(c.current().revision, 1);
        }
        let mut gpu: CostTable = serde_json::from_str(&good).unwrap();
        gpu.device = "cuda".into();
        let e = c
            .install(
                &serde_json::to_string(&gpu).unwrap(),
                CostTableSource::Admin,
            )
            .unwrap_err();
        assert!(matches!(e, CostTableError::WrongDevice { .. }));
        // Same table again: no new revision.
        assert_eq!(c.install(&good, CostTableSource::File).unwrap().revision, 1);
    }

    #[test]
    fn file_is_hot_reloaded_and_bad_edits_are_ignored() {
        let (dir, path) = table_file("m", &[(1, 100.0), (4, 60.0)]);
        let c = Arc::new(CostTables::new("m", "cpu", None));
        c.watch_file(&path, Duration::from_millis(20)).unwrap();
        assert_eq!(c.current().revision, 1);
        assert_eq!(c.current().source, CostTableSource::File);
        let wait_for = |rev: u64| wait_until(|| c.current().revision == rev);
        // A ConfigMap-style swap: write elsewhere, rename over.
        let tmp = dir.join("tmp.json");
        std::fs::write(&tmp, table("m", &[(1, 100.0), (4, 80.0)])).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert!(wait_for(2), "new table not picked up");
        assert_eq!(c.current().sps(4), 80.0);
        std::fs::write(&path, "garbage").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(c.current().revision, 2);
        assert_eq!(c.current().sps(4), 80.0);
        std::fs::write(&path, table("m", &[(1, 90.0)])).unwrap();
        assert!(wait_for(3));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_or_bad_file_fails_at_start() {
        let c = Arc::new(CostTables::new("m", "cpu", None));
        let e = c
            .watch_file(Path::new("/nonexistent/ct.json"), Duration::from_secs(1))
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ct.json"), "{e}");
        let path = std::env::temp_dir().join(format!("dspark-ct-bad-{}.json", std::process::id()));
        std::fs::write(&path, table("m", &[(1, 10.0), (8, 50.0)])).unwrap();
        let e = c.watch_file(&path, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("not monotone"), "{e}");
        std::fs::remove_file(&path).ok();
    }

    /// A valid table for another model (a new commit of the weights) at start leaves the
    /// default in force and counts a refusal; once the file holds a fitting table, it is
    /// installed.
    #[test]
    fn a_table_for_another_model_at_start_serves_the_default_until_one_fits() {
        let (dir, path) = table_file("m@0123456789ab", &[(1, 100.0), (4, 60.0)]);
        let metrics = Arc::new(Metrics::new("m"));
        let c = Arc::new(CostTables::new(
            "m@ba9876543210",
            "cpu",
            Some(metrics.clone()),
        ));
        c.watch_file(&path, Duration::from_millis(20)).unwrap();
        assert_eq!(c.current().source, CostTableSource::Default);
        assert_eq!(metrics.cost_table_refusals.get(), 1);
        std::fs::write(&path, table("m@ba9876543210", &[(1, 100.0), (4, 70.0)])).unwrap();
        wait_until(|| c.current().source == CostTableSource::File);
        assert_eq!(c.current().source, CostTableSource::File);
        assert_eq!(c.current().sps(4), 70.0);
        std::fs::remove_dir_all(&dir).ok();
    }
}
