//! Rough per-call timings of the per-token metrics on a 262,144-entry row (Gemma 3's
//! vocabulary): `cargo bench -p kvfork-core --bench metrics`. A benchmark, not a test: it
//! prints and asserts nothing.
#![allow(clippy::print_stdout, reason = "the timings are its output")]

use std::hint::black_box;
use std::time::Instant;

use kvfork_core::metrics;

fn row(n: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 30.0 - 15.0
        })
        .collect()
}

fn time(name: &str, mut f: impl FnMut()) {
    let reps = 200;
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
    println!("{name:>14}: {us:8.1} us");
}

fn main() {
    let xs = row(262_144);
    let mut out = Vec::with_capacity(40);
    time("max", || {
        black_box(metrics::max(black_box(&xs)));
    });
    time("argmax", || {
        black_box(metrics::argmax(black_box(&xs)));
    });
    time("log_sum_exp", || {
        black_box(metrics::log_sum_exp(black_box(&xs)));
    });
    time("entropy", || {
        black_box(metrics::entropy(black_box(&xs)));
    });
    let mut dst = vec![0.0f32; xs.len()];
    time("copy", || {
        dst.copy_from_slice(black_box(&xs));
        black_box(&dst);
    });
    time("copy+summary", || {
        black_box(metrics::copy_and_summarize(black_box(&xs), &mut dst));
    });
    time("summary", || {
        black_box(metrics::summarize(black_box(&xs), 0, &mut out));
    });
    time("summary+top40", || {
        black_box(metrics::summarize(black_box(&xs), 40, &mut out));
    });
    // What the threads of a small step share between them: every part on its own, one thread.
    for k in [0, 40] {
        time(&format!("parts+merge{k}"), || {
            let parts: Vec<_> = (0..metrics::segments(xs.len()))
                .map(|s| metrics::summarize_part(black_box(&xs), s, k))
                .collect();
            black_box(metrics::merge_parts(&xs, &parts, k, &mut out));
        });
    }
    time("top_k(40)", || {
        metrics::top_k_indices(black_box(&xs), 40, &mut out);
        black_box(&out);
    });
}
