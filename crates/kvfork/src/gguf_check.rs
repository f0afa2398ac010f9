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

/// An open `gguf_context` (metadata only, no tensor data). Invariant: the pointer is a live,
/// non-NULL context from `gguf_init_from_file`, owned by this value (freed in `Drop`).
pub(crate) struct Gguf(*mut sys::gguf_context);

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: the context `open` got from `gguf_init_from_file`; freed here only, once.
        unsafe { sys::gguf_free(self.0) }
    }
}

impl Gguf {
    pub(crate) fn open(path: &Path) -> Option<Gguf> {
        let c_path = CString::new(path.to_string_lossy().as_bytes()).ok()?;
        let params = sys::gguf_init_params {
            no_alloc: true,
            ctx: std::ptr::null_mut(),
        };
        // SAFETY: `c_path` is NUL-terminated and alive for the call; with `no_alloc` and no
        // `ctx` out-pointer ggml reads metadata only, and returns NULL for a file it cannot
        // parse (sizes and counts are checked against the file).
        let ctx = unsafe { sys::gguf_init_from_file(c_path.as_ptr(), params) };
        (!ctx.is_null()).then_some(Gguf(ctx))
    }

    /// The key's id and type (every typed getter asserts on the type: check it first).
    fn key(&self, name: &str) -> Option<(i64, sys::gguf_type)> {
        let name = CString::new(name).ok()?;
        // SAFETY: a live context (type invariant); `name` is NUL-terminated, alive for the call.
        let id = unsafe { sys::gguf_find_key(self.0, name.as_ptr()) };
        // SAFETY: `id` >= 0 was returned by `gguf_find_key`, so it indexes a key (ggml asserts
        // on ids outside [0, n_kv)).
        (id >= 0).then(|| (id, unsafe { sys::gguf_get_kv_type(self.0, id) }))
    }

    pub(crate) fn string(&self, name: &str) -> Option<String> {
        match self.key(name)? {
            (id, sys::GGUF_TYPE_STRING) => {
                // SAFETY: `id` is a key of type string (matched: ggml asserts on a getter of
                // another type); the string lives as long as the context; `c_str` copies it.
                Some(unsafe { c_str(sys::gguf_get_val_str(self.0, id)) })
            }
            _ => None,
        }
    }

    fn integer(&self, name: &str) -> Option<i64> {
        let (id, ty) = self.key(name)?;
        // SAFETY: `id` is a found key, and each getter runs only for the type `key` reported
        // (ggml asserts on a mismatch).
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
        // SAFETY: `id` is a found key, and each getter runs only for the type `key` reported
        // (ggml asserts on a mismatch).
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
        // SAFETY: `id` is a found key; the array getters run only once it is known to be an
        // array of strings, and only for indices below its length (ggml asserts otherwise).
        // Each string is NUL-terminated and owned by the context, which the returned slices
        // borrow through `&self`, so they cannot outlive `gguf_free`.
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

    /// Each tensor's name, type and first two dimensions.
    pub(crate) fn tensors_with_shape(
        &self,
    ) -> impl Iterator<Item = (String, sys::ggml_type, [i64; 2])> + '_ {
        self.tensors().enumerate().map(|(i, (name, ty))| {
            // SAFETY: `i` is below the tensor count of the live context; the returned array
            // holds GGML_MAX_DIMS (4) dimensions and lives as long as the context.
            let ne =
                unsafe { std::slice::from_raw_parts(sys::gguf_get_tensor_ne(self.0, i as i64), 4) };
            (name, ty, [ne[0], ne[1]])
        })
    }

    /// Where tensor `i`'s data starts in the file (None past the addressable).
    pub(crate) fn tensor_data_offset(&self, i: usize) -> Option<usize> {
        // SAFETY: getters of the live context; `i` is below its tensor count (callers take
        // it from `tensors_with_shape`).
        let (base, offset) = unsafe {
            (
                sys::gguf_get_data_offset(self.0),
                sys::gguf_get_tensor_offset(self.0, i as i64),
            )
        };
        base.checked_add(offset)
    }

    /// The first tensor whose data does not fit in a file of `len` bytes.
    pub(crate) fn tensor_past_end(&self, len: usize) -> Option<String> {
        self.tensors().enumerate().find_map(|(i, (name, _))| {
            // SAFETY: `i` is below the tensor count of the live context.
            let size = unsafe { sys::gguf_get_tensor_size(self.0, i as i64) };
            let end = self.tensor_data_offset(i).and_then(|o| o.checked_add(size));
            end.is_none_or(|end| end > len).then_some(name)
        })
    }

    /// The type of the weights that make the logits: `output.weight`, or the token
    /// embeddings of a model that ties them (None when the file has neither).
    pub(crate) fn output_weight_type(&self) -> Option<sys::ggml_type> {
        let mut tied = None;
        for (name, ty) in self.tensors() {
            match name.as_str() {
                "output.weight" => return Some(ty),
                "token_embd.weight" => tied = Some(ty),
                _ => {}
            }
        }
        tied
    }

    fn tensors(&self) -> impl Iterator<Item = (String, sys::ggml_type)> + '_ {
        // SAFETY: a getter of the live context.
        let n = unsafe { sys::gguf_get_n_tensors(self.0) };
        // SAFETY: `i` is below the tensor count of the live context (borrowed for as long as
        // the iterator); `c_str` copies the name at once.
        (0..n).map(move |i| unsafe {
            (
                c_str(sys::gguf_get_tensor_name(self.0, i)),
                sys::gguf_get_tensor_type(self.0, i),
            )
        })
    }
}

/// A copy of a string a gguf getter returned.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that stays alive for the call.
unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: not NULL, so a live NUL-terminated string (the caller's contract).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `Err(reason)` when llama.cpp would abort on the file `g` read; `Ok` also when it would
/// refuse it cleanly (it says why itself).
pub(crate) fn check(g: &Gguf) -> Result<(), String> {
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
