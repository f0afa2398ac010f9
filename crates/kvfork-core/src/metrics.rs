//! Per-token statistics over a logits row. Rows can hold 262,144 entries and
//! these run for every generated token, so the loops are written as fixed
//! lanes of straight-line arithmetic that LLVM turns into SIMD; masked tokens
//! (`-inf`) are handled with selects, not branches.
//!
//! Inputs must not contain NaN or `+inf`; `-inf` marks a masked token.

const LANES: usize = 16;
/// Exp sums run in `f32` lanes for at most this many elements, then fold into
/// `f64`, so rounding error stays tiny even for huge vocabularies.
const BLOCK: usize = 256;
/// Granularity of the top-k threshold test.
const SCAN: usize = 128;

const EXP_LO: f32 = -87.0;
/// Just past ln(f32::MAX), so larger inputs overflow to `+inf`.
const EXP_HI: f32 = 89.0;
/// ln 2 split as HI + LO, HI having 9 significant bits so `n * HI` is exact.
const LN2_HI: f32 = 355.0 / 512.0;
const LN2_LO: f32 = (std::f64::consts::LN_2 - 355.0 / 512.0) as f32;
/// Adding then subtracting 1.5 * 2^23 rounds an `f32` to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Splits `x` (already clamped to a safe range) as `x = n ln 2 + r`,
/// |r| <= ln(2)/2, returning `(e^r, n)`.
/// `FMA` fuses the multiply-adds (only where the CPU has FMA, else `mul_add` is a libm call).
#[inline(always)]
fn exp_reduce<const FMA: bool>(x: f32) -> (f32, i32) {
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    let t = madd(x, std::f32::consts::LOG2_E, ROUND_MAGIC);
    let n = t.to_bits() as i32 - ROUND_MAGIC.to_bits() as i32;
    let nf = t - ROUND_MAGIC;
    let r = madd(-nf, LN2_LO, madd(-nf, LN2_HI, x));
    // Degree-6 Taylor series (Horner): truncation error r^7/7! < 1.2e-7 here.
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 1.0 / 2.0, 1.0, 1.0] {
        p = madd(p, r, c);
    }
    (p, n)
}

/// Whether the baseline build may use `mul_add` freely.
const BASE_FMA: bool = cfg!(target_feature = "fma");

/// `2^e` for `e` in -126..=127, built directly from the exponent bits.
#[inline(always)]
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `e^x` for `f32`, branch-free so it vectorizes. Relative error below 2e-6
/// on [-87, 88]; returns 0 for `x < -87` (including `-inf`), `+inf` past ~88.7.
#[inline]
pub fn fast_exp(x: f32) -> f32 {
    let xc = if x < EXP_LO { EXP_LO } else { x };
    let xc = if xc > EXP_HI { EXP_HI } else { xc };
    let (p, n) = exp_reduce::<BASE_FMA>(xc);
    // n reaches 128 and 2^128 has no f32 encoding, so scale in two halves.
    let half = n >> 1;
    let y = p * pow2i(half) * pow2i(n - half);
    if x < EXP_LO {
        0.0
    } else {
        y
    }
}

/// Cheaper `e^d` for the softmax sums, where `d = x - max <= 0`: one scale
/// step suffices. `d < -87` is clamped (about 1.6e-38); callers mask it.
#[inline(always)]
fn exp_nonpos<const FMA: bool>(d: f32) -> f32 {
    let (p, n) = exp_reduce::<FMA>(if d < EXP_LO { EXP_LO } else { d });
    p * pow2i(n)
}

#[inline]
fn max_f32(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// Largest logit; `-inf` for an empty row.
#[allow(unsafe_code)]
pub fn max(logits: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match simd() {
        // SAFETY: `simd` confirmed at run time that this CPU has avx512f (and fma).
        Simd::Avx512 => return unsafe { max_avx512(logits) },
        // SAFETY: `simd` confirmed at run time that this CPU has avx2 (and fma).
        Simd::Avx2 => return unsafe { max_avx2(logits) },
        Simd::Base => {}
    }
    max_lanes(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn max_avx512(logits: &[f32]) -> f32 {
    max_lanes(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn max_avx2(logits: &[f32]) -> f32 {
    max_lanes(logits)
}

#[inline(always)]
fn max_lanes(logits: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] = max_f32(acc[j], c[j]);
        }
    }
    let tail = chunks.remainder().iter().copied();
    acc.into_iter().chain(tail).fold(f32::NEG_INFINITY, max_f32)
}

/// The widest kernels this CPU runs. The release wheel's baseline is x86-64 (SSE2), so the
/// AVX2 tier is chosen at run time too; a build with `+avx2,+fma` (`.cargo/config.toml`) gets
/// the same code from its baseline.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Simd {
    /// AVX-512 F with FMA: the intrinsics of `avx512` and 16-lane loops.
    Avx512,
    /// AVX2 with FMA: the portable loops compiled for 8 lanes and fused multiply-adds.
    Avx2,
    /// What the build's own target features give.
    Base,
}

/// Probed on every call: std caches the CPUID result, so this is two loads and a branch.
#[cfg(target_arch = "x86_64")]
fn simd() -> Simd {
    use std::arch::is_x86_feature_detected as has;
    if has!("avx512f") && has!("fma") {
        Simd::Avx512
    } else if has!("avx2") && has!("fma") {
        Simd::Avx2
    } else {
        Simd::Base
    }
}

/// `(e^d, d)` with `d` clamped to the cutoff: exactly 0 below it, so a lone finite logit has
/// entropy 0; callers weight with the clamped `d` because `0 * -inf` is NaN.
#[inline(always)]
fn masked_exp<const FMA: bool>(d: f32) -> (f32, f32) {
    let masked = d < EXP_LO;
    let dc = if masked { EXP_LO } else { d };
    let e = exp_nonpos::<FMA>(dc);
    (if masked { 0.0 } else { e }, dc)
}

/// `(Σ e^d, Σ e^d·d)` with `d = x - shift <= 0`; the second sum only if
/// `WEIGHTED`. Entries with `d < -87` (masked ones included) add exactly 0.
/// Uses AVX-512 or AVX2 when the CPU has it (chosen at run time).
#[allow(unsafe_code)]
fn exp_sums<const WEIGHTED: bool>(logits: &[f32], shift: f32) -> (f64, f64) {
    #[cfg(target_arch = "x86_64")]
    match simd() {
        // SAFETY: `simd` just confirmed at run time that this CPU has avx512f and fma, the
        // only features `exp_sums_avx512` is compiled with.
        Simd::Avx512 => return unsafe { exp_sums_avx512::<WEIGHTED>(logits, shift) },
        // SAFETY: as above, for avx2 and fma.
        Simd::Avx2 => return unsafe { exp_sums_avx2::<WEIGHTED>(logits, shift) },
        Simd::Base => {}
    }
    exp_sums_lanes::<WEIGHTED, BASE_FMA>(logits, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_sums_avx2<const WEIGHTED: bool>(logits: &[f32], shift: f32) -> (f64, f64) {
    exp_sums_lanes::<WEIGHTED, true>(logits, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn exp_sums_avx512<const WEIGHTED: bool>(logits: &[f32], shift: f32) -> (f64, f64) {
    exp_sums_lanes::<WEIGHTED, true>(logits, shift)
}

#[inline(always)]
fn exp_sums_lanes<const WEIGHTED: bool, const FMA: bool>(logits: &[f32], shift: f32) -> (f64, f64) {
    let mut total = 0.0f64;
    let mut weighted = 0.0f64;
    for block in logits.chunks(BLOCK) {
        let mut s = [0.0f32; LANES];
        let mut w = [0.0f32; LANES];
        let mut chunks = block.chunks_exact(LANES);
        for c in &mut chunks {
            // Fixed-size lanes and selects (no calls under a branch) so this vectorizes.
            for j in 0..LANES {
                let (e, d) = masked_exp::<FMA>(c[j] - shift);
                s[j] += e;
                if WEIGHTED {
                    w[j] += e * d;
                }
            }
        }
        for &x in chunks.remainder() {
            let (e, d) = masked_exp::<FMA>(x - shift);
            s[0] += e;
            if WEIGHTED {
                w[0] += e * d;
            }
        }
        total += s.iter().map(|&v| f64::from(v)).sum::<f64>();
        if WEIGHTED {
            weighted += w.iter().map(|&v| f64::from(v)).sum::<f64>();
        }
    }
    (total, weighted)
}

/// A block may be summed against a shift up to this much below its max (`e^64` and sums of
/// them stay far inside `f32`); beyond, it is summed again against its own max.
const STALE_SHIFT: f32 = 64.0;

/// `(Σ e^(x - shift), max x)` over a block, in one sweep. Entries with `x - shift < -87`
/// (masked ones included) add exactly 0; `x - shift` must stay below 88.
#[inline(always)]
fn exp_sum_and_max<const FMA: bool>(block: &[f32], shift: f32) -> (f64, f32) {
    let mut s = [0.0f32; LANES];
    let mut hi = [f32::NEG_INFINITY; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for c in &mut chunks {
        // Two loops, not one: fused, LLVM vectorizes this far worse (measured 1.7x slower).
        for j in 0..LANES {
            hi[j] = max_f32(hi[j], c[j]);
        }
        for j in 0..LANES {
            s[j] += masked_exp::<FMA>(c[j] - shift).0;
        }
    }
    for &x in chunks.remainder() {
        hi[0] = max_f32(hi[0], x);
        s[0] += masked_exp::<FMA>(x - shift).0;
    }
    let sum = s.iter().map(|&v| f64::from(v)).sum::<f64>();
    (sum, hi.into_iter().fold(f32::NEG_INFINITY, max_f32))
}

/// What sampling and perplexity need first from a fresh logits row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSummary {
    /// `ln Σ e^x` over the finite logits; `-inf` when there are none.
    pub log_sum_exp: f64,
    /// Index of the first largest logit (0 for an empty or fully masked row).
    pub argmax: usize,
}

/// Rows are summarized in segments of this many logits, each on its own ([`summarize_part`]),
/// and the parts merged ([`merge_parts`]): the one or two rows of a small step can then spread
/// over the cores, and a row's summary is the same bits whichever threads took its parts.
/// A whole number of blocks.
pub const SEGMENT: usize = 64 * BLOCK;

/// How many segments a row of `len` logits has (at least one).
pub fn segments(len: usize) -> usize {
    len.div_ceil(SEGMENT).max(1)
}

fn segment_range(len: usize, segment: usize) -> std::ops::Range<usize> {
    let start = segment * SEGMENT;
    start..(start + SEGMENT).min(len)
}

/// One segment's share of a row's summary ([`summarize_part`], [`merge_parts`]).
#[derive(Clone, Debug, Default)]
pub struct RowPart {
    /// The segment's largest logit (`-inf` when none is finite).
    max: f32,
    /// `Σ e^(x - max)` over the segment.
    sum: f64,
    /// Index in the row of the segment's first largest logit.
    argmax: usize,
    /// The segment's best `k` finite logits, best first.
    top: Vec<u32>,
}

#[cfg(test)]
impl RowPart {
    /// The summary of a row that is this one segment.
    fn alone(&self) -> RowSummary {
        merge_sums(std::slice::from_ref(self))
    }
}

/// Summarizes a fresh row in one pass over memory: its max, log-sum-exp and argmax, and the
/// indices of its `k` best finite logits in `top`, best first (as [`top_k_sorted`]).
/// Each block's max is taken while the block is in L1, the running exp-sum is rescaled
/// whenever a block raises the max, and a block whose max cannot enter the top `k` is not
/// looked at again: the top `k` costs next to nothing on top of the log-sum-exp.
/// Equal to the bit to [`merge_parts`] of every segment's [`summarize_part`].
pub fn summarize(row: &[f32], k: usize, top: &mut Vec<u32>) -> RowSummary {
    // One top-k over the whole row: its threshold, once high, skips the later segments'
    // blocks (a part of its own starts again from nothing). The best k are the same.
    let mut best = TopK::new(k, top);
    let parts: Vec<RowPart> = (0..segments(row.len()))
        .map(|s| summarize_dispatch(row, segment_range(row.len(), s), None, &mut best))
        .collect();
    best.into_sorted(row);
    merge_sums(&parts)
}

/// Segment `segment` of `row` summarized, its best `k` logits kept, for [`merge_parts`].
/// Segments are independent: any thread may take any of them.
///
/// # Panics
/// If the row has no such segment.
pub fn summarize_part(row: &[f32], segment: usize, k: usize) -> RowPart {
    assert!(
        segment < segments(row.len()),
        "summarize_part: no segment {segment}"
    );
    let mut top = Vec::new();
    let mut best = TopK::new(k, &mut top);
    let mut part = summarize_dispatch(row, segment_range(row.len(), segment), None, &mut best);
    best.into_sorted(row);
    part.top = top;
    part
}

/// The summary of `row` from the parts of its segments, in order, and its best `k` logits in
/// `top`, best first: equal to [`summarize`]'s.
///
/// # Panics
/// If `parts` is not one part per segment of `row`.
pub fn merge_parts(row: &[f32], parts: &[RowPart], k: usize, top: &mut Vec<u32>) -> RowSummary {
    assert_eq!(
        parts.len(),
        segments(row.len()),
        "merge_parts: one part per segment"
    );
    top.clear();
    for part in parts {
        top.extend_from_slice(&part.top);
    }
    // Each segment's best k hold the row's best k; ordered again, as one pass orders them.
    sort_best_first(row, top);
    top.truncate(k);
    merge_sums(parts)
}

/// Log-sum-exp and argmax of a row from its segments' maxima and sums, in order.
fn merge_sums(parts: &[RowPart]) -> RowSummary {
    let m = parts.iter().map(|p| p.max).fold(f32::NEG_INFINITY, max_f32);
    let Some(first) = parts.iter().find(|p| p.max == m && m > f32::NEG_INFINITY) else {
        return RowSummary {
            log_sum_exp: f64::NEG_INFINITY,
            argmax: 0,
        };
    };
    // Each sum rescaled to the row's max (`e^0` is exactly 1: a lone segment's sum is kept).
    let total: f64 = parts
        .iter()
        .filter(|p| p.max > f32::NEG_INFINITY)
        .map(|p| p.sum * (f64::from(p.max) - f64::from(m)).exp())
        .sum();
    RowSummary {
        log_sum_exp: f64::from(m) + total.ln(),
        argmax: first.argmax,
    }
}

/// [`summarize`] without the top `k`, also copying `src` into `dst` in the same pass: one
/// DRAM read instead of two.
///
/// # Panics
/// If the lengths differ.
pub fn copy_and_summarize(src: &[f32], dst: &mut [f32]) -> RowSummary {
    assert_eq!(src.len(), dst.len(), "copy_and_summarize: lengths differ");
    let parts: Vec<RowPart> = (0..segments(src.len()))
        .map(|s| {
            let range = segment_range(src.len(), s);
            summarize_dispatch(
                src,
                range,
                Some(&mut *dst),
                &mut TopK::new(0, &mut Vec::new()),
            )
        })
        .collect();
    merge_sums(&parts)
}

/// One segment, `range` of `src`, summarized on the widest kernels this CPU runs (copied into
/// the same range of `dst` when given), its blocks offered to `best`; the part's own `top`
/// is left empty.
#[allow(unsafe_code)]
fn summarize_dispatch(
    src: &[f32],
    range: std::ops::Range<usize>,
    dst: Option<&mut [f32]>,
    best: &mut TopK<'_>,
) -> RowPart {
    #[cfg(target_arch = "x86_64")]
    match simd() {
        // SAFETY: `simd` just confirmed at run time that this CPU has avx512f and fma, the
        // only features `summarize_avx512` is compiled with.
        Simd::Avx512 => return unsafe { summarize_avx512(src, range, dst, best) },
        // SAFETY: as above, for avx2 and fma.
        Simd::Avx2 => return unsafe { summarize_avx2(src, range, dst, best) },
        Simd::Base => {}
    }
    summarize_lanes::<BASE_FMA>(src, range, dst, best)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn summarize_avx2(
    src: &[f32],
    range: std::ops::Range<usize>,
    dst: Option<&mut [f32]>,
    best: &mut TopK<'_>,
) -> RowPart {
    summarize_lanes::<true>(src, range, dst, best)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn summarize_avx512(
    src: &[f32],
    range: std::ops::Range<usize>,
    dst: Option<&mut [f32]>,
    best: &mut TopK<'_>,
) -> RowPart {
    summarize_with(src, range, dst, best, |block, shift| {
        avx512::exp_sum_and_max(block, shift)
    })
}

/// The block kernel of [`summarize`] in AVX-512 intrinsics: 13 instructions per 16 logits
/// where the portable lanes take about 19 (`vscalefps` scales by `2^n` and `vrndscaleps`
/// rounds in one instruction each).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_fmadd_ps, _mm512_fmsub_ps, _mm512_loadu_ps,
        _mm512_mask_loadu_ps, _mm512_max_ps, _mm512_mul_ps, _mm512_reduce_add_ps,
        _mm512_reduce_max_ps, _mm512_roundscale_ps, _mm512_scalef_ps, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_sub_ps,
    };

    /// `2^f` for `f` in [-0.5, 0.5]: `ln2^k / k!` up to degree 6 (relative error < 1.2e-7).
    const EXP2: [f32; 7] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
    ];
    /// `x - shift` below `-125 ln 2` adds `2^-125` (under 3e-38, so nothing a sum ≥ 1 can
    /// show) instead of its true value: no denormals, and masked `-inf` entries stay finite.
    const FLOOR: f32 = -125.0;

    /// `e^(x - shift)` for 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    fn exp_lanes(x: __m512, shift: __m512) -> __m512 {
        let d = _mm512_sub_ps(x, shift);
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let t = _mm512_max_ps(_mm512_mul_ps(d, log2e), _mm512_set1_ps(FLOOR));
        // Round to nearest (0) without raising the inexact flag (8).
        let n = _mm512_roundscale_ps::<8>(t);
        // f = t - n with one rounding (t itself is only used for n).
        let f = _mm512_max_ps(_mm512_fmsub_ps(d, log2e, n), _mm512_set1_ps(-0.5));
        let mut p = _mm512_set1_ps(EXP2[6]);
        for c in EXP2[..6].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(*c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// `(Σ e^(x - shift), max x)` over a block; `x - shift` must stay below 88.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) fn exp_sum_and_max(block: &[f32], shift: f32) -> (f64, f32) {
        let shift = _mm512_set1_ps(shift);
        let mut sum = _mm512_setzero_ps();
        let mut hi = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut chunks = block.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: `c` holds 16 floats.
            let x = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            hi = _mm512_max_ps(hi, x);
            sum = _mm512_add_ps(sum, exp_lanes(x, shift));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            // The lanes past the block read as -inf (the masked load touches no other memory).
            let mask = (1u16 << rest.len()) - 1;
            let neg = _mm512_set1_ps(f32::NEG_INFINITY);
            // SAFETY: only the first `rest.len()` lanes are loaded, all inside `rest`.
            let x = unsafe { _mm512_mask_loadu_ps(neg, mask, rest.as_ptr()) };
            hi = _mm512_max_ps(hi, x);
            let e = exp_lanes(x, shift);
            // The -inf lanes add their floor value; zero them to add nothing.
            sum = _mm512_add_ps(sum, std::arch::x86_64::_mm512_maskz_mov_ps(mask, e));
        }
        (
            f64::from(_mm512_reduce_add_ps(sum)),
            _mm512_reduce_max_ps(hi),
        )
    }
}

#[inline(always)]
fn summarize_lanes<const FMA: bool>(
    src: &[f32],
    range: std::ops::Range<usize>,
    dst: Option<&mut [f32]>,
    best: &mut TopK<'_>,
) -> RowPart {
    summarize_with(src, range, dst, best, exp_sum_and_max::<FMA>)
}

/// The one pass of [`summarize`] over the segment `src[range]`, with `sum_block` giving a
/// block's `(Σ e^(x - shift), max x)`; its blocks offered to `best`.
#[inline(always)]
fn summarize_with(
    src: &[f32],
    range: std::ops::Range<usize>,
    mut dst: Option<&mut [f32]>,
    best: &mut TopK<'_>,
    sum_block: impl Fn(&[f32], f32) -> (f64, f32),
) -> RowPart {
    let mut m = f32::NEG_INFINITY;
    let mut max_start = range.start;
    // Σ e^(x - m) over the blocks so far.
    let mut total = 0.0f64;
    for (b, from) in src[range.clone()].chunks(BLOCK).enumerate() {
        let start = range.start + b * BLOCK;
        let block = match dst.as_deref_mut() {
            Some(dst) => {
                let to = &mut dst[start..start + from.len()];
                to.copy_from_slice(from);
                &*to
            }
            None => from,
        };
        // Each block's sum is taken against the max so far (its own before any), and its
        // max in the same sweep; only a block far above that shift is summed again.
        let mut shift = if m > f32::NEG_INFINITY {
            m
        } else {
            max_lanes(block)
        };
        if shift == f32::NEG_INFINITY {
            continue; // nothing finite yet
        }
        let (mut sum, block_max) = sum_block(block, shift);
        if block_max > shift + STALE_SHIFT {
            shift = block_max;
            sum = sum_block(block, shift).0;
        }
        // Into `total`, relative to the new max.
        let new_m = m.max(block_max);
        if new_m > m {
            if m > f32::NEG_INFINITY {
                total *= (f64::from(m) - f64::from(new_m)).exp();
            }
            m = new_m;
            max_start = start;
        }
        total += if shift == m {
            sum
        } else {
            sum * (f64::from(shift) - f64::from(m)).exp()
        };
        best.offer(src, start, block.len(), block_max);
    }
    let argmax = if m == f32::NEG_INFINITY {
        range.start
    } else {
        max_start
            + src[max_start..range.end]
                .iter()
                .position(|&x| x == m)
                .expect("the max block holds the max")
    };
    RowPart {
        max: m,
        sum: total,
        argmax,
        top: Vec::new(),
    }
}

/// `ln Σ e^x` over the finite logits; `-inf` when there are none.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = max(logits);
    if m == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let (sum, _) = exp_sums::<false>(logits, m);
    f64::from(m) + sum.ln()
}

/// Log-probability of `token`: its logit minus the log-partition.
///
/// # Panics
/// If `token` is out of range.
pub fn log_softmax_at(logits: &[f32], token: usize) -> f64 {
    let logit = logits[token];
    if logit == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    f64::from(logit) - log_sum_exp(logits)
}

/// Information content of `token` in nats; `+inf` for a masked token.
pub fn surprisal(logits: &[f32], token: usize) -> f64 {
    -log_softmax_at(logits, token)
}

/// Shannon entropy of the softmax in nats. Masked tokens contribute nothing;
/// a row with at most one finite logit has entropy 0.
pub fn entropy(logits: &[f32]) -> f64 {
    log_sum_exp_and_entropy(logits).1
}

/// `(log_sum_exp, entropy)` from one pass over the row, for callers that
/// report both surprisal and entropy per token.
pub fn log_sum_exp_and_entropy(logits: &[f32]) -> (f64, f64) {
    let m = max(logits);
    if m == f32::NEG_INFINITY {
        return (f64::NEG_INFINITY, 0.0);
    }
    // With d = x - max and Z = Σ e^d: H = ln Z - Σ e^d·d / Z.
    let (z, weighted) = exp_sums::<true>(logits, m);
    let ln_z = z.ln();
    (f64::from(m) + ln_z, (ln_z - weighted / z).max(0.0))
}

/// Unit for reporting surprisal and entropy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogBase {
    #[default]
    /// Natural logarithm (the default).
    Nats,
    /// Base-2 logarithm.
    Bits,
}

impl LogBase {
    /// Parses `"nats"` or `"bits"` (ASCII case-insensitive).
    pub fn from_name(name: &str) -> Option<LogBase> {
        if name.eq_ignore_ascii_case("nats") {
            Some(LogBase::Nats)
        } else if name.eq_ignore_ascii_case("bits") {
            Some(LogBase::Bits)
        } else {
            None
        }
    }

    /// Converts a quantity measured in nats into this unit.
    pub fn convert(self, nats: f64) -> f64 {
        match self {
            LogBase::Nats => nats,
            LogBase::Bits => nats / std::f64::consts::LN_2,
        }
    }
}

/// Running perplexity: `exp(mean surprisal)` over the tokens added so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Perplexity {
    sum: f64,
    count: u64,
}

impl Perplexity {
    /// No tokens yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The accumulator as (sum of surprisals in nats, token count), for saving.
    pub fn parts(&self) -> (f64, u64) {
        (self.sum, self.count)
    }

    /// The accumulator `parts` returned (restoring a saved branch).
    pub fn from_parts(sum: f64, count: u64) -> Self {
        Perplexity { sum, count }
    }

    /// Adds one token's surprisal in nats (`+inf` makes the result `+inf`).
    pub fn add(&mut self, surprisal_nats: f64) {
        self.sum += surprisal_nats;
        self.count += 1;
    }

    /// Tokens added so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean surprisal in nats (cross-entropy); `+inf` before any token.
    pub fn mean_surprisal(&self) -> f64 {
        if self.count == 0 {
            f64::INFINITY
        } else {
            self.sum / self.count as f64
        }
    }

    /// Perplexity; `+inf` before any token.
    pub fn value(&self) -> f64 {
        self.mean_surprisal().exp()
    }
}

/// Index of the largest logit, the first one on ties.
///
/// # Panics
/// If `logits` is empty.
pub fn argmax(logits: &[f32]) -> usize {
    assert!(!logits.is_empty(), "argmax of an empty logits row");
    let m = max(logits);
    // Find the first block holding the max with a vectorizable any(), then scan it.
    let block = logits
        .chunks(SCAN)
        .position(|c| c.iter().fold(false, |hit, &x| hit | (x == m)))
        .expect("the max is an element");
    let start = block * SCAN;
    start
        + logits[start..]
            .iter()
            .position(|&x| x == m)
            .expect("block holds the max")
}

/// True if `a` should be evicted before `b`: lower logit, or equal and later.
#[inline]
fn weaker(logits: &[f32], a: u32, b: u32) -> bool {
    let (x, y) = (logits[a as usize], logits[b as usize]);
    x < y || (x == y && a > b)
}

/// Min-heap (by [`weaker`]) sift-up of the entry at `pos`.
fn sift_up(heap: &mut [u32], mut pos: usize, logits: &[f32]) {
    while pos > 0 {
        let parent = (pos - 1) / 2;
        if !weaker(logits, heap[pos], heap[parent]) {
            break;
        }
        heap.swap(pos, parent);
        pos = parent;
    }
}

/// Min-heap sift-down from the root.
fn sift_down(heap: &mut [u32], logits: &[f32]) {
    let mut pos = 0;
    loop {
        let (l, r) = (2 * pos + 1, 2 * pos + 2);
        let mut least = pos;
        if l < heap.len() && weaker(logits, heap[l], heap[least]) {
            least = l;
        }
        if r < heap.len() && weaker(logits, heap[r], heap[least]) {
            least = r;
        }
        if least == pos {
            break;
        }
        heap.swap(pos, least);
        pos = least;
    }
}

/// The best `k` finite logits seen so far, as a min-heap (by [`weaker`]) of their indices:
/// its weakest entry is the threshold anything must beat to enter.
struct TopK<'a> {
    k: usize,
    heap: &'a mut Vec<u32>,
    /// -inf until the heap is full.
    threshold: f32,
}

impl<'a> TopK<'a> {
    fn new(k: usize, heap: &'a mut Vec<u32>) -> Self {
        heap.clear();
        TopK {
            k,
            heap,
            threshold: f32::NEG_INFINITY,
        }
    }

    /// Offer `row[start..start + len]`, whose max is `block_max`. Blocks come in index order,
    /// so a block whose max only ties the threshold cannot enter (the earlier index wins).
    #[inline(always)]
    fn offer(&mut self, row: &[f32], start: usize, len: usize, block_max: f32) {
        if self.k == 0 || block_max <= self.threshold {
            return;
        }
        for (c, chunk) in row[start..start + len].chunks(LANES).enumerate() {
            // A vectorized look first: most chunks of a passing block hold nothing to take.
            let threshold = self.threshold;
            if !chunk.iter().fold(false, |hit, &x| hit | (x > threshold)) {
                continue;
            }
            for (j, &x) in chunk.iter().enumerate() {
                if x > self.threshold {
                    self.insert((start + c * LANES + j) as u32, row);
                }
            }
        }
    }

    fn insert(&mut self, i: u32, row: &[f32]) {
        let heap = &mut *self.heap;
        if heap.len() < self.k {
            heap.push(i);
            let last = heap.len() - 1;
            sift_up(heap, last, row);
            if heap.len() == self.k {
                self.threshold = row[heap[0] as usize];
            }
        } else {
            heap[0] = i;
            sift_down(heap, row);
            self.threshold = row[heap[0] as usize];
        }
    }

    /// The entries, best first.
    fn into_sorted(self, row: &[f32]) {
        sort_best_first(row, self.heap);
    }
}

/// Fills `out` with the indices of the `k` largest finite logits, in no
/// particular order (fewer if fewer are finite). On ties the earlier index wins.
///
/// One pass: `out` doubles as a min-heap of the current best k, and whole
/// blocks whose max cannot beat the heap's weakest entry are skipped after a
/// vectorized max, so typical cost is a single streaming read of the row.
pub fn top_k_indices(logits: &[f32], k: usize, out: &mut Vec<u32>) {
    debug_assert!(logits.len() <= u32::MAX as usize);
    let mut best = TopK::new(k, out);
    if k == 0 {
        return;
    }
    for (b, block) in logits.chunks(SCAN).enumerate() {
        best.offer(logits, b * SCAN, block.len(), max(block));
    }
}

/// [`top_k_indices`], best first (the higher logit first; on ties the lower index): the first
/// `j` entries of `top_k_sorted(row, k)` are `top_k_sorted(row, j)` for every `j <= k`.
pub fn top_k_sorted(logits: &[f32], k: usize, out: &mut Vec<u32>) {
    top_k_indices(logits, k, out);
    sort_best_first(logits, out);
}

/// Orders indices of `logits` best first: the higher logit first, on ties the lower index.
pub fn sort_best_first(logits: &[f32], idx: &mut [u32]) {
    idx.sort_unstable_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NEG: f32 = f32::NEG_INFINITY;

    fn naive_lse(xs: &[f32]) -> f64 {
        let m = xs
            .iter()
            .fold(f64::NEG_INFINITY, |a, &x| a.max(f64::from(x)));
        if m == f64::NEG_INFINITY {
            return m;
        }
        m + xs
            .iter()
            .map(|&x| (f64::from(x) - m).exp())
            .sum::<f64>()
            .ln()
    }

    fn naive_entropy(xs: &[f32]) -> f64 {
        let lse = naive_lse(xs);
        xs.iter()
            .filter(|x| x.is_finite())
            .map(|&x| {
                let lp = f64::from(x) - lse;
                -lp.exp() * lp
            })
            .sum()
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        a == b || (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0)
    }

    /// Deterministic pseudo-random logits (xorshift), some masked.
    fn logits(n: usize, seed: u64, masked_every: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                if masked_every > 0 && i % masked_every == 3 {
                    NEG
                } else {
                    ((s >> 40) as f32 / (1u64 << 24) as f32) * 30.0 - 15.0
                }
            })
            .collect()
    }

    #[test]
    fn fast_exp_edges() {
        assert_eq!(fast_exp(0.0), 1.0);
        assert_eq!(fast_exp(NEG), 0.0);
        assert_eq!(fast_exp(-87.01), 0.0);
        assert_eq!(fast_exp(-1e30), 0.0);
        assert!(fast_exp(-87.0) > 0.0);
        assert!(fast_exp(88.0).is_finite());
        assert_eq!(fast_exp(100.0), f32::INFINITY);
        let rel = (f64::from(fast_exp(1.0)) - 1f64.exp()).abs() / 1f64.exp();
        assert!(rel < 2e-6);
    }

    #[test]
    fn fast_exp_dense_sweep() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            worst = worst.max((f64::from(fast_exp(x)) - want).abs() / want);
            x += 0.001_3;
        }
        assert!(worst < 2e-6, "worst relative error {worst}");
    }

    #[test]
    fn max_and_argmax() {
        assert_eq!(max(&[]), NEG);
        assert_eq!(max(&[NEG, NEG]), NEG);
        let mut xs = logits(1000, 7, 5);
        xs[613] = 100.0;
        xs[900] = 100.0;
        assert_eq!(max(&xs), 100.0);
        assert_eq!(argmax(&xs), 613);
        assert_eq!(argmax(&[NEG, NEG]), 0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }

    #[test]
    fn lse_matches_naive() {
        for (n, masked) in [(1, 0), (17, 4), (1000, 7), (262_144, 11)] {
            let xs = logits(n, n as u64, masked);
            let (a, b) = (log_sum_exp(&xs), naive_lse(&xs));
            assert!(close(a, b, 1e-5), "n={n}: {a} vs {b}");
        }
        assert_eq!(log_sum_exp(&[]), NEG.into());
        assert_eq!(log_sum_exp(&[NEG, NEG]), NEG.into());
        assert!(close(log_sum_exp(&[0.0, 0.0]), 2f64.ln(), 1e-6));
    }

    #[test]
    fn softmax_and_surprisal() {
        let xs = [1.0, NEG, 2.0, 0.5];
        let lse = naive_lse(&xs);
        assert!(close(log_softmax_at(&xs, 2), 2.0 - lse, 1e-5));
        assert!(close(surprisal(&xs, 0), lse - 1.0, 1e-5));
        assert_eq!(log_softmax_at(&xs, 1), f64::NEG_INFINITY);
        assert_eq!(surprisal(&xs, 1), f64::INFINITY);
        assert_eq!(surprisal(&[NEG], 0), f64::INFINITY);
        assert_eq!(surprisal(&[5.0, NEG], 0), 0.0);
    }

    #[test]
    fn entropy_matches_naive() {
        for (n, masked) in [(2, 0), (33, 4), (5000, 3), (262_144, 11)] {
            let xs = logits(n, 99 + n as u64, masked);
            let (a, b) = (entropy(&xs), naive_entropy(&xs));
            assert!(close(a, b, 1e-5), "n={n}: {a} vs {b}");
        }
        assert_eq!(entropy(&[3.0, NEG, NEG]), 0.0);
        assert_eq!(entropy(&[]), 0.0);
        assert!(close(entropy(&[0.0; 4]), 4f64.ln(), 1e-6));
        // Far-below-max tokens are effectively masked, not NaN.
        assert!(entropy(&[0.0, -200.0]).abs() < 1e-6);
        let xs = logits(4096, 3, 9);
        let (lse, h) = log_sum_exp_and_entropy(&xs);
        assert_eq!((lse, h), (log_sum_exp(&xs), entropy(&xs)));
        assert_eq!(log_sum_exp_and_entropy(&[NEG]), (f64::NEG_INFINITY, 0.0));
    }

    #[test]
    fn log_base() {
        assert_eq!(LogBase::from_name("bits"), Some(LogBase::Bits));
        assert_eq!(LogBase::from_name("Nats"), Some(LogBase::Nats));
        assert_eq!(LogBase::from_name("bans"), None);
        assert!(close(
            LogBase::Bits.convert(std::f64::consts::LN_2),
            1.0,
            1e-12
        ));
        assert_eq!(LogBase::Nats.convert(1.5), 1.5);
    }

    #[test]
    fn perplexity() {
        let mut p = Perplexity::default();
        assert_eq!(p.value(), f64::INFINITY);
        p.add(1.0);
        p.add(3.0);
        assert_eq!(p.count(), 2);
        assert!(close(p.value(), 2f64.exp(), 1e-12));
        p.add(f64::INFINITY);
        assert_eq!(p.value(), f64::INFINITY);
    }

    #[test]
    fn the_portable_and_the_avx512_summaries_agree() {
        // `summarize` dispatches at run time; the portable lanes must agree with it on any CPU.
        for seed in 0..6 {
            let xs = logits(
                70_000 + seed as usize * 997,
                seed,
                if seed % 2 == 0 { 7 } else { 0 },
            );
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let fast = summarize(&xs, 33, &mut a);
            let portable =
                summarize_lanes::<BASE_FMA>(&xs, 0..xs.len(), None, &mut TopK::new(33, &mut b));
            sort_best_first(&xs, &mut b);
            let portable = portable.alone();
            assert_eq!((fast.argmax, &a), (portable.argmax, &b));
            assert!(close(fast.log_sum_exp, portable.log_sum_exp, 1e-6));
            assert!(close(fast.log_sum_exp, naive_lse(&xs), 1e-6));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    #[allow(unsafe_code)]
    fn every_simd_tier_this_cpu_runs_agrees_with_the_portable_lanes() {
        // The AVX2 tier is what an AVX2 machine without AVX-512 runs from the x86-64 wheel;
        // check it here too (this CPU may have AVX-512, so dispatch alone would skip it).
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            return;
        }
        for seed in 0..4 {
            let xs = logits(50_000 + seed as usize * 131, seed, 5);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            // SAFETY: avx2 and fma were detected above.
            let avx2 =
                unsafe { summarize_avx2(&xs, 0..xs.len(), None, &mut TopK::new(17, &mut a)) };
            sort_best_first(&xs, &mut a);
            let avx2 = avx2.alone();
            let portable =
                summarize_lanes::<false>(&xs, 0..xs.len(), None, &mut TopK::new(17, &mut b));
            sort_best_first(&xs, &mut b);
            let portable = portable.alone();
            assert_eq!((avx2.argmax, &a), (portable.argmax, &b));
            assert!(close(avx2.log_sum_exp, portable.log_sum_exp, 1e-6));
            // SAFETY: as above.
            let (s2, w2) = unsafe { exp_sums_avx2::<true>(&xs, avx2.log_sum_exp as f32) };
            let (s0, w0) = exp_sums_lanes::<true, false>(&xs, avx2.log_sum_exp as f32);
            assert!(
                close(s2, s0, 1e-6) && close(w2, w0, 1e-5),
                "{s2} {s0} {w2} {w0}"
            );
            // SAFETY: as above.
            assert_eq!(unsafe { max_avx2(&xs) }, max_lanes(&xs));
        }
    }

    #[test]
    fn top_k_basics() {
        let mut out = vec![99];
        top_k_indices(&[1.0, 5.0, NEG, 3.0, 4.0], 2, &mut out);
        out.sort();
        assert_eq!(out, [1, 4]);
        top_k_indices(&[1.0, NEG, 2.0], 10, &mut out);
        out.sort();
        assert_eq!(out, [0, 2]);
        top_k_indices(&[1.0], 0, &mut out);
        assert!(out.is_empty());
        top_k_indices(&[NEG; 300], 3, &mut out);
        assert!(out.is_empty());
        top_k_indices(&[2.0; 300], 3, &mut out);
        out.sort();
        assert_eq!(out, [0, 1, 2], "earlier index wins ties");
    }

    #[test]
    fn top_k_large_row() {
        let xs = logits(262_144, 5, 13);
        let mut out = Vec::new();
        top_k_indices(&xs, 40, &mut out);
        let mut got: Vec<f32> = out.iter().map(|&i| xs[i as usize]).collect();
        got.sort_by(|a, b| b.total_cmp(a));
        let mut all = xs.clone();
        all.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(got, all[..40]);
    }

    fn logit_strategy() -> impl Strategy<Value = f32> {
        prop_oneof![
            8 => -30.0f32..30.0,
            1 => Just(NEG),
            1 => (-3i32..3).prop_map(|v| v as f32), // plenty of ties
        ]
    }

    proptest! {
        #[test]
        fn fast_exp_relative_error(x in -87.0f32..88.0) {
            let want = f64::from(x).exp();
            let rel = (f64::from(fast_exp(x)) - want).abs() / want;
            prop_assert!(rel < 2e-6, "x={x}: rel {rel}");
        }

        #[test]
        fn top_k_matches_sort(
            xs in prop::collection::vec(logit_strategy(), 0..700),
            k in 0usize..50,
        ) {
            let mut out = Vec::new();
            top_k_indices(&xs, k, &mut out);
            let mut finite: Vec<(f32, u32)> = xs
                .iter()
                .enumerate()
                .filter(|(_, x)| x.is_finite())
                .map(|(i, &x)| (x, i as u32))
                .collect();
            // Descending value, earlier index first on ties.
            finite.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut want: Vec<u32> = finite.iter().take(k).map(|e| e.1).collect();
            want.sort();
            out.sort();
            prop_assert_eq!(out, want);
        }

        #[test]
        fn lse_and_entropy_match_naive(xs in prop::collection::vec(logit_strategy(), 0..400)) {
            prop_assert!(close(log_sum_exp(&xs), naive_lse(&xs), 1e-5));
            prop_assert!((entropy(&xs) - naive_entropy(&xs)).abs() < 1e-5);
        }
    }
}
