//! Arguments and results of `Context.embed` / `embed_batch`: a queued embedding request and
//! how its rows become a numpy array, shared by the async methods and their sync twins.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::awaitable::Call;
use crate::convert;
use crate::errors::IntoPyResult;

/// What the engine returns for a list of texts.
type Rows = Vec<kvfork::Embedding>;

/// A queued embedding and the shape of its result.
pub struct Request {
    pending: kvfork::Pending<Rows>,
    shape: Shape,
}

#[derive(Clone, Copy)]
enum Shape {
    /// One text: a vector (pooled) or one row per token.
    One { pooled: bool, dim: usize },
    /// Many texts, one pooled vector each.
    Many { dim: usize },
}

impl Request {
    /// Queue the embedding of one text (str or tokens).
    pub fn one(ctx: &kvfork::Context, obj: &Bound<'_, PyAny>, normalize: bool) -> PyResult<Self> {
        let input = vec![input(ctx, obj)?];
        Ok(Request {
            pending: ctx.embed(input, normalize),
            shape: Shape::One {
                pooled: ctx.embeddings_pooled(),
                dim: ctx.embedding_dim(),
            },
        })
    }

    /// Queue the embeddings of many texts; refused before any work without pooling.
    pub fn many(
        ctx: &kvfork::Context,
        texts: &Bound<'_, PyAny>,
        normalize: bool,
    ) -> PyResult<Self> {
        ctx.check_computes_embeddings().py()?; // before a word about its pooling
        if !ctx.embeddings_pooled() {
            return Err(PyValueError::new_err(
                "embed_batch needs a pooled context (pooling 'mean', 'cls' or 'last'); \
                 with pooling 'none' call embed per text",
            ));
        }
        if texts.is_instance_of::<pyo3::types::PyString>() {
            return Err(crate::errors::type_error(
                "texts must be a list of texts, not one str (use embed for one text)",
            ));
        }
        let inputs = texts
            .try_iter()?
            .map(|t| input(ctx, &t?))
            .collect::<PyResult<_>>()?;
        Ok(Request {
            pending: ctx.embed(inputs, normalize),
            shape: Shape::Many {
                dim: ctx.embedding_dim(),
            },
        })
    }

    /// An awaitable of the array.
    pub fn awaitable<'py>(self, py: Python<'py>, call: Call) -> PyResult<Bound<'py, PyAny>> {
        let shape = self.shape;
        convert::awaitable_py(py, call, self.pending, move |py, rows| {
            array(py, shape, rows).map(Bound::unbind)
        })
    }

    /// Block (without the GIL) for the array.
    pub fn wait<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let shape = self.shape;
        let rows = convert::wait(py, self.pending)?;
        array(py, shape, rows)
    }
}

/// A str (tokenized with special tokens, as a model expects a document) or a token list.
fn input(ctx: &kvfork::Context, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    match obj.extract::<String>() {
        Ok(text) => ctx.tokenize(&text, true, false).py(),
        // A str that is not UTF-8 (a lone surrogate): its own error, not "not a str".
        Err(e) if obj.is_instance_of::<pyo3::types::PyString>() => Err(e),
        Err(_) => convert::tokens(obj, "text_or_tokens"),
    }
}

/// The float32 array: `(dim,)` or `(n_tokens, dim)` for one text, `(n_texts, dim)` for many.
fn array<'py>(py: Python<'py>, shape: Shape, rows: Rows) -> PyResult<Bound<'py, PyAny>> {
    let (n, dim, flat) = match shape {
        Shape::One { pooled: true, .. } => {
            let flat: Vec<f32> = rows.into_iter().flatten().flatten().collect();
            return convert::f32_array(py, &flat);
        }
        Shape::One { dim, .. } => {
            let rows = rows.into_iter().next().unwrap_or_default();
            (rows.len(), dim, rows.concat())
        }
        Shape::Many { dim } => (
            rows.len(),
            dim,
            rows.into_iter().flatten().flatten().collect(),
        ),
    };
    convert::f32_array(py, &flat)?.call_method1("reshape", ((n, dim),))
}
