//! An owned `llama_sampler` pointer: freed on drop, deep-copied with `llama_sampler_clone`.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

/// Invariant: the pointer is a live sampler that this value alone owns.
pub(crate) struct RawSampler(NonNull<sys::llama_sampler>);

// SAFETY: a llama_sampler is heap state with no thread affinity (no thread-locals, no
// callbacks); a grammar sampler also points to its model's vocabulary, which is only read and
// is `Sync` (see `Model`). `RawSampler` is not `Sync` and mutates only through `&mut self`, so
// moving it between threads never lets two use it at once (branches keep theirs behind a mutex).
unsafe impl Send for RawSampler {}

impl RawSampler {
    /// Take ownership of a sampler returned by a `llama_sampler_init_*` call (None if NULL).
    ///
    /// # Safety
    /// `ptr` is NULL or a live sampler that nothing else frees or keeps using.
    pub unsafe fn from_raw(ptr: *mut sys::llama_sampler) -> Option<Self> {
        NonNull::new(ptr).map(RawSampler)
    }

    pub fn as_ptr(&self) -> *mut sys::llama_sampler {
        self.0.as_ptr()
    }

    /// Run the sampler over `cur`, which must describe `size` initialised entries of a
    /// buffer borrowed for the call: kvfork builds every such array from a live slice
    /// (`Candidates::array`, `Grammar::apply`) right before the call.
    pub fn apply(&mut self, cur: &mut sys::llama_token_data_array) {
        // SAFETY: the sampler is live and owned (type invariant); `cur` meets the contract
        // above, and llama.cpp's samplers write only inside it, at most shrinking `size` or
        // moving `data` forward within the buffer.
        unsafe { sys::llama_sampler_apply(self.as_ptr(), cur) }
    }

    /// Feed an accepted token to a filter (penalties, DRY, ...). Grammar samplers take tokens
    /// through `llama_rs_sampler_accept` instead: llama.cpp throws on a refused one.
    pub fn accept(&mut self, token: i32) {
        // SAFETY: the sampler is live and owned; the filters kvfork builds take any token
        // value (they count it or keep it in a ring buffer) and throw nothing.
        unsafe { sys::llama_sampler_accept(self.as_ptr(), token) }
    }
}

impl Clone for RawSampler {
    fn clone(&self) -> Self {
        // SAFETY: `self` is a live sampler; the clone is a deep copy (a chain's members, a
        // grammar's parse stacks) that the new value alone owns.
        let ptr = unsafe { sys::llama_sampler_clone(self.as_ptr()) };
        RawSampler(NonNull::new(ptr).expect("llama_sampler_clone returned NULL"))
    }
}

impl Drop for RawSampler {
    fn drop(&mut self) {
        // SAFETY: the sampler is owned by this value alone and freed here only, once (a chain
        // frees its members). Freeing reads no vocabulary, so a grammar may outlive its model.
        unsafe { sys::llama_sampler_free(self.as_ptr()) }
    }
}
