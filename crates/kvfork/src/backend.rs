//! Process-wide llama.cpp state: backend initialisation, the log bridge and system info.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};

/// Severity of a llama.cpp log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Verbose diagnostics.
    Debug = 1,
    /// Progress and settings (model load, context creation).
    Info = 2,
    /// Something odd that did not fail (the default minimum).
    Warn = 3,
    /// A failure llama.cpp reports.
    Error = 4,
}

type LogSink = Box<dyn Fn(LogLevel, &str) + Send + Sync>;

static BACKEND: OnceLock<std::result::Result<LlamaBackend, String>> = OnceLock::new();
static LOG_SINK: RwLock<Option<LogSink>> = RwLock::new(None);
/// Lines below this level are dropped before they reach the sink (quiet by default).
static LOG_MIN_LEVEL: AtomicI32 = AtomicI32::new(LogLevel::Warn as i32);
/// llama.cpp sends lines in pieces (CONT); they are joined here until the newline.
static LOG_PENDING: Mutex<(i32, String)> = Mutex::new((0, String::new()));

std::thread_local! {
    /// What llama.cpp logs on this thread during [`logged_during`], if it is running.
    static CAPTURED: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// `f()`, with what llama.cpp logged on this thread meanwhile (every level): the reason a
/// call that only returns a failure failed.
pub(crate) fn logged_during<R>(f: impl FnOnce() -> R) -> (R, String) {
    let outer = CAPTURED.with(|c| c.borrow_mut().replace(String::new()));
    let result = f();
    let logged = CAPTURED.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    (result, logged.unwrap_or_default())
}

/// Route llama.cpp's log to `sink` (replacing any previous sink).
pub fn set_log_sink(sink: impl Fn(LogLevel, &str) + Send + Sync + 'static) {
    *LOG_SINK.write().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(sink));
}

/// Lowest level forwarded to the sink.
pub fn set_log_min_level(level: LogLevel) {
    LOG_MIN_LEVEL.store(level as i32, Ordering::Relaxed);
}

/// llama.cpp's log callback.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string valid for the call (as llama.cpp passes it).
unsafe extern "C" fn log_callback(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: not NULL, so a NUL-terminated string llama.cpp keeps alive for the call; it is
    // copied out before the callback returns.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    CAPTURED.with(|c| {
        if let Some(log) = c.borrow_mut().as_mut() {
            log.push_str(&text);
        }
    });
    let mut pending = LOG_PENDING.lock().unwrap_or_else(|e| e.into_inner());
    if level != sys::GGML_LOG_LEVEL_CONT {
        pending.0 = level as i32;
    }
    pending.1.push_str(&text);
    if !pending.1.ends_with('\n') {
        return;
    }
    let line = std::mem::take(&mut pending.1);
    let level = match pending.0 {
        1 => LogLevel::Debug,
        2 => LogLevel::Info,
        3 => LogLevel::Warn,
        _ => LogLevel::Error,
    };
    drop(pending);
    if (level as i32) < LOG_MIN_LEVEL.load(Ordering::Relaxed) {
        return;
    }
    if let Some(sink) = LOG_SINK.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        sink(level, line.trim_end());
    }
}

// The variant table is used by `dynamic-backends` builds only; its tests run in every build.
#[cfg_attr(not(feature = "dynamic-backends"), allow(dead_code))]
mod cpu_variant;
#[cfg(feature = "dynamic-backends")]
mod modules;

/// Sets the directories searched for ggml's backend modules (`libggml-cpu-*.so`,
/// `libggml-cuda.so`, ...), in order. Builds with `dynamic-backends` only load modules; in
/// others this does nothing. Takes effect only before the first model load or `system_info`.
pub fn set_module_dirs(dirs: Vec<std::path::PathBuf>) {
    #[cfg(feature = "dynamic-backends")]
    modules::set_module_dirs(dirs);
    #[cfg(not(feature = "dynamic-backends"))]
    drop(dirs);
}

/// What `ensure_backend` loaded: the ggml modules of a `dynamic-backends` build.
#[cfg(feature = "dynamic-backends")]
static LOADED: OnceLock<modules::Loaded> = OnceLock::new();

/// Initialise llama.cpp once per process. Fails (instead of crashing with SIGILL later)
/// when the CPU lacks an instruction set the library was compiled for, or (`dynamic-backends`)
/// when no CPU variant of ggml runs on it.
pub fn ensure_backend() -> Result<()> {
    let state = BACKEND.get_or_init(|| {
        // SAFETY: `log_callback` has ggml's log-callback signature, reads no user data (NULL)
        // and only touches Rust statics that are locks or atomics, so any thread may call it.
        // Set once (this `OnceLock`), before kvfork creates anything in llama.cpp that logs.
        unsafe { sys::llama_log_set(Some(log_callback), std::ptr::null_mut()) };
        #[cfg(feature = "dynamic-backends")]
        {
            let loaded = modules::load_all()?;
            let _ = LOADED.set(loaded);
        }
        let missing = missing_cpu_features();
        if !missing.is_empty() {
            return Err(format!(
                "kvfork's llama.cpp was built for CPU features this machine lacks ({}); \
                 rebuild kvfork on this machine (see README, 'CPU features')",
                missing.join(", ")
            ));
        }
        LlamaBackend::init().map_err(|e| e.to_string())
    });
    state
        .as_ref()
        .map(|_| ())
        .map_err(|e| Error::Other(e.clone()))
}

/// Whether llama.cpp's CPU code was compiled with each of `names` (ggml's feature names).
/// Statically linked: ggml's `ggml_cpu_has_*` getters.
#[cfg(all(target_arch = "x86_64", not(feature = "dynamic-backends")))]
fn compiled_cpu_features() -> [bool; 11] {
    // SAFETY: ggml's feature getters take no arguments and return constants compiled into
    // the library; they read no state.
    unsafe {
        [
            sys::ggml_cpu_has_avx() != 0,
            sys::ggml_cpu_has_avx2() != 0,
            sys::ggml_cpu_has_fma() != 0,
            sys::ggml_cpu_has_f16c() != 0,
            sys::ggml_cpu_has_bmi2() != 0,
            sys::ggml_cpu_has_avx512() != 0,
            sys::ggml_cpu_has_avx512_vnni() != 0,
            sys::ggml_cpu_has_avx512_vbmi() != 0,
            sys::ggml_cpu_has_avx512_bf16() != 0,
            sys::ggml_cpu_has_avx_vnni() != 0,
            sys::ggml_cpu_has_amx_int8() != 0,
        ]
    }
}

/// Loaded at run time: the getters live in the CPU module, which reports what it was compiled
/// with through `ggml_backend_get_features` (nothing before the module is loaded).
#[cfg(all(target_arch = "x86_64", feature = "dynamic-backends"))]
fn compiled_cpu_features() -> [bool; 11] {
    let have = modules::cpu_features();
    FEATURE_NAMES.map(|name| have.iter().any(|h| h == name))
}

/// ggml's names of the features `compiled_cpu_features` reports, in its order.
#[cfg(target_arch = "x86_64")]
const FEATURE_NAMES: [&str; 11] = [
    "AVX",
    "AVX2",
    "FMA",
    "F16C",
    "BMI2",
    "AVX512",
    "AVX512_VNNI",
    "AVX512_VBMI",
    "AVX512_BF16",
    "AVX_VNNI",
    "AMX_INT8",
];

/// (name, compiled into ggml, reported by the host)
#[cfg(target_arch = "x86_64")]
fn compiled_x86_features() -> Vec<(&'static str, bool, bool)> {
    use std::arch::is_x86_feature_detected as has;
    let host = [
        has!("avx"),
        has!("avx2"),
        has!("fma"),
        has!("f16c"),
        has!("bmi2"),
        has!("avx512f"),
        has!("avx512vnni"),
        has!("avx512vbmi"),
        has!("avx512bf16"),
        has!("avxvnni"),
        // AMX counts as missing: it is never compiled in or loaded on purpose (VM crashes).
        false,
    ];
    let compiled = compiled_cpu_features();
    FEATURE_NAMES
        .iter()
        .zip(compiled.iter().zip(host.iter()))
        .map(|(&name, (&c, &h))| (name, c, h))
        .collect()
}

#[cfg(not(target_arch = "x86_64"))]
fn compiled_x86_features() -> Vec<(&'static str, bool, bool)> {
    Vec::new()
}

/// Features compiled into llama.cpp that the host CPU does not report.
/// AMX is always "missing": it is never compiled in on purpose (it crashes on these VMs).
fn missing_cpu_features() -> Vec<&'static str> {
    compiled_x86_features()
        .into_iter()
        .filter(|(_, compiled, host)| *compiled && !*host)
        .map(|(name, _, _)| name)
        .collect()
}

/// The llama.cpp source vendored by the pinned `llama-cpp-sys-2`.
pub const LLAMA_CPP_CRATE: &str = "llama-cpp-sys-2 0.1.161 / llama-cpp-2 0.1.160";

/// Which compute backend this build uses: with `dynamic-backends`, the first GPU module that
/// loaded with a device, else `cpu` (valid once the backend is initialised).
pub fn backend_name() -> &'static str {
    #[cfg(feature = "dynamic-backends")]
    if let Some(loaded) = LOADED.get() {
        return loaded.gpu.unwrap_or("cpu");
    }
    if cfg!(feature = "cuda") {
        "cuda"
    } else if cfg!(feature = "metal") {
        "metal"
    } else if cfg!(feature = "vulkan") {
        "vulkan"
    } else {
        "cpu"
    }
}

/// A description of the build and the machine, for `kvfork.system_info()`.
#[derive(Debug, Clone)]
pub struct SystemInfo {
    /// The compute backend built in: `cpu`, `cuda`, `metal` or `vulkan`.
    pub backend: &'static str,
    /// CPU instruction sets compiled into llama.cpp (what it uses).
    pub cpu_features: Vec<&'static str>,
    /// CPU instruction sets the host reports (of those llama.cpp could use).
    pub host_cpu_features: Vec<&'static str>,
    /// The llama.cpp crates (and so the llama.cpp source) built in.
    pub llama_cpp: &'static str,
    /// llama.cpp's own `llama_print_system_info()` line.
    pub llama_system_info: String,
    /// Whether layers can be offloaded to a GPU.
    pub gpu_offload: bool,
    /// Whether model files can be memory-mapped.
    pub mmap: bool,
    /// The CPU code in use: a ggml CPU variant loaded at run time (`haswell`, `zen4`, ...)
    /// or `built-in` (llama.cpp compiled for one instruction-set level, linked statically).
    pub cpu_variant: &'static str,
    /// Why that CPU code.
    pub cpu_variant_reason: String,
    /// The compute backends found, one line each (`cpu: zen4 (...)`, `cuda: 1 device(s)`).
    pub backends: Vec<String>,
}

/// Report the backend and CPU features in use.
pub fn system_info() -> Result<SystemInfo> {
    ensure_backend()?;
    let features = compiled_x86_features();
    // SAFETY: the backend is initialised; these getters read what was compiled in.
    let (gpu_offload, mmap) = unsafe {
        (
            sys::llama_supports_gpu_offload(),
            sys::llama_supports_mmap(),
        )
    };
    #[cfg(feature = "dynamic-backends")]
    let (cpu_variant, cpu_variant_reason, backends) = match LOADED.get() {
        Some(l) => (l.cpu_variant, l.cpu_reason.clone(), l.backends.clone()),
        None => ("none", "no CPU module loaded".to_string(), Vec::new()),
    };
    #[cfg(not(feature = "dynamic-backends"))]
    let (cpu_variant, cpu_variant_reason, backends) = (
        "built-in",
        "llama.cpp compiled for the instruction sets of the build machine's flags \
         (scripts/cpu_flags.sh, or .cargo/config.toml's x86-64-v3 defaults) and linked in"
            .to_string(),
        vec![format!("{} (linked in)", backend_name())],
    );
    Ok(SystemInfo {
        cpu_variant,
        cpu_variant_reason,
        backends,
        backend: backend_name(),
        cpu_features: features.iter().filter(|f| f.1).map(|f| f.0).collect(),
        host_cpu_features: features.iter().filter(|f| f.2).map(|f| f.0).collect(),
        llama_cpp: LLAMA_CPP_CRATE,
        llama_system_info: llama_system_info().to_string(),
        gpu_offload,
        mmap,
    })
}

/// llama.cpp's `llama_print_system_info()` line, read once per process: llama.cpp builds it
/// in a function-local static `std::string` that every call clears and refills, so two
/// threads calling it at once would race on it (and on the pointer it returns).
fn llama_system_info() -> &'static str {
    static INFO: OnceLock<String> = OnceLock::new();
    INFO.get_or_init(|| {
        // SAFETY: the backend is initialised (by every caller, through `ensure_backend`);
        // `OnceLock` runs this once, so no other kvfork call refills llama.cpp's static string
        // while it is read, and it is copied out at once.
        let raw = unsafe { CStr::from_ptr(sys::llama_print_system_info()) };
        raw.to_string_lossy().trim().to_string()
    })
}

impl SystemInfo {
    /// Flat string map (for bindings).
    pub fn to_map(&self) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("backend", self.backend.to_string()),
            ("cpu_variant", self.cpu_variant.to_string()),
            ("cpu_variant_reason", self.cpu_variant_reason.clone()),
            ("backends", self.backends.join("; ")),
            ("cpu_features", self.cpu_features.join(",")),
            ("host_cpu_features", self.host_cpu_features.join(",")),
            ("llama_cpp", self.llama_cpp.to_string()),
            ("llama_system_info", self.llama_system_info.clone()),
        ])
    }
}
