//! Cache prefetch hints.
//!
//! The batch calls walk thousands of requests whose state is rarely cached between scheduler
//! steps; asking for the next requests' lines a few iterations ahead lets those memory loads
//! overlap instead of stalling one after another.
//!
//! An address in the first page (null, or a small offset from it: an address not known) is
//! not prefetched: nothing is mapped there, and a prefetch of an unmapped address walks the
//! page tables for nothing, which on a virtual machine costs as much as a miss to memory.

/// Hints the CPU to bring the two cache lines starting at `addr` into the cache. A hint only:
/// it has no effect on the program's behaviour, whatever the address.
#[inline(always)]
pub fn prefetch<T>(addr: *const T) {
    if unmapped(addr) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch` never faults and has no architecturally visible effect for any
    // address (valid, dangling or null); nothing is dereferenced. SSE is part of the x86_64
    // baseline, so the instruction is always available.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = addr.cast::<i8>();
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p.wrapping_add(64), _MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Hints the CPU to bring the one cache line holding `addr` into the cache (for a small
/// object or field that lies within one line). A hint only, as [`prefetch`].
#[inline(always)]
pub fn prefetch_line<T>(addr: *const T) {
    if unmapped(addr) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: as `prefetch`: the instruction never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch(addr.cast::<i8>(), _MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Whether `addr` lies in the first page, which nothing maps.
#[inline(always)]
fn unmapped<T>(addr: *const T) -> bool {
    (addr as usize) < 4096
}

/// [`prefetch`] for the `lines` cache lines (64 bytes each, rounded up to pairs) starting at
/// `addr`.
#[inline(always)]
pub fn prefetch_lines<T>(addr: *const T, lines: usize) {
    let p = addr.cast::<u8>();
    for k in (0..lines).step_by(2) {
        prefetch(p.wrapping_add(64 * k));
    }
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    #[test]
    fn any_address_is_fine() {
        let v = [1u64, 2, 3];
        prefetch(v.as_ptr());
        prefetch(std::ptr::null::<u8>());
        super::prefetch_line(usize::MAX as *const u8);
        prefetch(usize::MAX as *const u8);
        super::prefetch_lines(v.as_ptr(), 4);
        assert_eq!(v, [1, 2, 3]);
    }
}
