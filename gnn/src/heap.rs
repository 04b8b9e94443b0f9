//! The binaries' allocator ([`LineAligned`]) and handing freed pages back to the OS at the few points where a
//! large buffer is gone for good.
//!
//! The binaries tell glibc to serve large buffers from the heap and never trim it, so every epoch reuses the
//! previous epoch's pages instead of faulting them in again. The price is that a buffer freed for good (the
//! input features once `A X` is cached) stays resident as a hole the next, larger buffer does not fit in:
//! the hole and the buffer placed above it are both counted in the peak. Trimming right after such a free
//! returns the hole's pages; later allocations that land in it fault them back in as they are written.
//!
//! Buffers of 1 MiB and more (an n x hidden activation is a GiB at a million nodes, an n x classes one 64 MB,
//! a halo message a few MiB) bypass the heap altogether:
//! [`LineAligned`] maps each one on its own and keeps a freed one for the next request of its size (an epoch
//! asks for the same shapes as the last), so epochs still reuse resident pages, but a hole can no longer
//! strand a GiB below the heap's top. With them in the heap, the evaluation pass after the last epoch, which
//! frees and allocates in another order, raised a GCN run's peak at 1M nodes from 2.2 to 3.1-4.0 GiB, by run,
//! and n x classes buffers (64 MB, first left in the heap) still added 0.4-0.6 GiB to GraphSAGE's (issue 34).
//!
//! The threshold was 16 MiB until issue 31 measured a worker: two allocators that each keep what they
//! freed keep each one's own high-water mark resident, so the process's peak is the sum of the two peaks
//! even when they never coincide. A partition worker's exchange buffers (halo messages of 1-16 MiB, their
//! encoded and decoded copies) grew glibc's heap to 200-250 MiB with 27-57 MiB of it in use, beside the
//! large blocks' own 484 MiB peak (SBM 1M, 4 workers, GraphSAGE: 700-750 MiB a worker). With every block of
//! 1 MiB or more here, the kept blocks stay under one peak, the heap under 15 MiB, and the worker's peak
//! fell to 570-600 MiB, epochs no slower (bench/RESULTS.md).

/// Returns the heap's free pages to the OS (glibc's `malloc_trim`, which also releases whole free pages in
/// the middle of the heap), and the freed large blocks [`LineAligned`] keeps for reuse. A no-op where the
/// allocator is not glibc's.
pub fn release_freed_memory() {
    big::flush();
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

/// Drops `v` and, if [`LineAligned`] mapped it alone (a block of 1 MiB or more), hands its pages back to the
/// OS at once instead of keeping the block for the next request of its size: for a buffer nothing asks for
/// again before the peak it would otherwise add to.
pub fn drop_now<T>(v: Vec<T>) {
    big::UNKEPT.with(|u| u.set(true));
    drop(v);
    big::UNKEPT.with(|u| u.set(false));
}

/// A global allocator that forwards to the system's and counts the bytes live and the most live at once,
/// for measuring what a phase allocates (`examples/live_bytes.rs`, `tests/first_layer_memory.rs`):
/// `#[global_allocator] static A: physalia_gnn::heap::Counting = physalia_gnn::heap::Counting;`, then
/// [`Counting::live`], [`Counting::peak`] and [`Counting::reset_peak`].
pub struct Counting;

static COUNTED_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static COUNTED_PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Counting {
    /// Bytes allocated and not yet freed.
    pub fn live() -> usize {
        COUNTED_LIVE.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// The most bytes live at once since the last [`Counting::reset_peak`].
    pub fn peak() -> usize {
        COUNTED_PEAK.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Starts a new peak from the bytes live now.
    pub fn reset_peak() {
        COUNTED_PEAK.store(Self::live(), std::sync::atomic::Ordering::Relaxed);
    }
    fn grew(by: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = COUNTED_LIVE.fetch_add(by, Relaxed) + by;
        COUNTED_PEAK.fetch_max(now, Relaxed);
    }
    fn shrank(by: usize) {
        COUNTED_LIVE.fetch_sub(by, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` unchanged; the counters are only counted.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        Self::grew(l.size());
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        Self::grew(l.size());
        unsafe { std::alloc::System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, l) };
        Self::shrank(l.size());
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        if n > l.size() {
            Self::grew(n - l.size());
        } else {
            Self::shrank(l.size() - n);
        }
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

/// A global allocator that starts every allocation of [`LINE_ALIGNED_BYTES`] or more on a 64-byte cache
/// line, asks for transparent huge pages under every allocation of [`HUGE_PAGE_BYTES`] or more, and leaves
/// smaller ones to the system allocator as they are.
///
/// glibc's malloc aligns to 16 bytes, so a matrix's rows usually start mid-line: a gathered row of a
/// width-16 matrix (64 bytes, the width every epoch's SpMM runs at for 16 classes) then spans two lines, and
/// random gathers fetch twice the bytes they use.
///
/// SpMM gathers rows at random from a matrix of hundreds of MiB: on 4 KiB pages nearly every gathered row
/// misses the TLB and waits for a page walk (two-dimensional, so several memory reads, in a virtual
/// machine), and page walks, not DRAM, set the kernel's rate (issue 34: the same kernel ran 1.5-2x faster on
/// 2 MiB pages). Where the kernel's THP mode is `madvise` (Debian's and Ubuntu's default) nothing gets huge
/// pages unless asked, so large blocks are advised with `MADV_HUGEPAGE` as they are handed out; pages
/// already resident (a reused heap block) stay as they are until the kernel's khugepaged collapses them.
/// `PHYSALIA_HUGE_PAGES=0` turns the advice off.
///
/// A binary opts in with
/// `#[global_allocator] static A: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;`
/// (`examples/kernels.rs` measures both effects on SpMM).
pub struct LineAligned;

/// Allocations from this size up are advised to use transparent huge pages by [`LineAligned`] (the 2 MiB
/// pages inside them; a smaller block has at most one).
pub const HUGE_PAGE_BYTES: usize = 4 << 20;

/// Advises the kernel to back the whole 2 MiB pages inside `len` bytes at `p` with transparent huge pages
/// (`on`), or never to (`!on`). Only a hint: an error (no THP in this kernel, a range it refuses) changes
/// nothing, and pages already resident keep their size until khugepaged collapses them.
pub fn advise_huge_pages(p: *const u8, len: usize, on: bool) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (p as usize).next_multiple_of(HUGE);
        let end = (p as usize + len) & !(HUGE - 1);
        if end > start {
            unsafe extern "C" {
                fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
            }
            const MADV_HUGEPAGE: i32 = 14;
            const MADV_NOHUGEPAGE: i32 = 15;
            let advice = if on { MADV_HUGEPAGE } else { MADV_NOHUGEPAGE };
            // SAFETY: advice on whole pages inside one live allocation; neither advice changes its contents.
            unsafe { madvise(start as *mut u8, end - start, advice) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len, on);
}

/// Whether [`LineAligned`] advises huge pages (read once: `PHYSALIA_HUGE_PAGES=0` turns it off).
fn huge_pages_wanted() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0 unknown, 1 off, 2 on; an allocator cannot use OnceLock's allocation-free guarantee knowingly, so a
    // plain atomic (a race only reads the environment twice)
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            // std::env::var_os allocates; the allocator may re-enter only for small blocks, below the
            // threshold, which never reach this function
            let on = std::env::var_os("PHYSALIA_HUGE_PAGES").is_none_or(|v| v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Advises huge pages over the whole mapping (`len` bytes at `p`) of a `big` block of `size` bytes, if it is
/// [`HUGE_PAGE_BYTES`] or more. The whole mapping, not the pages inside `size`: advice on part of it would
/// split the mapping in two, and `mremap` (growing a block) refuses a range across mappings. Smaller blocks
/// (a halo message of a few MiB) get none: the huge page over a block's tail would make all of it resident
/// for a block that gains little from it.
fn advise_mapped(p: *mut u8, size: usize, len: usize) {
    if size >= HUGE_PAGE_BYTES && huge_pages_wanted() {
        advise_huge_pages(p, len, true);
    }
}

/// Advises huge pages under a block [`LineAligned`] just handed out, if it is large enough.
fn advise_block(p: *mut u8, size: usize) {
    if !p.is_null() && size >= HUGE_PAGE_BYTES && huge_pages_wanted() {
        advise_huge_pages(p, size, true);
    }
}

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
// Blocks of [`big::BYTES`] and more (page alignment at most) are `big`'s, by size alone, so `dealloc` and
// `realloc` route a block where `alloc` got it.
unsafe impl std::alloc::GlobalAlloc for LineAligned {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if big::serves(l.size(), l.align()) {
            return big::alloc(l.size(), false);
        }
        let p = unsafe { std::alloc::System.alloc(Self::layout(l)) };
        advise_block(p, l.size());
        p
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        if big::serves(l.size(), l.align()) {
            return big::alloc(l.size(), true);
        }
        // calloc leaves fresh pages untouched (they are zero), so the advice still applies to them
        let p = unsafe { std::alloc::System.alloc_zeroed(Self::layout(l)) };
        advise_block(p, l.size());
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        if big::serves(l.size(), l.align()) {
            return unsafe { big::dealloc(p, l.size()) };
        }
        unsafe { std::alloc::System.dealloc(p, Self::layout(l)) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let (was_big, is_big) = (
            big::serves(l.size(), l.align()),
            big::serves(new_size, l.align()),
        );
        if was_big && is_big {
            return unsafe { big::realloc(p, l.size(), new_size) };
        }
        if was_big || is_big {
            // across the threshold: a block of the other kind, the bytes copied over
            // SAFETY: `new_size` with `l`'s alignment is a valid layout (the caller's contract)
            let new = unsafe { std::alloc::Layout::from_size_align_unchecked(new_size, l.align()) };
            let q = unsafe { self.alloc(new) };
            if !q.is_null() {
                unsafe {
                    std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                    self.dealloc(p, l);
                }
            }
            return q;
        }
        let old = Self::layout(l);
        // SAFETY: `new_size` with `l`'s alignment is a valid layout (the caller's contract)
        let new = Self::layout(unsafe {
            std::alloc::Layout::from_size_align_unchecked(new_size, l.align())
        });
        if old.align() == new.align() {
            // the system allocator keeps the alignment it was given
            let q = unsafe { std::alloc::System.realloc(p, old, new_size) };
            advise_block(q, new_size);
            return q;
        }
        // crossing the threshold: a new block with the new alignment
        let q = unsafe { std::alloc::System.alloc(new) };
        advise_block(q, new_size);
        if !q.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                std::alloc::System.dealloc(p, old);
            }
        }
        q
    }
}

/// [`LineAligned`]'s blocks of `big::BYTES` and more: each its own mapping (on a 2 MiB boundary, advised
/// onto huge pages), and a few freed ones kept for the next request of their size.
mod big {
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Blocks from this size up are mapped on their own.
    pub const BYTES: usize = 1 << 20;

    thread_local! {
        /// Set by [`super::drop_now`]: a block freed on this thread now is unmapped, not kept.
        pub static UNKEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    /// Freed blocks kept at most.
    const SLOTS: usize = 64;
    /// Bytes mapped for blocks, live and kept.
    static MAPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    /// The most bytes of blocks ever live at once (mapped lengths).
    static PEAK_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    const HUGE: usize = 2 << 20;

    /// Freed blocks (address, mapped length; 0 = empty), behind a spin lock: they change hands a few times an
    /// epoch, so the lock is never contended for long, and an allocator cannot use `Mutex`'s lazy
    /// allocation knowingly.
    struct Cache {
        locked: AtomicBool,
        slots: std::cell::UnsafeCell<[(usize, usize); SLOTS]>,
    }

    // SAFETY: `slots` is only touched while `locked` is held (see `with`).
    unsafe impl Sync for Cache {}

    static CACHE: Cache = Cache {
        locked: AtomicBool::new(false),
        slots: std::cell::UnsafeCell::new([(0, 0); SLOTS]),
    };

    fn with<T>(f: impl FnOnce(&mut [(usize, usize); SLOTS]) -> T) -> T {
        while CACHE
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        // SAFETY: the lock is held until the store below.
        let r = f(unsafe { &mut *CACHE.slots.get() });
        CACHE.locked.store(false, Ordering::Release);
        r
    }

    #[cfg(target_os = "linux")]
    unsafe extern "C" {
        fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
        fn munmap(addr: *mut u8, len: usize) -> i32;
        fn mremap(old: *mut u8, old_len: usize, new_len: usize, flags: i32, ...) -> *mut u8;
    }
    // elsewhere `serves` is false and nothing here runs; these keep the calls linkable
    #[cfg(not(target_os = "linux"))]
    unsafe fn mmap(_: *mut u8, _: usize, _: i32, _: i32, _: i32, _: i64) -> *mut u8 {
        MAP_FAILED
    }
    #[cfg(not(target_os = "linux"))]
    unsafe fn munmap(_: *mut u8, _: usize) -> i32 {
        -1
    }
    #[cfg(not(target_os = "linux"))]
    unsafe fn mremap(_: *mut u8, _: usize, _: usize, _: i32) -> *mut u8 {
        MAP_FAILED
    }
    const PROT_READ_WRITE: i32 = 0x1 | 0x2;
    const MAP_PRIVATE_ANONYMOUS: i32 = 0x02 | 0x20;
    const MAP_FAILED: *mut u8 = !0usize as *mut u8;
    const MREMAP_MAYMOVE: i32 = 1;

    /// Whether a block of `size` bytes aligned to `align` is this module's (Linux only: elsewhere every block
    /// stays the system allocator's).
    pub fn serves(size: usize, align: usize) -> bool {
        cfg!(target_os = "linux") && size >= BYTES && align <= 4096
    }

    /// The mapped length of a block of `size` bytes: whole huge pages.
    fn mapped(size: usize) -> usize {
        size.next_multiple_of(HUGE)
    }

    /// A block of `size` bytes: a kept one of its mapped length (whole 2 MiB pages; exactly, since a block's
    /// length is known again only from the size it is freed with), else a new mapping (and then kept ones go
    /// back to the OS, largest first, as far as the mapped total would otherwise pass the most bytes ever
    /// live at once: kept blocks never add to the peak). Null when the OS refuses.
    pub fn alloc(size: usize, zeroed: bool) -> *mut u8 {
        let len = mapped(size);
        let (hit, stale) = with(|slots| {
            let kept: usize = slots.iter().map(|s| s.1).sum();
            let live = MAPPED.load(Ordering::Relaxed).saturating_sub(kept);
            PEAK_LIVE.fetch_max(live + len, Ordering::Relaxed);
            let best = slots.iter().position(|&(p, l)| p != 0 && l == len);
            match best {
                Some(i) => (Some(std::mem::take(&mut slots[i])), [(0, 0); SLOTS]),
                None => {
                    // kept blocks go back, largest first, only as far as the mapped total would pass
                    // the most ever live at once: a kept block then never adds to the peak, and the
                    // epoch's other blocks stay resident (handing them all back made every epoch of a
                    // GAT fault its buffers in again, 0.4-0.8 s of system time at 1M nodes: issue 34)
                    let limit = PEAK_LIVE.load(Ordering::Relaxed);
                    let mut total = live + kept + len;
                    let mut stale = [(0, 0); SLOTS];
                    while total > limit {
                        let Some(i) = (0..SLOTS)
                            .filter(|&i| slots[i].0 != 0)
                            .max_by_key(|&i| slots[i].1)
                        else {
                            break;
                        };
                        total -= slots[i].1;
                        stale[i] = std::mem::take(&mut slots[i]);
                    }
                    (None, stale)
                }
            }
        });
        if let Some((p, _)) = hit {
            let p = p as *mut u8;
            if zeroed {
                // SAFETY: the kept block is at least `size` bytes and no one else's.
                unsafe { p.write_bytes(0, size) };
            }
            return p;
        }
        unmap_all(&stale);
        // a fresh mapping is zero; on a 2 MiB boundary so every page of it can be a huge page
        // SAFETY: an anonymous private mapping of our own; the trimmed ends are unmapped within it.
        unsafe {
            let raw = mmap(
                std::ptr::null_mut(),
                len + HUGE,
                PROT_READ_WRITE,
                MAP_PRIVATE_ANONYMOUS,
                -1,
                0,
            );
            if raw == MAP_FAILED {
                return std::ptr::null_mut();
            }
            let p = (raw as usize).next_multiple_of(HUGE) as *mut u8;
            let head = p as usize - raw as usize;
            if head > 0 {
                munmap(raw, head);
            }
            munmap(p.add(len), HUGE - head);
            MAPPED.fetch_add(len, Ordering::Relaxed);
            super::advise_mapped(p, size, len);
            p
        }
    }

    /// Keeps the freed block `p` of `size` bytes for reuse, or unmaps it when every slot is taken.
    ///
    /// # Safety
    /// `p` is a block of `size` bytes from [`alloc`] (or [`realloc`]), freed by its owner.
    pub unsafe fn dealloc(p: *mut u8, size: usize) {
        let len = mapped(size);
        // (a thread being torn down keeps its blocks)
        let unkept = UNKEPT.try_with(|u| u.get()).unwrap_or(false);
        let kept = !unkept
            && with(|slots| match slots.iter_mut().find(|s| s.0 == 0) {
                Some(s) => {
                    *s = (p as usize, len);
                    true
                }
                None => false,
            });
        if !kept {
            // SAFETY: our mapping, no longer used.
            unsafe { munmap(p, len) };
            MAPPED.fetch_sub(len, Ordering::Relaxed);
        }
    }

    /// Resizes a block in place or moves it (the kernel remaps its pages; nothing is copied).
    ///
    /// # Safety
    /// As [`dealloc`], for a block still in use.
    pub unsafe fn realloc(p: *mut u8, size: usize, new_size: usize) -> *mut u8 {
        let (old, new) = (mapped(size), mapped(new_size));
        if old == new {
            return p;
        }
        // SAFETY: our mapping; the kernel keeps its bytes up to the smaller length.
        let q = unsafe { mremap(p, old, new, MREMAP_MAYMOVE) };
        if q == MAP_FAILED {
            return std::ptr::null_mut();
        }
        MAPPED.fetch_add(new, Ordering::Relaxed);
        MAPPED.fetch_sub(old, Ordering::Relaxed);
        super::advise_mapped(q, new_size, new);
        q
    }

    fn unmap_all(blocks: &[(usize, usize)]) {
        for &(p, l) in blocks {
            if p != 0 {
                // SAFETY: a kept block: ours, unused.
                unsafe { munmap(p as *mut u8, l) };
                MAPPED.fetch_sub(l, Ordering::Relaxed);
            }
        }
    }

    /// Unmaps every kept block.
    pub fn flush() {
        let stale = with(|slots| std::mem::replace(slots, [(0, 0); SLOTS]));
        unmap_all(&stale);
    }

    /// The blocks kept now (for tests).
    #[cfg(test)]
    pub fn kept() -> Vec<(usize, usize)> {
        with(|slots| slots.iter().copied().filter(|s| s.0 != 0).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    /// The tests share `big`'s cache of kept blocks (every block of 1 MiB or more is its), so they take
    /// turns: one test's kept blocks would otherwise show up in another's.
    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        TURN.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `VmFlags` of the mapping that holds address `p` (`/proc/self/smaps`), if this system has them.
    fn vm_flags(p: usize) -> Option<Vec<String>> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&p);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.split_whitespace().map(String::from).collect());
            }
        }
        None
    }

    #[test]
    fn large_blocks_are_advised_onto_huge_pages_and_the_advice_can_be_withdrawn() {
        let _turn = one_at_a_time();
        // a kernel without transparent huge pages refuses the advice; nothing to check there
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
            || std::env::var_os("PHYSALIA_HUGE_PAGES").is_some()
        {
            return;
        }
        let a = LineAligned;
        let large = Layout::from_size_align(2 * HUGE_PAGE_BYTES, 4).expect("valid");
        unsafe {
            for zeroed in [false, true] {
                let p = if zeroed {
                    a.alloc_zeroed(large)
                } else {
                    a.alloc(large)
                };
                assert!(!p.is_null());
                // a 2 MiB page inside the block: advised (`hg`), whatever page size backs it yet
                let inside = (p as usize).next_multiple_of(2 << 20);
                let flags = vm_flags(inside).expect("the block is mapped");
                assert!(
                    flags.iter().any(|f| f == "hg"),
                    "no huge-page advice on a block of {} bytes (zeroed: {zeroed}): {flags:?}",
                    large.size()
                );
                a.dealloc(p, large);
            }
            // turned off for one range, as the base of `examples/kernels.rs` is
            let p = a.alloc(large);
            let inside = (p as usize).next_multiple_of(2 << 20);
            advise_huge_pages(p, large.size(), false);
            let flags = vm_flags(inside).expect("the block is mapped");
            assert!(flags.iter().any(|f| f == "nh"), "{flags:?}");
            a.dealloc(p, large);
        }
    }

    #[test]
    fn large_blocks_start_on_a_line_and_keep_their_bytes_across_realloc() {
        let _turn = one_at_a_time();
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

    /// A halo message of a few MiB is `big`'s, not glibc's: freed, it is kept under the one high-water mark
    /// instead of growing glibc's heap beside it (issue 31: a worker's peak was the two allocators' peaks
    /// added up).
    #[test]
    fn blocks_of_a_mebibyte_and_more_are_mapped_alone() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let _turn = one_at_a_time();
        release_freed_memory();
        let a = LineAligned;
        unsafe {
            for (size, alone) in [(3 << 20, true), (1 << 20, true), ((1 << 20) - 1, false)] {
                let l = Layout::from_size_align(size, 8).expect("valid");
                let p = a.alloc(l);
                assert!(!p.is_null());
                p.write_bytes(1, size);
                a.dealloc(p, l);
                let kept = big::kept().iter().any(|&(q, _)| q == p as usize);
                assert_eq!(kept, alone, "a block of {size} bytes");
            }
        }
        release_freed_memory();
    }

    #[test]
    fn the_largest_blocks_are_mapped_alone_and_a_freed_one_serves_the_next_request_of_its_size() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let _turn = one_at_a_time();
        release_freed_memory();
        let a = LineAligned;
        // sizes well above the threshold, whose mapped lengths (whole 2 MiB pages) all differ
        const M: usize = 16 << 20;
        const { assert!(M >= big::BYTES) };
        let size = M + 12345;
        let l = Layout::from_size_align(size, 64).expect("valid");
        unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null());
            assert_eq!(p as usize % (2 << 20), 0, "on a huge page boundary");
            p.write_bytes(3, size);
            a.dealloc(p, l);
            assert!(big::kept().iter().any(|&(q, _)| q == p as usize));
            // the same size again: the kept block, zeroed when asked
            let z = a.alloc_zeroed(l);
            assert_eq!(z, p);
            assert!((0..size).step_by(4093).all(|i| *z.add(i) == 0));
            // growing moves the pages, never the bytes; shrinking below the threshold copies them
            z.write_bytes(5, size);
            let g = a.realloc(z, l, 2 * M);
            assert!(!g.is_null());
            assert!((0..size).step_by(4093).all(|i| *g.add(i) == 5));
            let gl = Layout::from_size_align(2 * M, 64).expect("valid");
            let s = a.realloc(g, gl, 1000);
            assert!((0..1000).all(|i| *s.add(i) == 5));
            a.dealloc(s, Layout::from_size_align(1000, 64).expect("valid"));
            let kept = big::kept();
            assert_eq!(kept.len(), 1, "the block shrunk out of is kept: {kept:?}");
            // a freed block serves no request of another size
            let q = a.alloc(gl);
            assert_eq!(q as usize, kept[0].0);
            a.dealloc(q, gl);
            let r = a.alloc(l);
            assert_ne!(r, q);
            a.dealloc(r, l);
            release_freed_memory();
            assert!(big::kept().is_empty());
            // a miss hands kept blocks back, largest first, only as far as the mapped total would pass
            // the most ever live: three blocks live at once (32 + 18 + 20 MiB), all freed, then a fourth
            // size (22 MiB) costs the largest kept block only
            let third = Layout::from_size_align(M + (4 << 20), 64).expect("valid");
            let fourth = Layout::from_size_align(M + (6 << 20), 64).expect("valid");
            let (b1, b2, b3) = (a.alloc(gl), a.alloc(l), a.alloc(third));
            a.dealloc(b1, gl);
            a.dealloc(b2, l);
            a.dealloc(b3, third);
            let b4 = a.alloc(fourth);
            let kept: Vec<usize> = big::kept().iter().map(|k| k.0).collect();
            assert!(
                !kept.contains(&(b1 as usize)),
                "the largest went back: {kept:?}"
            );
            assert!(
                kept.contains(&(b2 as usize)) && kept.contains(&(b3 as usize)),
                "{kept:?}"
            );
            a.dealloc(b4, fourth);
            release_freed_memory();
            assert!(big::kept().is_empty());
        }
    }
}
