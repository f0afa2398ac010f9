//! Bookkeeping and pure math for kvfork: forkable decode branches that share
//! one KV cache. Nothing here touches llama.cpp, so it is tested in isolation.
// One audited exception: the runtime-dispatched AVX-512 kernel in `metrics`.
#![deny(unsafe_code)]

pub mod arena;
pub mod bias;
pub mod checkpoints;
pub mod error;
pub mod gather;
pub mod gbnf;
pub mod handle;
pub mod json;
pub mod lease;
pub mod metrics;
pub mod output_tile;
pub mod packer;
pub mod park;
pub mod prefix_trie;
pub mod speculation;
pub mod state_file;
pub mod steps_apart;
pub mod text;
pub mod threads;
pub mod tree;

pub use arena::Arena;
pub use bias::Biases;
pub use checkpoints::{Budget, Checkpoint, Checkpoints};
pub use error::TenancyError;
pub use handle::Handle;
pub use lease::LeaseAllocator;
pub use metrics::{LogBase, Perplexity};
pub use packer::{logits_index, plan_chunk, plan_prefill, Chunk, ChunkRoom, Progress, Span};
pub use park::{ParkLedger, Parked, Place, Segment};
pub use prefix_trie::PrefixTrie;
pub use speculation::GuessPolicy;
pub use steps_apart::StepsApart;
pub use text::Utf8Carry;
pub use tree::{Node, Pruned, Registry};
