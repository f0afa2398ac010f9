//! The Python exception hierarchy and the mapping from `kvfork::Error`.

use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyIsADirectoryError, PyOSError, PyPermissionError,
    PyTypeError, PyUserWarning, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

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

pyo3::create_exception!(
    kvfork,
    KvforkWarning,
    PyUserWarning,
    "A call that works but likely not as meant (e.g. a branch created with nothing behind it)."
);

/// Issue a `KvforkWarning` with `msg`, pointing at the caller's line.
pub(crate) fn warn(py: Python<'_>, msg: String) -> PyResult<()> {
    let msg = std::ffi::CString::new(msg).unwrap_or_default();
    let category = py.get_type::<KvforkWarning>();
    PyErr::warn(py, category.as_any(), &msg, 1)
}

/// A TypeError that names the argument in its message. pyo3 (0.30) reports a bad argument's
/// name only as a note (`add_note("while processing 'n_ctx'")`), which `str(e)` and logs
/// leave out; this class folds that note into the message instead.
const ARGUMENT_TYPE_ERROR: &std::ffi::CStr = c"
class ArgumentTypeError(TypeError):
    \"\"\"A TypeError about one argument, named in the message.\"\"\"

    __module__ = \"kvfork\"

    def add_note(self, note, /):
        prefix = \"while processing '\"
        if note.startswith(prefix) and note.endswith(\"'\") and len(self.args) == 1:
            name = note[len(prefix):-1]
            message = str(self.args[0])
            if not message.startswith(name):
                self.args = (f\"argument '{name}': {message}\",)
            return
        super().add_note(note)
";

static ARGUMENT_TYPE_ERROR_CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A TypeError for a bad argument: when raised while pyo3 extracts an argument, the message
/// becomes "argument 'name': `msg`".
pub fn type_error(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match argument_type_error_class(py) {
        Ok(class) => PyErr::from_type(class.bind(py).clone(), (msg,)),
        Err(e) => e,
    })
}

fn argument_type_error_class(py: Python<'_>) -> PyResult<&Py<PyType>> {
    ARGUMENT_TYPE_ERROR_CLASS.get_or_try_init(py, || {
        let module = PyModule::from_code(
            py,
            ARGUMENT_TYPE_ERROR,
            c"kvfork/_argument_error.py",
            c"kvfork._argument_error",
        )?;
        Ok(module
            .getattr("ArgumentTypeError")?
            .cast_into::<PyType>()?
            .unbind())
    })
}

/// `err` as an [`type_error`] when it is a TypeError (so pyo3 names the argument in its
/// message); any other error as it is.
pub fn naming_argument(py: Python<'_>, err: PyErr) -> PyErr {
    if err.is_instance_of::<PyTypeError>(py) {
        let msg = err.value(py).to_string();
        type_error(msg)
    } else {
        err
    }
}

/// `kvfork::Error` → the matching Python exception.
pub fn to_py(err: kvfork::Error) -> PyErr {
    use kvfork::Error as E;
    let msg = err.to_string();
    match err {
        E::ModelLoad { .. } => ModelLoadError::new_err(msg),
        E::Decode(_) => DecodeError::new_err(msg),
        E::KvCacheFull(_) => KvCacheFullError::new_err(msg),
        E::LeaseExhausted { .. } | E::SeqLeased { .. } => LeaseExhaustedError::new_err(msg),
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
    m.add("KvforkWarning", py.get_type::<KvforkWarning>())?;
    m.add("ArgumentTypeError", argument_type_error_class(py)?.bind(py))?;
    Ok(())
}
