//! The SPS(B) cost table: target-forward steps per second as a function of the number of tokens
//! `B` in one batched forward, measured once per (model, drafter, engine version, device), and
//! (schema 2) the drafter's time per draft call by number of drafting sequences and draft
//! length, so the scheduler can price the whole draft-verify cycle.

use serde::{Deserialize, Serialize};

/// Version of the table's JSON layout written by this build. Schema 2 added `draft_points`;
/// schema 1 tables (no draft times) still load.
pub const COST_TABLE_SCHEMA: u32 = 2;

/// Oldest schema this build reads.
pub const MIN_COST_TABLE_SCHEMA: u32 = 1;

/// A Kubernetes container termination message holds at most 4096 bytes.
pub const MAX_COMPACT_BYTES: usize = 4096;

/// A measured SPS(B) table and what it was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostTable {
    pub schema: u32,
    pub model_id: String,
    #[serde(default)]
    pub drafter_id: Option<String>,
    pub engine_version: String,
    pub device: String,
    #[serde(default)]
    pub node_type: Option<String>,
    pub dtype: String,
    /// RFC 3339 time of the measurement.
    pub measured_at: String,
    /// `[B, steps_per_second]`, strictly increasing in B, non-increasing in SPS.
    pub points: Vec<(u32, f64)>,
    /// `[sequences, draft_length, seconds]`: wall time of one drafter call (context feed
    /// plus the batched draft) for that many drafting sequences and draft tokens each.
    /// Sorted by (sequences, draft_length), both strictly increasing; empty when the table
    /// was measured without a drafter (or by a schema-1 engine).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draft_points: Vec<(u32, u32, f64)>,
}

/// Why a cost table was refused. Every message says what is wrong and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostTableError {
    #[error("cost table is not valid JSON: {0}")]
    Malformed(String),
    #[error("cost table schema {found} is not supported (this build reads schemas {MIN_COST_TABLE_SCHEMA}..={expected}); re-run `dspark-engine profile` with this engine")]
    Schema { found: u32, expected: u32 },
    #[error("cost table draft point {index} is invalid: {why}")]
    BadDraftPoint { index: usize, why: String },
    #[error("cost table has no points; re-run `dspark-engine profile`")]
    Empty,
    #[error("cost table point {index} is invalid: {why}")]
    BadPoint { index: usize, why: String },
    #[error("cost table is not monotone: SPS({b_hi}) = {sps_hi} is above SPS({b_lo}) = {sps_lo}; a forward with more tokens cannot take less time, re-profile")]
    NotMonotone {
        b_lo: u32,
        sps_lo: f64,
        b_hi: u32,
        sps_hi: f64,
    },
    #[error(
        "cost table is for model '{table}' but this engine serves '{engine}'; profile this model"
    )]
    WrongModel { table: String, engine: String },
    #[error("cost table for device '{table}' does not match this engine's device '{engine}'; re-run `dspark-engine profile` on this device")]
    WrongDevice { table: String, engine: String },
    #[error("cost table was measured by engine {table}, incompatible with this engine {engine} (major.minor must match); re-profile")]
    WrongEngineVersion { table: String, engine: String },
    #[error("compact cost table is {0} bytes, over the {MAX_COMPACT_BYTES}-byte limit of a termination message")]
    TooLarge(usize),
}

impl CostTable {
    /// Parses and validates a table (structure only; see [`CostTable::check_compatible`]).
    pub fn from_json(text: &str) -> Result<Self, CostTableError> {
        let table: CostTable = serde_json::from_str(text.trim())
            .map_err(|e| CostTableError::Malformed(e.to_string()))?;
        table.validate()?;
        Ok(table)
    }

    /// Pretty JSON, for files and ConfigMaps.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("cost table serializes")
    }

    /// One-line JSON that fits a container termination message, or an error if it cannot.
    /// SPS values are rounded to 4 significant digits, far below measurement noise.
    pub fn to_compact(&self) -> Result<String, CostTableError> {
        let mut t = self.clone();
        for p in &mut t.points {
            p.1 = round_sig(p.1, 4);
        }
        for p in &mut t.draft_points {
            p.2 = round_sig(p.2, 3);
        }
        let s = serde_json::to_string(&t).expect("cost table serializes");
        if s.len() > MAX_COMPACT_BYTES {
            return Err(CostTableError::TooLarge(s.len()));
        }
        Ok(s)
    }

    /// Checks the structure: schema, at least one point, B strictly increasing and >= 1,
    /// SPS finite, positive and non-increasing in B.
    pub fn validate(&self) -> Result<(), CostTableError> {
        if !(MIN_COST_TABLE_SCHEMA..=COST_TABLE_SCHEMA).contains(&self.schema) {
            return Err(CostTableError::Schema {
                found: self.schema,
                expected: COST_TABLE_SCHEMA,
            });
        }
        if self.points.is_empty() {
            return Err(CostTableError::Empty);
        }
        for (i, &(b, sps)) in self.points.iter().enumerate() {
            if b == 0 {
                return Err(CostTableError::BadPoint {
                    index: i,
                    why: "B must be at least 1".into(),
                });
            }
            if !sps.is_finite() || sps <= 0.0 {
                return Err(CostTableError::BadPoint {
                    index: i,
                    why: format!("SPS must be a positive number, got {sps}"),
                });
            }
            if i > 0 {
                let (pb, psps) = self.points[i - 1];
                if b <= pb {
                    return Err(CostTableError::BadPoint {
                        index: i,
                        why: format!("B must increase strictly, got {b} after {pb}"),
                    });
                }
                if sps > psps {
                    return Err(CostTableError::NotMonotone {
                        b_lo: pb,
                        sps_lo: psps,
                        b_hi: b,
                        sps_hi: sps,
                    });
                }
            }
        }
        self.validate_draft_points()
    }

    fn validate_draft_points(&self) -> Result<(), CostTableError> {
        let bad = |index: usize, why: String| Err(CostTableError::BadDraftPoint { index, why });
        if self.schema < 2 && !self.draft_points.is_empty() {
            return bad(0, "draft points need schema 2".into());
        }
        for (i, &(n, l, secs)) in self.draft_points.iter().enumerate() {
            if n == 0 || l == 0 {
                return bad(
                    i,
                    format!("sequences and draft length must be at least 1, got [{n}, {l}]"),
                );
            }
            if !secs.is_finite() || secs <= 0.0 {
                return bad(i, format!("seconds must be a positive number, got {secs}"));
            }
            if i > 0 {
                let (pn, pl, _) = self.draft_points[i - 1];
                if (n, l) <= (pn, pl) {
                    return bad(i, format!("points must be sorted by (sequences, draft length), got [{n}, {l}] after [{pn}, {pl}]"));
                }
            }
        }
        Ok(())
    }

    /// Seconds of one drafter call for `n` drafting sequences of `l` draft tokens each, from
    /// the draft points: linear interpolation in `n` between the measured sequence counts
    /// (proportional beyond the largest, the first row's value below the smallest) at the
    /// nearest measured length at or above `l` (the longest when `l` is beyond it, scaled
    /// by `l / l_max`). `None` without draft points.
    pub fn draft_seconds(&self, n: u32, l: u32) -> Option<f64> {
        if self.draft_points.is_empty() || n == 0 || l == 0 {
            return (!self.draft_points.is_empty()).then_some(0.0);
        }
        // Rows: one per measured n, each the time at the chosen length.
        let mut rows: Vec<(u32, f64)> = Vec::new();
        let mut k = 0;
        let pts = &self.draft_points;
        while k < pts.len() {
            let n0 = pts[k].0;
            let end = k + pts[k..].iter().take_while(|p| p.0 == n0).count();
            let row = &pts[k..end];
            let t = match row.iter().find(|p| p.1 >= l) {
                Some(p) => p.2,
                None => {
                    let last = row[row.len() - 1];
                    last.2 * l as f64 / last.1 as f64
                }
            };
            rows.push((n0, t));
            k = end;
        }
        let (n_first, t_first) = rows[0];
        if n <= n_first {
            return Some(t_first);
        }
        let (n_last, t_last) = rows[rows.len() - 1];
        if n >= n_last {
            return Some(t_last * n as f64 / n_last as f64);
        }
        let i = rows.partition_point(|&(rn, _)| rn <= n);
        let (xa, ya) = rows[i - 1];
        let (xb, yb) = rows[i];
        let t = (n - xa) as f64 / (xb - xa) as f64;
        Some(ya + t * (yb - ya))
    }

    /// Checks that the table was measured for this model, device and engine version.
    pub fn check_compatible(
        &self,
        model_id: &str,
        device: &str,
        engine_version: &str,
    ) -> Result<(), CostTableError> {
        if self.model_id != model_id {
            return Err(CostTableError::WrongModel {
                table: self.model_id.clone(),
                engine: model_id.to_string(),
            });
        }
        if self.device != device {
            return Err(CostTableError::WrongDevice {
                table: self.device.clone(),
                engine: device.to_string(),
            });
        }
        if major_minor(&self.engine_version) != major_minor(engine_version) {
            return Err(CostTableError::WrongEngineVersion {
                table: self.engine_version.clone(),
                engine: engine_version.to_string(),
            });
        }
        Ok(())
    }

    /// SPS at `b` tokens: between two points the step TIME is linear in B (each extra token
    /// costs the same, as it does within a measured interval), so the token throughput
    /// `B * SPS(B)` between them lies between theirs and never shows a bump the measurements
    /// do not (interpolating SPS itself, e.g. in log B, invents throughput between points
    /// that makes a planner draft where even a perfect drafter cannot pay); below the first
    /// point the first value; beyond the last point the token throughput stays at the last
    /// point's (`SPS(B) = SPS(B_max) * B_max / B`), which is the conservative reading.
    pub fn sps(&self, b: u32) -> f64 {
        let b = b.max(1);
        let pts = &self.points;
        let (b0, s0) = pts[0];
        if b <= b0 {
            return s0;
        }
        let (bl, sl) = pts[pts.len() - 1];
        if b >= bl {
            return sl * bl as f64 / b as f64;
        }
        let i = pts.partition_point(|&(pb, _)| pb <= b);
        let (xa, ya) = pts[i - 1];
        let (xb, yb) = pts[i];
        let t = (b - xa) as f64 / (xb - xa) as f64;
        1.0 / (1.0 / ya + t * (1.0 / yb - 1.0 / ya))
    }

    /// A stable digest of the measured content (FNV-1a over the compact JSON), used to tell
    /// whether an engine already holds a table.
    pub fn digest(&self) -> String {
        let s = serde_json::to_string(self).expect("cost table serializes");
        let mut h: u64 = 0xcbf29ce484222325;
        for byte in s.bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        format!("{h:016x}")
    }
}

fn major_minor(v: &str) -> (String, String) {
    let mut it = v.trim_start_matches('v').split('.');
    (
        it.next().unwrap_or("").to_string(),
        it.next().unwrap_or("").to_string(),
    )
}

fn round_sig(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let mag = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(digits - 1 - mag);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(points: Vec<(u32, f64)>) -> CostTable {
        CostTable {
            schema: COST_TABLE_SCHEMA,
            model_id: "smollm2".into(),
            drafter_id: None,
            engine_version: "0.1.3".into(),
            device: "cpu".into(),
            node_type: Some("cpu-2c".into()),
            dtype: "q4_1".into(),
            measured_at: "2026-11-29T00:00:00Z".into(),
            points,
            draft_points: Vec::new(),
        }
    }

    #[test]
    fn schema_one_tables_load_and_draft_points_need_schema_two() {
        let v1 = r#"{"schema":1,"model_id":"m","engine_version":"0.1.0","device":"cpu","dtype":"q4_1","measured_at":"t","points":[[1,100.0],[4,80.0]]}"#;
        let t = CostTable::from_json(v1).unwrap();
        assert!(t.draft_points.is_empty());
        assert_eq!(t.draft_seconds(4, 3), None);
        let mut t2 = t.clone();
        t2.draft_points = vec![(1, 1, 0.001)];
        assert!(matches!(
            t2.validate(),
            Err(CostTableError::BadDraftPoint { .. })
        ));
        t2.schema = 2;
        t2.validate().unwrap();
        // The compact form without draft points is unchanged (no empty field).
        assert!(!t.to_compact().unwrap().contains("draft_points"));
    }

    #[test]
    fn draft_points_are_validated_and_interpolated() {
        let mut t = table(vec![(1, 100.0)]);
        t.draft_points = vec![(1, 1, 0.001), (1, 4, 0.002), (4, 1, 0.002), (4, 4, 0.004)];
        t.validate().unwrap();
        assert_eq!(t.draft_seconds(1, 1), Some(0.001));
        assert_eq!(t.draft_seconds(1, 3), Some(0.002)); // next measured length up
        assert_eq!(t.draft_seconds(1, 8), Some(0.004)); // beyond: scaled by length
        assert!((t.draft_seconds(2, 4).unwrap() - (0.002 + 0.002 / 3.0)).abs() < 1e-12);
        assert!((t.draft_seconds(8, 4).unwrap() - 0.008).abs() < 1e-12); // proportional
        assert_eq!(t.draft_seconds(0, 4), Some(0.0));
        let mut bad = t.clone();
        bad.draft_points.swap(1, 2);
        assert!(matches!(
            bad.validate(),
            Err(CostTableError::BadDraftPoint { index: 2, .. })
        ));
        bad.draft_points = vec![(1, 0, 0.1)];
        assert!(bad.validate().is_err());
        bad.draft_points = vec![(1, 1, -0.1)];
        assert!(bad.validate().is_err());
    }

    #[test]
    fn a_full_draft_grid_fits_the_compact_form() {
        let mut t = table((1..=12u32).map(|i| (i * 11, 1000.0 / i as f64)).collect());
        for n in [1u32, 2, 4, 8, 16, 32, 64, 128] {
            for l in 1..=16u32 {
                t.draft_points
                    .push((n, l, 0.000_123_456 * n as f64 * l as f64));
            }
        }
        let c = t.to_compact().unwrap();
        assert!(c.len() <= MAX_COMPACT_BYTES, "{} bytes", c.len());
        let back = CostTable::from_json(&c).unwrap();
        assert_eq!(back.draft_points.len(), 128);
    }

    #[test]
    fn refuses_non_monotone_and_bad_points() {
        let t = table(vec![(1, 100.0), (2, 120.0)]);
        assert!(matches!(
            t.validate(),
            Err(CostTableError::NotMonotone { .. })
        ));
        let t = table(vec![(2, 100.0), (2, 90.0)]);
        assert!(matches!(
            t.validate(),
            Err(CostTableError::BadPoint { index: 1, .. })
        ));
        let t = table(vec![(1, f64::NAN)]);
        assert!(matches!(
            t.validate(),
            Err(CostTableError::BadPoint { index: 0, .. })
        ));
        assert_eq!(table(vec![]).validate(), Err(CostTableError::Empty));
        let mut t = table(vec![(1, 10.0)]);
        t.schema = 99;
        assert!(matches!(t.validate(), Err(CostTableError::Schema { .. })));
        t.schema = 0;
        assert!(matches!(t.validate(), Err(CostTableError::Schema { .. })));
        assert!(matches!(
            CostTable::from_json("{not json"),
            Err(CostTableError::Malformed(_))
        ));
    }

    #[test]
    fn compatibility_names_the_mismatch() {
        let t = table(vec![(1, 100.0)]);
        assert!(t.check_compatible("smollm2", "cpu", "0.1.9").is_ok());
        let e = t.check_compatible("other", "cpu", "0.1.3").unwrap_err();
        assert!(e.to_string().contains("'smollm2'"));
        let e = t
            .check_compatible("smollm2", "NVIDIA H200", "0.1.3")
            .unwrap_err();
        assert!(e.to_string().contains("NVIDIA H200"));
        assert!(t.check_compatible("smollm2", "cpu", "0.2.0").is_err());
    }

    #[test]
    fn interpolates_step_time_and_extrapolates_conservatively() {
        let t = table(vec![(1, 100.0), (4, 50.0), (16, 20.0)]);
        assert_eq!(t.sps(1), 100.0);
        // Step time 10 ms at B = 1, 20 ms at B = 4: 13.3 ms at B = 2.
        assert!((t.sps(2) - 75.0).abs() < 1e-9);
        assert!((t.sps(10) - 1.0 / 0.035).abs() < 1e-9);
        assert_eq!(t.sps(16), 20.0);
        assert!((t.sps(32) - 10.0).abs() < 1e-9);
        // A table measured from `SPS = 100 / B` (every token costs a whole step) reads back
        // exactly between its points: no throughput that was not measured.
        let steep = table(
            (0..8)
                .map(|i| (1u32 << i, 100.0 / (1u32 << i) as f64))
                .collect(),
        );
        for b in 1..=128u32 {
            assert!((b as f64 * steep.sps(b) - 100.0).abs() < 1e-9, "B = {b}");
        }
    }

    #[test]
    fn compact_round_trips_and_fits() {
        let pts: Vec<(u32, f64)> = (0..64)
            .map(|i| (i + 1, 1000.0 / (i as f64 + 1.0)))
            .collect();
        let t = table(pts);
        let c = t.to_compact().unwrap();
        assert!(c.len() <= MAX_COMPACT_BYTES);
        let back = CostTable::from_json(&c).unwrap();
        assert_eq!(back.points.len(), 64);
        assert!((back.sps(3) - t.sps(3)).abs() / t.sps(3) < 1e-3);
    }

    proptest! {
        #[test]
        fn sps_is_non_increasing(raw in proptest::collection::vec(1.0f64..1000.0, 1..11), b in 1u32..200) {
            let mut sps = raw.clone();
            sps.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let t = table(sps.into_iter().enumerate().map(|(i, s)| (1u32 << i, s)).collect());
            t.validate().unwrap();
            prop_assert!(t.sps(b) >= t.sps(b + 1) - 1e-9);
            // Between two points the token throughput lies between theirs.
            let pts = &t.points;
            if let Some(i) = pts.iter().position(|&(pb, _)| pb > b).filter(|&i| i > 0) {
                let (lo, hi) = (pts[i - 1], pts[i]);
                let (ta, tb) = (lo.0 as f64 * lo.1, hi.0 as f64 * hi.1);
                let tok = b as f64 * t.sps(b);
                prop_assert!(tok <= ta.max(tb) * (1.0 + 1e-9) && tok >= ta.min(tb) * (1.0 - 1e-9));
            }
        }
    }
}
