//! Argument and result conversions shared by the classes.

#[cfg(not(feature = "abi3"))]
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::time::Duration;

use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyModule, PyString};
use pyo3::IntoPyObjectExt;

use crate::awaitable::{Call, OnCancel, Operation};
use crate::errors::{naming_argument, type_error, IntoPyResult};
use kvfork::{Cancel, Pending};

/// Tokens from a list, any sequence of ints, or a 1-D integer numpy array.
pub fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i32>> {
    let narrow = |v: Vec<i64>| -> PyResult<Vec<i32>> {
        v.into_iter()
            .map(|t| {
                i32::try_from(t).map_err(|_| {
                    PyValueError::new_err(format!("{name}: token id {t} is out of range"))
                })
            })
            .collect()
    };
    if obj.is_instance_of::<PyString>() {
        return Err(type_error(format!(
            "{name} must be a sequence of ints, not str"
        )));
    }
    // Bytes are a sequence of ints, but never token ids: text passed as bytes.
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>() {
        let kind = obj.get_type().name()?;
        return Err(type_error(format!(
            "{name} must be a sequence of ints (token ids), not {kind}: decode text to str"
        )));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let v = list
            .iter()
            .map(|x| match x.extract::<i64>() {
                Ok(t) => Ok(t),
                // An int too large for i64 is out of range, not of the wrong type.
                Err(_) if x.is_instance_of::<PyInt>() => Ok(i64::MAX),
                Err(_) => Err(type_error(format!("{name} must contain only ints"))),
            })
            .collect::<PyResult<Vec<_>>>()?;
        return narrow(v);
    }
    #[cfg(not(feature = "abi3"))]
    {
        let py = obj.py();
        if let Ok(buf) = PyBuffer::<i64>::get(obj) {
            check_1d(buf.dimensions(), name)?;
            if native_order(buf.format()) {
                return narrow(buf.to_vec(py)?);
            }
        } else if let Ok(buf) = PyBuffer::<i32>::get(obj) {
            check_1d(buf.dimensions(), name)?;
            if native_order(buf.format()) {
                return buf.to_vec(py);
            }
        }
        // Another byte order (numpy's ">i4"): the buffer's bytes are not our ints, the
        // array's own values are.
        if let Ok(v) = obj
            .call_method0("tolist")
            .and_then(|l| l.extract::<Vec<i64>>())
        {
            return narrow(v);
        }
    }
    // The stable ABI of Python 3.10 has no buffer protocol: read an array through `tolist`.
    #[cfg(feature = "abi3")]
    if let Some(ndim) = array_ndim(obj) {
        check_1d(ndim, name)?;
        if let Ok(v) = obj.call_method0("tolist")?.extract::<Vec<i64>>() {
            return narrow(v);
        }
    }
    let v = obj.extract::<Vec<i64>>().map_err(|_| {
        type_error(format!(
            "{name} must be a sequence of ints or a 1-D integer array"
        ))
    })?;
    narrow(v)
}

/// Whether a buffer's struct format reads in this machine's byte order (pyo3's element check
/// takes "<", ">" and "!" alike).
#[cfg(not(feature = "abi3"))]
fn native_order(format: &std::ffi::CStr) -> bool {
    match format.to_bytes().first() {
        Some(b'>' | b'!') => cfg!(target_endian = "big"),
        Some(b'<') => cfg!(target_endian = "little"),
        _ => true,
    }
}

fn check_1d(ndim: usize, name: &str) -> PyResult<()> {
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "{name} must be 1-D, got {ndim} dimensions"
        )));
    }
    Ok(())
}

/// `ndim` of a numpy-like array; None for anything else.
#[cfg(feature = "abi3")]
fn array_ndim(obj: &Bound<'_, PyAny>) -> Option<usize> {
    obj.getattr("ndim").ok()?.extract::<usize>().ok()
}

/// A 1-D float32 numpy array copied into a Vec (stable ABI: through `tobytes`).
#[cfg(feature = "abi3")]
pub fn f32_vec(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f32>> {
    let wrong = || PyValueError::new_err(format!("{name} must be a 1-D numpy.float32 array"));
    let ndim = array_ndim(obj).ok_or_else(wrong)?;
    let dtype: String = obj.getattr("dtype")?.getattr("str")?.extract()?;
    let native = if cfg!(target_endian = "little") {
        "<f4"
    } else {
        ">f4"
    };
    if dtype != native {
        return Err(PyValueError::new_err(format!(
            "{name} must be a native float32 array"
        )));
    }
    check_1d(ndim, name)?;
    let bytes: Vec<u8> = obj.call_method0("tobytes")?.extract()?;
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// A 1-D native-endian float32 buffer (numpy array) copied into a Vec.
#[cfg(not(feature = "abi3"))]
pub fn f32_vec(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f32>> {
    let buf = PyBuffer::<f32>::get(obj)
        .map_err(|_| PyValueError::new_err(format!("{name} must be a 1-D numpy.float32 array")))?;
    if !matches!(buf.format().to_bytes(), b"f" | b"@f" | b"=f" | b"<f") {
        return Err(PyValueError::new_err(format!(
            "{name} must be a native float32 array"
        )));
    }
    check_1d(buf.dimensions(), name)?;
    buf.to_vec(obj.py())
}

/// A new writable float32 numpy array (a copy the caller owns).
pub fn f32_array<'py>(py: Python<'py>, data: &[f32]) -> PyResult<Bound<'py, PyAny>> {
    static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let np = NUMPY
        .get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?
        .bind(py);
    let bytes = PyByteArray::new_with(py, std::mem::size_of_val(data), |out: &mut [u8]| {
        for (dst, v) in out.chunks_exact_mut(4).zip(data) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })?;
    np.call_method1("frombuffer", (bytes, np.getattr("float32")?))
}

/// `{token: bias}` → pairs.
pub fn bias_map(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(i32, f32)>> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error("bias must be a dict {token: bias}"))?;
    dict.iter()
        .map(|(k, v)| {
            let t: i64 = k
                .extract()
                .map_err(|_| type_error("bias keys must be token ids (int)"))?;
            let t = i32::try_from(t)
                .map_err(|_| PyValueError::new_err(format!("token id {t} is out of range")))?;
            let b: f64 = v
                .extract()
                .map_err(|_| type_error("bias values must be floats"))?;
            Ok((t, b as f32))
        })
        .collect()
}

/// Block (without the GIL) until the engine replies. Signals are checked every 50 ms: on
/// Ctrl-C the job is cancelled — dropped if it has not started, aborted and rolled back if it
/// is a running prefill, else completed — and KeyboardInterrupt is raised.
pub fn wait<T: Send>(py: Python<'_>, pending: Pending<T>) -> PyResult<T> {
    wait_or_discard(py, pending, drop)
}

/// [`wait`], handing a value that Ctrl-C leaves behind (the job completed, nobody receives it)
/// to `discard`.
pub fn wait_or_discard<T: Send>(
    py: Python<'_>,
    pending: Pending<T>,
    discard: impl FnOnce(T),
) -> PyResult<T> {
    let mut pending = pending;
    loop {
        match py.detach(|| pending.wait_timeout(Duration::from_millis(50))) {
            Ok(result) => {
                // A Ctrl-C that came as the reply did would raise KeyboardInterrupt right
                // after this returns, the value lost on the way: hand it to `discard`.
                if let Err(interrupt) = py.check_signals() {
                    if let Ok(value) = result {
                        discard(value);
                    }
                    return Err(interrupt);
                }
                return result.py();
            }
            Err(still) => pending = still,
        }
        if let Err(interrupt) = py.check_signals() {
            if pending.cancel() != Cancel::Prevented {
                if let Ok(value) = py.detach(|| pending.wait()) {
                    discard(value);
                }
            }
            return Err(interrupt);
        }
    }
}

/// An awaitable resolving to the engine's reply, converted by `f` with the GIL; `call` names
/// the Python call it came from (for the never-awaited warning).
pub fn awaitable<'py, T, R>(
    py: Python<'py>,
    call: Call,
    pending: Pending<T>,
    f: impl FnOnce(T) -> PyResult<R> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Send + 'static,
    R: for<'a> IntoPyObject<'a>,
{
    awaitable_py(py, call, pending, move |py, v| f(v)?.into_py_any(py))
}

/// An awaitable resolving to the engine's reply, converted by `f` with the GIL held (for
/// results that are built from Python objects, e.g. numpy arrays).
pub fn awaitable_py<'py, T: Send + 'static>(
    py: Python<'py>,
    call: Call,
    pending: Pending<T>,
    f: impl FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>> {
    let op = Operation::new(call, pending, OnCancel::Settle, f);
    Bound::new(py, op).map(Bound::into_any)
}

/// The conversion of a job that returns nothing: None in Python (for `twins!`).
pub fn none(_: ()) -> PyResult<Option<()>> {
    Ok(None)
}

/// An argument extracted as `T` whose wrong type raises a TypeError naming the argument
/// (`errors::type_error`); pyo3's own extraction of `String`, `bool`, `f32`, paths … would name
/// it only in a note.
pub struct Arg<T>(pub T);

impl<'a, 'py, T> FromPyObject<'a, 'py> for Arg<T>
where
    T: FromPyObject<'a, 'py>,
{
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        T::extract(obj)
            .map(Arg)
            .map_err(|e| naming_argument(obj.py(), e.into()))
    }
}

/// A reply of bytes as a Python `bytes` object made by a thread of its own: only its
/// allocation holds the GIL, the copy runs without it, so the event loop that receives the
/// object copies nothing (a state of tens of MB held the loop ~1 ms per MB). A cancel
/// reaches the job it waits for.
pub fn bytes_off_loop(pending: Pending<Vec<u8>>) -> Pending<Py<PyBytes>> {
    Pending::spawn_relayed("kvfork-bytes", move |relay| {
        let data = relay.wait(pending)?;
        new_bytes(&data)
    })
}

/// A `bytes` object holding `data`, from a thread without the GIL.
fn new_bytes(data: &[u8]) -> kvfork::Result<Py<PyBytes>> {
    struct Unfilled(Py<PyBytes>, *mut u8);
    // SAFETY: the buffer of a new object no other code has seen yet (filled below).
    unsafe impl Send for Unfilled {}
    let unfilled = Python::try_attach(|py| -> PyResult<Unfilled> {
        let len = isize::try_from(data.len())
            .map_err(|_| pyo3::exceptions::PyMemoryError::new_err("too large"))?;
        // SAFETY: a NULL source makes an uninitialised object of `len` bytes (CPython's API).
        let raw = unsafe { pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
        // SAFETY: `raw` is a new reference, or NULL with an exception set.
        let object = unsafe { Bound::from_owned_ptr_or_err(py, raw)? }.cast_into::<PyBytes>()?;
        // SAFETY: a bytes object's buffer, `len` bytes long.
        let buffer = unsafe { pyo3::ffi::PyBytes_AsString(object.as_ptr()) }.cast::<u8>();
        Ok(Unfilled(object.unbind(), buffer))
    })
    .ok_or(kvfork::Error::Closed)?
    .map_err(|e| kvfork::Error::Other(format!("could not make the bytes: {e}")))?;
    // SAFETY: `len` writable bytes at the buffer, which no other thread can reach yet (the
    // object is referenced only here), so the copy needs no GIL.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), unfilled.1, data.len()) };
    Ok(unfilled.0)
}

/// Snapshot bytes for the engine (`restore`): a `bytes` object is read in place on the engine
/// thread (immutable, and kept alive by the reference held here): no copy on the calling
/// thread, which may be the event loop (~1 ms per MB). Other buffers (`bytearray`) may change
/// meanwhile, so they are copied.
pub enum StateBytes {
    Shared {
        _owner: Py<PyBytes>,
        ptr: *const u8,
        len: usize,
    },
    Owned(Vec<u8>),
}

// SAFETY: `ptr` points into the immutable buffer of the `bytes` object `_owner` keeps alive;
// reading it needs no GIL, and the reference is released through pyo3's pool when dropped
// without the GIL.
unsafe impl Send for StateBytes {}

impl AsRef<[u8]> for StateBytes {
    fn as_ref(&self) -> &[u8] {
        match self {
            // SAFETY: see `Send` above: `len` bytes at `ptr`, alive and unchanging while
            // `self` is.
            StateBytes::Shared { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(*ptr, *len)
            },
            StateBytes::Owned(v) => v,
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for StateBytes {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            let data = bytes.as_bytes();
            return Ok(StateBytes::Shared {
                ptr: data.as_ptr(),
                len: data.len(),
                _owner: bytes.to_owned().unbind(),
            });
        }
        let data: std::borrow::Cow<'_, [u8]> = obj.extract()?;
        Ok(StateBytes::Owned(data.into_owned()))
    }
}

/// An int argument of any size: an int or anything with `__index__` (a NumPy integer), as
/// `operator.index` takes; anything else is a TypeError naming the argument. An int beyond
/// i64 is kept as `None` so range checks can name the argument.
pub struct Int(pub Option<i64>);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyInt>() {
            return Ok(Int(obj.extract::<i64>().ok()));
        }
        // SAFETY: `obj` is a live object; PyNumber_Index returns a new reference or NULL with
        // an exception set, which `from_owned_ptr_or_err` takes.
        let index = unsafe {
            Bound::from_owned_ptr_or_err(obj.py(), pyo3::ffi::PyNumber_Index(obj.as_ptr()))
        };
        match index {
            Ok(int) => Ok(Int(int.extract::<i64>().ok())),
            Err(_) => Err(type_error(format!(
                "expected an int, got {}",
                obj.get_type().name()?
            ))),
        }
    }
}

impl Int {
    /// The value if it lies in [lo, hi], else a ValueError naming the argument.
    pub fn within(&self, name: &str, lo: i64, hi: i64) -> PyResult<i64> {
        match self.0 {
            Some(v) if (lo..=hi).contains(&v) => Ok(v),
            Some(v) => Err(PyValueError::new_err(format!(
                "{name} must be in [{lo}, {hi}], got {v}"
            ))),
            None => Err(PyValueError::new_err(format!(
                "{name} must be in [{lo}, {hi}], got an int outside the 64-bit range"
            ))),
        }
    }

    /// The value within `range`, as its type (a ValueError naming `name` and the range).
    pub fn in_range<T>(&self, name: &str, range: std::ops::RangeInclusive<T>) -> PyResult<T>
    where
        T: Copy + Into<i64> + TryFrom<i64>,
    {
        let v = self.within(name, (*range.start()).into(), (*range.end()).into())?;
        Ok(T::try_from(v).unwrap_or_else(|_| unreachable!("within the range")))
    }

    pub fn u32(&self, name: &str, lo: u32) -> PyResult<u32> {
        self.in_range(name, lo..=u32::MAX)
    }

    pub fn i32(&self, name: &str, lo: i32) -> PyResult<i32> {
        self.in_range(name, lo..=i32::MAX)
    }
}

/// A token id argument taken as any int (`Int`): out of the engine's token type's range, even
/// past 64 bits, a ValueError naming it (the vocabulary check is the engine's).
pub(crate) fn token_int(token: &Int) -> PyResult<i32> {
    match token.0 {
        Some(v) => i32::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("token: token id {v} is out of range"))),
        None => Err(PyValueError::new_err(
            "token: token id is out of range (an int past 64 bits)",
        )),
    }
}

/// A guess of draft tokens, each in range of the engine's token type (a ValueError naming
/// `draft` otherwise, even past 64 bits).
pub(crate) fn draft_tokens(draft: &[Int]) -> PyResult<Vec<kvfork::Token>> {
    draft
        .iter()
        .map(|t| {
            t.0.and_then(|v| kvfork::Token::try_from(v).ok())
                .ok_or_else(|| match t.0 {
                    Some(v) => {
                        PyValueError::new_err(format!("draft: token id {v} is out of range"))
                    }
                    None => PyValueError::new_err(
                        "draft: a token id is out of range (an int past 64 bits)",
                    ),
                })
        })
        .collect()
}

/// The `on_context_full` and `keep` arguments as the engine's choice (not yet checked
/// against a context).
pub(crate) fn on_full_arg(name: &str, keep: Int) -> PyResult<kvfork::OnContextFull> {
    let keep = keep.within("keep", 0, i64::from(i32::MAX))? as usize;
    kvfork::OnContextFull::from_name(name, keep).ok_or_else(|| {
        PyValueError::new_err(format!(
            "on_context_full must be \"stop\" or \"shift\", not {name:?}"
        ))
    })
}

/// `value` as Python's `repr` writes it (a repr that reads back), with Python's escapes, not
/// Rust's `{:?}` ones (`\\u{7f}` is no Python).
pub fn py_repr<'py>(py: Python<'py>, value: impl IntoPyObject<'py>) -> PyResult<String> {
    Ok(value.into_bound_py_any(py)?.repr()?.to_string())
}
