//! Branches a call makes (a restore, a load) that may reach nobody: an await cancelled, or a
//! blocking wait interrupted by Ctrl-C, after the engine made them. A context keeps a branch
//! until it is pruned, so they would hold their leases for the context's life, unreachable:
//! they are pruned instead (the caller asked for nothing to happen).

use kvfork::Pending;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::awaitable::{Call, Discard, OnCancel, Operation};
use crate::convert;
use crate::handles::{wrap, PyBranch};

/// Prune `branches`, listed each after its parent: the last first. Queued in that order and
/// run whether or not anyone waits.
fn prune_all(branches: &[kvfork::Branch]) {
    for branch in branches.iter().rev() {
        drop(branch.prune());
    }
}

/// The branches inside a converted result nobody took (a Branch, or a list of them).
fn discard_made() -> Discard {
    Box::new(|py, made| {
        let made = made.bind(py);
        let branches: Vec<kvfork::Branch> = match made.cast::<PyBranch>() {
            Ok(one) => vec![one.get().inner.clone()],
            Err(_) => made
                .extract::<Vec<Py<PyBranch>>>()
                .map(|all| all.iter().map(|b| b.get().inner.clone()).collect())
                .unwrap_or_default(),
        };
        prune_all(&branches);
    })
}

/// An awaitable of one new branch; made after a cancel, it is pruned.
pub fn awaitable_branch<'py>(
    py: Python<'py>,
    call: Call,
    pending: Pending<kvfork::Branch>,
) -> PyResult<Bound<'py, PyAny>> {
    let op = Operation::new(call, pending, OnCancel::Settle, |py, b| {
        wrap(b).into_py_any(py)
    })
    .with_discard(discard_made());
    Bound::new(py, op).map(Bound::into_any)
}

/// An awaitable of new branches (each after its parent); made after a cancel, they are pruned.
pub fn awaitable_branches<'py>(
    py: Python<'py>,
    call: Call,
    pending: Pending<Vec<kvfork::Branch>>,
) -> PyResult<Bound<'py, PyAny>> {
    let op = Operation::new(call, pending, OnCancel::Settle, |py, bs| {
        bs.into_iter().map(wrap).collect::<Vec<_>>().into_py_any(py)
    })
    .with_discard(discard_made());
    Bound::new(py, op).map(Bound::into_any)
}

/// The blocking wait of one new branch; made after a Ctrl-C, it is pruned.
pub fn wait_branch(py: Python<'_>, pending: Pending<kvfork::Branch>) -> PyResult<PyBranch> {
    convert::wait_or_discard(py, pending, |b| prune_all(&[b])).map(wrap)
}

/// The blocking wait of new branches; made after a Ctrl-C, they are pruned.
pub fn wait_branches(
    py: Python<'_>,
    pending: Pending<Vec<kvfork::Branch>>,
) -> PyResult<Vec<PyBranch>> {
    convert::wait_or_discard(py, pending, |bs| prune_all(&bs))
        .map(|bs| bs.into_iter().map(wrap).collect())
}
