//! What `Branch.score` and `BranchStore.score` return: logprobs alone, or each with its most
//! likely tokens when `top_logprobs` was given (even 0).

use pyo3::prelude::*;

use crate::convert::Int;

/// One run's scores.
#[derive(IntoPyObject)]
pub(crate) enum Scores {
    Plain(Vec<f64>),
    WithTop(Vec<(f64, Vec<(i32, f64)>)>),
}

impl Scores {
    fn of(scores: Vec<kvfork::TokenScore>, with_top: bool) -> Self {
        if with_top {
            Scores::WithTop(scores.into_iter().map(|s| (s.logprob, s.top)).collect())
        } else {
            Scores::Plain(scores.into_iter().map(|s| s.logprob).collect())
        }
    }
}

/// Most alternatives a score may ask for at each position: every position's come back as
/// Python tuples (the whole vocabulary at each of a long run's positions would be tens of
/// GB).
const MAX_TOP: i64 = 1024;

/// `top_logprobs` as a count (None: 0).
pub(crate) fn top_count(top_logprobs: Option<&Int>) -> PyResult<usize> {
    Ok(match top_logprobs {
        Some(k) => k.within("top_logprobs", 0, MAX_TOP)? as usize,
        None => 0,
    })
}

/// The conversion of `Branch.score`'s reply, as the call asked for it.
pub(crate) fn one(with_top: bool) -> impl FnOnce(Vec<kvfork::TokenScore>) -> PyResult<Scores> {
    move |scores| Ok(Scores::of(scores, with_top))
}

/// The conversion of `BranchStore.score`'s reply: one run's scores per entry.
pub(crate) fn each(
    with_top: bool,
) -> impl FnOnce(Vec<Vec<kvfork::TokenScore>>) -> PyResult<Vec<Scores>> {
    move |runs| Ok(runs.into_iter().map(|r| Scores::of(r, with_top)).collect())
}
