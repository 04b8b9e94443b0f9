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

/// A global allocator that starts every allocation of [`LINE_ALIGNED_BYTES`] or more on a 64-byte cache
/// line, and leaves smaller ones to the system allocator as they are.
///
/// glibc's malloc aligns to 16 bytes, so a matrix's rows usually start mid-line: a gathered row of a
/// width-16 matrix (64 bytes, the width every epoch's SpMM runs at for 16 classes) then spans two lines, and
/// random gathers fetch twice the bytes they use. A binary opts in with
/// `#[global_allocator] static A: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;`
/// (`examples/kernels.rs` measures the difference with `ALIGN64=1`).
pub struct LineAligned;

/// Allocations from this size up are aligned to a cache line by [`LineAligned`].
pub const LINE_ALIGNED_BYTES: usize = 1 << 20;

impl LineAligned {
    /// The layout an allocation is made and freed with: a pure function of the request, so `dealloc` and
    /// `realloc` always see the layout `alloc` used.
    fn layout(l: std::alloc::Layout) -> std::alloc::Layout {
        if l.size() >= LINE_ALIGNED_BYTES && l.align() < 64 {
            l.align_to(64).expect("64 is a power of two")
        } else {
            l
        }
    }
}

// SAFETY: every call forwards to `System` with `LineAligned::layout` of the caller's layout, which has the
// caller's size and at least its alignment, and `dealloc`/`realloc` map the layout the same way `alloc` did.
unsafe impl std::alloc::GlobalAlloc for LineAligned {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        unsafe { std::alloc::System.alloc(Self::layout(l)) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        unsafe { std::alloc::System.alloc_zeroed(Self::layout(l)) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, Self::layout(l)) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let old = Self::layout(l);
        // SAFETY: `new_size` with `l`'s alignment is a valid layout (the caller's contract)
        let new = Self::layout(unsafe {
            std::alloc::Layout::from_size_align_unchecked(new_size, l.align())
        });
        if old.align() == new.align() {
            // the system allocator keeps the alignment it was given
            return unsafe { std::alloc::System.realloc(p, old, new_size) };
        }
        // crossing the threshold: a new block with the new alignment
        let q = unsafe { std::alloc::System.alloc(new) };
        if !q.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                std::alloc::System.dealloc(p, old);
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    #[test]
    fn large_blocks_start_on_a_line_and_keep_their_bytes_across_realloc() {
        let a = LineAligned;
        let small = Layout::from_size_align(100, 4).expect("valid");
        let large = Layout::from_size_align(LINE_ALIGNED_BYTES, 4).expect("valid");
        unsafe {
            let p = a.alloc(large);
            assert!(!p.is_null());
            assert_eq!(p as usize % 64, 0);
            p.write_bytes(7, large.size());
            // shrinking below the threshold, then growing past it again, keeps the bytes
            let q = a.realloc(p, large, 100);
            assert!(!q.is_null());
            assert!((0..100).all(|i| *q.add(i) == 7));
            let r = a.realloc(q, small, 3 * LINE_ALIGNED_BYTES);
            assert!(!r.is_null());
            assert_eq!(r as usize % 64, 0);
            assert!((0..100).all(|i| *r.add(i) == 7));
            let r2 = a.realloc(
                r,
                Layout::from_size_align(3 * LINE_ALIGNED_BYTES, 4).expect("valid"),
                2 * LINE_ALIGNED_BYTES,
            );
            assert_eq!(r2 as usize % 64, 0);
            assert!((0..100).all(|i| *r2.add(i) == 7));
            a.dealloc(
                r2,
                Layout::from_size_align(2 * LINE_ALIGNED_BYTES, 4).expect("valid"),
            );
            let z = a.alloc_zeroed(large);
            assert_eq!(z as usize % 64, 0);
            assert!((0..large.size()).step_by(4093).all(|i| *z.add(i) == 0));
            a.dealloc(z, large);
        }
    }
}
