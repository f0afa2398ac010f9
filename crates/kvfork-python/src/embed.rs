//! Arguments and results of `Context.embed` / `embed_batch`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::convert;
use crate::errors::IntoPyResult;

/// A str (tokenized with special tokens, as a model expects a document) or a token list.
pub fn input(ctx: &kvfork::Context, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    match obj.extract::<String>() {
        Ok(text) => ctx.tokenize(&text, true, false).py(),
        Err(_) => convert::tokens(obj, "text_or_tokens"),
    }
}

pub fn inputs(ctx: &kvfork::Context, texts: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<i32>>> {
    if texts.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(
            "texts must be a list of texts, not one str (use embed for one text)",
        ));
    }
    texts.try_iter()?.map(|t| input(ctx, &t?)).collect()
}

/// One text's rows as a 1-D array (pooled) or a 2-D array (one row per token).
pub fn text_array<'py>(
    py: Python<'py>,
    rows: Vec<Vec<f32>>,
    pooled: bool,
    dim: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let n = rows.len();
    let flat = convert::f32_array(py, &rows.concat())?;
    if pooled {
        Ok(flat)
    } else {
        flat.call_method1("reshape", ((n, dim),))
    }
}

/// `(len(texts), dim)` of pooled embeddings.
pub fn batch_array<'py>(
    py: Python<'py>,
    rows: Vec<Vec<Vec<f32>>>,
    dim: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let n = rows.len();
    let flat: Vec<f32> = rows.into_iter().flatten().flatten().collect();
    convert::f32_array(py, &flat)?.call_method1("reshape", ((n, dim),))
}

/// `embed_batch` stacks one vector per text: refused before any work without pooling.
pub fn check_pooled(ctx: &kvfork::Context) -> PyResult<()> {
    if !ctx.embeddings_pooled() {
        return Err(PyValueError::new_err(
            "embed_batch needs a pooled context (pooling 'mean', 'cls' or 'last'); \
             with pooling 'none' call embed per text",
        ));
    }
    Ok(())
}
