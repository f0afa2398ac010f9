//! The stages of the chain that draw random numbers or adapt between draws: XTC, temperature
//! and the terminal (`dist`, Mirostat 1 and 2). They live in Rust, not in llama.cpp, because
//! their whole state — one RNG and Mirostat's `mu` — must be plain data: it carries on
//! through a chain rebuild (`set_sampler_params`) and is written by `Branch.save`.
//! The algorithms follow llama.cpp's samplers of the same names.

use llama_cpp_sys_2::llama_token_data as Candidate;

/// xoshiro256**: small, fast, and its state is four words that can be saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Seeded through SplitMix64, which spreads a 32-bit seed over the 256-bit state.
    pub fn from_seed(seed: u32) -> Self {
        let mut x = u64::from(seed);
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn from_state(s: [u64; 4]) -> Option<Self> {
        // The all-zero state is the one xoshiro cannot leave.
        (s != [0; 4]).then_some(Rng { s })
    }

    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The candidates the stages work on: `data[start..end]` of the chain's buffer (XTC and
/// Mirostat cut the front or the back).
pub(crate) type Window<'a> = &'a mut [Candidate];

fn max_logit(c: &[Candidate]) -> f32 {
    c.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max)
}

/// Unnormalised softmax weights into `p` (-inf logits get 0); returns their sum. Where some
/// logits are `+inf` (penalties or a bias pushed them past `f32::MAX`) they share the mass
/// (the limit), every other gets 0.
fn weigh(c: &mut [Candidate]) -> f64 {
    let max = max_logit(c);
    c.iter_mut()
        .map(|x| {
            x.p = match max {
                f32::INFINITY => f32::from(x.logit == f32::INFINITY),
                _ => (x.logit - max).exp(),
            };
            f64::from(x.p)
        })
        .sum()
}

/// Sort best first and put the softmax into `p`.
fn sorted_softmax(c: &mut [Candidate]) {
    c.sort_by(|a, b| b.logit.total_cmp(&a.logit));
    let sum = weigh(c) as f32;
    c.iter_mut().for_each(|x| x.p /= sum);
}

/// Index of the largest logit (ties: the first).
pub(crate) fn argmax(c: &[Candidate]) -> usize {
    (0..c.len()).fold(0, |b, i| if c[i].logit > c[b].logit { i } else { b })
}

/// Index drawn in proportion to the weights `p`, which sum to `total` (one uniform draw,
/// also when there is one candidate).
fn draw(c: &[Candidate], total: f64, rng: &mut Rng) -> usize {
    let r = rng.uniform();
    if c.len() == 1 {
        return 0;
    }
    let target = total * r;
    let mut run = 0.0;
    for (i, x) in c.iter().enumerate() {
        run += f64::from(x.p);
        if run >= target && x.p > 0.0 {
            return i;
        }
    }
    // Rounding left the target above the running sum: the last token with mass.
    c.iter().rposition(|x| x.p > 0.0).unwrap_or(0)
}

/// Keep the first `keep` of the sorted candidates, draw among them, then move Mirostat's
/// `mu` towards the target surprise `tau` by `eta` times the observed error (in bits).
fn draw_and_adapt(
    c: &mut [Candidate],
    keep: usize,
    tau: f32,
    eta: f32,
    mu: &mut f32,
    rng: &mut Rng,
) -> usize {
    let kept = &mut c[..keep];
    let total = weigh(kept);
    let i = draw(kept, total, rng);
    kept.iter_mut()
        .for_each(|x| x.p = (f64::from(x.p) / total) as f32);
    *mu -= eta * (-kept[i].p.log2() - tau);
    i
}

/// XTC ("exclude top choices"): with `probability`, drop every candidate at or above
/// `threshold` except the least likely of them. Returns how many were dropped from the front
/// (the window is sorted best first when that happens).
pub(crate) fn xtc(
    c: Window<'_>,
    probability: f32,
    threshold: f32,
    roll: impl FnOnce() -> f64,
) -> usize {
    if probability <= 0.0 || threshold > 0.5 || c.len() < 2 {
        return 0;
    }
    if roll() as f32 > probability {
        return 0;
    }
    sorted_softmax(c);
    let last_above = c.iter().take_while(|x| x.p >= threshold).count();
    // Keep the last candidate above the threshold; at least one candidate stays.
    last_above.saturating_sub(1).min(c.len() - 1)
}

/// Divide the logits by `t`; `t <= 0` keeps only the best candidate (ties: the first), as
/// llama.cpp does (reachable with Mirostat, which is never plain greedy). Where the best
/// logit over a tiny `t` would overflow, all are first taken relative to it (the softmax is
/// the same): no `inf - inf` in the draw's softmax.
pub(crate) fn temperature(c: Window<'_>, t: f32) {
    if t > 0.0 {
        // Only a `t` below 1 makes a finite logit infinite: no extra pass otherwise.
        let max = if t < 1.0 { max_logit(c) } else { 0.0 };
        let shift = if max.is_finite() && !(max / t).is_finite() {
            max
        } else {
            0.0
        };
        c.iter_mut().for_each(|x| x.logit = (x.logit - shift) / t);
        return;
    }
    let best = argmax(c);
    for (i, x) in c.iter_mut().enumerate() {
        if i != best {
            x.logit = f32::NEG_INFINITY;
        }
    }
}

/// Draw from the softmax of the window.
pub(crate) fn dist(c: Window<'_>, rng: &mut Rng) -> usize {
    let total = weigh(c);
    draw(c, total, rng)
}

/// Mirostat 2.0: keep the candidates whose surprise (bits) is at most `mu`, draw, then move
/// `mu` towards the target surprise `tau` by `eta` times the error. Returns the index drawn
/// in the window, which is sorted best first.
pub(crate) fn mirostat_v2(c: Window<'_>, tau: f32, eta: f32, mu: &mut f32, rng: &mut Rng) -> usize {
    let n = finite_prefix(c);
    let c = &mut c[..n];
    sorted_softmax(c);
    let keep = c.iter().take_while(|x| -x.p.log2() <= *mu).count().max(1);
    draw_and_adapt(c, keep, tau, eta, mu, rng)
}

/// Mirostat 1: estimate the Zipf exponent from the `m` most likely candidates, keep the top
/// k that gives surprise `mu`, draw, then update `mu` as in Mirostat 2.0.
pub(crate) fn mirostat_v1(
    c: Window<'_>,
    n_vocab: usize,
    tau: f32,
    eta: f32,
    mu: &mut f32,
    rng: &mut Rng,
) -> usize {
    const M: usize = 100;
    let n = finite_prefix(c);
    let c = &mut c[..n];
    sorted_softmax(c);
    let (mut sum_tb, mut sum_tt) = (0.0f32, 0.0f32);
    for i in 0..(M - 1).min(c.len() - 1) {
        let t = ((i + 2) as f32 / (i + 1) as f32).ln();
        let b = (c[i].p / c[i + 1].p).ln();
        sum_tb += t * b;
        sum_tt += t * t;
    }
    let s_hat = sum_tb / sum_tt;
    let eps = s_hat - 1.0;
    let k = ((eps * 2f32.powf(*mu)) / (1.0 - (n_vocab as f32).powf(-eps))).powf(1.0 / s_hat);
    // NaN (a single or a flat candidate list) keeps everything; `as` saturates.
    let k = if k.is_nan() {
        c.len()
    } else {
        (k as usize).clamp(1, c.len())
    };
    draw_and_adapt(c, k, tau, eta, mu, rng)
}

/// Move the finite candidates to the front (order kept); how many there are (at least 1:
/// callers guarantee one finite candidate).
fn finite_prefix(c: &mut [Candidate]) -> usize {
    let mut n = 0;
    for i in 0..c.len() {
        if c[i].logit.is_finite() {
            c.swap(n, i);
            n += 1;
        }
    }
    n.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(logits: &[f32]) -> Vec<Candidate> {
        logits
            .iter()
            .enumerate()
            .map(|(i, &logit)| Candidate {
                id: i as i32,
                logit,
                p: 0.0,
            })
            .collect()
    }

    #[test]
    fn rng_is_reproducible_and_resumable() {
        let mut a = Rng::from_seed(7);
        let first: Vec<f64> = (0..5).map(|_| a.uniform()).collect();
        let mut b = Rng::from_seed(7);
        assert_eq!(first, (0..5).map(|_| b.uniform()).collect::<Vec<_>>());
        let mut resumed = Rng::from_state(a.state()).unwrap();
        assert_eq!(a.uniform(), resumed.uniform());
        assert_ne!(Rng::from_seed(8).uniform(), Rng::from_seed(7).uniform());
        assert!(Rng::from_state([0; 4]).is_none());
        assert!((0..10_000)
            .map(|_| b.uniform())
            .all(|u| (0.0..1.0).contains(&u)));
    }

    #[test]
    fn dist_follows_the_softmax() {
        let mut rng = Rng::from_seed(1);
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            let mut c = cands(&logits);
            let i = dist(&mut c, &mut rng);
            counts[c[i].id as usize] += 1;
        }
        let share = counts[1] as f64 / 40_000.0;
        assert!((share - 0.75).abs() < 0.01, "{counts:?}");
        assert_eq!(counts[2], 0);
    }

    #[test]
    fn xtc_drops_all_but_the_least_likely_top_choice() {
        let mut rng = Rng::from_seed(3);
        let mut c = cands(&[3.0, 2.9, 2.8, -5.0]);
        let cut = xtc(&mut c, 1.0, 0.1, || rng.uniform());
        assert_eq!(cut, 2);
        assert_eq!(c[cut].id, 2);
        // Never when the threshold cannot be met by two candidates, nor with one candidate.
        assert_eq!(xtc(&mut cands(&[1.0, 0.0]), 1.0, 0.6, || rng.uniform()), 0);
        assert_eq!(xtc(&mut cands(&[1.0]), 1.0, 0.1, || rng.uniform()), 0);
    }

    #[test]
    fn mirostat_adapts_mu_towards_tau() {
        let logits: Vec<f32> = (0..500).map(|i| -(i as f32).sqrt()).collect();
        for v2 in [false, true] {
            let (tau, eta) = (3.0, 0.1);
            let mut mu = 2.0 * tau;
            let mut rng = Rng::from_seed(5);
            let mut surprise = 0.0;
            let n = 2000;
            for _ in 0..n {
                let mut c = cands(&logits);
                let i = if v2 {
                    mirostat_v2(&mut c, tau, eta, &mut mu, &mut rng)
                } else {
                    mirostat_v1(&mut c, 500, tau, eta, &mut mu, &mut rng)
                };
                assert!(mu.is_finite());
                surprise += -c[i].p.log2();
            }
            let mean = surprise / n as f32;
            assert!((mean - tau).abs() < 0.5, "v2={v2} mean surprise {mean}");
        }
    }

    #[test]
    fn a_tiny_temperature_or_an_infinite_logit_draws_the_best_not_nan() {
        for t in [1e-38, 1e-45, 1e-30] {
            let mut c = cands(&[-16.0, 30.0, 29.9, -3e38]);
            temperature(&mut c, t);
            assert!(c.iter().all(|x| !x.logit.is_nan()), "t={t}");
            for seed in 0..20 {
                let i = dist(&mut c, &mut Rng::from_seed(seed));
                assert_eq!(c[i].id, 1, "t={t}");
            }
        }
        let mut c = cands(&[f32::INFINITY, 5.0, f32::INFINITY]);
        temperature(&mut c, 0.7);
        let drawn: Vec<i32> = (0..200)
            .map(|seed| {
                let i = dist(&mut c, &mut Rng::from_seed(seed));
                c[i].id
            })
            .collect();
        assert!(drawn.iter().all(|&id| id != 1) && drawn.contains(&0) && drawn.contains(&2));
    }

    #[test]
    fn zero_temperature_keeps_the_best_candidate_only() {
        let mut c = cands(&[1.0, 3.0, 2.0]);
        temperature(&mut c, 0.0);
        assert_eq!(c.iter().filter(|x| x.logit.is_finite()).count(), 1);
        assert_eq!(c[1].logit, 3.0);
        let mut rng = Rng::from_seed(1);
        let mut mu = 10.0;
        let i = mirostat_v2(&mut c, 5.0, 0.1, &mut mu, &mut rng);
        assert_eq!(c[i].id, 1);
    }

    #[test]
    fn mirostat_tolerates_masked_and_single_candidates() {
        let mut rng = Rng::from_seed(9);
        let mut mu = 10.0;
        let mut c = cands(&[f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY]);
        let i = mirostat_v1(&mut c, 3, 5.0, 0.1, &mut mu, &mut rng);
        assert_eq!(c[i].id, 1);
        let mut c = cands(&[f32::NEG_INFINITY, 1.0, 0.5]);
        let i = mirostat_v2(&mut c, 5.0, 0.1, &mut mu, &mut rng);
        assert!(c[i].logit.is_finite());
    }
}
