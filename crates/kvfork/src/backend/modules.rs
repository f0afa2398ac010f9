//! Loading ggml's backend modules (builds with `dynamic-backends`: the release wheel).
//!
//! The wheel ships ggml's CPU variants and, through the `kvfork[cuda]`/`kvfork[vulkan]`
//! companion packages, GPU modules, as `libggml-*.so` files. The Python package names the
//! directories to search (`set_module_dirs`) before the first model loads; a Rust program
//! that names none gets the build's own directory (`llama_cpp_sys_2::BACKENDS_DIR`).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use llama_cpp_sys_2 as sys;

use super::cpu_variant::{self, Isa};

/// Directories searched for `libggml-*.so`, in order (the first holding a module wins).
static MODULE_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The GPU backends kvfork looks for, by ggml's module name (`libggml-<name>.so`).
const GPU_MODULES: &[&str] = &["cuda", "vulkan"];

/// Sets the directories searched for backend modules. Takes effect only before the backend
/// is initialised (the first model load or `system_info`).
pub fn set_module_dirs(dirs: Vec<PathBuf>) {
    *MODULE_DIRS.lock().unwrap_or_else(|e| e.into_inner()) = dirs;
}

fn module_dirs() -> Vec<PathBuf> {
    let dirs = MODULE_DIRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if !dirs.is_empty() {
        return dirs;
    }
    sys::BACKENDS_DIR.map(PathBuf::from).into_iter().collect()
}

/// What was loaded, for `system_info()`.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The CPU variant in use (`haswell`, `zen4`, ...).
    pub cpu_variant: &'static str,
    /// Why that variant.
    pub cpu_reason: String,
    /// One line per backend module found: `"cpu: .../libggml-cpu-zen4.so"`,
    /// `"cuda: 1 device(s)"`, `"vulkan: not loaded (...)"`.
    pub backends: Vec<String>,
    /// The first GPU backend that loaded with at least one device (`cuda`, `vulkan`).
    pub gpu: Option<&'static str>,
}

/// `dir/libggml-<name>.so` in the first directory that has it.
fn find_module(dirs: &[PathBuf], name: &str) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join(format!("libggml-{name}.so")))
        .find(|p| p.is_file())
}

/// Registers the module at `path` with ggml: its registry entry, or `None` when ggml refused
/// it (the reason is in the log: a missing runtime library, a score of 0).
fn load(path: &Path) -> Option<sys::ggml_backend_reg_t> {
    let c_path = CString::new(path.to_string_lossy().as_bytes()).ok()?;
    // SAFETY: `c_path` is NUL-terminated and alive for the call. ggml dlopens the file and
    // calls its score and init entry points; the modules in the wheel are built from the same
    // ggml as the linked libggml (one build), and a CPU variant is only loaded when this CPU
    // has every instruction set it was compiled for (`cpu_variant::choose`).
    let reg = unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
    (!reg.is_null()).then_some(reg)
}

/// Loads the best CPU variant and any GPU module present. Errs (a sentence for the user)
/// when no CPU variant runs here or its module does not load.
pub fn load_all() -> Result<Loaded, String> {
    let dirs = module_dirs();
    let (name, reason, path) = load_cpu(&dirs)?;
    let mut backends = vec![format!("cpu: {name} ({})", path.display())];
    let mut gpu = None;
    for gpu_name in GPU_MODULES {
        let Some(path) = find_module(&dirs, gpu_name) else {
            continue;
        };
        if registered(gpu_name) {
            continue; // loaded with the CPU variants (not x86-64)
        }
        match load(&path) {
            Some(reg) => {
                // SAFETY: `reg` is the registry entry ggml just returned; registered backends
                // live until the process ends.
                let devices = unsafe { sys::ggml_backend_reg_dev_count(reg) };
                if devices > 0 && gpu.is_none() {
                    gpu = Some(*gpu_name);
                }
                backends.push(format!(
                    "{gpu_name}: {devices} device(s) ({})",
                    path.display()
                ));
            }
            None => backends.push(format!(
                "{gpu_name}: not loaded ({}; its runtime or driver is missing, see the kvfork log)",
                path.display()
            )),
        }
    }
    Ok(Loaded {
        cpu_variant: name,
        cpu_reason: reason,
        backends,
        gpu,
    })
}

/// Whether a backend of this name (any case) is registered with ggml already.
fn registered(name: &str) -> bool {
    // SAFETY: the registry's count and entries are valid until the process ends; the names are
    // NUL-terminated strings owned by the registered backends.
    unsafe {
        (0..sys::ggml_backend_reg_count()).any(|i| {
            let reg = sys::ggml_backend_reg_get(i);
            CStr::from_ptr(sys::ggml_backend_reg_name(reg))
                .to_string_lossy()
                .eq_ignore_ascii_case(name)
        })
    }
}

/// x86-64: kvfork's own choice among ggml's variants (never AMX; see `cpu_variant`).
#[cfg(target_arch = "x86_64")]
fn load_cpu(dirs: &[PathBuf]) -> Result<(&'static str, String, PathBuf), String> {
    let available: Vec<&str> = cpu_variant::X86_VARIANTS
        .iter()
        .map(|v| v.name)
        .filter(|name| find_module(dirs, &format!("cpu-{name}")).is_some())
        .collect();
    let forced = std::env::var("KVFORK_CPU_VARIANT").ok();
    let host = |isa: Isa| isa.on_host();
    let forced = forced.as_deref().filter(|s| !s.is_empty());
    let choice = cpu_variant::choose(&available, &host, forced).map_err(|e| {
        let shown: Vec<_> = dirs.iter().map(|d| d.display().to_string()).collect();
        format!("{e} (searched {})", shown.join(", "))
    })?;
    let name = choice.variant.name;
    let path = find_module(dirs, &format!("cpu-{name}"))
        .ok_or_else(|| format!("the module of CPU variant {name} vanished"))?;
    load(&path).ok_or_else(|| {
        format!(
            "llama.cpp's CPU backend {} did not load (see the kvfork log)",
            path.display()
        )
    })?;
    Ok((name, choice.reason, path))
}

/// Elsewhere (ARM, ...) there is no AMX to avoid: ggml's own loader scores the variants of
/// the first directory that has any.
#[cfg(not(target_arch = "x86_64"))]
fn load_cpu(dirs: &[PathBuf]) -> Result<(&'static str, String, PathBuf), String> {
    let has_cpu = |d: &PathBuf| {
        std::fs::read_dir(d).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("libggml-cpu") && n.ends_with(".so")
            })
        })
    };
    let dir = dirs
        .iter()
        .find(|d| has_cpu(d))
        .ok_or_else(|| "no CPU backend module of llama.cpp found".to_string())?;
    let c_dir = CString::new(dir.to_string_lossy().as_bytes())
        .map_err(|_| "the module directory's path holds a NUL byte".to_string())?;
    // SAFETY: `c_dir` is NUL-terminated and alive for the call; ggml loads, from that directory
    // (and GGML_BACKEND_PATH), the best-scoring module of each backend it knows.
    unsafe { sys::ggml_backend_load_all_from_path(c_dir.as_ptr()) };
    Ok((
        "ggml-best",
        "ggml's highest-scoring CPU variant for this CPU".to_string(),
        dir.clone(),
    ))
}

/// The instruction sets the loaded CPU backend was compiled for, from its
/// `ggml_backend_get_features` (the `ggml_cpu_has_*` getters live in the module, not in the
/// libraries kvfork links against).
pub fn cpu_features() -> Vec<String> {
    let name = c"CPU";
    // SAFETY: a NUL-terminated name; ggml returns NULL or a registry entry that lives until the
    // process ends.
    let reg = unsafe { sys::ggml_backend_reg_by_name(name.as_ptr()) };
    if reg.is_null() {
        return Vec::new();
    }
    let proc_name = c"ggml_backend_get_features";
    // SAFETY: `reg` is a live registry entry and the name is NUL-terminated.
    let ptr = unsafe { sys::ggml_backend_reg_get_proc_address(reg, proc_name.as_ptr()) };
    if ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: ggml's CPU backend returns its `ggml_backend_get_features_t` under this name
    // (ggml-cpu.cpp, `ggml_backend_cpu_get_reg_proc_address`), a non-NULL function pointer.
    let get: unsafe extern "C" fn(sys::ggml_backend_reg_t) -> *mut sys::ggml_backend_feature =
        unsafe { std::mem::transmute(ptr) };
    // SAFETY: `reg` is the CPU registry entry the function belongs to; it returns a static
    // array terminated by an entry whose name is NULL.
    let mut feature = unsafe { get(reg) };
    let mut out = Vec::new();
    while !feature.is_null() {
        // SAFETY: `feature` points into that array, before or at its terminator.
        let f = unsafe { &*feature };
        if f.name.is_null() {
            break;
        }
        // SAFETY: the array's names and values are static NUL-terminated strings.
        let (n, v) = unsafe { (CStr::from_ptr(f.name), CStr::from_ptr(f.value)) };
        if v.to_bytes() == b"1" {
            out.push(n.to_string_lossy().into_owned());
        }
        // SAFETY: not the terminator yet, so the next entry is inside the array.
        feature = unsafe { feature.add(1) };
    }
    out
}
