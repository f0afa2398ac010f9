//! An owned `llama_sampler` pointer: freed on drop, deep-copied with `llama_sampler_clone`.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

pub(crate) struct RawSampler(NonNull<sys::llama_sampler>);

// SAFETY: a llama_sampler is plain state with no thread affinity; kvfork guards every
// sampler behind its branch's mutex, so it is never used from two threads at once.
unsafe impl Send for RawSampler {}

impl RawSampler {
    /// Take ownership of a sampler returned by a `llama_sampler_init_*` call (None if NULL).
    pub fn from_raw(ptr: *mut sys::llama_sampler) -> Option<Self> {
        NonNull::new(ptr).map(RawSampler)
    }

    pub fn as_ptr(&self) -> *mut sys::llama_sampler {
        self.0.as_ptr()
    }

    pub fn apply(&mut self, cur: &mut sys::llama_token_data_array) {
        unsafe { sys::llama_sampler_apply(self.as_ptr(), cur) }
    }

    pub fn accept(&mut self, token: i32) {
        unsafe { sys::llama_sampler_accept(self.as_ptr(), token) }
    }
}

impl Clone for RawSampler {
    fn clone(&self) -> Self {
        let ptr = unsafe { sys::llama_sampler_clone(self.as_ptr()) };
        RawSampler(NonNull::new(ptr).expect("llama_sampler_clone returned NULL"))
    }
}

impl Drop for RawSampler {
    fn drop(&mut self) {
        unsafe { sys::llama_sampler_free(self.as_ptr()) }
    }
}
