//! Handing freed heap pages back to the OS at the few points where a large buffer is gone for good.
//!
//! The binaries tell glibc to serve large buffers from the heap and never trim it, so every epoch reuses the
//! previous epoch's pages instead of faulting them in again. The price is that a buffer freed for good (the
//! input features once `A X` is cached) stays resident as a hole the next, larger buffer does not fit in:
//! the hole and the buffer placed above it are both counted in the peak. Trimming right after such a free
//! returns the hole's pages; later allocations that land in it fault them back in as they are written.

/// Returns the heap's free pages to the OS (glibc's `malloc_trim`, which also releases whole free pages in
/// the middle of the heap). A no-op where the allocator is not glibc's.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only returns free heap pages to the OS; it touches no live allocation.
        unsafe {
            malloc_trim(0);
        }
    }
}
