//! An allocator for the pool's large tables that asks Linux for transparent huge pages.
//!
//! The prefix-cache index of a 131072-block pool spans tens of megabytes and is probed at
//! random, so with 4 KiB pages nearly every probe also misses the TLB. Allocations of at least
//! 2 MiB are aligned to 2 MiB and advised `MADV_HUGEPAGE` (which kernels set to `madvise`
//! honour); smaller ones, and other systems, use the global allocator unchanged.

use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global, Layout};

/// Size and alignment of a huge page.
const HUGE: usize = 2 << 20;

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct HugePages;

/// The layout actually requested from the global allocator for `layout`: the same function of
/// the layout on allocation and deallocation, as [`Allocator`] requires.
fn backing(layout: Layout) -> Result<Layout, AllocError> {
    if layout.size() < HUGE {
        return Ok(layout);
    }
    Layout::from_size_align(layout.size(), layout.align().max(HUGE)).map_err(|_| AllocError)
}

/// Allocates `layout`'s backing layout with `alloc`, advising huge pages when it is large.
fn with_advice(
    layout: Layout,
    alloc: impl FnOnce(Layout) -> Result<NonNull<[u8]>, AllocError>,
) -> Result<NonNull<[u8]>, AllocError> {
    let real = backing(layout)?;
    let block = alloc(real)?;
    if real.size() >= HUGE {
        advise(block);
    }
    Ok(block)
}

#[cfg(target_os = "linux")]
fn advise(block: NonNull<[u8]>) {
    #[allow(unsafe_code)]
    // SAFETY: the range is exactly the allocation just returned by the global allocator, which
    // this allocator owns until it is deallocated. MADV_HUGEPAGE changes only how the kernel
    // backs the pages, never their contents or validity; a failure leaves 4 KiB pages, so the
    // result is ignored.
    unsafe {
        libc::madvise(
            block.as_ptr().cast::<libc::c_void>(),
            block.len(),
            libc::MADV_HUGEPAGE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_block: NonNull<[u8]>) {}

/// This machine's physical memory in bytes, where the system says (Linux).
#[cfg(target_os = "linux")]
pub(crate) fn physical_memory() -> Option<u64> {
    #[allow(unsafe_code)]
    // SAFETY: `sysconf` takes no pointers and only reads system configuration; it is safe to
    // call from any thread. A failure returns -1, handled below.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let pages = u64::try_from(pages).ok().filter(|&p| p > 0)?;
    let page_size = u64::try_from(page_size).ok().filter(|&p| p > 0)?;
    Some(pages.saturating_mul(page_size))
}

/// This machine's physical memory in bytes: unknown here.
#[cfg(not(target_os = "linux"))]
pub(crate) fn physical_memory() -> Option<u64> {
    None
}

#[allow(unsafe_code)]
// SAFETY: every method forwards to `Global` with the layout from `backing`, a pure function of
// the caller's layout, so a block is always freed (or resized) with the layout it was
// allocated with; `backing` only raises the alignment, so the returned blocks satisfy the
// caller's layout. Growing and shrinking use the trait's default implementations, which are
// built on `allocate` and `deallocate`.
unsafe impl Allocator for HugePages {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        with_advice(layout, |real| Global.allocate(real))
    }

    fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        with_advice(layout, |real| Global.allocate_zeroed(real))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // `backing(layout)` succeeded when this block was allocated with `layout`.
        if let Ok(real) = backing(layout) {
            // SAFETY: `ptr` was allocated by `Global` with `real` (see the impl's comment).
            unsafe { Global.deallocate(ptr, real) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_round_trip() {
        for size in [8usize, 4096, HUGE, 3 * HUGE + 17] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            let block = HugePages.allocate_zeroed(layout).unwrap();
            assert!(block.len() >= size);
            if size >= HUGE {
                assert_eq!(block.cast::<u8>().as_ptr() as usize % HUGE, 0);
            }
            #[allow(unsafe_code)]
            // SAFETY: allocated just above with `layout`, zeroed, `size` bytes long.
            unsafe {
                let p = block.cast::<u8>().as_ptr();
                assert_eq!(*p.add(size - 1), 0);
                *p.add(size - 1) = 7;
                HugePages.deallocate(block.cast(), layout);
            }
        }
    }

    #[test]
    fn physical_memory_is_known_on_linux() {
        let mem = physical_memory();
        assert_eq!(mem.is_some(), cfg!(target_os = "linux"));
        if let Some(m) = mem {
            assert!(m >= 1 << 20, "{m} bytes");
        }
    }

    #[test]
    fn a_map_grows_past_the_threshold() {
        let mut m: hashbrown::HashMap<u64, [u64; 4], hashbrown::DefaultHashBuilder, HugePages> =
            hashbrown::HashMap::with_hasher_in(Default::default(), HugePages);
        for i in 0..200_000u64 {
            m.insert(i, [i; 4]);
        }
        assert!((0..200_000u64).all(|i| m[&i][3] == i));
        m.clear();
        m.shrink_to_fit();
        assert!(m.is_empty());
    }
}
