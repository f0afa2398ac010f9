//! Sampling: parameters, the llama.cpp sampler chain, grammars.

pub(crate) mod chain;
pub(crate) mod device;
pub(crate) mod grammar;
pub(crate) mod guidance;
pub(crate) mod json_schema;
pub(crate) mod lazy;
pub(crate) mod llama_sampler;
pub mod params;
pub(crate) mod stochastic;

pub use grammar::GrammarSpec;
pub use params::SamplingParams;
