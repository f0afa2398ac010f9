//! One definition, both twins: every engine call has an async method (returning an awaitable)
//! and a blocking `*_sync` twin (waiting without the GIL). [`twins!`] writes both from one
//! body that validates the arguments and builds the engine's `Pending` request, and one
//! conversion of its result. Each invocation is a `#[pymethods]` block of its own (pyo3's
//! `multiple-pymethods`), next to the class's other methods.

/// `twins! { impl Class { ... } }` with items of the form
///
/// ```text
/// /// Docs of the async method.
/// #[sync_doc = "what the blocking twin returns, and what Ctrl-C does"]
/// #[pyo3(signature = (...))]            // optional, shared by both
/// fn name / name_sync(&self, py, arg: Type, ...) -> SyncReturn {
///     /* validate arguments, return a kvfork::Pending<T> */
/// } => |value: T| -> PyResult<SyncReturn> { /* convert */ };
/// ```
///
/// The async method resolves to what the conversion returns; the blocking twin returns it.
/// A unit result converts to `Option<()>` (`None` in Python).
macro_rules! twins {
    (
        impl $class:ty {
            $(
                $(#[doc = $doc:literal])*
                #[sync_doc = $sync_doc:literal]
                $(#[pyo3($($sig:tt)*)])?
                fn $name:ident / $sync:ident (&$slf:ident, $py:ident $(, $arg:ident : $argty:ty)* $(,)?)
                    -> $out:ty
                    $body:block
                    => $convert:expr;
            )+
        }
    ) => {
        #[pyo3::pymethods]
        impl $class {
            $(
                $(#[doc = $doc])*
                $(#[pyo3($($sig)*)])?
                fn $name<'py>(
                    &$slf,
                    $py: pyo3::Python<'py>
                    $(, $arg: $argty)*
                ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>> {
                    let pending = $body;
                    let call = $crate::awaitable::Call(
                        <$class as pyo3::PyClass>::NAME,
                        stringify!($name),
                    );
                    $crate::convert::awaitable($py, call, pending, $convert)
                }

                #[doc = concat!("Blocking twin of `", stringify!($name), "`: ", $sync_doc)]
                $(#[pyo3($($sig)*)])?
                fn $sync(
                    &$slf,
                    $py: pyo3::Python<'_>
                    $(, $arg: $argty)*
                ) -> pyo3::PyResult<$out> {
                    let pending = $body;
                    // A conversion may be plain `Ok` (the value as it is).
                    #[allow(clippy::needless_question_mark)]
                    ($convert)($crate::convert::wait($py, pending)?)
                }
            )+
        }
    };
}

pub(crate) use twins;
