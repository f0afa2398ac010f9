//! Sampling parameters: every field is honoured by the branch's sampler chain.

use crate::error::{Error, Result};

/// Parameters of a branch's sampler chain. `temperature <= 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before the draw; `<= 0` keeps only the most likely token (greedy;
    /// with Mirostat on, after the filters).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: i32,
    /// Keep the most likely tokens until their probabilities sum to `top_p`; 1.0 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// Locally typical sampling up to this total probability; 1.0 disables.
    pub typical_p: f32,
    /// Keep tokens within `top_n_sigma` standard deviations of the best logit; `<= 0`
    /// disables.
    pub top_n_sigma: f32,
    /// Seed of the branch's RNG (XTC, the draw, Mirostat). `None`: a fresh random seed.
    pub seed: Option<u32>,
    /// Divides positive logits (multiplies negative ones) of tokens in the penalty window;
    /// 1.0 disables.
    pub repeat_penalty: f32,
    /// Subtracted once per occurrence in the penalty window; 0 disables.
    pub frequency_penalty: f32,
    /// Subtracted from every token present in the penalty window; 0 disables.
    pub presence_penalty: f32,
    /// Recent tokens the three penalties look at; -1 the whole context, 0 disables them
    /// (at most the model's training context: see `chain::resolve_window`).
    pub penalty_last_n: i32,
    /// 0 off, 1 Mirostat, 2 Mirostat 2.0 (replaces the truncation filters and XTC).
    pub mirostat: i32,
    /// Mirostat's target surprise in bits (`mu` starts at 2 * tau).
    pub mirostat_tau: f32,
    /// Mirostat's learning rate.
    pub mirostat_eta: f32,
    /// Strength of the DRY penalty on tokens that extend a repeat; 0 disables.
    pub dry_multiplier: f32,
    /// DRY's penalty grows as `dry_base` to the power of the repeat's excess length (>= 1).
    pub dry_base: f32,
    /// Repeats up to this many tokens go unpenalised by DRY.
    pub dry_allowed_length: i32,
    /// Recent tokens DRY scans for repeats; -1 the whole context, 0 disables DRY (at most
    /// the model's training context).
    pub dry_penalty_last_n: i32,
    /// XTC: the chance per draw that it removes the top choices; 0 disables.
    pub xtc_probability: f32,
    /// XTC removes every token at least this likely but the least likely of them; above 0.5
    /// it never fires.
    pub xtc_threshold: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            seed: None,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
        }
    }
}

fn check(ok: bool, name: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            name,
            message: message(),
        })
    }
}

impl SamplingParams {
    /// Greedy decoding (argmax).
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Whether the chain takes the argmax (temperature `<= 0`, Mirostat off).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.mirostat == 0
    }

    /// True when the penalty samplers change nothing.
    pub fn penalties_neutral(&self) -> bool {
        (self.repeat_penalty == 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0)
            || self.penalty_last_n == 0
    }

    /// Whether the DRY penalty is on.
    pub fn dry_enabled(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_penalty_last_n != 0
    }

    /// Reject values llama.cpp would misbehave on; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let finite = |v: f32| v.is_finite();
        check(finite(self.temperature), "temperature", || {
            "must be finite".into()
        })?;
        check(self.top_k >= 0, "top_k", || {
            format!("{} must be >= 0 (0 disables)", self.top_k)
        })?;
        check((0.0..=1.0).contains(&self.top_p), "top_p", || {
            format!("{} is not in [0, 1]", self.top_p)
        })?;
        check((0.0..=1.0).contains(&self.min_p), "min_p", || {
            format!("{} is not in [0, 1]", self.min_p)
        })?;
        check((0.0..=1.0).contains(&self.typical_p), "typical_p", || {
            format!("{} is not in [0, 1]", self.typical_p)
        })?;
        check(finite(self.top_n_sigma), "top_n_sigma", || {
            "must be finite (<= 0 disables)".into()
        })?;
        check(
            finite(self.repeat_penalty) && self.repeat_penalty > 0.0,
            "repeat_penalty",
            || format!("{} must be > 0 (1 disables)", self.repeat_penalty),
        )?;
        check(finite(self.frequency_penalty), "frequency_penalty", || {
            "must be finite".into()
        })?;
        check(finite(self.presence_penalty), "presence_penalty", || {
            "must be finite".into()
        })?;
        check(self.penalty_last_n >= -1, "penalty_last_n", || {
            format!("{} must be >= -1", self.penalty_last_n)
        })?;
        check((0..=2).contains(&self.mirostat), "mirostat", || {
            format!("{} is not 0, 1 or 2", self.mirostat)
        })?;
        check(
            finite(self.mirostat_tau) && self.mirostat_tau >= 0.0,
            "mirostat_tau",
            || "must be >= 0".into(),
        )?;
        check(
            finite(self.mirostat_eta) && self.mirostat_eta >= 0.0,
            "mirostat_eta",
            || "must be >= 0".into(),
        )?;
        check(
            finite(self.dry_multiplier) && self.dry_multiplier >= 0.0,
            "dry_multiplier",
            || "must be >= 0".into(),
        )?;
        check(
            finite(self.dry_base) && self.dry_base >= 1.0,
            "dry_base",
            || format!("{} must be >= 1", self.dry_base),
        )?;
        check(self.dry_allowed_length >= 0, "dry_allowed_length", || {
            "must be >= 0".into()
        })?;
        check(self.dry_penalty_last_n >= -1, "dry_penalty_last_n", || {
            "must be >= -1".into()
        })?;
        check(
            (0.0..=1.0).contains(&self.xtc_probability),
            "xtc_probability",
            || format!("{} is not in [0, 1]", self.xtc_probability),
        )?;
        check(
            (0.0..=1.0).contains(&self.xtc_threshold),
            "xtc_threshold",
            || format!("{} is not in [0, 1]", self.xtc_threshold),
        )?;
        Ok(())
    }
}
