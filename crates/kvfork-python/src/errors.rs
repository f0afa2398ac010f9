//! The Python exception hierarchy and the mapping from `kvfork::Error`.

use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyIsADirectoryError, PyOSError, PyPermissionError,
    PyValueError,
};
use pyo3::prelude::*;

pyo3::create_exception!(
    kvfork,
    KvforkError,
    PyException,
    "Base class of every kvfork error."
);
pyo3::create_exception!(
    kvfork,
    ModelLoadError,
    KvforkError,
    "A model file could not be loaded."
);
pyo3::create_exception!(kvfork, DecodeError, KvforkError, "llama_decode failed.");
pyo3::create_exception!(
    kvfork,
    KvCacheFullError,
    DecodeError,
    "No room left in the KV cache."
);
pyo3::create_exception!(
    kvfork,
    LeaseExhaustedError,
    KvforkError,
    "Every KV sequence of the context is leased."
);
pyo3::create_exception!(
    kvfork,
    BranchDisposedError,
    KvforkError,
    "The branch was pruned."
);
pyo3::create_exception!(
    kvfork,
    GrammarError,
    KvforkError,
    "A grammar failed to parse or has no legal continuation."
);
pyo3::create_exception!(
    kvfork,
    ChatTemplateError,
    KvforkError,
    "A chat template is missing or failed to render."
);

pyo3::create_exception!(
    kvfork,
    StateFileError,
    KvforkError,
    "A saved state file is corrupt, truncated, foreign, or from another model."
);

/// `kvfork::Error` → the matching Python exception.
pub fn to_py(err: kvfork::Error) -> PyErr {
    use kvfork::Error as E;
    let msg = err.to_string();
    match err {
        E::ModelLoad { .. } => ModelLoadError::new_err(msg),
        E::Decode(_) => DecodeError::new_err(msg),
        E::KvCacheFull(_) => KvCacheFullError::new_err(msg),
        E::LeaseExhausted { .. } => LeaseExhaustedError::new_err(msg),
        E::BranchDisposed(_) => BranchDisposedError::new_err(msg),
        E::Grammar(_) => GrammarError::new_err(msg),
        E::ChatTemplate(_) => ChatTemplateError::new_err(msg),
        E::InvalidArgument { .. } => PyValueError::new_err(msg),
        E::State(_) => StateFileError::new_err(msg),
        E::Io { kind, .. } => match kind {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            std::io::ErrorKind::IsADirectory => PyIsADirectoryError::new_err(msg),
            _ => PyOSError::new_err(msg),
        },
        E::Closed | E::Cancelled(_) | E::Internal(_) | E::Other(_) => KvforkError::new_err(msg),
    }
}

/// `?`-friendly conversion of kvfork results.
pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for kvfork::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvforkError", py.get_type::<KvforkError>())?;
    m.add("ModelLoadError", py.get_type::<ModelLoadError>())?;
    m.add("DecodeError", py.get_type::<DecodeError>())?;
    m.add("KvCacheFullError", py.get_type::<KvCacheFullError>())?;
    m.add("LeaseExhaustedError", py.get_type::<LeaseExhaustedError>())?;
    m.add("BranchDisposedError", py.get_type::<BranchDisposedError>())?;
    m.add("GrammarError", py.get_type::<GrammarError>())?;
    m.add("ChatTemplateError", py.get_type::<ChatTemplateError>())?;
    m.add("StateFileError", py.get_type::<StateFileError>())?;
    Ok(())
}
