//! Structural checks of a GGUF file before llama.cpp loads it. llama.cpp validates sizes and
//! counts itself (a truncated or random file is refused), but trusts some values of a file
//! that parses, and aborts the process on them — at load or at the first decode:
//! a layer count outside 1..=512, duplicate vocabulary strings, a negative or NaN norm
//! epsilon, a norm weight that is not f32. Those are refused here.

use std::collections::HashSet;
use std::ffi::{c_char, CStr, CString};
use std::path::Path;

use llama_cpp_sys_2 as sys;

/// llama.cpp's `LLAMA_MAX_LAYERS`.
const MAX_LAYERS: u32 = 512;

/// An open `gguf_context` (metadata only, no tensor data).
struct Gguf(*mut sys::gguf_context);

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: a context returned by gguf_init_from_file, freed once.
        unsafe { sys::gguf_free(self.0) }
    }
}

impl Gguf {
    fn open(path: &Path) -> Option<Gguf> {
        let c_path = CString::new(path.to_string_lossy().as_bytes()).ok()?;
        let params = sys::gguf_init_params {
            no_alloc: true,
            ctx: std::ptr::null_mut(),
        };
        // SAFETY: a valid C string; llama.cpp returns NULL for anything it cannot parse.
        let ctx = unsafe { sys::gguf_init_from_file(c_path.as_ptr(), params) };
        (!ctx.is_null()).then_some(Gguf(ctx))
    }

    /// The key's id and type (every typed getter asserts on the type: check it first).
    fn key(&self, name: &str) -> Option<(i64, sys::gguf_type)> {
        let name = CString::new(name).ok()?;
        // SAFETY: live context, valid C string.
        let id = unsafe { sys::gguf_find_key(self.0, name.as_ptr()) };
        // SAFETY: `id` was just found.
        (id >= 0).then(|| (id, unsafe { sys::gguf_get_kv_type(self.0, id) }))
    }

    fn string(&self, name: &str) -> Option<String> {
        match self.key(name)? {
            // SAFETY: the type is checked; the string lives as long as the context.
            (id, sys::GGUF_TYPE_STRING) => {
                Some(c_str(unsafe { sys::gguf_get_val_str(self.0, id) }))
            }
            _ => None,
        }
    }

    fn integer(&self, name: &str) -> Option<i64> {
        let (id, ty) = self.key(name)?;
        // SAFETY: each getter is called for its own type only.
        unsafe {
            Some(match ty {
                sys::GGUF_TYPE_UINT32 => sys::gguf_get_val_u32(self.0, id) as i64,
                sys::GGUF_TYPE_INT32 => sys::gguf_get_val_i32(self.0, id) as i64,
                sys::GGUF_TYPE_UINT64 => sys::gguf_get_val_u64(self.0, id) as i64,
                sys::GGUF_TYPE_INT64 => sys::gguf_get_val_i64(self.0, id),
                sys::GGUF_TYPE_UINT16 => sys::gguf_get_val_u16(self.0, id) as i64,
                sys::GGUF_TYPE_UINT8 => sys::gguf_get_val_u8(self.0, id) as i64,
                _ => return None,
            })
        }
    }

    fn float(&self, name: &str) -> Option<f64> {
        let (id, ty) = self.key(name)?;
        // SAFETY: each getter is called for its own type only.
        unsafe {
            Some(match ty {
                sys::GGUF_TYPE_FLOAT32 => sys::gguf_get_val_f32(self.0, id) as f64,
                sys::GGUF_TYPE_FLOAT64 => sys::gguf_get_val_f64(self.0, id),
                _ => return None,
            })
        }
    }

    /// The strings of an array-of-strings key.
    fn strings(&self, name: &str) -> Option<Vec<&[u8]>> {
        let (id, ty) = self.key(name)?;
        // SAFETY: the key is an array of strings (checked); indices are below its length.
        unsafe {
            if ty != sys::GGUF_TYPE_ARRAY
                || sys::gguf_get_arr_type(self.0, id) != sys::GGUF_TYPE_STRING
            {
                return None;
            }
            let n = sys::gguf_get_arr_n(self.0, id);
            Some(
                (0..n)
                    .map(|i| CStr::from_ptr(sys::gguf_get_arr_str(self.0, id, i)).to_bytes())
                    .collect(),
            )
        }
    }

    fn tensors(&self) -> impl Iterator<Item = (String, sys::ggml_type)> + '_ {
        // SAFETY: indices below the tensor count of a live context.
        let n = unsafe { sys::gguf_get_n_tensors(self.0) };
        (0..n).map(move |i| unsafe {
            (
                c_str(sys::gguf_get_tensor_name(self.0, i)),
                sys::gguf_get_tensor_type(self.0, i),
            )
        })
    }
}

fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string owned by the gguf context.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `Err(reason)` when llama.cpp would abort on this file; `Ok` also when it would refuse it
/// cleanly (it says why itself).
pub(crate) fn check(path: &Path) -> Result<(), String> {
    let Some(g) = Gguf::open(path) else {
        return Ok(());
    };
    let arch = g.string("general.architecture").unwrap_or_default();
    if let Some(n) = g.integer(&format!("{arch}.block_count")) {
        if !(1..=MAX_LAYERS as i64).contains(&n) {
            return Err(format!(
                "{arch}.block_count = {n} is not in [1, {MAX_LAYERS}]"
            ));
        }
    }
    for key in ["layer_norm_rms_epsilon", "layer_norm_epsilon"] {
        let name = format!("{arch}.attention.{key}");
        if let Some(eps) = g.float(&name) {
            if !(eps.is_finite() && eps >= 0.0) {
                return Err(format!("{name} = {eps} must be a finite number >= 0"));
            }
        }
    }
    if let Some(tokens) = g.strings("tokenizer.ggml.tokens") {
        let mut seen = HashSet::with_capacity(tokens.len());
        if let Some(dup) = tokens.iter().find(|t| !seen.insert(**t)) {
            return Err(format!(
                "the vocabulary holds {:?} twice",
                String::from_utf8_lossy(dup)
            ));
        }
    }
    for (name, ty) in g.tensors() {
        if name.ends_with("norm.weight") && ty != sys::GGML_TYPE_F32 {
            return Err(format!(
                "tensor {name} has type {ty}, norm weights must be f32"
            ));
        }
    }
    Ok(())
}
