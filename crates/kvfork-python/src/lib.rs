//! Python bindings of kvfork (`kvfork._native`). Thin: convert arguments, call the `kvfork`
//! crate, convert results. One class per file.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

mod adapter;
mod awaitable;
mod branch;
mod chat;
mod context;
mod convert;
mod delivery;
mod embed;
mod errors;
mod generate;
mod handles;
mod made;
mod model;
mod params;
mod prefix_cache;
mod raw_layer;
mod scores;
mod store;
mod token;
mod twins;

use errors::IntoPyResult;

/// What llama.cpp and kvfork were built with and run on: `backend` (`cpu`, or the GPU in
/// use), `backends` (one line per backend found), `cpu_variant` (the CPU code in use: the
/// module of llama.cpp's CPU backend the release wheel loaded, or `built-in` for a build that
/// links it in) and `cpu_variant_reason` (why), `cpu_features` (its instruction sets) and
/// `host_cpu_features` (this CPU's), `llama_cpp`, `llama_system_info`, `gpu_offload`, `mmap`.
#[pyfunction]
fn system_info(py: Python<'_>) -> PyResult<std::collections::BTreeMap<&'static str, Py<PyAny>>> {
    use pyo3::IntoPyObjectExt;
    let info = kvfork::system_info().py()?;
    let mut d = std::collections::BTreeMap::new();
    d.insert("backend", info.backend.into_py_any(py)?);
    d.insert("cpu_features", info.cpu_features.clone().into_py_any(py)?);
    d.insert(
        "host_cpu_features",
        info.host_cpu_features.clone().into_py_any(py)?,
    );
    d.insert("llama_cpp", info.llama_cpp.into_py_any(py)?);
    d.insert(
        "llama_system_info",
        info.llama_system_info.clone().into_py_any(py)?,
    );
    d.insert("gpu_offload", info.gpu_offload.into_py_any(py)?);
    d.insert("mmap", info.mmap.into_py_any(py)?);
    d.insert("cpu_variant", info.cpu_variant.into_py_any(py)?);
    d.insert(
        "cpu_variant_reason",
        info.cpu_variant_reason.clone().into_py_any(py)?,
    );
    d.insert("backends", info.backends.clone().into_py_any(py)?);
    Ok(d)
}

/// GBNF grammar from a JSON schema (a dict is serialised by the Python wrapper).
#[pyfunction]
fn json_schema_to_grammar(py: Python<'_>, schema: convert::Arg<&str>) -> PyResult<String> {
    py.detach(|| kvfork::json_schema_to_grammar(schema.0)).py()
}

/// Lowest Python logging level forwarded from llama.cpp (10 debug … 40 error).
#[pyfunction]
fn _set_log_level(level: i32) {
    kvfork::set_log_min_level(match level {
        ..=10 => kvfork::LogLevel::Debug,
        11..=20 => kvfork::LogLevel::Info,
        21..=30 => kvfork::LogLevel::Warn,
        _ => kvfork::LogLevel::Error,
    });
}

/// Called once by `kvfork/__init__.py` with the directories that may hold ggml's backend
/// modules (the wheel's `kvfork/ggml`, the GPU companion packages), before anything loads.
#[pyfunction]
fn _set_module_dirs(dirs: Vec<std::path::PathBuf>) {
    kvfork::set_module_dirs(dirs);
}

/// llama.cpp log lines → `logging.getLogger("kvfork")`. May run on any thread.
fn forward_log(level: kvfork::LogLevel, message: &str) {
    static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let level = match level {
        kvfork::LogLevel::Debug => 10,
        kvfork::LogLevel::Info => 20,
        kvfork::LogLevel::Warn => 30,
        kvfork::LogLevel::Error => 40,
    };
    let _ = Python::try_attach(|py| {
        let forwarded = LOGGER
            .get_or_try_init(py, || {
                py.import("logging")?
                    .call_method1("getLogger", ("kvfork",))
                    .map(Bound::unbind)
            })
            .and_then(|logger| logger.bind(py).call_method1("log", (level, message)));
        if let Err(e) = forwarded {
            if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
                // Ctrl-C's handler ran in this Python code (a model loading logs): raised
                // again where the caller's Python code resumes, not lost.
                // SAFETY: callable from any thread; it only flags a SIGINT.
                unsafe { pyo3::ffi::PyErr_SetInterrupt() };
            }
        }
    });
}

/// Waits for an engine thread to end (a context closed, or dropped with its last reference)
/// let the GIL go when this thread holds it: the engine thread may need it to forward its last
/// log lines (dropping a busy context hung there).
fn release_gil_while(wait: &mut dyn FnMut()) {
    extern "C" {
        // Outside the limited API's headers (pyo3's abi3 bindings leave it out), but exported
        // by every CPython since 3.4: an abi3 build resolves it from the interpreter as any.
        fn PyGILState_Check() -> std::os::raw::c_int;
    }

    /// The wait moves to no other thread: `detach` runs it here, without the GIL.
    struct OnThisThread<'a>(&'a mut dyn FnMut());
    // SAFETY: see above: `detach` calls the closure on the calling thread.
    unsafe impl Send for OnThisThread<'_> {}
    impl OnThisThread<'_> {
        fn run(self) {
            (self.0)()
        }
    }

    // SAFETY: PyGILState_Check only reads this thread's state (1: it holds the GIL).
    if unsafe { PyGILState_Check() } != 1 {
        return wait();
    }
    let wait = OnThisThread(wait);
    // SAFETY: this thread holds the GIL (checked just above).
    let py = unsafe { Python::assume_attached() };
    py.detach(move || wait.run());
}

/// Refuse a subinterpreter (`kvfork/__init__.py`, at import): CPython hands a subinterpreter
/// a copy of this module's dict without running its init, and the extension keeps Python
/// objects process-wide (the event loops' deliveries, the logger); with those of a destroyed
/// subinterpreter, the main interpreter's awaits failed.
#[pyfunction]
fn _check_main_interpreter() -> PyResult<()> {
    // SAFETY: with the GIL held (a pyfunction), both read the current interpreter's state.
    let id = unsafe { pyo3::ffi::PyInterpreterState_GetID(pyo3::ffi::PyInterpreterState_Get()) };
    if id != 0 {
        return Err(pyo3::exceptions::PyImportError::new_err(
            "kvfork runs in the main interpreter only, not in a subinterpreter",
        ));
    }
    Ok(())
}

/// Close every live context (`atexit`): a thread frozen at exit holding one would leave its
/// engine decoding while the process's static destructors run.
#[pyfunction]
fn _close_all_contexts(py: Python<'_>) {
    py.detach(kvfork::close_all);
}

/// `os.register_at_fork(after_in_child=...)`: the child has none of the engines' threads, so
/// the contexts it inherited are closed, and using one says why (it hung).
#[pyfunction]
fn _after_fork_in_child() {
    kvfork::forsake_all_after_fork();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    kvfork::set_log_sink(forward_log);
    kvfork::set_blocking_wrapper(release_gil_while);

    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<model::PyModel>()?;
    m.add_class::<adapter::PyLoraAdapter>()?;
    m.add_class::<adapter::PyControlVector>()?;
    m.add_class::<handles::PyContext>()?;
    m.add_class::<params::PySamplingParams>()?;
    m.add_class::<token::PyToken>()?;
    m.add_class::<chat::PyFormattedChat>()?;
    m.add_class::<handles::PyBranch>()?;
    m.add_class::<store::PyBranchStore>()?;
    m.add_class::<prefix_cache::PyPrefixCache>()?;
    m.add_class::<generate::PyGenerator>()?;
    m.add_class::<generate::PyGeneratorSync>()?;
    m.add_class::<generate::PySpeculativeSchedule>()?;
    m.add_class::<awaitable::Ready>()?;
    m.add_class::<awaitable::Operation>()?;
    m.add_function(wrap_pyfunction!(context::create_context, m)?)?;
    m.add_function(wrap_pyfunction!(context::create_context_sync, m)?)?;
    m.add_function(wrap_pyfunction!(system_info, m)?)?;
    m.add_function(wrap_pyfunction!(json_schema_to_grammar, m)?)?;
    m.add_function(wrap_pyfunction!(_close_all_contexts, m)?)?;
    m.add_function(wrap_pyfunction!(_check_main_interpreter, m)?)?;
    m.add_function(wrap_pyfunction!(_after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(_set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(_set_module_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(branch::_use_speculative_streams, m)?)?;
    Ok(())
}
