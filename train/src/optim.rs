//! Optimiser: AdamW (decoupled weight decay, bias-corrected moments: the update rule of
//! `candle_nn::AdamW`, restated here because candle keeps its moments private and a resumed
//! run must continue with them), a linear warm-up + cosine learning-rate schedule and global
//! gradient-norm clipping.

use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    pub lr: f64,
    /// Fraction of the steps spent warming up linearly from 0.
    pub warmup: f64,
    /// Cosine decays to `min_lr_ratio * lr` at the last step.
    pub min_lr_ratio: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global L2 norm the gradients are clipped to (`<= 0`: no clipping).
    pub clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 6e-4,
            warmup: 0.04,
            min_lr_ratio: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            clip: 1.0,
        }
    }
}

impl OptimConfig {
    /// Learning rate at 0-based `step` of `total`.
    pub fn lr_at(&self, step: usize, total: usize) -> f64 {
        let warm = ((self.warmup * total as f64).round() as usize).max(1);
        if step < warm {
            return self.lr * (step + 1) as f64 / warm as f64;
        }
        let span = total.saturating_sub(warm).max(1) as f64;
        let t = ((step - warm) as f64 / span).min(1.0);
        let min = self.lr * self.min_lr_ratio;
        min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// AdamW over named variables.
pub struct AdamW {
    pub cfg: OptimConfig,
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub step_t: usize,
}

/// Scales every gradient so that their global L2 norm is at most `max_norm`; returns the
/// norm before clipping.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[(String, Var)], max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for (_, v) in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    let norm = sq.sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let s = max_norm / (norm + 1e-6);
        for (_, v) in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * s)?);
            }
        }
    }
    Ok(norm)
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, cfg: OptimConfig) -> Result<Self> {
        let m = vars
            .iter()
            .map(|(_, v)| v.as_tensor().zeros_like())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let v = m.clone();
        Ok(Self {
            cfg,
            vars,
            m,
            v,
            step_t: 0,
        })
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// One update at learning rate `lr`.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step_t += 1;
        let c = self.cfg;
        let scale_m = 1.0 / (1.0 - c.beta1.powi(self.step_t as i32));
        let scale_v = 1.0 / (1.0 - c.beta2.powi(self.step_t as i32));
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let m = ((&self.m[i] * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            let v = ((&self.v[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let upd = ((&m * scale_m)? / ((&v * scale_v)?.sqrt()? + c.eps)?)?;
            let theta = ((var.as_tensor() * (1.0 - lr * c.weight_decay))? - (upd * lr)?)?;
            var.set(&theta)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// Writes the moments (`m.NAME`, `v.NAME`) to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("m.{name}"), self.m[i].clone());
            out.insert(format!("v.{name}"), self.v[i].clone());
        }
        candle_core::safetensors::save(&out, path)
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Restores the moments written by [`AdamW::save`] after `step_t` steps.
    pub fn load(&mut self, path: &Path, step_t: usize) -> Result<()> {
        let dev = self.m.first().map(|t| t.device().clone());
        let Some(dev) = dev else { return Ok(()) };
        let mut t = candle_core::safetensors::load(path, &dev)
            .with_context(|| format!("cannot read optimiser state {}", path.display()))?;
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (key, slot) in [("m", &mut self.m[i]), ("v", &mut self.v[i])] {
                let x = t
                    .remove(&format!("{key}.{name}"))
                    .with_context(|| format!("{}: no state for '{name}'", path.display()))?;
                anyhow::ensure!(
                    x.dims() == var.dims(),
                    "{}: state of '{name}' has shape {:?}, the variable {:?}",
                    path.display(),
                    x.dims(),
                    var.dims()
                );
                *slot = x;
            }
        }
        self.step_t = step_t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let c = OptimConfig {
            lr: 1.0,
            warmup: 0.1,
            min_lr_ratio: 0.0,
            ..Default::default()
        };
        assert!((c.lr_at(0, 100) - 0.1).abs() < 1e-9);
        assert!((c.lr_at(9, 100) - 1.0).abs() < 1e-9);
        assert!((c.lr_at(10, 100) - 1.0).abs() < 1e-9);
        assert!((c.lr_at(55, 100) - 0.5).abs() < 1e-9);
        assert!(c.lr_at(99, 100) < 0.01);
    }
}
